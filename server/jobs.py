"""What every generation route shares, whatever API it speaks: prompt -> job -> events.

    prompt = await prompt_ids(st, text, add_special=True, parse_special=True)   # bounded, checked
    stream = start_job(request, st, gen, prompt)          # queued (503 when full / shutting down)
    event = await first_event(stream)                     # the prompt is processed by then
    async for ev in events(stream, event): ...            # (Progress...) Delta..., Done; ApiError on failure

    chat = await start_chat(request, st, body)            # an OpenAI chat body: parse, render, start
    msg, has_calls, result = await chat_message(chat)     # non-streamed
    async for kind, *rest in chat_stream(chat): ...       # ("progress", Progress) ... with return_progress,
                                                          # ("delta", {...}) ..., ("done", result, has_calls)

The OpenAI routes (generation.py), Anthropic's /v1/messages (anthropic.py), the Responses API
(responses.py) and Ollama's /api/chat (ollama.py) all turn their request into an OpenAI chat
body and come here, so validation, templating, tool-call and reasoning parsing, the queue,
cancellation and metrics are one code path; each module only translates shapes.

Errors: before the first event they are ordinary HTTP errors (ApiError). After it, `events`
raises ApiError for an engine failure, a cancelled generation (503: server shutdown) or a
disconnect (499): the caller writes its API's error event. However it ends, the job is
cancelled if still running (JobStream.close in every `finally`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from genie_rt.engine.chat import TOOL_CALL_START
from genie_rt.engine.chat_caps import template_caps
from genie_rt.engine.generate import Delta, Done, GenerationRequest, Progress

from . import chat_request, completion_request, schemas
from .constraints import tool_constraint
from .errors import ApiError, api_error, bad_request, exceed_context
from .openai_format import ChatOutput, prompt_opens_thinking
from .prompt_limits import TextBudget, TooManyTokens, encode_bounded
from .state import ServerState
from .streaming import JobStream, read_json
from .worker import DISCONNECTED, Job, QueueFull, ShuttingDown

log = logging.getLogger("genie_rt.server")


# --- prompts --------------------------------------------------------------------------------------
def text_budget(st: ServerState) -> TextBudget:
    budget = getattr(st, "_text_budget", None)
    if budget is None or budget[0] is not st.engine:
        budget = (st.engine, TextBudget(st.engine.tokenizer))
        st._text_budget = budget
    return budget[1]


def encode_prompt(st: ServerState, text: str, add_special: bool, parse_special: bool, limit: int | None) -> list[int]:
    """Token ids of `text`; 400 exceed_context_size as soon as more than `limit` is certain."""
    try:
        return encode_bounded(st.engine.tokenizer, text, add_special, parse_special, limit,
                              None if limit is None else text_budget(st))
    except TooManyTokens as exc:
        raise exceed_context(exc.n_at_least, st.engine.n_ctx) from None


def tokenize_content(st: ServerState, content, add_special: bool, parse_special: bool,
                     limit: int | None = None) -> list[int]:
    """A prompt or /tokenize content: text, or llama-server's mixed list of texts and token ids."""
    if isinstance(content, str):
        return encode_prompt(st, content, add_special, parse_special, limit)
    if isinstance(content, list):
        ids: list[int] = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                left = None if limit is None else max(0, limit - len(ids))
                ids += encode_prompt(st, part, add_special and k == 0, parse_special, left)
            else:
                ids.append(completion_request.validate_token_id(part, f"content[{k}]", st.vocab_size))
            if limit is not None and len(ids) > limit:
                raise exceed_context(len(ids), st.engine.n_ctx)
        return ids
    raise bad_request("'content' must be a string or an array of strings and token ids")


def check_prompt(prompt: list[int], n_ctx: int) -> None:
    if not prompt:
        raise bad_request("the prompt is empty")
    if len(prompt) >= n_ctx:
        raise exceed_context(len(prompt), n_ctx)


# --- jobs -----------------------------------------------------------------------------------------
def start_job(request: Request, st: ServerState, gen: schemas.GenerationFields, prompt: list[int],
              constraint=None) -> JobStream:
    """Queue a generation; `constraint` (a chat's tool-call grammar) replaces gen.constraint. A
    streamed request with return_progress gets Progress events, one per -b/--batch-size tokens
    of the prompt (llama-server sends prompt_progress only while streaming)."""
    job = Job(GenerationRequest(prompt=prompt, params=gen.params, max_tokens=gen.max_tokens, stop=gen.stop,
                                ignore_eos=gen.ignore_eos, conversation_id=gen.conversation_id,
                                constraint=constraint if constraint is not None else gen.constraint,
                                n_probs=gen.n_probs, logprobs=gen.logprobs,
                                post_sampling_probs=gen.post_sampling_probs, n=gen.n,
                                progress_batch=st.settings.n_batch if gen.stream and gen.return_progress else 0),
              asyncio.get_running_loop())
    try:
        st.worker.submit(job)
    except QueueFull as exc:
        st.metrics.on_rejected("queue_full")
        raise api_error(exc, st.settings.retry_after_s) from None
    except ShuttingDown as exc:
        raise api_error(exc, st.settings.retry_after_s) from None
    return JobStream(st.worker, job, request.receive)


