"""Tests for genie_rt.quant.gemv: the decode GEMV kernels against numpy, three ways.

- simulator tests (no GPU; on a GPU machine the same tests run on the device): tiny
  shapes with awkward sizes (rows not a multiple of the rows per block, rows shorter than
  a warp's 32 units, rows longer than one trip of the row loop, n_tok 1/3/7/8, KSPLIT
  1/2/4), every format x mode, residual (separate and in place), fused QKV with mixed
  formats, fused gate/up + SiLU with mixed formats, q8 activation quantization (the PDL builds
  against the plain ones: test_gemv_pdl.py);
- PTX tests: every kernel kind compiled for sm_87 and sm_90 in one subprocess, checking
  128-bit loads, dp4a, no float64 and no local memory;
- GPU tests (`-m gpu`): Qwen3-4B shapes on fresh random weights.

Error bounds (gemv.error_bound, defined once): a dot product's rounding error scales
with sum |w x|, so the scale is |W| @ |x|, not |y|:
    f32 mode:  |y - W x| <= 1e-5 * |W| @ |x|
    dp4a mode: compared with W x~ (x~ = the q8 activations the kernel multiplies) within
               the f32 bound, and with W x within that plus |W| @ (d / 2): each q8 value
               is within half a step d = amax / 127 of x (d of its 32-value block).
"""

import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_kernels as K
from genie_rt.quant.formats import QType, quantize
from genie_rt.quant.gemv_bench import random_weight, rows_of
from genie_rt.quant.layout import pack
from ptx_helpers import assert_no_f64, assert_ptx_contains, assert_ptx_lacks, compile_in_subprocess, \
    local_memory_bytes


@pytest.fixture
def plain_launch(monkeypatch):
    """pdl.launch as the plain launch: a PDL build runs under the simulator (griddepcontrol is a
    no-op there; the launch attribute needs an sm_90 GPU). test_gemv_pdl.py uses it too."""
    from genie_rt.quant import pdl
    monkeypatch.setattr(pdl, "launch", lambda k, grid, block, stream, *a: k[grid, block, stream](*a))


Q4, Q6, Q8, Q5, F16 = QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.Q5_0, QType.F16
Q40, Q41, Q51, Q5K, BF16 = QType.Q4_0, QType.Q4_1, QType.Q5_1, QType.Q5_K, QType.BF16
VARIANTS = [(q, m) for q, modes in K.MODES.items() for m in modes]   # 7 (format, mode) pairs


# =====================================================================================
# Helpers
# =====================================================================================
def weight(qtype, mode, rows, cols, seed=0):
    """(W float32 [rows, cols] reference values, GemvWeight on the device)."""
    hw = random_weight(qtype, rows, cols, np.random.default_rng(seed))
    return G.dequantize_weight(hw), G.prepare_weight(G.to_device(hw), mode)


