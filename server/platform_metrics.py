"""Power, heat, clocks and the step guard in GET /health ("platform") and GET /metrics.

Read afresh at each request from sysfs (engine/platform_probe.py: ~50 small files on a
Jetson, well under a millisecond; nothing at all where the files are absent). Series:

    genie_rt_mem_available_bytes                 MemAvailable (the pool an integrated GPU shares)
    genie_rt_power_mode{name,id}                 1 for the nvpmodel mode in force
    genie_rt_gpu_clock_hz / genie_rt_gpu_clock_max_hz / genie_rt_gpu_load_ratio   devfreq
    genie_rt_emc_clock_hz                        memory clock (readable by root only)
    genie_rt_temperature_celsius{zone}           every thermal zone with a reading
    genie_rt_power_milliwatts{rail}              INA3221 rails (VDD_IN: the whole module)
    genie_rt_memory_budget_bytes{term}           the load's budget: weights, kv, scratch, overhead,
                                                 reserve, total, available (engine/memory.py)
    genie_rt_memory_guard_stops_total            replies ended because memory ran short
    genie_rt_thermal_backoff_seconds_total       time spent waiting while too hot
"""
from __future__ import annotations

import dataclasses

from genie_rt.engine.platform_probe import Probe


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def health(engine, probe: Probe | None = None) -> dict:
    probe = probe or Probe()
    t = probe.telemetry()
    guard = getattr(engine, "guard", None)
    board = probe.board()
    return {"board": None if board is None else dataclasses.asdict(board), "mem_available": probe.mem_available(),
            **t.as_dict(), "guard": guard.snapshot() if guard is not None else None}


def metric_lines(engine, probe: Probe | None = None) -> str:
    probe = probe or Probe()
    t = probe.telemetry()
    out: list[str] = []

    def metric(name, kind, help_, samples):
        samples = [(lab, v) for lab, v in samples if v is not None]
        if not samples:
            return
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for lab, v in samples:
            labels = ",".join(f'{k}="{_esc(x)}"' for k, x in lab.items())
            out.append(f"{name}{{{labels}}} {v}" if labels else f"{name} {v}")

    plan = getattr(engine, "plan", None)
    if dataclasses.is_dataclass(plan):
        metric("genie_rt_memory_budget_bytes", "gauge", "The memory budget checked at load, by term.",
               [({"term": k}, getattr(plan, k)) for k in ("weights", "kv", "scratch", "overhead", "reserve",
                                                          "total", "available")])
    metric("genie_rt_mem_available_bytes", "gauge", "MemAvailable of the host (shared with an integrated GPU).",
           [({}, probe.mem_available())])
    if t.power_mode is not None:
        metric("genie_rt_power_mode", "gauge", "The nvpmodel power mode in force (1).",
               [({"id": t.power_mode.id, "name": t.power_mode.name or ""}, 1)])
    if t.gpu is not None:
        metric("genie_rt_gpu_clock_hz", "gauge", "GPU clock (devfreq cur_freq).", [({}, t.gpu.cur_hz)])
        metric("genie_rt_gpu_clock_max_hz", "gauge", "GPU clock ceiling (devfreq max_freq).", [({}, t.gpu.max_hz)])
        metric("genie_rt_gpu_load_ratio", "gauge", "GPU load seen by the devfreq governor, 0..1.", [({}, t.gpu.load)])
    metric("genie_rt_emc_clock_hz", "gauge", "Memory controller (EMC) clock.", [({}, t.emc_hz)])
    metric("genie_rt_temperature_celsius", "gauge", "Thermal zone temperature.",
           [({"zone": z.name}, z.temp_c) for z in t.zones])
    metric("genie_rt_power_milliwatts", "gauge", "Power rail (INA3221), instantaneous.",
           [({"rail": r.name}, round(r.power_mw, 1)) for r in t.rails])
    guard = getattr(engine, "guard", None)
    if guard is not None:
        s = guard.snapshot()
        metric("genie_rt_memory_guard_stops_total", "counter",
               "Replies ended early because available memory fell below the headroom kept free.",
               [({}, s["memory_stops"])])
        metric("genie_rt_thermal_backoff_seconds_total", "counter",
               "Seconds generation waited because the hottest zone was at or above the limit.",
               [({}, s["backoff_seconds"])])
    return "\n".join(out) + ("\n" if out else "")
