"""Ollama's API, so the `ollama` Python client and Home Assistant's built-in Ollama integration work
unchanged against this server (`ollama.Client(host="http://127.0.0.1:8080")`).

    POST /api/chat       messages, tools, think, options, format, stream (default true: NDJSON)
    POST /api/generate   prompt, system, raw, think, options, stream
    GET  /api/tags       the one model, as Ollama lists local models
    POST /api/show       its details, template, model_info, capabilities
    GET  /api/ps         the loaded model
    GET  /api/version    {"version"}
    pull, push, create, copy, delete, embed, embeddings: 501 with a sentence (one local GGUF, no
    embeddings)

A chat is translated to an OpenAI chat body and served by jobs.py like any chat: messages with
role system / user / assistant / tool (tool_calls with object arguments -> OpenAI calls with JSON
strings; `thinking` -> reasoning_content; images -> 400, a text-only engine), tools in OpenAI's
function shape (Ollama's own), think (true / false; "low" / "medium" / "high" mean true), options
temperature, top_k, top_p, min_p, seed, num_predict, stop, repeat_penalty, repeat_last_n,
presence_penalty, frequency_penalty (num_ctx, num_gpu, num_thread, keep_alive are accepted and
ignored: the context is the server's). `format` ("json" or a schema) becomes response_format,
which constrains the reply (server/constraints.py).
Replies: {"model", "created_at", "message": {"role": "assistant", "content", "thinking"?,
"tool_calls"?: [{"function": {"name", "arguments": {...}}}]}, "done": false} per piece (a tool
call once its block is closed), then the final object with "done": true, "done_reason" stop |
length, and the counts and durations (nanoseconds). Any model name is accepted (one model per
server). Errors are Ollama's {"error": "message"} with the HTTP status.

Deliberately not here: model management, embeddings, images, Modelfile templates (`template`
in /api/generate is refused: the GGUF's chat template is used).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time
from contextlib import contextmanager

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from . import completion_request, jobs, schemas
from .errors import ApiError, JSONResp, api_error, bad_request, endpoint, json_bytes
from .openai_format import random_id
from .state import VERSION, ServerState
from .streaming import read_json

log = logging.getLogger("genie_rt.server")

OLLAMA_VERSION = "0.12.0"      # the Ollama API level these routes follow (clients check >= some version)
OPTION_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "seed": "seed", "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repeat_penalty",
                 "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
IGNORED_OPTIONS = ("num_ctx", "num_gpu", "num_thread", "num_batch", "num_keep", "main_gpu", "use_mmap",
                   "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "typical_p", "tfs_z",
                   "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline")


def ollama_endpoint(fn):
    """endpoint() with every error in Ollama's shape: {"error": "message"}."""
    @endpoint
    async def wrapped(request: Request, st: ServerState) -> Response:
        try:
            return await fn(request, st)
        except Exception as exc:
            err = api_error(exc, st.settings.retry_after_s)
            if err.status >= 500 and not isinstance(exc, ApiError):
                log.exception("%s %s failed", request.method, request.url.path)
            if err.status == 400:
                st.metrics.on_rejected("invalid")
            return JSONResp({"error": err.message}, status_code=err.status, headers=err.headers)
    wrapped.__name__ = fn.__name__
    return wrapped


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _model_name(st: ServerState) -> str:
    name = st.model_name
    return name if ":" in name else name + ":latest"


# --- request -> OpenAI chat body --------------------------------------------------------------------
def _options(body: dict, out: dict) -> None:
    options = body.get("options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object")
    for key, value in options.items():
        if key in OPTION_FIELDS:
            out[OPTION_FIELDS[key]] = value
        elif key not in IGNORED_OPTIONS:
            raise bad_request(f"'options.{key}' is not a known option")


@contextmanager
def _ollama_names(body: dict):
    """A 400 about a field an option was translated to names the option (`options.num_predict`,
    not `max_tokens`): the client sent Ollama's names."""
    try:
        yield
    except ApiError as exc:
        options = body.get("options")
        if exc.status == 400 and isinstance(options, dict):
            for key in options:
                if key in OPTION_FIELDS:
                    exc.message = exc.message.replace(f"'{OPTION_FIELDS[key]}'", f"'options.{key}'")
        raise


