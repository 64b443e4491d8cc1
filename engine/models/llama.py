"""Llama (Llama 2/3.x, SmolLM2, TinyLlama): the plain pre-norm decoder the others vary.

Per layer (x is the residual stream, [n_tokens, n_embd]):

    h = rmsnorm(x) * attn_norm
    q, k, v = h Wq^T, h Wk^T, h Wv^T                 split into heads of head_dim
    q, k = rope(q, pos), rope(k, pos)                llama.cpp's "normal" RoPE: pairs (2i, 2i+1)
    cache k, v at their positions
    a = softmax(q K^T / sqrt(head_dim), causal) V    each KV head serves n_head / n_head_kv heads
    x = x + a Wo^T
    h = rmsnorm(x) * ffn_norm
    x = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
    logits = (rmsnorm(x) * output_norm) Wout^T       Wout = token_embd when tied

RoPE frequencies: theta_i = pos * base^(-2i/d), divided by `rope_freqs.weight[i]` when the
file has that tensor (Llama 3.1+ "llama3" scaling, baked by the converter), times
freq_scale for linear `rope.scaling` (engine/config.py).

Why "normal" RoPE: HF's Llama rotates (i, i + d/2) like NeoX, but llama.cpp's converter
permutes the rows of Wq and Wk so that the pairs become adjacent; a GGUF therefore needs
the adjacent-pair rotation (Qwen3 and Gemma are converted without the permutation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .weights import T

TENSORS = {
    "token_embd.weight": T("tok_embd", lambda c: (c.vocab_size, c.n_embd)),
    "output_norm.weight": T("output_norm", lambda c: (c.n_embd,)),
    "output.weight": T("output", lambda c: (c.vocab_size, c.n_embd), required=False),
    "rope_freqs.weight": T("rope_freqs", lambda c: (c.head_dim // 2,), required=False),
}
LAYER_TENSORS = {
    "attn_norm.weight": T("attn_norm", lambda c: (c.n_embd,)),
    "attn_q.weight": T("wq", lambda c: (c.q_dim, c.n_embd)),
    "attn_k.weight": T("wk", lambda c: (c.kv_dim, c.n_embd)),
    "attn_v.weight": T("wv", lambda c: (c.kv_dim, c.n_embd)),
    "attn_output.weight": T("wo", lambda c: (c.n_embd, c.q_dim)),
    "ffn_norm.weight": T("ffn_norm", lambda c: (c.n_embd,)),
    "ffn_gate.weight": T("w_gate", lambda c: (c.n_ff, c.n_embd)),
    "ffn_up.weight": T("w_up", lambda c: (c.n_ff, c.n_embd)),
    "ffn_down.weight": T("w_down", lambda c: (c.n_embd, c.n_ff)),
}
# Tensors of Llama variants we do not run: refused by name rather than silently ignored.
UNSUPPORTED = frozenset({
    "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_gate.bias",
    "ffn_up.bias", "ffn_down.bias", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
    "rope_factors_long.weight", "rope_factors_short.weight",
})
# Matrices that read the same input, in the order the forward concatenates their outputs
# (a back-end may store each group as one matrix).
GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))


@dataclass
class Layer:
    attn_norm: Any         # [n_embd]
    wq: Any                # [q_dim, n_embd]
    wk: Any                # [kv_dim, n_embd]
    wv: Any                # [kv_dim, n_embd]
    wo: Any                # [n_embd, q_dim]
    ffn_norm: Any          # [n_embd]
    w_gate: Any            # [n_ff, n_embd]
    w_up: Any              # [n_ff, n_embd]
    w_down: Any            # [n_embd, n_ff]
    q_norm: Any = None     # [head_dim] (Qwen3's QK-norm; Llama has none)
    k_norm: Any = None


def hparams(r, base: dict) -> dict:
    """ModelConfig fields of a Llama file beyond the common ones."""
    return dict(rope_style="norm", rope_freqs="rope_freqs.weight" in r.g.tensors)


def body(ops, w, attn, s, cfg) -> None:
    """Embed s.ids and run every layer on s.x (the chunk's rows)."""
    ops.embed(w.tok_embd, s.ids, s.x, cfg.embd_scale)
    for L, a in zip(w.layers, attn):
        layer(ops, L, a, s)


def layer(ops, L: Layer, a, s) -> None:
    ops.norm(s.x, L.attn_norm, out=s.h)                  # h = rmsnorm(x) * attn_norm
    ops.linear(s.h, (L.wq, L.wk, L.wv), out=s.qkv)       # [q | k | v] = h [Wq | Wk | Wv]^T
    ops.rope_write(s.qkv, a, q_out=s.q)                  # q, k = rope(q, k); cache k, v
    ops.attention(s.q, a, out=s.attn)                    # softmax(q K^T * scale, causal) V
    ops.linear(s.attn, L.wo, out=s.x, add=True)          # x += attn Wo^T
    ops.norm(s.x, L.ffn_norm, out=s.h)                   # h = rmsnorm(x) * ffn_norm
    ops.gated(s.h, (L.w_gate, L.w_up), out=s.ff, act="silu")   # silu(h Wg^T) * (h Wu^T)
    ops.linear(s.ff, L.w_down, out=s.x, add=True)        # x += ff Wdown^T


def head(ops, w, x, logits, cfg) -> None:
    ops.head(x, w.output_norm, w.output, logits, cfg.logit_softcap)
