"""The prefill's programmatic-dependent-launch builds (EngineConfig.prefill_pdl; quant/mmq.py
`mmq(pdl=True)`, `prepare_x(pdl=True)`, kvcache/attention_merge.py `merge_prepare_x(pdl=True)`).

The GEMM's PDL build copies its prologue stages' weights (constants) before
`griddepcontrol.wait` and X (prepare_x's output) after it; the input conversions before it
execute `griddepcontrol.launch_dependents` first, so it launches while they run (prepare_x's
build is itself launched early and waits before it reads x). Checked:
- PTX for sm_90 (no GPU needed): the trigger first, then the wait; before the wait only the
  weights' cp.async copies (and Q6_K's fp16 d loads), as many as the geometry says; no
  non-coherent load anywhere; the plain builds carry no griddepcontrol;
- the simulator: the PDL build copies no X before its wait (a stand-in wait marks the thread)
  and gives the plain build's bits; the engine asks for these builds when prefill_pdl is on;
- a GPU (marker gpu, sm_90+): the prefill graph's residual stream with and without, replay
  after replay, including a start deep enough to split the attention (the merge's build).
"""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import mmq
from genie_rt.quant import mmq_defs as D
from genie_rt.quant import mmq_kernels as K
from genie_rt.quant import mmq_kquants as Q
from genie_rt.quant import mmq_plan as MP
from genie_rt.quant import mmq_reference as MR
from ptx_helpers import compile_in_subprocess, local_memory_bytes

SIM = K.SIMULATOR

_SOURCE = """
from genie_rt.kvcache.attention_merge import merge_prepare_x_kernel_for
from genie_rt.quant import mmq_kquants as Q
from genie_rt.quant.mmq_defs import EPI_ADD, EPI_STORE, RED_KERNEL, RED_LAST
from genie_rt.quant.mmq_kernels import build_mmq_kernel
from genie_rt.quant.mmq_prep import prepare_x_kernel_for
q4k_pdl = build_mmq_kernel(Q.Q4_K, 4, 1, 2, 2, 2, EPI_STORE, RED_KERNEL, pdl=True)   # small_config(16)
q4k_plain = build_mmq_kernel(Q.Q4_K, 4, 1, 2, 2, 2, EPI_STORE, RED_KERNEL)
q6k_pdl = build_mmq_kernel(Q.Q6_K, 4, 1, 2, 2, 2, EPI_ADD, RED_LAST, pdl=True)       # ffn_down, residual
q4k_pdl_s3 = build_mmq_kernel(Q.Q4_K, 4, 2, 2, 8, 3, EPI_STORE, RED_LAST, pdl=True)  # LARGE: 2 prologue stages
prep_pdl = prepare_x_kernel_for(2560, True)
prep_plain = prepare_x_kernel_for(2560)
merge_pdl = merge_prepare_x_kernel_for(True)
from genie_rt.quant.mmq_reduce import build_reduce_kernel
reduce_pdl = build_reduce_kernel(EPI_ADD, True)
"""
_CP = re.compile(r"cp\.async\.c[ag]\.shared\.global")
_LD = re.compile(r"^\s*(@%p\d+\s+)?ld\.global\.(\S+)", re.M)
# (name, format, block rows, threads, prologue stages)
_MMQ = (("q4k_pdl", Q.Q4_K, 128, 128, 1), ("q6k_pdl", Q.Q6_K, 128, 128, 1), ("q4k_pdl_s3", Q.Q4_K, 128, 256, 2))


@pytest.fixture(scope="module")
def ptx():
    from genie_rt.kvcache.attention_merge import MERGE_PREPARE_SIGNATURE
    sig4, sig6 = mmq.kernel_signature(Q.Q4_K), mmq.kernel_signature(Q.Q6_K)
    return compile_in_subprocess(_SOURCE, {
        "q4k_pdl": sig4, "q4k_plain": sig4, "q6k_pdl": sig6, "q4k_pdl_s3": sig4,
        "prep_pdl": mmq.PREPARE_X_SIGNATURE, "prep_plain": mmq.PREPARE_X_SIGNATURE,
        "merge_pdl": MERGE_PREPARE_SIGNATURE, "reduce_pdl": mmq.REDUCE_SIGNATURE}, ccs=((9, 0),))


