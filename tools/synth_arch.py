#!/usr/bin/env python3
"""Write a synthetic GGUF of any supported architecture: chosen shapes and tensor types,
random weights, the tokenizer of another file.

For tests (tiny Llama / Gemma 3 / Qwen3 files of awkward shapes and mixed types, for the
simulator and the GPU) and for benchmarks at the shapes of real models the GPU machine
cannot download (Gemma 3 270M, SmolLM2 135M): speed depends on shapes and types, not on
the numbers. `tools/synth_gguf.py` remains the writer of Qwen3 files with llama.cpp's exact
Q4_K_M layout (its files are checked against llama-quantize's).

Weights: normal, std 0.02 (norm weights ~1), quantized by genie_rt.quant.formats.quantize,
so a file is numpy-speed to write (the 262,144 x 640 Q8_0 table of Gemma takes seconds).
The vocabulary and tokenizer metadata are copied from `--tokenizer FILE` (default: the
Qwen3 micro fixture, 4,122 tokens), padded with "[PAD<id>]" tokens up to --vocab.

    python tools/synth_arch.py --preset gemma3-270m -o /tmp/gemma-shape.gguf
    python tools/synth_arch.py --preset smollm2-135m -o /tmp/smollm-shape.gguf
    python tools/synth_arch.py --arch llama --layers 2 --hidden 192 --heads 3 --kv-heads 1 \
        --head-dim 64 --ffn 320 --types Q4_1 -o /tmp/tiny-llama.gguf
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MICRO = ROOT / "tests" / "fixtures" / "qwen3-micro-q4km.gguf"

# Real models' shapes and per-role types (read off the published Q4_K_M / Q4_1 files).
PRESETS = {
    "gemma3-270m": dict(arch="gemma3", layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256,
                        ffn=2048, vocab=262144, window=512, rope_base=1e6,
                        types=dict(default="Q5_0", wo="Q4_K", w_down="Q4_K", wv="Q8_0",
                                   tok_embd="Q8_0")),
    "smollm2-135m": dict(arch="llama", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                         ffn=1536, vocab=49152, rope_base=1e5, types=dict(default="Q4_1", tok_embd="Q8_0")),
    "gemma3-tiny": dict(arch="gemma3", layers=3, hidden=128, heads=2, kv_heads=1, head_dim=64,
                        ffn=256, vocab=0, window=8, pattern=3, rope_base=1e6,
                        types=dict(default="Q8_0", wo="Q4_0", w_down="Q5_0", tok_embd="Q8_0")),
    "llama-tiny": dict(arch="llama", layers=2, hidden=192, heads=3, kv_heads=1, head_dim=64,
                       ffn=320, vocab=0, rope_base=1e4, types=dict(default="Q4_1", tok_embd="Q8_0")),
}

# GGUF suffix -> role name used in `types` (the typed-weights field)
ROLES = {
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_output.weight": "wo",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}


def _tensors(arch: str, s: dict) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """(name, numpy shape, role) in llama.cpp's order: token_embd, layers, output_norm."""
    E, F, hd = s["hidden"], s["ffn"], s["head_dim"]
    Q, KV = s["heads"] * hd, s["kv_heads"] * hd
    out = [("token_embd.weight", (s["vocab"], E), "tok_embd")]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        layer = [("attn_norm.weight", (E,)), ("attn_q.weight", (Q, E)), ("attn_k.weight", (KV, E)),
                 ("attn_v.weight", (KV, E)), ("attn_output.weight", (E, Q))]
        if arch in ("qwen3", "gemma3"):
            layer[1:1] = [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,))]
        if arch == "gemma3":
            layer.append(("post_attention_norm.weight", (E,)))
        layer += [("ffn_norm.weight", (E,)), ("ffn_gate.weight", (F, E)), ("ffn_up.weight", (F, E)),
                  ("ffn_down.weight", (E, F))]
        if arch == "gemma3":
            layer.append(("post_ffw_norm.weight", (E,)))
        out += [(b + n, shp, ROLES.get(n, "norm")) for n, shp in layer]
    out.append(("output_norm.weight", (E,), "norm"))
    if not s.get("tied", True):
        out.append(("output.weight", (s["vocab"], E), "output"))
    return out


