"""Generation requests, results, and stop-string matching (no model code here).

`StopMatcher` turns a stream of decoded text into text safe to emit: it holds back
any tail that could still become a stop string, so a client never sees half of
"</tool_call>" before the stop is recognised (llama-server does the same).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from .sampling import SamplingParams, TokenProbs


class ContextOverflowError(ValueError):
    """The prompt does not fit the context (the server answers 400 exceed_context_size_error)."""

    def __init__(self, n_prompt: int, n_ctx: int):
        super().__init__(f"the request ({n_prompt} prompt tokens) exceeds the available context "
                         f"size ({n_ctx} tokens); shorten the prompt or start with a larger --ctx")
        self.n_prompt_tokens = n_prompt
        self.n_ctx = n_ctx


@dataclass
class GenerationRequest:
    prompt: list[int]                          # token ids, template already applied
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None              # None: until a stop or the end of the context
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    conversation_id: str | None = None         # persistent KV (kvcache/persist.py)
    cancel: threading.Event | None = None      # set by the client side to stop early
    constraint: object = None                  # engine/constrain.py ConstraintSpec: the output's grammar
    n_probs: int = 0                           # the most likely tokens to report per token
    logprobs: bool = False                     # report each token's probability (Delta.probs)
    post_sampling_probs: bool = False          # ... after the whole sampler chain (llama-server)
    n: int = 1                                 # choices: replies to the one prompt, one after another
    progress_batch: int = 0                    # > 0: prefill in pieces of this many tokens, a
                                               # Progress event before the first and after each


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index` of a request with n choices: the request's own
    for choice 0; for choice i, seed + i (modulo 2^64; as llama-server seeds its n_cmpl children),
    so each choice is reproducible on its own and a choice's reply does not depend on how long the
    ones before it were. Without a seed every choice draws a random one."""
    if index == 0 or params.seed is None or params.seed < 0:
        return params
    return replace(params, seed=(params.seed + index) % (1 << 64))


@dataclass
class Stats:
    """A generation's counts and times so far (a GenerationResult's names for them, so the
    server's `timings` reads either one)."""
    n_prompt: int
    n_cached: int
    prompt_ms: float
    n_generated: int = 0
    gen_ms: float = 0.0


@dataclass
class Progress:
    """How far the prompt is processed (GenerationRequest.progress_batch > 0): llama-server's
    prompt_progress. `processed` counts the cached tokens too: the first event, sent before
    any prompt token is run, has processed == cache, the last one processed == total."""
    total: int
    cache: int
    processed: int
    prompt_ms: float

    @property
    def stats(self) -> Stats:
        return Stats(n_prompt=self.processed, n_cached=self.cache, prompt_ms=self.prompt_ms)


@dataclass
class Delta:
    """Newly completed text and the token ids that produced it (with their probabilities when
    the request asked for logprobs: one TokenProbs per token), and the counts and times so far."""
    text: str
    tokens: list[int]
    probs: list[TokenProbs] | None = None
    stats: Stats | None = None
    index: int = 0                  # the choice it belongs to (GenerationRequest.n)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str          # "stop" (EOS or stop string), "length", "cancelled"
    stop_word: str | None
    n_prompt: int
    n_cached: int               # prompt tokens whose KV was reused (prefix or file)
    prompt_ms: float
    n_generated: int
    gen_ms: float
    probs: list[TokenProbs] | None = None   # per generated token, when the request asked

    @property
    def prompt_per_second(self) -> float:
        n = self.n_prompt - self.n_cached
        return n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0

    @property
    def gen_per_second(self) -> float:
        return self.n_generated / (self.gen_ms / 1000) if self.gen_ms > 0 else 0.0


@dataclass
class Done:
    """The end of one choice: a request with n choices yields n, in index order."""
    result: GenerationResult
    index: int = 0


class StopMatcher:
    """Finds the first stop string in generated text; holds back possible prefixes."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0            # characters of self.text already released
        self.stop_word: str | None = None

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add decoded text; return (text now safe to emit, stopped)."""
        self.text += piece
        if self.stops:
            start = max(0, self.emitted - max(len(s) for s in self.stops))
            best = None
            for s in self.stops:
                at = self.text.find(s, start)
                if at >= 0 and (best is None or at < best[0]):
                    best = (at, s)
            if best is not None:
                at, self.stop_word = best
                out = self.text[self.emitted:at]
                self.text = self.text[:at]
                self.emitted = at
                return out, True
        hold = self._partial_tail()
        end = len(self.text) - hold
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, False

    @property
    def holding(self) -> bool:
        """True while text that may start a stop string is held back."""
        return self.emitted < len(self.text)

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    def _partial_tail(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        tail_len = len(self.text) - self.emitted
        for s in self.stops:
            for n in range(min(len(s) - 1, tail_len), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
