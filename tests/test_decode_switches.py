"""The CUDA decode step's switches, each against the step without it (engine/cuda_ops.py,
EngineConfig): the attention writing its q8, the PDL builds, the fused rope and the
short-context graph (decode_short_ctx). In the
simulator (slow) on a 2-layer model, the launches and the logits' bits; on a GPU (marker gpu)
through the captured graphs, replay after replay. The back-end against the CPU back-end is
test_backend_cuda.py, whose helpers these tests share.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from synth_gguf import write_synthetic_qwen3  # noqa: E402
from test_backend_cuda import SIM, assert_greedy_agrees, cosine_rows, make_backends  # noqa: E402


@pytest.fixture(scope="module")
def prompts(llamacpp_logits):
    return [llamacpp_logits[f"tokens_{i}"] for i in range(3)]


def _tiny_decode_backends(tmp_path, kv, warm=True):
    """(CUDA back-end, CPU back-end, config) of a 2-layer synthetic Qwen3 small enough for the
    simulator's decode step, for the tests that decode one token with a switch on and off."""
    path = tmp_path / "tiny2.gguf"
    write_synthetic_qwen3(path, dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=1, exact=True)
    return make_backends(path, kv, n_ctx=64, chunk=16, warm=warm)


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_gpu_decode_attention_q8_same_bits)")
def test_simulated_decode_attention_writes_its_q8(tmp_path, monkeypatch):
    """EngineConfig.decode_attention_q8: the attention launch writes its output's q8 blocks, so
    the decode step quantizes only the FFN's hidden state (one quantize_q8 a layer instead of
    two), and the logits are the same bits as with the separate launch."""
    import dataclasses

    from genie_rt.quant import gemv
    gpu, _, cfg = _tiny_decode_backends(tmp_path, "int8", warm=False)
    calls = []
    real = gemv.quantize_q8
    monkeypatch.setattr(gemv, "quantize_q8", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got = {}
    for on in (True, False):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_attention_q8=on)
        calls.clear()
        got[on] = gpu.decode(77, 5)                  # the same token at the same position
        assert len(calls) == (1 if on else 2) * cfg.n_layers, f"attention_q8={on}: {len(calls)} quantize_q8"
    np.testing.assert_array_equal(got[True].view(np.int32), got[False].view(np.int32))


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_pdl_decode_graph_gives_the_same_bits)")
def test_simulated_decode_pdl_builds(tmp_path, monkeypatch):
    """EngineConfig.decode_pdl with the device's PDL pretended (the simulator launches a PDL
    build plainly and runs griddepcontrol as no-ops): every kernel of the step is asked for
    its PDL build - the norms, the GEMVs, rope_write, the attention, quantize_q8 - and the
    logits are the same bits as the plain builds'. That the builds wait before their first read of the kernel before is a property
    of the code (the PTX tests check each PDL build carries the wait); a GPU replays it."""
    import dataclasses

    from genie_rt.engine import cuda_ops, norm
    from genie_rt.kvcache import attention, rope_write
    from genie_rt.quant import gemv
    gpu, _, cfg = _tiny_decode_backends(tmp_path, "int8", warm=False)
    seen = []

    def spy(mod, name):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: (seen.append((name, bool(k.get("pdl")))), real(*a, **k))[1])
    for mod, name in ((norm, "rmsnorm_q8"), (gemv, "gemv"), (gemv, "gemv_qkv"), (gemv, "gemv_swiglu"),
                      (gemv, "quantize_q8"), (rope_write, "rope_write"), (attention, "decode_attention"),
                      (attention, "decode_rope_attention")):
        spy(mod, name)
    monkeypatch.setattr(cuda_ops, "_pdl_available", lambda: True)
    got = {}
    for on in (False, True):                           # (rope_write's own PDL build: the GPU tests)
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_pdl=on)
        seen.clear()
        got[on] = gpu.decode(77, 5)                    # the same token at the same position
        bad = [(n, p) for n, p in seen if p != on]
        assert not bad, (on, bad)
        assert {n for n, _ in seen} == {"rmsnorm_q8", "gemv", "gemv_qkv", "gemv_swiglu", "quantize_q8",
                                        "decode_rope_attention"}, seen
    np.testing.assert_array_equal(got[True].view(np.int32), got[False].view(np.int32))


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_gpu_decode_fused_rope_same_bits)")
def test_simulated_decode_fused_rope(tmp_path, monkeypatch):
    """EngineConfig.decode_fused_rope: rope_write's work runs inside the attention's launch
    (kvcache/attention_decode_rope.py) - no rope_write launch, one attention launch a layer - and
    the step gives the same logits' bits and writes the same cache rows as with rope_write's own
    launch (steps that read rows the launch wrote, f16, rings: tests/test_attention_rope.py)."""
    import dataclasses

    from genie_rt.kvcache import attention, rope_write
    gpu, _, cfg = _tiny_decode_backends(tmp_path, "int8", warm=False)
    calls = []
    for mod, name in ((rope_write, "rope_write"), (attention, "decode_attention"),
                      (attention, "decode_rope_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    got, caches = {}, {}
    for on in (True, False):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_fused_rope=on)
        calls.clear()
        got[on] = gpu.decode(77, 5)
        want = ["decode_rope_attention"] if on else ["decode_attention", "rope_write"]
        assert sorted(set(calls)) == want and len(calls) == len(want) * cfg.n_layers, (on, calls)
        caches[on] = [(lay.k.copy_to_host()[:7], lay.v.copy_to_host()[:7], lay.k_scale.copy_to_host()[:7],
                       lay.v_scale.copy_to_host()[:7]) for lay in gpu.kv_layers]
    np.testing.assert_array_equal(got[True].view(np.int32), got[False].view(np.int32))
    for a, b in zip(caches[True], caches[False]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_gpu_short_context_graph_agrees)")
def test_simulated_decode_short_context_plans(tmp_path, monkeypatch):
    """EngineConfig.decode_short_ctx: a step below the threshold launches its attention with the
    short-context plans (one query head a block, their own workspace), a step at or above it with
    the others (two heads a block here), and both give the logits of one graph at every position
    (0: no short plans at all)."""
    import dataclasses

    from genie_rt.kvcache import attention
    gpu, _, cfg = _tiny_decode_backends(tmp_path, "int8", warm=False)
    assert gpu.ecfg.decode_short_ctx == 1024 and gpu.dws_short is not None
    assert {p.heads_per_block for p in gpu.lay.decode_plans_short} == {1}
    assert {p.heads_per_block for p in gpu.lay.decode_plans} == {2}
    seen = []
    real = attention.decode_rope_attention
    monkeypatch.setattr(attention, "decode_rope_attention",
                        lambda *a, **k: (seen.append((k["plan"].heads_per_block, a[9] is gpu.dws_short)),
                                         real(*a, **k))[1])
    gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_short_ctx=6)
    short = gpu.decode(77, 5)
    assert seen == [(1, True)] * cfg.n_layers
    seen.clear()
    gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_short_ctx=5)
    long_ = gpu.decode(77, 5)                          # the same step at the threshold: the other plans
    assert seen == [(2, False)] * cfg.n_layers
    np.testing.assert_allclose(short, long_, rtol=1e-5, atol=1e-5 * np.abs(long_).max())


