"""The CUDA back-end's graphs: each recorded sequence run once and captured, or captured
without a run, and the warm-up that captures every graph a request can need at load.

A mixin of CUDABackend (engine/backend_cuda.py). It uses that class's `stream`, `state`,
`arena`, `lay`, `n_ctx`, `ecfg`, `kv`, `use_graphs`, `_graphs` (key -> CUDAGraph), `capture_stats`,
`pending_launch`, `_upload` (a cuda_weights.BackgroundUpload or None), `_max_splits_of`, and
its methods `_record_prefill/_head/_decode`, `_set_state`, `_wrote`, and `dws_short` (not None: there
is a short-context decode graph). Which split counts a prefill chunk's graph holds and uses are
worked out here (`_plans`, `_splits_at`, `_splits`, `_max_splits`; memoised in `_splits_of`,
`_max_splits_of`).
Keys: ("prefill", n, splits), ("prefill_short", 8, splits) (EngineConfig.short_prefill), ("head", mode), ("decode", mode), ("decode", mode, "short") (a step
below EngineConfig.decode_short_ctx) and the constrained steps' ("sample", ...)
(engine/cuda_constrained.py).
"""
from __future__ import annotations

import logging
import time

from .cuda_layout import BUCKETS, SHORT_ROWS
from .device_state import MAX_PLANS
from .progress import NO_PROGRESS, Progress

log = logging.getLogger("genie_rt.cuda")


