"""The KV pool on the GPU: the same layout and INT8 row format as the host pool.

Per layer `[position][kv_head][head_dim]`, stored as one device array per quantity:

    k, v              int8 | float16 | float32   [n_layers, n_ctx, n_kv_heads, head_dim]
    k_scale, v_scale  float32                    [n_layers, n_ctx, n_kv_heads]   (int8 only)

INT8 rows follow kvcache/pool.py exactly (scale = max|x| / 127, q = rint(x / scale)
clipped to [-127, 127], one scale per (layer, position, kv_head)), so
`export_positions` / `import_positions` here and on `HostKVPool` produce and accept the
same names, shapes and dtypes: a conversation saved by one back-end loads in the other.

The arrays are zero-copy views of one uint8 buffer: the caller's arena slice
(`arena_view`, at least `DeviceKVPool.nbytes(shape)` bytes, 256-byte aligned) or a
buffer allocated here. Each region starts at a multiple of 256 bytes, so every row is
16-byte aligned for 128-bit loads. Kernels get a layer's arrays from `layer(i)`
(precomputed views; creating views on the hot path costs host time).

Deliberately not here: which tokens the positions hold (the engine's prefix tracking),
the kernels that write and read it (kvcache/rope_write.py, kvcache/attention.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from genie_rt.quant.ptx import SIMULATOR

from .pool import KVShape

_STORAGE = {"int8": np.int8, "f16": np.float16, "f32": np.float32}
_ALIGN = 256


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class KVLayer(NamedTuple):
    """One layer's views, what the rope_write and attention launchers take.

    k, v:             storage dtype [n_ctx, n_kv_heads, head_dim]
    k_scale, v_scale: float32 [n_ctx, n_kv_heads] for int8; a [1, 1] placeholder otherwise
    k_words, v_words: uint32 [n_ctx * n_kv_heads * head_dim * itemsize / 4], the same bytes
                      as k, v (what 128-bit loads index)
    """
    k: object
    v: object
    k_scale: object
    v_scale: object
    k_words: object
    v_words: object


class DeviceKVPool:
    """KV storage in device memory for the CUDA back-end.

    Contents are zero after construction; a position holds what rope_write (or
    import_positions) last wrote there.
    """

    def __init__(self, shape: KVShape, arena_view=None, stream=0):
        self.shape = shape
        L, n_ctx, n_kv, hd = shape.n_layers, shape.n_ctx, shape.n_kv_heads, shape.head_dim
        dt = np.dtype(_STORAGE[shape.dtype])
        if (hd * dt.itemsize) % 16:
            raise ValueError(f"head_dim {hd} x {dt.itemsize} bytes is not a multiple of 16 bytes: "
                             "rows could not be read with 128-bit loads")
        need = self.nbytes(shape)
        if arena_view is None:
            buf = cuda.device_array(need, np.uint8)
        else:
            if arena_view.dtype != np.uint8 or arena_view.ndim != 1:
                raise ValueError(f"arena_view must be a 1-d uint8 device array, got "
                                 f"{arena_view.dtype} with {arena_view.ndim} dims")
            if arena_view.size < need:
                raise ValueError(f"arena_view holds {arena_view.size} bytes; the KV pool {shape} "
                                 f"needs DeviceKVPool.nbytes(shape) = {need}")
            buf = arena_view[:need]
        self._buf = buf
        dims = (L, n_ctx, n_kv, hd)
        body = L * n_ctx * n_kv * hd * dt.itemsize
        off = 0

        def carve(nbytes, dtype, shp):
            nonlocal off
            view = buf[off:off + nbytes].view(dtype).reshape(shp)
            off += _aligned(nbytes)
            return view

        self.k = carve(body, dt, dims)
        self.v = carve(body, dt, dims)
        if shape.dtype == "int8":
            sbytes = L * n_ctx * n_kv * 4
            self.k_scale = carve(sbytes, np.float32, dims[:3])
            self.v_scale = carve(sbytes, np.float32, dims[:3])
            scales = lambda i: (self.k_scale[i], self.v_scale[i])  # noqa: E731
        else:
            placeholder = carve(4, np.float32, (1, 1))
            scales = lambda i: (placeholder, placeholder)  # noqa: E731
        self.zero(stream)
        self._layers = []
        for i in range(L):
            ks, vs = scales(i)
            kl, vl = self.k[i], self.v[i]
            self._layers.append(KVLayer(kl, vl, ks, vs,
                                        kl.reshape(-1).view(np.uint32),
                                        vl.reshape(-1).view(np.uint32)))

    @staticmethod
    def nbytes(shape: KVShape) -> int:
        """Device bytes the pool needs (KVShape.nbytes() plus alignment padding)."""
        itemsize = np.dtype(_STORAGE[shape.dtype]).itemsize
        body = shape.n_layers * shape.n_ctx * shape.n_kv_heads * shape.head_dim * itemsize
        if shape.dtype == "int8":
            scales = _aligned(shape.n_layers * shape.n_ctx * shape.n_kv_heads * 4)
        else:
            scales = _ALIGN // 2          # the [1, 1] placeholder
        return 2 * _aligned(body) + 2 * scales

    @property
    def n_ctx(self) -> int:
        return self.shape.n_ctx

    def layer(self, i: int) -> KVLayer:
        return self._layers[i]

    def zero(self, stream=0) -> None:
        """Zero every byte of the pool (setup time; not for the hot path)."""
        if SIMULATOR:
            self._buf.copy_to_device(np.zeros(self._buf.size, np.uint8), stream=stream)
            return
        from numba.cuda.cudadrv import driver
        driver.device_memset(self._buf, 0, self._buf.size, stream=stream)

    # -- persistence: the raw stored bytes of the first n positions ----------------
    def _names(self):
        return ("k", "v") + (("k_scale", "v_scale") if self.shape.dtype == "int8" else ())

    def export_positions(self, n: int, stream=0) -> dict[str, np.ndarray]:
        """Host copies of positions 0 .. n-1, layer-major, exactly like HostKVPool's:
        k, v [n_layers, n, n_kv_heads, head_dim] storage dtype; k_scale, v_scale
        [n_layers, n, n_kv_heads] float32 (int8 only). Synchronizes `stream`."""
        if not 0 <= n <= self.shape.n_ctx:
            raise IndexError(f"cannot export {n} positions from a context of {self.shape.n_ctx}")
        out = {}
        for name in self._names():
            dev = getattr(self, name)
            host = np.empty((dev.shape[0], n) + tuple(dev.shape[2:]), dev.dtype)
            if n:
                for i in range(dev.shape[0]):          # per layer: contiguous slices
                    dev[i, :n].copy_to_host(host[i], stream=stream)
            out[name] = host
        if stream:
            stream.synchronize()
        return out

    def import_positions(self, arrays: dict[str, np.ndarray], n: int, stream=0) -> None:
        """Load positions 0 .. n-1 from arrays shaped like export_positions(n) (extra
        positions beyond n are ignored, as in HostKVPool). Synchronizes `stream`."""
        if not 0 <= n <= self.shape.n_ctx:
            raise IndexError(f"cannot import {n} positions into a context of {self.shape.n_ctx}")
        staged = {}
        for name in self._names():
            dev = getattr(self, name)
            if name not in arrays:
                raise ValueError(f"import_positions: '{name}' is missing (got {sorted(arrays)})")
            a = np.asarray(arrays[name])
            want = (dev.shape[0], n) + tuple(dev.shape[2:])
            if a.dtype != dev.dtype or a.ndim != dev.ndim or a.shape[0] != want[0] \
                    or a.shape[1] < n or a.shape[2:] != want[2:]:
                raise ValueError(f"import_positions: '{name}' is {a.dtype}{list(a.shape)}; "
                                 f"this pool needs {dev.dtype}{list(want)} (or more positions)")
            staged[name] = np.ascontiguousarray(a[:, :n])
        if n:
            for name, a in staged.items():
                dev = getattr(self, name)
                for i in range(dev.shape[0]):
                    dev[i, :n].copy_to_device(a[i], stream=stream)
        if stream:
            stream.synchronize()

    def read(self, layer: int, end: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """K, V of positions 0 .. end-1 as host float [end, n_kv_heads, head_dim]
        (tests and debugging; HostKVPool.read's twin)."""
        arrays = {name: getattr(self, name)[layer, :end].copy_to_host() for name in self._names()}
        if self.shape.dtype == "int8":
            k = arrays["k"].astype(np.float32) * arrays["k_scale"][..., None]
            v = arrays["v"].astype(np.float32) * arrays["v_scale"][..., None]
            return k.astype(dtype, copy=False), v.astype(dtype, copy=False)
        return arrays["k"].astype(dtype), arrays["v"].astype(dtype)
