"""What the machine is and how it is doing: memory, board, power mode, clocks, heat, power.

Every reading comes from a file that Linux (and on a Jetson, L4T R36 / JetPack 6) exposes;
nothing is executed and nothing needs root except the EMC clock (debugfs). A file that
is absent or unreadable gives None (or an empty list): off a Jetson every reader is
harmless and says nothing.

    probe = Probe()                    # reads below "/" (or $GENIE_RT_SYSFS_ROOT)
    probe = Probe(root=tmp_path)       # tests: a fake tree laid out like L4T's

Interface (all methods read afresh; no caching, no threads):

    probe.meminfo() -> dict            /proc/meminfo, bytes ({"MemTotal": ..., "MemAvailable": ...})
    probe.mem_available() -> int|None  MemAvailable, bytes
    probe.board() -> Board|None        /proc/device-tree/model, /etc/nv_tegra_release (Jetson only)
    probe.power_mode() -> PowerMode|None  /var/lib/nvpmodel/status ("pmode:0002") named by
                                       /etc/nvpmodel.conf ("< POWER_MODEL ID=2 NAME=MAXN_SUPER >")
    probe.gpu_clock() -> GpuClock|None /sys/class/devfreq/*: the node whose device/of_node/name is
                                       ga10b/gv11b/gp10b/gpu (cur/min/max_freq in Hz; device/load in 1/1000)
    probe.emc_hz() -> int|None         /sys/kernel/debug/bpmp/debug/clk/emc/rate (root only)
    probe.thermal() -> [Zone]          /sys/class/thermal/thermal_zone*/{type,temp,trip_point_*} (m°C)
    probe.hottest_c() -> float|None    the hottest zone, from the temp files alone
    probe.rails() -> [Rail]            INA3221 rails: /sys/bus/i2c/devices/*/name == ina3221,
                                       hwmon/hwmon*/in{N}_label, in{N}_input (mV), curr{N}_input (mA)
    probe.telemetry() -> Telemetry     all of the above that changes, with the time it was read

`parse_tegrastats(line)` reads one line of `tegrastats` into the same Telemetry (its EMC
figure is the one way to see the memory clock without root). `gpu_facts(dev)` reads the
CUDA device attributes that matter here (integrated, mapped host memory, managed memory)
from a numba device or any object with those attribute names (tests pass a namespace).
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT_ENV = "GENIE_RT_SYSFS_ROOT"
GPU_NODE_NAMES = ("ga10b", "gv11b", "gp10b", "gpu")   # the integrated GPU's device-tree node
INVALID_TEMP_C = -40.0   # Orin reports unused zones (cv*) as -256 °C: below this is "no reading"


@dataclass(frozen=True)
class Board:
    model: str            # "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super"
    l4t: str | None       # "R36.4.3"
    is_jetson: bool


@dataclass(frozen=True)
class PowerMode:
    id: int
    name: str | None                  # "MAXN_SUPER", "15W", ...; None when nvpmodel.conf is absent
    default_id: int | None            # PM_CONFIG DEFAULT
    modes: dict = field(default_factory=dict)   # id -> name, every mode the board offers


@dataclass(frozen=True)
class GpuClock:
    cur_hz: int | None
    min_hz: int | None
    max_hz: int | None
    load: float | None                # 0..1, the devfreq governor's view of the last window
    governor: str | None


@dataclass(frozen=True)
class Zone:
    name: str                         # "gpu-thermal", "tj-thermal", "cpu@" from tegrastats ...
    temp_c: float
    passive_c: float | None = None    # the lowest passive trip: where the kernel starts throttling
    critical_c: float | None = None


@dataclass(frozen=True)
class Rail:
    name: str                         # "VDD_IN" (the whole module), "VDD_CPU_GPU_CV", "VDD_SOC"
    power_mw: float
    volt_mv: float | None = None
    curr_ma: float | None = None


@dataclass(frozen=True)
class Telemetry:
    time: float
    power_mode: PowerMode | None = None
    gpu: GpuClock | None = None
    emc_hz: int | None = None
    emc_load: float | None = None      # only from tegrastats
    zones: tuple = ()
    rails: tuple = ()
    ram_used: int | None = None        # only from tegrastats
    ram_total: int | None = None

    @property
    def hottest(self) -> Zone | None:
        return max(self.zones, key=lambda z: z.temp_c, default=None)

    @property
    def total_power_mw(self) -> float | None:
        """VDD_IN is the module's input (what the L4T docs call total); else the sum."""
        for r in self.rails:
            if r.name in ("VDD_IN", "POM_5V_IN"):
                return r.power_mw
        return sum(r.power_mw for r in self.rails) if self.rails else None

    @property
    def empty(self) -> bool:
        return not (self.power_mode or self.gpu or self.emc_hz or self.zones or self.rails)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["zones"], d["rails"] = list(d["zones"]), list(d["rails"])
        d["power_mode"] = None if self.power_mode is None else \
            {"id": self.power_mode.id, "name": self.power_mode.name, "default_id": self.power_mode.default_id}
        d["hottest_c"] = None if self.hottest is None else self.hottest.temp_c
        d["total_power_mw"] = self.total_power_mw
        return d


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except (OSError, ValueError):
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


