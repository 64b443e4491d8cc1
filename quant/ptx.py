"""Inline-PTX intrinsics for the Numba CUDA kernels, each with a simulator fallback.

Every instruction that numba-cuda does not expose (tensor-core mma, ldmatrix, cp.async,
dp4a, 128-bit read-only loads, f16x2 packing) lives in this one module, so kernels stay
plain Python and a later move away from numba-cuda touches one file.

Two implementations of every public function, chosen once at import:

- device (default): a `numba.cuda.extending.intrinsic` that emits `llvmlite.ir.InlineAsm`.
  Callable only from `@cuda.jit` code.
- simulator (`NUMBA_ENABLE_CUDASIM=1`): a pure-Python/numpy function with the same
  arguments and results. Warp-wide instructions (mma, ldmatrix, shuffles) gather the
  lanes of one warp through a warp exchange (`_warp_collective`), compute the result in
  numpy from the PTX-ISA fragment layouts, and hand each lane its part. Importing this
  module under the simulator also installs `cuda.shfl_*_sync`, `cuda.ballot_sync`,
  `cuda.all_sync`, `cuda.any_sync`, `cuda.eq_sync`, `cuda.activemask` and
  `cuda.lanemask_lt` on the simulator's `FakeCUDAModule`, and lets
  `cuda.shared.array` / `cuda.local.array` take `alignment=`.

The numpy references (`mma_f16_f32_reference`, `frag_a_f16`, ...) are always defined:
the fallbacks use them, and tests use them to check the hardware.

Fragment layouts, constraints and the fallbacks' limits: docs/ptx-intrinsics.md.

Deliberately not here: wgmma/TMA (sm_90-only), bf16/fp8 mma, stmatrix, anything that
numba-cuda already provides (`cuda.shfl_*_sync`, atomics, `cuda.fp16`).
"""
import os
import sys
import threading
import time
import weakref

import numpy as np

__all__ = [
    "SIMULATOR",
    # tensor cores
    "mma_f16_f32", "mma_s8_s32",
    "ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4",
    "ldmatrix_x1_trans", "ldmatrix_x2_trans", "ldmatrix_x4_trans",
    # memory
    "cp_async16", "cp_async16_zfill", "cp_async_commit", "cp_async_wait_all",
    "cp_async_wait_group", "cp_async_wait_group_0", "cp_async_wait_group_1",
    "cp_async_wait_group_2", "ldg_v4",
    # scalar
    "dp4a", "hfma2", "pack_half2", "unpack_half2", "f16_bits_to_f32", "bits_to_f32",
    # host-side fragment packing and numpy references
    "frag_a_f16", "frag_b_f16", "frag_a_s8", "frag_b_s8", "frag_c", "unfrag_c",
    "unfrag_a_f16", "unfrag_b_f16", "unfrag_a_s8", "unfrag_b_s8",
    "mma_f16_f32_reference", "mma_s8_s32_reference", "ldmatrix_reference",
    "dp4a_reference", "hfma2_reference",
]


def _simulator_enabled() -> bool:
    try:
        from numba.cuda import config as cuda_config
        if getattr(cuda_config, "ENABLE_CUDASIM", False):
            return True
    except ImportError:
        pass
    try:
        from numba import config
        if getattr(config, "ENABLE_CUDASIM", False):
            return True
    except ImportError:
        pass
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


SIMULATOR: bool = _simulator_enabled()


def is_device_array(a) -> bool:
    """A CUDA array kernels can take: numba's device arrays (mapped and pinned-device
    ones too, which are also numpy arrays), any __cuda_array_interface__ object, or the
    simulator's stand-in. Launchers use it to refuse host arrays, which numba would
    silently copy on every launch."""
    return hasattr(a, "__cuda_array_interface__") or type(a).__name__ == "FakeCUDAArray"

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


