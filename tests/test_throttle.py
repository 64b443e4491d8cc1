"""engine/throttle.py: the signs of a slowed benchmark from fake L4T readings, and
`genie-rt bench` printing them (CPU back-end, micro model, fake tree)."""
import json
import sys
from pathlib import Path

from genie_rt.engine.cli import main
from genie_rt.engine.platform_probe import ROOT_ENV, GpuClock, PowerMode, Probe, Telemetry, Zone
from genie_rt.engine.throttle import hints, summary

sys.path.insert(0, str(Path(__file__).parent))
from fake_l4t import make_tree  # noqa: E402

MODES = {0: "15W", 1: "25W", 2: "MAXN_SUPER", 3: "7W"}


def tele(mode=2, cur=1020, load=0.9, temp=60.0):
    return Telemetry(time=0, power_mode=PowerMode(mode, MODES[mode], 2, MODES),
                     gpu=GpuClock(cur * 10 ** 6, 306 * 10 ** 6, 1020 * 10 ** 6, load, "nvhost_podgov"),
                     zones=(Zone("tj-thermal", temp, 99.0, 104.5),))


def test_full_speed_has_no_hints():
    assert hints([tele(), tele(temp=65.0)]) == []
    s = summary([tele(), tele(temp=65.0)])
    assert s["power_mode"] == "MAXN_SUPER" and s["hottest_c_max"] == 65.0 and s["gpu_clock_min_hz"] == 1020e6


def test_each_sign_of_a_slowed_run():
    h = "\n".join(hints([tele(mode=3)]))
    assert "power mode 7W is not the board's fastest: MAXN_SUPER (`sudo nvpmodel -m 2`" in h
    h = "\n".join(hints([tele(cur=612, load=0.95)]))
    assert "GPU clock 612 MHz of its 1020 MHz ceiling while 95 % busy" in h
    assert hints([tele(cur=306, load=0.1)]) == []                    # idle and slow: the governor, not a cap
    h = "\n".join(hints([tele(temp=80.0), tele(cur=800, load=0.3, temp=96.5)]))
    assert "fell from 1020 to 800 MHz" in h and "thermal throttling" in h
    assert "tj-thermal reached 96.5 °C, within 5 °C of its passive trip point 99.0 °C" in h
    assert hints([Telemetry(time=0)]) == [] and summary([Telemetry(time=0)]) == {}   # not a Jetson


def test_bench_prints_platform_and_hints(fixture_gguf, tmp_path, monkeypatch, capsys):
    root = make_tree(tmp_path / "orin", mode=0, temps={"tj-thermal": 97000, "gpu-thermal": 90000})
    monkeypatch.setenv(ROOT_ENV, str(root))
    assert Probe().power_mode().name == "15W"
    args = ["bench", "-m", str(fixture_gguf), "--backend", "cpu", "-p", "8", "-n", "4", "-r", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "platform: power_mode 15W" in out
    assert "throttle? power mode 15W is not the board's fastest: MAXN_SUPER" in out
    assert "throttle? tj-thermal reached 97.0" in out
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["platform"]["summary"]["hottest_c_max"] == 97.0 and len(d["platform"]["hints"]) == 2
