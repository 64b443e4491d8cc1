"""OpenAI's Responses API (POST /v1/responses): the subset the `openai` client's
`responses.create` and `responses.stream` use, served by jobs.py like any chat.

Request -> OpenAI chat body:
- `instructions` -> a system message; `input` a string (one user message) or a list of items:
  messages ({"role", "content": string or input_text / output_text parts}, with or without
  "type": "message"; developer = system), `function_call` items (-> an assistant tool call,
  consecutive ones in one message), `function_call_output` (-> a tool message), `reasoning`
  items (-> the next assistant message's reasoning_content);
- tools [{"type": "function", "name", "description", "parameters"}] and tool_choice ("auto",
  "none", "required", {"type": "function", "name"}); max_output_tokens, temperature, top_p,
  stream; reasoning.effort "none"/"minimal" switches thinking off, any other effort on.
- previous_response_id and conversation are refused (400): nothing is stored (`store` is
  ignored). text.format json_schema / json_object constrain the output (server/constraints.py);
  other formats and built-in tools (web search, file search, ...) are refused.
Response: {"id": "resp_...", "object": "response", "status": completed | incomplete, "output":
[reasoning item, message item (output_text), function_call items], "usage", ...}. Streaming:
response.created, response.in_progress, then per item output_item.added, content_part.added /
output_text.delta / output_text.done / content_part.done (or reasoning_text.delta / .done, or
function_call_arguments.delta / .done), output_item.done, and response.completed (also when the
token limit cut the reply: its status says "incomplete", and llama-server's `timings` ride on
it); a failure after the start is a response.failed event. Every event has its
sequence_number, as the client's stream accumulator expects. llama-server's telemetry:
`return_progress` adds a response.in_progress event with `prompt_progress` per batch of the
prompt, `timings_per_token` puts the timings so far on each text delta event.

Deliberately not here: storage of responses, built-in tools.
"""
from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import Response

from . import jobs, schemas
from .errors import ApiError, JSONResp, bad_request, endpoint, json_bytes
from .openai_format import random_id, timings, with_telemetry
from .state import ServerState
from .streaming import SSEResponse, read_json

log = logging.getLogger("genie_rt.server")


# --- request -> chat body ---------------------------------------------------------------------------
def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of content parts")
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"'{where}[{k}]' must be an object")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{k}].text' must be a string")
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"'{where}[{k}]' is {kind}: only text is supported (a text-only engine)")
        else:
            raise bad_request(f"'{where}[{k}].type' {schemas._show(kind)} is not supported")
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise bad_request("'input' is required")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("'input' must be a string or an array of input items")
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"'{where}.role' must be user, system, developer or assistant")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _content_text(item.get("content", ""), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or "call_" + random_id(12)), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": output if isinstance(output, str) else _content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            text = _content_text(item.get("content") or [], f"{where}.content") or \
                _content_text(item.get("summary") or [], f"{where}.summary")
            reasoning = text
        else:
            raise bad_request(f"'{where}.type' {schemas._show(kind)} is not supported")
    return out


