"""q8_K activations: the numpy reference (`quantize_q8k`) and the device's layout - what the short
prefill's writers store and its mma GEMVs read.

q8_K (`quantize_q8k`) gives each token's row of int8 values, a float scale a 256 values
(xd) and an integer sum a 32 (xb). On the device all three are tiled the same way: tokens in
groups of TILE = 8, and within a group block by block, each block's 8 tokens' parts back to back.

    xq byte of token t, value c:   (t // 8) 8 cols       + (c // 32) 256 + (t % 8) 32 + c % 32
    xd of token t, block b:        (t // 8) 8 (cols/256) + b 8           + t % 8
    xb of token t, sub-block s:    (t // 8) 8 (cols/32)  + (s // 8) 64   + (t % 8) 8  + s % 8

(xq's unit is a 32-value sub-block, xd's and xb's a 256-value block.) A token's first xb word of a
block is 8x its xd index, so one base a token serves both (`xd_base`).

Why. The mma GEMVs' B fragment is 8 tokens: a warp's load of 8 bytes a lane takes 32 bytes of one
sub-block from each of 8 tokens. Row-major, that is 8 rows and 8 cache lines a load instruction
(the kernel was L1-bound: docs/kernels/gemv.md 8i); tiled, 256 contiguous bytes, two lines. The
sums and scales of the accumulators' tokens (2t, 2t + 1 of lane t) likewise: 4 tokens' 32 bytes
of xb in two lines, not four; their 4 scales in one, not four. The
group is a constant, so each load's offset from the block's first word is an immediate: an earlier
build with the tokens' count as the stride cost 32-65 registers a thread (8i).

Writers: quant/quantize_q8k.rmsnorm_q8k, kvcache/attention_merge.merge_q8k. Readers:
quant/gemv_mma_k.py, gemv_mma_q6k.py, gemv_mma_glu.py, gemv_mma_qkv.py (through their token loads).
"""
from __future__ import annotations

import numpy as np
from numba import uint32

from .gemv_mma import _dev

TILE = 8                    # tokens a group
SUB = 32                    # values a sub-block
QK = 256                    # values a q8_K block (one scale)


