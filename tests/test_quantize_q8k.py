"""quant/quantize_q8k.py: RMSNorm -> q8_K on the device, in the simulator, against numpy.

Without the norm the device's q8_K is the numpy reference's bit for bit (the same IEEE float32
operations); with it, h = rmsnorm(x) * w differs from numpy's only by the order of the sum of
squares, so a quant may move by one where h sits on a rounding boundary. Awkward rows: blocks
more than the 8 warps (a warp takes two), an all-zero block, one large value in a block, a
fully zero row with the norm's eps. A row is split over thread blocks of 8 warps (a warp a block):
2,560 values are two thread blocks, the second with two busy warps; 4,608 are three.
"""
import re

import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv_mma_k as K
from genie_rt.quant.q8k_layout import sizes, tiled, untiled, xq_size
from genie_rt.quant.quantize_q8k import rmsnorm_q8k


def _rows(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    x[0, 256:512] = 0                                # an all-zero block
    x[-1, 7] = 40.0                                  # one value far above its block
    return x


SENTINEL = 99


def _run(x, w, eps=1e-6, flat=False):
    """(xq [n, d] untiled, xd, xb); flat: xq as the device holds it (quant/q8k_layout.py), its
    padding rows' bytes left as SENTINEL where the kernel wrote nothing."""
    n, d = x.shape
    xq = cuda.to_device(np.full(xq_size(n, d), SENTINEL, np.int8))
    _, nd, nb = sizes(n, d)
    xd = cuda.to_device(np.full(nd, SENTINEL, np.float32))
    xb = cuda.to_device(np.full(nb, SENTINEL, np.int32))
    rmsnorm_q8k(cuda.to_device(x), None if w is None else cuda.to_device(w), eps, xq, xd, xb)
    got = xq.copy_to_host(), xd.copy_to_host(), xb.copy_to_host()
    return got if flat else untiled(*got, n, d)


@pytest.mark.parametrize("n,d", [(1, 256), (3, 2560), (2, 4608), (9, 512)])   # 4608: 18 blocks, 3 thread
def test_q8k_without_the_norm_is_the_reference_bit_for_bit(n, d):            # blocks; 9: two token groups
    x = _rows(n, d, d)
    got = _run(x, None, flat=True)
    # xq, xd, xb tiled element for element (a row-major one fails here), the padding rows untouched
    ref = K.quantize_q8k(x)
    for what, g, want, real in zip(("xq", "xd", "xb"), got, tiled(*ref), tiled(*(np.ones_like(a) for a in ref))):
        np.testing.assert_array_equal(g[real == 1], want[real == 1], err_msg=what)
        assert (g[real == 0] == SENTINEL).all(), what


@pytest.mark.parametrize("n,d", [(2, 512), (5, 2560), (2, 4608)])
def test_rmsnorm_q8k_matches_numpy(n, d):
    x = _rows(n, d, 3 * d)
    w = (1 + 0.1 * np.random.default_rng(1).standard_normal(d)).astype(np.float32)
    eps = 1e-6
    h = (x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps) * w).astype(np.float32)
    rq, rd, rb = K.quantize_q8k(h)
    xq, xd, xb = _run(x, w, eps)
    np.testing.assert_allclose(xd, rd, rtol=2e-6)
    diff = np.abs(xq.astype(np.int32) - rq)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    # (xd against numpy's in every block, above, fails if a thread block of a row divides by the
    # rms of its own part: every block of 4608 and 2560 values has 1-2 thread blocks beside it)
    # the sums are of the device's own quants, exactly
    np.testing.assert_array_equal(xb, xq.reshape(n, d // 32, 32).astype(np.int32).sum(axis=2))
    assert not xq[0, 256:512].any() and xd[0, 1] == 0
    # and the GEMV's input: the dequantized values are h within half a step
    back = K.dequantize_q8k(xq, xd)
    assert np.all(np.abs(back - h) <= np.repeat(xd, 256, axis=1) * 0.5 + 1e-6 * np.abs(h) + 1e-7)


def test_rmsnorm_q8k_of_a_zero_row_is_zero():
    x = np.zeros((1, 512), np.float32)
    xq, xd, xb = _run(x, np.ones(512, np.float32))
    assert not xq.any() and not xd.any() and not xb.any()


def test_rmsnorm_q8k_refuses_bad_shapes():
    wide = cuda.to_device(np.zeros((2, 512), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm_q8k(wide[:, :256], None, 1e-6, cuda.device_array((8, 256), np.int8), cuda.device_array(8, np.float32),
                    cuda.device_array(64, np.int32))
    x = cuda.to_device(np.zeros((2, 300), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        rmsnorm_q8k(x, None, 1e-6, cuda.device_array((8, 300), np.int8), cuda.device_array(8, np.float32),
                    cuda.device_array(18, np.int32))
    x = cuda.to_device(np.zeros((2, 256), np.float32))
    with pytest.raises(ValueError, match="xb must be int32"):
        rmsnorm_q8k(x, None, 1e-6, cuda.device_array((8, 256), np.int8), cuda.device_array(8, np.float32),
                    cuda.device_array(64, np.float32))
    with pytest.raises(ValueError, match="w must be float32 with 256"):
        rmsnorm_q8k(x, cuda.to_device(np.ones(128, np.float32)), 1e-6, cuda.device_array((8, 256), np.int8),
                    cuda.device_array(8, np.float32), cuda.device_array(64, np.int32))
    with pytest.raises(ValueError, match="xq must be int8 with 2048"):      # a row-major size: not the tiled
        rmsnorm_q8k(x, None, 1e-6, cuda.device_array((2, 256), np.int8), cuda.device_array(8, np.float32),
                    cuda.device_array(64, np.int32))


@pytest.mark.slow
def test_rmsnorm_q8k_ptx_has_no_f64_and_no_local_memory():
    # sm_87 and sm_90, both builds: the 8 values a lane stay in registers (ptxas, 2026-12-05: 40-44
    # registers), and no float64 (a Python float in the arithmetic would bring it)
    from ptx_helpers import assert_no_f64, compile_in_subprocess, local_memory_bytes
    from genie_rt.quant.quantize_q8k import SIGNATURE
    out = compile_in_subprocess("from genie_rt.quant.quantize_q8k import rmsnorm_q8k_kernel\n"
                                "q8k_norm = rmsnorm_q8k_kernel(True)\nq8k_plain = rmsnorm_q8k_kernel(False)\n",
                                {"q8k_norm": SIGNATURE, "q8k_plain": SIGNATURE})
    for name, per_cc in out.items():
        for cc, text in per_cc.items():
            assert_no_f64(text, where=f"{name} sm_{cc[0]}{cc[1]}")
            assert local_memory_bytes(text) == 0, f"{name} sm_{cc[0]}{cc[1]}: local memory"
            # v * inv rounded on its own (mul.rn), not contracted with the + 1.5 * 2^23 into an FMA:
            # the reference rounds the float32 product
            assert "mul.rn.f32" in text and not re.search(r"fma\.rn\.f32[^;]*0f4B400000", text), \
                f"{name} sm_{cc[0]}{cc[1]}: the rounding's product contracted into an FMA"