def _format(body: dict, out: dict) -> None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise bad_request("'format' must be \"json\" or a JSON schema object")


def _think(body: dict, out: dict) -> None:
    think = body.get("think")
    if think is None:
        return
    if isinstance(think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": think}
    elif think in ("low", "medium", "high"):
        out["chat_template_kwargs"] = {"enable_thinking": True}
    else:
        raise bad_request("'think' must be true, false, \"low\", \"medium\" or \"high\"")


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object")
    if m.get("images"):
        raise bad_request(f"'{where}.images': images are not supported (a text-only engine)")
    role = m.get("role")
    msg: dict = {"role": role, "content": m.get("content") if m.get("content") is not None else ""}
    if m.get("thinking"):
        msg["reasoning_content"] = m["thinking"]
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise bad_request(f"'{where}.tool_calls' must be an array")
        out_calls = []
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise bad_request(f"'{where}.tool_calls[{k}].function' must be an object")
            args = fn.get("arguments", {})
            out_calls.append({"id": str(call.get("id") or "call_" + random_id(12)), "type": "function",
                              "function": {"name": fn.get("name"),
                                           "arguments": args if isinstance(args, str) else json.dumps(args)}})
        msg["tool_calls"] = out_calls
    if role == "tool" and m.get("tool_name"):
        msg["name"] = m["tool_name"]
    return msg


def chat_body(body: dict) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be an array")
    out: dict = {"messages": [_message(i, m) for i, m in enumerate(messages)],
                 "stream": schemas.get_bool(body, "stream", True)}
    tools = body.get("tools")
    if tools:
        out["tools"] = [{**t, "type": t.get("type") or "function"} if isinstance(t, dict) else t for t in tools]
    _options(body, out)
    _format(body, out)
    _think(body, out)
    return out


def generate_body(body: dict, base_model: bool = False) -> dict:
    """An /api/generate body as a chat body (the model's template applied), or with `raw` as a
    completion body. A base model (the plain transcript fallback: no chat template) continues the
    prompt as is, as Ollama's `{{ .Prompt }}` template for base models does and `genie-rt run`
    does; its `system`, if any, is the first paragraph, as the transcript would write it."""
    for key in ("images", "suffix", "template"):
        if body.get(key):
            raise bad_request(f"'{key}' is not supported by this server")
    prompt = schemas.get_str(body, "prompt", "")
    raw = schemas.get_bool(body, "raw", False)
    out: dict = {"stream": schemas.get_bool(body, "stream", True)}
    system = schemas.get_str(body, "system", None)
    if raw:
        out["prompt"] = prompt
    elif base_model:
        out["prompt"] = (system + "\n\n" if system else "") + prompt
    else:
        out["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
    _options(body, out)
    _format(body, out)
    _think(body, out)
    return out


# --- replies ----------------------------------------------------------------------------------------
def _ns(ms: float) -> int:
    return int(ms * 1e6)


def _final(st: ServerState, result, t0: float, extra: dict) -> dict:
    return {"model": _model_name(st), "created_at": _now(), **extra, "done": True,
            "done_reason": "length" if result.finish_reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
            "prompt_eval_count": result.n_prompt - result.n_cached, "prompt_eval_duration": _ns(result.prompt_ms),
            "eval_count": result.n_generated, "eval_duration": _ns(result.gen_ms)}


def _ollama_calls(calls: list[dict]) -> list[dict]:
    return [{"id": c["id"], "function": {"index": i, "name": c["function"]["name"],
                                         "arguments": json.loads(c["function"]["arguments"] or "{}")}}
            for i, c in enumerate(calls)]


def _ndjson(obj: dict) -> bytes:
    return json_bytes(obj) + b"\n"


class NDJSONResponse(StreamingResponse):
    def __init__(self, chunks):
        super().__init__(chunks, media_type="application/x-ndjson")


async def _chat_lines(st: ServerState, chat: jobs.ChatJob, t0: float, generate: bool):
    model = _model_name(st)
    try:
        async for kind, *rest in jobs.chat_stream(chat):
            if kind == "delta":
                (delta,) = rest
                if generate:
                    piece = {"response": delta.get("content", "")}
                    if delta.get("reasoning_content"):
                        piece["thinking"] = delta["reasoning_content"]
                    if not piece["response"] and "thinking" not in piece:
                        continue
                else:
                    msg: dict = {"role": "assistant", "content": delta.get("content", "")}
                    if delta.get("reasoning_content"):
                        msg["thinking"] = delta["reasoning_content"]
                    if delta.get("tool_calls"):
                        msg["tool_calls"] = _ollama_calls([dict(c) for c in delta["tool_calls"]])
                    piece = {"message": msg}
                yield _ndjson({"model": model, "created_at": _now(), **piece, "done": False})
            elif kind == "done":
                result, _ = rest
                extra = {"response": "", "context": chat.prompt + list(result.tokens)} if generate else \
                    {"message": {"role": "assistant", "content": ""}}
                yield _ndjson(_final(st, result, t0, extra))
    except ApiError as exc:
        if exc.status != 499:
            yield _ndjson({"error": exc.message})
    except Exception as exc:
        log.exception("ollama stream failed")
        yield _ndjson({"error": f"internal error: {type(exc).__name__}"})
    finally:
        chat.stream.close()


def _load_only(st: ServerState, generate: bool) -> Response:
    extra = {"response": ""} if generate else {"message": {"role": "assistant", "content": ""}}
    return JSONResp({"model": _model_name(st), "created_at": _now(), **extra, "done_reason": "load", "done": True})


@ollama_endpoint
async def chat(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    t0 = time.perf_counter()
    body = await read_json(request, st.settings.max_body_bytes)
    if not body.get("messages"):
        return _load_only(st, False)         # Ollama: no messages = load the model
    with _ollama_names(body):
        job = await jobs.start_chat(request, st, chat_body(body))
    if job.req.gen.stream:
        return NDJSONResponse(_chat_lines(st, job, t0, generate=False))
    msg, has_calls, result = await jobs.chat_message(job)
    message: dict = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("reasoning_content"):
        message["thinking"] = msg["reasoning_content"]
    if has_calls:
        message["tool_calls"] = _ollama_calls(msg["tool_calls"])
    return JSONResp(_final(st, result, t0, {"message": message}))


@ollama_endpoint
async def generate(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    t0 = time.perf_counter()
    body = await read_json(request, st.settings.max_body_bytes)
    if not body.get("prompt"):
        return _load_only(st, True)
    converted = generate_body(body, getattr(st.engine.template, "is_plain", False))
    if "prompt" in converted:        # raw (or a base model): the prompt is the model's input, as /completion
        with _ollama_names(body):
            return await _generate_raw(request, st, converted, t0, context=not body.get("raw"))
    with _ollama_names(body):
        job = await jobs.start_chat(request, st, converted)
    if job.req.gen.stream:
        return NDJSONResponse(_chat_lines(st, job, t0, generate=True))
    msg, _, result = await jobs.chat_message(job)
    extra = {"response": msg.get("content") or "", "context": job.prompt + list(result.tokens)}
    if msg.get("reasoning_content"):
        extra["thinking"] = msg["reasoning_content"]
    return JSONResp(_final(st, result, t0, extra))


async def _generate_raw(request: Request, st: ServerState, converted: dict, t0: float,
                        context: bool = False) -> Response:
    """The prompt as the model's input. context: the reply ends with Ollama's `context` (the
    prompt's and the reply's tokens), as a templated reply does; raw replies have none."""
    req = await run_in_threadpool(completion_request.parse_completion, converted, st.vocab_size, st.tokenize_text,
                                  st.settings.defaults, False)
    prompt = await run_in_threadpool(jobs.tokenize_content, st, req.prompt, True, True, st.engine.n_ctx - 1)
    jobs.check_prompt(prompt, st.engine.n_ctx)
    stream = jobs.start_job(request, st, req.gen, prompt)
    event = await jobs.first_event(stream)
    model = _model_name(st)
    if not req.gen.stream:
        text, tokens, result = await jobs.collect(stream, event)
        extra = {"response": text, **({"context": prompt + list(result.tokens)} if context else {})}
        return JSONResp(_final(st, result, t0, extra))

    async def lines():
        try:
            async for ev in jobs.events(stream, event):
                if hasattr(ev, "result"):
                    extra = {"response": "", **({"context": prompt + list(ev.result.tokens)} if context else {})}
                    yield _ndjson(_final(st, ev.result, t0, extra))
                elif ev.text:
                    yield _ndjson({"model": model, "created_at": _now(), "response": ev.text, "done": False})
        except ApiError as exc:
            if exc.status != 499:
                yield _ndjson({"error": exc.message})
    return NDJSONResponse(lines())


# --- models -----------------------------------------------------------------------------------------
def _details(st: ServerState) -> dict:
    engine = st.engine
    meta = engine.gfile.metadata if getattr(engine, "gfile", None) is not None else {}
    arch = meta.get("general.architecture", "")
    n_params = 0
    try:
        for t in engine.gfile.tensors.values():
            n = 1
            for d in t.shape:
                n *= int(d)
            n_params += n
    except (AttributeError, TypeError):
        pass
    size = f"{n_params / 1e9:.1f}B" if n_params >= 1e8 else f"{n_params / 1e6:.0f}M"
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
            "parameter_size": size, "quantization_level": _quant_name(meta.get("general.file_type"))}


def _quant_name(file_type) -> str:
    names = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
             11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
             18: "Q6_K", 30: "BF16"}
    return names.get(file_type, "unknown") if isinstance(file_type, int) else "unknown"


def _file_facts(st: ServerState) -> tuple[int, str, str]:
    path = getattr(getattr(st.engine, "gfile", None), "path", None)
    try:
        stat = path.stat()
        size, mtime = stat.st_size, stat.st_mtime
    except (AttributeError, OSError):
        size, mtime = 0, time.time()
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()   # stable id, not the file's hash
    modified = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return size, digest, modified


def _model_entry(st: ServerState) -> dict:
    size, digest, modified = _file_facts(st)
    name = _model_name(st)
    return {"name": name, "model": name, "modified_at": modified, "size": size, "digest": digest,
            "details": _details(st)}


@ollama_endpoint
async def tags(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    return JSONResp({"models": [_model_entry(st)]})


@ollama_endpoint
async def ps(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    entry = _model_entry(st)
    plan = getattr(st.engine, "plan", None)
    vram = int(getattr(plan, "weights", 0) or 0) + int(getattr(plan, "kv", 0) or 0)
    if getattr(getattr(st.engine, "backend", None), "name", "cpu") == "cpu":
        vram = 0
    entry.update({"expires_at": "2999-01-01T00:00:00Z", "size_vram": vram, "context_length": st.engine.n_ctx})
    return JSONResp({"models": [entry]})


@ollama_endpoint
async def show(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    await read_json(request, st.settings.max_body_bytes)      # {"model": ...}: any name is this model
    meta = engine.gfile.metadata if getattr(engine, "gfile", None) is not None else {}
    info = {k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool)) and not k.startswith("tokenizer.")
            and len(str(v)) < 1024}
    capabilities = ["completion"]
    source = engine.template.source or ""
    if "tools" in source:
        capabilities.append("tools")
    if "<think>" in source or "enable_thinking" in source:
        capabilities.append("thinking")
    _, _, modified = _file_facts(st)
    return JSONResp({"modelfile": f"FROM {st.settings.model_path or ''}\n", "parameters": "",
                     "template": source, "details": _details(st), "model_info": info,
                     "capabilities": capabilities, "modified_at": modified, "license": ""})


@ollama_endpoint
async def version(request: Request, st: ServerState) -> Response:
    return JSONResp({"version": OLLAMA_VERSION, "genie_rt": VERSION})


@ollama_endpoint
async def not_supported(request: Request, st: ServerState) -> Response:
    what = request.url.path.rsplit("/", 1)[-1]
    why = "embeddings are not supported" if what.startswith("embed") else \
        "models are not managed by this server: it serves one local GGUF (genie-rt serve -m FILE)"
    raise ApiError(501, f"/api/{what}: {why}", "not_supported_error")


def routes() -> list[Route]:
    out = [Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
           Route("/api/tags", tags, methods=["GET"]), Route("/api/ps", ps, methods=["GET"]),
           Route("/api/show", show, methods=["POST"]), Route("/api/version", version, methods=["GET"])]
    for name in ("pull", "push", "create", "copy", "delete", "embed", "embeddings"):
        out.append(Route(f"/api/{name}", not_supported, methods=["POST", "DELETE"]))
    return out
