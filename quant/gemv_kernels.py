"""Device code of the decode GEMV: per-format unit decoders and the kernel factories.

The story, the numpy reference and the public launchers are in `gemv.py`; this file is
the part that runs on the GPU. Read it in this order:

1. the *unit*: every format is streamed in units of 16 bytes of its bulk quants plane
   (one `ld.global.nc.v4`), which hold 32 weights for Q4_K / Q6_K / Q5_0, 16 for Q8_0
   and 8 for F16. `load_*` reads one unit (plus the block header it needs), `*_dp4a` /
   `*_f32` turns it into `acc[t] += sum_i w_i * x[t, i]` for the NT tokens.
2. `_make_row_dot`: a lane walks the units of one row with stride 32 * KSPLIT, three
   units per trip so that three 16-byte loads are in flight before the first is used.
3. `_make_reduce`: warp-shuffle sum, then (KSPLIT > 1) the warps that share a row add
   their partial sums through shared memory.
4. the three kernel factories: `gemv_kernel` (y = W x (+ r); with NORM also rmsnorm_q8
   of the new y in the last block), `qkv_kernel` (three
   weights, rows partitioned between blocks, one concatenated output) and
   `swiglu_kernel` (h = silu(Wg x) * (Wu x)), plus `quantize_q8_kernel`.

Who owns what (block = 4 warps = 128 threads):
    warp   -> one (row, k-part): row = global_warp // KSPLIT, k-part = global_warp % KSPLIT
    lane l -> units l + 32 * k-part, then + 32 * KSPLIT, ... of that row
    lane 0 of the k-part-0 warp -> writes y[t, row] for every token t
    (LPR = 16 lanes per row, KSPLIT = 1: a warp holds two rows, one per half-warp, and
    lanes 0 and 16 write; see _make_assign)

Two ways to multiply (the "mode" of a weight):
    dp4a: x was quantized to q8 (int8 per weight + one float scale per 32), see
          `quantize_q8_kernel`; each run of 16 weights becomes 4 `dp4a` on packed
          int8 quants, plus a few float ops per run. Q4_K: ~100 PTX instructions per
          32-weight unit at NT = 1, loads and address math included.
    f32:  weights are dequantized to float32 (nibbles/bytes become floats through the
          fp16 "1024 + q" bit trick, no int->float conversion unit) and dotted with the
          float32 x; exact up to fp32 rounding. Q4_K: ~290 PTX instructions per unit.
The kernels are specialized at compile time on the formats, the modes, NT (tokens,
1..8, accumulators live in registers) and KSPLIT (1, 2, 4); `gemv.py` keeps the cache.

What it deliberately does not do: choose grids, check arguments, allocate (gemv.py),
or use tensor cores (batches > 8 belong to the MMQ GEMM).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int8, uint32

from genie_rt.engine import kernel_cache

from . import gemv_units as U
from . import ptx
from .formats import QType
from .norm_q8_device import make_norm_q8_tail, q8_of_warp   # q8_of_warp: quantize_q8_kernel's

WARPS = 4                 # warps per block
BLOCK = 32 * WARPS        # threads per block
FULL = 0xFFFFFFFF         # shuffle mask: the whole warp

LO4 = 0x0F0F0F0F          # low nibble of each byte
MAGIC = 0x64006400        # two fp16 1024.0: (q | MAGIC) as half2 is (1024 + q_lo, 1024 + q_hi)
F1024 = np.float32(1024.0)
F1056 = np.float32(1056.0)            # 1024 + 32: Q6_K quants are q - 32
F32 = np.float32(32.0)
F16_ = np.float32(16.0)
RINT = np.float32(12582912.0)         # 1.5 * 2**23: (v + RINT) - RINT rounds to nearest even
_GELU_A = float32(0.044715)
_GELU_S = float32(0.79788456080286535587989211986876)

# weights per unit, units per format block (all powers of two); the formats after F16
# have their unit decoders in gemv_units.py
UNIT_WEIGHTS = {QType.Q4_K: 32, QType.Q6_K: 32, QType.Q5_0: 32, QType.Q8_0: 16, QType.F16: 8,
                QType.Q4_0: 32, QType.Q4_1: 32, QType.Q5_1: 32, QType.Q5_K: 32, QType.BF16: 8}
UNIT_SHIFT = {QType.Q4_K: 3, QType.Q6_K: 3, QType.Q8_0: 1, QType.Q5_0: 0, QType.F16: 0,  # log2 units/block
              QType.Q4_0: 0, QType.Q4_1: 0, QType.Q5_1: 0, QType.Q5_K: 3, QType.BF16: 0}
MODES = {QType.Q4_K: ("dp4a", "f32"), QType.Q6_K: ("dp4a", "f32"), QType.Q8_0: ("dp4a",),
         QType.Q5_0: ("dp4a",), QType.F16: ("f32",),
         QType.Q4_0: ("dp4a",), QType.Q4_1: ("dp4a",), QType.Q5_1: ("dp4a",), QType.Q5_K: ("dp4a",),
         QType.BF16: ("f32",)}

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


# =====================================================================================
# Small helpers
# =====================================================================================
@_dev
def _dot16(w0, w1, w2, w3, x):
    """Sum of the 16 int8 products of words w0..w3 and the 4-word tuple x (4 dp4a)."""
    s = ptx.dp4a(w0, x[0], 0)
    s = ptx.dp4a(w1, x[1], s)
    s = ptx.dp4a(w2, x[2], s)
    return ptx.dp4a(w3, x[3], s)


@_dev
def _bytes_f32(q, sub, scale, off):
    """4 bytes q (each < 1024) -> 4 floats scale * (q - (sub - 1024)) - off, byte 0 first.

    (q & 0x00FF00FF) | MAGIC reads as two fp16 1024 + q (exact): the fp16 -> f32 cvt
    runs on the FMA pipe, unlike the int -> float conversion unit (16/clk/SM)."""
    e = ptx.unpack_half2((q & 0x00FF00FF) | MAGIC)
    o = ptx.unpack_half2(((q >> 8) & 0x00FF00FF) | MAGIC)
    return (scale * (e[0] - sub) - off, scale * (o[0] - sub) - off,
            scale * (e[1] - sub) - off, scale * (o[1] - sub) - off)


@_dev
def _dot4f(w, x):
    return w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3]


@_dev
def _k_scales(h, c):
    """(scale, min), 6 bits each, of sub-blocks 2c and 2c + 1 (c = 0..3) of a Q4_K block
    whose header words are h (h[1..3] = the 12 packed scale bytes; layout: kquants.py).

    All four bytes of a word are decoded at once (sub-blocks 0-3 sit in bits 0-5 of
    scales[0:4] / [4:8]; 4-7 are split between scales[8:12] and bits 6-7 of [0:8]), then
    the lane picks its pair with selects. Constant shifts only: numba types a shift by a
    variable as a 64-bit op, and the lanes of a warp hold different c (no branches)."""
    sc_lo = h[1] & 0x3F3F3F3F                                   # sc[0..3]
    mn_lo = h[2] & 0x3F3F3F3F                                   # m[0..3]
    sc_hi = (h[3] & 0x0F0F0F0F) | ((h[1] >> 2) & 0x30303030)    # sc[4..7]
    mn_hi = ((h[3] >> 4) & 0x0F0F0F0F) | ((h[2] >> 2) & 0x30303030)
    sc = sc_hi if c >= 2 else sc_lo
    mn = mn_hi if c >= 2 else mn_lo
    sc = (sc >> 16) if c & 1 else sc                            # bytes 2(c % 2), 2(c % 2) + 1
    mn = (mn >> 16) if c & 1 else mn
    return int32(sc & 0xFF), int32(mn & 0xFF), int32((sc >> 8) & 0xFF), int32((mn >> 8) & 0xFF)


@_dev
def _warp_sum(v):
    for off in (16, 8, 4, 2, 1):
        v += cuda.shfl_xor_sync(FULL, v, off)
    return v


# =====================================================================================
# Unit loaders. g = row * units_per_row + u is the global unit index; planes are flat
# (wa, wb, wc: uint32 words; wd: uint16 fp16 bits), see gemv.prepare_weight.
# =====================================================================================
@_dev
def load_q4k(wa, wb, wc, wd, g):
    # wa = qs  (128 B per 256-weight block: 8 units), wb = hdr (16 B per block)
    return ptx.ldg_v4(wa, g * 4), ptx.ldg_v4(wb, (g >> 3) * 4)


@_dev
def load_q6k(wa, wb, wc, wd, g):
    # wa = ql (128 B/block: unit p = bytes 16p..16p+15), wb = qh (64 B/block: the unit
    # needs piece 2h + g of 4, h = p >> 2, g = p & 1), wc = sc (16 int8/block), wd = d
    p = g & 7
    b = g >> 3
    return (ptx.ldg_v4(wa, g * 4), ptx.ldg_v4(wb, (b * 4 + (p >> 2) * 2 + (p & 1)) * 4),
            ptx.ldg_v4(wc, b * 4), wd[uint32(b)])


@_dev
def load_q8_0(wa, wb, wc, wd, g):
    # wa = qs (32 B per 32-weight block: 2 units), wd = d
    return ptx.ldg_v4(wa, g * 4), wd[uint32(g >> 1)]


@_dev
def load_q5_0(wa, wb, wc, wd, g):
    # wa = qs (16 B per block = 1 unit), wb = qh (one uint32 per block), wd = d
    return ptx.ldg_v4(wa, g * 4), wb[uint32(g)], wd[uint32(g)]


@_dev
def load_f16(wa, wb, wc, wd, g):
    # wa = 8 fp16 weights per unit, as 4 words
    return ptx.ldg_v4(wa, g * 4)


LOADERS = {QType.Q4_K: load_q4k, QType.Q6_K: load_q6k, QType.Q8_0: load_q8_0,
           QType.Q5_0: load_q5_0, QType.F16: load_f16,
           QType.Q4_0: U.load_q4_0, QType.Q4_1: U.load_q4_1, QType.Q5_1: U.load_q5_1,
           QType.Q5_K: U.load_q5_k, QType.BF16: U.load_bf16}


# =====================================================================================
# Unit multipliers: acc[ao + t] += sum over the unit's weights of w * x[t], for t < NT.
# blk = format block of the unit inside the row, p = the unit's piece of that block (the
# same for every unit a lane visits: the lane stride is a multiple of 8 units).
# Activations, flat: xf float32 [n_tok * cols]; xq uint32 words of the int8 q8 values;
# xs float32, 4 per 32 values: (d, d * sum q[0:16], d * sum q[16:32], d * sum q[0:32]),
# so that x ~ d * q and the sums serve the formats' offsets (Q4_K min, Q6_K -32, Q5_0 -16).
# =====================================================================================
def _q4k_dp4a(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, h = v
        # piece p = bytes 16p..16p+15 of the block's 128-byte qs: chunk c = p // 2 holds
        # sub-block 2c (low nibbles, run A) and 2c + 1 (high nibbles, run B), lanes 16 (p % 2) + 0..15
        dm = ptx.unpack_half2(h[0])                    # (d, dmin)
        sca, mna, scb, mnb = _k_scales(h, p >> 1)
        da = dm[0] * float32(sca)
        db = dm[0] * float32(scb)
        ma = dm[1] * float32(mna)
        mb = dm[1] * float32(mnb)
        a0, a1, a2, a3 = q[0] & LO4, q[1] & LO4, q[2] & LO4, q[3] & LO4
        b0, b1, b2, b3 = (q[0] >> 4) & LO4, (q[1] >> 4) & LO4, (q[2] >> 4) & LO4, (q[3] >> 4) & LO4
        odd = (p & 1) != 0
        pa = blk * 256 + (p >> 1) * 64 + (p & 1) * 16     # column of run A; run B is 32 further
        for t in range(NT):
            o = t * cols + pa
            xa = ptx.ldg_v4(xq, o >> 2)
            xb = ptx.ldg_v4(xq, (o + 32) >> 2)
            sa = ptx.ldg_v4(xs, (o >> 5) * 4)
            sb = ptx.ldg_v4(xs, ((o + 32) >> 5) * 4)
            # w = d*sc*q - dmin*m, x ~ xd*xq: sum w x = d*sc*xd*sum(q xq) - dmin*m*xd*sum(xq)
            ra = da * sa[0] * float32(_dot16(a0, a1, a2, a3, xa)) - ma * (sa[2] if odd else sa[1])
            rb = db * sb[0] * float32(_dot16(b0, b1, b2, b3, xb)) - mb * (sb[2] if odd else sb[1])
            acc[ao + t] += ra + rb
    return mul


def _q4k_f32(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, h = v
        dm = ptx.unpack_half2(h[0])
        sca, mna, scb, mnb = _k_scales(h, p >> 1)
        da = dm[0] * float32(sca)
        db = dm[0] * float32(scb)
        ma = dm[1] * float32(mna)
        mb = dm[1] * float32(mnb)
        # 32 weights w = (d*sc) * q - dmin*m, dequantized once for all tokens
        wa0 = _bytes_f32(q[0] & LO4, F1024, da, ma)
        wa1 = _bytes_f32(q[1] & LO4, F1024, da, ma)
        wa2 = _bytes_f32(q[2] & LO4, F1024, da, ma)
        wa3 = _bytes_f32(q[3] & LO4, F1024, da, ma)
        wb0 = _bytes_f32((q[0] >> 4) & LO4, F1024, db, mb)
        wb1 = _bytes_f32((q[1] >> 4) & LO4, F1024, db, mb)
        wb2 = _bytes_f32((q[2] >> 4) & LO4, F1024, db, mb)
        wb3 = _bytes_f32((q[3] >> 4) & LO4, F1024, db, mb)
        pa = blk * 256 + (p >> 1) * 64 + (p & 1) * 16
        for t in range(NT):
            o = t * cols + pa
            s = _dot4f(wa0, ptx.ldg_v4(xf, o)) + _dot4f(wa1, ptx.ldg_v4(xf, o + 4))
            s += _dot4f(wa2, ptx.ldg_v4(xf, o + 8)) + _dot4f(wa3, ptx.ldg_v4(xf, o + 12))
            s += _dot4f(wb0, ptx.ldg_v4(xf, o + 32)) + _dot4f(wb1, ptx.ldg_v4(xf, o + 36))
            s += _dot4f(wb2, ptx.ldg_v4(xf, o + 40)) + _dot4f(wb3, ptx.ldg_v4(xf, o + 44))
            acc[ao + t] += s
    return mul


@_dev
def _q6k_quants(ql, qh, kk):
    """Unsigned 6-bit quants (bytes 0..63) of runs A (quarter kk) and B (quarter kk + 2)
    for the 4 words of a Q6_K unit: low 4 bits from ql's nibbles, high 2 from qh
    (bits 2k..2k+1 of each qh byte belong to quarter k)."""
    odd = kk != 0
    h0 = (qh[0] >> 2) if odd else qh[0]          # constant shifts + selects (see _k_scales)
    h1 = (qh[1] >> 2) if odd else qh[1]
    h2 = (qh[2] >> 2) if odd else qh[2]
    h3 = (qh[3] >> 2) if odd else qh[3]
    a0 = (ql[0] & LO4) | ((h0 & 0x03030303) << 4)
    a1 = (ql[1] & LO4) | ((h1 & 0x03030303) << 4)
    a2 = (ql[2] & LO4) | ((h2 & 0x03030303) << 4)
    a3 = (ql[3] & LO4) | ((h3 & 0x03030303) << 4)
    b0 = ((ql[0] >> 4) & LO4) | (h0 & 0x30303030)
    b1 = ((ql[1] >> 4) & LO4) | (h1 & 0x30303030)
    b2 = ((ql[2] >> 4) & LO4) | (h2 & 0x30303030)
    b3 = ((ql[3] >> 4) & LO4) | (h3 & 0x30303030)
    return a0, a1, a2, a3, b0, b1, b2, b3


@_dev
def _q6k_scales(sc, p):
    """int8 scales of runs A and B of piece p: sc[8h + 2kk + g] and sc[8h + 2kk + g + 4]
    (h = p // 4, kk = p // 2 % 2, g = p % 2), i.e. byte p % 4 of sc word 2h and of 2h + 1."""
    wa = sc[2] if p >= 4 else sc[0]             # (no tuple[variable]: that goes to local memory)
    wb = sc[3] if p >= 4 else sc[1]
    wa = (wa >> 16) if p & 2 else wa
    wb = (wb >> 16) if p & 2 else wb
    va = ((wa >> 8) if p & 1 else wa) & 0xFF
    vb = ((wb >> 8) if p & 1 else wb) & 0xFF
    return int32((int32(va) ^ 0x80) - 0x80), int32((int32(vb) ^ 0x80) - 0x80)


def _q6k_dp4a(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        ql, qh, sc, dbits = v
        # piece p = ql bytes 16p..: half h = p // 4, quarter kk = p // 2 % 2 (low nibbles,
        # run A) and kk + 2 (high nibbles, run B), lanes 16 g + 0..15 with g = p % 2
        a0, a1, a2, a3, b0, b1, b2, b3 = _q6k_quants(ql, qh, (p >> 1) & 1)
        sa, sb = _q6k_scales(sc, p)
        d = ptx.f16_bits_to_f32(uint32(dbits))
        fa = d * float32(sa)
        fb = d * float32(sb)
        odd = (p & 1) != 0
        pa = blk * 256 + (p >> 2) * 128 + ((p >> 1) & 1) * 32 + (p & 1) * 16   # run B: + 64
        for t in range(NT):
            o = t * cols + pa
            xa = ptx.ldg_v4(xq, o >> 2)
            xb = ptx.ldg_v4(xq, (o + 64) >> 2)
            za = ptx.ldg_v4(xs, (o >> 5) * 4)
            zb = ptx.ldg_v4(xs, ((o + 64) >> 5) * 4)
            # w = d*sc*(q - 32): sum w x = d*sc*(xd*sum(q xq) - 32*xd*sum(xq)), q unsigned
            ra = za[0] * float32(_dot16(a0, a1, a2, a3, xa)) - F32 * (za[2] if odd else za[1])
            rb = zb[0] * float32(_dot16(b0, b1, b2, b3, xb)) - F32 * (zb[2] if odd else zb[1])
            acc[ao + t] += fa * ra + fb * rb
    return mul


def _q6k_f32(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        ql, qh, sc, dbits = v
        a0, a1, a2, a3, b0, b1, b2, b3 = _q6k_quants(ql, qh, (p >> 1) & 1)
        sa, sb = _q6k_scales(sc, p)
        d = ptx.f16_bits_to_f32(uint32(dbits))
        fa = d * float32(sa)
        fb = d * float32(sb)
        zero = float32(0)
        wa0, wa1 = _bytes_f32(a0, F1056, fa, zero), _bytes_f32(a1, F1056, fa, zero)
        wa2, wa3 = _bytes_f32(a2, F1056, fa, zero), _bytes_f32(a3, F1056, fa, zero)
        wb0, wb1 = _bytes_f32(b0, F1056, fb, zero), _bytes_f32(b1, F1056, fb, zero)
        wb2, wb3 = _bytes_f32(b2, F1056, fb, zero), _bytes_f32(b3, F1056, fb, zero)
        pa = blk * 256 + (p >> 2) * 128 + ((p >> 1) & 1) * 32 + (p & 1) * 16
        for t in range(NT):
            o = t * cols + pa
            s = _dot4f(wa0, ptx.ldg_v4(xf, o)) + _dot4f(wa1, ptx.ldg_v4(xf, o + 4))
            s += _dot4f(wa2, ptx.ldg_v4(xf, o + 8)) + _dot4f(wa3, ptx.ldg_v4(xf, o + 12))
            s += _dot4f(wb0, ptx.ldg_v4(xf, o + 64)) + _dot4f(wb1, ptx.ldg_v4(xf, o + 68))
            s += _dot4f(wb2, ptx.ldg_v4(xf, o + 72)) + _dot4f(wb3, ptx.ldg_v4(xf, o + 76))
            acc[ao + t] += s
    return mul


def _q8_0_dp4a(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, dbits = v
        d = ptx.f16_bits_to_f32(uint32(dbits))
        pa = blk * 32 + p * 16                  # 16 weights: half p of 32-weight block blk
        for t in range(NT):
            o = t * cols + pa
            acc[ao + t] += d * xs[uint32((o >> 5) * 4)] * float32(
                _dot16(q[0], q[1], q[2], q[3], ptx.ldg_v4(xq, o >> 2)))
    return mul


@_dev
def _spread4(bits):
    """4 bits -> bit 4 of each of 4 bytes (bit k -> byte k): the 5th bit of Q5_0 quants."""
    return ((bits * 0x00204081) & 0x01010101) << 4


def _q5_0_dp4a(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, qh, dbits = v
        d = ptx.f16_bits_to_f32(uint32(dbits))
        # unsigned q in 0..31: weight j < 16 = low nibble of byte j + bit j of qh,
        # weight 16 + j = high nibble of byte j + bit 16 + j
        a0 = (q[0] & LO4) | _spread4(qh & 15)
        a1 = (q[1] & LO4) | _spread4((qh >> 4) & 15)
        a2 = (q[2] & LO4) | _spread4((qh >> 8) & 15)
        a3 = (q[3] & LO4) | _spread4((qh >> 12) & 15)
        b0 = ((q[0] >> 4) & LO4) | _spread4((qh >> 16) & 15)
        b1 = ((q[1] >> 4) & LO4) | _spread4((qh >> 20) & 15)
        b2 = ((q[2] >> 4) & LO4) | _spread4((qh >> 24) & 15)
        b3 = ((q[3] >> 4) & LO4) | _spread4((qh >> 28) & 15)
        pa = blk * 32
        for t in range(NT):
            o = t * cols + pa
            z = ptx.ldg_v4(xs, (o >> 5) * 4)
            s = _dot16(a0, a1, a2, a3, ptx.ldg_v4(xq, o >> 2))
            s = s + _dot16(b0, b1, b2, b3, ptx.ldg_v4(xq, (o + 16) >> 2))
            # w = d (q - 16): sum w x = d (xd sum(q xq) - 16 xd sum(xq))
            acc[ao + t] += d * (z[0] * float32(s) - F16_ * z[3])
    return mul


def _f16_f32(NT):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        w01 = ptx.unpack_half2(v[0])
        w23 = ptx.unpack_half2(v[1])
        w45 = ptx.unpack_half2(v[2])
        w67 = ptx.unpack_half2(v[3])
        pa = blk * 8
        for t in range(NT):
            o = t * cols + pa
            xa = ptx.ldg_v4(xf, o)
            xb = ptx.ldg_v4(xf, o + 4)
            acc[ao + t] += (w01[0] * xa[0] + w01[1] * xa[1] + w23[0] * xa[2] + w23[1] * xa[3]
                            + w45[0] * xb[0] + w45[1] * xb[1] + w67[0] * xb[2] + w67[1] * xb[3])
    return mul


MULTIPLIERS = {(QType.Q4_K, "dp4a"): _q4k_dp4a, (QType.Q4_K, "f32"): _q4k_f32,
               (QType.Q6_K, "dp4a"): _q6k_dp4a, (QType.Q6_K, "f32"): _q6k_f32,
               (QType.Q8_0, "dp4a"): _q8_0_dp4a, (QType.Q5_0, "dp4a"): _q5_0_dp4a,
               (QType.F16, "f32"): _f16_f32,
               (QType.Q4_0, "dp4a"): U._q4_0_dp4a, (QType.Q4_1, "dp4a"): U._q4_1_dp4a,
               (QType.Q5_1, "dp4a"): U._q5_1_dp4a, (QType.Q5_K, "dp4a"): lambda NT: U._q5k_dp4a(NT, _k_scales),
               (QType.BF16, "f32"): U._bf16_f32}


# =====================================================================================
# Row loop and reduction
# =====================================================================================
_row_dots = {}


@_dev
def _no_op():
    pass


def _pdl_hooks(PDL):
    """(wait, launch_dependents) device functions: griddepcontrol on a programmatic-
    dependent-launch build (PDL, sm_90+: quant/pdl.py), no-ops that inline to nothing
    otherwise - so the sm_80/87 kernels are the same code as before PDL existed."""
    if PDL:
        return ptx.griddep_wait, ptx.griddep_launch_dependents
    return _no_op, _no_op


def _make_row_dot(qtype, mode, NT, PDL=False):
    """Device function row_dot(wa, wb, wc, wd, nu, row, u, step, xf, xq, xs, cols, acc, ao):
    acc[ao + t] += the lane's share (units u, u + step, ...) of row `row` times x[t].
    PDL: each trip's weight loads are issued before `griddepcontrol.wait` - on the first trip
    that overlaps them with the end of the kernel before (whose output x is), later trips
    pass the wait at once."""
    key = (qtype, mode, NT, PDL)
    if key in _row_dots:
        return _row_dots[key]
    wait = _pdl_hooks(PDL)[0]
    load = LOADERS[qtype]
    mul = MULTIPLIERS[(qtype, mode)](NT)
    SH = UNIT_SHIFT[qtype]
    PM = (1 << SH) - 1

    @_dev
    def row_dot(wa, wb, wc, wd, nu, row, u, step, xf, xq, xs, cols, acc, ao):
        base = row * nu
        last = nu - 1
        p = u & PM                  # piece of the block: fixed per lane (step % 8 == 0)
        blk = u >> SH
        bstep = step >> SH
        while u < nu:
            # 3 units' loads issued before the first multiply; past the end of the row a
            # lane re-reads its last unit (harmless, L1) instead of branching around a load
            u1 = u + step
            u2 = u1 + step
            v0 = load(wa, wb, wc, wd, base + u)
            v1 = load(wa, wb, wc, wd, base + min(u1, last))
            v2 = load(wa, wb, wc, wd, base + min(u2, last))
            wait()                  # x is the previous kernel's output (PDL builds only)
            mul(v0, blk, p, xf, xq, xs, cols, acc, ao)
            if u1 < nu:
                mul(v1, blk + bstep, p, xf, xq, xs, cols, acc, ao)
            if u2 < nu:
                mul(v2, blk + 2 * bstep, p, xf, xq, xs, cols, acc, ao)
            u = u2 + step
            blk += 3 * bstep
    _row_dots[key] = row_dot
    return row_dot


def _make_reduce(M, KSPLIT, LPR=32):
    """reduce(acc, warp, lane, ks): acc[0:M] of every lane -> the row total in the lanes of
    the k-part-0 warp (warp shuffles over the LPR lanes of a row, then shared memory
    across the KSPLIT warps). With LPR = 16 a warp holds two rows, one per half."""
    assert LPR == 32 or KSPLIT == 1, "two rows per warp only without a k-split"

    @_dev
    def reduce(acc, warp, lane, ks):
        for i in range(M):
            v = acc[i]
            if LPR == 32:
                v += cuda.shfl_xor_sync(FULL, v, 16)
            v += cuda.shfl_xor_sync(FULL, v, 8)      # offsets < 16 stay inside a half-warp
            v += cuda.shfl_xor_sync(FULL, v, 4)
            v += cuda.shfl_xor_sync(FULL, v, 2)
            v += cuda.shfl_xor_sync(FULL, v, 1)
            acc[i] = v
        if KSPLIT > 1:
            red = cuda.shared.array((WARPS, M), float32)
            if lane == 0:
                for i in range(M):
                    red[warp, i] = acc[i]
            cuda.syncthreads()          # every warp of the block reaches this, rows or not
            if ks == 0:
                for k in range(1, KSPLIT):
                    for i in range(M):
                        acc[i] += red[warp + k, i]
    return reduce


def _make_assign(KSPLIT, LPR):
    """assign(gw, lane) -> (row, k-part, first unit, unit step) of a lane of global warp gw:
    LPR = 32: one (row, k-part) per warp, lanes stride 32 * KSPLIT units;
    LPR = 16: two rows per warp (lanes 0-15 and 16-31), each lane strides 16 units. For
    rows of 80 units (2560 columns of Q4_K / Q6_K) that is 5 units per lane instead of
    2 or 3 (the warp's third trip half empty)."""
    LOG = _LOG2[KSPLIT]

    @_dev
    def assign(gw, lane):
        if LPR == 32:
            ks = gw & (KSPLIT - 1)
            return gw >> LOG, ks, lane + 32 * ks, 32 * KSPLIT
        return gw * 2 + (lane >> 4), 0, lane & 15, 16
    return assign


_LOG2 = {1: 0, 2: 1, 4: 2}


# =====================================================================================
# Kernels
# =====================================================================================
def gemv_kernel(qtype, mode, NT, KSPLIT, RESID, LPR=32, PDL=False, NORM=0):
    """y[t, r] = sum_c W[r, c] x[t, c] (+ res[t, r]) for t < NT:
    grid = ceil(rows * KSPLIT / (4 * 32 / LPR)) blocks.

    Arguments (flat, C-contiguous):
      wa, wb, wc: uint32 planes, wd: uint16 plane   the weight (gemv.prepare_weight)
      nu:   units per row                           rows: rows of W
      xf:   float32 [NT * cols]                     xq: uint32 [NT * cols / 4] (int8 q8)
      xs:   float32 [NT * cols / 32] q8 scales      cols: columns of W
      y:    float32 [NT * rows] output              res: float32 [NT * rows] residual (may be y)
    PDL: built for programmatic dependent launch (sm_90+, quant/pdl.py): the next kernel may
    launch at once, and the weight loads start before this one waits for the one before.

    NORM (1: q8 only, 2: q8 and h; needs RESID and NT == 1): the RMSNorm of the new y and
    its q8 activations, by the block that finishes last (engine/norm.py's rmsnorm_q8 at
    block nb, bit for bit: norm_q8_device.make_norm_q8_tail). Extra arguments:
      nw:   float32 [rows] norm weight              eps: float32
      nxq:  int8 [1, rows], nxs: float32 [1, rows / 8]   the q8 of h = rmsnorm(y) * nw
      h:    float32 [1, rows] (written if NORM == 2; otherwise any float32 [1, n])
      counter: int32 [1], 0 before the launch and after it (the last block resets it)
      nb:   the norm's block size to reproduce (a multiple of 32, 32..1024)
    Each block writes its rows of y, fences them (threadfence: visible GPU-wide before the
    count), and thread 0 counts the block with an atomic add; the block that sees
    gridDim - 1 is the last, and all of y is final then. Launches on one stream never
    overlap, so one counter serves every fused launch of a step. (With PDL, thread 0 has
    passed the wait for the kernel before - its lane always has a unit of a row - before
    it counts, so the counter's reset by the previous fused launch is seen.)
    """
    assert NORM in (0, 1, 2) and (not NORM or (RESID and NT == 1)), "NORM: a residual GEMV of one token"
    row_dot = _make_row_dot(qtype, mode, NT, PDL)
    launch_dependents = _pdl_hooks(PDL)[1]
    reduce = _make_reduce(NT, KSPLIT, LPR)
    assign = _make_assign(KSPLIT, LPR)
    SUB = LPR - 1

    @_dev
    def body(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res):
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        row, ks, u0, step = assign(cuda.blockIdx.x * WARPS + warp, lane)
        acc = cuda.local.array(NT, float32)
        for t in range(NT):
            acc[t] = float32(0)
        if row < rows:
            row_dot(wa, wb, wc, wd, nu, row, u0, step, xf, xq, xs, cols, acc, 0)
        reduce(acc, warp, lane, ks)
        if (lane & SUB) == 0 and ks == 0 and row < rows:       # (these lanes passed the wait)
            for t in range(NT):
                i = t * rows + row
                if RESID:
                    y[i] = acc[t] + res[i]      # same thread reads then writes: y may be res
                else:
                    y[i] = acc[t]

    if not NORM:
        @cuda.jit
        def gemv(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res):
            launch_dependents()
            body(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res)
        return kernel_cache.attach(gemv)

    tail = make_norm_q8_tail(BLOCK, NORM == 2)

    @cuda.jit
    def gemv_norm(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res, nw, eps, nxq, nxs, h, counter, nb):
        launch_dependents()
        body(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res)
        last = cuda.shared.array(1, int32)
        cuda.threadfence()                  # this thread's rows of y, visible GPU-wide ...
        cuda.syncthreads()                  # ... for every thread of the block, before the count
        if cuda.threadIdx.x == 0:
            done = cuda.atomic.add(counter, 0, 1)
            is_last = done == cuda.gridDim.x - 1
            if is_last:
                counter[0] = 0              # for the next fused launch (and graph replay)
            cuda.threadfence()              # acquire: the other blocks' y before this block reads it
            last[0] = 1 if is_last else 0
        cuda.syncthreads()
        if last[0] != 0:                    # block-uniform
            tail(y, nw, eps, rows, nb, nxq, nxs, h)
    return kernel_cache.attach(gemv_norm)


def qkv_kernel(specs, NT, KSPLIT, LPR=32, PDL=False):
    """Three weights in one launch; segment s owns blocks [start_s, start_s+1) and writes
    y[t, off_s + r] with off = (0, rows0, rows0 + rows1), ldy = rows0 + rows1 + rows2.
    specs = ((qtype, mode),) * 3. Arguments: per weight (wa, wb, wc, wd, nu, rows), then
    blk1, blk2 (first block of segments 1 and 2), xf, xq, xs, cols, y [NT * ldy]."""
    dots = [_make_row_dot(q, m, NT, PDL) for q, m in specs]
    dot0, dot1, dot2 = dots
    launch_dependents = _pdl_hooks(PDL)[1]
    reduce = _make_reduce(NT, KSPLIT, LPR)
    assign = _make_assign(KSPLIT, LPR)
    SUB = LPR - 1

    @cuda.jit
    def qkv(a0, b0, c0, d0, nu0, rows0, a1, b1, c1, d1, nu1, rows1, a2, b2, c2, d2, nu2, rows2,
            blk1, blk2, xf, xq, xs, cols, y):
        launch_dependents()
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        bid = cuda.blockIdx.x
        ldy = rows0 + rows1 + rows2
        acc = cuda.local.array(NT, float32)
        for t in range(NT):
            acc[t] = float32(0)
        if bid < blk1:                      # block-uniform branch: no divergence
            row, ks, u0, step = assign(bid * WARPS + warp, lane)
            nrows = rows0
            off = 0
            if row < nrows:
                dot0(a0, b0, c0, d0, nu0, row, u0, step, xf, xq, xs, cols, acc, 0)
        elif bid < blk2:
            row, ks, u0, step = assign((bid - blk1) * WARPS + warp, lane)
            nrows = rows1
            off = rows0
            if row < nrows:
                dot1(a1, b1, c1, d1, nu1, row, u0, step, xf, xq, xs, cols, acc, 0)
        else:
            row, ks, u0, step = assign((bid - blk2) * WARPS + warp, lane)
            nrows = rows2
            off = rows0 + rows1
            if row < nrows:
                dot2(a2, b2, c2, d2, nu2, row, u0, step, xf, xq, xs, cols, acc, 0)
        reduce(acc, warp, lane, ks)
        if (lane & SUB) == 0 and ks == 0 and row < nrows:
            for t in range(NT):
                y[t * ldy + off + row] = acc[t]
    return kernel_cache.attach(qkv)


GELU_A = np.float32(0.044715)                             # ggml's GELU_COEF_A
GELU_S = np.float32(0.79788456080286535587989211986876)   # ggml's SQRT_2_OVER_PI
ACTS = ("silu", "gelu")


def swiglu_kernel(gate, up, NT, KSPLIT, LPR=32, ACT="silu", PDL=False):
    """h[t, r] = act(Wg x)[t, r] * (Wu x)[t, r]: each warp streams row r of both weights
    (gate then up; mixed formats just mean two different row loops). act = silu (SwiGLU:
    Qwen, Llama) or gelu, the tanh form (GeGLU: Gemma; engine/norm.py's gelu_reference).
    gate/up = (qtype, mode). Arguments: (wa, wb, wc, wd, nu) of Wg, then of Wu, rows,
    xf, xq, xs, cols, h [NT * rows]."""
    assert ACT in ACTS, ACT
    GELU = ACT == "gelu"
    dot_g = _make_row_dot(gate[0], gate[1], NT, PDL)
    dot_u = _make_row_dot(up[0], up[1], NT, PDL)
    launch_dependents = _pdl_hooks(PDL)[1]
    NT2 = 2 * NT
    reduce = _make_reduce(NT2, KSPLIT, LPR)
    assign = _make_assign(KSPLIT, LPR)
    SUB = LPR - 1

    @cuda.jit
    def swiglu(ga, gb, gc, gd, gnu, ua, ub, uc, ud, unu, rows, xf, xq, xs, cols, h):
        launch_dependents()
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        row, ks, u0, step = assign(cuda.blockIdx.x * WARPS + warp, lane)
        acc = cuda.local.array(NT2, float32)        # [0, NT): gate, [NT, 2 NT): up
        for t in range(NT2):
            acc[t] = float32(0)
        if row < rows:
            dot_g(ga, gb, gc, gd, gnu, row, u0, step, xf, xq, xs, cols, acc, 0)
            dot_u(ua, ub, uc, ud, unu, row, u0, step, xf, xq, xs, cols, acc, NT)
        reduce(acc, warp, lane, ks)
        if (lane & SUB) == 0 and ks == 0 and row < rows:
            for t in range(NT):
                g = acc[t]
                if GELU:
                    th = math.tanh(_GELU_S * g * (float32(1) + _GELU_A * g * g))
                    h[t * rows + row] = float32(0.5) * g * (float32(1) + th) * acc[NT + t]
                else:
                    h[t * rows + row] = g / (float32(1) + math.exp(-g)) * acc[NT + t]
    return kernel_cache.attach(swiglu)


def _make_quantize_q8(PDL):
    launch_dependents = _pdl_hooks(PDL)[1]

    @cuda.jit
    def quantize_q8_kernel(x, xq, xs, n):
        """x float32 [n] -> q8: per 32 values (one warp, one lane each) d = amax / 127 and
        q = rint(x / d) in -127..127 -> xq int8 [n]; xs float32 [n / 8] gets 4 floats per 32:
        (d, d * sum q[0:16], d * sum q[16:32], d * sum q[0:32]). n % 32 == 0.
        Grid: ceil(n / 128) blocks of 128 threads. PDL: the next kernel (a PDL GEMV, which
        waits for this one's output itself) may launch at once."""
        launch_dependents()
        i = cuda.grid(1)
        v = float32(0)
        if i < n:
            v = x[i]
        q, d, s, s_hi = q8_of_warp(v)
        if i < n:
            xq[i] = int8(q)
            if (i & 31) == 0:
                b = (i >> 5) * 4
                xs[b] = d
                xs[b + 1] = d * float32(s)
                xs[b + 2] = d * float32(s_hi)
                xs[b + 3] = d * float32(s + s_hi)
    return kernel_cache.attach(quantize_q8_kernel)   # compiled kernels persist on disk


quantize_q8_kernel = _make_quantize_q8(False)
quantize_q8_pdl_kernel = _make_quantize_q8(True)     # sm_90+ only (quant/pdl.py)
