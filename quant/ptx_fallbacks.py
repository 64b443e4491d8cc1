"""Simulator versions of quant/ptx.py's intrinsics: the same names and results as
ptx_device.py, in numpy. Warp-wide instructions (mma, ldmatrix) gather the warp's lanes
through ptx_sim's warp exchange and compute with ptx_reference.py; cp.async is a
synchronous copy (commit and wait do nothing); loads and copies check state spaces and
16-byte alignment as the hardware does. Imported by ptx.py only under the simulator.
"""
import numpy as np

from .ptx_reference import (_wrap_i32, hfma2_reference, ldmatrix_reference, mma_f16_f32_reference,
                            mma_s8_k16_reference, mma_s8_s32_reference)
from .ptx_sim import _FULL_MASK, _bytes_at, _check_space, _full_warp, _np, _sim_thread, _warp_collective


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


def _mma_k16_combine(values, mask):
    a = np.array([[_u32(x) for x in v[0:2]] for v in values], np.uint32)
    b = np.array([[_u32(v[2])] for v in values], np.uint32)
    c = _wrap_i32([[int(x) for x in v[3:7]] for v in values])
    d = mma_s8_k16_reference(a, b, c)
    return [tuple(d[lane]) for lane in range(32)]


def mma_s8_k16(a0, a1, b0, c0, c1, c2, c3):
    """Simulator: m16n8k16 s8*s8+s32 across the warp's 32 lanes (see module docs)."""
    _full_warp("mma_s8_k16")
    return _warp_collective("mma_s8_k16", _FULL_MASK, (a0, a1, b0, c0, c1, c2, c3), _mma_k16_combine)


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


def griddep_wait():
    pass                # the simulator runs one grid at a time: nothing to wait for


def griddep_launch_dependents():
    pass


# ---- 128-bit read-only global load ---------------------------------------------
def _ldg_words(name, arr, idx, n):
    """n plain loads of a 1-d 32-bit array from element idx, after the hardware's alignment
    check (the vector's size)."""
    _check_space(name, "arr", arr, shared=False)
    a = _np(arr)
    if a.dtype not in (np.uint32, np.int32, np.float32) or a.ndim != 1:
        raise TypeError(f"{name}: needs a 1-d uint32/int32/float32 array, got {a.dtype} "
                        f"{a.ndim}-d")
    return tuple(_bytes_at(name, a, int(idx), nbytes=4 * n, align=4 * n).view(a.dtype))


def ldg_v4(arr, idx):
    """Simulator: four plain loads, after the hardware's 16-byte alignment check."""
    return _ldg_words("ldg_v4", arr, idx, 4)


def ldg_v2(arr, idx):
    """Simulator: two plain loads, after the hardware's 8-byte alignment check."""
    return _ldg_words("ldg_v2", arr, idx, 2)


def ld_v2(arr, idx):
    """Simulator: ldg_v2's (the simulator's memory is coherent)."""
    return ldg_v2(arr, idx)


def ld_v4(arr, idx):
    """Simulator: ldg_v4's (the simulator's memory is coherent)."""
    return ldg_v4(arr, idx)


def ldw_v4(arr, idx):
    """Simulator: ldg_v4's (ptx_device.ldw_v4 differs only in where the compiler schedules it)."""
    return _ldg_words("ldw_v4", arr, idx, 4)


def ldw_v2(arr, idx):
    """Simulator: ldg_v2's (as ldw_v4)."""
    return _ldg_words("ldw_v2", arr, idx, 2)


def _ld_relaxed(name, arr, idx, dtype):
    """Simulator: a plain load (the simulator's memory is coherent)."""
    _check_space(name, "arr", arr, shared=False)
    a = _np(arr)
    if a.dtype != dtype:
        raise TypeError(f"{name}: needs a {np.dtype(dtype).name} array, got {a.dtype}")
    return a[idx]


def ld_relaxed_f32(arr, idx):
    """Simulator: a plain load (the simulator's memory is coherent)."""
    return _ld_relaxed("ld_relaxed_f32", arr, idx, np.float32)


def ld_relaxed_i32(arr, idx):
    """Simulator: a plain load (the simulator's memory is coherent)."""
    return _ld_relaxed("ld_relaxed_i32", arr, idx, np.int32)


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


def mul_rn(a, b):
    """Simulator: the float32 product of a and b as float32, rounded once."""
    return np.float32(a) * np.float32(b)
