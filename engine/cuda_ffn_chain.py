"""DecodeOps' second peephole: a layer's FFN half recorded as ops, launched as one kernel.

With EngineConfig.decode_fused_ffn, the decode forward's ops

    linear(a, Wo, out=x, add=True)          x += a Wo^T
    norm(x, ffn_norm, out=h)                h = rmsnorm(x) * ffn_norm
    gated(h, (Wg, Wu), out=f, act)          f = act(h Wg^T) * (h Wu^T)
    linear(f, Wd, out=x, add=True)          x += f Wd^T
    [norm(x, next_norm, out=h)]             the next layer's (or the head's) pre-norm

are kept, not launched, while they arrive in this order on these buffers; the fifth (or
whatever op comes instead) launches them as ONE quant/ffn_fused.py kernel - the same bits as
the separate launches. A chain that breaks off earlier (another op, another buffer, a weight
the fused kernel does not read, Gemma 3's post-norms) is replayed op by op, unfused. Every op
of DecodeOps flushes pending work before its own (`_flushing`, `norm`, `finish`), so nothing
runs out of order.

What the launch leaves: x (float) and h's q8 blocks (the next norm's, or the ffn norm's when
the chain ended after the down GEMV), f (float) and its q8 blocks; h's float values are not
written (an op reading h as float after the launch is refused at recording, as for the
q8-only rmsnorm_q8).
"""
from __future__ import annotations

from typing import NamedTuple

from .cuda_layout import Q8_SOURCES


class Call(NamedTuple):
    op: str                 # "linear", "norm" or "gated"
    x: object
    w: object
    out: object
    extra: object           # linear: add; gated: act; norm: None


def _dp4a_matrix(w) -> bool:
    return not isinstance(w, tuple) and getattr(w.gemv, "mode", None) == "dp4a"


class FFNChain:
    """The recorded ops of one DecodeOps (see the module docstring)."""

    def __init__(self, ops):
        self.ops = ops
        self.calls: list[Call] = []
        self.replaying = False

    def take(self, call: Call) -> bool:
        """Keep `call` if it continues the chain (True); else the caller runs it itself, and its
        flush launches or replays what was kept."""
        if self.replaying:
            return False
        c, n = self.calls, len(self.calls)
        ok = False
        if call.op == "linear":
            if n == 0:
                ok = (call.extra is True and _dp4a_matrix(call.w)
                      and self.ops._name(call.x) in Q8_SOURCES)
            elif n == 3:
                ok = (call.extra is True and call.x is c[2].out and call.out is c[0].out
                      and _dp4a_matrix(call.w) and self._supported(call.w))
        elif call.op == "norm":
            ok = n in (1, 4) and call.x is c[0].out and (n == 1 or call.out is c[1].out)
        elif call.op == "gated":
            ok = n == 2 and call.x is c[1].out and isinstance(call.w, tuple) and len(call.w) == 2 \
                and all(_dp4a_matrix(m) for m in call.w)
        if not ok:
            return False
        c.append(call)
        if len(c) == 5:
            self._launch(next_norm=call.w)
        return True

    def _supported(self, wd) -> bool:
        from genie_rt.quant import ffn_fused
        wg, wu = (m.gemv for m in self.calls[2].w)
        return ffn_fused.supported(self.calls[0].w.gemv, wg, wu, wd.gemv) is None

    def flush(self) -> None:
        """Launch a complete chain (no next norm), or replay a partial one op by op."""
        if len(self.calls) == 4:
            self._launch(next_norm=None)
            return
        calls, self.calls = self.calls, []
        ops = self.ops
        self.replaying = True
        try:
            for c in calls:                   # unfused, in order
                if c.op == "linear":
                    ops.linear(c.x, c.w, c.out, add=c.extra)
                elif c.op == "norm":
                    ops.norm(c.x, c.w, c.out)
                else:
                    ops.gated(c.x, c.w, c.out, act=c.extra)
        finally:
            self.replaying = False

    def _launch(self, next_norm) -> None:
        from genie_rt.quant import ffn_fused
        lin_o, norm_f, gated, lin_d = self.calls[:4]
        self.calls = []
        ops, rt = self.ops, self.ops.rt
        wo, wd = lin_o.w.gemv, lin_d.w.gemv
        wg, wu = (m.gemv for m in gated.w)
        x, h, f = lin_o.out, norm_f.out, gated.out
        aq, as_ = ops._prepared(lin_o.x, (wo,))      # the attention's own q8, or quantize_q8 now
        ops._reads_float(x)
        hq, hs = ops._q8_views(h)
        fq, fs = ops._q8_views(f)
        ffn_fused.ffn_fused(wo, wg, wu, wd, aq, as_, x, norm_f.w, ops.cfg.rms_eps, hq, hs, f, fq, fs,
                            rt.ffn_counters, next_norm=next_norm, act=gated.extra, stream=ops.stream)
        for buf in (x, f, h):
            ops._wrote(buf)
        ops._no_float.add(ops._name(h))
        ops._q8_fresh.update((ops._name(h), ops._name(f)))
