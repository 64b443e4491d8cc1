"""The numpy side of the decode GEMV: references and numerics for `gemv.py`'s kernels.

llm.c's rule, a reference beside every kernel: each function here is what a GEMV kernel
computes, written in numpy, plus the error bound the tests and the benchmark compare with.
All are re-exported by `gemv.py` (`gemv.gemv_reference` etc.); the story is in
docs/kernels/gemv.md.

    dequantize_weight       PackedWeight (host planes) -> float32 W (llama.cpp's values)
    gemv_reference          y = x @ W.T (+ residual), float64
    swiglu_reference        act(x @ Wg.T) * (x @ Wu.T); act_reference: silu / gelu_tanh
    quantize_q8_reference   x -> (xq, xs), the q8 activations exactly as the kernel makes them
    dequantize_q8           (xq, xs) -> the float activations the dp4a kernels multiply by
    error_bound             the largest |y_kernel - y_reference| allowed, per element

What it deliberately does not do: touch the device (the launchers are in gemv.py).
"""
from __future__ import annotations

import numpy as np

from . import gemv_kernels as K
from .formats import dequantize
from .layout import PackedWeight, unpack

Q8_BLOCK = 32                   # activation values per q8 scale
Q8_FLOATS = 4                   # floats of xs per 32 values: d and three pre-scaled sums


def dequantize_weight(w: PackedWeight) -> np.ndarray:
    """PackedWeight with host planes -> float32 [rows, cols] (bit-exact llama.cpp values)."""
    return dequantize(unpack(w), w.qtype, (w.rows, w.cols))


def gemv_reference(W: np.ndarray, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W.T (+ residual) in float64: W float32 [rows, cols], x [n_tok, cols].

    Memory traffic of the real thing, per token batch: rows * row_bytes(W) (all of W, once)
    + n_tok * cols * 4 (x) + n_tok * rows * 4 (y): W dominates whenever rows >> n_tok."""
    y = np.asarray(x, np.float64) @ np.asarray(W, np.float64).T
    return y if residual is None else y + residual


def swiglu_reference(Wg: np.ndarray, Wu: np.ndarray, x: np.ndarray, act: str = "silu") -> np.ndarray:
    """h = act(x @ Wg.T) * (x @ Wu.T) in float64: act "silu" (Qwen/Llama feed-forward
    input) or "gelu", the tanh form (Gemma; engine/norm.py's gelu_reference)."""
    g = gemv_reference(Wg, x)
    return act_reference(g, act) * gemv_reference(Wu, x)


def act_reference(g: np.ndarray, act: str) -> np.ndarray:
    """silu(g) or gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))), float64."""
    if act == "silu":
        return g / (1.0 + np.exp(-g))
    if act == "gelu":
        return 0.5 * g * (1.0 + np.tanh(float(K.GELU_S) * g * (1.0 + float(K.GELU_A) * g * g)))
    raise ValueError(f"act must be one of {K.ACTS}, got {act!r}")


def quantize_q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [n, cols] -> (xq int8 [n, cols], xs float32 [n, cols // 8]), exactly what
    the kernel computes. Per 32 values: d = amax / 127, q = rint(x * (127 / amax)), and
    xs holds 4 floats (d, d * sum q[0:16], d * sum q[16:32], d * sum q[0:32]): the sums
    let the kernels apply Q4_K's mins and the -32 / -16 offsets of Q6_K / Q5_0 per run
    of 16 or 32 weights instead of per weight."""
    x = np.asarray(x, np.float32)
    n, cols = x.shape
    blocks = x.reshape(n, cols // Q8_BLOCK, Q8_BLOCK)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int32)
    d = (amax[:, :, 0] / np.float32(127)).astype(np.float32)
    xs = np.empty((n, cols // Q8_BLOCK, Q8_FLOATS), np.float32)
    xs[:, :, 0] = d
    xs[:, :, 1] = d * q[:, :, :16].sum(axis=2).astype(np.float32)
    xs[:, :, 2] = d * q[:, :, 16:].sum(axis=2).astype(np.float32)
    xs[:, :, 3] = d * q.sum(axis=2).astype(np.float32)
    return q.astype(np.int8).reshape(n, cols), xs.reshape(n, cols // Q8_BLOCK * Q8_FLOATS)


def dequantize_q8(xq: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """(xq, xs) -> the float32 activations the dp4a kernels really multiply by."""
    n, cols = xq.shape
    d = xs[:, ::Q8_FLOATS]
    return (xq.reshape(n, -1, Q8_BLOCK).astype(np.float32) * d[:, :, None]).reshape(n, cols)


EPS_F32 = 1e-5      # fp32 accumulation + dequantization rounding, relative to |W| @ |x|
ATOL = 1e-30


def error_bound(W: np.ndarray, x: np.ndarray, mode: str, xs: np.ndarray | None = None) -> np.ndarray:
    """Largest |y_kernel - gemv_reference(W, x)| allowed, per element [n_tok, rows].

    A dot product's rounding error scales with the sum of |terms|, not with |result|
    (which can cancel to ~0), so the scale is |W| @ |x|:
      f32:  EPS_F32 * |W| @ |x|
      dp4a: that, plus the q8 rounding of x: |x - xs * xq| <= xs / 2 per value, so
            |W (x - x~)| <= |W| @ (xs / 2) (xs of x's block, broadcast over its 32 values).
    """
    Wa = np.abs(np.asarray(W, np.float64))
    bound = EPS_F32 * (np.abs(np.asarray(x, np.float64)) @ Wa.T) + ATOL
    if mode == "dp4a":
        if xs is None:
            xs = quantize_q8_reference(x)[1]
        half_step = np.repeat(np.asarray(xs, np.float64)[:, ::Q8_FLOATS] / 2, Q8_BLOCK, axis=1)
        bound += (half_step @ Wa.T) * (1 + 1e-6)
    return bound