@pytest.mark.parametrize("name,fmt,rows,threads,prologue", _MMQ, ids=[m[0] for m in _MMQ])
def test_mmq_pdl_build_copies_only_weights_before_its_wait(ptx, name, fmt, rows, threads, prologue):
    text = ptx[name][(9, 0)]
    assert local_memory_bytes(text) == 0, f"{name}: local memory used"
    trigger, wait = text.find("griddepcontrol.launch_dependents;"), text.find("griddepcontrol.wait;")
    assert 0 <= trigger < wait, f"{name}: launch_dependents must come first, then the wait"
    assert text.count("griddepcontrol.wait;") == 1, name
    # a stage's raw weight bytes: RAW_CHUNKS 16-byte chunks a row, spread over the block's threads
    # (a whole number a thread: the copies unroll, so the PTX holds each; else a loop's)
    copies = len(_CP.findall(text[:wait]))
    per_thread = rows * D.RAW_CHUNKS[fmt] / threads
    if per_thread == int(per_thread) and prologue == 1:
        assert copies == per_thread, f"{name}: {copies} cp.async copies before the wait"
    assert copies > 0, f"{name}: no weights copied before the wait"
    loads = [m.group(2) for m in _LD.finditer(text[:wait])]
    # Q6_K: the fp16 d of the block's rows (a constant plane), nothing else; Q4_K: nothing
    assert all(t == "u16" for t in loads) and (fmt == Q.Q6_K or not loads), (name, loads)
    assert len(_CP.findall(text[wait:])) > 0, f"{name}: X is copied after the wait"
    assert "ld.global.nc" not in text, f"{name}: a non-coherent load (pdl.py rule 3)"


def test_mmq_plain_build_is_unchanged_by_the_split_loader(ptx):
    plain, pdl = ptx["q4k_plain"][(9, 0)], ptx["q4k_pdl"][(9, 0)]
    assert "griddepcontrol" not in plain
    assert len(_CP.findall(plain)) == len(_CP.findall(pdl)), "the same copies, in another order"


@pytest.mark.parametrize("name", ["prep_pdl", "reduce_pdl"])
def test_prepare_x_and_reduce_pdl_builds_trigger_then_wait_before_reading(ptx, name):
    text = ptx[name][(9, 0)]
    trigger, wait = text.find("griddepcontrol.launch_dependents;"), text.find("griddepcontrol.wait;")
    assert 0 <= trigger < wait, name
    assert not _LD.findall(text[:wait]), f"{name}: a global load before the wait"
    assert _LD.findall(text[wait:]) and "ld.global.nc" not in text, name
    assert "griddepcontrol" not in ptx["prep_plain"][(9, 0)]


def test_merge_pdl_build_lets_the_gemm_launch_and_is_itself_launched_plainly(ptx):
    # (its predecessor, the prefill attention, is a plain build: nothing to overlap it with)
    text = ptx["merge_pdl"][(9, 0)]
    assert "griddepcontrol.launch_dependents;" in text and "griddepcontrol.wait" not in text


# ---- simulator (or a device) ------------------------------------------------------------
class _Watch:
    """Stand-ins for the GEMM's PDL hooks under the simulator (each simulated thread is a Python
    thread): `wait` marks the thread as past its wait; cp.async copies from an fp16 source (X:
    the weight planes are bytes) by a thread that has not waited are recorded."""
    def __init__(self):
        import threading
        from genie_rt.quant import ptx as X
        self.local, self.early, self.x_copies = threading.local(), [], []
        real = X.cp_async16_zfill
        watch = self

        def wait():
            watch.local.waited = True

        def copy(dst, di, src, si, nbytes):
            if src.dtype == np.float16:
                (watch.x_copies if getattr(watch.local, "waited", False) else watch.early).append(si)
            real(dst, di, src, si, nbytes)
        self.wait, self.copy = wait, copy