# =====================================================================================
# Device implementations: inline PTX through numba intrinsics.
# =====================================================================================
if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i32 = ir.IntType(32)
    _i64 = ir.IntType(64)
    _f32 = ir.FloatType()

    def _asm(builder, retty, argtys, text, constraints, args, side_effect=False):
        fnty = ir.FunctionType(retty, argtys)
        asm = ir.InlineAsm(fnty, text, constraints, side_effect=side_effect)
        return builder.call(asm, args)

    def _struct_to_tuple(context, builder, restype, st, n):
        vals = [builder.extract_value(st, k) for k in range(n)]
        return context.make_tuple(builder, restype, vals)

    def _check_ints(name, **tys):
        for argname, ty in tys.items():
            if not isinstance(ty, types.Integer):
                raise TypingError(f"{name}: {argname} must be an integer, got {ty}")

    def _check_index(name, arrty, idxty):
        if not isinstance(arrty, types.Array):
            raise TypingError(f"{name}: expected an array, got {arrty}")
        if isinstance(idxty, types.BaseTuple):
            if len(idxty) != arrty.ndim or not all(isinstance(t, types.Integer) for t in idxty):
                raise TypingError(f"{name}: index {idxty} does not match a {arrty.ndim}-d array")
        elif not (isinstance(idxty, types.Integer) and arrty.ndim == 1):
            raise TypingError(f"{name}: index must be an integer for a 1-d array or a tuple "
                              f"of {arrty.ndim} integers, got {idxty}")

    def _elem_ptr(context, builder, arrty, arr, idxty, idx):
        """Generic pointer to arr[idx] (no bounds check, no negative wrap-around)."""
        ary = context.make_array(arrty)(context, builder, value=arr)
        if isinstance(idxty, types.BaseTuple):
            vals = cgutils.unpack_tuple(builder, idx, len(idxty))
            tys = list(idxty)
        else:
            vals, tys = [idx], [idxty]
        vals = [context.cast(builder, v, t, types.intp) for v, t in zip(vals, tys)]
        return cgutils.get_item_pointer(context, builder, arrty, ary, vals, wraparound=False)

    def _shared_addr32(builder, ptr):
        """Generic pointer -> 32-bit .shared address (CUDA's __cvta_generic_to_shared)."""
        sp = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=3))
        return builder.ptrtoint(sp, _i32)

    def _global_addr64(builder, ptr):
        """Generic pointer -> 64-bit .global address (cvta.to.global)."""
        gp = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=1))
        return builder.ptrtoint(gp, _i64)

    # ---- tensor-core mma -----------------------------------------------------------
    _MMA_OPERANDS = "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"

    @intrinsic
    def mma_f16_f32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A(16x16 f16, row) * B(16x8 f16, col) + C(16x8 f32), one warp; see frag_a_f16."""
        _check_ints("mma_f16_f32", a0=a0, a1=a1, a2=a2, a3=a3, b0=b0, b1=b1)
        for ty in (c0, c1, c2, c3):
            if not isinstance(ty, (types.Float, types.Integer)):
                raise TypingError(f"mma_f16_f32: accumulators must be float32, got {ty}")
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, sig, args):
            st = _asm(builder, ir.LiteralStructType([_f32] * 4), [_i32] * 6 + [_f32] * 4,
                      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " + _MMA_OPERANDS,
                      "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", list(args))
            return _struct_to_tuple(context, builder, sig.return_type, st, 4)
        return sig, codegen

    @intrinsic
    def mma_s8_s32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A(16x32 s8, row) * B(32x8 s8, col) + C(16x8 s32), one warp; see frag_a_s8."""
        _check_ints("mma_s8_s32", a0=a0, a1=a1, a2=a2, a3=a3, b0=b0, b1=b1,
                    c0=c0, c1=c1, c2=c2, c3=c3)
        sig = types.UniTuple(types.int32, 4)(*([types.uint32] * 6 + [types.int32] * 4))

        def codegen(context, builder, sig, args):
            st = _asm(builder, ir.LiteralStructType([_i32] * 4), [_i32] * 10,
                      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 " + _MMA_OPERANDS,
                      "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", list(args))
            return _struct_to_tuple(context, builder, sig.return_type, st, 4)
        return sig, codegen

    # ---- ldmatrix ------------------------------------------------------------------
    def _make_ldmatrix(num, trans):
        name = f"ldmatrix_x{num}" + ("_trans" if trans else "")
        outs = ",".join(f"${k}" for k in range(num))
        text = (f"ldmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16 "
                f"{{{outs}}}, [${num}];")
        cons = ",".join(["=r"] * num + ["r", "~{memory}"])

        def typer(typingctx, smem, idx):
            _check_index(name, smem, idx)
            rt = types.uint32 if num == 1 else types.UniTuple(types.uint32, num)

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                addr = _shared_addr32(builder, p)
                if num == 1:
                    return _asm(builder, _i32, [_i32], text, cons, [addr], side_effect=True)
                st = _asm(builder, ir.LiteralStructType([_i32] * num), [_i32], text, cons,
                          [addr], side_effect=True)
                return _struct_to_tuple(context, builder, sig.return_type, st, num)
            return rt(smem, idx), codegen
        typer.__name__ = name
        typer.__doc__ = (f"{name}(smem, idx): warp-wide {text.split()[0]}; this lane supplies "
                         f"the address of smem[idx] (16-byte aligned row of 8 b16).")
        return intrinsic(typer)

    ldmatrix_x1 = _make_ldmatrix(1, False)
    ldmatrix_x2 = _make_ldmatrix(2, False)
    ldmatrix_x4 = _make_ldmatrix(4, False)
    ldmatrix_x1_trans = _make_ldmatrix(1, True)
    ldmatrix_x2_trans = _make_ldmatrix(2, True)
    ldmatrix_x4_trans = _make_ldmatrix(4, True)

    # ---- cp.async ------------------------------------------------------------------
    @intrinsic
    def cp_async16(typingctx, dst_smem, di, src_glob, si):
        """Asynchronous 16-byte copy global src_glob[si] -> shared dst_smem[di] (cp.async.cg)."""
        _check_index("cp_async16", dst_smem, di)
        _check_index("cp_async16", src_glob, si)

        def codegen(context, builder, sig, args):
            d = _shared_addr32(builder, _elem_ptr(context, builder, sig.args[0], args[0],
                                                  sig.args[1], args[1]))
            s = _global_addr64(builder, _elem_ptr(context, builder, sig.args[2], args[2],
                                                  sig.args[3], args[3]))
            _asm(builder, ir.VoidType(), [_i32, _i64],
                 "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", [d, s],
                 side_effect=True)
            return context.get_dummy_value()
        return types.void(dst_smem, di, src_glob, si), codegen

    @intrinsic
    def cp_async16_zfill(typingctx, dst_smem, di, src_glob, si, src_bytes):
        """cp_async16 reading only src_bytes (0..16) bytes; the rest of the 16 is zero-filled."""
        _check_index("cp_async16_zfill", dst_smem, di)
        _check_index("cp_async16_zfill", src_glob, si)
        _check_ints("cp_async16_zfill", src_bytes=src_bytes)
        sig = types.void(dst_smem, di, src_glob, si, types.uint32)

        def codegen(context, builder, sig, args):
            d = _shared_addr32(builder, _elem_ptr(context, builder, sig.args[0], args[0],
                                                  sig.args[1], args[1]))
            s = _global_addr64(builder, _elem_ptr(context, builder, sig.args[2], args[2],
                                                  sig.args[3], args[3]))
            _asm(builder, ir.VoidType(), [_i32, _i64, _i32],
                 "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                 [d, s, args[4]], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    def _make_void_asm(name, text, doc):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [], text, "~{memory}", [], side_effect=True)
                return context.get_dummy_value()
            return types.void(), codegen
        typer.__name__ = name
        typer.__doc__ = doc
        return intrinsic(typer)

    cp_async_commit = _make_void_asm(
        "cp_async_commit", "cp.async.commit_group;",
        "Close the current group of cp.async copies issued by this thread.")
    cp_async_wait_all = _make_void_asm(
        "cp_async_wait_all", "cp.async.wait_all;",
        "Wait until all of this thread's cp.async copies have landed (no syncthreads implied).")
    cp_async_wait_group_0 = _make_void_asm(
        "cp_async_wait_group_0", "cp.async.wait_group 0;", "cp.async.wait_group 0")
    cp_async_wait_group_1 = _make_void_asm(
        "cp_async_wait_group_1", "cp.async.wait_group 1;", "cp.async.wait_group 1")
    cp_async_wait_group_2 = _make_void_asm(
        "cp_async_wait_group_2", "cp.async.wait_group 2;", "cp.async.wait_group 2")

    @intrinsic
    def cp_async_wait_group(typingctx, n):
        """Wait until at most n of this thread's committed cp.async groups are pending.

        n must be a compile-time integer literal (an immediate in PTX)."""
        if not isinstance(n, types.IntegerLiteral):
            # numba also tries the literal type when the argument is a constant
            raise TypingError("cp_async_wait_group(n): n must be an integer literal written "
                              "at the call (it is a PTX immediate), e.g. "
                              "cp_async_wait_group(1); or use cp_async_wait_group_0/_1/_2")
        count = int(n.literal_value)
        if not 0 <= count <= 7:
            raise TypingError(f"cp_async_wait_group: n must be 0..7, got {count}")

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {count};", "~{memory}", [],
                 side_effect=True)
            return context.get_dummy_value()
        return types.void(n), codegen

    # ---- 128-bit read-only global load ---------------------------------------------
    _LDG_TYPES = {types.uint32: ("u32", "r"), types.int32: ("s32", "r"),
                  types.float32: ("f32", "f")}

    @intrinsic
    def ldg_v4(typingctx, arr, idx):
        """(arr[idx], arr[idx+1], arr[idx+2], arr[idx+3]) by one ld.global.nc.v4 (16-byte aligned)."""
        _check_index("ldg_v4", arr, idx)
        if arr.dtype not in _LDG_TYPES:
            raise TypingError(f"ldg_v4: array dtype must be uint32, int32 or float32, got "
                              f"{arr.dtype}; view the buffer as uint32 on the host")
        ptx_ty, letter = _LDG_TYPES[arr.dtype]
        text = f"ld.global.nc.v4.{ptx_ty} {{$0,$1,$2,$3}}, [$4];"
        cons = f"={letter},={letter},={letter},={letter},l"

        def codegen(context, builder, sig, args):
            p = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            lty = context.get_value_type(sig.args[0].dtype)
            st = _asm(builder, ir.LiteralStructType([lty] * 4), [_i64], text, cons,
                      [_global_addr64(builder, p)])
            return _struct_to_tuple(context, builder, sig.return_type, st, 4)
        return types.UniTuple(arr.dtype, 4)(arr, idx), codegen

    # ---- integer dot product -------------------------------------------------------
    @intrinsic
    def dp4a(typingctx, a, b, c):
        """c + sum of the 4 signed-byte products of a and b (dp4a.s32.s32), as int32."""
        _check_ints("dp4a", a=a, b=b, c=c)

        def codegen(context, builder, sig, args):
            return _asm(builder, _i32, [_i32] * 3, "dp4a.s32.s32 $0, $1, $2, $3;",
                        "=r,r,r,r", list(args))
        return types.int32(types.int32, types.int32, types.int32), codegen

    @intrinsic
    def hfma2(typingctx, a, b, c):
        """fma.rn.f16x2 on packed half2 words: (a.lo*b.lo + c.lo, a.hi*b.hi + c.hi)."""
        _check_ints("hfma2", a=a, b=b, c=c)

        def codegen(context, builder, sig, args):
            return _asm(builder, _i32, [_i32] * 3, "fma.rn.f16x2 $0, $1, $2, $3;",
                        "=r,r,r,r", list(args))
        return types.uint32(types.uint32, types.uint32, types.uint32), codegen

    # ---- f16 packing ---------------------------------------------------------------
    @intrinsic
    def pack_half2(typingctx, lo, hi):
        """uint32 holding f16(lo) in bits 0..15 and f16(hi) in bits 16..31 (round to nearest even)."""
        def codegen(context, builder, sig, args):
            # cvt.rn.f16x2.f32 d, a, b puts a in the UPPER half: pass hi first.
            return _asm(builder, _i32, [_f32, _f32], "cvt.rn.f16x2.f32 $0, $2, $1;",
                        "=r,f,f", list(args))
        return types.uint32(types.float32, types.float32), codegen

    @intrinsic
    def unpack_half2(typingctx, h2):
        """(f32 of bits 0..15, f32 of bits 16..31) of a packed half2 word."""
        _check_ints("unpack_half2", h2=h2)

        def codegen(context, builder, sig, args):
            st = _asm(builder, ir.LiteralStructType([_f32, _f32]), [_i32],
                      "{ .reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\t"
                      "cvt.f32.f16 $0, lo;\n\tcvt.f32.f16 $1, hi; }",
                      "=f,=f,r", list(args))
            return _struct_to_tuple(context, builder, sig.return_type, st, 2)
        return types.UniTuple(types.float32, 2)(types.uint32), codegen

    @intrinsic
    def f16_bits_to_f32(typingctx, bits):
        """float32 value of the IEEE half whose bits are the low 16 bits of `bits` (cvt.f32.f16)."""
        _check_ints("f16_bits_to_f32", bits=bits)

        def codegen(context, builder, sig, args):
            return _asm(builder, _f32, [_i32],
                        "{ .reg .b16 h;\n\tcvt.u16.u32 h, $1;\n\tcvt.f32.f16 $0, h; }",
                        "=f,r", list(args))
        return types.float32(types.uint32), codegen

    @intrinsic
    def bits_to_f32(typingctx, bits):
        """The float32 whose bits are the uint32 `bits` (mov.b32: a reinterpretation;
        bf16 weights are the high 16 bits of a float32)."""
        _check_ints("bits_to_f32", bits=bits)

        def codegen(context, builder, sig, args):
            return _asm(builder, _f32, [_i32], "mov.b32 $0, $1;", "=f,r", list(args))
        return types.float32(types.uint32), codegen


