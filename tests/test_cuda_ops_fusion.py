"""DecodeOps' peephole (engine/cuda_ops.py): rope_write waits for the next op, and if that op is
the attention that reads its q both become one launch (decode_rope_attention); and the
decode configuration's switches.

No kernels run here: the launchers are replaced by loggers and the forwards of
engine/models/ run on a fake runtime, so these tests check only what is launched, in what
order - fast, on any machine. The bits of the fused launch, in a real recorded decode step
(simulator and GPU), are tests/test_decode_switches.py's.
"""
import argparse
from types import SimpleNamespace

import pytest

from genie_rt.engine import cuda_ops, norm, post_norm
from genie_rt.engine.models import gemma3, llama
from genie_rt.engine.models.ops import AttnLayer, Ops
from genie_rt.kvcache import attention, rope_write
from genie_rt.quant import embed, gemv

N_LAYERS = 3


class _Arena(dict):
    def __missing__(self, key):
        v = self[key] = SimpleNamespace(name=key)
        return v


def _matrix(name, mode="dp4a"):
    return SimpleNamespace(name=name, gemv=SimpleNamespace(name=name, mode=mode, rows=4))


def _rt(float_inputs=False, fused_rope=False):
    return SimpleNamespace(arena=_Arena(), stream=0, cfg=SimpleNamespace(rms_eps=1e-6, n_head=1, head_dim=4,
                                                                            rope_style="neox"),
                           ecfg=SimpleNamespace(decode_fused_rope=fused_rope), q8_inputs=True,
                           float_inputs=float_inputs,
                           embd_planes=None, pending_launch=None, kv_layers=[None] * N_LAYERS, state=None,
                           dws=None, lay=SimpleNamespace(decode_plans=[None] * N_LAYERS),
                           rope_table=lambda a: (None, None))


@pytest.fixture
def log(monkeypatch):
    """The launches, in order: (kind, detail)."""
    out = []

    monkeypatch.setattr(gemv, "gemv", lambda w, *a, **k: out.append(("gemv", w.name)))
    monkeypatch.setattr(gemv, "gemv_qkv", lambda *a, **k: out.append(("qkv", a[0].name)))
    monkeypatch.setattr(gemv, "gemv_swiglu", lambda *a, **k: out.append(("gated", a[0].name)))
    monkeypatch.setattr(gemv, "quantize_q8", lambda x, *a, **k: out.append(("quantize_q8", None)))
    monkeypatch.setattr(norm, "rmsnorm_q8", lambda x, w, *a, **k: out.append(("rmsnorm_q8", w)))
    monkeypatch.setattr(norm, "rmsnorm", lambda x, w, *a, **k: out.append(("rmsnorm", w)))
    monkeypatch.setattr(post_norm, "post_norm_add", lambda x, y, w, *a, **k: out.append(("post_norm_add", w)))
    monkeypatch.setattr(embed, "embed", lambda *a, **k: out.append(("embed", None)))
    monkeypatch.setattr(rope_write, "rope_write", lambda *a, **k: out.append(("rope_write", None)))
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: out.append(("attention", None)))
    monkeypatch.setattr(attention, "decode_rope_attention",
                        lambda qkv, *a, **k: out.append(("rope_attention", (qkv.name, k["rope"]))))
    return out


class _Buf(SimpleNamespace):
    def reshape(self, *shape):
        return self


def _scratch(gemma=False):
    names = ["x", "h", "qkv", "q", "attn", "ff"] + (["y"] if gemma else [])
    return SimpleNamespace(ids=None, **{n: _Buf(name=n, shape=(1, 8)) for n in names})


def _record(rt, spec, layers, gemma=False):
    ops = cuda_ops.DecodeOps(rt)
    s = _scratch(gemma)
    ops.bind_scratch(s)
    attn = [AttnLayer(i, None, None, None, 1e4, 1.0, None, 0.5) for i in range(len(layers))]
    w = SimpleNamespace(tok_embd=SimpleNamespace(packed=None), layers=layers, output_norm="output_norm",
                        output=_matrix("output"))
    spec.body(ops, w, attn, s, SimpleNamespace(embd_scale=None, logit_softcap=None))
    spec.head(ops, w, s.x, "logits", SimpleNamespace(logit_softcap=None))
    ops.finish()
    assert rt.pending_launch is None
    return ops


