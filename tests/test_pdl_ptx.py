"""The programmatic-dependent-launch builds of the decode step's kernels (quant/pdl.py), as PTX
for sm_90 (compiled in a subprocess without the simulator; no GPU needed).

The rule every PDL build keeps: `griddepcontrol.launch_dependents` first (the next kernel may
launch), and no read of another kernel's output before `griddepcontrol.wait` (a PDL launch
may start while the kernel before it still writes). Checked here on the PTX itself: the only
global loads before the wait are of constants - none in rope_write, the attention and
quantize_q8, the norm weight in rmsnorm_q8, a lane's first three weight units in a GEMV -
and what the kernel before wrote is read by coherent loads, never `ld.global.nc`: ptxas may
schedule a non-coherent load (data promised unchanging while the kernel runs) above the wait,
which on the H200 gave wrong logits (2026-12-04).
Which kernels the engine asks for these builds: tests/test_decode_switches.py (simulator and GPU).
"""
import re

import pytest

from ptx_helpers import assert_no_f64, compile_in_subprocess, global_loads, ptx_pre_wait_loads

_SOURCE = """
from genie_rt.engine.norm import _make_rmsnorm_q8_resident
from genie_rt.kvcache.attention_decode_kernels import decode_kernel
from genie_rt.kvcache.rope_write import rope_write_kernel
from genie_rt.quant import gemv_kernels as K
from genie_rt.quant.formats import QType as Q
norm_pdl = _make_rmsnorm_q8_resident(False, 4, True)
norm_plain = _make_rmsnorm_q8_resident(False, 4, False)
rope_pdl = rope_write_kernel("int8", pdl=True)
attention_pdl = decode_kernel(128, 2, "int8", pdl=True, loop="block")
attention_warp_pdl = decode_kernel(128, 2, "int8", pdl=True, loop="warp")   # the engine's default
attention_warp_gemma_pdl = decode_kernel(256, 4, "f16", 4, 4, 512, pdl=True, loop="warp")
attention_q8_pdl = decode_kernel(128, 2, "int8", q8=True, pdl=True, loop="block")
attention_gemma_pdl = decode_kernel(256, 4, "int8", 4, 4, 512, pdl=True, loop="block")   # window, ring, hd 256
rope_gemma_pdl = rope_write_kernel("int8", ring=True, pdl=True)
rope_llama_pdl = rope_write_kernel("f16", neox=False, qk_norm=False, pdl=True)
quantize_pdl = K.quantize_q8_pdl_kernel
gemv_q4k_pdl = K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True)
gemv_q4k_pdl_early2 = K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True, EARLY=2)
gemv_q6k_pdl_early3 = K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, True, 32, True, EARLY=3)
attention_rope_pdl = decode_kernel(128, 2, "int8", pdl=True, loop="warp", rope="neox")   # Qwen3, fused rope
attention_rope_gemma_pdl = decode_kernel(256, 4, "f16", 4, 4, 512, pdl=True, loop="warp", rope="neox", ring=True)
attention_rope_llama_pdl = decode_kernel(64, 3, "int8", pdl=True, loop="block", rope="normal", qk_norm=False)
attention_rope_plain = decode_kernel(128, 2, "int8", loop="warp", rope="neox")
# the lab knob MERGE_PREFETCH (kvcache/attention.py): the engine's build with it
attention_rope_chain_pdl = decode_kernel(128, 2, "int8", 8, 2, q8=True, pdl=True, loop="warp", rope="neox",
                                         merge_pf=True)
swiglu_pair_pdl = K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 32, "silu", True, True)
"""
# global loads a build may issue before its wait: constants only
PRE_WAIT_LOADS = {"norm_pdl": 1, "rope_pdl": 0, "attention_pdl": 0, "attention_q8_pdl": 0,
                  # the warp loop: the position (state[0], written by the step before) and the first
                  # trip's rows of earlier positions (4 rows x K, V and their int8 scales; f16: no
                  # scales) - attention_decode_tiles.warp_tiles EARLY
                  "attention_warp_pdl": 17, "attention_warp_gemma_pdl": 9,
                  "attention_gemma_pdl": 0, "rope_gemma_pdl": 0, "rope_llama_pdl": 0,
                  "quantize_pdl": 0, "gemv_q4k_pdl": 6,      # Q4_K: 3 units x (qs, header)
                  "gemv_q4k_pdl_early2": 12,                  # gemv.PDL_EARLY_TRIPS: two trips,
                  "gemv_q6k_pdl_early3": 36,                  # three (Q6_K: 4 loads a unit)
                  "swiglu_pair_pdl": 12,                      # both rows' first trip
                  # the attention that ropes its own token (attention_decode_rope.py): the warp loop's
                  # early loads as above; the block loop: nothing
                  "attention_rope_pdl": 17, "attention_rope_gemma_pdl": 9,
                  "attention_rope_llama_pdl": 0,
                  "attention_rope_chain_pdl": 9}             # 8 x 2: two rows a lane (K, V, scales) + state


