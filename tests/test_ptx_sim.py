"""The CUDA simulator's machinery that quant/ptx_sim.py and quant/sim_block.py install, on a
machine without a GPU (every test here is simulator-only; on a GPU machine they skip):

- the fallbacks report what would fail on hardware (misaligned or wrong-space accesses,
  divergent or partial warps, types numba rejects);
- the deadlock checks of a warp collective (a lane that exited, one in syncthreads, one not
  started yet, one being released);
- the event-driven thread block (quant/sim_block.py): barriers, threads that exit while
  others wait, syncthreads_count/and/or, an exception that aborts the block.
"""
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import ptx

SIM = ptx.SIMULATOR
sim_only = pytest.mark.skipif(not SIM, reason="checks a simulator-only behaviour")
pytestmark = sim_only
FULL = 0xFFFFFFFF


# ---- simulator-only: the fallbacks report what would fail on hardware -----------------
@cuda.jit
def k_ldg_misaligned(x, out):
    v = ptx.ldg_v4(x, 2)
    out[cuda.threadIdx.x] = v[0]


@cuda.jit
def k_cp_async_unaligned_shared(src, out):
    s = cuda.shared.array(64, np.float16)          # no alignment=16: only 2-byte aligned
    ptx.cp_async16(s, cuda.threadIdx.x * 8, src, cuda.threadIdx.x * 8)
    out[0] = s[0]


@cuda.jit
def k_lane_exits_before_shfl(x):
    if cuda.threadIdx.x == 3:
        return
    x[cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, x[cuda.threadIdx.x], 1)


@cuda.jit
def k_mma_partial_warp(out):
    r = ptx.mma_s8_s32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    out[cuda.threadIdx.x] = r[0]


@cuda.jit
def k_cp_async_swapped(src, out):
    s = cuda.shared.array(64, np.float16, alignment=16)
    ptx.cp_async16(src, cuda.threadIdx.x * 8, s, cuda.threadIdx.x * 8)   # dst/src swapped
    out[0] = s[0]


@cuda.jit
def k_ldmatrix_on_global(x, out):
    r = ptx.ldmatrix_x1(x, (cuda.threadIdx.x & 7) * 8)
    out[cuda.threadIdx.x] = r


@cuda.jit
def k_half_warp_masks(x, out):
    # each half-warp reduces with its own member mask, concurrently (legal on sm_70+)
    l = cuda.threadIdx.x & 31
    m = 0x0000FFFF if l < 16 else 0xFFFF0000
    v = x[cuda.threadIdx.x]
    for off in (8, 4, 2, 1):
        v += cuda.shfl_xor_sync(m, v, off)
    out[cuda.threadIdx.x] = v


@cuda.jit
def k_overlapping_masks(x):
    l = cuda.threadIdx.x & 31
    if l < 16:
        x[l] = cuda.shfl_xor_sync(0x0000FFFF, x[l], 1)
    else:
        x[l] = cuda.shfl_xor_sync(FULL, x[l], 1)


def test_sim_cp_async_rejects_swapped_state_spaces():
    with pytest.raises(RuntimeError, match="dst_smem must be a shared array"):
        k_cp_async_swapped[1, 8](np.zeros(64, np.float16), np.zeros(1, np.float16))


def test_sim_ldmatrix_rejects_global_memory():
    with pytest.raises(RuntimeError, match="smem must be a shared array"):
        k_ldmatrix_on_global[1, 32](np.zeros(64, np.float16), np.zeros(32, np.uint32))


def test_sim_disjoint_masks_run_concurrently_and_overlap_is_reported(monkeypatch):
    import genie_rt.quant.ptx_sim as mod
    monkeypatch.setattr(mod, "_SIM_STALL_CHECK_S", 0.3)
    x = np.arange(64, dtype=np.int32)
    out = np.zeros(64, np.int32)
    k_half_warp_masks[1, 64](x, out)
    np.testing.assert_array_equal(out, np.repeat(x.reshape(4, 16).sum(1), 16))
    # depending on thread timing: caught on arrival, or the half-warp is seen to have exited
    with pytest.raises(RuntimeError, match="divergent warp|exited without reaching"):
        k_overlapping_masks[1, 32](np.arange(32, dtype=np.int32))


