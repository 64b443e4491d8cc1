"""numpy side of the inline-PTX intrinsics (quant/ptx.py): the PTX-ISA fragment layouts
of mma.m16n8k16 / m16n8k32, host packing of matrices into per-lane registers and back
(`frag_*`, `unfrag_*`), and the numpy reference of every instruction with a non-trivial
result (`mma_*_reference`, `ldmatrix_reference`, `dp4a_reference`, `hfma2_reference`).

The simulator fallbacks (ptx_fallbacks.py) compute with these; tests check the hardware
against them. Pure numpy: no numba, no GPU.
"""
import numpy as np

# =====================================================================================
# Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k32").
# groupID g = lane >> 2 (0..7), threadID_in_group t = lane & 3 (0..3).
# Each table maps (lane, register, element-in-register) -> (row, col) of the matrix;
# element 0 sits in the register's lowest bits.
# =====================================================================================
_LANE = np.arange(32)
_G = (_LANE >> 2)[:, None, None]
_T = (_LANE & 3)[:, None, None]


def _grid(nregs, nelems):
    r = np.arange(nregs)[None, :, None]
    e = np.arange(nelems)[None, None, :]
    return r, e


_r, _e = _grid(4, 2)
# A 16x16 f16, row-major ("row"): a0=(g, 2t..2t+1) a1=(g+8, 2t..) a2=(g, 2t+8..) a3=(g+8, 2t+8..)
_A16_ROW = np.broadcast_to(_G + 8 * (_r & 1), (32, 4, 2))
_A16_COL = np.broadcast_to(2 * _T + _e + 8 * (_r >> 1), (32, 4, 2))
_r, _e = _grid(2, 2)
# B 16x8 (k x n) f16, column-major ("col"): b0=(k=2t..2t+1, n=g) b1=(k=2t+8..2t+9, n=g)
_B16_K = np.broadcast_to(2 * _T + _e + 8 * _r, (32, 2, 2))
_B16_N = np.broadcast_to(_G + 0 * _r + 0 * _e, (32, 2, 2))
_r, _e = _grid(4, 4)
# A 16x32 s8: a0=(g, 4t..4t+3) a1=(g+8, 4t..) a2=(g, 4t+16..) a3=(g+8, 4t+16..)
_A8_ROW = np.broadcast_to(_G + 8 * (_r & 1) + 0 * _e, (32, 4, 4))
_A8_COL = np.broadcast_to(4 * _T + _e + 16 * (_r >> 1), (32, 4, 4))
_r, _e = _grid(2, 4)
# B 32x8 (k x n) s8: b0=(k=4t..4t+3, n=g) b1=(k=4t+16..4t+19, n=g)
_B8_K = np.broadcast_to(4 * _T + _e + 16 * _r, (32, 2, 4))
_B8_N = np.broadcast_to(_G + 0 * _r + 0 * _e, (32, 2, 4))
# C/D 16x8 (f32 or s32): c0=(g, 2t) c1=(g, 2t+1) c2=(g+8, 2t) c3=(g+8, 2t+1)
_C_ROW = (_LANE >> 2)[:, None] + 8 * (np.arange(4)[None, :] >> 1)
_C_COL = 2 * (_LANE & 3)[:, None] + (np.arange(4)[None, :] & 1)
del _r, _e


def _pack_u32(elems_u, bits):
    """(32, R, E) unsigned elements -> (32, R) uint32, element 0 in the low bits."""
    out = np.zeros(elems_u.shape[:2], np.uint32)
    for e in range(elems_u.shape[2]):
        out |= elems_u[:, :, e].astype(np.uint32) << np.uint32(bits * e)
    return out


def _unpack_u32(regs, nelems, dtype):
    """(32, R) uint32 -> (32, R, E) elements of `dtype` (16- or 8-bit)."""
    regs = np.asarray(regs).astype(np.uint64).astype(np.uint32)  # wrap negatives
    bits = 32 // nelems
    utype = np.uint16 if bits == 16 else np.uint8
    parts = [((regs >> np.uint32(bits * e)) & np.uint32((1 << bits) - 1)).astype(utype)
             for e in range(nelems)]
    return np.stack(parts, axis=2).view(dtype)


def frag_a_f16(a):
    """Host packing of A (16x16 float16, row-major) -> (32 lanes, 4) uint32 a0..a3."""
    a = np.asarray(a, np.float16)
    assert a.shape == (16, 16), a.shape
    return _pack_u32(a[_A16_ROW, _A16_COL].view(np.uint16), 16)


def frag_b_f16(b):
    """Host packing of B (16x8 = k x n float16) -> (32 lanes, 2) uint32 b0, b1."""
    b = np.asarray(b, np.float16)
    assert b.shape == (16, 8), b.shape
    return _pack_u32(b[_B16_K, _B16_N].view(np.uint16), 16)


def frag_a_s8(a):
    """Host packing of A (16x32 int8, row-major) -> (32 lanes, 4) uint32 a0..a3."""
    a = np.asarray(a, np.int8)
    assert a.shape == (16, 32), a.shape
    return _pack_u32(a[_A8_ROW, _A8_COL].view(np.uint8), 8)


def frag_b_s8(b):
    """Host packing of B (32x8 = k x n int8) -> (32 lanes, 2) uint32 b0, b1."""
    b = np.asarray(b, np.int8)
    assert b.shape == (32, 8), b.shape
    return _pack_u32(b[_B8_K, _B8_N].view(np.uint8), 8)


