"""The CUDA back-end: Qwen3 on Numba kernels, one arena, CUDA graphs for every step.

Load (all before the first token):
  1. `CudaLayout` lays out every buffer - weights in the planar device layout
     (quant/layout.py; Q/K/V and gate/up stacked where their types agree, so one GEMM
     serves them), norms, RoPE tables, the KV pool, prefill and decode scratch, the
     sampler - and `cuda_budget` checks its size against free memory.
  2. One `Arena` is allocated; weights are packed tensor by tensor from the memory-mapped
     file into it (on an integrated GPU the file's pages are dropped as they are copied,
     so the weights exist once in the shared memory).
  3. Every kernel is compiled and the decode step and the prefill buckets are captured
     into CUDA graphs (a first, uncaptured run compiles; the capture records).

Decode step (one token, `_record_decode`), per layer - 9 launches, one graph:
    q8(rmsnorm(x) * attn_norm)                      engine/norm.py (one fused launch)
    qkv = [Wq h | Wk h | Wv h]                      one GEMV launch, mixed types allowed
    q, cache <- qk_norm + rope(qkv) at state[0]     kvcache/rope_write.py
    a = attention(q, cache[0 .. state[0]])          kvcache/attention.py (flash-decoding)
    x += Wo q8(a)                                   GEMV with fused residual
    q8(rmsnorm(x) * ffn_norm)                       one fused launch
    f = silu(Wg h) * (Wu h)                         one GEMV launch
    x += Wdown q8(f)
then the head: rmsnorm, the output GEMV into the logits, sampling on the GPU (the token
goes to state[1] for the next replay and to a host-mapped slot for streaming), and
state[0] += 1. Between replays the host only reads the token: replays run one step
ahead of the host, so the GPU never waits for Python.

Prefill (`_record_prefill`): layer-major over a chunk of N tokens (N rounded up to a
bucket so graphs are reused; padded rows are computed and ignored): the MMQ GEMM with
fused RMSNorm in its input conversion, tensor-core causal attention over the cache
(positions < start come from earlier chunks or prefix reuse), logits for the last real
token only (`gather_row` picks it by an index in device memory).

State (int32, device): [0] position (decode) / chunk start (prefill), [1] current
token, [2] draws this request, [3] tokens in the penalty ring (engine/gpu_sampling.py),
[4] last real row of the prefill chunk.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from genie_rt.kvcache.pool import KVShape
from genie_rt.quant.formats import QType
from genie_rt.quant.layout import PLANES, PackedWeight, pack

from .arena import Arena, ArenaLayout
from .config import EngineConfig, ModelConfig
from .gguf_file import GGUFError, GGUFFile
from .h2d import pinned_like, upload
from .memory import MemoryBudget, MemoryPlan, mem_available_bytes
from .qwen3 import check_tensors

log = logging.getLogger("genie_rt.cuda")

MiB = 1 << 20
# Prefill graph sizes: a prompt runs as the smallest bucket that holds it (padded rows are
# computed and ignored). Up to 64 each size compiles its own GEMM tile (8 tokens per mma
# column), so the buckets are dense where home commands live (18-48 tokens after the
# chat template). Qwen3-4B on the H200 (tools/profile_prefill.py, 2026-11-29): 40 tokens
# 6.33 ms, 64 tokens 8.52 ms, so a 33-token prompt gains 26 % from the 40 bucket. Each
# bucket costs compile and capture time at load (~25 s on the H200 for a new tile width),
# which is why 24 (pp18: +3.5 %) is not one.
BUCKETS = (16, 32, 40, 48, 64, 128, 256, 512)
OUT_SLOTS = 64                    # host-mapped ring of sampled tokens
S_POS, S_TOKEN, S_DRAWS, S_HIST, S_LAST = 0, 1, 2, 3, 4
OVERHEAD_DISCRETE = 384 * MiB     # modules, graphs, numba and driver allocations
OVERHEAD_INTEGRATED = 512 * MiB   # the same plus the interpreter's share of the one pool
RESERVE_DISCRETE = 512 * MiB
RESERVE_INTEGRATED = 1536 * MiB   # OS, speech-to-text, text-to-speech, Home Assistant
MAX_BIAS = 256
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# =====================================================================================
# Layout: every buffer, before anything is allocated
# =====================================================================================
@dataclass
class WeightGroup:
    """Matrices stacked by rows into one set of planes (same type, same columns)."""
    name: str                      # arena prefix, e.g. "blk.3.qkv"
    members: list[tuple[str, int]]  # (GGUF tensor name, rows)
    qtype: QType
    cols: int

    @property
    def rows(self) -> int:
        return sum(r for _, r in self.members)


def _stack(prefix: str, names: list[str], tensors) -> list[WeightGroup]:
    """Consecutive tensors of equal type become one group."""
    groups: list[WeightGroup] = []
    for name in names:
        t = tensors[name]
        if groups and groups[-1].qtype == t.qtype and groups[-1].cols == t.shape[1]:
            groups[-1].members.append((name, t.shape[0]))
        else:
            groups.append(WeightGroup(f"{prefix}{len(groups)}", [(name, t.shape[0])], t.qtype, t.shape[1]))
    return groups


@dataclass
class CudaLayout:
    layout: ArenaLayout
    groups: dict[str, list[WeightGroup]]  # per layer key "i.qkv", "i.o", "i.gu", "i.down", and "embd", "out"
    norms: list[str]
    kv_shape: KVShape
    weight_bytes: int
    stream_bytes_per_token: int            # what one decode step reads from weights
    chunk: int
    decode_plan: object
    prefill_plan: object
    mmq_workspace: int
    mixed_qkv: bool
    split_gu: bool


def _plane_entries(layout: ArenaLayout, g: WeightGroup) -> None:
    from genie_rt.quant.formats import BLOCK_SIZES
    nb = g.cols // BLOCK_SIZES[g.qtype][0]
    for plane, _, size, dt in PLANES[g.qtype]:
        width = nb * size // np.dtype(dt).itemsize
        layout.add(f"{g.name}.{plane}", (g.rows, width), np.dtype(dt))


def plan_layout(g: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig, n_ctx: int) -> CudaLayout:
    from genie_rt.engine import gpu_sampling
    from genie_rt.kvcache.attention import plan_decode
    from genie_rt.kvcache.attention_prefill import plan_prefill
    from genie_rt.kvcache.device_pool import DeviceKVPool
    from genie_rt.quant import gemv, mmq

    tensors = check_tensors(g, cfg)
    for name, t in tensors.items():
        if t.shape[-1:] and len(t.shape) == 2 and t.qtype not in PLANES:
            raise GGUFError(f"{g.path}: tensor '{name}' is {t.qtype.name}; the CUDA back-end reads "
                            f"{', '.join(sorted(q.name for q in PLANES))} (use --backend cpu, or re-quantize)")
    for i in range(cfg.n_layers):
        for m in MATRICES:
            t = tensors[f"blk.{i}.{m}.weight"]
            if t.qtype not in gemv.SUPPORTED or t.qtype not in mmq.SUPPORTED:
                raise GGUFError(f"{g.path}: tensor 'blk.{i}.{m}.weight' is {t.qtype.name}; the CUDA "
                                f"kernels handle {', '.join(q.name for q in mmq.SUPPORTED)} "
                                "(Q4_K_M / Q6_K / Q8_0 files); use --backend cpu")
    L = ArenaLayout()
    groups: dict[str, list[WeightGroup]] = {}
    mixed_qkv = split_gu = False
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        groups[f"{i}.qkv"] = _stack(f"{b}qkv", [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], tensors)
        groups[f"{i}.o"] = _stack(f"{b}o", [b + "attn_output.weight"], tensors)
        groups[f"{i}.gu"] = _stack(f"{b}gu", [b + "ffn_gate.weight", b + "ffn_up.weight"], tensors)
        groups[f"{i}.down"] = _stack(f"{b}down", [b + "ffn_down.weight"], tensors)
        mixed_qkv |= len(groups[f"{i}.qkv"]) > 1
        split_gu |= len(groups[f"{i}.gu"]) > 1
    groups["embd"] = _stack("embd", ["token_embd.weight"], tensors)
    if not cfg.tied_embeddings:
        groups["out"] = _stack("out", ["output.weight"], tensors)
    for gs in groups.values():
        for grp in gs:
            _plane_entries(L, grp)
    norms = [n for n in tensors if tensors[n].qtype in (QType.F32, QType.F16) and len(tensors[n].shape) == 1]
    for n in norms:
        L.add(n, tensors[n].shape, np.float32)
    weight_bytes = L.nbytes

    out_t = tensors["output.weight" if not cfg.tied_embeddings else "token_embd.weight"]
    stream = sum(tensors[f"blk.{i}.{m}.weight"].nbytes for i in range(cfg.n_layers) for m in MATRICES)
    stream += out_t.nbytes + tensors["token_embd.weight"].nbytes // cfg.vocab_size

    # -- KV pool and RoPE tables -------------------------------------------------------
    kv_shape = KVShape(cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype)
    L.add("kv_pool", (DeviceKVPool.nbytes(kv_shape),), np.uint8)
    L.add("rope.cos", (n_ctx, cfg.head_dim // 2), np.float32)
    L.add("rope.sin", (n_ctx, cfg.head_dim // 2), np.float32)

    # -- scratch ---------------------------------------------------------------------
    N, E, Q, KV, F = ecfg.prefill_chunk, cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff
    widest = max(E, Q, F)
    L.add("state", (8,), np.int32)
    L.add("ids", (N,), np.int32)
    L.add("x", (N, E), np.float32)            # residual stream
    L.add("h", (1, E), np.float32)            # decode: normed input of a GEMV
    L.add("x_last", (1, E), np.float32)
    L.add("x16", (N, widest), np.float16)     # MMQ input
    L.add("xscale", (N,), np.float32)
    L.add("qkv", (N, Q + 2 * KV), np.float32)
    if mixed_qkv:
        L.add("qkv_a", (N, Q + 2 * KV), np.float32)
        L.add("qkv_b", (N, Q + 2 * KV), np.float32)
    L.add("q", (N, cfg.n_head, cfg.head_dim), np.float32)
    L.add("attn", (N, Q), np.float32)
    L.add("ff", (N, F), np.float32)
    if split_gu:
        L.add("ff_up", (N, F), np.float32)
        L.add("ff_gate", (N, F), np.float32)
    for name, cols in (("E", E), ("Q", Q), ("F", F)):
        L.add(f"xq.{name}", (1, cols), np.int8)
        L.add(f"xs.{name}", (1, cols // gemv.Q8_BLOCK * gemv.Q8_FLOATS), np.float32)
    L.add("logits", (1, cfg.vocab_size), np.float32)
    dplan = plan_decode(cfg.n_head, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype, n_ctx)
    L.add("ws.decode", (dplan.workspace_bytes,), np.uint8)
    pplan = plan_prefill(cfg.n_head, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype, N)
    L.add("ws.prefill", (max(pplan.workspace_bytes, 16),), np.uint8)
    mmq_ws = 0
    for gs in groups.values():
        for grp in gs:
            shell = PackedWeight(grp.qtype, grp.rows, grp.cols, {})
            if grp.qtype not in mmq.SUPPORTED:
                continue
            for n in BUCKETS:
                if n <= N:
                    for mode in ("store", "add", "swiglu"):
                        if mode == "swiglu" and grp.rows % 2:
                            continue
                        mmq_ws = max(mmq_ws, mmq.workspace_bytes(shell, n, mode))
    L.add("ws.mmq", (max(mmq_ws, 16),), np.uint8)
    gpu_sampling.workspace_layout(L, cfg.vocab_size, prefix="sampler.", ring_capacity=max(n_ctx, 64),
                                  max_bias=MAX_BIAS)
    return CudaLayout(L, groups, norms, kv_shape, weight_bytes, stream, N, dplan, pplan, mmq_ws,
                      mixed_qkv, split_gu)


def _device():
    from numba import cuda
    return cuda.get_current_device()


def _is_integrated(dev) -> bool:
    """True on a GPU that shares the host's memory (Jetson); the simulator's device has no
    such attribute and counts as discrete."""
    return bool(getattr(dev, "INTEGRATED", 0))


def _drop_file_pages(fd: int, offset: int, nbytes: int, path) -> bool:
    """posix_fadvise(DONTNEED) over one tensor's bytes of the mapped file, so that on an
    integrated GPU the weights live once in the shared memory (arena), not twice (arena +
    page cache). Only advice: a file system that refuses it costs memory, not correctness,
    so a failure is logged and the caller stops asking (returns False)."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return True
    except OSError as exc:
        log.warning("%s: cannot drop the file's pages after copying them (posix_fadvise: %s); "
                    "the page cache keeps a second copy of the weights until the kernel evicts it",
                    path, exc)
        return False


