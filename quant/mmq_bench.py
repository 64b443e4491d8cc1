"""Microbenchmark of the MMQ family on a real GPU: `python -m genie_rt.quant.mmq`.

Order of work (nothing is timed before it matches the reference):
  1. probes: mma.sync f16 peak (back-to-back mma in registers), HBM read bandwidth;
  2. prepare_x: validate, time;
  3. the Qwen3-4B layer shapes at N = 18, 33, 128, 512, 2048 with the default plan:
     validate a sample of output rows against numpy (float64 X @ dequantize(W).T, with
     the bound of mmq_reference.error_bound), then time;
  4. tile configs and split-K choices compared on the FFN shapes at N = 33 and 512;
  5. one layer's seven matrices at N = 33 (and with gate/up fused as SwiGLU), timed as
     one CUDA graph, plus the sum of the single-GEMM medians;
  6. a summary table; --json PATH writes every record.

Timing: the kernel is launched R times inside a CUDA graph (captured from ordinary
launches on a numba stream: this also checks the launcher is capture-safe); the graph
is replayed after a warm-up and timed with CUDA events; the reported time is the median
over replays divided by R (it includes the graph's per-node launch gap, ~1 us, which a
captured engine step pays too). Falls back to timing plain launches if capture fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dataclasses import replace

from . import mmq
from . import mmq_kernels as K
from . import mmq_plan as MP
from . import mmq_prep as P
from . import mmq_reference as MR
from .layout import PackedWeight

HIDDEN, Q_DIM, KV_DIM, FFN = 2560, 4096, 1024, 9728
# (name, rows, cols, qtype, mode): one Qwen3-4B layer (Q4_K_M: V and down are Q6_K in
# some layers; both types are measured)
LAYER = [
    ("q", Q_DIM, HIDDEN, "Q4_K", "store"),
    ("k", KV_DIM, HIDDEN, "Q4_K", "store"),
    ("v", KV_DIM, HIDDEN, "Q4_K", "store"),
    ("o", HIDDEN, Q_DIM, "Q4_K", "add"),
    ("gate", FFN, HIDDEN, "Q4_K", "store"),
    ("up", FFN, HIDDEN, "Q4_K", "store"),
    ("down", HIDDEN, FFN, "Q4_K", "add"),
]
EXTRA = [
    ("v_q6k", KV_DIM, HIDDEN, "Q6_K", "store"),
    ("down_q6k", HIDDEN, FFN, "Q6_K", "add"),
    ("q_q8_0", Q_DIM, HIDDEN, "Q8_0", "store"),
    ("gate_up_swiglu", 2 * FFN, HIDDEN, "Q4_K", "swiglu"),
    # the other weight types of the prefill GEMM, at shapes of the Q4_K ones above
    ("q_q5k", Q_DIM, HIDDEN, "Q5_K", "store"),
    ("down_q5k", HIDDEN, FFN, "Q5_K", "add"),
    ("q_f16", Q_DIM, HIDDEN, "F16", "store"),
    ("down_f16", HIDDEN, FFN, "F16", "add"),
    ("q_bf16", Q_DIM, HIDDEN, "BF16", "store"),
    ("down_bf16", HIDDEN, FFN, "BF16", "add"),
]
N_VALUES = (18, 33, 128, 512, 2048)


class Timer:
    """Median per-launch time of fn() in microseconds: engine/cuda_graph.time_us (a CUDA
    graph of `reps` launches, `samples` timed replays; plain launches if capture fails)."""

    def __init__(self, cuda, stream):
        self.cuda, self.stream = cuda, stream

    def time_us(self, fn, reps=20, samples=7):
        from genie_rt.engine.cuda_graph import time_us
        return time_us(fn, self.stream, per=reps, reps=samples)


def mma_peak_tflops(cuda, timer):
    sms, _ = MP.device_limits()
    blocks, threads, iters = sms * 8, 256, 4096
    out = cuda.device_array(blocks * threads, np.float32)
    fn = lambda: P.mma_peak_kernel[blocks, threads, timer.stream](out, iters)  # noqa: E731
    us = timer.time_us(fn, reps=3, samples=5)
    flops = blocks * threads // 32 * iters * 8 * 2 * 16 * 8 * 16
    return flops / us / 1e6


def bandwidth_gbs(cuda, timer):
    from numba import uint32
    from .ptx import ldg_v4

    @cuda.jit
    def read_kernel(a, out):
        i = cuda.grid(1) * 4
        stride = cuda.gridsize(1) * 4
        s = uint32(0)
        while i < a.shape[0]:
            v = ldg_v4(a, i)
            s ^= v[0] ^ v[1] ^ v[2] ^ v[3]
            i += stride
        if s == uint32(0x12345678):
            out[0] = s

    n = 1 << 28                              # 1 GiB of uint32
    a = cuda.device_array(n, np.uint32)
    out = cuda.device_array(1, np.uint32)
    sms, _ = MP.device_limits()
    fn = lambda: read_kernel[sms * 16, 256, timer.stream](a, out)  # noqa: E731
    us = timer.time_us(fn, reps=3, samples=5)
    return 4 * n / us / 1e3


class Case:
    """One weight on the device with its activations, outputs and workspace."""

    def __init__(self, cuda, name, rows, cols, qtype, mode, n_max, rng):
        self.name, self.rows, self.cols, self.qtype, self.mode = name, rows, cols, qtype, mode
        self.host = MR.random_weight(qtype, rows, cols, rng)
        self.w = PackedWeight(self.host.qtype, rows, cols,
                                  {k: cuda.to_device(v) for k, v in self.host.planes.items()})
        self.rows_out = rows // 2 if mode == "swiglu" else rows
        self.bytes = self.host.nbytes


def run(args):
    from numba import cuda
    rng = np.random.default_rng(1234)
    stream = cuda.stream()
    timer = Timer(cuda, stream)
    dev = cuda.get_current_device()
    sms, smem = MP.device_limits()
    records = {"device": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
               "cc": list(dev.compute_capability), "sms": sms, "smem_optin": smem,
               "date": time.strftime("%Y-%m-%d %H:%M"), "gemm": [], "configs": [], "layer": {}}
    t_start = time.time()
    print(f"device {records['device']} cc {dev.compute_capability} SMs {sms} smem/block {smem}")
    peak = mma_peak_tflops(cuda, timer)
    bw = bandwidth_gbs(cuda, timer)
    records.update(mma_peak_tflops=peak, read_gbs=bw)
    print(f"mma.sync f16->f32 peak (probe): {peak:.1f} TFLOP/s;  HBM read (ldg_v4): {bw:.0f} GB/s")

    n_values = args.n or N_VALUES
    n_max = max(n_values)
    cases = [Case(cuda, *spec, n_max, rng) for spec in LAYER + EXTRA]
    cols_set = sorted({c.cols for c in cases})
    x_host = {c: rng.standard_normal((n_max, c)).astype(np.float32) for c in cols_set}
    x_dev = {c: cuda.to_device(x_host[c]) for c in cols_set}
    x16 = {c: cuda.device_array((n_max, c), np.float16) for c in cols_set}
    xs = {c: cuda.device_array(n_max, np.float32) for c in cols_set}
    y_max = max(c.rows_out for c in cases)
    y_buf = cuda.device_array(n_max * y_max, np.float32)
    ws_bytes = 1 << 20
    for c in cases:
        for n in n_values:
            ws_bytes = max(ws_bytes, MP.workspace_bytes(c.w, n, c.mode))
    ws_bytes = max(ws_bytes, 256 << 20)     # room for the sweep's split-K variants too
    ws = cuda.to_device(np.zeros(ws_bytes, np.uint8))

    # ---- prepare_x (plain, and with the RMSNorm fused in) --------------------------------
    for cols in cols_set:
        norm_w = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        norm_d = cuda.to_device(norm_w)
        for n in sorted({33, 512, n_max}):
            if n > n_max:
                continue
            xv, hv, sv = x_dev[cols][:n], x16[cols][:n], xs[cols][:n]
            for tag, wv in (("plain", None), ("rmsnorm", norm_d)):
                mmq.prepare_x(xv, hv, sv, stream, norm_weight=wv)
                stream.synchronize()
                want16, want_s = MR.prepare_x_reference(x_host[cols][:n], None if wv is None else norm_w)
                got = hv.copy_to_host().astype(np.float32)
                ok = bool(np.all(sv.copy_to_host() == want_s) and np.allclose(
                    got, want16.astype(np.float32), rtol=2 ** -10, atol=0))
                us = timer.time_us(lambda: mmq.prepare_x(xv, hv, sv, stream, norm_weight=wv))
                gbs = n * cols * 6 / us / 1e3
                print(f"prepare_x {tag:7s} N={n:5d} cols={cols:5d}: {us:8.2f} us  {gbs:6.0f} GB/s  "
                      f"{'ok' if ok else 'MISMATCH'}")
                records.setdefault("prepare_x", []).append(dict(n=n, cols=cols, norm=tag, us=us, ok=ok))
    for cols in cols_set:
        mmq.prepare_x(x_dev[cols], x16[cols], xs[cols], stream)
    stream.synchronize()

    def y_view(n, c):
        return y_buf[:n * c.rows_out].reshape(n, c.rows_out)

    def launch(c, n, config=None, splits=None):
        return lambda: mmq.mmq(c.w, x16[c.cols][:n], xs[c.cols][:n], y_view(n, c), c.mode,
                               workspace=ws, stream=stream, config=config, splits=splits)

    def validate(c, n, config=None, splits=None):
        """Max error / bound and relative rms on a sample of output rows."""
        rows = np.sort(rng.choice(c.rows_out, min(c.rows_out, 160), replace=False))
        y0 = rng.standard_normal((n, c.rows_out)).astype(np.float32)
        yv = y_view(n, c)
        yv.copy_to_device(y0, stream=stream)
        launch(c, n, config, splits)()
        stream.synchronize()
        out = yv.copy_to_host()[:, rows]
        x = x_host[c.cols][:n]
        ref = MR.reference(c.host, x, c.mode, y0, rows)
        bound = MR.error_bound(c.host, x, c.mode, y0, rows)
        err = np.abs(out.astype(np.float64) - ref)
        ratio = float(np.max(err / bound))
        dev_part = ref - (y0[:, rows] if c.mode == "add" else 0)
        rms = float(np.sqrt(np.mean(err ** 2) / max(np.mean(dev_part ** 2), 1e-300)))
        ok = bool(ratio <= 1.0 and np.all(np.isfinite(out)))
        return ok, ratio, rms

    def measure(c, n, config=None, splits=None, tag="default"):
        p = MP.plan(c.w.qtype, c.rows_out, c.cols, n, c.mode, config, splits)
        t0 = time.time()
        ok, ratio, rms = validate(c, n, config, splits)
        t_compile_validate = time.time() - t0
        us = timer.time_us(launch(c, n, config, splits))
        flops = 2.0 * n * c.rows * c.cols
        rec = dict(name=c.name, qtype=c.qtype, rows=c.rows, cols=c.cols, mode=c.mode, n=n,
                   tag=tag, config=p.config.name, splits=p.splits, grid=list(p.grid),
                   smem=p.smem, us=us, tflops=flops / us / 1e6, frac_peak=flops / us / 1e6 / peak,
                   weight_gbs=c.bytes / us / 1e3, frac_bw=c.bytes / us / 1e3 / bw,
                   ok=ok, err_over_bound=ratio, rel_rms=rms, first_call_s=t_compile_validate)
        flag = "ok " if ok else "BAD"
        print(f"  {c.name:15s} {c.qtype} {c.rows:5d}x{c.cols:5d} N={n:5d} {p.config.name:18s} "
              f"split {p.splits:2d}: {us:9.2f} us {rec['tflops']:7.1f} TF/s "
              f"({100 * rec['frac_peak']:5.1f}% peak) {rec['weight_gbs']:6.0f} GB/s  "
              f"{flag} err/bound {ratio:.3f} rms {rms:.1e}")
        return rec

    # ---- every shape, default plan -----------------------------------------------------
    for n in n_values:
        print(f"N = {n}")
        for c in cases:
            records["gemm"].append(measure(c, n))
        print(f"  [elapsed {time.time() - t_start:.0f} s]")

    # ---- tile configs / split-K on the FFN shapes ----------------------------------------
    by_name = {c.name: c for c in cases}
    if not args.no_sweep:
        print("tile configs and split-K (gate Q4_K, down Q6_K)")
        for n in [v for v in (33, 512) if v in n_values]:
            if n <= 64:
                base = MP.small_config(n)
                variants = [(base, 1, "no split"), (base, 2, "2 splits"), (base, 64, "max split"),
                            (replace(base, stages=4), None, "4 stages"),
                            (MP.TileConfig(wm=4, wn=1, mt=1, nt=base.nt, stages=4), None, "bm 64")]
            else:
                variants = [(MP.LARGE, 1, "128x128 s3"), (replace(MP.LARGE, stages=2), 1, "128x128 s2"),
                            (MP.TileConfig(wm=2, wn=2, mt=4, nt=8, stages=3), None, "4 warps 64x64"),
                            (MP.TileConfig(wm=4, wn=1, mt=2, nt=16, stages=3), None, "4 warps 32x128")]
            for name in ("gate", "down_q6k"):
                c = by_name[name]
                for cfg, splits, tag in variants:
                    try:
                        records["configs"].append(measure(c, n, cfg, splits, tag))
                    except Exception as exc:                     # noqa: BLE001
                        print(f"  {name} N={n} {cfg.name} {tag}: skipped ({exc})")
            print(f"  [elapsed {time.time() - t_start:.0f} s]")

    # ---- one layer at N = 33 -------------------------------------------------------------
    if 33 in n_values:
        n = 33
        singles = {r["name"]: r["us"] for r in records["gemm"] if r["n"] == n and r["tag"] == "default"}
        layer = [by_name[s[0]] for s in LAYER]
        total = sum(singles[c.name] for c in layer)
        fused = [by_name[nm] for nm in ("q", "k", "v", "o", "gate_up_swiglu", "down")]
        total_fused = sum(singles[c.name] for c in fused)

        def chain(cs):
            fns = [launch(c, n) for c in cs]
            return lambda: [f() for f in fns]
        t_graph = timer.time_us(chain(layer), reps=5)
        t_graph_fused = timer.time_us(chain(fused), reps=5)
        layer_bytes = sum(c.bytes for c in layer)
        records["layer"] = dict(n=n, sum_single_us=total, graph_us=t_graph,
                                sum_single_fused_us=total_fused, graph_fused_us=t_graph_fused,
                                weight_bytes=layer_bytes, floor_us=layer_bytes / bw / 1e3)
        print(f"Qwen3-4B layer, 7 matrices (Q4_K), N = 33: sum of singles {total:.1f} us, "
              f"as one graph {t_graph:.1f} us; with gate/up as one SwiGLU GEMM: "
              f"{total_fused:.1f} / {t_graph_fused:.1f} us; weight read floor "
              f"{layer_bytes / bw / 1e3:.1f} us ({layer_bytes / 1e6:.1f} MB)")

    # ---- summary -------------------------------------------------------------------------
    print("\nsummary (default plans): us per GEMM")
    names = [c.name for c in cases]
    print(f"{'N':>6s} " + " ".join(f"{nm[:9]:>9s}" for nm in names))
    for n in n_values:
        row = {r["name"]: r for r in records["gemm"] if r["n"] == n}
        print(f"{n:6d} " + " ".join(f"{row[nm]['us']:9.1f}" for nm in names))
    for n in n_values:
        ffn = [r for r in records["gemm"] if r["n"] == n and r["name"] in ("gate", "down")]
        print(f"N={n:5d} FFN Q4_K: " + ", ".join(f"{r['name']} {r['tflops']:.1f} TF/s" for r in ffn))
    bad = [r for r in records["gemm"] + records["configs"] + records.get("prepare_x", []) if not r["ok"]]
    print(f"validation: {'all ok' if not bad else f'{len(bad)} FAILED'}; "
          f"total {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if not bad else 1


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m genie_rt.quant.mmq", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all records to this file")
    ap.add_argument("--n", type=int, nargs="*", help=f"token counts (default {N_VALUES})")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-config comparison")
    ap.add_argument("--quick", action="store_true", help="N = 33 and 512 only, no sweep")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.no_sweep = [33, 512], True
    if K.SIMULATOR:
        sys.exit("mmq benchmark: needs a GPU (NUMBA_ENABLE_CUDASIM is set)")
    sys.exit(run(args))
