"""Tests for genie_rt.quant.mmq (prefill GEMM on tensor cores), three ways.

- simulator (default without a GPU; on a GPU machine the same tests run on the device):
  tiny shapes (16..48 rows, 256..1024 columns, N in {1, 7, 9, 33}) against the float64
  numpy reference, every format, every epilogue, split-K, several token tiles;
- PTX: representative kernels compiled for sm_87 and sm_90 (mma.sync, ldmatrix, cp.async,
  fp16x2 FMA present; no float64; local memory reported and required to be zero);
- GPU (`-m gpu`): the Qwen3-4B shapes at N = 18, 33, 128, 512, 2048 on fresh random
  blocks, split-K determinism, the workspace counters left at zero.

Error bound (mmq_reference.error_bound, per output element): with u = 2^-11 (fp16 rounding),
    |y - ref| <= (3u + cols 2^-22) * sum_k |x_k| W_abs_k
where W_abs = |s q| + |m| for Q4_K (the terms before cancellation) and |w| otherwise:
one rounding of x to fp16 (the per-token power-of-two scale is exact), up to two of the
weight (fp16 scale, fp16 result of q s - m), float32 sums in the tensor core. The tests
also require the relative rms error to stay below 2e-3 (typical: 3e-4).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import mmq
from genie_rt.quant import mmq_kernels as K
from genie_rt.quant import mmq_kquants as Q
from genie_rt.quant import mmq_plan as MP
from genie_rt.quant import mmq_prep as P
from genie_rt.quant import mmq_reference as MR
from genie_rt.quant import ptx as X
from genie_rt.quant.layout import PackedWeight
from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess, local_memory_bytes

SIM = K.SIMULATOR
REL_RMS_MAX = 2e-3


def to_device(w):
    return PackedWeight(w.qtype, w.rows, w.cols, {k: cuda.to_device(v) for k, v in w.planes.items()})


def host_x16(x):
    """What prepare_x produces, computed on the host (keeps simulator tests short)."""
    return np.ascontiguousarray(x[:, P.mmq_order(x.shape[1])], np.float16), np.ones(x.shape[0], np.float32)


def check_close(out, w, x, mode, y0=None, rows=None, where=""):
    ref = MR.reference(w, x, mode, y0, rows)
    bound = MR.error_bound(w, x, mode, y0, rows)
    err = np.abs(out.astype(np.float64) - ref)
    ratio = err / bound
    if not (ratio <= 1).all():
        i = np.unravel_index(np.argmax(ratio), ratio.shape)
        bad = np.argwhere(ratio > 1)
        pairs = ", ".join(f"{tuple(b)}: {out[tuple(b)]:.6g} vs {ref[tuple(b)]:.6g}" for b in bad[:5])
        raise AssertionError(f"{where}: {len(bad)} of {ratio.size} outputs beyond the bound; worst "
                             f"(token, row) {i}: got {out[i]:.6g}, want {ref[i]:.6g}, bound "
                             f"{bound[i]:.3g}; first: {pairs}")
    y0_sel = None if y0 is None else (y0 if rows is None else y0[:, rows])
    base = ref - (np.asarray(y0_sel, np.float64) if mode == "add" else 0)
    rms = np.sqrt(np.mean(err ** 2) / max(np.mean(base ** 2), 1e-300))
    assert rms <= REL_RMS_MAX, f"{where}: relative rms error {rms:.2e} > {REL_RMS_MAX}"
    return float(ratio.max()), float(rms)


def run_mmq(w, x, mode, config=None, splits=None, y0=None, use_prepare=False, reduce=None):
    n = x.shape[0]
    rows_out = w.rows // 2 if mode in MP.GATED else w.rows
    wd = to_device(w)
    if use_prepare:
        xd = cuda.to_device(x)
        x16 = cuda.device_array(x.shape, np.float16)
        xs = cuda.device_array(n, np.float32)
        mmq.prepare_x(xd, x16, xs)
    else:
        h16, hs = host_x16(x)
        x16, xs = cuda.to_device(h16), cuda.to_device(hs)
    y = cuda.to_device(np.zeros((n, rows_out), np.float32) if y0 is None else y0.copy())
    p = MP.plan(w.qtype, rows_out, w.cols, n, mode, config, splits, reduce=reduce)
    ws = cuda.to_device(np.zeros(max(p.workspace, 16), np.uint8))
    mmq.mmq(wd, x16, xs, y, mode, workspace=ws, config=config, splits=splits, reduce=reduce)
    return y.copy_to_host(), ws.copy_to_host()[:4 * p.counters].view(np.int32), p


# =====================================================================================
# Simulator (or device) tests at tiny shapes
# =====================================================================================
SMALL_CASES = [
    # qtype, rows, cols, N, mode, config, splits
    ("Q4_K", 40, 512, 33, "store", None, 1),        # rows not a multiple of 16, N = 33
    ("Q6_K", 24, 256, 7, "add", None, 1),
    ("Q8_0", 16, 256, 1, "store", None, 1),         # N = 1
    ("Q4_K", 48, 256, 9, "swiglu", None, 1),        # gate/up stacked: 24 outputs
    ("Q6_K", 40, 1024, 7, "store", None, 2),        # split-K, deterministic reduction
    ("Q4_K", 40, 512, 20, "add", MP.TileConfig(wm=1, wn=2, mt=1, nt=1, stages=4), 2),
    ("Q8_0", 40, 512, 33, "store", MP.TileConfig(wm=1, wn=2, mt=2, nt=1, stages=2), 1),
    ("Q6_K", 40, 512, 33, "swiglu", MP.TileConfig(wm=1, wn=2, mt=2, nt=1, stages=3), 2),
    ("Q4_K", 48, 256, 9, "geglu", None, 1),         # Gemma's gated FFN (gelu, tanh form)
    ("Q8_0", 32, 512, 5, "geglu", MP.TileConfig(wm=1, wn=1, mt=2, nt=1, stages=2), 2),
    # the 32-weight formats (mmq_legacy.py) at K a multiple of 32 but not of 128: the last
    # stage is partial (SmolLM2's 576 = 4.5 stages, Gemma 3 270M's 640 = 5, 96 < 1 stage)
    ("Q4_1", 40, 576, 9, "store", MP.TileConfig(wm=1, wn=2, mt=1, nt=1, stages=2), 1),
    ("Q4_1", 32, 576, 5, "swiglu", MP.TileConfig(wm=1, wn=1, mt=2, nt=1, stages=3), 2),
    ("Q5_0", 24, 640, 7, "add", MP.TileConfig(wm=1, wn=1, mt=2, nt=1, stages=2), 1),
    ("Q5_0", 32, 640, 3, "geglu", MP.TileConfig(wm=1, wn=1, mt=2, nt=1, stages=2), 2),
    ("Q8_0", 20, 640, 5, "store", MP.TileConfig(wm=1, wn=1, mt=1, nt=1, stages=3), 1),
    ("Q4_0", 20, 96, 3, "store", MP.TileConfig(wm=1, wn=1, mt=1, nt=1, stages=2), 1),
    ("Q5_1", 24, 576, 9, "add", MP.TileConfig(wm=1, wn=2, mt=1, nt=1, stages=2), 2),
]


# every split-K case runs with both reductions (mmq_defs.RED_LAST / RED_KERNEL)
CASES_RED = [c + (r,) for c in SMALL_CASES for r in (("last", "kernel") if c[6] > 1 else (None,))]


@pytest.mark.parametrize("qtype,rows,cols,n,mode,config,splits,reduce", CASES_RED,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-N{c[3]}-{c[4]}-s{c[6]}" + ("-cfg" if c[5] else "")
                              + (f"-{c[7]}" if c[7] else "") for c in CASES_RED])
def test_mmq_matches_reference(qtype, rows, cols, n, mode, config, splits, reduce):
    rng = np.random.default_rng(rows * 1000 + n)
    w = MR.random_weight(qtype, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    rows_out = rows // 2 if mode in MP.GATED else rows
    y0 = rng.standard_normal((n, rows_out)).astype(np.float32) if mode == "add" else None
    if mode == "geglu":
        x *= 3                                      # reach gelu's curved part
    out, counters, p = run_mmq(w, x, mode, config, splits, y0, reduce=reduce)
    assert p.splits == splits
    check_close(out, w, x, mode, y0, where=f"{qtype} {rows}x{cols} N={n} {mode} reduce={reduce}")
    assert (counters == 0).all(), f"split-K counters not reset: {counters}"


def test_one_workspace_serves_launches_of_different_plans():
    """The engine runs every GEMM of a forward on one workspace, one after another. A plan
    with more split-K counters than the previous launch must still find its counters at
    zero (the previous launch's partial sums may not land where they live)."""
    rng = np.random.default_rng(11)
    cfg = MP.TileConfig(wm=1, wn=1, mt=1, nt=1, stages=2)            # 16 rows x 8 tokens a tile
    small = MR.random_weight("Q4_K", 16, 512, rng)                    # 1 row tile: 4 counters
    large = MR.random_weight("Q4_K", 80, 512, rng)                    # 5 row tiles: 8 counters
    x = rng.standard_normal((3, 512)).astype(np.float32)
    h16, hs = host_x16(x)
    x16, xs = cuda.to_device(h16), cuda.to_device(hs)
    size = max(MP.plan(w.qtype, w.rows, w.cols, 3, "store", cfg, 2, reduce=r).workspace
               for w in (small, large) for r in MP.REDUCTIONS)
    ws = cuda.to_device(np.zeros(size, np.uint8))
    for w, r in ((small, "last"), (large, "last"), (small, "kernel"), (large, "last"), (small, "last")):
        y = cuda.to_device(np.zeros((3, w.rows), np.float32))
        mmq.mmq(to_device(w), x16, xs, y, "store", workspace=ws, config=cfg, splits=2, reduce=r)
        check_close(y.copy_to_host(), w, x, "store", where=f"{w.rows} rows ({r}) after another plan")


def test_prepare_x_order_and_scale():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1, 17] = 1.0e5                   # needs scale 8: 1e5 / 8 = 12500 <= 16384
    x[2] *= 1e-3                       # small rows keep scale 1
    xd = cuda.to_device(x)
    x16 = cuda.device_array(x.shape, np.float16)
    xs = cuda.device_array(3, np.float32)
    mmq.prepare_x(xd, x16, xs)
    want16, want_scale = MR.prepare_x_reference(x)
    np.testing.assert_array_equal(xs.copy_to_host(), [1.0, 8.0, 1.0])
    np.testing.assert_array_equal(want_scale, [1.0, 8.0, 1.0])
    np.testing.assert_array_equal(x16.copy_to_host(), want16)


