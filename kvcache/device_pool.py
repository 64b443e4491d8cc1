"""The KV pool on the GPU: the same layout and INT8 row format as the host pool.

Per layer `[slot][kv_head][head_dim]`, stored as one device region per quantity:

    k, v              int8 | float16 | float32   layer i: [R_i, n_kv_heads, head_dim]
    k_scale, v_scale  float32                    layer i: [R_i, n_kv_heads]   (int8 only)

R_i = shape.layer_slots(i): n_ctx for an ordinary layer (slot = position), fewer for a
ring layer (a sliding-window layer: position p in slot p % R_i; kvcache/pool.py's
KVShape). The layers lie back to back in each region, so without rings the regions are
the [n_layers, n_ctx, ...] arrays `k`, `v`, `k_scale`, `v_scale` (also attributes here).

INT8 rows follow kvcache/pool.py exactly (scale = max|x| / 127, q = rint(x / scale)
clipped to [-127, 127], one scale per (layer, position, kv_head)), so
`export_positions` / `import_positions` here and on `HostKVPool` produce and accept the
same names, shapes and dtypes: a conversation saved by one back-end loads in the other.
Ring layers hold only their last R positions: `export_window` / `import_window` move
positions first .. end-1 in position order, through the ring's slots.

The arrays are zero-copy views of one uint8 buffer: the caller's arena slice
(`arena_view`, at least `DeviceKVPool.nbytes(shape)` bytes, 256-byte aligned) or a
buffer allocated here. Each region starts at a multiple of 256 bytes and every row is a
multiple of 16 bytes, so every row is 16-byte aligned for 128-bit loads. Kernels get a
layer's arrays from `layer(i)` (precomputed views; creating views on the hot path costs
host time).

Deliberately not here: which tokens the positions hold (the engine's prefix tracking),
the kernels that write and read it (kvcache/rope_write.py - its row code also runs inside the
decode attention, attention_decode_rope.py - and kvcache/attention.py).
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

    k, v:             storage dtype [R, n_kv_heads, head_dim]   (R slots)
    k_scale, v_scale: float32 [R, n_kv_heads] for int8; a [1, 1] placeholder otherwise
    k_words, v_words: uint32 [R * n_kv_heads * head_dim * itemsize / 4], the same bytes
                      as k, v (what 128-bit loads index)
    ring:             True when R < n_ctx: position p is in slot p % R (rope_write writes
                      there; attention needs a window <= R to read through it)
    """
    k: object
    v: object
    k_scale: object
    v_scale: object
    k_words: object
    v_words: object
    ring: bool = False

    @property
    def slots(self) -> int:
        return self.k.shape[0]


def _slot_runs(first: int, end: int, slots: int):
    """Positions first .. end-1 (end - first <= slots) as contiguous slot runs:
    [(offset into the positions, first slot, count)], one run or two (the ring wraps)."""
    runs, p = [], first
    while p < end:
        s = p % slots
        m = min(end - p, slots - s)
        runs.append((p - first, s, m))
        p += m
    return runs


