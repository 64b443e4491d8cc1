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


# how the CUDA decode attention walks a split's rows (kvcache/attention_decode_tiles.py): "block"
# (the block in step, three barriers a tile), "warp" (each lane slot its own running softmax, the
# next trip's loads in flight, and in its PDL build the first trip's rows of earlier positions
# loaded before the wait), "warp-nopf" (the warp loop without that prefetch - and so without the
# loads before the wait). The default, "warp": H200, 2026-12-04 12:43 UTC, the 4B's decode step
# (tools/profile_decode.py --settings loop): warp / block / warp-nopf 1.976 / 2.034 / 2.034 ms at
# depth 512, 2.277 / 2.419 / 2.320 ms at 4096 (docs/decode-journal.md, section 6c)
# "mma" (2026-12-05, int8 caches): scores and P x V on the tensor cores, the whole GQA group a block
# (kvcache/attention_decode_mma.py); since its H100 measurement (2026-12-05) the long-context graph's
# loop by default on sm_90 (engine/cuda_layout.decode_loop), DEFAULT_DECODE_ATTENTION_LOOP elsewhere.
DECODE_ATTENTION_LOOPS = ("block", "warp", "warp-nopf", "mma")
MAX_DECODE_ATTENTION_SPLITS = 64        # kvcache/attention_decode_kernels.MAX_SPLITS (a test keeps them equal)
DEFAULT_DECODE_ATTENTION_LOOP = "warp"