def test_prepare_x_fused_rmsnorm():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 256)) * 30).astype(np.float32)
    w = rng.uniform(0.5, 2.0, 256).astype(np.float32)
    x16 = cuda.device_array(x.shape, np.float16)
    xs = cuda.device_array(2, np.float32)
    mmq.prepare_x(cuda.to_device(x), x16, xs, norm_weight=cuda.to_device(w), eps=1e-6)
    want16, want_scale = MR.prepare_x_reference(x, w, 1e-6)
    got = x16.copy_to_host().astype(np.float32)
    np.testing.assert_array_equal(xs.copy_to_host(), want_scale)
    # float32 rsqrt vs float64 in numpy: at most one fp16 rounding step apart
    np.testing.assert_allclose(got, want16.astype(np.float32), rtol=2 ** -10, atol=0)


@pytest.mark.parametrize("cols", [768, 2 * P.PREP_THREADS * P.PREP_PAIRS_MAX + 256])
def test_prepare_x_register_resident_and_wide_rows(cols):
    """Several pairs per thread (the register-resident kernel, pairs past the row end in
    the last trip) and a row wider than it handles (the looping kernel): both match."""
    kern = P.prepare_x_kernel_for(cols)
    assert (kern is P.prepare_x_kernel) == (cols > 2 * P.PREP_THREADS * P.PREP_PAIRS_MAX)
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((2, cols)) * 30).astype(np.float32)
    x[1, 5] = 3.0e5                                  # a row that needs a scale
    w = rng.uniform(0.5, 2.0, cols).astype(np.float32)
    x16 = cuda.device_array(x.shape, np.float16)
    xs = cuda.device_array(2, np.float32)
    mmq.prepare_x(cuda.to_device(x), x16, xs)
    want16, want_scale = MR.prepare_x_reference(x)
    np.testing.assert_array_equal(xs.copy_to_host(), want_scale)
    np.testing.assert_array_equal(x16.copy_to_host(), want16)
    mmq.prepare_x(cuda.to_device(x), x16, xs, norm_weight=cuda.to_device(w), eps=1e-6)
    want16, want_scale = MR.prepare_x_reference(x, w, 1e-6)
    np.testing.assert_array_equal(xs.copy_to_host(), want_scale)
    np.testing.assert_allclose(x16.copy_to_host().astype(np.float32), want16.astype(np.float32),
                               rtol=2 ** -10, atol=0)