def _llama_layers(mode="dp4a"):
    return [llama.Layer(f"attn_norm.{i}", _matrix(f"wq.{i}"), _matrix(f"wk.{i}"), _matrix(f"wv.{i}"),
                        _matrix(f"wo.{i}", mode), f"ffn_norm.{i}", _matrix(f"gate.{i}"), _matrix(f"up.{i}"),
                        _matrix(f"down.{i}", mode)) for i in range(N_LAYERS)]


def _norms(log):
    return [d for k, d in log if k == "rmsnorm_q8"]


def test_every_decode_norm_is_its_own_launch(log):
    """Two norms a layer and the head's, each one rmsnorm_q8 launch in the step's order, right
    before the launch that reads it."""
    _record(_rt(), llama, _llama_layers())
    expect = []
    for i in range(N_LAYERS):
        expect += [f"attn_norm.{i}", f"ffn_norm.{i}"]
    assert _norms(log) == expect + ["output_norm"]
    i = log.index(("rmsnorm_q8", "ffn_norm.0"))
    assert log[i - 1] == ("gemv", "wo.0") and log[i + 1] == ("gated", "gate.0")
    assert log[-1] == ("gemv", "output")


def test_gemma3_post_norms(log):
    layers = [gemma3.Layer(f"attn_norm.{i}", _matrix(f"wq.{i}"), _matrix(f"wk.{i}"), _matrix(f"wv.{i}"), None, None,
                           _matrix(f"wo.{i}"), f"post_attn.{i}", f"ffn_norm.{i}", _matrix(f"gate.{i}"),
                           _matrix(f"up.{i}"), _matrix(f"down.{i}"), f"post_ffn.{i}") for i in range(N_LAYERS)]
    _record(_rt(), gemma3, layers, gemma=True)
    assert len(_norms(log)) == 2 * N_LAYERS + 1
    assert [d for k, d in log if k == "post_norm_add"][:2] == ["post_attn.0", "post_ffn.0"]


def test_every_op_launches_a_held_rope_write_first():
    """Every op of the vocabulary but head (which starts with norm) is wrapped to launch a held
    rope_write before its own work; the attention takes it instead where it reads its q (below)."""
    ops_names = [n for n in vars(Ops) if not n.startswith("_")]
    assert set(ops_names) >= {"embed", "norm", "linear", "gated", "attention", "rope_write", "post_norm_add", "head"}
    for name in ops_names:
        if name != "head":
            assert getattr(getattr(cuda_ops.DecodeOps, name), "flushes", False), f"DecodeOps.{name} does not flush"


def test_fused_rope_each_layer_ropes_inside_its_attention_launch(log):
    """EngineConfig.decode_fused_rope: rope_write is held and launched inside the attention
    that reads its q (kvcache/attention_decode_rope.py): no rope_write launch, one attention
    launch a layer, right after the QKV GEMV."""
    _record(_rt(fused_rope=True), llama, _llama_layers())
    kinds = [e[0] for e in log]
    assert "rope_write" not in kinds and "attention" not in kinds
    assert kinds.count("rope_attention") == N_LAYERS
    for i in range(N_LAYERS):
        j = log.index(("qkv", f"wq.{i}"))
        assert log[j + 1] == ("rope_attention", ("qkv", "neox"))
    _record(_rt(fused_rope=False), llama, _llama_layers())      # off: the two launches
    assert [e[0] for e in log].count("rope_write") == N_LAYERS


