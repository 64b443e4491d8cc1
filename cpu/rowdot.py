"""Whole-row dot products of the integer formats: one weight row against one token's int8
activations, as LLVM IR loops (numba intrinsics), with float accumulation in vector lanes.

Why whole rows. The per-block integer sum is exact, but reducing each 32-block to one
int32 costs a horizontal add per block (about as much as the multiply itself). Like
ggml's CPU kernels we skip it: each block's products are summed in pairs into 16 int32
lanes (pmaddwd on x86), converted to float, scaled by the block's d_w * d_x and added
into 16 float lanes; the 16 lanes are summed once per row, at the end, by halving
(simd._tree_fadd). Q8_0 2048 x 640, 33 tokens, one core of the dev machine (Zen 5, hot
cache, 2026-12-02): 20 G multiply-adds/s with a horizontal add per block, 42 with lanes.

The float operations, per row and token (and identical in the fused and buffered forms):

    lanes[l] = 0                                             l = 0..15
    for each block b, in order:
        p[l]      = q[2l] x[2l] + q[2l+1] x[2l+1]            int32, exact (legacy, 32 weights)
                    (k-quants: the 8 such vectors of the 256-weight block added, exact)
        lanes[l]  = lanes[l] + float(p[l]) * (d_w[b] * d_x[b])
        minacc    = minacc + m_w[b] * (d_x[b] * float(sum_x[b]))                (Q4_1, Q5_1)
        minacc    = minacc - (dmin[b] * d_x[b]) * float(sum_j m[b, j] sum_x[b, j])  (Q4_K, Q5_K)
    result = tree_sum(lanes) + minacc

Nothing here depends on n or on the other tokens, which is what makes linear
batch-invariant. Two forms of each row dot:
- fused (`row_dot_<fmt>`): decodes each block from the GGUF bytes in registers - for
  small n, where every weight is used once or twice;
- buffered (`row_dot_legacy_buf`, `row_dot_kquant_buf`): reads quants a kernel already
  unpacked into an L1 buffer (simd.unpack_*), for larger n, where decoding once per row
  pays off. Same float sequence, so the same bits.

Contracts (checked by linear.py's launcher, not here): C-contiguous arrays, flat
element offsets, nb >= 1 blocks in range. What it does not do: loop over rows or tokens,
or thread (linear_kernels.py).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (_F16, _F32, _I8, _I16, _I32, _c_array, _dec_q4_0, _dec_q4_1, _dec_q4_k, _dec_q5_0,
                   _dec_q5_1, _dec_q5_k, _dec_q6_k, _dec_q8_0, _load, _mask, _reduce_add_i32, _scale_vector,
                   _tree_fadd, _vec)

_I64 = ir.IntType(64)
LANES = 16


def _c(v):
    return ir.Constant(_I64, v)


def _pairs(builder, q, x):
    """<2m x iN> q, <2m x i8> x -> <m x i32>: lane l = q[2l] x[2l] + q[2l+1] x[2l+1] (pmaddwd)."""
    n = q.type.count
    prod = builder.mul(builder.sext(q, _vec(_I32, n)), builder.sext(x, _vec(_I32, n)))
    even = builder.shuffle_vector(prod, prod, _mask(range(0, n, 2)))
    odd = builder.shuffle_vector(prod, prod, _mask(range(1, n, 2)))
    return builder.add(even, odd)


def _fold16(builder, v):
    """<m x i32> -> <16 x i32> by adding 16-lane chunks (integers: exact in any order)."""
    parts = [builder.shuffle_vector(v, v, _mask(range(i, i + LANES))) for i in range(0, v.type.count, LANES)]
    while len(parts) > 1:
        parts = [builder.add(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def _lane_step(builder, acc_ptr, p16, scale):
    """lanes += float(p16) * scale - the one float step per block (no FMA: fastmath off)."""
    sv = builder.insert_element(ir.Constant(_vec(_F32, LANES), None), scale, ir.Constant(_I32, 0))
    sv = builder.shuffle_vector(sv, sv, _mask([0] * LANES))
    acc = builder.load(acc_ptr)
    builder.store(builder.fadd(acc, builder.fmul(builder.sitofp(p16, _vec(_F32, LANES)), sv)), acc_ptr)


def _scalar(context, builder, aty, aval, off, lty):
    return _load(context, builder, aty, aval, off, lty)


def _row_loop(context, builder, nb, body):
    """Run body(b) for b in [0, nb) with the lane accumulator and the min accumulator;
    return tree_sum(lanes) + minacc."""
    acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, LANES), [ir.Constant(_F32, 0.0)] * LANES))
    min_ptr = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
    with cgutils.for_range(builder, nb) as loop:
        body(loop.index, acc_ptr, min_ptr)
    return builder.fadd(_tree_fadd(builder, builder.load(acc_ptr)), builder.load(min_ptr))


def _legacy_min(builder, min_ptr, m, xd, xs):
    """minacc = minacc + m * (xd * float(xs))"""
    term = builder.fmul(m, builder.fmul(xd, builder.sitofp(xs, _F32)))
    builder.store(builder.fadd(builder.load(min_ptr), term), min_ptr)


# -- legacy formats ---------------------------------------------------------------------

_LEGACY = {  # name: (decoder, block bytes, byte offset of m or None)
    "q4_0": (_dec_q4_0, 18, None), "q4_1": (_dec_q4_1, 20, 2), "q5_0": (_dec_q5_0, 22, None),
    "q5_1": (_dec_q5_1, 24, 2), "q8_0": (_dec_q8_0, 34, None),
}


def _make_legacy_fused(name):
    decoder, bb, m_off = _LEGACY[name]

    @intrinsic
    def row_dot(typingctx, w, wo, xq, xo, xd, xs, bo, nb):
        """W row at byte wo of w (nb blocks) . token at xq[xo:], scales xd[bo:], sums xs[bo:]."""
        if not all(_c_array(a) for a in (w, xq, xd, xs)):
            return None
        sig = types.float32(w, wo, xq, xo, xd, xs, bo, nb)

        def codegen(context, builder, signature, args):
            aty = signature.args
            wv, wov, xqv, xov, xdv, xsv, bov, nbv = [
                context.cast(builder, v, t, types.int64) if isinstance(t, types.Integer) else v
                for v, t in zip(args, aty)]

            def body(i, acc_ptr, min_ptr):
                o = builder.add(wov, builder.mul(i, _c(bb)))                 # block i's first byte
                q = decoder(context, builder, aty[0], wv, o)                 # <32 x i8>
                x = _load(context, builder, aty[2], xqv, builder.add(xov, builder.mul(i, _c(32))), _vec(_I8, 32))
                dw = builder.fpext(builder.bitcast(_load(context, builder, aty[0], wv, o, _I16), _F16), _F32)
                xdb = _load(context, builder, aty[4], xdv, builder.add(bov, i), _F32)
                _lane_step(builder, acc_ptr, _pairs(builder, q, x), builder.fmul(dw, xdb))
                if m_off is not None:
                    mw = builder.fpext(builder.bitcast(
                        _load(context, builder, aty[0], wv, builder.add(o, _c(m_off)), _I16), _F16), _F32)
                    _legacy_min(builder, min_ptr, mw, xdb, _load(context, builder, aty[5], xsv, builder.add(bov, i), _I32))

            return _row_loop(context, builder, nbv, body)

        return sig, codegen

    row_dot.__name__ = row_dot.__qualname__ = f"row_dot_{name}"
    return row_dot


def _make_legacy_buf(has_min):
    @intrinsic
    def row_dot(typingctx, q, xq, xo, dw, mw, xd, xs, bo, nb):
        """Unpacked row q int8 [nb * 32] with scales dw [nb] (and minima mw [nb]) . token."""
        if not all(_c_array(a) for a in (q, xq, dw, mw, xd, xs)):
            return None
        sig = types.float32(q, xq, xo, dw, mw, xd, xs, bo, nb)

        def codegen(context, builder, signature, args):
            aty = signature.args
            qv, xqv, xov, dwv, mwv, xdv, xsv, bov, nbv = [
                context.cast(builder, v, t, types.int64) if isinstance(t, types.Integer) else v
                for v, t in zip(args, aty)]

            def body(i, acc_ptr, min_ptr):
                qb = _load(context, builder, aty[0], qv, builder.mul(i, _c(32)), _vec(_I8, 32))
                x = _load(context, builder, aty[1], xqv, builder.add(xov, builder.mul(i, _c(32))), _vec(_I8, 32))
                xdb = _load(context, builder, aty[5], xdv, builder.add(bov, i), _F32)
                dwb = _load(context, builder, aty[3], dwv, i, _F32)
                _lane_step(builder, acc_ptr, _pairs(builder, qb, x), builder.fmul(dwb, xdb))
                if has_min:
                    _legacy_min(builder, min_ptr, _load(context, builder, aty[4], mwv, i, _F32), xdb,
                                _load(context, builder, aty[6], xsv, builder.add(bov, i), _I32))

            return _row_loop(context, builder, nbv, body)

        return sig, codegen

    row_dot.__name__ = row_dot.__qualname__ = "row_dot_legacy_buf" + ("_min" if has_min else "")
    return row_dot


row_dot_q4_0 = _make_legacy_fused("q4_0")
row_dot_q4_1 = _make_legacy_fused("q4_1")
row_dot_q5_0 = _make_legacy_fused("q5_0")
row_dot_q5_1 = _make_legacy_fused("q5_1")
row_dot_q8_0 = _make_legacy_fused("q8_0")
row_dot_legacy_buf = _make_legacy_buf(False)
row_dot_legacy_buf_min = _make_legacy_buf(True)


# -- k-quants ------------------------------------------------------------------------------

_KQUANT = {"q4_k": (_dec_q4_k, 144, 8, True), "q5_k": (_dec_q5_k, 176, 8, True), "q6_k": (_dec_q6_k, 210, 16, False)}


def _kquant_body(context, builder, aty, i, acc_ptr, min_ptr, q16, a, has_min):
    """One super-block's step; q16 <256 x i16> = quants x sub-block scales. `a` maps
    argument names to (value, type) for xq, xo, d, dmin, mins, xd, xs, bo, so (x's sums offset)."""
    xq, xo = a["xq"], a["xo"][0]
    x = _load(context, builder, xq[1], xq[0], builder.add(xo, builder.mul(i, _c(256))), _vec(_I8, 256))
    p16 = _fold16(builder, _pairs(builder, q16, x))                   # <16 x i32>, exact
    xdb = _load(context, builder, a["xd"][1], a["xd"][0], builder.add(a["bo"][0], i), _F32)
    db = _load(context, builder, a["d"][1], a["d"][0], i, _F32)
    _lane_step(builder, acc_ptr, p16, builder.fmul(db, xdb))
    if has_min:                                                       # minacc -= (dmin xd) sum_j m_j xs_j
        mins = _load(context, builder, a["mins"][1], a["mins"][0], builder.mul(i, _c(8)), _vec(_I32, 8))
        xs = _load(context, builder, a["xs"][1], a["xs"][0], builder.add(a["so"][0], builder.mul(i, _c(8))), _vec(_I32, 8))
        msum = _reduce_add_i32(builder, builder.mul(mins, xs))
        dmin = _load(context, builder, a["dmin"][1], a["dmin"][0], i, _F32)
        term = builder.fmul(builder.fmul(dmin, xdb), builder.sitofp(msum, _F32))
        builder.store(builder.fsub(builder.load(min_ptr), term), min_ptr)


_KARGS = ("xq", "xo", "d", "dmin", "mins", "xd", "xs", "bo", "so", "nb")


def _unpack_args(context, builder, names, args, aty):
    out = {}
    for nm, v, t in zip(names, args, aty):
        out[nm] = (context.cast(builder, v, t, types.int64) if isinstance(t, types.Integer) else v, t)
    return out


def _make_kquant_fused(name):
    decoder, bb, n_sub, has_min = _KQUANT[name]

    @intrinsic
    def row_dot(typingctx, w, wo, sc, xq, xo, d, dmin, mins, xd, xs, bo, so, nb):
        """k-quant row at byte wo of w; sc int16 [nb * 16] its sub-block scales, d, dmin [nb],
        mins int32 [nb * 8] (unpacked by the kernel); token xq[xo:], xd[bo:], xs[so:]."""
        arrays = (w, sc, xq, d, dmin, mins, xd, xs)
        if not all(_c_array(t) for t in arrays):
            return None
        sig = types.float32(w, wo, sc, xq, xo, d, dmin, mins, xd, xs, bo, so, nb)

        def codegen(context, builder, signature, args):
            aty = signature.args
            a = _unpack_args(context, builder, ("w", "wo", "sc") + _KARGS, args, aty)

            def body(i, acc_ptr, min_ptr):
                o = builder.add(a["wo"][0], builder.mul(i, _c(bb)))
                q = builder.sext(decoder(context, builder, a["w"][1], a["w"][0], o), _vec(_I16, 256))
                q16 = builder.mul(q, _scale_vector(context, builder, a["sc"][1], a["sc"][0], builder.mul(i, _c(16)), n_sub))
                _kquant_body(context, builder, aty, i, acc_ptr, min_ptr, q16, a, has_min)

            return _row_loop(context, builder, a["nb"][0], body)

        return sig, codegen

    row_dot.__name__ = row_dot.__qualname__ = f"row_dot_{name}"
    return row_dot


def _make_kquant_buf(has_min):
    @intrinsic
    def row_dot(typingctx, q16, xq, xo, d, dmin, mins, xd, xs, bo, so, nb):
        """Unpacked k-quant row q16 int16 [nb * 256] (quants x sub-block scales) . token."""
        if not all(_c_array(t) for t in (q16, xq, d, dmin, mins, xd, xs)):
            return None
        sig = types.float32(q16, xq, xo, d, dmin, mins, xd, xs, bo, so, nb)

        def codegen(context, builder, signature, args):
            aty = signature.args
            a = _unpack_args(context, builder, ("q16",) + _KARGS, args, aty)

            def body(i, acc_ptr, min_ptr):
                qb = _load(context, builder, a["q16"][1], a["q16"][0], builder.mul(i, _c(256)), _vec(_I16, 256))
                _kquant_body(context, builder, aty, i, acc_ptr, min_ptr, qb, a, has_min)

            return _row_loop(context, builder, a["nb"][0], body)

        return sig, codegen

    row_dot.__name__ = row_dot.__qualname__ = "row_dot_kquant_buf" + ("_min" if has_min else "")
    return row_dot


row_dot_q4_k = _make_kquant_fused("q4_k")
row_dot_q5_k = _make_kquant_fused("q5_k")
row_dot_q6_k = _make_kquant_fused("q6_k")
row_dot_kquant_buf = _make_kquant_buf(False)
row_dot_kquant_buf_min = _make_kquant_buf(True)
