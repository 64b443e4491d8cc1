"""Tests for genie_rt.kvcache.rope_write: QK-norm + NeoX RoPE + KV-cache write.

- simulator (no GPU) or device: tiny shapes (4 q heads, 2 kv heads, head_dim 32/64),
  n in {1, 5}, start in {0, 9}, int8 and f16 caches, against engine.models.reference's rmsnorm /
  rope_neox and kvcache.pool's int8 row format;
- PTX: both kernels compile for sm_87 and sm_90 without float64 instructions;
- variants: normal (adjacent) pairs, no QK-norm (SmolLM2's 9 / 3 heads, head_dim 64),
  head_dim 256 with one KV head (Gemma 3), writes into a ring (slot p % R, wrapping),
  rope_table with Llama 3 frequency factors and linear scaling;
- GPU (`-m gpu`): Qwen3-4B shapes (32 / 8 heads, head_dim 128), n in {1, 33, 512};
  Gemma 3 270M (ring of 1023 slots) and SmolLM2 shapes.

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
from genie_rt.kvcache.rope_write import (cache_rows_reference, rope_norm_reference, rope_table,
                                         rope_write, rope_write_reference)
from ptx_helpers import assert_no_f64, compile_in_subprocess

EPS = 1e-6


def _case(n_head, n_kv, hd, n, start, n_ctx, kv_dtype, seed=0, layers=2, layer=1, n_rope=None,
          rope="neox", qk_norm=True, slots=None, base=1e6):
    """Run rope_write once; returns (pool, q from the kernel, float64 reference (q, k, v)).
    slots: ring slot count of every layer (None: ordinary layers)."""
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((n, (n_head + 2 * n_kv) * hd)) * 3).astype(np.float32)
    q_norm = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    k_norm = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    cos, sin = rope_table(n_rope or n_ctx, hd, base)
    shape = KVShape(layers, n_ctx, n_kv, hd, kv_dtype, slots=None if slots is None else (slots,) * layers)
    pool = DeviceKVPool(shape)
    q_out = cuda.device_array((n, n_head, hd), np.float32)
    state = cuda.to_device(np.array([start], np.int32))
    d = {name: cuda.to_device(a) for name, a in
         dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin).items()}
    rope_write(d["qkv"], d["q_norm"] if qk_norm else None, d["k_norm"] if qk_norm else None,
               EPS, d["cos"], d["sin"], state, q_out, pool.layer(layer), rope=rope)
    cuda.synchronize()
    f64 = {name: a.astype(np.float64) for name, a in
           dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin).items()}
    q_ref, k_ref, v_ref = rope_write_reference(
        f64["qkv"], f64["q_norm"] if qk_norm else None, f64["k_norm"] if qk_norm else None, EPS,
        f64["cos"], f64["sin"], start, n_head, n_kv, neox=rope == "neox")
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


# ---- variants: normal (adjacent) pairs, no QK-norm, ring slots, head_dim 256 / 64 -------
def _check_ring(pool, q, refs, start, n, layer=1):
    """A ring layer of R slots: position p in slot p % R; every other slot still zero."""
    q_ref, k_ref, v_ref = refs
    assert (np.abs(q - q_ref) <= 2e-6 * (1 + np.abs(q_ref))).all(), "q: " + _worst(q, q_ref)
    lay = pool.layer(layer)
    R = lay.slots
    written = {(start + t) % R: t for t in range(n)}
    for name, ref in (("k", k_ref), ("v", v_ref)):
        got = getattr(lay, name).copy_to_host()
        scales = getattr(lay, name + "_scale").copy_to_host() if pool.shape.dtype == "int8" else None
        for slot in range(R):
            if slot not in written:
                assert not got[slot].any(), f"{name}: slot {slot} written"
                continue
            want, scale = cache_rows_reference(ref[written[slot]], pool.shape.dtype)
            if scale is None:
                g, w = got[slot].astype(np.float32), want.astype(np.float32)
                assert (np.abs(g - w) <= 2 ** -10 * np.abs(w) + 1e-7).all(), f"{name} slot {slot}"
            else:
                assert np.allclose(scales[slot], scale, rtol=1e-5, atol=0), f"{name}_scale slot {slot}"
                assert np.abs(got[slot].astype(np.int32) - want).max() <= 1, f"{name} slot {slot}"


def test_rope_norm_reference_rotates_adjacent_pairs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 8))
    cos, sin = rope_table(3, 8, 100.0)
    got = rope_norm_reference(x, cos.astype(np.float64), sin.astype(np.float64))
    for t in range(3):
        for i in range(4):
            a, b = x[t, :, 2 * i], x[t, :, 2 * i + 1]
            c, s_ = cos[t, i], sin[t, i]
            assert np.allclose(got[t, :, 2 * i], a * c - b * s_)
            assert np.allclose(got[t, :, 2 * i + 1], b * c + a * s_)


def test_rope_table_factors_and_linear_scale():
    from genie_rt.engine.models.reference import rope_tables
    c0, s0 = rope_table(50, 64, 1e4)
    c1, s1 = rope_tables(64, np.arange(50), 1e4, np.float32)
    assert np.array_equal(c0, c1) and np.array_equal(s0, s1)          # the default is qwen3's
    ff = np.linspace(1, 8, 32).astype(np.float32)
    c, s = rope_table(50, 64, 5e5, freq_factors=ff, freq_scale=0.125)
    theta = 0.125 * np.arange(50)[:, None] * (5e5 ** (-np.arange(0, 64, 2) / 64) / ff)[None]
    assert np.allclose(c, np.cos(theta), atol=1e-7) and np.allclose(s, np.sin(theta), atol=1e-7)
    assert c.dtype == np.float32 and c.shape == (50, 32)
    with pytest.raises(ValueError, match="freq_factors has 31"):
        rope_table(8, 64, 1e4, freq_factors=ff[:31])
    with pytest.raises(ValueError, match="> 0"):
        rope_table(8, 64, 1e4, freq_factors=-ff)
    with pytest.raises(ValueError, match="freq_scale"):
        rope_table(8, 64, 1e4, freq_scale=0.0)


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_rope_write_normal_pairs_without_qk_norm(kv_dtype):
    # the llama arch (SmolLM2: 9 q heads, 3 kv heads, head_dim 64): no q_norm / k_norm
    pool, q, refs = _case(9, 3, 64, 2, 5, 12, kv_dtype, seed=8, rope="normal", qk_norm=False,
                          base=1e5)
    _check(pool, q, refs, 5, 2)


def test_rope_write_neox_without_qk_norm_and_normal_with_it():
    pool, q, refs = _case(4, 2, 32, 3, 2, 12, "int8", seed=9, qk_norm=False)
    _check(pool, q, refs, 2, 3)
    pool, q, refs = _case(4, 2, 32, 3, 2, 12, "f16", seed=10, rope="normal")
    _check(pool, q, refs, 2, 3)


@pytest.mark.parametrize("kv_dtype,start,n", [("int8", 9, 4), ("f16", 4, 5), ("int8", 0, 6)])
def test_rope_write_into_a_ring_wraps(kv_dtype, start, n):
    # 6 slots: positions 9..12 -> slots 3, 4, 5, 0; 4..8 -> 4, 5, 0, 1, 2; 0..5 fill it
    pool, q, refs = _case(4, 2, 32, n, start, 40, kv_dtype, seed=start, slots=6)
    assert pool.layer(1).ring
    _check_ring(pool, q, refs, start, n)


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_rope_write_head_dim_256_one_kv_head(kv_dtype):
    # Gemma 3 270M's shape: 4 q heads, 1 kv head, head_dim 256 (8 values per lane)
    pool, q, refs = _case(4, 1, 256, 2, 3, 8, kv_dtype, seed=12, base=1e4)
    _check(pool, q, refs, 3, 2)


def test_rope_write_refuses_bad_variants():
    pool = DeviceKVPool(KVShape(1, 16, 2, 32, "int8", slots=(4,)))
    qkv = cuda.device_array((5, 8 * 32), np.float32)
    qn = cuda.device_array(32, np.float32)
    cos = cuda.device_array((16, 16), np.float32)
    state = cuda.to_device(np.zeros(1, np.int32))
    q = cuda.device_array((5, 4, 32), np.float32)
    with pytest.raises(ValueError, match="ring of 4 slots"):
        rope_write(qkv, qn, qn, EPS, cos, cos, state, q, pool.layer(0))
    with pytest.raises(ValueError, match="or neither"):
        rope_write(qkv[:2], qn, None, EPS, cos, cos, state, q[:2], pool.layer(0))
    with pytest.raises(ValueError, match="rope must be"):
        rope_write(qkv[:2], qn, qn, EPS, cos, cos, state, q[:2], pool.layer(0), rope="yarn")


# ---- PTX ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ptx_text():
    from genie_rt.kvcache import rope_write as m
    return compile_in_subprocess(_PTX_SOURCE, {
        "rope_write_int8": m.signature("int8"),
        "rope_write_f16": m.signature("f16"),
        "llama_int8_ring": m.signature("int8"),
        "gemma_f16_ring": m.signature("f16"),
    })


_PTX_SOURCE = """
from genie_rt.kvcache.rope_write import rope_write_int8, rope_write_f16, rope_write_kernel
llama_int8_ring = rope_write_kernel("int8", neox=False, qk_norm=False, ring=True)
gemma_f16_ring = rope_write_kernel("f16", neox=True, qk_norm=True, ring=True)
"""


def test_ptx_compiles_without_f64(ptx_text):
    for name, per_cc in ptx_text.items():
        assert set(per_cc) == {(8, 7), (9, 0)}
        for cc, text in per_cc.items():
            assert_no_f64(text, where=f"{name} sm_{cc[0]}{cc[1]}")
            assert "shfl.sync.bfly" in text
    # the ring variant computes a slot (an integer remainder); the others do not
    for cc in ((8, 7), (9, 0)):
        assert "rem.s64" in ptx_text["gemma_f16_ring"][cc] or "rem.u64" in ptx_text["gemma_f16_ring"][cc]
        assert "rem." not in ptx_text["rope_write_f16"][cc]


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


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(1, 0), (1, 3000), (512, 0), (512, 700), (33, 1010)])
def test_gpu_rope_write_gemma3_ring(kv_dtype, n, start):
    # Gemma 3 270M: 4 / 1 heads, head_dim 256, local layer ring of 1023 slots, base 1e4
    from genie_rt.kvcache.rope_write import compile_for, rope_write_kernel
    compile_for(kv_dtype, ring=True)
    pool, q, refs = _case(4, 1, 256, n, start, 4096, kv_dtype, seed=n + start, slots=1023,
                          base=1e4)
    _check_ring(pool, q, refs, start, n)
    assert len(rope_write_kernel(kv_dtype, ring=True).overloads) == 1, "recompiled"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(1, 0), (1, 8000), (33, 100), (512, 77)])
def test_gpu_rope_write_smollm2(kv_dtype, n, start):
    # SmolLM2: 9 / 3 heads, head_dim 64, normal pairs, no QK-norm, base 1e5
    from genie_rt.kvcache.rope_write import compile_for, rope_write_kernel
    compile_for(kv_dtype, rope="normal", qk_norm=False)
    pool, q, refs = _case(9, 3, 64, n, start, 8192 + 64, kv_dtype, seed=n + start, rope="normal",
                          qk_norm=False, base=1e5)
    _check(pool, q, refs, start, n)
    assert len(rope_write_kernel(kv_dtype, neox=False, qk_norm=False).overloads) == 1
