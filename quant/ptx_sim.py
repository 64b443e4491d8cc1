"""The CUDA simulator's missing warp machinery, installed when this module is imported
(quant/ptx.py imports it, through ptx_fallbacks.py, only under NUMBA_ENABLE_CUDASIM=1):

- a warp exchange (`_warp_collective`): the lanes of one warp meet, the last to arrive
  computes the collective's result for all, each lane takes its part; waits only for its
  own warp, reports divergent masks, lanes that exited or wait in syncthreads (deadlock)
  and lanes that never arrive (`_stall_check`, every `_SIM_STALL_CHECK_S` seconds);
- `cuda.shfl_sync` / `_up` / `_down` / `_xor`, `ballot_sync`, `all_sync`, `any_sync`,
  `eq_sync`, `activemask`, `lanemask_lt` on the simulator's `FakeCUDAModule`;
- `cuda.shared.array` / `cuda.local.array` with `alignment=` (without it a shared array is
  only dtype-aligned, as PTX guarantees, so a misaligned 16-byte access fails here too);
- memory helpers for the fallbacks: which state space an array lives in, the 16 bytes at
  an element with the hardware's alignment check.


The simulator's BlockThread.syncthreads and .run are wrapped once to count barriers and
record finished threads (what the stall check reads). Nothing here is used on a GPU.
"""
import sys
import threading
import time
import weakref

import numpy as np
from numba.cuda.simulator import kernel as _sim_kernel
from numba.cuda.simulator import kernelapi as _kernelapi
from numba.cuda.simulator.cudadrv import devicearray as _sim_devicearray

from . import sim_block  # noqa: F401  (installs the event-driven block before the wrappers below)

# The first lane to wait in a warp collective checks for deadlock after this many seconds
# (a lane of its warp exited, or waits in syncthreads), then again every second. Only that
# one lane checks, and the others wake only every _SIM_IDLE_WAKE_S (to see an abort): with
# every waiting lane of a 1024-thread block polling, the wake-ups and the checks' thread
# scans starved the lanes still working (CI 2026-12-03: a shuffle "did not arrive in 600 s").
_SIM_STALL_CHECK_S = 5.0
_SIM_IDLE_WAKE_S = 1.0
# A collective whose block has made no progress (no collective completed, no barrier passed)
# for this long raises: a lane spins or waits on something that never comes.
_SIM_NO_PROGRESS_S = 600.0
# ... and one that has waited this long raises whatever the block does (a warp that spins on
# collectives while waiting for a deadlocked one would otherwise look like progress forever).
_SIM_WAIT_CAP_S = 1800.0
_FULL_MASK = 0xFFFFFFFF
_create_lock = threading.Lock()


class _Round:
    """One execution of a warp collective: the lanes' inputs, then everyone's outputs."""
    __slots__ = ("name", "mask", "arrived", "values", "result", "error", "done")

    def __init__(self, name, mask):
        self.name, self.mask, self.arrived = name, mask, 0
        self.values = [None] * 32
        self.result = self.error = None
        self.done = False


class _Warp:
    __slots__ = ("cond", "lane_bits", "open")

    def __init__(self, nlanes):
        self.cond = threading.Condition()
        self.lane_bits = (1 << nlanes) - 1   # lanes that exist (last warp may be partial)
        self.open = {}                      # member mask -> _Round being gathered


def _sim_thread():
    th = threading.current_thread()
    if not hasattr(th, "_manager") or not hasattr(th, "thread_id"):
        raise RuntimeError("genie_rt.quant.ptx: simulator fallbacks can only be called "
                           "from inside a kernel run by the CUDA simulator")
    return th


