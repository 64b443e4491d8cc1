"""The KV pool on the host: per layer `[position][kv_head][head_dim]`, INT8 or FP16/FP32.

INT8 stores one absmax scale per (layer, position, kv_head), for K and for V:

    scale = max(|x[0:head_dim]|) / 127          float32
    q     = round(x / scale)                    int8 in [-127, 127]
    x'    = q * scale                           (scale 0 when the row is all zeros)

Half the bytes of FP16 (plus 4 bytes per 128 values for the scale), and the same
per-row format as the CUDA pool, so files saved by one back-end load in the other.

`KVShape` is the layout both pools share. A layer normally holds every position
0 .. n_ctx-1 (slot = position). A sliding-window layer (Gemma 3's local layers) may
instead hold a *ring* of R < n_ctx slots (`KVShape.slots`): position p lives in slot
p % R, so after positions 0 .. T-1 were written in order the ring holds the last
min(T, R) of them (`oldest_held`). Only the device pool implements rings
(kvcache/device_pool.py); docs/kv-pool.md explains why R >= window + chunk - 1.

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
    """n_layers layers of n_ctx positions x n_kv_heads x head_dim, dtype int8 | f16 | f32.

    slots: per-layer slot counts (a tuple of n_layers ints in 1 .. n_ctx), or None when
    every layer holds n_ctx slots. A layer with fewer slots than n_ctx is a ring
    (position p in slot p % R); equal to n_ctx it is an ordinary layer. A tuple whose
    entries all equal n_ctx is normalised to None, so equal layouts compare equal."""
    n_layers: int
    n_ctx: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # "int8" | "f16" | "f32"
    slots: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype '{self.dtype}' is not one of {', '.join(KV_DTYPES)}")
        if self.slots is None:
            return
        slots = tuple(int(r) for r in self.slots)
        if len(slots) != self.n_layers:
            raise ValueError(f"KVShape.slots has {len(slots)} entries for {self.n_layers} layers")
        bad = [(i, r) for i, r in enumerate(slots) if not 1 <= r <= self.n_ctx]
        if bad:
            raise ValueError(f"KVShape.slots: layer {bad[0][0]} has {bad[0][1]} slots; each layer "
                             f"needs 1 .. n_ctx = {self.n_ctx}")
        object.__setattr__(self, "slots", None if all(r == self.n_ctx for r in slots) else slots)

    def layer_slots(self, layer: int) -> int:
        """Slots of one layer: n_ctx, or R for a ring layer."""
        return self.n_ctx if self.slots is None else self.slots[layer]

    def is_ring(self, layer: int) -> bool:
        return self.layer_slots(layer) < self.n_ctx

    @property
    def ring_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_ring(i))

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if not self.is_ring(i))

    def oldest_held(self, layer: int, end: int) -> int:
        """The oldest position the layer still holds after positions 0 .. end-1 were
        written in order: 0 for an ordinary layer, max(0, end - R) for a ring."""
        return max(0, end - self.layer_slots(layer))

    @property
    def layer_bytes_per_position(self) -> int:
        """K and V bytes of one position in one layer (scales included)."""
        per_head = self.head_dim * np.dtype(_STORAGE[self.dtype]).itemsize
        if self.dtype == "int8":
            per_head += 4  # float32 scale
        return 2 * self.n_kv_heads * per_head

    @property
    def bytes_per_position(self) -> int:
        """K and V bytes for one position across all layers (scales included): what a
        position costs in a layout without rings (rings: see nbytes)."""
        return self.n_layers * self.layer_bytes_per_position

    def nbytes(self, n_positions: int | None = None) -> int:
        """Bytes of the whole pool (None), or of n positions as an export holds them:
        min(n, slots) positions per layer. Without rings: bytes_per_position * n."""
        n = self.n_ctx if n_positions is None else n_positions
        if self.slots is None:
            return self.bytes_per_position * n
        return self.layer_bytes_per_position * sum(min(n, r) for r in self.slots)


def ring_slots(window: int, chunk: int, n_ctx: int) -> int:
    """Slots of a sliding-window layer's ring: window + chunk - 1 (the keys a prefill
    chunk of `chunk` tokens reads, its own included, all present at once), at most n_ctx."""
    if window < 1 or chunk < 1:
        raise ValueError(f"ring_slots: window {window} and chunk {chunk} must be >= 1")
    return min(n_ctx, window + chunk - 1)


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
        if shape.slots is not None:
            raise ValueError(f"HostKVPool holds every layer at n_ctx positions; ring layers "
                             f"{shape.ring_layers} (KVShape.slots) need the device pool")
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

    def _names(self) -> tuple[str, ...]:
        return ("k", "v") + (("k_scale", "v_scale") if self.shape.dtype == "int8" else ())

    def export_window(self, end: int, layers=None, first: int = 0) -> tuple[int, dict[str, np.ndarray]]:
        """Copies of positions first .. end-1 of `layers` (default all): the device pool's
        signature, so persistence treats both pools alike."""
        layers = list(range(self.shape.n_layers)) if layers is None else list(layers)
        return first, {name: getattr(self, name)[layers, first:end].copy() for name in self._names()}

    def import_window(self, arrays: dict[str, np.ndarray], first: int, end: int, layers=None) -> None:
        """Write positions first .. end-1 of `layers` from arrays [len(layers), >= end - first,
        ...] (their last end - first positions)."""
        if not 0 <= first <= end <= self.shape.n_ctx:
            raise IndexError(f"import_window: positions {first} .. {end - 1} outside a context of "
                             f"{self.shape.n_ctx}")
        layers = list(range(self.shape.n_layers)) if layers is None else list(layers)
        m = end - first
        for name in self._names():
            a = np.asarray(arrays[name])
            getattr(self, name)[layers, first:end] = a[:, a.shape[1] - m:]

    def import_positions(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """Load positions 0 .. n-1 from arrays shaped like export_positions(n)."""
        if n > self.shape.n_ctx:
            raise IndexError(f"cannot import {n} positions into a context of {self.shape.n_ctx}")
        for name in ("k", "v") + (("k_scale", "v_scale") if self.shape.dtype == "int8" else ()):
            getattr(self, name)[:, :n] = arrays[name][:, :n]
