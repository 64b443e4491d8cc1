"""The numpy side of MMQ: a reference beside every kernel of mmq.py (llm.c's rule), the
error bound the tests compare with, and the host-side helpers that build test weights.

    dequantize_weight(w, rows)             PackedWeight (device or host planes) -> float64 rows
    reference(w, x, mode, y0, rows)        float64 Y of mmq, every mode
    error_bound(w, x, mode, y0, rows)      the guaranteed bound on |mmq - reference|
    prepare_x_reference(x, norm_weight, eps)  numpy twin of prepare_x
    random_weight(qtype, rows, cols, rng)  a PackedWeight of valid random blocks (host planes)
    stack_rows(gate, up)                   the stacked [gate; up] weight of the gated modes

What it deliberately does not do: launch anything (the launchers are in mmq.py).
"""
from __future__ import annotations

import numpy as np

from .formats import QType, dequantize
from .kquants import unpack_q4_k_scales, unpack_q5_k_scales
from .layout import PackedWeight, pack, unpack
from . import mmq_prep as P
from .mmq_plan import GATED


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
