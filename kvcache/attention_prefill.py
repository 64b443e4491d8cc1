"""Causal prefill attention over the KV pool, on tensor cores (mma.sync m16n8k16 f16->f32).

The math (engine/models/reference.py `attention`): n query tokens at positions start .. start+n-1
(start = state[0], read at run time), query i attends to cache positions 0 .. start+i,
which include earlier chunks and reused prefixes (written before this launch):

    out[i, h] = softmax(q[i, h] . K[0:start+i+1, h // group]^T / sqrt(hd)) @ V[...]

Output: float32 [n, n_head * hd], the O-projection's input (the prefill GEMM quantizes
or converts its activations itself; no f16 copy is written).

Here: the numpy reference (`prefill_reference`, `prefill_flops`), the plan fixed at load
(`plan_prefill`, `prefill_splits`), the split workspace and the launcher
(`prefill_attention`, which checks every argument). The kernels, how they pack GQA
heads onto the tensor cores, their traffic and their compile-time variants (sliding
window, scale, head_dim 256) are in kvcache/attention_prefill_kernels.py.

Deliberately not here: a SIMT path for tiny n (the tensor-core kernel at n = 5 costs
about what one tile of loads costs), head_dim > 256, Hopper-only instructions (wgmma,
TMA), soft-capping.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from genie_rt.quant.ptx import SIMULATOR

from .attention import KV_DTYPES, attention_window_reference
from .attention_prefill_kernels import (BM, MERGE_SIGNATURE, PREFILL_SIGNATURE, THREADS, block_n, launch_merge,
                                        o_splits, prefill_kernel, prefill_merge)
from .device_pool import KVLayer

_ALIGN = 256


# =====================================================================================
# numpy reference
# =====================================================================================
def prefill_reference(q, k, v, start, window=0, scale=None):
    """q [n, n_head, hd]; k, v float [>= start+n, n_kv, hd] (the dequantized cache, in
    position order) -> [n, n_head * hd] float64 (window W > 0: query i sees keys
    start + i - W + 1 .. start + i)."""
    n = q.shape[0]
    return attention_window_reference(q, k[:start + n], v[:start + n], start, window, scale)


def prefill_flops(n, start, n_head, head_dim):
    """Useful FLOPs: 2 matmuls x 2 flops x hd per (query, visible key) pair."""
    pairs = n * start + n * (n + 1) // 2
    return 4 * head_dim * pairs * n_head


# =====================================================================================
# plan, workspace, launcher
# =====================================================================================
def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class PrefillPlan:
    """Shapes fixed at load: the largest chunk (n_max tokens) and split count (one plan
    per layer kind: a model with sliding-window layers has a global and a windowed one,
    which may share one workspace)."""
    n_head: int
    n_kv: int
    head_dim: int
    kv_dtype: str            # "int8" | "f16"
    n_max: int               # most query tokens per launch
    max_splits: int = 8      # most context splits per launch (workspace size)
    bn: int = 0              # keys per tile; 0 = block_n(head_dim, kv_dtype) (tests: small)
    window: int = 0          # 0: keys 0 .. position; W: position - W + 1 .. position
    scale: float | None = None   # attention scale; None: 1 / sqrt(head_dim)

    @property
    def group(self) -> int:
        return self.n_head // self.n_kv

    @property
    def block_n(self) -> int:
        return self.bn or block_n(self.head_dim, self.kv_dtype)

    @property
    def o_splits(self) -> int:
        return o_splits(self.head_dim)

    def kernel(self):
        return prefill_kernel(self.head_dim, self.group, self.kv_dtype, self.bn, self.window,
                              self.scale)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the split workspace (0 when max_splits == 1)."""
        if self.max_splits <= 1:
            return 0
        rows = self.max_splits * self.n_max * self.n_head
        return _aligned(rows * self.head_dim * 4) + _aligned(rows * 2 * 4)

    def fits(self, ws_plan: "PrefillPlan") -> bool:
        """Whether this plan can run in a workspace carved for ws_plan."""
        return ((self.n_head, self.head_dim) == (ws_plan.n_head, ws_plan.head_dim)
                and self.n_max <= ws_plan.n_max and self.max_splits <= ws_plan.max_splits)


