"""Device code of "RMSNorm -> q8 activations", shared by every kernel that ends with it.

Three families write the 8-bit activations (xq, xs) of a normalised row h = rmsnorm(x) * w
that the dp4a GEMVs read (quant/gemv.py):
    engine/norm.py       rmsnorm_q8: one block per row
    engine/post_norm.py  Gemma 3's post-norm + add, then the next norm's q8
    quant/gemv_kernels.py  the residual GEMV that produces x, with the norm folded into
                         its last block (NORM; `make_norm_q8_tail` below)
They must give the same bits, so they share these device functions:

- `q8_of_warp`: q8 of one 32-value block, one value per lane (quantize_q8_kernel's own);
- `block_sum`: a block-wide float32 sum (warp butterflies, then across warps through
  shared memory) - its order of additions fixes the rounding of the sum of squares, so
  rmsnorm_q8 is bit-identical to rmsnorm + quantize_q8 only at the same block size;
- `q8_write`, `q8_put`, `q8_store`: the store of a warp's q8 block (flat xq / xs), q8_of_warp
  then that store, and the same into row r of 2-D xq / xs (quantize_q8_kernel's layout);
- `q8k_scale`, `q8k_round`: q8_K's arithmetic (a scale a 256 values, gemv_mma_k.quantize_q8k),
  shared by quant/quantize_q8k.rmsnorm_q8k and kvcache/attention_merge.merge_q8k, whose bits must
  both be the reference's;
- `make_norm_q8_tail`: rmsnorm_q8 of one row by a block of any size B, computing the sum of
  squares in the order a block of VB threads would (VB a runtime argument): B = 128 (the
  GEMV's block) reproduces rmsnorm_q8(block=VB) bit for bit, whatever VB.

Deliberately not here: launches, argument checks (engine/norm.py, quant/gemv.py).
This module imports nothing from engine/ (engine/norm.py imports it; quant must not import
engine at module import where that would be a cycle).
"""
from __future__ import annotations

import math

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


@_inline
def _virtual_warp_sum(ss, sh, v, lane):
    """block_sum's first stage for virtual thread v (whose lane is `lane`; the whole warp
    calls): the butterfly over its virtual warp; lane 0 stores the sum in sh[v >> 5]."""
    off = 16
    while off > 0:
        ss += cuda.shfl_xor_sync(FULL, ss, off)
        off >>= 1
    if lane == 0:
        sh[v >> 5] = ss


@_inline
def _virtual_total(sh, vb, lane):
    """block_sum's second stage as a block of vb threads runs it: the vb / 32 warp sums in sh
    reduced by one more butterfly (at vb = 32, sh[0] itself). The whole warp calls."""
    nw = vb >> 5
    if nw == 1:
        return sh[0]
    tot = sh[lane] if lane < nw else float32(0)
    off = 16
    while off > 0:
        tot += cuda.shfl_xor_sync(FULL, tot, off)
        off >>= 1
    return tot


STAGED_MAX_D = 4096                  # widest row the staged tail holds in shared memory
STAGED_MAX_VALUES = 32                # most values of y one thread holds in registers there


