"""The op vocabulary (engine/models/ops.py) as CUDA kernel launches: what a forward records.

`DecodeOps` (one row, the decode GEMVs) and `PrefillOps` (a chunk of n rows, the
tensor-core GEMMs) launch on the runtime's stream and never allocate, copy from the host
or synchronise, so an architecture's `body` run inside a capture is a CUDA graph. Positions
are read by the kernels from the device state (engine/device_state.py), so one graph serves
every position.

Activations in the form their consumer reads. A decode GEMV of an integer format reads x
as 8-bit blocks (xq, xs: quant/gemv.py); a prefill GEMM reads it as fp16 (x16, xscale:
quant/mmq.py `prepare_x`). The norm writes that form directly (one fused launch: rmsnorm_q8,
or prepare_x with the norm folded in), and a matrix product whose input is a plain buffer
(the attention output, the FFN activation) converts it first. The ops track, while
recording, which buffer each prepared copy holds; a buffer whose float values were never
written (a prefill norm output: only its fp16 copy exists) is refused by any op that would
read it as float - a recording-time assertion, not a run-time cost.

One peephole (DecodeOps). EngineConfig.decode_fused_rope (on): `rope_write` is not launched at
once but kept pending, and the attention that reads its q launches kvcache/attention.py
`decode_rope_attention` - the rope inside the attention's launch, the same bits; q itself is then
never written. Any other op launches the pending rope_write first, and every recording ends with
`finish()`, which does too (the runtime asserts nothing is left pending after a recording).
(Two other folds were built, measured slower and removed: the norm in the last block of the
residual GEMV before it, and a layer's FFN half as one persistent launch - docs/decode-step.md 6.)
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from .cuda_layout import Q8_SOURCES
from .models.ops import AttnLayer

ROPE_NAMES = {"neox": "neox", "norm": "normal"}     # ModelConfig.rope_style -> rope_write's name


def _flushing(op):
    """An op that launches a pending rope_write (DecodeOps) before its own work."""
    @functools.wraps(op)
    def run(self, *args, **kwargs):
        self._flush()
        return op(self, *args, **kwargs)
    run.flushes = True
    return run


class _Ops:
    def __init__(self, rt, rows: int):
        self.rt, self.A, self.stream, self.cfg = rt, rt.arena, rt.stream, rt.cfg
        self.rows = rows
        # the kernel kinds launched by programmatic dependent launch (quant/pdl.py; DecodeOps' kinds;
        # PrefillOps has its own switch, self.pdl)
        self.pdl_kinds = frozenset()
        self._names = {}            # id(buffer view) -> scratch name (for the preparation tracking)
        self._no_float = set()      # buffers whose float values were not written (prefill norm)

    def bind_scratch(self, s) -> None:
        """Name the buffers of `s` (the Scratch the forward will pass) for the tracking."""
        self.s = s
        self._names = {id(v): k for k, v in vars(s).items()}

    def _name(self, buf) -> str:
        return self._names.get(id(buf), f"<{id(buf)}>")

    def _wrote(self, buf) -> None:
        self._no_float.discard(self._name(buf))
        self._invalidate(self._name(buf))

    def _reads_float(self, *bufs) -> None:
        for b in bufs:
            assert self._name(b) not in self._no_float, \
                f"{self._name(b)} holds no float values here (only its prepared copy)"

    def _invalidate(self, name: str) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """Launch what an op kept pending (only DecodeOps keeps anything)."""

    def finish(self) -> None:
        """End of a recording: nothing may stay pending."""
        self._flush()

    # -- ops that are the same for one row and n rows ---------------------------------------
    def embed(self, table, ids, out, scale: float | None = None) -> None:
        from genie_rt.quant import embed
        kw = {"scale": scale} if scale is not None else {}
        embed.embed(table.packed, ids, out, stream=self.stream, planes=self.rt.embd_planes, **kw)
        self._wrote(out)

    def rope_write(self, qkv, a: AttnLayer, q_out) -> None:
        from genie_rt.kvcache.rope_write import rope_write
        self._reads_float(qkv)
        cfg, rt = self.cfg, self.rt
        cos, sin = rt.rope_table(a)
        q3 = q_out.reshape(self.rows, cfg.n_head, cfg.head_dim)
        rope_write(qkv, a.q_norm, a.k_norm, cfg.rms_eps, cos, sin, rt.state, q3, rt.kv_layers[a.index],
                   stream=self.stream, rope=ROPE_NAMES[cfg.rope_style], pdl="rope" in self.pdl_kinds)
        self._wrote(q_out)

    def post_norm_add(self, x, y, w) -> None:
        from genie_rt.engine import post_norm
        self._reads_float(x, y)
        post_norm.post_norm_add(x, y, w, self.cfg.rms_eps, stream=self.stream)
        self._wrote(x)


def _pdl_available() -> bool:
    from genie_rt.quant import pdl
    return pdl.available()


# The decode kernels EngineConfig.decode_pdl launches by programmatic dependent launch: every
# kind of a layer, so each kernel launches while the one before runs and waits for it on the
# device. A lab knob (tools/profile_decode.py times subsets, e.g. {"gemv", "q8"}: the GEMVs
# and quantize_q8 alone, the form measured on 2026-12-03).
PDL_ALL = frozenset({"gemv", "q8", "norm", "rope", "attention"})
PDL_KINDS = PDL_ALL


class _PendingRope(NamedTuple):
    """rope_write(qkv, a, q_out) recorded but not launched yet (DecodeOps' peephole)."""
    qkv: object
    a: AttnLayer
    q_out: object


class DecodeOps(_Ops):
    """One token: GEMVs, flash-decoding attention."""

    def __init__(self, rt, short: bool = False):
        super().__init__(rt, 1)
        # the attention's plans and workspace: the short-context graph's (one query head a block,
        # EngineConfig.decode_short_ctx) or the others
        self.attn_plans, self.attn_ws = ((rt.lay.decode_plans_short, rt.dws_short) if short
                                         else (rt.lay.decode_plans, rt.dws))
        self._q8_fresh = set()      # buffers whose xq.<name>, xs.<name> hold their current values
        # programmatic dependent launch (quant/pdl.py): asked for and the device has it
        on = bool(getattr(rt.ecfg, "decode_pdl", False)) and _pdl_available()
        assert PDL_KINDS <= PDL_ALL, PDL_KINDS
        self.pdl_kinds = PDL_KINDS if on else frozenset()
        self.pdl = "gemv" in self.pdl_kinds            # the GEMV launchers' pdl=
        # attention writes its output's q8 blocks itself (EngineConfig.decode_attention_q8)
        self.attention_q8 = bool(getattr(rt.ecfg, "decode_attention_q8", False)) and rt.q8_inputs
        # rope_write kept pending: the attention that reads its q does its work in the same launch
        # (EngineConfig.decode_fused_rope, kvcache/attention_decode_rope.py); any other op launches it
        self.fused_rope = bool(getattr(rt.ecfg, "decode_fused_rope", False))
        self._rope: _PendingRope | None = None

    embed = _flushing(_Ops.embed)
    post_norm_add = _flushing(_Ops.post_norm_add)

    @_flushing
    def rope_write(self, qkv, a: AttnLayer, q_out) -> None:
        """rope_write; with fused_rope kept pending for the attention that reads q_out."""
        if not self.fused_rope:
            _Ops.rope_write(self, qkv, a, q_out)
            return
        self._reads_float(qkv)
        self._rope = _PendingRope(qkv, a, q_out)
        self.rt.pending_launch = f"rope_write of layer {a.index}"
        self._wrote(q_out)

    def _flush(self) -> None:
        r = self._rope
        if r is not None:           # nothing fused it: its own launch, q_out written after all
            self._rope = None
            self.rt.pending_launch = None
            _Ops.rope_write(self, r.qkv, r.a, r.q_out)

    def _invalidate(self, name: str) -> None:
        self._q8_fresh.discard(name)

    def _q8_views(self, buf):
        name = self._name(buf)
        return self.A[f"xq.{name}"], self.A[f"xs.{name}"]

    def _prepared(self, x, weights):
        """(xq, xs) holding x's 8-bit blocks if any weight reads them (quantized here if the
        producer did not write them), else (None, None)."""
        from genie_rt.quant import gemv
        if not gemv.needs_q8(*weights):
            return None, None
        xq, xs = self._q8_views(x)
        if self._name(x) not in self._q8_fresh:
            self._reads_float(x)
            gemv.quantize_q8(x, xq, xs, stream=self.stream, pdl="q8" in self.pdl_kinds)
            self._q8_fresh.add(self._name(x))
        return xq, xs

    @_flushing
    def norm(self, x, w, out) -> None:
        """out = rmsnorm(x) * w, and its 8-bit blocks in one launch (rmsnorm_q8 is bit-identical
        to rmsnorm + quantize_q8); the float out only if some matrix reads float input."""
        from genie_rt.engine import norm
        self._reads_float(x)
        self._wrote(out)
        if not self.rt.q8_inputs:
            norm.rmsnorm(x, w, out, self.cfg.rms_eps, stream=self.stream)
            return
        xq, xs = self._q8_views(out)
        norm.rmsnorm_q8(x, w, xq, xs, self.cfg.rms_eps, stream=self.stream,
                        out=out if self.rt.float_inputs else None, pdl="norm" in self.pdl_kinds)
        if not self.rt.float_inputs:
            self._no_float.add(self._name(out))
        self._q8_fresh.add(self._name(out))

    @_flushing
    def linear(self, x, w, out, add: bool = False) -> None:
        from genie_rt.quant import gemv
        ws = w if isinstance(w, tuple) else (w,)
        gw = [m.gemv for m in ws]
        xq, xs = self._prepared(x, gw)
        if any(m.mode != "dp4a" for m in gw):
            self._reads_float(x)
        if len(ws) == 3:
            assert not add
            gemv.gemv_qkv(*gw, x, out, xq=xq, xs=xs, stream=self.stream, pdl=self.pdl)
        elif len(ws) == 1:
            gemv.gemv(gw[0], x, out, xq=xq, xs=xs, residual=out if add else None, stream=self.stream,
                      pdl=self.pdl)
        else:                       # concatenated outputs: column slices of the one row
            assert not add and self.rows == 1
            c = 0
            for m in gw:
                gemv.gemv(m, x, out[:, c:c + m.rows], xq=xq, xs=xs, stream=self.stream, pdl=self.pdl)
                c += m.rows
        self._wrote(out)

    @_flushing
    def gated(self, x, w, out, act: str) -> None:
        from genie_rt.quant import gemv
        wg, wu = (m.gemv for m in w)
        xq, xs = self._prepared(x, (wg, wu))
        kw = {} if act == "silu" else {"act": act}
        gemv.gemv_swiglu(wg, wu, x, out, xq=xq, xs=xs, stream=self.stream, pdl=self.pdl, **kw)
        self._wrote(out)

    def attention(self, q, a: AttnLayer, out) -> None:
        """Decode attention; with attention_q8 (and GEMVs that read 8-bit input) its launch also
        writes out's q8 blocks (the same bits as quantize_q8 on out), so the output projection
        quantizes nothing. The pending rope_write of q (fused_rope) runs inside this launch:
        q itself is then never written (nothing else reads it)."""
        from genie_rt.kvcache.attention import decode_attention, decode_rope_attention
        r = self._rope
        fuse = r is not None and r.q_out is q and r.a is a
        if fuse:
            self._rope = None
            self.rt.pending_launch = None
        self._flush()
        if fuse:
            self._no_float.add(self._name(q))   # never written now: a later read fails at recording
        else:
            self._reads_float(q)
        xq = xs = None
        if self.attention_q8 and self._name(out) in Q8_SOURCES:
            xq, xs = self._q8_views(out)
        rt, ws = self.rt, self.attn_ws
        kw = dict(stream=self.stream, plan=self.attn_plans[a.index], xq=xq, xs=xs,
                  pdl="attention" in self.pdl_kinds)
        if fuse:
            cos, sin = rt.rope_table(a)
            decode_rope_attention(r.qkv, a.q_norm, a.k_norm, self.cfg.rms_eps, cos, sin, rt.kv_layers[a.index],
                                  rt.state, out, ws, rope=ROPE_NAMES[self.cfg.rope_style], **kw)
        else:
            decode_attention(q, rt.kv_layers[a.index], rt.state, out, ws, **kw)
        self._wrote(out)
        if xq is not None:
            self._q8_fresh.add(self._name(out))
    attention.flushes = True        # (itself, after taking a pending rope_write it fuses)

    def head(self, x, norm_w, w, logits, softcap: float | None = None) -> None:
        h = self.s.h
        self.norm(x, norm_w, h)
        self.linear(h, w, logits)
        if softcap:
            from .copy_kernels import softcap as softcap_kernel
            softcap_kernel(logits, softcap, stream=self.stream)


class _PendingMerge(NamedTuple):
    """A split prefill attention whose merge is not launched yet (PrefillOps)."""
    out: object                     # the attention output [n, n_head * hd]
    most: int                       # the launch's most splits
    at: int | None                  # the state slot of the count in use


class PrefillOps(_Ops):
    """A chunk of n rows: tensor-core GEMMs (MMQ), tensor-core causal attention.

    A split attention (most splits > 1: a bucket's graph serves every start) leaves its merge
    pending; when the next op is the GEMM that reads its output, the merge runs inside that
    GEMM's input conversion (kvcache/attention_merge.py: one launch, the same bits), else it
    is launched on its own before that op (and by finish())."""

    def __init__(self, rt, n: int, n_splits: tuple, splits_at: int | None = None):
        super().__init__(rt, n)
        self.n = n
        # the most context splits of each layer's attention plan (the runtime's key: one per
        # plan) and the state slot holding the count in use (splits_at + plan index; None:
        # exactly n_splits)
        self._splits = {id(p): (k, None if splits_at is None else splits_at + i)
                        for i, (p, k) in enumerate(zip(rt._plans(), n_splits))}
        self._x16_holds = None      # the buffer whose fp16 copy is in x16 now
        self._merge: _PendingMerge | None = None
        # EngineConfig.prefill_pdl on sm_90+: every GEMM, its split-K reduction, prepare_x and
        # rope_write launched by programmatic dependent launch (a GEMM copies its first weights
        # while the kernel before it runs); the merge + prepare_x lets its GEMM launch at once
        # (quant/mmq.py, quant/pdl.py). The attention and copy_cols launch plainly
        self.pdl = bool(getattr(getattr(rt, "ecfg", None), "prefill_pdl", False)) and _pdl_available()
        self.pdl_kinds = frozenset({"rope"}) if self.pdl else frozenset()    # rope_write's build too

    embed = _flushing(_Ops.embed)
    rope_write = _flushing(_Ops.rope_write)
    post_norm_add = _flushing(_Ops.post_norm_add)

    def _flush(self) -> None:
        """Launch a pending split merge on its own (prefill_merge)."""
        m = self._merge
        if m is None:
            return
        from genie_rt.kvcache.attention_prefill_kernels import launch_merge
        self._merge = None
        self.rt.pending_launch = None
        launch_merge(self.rt.pws.part_o, self.rt.pws.part_ml, m.most, self.rt.state, m.at, m.out, self.cfg.n_head,
                     self.stream)

    def _reads_float(self, *bufs) -> None:
        if self._merge is not None and any(b is self._merge.out for b in bufs):
            self._flush()
        super()._reads_float(*bufs)

    def _invalidate(self, name: str) -> None:
        if self._x16_holds == name:
            self._x16_holds = None

    def _x16(self, cols: int):
        buf = self.A["x16"]
        return buf[:self.n, :cols] if cols == buf.shape[1] else buf.reshape(-1)[:self.n * cols].reshape(self.n, cols)

    def _prepared(self, x):
        from genie_rt.quant import mmq
        xe, xscale = self._x16(x.shape[1]), self.A["xscale"][:self.n]
        m = self._merge
        if m is not None and m.out is x:        # the split merge inside the conversion: one launch
            from genie_rt.kvcache.attention_merge import merge_prepare_x
            self._merge = None
            self.rt.pending_launch = None
            merge_prepare_x(self.rt.pws.part_o, self.rt.pws.part_ml, m.most, self.rt.state, m.at, x, xe, xscale,
                            stream=self.stream, pdl=self.pdl)
            self._x16_holds = self._name(x)
            return xe, xscale
        self._flush()
        if self._x16_holds != self._name(x):
            self._reads_float(x)
            mmq.prepare_x(x, xe, xscale, stream=self.stream, pdl=self.pdl)
            self._x16_holds = self._name(x)
        return xe, xscale

    @_flushing
    def norm(self, x, w, out) -> None:
        """The norm folded into the GEMM input conversion: out's fp16 copy only."""
        from genie_rt.quant import mmq
        self._reads_float(x)
        self._wrote(out)
        xe, xscale = self._x16(x.shape[1]), self.A["xscale"][:self.n]
        mmq.prepare_x(x, xe, xscale, stream=self.stream, norm_weight=w, eps=self.cfg.rms_eps, pdl=self.pdl)
        self._x16_holds = self._name(out)
        self._no_float.add(self._name(out))

    def _gemm(self, x, stacks, out, mode: str) -> None:
        """out = x [W0 | W1 | ...]^T over a group's stacked parts (one GEMM per part)."""
        from genie_rt.quant import mmq
        from .copy_kernels import copy_cols
        xe, xscale = self._prepared(x)
        ws = self.A["ws.mmq"]
        if len(stacks) == 1:
            mmq.mmq(stacks[0], xe, xscale, out, mode, workspace=ws, stream=self.stream, pdl=self.pdl)
            return
        assert mode == "store"
        col = 0
        for j, w in enumerate(stacks):
            tmp = self.A["part_a" if j % 2 == 0 else "part_b"].reshape(-1)[:self.n * w.rows].reshape(self.n, w.rows)
            mmq.mmq(w, xe, xscale, tmp, "store", workspace=ws, stream=self.stream, pdl=self.pdl)
            copy_cols(tmp, out, col, stream=self.stream)
            col += w.rows

    def linear(self, x, w, out, add: bool = False) -> None:
        ws = w if isinstance(w, tuple) else (w,)
        self._gemm(x, self.rt.stacks[tuple(m.name for m in ws)], out, "add" if add else "store")
        self._wrote(out)

    def gated(self, x, w, out, act: str) -> None:
        from genie_rt.engine import norm
        stacks = self.rt.stacks[tuple(m.name for m in w)]
        mode = {"silu": "swiglu", "gelu": "geglu"}[act]
        if len(stacks) == 1:
            self._gemm(x, stacks, out, mode)
        else:                       # gate and up of different types: two GEMMs, then the product
            gate, up = self.A["split_gate"][:self.n], self.A["split_up"][:self.n]
            self._gemm(x, stacks[:1], gate, "store")
            self._gemm(x, stacks[1:], up, "store")
            if act == "silu":
                norm.swiglu(gate, up, out, stream=self.stream)
            else:
                norm.geglu(gate, up, out, stream=self.stream)
        self._wrote(out)

    @_flushing
    def attention(self, q, a: AttnLayer, out) -> None:
        from genie_rt.kvcache.attention_prefill import prefill_attention
        self._reads_float(q)
        q3 = q.reshape(self.n, self.cfg.n_head, self.cfg.head_dim)
        plan = self.rt.lay.prefill_plans[a.index]
        most, at = self._splits[id(plan)]
        prefill_attention(q3, self.rt.kv_layers[a.index], self.rt.state, out, self.rt.pws,
                          n_splits=most, stream=self.stream, plan=plan, splits_at=at, merge=False)
        self._wrote(out)
        if most > 1:                    # merged by the next op (see the class docstring)
            self._merge = _PendingMerge(out, most, at)
            self.rt.pending_launch = "the prefill attention's split merge"

    def head(self, x, norm_w, w, logits, softcap: float | None = None) -> None:
        raise AssertionError("the prefill graph ends at the hidden state; the head runs on one row")

