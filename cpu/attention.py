"""Causal GQA attention over one layer's KV cache on the CPU, and the K/V write into it.

    attention(q, k, v, k_scale, v_scale, start, scale, window=0, ring=0, out=None) -> out
        q        float32 [n, n_head, hd]    queries at positions start .. start + n - 1
        k, v     [slots, n_kv, hd]          int8 (with k_scale, v_scale float32 [slots, n_kv]),
                                            float16 or float32 (scales None)
        scale    the score scale (1/sqrt(hd) for most models; Gemma 3: query_pre_attn_scalar^-0.5)
        window   W > 0: query p1 sees keys p0 with p1 - W < p0 <= p1 (Gemma 3's local layers);
                 0: every p0 <= p1
        ring     R > 0: position p lives in slot p % R (a sliding layer's ring of R >= W + n - 1
                 slots); 0: in slot p
        out      float32 [n, n_head * hd]
    kv_write(k_new, v_new, k, v, k_scale, v_scale, start, ring=0)
        k_new, v_new float32 [n, n_kv, hd] -> slots (start + i) % R (or start + i): int8 rows
        quantized exactly as kvcache/pool.py's quantize_rows_int8 (one absmax scale per
        (position, kv head)), or converted to float16 (round to nearest even) / float32.

The cache arrays are one layer of kvcache/pool.py's HostKVPool (pool.k[layer], ...),
and the row format is the pool's, so the CPU and CUDA back-ends share saved files.

Who owns what: `prange` over nt chunks of the n * n_head (query, head) pairs; a pair is
computed by one thread, start to end, over its keys in position order:

    s[j]   = (q . k_j) * k_scale_j * scale       q . k_j: 64-wide chunks (16 if hd % 64),
                                                  each a fixed-order tree (simd.dot_f32_*)
    m      = max_j s[j];  p[j] = exp(s[j] - m);  l = sum_j p[j]   (in position order)
    out    = (sum_j (p[j] * v_scale_j) * v_j) / l                  (in position order)

so each output depends only on its query row and the cache, never on n or the thread
count: a prompt prefilled in one chunk or token by token gives the same bits. The score
and probability rows live in a per-thread buffer of (longest key range) floats. exp is
ops-style polynomial (within 3 ulp of expf), so the loops vectorise.

What it deliberately does not do: split one (query, head) over threads (flash-decoding
would make the bits depend on the split), soft-capping or ALiBi, or own the cache
(the pool does; the ring views of the pool are another module's).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .jit import kernel
from .ops import _exp
from .simd import dot_f32, dot_f32_f16, dot_f32_i8, load_f16, store_f16
from .threads import get_threads

# -- numpy reference --------------------------------------------------------------------


def slot_of(p, ring: int):
    return p % ring if ring else p


def attention_reference(q, k, v, k_scale, v_scale, start: int, scale: float, window: int = 0,
                        ring: int = 0) -> np.ndarray:
    """float64 [n, n_head * hd]: dequantize the keys each query sees, then softmax."""
    q = np.asarray(q, np.float64)
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    kf = k.astype(np.float64) * (k_scale[..., None] if k_scale is not None else 1.0)
    vf = v.astype(np.float64) * (v_scale[..., None] if v_scale is not None else 1.0)
    out = np.zeros((n, n_head, hd))
    for i in range(n):
        p1 = start + i
        lo = max(0, p1 - window + 1) if window else 0
        slots = slot_of(np.arange(lo, p1 + 1), ring)
        for h in range(n_head):
            s = kf[slots, h // group] @ q[i, h] * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vf[slots, h // group]
    return out.reshape(n, n_head * hd)


# -- kernels ----------------------------------------------------------------------------

@njit(inline="always")
def _keys(p1, window):
    """First visible key position of the query at p1."""
    return max(0, p1 - window + 1) if window > 0 else 0


@njit(inline="always")
def _softmax_weights(s, nk):
    """s[0:nk] scores -> exp(s - max) in place; returns their sum (position order)."""
    m = s[0]
    for j in range(1, nk):
        m = max(m, s[j])
    for j in range(nk):
        s[j] = _exp(s[j] - m)
    total = np.float32(0)
    for j in range(nk):
        total += s[j]
    return total


@kernel(parallel=True)
def _attention_int8(q, k, v, ks, vs, start, scale, window, ring, out, nt):
    """q float32 [n, H, hd]; k, v int8 [slots, n_kv, hd]; ks, vs float32 [slots, n_kv]."""
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    ch = 64 if hd % 64 == 0 else 16
    longest = start + n - _keys(start + n - 1, window)
    items = n * n_head
    for c in prange(nt):
        s = np.empty(longest, np.float32)            # this thread's score / weight row
        acc = np.empty(hd, np.float32)
        for it in range(items * c // nt, items * (c + 1) // nt):
            i = it // n_head
            h = it - i * n_head
            g = h // group
            p1 = start + i
            lo = _keys(p1, window)
            nk = p1 - lo + 1
            qo = (i * n_head + h) * hd
            for j in range(nk):
                slot = (lo + j) % ring if ring > 0 else lo + j
                ko = (slot * n_kv + g) * hd
                dot = np.float32(0)
                for d0 in range(0, hd, ch):
                    if ch == 64:
                        dot += dot_f32_i8(q, qo + d0, k, ko + d0, 64)
                    else:
                        dot += dot_f32_i8(q, qo + d0, k, ko + d0, 16)
                s[j] = dot * ks[slot, g] * scale
            total = _softmax_weights(s, nk)
            acc[:] = 0
            for j in range(nk):
                slot = (lo + j) % ring if ring > 0 else lo + j
                wj = s[j] * vs[slot, g]
                for d in range(hd):
                    acc[d] += wj * np.float32(v[slot, g, d])
            for d in range(hd):
                out[i, h * hd + d] = acc[d] / total


@njit(inline="always")
def _attend_float(half, q, k, v, start, scale, window, ring, out, lo_item, hi_item, s, acc):
    """(query, head) pairs [lo_item, hi_item) over a float cache; half is a constant at each
    call site: True for uint16 arrays of F16 bits, False for float32."""
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    ch = 64 if hd % 64 == 0 else 16
    for it in range(lo_item, hi_item):
        i = it // n_head
        h = it - i * n_head
        g = h // group
        p1 = start + i
        lo = _keys(p1, window)
        nk = p1 - lo + 1
        qo = (i * n_head + h) * hd
        for j in range(nk):
            slot = (lo + j) % ring if ring > 0 else lo + j
            ko = (slot * n_kv + g) * hd
            dot = np.float32(0)
            for d0 in range(0, hd, ch):
                if half and ch == 64:
                    dot += dot_f32_f16(q, qo + d0, k, ko + d0, 64)
                elif half:
                    dot += dot_f32_f16(q, qo + d0, k, ko + d0, 16)
                elif ch == 64:
                    dot += dot_f32(q, qo + d0, k, ko + d0, 64)
                else:
                    dot += dot_f32(q, qo + d0, k, ko + d0, 16)
            s[j] = dot * scale
        total = _softmax_weights(s, nk)
        acc[:] = 0
        for j in range(nk):
            slot = (lo + j) % ring if ring > 0 else lo + j
            wj = s[j]
            vo = (slot * n_kv + g) * hd
            for d in range(hd):
                vd = load_f16(v, vo + d) if half else np.float32(v[slot, g, d])
                acc[d] += wj * vd
        for d in range(hd):
            out[i, h * hd + d] = acc[d] / total


@kernel(parallel=True)
def _attention_f16(q, k, v, start, scale, window, ring, out, nt):
    """q float32 [n, H, hd]; k, v uint16 [slots, n_kv, hd] (F16 bits)."""
    n, n_head, hd = q.shape
    longest = start + n - _keys(start + n - 1, window)
    items = n * n_head
    for c in prange(nt):
        s = np.empty(longest, np.float32)
        acc = np.empty(hd, np.float32)
        _attend_float(True, q, k, v, start, scale, window, ring, out, items * c // nt, items * (c + 1) // nt, s, acc)


@kernel(parallel=True)
def _attention_f32(q, k, v, start, scale, window, ring, out, nt):
    """q float32 [n, H, hd]; k, v float32 [slots, n_kv, hd]."""
    n, n_head, hd = q.shape
    longest = start + n - _keys(start + n - 1, window)
    items = n * n_head
    for c in prange(nt):
        s = np.empty(longest, np.float32)
        acc = np.empty(hd, np.float32)
        _attend_float(False, q, k, v, start, scale, window, ring, out, items * c // nt, items * (c + 1) // nt, s, acc)


@kernel()
def _kv_write_int8(kn, vn, k, v, ks, vs, start, ring):
    """Quantize rows exactly as kvcache/pool.py quantize_rows_int8 and store them."""
    n, n_kv, hd = kn.shape
    for i in range(n):
        slot = (start + i) % ring if ring > 0 else start + i
        for g in range(n_kv):
            for which in range(2):
                x = kn if which == 0 else vn
                amax = np.float32(0)
                for d in range(hd):
                    amax = max(amax, abs(x[i, g, d]))
                sc = amax / np.float32(127)
                inv = np.float32(1) / sc if sc > 0 else np.float32(0)
                dst = k if which == 0 else v
                for d in range(hd):
                    qv = min(max(np.rint(x[i, g, d] * inv), np.float32(-127)), np.float32(127))
                    dst[slot, g, d] = np.int8(qv)
                if which == 0:
                    ks[slot, g] = sc
                else:
                    vs[slot, g] = sc


@kernel()
def _kv_write_f16(kn, vn, k, v, start, ring):
    """float32 rows -> uint16 (F16 bits, round to nearest even) cache at their slots."""
    n, n_kv, hd = kn.shape
    for i in range(n):
        slot = (start + i) % ring if ring > 0 else start + i
        for g in range(n_kv):
            o = (slot * n_kv + g) * hd
            for d in range(hd):
                store_f16(k, o + d, kn[i, g, d])
                store_f16(v, o + d, vn[i, g, d])


@kernel()
def _kv_write_f32(kn, vn, k, v, start, ring):
    n, n_kv, hd = kn.shape
    for i in range(n):
        slot = (start + i) % ring if ring > 0 else start + i
        for g in range(n_kv):
            for d in range(hd):
                k[slot, g, d] = kn[i, g, d]
                v[slot, g, d] = vn[i, g, d]


# -- launchers --------------------------------------------------------------------------

def _cache_args(k, v, k_scale, v_scale, what):
    """Validate one layer's cache; returns (k, v, ks, vs) as the kernels take them."""
    for name, a in (("k", k), ("v", v)):
        if not isinstance(a, np.ndarray) or a.ndim != 3 or not a.flags.c_contiguous:
            raise ValueError(f"{what}: {name} must be a C-contiguous [slots, n_kv, hd] array, got "
                             f"{getattr(a, 'shape', type(a))}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"{what}: k {k.dtype}{k.shape} and v {v.dtype}{v.shape} must match")
    if k.dtype == np.int8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (isinstance(s, np.ndarray) and s.dtype == np.float32 and s.shape == k.shape[:2]
                    and s.flags.c_contiguous):
                raise ValueError(f"{what}: an int8 cache needs {name} float32 {k.shape[:2]}, got "
                                 f"{getattr(s, 'dtype', type(s))} {getattr(s, 'shape', '')}")
        return k, v, k_scale, v_scale
    if k.dtype == np.float16:
        return k.view(np.uint16), v.view(np.uint16), None, None
    if k.dtype == np.float32:
        return k, v, None, None
    raise ValueError(f"{what}: the cache dtype must be int8, float16 or float32, got {k.dtype}")


def _check_positions(start, n, window, ring, slots, what):
    if start < 0 or window < 0 or ring < 0:
        raise ValueError(f"{what}: start, window and ring must be >= 0 (got {start}, {window}, {ring})")
    if ring:
        if ring > slots:
            raise ValueError(f"{what}: ring = {ring} but the layer has only {slots} slots")
        need = window + n - 1 if window else start + n
        if ring < need:
            raise ValueError(f"{what}: a ring of {ring} slots cannot hold what {n} queries at {start} "
                             f"need ({need} slots: window + n - 1, or every position without a window); "
                             "prefill in smaller chunks or give the layer more slots")
    elif start + n > slots:
        raise IndexError(f"{what}: positions up to {start + n - 1} exceed the {slots} slots of the cache")


def attention(q, k, v, k_scale, v_scale, start: int, scale: float, window: int = 0, ring: int = 0,
              out: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention of q [n, n_head, hd] over the cache; see the module docstring."""
    what = "attention"
    if not (isinstance(q, np.ndarray) and q.dtype == np.float32 and q.ndim == 3 and q.flags.c_contiguous):
        raise ValueError(f"{what}: q must be a C-contiguous float32 [n, n_head, hd] array, got "
                         f"{getattr(q, 'dtype', type(q))} {getattr(q, 'shape', '')}")
    k, v, ks, vs = _cache_args(k, v, k_scale, v_scale, what)
    n, n_head, hd = q.shape
    slots, n_kv, khd = k.shape
    if khd != hd or n_head % n_kv or hd % 16:
        raise ValueError(f"{what}: q {q.shape} does not fit the cache {k.shape} (head_dim must match "
                         "and be a multiple of 16, n_head a multiple of n_kv)")
    start, window, ring = int(start), int(window), int(ring)
    _check_positions(start, n, window, ring, slots, what)
    if out is None:
        out = np.empty((n, n_head * hd), np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (n, n_head * hd)
              and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"{what}: out must be a writable float32 [{n}, {n_head * hd}]")
    if n == 0:
        return out
    nt = min(get_threads(), n * n_head)
    if ks is not None:
        _attention_int8(q, k, v, ks, vs, start, np.float32(scale), window, ring, out, nt)
    elif k.dtype == np.uint16:
        _attention_f16(q, k, v, start, np.float32(scale), window, ring, out, nt)
    else:
        _attention_f32(q, k, v, start, np.float32(scale), window, ring, out, nt)
    return out


def kv_write(k_new, v_new, k, v, k_scale, v_scale, start: int, ring: int = 0) -> None:
    """Store k_new, v_new float32 [n, n_kv, hd] at positions start .. start + n - 1."""
    what = "kv_write"
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 3 and a.flags.c_contiguous):
            raise ValueError(f"{what}: {name} must be a C-contiguous float32 [n, n_kv, hd] array")
    if k_new.shape != v_new.shape:
        raise ValueError(f"{what}: k_new {k_new.shape} and v_new {v_new.shape} differ")
    k, v, ks, vs = _cache_args(k, v, k_scale, v_scale, what)
    if k_new.shape[1:] != k.shape[1:]:
        raise ValueError(f"{what}: rows {k_new.shape[1:]} do not fit the cache {k.shape}")
    n = k_new.shape[0]
    start, ring = int(start), int(ring)
    if start < 0 or ring < 0 or (ring and ring > k.shape[0]) or (not ring and start + n > k.shape[0]):
        raise IndexError(f"{what}: {n} positions at {start} do not fit {k.shape[0]} slots (ring {ring})")
    if ring and n > ring:
        raise ValueError(f"{what}: {n} positions would overwrite each other in a ring of {ring}")
    if not (k.flags.writeable and v.flags.writeable):
        raise ValueError(f"{what}: the cache arrays must be writable")
    if n == 0:
        return
    if ks is not None:
        _kv_write_int8(k_new, v_new, k, v, ks, vs, start, ring)
    elif k.dtype == np.uint16:
        _kv_write_f16(k_new, v_new, k, v, start, ring)
    else:
        _kv_write_f32(k_new, v_new, k, v, start, ring)