def frag_c(c):
    """C/D (16x8, float32 or int32) -> (32 lanes, 4) c0..c3 in the same dtype."""
    c = np.asarray(c)
    assert c.shape == (16, 8), c.shape
    return np.ascontiguousarray(c[_C_ROW, _C_COL])


def unfrag_c(d):
    """(32 lanes, 4) d0..d3 -> D (16x8) in the same dtype."""
    d = np.asarray(d)
    out = np.zeros((16, 8), d.dtype)
    out[_C_ROW, _C_COL] = d
    return out


def unfrag_a_f16(a):
    out = np.zeros((16, 16), np.float16)
    out[_A16_ROW, _A16_COL] = _unpack_u32(a, 2, np.float16)
    return out


def unfrag_b_f16(b):
    out = np.zeros((16, 8), np.float16)
    out[_B16_K, _B16_N] = _unpack_u32(b, 2, np.float16)
    return out


def unfrag_a_s8(a):
    out = np.zeros((16, 32), np.int8)
    out[_A8_ROW, _A8_COL] = _unpack_u32(a, 4, np.int8)
    return out


def unfrag_b_s8(b):
    out = np.zeros((32, 8), np.int8)
    out[_B8_K, _B8_N] = _unpack_u32(b, 4, np.int8)
    return out


def _wrap_i32(x):
    """int64 array -> int32 with two's-complement wrap-around (what the hardware does)."""
    return (np.asarray(x, np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def mma_f16_f32_reference(a, b, c):
    """One warp's m16n8k16 f16*f16+f32: a (32,4) u32, b (32,2) u32, c (32,4) f32 -> d (32,4) f32.

    Products of two f16 are exact in f32; the sum is formed in f64 and rounded once, so
    results can differ from the tensor core's internal rounding in the last bit or two.
    """
    A = unfrag_a_f16(a).astype(np.float64)
    B = unfrag_b_f16(b).astype(np.float64)
    C = unfrag_c(np.asarray(c, np.float32)).astype(np.float64)
    return frag_c((A @ B + C).astype(np.float32))


def mma_s8_s32_reference(a, b, c):
    """One warp's m16n8k32 s8*s8+s32: a (32,4) u32, b (32,2) u32, c (32,4) i32 -> d (32,4) i32.

    Exact; the accumulation wraps modulo 2**32 like the instruction without .satfinite.
    """
    A = unfrag_a_s8(a).astype(np.int64)
    B = unfrag_b_s8(b).astype(np.int64)
    C = unfrag_c(_wrap_i32(c)).astype(np.int64)
    return frag_c(_wrap_i32(A @ B + C))


def mma_s8_k16_reference(a, b, c):
    """One warp's m16n8k16 s8*s8+s32: a (32,2) u32 (a0, a1), b (32,1) u32, c (32,4) i32 -> d
    (32,4) i32: m16n8k32 with the second half of k zero (a2 = a3 = b1 = 0)."""
    a = np.asarray(a, np.uint32).reshape(32, 2)
    b = np.asarray(b, np.uint32).reshape(32, 1)
    return mma_s8_s32_reference(np.concatenate([a, np.zeros_like(a)], axis=1),
                                np.concatenate([b, np.zeros_like(b)], axis=1), c)


def ldmatrix_reference(rows, num, trans=False):
    """ldmatrix.m8n8.x{num}{.trans}.b16: rows (8*num, 8) 16-bit -> (32 lanes, num) uint32.

    rows[8*m + r] is the 16-byte row whose address lane 8*m + r supplied. Without .trans,
    lane l gets matrix m's (row l>>2, cols 2(l&3), 2(l&3)+1) in register m; with .trans it
    gets (rows 2(l&3), 2(l&3)+1; col l>>2), i.e. the same fragment of the transpose.
    """
    rows = np.asarray(rows).view(np.uint16).reshape(num, 8, 8)
    if trans:
        rows = rows.transpose(0, 2, 1)
    g, t = _LANE >> 2, _LANE & 3
    lo = rows[:, g, 2 * t].T.astype(np.uint32)          # (32, num)
    hi = rows[:, g, 2 * t + 1].T.astype(np.uint32)
    return lo | (hi << np.uint32(16))


def hfma2_reference(a, b, c):
    """numpy fma.rn.f16x2 on uint32 words holding half2: products of halves are exact in
    float64 and the sum rounds once to fp16, as the instruction does."""
    ha = np.asarray(a, np.uint32).view(np.float16).astype(np.float64)
    hb = np.asarray(b, np.uint32).view(np.float16).astype(np.float64)
    hc = np.asarray(c, np.uint32).view(np.float16).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (ha * hb + hc).astype(np.float16).view(np.uint32)


def dp4a_reference(a, b, c):
    """dp4a.s32.s32 on arrays: sum of the four signed byte products of a and b, plus c (wraps)."""
    a8 = np.asarray(a).astype(np.int64).astype(np.uint32).view(np.int8).reshape(-1, 4)
    b8 = np.asarray(b).astype(np.int64).astype(np.uint32).view(np.int8).reshape(-1, 4)
    dot = (a8.astype(np.int64) * b8.astype(np.int64)).sum(axis=1)
    out = _wrap_i32(dot.reshape(np.shape(a)) + np.asarray(c, np.int64))
    return out
