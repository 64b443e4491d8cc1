"""The decode GEMVs' programmatic-dependent-launch builds (quant/pdl.py) against the plain ones,
under the simulator (griddepcontrol is a no-op there; pdl.launch is replaced by the plain launch,
since the launch itself needs an sm_90 GPU): the same bits, with the early trips' loads issued
before the wait (PDL_EARLY_TRIPS, and a k-split of 2), pinned there or not (PDL_PIN_WEIGHTS). The PTX
rules of these builds are tests/test_pdl_ptx.py, where ptxas puts their loads tests/test_pdl_sass.py; the helpers and bounds are test_gemv.py's.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import gemv as G
from test_gemv import Q4, Q6, activations, plain_launch, weight  # noqa: F401 (plain_launch: a fixture)


def test_pdl_builds_compute_the_same_bits(monkeypatch, plain_launch):
    """The programmatic-dependent-launch builds (quant/pdl.py: griddepcontrol waits, no-ops
    here) of gemv (residual), QKV and gate/up + SiLU give the plain builds' bits. The
    launch itself needs an sm_90 GPU: here pdl.launch is the plain launch (`plain_launch`)."""
    _, wq = weight(Q4, "dp4a", 37, 256, seed=1)
    _, wk = weight(Q4, "dp4a", 5, 256, seed=2)
    _, wv = weight(Q6, "dp4a", 9, 256, seed=3)
    x, dx, xq, xs = activations(1, 256)
    outs = {}
    for use in (False, True):
        monkeypatch.setattr(G, "PDL", use)
        y = cuda.to_device(np.ones((1, 37), np.float32))
        G.gemv(wq, dx, y, xq=xq, xs=xs, residual=y)
        qkv = cuda.device_array((1, 51), np.float32)
        G.gemv_qkv(wq, wk, wv, dx, qkv, xq=xq, xs=xs)
        h = cuda.device_array((1, 37), np.float32)
        G.gemv_swiglu(wq, wq, dx, h, xq=xq, xs=xs)
        outs[use] = [a.copy_to_host() for a in (y, qkv, h)]
    for a, b in zip(outs[False], outs[True]):
        np.testing.assert_array_equal(a, b)
    # the PDL build ran
    assert ("gemv", wq.spec, 1, 1, True, 32, True, G.PDL_EARLY_TRIPS, True, G.PDL_MAX_REGISTERS) in G._kernels


@pytest.mark.parametrize("qt", [Q4, Q6])
def test_pdl_early_trips_give_the_same_bits(monkeypatch, plain_launch, qt):
    """gemv.PDL_EARLY_TRIPS (gemv_kernels._make_row_dot EARLY): a PDL build of the residual GEMV
    with the first 1, 2 or 3 trips' loads issued before its wait multiplies the units in the
    same order - the plain build's bits - on ffn_down's row length (304 units: 3 early trips and
    a remainder), a row of one trip, and a row shorter than the warp (lanes with no unit)."""
    for cols, ks in ((9728, 1), (2560, 1), (256, 1), (9728, 2)):   # ks 2: profile_decode --settings ksplit
        _, w = weight(qt, "dp4a", 3, cols, seed=cols)
        x, dx, xq, xs = activations(1, cols)
        outs = []
        for use, early, pin in ((False, 1, True), (True, 1, True), (True, 2, True), (True, 3, True),
                                (True, 2, False)):
            monkeypatch.setattr(G, "PDL", use)
            monkeypatch.setattr(G, "PDL_EARLY_TRIPS", early)
            monkeypatch.setattr(G, "PDL_PIN_WEIGHTS", pin)
            monkeypatch.setattr(G, "PDL_EARLY_TRIPS_Q6K", None)      # Q6_K's trips as Q4_K's here
            y = cuda.to_device(np.ones((1, 3), np.float32))
            G.gemv(w, dx, y, xq=xq, xs=xs, residual=y, ksplit=ks)
            outs.append(y.copy_to_host())
            assert ("gemv", w.spec, 1, ks, True, 32, use, early if use else 1, pin,
                    G.PDL_MAX_REGISTERS if use else None) in G._kernels
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


def test_pinned_early_trips_by_format_and_lanes(monkeypatch, plain_launch):
    """gemv.PDL_PIN_WEIGHTS's early trips (gemv._early_trips): PDL_EARLY_TRIPS_Q6K for Q6_K where
    set, one for a 16-lane row (the output projection), and PDL_EARLY_TRIPS unpinned - each the
    plain build's bits on the output projection's shape of row (2,560 columns, 16 lanes)."""
    monkeypatch.setattr(G, "PDL_EARLY_TRIPS", 2)
    monkeypatch.setattr(G, "PDL_EARLY_TRIPS_Q6K", 1)
    assert G._early_trips(Q6, 32, True) == 1 and G._early_trips(Q4, 32, True) == 2
    assert G._early_trips(Q4, 16, True) == 1 and G._early_trips(Q6, 16, False) == 2
    _, w = weight(Q6, "dp4a", 37, 2560, seed=5)
    x, dx, xq, xs = activations(1, 2560)
    outs = []
    for use, pin in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(G, "PDL", use)
        monkeypatch.setattr(G, "PDL_PIN_WEIGHTS", pin)
        y = cuda.device_array((1, 37), np.float32)
        G.gemv(w, dx, y, xq=xq, xs=xs, lpr=16)
        outs.append(y.copy_to_host())
    assert ("gemv", w.spec, 1, 1, False, 16, True, 1, True, G.PDL_MAX_REGISTERS) in G._kernels
    assert ("gemv", w.spec, 1, 1, False, 16, True, 2, False, G.PDL_MAX_REGISTERS) in G._kernels
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
