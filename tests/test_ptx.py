"""Tests for genie_rt.quant.ptx (and its parts ptx_reference, ptx_device, ptx_sim,
ptx_fallbacks): every intrinsic against numpy, three ways. (The simulator's own machinery -
what its fallbacks report, the deadlock checks, the event-driven block - is tests/test_ptx_sim.py.)

- simulator tests (default on a machine without a GPU; on a GPU machine the same tests
  run on the device): tiny kernels calling each intrinsic, compared with numpy;
- PTX tests: the same kernels compiled for sm_87 and sm_90 in one subprocess, asserting
  the instructions are really emitted;
- GPU tests (`-m gpu`): larger random checks on a device, bit-exact against the numpy
  references that the simulator fallbacks use (so they also validate the fallbacks).

Kernels are module-level and lazily jitted so ptx_helpers can import this file in a
subprocess without the simulator.
"""

import numpy as np
import pytest
from numba import cuda, float32, int32

from genie_rt.quant import ptx
from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess

SIM = ptx.SIMULATOR
sim_only = pytest.mark.skipif(not SIM, reason="checks a simulator-only behaviour")
FULL = 0xFFFFFFFF


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


@cuda.jit
def k_dp4a(a, b, c, out):
    # a, b (n,) u32 packed 4 x s8; c, out (n,) i32
    i = cuda.grid(1)
    if i < out.size:
        out[i] = ptx.dp4a(a[i], b[i], c[i])


@cuda.jit
def k_ld_relaxed(x, out):
    # x, out (n,) f32: out[i] = x[n - 1 - i] by ld.relaxed.gpu (the fused GEMV's reads of y)
    i = cuda.grid(1)
    if i < out.size:
        out[i] = ptx.ld_relaxed_f32(x, out.size - 1 - i)


@cuda.jit
def k_ldg_v4(xu, xf, out_u, out_f):
    # xu (4n,) u32, xf (4n,) f32; out_u (n, 4) u32, out_f (n, 4) f32
    i = cuda.grid(1)
    if i < out_u.shape[0]:
        u = ptx.ldg_v4(xu, i * 4)
        f = ptx.ldg_v4(xf, i * 4)
        for k in range(4):
            out_u[i, k] = u[k]
            out_f[i, k] = f[k]


@cuda.jit
def k_ldg_v2(xu, xf, out_u, out_f):
    # xu (2n + 2,) u32, xf (2n + 2,) f32; out_u (n, 2) u32, out_f (n, 2) f32: words 2i + 2, 2i + 3
    # (an 8-byte boundary that is not a 16-byte one for odd i); f by the coherent ld_v2
    i = cuda.grid(1)
    if i < out_u.shape[0]:
        u = ptx.ldg_v2(xu, i * 2 + 2)
        f = ptx.ld_v2(xf, i * 2 + 2)
        for k in range(2):
            out_u[i, k] = u[k]
            out_f[i, k] = f[k]


@cuda.jit
def k_cp_async(src8, src32, src16, out8, out32, out16, outz):
    # src8/out8 (64*16,) u8, src32/out32 (64*4,) u32, src16/out16 (64*8,) f16,
    # outz (64*16,) u8: zero-fill copy of src8 with tid % 17 source bytes. 64 threads.
    s8 = cuda.shared.array(1024, np.uint8, alignment=16)
    s32 = cuda.shared.array(256, np.uint32, alignment=16)
    s16 = cuda.shared.array(512, np.float16, alignment=16)
    sz = cuda.shared.array(1024, np.uint8, alignment=16)
    t = cuda.threadIdx.x
    ptx.cp_async16(s8, t * 16, src8, t * 16)
    ptx.cp_async_commit()
    ptx.cp_async16(s32, t * 4, src32, t * 4)
    ptx.cp_async16(s16, t * 8, src16, t * 8)
    ptx.cp_async_commit()
    ptx.cp_async16_zfill(sz, t * 16, src8, t * 16, t % 17)
    ptx.cp_async_commit()
    ptx.cp_async_wait_group_2()
    ptx.cp_async_wait_group_1()
    ptx.cp_async_wait_group(0)
    cuda.syncthreads()
    # read back a neighbour's chunk, so the copy must be visible block-wide
    u = (t + 1) & 63
    for k in range(16):
        out8[u * 16 + k] = s8[u * 16 + k]
        outz[u * 16 + k] = sz[u * 16 + k]
    for k in range(4):
        out32[u * 4 + k] = s32[u * 4 + k]
    for k in range(8):
        out16[u * 8 + k] = s16[u * 8 + k]


