"""The residual GEMV with the RMSNorm + q8 of its output folded in (gemv(..., norm=GemvNorm)).

The fused launch must give exactly the bits of the two launches it replaces - the plain
residual GEMV, then engine/norm.py's rmsnorm_q8 at the same block size - so the tests
compare bits, not tolerances: y, xq, xs and h, for several formats, k-splits, lanes per
row and norm block sizes (the last block reproduces any block's order of the sum of
squares). Also: the counter is back to 0 after each launch (three launches in a row stay
right), and bad GemvNorm arguments are refused with errors naming the field.

Simulator (conftest.py) at tiny shapes; the PTX of the fused kernel is checked in
tests/test_gemv.py with the other GEMV kernels.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.engine import norm as N
from genie_rt.quant import gemv as G
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight
from test_gemv import plain_launch  # noqa: F401 (a fixture)

Q4, Q6, Q8 = QType.Q4_K, QType.Q6_K, QType.Q8_0
EPS = 1e-6


def _bits_equal(got, ref, what):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    g = got.view(np.uint8).reshape(got.size, -1)
    r = ref.view(np.uint8).reshape(ref.size, -1)
    bad = np.flatnonzero((g != r).any(axis=1))
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} elements differ, first at {bad[0]}: "
                           f"{got.flat[bad[0]]!r} vs {ref.flat[bad[0]]!r}")


def _problem(qtype, rows, cols, seed):
    """(GemvWeight, x, xq, xs on the device; y0, norm weight on the host)."""
    rng = np.random.default_rng(seed)
    w = G.prepare_weight(G.to_device(random_weight(qtype, rows, cols, rng)), "dp4a")
    x = rng.standard_normal((1, cols)).astype(np.float32)
    dx = cuda.to_device(x)
    xq = cuda.device_array((1, cols), np.int8)
    xs = cuda.device_array((1, cols // 8), np.float32)
    G.quantize_q8(dx, xq, xs)
    y0 = rng.standard_normal((1, rows)).astype(np.float32)
    y0[0, 32:64] *= 1e-3                       # blocks of very different scales
    wn = (1 + 0.5 * rng.standard_normal(rows)).astype(np.float32)
    return w, dx, xq, xs, y0, wn


def _outputs(rows):
    return (cuda.to_device(np.full((1, rows), 77, np.int8)),
            cuda.to_device(np.full((1, rows // 8), np.nan, np.float32)),
            cuda.to_device(np.full((1, rows), np.nan, np.float32)))


def _two_launches(w, dx, xq, xs, y0, wn, block, ks, lpr, with_h):
    """The reference: gemv(residual) then rmsnorm_q8 (host copies of y, xq, xs, h)."""
    rows = w.rows
    y = cuda.to_device(y0)
    G.gemv(w, dx, y, xq=xq, xs=xs, residual=y, ksplit=ks, lpr=lpr)
    nq, ns, h = _outputs(rows)
    N.rmsnorm_q8(y, cuda.to_device(wn), nq, ns, EPS, out=h if with_h else None, block=block)
    return y.copy_to_host(), nq.copy_to_host(), ns.copy_to_host(), h.copy_to_host()


# (format, rows, cols, ksplit, lanes per row, norm block, h): rows = the norm's width (a
# multiple of 32); norm blocks below, at and above the GEMV's 128 threads, and None
# (engine/norm.py's default, what the decode step's norms use)
CASES = [(Q4, 96, 256, 1, 32, 128, True),
         (Q4, 64, 512, 2, 32, None, False),
         (Q6, 96, 256, 1, 32, 128, True),
         (Q6, 64, 256, 2, 32, 320, True),
         (Q6, 96, 256, 1, 16, 32, False),
         (Q8, 64, 96, 1, 32, 96, True)]


@pytest.mark.parametrize("qtype,rows,cols,ks,lpr,block,with_h", CASES,
                         ids=[f"{q.name}-{r}x{c}-ks{k}-lpr{lp}-b{b}-{'h' if h else 'q8'}"
                              for q, r, c, k, lp, b, h in CASES])
def test_fused_norm_is_gemv_then_rmsnorm_q8_bit_for_bit(qtype, rows, cols, ks, lpr, block, with_h):
    w, dx, xq, xs, y0, wn = _problem(qtype, rows, cols, seed=rows + cols + ks)
    ref = _two_launches(w, dx, xq, xs, y0, wn, block, ks, lpr, with_h)
    y = cuda.to_device(y0)
    nq, ns, h = _outputs(rows)
    counter = cuda.to_device(np.zeros(1, np.int32))
    norm = G.GemvNorm(cuda.to_device(wn), EPS, nq, ns, counter, h=h if with_h else None, block=block)
    G.gemv(w, dx, y, xq=xq, xs=xs, residual=y, ksplit=ks, lpr=lpr, norm=norm)
    for what, got, r in zip(("y", "xq", "xs"), (y, nq, ns), ref):
        _bits_equal(got.copy_to_host(), r, what)
    if with_h:
        _bits_equal(h.copy_to_host(), ref[3], "h")
    else:
        assert np.isnan(h.copy_to_host()).all(), "h written without norm.h"
    assert int(counter.copy_to_host()[0]) == 0, "the last block resets the counter"


def test_the_loop_tail_for_shapes_the_staged_one_does_not_take(monkeypatch):
    """Rows or norm blocks beyond what the staged tail holds (quant/norm_q8_device.py) take the
    loop tail: the same bits (forced here, at a shape no other test builds)."""
    from genie_rt.quant import norm_q8_device
    monkeypatch.setattr(norm_q8_device, "STAGED_MAX_VALUES", 0)
    qtype, rows, cols, block = Q8, 128, 96, 64
    w, dx, xq, xs, y0, wn = _problem(qtype, rows, cols, seed=5)
    ref = _two_launches(w, dx, xq, xs, y0, wn, block, 1, 32, True)
    y = cuda.to_device(y0)
    nq, ns, h = _outputs(rows)
    norm = G.GemvNorm(cuda.to_device(wn), EPS, nq, ns, cuda.to_device(np.zeros(1, np.int32)), h=h, block=block)
    G.gemv(w, dx, y, xq=xq, xs=xs, residual=y, ksplit=1, lpr=32, norm=norm)
    for what, got, r in zip(("y", "xq", "xs", "h"), (y, nq, ns, h), ref):
        _bits_equal(got.copy_to_host(), r, what)


def test_three_launches_in_a_row_share_one_counter():
    """Each launch leaves the counter at 0, so the next one finds its last block again;
    the residual stream moves each time (y += W x) and the norm follows it."""
    w, dx, xq, xs, y0, wn = _problem(Q4, 32, 256, seed=7)
    y_ref = cuda.to_device(y0)
    y = cuda.to_device(y0)
    counter = cuda.to_device(np.zeros(1, np.int32))
    dwn = cuda.to_device(wn)
    for step in range(3):
        G.gemv(w, dx, y_ref, xq=xq, xs=xs, residual=y_ref)
        rq, rs, _ = _outputs(32)
        N.rmsnorm_q8(y_ref, dwn, rq, rs, EPS)
        nq, ns, _ = _outputs(32)
        G.gemv(w, dx, y, xq=xq, xs=xs, residual=y, norm=G.GemvNorm(dwn, EPS, nq, ns, counter))
        assert int(counter.copy_to_host()[0]) == 0, f"launch {step}: counter not reset"
        _bits_equal(y.copy_to_host(), y_ref.copy_to_host(), f"launch {step}: y")
        _bits_equal(nq.copy_to_host(), rq.copy_to_host(), f"launch {step}: xq")
        _bits_equal(ns.copy_to_host(), rs.copy_to_host(), f"launch {step}: xs")


def test_pdl_build_of_the_fused_kernel_gives_the_same_bits(monkeypatch, plain_launch):
    """The programmatic-dependent-launch build (G.PDL, a lab switch; griddepcontrol is a
    no-op here and pdl.launch the plain launch) of the fused kernel: the same bits."""
    w, dx, xq, xs, y0, wn = _problem(Q4, 32, 256, seed=11)
    outs = {}
    for use in (False, True):
        monkeypatch.setattr(G, "PDL", use)
        y = cuda.to_device(y0)
        nq, ns, h = _outputs(32)
        G.gemv(w, dx, y, xq=xq, xs=xs, residual=y,
               norm=G.GemvNorm(cuda.to_device(wn), EPS, nq, ns, cuda.to_device(np.zeros(1, np.int32)), h=h))
        outs[use] = [a.copy_to_host() for a in (y, nq, ns, h)]
    for a, b, what in zip(outs[False], outs[True], ("y", "xq", "xs", "h")):
        _bits_equal(b, a, f"PDL build: {what}")
    assert ("gemv_norm", w.spec, 1, 32, 2, True, (32, 32)) in G._kernels  # the PDL build ran (rows, block)


def test_bad_norm_arguments_are_refused():
    w, dx, xq, xs, y0, wn = _problem(Q4, 96, 256, seed=8)
    y = cuda.to_device(y0)
    nq, ns, h = _outputs(96)
    c = cuda.to_device(np.zeros(1, np.int32))
    good = G.GemvNorm(cuda.to_device(wn), EPS, nq, ns, c)

    def call(norm, residual=y, **kw):
        G.gemv(w, dx, y, xq=xq, xs=xs, residual=residual, norm=norm, **kw)

    with pytest.raises(ValueError, match="residual"):
        call(good, residual=None)
    with pytest.raises(TypeError, match="GemvNorm"):
        call((cuda.to_device(wn), EPS, nq, ns, c))
    with pytest.raises(TypeError, match="norm.weight"):
        call(good._replace(weight=wn))
    with pytest.raises(ValueError, match="norm.weight"):
        call(good._replace(weight=cuda.to_device(wn[:64])))
    with pytest.raises(ValueError, match="norm.eps"):
        call(good._replace(eps=0.0))
    with pytest.raises(ValueError, match="norm.xq"):
        call(good._replace(xq=cuda.device_array((1, 96), np.uint8)))
    with pytest.raises(ValueError, match="norm.xs"):
        call(good._replace(xs=cuda.device_array((1, 96), np.float32)))
    with pytest.raises(ValueError, match="norm.h"):
        call(good._replace(h=cuda.device_array((1, 64), np.float32)))
    with pytest.raises(ValueError, match="overlaps y"):
        call(good._replace(h=y))
    with pytest.raises(TypeError, match="norm.counter"):
        call(good._replace(counter=np.zeros(1, np.int32)))
    with pytest.raises(ValueError, match="norm.counter"):
        call(good._replace(counter=cuda.to_device(np.zeros(2, np.int32))))
    with pytest.raises(ValueError, match="norm.counter"):
        call(good._replace(counter=cuda.to_device(np.zeros(1, np.int64))))
    with pytest.raises(ValueError, match="norm.block"):
        call(good._replace(block=48))
    with pytest.raises(ValueError, match="one token"):
        x3 = cuda.to_device(np.ones((3, 256), np.float32))
        G.gemv(w, x3, cuda.device_array((3, 96), np.float32), xq=cuda.device_array((3, 256), np.int8),
               xs=cuda.device_array((3, 32), np.float32), residual=cuda.device_array((3, 96), np.float32),
               norm=good)
    w2, dx2, xq2, xs2, y2, wn2 = _problem(Q4, 100, 256, seed=9)       # 100 rows: not q8 blocks
    with pytest.raises(ValueError, match="multiple of 32"):
        y2d = cuda.to_device(y2)
        G.gemv(w2, dx2, y2d, xq=xq2, xs=xs2, residual=y2d, norm=good)
    with pytest.raises(ValueError, match="residual=True"):
        G.compile_gemv(w, norm=True)
    assert int(c.copy_to_host()[0]) == 0                               # nothing launched


# =====================================================================================
# GPU: Qwen3-4B's residual GEMVs, many launches in a row (the simulator runs a grid's
# blocks one after another, so only a GPU exercises the fence / count / last-block
# protocol with blocks in flight together)
# =====================================================================================
@pytest.mark.gpu
@pytest.mark.parametrize("qtype,cols", [(Q4, 4096), (Q6, 9728)], ids=["attn_output-Q4_K", "ffn_down-Q6_K"])
def test_gpu_fused_norm_at_qwen3_4b_shapes_bit_for_bit(qtype, cols):
    rows, reps = 2560, 50
    w, dx, xq, xs, y0, wn = _problem(qtype, rows, cols, seed=cols)
    dwn = cuda.to_device(wn)
    counter = cuda.to_device(np.zeros(1, np.int32))
    y_ref, y = cuda.to_device(y0), cuda.to_device(y0)
    rq, rs, rh = _outputs(rows)
    nq, ns, h = _outputs(rows)
    norm = G.GemvNorm(dwn, EPS, nq, ns, counter, h=h)
    for step in range(reps):
        G.gemv(w, dx, y_ref, xq=xq, xs=xs, residual=y_ref)
        N.rmsnorm_q8(y_ref, dwn, rq, rs, EPS, out=rh)
        G.gemv(w, dx, y, xq=xq, xs=xs, residual=y, norm=norm)
        if step % 10 == 9 or step < 3:
            for what, got, ref in (("y", y, y_ref), ("xq", nq, rq), ("xs", ns, rs), ("h", h, rh)):
                _bits_equal(got.copy_to_host(), ref.copy_to_host(), f"launch {step}: {what}")
            assert int(counter.copy_to_host()[0]) == 0, f"launch {step}: counter not reset"


def test_the_norm_fold_lab_validates_before_it_times(monkeypatch):
    """tools/norm_fold_lab.py (the GPU lab that times the fold's parts) checks the fused launch
    against gemv + rmsnorm_q8 first; here at small shapes, without timing."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    import norm_fold_lab
    assert norm_fold_lab.main(["--tiny", "--check"]) == 0
