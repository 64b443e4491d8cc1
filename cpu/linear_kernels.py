"""The quantized matmul kernels: out[t, r] = sum_c x[t, c] * W[r, c], W read as GGUF bytes.

Three kernel families, each one numba function that switches on a small format code
(weights.LEGACY / KQUANT / FLOAT) once per block:

    linear_legacy   Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (32-weight blocks, one fp16 scale each)
    linear_kquant   Q4_K Q5_K Q6_K          (256-weight super-blocks)
    linear_float    F32, and F16 / BF16 (linear_half)

The integer families (what llama.cpp's CPU back-end does too): each token's activations
are quantized to int8 per block (`quantize_rows`: one float32 scale per 32 values for
the legacy formats, per 256 for the k-quants, like ggml's Q8_0 / Q8_K), and every
block's dot product is an exact int32 sum of int8 x int8 (int16 x int8 for the
k-quants, whose integer sub-block scales are folded into the quants). Only the per-block
combination is float:

    legacy, block b:   acc += float(isum_b) * (d_w[b] * d_x[t, b])
                       (Q4_1, Q5_1)  + m_w[b] * (d_x[t, b] * float(sum_x[t, b]))
    k-quant, block b:  acc += (d[b] * d_x[t, b]) * float(isum_b)
                       (Q4_K, Q5_K)  - (dmin[b] * d_x[t, b]) * float(sum_j m_j * sum_x[t, 8b + j])

Who owns what: `prange` over nt chunks of consecutive output rows (one per thread, so
2 threads do half the rows each); a chunk unpacks one weight row at a time into its own
small buffer (int8 or folded int16 quants, per-block scales: a few KB, in L1), then runs
every token against it, so a row's bytes are read from memory once per call whatever n.

Batch invariance: out[t, r] is a function of W's row r and x's row t only. The int8
quantization of x is per row, the integer sums are exact, and the float combination
runs over blocks in one fixed order (fastmath off: LLVM may not reorder or contract
it). So the bits do not depend on n, on where the row sits in the batch, or on the
thread count (tests/test_cpu_kernels.py checks all three).

Float formats: x stays float32; the row dot is 64-wide chunks summed by simd.dot_f32*
(fixed tree order) and added in order, then the cols % 64 tail scalar, in order.

What it deliberately does not do: check arguments (linear.py's launcher does: shapes,
types, contiguity), allocate per row, or call numba.get_num_threads() (nt is passed in,
see jit.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .jit import kernel
from .simd import (bf16_bits_to_f32, dot_f32, dot_f32_bf16, dot_f32_f16, dot_i8, dot_i16_i8,
                   f16_bits_to_f32, f16_to_f32, unpack_q4_0, unpack_q4_1, unpack_q5_0, unpack_q5_1,
                   unpack_q8_0, unpack_scaled_q4_k, unpack_scaled_q5_k, unpack_scaled_q6_k)


# -- activation quantization -------------------------------------------------------------

@njit(inline="always")
def quantize_rows(x, block, xq, xd, xs):
    """x float32 [n, k] -> xq int8 [n, k], xd float32 [n, k / block], xs int32 [n, k / 32].

    Per block of `block` values: d = max|x| / 127, q = rint(x / d) (x * (1 / d)),
    clipped to +-127; a block of zeros gets d = 0 and q = 0. xs is the sum of q over
    each 32 values (the min terms of Q4_1, Q5_1, Q4_K, Q5_K). Mirrors
    linear.quantize_rows_reference operation for operation."""
    n, k = x.shape
    for t in range(n):
        for b in range(k // block):
            amax = np.float32(0)
            for j in range(b * block, (b + 1) * block):
                a = abs(x[t, j])
                if a > amax:
                    amax = a
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d > 0 else np.float32(0)
            xd[t, b] = d
            for j in range(b * block, (b + 1) * block):
                v = np.rint(x[t, j] * inv)
                v = min(max(v, np.float32(-127)), np.float32(127))
                xq[t, j] = np.int8(v)
        for b in range(k // 32):
            s = np.int32(0)
            for j in range(b * 32, b * 32 + 32):
                s += np.int32(xq[t, j])
            xs[t, b] = s


# -- legacy 32-weight blocks ---------------------------------------------------------------

LEGACY_BLOCK_BYTES = (18, 20, 22, 24, 34)   # by format code: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0


@njit(inline="always")
def _unpack_legacy_row(fmt, w, base, nb, bb, q, dw, mw):
    """Row at byte `base`: quants -> q int8 [nb * 32], scales -> dw [nb], mins -> mw [nb]."""
    for b in range(nb):
        o = base + b * bb
        dw[b] = f16_to_f32(w[o], w[o + 1])              # every legacy block starts with fp16 d
        if fmt == 0:
            unpack_q4_0(w, o, q, b * 32)
        elif fmt == 1:
            mw[b] = f16_to_f32(w[o + 2], w[o + 3])      # fp16 m (the block minimum)
            unpack_q4_1(w, o, q, b * 32)
        elif fmt == 2:
            unpack_q5_0(w, o, q, b * 32)
        elif fmt == 3:
            mw[b] = f16_to_f32(w[o + 2], w[o + 3])
            unpack_q5_1(w, o, q, b * 32)
        else:
            unpack_q8_0(w, o, q, b * 32)


@kernel(parallel=True)
def linear_legacy(x, w, fmt, rows, out, nt):
    """x float32 [n, cols]; w uint8 [rows * row_bytes] (raw blocks); out float32 [n, rows]."""
    n, cols = x.shape
    nb = cols // 32
    bb = LEGACY_BLOCK_BYTES[fmt]
    has_min = fmt == 1 or fmt == 3
    xq = np.empty((n, cols), np.int8)                 # activations, int8 per 32-block
    xd = np.empty((n, nb), np.float32)                # their scales
    xs = np.empty((n, nb), np.int32)                  # their sums (for the min term)
    quantize_rows(x, 32, xq, xd, xs)
    for c in prange(nt):                              # chunk c: rows [lo, hi), one thread
        lo = rows * c // nt
        hi = rows * (c + 1) // nt
        q = np.empty(cols, np.int8)                   # the current row's quants (L1)
        dw = np.empty(nb, np.float32)                 # its block scales
        mw = np.zeros(nb, np.float32)                 # its block minima (Q4_1, Q5_1)
        for r in range(lo, hi):
            _unpack_legacy_row(fmt, w, r * nb * bb, nb, bb, q, dw, mw)
            for t in range(n):
                acc = np.float32(0)
                for b in range(nb):
                    isum = dot_i8(q, b * 32, xq, t * cols + b * 32, 32)     # exact int32
                    acc += np.float32(isum) * (dw[b] * xd[t, b])
                    if has_min:
                        acc += mw[b] * (xd[t, b] * np.float32(xs[t, b]))
                out[t, r] = acc


# -- k-quant 256-weight super-blocks -------------------------------------------------------

KQUANT_BLOCK_BYTES = (144, 176, 210)        # by format code: Q4_K Q5_K Q6_K


@njit(inline="always")
def _unpack_kquant_row(fmt, w, base, nb, bb, q16, sc, d, dmin, mins):
    """Row at byte `base`: quants x integer sub-block scales -> q16 int16 [nb * 256];
    d, dmin [nb] float32; mins int32 [nb * 8] (Q4_K, Q5_K; sub-block j of block b at 8b + j)."""
    for b in range(nb):
        o = base + b * bb
        if fmt == 2:                                  # Q6_K: int8 scales[16] at 192, fp16 d at 208
            d[b] = f16_to_f32(w[o + 208], w[o + 209])
            for j in range(16):
                sc[j] = np.int16(np.int8(w[o + 192 + j]))
            unpack_scaled_q6_k(w, o, sc, 0, q16, b * 256)
            continue
        d[b] = f16_to_f32(w[o], w[o + 1])             # Q4_K / Q5_K: fp16 d, fp16 dmin,
        dmin[b] = f16_to_f32(w[o + 2], w[o + 3])      # then 12 bytes of packed 6-bit sc, m
        for j in range(4):
            sc[j] = np.int16(w[o + 4 + j] & 63)
            mins[b * 8 + j] = np.int32(w[o + 8 + j] & 63)
            sc[j + 4] = np.int16((w[o + 12 + j] & 15) | ((w[o + 4 + j] >> 6) << 4))
            mins[b * 8 + j + 4] = np.int32((w[o + 12 + j] >> 4) | ((w[o + 8 + j] >> 6) << 4))
        if fmt == 0:
            unpack_scaled_q4_k(w, o, sc, 0, q16, b * 256)
        else:
            unpack_scaled_q5_k(w, o, sc, 0, q16, b * 256)


@kernel(parallel=True)
def linear_kquant(x, w, fmt, rows, out, nt):
    """x float32 [n, cols]; w uint8 [rows * row_bytes]; out float32 [n, rows]; cols % 256 == 0."""
    n, cols = x.shape
    nb = cols // 256
    bb = KQUANT_BLOCK_BYTES[fmt]
    xq = np.empty((n, cols), np.int8)                 # activations, int8 per 256 (Q8_K-like)
    xd = np.empty((n, nb), np.float32)
    xs = np.empty((n, cols // 32), np.int32)          # sums per 32 (the sub-block minima)
    quantize_rows(x, 256, xq, xd, xs)
    for c in prange(nt):
        lo = rows * c // nt
        hi = rows * (c + 1) // nt
        q16 = np.empty(cols, np.int16)                # the row's folded quants q * sc (L1)
        sc = np.empty(16, np.int16)
        d = np.empty(nb, np.float32)
        dmin = np.zeros(nb, np.float32)
        mins = np.zeros(nb * 8, np.int32)
        for r in range(lo, hi):
            _unpack_kquant_row(fmt, w, r * nb * bb, nb, bb, q16, sc, d, dmin, mins)
            for t in range(n):
                acc = np.float32(0)
                for b in range(nb):
                    isum = dot_i16_i8(q16, b * 256, xq, t * cols + b * 256, 256)   # exact int32
                    acc += (d[b] * xd[t, b]) * np.float32(isum)
                    if fmt != 2:
                        msum = np.int32(0)
                        for j in range(8):
                            msum += mins[b * 8 + j] * xs[t, b * 8 + j]
                        acc -= (dmin[b] * xd[t, b]) * np.float32(msum)
                out[t, r] = acc


# -- float weights --------------------------------------------------------------------------

@kernel(parallel=True)
def linear_float(x, w, rows, out, nt):
    """x float32 [n, cols]; w float32 [rows * cols]; out float32 [n, rows]."""
    n, cols = x.shape
    main = cols // 64 * 64
    for c in prange(nt):
        lo = rows * c // nt
        hi = rows * (c + 1) // nt
        for r in range(lo, hi):
            for t in range(n):
                acc = np.float32(0)
                for j in range(0, main, 64):
                    acc += dot_f32(x, t * cols + j, w, r * cols + j, 64)
                for j in range(main, cols):
                    acc += x[t, j] * w[r * cols + j]
                out[t, r] = acc


@kernel(parallel=True)
def linear_half(x, w, is_bf16, rows, out, nt):
    """x float32 [n, cols]; w uint16 [rows * cols] (F16 or BF16 bits); out float32 [n, rows]."""
    n, cols = x.shape
    main = cols // 64 * 64
    for c in prange(nt):
        lo = rows * c // nt
        hi = rows * (c + 1) // nt
        for r in range(lo, hi):
            for t in range(n):
                acc = np.float32(0)
                for j in range(0, main, 64):
                    if is_bf16:
                        acc += dot_f32_bf16(x, t * cols + j, w, r * cols + j, 64)
                    else:
                        acc += dot_f32_f16(x, t * cols + j, w, r * cols + j, 64)
                for j in range(main, cols):
                    h = w[r * cols + j]
                    acc += x[t, j] * (bf16_bits_to_f32(h) if is_bf16 else f16_bits_to_f32(h))
                out[t, r] = acc