async def first_event(stream: JobStream):
    """Wait for the first event (the prompt is processed by then); errors become HTTP errors."""
    try:
        event = await stream.next()
    except BaseException:
        stream.close()
        raise
    if event is DISCONNECTED or isinstance(event, BaseException):
        stream.close()
        raise api_error(ApiError(499, "client disconnected") if event is DISCONNECTED else event)
    if isinstance(event, Done) and event.result.finish_reason == "cancelled":
        stream.close()
        raise ApiError(503, "the generation was cancelled: the server is shutting down",
                       headers={"Connection": "close"})
    return event


async def events(stream: JobStream, event, n: int = 1) -> AsyncIterator:
    """(Progress events, with return_progress: the prompt's, before choice 0,) then Delta events
    and the Done - of each of the job's n choices in turn (each event's `index`); ApiError for a
    failure, a cancelled run or a disconnect."""
    done = 0
    try:
        while True:
            if isinstance(event, (Delta, Progress)):
                yield event
            elif isinstance(event, Done):
                if event.result.finish_reason == "cancelled":  # server shutdown
                    raise ApiError(503, "the generation was cancelled: the server is shutting down")
                yield event
                done += 1
                if done == n:
                    return
            elif event is DISCONNECTED:
                raise ApiError(499, "client disconnected")
            elif isinstance(event, BaseException):
                raise api_error(event)
            event = await stream.next()
    finally:
        stream.close()


async def collect(stream: JobStream, event) -> tuple[str, list[int], Any]:
    """All text and token ids of a non-streamed job, and its result."""
    return (await collect_choices(stream, event, 1))[0]


async def collect_choices(stream: JobStream, event, n: int) -> list[tuple[str, list[int], Any]]:
    """(text, token ids, result) of each of a non-streamed job's n choices."""
    pieces: list[list[str]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    out = []
    async for ev in events(stream, event, n):
        if isinstance(ev, Delta):
            pieces[ev.index].append(ev.text)
            tokens[ev.index] += ev.tokens
        elif isinstance(ev, Done):
            out.append(("".join(pieces[ev.index]), tokens[ev.index], ev.result))
    if len(out) != n:
        raise ApiError(500, "the generation ended without a result")
    return out


# --- chat ------------------------------------------------------------------------------------------
def render_chat(template, messages: list, tools, kwargs: dict, add_generation_prompt: bool = True
                ) -> tuple[str, bool]:
    """The prompt text of a chat request, and whether it ends with a prefill. As llama-server,
    a final assistant message is a prefill: the conversation before it is rendered with the
    generation prompt and its text appended as is, so the model continues it (no end-of-turn)
    and the reply is what follows. Otherwise add_generation_prompt says whether the assistant's
    turn is opened."""
    last_is_prefill = bool(messages) and messages[-1].get("role") == "assistant" and not messages[-1].get("tool_calls")
    if last_is_prefill:
        if len(messages) > 1 and messages[-2].get("role") == "assistant":
            raise bad_request("'messages' ends with two assistant messages; only the last one can "
                              "be a prefill for the reply")
        content = messages[-1].get("content")
        prefill = content if isinstance(content, str) else "\n\n".join(   # text parts: llama-server's join
            p.get("text", "") for p in content or [] if isinstance(p, dict))
        return template.render(messages[:-1], tools=tools, add_generation_prompt=True, **kwargs) + prefill, True
    return template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs), False


def close_forced_think(text: str, reasoning_off: bool) -> str:
    """With thinking off, a template that always opens a think block (DeepSeek-R1, QwQ) gets it
    closed, as llama-server does for --reasoning off."""
    if reasoning_off and prompt_opens_thinking(text):
        return text.rstrip(" ") + "</think>"
    return text


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


@dataclass
class ChatJob:
    req: chat_request.ChatRequest
    output: ChatOutput
    forced: str
    prompt: list[int]
    stream: JobStream
    event: Any
    st: ServerState
    prompt_text: str = ""
    stats: Any = None           # the counts and times of the last Delta (timings_per_token)


