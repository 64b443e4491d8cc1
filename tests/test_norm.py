"""RMSNorm, fused residual + RMSNorm, fused RMSNorm + q8 and SwiGLU kernels
(engine/norm.py) against the numpy reference (engine/models/reference.py's rmsnorm / silu, quant/
gemv.py's quantize_q8): simulator at awkward small shapes, PTX for sm_87 / sm_90
without float64, GPU at the real shapes (-m gpu)."""
import re
import sys
import threading

import numpy as np
import pytest
from numba import cuda

from genie_rt.engine import norm
from genie_rt.engine.models.reference import rmsnorm as qwen3_rmsnorm
from genie_rt.engine.models.reference import silu as qwen3_silu
from genie_rt.quant import gemv
from ptx_helpers import assert_no_f64, compile_in_subprocess

EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _simulator_shared_arrays():
    """The simulator allocates a cuda.shared.array on a thread's first call without a
    lock, so two threads of a block can get different arrays: serialise it (same keying
    by the caller's line; see tests/test_gpu_sampling.py)."""
    if not norm.SIMULATOR:
        yield
        return
    from numba.cuda.simulator import kernelapi
    current = kernelapi.FakeCUDAShared.array
    if not getattr(current, "_genie_locked", False):
        lock = threading.Lock()

        def array(self, shape, dtype, alignment=None):
            if shape == 0:
                return current(self, shape, dtype, alignment)
            f = sys._getframe(1)
            caller = (f.f_code.co_filename, f.f_lineno)
            with lock:
                res = self._allocations.get(caller)
                if res is None:
                    res = current(self, shape, dtype, alignment)
                    for k in [k for k, v in self._allocations.items() if v is res]:
                        del self._allocations[k]
                    self._allocations[caller] = res
                return res
        array._genie_locked = True
        kernelapi.FakeCUDAShared.array = array
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)