@cuda.jit
def k_shuffles(xi, xf, out):
    # xi (n,) i32, xf (n,) f32; out (n, 6) i32: xor-sum, down-sum, idx, up, ballot, f32 xor-sum
    i = cuda.grid(1)
    l = cuda.threadIdx.x & 31
    w = cuda.threadIdx.x >> 5
    v = xi[i]
    f = xf[i]
    s = v
    for off in (16, 8, 4, 2, 1):
        s += cuda.shfl_xor_sync(FULL, s, off)
    dn = v
    for off in (16, 8, 4, 2, 1):
        dn += cuda.shfl_down_sync(FULL, dn, off)
    src = (w * 7 + cuda.blockIdx.x * 3) & 31
    bc = cuda.shfl_sync(FULL, v, src)
    up = cuda.shfl_up_sync(FULL, v, 3)
    bal = cuda.ballot_sync(FULL, v > 0)
    for off in (16, 8, 4, 2, 1):
        f += cuda.shfl_xor_sync(FULL, f, off)
    out[i, 0] = s
    out[i, 1] = dn
    out[i, 2] = bc
    out[i, 3] = up
    out[i, 4] = int32(bal)
    out[i, 5] = int32(f)


@cuda.jit
def k_shuffles_partial(xi, out):
    # blockDim 48: warp 1 has 16 lanes. xi (n,) i32; out (n, 3) i32:
    # xor-sum over 16-lane groups, broadcast of lane 5, ballot(v > 0)
    i = cuda.grid(1)
    v = xi[i]
    s = v
    for off in (8, 4, 2, 1):
        s += cuda.shfl_xor_sync(FULL, s, off)
    out[i, 0] = s
    out[i, 1] = cuda.shfl_sync(FULL, v, 5)
    out[i, 2] = int32(cuda.ballot_sync(FULL, v > 0))


@cuda.jit
def k_half2(x, packed, unpacked, bits, from_bits):
    # x (n, 2) f32; packed (n,) u32; unpacked (n, 2) f32; bits (n,) u16; from_bits (n,) f32
    i = cuda.grid(1)
    if i < packed.size:
        p = ptx.pack_half2(x[i, 0], x[i, 1])
        packed[i] = p
        lo, hi = ptx.unpack_half2(p)
        unpacked[i, 0] = lo
        unpacked[i, 1] = hi
        from_bits[i] = ptx.f16_bits_to_f32(bits[i])


