#!/usr/bin/env python3
"""Where the short graph's attention chain spends its time: the fused launch (kvcache/attention_short.py)
against the three launches it replaces, and the fused launch with parts left out.

At Qwen3-4B's shapes (32 query heads, 8 KV heads, head_dim 128, int8 cache; 8 new tokens after
`--start` cached, the graph's 8 splits of which the state's count are in use), each timed as a CUDA
graph of 20 launches (engine/cuda_graph.time_us, microseconds a launch):

    rope_write, attention, merge_q8k   each of the three launches alone, then the three together
    fused                              the one launch (bit for bit the three: checked before timing)
    fused -rope / -writes / -tail      with attention_short.ABLATE: no rope_rows at all, the query rows
                                       only (no cache rows written), no merge and q8_K (wrong results by
                                       design: what each part costs)

    python tools/bench_short_attention.py --json short-attn.json          (needs a CUDA GPU)
    ncu --profile-from-start off ... python tools/bench_short_attention.py --ncu
        (--ncu: each way launched once between cudaProfilerStart and Stop, after a warm-up, no timing)

Results: docs/decode-step.md 7.
"""
from __future__ import annotations

import argparse
import json
import sys

ABLATIONS = ((), ("rope",), ("writes",), ("tail",), ("rope", "tail"))
EPS = 1e-6


def setup(start: int, splits: int, count: int, seed: int = 7):
    """Device buffers of one layer at the 4B's shapes; returns (three, fused, read) closures:
    three() and fused() launch, read() copies the outputs (cache rows, out, q8_K) to the host."""
    import numpy as np
    from numba import cuda

    from genie_rt.kvcache.attention_merge import merge_q8k
    from genie_rt.kvcache.attention_prefill import PrefillWorkspace, plan_prefill, prefill_attention
    from genie_rt.kvcache.attention_short import short_attention
    from genie_rt.kvcache.device_pool import DeviceKVPool
    from genie_rt.kvcache.pool import KVShape
    from genie_rt.kvcache.rope_write import rope_table, rope_write
    from genie_rt.quant.q8k_layout import sizes

    n_head, n_kv, hd, n = 32, 8, 128, 8
    rng = np.random.default_rng(seed)
    n_ctx = start + n + 8
    shape = KVShape(1, n_ctx, n_kv, hd, "int8")
    pool = DeviceKVPool(shape)
    L = pool.layer(0)
    for arr in (L.k, L.v):
        host = rng.integers(-127, 128, arr.shape).astype(np.int8)
        host[start:] = 0
        arr.copy_to_device(host)
    for arr in (L.k_scale, L.v_scale):
        host = rng.uniform(0.005, 0.05, arr.shape).astype(np.float32)
        host[start:] = 0
        arr.copy_to_device(host)
    qkv = cuda.to_device((rng.standard_normal((n, (n_head + 2 * n_kv) * hd)) * 3).astype(np.float32))
    qn = cuda.to_device((1 + 0.3 * rng.standard_normal(hd)).astype(np.float32))
    kn = cuda.to_device((1 + 0.3 * rng.standard_normal(hd)).astype(np.float32))
    cos, sin = (cuda.to_device(a) for a in rope_table(n_ctx, hd, 1e6))
    plan = plan_prefill(n_head, n_kv, hd, "int8", n_max=8, max_splits=splits)
    state = cuda.to_device(np.array([start, count], np.int32))
    cols = n_head * hd
    ws = PrefillWorkspace(plan)
    out = cuda.to_device(np.zeros((n, cols), np.float32))
    q = cuda.device_array((n, n_head, hd), np.float32)
    xq, xd, xb = (cuda.to_device(np.zeros(s, t)) for s, t in zip(sizes(n, cols), (np.int8, np.float32, np.int32)))
    stream = cuda.stream()

    parts = {
        "rope_write": lambda: rope_write(qkv, qn, kn, EPS, cos, sin, state, q, L, rope="neox", stream=stream),
        "attention": lambda: prefill_attention(q, L, state, out, ws, n_splits=splits, plan=plan, splits_at=1,
                                               merge=False, stream=stream),
        "merge_q8k": lambda: merge_q8k(ws.part_o, ws.part_ml, splits, state, 1, out, xq, xd, xb, stream=stream),
    }

    def three():
        for f in parts.values():
            f()

    def fused():
        short_attention(qkv, qn, kn, EPS, cos, sin, L, state, out, ws, splits, plan, 1, xq, xd, xb,
                        rope="neox", stream=stream)

    def read():
        stream.synchronize()
        return [a.copy_to_host() for a in (L.k, L.v, L.k_scale, L.v_scale, out, xq, xd, xb)]

    return parts, three, fused, read, stream


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", type=int, default=500, help="tokens already cached (default 500)")
    p.add_argument("--splits", type=int, default=8, help="the graph's splits (default 8)")
    p.add_argument("--count", type=int, default=4, help="splits in use, the state's count (default 4)")
    p.add_argument("--ncu", action="store_true", help="launch each way once between cudaProfilerStart/Stop")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import numpy as np
    from numba import cuda

    from genie_rt.engine.cuda_graph import time_us
    from genie_rt.kvcache import attention_short

    parts, three, fused, read, stream = setup(args.start, args.splits, args.count)

    def ablated(ab):
        attention_short.ABLATE = ab          # a build of its own (prefill_kernel's key)
        fused()                              # compiled now, outside any capture
        stream.synchronize()

    three()
    want = read()
    ablated(())
    got = read()
    names = ("k", "v", "k_scale", "v_scale", "out", "xq", "xd", "xb")
    bad = [nm for nm, a, b in zip(names, got, want) if not np.array_equal(a.view(np.uint8), b.view(np.uint8))]
    if bad:
        raise SystemExit(f"fused launch differs from the three launches in {bad}; not timing it")
    dev = cuda.get_current_device().name
    dev = dev.decode() if isinstance(dev, bytes) else dev
    print(f"{dev}: 8 tokens after {args.start}, {args.count} of {args.splits} splits; "
          "fused = the three launches, bit for bit")

    if args.ncu:
        for ab in ABLATIONS:                 # every build compiled before the profile
            ablated(ab)
        cuda.profile_start()
        for f in parts.values():
            f()
        for ab in ABLATIONS:
            attention_short.ABLATE = ab
            fused()
        stream.synchronize()
        cuda.profile_stop()
        print("ncu order: rope_write, attention, merge_q8k, then fused " + ", ".join(
            "-" + "-".join(ab) if ab else "(all)" for ab in ABLATIONS))
        return 0

    res = {}
    for name, f in parts.items():
        res[name] = time_us(f, stream)
    res["three"] = time_us(three, stream)
    for ab in ABLATIONS:
        ablated(ab)
        res["fused" + "".join(" -" + a for a in ab)] = time_us(fused, stream)
    attention_short.ABLATE = ()
    for name, us in res.items():
        print(f"  {name:24s} {us:8.2f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "start": args.start, "splits": args.splits, "count": args.count,
                       "us": res}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