def assert_close(got, ref, rtol, what, floor=1e-6):
    """Relative error below rtol, each element measured against max(|ref|, floor)-ish.
    A residual sum (x + norm(y) * w) can cancel to near zero; its float32 rounding is relative
    to the operands, not to the tiny result: such checks pass the stream's scale as `floor`."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    err = np.abs(got - ref) / (np.abs(ref) + floor)
    k = int(np.argmax(err))
    assert err.flat[k] <= rtol, (f"{what}: worst relative error {err.flat[k]:.3g} at {np.unravel_index(k, ref.shape)}: "
                                 f"got {got.flat[k]!r}, reference {ref.flat[k]!r}")


def test_references_are_qwen3s():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 77)).astype(np.float32)
    w = rng.standard_normal(77).astype(np.float32)
    np.testing.assert_array_equal(norm.rmsnorm_reference(x, w, EPS), qwen3_rmsnorm(x, w, EPS))
    u = rng.standard_normal((3, 77)).astype(np.float32)
    np.testing.assert_array_equal(norm.swiglu_reference(x, u), qwen3_silu(x) * u)


@pytest.mark.parametrize("n,d,block", [(3, 200, 64), (2, 37, 32), (1, 128, 32)])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_rmsnorm(n, d, block, out_dtype):
    rng = np.random.default_rng(d)
    x_h = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    w_h = rng.standard_normal(d).astype(np.float32)
    x, w = cuda.to_device(x_h), cuda.to_device(w_h)
    out = cuda.device_array((n, d), out_dtype)
    norm.rmsnorm(x, w, out, EPS, block=block)
    ref = norm.rmsnorm_reference(x_h, w_h, EPS)
    if out_dtype == np.float32:
        assert_close(out.copy_to_host(), ref, 2e-6, "rmsnorm")
    else:   # the float16 rounding of a value within float32 rounding of the reference
        np.testing.assert_allclose(out.copy_to_host().astype(np.float32), ref.astype(np.float16).astype(np.float32),
                                   rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(x.copy_to_host(), x_h)        # input untouched


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_add_rmsnorm_updates_the_residual(out_dtype):
    rng = np.random.default_rng(1)
    n, d = 3, 160
    x_h = rng.standard_normal((n, d)).astype(np.float32)
    dl_h = rng.standard_normal((n, d)).astype(np.float32)
    w_h = rng.standard_normal(d).astype(np.float32)
    x, dl, w = cuda.to_device(x_h), cuda.to_device(dl_h), cuda.to_device(w_h)
    out = cuda.device_array((n, d), out_dtype)
    norm.add_rmsnorm(x, dl, w, out, EPS, block=64)
    np.testing.assert_array_equal(x.copy_to_host(), x_h + dl_h)  # exact: one float32 add
    ref = norm.rmsnorm_reference(x_h + dl_h, w_h, EPS)
    tol = 2e-6 if out_dtype == np.float32 else 1e-3
    assert_close(out.copy_to_host().astype(np.float32), ref, tol, "add_rmsnorm")


def test_rmsnorm_per_head_view():
    """QK-norm: q [n, heads * head_dim] viewed as [n * heads, head_dim]."""
    rng = np.random.default_rng(2)
    n, heads, hd = 2, 3, 64
    q_h = rng.standard_normal((n, heads * hd)).astype(np.float32)
    w_h = rng.standard_normal(hd).astype(np.float32)
    q = cuda.to_device(q_h.reshape(n * heads, hd))
    out = cuda.device_array((n * heads, hd), np.float32)
    norm.rmsnorm(q, cuda.to_device(w_h), out, EPS)
    ref = norm.rmsnorm_reference(q_h.reshape(n, heads, hd), w_h, EPS).reshape(n * heads, hd)
    assert_close(out.copy_to_host(), ref, 2e-6, "per-head rmsnorm")


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_swiglu_separate_and_fused(out_dtype):
    rng = np.random.default_rng(3)
    n, n_ff = 3, 100
    g_h = (rng.standard_normal((n, n_ff)) * 4).astype(np.float32)
    u_h = rng.standard_normal((n, n_ff)).astype(np.float32)
    g_h[0, :4] = [0.0, -30.0, 30.0, -88.0]                      # exp overflow side
    ref = norm.swiglu_reference(g_h, u_h)
    out = cuda.device_array((n, n_ff), out_dtype)
    norm.swiglu(cuda.to_device(g_h), cuda.to_device(u_h), out, block=64)
    tol = 1e-6 if out_dtype == np.float32 else 1e-3
    np.testing.assert_allclose(out.copy_to_host().astype(np.float32), ref, rtol=tol, atol=tol)
    gu = cuda.to_device(np.concatenate([g_h, u_h], axis=1))
    out2 = cuda.device_array((n, n_ff), out_dtype)
    norm.swiglu_fused(gu, out2, block=64)
    np.testing.assert_array_equal(out2.copy_to_host(), out.copy_to_host())


def test_launchers_refuse_bad_arguments():
    x = cuda.to_device(np.zeros((2, 64), np.float32))
    w = cuda.to_device(np.ones(64, np.float32))
    with pytest.raises(TypeError, match="device array"):
        norm.rmsnorm(np.zeros((2, 64), np.float32), w, x, EPS)
    with pytest.raises(ValueError, match="shape"):
        norm.rmsnorm(x, w, cuda.device_array((2, 65), np.float32), EPS)
    with pytest.raises(ValueError, match="float32\\[64\\]"):
        norm.rmsnorm(x, cuda.to_device(np.ones(63, np.float32)), x, EPS)
    with pytest.raises(TypeError, match="float32"):
        norm.rmsnorm(cuda.to_device(np.zeros((2, 64), np.float64)), w, x, EPS)
    with pytest.raises(ValueError, match="shape"):
        norm.swiglu_fused(cuda.to_device(np.zeros((2, 100), np.float32)), cuda.device_array((2, 49), np.float32))


# ---- rmsnorm -> q8 -------------------------------------------------------------------
def _q8_rows(rng, n, d):
    """Random rows (varied scales per 32-block) with an all-zero 32-block in row 0 and,
    from n = 3 on, an all-zero row 2."""
    x = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-3, 3, (n, d // 32, 1))).repeat(32, axis=2).reshape(n, d))
    x = x.astype(np.float32)
    x[0, 32:64] = 0.0
    if n >= 3:
        x[2] = 0.0
    return x


def _two_launches(x, w, block):
    """rmsnorm then quantize_q8: what rmsnorm_q8 replaces (h, xq, xs on the host)."""
    n, d = x.shape
    h = cuda.device_array((n, d), np.float32)
    xq = cuda.device_array((n, d), np.int8)
    xs = cuda.device_array((n, d // 8), np.float32)
    norm.rmsnorm(x, w, h, EPS, block=block)
    gemv.quantize_q8(h, xq, xs)
    return h.copy_to_host(), xq.copy_to_host(), xs.copy_to_host()


def _assert_bits_equal(got, ref, what):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    bad = np.flatnonzero(got.view(np.uint8).reshape(got.size, -1) != ref.view(np.uint8).reshape(ref.size, -1))
    assert bad.size == 0, (f"{what}: {bad.size} elements differ, first at flat {bad[0] // got.itemsize}: "
                           f"{got.flat[bad[0] // got.itemsize]!r} vs {ref.flat[bad[0] // got.itemsize]!r}")


@pytest.mark.parametrize("n,d,block,with_h", [
    (3, 64, 32, False), (3, 64, 64, True), (2, 256, None, False), (2, 256, None, True), (1, 256, 96, True),
    (2, 1024, 32, True),                          # 32 values per thread: the loop kernel
    pytest.param(1, 2560, None, True, marks=pytest.mark.slow)])   # Qwen3-4B's width, 640 threads
def test_rmsnorm_q8_is_rmsnorm_then_quantize_bit_for_bit(n, d, block, with_h):
    rng = np.random.default_rng(d + n)
    x_h = _q8_rows(rng, n, d)
    w_h = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    x, w = cuda.to_device(x_h), cuda.to_device(w_h)
    h_ref, xq_ref, xs_ref = _two_launches(x, w, block)
    xq = cuda.to_device(np.full((n, d), 77, np.int8))
    xs = cuda.to_device(np.full((n, d // 8), np.nan, np.float32))
    out = cuda.to_device(np.full((n, d), np.nan, np.float32)) if with_h else None
    norm.rmsnorm_q8(x, w, xq, xs, EPS, out=out, block=block)
    _assert_bits_equal(xq.copy_to_host(), xq_ref, "xq")
    _assert_bits_equal(xs.copy_to_host(), xs_ref, "xs")
    if with_h:
        _assert_bits_equal(out.copy_to_host(), h_ref, "h")
    _assert_bits_equal(x.copy_to_host(), x_h, "x (input, and the stand-in for out)")
    # and against numpy: h to float32 rounding, q8 exactly quantize_q8_reference's of h
    h_np, _, _ = norm.rmsnorm_q8_reference(x_h, w_h, EPS)
    assert_close(h_ref, h_np, 2e-6, "rmsnorm_q8 h")
    rq, rs = gemv.quantize_q8_reference(h_ref)
    _assert_bits_equal(xq_ref, rq, "xq vs quantize_q8_reference")
    _assert_bits_equal(xs_ref, rs, "xs vs quantize_q8_reference")
    assert np.all(xs_ref[0, 4:8] == 0) and np.all(xq_ref[0, 32:64] == 0)     # the zero block
    if n >= 3:
        assert np.all(xs_ref[2] == 0) and np.all(xq_ref[2] == 0)


def test_rmsnorm_q8_picks_register_resident_up_to_its_limit():
    assert norm._rmsnorm_q8_for(False, 2560, norm.norm_block(2560)) is norm._rmsnorm_q8_r4_kernel
    assert norm._rmsnorm_q8_for(True, 4096, 1024) is norm._rmsnorm_q8_h_r4_kernel
    assert norm._rmsnorm_q8_for(True, 256, 96) is norm._rmsnorm_q8_for(True, 288, 96)     # J = 3, cached
    assert norm._rmsnorm_q8_for(True, 1024, 32) is norm._rmsnorm_q8_h_kernel              # J = 32: the loop
    assert norm._rmsnorm_q8_for(False, 32 * 17, 32) is norm._rmsnorm_q8_kernel


def test_rmsnorm_q8_reference_is_rmsnorm_then_quantize():
    rng = np.random.default_rng(5)
    x = _q8_rows(rng, 3, 96)
    w = rng.standard_normal(96).astype(np.float32)
    h, xq, xs = norm.rmsnorm_q8_reference(x, w, EPS)
    np.testing.assert_array_equal(h, norm.rmsnorm_reference(x, w, EPS))
    rq, rs = gemv.quantize_q8_reference(h)
    np.testing.assert_array_equal(xq, rq)
    np.testing.assert_array_equal(xs, rs)
    assert xq.dtype == np.int8 and xs.shape == (3, 96 // 8)


def test_rmsnorm_q8_refuses_bad_arguments():
    x = cuda.to_device(np.ones((2, 64), np.float32))
    w = cuda.to_device(np.ones(64, np.float32))
    xq = cuda.device_array((2, 64), np.int8)
    xs = cuda.device_array((2, 8), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        norm.rmsnorm_q8(cuda.to_device(np.ones((2, 48), np.float32)), cuda.to_device(np.ones(48, np.float32)),
                        cuda.device_array((2, 48), np.int8), cuda.device_array((2, 6), np.float32), EPS)
    with pytest.raises(ValueError, match="shape"):
        norm.rmsnorm_q8(x, w, xq, cuda.device_array((2, 16), np.float32), EPS)
    with pytest.raises(TypeError, match="int8"):
        norm.rmsnorm_q8(x, w, cuda.device_array((2, 64), np.uint8), xs, EPS)
    with pytest.raises(TypeError, match="float32"):
        norm.rmsnorm_q8(x, w, xq, xs, EPS, out=cuda.device_array((2, 64), np.float16))
    with pytest.raises(ValueError, match="block"):
        norm.rmsnorm_q8(x, w, xq, xs, EPS, block=48)
    with pytest.raises(TypeError, match="device array"):
        norm.rmsnorm_q8(x, w, np.zeros((2, 64), np.int8), xs, EPS)
    with pytest.raises(ValueError, match="out must not be x"):      # J blocks of a row: a race
        norm.rmsnorm_q8(x, w, xq, xs, EPS, out=x)


def test_block_size_choice():
    assert norm.norm_block(2560) == 640
    assert norm.norm_block(128) == 32
    assert norm.norm_block(1 << 20) == 1024


# ---- GeGLU (Gemma 3's FFN) -----------------------------------------------------------
def test_gelu_reference_is_ggmls_tanh_form():
    g = np.linspace(-6, 6, 97, dtype=np.float32)
    ref = 0.5 * g.astype(np.float64) * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g.astype(np.float64) ** 3)))
    # float32 cancellation in 1 + tanh for large negative g: absolute error ~1e-7
    assert np.allclose(norm.gelu_reference(g), ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_geglu_separate_and_fused(out_dtype):
    rng = np.random.default_rng(13)
    n, n_ff = 3, 70
    g_h = (rng.standard_normal((n, n_ff)) * 4).astype(np.float32)
    u_h = rng.standard_normal((n, n_ff)).astype(np.float32)
    g_h[0, :4] = [0.0, -30.0, 30.0, -88.0]
    ref = norm.geglu_reference(g_h, u_h)
    out = cuda.device_array((n, n_ff), out_dtype)
    norm.geglu(cuda.to_device(g_h), cuda.to_device(u_h), out, block=64)
    tol = 2e-6 if out_dtype == np.float32 else 1e-3
    np.testing.assert_allclose(out.copy_to_host().astype(np.float32), ref, rtol=tol, atol=tol)
    out2 = cuda.device_array((n, n_ff), out_dtype)
    norm.geglu_fused(cuda.to_device(np.concatenate([g_h, u_h], axis=1)), out2, block=64)
    np.testing.assert_array_equal(out2.copy_to_host(), out.copy_to_host())


# ---- Gemma 3's post-norms: x += rmsnorm(y) * w_post, then the next pre-norm ----------
from genie_rt.engine import post_norm  # noqa: E402


def _post_case(n, d, seed):
    rng = np.random.default_rng(seed)
    x_h = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    y_h = _q8_rows(rng, n, d) if d % 32 == 0 else rng.standard_normal((n, d)).astype(np.float32)
    if n >= 2:
        y_h[1] = 0.0                    # an all-zero block output: x unchanged
    wp = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    wn = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    return x_h, y_h, wp, wn


def _unfused_post(x_h, y_h, wp, wn, block):
    """rmsnorm(y, w_post) -> add_rmsnorm(x, ., w_next): what post_norm_add replaces.
    Returns (x, h) on the host."""
    n, d = x_h.shape
    x, y = cuda.to_device(x_h), cuda.to_device(y_h)
    t = cuda.device_array((n, d), np.float32)
    h = cuda.device_array((n, d), np.float32)
    norm.rmsnorm(y, cuda.to_device(wp), t, EPS, block=block)
    norm.add_rmsnorm(x, t, cuda.to_device(wn), h, EPS, block=block)
    return x.copy_to_host(), h.copy_to_host()


@pytest.mark.parametrize("n,d,block", [(3, 200, 64), (2, 37, 32),
                                       pytest.param(1, 640, None, marks=pytest.mark.slow)])
def test_post_norm_add_is_the_two_launches_bit_for_bit(n, d, block):
    x_h, y_h, wp, wn = _post_case(n, d, d + n)
    x_ref, h_ref = _unfused_post(x_h, y_h, wp, wn, block)
    x = cuda.to_device(x_h)
    post_norm.post_norm_add(x, cuda.to_device(y_h), cuda.to_device(wp), EPS, block=block)
    _assert_bits_equal(x.copy_to_host(), x_ref, "x (add only)")
    for out_dtype in (np.float32, np.float16):
        x = cuda.to_device(x_h)
        out = cuda.device_array((n, d), out_dtype)
        post_norm.post_norm_add(x, cuda.to_device(y_h), cuda.to_device(wp), EPS,
                                w_next=cuda.to_device(wn), out=out, block=block)
        _assert_bits_equal(x.copy_to_host(), x_ref, "x")
        _assert_bits_equal(out.copy_to_host(), h_ref.astype(out_dtype) if out_dtype == np.float32
                           else out.copy_to_host(), "h")
        if out_dtype == np.float16:
            np.testing.assert_allclose(out.copy_to_host().astype(np.float32), h_ref, rtol=1e-3, atol=1e-3)
    x_np, h_np = post_norm.post_norm_add_reference(x_h, y_h, wp, EPS, wn)
    assert_close(x_ref, x_np, 2e-6, "post_norm_add x vs numpy")
    assert_close(h_ref, h_np, 5e-6, "post_norm_add h vs numpy")
    if n >= 2:
        _assert_bits_equal(x_ref[1], x_h[1], "a zero y leaves x")


@pytest.mark.parametrize("n,d,block,with_h", [
    (2, 64, 32, True),       # 2 values per thread: register-resident
    (3, 96, 96, False),      # 1 value per thread
    pytest.param(1, 640, None, True, marks=pytest.mark.slow),   # Gemma 3 270M: 160 threads x 4
    (1, 1024, 32, False),    # 32 values per thread: the loop kernel
])
def test_post_norm_add_q8_is_rmsnorm_add_rmsnorm_q8_bit_for_bit(n, d, block, with_h):
    x_h, y_h, wp, wn = _post_case(n, d, 7 * d + n)
    x_ref, _ = _unfused_post(x_h, y_h, wp, wn, block)
    _, xq_ref, xs_ref = _two_launches(cuda.to_device(x_ref), cuda.to_device(wn), block)
    h_ref = norm.rmsnorm_q8_reference(x_ref, wn, EPS)[0]
    xq_ref2 = cuda.device_array((n, d), np.int8)
    xs_ref2 = cuda.device_array((n, d // 8), np.float32)
    h_dev = cuda.device_array((n, d), np.float32)
    norm.rmsnorm_q8(cuda.to_device(x_ref), cuda.to_device(wn), xq_ref2, xs_ref2, EPS, out=h_dev,
                    block=block)
    _assert_bits_equal(xq_ref2.copy_to_host(), xq_ref, "rmsnorm_q8 == rmsnorm + quantize_q8")
    x = cuda.to_device(x_h)
    xq = cuda.to_device(np.full((n, d), 77, np.int8))
    xs = cuda.to_device(np.full((n, d // 8), np.nan, np.float32))
    out = cuda.to_device(np.full((n, d), np.nan, np.float32)) if with_h else None
    post_norm.post_norm_add_q8(x, cuda.to_device(y_h), cuda.to_device(wp), cuda.to_device(wn),
                               xq, xs, EPS, out=out, block=block)
    _assert_bits_equal(x.copy_to_host(), x_ref, "x")
    _assert_bits_equal(xq.copy_to_host(), xq_ref, "xq")
    _assert_bits_equal(xs.copy_to_host(), xs_ref, "xs")
    if with_h:
        _assert_bits_equal(out.copy_to_host(), h_dev.copy_to_host(), "h")
    assert_close(h_dev.copy_to_host(), h_ref, 2e-6, "h vs numpy")


def test_post_norm_picks_resident_up_to_its_limit():
    assert post_norm._q8_kernel_for(False, 640, norm.norm_block(640)) is post_norm._post_norm_add_q8_kernel(False, 4)
    assert post_norm._q8_kernel_for(True, 1024, 32) is post_norm._post_norm_add_q8_kernel(True, 0)


def test_post_norm_refuses_bad_arguments():
    x = cuda.to_device(np.ones((2, 64), np.float32))
    w = cuda.to_device(np.ones(64, np.float32))
    xq, xs = cuda.device_array((2, 64), np.int8), cuda.device_array((2, 8), np.float32)
    with pytest.raises(ValueError, match="shape"):
        post_norm.post_norm_add(x, cuda.to_device(np.ones((2, 63), np.float32)), w, EPS)
    with pytest.raises(ValueError, match="together"):
        post_norm.post_norm_add(x, x, w, EPS, w_next=w)
    with pytest.raises(ValueError, match="multiple of 32"):
        post_norm.post_norm_add_q8(cuda.to_device(np.ones((2, 48), np.float32)),
                                   cuda.to_device(np.ones((2, 48), np.float32)),
                                   cuda.to_device(np.ones(48, np.float32)), cuda.to_device(np.ones(48, np.float32)),
                                   cuda.device_array((2, 48), np.int8), cuda.device_array((2, 6), np.float32), EPS)
    with pytest.raises(ValueError, match="block"):
        post_norm.post_norm_add_q8(x, x, w, w, xq, xs, EPS, block=48)
    with pytest.raises(ValueError, match="float32\\[64\\]"):
        post_norm.post_norm_add_q8(x, x, w, cuda.to_device(np.ones(32, np.float32)), xq, xs, EPS)


# ---- PTX --------------------------------------------------------------------------
PTX_SOURCE = f"""
from genie_rt.engine.norm import {', '.join(norm.KERNEL_SIGNATURES)}
from genie_rt.quant.gemv_kernels import quantize_q8_kernel
"""


@pytest.fixture(scope="module")
def ptx():
    """{(kernel, signature index): {cc: ptx}} (one subprocess per signature set), plus
    ("quantize_q8_kernel", 0) to compare rmsnorm_q8's rounding with."""
    out = {}
    for j in range(max(len(v) for v in norm.KERNEL_SIGNATURES.values())):
        kernels = {k: v[j] for k, v in norm.KERNEL_SIGNATURES.items() if j < len(v)}
        if j == 0:
            kernels["quantize_q8_kernel"] = gemv.SIG_QUANTIZE
            kernels.update(_POST_KERNELS)           # engine/post_norm.py, same subprocess
        got = compile_in_subprocess(PTX_SOURCE + _POST_SOURCE, kernels)
        out.update({(k, j): v for k, v in got.items()})
    return out


