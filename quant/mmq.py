"""MMQ: the prefill GEMM  Y = X W^T  for quantized weights, on tensor cores (mma.sync).

Prefill multiplies N prompt tokens by every weight matrix of a layer. Each weight is
read once and used N times, so from N of a few hundred on the GEMM is compute-bound;
at the N = 18..33 of a home-assistant command it is still bound by reading the weights
once. One kernel family serves both: weights stay in the GGUF bits in global memory
(the planar layout of quant/layout.py), are staged raw into shared memory with cp.async,
and each warp dequantizes them straight into fp16 mma fragments in registers.

    W   PackedWeight [rows, cols], planes on the device: Q4_K, Q5_K, Q6_K, Q8_0 (K a multiple
        of 256), Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (of 32: mmq_legacy.py), F16, BF16 (of 16:
        mmq_float.py)
    X   float32 [N, cols] activations (the RMSNorm output)
        -> prepare_x -> x16 float16 [N, cols] in "MMQ order" + xscale float32 [N]
    Y   float32 [N, rows]:  mode "store"   Y  = X W^T
                            mode "add"     Y += X W^T        (residual stream)
                            mode "swiglu"  Y  = silu(X G^T) * (X U^T), W = [G; U] stacked
                                           by rows (2 I rows -> Y [N, I])
                            mode "geglu"   Y  = gelu(X G^T) * (X U^T), gelu's tanh form
                                           (Gemma), same stacking

Public API (all launchers: no allocation, no synchronisation, any numba stream):
    prepare_x(x, x16, xscale, stream=0, norm_weight=None, eps=1e-6)   (+ fused RMSNorm)
    mmq(w, x16, xscale, y, mode="store", workspace=None, stream=0, config=None, splits=None)
    workspace_bytes(w, n, mode="store", config=None) -> int
    compile_for(weights, n_values, modes) -> None                eager compile at load
    plan(qtype, rows_out, cols, n, mode, config=None, splits=None) -> Plan   what mmq launches
Host side (numpy): reference(w, x, mode, y0, rows) (float64), error_bound(...) (the
guaranteed bound the tests use), prepare_x_reference(x, norm_weight, eps),
random_weight(qtype, rows, cols, rng) (valid random blocks), stack_rows(gate, up).

Why fp16 mma and not int8 (llama.cpp's MMQ quantizes X to q8_1 and uses s8 mma): the
k-quant scales change every 16 or 32 weights, so the int8 path converts and rescales
its int32 partial sums after every k32 step (4 cvt + 8 FMA per mma per lane), and Q4_K's
mins need a second sum. With fp16, scales and mins are folded into the weights once
(2 fp16x2 FMAs per pair of weights, per warp) and the accumulators never leave the
tensor cores. tools/mmq_variants/ has the int8 variant to measure against.

What this module does not do: attention, F32 or the other GGUF types (the launcher
refuses them with a message), decode (N = 1 is the GEMV's job, although MMQ
accepts it), or picking fused QKV layouts for the engine.

Numbers: docs/kernels/mmq.md (the lesson and the measured table); the benchmark is
`python -m genie_rt.quant.mmq`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from .formats import QType, dequantize
from .kquants import unpack_q4_k_scales, unpack_q5_k_scales
from .layout import PackedWeight, pack, unpack
from . import mmq_float as F
from . import mmq_kernels as K
from . import mmq_legacy as L
from . import mmq_prep as P
from . import mmq_reduce as R

SUPPORTED = {QType.Q4_K: K.Q4_K, QType.Q5_K: K.Q5_K, QType.Q6_K: K.Q6_K, QType.Q8_0: K.Q8_0,
             QType.Q4_0: L.Q4_0, QType.Q4_1: L.Q4_1, QType.Q5_0: L.Q5_0, QType.Q5_1: L.Q5_1,
             QType.F16: F.F16, QType.BF16: F.BF16}
# Split-K workspace layout: every plan's int32 tile counters start at byte 0 of a region
# of this size and its partial sums start after it. The kernels leave their counters at
# zero, so one workspace, zeroed once, serves any sequence of launches of different
# plans on one stream: no launch's partial sums can land on another plan's counters.
COUNTER_BYTES = 1 << 16
MODES = {"store": K.EPI_STORE, "add": K.EPI_ADD, "swiglu": K.EPI_SWIGLU, "geglu": K.EPI_GEGLU}
GATED = ("swiglu", "geglu")     # W = [gate; up] stacked by rows; y = act(x G^T) * (x U^T)
REDUCTIONS = {"last": K.RED_LAST, "kernel": K.RED_KERNEL}
# How a split K is summed (mmq_kernels.RED_*): "kernel" (partial sums to a workspace,
# then one reduction launch over every output) or "last" (the last block of each tile
# sums the partials of its tile). docs/kernels/mmq.md has the measurements.
DEFAULT_REDUCE = "kernel"
COL_MULTIPLE = 256      # K of the k-quants: whole super-blocks (and Q8_0's fast path: 8-block groups)
COL_MULTIPLE_32 = 32    # K of the 32-weight formats (mmq_legacy.py): whole blocks
COL_MULTIPLE_16 = 16    # K of F16 / BF16 (mmq_float.py): whole k16 groups (prepare_x's unit too)


def kernel_format(qtype, cols: int) -> int:
    """The kernel format code for a weight: Q8_0 takes mmq_kernels' path when K is a
    multiple of 256 (its d plane is staged with cp.async, 8 blocks at a time) and
    mmq_legacy's otherwise (Gemma 3 270M's 640 columns)."""
    fmt = SUPPORTED[QType[qtype] if isinstance(qtype, str) else QType(qtype)]
    if fmt == K.Q8_0 and cols % COL_MULTIPLE:
        return L.Q8_0L
    return fmt


def _col_multiple(fmt) -> int:
    if fmt in F.FLOAT:
        return COL_MULTIPLE_16
    return COL_MULTIPLE_32 if fmt in L.LEGACY else COL_MULTIPLE


# =====================================================================================
# numpy reference
# =====================================================================================
def _host_planes(w: PackedWeight) -> PackedWeight:
    planes = {k: (v.copy_to_host() if hasattr(v, "copy_to_host") else np.asarray(v))
              for k, v in w.planes.items()}
    return PackedWeight(w.qtype, w.rows, w.cols, planes)


def dequantize_weight(w: PackedWeight, rows=None) -> np.ndarray:
    """float64 [len(rows), cols] dequantized weight rows (all rows by default)."""
    hw = _host_planes(w)
    raw = unpack(hw)
    if rows is not None:
        raw = raw[np.asarray(rows)]
    return dequantize(raw, hw.qtype, (raw.shape[0], hw.cols)).astype(np.float64)


def _weight_abs(w: PackedWeight, rows=None) -> np.ndarray:
    """|terms| of each weight before cancellation: |s q| + |m| (Q4_K, Q5_K, Q4_1, Q5_1),
    |w| otherwise."""
    wd = dequantize_weight(w, rows)
    if w.qtype in (QType.Q4_1, QType.Q5_1):         # w = d q + m: |d q| + |m|
        dm = _host_planes(w).planes["dm"]
        if rows is not None:
            dm = dm[np.asarray(rows)]
        m = np.repeat(np.ascontiguousarray(dm).view(np.float16)[:, 1::2].astype(np.float64), 32, axis=1)
        return np.abs(wd - m) + np.abs(m)
    if w.qtype not in (QType.Q4_K, QType.Q5_K):
        return np.abs(wd)
    raw = unpack(_host_planes(w))
    if rows is not None:
        raw = raw[np.asarray(rows)]
    q4 = w.qtype == QType.Q4_K
    blocks = raw.reshape(-1, 144 if q4 else 176)
    _, dmin, _, m = (unpack_q4_k_scales if q4 else unpack_q5_k_scales)(blocks)
    mins = np.repeat((dmin[:, None] * m.astype(np.float32)).astype(np.float64), 32, axis=1)
    mins = mins.reshape(wd.shape)
    return np.abs(wd + mins) + mins


def _split_swiglu(w: PackedWeight, rows):
    """Rows of the stacked [gate; up] weight for output rows `rows`."""
    half = w.rows // 2
    rows = np.arange(half) if rows is None else np.asarray(rows)
    return rows, rows + half


def reference(w: PackedWeight, x: np.ndarray, mode: str = "store", y0=None, rows=None) -> np.ndarray:
    """float64 [N, len(rows)] reference of mmq for output rows `rows` (default: all).

    x is the float32 activation [N, cols] that prepare_x receives; y0 the residual [N, rows]
    for mode "add". SwiGLU: w stacks gate (rows 0..I-1) and up (I..2I-1)."""
    x64 = np.asarray(x, np.float64)
    if mode in GATED:
        rg, ru = _split_swiglu(w, rows)
        gate = x64 @ dequantize_weight(w, rg).T
        up = x64 @ dequantize_weight(w, ru).T
        return _act(gate, mode) * up
    y = x64 @ dequantize_weight(w, rows).T
    if mode == "add":
        y0 = np.asarray(y0, np.float64)
        y = y + (y0 if rows is None else y0[:, np.asarray(rows)])
    return y


# Error model of the kernel, per product x * w (u = 2^-11, fp16 unit roundoff):
#   x -> fp16 (scaled by a power of two: exact scaling)        |x| u
#   Q4_K, Q5_K: s = fp16(d sc), m = fp16(dmin mn), w16 = fp16(q s - m)  (|s q| + |m|) 2u + |w| u
#   Q6_K: s = fp16(d sc), w16 = fp16(q s); Q8_0: s = d (exact)   |w| 2u
#   F16: exact; BF16 -> fp16: exact from 2^-14 to 65504 (8 significant bits fit in 11)
#   products exact in f32; sums in f32 inside the tensor core (truncating adds allowed)
# plus fp16 subnormals (below 2^-14 the spacing is 2^-24, absolute): half a spacing on
# s (times |q| <= QMAX), m, w16 and x:
# |y - ref| <= (3u + cols 2^-22) sum_k |x_k| W_abs_k
#              + 2^-25 ((QMAX + 2) sum_k |x_k| + sum_k |w_k|)
F16_U = 2.0 ** -11
_QMAX = {QType.Q4_K: 15, QType.Q5_K: 31, QType.Q6_K: 32, QType.Q8_0: 0,   # 32-weight formats: d is exact fp16
         QType.Q4_0: 0, QType.Q4_1: 0, QType.Q5_0: 0, QType.Q5_1: 0,
         QType.F16: 0, QType.BF16: 0}                # (BF16 subnormals: the 2^-25 |x| term)


def error_bound(w: PackedWeight, x: np.ndarray, mode: str = "store", y0=None, rows=None) -> np.ndarray:
    """Elementwise bound on |mmq - reference| (float64 [N, len(rows)])."""
    ax = np.abs(np.asarray(x, np.float64))
    acc_eps = w.cols * 2.0 ** -22
    qmax = _QMAX[QType(w.qtype)]

    def gemm_bound(r):
        wabs = _weight_abs(w, r)
        sub = 2.0 ** -25 * ((qmax + 2) * ax.sum(axis=1)[:, None] + np.abs(dequantize_weight(w, r)).sum(axis=1)[None, :])
        return ax @ ((3 * F16_U + acc_eps) * wabs).T + sub + 1e-30

    if mode in GATED:
        rg, ru = _split_swiglu(w, rows)
        x64 = np.asarray(x, np.float64)
        g = x64 @ dequantize_weight(w, rg).T
        u = x64 @ dequantize_weight(w, ru).T
        eg, eu = gemm_bound(rg), gemm_bound(ru)
        a = _act(g, mode)
        # |d silu/dg| <= 1.1, |d gelu/dg| <= 1.13; act(g)*u in float32 adds a few ulps
        return 1.13 * (np.abs(u) + eu) * eg + np.abs(a) * eu + 1e-6 * np.abs(a * u)
    b = gemm_bound(rows)
    if mode == "add":
        y0 = np.abs(np.asarray(y0, np.float64))
        b = b + 2.0 ** -23 * (y0 if rows is None else y0[:, np.asarray(rows)])
    return b


def _act(g, mode):
    """float64 silu (mode "swiglu") or gelu-tanh ("geglu") of the gate."""
    if mode == "swiglu":
        return g / (1.0 + np.exp(-g))
    return 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * g * (1.0 + 0.044715 * g * g)))


def random_weight(qtype, rows: int, cols: int, rng: np.random.Generator) -> PackedWeight:
    """A PackedWeight of valid random blocks (host planes): random bits for quants and
    packed scales, fp16 super-block scales of realistic size (|w| mostly below ~0.5)."""
    qtype = QType[qtype] if isinstance(qtype, str) else QType(qtype)
    if qtype == QType.Q4_K:
        nb = cols // 256
        raw = rng.integers(0, 256, (rows, nb, 144), dtype=np.uint8)
        dd = rng.uniform(1e-4, 6e-4, (rows, nb, 2)).astype(np.float16)
        raw[:, :, 0:4] = dd.view(np.uint8).reshape(rows, nb, 4)
    elif qtype == QType.Q6_K:
        nb = cols // 256
        raw = rng.integers(0, 256, (rows, nb, 210), dtype=np.uint8)
        d = rng.uniform(2e-5, 1e-4, (rows, nb, 1)).astype(np.float16)
        raw[:, :, 208:210] = d.view(np.uint8).reshape(rows, nb, 2)
    elif qtype == QType.Q8_0:
        nb = cols // 32
        raw = rng.integers(0, 256, (rows, nb, 34), dtype=np.uint8)
        d = rng.uniform(1e-4, 1e-3, (rows, nb, 1)).astype(np.float16)
        raw[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    else:
        from .gemv_bench import random_weight as any_random_weight
        return any_random_weight(qtype, rows, cols, rng)
    return pack(raw.reshape(rows, -1), qtype, (rows, cols))


def stack_rows(a: PackedWeight, b: PackedWeight) -> PackedWeight:
    """[a; b] by rows (host planes): the gate/up weight the "swiglu" mode expects."""
    if a.qtype != b.qtype or a.cols != b.cols:
        raise ValueError(f"stack_rows: {a.qtype.name}[{a.rows},{a.cols}] and "
                         f"{b.qtype.name}[{b.rows},{b.cols}] differ in type or columns")
    ha, hb = _host_planes(a), _host_planes(b)
    planes = {k: np.concatenate([ha.planes[k], hb.planes[k]], axis=0) for k in ha.planes}
    return PackedWeight(a.qtype, a.rows + b.rows, a.cols, planes)


# =====================================================================================
# Tile configurations and the launch plan
# =====================================================================================
@dataclass(frozen=True)
class TileConfig:
    """Block = wm x wn warps; a warp owns mt m16 tiles (16 mt weight rows) x nt n8 tiles
    (8 nt tokens); stages = depth of the cp.async ring (2..4)."""
    wm: int
    wn: int
    mt: int
    nt: int
    stages: int = 3

    @property
    def threads(self):
        return 32 * self.wm * self.wn

    @property
    def bm(self):                       # weight rows staged per block
        return 16 * self.mt * self.wm

    @property
    def bn(self):                       # tokens per block
        return 8 * self.nt * self.wn

    @property
    def name(self):
        return f"{self.bm}x{self.bn}/{self.wm}x{self.wn}w/s{self.stages}"

    def smem_bytes(self, fmt):
        return K.smem_bytes(fmt, self.wm, self.wn, self.mt, self.nt, self.stages)


SMALL_NT = (1, 2, 3, 4, 5, 6, 8)        # token widths (x8) compiled for N <= 64
# N <= 64: pipeline stages, and the fewest K stages a split may own (the split count fills
# one wave of resident blocks within this bound). Measured on the H200 (docs/kernels/mmq.md):
# with the split-K reduction kernel, 2 stages and splits down to 2 stages each beat 3 stages
# and >= 4 stages per split by 3-45 % per GEMM (one Qwen3-4B layer at N = 33: 84.2 -> 81.7 us,
# against 116.5 us before the reduction kernel).
SMALL_STAGES = 2
SMALL_MIN_STAGES_PER_SPLIT = 2


def small_config(n: int) -> TileConfig:
    """N <= 64: all tokens in one tile, 4 warps side by side over 128 weight rows."""
    need = -(-n // 8)
    nt = next(v for v in SMALL_NT if v >= need)
    return TileConfig(wm=4, wn=1, mt=2, nt=nt, stages=SMALL_STAGES)


LARGE = TileConfig(wm=4, wn=2, mt=2, nt=8, stages=3)       # 128 rows x 128 tokens, 8 warps
CANDIDATES_LARGE = (LARGE, replace(LARGE, stages=2), TileConfig(wm=2, wn=2, mt=4, nt=8, stages=3),
                    TileConfig(wm=4, wn=2, mt=4, nt=8, stages=2))


@dataclass(frozen=True)
class Plan:
    fmt: int
    epi: int
    config: TileConfig
    rows_out: int
    n: int
    grid: tuple
    splits: int
    stages_per_split: int
    n_stages: int
    smem: int
    workspace: int                      # bytes (0 without split-K)
    counters: int                       # int32 counters at the start of the workspace
    red: int                            # split-K reduction (mmq_kernels.RED_*)


_DEVICE = {}


def device_limits():
    """(SM count, max dynamic shared memory per block) of the current device."""
    if "limits" not in _DEVICE:
        if K.SIMULATOR:
            _DEVICE["limits"] = (132, 227 * 1024)
        else:
            from numba import cuda
            dev = cuda.get_current_device()
            _DEVICE["limits"] = (dev.MULTIPROCESSOR_COUNT, dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    return _DEVICE["limits"]


def _blocks_per_sm(cfg, smem, smem_limit, epi):
    """Resident blocks per SM: shared memory (an SM has ~1 KB more than one block may
    take, and reserves 1 KB per block), threads, registers (128 per thread when capped,
    see mmq_kernels.register_capped; up to 255 otherwise)."""
    per_sm = smem_limit + 1024
    regs = K.MAX_REGISTERS if K.register_capped(cfg.mt, cfg.nt, cfg.threads, epi) else 255
    return max(1, min(per_sm // (smem + 1024), 2048 // cfg.threads, 65536 // (cfg.threads * regs), 32))


def _fit(cfg, fmt, smem_limit):
    """cfg with stages reduced until one block fits the shared memory limit (or None)."""
    while cfg.smem_bytes(fmt) > smem_limit and cfg.stages > 2:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg if cfg.smem_bytes(fmt) <= smem_limit else None


def _split(n_stages, splits):
    """(splits, stages per split): whole super-blocks per split, no empty split."""
    splits = max(1, min(int(splits), n_stages // 2))
    sps = -(-n_stages // splits)
    sps += sps & 1
    return -(-n_stages // sps), sps


@functools.lru_cache(maxsize=4096)
def plan(qtype, rows_out: int, cols: int, n: int, mode: str = "store", config: TileConfig = None,
         splits: int = None, num_sms: int = None, smem_limit: int = None, reduce: str = None) -> Plan:
    """What mmq launches for this shape: tile config, grid, split-K, shared memory, workspace.

    N <= 64 (bandwidth-bound): small_config(N), one tile covers every token; K is split
    until the grid fills one wave (blocks per SM x SMs), so every SM keeps several
    stages of weights in flight, but into no fewer than 4 stages per split (a split's
    partial tile, 128 x 8 nt floats, costs about 2 stages of Q4_K weight bytes in L2).
    N > 64 (compute-bound): LARGE with 3 or 2 stages and a split of K (only if the tiles
    alone do not fill a wave), whichever a wave model finds fastest: time ~ waves x
    (blocks per SM) x (stages per block + 2 if split), where a wave is SMs x resident
    blocks per SM (2-stage blocks fit twice on an SM).
    Stages drop until the block fits the device's shared memory (Orin: 163 KB).
    reduce: how a split K is summed ("kernel" or "last", default DEFAULT_REDUCE)."""
    qtype = QType[qtype] if isinstance(qtype, str) else QType(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"mmq: {qtype.name} weights are not supported (supported: "
                         f"{', '.join(q.name for q in SUPPORTED)})")
    if mode not in MODES:
        raise ValueError(f"mmq: mode must be one of {sorted(MODES)}, got {mode!r}")
    reduce = DEFAULT_REDUCE if reduce is None else reduce
    if reduce not in REDUCTIONS:
        raise ValueError(f"mmq: reduce must be one of {sorted(REDUCTIONS)}, got {reduce!r}")
    fmt, epi = kernel_format(qtype, cols), MODES[mode]
    if cols % _col_multiple(fmt) or cols < 1:
        raise ValueError(f"mmq: {qtype.name} weights need cols a multiple of {_col_multiple(fmt)}, got {cols}")
    if n < 1 or rows_out < 1:
        raise ValueError(f"mmq: need N >= 1 and rows >= 1, got N = {n}, rows = {rows_out}")
    sms, limit = device_limits()
    num_sms = num_sms or sms
    smem_limit = smem_limit or limit
    n_stages = -(-cols // K.STAGE_K)        # the last stage of a 32-weight format may be partial
    if config is not None:
        candidates = [config]
    elif n <= 64:
        candidates = [small_config(n)]
    else:
        candidates = [LARGE, replace(LARGE, stages=2)]
    best = None
    for cfg in candidates:
        if epi in K.GATED and cfg.mt % 2:
            raise ValueError(f"mmq: mode {mode!r} needs an even mt, config {cfg.name} has mt = {cfg.mt}")
        fitted = _fit(cfg, fmt, smem_limit)
        if fitted is None:
            raise ValueError(f"mmq: config {cfg.name} needs {cfg.smem_bytes(fmt)} B of shared "
                             f"memory, the device allows {smem_limit}; use a smaller tile")
        cfg = fitted
        smem = cfg.smem_bytes(fmt)
        bm_out = cfg.bm // 2 if epi in K.GATED else cfg.bm
        row_tiles, tok_tiles = -(-rows_out // bm_out), -(-n // cfg.bn)
        tiles = row_tiles * tok_tiles
        per_sm = _blocks_per_sm(cfg, smem, smem_limit, epi)
        wave = num_sms * per_sm
        if splits is not None:
            options = [_split(n_stages, splits)]
        elif n <= 64:                   # fill one wave, each split >= SMALL_MIN_STAGES_PER_SPLIT stages
            options = [_split(n_stages, max(1, min(wave // tiles, n_stages // SMALL_MIN_STAGES_PER_SPLIT)))]
        else:                           # split only a grid that does not fill a wave
            options = sorted({_split(n_stages, s) for s in range(1, 9) if tiles * s <= max(wave, tiles)})
        for sp, sps in options:
            # a split costs about two stages: its partial tile out to L2 and back
            cost = -(-tiles * sp // wave) * per_sm * (sps + (2 if sp > 1 else 0))
            key = (cost, sp, -cfg.stages)
            if best is None or key < best[0]:
                best = (key, cfg, smem, (row_tiles, tok_tiles, sp), sps, tiles)
    _, cfg, smem, grid, sps, tiles = best
    sp = grid[2]
    ws, counters, red = 0, 0, REDUCTIONS[reduce]
    if sp > 1 and red == K.RED_KERNEL:
        partials = sp * n * rows_out * (2 if epi in K.GATED else 1)
        if partials >= 1 << 31:
            raise ValueError(f"mmq: {partials} split-K partial sums exceed the 32-bit index "
                             "range; use fewer splits or a smaller chunk")
        ws = COUNTER_BYTES + 4 * partials
    elif sp > 1:
        counters = -(-tiles // 4) * 4
        if 4 * counters > COUNTER_BYTES:
            raise ValueError(f"mmq: {tiles} output tiles need more split-K counters than the "
                             f"{COUNTER_BYTES}-byte counter region holds; use fewer splits")
        ws = COUNTER_BYTES + 4 * tiles * sp * cfg.threads * cfg.mt * cfg.nt * 4
    return Plan(fmt, epi, cfg, rows_out, n, grid, sp, sps, n_stages, smem, ws, counters, red)


def _rows_out(w: PackedWeight, mode: str) -> int:
    if mode in GATED:
        if w.rows % 2:
            raise ValueError(f"mmq: mode {mode!r} needs the stacked [gate; up] weight (even "
                             f"rows), got {w.rows} rows")
        return w.rows // 2
    return w.rows


def workspace_bytes(w: PackedWeight, n: int, mode: str = "store", config: TileConfig = None,
                    reduce: str = None) -> int:
    """Bytes of workspace mmq(w, ...) needs for N = n (0: none). Allocate once, zero once:
    the kernels leave the counters at zero. Do not share one workspace between launches
    that may run at the same time (two streams)."""
    return plan(w.qtype, _rows_out(w, mode), w.cols, n, mode, config, reduce=reduce).workspace


# =====================================================================================
# Launchers
# =====================================================================================
_KERNELS = {}


def _kernel(fmt, cfg: TileConfig, epi, red=K.RED_LAST):
    key = (fmt, cfg, epi, red)
    if key not in _KERNELS:
        _KERNELS[key] = K.build_mmq_kernel(fmt, cfg.wm, cfg.wn, cfg.mt, cfg.nt, cfg.stages, epi, red)
    return _KERNELS[key]


def _reduce_kernel(epi):
    key = ("reduce", epi)
    if key not in _KERNELS:
        _KERNELS[key] = R.build_reduce_kernel(epi)
    return _KERNELS[key]


REDUCE_SIGNATURE = "void(float32[::1], float32[::1], float32[:, ::1], int64, int64, int64)"


_PLANE_TYPES = {   # fmt -> kernel plane slots p0..p3: (plane name, numba dtype)
    K.Q4_K: (("qs", "uint8"), ("hdr", "uint8"), ("qs", "uint8"), ("qs", "uint8")),
    K.Q6_K: (("ql", "uint8"), ("qh", "uint8"), ("sc", "int8"), ("d", "float16")),
    K.Q8_0: (("qs", "int8"), ("d", "float16"), ("qs", "int8"), ("qs", "int8")),
    # the 32-weight formats: d as its fp16 bits, qh (uint8 in the layout) as a uint32 a block
    L.Q4_0: (("qs", "uint8"), ("d", "uint16"), ("qs", "uint8"), ("qs", "uint8")),
    L.Q4_1: (("qs", "uint8"), ("dm", "uint32"), ("qs", "uint8"), ("qs", "uint8")),
    L.Q5_0: (("qs", "uint8"), ("d", "uint16"), ("qh", "uint32"), ("qs", "uint8")),
    L.Q5_1: (("qs", "uint8"), ("dm", "uint32"), ("qh", "uint32"), ("qs", "uint8")),
    L.Q8_0L: (("qs", "int8"), ("d", "uint16"), ("qs", "int8"), ("qs", "int8")),
    K.Q5_K: (("qs", "uint8"), ("hdr", "uint8"), ("qh", "uint8"), ("qs", "uint8")),
    # F16 / BF16: the weights as bytes (mmq_float.py stages them with the byte-row loader)
    F.F16: (("w", "uint8"),) * 4,
    F.BF16: (("w", "uint8"),) * 4,
}
# plane name -> (dtypes it is stored as, the dtype it is passed as when the kernel's differs)
_PLANE_DTYPES = {"d": ((np.float16,), np.uint16), "qh": ((np.uint8,), np.uint32),
                 "w": ((np.float16, np.uint16), np.uint8)}
_REST_SIG = ("float16[:, ::1], float32[::1], float32[:, ::1], float32[::1], int32[::1], "
             "int64, int64, int64, int64, int64")


def kernel_signature(fmt) -> str:
    planes = ", ".join(f"{dt}[:, ::1]" for _, dt in _PLANE_TYPES[fmt])
    return f"void({planes}, {_REST_SIG})"


PREPARE_X_SIGNATURE = "void(float32[:, ::1], float32[::1], uint32[:, ::1], float32[::1], int64, float32, int64)"
_READY = set()


def _ensure_compiled(kern, fmt):
    """Compile for the one signature the launcher uses and allow > 48 KB of dynamic
    shared memory (cuFuncSetAttribute; numba has no option for it)."""
    if K.SIMULATOR:
        return
    from numba import cuda
    dev = cuda.get_current_device().id
    key = (id(kern), dev)
    if key in _READY:
        return
    compiled = kern.compile(kernel_signature(fmt))
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver
    cufunc = compiled._codelibrary.get_cufunc()
    _, limit = device_limits()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(limit), cufunc.handle, dev)
    _READY.add(key)


def _check(cond, msg):
    if not cond:
        raise ValueError("mmq: " + msg)


def _c_contig(a):
    if hasattr(a, "is_c_contiguous"):                  # numba device arrays (and simulated)
        return bool(a.is_c_contiguous())
    return bool(a.flags.c_contiguous)


def compile_for(weights, n_values=(18, 33, 128, 512), modes=("store",)) -> None:
    """Compile at load, before the first request, every kernel mmq will launch for these
    weights (PackedWeights: their exact plans; QTypes: every candidate config), token
    counts and modes; also prepare_x. A kernel takes a few seconds to compile; anything
    not compiled here compiles on first use. No-op under the simulator."""
    if K.SIMULATOR:
        return
    keys = set()
    for item in weights:
        for n in n_values:
            for mode in modes:
                if isinstance(item, PackedWeight):
                    qtype = item.qtype
                    if mode in GATED and item.rows % 2:
                        continue
                    p = plan(qtype, _rows_out(item, mode), item.cols, n, mode)
                    cfgs = [(p.config, p.red)]
                    fmt = p.fmt
                else:
                    qtype = QType(item)
                    fmt = SUPPORTED[qtype]
                    red = REDUCTIONS[DEFAULT_REDUCE]
                    cfgs = [(small_config(n), red)] if n <= 64 else \
                        [(LARGE, red), (replace(LARGE, stages=2), red)]
                for cfg, red in cfgs:
                    keys.add((fmt, cfg, MODES[mode], red))
    for fmt, cfg, epi, red in sorted(keys, key=str):
        _ensure_compiled(_kernel(fmt, cfg, epi, red), fmt)
        if red == K.RED_KERNEL:                   # (compiled even if no plan splits K)
            _reduce_kernel(epi).compile(REDUCE_SIGNATURE)
    P.prepare_x_kernel.compile(PREPARE_X_SIGNATURE)
    for cols in {item.cols for item in weights if isinstance(item, PackedWeight)}:
        P.prepare_x_kernel_for(cols).compile(PREPARE_X_SIGNATURE)   # the register-resident variants


def prepare_x(x, x16, xscale, stream=0, norm_weight=None, eps: float = 1e-6) -> None:
    """x float32 [N, cols] -> x16 float16 [N, cols] (MMQ order), xscale float32 [N].

    With norm_weight (float32 [cols]) the RMSNorm is fused in: the values converted are
    x / sqrt(mean(x^2) + eps) * norm_weight (engine/models/reference.py's rmsnorm), so the residual
    stream feeds MMQ in one kernel. xscale[t] is 1 unless max|v[t]| > 16384, then the
    power of two that brings the row below it (fp16 overflows at 65504; mmq multiplies
    it back in its epilogue)."""
    _check(len(x.shape) == 2 and x.dtype == np.float32 and _c_contig(x),
           f"x must be a C-contiguous float32 [N, cols], got {x.dtype}{tuple(x.shape)}")
    n, cols = x.shape
    _check(cols % 16 == 0, f"cols = {cols} must be a multiple of 16")
    _check(tuple(x16.shape) == (n, cols) and x16.dtype == np.float16 and _c_contig(x16),
           f"x16 must be a C-contiguous float16 [{n}, {cols}], got {x16.dtype}{tuple(x16.shape)}")
    _check(tuple(xscale.shape) == (n,) and xscale.dtype == np.float32,
           f"xscale must be float32 [{n}], got {xscale.dtype}{tuple(xscale.shape)}")
    if norm_weight is not None:
        _check(tuple(norm_weight.shape) == (cols,) and norm_weight.dtype == np.float32,
               f"norm_weight must be float32 [{cols}], got {norm_weight.dtype}{tuple(norm_weight.shape)}")
        w, has_norm = norm_weight, 1
    else:
        w, has_norm = xscale, 0                          # never read
    P.prepare_x_kernel_for(cols)[n, P.PREP_THREADS, stream](x, w, x16.view(np.uint32), xscale, cols,
                                                  np.float32(eps), has_norm)


def prepare_x_reference(x, norm_weight=None, eps: float = 1e-6):
    """numpy twin of prepare_x: (x16 float16 [N, cols] in MMQ order, xscale float32 [N])."""
    v = np.asarray(x, np.float32)
    if norm_weight is not None:
        ms = (v.astype(np.float64) ** 2).mean(axis=1, keepdims=True)
        v = (v / np.sqrt(ms + eps) * norm_weight).astype(np.float32)
    amax = np.abs(v).max(axis=1)
    scale = np.ones(v.shape[0], np.float32)
    while np.any(big := (amax / scale > P.X_LIMIT) & np.isfinite(amax)):
        scale[big] *= 2
    x16 = np.ascontiguousarray((v / scale[:, None])[:, P.mmq_order(v.shape[1])], np.float16)
    return x16, scale


def mmq(w: PackedWeight, x16, xscale, y, mode: str = "store", workspace=None, stream=0,
        config: TileConfig = None, splits: int = None, reduce: str = None) -> None:
    """Y = X W^T on the tensor cores (see the module docstring for the modes).

    w          PackedWeight, planes are device arrays ([rows, bytes], C-contiguous rows)
    x16        float16 [N, cols] from prepare_x; xscale float32 [N] from prepare_x
    y          float32 [N, rows] ("store", "add": read and written), [N, rows/2] ("swiglu",
               "geglu")
    workspace  uint8 device array >= workspace_bytes(w, N, mode) bytes (zeroed once after
               allocation; may be shared by every launch on this stream, whatever its
               plan - see COUNTER_BYTES), or None when that is 0
    stream     numba stream (or 0); config/splits/reduce override the automatic plan
               (benchmarks)
    With a split K and reduce "kernel" this is two launches: the GEMM, then the reduction.
    """
    _check(w.qtype in SUPPORTED, f"{QType(w.qtype).name} weights are not supported "
           f"(supported: {', '.join(sorted(q.name for q in SUPPORTED))})")
    _check(len(x16.shape) == 2 and x16.dtype == np.float16 and _c_contig(x16),
           f"x16 must be a C-contiguous float16 [N, cols] from prepare_x, got "
           f"{x16.dtype}{tuple(x16.shape)}")
    n, cols = x16.shape
    _check(cols == w.cols, f"x16 has {cols} columns, the weight {w.cols}")
    _check(tuple(xscale.shape) == (n,) and xscale.dtype == np.float32,
           f"xscale must be float32 [{n}], got {xscale.dtype}{tuple(xscale.shape)}")
    rows_out = _rows_out(w, mode)
    _check(tuple(y.shape) == (n, rows_out) and y.dtype == np.float32 and _c_contig(y),
           f"y must be a C-contiguous float32 [{n}, {rows_out}] for mode {mode!r}, got "
           f"{y.dtype}{tuple(y.shape)}")
    p = plan(w.qtype, rows_out, cols, n, mode, config, splits, reduce=reduce)
    fmt = p.fmt
    slots = []
    for name, dt in _PLANE_TYPES[fmt]:
        plane = w.planes.get(name)
        _check(plane is not None, f"{QType(w.qtype).name} weight lacks plane {name!r}")
        stored, passed = _PLANE_DTYPES.get(name, ((), None))
        if passed == np.dtype(dt) and plane.dtype in stored:
            plane = plane.view(passed)                  # a reinterpretation (no copy)
        _check(len(plane.shape) == 2 and plane.shape[0] == w.rows and plane.dtype == np.dtype(dt)
               and _c_contig(plane), f"plane {name!r} must be a C-contiguous {dt} [{w.rows}, *], "
               f"got {plane.dtype}{tuple(plane.shape)}")
        slots.append(plane)
    if p.splits > 1:
        _check(workspace is not None and workspace.dtype == np.uint8 and len(workspace.shape) == 1
               and workspace.shape[0] >= p.workspace,
               f"this shape splits K {p.splits} ways and needs a uint8 workspace of "
               f"{p.workspace} bytes (workspace_bytes(w, {n}, {mode!r}))")
        ws = workspace[COUNTER_BYTES:p.workspace].view(np.float32)
        cnt = workspace[:4 * max(p.counters, 4)].view(np.int32)   # RED_KERNEL: never touched
    else:
        flat = y.reshape(y.shape[0] * y.shape[1])        # never touched with one split
        ws, cnt = flat, flat.view(np.int32)
    kern = _kernel(fmt, p.config, p.epi, p.red)   # (one split: either reduction, same path)
    _ensure_compiled(kern, fmt)
    kern[p.grid, p.config.threads, stream, p.smem](
        slots[0], slots[1], slots[2], slots[3], x16, xscale, y, ws, cnt,
        n, rows_out, p.n_stages, p.stages_per_split, p.splits)
    if p.red == K.RED_KERNEL and p.splits > 1:
        grid = (-(-rows_out // R.REDUCE_THREADS), n)
        _reduce_kernel(p.epi)[grid, R.REDUCE_THREADS, stream](ws, xscale, y, n, rows_out, p.splits)


if __name__ == "__main__":
    from .mmq_bench import main
    main()
