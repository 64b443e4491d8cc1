"""llama-server's slot routes over this server's one KV pool.

    GET  /slots                                   -> [{"id", "id_task", "n_ctx", "is_processing", ...}] per slot
    POST /slots/{id}?action=save    {"filename"}  -> {"id_slot", "filename", "n_saved", "n_written", "timings"}
    POST /slots/{id}?action=restore {"filename"}  -> {"id_slot", "filename", "n_restored", "n_read", "timings"}
    POST /slots/{id}?action=erase                 -> {"id_slot", "n_erased"}

What a slot is here: -np N reports N slots, but one engine worker and one KV pool serve them
in turn, so every slot id names that pool (what one slot saves, any slot restores; erasing one
empties the pool). Save and restore are the persistent KV files of kvcache/persist.py in the
--slot-save-path folder: the file name must be 1-60 characters of A-Z, a-z, 0-9, '_', '-'
(a ".bin" suffix, llama.cpp's habit, is accepted and dropped), so a path is always
<folder>/<name>.kv - never a separator, '..' or an absolute path (persist.py checks the
resolved path stays in the folder too). A file written by another model or KV layout is refused
(400), as persist.py validates every file it reads. The work runs on the engine's thread, in
the queue like a request.

Deliberately not here: several KV pools, or saving anything but the pool's positions and ids.
"""
from __future__ import annotations

import asyncio
import re
import time

from starlette.requests import Request
from starlette.responses import Response

from . import schemas
from .errors import ApiError, JSONResp, api_error, bad_request, endpoint
from .state import ServerState
from .streaming import read_json
from .worker import Job, QueueFull, ShuttingDown

_FILENAME = re.compile(r"([A-Za-z0-9_-]{1,60})(\.bin)?")
STORE_BUDGET = 1 << 60          # slot files are never evicted: the user names and removes them


def _slot_id(request: Request, st: ServerState) -> int:
    raw = request.path_params["id_slot"]
    if not raw.isdigit() or not 0 <= int(raw) < st.settings.n_parallel:
        raise bad_request(f"slot id {raw[:20]!r} is invalid: this server has slots 0..{st.settings.n_parallel - 1}")
    return int(raw)


def _not_supported() -> ApiError:
    return ApiError(501, "This server does not support slots endpoint.", "not_supported_error")


@endpoint
async def list_slots(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    if not st.settings.slots_endpoint:
        raise _not_supported()
    busy = bool(st.worker is not None and st.worker.n_processing)
    n_kv = len(getattr(engine, "kv_tokens", ()) or ())
    out = []
    for i in range(st.settings.n_parallel):
        out.append({"id": i, "id_task": -1, "n_ctx": engine.n_ctx, "speculative": False,
                    "is_processing": busy and i == 0, "n_cached": n_kv,
                    "next_token": [{"has_next_token": busy and i == 0, "has_new_line": False, "n_remain": -1,
                                    "n_decoded": 0}]})
    return JSONResp(out)


def _store(st: ServerState):
    store = getattr(st, "_slot_store", None)
    if store is None:
        from genie_rt.kvcache.persist import KVStore
        store = st._slot_store = KVStore(st.settings.slot_save_path, budget_bytes=STORE_BUDGET)
    return store


def _file_id(body: dict) -> tuple[str, str]:
    name = schemas.get_str(body, "filename", None)
    if not name:
        raise bad_request("'filename' is required")
    m = _FILENAME.fullmatch(name)
    if m is None:
        raise bad_request(f"'filename' {schemas._show(name)} is invalid: use 1-60 characters of A-Z, a-z, 0-9, "
                          "'_' and '-' (an optional '.bin' suffix is dropped)")
    return name, m.group(1)


async def _run_on_engine(request: Request, st: ServerState, task):
    job = Job(task, asyncio.get_running_loop())
    try:
        st.worker.submit(job)
    except (QueueFull, ShuttingDown) as exc:
        raise api_error(exc, st.settings.retry_after_s) from None
    try:
        return await job.result()
    except asyncio.CancelledError:
        st.worker.cancel(job)
        raise


def _save(store, cid: str):
    def task(engine):
        t0 = time.perf_counter()
        n = len(engine.kv_tokens)
        if n == 0:
            raise ApiError(400, "the slot is empty: nothing to save")
        if not store.save(engine, cid):
            raise ApiError(500, "the slot could not be written (see the server log)")
        size = store.path_for(cid).stat().st_size
        return n, size, (time.perf_counter() - t0) * 1000
    return task


def _restore(store, cid: str):
    def task(engine):
        t0 = time.perf_counter()
        meta, verdict = store.inspect(cid)
        if meta is None or not verdict.startswith("ok"):
            raise ApiError(400 if meta is not None else 404, f"slot file {cid!r}: {verdict}")
        tokens = [int(t) for t in meta.tokens]
        if len(tokens) >= engine.n_ctx:
            raise ApiError(400, f"slot file {cid!r} holds {len(tokens)} tokens; the context is {engine.n_ctx}")
        n = store.restore(engine, cid, tokens + [0], 0)
        if n != len(tokens):
            raise ApiError(400, f"slot file {cid!r} was not restored: it does not match this model "
                                "or KV layout (see the server log)")
        size = store.path_for(cid).stat().st_size
        return n, size, (time.perf_counter() - t0) * 1000
    return task


def _erase(engine):
    n = len(engine.kv_tokens)
    engine.kv_tokens = []
    return n


@endpoint
async def slot_action(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    id_slot = _slot_id(request, st)
    action = request.query_params.get("action", "")
    if action == "erase":
        n = await _run_on_engine(request, st, _erase)
        return JSONResp({"id_slot": id_slot, "n_erased": n})
    if action not in ("save", "restore"):
        raise bad_request(f"'action' must be save, restore or erase, got {schemas._show(action)}")
    if not st.settings.slot_save_path:
        raise bad_request("slot save and restore need --slot-save-path")
    body = await read_json(request, st.settings.max_body_bytes)
    filename, cid = _file_id(body)
    store = _store(st)
    if action == "save":
        n, size, ms = await _run_on_engine(request, st, _save(store, cid))
        return JSONResp({"id_slot": id_slot, "filename": filename, "n_saved": n, "n_written": size,
                         "timings": {"save_ms": ms}})
    n, size, ms = await _run_on_engine(request, st, _restore(store, cid))
    return JSONResp({"id_slot": id_slot, "filename": filename, "n_restored": n, "n_read": size,
                     "timings": {"restore_ms": ms}})
