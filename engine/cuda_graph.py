"""Capture a sequence of Numba kernel launches into a CUDA graph and replay it.

Through Numba's dispatcher a launch costs 20-50 us of host time; a 36-layer decode
step has ~300 launches, so the host alone would cap decode near 100 tokens/s. A CUDA
graph records the launches once (`cuStreamBeginCapture` on the stream, ordinary
`kernel[grid, block, stream](...)` calls, `cuStreamEndCapture`) and replays all of
them with one `cuGraphLaunch` (~1 us per kernel node on the device side, ~2 us of host
time per replay). Pointers and scalar arguments are frozen into the graph, so every
buffer must stay where it was (an arena) and values that change per token (position,
token id, context length) must be read by the kernels from device memory.

Nothing may allocate, synchronise or copy from pageable host memory during capture:
launchers used inside a captured region must be pure launches. A copy from a pinned mirror
by a bound h2d.Upload (one cuMemcpyHtoDAsync) is allowed: it becomes a memcpy node that reads
the mirror when the graph runs (a prefill's ids and state slots, CUDABackend._record_prefill).

A capture may be cut into parts (`cut(stream)` between two launches of the recorded sequence): each
part is its own graph, and one replay launches them in order on the stream. A launch's host time
grows with its nodes, so a small first part can start the device sooner (a lab knob of the short
prefill's graph: engine/cuda_short_prefill.py SPLIT_LAUNCH).
"""
from __future__ import annotations

from contextlib import contextmanager


class CUDAGraphError(RuntimeError):
    pass


def _check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise CUDAGraphError(f"{what} failed: {err!r}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


# the graphs capturing now, by the id of their stream object: what `cut` ends a part of
_CAPTURING: dict = {}


def cut(stream) -> None:
    """End the current part of the graph capturing on `stream` and begin the next one (nothing where
    no graph captures there: an uncaptured run, or the simulator). See CUDAGraph.cut."""
    graph = _CAPTURING.get(id(stream))
    if graph is not None:
        graph.cut()


class CUDAGraph:
    """A captured, instantiated graph bound to one stream: one part, or several (`cut`) launched in
    order by one replay."""

    def __init__(self, stream):
        from cuda.bindings import driver
        self._driver = driver
        self.stream = stream
        self._hstream = driver.CUstream(int(stream.handle))
        self._graphs = []       # the captured parts, in order
        self._execs = []        # their instantiations
        self.n_nodes = 0

    def _begin(self) -> None:
        d = self._driver
        _check(d.cuStreamBeginCapture(self._hstream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")

    def cut(self) -> None:
        """Inside capture(): what was recorded so far becomes a part of its own, launched before the
        rest. cuGraphLaunch costs host time per node (~0.05-0.07 ms for the short prefill's ~370 on
        H100 hosts, docs/decode-journal.md 7a), so a first part of a few nodes lets the device
        start while the host still launches the rest; the price is one boundary between graphs,
        which a PDL edge does not cross (engine/cuda_short_prefill.py SPLIT_LAUNCH)."""
        part = _check(self._driver.cuStreamEndCapture(self._hstream), "cuStreamEndCapture")
        self._graphs.append(part)
        self._begin()

    @contextmanager
    def capture(self):
        """Record the launches of the with-block (cut into parts where `cut` is called), then
        instantiate and upload each part. Any failure - in the block, in ending the capture or in
        instantiating a part - destroys every part made and raises the first error."""
        self._begin()
        key = id(self.stream)
        _CAPTURING[key] = self
        try:
            yield self
        except BaseException:
            _CAPTURING.pop(key, None)
            self._abort()
            raise
        _CAPTURING.pop(key, None)
        try:
            self._graphs.append(_check(self._driver.cuStreamEndCapture(self._hstream), "cuStreamEndCapture"))
            self._instantiate()
        except BaseException:
            self.close()
            raise

    def _abort(self) -> None:
        """End a capture that failed (ignoring a stream that no longer captures) and destroy its parts."""
        try:
            res = self._driver.cuStreamEndCapture(self._hstream)
            if isinstance(res, tuple) and int(res[0]) == 0 and res[1] is not None:
                self._graphs.append(res[1])
        except Exception:       # noqa: BLE001 - the block's error is the one to report
            pass
        self.close()

    def _instantiate(self) -> None:
        d = self._driver
        for part in self._graphs:
            self._execs.append(_check(d.cuGraphInstantiate(part, 0), "cuGraphInstantiate"))
            # the graph's work to the device now, not at its first launch: on an H100 (2026-12-07)
            # a warm request's first use of the short prefill's graph after load took ~0.5 ms
            # more than the next ones (docs/decode-journal.md 7a: 3.1 -> 2.67 ms with it). A
            # driver (or a cuda.bindings without the call) that refuses costs nothing: the first
            # launch uploads, as before
            upload = getattr(d, "cuGraphUpload", None)
            if upload is not None:
                upload(self._execs[-1], self._hstream)
            res = d.cuGraphGetNodes(part, 0)   # (err, nodes, count) asking for the count only
            if int(res[0]) == 0:
                self.n_nodes += int(res[-1])

    @property
    def parts(self) -> int:
        return len(self._execs)

    def replay(self) -> None:
        if not self._execs:
            raise CUDAGraphError("replay() before a successful capture()")
        launch = self._driver.cuGraphLaunch
        for e in self._execs:
            _check(launch(e, self._hstream), "cuGraphLaunch")

    def close(self) -> None:
        d = self._driver
        for e in self._execs:
            d.cuGraphExecDestroy(e)
        for g in self._graphs:
            if g is not None:
                d.cuGraphDestroy(g)
        self._execs, self._graphs = [], []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def time_us(fn, stream, per: int = 20, reps: int = 15) -> float:
    """Median device time of one `fn()` in microseconds, from CUDA events around a graph
    of `per` captured calls, so host launch overhead does not count (as in the decode
    graph). Falls back to plain launches where graphs cannot be captured."""
    import numpy as np
    from numba import cuda
    fn()                                   # compile and warm up outside the capture
    stream.synchronize()
    graph = CUDAGraph(stream)
    try:
        with graph.capture():
            for _ in range(per):
                fn()
        run = graph.replay
    except Exception as exc:               # noqa: BLE001 - a launch the capture refused, or the capture's end
        print(f"  (no CUDA graph: {exc}; timing plain launches)")
        run, per = fn, 1
    run()
    stream.synchronize()
    times = []
    for _ in range(reps):
        a, b = cuda.event(), cuda.event()
        a.record(stream)
        run()
        b.record(stream)
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b) * 1e3 / per)
    graph.close()
    return float(np.median(times))
