"""A decode step's kernels from an Nsight Systems trace: each kernel's own time and the gaps.

    nsys profile --cuda-graph-trace=node --capture-range=cudaProfilerApi -o step \\
        python tools/profile_decode.py -m MODEL.gguf --trace 10
    nsys stats -r cuda_gpu_trace -f csv -o step step.nsys-rep      # -> step_cuda_gpu_trace.csv
    python tools/trace_report.py step_cuda_gpu_trace.csv [--json PATH]

profile_decode.py's ablation says what removing a family saves; this says what the GPU
did: per step (steps are told apart by the host's wait between replays, a gap > --split
us), the span from the first kernel's start to the last one's end, the sum of the kernels'
durations, and the rest - the time between one kernel's end and the next one's start
(launch of the next graph node, its ramp). Per family (the kernel's Python name): launches
per step, mean duration, the step's total and the gaps before its launches.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys


def _col(header, *prefixes):
    for p in prefixes:
        for i, h in enumerate(header):
            if h.strip().lower().startswith(p.lower()):
                return i
    raise SystemExit(f"trace_report: no column starting with {prefixes} in {header}")


def family(name: str) -> str:
    """A readable family from a numba kernel's (mangled or demangled) name."""
    n = name
    m = re.findall(r"(?:genie_rt[:._]+)?([a-z_]+)(?:[:._]+|::)(?:<locals>[:._]+)?([A-Za-z_][A-Za-z0-9_]*)", n)
    for pat in ("rmsnorm_q8", "rope_write", "decode_kernel", "quantize_q8", "qkv", "swiglu",
                "gemv", "embed", "sample_greedy", "advance_state", "greedy", "argmax"):
        if pat in n:
            return pat
    return m[-1][1] if m else n[:60]


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], [r for r in rows[1:] if r]
    i_start = _col(header, "Start")
    i_dur = _col(header, "Duration")
    i_name = _col(header, "Name")
    kernels = []
    for r in body:
        name = r[i_name]
        if name.startswith("[CUDA"):          # memcpy / memset rows
            continue
        kernels.append((int(float(r[i_start])), int(float(r[i_dur])), name))
    kernels.sort()
    return kernels


def steps_of(kernels, split_us: float):
    steps, cur = [], []
    for k in kernels:
        if cur and k[0] - (cur[-1][0] + cur[-1][1]) > split_us * 1000:
            steps.append(cur)
            cur = []
        cur.append(k)
    if cur:
        steps.append(cur)
    return steps


def summarise(step):
    span = (step[-1][0] + step[-1][1] - step[0][0]) / 1000
    busy = sum(k[1] for k in step) / 1000
    fam = {}
    prev_end = None
    for start, dur, name in step:
        f = fam.setdefault(family(name), {"launches": 0, "us": 0.0, "gap_us": 0.0})
        f["launches"] += 1
        f["us"] += dur / 1000
        if prev_end is not None:
            f["gap_us"] += max(0, start - prev_end) / 1000
        prev_end = start + dur
    return span, busy, fam


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--split", type=float, default=30.0, help="a gap longer than this (us) ends a step")
    ap.add_argument("--json", default=None)
    ap.add_argument("--first", type=int, default=24, help="list the first N kernels of the median step")
    args = ap.parse_args(argv)
    steps = steps_of(load(args.csv), args.split)
    n_k = statistics.median_low(len(s) for s in steps)
    steps = [s for s in steps if len(s) == n_k]          # whole steps only
    if not steps:
        print("no steps found", file=sys.stderr)
        return 1
    sums = [summarise(s) for s in steps]
    order = sorted(range(len(steps)), key=lambda i: sums[i][0])
    mid = order[len(order) // 2]
    span, busy, fam = sums[mid]
    print(f"{len(steps)} steps of {n_k} kernels; median step: span {span:.1f} us, kernels "
          f"{busy:.1f} us, between kernels {span - busy:.1f} us ({(span - busy) / max(1, n_k - 1):.2f} us a boundary)")
    print(f"  {'family':<16} {'launches':>8} {'us each':>8} {'us/step':>8} {'gaps us':>8}")
    for name, f in sorted(fam.items(), key=lambda kv: -kv[1]["us"]):
        print(f"  {name:<16} {f['launches']:>8} {f['us'] / f['launches']:>8.2f} {f['us']:>8.1f} {f['gap_us']:>8.1f}")
    step = steps[mid]
    print(f"first {args.first} kernels of that step (start offset, duration, gap before, us):")
    prev = None
    for start, dur, name in step[:args.first]:
        gap = 0 if prev is None else (start - prev) / 1000
        print(f"  {(start - step[0][0]) / 1000:8.2f} {dur / 1000:7.2f} {gap:6.2f}  {family(name)}")
        prev = start + dur
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": len(steps), "kernels_per_step": n_k, "span_us": span, "kernels_us": busy,
                       "families": fam,
                       "first": [dict(offset_us=(s - step[0][0]) / 1000, us=d / 1000, family=family(nm))
                                 for s, d, nm in step[:args.first]],
                       "span_us_all": [x[0] for x in sums]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
