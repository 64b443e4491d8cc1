"""GGUF k-quant super-block formats (Q4_K, Q5_K, Q6_K): layouts and numpy dequantizers.

What it does: turns raw k-quant blocks (uint8[n_blocks, bytes_per_block]) into float32
weights, bit-for-bit the values of llama.cpp's `dequantize_row_q*_K` (and of
`gguf.quants.dequantize`), and unpacks the packed sub-block scales for the GPU kernels.
The layout tables below are the reference the CUDA kernels are written against.

What it deliberately does not do: quantize (see `quantize.py`), parse GGUF files, or
handle whole tensors (shape checks, row chunking and dispatch live in `formats.py`).
Every function here takes a 2-D block array and trusts its width (it asserts it).

All three formats use a super-block of QK_K = 256 weights. Multi-byte fields are
little-endian; fp16 is IEEE binary16.

Q4_K: 144 bytes per 256 weights = 4.5 bits per weight
------------------------------------------------------
    offset  bytes  field    meaning
    0       2      d        fp16 super-block scale of the 6-bit sub-block scales
    2       2      dmin     fp16 super-block scale of the 6-bit sub-block mins
    4       12     scales   8 sub-blocks x (6-bit scale sc[j], 6-bit min m[j]), packed:
                              byte 0..3 : bits 0-5 sc[0..3], bits 6-7 = sc[4..7] >> 4
                              byte 4..7 : bits 0-5  m[0..3], bits 6-7 =  m[4..7] >> 4
                              byte 8..11: bits 0-3 sc[4..7] & 15, bits 4-7 = m[4..7] & 15
    16      128    qs       256 x 4-bit quants q in 0..15, as 4 chunks of 32 bytes;
                            chunk c holds sub-block 2c in the low nibbles and
                            sub-block 2c+1 in the high nibbles
    Weight i (sub-block j = i // 32, lane l = i % 32, chunk c = j // 2):
        q    = (qs[32c + l] >> (4 * (j % 2))) & 15
        w[i] = (d * sc[j]) * q - (dmin * m[j])         (float32, in this order)
    Sub-blocks are 32 weights with their own scale and (subtracted) min.

Q5_K: 176 bytes per 256 weights = 5.5 bits per weight
------------------------------------------------------
    offset  bytes  field    meaning
    0       2      d        fp16, as Q4_K
    2       2      dmin     fp16, as Q4_K
    4       12     scales   packed 6-bit sc[8], m[8], exactly as Q4_K
    16      32     qh       5th bit of every quant: bit j of qh[l] belongs to
                            sub-block j, lane l
    48      128    qs       low 4 bits, laid out exactly as Q4_K's qs
    Weight i (j = i // 32, l = i % 32, c = j // 2):
        q    = ((qs[32c + l] >> (4 * (j % 2))) & 15) | (((qh[l] >> j) & 1) << 4)  in 0..31
        w[i] = (d * sc[j]) * q - (dmin * m[j])

Q6_K: 210 bytes per 256 weights = 6.5625 bits per weight
---------------------------------------------------------
    offset  bytes  field    meaning
    0       128    ql       low 4 bits of the quants
    128     64     qh       high 2 bits of the quants
    192     16     scales   int8 scale per 16-weight sub-block
    208     2      d        fp16 super-block scale
    The block is two halves of 128 weights; half h uses ql[64h : 64h+64] and
    qh[32h : 32h+32]. Inside a half, quarter k (0..3) of 32 weights, lane l (0..31):
        low  = (ql[64h + 32 * (k % 2) + l] >> (4 * (k // 2))) & 15
        high = (qh[32h + l] >> (2 * k)) & 3
        q    = (low | high << 4) - 32                     in -32..31
    Weight i = 128h + 32k + l:
        w[i] = (d * scales[i // 16]) * q
    Sub-blocks are 16 weights; no min (the grid is symmetric around zero).
"""
import numpy as np

QK_K = 256                     # weights per super-block
Q4_K_BYTES = 144               # 2 + 2 + 12 + 128
Q5_K_BYTES = 176               # 2 + 2 + 12 + 32 + 128
Q6_K_BYTES = 210               # 128 + 64 + 16 + 2

_F16 = np.dtype("<f2")
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)


def _fp16(field: np.ndarray) -> np.ndarray:
    """uint8[n, 2] little-endian fp16 field -> float32[n]."""
    return np.ascontiguousarray(field).view(_F16)[:, 0].astype(np.float32)


def _unpack_6bit_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8[n, 12] packed scales of Q4_K/Q5_K -> (sc uint8[n, 8], m uint8[n, 8])."""
    n = packed.shape[0]
    lo_sc = packed[:, 0:4]     # (n, 4) sc[0..3] in bits 0-5, sc[4..7] >> 4 in bits 6-7
    lo_m = packed[:, 4:8]      # (n, 4)  m[0..3] in bits 0-5,  m[4..7] >> 4 in bits 6-7
    mixed = packed[:, 8:12]    # (n, 4) sc[4..7] & 15 | (m[4..7] & 15) << 4
    sc = np.empty((n, 8), dtype=np.uint8)
    m = np.empty((n, 8), dtype=np.uint8)
    sc[:, :4] = lo_sc & 63
    m[:, :4] = lo_m & 63
    sc[:, 4:] = (mixed & 15) | ((lo_sc >> 6) << 4)
    m[:, 4:] = (mixed >> 4) | ((lo_m >> 6) << 4)
    return sc, m


def _unpack_k_header(blocks: np.ndarray):
    d = _fp16(blocks[:, 0:2])
    dmin = _fp16(blocks[:, 2:4])
    sc, m = _unpack_6bit_scales(blocks[:, 4:16])
    return d, dmin, sc, m


def unpack_q4_k_scales(blocks: np.ndarray):
    """Q4_K blocks uint8[n, 144] -> (d float32[n], dmin float32[n], sc uint8[n, 8], m uint8[n, 8]).

    sc[:, j] and m[:, j] are the 6-bit scale and min of sub-block j (weights 32j..32j+31);
    that sub-block's weights are (d * sc[j]) * q - (dmin * m[j]).
    """
    assert blocks.ndim == 2 and blocks.shape[1] == Q4_K_BYTES, f"Q4_K blocks must be (n, 144), got {blocks.shape}"
    return _unpack_k_header(blocks)


def unpack_q5_k_scales(blocks: np.ndarray):
    """Q5_K blocks uint8[n, 176] -> (d, dmin, sc, m); the header is identical to Q4_K's."""
    assert blocks.ndim == 2 and blocks.shape[1] == Q5_K_BYTES, f"Q5_K blocks must be (n, 176), got {blocks.shape}"
    return _unpack_k_header(blocks)