def _warp_of(th):
    """The _Warp of this thread. Exchange state hangs off the simulator's BlockManager,
    which exists once per block per launch: no key can collide across launches or blocks,
    and it is freed with the block."""
    mgr = th._manager
    warps = getattr(mgr, "_genie_ptx_warps", None)
    if warps is None:
        with _create_lock:
            warps = getattr(mgr, "_genie_ptx_warps", None)
            if warps is None:
                nthreads = int(np.prod(mgr._block_dim))
                warps = [_Warp(min(32, nthreads - 32 * w)) for w in range((nthreads + 31) // 32)]
                mgr._genie_ptx_warps = warps
    return warps[th.thread_id >> 5]


# Barriers each simulated thread has passed, counted by a wrapper around the simulator's
# BlockThread.syncthreads (syncthreads_count/and/or call it too).
def _barriers(th):
    return getattr(th, "_genie_barriers", 0)


if not getattr(_sim_kernel.BlockThread.syncthreads, "_genie_counted", False):
    _sim_syncthreads = _sim_kernel.BlockThread.syncthreads

    def _counted_syncthreads(self):
        _sim_syncthreads(self)
        self._genie_barriers = _barriers(self) + 1
        _progress(self._manager)

    _counted_syncthreads._genie_counted = True
    _sim_kernel.BlockThread.syncthreads = _counted_syncthreads


# Threads of a block that have finished, recorded by a wrapper around BlockThread.run.
# The simulator starts a block's threads one by one, so under a loaded GIL a lane can be
# missing from threading.enumerate() because it has not started yet: only a lane that
# has run to its end can never arrive.
if not getattr(_sim_kernel.BlockThread.run, "_genie_counted", False):
    _sim_run = _sim_kernel.BlockThread.run

    def _recorded_run(self):
        try:
            _sim_run(self)
        finally:
            with _create_lock:
                done = getattr(self._manager, "_genie_exited", None)
                if done is None:
                    done = self._manager._genie_exited = set()
                done.add(self.thread_id)

    _recorded_run._genie_counted = True
    _sim_kernel.BlockThread.run = _recorded_run


def _progress(mgr):
    """Count one step of a block (a collective completed, a barrier passed); races between
    threads may lose a count, which only matters if every step is lost."""
    mgr._genie_progress = getattr(mgr, "_genie_progress", 0) + 1


def _stall_check(th, rnd, waited_s):
    """Raise if a lane that this collective waits for can never arrive."""
    missing = rnd.mask & ~rnd.arrived
    warp_base = th.thread_id & ~31
    alive = {t.thread_id: t for t in threading.enumerate()
             if getattr(t, "_manager", None) is th._manager}
    exited = getattr(th._manager, "_genie_exited", ())
    for lane in range(32):
        if not (missing >> lane) & 1:
            continue
        t = alive.get(warp_base + lane)
        if t is None and warp_base + lane not in exited:
            continue                 # not started yet: the simulator is still creating threads
        if t is None:
            raise RuntimeError(
                f"{rnd.name}: lane {lane} of warp {th.thread_id >> 5} (mask {rnd.mask:#010x}) "
                f"exited without reaching it; all lanes named in the mask must execute "
                f"warp-synchronous instructions (hangs or is undefined on hardware)")
        # A lane whose flag is up at a barrier this lane has already passed is being
        # released, not deadlocked (numba's own BlockManager cleared the flags one thread at
        # a time, seconds under a loaded GIL; quant/sim_block.py clears them under its lock,
        # but the check stays correct for either).
        if t.syncthreads_blocked and _barriers(t) >= _barriers(th):
            raise RuntimeError(
                f"{rnd.name}: lane {lane} of warp {th.thread_id >> 5} waits in syncthreads "
                f"while other lanes wait in {rnd.name}: divergent warp (deadlock)")
    if waited_s > _SIM_NO_PROGRESS_S:
        raise RuntimeError(f"{rnd.name}: lanes {missing:#010x} did not arrive, and the block made "
                           f"no progress, in {_SIM_NO_PROGRESS_S:.0f} s")


def _warp_collective(name, mask, value, combine):
    """Gather `value` from every lane in `mask`, run combine(values, mask) once (in the
    last lane to arrive), return element [lane] of its result to each lane.

    Waits only for the lanes of this warp (not a block-wide syncthreads), so other warps
    can be anywhere, including in syncthreads."""
    th = _sim_thread()
    warp = _warp_of(th)
    lane = th.thread_id & 31
    mask = int(mask) & _FULL_MASK & warp.lane_bits
    if not (mask >> lane) & 1:
        raise RuntimeError(f"{name}: lane {lane} is not in its own member mask {mask:#010x}")
    with warp.cond:
        # Disjoint groups of lanes (e.g. the two half-warps, each with its own mask) may
        # run collectives at the same time; overlapping masks mean a divergent warp.
        rnd = warp.open.get(mask)
        if rnd is None:
            for other in warp.open.values():
                if other.mask & mask:
                    raise RuntimeError(
                        f"warp {th.thread_id >> 5}: lane {lane} calls {name} with mask "
                        f"{mask:#010x} while lanes {other.arrived:#010x} wait in {other.name} "
                        f"with mask {other.mask:#010x}: divergent warp")
            rnd = warp.open[mask] = _Round(name, mask)
        elif rnd.name != name:
            raise RuntimeError(
                f"warp {th.thread_id >> 5}: lane {lane} calls {name} while lanes "
                f"{rnd.arrived:#010x} wait in {rnd.name} (mask {mask:#010x}): divergent warp")
        rnd.values[lane] = value
        rnd.arrived |= 1 << lane
        if rnd.arrived == rnd.mask:
            del warp.open[mask]
            _progress(th._manager)
            try:
                rnd.result = combine(rnd.values, rnd.mask)
            except BaseException as e:  # hand the error to every lane
                rnd.error = e
            rnd.done = True
            warp.cond.notify_all()
        else:
            checker = rnd.arrived == 1 << lane      # the first lane to wait checks for deadlock
            mgr = th._manager
            start = time.monotonic()
            next_check = _SIM_STALL_CHECK_S
            seen, seen_at = getattr(mgr, "_genie_progress", 0), start
            while not rnd.done:
                warp.cond.wait(0.25 if checker else _SIM_IDLE_WAKE_S)
                if th.abort:
                    raise RuntimeError("aborted: another simulated thread raised")
                if not checker or rnd.done:
                    continue
                now = time.monotonic()
                if now - start > next_check:
                    progress = getattr(mgr, "_genie_progress", 0)
                    if progress != seen:
                        seen, seen_at = progress, now
                    _stall_check(th, rnd, now - seen_at)
                    if now - start > _SIM_WAIT_CAP_S:
                        raise RuntimeError(f"{name}: lanes {rnd.mask & ~rnd.arrived:#010x} did not arrive "
                                           f"in {_SIM_WAIT_CAP_S:.0f} s")
                    next_check = now - start + 1.0
    if rnd.error is not None:
        raise RuntimeError(f"{name} failed in lane {lane}: {rnd.error!r}") from rnd.error
    return rnd.result[lane]


def _full_warp(name):
    th = _sim_thread()
    if _warp_of(th).lane_bits != _FULL_MASK:
        raise RuntimeError(f"{name} needs a full warp of 32 threads; this block has "
                           f"blockDim not a multiple of 32")


# ---- warp shuffles and votes, installed on the simulator's cuda module ---------
_SHFL_OK = (np.int32, np.int64, np.float32, np.float64)


def _check_shfl_value(name, value):
    # numba types Python int as int64 and float as float64; like the real intrinsic,
    # refuse other widths (unsigned, 8/16-bit, bool) so a kernel fails here, not on GPU.
    if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, np.generic) and not isinstance(value, _SHFL_OK)):
        raise TypeError(f"{name}: numba's shfl_*_sync only supports int32, int64, float32 "
                        f"and float64 values, got {type(value).__name__}")