def make_norm_q8_tail(B: int, WRITE_H: bool, D: int = 0, VB: int = 0):
    """The tail below; with the row width D and the norm block VB known at compile time (and
    D <= STAGED_MAX_D, ceil(VB / B) * ceil(D / VB) <= STAGED_MAX_VALUES) the staged one:
    `_make_staged_tail`, the same bits without a load waiting for the one before."""
    if D and VB and D <= STAGED_MAX_D and -(-VB // B) * -(-D // VB) <= STAGED_MAX_VALUES:
        return _make_staged_tail(B, WRITE_H, D, VB)
    return _make_loop_tail(B, WRITE_H)


def norm_scale_values(B: int, D: int, VB: int) -> int:
    """Length of make_norm_scale's `vals` array: the values of y one of B threads holds."""
    return -(-VB // B) * -(-D // VB)


def make_norm_scale(B: int, D: int, VB: int):
    """scale(y, eps, vals) -> s = sqrt(sum(y^2) / D + eps), every thread of a block of B
    (the whole block calls), the sum in rmsnorm_q8's order at block VB - so h = y / s * w
    is rmsnorm_q8's value bit for bit. y float32 [D] flat, read with ld.relaxed.gpu (other
    blocks of the same launch may have written it). vals: a local float32 array of
    norm_scale_values(B, D, VB) that receives this thread's values of y (virtual thread
    v = t + B j, element v + VB k at [j * K + k]; 0 past D), for a caller that needs them.

    1. every load of this thread's values, issued together into registers (loops without
       shuffles: unrolled, so the array is registers; the PTX tests refuse local memory);
    2. each virtual thread's sum of squares, in rmsnorm_q8's order, into shared memory;
    3. the butterflies of each virtual warp, from shared memory, as block_sum does."""
    assert B % 32 == 0 and D % 32 == 0 and VB % 32 == 0
    J = -(-VB // B)                   # virtual threads per physical thread
    K = -(-D // VB)                   # values per virtual thread

    @_inline
    def scale(y, eps, vals):
        sh = cuda.shared.array(32, float32)
        sv = cuda.shared.array(VB, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        for j in range(J):                         # 1. all loads in flight together
            for k in range(K):
                v = tid + j * B
                i = v + k * VB
                vals[j * K + k] = ptx.ld_relaxed_f32(y, i) if v < VB and i < D else float32(0)
        for j in range(J):                         # 2. virtual thread v's sum, from 0, in order
            v = tid + j * B
            if v < VB:
                ss = float32(0)
                for k in range(K):
                    a = vals[j * K + k]            # 0 past D: ss + 0 * 0 is ss
                    ss += a * a
                sv[v] = ss
        cuda.syncthreads()
        v = tid
        while v < VB:                              # 3. warp-uniform (VB % 32 == 0)
            _virtual_warp_sum(sv[v], sh, v, lane)
            v += B
        cuda.syncthreads()
        return math.sqrt(_virtual_total(sh, VB, lane) / float32(D) + eps)
    return scale


def _make_staged_tail(B: int, WRITE_H: bool, D: int, VB: int):
    """tail(y, w, eps, d, vb, xq, xs, h) with d == D and vb == VB: make_norm_q8_tail's result
    in stages, so that no load of y waits for another and nothing spills: steps 1-3 are
    make_norm_scale's (the loads, the sum of squares in rmsnorm_q8's order), then
    4. h = y / s * w from the registers into shared memory (and h itself if WRITE_H);
    5. q8 of h per warp from shared memory (q8_store).
    The H200 (2026-12-03) measured the loop tail at ~16 us a launch: about 40 dependent L2
    round trips per thread for the 4B's 2,560 values; here there is one."""
    J = -(-VB // B)
    K = -(-D // VB)
    N = J * K
    scale = make_norm_scale(B, D, VB)

    @_inline
    def tail(y, w, eps, d, vb, xq, xs, h):
        hs = cuda.shared.array(D, float32)
        tid = cuda.threadIdx.x
        vals = cuda.local.array(N, float32)
        s = scale(y, eps, vals)                    # 1-3.
        for j in range(J):                         # 4. rmsnorm's value, op for op
            for k in range(K):
                v = tid + j * B
                i = v + k * VB
                if v < VB and i < D:
                    hv = float32(vals[j * K + k] / s * w[i])
                    hs[i] = hv
                    if WRITE_H:
                        h[0, i] = hv
        cuda.syncthreads()
        for i in range(tid, D, B):                 # 5. warp k: 32 consecutive values, one q8 block
            q8_store(hs[i], xq, xs, 0, i)
    return tail


def _make_loop_tail(B: int, WRITE_H: bool):
    """tail(y, w, eps, d, vb, xq, xs, h): what rmsnorm_q8(y[None], w, xq, xs, eps,
    block=vb, out=h if WRITE_H) computes, by a block of B threads (B a multiple of 32; the
    whole block calls it). y float32 [d] (flat, read with ld.relaxed.gpu: other blocks of
    the same launch wrote it), w float32 [d], d % 32 == 0, xq int8 [1, d], xs float32
    [1, d // 8], h float32 [1, d] (touched only if WRITE_H), vb % 32 == 0, 32 <= vb <= 1024.

    The order of additions is rmsnorm_q8's at block vb: virtual thread v < vb adds y[v],
    y[v + vb], ... from 0; virtual warp k = v >> 5 is reduced by block_sum's butterfly and
    lands in sh[k]; then, as in block_sum, sh[0..vb/32) is reduced by one more butterfly
    (or, at vb = 32, sh[0] is the sum). Physical thread t runs virtual threads t, t + B, ...
    (the same lane, virtual warps (t >> 5) + B/32 * j: warp-uniform since vb % 32 == 0).
    Pass 2 is element-wise (h = y / s * w, rounded to float32) and q8 per 32 consecutive
    values: independent of the order, so it runs at B."""
    assert B % 32 == 0

    @_inline
    def tail(y, w, eps, d, vb, xq, xs, h):
        sh = cuda.shared.array(32, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        v = tid
        while v < vb:                              # warp-uniform
            ss = float32(0)
            for i in range(v, d, vb):
                a = ptx.ld_relaxed_f32(y, i)
                ss += a * a
            _virtual_warp_sum(ss, sh, v, lane)
            v += B
        cuda.syncthreads()
        s = math.sqrt(_virtual_total(sh, vb, lane) / float32(d) + eps)
        for i in range(tid, d, B):                # warp k: 32 consecutive values, one q8 block
            hv = float32(ptx.ld_relaxed_f32(y, i) / s * w[i])    # rmsnorm's value, op for op
            if WRITE_H:
                h[0, i] = hv
            q8_store(hv, xq, xs, 0, i)
    return tail