def quantize_q8k(x: np.ndarray):
    """numpy q8_K of x [n_tok, cols] (cols a multiple of 256): (xq int8 [n_tok, cols], xd float32
    [n_tok, cols / 256], xb int32 [n_tok, cols / 32]); xq = round(x / xd), xd = max |x| / 127 of
    each block (0 for an all-zero block), xb the sum of xq over each 32 values."""
    x = np.asarray(x, np.float32)
    n_tok, cols = x.shape
    if cols % QK:
        raise ValueError(f"quantize_q8k: cols {cols} must be a multiple of {QK}")
    blocks = x.reshape(n_tok, cols // QK, QK)
    amax = np.abs(blocks).max(axis=2)
    xd = (amax / 127).astype(np.float32)
    inv = np.divide(1.0, xd, out=np.zeros_like(xd), where=xd > 0)
    xq = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8).reshape(n_tok, cols)
    xb = xq.reshape(n_tok, cols // SUB, SUB).astype(np.int32).sum(axis=2).astype(np.int32)
    return xq, xd, xb


def dequantize_q8k(xq: np.ndarray, xd: np.ndarray) -> np.ndarray:
    n_tok, cols = xq.shape
    return (xq.reshape(n_tok, -1, QK).astype(np.float32) * xd[..., None]).reshape(n_tok, cols)


def sizes(n_tok: int, cols: int) -> tuple:
    """(xq, xd, xb) element counts on the device for n_tok tokens of cols values: whole groups."""
    rows = -(-n_tok // TILE) * TILE
    return rows * cols, rows * (cols // QK), rows * (cols // SUB)


def xq_size(n_tok: int, cols: int) -> int:
    """The int8 values of the device's xq for n_tok tokens (`sizes`' first)."""
    return sizes(n_tok, cols)[0]


def check(who: str, n_tok: int, cols: int, xq, xd, xb) -> None:
    """ValueError naming who and the array unless xq, xd, xb are int8, float32, int32 arrays of
    `sizes`' element counts (the writers' argument check)."""
    for name, a, dt, size in zip(("xq", "xd", "xb"), (xq, xd, xb), (np.int8, np.float32, np.int32),
                                 sizes(n_tok, cols)):
        if a.dtype != dt or a.size != size:
            raise ValueError(f"{who}: {name} must be {np.dtype(dt).name} with {size} elements, "
                             f"got {a.dtype} {tuple(a.shape)}")


def tile_blocks(a: np.ndarray, per: int) -> np.ndarray:
    """xd (per 1), xb (per 8) or xq (per 32, `tile_q8k`) [n_tok, units * per] as the device holds
    it, flat: groups of TILE tokens (the last padded with zeros), a group [units][TILE][per]."""
    n_tok, m = a.shape
    groups = -(-n_tok // TILE)
    pad = np.zeros((groups * TILE, m), a.dtype)
    pad[:n_tok] = a
    return np.ascontiguousarray(pad.reshape(groups, TILE, m // per, per).transpose(0, 2, 1, 3)).reshape(-1)


def untile_blocks(flat: np.ndarray, n_tok: int, m: int, per: int) -> np.ndarray:
    """tile_blocks' inverse: [n_tok, m]."""
    groups = -(-n_tok // TILE)
    t = np.asarray(flat)[:groups * TILE * m].reshape(groups, m // per, TILE, per)
    return np.ascontiguousarray(t.transpose(0, 2, 1, 3)).reshape(groups * TILE, m)[:n_tok]


def tiled(xq: np.ndarray, xd: np.ndarray, xb: np.ndarray) -> tuple:
    """quantize_q8k's (xq, xd, xb) as the device holds them: the GEMVs' inputs."""
    return tile_q8k(xq), tile_blocks(xd, 1), tile_blocks(xb, 8)


def untiled(xq, xd, xb, n_tok: int, cols: int) -> tuple:
    """`tiled`'s inverse, from the device's flat arrays: quantize_q8k's layout."""
    return (untile_q8k(xq, n_tok, cols), untile_blocks(xd, n_tok, cols // QK, 1),
            untile_blocks(xb, n_tok, cols // SUB, 8))


def tile_q8k(xq: np.ndarray) -> np.ndarray:
    """The q8 values [n_tok, cols] as the device holds them, flat int8 [xq_size(n_tok, cols)]: the
    tokens in groups of TILE (the last padded with zeros), a group [cols / 32][TILE][32] - each
    32-value sub-block's TILE rows back to back (`tile_blocks` with a sub-block's 32 values as the
    unit). Token t's values 32 s .. 32 s + 31 start at byte (t // 8) 8 cols + 256 s + 32 (t % 8).
    Written by quant/quantize_q8k.rmsnorm_q8k and kvcache/attention_merge.merge_q8k, read by the mma
    GEMVs (above)."""
    return tile_blocks(xq, SUB)


def untile_q8k(flat: np.ndarray, n_tok: int, cols: int) -> np.ndarray:
    """tile_q8k's inverse: int8 [n_tok, cols]."""
    return untile_blocks(flat, n_tok, cols, SUB)


@_dev
def xq_word(tb, cols):
    """The first 32-bit word of token tb's 32 bytes of sub-block 0 in the tiled xq (`tile_q8k`);
    sub-block s's are 64 s words on, block b's first 512 b."""
    return uint32((tb >> 3) * (cols << 1)) + uint32((tb & 7) * 8)


@_dev
def xd_base(tb, nb):
    """Token tb's xd index of block 0 in the tiled xd (nb blocks a row): block b's is 8 b on, and
    its 8 sub-block sums start at xb word 8 (xd_base + 8 b)."""
    return uint32((tb >> 3) * (nb << 3)) + uint32(tb & 7)
