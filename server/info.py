"""The routes around generation: /health, /v1/models, /props, /metrics, /tokenize,
/detokenize, /apply-template, in llama-server's shapes (docs/server.md)."""
from __future__ import annotations

import dataclasses

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from starlette.responses import StreamingResponse

from genie_rt.engine.chat_caps import template_caps

from . import chat_request, completion_request, jobs, platform_metrics, schemas
from .errors import ApiError, JSONResp, endpoint, json_bytes
from .openai_format import SAMPLERS, sampling_settings
from .prompt_limits import iter_encode, release_memory
from .state import FINGERPRINT, ServerState
from .streaming import read_json


@endpoint
async def health(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    worker = st.worker
    if worker is None or not worker.is_alive:
        raise ApiError(503, "the engine worker is not running")
    if worker.is_draining:
        raise ApiError(503, "the server is shutting down")
    plan = getattr(engine, "plan", None)
    backend = getattr(engine, "backend", None)
    device = backend.device_info() if hasattr(backend, "device_info") else {}
    return JSONResp({
        "status": "ok",
        "model": st.model_name,
        "model_path": st.settings.model_path or str(getattr(getattr(engine, "gfile", None), "path", "")),
        "n_ctx": engine.n_ctx,
        "device": device,
        "memory": dataclasses.asdict(plan) if dataclasses.is_dataclass(plan) else {},
        "load_seconds": getattr(engine, "load_seconds", None),
        "requests_processing": worker.n_processing,
        "requests_queued": worker.n_queued,
        "platform": platform_metrics.health(engine),
    })


def _model_meta(engine) -> dict:
    cfg = getattr(engine, "cfg", None)
    gfile = getattr(engine, "gfile", None)
    n_params, size = 0, 0
    try:
        for t in gfile.tensors.values():
            n = 1
            for d in t.shape:
                n *= int(d)
            n_params += n
        size = gfile.path.stat().st_size
    except (AttributeError, OSError, TypeError):
        pass
    return {"vocab_type": 2, "n_vocab": getattr(cfg, "vocab_size", None),
            "n_ctx_train": getattr(cfg, "n_ctx_train", None), "n_embd": getattr(cfg, "n_embd", None),
            "n_params": n_params, "size": size}


@endpoint
async def models(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    name = st.model_name
    entry = {"id": name, "object": "model", "created": st.started, "owned_by": "llamacpp",
             "meta": _model_meta(engine)}
    if st.settings.aliases:
        entry["aliases"] = sorted(st.settings.aliases)
    if st.settings.tags:
        entry["tags"] = sorted(st.settings.tags)
    return JSONResp({
        "object": "list",
        "data": [entry],
        "models": [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
                    "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                "parameter_size": "", "quantization_level": ""}}],
    })


def default_params(st: ServerState) -> dict:
    d = st.settings.defaults
    params = dataclasses.replace(d.params, top_k=max(0, d.top_k))
    n_predict = None if d.n_predict < 0 else d.n_predict
    return {**sampling_settings(params, n_predict, False, False), "n_probs": 0, "samplers": list(SAMPLERS)}


@endpoint
async def props(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    tok = engine.tokenizer

    def token_text(i):
        return tok.token_to_piece(i).decode("utf-8", "replace") if isinstance(i, int) else ""

    template = engine.template
    return JSONResp({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": engine.n_ctx, "speculative": False,
                                        "is_processing": bool(st.worker and st.worker.n_processing),
                                        "params": default_params(st)},
        "total_slots": st.settings.n_parallel,
        "model_alias": st.settings.alias or "",
        "model_path": st.settings.model_path or str(getattr(getattr(engine, "gfile", None), "path", "")),
        "modalities": {"vision": False, "audio": False},
        "n_ctx": engine.n_ctx,
        "chat_template": template.source,
        "chat_template_is_builtin": bool(getattr(template, "is_builtin", False)),
        "chat_template_caps": template_caps(template),
        "bos_token": token_text(tok.bos_id),
        "eos_token": token_text(tok.eos_id),
        "build_info": FINGERPRINT,
        "max_queue": st.settings.max_queue,
    })


@endpoint
async def metrics(request: Request, st: ServerState) -> Response:
    if not st.settings.metrics_endpoint:
        raise ApiError(501, "This server does not support metrics endpoint. Start it with --metrics.",
                       "not_supported_error")
    engine = st.ready_engine()
    worker = st.worker
    text = st.metrics.render(processing=worker.n_processing, queued=worker.n_queued,
                             kv_tokens=len(getattr(engine, "kv_tokens", ()) or ()), n_ctx=engine.n_ctx)
    text += platform_metrics.metric_lines(engine)
    response = PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
    # llama-server's casing (Starlette lowercases header names; a plain-dict reader looks this one up as is)
    response.raw_headers.append((b"Process-Start-Time-Unix", str(st.started).encode()))
    return response


TOKENIZE_GROUP = 4096       # ids (with pieces) rendered per chunk of a streamed /tokenize answer


@endpoint
async def tokenize(request: Request, st: ServerState) -> Response:
    """POST /tokenize. A text is tokenized in slices and the answer streamed as it is made
    (prompt_limits.iter_encode), so neither the ids of a megabyte text nor their pieces are
    ever all in memory at once."""
    st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    with_pieces = schemas.get_bool(body, "with_pieces", False)
    add_special = schemas.get_bool(body, "add_special", False)
    parse_special = schemas.get_bool(body, "parse_special", True)
    content = body.pop("content", None)
    del body
    if content is None:
        return JSONResp({"tokens": []})
    if not isinstance(content, str):
        ids = await run_in_threadpool(jobs.tokenize_content, st, content, add_special, parse_special)
        return JSONResp({"tokens": _with_pieces(st.engine, ids) if with_pieces else ids})
    if len(content) < 1 << 16:
        ids = await run_in_threadpool(st.engine.tokenizer.encode, content, add_special=add_special,
                                      parse_special=parse_special)
        return JSONResp({"tokens": _with_pieces(st.engine, ids) if with_pieces else ids})
    return StreamingResponse(_tokenize_stream(st, content, add_special, parse_special, with_pieces),
                             media_type="application/json; charset=utf-8")


async def _tokenize_stream(st: ServerState, text: str, add_special: bool, parse_special: bool, with_pieces: bool):
    groups = iter_encode(st.engine.tokenizer, text, add_special, parse_special, jobs.text_budget(st))
    done = object()
    first = True
    try:
        yield b'{"tokens":['
        while True:
            group = await run_in_threadpool(next, groups, done)
            if group is done:
                break
            for start in range(0, len(group), TOKENIZE_GROUP):
                part = group[start:start + TOKENIZE_GROUP]
                items = _with_pieces(st.engine, part) if with_pieces else part
                if not items:
                    continue
                chunk = json_bytes(items)[1:-1]
                yield chunk if first else b"," + chunk
                first = False
        yield b"]}"
    finally:
        del text, groups
        await run_in_threadpool(release_memory)


def _with_pieces(engine, ids: list[int]) -> list[dict]:
    out = []
    for i in ids:
        piece = engine.tokenizer.token_to_piece(i)
        try:
            out.append({"id": i, "piece": piece.decode("utf-8")})
        except UnicodeDecodeError:  # part of a character: the bytes, as llama-server sends them
            out.append({"id": i, "piece": list(piece)})
    return out


@endpoint
async def detokenize(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    tokens = body.get("tokens")
    if tokens is None:
        return JSONResp({"content": ""})
    ids = completion_request.validate_token_ids(tokens, "tokens", st.vocab_size)
    return JSONResp({"content": engine.tokenizer.decode(ids)})


@endpoint
async def apply_template(request: Request, st: ServerState) -> Response:
    """POST /apply-template: the prompt text a chat request would be given. add_generation_prompt
    (default true) and continue_final_message as llama-server reads them: both true is a 400; a
    final assistant message is continued (a prefill) either way."""
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    messages = chat_request.chat_messages(body)            # exactly what chat completions renders
    kwargs = chat_request.template_kwargs(body, st.settings.defaults.reasoning)
    tools = chat_request.parse_tools(body)
    add_gen = chat_request.generation_prompt_flag(body, messages)
    text, prefilled = await run_in_threadpool(jobs.render_chat, engine.template, messages, tools, kwargs, add_gen)
    if add_gen and not prefilled:
        text = jobs.close_forced_think(text, kwargs.get("enable_thinking") is False)
    return JSONResp({"prompt": text})
