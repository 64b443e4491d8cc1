"""Tests for the tensor-core intrinsics of genie_rt.quant.ptx (mma.sync f16 and int8, m16n8k32 and
m16n8k16; ldmatrix) and their fragment helpers, against numpy, three ways - as tests/test_ptx.py
does for the other intrinsics:

- simulator tests (on a GPU machine the same tests run on the device): tiny kernels, fragments
  packed here from the PTX ISA's tables (not with ptx.frag_*), compared with numpy;
- PTX tests: the kernels compiled for sm_87 and sm_90 in one subprocess, the instructions there;
- GPU tests (`-m gpu`): many warps, bit-exact against the references the fallbacks use.

Kernels are module-level and lazily jitted so ptx_helpers can import this file in a subprocess
without the simulator.
"""

import numpy as np
import pytest
from numba import cuda, float32

from genie_rt.quant import ptx
from ptx_helpers import assert_compiled_for, assert_every_target_contains, assert_no_f64, compile_in_subprocess


# =====================================================================================
# Test kernels. Array shapes in comments; `w` = warp index in the grid, `l` = lane.
# =====================================================================================
@cuda.jit
def k_mma_f16(a, b, c, d):
    # a (warps, 32, 4) u32, b (warps, 32, 2) u32, c/d (warps, 32, 4) f32: one mma per warp
    w = cuda.grid(1) >> 5
    l = cuda.threadIdx.x & 31
    r = ptx.mma_f16_f32(a[w, l, 0], a[w, l, 1], a[w, l, 2], a[w, l, 3], b[w, l, 0], b[w, l, 1],
                        c[w, l, 0], c[w, l, 1], c[w, l, 2], c[w, l, 3])
    for k in range(4):
        d[w, l, k] = r[k]


@cuda.jit
def k_mma_s8(a, b, c, d):
    # a (warps, 32, 4) u32, b (warps, 32, 2) u32, c/d (warps, 32, 4) i32
    w = cuda.grid(1) >> 5
    l = cuda.threadIdx.x & 31
    r = ptx.mma_s8_s32(a[w, l, 0], a[w, l, 1], a[w, l, 2], a[w, l, 3], b[w, l, 0], b[w, l, 1],
                       c[w, l, 0], c[w, l, 1], c[w, l, 2], c[w, l, 3])
    for k in range(4):
        d[w, l, k] = r[k]


@cuda.jit
def k_mma_s8_k16(a, b, c, d):
    # a (warps, 32, 2) u32, b (warps, 32, 1) u32, c/d (warps, 32, 4) i32
    w = cuda.grid(1) >> 5
    l = cuda.threadIdx.x & 31
    r = ptx.mma_s8_k16(a[w, l, 0], a[w, l, 1], b[w, l, 0], c[w, l, 0], c[w, l, 1], c[w, l, 2], c[w, l, 3])
    for k in range(4):
        d[w, l, k] = r[k]


@cuda.jit
def k_ldmatrix_mma_f16(a_g, bt_g, b_g, frags, d_nt, d_t):
    # a_g (256,) f16 = A 16x16 row-major; bt_g (128,) f16 = B^T 8x16; b_g (128,) f16 = B 16x8
    # frags (32, 16) u32: every ldmatrix variant's registers; d_nt/d_t (32, 4) f32
    sa = cuda.shared.array(256, np.float16, alignment=16)
    sbt = cuda.shared.array(128, np.float16, alignment=16)
    sb = cuda.shared.array(128, np.float16, alignment=16)
    l = cuda.threadIdx.x
    ptx.cp_async16(sa, l * 8, a_g, l * 8)                 # 32 chunks of 8 halves
    if l < 16:
        ptx.cp_async16(sbt, l * 8, bt_g, l * 8)
        ptx.cp_async16(sb, l * 8, b_g, l * 8)
    ptx.cp_async_commit()
    ptx.cp_async_wait_all()
    cuda.syncthreads()
    # A: lane l points at row (l & 15), column 8 * (l >> 4): matrices (0-7,0-7) (8-15,0-7)
    # (0-7,8-15) (8-15,8-15) = a0..a3
    a = ptx.ldmatrix_x4(sa, (l & 15) * 16 + (l >> 4) * 8)
    # B^T rows (n) 0..7, k halves 0-7 then 8-15 = b0, b1. Lanes >= 16 are ignored.
    bn = ptx.ldmatrix_x2(sbt, (l & 7) * 16 + ((l >> 3) & 1) * 8)
    # B rows (k) 0..15 transposed = b0, b1
    bt = ptx.ldmatrix_x2_trans(sb, (l & 15) * 8)
    x1 = ptx.ldmatrix_x1(sa, (l & 7) * 16)
    x1t = ptx.ldmatrix_x1_trans(sa, (l & 7) * 16)
    x4t = ptx.ldmatrix_x4_trans(sa, (l & 15) * 16 + (l >> 4) * 8)
    for k in range(4):
        frags[l, k] = a[k]
        frags[l, 8 + k] = x4t[k]
    frags[l, 4] = bn[0]
    frags[l, 5] = bn[1]
    frags[l, 6] = bt[0]
    frags[l, 7] = bt[1]
    frags[l, 12] = x1
    frags[l, 13] = x1t
    z = float32(0.0)
    r = ptx.mma_f16_f32(a[0], a[1], a[2], a[3], bn[0], bn[1], z, z, z, z)
    s = ptx.mma_f16_f32(a[0], a[1], a[2], a[3], bt[0], bt[1], z, z, z, z)
    for k in range(4):
        d_nt[l, k] = r[k]
        d_t[l, k] = s[k]


