"""PrefillOps (engine/cuda_ops.py): a split prefill attention leaves its merge pending, and
the O-projection's input conversion does it (kvcache/attention_merge.py, one launch instead of
prefill_merge + prepare_x); any other op launches the merge on its own first, and so does the
end of a recording. Without splits nothing changes.

No kernels run here (the launchers are loggers, the forward is engine/models/llama.py on a fake
runtime): this checks what is launched, in what order. The bits of the fused launch are
tests/test_attention_merge.py's."""
from types import SimpleNamespace

import pytest

from genie_rt.engine import cuda_ops
from genie_rt.engine.models import llama
from genie_rt.engine.models.ops import AttnLayer
from genie_rt.kvcache import attention_merge, attention_prefill, attention_prefill_kernels, rope_write
from genie_rt.quant import mmq

N_LAYERS = 2


class _Buf(SimpleNamespace):
    shape = (4, 8)

    def reshape(self, *shape):
        return self

    def __getitem__(self, key):
        return self


class _Arena(dict):
    def __missing__(self, key):
        v = self[key] = _Buf(name=key)
        return v


class _Launcher:
    def __init__(self, log, kind):
        self.log, self.kind = log, kind

    def __getitem__(self, config):
        return lambda *a: self.log.append((self.kind, None))


@pytest.fixture
def log(monkeypatch):
    out = []
    monkeypatch.setattr(mmq, "prepare_x", lambda x, *a, norm_weight=None, **k: out.append(
        ("prepare_x", "norm" if norm_weight is not None else x.name)))
    monkeypatch.setattr(mmq, "mmq", lambda w, *a, **k: out.append(("mmq", w)))
    monkeypatch.setattr(rope_write, "rope_write", lambda *a, **k: out.append(("rope_write", None)))
    monkeypatch.setattr(attention_prefill, "prefill_attention", lambda q, layer, state, o, ws, n_splits=1, merge=True,
                        **k: out.append(("attention", (n_splits, merge))))
    monkeypatch.setattr(attention_merge, "merge_prepare_x", lambda po, pm, most, state, at, x, *a, **k: out.append(
        ("merge_prepare_x", (most, at, x.name))))
    monkeypatch.setattr(attention_prefill_kernels, "prefill_merge", _Launcher(out, "prefill_merge"))
    return out


def _rt(most):
    plan = object()
    stacks = {}
    for i in range(N_LAYERS):
        for names in ((f"wq.{i}", f"wk.{i}", f"wv.{i}"), (f"wo.{i}",), (f"gate.{i}", f"up.{i}"), (f"down.{i}",)):
            stacks[names] = ["+".join(names)]
    return SimpleNamespace(arena=_Arena(), stream=0, cfg=SimpleNamespace(rms_eps=1e-6, n_head=2, head_dim=4, rope_style="neox"),
                           stacks=stacks, pending_launch=None, kv_layers=[None] * N_LAYERS, state=None,
                           pws=SimpleNamespace(part_o=None, part_ml=None), rope_table=lambda a: (None, None),
                           lay=SimpleNamespace(prefill_plans=[plan] * N_LAYERS), _plans=lambda: [plan],
                           most=most)


def _m(name):
    return SimpleNamespace(name=name)


def _ops(most):
    rt = _rt(most)
    ops = cuda_ops.PrefillOps(rt, 4, (most,), splits_at=5)
    s = SimpleNamespace(**{n: _Buf(name=n) for n in ("ids", "x", "h", "qkv", "q", "attn", "ff")})
    ops.bind_scratch(s)
    return rt, ops, s


def _layers():
    return [llama.Layer(f"attn_norm.{i}", _m(f"wq.{i}"), _m(f"wk.{i}"), _m(f"wv.{i}"), _m(f"wo.{i}"),
                        f"ffn_norm.{i}", _m(f"gate.{i}"), _m(f"up.{i}"), _m(f"down.{i}")) for i in range(N_LAYERS)]



def test_split_attention_is_merged_inside_the_o_projections_input_conversion(log):
    rt, ops, s = _ops(most=3)
    attn = [AttnLayer(i, None, None, None, 1e4, 1.0, None, 0.5) for i in range(N_LAYERS)]
    for L, a in zip(_layers(), attn):
        llama.layer(ops, L, a, s)
    ops.finish()
    assert rt.pending_launch is None
    assert not any(k == "prefill_merge" for k, _ in log)
    assert log[:8] == [("prepare_x", "norm"), ("mmq", "wq.0+wk.0+wv.0"), ("rope_write", None),
                       ("attention", (3, False)), ("merge_prepare_x", (3, 5, "attn")), ("mmq", "wo.0"),
                       ("prepare_x", "norm"), ("mmq", "gate.0+up.0")]
    assert [k for k, _ in log].count("merge_prepare_x") == N_LAYERS


def test_without_splits_nothing_is_pending(log):
    rt, ops, s = _ops(most=1)
    llama.layer(ops, _layers()[0], AttnLayer(0, None, None, None, 1e4, 1.0, None, 0.5), s)
    assert rt.pending_launch is None and not any(k in ("merge_prepare_x", "prefill_merge") for k, _ in log)
    assert log[3:6] == [("attention", (1, False)), ("prepare_x", "attn"), ("mmq", "wo.0")]


def test_any_other_reader_or_the_end_of_the_recording_launches_the_merge_first(log):
    a = AttnLayer(0, None, None, None, 1e4, 1.0, None, 0.5)
    rt, ops, s = _ops(most=2)
    ops.attention(s.q, a, out=s.attn)
    assert rt.pending_launch is not None
    ops.norm(s.attn, "w", out=s.h)                       # reads attn as float: the merge first
    assert [k for k, _ in log] == ["attention", "prefill_merge", "prepare_x"] and rt.pending_launch is None
    ops.attention(s.q, a, out=s.attn)
    ops.attention(s.q, a, out=s.attn)                    # the workspace is reused: merge the first
    assert [k for k, _ in log[-3:]] == ["attention", "prefill_merge", "attention"]
    ops.linear(s.h, _m("wo.0"), out=s.x, add=True)       # a GEMM of another input (its fp16 copy held)
    assert [k for k, _ in log[-2:]] == ["prefill_merge", "mmq"]
    ops.attention(s.q, a, out=s.attn)
    ops.finish()
    assert log[-1] == ("prefill_merge", None) and rt.pending_launch is None
