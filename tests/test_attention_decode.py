"""kvcache/attention.py: decode attention under the simulator (or on the device).

Tiny shapes (4 q heads, 2 kv heads, head_dim 32/64, n_ctx <= 64), int8 and f16 caches,
one split and many (tiny tiles so a 64-position pool has several), group 4, the same
workspace replayed at growing positions as a captured graph does, the refusals, the
plan's defaults at Qwen3-4B's shape; the int8 -> float trick the device uses is exact.
Sliding windows and rings are in test_attention_window.py, model shapes on a GPU in
test_attention_gpu.py.
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import assert_close, byte_perm, make_pool, run_decode
from genie_rt.kvcache.attention import DecodeWorkspace, decode_attention, decode_reference, plan_decode


def test_int8_to_float_magic_is_exact():
    # what the device _byte computes (the simulator runs the plain version)
    from genie_rt.kvcache.attention_decode_kernels import MAGIC_I8
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    words[:256] = np.arange(256, dtype=np.uint32) * np.uint32(0x01010101)   # every byte value
    signed = words.view(np.int8).reshape(-1, 4).astype(np.float32)
    for b in range(4):
        bits = byte_perm(words ^ np.uint32(0x80808080), np.uint32(0x4B000000), 0x7440 | b)
        got = bits.view(np.float32) - MAGIC_I8
        assert np.array_equal(got, signed[:, b]), b


# ---- decode: simulator ------------------------------------------------------------------
# every test runs each way a block can walk its rows (attention_decode_tiles.py)
LOOPS = ("block", "warp", "warp-nopf")


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("pos", [0, 40])
def test_decode_one_split(kv_dtype, pos, loop):
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 48)
    plan = run_decode(pool, kd, vd, 4, pos, n_splits=1, loop=loop)
    assert plan.n_splits == 1 and plan.loop == loop


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kv_dtype,pos,n_splits", [
    ("int8", 5, 3), ("int8", 30, 3), ("int8", 63, 64), ("f16", 30, 3), ("f16", 63, 4)])
def test_decode_splits_merge(kv_dtype, pos, n_splits, loop):
    # tiny tiles (1 warp, 1 row per thread: 8 rows int8, 4 rows f16) so a 64-position
    # pool has many tiles; splits beyond the run-time context exit at once
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=pos)
    plan = run_decode(pool, kd, vd, 4, pos, n_splits=n_splits, warps=1, rows_per_thread=1, loop=loop)
    assert plan.n_splits == min(n_splits, 64 // plan.tile)
    tiles = pos // plan.tile + 1                         # the splits with tiles wrote partials
    tps = -(-tiles // plan.n_splits)
    active = -(-tiles // tps)
    assert run_decode.splits_written == ([] if active == 1 else list(range(active)))


@pytest.mark.parametrize("loop", LOOPS)
def test_decode_head_dim_32_and_group_4(loop):
    pool, kd, vd = make_pool(1, 32, 32, "int8", 32)
    run_decode(pool, kd, vd, 4, 31, n_splits=2, warps=1, rows_per_thread=2, loop=loop)


@pytest.mark.parametrize("loop", ["warp", "warp-nopf"])
@pytest.mark.parametrize("kv_dtype,pos", [("int8", 37), ("f16", 50), ("int8", 2)])
def test_decode_warp_loop_slots_and_warps_without_rows(kv_dtype, pos, loop):
    # two warps, two rows a lane, several trips a split: at pos 2 most lane slots and one warp
    # see no valid row (their max stays -inf and must weigh 0, not NaN); at 37 / 50 the last
    # trip of a split is part-filled and the early loads of the next trip run past the split
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=pos + 1)
    run_decode(pool, kd, vd, 4, pos, n_splits=2, warps=2, rows_per_thread=2, loop=loop)


def test_decode_loop_is_checked():
    with pytest.raises(ValueError, match="loop 'fast' is not one of"):
        plan_decode(4, 2, 64, "int8", 64, loop="fast")


@pytest.mark.parametrize("kv_dtype,pos,n_splits,gh,loop", [
    ("int8", 40, 1, 2, "block"),          # one split: the block writes out (and its q8) itself
    ("int8", 63, 4, 1, "block"),          # the merge block writes them
    ("f16", 30, 3, 2, "block"),
    ("f16", 29, 2, 1, "block"),
    ("int8", 40, 1, 2, "warp"),
    ("f16", 29, 2, 1, "warp")])
def test_decode_q8_output_is_quantize_q8_of_out(kv_dtype, pos, n_splits, gh, loop):
    # xq / xs written by the attention launch: bit for bit what quantize_q8 makes of out,
    # and out itself the same bits as without them
    from genie_rt.quant import gemv
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=pos)
    plan = plan_decode(4, 2, 64, kv_dtype, 64, n_splits=n_splits, warps=1, rows_per_thread=1,
                       heads_per_block=gh, loop=loop)
    ws = DecodeWorkspace(plan)
    q = cuda.to_device(np.random.default_rng(pos).standard_normal((4, 64)).astype(np.float32))
    state = cuda.to_device(np.array([pos], np.int32))
    out, out2 = (cuda.device_array(4 * 64, np.float32) for _ in range(2))
    xq = cuda.to_device(np.full(4 * 64, 99, np.int8))
    xs = cuda.to_device(np.full(4 * 64 // 8, np.nan, np.float32))
    decode_attention(q, pool.layer(0), state, out, ws, xq=xq, xs=xs)
    decode_attention(q, pool.layer(0), state, out2, ws)
    rq, rs = cuda.device_array((1, 4 * 64), np.int8), cuda.device_array((1, 4 * 64 // 8), np.float32)
    gemv.quantize_q8(out2.reshape(1, 4 * 64), rq, rs)
    assert np.array_equal(out.copy_to_host().view(np.int32), out2.copy_to_host().view(np.int32))
    assert np.array_equal(xq.copy_to_host(), rq.copy_to_host()[0])
    assert np.array_equal(xs.copy_to_host().view(np.int32), rs.copy_to_host()[0].view(np.int32))
    assert not ws.tickets.copy_to_host().any()
    ref = decode_reference(q.copy_to_host(), kd[0], vd[0], pos)
    assert_close(out.copy_to_host(), ref, 2e-5 * np.abs(vd[0]).max(), 1e-5, "out")
    with pytest.raises(ValueError, match="both xq and xs"):
        decode_attention(q, pool.layer(0), state, out, ws, xq=xq)
    with pytest.raises(ValueError, match="xq must be int8"):
        decode_attention(q, pool.layer(0), state, out, ws, xq=xs, xs=xs)


def test_decode_graph_style_replay_reuses_workspace():
    # the same workspace and launch at growing positions (what a replayed graph does)
    pool, kd, vd = make_pool(2, 64, 64, "int8", 64, seed=5)
    plan = plan_decode(4, 2, 64, "int8", 64, n_splits=3, warps=1, rows_per_thread=1)
    ws = DecodeWorkspace(plan)
    q = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    qd = cuda.to_device(q)
    out = cuda.device_array(4 * 64, np.float32)
    state = cuda.to_device(np.zeros(1, np.int32))
    for pos in (3, 21, 63):
        state.copy_to_device(np.array([pos], np.int32))
        decode_attention(qd, pool.layer(0), state, out, ws)
        ref = decode_reference(q, kd[0], vd[0], pos)
        assert_close(out.copy_to_host(), ref, 2e-5 * np.abs(vd[0]).max(), 1e-5, f"pos {pos}")


def test_decode_rejects_mismatched_cache():
    pool, _, _ = make_pool(2, 64, 16, "f16", 4)
    plan = plan_decode(4, 2, 64, "int8", 16)
    with pytest.raises(ValueError, match="cache dtype"):
        decode_attention(cuda.device_array(256, np.float32), pool.layer(0),
                         cuda.to_device(np.zeros(1, np.int32)), cuda.device_array(256, np.float32),
                         DecodeWorkspace(plan))
    with pytest.raises(ValueError, match="not a multiple"):
        plan_decode(6, 4, 64, "int8", 16)


def test_plan_decode_defaults():
    # two query heads a block by default (DEFAULT_HEADS_PER_BLOCK): Qwen3-4B's group of 4 in
    # two subgroups; blocks of 8 warps x 2 rows (default_shape: the 64-row tile of 4 x 4), 2 an
    # SM at 126 registers -> 16 splits; 4 x 4 (168 registers) would take 3 an SM: 24
    p = plan_decode(32, 8, 128, "int8", 4096, sm_count=132)
    assert (p.tile, p.n_sub, p.heads_per_block, p.warps, p.rows_per_thread) == (64, 2, 2, 8, 2)
    assert p.n_splits == 16 and p.workspace_bytes >= 16 * 32 * 130 * 4
    assert plan_decode(32, 8, 128, "int8", 4096, sm_count=132, warps=4, rows_per_thread=4).n_splits == 24
    p = plan_decode(64, 8, 128, "int8", 40960, sm_count=132)       # group 8: four subgroups
    assert (p.n_sub, p.heads_per_block) == (4, 2)
    p = plan_decode(64, 8, 128, "f16", 100, sm_count=132)
    assert (p.n_sub, p.heads_per_block, p.tile) == (4, 2, 32) and p.n_splits == 4
    assert plan_decode(9, 3, 64, "int8", 100).heads_per_block == 1        # odd group: 1 divides it
    # asked for: every head of the group that fits in registers (the plan before 2026-12-03)
    p = plan_decode(32, 8, 128, "int8", 4096, sm_count=132, heads_per_block=4)
    assert (p.tile, p.n_sub, p.heads_per_block, p.n_splits, p.warps) == (64, 1, 4, 33, 4)
    p = plan_decode(64, 8, 128, "f16", 100, sm_count=132, heads_per_block=8)
    assert (p.n_sub, p.heads_per_block, p.tile) == (1, 8, 32) and p.n_splits == 4
    for bad in (0, 3, 8):                # 3 does not divide 4; 8 > the group and > int8's 4
        with pytest.raises(ValueError, match="heads_per_block"):
            plan_decode(32, 8, 128, "int8", 4096, heads_per_block=bad)


@pytest.mark.parametrize("kv_dtype,pos,n_splits", [("int8", 37, 2), ("int8", 5, 1), ("f16", 50, 3)])
def test_decode_pdl_build_of_the_warp_loop_gives_the_plain_bits(kv_dtype, pos, n_splits):
    # the PDL build of the "warp" loop loads the first trip's rows of earlier positions before its
    # wait and the trip holding the new row again after it (griddepcontrol is a no-op here, the
    # PTX side is tests/test_pdl_ptx.py): the plain build's bits, splits with and without the row
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=pos)
    plan = plan_decode(4, 2, 64, kv_dtype, 64, n_splits=n_splits, warps=2, rows_per_thread=2, loop="warp")
    ws = DecodeWorkspace(plan)
    q = cuda.to_device(np.random.default_rng(pos).standard_normal((4, 64)).astype(np.float32))
    state = cuda.to_device(np.array([pos], np.int32))
    outs = []
    for pdl in (False, True):
        out = cuda.device_array(4 * 64, np.float32)
        decode_attention(q, pool.layer(0), state, out, ws, pdl=pdl)
        outs.append(out.copy_to_host())
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    ref = decode_reference(q.copy_to_host(), kd[0], vd[0], pos)
    assert_close(outs[1], ref, 2e-5 * np.abs(vd[0]).max(), 1e-5, "pdl build")


def _knob_keeps_the_bits(monkeypatch, knob, n_ctx, pos, n_splits, warps, loop, pdl=False, on=True,
                         tol=(2e-5, 1e-5)):
    """The decode output with kvcache/attention.py's `knob` off and `on` (each build compiled anew):
    the same bits, and within the float64 reference's bound (tol: atol / max |v|, rtol)."""
    import genie_rt.kvcache.attention as A
    pool, kd, vd = make_pool(2, 64, n_ctx, "int8", n_ctx, seed=pos)
    plan = plan_decode(4, 2, 64, "int8", n_ctx, n_splits=n_splits, warps=warps, rows_per_thread=1, loop=loop)
    ws = DecodeWorkspace(plan)
    q = cuda.to_device(np.random.default_rng(pos).standard_normal((4, 64)).astype(np.float32))
    state = cuda.to_device(np.array([pos], np.int32))
    outs = []
    for value in (False, on):
        monkeypatch.setattr(A, knob, value)
        out = cuda.device_array(4 * 64, np.float32)
        decode_attention(q, pool.layer(0), state, out, ws, pdl=pdl)
        outs.append(out.copy_to_host())
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    assert_close(outs[1], decode_reference(q.copy_to_host(), kd[0], vd[0], pos),
                 tol[0] * np.abs(vd[0]).max(), tol[1], knob)