class Probe:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root if root is not None else os.environ.get(ROOT_ENV) or "/")

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    # -- memory --------------------------------------------------------------------------
    def meminfo(self) -> dict:
        text = _read(self.path("/proc/meminfo"))
        out = {}
        for line in (text or "").splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        return out

    def mem_available(self) -> int | None:
        return self.meminfo().get("MemAvailable")

    # -- what the board is ---------------------------------------------------------------
    def board(self) -> Board | None:
        model = _read(self.path("/proc/device-tree/model"))
        release = _read(self.path("/etc/nv_tegra_release"))
        compatible = _read(self.path("/proc/device-tree/compatible")) or ""
        is_jetson = release is not None or "nvidia,tegra" in compatible
        if not is_jetson:
            return None
        l4t = None
        m = re.search(r"R(\d+) \(release\), REVISION: ([0-9.]+)", release or "")
        if m:
            l4t = f"R{m.group(1)}.{m.group(2)}"
        return Board(model=(model or "NVIDIA Jetson").rstrip("\x00"), l4t=l4t, is_jetson=True)

    def power_mode(self) -> PowerMode | None:
        m = re.search(r"pmode:\s*(\d+)", _read(self.path("/var/lib/nvpmodel/status")) or "")
        if not m:
            return None
        conf = _read(self.path("/etc/nvpmodel.conf")) or ""
        modes = {int(i): name for i, name in re.findall(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>", conf)}
        d = re.search(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)\s*>", conf)
        mode_id = int(m.group(1))
        return PowerMode(mode_id, modes.get(mode_id), int(d.group(1)) if d else None, modes)

    # -- clocks --------------------------------------------------------------------------
    def gpu_clock(self) -> GpuClock | None:
        base = self.path("/sys/class/devfreq")
        try:
            nodes = sorted(base.iterdir())
        except OSError:
            return None
        for node in nodes:
            if _read(node / "device" / "of_node" / "name") not in GPU_NODE_NAMES:
                continue
            load = _int(node / "device" / "load")
            return GpuClock(cur_hz=_int(node / "cur_freq"), min_hz=_int(node / "min_freq"),
                            max_hz=_int(node / "max_freq"), load=None if load is None else load / 1000,
                            governor=_read(node / "governor"))
        return None

    def emc_hz(self) -> int | None:
        return _int(self.path("/sys/kernel/debug/bpmp/debug/clk/emc/rate"))

    # -- heat and power ------------------------------------------------------------------
    def thermal(self) -> list[Zone]:
        base = self.path("/sys/class/thermal")
        try:
            nodes = sorted(p for p in base.iterdir() if p.name.startswith("thermal_zone"))
        except OSError:
            return []
        zones = []
        for node in nodes:
            milli = _int(node / "temp")
            if milli is None or milli / 1000 <= INVALID_TEMP_C:
                continue
            passive, critical = [], []
            for trip in node.glob("trip_point_*_type"):
                kind = _read(trip)
                t = _int(trip.with_name(trip.name.replace("_type", "_temp")))
                if t is None or t <= 0:
                    continue
                (passive if kind == "passive" else critical if kind == "critical" else []).append(t / 1000)
            zones.append(Zone(_read(node / "type") or node.name, milli / 1000,
                              min(passive, default=None), min(critical, default=None)))
        return zones

    def hottest_c(self) -> float | None:
        """The hottest zone's temperature, from the temp files alone (cheap enough per token)."""
        best = None
        for node in self.path("/sys/class/thermal").glob("thermal_zone*"):
            milli = _int(node / "temp")
            if milli is not None and milli / 1000 > INVALID_TEMP_C and (best is None or milli / 1000 > best):
                best = milli / 1000
        return best

    def rails(self) -> list[Rail]:
        base = self.path("/sys/bus/i2c/devices")
        try:
            devices = sorted(base.iterdir())
        except OSError:
            return []
        rails = []
        for dev in devices:
            if "ina3221" not in (_read(dev / "name") or ""):
                continue
            for hw in sorted((dev / "hwmon").glob("hwmon*")):
                for label in sorted(hw.glob("in*_label")):
                    name = _read(label) or ""
                    n = label.name[2:-len("_label")]
                    if not n.isdigit() or n == "7" or not name or "NC" in name.split("_"):
                        continue   # channel 7: the sum of shunt voltages; NC: not connected
                    mv, ma = _int(hw / f"in{n}_input"), _int(hw / f"curr{n}_input")
                    if mv is None or ma is None:
                        continue
                    rails.append(Rail(name, mv * ma / 1000, mv, ma))
        return rails

    def telemetry(self) -> Telemetry:
        return Telemetry(time=time.time(), power_mode=self.power_mode(), gpu=self.gpu_clock(),
                         emc_hz=self.emc_hz(), zones=tuple(self.thermal()), rails=tuple(self.rails()))


_TS_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_TS_EMC = re.compile(r"\bEMC_FREQ (\d+)%(?:@(\d+))?")
_TS_GR3D = re.compile(r"\bGR3D_FREQ (\d+)%(?:@\[?(\d+)\]?)?")
_TS_TEMP = re.compile(r"\b([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C\b")
_TS_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]+) (\d+)mW/(\d+)mW")


