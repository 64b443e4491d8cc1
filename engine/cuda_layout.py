"""The CUDA back-end's memory plan: every buffer laid out before anything is allocated.

`plan_layout` places, in one ArenaLayout (engine/arena.py):

- the weights, in the planar device layout (quant/layout.py). Matrices that one op reads
  together (an architecture's GROUPS: Wq|Wk|Wv, Wgate|Wup) are stacked by rows into one
  set of planes where consecutive members share a type, so one GEMM serves them; a group
  of mixed types becomes several WeightGroups;
- 1-D tensors (norm weights) as float32;
- the KV pool and one RoPE table per (base, scale, factors) the layers use;
- the activation buffers of engine/models/ops.py `scratch_widths` ([prefill_chunk, width]
  float32, decode uses row 0), the 8-bit activations of the decode GEMVs per buffer they
  are made from, the fp16 input of the prefill GEMMs, the attention and GEMM workspaces,
  the logits and the sampler's workspace.

`cuda_budget` prices two contexts to split the total into a fixed part and a per-token
part, from the very layout that will be allocated.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from genie_rt.kvcache.pool import KVShape, ring_slots
from genie_rt.quant.formats import BLOCK_SIZES, QType
from genie_rt.quant.layout import PLANES, PackedWeight

from .arena import ArenaLayout
from .config import DEFAULT_KV, EngineConfig, ModelConfig
from .gguf_file import GGUFError, GGUFFile
from .memory import MemoryBudget, mem_available_bytes
from .models import architecture
from .models.ops import attn_layers, scratch_widths
from .models.weights import check_tensors

MiB = 1 << 20
# Prefill graph sizes: a prompt runs as the smallest bucket that holds it (padded rows are
# computed and ignored). Up to 64 each size compiles its own GEMM tile (8 tokens per mma
# column), so the buckets are dense where home commands live (18-48 tokens after the
# chat template). Qwen3-4B on the H200 (tools/profile_prefill.py, 2026-11-29): 40 tokens
# 6.33 ms, 64 tokens 8.52 ms, so a 33-token prompt gains 26 % from the 40 bucket. Each
# bucket costs compile and capture time at load (~25 s on the H200 for a new tile width),
# which is why 24 (pp18: +3.5 %) is not one.
BUCKETS = (16, 32, 40, 48, 64, 128, 256, 512)
# With EngineConfig.short_prefill, a chunk of at most this many rows runs as the short prefill's one
# graph instead (engine/cuda_short_prefill.py: gemv_mma_k's 8-token build)
SHORT_ROWS = 8
# the free memory a budget counts where the CUDA simulator reports infinity (tools run on the CPU with
# NUMBA_ENABLE_CUDASIM=1, e.g. tools/bench_prefix.py --backend cuda on the fixture)
SIMULATED_FREE = 1 << 36
# Runtime overhead: what a process holds on the device beside the arena - the CUDA context,
# modules, graphs, numba's and the driver's allocations. The context reserves local memory
# (the per-thread stack, 1 KiB by default) for every thread the GPU can hold at once, so that
# term scales with the chip: SMs x threads per SM x 1 KiB (H200: 132 x 2048 -> 264 MiB; Orin
# Nano: 8 x 1536 -> 12 MiB). The base is the rest. Measured with tools/check_plan.py on the
# H200 (2026-12-03, synthetic Qwen3-0.6B / 4B Q4_K_M, 4096 context): 595 / 607 MiB outside
# the arena; base + stack term = 352 + 264 = 616 MiB. The old flat 384 MiB put the plan 19 %
# under the process's real use there.
OVERHEAD_DISCRETE = 352 * MiB     # base: context, modules, graphs, numba and driver allocations
OVERHEAD_INTEGRATED = 512 * MiB   # the same plus the interpreter's share of the one pool
STACK_BYTES = 1024                # cudaLimitStackSize's default (numba does not change it)
RESERVE_DISCRETE = 512 * MiB
RESERVE_INTEGRATED = 1536 * MiB   # OS, speech-to-text, text-to-speech, Home Assistant
MAX_BIAS = 256
Q8_SOURCES = ("h", "attn", "ff")  # buffers whose 8-bit copy a decode GEMV reads


@dataclass
class WeightGroup:
    """Matrices stacked by rows into one set of planes (same type, same columns)."""
    name: str                       # arena prefix, e.g. "blk.3.g0.0"
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
            groups.append(WeightGroup(f"{prefix}.{len(groups)}", [(name, t.shape[0])], t.qtype, t.shape[1]))
    return groups


def rope_keys(cfg: ModelConfig) -> list[tuple]:
    """The distinct (base, scale, has_factors) RoPE tables the layers use, in layer order."""
    keys = []
    for a in attn_layers(cfg, [None] * cfg.n_layers):
        k = (a.rope_base, a.rope_scale, a.window is None and cfg.rope_freqs)
        if k not in keys:
            keys.append(k)
    return keys


@dataclass
class CudaLayout:
    layout: ArenaLayout
    groups: dict[tuple, list[WeightGroup]]  # (tensor names read together) -> its stacked groups
    matrices: list[str]                     # every 2-D weight tensor, GGUF name
    norms: list[str]                        # 1-D tensors uploaded as float32
    kv_shape: KVShape                       # per-layer slots: n_ctx, or a ring for windowed layers
    weight_bytes: int
    stream_bytes_per_token: int             # what one decode step reads from weights
    chunk: int
    decode_plan: object                     # the plan the decode workspace is carved for
    prefill_plan: object                    # the plan the prefill workspace is carved for
    decode_plans: list                      # per layer (a windowed layer has its own)
    prefill_plans: list
    mmq_workspace: int
    stacked: dict[str, int]                 # "mixed" groups (several WeightGroups): the widest
    # the short-context decode graph's attention (EngineConfig.decode_short_ctx): one query head a
    # block, its own workspace; None where there is no such graph (off, or a group of one head)
    decode_plan_short: object = None
    decode_plans_short: list | None = None


def _plane_entries(layout: ArenaLayout, g: WeightGroup) -> None:
    nb = g.cols // BLOCK_SIZES[g.qtype][0]
    for plane, _, size, dt in PLANES[g.qtype]:
        width = nb * size // np.dtype(dt).itemsize
        layout.add(f"{g.name}.{plane}", (g.rows, width), np.dtype(dt))


def _check_types(g: GGUFFile, tensors) -> None:
    """Layer matrices need the decode GEMV and the prefill GEMM; the embedding table the
    lookup (and the GEMV when it is the tied output); output.weight the GEMV."""
    from genie_rt.quant import embed, gemv, mmq_plan as MP
    for name, t in tensors.items():
        if len(t.shape) != 2:
            continue
        if name.startswith("blk."):
            need = {"GEMV": gemv.SUPPORTED, "GEMM": MP.SUPPORTED}
        elif name == "token_embd.weight":
            need = {"embedding": embed.SUPPORTED, "GEMV": gemv.SUPPORTED}
        else:
            need = {"GEMV": gemv.SUPPORTED}
        need["layout"] = PLANES
        for what, types in need.items():
            if t.qtype not in types:
                raise GGUFError(f"{g.path}: tensor '{name}' is {t.qtype.name}; the CUDA {what} kernels "
                                f"handle {', '.join(sorted(QType(q).name for q in types))}; use "
                                "--backend cpu, or a file of those types")


def plan_layout(g: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig, n_ctx: int) -> CudaLayout:
    from genie_rt.engine import gpu_sampling
    from genie_rt.kvcache.attention import plan_decode
    from genie_rt.kvcache.attention_prefill import plan_prefill
    from genie_rt.kvcache.device_pool import DeviceKVPool
    from genie_rt.quant import gemv, mmq_plan as MP

    spec = architecture(cfg.arch, g.path)
    tensors = check_tensors(g, cfg, spec)
    _check_types(g, tensors)
    if ecfg.kv_dtype is None:
        ecfg = dataclasses.replace(ecfg, kv_dtype=DEFAULT_KV["cuda"])
    field_to_suffix = {t.field: suffix for suffix, t in spec.LAYER_TENSORS.items()}
    L = ArenaLayout()
    groups: dict[tuple, list[WeightGroup]] = {}
    matrices = [n for n, t in tensors.items() if len(t.shape) == 2]
    for i in range(cfg.n_layers):
        grouped = set()
        for j, fields in enumerate(spec.GROUPS):
            names = tuple(f"blk.{i}.{field_to_suffix[f]}" for f in fields)
            groups[names] = _stack(f"blk.{i}.g{j}", list(names), tensors)
            grouped.update(names)
        for name in matrices:
            if name.startswith(f"blk.{i}.") and name not in grouped:
                groups[(name,)] = _stack(name[:-len(".weight")], [name], tensors)
    for name in ("token_embd.weight", "output.weight"):
        if name in tensors:
            groups[(name,)] = _stack(name[:-len(".weight")], [name], tensors)
    stacked: dict[str, int] = {}
    for names, gs in groups.items():
        for grp in gs:
            _plane_entries(L, grp)
        if len(gs) > 1:
            stacked["any"] = max(stacked.get("any", 0), sum(grp.rows for grp in gs))
    norms = [n for n, t in tensors.items() if len(t.shape) == 1 and n != "rope_freqs.weight"]
    for n in norms:
        L.add(n, tensors[n].shape, np.float32)
    weight_bytes = L.nbytes

    out_t = tensors.get("output.weight", tensors["token_embd.weight"])
    stream = sum(tensors[n].nbytes for n in matrices if n.startswith("blk."))
    stream += out_t.nbytes + tensors["token_embd.weight"].nbytes // cfg.vocab_size

    # -- KV pool and RoPE tables -------------------------------------------------------
    N = ecfg.prefill_chunk
    windows = [cfg.window(i) for i in range(cfg.n_layers)]
    slots = tuple(n_ctx if w is None else ring_slots(w, N, n_ctx) for w in windows)
    kv_shape = KVShape(cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype, slots=slots)
    L.add("kv_pool", (DeviceKVPool.nbytes(kv_shape),), np.uint8)
    for k, _ in enumerate(rope_keys(cfg)):
        L.add(f"rope.{k}.cos", (n_ctx, cfg.head_dim // 2), np.float32)
        L.add(f"rope.{k}.sin", (n_ctx, cfg.head_dim // 2), np.float32)

    # -- scratch ---------------------------------------------------------------------
    widths = scratch_widths(cfg)
    L.add("state", (8,), np.int32)
    L.add("ids", (N,), np.int32)
    for name, width in widths.items():
        L.add(name, (N, width), np.float32)
    L.add("x_last", (1, cfg.n_embd), np.float32)
    L.add("x16", (N, max(widths.values())), np.float16)     # MMQ input
    L.add("xscale", (N,), np.float32)
    if stacked:                                             # mixed-type groups: one GEMM per part
        L.add("part_a", (N, stacked["any"]), np.float32)
        L.add("part_b", (N, stacked["any"]), np.float32)
    L.add("split_gate", (N, cfg.n_ff), np.float32)          # gate/up of different types
    L.add("split_up", (N, cfg.n_ff), np.float32)
    if ecfg.short_prefill:                                  # q8_K activations of the short prefill
        from .cuda_short_prefill import q8k_buffers
        q8k_buffers(L, widths)
    for name in Q8_SOURCES:
        cols = widths[name]
        L.add(f"xq.{name}", (1, cols), np.int8)
        L.add(f"xs.{name}", (1, cols // gemv.Q8_BLOCK * gemv.Q8_FLOATS), np.float32)
    L.add("logits", (1, cfg.vocab_size), np.float32)
    # one attention plan per kind of layer (global, or windowed with its W); the workspaces
    # are carved for the largest and shared (DecodePlan.fits)
    long_loop = decode_loop(cfg, ecfg, windows, mma_measured_here())
    kinds = {w: (plan_decode(cfg.n_head, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype, n_ctx,
                             window=w, scale=cfg.attn_scale, loop=long_loop,
                             n_splits=getattr(ecfg, "decode_attention_splits", None)),
                 plan_prefill(cfg.n_head, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype, N,
                              window=w, scale=cfg.attn_scale)) for w in dict.fromkeys(windows)}
    dplan = max((d for d, _ in kinds.values()), key=lambda d: d.workspace_bytes)
    pplan = max((p for _, p in kinds.values()), key=lambda p: p.workspace_bytes)
    for d, _ in kinds.values():
        assert d.fits(dplan), "decode plans of one model share a workspace"
    L.add("ws.decode", (dplan.workspace_bytes,), np.uint8)
    short, splan = short_plans(cfg, ecfg, windows, dplan), None
    if short:
        splan = max(short.values(), key=lambda d: d.workspace_bytes)
        assert all(d.fits(splan) for d in short.values()), "short decode plans share a workspace"
        L.add("ws.decode_short", (splan.workspace_bytes,), np.uint8)
    L.add("ws.prefill", (max(pplan.workspace_bytes, 16),), np.uint8)
    mmq_ws = 0
    for names, gs in groups.items():
        if not names[0].startswith("blk."):
            continue                                        # embedding / output: GEMV only
        for grp in gs:
            shell = PackedWeight(grp.qtype, grp.rows, grp.cols, {})
            for n in BUCKETS:
                if n <= N:
                    for mode in ("store", "add", "swiglu"):
                        if mode == "swiglu" and grp.rows % 2:
                            continue
                        mmq_ws = max(mmq_ws, MP.workspace_bytes(shell, n, mode))
    L.add("ws.mmq", (max(mmq_ws, 16),), np.uint8)
    gpu_sampling.workspace_layout(L, cfg.vocab_size, prefix="sampler.", ring_capacity=max(n_ctx, 64),
                                  max_bias=MAX_BIAS)
    return CudaLayout(L, groups, matrices, norms, kv_shape, weight_bytes, stream, N, dplan, pplan,
                      [kinds[w][0] for w in windows], [kinds[w][1] for w in windows], mmq_ws, stacked,
                      splan, [short[w] for w in windows] if short else None)


def mma_measured_here() -> bool:
    """A real device of compute capability 9.x (the H100 and H200): where the tensor-core decode
    attention was measured faster (H100, 2026-12-05). The simulator, sm_80 / sm_87 and newer chips,
    not measured, keep the default loop."""
    from genie_rt.quant import ptx
    if ptx.SIMULATOR:
        return False
    try:
        return device().compute_capability[0] == 9
    except Exception:               # noqa: BLE001 - no GPU: nothing measured
        return False


def decode_loop(cfg, ecfg, windows, measured: bool, sm_count: int | None = None) -> str | None:
    """The long-context decode graph's attention loop: EngineConfig.decode_attention_loop when
    given; by default the tensor-core loop ("mma", the whole GQA group a block) where it was
    measured: on sm_90 (`measured`), an int8 cache, a head_dim it takes (32, 64, 128), groups of 4-8
    query heads, global layers only, and beside a short-context graph that keeps the warp loop's
    one-head blocks below decode_short_ctx (where mma is slower alone: 10.8 against 9.4 us at 512).
    H100, 2026-12-05 (docs/decode-journal.md 6h): tg128 463.7 / 391.9 at depths 4,096 / 16,384
    against 457.0 / 351.7. Anything else: None (the kernel module's DEFAULT_LOOP)."""
    from genie_rt.kvcache.attention_decode_mma import check_mma
    if ecfg.decode_attention_loop is not None or not measured:
        return ecfg.decode_attention_loop
    group = cfg.n_head // cfg.n_head_kv
    if ecfg.kv_dtype != "int8" or not 4 <= group <= 8 or any(w for w in windows):
        return None
    try:
        check_mma(ecfg.kv_dtype, cfg.head_dim)
    except ValueError:
        return None
    if not short_graph_fits(cfg, ecfg, sm_count):
        return None                  # no short graph: the long one would run every position
    return "mma"


def short_graph_fits(cfg, ecfg, sm_count: int | None = None) -> bool:
    """EngineConfig.decode_short_ctx asks for a short-context graph and the GPU holds one split of
    its one-head blocks in one wave (sm_count None: the current device's SMs)."""
    from genie_rt.kvcache.attention import default_shape, wave_splits
    short = int(getattr(ecfg, "decode_short_ctx", 0) or 0)
    return short > 0 and wave_splits(cfg.n_head_kv, cfg.n_head // cfg.n_head_kv, 1, *default_shape(1),
                                     sm_count=sm_count) >= 1


def short_plans(cfg, ecfg, windows, dplan) -> dict:
    """The attention plans of the short-context decode graph, by window (EngineConfig.
    decode_short_ctx): one query head a block, the splits sized for contexts below the threshold
    (kvcache/attention.py plan_decode: one wave; decode_attention_splits is for the other graph).
    Empty when the graph is off, would take one head a block anyway (dplan: the other graph's
    plan), or when the GPU cannot hold one split of such blocks in one wave (a few SMs, as on a
    Jetson: the blocks would run in two waves; the H200 measurement does not speak for that).
    With the tensor-core loop ("mma": the whole GQA group a block) in the other graph, this one
    keeps the default loop's one-head blocks (decode_short_ctx 0 with --attention-loop mma: mma at
    every position; decode_loop's default needs this graph)."""
    from genie_rt.kvcache.attention import plan_decode
    if dplan.heads_per_block == 1 or not short_graph_fits(cfg, ecfg):
        return {}
    short = int(ecfg.decode_short_ctx)
    # sized for the threshold, not the pool: the workspace does not grow with the context
    loop = None if dplan.loop == "mma" else ecfg.decode_attention_loop
    return {w: plan_decode(cfg.n_head, cfg.n_head_kv, cfg.head_dim, ecfg.kv_dtype, short,
                           window=w, scale=cfg.attn_scale, loop=loop,
                           heads_per_block=1) for w in dict.fromkeys(windows)}


def device():
    from numba import cuda
    return cuda.get_current_device()


def is_integrated(dev) -> bool:
    """True on a GPU that shares the host's memory (Jetson); the simulator's device has no
    such attribute and counts as discrete."""
    return bool(getattr(dev, "INTEGRATED", 0))


def runtime_overhead(dev, integrated: bool) -> int:
    """The runtime overhead term for device `dev` (see OVERHEAD_DISCRETE): base plus the
    context's local-memory reservation. A device without the attributes (the simulator's)
    gets the base alone."""
    sms = int(getattr(dev, "MULTIPROCESSOR_COUNT", 0) or 0)
    threads = int(getattr(dev, "MAX_THREADS_PER_MULTIPROCESSOR", 0) or 0)
    base = OVERHEAD_INTEGRATED if integrated else OVERHEAD_DISCRETE
    return base + sms * threads * STACK_BYTES


def cuda_budget(g: GGUFFile, cfg: ModelConfig, ecfg: EngineConfig) -> MemoryBudget:
    """Weights and scratch from the real layout; KV (+ RoPE tables, sampler ring) per token.

    Two layouts, both at contexts past every ring's size, give the per-token cost; the
    sliding-window rings (their size does not grow with the context) are `kv_fixed`. Below
    the ring size a ring is the context's size, so the plan is conservative there."""
    from genie_rt.kvcache.device_pool import DeviceKVPool
    from numba import cuda
    dev = device()
    integrated = is_integrated(dev)
    if ecfg.kv_dtype is None:
        ecfg = dataclasses.replace(ecfg, kv_dtype=DEFAULT_KV["cuda"])
    rings = [ring_slots(w, ecfg.prefill_chunk, 1 << 30) for w in cfg.layer_windows if w is not None]
    base = max(rings, default=0) + 256
    small = plan_layout(g, cfg, ecfg, base)
    big = plan_layout(g, cfg, ecfg, base + 256)
    per_token = -(-(big.layout.nbytes - small.layout.nbytes) // 256)
    ring_bytes = DeviceKVPool.nbytes(small.kv_shape) - len(small.kv_shape.global_layers) * base \
        * small.kv_shape.layer_bytes_per_position if rings else 0
    fixed = small.layout.nbytes - base * per_token - ring_bytes
    if integrated:
        avail = mem_available_bytes() or 0
        where = "shared memory (MemAvailable; integrated GPU)"
        overhead, reserve = runtime_overhead(dev, True), RESERVE_INTEGRATED
    elif ecfg.mapped_memory:              # the arena is mapped host memory: host memory pays for it
        avail = mem_available_bytes() or 0
        where = "host memory (MemAvailable; --mapped-memory)"
        overhead, reserve = runtime_overhead(dev, False), RESERVE_DISCRETE
    else:
        free, _total = cuda.current_context().get_memory_info()
        free = free if math.isfinite(free) else SIMULATED_FREE       # (the simulator says infinity)
        name = getattr(dev, "name", "CUDA simulator")
        avail, where = int(free), f"GPU memory ({name.decode() if isinstance(name, bytes) else name}, free)"
        overhead, reserve = runtime_overhead(dev, False), RESERVE_DISCRETE
    if ecfg.reserve_bytes is not None:
        reserve = ecfg.reserve_bytes
    return MemoryBudget(weights=small.weight_bytes, kv_bytes_per_token=per_token,
                        scratch=fixed - small.weight_bytes, overhead=overhead, reserve=reserve,
                        available=avail, where=where, n_ctx_train=cfg.n_ctx_train, kv_dtype=ecfg.kv_dtype,
                        kv_fixed=max(0, ring_bytes))
