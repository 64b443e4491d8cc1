"""POST /v1/chat/completions, /v1/completions and llama-server's /completion: from a request
body to a job's events (jobs.py) to an OpenAI (or llama-server) response, streamed or not.

    read (size-limited) -> validate (schemas.py) -> render + tokenize in a thread -> fits? ->
    queue a job (worker.py) -> wait for its first event -> SSE chunks or one JSON object

Streaming waits for the first event before it sends headers, so an error the engine finds
while processing the prompt is still an ordinary HTTP error; after that, an error is a
`data: {"error": ...}` chunk (also when the server's shutdown cancels the stream). However a
response ends - done, client gone, shutdown - the job is cancelled if it is still running.

/completion with several prompts (an array of prompts) runs them one after another and answers
an array of results (not streamed), as llama-server answers a batch.
"""
from __future__ import annotations

import logging

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from . import jobs, schemas
from .errors import ApiError, JSONResp, api_error, endpoint
from genie_rt.engine.generate import Progress

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


async def _sse(stream: JobStream, event, prelude: list[dict], on_text, on_done, done_marker: bool = True):
    """SSE bytes for one job: the prelude chunks, `on_text(event)` chunks per Delta (and per
    Progress event, with return_progress), then
    `on_done(result)` chunks and [DONE] (unless done_marker is False: llama-server's native
    /completion sends none) - or an error chunk, or nothing once the client left."""
    try:
        for chunk in prelude:
            yield sse(chunk)
        async for ev in jobs.events(stream, event):
            chunks = on_done(ev.result) if hasattr(ev, "result") else on_text(ev)
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


@endpoint
async def chat_completions(request: Request, st: ServerState) -> Response:
    chat = await jobs.start_chat(request, st)
    fmt = ChatFormatter(st.model_name, FINGERPRINT, chat.output, st.engine.tokenizer)
    include_usage = chat.req.gen.include_usage
    if chat.req.gen.stream:
        per_token = chat.req.gen.timings_per_token

        def on_event(ev) -> list[dict]:
            if isinstance(ev, Progress):   # as llama-server: the role delta again, with the progress
                return [with_telemetry(fmt.first_chunk(), ev, per_token)]
            chunks = fmt.text_chunks(ev.text, ev.probs)
            if chunks and per_token:
                with_telemetry(chunks[-1], ev, True)
            return chunks

        def done(result) -> list[dict]:
            chunks, has_calls = fmt.final_chunks(result, include_usage)
            jobs._count_tool_calls(st, result, has_calls)
            return chunks
        return SSEResponse(_sse(chat.stream, chat.event, [fmt.first_chunk()], on_event, done))
    response: dict = {}
    for k in range(chat.req.gen.n):    # n > 1: one job per choice; the first one's usage, as llama-server
        job = chat if k == 0 else await jobs.next_choice(request, chat)
        generated, _, result = await jobs.collect(job.stream, job.event)
        job.output.text = job.forced + generated
        fmt.output = job.output
        one, has_calls = fmt.response(result)
        jobs._count_tool_calls(st, result, has_calls)
        if k == 0:
            response = one
            if st.settings.verbose or chat.req.verbose:   # llama-server's --verbose / "verbose": what the model got
                response["__verbose"] = {"prompt": chat.prompt_text, "content": generated}
        else:
            response["choices"].append({**one["choices"][0], "index": k})
    return JSONResp(response)


@endpoint
async def chat_input_tokens(request: Request, st: ServerState) -> Response:
    """POST /v1/chat/completions/input_tokens: the prompt tokens a chat request would have."""
    engine = st.ready_engine()
    body = await read_json(request, st.settings.max_body_bytes)
    req = await run_in_threadpool(schemas.parse_chat, body, st.vocab_size, st.tokenize_text, st.settings.defaults)

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
    req = await run_in_threadpool(schemas.parse_completion, body, st.vocab_size, st.tokenize_text,
                                  st.settings.defaults, True)
    del body
    jobs.check_choices(st, req.gen)
    if req.batch is not None or req.gen.n > 1:
        return await _completion_batch(request, st, req, native)
    prompt = await _prompt_ids(st, req.prompt)
    stream = jobs.start_job(request, st, req.gen, prompt)
    event = await jobs.first_event(stream)
    if native:
        nfmt = NativeCompletionFormatter(st, req, prompt)
        if req.gen.stream:
            return SSEResponse(_sse(stream, event, [], lambda ev: [nfmt.text_chunk(ev)]
                                    if isinstance(ev, Progress) or ev.text or ev.tokens else [],
                                    lambda result: [nfmt.response("", [], result)], done_marker=False))
        text, tokens, result = await jobs.collect(stream, event)
        return JSONResp(select_fields(nfmt.response(text, tokens, result), req.response_fields))
    fmt = CompletionFormatter(st.model_name, FINGERPRINT, st.engine.tokenizer)
    if req.gen.stream:
        def on_event(ev) -> list[dict]:
            if isinstance(ev, Progress):
                return [with_telemetry(fmt.text_chunk(""), ev, req.gen.timings_per_token)]
            if ev.text or ev.probs:
                return [with_telemetry(fmt.text_chunk(ev.text, ev.probs), ev, req.gen.timings_per_token)]
            return []
        return SSEResponse(_sse(stream, event, [], on_event,
                                lambda result: fmt.final_chunks(result, req.gen.include_usage)))
    text, _, result = await jobs.collect(stream, event)
    return JSONResp(fmt.response(text, result))


async def _completion_batch(request: Request, st: ServerState, req, native: bool) -> Response:
    """Several prompts, or n > 1 choices of each: run one after another, answer the list
    (llama-server's batch answer: n_cmpl results per prompt)."""
    if req.gen.stream:
        raise ApiError(400, "'prompt' with several prompts cannot be streamed here; send one prompt per "
                            "request to stream")
    results = []
    fmt = CompletionFormatter(st.model_name, FINGERPRINT, st.engine.tokenizer)
    choices = []
    prompts = [one for one in (req.batch or [req.prompt]) for _ in range(req.gen.n)]
    for k, one in enumerate(prompts):
        prompt = await _prompt_ids(st, one)
        stream = jobs.start_job(request, st, req.gen, prompt)
        event = await jobs.first_event(stream)
        text, tokens, result = await jobs.collect(stream, event)
        if native:
            single = schemas.CompletionRequest(gen=req.gen, prompt=one, return_tokens=req.return_tokens)
            results.append({**NativeCompletionFormatter(st, single, prompt).response(text, tokens, result), "index": k})
        else:
            obj = fmt.response(text, result)
            choices.append({**obj["choices"][0], "index": k})
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
