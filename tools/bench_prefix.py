#!/usr/bin/env python3
"""Prefix reuse speed-up: a request that shares a long system prompt with the previous one.

Three prefills of the same prompt (system prompt + a short user turn), timed by the
engine itself (GenerationResult.prompt_ms, which includes the prefix matching and any
file hydration):

    cold   nothing reusable: the whole prompt is prefilled
    warm   the pool holds the system prompt from an unrelated earlier request (in memory)
    disk   the pool is forgotten; the conversation's KV file is hydrated from disk

The acceptance target is warm >= 10x faster than cold for a 500-token system prompt on
each back-end. Without -m a synthetic Qwen3 model is written with tools/synth_gguf.py
(default: 4 layers, hidden 1024 - big enough that prefill, not Python overhead,
dominates on the CPU back-end).

    python tools/bench_prefix.py                        # CPU back-end, synthetic model
    python tools/bench_prefix.py --backend cuda -m qwen3-4b-q4_k_m.gguf
    python tools/bench_prefix.py --system-tokens 2000 --kv f16 --repeat 5

--ab "M.K=V,M.K=V;M.K=V" (CUDA) then times warm requests, each after a cold one, with lab knobs set
each ';'-separated way (tools/lab_knobs.py assignments) in one process: round after round, each way's
short and bucket prefill graphs captured again after its knobs are set (a knob read at capture
applies), so the ways see the same machine and the same drift.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_SHAPE = dict(layers=4, hidden=1024, heads=8, kv_heads=4, head_dim=128, ffn=3072, vocab=4122, tied=True)


def synth_model(folder: Path, seed: int) -> Path:
    spec = importlib.util.spec_from_file_location("synth_gguf", HERE / "synth_gguf.py")
    sg = importlib.util.module_from_spec(spec)
    sys.modules["synth_gguf"] = sg
    spec.loader.exec_module(sg)
    return sg.write_synthetic_qwen3(folder / "bench-prefix.gguf", DEFAULT_SHAPE, seed=seed)


def greedy_request(prompt: list[int], max_tokens: int = 1, conversation_id: str | None = None):
    """The request every measurement here makes: greedy, `max_tokens` tokens."""
    from genie_rt.engine.generate import GenerationRequest
    from genie_rt.engine.sampling import SamplingParams
    return GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0), max_tokens=max_tokens,
                             conversation_id=conversation_id)


def cuda_breakdown(engine, prompt: list[int]) -> dict:
    """One warm request's prefill, step by step as CUDABackend.prefill_sample runs it, with
    host clocks around each step and CUDA events around the two graphs."""
    from numba import cuda

    from genie_rt.engine.sampling import Sampler
    be = engine.backend
    req = greedy_request(prompt)
    be.synchronize()
    t0 = time.perf_counter()
    n_reuse = engine._restore(req)
    t1 = time.perf_counter()
    be._enter()
    e0, e1, e2 = cuda.event(), cuda.event(), cuda.event()
    e0.record(be.stream)
    be._prefill_layers(np.asarray(prompt[n_reuse:], np.int32), n_reuse)
    e1.record(be.stream)
    t2 = time.perf_counter()
    be._begin_request(Sampler(req.params), prompt, wait=False)   # while the device runs the prefill
    t3 = time.perf_counter()
    be._run(("head", "greedy"), lambda: be._record_head(be.arena["x_last"], "greedy"))
    e2.record(be.stream)
    t4 = time.perf_counter()
    be.stream.synchronize()
    be._read_token()
    t5 = time.perf_counter()
    engine.kv_tokens = list(prompt)
    return {"host: prefix match (engine._restore)": (t1 - t0) * 1e3,
            "host: prefill enqueue (sync, mirrors, graph launch)": (t2 - t1) * 1e3,
            "host: begin request (sampler params; the device runs the prefill)": (t3 - t2) * 1e3,
            "host: head enqueue": (t4 - t3) * 1e3,
            "host: wait for the device + read the token": (t5 - t4) * 1e3,
            "total (host clock)": (t5 - t0) * 1e3,
            "device: prefill graph (events)": e0.elapsed_time(e1),
            "device: head graph + sampling (events)": e1.elapsed_time(e2)}


def direct_ms(engine, prompt: list[int]) -> float:
    """Host ms of a warm request's prefix match and `prefill_sample`, called as Engine.generate calls
    them but without the generator around them: beside the breakdown and GenerationResult.prompt_ms,
    which of the two layers holds the time one has and the other has not."""
    req = greedy_request(prompt)
    sampler = engine._sampler(req, 0)
    engine.backend.synchronize()
    t0 = time.perf_counter()
    n_reuse = engine._restore(req)
    engine.backend.prefill_sample(prompt[n_reuse:], n_reuse, sampler, prompt)
    t1 = time.perf_counter()
    engine.kv_tokens = list(prompt)
    return (t1 - t0) * 1e3


def generate_parts(engine, prompt: list[int]) -> dict:
    """One warm request through Engine.generate (its prompt_ms, as the warm row times it), with host
    clocks around the back-end calls it makes on the way: which of them holds the time prompt_ms has
    and cuda_breakdown's total has not. The wrappers are instance attributes, removed before
    returning; each adds well under a microsecond a call. (The ids and state slots are copied by the
    prefill graph's own first nodes: no host call to time.)"""
    from genie_rt.engine import gpu_sampling
    be = engine.backend
    spent: dict[str, float] = {}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t) * 1e3
        return call
    names = ("prefill_sample", "_enter", "_prefill_layers", "_set_state", "_splits", "_run", "_begin_request",
             "_read_token")
    for name in names:
        setattr(be, name, timed(name, getattr(be, name)))
    # (numba's Stream.synchronize: the prefill's sync before it rewrites the pinned mirrors, and the wait at the end)
    be.stream.synchronize = timed("stream.synchronize (numba)", be.stream.synchronize)
    real_check, real_ws = gpu_sampling.check_request, gpu_sampling.check_workspace
    # (Engine.generate's prefill_sample(checked=True) runs check_workspace before the enqueue; check_request,
    # which calls it too, runs in set_request after it - so the second count includes the first's kind)
    gpu_sampling.check_request = timed("check_request (after the enqueue)", real_check)
    gpu_sampling.check_workspace = timed("check_workspace", real_ws)
    collections = gc.get_count()
    try:
        r = list(engine.generate(greedy_request(prompt)))[-1].result
    finally:
        for name in names:
            delattr(be, name)
        del be.stream.synchronize
        gpu_sampling.check_request, gpu_sampling.check_workspace = real_check, real_ws
    out = {"Engine.generate's prompt_ms": r.prompt_ms}
    out.update({f"  of which {k}": v for k, v in spent.items()})
    out["gc generation-0 count before (of 700)"] = float(collections[0])
    return out