@pytest.mark.gpu
def test_gpu_short_context_graph_agrees(tmp_path):
    """On the GPU, through the captured graphs: the short-context decode graph (one query head an
    attention block) and the other give the same logits at short positions (cosine >= 0.9999:
    the merge of splits groups its sums differently), and a greedy run that crosses the threshold
    (decode_short_ctx 20: both graphs, one after the other) agrees with the CPU back-end's."""
    import dataclasses
    gpu, cpu, _ = _tiny_decode_backends(tmp_path, "int8")
    assert gpu.dws_short is not None
    gpu.prefill(np.arange(3, 43, dtype=np.int32), 0)
    for pos in (0, 20, 40):
        got = {}
        for short_ctx in (0, 512):
            gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_short_ctx=short_ctx)
            got[short_ctx] = gpu.decode(77, pos)
        assert cosine_rows(got[0], got[512])[0] >= 0.9999, pos
    gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_short_ctx=20)
    assert_greedy_agrees(gpu, cpu, list(range(3, 11)), 40, "decode_short_ctx 20")


@pytest.mark.gpu
def test_gpu_decode_fused_rope_same_bits(tmp_path):
    """The same through the captured decode graph on the GPU (PDL builds where the device has
    them): the logits' bits of two steps with and without EngineConfig.decode_fused_rope."""
    import dataclasses
    gpu, _, _ = _tiny_decode_backends(tmp_path, "int8")
    got = {}
    for on in (False, True):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_fused_rope=on)
        gpu._graphs.clear()                          # record the decode graph anew
        gpu.decode(77, 5)
        got[on] = gpu.decode(78, 6)
    np.testing.assert_array_equal(got[True].view(np.int32), got[False].view(np.int32))


