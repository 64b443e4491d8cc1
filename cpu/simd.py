"""SIMD primitives for the CPU kernels: short LLVM IR sequences exposed to numba as intrinsics.

Why they exist. The kernels run with fastmath off, so LLVM may not reorder float
additions and never vectorises a float reduction written as a loop; and numba's
auto-vectoriser does poorly on the many short (16-, 32-element) integer reductions of
the GGUF block formats (it unrolls fixed trip counts without vectorising, and for
runtime trip counts shorter than its unrolled vector body it runs the scalar
remainder). Measured on the 2-core dev machine (AMD EPYC Zen 5, hot cache, one core):
an int8 block-dot loop in plain numba 8.5 G multiply-adds/s, `dot_i8` below 22.9.
So the hot inner steps are written once here, as whole-vector IR that LLVM lowers to
the machine's SIMD (AVX-512/AVX2 pmaddwd on x86, NEON on aarch64):

    dot_i8(a, ao, b, bo, N)        sum_j a[ao+j] * b[bo+j], j < N         int8 x int8 -> int32
    dot_i16_i8(a, ao, b, bo, N)    the same with a int16                   -> int32
    dot_f32(a, ao, b, bo, N)       float32 x float32, fixed-order tree sum -> float32
    dot_f32_i8(a, ao, b, bo, N)    float32 x float32(int8)                 -> float32
    dot_f32_f16(a, ao, b, bo, N)   float32 x float32(f16 bits, uint16)    -> float32
    dot_f32_bf16(a, ao, b, bo, N)  float32 x float32(bf16 bits, uint16)   -> float32
    unpack_<fmt>(w, wo, dst, do)   one GGUF block at byte wo of uint8 w -> its quants,
                                   int8, weight order, into dst[do:]: q4_0 (-8..7),
                                   q4_1 (0..15), q5_0 (-16..15), q5_1 (0..31), q8_0
                                   (32 weights); q4_k (0..15), q5_k (0..31), q6_k
                                   (-32..31) (256 weights)
    unpack_scaled_<k>(w, wo, sc, so, dst, do)   a k-quant super-block's quants times
                                   their integer sub-block scales sc[so:] (int16), as
                                   int16 into dst[do:] (|value| <= 4096)
    dot_<fmt>(w, wo, x, xo)        unpack fused with dot_i8 against int8 x (32-blocks)
    dot_scaled_<k>(w, wo, sc, so, x, xo)   unpack_scaled fused with the int16 x int8 dot
    load_f16(a, ao)                one fp16 (a block scale) -> float32
    store_f16(a, ao, v)            float32 -> one fp16 (round to nearest even)

Integer sums are exact in any order, so LLVM is free to pair and tree them. The float
dots multiply lane-wise and then add by halving the vector (lanes j and j + N/2, ...,
down to one): a fixed order, the same on every call, so a result depends only on the
inputs (never on n, the thread, or what LLVM unrolled around it). N is a literal
(a compile-time constant) in every primitive.

Contracts (the callers' launchers check them; nothing here checks bounds): the arrays
are C-contiguous (any ndim), offsets are flat element indices (row t of a 2-D x [n, k]
starts at t * k), and [ao, ao + N) lies inside the array. Loads are unaligned (align 1). Block layouts: quant/legacy.py and
quant/kquants.py.

What it deliberately does not do: loops, threads, or scales. Each primitive is a
straight-line vector expression; the kernels around them (linear_kernels.py,
attention.py) own the loops, and the fp16 block scales are read there (`f16_to_f32`).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I1, _I8, _I16, _I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F16, _F32 = ir.HalfType(), ir.FloatType()


# -- IR helpers (run at compile time, inside intrinsic codegen) ------------------------

def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, value):
    return ir.Constant(_vec(t, n), [ir.Constant(t, value)] * n)


def _mask(idx):
    return ir.Constant(_vec(_I32, len(idx)), [ir.Constant(_I32, i) for i in idx])


def _load(context, builder, aty, aval, off, vty):
    """Load vector type vty from element `off` of the 1-D array aval (unaligned)."""
    ary = context.make_array(aty)(context, builder, aval)
    elt = context.get_data_type(aty.dtype)
    ptr = builder.gep(ary.data, [off], inbounds=True, source_etype=elt)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), typ=vty, align=1)


def _store(context, builder, aty, aval, off, value):
    ary = context.make_array(aty)(context, builder, aval)
    elt = context.get_data_type(aty.dtype)
    ptr = builder.gep(ary.data, [off], inbounds=True, source_etype=elt)
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=1)


def _concat(builder, parts):
    """Concatenate equal-length vectors, in order."""
    while len(parts) > 1:
        nxt = []
        for i in range(0, len(parts), 2):
            a, b = parts[i], parts[i + 1]
            n = a.type.count
            nxt.append(builder.shuffle_vector(a, b, _mask(range(2 * n))))
        parts = nxt
    return parts[0]


def _slice(builder, v, start, n):
    return builder.shuffle_vector(v, v, _mask(range(start, start + n)))


def _reduce_add_i32(builder, v):
    fnty = ir.FunctionType(_I32, [v.type])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.vector.reduce.add.v{v.type.count}i32")
    return builder.call(fn, [v])


def _tree_fadd(builder, v):
    """Sum the lanes of a float vector by halving: (lane j) + (lane j + n/2), repeated.
    A fixed order (no reassociation needed), so the same bits on every call."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.fadd(_slice(builder, v, 0, n), _slice(builder, v, n, n))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _nibbles(builder, qs):
    """<m x i8> packed bytes -> (low nibbles, high nibbles), each <m x i8> in 0..15."""
    m = qs.type.count
    lo = builder.and_(qs, _splat(_I8, m, 15))
    hi = builder.lshr(qs, _splat(_I8, m, 4))
    return lo, hi