def cuda_budget(g: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig) -> MemoryBudget:
    """Weights and scratch from the real layout; KV (+ RoPE table, sampler ring) per token."""
    from numba import cuda
    dev = _device()
    integrated = _is_integrated(dev)
    small = plan_layout(g, cfg, ecfg, 256)
    big = plan_layout(g, cfg, ecfg, 512)
    per_token = (big.layout.nbytes - small.layout.nbytes) // 256
    fixed = small.layout.nbytes - 256 * per_token
    if integrated:
        avail = mem_available_bytes() or 0
        where = "shared memory (MemAvailable; integrated GPU)"
        overhead, reserve = OVERHEAD_INTEGRATED, RESERVE_INTEGRATED
    else:
        free, _total = cuda.current_context().get_memory_info()
        avail, where = int(free), f"GPU memory ({dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, free)"
        overhead, reserve = OVERHEAD_DISCRETE, RESERVE_DISCRETE
    if ecfg.reserve_bytes is not None:
        reserve = ecfg.reserve_bytes
    return MemoryBudget(weights=small.weight_bytes, kv_bytes_per_token=per_token,
                        scratch=fixed - small.weight_bytes, overhead=overhead, reserve=reserve,
                        available=avail, where=where, n_ctx_train=cfg.n_ctx_train, kv_dtype=ecfg.kv_dtype)