@pytest.mark.parametrize("pos,n_splits", [(100, 20), pytest.param(127, 20, marks=pytest.mark.slow),
                                           pytest.param(300, 20, marks=pytest.mark.slow), (40, 3)])
def test_decode_merge_prefetch_gives_the_same_bits(monkeypatch, pos, n_splits):
    # MERGE_PREFETCH: the merging thread's first MERGE_PF (16) partials are loaded with the
    # splits' (max, sum) and summed in the same order - 7 active splits (a group of four and
    # three more), 8 (two groups), 19 (past the prefetched 16), 3 (no whole group)
    _knob_keeps_the_bits(monkeypatch, "MERGE_PREFETCH", 512, pos, n_splits, 2, "warp")


def test_decode_merge_prefetch_for_the_mma_loop_alone(monkeypatch):
    # MERGE_PREFETCH = "mma": the long graph's tensor-core plan merges with the prefetch (the same
    # bits as without: 19 splits busy, past the 16 prefetched), and a warp-loop plan builds without it
    import genie_rt.kvcache.attention as A
    _knob_keeps_the_bits(monkeypatch, "MERGE_PREFETCH", 512, 300, 20, 1, "mma", on="mma", tol=(2e-4, 1e-4))
    built = []
    monkeypatch.setattr(A, "decode_kernel", lambda *a: built.append(a[13]))
    for loop in ("mma", "warp", "block"):
        plan_decode(4, 2, 64, "int8", 512, n_splits=2, warps=2, rows_per_thread=1, loop=loop).kernel()
    assert built == [True, False, False]