def _bits_to_i8(builder, word):
    """i32 -> <32 x i8>: lane j is bit j of the word (0 or 1)."""
    bits = builder.bitcast(word, _vec(_I1, 32))
    return builder.zext(bits, _vec(_I8, 32))


def _c_array(t):
    """Offsets are flat element indices, so only C-contiguous arrays (any ndim) qualify."""
    return isinstance(t, types.Array) and t.layout == "C"


def _literal(n):
    return n.literal_value if isinstance(n, types.IntegerLiteral) else None


# -- block decoders: (w uint8 array, byte offset of the block) -> int8 quants -----------
# Each returns the block's quants in weight order as an <N x i8> vector; the scale math
# stays in the kernels. Layout references: quant/legacy.py, quant/kquants.py.

def _dec_q8_0(ctx, b, wty, w, wo):
    return _load(ctx, b, wty, w, b.add(wo, _const64(2)), _vec(_I8, 32))          # qs[32] after fp16 d


def _dec_q4_0(ctx, b, wty, w, wo):
    lo, hi = _nibbles(b, _load(ctx, b, wty, w, b.add(wo, _const64(2)), _vec(_I8, 16)))
    return b.sub(_concat(b, [lo, hi]), _splat(_I8, 32, 8))                        # q - 8


def _dec_q4_1(ctx, b, wty, w, wo):
    lo, hi = _nibbles(b, _load(ctx, b, wty, w, b.add(wo, _const64(4)), _vec(_I8, 16)))
    return _concat(b, [lo, hi])                                                  # d, m, then qs


def _q5(ctx, b, wty, w, qh_off, qs_off):
    lo, hi = _nibbles(b, _load(ctx, b, wty, w, qs_off, _vec(_I8, 16)))
    qh = _load(ctx, b, wty, w, qh_off, _I32)                                      # bit j = 5th bit of weight j
    return b.or_(_concat(b, [lo, hi]), b.shl(_bits_to_i8(b, qh), _splat(_I8, 32, 4)))


