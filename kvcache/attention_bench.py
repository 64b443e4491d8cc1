"""Microbenchmark of the attention kernels at Qwen3-4B shapes (GPU only).

    python -m genie_rt.kvcache.attention [--json PATH] [--quick]

Every configuration is checked against the numpy reference in the same run before it is
timed (a failed check skips its timing and makes the exit status 1). Times are GPU time
per launch from replaying a CUDA graph of 10-20 launches (the engine's decode path:
no host launch cost), median of 5 replays. Decode reports GB/s of K/V (+ scales) read
against 4.37 TB/s (the H200's measured 128-bit read rate from Numba); prefill reports
useful causal TFLOP/s (`prefill_flops`).
"""
from __future__ import annotations

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


_TIMER = _graph_us


def _bench_pool(kv_dtype, n_ctx, n_kv, hd, seed=0):
    from .device_pool import DeviceKVPool
    from .pool import KVShape, quantize_rows_int8
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, n_ctx, n_kv, hd), np.float32) * 2
    v = rng.standard_normal((1, n_ctx, n_kv, hd), np.float32)
    pool = DeviceKVPool(KVShape(1, n_ctx, n_kv, hd, kv_dtype))
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize_rows_int8(k), quantize_rows_int8(v)
        pool.import_positions(dict(k=kq, v=vq, k_scale=ks, v_scale=vs), n_ctx)
        return pool, dequantize_cache(kq[0], ks[0]), dequantize_cache(vq[0], vs[0])
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    pool.import_positions(dict(k=k16, v=v16), n_ctx)
    return pool, k16[0].astype(np.float64), v16[0].astype(np.float64)


def main(argv=None):
    import argparse
    import json
    import time

    from . import attention_prefill as P
    ap = argparse.ArgumentParser(description="validate, then time decode and prefill attention "
                                 "at Qwen3-4B shapes (32 q heads, 8 kv heads, head_dim 128)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # simulator dry run
    args = ap.parse_args(argv)
    if SIMULATOR and not args.tiny:
        raise SystemExit("the benchmark needs a GPU (NUMBA_ENABLE_CUDASIM is set)")
    t_start = time.time()
    if args.tiny:       # exercises this script's own code under the simulator
        H, KV, HD, n_ctx, ctxs, n_max = 4, 2, 64, 64, (16, 64), 32
        cases, sms, name = [(5, 0), (17, 9)], 4, "simulator"
    else:
        H, KV, HD, n_ctx, ctxs, n_max = 32, 8, 128, 16384 + 64, (512, 1024, 4096, 16384), 2048
        cases = [(33, 0), (33, 1000), (33, 4000), (512, 0), (512, 3000), (2048, 0)]
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
    for kv_dtype in ("int8", "f16"):
        pool, kd, vd = _bench_pool(kv_dtype, n_ctx, KV, HD)
        layer = pool.layer(0)
        vmax = float(np.abs(vd).max())
        q = (rng.standard_normal((H, HD)) * 2).astype(np.float32)
        qd = cuda.to_device(q)
        out = cuda.device_array(H * HD, np.float32)
        state = cuda.to_device(np.zeros(1, np.int32))
        base = plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms)
        variants = [base,
                    plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=16),
                    plan_decode(H, KV, HD, kv_dtype, n_ctx, n_splits=64)]
        variants = list(dict.fromkeys(variants))             # n_splits is capped by the tiles
        if not args.quick:
            variants += [plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, rows_per_thread=2),
                         plan_decode(H, KV, HD, kv_dtype, n_ctx, sm_count=sms, warps=8,
                                     rows_per_thread=2)]
        print(f"\ndecode attention, {kv_dtype} cache, pool {n_ctx} positions")
        for plan in variants:
            compile_decode(plan)
            ws = DecodeWorkspace(plan, stream=stream)
            name = (f"{kv_dtype} splits={plan.n_splits} warps={plan.warps} "
                    f"rows/thread={plan.rows_per_thread} tile={plan.tile}")
            for ctx in ctxs:
                state.copy_to_device(np.array([ctx - 1], np.int32), stream=stream)
                decode_attention(qd, layer, state, out, ws, stream)
                stream.synchronize()
                if not check(f"decode {name} ctx {ctx}", out.copy_to_host(),
                             decode_reference(q, kd, vd, ctx - 1), vmax, 2e-5, 1e-5):
                    continue
                us = _TIMER(lambda s: decode_attention(qd, layer, state, out, ws, s), stream)
                nbytes = ctx * KV * HD * 2 * (1 if kv_dtype == "int8" else 2)
                nbytes += ctx * KV * 8 if kv_dtype == "int8" else 0
                gbs = nbytes / us / 1e3
                print(f"  {name:48s} ctx {ctx:6d}: {us:8.2f} us  {gbs:7.0f} GB/s  "
                      f"{gbs / HBM_TBS / 10:5.1f} % of {HBM_TBS} TB/s")
                results.append(dict(kernel="decode", kv_dtype=kv_dtype, ctx=ctx,
                                    n_splits=plan.n_splits, warps=plan.warps,
                                    rows_per_thread=plan.rows_per_thread, us=us, gb_s=gbs,
                                    frac_hbm=gbs / HBM_TBS / 1e3))

        print(f"\nprefill attention, {kv_dtype} cache")
        plan = P.plan_prefill(H, KV, HD, kv_dtype, n_max=n_max, max_splits=8)
        P.compile_prefill(plan)
        ws = P.PrefillWorkspace(plan)
        qa = (rng.standard_normal((n_max, H, HD)) * 2).astype(np.float32)
        qall = cuda.to_device(qa)
        oall = cuda.device_array((n_max, H * HD), np.float32)
        for n, start in cases:
            qn, on = qall[:n], oall[:n]
            auto = P.prefill_splits(plan, n, start, sm_count=sms)
            for n_splits in sorted({1, auto}):
                state.copy_to_device(np.array([start], np.int32), stream=stream)
                P.prefill_attention(qn, layer, state, on, ws, n_splits, stream)
                stream.synchronize()
                rows = slice(max(0, n - 64), n)          # the reference is O(n * ctx) memory
                ref = P.prefill_reference(qa[rows], kd, vd, start + rows.start)
                what = f"prefill {kv_dtype} n {n} start {start} splits {n_splits}"
                if not check(what, on.copy_to_host()[rows], ref, vmax, 4e-3, 4e-3):
                    continue
                us = _TIMER(lambda s: P.prefill_attention(qn, layer, state, on, ws, n_splits, s),
                            stream, reps=10)
                tf = P.prefill_flops(n, start, H, HD) / us / 1e6
                print(f"  n {n:5d} start {start:5d} splits {n_splits}: {us:9.2f} us  "
                      f"{tf:6.1f} TFLOP/s  ({tf / F16_DENSE_TFLOPS * 100:4.1f} % of "
                      f"{F16_DENSE_TFLOPS} dense f16)")
                results.append(dict(kernel="prefill", kv_dtype=kv_dtype, n=n, start=start,
                                    n_splits=n_splits, us=us, tflops=tf))
    print(f"\n{len(results)} measurements, {len(failures)} failed checks, "
          f"{time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, sms=sms, results=results, failures=failures),
                      f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