@pytest.mark.parametrize("loop,pos,pdl", [("warp", 63, False), ("warp-nopf", 40, False), ("warp", 50, True)])
def test_decode_skip_rescale_gives_the_same_bits(monkeypatch, loop, pos, pdl):
    # SKIP_RESCALE: a head's accumulators are multiplied by alpha only when some lane's max grew
    # (a warp vote) - one warp walks several trips of 8 rows, the max grows in some and not in others
    _knob_keeps_the_bits(monkeypatch, "SKIP_RESCALE", 64, pos, 1, 1, loop, pdl)


@pytest.mark.parametrize("loop,pos,n_splits,hd,gh", [
    ("warp", 40, 3, 64, 2), ("block", 63, 4, 64, 4), ("warp-nopf", 17, 1, 32, 1), ("warp", 5, 2, 128, 2)])
def test_decode_qk8_scores_by_dp4a_with_q_quantized_per_lane_slice(monkeypatch, loop, pos, n_splits, hd, gh):
    # QK_DP4A (decode_kernel's qk8, a lab knob): each lane's 16 q values of a head become int8 with
    # their own scale; the output is the float reference's for that q (q8_slices_reference) within
    # the usual bound - and measurably not the float q's
    import math

    import genie_rt.kvcache.attention as A
    from genie_rt.kvcache.attention_decode_kernels import LOG2E
    from genie_rt.kvcache.attention_decode_tiles import q8_slices_reference
    monkeypatch.setattr(A, "QK_DP4A", True)
    pool, kd, vd = make_pool(2, hd, 64, "int8", 64, seed=pos)
    plan = plan_decode(8, 2, hd, "int8", 64, n_splits=n_splits, warps=2, rows_per_thread=2, loop=loop,
                       heads_per_block=gh)
    q = np.random.default_rng(pos).standard_normal((8, hd)).astype(np.float32) * 2
    out = cuda.device_array(8 * hd, np.float32)
    decode_attention(cuda.to_device(q), pool.layer(0), cuda.to_device(np.array([pos], np.int32)), out,
                     DecodeWorkspace(plan))
    got = out.copy_to_host()
    q_eff = q8_slices_reference(q, np.float32(LOG2E / math.sqrt(hd)))
    atol = 2e-5 * np.abs(vd[0]).max()
    assert_close(got, decode_reference(q_eff, kd[0], vd[0], pos), atol, 1e-5, "qk8")
    assert np.abs(got - decode_reference(q, kd[0], vd[0], pos).ravel()).max() > 10 * atol


