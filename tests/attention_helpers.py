"""What the attention-kernel tests share (test_attention_decode.py, _prefill, _window,
_chain, _gpu): pools filled with random K/V (`make_pool`, and `make_ring_pool` for layers
kept as rings), the comparison `assert_close`, and runners that launch decode or prefill
attention and check it against the float64 reference on the *same* (dequantized) cache,
so only the kernels' arithmetic is measured (`run_decode`, `run_prefill`, and the
windowed `run_decode_w`, `run_prefill_w`); Gemma 3 270M's window and chunk.

Tolerances (|got - ref| <= atol + rtol * |ref|, atol relative to max |V|):
- decode: float32 math on exact int8/f16 values: 2e-5 * max|V| + 1e-5 * |ref|;
- prefill: q and P are rounded to f16 for the tensor cores (relative 2^-11 each; K and V
  are exact in f16): 4e-3 * max|V| + 4e-3 * |ref|.
"""
import numpy as np
from numba import cuda

from genie_rt.kvcache.attention import DecodeWorkspace, decode_attention, decode_reference, plan_decode
from genie_rt.kvcache.attention_prefill import (PrefillWorkspace, plan_prefill, prefill_attention,
                                                prefill_reference)
from genie_rt.kvcache.device_pool import DeviceKVPool
from genie_rt.kvcache.pool import KVShape, quantize_rows_int8


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


def byte_perm(x, y, s):
    """numpy __nv_byte_perm (the device's libdevice.byte_perm, PRMT): result byte n = byte
    (s >> 4n) & 7 of the 8 bytes {y:x}; x uint32 array, y uint32 array or scalar."""
    y = np.full_like(x, y)
    src = [(v >> np.uint32(8 * i)) & np.uint32(0xFF) for v in (x, y) for i in range(4)]
    out = np.zeros_like(x)
    for n in range(4):
        out |= src[(s >> 4 * n) & 7] << np.uint32(8 * n)
    return out


def assert_close(got, ref, atol, rtol, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    bad = ~(err <= atol + rtol * np.abs(ref))          # a NaN is off too (NaN <= x is False)
    if bad.any():
        excess = np.where(np.isnan(err), np.inf, err - atol - rtol * np.abs(ref))
        i = np.unravel_index(np.argmax(np.where(bad, excess, -np.inf)), got.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; worst at {i}: "
                             f"got {got[i]:.7g} ref {ref[i]:.7g} "
                             f"(atol {atol:.3g}, rtol {rtol:.3g})")


def run_decode(pool, kd, vd, n_head, pos, layer=1, seed=1, tol=(2e-5, 1e-5), pdl=False, **plan_kw):
    """tol: (atol as a fraction of max |v|, rtol) against decode_reference."""
    n_kv, hd = pool.shape.n_kv_heads, pool.shape.head_dim
    plan = plan_decode(n_head, n_kv, hd, pool.shape.dtype, pool.n_ctx, **plan_kw)
    ws = DecodeWorkspace(plan)
    ws.part_o.copy_to_device(np.full(ws.part_o.shape, np.nan, np.float32))   # NaN: no split wrote
    q = np.random.default_rng(seed).standard_normal((n_head, hd)).astype(np.float32) * 2
    out = cuda.device_array(n_head * hd, np.float32)
    state = cuda.to_device(np.array([pos], np.int32))
    decode_attention(cuda.to_device(q), pool.layer(layer), state, out, ws, pdl=pdl)
    cuda.synchronize()
    ref = decode_reference(q, kd[layer], vd[layer], pos)
    atol = tol[0] * np.abs(vd[layer]).max()
    got = out.copy_to_host()
    assert_close(got, ref, atol, tol[1], f"decode pos {pos} {plan}")
    run_decode.out = got
    assert not ws.tickets.copy_to_host().any(), "tickets must be zero after a launch"
    # the splits whose blocks wrote partials (none when one split read the whole context)
    written = ~np.isnan(ws.part_o.copy_to_host()).all(axis=1)
    run_decode.splits_written = [int(i) for i in np.flatnonzero(written)]
    return plan


def run_prefill(pool, kd, vd, n_head, n, start, n_splits=1, layer=0, seed=2, used=None, **plan_kw):
    """used: the split count in use, from the device state (state[1]; n_splits is then the
    launch's most), as a bucket's graph runs it."""
    n_kv, hd = pool.shape.n_kv_heads, pool.shape.head_dim
    plan = plan_prefill(n_head, n_kv, hd, pool.shape.dtype, n_max=n, **plan_kw)
    ws = PrefillWorkspace(plan)
    if plan.max_splits > 1:       # NaN where no split wrote: a split block that ran shows
        ws.part_o.copy_to_device(np.full(ws.part_o.shape, np.nan, np.float32))
    q = np.random.default_rng(seed).standard_normal((n, n_head, hd)).astype(np.float32) * 2
    out = cuda.device_array((n, n_head * hd), np.float32)
    state = cuda.to_device(np.array([start, 0 if used is None else used], np.int32))
    prefill_attention(cuda.to_device(q), pool.layer(layer), state, out, ws, n_splits=n_splits,
                      splits_at=None if used is None else 1)
    cuda.synchronize()
    ref = prefill_reference(q, kd[layer], vd[layer], start)
    vmax = np.abs(vd[layer][:start + n]).max()
    assert_close(out.copy_to_host(), ref, 4e-3 * vmax, 4e-3,
                 f"prefill n {n} start {start} splits {n_splits} {plan}")
    if used is not None:          # which splits' blocks wrote partials
        written = ~np.isnan(ws.part_o.copy_to_host()[:, :n * n_head]).all(axis=(1, 2))
        run_prefill.splits_written = [int(i) for i in np.flatnonzero(written)]
    return plan


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


def run_decode_w(pool, kd, vd, n_head, pos, window, scale=None, layer=0, seed=1, tol=(2e-5, 1e-5),
                 **plan_kw):
    """tol: (atol as a fraction of max |v|, rtol) against decode_reference."""
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
    assert_close(out.copy_to_host(), ref, tol[0] * np.abs(vd[layer]).max(), tol[1],
                 f"decode pos {pos} window {window} {plan}")
    assert not ws.tickets.copy_to_host().any()
    return plan


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


# Gemma 3 270M: window 512, prefill chunks of 512
GEMMA_W, GEMMA_CHUNK = 512, 512
GEMMA_R = GEMMA_W + GEMMA_CHUNK - 1          # kvcache.pool.ring_slots(512, 512, n_ctx)
