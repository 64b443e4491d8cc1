"""Qwen3 (dense): the tensor table and the numpy reference forward pass.

The math, per layer (x is the residual stream, [n_tokens, n_embd]):

    h = rmsnorm(x) * attn_norm
    q, k, v = h @ Wq^T, h @ Wk^T, h @ Wv^T            split into heads of head_dim
    q, k = rmsnorm_per_head(q) * q_norm, rmsnorm_per_head(k) * k_norm   (Qwen3's QK-norm)
    q, k = rope_neox(q, pos), rope_neox(k, pos)          pairs (i, i + head_dim/2)
    cache k, v at their positions
    a = softmax(q K^T / sqrt(head_dim), causal) V        each KV head serves n_group query heads
    x = x + a @ Wo^T
    h = rmsnorm(x) * ffn_norm
    x = x + (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
    logits = (rmsnorm(x) * output_norm) @ Wout^T         Wout = token_embd when tied

This is the reference every GPU kernel and the CPU back-end are checked against. It
dequantizes every weight once at load (float32, or float64 for the strictest tests).
It does not quantize activations the way llama.cpp's CPU matmul does, so logits
differ from llama.cpp's by a few 1e-2 at most (see tests/test_qwen3_forward.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genie_rt.quant.formats import SUPPORTED as SUPPORTED_QTYPES
from genie_rt.quant.formats import dequantize

from .config import _LAYER_TENSOR, ModelConfig
from .gguf_file import GGUFError, GGUFFile, TensorInfo, _q

# GGUF tensor name -> (attribute, shape as a function of the config), numpy (rows, cols) order.
GLOBAL_TENSORS = {
    "token_embd.weight": ("tok_embd", lambda c: (c.vocab_size, c.n_embd)),
    "output_norm.weight": ("output_norm", lambda c: (c.n_embd,)),
    "output.weight": ("output", lambda c: (c.vocab_size, c.n_embd)),  # absent when tied
}
LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", lambda c: (c.n_embd,)),
    "attn_q.weight": ("wq", lambda c: (c.q_dim, c.n_embd)),
    "attn_k.weight": ("wk", lambda c: (c.kv_dim, c.n_embd)),
    "attn_v.weight": ("wv", lambda c: (c.kv_dim, c.n_embd)),
    "attn_q_norm.weight": ("q_norm", lambda c: (c.head_dim,)),
    "attn_k_norm.weight": ("k_norm", lambda c: (c.head_dim,)),
    "attn_output.weight": ("wo", lambda c: (c.n_embd, c.q_dim)),
    "ffn_norm.weight": ("ffn_norm", lambda c: (c.n_embd,)),
    "ffn_gate.weight": ("w_gate", lambda c: (c.n_ff, c.n_embd)),
    "ffn_up.weight": ("w_up", lambda c: (c.n_ff, c.n_embd)),
    "ffn_down.weight": ("w_down", lambda c: (c.n_embd, c.n_ff)),
}


def tensor_table(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by GGUF name, with its expected numpy shape."""
    table = {name: shape(cfg) for name, (_, shape) in GLOBAL_TENSORS.items()}
    if cfg.tied_embeddings:
        del table["output.weight"]
    for i in range(cfg.n_layers):
        for suffix, (_, shape) in LAYER_TENSORS.items():
            table[f"blk.{i}.{suffix}"] = shape(cfg)
    return table


def check_tensors(g: GGUFFile, cfg: ModelConfig) -> dict[str, TensorInfo]:
    """Validate presence, shape and type of every tensor; return them by name."""
    found = {}
    for name, shape in tensor_table(cfg).items():
        t = g.tensors.get(name)
        if t is None:
            raise GGUFError(f"{g.path}: tensor '{name}' is missing; the file is incomplete "
                            f"or not a {cfg.arch} model")
        if t.shape != shape:
            raise GGUFError(f"{g.path}: tensor '{name}' has shape {t.shape}, expected {shape} "
                            f"from the metadata (n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
                            f"n_head_kv={cfg.n_head_kv}, head_dim={cfg.head_dim}, n_ff={cfg.n_ff})")
        if t.qtype not in SUPPORTED_QTYPES:
            raise GGUFError(f"{g.path}: tensor '{name}' has type {t.qtype.name}, which is not supported "
                            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_QTYPES))}); "
                            "re-quantize the model, e.g. to Q4_K_M")
        found[name] = t
    extra = sorted(n for n in g.tensors if (m := _LAYER_TENSOR.match(n)) and int(m.group(1)) >= cfg.n_layers)
    if extra:                # llama.cpp refuses a tensor count that does not match too
        raise GGUFError(f"{g.path}: block_count says {cfg.n_layers} layers but the file has tensors of "
                        f"layer {_LAYER_TENSOR.match(extra[0]).group(1)} ({_q(extra[0])}, {len(extra)} "
                        "such tensors); the metadata or the tensor table is wrong")
    return found


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [n_embd]
    wq: np.ndarray         # [q_dim, n_embd]
    wk: np.ndarray         # [kv_dim, n_embd]
    wv: np.ndarray         # [kv_dim, n_embd]
    q_norm: np.ndarray     # [head_dim]
    k_norm: np.ndarray     # [head_dim]
    wo: np.ndarray         # [n_embd, q_dim]
    ffn_norm: np.ndarray   # [n_embd]
    w_gate: np.ndarray     # [n_ff, n_embd]
    w_up: np.ndarray       # [n_ff, n_embd]
    w_down: np.ndarray     # [n_embd, n_ff]


