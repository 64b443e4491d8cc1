"""kvcache/attention_merge.py: the prefill attention's split merge fused into prepare_x gives the
bits of prefill_merge then prepare_x - the merged attention output and its fp16 MMQ input -
for one split (the attention kernel wrote the output), several, and the count read from the
device state; bad arguments are refused with the argument named."""
import numpy as np
import pytest
from numba import cuda

from genie_rt.kvcache.attention_merge import merge_prepare_x, merge_q8k
from genie_rt.kvcache.attention_prefill_kernels import prefill_merge
from genie_rt.quant import mmq
from genie_rt.quant.gemv_mma_k import quantize_q8k
from genie_rt.quant.q8k_layout import sizes, tiled


def _problem(n, n_head, hd, splits, seed):
    rng = np.random.default_rng(seed)
    part_o = rng.standard_normal((splits, n * n_head + 3, hd)).astype(np.float32)
    ml = np.empty((splits, n * n_head + 3, 2), np.float32)
    ml[..., 0] = rng.uniform(-30, 5, ml.shape[:2])             # running max (log2 units)
    ml[..., 1] = rng.uniform(0.5, 40, ml.shape[:2])            # running sum
    ml[1 % splits, 0, 0] = -np.inf if splits > 2 else ml[1 % splits, 0, 0]   # a split that saw no key
    x = (rng.standard_normal((n, n_head * hd)) * 3).astype(np.float32)       # the one-split output
    return part_o, ml, x