@cuda.jit
def k_ldmatrix_b_x4(bt_g, frags):
    # bt_g (256,) f16 = B^T 16x16 (n x k): two n-tiles; frags (32, 4) u32
    sbt = cuda.shared.array((16, 16), np.float16, alignment=16)
    l = cuda.threadIdx.x
    ptx.cp_async16(sbt, (l >> 1, (l & 1) * 8), bt_g, l * 8)
    ptx.cp_async_wait_all()
    cuda.syncthreads()
    b = ptx.ldmatrix_x4(sbt, ((l & 7) + ((l >> 4) << 3), ((l >> 3) & 1) * 8))
    for k in range(4):
        frags[l, k] = b[k]


@cuda.jit
def k_ldmatrix_mma_s8(a_g, bt_g, d):
    # a_g (512,) i8 = A 16x32 row-major; bt_g (256,) i8 = B^T 8x32; d (32, 4) i32
    sa = cuda.shared.array((16, 32), np.int8, alignment=16)
    sbt = cuda.shared.array((8, 32), np.int8, alignment=16)
    l = cuda.threadIdx.x
    ptx.cp_async16(sa, (l >> 1, (l & 1) * 16), a_g, l * 16)
    if l < 16:
        ptx.cp_async16(sbt, (l >> 1, (l & 1) * 16), bt_g, l * 16)
    ptx.cp_async_commit()
    ptx.cp_async_wait_group(0)
    cuda.syncthreads()
    # int8 tiles are loaded as b16 pairs: the same lane addresses give the s8 fragments
    a = ptx.ldmatrix_x4(sa, (l & 15, (l >> 4) * 16))
    b = ptx.ldmatrix_x2(sbt, (l & 7, ((l >> 3) & 1) * 16))
    r = ptx.mma_s8_s32(a[0], a[1], a[2], a[3], b[0], b[1], 0, 0, 0, 0)
    for k in range(4):
        d[l, k] = r[k]


# Signatures for the PTX tests (the simulator and the GPU tests type them lazily).
KERNELS = {
    "k_mma_f16": "void(uint32[:,:,::1], uint32[:,:,::1], float32[:,:,::1], float32[:,:,::1])",
    "k_mma_s8": "void(uint32[:,:,::1], uint32[:,:,::1], int32[:,:,::1], int32[:,:,::1])",
    "k_mma_s8_k16": "void(uint32[:,:,::1], uint32[:,:,::1], int32[:,:,::1], int32[:,:,::1])",
    "k_ldmatrix_mma_f16": "void(float16[::1], float16[::1], float16[::1], uint32[:,::1], "
                          "float32[:,::1], float32[:,::1])",
    "k_ldmatrix_b_x4": "void(float16[::1], uint32[:,::1])",
    "k_ldmatrix_mma_s8": "void(int8[::1], int8[::1], int32[:,::1])",
}


# =====================================================================================
# Host helpers: independent fragment packing (written from the PTX ISA tables, not with
# ptx.frag_*), so the tests do not check the module against itself.
# =====================================================================================
LANE = np.arange(32)
G, T = LANE >> 2, LANE & 3


def _pk16(m, r, c):
    return m[r, c].view(np.uint16).astype(np.uint32) | (m[r, c + 1].view(np.uint16).astype(np.uint32) << 16)


def _pk8(m, r, c):
    return sum(m[r, c + j].view(np.uint8).astype(np.uint32) << (8 * j) for j in range(4)).astype(np.uint32)