def activations(n_tok, cols, seed=1):
    """x float32 [n_tok, cols] (host), and device x, xq, xs after quantize_q8."""
    x = np.random.default_rng(seed).standard_normal((n_tok, cols)).astype(np.float32)
    dx = cuda.to_device(x)
    xq = cuda.device_array((n_tok, cols), np.int8)
    xs = cuda.device_array((n_tok, cols // 8), np.float32)
    G.quantize_q8(dx, xq, xs)
    return x, dx, xq, xs


def assert_within(what, got, ref, bound):
    """|got - ref| <= bound everywhere, else fail with the worst element and a few pairs."""
    got = np.asarray(got, np.float64)
    err = np.abs(got - ref)
    ratio = err / bound
    if np.all(ratio <= 1):
        return float(ratio.max())
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    bad = np.argwhere(ratio > 1)[:5]
    pairs = ", ".join(f"{tuple(int(i) for i in b)}: {got[tuple(b)]:.6g} vs {ref[tuple(b)]:.6g}" for b in bad)
    pytest.fail(f"{what}: {int((ratio > 1).sum())} of {ratio.size} elements outside the bound; worst at "
                f"{worst}: got {got[worst]:.8g}, ref {ref[worst]:.8g}, |err| {err[worst]:.3g} > "
                f"bound {bound[worst]:.3g}. First: {pairs}")


def check_gemv(what, y, W, x, mode, xq, xs, residual=None):
    """y (host) against numpy for weight values W and activations x (see module doc)."""
    if mode == "dp4a":
        xt = G.dequantize_q8(xq.copy_to_host(), xs.copy_to_host())
        assert_within(f"{what} vs W @ q8(x)", y, G.gemv_reference(W, xt, residual), G.error_bound(W, xt, "f32"))
    assert_within(f"{what} vs W @ x", y, G.gemv_reference(W, x, residual),
                  G.error_bound(W, x, mode, xs.copy_to_host() if mode == "dp4a" else None))


# =====================================================================================
# Simulator (or device) tests at tiny shapes
# =====================================================================================
def test_quantize_q8_matches_reference_bit_for_bit():
    x = np.random.default_rng(3).standard_normal((3, 256)).astype(np.float32)
    x[0, 32:64] = 0                                    # an all-zero block: d = 0, q = 0
    x[1, :32] *= 1e-30                                 # tiny values
    x[2, 64:96] = np.linspace(-1, 1, 32)               # exact ties after scaling
    dx = cuda.to_device(x)
    xq = cuda.device_array((3, 256), np.int8)
    xs = cuda.device_array((3, 32), np.float32)
    G.quantize_q8(dx, xq, xs)
    rq, rs = G.quantize_q8_reference(x)
    np.testing.assert_array_equal(xq.copy_to_host(), rq)
    np.testing.assert_array_equal(xs.copy_to_host(), rs)
    # the bound the dp4a tests rely on: every value within half a step of its block's d
    d = np.repeat(rs[:, ::4], 32, axis=1)
    assert np.all(np.abs(G.dequantize_q8(rq, rs) - x) <= d / 2 * (1 + 1e-6))


# (rows, cols, n_tok, ksplit): rows not a multiple of the 4 / KSPLIT rows of a block;
# the K-quant rows of 256 columns have 8 units (24 of 32 lanes idle); 1280 columns are
# 40 units (lanes 0-7 take a second unit: the clamped-load path)
CASES = {Q4: [(5, 512, 1, 1), (7, 256, 3, 2), (3, 1280, 1, 1)],
         Q6: [(5, 512, 1, 1), (7, 256, 3, 2), (3, 1280, 1, 1)],
         Q8: [(6, 256, 1, 1), (5, 512, 3, 2)],
         Q5: [(5, 256, 1, 1), (6, 512, 3, 2), (2, 1280, 1, 1)],
         F16: [(5, 256, 1, 1), (3, 512, 3, 2)],
         # 32-weight formats at K a multiple of 32 but not of 256: SmolLM2's 576, Gemma's
         # 640, and 96 (3 blocks: odd block counts, 4-byte-aligned rows of d / dm / qh)
         Q40: [(5, 576, 1, 1), (6, 640, 3, 2), (3, 96, 2, 1)],
         Q41: [(5, 576, 1, 1), (6, 640, 3, 2), (3, 96, 2, 1), (2, 1280, 1, 1)],
         Q51: [(5, 576, 1, 1), (6, 640, 3, 2), (3, 96, 2, 1)],
         Q5K: [(5, 512, 1, 1), (7, 256, 3, 2), (3, 1280, 1, 1)],
         BF16: [(5, 576, 1, 1), (3, 512, 3, 2)]}
CASES[Q8] = CASES[Q8] + [(5, 576, 2, 1), (3, 96, 1, 1)]
CASES[Q5] = CASES[Q5] + [(5, 576, 2, 1), (4, 640, 1, 2)]


@pytest.mark.parametrize("qtype,mode", VARIANTS, ids=[f"{q.name}-{m}" for q, m in VARIANTS])
def test_gemv_matches_reference(qtype, mode):
    for i, (rows, cols, n_tok, ks) in enumerate(CASES[qtype]):
        if mode == "f32" and i == 1 and qtype in (Q4, Q6):
            ks = 4                                     # the f32 kernels take the 4-warp split
        W, w = weight(qtype, mode, rows, cols, seed=i)
        x, dx, xq, xs = activations(n_tok, cols, seed=10 + i)
        y = cuda.device_array((n_tok, rows), np.float32)
        G.gemv(w, dx, y, xq=xq, xs=xs, ksplit=ks)
        check_gemv(f"{qtype.name} {mode} {rows}x{cols} n_tok={n_tok} ksplit={ks}",
                   y.copy_to_host(), W, x, mode, xq, xs)


@pytest.mark.parametrize("n_tok", [7, 8])
def test_gemv_large_batches(n_tok):
    for qtype in (Q4, Q6):
        W, w = weight(qtype, "dp4a", 3, 256, seed=n_tok)
        x, dx, xq, xs = activations(n_tok, 256, seed=n_tok)
        y = cuda.device_array((n_tok, 3), np.float32)
        G.gemv(w, dx, y, xq=xq, xs=xs)
        check_gemv(f"{qtype.name} n_tok={n_tok}", y.copy_to_host(), W, x, "dp4a", xq, xs)


def test_gemv_residual_separate_and_in_place():
    W, w = weight(Q6, "dp4a", 6, 256, seed=4)
    x, dx, xq, xs = activations(3, 256, seed=5)
    r = np.random.default_rng(6).standard_normal((3, 6)).astype(np.float32)
    dr = cuda.to_device(r)
    y = cuda.device_array((3, 6), np.float32)
    G.gemv(w, dx, y, xq=xq, xs=xs, residual=dr, ksplit=2)
    check_gemv("y = W x + r", y.copy_to_host(), W, x, "dp4a", xq, xs, residual=r)
    np.testing.assert_array_equal(dr.copy_to_host(), r)              # r untouched
    G.gemv(w, dx, dr, xq=xq, xs=xs, residual=dr)                      # r += W x
    check_gemv("r += W x (in place)", dr.copy_to_host(), W, x, "dp4a", xq, xs, residual=r)


@pytest.mark.parametrize("specs,ks", [
    (((Q4, "dp4a"), (Q4, "dp4a"), (Q6, "dp4a")), 1),     # Qwen3 Q4_K_M: attn_v Q6_K
    (((F16, "f32"), (Q8, "dp4a"), (Q5, "dp4a")), 2),     # float and q8 activations in one launch
], ids=["q4k-q4k-q6k", "f16-q80-q50-ks2"])
def test_qkv_mixed_formats(specs, ks):
    rows = (5, 3, 6)
    ws = [weight(q, m, r, 256, seed=20 + i) for i, ((q, m), r) in enumerate(zip(specs, rows))]
    x, dx, xq, xs = activations(3, 256, seed=21)
    y = cuda.device_array((3, sum(rows)), np.float32)
    G.gemv_qkv(*(w for _, w in ws), dx, y, xq=xq, xs=xs, ksplit=ks)
    got = y.copy_to_host()
    lo = 0
    for (W, w), r in zip(ws, rows):
        check_gemv(f"qkv segment {w.qtype.name} {w.mode}", got[:, lo:lo + r], W, x, w.mode, xq, xs)
        lo += r


def _check_swiglu(what, h, Wg, Wu, x, xq, xs, modes, act="silu"):
    """act(g) * u with g and u each inside their bounds, propagated to first order
    (|d act / dg| <= 1.13 for both silu and gelu-tanh; silu's exact slope where known)."""
    def operand(W, mode):
        xt = G.dequantize_q8(xq.copy_to_host(), xs.copy_to_host()) if mode == "dp4a" else x
        return G.gemv_reference(W, xt), G.error_bound(W, xt, "f32")
    (g, bg), (u, bu) = operand(Wg, modes[0]), operand(Wu, modes[1])
    a = G.act_reference(g, act)
    if act == "silu":
        sg = 1 / (1 + np.exp(-g))
        slope = np.abs(sg * (1 + g * (1 - sg)))
    else:
        slope = 1.13
    bound = slope * np.abs(u) * bg + np.abs(a) * bu
    assert_within(what, h, a * u, 2 * bound + 1e-6 * np.abs(a * u) + 1e-30)


@pytest.mark.parametrize("gate,up,n_tok,ks", [
    ((Q4, "dp4a"), (Q4, "dp4a"), 1, 1),
    ((Q4, "dp4a"), (Q6, "f32"), 3, 2),                  # mixed formats and modes: two row loops
], ids=["q4k-q4k", "q4k-q6k-mixed-ks2"])
def test_swiglu(gate, up, n_tok, ks):
    Wg, wg = weight(*gate, 5, 256, seed=30)
    Wu, wu = weight(*up, 5, 256, seed=31)
    x, dx, xq, xs = activations(n_tok, 256, seed=32)
    h = cuda.device_array((n_tok, 5), np.float32)
    G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, ksplit=ks)
    _check_swiglu("swiglu", h.copy_to_host(), Wg, Wu, x, xq, xs, (gate[1], up[1]))


@pytest.mark.parametrize("gate,up,ks,lpr", [
    ((Q4, "dp4a"), (Q4, "dp4a"), 1, 32),
    ((Q4, "dp4a"), (Q6, "dp4a"), 2, 32),                 # Q4_K_M: some layers' up is Q6_K
    ((Q4, "dp4a"), (Q4, "dp4a"), 1, 16)], ids=["q4k-q4k", "q4k-q6k-ks2", "q4k-q4k-lpr16"])
def test_swiglu_pair_gives_the_same_bits(gate, up, ks, lpr, monkeypatch, plain_launch):
    """G.SWIGLU_PAIR: a warp's gate and up rows streamed together (make_pair_dot: both rows'
    loads of a trip issued before the first multiply) - the same bits as one row after the
    other; rows of 80 units (2,560 columns: the 4B's), a k-split and two rows a warp. The knob
    pairs the PDL builds only (griddepcontrol a no-op here, pdl.launch the plain launch)."""
    Wg, wg = weight(*gate, 9, 2560, seed=33)
    Wu, wu = weight(*up, 9, 2560, seed=34)
    x, dx, xq, xs = activations(1, 2560, seed=35)
    got = {}
    for pair, use_pdl in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(G, "SWIGLU_PAIR", pair)
        monkeypatch.setattr(G, "PDL", use_pdl)
        h = cuda.device_array((1, 9), np.float32)
        G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, ksplit=ks, lpr=lpr)
        got[pair and use_pdl] = h.copy_to_host()
        paired = pair and use_pdl and K.pairable(gate, up, 1)
        assert ("swiglu", gate, up, 1, ks, lpr, "silu", use_pdl, paired, G.PDL_PIN_WEIGHTS) in G._kernels
    assert K.pairable(gate, up, 1) and not K.pairable(gate, up, 2)
    assert np.array_equal(got[True].view(np.int32), got[False].view(np.int32))
    _check_swiglu("swiglu pair", got[True], Wg, Wu, x, xq, xs, (gate[1], up[1]))


