"""Tests for genie_rt.kvcache.rope_write: QK-norm + NeoX RoPE + KV-cache write.

- simulator (no GPU) or device: tiny shapes (4 q heads, 2 kv heads, head_dim 32/64),
  n in {1, 5}, start in {0, 9}, int8 and f16 caches, against engine.qwen3's rmsnorm /
  rope_neox and kvcache.pool's int8 row format;
- PTX: both kernels compile for sm_87 and sm_90 without float64 instructions;
- GPU (`-m gpu`): Qwen3-4B shapes (32 / 8 heads, head_dim 128), n in {1, 33, 512}.

Tolerances: q and the f16 cache within a few f32 / f16 ulps of the float64 reference;
int8 rows: scale within 1e-5 relative, bytes within 1 of the reference quantization of the
reference rows (the kernel's rows differ from numpy's by an ulp, so a value at a rounding
boundary may land on either side).
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.kvcache.device_pool import DeviceKVPool
from genie_rt.kvcache.pool import KVShape
from genie_rt.kvcache.rope_write import (cache_rows_reference, rope_table, rope_write,
                                         rope_write_reference)
from ptx_helpers import assert_no_f64, compile_in_subprocess

EPS = 1e-6


def _case(n_head, n_kv, hd, n, start, n_ctx, kv_dtype, seed=0, layers=2, layer=1, n_rope=None):
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((n, (n_head + 2 * n_kv) * hd)) * 3).astype(np.float32)
    q_norm = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    k_norm = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    cos, sin = rope_table(n_rope or n_ctx, hd, 1e6)
    pool = DeviceKVPool(KVShape(layers, n_ctx, n_kv, hd, kv_dtype))
    q_out = cuda.device_array((n, n_head, hd), np.float32)
    state = cuda.to_device(np.array([start], np.int32))
    d = {name: cuda.to_device(a) for name, a in
         dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin).items()}
    rope_write(d["qkv"], d["q_norm"], d["k_norm"], EPS, d["cos"], d["sin"], state, q_out,
               pool.layer(layer))
    cuda.synchronize()
    f64 = {name: a.astype(np.float64) for name, a in
           dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin).items()}
    q_ref, k_ref, v_ref = rope_write_reference(f64["qkv"], f64["q_norm"], f64["k_norm"], EPS,
                                               f64["cos"], f64["sin"], start, n_head, n_kv)
    return pool, q_out.copy_to_host(), (q_ref, k_ref, v_ref)


def _worst(got, ref):
    i = np.unravel_index(np.argmax(np.abs(got - ref)), got.shape)
    return f"worst at {i}: got {got[i]!r} ref {ref[i]!r}"


def _check(pool, q, refs, start, n, layer=1):
    q_ref, k_ref, v_ref = refs
    err = np.abs(q - q_ref)
    assert (err <= 2e-6 * (1 + np.abs(q_ref))).all(), "q: " + _worst(q, q_ref)
    arrays = pool.export_positions(pool.n_ctx)
    end = min(start + n, pool.n_ctx)
    m = end - start
    for name, ref in (("k", k_ref), ("v", v_ref)):
        got = arrays[name][layer, start:end]
        want, scale = cache_rows_reference(ref[:m], pool.shape.dtype)
        if pool.shape.dtype == "int8":
            gs = arrays[name + "_scale"][layer, start:end]
            assert np.allclose(gs, scale, rtol=1e-5, atol=0), f"{name}_scale: " + _worst(gs, scale)
            diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
            assert diff.max() <= 1, f"{name} bytes: " + _worst(got.astype(np.int32),
                                                               want.astype(np.int32))
            assert (diff > 0).mean() < 0.01, f"{name}: {(diff > 0).mean():.3%} of bytes differ"
            # positions outside [start, end) untouched (zero), other layers untouched
            assert not arrays[name + "_scale"][layer, :start].any()
            assert not arrays[name + "_scale"][layer, end:].any()
            assert not arrays[name + "_scale"][1 - layer].any()
        else:
            g, w = got.astype(np.float32), want.astype(np.float32)
            assert (np.abs(g - w) <= 2 ** -10 * np.abs(w) + 1e-7).all(), f"{name}: " + _worst(g, w)
        assert not arrays[name][layer, :start].any() and not arrays[name][layer, end:].any()
        assert not arrays[name][1 - layer].any()


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start,hd", [(1, 0, 32), (5, 9, 32), (1, 9, 64)])
def test_rope_write_small(kv_dtype, n, start, hd):
    pool, q, refs = _case(4, 2, hd, n, start, 16, kv_dtype)
    _check(pool, q, refs, start, n)


def test_rope_write_past_the_pool_is_not_written():
    # positions 14, 15 exist, 16 and 17 do not: q is still produced for every token
    pool, q, refs = _case(4, 2, 32, 4, 14, 16, "int8", seed=3, n_rope=20)
    _check(pool, q, refs, 14, 4)


def test_rope_write_rejects_bad_shapes():
    pool = DeviceKVPool(KVShape(1, 8, 2, 32, "int8"))
    qkv = cuda.device_array((2, 8 * 32), np.float32)
    qn = cuda.device_array(32, np.float32)
    cos = cuda.device_array((8, 16), np.float32)
    state = cuda.to_device(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="qkv shape"):
        rope_write(qkv, qn, qn, EPS, cos, cos, state, cuda.device_array((2, 3, 32), np.float32),
                   pool.layer(0))
    with pytest.raises(ValueError, match="state"):
        rope_write(qkv, qn, qn, EPS, cos, cos, cuda.to_device(np.zeros(1, np.int64)),
                   cuda.device_array((2, 4, 32), np.float32), pool.layer(0))


# ---- PTX ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ptx_text():
    from genie_rt.kvcache import rope_write as m
    return compile_in_subprocess("genie_rt.kvcache.rope_write", {
        "rope_write_int8": m.signature("int8"),
        "rope_write_f16": m.signature("f16"),
    })


def test_ptx_compiles_without_f64(ptx_text):
    for name, per_cc in ptx_text.items():
        assert set(per_cc) == {(8, 7), (9, 0)}
        for cc, text in per_cc.items():
            assert_no_f64(text, where=f"{name} sm_{cc[0]}{cc[1]}")
            assert "shfl.sync.bfly" in text


# ---- GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(1, 0), (1, 4000), (33, 0), (33, 1000), (512, 77)])
def test_gpu_rope_write_qwen3_4b(kv_dtype, n, start):
    from genie_rt.kvcache.rope_write import compile_for
    compile_for(kv_dtype)
    pool, q, refs = _case(32, 8, 128, n, start, 4096 + 64, kv_dtype, seed=n + start)
    _check(pool, q, refs, start, n)
    from genie_rt.kvcache.rope_write import _KERNELS
    assert len(_KERNELS[kv_dtype].overloads) == 1, "the launch recompiled: signature mismatch"
