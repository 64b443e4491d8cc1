"""QK-norm + RoPE + KV-cache write: one kernel per layer and step (Qwen3, Gemma 3, Llama).

The math (engine/models/reference.py, lines `q = rope_neox(rmsnorm(q, L.q_norm, eps), cos, sin)`,
the same for k, then `kv.write(i, start, k, v)`), for n tokens at positions
start .. start+n-1:

    q[t, h]  = rope(qk_norm(qkv[t, q_h], q_norm), start + t)  -> q_out (float32)
    k[t, h]  = rope(qk_norm(qkv[t, k_h], k_norm), start + t)  -> K cache slot of start+t
    v[t, h]  = qkv[t, v_h]                                    -> V cache slot of start+t

    qk_norm(x, w) = x / sqrt(mean(x^2) + eps) * w  (Qwen3, Gemma 3), or x (Llama: no norm)
    rope(x, p): rotate pairs by the angle p * theta_i read from the cos/sin tables, row p:
      NeoX   pairs (i, i + hd/2)   (Qwen3, Gemma 3; llama.cpp LLAMA_ROPE_TYPE_NEOX)
      normal pairs (2i, 2i + 1)    (llama arch; LLAMA_ROPE_TYPE_NORM)
      (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin)      (ggml's rotate_pairs)
    theta_i = freq_scale * base^(-2i/hd) / freq_factor_i      (`rope_table`, float64)

The slot of position p is p for an ordinary layer and p % R for a ring layer (a
sliding-window layer of R slots, kvcache/device_pool.py): the ring variant writes there.

INT8 cache rows are quantized in-kernel with kvcache/pool.py's format (scale =
max|x| / 127 by a warp reduction, q = rint(x / scale) clipped to [-127, 127]); FP16
rows are rounded to nearest. `start` is read from device memory (`state[0]`), so the
decode step (n = 1) can be captured once into a CUDA graph and replayed at every
position; prefill chunks pass the same kind of array.

Who does what: grid (n, ceil(rows / 4)), 128 threads; rows = n_head + 2 * n_kv "head
rows" of one token (q heads, then k heads, then v heads), one warp per head row. A warp
stages its row in shared memory (the rotation pairs elements other lanes loaded), so any
even head_dim <= 256 works. Traffic per token: (q_dim + 2 kv_dim) * 4 bytes in, q_dim * 4
+ 2 * kv_dim * (1 or 2) (+ scales) out: a few KB, launch-bound.

Variants (compile-time constants of `rope_write_kernel`, one kernel each): cache dtype,
NeoX or normal pairs, QK-norm or none, ring or not. The Qwen3 kernel (int8|f16, NeoX,
QK-norm, no ring) is the one this file always had.

Deliberately not here: the QKV projection (quant/ GEMV/GEMM), attention
(kvcache/attention.py), f16 q output (the attention kernels convert q themselves),
partial rotary (n_rot < head_dim), YaRN. The attention scale is applied by the attention
kernels. Positions at or past an ordinary layer's n_ctx are not written to the cache,
and tokens whose position has no row in the cos/sin tables are skipped entirely (q_out
left as it was): the engine never asks for either; the guards only keep a bug from
faulting.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from genie_rt.engine import kernel_cache
from genie_rt.engine.models.reference import rmsnorm, rope_neox, rope_tables
from genie_rt.quant import ptx  # noqa: F401  (installs warp shuffles in the simulator)
from genie_rt.quant.pdl import hooks, launch_or_plain
from genie_rt.quant.ptx import SIMULATOR

from .device_pool import KVLayer
from .pool import quantize_rows_int8

NW = 4              # warps per block, one head row each
MAX_HD = 256        # shared staging row
NV = MAX_HD // 32   # row values a lane holds (registers; guarded past head_dim)
NP = MAX_HD // 64   # rotation pairs a lane holds
BUF = NW * MAX_HD   # the block's staging rows (shared)
FULL = 0xFFFFFFFF
_MAGIC = float32(12582912.0)   # 1.5 * 2^23: (x + M) - M == rint(x) for |x| < 2^22 in f32


# =====================================================================================
# numpy reference
# =====================================================================================
def rope_table(n_ctx: int, head_dim: int, base: float, freq_factors=None,
               freq_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [n_ctx, head_dim/2] for positions 0 .. n_ctx-1 (float64 math):
    angle(p, i) = p * freq_scale * base^(-2i/head_dim) / freq_factors[i].

    freq_factors: None, or head_dim/2 factors (Llama 3's `rope_freqs.weight`: theta_i is
    divided by factor_i, as ggml's rope does). freq_scale: linear position scaling,
    1 / `rope.scaling.factor` for `rope.scaling.type = linear` (ggml's freq_scale).
    The defaults give exactly engine/models/reference.py's rope_tables."""
    half = head_dim // 2
    if head_dim % 2 or head_dim < 2:
        raise ValueError(f"rope_table: head_dim {head_dim} must be even")
    if freq_factors is None and freq_scale == 1.0:
        return rope_tables(head_dim, np.arange(n_ctx), base, np.float32)
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freq_factors is not None:
        ff = np.asarray(freq_factors, np.float64).reshape(-1)
        if ff.shape != (half,):
            raise ValueError(f"rope_table: freq_factors has {ff.size} values; head_dim "
                             f"{head_dim} needs {half}")
        if not np.all(np.isfinite(ff)) or np.any(ff <= 0):
            raise ValueError("rope_table: freq_factors must be finite and > 0")
        inv_freq = inv_freq / ff
    if not freq_scale > 0:
        raise ValueError(f"rope_table: freq_scale {freq_scale} must be > 0")
    angles = (np.arange(n_ctx, dtype=np.float64) * float(freq_scale))[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_norm_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, head_dim]: rotate adjacent pairs (2i, 2i + 1) by the position's angle
    (llama.cpp's LLAMA_ROPE_TYPE_NORM, the llama architecture's)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x1, shape=x.shape)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def rope_write_reference(qkv, q_norm, k_norm, eps, cos, sin, start, n_head, n_kv,
                         neox: bool = True):
    """qkv float [n, q_dim + 2 kv_dim] -> q [n, n_head, hd], k [n, n_kv, hd], v [n, n_kv, hd]
    (float32 out; pass float64 inputs for a stricter reference). q_norm = k_norm = None:
    no QK-norm (Llama). neox False: adjacent pairs."""
    n = qkv.shape[0]
    hd = (qkv.shape[1]) // (n_head + 2 * n_kv)
    q_dim, kv_dim = n_head * hd, n_kv * hd
    c, s = cos[start:start + n], sin[start:start + n]
    q = qkv[:, :q_dim].reshape(n, n_head, hd)
    k = qkv[:, q_dim:q_dim + kv_dim].reshape(n, n_kv, hd)
    v = qkv[:, q_dim + kv_dim:].reshape(n, n_kv, hd)
    if q_norm is not None:
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    rope = rope_neox if neox else rope_norm_reference
    q, k = rope(q, c, s), rope(k, c, s)
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def cache_rows_reference(x, kv_dtype):
    """What the cache holds for float rows x [..., hd]: (stored, scale or None)."""
    if kv_dtype == "int8":
        return quantize_rows_int8(x)
    return np.asarray(x, np.float16), None