@dataclass
class Qwen3Weights:
    tok_embd: np.ndarray     # [vocab, n_embd]
    output_norm: np.ndarray  # [n_embd]
    output: np.ndarray       # [vocab, n_embd] (the same array as tok_embd when tied)
    layers: list[LayerWeights]

    @classmethod
    def load(cls, g: GGUFFile, cfg: ModelConfig, dtype=np.float32) -> "Qwen3Weights":
        tensors = check_tensors(g, cfg)

        def deq(name: str) -> np.ndarray:
            t = tensors[name]
            return dequantize(t.data, t.qtype, t.shape).astype(dtype, copy=False)

        layers = []
        for i in range(cfg.n_layers):
            layers.append(LayerWeights(**{attr: deq(f"blk.{i}.{suffix}")
                                          for suffix, (attr, _) in LAYER_TENSORS.items()}))
        tok = deq("token_embd.weight")
        out = tok if cfg.tied_embeddings else deq("output.weight")
        return cls(tok, deq("output_norm.weight"), out, layers)


# -- building blocks ---------------------------------------------------------------

def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x[..., d] / sqrt(mean(x^2) + eps) * w[d]"""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def rope_tables(head_dim: int, positions: np.ndarray, base: float, dtype=np.float32):
    """cos, sin [n, head_dim/2] for NeoX RoPE: theta_i = pos * base^(-2i/head_dim)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, head_dim]: rotate pairs (i, i + head_dim/2) by the position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal GQA attention.

    q [n, n_head, hd] for positions start .. start+n-1; k, v [start+n, n_kv, hd].
    Returns [n, n_head * hd].
    """
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    total = k.shape[0]
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)         # [kv, group, n, hd]
    kt = k.transpose(1, 2, 0)                                        # [kv, hd, total]
    scores = (qg @ kt[:, None]) / np.sqrt(hd).astype(q.dtype)        # [kv, group, n, total]
    query_pos = start + np.arange(n)
    mask = np.arange(total)[None, :] > query_pos[:, None]            # [n, total]
    scores = np.where(mask, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v.transpose(1, 0, 2)[:, None]                          # [kv, group, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, n_head * hd)


def forward(w: Qwen3Weights, cfg: ModelConfig, tokens: np.ndarray, start: int, kv,
            all_logits: bool = False) -> np.ndarray:
    """Run `tokens` at positions start .. start+n-1, writing their K/V into `kv`.

    kv: an object with write(layer, start, k, v) and read(layer, end) (kvcache.pool.HostKVPool).
    Returns logits [vocab] for the last token, or [n, vocab] with all_logits.
    """
    dt = w.tok_embd.dtype
    n = len(tokens)
    hd, eps = cfg.head_dim, cfg.rms_eps
    cos, sin = rope_tables(hd, np.arange(start, start + n), cfg.rope_base, dt)
    x = w.tok_embd[np.asarray(tokens)]                               # [n, n_embd]
    for i, L in enumerate(w.layers):
        h = rmsnorm(x, L.attn_norm, eps)
        q = (h @ L.wq.T).reshape(n, cfg.n_head, hd)
        k = (h @ L.wk.T).reshape(n, cfg.n_head_kv, hd)
        v = (h @ L.wv.T).reshape(n, cfg.n_head_kv, hd)
        q = rope_neox(rmsnorm(q, L.q_norm, eps), cos, sin)
        k = rope_neox(rmsnorm(k, L.k_norm, eps), cos, sin)
        kv.write(i, start, k, v)
        k_all, v_all = kv.read(i, start + n, dt)
        x = x + attention(q, k_all, v_all, start) @ L.wo.T
        h = rmsnorm(x, L.ffn_norm, eps)
        x = x + (silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
    if not all_logits:
        x = x[-1:]
    logits = rmsnorm(x, w.output_norm, eps) @ w.output.T
    return logits if all_logits else logits[0]
