"""Decode GEMV: y = W x (+ r), for quantized weights in the planar device layout.

Decode is bandwidth-bound: each token streams every weight once and does ~2 flops per
weight, so a GEMV is as fast as it reads W. One launch reads a [rows, cols] weight in
its file-sized planes (`layout.py`) with 128-bit loads, decodes the block scales once
per 16-byte unit and accumulates in fp32; the result of each row is reduced with warp
shuffles. Lesson with the memory-traffic and roofline math: docs/kernels/gemv.md.

This file has two parts, in order:
1. `prepare_weight`: a PackedWeight with device planes -> a `GemvWeight` (flat uint32 /
   uint16 views of the same memory, checked once at load; no copy);
2. launchers (`quantize_q8`, `gemv`, `gemv_qkv`, `gemv_swiglu`) and their eager
   compilers (`compile_*`).
The numpy side is in `gemv_reference.py` and re-exported here by name: `dequantize_weight`,
`gemv_reference`, `swiglu_reference`, `act_reference`, `quantize_q8_reference`,
`dequantize_q8` and the error bound the tests and the benchmark use (`error_bound`), with
the q8 layout's `Q8_BLOCK` / `Q8_FLOATS`. The kernels are in `gemv_kernels.py` (the unit
decoders of each format in `gemv_formats.py` / `gemv_units.py`); the benchmark in
`gemv_bench.py` (`python -m genie_rt.quant.gemv`).

Formats: Q4_K, Q6_K, Q8_0, Q5_0 and (gemv_units.py) Q4_0, Q4_1, Q5_1, Q5_K (x quantized
to q8, `dp4a`), F16 and BF16 (float x). Q4_K and Q6_K also have an "f32" mode (dequantize to float, fp32 dot) for comparison;
`DEFAULT_MODE` says which one a weight gets unless `prepare_weight(..., mode=)` says.
Batches: x is float32 [n_tok, cols] with 1 <= n_tok <= 8; y is float32 [n_tok, rows].

Graph capture: launchers never allocate, copy or synchronize; they take every buffer
from the caller (device arrays, e.g. arena views) and a numba stream, and their
kernels can be compiled at load with `compile_gemv` / `compile_qkv` / `compile_swiglu` /
`compile_quantize_q8`, so capturing a decode step compiles nothing.

What it deliberately does not do: batches above 8 tokens (that is the MMQ GEMM),
Q2_K/Q3_K/IQ weights, other norms (the engine fuses the q8 quantization of
x into its norm kernel where it can; `quantize_q8` is the stand-alone version).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import gemv_kernels as K
from .formats import QType
from .gemv_reference import (ATOL, EPS_F32, Q8_BLOCK, Q8_FLOATS, act_reference,  # noqa: F401
                             dequantize_q8, dequantize_weight, error_bound, gemv_reference,
                             quantize_q8_reference, swiglu_reference)
from .layout import PackedWeight

MAX_TOKENS = 8                  # n_tok per launch: accumulators live in registers
SUPPORTED = tuple(K.MODES)      # Q4_K, Q6_K, Q8_0, Q5_0, F16, Q4_0, Q4_1, Q5_1, Q5_K, BF16
DEFAULT_MODE = {q: modes[0] for q, modes in K.MODES.items()}

# =====================================================================================
# 1. Weights prepared for the kernels
# =====================================================================================


@dataclass(frozen=True, eq=False)
class GemvWeight:
    """A weight ready for the GEMV kernels: flat views of its device planes (no copy).

    Slots (the kernels' wa, wb, wc: uint32 words; wd: uint16 fp16 bits):
        Q4_K  wa = qs, wb = hdr            Q6_K  wa = ql, wb = qh, wc = sc, wd = d
        Q8_0  wa = qs, wd = d              Q5_0  wa = qs, wb = qh, wd = d
        F16   wa = w                       BF16  wa = w
        Q4_0  wa = qs, wd = d              Q4_1  wa = qs, wb = dm
        Q5_1  wa = qs, wb = qh, wc = dm    Q5_K  wa = qs, wb = hdr, wc = qh
    Unused slots hold another view of the same memory (never read)."""
    qtype: QType
    mode: str               # "dp4a" (x as q8) or "f32" (x as float32)
    rows: int
    cols: int
    units: int              # 16-byte units of the bulk plane per row
    wa: object
    wb: object
    wc: object
    wd: object
    nbytes: int             # bytes one GEMV streams (the GGUF tensor size)

    @property
    def spec(self) -> tuple:
        return (self.qtype, self.mode)


_is_device = K.ptx.is_device_array
_address = K.ptx.device_address


def _flat(a, dtype=None):
    """1-D view of a C-contiguous device array (optionally reinterpreted as dtype)."""
    a = a.reshape(a.size)
    return a if dtype is None else a.view(dtype)


# slots the loaders read with ld.global.nc.v4 (16-byte aligned); the others are read a
# word or a half at a time (the fields of the 32-weight formats: 4-byte rows of d, qh, dm)
_VECTOR_SLOTS = {QType.Q4_K: ("wa", "wb"), QType.Q6_K: ("wa", "wb", "wc"), QType.Q5_K: ("wa", "wb", "wc")}


def prepare_weight(w: PackedWeight, mode: str | None = None) -> GemvWeight:
    """Check a PackedWeight whose planes are device arrays and make the kernels' views.

    Call once at load (not per launch). Raises ValueError for formats, modes or shapes
    the kernels cannot read, and for planes that are host arrays or misaligned."""
    qtype = QType(w.qtype)
    if qtype not in K.MODES:
        raise ValueError(f"gemv: no kernel for {qtype.name} weights; supported: "
                         f"{', '.join(q.name for q in SUPPORTED)}")
    mode = DEFAULT_MODE[qtype] if mode is None else mode
    if mode not in K.MODES[qtype]:
        raise ValueError(f"gemv: {qtype.name} supports modes {K.MODES[qtype]}, not {mode!r}")
    rows, cols = int(w.rows), int(w.cols)
    if cols % K.UNIT_WEIGHTS[qtype] or (mode == "dp4a" and cols % Q8_BLOCK) or cols % 8:
        raise ValueError(f"gemv: {qtype.name} weight with {cols} columns; need a multiple of "
                         f"{max(K.UNIT_WEIGHTS[qtype], 8)}{' and of 32' if mode == 'dp4a' else ''}")
    for name, plane in w.planes.items():
        if not _is_device(plane):
            raise ValueError(f"gemv: plane {name!r} of the {qtype.name} weight is a host array; "
                             f"copy the planes to the device once at load (cuda.to_device or arena views)")
        if not plane.flags["C_CONTIGUOUS"]:
            raise ValueError(f"gemv: plane {name!r} must be C-contiguous")
    u32, u16 = np.uint32, np.uint16
    p = w.planes
    if qtype == QType.Q4_K:
        wa, wb = _flat(p["qs"], u32), _flat(p["hdr"], u32)
        wc, wd = wa, wa.view(u16)
    elif qtype == QType.Q6_K:
        wa, wb, wc, wd = _flat(p["ql"], u32), _flat(p["qh"], u32), _flat(p["sc"], u32), _flat(p["d"], u16)
    elif qtype == QType.Q8_0:
        wa, wd = _flat(p["qs"], u32), _flat(p["d"], u16)
        wb = wc = wa
    elif qtype == QType.Q5_0:
        wa, wb, wd = _flat(p["qs"], u32), _flat(p["qh"], u32), _flat(p["d"], u16)
        wc = wa
    elif qtype == QType.Q4_0:
        wa, wd = _flat(p["qs"], u32), _flat(p["d"], u16)
        wb = wc = wa
    elif qtype == QType.Q4_1:
        wa, wb = _flat(p["qs"], u32), _flat(p["dm"], u32)
        wc, wd = wa, wa.view(u16)
    elif qtype == QType.Q5_1:
        wa, wb, wc = _flat(p["qs"], u32), _flat(p["qh"], u32), _flat(p["dm"], u32)
        wd = wa.view(u16)
    elif qtype == QType.Q5_K:
        wa, wb, wc = _flat(p["qs"], u32), _flat(p["hdr"], u32), _flat(p["qh"], u32)
        wd = wa.view(u16)
    else:  # F16, BF16
        wa, wd = _flat(p["w"], u32), _flat(p["w"], u16)
        wb = wc = wa
    slots = {"wa": wa, "wb": wb, "wc": wc}
    for name in _VECTOR_SLOTS.get(qtype, ("wa",)):      # the slots read with 16-byte loads
        a = slots[name]
        if _address(a) % 16:
            raise ValueError(f"gemv: {qtype.name} plane ({name}) starts at {_address(a):#x}, not "
                             f"16-byte aligned: keep arena offsets at multiples of 16")
    units = cols // K.UNIT_WEIGHTS[qtype]
    return GemvWeight(qtype, mode, rows, cols, units, wa, wb, wc, wd, int(w.nbytes))


def to_device(w: PackedWeight, stream=0) -> PackedWeight:
    """Host PackedWeight -> one with device planes (allocates: load time only)."""
    from numba import cuda
    return PackedWeight(w.qtype, w.rows, w.cols,
                        {k: cuda.to_device(np.ascontiguousarray(v), stream=stream) for k, v in w.planes.items()})


def needs_q8(*weights: GemvWeight) -> bool:
    """True if any of these weights multiplies q8 activations (call quantize_q8 first)."""
    return any(w.mode == "dp4a" for w in weights)


# =====================================================================================
# 2. Launchers
# =====================================================================================
_kernels: dict = {}
_sm_count_cache: list = []


def sm_count() -> int:
    """The current device's SM count, asked once (1 in the simulator, which has none)."""
    if not _sm_count_cache:
        try:
            from numba import cuda
            _sm_count_cache.append(int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
        except Exception:            # the simulator has no SM count
            _sm_count_cache.append(1)
    return _sm_count_cache[0]


KSPLIT_WARPS_PER_SM = 16    # split rows only when there are fewer than this many per SM


def choose_ksplit(total_rows: int, units: int) -> int:
    """Warps per row: split a row over 2 or 4 warps only when there are too few rows to
    give every SM KSPLIT_WARPS_PER_SM warps and each part keeps >= 2 units per lane. On
    the H200 (132 SMs) the layers' GEMVs (>= 2560 rows) run unsplit: in the decode step's
    graph that was 4.4 % faster than splitting attn_output and ffn_down in two (gemv.md)."""
    target = KSPLIT_WARPS_PER_SM * sm_count()
    ks = 1
    while ks < 4 and total_rows * ks < target and units >= 64 * ks:
        ks *= 2
    return ks


# Lanes per row (32: one row per warp; 16: two rows per warp) the launchers use unless
# told otherwise; see choose_lpr and docs/kernels/gemv.md, section 8.
LPR_POLICY = "auto"         # "auto" (the rule in choose_lpr), or 16 / 32 for every launch
LPR16_MIN_ROWS = 16384      # "auto" takes 16 lanes per row only for weights this tall


def choose_lpr(units: int, ks: int, rows: int) -> int:
    """Policy "auto": 16 lanes per row for tall weights (>= LPR16_MIN_ROWS rows: the
    output projection) whose rows split evenly over 5 units per lane (2560 columns of
    Q4_K / Q6_K: 80 units), so no lane idles through a half-empty last trip; 32
    otherwise. Measured on the H200 (gemv.md, 8): the output projection gains 12 %,
    while the layers' GEMVs inside the decode step's graph are slower with 16 (fewer,
    busier warps for a few thousand rows). 16 only without a k-split."""
    if ks != 1:
        return 32
    if LPR_POLICY == "auto":
        return 16 if units == 80 and rows >= LPR16_MIN_ROWS else 32
    return int(LPR_POLICY)


# Programmatic dependent launch (quant/pdl.py): the default of every launcher's `pdl=`
# argument, off. With pdl the GEMV kernels are built and launched for PDL (sm_90+ only: the
# caller checks pdl.available()); the engine passes EngineConfig.decode_pdl.
PDL = False


def _pdl(pdl) -> bool:
    return PDL if pdl is None else bool(pdl)


def _launch(kern, grid, stream, pdl: bool, sig: str, *args):
    from . import pdl as P
    P.launch_or_plain(kern, grid, K.BLOCK, stream, sig, pdl, *args)


def _get(key, make):
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = make()
    return k


# Trips of a row (3 units a lane each) whose weight loads a PDL build of the plain GEMV (in the
# decode step: attention output, ffn_down and the output projection; not QKV or gate/up) issues
# before it waits for the kernel before: 1, 2 or 3 (gemv_kernels._make_row_dot EARLY; the same
# bits; a row of fewer trips re-reads its last unit for the rest, from L1). H200, 2026-12-04 12:43 UTC
# (tools/profile_decode.py --settings early, the 4B's step): 1.976 / 1.961 / 2.109 ms at depth
# 512, 2.276 / 2.246 / 2.401 ms at 4096 - two (3 trips' registers cost occupancy: 98 / 130
# registers for Q4_K / Q6_K against 72 / 96 at two, ptxas sm_90). (Those loads were read-only ones,
# which ptxas scheduled after the wait: the numbers compared code shapes. Pinned above it since
# 2026-12-06 - PDL_PIN_WEIGHTS below - two is still the best for Q4_K, one for Q6_K.)
PDL_EARLY_TRIPS = 2

# Whether a PDL build's loads before its wait are ones the compilers leave there (ptx.ldw_v4), or
# the read-only ldg_v4 that every build used until 2026-12-06 - which ptxas (12.9, 13.0) schedules
# below griddepcontrol.wait, so no weight load overlapped the kernel before (the SASS:
# tests/test_pdl_sass.py). A lab knob, to time the two against each other (tools/profile_decode.py
# --settings pin); the same bits either way. Pinned, a 16-lane row (the output projection: many
# waves, whose later blocks gain nothing) keeps one early trip - two would pin 5 Q6_K units' loads,
# 120 registers against 64. The 4B's step at depth 64 (H100, 2026-12-06 03:50 UTC, two passes):
# 1.863 / 1.866 ms unpinned, 1.810 / 1.821 pinned (Q6_K one early trip), 1.762 / 1.783 pinned with
# SWIGLU_PAIR; tg128 545.1 -> 572.2 tokens/s (docs/decode-journal.md 6i).
PDL_PIN_WEIGHTS = True
# Q6_K's early trips where they differ from PDL_EARLY_TRIPS (None: the same). Pinned, two trips of
# Q6_K units (4 loads each) take ptxas sm_90 to 98 registers - 4 blocks an SM, so ffn_down's 640
# blocks need two waves on 132 SMs - and one trip to 64 (Q4_K: 76 at two trips, 6 blocks an SM; 58
# at one). Timed uncapped (H100, 2026-12-06 03:50 UTC): two trips everywhere 1.852 / 1.855 ms, one
# everywhere 1.821 / 1.835, two for Q4_K and one for Q6_K 1.810 / 1.821. With PDL_MAX_REGISTERS at 96
# (below) two Q6_K trips are 5 blocks an SM, one wave, and the best way (07:15-07:44 UTC): the step
# 1.781 / 1.771 ms against 1.794 / 1.783 at depth 64, 2.042 / 1.997 against 2.049 / 2.012 at 4,096
# (the same bits), genie-rt bench tg128 576.5 / 487.4 against 569.9 / 482.2 at depth 0 / 4,096 in
# one call (docs/decode-journal.md 6j).
PDL_EARLY_TRIPS_Q6K = 2
# ptxas's register cap for the PDL builds of the plain GEMV (None: its own choice). Binding only where
# a build wants more: two pinned Q6_K trips (98 -> 96, 12 bytes of spill) or three Q4_K trips (100 ->
# 96, 8 bytes); the others take 58-76. Uncapped, three Q4_K trips cost 7 % of the step (4 blocks an
# SM); capped, they were within 1 % of two (tools/profile_decode.py --settings trips). The plain builds
# (sm_80 / sm_87: the Jetson) are not capped.
PDL_MAX_REGISTERS = 96


def _early_trips(qtype, lpr: int, pin: bool) -> int:
    """The early trips of a PDL build of the plain GEMV (gemv_kernels._make_row_dot EARLY)."""
    if not pin:
        return PDL_EARLY_TRIPS                  # the build of 2026-12-04 to 12-06
    if lpr != 32:
        return 1
    if qtype == QType.Q6_K and PDL_EARLY_TRIPS_Q6K is not None:
        return PDL_EARLY_TRIPS_Q6K
    return PDL_EARLY_TRIPS


def _gemv_kernel(spec, n_tok, ks, resid, lpr, pdl=False):
    pin = PDL_PIN_WEIGHTS
    early = _early_trips(spec[0], lpr, pin) if pdl else 1
    cap = PDL_MAX_REGISTERS if pdl else None
    return _get(("gemv", spec, n_tok, ks, resid, lpr, pdl, early, pin, cap),
                lambda: K.gemv_kernel(spec[0], spec[1], n_tok, ks, resid, lpr, pdl, EARLY=early, PIN=pin,
                                      MAXREG=cap))


def _qkv_kernel(specs, n_tok, ks, lpr, pdl=False):
    pin = PDL_PIN_WEIGHTS
    return _get(("qkv", specs, n_tok, ks, lpr, pdl, pin),
                lambda: K.qkv_kernel(specs, n_tok, ks, lpr, PDL=pdl, PIN=pin))


# The SwiGLU GEMV streams a warp's gate and up rows together where it can (K.pairable: one token,
# dp4a, the same units a row), so a PDL build has both rows' first trip in flight before its wait.
# Within the noise while the early loads were sunk below the wait (2026-12-04); with them pinned
# there, the 4B's step at depth 64 took 1.762 / 1.783 ms against 1.810 / 1.821 without (H100,
# 2026-12-06, tools/profile_decode.py --settings pin; the same bits): on since, for the PDL builds
# it was timed in. A plain build (sm_80 / sm_87: the Jetson; --no-pdl) stays unpaired - untimed
# there, and pairing costs registers (ptxas sm_87: 66 against 52; sm_90 PDL: 96 against 60).
SWIGLU_PAIR = True


def _swiglu_kernel(g, u, n_tok, ks, lpr, act="silu", pdl=False):
    pair = SWIGLU_PAIR and pdl and K.pairable(g, u, n_tok)
    pin = PDL_PIN_WEIGHTS
    return _get(("swiglu", g, u, n_tok, ks, lpr, act, pdl, pair, pin),
                lambda: K.swiglu_kernel(g, u, n_tok, ks, lpr, act, PDL=pdl, PAIR=pair, PIN=pin))


def _blocks(rows: int, ks: int, lpr: int = 32) -> int:
    per_block = K.WARPS * (32 // lpr)               # rows per block at ks = 1
    return -(-rows * ks // per_block)


_W = "uint32[::1], uint32[::1], uint32[::1], uint16[::1], int64"       # wa wb wc wd nu
_X = "float32[::1], uint32[::1], float32[::1], int64"                  # xf xq xs cols
SIG_GEMV = f"void({_W}, int64, {_X}, float32[::1], float32[::1])"
SIG_QKV = f"void({_W}, int64, {_W}, int64, {_W}, int64, int64, int64, {_X}, float32[::1])"
SIG_SWIGLU = f"void({_W}, {_W}, int64, {_X}, float32[::1])"
SIG_QUANTIZE = "void(float32[::1], int8[::1], float32[::1], int64)"


def _compile(kernel, sig):
    if not K.ptx.SIMULATOR:
        kernel.compile(sig)
    return kernel


def _check_array(a, what, dtype, shape):
    if not _is_device(a):
        raise TypeError(f"gemv: {what} must be a device array (cuda.device_array / an arena view), "
                        f"got {type(a).__name__}: a host array would be copied on every launch")
    if a.dtype != dtype or tuple(a.shape) != tuple(shape):
        raise ValueError(f"gemv: {what} must be {np.dtype(dtype).name} {list(shape)}, "
                         f"got {a.dtype} {list(a.shape)}")
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"gemv: {what} must be C-contiguous")
    if _address(a) % 16:
        raise ValueError(f"gemv: {what} must start 16-byte aligned (got {_address(a):#x})")


def _activations(weights, x, xq, xs):
    """Check x (and xq/xs when a weight needs q8); return flat (xf, xq, xs, n_tok, cols)."""
    if not _is_device(x) or len(x.shape) != 2:
        raise TypeError(f"gemv: x must be a 2-D float32 device array [n_tok, cols], got "
                        f"{type(x).__name__} {getattr(x, 'shape', '')}")
    n_tok, cols = int(x.shape[0]), int(x.shape[1])
    if not 1 <= n_tok <= MAX_TOKENS:
        raise ValueError(f"gemv: n_tok = {n_tok}; the GEMV takes 1..{MAX_TOKENS} tokens "
                         f"(larger batches: the MMQ GEMM)")
    for w in weights:
        if w.cols != cols:
            raise ValueError(f"gemv: x has {cols} columns but the {w.qtype.name} weight "
                             f"[{w.rows}, {w.cols}] needs {w.cols}")
    _check_array(x, "x", np.float32, (n_tok, cols))
    xf = _flat(x)
    if needs_q8(*weights):
        if xq is None or xs is None:
            raise ValueError("gemv: these weights multiply q8 activations: pass xq and xs, "
                             "filled by quantize_q8(x, xq, xs) (or by a fused norm kernel)")
        _check_array(xq, "xq", np.int8, (n_tok, cols))
        _check_array(xs, "xs", np.float32, (n_tok, cols // Q8_BLOCK * Q8_FLOATS))
        return xf, _flat(xq, np.uint32), _flat(xs), n_tok, cols
    return xf, xf.view(np.uint32), xf, n_tok, cols      # unused slots: views of x


def _check_out(y, what, n_tok, n, x):
    _check_array(y, what, np.float32, (n_tok, n))
    xa, ya = _address(x), _address(y)
    if xa < ya + y.size * 4 and ya < xa + x.size * 4:
        raise ValueError(f"gemv: {what} overlaps x (x is read through the read-only cache)")


def _w_args(w: GemvWeight):
    return (w.wa, w.wb, w.wc, w.wd, w.units)


def _prepared(w):
    return w if isinstance(w, GemvWeight) else prepare_weight(w)


def _split_lanes(rows, units, ksplit, lpr):
    """(ksplit, lanes per row) of a launch: the arguments, or the policies' choice."""
    ks = choose_ksplit(rows, units) if ksplit is None else ksplit
    lpr = choose_lpr(units, ks, rows) if lpr is None else lpr
    if lpr not in (16, 32) or (lpr == 16 and ks != 1):
        raise ValueError(f"gemv: lanes per row must be 32, or 16 without a k-split; got "
                         f"lpr = {lpr}, ksplit = {ks}")
    return ks, lpr


def quantize_q8(x, xq, xs, *, stream=0, pdl=None):
    """x float32 [n, cols] -> xq int8 [n, cols] + xs float32 [n, cols // 8] (q8 per 32 values:
    the layout is quantize_q8_reference's). pdl: the PDL build and launch (quant/pdl.py: it
    lets the next kernel launch at once, and waits for the kernel before it before reading x)."""
    if not _is_device(x) or len(x.shape) != 2:
        raise TypeError("quantize_q8: x must be a 2-D float32 device array")
    n, cols = int(x.shape[0]), int(x.shape[1])
    if cols % Q8_BLOCK:
        raise ValueError(f"quantize_q8: cols = {cols} is not a multiple of {Q8_BLOCK}")
    _check_array(x, "x", np.float32, (n, cols))
    _check_array(xq, "xq", np.int8, (n, cols))
    _check_array(xs, "xs", np.float32, (n, cols // Q8_BLOCK * Q8_FLOATS))
    total = n * cols
    pdl = _pdl(pdl)
    kern = K.quantize_q8_pdl_kernel if pdl else K.quantize_q8_kernel
    _launch(kern, -(-total // K.BLOCK), stream, pdl, SIG_QUANTIZE, _flat(x), _flat(xq), _flat(xs), total)


def compile_quantize_q8(pdl=None):
    return _compile(K.quantize_q8_pdl_kernel if _pdl(pdl) else K.quantize_q8_kernel, SIG_QUANTIZE)


def gemv(w, x, y, *, xq=None, xs=None, residual=None, stream=0, ksplit=None, lpr=None, pdl=None):
    """y[t] = W x[t] (+ residual[t]) for the n_tok rows t of x.

    w: GemvWeight [rows, cols] (prepare_weight; a PackedWeight works too, prepared per call)
    x: float32 [n_tok, cols], 1 <= n_tok <= 8
    y: float32 [n_tok, rows]                      residual: float32 [n_tok, rows] or None;
       may be y itself (y += W x, in place on the residual stream)
    xq, xs: q8 activations of x (quantize_q8), needed when w.mode == "dp4a"
    ksplit: warps per row (1, 2, 4); lpr: lanes per row (32, or 16 = two rows per warp);
    None picks each by choose_ksplit / choose_lpr.
    pdl: a programmatic-dependent-launch build and launch (quant/pdl.py, sm_90+; None: PDL)."""
    w = _prepared(w)
    xf, xqf, xsf, n_tok, cols = _activations((w,), x, xq, xs)
    _check_out(y, "y", n_tok, w.rows, x)
    if residual is not None and residual is not y:
        _check_out(residual, "residual", n_tok, w.rows, x)
    ks, lpr = _split_lanes(w.rows, w.units, ksplit, lpr)
    pdl = _pdl(pdl)
    kern = _gemv_kernel(w.spec, n_tok, ks, residual is not None, lpr, pdl)
    yf = _flat(y)
    res = yf if residual is None or residual is y else _flat(residual)
    _launch(kern, _blocks(w.rows, ks, lpr), stream, pdl, SIG_GEMV,
            *_w_args(w), w.rows, xf, xqf, xsf, cols, yf, res)


def compile_gemv(w, n_tok=1, residual=False, ksplit=None, lpr=None, pdl=None):
    """Compile (at load) the kernel gemv(w, x[n_tok], ..., residual=...) will launch."""
    w = _prepared(w)
    ks, lpr = _split_lanes(w.rows, w.units, ksplit, lpr)
    return _compile(_gemv_kernel(w.spec, n_tok, ks, bool(residual), lpr, _pdl(pdl)), SIG_GEMV)


def gemv_qkv(wq, wk, wv, x, y, *, xq=None, xs=None, stream=0, ksplit=None, lpr=None, pdl=None):
    """y = [Wq x | Wk x | Wv x] in one launch: y float32 [n_tok, rows_q + rows_k + rows_v].

    The three weights may have different formats (e.g. attn_v Q6_K, attn_q/k Q4_K):
    each block owns rows of one weight only, so the format branch is uniform per block.
    Take q/k/v as column slices of y (or let the next kernel index y directly)."""
    ws = tuple(_prepared(w) for w in (wq, wk, wv))
    xf, xqf, xsf, n_tok, cols = _activations(ws, x, xq, xs)
    total = sum(w.rows for w in ws)
    _check_out(y, "y", n_tok, total, x)
    ks, lpr = _split_lanes(total, min(w.units for w in ws), ksplit, lpr)
    pdl = _pdl(pdl)
    kern = _qkv_kernel(tuple(w.spec for w in ws), n_tok, ks, lpr, pdl)
    b1 = _blocks(ws[0].rows, ks, lpr)
    b2 = b1 + _blocks(ws[1].rows, ks, lpr)
    grid = b2 + _blocks(ws[2].rows, ks, lpr)
    args = []
    for w in ws:
        args += [*_w_args(w), w.rows]
    _launch(kern, grid, stream, pdl, SIG_QKV, *args, b1, b2, xf, xqf, xsf, cols, _flat(y))


def compile_qkv(wq, wk, wv, n_tok=1, ksplit=None, lpr=None, pdl=None):
    ws = tuple(_prepared(w) for w in (wq, wk, wv))
    total = sum(w.rows for w in ws)
    ks, lpr = _split_lanes(total, min(w.units for w in ws), ksplit, lpr)
    return _compile(_qkv_kernel(tuple(w.spec for w in ws), n_tok, ks, lpr, _pdl(pdl)), SIG_QKV)


def gemv_swiglu(wg, wu, x, h, *, xq=None, xs=None, stream=0, ksplit=None, lpr=None, act="silu",
                pdl=None):
    """h = act(Wg x) * (Wu x) in one launch: h float32 [n_tok, rows]; act "silu" (SwiGLU)
    or "gelu" (GELU, tanh form: Gemma's GeGLU).

    Wg and Wu must have the same shape; their formats may differ (the kernel then runs
    two different row loops one after the other, still one launch)."""
    if act not in K.ACTS:
        raise ValueError(f"gemv_swiglu: act must be one of {K.ACTS}, got {act!r}")
    wg, wu = _prepared(wg), _prepared(wu)
    if (wg.rows, wg.cols) != (wu.rows, wu.cols):
        raise ValueError(f"gemv_swiglu: gate {wg.rows}x{wg.cols} and up {wu.rows}x{wu.cols} differ")
    xf, xqf, xsf, n_tok, cols = _activations((wg, wu), x, xq, xs)
    _check_out(h, "h", n_tok, wg.rows, x)
    ks, lpr = _split_lanes(wg.rows, min(wg.units, wu.units), ksplit, lpr)
    pdl = _pdl(pdl)
    kern = _swiglu_kernel(wg.spec, wu.spec, n_tok, ks, lpr, act, pdl)
    _launch(kern, _blocks(wg.rows, ks, lpr), stream, pdl, SIG_SWIGLU, *_w_args(wg), *_w_args(wu), wg.rows,
            xf, xqf, xsf, cols, _flat(h))


def compile_swiglu(wg, wu, n_tok=1, ksplit=None, lpr=None, act="silu", pdl=None):
    wg, wu = _prepared(wg), _prepared(wu)
    ks, lpr = _split_lanes(wg.rows, min(wg.units, wu.units), ksplit, lpr)
    return _compile(_swiglu_kernel(wg.spec, wu.spec, n_tok, ks, lpr, act, _pdl(pdl)), SIG_SWIGLU)


if __name__ == "__main__":
    from .gemv_bench import main
    raise SystemExit(main())