def pack_f16(A, B):
    a = np.stack([_pk16(A, G, 2 * T), _pk16(A, G + 8, 2 * T),
                  _pk16(A, G, 2 * T + 8), _pk16(A, G + 8, 2 * T + 8)], 1)
    b = np.stack([_pk16(B.T, G, 2 * T), _pk16(B.T, G, 2 * T + 8)], 1)
    return a, b


def pack_s8(A, B):
    a = np.stack([_pk8(A, G, 4 * T), _pk8(A, G + 8, 4 * T),
                  _pk8(A, G, 4 * T + 16), _pk8(A, G + 8, 4 * T + 16)], 1)
    b = np.stack([_pk8(B.T, G, 4 * T), _pk8(B.T, G, 4 * T + 16)], 1)
    return a, b


def pack_c(C):
    return np.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], 1)


def unpack_d(D):
    out = np.zeros((16, 8), D.dtype)
    out[G, 2 * T], out[G, 2 * T + 1], out[G + 8, 2 * T], out[G + 8, 2 * T + 1] = D.T
    return out


def mma_f16_atol(A, B, C=0.0, ulps=8):
    """Tolerance for an f16 mma with f32 accumulation: a few f32 ulps of the magnitude of
    the terms summed (|A| @ |B| + |C|); the tensor core's internal rounding is unspecified."""
    scale = np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64)) + np.abs(C)
    return ulps * np.finfo(np.float32).eps * scale + 1e-30


def assert_close(got, want, rtol, atol, what):
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    tol = atol + rtol * np.abs(want.astype(np.float64))
    if (err > tol).any():
        k = np.unravel_index(np.argmax(err - tol), err.shape)
        raise AssertionError(f"{what}: worst at {k}: got {got[k]}, want {want[k]} "
                             f"({int((err > tol).sum())} of {err.size} outside tolerance)")


def run_mma_f16(nwarps, rng, grid, block):
    A = rng.standard_normal((nwarps, 16, 16)).astype(np.float16)
    B = rng.standard_normal((nwarps, 16, 8)).astype(np.float16)
    C = rng.standard_normal((nwarps, 16, 8)).astype(np.float32)
    a = np.stack([pack_f16(A[w], B[w])[0] for w in range(nwarps)])
    b = np.stack([pack_f16(A[w], B[w])[1] for w in range(nwarps)])
    c = np.stack([pack_c(C[w]) for w in range(nwarps)])
    d = np.zeros_like(c)
    k_mma_f16[grid, block](a, b, c, d)
    for w in range(nwarps):
        want = A[w].astype(np.float64) @ B[w].astype(np.float64) + C[w]
        assert_close(unpack_d(d[w]), want, 0, mma_f16_atol(A[w], B[w], C[w]), f"mma f16 warp {w}")
    return a, b, c, d


def run_mma_s8(nwarps, rng, grid, block, c_scale=1000):
    A = rng.integers(-128, 128, (nwarps, 16, 32)).astype(np.int8)
    B = rng.integers(-128, 128, (nwarps, 32, 8)).astype(np.int8)
    A[0, 0, :] = -128                         # extremes: -128 * -128 products
    B[0, :, 0] = -128
    C = rng.integers(-c_scale, c_scale, (nwarps, 16, 8)).astype(np.int32)
    a = np.stack([pack_s8(A[w], B[w])[0] for w in range(nwarps)])
    b = np.stack([pack_s8(A[w], B[w])[1] for w in range(nwarps)])
    c = np.stack([pack_c(C[w]) for w in range(nwarps)])
    d = np.zeros_like(c)
    k_mma_s8[grid, block](a, b, c, d)
    for w in range(nwarps):
        want = A[w].astype(np.int64) @ B[w].astype(np.int64) + C[w]
        want = ((want + 2**31) % 2**32 - 2**31).astype(np.int32)
        np.testing.assert_array_equal(unpack_d(d[w]), want, err_msg=f"mma s8 warp {w}")
    return a, b, c, d