# =====================================================================================
# The back-end
# =====================================================================================
@dataclass
class _Request:
    sampler: object = None
    greedy: bool = True
    draws: int = 0                 # tokens sampled on the device this request


class CUDABackend:
    name = "cuda"

    def __init__(self, g: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig, plan: MemoryPlan,
                 use_graphs: bool | None = None, warm: bool = True):
        from numba import cuda

        from genie_rt.engine import gpu_sampling
        from genie_rt.kvcache.attention import DecodeWorkspace
        from genie_rt.kvcache.attention_prefill import PrefillWorkspace
        from genie_rt.kvcache.device_pool import DeviceKVPool
        from genie_rt.kvcache.rope_write import rope_table
        from genie_rt.quant import ptx

        t0 = time.perf_counter()
        self.cfg, self.ecfg, self.n_ctx = cfg, ecfg, plan.n_ctx
        self.simulator = ptx.SIMULATOR
        self.use_graphs = (not self.simulator) if use_graphs is None else use_graphs
        self.lay = lay = plan_layout(g, cfg, ecfg, plan.n_ctx)
        self.stream = cuda.stream()
        self.arena = A = Arena(lay.layout)
        self.integrated = _is_integrated(_device())
        self._upload_weights(g)
        cos, sin = rope_table(plan.n_ctx, cfg.head_dim, cfg.rope_base)
        A["rope.cos"].copy_to_device(cos, stream=self.stream)
        A["rope.sin"].copy_to_device(sin, stream=self.stream)
        self.kv = DeviceKVPool(lay.kv_shape, A["kv_pool"], stream=self.stream)
        self.state = A["state"]
        self.state.copy_to_device(np.zeros(8, np.int32), stream=self.stream)
        self.dws = DecodeWorkspace(lay.decode_plan, A["ws.decode"], stream=self.stream)
        self.pws = PrefillWorkspace(lay.prefill_plan, A["ws.prefill"] if lay.prefill_plan.workspace_bytes else None)
        A["ws.mmq"].copy_to_device(np.zeros(A["ws.mmq"].shape, np.uint8), stream=self.stream)
        self.sws = gpu_sampling.workspace_from_arena(A, cfg.vocab_size, prefix="sampler.",
                                                     ring_capacity=max(plan.n_ctx, 64), max_bias=MAX_BIAS,
                                                     stream=self.stream)
        self.out = cuda.mapped_array(OUT_SLOTS, np.int32) if not self.simulator else cuda.device_array(OUT_SLOTS, np.int32)
        self._host_state = pinned_like(self.state)
        self._host_ids = pinned_like(A["ids"])
        self._slot_views = {k: (self.state[k:k + 1], self._host_state[k:k + 1]) for k in (S_POS, S_TOKEN, S_LAST)}
        self._build_views()
        self._req = _Request()
        self._graphs: dict = {}
        self.stream.synchronize()
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = 0.0
        if warm and not self.simulator:
            self.warm_up()

    # -- weights ---------------------------------------------------------------------
    def _upload_weights(self, g: GGUFFile) -> None:
        """Pack each tensor from the mapped file into its arena rows; on an integrated GPU
        drop the file's pages behind us so the weights live once in the shared memory."""
        A, s = self.arena, self.stream
        fd = os.open(g.path, os.O_RDONLY) if self.integrated and hasattr(os, "posix_fadvise") else None
        try:
            for gs in self.lay.groups.values():
                for grp in gs:
                    r0 = 0
                    for name, rows in grp.members:
                        t = g.tensors[name]
                        host = pack(t.data, t.qtype, t.shape)
                        for plane, arr in host.planes.items():
                            A[f"{grp.name}.{plane}"][r0:r0 + rows].copy_to_device(arr, stream=s)
                        s.synchronize()          # host planes are temporaries
                        r0 += rows
                        if fd is not None and not _drop_file_pages(fd, t.offset, t.nbytes, g.path):
                            os.close(fd)
                            fd = None
            from genie_rt.quant.formats import dequantize
            for n in self.lay.norms:
                t = g.tensors[n]
                A[n].copy_to_device(dequantize(t.data, t.qtype, t.shape).astype(np.float32), stream=s)
        finally:
            if fd is not None:
                os.close(fd)

    def _packed(self, grp: WeightGroup, r0: int = 0, rows: int | None = None) -> PackedWeight:
        rows = grp.rows if rows is None else rows
        planes = {p: self.arena[f"{grp.name}.{p}"][r0:r0 + rows] for p, *_ in PLANES[grp.qtype]}
        return PackedWeight(grp.qtype, rows, grp.cols, planes)

    def _matrix(self, key: str, tensor: str) -> PackedWeight:
        """The PackedWeight of one GGUF matrix (a row range of its group's planes)."""
        for grp in self.lay.groups[key]:
            r0 = 0
            for name, rows in grp.members:
                if name == tensor:
                    return self._packed(grp, r0, rows)
                r0 += rows
        raise KeyError(tensor)

    def _gemv_weight(self, w: PackedWeight):
        """The decode GEMV view of a matrix, in the configured mode where the format has it."""
        from genie_rt.quant import gemv
        modes = gemv.K.MODES[QType(w.qtype)]
        return gemv.prepare_weight(w, self.ecfg.gemv_mode if self.ecfg.gemv_mode in modes else None)

    def _build_views(self) -> None:
        from genie_rt.quant import embed
        cfg, A = self.cfg, self.arena
        self.layers = []
        for i in range(cfg.n_layers):
            b = f"blk.{i}."
            m = {k: self._matrix(key, b + k + ".weight") for key, ks in
                 ((f"{i}.qkv", ("attn_q", "attn_k", "attn_v")), (f"{i}.o", ("attn_output",)),
                  (f"{i}.gu", ("ffn_gate", "ffn_up")), (f"{i}.down", ("ffn_down",))) for k in ks}
            gw = self._gemv_weight
            self.layers.append(dict(
                g_q=gw(m["attn_q"]), g_k=gw(m["attn_k"]), g_v=gw(m["attn_v"]), g_o=gw(m["attn_output"]),
                g_gate=gw(m["ffn_gate"]), g_up=gw(m["ffn_up"]), g_down=gw(m["ffn_down"]),
                m_qkv=[self._packed(grp) for grp in self.lay.groups[f"{i}.qkv"]],
                m_o=self._packed(self.lay.groups[f"{i}.o"][0]),
                m_gu=[self._packed(grp) for grp in self.lay.groups[f"{i}.gu"]],
                m_down=self._packed(self.lay.groups[f"{i}.down"][0]),
                attn_norm=A[b + "attn_norm.weight"], ffn_norm=A[b + "ffn_norm.weight"],
                q_norm=A[b + "attn_q_norm.weight"], k_norm=A[b + "attn_k_norm.weight"],
                kv=self.kv.layer(i)))
        self.embd = self._packed(self.lay.groups["embd"][0])
        self.embd_planes = embed.device_planes(self.embd)
        out_grp = self.lay.groups["out" if "out" in self.lay.groups else "embd"][0]
        self.g_out = self._gemv_weight(self._packed(out_grp))
        self.output_norm = A["output_norm.weight"]

    # -- the recorded sequences ----------------------------------------------------------
    def _q8(self, x, key, *weights, norm_of=None):
        """q8 activations of x for the GEMVs of `weights` (no launch if none reads them).

        norm_of=(src, w): x is rmsnorm(src) * w, computed here too. When a weight reads
        q8, one rmsnorm_q8 launch writes xq, xs - and x only if a weight reads float x
        (an "f32"-mode weight); otherwise a plain rmsnorm writes x. Same values either
        way (rmsnorm_q8 is bit-identical to rmsnorm + quantize_q8)."""
        from genie_rt.engine import norm
        from genie_rt.quant import gemv
        if not gemv.needs_q8(*weights):
            if norm_of is not None:
                norm.rmsnorm(norm_of[0], norm_of[1], x, self.cfg.rms_eps, stream=self.stream)
            return None, None
        xq, xs = self.arena[f"xq.{key}"], self.arena[f"xs.{key}"]
        if norm_of is None:
            gemv.quantize_q8(x, xq, xs, stream=self.stream)
        else:
            reads_float = any(w.mode != "dp4a" for w in weights)
            norm.rmsnorm_q8(norm_of[0], norm_of[1], xq, xs, self.cfg.rms_eps, stream=self.stream,
                            out=x if reads_float else None)
        return xq, xs

    def _record_decode_layers(self) -> None:
        from genie_rt.kvcache.attention import decode_attention
        from genie_rt.kvcache.rope_write import rope_write
        from genie_rt.quant import embed, gemv
        cfg, A, s = self.cfg, self.arena, self.stream
        x, h = A["x"][:1], A["h"]
        qkv, q, attn, ff = A["qkv"][:1], A["q"][:1], A["attn"][:1], A["ff"][:1]
        embed.embed(self.embd, self.state[S_TOKEN:S_TOKEN + 1], x, stream=s, planes=self.embd_planes)
        for Lw in self.layers:
            # h = rmsnorm(x) * attn_norm and its q8: one launch (see _q8)
            xq, xs = self._q8(h, "E", Lw["g_q"], Lw["g_k"], Lw["g_v"], norm_of=(x, Lw["attn_norm"]))
            gemv.gemv_qkv(Lw["g_q"], Lw["g_k"], Lw["g_v"], h, qkv, xq=xq, xs=xs, stream=s)
            rope_write(qkv, Lw["q_norm"], Lw["k_norm"], cfg.rms_eps, A["rope.cos"], A["rope.sin"],
                       self.state, q, Lw["kv"], stream=s)
            decode_attention(q, Lw["kv"], self.state, attn, self.dws, stream=s)
            xq, xs = self._q8(attn, "Q", Lw["g_o"])
            gemv.gemv(Lw["g_o"], attn, x, xq=xq, xs=xs, residual=x, stream=s)
            xq, xs = self._q8(h, "E", Lw["g_gate"], Lw["g_up"], norm_of=(x, Lw["ffn_norm"]))
            gemv.gemv_swiglu(Lw["g_gate"], Lw["g_up"], h, ff, xq=xq, xs=xs, stream=s)
            xq, xs = self._q8(ff, "F", Lw["g_down"])
            gemv.gemv(Lw["g_down"], ff, x, xq=xq, xs=xs, residual=x, stream=s)

    def _record_head(self, x_last, sample: str | None) -> None:
        """Final norm, output projection, and (optionally) sampling of one row."""
        from genie_rt.engine import gpu_sampling
        from genie_rt.quant import gemv
        A, s = self.arena, self.stream
        h = A["h"]
        xq, xs = self._q8(h, "E", self.g_out, norm_of=(x_last, self.output_norm))
        gemv.gemv(self.g_out, h, A["logits"], xq=xq, xs=xs, stream=s)
        logits = A["logits"].reshape(self.cfg.vocab_size)
        if sample == "greedy":
            gpu_sampling.sample_greedy(self.sws, logits, self.state, self.out, stream=s)
        elif sample == "full":
            gpu_sampling.sample(self.sws, logits, self.state, self.out, stream=s)

    def _record_decode(self, sample: str | None) -> None:
        from genie_rt.engine import gpu_sampling
        self._record_decode_layers()
        self._record_head(self.arena["x"][:1], sample)
        if sample is not None:
            gpu_sampling.advance_state(self.state, stream=self.stream)

    def _record_prefill(self, n: int, n_splits: int) -> None:
        """Layer-major prefill of n rows (ids[:n]) at start = state[0]; x_last <- x[state[4]]."""
        from genie_rt.engine import norm
        from genie_rt.kvcache.attention_prefill import prefill_attention
        from genie_rt.kvcache.rope_write import rope_write
        from genie_rt.quant import embed, mmq
        from .copy_kernels import copy_cols, gather_row
        cfg, A, s = self.cfg, self.arena, self.stream
        x, xscale = A["x"][:n], A["xscale"][:n]
        qkv, q, attn, ff = A["qkv"][:n], A["q"][:n], A["attn"][:n], A["ff"][:n]
        ws = A["ws.mmq"]
        E, Q, F = cfg.n_embd, cfg.q_dim, cfg.n_ff

        def x16(cols):
            return A["x16"][:n, :cols] if cols == A["x16"].shape[1] else \
                A["x16"].reshape(-1)[:n * cols].reshape(n, cols)

        embed.embed(self.embd, A["ids"][:n], x, stream=s, planes=self.embd_planes)
        for Lw in self.layers:
            xe = x16(E)
            mmq.prepare_x(x, xe, xscale, stream=s, norm_weight=Lw["attn_norm"], eps=cfg.rms_eps)
            if len(Lw["m_qkv"]) == 1:
                mmq.mmq(Lw["m_qkv"][0], xe, xscale, qkv, "store", workspace=ws, stream=s)
            else:
                col = 0
                for j, w in enumerate(Lw["m_qkv"]):
                    tmp = A["qkv_a" if j % 2 == 0 else "qkv_b"].reshape(-1)[:n * w.rows].reshape(n, w.rows)
                    mmq.mmq(w, xe, xscale, tmp, "store", workspace=ws, stream=s)
                    copy_cols(tmp, qkv, col, stream=s)
                    col += w.rows
            rope_write(qkv, Lw["q_norm"], Lw["k_norm"], cfg.rms_eps, A["rope.cos"], A["rope.sin"],
                       self.state, q, Lw["kv"], stream=s)
            prefill_attention(q, Lw["kv"], self.state, attn, self.pws, n_splits=n_splits, stream=s)
            xa = x16(Q)
            mmq.prepare_x(attn, xa, xscale, stream=s)
            mmq.mmq(Lw["m_o"], xa, xscale, x, "add", workspace=ws, stream=s)
            mmq.prepare_x(x, xe, xscale, stream=s, norm_weight=Lw["ffn_norm"], eps=cfg.rms_eps)
            if len(Lw["m_gu"]) == 1:
                mmq.mmq(Lw["m_gu"][0], xe, xscale, ff, "swiglu", workspace=ws, stream=s)
            else:
                gate, up = A["ff_gate"][:n], A["ff_up"][:n]
                mmq.mmq(Lw["m_gu"][0], xe, xscale, gate, "store", workspace=ws, stream=s)
                mmq.mmq(Lw["m_gu"][1], xe, xscale, up, "store", workspace=ws, stream=s)
                norm.swiglu(gate, up, ff, stream=s)
            xf = x16(F)
            mmq.prepare_x(ff, xf, xscale, stream=s)
            mmq.mmq(Lw["m_down"], xf, xscale, x, "add", workspace=ws, stream=s)
        gather_row(x, self.state, S_LAST, A["x_last"], stream=s)

    # -- graphs ------------------------------------------------------------------------
    def _run(self, key, record) -> None:
        """Replay the graph for `key`. On first use the sequence runs uncaptured (compiling
        what is not compiled yet) and is then captured for the next time, so every call
        executes it exactly once (sampling and state updates are not idempotent)."""
        if not self.use_graphs:
            record()
            return
        graph = self._graphs.get(key)
        if graph is None:
            from .cuda_graph import CUDAGraph
            record()                      # this step's work (and any compilation) ...
            self.stream.synchronize()
            graph = CUDAGraph(self.stream)
            with graph.capture():         # ... then recorded, not executed again
                record()
            self._graphs[key] = graph
            return
        graph.replay()

    def warm_up(self) -> None:
        """Compile every kernel and capture the decode graphs and prefill buckets now."""
        t0 = time.perf_counter()
        self._set_state(pos=0, last=0)
        for n in BUCKETS:
            if n <= self.lay.chunk:
                self._run(("prefill", n, 1), lambda n=n: self._record_prefill(n, 1))
        for mode in (None, "greedy", "full"):
            self._run(("head", mode), lambda mode=mode: self._record_head(self.arena["x_last"], mode))
        for mode in (None, "greedy", "full"):
            self._set_state(pos=0)
            self._run(("decode", mode), lambda mode=mode: self._record_decode(mode))
        self.stream.synchronize()
        self.kv.zero(self.stream)
        self.stream.synchronize()
        self.compile_seconds = time.perf_counter() - t0
        from .kernel_cache import run_summary
        log.info("CUDA kernels compiled and %d graphs captured in %.1f s; %s", len(self._graphs),
                 self.compile_seconds, run_summary())

    # -- host <-> device per step -------------------------------------------------------
    def _set_state(self, pos: int | None = None, token: int | None = None, last: int | None = None) -> None:
        """Write some state slots (an async copy per slot from its pinned mirror; views made
        once at load, engine/h2d.py). A slot's mirror is rewritten only after the stream
        has synchronised since its last copy (every caller follows a sync)."""
        for slot, value in ((S_POS, pos), (S_TOKEN, token), (S_LAST, last)):
            if value is not None:
                dev, host = self._slot_views[slot]
                host[0] = value
                upload(dev, host, self.stream)

    def _begin_request(self, sampler, history) -> None:
        from genie_rt.engine import gpu_sampling
        if self._req.sampler is sampler:
            return
        self.stream.synchronize()
        gpu_sampling.set_request(self.sws, sampler.params, history, self.state, stream=self.stream)
        self._req = _Request(sampler, sampler.params.is_greedy, 0)

    def _read_token(self) -> int:
        tok = int(self.out[self._req.draws % OUT_SLOTS])
        self._req.draws += 1
        return tok

    # -- the back-end interface (engine/engine.py) ---------------------------------------
    def _enter(self) -> None:
        """Make the CUDA context current on the calling thread before any driver call: the
        server loads the model on one thread and generates on another."""
        if not self.simulator:
            from numba import cuda
            cuda.current_context()

    def device_info(self) -> dict:
        if self.simulator:
            return {"backend": "cuda", "device": "simulator"}
        dev = _device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return {"backend": "cuda", "device": name, "compute_capability": "%d.%d" % dev.compute_capability,
                "integrated": self.integrated, "arena_bytes": self.lay.layout.nbytes,
                "graphs": len(self._graphs), "compile_seconds": round(self.compile_seconds, 2)}

    def synchronize(self) -> None:
        self._enter()
        self.stream.synchronize()

    def _prefill_layers(self, tokens: np.ndarray, start: int, cancel=None) -> bool:
        from genie_rt.kvcache.attention_prefill import prefill_splits
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
            bucket = next((b for b in BUCKETS if b >= n and b <= chunk), n)
            if pos + bucket > self.n_ctx:
                bucket = n            # never pad past the pool
            self.stream.synchronize()  # the pinned ids buffer is about to be rewritten
            self._host_ids[:n] = part
            self._host_ids[n:bucket] = 0
            upload(self.arena["ids"], self._host_ids, self.stream, nbytes=4 * bucket)
            self._set_state(pos=pos, last=n - 1)
            splits = prefill_splits(self.lay.prefill_plan, bucket, pos)
            self._run(("prefill", bucket, splits), lambda: self._record_prefill(bucket, splits))
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
        self._run(("decode", None), lambda: self._record_decode(None))
        return self._logits()

    def prefill_sample(self, tokens, start: int, sampler, history, cancel=None) -> int | None:
        self._enter()
        self._begin_request(sampler, history)
        if not self._prefill_layers(np.asarray(tokens, np.int32), start, cancel):
            return None
        mode = "greedy" if self._req.greedy else "full"
        self._run(("head", mode), lambda: self._record_head(self.arena["x_last"], mode))
        self.stream.synchronize()
        return self._read_token()

    def decode_sample(self, token: int, pos: int, sampler, history) -> int:
        self._enter()
        self._begin_request(sampler, history[:-1] if history and history[-1] == token else history)
        self._set_state(pos=pos, token=token)
        mode = "greedy" if self._req.greedy else "full"
        self._run(("decode", mode), lambda: self._record_decode(mode))
        self.stream.synchronize()
        return self._read_token()

    def decode_tokens(self, token: int, pos: int, sampler, history):
        """Yield the tokens that follow `token` (at `pos`), one decode step each, with the
        device one step ahead of the host (it never waits for Python between tokens)."""
        from numba import cuda
        self._enter()
        self._begin_request(sampler, history[:-1] if history and history[-1] == token else history)
        self._set_state(pos=pos, token=token)
        mode = "greedy" if self._req.greedy else "full"
        replay = lambda: self._run(("decode", mode), lambda: self._record_decode(mode))  # noqa: E731
        pending: deque = deque()

        def launch():
            replay()
            ev = cuda.event(timing=False)
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
