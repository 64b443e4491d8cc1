"""Decode and prefill attention at model shapes on a GPU (`-m gpu`; skipped without one):
Qwen3-4B (32 / 8 heads, head_dim 128) at contexts 1 .. 4096, prefill n = 33 and 512 at
start 0 and start > 0 with and without context splits, decode replayed from a captured
CUDA graph; Gemma 3 270M (4 / 1 heads, head_dim 256, window 512 on a ring of 1023 slots)
and SmolLM2 (9 / 3 heads, head_dim 64), with no register spills.
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import (GEMMA_R, GEMMA_W, assert_close, make_pool, make_ring_pool, run_decode,
                               run_decode_w, run_prefill, run_prefill_w)
from genie_rt.kvcache.attention import DecodeWorkspace, decode_attention, decode_reference, plan_decode
from genie_rt.kvcache.attention_prefill import plan_prefill, prefill_splits


# ---- GPU: Qwen3-4B shapes ---------------------------------------------------------------
QWEN3_4B = dict(n_head=32, n_kv=8, hd=128)


@pytest.fixture(scope="module", params=["int8", "f16"])
def pool_4b(request):
    """One layer of 4096 + 64 positions, all filled."""
    return make_pool(QWEN3_4B["n_kv"], QWEN3_4B["hd"], 4096 + 64, request.param, 4096 + 64,
                     seed=11, layers=1)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["block", "warp", "warp-nopf"])
@pytest.mark.parametrize("pos", [0, 1, 63, 64, 100, 1023, 2500, 4095])
def test_gpu_decode_qwen3_4b(pool_4b, pos, loop):
    from genie_rt.kvcache.attention import compile_decode
    pool, kd, vd = pool_4b
    compile_decode(plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx, loop=loop))
    run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, loop=loop)                # default splits
    run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, n_splits=1, loop=loop)    # one block per head
    run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, n_splits=64, loop=loop)   # many splits
    plan = plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx, loop=loop)
    assert len(plan.kernel().overloads) == 1, "a launch recompiled: signature mismatch"


@pytest.mark.gpu
@pytest.mark.parametrize("pos", [0, 1, 63, 64, 100, 511, 1023, 4095])
def test_gpu_decode_qwen3_4b_one_head_a_block(pool_4b, pos):
    """The short-context decode graph's plan (EngineConfig.decode_short_ctx: one query head a block,
    8 warps of 2 rows, splits sized for 1,024 positions), and the same blocks over the whole pool."""
    from genie_rt.kvcache.attention import compile_decode
    pool, kd, vd = pool_4b
    for n_ctx in (1024, pool.n_ctx):
        plan = plan_decode(32, 8, 128, pool.shape.dtype, n_ctx, heads_per_block=1)
        assert (plan.heads_per_block, plan.warps, plan.rows_per_thread) == (1, 8, 2)
        compile_decode(plan)
        run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, heads_per_block=1, n_splits=plan.n_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("pos", [64, 100, 1023, 4095])
def test_gpu_decode_qwen3_4b_merge_prefetch_same_bits(pool_4b, pos, monkeypatch):
    """kvcache/attention.py MERGE_PREFETCH (lab): the merge with its first partials loaded early
    gives the bits of the merge without, at the 4B's shape (2 to 64 active splits, both plans, and the
    long graph's tensor-core plan with the knob at "mma")."""
    import genie_rt.kvcache.attention as A
    pool, kd, vd = pool_4b
    q = cuda.to_device(np.random.default_rng(pos).standard_normal((32, 128)).astype(np.float32))
    state = cuda.to_device(np.array([pos], np.int32))
    ways = ((2, None, None), (2, 64, None), (1, None, None))
    for gh, n_splits, loop in ways + (((None, None, "mma"),) if pool.shape.dtype == "int8" else ()):  # (mma: int8 only)
        kw = dict(heads_per_block=gh) if loop is None else dict(loop=loop)
        plan = plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx, n_splits=n_splits, **kw)
        outs = []
        for pf in (False, loop or True):
            monkeypatch.setattr(A, "MERGE_PREFETCH", pf)
            out = cuda.device_array(32 * 128, np.float32)
            decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(plan))
            outs.append(out.copy_to_host())
        assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32)), (gh, n_splits, loop)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["block", "warp"])
