"""Small host-to-device copies without per-copy overhead: pinned source, raw async copy.

A request's first token waits for a handful of tiny uploads (sampler parameters, the
penalty ring, token ids, state slots). Through `DeviceNDArray.copy_to_device` each costs
a slice or two of device arrays, numba's checks and, from pageable memory, a stream
synchronisation inside the driver (CUDA's rule for pageable host-to-device copies):
~0.1-0.2 ms each, ~1 ms per request on the H200 (tools/bench_prefix.py, 2026-12-01). Here
the source is a pinned mirror allocated at load and the copy is one cuMemcpyHtoDAsync
on the stream, so it is ordered with the kernels and costs a few microseconds.

    mirror = pinned_like(dev)          # at load
    mirror[:n] = values                # host writes (after the stream is idle for it)
    upload(dev, mirror, stream, nbytes=4 * n)

A request's own path to its first kernel (the prefill's token ids and state slots) binds each
pair once: `Upload(dev, mirror, stream)` takes the pointers and the stream's handle at load, and
each call is the driver's cuMemcpyHtoDAsync through cuda.bindings and nothing else. numba's
`driver.host_to_device`, which `upload` uses, looks up both pointers and the stream's handle on
every copy: ~20 us a copy on the H100 host of 2026-12-06 and ~45 us on the one of 2026-12-07
(tools/bench_prefix.py --breakdown-after-cold), host time before a warm request's first kernel.
Since 2026-12-07 16:30 UTC the prefill's two copies are its graph's first nodes instead (stream
capture records a bound call as a memcpy node that reads the mirror when the graph runs), so a
warm request's host work before its first kernel is the mirrors' writes and one launch.

The caller must not rewrite a mirror while a copy from it may still be pending (the
back-end synchronises the stream before it rewrites any, or waits for an event recorded after
the copies: `event()`, as gpu_sampling.set_request does). Under the simulator both are plain
numpy arrays and copies.
"""
from __future__ import annotations

import logging

import numpy as np

from genie_rt.quant import ptx

log = logging.getLogger("genie_rt.cuda")


def event():
    """A CUDA event for ordering only (no timing; the simulator's Event takes no arguments)."""
    from numba import cuda
    return cuda.event() if ptx.SIMULATOR else cuda.event(timing=False)


def pinned_like(dev) -> np.ndarray:
    """A zeroed page-locked host array of dev's shape and dtype (numpy under the simulator)."""
    from numba import cuda
    if ptx.SIMULATOR:
        return np.zeros(dev.shape, dev.dtype)
    a = cuda.pinned_array(dev.shape, dev.dtype)
    a[...] = 0
    return a


def upload(dev, host: np.ndarray, stream, nbytes: int | None = None) -> None:
    """Copy the first nbytes (default: all) of the pinned host array into dev, asynchronously
    on `stream`. Both must be C-contiguous; nbytes may not exceed either."""
    n = host.nbytes if nbytes is None else int(nbytes)
    dev_bytes = int(np.prod(dev.shape, dtype=np.int64)) * dev.dtype.itemsize
    if not 0 <= n <= min(host.nbytes, dev_bytes):
        raise ValueError(f"upload: {n} bytes do not fit a {host.nbytes}-byte host buffer and a "
                         f"{dev_bytes}-byte device array")
    if n == 0:
        return
    if ptx.SIMULATOR:
        flat = host.reshape(-1).view(np.uint8)[:n]
        dev.reshape(-1).view(np.uint8)[:n].copy_to_device(flat, stream=stream)
        return
    from numba.cuda.cudadrv import driver
    driver.host_to_device(dev, host, n, stream=stream)


class Upload:
    """upload(dev, host, stream, nbytes) bound once: the checks, both pointers and the stream's
    handle are taken here, and a call is one cuMemcpyHtoDAsync (cuda.bindings). dev and host
    must stay where they are (an arena's view, a mirror made at load). Under the simulator a call
    is `upload`."""

    def __init__(self, dev, host: np.ndarray, stream):
        self.limit = min(host.nbytes, int(np.prod(dev.shape, dtype=np.int64)) * dev.dtype.itemsize)
        if not (host.flags.c_contiguous and dev.is_c_contiguous()):
            raise ValueError("Upload: the host and device arrays must be C-contiguous")
        self._args = (dev, host, stream)
        self._copy = None
        if not ptx.SIMULATOR:
            from cuda.bindings import driver as cu
            from numba.cuda.cudadrv.driver import device_pointer, host_pointer
            self._copy = cu.cuMemcpyHtoDAsync
            self._dst = cu.CUdeviceptr(device_pointer(dev))
            self._src = host_pointer(host, readonly=True)
            self._stream = cu.CUstream(int(stream.handle))

    def __call__(self, nbytes: int | None = None) -> None:
        n = self.limit if nbytes is None else int(nbytes)
        if not 0 <= n <= self.limit:
            raise ValueError(f"upload: {n} bytes do not fit the {self.limit} bytes bound")
        if n == 0:
            return
        if self._copy is None:
            upload(*self._args, nbytes=n)
            return
        try:
            err = self._copy(self._dst, self._src, n, self._stream)[0]
        except (TypeError, ValueError, AttributeError) as e:   # a cuda.bindings that takes the call otherwise
            log.warning("h2d.Upload: cuMemcpyHtoDAsync through cuda.bindings failed (%s); numba's copy from now on", e)
            self._copy = None
            upload(*self._args, nbytes=n)
            return
        if int(err) != 0:
            raise RuntimeError(f"cuMemcpyHtoDAsync of {n} bytes failed: {err!r}")


class ContextGuard:
    """Make numba's CUDA context current on the calling thread, cheaply when it already is (the server
    loads the model on one thread and generates on another). numba's `cuda.current_context()` looks
    the context up through the driver on every call: ~0.03 ms on the H100 host of 2026-12-07 16:38
    UTC, host time before a warm request's first kernel (tools/bench_prefix.py). A call here is one
    cuCtxGetCurrent through cuda.bindings; a thread where no context, or another one, is current
    goes through numba's `current_context()` as before (which makes numba's current where none is,
    and leaves another one that a caller pushed). Under the simulator a call does nothing."""

    def __init__(self):
        self._get = None
        if ptx.SIMULATOR:
            return
        from cuda.bindings import driver as cu
        from numba import cuda
        self._handle = int(cuda.current_context().handle)
        self._get = cu.cuCtxGetCurrent

    def __call__(self) -> None:
        if self._get is None:
            return
        err, ctx = self._get()
        if int(err) != 0 or int(ctx) != self._handle:
            from numba import cuda
            cuda.current_context()