# =====================================================================================
# kernels
# =====================================================================================
@cuda.jit(device=True, inline=True)
def _warp_sum(x):
    for off in (16, 8, 4, 2, 1):
        x += cuda.shfl_xor_sync(FULL, x, off)
    return x


@cuda.jit(device=True, inline=True)
def _warp_max(x):
    for off in (16, 8, 4, 2, 1):
        x = max(x, cuda.shfl_xor_sync(FULL, x, off))
    return x


def rope_write_kernel(kv_dtype: str, neox: bool = True, qk_norm: bool = True,
                      ring: bool = False, pdl: bool = False):
    """The kernel specialised on its compile-time constants (cache dtype "int8" | "f16",
    NeoX or normal pairs, QK-norm or none, ring slots or not; pdl: the programmatic-
    dependent-launch build, sm_90+ only, quant/pdl.py). One dispatcher per variant,
    however the arguments are spelled (an lru_cache keys `f("int8", ring=True)` and
    `f("int8", True, True, True)` apart, which built and compiled the variant twice)."""
    return _rope_write_kernel(kv_dtype, bool(neox), bool(qk_norm), bool(ring), bool(pdl))


def make_head_row(neox: bool, qk_norm: bool, ring: bool, int8_cache: bool):
    """head_row(qkv, t, row, hd, n_head, n_kv, q_norm, k_norm, eps, cos, sin, pos, buf, bo, lane,
    k_cache, v_cache, k_scale, v_scale) -> True when buf[bo : bo + hd] holds the normed, roped
    query row `row` of token t (position pos); a k or v row is written to the cache instead
    (slot pos, or pos % R in a ring) and a row >= n_head + 2 n_kv does nothing. One warp per
    row (lane = its lane); buf is a float32 shared array the warp may use at bo .. bo + hd.
    It calls cuda.syncthreads() twice: every thread of the block must call it together (a
    thread without a row passes row = n_head + 2 n_kv). Used by this file's kernel and by the
    decode attention that does the new token's rope itself (attention_decode_rope.py): the
    same device code, so the same bits."""
    NEOX, QK_NORM, RING, I8 = bool(neox), bool(qk_norm), bool(ring), bool(int8_cache)

    @cuda.jit(device=True, inline=True)
    def pair(i, half):
        """The elements rotation pair i turns: (i, i + hd/2) for NeoX, (2i, 2i + 1) normal."""
        if NEOX:
            return i, i + half
        return 2 * i, 2 * i + 1

    @cuda.jit(device=True, inline=True)
    def head_row(qkv, t, row, hd, n_head, n_kv, q_norm, k_norm, eps, cos, sin, pos, buf, bo, lane,
                 k_cache, v_cache, k_scale, v_scale):
        half = hd >> 1
        n_slots = k_cache.shape[0]
        row_ok = row < n_head + 2 * n_kv
        is_q = row < n_head
        is_v = row >= n_head + n_kv
        base = row * hd                          # q | k | v are consecutive head rows
        # Every load is issued before the first use (the loops below have constant trip
        # counts, so they unroll and the arrays live in registers): the row, then the norm
        # weights and the table row of the position. A decode step's launch (one token) then
        # waits on memory twice (state, then the tables) instead of once per loop trip.
        xv = cuda.local.array(NV, float32)
        for j in range(NV):                      # coalesced row load
            d = lane + 32 * j
            xv[j] = qkv[t, base + d] if row_ok and d < hd else float32(0)
        active = row_ok and pos < cos.shape[0]   # no table row: no work
        rot = active and not is_v
        wa = cuda.local.array(NP, float32)
        wb = cuda.local.array(NP, float32)
        cs = cuda.local.array(NP, float32)
        sn = cuda.local.array(NP, float32)
        for p in range(NP):
            i = lane + 32 * p
            wa[p] = float32(1)
            wb[p] = float32(1)
            cs[p] = float32(0)
            sn[p] = float32(0)
            if rot and i < half:
                ia, ib = pair(i, half)
                if QK_NORM:
                    if is_q:
                        wa[p] = q_norm[ia]
                        wb[p] = q_norm[ib]
                    else:
                        wa[p] = k_norm[ia]
                        wb[p] = k_norm[ib]
                cs[p] = cos[pos, i]
                sn[p] = sin[pos, i]
        inv_rms = float32(0)
        if active:
            ss = float32(0)
            for j in range(NV):                  # staged for the rotation, summed in load order
                d = lane + 32 * j
                if d < hd:
                    x = xv[j]
                    buf[bo + d] = x
                    ss += x * x
            if QK_NORM:
                ss = _warp_sum(ss)
                inv_rms = float32(1) / math.sqrt(ss / float32(hd) + eps)
        cuda.syncthreads()                       # the rotation reads other lanes' elements
        if rot:
            for p in range(NP):
                i = lane + 32 * p
                if i < half:
                    ia, ib = pair(i, half)
                    x1 = buf[bo + ia]
                    x2 = buf[bo + ib]
                    if QK_NORM:
                        x1 = x1 * inv_rms * wa[p]
                        x2 = x2 * inv_rms * wb[p]
                    c = cs[p]
                    s = sn[p]
                    buf[bo + ia] = x1 * c - x2 * s
                    buf[bo + ib] = x2 * c + x1 * s
        cuda.syncthreads()
        if not active:
            return False
        if is_q:
            return True
        if RING:
            slot = pos % n_slots                 # position p lives in slot p % R
        else:
            if pos >= n_slots:                   # outside the pool: never written
                return False
            slot = pos
        kvh = row - n_head
        if is_v:
            kvh -= n_kv
        if I8:
            amax = float32(0)
            for d in range(lane, hd, 32):
                amax = max(amax, abs(buf[bo + d]))
            amax = _warp_max(amax)
            scale = amax / float32(127)          # pool.quantize_rows_int8, op for op
            inv = float32(0)
            if scale > float32(0):
                inv = float32(1) / scale
            for d in range(lane, hd, 32):
                r = (buf[bo + d] * inv + _MAGIC) - _MAGIC      # rint, ties to even
                r = min(max(r, float32(-127)), float32(127))
                if is_v:
                    v_cache[slot, kvh, d] = int32(r)
                else:
                    k_cache[slot, kvh, d] = int32(r)
            if lane == 0:
                if is_v:
                    v_scale[slot, kvh] = scale
                else:
                    k_scale[slot, kvh] = scale
        else:
            for d in range(lane, hd, 32):
                if is_v:
                    v_cache[slot, kvh, d] = buf[bo + d]
                else:
                    k_cache[slot, kvh, d] = buf[bo + d]
        return False
    return head_row


