"""The numpy reference of every building block the architectures use, and `ReferenceOps`.

The building blocks are the math, in float32 or float64 (whatever the inputs are):

    rmsnorm(x, w, eps)            x / sqrt(mean(x^2) + eps) * w
    rope_neox(x, cos, sin)        rotate pairs (i, i + d/2)        Qwen3, Gemma 3
    rope_norm(x, cos, sin)        rotate pairs (2i, 2i + 1)        Llama (llama.cpp's "normal" RoPE)
    rope_tables(d, pos, base,     theta_i = pos * scale * base^(-2i/d) / factor_i
                scale, factors)
    attention(q, k, v, start,     softmax(q k^T * scale, causal, optional sliding window) v, GQA
              scale, window)
    silu, gelu_tanh               the FFN activations (gelu_tanh as ggml's tanh approximation)

Every GPU kernel and the fast CPU kernels are tested against these.

`ReferenceOps` runs an architecture's forward (engine/models/<arch>.py) with them on
dequantized float weights and a host KV pool: it is the CPU back-end's slow, exact path
and the oracle the fast paths are compared with. Its contract is the op vocabulary of
engine/models/ops.py; it allocates freely (numpy temporaries) and is not fast.
"""
from __future__ import annotations

import numpy as np

SQRT_2_OVER_PI = 0.7978845608028654
GELU_COEF_A = 0.044715


# -- building blocks ----------------------------------------------------------------------
def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x[..., d] / sqrt(mean(x^2) + eps) * w[d]"""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def rope_tables(head_dim: int, positions: np.ndarray, base: float, dtype=np.float32,
                scale: float = 1.0, factors: np.ndarray | None = None):
    """cos, sin [n, head_dim/2]: theta_i = pos * scale * base^(-2i/head_dim) / factors[i].

    scale is llama.cpp's freq_scale (1 / the linear rope-scaling factor); factors are the
    per-frequency divisors of a `rope_freqs` tensor (llama 3.1+). Computed in float64."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    angles = positions.astype(np.float64)[:, None] * (scale * inv_freq)[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, head_dim]: rotate pairs (i, i + head_dim/2) by the position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, head_dim]: rotate adjacent pairs (2i, 2i + 1) (llama.cpp's normal RoPE)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


ROPE = {"neox": rope_neox, "norm": rope_norm}


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))): ggml's gelu (and Gemma's)."""
    return 0.5 * x * (1 + np.tanh(SQRT_2_OVER_PI * x * (1 + GELU_COEF_A * x * x)))


ACTIVATIONS = {"silu": silu, "gelu": gelu_tanh}


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float | None = None,
              window: int | None = None, key_start: int = 0) -> np.ndarray:
    """Causal GQA attention.

    q [n, n_head, hd] for positions start .. start+n-1; k, v [m, n_kv, hd] for positions
    key_start .. key_start+m-1 (key_start + m == start + n). scale defaults to
    1/sqrt(hd). With a window W, key p0 is masked for query p1 when p1 - p0 >= W
    (llama.cpp's standard sliding window). Returns [n, n_head * hd].
    """
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    total = k.shape[0]
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)         # [kv, group, n, hd]
    kt = k.transpose(1, 2, 0)                                        # [kv, hd, total]
    scores = (qg @ kt[:, None]) * np.asarray(scale, q.dtype)         # [kv, group, n, total]
    query_pos = start + np.arange(n)
    key_pos = key_start + np.arange(total)
    mask = key_pos[None, :] > query_pos[:, None]                     # [n, total]
    if window is not None:
        mask |= (query_pos[:, None] - key_pos[None, :]) >= window
    scores = np.where(mask, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v.transpose(1, 0, 2)[:, None]                          # [kv, group, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, n_head * hd)


# -- the op vocabulary on numpy ------------------------------------------------------------
class ReferenceOps:
    """engine/models/ops.py's ops on numpy arrays: float weights (already dequantized, or
    any object whose `.T` is the float matrix), a host KV pool, positions start..start+n-1.

    Buffers are plain numpy arrays [n, width]; `out=` arguments are written in place so the
    forward reads the same on every back-end."""

    def __init__(self, cfg, kv, start: int, n: int, dtype=np.float32):
        self.cfg, self.kv, self.start, self.n, self.dtype = cfg, kv, start, n, dtype
        self._rope = {}                  # (base, scale) -> (cos, sin) for this call's positions

    def embed(self, table, ids, out, scale: float | None = None) -> None:
        rows = table[np.asarray(ids)]
        out[...] = rows if scale is None else rows * np.asarray(scale, rows.dtype)

    def norm(self, x, w, out) -> None:
        out[...] = rmsnorm(x, w, self.cfg.rms_eps)

    def linear(self, x, w, out, add: bool = False) -> None:
        """out (+)= x @ W^T; w a matrix or a tuple of matrices whose outputs are concatenated."""
        ws = w if isinstance(w, tuple) else (w,)
        y = np.concatenate([x @ m.T for m in ws], axis=-1) if len(ws) > 1 else x @ ws[0].T
        if add:
            out += y
        else:
            out[...] = y

    def gated(self, x, w, out, act: str) -> None:
        """out = act(x Wg^T) * (x Wu^T); w = (Wg, Wu)."""
        wg, wu = w
        out[...] = ACTIVATIONS[act](x @ wg.T) * (x @ wu.T)

    def post_norm_add(self, x, y, w) -> None:
        """x += rmsnorm(y) * w (Gemma's post-attention / post-FFN norms)."""
        x += rmsnorm(y, w, self.cfg.rms_eps)

    def _tables(self, a):
        key = (a.rope_base, a.rope_scale)
        if key not in self._rope:
            pos = np.arange(self.start, self.start + self.n)
            self._rope[key] = rope_tables(self.cfg.rope_dim, pos, a.rope_base, self.dtype,
                                          a.rope_scale, a.rope_factors)
        return self._rope[key]

    def rope_write(self, qkv, a, q_out) -> None:
        """Split qkv into heads, QK-norm (when the layer has one), RoPE; K/V into the pool."""
        cfg, n, hd = self.cfg, self.n, self.cfg.head_dim
        q = qkv[:, :cfg.q_dim].reshape(n, cfg.n_head, hd)
        k = qkv[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(n, cfg.n_head_kv, hd)
        v = qkv[:, cfg.q_dim + cfg.kv_dim:].reshape(n, cfg.n_head_kv, hd)
        if a.q_norm is not None:
            q = rmsnorm(q, a.q_norm, cfg.rms_eps)
            k = rmsnorm(k, a.k_norm, cfg.rms_eps)
        cos, sin = self._tables(a)
        rope = ROPE[cfg.rope_style]
        q_out[...] = rope(q, cos, sin).reshape(n, cfg.q_dim)
        self.kv.write(a.index, self.start, rope(k, cos, sin), v)

    def attention(self, q, a, out) -> None:
        cfg, n = self.cfg, self.n
        end = self.start + n
        key_start = 0 if a.window is None else max(0, self.start - a.window + 1)
        k, v = self.kv.read(a.index, end, self.dtype, start=key_start)
        out[...] = attention(q.reshape(n, cfg.n_head, cfg.head_dim), k, v, self.start,
                             a.scale, a.window, key_start)

    def head(self, x, norm_w, w, logits, softcap: float | None = None) -> None:
        """logits = (rmsnorm(x) * norm_w) @ W^T for the rows of x, soft-capped when set."""
        y = rmsnorm(x, norm_w, self.cfg.rms_eps) @ w.T
        if softcap:
            y = np.tanh(y / softcap) * softcap
        logits[...] = y
