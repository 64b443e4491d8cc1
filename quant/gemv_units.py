"""Decode GEMV unit decoders of the formats beyond Qwen3's: Q4_0, Q4_1, Q5_1, Q5_K, BF16.

`gemv_kernels.py` holds the row loop, the reduction and the kernels, `gemv_formats.py`
the unit decoders of Q4_K, Q6_K, Q8_0, Q5_0 and F16 (Qwen3's and Gemma's hot formats)
and the format tables; this file adds the other GGUF formats in the same two parts per
format (read gemv_kernels.py's docstring first):

    load_*(wa, wb, wc, wd, g)   one 16-byte unit g of the bulk plane (+ the fields it needs)
    _*_dp4a(NT, xl) / _*_f32(NT, xl)    acc[ao + t] += sum over the unit's weights of w * x[t]
                                (x read by xl: ptx.ldg_v4, or ptx.ld_v4 in a PDL build)

Slots per format (flat views made by gemv.prepare_weight; planes: quant/layout.py):
    Q4_0  wa = qs (16 B = 32 weights a unit), wd = d (fp16)
    Q4_1  wa = qs, wb = dm (uint32 a block: fp16 d | fp16 m << 16)
    Q5_1  wa = qs, wb = qh (uint32 a block), wc = dm
    Q5_K  wa = qs (128 B a block: 8 units), wb = hdr (16 B a block), wc = qh (32 B a block)
    BF16  wa = 8 bf16 weights a unit (4 words)

The q8 activations: x ~ xd * xq per 32 values, xs holds (xd, xd*sum xq[0:16],
xd*sum xq[16:32], xd*sum xq[0:32]) (gemv_reference.quantize_q8_reference). The math per format:
    Q4_0  w = d (q - 8)        sum w x = d (xd sum(q xq) - 8 xd sum(xq))
    Q4_1  w = d q + m          sum w x = d xd sum(q xq) + m xd sum(xq)
    Q5_1  as Q4_1, q has 5 bits (the 5th from qh)
    Q5_K  w = d sc q - dmin mn, as Q4_K (q has 5 bits: bit j of qh byte l belongs to
          sub-block j's weight l)
    BF16  w = the float32 with the bf16 bits on top; fp32 dot with float x ("f32" mode)
What it deliberately does not do: an "f32" mode for the block formats (dp4a reads a
quarter of the bytes of float x and is exact up to x's q8 rounding, which the bound
accounts for), or any row-loop logic.
"""
from __future__ import annotations

from numba import cuda, float32, uint32

from . import ptx
from .formats import QType

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)

LO4 = 0x0F0F0F0F          # low nibble of each byte
F8 = float32(8.0)


@_dev
def dot16(w0, w1, w2, w3, x):
    """Sum of the 16 int8 products of words w0..w3 and the 4-word tuple x (4 dp4a)."""
    s = ptx.dp4a(w0, x[0], 0)
    s = ptx.dp4a(w1, x[1], s)
    s = ptx.dp4a(w2, x[2], s)
    return ptx.dp4a(w3, x[3], s)


@_dev
def spread4(bits):
    """4 bits -> bit 4 of each of 4 bytes (bit k -> byte k): the 5th bit of Q5_0/Q5_1 quants."""
    return ((bits * 0x00204081) & 0x01010101) << 4


# =====================================================================================
# Loaders (g = row * units_per_row + u: the global unit index)
# =====================================================================================
def loaders(ld):
    """{qtype: load(wa, wb, wc, wd, g)} of this file's formats, the 16-byte loads by `ld`
    (ptx.ldg_v4; ptx.ldw_v4 in a PDL build: gemv_formats.loaders)."""
    @_dev
    def load_q4_0(wa, wb, wc, wd, g):
        return ld(wa, g * 4), wd[uint32(g)]

    @_dev
    def load_q4_1(wa, wb, wc, wd, g):
        return ld(wa, g * 4), wb[uint32(g)]

    @_dev
    def load_q5_1(wa, wb, wc, wd, g):
        return ld(wa, g * 4), wb[uint32(g)], wc[uint32(g)]

    @_dev
    def load_q5_k(wa, wb, wc, wd, g):
        # unit p = g & 7 of a block: qs bytes 16p..16p+15 (sub-blocks 2c, 2c + 1 with c = p >> 1,
        # weights 16 (p & 1) + 0..15 of each), so it needs qh bytes 16 (p & 1) + 0..15
        return (ld(wa, g * 4), ld(wb, (g >> 3) * 4),
                ld(wc, (g >> 3) * 8 + (g & 1) * 4))

    @_dev
    def load_bf16(wa, wb, wc, wd, g):
        return ld(wa, g * 4)

    return {QType.Q4_0: load_q4_0, QType.Q4_1: load_q4_1, QType.Q5_1: load_q5_1, QType.Q5_K: load_q5_k,
            QType.BF16: load_bf16}


