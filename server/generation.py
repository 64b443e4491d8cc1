"""POST /v1/chat/completions, /v1/completions and llama-server's /completion: from a request
body to a job's events (jobs.py) to an OpenAI (or llama-server) response, streamed or not.

    read (size-limited) -> validate (chat_request.py, completion_request.py) -> render + tokenize in a thread -> fits? ->
    queue a job (worker.py) -> wait for its first event -> SSE chunks or one JSON object

Streaming waits for the first event before it sends headers, so an error the engine finds
while processing the prompt is still an ordinary HTTP error; after that, an error is a
`data: {"error": ...}` chunk (also when the server's shutdown cancels the stream). However a
response ends - done, client gone, shutdown - the job is cancelled if it is still running.

/completion with several prompts (an array of prompts) runs them one after another and answers
an array of results (not streamed), as llama-server answers a batch.

`n` (or llama-server's `n_cmpl`) > 1: one job whose engine run prefills the prompt once and
writes the choices one after another (engine/engine.py); every event carries its choice's
index. Streamed, each choice's chunks end with its own finish chunk before the next choice
starts; usage and timings at the end cover them all (the prompt counted once).

A streamed request with `return_progress` gets llama-server's prompt_progress chunks while the
prompt is processed (once, before choice 0's text: the choices share the prefill);
`timings_per_token` puts the timings of the chunk's choice so far on every streamed chunk.
"""
from __future__ import annotations

import logging

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from genie_rt.engine.generate import Progress

from . import chat_request, completion_request, jobs
from .errors import ApiError, JSONResp, api_error, endpoint
from .openai_format import SSE_DONE, ChatFormatter, CompletionFormatter, NativeCompletionFormatter, sse, with_telemetry
from .state import FINGERPRINT, ServerState
from .streaming import JobStream, SSEResponse, read_json
from .worker import DISCONNECTED

log = logging.getLogger("genie_rt.server")

# kept for callers of the old names (info.py, tests)
render_chat = jobs.render_chat
forced_tool_start = jobs.forced_tool_start


def select_fields(obj: dict, fields: list[str] | None) -> dict:
    """llama-server's response_fields: only these keys, "a/b" naming a nested one (missing: left out)."""
    if not fields:
        return obj
    out = {}
    for name in fields:
        value, found = obj, True
        for part in name.split("/"):
            if isinstance(value, dict) and part in value:
                value = value[part]
            else:
                found = False
                break
        if found:
            out[name] = value
    return out


def _sse_error(exc: BaseException) -> bytes:
    return sse({"error": api_error(exc).error_object()})


async def _sse(stream: JobStream, event, prelude: list[dict], on_text, on_done, done_marker: bool = True,
               n: int = 1):
    """SSE bytes for one job: the prelude chunks, `on_text(event)` chunks per Delta (and per
    Progress event, with return_progress), then `on_done(done_event)` chunks at the end of each
    of its n choices and [DONE] (unless done_marker is False: llama-server's native /completion
    sends none) - or an error chunk, or nothing once the client left."""
    try:
        for chunk in prelude:
            yield sse(chunk)
        async for ev in jobs.events(stream, event, n):
            chunks = on_done(ev) if hasattr(ev, "result") else on_text(ev)
            for chunk in chunks:
                yield sse(chunk)
        if done_marker:
            yield SSE_DONE
    except ApiError as exc:
        if exc.status != 499:         # 499: the client is gone, nobody reads an error
            yield _sse_error(exc)
    except Exception as exc:  # a bug here must still end the stream the way a client understands
        log.exception("stream failed")
        yield _sse_error(exc)
    finally:
        stream.close()


def _chat_stream(chat: jobs.ChatJob, fmt: ChatFormatter, st: ServerState) -> SSEResponse:
    """chat.completion.chunk events: per choice (its `index`) a role chunk, its deltas and its
    finish chunk, one choice after another; then usage (when asked) covering every choice."""
    n, include_usage, per_token = chat.req.gen.n, chat.req.gen.include_usage, chat.req.gen.timings_per_token
    started, results = {0}, []

    def opening(index: int) -> list[dict]:
        if index in started:
            return []
        started.add(index)
        return [fmt.first_chunk(index)]

    def text(ev) -> list[dict]:
        if isinstance(ev, Progress):   # as llama-server: choice 0's role delta again, with the progress
            return [with_telemetry(fmt.first_chunk(), ev, per_token)]
        chunks = opening(ev.index) + fmt.text_chunks(ev.text, ev.probs, ev.index)
        if chunks and per_token:
            with_telemetry(chunks[-1], ev, True)
        return chunks

    def done(ev) -> list[dict]:
        chunks, has_calls = fmt.finish_chunks(ev.result, ev.index)
        jobs._count_tool_calls(st, ev.result, has_calls)
        results.append(ev.result)
        chunks = opening(ev.index) + chunks
        return fmt.end_chunks(chunks, results, include_usage) if len(results) == n else chunks
    return SSEResponse(_sse(chat.stream, chat.event, [fmt.first_chunk()], text, done, n=n))


@endpoint
async def chat_completions(request: Request, st: ServerState) -> Response:
    chat = await jobs.start_chat(request, st)
    fmt = ChatFormatter(st.model_name, FINGERPRINT, chat.output, st.engine.tokenizer)
    if chat.req.gen.stream:
        return _chat_stream(chat, fmt, st)
    choices = await jobs.collect_choices(chat.stream, chat.event, chat.req.gen.n)
    for index, (generated, _, _) in enumerate(choices):
        fmt.output_of(index).text = chat.forced + generated
    results = [result for _, _, result in choices]
    response, calls = fmt.response(results)
    for result, has_calls in zip(results, calls):
        jobs._count_tool_calls(st, result, has_calls)
    if st.settings.verbose or chat.req.verbose:   # llama-server's --verbose / "verbose": what the model got
        response["__verbose"] = {"prompt": chat.prompt_text, "content": choices[0][0]}
    return JSONResp(response)


