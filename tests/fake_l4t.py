"""A fake Jetson Orin Nano 8 GB (Super, L4T R36.4) file tree, laid out as L4T lays out its
files, for engine/platform_probe.py's readers. `make_tree(root, **overrides)` writes it;
the keyword arguments change what matters to a test (free memory, temperatures, clocks)."""
from pathlib import Path

NVPMODEL_CONF = """\
# (excerpt) /etc/nvpmodel.conf of an Orin Nano 8 GB developer kit, JetPack 6.2
< PARAM TYPE=FILE NAME=CPU_ONLINE >
CORE_0 /sys/devices/system/cpu/cpu0/online
< POWER_MODEL ID=0 NAME=15W >
CPU_ONLINE CORE_0 1
< POWER_MODEL ID=1 NAME=25W >
CPU_ONLINE CORE_0 1
< POWER_MODEL ID=2 NAME=MAXN_SUPER >
CPU_ONLINE CORE_0 1
< POWER_MODEL ID=3 NAME=7W >
CPU_ONLINE CORE_0 1
< PM_CONFIG DEFAULT=2 >
"""

TEGRASTATS = ("12-02-2026 10:00:00 RAM 2843/7620MB (lfb 3x4MB) SWAP 0/3810MB (cached 0MB) "
              "CPU [2%@729,1%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 13%@3199 GR3D_FREQ 87%@[1020] "
              "NVDEC off NVJPG off VIC off OFA off APE 200 cpu@51.5C soc2@49.968C soc0@50.031C "
              "gpu@58.218C tj@58.5C soc1@50.5C cv0@-256C VDD_IN 9848mW/7211mW VDD_CPU_GPU_CV 4567mW/3001mW "
              "VDD_SOC 2415mW/2112mW")


def _w(root: Path, rel: str, text) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"{text}\n")


def make_tree(root: Path, mem_total_kb=7_802_880, mem_available_kb=5_242_880, mode=2, gpu_cur=1_020_000_000,
              gpu_max=1_020_000_000, gpu_load=870, temps=None, rails=True, emc=3_199_000_000) -> Path:
    root = Path(root)
    _w(root, "proc/meminfo", f"MemTotal:       {mem_total_kb} kB\nMemFree:         812345 kB\n"
                             f"MemAvailable:   {mem_available_kb} kB\nBuffers:           1234 kB\n"
                             "SwapTotal:       3901440 kB\nSwapFree:        3901440 kB\nHugePages_Total:       0")
    _w(root, "proc/device-tree/model", "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00")
    _w(root, "proc/device-tree/compatible", "nvidia,p3768-0000+p3767-0005-super\x00nvidia,p3767-0005\x00nvidia,tegra234")
    _w(root, "etc/nv_tegra_release", "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
                                     "DATE: Wed Jan  8 01:49:37 UTC 2025")
    if mode is not None:
        _w(root, "var/lib/nvpmodel/status", f"pmode:{mode:04d} fmode:quiet")
        _w(root, "etc/nvpmodel.conf", NVPMODEL_CONF)
    gpu = root / "sys/class/devfreq/17000000.gpu"
    _w(root, "sys/class/devfreq/17000000.gpu/device/of_node/name", "gpu")
    _w(root, "sys/class/devfreq/17000000.gpu/device/load", gpu_load)
    for name, v in (("cur_freq", gpu_cur), ("min_freq", 306_000_000), ("max_freq", gpu_max),
                    ("governor", "nvhost_podgov")):
        (gpu / name).write_text(f"{v}\n")
    _w(root, "sys/class/devfreq/13e00000.host1x/device/of_node/name", "host1x")   # not the GPU
    _w(root, "sys/class/devfreq/13e00000.host1x/cur_freq", 204_000_000)
    if emc is not None:
        _w(root, "sys/kernel/debug/bpmp/debug/clk/emc/rate", emc)
    temps = temps if temps is not None else {"cpu-thermal": 51500, "gpu-thermal": 58218, "cv0-thermal": -256000,
                                             "soc0-thermal": 50031, "tj-thermal": 58500}
    for i, (name, milli) in enumerate(temps.items()):
        z = f"sys/class/thermal/thermal_zone{i}"
        _w(root, f"{z}/type", name)
        _w(root, f"{z}/temp", milli)
        _w(root, f"{z}/trip_point_0_type", "passive")
        _w(root, f"{z}/trip_point_0_temp", 99000)
        _w(root, f"{z}/trip_point_1_type", "critical")
        _w(root, f"{z}/trip_point_1_temp", 104500)
    _w(root, "sys/class/thermal/cooling_device0/type", "pwm-fan")   # not a zone
    if rails:
        dev = "sys/bus/i2c/devices/1-0040"
        _w(root, f"{dev}/name", "ina3221")
        hw = f"{dev}/hwmon/hwmon1"
        for n, (label, mv, ma) in enumerate((("VDD_IN", 5072, 1942), ("VDD_CPU_GPU_CV", 5072, 900),
                                             ("VDD_SOC", 5072, 476)), start=1):
            _w(root, f"{hw}/in{n}_label", label)
            _w(root, f"{hw}/in{n}_input", mv)
            _w(root, f"{hw}/curr{n}_input", ma)
        _w(root, f"{hw}/in7_label", "sum of shunt voltages")
        _w(root, f"{hw}/in7_input", 1)
        _w(root, f"{hw}/curr7_input", 1)
        _w(root, "sys/bus/i2c/devices/1-0041/name", "lm75")
    return root