def parse_tegrastats(line: str, when: float | None = None) -> Telemetry:
    """One line of `tegrastats` (L4T R36): RAM, EMC and GPU (GR3D) load and clock, the
    temperatures and the rails' instantaneous power. Fields it lacks are None/empty."""
    ram = _TS_RAM.search(line)
    emc = _TS_EMC.search(line)
    gr3d = _TS_GR3D.search(line)
    gpu = None
    if gr3d:
        mhz = gr3d.group(2)
        gpu = GpuClock(cur_hz=int(mhz) * 1_000_000 if mhz else None, min_hz=None, max_hz=None,
                       load=int(gr3d.group(1)) / 100, governor=None)
    zones = tuple(Zone(name, float(t)) for name, t in _TS_TEMP.findall(line) if float(t) > INVALID_TEMP_C)
    rails = tuple(Rail(name, float(now)) for name, now, _avg in _TS_RAIL.findall(line))
    return Telemetry(time=time.time() if when is None else when, gpu=gpu,
                     emc_hz=int(emc.group(2)) * 1_000_000 if emc and emc.group(2) else None,
                     emc_load=int(emc.group(1)) / 100 if emc else None, zones=zones, rails=rails,
                     ram_used=int(ram.group(1)) << 20 if ram else None,
                     ram_total=int(ram.group(2)) << 20 if ram else None)


@dataclass(frozen=True)
class GpuFacts:
    name: str
    compute_capability: tuple | None
    sm_count: int | None
    integrated: bool                  # shares the host's memory (Jetson)
    can_map_host_memory: bool | None
    managed_memory: bool | None
    concurrent_managed_access: bool | None   # False on Orin: the CPU may not touch managed
                                             # memory while a kernel runs


def gpu_facts(dev) -> GpuFacts:
    def attr(name):
        v = getattr(dev, name, None)
        return None if v is None else bool(v)
    name = getattr(dev, "name", "GPU")
    cc = getattr(dev, "compute_capability", None)
    return GpuFacts(name=name.decode() if isinstance(name, bytes) else str(name),
                    compute_capability=tuple(cc) if cc is not None else None,
                    sm_count=getattr(dev, "MULTIPROCESSOR_COUNT", None),
                    integrated=bool(getattr(dev, "INTEGRATED", 0)),
                    can_map_host_memory=attr("CAN_MAP_HOST_MEMORY"), managed_memory=attr("MANAGED_MEMORY"),
                    concurrent_managed_access=attr("CONCURRENT_MANAGED_ACCESS"))
