"""rope_write -> prefill attention -> decode attention chained as one layer of the engine
runs them: every chunk's K/V written by rope_write before its attention, on an ordinary
layer and (Gemma 3's way) on a ring layer that wraps plus a global one, checked against
the float64 reference on what the cache holds. Tiny shapes under the simulator; Gemma 3
270M's shape on a GPU (`-m gpu`).
"""
import numpy as np
import pytest
from numba import cuda

from attention_helpers import GEMMA_CHUNK, GEMMA_W, assert_close, make_pool
from genie_rt.kvcache.attention import DecodeWorkspace, decode_attention, decode_reference, plan_decode
from genie_rt.kvcache.attention_prefill import (PrefillWorkspace, plan_prefill, prefill_attention,
                                                prefill_reference)
from genie_rt.kvcache.device_pool import DeviceKVPool
from genie_rt.kvcache.pool import KVShape, ring_slots


# ---- the three kernels chained, as one layer of the engine does -----------------------------
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_rope_write_then_prefill_then_decode(kv_dtype):
    from genie_rt.kvcache.rope_write import rope_table, rope_write, rope_write_reference
    n_head, n_kv, hd, n_ctx, prefix, n = 4, 2, 32, 32, 9, 5
    pool, _, _ = make_pool(n_kv, hd, n_ctx, kv_dtype, prefix, layers=1)   # reused prefix
    rng = np.random.default_rng(3)
    qn, kn = (1 + 0.2 * rng.standard_normal((2, hd))).astype(np.float32)
    cos, sin = rope_table(n_ctx, hd, 1e6)
    dev = {name: cuda.to_device(a) for name, a in dict(qn=qn, kn=kn, cos=cos, sin=sin).items()}
    state = cuda.to_device(np.array([prefix], np.int32))

    def project(m, pos):   # rope_write m tokens at pos; returns device q and the numpy q
        qkv = (rng.standard_normal((m, (n_head + 2 * n_kv) * hd)) * 2).astype(np.float32)
        q = cuda.device_array((m, n_head, hd), np.float32)
        state.copy_to_device(np.array([pos], np.int32))
        rope_write(cuda.to_device(qkv), dev["qn"], dev["kn"], 1e-6, dev["cos"], dev["sin"],
                   state, q, pool.layer(0))
        return q, rope_write_reference(qkv.astype(np.float64), qn, kn, 1e-6, cos, sin, pos,
                                       n_head, n_kv)[0]

    q, q_ref = project(n, prefix)                     # prefill chunk: positions 9 .. 13
    plan = plan_prefill(n_head, n_kv, hd, kv_dtype, n_max=n)
    out = cuda.device_array((n, n_head * hd), np.float32)
    prefill_attention(q, pool.layer(0), state, out, PrefillWorkspace(plan))
    k_all, v_all = pool.read(0, prefix + n)           # what rope_write stored (+ the prefix)
    vmax = np.abs(v_all).max()
    assert_close(out.copy_to_host(), prefill_reference(q_ref, k_all, v_all, prefix),
                 4e-3 * vmax, 4e-3, "chained prefill")

    q1, q1_ref = project(1, prefix + n)               # decode: position 14
    dplan = plan_decode(n_head, n_kv, hd, kv_dtype, n_ctx, n_splits=2, warps=1,
                        rows_per_thread=1)
    out1 = cuda.device_array(n_head * hd, np.float32)
    decode_attention(q1, pool.layer(0), state, out1, DecodeWorkspace(dplan))
    k_all, v_all = pool.read(0, prefix + n + 1)
    assert_close(out1.copy_to_host(), decode_reference(q1_ref[0], k_all, v_all, prefix + n),
                 1e-4 * vmax, 1e-4, "chained decode")


