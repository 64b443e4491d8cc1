"""A decode GEMV with the RMSNorm before it folded into its own prologue (a lab: EngineConfig.
decode_norm_fold, off).

A decode layer runs each norm as its own launch today: rmsnorm_q8 (engine/norm.py, 4 blocks)
writes the q8 blocks of h = rmsnorm(x) * w to global memory, and the GEMV after it reads them.
Under programmatic dependent launch that is one more link in the chain per norm - the norm's
wait, its loads of x, its reductions, its stores, its exit - 72 a step on Qwen3-4B, ~125 us of
the H200's 2.0 ms at depth 4,096 (docs/decode-step.md's ablation, 2026-12-05).

Here the consumer does it. Every block of the SwiGLU GEMV (gate and up streamed together,
gemv_kernels.make_pair_dot's trip) issues its rows' first trip of weight loads, waits for the
kernel before (the residual GEMV that wrote x), then computes the q8 of h itself into shared
memory - all of x (10 KB for 2,560 values, from L2) and the norm weight - and multiplies from
there. The norm's launch is gone, and so is one round trip: the q8 never goes through L2.

The same bits as rmsnorm_q8 and then gemv_swiglu:
  - the sum of squares in rmsnorm_q8's order at its block (norm_q8_device.make_norm_scale, the
    device code the GEMV's NORM tail uses);
  - h = x / s * w op for op, and q8_of_warp per 32 values (quantize_q8's own device function);
  - the units multiplied in make_pair_dot's order (gate's three of a trip, then up's).

Cost: each block reads x and w again (from L2; 10 KB each for the 4B) and pays the norm's two
block barriers; the GEMV's 2,432 blocks (the 4B's ffn) do that ~3 times an SM. Whether the chain
link it removes is worth that is what tools/profile_decode.py --settings fold measures.

Limits (else the launcher refuses and the engine keeps the two launches): one token, the pair
trip (`gemv_kernels.pairable`: dp4a, the same units a row), 32 lanes a row without a k-split,
and a row that make_norm_scale holds in registers (`applies`).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import pdl, ptx
from .gemv_formats import LOADERS, MULTIPLIERS, UNIT_SHIFT, loaders
from .gemv_kernels import ACTS, BLOCK, FULL, WARPS, _GELU_A, _GELU_S, _make_reduce, pairable
from .norm_q8_device import (STAGED_MAX_D, STAGED_MAX_VALUES, make_norm_scale, norm_block,
                             norm_scale_values, q8_of_warp)

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


@_dev
def xl_shared(a, i):
    """The GEMV multipliers' 16-byte activation load (their `xl`), from a shared array."""
    return a[i], a[i + 1], a[i + 2], a[i + 3]