@pytest.mark.parametrize("gate,up,n_tok,ks", [
    ((Q4, "dp4a"), (Q4, "dp4a"), 1, 1),
    ((Q5, "dp4a"), (Q5, "dp4a"), 2, 2),                 # Gemma 3 270M: gate/up Q5_0
], ids=["q4k-q4k", "q50-q50-ks2"])
def test_geglu(gate, up, n_tok, ks):
    """act="gelu": Gemma's gated FFN (gelu, tanh form) in the fused gate/up launch; 640
    columns (Gemma 3 270M's hidden size) for the 32-weight format."""
    cols = 256 if gate[0] == Q4 else 640
    Wg, wg = weight(*gate, 5, cols, seed=33)
    Wu, wu = weight(*up, 5, cols, seed=34)
    x, dx, xq, xs = activations(n_tok, cols, seed=35)
    x *= 2                                              # reach gelu's curved part
    dx = cuda.to_device(x)
    G.quantize_q8(dx, xq, xs)
    h = cuda.device_array((n_tok, 5), np.float32)
    G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, ksplit=ks, act="gelu")
    _check_swiglu("geglu", h.copy_to_host(), Wg, Wu, x, xq, xs, (gate[1], up[1]), act="gelu")
    with pytest.raises(ValueError, match="act must be"):
        G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, act="relu")


