"""Qwen3 (dense): Llama plus a per-head RMSNorm of q and k, with NeoX RoPE.

What differs from engine/models/llama.py, and nothing else:

    q, k = rmsnorm_per_head(q) * q_norm, rmsnorm_per_head(k) * k_norm    before RoPE
    RoPE rotates pairs (i, i + head_dim/2) (NeoX): Qwen's converter does not permute Wq/Wk
    head_dim is attention.key_length (128 for every size), not n_embd / n_head

The layer forward is Llama's: `rope_write` applies the QK-norm when the layer has one.
"""
from __future__ import annotations

from . import llama
from .llama import GROUPS, Layer, body, head, layer  # noqa: F401  (the forward is Llama's)
from .weights import T

TENSORS = {k: v for k, v in llama.TENSORS.items() if k != "rope_freqs.weight"}
LAYER_TENSORS = dict(llama.LAYER_TENSORS, **{
    "attn_q_norm.weight": T("q_norm", lambda c: (c.head_dim,)),
    "attn_k_norm.weight": T("k_norm", lambda c: (c.head_dim,)),
})
UNSUPPORTED = llama.UNSUPPORTED


def hparams(r, base: dict) -> dict:
    return dict(rope_style="neox", qk_norm=True)
