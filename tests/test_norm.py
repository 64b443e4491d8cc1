"""RMSNorm, fused residual + RMSNorm and SwiGLU kernels (engine/norm.py) against the
numpy reference (engine/qwen3.py's rmsnorm / silu): simulator at awkward small shapes,
PTX for sm_87 / sm_90 without float64, GPU at the real shapes (-m gpu)."""
import sys
import threading

import numpy as np
import pytest
from numba import cuda

from genie_rt.engine import norm
from genie_rt.engine.qwen3 import rmsnorm as qwen3_rmsnorm
from genie_rt.engine.qwen3 import silu as qwen3_silu
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


def assert_close(got, ref, rtol, what):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    err = np.abs(got - ref) / (np.abs(ref) + 1e-6)
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


def test_block_size_choice():
    assert norm.norm_block(2560) == 640
    assert norm.norm_block(128) == 32
    assert norm.norm_block(1 << 20) == 1024


# ---- PTX --------------------------------------------------------------------------
PTX_SOURCE = f"""
from genie_rt.engine.norm import {', '.join(norm.KERNEL_SIGNATURES)}
"""


@pytest.fixture(scope="module")
def ptx():
    """{(kernel, output dtype index): {cc: ptx}} (one subprocess per signature set)."""
    out = {}
    for j in range(2):
        got = compile_in_subprocess(PTX_SOURCE, {k: v[j] for k, v in norm.KERNEL_SIGNATURES.items()})
        out.update({(k, j): v for k, v in got.items()})
    return out


def test_kernels_compile_without_f64(ptx):
    for (name, j), per in ptx.items():
        assert set(per) == {(8, 7), (9, 0)}
        for cc, text in per.items():
            assert_no_f64(text, where=f"{name}[{j}] sm_{cc[0]}{cc[1]}")
    assert "cvt.rn.f16.f32" in ptx[("_rmsnorm_kernel", 1)][(9, 0)]
    assert "sqrt.rn.f32" in ptx[("_rmsnorm_kernel", 0)][(9, 0)]


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
