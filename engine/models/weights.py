"""Tensor tables: which GGUF tensors an architecture needs, checked, and bound to typed weights.

An architecture declares its tensors as two tables (global and per layer) of

    "attn_q.weight": T("wq", lambda c: (c.q_dim, c.n_embd))        # field, numpy shape
    "ffn_norm.weight": T("ffn_norm", lambda c: (c.n_embd,))
    "output.weight": T("output", ..., required=False)                # tied when absent

`check_tensors` validates presence, shape and type of every one before anything is loaded
(a clear GGUFError naming the tensor and what the metadata implies), and refuses tensors
the architecture knows but we do not run (biases, say) instead of ignoring them.
`bind_weights` builds the typed weights with a back-end's `bind(TensorInfo) -> object`:
float arrays for the reference, quantized views for the fast CPU path, CUDA views.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable

from genie_rt.quant.formats import SUPPORTED as SUPPORTED_QTYPES

from ..gguf_file import GGUFError, GGUFFile, TensorInfo, _q

_LAYER_TENSOR = re.compile(r"blk\.(0|[1-9][0-9]{0,7})\.(.+)", re.ASCII)


@dataclass(frozen=True)
class T:
    field: str                                  # attribute of the typed weights
    shape: Callable                             # ModelConfig -> numpy shape
    required: bool = True


@dataclass
class Weights:
    """A model's weights on one back-end; `layers` are the architecture's `Layer` objects."""
    tok_embd: Any            # [vocab, n_embd]
    output_norm: Any         # [n_embd]
    output: Any              # [vocab, n_embd] (tok_embd itself when tied)
    layers: list
    rope_freqs: Any = None   # [head_dim/2] frequency divisors (Llama 3.1+) or None


def _table(spec, cfg) -> dict[str, tuple[T, int | None]]:
    """GGUF name -> (T, layer index or None) for every tensor the model may have."""
    table = {name: (t, None) for name, t in spec.TENSORS.items()}
    for i in range(cfg.n_layers):
        for suffix, t in spec.LAYER_TENSORS.items():
            table[f"blk.{i}.{suffix}"] = (t, i)
    return table


def check_tensors(g: GGUFFile, cfg, spec=None) -> dict[str, TensorInfo]:
    """Validate presence, shape and type of every tensor; return the present ones by name."""
    if spec is None:
        from . import architecture
        spec = architecture(cfg.arch, g.path)
    found = {}
    for name, (t, _) in _table(spec, cfg).items():
        info = g.tensors.get(name)
        if info is None:
            if t.required:
                raise GGUFError(f"{g.path}: tensor '{name}' is missing; the file is incomplete "
                                f"or not a {cfg.arch} model")
            continue
        shape = t.shape(cfg)
        if info.shape != shape:
            raise GGUFError(f"{g.path}: tensor '{name}' has shape {info.shape}, expected {shape} "
                            f"from the metadata (n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
                            f"n_head_kv={cfg.n_head_kv}, head_dim={cfg.head_dim}, n_ff={cfg.n_ff})")
        if info.qtype not in SUPPORTED_QTYPES:
            raise GGUFError(f"{g.path}: tensor '{name}' has type {info.qtype.name}, which is not supported "
                            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_QTYPES))}); "
                            "re-quantize the model, e.g. to Q4_K_M")
        found[name] = info
    extra, refused = [], []
    for n in g.tensors:
        m = _LAYER_TENSOR.match(n)
        if m and int(m.group(1)) >= cfg.n_layers:
            extra.append(n)
        elif (m.group(2) if m else n) in getattr(spec, "UNSUPPORTED", ()):
            refused.append(n)
    if extra:                # llama.cpp refuses a tensor count that does not match too
        extra.sort()
        raise GGUFError(f"{g.path}: block_count says {cfg.n_layers} layers but the file has tensors of "
                        f"layer {_LAYER_TENSOR.match(extra[0]).group(1)} ({_q(extra[0])}, {len(extra)} "
                        "such tensors); the metadata or the tensor table is wrong")
    if refused:
        raise GGUFError(f"{g.path}: tensor {_q(sorted(refused)[0])} ({len(refused)} such tensors) is "
                        f"part of a {cfg.arch} variant this runtime does not implement (biases or other "
                        "extra weights); it would be wrong to ignore it")
    return found


def bind_weights(g: GGUFFile, cfg, bind: Callable[[TensorInfo], Any], spec=None,
                 tensors: dict[str, TensorInfo] | None = None) -> Weights:
    """Typed weights: every present tensor passed through `bind`, placed in its field."""
    if spec is None:
        from . import architecture
        spec = architecture(cfg.arch, g.path)
    tensors = check_tensors(g, cfg, spec) if tensors is None else tensors
    layer_fields = {f.name for f in fields(spec.Layer)}
    per_layer: list[dict] = [{} for _ in range(cfg.n_layers)]
    glob: dict[str, Any] = {}
    for name, (t, i) in _table(spec, cfg).items():
        if name not in tensors:
            continue
        value = bind(tensors[name])
        if i is None:
            glob[t.field] = value
        else:
            assert t.field in layer_fields, f"{spec.__name__}: Layer has no field {t.field}"
            per_layer[i][t.field] = value
    layers = [spec.Layer(**kw) for kw in per_layer]
    out = glob.get("output", glob["tok_embd"])
    return Weights(glob["tok_embd"], glob["output_norm"], out, layers, glob.get("rope_freqs"))
