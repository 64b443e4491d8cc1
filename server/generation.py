"""POST /v1/chat/completions and /v1/completions: from a request body to a job's events
to an OpenAI response, streamed or not.

    read (size-limited) -> validate (schemas.py) -> render + tokenize in a thread -> fits? ->
    queue a job (worker.py) -> wait for its first event -> SSE chunks or one JSON object

Streaming waits for the first event before it sends headers, so an error the engine finds
while processing the prompt is still an ordinary HTTP error; after that, an error is a
`data: {"error": ...}` chunk. However a response ends - done, client gone, shutdown - the
job is cancelled if it is still running (JobStream.close in every `finally`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from genie_rt.engine.chat import TOOL_CALL_START
from genie_rt.engine.generate import Delta, Done, GenerationRequest

from . import schemas
from .errors import ApiError, JSONResp, api_error, bad_request, endpoint, exceed_context
from .openai_format import (SSE_DONE, ChatFormatter, ChatOutput, CompletionFormatter, NativeCompletionFormatter,
                            prompt_opens_thinking,
                            sse)
from .state import FINGERPRINT, ServerState
from .streaming import JobStream, SSEResponse, read_json
from .worker import DISCONNECTED, Job, QueueFull, ShuttingDown

log = logging.getLogger("genie_rt.server")


def tokenize_content(engine, content, add_special: bool, parse_special: bool, vocab_size: int) -> list[int]:
    if isinstance(content, str):
        return engine.tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
    if isinstance(content, list):  # llama-server's mixed form: strings and token ids
        ids: list[int] = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                ids += engine.tokenizer.encode(part, add_special=add_special and k == 0, parse_special=parse_special)
            else:
                ids.append(schemas.validate_token_id(part, f"content[{k}]", vocab_size))
        return ids
    raise bad_request("'content' must be a string or an array of strings and token ids")


def _check_prompt(prompt: list[int], n_ctx: int) -> None:
    if not prompt:
        raise bad_request("the prompt is empty")
    if len(prompt) >= n_ctx:
        raise exceed_context(len(prompt), n_ctx)


def _start_job(request: Request, st: ServerState, gen: schemas.GenerationFields, prompt: list[int]) -> JobStream:
    job = Job(GenerationRequest(prompt=prompt, params=gen.params, max_tokens=gen.max_tokens, stop=gen.stop,
                                ignore_eos=gen.ignore_eos, conversation_id=gen.conversation_id),
              asyncio.get_running_loop())
    try:
        st.worker.submit(job)
    except QueueFull as exc:
        st.metrics.on_rejected("queue_full")
        raise api_error(exc, st.settings.retry_after_s) from None
    except ShuttingDown as exc:
        raise api_error(exc, st.settings.retry_after_s) from None
    return JobStream(st.worker, job, request.receive)


async def _first_event(stream: JobStream):
    """Wait for the first event (the prompt is processed by then); errors become HTTP errors."""
    try:
        event = await stream.next()
    except BaseException:
        stream.close()
        raise
    if event is DISCONNECTED or isinstance(event, BaseException):
        stream.close()
        raise api_error(ApiError(499, "client disconnected") if event is DISCONNECTED else event)
    return event


async def _collect(stream: JobStream, event) -> tuple[str, Any]:
    """All text of a non-streamed job, and its result."""
    pieces: list[str] = []
    try:
        while True:
            if isinstance(event, Delta):
                pieces.append(event.text)
            elif isinstance(event, Done):
                if event.result.finish_reason == "cancelled":
                    raise ApiError(503, "the generation was cancelled")
                return "".join(pieces), event.result
            elif event is DISCONNECTED:
                raise ApiError(499, "client disconnected")
            elif isinstance(event, BaseException):
                raise api_error(event)
            event = await stream.next()
    finally:
        stream.close()


def _sse_error(exc: BaseException) -> bytes:
    return sse({"error": api_error(exc).error_object()})


async def _sse(stream: JobStream, event, prelude: list[dict], on_text, on_done, done_marker: bool = True):
    """SSE bytes for one job: the prelude chunks, `on_text(piece)` chunks per Delta, then
    `on_done(result)` chunks and [DONE] (unless done_marker is False: llama-server's native
    /completion sends none) - or an error chunk, or nothing once the client left."""
    try:
        for chunk in prelude:
            yield sse(chunk)
        while True:
            if isinstance(event, Delta):
                for chunk in on_text(event.text):
                    yield sse(chunk)
            elif isinstance(event, Done):
                if event.result.finish_reason == "cancelled":  # server shutdown
                    yield _sse_error(ApiError(503, "the generation was cancelled"))
                    return
                for chunk in on_done(event.result):
                    yield sse(chunk)
                if done_marker:
                    yield SSE_DONE
                return
            elif event is DISCONNECTED:
                return
            elif isinstance(event, BaseException):
                yield _sse_error(event)
                return
            event = await stream.next()
    except Exception as exc:  # a bug here must still end the stream the way a client understands
        log.exception("stream failed")
        yield _sse_error(exc)
    finally:
        stream.close()


def render_chat(template, messages: list, tools, kwargs: dict) -> tuple[str, bool]:
    """The prompt text of a chat request, and whether it ends with a prefill. As llama-server,
    a final assistant message is a prefill: the conversation before it is rendered with the
    generation prompt and its text appended as is, so the model continues it (no end-of-turn)
    and the reply is what follows."""
    if messages and messages[-1].get("role") == "assistant" and not messages[-1].get("tool_calls"):
        if len(messages) > 1 and messages[-2].get("role") == "assistant":
            raise bad_request("'messages' ends with two assistant messages; only the last one can "
                              "be a prefill for the reply")
        content = messages[-1].get("content")
        prefill = content if isinstance(content, str) else "".join(
            p.get("text", "") for p in content or [] if isinstance(p, dict))
        return template.render(messages[:-1], tools=tools, add_generation_prompt=True, **kwargs) + prefill, True
    return template.render(messages, tools=tools, add_generation_prompt=True, **kwargs), False


def _render_chat(engine, req: schemas.ChatRequest) -> tuple[str, str, list[int]]:
    """Prompt text (kept for think detection), the reply's forced start, and the ids of both."""
    text, prefilled = render_chat(engine.template, req.messages, req.tools, req.template_kwargs)
    forced = "" if prefilled else forced_tool_start(engine.template, text, req.forced_tool)
    return text, forced, engine.tokenizer.encode(text + forced, add_special=True, parse_special=True)


