"""quant/gemv_mma_q6k.py: the int8 tensor-core GEMV for Q6_K weights (lab), in the simulator.

Random Q6_K blocks (every quant and scale bit random: scales -128..127, both signs of d) at tiny
shapes - rows not a multiple of the 16-row tile, several blocks split unevenly over 1-16 warps,
1-16 tokens, with and without the residual, pipelined or not - against numpy (W @ the dequantized
q8_K x, within the dp4a GEMV's error bound) and against the same sums done exactly in integers.
Then: each of a block's 16 sub-block scales, d and every quant bit plane is read where it belongs
(a change to one moves the result by what the numpy reference says), and the PTX promises.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_mma_k as K
from genie_rt.quant import layout, ptx
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight


def _run(hw, x, n_tok, ksplit=None, pipe=None, resid=None, w16=False):
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    xq, xd, _ = K.quantize_q8k(x)
    y = cuda.to_device(resid) if resid is not None else cuda.device_array((n_tok, hw.rows), np.float32)
    K.gemv_mma_k(gw, cuda.to_device(K.tile_q8k(xq)), cuda.to_device(K.tile_blocks(xd, 1)), None, y, n_tok,
                 residual=y if resid is not None else None, ksplit=ksplit, pipe=pipe, w16=w16)
    return y.copy_to_host(), xq, xd


def _exact(hw, xq, xd):
    """The kernel's sums without rounding: sum over blocks of xd * d * sum_s sc * dot(q - 32, xq)
    in integers and float64."""
    ql, qh, sc, d = (hw.planes[k] for k in ("ql", "qh", "sc", "d"))
    rows, nb = d.shape
    q = np.zeros((rows, nb, 256), np.int64)
    ql, qh = ql.reshape(rows, nb, 2, 64).astype(np.int64), qh.reshape(rows, nb, 2, 32).astype(np.int64)
    for h in range(2):
        for quarter in range(4):
            lo = ql[:, :, h, 32 * (quarter & 1):32 * (quarter & 1) + 32] >> (4 * (quarter >> 1)) & 15
            q[:, :, 128 * h + 32 * quarter:128 * h + 32 * quarter + 32] = lo | ((qh[:, :, h] >> (2 * quarter) & 3) << 4)
    dots = np.einsum("rbsk,tbsk->rtbs", (q - 32).reshape(rows, nb, 16, 16),
                     xq.astype(np.int64).reshape(xq.shape[0], nb, 16, 16))
    S = (dots * sc.reshape(rows, 1, nb, 16).astype(np.int64)).sum(axis=3)
    return (S * d.astype(np.float64)[:, None, :] * xd.astype(np.float64)[None]).sum(axis=2).T


def _case(rows, cols, n_tok, seed):
    hw = random_weight(QType.Q6_K, rows, cols, np.random.default_rng(seed))
    x = np.random.default_rng(seed + 1).standard_normal((n_tok, cols)).astype(np.float32)
    x[:, :16] *= 8                                   # a sub-block far above the rest of its block
    return hw, x


@pytest.mark.parametrize("pipe", [True, False])
@pytest.mark.parametrize("rows,cols,n_tok,ksplit,resid", [
    (16, 256, 1, 1, False),      # one tile, one block, one token
    (21, 512, 3, 2, True),       # a partial second tile, two blocks over two warps
    (9, 768, 8, 4, False),       # 3 blocks over 4 warps: one warp without a block
    (20, 1280, 2, 3, True),      # 5 blocks over 3 warps: 2, 2, 1
    (18, 1792, 5, None, False),  # plan_ksplit's split
    (21, 768, 9, 2, True),       # the 16-token build: a second B fragment with one token
    (16, 512, 16, 3, False),     # 16 tokens, a warp without a block
    (20, 768, 4, 16, False)])    # 16 warps over 3 blocks
def test_gemv_mma_q6k_matches_numpy_and_the_exact_sums(rows, cols, n_tok, ksplit, resid, pipe):
    hw, x = _case(rows, cols, n_tok, rows + cols)
    r = np.random.default_rng(7).standard_normal((n_tok, rows)).astype(np.float32)
    if pipe and ksplit == 16 and not ptx.SIMULATOR:
        # the pipelined Q6_K build's 158 registers (sm_90) x 512 threads exceed a block's 65,536:
        # refused by name before the driver's out-of-resources error (gemv_mma_k._fits)
        with pytest.raises(ValueError, match="k-split 16 with pipe=True .* does not fit a thread block"):
            _run(hw, x, n_tok, ksplit, pipe, r if resid else None)
        return
    got, xq, xd = _run(hw, x, n_tok, ksplit, pipe, r if resid else None)
    W = G.dequantize_weight(hw)
    xt = K.dequantize_q8k(xq, xd)
    ref = G.gemv_reference(W, xt, r if resid else None)
    bound = G.error_bound(W, xt, "f32")
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) / bound))
    exact = _exact(hw, xq, xd) + (r if resid else 0)
    np.testing.assert_allclose(got, exact, rtol=2e-6, atol=2e-6 * float(np.abs(exact).max()))


@pytest.mark.parametrize("rows,cols,n_tok,ksplit,pipe,resid", [
    (21, 512, 3, 2, False, True),     # a partial second tile, two blocks over two warps
    (20, 1280, 8, 3, False, False),   # 5 blocks over 3 warps, 8 tokens
    (18, 768, 5, 4, True, False),     # pipelined, a warp without a block
    (21, 768, 11, 2, False, True)])   # the 16-token build
def test_q6k_w16_is_the_4_byte_build_bit_for_bit(rows, cols, n_tok, ksplit, pipe, resid):
    # the build W16 (gemv_mma_q6k.W16, the default: ql and qh by 16-byte lane loads, a 4 x 4 transpose over each
    # quad) gives every lane the words the 4-byte loads give it: the same bits, every quant bit random
    hw, x = _case(rows, cols, n_tok, 3 * rows + cols)
    r = np.random.default_rng(5).standard_normal((n_tok, rows)).astype(np.float32)
    outs = [_run(hw, x, n_tok, ksplit, pipe, r if resid else None, w16=w16)[0] for w16 in (False, True)]
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))


def test_q6k_w16_knob_is_the_default_build(monkeypatch):
    # gemv_mma_q6k.W16 (on since 2026-12-08; a knob): default_build takes W16 for a Q6_K weight up to 8
    # tokens where it is on, with the 4-byte build's k-split (both unpipelined), and the 4-byte build where off
    from types import SimpleNamespace

    from genie_rt.quant import gemv_mma_q6k as Q6
    assert Q6.W16 is True
    w = SimpleNamespace(rows=2560, cols=9728, qtype=QType.Q6_K)
    monkeypatch.setattr(Q6, "W16", False)
    off = K.default_build(w, 8)
    monkeypatch.setattr(Q6, "W16", True)
    on = K.default_build(w, 8)
    assert off[2] is False and on[2] is True and on[:2] == off[:2] and on[1] is False
    assert K.default_build(w, 9)[2] is False


def test_gemv_mma_q6k_reads_each_field_where_it_belongs():
    # one block, one row changed at a time: sub-block s's scale, d, a ql nibble, a qh bit pair -
    # the kernel's result follows numpy's for every change (a field read from the wrong place
    # would leave the result or move a different row)
    rows, cols, n_tok = 16, 512, 3
    hw, x = _case(rows, cols, n_tok, 11)
    base = {k: v.copy() for k, v in hw.planes.items()}
    rng = np.random.default_rng(12)
    for _ in range(6):
        planes = {k: v.copy() for k, v in base.items()}
        r, b = int(rng.integers(rows)), int(rng.integers(cols // 256))
        s = int(rng.integers(16))
        v = int(planes["sc"][r, 16 * b + s])
        planes["sc"][r, 16 * b + s] = 5 if v in (0, -128) else -v
        planes["ql"][r, 128 * b + int(rng.integers(128))] ^= np.uint8(0x5A)
        planes["qh"][r, 64 * b + int(rng.integers(64))] ^= np.uint8(0xC3)
        changed = layout.PackedWeight(hw.qtype, hw.rows, hw.cols, planes)
        got, xq, xd = _run(changed, x, n_tok, ksplit=2)
        xt = K.dequantize_q8k(xq, xd)
        W = G.dequantize_weight(changed)
        ref, bound = G.gemv_reference(W, xt), G.error_bound(W, xt, "f32")
        assert np.all(np.abs(got - ref) <= bound)
        assert not np.allclose(ref[:, r], G.gemv_reference(G.dequantize_weight(hw), xt)[:, r])


def test_gemv_mma_k_takes_q6k_without_xb_and_refuses_other_formats():
    hw, x = _case(16, 256, 1, 0)
    xq, xd, xb = (cuda.to_device(a) for a in K.quantize_q8k_tiled(x))
    y = cuda.device_array((1, 16), np.float32)
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    K.gemv_mma_k(gw, xq, xd, xb, y, 1)               # xb given: not read
    with pytest.raises(ValueError, match="n_tok"):
        K.gemv_mma_k(gw, xq, xd, None, y, 17)
    q8 = G.prepare_weight(G.to_device(random_weight(QType.Q8_0, 16, 256, np.random.default_rng(0))), "dp4a")
    with pytest.raises(ValueError, match="only Q4_K and Q6_K"):
        K.gemv_mma_k(q8, xq, xd, xb, y, 1)


@pytest.mark.slow
def test_gemv_mma_q6k_ptx_uses_the_k16_mma_in_32_bits():
    # sm_87 and sm_90, pipelined, block and 16-token builds: sixteen m16n8k16 s8 mma a block (32 at
    # 16 tokens), no f64, no local memory, the block's loads before its first mma, and between the
    # first and last mma no 64-bit multiply or negative-index wrap-around (unsigned indices, int32
    # sums), no m16n8k32
    from ptx_helpers import assert_no_f64, compile_in_subprocess, local_memory_bytes

    from genie_rt.quant.gemv_mma_q6k import SIGNATURE
    src = ("from genie_rt.quant.gemv_mma_q6k import mma_q6k_q8k_kernel\n"
           "k6_pipe = mma_q6k_q8k_kernel(4, True)\nk6_block = mma_q6k_q8k_kernel(4, False)\n"
           "k6_16 = mma_q6k_q8k_kernel(4, False, 16)\nk6_w16 = mma_q6k_q8k_kernel(4, False, 8, 0, True)\n")
    out = compile_in_subprocess(src, {n: SIGNATURE for n in ("k6_pipe", "k6_block", "k6_16", "k6_w16")})
    for name, mmas in (("k6_pipe", 16), ("k6_block", 16), ("k6_16", 32), ("k6_w16", 16)):
        for cc, text in out[name].items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_no_f64(text, where=where)
            assert local_memory_bytes(text) == 0, f"{where}: local memory used"
            assert "m16n8k32" not in text and "ld.global.nc.v4.u32" in text, where
            loop = text[text.index("mma.sync"):text.rindex("mma.sync")]
            assert loop.count("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32") == mmas - 1, where
            assert loop.count("ld.global") == 0, f"{where}: a load between the block's mmas"
            assert "mul.lo.s64" not in loop and "mul.wide" not in loop and "shr.s64" not in loop, where
            if name == "k6_w16":             # ql, qh and the scales by 16-byte loads, 3 a row, 24 shuffles a block
                assert text.count("ld.global.nc.v4.u32") == 2 * 4 and text.count("shfl.sync.bfly.b32") == 24, where


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_q6k_w16_is_the_4_byte_build_at_the_4b_shapes(pdl):
    # the knob gemv_mma_q6k.W16 on the device, at the short graph's Q6_K shapes (8 tokens): ffn_down
    # 2,560 x 9,728 alone, and attn_v 1,024 x 2,560 in the q/k/v launch - the same bits as the 4-byte
    # builds, plain and by the PDL build
    from genie_rt.quant import pdl as P
    from genie_rt.quant.gemv_mma_qkv import gemv_mma_qkv
    if pdl and not P.available():
        pytest.skip("PDL needs sm_90+")
    hw, x = _case(2560, 9728, 8, 1)
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    outs = []
    for w16 in (False, True):
        y = cuda.device_array((8, 2560), np.float32)
        K.gemv_mma_k(gw, *q, y, 8, w16=w16, pdl=pdl)
        outs.append(y.copy_to_host())
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    ws = [G.prepare_weight(G.to_device(random_weight(qt, r, 2560, np.random.default_rng(r))), "dp4a")
          for qt, r in ((QType.Q4_K, 4096), (QType.Q4_K, 1024), (QType.Q6_K, 1024))]
    x = np.random.default_rng(3).standard_normal((8, 2560)).astype(np.float32)
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    outs = []
    for w16q6 in (False, True):
        y = cuda.device_array((8, 6144), np.float32)
        gemv_mma_qkv(ws, *q, y, 8, pipe=False, w16=True, w16q6=w16q6, pdl=pdl)
        outs.append(y.copy_to_host())
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
