"""Compare the MMQ variants on the GPU (validate first, then time).

    python tools/mmq_variants/bench_variants.py [--json PATH]      # GPU
    NUMBA_ENABLE_CUDASIM=1 python tools/mmq_variants/bench_variants.py --selftest   # no GPU

v1  the package kernel (quant/mmq_kernels.py): fp16 mma, weights dequantized to fp16 in
    registers, X fp16 in MMQ order. Timed with its default plan and without split-K.
v2  v2_s8_q4k.py: int8 mma m16n8k32, X quantized per 32 (q8_1 style), per-k32 rescale.

Shapes: Qwen3-4B gate (9728 x 2560) and down (2560 x 9728), Q4_K, N = 33 and 512.
Also prints the f16 and s8 mma.sync peaks (register-only probes): v2 can only win if
the s8 rate (2x f16 on paper) survives its per-mma rescaling.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from numba import cuda  # noqa: E402

import v2_s8_q4k as V2  # noqa: E402
from genie_rt.quant import mmq, mmq_kernels as K, mmq_plan as MP, mmq_reference as MR  # noqa: E402
from genie_rt.quant.layout import PackedWeight  # noqa: E402

SHAPES = [("gate", 9728, 2560), ("down", 2560, 9728)]
V2_CONFIGS = {33: (4, 2, 6, 3), 512: (4, 2, 16, 2)}       # wm, mt, nt, stages


def to_device(w):
    return PackedWeight(w.qtype, w.rows, w.cols, {k: cuda.to_device(v) for k, v in w.planes.items()})


def run_v2(kern, w_dev, x, stream=0):
    """prepare_x_q8 + the s8 GEMM; returns device buffers (xq, dx, sx, y) and a launcher."""
    n, cols = x.shape
    xd = cuda.to_device(x)
    q = cuda.device_array((n, cols // 4), np.uint32)
    dx = cuda.device_array((n, cols // 32), np.float32)
    sx = cuda.device_array((n, cols // 32), np.float32)
    V2.prepare_x_q8_kernel[n, 128, stream](xd, q, dx, sx, cols // 32)
    y = cuda.device_array((n, w_dev.rows), np.float32)
    xq = q.view(np.uint8)

    def go():
        V2.launch(kern, w_dev, xq, dx, sx, y, stream)
    return y, go


def check_v2(w, x, y, rows=None):
    rows = np.arange(w.rows) if rows is None else rows
    wd = MR.dequantize_weight(w, rows)
    ref = x.astype(np.float64) @ wd.T
    bound = V2.q8_error_bound(wd, x)
    err = np.abs(y[:, rows] - ref)
    ratio = float((err / bound).max())
    rms = float(np.sqrt((err ** 2).mean() / (ref ** 2).mean()))
    return ratio <= 1.0, ratio, rms


def selftest():
    rng = np.random.default_rng(0)
    w = MR.random_weight("Q4_K", 32, 512, rng)
    x = rng.standard_normal((7, 512)).astype(np.float32)
    kern = V2.build_s8_kernel(wm=1, mt=2, nt=2, stages=3)
    y, go = run_v2(kern, to_device(w), x)
    go()
    ok, ratio, rms = check_v2(w, x, y.copy_to_host())
    print(f"v2 selftest Q4_K 32x512 N=7: {'ok' if ok else 'FAILED'} err/bound {ratio:.3f} rel rms {rms:.1e}")
    # prepare_x_q8 against its numpy twin (equal up to ties in rounding)
    q = cuda.device_array((2, 128), np.uint32)
    d = cuda.device_array((2, 16), np.float32)
    s = cuda.device_array((2, 16), np.float32)
    V2.prepare_x_q8_kernel[2, 32](cuda.to_device(x[:2]), q, d, s, 16)
    qh, dh, _ = V2.prepare_x_q8_host(x[:2])
    same = np.mean(q.copy_to_host().view(np.int8) == qh)
    print(f"prepare_x_q8 vs numpy: {100 * same:.2f} % of quants identical, d max diff "
          f"{np.abs(d.copy_to_host() - dh).max():.1e}")
    return 0 if ok and same > 0.99 else 1


def gpu(args):
    from genie_rt.quant.mmq_bench import Timer, mma_peak_tflops
    stream = cuda.stream()
    timer = Timer(cuda, stream)
    rng = np.random.default_rng(42)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    peak16 = mma_peak_tflops(cuda, timer)
    sms, _ = MP.device_limits()
    o = cuda.device_array(sms * 8 * 256, np.int32)
    us = timer.time_us(lambda: V2.mma_s8_peak_kernel[sms * 8, 256, stream](o, 4096), reps=3, samples=5)
    peak8 = sms * 8 * 8 * 4096 * 8 * 2 * 16 * 8 * 32 / us / 1e6
    out.update(f16_peak_tflops=peak16, s8_peak_tops=peak8)
    print(f"mma.sync peaks (probe): f16->f32 {peak16:.0f} TFLOP/s, s8->s32 {peak8:.0f} TOP/s")
    for name, rows, cols in SHAPES:
        w = MR.random_weight("Q4_K", rows, cols, rng)
        wd = to_device(w)
        for n in (33, 512):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            flops = 2.0 * n * rows * cols
            sample = np.sort(rng.choice(rows, 160, replace=False))
            # v1, default plan and without split-K
            xd = cuda.to_device(x)
            x16 = cuda.device_array((n, cols), np.float16)
            xs = cuda.device_array(n, np.float32)
            mmq.prepare_x(xd, x16, xs, stream)
            y1 = cuda.device_array((n, rows), np.float32)
            ws = cuda.to_device(np.zeros(max(MP.workspace_bytes(wd, n), 16), np.uint8))
            for tag, splits in (("v1 default", None), ("v1 no split", 1)):
                def go1(splits=splits):
                    mmq.mmq(wd, x16, xs, y1, workspace=ws, stream=stream, splits=splits)
                go1()
                stream.synchronize()
                ref = MR.reference(w, x, rows=sample)
                bound = MR.error_bound(w, x, rows=sample)
                ratio = float((np.abs(y1.copy_to_host()[:, sample] - ref) / bound).max())
                t = timer.time_us(go1)
                rec = dict(variant=tag, shape=name, n=n, us=t, tflops=flops / t / 1e6, err_over_bound=ratio)
                out["runs"].append(rec)
                print(f"{name:5s} N={n:4d} {tag:12s}: {t:9.2f} us {rec['tflops']:7.1f} TF/s "
                      f"{'ok' if ratio <= 1 else 'BAD'} err/bound {ratio:.3f}")
            # v2
            wm, mt, nt, stages = V2_CONFIGS[n]
            kern = V2.build_s8_kernel(wm=wm, mt=mt, nt=nt, stages=stages)
            if kern.meta["smem"] > 48 * 1024:
                compiled = kern.compile(V2.SIGNATURE)
                from cuda.bindings import driver as binding
                from numba.cuda.cudadrv.driver import driver
                cufunc = compiled._codelibrary.get_cufunc()
                attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.cuKernelSetAttribute(attr, kern.meta["smem"], cufunc.handle,
                                            cuda.get_current_device().id)
            y2, go2 = run_v2(kern, wd, x, stream)
            go2()
            stream.synchronize()
            ok, ratio, rms = check_v2(w, x, y2.copy_to_host(), sample)
            t = timer.time_us(go2)
            rec = dict(variant=f"v2 s8 {kern.meta['bm']}x{kern.meta['bn']}", shape=name, n=n, us=t,
                       tflops=flops / t / 1e6, err_over_bound=ratio, rel_rms=rms)
            out["runs"].append(rec)
            print(f"{name:5s} N={n:4d} {'v2 s8':12s}: {t:9.2f} us {rec['tflops']:7.1f} TF/s "
                  f"{'ok' if ok else 'BAD'} err/bound(q8) {ratio:.3f} rel rms {rms:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--selftest", action="store_true", help="tiny correctness check (simulator ok)")
    args = ap.parse_args()
    if args.selftest or K.SIMULATOR:
        sys.exit(selftest())
    sys.exit(gpu(args))


if __name__ == "__main__":
    main()
