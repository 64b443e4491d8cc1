"""quant/gemv_mma_k.py: the int8 tensor-core GEMV with an integer epilogue (lab), in the simulator.

Q4_K weights at tiny shapes (rows not a multiple of the 16-row tile, several 256-weight blocks
split over 1-16 warps - uneven, and warps with no block), 1-16 tokens (above 8: the build with a
second B fragment), with and without the residual add, each with and without the next block's
loads pipelined: within the dp4a GEMV's error bound of numpy (W @ the dequantized
q8_K x), and within float rounding of gemv_mma.py's kernel fed the same values as q8 (its
32-value scales all equal to the block's: the same integer dots, summed in another order).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_mma as M
from genie_rt.quant import gemv_mma_k as K
from genie_rt.quant import ptx
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight


def _case(rows, cols, n_tok, seed):
    hw = random_weight(QType.Q4_K, rows, cols, np.random.default_rng(seed))
    W = G.dequantize_weight(hw)
    gw = G.prepare_weight(G.to_device(hw), "dp4a")
    x = np.random.default_rng(seed + 1).standard_normal((n_tok, cols)).astype(np.float32)
    x[:, :32] *= 8                                   # a sub-block far above the rest of its block
    return W, gw, x


def test_quantize_q8k_reference():
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    x[1, 256:] = 0                                   # an all-zero block: scale 0, values 0
    xq, xd, xb = K.quantize_q8k(x)
    assert xq.dtype == np.int8 and xd.shape == (3, 2) and xb.shape == (3, 16) and xb.dtype == np.int32
    assert xd[1, 1] == 0 and not xq[1, 256:].any()
    assert np.abs(xq).max() == 127
    np.testing.assert_array_equal(xb, xq.reshape(3, 16, 32).astype(np.int32).sum(axis=2))
    back = K.dequantize_q8k(xq, xd)
    assert np.all(np.abs(back - x) <= np.repeat(xd, 256, axis=1) / 2 + 1e-6)
    with pytest.raises(ValueError, match="multiple of 256"):
        K.quantize_q8k(np.zeros((1, 100), np.float32))


def test_q8k_layout_is_groups_of_eight_tokens_by_sub_block():
    # quant/q8k_layout.py: token t's value c at byte (t // 8) 8 cols + (c // 32) 256 + (t % 8) 32
    # + c % 32, the last group padded with zeros; untile_q8k inverts it
    n, cols = 11, 512
    xq = np.random.default_rng(2).integers(-127, 128, (n, cols)).astype(np.int8)
    flat = K.tile_q8k(xq)
    assert flat.shape == (K.xq_size(n, cols),) == (16 * cols,)
    for t, c in ((0, 0), (3, 37), (7, 511), (8, 0), (10, 300)):
        assert flat[(t // 8) * 8 * cols + (c // 32) * 256 + (t % 8) * 32 + c % 32] == xq[t, c]
    assert not flat.reshape(2, cols // 32, 8, 32)[1, :, 3:].any()
    np.testing.assert_array_equal(K.untile_q8k(flat, n, cols), xq)
    assert K.xq_size(8, cols) == 8 * cols and K.xq_size(1, cols) == 8 * cols
    # xd and xb a block at a time: [group][block][8 tokens][1 scale or 8 sums]; a token's first
    # xb word of a block is 8x its xd index
    xd = np.random.default_rng(3).standard_normal((n, 2)).astype(np.float32)
    xb = np.arange(n * 16, dtype=np.int32).reshape(n, 16)
    tq, td, tb = K.tiled(xq, xd, xb)
    assert (td.size, tb.size) == K.sizes(n, cols)[1:] == (32, 256)
    for t, b, s in ((0, 0, 0), (5, 1, 3), (9, 0, 7), (10, 1, 6)):
        ix = (t // 8) * 8 * 2 + b * 8 + t % 8
        assert td[ix] == xd[t, b] and tb[8 * ix + s] == xb[t, 8 * b + s]
    for a, want in zip(K.untiled(tq, td, tb, n, cols), (xq, xd, xb)):
        np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize("pipe,w16", [(True, False), (False, False), (False, True), (True, True)])
@pytest.mark.parametrize("rows,cols,n_tok,ksplit,resid", [
    (16, 256, 1, 1, False),      # one tile, one block, one token
    (21, 512, 3, 2, True),       # a partial second tile, two blocks over two warps
    (9, 768, 8, 4, False),       # 3 blocks over 4 warps: one warp without a block
    (5, 512, 8, 8, True),        # 2 blocks over 8 warps, rows only in the first half-tile
    (20, 1280, 2, 3, False),     # 5 blocks over 3 warps: 2, 2, 1
    (18, 1792, 5, None, True),   # plan_ksplit's split (7 blocks: 7 warps of one)
    (21, 768, 9, 2, True),       # the 16-token build: a second B fragment with one token
    (16, 512, 16, 3, False),     # 16 tokens, a warp without a block
    (20, 768, 4, 16, False)])    # 16 warps over 3 blocks: 13 without one
def test_gemv_mma_k_matches_numpy_and_gemv_mma(rows, cols, n_tok, ksplit, resid, pipe, w16):
    # every build: 8- or 16-byte weight loads (W16, the default up to 8 tokens), pipelined or not
    W, gw, x = _case(rows, cols, n_tok, rows + cols)
    xq, xd, xb = K.quantize_q8k(x)
    r = np.random.default_rng(7).standard_normal((n_tok, rows)).astype(np.float32)
    y = cuda.to_device(r) if resid else cuda.device_array((n_tok, rows), np.float32)
    q = [cuda.to_device(a) for a in K.tiled(xq, xd, xb)]
    if pipe and w16 and ksplit == 16 and not ptx.SIMULATOR:
        # the pipelined W16 build's 164 registers (sm_90) x 512 threads exceed a block's 65,536
        with pytest.raises(ValueError, match="does not fit a thread block"):
            K.gemv_mma_k(gw, *q, y, n_tok, ksplit=ksplit, pipe=pipe, w16=w16)
        return
    K.gemv_mma_k(gw, *q, y, n_tok, residual=y if resid else None, ksplit=ksplit, pipe=pipe, w16=w16)
    got = y.copy_to_host()
    xt = K.dequantize_q8k(xq, xd)
    ref = G.gemv_reference(W, xt, r if resid else None)
    bound = G.error_bound(W, xt, "f32")
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) / bound))
    # the same values as q8 (each 32-value block's scale = its 256-block's): gemv_mma's result
    # (8 tokens at a time)
    xs = np.zeros((n_tok, cols // 32, 4), np.float32)
    d = np.repeat(xd, 8, axis=1)
    q = xq.reshape(n_tok, cols // 32, 32).astype(np.float32)
    xs[..., 0], xs[..., 1], xs[..., 2], xs[..., 3] = d, d * q[..., :16].sum(-1), d * q[..., 16:].sum(-1), d * q.sum(-1)
    for t0 in range(0, n_tok, 8):
        n = min(8, n_tok - t0)
        part = slice(t0, t0 + n)
        y2 = cuda.to_device(np.ascontiguousarray(r[part])) if resid else cuda.device_array((n, rows), np.float32)
        M.gemv_mma(gw, cuda.to_device(np.ascontiguousarray(xq[part])),
                   cuda.to_device(np.ascontiguousarray(xs[part].reshape(n, cols // 8))), y2, n,
                   residual=y2 if resid else None, ksplit=ksplit if ksplit in (1, 2, 4, 8) else 1)
        np.testing.assert_allclose(got[part], y2.copy_to_host(), rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("rows,cols,n_tok,ksplit,pipe,resid", [
    (21, 768, 5, 2, True, True),      # a partial tile, 3 blocks over 2 warps, pipelined
    (16, 512, 8, 3, False, False),    # 8 tokens, a warp without a block
    (20, 1024, 13, 2, False, True)])  # the 16-token build: the split weights against both B fragments
def test_w16_is_the_8_byte_build_bit_for_bit(rows, cols, n_tok, ksplit, pipe, resid):
    # the lab build W16 (16-byte weight loads a lane, lanes t and t ^ 2 swapping halves, the token
    # loads at the matching bytes): the same integer sums in the same order, so the same bits - and
    # numpy's within the bound. A wrong swap or token offset pairs weights with other values.
    W, gw, x = _case(rows, cols, n_tok, 5 * rows + cols)
    q = [cuda.to_device(a) for a in K.quantize_q8k_tiled(x)]
    r = np.random.default_rng(9).standard_normal((n_tok, rows)).astype(np.float32)
    ys = []
    for w16 in (False, True):
        y = cuda.to_device(r)
        K.gemv_mma_k(gw, *q, y, n_tok, residual=y if resid else None, ksplit=ksplit, pipe=pipe, w16=w16)
        ys.append(y.copy_to_host())
    np.testing.assert_array_equal(ys[1], ys[0])
    xq, xd, _ = K.quantize_q8k(x)
    xt = K.dequantize_q8k(xq, xd)
    ref = G.gemv_reference(W, xt, r if resid else None)
    assert np.all(np.abs(ys[1] - ref) <= G.error_bound(W, xt, "f32"))


@pytest.mark.parametrize("n_tok,tok", [(2, 1), (12, 9)])   # 12: token 9 is in the second B fragment
def test_gemv_mma_k_uses_every_sum_and_scale(n_tok, tok):
    # a wrong sub-block sum or block scale must show: the result moves outside the bound
    rows, cols = 16, 512
    W, gw, x = _case(rows, cols, n_tok, 3)
    xq, xd, xb = K.quantize_q8k(x)
    xt = K.dequantize_q8k(xq, xd)
    ref, bound = G.gemv_reference(W, xt), G.error_bound(W, xt, "f32")
    for what in ("xb", "xd"):
        bad_b, bad_d = xb.copy(), xd.copy()
        if what == "xb":
            bad_b[tok, 9] += 40
        else:
            bad_d[tok - 1, 1] *= 1.01
        y = cuda.device_array((n_tok, rows), np.float32)
        K.gemv_mma_k(gw, *(cuda.to_device(a) for a in K.tiled(xq, bad_d, bad_b)), y, n_tok, ksplit=2)
        assert not np.all(np.abs(y.copy_to_host() - ref) <= bound), what


def test_gemv_mma_k_refuses_what_it_does_not_do():
    W, gw, x = _case(16, 256, 1, 0)
    xq, xd, xb = (cuda.to_device(a) for a in K.quantize_q8k_tiled(x))
    y = cuda.device_array((1, 16), np.float32)
    with pytest.raises(ValueError, match="n_tok"):
        K.gemv_mma_k(gw, xq, xd, xb, y, 17)
    with pytest.raises(ValueError, match="ksplit"):
        K.gemv_mma_k(gw, xq, xd, xb, y, 1, ksplit=17)
    with pytest.raises(ValueError, match="xb must be int32"):
        K.gemv_mma_k(gw, xq, xd, xd, y, 1)
    hw5 = random_weight(QType.Q5_K, 16, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="only Q4_K and Q6_K"):
        K.gemv_mma_k(G.prepare_weight(G.to_device(hw5), "dp4a"), xq, xd, xb, y, 1)


def test_plan_ksplit_at_the_4b_shapes_and_small_rows():
    # the H100 sweep's picks (module docstring), and never a warp without a block
    assert [K.plan_ksplit(r, c) for r, c in ((4096, 2560), (9728, 2560), (2560, 4096), (2560, 9728))] == [4, 2, 4, 8]
    assert [K.plan_ksplit(r, c, 16) for r, c in ((4096, 2560), (9728, 2560), (2560, 4096), (2560, 9728))] == [4, 2, 4, 4]
    for rows, cols in ((1024, 2560), (16, 256), (2048, 1024), (151936, 2560), (16, 25600)):
        ks, nblk = K.plan_ksplit(rows, cols), cols // 256
        per = -(-nblk // ks)
        assert 1 <= ks <= 8 and (ks - 1) * per < nblk, (rows, cols, ks)


@pytest.mark.slow
def test_gemv_mma_k_ptx_uses_the_int8_tensor_cores_and_unsigned_indices():
    # sm_87 and sm_90, both builds and the 16-token one: the s8 mma, no f64, no local memory, a block's loads before its
    # first mma (the pipelined build: the next block's too), and the loop's loads without Numba's
    # negative-index wrap-around (shr.s64 x, 63 + and + add around a load: unsigned indices) and its
    # integer sums in 32 bits (numba widens int32 products to int64; the int32() around each sum
    # lets LLVM keep 32 bits)
    from test_gemv_mma import check_mma_gemv_ptx
    out = check_mma_gemv_ptx("from genie_rt.quant.gemv_mma_k import mma_q4k_q8k_kernel\n"
                             "mmak_pipe = mma_q4k_q8k_kernel(4, True)\n", "mmak_pipe", K.SIGNATURE, "gemv_mma_k")
    out2 = check_mma_gemv_ptx("from genie_rt.quant.gemv_mma_k import mma_q4k_q8k_kernel\n"
                              "mmak_block = mma_q4k_q8k_kernel(4, False)\n", "mmak_block", K.SIGNATURE, "gemv_mma_k")
    out3 = check_mma_gemv_ptx("from genie_rt.quant.gemv_mma_k import mma_q4k_q8k_kernel\n"
                              "mmak_16 = mma_q4k_q8k_kernel(4, False, 16)\n", "mmak_16", K.SIGNATURE, "gemv_mma_k")
    for mmas, per_cc in ((8, out), (8, out2), (16, out3)):
        for cc, text in per_cc.items():
            loop = text[text.index("mma.sync"):text.rindex("mma.sync")]
            assert "mul.lo.s64" not in loop and "mul.wide" not in loop, f"gemv_mma_k sm_{cc[0]}{cc[1]}: 64-bit sums"
            assert "shr.s64" not in loop, f"gemv_mma_k sm_{cc[0]}{cc[1]}: negative-index wrap-around code"
            assert loop.count("mma.sync") == mmas - 1, f"gemv_mma_k sm_{cc[0]}{cc[1]}: not one block's {mmas} mma a trip"


def test_gemv_mma_k_writes_column_slices_of_a_wider_buffer():
    # ldy: a Q4_K and a Q6_K weight into columns 0..20 and 21..36 of a [3, 40] buffer (the short
    # prefill's [q | k | v]), the second with the residual: the same values as separate outputs,
    # and the columns past them untouched
    n_tok, cols, width = 3, 512, 40
    x = np.random.default_rng(5).standard_normal((n_tok, cols)).astype(np.float32)
    xq, xd, xb = (cuda.to_device(a) for a in K.quantize_q8k_tiled(x))
    ws = [G.prepare_weight(G.to_device(random_weight(q, r, cols, np.random.default_rng(r))), "dp4a")
          for q, r in ((QType.Q4_K, 21), (QType.Q6_K, 16))]
    base = np.full((n_tok, width), np.nan, np.float32)
    base[:, 21:37] = 1.5
    buf = cuda.to_device(base)
    flat = buf.reshape(n_tok * width)
    K.gemv_mma_k(ws[0], xq, xd, xb, flat[0:], n_tok, ldy=width)
    K.gemv_mma_k(ws[1], xq, xd, xb, flat[21:], n_tok, residual=flat[21:], ldy=width)
    got = buf.copy_to_host()
    for (lo, hi), w, add in (((0, 21), ws[0], 0), ((21, 37), ws[1], 1.5)):
        y = cuda.device_array((n_tok, w.rows), np.float32)
        K.gemv_mma_k(w, xq, xd, xb, y, n_tok)
        np.testing.assert_array_equal(got[:, lo:hi], y.copy_to_host() + np.float32(add))
    assert np.isnan(got[:, 37:]).all()
    with pytest.raises(ValueError, match="at least"):
        K.gemv_mma_k(ws[0], xq, xd, xb, flat[30:], n_tok, ldy=width)
    with pytest.raises(ValueError, match=r"ldy 10 \(>= rows 21\)"):
        K.gemv_mma_k(ws[0], xq, xd, xb, flat, n_tok, ldy=10)
    with pytest.raises(ValueError, match="residual must be"):
        K.gemv_mma_k(ws[0], xq, xd, xb, flat, n_tok, residual=flat[100:], ldy=width)
    with pytest.raises(ValueError, match="reads xb"):
        K.gemv_mma_k(ws[0], xq, xd, None, flat, n_tok, ldy=width)