def plan_prefill(n_head: int, n_kv: int, head_dim: int, kv_dtype: str, n_max: int,
                 max_splits: int = 8, bn: int = 0, window: int | None = None,
                 scale: float | None = None) -> PrefillPlan:
    """window: None / 0 for a global layer, W >= 1 for a sliding-window layer. scale: the
    attention scale (None: 1 / sqrt(head_dim))."""
    if kv_dtype not in ("int8", "f16"):
        raise ValueError(f"prefill attention supports KV dtypes int8 and f16, not '{kv_dtype}'")
    if n_head % n_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv {n_kv}")
    nd = o_splits(head_dim) if head_dim > 0 else 1
    if head_dim % (16 * nd) or not 16 <= head_dim <= 256:
        raise ValueError(f"prefill attention needs head_dim a multiple of 16 (32 above 128) "
                         f"and <= 256, got {head_dim}")
    if bn % 16 or bn > 64:
        raise ValueError(f"block_n {bn} must be a multiple of 16 and <= 64 (0 = default)")
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"window {window} must be >= 1 (or 0 / None: a global layer)")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"attention scale {scale} must be finite and > 0")
    return PrefillPlan(n_head, n_kv, head_dim, kv_dtype, n_max, max(1, max_splits), bn, window,
                       None if scale is None else float(scale))


# the fewest key tiles a split keeps (prefill_splits); a lab knob: tools/profile_prefill.py
# --split-tiles times other values (short chunks after a cached prefix, 2026-12-05: 4 against 2 or 1
# at 8 and 16 rows, docs/forward-pass.md "Prefill")
MIN_SPLIT_TILES = 4
# the same for the short prefill's graph (engine/cuda_short_prefill.py: its attention, then merge_q8k):
# on an H100 (2026-12-07, 8 tokens after 500 cached, the 4B) 2 tiles a split (8 splits) gave the graph
# 2.244 ms against 2.266-2.275 with 4 (4 splits) - docs/decode-journal.md 7; a lab knob as the one above
SHORT_SPLIT_TILES = 2


