"""engine/cuda_short_prefill.py: up to 8 new tokens as a decode-shaped graph on gemv_mma_k (lab).

- Which models it takes: every layer matrix Q4_K or Q6_K with columns a multiple of 256.
- In the simulator, on a one-layer Qwen3 file with Q4_K and Q6_K matrices: a prompt cached by the
  MMQ prefill, then 5 new tokens by the short graph - the logits against the CPU back-end's for
  the whole text (cosine >= 0.999: its activations are q8_K where the CPU's are float32), the same
  argmax, and the K/V rows it wrote: the decode step after it agrees with the CPU's. A chunk of
  more than 8 tokens keeps the MMQ bucket.
- By programmatic dependent launch (the lab knob cuda_short_prefill.PDL with EngineConfig.decode_pdl,
  sm_90+): the same bits.
"""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from genie_rt.engine.cuda_short_prefill import unfit_reason
from genie_rt.quant.formats import QType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from synth_gguf import write_synthetic_qwen3  # noqa: E402

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


# the simulator tests' prompt (12 tokens: the MMQ bucket) and turn (5: the short graph)
PROMPT = np.array([5, 17, 100, 3, 250, 9, 42, 8, 61, 7, 199, 33], np.int32)
TURN = np.array([11, 4, 270, 90, 6], np.int32)


def _tiny(tmp_path):
    """A one-layer Qwen3 file of Q4_K and Q6_K matrices (the simulator tests')."""
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0, exact=True)
    return path


def _two_layers(tmp_path):
    """Two layers at real-ish widths, Q6_K attn_v and ffn_down among them (the GPU tests')."""
    path = tmp_path / "two.gguf"
    write_synthetic_qwen3(path, dict(layers=2, hidden=512, heads=8, kv_heads=2, head_dim=64, ffn=1536,
                                     vocab=1000, text_tokens=970), seed=1, exact=True)
    return path