# =====================================================================================
# Simulator implementations.
# =====================================================================================
else:
    from numba.cuda.simulator import kernelapi as _kernelapi
    from numba.cuda.simulator.cudadrv import devicearray as _sim_devicearray

    # A lane waiting in a warp collective checks for deadlock after this many seconds
    # (a lane of its warp exited, or waits in syncthreads), then again every second.
    _SIM_STALL_CHECK_S = 5.0
    _FULL_MASK = 0xFFFFFFFF
    _create_lock = threading.Lock()

    class _Round:
        """One execution of a warp collective: the lanes' inputs, then everyone's outputs."""
        __slots__ = ("name", "mask", "arrived", "values", "result", "error", "done")

        def __init__(self, name, mask):
            self.name, self.mask, self.arrived = name, mask, 0
            self.values = [None] * 32
            self.result = self.error = None
            self.done = False

    class _Warp:
        __slots__ = ("cond", "lane_bits", "open")

        def __init__(self, nlanes):
            self.cond = threading.Condition()
            self.lane_bits = (1 << nlanes) - 1   # lanes that exist (last warp may be partial)
            self.open = {}                      # member mask -> _Round being gathered

    def _sim_thread():
        th = threading.current_thread()
        if not hasattr(th, "_manager") or not hasattr(th, "thread_id"):
            raise RuntimeError("genie_rt.quant.ptx: simulator fallbacks can only be called "
                               "from inside a kernel run by the CUDA simulator")
        return th

    def _warp_of(th):
        """The _Warp of this thread. Exchange state hangs off the simulator's BlockManager,
        which exists once per block per launch: no key can collide across launches or blocks,
        and it is freed with the block."""
        mgr = th._manager
        warps = getattr(mgr, "_genie_ptx_warps", None)
        if warps is None:
            with _create_lock:
                warps = getattr(mgr, "_genie_ptx_warps", None)
                if warps is None:
                    nthreads = int(np.prod(mgr._block_dim))
                    warps = [_Warp(min(32, nthreads - 32 * w)) for w in range((nthreads + 31) // 32)]
                    mgr._genie_ptx_warps = warps
        return warps[th.thread_id >> 5]

    # Barriers each simulated thread has passed, counted by a wrapper around the simulator's
    # BlockThread.syncthreads (syncthreads_count/and/or call it too).
    from numba.cuda.simulator import kernel as _sim_kernel

    def _barriers(th):
        return getattr(th, "_genie_barriers", 0)

    if not getattr(_sim_kernel.BlockThread.syncthreads, "_genie_counted", False):
        _sim_syncthreads = _sim_kernel.BlockThread.syncthreads

        def _counted_syncthreads(self):
            _sim_syncthreads(self)
            self._genie_barriers = _barriers(self) + 1

        _counted_syncthreads._genie_counted = True
        _sim_kernel.BlockThread.syncthreads = _counted_syncthreads

    # Threads of a block that have finished, recorded by a wrapper around BlockThread.run.
    # The simulator starts a block's threads one by one, so under a loaded GIL a lane can be
    # missing from threading.enumerate() because it has not started yet: only a lane that
    # has run to its end can never arrive.
    if not getattr(_sim_kernel.BlockThread.run, "_genie_counted", False):
        _sim_run = _sim_kernel.BlockThread.run

        def _recorded_run(self):
            try:
                _sim_run(self)
            finally:
                with _create_lock:
                    done = getattr(self._manager, "_genie_exited", None)
                    if done is None:
                        done = self._manager._genie_exited = set()
                    done.add(self.thread_id)

        _recorded_run._genie_counted = True
        _sim_kernel.BlockThread.run = _recorded_run

    def _stall_check(th, rnd, waited_s):
        """Raise if a lane that this collective waits for can never arrive."""
        missing = rnd.mask & ~rnd.arrived
        warp_base = th.thread_id & ~31
        alive = {t.thread_id: t for t in threading.enumerate()
                 if getattr(t, "_manager", None) is th._manager}
        exited = getattr(th._manager, "_genie_exited", ())
        for lane in range(32):
            if not (missing >> lane) & 1:
                continue
            t = alive.get(warp_base + lane)
            if t is None and warp_base + lane not in exited:
                continue                 # not started yet: the simulator is still creating threads
            if t is None:
                raise RuntimeError(
                    f"{rnd.name}: lane {lane} of warp {th.thread_id >> 5} (mask {rnd.mask:#010x}) "
                    f"exited without reaching it; all lanes named in the mask must execute "
                    f"warp-synchronous instructions (hangs or is undefined on hardware)")
            # A lane whose flag is up at a barrier this lane has already passed is being
            # released (the simulator's BlockManager clears the flags one thread at a time,
            # which under a loaded GIL takes seconds for a 1024-thread block): not a deadlock.
            if t.syncthreads_blocked and _barriers(t) >= _barriers(th):
                raise RuntimeError(
                    f"{rnd.name}: lane {lane} of warp {th.thread_id >> 5} waits in syncthreads "
                    f"while other lanes wait in {rnd.name}: divergent warp (deadlock)")
        if waited_s > 600:
            raise RuntimeError(f"{rnd.name}: lanes {missing:#010x} did not arrive in 600 s")

    def _warp_collective(name, mask, value, combine):
        """Gather `value` from every lane in `mask`, run combine(values, mask) once (in the
        last lane to arrive), return element [lane] of its result to each lane.

        Waits only for the lanes of this warp (not a block-wide syncthreads), so other warps
        can be anywhere, including in syncthreads."""
        th = _sim_thread()
        warp = _warp_of(th)
        lane = th.thread_id & 31
        mask = int(mask) & _FULL_MASK & warp.lane_bits
        if not (mask >> lane) & 1:
            raise RuntimeError(f"{name}: lane {lane} is not in its own member mask {mask:#010x}")
        with warp.cond:
            # Disjoint groups of lanes (e.g. the two half-warps, each with its own mask) may
            # run collectives at the same time; overlapping masks mean a divergent warp.
            rnd = warp.open.get(mask)
            if rnd is None:
                for other in warp.open.values():
                    if other.mask & mask:
                        raise RuntimeError(
                            f"warp {th.thread_id >> 5}: lane {lane} calls {name} with mask "
                            f"{mask:#010x} while lanes {other.arrived:#010x} wait in {other.name} "
                            f"with mask {other.mask:#010x}: divergent warp")
                rnd = warp.open[mask] = _Round(name, mask)
            elif rnd.name != name:
                raise RuntimeError(
                    f"warp {th.thread_id >> 5}: lane {lane} calls {name} while lanes "
                    f"{rnd.arrived:#010x} wait in {rnd.name} (mask {mask:#010x}): divergent warp")
            rnd.values[lane] = value
            rnd.arrived |= 1 << lane
            if rnd.arrived == rnd.mask:
                del warp.open[mask]
                try:
                    rnd.result = combine(rnd.values, rnd.mask)
                except BaseException as e:  # hand the error to every lane
                    rnd.error = e
                rnd.done = True
                warp.cond.notify_all()
            else:
                start = time.monotonic()
                next_check = _SIM_STALL_CHECK_S
                while not rnd.done:
                    warp.cond.wait(0.05)
                    if th.abort:
                        raise RuntimeError("aborted: another simulated thread raised")
                    waited = time.monotonic() - start
                    if not rnd.done and waited > next_check:
                        _stall_check(th, rnd, waited)
                        next_check = waited + 1.0
        if rnd.error is not None:
            raise RuntimeError(f"{name} failed in lane {lane}: {rnd.error!r}") from rnd.error
        return rnd.result[lane]

    def _full_warp(name):
        th = _sim_thread()
        if _warp_of(th).lane_bits != _FULL_MASK:
            raise RuntimeError(f"{name} needs a full warp of 32 threads; this block has "
                               f"blockDim not a multiple of 32")

    # ---- warp shuffles and votes, installed on the simulator's cuda module ---------
    _SHFL_OK = (np.int32, np.int64, np.float32, np.float64)

    def _check_shfl_value(name, value):
        # numba types Python int as int64 and float as float64; like the real intrinsic,
        # refuse other widths (unsigned, 8/16-bit, bool) so a kernel fails here, not on GPU.
        if isinstance(value, (bool, np.bool_)) or (
                isinstance(value, np.generic) and not isinstance(value, _SHFL_OK)):
            raise TypeError(f"{name}: numba's shfl_*_sync only supports int32, int64, float32 "
                            f"and float64 values, got {type(value).__name__}")

    def _shfl_src(mode, lane, b, c):
        """Source lane of shfl.sync (PTX ISA pseudo-code); returns `lane` when out of range."""
        b = int(b) & 0xFFFFFFFF
        segmask = (c >> 8) & 0x1F
        min_lane = lane & segmask
        max_lane = min_lane | (c & 0x1F & ~segmask)
        if mode == "up":
            j = lane - b
            ok = j >= max_lane
        elif mode == "down":
            j = lane + b
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ b
            ok = j <= max_lane
        else:  # idx
            j = min_lane | (b & 0x1F & ~segmask)
            ok = j <= max_lane
        return j if ok else lane

    def _make_shfl(name, mode, c):
        def shfl(self, mask, value, b):
            _check_shfl_value(name, value)

            def combine(values, m):
                # values[l] = (value, b) of lane l; a source lane that is not in the mask or
                # does not exist is undefined on hardware: the lane gets its own value.
                out = [None] * 32
                for lane in range(32):
                    if (m >> lane) & 1:
                        v, bl = values[lane]
                        src = _shfl_src(mode, lane, bl, c)
                        out[lane] = values[src][0] if (m >> src) & 1 else v
                return out
            return _warp_collective(name, mask, (value, b), combine)
        shfl.__name__ = name
        return shfl

    def _vote(name, reduce, rtype):
        def vote(self, mask, predicate):
            def combine(values, m):
                r = rtype(reduce(values, m))
                return [r] * 32
            return _warp_collective(name, mask, predicate, combine)
        vote.__name__ = name
        return vote

    def _ballot(values, m):
        return sum(1 << lane for lane in range(32) if (m >> lane) & 1 and values[lane])

    # numba-cuda 0.30 types ballot_sync as int32, all/any/eq_sync as bool, activemask and
    # lanemask_lt as uint32: return the same types here.
    def _as_i32(bits):
        return np.uint32(bits).view(np.int32)

    def _activemask(self):
        # The simulator cannot see divergence: every existing lane counts as active.
        return np.uint32(_warp_of(_sim_thread()).lane_bits)

    def _lanemask_lt(self):
        return np.uint32((1 << (_sim_thread().thread_id & 31)) - 1)

    _fake = _kernelapi.FakeCUDAModule
    _fake.shfl_sync = _make_shfl("shfl_sync", "idx", 0x1F)
    _fake.shfl_up_sync = _make_shfl("shfl_up_sync", "up", 0)
    _fake.shfl_down_sync = _make_shfl("shfl_down_sync", "down", 0x1F)
    _fake.shfl_xor_sync = _make_shfl("shfl_xor_sync", "bfly", 0x1F)
    _fake.ballot_sync = _vote("ballot_sync", _ballot, _as_i32)
    _fake.all_sync = _vote("all_sync", lambda v, m: _ballot(v, m) == m, bool)
    _fake.any_sync = _vote("any_sync", lambda v, m: _ballot(v, m) != 0, bool)
    _fake.eq_sync = _vote("eq_sync", lambda v, m: _ballot(v, m) in (0, m), bool)
    _fake.activemask = _activemask
    _fake.lanemask_lt = _lanemask_lt

    # ---- cuda.shared.array / cuda.local.array with alignment= ----------------------
    def _aligned_empty(shape, dtype, align, misalign=0):
        """np.empty whose data address is == misalign (mod align)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = np.empty(nbytes + 2 * align, np.uint8)
        off = (misalign - buf.ctypes.data) % align
        return buf[off:off + nbytes].view(dtype).reshape(shape)

    def _as_np_dtype(dtype):
        from numba.cuda import types as _types
        from numba.cuda.np import numpy_support
        return numpy_support.as_dtype(dtype) if isinstance(dtype, _types.Type) else np.dtype(dtype)

    _shared_lock = threading.Lock()

    def _shared_array(self, shape, dtype, alignment=None):
        """FakeCUDAShared.array that accepts alignment=. Without it, the array is placed at an
        address that is only dtype-aligned (what PTX guarantees: `.shared .align <itemsize>`),
        so a 16-byte ldmatrix/cp.async on an unaligned tile fails here, not on the GPU."""
        dtype = _as_np_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer, 16-byte aligned
            _register_shared(self._dynshared)
            count = self._dynshared_size // dtype.itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)  # one allocation per source line
        with _shared_lock:  # the threads of a block race to allocate: all must get one array
            res = self._allocations.get(caller)
            if res is None:
                if alignment is None:
                    misalign = dtype.itemsize if dtype.itemsize < 16 else 0
                    res = _aligned_empty(shape, dtype, 16, misalign)
                else:
                    res = _aligned_empty(shape, dtype, max(int(alignment), dtype.itemsize))
                _register_shared(res)
                self._allocations[caller] = res
        return res

    def _local_array(self, shape, dtype, alignment=None):
        dtype = _as_np_dtype(dtype)
        return _aligned_empty(shape, dtype, max(int(alignment or 1), dtype.itemsize, 16))

    _kernelapi.FakeCUDAShared.array = _shared_array
    _kernelapi.FakeCUDALocal.array = _local_array

    # ---- memory helpers ------------------------------------------------------------
    def _np(arr):
        """The numpy array behind a simulator kernel argument or shared/local array."""
        if isinstance(arr, _sim_devicearray.FakeWithinKernelCUDAArray):
            arr = arr.__dict__["_item"]
        if isinstance(arr, _sim_devicearray.FakeCUDAArray):
            arr = arr._ary
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"expected an array, got {type(arr).__name__}")
        return arr

    _shared_ids = set()   # id() of the root buffers of simulated shared memory

    def _root(a):
        while True:
            b = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
            if b is None:
                return a
            a = b

    def _register_shared(arr):
        root = _root(arr)
        if id(root) not in _shared_ids:
            _shared_ids.add(id(root))
            weakref.finalize(root, _shared_ids.discard, id(root))

    def _is_shared(a):
        """True if `a` is a numpy array viewing simulated shared memory (static or dynamic)."""
        return isinstance(a, np.ndarray) and id(_root(a)) in _shared_ids

    def _check_space(name, what, arr, shared):
        # In the simulator, global memory reaches a kernel wrapped (FakeWithinKernelCUDAArray,
        # slices and views stay wrapped); shared and local arrays are plain numpy arrays.
        is_global = not isinstance(arr, np.ndarray)
        if (_is_shared(arr) if shared else is_global):
            return
        raise RuntimeError(f"{name}: {what} must be a {'shared' if shared else 'global'} array "
                           f"(cuda.shared.array / a kernel argument); the instruction addresses "
                           f"the .{'shared' if shared else 'global'} state space")

    def _bytes_at(name, arr, idx, nbytes=16, align=16):
        """Writable uint8 view of the nbytes starting at &arr[idx], checked like hardware:
        address aligned to `align`, and (stricter) inside the array."""
        a = _np(arr)
        if not a.flags.c_contiguous:
            raise NotImplementedError(f"{name}: the simulator fallback needs a C-contiguous array")
        if isinstance(idx, tuple):
            if len(idx) != a.ndim:
                raise IndexError(f"{name}: index {idx} for a {a.ndim}-d array")
            if any(int(i) < 0 or int(i) >= n for i, n in zip(idx, a.shape)):
                raise IndexError(f"{name}: index {idx} out of bounds for shape {a.shape}")
            flat = int(np.ravel_multi_index(tuple(int(i) for i in idx), a.shape))
        else:
            if a.ndim != 1:
                raise IndexError(f"{name}: integer index needs a 1-d array, got {a.ndim}-d")
            flat = int(idx)
        start = flat * a.itemsize
        if flat < 0 or start + nbytes > a.nbytes:
            raise IndexError(f"{name}: bytes [{start}, {start + nbytes}) of element {idx} are "
                             f"outside the array ({a.nbytes} bytes)")
        if (a.ctypes.data + start) % align:
            raise RuntimeError(f"{name}: misaligned address: element {idx} of a {a.dtype} array "
                               f"is at byte {(a.ctypes.data + start) % align} mod {align}; the "
                               f"instruction needs {align}-byte alignment (shared tiles: "
                               f"cuda.shared.array(..., alignment=16))")
        return a.reshape(-1).view(np.uint8)[start:start + nbytes]

    def _u32(x):
        return int(x) & 0xFFFFFFFF

    # ---- tensor-core mma -----------------------------------------------------------
    def _mma_combine(reference, ctype):
        def combine(values, mask):
            a = np.array([[_u32(x) for x in v[0:4]] for v in values], np.uint32)
            b = np.array([[_u32(x) for x in v[4:6]] for v in values], np.uint32)
            if ctype is np.float32:
                c = np.array([[np.float32(x) for x in v[6:10]] for v in values], np.float32)
            else:
                c = _wrap_i32([[int(x) for x in v[6:10]] for v in values])
            d = reference(a, b, c)
            return [tuple(d[lane]) for lane in range(32)]
        return combine

    _mma_f16_combine = _mma_combine(mma_f16_f32_reference, np.float32)
    _mma_s8_combine = _mma_combine(mma_s8_s32_reference, np.int32)

    def mma_f16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Simulator: m16n8k16 f16*f16+f32 across the warp's 32 lanes (see module docs)."""
        _full_warp("mma_f16_f32")
        return _warp_collective("mma_f16_f32", _FULL_MASK,
                                (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_f16_combine)

    def mma_s8_s32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Simulator: m16n8k32 s8*s8+s32 across the warp's 32 lanes (see module docs)."""
        _full_warp("mma_s8_s32")
        return _warp_collective("mma_s8_s32", _FULL_MASK,
                                (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_s8_combine)

    # ---- ldmatrix ------------------------------------------------------------------
    def _make_ldmatrix(num, trans):
        name = f"ldmatrix_x{num}" + ("_trans" if trans else "")

        def combine(values, mask):
            # read the rows now that every lane has arrived (what the hardware sees)
            d = ldmatrix_reference(np.stack([v.view(np.uint16) for v in values[:8 * num]]),
                                   num, trans)
            if num == 1:
                return [np.uint32(d[lane, 0]) for lane in range(32)]
            return [tuple(np.uint32(x) for x in d[lane]) for lane in range(32)]

        def ldmatrix(smem, idx):
            _full_warp(name)
            _check_space(name, "smem", smem, shared=True)
            lane = _sim_thread().thread_id & 31
            # Only lanes 0..8*num-1 supply row addresses; the others' are ignored.
            row = _bytes_at(name, smem, idx) if lane < 8 * num else None
            return _warp_collective(name, _FULL_MASK, row, combine)
        ldmatrix.__name__ = name
        ldmatrix.__doc__ = f"Simulator: {name} (see module docs)."
        return ldmatrix

    ldmatrix_x1 = _make_ldmatrix(1, False)
    ldmatrix_x2 = _make_ldmatrix(2, False)
    ldmatrix_x4 = _make_ldmatrix(4, False)
    ldmatrix_x1_trans = _make_ldmatrix(1, True)
    ldmatrix_x2_trans = _make_ldmatrix(2, True)
    ldmatrix_x4_trans = _make_ldmatrix(4, True)

    # ---- cp.async: a synchronous 16-byte copy; commit/wait do nothing ---------------
    def cp_async16(dst_smem, di, src_glob, si):
        """Simulator: copy the 16 bytes at &src_glob[si] to &dst_smem[di], now."""
        _check_space("cp_async16", "dst_smem", dst_smem, shared=True)
        _check_space("cp_async16", "src_glob", src_glob, shared=False)
        _bytes_at("cp_async16", dst_smem, di)[:] = _bytes_at("cp_async16", src_glob, si)

    def cp_async16_zfill(dst_smem, di, src_glob, si, src_bytes):
        """Simulator: copy src_bytes (0..16) bytes, zero the rest of the 16."""
        n = int(src_bytes)
        if not 0 <= n <= 16:
            raise ValueError(f"cp_async16_zfill: src_bytes must be 0..16, got {n}")
        _check_space("cp_async16_zfill", "dst_smem", dst_smem, shared=True)
        _check_space("cp_async16_zfill", "src_glob", src_glob, shared=False)
        dst = _bytes_at("cp_async16_zfill", dst_smem, di)
        dst[n:] = 0
        if n:
            dst[:n] = _bytes_at("cp_async16_zfill", src_glob, si)[:n]

    def cp_async_commit():
        pass

    def cp_async_wait_all():
        pass

    def cp_async_wait_group(n):
        pass

    def cp_async_wait_group_0():
        pass

    def cp_async_wait_group_1():
        pass

    def cp_async_wait_group_2():
        pass

    # ---- 128-bit read-only global load ---------------------------------------------
    def ldg_v4(arr, idx):
        """Simulator: four plain loads, after the hardware's 16-byte alignment check."""
        _check_space("ldg_v4", "arr", arr, shared=False)
        a = _np(arr)
        if a.dtype not in (np.uint32, np.int32, np.float32) or a.ndim != 1:
            raise TypeError(f"ldg_v4: needs a 1-d uint32/int32/float32 array, got {a.dtype} "
                            f"{a.ndim}-d")
        v = _bytes_at("ldg_v4", a, int(idx)).view(a.dtype)
        return (v[0], v[1], v[2], v[3])

    # ---- scalar --------------------------------------------------------------------
    def dp4a(a, b, c):
        """Simulator: c + dot(int8x4(a), int8x4(b)), wrapped to int32."""
        a8 = np.array([_u32(a)], np.uint32).view(np.int8).astype(np.int64)
        b8 = np.array([_u32(b)], np.uint32).view(np.int8).astype(np.int64)
        c32 = int(_wrap_i32(int(c)))            # the intrinsic takes c as int32
        return np.int32(_wrap_i32(int((a8 * b8).sum()) + c32))

    def hfma2(a, b, c):
        """Simulator: f16x2 FMA; products of halves are exact in float64, one rounding."""
        words = [np.array([_u32(v)], np.uint32) for v in (a, b, c)]
        return np.uint32(hfma2_reference(*words)[0])

    def _f16_bits(x):
        # f64 -> f32 -> f16, as the compiled code does (the intrinsic takes float32);
        # beyond the half range the result is +-inf, as with cvt.rn.
        with np.errstate(over="ignore"):
            return int(np.float32(x).astype(np.float16).view(np.uint16))

    def pack_half2(lo, hi):
        """Simulator: f16(lo) | f16(hi) << 16, round to nearest even."""
        return np.uint32(_f16_bits(lo) | (_f16_bits(hi) << 16))

    def _bits_to_f32(bits16):
        return np.float32(np.array([bits16], np.uint16).view(np.float16)[0])

    def unpack_half2(h2):
        """Simulator: (f32 of low half, f32 of high half)."""
        u = _u32(h2)
        return (_bits_to_f32(u & 0xFFFF), _bits_to_f32(u >> 16))

    def f16_bits_to_f32(bits):
        """Simulator: f32 of the half in the low 16 bits."""
        return _bits_to_f32(_u32(bits) & 0xFFFF)

    def bits_to_f32(bits):
        """Simulator: the float32 whose bits are `bits`."""
        return np.array([_u32(bits)], np.uint32).view(np.float32)[0]