CASES = [  # qtype, rows, cols, N, mode, config, splits, reduce
    ("Q4_K", 40, 512, 9, "store", None, 2, "kernel"),
    ("Q6_K", 24, 256, 7, "add", None, 1, None),
    ("Q4_K", 48, 512, 5, "swiglu", MP.TileConfig(wm=1, wn=1, mt=2, nt=1, stages=3), 2, "last"),
]


@pytest.mark.skipif(not SIM, reason="simulator test (stand-in hooks); a GPU runs test_gpu_prefill_pdl_same_bits")
@pytest.mark.parametrize("qtype,rows,cols,n,mode,config,splits,reduce", CASES,
                         ids=[f"{c[0]}-{c[4]}-s{c[6]}" for c in CASES])
def test_mmq_pdl_build_copies_x_only_after_its_wait_and_gives_the_plain_bits(
        monkeypatch, qtype, rows, cols, n, mode, config, splits, reduce):
    from test_mmq import host_x16, to_device
    w = MR.random_weight(qtype, rows, cols, np.random.default_rng(rows + n))
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    rows_out = rows // 2 if mode in MP.GATED else rows
    y0 = np.random.default_rng(7).standard_normal((n, rows_out)).astype(np.float32)
    h16, hs = host_x16(x)
    wd, x16, xs = to_device(w), cuda.to_device(h16), cuda.to_device(hs)
    p = MP.plan(w.qtype, rows_out, cols, n, mode, config, splits, reduce=reduce)
    ws = cuda.to_device(np.zeros(max(p.workspace, 16), np.uint8))
    watch = _Watch()
    no_op = lambda: None   # noqa: E731
    monkeypatch.setattr(K, "hooks", lambda pdl: (watch.wait, no_op, None) if pdl else (no_op, no_op, None))
    monkeypatch.setattr(K, "cp_async16_zfill", watch.copy)
    monkeypatch.setattr(mmq, "_KERNELS", {})            # built again with the stand-ins
    out = {}
    for pdl in (False, True):
        y = cuda.to_device(y0.copy())
        mmq.mmq(wd, x16, xs, y, mode, workspace=ws, config=config, splits=splits, reduce=reduce, pdl=pdl)
        out[pdl] = y.copy_to_host()
        if not pdl:                                      # (the plain build never waits)
            watch.x_copies.clear()
            watch.early.clear()
            watch.local = type(watch.local)()            # fresh per-thread marks
    assert not watch.early, f"{len(watch.early)} copies of X before the wait"
    assert watch.x_copies, "the PDL build copied X after its wait"
    np.testing.assert_array_equal(out[True].view(np.int32), out[False].view(np.int32))
    assert (ws.copy_to_host()[:4 * p.counters].view(np.int32) == 0).all(), "split-K counters not reset"


def test_mmq_pdl_is_ignored_where_the_device_has_none(monkeypatch):
    """`pdl=True` on a device without programmatic dependent launch (sm_80 / sm_87: the Jetson) takes
    the plain build: the PDL one would not even compile there (quant/pdl.wanted, which mmq, prepare_x
    and merge_prepare_x ask)."""
    from genie_rt.quant import pdl
    monkeypatch.setattr(pdl.ptx, "SIMULATOR", False)
    monkeypatch.setattr(pdl, "available", lambda: False)
    assert pdl.wanted(True) is False
    monkeypatch.setattr(pdl, "available", lambda: True)
    assert pdl.wanted(True) is True and pdl.wanted(False) is False


def test_prefill_pdl_config_and_cli():
    """EngineConfig.prefill_pdl: off by default (a lab switch until measured faster); --prefill-pdl
    turns it on, --no-pdl turns every PDL path off; a non-bool is refused naming the field."""
    from test_cuda_ops_fusion import _cli_config
    from genie_rt.engine.config import EngineConfig
    assert EngineConfig().prefill_pdl is False
    with pytest.raises(ValueError, match="prefill_pdl"):
        EngineConfig(prefill_pdl=1)
    assert _cli_config([]).prefill_pdl is False
    assert _cli_config(["--prefill-pdl"]).prefill_pdl is True
    assert _cli_config(["--prefill-pdl", "--no-pdl"]).prefill_pdl is False


