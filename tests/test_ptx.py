"""Tests for genie_rt.quant.ptx (and its parts ptx_reference, ptx_device, ptx_sim,
ptx_fallbacks): every intrinsic but the tensor cores' against numpy, three ways. (The tensor
cores - mma, ldmatrix - are tests/test_ptx_mma.py; the simulator's own machinery - what its
fallbacks report, the deadlock checks, the event-driven block - is tests/test_ptx_sim.py.)

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
from numba import cuda, int32

from genie_rt.quant import ptx
from ptx_helpers import assert_compiled_for, assert_every_target_contains, assert_no_f64, compile_in_subprocess

SIM = ptx.SIMULATOR
sim_only = pytest.mark.skipif(not SIM, reason="checks a simulator-only behaviour")
FULL = 0xFFFFFFFF


# =====================================================================================
# Test kernels. Array shapes in comments; `w` = warp index in the grid, `l` = lane.
# =====================================================================================
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
# Host helpers
# =====================================================================================
LANE = np.arange(32)


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
    assert_compiled_for(ptx_text, KERNELS, ((8, 7), (9, 0)))


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_ptx_contains_the_instructions(ptx_text, name):
    assert_every_target_contains(ptx_text[name], EXPECT[name], name)


def test_ptx_zfill_and_no_float64(ptx_text):
    for cc, text in ptx_text["k_cp_async"].items():
        assert "cp.async.cg.shared.global" in text and ", 16, %r" in text, "zfill src-size form"
    for name in ("k_half2",):
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