def test_a_held_rope_write_launches_before_any_other_op(log):
    rt = _rt(fused_rope=True)
    ops = cuda_ops.DecodeOps(rt)
    s = _scratch()
    ops.bind_scratch(s)
    a = AttnLayer(0, None, None, None, 1e4, 1.0, None, 0.5)
    ops.rope_write(s.qkv, a, q_out=s.q)
    assert log == [] and rt.pending_launch == "rope_write of layer 0"
    ops.linear(s.q, _matrix("wo"), out=s.x)              # reads q: rope_write goes first, on its own
    assert [k for k, _ in log][:1] == ["rope_write"] and rt.pending_launch is None
    log.clear()
    ops.rope_write(s.qkv, a, q_out=s.q)
    ops.attention(s.h, a, out=s.attn)                    # attention of another buffer: no fusion
    assert [k for k, _ in log] == ["rope_write", "attention"]
    log.clear()
    ops.rope_write(s.qkv, a, q_out=s.q)
    ops.finish()                                         # the end of a recording launches it
    assert [k for k, _ in log] == ["rope_write"] and rt.pending_launch is None
    log.clear()
    ops.rope_write(s.qkv, a, q_out=s.q)
    ops.attention(s.q, AttnLayer(1, None, None, None, 1e4, 1.0, None, 0.5), out=s.attn)   # another layer
    assert [k for k, _ in log] == ["rope_write", "attention"]
    log.clear()
    ops.rope_write(s.qkv, a, q_out=s.q)
    ops.attention(s.q, a, out=s.attn)                    # fused: q is never written ...
    assert [k for k, _ in log] == ["rope_attention"]
    with pytest.raises(AssertionError, match="q holds no float values"):
        ops.linear(s.q, _matrix("wo"), out=s.x)          # ... so reading it is refused at recording


def test_fused_rope_config_and_cli_switch():
    from genie_rt.engine.config import EngineConfig
    assert EngineConfig().decode_fused_rope is True
    with pytest.raises(ValueError, match="decode_fused_rope"):
        EngineConfig(decode_fused_rope=1)
    assert _cli_config([]).decode_fused_rope is True
    assert _cli_config(["--no-fused-rope"]).decode_fused_rope is False


def test_attention_splits_config_and_cli():
    from genie_rt.engine.config import MAX_DECODE_ATTENTION_SPLITS, EngineConfig
    from genie_rt.kvcache.attention import MAX_SPLITS, plan_decode
    assert MAX_DECODE_ATTENTION_SPLITS == MAX_SPLITS
    assert EngineConfig().decode_attention_splits is None
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="decode_attention_splits"):
            EngineConfig(decode_attention_splits=bad)
    assert _cli_config(["--attention-splits", "24"]).decode_attention_splits == 24
    with pytest.raises(ValueError, match="--attention-splits must be in 1..64"):
        _cli_config(["--attention-splits", "0"])
    # the plan takes it, capped by the pool's tiles (64 rows of int8 at hd 128)
    assert plan_decode(32, 8, 128, "int8", 8192, n_splits=24).n_splits == 24
    assert plan_decode(32, 8, 128, "int8", 8192, sm_count=132).n_splits == 16
    assert plan_decode(32, 8, 128, "int8", 1024, n_splits=24).n_splits == 16


