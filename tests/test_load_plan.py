"""The plan before the load (engine/load_plan.py, `genie-rt info` / `--dry-run`): every term,
the context it picks, the refusal, and that Engine.load follows the same numbers. A Jetson
is simulated: its /proc/meminfo through $GENIE_RT_SYSFS_ROOT (tests/fake_l4t.py), its
CUDA device as a namespace that says INTEGRATED (the CUDA simulator runs the rest)."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from genie_rt.engine import cuda_layout as lay
from genie_rt.engine.cli import main
from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.load_plan import make_plan
from genie_rt.engine.memory import GiB, MiB, MemoryBudgetError
from genie_rt.engine.platform_probe import ROOT_ENV

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from fake_l4t import make_tree  # noqa: E402
from synth_gguf import write_synthetic_qwen3  # noqa: E402

ORIN = SimpleNamespace(INTEGRATED=1, name=b"Orin (simulated)", compute_capability=(8, 7), MULTIPROCESSOR_COUNT=8,
                       MAX_THREADS_PER_MULTIPROCESSOR=1536,
                       CAN_MAP_HOST_MEMORY=1, MANAGED_MEMORY=1, CONCURRENT_MANAGED_ACCESS=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=3)
    return path


def _jetson(tmp_path, monkeypatch, available_mib):
    root = make_tree(tmp_path / "orin", mem_available_kb=available_mib * 1024)
    monkeypatch.setenv(ROOT_ENV, str(root))
    return root


def test_cpu_plan_terms_add_up_and_the_load_agrees(fixture_gguf, tmp_path, monkeypatch):
    _jetson(tmp_path, monkeypatch, 4096)
    p = make_plan(fixture_gguf, EngineConfig(backend="cpu"))
    b = p.budget
    assert p.fits and p.backend == "cpu" and p.kv_dtype == "f16" and b.available == 4096 * MiB
    assert p.platform["board"]["l4t"] == "R36.4.3" and p.platform["power_mode"]["name"] == "MAXN_SUPER"
    assert sum(r["bytes"] for r in p.weights_by_type.values()) > 0 and "Q4_K" in p.weights_by_type
    assert p.n_ctx == p.max_ctx == p.n_ctx_train                   # 4 GiB holds all of the micro model's
    assert p.plan.total == b.weights + b.kv_fixed + p.n_ctx * b.kv_bytes_per_token + b.scratch + b.overhead \
        + b.reserve
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu"))
    assert engine.n_ctx == p.n_ctx and engine.plan == p.plan


def test_a_tight_pool_shrinks_the_context_and_says_so(fixture_gguf, tmp_path, monkeypatch):
    _jetson(tmp_path, monkeypatch, 4096)
    b = make_plan(fixture_gguf, EngineConfig(backend="cpu")).budget
    room = 1000 * b.kv_bytes_per_token                                # room for 1000 tokens past the fixed terms
    reserve = b.available - (b.fixed - b.reserve) - room
    p = make_plan(fixture_gguf, EngineConfig(backend="cpu", reserve_bytes=reserve))
    assert p.fits and p.n_ctx == p.max_ctx == 768                    # the largest multiple of 256 <= 1000
    assert "768 tokens: the largest that fits" in p.text()
    # an explicit --ctx past that is refused, naming the context that would fit
    p = make_plan(fixture_gguf, EngineConfig(backend="cpu", reserve_bytes=reserve, n_ctx=4096))
    assert not p.fits and "--ctx 768" in p.error and "does NOT fit" in p.text()
    with pytest.raises(MemoryBudgetError, match="--ctx 768"):
        Engine.load(fixture_gguf, EngineConfig(backend="cpu", reserve_bytes=reserve, n_ctx=4096))


def test_cli_info_json_and_dry_run(fixture_gguf, tmp_path, monkeypatch, capsys):
    _jetson(tmp_path, monkeypatch, 4096)
    assert main(["info", "-m", str(fixture_gguf), "--backend", "cpu", "--ctx", "1024", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["n_ctx"] == 1024 and d["plan"]["kv"] == 1024 * d["budget"]["kv_bytes_per_token"]
    assert d["plan"]["margin"] == d["budget"]["available"] - d["plan"]["total"]
    # --dry-run on run: the plan, no generation; a reserve larger than the pool: refused, status 1
    assert main(["run", "-m", str(fixture_gguf), "--backend", "cpu", "-p", "hi", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory budget at ctx" in out and "verdict    fits" in out
    assert main(["plan", "-m", str(fixture_gguf), "--backend", "cpu", "--reserve-mb", "8192"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "reserve for the rest of the system" in out and "8.00 GiB" in out


def test_integrated_gpu_plan_counts_the_shared_pool(tiny, tmp_path, monkeypatch):
    """The CUDA plan on a simulated Orin: MemAvailable of the fake tree, the integrated overhead
    and reserve (the voice stack's margin), the graphs; too small a reserve margin refuses."""
    monkeypatch.setattr(lay, "device", lambda: ORIN)
    monkeypatch.setattr("genie_rt.engine.load_plan.cuda_available", lambda: True)
    _jetson(tmp_path, monkeypatch, 3 * 1024)
    p = make_plan(tiny, EngineConfig(backend="cuda", prefill_chunk=64))
    b = p.budget
    assert p.fits and p.kv_dtype == "int8" and p.device["integrated"] and p.device["sm_count"] == 8
    assert b.available == 3 * GiB and "integrated" in b.where
    assert (b.overhead, b.reserve) == (lay.runtime_overhead(ORIN, True), lay.RESERVE_INTEGRATED)
    assert p.graphs == [16, 32, 40, 48, 64]
    text = p.text()
    for term in ("integrated: CPU and GPU share one memory pool", "weights (device layout)", "KV cache, int8",
                 "CUDA context, modules, graphs", "speech-to-text", "shared memory (MemAvailable; integrated GPU)"):
        assert term in text
    # the pool shrinks below the integrated overhead + reserve: refused before anything loads
    _jetson(tmp_path, monkeypatch, (lay.runtime_overhead(ORIN, True) + lay.RESERVE_INTEGRATED) // MiB)
    p = make_plan(tiny, EngineConfig(backend="cuda", prefill_chunk=64))
    assert not p.fits and p.max_ctx == 0 and "does not fit" in p.error


def test_runtime_overhead_scales_with_the_chip():
    """The context's local-memory reservation (SMs x threads per SM x 1 KiB stack) on top of a
    base: the H200 (132 x 2048) pays 264 MiB more than the base, an Orin Nano (8 x 1536) 12 MiB;
    a device without the attributes (the simulator's) the base alone."""
    h200 = SimpleNamespace(INTEGRATED=0, MULTIPROCESSOR_COUNT=132, MAX_THREADS_PER_MULTIPROCESSOR=2048)
    assert lay.runtime_overhead(h200, False) == lay.OVERHEAD_DISCRETE + 264 * MiB
    assert lay.runtime_overhead(ORIN, True) == lay.OVERHEAD_INTEGRATED + 12 * MiB
    assert lay.runtime_overhead(SimpleNamespace(), False) == lay.OVERHEAD_DISCRETE