def _shfl_src(mode, lane, b, c):
    """Source lane of shfl.sync (PTX ISA pseudo-code); returns `lane` when out of range."""
    b = int(b) & 0xFFFFFFFF
    segmask = (c >> 8) & 0x1F
    min_lane = lane & segmask
    max_lane = min_lane | (c & 0x1F & ~segmask)
    if mode == "up":
        j = lane - b
        ok = j >= max_lane
    elif mode == "down":
        j = lane + b
        ok = j <= max_lane
    elif mode == "bfly":
        j = lane ^ b
        ok = j <= max_lane
    else:  # idx
        j = min_lane | (b & 0x1F & ~segmask)
        ok = j <= max_lane
    return j if ok else lane


def _make_shfl(name, mode, c):
    def shfl(self, mask, value, b):
        _check_shfl_value(name, value)

        def combine(values, m):
            # values[l] = (value, b) of lane l; a source lane that is not in the mask or
            # does not exist is undefined on hardware: the lane gets its own value.
            out = [None] * 32
            for lane in range(32):
                if (m >> lane) & 1:
                    v, bl = values[lane]
                    src = _shfl_src(mode, lane, bl, c)
                    out[lane] = values[src][0] if (m >> src) & 1 else v
            return out
        return _warp_collective(name, mask, (value, b), combine)
    shfl.__name__ = name
    return shfl