@pytest.fixture(scope="module")
def ptx():
    from genie_rt.engine.norm import KERNEL_SIGNATURES
    from genie_rt.kvcache.attention_decode_kernels import DECODE_SIGNATURE, DECODE_SIGNATURE_Q8, rope_signature
    from genie_rt.kvcache.rope_write import signature
    from genie_rt.quant import gemv
    norm_sig = KERNEL_SIGNATURES["_rmsnorm_q8_r4_kernel"][0]
    return compile_in_subprocess(_SOURCE, {
        "norm_pdl": norm_sig, "norm_plain": norm_sig, "rope_pdl": signature("int8"),
        "rope_gemma_pdl": signature("int8"), "rope_llama_pdl": signature("f16"),
        "attention_pdl": DECODE_SIGNATURE, "attention_q8_pdl": DECODE_SIGNATURE_Q8,
        "attention_gemma_pdl": DECODE_SIGNATURE, "attention_warp_pdl": DECODE_SIGNATURE,
        "attention_warp_gemma_pdl": DECODE_SIGNATURE,
        "quantize_pdl": gemv.SIG_QUANTIZE, "gemv_q4k_pdl": gemv.SIG_GEMV,
        "gemv_q4k_pdl_early2": gemv.SIG_GEMV, "gemv_q6k_pdl_early3": gemv.SIG_GEMV,
        "swiglu_pair_pdl": gemv.SIG_SWIGLU, "attention_rope_pdl": rope_signature("int8"),
        "attention_rope_gemma_pdl": rope_signature("f16"), "attention_rope_llama_pdl": rope_signature("int8"),
        "attention_rope_plain": rope_signature("int8"),
        "attention_rope_chain_pdl": rope_signature("int8", True)}, ccs=((9, 0),))


@pytest.mark.parametrize("name", sorted(PRE_WAIT_LOADS))
def test_pdl_build_reads_nothing_of_the_kernel_before_until_it_waits(ptx, name):
    from ptx_helpers import local_memory_bytes
    text = ptx[name][(9, 0)]
    assert_no_f64(text, name)
    assert local_memory_bytes(text) == 0, f"{name}: local memory used"
    trigger = text.find("griddepcontrol.launch_dependents;")
    wait = text.find("griddepcontrol.wait;")
    assert 0 <= trigger < wait, f"{name}: launch_dependents must come first, then the wait"
    before = ptx_pre_wait_loads(text)
    assert before == PRE_WAIT_LOADS[name], f"{name}: {before} global loads before the wait"
    assert global_loads(text[wait:]) > 0, f"{name}: nothing read after the wait?"
    # what the kernel before wrote is read coherently: an ld.global.nc (data unchanging for the
    # kernel's lifetime) may be scheduled above the wait by ptxas, and with PDL it is not
    if name.startswith(("gemv", "swiglu")):   # later trips' weights are .nc; the activations not
        assert "ld.global.nc.v4.f32" not in text and "ld.global.v4.f32" in text, name
        assert "ld.global.v4.u32" in text, name
    else:
        assert "ld.global.nc" not in text[wait:], f"{name}: a non-coherent load after the wait"


def test_plain_build_has_no_griddepcontrol(ptx):
    assert "griddepcontrol" not in ptx["norm_plain"][(9, 0)]


def test_attention_that_ropes_its_token_reads_the_cache_coherently_in_every_build(ptx):
    # its block writes the new K/V row and reads it back after a barrier: a read-only (.nc) load
    # of the cache would promise data that does not change while the kernel runs - so even the
    # plain (sm_80 / Jetson) build reads everything coherently (attention_decode_rope.py)
    from ptx_helpers import local_memory_bytes
    text = ptx["attention_rope_plain"][(9, 0)]
    assert "griddepcontrol" not in text
    assert "ld.global.nc" not in text and "ld.global.v4.u32" in text
    assert local_memory_bytes(text) == 0
    assert "st.global.u8" in text or "st.global.s8" in text, "the new K/V row is written"


