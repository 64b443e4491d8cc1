"""The engine: load a model within its memory budget, then generate.

    engine = Engine.load("model.gguf", EngineConfig(backend="auto"))
    for event in engine.generate(GenerationRequest(prompt=ids, max_tokens=64)):
        ...  # Delta(text, tokens) as text completes, then Done(result)
             # (with progress_batch: Progress events while the prompt is processed, first)

Loading checks everything before allocating: the file's structure, the config, every
tensor's presence, shape and type, then the memory budget - so a model that cannot
fit is refused with the numbers, not killed by the OOM handler mid-sentence.

The engine remembers which tokens its KV pool holds. A request reuses the longest
common prefix with them and prefills only the rest (at least one token, for the
logits): a stable system prompt is prefilled once. Correct because a shared prefix
sits at the same positions and causal attention never reads past a position.

A request with n > 1 choices (GenerationRequest.n) gets its replies one after another from
one prefill: the prompt's last logits are kept, each choice draws its first token from them
with its own sampler (seed + i: generate.choice_params) and decodes from the position after
the prompt, overwriting the previous reply. Full-context layers never lose a prompt position
that way; sliding-window rings do, so what they hold of the prompt is copied out once and
put back before each further choice.

One thread at a time may call `generate` (the server's worker owns the engine).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from genie_rt.kvcache.persist import validate_conversation_id

from .chat import ChatTemplate
from .config import DEFAULT_KV, EngineConfig, ModelConfig
from .generate import (ContextOverflowError, Delta, Done, GenerationRequest, GenerationResult, Progress, Stats,
                       StopMatcher, choice_params)
from .gguf_file import GGUFError, GGUFFile, open_gguf
from .load_plan import budget_for, choose_backend, cuda_available  # noqa: F401 (tests patch it here)
from .memory import MemoryPlan, fmt_bytes
from .progress import NO_PROGRESS, Progress as LoadProgress
from .sampling import Sampler
from .tokenizer import Tokenizer

log = logging.getLogger("genie_rt")
_loaded_once = False    # a model was loaded in this process: a later load's timeline has no "start"


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """The length of a's and b's common prefix. List slices compare in C: a whole match (a chat's
    next turn extends the last) is one comparison, a mismatch is found by halving to 64 items."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                      # a[:lo] == b[:lo]; the first mismatch is below hi
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    prompt_ms: float = 0.0
    gen_ms: float = 0.0
    prefix_hits: int = 0


def make_guard(ecfg: EngineConfig, integrated: bool):
    """The StepGuard for these settings, or None when nothing is guarded."""
    from .step_guard import DEFAULT_HEADROOM_INTEGRATED, GuardConfig, StepGuard
    headroom = ecfg.min_headroom_bytes
    if headroom is None:
        headroom = DEFAULT_HEADROOM_INTEGRATED if integrated else 0
    gcfg = GuardConfig(min_headroom=headroom or None, thermal_limit_c=ecfg.thermal_limit_c)
    return StepGuard(gcfg) if gcfg.active else None


