"""Decode attention over the KV pool: one query token, every head, INT8 or FP16 cache.

The math (engine/models/reference.py `attention`, n = 1): for each query head h of KV head
j = h // group,

    out[h] = softmax(q[h] . K[0:ctx, j]^T / sqrt(hd)) @ V[0:ctx, j]       ctx = state[0] + 1

with K, V dequantized row by row (int8 q * row scale). `state[0]` (the position of the
query token) is read from device memory, so one captured CUDA graph serves every
position. Compile-time variants (`decode_kernel(..., window, scale)`): a sliding window
W reads only positions max(0, pos - W + 1) .. pos (Gemma 3's local layers; llama.cpp
masks key p0 for query p1 when p1 - p0 >= W), through a ring of R slots (position p in
slot p % R, kvcache/device_pool.py) when the layer is one; the scale 1/sqrt(hd) may be
replaced (Gemma 3 27B).

Flash-decoding. Grid (n_splits, n_kv, n_sub), 32 * warps threads. Block (s, j, z) owns
query heads j*group + z*gh .. +gh-1 (gh = group / n_sub, at most 4 for int8, 8 for f16:
their q slices and accumulators live in registers) and split s of the context. The
context is cut into tiles of `tile` rows; split s takes `ceil(tiles / n_splits)`
consecutive tiles of the *run-time* ctx, so short contexts use few splits and the rest
exit at once. n_splits is fixed when the graph is captured (`plan_decode`).

Inside a block, each K/V row (hd * 1 or 2 bytes) is read by `lanes_per_row` lanes with one
128-bit read-only load each (16 int8 or 8 f16 values per lane), so a warp reads 32 / lpr
rows per load instruction, once for all gh heads of the group (GQA: each row is read from
memory once per block). Per tile:
  1. every lane loads its rows' K and V words (all loads in flight together);
  2. scores: dot(q_slice, k_slice) per head, summed over the row's lanes by shuffles,
     times the K row scale -> shared s_p[h][row] (log2 domain: q is pre-scaled by
     log2(e) / sqrt(hd), so softmax uses exp2);
  3. one warp per head: tile max, running max m, p = exp2(s - m), running sum l,
     rescale factor alpha;
  4. acc[h][slice] = alpha * acc + sum_rows p * v_scale * v_slice.
At the end the row slots are summed (shuffles, then shared memory across warps). With
one active split the block writes out = acc / l. Otherwise it writes (acc, m, l) to the
workspace; the last block of its (kv head, subgroup) to finish (an atomic ticket after a
threadfence) merges the splits: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,
and resets its ticket to zero for the next launch.

Traffic: ctx * n_kv * hd * 2 * (1 + 4/hd) bytes for int8 (K, V, scales), twice the
payload for f16; partials n_splits * n_head * (hd + 2) * 4 bytes written and read once.
Qwen3-4B at ctx 4096, int8: 8.4 MB per layer -> 1.9 us at 4.37 TB/s.

Prefill (causal, many query tokens, tensor cores) is in kvcache/attention_prefill.py.
`python -m genie_rt.kvcache.attention` validates both against numpy and times them.

Deliberately not here: f32 caches (the CPU pool has them; the CUDA back-end uses int8 or
f16), ALiBi, soft-capping, chunked or symmetric windows.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache
from genie_rt.engine.models.reference import attention as attention_reference
from genie_rt.quant import ptx
from genie_rt.quant.ptx import SIMULATOR

from .device_pool import KVLayer

FULL = 0xFFFFFFFF
LOG2E = 1.4426950408889634
NEG_INF = float32(-np.inf)
MAX_SPLITS = 64                  # shared-memory weights table of the merge
_ALIGN = 256
KV_DTYPES = {np.dtype(np.int8): "int8", np.dtype(np.float16): "f16"}


# =====================================================================================
# numpy reference
# =====================================================================================
def attention_window_reference(q, k, v, start, window=0, scale=None):
    """Causal GQA attention with an optional sliding window, float64.

    q [n, n_head, hd] at positions start .. start+n-1; k, v float [start+n, n_kv, hd]
    (positions 0 .. start+n-1, in position order). Query i sees keys p with
    p <= start + i and, when window W > 0, start + i - p < W (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD masks p when start + i - p >= W). scale: the score scale
    (None: 1 / sqrt(hd)). window 0 and scale None give engine/models/reference.py's attention
    exactly. Returns [n, n_head * hd]."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    n, n_head, hd = q.shape
    if not window and scale is None:
        return attention_reference(q, k, v, start)
    n_kv = k.shape[1]
    group = n_head // n_kv
    total = k.shape[0]
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)           # [kv, group, n, hd]
    s = (qg @ k.transpose(1, 2, 0)[:, None]) * (1 / np.sqrt(hd) if scale is None else scale)
    qpos = start + np.arange(n)[:, None]
    kpos = np.arange(total)[None, :]
    mask = kpos > qpos
    if window:
        mask |= qpos - kpos >= window
    s = np.where(mask, -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v.transpose(1, 0, 2)[:, None]                            # [kv, group, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, n_head * hd)


def decode_reference(q, k, v, pos, window=0, scale=None):
    """q [n_head, hd]; k, v float [>= pos+1, n_kv, hd] (the dequantized cache, in position
    order) -> [n_head * hd] float64: attention of the token at `pos` over positions
    0 .. pos (window W > 0: max(0, pos - W + 1) .. pos)."""
    q = np.asarray(q, np.float64)[None]
    return attention_window_reference(q, k[:pos + 1], v[:pos + 1], pos, window, scale)[0]


def dequantize_cache(stored, scale):
    """Host cache rows (int8 + scales, or f16) -> float64 [..., hd]."""
    x = np.asarray(stored, np.float64)
    return x * np.asarray(scale, np.float64)[..., None] if scale is not None else x


# =====================================================================================
# kernel
# =====================================================================================
# int8 -> f32 without the quarter-rate I2F conversion: flip the sign bit of each byte
# (u = b + 128, unsigned), put u in the mantissa of 2^23 (bits 0x4B0000uu = 2^23 + u),
# subtract 2^23 + 128. One PRMT (byte_perm) + one FADD per value, exact.
MAGIC_I8 = float32(8388736.0)        # 2^23 + 128

if SIMULATOR:
    @cuda.jit(device=True)
    def _byte(word, b):
        """Signed byte b (0..3, constant) of a uint32 word, as float32."""
        x = int32((word >> uint32(8 * b)) & uint32(0xFF))
        return float32((x ^ 0x80) - 0x80)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _byte(word, b):
        """Signed byte b (0..3, constant) of a uint32 word, as float32."""
        bits = libdevice.byte_perm(int32(word ^ uint32(0x80808080)), int32(0x4B000000),
                                   int32(0x7440 | b))
        return libdevice.int_as_float(bits) - MAGIC_I8


@functools.lru_cache(maxsize=None)
def decode_kernel(head_dim: int, heads_per_block: int, kv_dtype: str, warps: int = 4,
                  rows_per_thread: int = 4, window: int = 0, scale: float | None = None):
    """The decode kernel specialised on its compile-time constants (one per model shape
    and layer kind). window 0: keys 0 .. pos, slot = position; window W > 0: keys
    max(0, pos - W + 1) .. pos, slot = position % R (R = the layer's slots; a ring when
    R < n_ctx). scale: the attention scale (None: 1 / sqrt(head_dim))."""
    HD, GH, NW, RPT = head_dim, heads_per_block, warps, rows_per_thread
    WIN = int(window)
    I8 = kv_dtype == "int8"
    VEC = 16 if I8 else 8            # values per 16-byte load
    EPW = 4 if I8 else 2             # values per 32-bit word
    LPR = HD // VEC                  # lanes per row
    assert HD % VEC == 0 and 32 % LPR == 0, f"head_dim {HD} unsupported for {kv_dtype}"
    RPW = 32 // LPR                  # rows per warp per load instruction
    STEP = NW * RPW                  # rows per block per load instruction
    TILE = STEP * RPT                # rows per tile
    WPR = HD // EPW                  # 32-bit words per cache row
    NQ = GH * VEC                    # q values (and accumulators) per thread
    NRED = GH * HD
    NT = 32 * NW
    NKW = RPT * 4                    # K (and V) words held per thread per tile
    QSCALE = float32(LOG2E / math.sqrt(HD) if scale is None else LOG2E * float(scale))

    @cuda.jit
    def kernel(q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets):
        # q        f32 [n_head * HD]          query of the current token (normed, roped)
        # k_words  u32 [R * n_kv * WPR]       this layer's K cache (R slots) as 32-bit words
        # v_words  u32 [R * n_kv * WPR]
        # k_scale  f32 [R, n_kv]              int8 row scales (unused for f16)
        # v_scale  f32 [R, n_kv]
        # state    i32 [>=1]                  state[0] = position of the query token
        # out      f32 [n_head * HD]          attention output (written)
        # part_o   f32 [n_splits, n_head*HD]  per-split unnormalised accumulators
        # part_ml  f32 [n_splits, 2*n_head]   per-split (max, sum) in the log2 domain
        # tickets  i32 [n_kv * n_sub]         zero between launches
        split = cuda.blockIdx.x
        n_splits = cuda.gridDim.x
        kvh = cuda.blockIdx.y
        n_kv = cuda.gridDim.y
        sub = cuda.blockIdx.z
        n_sub = cuda.gridDim.z
        head0 = (kvh * n_sub + sub) * GH
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        slot = lane // LPR               # which row of the warp's RPW rows
        c = lane % LPR                   # which 16-byte column of the row
        n_ctx = k_words.size // (n_kv * WPR)                 # slots R
        if WIN == 0:
            ctx = min(state[0] + 1, n_ctx)                   # keys 0 .. ctx-1 = slots
            if ctx < 1:
                ctx = 1
            lo = 0
        else:
            # keys lo .. pos (llama.cpp masks p0 when pos - p0 >= W); they live in slots
            # p % R, all distinct because the launcher checks W <= R
            ctx = max(state[0], 0) + 1
            lo = max(ctx - WIN, 0)
            ring0 = lo - lo % n_ctx                          # position of slot 0's lap
        tiles = (ctx - lo + TILE - 1) // TILE
        tps = (tiles + n_splits - 1) // n_splits             # tiles per split
        n_active = (tiles + tps - 1) // tps
        if split >= n_active:
            return                                           # whole block: no barrier skipped
        r_begin = lo + split * tps * TILE
        r_end = min(r_begin + tps * TILE, ctx)

        s_p = cuda.shared.array((GH, TILE), float32)         # scores, then probabilities
        s_m = cuda.shared.array(GH, float32)                 # running max (log2 domain)
        s_l = cuda.shared.array(GH, float32)                 # running sum
        s_alpha = cuda.shared.array(GH, float32)             # rescale of this tile
        s_red = cuda.shared.array((NW, NRED), float32)       # per-warp accumulators
        s_w = cuda.shared.array((GH, MAX_SPLITS), float32)   # merge weights
        s_flag = cuda.shared.array(1, int32)

        qv = cuda.local.array(NQ, float32)                   # q[h][c*VEC + e], pre-scaled
        acc = cuda.local.array(NQ, float32)
        kw = cuda.local.array(NKW, uint32)
        vw = cuda.local.array(NKW, uint32)
        ks = cuda.local.array(RPT, float32)
        vs = cuda.local.array(RPT, float32)
        sc = cuda.local.array(GH, float32)
        for h in range(GH):
            for e in range(VEC):
                qv[h * VEC + e] = q[(head0 + h) * HD + c * VEC + e] * QSCALE
                acc[h * VEC + e] = float32(0)
        if tid < GH:
            s_m[tid] = NEG_INF
            s_l[tid] = float32(0)
        cuda.syncthreads()

        t0 = r_begin
        while t0 < r_end:
            # 1. this thread's K and V words for the whole tile: 2 * RPT loads in flight
            for i in range(RPT):
                r = t0 + i * STEP + warp * RPW + slot
                if r < r_end:
                    if WIN != 0:                             # position -> ring slot
                        r -= ring0
                        if r >= n_ctx:
                            r -= n_ctx
                    wi = (r * n_kv + kvh) * WPR + c * 4
                    w4 = ptx.ldg_v4(k_words, wi)
                    u4 = ptx.ldg_v4(v_words, wi)
                    for x in range(4):
                        kw[i * 4 + x] = w4[x]
                        vw[i * 4 + x] = u4[x]
                    if I8:
                        ks[i] = k_scale[r, kvh]
                        vs[i] = v_scale[r, kvh]
                else:
                    for x in range(4):
                        kw[i * 4 + x] = uint32(0)
                        vw[i * 4 + x] = uint32(0)
                    ks[i] = float32(0)
                    vs[i] = float32(0)
            # 2. scores of the tile's rows -> s_p
            for i in range(RPT):
                for h in range(GH):
                    sc[h] = float32(0)
                for x in range(4):
                    word = kw[i * 4 + x]
                    if I8:
                        for b in range(4):
                            kval = _byte(word, b)
                            for h in range(GH):
                                sc[h] += qv[h * VEC + x * 4 + b] * kval
                    else:
                        lo, hi = ptx.unpack_half2(word)
                        for h in range(GH):
                            sc[h] += qv[h * VEC + x * 2] * lo + qv[h * VEC + x * 2 + 1] * hi
                for h in range(GH):
                    s = sc[h]
                    off = LPR >> 1               # sum over the row's LPR lanes
                    while off > 0:
                        s += cuda.shfl_xor_sync(FULL, s, off)
                        off >>= 1
                    sc[h] = s
                rl = i * STEP + warp * RPW + slot
                if c == 0:
                    valid = t0 + rl < r_end
                    for h in range(GH):
                        if not valid:
                            s_p[h, rl] = NEG_INF
                        elif I8:
                            s_p[h, rl] = sc[h] * ks[i]
                        else:
                            s_p[h, rl] = sc[h]
            cuda.syncthreads()
            # 3. online softmax, one warp per head
            for h in range(warp, GH, NW):
                mx = NEG_INF
                for x in range(lane, TILE, 32):
                    mx = max(mx, s_p[h, x])
                for off in (16, 8, 4, 2, 1):
                    mx = max(mx, cuda.shfl_xor_sync(FULL, mx, off))
                m_old = s_m[h]
                m_new = max(m_old, mx)           # finite: every tile has a valid row
                psum = float32(0)
                for x in range(lane, TILE, 32):
                    p = math.exp2(s_p[h, x] - m_new)
                    s_p[h, x] = p
                    psum += p
                for off in (16, 8, 4, 2, 1):
                    psum += cuda.shfl_xor_sync(FULL, psum, off)
                if lane == 0:
                    alpha = math.exp2(m_old - m_new)
                    s_alpha[h] = alpha
                    s_l[h] = s_l[h] * alpha + psum
                    s_m[h] = m_new
            cuda.syncthreads()
            # 4. acc = alpha * acc + P V
            for h in range(GH):
                a = s_alpha[h]
                for e in range(VEC):
                    acc[h * VEC + e] *= a
            for i in range(RPT):
                rl = i * STEP + warp * RPW + slot
                for h in range(GH):
                    sc[h] = s_p[h, rl] * vs[i] if I8 else s_p[h, rl]
                for x in range(4):
                    word = vw[i * 4 + x]
                    if I8:
                        for b in range(4):
                            vval = _byte(word, b)
                            for h in range(GH):
                                acc[h * VEC + x * 4 + b] += sc[h] * vval
                    else:
                        lo, hi = ptx.unpack_half2(word)
                        for h in range(GH):
                            acc[h * VEC + x * 2] += sc[h] * lo
                            acc[h * VEC + x * 2 + 1] += sc[h] * hi
            cuda.syncthreads()                   # s_p is rewritten by the next tile
            t0 += TILE

        # sum the RPW row slots of each warp, then the warps
        off = LPR
        while off < 32:
            for j in range(NQ):
                acc[j] += cuda.shfl_xor_sync(FULL, acc[j], off)
            off <<= 1
        if slot == 0:
            for h in range(GH):
                for e in range(VEC):
                    s_red[warp, h * HD + c * VEC + e] = acc[h * VEC + e]
        cuda.syncthreads()
        for idx in range(tid, NRED, NT):
            v = float32(0)
            for w in range(NW):
                v += s_red[w, idx]
            h = idx // HD
            if n_active == 1:
                out[head0 * HD + idx] = v / s_l[h]
            else:
                part_o[split, head0 * HD + idx] = v
        if n_active == 1:
            return
        if tid < GH:
            part_ml[split, 2 * (head0 + tid)] = s_m[tid]
            part_ml[split, 2 * (head0 + tid) + 1] = s_l[tid]
        cuda.threadfence()                       # partials visible before the ticket
        cuda.syncthreads()
        if tid == 0:
            ticket = cuda.atomic.add(tickets, kvh * n_sub + sub, 1)
            s_flag[0] = 1 if ticket == n_active - 1 else 0
        cuda.syncthreads()
        if s_flag[0] == 0:
            return
        cuda.threadfence()
        # last block of this (kv head, subgroup): merge the n_active splits
        for h in range(warp, GH, NW):
            hm = 2 * (head0 + h)
            mx = NEG_INF
            for s in range(lane, n_active, 32):
                mx = max(mx, part_ml[s, hm])
            for off in (16, 8, 4, 2, 1):
                mx = max(mx, cuda.shfl_xor_sync(FULL, mx, off))
            den = float32(0)
            for s in range(lane, n_active, 32):
                wgt = math.exp2(part_ml[s, hm] - mx)
                s_w[h, s] = wgt
                den += wgt * part_ml[s, hm + 1]
            for off in (16, 8, 4, 2, 1):
                den += cuda.shfl_xor_sync(FULL, den, off)
            if lane == 0:
                s_alpha[h] = den
        cuda.syncthreads()
        for idx in range(tid, NRED, NT):
            h = idx // HD
            col = head0 * HD + idx
            a0 = float32(0)
            a1 = float32(0)
            a2 = float32(0)
            a3 = float32(0)
            s = 0
            while s + 4 <= n_active:             # four independent loads in flight
                a0 += s_w[h, s] * part_o[s, col]
                a1 += s_w[h, s + 1] * part_o[s + 1, col]
                a2 += s_w[h, s + 2] * part_o[s + 2, col]
                a3 += s_w[h, s + 3] * part_o[s + 3, col]
                s += 4
            while s < n_active:
                a0 += s_w[h, s] * part_o[s, col]
                s += 1
            out[col] = (a0 + a1 + a2 + a3) / s_alpha[h]
        if tid == 0:
            tickets[kvh * n_sub + sub] = 0       # ready for the next launch (graph replay)

    kernel.tile = TILE
    return kernel_cache.attach(kernel)


DECODE_SIGNATURE = ("void(float32[::1], uint32[::1], uint32[::1], float32[:, ::1], "
                    "float32[:, ::1], int32[::1], float32[::1], float32[:, ::1], "
                    "float32[:, ::1], int32[::1])")


# =====================================================================================
# plan, workspace, launcher
# =====================================================================================
def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class DecodePlan:
    """Everything fixed when the decode step is captured (one plan per layer kind: a model
    with sliding-window layers has a global plan and a windowed one)."""
    n_head: int
    n_kv: int
    head_dim: int
    kv_dtype: str              # "int8" | "f16"
    n_splits: int              # blocks along the context per (kv head, subgroup)
    n_sub: int                 # head subgroups per kv head (group / heads_per_block)
    warps: int = 4
    rows_per_thread: int = 4
    window: int = 0            # 0: every key 0 .. pos; W: keys pos - W + 1 .. pos (ring-safe)
    scale: float | None = None  # attention scale; None: 1 / sqrt(head_dim)

    @property
    def heads_per_block(self) -> int:
        return self.n_head // self.n_kv // self.n_sub

    @property
    def tile(self) -> int:
        lpr = self.head_dim // (16 if self.kv_dtype == "int8" else 8)
        return self.warps * (32 // lpr) * self.rows_per_thread

    def kernel(self):
        return decode_kernel(self.head_dim, self.heads_per_block, self.kv_dtype, self.warps,
                             self.rows_per_thread, self.window, self.scale)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the workspace buffer (partials + tickets)."""
        return (_aligned(self.n_splits * self.n_head * self.head_dim * 4)
                + _aligned(self.n_splits * self.n_head * 2 * 4)
                + _aligned(self.n_kv * self.n_sub * 4))

    def fits(self, ws_plan: "DecodePlan") -> bool:
        """Whether this plan can run in a workspace carved for ws_plan (same heads and
        subgroups, no more splits): a windowed plan shares the global plan's workspace."""
        return ((self.n_head, self.n_kv, self.head_dim, self.n_sub)
                == (ws_plan.n_head, ws_plan.n_kv, ws_plan.head_dim, ws_plan.n_sub)
                and self.n_splits <= ws_plan.n_splits)


def plan_decode(n_head: int, n_kv: int, head_dim: int, kv_dtype: str, n_ctx: int,
                n_splits: int | None = None, sm_count: int | None = None,
                warps: int = 4, rows_per_thread: int = 4, window: int | None = None,
                scale: float | None = None) -> DecodePlan:
    """Choose the split count for a pool of n_ctx positions (default: about 2 blocks per
    SM at full context, at least one tile per split, at most MAX_SPLITS). window: None or
    0 for a global layer, W >= 1 for a sliding-window layer (keys pos - W + 1 .. pos; the
    splits then cover W keys, not n_ctx). scale: the attention scale (None: 1/sqrt(hd))."""
    if kv_dtype not in ("int8", "f16"):
        raise ValueError(f"decode attention supports KV dtypes int8 and f16, not '{kv_dtype}'")
    if n_head % n_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv {n_kv}")
    vec = 16 if kv_dtype == "int8" else 8
    if head_dim % vec or head_dim // vec == 0 or 32 % (head_dim // vec):
        raise ValueError(f"head_dim {head_dim} unsupported: need head_dim / {vec} to divide 32")
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"window {window} must be >= 1 (or 0 / None: a global layer)")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"attention scale {scale} must be finite and > 0")
    group = n_head // n_kv
    max_gh = 64 // vec                           # registers: q slice + accumulators <= 2 x 64
    n_sub = next(s for s in range(1, group + 1) if group % s == 0 and group // s <= max_gh)
    plan = DecodePlan(n_head, n_kv, head_dim, kv_dtype, 1, n_sub, warps, rows_per_thread)
    keys = min(n_ctx, window) if window else n_ctx
    tiles = -(-keys // plan.tile)
    if n_splits is None:
        if sm_count is None:
            sm_count = 132 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        n_splits = max(1, (2 * sm_count) // (n_kv * n_sub))
    n_splits = max(1, min(n_splits, tiles, MAX_SPLITS))
    return DecodePlan(n_head, n_kv, head_dim, kv_dtype, n_splits, n_sub, warps, rows_per_thread,
                      window, None if scale is None else float(scale))


class DecodeWorkspace:
    """Zero-copy views of the workspace buffer (carved once, at load).

    part_o f32 [n_splits, n_head * hd], part_ml f32 [n_splits, 2 * n_head],
    tickets i32 [n_kv * n_sub] (zeroed here; every launch leaves them zero)."""

    def __init__(self, plan: DecodePlan, buf=None, stream=0):
        self.plan = plan
        nb = plan.workspace_bytes
        if buf is None:
            buf = cuda.device_array(nb, np.uint8)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < nb:
            raise ValueError(f"decode workspace must be a uint8 device buffer of >= {nb} bytes")
        S, H, D = plan.n_splits, plan.n_head, plan.head_dim
        a = _aligned(S * H * D * 4)
        b = a + _aligned(S * H * 2 * 4)
        self.part_o = buf[:S * H * D * 4].view(np.float32).reshape(S, H * D)
        self.part_ml = buf[a:a + S * H * 2 * 4].view(np.float32).reshape(S, 2 * H)
        self.tickets = buf[b:b + plan.n_kv * plan.n_sub * 4].view(np.int32)
        self.tickets.copy_to_device(np.zeros(plan.n_kv * plan.n_sub, np.int32), stream=stream)


def compile_decode(plan: DecodePlan) -> None:
    """Compile the plan's kernel now (at load), not on the first token."""
    if not SIMULATOR:
        plan.kernel().compile(DECODE_SIGNATURE)


def _flat(a, n, what):
    if a.dtype != np.float32 or a.size != n:
        raise ValueError(f"decode_attention: {what} must be float32 with {n} elements, got "
                         f"{a.dtype} {tuple(a.shape)}")
    return a if a.ndim == 1 else a.reshape(n)


def decode_attention(q, layer: KVLayer, state, out, ws: DecodeWorkspace, stream=0,
                     plan: DecodePlan | None = None):
    """out = attention of the query at position state[0] over cache positions 0..state[0]
    (a windowed plan: max(0, state[0] - W + 1) .. state[0], read through a ring's slots).

    q      float32 [n_head * hd] (or [1, n_head, hd])   device
    layer  DeviceKVPool.layer(i)                          int8 or f16; a ring layer needs a
                                                          windowed plan with W <= its slots
    state  int32 [>=1] device; state[0] = position (read at run time, graph-safe)
    out    float32 [n_head * hd] (or any shape of that size, C-contiguous)
    ws     DecodeWorkspace (of `plan`, or of a plan it fits: see DecodePlan.fits)
    plan   the layer's plan; None: ws.plan
    No allocation, no synchronization."""
    p = ws.plan if plan is None else plan
    if plan is not None and not plan.fits(ws.plan):
        raise ValueError(f"decode_attention: the plan {plan} does not fit the workspace of "
                         f"{ws.plan} (heads, subgroups and at most its splits)")
    kv_dtype = KV_DTYPES.get(np.dtype(layer.k.dtype))
    if kv_dtype != p.kv_dtype:
        raise ValueError(f"decode_attention: cache dtype {layer.k.dtype} but the plan is "
                         f"{p.kv_dtype}")
    if tuple(layer.k.shape[1:]) != (p.n_kv, p.head_dim):
        raise ValueError(f"decode_attention: cache rows {tuple(layer.k.shape[1:])} != plan "
                         f"({p.n_kv}, {p.head_dim})")
    if getattr(layer, "ring", False) and not p.window:
        raise ValueError(f"decode_attention: the layer is a ring of {layer.k.shape[0]} slots; "
                         "it needs a windowed plan (plan_decode(..., window=W))")
    if p.window > layer.k.shape[0]:
        raise ValueError(f"decode_attention: window {p.window} > the layer's {layer.k.shape[0]} "
                         "slots: the ring cannot hold the window")
    if state.dtype != np.int32 or state.ndim != 1:
        raise ValueError("decode_attention: state must be a 1-d int32 device array")
    n = p.n_head * p.head_dim
    p.kernel()[(p.n_splits, p.n_kv, p.n_sub), 32 * p.warps, stream](
        _flat(q, n, "q"), layer.k_words, layer.v_words, layer.k_scale, layer.v_scale, state,
        _flat(out, n, "out"), ws.part_o, ws.part_ml, ws.tickets)


if __name__ == "__main__":       # python -m genie_rt.kvcache.attention [--json PATH] [--quick]
    from genie_rt.kvcache.attention_bench import main
    raise SystemExit(main())