def test_short_ctx_config_cli_and_the_layouts_short_plans(tmp_path, monkeypatch):
    """EngineConfig.decode_short_ctx (--attention-short-ctx): below it the decode step runs a graph
    whose attention plans take one query head a block, in a workspace of their own in the layout;
    0, or a model whose plans take one head a block anyway, has none."""
    from genie_rt.engine.config import EngineConfig, ModelConfig
    from genie_rt.engine.cuda_layout import plan_layout
    import sys
    from pathlib import Path

    from genie_rt.engine.gguf_file import open_gguf
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from synth_gguf import write_synthetic_qwen3
    assert EngineConfig().decode_short_ctx == 1024
    for bad in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match="decode_short_ctx"):
            EngineConfig(decode_short_ctx=bad)
    assert _cli_config([]).decode_short_ctx == 1024
    assert _cli_config(["--attention-short-ctx", "0"]).decode_short_ctx == 0
    with pytest.raises(ValueError, match="--attention-short-ctx must be >= 0"):
        _cli_config(["--attention-short-ctx", "-5"])
    from genie_rt.engine import cuda_layout
    monkeypatch.setattr(cuda_layout, "mma_measured_here", lambda: False)   # the warp loop's plans, on any GPU
    lays = {}
    for heads, kv in ((8, 2), (4, 4)):
        path = tmp_path / f"tiny{heads}.gguf"
        write_synthetic_qwen3(path, dict(layers=2, hidden=256, heads=heads, kv_heads=kv, head_dim=64, ffn=256,
                                         vocab=300, text_tokens=274), seed=0)
        g = open_gguf(path)
        cfg = ModelConfig.from_gguf(g)
        for short in (0, 512):
            ecfg = EngineConfig(backend="cuda", n_ctx=1024, kv_dtype="int8", prefill_chunk=16,
                                decode_short_ctx=short)
            lays[heads, short] = plan_layout(g, cfg, ecfg, 1024)
    lay = lays[8, 512]                   # a group of 4: two heads a block, and one in the short graph
    assert {p.heads_per_block for p in lay.decode_plans} == {2}
    assert {p.heads_per_block for p in lay.decode_plans_short} == {1} == {lay.decode_plan_short.heads_per_block}
    # no GPU: 132 SMs, two blocks an SM - more than the tiles (128 rows at hd 64): the short graph's
    # splits are capped by its 512 positions, the other's by the pool's 1,024
    assert lay.decode_plan_short.n_splits == 4 and lay.decode_plan.n_splits == 8
    assert lay.layout.entries["ws.decode_short"].nbytes >= lay.decode_plan_short.workspace_bytes
    for key in ((8, 0), (4, 512), (4, 0)):   # off, or one head a block anyway: no short graph
        assert lays[key].decode_plans_short is None and "ws.decode_short" not in lays[key].layout.entries
    # a GPU that cannot hold one split of one-head blocks in a wave (3 SMs here, 8 x 2 KV heads x 4
    # subgroups; the 4B on an 8-SM Orin): no short graph either
    from genie_rt.kvcache import attention
    real = attention.wave_splits
    assert real(2, 4, 1, 8, 2, sm_count=3) == 0 and real(2, 4, 1, 8, 2, sm_count=4) == 1
    assert real(8, 4, 1, 8, 2, sm_count=8) == 0 and real(8, 2, 2, 8, 2, sm_count=8) == 1
    monkeypatch.setattr(attention, "wave_splits", lambda *a, **k: real(*a[:5], sm_count=3))
    g = open_gguf(tmp_path / "tiny8.gguf")
    lay = plan_layout(g, ModelConfig.from_gguf(g), EngineConfig(backend="cuda", n_ctx=1024, kv_dtype="int8",
                                                                prefill_chunk=16), 1024)
    assert lay.decode_plans_short is None and "ws.decode_short" not in lay.layout.entries


def test_the_runtime_refuses_a_recording_that_leaves_a_launch_pending():
    from genie_rt.engine.backend_cuda import CUDABackend
    rt = SimpleNamespace(pending_launch="stale")
    CUDABackend._recorded(rt, lambda: None)            # a stale mark from a failed recording is cleared
    with pytest.raises(AssertionError, match="rope_write of layer 0 still pending"):
        CUDABackend._recorded(rt, lambda: setattr(rt, "pending_launch", "rope_write of layer 0"))


def _cli_config(argv):
    """The EngineConfig the CLI's model options make of argv."""
    from genie_rt.engine.cli import _add_model_args, _engine_config
    p = argparse.ArgumentParser()
    _add_model_args(p)
    return _engine_config(p.parse_args(argv))


def test_pdl_is_on_by_default_and_no_pdl_turns_it_off():
    """EngineConfig.decode_pdl: programmatic dependent launch of the decode step, on by default
    (only an sm_90+ device acts on it: cuda_ops.DecodeOps asks pdl.available()); --no-pdl."""
    from genie_rt.engine.config import EngineConfig
    assert EngineConfig().decode_pdl is True
    with pytest.raises(ValueError, match="decode_pdl"):
        EngineConfig(decode_pdl="off")
    assert _cli_config([]).decode_pdl is True
    assert _cli_config(["--no-pdl"]).decode_pdl is False


