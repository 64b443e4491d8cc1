"""The decode attention that ropes its own token (kvcache/attention_decode_rope.py,
kvcache/attention.py `decode_rope_attention`) against what it replaces: `rope_write` then
`decode_attention`. Both run rope_write's device code for the rows and the same attention
loop, so the output and the cache (K/V rows and int8 scales) must be the same bits:

- the loops (block, warp, warp-nopf, mma) and the PDL build (griddepcontrol is a no-op in the
  simulator; the PTX rules are tests/test_pdl_ptx.py), one split or several (the new row in
  the last split only), int8 and f16 caches;
- Qwen3's form (NeoX pairs, QK-norm), Llama's (adjacent pairs, no QK-norm, group 3), a ring
  layer with a window (Gemma 3's local layers) past its first lap, head_dim 256;
- three steps in a row (each reads the rows the steps before wrote);
- the PDL build never loads the new row before its wait (the new row is not written yet then);
- bad arguments are refused with the argument's name.
Simulator shapes: 2 warps, 2 rows a lane, 64 slots.
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import make_pool, make_ring_pool
from genie_rt.kvcache.attention import (DecodeWorkspace, decode_attention, decode_rope_attention,
                                        plan_decode)
from genie_rt.kvcache.rope_write import rope_table, rope_write

EPS = 1e-6


def _inputs(n_head, n_kv, hd, n_rope, seed):
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((1, (n_head + 2 * n_kv) * hd)) * 3).astype(np.float32)
    qn = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    kn = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    cos, sin = rope_table(n_rope, hd, 1e4)
    return [cuda.to_device(a) for a in (qkv, qn, kn, cos, sin)]


def _step(fused, pool, layer, inp, pos, plan, rope, qk_norm, pdl):
    qkv, qn, kn, cos, sin = inp
    qn, kn = (qn, kn) if qk_norm else (None, None)
    ws = DecodeWorkspace(plan)
    state = cuda.to_device(np.array([pos], np.int32))
    out = cuda.device_array(plan.n_head * plan.head_dim, np.float32)
    if fused:
        decode_rope_attention(qkv, qn, kn, EPS, cos, sin, pool.layer(layer), state, out, ws, plan=plan,
                              rope=rope, pdl=pdl)
    else:
        q = cuda.device_array((1, plan.n_head, plan.head_dim), np.float32)
        rope_write(qkv, qn, kn, EPS, cos, sin, state, q, pool.layer(layer), rope=rope)
        decode_attention(q, pool.layer(layer), state, out, ws, plan=plan, pdl=pdl)
    cuda.synchronize()
    return out.copy_to_host()


def _check_same(kv_dtype, positions, n_head, n_kv, hd, n_ctx, pdl, slots=None, rope="neox", qk_norm=True,
                **plan_kw):
    """Run the steps at `positions` both ways (rope_write + decode_attention, then the fused
    launch) on two identical pools of layer-1 rows filled to positions[0] (a ring of `slots`
    slots, or not): every output and the layer's cache must be the same bits."""
    results = []
    for fused in (False, True):
        if slots:
            pool = make_ring_pool(n_kv, hd, n_ctx, slots, kv_dtype, positions[0], seed=7, layers=2)[0]
        else:
            pool = make_pool(n_kv, hd, n_ctx, kv_dtype, positions[0], seed=7)[0]
        plan = plan_decode(n_head, n_kv, hd, kv_dtype, n_ctx, **plan_kw)
        outs = [_step(fused, pool, 1, _inputs(n_head, n_kv, hd, n_ctx, seed=p), p, plan, rope, qk_norm, pdl)
                for p in positions]
        results.append((outs, _layer_rows(pool)))
    (o0, c0), (o1, c1) = results
    for p, a, b in zip(positions, o0, o1):
        assert np.isfinite(a).all()
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), \
            f"position {p}: out differs by up to {np.abs(a - b).max():.3g}"
    for name in c0:
        assert np.array_equal(c0[name], c1[name]), f"cache {name} differs"


def _same(kv_dtype, positions, n_splits, loop, pdl=False, n_head=4, n_kv=2, hd=64, window=0,
          heads_per_block=None, n_ctx=64, **kw):
    """_check_same at simulator sizes: 2 warps, 2 rows a lane, n_splits splits."""
    _check_same(kv_dtype, positions, n_head, n_kv, hd, n_ctx, pdl, n_splits=n_splits, warps=2,
                rows_per_thread=2, loop=loop, window=window or None, heads_per_block=heads_per_block, **kw)


