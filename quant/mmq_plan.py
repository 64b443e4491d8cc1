"""MMQ plans: what one GEMM launch of mmq.py runs - kernel format, tile, grid, split of K,
shared memory and workspace - and the tile configurations it picks from.

    SUPPORTED, MODES, REDUCTIONS   GGUF types -> kernel formats; modes -> epilogues; split-K
                                   reductions ("kernel" or "last"; DEFAULT_REDUCE)
    kernel_format(qtype, cols)     the kernel format of a weight (Q8_0: by K)
    TileConfig, small_config(n),   the tile shapes: N <= 64 one tile of all tokens,
    LARGE, CANDIDATES_LARGE        larger N 128 x 128 tiles
    device_limits()                SM count and shared memory per block (queried once)
    plan(...) -> Plan              memoised; the launcher calls it on every launch
    workspace_bytes(w, n, mode)    the split-K workspace a launch needs (COUNTER_BYTES: its
                                   layout), for the engine to allocate at load

Plain Python: no kernel is built here (the geometry comes from mmq_defs.py). The
measurements behind the choices are in docs/kernels/mmq.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .formats import QType
from .layout import PackedWeight
from . import mmq_defs as D
from . import mmq_float as F
from . import mmq_kquants as Q
from . import mmq_legacy as L
from .ptx import SIMULATOR

SUPPORTED = {QType.Q4_K: Q.Q4_K, QType.Q5_K: Q.Q5_K, QType.Q6_K: Q.Q6_K, QType.Q8_0: Q.Q8_0,
             QType.Q4_0: L.Q4_0, QType.Q4_1: L.Q4_1, QType.Q5_0: L.Q5_0, QType.Q5_1: L.Q5_1,
             QType.F16: F.F16, QType.BF16: F.BF16}
# Split-K workspace layout: every plan's int32 tile counters start at byte 0 of a region
# of this size and its partial sums start after it. The kernels leave their counters at
# zero, so one workspace, zeroed once, serves any sequence of launches of different
# plans on one stream: no launch's partial sums can land on another plan's counters.
COUNTER_BYTES = 1 << 16
MODES = {"store": D.EPI_STORE, "add": D.EPI_ADD, "swiglu": D.EPI_SWIGLU, "geglu": D.EPI_GEGLU}
GATED = ("swiglu", "geglu")     # W = [gate; up] stacked by rows; y = act(x G^T) * (x U^T)
REDUCTIONS = {"last": D.RED_LAST, "kernel": D.RED_KERNEL}
# How a split K is summed (mmq_defs.RED_*): "kernel" (partial sums to a workspace,
# then one reduction launch over every output) or "last" (the last block of each tile
# sums the partials of its tile). docs/kernels/mmq.md has the measurements.
DEFAULT_REDUCE = "kernel"
COL_MULTIPLE = 256      # K of the k-quants: whole super-blocks (and Q8_0's fast path: 8-block groups)
COL_MULTIPLE_32 = 32    # K of the 32-weight formats (mmq_legacy.py): whole blocks
COL_MULTIPLE_16 = 16    # K of F16 / BF16 (mmq_float.py): whole k16 groups (prepare_x's unit too)


def kernel_format(qtype, cols: int) -> int:
    """The kernel format code for a weight: Q8_0 takes mmq_kquants' path when K is a
    multiple of 256 (its d plane is staged with cp.async, 8 blocks at a time) and
    mmq_legacy's otherwise (Gemma 3 270M's 640 columns)."""
    fmt = SUPPORTED[QType[qtype] if isinstance(qtype, str) else QType(qtype)]
    if fmt == Q.Q8_0 and cols % COL_MULTIPLE:
        return L.Q8_0L
    return fmt


def _col_multiple(fmt) -> int:
    if fmt in F.FLOAT:
        return COL_MULTIPLE_16
    return COL_MULTIPLE_32 if fmt in L.LEGACY else COL_MULTIPLE


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
        return D.smem_bytes(fmt, self.wm, self.wn, self.mt, self.nt, self.stages)


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
    red: int                            # split-K reduction (mmq_defs.RED_*)


_DEVICE = {}


def device_limits():
    """(SM count, max dynamic shared memory per block) of the current device."""
    if "limits" not in _DEVICE:
        if SIMULATOR:
            _DEVICE["limits"] = (132, 227 * 1024)
        else:
            from numba import cuda
            dev = cuda.get_current_device()
            _DEVICE["limits"] = (dev.MULTIPROCESSOR_COUNT, dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    return _DEVICE["limits"]


def _blocks_per_sm(cfg, smem, smem_limit, epi):
    """Resident blocks per SM: shared memory (an SM has ~1 KB more than one block may
    take, and reserves 1 KB per block), threads, registers (128 per thread when capped,
    see mmq_defs.register_capped; up to 255 otherwise)."""
    per_sm = smem_limit + 1024
    regs = D.MAX_REGISTERS if D.register_capped(cfg.mt, cfg.nt, cfg.threads, epi) else 255
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
    n_stages = -(-cols // D.STAGE_K)        # the last stage of a 32-weight format may be partial
    if config is not None:
        candidates = [config]
    elif n <= 64:
        candidates = [small_config(n)]
    else:
        candidates = [LARGE, replace(LARGE, stages=2)]
    best = None
    for cfg in candidates:
        if epi in D.GATED and cfg.mt % 2:
            raise ValueError(f"mmq: mode {mode!r} needs an even mt, config {cfg.name} has mt = {cfg.mt}")
        fitted = _fit(cfg, fmt, smem_limit)
        if fitted is None:
            raise ValueError(f"mmq: config {cfg.name} needs {cfg.smem_bytes(fmt)} B of shared "
                             f"memory, the device allows {smem_limit}; use a smaller tile")
        cfg = fitted
        smem = cfg.smem_bytes(fmt)
        bm_out = cfg.bm // 2 if epi in D.GATED else cfg.bm
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
    if sp > 1 and red == D.RED_KERNEL:
        partials = sp * n * rows_out * (2 if epi in D.GATED else 1)
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
