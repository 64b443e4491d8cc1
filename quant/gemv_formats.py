"""Decode GEMV unit decoders: what one 16-byte unit of each format multiplies to.

Every format is streamed in units of 16 bytes of its bulk quants plane (one
`ld.global.nc.v4`), which hold 32 weights for Q4_K / Q6_K / Q5_0, 16 for Q8_0 and 8 for
F16. Per format this file has two parts (read gemv_kernels.py's docstring first: the
row loop that calls them):

    load_*(wa, wb, wc, wd, g)   one 16-byte unit g of the bulk plane (+ the block header
                                or fields it needs)
    _*_dp4a(NT) / _*_f32(NT)    acc[ao + t] += sum over the unit's weights of w * x[t]
                                for the NT tokens

It holds the decoders of Q4_K, Q6_K, Q8_0, Q5_0 and F16 (Qwen3's and Gemma's hot formats)
and the tables the kernels look formats up in - `LOADERS`, `MULTIPLIERS` (keyed by
(qtype, mode)), `UNIT_WEIGHTS`, `UNIT_SHIFT`, `MODES` - which also name the other formats'
decoders in `gemv_units.py` (Q4_0, Q4_1, Q5_1, Q5_K, BF16).

What it deliberately does not do: walk rows, reduce or launch (gemv_kernels.py).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from . import gemv_units as U
from .gemv_units import dot16 as _dot16
from . import ptx
from .formats import QType
from .pdl import weight_loads

LO4 = 0x0F0F0F0F          # low nibble of each byte
MAGIC = 0x64006400        # two fp16 1024.0: (q | MAGIC) as half2 is (1024 + q_lo, 1024 + q_hi)
F1024 = np.float32(1024.0)
F1056 = np.float32(1056.0)            # 1024 + 32: Q6_K quants are q - 32
F32 = np.float32(32.0)
F16_ = np.float32(16.0)

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

# =====================================================================================
# Unit loaders. g = row * units_per_row + u is the global unit index; planes are flat
# (wa, wb, wc: uint32 words; wd: uint16 fp16 bits), see gemv.prepare_weight.
# =====================================================================================
def _loaders(ld):
    @_dev
    def load_q4k(wa, wb, wc, wd, g):
        # wa = qs  (128 B per 256-weight block: 8 units), wb = hdr (16 B per block)
        return ld(wa, g * 4), ld(wb, (g >> 3) * 4)

    @_dev
    def load_q6k(wa, wb, wc, wd, g):
        # wa = ql (128 B/block: unit p = bytes 16p..16p+15), wb = qh (64 B/block: the unit
        # needs piece 2h + g of 4, h = p >> 2, g = p & 1), wc = sc (16 int8/block), wd = d
        p = g & 7
        b = g >> 3
        return (ld(wa, g * 4), ld(wb, (b * 4 + (p >> 2) * 2 + (p & 1)) * 4),
                ld(wc, b * 4), wd[uint32(b)])

    @_dev
    def load_q8_0(wa, wb, wc, wd, g):
        # wa = qs (32 B per 32-weight block: 2 units), wd = d
        return ld(wa, g * 4), wd[uint32(g >> 1)]

    @_dev
    def load_q5_0(wa, wb, wc, wd, g):
        # wa = qs (16 B per block = 1 unit), wb = qh (one uint32 per block), wd = d
        return ld(wa, g * 4), wb[uint32(g)], wd[uint32(g)]

    @_dev
    def load_f16(wa, wb, wc, wd, g):
        # wa = 8 fp16 weights per unit, as 4 words
        return ld(wa, g * 4)

    return {QType.Q4_K: load_q4k, QType.Q6_K: load_q6k, QType.Q8_0: load_q8_0, QType.Q5_0: load_q5_0,
            QType.F16: load_f16, **U.loaders(ld)}


# the plain builds' and the programmatic-dependent-launch builds' (whose loads before
# griddepcontrol.wait must stay there: quant/pdl.py weight_loads, rule 2)
LOADERS = _loaders(weight_loads(False)[1])
PDL_LOADERS = _loaders(weight_loads(True)[1])


def loaders(PDL: bool):
    """{qtype: load(wa, wb, wc, wd, g)}: the unit loaders of a plain build, or of a PDL build."""
    return PDL_LOADERS if PDL else LOADERS


# =====================================================================================
# Unit multipliers: acc[ao + t] += sum over the unit's weights of w * x[t], for t < NT.
# blk = format block of the unit inside the row, p = the unit's piece of that block (the
# same for every unit a lane visits: the lane stride is a multiple of 8 units).
# Activations, flat: xf float32 [n_tok * cols]; xq uint32 words of the int8 q8 values;
# xs float32, 4 per 32 values: (d, d * sum q[0:16], d * sum q[16:32], d * sum q[0:32]),
# so that x ~ d * q and the sums serve the formats' offsets (Q4_K min, Q6_K -32, Q5_0 -16).
# Each factory takes NT and xl, the activations' 16-byte load: ptx.ldg_v4 (read-only path),
# or ptx.ld_v4 in a programmatic-dependent-launch build, whose activations the kernel before
# may still be writing when this one starts (gemv_kernels._make_row_dot).
# =====================================================================================
def _q4k_dp4a(NT, xl=ptx.ldg_v4):
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
            xa = xl(xq, o >> 2)
            xb = xl(xq, (o + 32) >> 2)
            sa = xl(xs, (o >> 5) * 4)
            sb = xl(xs, ((o + 32) >> 5) * 4)
            # w = d*sc*q - dmin*m, x ~ xd*xq: sum w x = d*sc*xd*sum(q xq) - dmin*m*xd*sum(xq)
            ra = da * sa[0] * float32(_dot16(a0, a1, a2, a3, xa)) - ma * (sa[2] if odd else sa[1])
            rb = db * sb[0] * float32(_dot16(b0, b1, b2, b3, xb)) - mb * (sb[2] if odd else sb[1])
            acc[ao + t] += ra + rb
    return mul


def _q4k_f32(NT, xl=ptx.ldg_v4):
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
            s = _dot4f(wa0, xl(xf, o)) + _dot4f(wa1, xl(xf, o + 4))
            s += _dot4f(wa2, xl(xf, o + 8)) + _dot4f(wa3, xl(xf, o + 12))
            s += _dot4f(wb0, xl(xf, o + 32)) + _dot4f(wb1, xl(xf, o + 36))
            s += _dot4f(wb2, xl(xf, o + 40)) + _dot4f(wb3, xl(xf, o + 44))
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


def _q6k_dp4a(NT, xl=ptx.ldg_v4):
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
            xa = xl(xq, o >> 2)
            xb = xl(xq, (o + 64) >> 2)
            za = xl(xs, (o >> 5) * 4)
            zb = xl(xs, ((o + 64) >> 5) * 4)
            # w = d*sc*(q - 32): sum w x = d*sc*(xd*sum(q xq) - 32*xd*sum(xq)), q unsigned
            ra = za[0] * float32(_dot16(a0, a1, a2, a3, xa)) - F32 * (za[2] if odd else za[1])
            rb = zb[0] * float32(_dot16(b0, b1, b2, b3, xb)) - F32 * (zb[2] if odd else zb[1])
            acc[ao + t] += fa * ra + fb * rb
    return mul


def _q6k_f32(NT, xl=ptx.ldg_v4):
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
            s = _dot4f(wa0, xl(xf, o)) + _dot4f(wa1, xl(xf, o + 4))
            s += _dot4f(wa2, xl(xf, o + 8)) + _dot4f(wa3, xl(xf, o + 12))
            s += _dot4f(wb0, xl(xf, o + 64)) + _dot4f(wb1, xl(xf, o + 68))
            s += _dot4f(wb2, xl(xf, o + 72)) + _dot4f(wb3, xl(xf, o + 76))
            acc[ao + t] += s
    return mul


def _q8_0_dp4a(NT, xl=ptx.ldg_v4):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, dbits = v
        d = ptx.f16_bits_to_f32(uint32(dbits))
        pa = blk * 32 + p * 16                  # 16 weights: half p of 32-weight block blk
        for t in range(NT):
            o = t * cols + pa
            acc[ao + t] += d * xs[uint32((o >> 5) * 4)] * float32(
                _dot16(q[0], q[1], q[2], q[3], xl(xq, o >> 2)))
    return mul


def _q5_0_dp4a(NT, xl=ptx.ldg_v4):
    block_dot = U._block_dot_of(xl)

    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, qh, dbits = v
        d = ptx.f16_bits_to_f32(uint32(dbits))
        a0, a1, a2, a3, b0, b1, b2, b3 = U.q5_words(q, qh)     # unsigned q in 0..31
        pa = blk * 32
        for t in range(NT):
            o = t * cols + pa
            z = xl(xs, (o >> 5) * 4)
            s = block_dot(a0, a1, a2, a3, b0, b1, b2, b3, xq, o)
            # w = d (q - 16): sum w x = d (xd sum(q xq) - 16 xd sum(xq))
            acc[ao + t] += d * (z[0] * float32(s) - F16_ * z[3])
    return mul


def _f16_f32(NT, xl=ptx.ldg_v4):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        w01 = ptx.unpack_half2(v[0])
        w23 = ptx.unpack_half2(v[1])
        w45 = ptx.unpack_half2(v[2])
        w67 = ptx.unpack_half2(v[3])
        pa = blk * 8
        for t in range(NT):
            o = t * cols + pa
            xa = xl(xf, o)
            xb = xl(xf, o + 4)
            acc[ao + t] += (w01[0] * xa[0] + w01[1] * xa[1] + w23[0] * xa[2] + w23[1] * xa[3]
                            + w45[0] * xb[0] + w45[1] * xb[1] + w67[0] * xb[2] + w67[1] * xb[3])
    return mul


MULTIPLIERS = {(QType.Q4_K, "dp4a"): _q4k_dp4a, (QType.Q4_K, "f32"): _q4k_f32,
               (QType.Q6_K, "dp4a"): _q6k_dp4a, (QType.Q6_K, "f32"): _q6k_f32,
               (QType.Q8_0, "dp4a"): _q8_0_dp4a, (QType.Q5_0, "dp4a"): _q5_0_dp4a,
               (QType.F16, "f32"): _f16_f32,
               (QType.Q4_0, "dp4a"): U._q4_0_dp4a, (QType.Q4_1, "dp4a"): U._q4_1_dp4a,
               (QType.Q5_1, "dp4a"): U._q5_1_dp4a, (QType.Q5_K, "dp4a"): lambda NT, xl=ptx.ldg_v4: U._q5k_dp4a(NT, _k_scales, xl),
               (QType.BF16, "f32"): U._bf16_f32}
