"""The CUDA back-end against the CPU back-end (the numpy reference).

- Simulator (runs everywhere, slow: about a minute per forward): a one-layer model,
  prefill and decode logits against the CPU back-end.
- GPU (marker gpu): the fixture and synthetic files of real layer shapes, every position
  (logits cosine >= 0.999 with FP16 KV, >= 0.998 with INT8 KV), identical greedy
  continuations (64 tokens, FP16 KV) on the fixture prompts, the engine end to end,
  prefix reuse, and KV files that move between back-ends.
The decode step's switches (norm fold, attention q8, PDL, fused rope, fused FFN, the
short-context graph), each against the step without it, are in test_decode_switches.py.
"""
import dataclasses
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
from synth_gguf import write_synthetic_qwen3  # noqa: E402

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def cosine_rows(a, b):
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def make_backends(path, kv="f16", n_ctx=128, chunk=512, gemv_mode="dp4a", warm=True, **ecfg_kw):
    from genie_rt.engine.backend_cuda import CUDABackend
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    ecfg = EngineConfig(backend="cuda", n_ctx=n_ctx, kv_dtype=kv, prefill_chunk=chunk, gemv_mode=gemv_mode,
                        **ecfg_kw)
    plan = MemoryPlan(n_ctx, 0, 0, 0, 0, 0, 1 << 50, "test")
    return CUDABackend(g, cfg, ecfg, plan, warm=warm), CPUBackend(g, cfg, n_ctx, kv), cfg


def greedy_continuation(be, tokens, n):
    """n greedy tokens after `tokens` on back-end `be`: prefill_sample, then decode_tokens."""
    from genie_rt.engine.sampling import Sampler, SamplingParams
    sampler = Sampler(SamplingParams(temperature=0))
    history = list(tokens)
    seq = [be.prefill_sample(tokens, 0, sampler, history)]
    steps = be.decode_tokens(seq[0], len(tokens), sampler, history)
    for _ in range(n - 1):
        history.append(seq[-1])
        seq.append(next(steps))
    steps.close()
    return seq


TIE = 0.05     # a near-tie: top-2 margin below this fraction of the logits' standard deviation


