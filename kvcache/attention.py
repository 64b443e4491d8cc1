"""Decode attention over the KV pool: one query token, every head, INT8 or FP16 cache.

The math (engine/models/reference.py `attention`, n = 1): for each query head h of KV head
j = h // group,

    out[h] = softmax(q[h] . K[0:ctx, j]^T / sqrt(hd)) @ V[0:ctx, j]       ctx = state[0] + 1

with K, V dequantized row by row (int8 q * row scale). `state[0]` (the position of the
query token) is read from device memory, so one captured CUDA graph serves every
position. Compile-time variants (`decode_kernel(..., window, scale)`): a sliding window
W reads only positions max(0, pos - W + 1) .. pos (Gemma 3's local layers; llama.cpp
masks key p0 for query p1 when p1 - p0 >= W), through a ring of R slots (position p in
slot p % R, kvcache/device_pool.py) when the layer is one; the scale 1/sqrt(hd) may be
replaced (Gemma 3 27B).

Here: the numpy references (`attention_window_reference`, `decode_reference`,
`dequantize_cache`), the plan fixed when the decode step is captured (`plan_decode`:
the split count), the workspace (`DecodeWorkspace`) and the launcher (`decode_attention`,
which checks every argument). The flash-decoding kernel - how a block splits the context,
reads the cache and merges the splits, and its traffic - is in
kvcache/attention_decode_kernels.py.

Prefill (causal, many query tokens, tensor cores) is in kvcache/attention_prefill.py.
`python -m genie_rt.kvcache.attention` validates both against numpy and times them.

Deliberately not here: f32 caches (the CPU pool has them; the CUDA back-end uses int8 or
f16), ALiBi, soft-capping, chunked or symmetric windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from genie_rt.engine.models.reference import attention as attention_reference
from genie_rt.quant.pdl import launch_or_plain
from genie_rt.quant.ptx import SIMULATOR

from .attention_decode_kernels import (DECODE_SIGNATURE, DECODE_SIGNATURE_Q8, DEFAULT_LOOP, LOOPS, MAX_SPLITS,
                                       decode_kernel, rope_signature)
from .attention_decode_mma import check_mma
from .device_pool import KVLayer
from .rope_write import check_rope_args

_ALIGN = 256
# Query heads of one KV head a decode block takes by default. Fewer heads a block means more
# blocks, each with a shorter chain of dependent instructions (a q slice and accumulators per
# head, the final reduction, the merge) and fewer registers; the K/V rows are then read
# group / heads_per_block times, from L2. Measured on the H200 (2026-12-03, `python -m
# genie_rt.kvcache.attention`, Qwen3-4B shapes, int8 cache; us per launch at ctx 512 / 1024 /
# 4096 / 16384): 4 heads (33 splits) 11.65 / 14.16 / 21.24 / 38.24; 2 heads (16 splits)
# 8.97 / 10.25 / 16.73 / 42.10; 1 head (8 splits) 7.70 / 9.40 / 20.06 / 65.33.
# docs/kernels/attention.md has the whole table.
DEFAULT_HEADS_PER_BLOCK = 2
KV_DTYPES = {np.dtype(np.int8): "int8", np.dtype(np.float16): "f16"}


# =====================================================================================
# numpy reference
# =====================================================================================
def attention_window_reference(q, k, v, start, window=0, scale=None):
    """Causal GQA attention with an optional sliding window, float64.

    q [n, n_head, hd] at positions start .. start+n-1; k, v float [start+n, n_kv, hd]
    (positions 0 .. start+n-1, in position order). Query i sees keys p with
    p <= start + i and, when window W > 0, start + i - p < W (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD masks p when start + i - p >= W). scale: the score scale
    (None: 1 / sqrt(hd)). window 0 and scale None give engine/models/reference.py's attention
    exactly. Returns [n, n_head * hd]."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    n, n_head, hd = q.shape
    if not window and scale is None:
        return attention_reference(q, k, v, start)
    n_kv = k.shape[1]
    group = n_head // n_kv
    total = k.shape[0]
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)           # [kv, group, n, hd]
    s = (qg @ k.transpose(1, 2, 0)[:, None]) * (1 / np.sqrt(hd) if scale is None else scale)
    qpos = start + np.arange(n)[:, None]
    kpos = np.arange(total)[None, :]
    mask = kpos > qpos
    if window:
        mask |= qpos - kpos >= window
    s = np.where(mask, -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v.transpose(1, 0, 2)[:, None]                            # [kv, group, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, n_head * hd)


def decode_reference(q, k, v, pos, window=0, scale=None):
    """q [n_head, hd]; k, v float [>= pos+1, n_kv, hd] (the dequantized cache, in position
    order) -> [n_head * hd] float64: attention of the token at `pos` over positions
    0 .. pos (window W > 0: max(0, pos - W + 1) .. pos)."""
    q = np.asarray(q, np.float64)[None]
    return attention_window_reference(q, k[:pos + 1], v[:pos + 1], pos, window, scale)[0]


def dequantize_cache(stored, scale):
    """Host cache rows (int8 + scales, or f16) -> float64 [..., hd]."""
    x = np.asarray(stored, np.float64)
    return x * np.asarray(scale, np.float64)[..., None] if scale is not None else x


# =====================================================================================
# plan, workspace, launcher
# =====================================================================================
def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# The merge's partials loaded together with the splits' (max, sum) (decode_kernel's merge_pf; the
# same bits). A lab knob, read when a plan's kernel is built. Timed in the 4B's step on the H200
# (2026-12-05, tools/profile_decode.py --settings chain, docs/decode-journal.md 6g): 15 us faster at
# depth 4,096, the same at 2,048, 15-25 us slower at 512 (the short graph's one-head blocks):
# off. Its companion of that day, the new K/V row kept in shared memory (the "stash"), was no
# faster at any depth and was removed (it stays in commit 4bb5b43). A loop's name ("mma") turns it
# on for that loop's plans alone: since 2026-12-05 positions below decode_short_ctx run the short
# graph's one-head plan, and the long graph's plan on sm_90 is the mma loop, which the timing above
# predates (profile_decode --depth 4096 --settings chain times it there).
MERGE_PREFETCH: bool | str = False
# Scores by dp4a (decode_kernel's qk8; int8 caches): q quantized to int8 a lane's 16 values at a
# time, as llama.cpp's vector kernel does for quantized caches. Other numbers than the float q
# (cosine, not bits). Timed on the H200 (2026-12-05): the 4B's step 25 us faster at depth 4,096
# (2.014 -> 1.989 ms), 7 us slower at 64; its logits' cosine with the float q's 0.9987 / 0.9979
# at depth 64 / 4,096 (the CPU back-end's parity test, 0.998, passed). A lab knob, off.
QK_DP4A = False
# The warp loops' rescale of a head's accumulators only when some lane of the warp saw its max grow
# (decode_kernel's skip_rescale, a warp vote): 32 of a trip's ~350 instructions at two heads, the
# same bits (x * 1 is x). Built 2026-12-05 without a GPU (docs/decode-journal.md 7, item 4); a lab
# knob, off, until profile_decode --settings skip times it.
SKIP_RESCALE = False
# The "mma" loop's splits cut by a warp's trips (16-row chunks) as evenly as they go, not by whole
# tiles of warps x 16 rows (decode_kernel's even_splits). With tiles, the 4B's 16 splits of 8 x 16 rows
# at 4,097 keys (genie-rt bench's depth 4,096) are 11 of 3 tiles: 88 of 132 SMs busy, each with 24
# chunks; evenly, 16 of 16-17 chunks: 128 SMs. 12 warps a block (also 2 trips at 4,097, 11 blocks of
# 24 chunks) was no faster (H100, 2026-12-07: tg128 at depth 4,096 481.2 against 486.9 with 8):
# a block's time follows its chunks, not its trips. Evenly (same H100 kind, the next call): 495.8
# against 486.9, +1.8 % (docs/decode-journal.md 7); logits cosine 0.9986 with the tiles' cut (another
# grouping of the f16 P'). On; a knob, read when a plan's kernel is built.
MMA_EVEN_SPLITS = True


@dataclass(frozen=True)
class DecodePlan:
    """Everything fixed when the decode step is captured (one plan per layer kind: a model
    with sliding-window layers has a global plan and a windowed one)."""
    n_head: int
    n_kv: int
    head_dim: int
    kv_dtype: str              # "int8" | "f16"
    n_splits: int              # blocks along the context per (kv head, subgroup)
    n_sub: int                 # head subgroups per kv head (group / heads_per_block)
    warps: int = 4
    rows_per_thread: int = 4   # loop "mma": 16-row chunks a warp's trip
    window: int = 0            # 0: every key 0 .. pos; W: keys pos - W + 1 .. pos (ring-safe)
    scale: float | None = None  # attention scale; None: 1 / sqrt(head_dim)
    loop: str = DEFAULT_LOOP   # how a block walks its rows (LOOPS; engine/config.py says why this one)

    @property
    def heads_per_block(self) -> int:
        return self.n_head // self.n_kv // self.n_sub

    @property
    def tile(self) -> int:
        if self.loop == "mma":           # rows_per_thread: 16-row chunks a warp's trip
            return self.warps * 16 * self.rows_per_thread
        lpr = self.head_dim // (16 if self.kv_dtype == "int8" else 8)
        return self.warps * (32 // lpr) * self.rows_per_thread

    def kernel(self, q8: bool = False, pdl: bool = False, rope: str = "", qk_norm: bool = True,
               ring: bool = False):
        """The kernel of this plan; rope (a ROPE build, decode_rope_attention): "neox" | "normal"."""
        return decode_kernel(self.head_dim, self.heads_per_block, self.kv_dtype, self.warps,
                             self.rows_per_thread, self.window, self.scale, q8, pdl, self.loop,
                             rope, bool(qk_norm), bool(ring), MERGE_PREFETCH in (True, self.loop),
                             QK_DP4A and self.kv_dtype == "int8", SKIP_RESCALE,
                             MMA_EVEN_SPLITS and self.loop == "mma")

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the workspace buffer (partials + tickets)."""
        return (_aligned(self.n_splits * self.n_head * self.head_dim * 4)
                + _aligned(self.n_splits * self.n_head * 2 * 4)
                + _aligned(self.n_kv * self.n_sub * 4))

    def fits(self, ws_plan: "DecodePlan") -> bool:
        """Whether this plan can run in a workspace carved for ws_plan (same heads and
        subgroups, no more splits): a windowed plan shares the global plan's workspace."""
        return ((self.n_head, self.n_kv, self.head_dim, self.n_sub)
                == (ws_plan.n_head, ws_plan.n_kv, ws_plan.head_dim, ws_plan.n_sub)
                and self.n_splits <= ws_plan.n_splits)


def default_shape(heads_per_block: int) -> tuple[int, int]:
    """(warps, rows a thread) of a block by default: 8 warps of 2 rows at up to two heads a block,
    4 of 4 at more (whose 249 registers and shared memory per warp would not take 8). The same
    64-row tile for int8 at hd 128 either way; 8 x 2 halves a warp's trip and takes 126 registers
    instead of 168. The 4B's step (H200, 2026-12-04 18:03-18:06 UTC, tools/profile_decode.py
    --settings plan, two passes): depth 4,096 2.020 / 2.021 ms against 4 x 4's 2.074 / 2.096,
    depth 512 1.826 / 1.817 against 1.822 / 1.862, depth 64 1.776 / 1.793 against 1.803 / 1.789
    (docs/kernels/attention.md)."""
    return (8, 2) if heads_per_block <= 2 else (4, 4)


# registers a thread of the decode kernels (ptxas 13, sm_90, the engine's build: warp loop, PDL,
# rope, q8), by heads a block and rows a thread: what `_blocks_per_sm` sizes the splits by
_REGISTERS = {(2, 4): 168, (2, 2): 126, (2, 1): 125, (4, 4): 249}


# the "mma" loop (the whole group a block, up to 8 heads), by 16-row chunks a warp's trip: ptxas 13,
# sm_90, the engine's build (PDL, rope, q8; head_dim 128, 4 heads), 2026-12-05. 8 warps of one chunk
# take 161. Its block shape by default (warps, chunks a trip): 8 x 1, one block an SM, 16 splits on
# the 4B - alone on an H100 (2026-12-05, docs/decode-journal.md 6h) 14.24 / 23.59 us at depths 4,096 /
# 16,384 against 20.28 / 31.88 for 4 x 1 (three blocks an SM, 49 splits): more splits cost more
# than the occupancy gains, as for the warp loop
_MMA_REGISTERS = {1: 158, 2: 248}
MMA_SHAPE = (8, 1)


def blocks_at(registers: int, warps: int) -> int:
    """Blocks of `warps` warps an SM holds at `registers` a thread (65,536 registers an SM,
    allocated in steps of 8 a thread)."""
    return max(1, 65536 // (-(-registers // 8) * 8 * 32 * warps))


def _blocks_per_sm(heads_per_block: int, warps: int, rows_per_thread: int, loop: str = "") -> int:
    """Blocks an SM the default split count is sized for: one wave of the kernel at its occupancy.
    4 warps of 4 rows at two heads (168 registers) make 3 an SM, 8 warps of 2 rows (126) 2 (a shape
    not in `_REGISTERS` counts as its heads' 4-row one). The 4B's step at depth 4,096 with 4 x 4
    (H200, 2026-12-04 17:48 UTC, --settings splits): 16 splits (2 an SM) 2.113 / 2.131 ms, 24 (3)
    2.071 / 2.089, 32 (two waves) 2.081 / 2.084."""
    if loop == "mma":
        return blocks_at(_MMA_REGISTERS.get(rows_per_thread, _MMA_REGISTERS[1]), warps)
    gh = 2 if heads_per_block <= 2 else 4
    return blocks_at(_REGISTERS.get((gh, rows_per_thread), _REGISTERS[(gh, 4)]), warps)


def wave_splits(n_kv: int, n_sub: int, heads_per_block: int, warps: int, rows_per_thread: int,
                sm_count: int | None = None, loop: str = "") -> int:
    """Splits of one wave: the blocks the SMs hold at the kernel's occupancy (`_blocks_per_sm`)
    over the blocks of a split (n_kv * n_sub); 0 when one split is already more than a wave.
    sm_count None: the current device's (132 without a GPU)."""
    if sm_count is None:
        sm_count = 132 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
    return (_blocks_per_sm(heads_per_block, warps, rows_per_thread, loop) * sm_count) // (n_kv * n_sub)


def plan_decode(n_head: int, n_kv: int, head_dim: int, kv_dtype: str, n_ctx: int,
                n_splits: int | None = None, sm_count: int | None = None,
                warps: int | None = None, rows_per_thread: int | None = None, window: int | None = None,
                scale: float | None = None, heads_per_block: int | None = None,
                loop: str | None = None) -> DecodePlan:
    """Choose the split count for a pool of n_ctx positions (default: one wave of blocks at full
    context - `_blocks_per_sm` - at least one tile per split, at most MAX_SPLITS). warps,
    rows_per_thread: the block's shape (None: `default_shape`). loop: how a block
    walks its rows (LOOPS; None: DEFAULT_LOOP). heads_per_block:
    query heads of one KV head a block takes (default: the largest divisor of the group up to
    DEFAULT_HEADS_PER_BLOCK; at most what fits in registers). window: None or
    0 for a global layer, W >= 1 for a sliding-window layer (keys pos - W + 1 .. pos; the
    splits then cover W keys, not n_ctx). scale: the attention scale (None: 1/sqrt(hd))."""
    if kv_dtype not in ("int8", "f16"):
        raise ValueError(f"decode attention supports KV dtypes int8 and f16, not '{kv_dtype}'")
    if n_head % n_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv {n_kv}")
    vec = 16 if kv_dtype == "int8" else 8
    if head_dim % vec or head_dim // vec == 0 or 32 % (head_dim // vec):
        raise ValueError(f"head_dim {head_dim} unsupported: need head_dim / {vec} to divide 32")
    loop = DEFAULT_LOOP if loop is None else loop
    if loop not in LOOPS:
        raise ValueError(f"decode attention loop '{loop}' is not one of {LOOPS}")
    mma = loop == "mma"
    if mma:
        check_mma(kv_dtype, head_dim)
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"window {window} must be >= 1 (or 0 / None: a global layer)")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"attention scale {scale} must be finite and > 0")
    group = n_head // n_kv
    max_gh = 8 if mma else 64 // vec             # mma: its n = 8; else q slice + accumulators <= 2 x 64
    if heads_per_block is None:                  # mma: the whole group, as far as 8 go
        heads_per_block = next(h for h in range(min(group, max_gh if mma else DEFAULT_HEADS_PER_BLOCK),
                                                0, -1) if group % h == 0)
    if not (1 <= heads_per_block <= min(group, max_gh) and group % heads_per_block == 0):
        raise ValueError(f"heads_per_block {heads_per_block} must divide the group of "
                         f"{group} query heads per KV head and be <= {max_gh}")
    n_sub = group // heads_per_block
    dw, dr = MMA_SHAPE if mma else default_shape(heads_per_block)
    warps = dw if warps is None else warps
    rows_per_thread = dr if rows_per_thread is None else rows_per_thread
    plan = DecodePlan(n_head, n_kv, head_dim, kv_dtype, 1, n_sub, warps, rows_per_thread, loop=loop)
    keys = min(n_ctx, window) if window else n_ctx
    tiles = -(-keys // plan.tile)
    if n_splits is None:
        n_splits = max(1, wave_splits(n_kv, n_sub, heads_per_block, warps, rows_per_thread, sm_count,
                                      loop))
    n_splits = max(1, min(n_splits, tiles, MAX_SPLITS))
    return DecodePlan(n_head, n_kv, head_dim, kv_dtype, n_splits, n_sub, warps, rows_per_thread,
                      window, None if scale is None else float(scale), loop)


class DecodeWorkspace:
    """Zero-copy views of the workspace buffer (carved once, at load).

    part_o f32 [n_splits, n_head * hd], part_ml f32 [n_splits, 2 * n_head],
    tickets i32 [n_kv * n_sub] (zeroed here; every launch leaves them zero)."""

    def __init__(self, plan: DecodePlan, buf=None, stream=0):
        self.plan = plan
        nb = plan.workspace_bytes
        if buf is None:
            buf = cuda.device_array(nb, np.uint8)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < nb:
            raise ValueError(f"decode workspace must be a uint8 device buffer of >= {nb} bytes")
        S, H, D = plan.n_splits, plan.n_head, plan.head_dim
        a = _aligned(S * H * D * 4)
        b = a + _aligned(S * H * 2 * 4)
        self.part_o = buf[:S * H * D * 4].view(np.float32).reshape(S, H * D)
        self.part_ml = buf[a:a + S * H * 2 * 4].view(np.float32).reshape(S, 2 * H)
        self.tickets = buf[b:b + plan.n_kv * plan.n_sub * 4].view(np.int32)
        self.tickets.copy_to_device(np.zeros(plan.n_kv * plan.n_sub, np.int32), stream=stream)


def compile_decode(plan: DecodePlan, q8: bool = False, pdl: bool = False) -> None:
    """Compile the plan's kernel now (at load), not on the first token; q8: the variant that
    also writes out's q8 activations (decode_attention(..., xq=, xs=)); pdl: its
    programmatic-dependent-launch build (sm_90+)."""
    if not SIMULATOR:
        plan.kernel(q8, pdl).compile(DECODE_SIGNATURE_Q8 if q8 else DECODE_SIGNATURE)


def _flat(a, n, what, dtype=np.float32, fn="decode_attention"):
    if a.dtype != dtype or a.size != n:
        raise ValueError(f"{fn}: {what} must be {np.dtype(dtype).name} with {n} elements, got "
                         f"{a.dtype} {tuple(a.shape)}")
    return a if a.ndim == 1 else a.reshape(n)


def _check_launch(p: DecodePlan, ws: DecodeWorkspace, plan, layer: KVLayer, state, xq, xs,
                  what: str = "decode_attention") -> None:
    """The checks decode_attention and decode_rope_attention share (ValueError naming `what`)."""
    if plan is not None and not plan.fits(ws.plan):
        raise ValueError(f"{what}: the plan {plan} does not fit the workspace of "
                         f"{ws.plan} (heads, subgroups and at most its splits)")
    kv_dtype = KV_DTYPES.get(np.dtype(layer.k.dtype))
    if kv_dtype != p.kv_dtype:
        raise ValueError(f"{what}: cache dtype {layer.k.dtype} but the plan is {p.kv_dtype}")
    if tuple(layer.k.shape[1:]) != (p.n_kv, p.head_dim):
        raise ValueError(f"{what}: cache rows {tuple(layer.k.shape[1:])} != plan "
                         f"({p.n_kv}, {p.head_dim})")
    if getattr(layer, "ring", False) and not p.window:
        raise ValueError(f"{what}: the layer is a ring of {layer.k.shape[0]} slots; "
                         "it needs a windowed plan (plan_decode(..., window=W))")
    if p.window > layer.k.shape[0]:
        raise ValueError(f"{what}: window {p.window} > the layer's {layer.k.shape[0]} "
                         "slots: the ring cannot hold the window")
    if state.dtype != np.int32 or state.ndim != 1:
        raise ValueError(f"{what}: state must be a 1-d int32 device array")
    if (xq is None) != (xs is None):
        raise ValueError(f"{what}: pass both xq and xs (out's q8 activations), or neither")
    if xq is not None and (p.heads_per_block * p.head_dim) % 32:
        raise ValueError(f"{what}: q8 output needs heads_per_block * head_dim "
                         f"({p.heads_per_block} * {p.head_dim}) to be a multiple of 32")


def _workspace_args(p: DecodePlan, ws: DecodeWorkspace, layer: KVLayer, state, out, what: str):
    n = p.n_head * p.head_dim
    return (layer.k_words, layer.v_words, layer.k_scale, layer.v_scale, state,
            _flat(out, n, "out", fn=what), ws.part_o, ws.part_ml, ws.tickets)


def _q8_args(p: DecodePlan, xq, xs, what: str) -> tuple:
    n = p.n_head * p.head_dim
    return () if xq is None else (_flat(xq, n, "xq", np.int8, what), _flat(xs, n // 8, "xs", fn=what))


def decode_attention(q, layer: KVLayer, state, out, ws: DecodeWorkspace, stream=0,
                     plan: DecodePlan | None = None, xq=None, xs=None, pdl: bool = False):
    """out = attention of the query at position state[0] over cache positions 0..state[0]
    (a windowed plan: max(0, state[0] - W + 1) .. state[0], read through a ring's slots).

    q      float32 [n_head * hd] (or [1, n_head, hd])   device
    layer  DeviceKVPool.layer(i)                          int8 or f16; a ring layer needs a
                                                          windowed plan with W <= its slots
    state  int32 [>=1] device; state[0] = position (read at run time, graph-safe)
    out    float32 [n_head * hd] (or any shape of that size, C-contiguous)
    ws     DecodeWorkspace (of `plan`, or of a plan it fits: see DecodePlan.fits)
    plan   the layer's plan; None: ws.plan
    xq, xs int8 [n_head * hd], float32 [n_head * hd / 8] (or any shapes of those sizes), or
           both None: when given, out's q8 activations are written too (quant/gemv.py's
           quantize_q8 layout and bits), by the same launch
    pdl    launch the programmatic-dependent-launch build (quant/pdl.py, sm_90+): the next
           kernel may start at once; the same bits
    No allocation, no synchronization."""
    p = ws.plan if plan is None else plan
    _check_launch(p, ws, plan, layer, state, xq, xs)
    q8 = xq is not None
    what = "decode_attention"
    args = (_flat(q, p.n_head * p.head_dim, "q"),) + _workspace_args(p, ws, layer, state, out, what)
    launch_or_plain(p.kernel(q8, pdl), (p.n_splits, p.n_kv, p.n_sub), 32 * p.warps, stream,
                    DECODE_SIGNATURE_Q8 if q8 else DECODE_SIGNATURE, pdl, *args, *_q8_args(p, xq, xs, what))


def decode_rope_attention(qkv, q_norm, k_norm, eps, cos, sin, layer: KVLayer, state, out,
                          ws: DecodeWorkspace, stream=0, plan: DecodePlan | None = None,
                          rope: str = "neox", xq=None, xs=None, pdl: bool = False):
    """kvcache/rope_write.py's `rope_write` of one token and `decode_attention` of it in ONE
    launch (kvcache/attention_decode_rope.py): the same bits - the query rows, the cache rows
    written and out.

    qkv     float32 [1, (n_head + 2 n_kv) * hd]   the QKV projection's row, device
    q_norm, k_norm float32 [hd], or both None (no QK-norm); eps: the norm's epsilon
    cos, sin float32 [n_ctx_max, hd / 2]          rope_write's tables
    rope    "neox" | "normal"                     rope_write's pairs
    The rest as decode_attention's; the new position state[0] is written into `layer` (slot
    state[0], or state[0] % R for a ring), as rope_write writes it. No q is written anywhere.
    head_dim: even and <= 256 (rope_write's rows). Like rope_write, the kernel does nothing for a
    position without a row in cos/sin - and then attends with an unset q: the engine never asks
    (its tables cover the pool), so this is not checked on the device."""
    p = ws.plan if plan is None else plan
    what = "decode_rope_attention"
    _check_launch(p, ws, plan, layer, state, xq, xs, what)
    hd = p.head_dim
    q_norm, k_norm, qk_norm = check_rope_args(hd, q_norm, k_norm, cos, sin, rope, what)
    if qkv.dtype != np.float32 or qkv.shape != (1, (p.n_head + 2 * p.n_kv) * hd):
        raise ValueError(f"{what}: qkv must be float32 [1, {(p.n_head + 2 * p.n_kv) * hd}], got "
                         f"{qkv.dtype} {tuple(qkv.shape)}")
    ring = bool(getattr(layer, "ring", False))
    q8 = xq is not None
    args = (qkv, q_norm, k_norm, np.float32(eps), cos, sin, layer.k, layer.v) + \
        _workspace_args(p, ws, layer, state, out, what)
    launch_or_plain(p.kernel(q8, pdl, rope, qk_norm, ring), (p.n_splits, p.n_kv, p.n_sub), 32 * p.warps,
                    stream, rope_signature(p.kv_dtype, q8), pdl, *args, *_q8_args(p, xq, xs, what))


if __name__ == "__main__":       # python -m genie_rt.kvcache.attention [--json PATH] [--quick]
    from genie_rt.kvcache.attention_bench import main
    raise SystemExit(main())
