"""Tests for genie_rt.kvcache.attention (decode) and attention_prefill (causal prefill).

- simulator (no GPU) or device: tiny shapes (4 q heads, 2 kv heads, head_dim 32/64,
  n_ctx <= 64), int8 and f16 caches, against engine.models.reference.attention run in float64 on
  the *same* (dequantized) cache, so only the kernels' arithmetic is measured;
- PTX: every kernel compiles for sm_87 and sm_90, no float64 instructions, and the
  prefill kernel uses mma.sync + ldmatrix;
- GPU (`-m gpu`): Qwen3-4B shapes (32 / 8 heads, head_dim 128), contexts 1 .. 4096,
  prefill n = 33 and 512 at start 0 and start > 0, with and without context splits;
  Gemma 3 270M (4 / 1 heads, head_dim 256, window 512 on a ring of 1023 slots) and
  SmolLM2 (9 / 3 heads, head_dim 64) shapes.
- sliding windows and rings (simulator): windows inside / wider than the context and
  smaller than the chunk, wrapped rings with R = W + n - 1 exactly, head_dim 64 with
  group 3, head_dim 256 with one KV head, an explicit scale; references are
  attention_window_reference (engine.models.reference's attention plus llama.cpp's SWA mask) on
  every position 0 .. T-1, of which the ring holds the last R.

Tolerances (|got - ref| <= atol + rtol * |ref|, atol relative to max |V|):
- decode: float32 math on exact int8/f16 values: 2e-5 * max|V| + 1e-5 * |ref|;
- prefill: q and P are rounded to f16 for the tensor cores (relative 2^-11 each; K and V
  are exact in f16): 4e-3 * max|V| + 4e-3 * |ref|.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.kvcache.attention import (DecodeWorkspace, decode_attention, decode_reference,
                                        plan_decode)
from genie_rt.kvcache.device_pool import DeviceKVPool
from genie_rt.kvcache.pool import KVShape, quantize_rows_int8, ring_slots
from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess

SIM_SHAPE = dict(n_head=4, n_kv=2)


def make_pool(n_kv, hd, n_ctx, kv_dtype, filled, seed=0, layers=2):
    """A pool whose positions 0 .. filled-1 of every layer hold random K/V; returns the pool
    and the float64 dequantized K, V [layers, filled, n_kv, hd] it holds."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, filled, n_kv, hd)) * 2
    v = rng.standard_normal((layers, filled, n_kv, hd))
    k[..., 3] += 4                      # a few large, shared directions: peaky softmax
    pool = DeviceKVPool(KVShape(layers, n_ctx, n_kv, hd, kv_dtype))
    if kv_dtype == "int8":
        kq, ks = quantize_rows_int8(k)
        vq, vs = quantize_rows_int8(v)
        arrays = dict(k=kq, v=vq, k_scale=ks, v_scale=vs)
        kd = kq.astype(np.float64) * ks[..., None]
        vd = vq.astype(np.float64) * vs[..., None]
    else:
        arrays = dict(k=k.astype(np.float16), v=v.astype(np.float16))
        kd, vd = arrays["k"].astype(np.float64), arrays["v"].astype(np.float64)
    pool.import_positions(arrays, filled)
    return pool, kd, vd


