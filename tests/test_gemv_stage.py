"""The residual GEMV with its rows staged in shared memory by cp.async (quant/gemv_stage.py):
the same bits as the plain kernel (simulator), the launcher's choice of kernel, and the PTX's
order (copies before the PDL wait, the copy wait and the shared-memory reads after it).

The simulator runs cp.async as an immediate copy, so a missing wait cannot fail there: the PTX
test checks that the wait is in its place.
"""
import re

import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from genie_rt.quant import gemv_stage as S
from genie_rt.quant.formats import QType
from genie_rt.quant.gemv_bench import random_weight
from ptx_helpers import assert_no_f64, compile_in_subprocess, local_memory_bytes

Q4, Q6 = QType.Q4_K, QType.Q6_K


def weight(qtype, rows, cols, seed=0):
    hw = random_weight(qtype, rows, cols, np.random.default_rng(seed))
    return G.prepare_weight(G.to_device(hw), "dp4a")


def activations(n_tok, cols, seed=1):
    x = np.random.default_rng(seed).standard_normal((n_tok, cols)).astype(np.float32)
    dx = cuda.to_device(x)
    xq = cuda.device_array((n_tok, cols), np.int8)
    xs = cuda.device_array((n_tok, cols // 8), np.float32)
    G.quantize_q8(dx, xq, xs)
    return dx, xq, xs


def run(monkeypatch, w, dx, xq, xs, n_tok, stage, pdl, resid):
    monkeypatch.setattr(G, "GEMV_STAGE", stage)
    monkeypatch.setattr(G, "PDL", pdl)
    y = cuda.to_device(np.linspace(-1, 1, n_tok * w.rows, dtype=np.float32).reshape(n_tok, w.rows))
    G.gemv(w, dx, y, xq=xq, xs=xs, residual=y if resid else None, ksplit=1, lpr=32)
    return y.copy_to_host()


@pytest.mark.parametrize("qt", [Q4, Q6])
def test_staged_rows_give_the_plain_bits(monkeypatch, qt):
    """ffn_down's row (304 units: ten a lane, some lanes nine), attn_output's (128: four a lane),
    a row of one block (8 units: most lanes idle); 5 rows (the second block's last three warps
    have no row); residual in place and not; two tokens; with and without the PDL build."""
    for cols, n_tok, resid in ((9728, 1, True), (4096, 2, False), (256, 1, True)):
        w = weight(qt, 5, cols, seed=cols)
        dx, xq, xs = activations(n_tok, cols)
        ref = run(monkeypatch, w, dx, xq, xs, n_tok, False, False, resid)
        for pdl in (False, True):
            got = run(monkeypatch, w, dx, xq, xs, n_tok, True, pdl, resid)
            np.testing.assert_array_equal(got, ref, err_msg=f"{qt.name} cols {cols} pdl {pdl}")
            assert ("gemv_stage", qt, n_tok, resid, pdl) in G._kernels


def test_stageable():
    assert S.stageable(Q4, "dp4a", 1, 1, 32, 304) and S.stageable(Q6, "dp4a", 1, 1, 32, 304)
    assert S.stage_bytes(Q4, 304) == 4 * 5472 and S.stage_bytes(Q6, 304) == 4 * 7904   # decode-step.md 7
    assert not S.stageable(Q4, "f32", 1, 1, 32, 304)           # the f32 mode
    assert not S.stageable(Q4, "dp4a", 1, 2, 32, 304)          # a k-split
    assert not S.stageable(Q4, "dp4a", 1, 1, 16, 80)           # two rows a warp
    assert not S.stageable(QType.Q8_0, "dp4a", 1, 1, 32, 304)  # a format without a staged loader
    assert not S.stageable(Q6, "dp4a", 1, 1, 32, 8 * 60)       # 60 blocks of Q6_K: 49,920 B > 48 KB
    assert S.stageable(Q6, "dp4a", 1, 1, 32, 8 * 59)


def test_unstageable_gemv_keeps_the_plain_kernel(monkeypatch):
    """A GEMV the staged kernel does not run (here: the f32 mode) takes the plain one with the
    knob on, and gives its result."""
    hw = random_weight(Q4, 3, 512, np.random.default_rng(3))
    w = G.prepare_weight(G.to_device(hw), "f32")
    dx, xq, xs = activations(1, 512)
    monkeypatch.setattr(G, "GEMV_STAGE", True)
    before = {k for k in G._kernels if k[0] == "gemv_stage"}
    y = cuda.device_array((1, 3), np.float32)
    G.gemv(w, dx, y, ksplit=1, lpr=32)
    ref = G.gemv_reference(G.dequantize_weight(hw), dx.copy_to_host())
    np.testing.assert_allclose(y.copy_to_host(), ref, rtol=1e-4, atol=1e-4)
    assert {k for k in G._kernels if k[0] == "gemv_stage"} == before


@pytest.mark.gpu
@pytest.mark.parametrize("qt,cols", [(Q4, 9728), (Q6, 9728), (Q4, 4096)])
def test_gpu_staged_rows_give_the_plain_bits(monkeypatch, qt, cols):
    """The 4B's ffn_down (both formats) and attn_output on the device: quantize_q8 writes x's q8
    and the GEMV reads it right after, ten times on one stream, with and without the PDL builds
    (the staged kernel's copies then overlap quantize_q8, and its reads of x wait for it) - the
    plain kernel's bits every time. Here the copies are asynchronous, unlike in the simulator."""
    from genie_rt.quant import pdl
    w = weight(qt, 2560, cols, seed=cols)
    x = np.random.default_rng(cols).standard_normal((10, 1, cols)).astype(np.float32)
    dx = [cuda.to_device(v) for v in x]
    xq = cuda.device_array((1, cols), np.int8)
    xs = cuda.device_array((1, cols // 8), np.float32)
    stream = cuda.stream()
    outs = {}
    for stage, use in ((False, False), (True, False)) + (((False, True), (True, True)) if pdl.available() else ()):
        monkeypatch.setattr(G, "GEMV_STAGE", stage)
        y = cuda.to_device(np.ones((1, 2560), np.float32), stream=stream)
        got = []
        for v in dx:
            G.quantize_q8(v, xq, xs, stream=stream, pdl=use)
            G.gemv(w, v, y, xq=xq, xs=xs, residual=y, stream=stream, ksplit=1, lpr=32, pdl=use)
            got.append(y.copy_to_host(stream=stream))
        stream.synchronize()
        outs[(stage, use)] = np.stack(got)
    ref = outs[(False, False)]
    for k, v in outs.items():
        np.testing.assert_array_equal(v, ref, err_msg=str(k))
    assert ("gemv_stage", qt, 1, True, False) in G._kernels


_SOURCE = """
from genie_rt.quant import gemv_stage as S
from genie_rt.quant.formats import QType as Q
q4k_pdl = S.gemv_stage_kernel(Q.Q4_K, 1, True, True)
q6k_pdl = S.gemv_stage_kernel(Q.Q6_K, 1, True, True)
q4k_plain = S.gemv_stage_kernel(Q.Q4_K, 1, True, False)
"""


@pytest.fixture(scope="module")
def ptx():
    return compile_in_subprocess(_SOURCE, {k: G.SIG_GEMV for k in ("q4k_pdl", "q6k_pdl", "q4k_plain")},
                                 ccs=((9, 0), (8, 7)))


@pytest.mark.parametrize("name", ["q4k_pdl", "q6k_pdl"])
def test_copies_go_out_before_the_wait_and_are_read_after_it(ptx, name):
    text = ptx[name][(9, 0)]
    assert_no_f64(text, name)
    assert local_memory_bytes(text) == 0
    trigger = text.find("griddepcontrol.launch_dependents;")
    wait = text.find("griddepcontrol.wait;")
    copy_wait = text.find("cp.async.wait_all;")
    assert 0 <= trigger < wait < copy_wait, "trigger, then the PDL wait, then the copies' wait"
    copies = [m.start() for m in re.finditer(r"cp\.async\.cg\.shared\.global", text)]
    assert copies and max(copies) < wait, "every cp.async before the PDL wait"
    assert not re.search(r"ld\.global", text[:wait]), "nothing but copies before the wait"
    reads = [m.start() for m in re.finditer(r"ld\.shared\.v4\.u32", text)]
    assert reads and min(reads) > copy_wait, "shared memory read only after the copies landed"
    # x (written by the kernel before) coherently; the weights never by a load of their own but d
    assert "ld.global.nc.v4" not in text


def test_plain_build_is_for_sm80_plus(ptx):
    for cc in ((9, 0), (8, 7)):
        text = ptx["q4k_plain"][cc]
        assert "griddepcontrol" not in text and "cp.async.cg.shared.global" in text
