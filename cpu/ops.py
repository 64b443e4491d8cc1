"""The small CPU ops around the matmuls: norms, RoPE, gated activations, embedding lookup.

    rmsnorm(x, w, eps, out=None)        x [..., d] / sqrt(mean(x^2) + eps) * w[d]
                                        (per-head QK norm: x [n, heads, head_dim], w [head_dim])
    rope(x, cos, sin, neox=True)        in place on x [n, heads, head_dim]; cos, sin [n, n_rot/2]
                                        rotate the first n_rot dims: NeoX pairs (i, i + n_rot/2)
                                        (Qwen3, Gemma 3), normal pairs (2i, 2i + 1) (llama)
    silu_mul(g, u, out=None)            silu(g) * u = g / (1 + exp(-g)) * u
    gelu_tanh_mul(g, u, out=None)       0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u  (ggml's)
    embed(tokens, table, out=None, scale=None)
                                        rows of a CPUWeight table -> float32 [n, d], bit-identical
                                        to quant.formats.dequantize of those rows, then * scale
                                        (Gemma: sqrt(n_embd)) as one float32 multiply

All float32 in, float32 out, C-contiguous; each output element is computed by the
same operations whatever n (batch-invariant). The numpy references are the ones in
engine/models/reference.py (rmsnorm, rope_neox, silu) and here (`*_reference`).

Accuracy: rmsnorm sums squares in 64-wide float32 chunks (simd.dot_f32, a fixed tree)
added in order - not numpy's pairwise order, so results differ from numpy by float32
rounding (a few ulps), never by more. exp is a polynomial (`_exp`, within 2 ulp of
expf on [-87, 88], clamped outside) so that the activation loops vectorise; GELU's
0.5 g (1 + tanh y) is computed as g / (1 + exp(-2y)), the same function without the
cancellation of 1 + tanh(y) at negative y.

What it deliberately does not do: fuse ops (the model files call them in sequence),
thread (these are O(n d) and well under the linears' cost), or compute the RoPE tables
(engine/models/reference.rope_tables does, and the model file owns the positions).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from genie_rt.quant.formats import QType

from .jit import kernel
from .simd import (dot_f32, load_f16, unpack_q4_0, unpack_q4_1, unpack_q4_k, unpack_q5_0, unpack_q5_1,
                   unpack_q5_k, unpack_q6_k, unpack_q8_0)
from .weights import CPUWeight

# -- numpy references -------------------------------------------------------------------


def gelu_tanh_reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def silu_reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1 + np.exp(-x))


def rope_normal_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, hd]: rotate adjacent pairs (2i, 2i + 1) of the first n_rot dims."""
    out = x.copy()
    r = 2 * cos.shape[1]
    a, b = x[..., 0:r:2], x[..., 1:r:2]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., 0:r:2] = a * c - b * s
    out[..., 1:r:2] = b * c + a * s
    return out


