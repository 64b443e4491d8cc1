#!/usr/bin/env python3
"""Where the fused FFN launch's time goes (quant/ffn_fused.py), against the six launches it replaces.

At Qwen3-4B's shapes (Wo 2560x4096, Wg/Wu 9728x2560 Q4_K, Wd 2560x9728 Q6_K; random weights),
each timed as a CUDA graph of 20 launches (engine/cuda_graph.time_us, microseconds a launch):

    separate       gemv(Wo, residual), rmsnorm_q8, gemv_swiglu, quantize_q8, gemv(Wd, residual),
                   rmsnorm_q8 - today's decode step - and each of them alone
    fused          the one launch at 2, 4 and 8 resident blocks an SM; with gate and up one after
                   the other (PAIR=0), a warp's rows of Wo / Wd one at a time (ROWS2=0), thread 0
                   alone fencing at a barrier (FENCE_ALL=0)
    barriers       the launch with no phase (PHASES=0): five grid barriers and the exit
    phase p        the launch with phase p only (its cost: this minus "barriers")

    python tools/bench_ffn_fused.py --json ffn.json          (needs a CUDA GPU)

Before timing, one fused launch is checked against the six launches, bit for bit.

Results: docs/kernels/ffn-fused.md (docs/bench/bench-ffn-h200-*.json).
"""
from __future__ import annotations

import argparse
import json
import sys


