"""One device allocation for everything: weights, KV pool, scratch.

Two phases, so the memory budget is computed from the very layout that is allocated:

    layout = ArenaLayout()
    layout.add("blk.0.attn_q.qs", (4096, 1280), np.uint8)     # -> byte offset
    ...                                                        # budget checks layout.nbytes
    arena = Arena(layout)                                      # one cuda.device_array
    arena = Arena(layout, mapped=True)                         # or one mapped host allocation
    arena["blk.0.attn_q.qs"]                                   # zero-copy typed view

Every entry is aligned to 256 bytes (128-bit loads and cp.async need 16; 256 keeps
each buffer on its own cache lines). Views never move, which is what lets one CUDA
graph serve every decode step.

`mapped=True` places the whole arena in page-locked host memory mapped into the device's
address space (cuMemHostAlloc DEVICEMAP), what an integrated GPU's memory is: kernels read
and write it through the same device pointers, so every kernel, graph and copy is the one
the device-memory arena uses (--mapped-memory: the Jetson placement, exercised on a
discrete GPU). Under the CUDA simulator both are host memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALIGN = 256


@dataclass(frozen=True)
class Entry:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class ArenaLayout:
    def __init__(self):
        self.entries: dict[str, Entry] = {}
        self.nbytes = 0

    def add(self, name: str, shape, dtype) -> int:
        if name in self.entries:
            raise KeyError(f"arena entry '{name}' added twice")
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        entry = Entry(-(-self.nbytes // ALIGN) * ALIGN, shape, np.dtype(dtype))
        self.entries[name] = entry
        self.nbytes = entry.offset + entry.nbytes
        return entry.offset

    def bytes_with_prefix(self, prefix: str) -> int:
        return sum(e.nbytes for n, e in self.entries.items() if n.startswith(prefix))


class Arena:
    """The allocation and its named views (numba DeviceNDArrays)."""

    def __init__(self, layout: ArenaLayout, mapped: bool = False):
        from numba import cuda
        self.layout = layout
        self.mapped = mapped
        n = max(layout.nbytes, ALIGN)
        if not mapped:
            self.buffer = cuda.device_array(n, np.uint8)
        else:
            from genie_rt.quant.ptx import SIMULATOR
            host = cuda.mapped_array(n, np.uint8)
            if SIMULATOR:
                self.buffer = host
            else:                      # a device array over the mapped pages (it keeps them alive)
                from numba.cuda.cudadrv.devicearray import DeviceNDArray
                self.buffer = DeviceNDArray((n,), (1,), np.uint8, gpu_data=host.gpu_data)
            self._host = host
        self._views = {}

    def __getitem__(self, name: str):
        view = self._views.get(name)
        if view is None:
            e = self.layout.entries[name]
            raw = self.buffer[e.offset:e.offset + e.nbytes]
            view = raw.view(e.dtype).reshape(e.shape) if e.nbytes else raw
            self._views[name] = view
        return view

    def __contains__(self, name: str) -> bool:
        return name in self.layout.entries
