#!/usr/bin/env python3
"""Lab (GPU): where the decode norm fold's time goes (issue 14, docs/forward-pass.md).

On the H200 (2026-12-03) folding each rmsnorm_q8 into the residual GEMV before it made the
decode step slower: ~12.8 us per fused launch against the ~4.8 us rmsnorm_q8 launch it
replaces, with either tail (the loop tail or the staged one). This times, at the 4B's shapes
(attn_output Q4_K 4096 -> 2560, ffn_down Q6_K 9728 -> 2560), each as a graph of repeated
launches:

    plain       gemv(..., residual=y)                          the GEMV alone
    norm        rmsnorm_q8(y, ...)                             the launch the fold removes
    two         plain, then norm                               today's default, two launches
    fused       gemv(..., residual=y, norm=GemvNorm(...))      the fold, one launch
    fused-noh   the same without the float h                   (h is written only when some
                                                               GEMV reads float input)

and checks first that fused gives the two launches' bits. fused - plain is the fold's own
cost (the counter, the last block's wait and tail); two - fused is what it saves. With --ncu
each kernel is launched once after a cudaProfilerStart for Nsight Compute
(`tools/gpu_check.sh normlab`: registers, occupancy, stall reasons of plain against fused).

    python tools/norm_fold_lab.py [--ncu] [--json PATH]
    NUMBA_ENABLE_CUDASIM=1 python tools/norm_fold_lab.py --tiny --check   (the script's own check)
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

EPS = 1e-6
SHAPES = (("attn_output", "Q4_K", 2560, 4096), ("ffn_down", "Q6_K", 2560, 9728))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu", action="store_true", help="launch each kernel once for Nsight Compute, no timing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--per-graph", type=int, default=50)
    ap.add_argument("--check", action="store_true", help="validate the bits only (no timing)")
    ap.add_argument("--tiny", action="store_true", help="small shapes (the simulator: with --check)")
    args = ap.parse_args(argv)
    shapes = [(n, qt, 64, 256) for n, qt, _, _ in SHAPES] if args.tiny else SHAPES

    from numba import cuda

    from genie_rt.engine import norm as N
    from genie_rt.quant import gemv as G
    from genie_rt.quant.formats import QType
    from genie_rt.quant.gemv_bench import random_weight, time_graph

    s = cuda.stream()
    rng = np.random.default_rng(0)
    rows_out = []
    for name, qt, rows, cols in shapes:
        w = G.prepare_weight(G.to_device(random_weight(QType[qt], rows, cols, rng), stream=s), "dp4a")
        x = cuda.to_device(rng.standard_normal((1, cols)).astype(np.float32), stream=s)
        xq, xs = cuda.device_array((1, cols), np.int8, stream=s), cuda.device_array((1, cols // 8), np.float32, stream=s)
        G.quantize_q8(x, xq, xs, stream=s)
        y0 = (rng.standard_normal((1, rows)) * 1e-2).astype(np.float32)   # small: many launches stay finite
        wn = cuda.to_device((1 + 0.1 * rng.standard_normal(rows)).astype(np.float32), stream=s)
        counter = cuda.to_device(np.zeros(1, np.int32), stream=s)

        def bufs():
            return (cuda.to_device(y0, stream=s), cuda.device_array((1, rows), np.int8, stream=s),
                    cuda.device_array((1, rows // 8), np.float32, stream=s),
                    cuda.device_array((1, rows), np.float32, stream=s))
        (ya, qa, sa, ha), (yb, qb, sb, hb) = bufs(), bufs()
        fused = G.GemvNorm(wn, EPS, qb, sb, counter, h=hb)
        fused_noh = G.GemvNorm(wn, EPS, qb, sb, counter)
        cases = {
            "plain": lambda: G.gemv(w, x, ya, xq=xq, xs=xs, residual=ya, stream=s),
            "norm": lambda: N.rmsnorm_q8(ya, wn, qa, sa, EPS, stream=s, out=ha),
            "two": lambda: (G.gemv(w, x, ya, xq=xq, xs=xs, residual=ya, stream=s),
                            N.rmsnorm_q8(ya, wn, qa, sa, EPS, stream=s, out=ha)),
            "fused": lambda: G.gemv(w, x, yb, xq=xq, xs=xs, residual=yb, stream=s, norm=fused),
            "fused-noh": lambda: G.gemv(w, x, yb, xq=xq, xs=xs, residual=yb, stream=s, norm=fused_noh),
        }
        for fused_case, outs in (("fused", ("y", "xq", "xs", "h")), ("fused-noh", ("y", "xq", "xs"))):
            # validate: one step each way from the same y, the same bits
            ya.copy_to_device(y0, stream=s)
            yb.copy_to_device(y0, stream=s)
            cases["two"]()
            cases[fused_case]()
            s.synchronize()
            pairs = {"y": (ya, yb), "xq": (qa, qb), "xs": (sa, sb), "h": (ha, hb)}
            for what in outs:
                ga, gb = (b.copy_to_host() for b in pairs[what])
                if not np.array_equal(ga.view(np.uint8), gb.view(np.uint8)):
                    print(f"{name}: {fused_case} {what} differs from gemv + rmsnorm_q8: not timing it",
                          file=sys.stderr)
                    return 1
        if args.check:
            print(f"{name}: fused gives gemv + rmsnorm_q8's bits", flush=True)
            continue
        if args.ncu:
            cuda.profile_start()
            for k in ("plain", "norm", "fused"):
                cases[k]()
            s.synchronize()
            cuda.profile_stop()
            continue
        row = {"shape": name, "qtype": qt, "rows": rows, "cols": cols}
        for k, fn in cases.items():
            row[k + "_us"] = round(time_graph(s, fn, args.per_graph) * 1e6, 2)
        row["fold_cost_us"] = round(row["fused_us"] - row["plain_us"], 2)
        row["saved_us"] = round(row["two_us"] - row["fused_us"], 2)
        rows_out.append(row)
        print(f"{name:12s} {qt}: plain {row['plain_us']:7.2f} us, norm {row['norm_us']:6.2f}, two "
              f"{row['two_us']:7.2f}, fused {row['fused_us']:7.2f} (without h {row['fused-noh_us']:7.2f}): "
              f"the fold costs {row['fold_cost_us']:+.2f} us, saves {row['saved_us']:+.2f}", flush=True)
    if args.json and rows_out:
        with open(args.json, "w") as f:
            name = cuda.get_current_device().name
            json.dump({"device": name.decode() if isinstance(name, bytes) else str(name), "rows": rows_out}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
