"""OpenAI response objects and SSE chunks, shaped as llama-server shapes them.

What it does
- `ChatOutput`: the streaming state machine for one chat reply. It keeps the generated
  text, re-parses it after every piece with engine/chat.py (`split_reasoning` for
  `<think>`, `parse_tool_calls` for `<tool_call>`, both with partial=True while streaming)
  and returns the differences as OpenAI deltas: reasoning_content, content, and each tool
  call once its block is closed (name, id and complete arguments in one delta). The same
  parse with partial=False gives the non-streamed message. The partial parses hold back any
  text whose reading can still change (leading whitespace or a `<thi` before a possible
  `<think>`, a tag still being written), so each one is a prefix of the final parse and the
  streamed deltas add up exactly to the non-streamed message, however the text is cut.
  As llama-server, the reply is read as starting inside a think block only when the prompt
  opened one (think_open); otherwise only a leading `<think>...</think>` is reasoning and a
  stray `</think>` later is content (inferring reasoning from it would mean holding back all
  content until the end of every reply).
- Builders for chat.completion, chat.completion.chunk, text_completion, usage (with
  prompt_tokens_details.cached_tokens) and llama-server's `timings`.
- SSE framing: `data: {json}\\n\\n`, `data: [DONE]\\n\\n`; llama-server's streamed telemetry
  (prompt_progress with return_progress, timings with timings_per_token).

What it deliberately does not do: HTTP, validation, or tool-call formats other than the
Qwen/Hermes `<tool_call>` JSON that engine/chat.py reads.
"""
from __future__ import annotations

import secrets
import string
import time
from dataclasses import replace

from genie_rt.engine.chat import THINK_START, parse_tool_calls, split_reasoning

from . import logprobs as lp
from .errors import json_bytes
from .schemas import RANDOM_SEED

_ALPHABET = string.ascii_letters + string.digits
SSE_DONE = b"data: [DONE]\n\n"


def random_id(n: int = 32) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(n))


def sse(obj) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when the generation prompt already opened a think block (some Qwen3 templates end
    with '<think>\\n' when thinking is on): the reply starts inside it."""
    return prompt_text.rstrip().endswith(THINK_START)


# --- usage and timings ----------------------------------------------------------------------------
def _per_second(n: int, ms: float) -> float:
    return n / (ms / 1000) if ms > 0 else 0.0


def _per_token_ms(n: int, ms: float) -> float:
    return ms / n if n > 0 else 0.0


def merge_results(results: list):
    """One result standing for a request's n choices in usage and timings: the prompt counted
    once (the first choice's: the others reuse its prefill), the generated tokens of all; each
    further choice's first draw (its prompt_ms) is generation time."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    return replace(first, tokens=[], text="", probs=None,
                   n_generated=sum(r.n_generated for r in results),
                   gen_ms=sum(r.gen_ms for r in results) + sum(r.prompt_ms for r in results[1:]))


def usage(result) -> dict:
    return {"completion_tokens": result.n_generated, "prompt_tokens": result.n_prompt,
            "total_tokens": result.n_generated + result.n_prompt,
            "prompt_tokens_details": {"cached_tokens": result.n_cached}}


def timings(result) -> dict:
    """llama-server's timings. The first generated token comes from the prompt's last logits (its
    time is in prompt_ms), so the generation rate is over the n - 1 decode steps, as llama-server
    reports it (0 for a single token)."""
    prompt_n = result.n_prompt - result.n_cached
    steps = max(0, result.n_generated - 1)
    return {"cache_n": result.n_cached,
            "prompt_n": prompt_n, "prompt_ms": result.prompt_ms,
            "prompt_per_token_ms": _per_token_ms(prompt_n, result.prompt_ms),
            "prompt_per_second": _per_second(prompt_n, result.prompt_ms),
            "predicted_n": result.n_generated, "predicted_ms": result.gen_ms,
            "predicted_per_token_ms": _per_token_ms(steps, result.gen_ms),
            "predicted_per_second": _per_second(steps, result.gen_ms)}


def prompt_progress(progress) -> dict:
    """llama-server's prompt_progress of an engine Progress event (processed counts the cached
    tokens; time_ms since the prompt's processing began)."""
    return {"total": progress.total, "cache": progress.cache, "processed": progress.processed,
            "time_ms": int(progress.prompt_ms)}


def with_telemetry(chunk: dict, event, per_token: bool) -> dict:
    """A streamed chunk with llama-server's telemetry: prompt_progress on a Progress event's
    chunk, and (timings_per_token) the timings so far on every chunk."""
    if hasattr(event, "processed"):
        chunk["prompt_progress"] = prompt_progress(event)
    if per_token and getattr(event, "stats", None) is not None:
        chunk["timings"] = timings(event.stats)
    return chunk