def test_prepare_x_then_mmq_with_large_activations():
    # a token row beyond fp16 range goes through the per-token scale and comes back exact
    rng = np.random.default_rng(5)
    w = MR.random_weight("Q8_0", 16, 256, rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0] *= 3e5
    out, _, _ = run_mmq(w, x, "store", use_prepare=True)
    check_close(out, w, x, "store", where="prepare_x + mmq, |x| up to 1e6")


def test_hfma2_matches_reference():
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(6).astype(np.float16).view(np.uint32) for _ in range(3))
    want = X.hfma2_reference(a, b, c)
    if SIM:
        got = np.array([X.hfma2(a[i], b[i], c[i]) for i in range(3)], np.uint32)
        np.testing.assert_array_equal(got, want)
    # the dequantization identity the kernels rely on: (1024 + q) * 1 - 1024 = q exactly
    q = np.arange(256, dtype=np.uint32)
    h = (q | 0x6400) | ((q | 0x6400) << 16)
    r = X.hfma2_reference(h, np.full(256, Q.ONE2, np.uint32), np.full(256, Q.NEG1024, np.uint32))
    np.testing.assert_array_equal(r.view(np.float16)[0::2], q.astype(np.float16))


def test_mmq_order_pairs_match_weight_bytes():
    # word t of a 16-group holds (x[4t], x[4t+2]) and word t+4 (x[4t+1], x[4t+3]): the
    # bytes (0, 2) and (1, 3) of weight word t, which is how the kernels build fragments
    order = P.mmq_order(32).reshape(2, 8, 2)
    for grp in range(2):
        for t in range(4):
            assert list(order[grp, t]) == [16 * grp + 4 * t, 16 * grp + 4 * t + 2]
            assert list(order[grp, t + 4]) == [16 * grp + 4 * t + 1, 16 * grp + 4 * t + 3]


