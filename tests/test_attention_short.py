"""kvcache/attention_short.py: the short prefill's attention chain in one launch gives the bits of
rope_write, then the prefill attention without its merge, then merge_q8k - the cache rows it writes,
the attention output and its q8_K values - for one split, several (the count read from the device
state, the chunk's keys in the last split or across two), int8 and f16 caches, NeoX pairs with
QK-norm and normal pairs without; the tickets are left zero for the next launch; layers it cannot
take are named; bad arguments are refused.

Simulator shapes (2 KV heads, head_dim 64, group 4: a KV head's 256 columns are one q8_K block);
`-m gpu` adds Qwen3-4B's (8 KV heads, head_dim 128, group 4, 8 tokens after 500).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.kvcache.attention_merge import merge_q8k
from genie_rt.kvcache.attention_prefill import PrefillWorkspace, plan_prefill, prefill_attention
from genie_rt.kvcache.attention_short import fusable, short_attention
from genie_rt.kvcache.device_pool import DeviceKVPool
from genie_rt.kvcache.pool import KVShape
from genie_rt.kvcache.rope_write import rope_table, rope_write
from genie_rt.quant.q8k_layout import sizes

EPS = 1e-6


def _pool(shape, rng, start):
    """A pool whose positions before `start` hold random rows (a cached prefix)."""
    pool = DeviceKVPool(shape)
    L = pool.layer(0)
    for arr in (L.k, L.v):
        if arr.dtype == np.int8:
            host = rng.integers(-127, 128, arr.shape).astype(np.int8)
        else:
            host = (rng.standard_normal(arr.shape)).astype(np.float16)
        host[start:] = 0
        arr.copy_to_device(host)
    if shape.dtype == "int8":
        for arr in (L.k_scale, L.v_scale):
            host = rng.uniform(0.005, 0.05, arr.shape).astype(np.float32)
            host[start:] = 0
            arr.copy_to_device(host)
    return pool


def _run(n_head, n_kv, hd, n, start, kv_dtype, splits, count, rope="neox", qk_norm=True, bn=16, seed=0,
         n_ctx=None):
    rng = np.random.default_rng(seed)
    n_ctx = n_ctx or start + n + 8
    shape = KVShape(1, n_ctx, n_kv, hd, kv_dtype)
    qkv = (rng.standard_normal((n, (n_head + 2 * n_kv) * hd)) * 3).astype(np.float32)
    q_norm = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    k_norm = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    cos, sin = (cuda.to_device(a) for a in rope_table(n_ctx, hd, 1e6))
    plan = plan_prefill(n_head, n_kv, hd, kv_dtype, n_max=8, max_splits=max(4, splits), bn=bn)
    state = cuda.to_device(np.array([start, count], np.int32))
    cols = n_head * hd
    got = {}
    for way in ("three", "fused"):
        pool = _pool(shape, np.random.default_rng(seed + 1), start)
        L = pool.layer(0)
        ws = PrefillWorkspace(plan)
        d_qkv = cuda.to_device(qkv)
        qn = None if q_norm is None else cuda.to_device(q_norm)
        kn = None if k_norm is None else cuda.to_device(k_norm)
        out = cuda.to_device(np.full((n, cols), np.nan, np.float32))
        xq, xd, xb = (cuda.to_device(np.zeros(s, t)) for s, t in zip(sizes(n, cols), (np.int8, np.float32, np.int32)))
        if way == "three":
            q = cuda.device_array((n, n_head, hd), np.float32)
            rope_write(d_qkv, qn, kn, EPS, cos, sin, state, q, L, rope=rope)
            prefill_attention(q, L, state, out, ws, n_splits=splits, plan=plan, splits_at=1, merge=False)
            merge_q8k(ws.part_o, ws.part_ml, splits, state, 1, out, xq, xd, xb)
        else:
            short_attention(d_qkv, qn, kn, EPS, cos, sin, L, state, out, ws, splits, plan, 1, xq, xd, xb, rope=rope)
            assert not ws.tickets.copy_to_host().any(), "the tickets must be left zero"
        cuda.synchronize()
        got[way] = dict(k=L.k.copy_to_host(), v=L.v.copy_to_host(), k_scale=L.k_scale.copy_to_host(),
                        v_scale=L.v_scale.copy_to_host(), out=out.copy_to_host(), xq=xq.copy_to_host(),
                        xd=xd.copy_to_host(), xb=xb.copy_to_host())
    for name, want in got["three"].items():
        have = got["fused"][name]
        if have.dtype.kind == "f":
            have, want = have.view(f"u{have.itemsize}"), want.view(f"u{want.itemsize}")
        np.testing.assert_array_equal(have, want, err_msg=name)
    assert np.abs(got["fused"]["xq"]).max() == 127
    return got["fused"]


@pytest.mark.parametrize("n,start,splits,count,kv_dtype", [
    (8, 40, 3, 3, "int8"),       # the chunk's keys in the last split (tiles of 16: 48 keys, one a split)
    (8, 37, 4, 3, "int8"),       # keys 37 .. 44 across the last two splits' tiles; the launch has 4, 3 in use
    (5, 3, 3, 1, "int8"),        # one split in use: the block holds every row; 5 of 8 rows
    (8, 40, 2, 2, "f16"),
])
def test_fused_chain_is_the_three_launches_bit_for_bit(n, start, splits, count, kv_dtype):
    _run(8, 2, 64, n, start, kv_dtype, splits, count, seed=n + start)


def test_normal_pairs_without_qk_norm():
    _run(8, 2, 64, 6, 20, "int8", 2, 2, rope="normal", qk_norm=False, seed=3)


def test_group_two_head_dim_128():
    # Qwen3-0.6B's group (16 / 8 heads) with one KV head here: two heads of 128, one q8_K block
    _run(2, 1, 128, 8, 30, "int8", 2, 2, seed=4)


def test_fusable_names_what_it_cannot_take():
    assert fusable(128, 4, "int8", 8) is None
    assert fusable(128, 2, "f16", 8) is None
    assert "sliding-window" in fusable(128, 4, "int8", 8, window=512)
    assert "head_dim 256" in fusable(256, 4, "int8", 8)
    assert "row tile" in fusable(64, 16, "int8", 8)
    assert "q8_K blocks" in fusable(128, 1, "int8", 8)
    assert "shared memory" in fusable(128, 8, "f16", 8)
    assert "at most 8" in fusable(128, 4, "int8", 8, max_splits=16)


def test_bad_arguments_are_refused():
    shape = KVShape(1, 64, 2, 64, "int8")
    L = DeviceKVPool(shape).layer(0)
    plan = plan_prefill(8, 2, 64, "int8", n_max=8, max_splits=4, bn=16)
    ws = PrefillWorkspace(plan)
    cos, sin = (cuda.to_device(a) for a in rope_table(64, 64, 1e6))
    qkv = cuda.device_array((8, 12 * 64), np.float32)
    out = cuda.device_array((8, 512), np.float32)
    state = cuda.to_device(np.array([10, 2], np.int32))
    xq, xd, xb = (cuda.device_array(s, t) for s, t in zip(sizes(8, 512), (np.int8, np.float32, np.int32)))
    ok = dict(rope="neox")
    with pytest.raises(ValueError, match="qkv must be float32"):
        short_attention(cuda.device_array((8, 11 * 64), np.float32), None, None, EPS, cos, sin, L, state, out, ws,
                        2, plan, 1, xq, xd, xb, **ok)
    with pytest.raises(ValueError, match="n_splits 5"):
        short_attention(qkv, None, None, EPS, cos, sin, L, state, out, ws, 5, plan, 1, xq, xd, xb, **ok)
    with pytest.raises(ValueError, match="xb must be int32"):
        short_attention(qkv, None, None, EPS, cos, sin, L, state, out, ws, 2, plan, 1, xq, xd,
                        cuda.device_array(xb.size, np.float32), **ok)
    with pytest.raises(ValueError, match="rope must be one of"):
        short_attention(qkv, None, None, EPS, cos, sin, L, state, out, ws, 2, plan, 1, xq, xd, xb, rope="yarn")
    with pytest.raises(ValueError, match="splits_at 7"):
        short_attention(qkv, None, None, EPS, cos, sin, L, state, out, ws, 2, plan, 7, xq, xd, xb, **ok)


@pytest.mark.gpu
def test_qwen3_4b_shapes_on_the_device():
    # 8 new tokens after 500 cached, the graph's 8 splits of which 4 in use, and a shallow start
    _run(32, 8, 128, 8, 500, "int8", 8, 4, bn=0, seed=7)
    _run(32, 8, 128, 8, 12, "int8", 8, 1, bn=0, seed=8)