# --- chat --------------------------------------------------------------------------------------------
class ChatOutput:
    """Parsed view of one assistant reply as it grows."""

    def __init__(self, *, parse_reasoning: bool, think_open: bool, parse_tools: bool,
                 infer_open: bool = False):
        self.parse_reasoning = parse_reasoning
        self.think_open = think_open
        # True: a `</think>` without a leading `<think>` makes the text before it reasoning
        # (split_reasoning's default); streaming then holds back all content until the end.
        self.infer_open = infer_open
        self.parse_tools = parse_tools
        self.text = ""
        self._sent_reasoning = ""
        self._sent_content = ""
        self._call_ids: list[str] = []    # one id per call, stable between the stream and the end
        self._n_calls_sent = 0
        self.start = ""                   # text the reply starts with (a forced tool-call start)

    def fresh(self) -> "ChatOutput":
        """A new reply to the same prompt (the next choice): same settings, same start."""
        out = ChatOutput(parse_reasoning=self.parse_reasoning, think_open=self.think_open,
                         parse_tools=self.parse_tools, infer_open=self.infer_open)
        out.start = out.text = self.start
        return out

    def parse(self, final: bool) -> tuple[str, str, list[dict]]:
        """(reasoning, content, calls) of the text so far."""
        partial = not final
        if self.parse_reasoning:
            reasoning, content = split_reasoning(self.text, partial=partial, think_open=self.think_open,
                                                 infer_open=self.infer_open)
        else:
            reasoning, content = "", self.text
        calls: list[dict] = []
        if self.parse_tools:
            content, calls = parse_tool_calls(content, partial=partial)
        while len(self._call_ids) < len(calls):
            self._call_ids.append(random_id())
        calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]},
                  "id": self._call_ids[i]} for i, c in enumerate(calls)]
        return reasoning, content, calls

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        """Add generated text; return the new deltas (each one chunk's `delta`)."""
        self.text += piece
        reasoning, content, calls = self.parse(final)
        deltas: list[dict] = []
        # Each partial parse is a prefix of the final one (the parsers hold back whatever could
        # still change), so the new text is always a clean extension of what was sent; the
        # check stays as a guard, since nothing already sent can be taken back.
        if len(reasoning) > len(self._sent_reasoning) and reasoning.startswith(self._sent_reasoning):
            deltas.append({"reasoning_content": reasoning[len(self._sent_reasoning):]})
            self._sent_reasoning = reasoning
        if len(content) > len(self._sent_content) and content.startswith(self._sent_content):
            deltas.append({"content": content[len(self._sent_content):]})
            self._sent_content = content
        for i in range(self._n_calls_sent, len(calls)):
            call = calls[i]
            deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                           "function": dict(call["function"])}]})
        self._n_calls_sent = max(self._n_calls_sent, len(calls))
        return deltas

    def message(self) -> tuple[dict, bool]:
        """The final assistant message and whether it holds tool calls."""
        reasoning, content, calls = self.parse(final=True)
        msg: dict = {"role": "assistant", "content": None if (calls and not content) else content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg, bool(calls)


def finish_reason(result, has_tool_calls: bool) -> str:
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


class ChatFormatter:
    """chat.completion / chat.completion.chunk objects for one request, of one or several choices
    (each its own ChatOutput: choice 0's is the one given, the others ChatOutput.fresh())."""

    def __init__(self, model: str, fingerprint: str, output: ChatOutput, tokenizer=None):
        self.id = "chatcmpl-" + random_id()
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.outputs = [output]
        self.tokenizer = tokenizer        # for logprobs (token texts)
        self._pending_probs: dict[int, list] = {}   # per choice: probabilities of held-back text

    def output_of(self, index: int) -> ChatOutput:
        while len(self.outputs) <= index:
            self.outputs.append(self.outputs[0].fresh())
        return self.outputs[index]

    def _chunk(self, choices: list, **extra) -> dict:
        return {"choices": choices, "created": self.created, "id": self.id, "model": self.model,
                "system_fingerprint": self.fingerprint, "object": "chat.completion.chunk", **extra}

    def _delta_chunk(self, delta: dict, index: int = 0) -> dict:
        return self._chunk([{"finish_reason": None, "index": index, "delta": delta}])

    def first_chunk(self, index: int = 0) -> dict:
        return self._delta_chunk({"role": "assistant", "content": None}, index)

    def _attach_probs(self, chunks: list[dict], probs, index: int = 0) -> None:
        """A delta's token probabilities go on the first chunk that carries its text (held back
        with the text the parser holds back)."""
        pending = self._pending_probs.setdefault(index, [])
        if probs:
            pending.extend(probs)
        if chunks and pending and self.tokenizer is not None:
            chunks[0]["choices"][0]["logprobs"] = lp.chat_logprobs(self.tokenizer, pending)
            self._pending_probs[index] = []

    def text_chunks(self, piece: str, probs=None, index: int = 0) -> list[dict]:
        chunks = [self._delta_chunk(d, index) for d in self.output_of(index).feed(piece)]
        self._attach_probs(chunks, probs, index)
        return chunks

    def finish_chunks(self, result, index: int = 0) -> tuple[list[dict], bool]:
        """The rest of choice `index`'s deltas and its finish chunk; whether it calls tools."""
        output = self.output_of(index)
        chunks = [self._delta_chunk(d, index) for d in output.feed("", final=True)]
        _, has_calls = output.message()
        chunks.append(self._chunk([{"finish_reason": finish_reason(result, has_calls), "index": index,
                                    "delta": {}}]))
        self._attach_probs(chunks, None, index)
        return chunks, has_calls

    def end_chunks(self, chunks: list[dict], results: list, include_usage: bool) -> list[dict]:
        """After the last choice's chunks: the usage chunk (OpenAI: empty choices) when asked;
        timings (every choice's generation) on the last chunk."""
        total = merge_results(results)
        if include_usage:
            chunks.append(self._chunk([], usage=usage(total)))
        chunks[-1]["timings"] = timings(total)
        return chunks

    def response(self, results: list) -> tuple[dict, list[bool]]:
        """The chat.completion of the choices (one result each, in index order) whose outputs
        hold their whole text; whether each calls tools."""
        choices, calls = [], []
        for index, result in enumerate(results):
            msg, has_calls = self.output_of(index).message()
            choice = {"finish_reason": finish_reason(result, has_calls), "index": index, "message": msg}
            if result.probs is not None and self.tokenizer is not None:
                choice["logprobs"] = lp.chat_logprobs(self.tokenizer, result.probs)
            choices.append(choice)
            calls.append(has_calls)
        total = merge_results(results)
        return {"choices": choices,
                "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
                "object": "chat.completion", "usage": usage(total), "id": self.id,
                "timings": timings(total)}, calls


# --- raw completions ---------------------------------------------------------------------------------
class CompletionFormatter:
    """text_completion objects (streamed chunks share the object name, as in llama-server), of
    one or several choices."""

    def __init__(self, model: str, fingerprint: str, tokenizer=None):
        self.id = "cmpl-" + random_id()
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer        # for logprobs (token texts)
        self._offsets: dict[int, int] = {}   # per choice: text_offset of its next streamed token

    def _choice(self, text: str, finish: str | None, probs=None, index: int = 0) -> dict:
        logprobs = None
        if probs is not None and self.tokenizer is not None:
            logprobs, self._offsets[index] = lp.completion_logprobs(self.tokenizer, probs,
                                                                    self._offsets.get(index, 0))
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    def _obj(self, choices: list, **extra) -> dict:
        return {"choices": choices, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "object": "text_completion", "id": self.id, **extra}

    def text_chunk(self, piece: str, probs=None, index: int = 0) -> dict:
        return self._obj([self._choice(piece, None, probs, index)])

    def finish_chunk(self, result, index: int = 0, **extra) -> dict:
        return self._obj([self._choice("", finish_reason(result, False), index=index)], **extra)

    def end_chunks(self, chunks: list[dict], results: list, include_usage: bool) -> list[dict]:
        """Usage on the last finish chunk (llama-server) or, with include_usage, on a last chunk
        with empty choices (OpenAI) - never on both, so clients that add usage up stay right;
        timings on the last chunk."""
        total = merge_results(results)
        if include_usage:
            chunks.append(self._obj([], usage=usage(total)))
        else:
            chunks[-1]["usage"] = usage(total)
        chunks[-1]["timings"] = timings(total)
        return chunks

    def response(self, pairs: list) -> dict:
        """The text_completion of the choices [(text, result), ...] (index: their order)."""
        self._offsets = {}
        choices = [self._choice(t, finish_reason(r, False), r.probs, i) for i, (t, r) in enumerate(pairs)]
        total = merge_results([r for _, r in pairs])
        return self._obj(choices, usage=usage(total), timings=timings(total))


# --- llama-server's native /completion --------------------------------------------------------------
SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]


