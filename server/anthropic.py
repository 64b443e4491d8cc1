"""Anthropic's Messages API: POST /v1/messages (streamed or not) and /v1/messages/count_tokens.

The request is translated to an OpenAI chat body and served by jobs.py like any chat:
- `system` (a string or text blocks) -> a system message; `messages` with content a string or
  blocks: text, tool_use (-> assistant tool_calls, arguments as JSON), tool_result (-> a tool
  message; its text content; is_error noted in the text), thinking (-> reasoning_content);
  image and document blocks are refused (400: a text-only engine);
- max_tokens (required, as Anthropic), stop_sequences, temperature, top_p, top_k, stream;
- tools [{name, description, input_schema}] -> function tools; tool_choice auto / any (->
  required) / tool {name} / none;
- thinking {type: enabled} / {type: disabled} -> chat_template_kwargs.enable_thinking.
Response: {"id": "msg_...", "type": "message", "role": "assistant", "model", "content": [thinking,
text, tool_use blocks], "stop_reason": end_turn | max_tokens | stop_sequence | tool_use,
"stop_sequence", "usage": {"input_tokens", "output_tokens", "cache_read_input_tokens"}}.
Streaming is Anthropic's SSE (`event: NAME` + `data:`): message_start, for each block
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop, then message_delta (stop_reason, usage) and message_stop; a failure after
the start is an `error` event. Errors are Anthropic's {"type": "error", "error": {"type",
"message"}} with the HTTP status llama-server would give.

Deliberately not here: validation, templating or parsing of the reply (jobs.py, chat_request.py,
openai_format.py), prompt caching, citations, server tools, images.
"""
from __future__ import annotations

import json
import logging

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from . import chat_request, jobs, schemas
from .errors import ApiError, JSONResp, api_error, bad_request, endpoint, json_bytes
from .openai_format import random_id
from .state import ServerState
from .streaming import SSEResponse, read_json

log = logging.getLogger("genie_rt.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               499: "api_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(exc: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def anthropic_endpoint(fn):
    """endpoint() with every error in Anthropic's shape (a template's or the engine's too)."""
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
            return JSONResp(anthropic_error(err), status_code=err.status, headers=err.headers)
    wrapped.__name__ = fn.__name__
    return wrapped


# --- request -> OpenAI chat body ----------------------------------------------------------------------
def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of content blocks")
    parts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad_request(f"'{where}[{k}]' must be an object")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{where}[{k}].text' must be a string")
            parts.append(text)
        elif kind in ("image", "document"):
            raise bad_request(f"'{where}[{k}]' is a {kind} block: images and documents are not supported "
                              "(a text-only engine)")
        else:
            raise bad_request(f"'{where}[{k}].type' {schemas._show(kind)} is not supported here")
    return "\n".join(parts)


def _convert_message(i: int, m) -> list[dict]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"'{where}.role' must be user or assistant, got {schemas._show(role)}")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of content blocks")
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    thinking: list[str] = []
    for k, block in enumerate(content):
        bw = f"{where}.content[{k}]"
        if not isinstance(block, dict):
            raise bad_request(f"'{bw}' must be an object")
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of([block], bw))
        elif kind == "tool_use" and role == "assistant":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad_request(f"'{bw}.name' must be a non-empty string")
            if not isinstance(args, dict):
                raise bad_request(f"'{bw}.input' must be an object")
            calls.append({"id": str(block.get("id") or "call_" + random_id(12)), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            text = _text_of(block.get("content"), f"{bw}.content")
            if block.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind in ("image", "document"):
            raise bad_request(f"'{bw}' is a {kind} block: images and documents are not supported "
                              "(a text-only engine)")
        else:
            raise bad_request(f"'{bw}.type' {schemas._show(kind)} is not supported in a {role} message")
    if role == "assistant":
        msg: dict = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "\n".join(thinking)
        out.append(msg)
    elif texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"'tools[{k}]' must be an object")
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"'tools[{k}].type' {schemas._show(t.get('type'))}: server tools are not supported")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None:
        return None
    if not isinstance(choice, dict):
        raise bad_request("'tool_choice' must be an object")
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"'tool_choice.type' must be auto, any, tool or none, got {schemas._show(kind)}")


