"""The int8 tensor-core GEMV for Q6_K weights and q8_K activations, 1-16 tokens (lab, 2026-12-05).

gemv_mma_k.py's Q4_K kernel with Q6_K's block. What differs, and why:

- **The mma is m16n8k16** (`ptx.mma_s8_k16`). A Q6_K scale covers 16 weights, and the integer
  dot of one mma must be one scale's: m16n8k32 would add two sub-blocks of different scales.
  Sixteen mma a 256-weight block instead of eight (the tensor cores are far from busy here).
- **The quants go in signed, times four.** A weight is d * sc * (q - 32) with q 6 bits unsigned.
  `(q ^ 0x20) << 2` is 4 (q - 32) as an int8 (-128 .. 124) byte by byte in a packed word (bit 5
  flipped is q - 32 in 6-bit two's complement; two more places make bit 5 the sign bit), so there
  is no -32 * sum(x) term and no sub-block sums of x: `xb` is not read. The 1/4 goes into d.
  |S| <= 16 sub-blocks * 128 * 16 * 128 * 127 < 2^30.
- **Lane t holds weights 4t .. 4t + 3 of every 16-weight sub-block**, which is forced: each of the
  four lanes of an mma row must hold four of the same sub-block's weights, and a sub-block's 16
  quants are 16 adjacent ql bytes. So the quants come by 4-byte loads: 8 ql words and 4 qh words a
  row a block (a qh byte holds the high bits of four quarters' weights), and the token's 16 q8
  words the same way (words 4s + t). The rows' 16 scales are one 16-byte load, d one 2-byte load.

Block layout (llama.cpp's dequantize_row_q6_K): sub-block s = 8h + 2q + j (half h, quarter q,
sixteen j) is weights 16s .. 16s + 15 with scale sc[s]; weight 128h + 32q + 16j + l (l < 16) has
its low 4 bits in ql byte 64h + 32(q & 1) + 16j + l (the low nibble for q < 2, else the high one)
and its high 2 in bits 2q, 2q + 1 of qh byte 32h + 16j + l. With the device planes
(quant/layout.py: ql, qh, sc, d) lane t's ql words of a block are 16h + 8(q & 1) + 4j + t and its qh
words 8h + 4j + t.

    y[t, r] = sum over blocks b of xd[t, b] * d[r, b] / 4 * S[r, t, b]
    S = sum_s sc[r, s] * dot(4 (q[r, s] - 32), xq[t, s])

Rows, tokens, the k-split, PIPE, NT 16 and the shared-memory finish are gemv_mma_k.py's (see
there); the entry point is `gemv_mma_k.gemv_mma_k`, which takes either format.

W16 (the default since 2026-12-08, the knob `W16`): the 4-byte loads above read 16 bytes of a row a quad, so a warp instruction
takes 8 rows' 16 bytes (8 lines for 512 bytes: the L1's wavefronts, what the Q4_K build's W16 cut,
docs/kernels/gemv.md 8k). With W16 lane t of a quad loads ql words 4t .. 4t + 3 and 16 + 4t .. 19 + 4t
of the block (groups t and 4 + t of the eight 16-byte groups (h, q & 1, j)) and qh words 4t .. 4t + 3
(group t of (h, j)): three 16-byte loads a row and block instead of twelve. A 4 x 4 transpose over
the quad (`gemv_mma_k_w16.transpose4`, four shuffles a group of four) then gives lane t word t of
every group - the words the 4-byte loads give it, so the mma and the sums are the same, bit for bit.

Status: checked in the simulator (tests/test_gemv_mma_q6k.py) and on an H100 (the short prefill's
GPU tests); register counts from ptxas (kernels/gemv.md 8e); timed on the H100, 2026-12-06: 8 tokens
of ffn_down 19.4 us unpipelined against the dp4a GEMV's 12.0 for one token (kernels/gemv.md 8h).
Used by the short prefill (engine/cuda_short_prefill.py, a lab switch, off).
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .gemv_mma import LO4, ROWS, _dev, lanes, make_block_loop, make_finish
from .gemv_mma_k_w16 import transpose4
from .pdl import triggers as pdl_triggers
from .q8k_layout import xd_base, xq_word
from .pdl import weight_loads as pdl_weight_loads

SIGNATURE = ("void(uint32[::1], uint32[::1], uint32[::1], uint16[::1], int64, int64, uint32[::1], "
             "float32[::1], int64, int64, int64, float32[::1], float32[::1], int64)")
HI2 = 0x03030303
# Up to 8 tokens, the Q6_K builds load their quants 16 bytes a lane (W16, the docstring's last paragraph):
# the default of gemv_mma_k.default_w16 for Q6_K (the short graph's ffn_down) and of gemv_mma_qkv's Q6_K
# matrices (attn_v). H100, 2026-12-08 00:50 UTC, 8 tokens, weights from DRAM: ffn_down 2,560 x 9,728 14.60 us
# against 17.75 (k-split 8), attn_v 4.26 against 4.19; the 4B's warm request 2.434 ms against 2.532, its
# short graph 2.250 against 2.303 by events (docs/kernels/gemv.md 8n). On; False (a knob) for the 4-byte build.
W16 = True


def make_row_loads(PDL: bool = False, W16: bool = False):
    """row_loads(wa, wb, wc, wd, nblk, rr, qi, hi, blk): row rr's part of block blk for this lane -
    its 8 ql words (qi: the row's first, + t), its 4 qh words (hi likewise), the row's 16 scales
    (one 16-byte load: PDL ptx.ldw_v4, which stays above griddepcontrol.wait, else the read-only
    ldg_v4, which ptxas sinks below it) and d's bits. The word loads are ordinary ones either way.
    W16: ql and qh by three 16-byte loads of that kind (qi, hi: the row's first word + 4 t), raw -
    `unpack16` gives the lane its 8 + 4 words."""
    ld4 = pdl_weight_loads(PDL)[1]
    if W16:
        @_dev
        def row_loads16(wa, wb, wc, wd, nblk, rr, qi, hi, blk):
            q = qi + uint32(32) * uint32(blk)
            j = uint32(rr * nblk + blk)
            return ((ld4(wa, q), ld4(wa, q + uint32(16))), ld4(wb, hi + uint32(16) * uint32(blk)),
                    ld4(wc, j * uint32(4)), wd[j])
        return row_loads16

    @_dev
    def row_loads(wa, wb, wc, wd, nblk, rr, qi, hi, blk):
        q = qi + uint32(32) * uint32(blk)
        h = hi + uint32(16) * uint32(blk)
        ql = (wa[q], wa[q + uint32(4)], wa[q + uint32(8)], wa[q + uint32(12)],
              wa[q + uint32(16)], wa[q + uint32(20)], wa[q + uint32(24)], wa[q + uint32(28)])
        qh = (wb[h], wb[h + uint32(4)], wb[h + uint32(8)], wb[h + uint32(12)])
        j = uint32(rr * nblk + blk)
        return ql, qh, ld4(wc, j * uint32(4)), wd[j]
    return row_loads


@_dev
def _token_loads(xq, xd, tok, nb, blk):
    """A B fragment's token's part of block blk (tok = (okb, xi, da, dc): words 4s + t of its 64,
    zero when okb is false - in the tiled xq (quant/q8k_layout.py: xi = xq_word(token) + t), word
    4s + t is word 4 (s & 1) + t of sub-block s >> 1, 64 words a sub-block) and the block scales of
    the accumulators' tokens (da, dc: their xd_base)."""
    okb, xi, da, dc = tok
    o = xi + uint32(512) * uint32(blk)
    z = uint32(0)
    x = (xq[o] if okb else z, xq[o + uint32(4)] if okb else z, xq[o + uint32(64)] if okb else z,
         xq[o + uint32(68)] if okb else z, xq[o + uint32(128)] if okb else z, xq[o + uint32(132)] if okb else z,
         xq[o + uint32(192)] if okb else z, xq[o + uint32(196)] if okb else z, xq[o + uint32(256)] if okb else z,
         xq[o + uint32(260)] if okb else z, xq[o + uint32(320)] if okb else z, xq[o + uint32(324)] if okb else z,
         xq[o + uint32(384)] if okb else z, xq[o + uint32(388)] if okb else z, xq[o + uint32(448)] if okb else z,
         xq[o + uint32(452)] if okb else z)
    b8 = uint32(8) * uint32(blk)
    return x, xd[da + b8], xd[dc + b8]


@_dev
def _q6(ql, qh, nib, qsh):
    """Four weights' 4 (q - 32) as int8 bytes: the low 4 bits from ql's nibble (shift nib 0 or
    4), the high 2 from qh's bits qsh, qsh + 1 (module docstring)."""
    return ((((ql >> nib) & LO4) | (((qh >> qsh) & HI2) << 4)) ^ 0x20202020) << 2


@_dev
def _sc(word, k):
    """Signed byte k (a literal 0..3) of a word of Q6_K scales (in 32 bits: a shift of the int32
    word would be widened to 64)."""
    b = int32((word >> uint32(8 * k)) & uint32(0xFF))
    return int32((b ^ 0x80) - 0x80)


@_dev
def _sub(S, ra, rb, x, s):
    """Sub-block s (a literal 0..15) of the block: the rows' 4 (q - 32) words, one m16n8k16 with
    the token's word x, scaled by each row's sc[s], added to the integer sums S."""
    h, q, j = s >> 3, (s >> 1) & 3, s & 1
    wi = 4 * h + 2 * (q & 1) + j                     # the lane's ql word (of 8) and qh word (of 4)
    hw = 2 * h + j
    nib, qsh = 4 * (q >> 1), 2 * q
    a0 = _q6(ra[0][wi], ra[1][hw], nib, qsh)
    a1 = _q6(rb[0][wi], rb[1][hw], nib, qsh)
    c = ptx.mma_s8_k16(a0, a1, x, int32(0), int32(0), int32(0), int32(0))
    s0 = _sc(ra[2][s >> 2], s & 3)
    s1 = _sc(rb[2][s >> 2], s & 3)
    # (int32() around each sum: numba widens int32 products to int64; truncated, LLVM keeps 32 bits)
    return (int32(S[0] + s0 * c[0]), int32(S[1] + s0 * c[1]), int32(S[2] + s1 * c[2]), int32(S[3] + s1 * c[3]))


@_dev
def _tokens(acc, k0, W, T):
    """One B fragment's eight tokens of a block into acc[k0 .. k0 + 3]: sixteen mma, then
    xd * d / 4 * S."""
    ra, rb = W
    x, xd0, xd1 = T
    z = int32(0)
    S = (z, z, z, z)
    S = _sub(S, ra, rb, x[0], 0)
    S = _sub(S, ra, rb, x[1], 1)
    S = _sub(S, ra, rb, x[2], 2)
    S = _sub(S, ra, rb, x[3], 3)
    S = _sub(S, ra, rb, x[4], 4)
    S = _sub(S, ra, rb, x[5], 5)
    S = _sub(S, ra, rb, x[6], 6)
    S = _sub(S, ra, rb, x[7], 7)
    S = _sub(S, ra, rb, x[8], 8)
    S = _sub(S, ra, rb, x[9], 9)
    S = _sub(S, ra, rb, x[10], 10)
    S = _sub(S, ra, rb, x[11], 11)
    S = _sub(S, ra, rb, x[12], 12)
    S = _sub(S, ra, rb, x[13], 13)
    S = _sub(S, ra, rb, x[14], 14)
    S = _sub(S, ra, rb, x[15], 15)
    d0 = ptx.f16_bits_to_f32(uint32(ra[3])) * float32(0.25)
    d1 = ptx.f16_bits_to_f32(uint32(rb[3])) * float32(0.25)
    acc[k0] += xd0 * (d0 * float32(S[0]))
    acc[k0 + 1] += xd1 * (d0 * float32(S[1]))
    acc[k0 + 2] += xd0 * (d1 * float32(S[2]))
    acc[k0 + 3] += xd1 * (d1 * float32(S[3]))


@_dev
def _unpack_row(r):
    """A W16 row's raw loads -> the 8-byte build's (ql words, qh words, scales, d): lane t of a quad
    loaded ql groups t and 4 + t and qh group t (16 bytes each); `transpose4` gives it word t of
    every group - the words the 4-byte loads give it."""
    return transpose4(r[0][0]) + transpose4(r[0][1]), transpose4(r[1]), r[2], r[3]


@_dev
def unpack16(W):
    """W16: both rows' raw loads as `make_row_loads` returns them without it. Called by the trip's
    multiply, not by the loads (as gemv_mma_k_w16.split16)."""
    return _unpack_row(W[0]), _unpack_row(W[1])


def make_block_parts(NT: int = 8, PDL: bool = False, W16: bool = False):
    """(wloads, tloads, block) for up to NT (8 or 16) tokens, gemv_mma.make_block_loop's three: the
    two rows' 28 weight loads a lane (`make_row_loads`: 24 quant words, two 16-byte scale loads, two d),
    the token's 18 (16 words, 2 block scales; NT 16: a second B fragment, tokens 8 .. 15) and the
    block's sixteen mma. The token
    loads are ordinary (coherent) loads, so the PDL build reads them the same way. W16: the quants
    by 16-byte loads (`make_row_loads`), unpacked in the multiply."""
    row_loads = make_row_loads(PDL, W16)

    @_dev
    def wloads(wa, wb, wc, wd, xq, xd, nblk, rr0, rr1, bases, tok, tok2, nb, blk):
        q0, q1, h0, h1 = bases
        return row_loads(wa, wb, wc, wd, nblk, rr0, q0, h0, blk), row_loads(wa, wb, wc, wd, nblk, rr1, q1, h1, blk)

    if NT == 8:
        @_dev
        def tloads(wa, wb, wc, wd, xq, xd, nblk, rr0, rr1, bases, tok, tok2, nb, blk):
            return _token_loads(xq, xd, tok, nb, blk)

        @_dev
        def block(acc, W, X):
            _tokens(acc, 0, unpack16(W) if W16 else W, X)
    else:
        @_dev
        def tloads(wa, wb, wc, wd, xq, xd, nblk, rr0, rr1, bases, tok, tok2, nb, blk):
            return _token_loads(xq, xd, tok, nb, blk), _token_loads(xq, xd, tok2, nb, blk)

        @_dev
        def block(acc, W, X):
            Wu = unpack16(W) if W16 else W
            _tokens(acc, 0, Wu, X[0])
            _tokens(acc, 4, Wu, X[1])                # the same A words: decoded again (registers)
    return wloads, tloads, block


def make_trips(NW: int, NT: int = 8, PIPE: bool = True, PDL: bool = False, W16: bool = False):
    """trips(acc, wa, wb, wc, wd, nu, rows, tile, warp, lane, xq, xd, xb, cols, n_tok): warp `warp`'s
    share of the blocks of the Q6_K rows tile * 16 .. + 15 into acc - gemv_mma_k.make_trips' contract
    (xb is not read; PDL as there). W16: the quants by 16-byte lane loads (the module docstring)."""
    run = make_block_loop(*make_block_parts(NT, PDL, W16), PIPE, PDL,
                          wrest=make_block_parts(NT, False, W16)[0] if PDL else None)   # (as gemv_mma_k's)
    tw = 4 if W16 else 1                     # a lane's first ql / qh word: 4 t (W16) or t

    @_dev
    def trips(acc, wa, wb, wc, wd, nu, rows, tile, warp, lane, xq, xd, xb, cols, n_tok):
        g, t, rr0, rr1, nblk, b_lo, b_hi, tb, ta, tc, tb2, ta2, tc2 = lanes(tile, warp, lane, rows, nu, n_tok, NW)
        nb = cols >> 8
        ut = uint32(t)
        uw = uint32(tw * t)
        bases = (uint32(rr0 * nu * 4) + uw, uint32(rr1 * nu * 4) + uw,     # ql: 4 words a unit
                 uint32(rr0 * nu * 2) + uw, uint32(rr1 * nu * 2) + uw)     # qh: 2 words a unit
        tok = (g < n_tok, xq_word(tb, cols) + ut, xd_base(ta, nb), xd_base(tc, nb))   # (quant/q8k_layout.py)
        tok2 = (g + 8 < n_tok, xq_word(tb2, cols) + ut, xd_base(ta2, nb), xd_base(tc2, nb))
        run(acc, (wa, wb, wc, wd, xq, xd, nblk, rr0, rr1, bases, tok, tok2, nb), b_lo, b_hi, nblk)
    return trips


@functools.lru_cache(maxsize=None)
def mma_q6k_q8k_kernel(KSPLIT: int = 4, PIPE: bool = True, NT: int = 8, PDL: int = 0, W16: bool = False):
    """y[t, r] = sum_c W[r, c] x[t, c] (+ res[t, r]) for t < n_tok <= NT (8 or 16), W Q6_K, x as
    q8_K; grid ceil(rows / 16) blocks of 32 * KSPLIT threads (KSPLIT 1..16). Arguments: wa, wb,
    wc, wd (the Q6_K GEMV planes ql, qh, sc, d), nu (ql units a row), rows, xq (uint32 words of
    the tiled int8 [xq_size(n_tok, cols)], gemv_mma_k.tile_q8k), xd (float32 [n_tok * cols / 256]), cols, n_tok, ldy, y (float32, token t's
    row at t * ldy), res, resid. Rows, tokens, split, finish and PDL as gemv_mma_k.mma_q4k_q8k_kernel.
    W16: the quants by 16-byte lane loads (the module docstring; the same bits)."""
    if NT not in (8, 16):
        raise ValueError(f"mma_q6k_q8k_kernel: NT {NT} must be 8 or 16")
    NW = KSPLIT
    NACC = NT // 2
    finish = make_finish(NW, NACC)
    trips = make_trips(NW, NT, PIPE, PDL, W16)
    trigger_first, trigger_late = pdl_triggers(PDL)

    @cuda.jit
    def kernel(wa, wb, wc, wd, nu, rows, xq, xd, cols, n_tok, ldy, y, res, resid):
        trigger_first()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        acc = cuda.local.array(NACC, float32)        # k: row g + 8 ((k >> 1) & 1), token 2t + (k & 1) + 8 (k >> 2)
        for k in range(NACC):
            acc[k] = float32(0)
        trips(acc, wa, wb, wc, wd, nu, rows, cuda.blockIdx.x, warp, lane, xq, xd, xd, cols, n_tok)
        trigger_late()
        finish(acc, warp, lane, cuda.blockIdx.x * ROWS + (lane >> 2), 2 * (lane & 3), rows, ldy, n_tok, y, res,
               resid)
    return kernel_cache.attach(kernel)