def _prompt_and_turns(seed):
    """The GPU bits tests' 20-token prompt and turns of 1, 5, 8 and 8 tokens after it."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 256, 20).astype(np.int32)
    return prompt, [rng.integers(0, 256, n).astype(np.int32) for n in (1, 5, 8, 8)]


def _turns(gpu, prompt, turns, decode=True):
    """Each turn's logits after the prompt, and (decode) the decode step's after the turn: the K/V rows
    it wrote."""
    out = []
    for turn in turns:
        gpu.prefill(prompt, 0)
        out.append(gpu.prefill(turn, len(prompt)))
        if decode:
            out.append(gpu.decode(7, len(prompt) + len(turn)))
    return out


def _m(name, qtype, cols):
    return SimpleNamespace(name=name, packed=SimpleNamespace(qtype=qtype, cols=cols))


def test_unfit_reason_names_the_matrix():
    ok = SimpleNamespace(layers=[SimpleNamespace(attn_norm=np.ones(3), wq=_m("blk.0.attn_q.weight", QType.Q4_K, 512),
                                                 wv=_m("blk.0.attn_v.weight", QType.Q6_K, 512))])
    assert unfit_reason(ok) is None
    q8 = SimpleNamespace(layers=[SimpleNamespace(wq=_m("blk.0.attn_q.weight", QType.Q8_0, 512))])
    assert "blk.0.attn_q.weight is Q8_0" in unfit_reason(q8)
    odd = SimpleNamespace(layers=[SimpleNamespace(wq=_m("blk.3.ffn_down.weight", QType.Q4_K, 576))])
    assert "blk.3.ffn_down.weight has 576 columns" in unfit_reason(odd)


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: tools/gpu_check.sh s33)")
def test_simulated_short_prefill_matches_the_mmq_prefill_and_the_cpu(tmp_path):
    from test_backend_cuda import cosine_rows, make_backends
    path = _tiny(tmp_path)
    gpu, cpu, _ = make_backends(path, "f16", n_ctx=64, chunk=16, warm=False, short_prefill=True)
    assert gpu.short_prefill and set(gpu.short_gemv) == {f"blk.0.{n}.weight" for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    prompt, turn = PROMPT, TURN
    seen, real = [], gpu._record_prefill
    gpu._record_prefill = lambda n, splits, short=False: seen.append((n, short)) or real(n, splits, short)
    gpu.prefill(prompt, 0)
    got = gpu.prefill(turn, len(prompt))
    got_d = gpu.decode(77, len(prompt) + len(turn))
    assert seen == [(16, False), (8, True)]
    ref = cpu.prefill(np.concatenate([prompt, turn]), 0)
    ref_d = cpu.decode(77, len(prompt) + len(turn))
    assert np.isfinite(got).all() and np.isfinite(got_d).all()
    assert cosine_rows(got, ref)[0] >= 0.999 and got.argmax() == ref.argmax()
    assert cosine_rows(got_d, ref_d)[0] >= 0.999             # the K/V rows the short graph wrote
    # more than 8 new tokens: the MMQ bucket, not the short graph (its recording not run here)
    seen.clear()
    gpu._record_prefill = lambda n, splits, short=False: seen.append((n, short))
    gpu.prefill(np.concatenate([turn, turn]), len(prompt))
    assert seen == [(16, False)]


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_gpu_short_prefill_pdl_keeps_the_bits)")
def test_simulated_short_prefill_by_pdl_launches_every_gemv_and_norm_so_and_keeps_the_bits(tmp_path, monkeypatch):
    # EngineConfig.decode_pdl on a device with PDL (stood in for: the simulator runs the PDL builds
    # plainly, griddepcontrol as no-ops): the norms, q8_K launches, GEMVs and rope_write of the short
    # graph ask for their PDL builds, the attention does not, and the logits keep the plain graph's bits
    from genie_rt.engine import cuda_short_prefill
    from genie_rt.quant import pdl
    from test_backend_cuda import make_backends
    path = _tiny(tmp_path)
    prompt, turn = PROMPT, TURN
    from genie_rt.kvcache import rope_write
    launched, real = [], pdl.launch_or_plain

    def spy(kern, grid, block, stream, sig, on, *a, **k):
        launched.append((kern.py_func.__qualname__, on))
        return real(kern, grid, block, stream, sig, on, *a, **k)
    monkeypatch.setattr(pdl, "launch_or_plain", spy)
    monkeypatch.setattr(rope_write, "launch_or_plain", spy)        # (imported by name there)
    kernels = ("rmsnorm_q8k_kernel", "mma_qkv_kernel", "mma_q4k_q8k_kernel", "mma_q6k_q8k_kernel",
               "mma_glu_q4k_q8k_kernel", "_rope_write_kernel")
    got = {}
    # the knob True (every kind) without and with PDL on the device, then two kinds of PDL_KINDS:
    # the norms' rmsnorm_q8k by PDL, the q8_K-only launches of the same kernel not; the GLU by PDL
    some = {"rmsnorm_q8k_kernel": {True, False}, "mma_glu_q4k_q8k_kernel": {True}}
    for name, knob, on in (("off", True, False), ("all", True, True), ("some", ("norm", "glu"), True)):
        monkeypatch.setattr(cuda_short_prefill, "PDL", knob)       # (True by default)
        monkeypatch.setattr(cuda_short_prefill, "_pdl_available", lambda: on)
        gpu, _, _ = make_backends(path, "f16", n_ctx=64, chunk=16, warm=False, short_prefill=True)
        gpu.prefill(prompt, 0)
        launched.clear()
        got[name] = gpu.prefill(turn, len(prompt))
        flags = {}
        for q, flag in launched:
            flags.setdefault(q.split(".")[0], set()).add(flag)
        for k in kernels:
            want = some.get(k, {False}) if name == "some" else {on}
            assert flags.get(k) == want, (name, k, flags)
    np.testing.assert_array_equal(got["all"], got["off"])
    np.testing.assert_array_equal(got["some"], got["off"])


@pytest.mark.slow
def test_simulated_short_prefill_fused_w16_knob_keeps_the_bits(tmp_path, monkeypatch):
    # the lab knob FUSED_W16: q/k/v and gate/up/SwiGLU by 16-byte weight loads, unpipelined - the
    # same integer sums in the same order, so the logits keep the 8-byte graph's bits
    from genie_rt.engine import cuda_short_prefill
    from genie_rt.quant import gemv_mma_glu, gemv_mma_qkv
    from test_backend_cuda import make_backends
    path = _tiny(tmp_path)
    calls, got = [], {}
    for mod, name in ((gemv_mma_glu, "gemv_mma_glu"), (gemv_mma_qkv, "gemv_mma_qkv")):
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append((_name, k.get("w16"), k.get("pipe")))
            return _real(*a, **k)
        monkeypatch.setattr(mod, name, spy)
    for knob in (False, True):
        monkeypatch.setattr(cuda_short_prefill, "FUSED_W16", knob)
        gpu, _, _ = make_backends(path, "f16", n_ctx=64, chunk=16, warm=False, short_prefill=True)
        gpu.prefill(PROMPT, 0)
        calls.clear()
        got[knob] = gpu.prefill(TURN, len(PROMPT))
        assert {c[0] for c in calls} == {"gemv_mma_glu", "gemv_mma_qkv"}, calls
        assert all(c[1] is knob and c[2] is (not knob) for c in calls), calls
    np.testing.assert_array_equal(got[True], got[False])


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_gpu_short_prefill_q6k_w16_keeps_the_bits)")
def test_simulated_short_prefill_q6k_w16_knob_keeps_the_bits(tmp_path, monkeypatch):
    # the knob gemv_mma_q6k.W16: the Q6_K matrices (attn_v in the q/k/v launch, ffn_down alone) by
    # 16-byte loads - the 4-byte build's words after the quad's transpose, so the logits keep their bits
    from genie_rt.quant import gemv_mma_k, gemv_mma_q6k
    from test_backend_cuda import make_backends
    path = _tiny(tmp_path)
    built, got = [], {}
    real = gemv_mma_k.mma_q6k_q8k_kernel

    def spy(*a):
        built.append(a[4] if len(a) > 4 else False)
        return real(*a)
    monkeypatch.setattr(gemv_mma_k, "mma_q6k_q8k_kernel", spy)
    for knob in (False, True):
        monkeypatch.setattr(gemv_mma_q6k, "W16", knob)
        gpu, _, _ = make_backends(path, "f16", n_ctx=64, chunk=16, warm=False, short_prefill=True)
        gpu.prefill(PROMPT, 0)
        built.clear()
        got[knob] = gpu.prefill(TURN, len(PROMPT))
        assert built and all(w is knob for w in built), built      # ffn_down (Q6_K) took the knob's build
    np.testing.assert_array_equal(got[True], got[False])


def test_short_prefill_pdl_knob_names_known_kinds():
    from genie_rt.engine.cuda_short_prefill import PDL_KINDS, pdl_kinds
    assert pdl_kinds(False) == frozenset() and pdl_kinds(True) == frozenset(PDL_KINDS)
    assert pdl_kinds(("norm", "glu")) == {"norm", "glu"}
    with pytest.raises(ValueError, match="unknown kinds \\['attention'\\]"):
        pdl_kinds(("norm", "attention"))


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test")
def test_simulated_short_prefill_stays_off_where_a_chunk_is_below_8_rows(tmp_path, caplog):
    from test_backend_cuda import make_backends
    path = _tiny(tmp_path)
    with caplog.at_level("WARNING", logger="genie_rt.cuda"):
        gpu, _, _ = make_backends(path, "f16", n_ctx=64, chunk=4, warm=False, short_prefill=True)
    assert not gpu.short_prefill and "chunk of 4 rows" in caplog.text
    assert np.isfinite(gpu.prefill(np.array([5, 17, 100], np.int32), 0)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["fixture", "q6k"])
def test_gpu_short_prefill_matches_the_mmq_prefill(fixture_gguf, tmp_path, which):
    # the micro fixture (Q4_K layers) and a synthetic two-layer file with Q6_K attn_v and ffn_down:
    # after a 20-token prompt, turns of 1-8 tokens by the short graph and by the MMQ bucket - logits
    # cosine >= 0.999, the decode step after each turn too (the K/V rows it wrote)
    from test_backend_cuda import cosine_rows, make_backends
    path = fixture_gguf
    if which == "q6k":
        path = _two_layers(tmp_path)
    gpu, _, _ = make_backends(path, "f16", n_ctx=128, chunk=64, short_prefill=True)
    assert gpu.short_prefill and gpu.device_info()["short_prefill"]
    assert ("prefill_short", 8, gpu._max_splits(8)) in gpu._graphs     # captured at load
    keys, real = [], gpu._run
    gpu._run = lambda key, record: keys.append(key[0]) or real(key, record)     # which graph each step replays
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 256, 20).astype(np.int32)
    for n in range(1, 9):
        turn = rng.integers(0, 256, n).astype(np.int32)
        got = {}
        for short in (True, False):
            gpu.short_prefill = short
            gpu.prefill(prompt, 0)
            keys.clear()
            got[short] = gpu.prefill(turn, 20), gpu.decode(7, 20 + n)
            assert keys[0] == ("prefill_short" if short else "prefill"), keys
        for a, b in zip(got[True], got[False]):
            assert cosine_rows(a, b)[0] >= 0.999, (which, n)


@pytest.mark.gpu
def test_gpu_short_prefill_pdl_keeps_the_bits(tmp_path, monkeypatch):
    # the short graph with its launches chained by PDL (EngineConfig.decode_pdl, sm_90+) against the
    # same graph launched plainly, on a file with Q4_K and Q6_K matrices: turns of 1, 5 and 8 tokens
    # after a prompt, the logits' bits equal, replay after replay
    from genie_rt.quant import pdl
    from test_backend_cuda import make_backends
    from genie_rt.engine import cuda_short_prefill
    if not pdl.available():
        pytest.skip("no programmatic dependent launch on this device (sm_90+)")
    monkeypatch.setattr(cuda_short_prefill, "PDL", True)       # (the default)
    path = _two_layers(tmp_path)
    prompt, turns = _prompt_and_turns(5)
    got = {}
    for on in (True, False):
        gpu, _, _ = make_backends(path, "f16", n_ctx=128, chunk=64, short_prefill=True, decode_pdl=on)
        assert gpu.short_prefill
        got[on] = _turns(gpu, prompt, turns, decode=False)
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_short_prefill_q6k_w16_keeps_the_bits(tmp_path, monkeypatch):
    # the knob gemv_mma_q6k.W16 (the Q6_K quants by 16-byte loads) in the short graph, with its PDL
    # builds where the device has them, on the two-layer file (Q6_K attn_v and ffn_down): turns of 1, 5
    # and 8 tokens after a prompt, the logits' bits and the decode step's after each turn equal
    from test_backend_cuda import make_backends
    from genie_rt.quant import gemv_mma_k, gemv_mma_q6k, gemv_mma_qkv
    path = _two_layers(tmp_path)
    prompt, turns = _prompt_and_turns(7)
    got, built = {}, []
    real_k, real_qkv = gemv_mma_k.mma_q6k_q8k_kernel, gemv_mma_qkv.mma_qkv_kernel
    monkeypatch.setattr(gemv_mma_k, "mma_q6k_q8k_kernel", lambda *a: built.append(("ffn_down", a[4])) or real_k(*a))
    monkeypatch.setattr(gemv_mma_qkv, "mma_qkv_kernel",
                        lambda *a: built.append(("qkv", a[5])) or real_qkv(*a) if "Q6_K" in a[0] else real_qkv(*a))
    for on in (True, False):
        monkeypatch.setattr(gemv_mma_q6k, "W16", on)
        built.clear()
        gpu, _, _ = make_backends(path, "f16", n_ctx=128, chunk=64, short_prefill=True)
        got[on] = _turns(gpu, prompt, turns)
        # (the Q6_K matrices took the knob's builds: ffn_down alone, attn_v in the q/k/v launch)
        assert {k for k, _ in built} == {"ffn_down", "qkv"} and all(w is on for _, w in built), built
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_short_prefill_split_launch_keeps_the_bits(tmp_path, monkeypatch):
    # the short graph captured as two parts (cuda_short_prefill.SPLIT_LAUNCH: the second from layer 1's
    # attention on) against one graph, on the two-layer file: turns of 1, 5 and 8 tokens after a
    # prompt, the logits' bits equal replay after replay, and the decode step after a turn too (the
    # K/V rows both parts wrote)
    from test_backend_cuda import make_backends
    from genie_rt.engine import cuda_short_prefill
    path = _two_layers(tmp_path)
    prompt, turns = _prompt_and_turns(6)
    got = {}
    for split in (1, None):
        monkeypatch.setattr(cuda_short_prefill, "SPLIT_LAUNCH", split)
        gpu, _, _ = make_backends(path, "f16", n_ctx=128, chunk=64, short_prefill=True)
        graph = gpu._graphs[("prefill_short", 8, gpu._max_splits(8, True))]
        assert graph.parts == (2 if split else 1)
        got[split] = _turns(gpu, prompt, turns)
    for a, b in zip(got[1], got[None]):
        np.testing.assert_array_equal(a, b)
