"""kvcache/attention_decode_mma.py: the tensor-core decode loop ("mma") under the simulator.

The simulator's mma is numpy on the PTX fragment layouts (quant/ptx_fallbacks.py), so these
tests check the loop's lane bookkeeping - which lane holds which row, dimension and head in
each fragment, the P transfer between them, the byte tricks - against the float64 reference.
Its numbers are not the FMA loops' (P' is rounded to f16; q is two f16 parts): the tolerance
is MMA_TOL, ten times the FMA loops', and a test below shows a one-part q would miss it.
The PTX side (it compiles for sm_80 and sm_90, without spills) is in test_attention_ptx.py.
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import assert_close, byte_perm, make_pool, make_ring_pool, run_decode, run_decode_w
from genie_rt.kvcache.attention import DecodeWorkspace, decode_attention, plan_decode
from genie_rt.kvcache import attention_decode_mma as M
from genie_rt.quant.ptx import SIMULATOR as SIM, hfma2_reference

MMA_TOL = (2e-4, 1e-4)          # (atol / max |v|, rtol); measured 0.5-0.8e-4 of max |v|


@pytest.mark.parametrize("hd,n_head,n_kv,pos,n_splits,chunks", [
    (64, 8, 2, 0, 1, 1),          # one valid row
    (64, 8, 2, 40, 1, 1),         # group 4, one split, rows past the context in the last chunk
    (64, 8, 2, 63, 3, 1),         # three splits merged
    (128, 8, 2, 50, 2, 2),        # Qwen3's head_dim, two chunks a trip
    (32, 16, 2, 33, 2, 1),        # group 8: every column of the mma's n
    (64, 2, 2, 20, 2, 1),         # group 1: seven zero columns
    (64, 6, 2, 29, 2, 1),         # group 3: a head pair split between lanes
])
def test_mma_decode_matches_reference(hd, n_head, n_kv, pos, n_splits, chunks):
    pool, kd, vd = make_pool(n_kv, hd, 64, "int8", 64, seed=pos + hd)
    plan = run_decode(pool, kd, vd, n_head, pos, n_splits=n_splits, warps=2, rows_per_thread=chunks,
                      loop="mma", tol=MMA_TOL)
    assert plan.loop == "mma" and plan.n_sub == 1 and plan.tile == 32 * chunks


@pytest.mark.parametrize("pos,n_splits", [(70, 2), (95, 3)])
def test_mma_decode_with_a_warp_count_not_a_power_of_two(pos, n_splits):
    """3 warps a block (48-row tiles; plan_decode takes any warp count, and 12 were timed for the 4B on
    2026-12-07): the warps' chunks, the cross-warp sums and the merge do not assume a power of two.
    pos 95: the last tile is whole, 70: it ends mid-chunk."""
    pool, kd, vd = make_pool(2, 64, 128, "int8", 128, seed=pos)
    plan = run_decode(pool, kd, vd, 8, pos, n_splits=n_splits, warps=3, rows_per_thread=1, loop="mma",
                      tol=MMA_TOL)
    assert plan.tile == 48 and plan.n_splits == n_splits


@pytest.mark.parametrize("even", [True, False])
def test_mma_decode_splits_by_chunks_or_by_tiles(monkeypatch, even):
    """MMA_EVEN_SPLITS (the default): 4 splits of 2-warp blocks (32-row tiles) at 97 keys cut 7
    chunks of 16 rows 1 / 2 / 2 / 2 - every split busy; by whole tiles (4 tiles, one a split) the
    same 4. At 65 keys (5 chunks, 3 tiles) the chunks give 4 busy splits and the tiles 3. Either
    way the result is the reference's."""
    from genie_rt.kvcache import attention as A
    monkeypatch.setattr(A, "MMA_EVEN_SPLITS", even)
    pool, kd, vd = make_pool(2, 64, 128, "int8", 128, seed=3)
    for pos, busy in ((96, (4, 4)), (64, (4, 3))):
        run_decode(pool, kd, vd, 8, pos, n_splits=4, warps=2, rows_per_thread=1, loop="mma", tol=MMA_TOL)
        assert run_decode.splits_written == list(range(busy[0] if even else busy[1])), (pos, even)


@pytest.mark.parametrize("pos,n_splits,warps", [(45, 2, 2), (63, 1, 1)])
def test_mma_decode_pdl_build_gives_the_plain_bits(pos, n_splits, warps):
    # EARLY: the first trip's earlier rows before the wait, the trip with the new row again after
    # it; the plain build loads the first trip whole: the same arithmetic on the same rows. (63, 1,
    # 1): one warp's four trips, the new row in the last
    pool, kd, vd = make_pool(2, 64, 64, "int8", 64, seed=9)
    outs = []
    for pdl in (False, True):
        run_decode(pool, kd, vd, 8, pos, n_splits=n_splits, warps=warps, rows_per_thread=1, loop="mma",
                   tol=MMA_TOL, pdl=pdl)
        outs.append(run_decode.out)
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))