def unpack_q6_k_scales(blocks: np.ndarray):
    """Q6_K blocks uint8[n, 210] -> (d float32[n], scales int8[n, 16]).

    scales[:, k] belongs to sub-block k (weights 16k..16k+15): w = (d * scales[k]) * q.
    """
    assert blocks.ndim == 2 and blocks.shape[1] == Q6_K_BYTES, f"Q6_K blocks must be (n, 210), got {blocks.shape}"
    d = _fp16(blocks[:, 208:210])
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    return d, scales


def _out3(out: np.ndarray | None, n: int, groups: int, lanes: int) -> np.ndarray | None:
    """View the caller's float32[n, groups * lanes] output as (n, groups, lanes)."""
    if out is None:
        return None
    assert out.dtype == np.float32 and out.shape == (n, groups * lanes) and out.flags.c_contiguous, \
        f"out must be a C-contiguous float32[{n}, {groups * lanes}], got {out.dtype}{out.shape}"
    return out.reshape(n, groups, lanes)


def _q4_nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8[n, 128] Q4_K/Q5_K qs -> uint8[n, 8, 32]: the low 4 bits of sub-block j, lane l."""
    n = qs.shape[0]
    # (n, chunk c, nibble, lane): chunk c's low nibbles are sub-block 2c, high nibbles 2c+1
    nib = (qs.reshape(n, 4, 1, 32) >> _NIBBLE_SHIFTS) & np.uint8(15)
    return nib.reshape(n, 8, 32)


def dequantize_q4_k(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_K blocks uint8[n, 144] -> float32[n, 256] (written into `out` if given)."""
    assert blocks.ndim == 2 and blocks.shape[1] == Q4_K_BYTES, f"Q4_K blocks must be (n, 144), got {blocks.shape}"
    n = blocks.shape[0]
    d, dmin, sc, m = _unpack_k_header(blocks)
    scale = (d[:, None] * sc.astype(np.float32))[:, :, None]      # (n, 8, 1)
    offset = (dmin[:, None] * m.astype(np.float32))[:, :, None]   # (n, 8, 1)
    q = _q4_nibbles(blocks[:, 16:144])                              # (n, 8, 32) in 0..15
    res = np.multiply(scale, q, out=_out3(out, n, 8, 32), dtype=np.float32)
    res -= offset
    return res.reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q5_K blocks uint8[n, 176] -> float32[n, 256] (written into `out` if given)."""
    assert blocks.ndim == 2 and blocks.shape[1] == Q5_K_BYTES, f"Q5_K blocks must be (n, 176), got {blocks.shape}"
    n = blocks.shape[0]
    d, dmin, sc, m = _unpack_k_header(blocks)
    scale = (d[:, None] * sc.astype(np.float32))[:, :, None]      # (n, 8, 1)
    offset = (dmin[:, None] * m.astype(np.float32))[:, :, None]   # (n, 8, 1)
    qh = blocks[:, 16:48]                                           # (n, 32): bit j = sub-block j
    bit5 = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # (n, 8, 32)
    q = _q4_nibbles(blocks[:, 48:176]) | (bit5 << np.uint8(4))      # (n, 8, 32) in 0..31
    res = np.multiply(scale, q, out=_out3(out, n, 8, 32), dtype=np.float32)
    res -= offset
    return res.reshape(n, QK_K)


def q6_k_quants(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks uint8[n, 210] -> int8[n, 256]: the signed 6-bit quants q in -32..31, weight order."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)      # (n, half, 1, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)    # (n, half, 1, 32)
    # low nibbles -> (n, half, nibble a, 64) -> (n, half, quarter k = 2a + b, lane): byte 32b + l
    low = ((ql >> _NIBBLE_SHIFTS) & np.uint8(15)).reshape(n, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = (low | (high << np.uint8(4))).view(np.int8)
    q -= np.int8(32)
    return q.reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q6_K blocks uint8[n, 210] -> float32[n, 256] (written into `out` if given)."""
    assert blocks.ndim == 2 and blocks.shape[1] == Q6_K_BYTES, f"Q6_K blocks must be (n, 210), got {blocks.shape}"
    n = blocks.shape[0]
    d, scales = unpack_q6_k_scales(blocks)
    scale = (d[:, None] * scales.astype(np.float32))[:, :, None]  # (n, 16, 1)
    q = q6_k_quants(blocks).reshape(n, 16, 16)                      # (n, sub-block, lane)
    return np.multiply(scale, q, out=_out3(out, n, 16, 16), dtype=np.float32).reshape(n, QK_K)