# ---- the PDL build's early loads never touch the new row before the wait ----------------------
class _Watch:
    """Stand-ins for quant/pdl.hooks under the simulator (each simulated thread is a Python thread):
    `wait` marks the thread as past its wait; `ld4` records a load of the watched slot (the new
    position's) by a thread that has not waited, and hands it garbage, as an unwritten row would;
    the loads of that slot after the wait are recorded in `late`."""
    def __init__(self):
        import threading
        self.local, self.early, self.late, self.slot, self.words = threading.local(), [], [], -1, 1
        watch = self

        def wait():
            watch.local.waited = True

        def ld4(a, i):
            if i // watch.words == watch.slot:
                if not getattr(watch.local, "waited", False):
                    watch.early.append(i)
                    return (np.uint32(0x7F7F7F7F),) * 4
                watch.late.append(i)            # after the wait (list.append: thread-safe)
            return (a[i], a[i + 1], a[i + 2], a[i + 3])
        self.wait, self.ld4 = wait, ld4


@pytest.fixture
def watch(monkeypatch):
    import genie_rt.kvcache.attention_decode_kernels as ADK
    w = _Watch()
    no_op = lambda: None   # noqa: E731
    monkeypatch.setattr(ADK, "hooks", lambda pdl: (w.wait, no_op, w.ld4) if pdl else (no_op, no_op, w.ld4))
    ADK.decode_kernel.cache_clear()
    yield w
    ADK.decode_kernel.cache_clear()


