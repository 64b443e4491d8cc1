"""quant/gemv_mma_qkv.py: q, k and v in one launch, Q4_K and Q6_K mixed (lab), in the simulator.

The same bits as gemv_mma_k on each matrix at the same k-split, each in its columns of one
[n_tok, ldy] output (partial tiles, a wider ldy whose last columns stay untouched), pipelined or
not; what it refuses; the PTX (slow: both builds in one kernel, no local memory).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_mma_k as K
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight
from genie_rt.quant.gemv_mma_qkv import SIGNATURE, gemv_mma_qkv

Q4, Q6 = QType.Q4_K, QType.Q6_K


def _ws(spec, cols, seed):
    return [G.prepare_weight(G.to_device(random_weight(q, r, cols, np.random.default_rng(seed + i))), "dp4a")
            for i, (q, r) in enumerate(spec)]


@pytest.mark.parametrize("pipe,w16,w16q6", [(True, False, False), (False, False, False), (False, True, False),
                                            (False, True, True)])
@pytest.mark.parametrize("spec,cols,n_tok,ksplit,extra", [
    (((Q4, 32), (Q4, 16), (Q6, 16)), 512, 1, 2, 0),
    (((Q4, 21), (Q4, 9), (Q6, 9)), 768, 5, 3, 3),        # partial tiles, a wider output
    (((Q6, 16), (Q4, 20), (Q6, 5)), 256, 8, 1, 0),
    (((Q4, 48), (Q4, 16), (Q4, 16)), 512, 3, None, 1)])
def test_qkv_is_gemv_mma_k_per_matrix(spec, cols, n_tok, ksplit, extra, pipe, w16, w16q6):
    # (w16: the Q4_K matrices by 16-byte loads, w16q6 the Q6_K ones, against gemv_mma_k's 8- and 4-byte
    # builds: the same bits)
    ws = _ws(spec, cols, cols + n_tok)
    x = np.random.default_rng(2).standard_normal((n_tok, cols)).astype(np.float32)
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    total = sum(w.rows for w in ws)
    ldy = total + extra
    y = cuda.to_device(np.full((n_tok, ldy), np.nan, np.float32))
    gemv_mma_qkv(ws, *q, y, n_tok, ldy=ldy, ksplit=ksplit, pipe=pipe, w16=w16, w16q6=w16q6)
    got = y.copy_to_host()
    ks = K.plan_ksplit(total, cols, n_tok) if ksplit is None else ksplit
    c = 0
    for w in ws:
        one = cuda.device_array((n_tok, w.rows), np.float32)
        K.gemv_mma_k(w, *q, one, n_tok, ksplit=ks, pipe=pipe, w16=False)
        np.testing.assert_array_equal(got[:, c:c + w.rows], one.copy_to_host(), err_msg=f"{w.qtype.name} at {c}")
        c += w.rows
    assert np.isnan(got[:, total:]).all()


def test_qkv_refuses_what_it_does_not_do():
    ws = _ws(((Q4, 16), (Q4, 16), (Q6, 16)), 256, 0)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    y = cuda.device_array((1, 48), np.float32)
    with pytest.raises(ValueError, match="three weights"):
        gemv_mma_qkv(ws[:2], *q, y, 1)
    with pytest.raises(ValueError, match="columns differ"):
        gemv_mma_qkv(ws[:2] + _ws(((Q4, 16),), 512, 0), *q, y, 1)
    with pytest.raises(ValueError, match="only Q4_K and Q6_K"):
        gemv_mma_qkv(ws[:2] + _ws(((QType.Q8_0, 16),), 256, 0), *q, y, 1)
    with pytest.raises(ValueError, match="ldy"):
        gemv_mma_qkv(ws, *q, y, 1, ldy=40)
    with pytest.raises(ValueError, match="n_tok"):
        gemv_mma_qkv(ws, *q, y, 9)


@pytest.mark.slow
def test_qkv_ptx_holds_both_builds():
    from ptx_helpers import assert_no_f64, compile_in_subprocess, local_memory_bytes
    src = ("from genie_rt.quant.gemv_mma_qkv import mma_qkv_kernel\n"
           "qkv_mixed = mma_qkv_kernel(('Q4_K', 'Q4_K', 'Q6_K'), 4, True)\n")
    out = compile_in_subprocess(src, {"qkv_mixed": SIGNATURE})
    for cc, text in out["qkv_mixed"].items():
        where = f"qkv sm_{cc[0]}{cc[1]}"
        assert_no_f64(text, where=where)
        assert local_memory_bytes(text) == 0, where
        assert text.count("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32") == 16, where     # q, k: 8 each
        assert text.count("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32") == 16, where     # v