# Signatures for the PTX tests (the simulator and the GPU tests type them lazily).
KERNELS = {
    "k_mma_f16": "void(uint32[:,:,::1], uint32[:,:,::1], float32[:,:,::1], float32[:,:,::1])",
    "k_mma_s8": "void(uint32[:,:,::1], uint32[:,:,::1], int32[:,:,::1], int32[:,:,::1])",
    "k_mma_s8_k16": "void(uint32[:,:,::1], uint32[:,:,::1], int32[:,:,::1], int32[:,:,::1])",
    "k_ldmatrix_mma_f16": "void(float16[::1], float16[::1], float16[::1], uint32[:,::1], "
                          "float32[:,::1], float32[:,::1])",
    "k_ldmatrix_b_x4": "void(float16[::1], uint32[:,::1])",
    "k_ldmatrix_mma_s8": "void(int8[::1], int8[::1], int32[:,::1])",
    "k_dp4a": "void(uint32[::1], uint32[::1], int32[::1], int32[::1])",
    "k_ldg_v4": "void(uint32[::1], float32[::1], uint32[:,::1], float32[:,::1])",
    "k_ldg_v2": "void(uint32[::1], float32[::1], uint32[:,::1], float32[:,::1])",
    "k_ld_relaxed": "void(float32[::1], float32[::1])",
    "k_cp_async": "void(uint8[::1], uint32[::1], float16[::1], uint8[::1], uint32[::1], "
                  "float16[::1], uint8[::1])",
    "k_shuffles": "void(int32[::1], float32[::1], int32[:,::1])",
    "k_half2": "void(float32[:,::1], uint32[::1], float32[:,::1], uint16[::1], float32[::1])",
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


def shuffle_reference(xi, xf, block):
    n = xi.size
    out = np.zeros((n, 6), np.int64)
    for blk in range(n // block):
        for w in range(block // 32):
            base = blk * block + w * 32
            v = xi[base:base + 32].astype(np.int64)
            dn = v.copy()
            for off in (16, 8, 4, 2, 1):
                src = np.where(LANE + off < 32, LANE + off, LANE)
                dn = dn + dn[src]
            src = (w * 7 + blk * 3) & 31
            up = np.where(LANE >= 3, v[np.maximum(LANE - 3, 0)], v)
            bal = int(sum(1 << k for k in range(32) if v[k] > 0))
            out[base:base + 32, 0] = v.sum()
            out[base:base + 32, 1] = dn
            out[base:base + 32, 2] = v[src]
            out[base:base + 32, 3] = up
            out[base:base + 32, 4] = np.int64(np.uint32(bal).view(np.int32))
            out[base:base + 32, 5] = int(xf[base:base + 32].sum())
    return out


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


def test_dp4a_exact():
    rng = np.random.default_rng(6)
    n = 96
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    c = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    a[0] = b[0] = 0x80808080                  # 4 * (-128 * -128) = 65536
    c[1] = 2**31 - 1                          # wraps
    a[1] = b[1] = 0x7F7F7F7F
    out = np.zeros(n, np.int32)
    k_dp4a[2, 64](a, b, c, out)
    a8 = a.view(np.int8).reshape(n, 4).astype(np.int64)
    b8 = b.view(np.int8).reshape(n, 4).astype(np.int64)
    want = (a8 * b8).sum(1) + c
    want = ((want + 2**31) % 2**32 - 2**31).astype(np.int32)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(ptx.dp4a_reference(a, b, c), want)


def test_ldg_v4():
    n = 48
    xu = np.arange(4 * n, dtype=np.uint32) * np.uint32(2654435761)
    xf = np.linspace(-3, 3, 4 * n).astype(np.float32)
    out_u = np.zeros((n, 4), np.uint32)
    out_f = np.zeros((n, 4), np.float32)
    k_ldg_v4[1, 64](xu, xf, out_u, out_f)
    np.testing.assert_array_equal(out_u, xu.reshape(n, 4))
    np.testing.assert_array_equal(out_f, xf.reshape(n, 4))


def test_ldg_v2_and_ld_v2():
    n = 37
    xu = np.arange(2 * n + 2, dtype=np.uint32) * np.uint32(2654435761)
    xf = np.linspace(-3, 3, 2 * n + 2).astype(np.float32)
    out_u = np.zeros((n, 2), np.uint32)
    out_f = np.zeros((n, 2), np.float32)
    k_ldg_v2[1, 64](xu, xf, out_u, out_f)
    np.testing.assert_array_equal(out_u, xu[2:].reshape(n, 2))
    np.testing.assert_array_equal(out_f, xf[2:].reshape(n, 2))


@pytest.mark.skipif(not ptx.SIMULATOR, reason="the simulator's alignment check (a GPU faults)")
def test_ldg_v2_refuses_a_misaligned_address():
    @cuda.jit
    def odd(x, out):
        v = ptx.ldg_v2(x, 1)                     # word 1: 4 bytes past an 8-byte boundary
        out[0] = v[0]
    with pytest.raises(RuntimeError, match="misaligned"):
        odd[1, 1](np.zeros(8, np.uint32), np.zeros(1, np.uint32))


def test_ld_relaxed_f32():
    x = np.linspace(-3, 3, 40).astype(np.float32)
    out = np.zeros(40, np.float32)
    k_ld_relaxed[1, 64](x, out)
    np.testing.assert_array_equal(out, x[::-1])


def test_cp_async_copies_16_bytes_of_each_dtype():
    rng = np.random.default_rng(7)
    src8 = rng.integers(0, 256, 1024).astype(np.uint8)
    src32 = rng.integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)
    src16 = rng.standard_normal(512).astype(np.float16)
    out8, outz = np.zeros_like(src8), np.full_like(src8, 0xEE)
    out32, out16 = np.zeros_like(src32), np.zeros_like(src16)
    k_cp_async[1, 64](src8, src32, src16, out8, out32, out16, outz)
    np.testing.assert_array_equal(out8, src8)
    np.testing.assert_array_equal(out32, src32)
    np.testing.assert_array_equal(out16.view(np.uint16), src16.view(np.uint16))
    want = src8.reshape(64, 16).copy()
    for t in range(64):
        want[t, t % 17:] = 0
    np.testing.assert_array_equal(outz.reshape(64, 16), want)


@pytest.mark.parametrize("block,grid", [(64, 2), (128, 3)])
def test_warp_shuffles(block, grid):
    rng = np.random.default_rng(block + grid)
    n = block * grid
    xi = rng.integers(-1000, 1000, n).astype(np.int32)
    xf = rng.integers(-50, 50, n).astype(np.float32)
    out = np.zeros((n, 6), np.int32)
    k_shuffles[grid, block](xi, xf, out)
    np.testing.assert_array_equal(out, shuffle_reference(xi, xf, block))


def test_warp_shuffles_partial_warp():
    rng = np.random.default_rng(9)
    block, grid = 48, 2
    xi = rng.integers(-1000, 1000, block * grid).astype(np.int32)
    out = np.zeros((block * grid, 3), np.int32)
    k_shuffles_partial[grid, block](xi, out)
    for blk in range(grid):
        for base, nl in ((0, 32), (32, 16)):
            v = xi[blk * block + base: blk * block + base + nl]
            o = out[blk * block + base: blk * block + base + nl]
            np.testing.assert_array_equal(o[:, 0], np.repeat(v.reshape(-1, 16).sum(1), 16))
            np.testing.assert_array_equal(o[:, 1], v[5])
            bal = sum(1 << k for k in range(nl) if v[k] > 0)
            np.testing.assert_array_equal(o[:, 2], np.uint32(bal).view(np.int32))


def test_pack_unpack_half2():
    rng = np.random.default_rng(10)
    n = 64
    x = (rng.standard_normal((n, 2)) * 10.0 ** rng.integers(-9, 6, (n, 2))).astype(np.float32)
    x[0] = [65504.0, -65520.0]                # max half; rounds to -inf
    x[1] = [1e-8, -3e-5]                      # subnormal halves / rounds to zero
    x[2] = [np.inf, -0.0]
    bits = rng.integers(0, 2**16, n).astype(np.uint16)
    bits[0], bits[1] = 0x7C00, 0x0001         # +inf, smallest subnormal
    packed = np.zeros(n, np.uint32)
    unpacked = np.zeros((n, 2), np.float32)
    from_bits = np.zeros(n, np.float32)
    k_half2[1, 64](x, packed, unpacked, bits, from_bits)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    want = h[:, 0].view(np.uint16).astype(np.uint32) | (h[:, 1].view(np.uint16).astype(np.uint32) << 16)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(unpacked, h.astype(np.float32))
    ok = ~np.isnan(bits.view(np.float16))
    np.testing.assert_array_equal(from_bits[ok], bits.view(np.float16)[ok].astype(np.float32))
    assert np.isnan(from_bits[~ok]).all()


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
    "k_dp4a": ["dp4a.s32.s32"],
    "k_ldg_v4": ["ld.global.nc.v4.u32", "ld.global.nc.v4.f32"],
    "k_ldg_v2": ["ld.global.nc.v2.u32", "ld.global.v2.f32"],
    "k_ld_relaxed": ["ld.relaxed.gpu.global.f32"],
    "k_cp_async": ["cp.async.cg.shared.global", "cp.async.wait_group 2",
                   "cp.async.wait_group 1", "cp.async.wait_group 0"],
    "k_shuffles": ["shfl.sync.bfly.b32", "shfl.sync.down.b32", "shfl.sync.idx.b32",
                   "shfl.sync.up.b32", "vote.sync.ballot.b32"],
    "k_half2": ["cvt.rn.f16x2.f32", "cvt.f32.f16"],
}


@pytest.fixture(scope="module")
def ptx_text():
    return compile_in_subprocess(__file__, KERNELS)


def test_ptx_compiles_for_sm87_and_sm90(ptx_text):
    assert set(ptx_text) == set(KERNELS)
    for name, per_cc in ptx_text.items():
        assert set(per_cc) == {(8, 7), (9, 0)}, name
        for cc, text in per_cc.items():
            assert f".target sm_{cc[0]}{cc[1]}" in text


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_ptx_contains_the_instructions(ptx_text, name):
    for cc, text in ptx_text[name].items():
        assert_ptx_contains(text, *EXPECT[name], where=f"{name} sm_{cc[0]}{cc[1]}")


def test_ptx_zfill_and_no_float64(ptx_text):
    for cc, text in ptx_text["k_cp_async"].items():
        assert "cp.async.cg.shared.global" in text and ", 16, %r" in text, "zfill src-size form"
    for name in ("k_mma_f16", "k_mma_s8", "k_mma_s8_k16", "k_ldmatrix_mma_f16", "k_ldmatrix_mma_s8", "k_half2"):
        for cc, text in ptx_text[name].items():
            assert_no_f64(text, where=f"{name} sm_{cc[0]}{cc[1]}")


def test_ptx_helper_accepts_source_text_and_device_functions():
    src = """
        from numba import cuda
        from genie_rt.quant import ptx

        @cuda.jit(device=True)
        def dot4(a, b, c):
            return ptx.dp4a(a, b, c)
    """
    out = compile_in_subprocess(src, {"dot4": ("int32(uint32, uint32, int32)", {"device": True})},
                                ccs=[(8, 7)])
    assert "dp4a.s32.s32" in out["dot4"][(8, 7)]


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


@pytest.mark.gpu
def test_gpu_dp4a_random_bit_exact():
    rng = np.random.default_rng(22)
    n = 1 << 16
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    c = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    out = np.zeros(n, np.int32)
    k_dp4a[n // 256, 256](a, b, c, out)
    np.testing.assert_array_equal(out, ptx.dp4a_reference(a, b, c))


@pytest.mark.gpu
def test_gpu_half2_all_finite_bit_patterns():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    n = bits.size
    x = np.random.default_rng(23).standard_normal((n, 2)).astype(np.float32) * 1e3
    packed = np.zeros(n, np.uint32)
    unpacked = np.zeros((n, 2), np.float32)
    from_bits = np.zeros(n, np.float32)
    k_half2[n // 256, 256](x, packed, unpacked, bits, from_bits)
    h = x.astype(np.float16)
    want = h[:, 0].view(np.uint16).astype(np.uint32) | (h[:, 1].view(np.uint16).astype(np.uint32) << 16)
    np.testing.assert_array_equal(packed, want)
    ok = ~np.isnan(bits.view(np.float16))
    np.testing.assert_array_equal(from_bits[ok], bits.view(np.float16)[ok].astype(np.float32))


@pytest.mark.gpu
def test_gpu_ldg_v4_large():
    n = 1 << 18
    xu = np.arange(4 * n, dtype=np.uint32)
    xf = xu.astype(np.float32)
    out_u = np.zeros((n, 4), np.uint32)
    out_f = np.zeros((n, 4), np.float32)
    k_ldg_v4[n // 256, 256](xu, xf, out_u, out_f)
    np.testing.assert_array_equal(out_u, xu.reshape(n, 4))
    np.testing.assert_array_equal(out_f, xf.reshape(n, 4))
