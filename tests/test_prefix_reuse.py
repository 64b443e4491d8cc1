"""In-memory prefix reuse (engine/engine.py `_restore`), on the CPU back-end.

What the engine reports is checked, never the clock: `n_cached`, and what it really
prefilled (a spy on the back-end's `prefill` records how many tokens at which start
position). A reused prefix must give the same logits as a cold run (cosine >= 0.999,
same argmax) and the same greedy text; reuse works across unrelated requests that share
a system prompt, never exceeds len(prompt) - 1, and survives a cancelled prefill.
The speed-up itself (>= 10x for a 500-token system prompt) is measured by
tools/bench_prefix.py, not asserted here.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine, common_prefix_len
from genie_rt.engine.generate import GenerationRequest
from genie_rt.engine.sampling import SamplingParams

MODEL = Path(__file__).resolve().parent / "fixtures" / "qwen3-micro-q4km.gguf"
GREEDY = SamplingParams(temperature=0)


class Spy:
    """Wraps backend.prefill: records (n_tokens, start) and the returned logits."""

    def __init__(self, engine: Engine):
        self.calls: list[tuple[int, int]] = []
        self.logits: list[np.ndarray] = []
        real = engine.backend.prefill

        def prefill(tokens, start, cancel=None, all_logits=False):
            self.calls.append((len(tokens), start))
            out = real(tokens, start, cancel, all_logits)
            self.logits.append(out)
            return out

        engine.backend.prefill = prefill

    def last(self) -> tuple[int, int]:
        return self.calls[-1]


def load(kv_dtype: str = "int8", n_ctx: int = 640) -> Engine:
    return Engine.load(MODEL, EngineConfig(backend="cpu", n_ctx=n_ctx, kv_dtype=kv_dtype))


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 4000, n)]


def run(engine: Engine, prompt: list[int], max_tokens: int = 6, cancel=None):
    req = GenerationRequest(prompt=prompt, params=GREEDY, max_tokens=max_tokens, cancel=cancel)
    return list(engine.generate(req))[-1].result


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_logits_match(warm, cold):
    cos = cosine(warm, cold)
    worst = int(np.argmax(np.abs(warm - cold)))
    assert cos >= 0.999, f"cosine {cos:.6f}; worst logit {worst}: {warm[worst]} vs {cold[worst]}"
    assert int(np.argmax(warm)) == int(np.argmax(cold))


@pytest.fixture(scope="module")
def cold_engine() -> Engine:
    return load("int8")


def cold_logits(cold_engine: Engine, prompt: list[int]) -> np.ndarray:
    cold_engine.kv_tokens = []
    return cold_engine.backend.prefill(prompt, 0)


def test_shared_500_token_system_prompt_across_unrelated_requests(cold_engine):
    e = load("int8")
    spy = Spy(e)
    system = tokens(500, seed=1)
    a, b = [11] + tokens(20, seed=2), [12] + tokens(9, seed=3)   # unrelated user turns
    r1 = run(e, system + a)
    assert r1.n_cached == 0 and spy.last() == (521, 0)
    r2 = run(e, system + b)
    assert r2.n_cached == 500
    assert spy.last() == (10, 500), "only the new user tokens are prefilled"
    assert_logits_match(spy.logits[-1], cold_logits(cold_engine, system + b))
    cold_engine.kv_tokens = []
    assert r2.tokens == run(cold_engine, system + b).tokens
    assert e.stats.prompt_tokens_cached == 500 and e.stats.prefix_hits == 1


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_reuse_with_other_kv_dtypes(kv_dtype):
    e, cold = load(kv_dtype, 256), load(kv_dtype, 256)
    spy = Spy(e)
    system = tokens(120, seed=4)
    run(e, system + [5, 6, 7])
    r = run(e, system + [8, 9])
    assert r.n_cached == 120 and spy.last() == (2, 120)
    cold.kv_tokens = []
    assert_logits_match(spy.logits[-1], cold.backend.prefill(system + [8, 9], 0))
    assert r.tokens == run(cold, system + [8, 9]).tokens


def test_identical_prompt_prefills_exactly_one_token(cold_engine):
    e = load("int8", 256)
    spy = Spy(e)
    p = tokens(80, seed=5)
    first = run(e, p)
    again = run(e, p)
    assert again.n_cached == len(p) - 1 and spy.last() == (1, len(p) - 1)
    assert again.tokens == first.tokens
    assert_logits_match(spy.logits[-1], spy.logits[0])


def test_shorter_prompt_inside_the_cache_and_single_token_prompt():
    e = load("int8", 256)
    spy = Spy(e)
    p = tokens(60, seed=6)
    run(e, p)
    r = run(e, p[:30])                                   # a strict prefix of what the pool holds
    assert r.n_cached == 29 and spy.last() == (1, 29)
    r = run(e, p[:1])                                    # nothing can be reused from one token
    assert r.n_cached == 0 and spy.last() == (1, 0)


def test_unrelated_prompt_reuses_nothing():
    e = load("int8", 256)
    spy = Spy(e)
    run(e, [100] + tokens(40, seed=7))
    r = run(e, [200] + tokens(40, seed=7))
    assert r.n_cached == 0 and spy.last() == (41, 0)


def test_multi_turn_reuses_prompt_and_generated_tokens(cold_engine):
    e = load("int8", 256)
    spy = Spy(e)
    p1 = tokens(70, seed=8)
    r1 = run(e, p1, max_tokens=5)
    assert e.kv_tokens == p1 + r1.tokens[:-1]           # the last sampled token was never decoded
    p2 = p1 + r1.tokens + tokens(15, seed=9)
    r2 = run(e, p2)
    assert r2.n_cached == len(p1) + len(r1.tokens) - 1
    assert spy.last() == (len(p2) - r2.n_cached, r2.n_cached)
    assert_logits_match(spy.logits[-1], cold_logits(cold_engine, p2))


class CancelAfter(threading.Event):
    """An Event that reports set from its n-th is_set() call on (a client leaving mid-prefill)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_cancelled_prefill_never_leaves_untracked_positions_trusted(cold_engine):
    e = load("int8", 256)
    e.backend.prefill_chunk = 8
    spy = Spy(e)
    system = tokens(40, seed=10)
    run(e, system + [1, 2, 3])
    held = list(e.kv_tokens)
    # shares 40 tokens; its first chunk (positions 40..47) overwrites the old turn, then the client leaves
    r = run(e, system + tokens(30, seed=11), cancel=CancelAfter(1))
    assert r.finish_reason == "cancelled" and r.n_cached == 40
    assert e.kv_tokens == held[:40]
    p = system + [1, 2, 3, 4]                            # would match the old turn's positions 40..42
    r = run(e, p)
    assert r.n_cached == 40 and spy.last() == (4, 40)
    assert_logits_match(spy.logits[-1], cold_logits(cold_engine, p))