def run_mma_s8_k16(nwarps, rng, grid, block, c_scale=1000):
    """m16n8k16 s8 against A @ B + C, the fragments packed from the PTX ISA's table (a0 = row g,
    a1 = row g + 8, both k 4t..4t+3; b0 = k 4t..4t+3 of column g), not from ptx_reference."""
    A = rng.integers(-128, 128, (nwarps, 16, 16)).astype(np.int8)
    B = rng.integers(-128, 128, (nwarps, 16, 8)).astype(np.int8)
    A[0, 0, :], B[0, :, 0] = -128, -128
    C = rng.integers(-c_scale, c_scale, (nwarps, 16, 8)).astype(np.int32)
    a = np.stack([np.stack([_pk8(A[w], G, 4 * T), _pk8(A[w], G + 8, 4 * T)], 1) for w in range(nwarps)])
    b = np.stack([_pk8(B[w].T, G, 4 * T)[:, None] for w in range(nwarps)])
    c = np.stack([pack_c(C[w]) for w in range(nwarps)])
    d = np.zeros_like(c)
    k_mma_s8_k16[grid, block](a, b, c, d)
    for w in range(nwarps):
        want = A[w].astype(np.int64) @ B[w].astype(np.int64) + C[w]
        want = ((want + 2**31) % 2**32 - 2**31).astype(np.int32)
        np.testing.assert_array_equal(unpack_d(d[w]), want, err_msg=f"mma s8 k16 warp {w}")
    return a, b, c, d


# =====================================================================================
# Simulator tests (on a GPU machine these run on the device).
# =====================================================================================
def test_fragment_helpers_match_ptx_isa_tables():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    a, b = pack_f16(A, B)
    np.testing.assert_array_equal(ptx.frag_a_f16(A), a)
    np.testing.assert_array_equal(ptx.frag_b_f16(B), b)
    np.testing.assert_array_equal(ptx.unfrag_a_f16(a), A)
    np.testing.assert_array_equal(ptx.unfrag_b_f16(b), B)
    A8 = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    B8 = rng.integers(-128, 128, (32, 8)).astype(np.int8)
    a8, b8 = pack_s8(A8, B8)
    np.testing.assert_array_equal(ptx.frag_a_s8(A8), a8)
    np.testing.assert_array_equal(ptx.frag_b_s8(B8), b8)
    np.testing.assert_array_equal(ptx.unfrag_a_s8(a8), A8)
    np.testing.assert_array_equal(ptx.unfrag_b_s8(b8), B8)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    np.testing.assert_array_equal(ptx.frag_c(C), pack_c(C))
    np.testing.assert_array_equal(ptx.unfrag_c(pack_c(C)), C)


def test_mma_f16_f32():
    # 2 blocks x 2 warps: each warp multiplies its own tiles
    run_mma_f16(4, np.random.default_rng(2), 2, 64)


def test_mma_s8_s32_exact():
    run_mma_s8(4, np.random.default_rng(3), 2, 64)


def test_mma_s8_k16_exact():
    run_mma_s8_k16(4, np.random.default_rng(5), 2, 64)


def test_ldmatrix_and_mma_f16_from_shared_tile():
    rng = np.random.default_rng(4)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    frags = np.zeros((32, 16), np.uint32)
    d_nt = np.zeros((32, 4), np.float32)
    d_t = np.zeros((32, 4), np.float32)
    k_ldmatrix_mma_f16[1, 32](A.ravel(), np.ascontiguousarray(B.T).ravel(), B.ravel(),
                              frags, d_nt, d_t)
    a, b = pack_f16(A, B)
    np.testing.assert_array_equal(frags[:, 0:4], a, err_msg="ldmatrix_x4 != A fragments")
    np.testing.assert_array_equal(frags[:, 4:6], b, err_msg="ldmatrix_x2 of B^T != B fragments")
    np.testing.assert_array_equal(frags[:, 6:8], b, err_msg="ldmatrix_x2_trans of B != B fragments")
    # x4.trans: matrix m = the 8x8 block of A addressed by lanes 8m..8m+7, transposed
    rows = np.concatenate([A[0:8, 0:8], A[8:16, 0:8], A[0:8, 8:16], A[8:16, 8:16]])
    np.testing.assert_array_equal(frags[:, 8:12], ptx.ldmatrix_reference(rows, 4, trans=True))
    np.testing.assert_array_equal(frags[:, 12], ptx.ldmatrix_reference(A[0:8, 0:8], 1)[:, 0])
    np.testing.assert_array_equal(frags[:, 13], ptx.ldmatrix_reference(A[0:8, 0:8], 1, True)[:, 0])
    want = A.astype(np.float64) @ B.astype(np.float64)
    tol = mma_f16_atol(A, B)
    assert_close(unpack_d(d_nt), want, 0, tol, "ldmatrix + mma (B^T tile)")
    assert_close(unpack_d(d_t), want, 0, tol, "ldmatrix.trans + mma (B tile)")


