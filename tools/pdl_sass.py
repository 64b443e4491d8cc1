#!/usr/bin/env python3
"""Lab (GPU): where the device's own compiler put a PDL build's early loads.

tests/test_pdl_sass.py checks the SASS of the PDL builds as the toolkit's ptxas assembles them
for sm_90. On a GPU, numba hands the PTX to the driver's (or nvJitLink's) compiler instead, which
may schedule differently. This compiles the decode GEMVs' PDL builds there - the pinned loads
(ptx.ldw_v4) and the unpinned ones (quant/gemv.py PDL_PIN_WEIGHTS False) - and counts the global
loads before the first griddepcontrol.wait (ACQBULK) in what the device will run, beside the PTX's.
Needs nvdisasm ($NVDISASM, the PATH, or the nvidia-cuda-nvdisasm wheel: ptx_helpers.cuda_tool).

    python tools/pdl_sass.py [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ptx_helpers import cuda_tool, ptx_pre_wait_loads, sass_instructions, sass_pre_wait_loads  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    nvdisasm = cuda_tool("nvdisasm")
    if not nvdisasm:
        raise SystemExit("pdl_sass: no nvdisasm (NVDISASM=path)")
    from numba import cuda

    from genie_rt.engine import kernel_cache
    from genie_rt.quant import gemv as G
    kernel_cache.configure("off")       # compiled here: a cached kernel has its cubin but no LLVM IR to list
    from genie_rt.quant import gemv_kernels as K
    from genie_rt.quant.formats import QType as Q
    cc = cuda.get_current_device().compute_capability
    builds = {
        "gemv Q4_K, 2 early trips, pinned": (K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True, EARLY=2), G.SIG_GEMV),
        "gemv Q4_K, 2 early trips, unpinned": (K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True, EARLY=2, PIN=False),
                                               G.SIG_GEMV),
        "gemv Q6_K, 1 early trip, pinned": (K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, True, 32, True, EARLY=1), G.SIG_GEMV),
        "gemv Q6_K, 2 early trips, pinned, 96 registers": (
            K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, True, 32, True, EARLY=2, MAXREG=96), G.SIG_GEMV),
        "swiglu Q4_K, pinned": (K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 32, PDL=True), G.SIG_SWIGLU),
        "swiglu Q4_K, unpinned": (K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 32, PDL=True, PIN=False),
                                  G.SIG_SWIGLU),
    }
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, (kern, sig) in builds.items():
            kern.compile(sig)
            over = next(iter(kern.overloads.values()))
            lib = over._codelibrary
            ptx_loads = ptx_pre_wait_loads(lib.get_asm_str(cc=cc))
            path = os.path.join(d, "k.cubin")
            cubin = lib.get_cubin(cc=cc)
            with open(path, "wb") as f:          # bytes, or cuda.core's ObjectCode (numba-cuda 0.30 on some hosts)
                f.write(cubin if isinstance(cubin, (bytes, bytearray)) else bytes(cubin.code))
            sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True).stdout
            insns = sass_instructions(sass)
            n = sass_pre_wait_loads(insns)
            regs = over.regs_per_thread
            rows.append(dict(build=label, ptx_pre_wait_loads=ptx_loads, sass_pre_wait_loads=n, registers=regs,
                             sass_instructions=len(insns)))
            print(f"{label:<40} PTX {ptx_loads:3d} loads before the wait, SASS {n} (registers {regs}, "
                  f"{len(insns)} instructions)")
    if args.json:
        with open(args.json, "w") as f:
            name = cuda.get_current_device().name
            json.dump(dict(device=name.decode() if isinstance(name, bytes) else str(name),
                           compute_capability=list(cc), builds=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