def to_chat_body(body: dict, need_max_tokens: bool = True) -> dict:
    if "messages" not in body:
        raise bad_request("'messages' is required")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise bad_request("'messages' must be an array")
    messages: list[dict] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(raw):
        messages += _convert_message(i, m)
    if not any(m["role"] != "system" for m in messages):   # llama-server is permissive here
        messages.append({"role": "user", "content": ""})
    if need_max_tokens and body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required")
    out = {"messages": messages}
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream", "seed"):
        if key in body:
            out[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        out["stop"] = stops
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            out["tool_choice"] = choice
        flag = body["tool_choice"].get("disable_parallel_tool_use") if isinstance(body.get("tool_choice"), dict) else None
        if flag is not None and not isinstance(flag, bool):
            raise bad_request("'tool_choice.disable_parallel_tool_use' must be a boolean")
        if flag:                                    # Anthropic's spelling: at most one call
            out["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        out["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    return out


# --- reply -> Anthropic shapes ------------------------------------------------------------------------
def stop_reason(result, has_calls: bool) -> str:
    if has_calls:
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_word else "end_turn"


def _usage(result) -> dict:
    return {"input_tokens": result.n_prompt - result.n_cached, "output_tokens": result.n_generated,
            "cache_read_input_tokens": result.n_cached, "cache_creation_input_tokens": 0}


def content_blocks(msg: dict) -> list[dict]:
    blocks: list[dict] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"


async def _stream(chat: jobs.ChatJob, msg_id: str, model: str):
    """Anthropic's event sequence for one streamed reply."""
    n_prompt = len(chat.prompt)
    index = -1
    open_kind: str | None = None    # the block being written: "text" | "thinking"
    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
        async for kind, *rest in jobs.chat_stream(chat):
            if kind == "delta":
                (delta,) = rest
                for key, block_kind, delta_type, field in (("reasoning_content", "thinking", "thinking_delta", "thinking"),
                                                           ("content", "text", "text_delta", "text")):
                    if delta.get(key):
                        if open_kind != block_kind:
                            if open_kind is not None:
                                if open_kind == "thinking":
                                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                                         "delta": {"type": "signature_delta", "signature": ""}})
                                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                            index += 1
                            open_kind = block_kind
                            start = {"type": "thinking", "thinking": "", "signature": ""} if block_kind == "thinking" \
                                else {"type": "text", "text": ""}
                            yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": start})
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": delta_type, field: delta[key]}})
                for call in delta.get("tool_calls") or []:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        open_kind = None
                    index += 1
                    fn = call["function"]
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "tool_use", "id": call["id"],
                                                                           "name": fn["name"], "input": {}}})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": {"type": "input_json_delta",
                                                                   "partial_json": fn["arguments"]}})
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            elif kind == "done":
                result, has_calls = rest
                if index < 0:     # an empty reply still has one (empty) text block
                    index, open_kind = 0, "text"
                    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                         "content_block": {"type": "text", "text": ""}})
                if open_kind is not None:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                yield _event("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": stop_reason(result, has_calls),
                                                         "stop_sequence": result.stop_word},
                                               "usage": {"output_tokens": result.n_generated}})
                yield _event("message_stop", {"type": "message_stop"})
    except ApiError as exc:
        if exc.status != 499:
            yield _event("error", anthropic_error(exc))
    except Exception as exc:
        log.exception("anthropic stream failed")
        yield _event("error", anthropic_error(ApiError(500, f"internal error: {type(exc).__name__}")))
    finally:
        chat.stream.close()


@anthropic_endpoint
async def messages(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    chat = await jobs.start_chat(request, st, to_chat_body(body))
    msg_id = "msg_" + random_id(24)
    if chat.req.gen.stream:
        return SSEResponse(_stream(chat, msg_id, st.model_name))
    msg, has_calls, result = await jobs.chat_message(chat)
    return JSONResp({"id": msg_id, "type": "message", "role": "assistant", "model": st.model_name,
                     "content": content_blocks(msg), "stop_reason": stop_reason(result, has_calls),
                     "stop_sequence": result.stop_word, "usage": _usage(result)})


@anthropic_endpoint
async def count_tokens(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    chat_body = to_chat_body(body, need_max_tokens=False)
    req = await run_in_threadpool(chat_request.parse_chat, chat_body, st.vocab_size, st.tokenize_text, st.settings.defaults)

    def count() -> int:
        text, _ = jobs.render_chat(engine.template, req.messages, req.tools, req.template_kwargs)
        return len(jobs.encode_prompt(st, text, True, True, None))

    return JSONResp({"input_tokens": await run_in_threadpool(count)})
