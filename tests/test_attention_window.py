"""kvcache/attention.py + attention_prefill.py: sliding windows, rings, an explicit
attention scale, head_dim 256 with one KV head and head_dim 64 with group 3, under the
simulator (or on the device).

Windows inside / wider than the context and smaller than the chunk, wrapped rings with
R = W + n - 1 exactly; references are attention_window_reference (engine.models.reference's
attention plus llama.cpp's SWA mask) on every position 0 .. T-1, of which the ring holds
the last R; the windowed plans and what the launchers refuse.
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import make_pool, make_ring_pool, run_decode_w, run_prefill_w
from genie_rt.kvcache.attention import DecodeWorkspace, decode_attention, plan_decode
from genie_rt.kvcache.attention_prefill import (PrefillWorkspace, plan_prefill, prefill_attention,
                                                prefill_splits)


# ---- sliding windows, rings, attention scale, head_dim 256 / 64 with an odd group --------
def test_window_reference_is_the_plain_one_with_a_mask():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, 4, 16))
    k, v = rng.standard_normal((2, 12, 2, 16))
    from genie_rt.kvcache.attention import attention_window_reference as ref
    full = ref(q, k, v, 7)
    assert np.allclose(ref(q, k, v, 7, window=12), full)        # a window wider than the context
    got = ref(q, k, v, 7, window=3, scale=0.3)
    for i in range(5):                                          # query 7 + i sees 5 + i .. 7 + i
        lo = 7 + i - 2
        one = ref(q[i:i + 1], k[lo:8 + i] * 0.3 * 4, v[lo:8 + i], 8 + i - lo - 1)
        assert np.allclose(got[i], one[0])


@pytest.mark.parametrize("kv_dtype,pos,window,n_splits", [
    ("int8", 20, 5, 1),        # window inside the context, one split
    ("f16", 47, 13, 3),        # window over several tiles and splits
    ("int8", 3, 8, 2),         # context shorter than the window
])
def test_decode_window_on_an_ordinary_layer(kv_dtype, pos, window, n_splits):
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 48, layers=1)
    run_decode_w(pool, kd, vd, 4, pos, window, n_splits=n_splits, warps=1, rows_per_thread=1)


@pytest.mark.parametrize("kv_dtype,T,slots,window,n_splits", [
    ("int8", 30, 12, 12, 2),   # ring full, oldest position 18 in slot 6: the window wraps
    ("f16", 40, 13, 9, 3),     # ring larger than the window (prefill chunk room)
    ("int8", 7, 12, 12, 1),    # not wrapped yet
])
@pytest.mark.parametrize("loop", ["block", "warp"])
def test_decode_window_through_a_ring(kv_dtype, T, slots, window, n_splits, loop):
    pool, kd, vd = make_ring_pool(2, 32, 64, slots, kv_dtype, T, seed=T)
    plan = run_decode_w(pool, kd, vd, 4, T - 1, window, n_splits=n_splits, warps=1,
                        rows_per_thread=1, loop=loop)
    assert plan.window == window


def test_decode_head_dim_64_group_3_and_a_scale():
    # SmolLM2's shape: 9 q heads over 3 kv heads; Gemma 3 27B's kind of explicit scale
    pool, kd, vd = make_pool(3, 64, 32, "int8", 32, layers=1, seed=4)
    plan = run_decode_w(pool, kd, vd, 9, 29, 20, scale=0.07, n_splits=2, warps=1,
                        rows_per_thread=2, heads_per_block=3)   # keys 10 .. 29: two 16-row tiles
    assert (plan.heads_per_block, plan.n_sub, plan.n_splits) == (3, 1, 2)
    plan = run_decode_w(pool, kd, vd, 9, 29, 20, scale=0.07, n_splits=2, warps=1,
                        rows_per_thread=2)          # the default: one head a block
    assert (plan.heads_per_block, plan.n_sub, plan.n_splits) == (1, 3, 2)


@pytest.mark.parametrize("loop", ["block", "warp"])
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_decode_head_dim_256_one_kv_head_ring(kv_dtype, loop):
    # Gemma 3 270M's shape (4 q heads, 1 kv head, head_dim 256) on a wrapped ring
    pool, kd, vd = make_ring_pool(1, 256, 64, 10, kv_dtype, 23, seed=6)
    run_decode_w(pool, kd, vd, 4, 22, 8, n_splits=2, warps=1, rows_per_thread=2, loop=loop)


def test_decode_window_plans_and_refusals():
    p = plan_decode(4, 1, 256, "int8", 32768, window=512, sm_count=132)
    g = plan_decode(4, 1, 256, "int8", 32768, sm_count=132)
    assert (p.tile, p.n_splits, g.n_splits, p.window) == (32, 16, 64, 512)   # 512 keys: 16 tiles
    assert p.fits(g) and not g.fits(p)
    pool, _, _ = make_ring_pool(2, 32, 64, 8, "int8", 10)
    state = cuda.to_device(np.zeros(1, np.int32))
    q, out = cuda.device_array(128, np.float32), cuda.device_array(128, np.float32)
    glob = plan_decode(4, 2, 32, "int8", 64, n_splits=2)
    with pytest.raises(ValueError, match="needs a windowed plan"):
        decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(glob))
    wide = plan_decode(4, 2, 32, "int8", 64, n_splits=2, window=9)
    with pytest.raises(ValueError, match="window 9 > the layer's 8 slots"):
        decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(wide))
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(glob),
                         plan=plan_decode(8, 2, 32, "int8", 64, window=8))
    with pytest.raises(ValueError, match="window"):
        plan_decode(4, 2, 32, "int8", 64, window=-1)
    with pytest.raises(ValueError, match="scale"):
        plan_decode(4, 2, 32, "int8", 64, scale=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,n,start,window,n_splits", [
    ("int8", 9, 5, 4, 1),      # window smaller than the chunk: rows lose keys inside it
    ("f16", 9, 30, 4, 2),      # ... after a prefix, split over the window's tiles
    ("int8", 5, 40, 20, 3),    # short chunk, window over several 16-key tiles
])
def test_prefill_window_on_an_ordinary_layer(kv_dtype, n, start, window, n_splits):
    pool, kd, vd = make_pool(2, 32, 64, kv_dtype, 64, seed=start, layers=1)
    run_prefill_w(pool, kd, vd, 4, n, start, window, n_splits, max_splits=4, bn=16)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,n,start,window,n_splits", [
    ("int8", 6, 20, 7, 1),     # R = W + n - 1 = 12 exactly; keys 14 .. 25 wrap the ring
    ("f16", 6, 37, 7, 2),
])
def test_prefill_window_through_a_ring(kv_dtype, n, start, window, n_splits):
    slots = window + n - 1
    pool, kd, vd = make_ring_pool(2, 32, 64, slots, kv_dtype, start + n, seed=start)
    run_prefill_w(pool, kd, vd, 4, n, start, window, n_splits, max_splits=2, bn=16)


@pytest.mark.slow
def test_prefill_head_dim_64_group_3():
    pool, kd, vd = make_pool(3, 64, 32, "int8", 32, layers=1, seed=3)
    run_prefill_w(pool, kd, vd, 9, 7, 11, 0, n_splits=2, scale=0.1, max_splits=2, bn=16)
    run_prefill_w(pool, kd, vd, 9, 7, 11, 6, bn=16)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,n_splits", [("int8", 1), ("f16", 2)])
def test_prefill_head_dim_256_one_kv_head(kv_dtype, n_splits):
    # Gemma 3 270M's shape: O in two column halves per row block (o_splits = 2)
    pool, kd, vd = make_ring_pool(1, 256, 64, 12, kv_dtype, 20, seed=7)
    plan = run_prefill_w(pool, kd, vd, 4, 5, 15, 8, n_splits, max_splits=2)
    assert plan.o_splits == 2 and plan.block_n == 16


def test_prefill_window_plans_and_refusals():
    plan = plan_prefill(4, 1, 256, "int8", n_max=512, window=512)
    # 6 blocks (3 row tiles x 2 column halves); 511 + 33 keys = 34 tiles: 8 splits
    assert prefill_splits(plan, 33, 30000, sm_count=132) == 8
    assert prefill_splits(plan, 33, 20, sm_count=132) == 1                 # 53 keys: 4 tiles
    assert plan_prefill(4, 1, 256, "f16", n_max=16).o_splits == 2
    pool, _, _ = make_ring_pool(2, 32, 64, 10, "int8", 10)
    state = cuda.to_device(np.zeros(1, np.int32))
    q, out = cuda.device_array((5, 4, 32), np.float32), cuda.device_array((5, 128), np.float32)
    with pytest.raises(ValueError, match="needs a windowed plan"):
        prefill_attention(q, pool.layer(0), state, out, PrefillWorkspace(plan_prefill(4, 2, 32, "int8", 5)))
    with pytest.raises(ValueError, match="reads 11 keys at once; the ring holds 10"):
        prefill_attention(q, pool.layer(0), state, out,
                          PrefillWorkspace(plan_prefill(4, 2, 32, "int8", 5, window=7)))
    with pytest.raises(ValueError, match="does not fit"):
        prefill_attention(q, pool.layer(0), state, out,
                          PrefillWorkspace(plan_prefill(4, 2, 32, "int8", 5, window=6)),
                          plan=plan_prefill(4, 2, 32, "int8", 9, window=6))
    with pytest.raises(ValueError, match="head_dim"):
        plan_prefill(4, 1, 272, "int8", 8)
    with pytest.raises(ValueError, match="head_dim"):
        plan_prefill(4, 1, 176, "int8", 8)     # two halves of 88: not a multiple of 16
