"""The KV pool on the host: per layer `[position][kv_head][head_dim]`, INT8 or FP16/FP32.

INT8 stores one absmax scale per (layer, position, kv_head), for K and for V:

    scale = max(|x[0:head_dim]|) / 127          float32
    q     = round(x / scale)                    int8 in [-127, 127]
    x'    = q * scale                           (scale 0 when the row is all zeros)

Half the bytes of FP16 (plus 4 bytes per 128 values for the scale), and the same
per-row format as the CUDA pool, so files saved by one back-end load in the other.

This module holds bytes and converts them; it does not know which tokens the
positions hold (the engine's `kv_tokens` tracks that) and has no GPU code.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KV_DTYPES = ("int8", "f16", "f32")
_STORAGE = {"int8": np.int8, "f16": np.float16, "f32": np.float32}


@dataclass(frozen=True)
class KVShape:
    n_layers: int
    n_ctx: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # "int8" | "f16" | "f32"

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype '{self.dtype}' is not one of {', '.join(KV_DTYPES)}")

    @property
    def bytes_per_position(self) -> int:
        """K and V bytes for one position across all layers (scales included)."""
        per_head = self.head_dim * np.dtype(_STORAGE[self.dtype]).itemsize
        if self.dtype == "int8":
            per_head += 4  # float32 scale
        return 2 * self.n_layers * self.n_kv_heads * per_head

    def nbytes(self, n_positions: int | None = None) -> int:
        return self.bytes_per_position * (self.n_ctx if n_positions is None else n_positions)


def quantize_rows_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float[..., head_dim] -> (q int8[..., head_dim], scale float32[...])."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_rows_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[..., None]


class HostKVPool:
    """KV storage in numpy arrays for the CPU back-end.

    k, v:             storage dtype [n_layers, n_ctx, n_kv_heads, head_dim]
    k_scale, v_scale: float32       [n_layers, n_ctx, n_kv_heads]   (int8 only)
    """

    def __init__(self, shape: KVShape):
        self.shape = shape
        dt = _STORAGE[shape.dtype]
        dims = (shape.n_layers, shape.n_ctx, shape.n_kv_heads, shape.head_dim)
        self.k = np.zeros(dims, dt)
        self.v = np.zeros(dims, dt)
        if shape.dtype == "int8":
            self.k_scale = np.zeros(dims[:3], np.float32)
            self.v_scale = np.zeros(dims[:3], np.float32)

    @property
    def n_ctx(self) -> int:
        return self.shape.n_ctx

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v float[n, n_kv_heads, head_dim] at positions start .. start+n-1."""
        n = k.shape[0]
        if start < 0 or start + n > self.shape.n_ctx:
            raise IndexError(f"KV write of {n} positions at {start} exceeds the context {self.shape.n_ctx}")
        if self.shape.dtype == "int8":
            self.k[layer, start:start + n], self.k_scale[layer, start:start + n] = quantize_rows_int8(k)
            self.v[layer, start:start + n], self.v_scale[layer, start:start + n] = quantize_rows_int8(v)
        else:
            self.k[layer, start:start + n] = k
            self.v[layer, start:start + n] = v

    def read(self, layer: int, end: int, dtype=np.float32, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """K, V of positions start .. end-1 as float [end - start, n_kv_heads, head_dim]."""
        if self.shape.dtype == "int8":
            k = dequantize_rows_int8(self.k[layer, start:end], self.k_scale[layer, start:end])
            v = dequantize_rows_int8(self.v[layer, start:end], self.v_scale[layer, start:end])
            return k.astype(dtype, copy=False), v.astype(dtype, copy=False)
        return self.k[layer, start:end].astype(dtype), self.v[layer, start:end].astype(dtype)

    # -- persistence: the raw stored bytes of the first n positions ----------------
    def export_positions(self, n: int) -> dict[str, np.ndarray]:
        """Copies of the stored arrays for positions 0 .. n-1 (layer-major)."""
        out = {"k": self.k[:, :n].copy(), "v": self.v[:, :n].copy()}
        if self.shape.dtype == "int8":
            out["k_scale"] = self.k_scale[:, :n].copy()
            out["v_scale"] = self.v_scale[:, :n].copy()
        return out

    def import_positions(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """Load positions 0 .. n-1 from arrays shaped like export_positions(n)."""
        if n > self.shape.n_ctx:
            raise IndexError(f"cannot import {n} positions into a context of {self.shape.n_ctx}")
        for name in ("k", "v") + (("k_scale", "v_scale") if self.shape.dtype == "int8" else ()):
            getattr(self, name)[:, :n] = arrays[name][:, :n]