def make_prenorm_q8(B: int, D: int, VB: int):
    """prenorm(x, w, eps, sxq, sxs): the q8 of h = rmsnorm(x) * w - rmsnorm_q8 at block VB, bit
    for bit - into shared memory, by a block of B threads (all of them call it, after the PDL
    wait: x is the kernel before's output). x float32 [D] flat (read coherently), w float32 [D],
    sxq uint32 [D / 4] (the int8 quants, four a word, little-endian as xq's bytes), sxs float32
    [D / 8] (quantize_q8's four floats a 32-value block). As the GEMV's staged NORM tail: h to
    shared memory first (the loops that hold x in registers have no shuffles, so they unroll),
    then the q8 of each 32 values by a warp. Ends with a barrier."""
    J = -(-VB // B)
    K = -(-D // VB)
    N = J * K
    scale = make_norm_scale(B, D, VB)

    @_dev
    def prenorm(x, w, eps, sxq, sxs):
        hs = cuda.shared.array(D, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        vals = cuda.local.array(N, float32)
        s = scale(x, eps, vals)                      # rmsnorm_q8's sum of squares, its order
        for j in range(J):                           # no shuffles here: unrolled, vals in registers
            for k in range(K):
                v = tid + j * B
                i = v + k * VB
                if v < VB and i < D:
                    hs[i] = float32(vals[j * K + k] / s * w[i])     # rmsnorm's value, op for op
        cuda.syncthreads()
        for i in range(tid, D, B):                   # warp k: 32 consecutive values, one q8 block
            q, d, sm, s_hi = q8_of_warp(hs[i])
            b = int32(q & 0xFF)
            b1 = cuda.shfl_down_sync(FULL, b, 1)
            b2 = cuda.shfl_down_sync(FULL, b, 2)
            b3 = cuda.shfl_down_sync(FULL, b, 3)
            if (lane & 3) == 0:
                sxq[i >> 2] = (uint32(b) | (uint32(b1) << uint32(8)) | (uint32(b2) << uint32(16))
                               | (uint32(b3) << uint32(24)))
            if lane == 0:                            # quantize_q8's layout (q8_store)
                o = (i >> 5) * 4
                sxs[o] = d
                sxs[o + 1] = d * float32(sm)
                sxs[o + 2] = d * float32(s_hi)
                sxs[o + 3] = d * float32(sm + s_hi)
        cuda.syncthreads()
    return prenorm


def applies(gate, up, rows: int, cols: int, ks: int, lpr: int) -> bool:
    """Whether the folded SwiGLU GEMV builds for these weights (gate / up = (qtype, mode)) and
    the plain launch's (ksplit, lanes a row)."""
    vb = norm_block(cols)
    return (pairable(gate, up, 1) and ks == 1 and lpr == 32 and rows > 0 and cols % 32 == 0
            and cols <= STAGED_MAX_D and norm_scale_values(BLOCK, cols, vb) <= STAGED_MAX_VALUES)


def covers(wg, wu) -> bool:
    """Whether gemv_swiglu_prenorm takes these GemvWeights (as the decode step launches them)."""
    from . import gemv as G
    if (wg.rows, wg.cols) != (wu.rows, wu.cols):
        return False
    ks, lpr = G._split_lanes(wg.rows, min(wg.units, wu.units), None, None)
    return applies(wg.spec, wu.spec, wg.rows, wg.cols, ks, lpr)


def swiglu_prenorm_kernel(gate, up, D: int, ACT="silu", PDL=False, PIN=True):
    """h[r] = act(Wg n)[r] * (Wu n)[r], n = rmsnorm(x) * nw, one token; a block of 4 warps, a
    warp a row (gate and up streamed together). Arguments: (wa, wb, wc, wd, nu) of Wg and of Wu
    (gemv.prepare_weight's views), rows, x float32 [D], nw float32 [D], eps float32, h float32
    [rows]. PDL: the first trip's weight loads before griddepcontrol.wait (by ptx.ldw_v4 if
    PIN), the norm after it."""
    assert ACT in ACTS and pairable(gate, up, 1), (gate, up)
    qa, qb = gate[0], up[0]
    VB = norm_block(D)
    prenorm = make_prenorm_q8(BLOCK, D, VB)
    wait, launch_dependents, _ = pdl.hooks(PDL)
    load_a, load_b = loaders(PDL and PIN)[qa], loaders(PDL and PIN)[qb]
    late_a, late_b = LOADERS[qa], LOADERS[qb]
    mul_a, mul_b = MULTIPLIERS[(qa, "dp4a")](1, xl_shared), MULTIPLIERS[(qb, "dp4a")](1, xl_shared)
    SA, SB = UNIT_SHIFT[qa], UNIT_SHIFT[qb]
    MA, MB = (1 << SA) - 1, (1 << SB) - 1
    reduce = _make_reduce(2, 1, 32)
    GELU = ACT == "gelu"
    NQ, NS = D // 4, D // 8

    @_dev
    def trip(a0, a1, a2, b0, b1, b2, nu, u, step, sxq, sxs, acc):
        # make_pair_dot's order: the gate's three units, then the up's
        pa, pb = u & MA, u & MB
        ka, kb = u >> SA, u >> SB
        sa, sb = step >> SA, step >> SB
        if u < nu:
            mul_a(a0, ka, pa, sxs, sxq, sxs, D, acc, 0)
        if u + step < nu:
            mul_a(a1, ka + sa, pa, sxs, sxq, sxs, D, acc, 0)
        if u + 2 * step < nu:
            mul_a(a2, ka + 2 * sa, pa, sxs, sxq, sxs, D, acc, 0)
        if u < nu:
            mul_b(b0, kb, pb, sxs, sxq, sxs, D, acc, 1)
        if u + step < nu:
            mul_b(b1, kb + sb, pb, sxs, sxq, sxs, D, acc, 1)
        if u + 2 * step < nu:
            mul_b(b2, kb + 2 * sb, pb, sxs, sxq, sxs, D, acc, 1)

    @cuda.jit
    def swiglu_prenorm(ga, gb, gc, gd, nu, ua, ub, uc, ud, unu, rows, x, nw, eps, h):
        launch_dependents()
        sxq = cuda.shared.array(NQ, uint32)
        sxs = cuda.shared.array(NS, float32)
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        row = cuda.blockIdx.x * WARPS + warp
        base = min(row, rows - 1) * nu            # a spare warp of the last block loads a real row
        last = nu - 1
        step = 32
        u = lane
        i0, i1, i2 = base + min(u, last), base + min(u + step, last), base + min(u + 2 * step, last)
        a0, a1, a2 = load_a(ga, gb, gc, gd, i0), load_a(ga, gb, gc, gd, i1), load_a(ga, gb, gc, gd, i2)
        b0, b1, b2 = load_b(ua, ub, uc, ud, i0), load_b(ua, ub, uc, ud, i1), load_b(ua, ub, uc, ud, i2)
        wait()                                    # x: the kernel before's output
        prenorm(x, nw, eps, sxq, sxs)             # the whole block (a barrier inside)
        acc = cuda.local.array(2, float32)
        acc[0] = float32(0)
        acc[1] = float32(0)
        if row < rows:
            trip(a0, a1, a2, b0, b1, b2, nu, u, step, sxq, sxs, acc)
            u += 3 * step
            while u < nu:                         # rows longer than a trip: the read-only path
                i0, i1, i2 = base + u, base + min(u + step, last), base + min(u + 2 * step, last)
                c0, c1, c2 = late_a(ga, gb, gc, gd, i0), late_a(ga, gb, gc, gd, i1), late_a(ga, gb, gc, gd, i2)
                e0, e1, e2 = late_b(ua, ub, uc, ud, i0), late_b(ua, ub, uc, ud, i1), late_b(ua, ub, uc, ud, i2)
                trip(c0, c1, c2, e0, e1, e2, nu, u, step, sxq, sxs, acc)
                u += 3 * step
        reduce(acc, warp, lane, 0)
        if lane == 0 and row < rows:
            g = acc[0]
            if GELU:
                th = math.tanh(_GELU_S * g * (float32(1) + _GELU_A * g * g))
                h[row] = float32(0.5) * g * (float32(1) + th) * acc[1]
            else:
                h[row] = g / (float32(1) + math.exp(-g)) * acc[1]
    return kernel_cache.attach(swiglu_prenorm)


_W = "uint32[::1], uint32[::1], uint32[::1], uint16[::1], int64"
SIGNATURE = f"void({_W}, {_W}, int64, float32[::1], float32[::1], float32, float32[::1])"
_kernels: dict = {}


def gemv_swiglu_prenorm(wg, wu, x, nw, eps: float, h, *, stream=0, act="silu", pdl=None) -> None:
    """h = act(Wg n) * (Wu n) with n = rmsnorm(x) * nw, one launch: x float32 [1, cols] (the
    residual stream), nw float32 [cols], h float32 [1, rows]; the bits of rmsnorm_q8 (at its
    default block) then gemv_swiglu. Refuses (ValueError) what `applies` does not cover."""
    from . import gemv as G
    wg, wu = G._prepared(wg), G._prepared(wu)
    if act not in ACTS:
        raise ValueError(f"gemv_swiglu_prenorm: act must be one of {ACTS}, got {act!r}")
    if (wg.rows, wg.cols) != (wu.rows, wu.cols):
        raise ValueError(f"gemv_swiglu_prenorm: gate {wg.rows}x{wg.cols} and up {wu.rows}x{wu.cols} differ")
    cols, rows = wg.cols, wg.rows
    G._check_array(x, "x", np.float32, (1, cols))
    G._check_array(nw, "the norm weight", np.float32, (cols,))
    G._check_out(h, "h", 1, rows, x)
    ks, lpr = G._split_lanes(rows, min(wg.units, wu.units), None, None)
    if not applies(wg.spec, wu.spec, rows, cols, ks, lpr):
        raise ValueError(f"gemv_swiglu_prenorm: {wg.qtype.name}/{wu.qtype.name} [{rows}, {cols}] is not "
                         "covered (one token, the paired dp4a trip, 32 lanes a row, a row the norm "
                         "holds in registers): use rmsnorm_q8 and gemv_swiglu")
    use_pdl = G._pdl(pdl)
    key = (wg.spec, wu.spec, cols, act, use_pdl, G.PDL_PIN_WEIGHTS)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = swiglu_prenorm_kernel(wg.spec, wu.spec, cols, act, use_pdl, G.PDL_PIN_WEIGHTS)
    G._launch(kern, -(-rows // WARPS), stream, use_pdl, SIGNATURE, *G._w_args(wg), *G._w_args(wu), rows,
              G._flat(x), nw, np.float32(eps), G._flat(h))