def test_kernels_compile_without_f64(ptx):
    for (name, j), per in ptx.items():
        assert set(per) == {(8, 7), (9, 0)}
        for cc, text in per.items():
            assert_no_f64(text, where=f"{name}[{j}] sm_{cc[0]}{cc[1]}")
    assert "cvt.rn.f16.f32" in ptx[("_rmsnorm_kernel", 1)][(9, 0)]
    assert "sqrt.rn.f32" in ptx[("_rmsnorm_kernel", 0)][(9, 0)]


def test_decode_norms_keep_their_values_in_registers(ptx):
    # the resident kernels' point: a value picked by a run-time index (the block's jb) once put
    # the array in local memory (2026-12-03 review), a round trip in a latency-bound kernel
    from ptx_helpers import local_memory_bytes
    for name in ("_rmsnorm_q8_r4_kernel", "_rmsnorm_q8_h_r4_kernel"):
        for cc, text in ptx[(name, 0)].items():
            assert local_memory_bytes(text) == 0, f"{name} sm_{cc[0]}{cc[1]}: local memory used"


# quantize_q8's rounding as NVVM emits it: v * inv + RINT contracted into one fma (one
# rounding), then - RINT, then the conversion. rmsnorm_q8 is bit-identical to rmsnorm +
# quantize_q8 only if it rounds the same way.
_Q8_ROUND = re.compile(r"fma\.rn\.f32\s+%f\d+, %f\d+, %f\d+, 0f4B400000;\s*"
                       r"add\.f32\s+%f\d+, %f\d+, 0fCB400000;\s*cvt\.rzi\.s32\.f32")