def tool_grammar(st: ServerState, req: chat_request.ChatRequest, forced: str, prefilled: bool):
    """The tool-call constraint of a chat with tools (None without tools, with a `grammar`,
    or when the reply continues a prefilled assistant message)."""
    if not req.tools or prefilled or (req.gen.constraint is not None and req.gen.response_schema is None):
        return None
    tools = req.tools
    if req.forced_tool:
        mode = req.forced_tool if forced else "open"
        if isinstance(req.forced_tool, str):      # a named function: only it may be called
            tools = [t for t in tools if t["function"]["name"] == req.forced_tool]
    else:
        mode = "auto"
    schema = req.gen.response_schema if mode == "auto" else None
    # parallel_tool_calls as llama-server reads it: absent, a template that writes calls itself
    # (Qwen/Hermes `<tool_call>` blocks) may write several, and a model without one makes one
    parallel = req.parallel_tool_calls
    if parallel is None:
        parallel = TOOL_CALL_START in (getattr(st.engine.template, "source", None) or "")
    return tool_constraint(tools, mode, getattr(st.engine, "tokenizer", None), schema, parallel)


_warned_tools: set[int] = set()


def _warn_unrendered_tools(template) -> None:
    """Once per template: a request's tools that its template does not show the model (a base
    model's transcript, SmolLM2's template). The request still runs: its calls are parsed, and a
    forced tool_choice still makes one; /props' chat_template_caps says the same."""
    if id(template) in _warned_tools or template_caps(template)["supports_tools"]:
        return
    _warned_tools.add(id(template))
    log.warning("the chat template does not render tools: requests with tools run, but the model "
                "is not shown them (tool_choice \"required\" or a named function still forces a call)")


def _render(st: ServerState, req: chat_request.ChatRequest) -> tuple[str, str, list[int], object]:
    engine = st.engine
    if req.tools:
        _warn_unrendered_tools(engine.template)
    text, prefilled = render_chat(engine.template, req.messages, req.tools, req.template_kwargs,
                                  req.add_generation_prompt)
    if not prefilled and req.add_generation_prompt:
        text = close_forced_think(text, req.template_kwargs.get("enable_thinking") is False)
    forced = "" if prefilled else forced_tool_start(engine.template, text, req.forced_tool)
    return (text, forced, encode_prompt(st, text + forced, True, True, engine.n_ctx - 1),
            tool_grammar(st, req, forced, prefilled))


async def start_chat(request: Request, st: ServerState, body: dict | None = None) -> ChatJob:
    """Validate an OpenAI chat body (read from the request when not given), render it, queue it and
    wait for its first event."""
    engine = st.ready_engine()
    if body is None:
        body = await read_json(request, st.settings.max_body_bytes)
    # in the pool: logit_bias may carry text keys to tokenize (megabytes at worst)
    req = await run_in_threadpool(chat_request.parse_chat, body, st.vocab_size, st.tokenize_text, st.settings.defaults)
    text, forced, prompt, tool_spec = await run_in_threadpool(_render, st, req)
    check_prompt(prompt, engine.n_ctx)
    output = ChatOutput(parse_reasoning=req.parse_reasoning, think_open=prompt_opens_thinking(text),
                        parse_tools=req.tools is not None)
    output.start = output.text = forced  # the reply is parsed with its forced start (held back until parsed)
    gen = req.gen
    if engine.template.stop_strings:   # the plain fallback's next "User:" line ends the reply
        gen = replace(gen, stop=list(gen.stop) + [s for s in engine.template.stop_strings
                                                              if s not in gen.stop])
    stream = start_job(request, st, gen, prompt, tool_spec)
    event = await first_event(stream)
    return ChatJob(req, output, forced, prompt, stream, event, st, text + forced)


def _count_tool_calls(st: ServerState, result, has_calls: bool) -> None:
    if has_calls and result.finish_reason == "stop":
        st.metrics.on_tool_calls()


async def chat_message(chat: ChatJob) -> tuple[dict, bool, Any]:
    """The whole assistant message (OpenAI shape), whether it calls tools, and the result."""
    generated, _, result = await collect(chat.stream, chat.event)
    chat.output.text = chat.forced + generated
    msg, has_calls = chat.output.message()
    _count_tool_calls(chat.st, result, has_calls)
    return msg, has_calls, result


async def chat_stream(chat: ChatJob) -> AsyncIterator[tuple]:
    """("progress", Progress) while the prompt is processed (only with return_progress),
    ("delta", OpenAI delta) as the reply grows, then ("done", result, has_calls). Raises ApiError
    on a failure after the first event."""
    async for ev in events(chat.stream, chat.event):
        if isinstance(ev, Progress):
            yield ("progress", ev)
        elif isinstance(ev, Delta):
            chat.stats = ev.stats
            for d in chat.output.feed(ev.text):
                yield ("delta", d)
        else:
            for d in chat.output.feed("", final=True):
                yield ("delta", d)
            _, has_calls = chat.output.message()
            _count_tool_calls(chat.st, ev.result, has_calls)
            yield ("done", ev.result, has_calls)