# =====================================================================================
# Multipliers
# =====================================================================================
@_dev
def _nibbles(q):
    """The 32 unsigned 4-bit quants of a 32-weight block's 16 bytes, as int8 words:
    weights 0..15 (low nibbles) then 16..31 (high nibbles)."""
    return (q[0] & LO4, q[1] & LO4, q[2] & LO4, q[3] & LO4,
            (q[0] >> 4) & LO4, (q[1] >> 4) & LO4, (q[2] >> 4) & LO4, (q[3] >> 4) & LO4)


@_dev
def q5_words(q, qh):
    """The 32 unsigned 5-bit quants of a Q5_0 / Q5_1 block as 8 words of 4 bytes: weight j <
    16 is the low nibble of byte j plus bit j of qh, weight 16 + j the high nibble plus bit
    16 + j (a0..a3: weights 0..15, b0..b3: 16..31)."""
    return ((q[0] & LO4) | spread4(qh & 15), (q[1] & LO4) | spread4((qh >> 4) & 15),
            (q[2] & LO4) | spread4((qh >> 8) & 15), (q[3] & LO4) | spread4((qh >> 12) & 15),
            ((q[0] >> 4) & LO4) | spread4((qh >> 16) & 15), ((q[1] >> 4) & LO4) | spread4((qh >> 20) & 15),
            ((q[2] >> 4) & LO4) | spread4((qh >> 24) & 15), ((q[3] >> 4) & LO4) | spread4((qh >> 28) & 15))


_block_dots = {}


def _block_dot_of(xl):
    """block_dot(a0..a3, b0..b3, xq, o) = sum(q xq) over one 32-weight block at column o of
    the flat activations, read by xl (ptx.ldg_v4, or ptx.ld_v4 in a PDL build)."""
    if xl not in _block_dots:
        @_dev
        def block_dot(a0, a1, a2, a3, b0, b1, b2, b3, xq, o):
            s = dot16(a0, a1, a2, a3, xl(xq, o >> 2))
            return s + dot16(b0, b1, b2, b3, xl(xq, (o + 16) >> 2))
        _block_dots[xl] = block_dot
    return _block_dots[xl]


def _q4_0_dp4a(NT, xl=ptx.ldg_v4):
    _block_dot = _block_dot_of(xl)

    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, dbits = v
        d = ptx.f16_bits_to_f32(uint32(dbits))
        a0, a1, a2, a3, b0, b1, b2, b3 = _nibbles(q)
        pa = blk * 32
        for t in range(NT):
            o = t * cols + pa
            z = xl(xs, (o >> 5) * 4)
            s = _block_dot(a0, a1, a2, a3, b0, b1, b2, b3, xq, o)
            acc[ao + t] += d * (z[0] * float32(s) - F8 * z[3])
    return mul


def _q4_1_dp4a(NT, xl=ptx.ldg_v4):
    _block_dot = _block_dot_of(xl)

    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, dm = v
        d, m = ptx.unpack_half2(dm)
        a0, a1, a2, a3, b0, b1, b2, b3 = _nibbles(q)
        pa = blk * 32
        for t in range(NT):
            o = t * cols + pa
            z = xl(xs, (o >> 5) * 4)
            s = _block_dot(a0, a1, a2, a3, b0, b1, b2, b3, xq, o)
            acc[ao + t] += d * z[0] * float32(s) + m * z[3]
    return mul