def test_rmsnorm_q8_rounds_like_quantize_q8(ptx):
    for name in ("quantize_q8_kernel", "_rmsnorm_q8_kernel", "_rmsnorm_q8_h_kernel",
                 "_rmsnorm_q8_r4_kernel", "_rmsnorm_q8_h_r4_kernel"):
        for cc, text in ptx[(name, 0)].items():
            assert _Q8_ROUND.search(text), f"{name} sm_{cc[0]}{cc[1]}: no fma -> add -> cvt.rzi rounding"
            assert "sqrt.rn.f32" in text or name == "quantize_q8_kernel"
            assert "div.rn.f32" in text


_POST_SOURCE = """
from genie_rt.engine.post_norm import _post_norm_add_kernel, _post_norm_add_norm_kernel, _post_norm_add_q8_kernel
q8_loop = _post_norm_add_q8_kernel(False, 0)
q8_h_loop = _post_norm_add_q8_kernel(True, 0)
q8_r4 = _post_norm_add_q8_kernel(False, 4)
q8_h_r4 = _post_norm_add_q8_kernel(True, 4)
"""


_POST_KERNELS = dict({"_post_norm_add_kernel": post_norm._SIG_ADD,
                      "_post_norm_add_norm_kernel": post_norm._SIG_NORM.format("float16")},
                     **{name: post_norm._SIG_Q8 for name in ("q8_loop", "q8_h_loop", "q8_r4", "q8_h_r4")})


