"""How many threads the CPU kernels use: `set_threads(n)` (the CLI's --threads), default the
physical cores this process may run on.

Every parallel kernel splits its work into exactly `get_threads()` equal chunks (output
rows for linear, (query, kv-head) pairs for attention) run by numba's threading layer
(OpenMP or TBB when installed, else numba's workqueue), so 2 threads do half the work
each. The split never changes a result: each output element is computed by one thread
with the same operation sequence whatever the thread count.

Hyper-threads are not counted by default: two threads on one core share its SIMD units
and its cache, and these kernels are bandwidth- or SIMD-bound.

What it deliberately does not do: pin threads to cores, or start threads (numba starts
its pool on the first parallel call).
"""
from __future__ import annotations

import os
from pathlib import Path

import numba

_threads: int | None = None


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on; falls back
    to the CPU count where Linux's topology files are absent."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:                     # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def max_threads() -> int:
    """The size of numba's thread pool (NUMBA_NUM_THREADS, default the logical CPUs)."""
    return numba.config.NUMBA_NUM_THREADS


def set_threads(n: int | None) -> int:
    """Use n threads (None or 0: the physical cores). Returns the count now in effect.
    Raises ValueError for n < 0 or above numba's pool (NUMBA_NUM_THREADS)."""
    global _threads
    if n is None or n == 0:
        n = min(physical_cores(), max_threads())
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"threads must be a positive integer (0 = the physical cores), got {n!r}")
    if n > max_threads():
        raise ValueError(f"threads = {n} exceeds numba's thread pool of {max_threads()} "
                         "(set NUMBA_NUM_THREADS before starting, or ask for fewer)")
    _threads = n
    return n


def get_threads() -> int:
    """The thread count kernels split their work into; also makes it numba's count for the
    calling Python thread (numba keeps that count per thread)."""
    n = _threads if _threads is not None else set_threads(None)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n