def test_ldmatrix_x4_gives_b_fragments_of_two_n_tiles():
    B = np.random.default_rng(11).standard_normal((16, 16)).astype(np.float16)   # K x N
    frags = np.zeros((32, 4), np.uint32)
    k_ldmatrix_b_x4[1, 32](np.ascontiguousarray(B.T).ravel(), frags)
    np.testing.assert_array_equal(frags[:, 0:2], pack_f16(B, B[:, 0:8])[1])
    np.testing.assert_array_equal(frags[:, 2:4], pack_f16(B, B[:, 8:16])[1])


def test_ldmatrix_and_mma_s8_from_2d_shared_tile():
    rng = np.random.default_rng(5)
    A = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    B = rng.integers(-128, 128, (32, 8)).astype(np.int8)
    d = np.zeros((32, 4), np.int32)
    k_ldmatrix_mma_s8[1, 32](A.ravel(), np.ascontiguousarray(B.T).ravel(), d)
    np.testing.assert_array_equal(unpack_d(d), (A.astype(np.int32) @ B.astype(np.int32)))


# =====================================================================================
# PTX tests: one subprocess compiles every test kernel for sm_87 and sm_90.
# =====================================================================================
EXPECT = {
    "k_mma_f16": ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"],
    "k_mma_s8": ["mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"],
    "k_mma_s8_k16": ["mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32"],
    "k_ldmatrix_mma_f16": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                           "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
                           "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
                           "ldmatrix.sync.aligned.m8n8.x1.shared.b16",
                           "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16",
                           "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                           "cp.async.cg.shared.global", "cp.async.commit_group",
                           "cp.async.wait_all", "mma.sync.aligned.m16n8k16"],
    "k_ldmatrix_b_x4": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.wait_all"],
    "k_ldmatrix_mma_s8": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.wait_group 0",
                          "mma.sync.aligned.m16n8k32"],
}


@pytest.fixture(scope="module")
def ptx_text():
    return compile_in_subprocess(__file__, KERNELS)


def test_ptx_compiles_for_sm87_and_sm90(ptx_text):
    assert_compiled_for(ptx_text, KERNELS, ((8, 7), (9, 0)))


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_ptx_contains_the_instructions(ptx_text, name):
    assert_every_target_contains(ptx_text[name], EXPECT[name], name)


def test_ptx_no_float64(ptx_text):
    for name in ("k_mma_f16", "k_mma_s8", "k_mma_s8_k16", "k_ldmatrix_mma_f16", "k_ldmatrix_mma_s8"):
        for cc, text in ptx_text[name].items():
            assert_no_f64(text, where=f"{name} sm_{cc[0]}{cc[1]}")


# =====================================================================================
# GPU tests: larger random checks, bit-exact against the numpy references that the
# simulator fallbacks use (run with -m gpu on a machine with a CUDA GPU).
# =====================================================================================
@pytest.mark.gpu
def test_gpu_mma_f16_many_warps_vs_reference():
    a, b, c, d = run_mma_f16(256, np.random.default_rng(20), 32, 256)
    worst = 0.0
    for w in range(a.shape[0]):
        ref = ptx.mma_f16_f32_reference(a[w], b[w], c[w])
        A, B = ptx.unfrag_a_f16(a[w]), ptx.unfrag_b_f16(b[w])
        scale = ptx.frag_c(mma_f16_atol(A, B, ptx.unfrag_c(c[w]), ulps=1))
        # the fallback's single rounding vs the tensor core's: within 2 ulps of the terms
        assert_close(d[w], ref, 0, 2 * scale, f"fallback vs tensor core, warp {w}")
        worst = max(worst, float((np.abs(d[w] - ref) / scale).max()))
    print(f"worst |tensor core - fallback| = {worst:.3f} ulps of the summed magnitude")


@pytest.mark.gpu
def test_gpu_mma_s8_wraps_and_matches_reference_bit_exact():
    rng = np.random.default_rng(21)
    a, b, c, d = run_mma_s8(256, rng, 32, 256, c_scale=2**31)   # C spans int32: sums wrap
    for w in range(a.shape[0]):
        np.testing.assert_array_equal(d[w], ptx.mma_s8_s32_reference(a[w], b[w], c[w]))


@pytest.mark.gpu
def test_gpu_mma_s8_k16_wraps_and_matches_reference_bit_exact():
    a, b, c, d = run_mma_s8_k16(256, np.random.default_rng(23), 32, 256, c_scale=2**31)
    for w in range(a.shape[0]):
        np.testing.assert_array_equal(d[w], ptx.mma_s8_k16_reference(a[w], b[w], c[w]))