_SHAPE_SOURCE = """
from genie_rt.kvcache.attention_decode_kernels import decode_kernel
shape_8x2 = decode_kernel(128, 2, "int8", 8, 2, pdl=True, loop="warp", rope="neox", q8=True)
shape_4x4 = decode_kernel(128, 2, "int8", 4, 4, pdl=True, loop="warp", rope="neox", q8=True)
shape_8x2_one_head = decode_kernel(128, 1, "int8", 8, 2, pdl=True, loop="warp", rope="neox", q8=True)
# with the lab knob MERGE_PREFETCH on: the split sizing must still hold
chain_8x2 = decode_kernel(128, 2, "int8", 8, 2, pdl=True, loop="warp", rope="neox", q8=True, merge_pf=True)
chain_8x2_one_head = decode_kernel(128, 1, "int8", 8, 2, pdl=True, loop="warp", rope="neox", q8=True,
                                   merge_pf=True)
# the long graph's tensor-core loop (sm_90), the 4B's whole group of 4 heads a block, and with MERGE_PREFETCH "mma"
mma_8x1 = decode_kernel(128, 4, "int8", 8, 1, pdl=True, loop="mma", rope="neox", q8=True, even_splits=True)
chain_mma_8x1 = decode_kernel(128, 4, "int8", 8, 1, pdl=True, loop="mma", rope="neox", q8=True, even_splits=True,
                              merge_pf=True)
"""


