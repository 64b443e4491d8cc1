"""Small kernels the CUDA forward needs between the big ones.

    gather_row(src [N, d], state, slot, dst [1, d])     dst[0] = src[state[slot]]
    copy_cols(src [N, c], dst [N, C], col0)             dst[:, col0:col0+c] = src
    softcap(x [N, d], cap)                              x = cap * tanh(x / cap)   (in place)

`gather_row` picks the last prompt token's hidden state for the logits; the row index
is read from device memory, so one captured prefill graph serves every prompt length
of its bucket. `copy_cols` places the V projection next to Q and K when attn_v has a
different quantization type (Q6_K in some layers of Q4_K_M files) and so cannot be
stacked into one GEMM with them. `softcap` bounds the logits of models whose GGUF sets
`final_logit_softcapping` (Gemma 2 style). All move a few KB to a few MB: launch-bound.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from . import kernel_cache

BLOCK = 256


# -- numpy references -------------------------------------------------------------------
def gather_row_reference(src: np.ndarray, index: int) -> np.ndarray:
    return src[index:index + 1].copy()


def copy_cols_reference(src: np.ndarray, dst: np.ndarray, col0: int) -> np.ndarray:
    out = dst.copy()
    out[:, col0:col0 + src.shape[1]] = src
    return out


def softcap_reference(x: np.ndarray, cap: float) -> np.ndarray:
    return (np.tanh(np.asarray(x, np.float64) / cap) * cap).astype(np.float32)


# -- kernels ----------------------------------------------------------------------------
@cuda.jit
def _softcap_kernel(x, cap, inv_cap):
    """Thread i of block row t caps element i of row t."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if i < x.shape[1]:
        x[t, i] = math.tanh(x[t, i] * inv_cap) * cap


@cuda.jit
def _gather_row_kernel(src, state, slot, dst):
    """Thread i copies element i of row state[slot] (rows outside src copy nothing)."""
    i = cuda.grid(1)
    r = state[slot]
    if i < dst.shape[1] and 0 <= r < src.shape[0]:
        dst[0, i] = src[r, i]


@cuda.jit
def _copy_cols_kernel(src, dst, col0):
    """Block (x, t) copies BLOCK columns of row t."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if i < src.shape[1]:
        dst[t, col0 + i] = src[t, i]


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)


# -- launchers --------------------------------------------------------------------------
def _check(name, a, ndim):
    if getattr(a, "dtype", None) != np.float32 or a.ndim != ndim:
        raise ValueError(f"{name} must be a float32 {ndim}-d device array, got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def gather_row(src, state, slot: int, dst, stream=0) -> None:
    _check("src", src, 2)
    _check("dst", dst, 2)
    if dst.shape != (1, src.shape[1]):
        raise ValueError(f"dst must be [1, {src.shape[1]}], got {dst.shape}")
    d = src.shape[1]
    _gather_row_kernel[-(-d // BLOCK), BLOCK, stream](src, state, np.int32(slot), dst)


def copy_cols(src, dst, col0: int, stream=0) -> None:
    _check("src", src, 2)
    _check("dst", dst, 2)
    n, c = src.shape
    if dst.shape[0] != n or not 0 <= col0 <= dst.shape[1] - c:
        raise ValueError(f"copy_cols: src {src.shape} does not fit dst {dst.shape} at column {col0}")
    if n == 0:
        return
    _copy_cols_kernel[(-(-c // BLOCK), n), BLOCK, stream](src, dst, np.int64(col0))


def softcap(x, cap: float, stream=0) -> None:
    """x = cap * tanh(x / cap), in place (float32 [N, d])."""
    _check("x", x, 2)
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap}")
    n, d = x.shape
    _softcap_kernel[(-(-d // BLOCK), n), BLOCK, stream](x, float32(cap), float32(1.0 / cap))
