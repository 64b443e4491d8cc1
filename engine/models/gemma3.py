"""Gemma 3 (text): Llama's skeleton with five differences, each a line of the forward.

    x = embed(tokens) * sqrt(n_embd)                          1. scaled embeddings
    per layer:
      h = rmsnorm(x) * attn_norm
      q, k, v = h Wq^T, h Wk^T, h Wv^T
      q, k = rmsnorm_per_head(q) * q_norm, (k) * k_norm       (QK-norm, as Qwen3)
      q, k = rope_neox(q, k, pos, base_of_layer)              2. local layers: base 10000
      a = softmax(q K^T / sqrt(head_dim), causal, window) V   3. 5 of 6 layers: sliding window
      x = x + rmsnorm(a Wo^T) * post_attention_norm           4. post-norms around both blocks
      h = rmsnorm(x) * ffn_norm
      x = x + rmsnorm((gelu(h Wg^T) * (h Wu^T)) Wd^T) * post_ffw_norm   5. GeGLU (tanh gelu)
    logits = (rmsnorm(x) * output_norm) token_embd^T         (tied; soft-capped if the file says)

Conventions checked against llama.cpp (src/models/gemma3.cpp) and its logits for the
270M file (tests/test_real_models.py):
- Norm weights are stored with Gemma's "+1" already added by the converter: rmsnorm(x) * w
  with w as stored (HF computes x * (1 + w_hf)).
- Local layers are those with il % pattern < pattern - 1 (pattern 6: layers 5, 11, 17, ...
  are global), unless the file gives the pattern as a per-layer array. A key at position
  p0 is masked for a query at p1 when p1 - p0 >= window.
- Global layers use rope.freq_base (1e6) and rope.scaling (linear, 8 for 4B+); local
  layers rope.freq_base_swa (default 10000) without scaling.
- The q k^T scale is 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(n_embd/n_head).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..gguf_file import GGUFError
from .llama import GROUPS  # noqa: F401  (Wq|Wk|Wv and Wgate|Wup read the same input)
from .weights import T

TENSORS = {
    "token_embd.weight": T("tok_embd", lambda c: (c.vocab_size, c.n_embd)),
    "output_norm.weight": T("output_norm", lambda c: (c.n_embd,)),
    "output.weight": T("output", lambda c: (c.vocab_size, c.n_embd), required=False),
}
LAYER_TENSORS = {
    "attn_norm.weight": T("attn_norm", lambda c: (c.n_embd,)),
    "attn_q.weight": T("wq", lambda c: (c.q_dim, c.n_embd)),
    "attn_k.weight": T("wk", lambda c: (c.kv_dim, c.n_embd)),
    "attn_v.weight": T("wv", lambda c: (c.kv_dim, c.n_embd)),
    "attn_q_norm.weight": T("q_norm", lambda c: (c.head_dim,)),
    "attn_k_norm.weight": T("k_norm", lambda c: (c.head_dim,)),
    "attn_output.weight": T("wo", lambda c: (c.n_embd, c.q_dim)),
    "post_attention_norm.weight": T("post_attn_norm", lambda c: (c.n_embd,)),
    "ffn_norm.weight": T("ffn_norm", lambda c: (c.n_embd,)),
    "ffn_gate.weight": T("w_gate", lambda c: (c.n_ff, c.n_embd)),
    "ffn_up.weight": T("w_up", lambda c: (c.n_ff, c.n_embd)),
    "ffn_down.weight": T("w_down", lambda c: (c.n_embd, c.n_ff)),
    "post_ffw_norm.weight": T("post_ffn_norm", lambda c: (c.n_embd,)),
}
UNSUPPORTED = frozenset({"dense_2_out.weight", "dense_3_out.weight"})   # EmbeddingGemma's heads


@dataclass
class Layer:
    attn_norm: Any         # [n_embd]
    wq: Any                # [q_dim, n_embd]
    wk: Any                # [kv_dim, n_embd]
    wv: Any                # [kv_dim, n_embd]
    q_norm: Any            # [head_dim]
    k_norm: Any            # [head_dim]
    wo: Any                # [n_embd, q_dim]
    post_attn_norm: Any    # [n_embd]
    ffn_norm: Any          # [n_embd]
    w_gate: Any            # [n_ff, n_embd]
    w_up: Any              # [n_ff, n_embd]
    w_down: Any            # [n_embd, n_ff]
    post_ffn_norm: Any     # [n_embd]


def _local_layers(r, n_layers: int) -> list[bool]:
    key = f"{r.arch}.attention.sliding_window_pattern"
    value = r.g.get(key, 6)
    if isinstance(value, list):
        if len(value) != n_layers or not all(isinstance(v, bool) for v in value):
            raise GGUFError(f"{r.g.path}: metadata '{key}' must be {n_layers} booleans (one per layer)")
        return list(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFError(f"{r.g.path}: metadata '{key}' = {value!r} is not a layer pattern")
    return [value == 0 or i % value < value - 1 for i in range(n_layers)]


def hparams(r, base: dict) -> dict:
    n_layers = base["n_layers"]
    window = r.opt("attention.sliding_window", int)
    local = _local_layers(r, n_layers) if window else [False] * n_layers
    if base["n_layers"] == 62:               # Gemma 3 27B: query_pre_attn_scalar = n_embd / n_head
        attn_scale = 1.0 / math.sqrt(base["n_embd"] / base["n_head"])
    else:
        attn_scale = 1.0 / math.sqrt(base["head_dim"])
    softcap = r.opt("final_logit_softcapping")
    return dict(
        rope_style="neox", qk_norm=True, ffn_act="gelu", post_norms=True,
        embd_scale=math.sqrt(base["n_embd"]), attn_scale=attn_scale,
        logit_softcap=softcap or None,
        layer_windows=tuple(window if is_local else None for is_local in local),
        rope_base_local=r.num("rope.freq_base_swa", float, 10000.0),
    )


def body(ops, w, attn, s, cfg) -> None:
    ops.embed(w.tok_embd, s.ids, s.x, cfg.embd_scale)          # x = embed * sqrt(n_embd)
    for L, a in zip(w.layers, attn):
        layer(ops, L, a, s)


def layer(ops, L: Layer, a, s) -> None:
    ops.norm(s.x, L.attn_norm, out=s.h)                        # h = rmsnorm(x) * attn_norm
    ops.linear(s.h, (L.wq, L.wk, L.wv), out=s.qkv)
    ops.rope_write(s.qkv, a, q_out=s.q)                        # QK-norm, RoPE of the layer's base
    ops.attention(s.q, a, out=s.attn)                          # windowed on local layers
    ops.linear(s.attn, L.wo, out=s.y)
    ops.post_norm_add(s.x, s.y, L.post_attn_norm)              # x += rmsnorm(y) * post_attn_norm
    ops.norm(s.x, L.ffn_norm, out=s.h)
    ops.gated(s.h, (L.w_gate, L.w_up), out=s.ff, act="gelu")   # gelu(h Wg^T) * (h Wu^T)
    ops.linear(s.ff, L.w_down, out=s.y)
    ops.post_norm_add(s.x, s.y, L.post_ffn_norm)               # x += rmsnorm(y) * post_ffn_norm


def head(ops, w, x, logits, cfg) -> None:
    ops.head(x, w.output_norm, w.output, logits, cfg.logit_softcap)
