"""Was the benchmark run at full speed? Power mode, clocks and heat around `genie-rt bench`.

`genie-rt bench` reads engine/platform_probe.py's telemetry before the first test and
right after each one, and prints `summary()` and `hints()` below its table (and puts both
in --json's "platform"). Off a Jetson the readings are empty and nothing is printed.

A hint is printed when:
- the nvpmodel mode is not the board's fastest (a MAXN mode exists and another is set);
- the GPU clock was under 90 % of its ceiling while the GPU was busy (load >= 50 %): the
  power mode's cap, a thermal cap, or the DVFS governor still ramping;
- the GPU clock fell during the run while the hottest zone warmed (thermal throttling);
- a zone came within 5 °C of its passive trip point (where the kernel throttles).
"""
from __future__ import annotations

from .platform_probe import Telemetry

NEAR_TRIP_C = 5.0
BUSY = 0.5
CLOCK_FRACTION = 0.9


def fastest_mode(modes: dict) -> tuple[int, str] | None:
    maxn = [(i, n) for i, n in modes.items() if n and n.upper().startswith("MAXN")]
    return maxn[0] if maxn else None


def summary(samples: list[Telemetry]) -> dict:
    samples = [s for s in samples if not s.empty]
    if not samples:
        return {}
    clocks = [s.gpu.cur_hz for s in samples if s.gpu and s.gpu.cur_hz]
    hottest = [s.hottest.temp_c for s in samples if s.hottest]
    power = [s.total_power_mw for s in samples if s.total_power_mw is not None]
    mode = samples[-1].power_mode
    gpu = samples[-1].gpu
    return {"power_mode": None if mode is None else mode.name or str(mode.id),
            "gpu_clock_min_hz": min(clocks, default=None), "gpu_clock_max_hz": max(clocks, default=None),
            "gpu_clock_ceiling_hz": gpu.max_hz if gpu else None,
            "emc_hz": samples[-1].emc_hz,
            "hottest_c_start": hottest[0] if hottest else None, "hottest_c_max": max(hottest, default=None),
            "power_mw_max": max(power, default=None), "samples": len(samples)}


def hints(samples: list[Telemetry]) -> list[str]:
    samples = [s for s in samples if not s.empty]
    out: list[str] = []
    if not samples:
        return out
    mode = samples[-1].power_mode
    if mode is not None:
        best = fastest_mode(mode.modes)
        if best is not None and best[0] != mode.id:
            out.append(f"power mode {mode.name or mode.id} is not the board's fastest: {best[1]} "
                       f"(`sudo nvpmodel -m {best[0]}`; docs/jetson.md)")
    busy_slow = [s.gpu for s in samples if s.gpu and s.gpu.load is not None and s.gpu.load >= BUSY
                 and s.gpu.cur_hz and s.gpu.max_hz and s.gpu.cur_hz < CLOCK_FRACTION * s.gpu.max_hz]
    if busy_slow:
        g = min(busy_slow, key=lambda g: g.cur_hz)
        out.append(f"GPU clock {g.cur_hz / 1e6:.0f} MHz of its {g.max_hz / 1e6:.0f} MHz ceiling while "
                   f"{100 * g.load:.0f} % busy: capped or still ramping (`sudo jetson_clocks` pins the clocks)")
    first, last = samples[0], samples[-1]
    if first.gpu and last.gpu and first.gpu.cur_hz and last.gpu.cur_hz and first.hottest and last.hottest \
            and last.gpu.cur_hz < CLOCK_FRACTION * first.gpu.cur_hz and last.hottest.temp_c > first.hottest.temp_c:
        out.append(f"GPU clock fell from {first.gpu.cur_hz / 1e6:.0f} to {last.gpu.cur_hz / 1e6:.0f} MHz while "
                   f"the hottest zone rose from {first.hottest.temp_c:.1f} to {last.hottest.temp_c:.1f} °C: "
                   "thermal throttling; later results are slower than the first")
    near = {}
    for s in samples:
        for z in s.zones:
            if z.passive_c is not None and z.temp_c >= z.passive_c - NEAR_TRIP_C:
                if z.name not in near or z.temp_c > near[z.name].temp_c:
                    near[z.name] = z
    for z in near.values():
        out.append(f"{z.name} reached {z.temp_c:.1f} °C, within {NEAR_TRIP_C:.0f} °C of its passive trip point "
                   f"{z.passive_c:.1f} °C (the kernel throttles there): cool the board or lower the load")
    return out
