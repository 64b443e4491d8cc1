"""Microbenchmark of the attention kernels at Qwen3-4B shapes (GPU only).

    python -m genie_rt.kvcache.attention [--json PATH] [--quick] [--shapes NAME ...]

--shapes adds Gemma 3 270M (4 / 1 heads, head_dim 256: a global layer, and a local layer
with window 512 on a ring of 1023 slots) and SmolLM2-135M (9 / 3 heads, head_dim 64);
the default is Qwen3-4B alone (what tools/gpu_check.sh times).

Every configuration is checked against the numpy reference in the same run before it is
timed (a failed check skips its timing and makes the exit status 1). Times are GPU time
per launch from replaying a CUDA graph of 10-20 launches (the engine's decode path:
no host launch cost), median of 5 replays. Decode reports GB/s of K/V (+ scales) read
against 4.37 TB/s (the H200's measured 128-bit read rate from Numba); prefill reports
useful causal TFLOP/s (`prefill_flops`).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda

from genie_rt.quant.ptx import SIMULATOR

from .attention import (DecodeWorkspace, compile_decode, decode_attention, decode_reference,
                        dequantize_cache, plan_decode)

HBM_TBS = 4.37          # H200, 128-bit loads from a Numba kernel (notes/numba-cuda.md)
F16_DENSE_TFLOPS = 989  # H200 datasheet dense f16 tensor rate (mma.sync reaches a fraction)


def _graph_us(launch, stream, reps=20):
    """GPU microseconds per launch: `reps` launches captured in a CUDA graph, replayed
    (no host launch cost, as in the engine's decode graph); median of 5 replays
    (engine/cuda_graph.time_us)."""
    from genie_rt.engine.cuda_graph import time_us
    return time_us(lambda: launch(stream), stream, per=reps, reps=5)


def _wall_us(launch, stream, reps=1):
    """--tiny (simulator): one launch, wall time (the simulator has no graphs)."""
    import time
    t = time.perf_counter()
    launch(stream)
    stream.synchronize()
    return (time.perf_counter() - t) * 1e6


_TIMER = _graph_us


def _bench_pool(kv_dtype, n_ctx, n_kv, hd, seed=0, slots=None, filled=None):
    """One layer holding random K/V. slots: a ring of that many slots, holding the last
    `slots` of `filled` positions (default n_ctx). Returns the pool and the float64
    dequantized K, V of every position 0 .. filled-1, in position order."""
    from .device_pool import DeviceKVPool
    from .pool import KVShape, quantize_rows_int8
    rng = np.random.default_rng(seed)
    T = filled or n_ctx
    k = rng.standard_normal((1, T, n_kv, hd), np.float32) * 2
    v = rng.standard_normal((1, T, n_kv, hd), np.float32)
    pool = DeviceKVPool(KVShape(1, n_ctx, n_kv, hd, kv_dtype, slots=slots and (slots,)))
    first = max(0, T - slots) if slots else 0
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize_rows_int8(k), quantize_rows_int8(v)
        arrays = dict(k=kq, v=vq, k_scale=ks, v_scale=vs)
        kd, vd = dequantize_cache(kq[0], ks[0]), dequantize_cache(vq[0], vs[0])
    else:
        arrays = dict(k=k.astype(np.float16), v=v.astype(np.float16))
        kd, vd = arrays["k"][0].astype(np.float64), arrays["v"][0].astype(np.float64)
    pool.import_window({n: a[:, first:] for n, a in arrays.items()}, first, T)
    return pool, kd, vd


# name: (q heads, kv heads, head_dim, pool positions, window, ring slots, decode contexts,
#        prefill (n, start) cases, largest chunk)
SHAPES = {
    "qwen3-4b": (32, 8, 128, 16384 + 64, 0, None, (512, 1024, 4096, 16384),
                 [(33, 0), (33, 1000), (33, 4000), (512, 0), (512, 3000), (2048, 0)], 2048),
    "gemma3-270m-global": (4, 1, 256, 16384 + 64, 0, None, (512, 4096, 16384),
                           [(33, 4000), (512, 0), (512, 3000)], 512),
    "gemma3-270m-local": (4, 1, 256, 16384 + 64, 512, 1023, (512, 4096, 16384),
                          [(33, 4000), (512, 0), (512, 3000)], 512),
    "smollm2": (9, 3, 64, 8192, 0, None, (512, 4096, 8192), [(33, 4000), (512, 0), (512, 3000)],
                512),
}


def _bench_shape(shape, kv_dtype, H, KV, HD, n_ctx, W, R, ctxs, cases, n_max, sms, quick,
                 stream, rng, check, results):
    """Validate, then time decode and prefill of one shape and cache dtype. A ring shape
    (R slots, window W) gets a pool filled up to each context (the ring holds its last R
    positions), an ordinary one a single pool filled to n_ctx."""
    from . import attention_prefill as P
    ring = R is not None
    pools = {}

    def pool_for(filled):
        key = filled if ring else n_ctx
        if key not in pools:
            pools.clear()                                   # one pool in memory at a time
            pools[key] = _bench_pool(kv_dtype, n_ctx, KV, HD, slots=R, filled=key)
        return pools[key]

    q = (rng.standard_normal((H, HD)) * 2).astype(np.float32)
    qd = cuda.to_device(q)
    out = cuda.device_array(H * HD, np.float32)
    state = cuda.to_device(np.zeros(1, np.int32))
    base = plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, window=W)
    variants = [base,
                plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=16, window=W),
                plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=64, window=W)]
    # each loop of attention_decode_tiles.py on the default plan (the block loop beside the warp
    # loop with and without its prefetch of the next trip), and the warp loop with more splits
    variants += [dataclasses.replace(base, loop="block"), dataclasses.replace(base, loop="warp"),
                 dataclasses.replace(base, loop="warp-nopf"),
                 plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=2 * base.n_splits, window=W, loop="warp")]
    if kv_dtype == "int8" and HD % 32 == 0:               # the tensor-core loop: the group a block
        variants += [plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, window=W, loop="mma"),
                     plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, window=W, loop="mma", warps=4)]
    variants = list(dict.fromkeys(variants))             # n_splits is capped by the tiles
    if not quick:
        variants += [plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, warps=4, rows_per_thread=4,
                                 window=W),         # the block shape before 2026-12-04 night
                     plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, warps=4,
                                 rows_per_thread=2, window=W)]
        for gh in range(1, H // KV + 1):                  # heads a block: chains vs re-reads
            try:                                          # plan_decode says which fit
                variants.append(plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, window=W,
                                            heads_per_block=gh))
            except ValueError:
                pass
        variants += [plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=ns, window=W,
                                 heads_per_block=1) for ns in (16, 33)]   # one head, more splits
        variants += [plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, window=W, loop="warp",
                                 warps=4, rows_per_thread=1),
                     plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, window=W, loop="warp",
                                 heads_per_block=min(4, H // KV)),
                     plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=4 * base.n_splits, window=W,
                                 loop="warp")]
        variants = list(dict.fromkeys(variants))
    where = f"{shape} ({H} / {KV} heads, hd {HD}{f', window {W}, ring {R}' if W else ''})"
    print(f"\ndecode attention, {where}, {kv_dtype} cache, pool {n_ctx} positions")
    for plan in variants:
        compile_decode(plan)
        ws = DecodeWorkspace(plan, stream=stream)
        name = (f"{kv_dtype} splits={plan.n_splits} warps={plan.warps} "
                f"rows/thread={plan.rows_per_thread} tile={plan.tile} heads={plan.heads_per_block} "
                f"loop={plan.loop}")
        for ctx in ctxs:
            pool, kd, vd = pool_for(ctx)
            layer = pool.layer(0)
            vmax = float(np.abs(vd).max())
            state.copy_to_device(np.array([ctx - 1], np.int32), stream=stream)
            decode_attention(qd, layer, state, out, ws, stream)
            stream.synchronize()
            if not check(f"decode {shape} {name} ctx {ctx}", out.copy_to_host(),
                         decode_reference(q, kd, vd, ctx - 1, W), vmax,
                         *((2e-4, 1e-4) if plan.loop == "mma" else (2e-5, 1e-5))):   # mma: f16 P
                continue
            us = _TIMER(lambda s: decode_attention(qd, layer, state, out, ws, s), stream)
            keys = min(ctx, W) if W else ctx
            nbytes = keys * KV * HD * 2 * (1 if kv_dtype == "int8" else 2)
            nbytes += keys * KV * 8 if kv_dtype == "int8" else 0
            gbs = nbytes / us / 1e3
            print(f"  {name:48s} ctx {ctx:6d}: {us:8.2f} us  {gbs:7.0f} GB/s  "
                  f"{gbs / HBM_TBS / 10:5.1f} % of {HBM_TBS} TB/s")
            results.append(dict(kernel="decode", shape=shape, window=W, kv_dtype=kv_dtype,
                                ctx=ctx, n_splits=plan.n_splits, warps=plan.warps,
                                rows_per_thread=plan.rows_per_thread,
                                heads_per_block=plan.heads_per_block, loop=plan.loop, us=us, gb_s=gbs,
                                frac_hbm=gbs / HBM_TBS / 1e3))

    if not quick:                   # the engine's decode: out's q8 by the attention launch
        from genie_rt.quant import gemv
        n = H * HD
        xq, xs = cuda.device_array((1, n), np.int8), cuda.device_array((1, n // 8), np.float32)
        compile_decode(base, q8=True)
        ws = DecodeWorkspace(base, stream=stream)
        out2 = out.reshape(1, n)
        for ctx in ctxs:
            pool, kd, vd = pool_for(ctx)
            layer = pool.layer(0)
            state.copy_to_device(np.array([ctx - 1], np.int32), stream=stream)

            def two(s):
                decode_attention(qd, layer, state, out, ws, s)
                gemv.quantize_q8(out2, xq, xs, stream=s)

            def one(s):
                decode_attention(qd, layer, state, out, ws, s, xq=xq, xs=xs)
            t2, t1 = _TIMER(two, stream), _TIMER(one, stream)
            print(f"  {kv_dtype} default plan ctx {ctx:6d}: attention + quantize_q8 {t2:7.2f} us, "
                  f"attention writing q8 {t1:7.2f} us")
            results.append(dict(kernel="decode+q8", shape=shape, kv_dtype=kv_dtype, ctx=ctx,
                                heads_per_block=base.heads_per_block, us_two=t2, us_fused=t1))

    print(f"\nprefill attention, {where}, {kv_dtype} cache")
    plan = P.plan_prefill(H, KV, HD, kv_dtype, n_max=n_max, max_splits=8, window=W)
    P.compile_prefill(plan)
    ws = P.PrefillWorkspace(plan)
    qa = (rng.standard_normal((n_max, H, HD)) * 2).astype(np.float32)
    qall = cuda.to_device(qa)
    oall = cuda.device_array((n_max, H * HD), np.float32)
    for n, start in cases:
        pool, kd, vd = pool_for(start + n)
        layer = pool.layer(0)
        vmax = float(np.abs(vd).max())
        qn, on = qall[:n], oall[:n]
        auto = P.prefill_splits(plan, n, start, sm_count=sms)
        for n_splits in sorted({1, auto}):
            state.copy_to_device(np.array([start], np.int32), stream=stream)
            P.prefill_attention(qn, layer, state, on, ws, n_splits, stream)
            stream.synchronize()
            rows = slice(max(0, n - 64), n)          # the reference is O(n * ctx) memory
            ref = P.prefill_reference(qa[rows], kd, vd, start + rows.start, W)
            what = f"prefill {shape} {kv_dtype} n {n} start {start} splits {n_splits}"
            if not check(what, on.copy_to_host()[rows], ref, vmax, 4e-3, 4e-3):
                continue
            us = _TIMER(lambda s: P.prefill_attention(qn, layer, state, on, ws, n_splits, s),
                        stream, reps=10)
            tf = _prefill_flops(n, start, H, HD, W) / us / 1e6
            print(f"  n {n:5d} start {start:5d} splits {n_splits}: {us:9.2f} us  "
                  f"{tf:6.1f} TFLOP/s  ({tf / F16_DENSE_TFLOPS * 100:4.1f} % of "
                  f"{F16_DENSE_TFLOPS} dense f16)")
            results.append(dict(kernel="prefill", shape=shape, window=W, kv_dtype=kv_dtype,
                                n=n, start=start, n_splits=n_splits, us=us, tflops=tf))


def _prefill_flops(n, start, n_head, head_dim, window):
    """Useful FLOPs (4 * hd per visible (query, key) pair and head), with a window."""
    from .attention_prefill import prefill_flops
    if not window:
        return prefill_flops(n, start, n_head, head_dim)
    pairs = sum(min(start + i + 1, window) for i in range(n))
    return 4 * head_dim * pairs * n_head


def main(argv=None):
    import argparse
    import json
    import time

    ap = argparse.ArgumentParser(description="validate, then time decode and prefill attention "
                                 "at Qwen3-4B shapes (32 q heads, 8 kv heads, head_dim 128) "
                                 "and, with --shapes, Gemma 3 270M / SmolLM2 shapes")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--shapes", nargs="*", default=["qwen3-4b"],
                    help=f"model shapes to time: {', '.join(SHAPES)} or all (default qwen3-4b)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # simulator dry run
    args = ap.parse_args(argv)
    if SIMULATOR and not args.tiny:
        raise SystemExit("the benchmark needs a GPU (NUMBA_ENABLE_CUDASIM is set)")
    names = list(SHAPES) if "all" in args.shapes else args.shapes
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)} or all")
    t_start = time.time()
    if args.tiny:       # exercises this script's own code under the simulator
        global _TIMER
        _TIMER = _wall_us
        shapes = {"tiny": (4, 2, 64, 64, 0, None, (16, 64), [(5, 0), (17, 9)], 32),
                  "tiny-ring": (4, 1, 32, 64, 6, 12, (40,), [(7, 30)], 7)}
        sms, name = 4, "simulator"
    else:
        shapes = {n: SHAPES[n] for n in names}
        dev = cuda.get_current_device()
        sms, name = dev.MULTIPROCESSOR_COUNT, dev.name
        name = name.decode() if isinstance(name, bytes) else str(name)
    stream = cuda.stream()
    rng = np.random.default_rng(1)
    results, failures = [], []

    def check(what, got, ref, vmax, atol_rel, rtol):
        err = np.abs(got - ref)
        ok = bool((err <= atol_rel * vmax + rtol * np.abs(ref)).all())
        print(f"  check {what}: max |err| {err.max():.2e} (|V|max {vmax:.2f}) "
              f"{'ok' if ok else 'FAILED'}")
        if not ok:
            failures.append(what)
        return ok

    print(f"device: {name}, {sms} SMs")
    for shape, (H, KV, HD, n_ctx, W, R, ctxs, cases, n_max) in shapes.items():
        for kv_dtype in ("int8", "f16"):
            _bench_shape(shape, kv_dtype, H, KV, HD, n_ctx, W, R, ctxs, cases, n_max, sms,
                         args.quick, stream, rng, check, results)
    print(f"\n{len(results)} measurements, {len(failures)} failed checks, "
          f"{time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, sms=sms, results=results, failures=failures),
                      f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
