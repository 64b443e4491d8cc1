"""`genie-rt info`'s plan against what a load really takes on a CUDA GPU (issue 17: within 5 %).

    python tools/check_plan.py -m MODEL [--ctx N] [--json FILE]

One process, on a GPU no one else is using:
1. the device's used memory before this process touches CUDA (nvidia-smi memory.used);
2. the plan (engine/load_plan.py make_plan: what `genie-rt info` prints);
3. Engine.load with the same settings (arena, kernels, warm-up: every graph captured);
4. the device's used memory again. Its growth is the whole process: CUDA context, modules,
   graphs, the arena. It is compared with the plan's weights + KV + scratch + overhead
   (the reserve is what the plan leaves free, not what it uses), and the arena the back-end
   allocated with the plan's weights + KV + scratch (the same layout: equal, or the plan up to
   0.1 % above from the per-token rounding; never below).
Exit status 1 when the process's memory is more than 5 % from the plan.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

TOLERANCE = 0.05
ARENA_SLACK = 0.001     # the plan's arena may exceed the real one by 0.1 % (padding), never fall short
MiB = 1 << 20


def device_used_bytes() -> int | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout.split()[0]) * MiB if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    before = device_used_bytes()
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.load_plan import make_plan
    ecfg = EngineConfig(backend="cuda", n_ctx=args.ctx, kv_dtype=args.kv)
    plan = make_plan(args.model, ecfg)
    print(plan.text())
    if not plan.fits:
        return 1
    p = plan.plan
    engine = Engine.load(args.model, ecfg)
    engine.backend.synchronize()
    after = device_used_bytes()
    arena = engine.backend.lay.layout.nbytes
    planned_arena = p.weights + p.kv + p.scratch
    planned_process = planned_arena + p.overhead
    out = {"model": args.model, "n_ctx": p.n_ctx, "kv_dtype": args.kv, "planned_arena": planned_arena,
           "arena": arena, "planned_process": planned_process, "overhead_planned": p.overhead,
           "device_used_before": before, "device_used_after": after, "device": engine.backend.device_info()}
    print(f"\narena: planned {planned_arena / MiB:.1f} MiB, allocated {arena / MiB:.1f} MiB")
    # The plan prices the context linearly (two layouts 256 tokens apart give the per-token
    # bytes, rounded up), so alignment padding can put it a little above the real layout; it
    # must never be below it (H200, 2026-12-03: 0.26 / 0.51 MiB above, for the 0.6B / 4B).
    ok = arena <= planned_arena <= arena * (1 + ARENA_SLACK)
    if before is not None and after is not None:
        grown = after - before
        err = (grown - planned_process) / planned_process
        out.update(process_bytes=grown, process_error=err, context_and_rest=grown - arena)
        print(f"process (nvidia-smi memory.used growth): {grown / MiB:.1f} MiB against a plan of "
              f"{planned_process / MiB:.1f} MiB ({100 * err:+.2f} %); outside the arena "
              f"{(grown - arena) / MiB:.1f} MiB against the {p.overhead / MiB:.0f} MiB overhead term")
        ok = ok and abs(err) <= TOLERANCE
    else:
        print("nvidia-smi not readable: the process's memory was not measured")
    out["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