@pytest.mark.slow       # many random request sequences against cold runs
def test_random_request_sequences_keep_the_invariants(cold_engine):
    """Requests drawn from a few shared prefixes: n_cached is always the longest common
    prefix with what the pool held, capped at len(prompt) - 1, and exactly the rest is
    prefilled; the pool's token record is always prompt + generated[:-1]."""
    e = load("int8", 256)
    spy = Spy(e)
    rng = np.random.default_rng(12)
    prefixes = [tokens(n, seed=20 + n) for n in (0, 8, 30, 45)]
    history: list[list[int]] = []
    for i in range(14):
        if history and rng.random() < 0.3:
            prompt = list(history[int(rng.integers(len(history)))])    # a repeat or an extension
            prompt = prompt[:int(rng.integers(1, len(prompt) + 1))] + tokens(int(rng.integers(0, 4)), 100 + i)
        else:
            prompt = prefixes[int(rng.integers(len(prefixes)))] + tokens(int(rng.integers(1, 12)), 200 + i)
        held = list(e.kv_tokens)
        r = run(e, prompt, max_tokens=int(rng.integers(1, 4)))
        want = min(common_prefix_len(held, prompt), len(prompt) - 1)
        assert r.n_cached == want, (i, r.n_cached, want)
        assert spy.last() == (len(prompt) - want, want)
        assert e.kv_tokens == prompt + r.tokens[:-1]
        history.append(prompt + r.tokens)
    assert_logits_match(spy.logits[-1], cold_logits(cold_engine, prompt))