def _q5_1_dp4a(NT, xl=ptx.ldg_v4):
    _block_dot = _block_dot_of(xl)

    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, qh, dm = v
        d, m = ptx.unpack_half2(dm)
        # weight j < 16: low nibble of byte j + bit j of qh; 16 + j: high nibble + bit 16 + j
        a0, a1, a2, a3, b0, b1, b2, b3 = q5_words(q, qh)
        pa = blk * 32
        for t in range(NT):
            o = t * cols + pa
            z = xl(xs, (o >> 5) * 4)
            s = _block_dot(a0, a1, a2, a3, b0, b1, b2, b3, xq, o)
            acc[ao + t] += d * z[0] * float32(s) + m * z[3]
    return mul


def _q5k_dp4a(NT, k_scales, xl=ptx.ldg_v4):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        q, h, qh = v
        c = p >> 1
        dm = ptx.unpack_half2(h[0])                    # (d, dmin)
        sca, mna, scb, mnb = k_scales(h, c)
        da = dm[0] * float32(sca)
        db = dm[0] * float32(scb)
        ma = dm[1] * float32(mna)
        mb = dm[1] * float32(mnb)
        # 5th bits: bit 2c of each qh byte (run A = sub-block 2c), bit 2c + 1 (run B);
        # constant shifts and selects (a shift by a variable is a 64-bit op in numba)
        h0, h1, h2, h3 = qh[0], qh[1], qh[2], qh[3]
        if c >= 2:
            h0, h1, h2, h3 = h0 >> 4, h1 >> 4, h2 >> 4, h3 >> 4
        if c & 1:
            h0, h1, h2, h3 = h0 >> 2, h1 >> 2, h2 >> 2, h3 >> 2
        a0 = (q[0] & LO4) | ((h0 & 0x01010101) << 4)
        a1 = (q[1] & LO4) | ((h1 & 0x01010101) << 4)
        a2 = (q[2] & LO4) | ((h2 & 0x01010101) << 4)
        a3 = (q[3] & LO4) | ((h3 & 0x01010101) << 4)
        b0 = ((q[0] >> 4) & LO4) | (((h0 >> 1) & 0x01010101) << 4)
        b1 = ((q[1] >> 4) & LO4) | (((h1 >> 1) & 0x01010101) << 4)
        b2 = ((q[2] >> 4) & LO4) | (((h2 >> 1) & 0x01010101) << 4)
        b3 = ((q[3] >> 4) & LO4) | (((h3 >> 1) & 0x01010101) << 4)
        odd = (p & 1) != 0
        pa = blk * 256 + c * 64 + (p & 1) * 16          # column of run A; run B is 32 further
        for t in range(NT):
            o = t * cols + pa
            xa = xl(xq, o >> 2)
            xb = xl(xq, (o + 32) >> 2)
            sa = xl(xs, (o >> 5) * 4)
            sb = xl(xs, ((o + 32) >> 5) * 4)
            ra = da * sa[0] * float32(dot16(a0, a1, a2, a3, xa)) - ma * (sa[2] if odd else sa[1])
            rb = db * sb[0] * float32(dot16(b0, b1, b2, b3, xb)) - mb * (sb[2] if odd else sb[1])
            acc[ao + t] += ra + rb
    return mul


@_dev
def _bf16_pair(v):
    """(weight 2i, weight 2i + 1) of word v: bf16 bits are a float32's high half."""
    return ptx.bits_to_f32(uint32(v) << 16), ptx.bits_to_f32(uint32(v) & uint32(0xFFFF0000))


def _bf16_f32(NT, xl=ptx.ldg_v4):
    @_dev
    def mul(v, blk, p, xf, xq, xs, cols, acc, ao):
        w0, w1 = _bf16_pair(v[0])
        w2, w3 = _bf16_pair(v[1])
        w4, w5 = _bf16_pair(v[2])
        w6, w7 = _bf16_pair(v[3])
        pa = blk * 8
        for t in range(NT):
            o = t * cols + pa
            xa = xl(xf, o)
            xb = xl(xf, o + 4)
            acc[ao + t] += (w0 * xa[0] + w1 * xa[1] + w2 * xa[2] + w3 * xa[3]
                            + w4 * xb[0] + w5 * xb[1] + w6 * xb[2] + w7 * xb[3])
    return mul