def rope_neox_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, hd]: rotate pairs (i, i + n_rot/2) of the first n_rot dims."""
    out = x.copy()
    h = cos.shape[1]
    a, b = x[..., :h], x[..., h:2 * h]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., :h] = a * c - b * s
    out[..., h:2 * h] = b * c + a * s
    return out


# -- kernels ----------------------------------------------------------------------------

@njit(inline="always")
def _exp(x):
    """float32 e^x: x = k ln2 + r, |r| <= ln2/2 (Cody-Waite split of ln2), e^r by a
    degree-6 Taylor polynomial in Horner form, 2^k by building the exponent bits."""
    x = min(max(x, np.float32(-87.33654)), np.float32(88.37626))
    k = np.rint(x * np.float32(1.4426950408889634))
    r = (x - k * np.float32(0.693359375)) - k * np.float32(-2.12194440e-4)
    p = np.float32(1.0 / 720)
    p = p * r + np.float32(1.0 / 120)
    p = p * r + np.float32(1.0 / 24)
    p = p * r + np.float32(1.0 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    scale = np.uint32((np.int32(k) + np.int32(127)) << np.int32(23)).view(np.float32)
    return p * scale


@kernel()
def _rmsnorm(x, w, eps, out):
    """x, out float32 [m, d]; w float32 [d]."""
    m, d = x.shape
    main = d // 64 * 64
    for i in range(m):
        ss = np.float32(0)
        for j in range(0, main, 64):
            ss += dot_f32(x, i * d + j, x, i * d + j, 64)
        for j in range(main, d):
            ss += x[i, j] * x[i, j]
        rms = np.sqrt(ss / np.float32(d) + eps)
        for j in range(d):
            out[i, j] = x[i, j] / rms * w[j]             # the reference's order: x / rms * w


@kernel()
def _rope(x, cos, sin, neox):
    """x float32 [n, heads, hd] in place; cos, sin float32 [n, half]; rotates 2 * half dims."""
    n, heads, _ = x.shape
    half = cos.shape[1]
    for t in range(n):
        for h in range(heads):
            for i in range(half):
                ia = i if neox else 2 * i            # the pair: (i, i + half) or (2i, 2i + 1)
                ib = i + half if neox else 2 * i + 1
                a = x[t, h, ia]
                b = x[t, h, ib]
                c = cos[t, i]
                s = sin[t, i]
                x[t, h, ia] = a * c - b * s
                x[t, h, ib] = b * c + a * s


@kernel()
def _silu_mul(g, u, out):
    for i in range(g.size):
        v = g[i]
        out[i] = v / (np.float32(1) + _exp(-v)) * u[i]


@kernel()
def _gelu_tanh_mul(g, u, out):
    for i in range(g.size):
        v = g[i]
        y = np.float32(0.7978845608028654) * (v + np.float32(0.044715) * v * v * v)
        # 0.5 v (1 + tanh y) = v / (1 + exp(-2y)): the same function without the
        # cancellation of 1 + tanh(y) for negative y
        out[i] = v / (np.float32(1) + _exp(np.float32(-2) * y)) * u[i]


@njit(inline="always")
def _embed_row(fmt, w, base, d, q, out, t):
    """One table row at byte `base` -> out[t, :d], as quant.formats.dequantize computes it.
    fmt: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0 (32-blocks), 5 Q4_K, 6 Q5_K, 7 Q6_K."""
    if fmt <= 4:
        bb = (18, 20, 22, 24, 34)[fmt]
        for b in range(d // 32):
            o = base + b * bb
            dd = load_f16(w, o)
            m = np.float32(0)
            if fmt == 0:
                unpack_q4_0(w, o, q, 0)
            elif fmt == 1:
                m = load_f16(w, o + 2)
                unpack_q4_1(w, o, q, 0)
            elif fmt == 2:
                unpack_q5_0(w, o, q, 0)
            elif fmt == 3:
                m = load_f16(w, o + 2)
                unpack_q5_1(w, o, q, 0)
            else:
                unpack_q8_0(w, o, q, 0)
            for j in range(32):
                v = np.float32(q[j]) * dd                 # q * d, then + m: two roundings, as numpy
                out[t, b * 32 + j] = v + m if (fmt == 1 or fmt == 3) else v
        return
    bb = (144, 176, 210)[fmt - 5]
    for b in range(d // 256):
        o = base + b * bb
        if fmt == 7:                                       # Q6_K: (d * sc16) * q
            dd = load_f16(w, o + 208)
            unpack_q6_k(w, o, q, 0)
            for s in range(16):
                scale = dd * np.float32(np.int8(w[o + 192 + s]))
                for j in range(16):
                    out[t, b * 256 + s * 16 + j] = scale * np.float32(q[s * 16 + j])
            continue
        dd = load_f16(w, o)                                # Q4_K / Q5_K: (d * sc) * q - (dmin * m)
        dmin = load_f16(w, o + 2)
        if fmt == 5:
            unpack_q4_k(w, o, q, 0)
        else:
            unpack_q5_k(w, o, q, 0)
        for s in range(8):
            if s < 4:
                sc = w[o + 4 + s] & 63
                mn = w[o + 8 + s] & 63
            else:
                sc = (w[o + 8 + s] & 15) | ((w[o + s] >> 6) << 4)
                mn = (w[o + 8 + s] >> 4) | ((w[o + 4 + s] >> 6) << 4)
            scale = dd * np.float32(sc)
            offset = dmin * np.float32(mn)
            for j in range(32):
                out[t, b * 256 + s * 32 + j] = scale * np.float32(q[s * 32 + j]) - offset


@kernel()
def _embed_quant(tokens, w, fmt, row_bytes, out, scale, use_scale):
    n, d = out.shape
    q = np.empty(256, np.int8)
    for t in range(n):
        _embed_row(fmt, w, tokens[t] * row_bytes, d, q, out, t)
        if use_scale:
            for j in range(d):
                out[t, j] = out[t, j] * scale


@kernel()
def _embed_float(tokens, w, kind, out, scale, use_scale):
    """kind 0: w float32 [vocab * d]; 1: uint16 F16 bits; 2: uint16 BF16 bits."""
    n, d = out.shape
    for t in range(n):
        base = tokens[t] * d
        for j in range(d):
            if kind == 0:
                v = np.float32(w[base + j])
            elif kind == 1:
                v = load_f16(w, base + j)
            else:
                v = np.uint32(np.uint32(w[base + j]) << np.uint32(16)).view(np.float32)
            out[t, j] = v * scale if use_scale else v


# -- launchers --------------------------------------------------------------------------

def _f32(a, what: str) -> np.ndarray:
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous):
        raise ValueError(f"{what} must be a C-contiguous float32 array, got "
                         f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
    return a


def _out(out, shape, what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    _f32(out, f"{what}: out")
    if out.shape != tuple(shape) or not out.flags.writeable:
        raise ValueError(f"{what}: out must be a writable float32 {tuple(shape)}, got {out.shape}")
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """x float32 [..., d] normalised over the last axis, times w float32 [d]."""
    _f32(x, "rmsnorm: x")
    _f32(w, "rmsnorm: w")
    if x.ndim < 1 or w.shape != (x.shape[-1],):
        raise ValueError(f"rmsnorm: w has shape {w.shape}, x {x.shape}; w must be [x.shape[-1]]")
    out = _out(out, x.shape, "rmsnorm")
    d = x.shape[-1]
    if x.size:
        _rmsnorm(x.reshape(-1, d), w, np.float32(eps), out.reshape(-1, d))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool = True) -> np.ndarray:
    """Rotate x float32 [n, heads, head_dim] in place (and return it); cos, sin [n, n_rot/2]."""
    _f32(x, "rope: x")
    _f32(cos, "rope: cos")
    _f32(sin, "rope: sin")
    if x.ndim != 3 or cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0] \
            or 2 * cos.shape[1] > x.shape[2]:
        raise ValueError(f"rope: x must be [n, heads, head_dim] and cos, sin [n, <= head_dim/2]; got "
                         f"x {x.shape}, cos {cos.shape}, sin {sin.shape}")
    if not x.flags.writeable:
        raise ValueError("rope: x is rotated in place and must be writable")
    _rope(x, cos, sin, bool(neox))
    return x


def _gated(fn, g, u, out, what):
    _f32(g, f"{what}: g")
    _f32(u, f"{what}: u")
    if g.shape != u.shape:
        raise ValueError(f"{what}: g {g.shape} and u {u.shape} must have the same shape")
    out = _out(out, g.shape, what)
    fn(g.reshape(-1), u.reshape(-1), out.reshape(-1))
    return out


def silu_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(g) * u, elementwise (SwiGLU: Qwen3, Llama)."""
    return _gated(_silu_mul, g, u, out, "silu_mul")