# =====================================================================================
# Plans, checks, the error bound (CPU only)
# =====================================================================================
def test_plan_picks_by_n_and_splits_k_when_rows_run_out():
    small = MP.plan("Q4_K", 9728, 2560, 33, num_sms=132, smem_limit=227 * 1024)
    assert small.config.bn == 40 and small.config.wn == 1
    big = MP.plan("Q4_K", 9728, 2560, 512, num_sms=132, smem_limit=227 * 1024)
    assert big.config == MP.LARGE and big.splits == 1 and big.grid == (76, 4, 1)
    kv = MP.plan("Q4_K", 1024, 2560, 33, num_sms=132, smem_limit=227 * 1024)
    assert kv.splits > 1 and kv.stages_per_split % 2 == 0
    assert kv.splits * kv.stages_per_split >= kv.n_stages > (kv.splits - 1) * kv.stages_per_split
    assert kv.workspace > 0
    # a device with less shared memory gets fewer stages, never a failure
    orin = MP.plan("Q8_0", 4096, 2560, 512, num_sms=16, smem_limit=163 * 1024)
    assert orin.smem <= 163 * 1024
    tight = MP.plan("Q8_0", 4096, 2560, 512, num_sms=16, smem_limit=120 * 1024)
    assert tight.smem <= 120 * 1024 and tight.config.stages == 2


