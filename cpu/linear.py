"""y = x W^T on the CPU with W in its GGUF encoding: the numpy reference and the launcher.

    linear(x, w, out=None) -> out
        x    float32 [n, cols]  activations, one row per token (C-contiguous)
        w    CPUWeight (rows, cols), any type in weights.SUPPORTED, read in place
        out  float32 [n, rows]  written and returned (allocated when None)

Integer formats quantize x to int8 per block first (like llama.cpp: per 32 values for
Q4_0..Q8_0, per 256 for Q4_K..Q6_K); float formats keep x in float32. Kernels, thread
split and the batch-invariance argument: linear_kernels.py. Speed: docs/cpu-backend.md.

Two references, both numpy:
- `linear_reference(x, w)`: quant/formats.dequantize, then a float64 matmul of the
  exact x - the ground truth. The kernel differs from it by the int8 rounding of x,
  bounded elementwise by `linear_error_bound` (|W| . |x - x_q|, plus float32 rounding).
- `linear_quantized_reference(x, w)`: the same float64 matmul but with the kernel's own
  quantized x (`quantize_rows_reference`), so kernel and reference differ only by
  float32 rounding - the tight check that catches a wrong scale or a swapped block.

What it deliberately does not do: own any weights or scratch (each call allocates its
own int8 copy of x, n * cols bytes), fuse ops, or pick the thread count (threads.py).
"""
from __future__ import annotations

import numpy as np

from genie_rt.quant.formats import QType, dequantize

from . import linear_kernels as K
from .threads import get_threads
from .weights import KQUANT, LEGACY, CPUWeight

# -- numpy references --------------------------------------------------------------------


def quantize_rows_reference(x: np.ndarray, block: int):
    """float32 [n, k] -> (q int8 [n, k], d float32 [n, k / block]); the kernels' rule."""
    x = np.asarray(x, np.float32)
    n, k = x.shape
    xb = x.reshape(n, k // block, block)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(n, k), d


def activation_block(w: CPUWeight) -> int:
    """Values per int8 scale of x for this weight type (0: x stays float32)."""
    return 32 if w.qtype in LEGACY else 256 if w.qtype in KQUANT else 0


def linear_reference(x: np.ndarray, w: CPUWeight) -> np.ndarray:
    """float64 [n, rows]: dequantized W times the exact x."""
    wf = dequantize(w.data, w.qtype, w.shape).astype(np.float64)
    return np.asarray(x, np.float64) @ wf.T


def linear_quantized_reference(x: np.ndarray, w: CPUWeight) -> np.ndarray:
    """float64 [n, rows]: dequantized W times x as the kernel quantizes it."""
    block = activation_block(w)
    if block:
        q, d = quantize_rows_reference(x, block)
        n, k = q.shape
        x = (q.reshape(n, k // block, block).astype(np.float64) * d[..., None]).reshape(n, k)
    return linear_reference(x, w)


def linear_error_bound(x: np.ndarray, w: CPUWeight, quantized: bool = False) -> np.ndarray:
    """float64 [n, rows]: a bound on |kernel - linear_reference|, elementwise (with
    quantized=True: on |kernel - linear_quantized_reference|, float32 rounding only).

    The int8 rounding moves each x by at most half its block's step d/2, summed against
    |W|. Float32 arithmetic: the per-block integer sums are exact; each block's float
    combination and the running sum round a few times each, 2^-24 of the magnitudes
    involved. Those magnitudes are |W| |x_q|, except that the formats with a block
    minimum (Q4_1, Q5_1, Q4_K, Q5_K) split each weight into a scaled quant and a min that
    may be larger than the weight; we allow 2 * max|W| of the row per weight for that."""
    x = np.asarray(x, np.float32)
    wf = np.abs(dequantize(w.data, w.qtype, w.shape).astype(np.float64))
    block = activation_block(w)
    n, k = x.shape
    if not block:
        ulps = (k // 64 + k % 64 + 8) * 2.0 ** -24
        return (np.abs(x.astype(np.float64)) @ wf.T) * ulps + 1e-30
    q, d = quantize_rows_reference(x, block)
    xq = np.abs(q.reshape(n, k // block, block).astype(np.float64) * d[..., None]).reshape(n, k)
    parts = xq @ wf.T + np.abs(xq).sum(axis=1, keepdims=True) * (2 * wf.max(axis=1))[None, :]
    rounding = parts * ((3 * (k // 32) + 8) * 2.0 ** -24) + 1e-30
    if quantized:
        return rounding
    step = np.repeat(d.astype(np.float64), block, axis=1) / 2      # [n, k] max rounding of each x
    return step @ wf.T + rounding


# -- launcher ----------------------------------------------------------------------------


def linear(x: np.ndarray, w: CPUWeight, out: np.ndarray | None = None) -> np.ndarray:
    """out[t, r] = sum_c x[t, c] * W[r, c]; see the module docstring for the contract."""
    if not isinstance(w, CPUWeight):
        raise TypeError(f"linear: w must be a CPUWeight (CPUWeight.from_tensor(t)), got {type(w).__name__}")
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous):
        raise ValueError(f"linear({w.name}): x must be a C-contiguous float32 [n, {w.cols}] array, got "
                         f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    n, cols = x.shape
    if cols != w.cols:
        raise ValueError(f"linear({w.name}): x has {cols} columns but the weight has {w.cols} ({w.shape})")
    if out is None:
        out = np.empty((n, w.rows), np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (n, w.rows)
              and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"linear({w.name}): out must be a writable C-contiguous float32 [{n}, {w.rows}], "
                         f"got {getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    if n == 0:
        return out
    nt = min(get_threads(), w.rows)
    data = w.data
    if w.qtype == QType.F32:
        data = data.view(np.float32)
    elif w.qtype in (QType.F16, QType.BF16):
        data = data.view(np.uint16)
    _KERNELS[w.qtype](x, data, w.rows, out, nt)
    return out


_KERNELS = {
    QType.Q4_0: K.linear_q4_0, QType.Q4_1: K.linear_q4_1, QType.Q5_0: K.linear_q5_0, QType.Q5_1: K.linear_q5_1,
    QType.Q8_0: K.linear_q8_0, QType.Q4_K: K.linear_q4_k, QType.Q5_K: K.linear_q5_k, QType.Q6_K: K.linear_q6_k,
    QType.F32: K.linear_f32, QType.F16: K.linear_f16, QType.BF16: K.linear_bf16,
}
