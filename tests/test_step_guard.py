"""The step guard (engine/step_guard.py): a reply ends cleanly when a fake shrinking pool
falls below the headroom; the thermal back-off waits while a fake zone is hot; the guard's
counts and the platform readings reach /health and /metrics."""
import sys
from pathlib import Path

import httpx
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine, make_guard
from genie_rt.engine.generate import Done, GenerationRequest
from genie_rt.engine.platform_probe import ROOT_ENV, Probe
from genie_rt.engine.sampling import SamplingParams
from genie_rt.engine.step_guard import DEFAULT_HEADROOM_INTEGRATED, GuardConfig, StepGuard

sys.path.insert(0, str(Path(__file__).parent))
from fake_l4t import make_tree  # noqa: E402

MiB = 1 << 20


def test_memory_guard_reads_every_n_tokens_and_stops_below_the_headroom():
    pool = iter([900 * MiB, 700 * MiB, 200 * MiB])
    reads = []
    g = StepGuard(GuardConfig(min_headroom=256 * MiB, every=4),
                  read_available=lambda: reads.append(1) or next(pool))
    verdicts = [g.after_token() for _ in range(9)]
    assert verdicts == [None] * 8 + ["memory"] and len(reads) == 3     # tokens 0, 4 and 8
    assert g.memory_stops == 1 and g.last_available == 200 * MiB
    g.start_reply()
    g._available = lambda: None                                        # no /proc/meminfo: never stops
    assert g.after_token() is None


def test_thermal_backoff_waits_only_while_hot(caplog):
    temps = iter([70.0, 86.0, 90.0, 60.0])
    waits = []
    g = StepGuard(GuardConfig(thermal_limit_c=85.0, backoff_s=0.01, every=2), read_hottest=lambda: next(temps),
                  sleep=waits.append)
    for _ in range(8):
        assert g.after_token() is None
    assert waits == [0.01] * 4                                         # tokens 2..5: hot; 6, 7: cooled
    assert g.snapshot()["backoff_seconds"] == pytest.approx(0.04) and not g.snapshot()["backing_off"]
    assert "thermal back-off on" in caplog.text and "thermal back-off off" in caplog.text


def test_defaults_guard_an_integrated_gpu_only():
    assert make_guard(EngineConfig(), integrated=False) is None
    g = make_guard(EngineConfig(), integrated=True)
    assert g.cfg.min_headroom == DEFAULT_HEADROOM_INTEGRATED and g.cfg.thermal_limit_c is None
    assert make_guard(EngineConfig(min_headroom_bytes=0), integrated=True) is None
    assert make_guard(EngineConfig(thermal_limit_c=80.0), integrated=False).cfg.min_headroom is None
    with pytest.raises(ValueError, match="thermal_limit_c"):
        EngineConfig(thermal_limit_c=-3)
    with pytest.raises(ValueError, match="interval"):
        StepGuard(GuardConfig(min_headroom=1, every=0))


def test_a_shrinking_pool_ends_the_reply_with_length(fixture_gguf, caplog):
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=128))
    req = dict(prompt=engine.raw_prompt("hello"), params=SamplingParams(temperature=0), max_tokens=40,
               ignore_eos=True)
    full = [e for e in engine.generate(GenerationRequest(**req)) if isinstance(e, Done)][0].result
    assert full.n_generated == 40
    pool = iter([2000 * MiB] * 3 + [100 * MiB] * 100)                 # another tenant takes memory
    engine.guard = StepGuard(GuardConfig(min_headroom=256 * MiB, every=4), read_available=lambda: next(pool))
    r = [e for e in engine.generate(GenerationRequest(**req)) if isinstance(e, Done)][0].result
    assert r.finish_reason == "length" and r.n_generated == 13          # read at tokens 0, 4, 8, 12
    assert r.tokens == full.tokens[:13]                                 # what came out is the same text
    assert "memory guard" in caplog.text and engine.guard.memory_stops == 1
    # the engine is fine afterwards
    engine.guard = None
    again = [e for e in engine.generate(GenerationRequest(**req)) if isinstance(e, Done)][0].result
    assert again.tokens == full.tokens


def test_health_and_metrics_report_the_platform(fixture_gguf, tmp_path, monkeypatch):
    from genie_rt.server.app import ServerSettings, create_app
    from test_server_support import running_server
    make_tree(tmp_path / "orin")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "orin"))
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=128, thermal_limit_c=95.0))
    assert engine.guard is not None
    app = create_app(engine, ServerSettings(model_path=str(fixture_gguf)))
    with running_server(app) as (base, _server, _thread):
        h = httpx.get(f"{base}/health").json()["platform"]
        assert h["board"]["l4t"] == "R36.4.3" and h["power_mode"]["name"] == "MAXN_SUPER"
        assert h["gpu"]["cur_hz"] == 1_020_000_000 and h["hottest_c"] == pytest.approx(58.5)
        assert h["guard"]["thermal_limit_c"] == 95.0 and h["total_power_mw"] == pytest.approx(5072 * 1942 / 1000)
        m = httpx.get(f"{base}/metrics").text
    for line in ('genie_rt_power_mode{id="2",name="MAXN_SUPER"} 1', 'genie_rt_gpu_clock_hz 1020000000',
                 'genie_rt_temperature_celsius{zone="tj-thermal"} 58.5', 'genie_rt_power_milliwatts{rail="VDD_IN"}',
                 'genie_rt_emc_clock_hz 3199000000', 'genie_rt_thermal_backoff_seconds_total 0',
                 'genie_rt_memory_budget_bytes{term="weights"}', 'genie_rt_mem_available_bytes 5368709120'):
        assert line in m, line


def test_off_a_jetson_the_platform_is_empty_and_harmless(tmp_path):
    from genie_rt.server import platform_metrics
    probe = Probe(tmp_path / "nothing")
    h = platform_metrics.health(None, probe)
    assert h["board"] is None and h["zones"] == [] and h["guard"] is None
    assert platform_metrics.metric_lines(None, probe) == ""