def _layer_rows(pool):
    lay = pool.layer(1)
    return {"k": lay.k.copy_to_host(), "v": lay.v.copy_to_host(), "k_scale": lay.k_scale.copy_to_host(),
            "v_scale": lay.v_scale.copy_to_host()}


@pytest.mark.parametrize("kv_dtype,pos,n_splits,loop,pdl", [
    ("int8", 5, 1, "warp", False), ("int8", 37, 3, "warp", True), ("int8", 16, 2, "warp", True),
    ("f16", 50, 3, "block", False), ("int8", 20, 2, "warp-nopf", False), ("f16", 0, 1, "warp", True),
    ("int8", 63, 4, "block", True), ("int8", 37, 3, "mma", True), ("int8", 9, 1, "mma", False)])
def test_fused_rope_gives_rope_write_then_attention_bits(kv_dtype, pos, n_splits, loop, pdl):
    _same(kv_dtype, [pos], n_splits, loop, pdl)


@pytest.mark.parametrize("loop", ["warp", "block"])
def test_fused_rope_llama_normal_pairs_without_qk_norm_group_3(loop):
    _same("int8", [29], 2, loop, n_head=6, n_kv=2, rope="normal", qk_norm=False)


def test_fused_rope_steps_read_the_rows_the_steps_before_wrote():
    _same("int8", [70, 71, 72], 3, "warp", pdl=True, n_ctx=128)   # tiles of 32 rows: three active splits


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_fused_rope_ring_layer_past_its_first_lap(kv_dtype):
    # a ring of 24 slots with a window of 16: positions 40, 41 live in slots 16, 17
    _same(kv_dtype, [40, 41], 2, "warp", pdl=True, window=16, slots=24)


@pytest.mark.parametrize("kv_dtype,loop", [("int8", "warp"), ("f16", "block"), ("int8", "mma")])
def test_fused_rope_ring_window_over_several_splits_and_subgroups(kv_dtype, loop):
    # a window of 40 over a ring of 48 slots at positions 100, 101: two or more active splits
    # (tiles of 16 / 32 rows), 4 query heads a KV head in 4 subgroups (every block of the last
    # split writes the same new row)
    _same(kv_dtype, [100, 101], 4, loop, pdl=True, n_head=8, n_kv=2, window=40, slots=48, n_ctx=128,
          heads_per_block=1)


def test_fused_rope_head_dim_256_one_kv_head():
    _same("f16", [9], 1, "warp", n_head=4, n_kv=1, hd=256, heads_per_block=4)


def test_fused_rope_pdl_build_reads_the_new_row_only_after_its_wait(monkeypatch):
    from test_attention_decode import _Watch
    import genie_rt.kvcache.attention_decode_kernels as ADK
    w = _Watch()
    no_op = lambda: None   # noqa: E731
    monkeypatch.setattr(ADK, "hooks", lambda pdl: (w.wait, no_op, w.ld4) if pdl else (no_op, no_op, w.ld4))
    ADK.decode_kernel.cache_clear()
    try:
        pos = 9                              # the first trip of the only split holds the new row
        pool = make_pool(2, 64, 64, "int8", 64, seed=3)[0]
        w.slot, w.words = pos, 2 * 64 // 4
        plan = plan_decode(4, 2, 64, "int8", 64, n_splits=1, warps=2, rows_per_thread=2, loop="warp")
        _step(True, pool, 0, _inputs(4, 2, 64, 64, seed=1), pos, plan, "neox", True, True)
        assert not w.early, f"{len(w.early)} loads of the new row before the wait"
    finally:
        ADK.decode_kernel.cache_clear()


def test_fused_rope_pdl_build_loads_the_new_row_again_after_its_wait(monkeypatch):
    # the block that writes the new K/V row (the second split here) loads its first trip again
    # after its wait, so the row it wrote is read from the cache (a shared-memory stash of the
    # row instead was measured no faster on the H200, 2026-12-05, and removed); rope_write-then-
    # attention's bits
    from test_attention_decode import _Watch
    import genie_rt.kvcache.attention_decode_kernels as ADK
    pos = 41                                 # tiles of 32 rows: the new row in the 2nd split's 1st trip
    _same("int8", [pos], 3, "warp", pdl=True)
    w = _Watch()
    no_op = lambda: None   # noqa: E731
    monkeypatch.setattr(ADK, "hooks", lambda pdl: (w.wait, no_op, w.ld4) if pdl else (no_op, no_op, w.ld4))
    ADK.decode_kernel.cache_clear()
    try:
        pool = make_pool(2, 64, 64, "int8", pos, seed=7)[0]
        w.slot, w.words = pos, 2 * 64 // 4
        plan = plan_decode(4, 2, 64, "int8", 64, n_splits=3, warps=2, rows_per_thread=2, loop="warp")
        _step(True, pool, 1, _inputs(4, 2, 64, 64, seed=pos), pos, plan, "neox", True, True)
        assert not w.early
        assert w.late, "the new row was not loaded after the wait"
    finally:
        ADK.decode_kernel.cache_clear()