def test_format_routing_and_k_multiples():
    """Q8_0 keeps its cp.async-staged d path when K is whole super-blocks, else the
    32-weight path; the 32-weight formats take any K that is whole blocks."""
    from genie_rt.quant import mmq_legacy as L
    assert MP.kernel_format("Q8_0", 2560) == Q.Q8_0 and MP.kernel_format("Q8_0", 640) == L.Q8_0L
    assert MP.plan("Q4_1", 1536, 576, 33).n_stages == 5
    with pytest.raises(ValueError, match="multiple of 32"):
        MP.plan("Q4_1", 64, 80, 8)


def test_launcher_refuses_what_it_cannot_do():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="not supported"):
        MP.plan("F32", 256, 256, 8)
    with pytest.raises(ValueError, match="multiple of 256"):
        MP.plan("Q4_K", 256, 320, 8)
    with pytest.raises(ValueError, match="mode"):
        MP.plan("Q4_K", 256, 256, 8, mode="gelu")
    with pytest.raises(ValueError, match="reduce"):
        MP.plan("Q4_K", 256, 256, 8, reduce="atomic")
    w = to_device(MR.random_weight("Q4_K", 31, 256, rng))
    x16 = cuda.to_device(np.zeros((4, 256), np.float16))
    xs = cuda.to_device(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="even"):
        mmq.mmq(w, x16, xs, cuda.to_device(np.zeros((4, 15), np.float32)), mode="swiglu")
    with pytest.raises(ValueError, match="y must be"):
        mmq.mmq(w, x16, xs, cuda.to_device(np.zeros((4, 30), np.float32)))
    w2 = to_device(MR.random_weight("Q4_K", 16, 1024, rng))
    with pytest.raises(ValueError, match="workspace"):
        mmq.mmq(w2, cuda.to_device(np.zeros((4, 1024), np.float16)), xs,
                cuda.to_device(np.zeros((4, 16), np.float32)), splits=2)
    with pytest.raises(ValueError, match="x16"):
        mmq.mmq(w, cuda.to_device(np.zeros((4, 256), np.float32)), xs,
                cuda.to_device(np.zeros((4, 31), np.float32)))


def test_error_bound_catches_a_wrong_sub_block():
    # the bound is tight enough to see one Q4_K sub-block with the wrong scale
    rng = np.random.default_rng(2)
    w = MR.random_weight("Q4_K", 8, 256, rng)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    bad = PackedWeight(w.qtype, w.rows, w.cols, {k: v.copy() for k, v in w.planes.items()})
    bad.planes["hdr"][:, 4] ^= 0x20                  # bit 5 of the 6-bit scale of sub-block 0
    err = np.abs(MR.reference(bad, x) - MR.reference(w, x))
    assert (err > MR.error_bound(w, x)).mean() > 0.9


def test_workspace_bytes_and_stack_rows():
    rng = np.random.default_rng(4)
    g = MR.random_weight("Q4_K", 16, 512, rng)
    u = MR.random_weight("Q4_K", 16, 512, rng)
    gu = MR.stack_rows(g, u)
    assert gu.rows == 32 and gu.planes["qs"].shape == (32, 256)
    np.testing.assert_array_equal(MR.dequantize_weight(gu)[16:], MR.dequantize_weight(u))
    assert MP.workspace_bytes(gu, 33, "swiglu") == MP.plan("Q4_K", 16, 512, 33, "swiglu").workspace