def assert_greedy_agrees(gpu, cpu, tokens, n, what=""):
    """Both back-ends' greedy continuations of `tokens` (n tokens, through their samplers) are
    the same, or part only at a near-tie. Random-weight files have many: the micro fixture's
    top-2 margins are often < 0.01, and a float32 rounding difference between two correct
    back-ends then picks the other token. At the first difference both back-ends recompute the
    logits of that position: the CPU's margin between the two picks must be below TIE x its
    logits' spread, each pick must be its own back-end's argmax there, and the logits must
    agree (cosine >= 0.999) - a wrong kernel fails one of these, a rounding tie none."""
    out = [greedy_continuation(be, tokens, n) for be in (gpu, cpu)]
    if out[0] == out[1]:
        return
    k = next(i for i, (a, b) in enumerate(zip(*out)) if a != b)
    ctx = np.concatenate([np.asarray(tokens, np.int32), np.asarray(out[1][:k], np.int32)])
    lg = np.atleast_2d(gpu.prefill(ctx, 0))[-1].astype(np.float64)
    lc = np.atleast_2d(cpu.prefill(ctx, 0))[-1].astype(np.float64)
    g, c = out[0][k], out[1][k]
    margin, spread = lc[c] - lc[g], lc.std()
    info = (f"{what} step {k}: gpu {g} cpu {c}, cpu margin {margin:.4g} (spread {spread:.4g}), "
            f"gpu margin {lg[g] - lg[c]:.4g}, cosine {cosine_rows(lg, lc)[0]:.6f}")
    assert cosine_rows(lg, lc)[0] >= 0.999, info
    assert lc[c] >= lc.max() - 1e-6 * spread and lg[g] >= lg.max() - 1e-6 * spread, info
    assert margin <= TIE * spread, info


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU the gpu tests cover this)")
def test_simulated_forward_matches_cpu(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0, exact=True)
    # a 512-token context: each bucket's graph launches 2 attention splits (a start near the
    # end would use them), so the merge is pending and done inside the O projection's input
    # conversion (kvcache/attention_merge.py) - here with the one split a start of 0 uses
    gpu, cpu, _ = make_backends(path, "f16", n_ctx=512, chunk=16)
    assert gpu._max_splits(16) == (2,)
    tokens = np.array([5, 17, 100, 3, 250, 9, 42], np.int32)       # 7 tokens: bucket 16, nine pad rows
    got, ref = gpu.prefill(tokens, 0), cpu.prefill(tokens, 0)
    assert cosine_rows(got, ref)[0] >= 0.999 and got.argmax() == ref.argmax()
    got, ref = gpu.decode(77, 7), cpu.decode(77, 7)
    assert cosine_rows(got, ref)[0] >= 0.999


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU the greedy and sampling tests cover this)")
def test_simulated_prefill_sample_begins_the_request_after_enqueueing_the_prefill(tmp_path):
    """prefill_sample sets the request's sampler up while the device runs the prefill (set_request
    waits for the previous request's copies by their event, not for the stream): the greedy token
    is the prompt's argmax, a seeded draw repeats, requests one after another each get their own;
    a request the sampler cannot take is refused before its prefill is queued."""
    from genie_rt.engine.cuda_layout import MAX_BIAS
    from genie_rt.engine.sampling import Sampler, SamplingParams
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0, exact=True)
    gpu, _, _ = make_backends(path, "f16", n_ctx=64, chunk=16, warm=False)
    tokens = np.array([5, 17, 100, 3, 250, 9, 42], np.int32)
    top = int(gpu.prefill(tokens, 0).argmax())
    assert gpu.prefill_sample(tokens, 0, Sampler(SamplingParams(temperature=0)), list(tokens)) == top
    assert gpu.sws.host["copied"] is not None                  # the event the next request waits for
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    again = [gpu.prefill_sample(tokens, 0, Sampler(params), list(tokens)) for _ in range(2)]
    assert again[0] == again[1]
    assert gpu.prefill_sample(tokens, 0, Sampler(SamplingParams(temperature=0)), list(tokens)) == top
    real, ran = gpu._prefill_layers, []
    gpu._prefill_layers = lambda *a, **k: ran.append(1) or real(*a, **k)
    with pytest.raises(ValueError, match="history holds token ids"):
        gpu.prefill_sample(tokens, 0, Sampler(SamplingParams(temperature=0)), [5, 999])
    assert not ran, "bad parameters must be refused before the prefill is queued"
    # checked=True (Engine.generate validated the ids): no history pass before the prefill, but a bad id
    # is still refused, by set_request while the device runs it; what only the workspace limits is
    # refused first either way
    with pytest.raises(ValueError, match="history holds token ids"):
        gpu.prefill_sample(tokens, 0, Sampler(SamplingParams(temperature=0)), [5, 999], checked=True)
    assert ran, "checked: the history is checked after the prefill is queued"
    ran.clear()
    with pytest.raises(ValueError, match="logit_bias entries"):
        gpu.prefill_sample(tokens, 0, Sampler(SamplingParams(temperature=0, logit_bias={i: 1.0 for i in range(MAX_BIAS + 1)})),
                           list(tokens), checked=True)
    assert not ran
    assert gpu.prefill_sample(tokens, 0, Sampler(SamplingParams(temperature=0)), list(tokens), checked=True) == top