def _dec_q5_0(ctx, b, wty, w, wo):
    q = _q5(ctx, b, wty, w, b.add(wo, _const64(2)), b.add(wo, _const64(6)))
    return b.sub(q, _splat(_I8, 32, 16))


def _dec_q5_1(ctx, b, wty, w, wo):
    return _q5(ctx, b, wty, w, b.add(wo, _const64(4)), b.add(wo, _const64(8)))


def _dec_q4_k(ctx, b, wty, w, wo):
    parts = []
    for c in range(4):                      # chunk c: sub-block 2c in low nibbles, 2c+1 in high
        lo, hi = _nibbles(b, _load(ctx, b, wty, w, b.add(wo, _const64(16 + 32 * c)), _vec(_I8, 32)))
        parts += [lo, hi]
    return _concat(b, parts)


def _dec_q5_k(ctx, b, wty, w, wo):
    qh = _load(ctx, b, wty, w, b.add(wo, _const64(16)), _vec(_I8, 32))           # bit j of qh[l]: sub-block j
    parts = []
    for c in range(4):
        lo, hi = _nibbles(b, _load(ctx, b, wty, w, b.add(wo, _const64(48 + 32 * c)), _vec(_I8, 32)))
        for j, nib in ((2 * c, lo), (2 * c + 1, hi)):
            bit = b.and_(b.lshr(qh, _splat(_I8, 32, j)), _splat(_I8, 32, 1))
            parts.append(b.or_(nib, b.shl(bit, _splat(_I8, 32, 4))))
    return _concat(b, parts)


def _dec_q6_k(ctx, b, wty, w, wo):
    parts = []
    for h in range(2):                      # two halves of 128 weights
        ql0 = _load(ctx, b, wty, w, b.add(wo, _const64(64 * h)), _vec(_I8, 32))
        ql1 = _load(ctx, b, wty, w, b.add(wo, _const64(64 * h + 32)), _vec(_I8, 32))
        qh = _load(ctx, b, wty, w, b.add(wo, _const64(128 + 32 * h)), _vec(_I8, 32))
        lo0, hi0 = _nibbles(b, ql0)
        lo1, hi1 = _nibbles(b, ql1)
        for k, low in enumerate((lo0, lo1, hi0, hi1)):     # quarter k: ql[32 (k % 2) + l] >> 4 (k // 2)
            high = b.and_(b.lshr(qh, _splat(_I8, 32, 2 * k)), _splat(_I8, 32, 3))
            q = b.or_(low, b.shl(high, _splat(_I8, 32, 4)))
            parts.append(b.sub(q, _splat(_I8, 32, 32)))
    return _concat(b, parts)


def _const64(v):
    return ir.Constant(ir.IntType(64), v)


def _make_unpack(decoder, n_weights, name):
    @intrinsic
    def unpack(typingctx, w, wo, dst, do):
        """dst[do : do + N] = the int8 quants of the block at byte wo of w (see module doc)."""
        if not (_c_array(w) and _c_array(dst)):
            return None
        sig = types.void(w, wo, dst, do)

        def codegen(context, builder, signature, args):
            wv, wov, dv, dov = args
            wov = context.cast(builder, wov, signature.args[1], types.int64)
            dov = context.cast(builder, dov, signature.args[3], types.int64)
            q = decoder(context, builder, signature.args[0], wv, wov)
            _store(context, builder, signature.args[2], dv, dov, q)
            return context.get_dummy_value()

        return sig, codegen

    unpack.__name__ = unpack.__qualname__ = name
    unpack.n_weights = n_weights
    return unpack