@pytest.mark.slow
def test_default_attention_shapes_fit_the_split_sizing(tmp_path):
    """kvcache/attention.py sizes the default split count by the blocks an SM the kernel's registers
    allow (`_REGISTERS`, `_blocks_per_sm`): the engine's decode build (Qwen3-4B: hd 128, two heads
    a block, int8, warp loop, PDL, rope, q8) must still fit - else the default splits make a second
    wave. ptxas for sm_90 (skipped where ptxas is not installed)."""
    import shutil
    import subprocess

    from genie_rt.kvcache.attention import _REGISTERS, _blocks_per_sm, blocks_at, default_shape
    from genie_rt.kvcache.attention_decode_kernels import rope_signature
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not installed")
    assert default_shape(2) == (8, 2) and default_shape(4) == (4, 4)
    sig = rope_signature("int8", True)
    names = ("shape_8x2", "shape_4x4", "shape_8x2_one_head", "chain_8x2", "chain_8x2_one_head", "mma_8x1",
             "chain_mma_8x1")
    out = compile_in_subprocess(_SHAPE_SOURCE, {n: sig for n in names}, ccs=((9, 0),))
    # (the short-context graph's one-head blocks are sized as two heads' 8 x 2: they must fit that too)
    for name, (warps, rows) in (("shape_8x2", (8, 2)), ("shape_4x4", (4, 4)), ("shape_8x2_one_head", (8, 2)),
                                ("chain_8x2", (8, 2)), ("chain_8x2_one_head", (8, 2)), ("mma_8x1", (8, 1)),
                                ("chain_mma_8x1", (8, 1))):
        path = tmp_path / f"{name}.ptx"
        path.write_text(out[name][(9, 0)])
        res = subprocess.run([ptxas, "-arch=sm_90", "-v", str(path), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
        assert re.search(r"\b0 bytes spill stores", res.stderr), f"{name} spills: {res.stderr[-500:]}"
        if "mma" in name:                     # one block of 8 warps an SM (_MMA_REGISTERS), with the knob too
            assert blocks_at(regs, warps) == _blocks_per_sm(4, warps, rows, "mma") == 1, (name, regs)
            continue
        if not name.startswith("chain"):      # the knobs' builds: 128 (two blocks an SM all the same)
            assert regs <= _REGISTERS[(2, rows)], f"{name}: {regs} registers > the table's {_REGISTERS[(2, rows)]}"
        assert blocks_at(regs, warps) == _blocks_per_sm(2, warps, rows), (name, regs)


_MMA_SOURCE = """
from genie_rt.quant.gemv_mma_glu import mma_glu_q4k_q8k_kernel
from genie_rt.quant.gemv_mma_k import mma_q4k_q8k_kernel
from genie_rt.quant.gemv_mma_q6k import mma_q6k_q8k_kernel
from genie_rt.quant.gemv_mma_qkv import mma_qkv_kernel
from genie_rt.quant.quantize_q8k import rmsnorm_q8k_kernel
mma_q4k = mma_q4k_q8k_kernel(4, True, 8, True)
mma_q4k_16 = mma_q4k_q8k_kernel(4, False, 16, True)
mma_q6k = mma_q6k_q8k_kernel(4, True, 8, True)
mma_glu = mma_glu_q4k_q8k_kernel(2, True, "silu", True)
mma_qkv = mma_qkv_kernel(("Q4_K", "Q4_K", "Q6_K"), 4, True, True)
norm_q8k = rmsnorm_q8k_kernel(True, True)
mma_q4k_plain = mma_q4k_q8k_kernel(4, True, 8, False)
mma_q4k_late = mma_q4k_q8k_kernel(4, False, 8, 2, True)
mma_q6k_late = mma_q6k_q8k_kernel(4, False, 8, 2)
mma_glu_late = mma_glu_q4k_q8k_kernel(2, False, "silu", 2, None, True)
mma_qkv_late = mma_qkv_kernel(("Q4_K", "Q4_K", "Q6_K"), 4, False, 2, True)
mma_q6k_w16 = mma_q6k_q8k_kernel(4, False, 8, True, True)
mma_q6k_w16_late = mma_q6k_q8k_kernel(4, False, 8, 2, True)
"""
# their late-trigger builds (quant/pdl.TRIGGER_LATE, lab): the trigger after every mma of the last trip
MMA_LATE = {"mma_q4k_late": "mma_q4k", "mma_q6k_late": "mma_q6k", "mma_glu_late": "mma_glu",
            "mma_qkv_late": "mma_qkv", "mma_q6k_w16_late": "mma_q6k_w16"}
# the short prefill's builds (engine/cuda_short_prefill.py): before the wait only the first 256-weight
# block's weights - Q4_K 8 quant loads + 2 headers for the lane's two rows, Q6_K 2 x (8 ql, 4 qh, the
# scales, d; the W16 build (the default) 2 x (2 ql, 1 qh 16-byte loads, the scales, d)), both weights of the GLU; the
# q8_K norm its lane's 8 norm weights (two 16-byte loads)
MMA_PRE_WAIT = {"mma_q4k": 10, "mma_q4k_16": 10, "mma_q6k": 28, "mma_glu": 20, "mma_qkv": 10, "norm_q8k": 2,
                "mma_q6k_w16": 10}


@pytest.mark.slow
def test_short_prefill_pdl_builds_read_only_weights_before_the_wait():
    from genie_rt.quant import gemv_mma_glu, gemv_mma_k, gemv_mma_q6k, gemv_mma_qkv, quantize_q8k
    sigs = {"mma_q4k": gemv_mma_k.SIGNATURE, "mma_q4k_16": gemv_mma_k.SIGNATURE, "mma_q6k": gemv_mma_q6k.SIGNATURE,
            "mma_q6k_w16": gemv_mma_q6k.SIGNATURE,
            "mma_glu": gemv_mma_glu.SIGNATURE, "mma_qkv": gemv_mma_qkv.SIGNATURE, "norm_q8k": quantize_q8k.SIGNATURE,
            "mma_q4k_plain": gemv_mma_k.SIGNATURE}
    sigs.update({late: sigs[base] for late, base in MMA_LATE.items()})
    out = compile_in_subprocess(_MMA_SOURCE, sigs, ccs=((9, 0),))
    for name in MMA_LATE:
        text = out[name][(9, 0)]
        assert text.count("griddepcontrol.launch_dependents;") == 1, name
        trigger, wait = text.find("griddepcontrol.launch_dependents;"), text.find("griddepcontrol.wait;")
        assert 0 <= wait < trigger and text.rfind("mma.sync") < trigger, f"{name}: the trigger after the last mma"
    assert "griddepcontrol" not in out["mma_q4k_plain"][(9, 0)]
    for name, pre in MMA_PRE_WAIT.items():
        text = out[name][(9, 0)]
        assert_no_f64(text, name)
        trigger, wait = text.find("griddepcontrol.launch_dependents;"), text.find("griddepcontrol.wait;")
        assert 0 <= trigger < wait, f"{name}: launch_dependents must come first, then the wait"
        # (the q/k/v kernel has a wait in each matrix's branch; the first is q's, a Q4_K one)
        assert ptx_pre_wait_loads(text) == pre, f"{name}: {ptx_pre_wait_loads(text)} loads before it"
        after = text[wait:]
        # the activations (q8_K values, sums, scales) coherently: the read-only path is only the weights'
        # (the later blocks' quants and headers, ld.global.nc.v2 / .v4.u32)
        assert not re.search(r"ld\.global\.nc\.(v\d\.)?(s32|f32)", after), f"{name}: an activation by ld.global.nc"
        if name in ("mma_q4k", "mma_q4k_16", "mma_glu", "mma_qkv"):
            assert "ld.global.v2.u32" in after and "ld.global.v4.s32" in after, name