def test_fused_rope_with_the_q8_output():
    # decode_attention's q8 output (EngineConfig.decode_attention_q8) from the fused launch too
    pool0 = make_pool(2, 64, 64, "int8", 30, seed=7)[0]
    pool1 = make_pool(2, 64, 64, "int8", 30, seed=7)[0]
    plan = plan_decode(4, 2, 64, "int8", 64, n_splits=2, warps=2, rows_per_thread=2)
    qkv, qn, kn, cos, sin = _inputs(4, 2, 64, 64, seed=30)
    state = cuda.to_device(np.array([30], np.int32))
    got = []
    for fused, pool in ((False, pool0), (True, pool1)):
        out = cuda.device_array(256, np.float32)
        xq, xs = cuda.device_array(256, np.int8), cuda.device_array(32, np.float32)
        if fused:
            decode_rope_attention(qkv, qn, kn, EPS, cos, sin, pool.layer(0), state, out, DecodeWorkspace(plan),
                                  xq=xq, xs=xs)
        else:
            q = cuda.device_array((1, 4, 64), np.float32)
            rope_write(qkv, qn, kn, EPS, cos, sin, state, q, pool.layer(0))
            decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(plan), xq=xq, xs=xs)
        got.append([a.copy_to_host() for a in (out, xq, xs)])
    for a, b in zip(*got):
        assert np.array_equal(a, b)
    assert got[0][1].any()


def test_decode_rope_attention_rejects_bad_arguments():
    pool = make_pool(2, 64, 64, "int8", 8)[0]
    plan = plan_decode(4, 2, 64, "int8", 64, n_splits=1, warps=2, rows_per_thread=2)
    qkv, qn, kn, cos, sin = _inputs(4, 2, 64, 64, seed=0)
    state = cuda.to_device(np.array([3], np.int32))
    out = cuda.device_array(4 * 64, np.float32)
    ws = DecodeWorkspace(plan)
    ok = dict(q_norm=qn, k_norm=kn, eps=EPS, cos=cos, sin=sin, layer=pool.layer(0), state=state, out=out,
              ws=ws)
    for bad, match in ((dict(qkv=cuda.device_array((1, 10), np.float32)), "qkv must be"),
                       (dict(k_norm=None), "both q_norm and k_norm"),
                       (dict(cos=cuda.device_array((64, 16), np.float32)), "cos/sin"),
                       (dict(rope="yarn"), "rope must be")):
        kw = {**ok, "qkv": qkv, **bad}
        rope = kw.pop("rope", "neox")
        with pytest.raises(ValueError, match=match):
            decode_rope_attention(kw["qkv"], kw["q_norm"], kw["k_norm"], kw["eps"], kw["cos"], kw["sin"],
                                  kw["layer"], kw["state"], kw["out"], kw["ws"], rope=rope)


# ---- GPU: the real shapes, the plan the engine makes ---------------------------------------------
def _gpu_same(kv_dtype, positions, n_head, n_kv, hd, n_ctx, pdl, window=0, **kw):
    """_check_same with the plan the engine makes (default warps, rows, splits for the SMs)."""
    _check_same(kv_dtype, positions, n_head, n_kv, hd, n_ctx, pdl, window=window or None, **kw)


def _pdl_cases():
    from genie_rt.quant import pdl
    return (False, True) if pdl.available() else (False,)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("positions", [[0, 1], [511, 512], [4094, 4095]])
def test_gpu_fused_rope_qwen3_4b_shape(kv_dtype, positions):
    for pdl in _pdl_cases():
        _gpu_same(kv_dtype, positions, 32, 8, 128, 4096, pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_gpu_fused_rope_gemma3_ring_and_smollm2(kv_dtype):
    for pdl in _pdl_cases():
        _gpu_same(kv_dtype, [2000, 2001], 4, 1, 256, 4096, pdl, window=512, slots=1023)
        _gpu_same(kv_dtype, [300, 301], 9, 3, 64, 2048, pdl, rope="normal", qk_norm=False)


def test_fused_rope_with_qk8_gives_rope_write_then_attention_bits(monkeypatch):
    # QK_DP4A (q quantized a lane slice at a time, scores by dp4a) in both launches: the same bits
    import genie_rt.kvcache.attention as A
    monkeypatch.setattr(A, "QK_DP4A", True)
    _same("int8", [37], 3, "warp", pdl=True)
