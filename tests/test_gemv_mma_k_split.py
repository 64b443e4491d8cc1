"""quant/gemv_mma_k_split.py: gemv_mma_k with a tile's k-range over KB thread blocks (lab), in the
simulator: within the dp4a GEMV's error bound of numpy, within float rounding of gemv_mma_k at the
same total warps (the parts are added in another order), the same bits on a second launch, and the
tile counters back at zero after each launch (the next launch's fix-up counts from there)."""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_mma_k as K
from genie_rt.quant import gemv_mma_k_split as S
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight


@pytest.mark.parametrize("rows,cols,n_tok,kb,ksplit,resid,w16", [
    (21, 768, 3, 2, 1, True, True),      # a partial second tile; 3 blocks over 2 one-warp parts
    (16, 1280, 8, 3, 2, False, False),   # 5 blocks over 3 parts of 2 warps: a warp without a block
    (9, 512, 9, 2, 1, True, False)])     # the 16-token build
def test_split_matches_numpy_and_gemv_mma_k(rows, cols, n_tok, kb, ksplit, resid, w16):
    hw = random_weight(QType.Q4_K, rows, cols, np.random.default_rng(rows + cols))
    W = G.dequantize_weight(hw)
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    x = np.random.default_rng(1).standard_normal((n_tok, cols)).astype(np.float32)
    xq, xd, xb = K.quantize_q8k(x)
    q = [cuda.to_device(a) for a in K.tiled(xq, xd, xb)]
    r = np.random.default_rng(7).standard_normal((n_tok, rows)).astype(np.float32)
    part, cnt = S.workspace(rows, kb, 8 if n_tok <= 8 else 16)
    got = []
    for _ in range(2):
        y = cuda.to_device(r) if resid else cuda.device_array((n_tok, rows), np.float32)
        S.gemv_mma_k_split(gw, *q, y, n_tok, part, cnt, kb=kb, residual=y if resid else None, ksplit=ksplit,
                           pipe=False, w16=w16)
        got.append(y.copy_to_host())
        assert not cnt.copy_to_host().any()
    np.testing.assert_array_equal(got[0], got[1])
    xt = K.dequantize_q8k(xq, xd)
    ref = G.gemv_reference(W, xt, r if resid else None)
    assert np.all(np.abs(got[0] - ref) <= G.error_bound(W, xt, "f32"))
    y = cuda.to_device(r) if resid else cuda.device_array((n_tok, rows), np.float32)
    K.gemv_mma_k(gw, *q, y, n_tok, residual=y if resid else None, ksplit=ksplit * kb, pipe=False, w16=w16)
    np.testing.assert_allclose(got[0], y.copy_to_host(), rtol=1e-5, atol=1e-4)


def test_split_refuses_what_it_does_not_do():
    hw = random_weight(QType.Q6_K, 16, 256, np.random.default_rng(0))
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    part, cnt = S.workspace(16, 2)
    with pytest.raises(ValueError, match="Q4_K weights only"):
        S.gemv_mma_k_split(gw, None, None, None, None, 1, part, cnt)
    hw = random_weight(QType.Q4_K, 16, 256, np.random.default_rng(0))
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    with pytest.raises(ValueError, match="kb 1 must be 2..8"):
        S.gemv_mma_k_split(gw, None, None, None, None, 1, part, cnt, kb=1)
    q = [cuda.to_device(a) for a in K.tiled(*K.quantize_q8k(np.ones((1, 256), np.float32)))]
    with pytest.raises(ValueError, match="part"):
        S.gemv_mma_k_split(gw, *q, cuda.device_array((1, 16), np.float32), 1, *S.workspace(16, 2)[:1],
                           cnt, kb=3)