def _vote(name, reduce, rtype):
    def vote(self, mask, predicate):
        def combine(values, m):
            r = rtype(reduce(values, m))
            return [r] * 32
        return _warp_collective(name, mask, predicate, combine)
    vote.__name__ = name
    return vote


def _ballot(values, m):
    return sum(1 << lane for lane in range(32) if (m >> lane) & 1 and values[lane])


# numba-cuda 0.30 types ballot_sync as int32, all/any/eq_sync as bool, activemask and
# lanemask_lt as uint32: return the same types here.
def _as_i32(bits):
    return np.uint32(bits).view(np.int32)


def _activemask(self):
    # The simulator cannot see divergence: every existing lane counts as active.
    return np.uint32(_warp_of(_sim_thread()).lane_bits)


def _lanemask_lt(self):
    return np.uint32((1 << (_sim_thread().thread_id & 31)) - 1)


_fake = _kernelapi.FakeCUDAModule
_fake.shfl_sync = _make_shfl("shfl_sync", "idx", 0x1F)
_fake.shfl_up_sync = _make_shfl("shfl_up_sync", "up", 0)
_fake.shfl_down_sync = _make_shfl("shfl_down_sync", "down", 0x1F)
_fake.shfl_xor_sync = _make_shfl("shfl_xor_sync", "bfly", 0x1F)
_fake.ballot_sync = _vote("ballot_sync", _ballot, _as_i32)
_fake.all_sync = _vote("all_sync", lambda v, m: _ballot(v, m) == m, bool)
_fake.any_sync = _vote("any_sync", lambda v, m: _ballot(v, m) != 0, bool)
_fake.eq_sync = _vote("eq_sync", lambda v, m: _ballot(v, m) in (0, m), bool)
_fake.activemask = _activemask
_fake.lanemask_lt = _lanemask_lt