# =====================================================================================
# PTX for sm_87 and sm_90
# =====================================================================================
PTX_SOURCE = """
from genie_rt.quant import mmq, mmq_defs as D, mmq_kquants as Q, mmq_plan as MP
small, large = MP.small_config(33), MP.LARGE
q4k_small_store = mmq._kernel(Q.Q4_K, small, D.EPI_STORE)
q4k_small_swiglu = mmq._kernel(Q.Q4_K, small, D.EPI_SWIGLU)
q4k_small_geglu = mmq._kernel(Q.Q4_K, small, D.EPI_GEGLU)
q4k_large_store = mmq._kernel(Q.Q4_K, large, D.EPI_STORE)
q4k_large_add = mmq._kernel(Q.Q4_K, large, D.EPI_ADD)
q6k_small_add = mmq._kernel(Q.Q6_K, small, D.EPI_ADD)
q6k_large_store = mmq._kernel(Q.Q6_K, large, D.EPI_STORE)
q8_0_small_store = mmq._kernel(Q.Q8_0, small, D.EPI_STORE)
q8_0_large_store = mmq._kernel(Q.Q8_0, large, D.EPI_STORE)
from genie_rt.quant import mmq_legacy as L
q4_1_small_store = mmq._kernel(L.Q4_1, small, D.EPI_STORE)
q4_1_large_swiglu = mmq._kernel(L.Q4_1, large, D.EPI_SWIGLU)
q5_0_small_geglu = mmq._kernel(L.Q5_0, small, D.EPI_GEGLU)
q5_0_large_add = mmq._kernel(L.Q5_0, large, D.EPI_ADD)
q5_1_small_add_redk = mmq._kernel(L.Q5_1, small, D.EPI_ADD, D.RED_KERNEL)
q4_0_large_store = mmq._kernel(L.Q4_0, large, D.EPI_STORE)
q8_0l_small_store = mmq._kernel(L.Q8_0L, small, D.EPI_STORE)
q4k_small_swiglu_redk = mmq._kernel(Q.Q4_K, small, D.EPI_SWIGLU, D.RED_KERNEL)
q6k_small_add_redk = mmq._kernel(Q.Q6_K, small, D.EPI_ADD, D.RED_KERNEL)
reduce_store = mmq._reduce_kernel(D.EPI_STORE)
reduce_add = mmq._reduce_kernel(D.EPI_ADD)
reduce_swiglu = mmq._reduce_kernel(D.EPI_SWIGLU)
reduce_geglu = mmq._reduce_kernel(D.EPI_GEGLU)
from genie_rt.quant import mmq_prep as P
prepare_x_kernel = P.prepare_x_kernel
prepare_x_resident_10 = P.prepare_x_kernel_for(2 * 512 * 10)
mma_peak_kernel = P.mma_peak_kernel
"""
MMQ_KERNELS = {
    "q4k_small_store": Q.Q4_K, "q4k_small_swiglu": Q.Q4_K, "q4k_small_geglu": Q.Q4_K, "q4k_large_store": Q.Q4_K,
    "q4k_large_add": Q.Q4_K, "q6k_small_add": Q.Q6_K, "q6k_large_store": Q.Q6_K,
    "q8_0_small_store": Q.Q8_0, "q8_0_large_store": Q.Q8_0,
    "q4k_small_swiglu_redk": Q.Q4_K, "q6k_small_add_redk": Q.Q6_K,
    "q4_1_small_store": 4, "q4_1_large_swiglu": 4, "q5_0_small_geglu": 5, "q5_0_large_add": 5,
    "q5_1_small_add_redk": 6, "q4_0_large_store": 3, "q8_0l_small_store": 7,     # mmq_legacy codes
}
REDUCE_KERNELS = ("reduce_store", "reduce_add", "reduce_swiglu", "reduce_geglu")