def _make_unpack_scaled(decoder, n_sub, name):
    @intrinsic
    def unpack_scaled(typingctx, w, wo, sc, so, dst, do):
        """dst[do : do + 256] = quant * sc[so + sub-block] as int16, for a k-quant super-block
        at byte wo of w; sc int16 holds the block's n_sub integer sub-block scales."""
        if not (_c_array(w) and _c_array(sc) and _c_array(dst)):
            return None
        sig = types.void(w, wo, sc, so, dst, do)

        def codegen(context, builder, signature, args):
            wv, wov, scv, sov, dv, dov = args
            wov = context.cast(builder, wov, signature.args[1], types.int64)
            sov = context.cast(builder, sov, signature.args[3], types.int64)
            dov = context.cast(builder, dov, signature.args[5], types.int64)
            q = builder.sext(decoder(context, builder, signature.args[0], wv, wov), _vec(_I16, 256))
            s = _scale_vector(context, builder, signature.args[2], scv, sov, n_sub)
            _store(context, builder, signature.args[4], dv, dov, builder.mul(q, s))
            return context.get_dummy_value()

        return sig, codegen

    unpack_scaled.__name__ = unpack_scaled.__qualname__ = name
    return unpack_scaled


def _int_dot(builder, q, x):
    """reduce_add(sext(q) * sext(x)) as int32: LLVM lowers it to pmaddwd (x86) or
    smull/sadalp (NEON) and a horizontal add."""
    n = q.type.count
    return _reduce_add_i32(builder, builder.mul(builder.sext(q, _vec(_I32, n)), builder.sext(x, _vec(_I32, n))))


def _make_fused_dot(decoder, n_weights, name):
    @intrinsic
    def dot_block(typingctx, w, wo, x, xo):
        """sum_j quant_j * x[xo + j] over the block at byte wo of w: an exact int32."""
        if not (_c_array(w) and _c_array(x)):
            return None
        sig = types.int32(w, wo, x, xo)

        def codegen(context, builder, signature, args):
            wv, wov, xv, xov = args
            wov = context.cast(builder, wov, signature.args[1], types.int64)
            xov = context.cast(builder, xov, signature.args[3], types.int64)
            q = decoder(context, builder, signature.args[0], wv, wov)
            xq = _load(context, builder, signature.args[2], xv, xov, _vec(_I8, n_weights))
            return _int_dot(builder, q, xq)

        return sig, codegen

    dot_block.__name__ = dot_block.__qualname__ = name
    return dot_block


