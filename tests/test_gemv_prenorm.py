"""The SwiGLU GEMV with its RMSNorm folded into the prologue (quant/gemv_prenorm.py) against the two
launches it replaces - rmsnorm_q8, then gemv_swiglu - under the simulator: the same bits, for the
plain and the PDL build (griddepcontrol a no-op here, pdl.launch the plain launch), on rows that
leave the last block's warps idle, a row longer than a trip, and both activations."""
import numpy as np
import pytest
from numba import cuda

from genie_rt.engine import norm
from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_prenorm as P
from test_gemv import Q4, Q6, plain_launch, weight  # noqa: F401 (plain_launch: a fixture)


def _two_launches(wg, wu, dx, dw, eps, rows, cols, act):
    xq = cuda.device_array((1, cols), np.int8)
    xs = cuda.device_array((1, cols // 8), np.float32)
    norm.rmsnorm_q8(dx, dw, xq, xs, eps)
    h = cuda.device_array((1, rows), np.float32)
    G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, act=act)
    return h.copy_to_host()


@pytest.mark.parametrize("qt, rows, cols, act", [(Q4, 9, 512, "silu"), (Q6, 6, 768, "silu"),
                                                 pytest.param(Q4, 41, 3328, "gelu", marks=pytest.mark.slow)])
def test_folded_norm_gives_the_two_launches_bits(monkeypatch, plain_launch, qt, rows, cols, act):
    """3,328 columns: 104 Q4_K units a row, more than one trip of 96; 9 and 41 rows: the last block
    has one row (its spare warps load the last row again and write nothing)."""
    _, wg = weight(qt, "dp4a", rows, cols, seed=3)
    _, wu = weight(qt, "dp4a", rows, cols, seed=4)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((1, cols)) * 3).astype(np.float32)
    w = (rng.standard_normal(cols) * 0.5 + 1).astype(np.float32)
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    eps = 1e-6
    monkeypatch.setattr(G, "PDL", False)
    ref = _two_launches(wg, wu, dx, dw, eps, rows, cols, act)
    for use in (False, True):
        h = cuda.to_device(np.full((1, rows), np.nan, np.float32))
        P.gemv_swiglu_prenorm(wg, wu, dx, dw, eps, h, act=act, pdl=use)
        np.testing.assert_array_equal(h.copy_to_host(), ref, err_msg=f"pdl={use}")


def test_refuses_what_it_does_not_cover():
    _, wg = weight(Q4, "dp4a", 4, 256, seed=1)
    _, wu = weight(Q6, "dp4a", 4, 256, seed=2)
    dx = cuda.to_device(np.ones((1, 256), np.float32))
    dw = cuda.to_device(np.ones(256, np.float32))
    h = cuda.device_array((1, 4), np.float32)
    if not G.K.pairable(wg.spec, wu.spec, 1):
        with pytest.raises(ValueError, match="not covered"):
            P.gemv_swiglu_prenorm(wg, wu, dx, dw, 1e-6, h)
    _, wg8 = weight(Q4, "dp4a", 4, 512, seed=1)
    with pytest.raises(ValueError, match="differ"):
        P.gemv_swiglu_prenorm(wg8, wu, dx, dw, 1e-6, h)
    with pytest.raises(ValueError, match="x must be"):
        P.gemv_swiglu_prenorm(wg, wg, cuda.to_device(np.ones((1, 128), np.float32)), dw, 1e-6, h)
