"""gemv_swiglu's q8 output (quant/gemv_kernels.swiglu_kernel Q8, EngineConfig.decode_swiglu_q8): h's q8
blocks written by the SwiGLU launch itself - each 32-row group's last block quantizes it - against
quantize_q8 on the plain launch's h, under the simulator: the same bits for h, hq and hs, at 1, 2, 4
and 8 rows a block (k-splits of 2 and 4, 16 lanes a row), with the PDL build, twice in a row (the
counters are zero again after a launch), and the refusals."""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from test_gemv import Q4, Q6, activations, plain_launch, weight  # noqa: F401 (plain_launch: a fixture)


@pytest.mark.parametrize("qt, rows, cols, ksplit, lpr, pdl", [
    (Q4, 96, 256, 1, 32, False),        # 4 rows a block: 3 groups of 8 blocks
    (Q6, 64, 512, 2, 32, True),         # 2 rows a block, the PDL build (paired rows)
    (Q4, 32, 512, 4, 32, False),        # 1 row a block: 32 blocks, one group
    (Q4, 64, 256, 1, 16, True),         # 8 rows a block
])
def test_swiglu_writes_its_q8_as_quantize_q8(monkeypatch, plain_launch, qt, rows, cols, ksplit, lpr, pdl):
    _, wg = weight(qt, "dp4a", rows, cols, seed=11)
    _, wu = weight(qt, "dp4a", rows, cols, seed=12)
    _, dx, xq, xs = activations(1, cols, seed=13)
    h_ref = cuda.device_array((1, rows), np.float32)
    G.gemv_swiglu(wg, wu, dx, h_ref, xq=xq, xs=xs, ksplit=ksplit, lpr=lpr, pdl=pdl)
    hq_ref = cuda.device_array((1, rows), np.int8)
    hs_ref = cuda.device_array((1, rows // 8), np.float32)
    G.quantize_q8(h_ref, hq_ref, hs_ref)
    counter = cuda.to_device(np.zeros(rows // 32 + 1, np.int32))
    for _ in range(2):                  # the second launch sees the counters the first left
        h = cuda.to_device(np.full((1, rows), np.nan, np.float32))
        hq = cuda.to_device(np.full((1, rows), 99, np.int8))
        hs = cuda.to_device(np.full((1, rows // 8), np.nan, np.float32))
        G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, ksplit=ksplit, lpr=lpr, pdl=pdl, q8=(hq, hs, counter))
        np.testing.assert_array_equal(h.copy_to_host(), h_ref.copy_to_host())
        np.testing.assert_array_equal(hq.copy_to_host(), hq_ref.copy_to_host())
        np.testing.assert_array_equal(hs.copy_to_host(), hs_ref.copy_to_host())
        assert not counter.copy_to_host().any()


def test_swiglu_q8_refuses_what_it_cannot_write():
    _, wg = weight(Q4, "dp4a", 40, 256, seed=1)
    _, dx, xq, xs = activations(1, 256)
    h = cuda.device_array((1, 40), np.float32)
    q8 = (cuda.device_array((1, 40), np.int8), cuda.device_array((1, 5), np.float32),
          cuda.to_device(np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="rows % 32"):
        G.gemv_swiglu(wg, wg, dx, h, xq=xq, xs=xs, q8=q8)
    _, wg = weight(Q4, "dp4a", 64, 256, seed=1)
    h = cuda.device_array((1, 64), np.float32)
    q8 = (cuda.device_array((1, 64), np.int8), cuda.device_array((1, 8), np.float32),
          cuda.to_device(np.zeros(1, np.int32)))
    with pytest.raises(ValueError, match="counter"):
        G.gemv_swiglu(wg, wg, dx, h, xq=xq, xs=xs, q8=q8)