def _scale_vector(context, builder, scty, scv, sov, n_sub):
    """<256 x i16>: sub-block scale sc[so + i // (256 / n_sub)] for weight i."""
    s = _load(context, builder, scty, scv, sov, _vec(_I16, n_sub))
    per = 256 // n_sub
    return builder.shuffle_vector(s, s, _mask([i // per for i in range(256)]))


def _make_fused_scaled_dot(decoder, n_sub, name):
    @intrinsic
    def dot_block(typingctx, w, wo, sc, so, x, xo):
        """sum_i quant_i * sc[so + sub-block(i)] * x[xo + i] over a k-quant super-block: int32."""
        if not (_c_array(w) and _c_array(sc) and _c_array(x)):
            return None
        sig = types.int32(w, wo, sc, so, x, xo)

        def codegen(context, builder, signature, args):
            wv, wov, scv, sov, xv, xov = args
            wov = context.cast(builder, wov, signature.args[1], types.int64)
            sov = context.cast(builder, sov, signature.args[3], types.int64)
            xov = context.cast(builder, xov, signature.args[5], types.int64)
            q = builder.sext(decoder(context, builder, signature.args[0], wv, wov), _vec(_I16, 256))
            q = builder.mul(q, _scale_vector(context, builder, signature.args[2], scv, sov, n_sub))
            xq = _load(context, builder, signature.args[4], xv, xov, _vec(_I8, 256))
            return _int_dot(builder, q, xq)

        return sig, codegen

    dot_block.__name__ = dot_block.__qualname__ = name
    return dot_block


@intrinsic
def load_f16(typingctx, a, ao):
    """float32 of the IEEE binary16 at element ao of a (bytes: a uint8 array, offset in
    bytes; or a uint16 array). Exact. One vcvtph2ps on x86 (F16C), fcvt on aarch64."""
    if not _c_array(a):
        return None
    sig = types.float32(a, ao)

    def codegen(context, builder, signature, args):
        av, aov = args
        aov = context.cast(builder, aov, signature.args[1], types.int64)
        h = _load(context, builder, signature.args[0], av, aov, _I16)
        return builder.fpext(builder.bitcast(h, _F16), _F32)

    return sig, codegen


@intrinsic
def store_f16(typingctx, a, ao, value):
    """a[ao] = IEEE binary16 of float32 `value` (round to nearest even, as numpy), a uint16."""
    if not _c_array(a):
        return None
    sig = types.void(a, ao, value)

    def codegen(context, builder, signature, args):
        av, aov, v = args
        aov = context.cast(builder, aov, signature.args[1], types.int64)
        v = context.cast(builder, v, signature.args[2], types.float32)
        h = builder.bitcast(builder.fptrunc(v, _F16), _I16)
        ary = context.make_array(signature.args[0])(context, builder, av)
        ptr = builder.gep(ary.data, [aov], inbounds=True, source_etype=context.get_data_type(signature.args[0].dtype))
        builder.store(h, builder.bitcast(ptr, _I16.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


unpack_q8_0 = _make_unpack(_dec_q8_0, 32, "unpack_q8_0")
unpack_q4_0 = _make_unpack(_dec_q4_0, 32, "unpack_q4_0")
unpack_q4_1 = _make_unpack(_dec_q4_1, 32, "unpack_q4_1")
unpack_q5_0 = _make_unpack(_dec_q5_0, 32, "unpack_q5_0")
unpack_q5_1 = _make_unpack(_dec_q5_1, 32, "unpack_q5_1")
unpack_q4_k = _make_unpack(_dec_q4_k, 256, "unpack_q4_k")
unpack_q5_k = _make_unpack(_dec_q5_k, 256, "unpack_q5_k")
unpack_q6_k = _make_unpack(_dec_q6_k, 256, "unpack_q6_k")
unpack_scaled_q4_k = _make_unpack_scaled(_dec_q4_k, 8, "unpack_scaled_q4_k")
unpack_scaled_q5_k = _make_unpack_scaled(_dec_q5_k, 8, "unpack_scaled_q5_k")
unpack_scaled_q6_k = _make_unpack_scaled(_dec_q6_k, 16, "unpack_scaled_q6_k")

dot_q8_0 = _make_fused_dot(_dec_q8_0, 32, "dot_q8_0")
dot_q4_0 = _make_fused_dot(_dec_q4_0, 32, "dot_q4_0")
dot_q4_1 = _make_fused_dot(_dec_q4_1, 32, "dot_q4_1")
dot_q5_0 = _make_fused_dot(_dec_q5_0, 32, "dot_q5_0")
dot_q5_1 = _make_fused_dot(_dec_q5_1, 32, "dot_q5_1")
dot_scaled_q4_k = _make_fused_scaled_dot(_dec_q4_k, 8, "dot_scaled_q4_k")
dot_scaled_q5_k = _make_fused_scaled_dot(_dec_q5_k, 8, "dot_scaled_q5_k")
dot_scaled_q6_k = _make_fused_scaled_dot(_dec_q6_k, 16, "dot_scaled_q6_k")


# -- dot products -----------------------------------------------------------------------

def _make_int_dot(a_bits, name):
    @intrinsic
    def dot(typingctx, a, ao, b, bo, n):
        N = _literal(n)
        if N is None or not (_c_array(a) and _c_array(b)):
            return None
        sig = types.int32(a, ao, b, bo, n)

        def codegen(context, builder, signature, args):
            av, aov, bv, bov, _ = args
            aov = context.cast(builder, aov, signature.args[1], types.int64)
            bov = context.cast(builder, bov, signature.args[3], types.int64)
            va = _load(context, builder, signature.args[0], av, aov, _vec(ir.IntType(a_bits), N))
            vb = _load(context, builder, signature.args[2], bv, bov, _vec(_I8, N))
            # widen to i32 and multiply; LLVM turns sext+mul+add-pairs into pmaddwd/sdot
            prod = builder.mul(builder.sext(va, _vec(_I32, N)), builder.sext(vb, _vec(_I32, N)))
            return _reduce_add_i32(builder, prod)

        return sig, codegen

    dot.__name__ = dot.__qualname__ = name
    return dot


dot_i8 = _make_int_dot(8, "dot_i8")          # a int8 (or uint8 bytes read as int8), b int8
dot_i16_i8 = _make_int_dot(16, "dot_i16_i8")  # a int16, b int8


def _make_float_dot(kind, name):
    @intrinsic
    def dot(typingctx, a, ao, b, bo, n):
        N = _literal(n)
        if N is None or N & (N - 1) or not (_c_array(a) and _c_array(b)):
            return None
        sig = types.float32(a, ao, b, bo, n)

        def codegen(context, builder, signature, args):
            av, aov, bv, bov, _ = args
            aov = context.cast(builder, aov, signature.args[1], types.int64)
            bov = context.cast(builder, bov, signature.args[3], types.int64)
            va = _load(context, builder, signature.args[0], av, aov, _vec(_F32, N))
            if kind == "f32":
                vb = _load(context, builder, signature.args[2], bv, bov, _vec(_F32, N))
            elif kind == "i8":           # exact: every int8 is a float32
                vb = builder.sitofp(_load(context, builder, signature.args[2], bv, bov, _vec(_I8, N)), _vec(_F32, N))
            elif kind == "f16":          # IEEE half bits -> float32 (exact)
                raw = _load(context, builder, signature.args[2], bv, bov, _vec(_I16, N))
                vb = builder.fpext(builder.bitcast(raw, _vec(_F16, N)), _vec(_F32, N))
            else:                        # bf16: the top half of a float32
                raw = _load(context, builder, signature.args[2], bv, bov, _vec(_I16, N))
                wide = builder.shl(builder.zext(raw, _vec(_I32, N)), _splat(_I32, N, 16))
                vb = builder.bitcast(wide, _vec(_F32, N))
            return _tree_fadd(builder, builder.fmul(va, vb))

        return sig, codegen

    dot.__name__ = dot.__qualname__ = name
    return dot


dot_f32 = _make_float_dot("f32", "dot_f32")
dot_f32_i8 = _make_float_dot("i8", "dot_f32_i8")
dot_f32_f16 = _make_float_dot("f16", "dot_f32_f16")
dot_f32_bf16 = _make_float_dot("bf16", "dot_f32_bf16")


# -- scalar helpers (plain numba; inlined into the kernels) ----------------------------

@njit(inline="always")
def f16_bits_to_f32(h):
    """IEEE binary16 bits (an integer < 2**16) -> float32 (exact; inf and nan kept)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1f)
    m = h & np.uint32(0x3ff)
    if e == 0:                                   # zero or subnormal: m * 2^-24, exact in float32
        v = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    if e == 31:                                  # inf / nan
        bits = sign | np.uint32(0x7f800000) | (m << np.uint32(13))
    else:                                        # rebias the exponent 15 -> 127
        bits = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    return np.uint32(bits).view(np.float32)


@njit(inline="always")
def f16_to_f32(lo, hi):
    """Two little-endian bytes of an IEEE binary16 (a block scale) -> float32."""
    return f16_bits_to_f32(np.uint32(lo) | (np.uint32(hi) << np.uint32(8)))


@njit(inline="always")
def bf16_bits_to_f32(h):
    """bfloat16 bits -> float32: they are the top half of the float32."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


UNPACKERS = {"Q8_0": unpack_q8_0, "Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q5_0": unpack_q5_0,
             "Q5_1": unpack_q5_1, "Q4_K": unpack_q4_k, "Q5_K": unpack_q5_k, "Q6_K": unpack_q6_k}
