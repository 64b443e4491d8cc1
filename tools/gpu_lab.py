#!/usr/bin/env python3
"""GPU lab for the small-N prefill GEMM and the decode GEMV: validate, then time, variants
side by side in one process (and, with --ncu, launch each once for Nsight Compute).

What it compares (Qwen3-4B shapes, fresh random weights, every result checked against
numpy before it is timed):

  MMQ at N = 16 and 33   small-N policies (mmq_plan.SMALL_*, DEFAULT_REDUCE): split-K summed by
                         the last block of each tile ("last") or by a reduction launch
                         ("kernel"), 2 or 3 stages, the fewest stages per split (the
                         two-warp-group variant is tools/mmq_variants/v3); each shape, then one
                         layer's GEMMs as one graph (QKV stacked, gate/up SwiGLU, and the
                         seven matrices one by one). At N = 512 the two reductions.
  GEMV                   16 or 32 lanes per row, k-split 1 or 2, on the output projection,
                         QKV, gate/up and down; then the whole decode step's 145 GEMVs as
                         one graph, without and with programmatic dependent launch
                         (quant/pdl.py, sm_90+; first checked bit-exact on a dependent chain).

    python tools/gpu_lab.py --json lab.json          # on the GPU machine
    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python tools/gpu_lab.py --ncu                # one profiled launch per kernel

Run by `tools/gpu_check.sh lab`. Numbers that matter go to docs/kernels/*.md with the
command and date; this file is the lab bench, not part of the package.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import numpy as np

HIDDEN, Q_DIM, KV_DIM, FFN, VOCAB = 2560, 4096, 1024, 9728, 151936


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--ncu", action="store_true", help="launch each profiled kernel once between "
                    "cuProfilerStart/Stop (run under ncu --profile-from-start off)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: mmq,gemv,step")
    args = ap.parse_args(argv)
    from numba import cuda

    from genie_rt.engine.cuda_graph import time_us
    from genie_rt.quant import gemv as G
    from genie_rt.quant import mmq, mmq_plan as MP, mmq_reference as MR
    from genie_rt.quant.mmq_bench import Case as MMQCase
    from genie_rt.quant.formats import QType
    from genie_rt.quant.gemv_bench import measure_bandwidth, random_weight as g_random, rows_of

    s = cuda.stream()
    rng = np.random.default_rng(2026)
    skip = set(filter(None, args.skip.split(",")))
    rec: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "mmq": [], "layer": [], "gemv": [], "step": []}
    t_start = time.time()
    bw = measure_bandwidth(s)["read_tbs"] if not args.ncu else 4.37
    rec["read_tbs"] = bw
    print(f"read bandwidth {bw:.3f} TB/s", flush=True)

    # ---------------------------------------------------------------- MMQ ------------
    nmax = 40

    def Case(name, rows, cols, qtype, mode):    # a weight on the device (the benchmark's own)
        return MMQCase(cuda, name, rows, cols, qtype, mode, nmax, rng)

    cases = {}
    xh = {c: rng.standard_normal((nmax, c)).astype(np.float32) for c in (HIDDEN, Q_DIM, FFN)}
    x16 = {c: cuda.device_array((nmax, c), np.float16) for c in xh}
    xsc = {c: cuda.device_array(nmax, np.float32) for c in xh}
    for c in xh:
        mmq.prepare_x(cuda.to_device(xh[c]), x16[c], xsc[c], s)
    y_buf = cuda.device_array(nmax * 2 * FFN, np.float32)
    ws = cuda.to_device(np.zeros(256 << 20, np.uint8))
    s.synchronize()

    def yv(c, n):
        return y_buf[:n * c.rows_out].reshape(n, c.rows_out)

    def launcher(c, n, config=None, splits=None, reduce=None):
        return lambda: mmq.mmq(c.w, x16[c.cols][:n], xsc[c.cols][:n], yv(c, n), c.mode, workspace=ws,
                               stream=s, config=config, splits=splits, reduce=reduce)

    def validate(c, n, fn):
        rows = np.sort(rng.choice(c.rows_out, min(c.rows_out, 128), replace=False))
        y0 = rng.standard_normal((n, c.rows_out)).astype(np.float32)
        yv(c, n).copy_to_device(y0, stream=s)
        fn()
        s.synchronize()
        out = yv(c, n).copy_to_host()[:, rows].astype(np.float64)
        x = xh[c.cols][:n]
        ref = MR.reference(c.host, x, c.mode, y0, rows)
        bound = MR.error_bound(c.host, x, c.mode, y0, rows)
        return float(np.max(np.abs(out - ref) / bound))

    # Small-N policies: (name, reduce, stages, min stages per split); the package default last
    POLICIES = [("old", "last", 3, 4), ("k-s3", "kernel", 3, 2),
                ("default", MP.DEFAULT_REDUCE, MP.SMALL_STAGES, MP.SMALL_MIN_STAGES_PER_SPLIT)]

    def set_policy(pol):
        _, red, st, sps = pol
        MP.DEFAULT_REDUCE, MP.SMALL_STAGES, MP.SMALL_MIN_STAGES_PER_SPLIT = red, st, sps
        MP.plan.cache_clear()

    if "mmq" not in skip and not args.ncu:
        for spec in [("qkv", Q_DIM + 2 * KV_DIM, HIDDEN, "Q4_K", "store"), ("k", KV_DIM, HIDDEN, "Q4_K", "store"),
                     ("o", HIDDEN, Q_DIM, "Q4_K", "add"), ("gate_up", 2 * FFN, HIDDEN, "Q4_K", "swiglu"),
                     ("down", HIDDEN, FFN, "Q4_K", "add"), ("down_q6k", HIDDEN, FFN, "Q6_K", "add"),
                     ("q", Q_DIM, HIDDEN, "Q4_K", "store"), ("gate", FFN, HIDDEN, "Q4_K", "store")]:
            cases[spec[0]] = Case(*spec)
        print("MMQ small N by policy: us per GEMM (validated: err/bound)", flush=True)
        for pol in POLICIES:
            set_policy(pol)
            for n in (16, 33):
                for name in ("qkv", "k", "o", "gate_up", "down", "down_q6k"):
                    c = cases[name]
                    try:
                        p = MP.plan(c.qtype, c.rows_out, c.cols, n, c.mode)
                        fn = launcher(c, n)
                        err = validate(c, n, fn)
                        us = time_us(fn, s, per=20, reps=7)
                    except Exception as exc:                      # noqa: BLE001
                        print(f"  {pol[0]} {name} N={n}: FAILED {exc}", flush=True)
                        continue
                    r = dict(policy=pol[0], name=name, n=n, config=p.config.name, splits=p.splits, us=us,
                             err=err, gbs=c.bytes / us / 1e3, ok=err <= 1)
                    rec["mmq"].append(r)
                    print(f"  {pol[0]:9s} N={n:3d} {name:9s} {p.config.name:20s} split {p.splits:3d}: "
                          f"{us:8.2f} us {r['gbs']:6.0f} GB/s err/bound {err:.3f}{'' if r['ok'] else ' BAD'}",
                          flush=True)
                for label, names in (("4 launches", ("qkv", "o", "gate_up", "down")),
                                     ("7 matrices", ("q", "k", "k", "o", "gate", "gate", "down"))):
                    fns = [launcher(cases[nm], n) for nm in names]
                    us = time_us(lambda: [f() for f in fns], s, per=5, reps=7)
                    rec["layer"].append(dict(n=n, policy=pol[0], what=label, us=us))
                    print(f"  {pol[0]:9s} layer N={n} {label:10s}: {us:8.2f} us", flush=True)
            print(f"  [{time.time() - t_start:.0f} s]", flush=True)
        set_policy(POLICIES[-1])
        print("MMQ N = 512 (LARGE tiles): the two reductions where the plan splits K", flush=True)
        for name in ("o", "down", "down_q6k"):
            c = cases[name]
            n = 512
            for red in ("last", "kernel"):
                try:
                    xs_ = {cc: cuda.device_array((512, cc), np.float16) for cc in (c.cols,)}
                    xsc_ = cuda.device_array(512, np.float32)
                    xr = rng.standard_normal((512, c.cols)).astype(np.float32)
                    mmq.prepare_x(cuda.to_device(xr), xs_[c.cols], xsc_, s)
                    ybig = cuda.device_array((512, c.rows_out), np.float32)
                    p = MP.plan(c.qtype, c.rows_out, c.cols, n, c.mode, reduce=red)
                    fn = (lambda c=c, red=red, ybig=ybig, xs_=xs_, xsc_=xsc_:
                          mmq.mmq(c.w, xs_[c.cols], xsc_, ybig, c.mode, workspace=ws, stream=s, reduce=red))
                    y0 = rng.standard_normal((512, c.rows_out)).astype(np.float32)
                    ybig.copy_to_device(y0, stream=s)
                    fn()
                    s.synchronize()
                    rows = np.sort(rng.choice(c.rows_out, 64, replace=False))
                    out = ybig.copy_to_host()[:, rows].astype(np.float64)
                    ref = MR.reference(c.host, xr, c.mode, y0, rows)
                    err = float(np.max(np.abs(out - ref) / MR.error_bound(c.host, xr, c.mode, y0, rows)))
                    us = time_us(fn, s, per=5, reps=7)
                except Exception as exc:                          # noqa: BLE001
                    print(f"  N=512 {name} {red}: FAILED {exc}", flush=True)
                    continue
                flops = 2.0 * 512 * c.rows * c.cols
                r = dict(policy="n512", name=name, n=512, reduce=red, config=p.config.name, splits=p.splits,
                         us=us, err=err, tflops=flops / us / 1e6, ok=err <= 1)
                rec["mmq"].append(r)
                print(f"  N=512 {name:9s} {red:6s} {p.config.name:18s} split {p.splits}: {us:8.2f} us "
                      f"{r['tflops']:6.1f} TF/s err/bound {err:.3f}", flush=True)
        print(f"  [{time.time() - t_start:.0f} s]", flush=True)

    # ---------------------------------------------------------------- GEMV -----------
    def gw(qt, rows, cols):
        h = g_random(qt, rows, cols, rng)
        return h, G.prepare_weight(G.to_device(h, stream=s))

    def act(cols):
        x = rng.standard_normal((1, cols)).astype(np.float32)
        dx = cuda.to_device(x)
        xq = cuda.device_array((1, cols), np.int8)
        xs_ = cuda.device_array((1, cols // 8), np.float32)
        G.quantize_q8(dx, xq, xs_, stream=s)
        return x, dx, xq, xs_

    def check_rows(label, got, h, idx, x, xs_h):
        W = G.dequantize_weight(rows_of(h, idx))
        ref = G.gemv_reference(W, x)
        bound = G.error_bound(W, x, "dp4a", xs_h)
        r = float(np.max(np.abs(got.astype(np.float64) - ref) / bound))
        if not r <= 1:
            raise AssertionError(f"{label}: err/bound {r}")
        return r

    if "gemv" not in skip or args.ncu:
        Q4, Q6 = QType.Q4_K, QType.Q6_K
        ho, wo = gw(Q6, VOCAB, HIDDEN)
        hq, wq = gw(Q4, Q_DIM, HIDDEN)
        hk, wk = gw(Q4, KV_DIM, HIDDEN)
        hv, wv = gw(Q6, KV_DIM, HIDDEN)
        hg, wg = gw(Q4, FFN, HIDDEN)
        hu, wu = gw(Q4, FFN, HIDDEN)
        hd, wd = gw(Q4, HIDDEN, FFN)
        xe = act(HIDDEN)
        xf = act(FFN)
        ylog = cuda.device_array((1, VOCAB), np.float32)
        yqkv = cuda.device_array((1, Q_DIM + 2 * KV_DIM), np.float32)
        yff = cuda.device_array((1, FFN), np.float32)
        yres = cuda.to_device(np.zeros((1, HIDDEN), np.float32))
        xs_e, xs_f = xe[3].copy_to_host(), xf[3].copy_to_host()

        def out_fn(lpr, ks=1):
            return lambda: G.gemv(wo, xe[1], ylog, xq=xe[2], xs=xe[3], stream=s, ksplit=ks, lpr=lpr)

        def qkv_fn(lpr, ks=1):
            return lambda: G.gemv_qkv(wq, wk, wv, xe[1], yqkv, xq=xe[2], xs=xe[3], stream=s, ksplit=ks, lpr=lpr)

        def gu_fn(lpr, ks=1):
            return lambda: G.gemv_swiglu(wg, wu, xe[1], yff, xq=xe[2], xs=xe[3], stream=s, ksplit=ks, lpr=lpr)

        def down_fn(lpr, ks):
            return lambda: G.gemv(wd, xf[1], yres, xq=xf[2], xs=xf[3], residual=yres, stream=s,
                                  ksplit=ks, lpr=lpr)

        if args.ncu:
            targets = [out_fn(32), out_fn(16), gu_fn(32), qkv_fn(32), down_fn(32, 1)]
            cases = {nm: Case(nm, *sp) for nm, *sp in [
                ("k", KV_DIM, HIDDEN, "Q4_K", "store"), ("gate_up", 2 * FFN, HIDDEN, "Q4_K", "swiglu"),
                ("down_q6k", HIDDEN, FFN, "Q6_K", "add"), ("gate", FFN, HIDDEN, "Q4_K", "store")]}
            targets += [launcher(cases["k"], 33, reduce="last"), launcher(cases["k"], 33, reduce="kernel"),
                        launcher(cases["gate_up"], 33, reduce="last"), launcher(cases["gate_up"], 33, reduce="kernel"),
                        launcher(cases["down_q6k"], 33, reduce="last"),
                        launcher(cases["down_q6k"], 33, reduce="kernel"),
                        launcher(cases["gate"], 33, splits=1)]
            for f in targets:                      # compile and warm up
                f()
            s.synchronize()
            cuda.profile_start()
            for f in targets:
                f()
                s.synchronize()
            cuda.profile_stop()
            print("profiled", len(targets), "launches (some are two kernels)")
            return 0

        print("GEMV variants (us per launch, validated):", flush=True)
        idx_o = np.sort(rng.choice(VOCAB, 1024, replace=False))
        for label, mk, opts, nbytes in (
                ("output Q6_K", out_fn, [(32, 1), (16, 1)], wo.nbytes),
                ("qkv Q4+Q4+Q6", qkv_fn, [(32, 1), (16, 1)], wq.nbytes + wk.nbytes + wv.nbytes),
                ("gate+up Q4_K", gu_fn, [(32, 1), (16, 1)], wg.nbytes + wu.nbytes),
                ("down Q4_K +res", down_fn, [(32, 2), (32, 1), (16, 1)], wd.nbytes)):
            for a, b in opts:
                fn = mk(a, b)
                try:
                    fn()
                    s.synchronize()
                    if label.startswith("output"):
                        err = check_rows(label, ylog.copy_to_host()[:, idx_o], ho, idx_o, xe[0], xs_e)
                    elif label.startswith("qkv"):
                        got = yqkv.copy_to_host()
                        err = max(check_rows(label, got[:, :Q_DIM][:, :256], hq, np.arange(256), xe[0], xs_e),
                                  check_rows(label, got[:, Q_DIM + KV_DIM:][:, :256], hv, np.arange(256), xe[0], xs_e))
                    elif label.startswith("gate"):
                        got = yff.copy_to_host()[:, :256]
                        Wg_, Wu_ = (G.dequantize_weight(rows_of(h, np.arange(256))) for h in (hg, hu))
                        xt = G.dequantize_q8(xe[2].copy_to_host(), xs_e)
                        ref = G.swiglu_reference(Wg_, Wu_, xt)
                        err = float(np.max(np.abs(got - ref) / (1e-3 * np.abs(ref) + 1e-4)))
                    else:
                        yres.copy_to_device(np.zeros((1, HIDDEN), np.float32), stream=s)
                        fn()
                        s.synchronize()
                        err = check_rows(label, yres.copy_to_host()[:, :256], hd, np.arange(256), xf[0], xs_f)
                    us = time_us(fn, s, per=20 if nbytes < 1e8 else 5, reps=7)
                except Exception as exc:                          # noqa: BLE001
                    print(f"  {label} {a} {b}: FAILED {exc}", flush=True)
                    continue
                tag = f"lpr{a} ks{b}"
                r = dict(name=label, variant=tag, us=us, gbs=nbytes / us / 1e3, frac=nbytes / us / 1e6 / bw, err=err)
                rec["gemv"].append(r)
                print(f"  {label:15s} {tag:14s}: {us:8.2f} us {r['gbs']:6.0f} GB/s "
                      f"{r['frac']:6.1%}  err {err:.3f}", flush=True)
        print(f"  [{time.time() - t_start:.0f} s]", flush=True)

    if "step" not in skip and not args.ncu:
        from genie_rt.quant.gemv_bench import Bench
        b = Bench(argparse.Namespace(seed=1, layers=36))
        b.peak = bw
        from genie_rt.quant import pdl
        # programmatic dependent launch (sm_90+): checked on a dependent chain, then the step
        # without and with it, twice each (quant/pdl.py)
        pdls = [False]
        if pdl.available():
            b.results = []
            ok = b.pdl_chain_check()
            rec["pdl_check"] = ok
            pdls = [False, True, False, True] if ok else [False]
        else:
            print("  programmatic dependent launch not available here (needs sm_90+ and cuda.core with it)")
        for use_pdl in pdls:
            G.PDL = use_pdl
            b.results = []
            b.decode_step(36)
            for r in b.results:
                r.update(lpr_policy=str(G.LPR_POLICY), ksplit_warps=G.KSPLIT_WARPS_PER_SM, pdl=use_pdl)
                rec["step"].append(r)
            print(f"  (PDL {use_pdl}) [{time.time() - t_start:.0f} s]", flush=True)
        G.PDL = False

    print("\n==== summary", flush=True)
    for r in rec["layer"]:
        print(f"layer N={r['n']} {r['what']} {r['policy']}: {r['us']:.1f} us")
    for r in rec["step"]:
        print(f"step lpr={r['lpr_policy']} ks-target={r['ksplit_warps']} q8={r.get('quantize')} pdl={r.get('pdl')}: {r['us']:.1f} us "
              f"({r['gbs'] / 1e3 / bw:.1%})")
    bad = [r for r in rec["mmq"] if not r["ok"]]
    print(f"mmq validation: {'all ok' if not bad else f'{len(bad)} BAD'}; total {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