# ---- cuda.shared.array / cuda.local.array with alignment= ----------------------
def _aligned_empty(shape, dtype, align, misalign=0):
    """np.empty whose data address is == misalign (mod align)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(nbytes + 2 * align, np.uint8)
    off = (misalign - buf.ctypes.data) % align
    return buf[off:off + nbytes].view(dtype).reshape(shape)


def _as_np_dtype(dtype):
    from numba.cuda import types as _types
    from numba.cuda.np import numpy_support
    return numpy_support.as_dtype(dtype) if isinstance(dtype, _types.Type) else np.dtype(dtype)


_shared_lock = threading.Lock()


def _shared_array(self, shape, dtype, alignment=None):
    """FakeCUDAShared.array that accepts alignment=. Without it, the array is placed at an
    address that is only dtype-aligned (what PTX guarantees: `.shared .align <itemsize>`),
    so a 16-byte ldmatrix/cp.async on an unaligned tile fails here, not on the GPU."""
    dtype = _as_np_dtype(dtype)
    if shape == 0:  # dynamic shared memory: one buffer, 16-byte aligned
        _register_shared(self._dynshared)
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)  # one allocation per source line
    with _shared_lock:  # the threads of a block race to allocate: all must get one array
        res = self._allocations.get(caller)
        if res is None:
            if alignment is None:
                misalign = dtype.itemsize if dtype.itemsize < 16 else 0
                res = _aligned_empty(shape, dtype, 16, misalign)
            else:
                res = _aligned_empty(shape, dtype, max(int(alignment), dtype.itemsize))
            _register_shared(res)
            self._allocations[caller] = res
    return res


def _local_array(self, shape, dtype, alignment=None):
    dtype = _as_np_dtype(dtype)
    return _aligned_empty(shape, dtype, max(int(alignment or 1), dtype.itemsize, 16))


_kernelapi.FakeCUDAShared.array = _shared_array
_kernelapi.FakeCUDALocal.array = _local_array


# ---- memory helpers ------------------------------------------------------------
def _np(arr):
    """The numpy array behind a simulator kernel argument or shared/local array."""
    if isinstance(arr, _sim_devicearray.FakeWithinKernelCUDAArray):
        arr = arr.__dict__["_item"]
    if isinstance(arr, _sim_devicearray.FakeCUDAArray):
        arr = arr._ary
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"expected an array, got {type(arr).__name__}")
    return arr


_shared_ids = set()   # id() of the root buffers of simulated shared memory


def _root(a):
    while True:
        b = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
        if b is None:
            return a
        a = b


def _register_shared(arr):
    root = _root(arr)
    if id(root) not in _shared_ids:
        _shared_ids.add(id(root))
        weakref.finalize(root, _shared_ids.discard, id(root))


def _is_shared(a):
    """True if `a` is a numpy array viewing simulated shared memory (static or dynamic)."""
    return isinstance(a, np.ndarray) and id(_root(a)) in _shared_ids


def _check_space(name, what, arr, shared):
    # In the simulator, global memory reaches a kernel wrapped (FakeWithinKernelCUDAArray,
    # slices and views stay wrapped); shared and local arrays are plain numpy arrays.
    is_global = not isinstance(arr, np.ndarray)
    if (_is_shared(arr) if shared else is_global):
        return
    raise RuntimeError(f"{name}: {what} must be a {'shared' if shared else 'global'} array "
                       f"(cuda.shared.array / a kernel argument); the instruction addresses "
                       f"the .{'shared' if shared else 'global'} state space")


def _bytes_at(name, arr, idx, nbytes=16, align=16):
    """Writable uint8 view of the nbytes starting at &arr[idx], checked like hardware:
    address aligned to `align`, and (stricter) inside the array."""
    a = _np(arr)
    if not a.flags.c_contiguous:
        raise NotImplementedError(f"{name}: the simulator fallback needs a C-contiguous array")
    if isinstance(idx, tuple):
        if len(idx) != a.ndim:
            raise IndexError(f"{name}: index {idx} for a {a.ndim}-d array")
        if any(int(i) < 0 or int(i) >= n for i, n in zip(idx, a.shape)):
            raise IndexError(f"{name}: index {idx} out of bounds for shape {a.shape}")
        flat = int(np.ravel_multi_index(tuple(int(i) for i in idx), a.shape))
    else:
        if a.ndim != 1:
            raise IndexError(f"{name}: integer index needs a 1-d array, got {a.ndim}-d")
        flat = int(idx)
    start = flat * a.itemsize
    if flat < 0 or start + nbytes > a.nbytes:
        raise IndexError(f"{name}: bytes [{start}, {start + nbytes}) of element {idx} are "
                         f"outside the array ({a.nbytes} bytes)")
    if (a.ctypes.data + start) % align:
        raise RuntimeError(f"{name}: misaligned address: element {idx} of a {a.dtype} array "
                           f"is at byte {(a.ctypes.data + start) % align} mod {align}; the "
                           f"instruction needs {align}-byte alignment (shared tiles: "
                           f"cuda.shared.array(..., alignment=16))")
    return a.reshape(-1).view(np.uint8)[start:start + nbytes]
