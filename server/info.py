"""The routes around generation: /health, /v1/models, /props, /metrics, /tokenize,
/detokenize, /apply-template, in llama-server's shapes (docs/server.md)."""
from __future__ import annotations

import dataclasses

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from . import schemas
from .errors import ApiError, JSONResp, endpoint
from .generation import render_chat, tokenize_content
from .openai_format import sampling_settings
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
    return JSONResp({
        "object": "list",
        "data": [{"id": name, "object": "model", "created": st.started, "owned_by": "llamacpp",
                  "meta": _model_meta(engine)}],
        "models": [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
                    "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                "parameter_size": "", "quantization_level": ""}}],
    })


def _default_params() -> dict:
    return {**sampling_settings(schemas.SamplingParams(), None, False, False), "max_tokens": -1,
            "n_probs": 0, "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}


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
                                        "params": _default_params()},
        "total_slots": 1,
        "model_alias": st.settings.alias or "",
        "model_path": st.settings.model_path or str(getattr(getattr(engine, "gfile", None), "path", "")),
        "modalities": {"vision": False, "audio": False},
        "n_ctx": engine.n_ctx,
        "chat_template": template.source,
        "chat_template_is_builtin": bool(getattr(template, "is_builtin", False)),
        "bos_token": token_text(tok.bos_id),
        "eos_token": token_text(tok.eos_id),
        "build_info": FINGERPRINT,
        "max_queue": st.settings.max_queue,
    })


@endpoint
async def metrics(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    worker = st.worker
    text = st.metrics.render(processing=worker.n_processing, queued=worker.n_queued,
                             kv_tokens=len(getattr(engine, "kv_tokens", ()) or ()), n_ctx=engine.n_ctx)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8",
                             headers={"Process-Start-Time-Unix": str(st.started)})


@endpoint
async def tokenize(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    with_pieces = schemas.get_bool(body, "with_pieces", False)
    add_special = schemas.get_bool(body, "add_special", False)
    parse_special = schemas.get_bool(body, "parse_special", True)
    content = body.get("content")
    if content is None:
        return JSONResp({"tokens": []})
    ids = await run_in_threadpool(tokenize_content, engine, content, add_special, parse_special, st.vocab_size)
    if not with_pieces:
        return JSONResp({"tokens": ids})
    return JSONResp({"tokens": await run_in_threadpool(_with_pieces, engine, ids)})


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
    ids = schemas.validate_token_ids(tokens, "tokens", st.vocab_size)
    return JSONResp({"content": engine.tokenizer.decode(ids)})


@endpoint
async def apply_template(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    messages = schemas.chat_messages(body)            # exactly what chat completions renders
    kwargs = schemas.template_kwargs(body)
    tools = schemas.parse_tools(body)
    text, _ = await run_in_threadpool(render_chat, engine.template, messages, tools, kwargs)
    return JSONResp({"prompt": text})