def profile_warm(run, prompts: list[list[int]], top: int) -> str:
    """pstats of `run(prompt)` over prompts that each follow the one before (every one warm: they
    share the system prompt), the `top` functions by their own time."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    run(prompts[0])
    prof.enable()
    for prompt in prompts[1:]:
        run(prompt)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join("    " + line for line in lines[start:] if line.strip())


def greedy_agreement(engine, prompt: list[int], other: list[int], n: int = 8) -> tuple[list[int], list[int]]:
    """The greedy continuation of `prompt` prefilled cold, then warm (after `other`, which shares its
    system prompt, so only the user turn is prefilled): a check that the warm path - e.g. the short
    prefill - computes what the cold one does, and that decoding after it does too."""
    def run(p: list[int], k: int) -> list[int]:
        return list(engine.generate(greedy_request(p, k)))[-1].result.tokens

    engine.kv_tokens = []
    engine.kv_store = None
    cold = run(prompt, n)
    run(other, 1)
    return cold, run(prompt, n)


def logits_agreement(engine, prompt: list[int], shared: int) -> float:
    """Cosine of the next-token logits of `prompt` prefilled whole (cold) and of its last
    len(prompt) - shared tokens prefilled after the first `shared` (warm: the back-end's own
    prefill at a start of `shared`, e.g. the 16-row bucket with its attention splits merged, or
    the short graph). Random-weight models have many near-ties, so the greedy tokens above may
    part where this stays >= 0.999."""
    be = engine.backend
    p = np.asarray(prompt, np.int32)
    a = np.asarray(be.prefill(p, 0), np.float64).ravel().copy()
    b = np.asarray(be.prefill(p[shared:], shared), np.float64).ravel()
    engine.kv_tokens = []                        # the back-end's cache no longer matches the pool's record
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def ab_ways(engine, specs: list, rounds: int, per: int, measure) -> dict:
    """{way: [(prompt_ms, device graph ms), ...]} of warm requests after cold ones (measure(i) -> one
    such pair) with each way's knobs set (tools/lab_knobs.py Ways), the ways alternating round by
    round; every knob is put back after. Each way's prefill graphs are captured again (an untimed
    warm request) after its knobs are set."""
    sys.path.insert(0, str(HERE))
    from lab_knobs import Ways
    names = [",".join(spec) or "(as is)" for spec in specs]
    if len(set(names)) != len(names):
        raise SystemExit(f"bench_prefix --ab: a way is given twice ({names})")
    knobs = Ways(specs)                                      # every assignment checked before any timing
    be = engine.backend

    def drop_prefill_graphs():
        for key in [k for k in be._graphs if k[0] in ("prefill", "prefill_short")]:
            be._graphs.pop(key).close()
    out = {name: [] for name in names}
    try:
        for r in range(rounds):
            for name, spec in zip(names, specs):
                knobs.use(spec)
                be.synchronize()
                drop_prefill_graphs()
                measure(10_000 + 100 * r)                          # captures this way's graphs (untimed)
                out[name] += [measure(10_001 + 100 * r + i) for i in range(per)]
    finally:
        knobs.restore()
        be.synchronize()
        drop_prefill_graphs()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: a synthetic model)")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="cpu")
    p.add_argument("--kv", choices=("int8", "f16", "f32"), default="int8")
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--user-tokens", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5, help="measurements per case (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-pdl", action="store_true",
                   help="CUDA: EngineConfig.prefill_pdl (the prefill's GEMMs by programmatic dependent launch)")
    p.add_argument("--short-prefill", action="store_true",
                   help="CUDA: EngineConfig.short_prefill (up to 8 new tokens by the int8 tensor-core GEMV)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also profile the host side of 100 warm requests (cProfile) and print the N "
                        "functions with the most time of their own")
    p.add_argument("--breakdown-after-cold", action="store_true",
                   help="CUDA: also break down warm requests that each follow a cold one (as the warm row's "
                        "do), beside the back-to-back ones")
    p.add_argument("--no-pdl", action="store_true",
                   help="CUDA: EngineConfig.decode_pdl off (the decode step's and the short prefill's launches plain)")
    p.add_argument("--ab", default=None, metavar="M.K=V,M.K=V;...",
                   help="CUDA: also time warm requests (each after a cold one) with lab knobs set each "
                        "';'-separated way, in alternating rounds (module docstring); an empty way is the "
                        "knobs as they are")
    p.add_argument("--ab-rounds", type=int, default=4, help="rounds of --ab (each way once a round)")
    args = p.parse_args(argv)

    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.kvcache.persist import KVStore

    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else synth_model(tmp, args.seed)
        n_ctx = args.system_tokens + 2 * args.user_tokens + 16
        engine = Engine.load(model, EngineConfig(backend=args.backend, n_ctx=n_ctx, kv_dtype=args.kv,
                                                 prefill_pdl=args.prefill_pdl, short_prefill=args.short_prefill,
                                                 decode_pdl=not args.no_pdl))
        store = KVStore(tmp / "kv")
        rng = np.random.default_rng(args.seed)
        vocab = min(engine.cfg.vocab_size, 4000)
        system = [int(t) for t in rng.integers(0, vocab, args.system_tokens)]

        def user(i: int) -> list[int]:
            return [1000 + i % 1000] + [int(t) for t in rng.integers(0, vocab, args.user_tokens - 1)]

        def prefill_ms(prompt: list[int], cid: str | None = None):
            r = list(engine.generate(greedy_request(prompt, conversation_id=cid)))[-1].result
            return r.prompt_ms, r.n_cached

        prefill_ms(system + user(0))                         # warm-up: BLAS threads, first-touch pages
        cold, warm, disk = [], [], []
        for i in range(args.repeat):
            engine.kv_tokens = []                            # forget the pool: nothing reusable
            engine.kv_store = None
            cold.append(prefill_ms(system + user(2 * i + 1)))
            warm.append(prefill_ms(system + user(2 * i + 2)))     # unrelated request, same system prompt
            engine.kv_store = store
            store.save(engine, "bench")                      # as at the end of a turn
            engine.kv_tokens = []                            # a restarted process: only the file is left
            disk.append(prefill_ms(system + user(2 * i + 3), "bench"))

        if engine.backend.name == "cuda":
            parts = [cuda_breakdown(engine, system + user(2 * args.repeat + 10 + i)) for i in range(args.repeat)]
            after_cold = []
            if args.breakdown_after_cold:        # prompts of their own: the ones below stay a plain run's
                other = np.random.default_rng(args.seed + 1)

                def turn(first: int) -> list[int]:
                    return system + [first % vocab] + [int(t) for t in other.integers(0, vocab, args.user_tokens - 1)]
                def following_cold(first: int, measure):
                    """measure(a warm turn) right after a cold request (the pool forgotten first), as the
                    warm row's requests run: the cold turn starts with token `first`, the warm one with
                    first + 500 (both mod the vocabulary)."""
                    engine.kv_tokens = []
                    prefill_ms(turn(first))
                    return measure(turn(first + 500))

                def without_gc(prompt: list[int]) -> float:
                    gc.disable()
                    try:
                        return prefill_ms(prompt)[0]
                    finally:
                        gc.enable()
                direct, generated, nogc, inside = [], [], [], []
                for i in range(args.repeat):
                    after_cold.append(following_cold(3000 + i, lambda p: cuda_breakdown(engine, p)))
                    direct.append(following_cold(4000 + i, lambda p: direct_ms(engine, p)))
                    generated.append(following_cold(5000 + i, lambda p: prefill_ms(p)[0]))
                    nogc.append(following_cold(6000 + i, without_gc))
                    inside.append(following_cold(7000 + i, lambda p: generate_parts(engine, p)))
            if args.ab:
                other_ab = np.random.default_rng(args.seed + 2)

                def ab_measure(first: int) -> tuple:
                    """(prompt_ms, device ms of the prefill graph) of a warm turn after a cold one."""
                    engine.kv_tokens = []
                    head = [first % vocab]
                    prefill_ms(system + head + [int(t) for t in other_ab.integers(0, vocab, args.user_tokens - 1)])
                    prompt = system + [(first + 500) % vocab] + [int(t) for t in other_ab.integers(0, vocab, args.user_tokens - 1)]
                    ms = prefill_ms(prompt)[0]
                    engine.kv_tokens = []                # the breakdown's own turn, after another cold one
                    prefill_ms(system + head)
                    return ms, cuda_breakdown(engine, prompt)["device: prefill graph (events)"]
                ab = ab_ways(engine, [[a for a in spec.split(",") if a] for spec in args.ab.split(";")],
                             args.ab_rounds, args.repeat, ab_measure)
        info = engine.backend.device_info()
        agree = greedy_agreement(engine, system + user(997), system + user(998))
        cos = logits_agreement(engine, system + user(996), args.system_tokens)
        if args.host_profile:        # last: the prompts above stay those of a run without it
            host_profile = profile_warm(prefill_ms, [system + user(2 * args.repeat + 40 + i) for i in range(101)],
                                        args.host_profile)

    med = {name: statistics.median(ms for ms, _ in runs) for name, runs in
           (("cold", cold), ("warm", warm), ("disk", disk))}
    n_prompt = args.system_tokens + args.user_tokens
    print(f"model {model.name if args.model else 'synthetic ' + str(DEFAULT_SHAPE)}")
    print(f"back-end {engine.backend.name}, KV {args.kv}, prompt {n_prompt} tokens "
          f"({args.system_tokens} shared), median of {args.repeat}, {time.strftime('%Y-%m-%d')}")
    if "short_prefill" in info:
        print(f"short prefill: {info['short_prefill']}")
    for name, runs in (("cold", cold), ("warm", warm), ("disk", disk)):
        n_cached = runs[-1][1]
        print(f"  {name:5s} prefill {med[name]:9.2f} ms   reused {n_cached:5d}, prefilled "
              f"{n_prompt - n_cached:5d} tokens   speed-up {med['cold'] / med[name]:6.1f}x")
    print("  each run, in order (ms): " + "; ".join(
        f"{name} " + " ".join(f"{ms:.2f}" for ms, _ in runs) for name, runs in (("cold", cold), ("warm", warm), ("disk", disk))))
    if engine.backend.name == "cuda":
        print("  warm request on the CUDA back-end, where the time goes (median ms"
              + ("; back to back, then each after a cold request):" if after_cold else "):"))
        for key in parts[0]:
            print(f"    {key:44s} {statistics.median(p[key] for p in parts):7.3f}"
                  + (f" {statistics.median(p[key] for p in after_cold):7.3f}" if after_cold else ""))
    if engine.backend.name == "cuda" and after_cold:
        print(f"  the same kind of warm request (after a cold one), host clock: _restore + prefill_sample called "
              f"directly {statistics.median(direct):.3f} ms, Engine.generate's prompt_ms "
              f"{statistics.median(generated):.3f} ms, the same with the garbage collector off "
              f"{statistics.median(nogc):.3f} ms")
        print("  Engine.generate's warm request (after a cold one) with host clocks around the back-end's calls "
              "(median ms; a call made twice is summed):")
        for key in inside[0]:
            print(f"    {key:44s} {statistics.median(p.get(key, 0.0) for p in inside):7.3f}")
    if engine.backend.name == "cuda" and args.ab:
        print(f"  lab knobs each way ({args.ab_rounds} rounds of {args.repeat}, alternating; warm requests after "
              "a cold one): median prompt_ms, then the prefill graph by events (ms), each run in order")
        for way, runs in ab.items():
            print(f"    {way:60s} {statistics.median(m for m, _ in runs):7.3f} {statistics.median(d for _, d in runs):7.3f}"
                  f"   [{' '.join(f'{m:.2f}' for m, _ in runs)}]")
    if args.host_profile:
        print(f"  the host's side of 100 warm requests (cProfile: its own overhead included), by own time:\n{host_profile}")
    same = sum(a == b for a, b in zip(*agree))
    print(f"greedy tokens after the prompt, cold vs warm: {same} of {len(agree[0])} the same"
          f"{'' if same == len(agree[0]) else ' (cold ' + str(agree[0]) + ', warm ' + str(agree[1]) + ')'}")
    print(f"next-token logits, cold vs warm: cosine {cos:.6f}")
    ok = med["cold"] / med["warm"] >= 10
    print(f"warm speed-up {med['cold'] / med['warm']:.1f}x (target >= 10x): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