def test_sim_ldg_v4_rejects_misaligned_index():
    with pytest.raises(RuntimeError, match="misaligned"):
        k_ldg_misaligned[1, 1](np.zeros(8, np.uint32), np.zeros(1, np.uint32))


def test_sim_cp_async_rejects_unaligned_shared_array():
    with pytest.raises(RuntimeError, match="alignment=16"):
        k_cp_async_unaligned_shared[1, 8](np.zeros(64, np.float16), np.zeros(1, np.float16))


def test_sim_lane_exiting_before_shuffle_is_reported(monkeypatch):
    import genie_rt.quant.ptx_sim as mod
    monkeypatch.setattr(mod, "_SIM_STALL_CHECK_S", 0.3)
    with pytest.raises(RuntimeError, match="lane 3 .* exited"):
        k_lane_exits_before_shfl[1, 32](np.arange(32, dtype=np.int32))


@cuda.jit
def k_half_warp_in_syncthreads(x):
    if cuda.threadIdx.x < 16:
        cuda.syncthreads()
    x[cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, x[cuda.threadIdx.x], 1)


def test_sim_lane_in_syncthreads_during_shuffle_is_reported(monkeypatch):
    import genie_rt.quant.ptx_sim as mod
    monkeypatch.setattr(mod, "_SIM_STALL_CHECK_S", 0.3)
    with pytest.raises(RuntimeError, match="waits in syncthreads"):
        k_half_warp_in_syncthreads[1, 32](np.arange(32, dtype=np.int32))


class _FakeLane(threading.Thread):
    """A live thread that _stall_check takes for a simulated lane of block `manager`."""
    def __init__(self, manager, lane, in_syncthreads, barriers_passed, stop):
        super().__init__(target=stop.wait, daemon=True)
        self._manager, self.thread_id = manager, lane
        self.syncthreads_blocked = in_syncthreads
        self._genie_barriers = barriers_passed


@pytest.mark.parametrize("late_lane_passed,deadlock", [(0, False), (1, True)])
def test_sim_stall_check_tells_a_lane_being_released_from_a_deadlock(late_lane_passed, deadlock):
    # CI 2026-12-01: lane 4 of a 1024-thread block still had its syncthreads flag up (the
    # simulator clears the flags one by one, seconds under a loaded GIL) while lane 27, past
    # that same barrier, waited 5 s for it in a shuffle: reported as a deadlock. A lane at
    # a barrier the waiter has passed is being released; one at a barrier the waiter has not
    # reached is deadlocked.
    import genie_rt.quant.ptx_sim as mod
    stop, manager = threading.Event(), object()
    waiter = _FakeLane(manager, 0, False, 1, stop)
    late = _FakeLane(manager, 1, True, late_lane_passed, stop)
    for t in (waiter, late):
        t.start()
    try:
        rnd = mod._Round("shfl_xor_sync", 0b11)
        rnd.arrived = 0b01
        if deadlock:
            with pytest.raises(RuntimeError, match="lane 1 .* waits in syncthreads"):
                mod._stall_check(waiter, rnd, 6.0)
        else:
            mod._stall_check(waiter, rnd, 6.0)
    finally:
        stop.set()