@functools.lru_cache(maxsize=None)
def _rope_write_kernel(kv_dtype: str, neox: bool, qk_norm: bool, ring: bool, pdl: bool = False):
    if kv_dtype not in ("int8", "f16"):
        raise ValueError(f"rope_write supports KV dtypes int8 and f16, not '{kv_dtype}'")
    head_row = make_head_row(neox, qk_norm, ring, kv_dtype == "int8")
    # PDL: the next kernel may launch at once; this one waits before its first read
    wait, launch_dependents, _ = hooks(pdl)

    @cuda.jit
    def kernel(qkv, q_norm, k_norm, eps, cos, sin, state, q_out, k_cache, v_cache,
               k_scale, v_scale):
        # qkv     f32 [n, n_head*hd + 2*n_kv*hd]  fused projection output, q | k | v
        # q_norm  f32 [hd], k_norm f32 [hd]       QK-norm weights (not read without QK_NORM)
        # eps     f32                             RMSNorm epsilon
        # cos/sin f32 [n_ctx_max, hd/2]           rope tables (row = position)
        # state   i32 [>=1]                       state[0] = position of token 0 (start)
        # q_out   f32 [n, n_head, hd]             normed + roped queries
        # k_cache, v_cache  int8|f16 [R, n_kv, hd]   this layer's cache (R slots)
        # k_scale, v_scale  f32 [R, n_kv]         int8 row scales (placeholder for f16)
        launch_dependents()
        wait()
        t = cuda.blockIdx.x                      # token
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.y * NW + warp        # head row of this warp
        n_head = q_out.shape[1]
        hd = q_out.shape[2]
        buf = cuda.shared.array(BUF, float32)
        bo = warp * MAX_HD
        if head_row(qkv, t, row, hd, n_head, k_cache.shape[1], q_norm, k_norm, eps, cos, sin,
                    state[0] + t, buf, bo, lane, k_cache, v_cache, k_scale, v_scale):
            for d in range(lane, hd, 32):
                q_out[t, row, d] = buf[bo + d]
    return kernel_cache.attach(kernel)