def test_mma_decode_window_through_a_ring():
    # ring of 12 slots, window 12, position 29: the oldest key lives in slot 6 and the window wraps
    pool, kd, vd = make_ring_pool(2, 32, 64, 12, "int8", 30, seed=30)
    run_decode_w(pool, kd, vd, 8, 29, 12, n_splits=2, warps=1, rows_per_thread=1, loop="mma",
                 tol=MMA_TOL)


@pytest.mark.parametrize("dc", [0, 50, 100])
def test_mma_decode_q_far_from_zero_mean(dc):
    # q with a large offset on every dimension (K rows of zero mean, so the scores stay moderate):
    # the scores' error must follow the scores, not sum(q). K converted as 1152 + b with 1152 *
    # sum(q) taken off after the mma (the first version) was off by 5e-4 of max |v| at dc 50
    from genie_rt.kvcache.device_pool import DeviceKVPool
    from genie_rt.kvcache.pool import KVShape, quantize_rows_int8
    from genie_rt.kvcache.attention import decode_reference
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 64, 1, 128)) * 2
    k -= k.mean(-1, keepdims=True)
    v = rng.standard_normal((1, 64, 1, 128))
    (kq, ks), (vq, vs) = quantize_rows_int8(k), quantize_rows_int8(v)
    pool = DeviceKVPool(KVShape(1, 64, 1, 128, "int8"))
    pool.import_positions(dict(k=kq, v=vq, k_scale=ks, v_scale=vs), 64)
    kd, vd = kq * ks[..., None].astype(np.float64), vq * vs[..., None].astype(np.float64)
    q = (rng.standard_normal((4, 128)) * 2 + dc).astype(np.float32)
    plan = plan_decode(4, 1, 128, "int8", 64, n_splits=1, warps=2, rows_per_thread=1, loop="mma")
    out = cuda.device_array(4 * 128, np.float32)
    decode_attention(cuda.to_device(q), pool.layer(0), cuda.to_device(np.array([63], np.int32)), out,
                     DecodeWorkspace(plan))
    ref = decode_reference(q, kd[0], vd[0], 63)
    vmax = np.abs(vd[0]).max()
    assert_close(out.copy_to_host(), ref, MMA_TOL[0] * vmax, MMA_TOL[1], f"q offset {dc}")


def test_mma_decode_a_zero_v_row_stays_finite():
    # an all-zero V row has scale 0: its log2 is clamped (VS_FLOOR), its p still counts in l
    pool, kd, vd = make_pool(2, 64, 64, "int8", 48, seed=5)
    lay = pool.layer(1)
    v, vs = lay.v.copy_to_host(), lay.v_scale.copy_to_host()
    v[7] = 0
    vs[7] = 0
    lay.v.copy_to_device(v)
    lay.v_scale.copy_to_device(vs)
    vd = vd.copy()
    vd[1, 7] = 0
    run_decode(pool, kd, vd, 8, 40, n_splits=2, warps=2, rows_per_thread=1, loop="mma", tol=MMA_TOL)


def test_mma_decode_one_f16_q_would_miss_the_tolerance(monkeypatch):
    # what the second q part buys: with q as one f16 the same case is off by more than MMA_TOL
    # (the loop's QL switch, read when the kernel is built)
    import genie_rt.kvcache.attention_decode_kernels as K
    pool, kd, vd = make_pool(2, 128, 64, "int8", 64, seed=178)
    run_decode(pool, kd, vd, 8, 50, n_splits=1, warps=2, rows_per_thread=2, loop="mma", tol=MMA_TOL)
    monkeypatch.setattr(M, "Q_PARTS", 1)
    K.decode_kernel.cache_clear()
    try:
        with pytest.raises(AssertionError, match="elements off"):
            run_decode(pool, kd, vd, 8, 50, n_splits=1, warps=2, rows_per_thread=2, loop="mma",
                       tol=MMA_TOL)
    finally:
        K.decode_kernel.cache_clear()


