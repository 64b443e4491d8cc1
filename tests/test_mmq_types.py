"""MMQ (the prefill GEMM) for Q5_K, F16 and BF16 weights, the way tests/test_mmq.py tests
the other formats (its helpers: run_mmq, check_close, the error bound of
mmq_reference.error_bound):

- simulator (on a GPU machine: the device): tiny awkward shapes against the float64 numpy
  reference - rows not a multiple of the tile, K at the smallest legal multiple (Q5_K 256,
  F16/BF16 16) and K leaving a partial last stage (F16/BF16), N = 1..33, every epilogue,
  split-K with both reductions; BF16 weights at the edges of fp16's range;
- PTX for sm_87 and sm_90: mma.sync, ldmatrix, cp.async, fully inlined (no local memory),
  no float64;
- GPU (`-m gpu`): Qwen3-4B-like shapes at N = 18..512 on fresh random weights.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import mmq
from genie_rt.quant import mmq_float as F
from genie_rt.quant import mmq_kquants as Q
from genie_rt.quant import mmq_plan as MP
from genie_rt.quant import mmq_reference as MR
from genie_rt.quant.formats import QType
from genie_rt.quant.layout import PackedWeight, pack
from genie_rt.quant.quantize import quantize_bf16
from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess, local_memory_bytes
from test_mmq import check_close, check_gpu_shape, run_mmq

T = MP.TileConfig
CASES = [
    # qtype, rows, cols, N, mode, config, splits
    ("Q5_K", 40, 512, 9, "store", None, 1),                         # rows not a multiple of 16
    ("Q5_K", 24, 256, 7, "add", T(wm=1, wn=1, mt=2, nt=1, stages=2), 1),    # K = one super-block
    ("Q5_K", 32, 256, 5, "swiglu", T(wm=1, wn=1, mt=2, nt=1, stages=3), 1),
    ("Q5_K", 20, 1024, 3, "store", T(wm=1, wn=1, mt=1, nt=1, stages=2), 2),  # split-K
    ("Q5_K", 16, 512, 33, "geglu", T(wm=1, wn=2, mt=2, nt=1, stages=2), 1),  # N = 33: 5 n8 tiles
    ("F16", 20, 16, 3, "store", T(wm=1, wn=1, mt=1, nt=1, stages=2), 1),     # K = 16: one k16 group
    ("F16", 40, 400, 9, "add", T(wm=1, wn=2, mt=1, nt=1, stages=2), 2),      # 3 stages + 16
    ("F16", 48, 144, 7, "swiglu", None, 1),
    ("F16", 24, 272, 1, "store", T(wm=1, wn=1, mt=1, nt=1, stages=3), 1),   # N = 1, 2 stages + 16
    ("BF16", 16, 16, 1, "store", T(wm=1, wn=1, mt=1, nt=1, stages=2), 1),
    ("BF16", 24, 208, 9, "geglu", T(wm=1, wn=1, mt=2, nt=1, stages=2), 1),
    ("BF16", 40, 528, 33, "store", T(wm=1, wn=2, mt=1, nt=2, stages=2), 2),  # 4 stages + 16
    ("BF16", 36, 336, 5, "add", None, 1),
]
CASES_RED = [c + (r,) for c in CASES for r in (("last", "kernel") if c[6] > 1 else (None,))]


@pytest.mark.parametrize("qtype,rows,cols,n,mode,config,splits,reduce", CASES_RED,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-N{c[3]}-{c[4]}-s{c[6]}" + ("-cfg" if c[5] else "")
                              + (f"-{c[7]}" if c[7] else "") for c in CASES_RED])
def test_mmq_matches_reference(qtype, rows, cols, n, mode, config, splits, reduce):
    rng = np.random.default_rng(rows * 1000 + cols + n)
    w = MR.random_weight(qtype, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    rows_out = rows // 2 if mode in MP.GATED else rows
    y0 = rng.standard_normal((n, rows_out)).astype(np.float32) if mode == "add" else None
    if mode in MP.GATED:
        x *= 30                                     # the random weights are ~0.02: reach the curve
    out, counters, p = run_mmq(w, x, mode, config, splits, y0, reduce=reduce)
    assert p.splits == splits
    check_close(out, w, x, mode, y0, where=f"{qtype} {rows}x{cols} N={n} {mode} reduce={reduce}")
    assert (counters == 0).all(), f"split-K counters not reset: {counters}"


def bf16_weight(values: np.ndarray):
    rows, cols = values.shape
    return pack(quantize_bf16(values.astype(np.float32).reshape(-1, 1)).reshape(rows, -1), QType.BF16,
                (rows, cols))


def test_bf16_weights_at_the_edges_of_fp16():
    """BF16 -> fp16 in registers: exact from 2^-14 to 65280 (the largest bf16 below fp16's
    max), fp16 subnormals below (the bound's 2^-25 term), signs and zeros kept."""
    rng = np.random.default_rng(5)
    mag = np.exp(rng.uniform(np.log(1e-9), np.log(6.5e4), (24, 64)))
    vals = mag * rng.choice([-1.0, 1.0], mag.shape)
    vals[3, :8] = 0.0
    vals[5, 0], vals[6, 1] = 65280.0, -65280.0
    w = bf16_weight(vals)
    x = (rng.standard_normal((5, 64)) * 1e-3).astype(np.float32)
    out, _, _ = run_mmq(w, x, "store", T(wm=1, wn=1, mt=1, nt=1, stages=2), 1)
    check_close(out, w, x, "store", where="BF16 edges")


def test_bf16_range_check_names_the_tensor():
    ok = bf16_weight(np.array([[65280.0, -1e-30, 0.0, 3.0]] * 2))
    F.check_bf16_range(ok.planes["w"], "blk.0.attn_q.weight")
    for bad in (65536.0, -1e6, np.inf, np.nan):
        w = bf16_weight(np.array([[1.0, bad, 0.5, 0.25]] * 2))
        with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*float16 range.*--backend cpu"):
            F.check_bf16_range(w.planes["w"], "blk.0.attn_q.weight")


def test_plan_and_refusals_for_the_new_types():
    assert MP.plan("Q5_K", 256, 2560, 33).fmt == Q.Q5_K
    assert MP.plan("F16", 640, 576, 33).n_stages == 5         # 4.5 stages: the last one partial
    assert MP.plan("BF16", 64, 16, 8).n_stages == 1
    with pytest.raises(ValueError, match="multiple of 256"):
        MP.plan("Q5_K", 64, 576, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        MP.plan("F16", 64, 40, 8)
    with pytest.raises(ValueError, match="not supported"):
        MP.plan("F32", 64, 64, 8)
    # a plane of the wrong type is refused by name
    w = MR.random_weight("F16", 16, 64, np.random.default_rng(0))
    bad = PackedWeight(w.qtype, w.rows, w.cols, {"w": cuda.to_device(w.planes["w"].astype(np.float32))})
    with pytest.raises(ValueError, match="plane 'w'"):
        mmq.mmq(bad, cuda.to_device(np.zeros((2, 64), np.float16)), cuda.to_device(np.ones(2, np.float32)),
                cuda.to_device(np.zeros((2, 16), np.float32)))


def test_error_bound_sees_a_wrong_fifth_bit_plane():
    """The Q5_K reference reads the qh plane: flipping one bit plane moves the result by far
    more than the bound (so the simulator tests above would catch a kernel ignoring it)."""
    rng = np.random.default_rng(3)
    w = MR.random_weight("Q5_K", 8, 256, rng)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    bad = PackedWeight(w.qtype, w.rows, w.cols, {k: v.copy() for k, v in w.planes.items()})
    bad.planes["qh"][:] ^= 0x10                       # the fifth bits of sub-block 4
    err = np.abs(MR.reference(bad, x) - MR.reference(w, x))
    assert (err > MR.error_bound(w, x)).mean() > 0.9


# =====================================================================================
# PTX for sm_87 and sm_90
# =====================================================================================
PTX_SOURCE = """
from genie_rt.quant import mmq, mmq_defs as D, mmq_float as F, mmq_kquants as Q, mmq_plan as MP
small, large = MP.small_config(33), MP.LARGE
q5k_small_store = mmq._kernel(Q.Q5_K, small, D.EPI_STORE)
q5k_large_swiglu = mmq._kernel(Q.Q5_K, large, D.EPI_SWIGLU)
q5k_small_add_redk = mmq._kernel(Q.Q5_K, small, D.EPI_ADD, D.RED_KERNEL)
f16_small_store = mmq._kernel(F.F16, small, D.EPI_STORE)
f16_large_add = mmq._kernel(F.F16, large, D.EPI_ADD)
f16_small_geglu_redk = mmq._kernel(F.F16, small, D.EPI_GEGLU, D.RED_KERNEL)
bf16_small_swiglu = mmq._kernel(F.BF16, small, D.EPI_SWIGLU)
bf16_large_store = mmq._kernel(F.BF16, large, D.EPI_STORE)
"""
KERNELS = {"q5k_small_store": Q.Q5_K, "q5k_large_swiglu": Q.Q5_K, "q5k_small_add_redk": Q.Q5_K,
           "f16_small_store": F.F16, "f16_large_add": F.F16, "f16_small_geglu_redk": F.F16,
           "bf16_small_swiglu": F.BF16, "bf16_large_store": F.BF16}
# what each format's dequantization must compile to, beside mma/ldmatrix/cp.async
FORMAT_PTX = {Q.Q5_K: ("fma.rn.f16x2",), F.F16: ("ld.shared.u64",),
              F.BF16: ("ld.shared.u64", "cvt.rn.f16x2.f32")}


@pytest.fixture(scope="module")
def ptx():
    return compile_in_subprocess(PTX_SOURCE, {name: mmq.kernel_signature(fmt) for name, fmt in KERNELS.items()})


@pytest.mark.slow
def test_kernels_use_tensor_cores_inline_and_no_f64(ptx):
    for name, fmt in KERNELS.items():
        assert set(ptx[name]) == {(8, 7), (9, 0)}, name
        for cc, text in ptx[name].items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_ptx_contains(text, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                "ldmatrix.sync.aligned.m8n8.x4", "cp.async.cg.shared.global",
                                "cp.async.wait_group", *FORMAT_PTX[fmt], where=where)
            assert_no_f64(text, where)
            assert "call" not in text, f"{where}: a device function was not inlined"
            assert local_memory_bytes(text) == 0, f"{where}: local memory (fragments spilled?)"


# =====================================================================================
# GPU: real shapes
# =====================================================================================
GPU_SHAPES = [
    # name, rows, cols, qtype, mode
    ("q5k-q", 4096, 2560, "Q5_K", "store"), ("q5k-down", 2560, 9728, "Q5_K", "add"),
    ("q5k-gate_up", 2 * 9728, 2560, "Q5_K", "swiglu"),
    ("f16-k", 1024, 2560, "F16", "store"), ("f16-o", 2560, 4096, "F16", "add"),
    ("f16-gate_up", 2 * 2048, 640, "F16", "geglu"),
    ("bf16-q", 576, 576, "BF16", "store"), ("bf16-down", 2560, 9728, "BF16", "add"),
    ("bf16-gate_up", 2 * 9728, 2560, "BF16", "swiglu"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [18, 33, 128, 512])
@pytest.mark.parametrize("name,rows,cols,qtype,mode", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_shapes(name, rows, cols, qtype, mode, n):
    check_gpu_shape(name, rows, cols, qtype, mode, n)