@pytest.mark.parametrize("pos", [0, 100, 4095])
def test_gpu_decode_q8_output_is_quantize_q8_of_out(pool_4b, pos, loop):
    """The engine's decode (q8 of out written by the attention launch, one split and the
    merge) against the plain launch + quantize_q8: the same bits, compiled for the GPU."""
    from genie_rt.kvcache.attention import compile_decode
    from genie_rt.quant import gemv
    pool, kd, vd = pool_4b
    n = 32 * 128
    for n_splits in (1, None):
        plan = plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx, n_splits=n_splits, loop=loop)
        compile_decode(plan, q8=True)
        ws = DecodeWorkspace(plan)
        q = cuda.to_device(np.random.default_rng(pos).standard_normal(n).astype(np.float32))
        state = cuda.to_device(np.array([pos], np.int32))
        out, out2 = cuda.device_array(n, np.float32), cuda.device_array((1, n), np.float32)
        xq, xs = cuda.device_array(n, np.int8), cuda.device_array(n // 8, np.float32)
        rq, rs = cuda.device_array((1, n), np.int8), cuda.device_array((1, n // 8), np.float32)
        decode_attention(q, pool.layer(0), state, out, ws, xq=xq, xs=xs)
        decode_attention(q, pool.layer(0), state, out2, ws)
        gemv.quantize_q8(out2, rq, rs)
        cuda.synchronize()
        where = f"pos {pos} splits {plan.n_splits}"
        assert np.array_equal(out.copy_to_host().view(np.int32), out2.copy_to_host()[0].view(np.int32)), where
        assert np.array_equal(xq.copy_to_host(), rq.copy_to_host()[0]), where
        assert np.array_equal(xs.copy_to_host().view(np.int32), rs.copy_to_host()[0].view(np.int32)), where
        assert len(plan.kernel(True).overloads) == 1, "a launch recompiled: signature mismatch"


@pytest.mark.gpu
@pytest.mark.parametrize("n,start", [(33, 0), (33, 1000), (33, 4000), (512, 0), (512, 3000)])
def test_gpu_prefill_qwen3_4b(pool_4b, n, start):
    from genie_rt.kvcache.attention_prefill import compile_prefill
    pool, kd, vd = pool_4b
    plan = plan_prefill(32, 8, 128, pool.shape.dtype, n_max=n)
    compile_prefill(plan)
    run_prefill(pool, kd, vd, 32, n, start, seed=n + start)
    splits = max(2, prefill_splits(plan, n, start))
    run_prefill(pool, kd, vd, 32, n, start, n_splits=min(splits, 8), seed=n + start)
    from genie_rt.kvcache.attention_prefill_kernels import prefill_merge
    assert len(plan.kernel().overloads) == 1, "a launch recompiled: signature mismatch"
    assert len(prefill_merge.overloads) == 1, "a launch recompiled: signature mismatch"


@pytest.mark.gpu
def test_gpu_decode_in_a_cuda_graph(pool_4b):
    """Capture one launch, replay it at several positions by writing state[0] only."""
    from cuda.bindings import driver
    pool, kd, vd = pool_4b
    plan = plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx)
    ws = DecodeWorkspace(plan)
    q = np.random.default_rng(5).standard_normal((32, 128)).astype(np.float32)
    qd = cuda.to_device(q)
    out = cuda.device_array(32 * 128, np.float32)
    state = cuda.to_device(np.array([10], np.int32))
    stream = cuda.stream()
    decode_attention(qd, pool.layer(0), state, out, ws, stream=stream)    # compile outside
    stream.synchronize()
    hs = driver.CUstream(int(stream.handle))
    driver.cuStreamBeginCapture(hs, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    decode_attention(qd, pool.layer(0), state, out, ws, stream=stream)
    err, graph = driver.cuStreamEndCapture(hs)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    err, gexec = driver.cuGraphInstantiate(graph, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    for pos in (0, 77, 4095, 5, 2048):
        state.copy_to_device(np.array([pos], np.int32), stream=stream)
        driver.cuGraphLaunch(gexec, hs)
        stream.synchronize()
        ref = decode_reference(q, kd[0], vd[0], pos)
        assert_close(out.copy_to_host(), ref, 2e-5 * np.abs(vd[0]).max(), 1e-5, f"graph pos {pos}")


# ---- GPU: Gemma 3 270M (4 / 1 heads, head_dim 256, window 512) and SmolLM2 (9 / 3, hd 64) ----
def _no_spills(kernel, what):
    local = kernel.get_local_mem_per_thread()
    assert all(v == 0 for v in local.values()), f"{what}: local memory (spills) {local}"


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["block", "warp"])
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("T", [1, 300, 512, 513, 1023, 1024, 1500, 4000])
def test_gpu_decode_gemma3_ring(kv_dtype, T, loop):
    from genie_rt.kvcache.attention import compile_decode
    pool, kd, vd = make_ring_pool(1, 256, 4096, GEMMA_R, kv_dtype, T, seed=T)
    plan = plan_decode(4, 1, 256, kv_dtype, 4096, window=GEMMA_W, loop=loop)
    compile_decode(plan)
    run_decode_w(pool, kd, vd, 4, T - 1, GEMMA_W, seed=T, loop=loop)
    run_decode_w(pool, kd, vd, 4, T - 1, GEMMA_W, seed=T, n_splits=1, loop=loop)
    _no_spills(plan.kernel(), f"decode gemma {kv_dtype} {loop}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("loop", ["block", "warp"])
def test_gpu_decode_gemma3_global_and_smollm2(kv_dtype, loop):
    pool, kd, vd = make_pool(1, 256, 4096, kv_dtype, 4096, seed=3, layers=1)
    for pos in (0, 511, 2047, 4095):
        run_decode_w(pool, kd, vd, 4, pos, 0, seed=pos, loop=loop)
    pool, kd, vd = make_pool(3, 64, 2048 + 64, kv_dtype, 2048 + 64, seed=4, layers=1)
    for pos in (0, 100, 2100):
        run_decode_w(pool, kd, vd, 9, pos, 0, seed=pos, loop=loop)
        plan = run_decode_w(pool, kd, vd, 9, pos, 0, scale=0.1, seed=pos, n_splits=3, loop=loop)
    _no_spills(plan.kernel(), f"decode smollm2 {kv_dtype} {loop}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(512, 0), (512, 511), (512, 1000), (512, 3000), (33, 2000),
                                     (1, 700)])
def test_gpu_prefill_gemma3_ring(kv_dtype, n, start):
    from genie_rt.kvcache.attention_prefill import compile_prefill
    pool, kd, vd = make_ring_pool(1, 256, 4096, GEMMA_R, kv_dtype, start + n, seed=n + start)
    plan = plan_prefill(4, 1, 256, kv_dtype, n_max=n, window=GEMMA_W)
    compile_prefill(plan)
    run_prefill_w(pool, kd, vd, 4, n, start, GEMMA_W, seed=start)
    splits = max(2, prefill_splits(plan, n, start))
    run_prefill_w(pool, kd, vd, 4, n, start, GEMMA_W, n_splits=min(splits, 8), seed=start)
    _no_spills(plan.kernel(), f"prefill gemma {kv_dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(512, 0), (512, 3000), (33, 4000)])
def test_gpu_prefill_gemma3_global_and_smollm2(kv_dtype, n, start):
    pool, kd, vd = make_pool(1, 256, 4096 + 64, kv_dtype, 4096 + 64, seed=5, layers=1)
    plan = plan_prefill(4, 1, 256, kv_dtype, n_max=n)
    run_prefill_w(pool, kd, vd, 4, n, start, 0, seed=n)
    run_prefill_w(pool, kd, vd, 4, n, start, 0, n_splits=min(8, max(2, prefill_splits(plan, n, start))),
                  seed=n)
    _no_spills(plan.kernel(), f"prefill gemma global {kv_dtype}")
    pool, kd, vd = make_pool(3, 64, 4096 + 64, kv_dtype, 4096 + 64, seed=6, layers=1)
    plan = run_prefill_w(pool, kd, vd, 9, n, start, 0, seed=n)
    run_prefill_w(pool, kd, vd, 9, n, start, 0, n_splits=4, seed=n)
    _no_spills(plan.kernel(), f"prefill smollm2 {kv_dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("pos", [0, 1, 15, 16, 63, 64, 100, 1023, 2500, 4095])
def test_gpu_decode_qwen3_4b_mma_loop(pool_4b, pos):
    """The tensor-core loop ("mma", attention_decode_mma.py; int8 caches) at the 4B's shape against
    the reference (its tolerance: f16 P), at its default plan, one split and 64; its PDL build the
    plain build's bits; no spills. The f16 pool is refused."""
    from test_attention_decode_mma import MMA_TOL
    from genie_rt.kvcache.attention import compile_decode
    pool, kd, vd = pool_4b
    if pool.shape.dtype != "int8":
        with pytest.raises(ValueError, match="int8 caches only"):
            plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx, loop="mma")
        return
    plan = plan_decode(32, 8, 128, "int8", pool.n_ctx, loop="mma")
    compile_decode(plan)
    outs = []
    for pdl in (False, True):
        run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, loop="mma", tol=MMA_TOL, pdl=pdl)
        outs.append(run_decode.out)
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32)), "PDL build: other bits"
    for n_splits in (1, 64):
        run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, n_splits=n_splits, loop="mma", tol=MMA_TOL)
    _no_spills(plan.kernel(), "decode mma")