def sampling_settings(p, max_tokens: int | None, ignore_eos: bool, stream: bool, n_probs: int = 0,
                      post_sampling_probs: bool = False, timings_per_token: bool = False) -> dict:
    """llama-server's names for a request's sampling settings (its generation_settings, and
    /props' defaults); seed 0xFFFFFFFF (RANDOM_SEED) means a random one. The samplers this
    engine lacks are reported with the values that switch them off, so a client reading the
    object finds every key llama-server sends."""
    n_predict = -1 if max_tokens is None else max_tokens
    return {"seed": RANDOM_SEED if p.seed is None else p.seed, "temperature": p.temperature,
            "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "top_n_sigma": -1.0,
            "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "dry_sequence_breakers": ["\n", ":", "\"", "*"],
            "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
            "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
            "ignore_eos": ignore_eos, "stream": stream, "n_probs": n_probs, "min_keep": 0,
            "grammar": "", "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": [],
            "chat_format": "Content-only", "reasoning_format": "auto", "reasoning_in_content": False,
            "generation_prompt": "", "samplers": list(SAMPLERS), "speculative.types": "none",
            "timings_per_token": timings_per_token, "post_sampling_probs": post_sampling_probs,
            "backend_sampling": False, "lora": []}


def logit_bias_list(logit_bias: dict, extra_banned=()) -> list[dict]:
    """llama-server's generation_settings.logit_bias: [{"bias": b or null for -inf, "token": id}]."""
    out = [{"bias": None if b == float("-inf") else b, "token": t} for t, b in logit_bias.items()]
    out += [{"bias": None, "token": t} for t in sorted(extra_banned) if t not in logit_bias]
    return out