def test_attention_loop_config_cli_and_the_layouts_plans(tmp_path):
    """EngineConfig.decode_attention_loop (--attention-loop): None is the kernel module's measured
    default; a name reaches every decode plan of the layout (the plans the step launches with);
    a wrong name is refused naming the choices."""
    from genie_rt.engine.config import DECODE_ATTENTION_LOOPS, EngineConfig, ModelConfig
    from genie_rt.engine.cuda_layout import plan_layout
    import sys
    from pathlib import Path

    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.kvcache.attention import DEFAULT_LOOP
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from synth_gguf import write_synthetic_qwen3
    assert EngineConfig().decode_attention_loop is None and DEFAULT_LOOP in DECODE_ATTENTION_LOOPS
    with pytest.raises(ValueError, match="decode_attention_loop must be one of"):
        EngineConfig(decode_attention_loop="fast")
    assert _cli_config([]).decode_attention_loop is None
    assert _cli_config(["--attention-loop", "warp"]).decode_attention_loop == "warp"
    with pytest.raises(ValueError, match="warp-nopf"):
        _cli_config(["--attention-loop", "fast"])
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    for loop in (None,) + DECODE_ATTENTION_LOOPS:
        ecfg = EngineConfig(backend="cuda", n_ctx=64, kv_dtype="int8", prefill_chunk=16,
                            decode_attention_loop=loop)
        lay = plan_layout(g, cfg, ecfg, 64)
        assert {p.loop for p in lay.decode_plans} == {loop or DEFAULT_LOOP}
        assert lay.decode_plan.loop == (loop or DEFAULT_LOOP)


def test_the_long_graphs_default_loop_is_mma_only_where_it_was_measured():
    """cuda_layout.decode_loop: with no --attention-loop the long-context graph takes the tensor-core
    loop on sm_90+ (H100, 2026-12-05: 463.7 / 391.9 tokens/s at depths 4,096 / 16,384 against
    457.0 / 351.7) for the shapes it was measured on, and the kernel module's default anywhere else;
    a given loop always wins."""
    from types import SimpleNamespace

    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.cuda_layout import decode_loop

    def cfg(heads=32, kv=8, hd=128):
        return SimpleNamespace(n_head=heads, n_head_kv=kv, head_dim=hd)

    def loop(c=None, measured=True, windows=(None,), **kw):
        ecfg = EngineConfig(backend="cuda", kv_dtype=kw.pop("kv_dtype", "int8"), **kw)
        return decode_loop(c or cfg(), ecfg, list(windows), measured, sm_count=132)
    assert loop() == "mma"                                    # Qwen3-4B: 32 / 8 heads, hd 128
    assert loop(cfg(32, 8, 64)) == "mma" and loop(cfg(64, 8, 128)) == "mma"   # hd 64; a group of 8
    assert loop(measured=False) is None                       # the simulator, sm_80 / sm_87
    assert loop(kv_dtype="f16") is None                       # the mma loop reads int8 caches only
    assert loop(cfg(16, 8, 128)) is None and loop(cfg(96, 8, 128)) is None   # groups of 2 and 12
    assert loop(cfg(4, 1, 256)) is None                       # head_dim 256 (Gemma 3) would spill
    assert loop(windows=(512, None)) is None                  # windowed layers: not measured
    assert loop(decode_short_ctx=0) is None                   # no short graph: every position
    ecfg = EngineConfig(backend="cuda", kv_dtype="int8")      # nor where one-head blocks overflow a wave
    assert decode_loop(cfg(), ecfg, [None], True, sm_count=8) is None     # the 4B on an 8-SM Orin
    assert loop(decode_attention_loop="warp") == "warp"
    assert loop(measured=False, decode_attention_loop="mma") == "mma"