@pytest.mark.gpu
def test_sampler_copies_beside_the_prefill_give_the_draws_of_copies_on_the_stream(fixture_gguf, monkeypatch):
    """backend_cuda.SAMPLER_COPY_STREAM: a request's sampler copies run beside its prefill and the head
    waits for them. Each request changes what the head must read (a ban of the last token by
    logit_bias, a seeded draw with penalties over the history): the same tokens as with the copies on
    the stream, request after request, and never a banned token. A 20 ms sleep is queued before the
    copies on whichever stream takes them, so they land long after the fixture's prefill: a head that
    did not wait for them would read the last request's parameters."""
    from numba import cuda

    from genie_rt.engine import backend_cuda, gpu_sampling
    from genie_rt.engine.sampling import Sampler, SamplingParams

    @cuda.jit
    def sleep(n):
        for _ in range(n):
            cuda.nanosleep(1000)
    real = gpu_sampling.set_request

    def late(ws, params, history, state, stream=0):
        sleep[1, 1, stream](20_000)
        return real(ws, params, history, state, stream=stream)
    monkeypatch.setattr(gpu_sampling, "set_request", late)
    gpu, _, _ = make_backends(fixture_gguf, "f16")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 9, 20, 7)]
    got = {}
    for side in (True, False):
        monkeypatch.setattr(backend_cuda, "SAMPLER_COPY_STREAM", side)
        got[side], last = [], None
        for i, tokens in enumerate(prompts * 2):
            ban = {} if last is None else {last: float("-inf")}
            params = (SamplingParams(temperature=0, logit_bias=ban) if i % 2 == 0 else
                      SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.3, seed=i, logit_bias=ban))
            last = gpu.prefill_sample(tokens, 0, Sampler(params), list(tokens))
            assert last not in ban, (side, i)
            got[side].append(last)
    assert got[True] == got[False]


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU the engine's choices tests cover this)")
def test_simulated_sample_logits(tmp_path):
    """CUDABackend.sample_logits, the first draw of an engine's further choices: the sampling
    graph of a prefill's head run on logits given from the host (left unchanged): greedy is
    their argmax, a seed reproduces its draw, different seeds differ."""
    import dataclasses

    from genie_rt.engine.sampling import Sampler, SamplingParams
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0, exact=True)
    gpu, _, _ = make_backends(path, "f16", n_ctx=64, chunk=16, warm=False)
    logits = (np.random.default_rng(0).standard_normal(300) * 2).astype(np.float32)
    keep = logits.copy()
    assert gpu.sample_logits(logits, Sampler(SamplingParams(temperature=0)), [1, 2, 3]) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    again = [gpu.sample_logits(logits, Sampler(params), [1, 2, 3]) for _ in range(2)]
    assert again[0] == again[1]
    draws = {gpu.sample_logits(logits, Sampler(dataclasses.replace(params, seed=s)), [1]) for s in range(8)}
    assert len(draws) > 1 and np.array_equal(logits, keep)


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU the overlapped-load bits test covers this)")
def test_simulated_background_upload_writes_what_upload_writes_and_hands_over_its_error(tmp_path, monkeypatch):
    """cuda_weights.BackgroundUpload (the weights read on a thread beside the warm-up): the
    arena's bytes equal a sequential upload's; an error on its thread is raised by wait()."""
    from numba import cuda

    from genie_rt.engine import cuda_weights
    from genie_rt.engine.arena import Arena
    from genie_rt.engine.cuda_layout import plan_layout
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    lay = plan_layout(g, cfg, EngineConfig(backend="cuda", n_ctx=64, kv_dtype="f16", prefill_chunk=16), 64)
    seq, bg = Arena(lay.layout), Arena(lay.layout)
    for a in (seq, bg):
        a.buffer.copy_to_device(np.zeros(a.buffer.shape, np.uint8))
    cuda_weights.upload(seq, lay, g, cuda.stream(), False)
    up = cuda_weights.BackgroundUpload(bg, lay, g)
    up.wait()
    assert up.seconds > 0
    np.testing.assert_array_equal(bg.buffer.copy_to_host(), seq.buffer.copy_to_host())

    def broken(*a, **k):
        raise ValueError("tensor blk.0.attn_q.weight: unreadable")
    monkeypatch.setattr(cuda_weights, "pack", broken)
    up = cuda_weights.BackgroundUpload(bg, lay, g)
    with pytest.raises(ValueError, match="unreadable"):
        up.wait()
    up.wait()                               # the error is handed over once


