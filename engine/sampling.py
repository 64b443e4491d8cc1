"""Token sampling on the host (numpy): llama.cpp's default sampler chain.

Order, as llama.cpp's common sampler applies it:
    logit_bias -> penalties (repeat, presence, frequency over the last repeat_last_n
    tokens) -> top_k -> top_p -> min_p -> temperature -> draw from the softmax
Temperature <= 0 means greedy (argmax after bias and penalties). top_k <= 0,
top_p >= 1 and min_p <= 0 switch those filters off. A seed makes the draw
reproducible: the same seed, prompt and parameters give the same tokens.

A grammar (engine/constrain.py) bans the tokens it does not allow after the penalties (their
logits become -inf), before top_k. With `n_probs` the sampler records, per draw, the chosen
token's log-probability and the `n_probs` most likely tokens (`records`, one TokenProbs a
draw): by default over the distribution the chain starts from (bias, penalties and the grammar
applied; llama-server's and OpenAI's logprobs), with `post_sampling` over what the chain kept
after top_k / top_p / min_p and temperature (llama-server's post_sampling_probs).

The CUDA back-end samples on the GPU with the same chain (engine/cuda_sampling.py);
this module is its reference. Validation of user input (ranges, types) happens at the
boundary (CLI, server) through `SamplingParams.validate`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


def requested_top_k(k: int, vocab_size: int) -> int:
    """top_k as a user asks for it (CLI, server; as llama.cpp reads it): <= 0 or >= the
    vocabulary means off (0); SamplingParams itself takes only 0..vocab_size."""
    return 0 if k <= 0 or k >= vocab_size else k


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0       # 1.0 = off; divides positive logits of recent tokens
    repeat_last_n: int = 64           # window for all three penalties; -1 = whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the field for out-of-range values."""
        def finite(name, v, lo=None, hi=None):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v in (float("inf"), float("-inf")):
                raise ValueError(f"'{name}' must be a finite number, got {v!r}")
            if lo is not None and v < lo:
                raise ValueError(f"'{name}' must be >= {lo}, got {v}")
            if hi is not None and v > hi:
                raise ValueError(f"'{name}' must be <= {hi}, got {v}")

        finite("temperature", self.temperature, 0, 100)
        finite("top_p", self.top_p, 0, 1)
        finite("min_p", self.min_p, 0, 1)
        finite("repeat_penalty", self.repeat_penalty, 0, 100)
        if self.repeat_penalty == 0:            # it divides the logits of recent tokens
            raise ValueError("'repeat_penalty' must be > 0 (1.0 = off), got 0")
        finite("presence_penalty", self.presence_penalty, -100, 100)
        finite("frequency_penalty", self.frequency_penalty, -100, 100)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0 or self.top_k > vocab_size:
            raise ValueError(f"'top_k' must be an integer in 0..{vocab_size}, got {self.top_k!r}")
        if not isinstance(self.repeat_last_n, int) or isinstance(self.repeat_last_n, bool) or self.repeat_last_n < -1:
            raise ValueError(f"'repeat_last_n' must be an integer >= -1, got {self.repeat_last_n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(1 << 63) <= self.seed < (1 << 64)):
            raise ValueError(f"'seed' must be an integer, got {self.seed!r}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise ValueError(f"'logit_bias' token id {tok!r} is outside the vocabulary (0..{vocab_size - 1})")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or bias != bias:
                raise ValueError(f"'logit_bias' value for token {tok} must be a number, got {bias!r}")
            if isinstance(bias, int) and abs(bias) > 1e300:     # would not convert to a float
                raise ValueError(f"'logit_bias' value for token {tok} is out of range "
                                 "(use -inf or a float to ban a token)")


@dataclass
class TokenProbs:
    """One draw's probabilities: the chosen token and the most likely ones, as natural logs
    (post_sampling: of the probabilities after the whole chain; -inf for a banned token)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]
    post_sampling: bool = False


def _top(ids: np.ndarray, logp: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n largest (id, logp), by logp descending then id ascending."""
    if n <= 0 or ids.size == 0:
        return []
    n = min(n, ids.size)
    part = np.argpartition(-logp, n - 1)[:n] if n < ids.size else np.arange(ids.size)
    order = np.lexsort((ids[part], -logp[part]))
    return [(int(ids[part[j]]), float(logp[part[j]])) for j in order]


class Sampler:
    """Stateful sampler for one request: owns the random generator (and the request's grammar
    constraint and probability records, when it has them)."""

    def __init__(self, params: SamplingParams, constraint=None, n_probs: int = 0,
                 want_probs: bool = False, post_sampling: bool = False):
        self.params = params
        seed = params.seed if params.seed is not None and params.seed >= 0 else None
        self.rng = np.random.default_rng(None if seed is None else seed & ((1 << 64) - 1))
        self.constraint = constraint          # engine/constrain.py Constraint, or None
        self.n_probs = n_probs
        self.want_probs = want_probs or n_probs > 0
        self.post_sampling = post_sampling
        self.records: list[TokenProbs] = []   # one per draw when want_probs

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.params
        logits = np.array(logits, dtype=np.float32, copy=True)
        for tok, bias in p.logit_bias.items():
            logits[tok] += np.float32(bias) if bias != float("-inf") else -np.inf
        if history and (p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:] if p.repeat_last_n else []
            for tok, count in Counter(window).items():
                if p.repeat_penalty != 1.0:
                    logits[tok] = logits[tok] / p.repeat_penalty if logits[tok] > 0 else logits[tok] * p.repeat_penalty
                logits[tok] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
        return logits

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        logits = self.apply_penalties(logits, history or [])
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if allowed is not None:
            logits[~allowed] = -np.inf
        token, kept, kept_p = self._draw(logits)
        if self.want_probs:
            self.records.append(self._record(logits, token, kept, kept_p))
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _record(self, logits, token, kept, kept_p) -> TokenProbs:
        if self.post_sampling:
            with np.errstate(divide="ignore"):
                logp = np.log(kept_p)
            hit = np.flatnonzero(kept == token)
            lp = float(logp[hit[0]]) if hit.size else float("-inf")
            return TokenProbs(token, lp, _top(kept, logp, self.n_probs), True)
        z = logits.astype(np.float64)
        finite = np.isfinite(z)
        zmax = z[finite].max() if finite.any() else 0.0
        lse = zmax + np.log(np.exp(z[finite] - zmax).sum()) if finite.any() else 0.0
        ids = np.flatnonzero(finite)
        logp = z[ids] - lse
        lp = float(z[token] - lse) if finite[token] else float("-inf")
        return TokenProbs(token, lp, _top(ids, logp, self.n_probs))

    def _draw(self, logits: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """The token, and the candidates the chain kept with their final probabilities."""
        p = self.params
        if p.is_greedy:
            t = int(np.argmax(logits))
            return t, np.array([t]), np.array([1.0])
        # candidates sorted by logit, descending (top_k first bounds the sort)
        k = p.top_k if 0 < p.top_k < logits.size else logits.size
        idx = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(logits.size)
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        cand = logits[idx].astype(np.float64)
        if not np.isfinite(cand[0]):          # every token banned by logit_bias: fall back
            return int(idx[0]), idx[:1], np.array([1.0])
        finite = np.isfinite(cand)
        cand, idx = cand[finite], idx[finite]
        probs = np.exp(cand - cand[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            cand, probs, idx = cand[:keep], probs[:keep], idx[:keep]
        if p.min_p > 0.0:
            keep = max(1, int(np.sum(probs >= p.min_p * probs[0])))
            cand, idx = cand[:keep], idx[:keep]
        scaled = (cand - cand[0]) / p.temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        return int(idx[self.rng.choice(probs.size, p=probs)]), idx, probs