rope_write_int8 = rope_write_kernel("int8")       # Qwen3's: NeoX, QK-norm, no ring
rope_write_f16 = rope_write_kernel("f16")
_KERNELS = {"int8": rope_write_int8, "f16": rope_write_f16}
ROPE_MODES = ("neox", "normal")


def signature(kv_dtype: str) -> str:
    """The numba signature the launcher uses for this cache dtype (every variant)."""
    cache = {"int8": "int8", "f16": "float16"}[kv_dtype]
    return ("void(float32[:, ::1], float32[::1], float32[::1], float32, float32[:, ::1], "
            "float32[:, ::1], int32[::1], float32[:, :, ::1], "
            f"{cache}[:, :, ::1], {cache}[:, :, ::1], float32[:, ::1], float32[:, ::1])")


def _kernel_for(kv_dtype: str, rope: str, qk_norm: bool, ring: bool, pdl: bool = False):
    if kv_dtype not in _KERNELS:
        raise ValueError(f"rope_write supports KV dtypes {sorted(_KERNELS)}, not '{kv_dtype}'")
    if rope not in ROPE_MODES:
        raise ValueError(f"rope_write: rope must be one of {ROPE_MODES}, not '{rope}'")
    return rope_write_kernel(kv_dtype, rope == "neox", bool(qk_norm), bool(ring), pdl)


def compile_for(kv_dtype: str, rope: str = "neox", qk_norm: bool = True,
                ring: bool = False, pdl: bool = False) -> None:
    """Compile the kernel for this variant now (at load), not on the first token."""
    k = _kernel_for(kv_dtype, rope, qk_norm, ring, pdl)
    if not SIMULATOR:
        k.compile(signature(kv_dtype))


