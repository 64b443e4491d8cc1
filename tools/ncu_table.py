#!/usr/bin/env python3
"""Nsight Compute's text report of the decode graph's nodes -> JSON and a markdown table.

    ncu --graph-profiling node --profile-from-start off --launch-count 14 --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        python tools/profile_decode.py -m MODEL.gguf --trace 1 > ncu.txt      # tools/gpu_check.sh trace
    python tools/ncu_table.py ncu.txt [--json OUT.json]       # or a JSON this wrote before

One row per profiled kernel, in launch order: its Python name, grid x block, registers a
thread, ncu's duration and elapsed cycles (ncu serializes the nodes and locks the SM clock
to base, ~1.5 GHz on the H200: compare rows with each other, not with a replayed graph),
the SM active cycles averaged over all SMs times the SM count / min(blocks, SMs) (`busy SM
cycles`: how long an SM that had work was busy - blocks that exit at once, as decode attention's
splits past the context do, count as work here) and the achieved occupancy.
"""
import argparse
import json
import re
import sys
from pathlib import Path

_HEAD = re.compile(r"^  (?P<name>[A-Za-z_][\w:]*)\[.*\) \((?P<gx>\d+), (?P<gy>\d+), (?P<gz>\d+)\)x"
                   r"\((?P<bx>\d+), (?P<by>\d+), (?P<bz>\d+)\)")
_METRICS = {"Duration": "us", "Elapsed Cycles": "elapsed_cycles", "SM Active Cycles": "sm_active_cycles",
            "Registers Per Thread": "registers", "Achieved Occupancy": "occupancy_pct",
            "# SMs": "sms", "Warp Cycles Per Issued Instruction": "cycles_per_issue"}


def parse(text: str) -> list[dict]:
    rows: list[dict] = []
    for line in text.splitlines():
        m = _HEAD.match(line)
        if m:
            g = [int(m[k]) for k in ("gx", "gy", "gz")]
            b = [int(m[k]) for k in ("bx", "by", "bz")]
            rows.append({"kernel": m["name"].split("::")[-1] if "::" in m["name"] else m["name"],
                         "module": m["name"].rsplit("::", 1)[0], "grid": g, "block": b})
            continue
        if not rows:
            continue
        for label, key in _METRICS.items():
            if line.strip().startswith(label + " ") and key not in rows[-1]:
                parts = line.split()
                try:
                    value = float(parts[-1].replace(",", ""))
                except ValueError:
                    continue
                if key == "us":                       # ncu picks the unit: ns, us, ms
                    value *= {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(parts[-2], 1.0)
                rows[-1][key] = value
    for r in rows:
        blocks = r["grid"][0] * r["grid"][1] * r["grid"][2]
        if "sm_active_cycles" in r and "sms" in r:
            r["busy_sm_cycles"] = r["sm_active_cycles"] * r["sms"] / max(1, min(blocks, r["sms"]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="ncu's text output, or a JSON this tool wrote")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    text = Path(args.report).read_text()
    rows = json.loads(text) if args.report.endswith(".json") else parse(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("| # | module.kernel | grid x block | registers | ncu us | elapsed cycles | busy SM cycles | occupancy |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rows):
        name = f"{r['module'].split('::')[-1]}.{r['kernel']}"
        g = list(r["grid"])
        while len(g) > 1 and g[-1] == 1:
            g.pop()
        grid = "x".join(str(v) for v in g)
        print(f"| {i} | {name} | {grid} x {r['block'][0]} | {r.get('registers', 0):.0f} | {r.get('us', 0):.2f} | "
              f"{r.get('elapsed_cycles', 0):,.0f} | {r.get('busy_sm_cycles', 0):,.0f} | {r.get('occupancy_pct', 0):.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
