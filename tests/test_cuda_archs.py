"""The CUDA back-end on the architectures beyond Qwen3 (Gemma 3, Llama / SmolLM2), against
the CPU back-end's exact path (the numpy reference ops on float32 weights).

Files are synthetic (tools/synth_arch.py) at the real models' layer shapes and weight-type
mixes - Gemma 3 270M: head_dim 256, one KV head, GeGLU, pre/post norms, Q/K norms, a
sliding window of 16 here (512 in the real file) with the global layer every 6th, so the
prompts below wrap the ring layers several times; SmolLM2 135M: Q4_1 at K = 576 (not a
multiple of 256), 9 query heads over 3 KV heads; and a Llama whose matrices are the types
with the newest prefill GEMMs (F16, BF16, Q5_K; Q/K/V of three types, so QKV runs as parts).

- GPU (marker gpu): every prompt position and a few decode steps, cosine >= 0.999 with
  FP16 KV and >= 0.998 with INT8 KV; greedy continuations identical (FP16 KV, float32
  decode activations, as tests/test_backend_cuda.py does for Qwen3).
- Simulator, the weight types (slow, 1.5-2.5 minutes on the 2-core machine): a one-layer Llama
  of F16 / BF16 / Q5_K matrices loads (the per-type check of cuda_layout.py lets it in), its
  prefill runs their MMQ kernels and matches the CPU back-end; a BF16 layer weight beyond
  fp16's range is refused at load, by name.
- Simulator (opt-in, GENIE_RT_SIM_ARCHS=1: 10-17 minutes per preset on the 2-core machine,
  too long for CI): tiny presets, one prefill and one decode step. Last run 2026-12-02 on the
  2-core dev machine under load: llama-tiny prefill cosine 0.99991 (same argmax); gemma3-tiny
  prefill 0.99982, decode 0.99980.
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from genie_rt.engine.backend_cpu import CPUBackend
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import MemoryPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import synth_arch  # noqa: E402
from test_backend_cuda import cosine_rows, assert_greedy_agrees  # noqa: E402

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and os.environ.get("GENIE_RT_SIM_ARCHS") == "1"

# every layer matrix in a type whose prefill GEMM is quant/mmq_float.py or Q5_K's
TYPE_MIX = dict(default="Q5_K", wq="F16", wk="BF16", wv="Q5_K", wo="BF16", w_gate="F16", w_up="F16",
                w_down="Q5_K", tok_embd="Q8_0")

SHAPES = {
    "gemma3": dict(layers=6, hidden=640, heads=4, kv_heads=1, head_dim=256, ffn=2048, vocab=0, window=16,
                   pattern=6, rope_base=1e6,
                   types=dict(default="Q5_0", wo="Q4_K", w_down="Q4_K", wv="Q8_0", tok_embd="Q8_0")),
    "llama": dict(layers=4, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=0, rope_base=1e5,
                  types=dict(default="Q4_1", tok_embd="Q8_0")),
    "llama-f16-bf16-q5k": dict(arch="llama", layers=4, hidden=768, heads=12, kv_heads=4, head_dim=64,
                               ffn=2048, vocab=0, rope_base=1e5, types=TYPE_MIX),
}


def backends(path, kv, n_ctx=256, chunk=512, gemv_mode="dp4a", warm=False):
    from genie_rt.engine.backend_cuda import CUDABackend
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    ecfg = EngineConfig(backend="cuda", n_ctx=n_ctx, kv_dtype=kv, prefill_chunk=chunk, gemv_mode=gemv_mode)
    plan = MemoryPlan(n_ctx, 0, 0, 0, 0, 0, 1 << 50, "test")
    return CUDABackend(g, cfg, ecfg, plan, warm=warm), CPUBackend(g, cfg, n_ctx, kv, exact=True), cfg


@pytest.fixture(scope="module", params=sorted(SHAPES))
def synth_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("arch") / f"{request.param}.gguf"
    shape = dict(SHAPES[request.param])
    return synth_arch.write(path, shape.pop("arch", request.param), shape, seed=3)


def prompt(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(3, min(cfg.vocab_size, 4000), n).astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("kv,min_cos", [("f16", 0.999), ("int8", 0.998)])
def test_every_position_and_decode_match_cpu(synth_file, kv, min_cos):
    gpu, cpu, cfg = backends(synth_file, kv)
    for n in (7, 70):                                   # under and over the window / a prefill bucket
        tokens = prompt(cfg, n, seed=n)
        got, ref = gpu.prefill(tokens, 0, all_logits=True), cpu.prefill(tokens, 0, all_logits=True)
        cos = cosine_rows(got, ref)
        assert cos.min() >= min_cos, (synth_file.name, kv, n, int(cos.argmin()), float(cos.min()))
        for i in range(6):                              # decode steps past the window edge
            tok = int(ref[-1].argmax()) if i == 0 else int(ref.argmax())
            got, ref = gpu.decode(tok, n + i), cpu.decode(tok, n + i)
            c = cosine_rows(got, ref)[0]
            assert c >= min_cos, (synth_file.name, kv, n, i, float(c))
    # a second chunked prefill continuing the same sequence (ring layers keep only their window)
    tokens = prompt(cfg, 40, seed=99)
    got, ref = gpu.prefill(tokens, 76), cpu.prefill(tokens, 76)
    assert cosine_rows(got, ref)[0] >= min_cos


@pytest.mark.gpu
def test_greedy_continuations_agree(synth_file):
    gpu, cpu, cfg = backends(synth_file, "f16", gemv_mode="f32")
    tokens = prompt(cfg, 23, seed=5)
    assert_greedy_agrees(gpu, cpu, tokens, 32, synth_file.name)


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="opt-in simulator test (GENIE_RT_SIM_ARCHS=1; on a GPU the gpu tests cover this)")
@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny"])
def test_simulated_forward_matches_cpu(tmp_path, preset):
    shape = dict(synth_arch.PRESETS[preset])
    path = synth_arch.write(tmp_path / f"{preset}.gguf", shape.pop("arch"), shape, seed=0)
    gpu, cpu, cfg = backends(path, "f16", n_ctx=64, chunk=16)
    tokens = prompt(cfg, 11)
    got, ref = gpu.prefill(tokens, 0), cpu.prefill(tokens, 0)
    assert cosine_rows(got, ref)[0] >= 0.999 and got.argmax() == ref.argmax()
    got, ref = gpu.decode(7, 11), cpu.decode(7, 11)
    assert cosine_rows(got, ref)[0] >= 0.999


TYPES_TINY = dict(layers=1, hidden=256, heads=2, kv_heads=1, head_dim=64, ffn=256, vocab=0, rope_base=1e4,
                  types=TYPE_MIX)


@pytest.mark.slow
def test_prefill_runs_the_f16_bf16_q5k_gemms(tmp_path):
    """Matrices of every newer MMQ type load (no refusal at the per-type check) and the
    prefill, through PrefillOps' GEMMs, matches the CPU back-end."""
    path = synth_arch.write(tmp_path / "types.gguf", "llama", TYPES_TINY, seed=1)
    gpu, cpu, cfg = backends(path, "f16", n_ctx=64, chunk=16)
    kinds = {w.qtype.name for parts in gpu.stacks.values() for w in parts}
    assert {"F16", "BF16", "Q5_K"} <= kinds, kinds
    tokens = prompt(cfg, 3)
    got, ref = gpu.prefill(tokens, 0), cpu.prefill(tokens, 0)
    assert cosine_rows(got, ref)[0] >= 0.999 and got.argmax() == ref.argmax()


