"""The int8 tensor-core GEMV for 1-16 tokens with an integer epilogue (lab, 2026-12-05).

Why. gemv_mma.py's kernel is flat in the tokens but issues 2.15x the dp4a GEMV's instructions
at one token (Nsight Compute, H100, 2026-12-05: 8.54 M against 3.97 M warp instructions for
ffn_gate, both at 0.58 issued a scheduler-cycle; docs/kernels/gemv.md 8b). Most of its extra
work is the float epilogue of every 32-weight sub-block: each integer dot is scaled by the
row's d * sc and the token's q8 scale, and dmin * m * (the token's scaled sum) is taken off -
~40 FP32 operations and 8 conversions a chunk, with 8 float loads of the token scales.

What changes. The activations come quantized per 256 values, as llama.cpp's q8_K: one scale xd
a token and 256-weight block, plus each 32-value sub-block's integer sum xb. Within a block the
row's d and dmin and the token's xd are then constants, so the sub-blocks add up as integers:

    y[t, r] = sum over blocks b of  xd[t, b] * (d[r, b] * S[r, t, b] - dmin[r, b] * M[r, t, b])
    S = sum_s sc[r, s] * dot(q[r, s], xq[t, s])     M = sum_s m[r, s] * xb[t, s]

(S, M int32: |S| <= 8 * 63 * 32 * 15 * 127 < 2^25, |M| <= 8 * 63 * 32 * 127). Which rows a
lane holds is gemv_mma.py's (see its docstring); the k order inside an mma differs: lane t's bytes
of chunk c (64 weights) are bytes 8 (t & 1) .. + 7 of unit 2c + (t >> 1) - weights 64c + 8t .. + 7
(low nibbles) and + 32 (high) - and its q8 values of token g the same positions, so each is one
8-byte load (`ptx.ldg_v2`) where gemv_mma reads two words.

A trip is one 256-weight block (since 2026-12-05 evening; before, two 64-weight chunks):
`make_block_parts` issues the block's 24 loads (4 chunks x 2 rows of weights, both rows' headers
once, token g's 256 q8 values, tokens 2t and 2t + 1's eight sub-block sums as two 16-byte loads
each, their two block scales), then its `block` decodes the rows' 6-bit scales once with constant
shifts, runs the four chunks' eight mma, and flushes the integer sums. The chunk trips loaded the
headers, sums and scales once a chunk and decoded the scales with selects: per 256 weights twice
the loads and 1.6x the instructions, at 110 registers against 66 (sm_90 ptxas). PIPE (default):
the next block's loads are issued before this block's multiplies (128 registers): the round trip
of a block overlaps the one before's arithmetic. The warps of a thread block split the row's
blocks; `plan_ksplit` picks how many.

Measured (H100, 2026-12-05, `python -m genie_rt.quant.gemv_mma_k`, weights cycling through 8
copies so they come from DRAM; docs/bench/gemv-mma-k-h100-2026-12-05b.json; us): the dp4a GEMV
at 1 / 8 tokens against this kernel at plan_ksplit's k-split - attn_q 5.01 / 19.14 against 5.66 /
6.45, ffn_gate 8.84 / 35.74 against 9.53 / 10.78, attn_output 5.18 / 19.54 against 6.64 / 7.62,
ffn_down 9.82 / 47.25 against 10.71 / 14.03. The chunk trips took 6.75 / 7.54, 12.89 / 14.04,
9.53 / 9.88 and 20.21 / 20.89 there (k-split 4). Eight tokens now cost 1.2-1.5x what the dp4a
GEMV takes for one (and 1.1-1.4x this kernel's own one-token time); at one token the dp4a GEMV
stays 8-28 % faster.

The q8_K activations lie tiled on the device (quant/q8k_layout.py): tokens in groups of TILE = 8,
and within a group each 32-value sub-block's 8 rows of 32 bytes back to back (the sums and scales
likewise a block at a time), so a warp's load of 8 tokens' bytes of one sub-block reads two
128-byte lines where row-major rows took eight (the kernel was L1-bound: docs/kernels/gemv.md 8i).
The group's size is a constant, so every load's offset from the block's first word is an
immediate. 9-24 % faster at 8 tokens on an H100 (2026-12-06, 8j).

W16 (the default for Q4_K up to 8 tokens since 2026-12-06): a lane loads a Q4_K row's quants 16
bytes at a time, two loads a block instead of four, and lanes t and t ^ 2 swap halves by two
shuffles before the multiply (`split16`): 6-15 % faster unpipelined at 8 tokens on an H100
(docs/kernels/gemv.md 8k). Its pipelined build holds 164 registers and lost.

The price is the activation's quantization: one scale for 256 values instead of 32 (q8_K, what
llama.cpp's CPU K-quant dot products use). `quantize_q8k` (quant/q8k_layout.py) is its numpy reference, and
quant/quantize_q8k.py's `rmsnorm_q8k` the device's (RMSNorm and q8_K in one launch, a block a row).

Up to 16 tokens (NT 16): a second B fragment, tokens 8 + g, against the same A fragments (160
registers, 255 with PIPE: a thread block fits 12 or 8 warps; above 8 tokens `gemv_mma_k` takes the
unpipelined build and at most 4 warps, the sweep's fastest). On the same H100: 8.5 / 14.7 / 11.0 / 20.7 us for the four shapes at 16 tokens
(DRAM) - against the engine's MMQ GEMM at 16 rows no faster; at 8 rows ~25 % faster for attn_q,
attn_output and gate/up, the same for ffn_down (docs/kernels/gemv.md 8d).

Q6_K weights (attn_v and half the ffn_down of a Q4_K_M file) take quant/gemv_mma_q6k.py's build
of the same kernel (m16n8k16: a Q6_K scale covers 16 weights); `gemv_mma_k` picks by format.

Status: checked in the simulator (tests/test_gemv_mma_k.py, test_gemv_mma_q6k.py), the Q4_K build
timed on the H100 and H200 (above), the Q6_K one not yet. Used by the short prefill
(engine/cuda_short_prefill.py, EngineConfig.short_prefill: a lab switch, off), not by decode.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .formats import QType
from .gemv_mma import LO4, ROWS, _dev, _flat, lanes, make_block_loop, make_finish
from .pdl import triggers as pdl_triggers
from .pdl import weight_loads as pdl_weight_loads
from .gemv_mma_q6k import SIGNATURE as SIGNATURE_Q6K
from .gemv_mma_k_w16 import _bases16, split16
from .q8k_layout import (QK, SUB, TILE, dequantize_q8k, quantize_q8k, sizes, tile_blocks, tile_q8k,  # noqa: F401
                         tiled, untile_q8k, untiled, xd_base, xq_size, xq_word)
from . import gemv_mma_q6k as Q6
from .gemv_mma_q6k import mma_q6k_q8k_kernel

SIGNATURE = ("void(uint32[::1], uint32[::1], int64, int64, uint32[::1], float32[::1], int32[::1], int64, "
             "int64, int64, float32[::1], float32[::1], int64)")
MAX_TOK = 16                # two B fragments


def quantize_q8k_tiled(x: np.ndarray):
    """quantize_q8k's (xq, xd, xb) as the device holds them (quant/q8k_layout.tiled): the GEMVs' inputs."""
    return tiled(*quantize_q8k(x))


@_dev
def _bases(nu, rr0, rr1, t, tb, cols):
    """The lane's first 32-bit word of rows rr0 and rr1 (chunk 0: unit 0 for lanes 0, 1, unit 1
    for lanes 2, 3; bytes 8 (t & 1) ..) and of token tb's q8 values of sub-block 0 (values 8 t ..;
    the tiled xq, `xq_word`), unsigned (no negative-index wrap-around code). The lane's 8 weights of
    a sub-block are then 8t .. 8t + 7 of its 32, and its 8 q8 values the same: one 8-byte load each."""
    off = uint32(4 * (t >> 1) + 2 * (t & 1))
    return (uint32(rr0 * nu * 4) + off, uint32(rr1 * nu * 4) + off, xq_word(tb, cols) + uint32(2 * t))


def make_weight_loads(PDL: bool = False, W16: bool = False):
    """weight_loads(wa, wb, nblk, rr0, rr1, wi0, wi1, blk): rows rr0 and rr1's part of block blk - the
    lane's 8 bytes of each of the block's four chunks (`_bases`' layout; 8 words a chunk) and both
    rows' headers, once a block. W16: two 16-byte loads a row instead of four 8-byte ones
    (`_bases16`: half the L1 wavefronts of the weights), raw - `split16` makes the four chunks. PDL: by ptx.ldw_v2 / ldw_v4, which stay above griddepcontrol.wait
    (ptxas sinks the read-only ldg below it: tests/test_pdl_sass.py), else read-only loads."""
    ld2, ld4 = pdl_weight_loads(PDL)
    if W16:
        @_dev
        def weight_loads16(wa, wb, nblk, rr0, rr1, wi0, wi1, blk):
            w = uint32(32) * uint32(blk)
            return ((ld4(wa, wi0 + w), ld4(wa, wi0 + w + uint32(16))),
                    (ld4(wa, wi1 + w), ld4(wa, wi1 + w + uint32(16))),
                    ld4(wb, uint32((rr0 * nblk + blk) * 4)), ld4(wb, uint32((rr1 * nblk + blk) * 4)))
        return weight_loads16

    @_dev
    def weight_loads(wa, wb, nblk, rr0, rr1, wi0, wi1, blk):
        w = uint32(32) * uint32(blk)
        a0 = ld2(wa, wi0 + w)
        a1 = ld2(wa, wi0 + w + uint32(8))
        a2 = ld2(wa, wi0 + w + uint32(16))
        a3 = ld2(wa, wi0 + w + uint32(24))
        b0 = ld2(wa, wi1 + w)
        b1 = ld2(wa, wi1 + w + uint32(8))
        b2 = ld2(wa, wi1 + w + uint32(16))
        b3 = ld2(wa, wi1 + w + uint32(24))
        return ((a0, a1, a2, a3), (b0, b1, b2, b3), ld4(wb, uint32((rr0 * nblk + blk) * 4)),
                ld4(wb, uint32((rr1 * nblk + blk) * 4)))
    return weight_loads


def make_token_loads(PDL: bool = False, W16: bool = False):
    """token_loads(xq, xd, xb, tok, nsb, nb, blk): eight tokens' part of block blk, tok = (okb, xi,
    da, dc): the B fragment's token (first word xi, `_bases`) - its q8 values of the four chunks,
    zero when okb is false - and the eight sub-block sums of the accumulators' tokens (two 16-byte
    loads each) with their block scales, da and dc those tokens' `xd_base` (quant/q8k_layout.py).
    W16: tok's fifth entry is the odd chunks' first word (`_bases16`).
    PDL: by coherent loads (another kernel wrote them: quant/pdl.py rule 3), else read-only ones."""
    ld2, ld4 = (ptx.ld_v2, ptx.ld_v4) if PDL else (ptx.ldg_v2, ptx.ldg_v4)

    @_dev
    def token_loads(xq, xd, xb, tok, nsb, nb, blk):
        okb, xi, da, dc = tok[0], tok[1], tok[2], tok[3]
        xo = xi + uint32(512) * uint32(blk)          # sub-block 8 blk (xq_word), values 8t ..
        xp = (tok[4] if W16 else xi) + uint32(512) * uint32(blk)   # the odd chunks' (W16: _bases16)
        z = (uint32(0), uint32(0))
        x0 = ld2(xq, xo) if okb else z
        x1 = ld2(xq, xo + uint32(64)) if okb else z
        x2 = ld2(xq, xp + uint32(128)) if okb else z
        x3 = ld2(xq, xp + uint32(192)) if okb else z
        x4 = ld2(xq, xo + uint32(256)) if okb else z
        x5 = ld2(xq, xo + uint32(320)) if okb else z
        x6 = ld2(xq, xp + uint32(384)) if okb else z
        x7 = ld2(xq, xp + uint32(448)) if okb else z
        b8 = uint32(8) * uint32(blk)
        ia = da + b8                                 # the tiled xd, xb (quant/q8k_layout.py)
        ic = dc + b8
        ja = uint32(8) * ia
        jc = uint32(8) * ic
        return ((x0, x1, x2, x3, x4, x5, x6, x7), (ld4(xb, ja), ld4(xb, ja + uint32(4))),
                (ld4(xb, jc), ld4(xb, jc + uint32(4))), xd[ia], xd[ic])
    return token_loads


def make_block_parts(NT: int = 8, PDL: bool = False, W16: bool = False):
    """(wloads, tloads, block) of a Q4_K build for up to NT (8 or 16) tokens, gemv_mma.make_block_loop's
    three: a block's 10 weight loads a lane (4 chunks x 2 rows, both rows' headers once), its 14
    token loads (NT 16: 28 - tokens 8 .. 15 are a second B fragment and a second set of sums against
    the same A fragments), and its mma and epilogue."""
    token_loads = make_token_loads(PDL, W16)
    weight_loads = make_weight_loads(PDL, W16)

    @_dev
    def wloads(wa, wb, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, tok2, nsb, nb, blk):
        return weight_loads(wa, wb, nblk, rr0, rr1, wi0, wi1, blk)

    if NT == 8:
        @_dev
        def tloads(wa, wb, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, tok2, nsb, nb, blk):
            return token_loads(xq, xd, xb, tok, nsb, nb, blk)

        @_dev
        def block(acc, W, X):
            _tokens(acc, 0, split16(W) if W16 else W, X)
    else:
        @_dev
        def tloads(wa, wb, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, tok2, nsb, nb, blk):
            return token_loads(xq, xd, xb, tok, nsb, nb, blk), token_loads(xq, xd, xb, tok2, nsb, nb, blk)

        @_dev
        def block(acc, W, X):
            Ws = split16(W) if W16 else W
            _tokens(acc, 0, Ws, X[0])
            _tokens(acc, 4, Ws, X[1])                # the same A fragments: the masks are shared
    return wloads, tloads, block


@_dev
def _byte(word, k):
    return int32((word >> (8 * k)) & 0xFF)


@_dev
def _scales8(h):
    """A Q4_K header's eight 6-bit scales and mins, packed four a word: (sc[0..3], sc[4..7],
    m[0..3], m[4..7]) (gemv_formats._k_scales' decode, once a block)."""
    return (h[1] & 0x3F3F3F3F, (h[3] & 0x0F0F0F0F) | ((h[1] >> 2) & 0x30303030),
            h[2] & 0x3F3F3F3F, ((h[3] >> 4) & 0x0F0F0F0F) | ((h[2] >> 2) & 0x30303030))


@_dev
def _chunk(acc, wr0, wr1, xv, xw, s0, s1, c):
    """Chunk c (a literal 0..3) of a block: its two mma (low nibbles: sub-block 2c, high: 2c + 1),
    scaled by the rows' 6-bit scales, added to the integer sums acc (S0..S3)."""
    ia = ptx.mma_s8_s32(wr0[0] & LO4, wr1[0] & LO4, wr0[1] & LO4, wr1[1] & LO4, xv[0], xv[1],
                        int32(0), int32(0), int32(0), int32(0))
    ib = ptx.mma_s8_s32((wr0[0] >> 4) & LO4, (wr1[0] >> 4) & LO4, (wr0[1] >> 4) & LO4, (wr1[1] >> 4) & LO4,
                        xw[0], xw[1], int32(0), int32(0), int32(0), int32(0))
    wq = s0[1] if c >= 2 else s0[0]                  # row 0's scales of sub-blocks 4 (c >= 2) ..
    wr = s1[1] if c >= 2 else s1[0]
    k = 2 * (c & 1)
    sa0, sb0, sa1, sb1 = _byte(wq, k), _byte(wq, k + 1), _byte(wr, k), _byte(wr, k + 1)
    # (int32() around each sum: numba widens int32 products to int64; truncated, LLVM keeps 32 bits)
    return (int32(acc[0] + sa0 * ia[0] + sb0 * ib[0]), int32(acc[1] + sa0 * ia[1] + sb0 * ib[1]),
            int32(acc[2] + sa1 * ia[2] + sb1 * ib[2]), int32(acc[3] + sa1 * ia[3] + sb1 * ib[3]))


@_dev
def _mins(m, sums):
    """sum over the block's eight sub-blocks of m[s] * sums[s] (m: two words of 6-bit mins,
    sums: two int32 4-tuples)."""
    a, b = sums
    return int32(_byte(m[0], 0) * a[0] + _byte(m[0], 1) * a[1] + _byte(m[0], 2) * a[2] + _byte(m[0], 3) * a[3]
                 + _byte(m[1], 0) * b[0] + _byte(m[1], 1) * b[1] + _byte(m[1], 2) * b[2] + _byte(m[1], 3) * b[3])


@_dev
def _tokens(acc, k0, W, T):
    """One B fragment's eight tokens of block (W, T) (`make_weight_loads`, `make_token_loads`) into the
    float accumulators acc[k0 .. k0 + 3]: the four chunks' integer sums, then xd * (d S - dmin M)."""
    wr0, wr1, h0, h1 = W
    xv, sa, sc, xd0, xd1 = T
    s0 = _scales8(h0)
    s1 = _scales8(h1)
    z = int32(0)
    si = (z, z, z, z)
    si = _chunk(si, wr0[0], wr1[0], (xv[0][0], xv[0][1]), (xv[1][0], xv[1][1]), (s0[0], s0[1]), (s1[0], s1[1]), 0)
    si = _chunk(si, wr0[1], wr1[1], (xv[2][0], xv[2][1]), (xv[3][0], xv[3][1]), (s0[0], s0[1]), (s1[0], s1[1]), 1)
    si = _chunk(si, wr0[2], wr1[2], (xv[4][0], xv[4][1]), (xv[5][0], xv[5][1]), (s0[0], s0[1]), (s1[0], s1[1]), 2)
    si = _chunk(si, wr0[3], wr1[3], (xv[6][0], xv[6][1]), (xv[7][0], xv[7][1]), (s0[0], s0[1]), (s1[0], s1[1]), 3)
    m0 = (s0[2], s0[3])
    m1 = (s1[2], s1[3])
    dm0 = ptx.unpack_half2(h0[0])
    dm1 = ptx.unpack_half2(h1[0])
    acc[k0] += xd0 * (dm0[0] * float32(si[0]) - dm0[1] * float32(_mins(m0, sa)))
    acc[k0 + 1] += xd1 * (dm0[0] * float32(si[1]) - dm0[1] * float32(_mins(m0, sc)))
    acc[k0 + 2] += xd0 * (dm1[0] * float32(si[2]) - dm1[1] * float32(_mins(m1, sa)))
    acc[k0 + 3] += xd1 * (dm1[0] * float32(si[3]) - dm1[1] * float32(_mins(m1, sc)))


def make_trips(NW: int, NT: int = 8, PIPE: bool = True, PDL: bool = False, W16: bool = False):
    """trips(acc, wa, wb, wc, wd, nu, rows, tile, warp, lane, xq, xd, xb, cols, n_tok): warp `warp`'s
    share of the 256-weight blocks of the Q4_K rows tile * 16 .. + 15, added into acc (NT // 2
    floats, the layout `make_finish` reads). wc, wd are not read (the Q6_K build's slots:
    gemv_mma_q6k.make_trips takes the same arguments, so one kernel can hold both,
    quant/gemv_mma_qkv.py). NW warps split the blocks; PIPE and NT: see the module; PDL: the
    first block's weight loads (ldw: they stay above it), then griddepcontrol.wait, then the rest, the
    later blocks' weights by read-only loads (gemv_mma.make_block_loop's wrest). W16: the weights by
    16-byte lane loads (`make_weight_loads`, `split16`)."""
    run = make_block_loop(*make_block_parts(NT, PDL, W16), PIPE, PDL,
                          wrest=make_block_parts(NT, False, W16)[0] if PDL else None)

    @_dev
    def trips(acc, wa, wb, wc, wd, nu, rows, tile, warp, lane, xq, xd, xb, cols, n_tok):
        g, t, rr0, rr1, nblk, b_lo, b_hi, tb, ta, tc, tb2, ta2, tc2 = lanes(tile, warp, lane, rows, nu, n_tok, NW)
        nsb = cols >> 5
        nb = cols >> 8
        if W16:
            wi0, wi1, xi, xj = _bases16(nu, rr0, rr1, t, tb, cols)
            xi2 = xq_word(tb2, cols) + (xi - xq_word(tb, cols))
            tok = (g < n_tok, xi, xd_base(ta, nb), xd_base(tc, nb), xj)
            tok2 = (g + 8 < n_tok, xi2, xd_base(ta2, nb), xd_base(tc2, nb), xi2 ^ uint32(2))
        else:
            wi0, wi1, xi = _bases(nu, rr0, rr1, t, tb, cols)
            tok = (g < n_tok, xi, xd_base(ta, nb), xd_base(tc, nb))
            tok2 = (g + 8 < n_tok, xq_word(tb2, cols) + uint32(2 * t), xd_base(ta2, nb), xd_base(tc2, nb))
        run(acc, (wa, wb, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, tok2, nsb, nb), b_lo, b_hi, nblk)
    return trips


@functools.lru_cache(maxsize=None)
def mma_q4k_q8k_kernel(KSPLIT: int = 4, PIPE: bool = True, NT: int = 8, PDL: int = 0, W16: bool = False):
    """y[t, r] = sum_c W[r, c] x[t, c] (+ res[t, r]) for t < n_tok <= NT (8 or 16), x as q8_K; grid
    ceil(rows / 16) blocks of 32 * KSPLIT threads (KSPLIT 1..16), warp w taking the row's 256-weight
    blocks [w * ceil(nblk / KSPLIT), ..). Arguments: wa, wb, nu, rows (the Q4_K GEMV planes), xq
    (uint32 words of int8), xd (float32), xb (int32) - q8_K, tiled (quant/q8k_layout.py: whole groups of
    8 tokens), cols, n_tok, ldy, y (float32, token t's row at t * ldy), res (the same layout),
    resid. PIPE: see the module. NT 16: a second B fragment (tokens 8 + g) against the same A
    fragments, eight accumulators a lane. PDL (quant/pdl.build): 0 plain; 1 a programmatic-dependent-launch
    build (sm_90; quant/pdl.py): launch_dependents first, the first block's weights loaded before the
    wait; 2 the same with the trigger after the last trip (quant/pdl.TRIGGER_LATE)."""
    if NT not in (8, 16):
        raise ValueError(f"mma_q4k_q8k_kernel: NT {NT} must be 8 or 16")
    NW = KSPLIT
    NACC = NT // 2
    finish = make_finish(NW, NACC)
    trips = make_trips(NW, NT, PIPE, PDL, W16)
    trigger_first, trigger_late = pdl_triggers(PDL)

    @cuda.jit
    def kernel(wa, wb, nu, rows, xq, xd, xb, cols, n_tok, ldy, y, res, resid):
        trigger_first()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        acc = cuda.local.array(NACC, float32)        # k: row g + 8 ((k >> 1) & 1), token 2t + (k & 1) + 8 (k >> 2)
        for k in range(NACC):
            acc[k] = float32(0)
        trips(acc, wa, wb, wa, wb, nu, rows, cuda.blockIdx.x, warp, lane, xq, xd, xb, cols, n_tok)
        trigger_late()
        finish(acc, warp, lane, cuda.blockIdx.x * ROWS + (lane >> 2), 2 * (lane & 3), rows, ldy, n_tok, y, res,
               resid)
    return kernel_cache.attach(kernel)


def plan_ksplit(rows: int, cols: int, n_tok: int = 8, warps: int = 1024) -> int:
    """The warps a thread block splits a row's 256-weight blocks over: the larger of the largest
    power of two that keeps the grid within ~`warps` warps (warps / the 16-row tiles) and the
    smallest that leaves a warp at most ~5 blocks, within 2..8 (2..4 above 8 tokens), then as few
    warps as give each the same count of blocks. From the H100's sweeps of 2026-12-05 (module
    docstring), weights from DRAM: within ~4 % of the sweep's best k-split at every shape for 1-8
    tokens (pipelined), within 6 % at 16 (unpipelined; the timings repeat within ~5 %)."""
    tiles, nblk = max(1, -(-rows // ROWS)), max(1, cols // QK)
    by_grid = 1
    while by_grid * 2 * tiles <= warps:
        by_grid *= 2
    by_len = 1
    while by_len * 5 < nblk:
        by_len *= 2
    ks = min(max(2, min(8 if n_tok <= 8 else 4, max(by_grid, by_len))), nblk)
    per = -(-nblk // ks)
    return -(-nblk // per)                           # no warp without a block


_FITS: dict = {}
REGS_PER_BLOCK = 65536      # the register file a thread block may use (sm_80 .. sm_90)


def _fits(kern, signature: str, key: tuple) -> None:
    """Refuse a k-split whose thread block needs more registers than a block may have (the NT 16
    builds: 160 registers a thread without PIPE, 255 with it on sm_90 - 12 and 8 warps at most;
    the H100 refused 13), once a build, before the driver's CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES.
    Registers are allocated a warp at a time in units of 256: a thread's count rounds up to 8.
    key: (format, ksplit, pipe, nt, pdl[, the build's other parameters])."""
    qname, ksplit, pipe, nt = key[:4]
    if key not in _FITS:
        kern.compile(signature)                      # the launch's own specialisation (flat arrays)
        regs = -(-max(kern.get_regs_per_thread().values()) // 8) * 8
        _FITS[key] = (True if regs * 32 * ksplit <= REGS_PER_BLOCK
                      else f"{regs} registers a thread x {32 * ksplit} threads > {REGS_PER_BLOCK}")
    if _FITS[key] is not True:
        raise ValueError(f"gemv_mma_k: {qname} k-split {ksplit} with pipe={pipe} for {nt} tokens does not fit a "
                         f"thread block ({_FITS[key]}); take a smaller ksplit")


FORMATS = (QType.Q4_K, QType.Q6_K)


def default_pipe(qtype, n_tok: int, w16: bool = False) -> bool:
    """Whether a build issues the next block's loads before this block's multiplies (PIPE): for
    Q4_K up to 8 tokens by 8-byte weight loads. Not above 8 (the 16-token build holds two blocks'
    loads in 255 registers, and was slower so), not for Q6_K (its pipelined build, 158 registers
    against ~100, was slower at every k-split on an H100, 2026-12-06: ffn_down 25.3 us at the
    planned k-split 8 against 19.4 unpipelined, attn_v 5.4 against 4.9; docs/kernels/gemv.md 8h), and
    not with W16 (164 registers pipelined against 96; slower at every shape, 8k)."""
    return n_tok <= 8 and qtype == QType.Q4_K and not w16


def default_w16(qtype, n_tok: int) -> bool:
    """Whether a build loads a Q4_K weight's quants 16 bytes a lane (W16, `make_weight_loads`): up to
    8 tokens; a Q6_K weight's (gemv_mma_q6k.make_row_loads) where the knob gemv_mma_q6k.W16 is on (the default).
    Unpipelined at its k-split (`plan_ksplit` with 2,048 warps) the Q4_K build beat the pipelined
    8-byte build at every Q4_K shape of the 4B (H100, 2026-12-06, three calls; 8 tokens, weights from
    DRAM, us): attn_q 5.18-5.21 against 5.50-5.53, ffn_gate 8.52-8.54 (k-split 4; the plan's 2 gave
    9.09) against 9.77-9.88, attn_output 5.67-5.77 against 6.65-6.73, ffn_down 10.18-10.32 against
    10.85-10.96 (docs/kernels/gemv.md 8k)."""
    return n_tok <= 8 and (qtype == QType.Q4_K or (qtype == QType.Q6_K and Q6.W16))


def default_build(w, n_tok: int, ksplit=None, pipe=None, w16=None) -> tuple:
    """(ksplit, pipe, w16) of gemv_mma_k for GemvWeight w at n_tok tokens: each None takes its
    default (`default_w16`, `default_pipe`, `plan_ksplit` - with twice the warps for the W16
    unpipelined build, which holds no next block in registers)."""
    q4 = w.qtype == QType.Q4_K
    w16 = default_w16(w.qtype, n_tok) if w16 is None else bool(w16)
    pipe = default_pipe(w.qtype, n_tok, w16) if pipe is None else bool(pipe)
    if ksplit is None:   # (a Q6_K build is unpipelined either way: the 8-byte build's plan, loads aside)
        ksplit = plan_ksplit(w.rows, w.cols, n_tok, warps=2048 if w16 and not pipe and q4 else 1024)
    return ksplit, pipe, w16


def q8k_inputs(who: str, weights, xq, xd, xb, n_tok: int, cols: int, read_xb: bool, w16: bool = False,
               w16q6: bool = False):
    """The q8_K activations as the mma GEMV kernels read them - (xq as uint32 words, xd, xb), flat -
    after the checks every launcher makes: sizes (tiled: quant/q8k_layout.sizes) and dtypes (xb where read_xb: a Q4_K build reads
    it, None is refused), then on a GPU the start of every plane read by vector loads (xq 8 bytes
    where xb is read - the Q4_K builds' 8-byte loads - else 4; xb 16; each weight's: Q4_K quants 8
    (16 for w16), Q6_K scales 16, and its ql and qh 16 for w16q6)."""
    nq, nd, nsum = sizes(n_tok, cols)                     # the tiled layout's (quant/q8k_layout.py)
    xq = _flat(xq, np.int8, nq, "xq", who).view(np.uint32)
    xd = _flat(xd, np.float32, nd, "xd", who)
    if read_xb:
        if xb is None:
            raise ValueError(f"{who}: a Q4_K weight reads xb (the 32-value sums of quantize_q8k); got None")
        xb = _flat(xb, np.int32, nsum, "xb", who)
    if not ptx.SIMULATOR:
        planes = [("xq", xq, 8 if read_xb else 4)] + ([("xb", xb, 16)] if read_xb else [])
        for w in weights:
            if w.qtype == QType.Q4_K:
                planes.append((f"the {w.qtype.name} weight's quants plane", w.wa, 16 if w16 else 8))
            else:
                planes.append((f"the {w.qtype.name} weight's scales plane", w.wc, 16))
                if w16q6:
                    planes += [(f"the {w.qtype.name} weight's ql plane", w.wa, 16),
                               (f"the {w.qtype.name} weight's qh plane", w.wb, 16)]
        for name, a, align in planes:
            if a.__cuda_array_interface__["data"][0] % align:
                raise ValueError(f"{who}: {name} must start on a {align}-byte boundary")
    return xq, xd, xb


def gemv_mma_k(w, xq, xd, xb, y, n_tok: int, residual=None, ksplit: int | None = None, stream=0,
               pipe: bool | None = None, ldy: int | None = None, pdl: bool = False, w16: bool | None = None) -> None:
    """y [n_tok, rows] = x W^T (+ residual) for a Q4_K or Q6_K GemvWeight `w`
    (gemv.prepare_weight, dp4a mode) and q8_K activations xq int8, xd float32, xb int32 as the device
    holds them (tiled, whole groups of 8 tokens: quant/q8k_layout.py; `quantize_q8k_tiled`;
    a Q6_K weight does not read
    xb, which may then be None); 1 <= n_tok <= 16 (above 8: the NT 16 build). ksplit: warps a
    thread block (1..16), pipe: the kernel's PIPE, w16: the quants by 16-byte lane loads
    (`make_weight_loads`; Q6_K: gemv_mma_q6k.make_row_loads) - each None: `default_build` (up to 8
    tokens a Q4_K weight takes W16 unpipelined, a Q6_K one the unpipelined build, W16 where the
    knob gemv_mma_q6k.W16 is on, the default). Q6_K:
    quant/gemv_mma_q6k.py. ldy: y (and residual) hold token t's row at t * ldy of a 1-D array of
    at least (n_tok - 1) * ldy + rows values - a column slice of a wider buffer, e.g. q's columns of
    [q | k | v] (None: y is [n_tok, rows]). pdl: the programmatic-dependent-launch build and launch
    (sm_90+ only: the caller checks quant/pdl.available(); the simulator runs it plainly). No
    allocation, no synchronization."""
    from . import pdl as P
    if w.qtype not in FORMATS:
        raise ValueError(f"gemv_mma_k: only Q4_K and Q6_K weights (got {w.qtype.name})")
    if not 1 <= n_tok <= MAX_TOK:
        raise ValueError(f"gemv_mma_k: n_tok {n_tok} must be 1..{MAX_TOK}")
    ksplit, pipe, w16 = default_build(w, n_tok, ksplit, pipe, w16)
    if not 1 <= ksplit <= 16:
        raise ValueError(f"gemv_mma_k: ksplit {ksplit} must be 1..16")
    rows, cols = w.rows, w.cols
    q6 = w.qtype == QType.Q6_K
    xq, xd, xb = q8k_inputs("gemv_mma_k", (w,), xq, xd, xb, n_tok, cols, read_xb=not q6, w16=w16 and not q6,
                            w16q6=w16 and q6)
    if ldy is None:
        ldy = rows
        yf = _flat(y, np.float32, n_tok * rows, "y", "gemv_mma_k")
        rf = yf if residual is None else _flat(residual, np.float32, n_tok * rows, "residual", "gemv_mma_k")
    else:
        span = (n_tok - 1) * ldy + rows
        for name, a in (("y", y), ("residual", y if residual is None else residual)):
            if ldy < rows or a.ndim != 1 or a.dtype != np.float32 or a.size < span:
                raise ValueError(f"gemv_mma_k: with ldy {ldy} (>= rows {rows}), {name} must be 1-D float32 with "
                                 f"at least {span} values, got {a.dtype} {tuple(a.shape)}")
        yf, rf = y, y if residual is None else residual
    nt = 8 if n_tok <= 8 else 16
    grid, block = (rows + ROWS - 1) // ROWS, 32 * ksplit
    resid = int(residual is not None)
    pdl = bool(pdl)
    build = P.build(pdl)
    if q6:
        kern = mma_q6k_q8k_kernel(ksplit, bool(pipe), nt, build, w16)
        if not ptx.SIMULATOR:
            _fits(kern, SIGNATURE_Q6K, ("Q6_K", ksplit, bool(pipe), nt, build, w16))
        P.launch_or_plain(kern, grid, block, stream, SIGNATURE_Q6K, pdl, w.wa, w.wb, w.wc, w.wd, w.units, rows,
                          xq, xd, cols, n_tok, ldy, yf, rf, resid)
        return
    kern = mma_q4k_q8k_kernel(ksplit, bool(pipe), nt, build, w16)
    if not ptx.SIMULATOR:
        _fits(kern, SIGNATURE, ("Q4_K", ksplit, bool(pipe), nt, build, w16))
    P.launch_or_plain(kern, grid, block, stream, SIGNATURE, pdl, w.wa, w.wb, w.units, rows, xq, xd, xb, cols,
                      n_tok, ldy, yf, rf, resid)


if __name__ == "__main__":      # python -m genie_rt.quant.gemv_mma_k [--json PATH] | --table PATH
    from .gemv_mma_k_bench import main
    raise SystemExit(main())