def to_chat_body(body: dict) -> dict:
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise bad_request(f"'{key}' is not supported: this server stores no responses; send the whole "
                              "conversation in 'input'")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    out: dict = {"messages": _messages(body)}
    if isinstance(fmt, dict) and fmt.get("type", "text") == "json_schema":   # constrained (constraints.py)
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema", {"type": "object"}), "strict": fmt.get("strict")}}
    elif isinstance(fmt, dict) and fmt.get("type", "text") == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise bad_request(f"'text.format.type' must be text, json_object or json_schema, got "
                          f"{schemas._show(fmt.get('type'))}")
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "stream", "seed", "top_k", "min_p", "stop", "parallel_tool_calls",
                "timings_per_token", "return_progress"):     # the last two: llama-server's telemetry
        if body.get(key) is not None:
            out[key] = body[key]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be an array")
        converted = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad_request(f"'tools[{k}]': only function tools are supported, got "
                                  f"{schemas._show(t.get('type') if isinstance(t, dict) else t)}")
            fn = {k2: t[k2] for k2 in ("name", "description", "parameters") if t.get(k2) is not None}
            converted.append({"type": "function", "function": fn})
        if converted:
            out["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and out.get("tools"):
        out["tool_choice"] = choice
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        out["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
    return out


# --- reply -> response objects ------------------------------------------------------------------------
class ResponseBuilder:
    def __init__(self, st: ServerState, body: dict, n_prompt: int):
        self.id = "resp_" + random_id(32)
        self.created = int(time.time())
        self.model = st.model_name
        self.body = body
        self.n_prompt = n_prompt
        self.seq = 0

    def envelope(self, status: str, output: list, result=None) -> dict:
        b = self.body
        obj = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": output, "error": None,
               "incomplete_details": None, "instructions": b.get("instructions"),
               "max_output_tokens": b.get("max_output_tokens"),
               "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
               "temperature": b.get("temperature"), "top_p": b.get("top_p"),
               "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
               "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": b.get("metadata") or {},
               "reasoning": b.get("reasoning"), "store": False, "usage": None}
        if result is not None:
            obj["usage"] = {"input_tokens": result.n_prompt, "output_tokens": result.n_generated,
                            "total_tokens": result.n_prompt + result.n_generated,
                            "input_tokens_details": {"cached_tokens": result.n_cached},
                            "output_tokens_details": {"reasoning_tokens": 0}}
            if result.finish_reason == "length":
                obj["status"] = "incomplete"
                obj["incomplete_details"] = {"reason": "max_output_tokens"}
        return obj

    @staticmethod
    def output_items(msg: dict, cut: bool = False) -> list[dict]:
        """The reply's items; cut (the token limit ended it): its message is "incomplete", as the
        response is."""
        items: list[dict] = []
        if msg.get("reasoning_content"):
            items.append(reasoning_item("rs_" + random_id(24), msg["reasoning_content"]))
        if msg.get("content") or not msg.get("tool_calls"):
            items.append(message_item("msg_" + random_id(24), msg.get("content") or "",
                                      "incomplete" if cut else "completed"))
        for call in msg.get("tool_calls") or []:
            items.append(call_item("fc_" + random_id(24), call, "completed"))
        return items

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: dict, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


async def _stream(chat: jobs.ChatJob, rb: ResponseBuilder):
    output: list[dict] = []
    current: dict | None = None          # the item being written: message or reasoning
    text = ""

    def close_current(status: str = "completed"):
        nonlocal current, text
        if current is None:
            return []
        idx = len(output) - 1
        out = []
        if current["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(rb.event("response.output_text.done", item_id=current["id"], output_index=idx,
                                content_index=0, text=text, logprobs=[]))
            out.append(rb.event("response.content_part.done", item_id=current["id"], output_index=idx,
                                content_index=0, part=part))
            output[idx] = message_item(current["id"], text, status)
        else:
            out.append(rb.event("response.reasoning_text.done", item_id=current["id"], output_index=idx,
                                content_index=0, text=text))
            output[idx] = reasoning_item(current["id"], text)
        out.append(rb.event("response.output_item.done", output_index=idx, item=output[idx]))
        current, text = None, ""
        return out

    def open_item(kind: str):
        nonlocal current
        if kind == "message":
            current = message_item("msg_" + random_id(24), "", "in_progress")
            current["content"] = []
        else:
            current = reasoning_item("rs_" + random_id(24), "")
            current["content"] = []
        output.append(current)
        idx = len(output) - 1
        out = [rb.event("response.output_item.added", output_index=idx, item=dict(current))]
        if kind == "message":
            out.append(rb.event("response.content_part.added", item_id=current["id"], output_index=idx,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []}))
        else:
            out.append(rb.event("response.content_part.added", item_id=current["id"], output_index=idx,
                                content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    try:
        yield rb.event("response.created", response=rb.envelope("in_progress", []))
        yield rb.event("response.in_progress", response=rb.envelope("in_progress", []))
        per_token = chat.req.gen.timings_per_token
        async for kind, *rest in jobs.chat_stream(chat):
            if kind == "progress":      # llama-server: a response.in_progress event with prompt_progress
                (progress,) = rest
                yield rb.event("response.in_progress", response=rb.envelope("in_progress", []),
                               **with_telemetry({}, progress, per_token))
            elif kind == "delta":
                (delta,) = rest
                for key, item_kind, event_name in (("reasoning_content", "reasoning", "response.reasoning_text.delta"),
                                                   ("content", "message", "response.output_text.delta")):
                    piece = delta.get(key)
                    if not piece:
                        continue
                    if current is None or current["type"] != item_kind:
                        for e in close_current() + open_item(item_kind):
                            yield e
                    text += piece
                    extra = {"logprobs": []} if item_kind == "message" else {}
                    if per_token and chat.stats is not None:
                        extra["timings"] = timings(chat.stats)
                    yield rb.event(event_name, item_id=current["id"], output_index=len(output) - 1,
                                   content_index=0, delta=piece, **extra)
                for call in delta.get("tool_calls") or []:
                    for e in close_current():
                        yield e
                    item = call_item("fc_" + random_id(24), call, "in_progress")
                    output.append({**item, "arguments": ""})
                    idx = len(output) - 1
                    yield rb.event("response.output_item.added", output_index=idx, item=dict(output[idx]))
                    yield rb.event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                   delta=item["arguments"])
                    yield rb.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                   arguments=item["arguments"], name=item["name"])
                    output[idx] = {**item, "status": "completed"}
                    yield rb.event("response.output_item.done", output_index=idx, item=output[idx])
            else:
                result, _ = rest
                if not output:
                    for e in open_item("message"):
                        yield e
                for e in close_current("incomplete" if result.finish_reason == "length" else "completed"):
                    yield e
                final = rb.envelope("completed", output, result)
                # response.completed even when the token limit cut the reply (status "incomplete"):
                # the openai client's stream only finishes on that event, and llama-server sends it
                yield rb.event("response.completed", response=final, timings=timings(result))
    except ApiError as exc:
        if exc.status != 499:
            failed = rb.envelope("failed", output)
            failed["error"] = {"code": "server_error", "message": exc.message}
            yield rb.event("response.failed", response=failed)
    except Exception as exc:
        log.exception("responses stream failed")
        failed = rb.envelope("failed", output)
        failed["error"] = {"code": "server_error", "message": f"internal error: {type(exc).__name__}"}
        yield rb.event("response.failed", response=failed)
    finally:
        chat.stream.close()


@endpoint
async def create(request: Request, st: ServerState) -> Response:
    st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    chat = await jobs.start_chat(request, st, to_chat_body(body))
    rb = ResponseBuilder(st, body, len(chat.prompt))
    if chat.req.gen.stream:
        return SSEResponse(_stream(chat, rb))
    msg, _, result = await jobs.chat_message(chat)
    return JSONResp(rb.envelope("completed", rb.output_items(msg, result.finish_reason == "length"), result))
