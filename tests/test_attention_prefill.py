"""kvcache/attention_prefill.py: causal prefill attention under the simulator (or on the
device).

Tiny shapes (4 q heads, 2 kv heads, head_dim 32/64), int8 and f16 caches, n in
{1, 5, 17, 40} at start 0 and after a prefix, several key and row tiles, context splits
(even and uneven), group 4, the split heuristic at Qwen3-4B's shape, the refusals.
Sliding windows and rings are in test_attention_window.py, model shapes on a GPU in
test_attention_gpu.py.
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import make_pool, run_prefill
from genie_rt.kvcache.attention_prefill import (PrefillWorkspace, plan_prefill, prefill_attention,
                                                prefill_splits)


# ---- prefill: simulator -----------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(1, 0), (5, 9), (17, 0), (17, 9)])
def test_prefill_small(kv_dtype, n, start):
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=n)
    run_prefill(pool, kd, vd, 4, n, start)


@pytest.mark.parametrize("kv_dtype,hd,n,start,n_splits", [
    ("int8", 64, 5, 40, 3),     # short chunk after a long prefix, split over the context
    ("f16", 64, 17, 9, 2),
    ("int8", 32, 40, 0, 1),     # 80 packed rows: two row tiles, causal mask on 3 key tiles
    ("int8", 32, 13, 50, 4),    # uneven split: the last split has one tile
])
def test_prefill_tiles_and_splits(kv_dtype, hd, n, start, n_splits):
    # 16-key tiles so a 64-position pool has several
    pool, kd, vd = make_pool(2, hd, 64, kv_dtype, 64, seed=start)
    run_prefill(pool, kd, vd, 4, n, start, n_splits=n_splits, max_splits=4, bn=16)


@pytest.mark.parametrize("used", [0, 1, 2, 3, 9])
def test_prefill_split_count_from_the_device_state(used):
    """A bucket's graph launches the most splits any start needs and reads the count in use
    from the state: blocks above it exit, one split writes out directly (the merge returns),
    and a count outside 1 .. most is clamped - every case gives the reference."""
    pool, kd, vd = make_pool(2, 32, 64, "int8", 64, seed=used)
    run_prefill(pool, kd, vd, 4, 5, 40, n_splits=3, max_splits=4, bn=16, used=used)
    k = min(max(used, 1), 3)
    assert run_prefill.splits_written == ([] if k == 1 else list(range(k)))


def test_prefill_group_4():
    pool, kd, vd = make_pool(1, 32, 32, "int8", 32, seed=7)
    run_prefill(pool, kd, vd, 4, 7, 20, n_splits=2, max_splits=2, bn=16)


def test_prefill_splits_heuristic():
    plan = plan_prefill(32, 8, 128, "int8", n_max=512)
    assert prefill_splits(plan, 512, 0, sm_count=132) == 1
    assert prefill_splits(plan, 33, 0, sm_count=132) == 1            # one key tile
    assert prefill_splits(plan, 33, 4000, sm_count=132) == 6         # 24 blocks -> 144
    assert plan.workspace_bytes >= 8 * 512 * 32 * 130 * 4
    # the short prefill's graph (8 rows: 8 blocks) keeps 2 tiles a split where the others keep 4:
    # 8 tokens after 500 cached (508 keys, 16 tiles of 32) take 8 splits there, 4 elsewhere
    short = plan_prefill(32, 8, 128, "int8", n_max=8, max_splits=8)
    assert short.block_n == 32
    assert prefill_splits(short, 8, 500, sm_count=132) == 4
    assert prefill_splits(short, 8, 500, sm_count=132, short=True) == 8
    assert prefill_splits(short, 8, 40, sm_count=132, short=True) == 1        # 48 keys: one split of 2 tiles


def test_prefill_rejects_bad_arguments():
    pool, _, _ = make_pool(2, 64, 16, "int8", 4)
    plan = plan_prefill(4, 2, 64, "int8", n_max=4, max_splits=1)
    ws = PrefillWorkspace(plan)
    state = cuda.to_device(np.zeros(1, np.int32))
    q = cuda.device_array((4, 4, 64), np.float32)
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention(q, pool.layer(0), state, cuda.device_array((4, 64), np.float32), ws)
    with pytest.raises(ValueError, match="splits_at 1 is not a slot"):
        prefill_attention(q, pool.layer(0), state, cuda.device_array((4, 4 * 64), np.float32), ws,
                          splits_at=1)
    with pytest.raises(ValueError, match="n_splits"):
        prefill_attention(q, pool.layer(0), state, cuda.device_array((4, 256), np.float32), ws,
                          n_splits=2)
    with pytest.raises(ValueError, match="head_dim"):
        plan_prefill(4, 2, 512, "int8", 8)