# ------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(llamacpp_logits):
    return [llamacpp_logits[f"tokens_{i}"] for i in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv,min_cos", [("f16", 0.999), ("int8", 0.998)])
def test_every_position_matches_cpu(fixture_gguf, prompts, kv, min_cos):
    gpu, cpu, _ = make_backends(fixture_gguf, kv)
    for tokens in prompts:
        got = gpu.prefill(tokens, 0, all_logits=True)
        ref = cpu.prefill(tokens, 0, all_logits=True)
        cos = cosine_rows(got, ref)
        assert cos.min() >= min_cos, f"worst position {cos.argmin()}: {cos.min():.5f}"
        # the batched prefill's last row equals the per-token path's
        last = gpu.prefill(tokens, 0)
        assert cosine_rows(last, ref[-1])[0] >= min_cos


@pytest.mark.gpu
def test_weights_read_beside_the_warm_up_give_the_same_bits(tmp_path, prompts):
    """EngineConfig.overlap_load: the weights read on a thread while the graphs are captured
    (no graph runs before they are in) give the bits of a load that reads them first."""
    import dataclasses

    from genie_rt.engine.backend_cuda import CUDABackend
    path = tmp_path / "synth.gguf"
    write_synthetic_qwen3(path, dict(layers=2, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                                     vocab=4122, text_tokens=4096), seed=0)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    base = EngineConfig(backend="cuda", n_ctx=256, kv_dtype="f16", prefill_chunk=512)
    plan = MemoryPlan(256, 0, 0, 0, 0, 0, 1 << 50, "test")
    tokens = np.concatenate(prompts)[:90]
    out = {}
    for overlap in (False, True):
        be = CUDABackend(g, cfg, dataclasses.replace(base, overlap_load=overlap), plan)
        assert (be.upload_seconds is not None) == overlap and be._upload is None
        out[overlap] = (be.prefill(tokens, 0), be.decode(11, 90), be.decode(12, 91))
        del be
    for a, b in zip(out[False], out[True]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("short_ctx", [None, 0])
def test_greedy_continuations_agree(fixture_gguf, prompts, short_ctx):
    """The fixture's random weights leave many near-tied logits (top-2 margins < 0.01), so
    this runs the decode GEMVs on float32 activations, the arithmetic closest to the CPU
    reference; the default q8 activations match it in cosine (above), like llama.cpp's.
    short_ctx 0: every step in the decode graph of long contexts (its two-head attention blocks;
    by default these positions run the short-context graph)."""
    kw = {} if short_ctx is None else {"decode_short_ctx": short_ctx}
    gpu, cpu, _ = make_backends(fixture_gguf, "f16", gemv_mode="f32", **kw)
    for i, tokens in enumerate(prompts):
        assert_greedy_agrees(gpu, cpu, tokens, 64, f"prompt {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    dict(layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=4122, text_tokens=4096),
    dict(layers=2, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=4122, text_tokens=4096),
])
def test_real_layer_shapes_match_cpu(tmp_path, shape, prompts):
    path = tmp_path / "synth.gguf"
    write_synthetic_qwen3(path, shape, seed=0)
    for kv, min_cos in (("f16", 0.999), ("int8", 0.998)):
        gpu, cpu, _ = make_backends(path, kv, n_ctx=256)
        tokens = np.concatenate(prompts)[:90]
        got, ref = gpu.prefill(tokens, 0), cpu.prefill(tokens, 0)
        assert cosine_rows(got, ref)[0] >= min_cos, kv
        got, ref = gpu.decode(11, 90), cpu.decode(11, 90)
        assert cosine_rows(got, ref)[0] >= min_cos, kv
        gpu.ecfg = dataclasses.replace(gpu.ecfg, decode_short_ctx=0)     # the long-context graph
        got = gpu.decode(11, 90)
        assert cosine_rows(got, ref)[0] >= min_cos, (kv, "decode_short_ctx 0")


@pytest.mark.gpu
def test_synthetic_qwen3_0p6b_every_position(tmp_path, prompts):
    """The whole Qwen3-0.6B shape (28 layers, vocabulary 151936, tied Q6_K embedding, the
    Q4_K_M type mix): logits at every prompt position and after a decode step."""
    path = tmp_path / "qwen3-0.6b.gguf"
    write_synthetic_qwen3(path, "0.6b", seed=1)
    tokens = np.concatenate(prompts)[:40]
    for kv, min_cos in (("f16", 0.999), ("int8", 0.998)):
        gpu, cpu, _ = make_backends(path, kv, n_ctx=64, warm=False)    # compiles only what runs
        got, ref = gpu.prefill(tokens, 0, all_logits=True), cpu.prefill(tokens, 0, all_logits=True)
        cos = cosine_rows(got, ref)
        assert cos.min() >= min_cos, (kv, int(cos.argmin()), float(cos.min()))
        got, ref = gpu.decode(int(ref[-1].argmax()), len(tokens)), cpu.decode(int(ref[-1].argmax()), len(tokens))
        assert cosine_rows(got, ref)[0] >= min_cos, kv
        del gpu, cpu


@pytest.mark.gpu
def test_engine_generates_and_reuses_prefix(fixture_gguf, tmp_path):
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.generate import Done, GenerationRequest
    from genie_rt.engine.sampling import SamplingParams
    eng = Engine.load(fixture_gguf, EngineConfig(backend="cuda", n_ctx=512, kv_dtype="int8",
                                                 kv_cache_dir=str(tmp_path / "kv")))
    assert eng.backend.name == "cuda"
    system = {"role": "system", "content": "You control a smart home. " + "Devices: lamp, fan. " * 20}
    a = eng.chat_prompt([system, {"role": "user", "content": "Lights on"}])
    b = eng.chat_prompt([system, {"role": "user", "content": "Fan off"}])

    def run(prompt, **kw):
        return [e for e in eng.generate(GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=16,
                                                          ignore_eos=True, **kw)) if isinstance(e, Done)][0].result

    run(a)
    warm = run(b)
    assert warm.n_cached > 100
    eng.kv_tokens = []
    cold = run(b)
    assert cold.n_cached == 0 and cold.tokens == warm.tokens
    # the server generates on a worker thread, not the one that loaded the model
    import threading
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", run(b)))
    worker.start()
    worker.join()
    assert out["r"].tokens == warm.tokens
    # seeded sampling on the device is reproducible
    p = dict(params=SamplingParams(temperature=1.0, seed=7))
    r1 = [e for e in eng.generate(GenerationRequest(a, max_tokens=16, ignore_eos=True, **p)) if isinstance(e, Done)]
    r2 = [e for e in eng.generate(GenerationRequest(a, max_tokens=16, ignore_eos=True, **p)) if isinstance(e, Done)]
    assert r1[0].result.tokens == r2[0].result.tokens
    # a conversation saved by the CUDA back-end restores into the CPU back-end
    run(a, conversation_id="kitchen")
    cpu = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=512, kv_dtype="int8",
                                                 kv_cache_dir=str(tmp_path / "kv")))
    follow = a + eng.tokenizer.encode(" more", add_special=False)
    restored = [e for e in cpu.generate(GenerationRequest(follow, SamplingParams(temperature=0), max_tokens=4,
                                                          conversation_id="kitchen")) if isinstance(e, Done)][0]
    assert restored.result.n_cached >= len(a)


