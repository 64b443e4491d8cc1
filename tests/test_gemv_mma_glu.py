"""quant/gemv_mma_glu.py: gate, up and the activation in one launch (lab), in the simulator.

The same bits as gemv_mma_k on each weight (the same k-split) then engine/norm.py's swiglu /
geglu, at tiny shapes (a partial tile, uneven k-splits, 1-8 tokens, pipelined or not); within
numpy's bound of act(x Wg^T) * (x Wu^T); what it refuses; the PTX (slow).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.engine import norm
from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_mma_k as K
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight
from genie_rt.quant.gemv_mma_glu import SIGNATURE, gemv_mma_glu


def _weights(rows, cols, seed, qtype=QType.Q4_K):
    hw = [random_weight(qtype, rows, cols, np.random.default_rng(seed + i)) for i in range(2)]
    return hw, [G.prepare_weight(G.to_device(h), "dp4a") for h in hw]


@pytest.mark.parametrize("pipe,w16", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("rows,cols,n_tok,ksplit,act", [
    (16, 256, 1, 1, "silu"), (21, 768, 5, 2, "silu"), (9, 1280, 8, 3, "gelu"), (40, 512, 3, None, "silu")])
def test_glu_is_gemv_mma_k_twice_then_the_activation(rows, cols, n_tok, ksplit, act, pipe, w16):
    # (w16: both weights by 16-byte loads, against gemv_mma_k's 8-byte build: the same bits)
    hw, (wg, wu) = _weights(rows, cols, rows + cols)
    x = np.random.default_rng(4).standard_normal((n_tok, cols)).astype(np.float32)
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    y = cuda.device_array((n_tok, rows), np.float32)
    gemv_mma_glu(wg, wu, *q, y, n_tok, act=act, ksplit=ksplit, pipe=pipe, w16=w16)
    ks = K.plan_ksplit(rows, cols, n_tok) if ksplit is None else ksplit
    g, u, want = (cuda.device_array((n_tok, rows), np.float32) for _ in range(3))
    K.gemv_mma_k(wg, *q, g, n_tok, ksplit=ks, pipe=pipe, w16=False)
    K.gemv_mma_k(wu, *q, u, n_tok, ksplit=ks, pipe=pipe, w16=False)
    (norm.swiglu if act == "silu" else norm.geglu)(g, u, want)
    np.testing.assert_array_equal(y.copy_to_host(), want.copy_to_host())
    # and numpy's: act of the float products within their bound
    xt = K.dequantize_q8k(*K.untiled(*(a.copy_to_host() for a in q), n_tok, cols)[:2])
    Wg, Wu = (G.dequantize_weight(h) for h in hw)
    rg, ru = G.gemv_reference(Wg, xt), G.gemv_reference(Wu, xt)
    ref = norm.swiglu_reference(rg, ru) if act == "silu" else norm.geglu_reference(rg, ru)
    bound = 2 * (G.error_bound(Wg, xt, "f32") * np.abs(ru) + G.error_bound(Wu, xt, "f32") * np.abs(rg)) + 1e-6
    assert np.all(np.abs(y.copy_to_host() - ref) <= bound)


def test_glu_refuses_what_it_does_not_do():
    _, (wg, wu) = _weights(16, 256, 0)
    _, (w6, _) = _weights(16, 256, 0, QType.Q6_K)
    _, (wl, _) = _weights(32, 256, 0)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    y = cuda.device_array((1, 16), np.float32)
    with pytest.raises(ValueError, match="only Q4_K"):
        gemv_mma_glu(w6, wu, *q, y, 1)
    with pytest.raises(ValueError, match="differ"):
        gemv_mma_glu(wl, wu, *q, y, 1)
    with pytest.raises(ValueError, match="n_tok"):
        gemv_mma_glu(wg, wu, *q, y, 9)
    with pytest.raises(ValueError, match="act"):
        gemv_mma_glu(wg, wu, *q, y, 1, act="relu")


@pytest.mark.slow
def test_glu_ptx_two_weights_one_token_load():
    # sm_87 / sm_90, pipelined and not: 16 s8 mma a block (8 a weight), no local memory, no f64,
    # no load between a block's first and last mma, 32-bit sums
    from ptx_helpers import assert_no_f64, compile_in_subprocess, local_memory_bytes
    src = ("from genie_rt.quant.gemv_mma_glu import mma_glu_q4k_q8k_kernel\n"
           "glu_pipe = mma_glu_q4k_q8k_kernel(2, True)\nglu_block = mma_glu_q4k_q8k_kernel(2, False, 'gelu')\n")
    out = compile_in_subprocess(src, {"glu_pipe": SIGNATURE, "glu_block": SIGNATURE})
    for name, per_cc in out.items():
        for cc, text in per_cc.items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_no_f64(text, where=where)
            assert local_memory_bytes(text) == 0, where
            loop = text[text.index("mma.sync"):text.rindex("mma.sync")]
            assert loop.count("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32") == 15, where
            assert loop.count("ld.global") == 0 and "mul.wide" not in loop and "shr.s64" not in loop, where
