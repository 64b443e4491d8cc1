"""Timing of gemv_mma_k (quant/gemv_mma_k.py) on a GPU: `python -m genie_rt.quant.gemv_mma_k`.

`bench`: the pipelined/unpipelined builds at plan_ksplit's k-split and a sweep of k-splits against
the dp4a GEMV at the 4B's Q4_K shapes and its two Q6_K ones (attn_v, ffn_down in half the layers
of a Q4_K_M file; --shapes picks), 1-16 tokens, each checked against numpy first, with the
weights cycling through copies (from DRAM) or repeated (from the L2); then rmsnorm_q8k. `table`:
the markdown table docs/kernels/gemv.md shows of its --json file.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import ptx
from .formats import QType
from .gemv_mma_k import QK, default_build, dequantize_q8k, gemv_mma_k, plan_ksplit, quantize_q8k, quantize_q8k_tiled
from .q8k_layout import sizes, tiled, untiled

SHAPES = (("attn_q", 4096, 2560, QType.Q4_K), ("ffn_gate", 9728, 2560, QType.Q4_K),
          ("attn_output", 2560, 4096, QType.Q4_K), ("ffn_down", 2560, 9728, QType.Q4_K),
          ("attn_v_q6k", 1024, 2560, QType.Q6_K), ("ffn_down_q6k", 2560, 9728, QType.Q6_K))


def _plain_launches(fn):
    """fn() with quant/pdl.launch_or_plain launching every build plainly (a PDL build's
    griddepcontrol then waits for nothing): the build's own time, without the overlap that a
    programmatic launch after the same kernel would give."""
    from . import pdl as P
    real = P.launch_or_plain

    def plain(kern, grid, block, stream, sig, pdl, *args, shmem=0):
        kern[grid, block, stream, shmem](*args)
    P.launch_or_plain = plain
    try:
        return fn()
    finally:
        P.launch_or_plain = real


def bench(argv=None) -> int:
    """Time gemv_mma_k (its defaults: plan_ksplit's k-split, pipelined up to 8 tokens; then --trips
    at each of --ks) against the dp4a GEMV at the 4B's Q4_K shapes, 1-16 tokens (the dp4a GEMV: 1-8;
    GPU only); every kernel is checked against numpy before it is timed, into an output filled
    with NaN (a launch that skips outputs fails the check). --mma adds gemv_mma (q8 activations)
    at k-splits 4 and 8."""
    import argparse
    import itertools
    import json
    from dataclasses import replace

    from . import gemv as G
    from .gemv_mma import _activations, _weight, _within, gemv_mma, profile_once
    from .quantize_q8k import rmsnorm_q8k

    def _dup(a):
        b = cuda.device_array_like(a)
        b.copy_to_device(a)
        return b

    from genie_rt.engine.cuda_graph import time_us
    ap = argparse.ArgumentParser(description="gemv_mma_k (int8 tensor cores, integer epilogue) vs the dp4a GEMV")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ks", default="2,4,5,8,10,13,16", help="k-splits of the --trips sweep (those above "
                    "the row's 256-weight blocks are skipped)")
    ap.add_argument("--trips", default="block,pipe", help="the sweep's builds: block (PIPE off), pipe, and "
                    "block16 / pipe16 (the weights by 16-byte lane loads: gemv_mma_k.make_weight_loads W16, "
                    "gemv_mma_q6k.make_row_loads W16); "
                    "empty: no sweep")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--mma", action="store_true")
    ap.add_argument("--shapes", default="q4k,q6k", help="which of SHAPES: q4k, q6k or both")
    ap.add_argument("--rows", default=None, help="comma-separated row counts each selected shape is "
                    "also timed at (its columns kept; e.g. 2112 = 132 tiles of 16: one thread block an SM "
                    "of an H100, against 2,560's 160)")
    ap.add_argument("--only", default=None, help="comma-separated names of SHAPES to time (default: all "
                    "of --shapes' formats)")
    ap.add_argument("--pdl-build", action="store_true", help="also time the programmatic-dependent-launch "
                    "build at the planned k-split, launched plainly (what the build's own code costs: its coherent "
                    "token loads, the first block's weights before the wait)")
    ap.add_argument("--ncu", action="store_true", help="no timing: each checked case launched once between "
                    "cuProfilerStart/Stop, for ncu --profile-from-start off")
    ap.add_argument("--copies", default="8,1", help="weight copies each timing cycles through: 8 "
                    "(112+ MB for the larger shapes, more than the L2: the weights come from DRAM as in a "
                    "decode step), 1 (the same weight 20 times: from the L2 after the first)")
    args = ap.parse_args(argv)
    if ptx.SIMULATOR:
        raise SystemExit("needs a GPU")
    stream = cuda.stream()
    out, profiled = [], []
    kinds = {QType[k.upper().replace("K", "_K")] for k in args.shapes.split(",") if k}
    shapes = [s for s in SHAPES if s[3] in kinds and (args.only is None or s[0] in args.only.split(","))]
    if args.rows:
        shapes += [(f"{n}@{r}", int(r), c, q) for n, _, c, q in list(shapes) for r in args.rows.split(",")]
    for name, rows, cols, qtype, n_copies in ((*shape, int(c)) for c in args.copies.split(",") for shape in shapes):
        W, gw = _weight(rows, cols, qtype)
        planes = ("wa", "wb") if qtype == QType.Q4_K else ("wa", "wb", "wc", "wd")
        copies = [gw] + [replace(gw, **{p: _dup(getattr(gw, p)) for p in planes}) for _ in range(n_copies - 1)]
        nxt = itertools.cycle(copies).__next__       # each call of a captured graph: the next copy
        for n_tok in (int(v) for v in args.tokens.split(",")):
            dx, xq, xs, y, ref, bound = _activations(W, n_tok, stream)       # q8: gemv_mma and dp4a
            k8 = quantize_q8k(dx.copy_to_host())                            # q8_K: gemv_mma_k
            kx = [cuda.to_device(a) for a in tiled(*k8)]                    # tiled, as on the device
            xt = dequantize_q8k(k8[0], k8[1])
            kref, kbound = G.gemv_reference(W, xt), G.error_bound(W, xt, "f32")
            row = dict(gemv=name, rows=rows, cols=cols, n_tok=n_tok, copies=n_copies)
            cases = [(f"plan_ks{default_build(gw, n_tok)[0]}", lambda: gemv_mma_k(nxt(), *kx, y, n_tok, stream=stream),
                      kref, kbound)]
            cases += [(f"{trip}_ks{ks}", lambda ks=ks, trip=trip: gemv_mma_k(
                           nxt(), *kx, y, n_tok, ksplit=ks, stream=stream, pipe=trip.startswith("pipe"),
                           w16=trip.endswith("16")), kref, kbound)
                      for trip in args.trips.split(",") if trip
                      for ks in (int(v) for v in args.ks.split(",")) if ks <= cols // QK]
            if args.pdl_build:
                cases += [(f"pdlbuild_ks{default_build(gw, n_tok)[0]}",
                           lambda: _plain_launches(lambda: gemv_mma_k(nxt(), *kx, y, n_tok, stream=stream, pdl=True)),
                           kref, kbound)]
            if args.mma and n_tok <= 8 and qtype == QType.Q4_K:
                cases += [(f"mma_ks{ks}", lambda ks=ks: gemv_mma(nxt(), xq, xs, y, n_tok, ksplit=ks, stream=stream),
                           ref, bound) for ks in (4, 8)]
            for label, fn, r, b in cases:
                y.copy_to_device(np.full(y.shape, np.nan, np.float32), stream=stream)
                try:
                    fn()
                except ValueError as exc:                # a k-split whose block does not fit (NT 16)
                    print(f"  {label}: {exc}")
                    continue
                stream.synchronize()
                row[f"{label}_ok"] = ok = _within(y, r, b)
                if ok and args.ncu:
                    profiled.append((f"{name} n_tok {n_tok} {label}", fn))
                elif ok:
                    row[f"{label}_us"] = round(time_us(fn, stream), 3)
            if args.ncu:
                continue
            if n_tok <= G.MAX_TOKENS:                 # the dp4a GEMV takes 1..8 tokens
                G.gemv(gw, dx, y, xq=xq, xs=xs, stream=stream)
                row["dp4a_us"] = round(time_us(lambda: G.gemv(nxt(), dx, y, xq=xq, xs=xs, stream=stream), stream), 3)
            best = min(((v, k[:-3]) for k, v in row.items() if k.endswith("_us") and k != "dp4a_us"),
                       default=(float("nan"), "none timed"))
            print(f"{name:12s} x{n_copies} n_tok {n_tok}: dp4a {row.get('dp4a_us', float('nan')):7.2f} us, best mma "
                  f"{best[0]:7.2f} us ({best[1]}); "
                  + " ".join(f"{k[:-3]} {v:.2f}" for k, v in row.items() if k.endswith("_us")), flush=True)
            out.append(row)
    if args.ncu:
        return profile_once(profiled, stream)
    for cols in sorted({s[2] for s in SHAPES if s[3] in kinds}):    # the quantizer before them (quantize_q8k.py)
        w = cuda.to_device(np.ones(cols, np.float32))
        for n_tok in (int(v) for v in args.tokens.split(",")):
            x = np.random.default_rng(2).standard_normal((n_tok, cols)).astype(np.float32)
            dx = cuda.to_device(x)
            q = tuple(cuda.device_array(n, t) for n, t in zip(sizes(n_tok, cols), (np.int8, np.float32, np.int32)))
            rmsnorm_q8k(dx, None, 0.0, *q, stream=stream)
            stream.synchronize()
            got = untiled(*(a.copy_to_host() for a in q), n_tok, cols)
            ok = all(np.array_equal(a, b) for a, b in zip(got, quantize_q8k(x)))
            us = round(time_us(lambda: rmsnorm_q8k(dx, w, 1e-6, *q, stream=stream), stream), 3)
            print(f"rmsnorm_q8k  cols {cols} n_tok {n_tok}: {us:7.2f} us ({'same bits as numpy without the norm' if ok else 'MISMATCH'})",
                  flush=True)
            out.append(dict(kernel="rmsnorm_q8k", cols=cols, n_tok=n_tok, ok=ok, us=us))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    bad = [f"{r.get('gemv', r.get('kernel'))} n_tok {r['n_tok']} {k}" for r in out for k, v in r.items()
           if k.endswith("ok") and not v]
    if bad:
        print("outside the error bound:", ", ".join(bad))
    return 1 if bad else 0


def bench_glu(argv=None) -> int:
    """`python -m genie_rt.quant.gemv_mma_glu`: gate + up + SwiGLU of the 4B's FFN (9,728 x 2,560,
    Q4_K, weights from DRAM: 8 copies of each) for 1 and 8 tokens, as one launch (gemv_mma_glu)
    against gemv_mma_k twice and norm.swiglu (the same bits, checked first); then q, k and v the
    same way (`_bench_qkv`); GPU only."""
    import argparse
    import itertools
    import json
    from dataclasses import replace

    from genie_rt.engine import norm
    from genie_rt.engine.cuda_graph import time_us

    from .gemv_mma import _weight
    from .gemv_mma_glu import gemv_mma_glu

    def _dup(a):
        b = cuda.device_array_like(a)
        b.copy_to_device(a)
        return b

    ap = argparse.ArgumentParser(description="gemv_mma_glu against gemv_mma_k twice + swiglu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--pipe", default="1,0", help="gemv_mma_glu's PIPE builds to time (1, 0)")
    ap.add_argument("--shape", default="9728,2560", help="rows,cols of gate and up")
    args = ap.parse_args(argv)
    if ptx.SIMULATOR:
        raise SystemExit("needs a GPU")
    (rows, cols), stream, out = (int(v) for v in args.shape.split(",")), cuda.stream(), []
    _, g0 = _weight(rows, cols)
    _, u0 = _weight(rows, cols, seed=1)               # another weight: a gate / up swap shows in the bits
    pairs = [(g0, u0)] + [(replace(g0, wa=_dup(g0.wa), wb=_dup(g0.wb)), replace(u0, wa=_dup(u0.wa), wb=_dup(u0.wb)))
                          for _ in range(7)]
    for n_tok in (int(v) for v in args.tokens.split(",")):
        x = np.random.default_rng(1).standard_normal((n_tok, cols)).astype(np.float32)
        q = [cuda.to_device(a) for a in quantize_q8k_tiled(x)]
        y, ga, up, want = (cuda.device_array((n_tok, rows), np.float32) for _ in range(4))
        row = dict(n_tok=n_tok, rows=rows, cols=cols)
        nxt = itertools.cycle(pairs).__next__

        def three():
            g, u = nxt()
            gemv_mma_k(g, *q, ga, n_tok, stream=stream)
            gemv_mma_k(u, *q, up, n_tok, stream=stream)
            norm.swiglu(ga, up, want, stream=stream)
        three()                                      # pairs[0]
        for p in (int(v) for v in args.pipe.split(",")):
            gemv_mma_glu(g0, u0, *q, y, n_tok, pipe=bool(p), stream=stream)
            stream.synchronize()
            row[f"glu_pipe{p}_same_bits"] = same = bool(np.array_equal(y.copy_to_host(), want.copy_to_host()))
            if same:
                row[f"glu_pipe{p}_us"] = round(time_us(
                    lambda p=p: gemv_mma_glu(*nxt(), *q, y, n_tok, pipe=bool(p), stream=stream), stream), 3)
        row["three_launches_us"] = round(time_us(three, stream), 3)
        print(f"gate+up+swiglu {rows}x{cols} n_tok {n_tok}: " + ", ".join(f"{k} {v}" for k, v in row.items()
                                                                          if k.endswith(("_us", "_bits"))), flush=True)
        out.append(row)
        out.append(_bench_qkv(n_tok, q, stream, _dup))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(v for r in out for k, v in r.items() if k.endswith("_bits")) else 1


def _bench_qkv(n_tok, q, stream, dup) -> dict:
    """q, k, v of the 4B (4,096 / 1,024 / 1,024 rows x 2,560; Q4_K, Q4_K, Q6_K: a Q4_K_M file's
    mixed layers; 8 copies) in one launch (gemv_mma_qkv) against gemv_mma_k three times into the
    same columns: the bits (at the one launch's k-split), then the times (each at its own plan)."""
    import itertools
    from dataclasses import replace

    from genie_rt.engine.cuda_graph import time_us

    from .gemv_mma import _weight
    from .gemv_mma_qkv import gemv_mma_qkv
    spec = ((4096, QType.Q4_K), (1024, QType.Q4_K), (1024, QType.Q6_K))
    base = [_weight(r, 2560, qt)[1] for r, qt in spec]
    planes = {QType.Q4_K: ("wa", "wb"), QType.Q6_K: ("wa", "wb", "wc", "wd")}
    sets = [base] + [[replace(w, **{p: dup(getattr(w, p)) for p in planes[w.qtype]}) for w in base] for _ in range(7)]
    total = sum(w.rows for w in base)
    y, y3 = (cuda.device_array((n_tok, total), np.float32) for _ in range(2))
    flat3 = y3.reshape(n_tok * total)
    nxt = itertools.cycle(sets).__next__

    ks = plan_ksplit(total, 2560, n_tok)            # gemv_mma_qkv's: the same sums in the same order

    def three(ws=None, ksplit=None):
        c = 0
        for w in ws or nxt():
            gemv_mma_k(w, *q, flat3[c:], n_tok, ldy=total, stream=stream, ksplit=ksplit)
            c += w.rows

    def one(ws=None):
        gemv_mma_qkv(ws or nxt(), *q, y, n_tok, stream=stream)
    three(base, ks)
    one(base)
    stream.synchronize()
    row = dict(kernel="qkv", n_tok=n_tok, same_bits=bool(np.array_equal(y.copy_to_host(), y3.copy_to_host())))
    if row["same_bits"]:
        row["one_launch_us"] = round(time_us(one, stream), 3)
        row["three_launches_us"] = round(time_us(three, stream), 3)
    print(f"q/k/v 4096/1024/1024 x 2560 (Q4_K/Q4_K/Q6_K) n_tok {n_tok}: {row}", flush=True)
    return row


def table(path: str) -> str:
    """The markdown table docs/kernels/gemv.md shows of a `--json` file: per shape, weight copies
    and tokens, the dp4a GEMV, gemv_mma_k's default build at plan_ksplit's k-split (as the sweep
    timed it), the best of the sweep (us)."""
    import json
    from types import SimpleNamespace
    lines = ["| shape | weights from | tokens | dp4a GEMV | gemv_mma_k (plan) | best of the sweep |",
             "|---|---|---:|---:|---:|---:|"]
    for r in (r for r in json.load(open(path)) if "gemv" in r):
        us = {k[:-3]: v for k, v in r.items() if k.endswith("_us") and k != "dp4a_us"}
        w = SimpleNamespace(rows=r["rows"], cols=r["cols"], qtype=QType.Q6_K if r["gemv"].endswith("q6k") else QType.Q4_K)
        ks, pipe, w16 = default_build(w, r["n_tok"])
        build = ("pipe" if pipe else "block") + ("16" if w16 else "")
        plan = us.get(f"{build}_ks{ks}", us.get(f"plan_ks{ks}"))   # (the plan's build, as the sweep timed it)
        if plan is None or not us:
            continue                                 # (not timed: outside the bound, or did not fit)
        best = min(us, key=us.get)
        dp4a = f"{r['dp4a_us']:.2f}" if "dp4a_us" in r else "-"
        lines.append(f"| {r['gemv']} {r['rows']}x{r['cols']} | {'DRAM' if r.get('copies', 1) > 1 else 'L2'} "
                     f"| {r['n_tok']} | {dp4a} | {plan:.2f} ({build}, k-split {ks}) | {us[best]:.2f} ({best}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:
        print(table(argv[1]))
        return 0
    return bench(argv)