@pytest.mark.parametrize("exited", [False, True])
def test_sim_stall_check_tells_a_lane_not_started_yet_from_one_that_exited(exited):
    # Full run on a loaded 2-core machine, 2026-12-02: lane 23 of a 128-thread rope_write
    # block was "exited without reaching" a shuffle - it had not been started yet (the
    # simulator starts a block's threads one by one). Only a lane that ran to its end is
    # reported; a lane with no live thread that never finished is still to come.
    import genie_rt.quant.ptx_sim as mod
    stop, manager = threading.Event(), SimpleNamespace()
    waiter = _FakeLane(manager, 0, False, 0, stop)
    waiter.start()
    if exited:
        manager._genie_exited = {1}
    try:
        rnd = mod._Round("shfl_xor_sync", 0b11)
        rnd.arrived = 0b01
        if exited:
            with pytest.raises(RuntimeError, match="lane 1 .* exited"):
                mod._stall_check(waiter, rnd, 6.0)
        else:
            mod._stall_check(waiter, rnd, 6.0)
    finally:
        stop.set()


def test_sim_mma_needs_full_warp():
    with pytest.raises(RuntimeError, match="full warp"):
        k_mma_partial_warp[1, 48](np.zeros(48, np.int32))


def test_sim_shuffle_rejects_types_numba_rejects():
    @cuda.jit
    def k(x):
        x[cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, x[cuda.threadIdx.x], 1)
    with pytest.raises(TypeError, match="int32, int64, float32"):
        k[1, 32](np.zeros(32, np.uint32))




# ---- the event-driven block (quant/sim_block.py) ----------------------------------------
@cuda.jit
def k_barriers(x, out):
    """Each round every thread reads its neighbour's value of the round before: right only
    if the barrier holds every thread until all have written."""
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    sh = cuda.shared.array(256, np.int32)
    sh[t] = x[t]
    for _ in range(5):
        cuda.syncthreads()
        v = sh[(t + 1) % n]
        cuda.syncthreads()
        sh[t] = v + 1
    cuda.syncthreads()
    out[t] = sh[t]


@cuda.jit
def k_exit_then_barrier(out):
    """Threads 0..2 exit before the barriers the others wait at (the simulator, like hardware,
    counts a thread that has exited as arrived); the count is over the survivors."""
    t = cuda.threadIdx.x
    if t < 3:
        return
    cuda.syncthreads()
    out[t] = cuda.syncthreads_count(1)


@cuda.jit
def k_votes(out):
    t = cuda.threadIdx.x
    c = cuda.syncthreads_count(t % 3 == 0)
    a = cuda.syncthreads_and(t < 1000)
    o = cuda.syncthreads_or(t == 7)
    z = cuda.syncthreads_or(0)
    if t == 0:
        out[0], out[1], out[2], out[3] = c, a, o, z


@cuda.jit
def k_raises_while_others_wait(x):
    t = cuda.threadIdx.x
    if t == 5:
        x[1000] = 1                     # out of bounds: the simulator raises IndexError
    cuda.syncthreads()
    x[t] = cuda.shfl_xor_sync(FULL, x[t], 1)


def test_block_barriers_order_every_round():
    n = 96
    x = np.arange(n, dtype=np.int32)
    out = np.zeros(n, np.int32)
    k_barriers[2, n](x, out)
    np.testing.assert_array_equal(out, (np.arange(n) + 5) % n + 5)


def test_threads_that_exit_release_the_barrier_the_others_wait_at():
    out = np.full(64, -1, np.int32)
    k_exit_then_barrier[1, 64](out)
    assert (out[3:] == 61).all() and (out[:3] == -1).all()


def test_syncthreads_count_and_or():
    out = np.zeros(4, np.int32)
    k_votes[1, 100](out)
    assert out.tolist() == [34, 1, 1, 0]


def test_an_exception_aborts_the_block_and_leaves_no_thread():
    before = {t for t in threading.enumerate()}
    with pytest.raises(IndexError):
        k_raises_while_others_wait[1, 64](np.zeros(64, np.int32))
    deadline = __import__("time").monotonic() + 10
    while __import__("time").monotonic() < deadline:
        left = [t for t in threading.enumerate() if t not in before and getattr(t, "_manager", None) is not None]
        if not left:
            break
    assert not left, f"{len(left)} simulated threads still alive"