@pytest.fixture(scope="module")
def ptx():
    kernels = {name: mmq.kernel_signature(fmt) for name, fmt in MMQ_KERNELS.items()}
    kernels.update({name: mmq.REDUCE_SIGNATURE for name in REDUCE_KERNELS})
    kernels["prepare_x_kernel"] = mmq.PREPARE_X_SIGNATURE
    kernels["prepare_x_resident_10"] = mmq.PREPARE_X_SIGNATURE
    kernels["mma_peak_kernel"] = "void(float32[::1], int64)"
    return compile_in_subprocess(PTX_SOURCE, kernels)


@pytest.mark.slow
def test_mmq_kernels_use_tensor_cores_and_no_f64(ptx):
    report = []
    for name in MMQ_KERNELS:
        for cc, text in ptx[name].items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_ptx_contains(text, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                "ldmatrix.sync.aligned.m8n8.x4", "cp.async.cg.shared.global",
                                "cp.async.wait_group", "fma.rn.f16x2", where=where)
            assert_no_f64(text, where)
            local = local_memory_bytes(text)
            report.append(f"{where}: local {local} B, {text.count('mma.sync')} mma")
            assert local == 0, f"{where}: {local} bytes of local memory (accumulators spilled?)"
    print("\n".join(report))


@pytest.mark.slow
def test_helper_kernels_ptx(ptx):
    for name in ("prepare_x_kernel", "prepare_x_resident_10", "mma_peak_kernel") + REDUCE_KERNELS:
        for cc, text in ptx[name].items():
            assert_no_f64(text, f"{name} sm_{cc[0]}{cc[1]}")
    for text in ptx["mma_peak_kernel"].values():
        assert_ptx_contains(text, "mma.sync", where="mma_peak_kernel")
        assert local_memory_bytes(text) == 0
    for text in ptx["prepare_x_kernel"].values():
        assert_ptx_contains(text, "cvt.rn.f16x2.f32", where="prepare_x_kernel")
    for text in ptx["prepare_x_resident_10"].values():      # the pairs stay in registers
        assert_ptx_contains(text, "cvt.rn.f16x2.f32", "shfl.sync.bfly", where="prepare_x_resident_10")
        assert local_memory_bytes(text) == 0
    for name in REDUCE_KERNELS:
        for cc, text in ptx[name].items():
            assert local_memory_bytes(text) == 0, f"{name} sm_{cc[0]}{cc[1]}: local memory"


# =====================================================================================
# GPU: real shapes
# =====================================================================================
QWEN3_4B = [
    # name, rows, cols, qtype, mode
    ("q", 4096, 2560, "Q4_K", "store"),
    ("k", 1024, 2560, "Q4_K", "store"),
    ("v", 1024, 2560, "Q6_K", "store"),
    ("o", 2560, 4096, "Q4_K", "add"),
    ("gate_up", 2 * 9728, 2560, "Q4_K", "swiglu"),
    ("down", 2560, 9728, "Q6_K", "add"),
    ("down_q4k", 2560, 9728, "Q4_K", "add"),
    ("q_q8_0", 4096, 2560, "Q8_0", "store"),
]


@pytest.fixture(scope="module")
def gpu_weights():
    rng = np.random.default_rng(7)
    return {name: (MR.random_weight(qt, rows, cols, rng), mode)
            for name, rows, cols, qt, mode in QWEN3_4B}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [18, 33, 128, 512, 2048])
@pytest.mark.parametrize("name", [s[0] for s in QWEN3_4B])
def test_gpu_qwen3_shapes(gpu_weights, name, n):
    w, mode = gpu_weights[name]
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, w.cols)).astype(np.float32)
    rows_out = w.rows // 2 if mode == "swiglu" else w.rows
    y0 = rng.standard_normal((n, rows_out)).astype(np.float32) if mode == "add" else None
    out, counters, p = run_mmq(w, x, mode, y0=y0, use_prepare=True)
    rows = np.sort(rng.choice(rows_out, 256, replace=False))
    ratio, rms = check_close(out[:, rows], w, x, mode, y0, rows,
                             where=f"{name} N={n} {p.config.name} split {p.splits}")
    assert (counters == 0).all()
    print(f"{name} N={n}: {p.config.name} split {p.splits}, err/bound {ratio:.3f}, rel rms {rms:.1e}")


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", sorted(MP.REDUCTIONS))
def test_gpu_split_k_is_deterministic(gpu_weights, reduce):
    w, _ = gpu_weights["down"]
    x = np.random.default_rng(9).standard_normal((33, w.cols)).astype(np.float32)
    a, _, p = run_mmq(w, x, "store", use_prepare=True, reduce=reduce)
    b, _, _ = run_mmq(w, x, "store", use_prepare=True, reduce=reduce)
    assert p.splits > 1
    np.testing.assert_array_equal(a, b)
    ratio, _ = check_close(a[:, :256], w, x, "store", rows=np.arange(256), where=f"down reduce={reduce}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k", "o", "gate_up", "down"])