def assert_close(got, ref, atol, rtol, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    if bad.any():
        i = np.unravel_index(np.argmax(err - rtol * np.abs(ref)), got.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; worst at {i}: "
                             f"got {got[i]:.7g} ref {ref[i]:.7g} "
                             f"(atol {atol:.3g}, rtol {rtol:.3g})")


def run_decode(pool, kd, vd, n_head, pos, layer=1, seed=1, **plan_kw):
    n_kv, hd = pool.shape.n_kv_heads, pool.shape.head_dim
    plan = plan_decode(n_head, n_kv, hd, pool.shape.dtype, pool.n_ctx, **plan_kw)
    ws = DecodeWorkspace(plan)
    q = np.random.default_rng(seed).standard_normal((n_head, hd)).astype(np.float32) * 2
    out = cuda.device_array(n_head * hd, np.float32)
    state = cuda.to_device(np.array([pos], np.int32))
    decode_attention(cuda.to_device(q), pool.layer(layer), state, out, ws)
    cuda.synchronize()
    ref = decode_reference(q, kd[layer], vd[layer], pos)
    atol = 2e-5 * np.abs(vd[layer]).max()
    assert_close(out.copy_to_host(), ref, atol, 1e-5, f"decode pos {pos} {plan}")
    assert not ws.tickets.copy_to_host().any(), "tickets must be zero after a launch"
    return plan


def _byte_perm(x, y, s):
    """numpy __nv_byte_perm: result byte n = byte (s >> 4n) & 7 of the 8 bytes {y:x}."""
    y = np.full_like(x, y)
    src = [(v >> np.uint32(8 * i)) & np.uint32(0xFF) for v in (x, y) for i in range(4)]
    out = np.zeros_like(x)
    for n in range(4):
        out |= src[(s >> 4 * n) & 7] << np.uint32(8 * n)
    return out


def test_int8_to_float_magic_is_exact():
    # what the device _byte computes (the simulator runs the plain version)
    from genie_rt.kvcache.attention import MAGIC_I8
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    words[:256] = np.arange(256, dtype=np.uint32) * np.uint32(0x01010101)   # every byte value
    signed = words.view(np.int8).reshape(-1, 4).astype(np.float32)
    for b in range(4):
        bits = _byte_perm(words ^ np.uint32(0x80808080), np.uint32(0x4B000000), 0x7440 | b)
        got = bits.view(np.float32) - MAGIC_I8
        assert np.array_equal(got, signed[:, b]), b


# ---- decode: simulator ------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("pos", [0, 40])
def test_decode_one_split(kv_dtype, pos):
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 48)
    plan = run_decode(pool, kd, vd, 4, pos, n_splits=1)
    assert plan.n_splits == 1


@pytest.mark.parametrize("kv_dtype,pos,n_splits", [
    ("int8", 5, 3), ("int8", 30, 3), ("int8", 63, 64), ("f16", 30, 3), ("f16", 63, 4)])
