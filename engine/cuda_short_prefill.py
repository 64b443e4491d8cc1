"""A short prefill as a decode-shaped graph: up to 8 new tokens by the int8 tensor-core GEMV (lab).

Why. Every chat turn and tool result after a cached prefix is a prefill of a few tokens. Through
the MMQ GEMMs of the 16-row bucket (engine/cuda_ops.py PrefillOps) 8 new tokens after 500 cached
ones cost 4.5 ms on the H200 against 24.4 cold - 5.5x, where issue 14 asks 10x. The products are
~70 us of a layer's ~110 and the rest a chain of small launches (docs/decode-journal.md 7). This
graph runs the same forward (an architecture's `body`) with the products of quant/gemv_mma_k.py,
whose time for 8 tokens is 1.2-1.5x the decode GEMV's for one (kernels/gemv.md 8d-8e), on q8_K
activations:

    norm        rmsnorm_q8k: RMSNorm and q8_K in one launch; the float output is not written
    linear      q8_K of the input where the op before did not leave it (rmsnorm_q8k without a
                norm weight), then q, k and v in one launch into their columns of [q | k | v]
                (quant/gemv_mma_qkv.py), any other product by gemv_mma_k (the residual added in
                the launch)
    gated       gate, up and the activation in one launch (quant/gemv_mma_glu.py) where both are
                Q4_K; else gemv_mma_k of each, then swiglu / geglu (engine/norm.py)
    attention   the prefill's kernel (its split count is device state), then its split merge and
                the q8_K of its output in one launch (kvcache/attention_merge.merge_q8k): the
                O-projection after it quantizes nothing
    rope_write, embed, post_norm_add
                the prefill's (n rows)

Which rows: a chunk of at most SHORT_ROWS new tokens runs as SHORT_ROWS rows (padded rows are
computed and ignored, as in the buckets), one graph for every start. Which models: every layer
matrix Q4_K or Q6_K (gemv_mma_k's formats) with columns a multiple of 256 (q8_K blocks); the
others keep the MMQ buckets (`unfit_reason`).

The numbers differ from the MMQ prefill's: the activations are q8_K (a scale per 256 values)
where the GEMMs read fp16 - tests/test_short_prefill.py holds the logits to the MMQ graph's by
cosine and checks the greedy next token. On sm_90+ the launches are chained by programmatic
dependent launch, the GEMVs triggering the next launch after their last trip (PDL below).
EngineConfig.short_prefill stays off by default (a first start also compiles the mma builds, and the
q8_K activations are coarser than the MMQ path's): on an H200 (2026-12-06, 20:45 UTC,
tools/bench_prefix.py) a warm 8-token turn after 500 cached tokens took 2.63 ms with it (9.3x cold's
24.47), the graph 2.17 ms (docs/decode-step.md 8, docs/kernels/gemv.md 8m).
"""
from __future__ import annotations

from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_mma_k import FORMATS, QK
from genie_rt.quant.q8k_layout import sizes as q8k_sizes

from .cuda_layout import SHORT_ROWS
from .cuda_ops import _Ops, _pdl_available
from .models.ops import AttnLayer

# The graph's launches chained by programmatic dependent launch (where the decode step's are:
# EngineConfig.decode_pdl on sm_90+), with the mma GEMVs' PDL builds triggering the next launch after
# their last trip (quant/pdl.TRIGGER_LATE). On since 2026-12-06 (night): the same bits, and on an H200
# the 4B's graph (8 new tokens after 500 cached) took 2.159 / 2.163 ms against 2.326 / 2.329 plain and
# 2.346 / 2.359 with the GEMVs triggering first thing (docs/kernels/gemv.md 8m). A lab knob: False (none),
# True (every kind of PDL_KINDS) or a collection of some of them (`tools/profile_prefill.py --short
# --pdl-kinds`).
PDL = True
# Lab knob: the q/k/v and gate/up/SwiGLU launches by 16-byte weight loads, unpipelined (W16:
# quant/gemv_mma_k_w16.py), as gemv_mma_k's Q4_K default. On since 2026-12-06: the same bits, and
# on one H100 in one call (8 new tokens after 500 cached) the graph took 2.400 ms against 2.439 with
# the pipelined 8-byte builds (q/k/v 8.9 against 9.5 us a layer, gate/up 14.4 against 15.4;
# docs/kernels/gemv.md 8k). False: those builds, for comparison.
FUSED_W16 = True
# Lab knob: the gate/up/SwiGLU launch's k-split (None: gemv_mma_k.plan_ksplit's, 2 for the 4B's
# 9,728 x 2,560; gemv_mma_k's W16 ffn_gate alone was fastest at 4 on an H100, 8.5 against 9.1 us,
# docs/kernels/gemv.md 8k). Not yet timed in the GLU: `tools/lab_knobs.py
# engine.cuda_short_prefill.GLU_KSPLIT=4 -- tools/profile_prefill.py --short ...`.
GLU_KSPLIT = None
# Lab knob: the graph captured as two parts launched one after the other (cuda_graph.CUDAGraph.cut),
# the second from this layer's attention on (None: one graph). cuGraphLaunch takes host time per node
# (0.05-0.07 ms for this graph's ~370 on H100 hosts, docs/decode-journal.md 7a); if the device starts
# only once the whole launch is in, a first part of ~1.3 layers (~15 nodes, ~70 us of work) starts it
# ~0.05 ms sooner, and the second part's launch runs while it works. The cut is before an attention,
# which launches plainly: the second part's first node needs no PDL edge. Not yet timed.
SPLIT_LAUNCH = None
# the launches that have PDL builds: rmsnorm_q8k with a norm weight (norm) and without (q8k), q/k/v
# in one launch (qkv), gemv_mma_k (gemv: attn_output, ffn_down), gate/up/SwiGLU (glu), rope_write
PDL_KINDS = ("norm", "q8k", "qkv", "gemv", "glu", "rope")


