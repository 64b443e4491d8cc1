"""The quantized matmul kernels: out[t, r] = sum_c x[t, c] * W[r, c], W read as GGUF bytes.

One kernel per weight type (linear.py picks it): linear_q4_0, _q4_1, _q5_0, _q5_1,
_q8_0 (32-weight blocks), linear_q4_k, _q5_k, _q6_k (256-weight super-blocks),
linear_f32, _f16, _bf16.

The integer types (what llama.cpp's CPU back-end does too): each token's activations
are quantized to int8 per block (`quantize_rows`: one float32 scale per 32 values for
the legacy types, per 256 for the k-quants, like ggml's Q8_0 / Q8_K); every block's
products are exact int32 sums (int16 x int8 for the k-quants, whose integer sub-block
scales are folded into the quants), and only the per-block scaling is float - the
sequence is written out in rowdot.py. The float types keep x in float32: 64-wide chunks
summed by simd.dot_f32* (a fixed tree), added in order, then the cols % 64 tail, in order.

Who owns what: `prange` over nt chunks of consecutive output rows (one chunk per
thread, so 2 threads do half the rows each). Within a chunk, row by row:
- n <= FUSED_MAX_N (decode): each token runs rowdot.row_dot_<type> on the raw bytes,
  decoding each block in registers; the row is read from memory once, then from L1;
- larger n (prefill): the row is decoded once into the chunk's own buffers (int8 or
  folded int16 quants and per-block scales, a few KB, in L1), then every token runs the
  buffered row dot against it. Same integer sums, same float sequence: same bits.

Batch invariance: out[t, r] depends on W's row r and x's row t only - x is quantized
per row, the integer sums are exact, and the float steps run in one fixed order
(fastmath off: LLVM may not reorder or fuse them). So the bits do not depend on n, on
where the row sits in the batch, or on the thread count (tests/test_cpu_kernels.py
checks all three).

Why one kernel per type rather than one per family with a format switch: with the
switch inside the prange body, numba's on-disk cache loaded a gufunc that ran 3x slower
than the freshly compiled one (same machine code, measured 0.20 vs 0.07 ms for Q8_0
4096 x 640 on the dev machine, 2026-12-03); with the type fixed at compile time the
cached and fresh kernels run at the same speed, and a model compiles only the types it
uses. The shared code lives in inline helpers taking the type code as a constant.

What it deliberately does not do: check arguments (linear.py's launcher does: shapes,
types, contiguity), allocate per row, or call numba.get_num_threads() (nt is passed in,
see jit.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .jit import kernel
from .rowdot import (row_dot_kquant_buf, row_dot_kquant_buf_min, row_dot_legacy_buf, row_dot_legacy_buf_min,
                     row_dot_q4_0, row_dot_q4_1, row_dot_q4_k, row_dot_q5_0, row_dot_q5_1, row_dot_q5_k,
                     row_dot_q6_k, row_dot_q8_0)
from .simd import (bf16_bits_to_f32, dot_f32, dot_f32_bf16, dot_f32_f16, load_f16, unpack_q4_0, unpack_q4_1,
                   unpack_q5_0, unpack_q5_1, unpack_q8_0, unpack_scaled_q4_k, unpack_scaled_q5_k,
                   unpack_scaled_q6_k)

FUSED_MAX_N = 2          # n <= this: decode blocks in registers per token; above: once per row


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


# -- legacy 32-weight blocks: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (type codes 0..4) ---------------

LEGACY_BLOCK_BYTES = (18, 20, 22, 24, 34)   # by type code


@njit(inline="always")
def _legacy_activations(x):
    n, cols = x.shape
    xq = np.empty((n, cols), np.int8)                 # activations, int8 per 32-block
    xd = np.empty((n, cols // 32), np.float32)        # their scales
    xs = np.empty((n, cols // 32), np.int32)          # their sums (the min term of Q4_1, Q5_1)
    quantize_rows(x, 32, xq, xd, xs)
    return xq, xd, xs


@njit(inline="always")
def _legacy_rows_buffered(fmt, w, xq, xd, xs, lo, hi, out):
    """Rows [lo, hi) for every token: decode each row once into L1 buffers, then the
    buffered row dot per token. fmt is a constant at each call site."""
    n, cols = xq.shape
    nb = cols // 32
    bb = LEGACY_BLOCK_BYTES[fmt]
    q = np.empty(cols, np.int8)                       # the row's quants, weight order
    dw = np.empty(nb, np.float32)                     # its block scales d
    mw = np.zeros(nb, np.float32)                     # its block minima m (Q4_1, Q5_1)
    for r in range(lo, hi):
        base = r * nb * bb
        for b in range(nb):
            o = base + b * bb
            dw[b] = load_f16(w, o)                    # every legacy block starts with fp16 d
            if fmt == 0:
                unpack_q4_0(w, o, q, b * 32)
            elif fmt == 1:
                mw[b] = load_f16(w, o + 2)            # then fp16 m for the _1 types
                unpack_q4_1(w, o, q, b * 32)
            elif fmt == 2:
                unpack_q5_0(w, o, q, b * 32)
            elif fmt == 3:
                mw[b] = load_f16(w, o + 2)
                unpack_q5_1(w, o, q, b * 32)
            else:
                unpack_q8_0(w, o, q, b * 32)
        for t in range(n):
            if fmt == 1 or fmt == 3:
                out[t, r] = row_dot_legacy_buf_min(q, xq, t * cols, dw, mw, xd, xs, t * nb, nb)
            else:
                out[t, r] = row_dot_legacy_buf(q, xq, t * cols, dw, mw, xd, xs, t * nb, nb)


@kernel(parallel=True)
def linear_q4_0(x, w, rows, out, nt):
    """x float32 [n, cols]; w uint8 [rows * row_bytes] (raw blocks); out float32 [n, rows]."""
    xq, xd, xs = _legacy_activations(x)
    n, cols = x.shape
    nb = cols // 32
    if n <= FUSED_MAX_N:
        for c in prange(nt):                          # chunk c: rows [lo, hi), one thread
            for r in range(rows * c // nt, rows * (c + 1) // nt):
                for t in range(n):
                    out[t, r] = row_dot_q4_0(w, r * nb * 18, xq, t * cols, xd, xs, t * nb, nb)
    else:
        for c in prange(nt):
            _legacy_rows_buffered(0, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


@kernel(parallel=True)
def linear_q4_1(x, w, rows, out, nt):
    """As linear_q4_0, for Q4_1."""
    xq, xd, xs = _legacy_activations(x)
    n, cols = x.shape
    nb = cols // 32
    if n <= FUSED_MAX_N:
        for c in prange(nt):
            for r in range(rows * c // nt, rows * (c + 1) // nt):
                for t in range(n):
                    out[t, r] = row_dot_q4_1(w, r * nb * 20, xq, t * cols, xd, xs, t * nb, nb)
    else:
        for c in prange(nt):
            _legacy_rows_buffered(1, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


@kernel(parallel=True)
def linear_q5_0(x, w, rows, out, nt):
    """As linear_q4_0, for Q5_0."""
    xq, xd, xs = _legacy_activations(x)
    n, cols = x.shape
    nb = cols // 32
    if n <= FUSED_MAX_N:
        for c in prange(nt):
            for r in range(rows * c // nt, rows * (c + 1) // nt):
                for t in range(n):
                    out[t, r] = row_dot_q5_0(w, r * nb * 22, xq, t * cols, xd, xs, t * nb, nb)
    else:
        for c in prange(nt):
            _legacy_rows_buffered(2, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


@kernel(parallel=True)
def linear_q5_1(x, w, rows, out, nt):
    """As linear_q4_0, for Q5_1."""
    xq, xd, xs = _legacy_activations(x)
    n, cols = x.shape
    nb = cols // 32
    if n <= FUSED_MAX_N:
        for c in prange(nt):
            for r in range(rows * c // nt, rows * (c + 1) // nt):
                for t in range(n):
                    out[t, r] = row_dot_q5_1(w, r * nb * 24, xq, t * cols, xd, xs, t * nb, nb)
    else:
        for c in prange(nt):
            _legacy_rows_buffered(3, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


@kernel(parallel=True)
def linear_q8_0(x, w, rows, out, nt):
    """As linear_q4_0, for Q8_0."""
    xq, xd, xs = _legacy_activations(x)
    n, cols = x.shape
    nb = cols // 32
    if n <= FUSED_MAX_N:
        for c in prange(nt):
            for r in range(rows * c // nt, rows * (c + 1) // nt):
                for t in range(n):
                    out[t, r] = row_dot_q8_0(w, r * nb * 34, xq, t * cols, xd, xs, t * nb, nb)
    else:
        for c in prange(nt):
            _legacy_rows_buffered(4, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


# -- k-quant 256-weight super-blocks: Q4_K Q5_K Q6_K (type codes 0..2) -------------------

KQUANT_BLOCK_BYTES = (144, 176, 210)        # by type code


@njit(inline="always")
def _kquant_activations(x):
    n, cols = x.shape
    xq = np.empty((n, cols), np.int8)                 # activations, int8 per 256 (Q8_K-like)
    xd = np.empty((n, cols // 256), np.float32)
    xs = np.empty((n, cols // 32), np.int32)          # sums per 32 (the sub-block minima)
    quantize_rows(x, 256, xq, xd, xs)
    return xq, xd, xs


@njit(inline="always")
def _kquant_scales(fmt, w, base, nb, bb, sc, d, dmin, mins):
    """Row at byte `base`: integer sub-block scales -> sc int16 [nb * 16] (block b at 16b);
    d, dmin [nb] float32; mins int32 [nb * 8] (Q4_K, Q5_K; sub-block j of block b at 8b + j)."""
    for b in range(nb):
        o = base + b * bb
        if fmt == 2:                                  # Q6_K: int8 scales[16] at 192, fp16 d at 208
            d[b] = load_f16(w, o + 208)
            for j in range(16):
                sc[b * 16 + j] = np.int16(np.int8(w[o + 192 + j]))
            continue
        d[b] = load_f16(w, o)                         # Q4_K / Q5_K: fp16 d, fp16 dmin,
        dmin[b] = load_f16(w, o + 2)                  # then 12 bytes of packed 6-bit sc, m
        for j in range(4):
            sc[b * 16 + j] = np.int16(w[o + 4 + j] & 63)
            mins[b * 8 + j] = np.int32(w[o + 8 + j] & 63)
            sc[b * 16 + j + 4] = np.int16((w[o + 12 + j] & 15) | ((w[o + 4 + j] >> 6) << 4))
            mins[b * 8 + j + 4] = np.int32((w[o + 12 + j] >> 4) | ((w[o + 8 + j] >> 6) << 4))


@njit(inline="always")
def _kquant_rows(fmt, w, xq, xd, xs, lo, hi, out):
    """Rows [lo, hi) for every token; fmt is a constant at each call site."""
    n, cols = xq.shape
    nb = cols // 256
    ns = cols // 32
    bb = KQUANT_BLOCK_BYTES[fmt]
    q16 = np.empty(cols, np.int16)                    # the row's folded quants q * sc (buffered)
    sc = np.empty(nb * 16, np.int16)                  # its integer sub-block scales
    d = np.empty(nb, np.float32)
    dmin = np.zeros(nb, np.float32)
    mins = np.zeros(nb * 8, np.int32)
    for r in range(lo, hi):
        base = r * nb * bb
        _kquant_scales(fmt, w, base, nb, bb, sc, d, dmin, mins)
        if n <= FUSED_MAX_N:                          # decode in registers, per token
            for t in range(n):
                if fmt == 0:
                    out[t, r] = row_dot_q4_k(w, base, sc, xq, t * cols, d, dmin, mins, xd, xs, t * nb, t * ns, nb)
                elif fmt == 1:
                    out[t, r] = row_dot_q5_k(w, base, sc, xq, t * cols, d, dmin, mins, xd, xs, t * nb, t * ns, nb)
                else:
                    out[t, r] = row_dot_q6_k(w, base, sc, xq, t * cols, d, dmin, mins, xd, xs, t * nb, t * ns, nb)
            continue
        for b in range(nb):                           # decode the row once
            o = base + b * bb
            if fmt == 0:
                unpack_scaled_q4_k(w, o, sc, b * 16, q16, b * 256)
            elif fmt == 1:
                unpack_scaled_q5_k(w, o, sc, b * 16, q16, b * 256)
            else:
                unpack_scaled_q6_k(w, o, sc, b * 16, q16, b * 256)
        for t in range(n):
            if fmt == 2:
                out[t, r] = row_dot_kquant_buf(q16, xq, t * cols, d, dmin, mins, xd, xs, t * nb, t * ns, nb)
            else:
                out[t, r] = row_dot_kquant_buf_min(q16, xq, t * cols, d, dmin, mins, xd, xs, t * nb, t * ns, nb)


@kernel(parallel=True)
def linear_q4_k(x, w, rows, out, nt):
    """x float32 [n, cols]; w uint8 [rows * row_bytes]; out float32 [n, rows]; cols % 256 == 0."""
    xq, xd, xs = _kquant_activations(x)
    for c in prange(nt):
        _kquant_rows(0, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


@kernel(parallel=True)
def linear_q5_k(x, w, rows, out, nt):
    """As linear_q4_k, for Q5_K."""
    xq, xd, xs = _kquant_activations(x)
    for c in prange(nt):
        _kquant_rows(1, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


@kernel(parallel=True)
def linear_q6_k(x, w, rows, out, nt):
    """As linear_q4_k, for Q6_K."""
    xq, xd, xs = _kquant_activations(x)
    for c in prange(nt):
        _kquant_rows(2, w, xq, xd, xs, rows * c // nt, rows * (c + 1) // nt, out)


# -- float weights --------------------------------------------------------------------------

@kernel(parallel=True)
def linear_f32(x, w, rows, out, nt):
    """x float32 [n, cols]; w float32 [rows * cols]; out float32 [n, rows]."""
    n, cols = x.shape
    main = cols // 64 * 64
    for c in prange(nt):
        for r in range(rows * c // nt, rows * (c + 1) // nt):
            for t in range(n):
                acc = np.float32(0)
                for j in range(0, main, 64):
                    acc += dot_f32(x, t * cols + j, w, r * cols + j, 64)
                for j in range(main, cols):
                    acc += x[t, j] * w[r * cols + j]
                out[t, r] = acc


@kernel(parallel=True)
def linear_f16(x, w, rows, out, nt):
    """x float32 [n, cols]; w uint16 [rows * cols] (IEEE half bits); out float32 [n, rows]."""
    n, cols = x.shape
    main = cols // 64 * 64
    for c in prange(nt):
        for r in range(rows * c // nt, rows * (c + 1) // nt):
            for t in range(n):
                acc = np.float32(0)
                for j in range(0, main, 64):
                    acc += dot_f32_f16(x, t * cols + j, w, r * cols + j, 64)
                for j in range(main, cols):
                    acc += x[t, j] * load_f16(w, r * cols + j)
                out[t, r] = acc


@kernel(parallel=True)
def linear_bf16(x, w, rows, out, nt):
    """x float32 [n, cols]; w uint16 [rows * cols] (bfloat16 bits); out float32 [n, rows]."""
    n, cols = x.shape
    main = cols // 64 * 64
    for c in prange(nt):
        for r in range(rows * c // nt, rows * (c + 1) // nt):
            for t in range(n):
                acc = np.float32(0)
                for j in range(0, main, 64):
                    acc += dot_f32_bf16(x, t * cols + j, w, r * cols + j, 64)
                for j in range(main, cols):
                    acc += x[t, j] * bf16_bits_to_f32(w[r * cols + j])
                out[t, r] = acc
