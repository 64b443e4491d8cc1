"""GGUF tensor formats on the CPU: the public entry points for (de)quantizing whole tensors.

What it does: `dequantize(raw bytes, type, shape) -> float32` and
`quantize(float32, type) -> raw bytes` for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K, plus the block-size table and row-size arithmetic the loader and the
kernels share. Dequantization is bit-exact with llama.cpp's `dequantize_row_*` (and
`gguf.quants.dequantize`); tensors are processed in chunks of about 256 K weights,
so the temporaries stay small next to the output.

What it deliberately does not do: read GGUF files, run on the GPU, or support the IQ,
TQ, MXFP4, Q2_K and Q3_K formats (they raise `UnsupportedQuantError`). The per-format
block layouts and the per-type functions live in `legacy.py` (floats and 32-weight
blocks), `kquants.py` (256-weight super-blocks) and `quantize.py` (the quantizers);
they are re-exported here.

Shapes are numpy's: the last axis is the contiguous one (GGUF's ne[0]), and a row of a
quantized tensor is a whole number of blocks. A GGUF tensor with ne = [cols, rows] is
`dequantize(data, qtype, (rows, cols))`.
"""
from math import prod

import numpy as np
from gguf import GGMLQuantizationType

from .kquants import (dequantize_q4_k, dequantize_q5_k, dequantize_q6_k, q6_k_quants,  # noqa: F401
                      unpack_q4_k_scales, unpack_q5_k_scales, unpack_q6_k_scales)
from .legacy import (dequantize_bf16, dequantize_f16, dequantize_f32, dequantize_q4_0,  # noqa: F401
                     dequantize_q4_1, dequantize_q5_0, dequantize_q5_1, dequantize_q8_0)
from .quantize import (make_qkx2_quants, make_qx_quants, quantize_bf16, quantize_f16,  # noqa: F401
                       quantize_f32, quantize_q4_0, quantize_q4_1, quantize_q4_k, quantize_q5_0,
                       quantize_q5_1, quantize_q5_k, quantize_q6_k, quantize_q8_0)

__all__ = [
    "QType", "BLOCK_SIZES", "SUPPORTED", "QUANTIZABLE", "UnsupportedQuantError", "row_bytes", "dequantize", "quantize",
    "dequantize_f32", "dequantize_f16", "dequantize_bf16", "dequantize_q4_0", "dequantize_q4_1", "dequantize_q5_0",
    "dequantize_q5_1", "dequantize_q8_0", "dequantize_q4_k", "dequantize_q5_k", "dequantize_q6_k",
    "quantize_f32", "quantize_f16", "quantize_bf16", "quantize_q4_0", "quantize_q4_1", "quantize_q5_0",
    "quantize_q5_1", "quantize_q8_0", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k",
    "unpack_q4_k_scales", "unpack_q5_k_scales", "unpack_q6_k_scales", "q6_k_quants",
    "make_qkx2_quants", "make_qx_quants",
]

QType = GGMLQuantizationType

# qtype -> (weights per block, bytes per block); the float types have blocks of one value
BLOCK_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q5_0: (32, 22),
    QType.Q5_1: (32, 24),
    QType.Q8_0: (32, 34),
    QType.Q4_K: (256, 144),
    QType.Q5_K: (256, 176),
    QType.Q6_K: (256, 210),
}

_DEQUANTIZERS = {
    QType.F32: dequantize_f32, QType.F16: dequantize_f16, QType.BF16: dequantize_bf16,
    QType.Q4_0: dequantize_q4_0, QType.Q4_1: dequantize_q4_1, QType.Q5_0: dequantize_q5_0,
    QType.Q5_1: dequantize_q5_1, QType.Q8_0: dequantize_q8_0,
    QType.Q4_K: dequantize_q4_k, QType.Q5_K: dequantize_q5_k, QType.Q6_K: dequantize_q6_k,
}
_QUANTIZERS = {
    QType.F32: quantize_f32, QType.F16: quantize_f16, QType.BF16: quantize_bf16,
    QType.Q4_0: quantize_q4_0, QType.Q4_1: quantize_q4_1, QType.Q5_0: quantize_q5_0,
    QType.Q5_1: quantize_q5_1, QType.Q8_0: quantize_q8_0,
    QType.Q4_K: quantize_q4_k, QType.Q5_K: quantize_q5_k, QType.Q6_K: quantize_q6_k,
}

SUPPORTED: frozenset = frozenset(BLOCK_SIZES)
QUANTIZABLE: frozenset = frozenset(_QUANTIZERS)

_CHUNK_WEIGHTS = 1 << 18        # weights per chunk: 1 MB of float32 output, temporaries alike (cache-sized)


