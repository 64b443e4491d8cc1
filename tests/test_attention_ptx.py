"""Decode and prefill attention kernels compiled to PTX for sm_87 and sm_90 (in a
subprocess without the simulator): no float64 instructions, no local memory; decode uses
128-bit loads and the atomic merge, prefill the tensor cores (mma.sync + ldmatrix).
Qwen3's kernels (and the tensor-core decode loop) and one of each newer kind (window, head_dim 256, one KV head, group 3)
in the quick suite, the rest `slow`.
"""
import pytest

from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess


# ---- PTX --------------------------------------------------------------------------------
_PTX_SOURCE = """
from genie_rt.kvcache.attention_decode_kernels import decode_kernel
from genie_rt.kvcache.attention_prefill_kernels import prefill_kernel, prefill_merge
from genie_rt.kvcache.attention_merge import merge_prepare_x_kernel
decode_int8 = decode_kernel(128, 4, "int8", loop="block")
decode_f16 = decode_kernel(128, 8, "f16", loop="block")
decode_q8_int8 = decode_kernel(128, 2, "int8", q8=True)   # the engine's Qwen3-4B decode (2 heads a block, q8 out)
decode_warp_int8 = decode_kernel(128, 2, "int8", loop="warp")   # the barrier-free loop
decode_q8_one_head_int8 = decode_kernel(128, 1, "int8", 8, 2, q8=True)   # the short-context graph's blocks
decode_q8_qk8_int8 = decode_kernel(128, 2, "int8", 8, 2, q8=True, qk8=True)   # QK_DP4A (lab): scores by dp4a
decode_warp_f16 = decode_kernel(128, 2, "f16", loop="warp")
decode_q8_mma_int8 = decode_kernel(128, 4, "int8", 4, 1, q8=True, loop="mma")   # the tensor-core loop (lab)
decode_warp_gemma_int8 = decode_kernel(256, 4, "int8", 4, 4, 512, loop="warp")
prefill_int8 = prefill_kernel(128, 4, "int8")
prefill_f16 = prefill_kernel(128, 4, "f16")
# Gemma 3 270M (4 / 1 heads, head_dim 256, window 512) and SmolLM2 (9 / 3 heads, hd 64)
decode_gemma_int8 = decode_kernel(256, 4, "int8", 4, 4, 512, loop="block")
decode_gemma_f16 = decode_kernel(256, 4, "f16", 4, 4, 512, loop="block")
decode_smol_int8 = decode_kernel(64, 3, "int8", loop="block")
prefill_gemma_int8 = prefill_kernel(256, 4, "int8", 0, 512)
prefill_gemma_f16 = prefill_kernel(256, 4, "f16", 0, 512)
prefill_smol_int8 = prefill_kernel(64, 3, "int8")
"""
# the quick suite compiles Qwen3's kernels and one of each new kind (window + hd 256 +
# one KV head, group 3); the f16 twins and SmolLM2's decode (~10 s more) are `slow`
_QUICK = ("decode_int8", "decode_f16", "decode_q8_int8", "decode_warp_int8", "decode_q8_one_head_int8",
          "decode_q8_qk8_int8", "decode_q8_mma_int8", "decode_gemma_int8",
          "prefill_int8", "prefill_f16", "prefill_gemma_int8", "prefill_smol_int8")
_MORE = ("decode_gemma_f16", "decode_smol_int8", "prefill_gemma_f16", "decode_warp_f16",
         "decode_warp_gemma_int8")


def _compile_ptx(names, merge):
    from genie_rt.kvcache.attention_decode_kernels import DECODE_SIGNATURE, DECODE_SIGNATURE_Q8
    from genie_rt.kvcache.attention_prefill_kernels import MERGE_SIGNATURE, PREFILL_SIGNATURE
    kernels = {name: (DECODE_SIGNATURE_Q8 if "_q8" in name else DECODE_SIGNATURE)
               if name.startswith("decode") else PREFILL_SIGNATURE for name in names}
    if merge:
        from genie_rt.kvcache.attention_merge import MERGE_PREPARE_SIGNATURE
        kernels["prefill_merge"] = MERGE_SIGNATURE
        kernels["merge_prepare_x_kernel"] = MERGE_PREPARE_SIGNATURE
    return compile_in_subprocess(_PTX_SOURCE, kernels)