def chain_layers(kv_dtype, n_head, n_kv, hd, n_ctx, W, C, n_chunks, rope="neox", qk_norm=True,
                 bn=0):
    """rope_write -> prefill in chunks of C tokens, then one decode step, on a local (ring of
    ring_slots(W, C) slots, rope base 1e4) and a global layer (base 1e6), as the engine runs
    Gemma 3: every chunk's K/V written before its attention, the ring wrapping. Checked
    against the float64 reference on what the cache holds."""
    from genie_rt.kvcache.rope_write import rope_table, rope_write, rope_write_reference
    shape = KVShape(2, n_ctx, n_kv, hd, kv_dtype, slots=(ring_slots(W, C, n_ctx), n_ctx))
    pool = DeviceKVPool(shape)
    rng = np.random.default_rng(7)
    qn, kn = (1 + 0.2 * rng.standard_normal((2, hd))).astype(np.float32)
    tables = [rope_table(n_ctx, hd, 1e4), rope_table(n_ctx, hd, 1e6)]
    dev = [tuple(cuda.to_device(a) for a in t) for t in tables]
    qn_d, kn_d = (cuda.to_device(qn), cuda.to_device(kn)) if qk_norm else (None, None)
    state = cuda.to_device(np.zeros(1, np.int32))
    plans = [plan_prefill(n_head, n_kv, hd, kv_dtype, n_max=C, window=W, bn=bn),
             plan_prefill(n_head, n_kv, hd, kv_dtype, n_max=C, bn=bn)]
    ws = PrefillWorkspace(plans[1])
    dplans = [plan_decode(n_head, n_kv, hd, kv_dtype, n_ctx, window=W),
              plan_decode(n_head, n_kv, hd, kv_dtype, n_ctx)]
    dws = DecodeWorkspace(dplans[1])
    k_all, v_all = [[], []], [[], []]
    for start in range(0, C * n_chunks + 1, C):
        m = C if start < C * n_chunks else 1               # the last step is a decode step
        qkv = (rng.standard_normal((m, (n_head + 2 * n_kv) * hd)) * 2).astype(np.float32)
        state.copy_to_device(np.array([start], np.int32))
        for li in (0, 1):
            q = cuda.device_array((m, n_head, hd), np.float32)
            cos, sin = dev[li]
            rope_write(cuda.to_device(qkv), qn_d, kn_d, 1e-6, cos, sin, state, q, pool.layer(li),
                       rope=rope)
            qr = rope_write_reference(qkv.astype(np.float64), qn if qk_norm else None,
                                      kn if qk_norm else None, 1e-6, *tables[li], start, n_head,
                                      n_kv, neox=rope == "neox")[0]
            kk, vv = pool.read(li, start + m, first=start)      # what rope_write stored
            k_all[li].append(kk)
            v_all[li].append(vv)
            kd, vd = np.concatenate(k_all[li]), np.concatenate(v_all[li])
            window = W if li == 0 else 0
            out = cuda.device_array((m, n_head * hd), np.float32)
            if m > 1:
                prefill_attention(q, pool.layer(li), state, out, ws, plan=plans[li])
                ref, tol = prefill_reference(qr, kd, vd, start, window), 4e-3
            else:
                decode_attention(q, pool.layer(li), state, out, dws, plan=dplans[li])
                ref, tol = decode_reference(qr[0], kd, vd, start, window)[None], 1e-4
            cuda.synchronize()
            assert_close(out.copy_to_host(), ref, tol * np.abs(vd).max(), tol,
                         f"layer {li} chunk at {start} ({kv_dtype})")


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,rope,qk_norm", [("int8", "neox", True), ("f16", "normal", False)])
def test_chunks_through_the_ring_tiny(kv_dtype, rope, qk_norm):
    # window 5, chunks of 4: a ring of 8 slots wraps at the second chunk
    chain_layers(kv_dtype, 4, 2, 32, 32, 5, 4, 3, rope=rope, qk_norm=qk_norm, bn=16)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_gpu_gemma3_layer_chunks_through_the_ring(kv_dtype):
    chain_layers(kv_dtype, 4, 1, 256, 4096, GEMMA_W, GEMMA_CHUNK, 3)