def _tokenizer(path: Path, vocab: int):
    from genie_rt.engine.gguf_file import open_gguf
    meta = open_gguf(path).metadata
    tok = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    n = len(tok["tokenizer.ggml.tokens"])
    vocab = vocab or n
    if vocab < n:
        raise SystemExit(f"--vocab {vocab} is smaller than {path}'s vocabulary ({n})")
    tok["tokenizer.ggml.tokens"] = list(tok["tokenizer.ggml.tokens"]) + [f"[PAD{i}]" for i in range(n, vocab)]
    if "tokenizer.ggml.token_type" in tok:
        tok["tokenizer.ggml.token_type"] = list(tok["tokenizer.ggml.token_type"]) + [5] * (vocab - n)
    if "tokenizer.ggml.scores" in tok:
        tok["tokenizer.ggml.scores"] = list(tok["tokenizer.ggml.scores"]) + [-1e9] * (vocab - n)
    return tok, vocab


def write(path, arch: str, shape: dict, seed: int = 0, tokenizer: Path = MICRO) -> Path:
    """Write the file; `shape` holds layers, hidden, heads, kv_heads, head_dim, ffn, vocab
    (0: the tokenizer's), types (role -> type name, "default"), and for gemma3 window/pattern."""
    import gguf

    from genie_rt.quant.formats import QType, quantize
    s = dict(shape)
    tok, s["vocab"] = _tokenizer(Path(tokenizer), s.get("vocab", 0))
    types = dict(s.get("types", {}))
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic {arch}")
    w.add_context_length(s.get("ctx", 8192))
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(float(s.get("rope_base", 1e4)))
    w.add_layer_norm_rms_eps(float(s.get("eps", 1e-6)))
    if arch == "gemma3" and s.get("window"):
        w.add_sliding_window(int(s["window"]))
        if s.get("pattern"):
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", int(s["pattern"]))
    if arch == "llama":
        w.add_rope_dimension_count(s["head_dim"])
    for key, value in tok.items():
        if isinstance(value, list):
            if key == "tokenizer.ggml.scores":
                w.add_array(key, [float(v) for v in value])
            else:
                w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
    for name, shp, role in _tensors(arch, s):
        if len(shp) == 1:
            v = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
            w.add_tensor(name, v)
            continue
        qname = types.get(role, types.get("default", "Q8_0"))
        qt = QType[qname]
        v = (0.02 * rng.standard_normal(shp)).astype(np.float32)
        if qt == QType.F32:
            w.add_tensor(name, v)
        else:
            w.add_tensor(name, quantize(v, qt), raw_shape=None, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--arch", choices=("llama", "qwen3", "gemma3"))
    for k in ("layers", "hidden", "heads", "kv-heads", "head-dim", "ffn", "vocab", "window", "pattern"):
        p.add_argument(f"--{k}", type=int)
    p.add_argument("--types", help="a type for every matrix (e.g. Q4_1), or role=TYPE,...")
    p.add_argument("--tokenizer", default=str(MICRO))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    shape = dict(PRESETS[a.preset]) if a.preset else {}
    arch = a.arch or shape.pop("arch", None)
    shape.pop("arch", None)
    if arch is None:
        p.error("--preset or --arch is required")
    for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "window", "pattern"):
        v = getattr(a, k)
        if v is not None:
            shape[k] = v
    if a.types:
        shape["types"] = ({"default": a.types} if "=" not in a.types else
                          dict(kv.split("=", 1) for kv in a.types.split(",")))
    missing = [k for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn") if k not in shape]
    if missing:
        p.error(f"missing shape fields: {', '.join(missing)}")
    out = write(a.output, arch, shape, a.seed, Path(a.tokenizer))
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB, {arch}, {shape['layers']} layers")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
