"""v1: the textbook Q4_K GEMV, the baseline the package kernels are measured against.

What it is: one warp per row; each lane reads one 4-byte word of the row's qs plane at
a time (a warp reads 128 contiguous bytes: coalesced, but 4-byte loads), reloads and
re-decodes its block header for every word, turns each nibble into a float with an
int -> float conversion, and multiplies by float32 x read with scalar loads. Exact up to
fp32 rounding (mode "f32").

What the package version (quant/gemv_kernels.py) changes, and why:
- 16-byte ld.global.nc.v4 loads, three in flight per lane (4.37 vs 3.68 TB/s in the
  bandwidth probe, and latency hidden without needing 2048 threads per SM);
- the header decoded once per 16-byte unit (32 weights) instead of once per 8 weights;
- "dp4a" mode: x quantized to q8 once, 4 weights per instruction, no per-weight float
  conversion; "f32" mode: nibbles become floats through the fp16 1024 + q trick.

Run by `python -m genie_rt.quant.gemv` (validated, then timed next to the package kernels).
Interface for the benchmark: NAME, QTYPE, MODE, launcher(w, x, y, xq, xs, stream).
"""
import numpy as np
from numba import cuda, float32

from genie_rt.quant import ptx
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_formats import _k_scales
from genie_rt.quant.gemv_kernels import _warp_sum

NAME = "v1 scalar-load Q4_K"
QTYPE = QType.Q4_K
MODE = "f32"
WARPS = 4


@cuda.jit
def gemv_q4k_v1(qs, hdr, nb, rows, x, y):
    # qs uint32 [rows * nb * 32], hdr uint32 [rows * nb * 4], x float32 [cols], y float32 [rows]
    lane = cuda.threadIdx.x & 31
    row = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    acc = float32(0)
    if row < rows:
        for wi in range(lane, nb * 32, 32):         # word wi of the row's qs
            b = wi >> 5                             # block
            k = wi & 31                             # word in the block's 128 bytes
            c = k >> 3                              # 32-byte chunk: sub-blocks 2c (low), 2c+1 (high)
            l0 = (k & 7) * 4                        # first of the word's 4 lanes l
            w = qs[row * nb * 32 + wi]
            hb = (row * nb + b) * 4
            h = (hdr[hb], hdr[hb + 1], hdr[hb + 2], hdr[hb + 3])
            dm = ptx.unpack_half2(h[0])
            sa, ma, sb, mb = _k_scales(h, c)
            da, oa = dm[0] * float32(sa), dm[1] * float32(ma)
            db, ob = dm[0] * float32(sb), dm[1] * float32(mb)
            col = b * 256 + c * 64 + l0
            for e in range(4):
                qa = (w >> (8 * e)) & 15
                qb = (w >> (8 * e + 4)) & 15
                acc += (da * float32(qa) - oa) * x[col + e] + (db * float32(qb) - ob) * x[col + 32 + e]
    acc = _warp_sum(acc)
    if lane == 0 and row < rows:
        y[row] = acc


def launcher(w, x, y, xq, xs, stream):
    """Compile for these buffers and return a no-argument launch (n_tok = 1)."""
    assert w.qtype == QTYPE and x.shape[0] == 1, "v1 handles Q4_K with one token"
    xf, yf = x.reshape(x.size), y.reshape(y.size)
    nb = w.cols // 256
    if not ptx.SIMULATOR:
        gemv_q4k_v1.compile("void(uint32[::1], uint32[::1], int64, int64, float32[::1], float32[::1])")
    grid = -(-w.rows // WARPS)

    def launch():
        gemv_q4k_v1[grid, 32 * WARPS, stream](w.wa, w.wb, nb, w.rows, xf, yf)
    return launch


if __name__ == "__main__":   # quick self-check (simulator or GPU)
    from genie_rt.quant import gemv as G
    from genie_rt.quant.gemv_bench import random_weight
    rng = np.random.default_rng(0)
    hw = random_weight(QTYPE, 5, 512, rng)
    w = G.prepare_weight(G.to_device(hw), MODE)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    y = cuda.device_array((1, 5), np.float32)
    launcher(w, cuda.to_device(x), y, None, None, 0)()
    W = G.dequantize_weight(hw)
    err = np.abs(y.copy_to_host() - G.gemv_reference(W, x)) / G.error_bound(W, x, "f32")
    print(f"{NAME}: max |err| / bound = {err.max():.3g}")