@pytest.mark.parametrize("kv_dtype,pos,n_splits", [("int8", 5, 1), ("f16", 17, 2), ("int8", 63, 4)])
def test_decode_pdl_warp_loop_reads_the_new_row_only_after_its_wait(watch, kv_dtype, pos, n_splits):
    # a load of the new position's row before the wait would read what rope_write has not
    # written yet: here it is recorded and answered with garbage, so the result is wrong too
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=pos)
    plan = plan_decode(4, 2, 64, kv_dtype, 64, n_splits=n_splits, warps=2, rows_per_thread=2, loop="warp")
    watch.slot, watch.words = pos, 2 * 64 // (4 if kv_dtype == "int8" else 2)
    q = np.random.default_rng(pos).standard_normal((4, 64)).astype(np.float32)
    out = cuda.device_array(4 * 64, np.float32)
    decode_attention(cuda.to_device(q), pool.layer(0), cuda.to_device(np.array([pos], np.int32)), out,
                     DecodeWorkspace(plan), pdl=True)
    assert not watch.early, f"{len(watch.early)} loads of the new row before the wait"
    assert_close(out.copy_to_host(), decode_reference(q, kd[0], vd[0], pos), 2e-5 * np.abs(vd[0]).max(),
                 1e-5, "pdl build")