class MetaReader:
    """Typed, range-checked access to `{arch}.*` metadata of one file (GGUFError naming the key)."""

    def __init__(self, g: GGUFFile, arch: str):
        self.g, self.arch = g, arch

    def num(self, key: str, kind=int, default=None, positive: bool = True):
        full = f"{self.arch}.{key}"
        value = self.g.get(full, default)
        if value is None:
            raise GGUFError(f"{self.g.path}: metadata key '{full}' is missing")
        # GGUF stores numbers typed: an integer field must hold an integer type, a float
        # field an integer or float one (a float head count or a string is corruption
        # or a broken converter, not something to round)
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise GGUFError(f"{self.g.path}: metadata '{full}' = {_short(value)} is not "
                            f"{'a number' if kind is float else 'an integer'}; the file's "
                            "metadata is corrupt or was written by a broken converter")
        value = kind(value)
        if (value <= 0 if positive else value < 0) or (kind is int and value > 1 << 24) \
                or value != value or value == float("inf"):
            raise GGUFError(f"{self.g.path}: metadata '{full}' = {value!r} is out of range")
        return value

    def opt(self, key: str, kind=float, positive: bool = True):
        """The value, or None when the key is absent."""
        return self.num(key, kind, positive=positive) if f"{self.arch}.{key}" in self.g.metadata else None

    def text(self, key: str) -> str | None:
        full = f"{self.arch}.{key}"
        value = self.g.get(full)
        if value is not None and not isinstance(value, str):
            raise GGUFError(f"{self.g.path}: metadata '{full}' = {_short(value)} is not a string")
        return value


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward needs to know about a model, from its GGUF metadata alone.

    The fields are the union over the supported architectures (engine/models/): each
    architecture's `hparams()` sets the ones that differ from the Llama defaults."""

    arch: str                 # general.architecture, e.g. "qwen3"
    name: str                 # general.name (informational)
    n_layers: int             # {arch}.block_count
    n_embd: int               # hidden size, {arch}.embedding_length
    n_ff: int                 # FFN inner size, {arch}.feed_forward_length
    n_head: int               # query heads
    n_head_kv: int            # key/value heads (GQA)
    head_dim: int             # {arch}.attention.key_length (Qwen3: 128, not n_embd / n_head)
    rope_base: float          # {arch}.rope.freq_base (global layers)
    rms_eps: float            # {arch}.attention.layer_norm_rms_epsilon
    n_ctx_train: int          # {arch}.context_length
    vocab_size: int           # rows of token_embd
    tied_embeddings: bool     # no output.weight: logits use token_embd
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None = field(repr=False)
    file_type: int | None     # general.file_type (15 = MOSTLY_Q4_K_M)
    # -- what differs between architectures (defaults: Llama) --------------------------
    rope_style: str = "norm"              # "norm": pairs (2i, 2i+1); "neox": pairs (i, i+d/2)
    rope_scale: float = 1.0               # llama.cpp freq_scale of global layers (1 / linear factor)
    qk_norm: bool = False                 # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    ffn_act: str = "silu"                 # gate activation: "silu" (SwiGLU) or "gelu" (GeGLU, tanh)
    embd_scale: float | None = None       # embeddings multiplied by this (Gemma: sqrt(n_embd))
    attn_scale: float | None = None       # q k^T scale; None: 1 / sqrt(head_dim)
    logit_softcap: float | None = None    # logits = c * tanh(logits / c) when set
    post_norms: bool = False              # RMSNorm of the attention and FFN outputs (Gemma)
    layer_windows: tuple = ()             # per layer: sliding-window size, or None (global)
    rope_base_local: float = 10000.0      # RoPE base of sliding-window layers
    rope_freqs: bool = False              # a rope_freqs tensor divides the frequencies (Llama 3.1+)

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

    @property
    def rope_dim(self) -> int:
        return self.head_dim

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (None: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelConfig":
        from .models import architecture
        arch = g.require("general.architecture")
        spec = architecture(arch, g.path)
        r = MetaReader(g, arch)
        num = r.num

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
        n_rot = num("rope.dimension_count", default=head_dim)
        if n_rot != head_dim:
            raise GGUFError(f"{g.path}: rope.dimension_count {n_rot} != head dimension {head_dim}: "
                            "partial RoPE is not supported")
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
        base = dict(
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
            rope_scale=_rope_scale(r),
        )
        base.update(spec.hparams(r, base))
        return cls(**base)


def _rope_scale(r: MetaReader) -> float:
    """llama.cpp's freq_scale from `rope.scaling.*`: 1 / factor for linear scaling, 1 without.
    Scalings that change the formula itself (YaRN, LongRoPE) are refused, not approximated."""
    kind = r.text("rope.scaling.type")
    factor = r.opt("rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        if kind is None and factor not in (None, 1.0):     # old files: a factor without a type
            return 1.0 / factor
        return 1.0
    if kind == "linear":
        return 1.0 / factor
    raise GGUFError(f"{r.g.path}: RoPE scaling type '{kind}' ({r.arch}.rope.scaling.type) is not "
                    "supported (only linear scaling and rope_freqs factors are)")


_LAYER_TENSOR = re.compile(r"blk\.(0|[1-9][0-9]{0,7})\.", re.ASCII)   # "blk.<layer>." (ASCII digits)

KVDType = Literal["int8", "f16", "f32"]
# The KV cache type when none is asked for. The GPU halves attention traffic and memory with
# INT8; the CPU keeps llama.cpp's default F16: for the small models a CPU runs, an INT8 cache
# is enough to turn a near-tied greedy choice (Gemma 3 270M, "The capital of France is":
# INT8 writes "country. It", F16 writes llama.cpp's "country of France", 2026-12-02).
DEFAULT_KV = {"cpu": "f16", "cuda": "int8"}


@dataclass
class EngineConfig:
    """Run-time settings chosen by the user (CLI flags, server options)."""

    backend: Literal["auto", "cpu", "cuda"] = "auto"
    n_ctx: int | None = None            # None: as much as fits, capped at the training context
    kv_dtype: KVDType | None = None     # None: the back-end's default (DEFAULT_KV)
    reserve_bytes: int | None = None    # memory left for the rest of the system; None: default
    prefill_chunk: int = 512            # prompt tokens per prefill pass
    gemv_mode: Literal["dp4a", "f32"] = "dp4a"   # CUDA decode: q8 activations + dp4a (fast, like
                                                 # llama.cpp) or float32 activations (closest to the
                                                 # CPU reference: greedy-text parity on near-tied logits)
    kv_cache_dir: str | None = None     # persistent per-conversation KV files
    kv_cache_budget: int = 1 << 30      # bytes on disk for conversation caches
    seed: int | None = None
    threads: int | None = None          # CPU back-end threads; None: the physical cores
    min_headroom_bytes: int | None = None   # end a reply when MemAvailable drops below this (step_guard.py);
                                            # None: 256 MiB on an integrated GPU, off elsewhere; 0: off
    thermal_limit_c: float | None = None    # slow generation while the hottest zone is this hot; None: off
    mapped_memory: bool = False         # CUDA: the arena in mapped host memory (an integrated GPU's placement)
    decode_pdl: bool = True             # CUDA decode on sm_90+ (Hopper, Blackwell): every kernel of the
                                        # step launched by programmatic dependent launch (quant/pdl.py:
                                        # it starts while the one before runs and waits on the device;
                                        # the same bits). sm_80/87 (the Jetson) run the plain kernels
                                        # whatever this says. --no-pdl turns it off
    prefill_pdl: bool = False           # CUDA prefill on sm_90+: every GEMM (quant/mmq.py) launched by
                                        # programmatic dependent launch, its first weight stages copied
                                        # while the input conversion before it runs (the same bits).
                                        # A lab switch until measured (tools/profile_prefill.py --pdl);
                                        # sm_80/87 run the plain kernels whatever this says. --no-pdl
                                        # turns it off
    short_prefill: bool = False         # CUDA: a chunk of up to 8 new tokens runs as a decode-shaped graph
                                        # on the int8 tensor-core GEMV (engine/cuda_short_prefill.py;
                                        # models whose layer matrices are all Q4_K / Q6_K). Off: q8_K
                                        # activations, more kernels to compile at a first start; a warm
                                        # 8-token turn 2.9 against 4.6 ms (H100, 2026-12-06,
                                        # docs/decode-step.md 8); --short-prefill
    decode_attention_q8: bool = True    # CUDA decode: the attention launch also writes the q8 blocks of
                                        # its output (kvcache/attention.py xq=, xs=; same bits as
                                        # quantize_q8), one launch fewer a layer. Off until the rope went
                                        # into the attention (H200, 2026-12-03: 2.188 vs 2.166 ms); since
                                        # then on: 1.822 vs 1.855 ms at depth 512, 2.120 vs 2.163 at 4096
                                        # (H200, 2026-12-04 15:10 UTC, tools/profile_decode.py --settings q8;
                                        # two more processes at 15:44: the same within 5 us)
    decode_fused_rope: bool = True      # CUDA decode: the attention launch does rope_write's work for the
                                        # new token itself (kvcache/attention_decode_rope.py; the same
                                        # bits), one launch fewer a layer; --no-fused-rope
    decode_attention_splits: int | None = None  # CUDA decode attention: blocks along the context per KV
                                        # head and subgroup (kvcache/attention.py plan_decode; None: its
                                        # choice from the SM count); --attention-splits. Not for the
                                        # short-context graph (decode_short_ctx): its plans are one wave
    decode_short_ctx: int = 1024        # CUDA decode: a step at a position below this runs a graph of its
                                        # own whose attention takes one query head a block (twice the
                                        # blocks, each a shorter chain; the K/V rows read once a head, from
                                        # L2). H200, 2026-12-04, the 4B's step (tools/profile_decode.py
                                        # --settings heads): depths 64 / 160 / 320 / 512 / 1,024 / 2,048
                                        # 1.740 / 1.749 / 1.754 / 1.784 / 1.835 / 1.929 ms against two heads'
                                        # 1.781 / 1.795 / 1.791 / 1.808 / 1.841 / 1.908 (docs/kernels/
                                        # attention.md): past ~1,024 the shared rows win (between 1,024 and
                                        # 2,048 not measured). Off where one split of one-head blocks is more
                                        # than a wave (few SMs: cuda_layout.short_plans). 0: one graph at
                                        # every position; --attention-short-ctx
    decode_attention_loop: str | None = None    # CUDA decode attention's loop (DECODE_ATTENTION_LOOPS;
                                        # None: DEFAULT_DECODE_ATTENTION_LOOP, but "mma" for the long-
                                        # context graph where it was measured faster: sm_90+, int8
                                        # cache, cuda_layout.decode_loop); --attention-loop
    overlap_load: bool = False          # CUDA, discrete GPU: read the weights on a thread while the
                                        # kernels load and the graphs are captured (cuda_weights.
                                        # BackgroundUpload; --overlap-load). H200, 2026-12-03: the
                                        # same bits; back-end 3.4-3.6 s vs 3.5 s reading first (the
                                        # thread and the captures share the GIL), so off: simpler
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        """The checks the CLI makes, for callers of the Python API too."""
        def integer(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {self.backend!r}")
        if self.n_ctx is not None and (not integer(self.n_ctx) or self.n_ctx < 1):
            raise ValueError(f"n_ctx must be an integer >= 1 (or None: what fits), got {self.n_ctx!r}")
        if self.kv_dtype not in (None, "int8", "f16", "f32"):
            raise ValueError(f"kv_dtype must be 'int8', 'f16' or 'f32', got {self.kv_dtype!r}")
        if self.reserve_bytes is not None and (not integer(self.reserve_bytes) or self.reserve_bytes < 0):
            raise ValueError(f"reserve_bytes must be an integer >= 0 (or None), got {self.reserve_bytes!r}")
        if not integer(self.prefill_chunk) or self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {self.prefill_chunk!r}")
        if not isinstance(self.overlap_load, bool):
            raise ValueError(f"overlap_load must be True or False, got {self.overlap_load!r}")
        if not isinstance(self.decode_pdl, bool):
            raise ValueError(f"decode_pdl must be True or False, got {self.decode_pdl!r}")
        if not isinstance(self.prefill_pdl, bool):
            raise ValueError(f"prefill_pdl must be True or False, got {self.prefill_pdl!r}")
        if not isinstance(self.short_prefill, bool):
            raise ValueError(f"short_prefill must be True or False, got {self.short_prefill!r}")
        if not isinstance(self.decode_attention_q8, bool):
            raise ValueError(f"decode_attention_q8 must be True or False, got {self.decode_attention_q8!r}")
        if not isinstance(self.decode_fused_rope, bool):
            raise ValueError(f"decode_fused_rope must be True or False, got {self.decode_fused_rope!r}")
        top = MAX_DECODE_ATTENTION_SPLITS
        if self.decode_attention_splits is not None and (not integer(self.decode_attention_splits)
                                                         or not 1 <= self.decode_attention_splits <= top):
            raise ValueError(f"decode_attention_splits must be an integer in 1..{top} (or None: the plan's "
                             f"choice), got {self.decode_attention_splits!r}")
        if not integer(self.decode_short_ctx) or self.decode_short_ctx < 0:
            raise ValueError(f"decode_short_ctx must be an integer >= 0 (0: one decode graph at every "
                             f"position), got {self.decode_short_ctx!r}")
        if self.decode_attention_loop not in (None,) + DECODE_ATTENTION_LOOPS:
            raise ValueError(f"decode_attention_loop must be one of {DECODE_ATTENTION_LOOPS} (or None: "
                             f"the default), got {self.decode_attention_loop!r}")
        if self.gemv_mode not in ("dp4a", "f32"):
            raise ValueError(f"gemv_mode must be 'dp4a' or 'f32', got {self.gemv_mode!r}")
        if self.threads is not None and (not integer(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1 (or None: the physical cores), got {self.threads!r}")
        if self.min_headroom_bytes is not None and (not integer(self.min_headroom_bytes)
                                                    or self.min_headroom_bytes < 0):
            raise ValueError(f"min_headroom_bytes must be an integer >= 0 (or None), got {self.min_headroom_bytes!r}")
        if self.thermal_limit_c is not None and not 0 < self.thermal_limit_c < 150:
            raise ValueError(f"thermal_limit_c must be between 0 and 150 °C (or None), got {self.thermal_limit_c!r}")
        if not integer(self.kv_cache_budget) or self.kv_cache_budget < 0:
            raise ValueError(f"kv_cache_budget must be a byte count >= 0, got {self.kv_cache_budget!r}")