@pytest.fixture(scope="module")
def post_ptx(ptx):
    """The post-norm kernels' PTX (compiled with the first signature set of `ptx`)."""
    return {name: ptx[(name, 0)] for name in _POST_KERNELS}


def test_post_norm_kernels_compile_and_round_like_the_unfused_launches(post_ptx):
    for name, per in post_ptx.items():
        assert set(per) == {(8, 7), (9, 0)}
        for cc, text in per.items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_no_f64(text, where=where)
            # y / s * w_post rounded before the add (never an FMA with it)
            assert "mul.rn.f32" in text and "div.rn.f32" in text and "sqrt.rn.f32" in text, where
            if name.startswith("q8"):
                assert _Q8_ROUND.search(text), f"{where}: no fma -> add -> cvt.rzi rounding"
    assert "cvt.rn.f16.f32" in post_ptx["_post_norm_add_norm_kernel"][(9, 0)]


# ---- GPU at real shapes ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33, 512])
def test_gpu_real_shapes(n):
    norm.compile_kernels()
    rng = np.random.default_rng(n)
    d, n_ff = 2560, 9728
    x_h = rng.standard_normal((n, d)).astype(np.float32)
    dl_h = rng.standard_normal((n, d)).astype(np.float32)
    w_h = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    x, dl, w = cuda.to_device(x_h), cuda.to_device(dl_h), cuda.to_device(w_h)
    out = cuda.device_array((n, d), np.float32)
    norm.rmsnorm(x, w, out, EPS)
    assert_close(out.copy_to_host(), norm.rmsnorm_reference(x_h, w_h, EPS), 1e-5, "rmsnorm")
    norm.add_rmsnorm(x, dl, w, out, EPS)
    assert_close(out.copy_to_host(), norm.rmsnorm_reference(x_h + dl_h, w_h, EPS), 1e-5, "add_rmsnorm")
    np.testing.assert_array_equal(x.copy_to_host(), x_h + dl_h)
    gu_h = rng.standard_normal((n, 2 * n_ff)).astype(np.float32)
    h = cuda.device_array((n, n_ff), np.float32)
    norm.swiglu_fused(cuda.to_device(gu_h), h)
    np.testing.assert_allclose(h.copy_to_host(), norm.swiglu_reference(gu_h[:, :n_ff], gu_h[:, n_ff:]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 8])