def _check_count(what: str, value, low: int, note: str = "") -> None:
    """A request count from a Python caller: an int (not a bool) >= low, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}{note}, got {value!r}")


class Engine:
    def __init__(self, gfile: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig, backend, plan: MemoryPlan,
                 tokenizer: Tokenizer, template: ChatTemplate, load_seconds: float):
        self.gfile, self.cfg, self.ecfg = gfile, cfg, ecfg
        self.backend, self.plan = backend, plan
        self.tokenizer, self.template = tokenizer, template
        self.load_seconds = load_seconds
        self.kv_tokens: list[int] = []   # token ids whose K/V sit at positions 0..len-1
        self.stats = EngineStats()
        self.kv_store = None             # kvcache.persist.KVStore when --kv-cache-dir is set
        self.guard = None                # step_guard.StepGuard: memory headroom, thermal back-off

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def model_name(self) -> str:
        return self.gfile.path.name

    @classmethod
    def load(cls, path: str | Path, ecfg: EngineConfig | None = None,
             progress: LoadProgress = NO_PROGRESS) -> "Engine":
        """Check, budget, read the weights, compile the kernels (the CPU's by a short warm-up
        forward, the GPU's with their graphs). `progress` (engine/progress.py) is told each
        long step; by default nothing is printed."""
        global _loaded_once
        from .load_report import process_age_s, timeline
        ecfg = ecfg or EngineConfig()
        t0 = time.perf_counter()
        age = process_age_s() if not _loaded_once else None
        marks = [("process start to load", age)] if age is not None else []
        g = open_gguf(path)
        cfg = ModelConfig.from_gguf(g)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
            template = ChatTemplate.from_gguf_metadata(g.metadata)
        except GGUFError:
            raise
        except ValueError as exc:          # bad tokenizer / template metadata: name the file
            raise GGUFError(f"{path}: {exc}") from exc
        t_files = time.perf_counter()
        backend_name, _why = choose_backend(ecfg.backend, lambda: cuda_available())
        if ecfg.kv_dtype is None:
            ecfg = dataclasses.replace(ecfg, kv_dtype=DEFAULT_KV.get(backend_name, "int8"))
        if ecfg.n_ctx is not None and ecfg.n_ctx > cfg.n_ctx_train:
            log.warning("context %d exceeds the model's training context %d", ecfg.n_ctx, cfg.n_ctx_train)
        log.info("loading %s (%s, %d layers) on the %s back-end", Path(path).name, cfg.arch, cfg.n_layers,
                 backend_name)
        t1 = time.perf_counter()
        budget = budget_for(g, cfg, ecfg, backend_name)     # what `genie-rt info` prints (load_plan.py)
        plan = budget.plan(ecfg.n_ctx)
        t2 = time.perf_counter()
        if ecfg.n_ctx is None and plan.n_ctx < cfg.n_ctx_train:
            log.info("context %d tokens: the largest that fits in %s (%s available, the model was trained "
                     "for %d)", plan.n_ctx, budget.where, fmt_bytes(budget.available), cfg.n_ctx_train)
        if backend_name == "cpu":
            from .backend_cpu import CPUBackend
            backend = CPUBackend(g, cfg, plan.n_ctx, ecfg.kv_dtype, ecfg.prefill_chunk, threads=ecfg.threads,
                                 progress=progress)
            backend.warm_up(progress)
        else:
            from .backend_cuda import CUDABackend
            backend = CUDABackend(g, cfg, ecfg, plan, progress=progress)
        engine = cls(g, cfg, ecfg, backend, plan, tokenizer, template, time.perf_counter() - t0)
        marks += [("file, tokenizer, template", t_files - t0), ("device query", t1 - t_files),
                  ("memory plan", t2 - t1), ("back-end", time.perf_counter() - t2)]
        log.info("load timeline: %s", timeline(marks, backend))
        _loaded_once = True
        engine.guard = make_guard(ecfg, bool(getattr(backend, "integrated", False)))
        if ecfg.kv_cache_dir:
            from genie_rt.kvcache.persist import KVStore
            engine.kv_store = KVStore(ecfg.kv_cache_dir, budget_bytes=ecfg.kv_cache_budget)
        return engine

    # -- prompts -----------------------------------------------------------------------
    def chat_prompt_text(self, messages: list[dict], tools: list[dict] | None = None,
                         add_generation_prompt: bool = True, **kwargs) -> tuple[str, list[int]]:
        """Render the chat template; return the text and its token ids."""
        text = self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        return text, self.tokenizer.encode(text, add_special=True, parse_special=True)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.chat_prompt_text(messages, tools, add_generation_prompt, **kwargs)[1]

    def raw_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    # -- generation --------------------------------------------------------------------
    def _restore(self, req: GenerationRequest) -> int:
        """Reuse what the KV pool (or a conversation file) already holds; return n_reused."""
        prompt = req.prompt
        n_reuse = common_prefix_len(self.kv_tokens, prompt)
        if self.kv_store is not None and req.conversation_id is not None:
            self.kv_store.restore(self, req.conversation_id, prompt, n_reuse)
            n_reuse = common_prefix_len(self.kv_tokens, prompt)  # the store may have replaced the pool
        # a sliding-window layer's ring may have lost the window the first new token needs
        return self.backend.reusable_prefix(min(n_reuse, len(prompt) - 1))

    def _prefill(self, req: GenerationRequest, prompt: list[int], n_reuse: int, sampler, t0: float):
        """Run the prompt after the reused prefix; yields Progress events when the request asks
        for them (then in pieces of progress_batch tokens, as llama-server's n_batch), and
        returns (the first generated token, the prompt's last logits) - the logits only with
        n > 1 choices (the other choices draw their first token from them); (None, None) when
        cancelled. The prompt is processed once whatever n is, so its progress comes once,
        before choice 0's first Delta."""
        step, total, pos = req.progress_batch, len(prompt), n_reuse
        if step > 0:
            yield Progress(total, n_reuse, n_reuse, 0.0)
            while total - pos > step:            # the last piece is sampled from, below
                if self.backend.prefill(prompt[pos:pos + step], pos, req.cancel) is None:
                    return None, None
                pos += step
                yield Progress(total, n_reuse, pos, (time.perf_counter() - t0) * 1000)
        logits = None
        if req.n == 1:
            # checked: generate() validated the prompt's ids and the parameters before its clock
            token = self.backend.prefill_sample(prompt[pos:], pos, sampler, prompt, req.cancel, checked=True)
        else:   # the logits stay for the other choices' first draws
            logits = self.backend.prefill(prompt[pos:], pos, req.cancel)
            token = None if logits is None else self.backend.sample_logits(logits, sampler, prompt)
        if token is not None and step > 0:
            yield Progress(total, n_reuse, total, (time.perf_counter() - t0) * 1000)
        return token, logits

    def generate(self, req: GenerationRequest) -> Iterator[Progress | Delta | Done]:
        """(Progress events, with progress_batch), then Delta(text, tokens, index=i)...
        Done(result, index=i) for each choice i = 0 .. req.n-1, one after another. The prompt is
        prefilled once: every choice draws its first token from the logits the prompt left (with
        its own sampler: choice_params) and decodes from the position after it, so a choice
        never re-runs a prompt token."""
        prompt = list(req.prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise ContextOverflowError(len(prompt), self.n_ctx)
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:     # (C loops; the message names the first)
            bad = next(t for t in prompt if not 0 <= t < self.cfg.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        _check_count("'n' (choices)", req.n, 1)
        _check_count("'progress_batch'", req.progress_batch, 0, " (0: no progress events)")
        req.params.validate(self.cfg.vocab_size)
        if req.conversation_id is not None:
            validate_conversation_id(req.conversation_id)   # InvalidConversationId before any work
        sampler = self._sampler(req, 0)      # ConstraintError (a ValueError) before any work
        cancel = req.cancel

        t0 = time.perf_counter()
        n_reuse = self._restore(req)
        self.kv_tokens = self.kv_tokens[:n_reuse]
        token, logits = yield from self._prefill(req, prompt, n_reuse, sampler, t0)
        rings = self._ring_snapshot(len(prompt)) if logits is not None else None
        t1 = time.perf_counter()
        if token is None:  # cancelled between prefill chunks: the pool holds a partial prompt
            yield Done(self._finish(req, [], "cancelled", None, n_reuse, t0, t1, t1, "", None))
            return
        self.kv_tokens = prompt[:]
        for index in range(req.n):
            if index:
                t0 = time.perf_counter()
                if cancel is not None and cancel.is_set():   # the caller waits for a Done to end on
                    yield Done(self._finish(req, [], "cancelled", None, len(prompt), t0, t0, t0, "", None,
                                            first_choice=False), index)
                    break
                self._ring_restore(rings, len(prompt))
                self.kv_tokens = prompt[:]
                sampler = self._sampler(req, index)
                token = self.backend.sample_logits(logits, sampler, prompt)
                t1 = time.perf_counter()
            result = yield from self._reply(req, prompt, token, sampler, index, len(prompt) if index else n_reuse,
                                            t0, t1)
            if result.finish_reason == "cancelled":
                break
        # After the last Done, so the client has its answer before the (possibly large) file is
        # written; every consumer (server worker, CLI) drives the generator to its end. A turn
        # cancelled after its prompt was processed is saved too (what the pool holds: the
        # prompt and the reply so far).
        if self.kv_store is not None and req.conversation_id is not None:
            self.kv_store.save(self, req.conversation_id)

    def _sampler(self, req: GenerationRequest, index: int) -> Sampler:
        """Choice `index`'s sampler: its seed (choice_params) and a fresh grammar state."""
        constraint = None
        if req.constraint is not None:
            from .constrain import Constraint
            constraint = Constraint.start(self.tokenizer, req.constraint, self.cfg.vocab_size)
        return Sampler(choice_params(req.params, index), constraint, n_probs=req.n_probs,
                       want_probs=req.logprobs or req.n_probs > 0, post_sampling=req.post_sampling_probs)

    def _ring_snapshot(self, end: int):
        """(first, arrays, layers) of what the sliding-window rings hold of the prompt (positions
        first .. end-1), or None without rings. A reply overwrites a ring's oldest slots, so the
        next choice puts these back (_ring_restore) instead of prefilling the prompt again;
        the other layers keep every prompt position, whatever a reply writes after them."""
        kv = self.backend.kv
        rings = kv.shape.ring_layers if kv.shape.slots is not None else ()
        if not rings:
            return None
        first = self.backend.ring_first(end)
        return first, kv.export_window(end, layers=rings, first=first)[1], rings

    def _ring_restore(self, snapshot, end: int) -> None:
        if snapshot is None:
            return
        first, arrays, rings = snapshot
        self.backend.kv.import_window(arrays, first, end, layers=rings)
        self.backend.kv_imported(first, end)

    def _reply(self, req: GenerationRequest, prompt: list[int], token: int, sampler: Sampler, index: int,
               n_reuse: int, t0: float, t1: float):
        """One choice, from its first token (drawn from the prompt's logits) on: its Deltas and
        its Done; returns the result."""
        probs = [] if sampler.want_probs else None
        cancel = req.cancel
        max_new = self.n_ctx - len(prompt)
        if req.max_tokens is not None:
            max_new = min(max_new, req.max_tokens)
        eot = self.tokenizer.eot_ids
        decoder = self.tokenizer.stream_decoder(skip_special=True)
        stops = StopMatcher(req.stop)
        generated: list[int] = []
        history = prompt[:]
        # A Delta carries the tokens whose text it completes: while the decoder or the stop
        # matcher holds text back, released text and tokens wait for it, so every Delta has at
        # least one token and the tokens of all Deltas are the generated ones (streamed pieces
        # never outnumber completion_tokens, also when a held-back stop prefix is flushed).
        finish, pending, stopped, buf = "length", [], False, ""

        def delta(text: str, tokens: list[int]) -> Delta:   # with this choice's counts and times so far
            return Delta(text, tokens, probs[len(probs) - len(tokens):] if probs is not None else None,
                         Stats(len(prompt), n_reuse, (t1 - t0) * 1000, len(generated),
                               (time.perf_counter() - t1) * 1000), index)

        # the back-end yields the token after each one fed to it (the CUDA back-end runs a
        # step ahead); a token is appended to history before the next is asked for
        steps = self.backend.decode_tokens(token, len(prompt), sampler, history)
        guard = self.guard
        if guard is not None:
            guard.start_reply()
        try:
            while len(generated) < max_new:
                if token in eot and not req.ignore_eos:
                    finish = "stop"
                    break
                generated.append(token)
                history.append(token)
                pending.append(token)
                if probs is not None:
                    probs.append(sampler.records[len(generated) - 1])
                text, stopped = stops.feed(decoder.feed(token))
                buf += text
                if stopped or (buf and not stops.holding and not decoder.holding):
                    yield delta(buf, pending)
                    pending, buf = [], ""
                if stopped:
                    finish = "stop"
                    break
                if len(generated) >= max_new:
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if guard is not None and guard.after_token() == "memory":
                    break                    # finish stays "length": the reply ends where it is
                token = next(steps)
                self.kv_tokens.append(generated[-1])
        finally:
            steps.close()
        if not stopped:
            text, stopped = stops.feed(decoder.flush())
            if stopped:
                finish = "stop"
            else:
                text += stops.flush()
            if buf + text or pending:
                yield delta(buf + text, pending)
        t2 = time.perf_counter()
        result = self._finish(req, generated, finish, stops.stop_word, n_reuse, t0, t1, t2, stops.text, probs,
                              first_choice=index == 0)
        yield Done(result, index)
        return result

    def _finish(self, req, generated, finish, stop_word, n_reuse, t0, t1, t2, text, probs,
                first_choice: bool = True) -> GenerationResult:
        """The result of one choice. The engine's stats count a request's prompt once (with
        its first choice); every choice's tokens and times."""
        s = self.stats
        if first_choice:
            s.requests += 1
            s.prompt_tokens += len(req.prompt)
            s.prompt_tokens_cached += n_reuse
            s.prefix_hits += n_reuse > 0
            s.prompt_ms += (t1 - t0) * 1000
        s.generated_tokens += len(generated)
        s.gen_ms += (t2 - t1) * 1000
        return GenerationResult(text=text, tokens=generated, finish_reason=finish, stop_word=stop_word,
                                n_prompt=len(req.prompt), n_cached=n_reuse, prompt_ms=(t1 - t0) * 1000,
                                n_generated=len(generated), gen_ms=(t2 - t1) * 1000, probs=probs)