def test_gpu_both_reductions_at_small_n(gpu_weights, name):
    w, mode = gpu_weights[name]
    rng = np.random.default_rng(17)
    for n in (16, 40):
        x = rng.standard_normal((n, w.cols)).astype(np.float32)
        rows_out = w.rows // 2 if mode == "swiglu" else w.rows
        y0 = rng.standard_normal((n, rows_out)).astype(np.float32) if mode == "add" else None
        rows = np.sort(rng.choice(rows_out, 256, replace=False))
        for reduce in MP.REDUCTIONS:
            out, _, p = run_mmq(w, x, mode, y0=y0, use_prepare=True, reduce=reduce)
            check_close(out[:, rows], w, x, mode, y0, rows,
                        where=f"{name} N={n} {p.config.name} split {p.splits} reduce={reduce}")


# Gemma 3 270M (hidden 640, ffn 2048: q/k/gate/up Q5_0, v Q8_0 at K = 640, o and down
# Q4_K / Q6_K) and SmolLM2 135M (hidden 576, ffn 1536, Q4_1) at their real shapes, and the
# other 32-weight formats at a Qwen-like one
MODEL_SHAPES = [
    ("gemma-q", 1024, 640, "Q5_0", "store"), ("gemma-v", 256, 640, "Q8_0", "store"),
    ("gemma-gate_up", 2 * 2048, 640, "Q5_0", "geglu"), ("gemma-o", 640, 1024, "Q4_K", "add"),
    ("gemma-down", 640, 2048, "Q6_K", "add"),
    ("smol-q", 576, 576, "Q4_1", "store"), ("smol-k", 192, 576, "Q4_1", "store"),
    ("smol-gate_up", 2 * 1536, 576, "Q4_1", "swiglu"), ("smol-down", 576, 1536, "Q4_1", "add"),
    ("q4_0", 4096, 2560, "Q4_0", "store"), ("q5_1", 4096, 2560, "Q5_1", "add"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [7, 33, 128, 512])
@pytest.mark.parametrize("name,rows,cols,qtype,mode", MODEL_SHAPES, ids=[s[0] for s in MODEL_SHAPES])
def test_gpu_model_shapes(name, rows, cols, qtype, mode, n):
    check_gpu_shape(name, rows, cols, qtype, mode, n)


def check_gpu_shape(name, rows, cols, qtype, mode, n):
    """One real-shape GEMM on the GPU against numpy (256 sampled columns) with its error bound."""
    rng = np.random.default_rng(rows + n)
    w = MR.random_weight(qtype, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    rows_out = rows // 2 if mode in MP.GATED else rows
    y0 = rng.standard_normal((n, rows_out)).astype(np.float32) if mode == "add" else None
    out, counters, p = run_mmq(w, x, mode, y0=y0, use_prepare=True)
    sel = np.sort(rng.choice(rows_out, min(rows_out, 256), replace=False))
    ratio, rms = check_close(out[:, sel], w, x, mode, y0, sel, where=f"{name} N={n} {p.config.name} split {p.splits}")
    assert (counters == 0).all()
    print(f"{name} N={n}: {p.config.name} split {p.splits}, err/bound {ratio:.3f}, rel rms {rms:.1e}")