def test_decode_splits_merge(kv_dtype, pos, n_splits):
    # tiny tiles (1 warp, 1 row per thread: 8 rows int8, 4 rows f16) so a 64-position
    # pool has many tiles; splits beyond the run-time context exit at once
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=pos)
    plan = run_decode(pool, kd, vd, 4, pos, n_splits=n_splits, warps=1, rows_per_thread=1)
    assert plan.n_splits == min(n_splits, 64 // plan.tile)


def test_decode_head_dim_32_and_group_4():
    pool, kd, vd = make_pool(1, 32, 32, "int8", 32)
    run_decode(pool, kd, vd, 4, 31, n_splits=2, warps=1, rows_per_thread=2)


def test_decode_graph_style_replay_reuses_workspace():
    # the same workspace and launch at growing positions (what a replayed graph does)
    pool, kd, vd = make_pool(2, 64, 64, "int8", 64, seed=5)
    plan = plan_decode(4, 2, 64, "int8", 64, n_splits=3, warps=1, rows_per_thread=1)
    ws = DecodeWorkspace(plan)
    q = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    qd = cuda.to_device(q)
    out = cuda.device_array(4 * 64, np.float32)
    state = cuda.to_device(np.zeros(1, np.int32))
    for pos in (3, 21, 63):
        state.copy_to_device(np.array([pos], np.int32))
        decode_attention(qd, pool.layer(0), state, out, ws)
        ref = decode_reference(q, kd[0], vd[0], pos)
        assert_close(out.copy_to_host(), ref, 2e-5 * np.abs(vd[0]).max(), 1e-5, f"pos {pos}")


def test_decode_rejects_mismatched_cache():
    pool, _, _ = make_pool(2, 64, 16, "f16", 4)
    plan = plan_decode(4, 2, 64, "int8", 16)
    with pytest.raises(ValueError, match="cache dtype"):
        decode_attention(cuda.device_array(256, np.float32), pool.layer(0),
                         cuda.to_device(np.zeros(1, np.int32)), cuda.device_array(256, np.float32),
                         DecodeWorkspace(plan))
    with pytest.raises(ValueError, match="not a multiple"):
        plan_decode(6, 4, 64, "int8", 16)


def test_plan_decode_defaults():
    p = plan_decode(32, 8, 128, "int8", 4096, sm_count=132)
    assert (p.tile, p.n_sub, p.heads_per_block) == (64, 1, 4)
    assert p.n_splits == 33 and p.workspace_bytes >= 33 * 32 * 130 * 4
    p = plan_decode(64, 8, 128, "int8", 40960, sm_count=132)       # group 8: two subgroups
    assert (p.n_sub, p.heads_per_block) == (2, 4)
    p = plan_decode(64, 8, 128, "f16", 100, sm_count=132)
    assert (p.n_sub, p.heads_per_block, p.tile) == (1, 8, 32) and p.n_splits == 4


# ---- prefill: simulator -----------------------------------------------------------------
from genie_rt.kvcache.attention_prefill import (PrefillWorkspace, plan_prefill,  # noqa: E402
                                                prefill_attention, prefill_reference,
                                                prefill_splits)


def run_prefill(pool, kd, vd, n_head, n, start, n_splits=1, layer=0, seed=2, **plan_kw):
    n_kv, hd = pool.shape.n_kv_heads, pool.shape.head_dim
    plan = plan_prefill(n_head, n_kv, hd, pool.shape.dtype, n_max=n, **plan_kw)
    ws = PrefillWorkspace(plan)
    q = np.random.default_rng(seed).standard_normal((n, n_head, hd)).astype(np.float32) * 2
    out = cuda.device_array((n, n_head * hd), np.float32)
    state = cuda.to_device(np.array([start], np.int32))
    prefill_attention(cuda.to_device(q), pool.layer(layer), state, out, ws, n_splits=n_splits)
    cuda.synchronize()
    ref = prefill_reference(q, kd[layer], vd[layer], start)
    vmax = np.abs(vd[layer][:start + n]).max()
    assert_close(out.copy_to_host(), ref, 4e-3 * vmax, 4e-3,
                 f"prefill n {n} start {start} splits {n_splits} {plan}")
    return plan


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("n,start", [(1, 0), (5, 9), (17, 0), (17, 9)])
def test_prefill_small(kv_dtype, n, start):
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 64, seed=n)
    run_prefill(pool, kd, vd, 4, n, start)


@pytest.mark.parametrize("kv_dtype,hd,n,start,n_splits", [
    ("int8", 64, 5, 40, 3),     # short chunk after a long prefix, split over the context
    ("f16", 64, 17, 9, 2),
    ("int8", 32, 40, 0, 1),     # 80 packed rows: two row tiles, causal mask on 3 key tiles
    ("int8", 32, 13, 50, 4),    # uneven split: the last split has one tile
])
def test_prefill_tiles_and_splits(kv_dtype, hd, n, start, n_splits):
    # 16-key tiles so a 64-position pool has several
    pool, kd, vd = make_pool(2, hd, 64, kv_dtype, 64, seed=start)
    run_prefill(pool, kd, vd, 4, n, start, n_splits=n_splits, max_splits=4, bn=16)


def test_prefill_group_4():
    pool, kd, vd = make_pool(1, 32, 32, "int8", 32, seed=7)
    run_prefill(pool, kd, vd, 4, 7, 20, n_splits=2, max_splits=2, bn=16)


def test_prefill_splits_heuristic():
    plan = plan_prefill(32, 8, 128, "int8", n_max=512)
    assert prefill_splits(plan, 512, 0, sm_count=132) == 1
    assert prefill_splits(plan, 33, 0, sm_count=132) == 1            # one key tile
    assert prefill_splits(plan, 33, 4000, sm_count=132) == 6         # 24 blocks -> 144
    assert plan.workspace_bytes >= 8 * 512 * 32 * 130 * 4