@pytest.mark.gpu
def test_gpu_decode_attention_q8_same_bits(tmp_path):
    """The same on the GPU, through the captured decode graph: the logits' bits with and
    without EngineConfig.decode_attention_q8."""
    import dataclasses
    gpu, _, _ = _tiny_decode_backends(tmp_path, "int8")
    got = {}
    for on in (False, True):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_attention_q8=on)
        gpu._graphs.clear()                          # record the decode graph anew
        got[on] = gpu.decode(77, 5)
    np.testing.assert_array_equal(got[True].view(np.int32), got[False].view(np.int32))


REPLAYS = 25


@pytest.mark.gpu
def test_pdl_decode_graph_gives_the_same_bits(tmp_path, prompts, monkeypatch):
    """EngineConfig.decode_pdl (quant/pdl.py, sm_90+; on by default there): every kernel of the
    decode graph launched by programmatic dependent launch (cuda_ops.PDL_KINDS, all kinds), or
    only the GEMVs and quantize_q8, gives the plain graph's logits bit for bit,
    replay after replay, with each capture replayed many times to catch a race.
    History: the GEMV-only form gave wrong logits in one run on the H200 (2026-12-03,
    afternoon, with the norm folded into the GEMVs on by default then) and the plain bits in
    every run since."""
    import dataclasses

    from genie_rt.engine import cuda_ops
    from genie_rt.quant import pdl
    if not pdl.available():
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    path = tmp_path / "synth.gguf"
    write_synthetic_qwen3(path, dict(layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                                     vocab=4122, text_tokens=4096), seed=0)
    gpu, _, _ = make_backends(path, "int8", n_ctx=256)
    tokens = np.concatenate(prompts)[:40]
    gpu.prefill(tokens, 0)
    gemv_only = frozenset({"gemv", "q8"})
    for short_ctx in (1024, 0):        # the short-context graph (position 40 < 1024), then the other
        got = []
        for use, scope in ((False, cuda_ops.PDL_ALL), (True, cuda_ops.PDL_ALL), (True, gemv_only),
                           (False, cuda_ops.PDL_ALL), (True, cuda_ops.PDL_ALL)):
            gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_pdl=use, decode_short_ctx=short_ctx)
            monkeypatch.setattr(cuda_ops, "PDL_KINDS", scope)
            for key in [k for k in gpu._graphs if k[0] == "decode"]:
                gpu._graphs.pop(key).close()                 # captured again with this setting
            got.append((use, scope, [gpu.decode(11, 40) for _ in range(REPLAYS)]))  # capture + run, then replays
        ref = got[0][2][0].view(np.int32)
        for use, scope, runs in got:
            for k, logits in enumerate(runs):
                np.testing.assert_array_equal(logits.view(np.int32), ref,
                                              err_msg=f"decode_short_ctx={short_ctx}, decode_pdl={use} "
                                                      f"({sorted(scope)}), run {k}")


@pytest.mark.gpu
def test_gpu_qk8_decode_matches_cpu(tmp_path, prompts, monkeypatch):
    """kvcache/attention.py QK_DP4A (lab): the decode attention scoring with q quantized to int8 a
    lane slice at a time still meets the int8 cache's bar against the CPU back-end (cosine >= 0.998)
    at the 4B's layer shape, through both decode graphs, step after step at growing positions."""
    import dataclasses

    import genie_rt.kvcache.attention as A
    monkeypatch.setattr(A, "QK_DP4A", True)
    path = tmp_path / "synth.gguf"
    write_synthetic_qwen3(path, dict(layers=2, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728,
                                     vocab=4122, text_tokens=4096), seed=0)
    gpu, cpu, _ = make_backends(path, "int8", n_ctx=256)
    gpu._graphs.clear()                                  # captured anew with the knob on
    tokens = np.concatenate(prompts)[:90]
    gpu.prefill(tokens, 0)
    cpu.prefill(tokens, 0)
    for pos, short_ctx in ((90, 1024), (91, 1024), (92, 0), (93, 0)):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_short_ctx=short_ctx)
        got, ref = gpu.decode(11 + pos, pos), cpu.decode(11 + pos, pos)
        assert cosine_rows(got, ref)[0] >= 0.998, (pos, short_ctx)
