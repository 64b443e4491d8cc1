"""The CUDA back-end's runtime: one arena, the device state, CUDA graphs for every step.

What lives where:
    engine/cuda_layout.py    every buffer laid out before anything is allocated; the budget
    engine/cuda_weights.py   weights packed into the arena and bound to the typed weights; RoPE tables
    engine/cuda_ops.py       the op vocabulary as kernel launches (decode and prefill)
    engine/models/<arch>.py  the forward (`body`, `head`), the same code on every back-end
    engine/device_state.py   the slots of `state` that graphs read per step
    engine/cuda_graph_steps.py  capture and replay, the warm-up, each chunk's split counts
    engine/cuda_rings.py     which positions the sliding-window rings hold (prefix reuse)
    engine/h2d.py            the host's copies and context check before a request's first kernel
    this file                load, the recorded sequences, and the back-end interface

Load (all before the first token): the layout is planned and budgeted; one Arena is
allocated; the weights are uploaded; every kernel is compiled and each sequence below is
captured into a CUDA graph (a first, uncaptured run compiles; the capture records):

    ("decode", mode)         body(DecodeOps) on one row, head, sampling (greedy / full /
                             none), S_POS += 1 - one graph per token
    ("decode", mode, "short")  the same for a position below EngineConfig.decode_short_ctx: its
                             attention takes one query head a block (lay.decode_plans_short)
    ("prefill", n, splits)   the chunk's ids and state slots copied from their pinned mirrors,
                             body(PrefillOps) on a chunk of n rows (a bucket: padded rows
                             are computed and ignored), then x_last <- x[S_LAST]; splits:
                             the most attention splits per plan at any start, the count in
                             use is read from state[S_SPLIT + i] - one graph per bucket
    ("prefill_short", 8, splits)  with EngineConfig.short_prefill, a chunk of at most 8 rows:
                             the same two copies, body(ShortPrefillOps), the int8 tensor-core GEMV on q8_K
                             activations (engine/cuda_short_prefill.py) - one graph
    ("head", mode)           the head on x_last and the sampling of the first token

Between decode replays the host only reads the sampled token from a host-mapped ring;
replays run one step ahead of the host, so the GPU never waits for Python.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from . import cuda_layout
from .arena import Arena
from .config import EngineConfig, ModelConfig
from .cuda_constrained import ConstrainedSteps
from .cuda_graph_steps import GraphSteps
from .cuda_layout import BUCKETS, MAX_BIAS, SHORT_ROWS, is_integrated, plan_layout
from .cuda_rings import RingPositions
from .device_state import N_SLOTS, S_LAST, S_POS, S_SPLIT, S_TOKEN
from .gguf_file import GGUFFile
from .h2d import ContextGuard, Upload, event, pinned_like
from .memory import MemoryPlan
from .models import architecture
from .models.ops import AttnLayer, attn_layers, scratch_widths
from .progress import NO_PROGRESS, Progress

log = logging.getLogger("genie_rt.cuda")

OUT_SLOTS = 64                    # host-mapped ring of sampled tokens
# A request's six sampler copies (gpu_sampling.set_request) on a stream of their own beside the prefill,
# not between its graph and the head's on the stream (_begin_request). The 4B's warm request (500 cached +
# 8, H100, 2026-12-08 00:50 UTC, bench_prefix --ab, two alternating rounds of 9): 2.505 ms against 2.532
# off (each round's median 0.01-0.03 lower); its GPU ordering test passed on that call. On; False (a knob)
# puts them back on the stream.
SAMPLER_COPY_STREAM = True


@dataclass
class _Request:
    sampler: object = None
    greedy: bool = True
    draws: int = 0                 # tokens sampled on the device this request


class CUDABackend(ConstrainedSteps, GraphSteps, RingPositions):
    """engine/backend.py's Backend on a CUDA GPU."""

    name = "cuda"

    def __init__(self, g: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig, plan: MemoryPlan,
                 use_graphs: bool | None = None, warm: bool = True, progress: Progress = NO_PROGRESS):
        from numba import cuda

        from genie_rt.engine import gpu_sampling
        from genie_rt.kvcache.attention import DecodeWorkspace
        from genie_rt.kvcache.attention_prefill import PrefillWorkspace
        from genie_rt.kvcache.device_pool import DeviceKVPool
        from genie_rt.quant import embed, ptx

        from . import cuda_weights

        t0 = time.perf_counter()
        self.cfg, self.ecfg, self.n_ctx = cfg, ecfg, plan.n_ctx
        self.spec = architecture(cfg.arch)
        self.simulator = ptx.SIMULATOR
        self.use_graphs = (not self.simulator) if use_graphs is None else use_graphs
        self.lay = lay = plan_layout(g, cfg, ecfg, plan.n_ctx)
        self.stream = cuda.stream()
        self.copy_stream = cuda.stream()   # a request's sampler copies, beside a prefill (_begin_request)
        self._context = ContextGuard()
        self.mapped = bool(getattr(ecfg, "mapped_memory", False))
        self.arena = A = Arena(lay.layout, mapped=self.mapped)
        self.integrated = is_integrated(cuda_layout.device())
        # weights in host memory (integrated GPU, or mapped): the file's pages are dropped behind them.
        # With EngineConfig.overlap_load, on a discrete GPU whose graphs are captured now, they
        # are read on a thread meanwhile.
        self._upload, self.upload_seconds = None, None
        overlap = (warm and self.use_graphs and not self.simulator and not (self.integrated or self.mapped)
                   and getattr(ecfg, "overlap_load", False))
        if not overlap:
            cuda_weights.upload(A, lay, g, self.stream, self.integrated or self.mapped, progress)
        self.weights, self.stacks = cuda_weights.bind(A, lay, g, cfg, ecfg.gemv_mode)
        self.attn = attn_layers(cfg, self.weights.layers, self.weights.rope_freqs)
        self.short_prefill, self.short_gemv = False, {}
        if ecfg.short_prefill:                # (the layout holds its q8_K buffers)
            from .cuda_short_prefill import short_gemv_weights, unfit_reason
            why = unfit_reason(self.weights) or (
                f"a prefill chunk of {lay.chunk} rows holds less than its {SHORT_ROWS}" if lay.chunk < SHORT_ROWS
                else None)
            if why is None:
                self.short_prefill, self.short_gemv = True, short_gemv_weights(self.weights)
            else:
                log.warning("short prefill off for this model: %s", why)
        self._rope = cuda_weights.upload_rope_tables(A, cfg, self.n_ctx, self.weights.rope_freqs, self.stream)
        self.kv = DeviceKVPool(lay.kv_shape, A["kv_pool"], stream=self.stream)
        self.kv_layers = [self.kv.layer(i) for i in range(cfg.n_layers)]
        self._init_rings(lay.kv_shape, cfg)
        self.state = A["state"]
        self.state.copy_to_device(np.zeros(N_SLOTS, np.int32), stream=self.stream)
        self.dws = DecodeWorkspace(lay.decode_plan, A["ws.decode"], stream=self.stream)
        self.dws_short = (DecodeWorkspace(lay.decode_plan_short, A["ws.decode_short"], stream=self.stream)
                          if lay.decode_plan_short is not None else None)
        self.pws = PrefillWorkspace(lay.prefill_plan, A["ws.prefill"] if lay.prefill_plan.workspace_bytes else None)
        A["ws.mmq"].copy_to_device(np.zeros(A["ws.mmq"].shape, np.uint8), stream=self.stream)
        self.sws = gpu_sampling.workspace_from_arena(A, cfg.vocab_size, prefix="sampler.",
                                                     ring_capacity=max(plan.n_ctx, 64), max_bias=MAX_BIAS,
                                                     stream=self.stream)
        self.out = cuda.mapped_array(OUT_SLOTS, np.int32) if not self.simulator else cuda.device_array(OUT_SLOTS, np.int32)
        self.embd_planes = embed.device_planes(self.weights.tok_embd.packed)
        modes = [m.gemv.mode for m in self._matrices()]
        self.q8_inputs = any(m == "dp4a" for m in modes)      # some GEMV reads 8-bit activations
        self.float_inputs = any(m != "dp4a" for m in modes)   # some GEMV reads float activations
        self._host_state = pinned_like(self.state)
        self._host_ids = pinned_like(A["ids"])
        self._upload_ids = Upload(A["ids"], self._host_ids, self.stream)
        self._slot_uploads: dict[tuple, Upload] = {}   # (first slot, end) -> its copy from the pinned mirror
        self._max_splits_of: dict[tuple, tuple] = {}
        self._splits_of: dict[tuple, tuple] = {}       # (rows, start, short) -> _splits' answer
        self._decode_scratch = self._scratch(1, self.state[S_TOKEN:S_TOKEN + 1])
        self._prefill_scratch = {}
        self._req = _Request()
        self._graphs: dict = {}
        self.pending_launch: str | None = None   # a launch a DecodeOps still holds (cuda_ops.py)
        self.capture_stats: dict[str, list] = {}   # graph kind -> [count, first-run s, capture s, nodes]
        self.stream.synchronize()
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = 0.0
        if warm and not self.simulator:
            if overlap:                   # nothing above reads a weight; warm_up joins it, on every path
                self._upload = cuda_weights.BackgroundUpload(A, lay, g)
            self.warm_up(progress)

    # -- load helpers --------------------------------------------------------------------
    def _matrices(self):
        w = self.weights
        seen = {}
        for m in [w.tok_embd, w.output] + [getattr(L, f) for L in w.layers for f in vars(L)]:
            if hasattr(m, "gemv"):
                seen[m.name] = m
        return list(seen.values())

    def rope_table(self, a: AttnLayer):
        """(cos, sin) device tables [n_ctx, head_dim/2] of a layer's RoPE."""
        return self._rope[(a.rope_base, a.rope_scale, a.rope_factors is not None)]

    def _scratch(self, rows: int, ids) -> SimpleNamespace:
        """The forward's buffers (engine/models/ops.py scratch_widths) as views of `rows` rows,
        made once: the ops recognise a buffer by its view object."""
        A = self.arena
        return SimpleNamespace(ids=ids, **{name: A[name][:rows] for name in scratch_widths(self.cfg)})

    # -- the recorded sequences ----------------------------------------------------------
    def _decode_ops(self, short: bool = False):
        from .cuda_ops import DecodeOps
        ops = DecodeOps(self, short)
        ops.bind_scratch(self._decode_scratch)
        return ops

    def _record_head(self, x_last, sample: str | None, ops=None) -> None:
        """Final norm, output projection, and (optionally) sampling of one row. `ops`: the
        decode step's DecodeOps, so that the last layer's residual GEMV and the head's norm
        can be one launch."""
        ops = ops or self._decode_ops()
        self.spec.head(ops, self.weights, x_last, self.arena["logits"], self.cfg)
        ops.finish()
        self._record_sample(sample)

    def _record_sample(self, sample: str | None, masked: bool = False, advance: bool = False) -> None:
        """Sampling of the logits (after the grammar mask in sws.mask when `masked`)."""
        from genie_rt.engine import gpu_mask, gpu_sampling
        logits = self.arena["logits"].reshape(self.cfg.vocab_size)
        if masked:
            gpu_mask.apply_mask(self.sws, logits, stream=self.stream)
        self._record_draw(logits, sample)
        if advance:
            gpu_sampling.advance_state(self.state, stream=self.stream)

    def _record_draw(self, logits, sample: str | None) -> None:
        from genie_rt.engine import gpu_sampling
        if sample == "greedy":
            gpu_sampling.sample_greedy(self.sws, logits, self.state, self.out, stream=self.stream)
        elif sample == "full":
            gpu_sampling.sample(self.sws, logits, self.state, self.out, stream=self.stream)

    def _record_decode(self, sample: str | None, short: bool = False) -> None:
        """One decode step; short: with the short-context attention plans (DecodeOps.attention)."""
        from genie_rt.engine import gpu_sampling
        s = self._decode_scratch
        ops = self._decode_ops(short and self.dws_short is not None)
        self.spec.body(ops, self.weights, self.attn, s, self.cfg)
        self._record_head(s.x, sample, ops)
        if sample is not None:
            gpu_sampling.advance_state(self.state, stream=self.stream)

    def short_at(self, pos: int) -> bool:
        """Whether the step at position pos runs the short-context decode graph (there is one, and
        pos is below EngineConfig.decode_short_ctx)."""
        return self.dws_short is not None and pos < self.ecfg.decode_short_ctx

    def _decode_step(self, sample: str | None, pos: int) -> None:
        """Replay (capture the first time) the decode graph of a step at position pos: the
        short-context one where `short_at(pos)`. Either computes the same step (the position is
        read on the device); they differ in speed only."""
        short = self.short_at(pos)
        key = ("decode", sample, "short") if short else ("decode", sample)
        self._run(key, lambda: self._record_decode(sample, short))

    def _record_prefill(self, n: int, n_splits: tuple, short: bool = False) -> None:
        """Layer-major prefill of n rows (ids[:n]) at start = state[S_POS]; x_last <- x[state[S_LAST]].
        The ids and the slots S_POS .. S_SPLIT + plans - 1 are first copied from their pinned mirrors,
        which the caller wrote (_set_state, copy=False is enough). short: by ShortPrefillOps
        (engine/cuda_short_prefill.py) instead of PrefillOps."""
        from .copy_kernels import gather_row
        from .cuda_ops import PrefillOps
        from .cuda_short_prefill import ShortPrefillOps
        s = self._prefill_scratch.get(n)
        if s is None:
            s = self._prefill_scratch[n] = self._scratch(n, self.arena["ids"][:n])
        # the chunk's ids and state slots (position, last row, splits), copied from the pinned mirrors
        # the caller wrote: in a graph these are its first two nodes, so a warm request's host work
        # before its first kernel is the mirrors' writes and one cuGraphLaunch, not two more driver
        # calls (~0.04 ms on the H100 host of 2026-12-07 16:21 UTC, tools/bench_prefix.py)
        self._upload_ids(4 * n)
        self._slot_upload(S_POS, S_SPLIT + len(n_splits))()
        ops = (ShortPrefillOps if short else PrefillOps)(self, n, n_splits, splits_at=S_SPLIT)
        ops.bind_scratch(s)
        self.spec.body(ops, self.weights, self.attn, s, self.cfg)
        ops.finish()
        gather_row(s.x, self.state, S_LAST, self.arena["x_last"], stream=self.stream)

    # -- host <-> device per step -------------------------------------------------------
    def _set_state(self, pos: int | None = None, token: int | None = None, last: int | None = None,
                   splits: tuple = (), copy: bool = True) -> None:
        """Write some state slots: one async copy from the pinned mirror for each run of adjacent
        slots (a prefill chunk's position, last row and splits are one copy: engine/device_state.py;
        its h2d.Upload bound once per run); splits: the prefill plans' attention split counts.
        copy False: the mirror only - a prefill's graph copies its slots itself (_record_prefill).
        A slot's mirror is rewritten only after the stream has synchronised since its last copy
        (every caller follows a sync)."""
        values = {S_POS: pos, S_TOKEN: token, S_LAST: last, **{S_SPLIT + i: k for i, k in enumerate(splits)}}
        slots = sorted(k for k, v in values.items() if v is not None)
        for k in slots:
            self._host_state[k] = values[k]
        if not copy:
            return
        first = 0
        for i, k in enumerate(slots):
            if i + 1 == len(slots) or slots[i + 1] != k + 1:
                self._slot_upload(slots[first], k + 1)()
                first = i + 1

    def _slot_upload(self, first: int, end: int) -> Upload:
        """The bound copy of state slots first .. end-1 from the pinned mirror (made once a run)."""
        copy = self._slot_uploads.get((first, end))
        if copy is None:
            copy = self._slot_uploads[(first, end)] = Upload(self.state[first:end], self._host_state[first:end],
                                                             self.stream)
        return copy

    def _begin_request(self, sampler, history, wait: bool = True) -> None:
        """The request's sampler parameters and history to the device (gpu_sampling.set_request).
        wait: synchronise the stream first, as the callers that then rewrite a state slot's pinned
        mirror (_set_state) need; False (prefill_sample, after its prefill is enqueued): the host
        work overlaps the device's. SAMPLER_COPY_STREAM: the copies run on copy_stream, beside a
        prefill (which reads none of what they write: the sampler's buffers, S_DRAWS and S_HIST),
        and the stream waits for them (an event) before what comes next - the head and its draw;
        else on the stream, after whatever is queued there."""
        from genie_rt.engine import gpu_sampling
        if self._req.sampler is sampler:
            return
        if wait:
            self.stream.synchronize()
        side = SAMPLER_COPY_STREAM
        gpu_sampling.set_request(self.sws, sampler.params, history, self.state,
                                 stream=self.copy_stream if side else self.stream)
        if side:
            self.sws.host["copied"].wait(self.stream)
        self._req = _Request(sampler, sampler.params.is_greedy, 0)

    def _read_token(self) -> int:
        tok = int(self.out[self._req.draws % OUT_SLOTS])
        self._req.draws += 1
        return tok

    # -- the back-end interface (engine/backend.py) --------------------------------------
    def _enter(self) -> None:
        """Make the CUDA context current on the calling thread before any driver call: the
        server loads the model on one thread and generates on another (h2d.ContextGuard)."""
        self._context()

    def device_info(self) -> dict:
        if self.simulator:
            return {"backend": "cuda", "device": "simulator"}
        dev = cuda_layout.device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        from genie_rt.quant import gemv, pdl
        return {"backend": "cuda", "device": name, "compute_capability": "%d.%d" % dev.compute_capability,
                "integrated": self.integrated, "mapped_memory": self.mapped, "arena_bytes": self.lay.layout.nbytes,
                "graphs": len(self._graphs), "compile_seconds": round(self.compile_seconds, 2),
                # the decode step by programmatic dependent launch (asked for and the device has it),
                # its attention's loop (and whether it does rope_write's work) and the PDL GEMVs'
                # trips before the wait
                "decode_pdl": bool(self.ecfg.decode_pdl) and pdl.available(),
                "prefill_pdl": bool(self.ecfg.prefill_pdl) and pdl.available(),
                "short_prefill": self.short_prefill,
                "decode_attention_loop": self.lay.decode_plan.loop,
                "decode_attention_splits": self.lay.decode_plan.n_splits,
                "decode_short_ctx": (self.ecfg.decode_short_ctx if self.dws_short is not None else 0),
                "decode_attention_splits_short": (self.lay.decode_plan_short.n_splits
                                                  if self.dws_short is not None else None),
                "decode_attention_loop_short": (self.lay.decode_plan_short.loop
                                                if self.dws_short is not None else None),
                "decode_fused_rope": bool(getattr(self.ecfg, "decode_fused_rope", False)),
                "decode_attention_q8": bool(getattr(self.ecfg, "decode_attention_q8", False)),
                "gemv_pdl_early_trips": gemv.PDL_EARLY_TRIPS}

    def synchronize(self) -> None:
        self._enter()
        self.stream.synchronize()

    def _prefill_layers(self, tokens: np.ndarray, start: int, cancel=None) -> bool:
        tokens = np.asarray(tokens, np.int32)
        if len(tokens) == 0 or start + len(tokens) > self.n_ctx:
            raise IndexError(f"prefill of {len(tokens)} tokens at {start} exceeds the context {self.n_ctx}")
        chunk = self.lay.chunk
        for c0 in range(0, len(tokens), chunk):
            if cancel is not None and cancel.is_set():
                return False
            part = tokens[c0:c0 + chunk]
            n = len(part)
            pos = start + c0
            short = self.short_prefill and n <= SHORT_ROWS <= chunk
            bucket = SHORT_ROWS if short else next((b for b in BUCKETS if b >= n and b <= chunk), n)
            if pos + bucket > self.n_ctx:
                bucket = n            # never pad past the pool
            self.stream.synchronize()  # the pinned mirrors are about to be rewritten
            self._host_ids[:n] = part
            self._host_ids[n:bucket] = 0
            # (the mirrors only: the graph's first nodes copy them, _record_prefill)
            self._set_state(pos=pos, last=n - 1, splits=self._splits(bucket, pos, short), copy=False)
            self._wrote(pos, bucket)              # padded rows write K/V too
            most = self._max_splits(bucket, short)
            key = ("prefill_short" if short else "prefill", bucket, most)
            self._run(key, lambda: self._record_prefill(bucket, most, short))
        return True

    def prefill(self, tokens, start: int, cancel=None, all_logits: bool = False) -> np.ndarray | None:
        self._enter()
        tokens = np.asarray(tokens, np.int32)
        if all_logits:   # tests: every position, one decode-style head per row
            rows = []
            for i, t in enumerate(tokens):
                rows.append(self.decode(int(t), start + i))
            return np.stack(rows)
        if not self._prefill_layers(tokens, start, cancel):
            return None
        self._run(("head", None), lambda: self._record_head(self.arena["x_last"], None))
        return self._logits()

    def _logits(self) -> np.ndarray:
        self.stream.synchronize()
        return self.arena["logits"].copy_to_host(stream=self.stream)[0]

    def decode(self, token: int, pos: int) -> np.ndarray:
        self._enter()
        self._set_state(pos=pos, token=token)
        self._wrote(pos, 1)
        self._decode_step(None, pos)
        return self._logits()

    def prefill_sample(self, tokens, start: int, sampler, history, cancel=None, checked: bool = False) -> int | None:
        self._enter()
        if sampler.want_probs:
            logits = self.prefill(tokens, start, cancel)
            return None if logits is None else sampler.sample(logits, history)
        if sampler.constraint is not None:
            self._begin_request(sampler, history)
            if not self._prefill_layers(np.asarray(tokens, np.int32), start, cancel):
                return None
            self._run(("head", None), lambda: self._record_head(self.arena["x_last"], None))
            self._draw_graph(self._mask_step(sampler), advance=False)
            self.stream.synchronize()
            token = self._read_token()
            sampler.constraint.accept(token)
            return token
        if self._req.sampler is not sampler:     # bad parameters refused before any device work
            from genie_rt.engine import gpu_sampling
            if checked:     # the caller validated them and the history's ids: what only this workspace limits
                gpu_sampling.check_workspace(self.sws, sampler.params)
            else:           # the history's ids too (a list of ~500 made an array: 0.03-0.06 ms on H100 hosts)
                gpu_sampling.check_request(self.sws, sampler.params, history)
        if not self._prefill_layers(np.asarray(tokens, np.int32), start, cancel):
            return None
        self._begin_request(sampler, history, wait=False)   # while the device runs the prefill
        mode = "greedy" if self._req.greedy else "full"
        self._run(("head", mode), lambda: self._record_head(self.arena["x_last"], mode))
        self.stream.synchronize()
        return self._read_token()

    def sample_logits(self, logits: np.ndarray, sampler, history) -> int:
        """prefill_sample's draw from host logits: uploaded to the head's output, then the
        sampling graph of a prefill's head (same RNG step, penalty ring and grammar mask), so
        the request's device state is what prefill_sample leaves."""
        self._enter()
        if sampler.want_probs:
            return sampler.sample(logits.copy(), history)
        self._begin_request(sampler, history)
        self.stream.synchronize()
        out = self.arena["logits"]
        out.copy_to_device(np.ascontiguousarray(logits, np.float32).reshape(out.shape), stream=self.stream)
        self._draw_graph(self._mask_step(sampler), advance=False)
        self.stream.synchronize()
        token = self._read_token()
        if sampler.constraint is not None:
            sampler.constraint.accept(token)
        return token

    def decode_sample(self, token: int, pos: int, sampler, history) -> int:
        self._enter()
        if sampler.want_probs or sampler.constraint is not None:
            return sampler.sample(self.decode(token, pos), history)
        self._begin_request(sampler, history[:-1] if history and history[-1] == token else history)
        self._set_state(pos=pos, token=token)
        self._wrote(pos, 1)
        mode = "greedy" if self._req.greedy else "full"
        self._decode_step(mode, pos)
        self.stream.synchronize()
        return self._read_token()

    def decode_tokens(self, token: int, pos: int, sampler, history):
        """Yield the tokens that follow `token` (at `pos`), one decode step each, with the
        device one step ahead of the host (it never waits for Python between tokens)."""
        self._enter()
        if sampler.want_probs:
            yield from self._host_sampled(token, pos, sampler, history)
            return
        self._begin_request(sampler, history[:-1] if history and history[-1] == token else history)
        self._set_state(pos=pos, token=token)
        if sampler.constraint is not None:
            yield from self._constrained(pos, sampler)
            return
        mode = "greedy" if self._req.greedy else "full"
        pending: deque = deque()

        step = [pos]

        def launch():
            self._wrote(step[0], 1)           # each replay writes the next position
            self._decode_step(mode, step[0])
            step[0] += 1
            ev = event()
            ev.record(self.stream)
            pending.append(ev)

        try:
            launch()
            while True:
                launch()
                pending.popleft().synchronize()
                yield self._read_token()
        finally:
            self.stream.synchronize()

    # -- benchmark helpers --------------------------------------------------------------
    def roofline(self) -> dict:
        from genie_rt.quant.gemv_bench import measure_bandwidth
        bw = measure_bandwidth(self.stream, 1 << 30)
        return {"bytes_per_token": self.lay.stream_bytes_per_token, "bandwidth": bw["read_tbs"] * 1e12}

    def peak_memory_bytes(self) -> int:
        from numba import cuda
        free, total = cuda.current_context().get_memory_info()
        return int(total - free)
