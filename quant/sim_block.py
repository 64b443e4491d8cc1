"""An event-driven thread block for Numba's CUDA simulator, installed when this module is
imported (quant/ptx_sim.py imports it, only under NUMBA_ENABLE_CUDASIM=1).

The simulator runs each CUDA thread of a block as a Python thread. Its BlockManager finds
out that every thread waits in `syncthreads` by polling all of them in a loop that never
sleeps, so a 256-thread block spends much of its time in that loop, and its threads wait
in turn for the GIL the loop holds. Here a barrier is a counter under one condition
variable: the last thread to arrive (or to exit) releases the others, and the manager
sleeps until the block has finished or a thread has raised.

Kept from the simulator: one Python thread per CUDA thread, started one by one;
`BlockThread.syncthreads_blocked` is up while a thread waits at a barrier (quant/ptx_sim.py's
deadlock check reads it); `syncthreads_count/and/or` (they call `syncthreads` twice);
a thread's exception aborts the block's other threads (at their next barrier or warp
collective) and is raised from the launch. Nothing here is used on a GPU.
"""
import threading

import numpy as np
from numba.cuda.simulator import kernel as _sim_kernel


class _Barrier:
    """The barrier state of one block: threads still running, threads waiting, and a
    generation number that each release advances."""
    __slots__ = ("cond", "live", "waiting", "generation", "finished", "failed")

    def __init__(self, nthreads):
        self.cond = threading.Condition()
        self.live, self.waiting, self.generation = nthreads, [], 0
        self.finished = threading.Event()      # set when every thread ended, or one raised
        self.failed = None

    def release(self):                          # caller holds cond
        for t in self.waiting:
            t.syncthreads_blocked = False
        self.waiting = []
        self.generation += 1
        self.cond.notify_all()


def _syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    bar = self._manager._genie_barrier
    with bar.cond:
        self.syncthreads_blocked = True
        bar.waiting.append(self)
        gen = bar.generation
        if len(bar.waiting) == bar.live:
            bar.release()
        else:
            while bar.generation == gen and not self.abort:
                bar.cond.wait()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


_sim_thread_run = _sim_kernel.BlockThread.run


def _run(self):
    try:
        _sim_thread_run(self)                   # stores an exception in self.exception
    finally:
        bar = self._manager._genie_barrier
        with bar.cond:
            bar.live -= 1
            if self.exception is not None and bar.failed is None:
                bar.failed = self
            if bar.failed is not None or bar.live == 0:
                bar.finished.set()
            elif bar.waiting and len(bar.waiting) == bar.live:
                bar.release()                   # the others wait at a barrier this one skipped


def _block_run(self, grid_point, *args):
    """BlockManager.run: start the block's threads, wait for them; a thread's exception
    sets every thread's abort flag and is raised here."""
    shape = tuple(self._block_dim)
    bar = self._genie_barrier = _Barrier(int(np.prod(shape)))
    threads = []
    for block_point in np.ndindex(*shape):
        def target():
            self._f(*args)
        t = _sim_kernel.BlockThread(target, self, grid_point, block_point, self._debug)
        threads.append(t)
        t.start()
    bar.finished.wait()
    failed = bar.failed
    if failed is None:
        for t in threads:
            t.join()
        failed = next((t for t in threads if t.exception), None)
    if failed is not None:
        with bar.cond:
            for t in threads:
                t.abort = True
                t.syncthreads_blocked = False
            bar.cond.notify_all()
        raise failed.exception[0].with_traceback(failed.exception[1])


if not getattr(_sim_kernel.BlockManager.run, "_genie_event_driven", False):
    _block_run._genie_event_driven = True
    _sim_kernel.BlockManager.run = _block_run
    _sim_kernel.BlockThread.syncthreads = _syncthreads
    _sim_kernel.BlockThread.run = _run
