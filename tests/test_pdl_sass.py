"""Where ptxas puts a programmatic-dependent-launch build's early loads (sm_90 SASS, no GPU).

test_pdl_ptx.py checks the PTX: which loads come before `griddepcontrol.wait`. But ptxas schedules
the machine code, and it treats the read-only path (`ld.global.nc`, ptx.ldg_v4) as free to move: on
2026-12-06 the SASS of every decode GEMV's PDL build had its weight loads (LDG.E.128.CONSTANT) after
the wait (ACQBULK), so none of them overlapped the kernel before, while the PTX said they did.
ptx.ldw_v4 (an ordinary load, L1::no_allocate) stays where the PTX has it.

Here each build is compiled to PTX (in a subprocess, as test_pdl_ptx.py does), assembled by ptxas
for sm_90 and disassembled by nvdisasm (the nvidia-cuda-nvdisasm wheel of the test extra): every
global load the PTX issues before the wait must still be before it in the SASS. The unpinned build
(quant/gemv.py PDL_PIN_WEIGHTS = False, kept to time against) is checked to lose them - what this
file is about.
"""
from __future__ import annotations

import subprocess

import pytest

from ptx_helpers import (compile_in_subprocess, cuda_tool, ptx_pre_wait_loads, sass_instructions,
                         sass_pre_wait_loads)

_SOURCE = """
from genie_rt.engine.norm import _make_rmsnorm_q8_resident
from genie_rt.kvcache.attention_decode_kernels import decode_kernel
from genie_rt.quant import gemv_kernels as K
from genie_rt.quant.formats import QType as Q
gemv_q4k_early2 = K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True, EARLY=2)
gemv_q6k_early1 = K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, True, 32, True, EARLY=1)
gemv_q6k_early2 = K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, True, 32, True, EARLY=2)
head_q6k_lpr16 = K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, False, 16, True, EARLY=1)
qkv = K.qkv_kernel(((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), (Q.Q6_K, "dp4a")), 1, 1, 32, PDL=True)
swiglu = K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 32, PDL=True)
swiglu_pair = K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 32, PDL=True, PAIR=True)
unpinned_q4k = K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True, EARLY=2, PIN=False)
norm = _make_rmsnorm_q8_resident(False, 4, True)
attention = decode_kernel(128, 2, "int8", 8, 2, q8=True, pdl=True, loop="warp", rope="neox")
from genie_rt.quant.gemv_mma_glu import mma_glu_q4k_q8k_kernel
from genie_rt.quant.gemv_mma_k import mma_q4k_q8k_kernel
from genie_rt.quant.gemv_mma_q6k import mma_q6k_q8k_kernel
mma_q4k = mma_q4k_q8k_kernel(4, True, 8, True)
mma_q6k = mma_q6k_q8k_kernel(4, False, 8, True)
mma_q6k_w16 = mma_q6k_q8k_kernel(4, False, 8, True, True)
mma_glu = mma_glu_q4k_q8k_kernel(2, True, "silu", True)
"""
_GEMVS = ("gemv_q4k_early2", "gemv_q6k_early1", "gemv_q6k_early2", "gemv_q6k_early2_cap96", "head_q6k_lpr16",
          "qkv", "swiglu", "swiglu_pair", "mma_q4k", "mma_q6k", "mma_glu",
          "mma_q6k_w16")       # mma_*: the short prefill's (PDL knob; mma_q6k_w16: the knob gemv_mma_q6k.W16)

@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    ptxas, nvdisasm = cuda_tool("ptxas"), cuda_tool("nvdisasm")
    if ptxas is None or nvdisasm is None:
        pytest.skip(f"needs ptxas ({ptxas}) and nvdisasm ({nvdisasm}): pip install -e '.[test]'")
    from genie_rt.engine.norm import KERNEL_SIGNATURES
    from genie_rt.kvcache.attention_decode_kernels import rope_signature
    from genie_rt.quant import gemv, gemv_mma_glu, gemv_mma_k, gemv_mma_q6k
    sigs = {n: gemv.SIG_GEMV for n in ("gemv_q4k_early2", "gemv_q6k_early1", "gemv_q6k_early2",
                                         "head_q6k_lpr16", "unpinned_q4k")}
    sigs.update(qkv=gemv.SIG_QKV, swiglu=gemv.SIG_SWIGLU, swiglu_pair=gemv.SIG_SWIGLU,
                norm=KERNEL_SIGNATURES["_rmsnorm_q8_r4_kernel"][0], attention=rope_signature("int8", True),
                mma_q4k=gemv_mma_k.SIGNATURE, mma_q6k=gemv_mma_q6k.SIGNATURE, mma_glu=gemv_mma_glu.SIGNATURE,
                mma_q6k_w16=gemv_mma_q6k.SIGNATURE)
    ptx = compile_in_subprocess(_SOURCE, sigs, ccs=((9, 0),))
    d = tmp_path_factory.mktemp("sass")
    out = {}
    # the decode step's Q6_K build: two early trips under gemv.PDL_MAX_REGISTERS (96), a cap the JIT
    # linker applies (not in the PTX): ptxas -maxrregcount, as the driver does
    builds = {name: (name, []) for name in sigs}
    builds["gemv_q6k_early2_cap96"] = ("gemv_q6k_early2", ["-maxrregcount=96"])
    for name, (src, extra) in builds.items():
        text = ptx[src][(9, 0)]
        (d / f"{name}.ptx").write_text(text)
        res = subprocess.run([ptxas, "-arch=sm_90", *extra, str(d / f"{name}.ptx"), "-o", str(d / f"{name}.cubin")],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        dis = subprocess.run([nvdisasm, "-c", str(d / f"{name}.cubin")], capture_output=True, text=True,
                             timeout=300)
        assert dis.returncode == 0, dis.stderr[-2000:]
        out[name] = (text, sass_instructions(dis.stdout))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", _GEMVS + ("norm", "attention"))
def test_pre_wait_loads_stay_before_the_wait_in_the_sass(sass, name):
    text, insns = sass[name]
    want = ptx_pre_wait_loads(text)
    assert want > 0, f"{name}: no load before the wait in the PTX"
    got = sass_pre_wait_loads(insns)
    assert got is not None, f"{name}: no ACQBULK (griddepcontrol.wait) in the SASS"
    if name == "qkv":       # three segments, each its own wait: the first in the SASS may be V's (Q6_K)
        want = (want, 12)
        assert got in want, f"qkv: {got} loads before the first ACQBULK, not one segment's first trip {want}"
        return
    assert got == want, f"{name}: {got} loads before ACQBULK in the SASS, {want} before the wait in the PTX"


@pytest.mark.slow
def test_read_only_loads_are_sunk_below_the_wait(sass):
    """Why ptx.ldw_v4 exists: the same build with the read-only ldg_v4 (PDL_PIN_WEIGHTS False) has
    its 12 early loads before the wait in the PTX and none before ACQBULK in the SASS. Should a
    later ptxas keep them in place, this fails: then the knob can go."""
    text, insns = sass["unpinned_q4k"]
    assert ptx_pre_wait_loads(text) == 12
    assert sass_pre_wait_loads(insns) == 0
    assert any(s.startswith("LDG.E.128.CONSTANT") for s in insns)
    pinned = sass["gemv_q4k_early2"][1]
    assert sum(1 for s in pinned if s.startswith("LDG.E.NA.128")) >= 12