class GraphSteps:
    def _recorded(self, record) -> None:
        """Run a recording; it must end with nothing pending (a DecodeOps' finish())."""
        self.pending_launch = None        # (left by a recording that raised)
        record()
        assert self.pending_launch is None, \
            f"a recording ended with {self.pending_launch} still pending: call ops.finish() at its end"

    def _run(self, key, record) -> None:
        """Replay the graph for `key`. On first use the sequence runs uncaptured (compiling
        what is not compiled yet) and is then captured for the next time, so every call
        executes it exactly once (sampling and state updates are not idempotent)."""
        if not self.use_graphs:
            self._recorded(record)
            return
        graph = self._graphs.get(key)
        if graph is None:
            from .cuda_graph import CUDAGraph
            t0 = time.perf_counter()
            self._recorded(record)        # this step's work (and any compilation) ...
            self.stream.synchronize()
            t1 = time.perf_counter()
            graph = CUDAGraph(self.stream)
            with graph.capture():         # ... then recorded, not executed again
                self._recorded(record)
            self._keep_graph(key, graph, t1 - t0, time.perf_counter() - t1)
            return
        graph.replay()

    def _keep_graph(self, key, graph, first_run_s: float, capture_s: float) -> None:
        """Store a captured graph and count it in capture_stats (the load log's per-kind line)."""
        self._graphs[key] = graph
        st = self.capture_stats.setdefault(key[0], [0, 0.0, 0.0, 0])
        st[0] += 1
        st[1] += first_run_s
        st[2] += capture_s
        st[3] += graph.n_nodes

    def _capture_only(self, key, record) -> bool:
        """Capture `record` without running it first (warm-up only: nothing needs the work
        done). Only safe when every kernel it launches is compiled and its buffers exist: a
        compile during the capture (a kernel-cache lookup that missed, or one with no cache)
        or any error discards the graph, and the caller takes the ordinary path. A lookup
        that hit is kept: it loads a cubin into the context (cuModuleLoadData, allowed while
        a stream captures), launches nothing and is what the graph then replays - a warm
        start loads its kernels inside the captures instead of capturing each sequence twice
        (H200, 2026-12-03: 7 discarded prefill captures, 1.2-2.4 s of a 6-10 s warm start)."""
        from .cuda_graph import CUDAGraph
        from .kernel_store import STATS
        before, t0 = STATS.lookups - STATS.hits, time.perf_counter()
        graph = CUDAGraph(self.stream)
        try:
            with graph.capture():
                self._recorded(record)
        except Exception as exc:          # noqa: BLE001 - any failure: the ordinary path
            log.debug("capture of %s without a first run failed (%s): running it first", key, exc)
            graph.close()
            self.stream.synchronize()
            self._discarded(f"{key[0]} (error)", t0)
            return False
        if STATS.lookups - STATS.hits != before:
            graph.close()
            self._discarded(f"{key[0]} (compiled kernels)", t0)
            return False
        self._keep_graph(key, graph, 0.0, time.perf_counter() - t0)
        return True

    def _discarded(self, kind: str, t0: float) -> None:
        """Count a capture thrown away in capture_stats (the load log's per-kind line): its
        seconds are warm-up time no kept graph accounts for."""
        st = self.capture_stats.setdefault(f"discarded {kind}", [0, 0.0, 0.0, 0])
        st[0] += 1
        st[2] += time.perf_counter() - t0

    def decode_graph_keys(self, mode) -> list:
        """[(graph key, short)] of the decode graphs warm_up captures for a sampling mode: the
        short-context one where there is one (`dws_short`), and the other unless every position
        of the pool is below EngineConfig.decode_short_ctx (then no step would replay it: a
        context of 1,024 or less on the default threshold captures three graphs fewer and
        compiles none of its attention kernels; a step that asks for it later, with the
        threshold changed, captures it then)."""
        short = getattr(self, "dws_short", None) is not None
        keys = []
        if not (short and self.n_ctx <= self.ecfg.decode_short_ctx):
            keys.append((("decode", mode), False))
        if short:
            keys.append((("decode", mode, "short"), True))
        return keys

    def warm_up(self, progress: Progress = NO_PROGRESS) -> None:
        """Compile every kernel and capture the decode graphs and prefill buckets now: one
        progress step, advanced per sequence (its kernels compiled or loaded from the kernel
        cache, then its graph captured).

        Each bucket is one graph (its attention split count is device state). The first
        bucket runs once uncaptured (compiling or loading its kernels) and is then captured;
        the later ones are first tried capture-only (no first run) and fall back to run-then-
        capture when that capture would compile or load a kernel. With a background upload
        (EngineConfig.overlap_load) every sequence is first tried capture-only, so that
        nothing reads a weight before the weights are in (`_warm_one`). Before the split count was
        device state, a warm start of the 4B on the H200 (2026-12-03, tools/bench_start.py,
        38 prefill graphs of 22,828 nodes) spent 9.7 of its 15.4 s here: the first runs of
        the 8 buckets 1.9 s, the 38 captures 6.7 s."""
        t0 = time.perf_counter()
        self._waited = 0.0                  # seconds spent waiting for a background upload
        used0 = _device_used()
        try:
            keys = self.prefill_keys()
            modes = (None, "greedy", "full")
            progress.start("compiling kernels" + (", capturing graphs" if self.use_graphs else ""),
                           len(keys) + 2 * len(modes), "graphs" if self.use_graphs else "sequences")
            for i, (n, splits, start, short) in enumerate(keys):
                # (the mirror only: the graph's first nodes copy it, _record_prefill)
                self._set_state(pos=start, last=0, splits=self._splits(n, start, short), copy=False)
                self._warm_one(("prefill_short" if short else "prefill", n, splits),
                               lambda n=n, splits=splits, short=short: self._record_prefill(n, splits, short),
                               first_try_capture=i > 0 and not short)
                progress.advance(1, f"prefill {n}{' (short)' if short else ''}")
            self._set_state(pos=0, last=0)
            for mode in modes:
                self._warm_one(("head", mode), lambda mode=mode: self._record_head(self.arena["x_last"], mode),
                               first_try_capture=False)
                progress.advance(1, f"head {mode or 'logits'}")
            for mode in modes:
                for key, short in self.decode_graph_keys(mode):
                    self._set_state(pos=0)
                    self._warm_one(key, lambda mode=mode, short=short: self._record_decode(mode, short),
                                   first_try_capture=False)
                progress.advance(1, f"decode {mode or 'logits'}")
            self.stream.synchronize()
            self.kv.zero(self.stream)
            self.stream.synchronize()
            self._wrote(0, 0, reset=True)
            self.compile_seconds = time.perf_counter() - t0 - self._waited
            from .kernel_cache import run_summary
            summary = run_summary()
            progress.done(summary)
            log.info("CUDA kernels compiled and %d graphs captured in %.1f s; %s", len(self._graphs),
                     self.compile_seconds, summary)
            used1 = _device_used()
            held = "" if used0 is None or used1 is None else \
                f"; device memory in use grew by {max(0, used1 - used0) / 2**20:.1f} MiB during the warm-up " \
                "(its kernel modules and graphs; device-wide, so another process's use would show too)"
            log.info("graphs by kind: %s%s", "; ".join(
                f"{kind} {n} (first runs {a:.2f} s, captures {b:.2f} s, {nodes} nodes)"
                for kind, (n, a, b, nodes) in self.capture_stats.items()), held)
        except BaseException:
            if self._upload is not None:          # nothing may write the arena once this raises
                self._upload.join()
            raise
        self._weights_ready(progress)       # after the warm-up's step: progress steps do not nest

    def _warm_one(self, key, record, first_try_capture: bool) -> None:
        """Capture `key`. While the weights are still being read (a background upload), every
        sequence is captured without a run: a try that compiles kernels is discarded and tried
        once more. Otherwise only where `first_try_capture` (the later buckets,
        whose kernels the first bucket loaded). Failing that, it waits for the weights, runs
        once and is captured."""
        reading = self._upload is not None and self._upload.reading
        if self.use_graphs and (reading or first_try_capture):
            for _ in range(2 if reading else 1):
                if self._capture_only(key, record):
                    return
        if self._upload is not None:        # the weights in (or the upload's error raised) before a run
            t0 = time.perf_counter()
            self._upload.wait()             # silently: the step is shown after the warm-up's
            self._waited += time.perf_counter() - t0
        self._run(key, record)

    def _weights_ready(self, progress: Progress = NO_PROGRESS) -> None:
        """Join the background upload (if any) and show its step "reading weights"."""
        if self._upload is not None:
            self._upload.wait(progress)     # raises the upload's error; the thread has ended
            self.upload_seconds = self._upload.seconds
            self._upload = None

    def prefill_keys(self) -> list[tuple[int, tuple, int, bool]]:
        """(bucket, most attention splits per plan, a start position, short) of every bucket's
        one graph, and of the short prefill's (EngineConfig.short_prefill): all are captured at
        load, so no chunk compiles or captures on its first use, whatever its start (the split
        count in use is device state)."""
        keys = [(n, self._max_splits(n), 0, False) for n in BUCKETS if n <= self.lay.chunk and n <= self.n_ctx]
        if getattr(self, "short_prefill", False) and SHORT_ROWS <= min(self.n_ctx, self.lay.chunk):
            keys.append((SHORT_ROWS, self._max_splits(SHORT_ROWS, True), 0, True))
        return keys

    def _plans(self) -> list:
        """The distinct prefill attention plans (one per kind of layer), in layer order;
        plan i's split count lives in state[S_SPLIT + i]."""
        plans = list({id(p): p for p in self.lay.prefill_plans}.values())
        assert len(plans) <= MAX_PLANS, f"{len(plans)} prefill attention plans; the state holds {MAX_PLANS}"
        return plans

    def _splits_at(self, n: int, start: int, short: bool = False) -> tuple:
        """The context splits of each plan for a chunk of n rows at `start` (graph key); short:
        in the short prefill's graph (its own fewest tiles a split, attention_prefill.SHORT_SPLIT_TILES)."""
        from genie_rt.kvcache.attention_prefill import prefill_splits
        return tuple(prefill_splits(p, n, start, short=short) for p in self._plans())

    def _splits(self, n: int, start: int, short: bool = False) -> tuple:
        """_splits_at for a chunk about to run: each (n, start) worked out once (a warm request's
        host time before its first kernel; _max_splits' sweep at load does not fill this)."""
        got = self._splits_of.get((n, start, short))
        if got is None:
            if len(self._splits_of) >= 1 << 14:
                self._splits_of.clear()
            got = self._splits_of[(n, start, short)] = self._splits_at(n, start, short)
        return got

    def _max_splits(self, n: int, short: bool = False) -> tuple:
        """The most context splits of each plan for a chunk of n rows at any start: the
        grid of the bucket's one graph (its blocks above the count in use exit at once); short:
        the short prefill's graph (_splits_at)."""
        got = self._max_splits_of.get((n, short))
        if got is None:
            step = min(p.block_n for p in self._plans())
            got = (1,) * len(self._plans())
            for start in list(range(0, self.n_ctx - n + 1, step)) + [max(self.n_ctx - n, 0)]:
                got = tuple(max(a, b) for a, b in zip(got, self._splits_at(n, start, short)))
            self._max_splits_of[(n, short)] = got
        return got


def _device_used() -> int | None:
    """Device memory in use (cuMemGetInfo total - free), or None where it cannot be asked (the
    simulator's context reports infinite memory: int() of it raises, caught below). The
    warm-up's difference is mostly its kernel modules and graphs: the arena is allocated before."""
    try:
        from numba import cuda
        free, total = cuda.current_context().get_memory_info()
        return int(total) - int(free)
    except Exception:       # noqa: BLE001 - only a log figure
        return None