def stop_type(result) -> str:
    """llama-server's stop_type: "eos" (end of generation token), "word" (a stop string),
    "limit" (n_predict or the end of the context)."""
    if result.finish_reason == "length":
        return "limit"
    return "word" if result.stop_word else "eos"


def truncated(result, n_ctx: int, max_tokens: int | None) -> bool:
    """llama-server's `truncated`: the generation stopped because the context was full."""
    return (result.finish_reason == "length" and result.n_prompt + result.n_generated >= n_ctx
            and (max_tokens is None or result.n_generated < max_tokens))


class NativeCompletionFormatter:
    """The objects of llama-server's own POST /completion: streamed chunks carry content, their
    token ids, stop false and the running counts; the last one, and the non-streamed answer,
    carry the rest."""

    def __init__(self, st, req, prompt: list[int]):
        self.model = st.model_name
        self.gen = req.gen
        self.return_tokens = req.return_tokens
        self.prompt_text = req.prompt if isinstance(req.prompt, str) else ""
        self.n_prompt = len(prompt)
        self.n_ctx = st.engine.n_ctx
        self.eog = sorted(getattr(st.engine.tokenizer, "eot_ids", ()) or ())
        self.tokenizer = st.engine.tokenizer
        self.n_generated: dict[int, int] = {}     # per choice, so far (streamed chunks)

    def text_chunk(self, delta) -> dict:
        """A Delta's chunk (of its choice), or a Progress event's (no content, prompt_progress;
        index 0: the prompt is processed before choice 0)."""
        index = getattr(delta, "index", 0)
        tokens = list(getattr(delta, "tokens", ()))
        self.n_generated[index] = self.n_generated.get(index, 0) + len(tokens)
        out = {"index": index, "content": getattr(delta, "text", ""), "tokens": tokens, "stop": False, "id_slot": 0,
               "tokens_predicted": self.n_generated[index], "tokens_evaluated": self.n_prompt}
        if getattr(delta, "probs", None) is not None:
            out["completion_probabilities"] = lp.native_probs(self.tokenizer, delta.probs)
        return with_telemetry(out, delta, self.gen.timings_per_token)

    def generation_settings(self) -> dict:
        g = self.gen
        return {**sampling_settings(g.params, g.max_tokens, g.ignore_eos, g.stream, g.n_probs, g.post_sampling_probs,
                                    g.timings_per_token),
                "stop": list(g.stop),
                "logit_bias": logit_bias_list(g.params.logit_bias, self.eog if g.ignore_eos else ())}

    def response(self, text: str, tokens: list[int], result, index: int = 0) -> dict:
        return {"index": index, "content": text, "tokens": list(tokens) if self.return_tokens else [], "id_slot": 0,
                "stop": True, "model": self.model, "tokens_predicted": result.n_generated,
                "tokens_evaluated": result.n_prompt, "generation_settings": self.generation_settings(),
                "prompt": self.prompt_text, "has_new_line": "\n" in (text or result.text),
                "truncated": truncated(result, self.n_ctx, self.gen.max_tokens), "stop_type": stop_type(result),
                "stopping_word": result.stop_word or "",
                "tokens_cached": result.n_prompt + result.n_generated, "timings": timings(result),
                **({"completion_probabilities": lp.native_probs(self.tokenizer, result.probs)}
                   if result.probs is not None and not self.gen.stream else {})}