# ---- the engine -------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU: test_gpu_prefill_pdl_same_bits)")
def test_simulated_prefill_asks_for_the_pdl_builds(tmp_path, monkeypatch):
    """EngineConfig.prefill_pdl with the device's PDL pretended: every GEMM, every input
    conversion and rope_write of the prefill is asked for its PDL build, and the logits are the
    same bits."""
    import dataclasses

    from genie_rt.engine import cuda_ops
    from genie_rt.kvcache import attention_merge, rope_write
    from test_decode_switches import _tiny_decode_backends
    gpu, _, _ = _tiny_decode_backends(tmp_path, "int8", warm=False)
    seen = []

    def spy(mod, name):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: (seen.append((name, bool(k.get("pdl")))), real(*a, **k))[1])
    for mod, name in ((mmq, "mmq"), (mmq, "prepare_x"), (attention_merge, "merge_prepare_x"),
                      (rope_write, "rope_write")):
        spy(mod, name)
    monkeypatch.setattr(cuda_ops, "_pdl_available", lambda: True)
    tokens = np.arange(3, 15, dtype=np.int32)
    got = {}
    for on in (False, True):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, prefill_pdl=on)
        for key in [k for k in gpu._graphs if k[0] == "prefill"]:
            gpu._graphs.pop(key).close()
        seen.clear()
        got[on] = gpu.prefill(tokens, 0)
        assert {"mmq", "prepare_x", "rope_write"} <= {n for n, _ in seen}, seen
        bad = [(n, p) for n, p in seen if p != on]
        assert not bad, (on, bad)
    np.testing.assert_array_equal(got[True].view(np.int32), got[False].view(np.int32))


REPLAYS = 5


@pytest.mark.gpu
def test_gpu_prefill_pdl_same_bits(tmp_path):
    """The prefill graphs with EngineConfig.prefill_pdl on give the plain graphs' logits bit for
    bit, replay after replay: a 40-token prompt from 0, 16 tokens after 600 (the attention splits
    its keys there, so the merge + prepare_x build runs too) and 300 from 0 (the large tiles, more
    than 48 KB of dynamic shared memory)."""
    import dataclasses

    from genie_rt.quant import pdl
    from synth_gguf import write_synthetic_qwen3
    from test_backend_cuda import make_backends
    if not pdl.available():
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    path = tmp_path / "synth.gguf"
    write_synthetic_qwen3(path, dict(layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                                     vocab=4122, text_tokens=4096), seed=0)
    gpu, _, _ = make_backends(path, "int8", n_ctx=1024)
    rng = np.random.default_rng(3)
    prefix, short, more, long = (rng.integers(0, 4096, k).astype(np.int32) for k in (600, 40, 16, 300))
    gpu.prefill(prefix, 0)
    assert max(gpu._splits(16, 600)) > 1, "the chunk at 600 should split its attention"
    gpu.prefill(long, 0)                                # the cache as every run below leaves it
    got = {}
    for on in (False, True, False, True):
        gpu.ecfg = dataclasses.replace(gpu.ecfg, prefill_pdl=on)
        for key in [k for k in gpu._graphs if k[0] == "prefill"]:
            gpu._graphs.pop(key).close()                 # captured again with this setting
        # every run leaves the cache as the one before: 0-39 short, 40-299 long, 300-599 the prefix
        # (the order matters - `more` attends to positions 0-615; run 0 of the first round used to
        # see the prefix at 40-299 and every later run `long`)
        runs = []
        for _ in range(REPLAYS):
            b = gpu.prefill(long, 0)
            a = gpu.prefill(short, 0)
            runs.append((a, gpu.prefill(more, 600), b))
        got.setdefault(on, []).extend(runs)
    ref = got[False][0]
    for on, runs in got.items():
        for k, run in enumerate(runs):
            for got_, ref_, what in zip(run, ref, ("40 at 0", "16 at 600", "300 at 0")):
                np.testing.assert_array_equal(got_.view(np.int32), ref_.view(np.int32),
                                              err_msg=f"pdl={on} run {k}, {what}")