def test_mma_byte_tricks_are_exact_for_every_byte():
    # K: prmt(w ^ 0x80808080, 0x64646464, 0x4140 / 0x4342) is f16 1152 + b of bytes 0, 1 / 2, 3;
    # V: (prmt(a, b, sel) & 0x00FF00FF) ^ 0x64806480, then hfma2(., 1, -1152), is exactly
    # (a's byte i, b's byte i) - the device's libdevice.byte_perm, checked here in numpy
    b = np.arange(256, dtype=np.uint32)
    w = b * np.uint32(0x01010101)                        # every byte value in every position
    signed = w.view(np.int8).reshape(-1, 4)[:, 0].astype(np.float32)
    for sel in (0x4140, 0x4342):
        f16 = byte_perm(w ^ np.uint32(M.SIGN), M.C64, sel)
        half = f16.view(np.float16).reshape(-1, 2).astype(np.float32)
        assert np.array_equal(half, np.stack([signed + 1152] * 2, axis=1))
    a = w
    bw = np.roll(w, 1)                                   # another row's bytes
    sb = bw.view(np.int8).reshape(-1, 4)[:, 0].astype(np.float32)
    for i in range(4):
        x = (byte_perm(a, bw, i | (4 + i) << 8) & np.uint32(M.LOW)) ^ np.uint32(M.HI64)
        v = hfma2_reference(x, np.full_like(x, M.ONE2), np.full_like(x, M.NEG2))
        pair = v.view(np.float16).reshape(-1, 2).astype(np.float32)
        assert np.array_equal(pair, np.stack([signed, sb], axis=1)), i


def test_mma_plans_and_refusals():
    p = plan_decode(32, 8, 128, "int8", 4096, loop="mma", sm_count=132)    # Qwen3-4B
    assert (p.heads_per_block, p.n_sub, p.warps, p.rows_per_thread, p.tile) == (4, 1, 8, 1, 128)
    assert p.n_splits == 132 // 8                # MMA_SHAPE 8 x 1, ~160 registers: one block an SM
    p = plan_decode(32, 8, 128, "int8", 4096, loop="mma", sm_count=132, warps=4)
    assert (p.tile, p.n_splits) == (64, 3 * 132 // 8)   # 4 warps: 3 blocks an SM
    p = plan_decode(32, 2, 128, "int8", 4096, loop="mma", sm_count=132)    # group 16: two blocks
    assert (p.heads_per_block, p.n_sub) == (8, 2)
    with pytest.raises(ValueError, match="int8 caches only"):
        plan_decode(32, 8, 128, "f16", 4096, loop="mma")
    for hd in (16, 256):                          # 256: its registers would spill
        with pytest.raises(ValueError, match="multiple of 32 up to 128"):
            plan_decode(4, 1, hd, "int8", 64, loop="mma")
    with pytest.raises(ValueError, match="heads_per_block"):
        plan_decode(32, 2, 128, "int8", 4096, loop="mma", heads_per_block=16)


def test_mma_workspace_replay_at_growing_positions():
    # one workspace, launches at positions crossing chunk and split edges, as a captured graph does
    pool, kd, vd = make_pool(2, 64, 64, "int8", 64, seed=2)
    plan = plan_decode(8, 2, 64, "int8", 64, n_splits=3, warps=1, rows_per_thread=1, loop="mma")
    ws = DecodeWorkspace(plan)
    from genie_rt.kvcache.attention import decode_reference
    q = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    for pos in (14, 15, 16, 47, 48):
        out = cuda.device_array(8 * 64, np.float32)
        decode_attention(cuda.to_device(q), pool.layer(0), cuda.to_device(np.array([pos], np.int32)),
                         out, ws)
        ref = decode_reference(q, kd[0], vd[0], pos)
        got = out.copy_to_host()
        assert np.abs(got - ref).max() <= MMA_TOL[0] * np.abs(vd[0]).max() + MMA_TOL[1] * np.abs(ref).max()
        assert not ws.tickets.copy_to_host().any()


# ---- the engine with the mma loop -------------------------------------------------------------
def _decode_steps(be, tokens, nexts):
    """Logits of a prefill of `tokens`, then of one decode step for each of `nexts`."""
    out = [np.atleast_2d(be.prefill(tokens, 0))[-1]]
    for i, tok in enumerate(nexts):
        out.append(np.atleast_2d(be.decode(int(tok), len(tokens) + i))[-1])
    return np.array(out, np.float64)


@pytest.mark.slow
@pytest.mark.skipif(not SIM, reason="simulator test (on a GPU test_gpu_mma_loop_decode_matches_cpu)")
def test_simulated_engine_with_the_mma_loop_matches_cpu(tmp_path):
    # EngineConfig.decode_attention_loop="mma" reaches the decode step's attention (decode_short_ctx
    # 0: every position; else the short graph keeps the default loop's one-head blocks); its steps'
    # logits against the CPU's, int8 cache
    from test_backend_cuda import cosine_rows, make_backends, write_synthetic_qwen3
    from genie_rt.engine.config import EngineConfig, ModelConfig
    from genie_rt.engine.cuda_layout import plan_layout
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.kvcache.attention import DEFAULT_LOOP
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=8, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0, exact=True)
    g = open_gguf(path)
    lay = plan_layout(g, ModelConfig.from_gguf(g), EngineConfig(backend="cuda", n_ctx=2048, kv_dtype="int8",
                                                                decode_attention_loop="mma"), 2048)
    assert lay.decode_plan.loop == "mma" and lay.decode_plan.heads_per_block == 4
    assert {(p.loop, p.heads_per_block) for p in lay.decode_plans_short} == {(DEFAULT_LOOP, 1)}
    gpu, cpu, _ = make_backends(path, "int8", n_ctx=64, chunk=16, warm=False, decode_attention_loop="mma",
                                decode_short_ctx=0)
    assert {p.loop for p in gpu.lay.decode_plans} == {"mma"} and gpu.lay.decode_plan.heads_per_block == 4
    assert gpu.lay.decode_plans_short is None
    tokens, nexts = np.array([5, 17, 100, 3, 250, 9, 42], np.int32), [77, 8]
    got, ref = _decode_steps(gpu, tokens, nexts), _decode_steps(cpu, tokens, nexts)
    assert cosine_rows(got, ref).min() >= 0.998


