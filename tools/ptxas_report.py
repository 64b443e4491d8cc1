#!/usr/bin/env python3
"""Registers, spills and shared memory of the MMQ and GEMV kernels, without a GPU.

Compiles the kernels to PTX (cuda.compile_ptx, in a subprocess without the simulator,
as the PTX tests do), then asks ptxas for the resource report of each target:

    python tools/ptxas_report.py                     # ptxas from $PTXAS or the PATH
    PTXAS=/path/to/ptxas python tools/ptxas_report.py --cc 87 90

ptxas comes with any CUDA toolkit, or from the nvidia-cuda-nvcc-cu12 wheel
(nvidia/cuda_nvcc/bin/ptxas). Kernels the package compiles with max_registers get the
same -maxrregcount here, so the report is what the driver will load.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

SOURCE = '''
from dataclasses import replace
from genie_rt.quant import mmq, mmq_defs as D, mmq_kquants as KQ, mmq_plan as MP
from genie_rt.quant import gemv_kernels as GK
from genie_rt.quant.formats import QType as Q
_small = {n: MP.small_config(n) for n in (16, 40)}
KERNELS = {}
for _n, _c in _small.items():
    for _fmt, _epi in ((KQ.Q4_K, D.EPI_STORE), (KQ.Q4_K, D.EPI_ADD), (KQ.Q4_K, D.EPI_SWIGLU),
                       (KQ.Q6_K, D.EPI_ADD)):
        for _st in (2, 3):
            _cfg2 = replace(_c, stages=_st)
            _name = f"mmq_{D.FORMAT_NAMES[_fmt]}_{D.EPI_NAMES[_epi]}_n{_n}_s{_st}"
            globals()[_name] = mmq._kernel(_fmt, _cfg2, _epi, D.RED_KERNEL)
            KERNELS[_name] = (_fmt, _cfg2, _epi)
gemv_q6k_lpr32 = GK.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, False, 32)
gemv_q6k_lpr16 = GK.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, False, 16)
gemv_q4k_lpr32 = GK.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32)
swiglu_q4k_lpr16 = GK.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 16)
gemv_q4k_nt8_lpr32 = GK.gemv_kernel(Q.Q4_K, "dp4a", 8, 1, True, 32)      # 8 tokens a launch
swiglu_q4k_nt8_lpr16 = GK.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 8, 1, 16)
# the short prefill's q8_K kernels (engine/cuda_short_prefill.py): name -> (kernel, signature, register cap)
from genie_rt.quant import gemv_mma_k as MK, gemv_mma_q6k as M6, gemv_mma_glu as MG, gemv_mma_qkv as MQ

MMA = {}
for _pdl in (False, True):
    _s = "_pdl" if _pdl else ""
    MMA["mma_q4k_nt8_b8pipe" + _s] = (MK.mma_q4k_q8k_kernel(4, True, 8, _pdl), MK.SIGNATURE, None)
    MMA["mma_q6k_nt8" + _s] = (M6.mma_q6k_q8k_kernel(4, False, 8, _pdl), M6.SIGNATURE, None)   # (unpipelined: default_pipe)
    _cap = MG.PDL_MAX_REGISTERS if _pdl else None
    MMA["mma_glu_q4k" + _s] = (MG.mma_glu_q4k_q8k_kernel(2, True, "silu", _pdl, _cap), MG.SIGNATURE, _cap)
    MMA["mma_qkv_q4k_q4k_q6k" + _s] = (MQ.mma_qkv_kernel(("Q4_K", "Q4_K", "Q6_K"), 4, True, _pdl), MQ.SIGNATURE, None)
# gemv_mma_k's Q4_K default up to 8 tokens (default_build: W16, unpipelined), its PDL build, and the others
MMA["mma_q4k_nt8_w16"] = (MK.mma_q4k_q8k_kernel(8, False, 8, False, True), MK.SIGNATURE, None)
MMA["mma_q4k_nt8_w16_pdl"] = (MK.mma_q4k_q8k_kernel(8, False, 8, True, True), MK.SIGNATURE, None)
MMA["mma_q4k_nt8_w16_pipe"] = (MK.mma_q4k_q8k_kernel(8, True, 8, False, True), MK.SIGNATURE, None)
MMA["mma_q4k_nt8_b8block"] = (MK.mma_q4k_q8k_kernel(8, False, 8, False), MK.SIGNATURE, None)
MMA["mma_glu_q4k_w16"] = (MG.mma_glu_q4k_q8k_kernel(2, False, "silu", False, None, True), MG.SIGNATURE, None)
MMA["mma_qkv_q4k_q4k_q6k_w16"] = (MQ.mma_qkv_kernel(("Q4_K", "Q4_K", "Q6_K"), 4, False, False, True), MQ.SIGNATURE, None)
MMA["mma_q6k_nt8_pipe"] = (M6.mma_q6k_q8k_kernel(4, True, 8, False), M6.SIGNATURE, None)
MMA["mma_q4k_nt16"] = (MK.mma_q4k_q8k_kernel(4, False, 16, False), MK.SIGNATURE, None)
MMA["mma_q6k_nt16"] = (M6.mma_q6k_q8k_kernel(4, False, 16, False), M6.SIGNATURE, None)
# the Q6_K quants by 16-byte lane loads (lab knob gemv_mma_q6k.W16): ffn_down's build, its PDL build, and q/k/v's
MMA["mma_q6k_nt8_w16"] = (M6.mma_q6k_q8k_kernel(4, False, 8, False, True), M6.SIGNATURE, None)
MMA["mma_q6k_nt8_w16_pdl"] = (M6.mma_q6k_q8k_kernel(4, False, 8, 2, True), M6.SIGNATURE, None)
MMA["mma_qkv_q4k_q4k_q6k_w16q6"] = (MQ.mma_qkv_kernel(("Q4_K", "Q4_K", "Q6_K"), 4, False, False, True, True),
                                    MQ.SIGNATURE, None)
for _name, (_k, _sig, _cap) in MMA.items():
    globals()[_name] = _k
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cc", nargs="*", default=["90", "87"])
    ap.add_argument("--filter", default="", help="regex on kernel names")
    args = ap.parse_args(argv)
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if not ptxas:
        sys.exit("ptxas not found: set PTXAS (e.g. the nvidia-cuda-nvcc-cu12 wheel's bin/ptxas)")
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    from ptx_helpers import compile_in_subprocess
    from genie_rt.quant import gemv as G
    from genie_rt.quant import mmq
    from genie_rt.quant import mmq_defs as D

    ns: dict = {}
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"          # only to build the table of names here
    exec(SOURCE, ns)                                   # noqa: S102 (our own source above)
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    pat = re.compile(args.filter)
    sigs, caps = {}, {}
    for name, (fmt, cfg, epi) in ns["KERNELS"].items():
        if pat.search(name):
            sigs[name] = mmq.kernel_signature(fmt)
            caps[name] = D.register_capped(cfg.mt, cfg.nt, cfg.threads, epi)
    for name, sig in (("gemv_q6k_lpr32", G.SIG_GEMV), ("gemv_q6k_lpr16", G.SIG_GEMV),
                      ("gemv_q4k_lpr32", G.SIG_GEMV), ("swiglu_q4k_lpr16", G.SIG_SWIGLU),
                      ("gemv_q4k_nt8_lpr32", G.SIG_GEMV), ("swiglu_q4k_nt8_lpr16", G.SIG_SWIGLU)):
        if pat.search(name):
            sigs[name], caps[name] = sig, False
    for name, (_, sig, cap) in ns["MMA"].items():
        if pat.search(name):
            sigs[name], caps[name] = sig, cap
    ccs = tuple((int(c[0]), int(c[1:])) for c in args.cc)
    ptx = compile_in_subprocess(SOURCE, sigs, ccs=ccs)
    with tempfile.TemporaryDirectory() as tmp:
        for name in sigs:
            line = [f"{name:40s}"]
            for cc, text in ptx[name].items():
                f = Path(tmp) / f"{name}_{cc[0]}{cc[1]}.ptx"
                f.write_text(text)
                cmd = [ptxas, "-v", f"--gpu-name=sm_{cc[0]}{cc[1]}", str(f), "-o", os.devnull]
                cap = D.MAX_REGISTERS if caps[name] is True else caps[name]
                if cap:
                    cmd.append(f"-maxrregcount={cap}")
                r = subprocess.run(cmd, capture_output=True, text=True)
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spill = re.search(r"(\d+) bytes spill stores", r.stderr)
                line.append(f"sm_{cc[0]}{cc[1]}: {regs.group(1) if regs else '?':>3s} regs"
                            f"{' (cap)' if caps[name] else '      '} spill {spill.group(1) if spill else '?'} B")
            print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