def test_act_reference_matches_the_engine_gelu():
    from genie_rt.engine.norm import gelu_reference
    g = np.linspace(-6, 6, 101)
    np.testing.assert_allclose(G.act_reference(g, "gelu"), gelu_reference(g.astype(np.float32)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype,mode", VARIANTS, ids=[f"{q.name}-{m}" for q, m in VARIANTS])
def test_two_rows_per_warp(qtype, mode):
    """16 lanes a row (two rows per warp; an odd row count leaves the last half-warp idle),
    rows of 16 units (512 columns of 32-weight units: one trip per lane) and of 5 units."""
    for i, (rows, cols, n_tok) in enumerate(((7, 512, 2), (4, 2560, 1))):
        W, w = weight(qtype, mode, rows, cols, seed=40 + i)
        x, dx, xq, xs = activations(n_tok, cols, seed=41 + i)
        y = cuda.device_array((n_tok, rows), np.float32)
        G.gemv(w, dx, y, xq=xq, xs=xs, ksplit=1, lpr=16)
        check_gemv(f"{qtype.name} {mode} {rows}x{cols} lpr=16", y.copy_to_host(), W, x, mode, xq, xs)


def test_fused_kernels_two_rows_per_warp():
    specs = ((Q4, "dp4a"), (Q4, "dp4a"), (Q6, "dp4a"))
    rows = (5, 3, 6)
    ws = [weight(q, m, r, 256, seed=50 + i) for i, ((q, m), r) in enumerate(zip(specs, rows))]
    x, dx, xq, xs = activations(1, 256, seed=51)
    y = cuda.device_array((1, sum(rows)), np.float32)
    G.gemv_qkv(*(w for _, w in ws), dx, y, xq=xq, xs=xs, ksplit=1, lpr=16)
    got, lo = y.copy_to_host(), 0
    for (W, w), r in zip(ws, rows):
        check_gemv(f"qkv lpr=16 segment {w.qtype.name}", got[:, lo:lo + r], W, x, w.mode, xq, xs)
        lo += r
    Wg, wg = weight(Q4, "dp4a", 5, 256, seed=52)
    Wu, wu = weight(Q6, "dp4a", 5, 256, seed=53)
    h = cuda.device_array((1, 5), np.float32)
    G.gemv_swiglu(wg, wu, dx, h, xq=xq, xs=xs, ksplit=1, lpr=16)
    _check_swiglu("swiglu lpr=16", h.copy_to_host(), Wg, Wu, x, xq, xs, ("dp4a", "dp4a"))
    with pytest.raises(ValueError, match="lanes per row"):
        G.gemv(wg, dx, h, xq=xq, xs=xs, ksplit=2, lpr=16)


def test_real_quantizer_output_too():
    """Blocks from the project's own quantizer (not random bytes) give the same answers."""
    rng = np.random.default_rng(7)
    w32 = (rng.standard_normal((5, 512)) * 0.02).astype(np.float32)
    for qtype in (Q4, Q6, Q40, Q41, Q51, Q5K, BF16):
        hw = pack(quantize(w32, qtype), qtype, (5, 512))
        W, w = G.dequantize_weight(hw), G.prepare_weight(G.to_device(hw))
        x, dx, xq, xs = activations(1, 512, seed=8)
        y = cuda.device_array((1, 5), np.float32)
        G.gemv(w, dx, y, xq=xq, xs=xs)
        check_gemv(f"{qtype.name} quantized", y.copy_to_host(), W, x, w.mode, xq, xs)


def test_launchers_refuse_what_they_cannot_handle():
    W, w = weight(Q4, "dp4a", 4, 256)
    x, dx, xq, xs = activations(1, 256)
    y = cuda.device_array((1, 4), np.float32)
    with pytest.raises(TypeError, match="device array"):
        G.gemv(w, dx, np.zeros((1, 4), np.float32), xq=xq, xs=xs)
    with pytest.raises(ValueError, match="pass xq and xs"):
        G.gemv(w, dx, y)
    with pytest.raises(ValueError, match="1..8 tokens"):
        G.gemv(w, cuda.to_device(np.zeros((9, 256), np.float32)), y, xq=xq, xs=xs)
    with pytest.raises(ValueError, match="columns"):
        G.gemv(w, cuda.to_device(np.zeros((1, 512), np.float32)), y, xq=xq, xs=xs)
    with pytest.raises(ValueError, match="must be float32"):
        G.gemv(w, dx, cuda.device_array((1, 5), np.float32), xq=xq, xs=xs)
    big = cuda.device_array((1, 512), np.float32)
    with pytest.raises(ValueError, match="overlaps x"):            # x is read through .nc loads
        G.gemv(weight(Q4, "dp4a", 256, 256)[1], big[:, :256], big[:, 128:384], xq=xq, xs=xs)
    q2k = pack(quantize(np.zeros((1, 256), np.float32), Q4), Q4, (1, 256))
    q2k.qtype = QType.Q2_K
    with pytest.raises(ValueError, match="no kernel for Q2_K"):
        G.prepare_weight(q2k)
    with pytest.raises(ValueError, match="modes"):
        G.prepare_weight(G.to_device(random_weight(Q8, 1, 32, np.random.default_rng(0))), "f32")
    with pytest.raises(ValueError, match="host array"):
        G.prepare_weight(random_weight(Q4, 1, 256, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="differ"):
        G.gemv_swiglu(w, weight(Q4, "dp4a", 3, 256)[1], dx, y, xq=xq, xs=xs)


def test_choose_ksplit():
    G._sm_count_cache[:] = [132]                       # an H200
    try:
        assert G.choose_ksplit(151936, 80) == 1        # output projection: rows enough
        assert G.choose_ksplit(6144, 80) == 1          # fused QKV
        assert G.choose_ksplit(2560, 128) == 1         # attn_output 4096 -> 2560
        assert G.choose_ksplit(2560, 304) == 1         # ffn_down 9728 -> 2560
        assert G.choose_ksplit(1024, 80) == 2          # attn_k alone: 2 warps per row
        assert G.choose_ksplit(1024, 40) == 1          # too few units (1280 columns) to split
        assert G.choose_ksplit(512, 1024) == 4
        # 16 lanes (two rows a warp, 5 units a lane) only for the tall output projection
        assert G.choose_lpr(80, 1, 151936) == 16
        assert G.choose_lpr(80, 1, 6144) == 32
        assert G.choose_lpr(80, 2, 151936) == 32
        assert G.choose_lpr(304, 1, 151936) == 32
    finally:
        G._sm_count_cache[:] = []


# =====================================================================================
# PTX: every kernel kind for sm_87 and sm_90, in one subprocess
# =====================================================================================
_PTX_SOURCE = '''
from genie_rt.quant import gemv_kernels as K
from genie_rt.quant.formats import QType as Q
for _q, _modes in K.MODES.items():
    for _m in _modes:
        globals()[f"gemv_{_q.name}_{_m}"] = K.gemv_kernel(_q, _m, 1, 1, False)
gemv_Q4_K_dp4a_nt3_ks2_resid = K.gemv_kernel(Q.Q4_K, "dp4a", 3, 2, True)
qkv_mixed = K.qkv_kernel(((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), (Q.Q6_K, "dp4a")), 1, 1)
swiglu_mixed_ks2 = K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q6_K, "f32"), 2, 2)
geglu_q5_0 = K.swiglu_kernel((Q.Q5_0, "dp4a"), (Q.Q5_0, "dp4a"), 1, 1, 32, "gelu")
gemv_Q6_K_dp4a_lpr16 = K.gemv_kernel(Q.Q6_K, "dp4a", 1, 1, False, 16)
qkv_mixed_lpr16 = K.qkv_kernel(((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), (Q.Q6_K, "dp4a")), 1, 1, 16)
qkv_gemma = K.qkv_kernel(((Q.Q5_0, "dp4a"), (Q.Q5_0, "dp4a"), (Q.Q8_0, "dp4a")), 1, 2)
swiglu_q4_1_nt3 = K.swiglu_kernel((Q.Q4_1, "dp4a"), (Q.Q4_1, "dp4a"), 3, 1)
quantize_q8_kernel = K.quantize_q8_kernel
gemv_Q4_K_dp4a_resid_pdl = K.gemv_kernel(Q.Q4_K, "dp4a", 1, 1, True, 32, True)
qkv_mixed_pdl = K.qkv_kernel(((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), (Q.Q6_K, "dp4a")), 1, 1, 32, True)
swiglu_dp4a_pdl = K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q4_K, "dp4a"), 1, 1, 32, "silu", True)
swiglu_pair = K.swiglu_kernel((Q.Q4_K, "dp4a"), (Q.Q6_K, "dp4a"), 1, 1, 32, "silu", False, True)
'''
PTX_KERNELS = {**{f"gemv_{q.name}_{m}": G.SIG_GEMV for q, m in VARIANTS},
               "gemv_Q4_K_dp4a_nt3_ks2_resid": G.SIG_GEMV, "qkv_mixed": G.SIG_QKV,
               "swiglu_mixed_ks2": G.SIG_SWIGLU, "geglu_q5_0": G.SIG_SWIGLU, "gemv_Q6_K_dp4a_lpr16": G.SIG_GEMV,
               "qkv_mixed_lpr16": G.SIG_QKV, "qkv_gemma": G.SIG_QKV, "swiglu_q4_1_nt3": G.SIG_SWIGLU,
               "quantize_q8_kernel": G.SIG_QUANTIZE, "gemv_Q4_K_dp4a_resid_pdl": G.SIG_GEMV,
               "qkv_mixed_pdl": G.SIG_QKV, "swiglu_dp4a_pdl": G.SIG_SWIGLU, "swiglu_pair": G.SIG_SWIGLU}


@pytest.fixture(scope="module")
def ptx_text():
    return compile_in_subprocess(_PTX_SOURCE, PTX_KERNELS)


@pytest.mark.parametrize("name", sorted(PTX_KERNELS))
def test_ptx(ptx_text, name):
    for cc, text in ptx_text[name].items():
        where = f"{name} sm_{cc[0]}{cc[1]}"
        assert_no_f64(text, where)
        assert local_memory_bytes(text) == 0, f"{where}: local memory (a spilled array or tuple[variable])"
        assert "call.uni" not in text, f"{where}: a device function was not inlined"
        if name.endswith("_pdl"):       # programmatic dependent launch: sm_90 builds only
            if cc >= (9, 0):
                assert_ptx_contains(text, "griddepcontrol.wait", "griddepcontrol.launch_dependents", where=where)
        else:                           # the plain builds (sm_80/87 too) never contain them
            assert_ptx_lacks(text, "griddepcontrol", where=where)
        if name == "quantize_q8_kernel":
            assert_ptx_contains(text, "shfl.sync.bfly", where=where)
            continue
        # weights by 16-byte loads: read-only ones, or (a PDL build's early trips) ordinary ones that
        # ptxas leaves above the wait (ptx.ldw_v4; tests/test_pdl_sass.py)
        weights = "ld.global.L1::no_allocate.v4.u32" if name.endswith("_pdl") else "ld.global.nc.v4.u32"
        assert_ptx_contains(text, weights, "shfl.sync.bfly", where=where)
        if "dp4a" in name or name.startswith("qkv_") or name in ("swiglu_mixed_ks2", "geglu_q5_0", "swiglu_q4_1_nt3",
                                                                   "swiglu_pair"):
            assert_ptx_contains(text, "dp4a.s32.s32", where=where)
        else:
            assert_ptx_lacks(text, "dp4a", where=where)
        if "ks2" in name or name == "qkv_gemma":
            assert_ptx_contains(text, "bar.sync", where=where)   # the k-split reduction


# =====================================================================================
# GPU: Qwen3-4B shapes on fresh random weights (H200 test machine)
# =====================================================================================
QWEN3_4B = [("attn_q", Q4, 4096, 2560), ("attn_k", Q4, 1024, 2560), ("attn_output", Q4, 2560, 4096),
            ("ffn_up", Q4, 9728, 2560), ("ffn_down", Q4, 2560, 9728), ("ffn_down", Q6, 2560, 9728),
            ("output", Q6, 151936, 2560)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,qtype,rows,cols", QWEN3_4B, ids=[f"{n}-{q.name}-{r}" for n, q, r, _ in QWEN3_4B])
@pytest.mark.parametrize("mode", ["dp4a", "f32"])
@pytest.mark.parametrize("n_tok", [1, 8])
def test_gpu_qwen3_4b_shapes(name, qtype, rows, cols, mode, n_tok):
    """Bound: gemv.error_bound on a random sample of 1024 rows (numpy on all 389M weights
    of the output projection would take minutes). Also prints the relative error."""
    rng = np.random.default_rng(rows + cols + n_tok)
    hw = random_weight(qtype, rows, cols, rng)
    w = G.prepare_weight(G.to_device(hw), mode)
    x, dx, xq, xs = activations(n_tok, cols, seed=rows)
    y = cuda.device_array((n_tok, rows), np.float32)
    G.gemv(w, dx, y, xq=xq, xs=xs)
    idx = np.sort(rng.choice(rows, min(rows, 1024), replace=False))
    W = G.dequantize_weight(rows_of(hw, idx))
    got = y.copy_to_host()[:, idx]
    check_gemv(f"{name} {qtype.name} {mode}", got, W, x, mode, xq, xs)
    ref = G.gemv_reference(W, x)
    print(f"{name} {qtype.name} {mode} n_tok={n_tok}: max |y - Wx| / max |Wx| = "
          f"{np.abs(got - ref).max() / np.abs(ref).max():.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 8])
def test_gpu_fused_qwen3_4b(n_tok):
    rng = np.random.default_rng(n_tok)
    hs = [random_weight(q, r, 2560, rng) for q, r in ((Q4, 4096), (Q4, 1024), (Q6, 1024))]
    ws = [G.prepare_weight(G.to_device(h)) for h in hs]
    x, dx, xq, xs = activations(n_tok, 2560, seed=n_tok)
    y = cuda.device_array((n_tok, 6144), np.float32)
    G.gemv_qkv(*ws, dx, y, xq=xq, xs=xs)
    got, lo = y.copy_to_host(), 0
    for h in hs:
        idx = np.sort(rng.choice(h.rows, 256, replace=False))
        check_gemv("qkv", got[:, lo + idx], G.dequantize_weight(rows_of(h, idx)), x, "dp4a", xq, xs)
        lo += h.rows
    hg, hu = random_weight(Q4, 9728, 2560, rng), random_weight(Q4, 9728, 2560, rng)
    h = cuda.device_array((n_tok, 9728), np.float32)
    G.gemv_swiglu(G.prepare_weight(G.to_device(hg)), G.prepare_weight(G.to_device(hu)), dx, h, xq=xq, xs=xs)
    idx = np.sort(rng.choice(9728, 512, replace=False))
    _check_swiglu("swiglu", h.copy_to_host()[:, idx], G.dequantize_weight(rows_of(hg, idx)),
                  G.dequantize_weight(rows_of(hu, idx)), x, xq, xs, ("dp4a", "dp4a"))


# Gemma 3 270M (Q4_K_M: attn_q/k/v, gate/up Q5_0, attn_v Q8_0 on half the layers, the tied
# Q8_0 output) and SmolLM2 135M (Q4_1 everywhere) at their real shapes, every other
# format at a Qwen-like one: fresh random blocks, a sample of rows against numpy
REAL_SHAPES = [("gemma-q", Q5, 1024, 640), ("gemma-v", Q8, 256, 640), ("gemma-o", Q4, 640, 1024),
               ("gemma-down", Q6, 640, 2048), ("gemma-out", Q8, 262144, 640),
               ("smol-q", Q41, 576, 576), ("smol-k", Q41, 192, 576), ("smol-up", Q41, 1536, 576),
               ("smol-down", Q41, 576, 1536), ("smol-out", Q8, 49152, 576),
               ("q4_0", Q40, 4096, 2560), ("q5_1", Q51, 4096, 2560), ("q5_k", Q5K, 4096, 2560),
               ("bf16", BF16, 2048, 2560), ("f16-576", F16, 1536, 576)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,qtype,rows,cols", REAL_SHAPES, ids=[s[0] for s in REAL_SHAPES])
@pytest.mark.parametrize("n_tok", [1, 5])
def test_gpu_model_shapes(name, qtype, rows, cols, n_tok):
    rng = np.random.default_rng(rows + cols + n_tok)
    hw = random_weight(qtype, rows, cols, rng)
    w = G.prepare_weight(G.to_device(hw))
    x, dx, xq, xs = activations(n_tok, cols, seed=rows)
    y = cuda.device_array((n_tok, rows), np.float32)
    G.gemv(w, dx, y, xq=xq, xs=xs)
    idx = np.sort(rng.choice(rows, min(rows, 512), replace=False))
    check_gemv(f"{name} {qtype.name}", y.copy_to_host()[:, idx], G.dequantize_weight(rows_of(hw, idx)), x,
               w.mode, xq, xs)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,cols,ff", [(Q5, 640, 2048), (Q41, 576, 1536)], ids=["gemma-q5_0", "smol-q4_1"])
def test_gpu_gated_ffn_model_shapes(qtype, cols, ff):
    rng = np.random.default_rng(ff)
    hg, hu = random_weight(qtype, ff, cols, rng), random_weight(qtype, ff, cols, rng)
    x, dx, xq, xs = activations(1, cols, seed=ff)
    idx = np.sort(rng.choice(ff, 512, replace=False))
    for act in ("silu", "gelu"):
        h = cuda.device_array((1, ff), np.float32)
        G.gemv_swiglu(G.prepare_weight(G.to_device(hg)), G.prepare_weight(G.to_device(hu)), dx, h,
                      xq=xq, xs=xs, act=act)
        _check_swiglu(act, h.copy_to_host()[:, idx], G.dequantize_weight(rows_of(hg, idx)),
                      G.dequantize_weight(rows_of(hu, idx)), x, xq, xs, ("dp4a", "dp4a"), act=act)