def forced_tool_start(template, prompt_text: str, forced_tool) -> str:
    """The start of a reply that must call a tool (tool_choice "required", or a named function:
    its name is written too), for templates whose tool calls are Qwen/Hermes `<tool_call>`
    blocks - the format the reply parser reads. Without grammar sampling this is how the call
    is enforced: the model continues inside the block. A prompt that leaves a think block open
    has it closed first (a forced call has no reasoning). "" when nothing is forced or the
    template writes calls another way (then the model decides, as with "auto")."""
    if not forced_tool or TOOL_CALL_START not in (template.source or ""):
        return ""
    start = f"{TOOL_CALL_START}\n"
    if isinstance(forced_tool, str):
        start += '{"name": ' + json.dumps(forced_tool, ensure_ascii=False) + ', "arguments": '
    return ("</think>\n\n" if prompt_opens_thinking(prompt_text) else "") + start


@endpoint
async def chat_completions(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    # in the pool: logit_bias may carry text keys to tokenize (megabytes at worst)
    req = await run_in_threadpool(schemas.parse_chat, body, st.vocab_size, st.tokenize_text)
    text, forced, prompt = await run_in_threadpool(_render_chat, engine, req)
    _check_prompt(prompt, engine.n_ctx)
    output = ChatOutput(parse_reasoning=req.parse_reasoning, think_open=prompt_opens_thinking(text),
                        parse_tools=req.tools is not None)
    output.text = forced        # the reply is parsed with its forced start (held back until parsed)
    fmt = ChatFormatter(st.model_name, FINGERPRINT, output)
    stream = _start_job(request, st, req.gen, prompt)
    event = await _first_event(stream)
    if req.gen.stream:
        def done(result) -> list[dict]:
            chunks, has_calls = fmt.final_chunks(result, req.gen.include_usage)
            if has_calls and result.finish_reason == "stop":
                st.metrics.on_tool_calls()
            return chunks
        return SSEResponse(_sse(stream, event, [fmt.first_chunk()], fmt.text_chunks, done))
    generated, result = await _collect(stream, event)
    output.text = forced + generated
    response, has_calls = fmt.response(result)
    if has_calls and result.finish_reason == "stop":
        st.metrics.on_tool_calls()
    return JSONResp(response)


@endpoint
async def completions(request: Request, st: ServerState) -> Response:
    """POST /v1/completions: OpenAI text_completion objects."""
    return await _completion(request, st, native=False)


@endpoint
async def completion_native(request: Request, st: ServerState) -> Response:
    """POST /completion (and /completions): llama-server's own completion objects."""
    return await _completion(request, st, native=True)


async def _completion(request: Request, st: ServerState, native: bool) -> Response:
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    req = await run_in_threadpool(schemas.parse_completion, body, st.vocab_size, st.tokenize_text)
    if isinstance(req.prompt, list) and not any(isinstance(t, str) for t in req.prompt):
        prompt = req.prompt
    else:  # as llama-server: BOS if the model wants one, and special tokens (<|im_start|>) parsed
        prompt = await run_in_threadpool(tokenize_content, engine, req.prompt, True, True, st.vocab_size)
    _check_prompt(prompt, engine.n_ctx)
    stream = _start_job(request, st, req.gen, prompt)
    event = await _first_event(stream)
    if native:
        nfmt = NativeCompletionFormatter(st.model_name, req.gen,
                                         req.prompt if isinstance(req.prompt, str) else "")
        if req.gen.stream:
            return SSEResponse(_sse(stream, event, [], lambda text: [nfmt.text_chunk(text)] if text else [],
                                    lambda result: [nfmt.response("", result)], done_marker=False))
        text, result = await _collect(stream, event)
        return JSONResp(nfmt.response(text, result))
    fmt = CompletionFormatter(st.model_name, FINGERPRINT)
    if req.gen.stream:
        return SSEResponse(_sse(stream, event, [], lambda text: [fmt.text_chunk(text)] if text else [],
                                lambda result: fmt.final_chunks(result, req.gen.include_usage)))
    text, result = await _collect(stream, event)
    return JSONResp(fmt.response(text, result))