def test_one_prefill_graph_per_bucket_serves_every_start_position():
    """A chunk after a long cached prefix runs with more attention splits. The split count in
    use is device state (state[S_SPLIT + plan]), so each bucket is one graph whose grid holds
    the most splits any start can need (issue 13: 8 graphs instead of 38 on the 4B). Gemma's
    windowed layers have their own plan, so a key holds one count per plan."""
    from types import MethodType, SimpleNamespace

    from genie_rt.engine.backend_cuda import BUCKETS, CUDABackend
    from genie_rt.kvcache.attention_prefill import plan_prefill, prefill_splits
    for plans in ([plan_prefill(32, 8, 128, "int8", 512)],
                  [plan_prefill(4, 1, 256, "int8", 512, window=512), plan_prefill(4, 1, 256, "int8", 512)]):
        be = SimpleNamespace(lay=SimpleNamespace(prefill_plans=plans * 2, chunk=512), n_ctx=8192,
                             _max_splits_of={})
        for name in ("_plans", "_splits_at", "_max_splits", "prefill_keys"):
            setattr(be, name, MethodType(getattr(CUDABackend, name), be))
        keys = be.prefill_keys()
        assert [n for n, _, _, _ in keys] == [n for n in BUCKETS if n <= 512]
        for n, most, start, short in keys:
            want = tuple(max(prefill_splits(p, n, s) for s in range(0, 8192 - n + 1)) for p in plans)
            assert most == want and start == 0 and not short
        assert max(max(m) for _, m, _, _ in keys) > 1        # some bucket does split
        be.short_prefill = True                              # EngineConfig.short_prefill: one more graph
        short_most = tuple(max(prefill_splits(p, 8, s, short=True) for s in range(0, 8192 - 8 + 1)) for p in plans)
        assert be.prefill_keys()[-1] == (8, short_most, 0, True)    # its own fewest tiles a split
        be.lay.chunk = 4                                     # ... only where a chunk holds its 8 rows
        assert not any(k[3] for k in be.prefill_keys())