def pdl_kinds(knob) -> frozenset:
    """The kinds a value of the PDL knob names (ValueError for a kind not in PDL_KINDS)."""
    if knob is True:
        return frozenset(PDL_KINDS)
    kinds = frozenset(knob or ())
    if kinds - set(PDL_KINDS):
        raise ValueError(f"cuda_short_prefill.PDL: unknown kinds {sorted(kinds - set(PDL_KINDS))}; "
                         f"known: {', '.join(PDL_KINDS)}")
    return kinds


def _layer_matrices(weights):
    """Every matrix of every layer (the norms and other 1-D tensors left out)."""
    for L in weights.layers:
        yield from (m for m in vars(L).values() if hasattr(m, "packed"))


def unfit_reason(weights) -> str | None:
    """Why the short graph cannot run this model's layers (None: it can)."""
    for m in _layer_matrices(weights):
        q = QType(m.packed.qtype)
        if q not in FORMATS:
            return f"{m.name} is {q.name} (the short prefill's GEMV reads Q4_K and Q6_K)"
        if m.packed.cols % QK:
            return f"{m.name} has {m.packed.cols} columns (q8_K blocks need a multiple of {QK})"
    return None


def q8k_buffers(layout, widths: dict) -> None:
    """The q8_K activation buffers (cuda_layout.plan_layout, when EngineConfig.short_prefill):
    values, block scales and 32-value sums of SHORT_ROWS rows of the widest input."""
    import numpy as np
    cols = max(widths[n] for n in ("h", "attn", "ff"))
    cols = -(-cols // QK) * QK
    for name, size, dt in zip(("xq8k", "xd8k", "xb8k"), q8k_sizes(SHORT_ROWS, cols), (np.int8, np.float32, np.int32)):
        layout.add(name, (size,), dt)              # tiled: quant/q8k_layout.py


class ShortPrefillOps(_Ops):
    """The forward of n <= SHORT_ROWS rows on gemv_mma_k (module docstring)."""

    def __init__(self, rt, n: int, n_splits: tuple, splits_at: int | None = None):
        super().__init__(rt, n)
        if n > SHORT_ROWS:
            raise ValueError(f"ShortPrefillOps: {n} rows; at most {SHORT_ROWS}")
        self.n = n
        self._splits = {id(p): (k, None if splits_at is None else splits_at + i)
                        for i, (p, k) in enumerate(zip(rt._plans(), n_splits))}
        self._holds = None          # the buffer whose q8_K values are in xq8k now
        self._gemv = rt.short_gemv  # tensor name -> its dp4a-mode GemvWeight
        # PDL: programmatic dependent launch (quant/pdl.py) of the kinds it names where
        # the decode step takes it (EngineConfig.decode_pdl on sm_90+); the attention and its merge
        # launch plainly
        kinds = pdl_kinds(PDL)
        on = bool(kinds) and bool(getattr(rt.ecfg, "decode_pdl", False)) and _pdl_available()
        self.pdl_kinds = kinds if on else frozenset()

    def _invalidate(self, name: str) -> None:
        if self._holds == name:
            self._holds = None

    def _q8k(self, cols: int):
        A, n = self.A, self.n
        nq, nd, nb = q8k_sizes(n, cols)              # tiled: quant/q8k_layout.py
        return A["xq8k"].reshape(-1)[:nq], A["xd8k"].reshape(-1)[:nd], A["xb8k"].reshape(-1)[:nb]

    def _prepared(self, x):
        """(xq, xd, xb) holding x's q8_K values, quantized here unless the op before wrote them."""
        from genie_rt.quant.quantize_q8k import rmsnorm_q8k
        q = self._q8k(x.shape[1])
        if self._holds != self._name(x):
            self._reads_float(x)
            rmsnorm_q8k(x, None, 0.0, *q, stream=self.stream, pdl="q8k" in self.pdl_kinds)
            self._holds = self._name(x)
        return q

    def norm(self, x, w, out) -> None:
        """out's q8_K values only (its float values are not written)."""
        from genie_rt.quant.quantize_q8k import rmsnorm_q8k
        self._reads_float(x)
        self._wrote(out)
        rmsnorm_q8k(x, w, self.cfg.rms_eps, *self._q8k(x.shape[1]), stream=self.stream,
                    pdl="norm" in self.pdl_kinds)
        self._holds = self._name(out)
        self._no_float.add(self._name(out))

    def _products(self, q, ws, out, add: bool) -> None:
        """out[:, c:c + rows] (+)= x W^T for each matrix of ws, c its first column."""
        from genie_rt.quant.gemv_mma_k import gemv_mma_k
        width, flat, c = out.shape[1], out.reshape(-1), 0
        for m in ws:
            y = flat[c:]
            gemv_mma_k(self._gemv[m.name], *q, y, self.n, residual=y if add else None, ldy=width,
                       stream=self.stream, pdl="gemv" in self.pdl_kinds)
            c += m.rows
        assert c == width, (c, width)

    def linear(self, x, w, out, add: bool = False) -> None:
        """[q | k | v] in one launch (quant/gemv_mma_qkv.py); any other product by gemv_mma_k
        per matrix."""
        from genie_rt.quant.gemv_mma_qkv import gemv_mma_qkv
        ws = w if isinstance(w, tuple) else (w,)
        q = self._prepared(x)
        if len(ws) == 3 and not add:
            gemv_mma_qkv([self._gemv[m.name] for m in ws], *q, out, self.n, ldy=out.shape[1], stream=self.stream,
                         pdl="qkv" in self.pdl_kinds, pipe=not FUSED_W16, w16=FUSED_W16)
        else:
            self._products(q, ws, out, add)
        self._wrote(out)

    def gated(self, x, w, out, act: str) -> None:
        """One launch where gate and up are Q4_K of one shape (quant/gemv_mma_glu.py); else
        gemv_mma_k of each and the activation's launch."""
        from genie_rt.engine import norm
        from genie_rt.quant.gemv_mma_glu import gemv_mma_glu
        q = self._prepared(x)
        wg, wu = (self._gemv[m.name] for m in w)
        if wg.qtype == wu.qtype == QType.Q4_K and (wg.rows, wg.cols) == (wu.rows, wu.cols):
            gemv_mma_glu(wg, wu, *q, out, self.n, act=act, ksplit=GLU_KSPLIT, stream=self.stream,
                         pdl="glu" in self.pdl_kinds, pipe=not FUSED_W16, w16=FUSED_W16)
            self._wrote(out)
            return
        gate, up = self.A["split_gate"][:self.n], self.A["split_up"][:self.n]
        self._products(q, w[:1], gate, False)
        self._products(q, w[1:], up, False)
        (norm.swiglu if act == "silu" else norm.geglu)(gate, up, out, stream=self.stream)
        self._wrote(out)

    def attention(self, q, a: AttnLayer, out) -> None:
        """The prefill attention, then its split merge and the q8_K of its output in one launch
        (kvcache/attention_merge.merge_q8k): the O-projection after it quantizes nothing."""
        from genie_rt.kvcache.attention_merge import merge_q8k
        from genie_rt.kvcache.attention_prefill import prefill_attention

        from .cuda_graph import cut
        if a.index == SPLIT_LAUNCH:
            cut(self.stream)                         # (nothing where no graph captures)
        self._reads_float(q)
        q3 = q.reshape(self.n, self.cfg.n_head, self.cfg.head_dim)
        plan = self.rt.lay.prefill_plans[a.index]
        most, at = self._splits[id(plan)]
        prefill_attention(q3, self.rt.kv_layers[a.index], self.rt.state, out, self.rt.pws,
                          n_splits=most, stream=self.stream, plan=plan, splits_at=at, merge=False)
        ws = self.rt.pws
        merge_q8k(ws.part_o, ws.part_ml, most, self.rt.state, at, out, *self._q8k(out.shape[1]), stream=self.stream)
        self._wrote(out)
        self._holds = self._name(out)

    def head(self, x, norm_w, w, logits, softcap: float | None = None) -> None:
        raise AssertionError("the prefill graph ends at the hidden state; the head runs on one row")


def short_gemv_weights(weights) -> dict:
    """tensor name -> a dp4a-mode GemvWeight of every layer matrix (views of the planes the
    decode GEMV and the GEMMs read: no copy)."""
    from genie_rt.quant import gemv
    return {m.name: m.gemv if m.gemv.mode == "dp4a" else gemv.prepare_weight(m.packed, "dp4a")
            for m in _layer_matrices(weights)}