def test_prefill_rejects_bad_arguments():
    pool, _, _ = make_pool(2, 64, 16, "int8", 4)
    plan = plan_prefill(4, 2, 64, "int8", n_max=4, max_splits=1)
    ws = PrefillWorkspace(plan)
    state = cuda.to_device(np.zeros(1, np.int32))
    q = cuda.device_array((4, 4, 64), np.float32)
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention(q, pool.layer(0), state, cuda.device_array((4, 64), np.float32), ws)
    with pytest.raises(ValueError, match="n_splits"):
        prefill_attention(q, pool.layer(0), state, cuda.device_array((4, 256), np.float32), ws,
                          n_splits=2)
    with pytest.raises(ValueError, match="head_dim"):
        plan_prefill(4, 2, 512, "int8", 8)


# ---- sliding windows, rings, attention scale, head_dim 256 / 64 with an odd group --------
def make_ring_pool(n_kv, hd, n_ctx, slots, kv_dtype, T, seed=0, layers=1):
    """A pool whose layers are rings of `slots` slots after positions 0 .. T-1 were written
    in order (the ring holds the last min(T, slots)); returns the pool and the float64
    dequantized K, V [layers, T, n_kv, hd] of *every* position 0 .. T-1, in position order
    (the reference sees all of them; only the window may be read)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, T, n_kv, hd)) * 2
    v = rng.standard_normal((layers, T, n_kv, hd))
    k[..., 3] += 4
    pool = DeviceKVPool(KVShape(layers, n_ctx, n_kv, hd, kv_dtype, slots=(slots,) * layers))
    if kv_dtype == "int8":
        kq, ks = quantize_rows_int8(k)
        vq, vs = quantize_rows_int8(v)
        arrays = dict(k=kq, v=vq, k_scale=ks, v_scale=vs)
        kd, vd = kq * ks[..., None].astype(np.float64), vq * vs[..., None].astype(np.float64)
    else:
        arrays = dict(k=k.astype(np.float16), v=v.astype(np.float16))
        kd, vd = arrays["k"].astype(np.float64), arrays["v"].astype(np.float64)
    first = max(0, T - slots)
    pool.import_window({n: a[:, first:] for n, a in arrays.items()}, first, T)
    return pool, kd, vd


def run_decode_w(pool, kd, vd, n_head, pos, window, scale=None, layer=0, seed=1, **plan_kw):
    n_kv, hd = pool.shape.n_kv_heads, pool.shape.head_dim
    plan = plan_decode(n_head, n_kv, hd, pool.shape.dtype, pool.n_ctx, window=window,
                       scale=scale, **plan_kw)
    ws = DecodeWorkspace(plan)
    q = np.random.default_rng(seed).standard_normal((n_head, hd)).astype(np.float32) * 2
    out = cuda.device_array(n_head * hd, np.float32)
    state = cuda.to_device(np.array([pos], np.int32))
    decode_attention(cuda.to_device(q), pool.layer(layer), state, out, ws)
    cuda.synchronize()
    ref = decode_reference(q, kd[layer], vd[layer], pos, window, scale)
    assert_close(out.copy_to_host(), ref, 2e-5 * np.abs(vd[layer]).max(), 1e-5,
                 f"decode pos {pos} window {window} {plan}")
    assert not ws.tickets.copy_to_host().any()
    return plan


def test_window_reference_is_the_plain_one_with_a_mask():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, 4, 16))
    k, v = rng.standard_normal((2, 12, 2, 16))
    from genie_rt.kvcache.attention import attention_window_reference as ref
    full = ref(q, k, v, 7)
    assert np.allclose(ref(q, k, v, 7, window=12), full)        # a window wider than the context
    got = ref(q, k, v, 7, window=3, scale=0.3)
    for i in range(5):                                          # query 7 + i sees 5 + i .. 7 + i
        lo = 7 + i - 2
        one = ref(q[i:i + 1], k[lo:8 + i] * 0.3 * 4, v[lo:8 + i], 8 + i - lo - 1)
        assert np.allclose(got[i], one[0])


@pytest.mark.parametrize("kv_dtype,pos,window,n_splits", [
    ("int8", 20, 5, 1),        # window inside the context, one split
    ("f16", 47, 13, 3),        # window over several tiles and splits
    ("int8", 3, 8, 2),         # context shorter than the window
])
def test_decode_window_on_an_ordinary_layer(kv_dtype, pos, window, n_splits):
    pool, kd, vd = make_pool(2, 64, 64, kv_dtype, 48, layers=1)
    run_decode_w(pool, kd, vd, 4, pos, window, n_splits=n_splits, warps=1, rows_per_thread=1)


@pytest.mark.parametrize("kv_dtype,T,slots,window,n_splits", [
    ("int8", 30, 12, 12, 2),   # ring full, oldest position 18 in slot 6: the window wraps
    ("f16", 40, 13, 9, 3),     # ring larger than the window (prefill chunk room)
    ("int8", 7, 12, 12, 1),    # not wrapped yet
])
def test_decode_window_through_a_ring(kv_dtype, T, slots, window, n_splits):
    pool, kd, vd = make_ring_pool(2, 32, 64, slots, kv_dtype, T, seed=T)
    plan = run_decode_w(pool, kd, vd, 4, T - 1, window, n_splits=n_splits, warps=1,
                        rows_per_thread=1)
    assert plan.window == window


def test_decode_head_dim_64_group_3_and_a_scale():
    # SmolLM2's shape: 9 q heads over 3 kv heads; Gemma 3 27B's kind of explicit scale
    pool, kd, vd = make_pool(3, 64, 32, "int8", 32, layers=1, seed=4)
    plan = run_decode_w(pool, kd, vd, 9, 29, 20, scale=0.07, n_splits=2, warps=1,
                        rows_per_thread=2)          # keys 10 .. 29: two 16-row tiles
    assert (plan.heads_per_block, plan.n_sub, plan.n_splits) == (3, 1, 2)


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_decode_head_dim_256_one_kv_head_ring(kv_dtype):
    # Gemma 3 270M's shape (4 q heads, 1 kv head, head_dim 256) on a wrapped ring
    pool, kd, vd = make_ring_pool(1, 256, 64, 10, kv_dtype, 23, seed=6)
    run_decode_w(pool, kd, vd, 4, 22, 8, n_splits=2, warps=1, rows_per_thread=2)


def test_decode_window_plans_and_refusals():
    p = plan_decode(4, 1, 256, "int8", 32768, window=512, sm_count=132)
    g = plan_decode(4, 1, 256, "int8", 32768, sm_count=132)
    assert (p.tile, p.n_splits, g.n_splits, p.window) == (32, 16, 64, 512)   # 512 keys: 16 tiles
    assert p.fits(g) and not g.fits(p)
    pool, _, _ = make_ring_pool(2, 32, 64, 8, "int8", 10)
    state = cuda.to_device(np.zeros(1, np.int32))
    q, out = cuda.device_array(128, np.float32), cuda.device_array(128, np.float32)
    glob = plan_decode(4, 2, 32, "int8", 64, n_splits=2)
    with pytest.raises(ValueError, match="needs a windowed plan"):
        decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(glob))
    wide = plan_decode(4, 2, 32, "int8", 64, n_splits=2, window=9)
    with pytest.raises(ValueError, match="window 9 > the layer's 8 slots"):
        decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(wide))
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q, pool.layer(0), state, out, DecodeWorkspace(glob),
                         plan=plan_decode(8, 2, 32, "int8", 64, window=8))
    with pytest.raises(ValueError, match="window"):
        plan_decode(4, 2, 32, "int8", 64, window=-1)
    with pytest.raises(ValueError, match="scale"):
        plan_decode(4, 2, 32, "int8", 64, scale=0.0)


def run_prefill_w(pool, kd, vd, n_head, n, start, window, n_splits=1, scale=None, layer=0,
                  seed=2, **plan_kw):
    n_kv, hd = pool.shape.n_kv_heads, pool.shape.head_dim
    plan = plan_prefill(n_head, n_kv, hd, pool.shape.dtype, n_max=n, window=window, scale=scale,
                        **plan_kw)
    ws = PrefillWorkspace(plan)
    q = np.random.default_rng(seed).standard_normal((n, n_head, hd)).astype(np.float32) * 2
    out = cuda.device_array((n, n_head * hd), np.float32)
    state = cuda.to_device(np.array([start], np.int32))
    prefill_attention(cuda.to_device(q), pool.layer(layer), state, out, ws, n_splits=n_splits)
    cuda.synchronize()
    ref = prefill_reference(q, kd[layer], vd[layer], start, window, scale)
    vmax = np.abs(vd[layer][:start + n]).max()
    assert_close(out.copy_to_host(), ref, 4e-3 * vmax, 4e-3,
                 f"prefill n {n} start {start} window {window} splits {n_splits} {plan}")
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,n,start,window,n_splits", [
    ("int8", 9, 5, 4, 1),      # window smaller than the chunk: rows lose keys inside it
    ("f16", 9, 30, 4, 2),      # ... after a prefix, split over the window's tiles
    ("int8", 5, 40, 20, 3),    # short chunk, window over several 16-key tiles
])
def test_prefill_window_on_an_ordinary_layer(kv_dtype, n, start, window, n_splits):
    pool, kd, vd = make_pool(2, 32, 64, kv_dtype, 64, seed=start, layers=1)
    run_prefill_w(pool, kd, vd, 4, n, start, window, n_splits, max_splits=4, bn=16)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,n,start,window,n_splits", [
    ("int8", 6, 20, 7, 1),     # R = W + n - 1 = 12 exactly; keys 14 .. 25 wrap the ring
    ("f16", 6, 37, 7, 2),
])
def test_prefill_window_through_a_ring(kv_dtype, n, start, window, n_splits):
    slots = window + n - 1
    pool, kd, vd = make_ring_pool(2, 32, 64, slots, kv_dtype, start + n, seed=start)
    run_prefill_w(pool, kd, vd, 4, n, start, window, n_splits, max_splits=2, bn=16)


@pytest.mark.slow
def test_prefill_head_dim_64_group_3():
    pool, kd, vd = make_pool(3, 64, 32, "int8", 32, layers=1, seed=3)
    run_prefill_w(pool, kd, vd, 9, 7, 11, 0, n_splits=2, scale=0.1, max_splits=2, bn=16)
    run_prefill_w(pool, kd, vd, 9, 7, 11, 6, bn=16)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,n_splits", [("int8", 1), ("f16", 2)])
def test_prefill_head_dim_256_one_kv_head(kv_dtype, n_splits):
    # Gemma 3 270M's shape: O in two column halves per row block (o_splits = 2)
    pool, kd, vd = make_ring_pool(1, 256, 64, 12, kv_dtype, 20, seed=7)
    plan = run_prefill_w(pool, kd, vd, 4, 5, 15, 8, n_splits, max_splits=2)
    assert plan.o_splits == 2 and plan.block_n == 16


def test_prefill_window_plans_and_refusals():
    plan = plan_prefill(4, 1, 256, "int8", n_max=512, window=512)
    # 6 blocks (3 row tiles x 2 column halves); 511 + 33 keys = 34 tiles: 8 splits
    assert prefill_splits(plan, 33, 30000, sm_count=132) == 8
    assert prefill_splits(plan, 33, 20, sm_count=132) == 1                 # 53 keys: 4 tiles
    assert plan_prefill(4, 1, 256, "f16", n_max=16).o_splits == 2
    pool, _, _ = make_ring_pool(2, 32, 64, 10, "int8", 10)
    state = cuda.to_device(np.zeros(1, np.int32))
    q, out = cuda.device_array((5, 4, 32), np.float32), cuda.device_array((5, 128), np.float32)
    with pytest.raises(ValueError, match="needs a windowed plan"):
        prefill_attention(q, pool.layer(0), state, out, PrefillWorkspace(plan_prefill(4, 2, 32, "int8", 5)))
    with pytest.raises(ValueError, match="reads 11 keys at once; the ring holds 10"):
        prefill_attention(q, pool.layer(0), state, out,
                          PrefillWorkspace(plan_prefill(4, 2, 32, "int8", 5, window=7)))
    with pytest.raises(ValueError, match="does not fit"):
        prefill_attention(q, pool.layer(0), state, out,
                          PrefillWorkspace(plan_prefill(4, 2, 32, "int8", 5, window=6)),
                          plan=plan_prefill(4, 2, 32, "int8", 9, window=6))
    with pytest.raises(ValueError, match="head_dim"):
        plan_prefill(4, 1, 272, "int8", 8)
    with pytest.raises(ValueError, match="head_dim"):
        plan_prefill(4, 1, 176, "int8", 8)     # two halves of 88: not a multiple of 16


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


# ---- PTX --------------------------------------------------------------------------------
_PTX_SOURCE = """
from genie_rt.kvcache.attention import decode_kernel
from genie_rt.kvcache.attention_prefill import prefill_kernel, prefill_merge
decode_int8 = decode_kernel(128, 4, "int8")
decode_f16 = decode_kernel(128, 8, "f16")
prefill_int8 = prefill_kernel(128, 4, "int8")
prefill_f16 = prefill_kernel(128, 4, "f16")
# Gemma 3 270M (4 / 1 heads, head_dim 256, window 512) and SmolLM2 (9 / 3 heads, hd 64)
decode_gemma_int8 = decode_kernel(256, 4, "int8", 4, 4, 512)
decode_gemma_f16 = decode_kernel(256, 4, "f16", 4, 4, 512)
decode_smol_int8 = decode_kernel(64, 3, "int8")
prefill_gemma_int8 = prefill_kernel(256, 4, "int8", 0, 512)
prefill_gemma_f16 = prefill_kernel(256, 4, "f16", 0, 512)
prefill_smol_int8 = prefill_kernel(64, 3, "int8")
"""
# the quick suite compiles Qwen3's kernels and one of each new kind (window + hd 256 +
# one KV head, group 3); the f16 twins and SmolLM2's decode (~10 s more) are `slow`
_QUICK = ("decode_int8", "decode_f16", "decode_gemma_int8", "prefill_int8", "prefill_f16",
          "prefill_gemma_int8", "prefill_smol_int8")
_MORE = ("decode_gemma_f16", "decode_smol_int8", "prefill_gemma_f16")


def _compile_ptx(names, merge):
    from genie_rt.kvcache.attention import DECODE_SIGNATURE
    from genie_rt.kvcache.attention_prefill import MERGE_SIGNATURE, PREFILL_SIGNATURE
    kernels = {name: DECODE_SIGNATURE if name.startswith("decode") else PREFILL_SIGNATURE
               for name in names}
    if merge:
        kernels["prefill_merge"] = MERGE_SIGNATURE
    return compile_in_subprocess(_PTX_SOURCE, kernels)


@pytest.fixture(scope="module")
def ptx_text():
    return _compile_ptx(_QUICK, merge=True)


def _check_ptx(ptx_text):
    from ptx_helpers import local_memory_bytes
    for name, per_cc in ptx_text.items():
        assert set(per_cc) == {(8, 7), (9, 0)}
        for cc, text in per_cc.items():
            where = f"{name} sm_{cc[0]}{cc[1]}"
            assert_no_f64(text, where=where)
            # the per-thread arrays (q slices, accumulators, fragments) must be registers
            assert local_memory_bytes(text) == 0, f"{where}: local memory used"
            if name.startswith("decode"):
                assert_ptx_contains(text, "ld.global.nc.v4.u32", "atom.global.add", "membar.gl",
                                    where=where)
            elif name.startswith("prefill_") and name != "prefill_merge":
                assert_ptx_contains(text, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                    "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                                    "ld.global.nc.v4.u32", where=where)


def test_ptx_all_kernels_compile_without_f64_or_local_memory(ptx_text):
    """No f64, no local memory; decode uses 128-bit loads and the atomic merge, prefill
    the tensor cores (mma.sync, ldmatrix)."""
    assert set(ptx_text) == set(_QUICK) | {"prefill_merge"}
    _check_ptx(ptx_text)


@pytest.mark.slow
def test_ptx_more_variants_compile():
    _check_ptx(_compile_ptx(_MORE, merge=False))


# ---- GPU: Qwen3-4B shapes ---------------------------------------------------------------
QWEN3_4B = dict(n_head=32, n_kv=8, hd=128)


@pytest.fixture(scope="module", params=["int8", "f16"])
def pool_4b(request):
    """One layer of 4096 + 64 positions, all filled."""
    return make_pool(QWEN3_4B["n_kv"], QWEN3_4B["hd"], 4096 + 64, request.param, 4096 + 64,
                     seed=11, layers=1)


@pytest.mark.gpu
@pytest.mark.parametrize("pos", [0, 1, 63, 64, 100, 1023, 2500, 4095])
def test_gpu_decode_qwen3_4b(pool_4b, pos):
    from genie_rt.kvcache.attention import compile_decode
    pool, kd, vd = pool_4b
    compile_decode(plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx))
    run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos)                # default splits
    run_decode(pool, kd, vd, 32, pos, layer=0, seed=pos, n_splits=1)    # one block per head
    plan = plan_decode(32, 8, 128, pool.shape.dtype, pool.n_ctx)
    assert len(plan.kernel().overloads) == 1, "a launch recompiled: signature mismatch"


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
    from genie_rt.kvcache.attention_prefill import prefill_merge
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
GEMMA_W, GEMMA_CHUNK = 512, 512
GEMMA_R = GEMMA_W + GEMMA_CHUNK - 1          # kvcache.pool.ring_slots(512, 512, n_ctx)


def _no_spills(kernel, what):
    local = kernel.get_local_mem_per_thread()
    assert all(v == 0 for v in local.values()), f"{what}: local memory (spills) {local}"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("T", [1, 300, 512, 513, 1023, 1024, 1500, 4000])
def test_gpu_decode_gemma3_ring(kv_dtype, T):
    from genie_rt.kvcache.attention import compile_decode
    pool, kd, vd = make_ring_pool(1, 256, 4096, GEMMA_R, kv_dtype, T, seed=T)
    plan = plan_decode(4, 1, 256, kv_dtype, 4096, window=GEMMA_W)
    compile_decode(plan)
    run_decode_w(pool, kd, vd, 4, T - 1, GEMMA_W, seed=T)
    run_decode_w(pool, kd, vd, 4, T - 1, GEMMA_W, seed=T, n_splits=1)
    _no_spills(plan.kernel(), f"decode gemma {kv_dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_gpu_decode_gemma3_global_and_smollm2(kv_dtype):
    pool, kd, vd = make_pool(1, 256, 4096, kv_dtype, 4096, seed=3, layers=1)
    for pos in (0, 511, 2047, 4095):
        run_decode_w(pool, kd, vd, 4, pos, 0, seed=pos)
    pool, kd, vd = make_pool(3, 64, 2048 + 64, kv_dtype, 2048 + 64, seed=4, layers=1)
    for pos in (0, 100, 2100):
        run_decode_w(pool, kd, vd, 9, pos, 0, seed=pos)
        plan = run_decode_w(pool, kd, vd, 9, pos, 0, scale=0.1, seed=pos, n_splits=3)
    _no_spills(plan.kernel(), f"decode smollm2 {kv_dtype}")


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