@pytest.mark.skipif(not SIM, reason="simulator test (plans only)")
def test_the_layout_takes_the_mma_loop_by_default_where_it_was_measured(tmp_path, monkeypatch):
    # cuda_layout.decode_loop's default reaches the layout: on a device it was measured on (patched
    # here), the long graph's plans are mma with the whole group a block and the short graph keeps
    # the warp loop's one-head blocks; without the short graph, or elsewhere, the warp loop's plans
    from test_backend_cuda import write_synthetic_qwen3
    from genie_rt.engine import cuda_layout
    from genie_rt.engine.config import EngineConfig, ModelConfig
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.kvcache.attention import DEFAULT_LOOP
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen3(path, dict(layers=1, hidden=256, heads=8, kv_heads=2, head_dim=64, ffn=256,
                                     vocab=300, text_tokens=274), seed=0, exact=True)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)

    def lay(**kw):
        return cuda_layout.plan_layout(g, cfg, EngineConfig(backend="cuda", n_ctx=2048, kv_dtype="int8", **kw), 2048)
    for measured in (True, False):
        monkeypatch.setattr(cuda_layout, "mma_measured_here", lambda m=measured: m)
        got = lay(decode_short_ctx=512)
        long = {(p.loop, p.heads_per_block) for p in got.decode_plans}
        assert long == ({("mma", 4)} if measured else {(DEFAULT_LOOP, 2)})
        assert {(p.loop, p.heads_per_block) for p in got.decode_plans_short} == {(DEFAULT_LOOP, 1)}
        assert {p.loop for p in lay(decode_short_ctx=0).decode_plans} == {DEFAULT_LOOP}
        assert {p.loop for p in lay(decode_short_ctx=512, decode_attention_loop="warp").decode_plans} == {"warp"}


@pytest.mark.gpu
def test_gpu_mma_loop_decode_matches_cpu(fixture_gguf, llamacpp_logits):
    # the fixture's prompts, then 24 decode steps on the CPU's greedy tokens: each step's logits
    # against the CPU back-end's (the int8 cache's bar, 0.998) and the default loop's (0.999)
    from test_backend_cuda import cosine_rows, make_backends
    mma, cpu, _ = make_backends(fixture_gguf, "int8", decode_attention_loop="mma", decode_short_ctx=0)
    warp = make_backends(fixture_gguf, "int8", decode_short_ctx=0)[0]
    for i in range(3):
        tokens = llamacpp_logits[f"tokens_{i}"]
        ref = [np.atleast_2d(cpu.prefill(tokens, 0))[-1]]
        nexts = []
        for k in range(24):
            nexts.append(int(ref[-1].argmax()))
            ref.append(np.atleast_2d(cpu.decode(nexts[-1], len(tokens) + k))[-1])
        ref = np.array(ref[:-1], np.float64)
        got = _decode_steps(mma, tokens, nexts[:-1])
        assert cosine_rows(got, ref).min() >= 0.998, f"prompt {i}: {cosine_rows(got, ref).min():.5f}"
        base = _decode_steps(warp, tokens, nexts[:-1])
        assert cosine_rows(got, base).min() >= 0.999, f"prompt {i}: {cosine_rows(got, base).min():.5f}"
