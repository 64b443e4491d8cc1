"""--mapped-memory (EngineConfig.mapped_memory): the CUDA arena in mapped host memory, the
placement of an integrated GPU, on any GPU.

- simulator / GPU: the arena's views read back what was written; the uploaded weights are
  the bytes of the device-memory arena; the budget counts host memory (MemAvailable);
- GPU (marker gpu): logits of every prompt position and of decode steps identical to the
  normal mode's (the same kernels on the same bytes: exact equality), and the same greedy
  text from the engine.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from genie_rt.engine import cuda_layout as lay
from genie_rt.engine.arena import Arena, ArenaLayout
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import GiB, MemoryPlan
from genie_rt.quant.layout import PLANES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from synth_gguf import write_synthetic_qwen3  # noqa: E402

DISCRETE = SimpleNamespace(INTEGRATED=0, name=b"H200 (simulated)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapped") / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=5)
    return path


def test_mapped_arena_views_round_trip():
    L = ArenaLayout()
    L.add("a", (3, 5), np.float32)
    L.add("b", (7,), np.int8)
    A = Arena(L, mapped=True)
    a = np.arange(15, dtype=np.float32).reshape(3, 5)
    b = np.arange(-3, 4, dtype=np.int8)
    A["a"].copy_to_device(a)
    A["b"].copy_to_device(b)
    np.testing.assert_array_equal(A["a"].copy_to_host(), a)
    np.testing.assert_array_equal(A["b"].copy_to_host(), b)
    assert A.mapped and A["a"].shape == (3, 5)


def _backend(path, mapped, monkeypatch, **kw):
    from genie_rt.engine.backend_cuda import CUDABackend
    monkeypatch.setattr(lay, "device", lambda: DISCRETE)
    g = open_gguf(path)
    ecfg = EngineConfig(backend="cuda", kv_dtype="f16", n_ctx=64, prefill_chunk=16, mapped_memory=mapped, **kw)
    return CUDABackend(g, ModelConfig.from_gguf(g), ecfg, MemoryPlan(64, 0, 0, 0, 0, 0, 1 << 50, "test"), warm=False)


def test_mapped_upload_is_the_device_arenas_bytes(tiny, monkeypatch):
    import os
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: None, raising=False)
    be, ref = _backend(tiny, True, monkeypatch), _backend(tiny, False, monkeypatch)
    assert be.mapped and be.arena.mapped and not ref.arena.mapped
    for gs in ref.lay.groups.values():
        for grp in gs:
            for p, *_ in PLANES[grp.qtype]:
                name = f"{grp.name}.{p}"
                np.testing.assert_array_equal(be.arena[name].copy_to_host(), ref.arena[name].copy_to_host(), name)


def test_mapped_budget_counts_host_memory(tiny, monkeypatch):
    from numba import cuda
    monkeypatch.setattr(lay, "device", lambda: DISCRETE)
    monkeypatch.setattr(lay, "mem_available_bytes", lambda: 9 * GiB)
    monkeypatch.setattr(cuda, "current_context",
                        lambda: SimpleNamespace(get_memory_info=lambda: (1, 8 * GiB)))   # not consulted
    g = open_gguf(tiny)
    b = lay.cuda_budget(g, ModelConfig.from_gguf(g), EngineConfig(backend="cuda", kv_dtype="int8", mapped_memory=True))
    assert b.available == 9 * GiB and "--mapped-memory" in b.where


@pytest.mark.gpu
def test_mapped_logits_equal_device_memory_logits(fixture_gguf, llamacpp_logits):
    from genie_rt.engine.backend_cuda import CUDABackend
    g = open_gguf(fixture_gguf)
    cfg = ModelConfig.from_gguf(g)
    plan = MemoryPlan(256, 0, 0, 0, 0, 0, 1 << 50, "test")
    out = {}
    for mapped in (False, True):
        be = CUDABackend(g, cfg, EngineConfig(backend="cuda", n_ctx=256, kv_dtype="int8", mapped_memory=mapped), plan)
        rows = []
        for i in range(3):
            tokens = llamacpp_logits[f"tokens_{i}"]
            rows.append(be.prefill(tokens, 0, all_logits=True))
            rows.append(be.decode(int(rows[-1][-1].argmax()), len(tokens))[None])
        out[mapped] = rows
        del be
    for a, b in zip(out[False], out[True]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_mapped_engine_writes_the_same_greedy_text(fixture_gguf):
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.generate import Done, GenerationRequest
    from genie_rt.engine.sampling import SamplingParams
    texts = []
    for mapped in (False, True):
        eng = Engine.load(fixture_gguf, EngineConfig(backend="cuda", n_ctx=256, mapped_memory=mapped))
        prompt = eng.chat_prompt([{"role": "user", "content": "Turn the kitchen lights down"}])
        r = [e for e in eng.generate(GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=32,
                                                       ignore_eos=True)) if isinstance(e, Done)][0].result
        texts.append(r.tokens)
        assert eng.backend.device_info()["mapped_memory"] is mapped
        del eng
    assert texts[0] == texts[1]