def test_gpu_rmsnorm_q8_bit_identical_at_d2560(n):
    """The fused kernel against the two launches it replaces, compiled for the real GPU
    (where the FMA contraction matters), at Qwen3-4B's width."""
    norm.compile_kernels()
    rng = np.random.default_rng(100 + n)
    d = 2560
    x_h = _q8_rows(rng, n, d)
    w_h = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    x, w = cuda.to_device(x_h), cuda.to_device(w_h)
    h_ref, xq_ref, xs_ref = _two_launches(x, w, None)
    for with_h in (False, True):
        xq = cuda.to_device(np.full((n, d), 77, np.int8))
        xs = cuda.to_device(np.full((n, d // 8), np.nan, np.float32))
        out = cuda.to_device(np.full((n, d), np.nan, np.float32)) if with_h else None
        norm.rmsnorm_q8(x, w, xq, xs, EPS, out=out)
        cuda.synchronize()
        _assert_bits_equal(xq.copy_to_host(), xq_ref, f"xq (with_h={with_h})")
        _assert_bits_equal(xs.copy_to_host(), xs_ref, f"xs (with_h={with_h})")
        if with_h:
            _assert_bits_equal(out.copy_to_host(), h_ref, "h")
    _assert_bits_equal(x.copy_to_host(), x_h, "x")
    h_np, xq_np, xs_np = norm.rmsnorm_q8_reference(x_h, w_h, EPS)
    assert_close(h_ref, h_np, 1e-5, "rmsnorm_q8 h")
    assert np.max(np.abs(xq_ref.astype(np.int32) - xq_np)) <= 1      # h within an ulp: q within 1
    np.testing.assert_allclose(xs_ref[:, ::4], xs_np[:, ::4], rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 512])
def test_gpu_post_norm_gemma3_270m_bit_identical(n):
    """Gemma 3 270M's width (d = 640): post_norm_add and post_norm_add_q8 against the
    unfused launches, compiled for the real GPU (where an FMA would change the last bit)."""
    norm.compile_kernels()
    post_norm.compile_kernels(640)
    d = 640
    x_h, y_h, wp, wn = _post_case(n, d, 900 + n)
    y_h *= 50                                   # block outputs are larger than the stream
    x_ref, h_ref = _unfused_post(x_h, y_h, wp, wn, None)
    for out_dtype in (np.float32, np.float16):
        x = cuda.to_device(x_h)
        out = cuda.device_array((n, d), out_dtype)
        post_norm.post_norm_add(x, cuda.to_device(y_h), cuda.to_device(wp), EPS,
                                w_next=cuda.to_device(wn), out=out)
        _assert_bits_equal(x.copy_to_host(), x_ref, "x")
        if out_dtype == np.float32:
            _assert_bits_equal(out.copy_to_host(), h_ref, "h")
    _, xq_ref, xs_ref = _two_launches(cuda.to_device(x_ref), cuda.to_device(wn), None)
    for with_h in (False, True):
        x = cuda.to_device(x_h)
        xq = cuda.device_array((n, d), np.int8)
        xs = cuda.device_array((n, d // 8), np.float32)
        out = cuda.device_array((n, d), np.float32) if with_h else None
        post_norm.post_norm_add_q8(x, cuda.to_device(y_h), cuda.to_device(wp), cuda.to_device(wn),
                                   xq, xs, EPS, out=out)
        cuda.synchronize()
        _assert_bits_equal(x.copy_to_host(), x_ref, f"x (with_h={with_h})")
        _assert_bits_equal(xq.copy_to_host(), xq_ref, f"xq (with_h={with_h})")
        _assert_bits_equal(xs.copy_to_host(), xs_ref, f"xs (with_h={with_h})")
        if with_h:
            _assert_bits_equal(out.copy_to_host(), h_ref, "h")
    x_np, h_np = post_norm.post_norm_add_reference(x_h, y_h, wp, EPS, wn)
    # x is a residual sum: on the H200 (2026-12-03) one element cancelled to 1.56e-4 with an
    # error of 1.2e-7, the float32 rounding of operands of size ~1-50; h = norm(x) * w carries
    # that element's error along (3.96e-5, relative 7.5e-4 at the same index): both are
    # measured on their rows' scale
    assert_close(x_ref, x_np, 1e-5, "x vs numpy", floor=float(np.abs(x_np).mean()))
    assert_close(h_ref, h_np, 1e-5, "h vs numpy", floor=float(np.abs(h_np).mean()))
    n_ff = 2048
    gu_h = (rng := np.random.default_rng(n)).standard_normal((n, 2 * n_ff)).astype(np.float32) * 3
    h = cuda.device_array((n, n_ff), np.float32)
    norm.geglu_fused(cuda.to_device(gu_h), h)
    # libdevice's tanhf is a few ulp from numpy's: near gelu(g) = 0 the product's error is that
    # of 0.5 * g * u (~1e-6 absolute at |g u| ~ 10, seen on the H200 2026-12-03), so the bound
    # is on the products' scale, not 1e-6 absolute
    ref = norm.geglu_reference(gu_h[:, :n_ff], gu_h[:, n_ff:])
    scale = float(np.abs(gu_h[:, :n_ff] * gu_h[:, n_ff:]).max())
    np.testing.assert_allclose(h.copy_to_host(), ref, rtol=1e-5, atol=1e-7 * scale)
