"""Device code of "RMSNorm -> q8 activations", shared by every kernel that ends with it.

Two families write the 8-bit activations (xq, xs) of a normalised row h = rmsnorm(x) * w
that the dp4a GEMVs read (quant/gemv.py):
    engine/norm.py       rmsnorm_q8: one block per row
    engine/post_norm.py  Gemma 3's post-norm + add, then the next norm's q8
They must give the same bits, so they share these device functions:

- `q8_of_warp`: q8 of one 32-value block, one value per lane (quantize_q8_kernel's own);
- `block_sum`: a block-wide float32 sum (warp butterflies, then across warps through
  shared memory) - its order of additions fixes the rounding of the sum of squares, so
  rmsnorm_q8 is bit-identical to rmsnorm + quantize_q8 only at the same block size;
- `q8_write`, `q8_put`, `q8_store`: the store of a warp's q8 block (flat xq / xs), q8_of_warp
  then that store, and the same into row r of 2-D xq / xs (quantize_q8_kernel's layout);
- `q8k_scale`, `q8k_round`: q8_K's arithmetic (a scale a 256 values, gemv_mma_k.quantize_q8k),
  shared by quant/quantize_q8k.rmsnorm_q8k and kvcache/attention_merge.merge_q8k, whose bits must
  both be the reference's.
(The norm folded into the last block of the residual GEMV before it, which reproduced
rmsnorm_q8's order of additions at any block size, was measured slower and removed:
docs/decode-step.md 6.)

Deliberately not here: launches, argument checks (engine/norm.py, quant/gemv.py).
This module imports nothing from engine/ (engine/norm.py imports it; quant must not import
engine at module import where that would be a cycle).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int8, int32

from . import ptx   # simulator: installs warp shuffles

FULL = 0xFFFFFFFF                     # shuffle mask: the whole warp
RINT = np.float32(12582912.0)         # 1.5 * 2**23: (v + RINT) - RINT rounds to nearest even

if ptx.SIMULATOR:
    _inline = cuda.jit(device=True)
else:
    _inline = cuda.jit(device=True, forceinline=True)


def norm_block(d: int) -> int:
    """engine/norm.py's default threads per row: one per 4 elements, a multiple of 32, at
    most 1024 (the decode step's norms run at this block; the fused GEMV reproduces it)."""
    return int(min(1024, max(32, 32 * -(-d // 128))))


@_inline
def q8_of_warp(v):
    """q8 of one 32-value block held by a warp, one value per lane (all 32 lanes call):
    returns (q, d, s, s_hi): this lane's quant q = rint(v * 127 / amax) in -127..127, the
    block's scale d = amax / 127, s = sum of q over this lane's 16-lane half, and s_hi
    (meaningful on lane 0) the other half's sum."""
    a = abs(v)
    for off in (16, 8, 4, 2, 1):
        a = max(a, cuda.shfl_xor_sync(FULL, a, off))
    inv = float32(127) / a if a > float32(0) else float32(0)
    q = int32((v * inv + RINT) - RINT)          # round to nearest even, exactly np.rint
    s = q
    for off in (8, 4, 2, 1):                    # sum over each 16-lane half
        s = int32(s + cuda.shfl_xor_sync(FULL, s, off))
    s_hi = cuda.shfl_xor_sync(FULL, s, 16)      # lane 0: the other half's sum
    return q, a / float32(127), s, s_hi


@_inline
def q8k_scale(a):
    """(xd, inv) of a q8_K block whose largest |value| is a: xd = a / 127, inv = 1 / xd (0 for an
    all-zero block) - quantize_q8k's float32 operations."""
    scale = a / float32(127)
    return scale, (float32(1) / scale if a > float32(0) else float32(0))


@_inline
def q8k_round(v, inv):
    """int32 rint(v * inv), round half to even - np.rint of the float32 product: the product is
    rounded on its own (mul.rn; NVVM would otherwise contract it and the rounding add into an FMA)."""
    return int32((ptx.mul_rn(v, inv) + RINT) - RINT)


@cuda.jit(device=True)
def block_sum(v, sh):
    """Block-wide float32 sum; every thread gets it. sh: shared float32[32]."""
    lane = cuda.threadIdx.x & 31
    nw = cuda.blockDim.x >> 5
    off = 16
    while off > 0:
        v += cuda.shfl_xor_sync(FULL, v, off)
        off >>= 1
    if nw == 1:
        return v
    if lane == 0:
        sh[cuda.threadIdx.x >> 5] = v
    cuda.syncthreads()
    v = sh[lane] if lane < nw else float32(0)
    off = 16
    while off > 0:
        v += cuda.shfl_xor_sync(FULL, v, off)
        off >>= 1
    cuda.syncthreads()                 # sh may be reused right after
    return v


@cuda.jit(device=True)
def q8_write(q, d, s, s_hi, i, xq, xs):
    """Store q8_of_warp's (q, d, s, s_hi) of x[i] into flat xq int8 [n] / xs float32 [n / 8]:
    the lane's quant, and lane 0 of the block its 4 floats (quantize_q8_kernel's layout)."""
    xq[i] = int8(q)
    if (i & 31) == 0:
        b = (i >> 5) * 4
        xs[b] = d
        xs[b + 1] = d * float32(s)
        xs[b + 2] = d * float32(s_hi)
        xs[b + 3] = d * float32(s + s_hi)


@cuda.jit(device=True)
def q8_put(v, i, xq, xs):
    """q8 of x[i] = v by the whole warp (one q8 block, i % 32 == the lane's place in it) into
    flat xq / xs: the decode attention writes its output's q8 with it, as quantize_q8_kernel
    (q8_of_warp, then q8_write) would."""
    q, d, s, s_hi = q8_of_warp(v)
    q8_write(q, d, s, s_hi, i, xq, xs)


@cuda.jit(device=True)
def q8_store(v, xq, xs, r, i):
    """q8 of h[r, i] = v, all 32 lanes of the warp together (one q8 block): xq[r, i], and
    lane 0 of the block writes its 4 floats of xs (quantize_q8_kernel's layout)."""
    q, dq, t, t_hi = q8_of_warp(v)         # quantize_q8_kernel's own device function
    xq[r, i] = int8(q)
    if (i & 31) == 0:
        b = (i >> 5) * 4
        xs[r, b] = dq
        xs[r, b + 1] = dq * float32(t)
        xs[r, b + 2] = dq * float32(t_hi)
        xs[r, b + 3] = dq * float32(t + t_hi)