def _reference(part_o, ml, x0, count, at, state):
    x = cuda.to_device(x0)
    if count > 1:
        prefill_merge[x0.shape[0] * (x0.shape[1] // part_o.shape[2]), 128](
            cuda.to_device(part_o), cuda.to_device(ml), np.int32(part_o.shape[0]), cuda.to_device(state),
            np.int32(at), x)
    x16, xs = cuda.device_array(x0.shape, np.float16), cuda.device_array(x0.shape[0], np.float32)
    mmq.prepare_x(x, x16, xs)
    return x.copy_to_host(), x16.copy_to_host(), xs.copy_to_host()


@pytest.mark.parametrize("n,n_head,hd,splits,count", [(3, 4, 64, 3, 1), (3, 4, 64, 3, 2), (2, 2, 128, 3, 3),
                                                      (5, 3, 64, 2, 2)])
def test_fused_merge_is_merge_then_prepare_x_bit_for_bit(n, n_head, hd, splits, count):
    part_o, ml, x0 = _problem(n, n_head, hd, splits, seed=n * 7 + count)
    if count == 3:
        part_o *= 1e6                                            # rows above fp16's range: xscale > 1
    state = np.array([0, count, 0], np.int32)
    ref = _reference(part_o, ml, x0, count, 1, state)
    x = cuda.to_device(x0)
    x16, xs = cuda.device_array(x0.shape, np.float16), cuda.device_array(n, np.float32)
    merge_prepare_x(cuda.to_device(part_o), cuda.to_device(ml), splits, cuda.to_device(state), 1, x, x16, xs)
    for what, got, want in zip(("x", "x16", "xscale"), (x.copy_to_host(), x16.copy_to_host(), xs.copy_to_host()), ref):
        np.testing.assert_array_equal(got.view(np.uint16 if got.dtype == np.float16 else np.uint32),
                                      want.view(np.uint16 if want.dtype == np.float16 else np.uint32), err_msg=what)
    if count == 3:
        assert ref[2].max() > 1


@pytest.mark.parametrize("n,n_head,hd,splits,count", [(3, 4, 64, 3, 1), (2, 4, 128, 3, 2), (2, 2, 256, 4, 4)])
def test_merge_q8k_is_merge_then_q8k_bit_for_bit(n, n_head, hd, splits, count):
    # the short prefill's merge: the merged output and its q8_K values, the bits of prefill_merge
    # then rmsnorm_q8k without a norm weight (quantize_q8k's arithmetic) - for one split (the
    # attention kernel wrote x: only quantized), two of three, and every split; 64-dim heads put
    # four heads in a q8_K block, 256-dim ones one
    from genie_rt.quant.quantize_q8k import rmsnorm_q8k
    part_o, ml, x0 = _problem(n, n_head, hd, splits, seed=n * 5 + count)
    x0[0, :256] = 0                                              # an all-zero block (one split: as written)
    state = np.array([0, count, 0], np.int32)
    want_x = _reference(part_o, ml, x0, count, 1, state)[0]
    cols = n_head * hd
    rq, rd, rb = (cuda.to_device(np.zeros(s, t)) for s, t in zip(sizes(n, cols), (np.int8, np.float32, np.int32)))
    rmsnorm_q8k(cuda.to_device(want_x), None, 0.0, rq, rd, rb)
    x = cuda.to_device(x0)
    xq, xd, xb = (cuda.to_device(np.zeros(a.size, a.dtype)) for a in (rq, rd, rb))
    merge_q8k(cuda.to_device(part_o), cuda.to_device(ml), splits, cuda.to_device(state), 1, x, xq, xd, xb)
    np.testing.assert_array_equal(x.copy_to_host().view(np.uint32), want_x.view(np.uint32))
    for what, got, want in (("xq", xq, rq), ("xd", xd, rd), ("xb", xb, rb)):
        np.testing.assert_array_equal(got.copy_to_host().reshape(-1), want.copy_to_host().reshape(-1), err_msg=what)
    assert np.abs(xq.copy_to_host()).max() == 127
    # and the layout the GEMVs read (quant/q8k_layout.py): tiled, not row-major
    for what, got, want in zip(("xq", "xd", "xb"), (xq, xd, xb), tiled(*quantize_q8k(want_x))):
        np.testing.assert_array_equal(got.copy_to_host(), want, err_msg=what)


def test_merge_q8k_refuses_bad_arguments():
    part_o, ml, x0 = (cuda.to_device(a) for a in _problem(2, 4, 64, 2, seed=2))
    state = cuda.to_device(np.array([0, 2], np.int32))
    xq, xd, xb = cuda.device_array(2048, np.int8), cuda.device_array(8, np.float32), cuda.device_array(64, np.int32)
    with pytest.raises(ValueError, match="xb must be int32 with 64"):
        merge_q8k(part_o, ml, 2, state, 1, x0, xq, xd, cuda.device_array(64, np.float32))
    with pytest.raises(ValueError, match="xq must be int8 with 2048"):        # 2 rows: a whole group of 8
        merge_q8k(part_o, ml, 2, state, 1, x0, cuda.device_array(512, np.int8), xd, xb)
    with pytest.raises(ValueError, match="multiple of 256"):
        merge_q8k(part_o, ml, 2, state, 1, cuda.device_array((4, 192), np.float32), xq, xd, xb)
    with pytest.raises(ValueError, match="fewer than 3 splits"):
        merge_q8k(part_o, ml, 3, state, 1, x0, xq, xd, xb)
    # one split reads no workspace: a placeholder is taken (the plan without splits has one)
    merge_q8k(cuda.device_array((1, 1, 64), np.float32), cuda.device_array((1, 1, 2), np.float32), 1, state, None,
              x0, xq, xd, xb)


def test_bad_arguments_are_refused():
    part_o, ml, x0 = (cuda.to_device(a) for a in _problem(2, 2, 64, 2, seed=1))
    state = cuda.to_device(np.array([0, 2], np.int32))
    ok16, okxs = cuda.device_array((2, 128), np.float16), cuda.device_array(2, np.float32)
    with pytest.raises(ValueError, match="x16 must be float16"):
        merge_prepare_x(part_o, ml, 2, state, 1, x0, cuda.device_array((2, 128), np.float32), okxs)
    with pytest.raises(ValueError, match="fewer than 3 splits"):
        merge_prepare_x(part_o, ml, 3, state, 1, x0, ok16, okxs)
    with pytest.raises(ValueError, match="n_head x head_dim"):
        merge_prepare_x(part_o, ml, 2, state, 1, cuda.device_array((2, 96), np.float32), ok16, okxs)
