"""quant/ffn_fused.py: the FFN half of a decode layer in one persistent launch, in the simulator.

The launch must give the bits of the launches it replaces, in order: gemv (attn_output,
residual), rmsnorm_q8 (ffn_norm), gemv_swiglu, quantize_q8, gemv (ffn_down, residual) and,
with a next norm, rmsnorm_q8 again. The simulator runs one block (its blocks run one after
another, so a grid barrier could not open with two): all rows go through that block's four
warps, each warp several rows, which is the row loop every block runs on a GPU. The GPU test
(tests/test_decode_switches.py, marked gpu) runs it at the 4B's shapes on a full grid.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.engine import norm as N
from genie_rt.quant import ffn_fused as F
from genie_rt.quant import gemv as G
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight


def _w(q, rows, cols, seed, mode="dp4a"):
    return G.prepare_weight(G.to_device(random_weight(q, rows, cols, np.random.default_rng(seed))), mode)


def _zeros(shape, dt):
    return cuda.to_device(np.zeros(shape, dt))


@pytest.mark.parametrize("D,nff,acols,qd,act,nxt", [
    (256, 256, 512, QType.Q6_K, "silu", True),     # Q4_K o/gate/up, Q6_K down (a Q4_K_M layer)
    pytest.param(256, 512, 256, QType.Q4_K, "gelu", False,       # GeGLU, no next norm
                 marks=pytest.mark.slow)])
def test_one_launch_gives_the_separate_kernels_bits(D, nff, acols, qd, act, nxt):
    rng = np.random.default_rng(D + nff + acols)
    wo = _w(QType.Q4_K, D, acols, 1)
    wg = _w(QType.Q4_K, nff, D, 2)
    wu = _w(QType.Q4_K, nff, D, 3)
    wd = _w(qd, D, nff, 4)
    eps = 1e-6
    attn = cuda.to_device(rng.standard_normal((1, acols)).astype(np.float32))
    aq, as_ = _zeros((1, acols), np.int8), _zeros((1, acols // 8), np.float32)
    G.quantize_q8(attn, aq, as_)
    x0 = (rng.standard_normal((1, D)) * 4).astype(np.float32)
    fw = cuda.to_device((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    nw = cuda.to_device((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))

    # the separate launches
    x = cuda.to_device(x0)
    h = _zeros((1, D), np.float32)
    hq, hs = _zeros((1, D), np.int8), _zeros((1, D // 8), np.float32)
    f = _zeros((1, nff), np.float32)
    fq, fs = _zeros((1, nff), np.int8), _zeros((1, nff // 8), np.float32)
    G.gemv(wo, attn, x, xq=aq, xs=as_, residual=x)
    N.rmsnorm_q8(x, fw, hq, hs, eps, out=h)
    kw = {} if act == "silu" else {"act": act}
    G.gemv_swiglu(wg, wu, h, f, xq=hq, xs=hs, **kw)
    G.quantize_q8(f, fq, fs)
    G.gemv(wd, f, x, xq=fq, xs=fs, residual=x)
    if nxt:
        N.rmsnorm_q8(x, nw, hq, hs, eps)
    want = [a.copy_to_host() for a in (x, f, fq, fs, hq, hs)]

    # one launch
    x2 = cuda.to_device(x0)
    hq2, hs2 = _zeros((1, D), np.int8), _zeros((1, D // 8), np.float32)
    f2 = _zeros((1, nff), np.float32)
    fq2, fs2 = _zeros((1, nff), np.int8), _zeros((1, nff // 8), np.float32)
    ctr = _zeros(F.N_COUNTERS, np.int32)
    F.ffn_fused(wo, wg, wu, wd, aq, as_, x2, fw, eps, hq2, hs2, f2, fq2, fs2, ctr,
                next_norm=nw if nxt else None, act=act)
    got = [a.copy_to_host() for a in (x2, f2, fq2, fs2, hq2, hs2)]
    for name, g, w in zip(("x", "f", "fq", "fs", "hq", "hs"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert not F.failed(ctr)
    assert not ctr.copy_to_host().any(), "the launch leaves its counters at 0"


def test_refuses_what_it_cannot_run():
    wo = _w(QType.Q4_K, 256, 256, 1)
    wg = _w(QType.Q4_K, 256, 256, 2)
    wf = _w(QType.Q4_K, 256, 256, 3, mode="f32")
    assert "f32 mode" in F.supported(wo, wg, wf, wo)
    assert "chain" in F.supported(wo, _w(QType.Q4_K, 256, 512, 5), wg, wo)
    assert F.supported(wo, wg, wg, wo) is None
    z = _zeros((1, 256), np.float32)
    q, s = _zeros((1, 256), np.int8), _zeros((1, 32), np.float32)
    ctr = _zeros(F.N_COUNTERS, np.int32)
    with pytest.raises(ValueError, match="f32 mode"):
        F.ffn_fused(wo, wg, wf, wo, q, s, z, z[0], 1e-6, q, s, z, q, s, ctr)
    with pytest.raises(ValueError, match="ctr must be"):
        F.ffn_fused(wo, wg, wg, wo, q, s, z, z[0], 1e-6, q, s, z, q, s, _zeros(3, np.int32))
    with pytest.raises(ValueError, match="grid must be 1"):
        F.ffn_fused(wo, wg, wg, wo, q, s, z, z[0], 1e-6, q, s, z, q, s, ctr, grid=2)


# =====================================================================================
# PTX (no GPU needed): the Qwen3-4B kernel for sm_87 (Jetson Orin) and sm_90
# =====================================================================================
_PTX_SOURCE = '''
from genie_rt.quant import ffn_fused as F
from genie_rt.quant.formats import QType as Q
ffn_4b = F.ffn_kernel(Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, 2560, 640, "silu", True)
'''


@pytest.fixture(scope="module")
def ptx_text():
    from ptx_helpers import compile_in_subprocess
    return compile_in_subprocess(_PTX_SOURCE, {"ffn_4b": F.SIG})


def test_ptx_barriers_and_no_local_memory(ptx_text):
    """No spills, every device function inlined, the barrier protocol (fence, atomic count,
    ld.relaxed.gpu spin, fence) and no sm_90-only instruction on either target."""
    from ptx_helpers import assert_no_f64, assert_ptx_contains, assert_ptx_lacks, local_memory_bytes
    for cc, text in ptx_text["ffn_4b"].items():
        where = f"ffn_4b sm_{cc[0]}{cc[1]}"
        assert_no_f64(text, where)
        assert local_memory_bytes(text) == 0, f"{where}: local memory"
        assert "call.uni" not in text, f"{where}: a device function was not inlined"
        assert_ptx_contains(text, "membar.gl", "atom.global.add", "ld.relaxed.gpu.global.s32",
                            "ld.relaxed.gpu.global.f32", "dp4a.s32.s32", "ld.global.nc.v4.u32", where=where)
        assert_ptx_lacks(text, "griddepcontrol", "wgmma", "cp.async.bulk", where=where)