@pytest.fixture(scope="module")
def ptx_text():
    return _compile_ptx(_QUICK, merge=True)


def _check_ptx(ptx_text):
    from ptx_helpers import local_memory_bytes
    for name, per_cc in ptx_text.items():
        assert set(per_cc) == {(8, 7), (9, 0)}
        for cc, text in per_cc.items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_no_f64(text, where=where)
            # the per-thread arrays (q slices, accumulators, fragments) must be registers
            assert local_memory_bytes(text) == 0, f"{where}: local memory used"
            if name.startswith("decode"):
                assert_ptx_contains(text, "ld.global.nc.v4.u32", "atom.global.add", "membar.gl",
                                    where=where)
                if "_q8" in name:                       # out's q8 blocks: int8 stores, amax shuffles
                    assert_ptx_contains(text, "st.global.u8", "shfl.sync.bfly.b32", where=where)
            elif name == "merge_prepare_x_kernel":     # the merge's exp2 and prepare_x's fp16 pairs
                assert_ptx_contains(text, "ex2.approx", "cvt.rn.f16x2.f32", where=where)
            elif name.startswith("prefill_") and name != "prefill_merge":
                assert_ptx_contains(text, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                    "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                                    "ld.global.nc.v4.u32", where=where)


def test_ptx_all_kernels_compile_without_f64_or_local_memory(ptx_text):
    """No f64, no local memory; decode uses 128-bit loads and the atomic merge, prefill
    the tensor cores (mma.sync, ldmatrix)."""
    assert set(ptx_text) == set(_QUICK) | {"prefill_merge", "merge_prepare_x_kernel"}
    _check_ptx(ptx_text)


@pytest.mark.slow
def test_ptx_more_variants_compile():
    _check_ptx(_compile_ptx(_MORE, merge=False))


def test_ptx_warp_loop_issues_the_next_trips_loads_before_this_trips_math(ptx_text):
    """The "warp" loop (attention_decode_tiles.warp_tiles, PF): 16 K/V loads of 16 bytes (4 rows a
    lane, K and V, the first trip and the next one inside the loop), every one of them before the
    first score's shuffle - the next trip's loads are in flight while this one's math runs."""
    for cc, text in ptx_text["decode_warp_int8"].items():
        loads = [i for i, line in enumerate(text.splitlines()) if "ld.global.nc.v4.u32" in line]
        first_shfl = next(i for i, line in enumerate(text.splitlines()) if "shfl.sync.bfly" in line)
        assert len(loads) == 16, (cc, len(loads))
        assert max(loads) < first_shfl, cc


def test_ptx_qk8_build_scores_by_dp4a(ptx_text):
    """QK_DP4A's build (decode_kernel qk8): the K side is dp4a against q's int8 words (and only the
    V side converts bytes to floats); the default build has no dp4a."""
    for cc, text in ptx_text["decode_q8_qk8_int8"].items():
        assert text.count("dp4a.s32.s32") >= 8, f"sm_{cc[0]}{cc[1]}: {text.count('dp4a.s32.s32')} dp4a"
    for cc, text in ptx_text["decode_q8_int8"].items():
        assert "dp4a" not in text


def test_ptx_mma_loop_scores_and_weights_values_on_the_tensor_cores(ptx_text):
    """The "mma" loop (attention_decode_mma.py), one 16-row chunk a trip at head_dim 128: 16 score
    mma (8 k-steps, q in two f16 parts) and 8 P x V mma a trip, bytes to f16 by prmt, the P
    transfer by indexed shuffles; the FMA loops' builds have no mma."""
    for cc, text in ptx_text["decode_q8_mma_int8"].items():
        where = f"sm_{cc[0]}{cc[1]}"
        n_mma = text.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
        assert n_mma % 24 == 0 and n_mma >= 24, f"{where}: {n_mma} mma"
        assert_ptx_contains(text, "prmt.b32", "fma.rn.f16x2", "shfl.sync.idx.b32", "cvt.rn.f16x2.f32",
                            where=where)
    for cc, text in ptx_text["decode_q8_int8"].items():
        assert "mma.sync" not in text
