"""GGUF float types and 32-weight block formats: layouts and numpy dequantizers.

What it does: turns raw F32 / F16 / BF16 values and Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
blocks (uint8[n_blocks, bytes_per_block]) into float32, bit-for-bit the values of
llama.cpp's `dequantize_row_*` (and of `gguf.quants.dequantize`). The layout tables
below are the reference the CUDA kernels are written against.

What it deliberately does not do: quantize (see `quantize.py`), parse GGUF files, or
handle whole tensors (shape checks, row chunking and dispatch live in `formats.py`).
Every function here takes a 2-D block array and trusts its width (it asserts it).

Multi-byte fields are little-endian; fp16 is IEEE binary16. For the float types a
"block" is one value.

F32: 4 bytes per weight, IEEE binary32.      w = value
F16: 2 bytes per weight, IEEE binary16.      w = float32(value)   (exact)
BF16: 2 bytes per weight, the top half of a binary32:
                                             w = bits << 16 reinterpreted as float32

Q4_0: 18 bytes per 32 weights = 4.5 bits per weight
    offset  bytes  field  meaning
    0       2      d      fp16 scale
    2       16     qs     4-bit quants: weight j (j < 16) is the low nibble of qs[j],
                          weight j + 16 is the high nibble of qs[j]
    w[j] = (q[j] - 8) * d                         q in 0..15, so q - 8 in -8..7

Q4_1: 20 bytes per 32 weights = 5 bits per weight
    0       2      d      fp16 scale
    2       2      m      fp16 offset (the block minimum)
    4       16     qs     4-bit quants, nibble order as Q4_0
    w[j] = q[j] * d + m                           q in 0..15

Q5_0: 22 bytes per 32 weights = 5.5 bits per weight
    0       2      d      fp16 scale
    2       4      qh     uint32: bit j is the 5th bit of weight j
    6       16     qs     low 4 bits, nibble order as Q4_0
    q[j] = low4[j] | ((qh >> j) & 1) << 4        in 0..31
    w[j] = (q[j] - 16) * d

Q5_1: 24 bytes per 32 weights = 6 bits per weight
    0       2      d      fp16 scale
    2       2      m      fp16 offset
    4       4      qh     uint32, as Q5_0
    8       16     qs     low 4 bits, as Q5_0
    w[j] = q[j] * d + m                           q in 0..31

Q8_0: 34 bytes per 32 weights = 8.5 bits per weight
    0       2      d      fp16 scale
    2       32     qs     int8 quants, weight order
    w[j] = qs[j] * d
"""
import numpy as np

QK = 32                        # weights per block of every legacy format

_F16 = np.dtype("<f2")
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
_BIT_SHIFTS = np.arange(32, dtype=np.uint32).reshape(1, 32)


def _check(blocks: np.ndarray, n_bytes: int, name: str) -> None:
    assert blocks.ndim == 2 and blocks.shape[1] == n_bytes, f"{name} blocks must be (n, {n_bytes}), got {blocks.shape}"


def _fp16(field: np.ndarray) -> np.ndarray:
    """uint8[n, 2] little-endian fp16 field -> float32[n, 1]."""
    return np.ascontiguousarray(field).view(_F16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8[n, 16] -> uint8[n, 32]: low nibbles are weights 0..15, high nibbles 16..31."""
    n = qs.shape[0]
    return ((qs.reshape(n, 1, 16) >> _NIBBLE_SHIFTS) & np.uint8(15)).reshape(n, QK)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """uint8[n, 4] little-endian uint32 -> uint8[n, 32]: bit j of it, shifted to 16."""
    bits = np.ascontiguousarray(qh).view("<u4")                   # (n, 1)
    return (((bits >> _BIT_SHIFTS) & np.uint32(1)) << np.uint32(4)).astype(np.uint8)


def dequantize_f32(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """F32 raw bytes uint8[n, 4] -> float32[n, 1]."""
    _check(blocks, 4, "F32")
    vals = np.ascontiguousarray(blocks).view("<f4")
    if out is None:
        return vals.astype(np.float32)
    out[...] = vals
    return out


def dequantize_f16(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """F16 raw bytes uint8[n, 2] -> float32[n, 1]."""
    _check(blocks, 2, "F16")
    vals = np.ascontiguousarray(blocks).view(_F16)
    if out is None:
        return vals.astype(np.float32)
    out[...] = vals
    return out


def dequantize_bf16(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 raw bytes uint8[n, 2] -> float32[n, 1]: the 16 bits become the top half of a binary32."""
    _check(blocks, 2, "BF16")
    bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << np.uint32(16)
    vals = bits.view(np.float32)
    if out is None:
        return vals
    out[...] = vals
    return out


def dequantize_q4_0(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_0 blocks uint8[n, 18] -> float32[n, 32]."""
    _check(blocks, 18, "Q4_0")
    d = _fp16(blocks[:, 0:2])                                      # (n, 1)
    q = _nibbles(blocks[:, 2:18]).view(np.int8) - np.int8(8)       # (n, 32) in -8..7
    return np.multiply(q, d, out=out, dtype=np.float32)


def dequantize_q4_1(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_1 blocks uint8[n, 20] -> float32[n, 32]."""
    _check(blocks, 20, "Q4_1")
    d = _fp16(blocks[:, 0:2])
    m = _fp16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:20])                                  # (n, 32) in 0..15
    res = np.multiply(q, d, out=out, dtype=np.float32)
    res += m
    return res


def dequantize_q5_0(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q5_0 blocks uint8[n, 22] -> float32[n, 32]."""
    _check(blocks, 22, "Q5_0")
    d = _fp16(blocks[:, 0:2])
    q = (_nibbles(blocks[:, 6:22]) | _high_bits(blocks[:, 2:6])).view(np.int8) - np.int8(16)  # -16..15
    return np.multiply(q, d, out=out, dtype=np.float32)


def dequantize_q5_1(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q5_1 blocks uint8[n, 24] -> float32[n, 32]."""
    _check(blocks, 24, "Q5_1")
    d = _fp16(blocks[:, 0:2])
    m = _fp16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:24]) | _high_bits(blocks[:, 4:8])     # (n, 32) in 0..31
    res = np.multiply(q, d, out=out, dtype=np.float32)
    res += m
    return res


def dequantize_q8_0(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q8_0 blocks uint8[n, 34] -> float32[n, 32]."""
    _check(blocks, 34, "Q8_0")
    d = _fp16(blocks[:, 0:2])
    q = blocks[:, 2:34].view(np.int8)                              # (n, 32) in -128..127
    return np.multiply(q, d, out=out, dtype=np.float32)
