"""The integrated-GPU code paths of the CUDA back-end (a Jetson: CPU and GPU share one
memory pool), by simulation: a fake device that says INTEGRATED, the CUDA simulator (or a
real GPU) for the rest.

- the memory budget counts MemAvailable of the shared pool with the integrated overhead
  and reserve, not the GPU's free memory, and refuses a model that does not fit there;
- the weight upload drops each tensor's file pages once it is copied (the weights live
  once in the shared memory), over exactly the bytes of the tensors it packed, and a file
  system that refuses the advice costs memory, not the load.
"""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from genie_rt.engine import backend_cuda as bc
from genie_rt.engine import cuda_layout as lay
from genie_rt.quant.layout import PLANES
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import GiB, MemoryBudgetError, MemoryPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from synth_gguf import write_synthetic_qwen3  # noqa: E402

ORIN = SimpleNamespace(INTEGRATED=1, name=b"Orin (simulated)")
DISCRETE = SimpleNamespace(INTEGRATED=0, name=b"H200 (simulated)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrated") / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=3)
    return path


def _load(path, **ecfg):
    g = open_gguf(path)
    return g, ModelConfig.from_gguf(g), EngineConfig(backend="cuda", **ecfg)


def test_budget_on_an_integrated_gpu_counts_the_shared_pool(tiny, monkeypatch):
    g, cfg, ecfg = _load(tiny, kv_dtype="int8")
    monkeypatch.setattr(lay, "device", lambda: ORIN)
    monkeypatch.setattr(lay, "mem_available_bytes", lambda: 5 * GiB)
    budget = lay.cuda_budget(g, cfg, ecfg)
    assert budget.available == 5 * GiB and "integrated" in budget.where
    assert (budget.overhead, budget.reserve) == (lay.runtime_overhead(ORIN, True), lay.RESERVE_INTEGRATED)
    assert budget.weights > 0 and budget.kv_bytes_per_token > 0
    # --reserve-mb replaces the default reserve for the voice stack
    g, cfg, ecfg = _load(tiny, kv_dtype="int8", reserve_bytes=3 * GiB)
    assert lay.cuda_budget(g, cfg, ecfg).reserve == 3 * GiB


def test_budget_on_an_integrated_gpu_refuses_what_the_pool_cannot_hold(tiny, monkeypatch):
    g, cfg, ecfg = _load(tiny, kv_dtype="int8")
    monkeypatch.setattr(lay, "device", lambda: ORIN)
    monkeypatch.setattr(lay, "mem_available_bytes", lambda: lay.RESERVE_INTEGRATED + 64 * 1024 ** 2)
    budget = lay.cuda_budget(g, cfg, ecfg)
    with pytest.raises(MemoryBudgetError, match=r"does not fit(.|\n)*shared memory \(MemAvailable; integrated GPU\)"):
        budget.plan(None)
    monkeypatch.setattr(lay, "mem_available_bytes", lambda: None)    # no /proc/meminfo: nothing is assumed
    with pytest.raises(MemoryBudgetError, match="does not fit"):
        lay.cuda_budget(g, cfg, ecfg).plan(None)


def test_budget_on_a_discrete_gpu_counts_its_free_memory(tiny, monkeypatch):
    from numba import cuda
    g, cfg, ecfg = _load(tiny, kv_dtype="int8")
    monkeypatch.setattr(lay, "device", lambda: DISCRETE)
    monkeypatch.setattr(lay, "mem_available_bytes", lambda: 1)       # must not be consulted
    monkeypatch.setattr(cuda, "current_context",
                        lambda: SimpleNamespace(get_memory_info=lambda: (7 * GiB, 8 * GiB)))
    budget = lay.cuda_budget(g, cfg, ecfg)
    assert budget.available == 7 * GiB and "GPU memory" in budget.where and "H200" in budget.where
    assert (budget.overhead, budget.reserve) == (lay.runtime_overhead(DISCRETE, False), lay.RESERVE_DISCRETE)
    # an H200's 139 GiB are all counted; only the simulator's infinity becomes SIMULATED_FREE, and a
    # device without a name (the simulator's) is named so
    monkeypatch.setattr(cuda, "current_context",
                        lambda: SimpleNamespace(get_memory_info=lambda: (139 * GiB, 141 * GiB)))
    assert lay.cuda_budget(g, cfg, ecfg).available == 139 * GiB
    monkeypatch.setattr(lay, "device", lambda: SimpleNamespace(INTEGRATED=0))
    monkeypatch.setattr(cuda, "current_context",
                        lambda: SimpleNamespace(get_memory_info=lambda: (float("inf"), float("inf"))))
    budget = lay.cuda_budget(g, cfg, ecfg)
    assert budget.available == lay.SIMULATED_FREE and "CUDA simulator" in budget.where


def _backend(path, device, monkeypatch, fadvise):
    monkeypatch.setattr(lay, "device", lambda: device)
    monkeypatch.setattr(os, "posix_fadvise", fadvise, raising=False)
    g, cfg, ecfg = _load(path, kv_dtype="f16", n_ctx=64, prefill_chunk=16)
    plan = MemoryPlan(64, 0, 0, 0, 0, 0, 1 << 50, "test")
    return g, bc.CUDABackend(g, cfg, ecfg, plan, warm=False)


def _weights(be):
    return {f"{grp.name}.{p}": be.arena[f"{grp.name}.{p}"].copy_to_host()
            for gs in be.lay.groups.values() for grp in gs for p, *_ in PLANES[grp.qtype]}


def test_upload_on_an_integrated_gpu_drops_each_tensors_file_pages(tiny, monkeypatch):
    calls = []
    g, be = _backend(tiny, ORIN, monkeypatch, lambda fd, off, n, advice: calls.append((fd, off, n, advice)))
    assert be.integrated
    packed = [g.tensors[name] for gs in be.lay.groups.values() for grp in gs for name, _ in grp.members]
    assert sorted((off, n) for _, off, n, _ in calls) == sorted((t.offset, t.nbytes) for t in packed)
    assert {advice for *_, advice in calls} == {os.POSIX_FADV_DONTNEED}
    fds = {fd for fd, *_ in calls}
    assert len(fds) == 1
    with pytest.raises(OSError):                 # the descriptor was closed after the upload
        os.fstat(fds.pop())
    # the same arena bytes as on a discrete GPU, which leaves the page cache alone
    discrete_calls = []
    _, ref = _backend(tiny, DISCRETE, monkeypatch, lambda *a: discrete_calls.append(a))
    assert not ref.integrated and not discrete_calls
    got, want = _weights(be), _weights(ref)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_upload_survives_a_file_system_that_refuses_the_advice(tiny, monkeypatch, caplog):
    calls = []

    def refuse(fd, off, n, advice):
        calls.append(off)
        raise OSError(22, "Invalid argument")

    _, be = _backend(tiny, ORIN, monkeypatch, refuse)
    assert len(calls) == 1                        # asked once, then no more
    assert "cannot drop the file's pages" in caplog.text and "tiny.gguf" in caplog.text
    _, ref = _backend(tiny, DISCRETE, monkeypatch, lambda *a: None)
    got, want = _weights(be), _weights(ref)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
