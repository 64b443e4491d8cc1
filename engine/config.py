"""Model and run-time configuration.

`ModelConfig` is built only from GGUF metadata and never changes after loading; it
derives the sizes every other module needs (head_dim, kv_dim, group size). Run-time
choices (back-end, context length, KV dtype, memory reserve) live in `EngineConfig`;
nothing writes back into a `ModelConfig`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from .gguf_file import GGUFError, GGUFFile, short_repr as _short

SUPPORTED_ARCHITECTURES = ("qwen3",)


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # general.architecture, e.g. "qwen3"
    name: str                 # general.name (informational)
    n_layers: int             # {arch}.block_count
    n_embd: int               # hidden size, {arch}.embedding_length
    n_ff: int                 # FFN inner size, {arch}.feed_forward_length
    n_head: int               # query heads
    n_head_kv: int            # key/value heads (GQA)
    head_dim: int             # {arch}.attention.key_length (Qwen3: 128, not n_embd / n_head)
    rope_base: float          # {arch}.rope.freq_base
    rms_eps: float            # {arch}.attention.layer_norm_rms_epsilon
    n_ctx_train: int          # {arch}.context_length
    vocab_size: int           # rows of token_embd
    tied_embeddings: bool     # no output.weight: logits use token_embd
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None = field(repr=False)
    file_type: int | None     # general.file_type (15 = MOSTLY_Q4_K_M)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_group(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelConfig":
        arch = g.require("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{g.path}: architecture '{arch}' is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

        def num(key: str, kind=int, default=None):
            full = f"{arch}.{key}"
            value = g.get(full, default)
            if value is None:
                raise GGUFError(f"{g.path}: metadata key '{full}' is missing")
            # GGUF stores numbers typed: an integer field must hold an integer type, a float
            # field an integer or float one (a float head count or a string is corruption
            # or a broken converter, not something to round)
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise GGUFError(f"{g.path}: metadata '{full}' = {_short(value)} is not "
                                f"{'a number' if kind is float else 'an integer'}; the file's "
                                "metadata is corrupt or was written by a broken converter")
            value = kind(value)
            if value <= 0 or (kind is int and value > 1 << 24) or value != value or value == float("inf"):
                raise GGUFError(f"{g.path}: metadata '{full}' = {value!r} is out of range")
            return value

        n_embd = num("embedding_length")
        n_head = num("attention.head_count")
        n_head_kv = num("attention.head_count_kv", default=n_head)
        head_dim = num("attention.key_length", default=n_embd // n_head)
        value_dim = num("attention.value_length", default=head_dim)
        if value_dim != head_dim:
            raise GGUFError(f"{g.path}: key_length {head_dim} != value_length {value_dim} is not supported")
        if n_head % n_head_kv:
            raise GGUFError(f"{g.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        if head_dim % 2:
            raise GGUFError(f"{g.path}: head dimension {head_dim} must be even for RoPE")
        emb = g.tensors.get("token_embd.weight")
        if emb is None:
            raise GGUFError(f"{g.path}: tensor 'token_embd.weight' is missing")
        tokens = g.get("tokenizer.ggml.tokens")
        if tokens is not None and not isinstance(tokens, list):
            raise GGUFError(f"{g.path}: metadata 'tokenizer.ggml.tokens' must be an array of "
                            f"strings, got {_short(tokens)}")
        vocab = len(tokens or []) or emb.shape[0]
        special = {}
        for name in ("bos", "eos"):
            key = f"tokenizer.ggml.{name}_token_id"
            tid = g.get(key)
            if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or tid < 0):
                raise GGUFError(f"{g.path}: metadata '{key}' = {_short(tid)} is not a token id "
                                "(a non-negative integer)")
            special[name] = tid
        name = g.get("general.name", g.path.stem)
        ftype = g.get("general.file_type")
        template = g.get("tokenizer.chat_template")
        n_layers = num("block_count")
        # a corrupt block_count (up to 2^24) must not make anything loop over layers that the
        # file does not have: compare it with the layers its tensor table names
        present = {int(m.group(1)) for m in map(_LAYER_TENSOR.match, g.tensors) if m}
        if n_layers > len(present):
            have = f"blk.0 .. blk.{max(present)}" if present else "none"
            raise GGUFError(f"{g.path}: block_count says {n_layers} layers but the tensor table has "
                            f"tensors for {len(present)} layers ({have}); the metadata or the tensor "
                            "table is wrong - convert the model again")
        return cls(
            arch=arch,
            name=name if isinstance(name, str) else g.path.stem,
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=num("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            rope_base=num("rope.freq_base", float, 10000.0),
            rms_eps=num("attention.layer_norm_rms_epsilon", float, 1e-6),
            n_ctx_train=num("context_length", default=4096),
            vocab_size=int(vocab),
            tied_embeddings="output.weight" not in g.tensors,
            bos_id=special["bos"],
            eos_id=special["eos"],
            chat_template=template if isinstance(template, str) else None,
            file_type=ftype if isinstance(ftype, int) and not isinstance(ftype, bool) else None,
        )


_LAYER_TENSOR = re.compile(r"blk\.(0|[1-9][0-9]{0,7})\.", re.ASCII)   # "blk.<layer>." (ASCII digits)

KVDType = Literal["int8", "f16", "f32"]


@dataclass
class EngineConfig:
    """Run-time settings chosen by the user (CLI flags, server options)."""

    backend: Literal["auto", "cpu", "cuda"] = "auto"
    n_ctx: int | None = None            # None: as much as fits, capped at the training context
    kv_dtype: KVDType = "int8"
    reserve_bytes: int | None = None    # memory left for the rest of the system; None: default
    prefill_chunk: int = 512            # prompt tokens per prefill pass
    gemv_mode: Literal["dp4a", "f32"] = "dp4a"   # CUDA decode: q8 activations + dp4a (fast, like
                                                 # llama.cpp) or float32 activations (closest to the
                                                 # CPU reference: greedy-text parity on near-tied logits)
    kv_cache_dir: str | None = None     # persistent per-conversation KV files
    kv_cache_budget: int = 1 << 30      # bytes on disk for conversation caches
    seed: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        """The checks the CLI makes, for callers of the Python API too."""
        def integer(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {self.backend!r}")
        if self.n_ctx is not None and (not integer(self.n_ctx) or self.n_ctx < 1):
            raise ValueError(f"n_ctx must be an integer >= 1 (or None: what fits), got {self.n_ctx!r}")
        if self.kv_dtype not in ("int8", "f16", "f32"):
            raise ValueError(f"kv_dtype must be 'int8', 'f16' or 'f32', got {self.kv_dtype!r}")
        if self.reserve_bytes is not None and (not integer(self.reserve_bytes) or self.reserve_bytes < 0):
            raise ValueError(f"reserve_bytes must be an integer >= 0 (or None), got {self.reserve_bytes!r}")
        if not integer(self.prefill_chunk) or self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {self.prefill_chunk!r}")
        if self.gemv_mode not in ("dp4a", "f32"):
            raise ValueError(f"gemv_mode must be 'dp4a' or 'f32', got {self.gemv_mode!r}")
        if not integer(self.kv_cache_budget) or self.kv_cache_budget < 0:
            raise ValueError(f"kv_cache_budget must be a byte count >= 0, got {self.kv_cache_budget!r}")
