"""quant/gemv_mma.py: the int8 tensor-core GEMV for 1-8 tokens (lab), in the simulator.

Q4_K weights at tiny shapes (rows not a multiple of the 16-row tile, several 256-weight
blocks, k split over 1-4 warps with uneven ranges), 1, 3 and 8 tokens, with and without the
residual add: within the dp4a GEMV's error bound of numpy (W @ the dequantized q8 x), and
within float rounding of the dp4a GEMV itself (the integer dots are exact in both).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_mma as M
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight


def _case(rows, cols, n_tok, seed):
    hw = random_weight(QType.Q4_K, rows, cols, np.random.default_rng(seed))
    W = G.dequantize_weight(hw)
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    x = np.random.default_rng(seed + 1).standard_normal((n_tok, cols)).astype(np.float32)
    dx = cuda.to_device(x)
    xq = cuda.device_array((n_tok, cols), np.int8)
    xs = cuda.device_array((n_tok, cols // 8), np.float32)
    G.quantize_q8(dx, xq, xs)
    return W, gw, dx, xq, xs


@pytest.mark.parametrize("rows,cols,n_tok,ksplit,resid", [
    (16, 256, 1, 1, False),      # one tile, one block, one token
    (21, 512, 3, 2, True),       # a partial second tile, two blocks over two warps
    (9, 768, 8, 4, False),       # 12 chunks over 4 warps, eight tokens (the whole B fragment)
    (5, 512, 8, 8, True)])       # 8 chunks over 8 warps, rows only in the first half-tile
def test_gemv_mma_matches_numpy_and_the_dp4a_gemv(rows, cols, n_tok, ksplit, resid):
    W, gw, dx, xq, xs = _case(rows, cols, n_tok, rows + cols)
    r = np.random.default_rng(7).standard_normal((n_tok, rows)).astype(np.float32)
    y = cuda.to_device(r) if resid else cuda.device_array((n_tok, rows), np.float32)
    M.gemv_mma(gw, xq, xs, y, n_tok, residual=y if resid else None, ksplit=ksplit)
    got = y.copy_to_host()
    xt = G.dequantize_q8(xq.copy_to_host(), xs.copy_to_host())
    ref = G.gemv_reference(W, xt, r if resid else None)
    bound = G.error_bound(W, xt, "f32")
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) / bound))
    y2 = cuda.to_device(r) if resid else cuda.device_array((n_tok, rows), np.float32)
    G.gemv(gw, dx, y2, xq=xq, xs=xs, residual=y2 if resid else None)
    np.testing.assert_allclose(got, y2.copy_to_host(), rtol=1e-5, atol=1e-4 * float(np.abs(ref).max()))


def test_gemv_mma_refuses_what_it_does_not_do():
    W, gw, dx, xq, xs = _case(16, 256, 1, 0)
    y = cuda.device_array((1, 16), np.float32)
    with pytest.raises(ValueError, match="n_tok"):
        M.gemv_mma(gw, xq, xs, y, 9)
    with pytest.raises(ValueError, match="ksplit"):
        M.gemv_mma(gw, xq, xs, y, 1, ksplit=3)
    with pytest.raises(ValueError, match="xs must be float32"):
        M.gemv_mma(gw, xq, xq, y, 1)
    hw6 = random_weight(QType.Q6_K, 16, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="only Q4_K"):
        M.gemv_mma(G.prepare_weight(G.to_device(hw6), "dp4a"), xq, xs, y, 1)


def check_mma_gemv_ptx(src, name, signature, what):
    """Compile kernel `name` of `src` for sm_87 and sm_90 and check what both mma GEMVs promise:
    the s8 mma, no f64, no local memory, a trip's loads all before its first mma; {cc: PTX}."""
    from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess, local_memory_bytes
    out = compile_in_subprocess(src, {name: signature})[name]
    for cc, text in out.items():
        where = f"{what} sm_{cc[0]}{cc[1]}"
        assert_no_f64(text, where=where)
        assert local_memory_bytes(text) == 0, f"{where}: local memory used"
        assert_ptx_contains(text, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "ld.global.nc.v4.u32",
                            where=where)
        first, last = text.index("mma.sync"), text.rindex("mma.sync")
        assert text[first:last].count("ld.global") == 0, f"{where}: a load between the trip's mmas"
    return out


@pytest.mark.slow
def test_gemv_mma_ptx_uses_the_int8_tensor_cores_without_local_memory():
    check_mma_gemv_ptx("from genie_rt.quant.gemv_mma import mma_q4k_kernel\nmma_ks8 = mma_q4k_kernel(8)\n",
                       "mma_ks8", M.SIGNATURE, "gemv_mma")