def test_bf16_layer_weight_beyond_fp16_is_refused_by_name(tmp_path):
    from genie_rt.engine.gguf_file import GGUFError
    path = synth_arch.write(tmp_path / "types.gguf", "llama", TYPES_TINY, seed=1)
    t = open_gguf(path).tensors["blk.0.attn_k.weight"]
    assert t.qtype.name == "BF16"
    with open(path, "r+b") as f:                        # one weight becomes 2^17 (bf16 0x4800)
        f.seek(t.offset + 2 * 77)
        f.write(np.array([0x4800], np.uint16).tobytes())
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_k\.weight.*131072.*float16 range"):
        backends(path, "f16", n_ctx=64, chunk=16)


@pytest.mark.gpu
def test_choices_share_one_prefill_through_the_rings(synth_file):
    """n choices on the CUDA engine: the prompt is prefilled once, each further choice draws its
    first token from the prompt's logits (the head's sampling graph, as prefill_sample) with the
    sliding-window rings put back - with a 16-token window and 16-token chunks a ring has 31
    slots, and each 40-token reply overwrites the prompt's window in it - so choice i is the
    cold one-choice reply with seed + i, greedy and sampled."""
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.generate import Done, GenerationRequest
    from genie_rt.engine.sampling import SamplingParams
    eng = Engine.load(synth_file, EngineConfig(backend="cuda", n_ctx=256, kv_dtype="f16", prefill_chunk=16))
    tokens = [int(t) for t in prompt(eng.cfg, 23, seed=5)]
    calls = []
    prefill = eng.backend.prefill
    eng.backend.prefill = lambda toks, start, *a, **k: calls.append((start, len(toks))) or prefill(toks, start, *a, **k)

    def run(n, seed, temperature):
        eng.kv_tokens = []
        params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        req = GenerationRequest(tokens, params, max_tokens=40, ignore_eos=True, n=n)
        return [e.result for e in eng.generate(req) if isinstance(e, Done)]

    for temperature in (0.0, 1.0):
        calls.clear()
        many = run(3, 11, temperature)
        assert calls == [(0, 23)] and [r.n_cached for r in many] == [0, 23, 23]
        singles = [run(1, 11 + i, temperature)[0] for i in range(3)]
        assert [r.tokens for r in many] == [r.tokens for r in singles], (synth_file.name, temperature)
        if temperature:
            assert len({tuple(r.tokens) for r in many}) == 3
