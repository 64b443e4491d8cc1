"""A weight matrix as the CPU kernels read it: the GGUF tensor's own bytes, not a copy.

`CPUWeight` is a zero-copy, read-only view of a tensor's raw bytes (normally of the
memory-mapped file, so the weights live once, in the page cache) plus what the kernels
need to walk it: the GGML type and the numpy shape (rows, cols). Row r occupies bytes
[r * row_bytes, (r + 1) * row_bytes) and is cols / block_weights blocks of the type's
layout (quant/legacy.py, quant/kquants.py).

What it deliberately does not do: dequantize, repack or align anything (the kernels
read unaligned), or know what a tensor is for (the model files decide that).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genie_rt.quant.formats import BLOCK_SIZES, QType, UnsupportedQuantError

# qtype -> kernel family and the family's format code (the kernels switch on the code)
LEGACY = {QType.Q4_0: 0, QType.Q4_1: 1, QType.Q5_0: 2, QType.Q5_1: 3, QType.Q8_0: 4}
KQUANT = {QType.Q4_K: 0, QType.Q5_K: 1, QType.Q6_K: 2}
FLOAT = {QType.F32: 0, QType.F16: 1, QType.BF16: 2}
SUPPORTED = frozenset(LEGACY) | frozenset(KQUANT) | frozenset(FLOAT)


@dataclass(frozen=True, eq=False)
class CPUWeight:
    """data: uint8 [rows * row_bytes], read-only, C-contiguous; shape (rows, cols)."""

    data: np.ndarray
    qtype: QType
    shape: tuple[int, int]
    name: str = ""

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def row_bytes(self) -> int:
        block, n_bytes = BLOCK_SIZES[self.qtype]
        return self.cols // block * n_bytes

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @classmethod
    def from_bytes(cls, data: np.ndarray, qtype, shape, name: str = "") -> "CPUWeight":
        """Wrap raw tensor bytes (any contiguous array over them: uint8 (rows, row_bytes)
        as the GGUF reader hands them over, or float16/float32 for the float types)
        without copying. Raises ValueError/UnsupportedQuantError naming the tensor."""
        label = f"tensor '{name}'" if name else "weight"
        try:
            qtype = QType[qtype] if isinstance(qtype, str) else QType(qtype)
        except (KeyError, ValueError):
            raise UnsupportedQuantError(f"{label}: unknown GGML type {qtype!r}") from None
        if qtype not in SUPPORTED:
            raise UnsupportedQuantError(
                f"{label}: the CPU kernels do not support {qtype.name}; supported: "
                f"{', '.join(sorted(q.name for q in SUPPORTED))} (re-quantize the model, e.g. to Q4_K_M)")
        shape = tuple(int(s) for s in shape)
        if len(shape) == 1:
            shape = (1, shape[0])
        if len(shape) != 2 or min(shape) <= 0:
            raise ValueError(f"{label}: expected a matrix shape (rows, cols), got {shape}")
        block, n_bytes = BLOCK_SIZES[qtype]
        if shape[1] % block:
            raise ValueError(f"{label}: {qtype.name} rows are {block}-weight blocks but cols = {shape[1]}")
        data = np.asarray(data)
        if not data.flags.c_contiguous:
            raise ValueError(f"{label}: the bytes must be contiguous (a view of the file), got strides {data.strides}")
        flat = data.reshape(-1).view(np.uint8)          # a view: contiguous, so no copy
        expected = shape[0] * (shape[1] // block) * n_bytes
        if flat.size != expected:
            raise ValueError(f"{label}: a {qtype.name} matrix of shape {shape} has {expected} bytes, "
                             f"got {flat.size} (wrong type or shape?)")
        if flat.flags.writeable:                        # one numba specialisation: always read-only
            flat = flat.view()
            flat.flags.writeable = False
        return cls(flat, qtype, shape, name)

    @classmethod
    def from_tensor(cls, t) -> "CPUWeight":
        """From an engine.gguf_file.TensorInfo (its data is the memory-mapped bytes)."""
        return cls.from_bytes(t.data, t.qtype, t.shape, t.name)

    def __repr__(self) -> str:
        return f"CPUWeight({self.name or '?'}, {self.qtype.name}, {self.shape}, {self.nbytes} bytes)"