@endpoint
async def chat_input_tokens(request: Request, st: ServerState) -> Response:
    """POST /v1/chat/completions/input_tokens: the prompt tokens a chat request would have."""
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    req = await run_in_threadpool(chat_request.parse_chat, body, st.vocab_size, st.tokenize_text, st.settings.defaults)

    def count() -> int:
        text, _ = jobs.render_chat(engine.template, req.messages, req.tools, req.template_kwargs,
                                   req.add_generation_prompt)
        return len(jobs.encode_prompt(st, text, True, True, None))
    return JSONResp({"input_tokens": await run_in_threadpool(count)})


@endpoint
async def completions(request: Request, st: ServerState) -> Response:
    """POST /v1/completions: OpenAI text_completion objects."""
    return await _completion(request, st, native=False)


@endpoint
async def completion_native(request: Request, st: ServerState) -> Response:
    """POST /completion (and /completions): llama-server's own completion objects."""
    return await _completion(request, st, native=True)


async def _prompt_ids(st: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and not any(isinstance(t, str) for t in prompt):
        ids = prompt
    else:  # as llama-server: BOS if the model wants one, and special tokens (<|im_start|>) parsed
        ids = await run_in_threadpool(jobs.tokenize_content, st, prompt, True, True, st.engine.n_ctx - 1)
    jobs.check_prompt(ids, st.engine.n_ctx)
    return ids


async def _completion(request: Request, st: ServerState, native: bool) -> Response:
    st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    req = await run_in_threadpool(completion_request.parse_completion, body, st.vocab_size, st.tokenize_text,
                                  st.settings.defaults, True)
    del body
    if req.batch is not None:
        return await _completion_batch(request, st, req, native)
    n = req.gen.n
    prompt = await _prompt_ids(st, req.prompt)
    stream = jobs.start_job(request, st, req.gen, prompt)
    event = await jobs.first_event(stream)
    if native:
        nfmt = NativeCompletionFormatter(st, req, prompt)
        if req.gen.stream:
            return SSEResponse(_sse(stream, event, [], lambda ev: [nfmt.text_chunk(ev)]
                                    if isinstance(ev, Progress) or ev.text or ev.tokens else [],
                                    lambda ev: [nfmt.response("", [], ev.result, ev.index)], done_marker=False,
                                    n=n))
        choices = await jobs.collect_choices(stream, event, n)
        objs = [select_fields(nfmt.response(text, tokens, result, index), req.response_fields)
                for index, (text, tokens, result) in enumerate(choices)]
        return JSONResp(objs[0] if n == 1 else objs)    # llama-server: an array for n_cmpl > 1
    fmt = CompletionFormatter(st.model_name, FINGERPRINT, st.engine.tokenizer)
    if req.gen.stream:
        per_token, results = req.gen.timings_per_token, []

        def text(ev) -> list[dict]:
            if isinstance(ev, Progress):
                return [with_telemetry(fmt.text_chunk(""), ev, per_token)]
            if ev.text or ev.probs:
                return [with_telemetry(fmt.text_chunk(ev.text, ev.probs, ev.index), ev, per_token)]
            return []

        def done(ev) -> list[dict]:
            results.append(ev.result)
            chunks = [fmt.finish_chunk(ev.result, ev.index)]
            return fmt.end_chunks(chunks, results, req.gen.include_usage) if len(results) == n else chunks
        return SSEResponse(_sse(stream, event, [], text, done, n=n))
    choices = await jobs.collect_choices(stream, event, n)
    return JSONResp(fmt.response([(text, result) for text, _, result in choices]))


async def _completion_batch(request: Request, st: ServerState, req, native: bool) -> Response:
    """Several prompts: run one after another, answer the list (llama-server's batch answer);
    with n choices each, prompt k's choice j has index k * n + j, as llama-server numbers them."""
    if req.gen.stream:
        raise ApiError(400, "'prompt' with several prompts cannot be streamed here; send one prompt per "
                            "request to stream")
    n = req.gen.n
    results = []
    fmt = CompletionFormatter(st.model_name, FINGERPRINT, st.engine.tokenizer)
    choices = []
    for k, one in enumerate(req.batch):
        prompt = await _prompt_ids(st, one)
        stream = jobs.start_job(request, st, req.gen, prompt)
        event = await jobs.first_event(stream)
        outs = await jobs.collect_choices(stream, event, n)
        if native:
            single = completion_request.CompletionRequest(gen=req.gen, prompt=one, return_tokens=req.return_tokens)
            nfmt = NativeCompletionFormatter(st, single, prompt)
            results += [{**nfmt.response(text, tokens, result), "index": k * n + j}
                        for j, (text, tokens, result) in enumerate(outs)]
        else:
            obj = fmt.response([(text, result) for text, _, result in outs])
            choices += [{**choice, "index": k * n + j} for j, choice in enumerate(obj["choices"])]
            results.append(obj)
    if native:
        return JSONResp(results)
    merged = results[-1]
    merged["choices"] = choices
    merged["usage"] = {"completion_tokens": sum(r["usage"]["completion_tokens"] for r in results),
                       "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in results),
                       "total_tokens": sum(r["usage"]["total_tokens"] for r in results)}
    return JSONResp(merged)


__all__ = ["chat_completions", "completions", "completion_native", "render_chat", "forced_tool_start",
           "DISCONNECTED"]
