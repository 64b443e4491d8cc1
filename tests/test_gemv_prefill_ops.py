"""GemvPrefillOps (engine/cuda_ops.py, EngineConfig.gemv_prefill): a chunk of up to 8 rows
runs the decode step's norm and GEMV launches on its n rows - no tensor-core GEMM, no fp16
input conversion - and PrefillOps' attention, whose split merge is launched before the O
projection's quantize_q8 reads the attention output.

No kernels run here (the launchers are loggers, the forward is engine/models/llama.py on a fake
runtime, as tests/test_prefill_merge_fusion.py): this checks what is launched, with how many rows
and in what order. The bits of an 8-row prefill against the CPU back-end are
tests/test_backend_cuda.py's (simulator)."""
from types import SimpleNamespace

import pytest

from genie_rt.engine import cuda_ops
from genie_rt.engine import norm as norm_mod
from genie_rt.engine.models import llama
from genie_rt.engine.models.ops import AttnLayer
from genie_rt.kvcache import attention_prefill, attention_prefill_kernels, rope_write
from genie_rt.quant import gemv, mmq

from test_prefill_merge_fusion import N_LAYERS, _Arena, _Buf, _Launcher, _layers, _rt


class _Rows(_Buf):
    """A buffer view that remembers how many rows it was cut to."""
    def __getitem__(self, key):
        rows = key.stop if isinstance(key, slice) else getattr(self, "rows", None)
        return _Rows(name=self.name, rows=rows)


class _RowsArena(_Arena):
    def __missing__(self, key):
        v = self[key] = _Rows(name=key)
        return v


def _w(name):
    return SimpleNamespace(name=name, gemv=SimpleNamespace(name=name, mode="dp4a"))


@pytest.fixture
def log(monkeypatch):
    out = []
    for fn in ("prepare_x", "mmq"):
        monkeypatch.setattr(mmq, fn, lambda *a, _fn=fn, **k: out.append((_fn, None)))
    monkeypatch.setattr(gemv, "needs_q8", lambda *ws: True)
    monkeypatch.setattr(gemv, "quantize_q8", lambda x, xq, xs, **k: out.append(("quantize_q8", (x.name, xq.rows))))
    monkeypatch.setattr(gemv, "gemv", lambda w, x, y, xq=None, residual=None, **k: out.append(
        ("gemv", (w.name, xq.rows, residual is not None))))
    monkeypatch.setattr(gemv, "gemv_qkv", lambda wq, wk, wv, x, y, xq=None, **k: out.append(("gemv_qkv", xq.rows)))
    monkeypatch.setattr(gemv, "gemv_swiglu", lambda wg, wu, x, y, xq=None, **k: out.append(("gemv_swiglu", xq.rows)))
    monkeypatch.setattr(norm_mod, "rmsnorm_q8", lambda x, w, xq, xs, eps, **k: out.append(("rmsnorm_q8", (w, xq.rows))))
    monkeypatch.setattr(rope_write, "rope_write", lambda *a, **k: out.append(("rope_write", None)))
    monkeypatch.setattr(attention_prefill, "prefill_attention", lambda q, layer, state, o, ws, n_splits=1, merge=True,
                        **k: out.append(("attention", (n_splits, merge))))
    monkeypatch.setattr(attention_prefill_kernels, "prefill_merge", _Launcher(out, "prefill_merge"))
    return out


def _ops(n, most):
    rt = _rt(most)
    rt.arena = _RowsArena()
    rt.q8_inputs, rt.float_inputs = True, False
    ops = cuda_ops.GemvPrefillOps(rt, n, (most,), splits_at=5)
    s = SimpleNamespace(**{k: _Rows(name=k, rows=n) for k in ("ids", "x", "h", "qkv", "q", "attn", "ff")})
    ops.bind_scratch(s)
    return rt, ops, s


def _gemv_layers():
    return [llama.Layer(f"attn_norm.{i}", _w(f"wq.{i}"), _w(f"wk.{i}"), _w(f"wv.{i}"), _w(f"wo.{i}"),
                        f"ffn_norm.{i}", _w(f"gate.{i}"), _w(f"up.{i}"), _w(f"down.{i}")) for i in range(N_LAYERS)]


def test_a_short_chunk_runs_the_decode_launches_on_its_rows(log):
    rt, ops, s = _ops(n=8, most=3)
    attn = [AttnLayer(i, None, None, None, 1e4, 1.0, None, 0.5) for i in range(N_LAYERS)]
    for L, a in zip(_gemv_layers(), attn):
        llama.layer(ops, L, a, s)
    ops.finish()
    assert rt.pending_launch is None
    kinds = [k for k, _ in log]
    assert "mmq" not in kinds and "prepare_x" not in kinds
    assert log[:11] == [("rmsnorm_q8", ("attn_norm.0", 8)), ("gemv_qkv", 8), ("rope_write", None),
                        ("attention", (3, False)), ("prefill_merge", None), ("quantize_q8", ("attn", 8)),
                        ("gemv", ("wo.0", 8, True)), ("rmsnorm_q8", ("ffn_norm.0", 8)), ("gemv_swiglu", 8),
                        ("quantize_q8", ("ff", 8)), ("gemv", ("down.0", 8, True))]
    assert kinds.count("prefill_merge") == N_LAYERS


def test_without_splits_the_attention_output_is_quantized_at_once(log):
    rt, ops, s = _ops(n=3, most=1)
    llama.layer(ops, _gemv_layers()[0], AttnLayer(0, None, None, None, 1e4, 1.0, None, 0.5), s)
    assert log[3:6] == [("attention", (1, False)), ("quantize_q8", ("attn", 3)), ("gemv", ("wo.0", 3, True))]


def test_more_rows_than_the_gemv_takes_are_refused():
    with pytest.raises(AssertionError, match="GemvPrefillOps"):
        _ops(n=gemv.MAX_TOKENS + 1, most=1)
