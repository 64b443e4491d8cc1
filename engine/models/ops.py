"""The contract between an architecture's forward and a back-end: the ops and the buffers.

A forward (engine/models/<arch>.py `body` and `head`) is written once against `Ops`; the
back-ends implement it:

- `ReferenceOps` (engine/models/reference.py): numpy on float weights, the oracle;
- the CPU back-end's fast ops (quantized weights, Numba kernels);
- the CUDA back-end's recording ops (engine/cuda_ops.py): each op launches kernels on the
  runtime's stream, so running the forward once inside a capture records a CUDA graph.
  Decode (one row) and prefill (a chunk of n rows) are two `Ops` objects over the same
  forward; positions come from the device state, not from Python.

Buffers are the back-end's (numpy arrays, or device views of the arena) with shape
[rows, width], named by `Scratch` (llama2.c's RunState): the forward writes into them with
`out=`, so nothing is allocated while it runs on the GPU. An op may read its inputs in a
form prepared by an earlier op (the CUDA decode norm also writes the 8-bit activations its
consumer GEMV reads): that is the back-end's business, invisible here.

`AttnLayer` describes one layer's attention for `rope_write` and `attention`; `a.index`
names its KV-pool layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class AttnLayer:
    """One layer's attention: what rope_write and attention need besides the tensors."""
    index: int                       # layer index = KV-pool layer
    q_norm: Any                      # per-head RMSNorm weights [head_dim] (None: no QK-norm)
    k_norm: Any
    window: int | None               # sliding window (None: global)
    rope_base: float
    rope_scale: float                # llama.cpp freq_scale
    rope_factors: Any                # rope_freqs divisors [head_dim/2] or None
    scale: float                     # q k^T scale


def attn_layers(cfg, layers, rope_factors=None) -> list[AttnLayer]:
    """The AttnLayer of every layer from the config (window, RoPE base) and its QK-norms."""
    out = []
    for i, L in enumerate(layers):
        window = cfg.window(i)
        out.append(AttnLayer(
            index=i, q_norm=getattr(L, "q_norm", None), k_norm=getattr(L, "k_norm", None),
            window=window,
            rope_base=cfg.rope_base if window is None else cfg.rope_base_local,
            rope_scale=cfg.rope_scale if window is None else 1.0,
            rope_factors=rope_factors if window is None else None,
            scale=cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5))
    return out


def scratch_widths(cfg) -> dict[str, int]:
    """Every activation buffer a forward uses, name -> width (rows: 1 for decode, the chunk
    for prefill). One table for all architectures: the union of what they write."""
    widths = {
        "x": cfg.n_embd,                        # residual stream
        "h": cfg.n_embd,                        # normed input of a matrix product
        "qkv": cfg.q_dim + 2 * cfg.kv_dim,      # [q | k | v] before RoPE
        "q": cfg.q_dim,                         # q after QK-norm and RoPE
        "attn": cfg.q_dim,                      # attention output (input of Wo)
        "ff": cfg.n_ff,                         # gated FFN activation (input of Wdown)
    }
    if cfg.post_norms:
        widths["y"] = cfg.n_embd                # a block's output before its post-norm
    return widths


class Ops(Protocol):
    """The op vocabulary. Shapes: x [rows, n_embd]; every out= is written, not allocated."""

    def embed(self, table, ids, out, scale: float | None = None) -> None:
        """out = table[ids] (* scale)."""

    def norm(self, x, w, out) -> None:
        """out = rmsnorm(x) * w."""

    def linear(self, x, w, out, add: bool = False) -> None:
        """out (+)= x W^T; w a weight, or a tuple of weights whose outputs are concatenated."""

    def gated(self, x, w, out, act: str) -> None:
        """out = act(x Wg^T) * (x Wu^T) for w = (Wg, Wu); act "silu" or "gelu" (tanh)."""

    def post_norm_add(self, x, y, w) -> None:
        """x += rmsnorm(y) * w."""

    def rope_write(self, qkv, a: AttnLayer, q_out) -> None:
        """Split [q | k | v], QK-norm when a has one, RoPE; write k, v to the KV pool at the
        chunk's positions; q_out = the rotated q."""

    def attention(self, q, a: AttnLayer, out) -> None:
        """Causal (and windowed) GQA attention of q over the pool's positions up to the chunk's."""

    def head(self, x, norm_w, w, logits, softcap: float | None = None) -> None:
        """logits = rmsnorm(x) * norm_w @ W^T (soft-capped) for the rows of x."""
