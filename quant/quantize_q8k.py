"""RMSNorm -> q8_K activations on the device: what quant/gemv_mma_k.py's GEMV reads (lab, 2026-12-05).

q8_K (llama.cpp's CPU K-quant activations): per token and 256-value block one float32 scale
xd = max |h| / 127, the values xq = rint(h / xd) in -127..127 (int8), and the integer sum xb of
each 32 values. `q8k_layout.quantize_q8k` is the numpy reference; `rmsnorm_q8k` here computes it
of h = rmsnorm(x) * w (or of x itself when w is None) for n_tok rows at once.

Who does what. A thread block of 8 warps quantizes 8 of a row's 256-value blocks, one a warp
(`grid`: a 9,728-value row is 5 thread blocks, so the work is spread over the GPU, not over one
SM a row). Lane l holds values 8l .. 8l + 7 of its warp's block (two 16-byte loads); the warp's
max by butterflies, the 32-value sums over lanes 4k .. 4k + 3 by two more, and the lane stores its
8 quants as two 32-bit words (xq is written through a uint32 view; all three tiled: quant/q8k_layout.py).
With the norm, every thread
block of a row first sums the whole row's squares (warp w blocks w, w + 8, ..; the row is 10-38 KB,
read from the L2 by each), in the same order in each, so all of a row's blocks divide by the same
rms; a warp keeps its own block's values from that pass.

The arithmetic is the reference's: xd = amax / 127, inv = 1 / xd (0 for an all-zero block), q = rint(v
* inv) (round half to even, as np.rint) in IEEE float32, the product rounded by itself (`mul.rn`:
NVVM would otherwise contract it and the rounding add into one FMA, as it does in quantize_q8's
kernel) - so without the norm the bits are the reference's; with it, h differs from numpy's by the
order of the sum of squares (float rounding).

Status: checked in the simulator (tests/test_quantize_q8k.py). Used by the short prefill
(engine/cuda_short_prefill.py). Its first build, a thread block a row and 8 scalar loads a lane,
took 4.6 us on an H100 for 8 or 16 rows of 2,560 values and 9.0 us of 9,728 (2026-12-05, `python
-m genie_rt.quant.gemv_mma_k`); in the short graph 2.8 us for the attention's output (4,096) and
5.0 for the SwiGLU's (9,728), 3.9 a norm (docs/bench/profile-short-h100-2026-12-06b.txt).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .norm_q8_device import FULL, block_sum, q8k_round, q8k_scale
from .pdl import hooks as pdl_hooks
from .q8k_layout import check, xd_base, xq_word

QK = 256
THREADS = 256                                   # 8 warps a block, a 256-value block a warp
WARPS = THREADS // 32
SIGNATURE = "void(float32[::1], int32, float32[::1], float32, uint32[::1], float32[::1], int32[::1])"


def grid(n_tok: int, d: int) -> tuple:
    """(n_tok, thread blocks a row): a row's 256-value blocks WARPS to a thread block."""
    return (n_tok, -(-(d // QK) // WARPS))


@functools.lru_cache(maxsize=None)
def rmsnorm_q8k_kernel(NORM: bool, PDL: bool = False):
    """The kernel: grid `grid(n_tok, d)`, THREADS threads. Arguments: x float32 [n * d] (rows of d
    values, d a multiple of 256), d, w float32 [d] (read when NORM), eps, xq uint32 [n * d / 4] (int8
    values, 4 a word), xd float32 [n * d / 256], xb int32 [n * d / 32]. PDL: a programmatic-
    dependent-launch build (quant/pdl.py): the next kernel may launch at once; this one loads its
    norm weights (constants), then waits for the one before (it reads x next)."""
    wait, launch_dependents, _ = pdl_hooks(PDL)
    ldw = ptx.ldw_v4 if PDL else ptx.ldg_v4      # a load that stays above the wait (quant/pdl.py)

    @cuda.jit
    def kernel(x, d, w, eps, xq, xd, xb):
        launch_dependents()
        r = cuda.blockIdx.x
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        nblk = d >> 8
        mine = cuda.blockIdx.y * WARPS + warp    # the 256-value block this warp quantizes
        base = mine * QK + 8 * lane              # its 8 values' first column
        row = r * d
        vals = cuda.local.array(8, float32)
        wv = cuda.local.array(8, float32)
        if NORM and mine < nblk:
            w0, w1, w2, w3 = ldw(w, base)
            w4, w5, w6, w7 = ldw(w, base + 4)
            wv[0], wv[1], wv[2], wv[3], wv[4], wv[5], wv[6], wv[7] = w0, w1, w2, w3, w4, w5, w6, w7
        wait()
        s = float32(1)
        if NORM:
            # every thread block of a row sums the whole row's squares, each in the same order:
            # warp w takes blocks w, w + 8, .., a lane 8 consecutive values of each (its own block's
            # kept for the quantization)
            sh = cuda.shared.array(32, float32)
            ss = float32(0)
            b = warp
            while b < nblk:
                v0, v1, v2, v3 = ptx.ld_v4(x, row + b * QK + 8 * lane)
                v4, v5, v6, v7 = ptx.ld_v4(x, row + b * QK + 8 * lane + 4)
                if b == mine:
                    vals[0], vals[1], vals[2], vals[3] = v0, v1, v2, v3
                    vals[4], vals[5], vals[6], vals[7] = v4, v5, v6, v7
                ss += v0 * v0
                ss += v1 * v1
                ss += v2 * v2
                ss += v3 * v3
                ss += v4 * v4
                ss += v5 * v5
                ss += v6 * v6
                ss += v7 * v7
                b += WARPS
            ss = block_sum(ss, sh)
            s = math.sqrt(ss / float32(d) + eps)
        elif mine < nblk:
            v0, v1, v2, v3 = ptx.ld_v4(x, row + base)
            v4, v5, v6, v7 = ptx.ld_v4(x, row + base + 4)
            vals[0], vals[1], vals[2], vals[3] = v0, v1, v2, v3
            vals[4], vals[5], vals[6], vals[7] = v4, v5, v6, v7
        if mine >= nblk:                         # warp-uniform; after the block-wide sum
            return
        a = float32(0)
        for j in range(8):
            v = vals[j]
            if NORM:
                v = float32(v / s * wv[j])
            vals[j] = v
            a = max(a, abs(v))
        for off in (16, 8, 4, 2, 1):
            a = max(a, cuda.shfl_xor_sync(FULL, a, off))
        scale, inv = q8k_scale(a)
        lo = uint32(0)
        hi = uint32(0)
        tot = int32(0)
        for j in range(8):
            # round half to even, exactly np.rint of the float32 product (not of an FMA's exact one)
            q = q8k_round(vals[j], inv)
            tot += q
            if j < 4:
                lo |= (uint32(q) & uint32(0xFF)) << uint32(8 * j)
            else:
                hi |= (uint32(q) & uint32(0xFF)) << uint32(8 * (j - 4))
        tot = int32(tot + cuda.shfl_xor_sync(FULL, tot, 1))   # lanes 4k .. 4k + 3: one sub-block
        tot = int32(tot + cuda.shfl_xor_sync(FULL, tot, 2))
        # the tiled xq (quant/q8k_layout.py): token r's 32 bytes of sub-block 8 mine + lane / 4
        wi = xq_word(r, d) + uint32((mine * 8 + (lane >> 2)) * 64 + 2 * (lane & 3))
        xq[wi] = lo
        xq[wi + uint32(1)] = hi
        ix = xd_base(r, nblk) + uint32(8 * mine)                    # the tiled xd, xb (q8k_layout)
        if (lane & 3) == 0:
            xb[uint32(8) * ix + uint32(lane >> 2)] = tot
        if lane == 0:
            xd[ix] = scale
    return kernel_cache.attach(kernel)


def rmsnorm_q8k(x, w, eps: float, xq, xd, xb, stream=0, pdl: bool = False) -> None:
    """q8_K of rmsnorm(x) * w (w None: of x) for every row of x float32 [n_tok, d] (d a multiple
    of 256) into xq int8, xd float32, xb int32 as the device holds them (tiled, whole groups of 8 rows:
    quant/q8k_layout.py; device arrays of any shape of its `sizes`). pdl: the programmatic-dependent-launch build and launch (sm_90+:
    the caller checks quant/pdl.available()). No allocation, no synchronization."""
    from . import pdl as P
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"rmsnorm_q8k: x must be float32 [n_tok, d], got {x.dtype} {tuple(x.shape)}")
    n, d = x.shape
    if d % QK:
        raise ValueError(f"rmsnorm_q8k: d {d} must be a multiple of {QK}")
    check("rmsnorm_q8k", n, d, xq, xd, xb)
    if w is not None and (w.dtype != np.float32 or w.size != d):
        raise ValueError(f"rmsnorm_q8k: w must be float32 with {d} elements, got {w.dtype} {tuple(w.shape)}")
    if not x.is_c_contiguous():
        raise ValueError(f"rmsnorm_q8k: x must be C-contiguous (its rows back to back), got strides {x.strides}")
    xq4 = xq.reshape(xq.size).view(np.uint32)
    flat_d, flat_b = xd.reshape(xd.size), xb.reshape(xb.size)
    flat_x = x.reshape(n * d)
    kern = rmsnorm_q8k_kernel(w is not None, bool(pdl))
    P.launch_or_plain(kern, grid(n, d), THREADS, stream, SIGNATURE, bool(pdl), flat_x, np.int32(d),
                      flat_x[:d] if w is None else w.reshape(d), np.float32(eps), xq4, flat_d, flat_b)