def prefill_splits(plan: PrefillPlan, n: int, start: int, sm_count: int | None = None, short: bool = False) -> int:
    """Context splits for a launch of n tokens at `start` (host-side choice): split only
    when the blocks would not fill the GPU and every split keeps >= MIN_SPLIT_TILES key tiles
    (short: the short prefill's graph, SHORT_SPLIT_TILES)."""
    if sm_count is None:                 # asked once a process (prefill_splits runs before every chunk)
        from genie_rt.quant.gemv import sm_count as device_sms
        sm_count = 132 if SIMULATOR else device_sms()
    blocks = -(-n * plan.group // BM) * plan.n_kv * plan.o_splits
    before = min(start, plan.window - 1) if plan.window else start     # keys before the chunk
    tiles = -(-(before + n) // plan.block_n)
    if blocks >= sm_count:
        return 1
    return max(1, min(plan.max_splits, -(-sm_count // blocks), tiles // (SHORT_SPLIT_TILES if short else MIN_SPLIT_TILES)))


class PrefillWorkspace:
    """Views of the split workspace: part_o f32 [max_splits, n_max * n_head, hd],
    part_ml f32 [max_splits, n_max * n_head, 2] (placeholders when max_splits == 1)."""

    def __init__(self, plan: PrefillPlan, buf=None):
        self.plan = plan
        nb = plan.workspace_bytes
        if nb == 0:
            self.part_o = cuda.device_array((1, 1, plan.head_dim), np.float32)
            self.part_ml = cuda.device_array((1, 1, 2), np.float32)
            return
        if buf is None:
            buf = cuda.device_array(nb, np.uint8)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < nb:
            raise ValueError(f"prefill workspace must be a uint8 device buffer of >= {nb} bytes")
        S, R, D = plan.max_splits, plan.n_max * plan.n_head, plan.head_dim
        a = _aligned(S * R * D * 4)
        self.part_o = buf[:S * R * D * 4].view(np.float32).reshape(S, R, D)
        self.part_ml = buf[a:a + S * R * 2 * 4].view(np.float32).reshape(S, R, 2)


def compile_prefill(plan: PrefillPlan) -> None:
    """Compile the plan's kernels now (at load)."""
    if not SIMULATOR:
        plan.kernel().compile(PREFILL_SIGNATURE)
        prefill_merge.compile(MERGE_SIGNATURE)


def prefill_attention(q, layer: KVLayer, state, out, ws: PrefillWorkspace, n_splits: int = 1,
                      stream=0, plan: PrefillPlan | None = None, splits_at: int | None = None,
                      merge: bool = True):
    """out[i] = causal attention of query i (position state[0] + i) over cache positions
    0 .. state[0] + i (a windowed plan: state[0] + i - W + 1 .. state[0] + i, read through
    a ring's slots). The K/V of this chunk must already be in the cache (rope_write).

    q      float32 [n, n_head, hd] device (n <= plan.n_max when n_splits > 1)
    layer  DeviceKVPool.layer(i)                         int8 or f16; a ring layer needs a
                                                         windowed plan and W + n - 1 <= slots
    state  int32 [>=1] device; state[0] = start          (read at run time)
    out    float32 [n, n_head * hd]
    ws     PrefillWorkspace (of `plan`, or of a plan it fits); n_splits <= plan.max_splits
           (see prefill_splits)
    plan   the layer's plan; None: ws.plan
    splits_at  None: n_splits splits. A state slot: the count is read at run time from
           state[splits_at] (clamped to 1 .. n_splits; n_splits is then the most the launch
           may use), so one captured graph serves every split count (engine/device_state.py)
    merge  False: with n_splits > 1 the split merge is left to the caller - out holds the
           result only if one split is in use - which must launch kvcache.attention_merge.
           merge_prepare_x (or prefill_merge) before anything reads out or the workspace is reused
    No allocation, no synchronization."""
    p = ws.plan if plan is None else plan
    if plan is not None and not plan.fits(ws.plan):
        raise ValueError(f"prefill_attention: the plan {plan} does not fit the workspace of "
                         f"{ws.plan}")
    kv_dtype = KV_DTYPES.get(np.dtype(layer.k.dtype))
    if kv_dtype != p.kv_dtype:
        raise ValueError(f"prefill_attention: cache dtype {layer.k.dtype} but the plan is "
                         f"{p.kv_dtype}")
    if tuple(layer.k.shape[1:]) != (p.n_kv, p.head_dim):
        raise ValueError(f"prefill_attention: cache rows {tuple(layer.k.shape[1:])} != plan "
                         f"({p.n_kv}, {p.head_dim})")
    if q.dtype != np.float32 or q.ndim != 3 or tuple(q.shape[1:]) != (p.n_head, p.head_dim):
        raise ValueError(f"prefill_attention: q must be float32 [n, {p.n_head}, {p.head_dim}], "
                         f"got {q.dtype} {tuple(q.shape)}")
    n = q.shape[0]
    if out.dtype != np.float32 or tuple(out.shape) != (n, p.n_head * p.head_dim):
        raise ValueError(f"prefill_attention: out must be float32 [{n}, {p.n_head * p.head_dim}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if state.dtype != np.int32 or state.ndim != 1:
        raise ValueError("prefill_attention: state must be a 1-d int32 device array")
    if not 1 <= n_splits <= p.max_splits:
        raise ValueError(f"prefill_attention: n_splits {n_splits} outside 1 .. {p.max_splits}")
    if n_splits > 1 and n > p.n_max:
        raise ValueError(f"prefill_attention: {n} tokens > plan.n_max {p.n_max} with splits")
    if getattr(layer, "ring", False):
        slots = layer.k.shape[0]
        if not p.window:
            raise ValueError(f"prefill_attention: the layer is a ring of {slots} slots; it "
                             "needs a windowed plan (plan_prefill(..., window=W))")
        if p.window + n - 1 > slots:
            raise ValueError(f"prefill_attention: a chunk of {n} tokens with window {p.window} "
                             f"reads {p.window + n - 1} keys at once; the ring holds {slots} "
                             f"(make it >= window + chunk - 1, kvcache.pool.ring_slots)")
    if splits_at is not None and not 0 <= splits_at < state.shape[0]:
        raise ValueError(f"prefill_attention: splits_at {splits_at} is not a slot of the state "
                         f"(0 .. {state.shape[0] - 1})")
    at = np.int32(-1 if splits_at is None else splits_at)
    grid = ((n * p.group + BM - 1) // BM * p.o_splits, p.n_kv, n_splits)
    p.kernel()[grid, THREADS, stream](q, layer.k_words, layer.v_words, layer.k_scale,
                                      layer.v_scale, state, out, ws.part_o, ws.part_ml, at)
    if n_splits > 1 and merge:
        launch_merge(ws.part_o, ws.part_ml, n_splits, state, splits_at, out, p.n_head, stream)
