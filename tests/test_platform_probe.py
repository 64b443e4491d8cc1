"""engine/platform_probe.py against a fake L4T R36 tree (tests/fake_l4t.py), a tegrastats
line, fake CUDA devices, and an empty tree (a machine that is not a Jetson)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from genie_rt.engine import memory
from genie_rt.engine.platform_probe import ROOT_ENV, Probe, gpu_facts, parse_tegrastats

sys.path.insert(0, str(Path(__file__).parent))
from fake_l4t import TEGRASTATS, make_tree  # noqa: E402


@pytest.fixture
def orin(tmp_path):
    return Probe(make_tree(tmp_path / "orin"))


def test_memory_board_and_power_mode(orin):
    mi = orin.meminfo()
    assert mi["MemTotal"] == 7_802_880 * 1024 and mi["SwapFree"] == 3_901_440 * 1024
    assert mi["HugePages_Total"] == 0                     # a count, not kB: not scaled
    assert orin.mem_available() == 5_242_880 * 1024
    b = orin.board()
    assert b.is_jetson and b.l4t == "R36.4.3" and b.model.endswith("Developer Kit Super")
    pm = orin.power_mode()
    assert (pm.id, pm.name, pm.default_id) == (2, "MAXN_SUPER", 2)
    assert pm.modes == {0: "15W", 1: "25W", 2: "MAXN_SUPER", 3: "7W"}


def test_clocks_heat_and_power(orin):
    g = orin.gpu_clock()                                  # the devfreq node whose of_node is the GPU
    assert (g.cur_hz, g.min_hz, g.max_hz, g.governor) == (1_020_000_000, 306_000_000, 1_020_000_000, "nvhost_podgov")
    assert g.load == pytest.approx(0.87)
    assert orin.emc_hz() == 3_199_000_000
    zones = {z.name: z for z in orin.thermal()}
    assert "cv0-thermal" not in zones                     # -256 °C: an unused zone, not a reading
    assert zones["gpu-thermal"].temp_c == pytest.approx(58.218)
    assert (zones["tj-thermal"].passive_c, zones["tj-thermal"].critical_c) == (99.0, 104.5)
    rails = {r.name: r for r in orin.rails()}
    assert set(rails) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}    # channel 7 (the sum) left out
    assert rails["VDD_IN"].power_mw == pytest.approx(5072 * 1942 / 1000)
    t = orin.telemetry()
    assert t.hottest.name == "tj-thermal" and t.total_power_mw == rails["VDD_IN"].power_mw
    d = t.as_dict()
    assert d["power_mode"]["name"] == "MAXN_SUPER" and d["hottest_c"] == pytest.approx(58.5)


def test_a_machine_that_is_not_a_jetson_says_nothing(tmp_path):
    p = Probe(tmp_path / "empty")
    assert p.meminfo() == {} and p.mem_available() is None
    assert p.board() is None and p.power_mode() is None and p.gpu_clock() is None and p.emc_hz() is None
    assert p.thermal() == [] and p.rails() == []
    t = p.telemetry()
    assert t.empty and t.hottest is None and t.total_power_mw is None


def test_garbage_in_the_files_is_no_reading(tmp_path):
    root = make_tree(tmp_path / "bad")
    (root / "sys/class/devfreq/17000000.gpu/cur_freq").write_text("busy\n")
    (root / "sys/class/thermal/thermal_zone1/temp").write_text("")
    (root / "var/lib/nvpmodel/status").write_text("garbage")
    p = Probe(root)
    assert p.gpu_clock().cur_hz is None and p.gpu_clock().max_hz == 1_020_000_000
    assert "gpu-thermal" not in {z.name for z in p.thermal()}
    assert p.power_mode() is None


def test_the_root_comes_from_the_environment(tmp_path, monkeypatch):
    make_tree(tmp_path / "env", mem_available_kb=1234)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "env"))
    assert Probe().mem_available() == 1234 * 1024
    assert memory.mem_available_bytes() == 1234 * 1024   # the budget reads the same file


def test_tegrastats_line():
    t = parse_tegrastats(TEGRASTATS, when=5.0)
    assert (t.ram_used, t.ram_total) == (2843 << 20, 7620 << 20)
    assert t.emc_hz == 3199 * 10 ** 6 and t.emc_load == pytest.approx(0.13)
    assert t.gpu.cur_hz == 1020 * 10 ** 6 and t.gpu.load == pytest.approx(0.87)
    temps = {z.name: z.temp_c for z in t.zones}
    assert temps["gpu"] == pytest.approx(58.218) and "cv0" not in temps and temps["tj"] == 58.5
    assert {r.name: r.power_mw for r in t.rails} == {"VDD_IN": 9848, "VDD_CPU_GPU_CV": 4567, "VDD_SOC": 2415}
    assert t.total_power_mw == 9848 and t.time == 5.0
    empty = parse_tegrastats("nothing here")
    assert empty.gpu is None and empty.zones == () and empty.emc_hz is None


def test_gpu_facts_of_an_integrated_and_a_discrete_device():
    orin = SimpleNamespace(name=b"Orin", compute_capability=(8, 7), MULTIPROCESSOR_COUNT=8, INTEGRATED=1,
                           CAN_MAP_HOST_MEMORY=1, MANAGED_MEMORY=1, CONCURRENT_MANAGED_ACCESS=0)
    f = gpu_facts(orin)
    assert f.integrated and f.name == "Orin" and f.compute_capability == (8, 7) and f.sm_count == 8
    assert f.can_map_host_memory is True and f.concurrent_managed_access is False
    bare = gpu_facts(SimpleNamespace(name="sim"))         # the simulator's device has none of them
    assert not bare.integrated and bare.managed_memory is None and bare.compute_capability is None