class UnsupportedQuantError(ValueError):
    """The tensor type is valid GGUF but this runtime has no (de)quantizer for it."""


def _names(types) -> str:
    return ", ".join(sorted(t.name for t in types))


def _qtype(qtype) -> GGMLQuantizationType:
    """Accept the enum, its integer value or its name ("Q4_K"); refuse anything else, listing the known names."""
    try:
        qtype = QType[qtype] if isinstance(qtype, str) else QType(qtype)
    except (KeyError, ValueError):
        raise UnsupportedQuantError(f"unknown GGML tensor type {qtype!r}; supported: {_names(SUPPORTED)}") from None
    if qtype not in SUPPORTED:
        raise UnsupportedQuantError(f"GGML tensor type {qtype.name} is not supported; supported: {_names(SUPPORTED)}")
    return qtype


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols weights of type qtype; n_cols must be a whole number of blocks."""
    qtype = _qtype(qtype)
    block, n_bytes = BLOCK_SIZES[qtype]
    if n_cols < 0 or n_cols % block:
        raise ValueError(f"{qtype.name} rows are made of {block}-weight blocks, but n_cols = {n_cols} "
                         f"is not a multiple of {block}")
    return n_cols // block * n_bytes


def _as_bytes(data) -> np.ndarray:
    """Any array whose buffer holds the tensor's raw bytes -> flat uint8 (a view where possible)."""
    data = np.asarray(data)
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8)
    return data.reshape(-1)


def dequantize(data: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF tensor bytes -> a new float32 array of `shape`.

    data: the tensor's raw bytes: uint8 of any shape (gguf's reader gives (rows, row_bytes)),
          or any array over those bytes (the reader hands F32/F16 tensors over as
          float32/float16 arrays; they are reinterpreted, not converted).
    qtype: a GGMLQuantizationType (or its int value) in SUPPORTED.
    shape: the logical numpy shape, e.g. (rows, cols), or (n,) for a 1-D tensor.
    Raises UnsupportedQuantError for an unsupported type, ValueError for a shape that
    is not whole blocks per row or a byte count that does not match the shape.
    """
    qtype = _qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape or min(shape) < 0:
        raise ValueError(f"dequantize: shape must be a non-empty tuple of sizes >= 0, got {shape}")
    n_row_bytes = row_bytes(qtype, shape[-1])
    raw = _as_bytes(data)
    expected = n_row_bytes * prod(shape[:-1])
    if raw.size != expected:
        raise ValueError(f"dequantize: a {qtype.name} tensor of shape {shape} has {expected} bytes, "
                         f"but data holds {raw.size} (wrong type or shape for this tensor?)")
    block, n_bytes = BLOCK_SIZES[qtype]
    blocks = raw.reshape(-1, n_bytes)                              # (n_blocks, bytes per block)
    out = np.empty((blocks.shape[0], block), dtype=np.float32)     # (n_blocks, weights per block)
    fn = _DEQUANTIZERS[qtype]
    step = max(1, _CHUNK_WEIGHTS // block)
    for start in range(0, blocks.shape[0], step):
        fn(blocks[start:start + step], out=out[start:start + step])
    return out.reshape(shape)


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    """float32 weights (rows, cols) -> raw GGUF bytes uint8 (rows, row_bytes(qtype, cols)).

    Any leading shape works: w of shape (..., cols) gives (..., row_bytes). Other float
    dtypes are converted to float32 first. Supported: QUANTIZABLE (every type in
    SUPPORTED). Block formats refuse NaN or infinite weights (they would poison the
    block's scale); every format refuses values whose fp16 scale would overflow.
    """
    qtype = _qtype(qtype)
    if qtype not in QUANTIZABLE:
        raise UnsupportedQuantError(f"no quantizer for {qtype.name}; quantize supports {_names(QUANTIZABLE)}")
    w = np.asarray(w)
    if w.ndim == 0 or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"quantize: expected a float array of shape (rows, cols), got {w.dtype} {w.shape}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    n_row_bytes = row_bytes(qtype, w.shape[-1])
    block, n_bytes = BLOCK_SIZES[qtype]
    if block > 1 and not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"quantize: weight {tuple(int(i) for i in bad)} is {w[tuple(bad)]}; "
                         f"{qtype.name} needs finite weights")
    blocks = w.reshape(-1, block)                                  # (n_blocks, weights per block)
    out = np.empty((blocks.shape[0], n_bytes), dtype=np.uint8)     # (n_blocks, bytes per block)
    fn = _QUANTIZERS[qtype]
    step = max(1, _CHUNK_WEIGHTS // block)
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = fn(blocks[start:start + step])
    return out.reshape(*w.shape[:-1], n_row_bytes)