def check_same_bits(F, G, N, wo, wg, wu, wd, attn, aq, as_, x, fw, nw, h, eps, stream, dev) -> None:
    """Validate before timing: one fused launch (on a full grid) against the six launches, on
    copies of x - the residual stream and the next norm's q8 must be the same bits."""
    import numpy as np
    out = {}
    for fused in (False, True):
        xc = dev(x.copy_to_host())
        hq, hs = dev(np.zeros((1, wo.rows), np.int8)), dev(np.zeros((1, wo.rows // 8), np.float32))
        f = dev(np.zeros((1, wg.rows), np.float32))
        fq, fs = dev(np.zeros((1, wg.rows), np.int8)), dev(np.zeros((1, wg.rows // 8), np.float32))
        if fused:
            F.ffn_fused(wo, wg, wu, wd, aq, as_, xc, fw, eps, hq, hs, f, fq, fs,
                        dev(np.zeros(F.N_COUNTERS, np.int32)), next_norm=nw, stream=stream)
        else:
            G.gemv(wo, attn, xc, xq=aq, xs=as_, residual=xc, stream=stream)
            N.rmsnorm_q8(xc, fw, hq, hs, eps, stream=stream)
            G.gemv_swiglu(wg, wu, h, f, xq=hq, xs=hs, stream=stream)
            G.quantize_q8(f, fq, fs, stream=stream)
            G.gemv(wd, f, xc, xq=fq, xs=fs, residual=xc, stream=stream)
            N.rmsnorm_q8(xc, nw, hq, hs, eps, stream=stream)
        stream.synchronize()
        out[fused] = [a.copy_to_host() for a in (xc, f, hq, hs)]
    for name, a, b in zip(("x", "f", "hq", "hs"), out[True], out[False]):
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            raise SystemExit(f"fused FFN: {name} differs from the six launches; not timing it")
    print("  fused launch = the six launches, bit for bit (x, f, q8 of f's input and of the next h)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import numpy as np
    from numba import cuda

    from genie_rt.engine import norm as N
    from genie_rt.engine.cuda_graph import time_us
    from genie_rt.quant import ffn_fused as F
    from genie_rt.quant import gemv as G
    from genie_rt.quant.formats import QType
    from genie_rt.quant.gemv_bench import random_weight

    D, NFF, QD = 2560, 9728, 4096
    rng = np.random.default_rng(0)

    def w(q, rows, cols):
        return G.prepare_weight(G.to_device(random_weight(q, rows, cols, rng)), "dp4a")
    wo, wg, wu, wd = w(QType.Q4_K, D, QD), w(QType.Q4_K, NFF, D), w(QType.Q4_K, NFF, D), w(QType.Q6_K, D, NFF)
    stream = cuda.stream()

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a), stream=stream)
    attn = dev(rng.standard_normal((1, QD)).astype(np.float32))
    aq, as_ = dev(np.zeros((1, QD), np.int8)), dev(np.zeros((1, QD // 8), np.float32))
    G.quantize_q8(attn, aq, as_, stream=stream)
    x = dev((rng.standard_normal((1, D)) * 4).astype(np.float32))
    fw, nw = dev(np.ones(D, np.float32)), dev(np.ones(D, np.float32))
    h = dev(np.zeros((1, D), np.float32))
    hq, hs = dev(np.zeros((1, D), np.int8)), dev(np.zeros((1, D // 8), np.float32))
    f = dev(np.zeros((1, NFF), np.float32))
    fq, fs = dev(np.zeros((1, NFF), np.int8)), dev(np.zeros((1, NFF // 8), np.float32))
    ctr = dev(np.zeros(F.N_COUNTERS, np.int32))
    eps = 1e-6
    rows = []
    name = cuda.get_current_device().name
    device = name.decode() if isinstance(name, bytes) else str(name)

    def record(label, fn, **extra):
        us = time_us(fn, stream)
        rows.append(dict(name=label, us=us, **extra))
        print(f"  {label:<44} {us:8.2f} us", flush=True)

    print(f"fused FFN vs separate launches, {device}, Qwen3-4B shapes")
    check_same_bits(F, G, N, wo, wg, wu, wd, attn, aq, as_, x, fw, nw, h, eps, stream, dev)
    parts = {
        "gemv attn_output (residual)": lambda: G.gemv(wo, attn, x, xq=aq, xs=as_, residual=x, stream=stream),
        "rmsnorm_q8": lambda: N.rmsnorm_q8(x, fw, hq, hs, eps, stream=stream),
        "gemv_swiglu": lambda: G.gemv_swiglu(wg, wu, h, f, xq=hq, xs=hs, stream=stream),
        "quantize_q8 (f)": lambda: G.quantize_q8(f, fq, fs, stream=stream),
        "gemv ffn_down (residual)": lambda: G.gemv(wd, f, x, xq=fq, xs=fs, residual=x, stream=stream),
    }
    for label, fn in parts.items():
        record(label, fn)

    def separate():
        for fn in parts.values():
            fn()
        N.rmsnorm_q8(x, nw, hq, hs, eps, stream=stream)
    record("separate: the six launches", separate)

    def fused(bps=F.MAX_BLOCKS_PER_SM, **variant):
        kern = F._kernel((wo.qtype, wg.qtype, wu.qtype, wd.qtype), D, N.norm_block(D), "silu", True,
                         tuple(sorted(variant.items())))
        grid = F.grid_blocks(kern, bps)
        F._grids.pop(id(kern), None)                  # the next call may ask another count
        return grid, lambda: F.ffn_fused(wo, wg, wu, wd, aq, as_, x, fw, eps, hq, hs, f, fq, fs, ctr,
                                         next_norm=nw, grid=grid, stream=stream, **variant)
    for bps in (2, 4, 8):
        grid, fn = fused(bps)
        record(f"fused, {bps} blocks/SM ({grid} blocks)", fn, blocks=grid)
    for label, variant in (("fused, PAIR=0", dict(PAIR=False)), ("fused, ROWS2=0", dict(ROWS2=False)),
                           ("fused, PAIR=0, ROWS2=0", dict(PAIR=False, ROWS2=False)),
                           ("fused, FENCE_ALL=0", dict(FENCE_ALL=False)),
                           ("barriers only (PHASES=0)", dict(PHASES=0)),
                           ("barriers only, FENCE_ALL=0", dict(PHASES=0, FENCE_ALL=False))):
        grid, fn = fused(**variant)
        record(label, fn, blocks=grid)
    for ph in range(6):
        grid, fn = fused(PHASES=1 << ph)
        record(f"phase {ph + 1} only", fn, blocks=grid)
    assert not F.failed(ctr), "a barrier gave up"
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=device, rows=rows), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