def gelu_tanh_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """gelu_tanh(g) * u, elementwise (GeGLU: Gemma 3)."""
    return _gated(_gelu_tanh_mul, g, u, out, "gelu_tanh_mul")


_EMBED_QUANT = {QType.Q4_0: 0, QType.Q4_1: 1, QType.Q5_0: 2, QType.Q5_1: 3, QType.Q8_0: 4,
                QType.Q4_K: 5, QType.Q5_K: 6, QType.Q6_K: 7}


def embed(tokens, table: CPUWeight, out: np.ndarray | None = None, scale: float | None = None) -> np.ndarray:
    """Rows `tokens` of table [vocab, d] -> float32 [n, d] (then * float32(scale) if given)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
    if not isinstance(table, CPUWeight):
        raise TypeError(f"embed: table must be a CPUWeight, got {type(table).__name__}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.rows):
        bad = tokens[(tokens < 0) | (tokens >= table.rows)][0]
        raise IndexError(f"embed({table.name}): token id {bad} is outside the vocabulary 0..{table.rows - 1}")
    out = _out(out, (tokens.size, table.cols), "embed")
    s = np.float32(1 if scale is None else scale)
    if tokens.size == 0:
        return out
    if table.qtype in _EMBED_QUANT:
        _embed_quant(tokens, table.data, _EMBED_QUANT[table.qtype], table.row_bytes, out, s, scale is not None)
    elif table.qtype == QType.F32:
        _embed_float(tokens, table.data.view(np.float32), 0, out, s, scale is not None)
    else:
        _embed_float(tokens, table.data.view(np.uint16), 1 if table.qtype == QType.F16 else 2, out, s,
                     scale is not None)
    return out
