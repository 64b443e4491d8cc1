"""`genie-rt bench`: prompt processing and generation speed, the way llama-bench measures.

    genie-rt bench -m FILE -p 18,33,128,512 -n 128 [-d 0,1024] -r 5 [--json]

- ppN: one batch of N prompt tokens (random ids) processed at depth d; tokens/s = N / time.
- tgN: N tokens generated one at a time at depth d, each step a full decode (on the GPU:
  the captured graph - forward, output projection and sampling) and the host reading
  the sampled id, as a real generation does; tokens/s = N / time.
- Each test runs once as a warm-up, then `-r` times; mean +- stddev of tokens/s.
- Decode also reports the fraction of the bandwidth roofline: the weight bytes one
  token streams (every matrix once, one embedding row) over the measured bandwidth.

The depth is reached by prefilling d random tokens before each repetition (not timed).
Power mode, clocks and temperatures are read before the first test and after each one
(engine/throttle.py): a summary and any sign of throttling are printed below the table.
Random tokens are drawn with a fixed seed, so runs are comparable.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .sampling import Sampler, SamplingParams


@dataclass
class BenchResult:
    test: str                   # "pp512", "tg128"
    n_prompt: int
    n_gen: int
    n_depth: int
    samples_ts: list[float] = field(default_factory=list)   # tokens/s per repetition

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise ValueError(f"{name} values must be >= 0, got {text!r}")
    return values


def _sync(backend) -> None:
    backend.synchronize()


def _fill(backend, rng, vocab, depth: int) -> None:
    if depth:
        backend.prefill(rng.integers(0, vocab, depth).astype(np.int32), 0)


def time_pp(backend, rng, vocab, n: int, depth: int) -> float:
    _fill(backend, rng, vocab, depth)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    _sync(backend)
    t0 = time.perf_counter()
    backend.prefill(tokens, depth)
    _sync(backend)
    return n / (time.perf_counter() - t0)


def time_tg(backend, rng, vocab, n: int, depth: int) -> float:
    _fill(backend, rng, vocab, depth)
    sampler = Sampler(SamplingParams(temperature=0))
    token = int(rng.integers(0, vocab))
    history: list[int] = [token]
    _sync(backend)
    t0 = time.perf_counter()
    steps = backend.decode_tokens(token, depth, sampler, history)   # what generation runs
    for _ in range(n):
        history.append(next(steps))
    steps.close()
    _sync(backend)
    return n / (time.perf_counter() - t0)


def run_bench(args, ecfg) -> int:
    from .engine import Engine
    from .platform_probe import Probe
    from .throttle import hints, summary
    probe = Probe()
    prompts = _ints(args.n_prompt, "-p")
    gens = _ints(args.n_gen, "-n")
    depths = _ints(args.depth, "-d")
    if args.repetitions < 1:
        raise ValueError("-r must be >= 1")
    if not depths:
        raise ValueError(f"-d needs at least one depth (e.g. -d 0), got {args.depth!r}")
    if not any(prompts) and not any(gens):
        raise ValueError("nothing to measure: give -p and/or -n sizes above 0")
    need = max(depths) + max(prompts + gens + [0]) + 1
    if ecfg.n_ctx is None:
        ecfg.n_ctx = max(need, 512)
    from .cli import load_progress
    engine = Engine.load(args.model, ecfg, progress=load_progress(args))
    backend, cfg = engine.backend, engine.cfg
    if need > backend.n_ctx:
        raise ValueError(f"the tests need {need} positions but the context is {backend.n_ctx}; pass a larger --ctx")
    rng = np.random.default_rng(0)
    results = []
    telemetry = [probe.telemetry()]
    tests = [(f"pp{n}", n, 0, d) for d in depths for n in prompts if n] + \
            [(f"tg{n}", 0, n, d) for d in depths for n in gens if n]
    for name, n_p, n_g, d in tests:
        fn = (lambda: time_pp(backend, rng, cfg.vocab_size, n_p, d)) if n_p else \
             (lambda: time_tg(backend, rng, cfg.vocab_size, n_g, d))
        fn()  # warm-up
        r = BenchResult(name, n_p, n_g, d, [fn() for _ in range(args.repetitions)])
        results.append(r)
        telemetry.append(probe.telemetry())
        if not args.json:
            print(f"{name:>8} @ d{d:<6} {r.avg_ts:10.2f} +- {r.stddev_ts:7.2f} tokens/s", flush=True)

    info = {"model": str(args.model), "backend": backend.name, "n_ctx": backend.n_ctx, "kv_dtype": engine.ecfg.kv_dtype,
            "kv_bytes": engine.plan.kv, "weights_bytes": engine.plan.weights,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    info.update(backend.device_info())
    roofline = backend.roofline()        # {"bytes_per_token": ..., "bandwidth": ...} or None
    rows = []
    for r in results:
        row = {**asdict(r), "avg_ts": r.avg_ts, "stddev_ts": r.stddev_ts}
        if roofline and r.n_gen:
            ceiling = roofline["bandwidth"] / roofline["bytes_per_token"]
            row["roofline_fraction"] = r.avg_ts / ceiling
        rows.append(row)
    peak = backend.peak_memory_bytes()
    if peak is not None:
        info["peak_memory_bytes"] = peak
    platform_info = {"summary": summary(telemetry), "hints": hints(telemetry)}
    if args.json:
        json.dump({"info": info, "roofline": roofline, "results": rows, "platform": platform_info}, sys.stdout,
                  indent=2)
        print()
    else:
        print(f"\nmodel {info['model']}  backend {info['backend']}  ctx {info['n_ctx']}  "
              f"KV {info['kv_dtype']} {info['kv_bytes'] / 2**20:.1f} MiB  weights {info['weights_bytes'] / 2**20:.0f} MiB"
              + (f"  peak memory {info['peak_memory_bytes'] / 2**20:.0f} MiB" if "peak_memory_bytes" in info else ""))
        if roofline:
            print(f"decode roofline: {roofline['bytes_per_token'] / 1e9:.3f} GB per token at "
                  f"{roofline['bandwidth'] / 1e12:.2f} TB/s -> {roofline['bandwidth'] / roofline['bytes_per_token']:.0f} tokens/s")
            for row in rows:
                if "roofline_fraction" in row:
                    print(f"  {row['test']} @ d{row['n_depth']}: {100 * row['roofline_fraction']:.1f} % of the roofline")
        sm = platform_info["summary"]
        if sm:
            print("platform: " + ", ".join(f"{k} {v}" for k, v in sm.items() if v is not None))
        for h in platform_info["hints"]:
            print(f"throttle? {h}")
    return 0