# =====================================================================================
# launcher
# =====================================================================================
def _check(cond, msg, what="rope_write"):
    if not cond:
        raise ValueError(f"{what}: {msg}")


def check_rope_args(hd, q_norm, k_norm, cos, sin, rope, what="rope_write"):
    """The checks of the rope arguments that rope_write and the decode attention that ropes its
    own token (attention.decode_rope_attention) share, as ValueErrors naming `what`; returns
    (q_norm, k_norm, qk_norm), the norms replaced by a stand-in the kernel never reads when
    there is no QK-norm (both None)."""
    _check(hd % 2 == 0 and hd <= MAX_HD, f"head_dim {hd} must be even and <= {MAX_HD}", what)
    qk_norm = q_norm is not None
    _check(qk_norm == (k_norm is not None), "pass both q_norm and k_norm, or neither", what)
    if qk_norm:
        _check(q_norm.shape == (hd,) and k_norm.shape == (hd,), "q_norm / k_norm must be [head_dim]", what)
    _check(cos.shape == sin.shape and cos.ndim == 2 and cos.shape[1] == hd // 2,
           f"cos/sin must be [n_ctx_max, {hd // 2}], got {tuple(cos.shape)}", what)
    _check(rope in ROPE_MODES, f"rope must be one of {ROPE_MODES}, not '{rope}'", what)
    if not qk_norm:
        q_norm = k_norm = cos[0]             # never read: any float32 [::1] stands in
    return q_norm, k_norm, qk_norm


def rope_write(qkv, q_norm, k_norm, eps, cos, sin, state, q_out, layer: KVLayer, stream=0,
               rope: str = "neox", pdl: bool = False):
    """Norm + rope q and k of n tokens, write k, v into `layer` at positions state[0] ..
    state[0]+n-1 (slots p, or p % R for a ring layer).

    qkv     float32 [n, (n_head + 2 n_kv) * hd]   device, C-contiguous
    q_norm, k_norm float32 [hd], or both None (no QK-norm: Llama)
    eps     float (not used without QK-norm)
    cos, sin float32 [n_ctx_max, hd/2]           rope_table(); rows >= every position used
                                                 (per layer: Gemma 3's local layers have
                                                 their own base)
    state   int32 [>=1] device                   state[0] = start (read at run time)
    q_out   float32 [n, n_head, hd]              written
    layer   DeviceKVPool.layer(i)                 int8 or f16 cache; a ring layer needs
                                                 n <= its slots (distinct slots)
    rope    "neox" (pairs i, i + hd/2) or "normal" (pairs 2i, 2i + 1)
    pdl     launch the programmatic-dependent-launch build (quant/pdl.py, sm_90+): the next
            kernel may start at once; the same bits
    No allocation, no synchronization; `stream` is a numba stream (or 0)."""
    kv_dtype = {np.dtype(np.int8): "int8", np.dtype(np.float16): "f16"}.get(np.dtype(layer.k.dtype))
    _check(kv_dtype is not None, f"cache dtype {layer.k.dtype} is not supported (int8, float16)")
    n, n_head, hd = q_out.shape
    n_slots, n_kv, hd_c = layer.k.shape
    _check(hd == hd_c, f"q_out head_dim {hd} != cache head_dim {hd_c}")
    _check(qkv.dtype == np.float32 and q_out.dtype == np.float32, "qkv and q_out must be float32")
    _check(qkv.shape == (n, (n_head + 2 * n_kv) * hd),
           f"qkv shape {tuple(qkv.shape)} != (n={n}, (n_head + 2 n_kv) * hd = "
           f"{(n_head + 2 * n_kv) * hd})")
    q_norm, k_norm, qk_norm = check_rope_args(hd, q_norm, k_norm, cos, sin, rope)
    _check(state.dtype == np.int32 and state.ndim == 1, "state must be a 1-d int32 device array")
    _check(n >= 1, "no tokens")
    ring = bool(getattr(layer, "ring", False))
    _check(not ring or n <= n_slots, f"{n} tokens into a ring of {n_slots} slots would overwrite "
           "each other")
    kern = _kernel_for(kv_dtype, rope, qk_norm, ring, pdl)
    rows = n_head + 2 * n_kv
    grid = (n, (rows + NW - 1) // NW)
    launch_or_plain(kern, grid, 32 * NW, stream, signature(kv_dtype), pdl,
                    qkv, q_norm, k_norm, float32(eps), cos, sin, state, q_out,
                    layer.k, layer.v, layer.k_scale, layer.v_scale)