class DeviceKVPool:
    """KV storage in device memory for the CUDA back-end.

    Contents are zero after construction; a slot holds what rope_write's row code (the
    rope_write kernel, or the decode attention that ropes its own token), or an import, last
    wrote there.
    """

    def __init__(self, shape: KVShape, arena_view=None, stream=0):
        self.shape = shape
        L, n_kv, hd = shape.n_layers, shape.n_kv_heads, shape.head_dim
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
        slots = [shape.layer_slots(i) for i in range(L)]
        total = sum(slots)                          # slots of every layer together
        row = n_kv * hd * dt.itemsize               # bytes of one slot, K (or V)
        off = 0

        def carve(nbytes):
            nonlocal off
            region = buf[off:off + nbytes]
            off += _aligned(nbytes)
            return region

        k_reg, v_reg = carve(total * row), carve(total * row)
        int8 = shape.dtype == "int8"
        if int8:
            ks_reg, vs_reg = carve(total * n_kv * 4), carve(total * n_kv * 4)
        else:
            placeholder = carve(4).view(np.float32).reshape(1, 1)
        self.zero(stream)
        self._layers = []
        first = 0                                   # first slot of layer i in the regions
        for i, r in enumerate(slots):
            kl = k_reg[first * row:(first + r) * row].view(dt).reshape(r, n_kv, hd)
            vl = v_reg[first * row:(first + r) * row].view(dt).reshape(r, n_kv, hd)
            if int8:
                sb = n_kv * 4
                ks = ks_reg[first * sb:(first + r) * sb].view(np.float32).reshape(r, n_kv)
                vs = vs_reg[first * sb:(first + r) * sb].view(np.float32).reshape(r, n_kv)
            else:
                ks = vs = placeholder
            self._layers.append(KVLayer(kl, vl, ks, vs, kl.reshape(-1).view(np.uint32),
                                        vl.reshape(-1).view(np.uint32), r < shape.n_ctx))
            first += r
        # without rings the regions are the stacked [n_layers, n_ctx, ...] arrays
        self.k = self.v = self.k_scale = self.v_scale = None
        if shape.slots is None:
            dims = (L, shape.n_ctx, n_kv, hd)
            self.k = k_reg.view(dt).reshape(dims)
            self.v = v_reg.view(dt).reshape(dims)
            if int8:
                self.k_scale = ks_reg.view(np.float32).reshape(dims[:3])
                self.v_scale = vs_reg.view(np.float32).reshape(dims[:3])

    @staticmethod
    def nbytes(shape: KVShape) -> int:
        """Device bytes the pool needs (KVShape.nbytes() plus alignment padding)."""
        itemsize = np.dtype(_STORAGE[shape.dtype]).itemsize
        total = sum(shape.layer_slots(i) for i in range(shape.n_layers))
        body = total * shape.n_kv_heads * shape.head_dim * itemsize
        if shape.dtype == "int8":
            scales = _aligned(total * shape.n_kv_heads * 4)
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

    # -- persistence: the raw stored bytes of positions, in position order -------------
    def _names(self):
        return ("k", "v") + (("k_scale", "v_scale") if self.shape.dtype == "int8" else ())

    def _select(self, layers, what):
        layers = tuple(range(self.shape.n_layers)) if layers is None else tuple(layers)
        bad = [i for i in layers if not 0 <= i < self.shape.n_layers]
        if bad:
            raise IndexError(f"{what}: layer {bad[0]} outside 0 .. {self.shape.n_layers - 1}")
        return layers

    def _check_span(self, layers, first, end, what):
        if not 0 <= first <= end <= self.shape.n_ctx:
            raise IndexError(f"{what}: positions {first} .. {end - 1} outside a context of "
                             f"{self.shape.n_ctx}")
        for i in layers:
            r = self.shape.layer_slots(i)
            if end - first > r:
                raise IndexError(f"{what}: layer {i} is a ring of {r} slots; it cannot hold the "
                                 f"{end - first} positions {first} .. {end - 1}")

    def _host_dims(self, name, m):
        dev = getattr(self._layers[0], name)
        return (m,) + tuple(dev.shape[1:]), dev.dtype

    def export_window(self, end: int, layers=None, first: int | None = None,
                      stream=0) -> tuple[int, dict[str, np.ndarray]]:
        """Host copies of positions first .. end-1 of `layers` (default: all), in position
        order: (first, {k, v [len(layers), end - first, n_kv, hd] storage dtype; k_scale,
        v_scale [len(layers), end - first, n_kv] float32 for int8}). first defaults to the
        oldest position every selected layer still holds after positions 0 .. end-1 were
        written (max over layers of KVShape.oldest_held): 0 without rings. The pool does
        not know what was written: the caller says end (the positions it holds).
        Synchronizes `stream`."""
        layers = self._select(layers, "export_window")
        if first is None:
            first = max([self.shape.oldest_held(i, end) for i in layers] + [0])
        self._check_span(layers, first, end, "export_window")
        m = end - first
        out = {}
        for name in self._names():
            dims, dtype = self._host_dims(name, m)
            host = np.empty((len(layers),) + dims, dtype)
            for j, i in enumerate(layers):
                dev = getattr(self._layers[i], name)
                for o, s, c in _slot_runs(first, end, dev.shape[0]):
                    dev[s:s + c].copy_to_host(host[j, o:o + c], stream=stream)
            out[name] = host
        if stream:
            stream.synchronize()
        return first, out

    def import_window(self, arrays: dict[str, np.ndarray], first: int, end: int, layers=None,
                      stream=0) -> None:
        """Write positions first .. end-1 of `layers` (default: all) into their slots, from
        arrays shaped like export_window's ([len(layers), >= end - first, ...]; when they
        hold more positions, the *last* end - first are used: arrays[:, -m:] are positions
        first .. end-1). Nothing is cast. Synchronizes `stream`."""
        layers = self._select(layers, "import_window")
        self._check_span(layers, first, end, "import_window")
        m = end - first
        staged = {}
        for name in self._names():
            if name not in arrays:
                raise ValueError(f"import_window: '{name}' is missing (got {sorted(arrays)})")
            a = np.asarray(arrays[name])
            dims, dtype = self._host_dims(name, m)
            want = (len(layers),) + dims
            if a.dtype != dtype or a.ndim != len(want) or a.shape[0] != want[0] \
                    or a.shape[1] < m or a.shape[2:] != want[2:]:
                raise ValueError(f"import_window: '{name}' is {a.dtype}{list(a.shape)}; "
                                 f"this pool needs {np.dtype(dtype)}{list(want)} (or more positions)")
            staged[name] = np.ascontiguousarray(a[:, a.shape[1] - m:])
        for name, a in staged.items():
            for j, i in enumerate(layers):
                dev = getattr(self._layers[i], name)
                for o, s, c in _slot_runs(first, end, dev.shape[0]):
                    dev[s:s + c].copy_to_device(a[j, o:o + c], stream=stream)
        if stream:
            stream.synchronize()

    def export_positions(self, n: int, stream=0) -> dict[str, np.ndarray]:
        """Host copies of positions 0 .. n-1, layer-major, exactly like HostKVPool's:
        k, v [n_layers, n, n_kv_heads, head_dim] storage dtype; k_scale, v_scale
        [n_layers, n, n_kv_heads] float32 (int8 only). Synchronizes `stream`.
        A ring layer holds positions 0 .. n-1 only while nothing past them was written,
        so with ring layers use export_window (global layers: layers=shape.global_layers)."""
        if not 0 <= n <= self.shape.n_ctx:
            raise IndexError(f"cannot export {n} positions from a context of {self.shape.n_ctx}")
        self._refuse_rings("export_positions", "export_window(end, layers)")
        return self.export_window(n, first=0, stream=stream)[1]

    def import_positions(self, arrays: dict[str, np.ndarray], n: int, stream=0) -> None:
        """Load positions 0 .. n-1 from arrays shaped like export_positions(n) (extra
        positions beyond n are ignored, as in HostKVPool). Synchronizes `stream`."""
        if not 0 <= n <= self.shape.n_ctx:
            raise IndexError(f"cannot import {n} positions into a context of {self.shape.n_ctx}")
        self._refuse_rings("import_positions", "import_window(arrays, first, end, layers)")
        first_n = {}                        # the first n positions (import_window takes the last)
        for name, a in arrays.items():
            a = np.asarray(a)
            first_n[name] = a[:, :n] if a.ndim >= 2 else a
        self.import_window(first_n, 0, n, stream=stream)

    def _refuse_rings(self, what, instead):
        if self.shape.slots is not None:
            raise ValueError(f"{what}: layers {self.shape.ring_layers} are rings of "
                             f"{self.shape.layer_slots(self.shape.ring_layers[0])} slots; use "
                             f"{instead} (the global layers are shape.global_layers)")

    def read(self, layer: int, end: int, dtype=np.float32, first: int = 0):
        """K, V of positions first .. end-1 as host float [end - first, n_kv_heads,
        head_dim] (tests and debugging; HostKVPool.read's twin). A ring layer must hold
        them: end - first <= its slots, and nothing past end-1 written."""
        self._check_span((layer,), first, end, "read")
        arrays = self.export_window(end, layers=(layer,), first=first)[1]
        arrays = {name: a[0] for name, a in arrays.items()}
        if self.shape.dtype == "int8":
            k = arrays["k"].astype(np.float32) * arrays["k_scale"][..., None]
            v = arrays["v"].astype(np.float32) * arrays["v_scale"][..., None]
            return k.astype(dtype, copy=False), v.astype(dtype, copy=False)
        return arrays["k"].astype(dtype), arrays["v"].astype(dtype)
