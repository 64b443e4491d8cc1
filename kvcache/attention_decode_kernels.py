"""Decode attention's kernel: flash-decoding over the KV pool, one query token, INT8 or FP16 cache.

What it computes, the plan that fixes its split count and the launcher that checks its
arguments are in kvcache/attention.py (read its docstring first); the lesson is in
docs/kernels/attention.md. `_byte` (int8 -> f32 in two instructions) and LOG2E / NEG_INF
are shared with the prefill kernels (attention_prefill_kernels.py).

Flash-decoding. Grid (n_splits, n_kv, n_sub), 32 * warps threads. Block (s, j, z) owns
query heads j*group + z*gh .. +gh-1 (gh = group / n_sub, at most 4 for int8, 8 for f16:
their q slices and accumulators live in registers) and split s of the context. The
context is cut into tiles of `tile` rows; split s takes `ceil(tiles / n_splits)`
consecutive tiles of the *run-time* ctx, so short contexts use few splits and the rest
exit at once. n_splits is fixed when the graph is captured (`plan_decode`).

Inside a block, each K/V row (hd * 1 or 2 bytes) is read by `lanes_per_row` lanes with one
128-bit read-only load each (16 int8 or 8 f16 values per lane), so a warp reads 32 / lpr
rows per load instruction, once for all gh heads of the group (GQA: each row is read from
memory once per block). How the block walks its rows is attention_decode_tiles.py's: the
"warp" loop (the default since 2026-12-04: every lane slot its own running softmax, no barrier
a trip, the next trip's loads in flight) or the "block" loop, per tile (a third, "mma", puts
the scores and P x V on the tensor cores: attention_decode_mma.py):
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

A ROPE build (`decode_kernel(rope=...)`, launcher attention.decode_rope_attention) takes the
QKV row instead of q and does rope_write's work for the new token first: its q rows into shared
memory, the new K/V row into the cache by the last split's blocks (attention_decode_rope.py).

Traffic: ctx * n_kv * hd * 2 * (1 + 4/hd) bytes for int8 (K, V, scales), twice the
payload for f16; partials n_splits * n_head * (hd + 2) * 4 bytes written and read once.
Qwen3-4B at ctx 4096, int8: 8.4 MB per layer -> 1.9 us at 4.37 TB/s.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache
from genie_rt.engine.config import DECODE_ATTENTION_LOOPS, DEFAULT_DECODE_ATTENTION_LOOP
from genie_rt.quant.norm_q8_device import q8_put   # quantize_q8_kernel's own store
from genie_rt.quant.pdl import hooks
from genie_rt.quant import ptx
from genie_rt.quant.ptx import SIMULATOR

from .attention_decode_rope import make_rope_prologue, rows_needed
from .attention_decode_mma import check_mma, mma_geometry, mma_tiles
from .attention_decode_tiles import block_tiles, geometry, warp_tiles

FULL = 0xFFFFFFFF
LOG2E = 1.4426950408889634
NEG_INF = float32(-np.inf)
MAX_SPLITS = 64                  # shared-memory weights table of the merge
MERGE_PF = 16                    # partials a merging thread loads before the weights (merge_pf)


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


if SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


LOOPS = DECODE_ATTENTION_LOOPS
DEFAULT_LOOP = DEFAULT_DECODE_ATTENTION_LOOP     # the measured one (engine/config.py)


@functools.lru_cache(maxsize=None)
def decode_kernel(head_dim: int, heads_per_block: int, kv_dtype: str, warps: int = 4,
                  rows_per_thread: int = 4, window: int = 0, scale: float | None = None,
                  q8: bool = False, pdl: bool = False, loop: str = DEFAULT_LOOP, rope: str = "",
                  qk_norm: bool = True, ring: bool = False, merge_pf: bool = False,
                  qk8: bool = False, skip_rescale: bool = False, even_splits: bool = False):
    """The decode kernel specialised on its compile-time constants (one per model shape
    and layer kind). window 0: keys 0 .. pos, slot = position; window W > 0: keys
    max(0, pos - W + 1) .. pos, slot = position % R (R = the layer's slots; a ring when
    R < n_ctx). scale: the attention scale (None: 1 / sqrt(head_dim)). q8: the kernel also
    writes the q8 activations of out (xq int8 [n_head * hd], xs float32 [n_head * hd / 8],
    two more arguments: DECODE_SIGNATURE_Q8) for the dp4a GEMV of the output projection,
    the same bits as quantize_q8 on out - one launch fewer a layer. pdl: the programmatic-
    dependent-launch build (sm_90+ only, quant/pdl.py): the next kernel may launch at once,
    and this one waits for the kernel before it (rope_write: q and the new K/V row; in a ROPE
    build the QKV GEMV: the QKV row) first - the "warp" loop's after the first trip's loads of
    earlier positions.
    loop: how a block walks its rows (attention_decode_tiles.py): "block" (barriers a tile),
    "warp" (every lane slot its own running softmax, the next trip's loads in flight; its PDL
    build loads the first trip's earlier rows before the wait), "warp-nopf" (the warp loop
    without the prefetch, and so without the loads before the wait), "mma" (int8: scores and
    P x V on the tensor cores, attention_decode_mma.py; rows_per_thread is then its 16-row
    chunks a warp's trip, and the block's result reaches s_red from the loop itself).
    rope: "" (q and the new K/V row come from rope_write), or "neox" / "normal": the kernel
    does rope_write's work for the new token itself (attention_decode_rope.py; qk_norm: the
    layer has QK-norm, ring: its cache is a ring of R < n_ctx slots) and takes the QKV row,
    the norm weights, the tables and the typed cache instead of q (`rope_signature`).
    merge_pf: the block that merges the splits issues its first MERGE_PF partial accumulators'
    loads before it reads the splits' (max, sum), so the merge waits for L2 once, not twice: the
    same operations on the same values, the same bits (MERGE_PREFETCH in kvcache/attention.py).
    qk8 (int8 caches; ignored for f16): each lane quantizes its 16 q values of a head to int8 (its
    own scale) and scores a K row with four dp4a instead of 16 conversions and 16 FMAs
    (attention_decode_tiles.make_load_q) - what llama.cpp's vector kernel does for quantized
    caches; other numbers than the float q (kvcache/attention.py QK_DP4A).
    skip_rescale (the "warp" loops): a head's accumulators are rescaled only when some lane's max
    grew (a warp vote), the same bits (kvcache/attention.py SKIP_RESCALE).
    even_splits (the "mma" loop; ignored by the others): the context is cut into the splits by a
    warp's trips (16-row chunks), as evenly as they go - split s takes chunks s * C / A ..
    (s + 1) * C / A of the C chunks, A = min(n_splits, C) - instead of whole tiles, ceil(tiles /
    n_splits) a split (kvcache/attention.py MMA_EVEN_SPLITS says why)."""
    # PDL: rope_write may still be writing the new K/V row when this launch starts (a ROPE build:
    # the block writes it itself), so the cache is read coherently (ld_v4), not by the read-only path
    wait, launch_dependents, ld4 = hooks(pdl)
    ROPE = bool(rope)
    if ROPE and not pdl:
        ld4 = ptx.ld_v4             # the block writes the new row itself: coherent loads, every build
    if loop not in LOOPS:
        raise ValueError(f"decode attention loop '{loop}' is not one of {LOOPS}")
    HD, GH, NW, RPT = head_dim, heads_per_block, warps, rows_per_thread
    Q8 = bool(q8)
    assert not Q8 or (GH * HD) % 32 == 0, "q8 output needs whole 32-value blocks per block"
    WIN = int(window)
    MMA = loop == "mma"
    if MMA:
        check_mma(kv_dtype, HD)
    VEC, EPW, LPR, RPW, STEP, TILE, WPR = geometry(HD, kv_dtype, NW, RPT)
    CH = 1
    if MMA:                          # rows_per_thread: 16-row chunks a warp's trip
        CH, TILE = mma_geometry(HD, NW, RPT)[2:]
    EVEN = bool(even_splits) and MMA
    NQ = GH * VEC                    # q values (and accumulators) per thread
    NRED = GH * HD
    NT = 32 * NW
    QSCALE = float32(LOG2E / math.sqrt(HD) if scale is None else LOG2E * float(scale))
    # the PDL build of the "warp" loop waits inside it, after the first trip's loads of earlier
    # positions (attention_decode_tiles.py); every other build waits first thing
    EARLY = pdl and loop in ("warp", "mma")
    MPF = MERGE_PF if merge_pf else 0
    NPF = max(MPF, 1)
    NRHD = rows_needed(GH) * HD if ROPE else 1       # shared rope rows (attention_decode_rope.py)
    if ROPE:
        prologue = make_rope_prologue(HD, GH, NW, rope, qk_norm, ring, kv_dtype)

        @_dev
        def ready(ra):              # after the wait: rope the block's rows, then all of it visible
            wait()
            prologue(ra)
            cuda.syncthreads()
    else:
        @_dev
        def ready(ra):
            wait()
    QK8 = bool(qk8) and kv_dtype == "int8"
    if MMA:
        tiles = mma_tiles(HD, GH, NW, RPT, WIN, ld4, QSCALE, wait=ready if EARLY else None)
    elif loop == "block":
        tiles = block_tiles(HD, GH, kv_dtype, NW, RPT, WIN, ld4, _byte, QSCALE, qk8=QK8)
    else:
        tiles = warp_tiles(HD, GH, kv_dtype, NW, RPT, WIN, ld4, _byte, QSCALE, PF=loop == "warp",
                           wait=ready if EARLY else None, qk8=QK8, skip_rescale=skip_rescale)
    wait_first = hooks(False)[0] if EARLY else wait

    @_dev
    def body(rk, q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets, xq, xs):
        # rk       ROPE: (qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_scale, v_scale)
        #          (attention_decode_rope.py); otherwise (q,), unused
        # q        f32 [n_head * HD]          query of the current token (normed, roped; not ROPE)
        # k_words  u32 [R * n_kv * WPR]       this layer's K cache (R slots) as 32-bit words
        # v_words  u32 [R * n_kv * WPR]
        # k_scale  f32 [R, n_kv]              int8 row scales (unused for f16)
        # v_scale  f32 [R, n_kv]
        # state    i32 [>=1]                  state[0] = position of the query token
        # out      f32 [n_head * HD]          attention output (written)
        # part_o   f32 [n_splits, n_head*HD]  per-split unnormalised accumulators
        # part_ml  f32 [n_splits, 2*n_head]   per-split (max, sum) in the log2 domain
        # tickets  i32 [n_kv * n_sub]         zero between launches
        # xq, xs   i8 [n_head * HD], f32 [n_head * HD / 8]: q8 of out (Q8 only; else unused)
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
            ring0 = 0
        else:
            # keys lo .. pos (llama.cpp masks p0 when pos - p0 >= W); they live in slots
            # p % R, all distinct because the launcher checks W <= R
            ctx = max(state[0], 0) + 1
            lo = max(ctx - WIN, 0)
            ring0 = lo - lo % n_ctx                          # position of slot 0's lap
        if EVEN:                                             # a warp's trips, evenly
            n_units = (ctx - lo + CH - 1) // CH
            n_active = min(n_splits, n_units)
            if split >= n_active:
                return                                       # whole block: no barrier skipped
            r_begin = lo + (split * n_units // n_active) * CH
            r_end = min(lo + ((split + 1) * n_units // n_active) * CH, ctx)
        else:
            n_tiles = (ctx - lo + TILE - 1) // TILE
            tps = (n_tiles + n_splits - 1) // n_splits       # tiles per split
            n_active = (n_tiles + tps - 1) // tps
            if split >= n_active:
                return                                       # whole block: no barrier skipped
            r_begin = lo + split * tps * TILE
            r_end = min(r_begin + tps * TILE, ctx)

        s_p = cuda.shared.array((GH, TILE), float32)         # block loop: scores, then p
        s_m = cuda.shared.array(GH, float32)                 # running max (log2 domain)
        s_l = cuda.shared.array(GH, float32)                 # running sum
        s_alpha = cuda.shared.array(GH, float32)             # rescale of a tile; merge: 1 / sum
        s_mw = cuda.shared.array((NW, GH), float32)          # warp loop: each warp's max ...
        s_lw = cuda.shared.array((NW, GH), float32)          # ... and sum
        s_red = cuda.shared.array((NW, NRED), float32)       # per-warp accumulators
        s_w = cuda.shared.array((GH, MAX_SPLITS), float32)   # merge weights
        s_flag = cuda.shared.array(1, int32)

        s_rows = cuda.shared.array(NRHD, float32)          # ROPE: the block's q rows, new K, V
        ra = rk + (s_rows, head0, kvh, split == n_active - 1, state[0])

        qv = cuda.local.array(NQ, float32)                   # q[h][c*VEC + e], pre-scaled
        acc = cuda.local.array(NQ, float32)
        if ROPE and not EARLY:      # (EARLY: the loop calls ready() after its first loads)
            prologue(ra)
            cuda.syncthreads()
        qsrc = s_rows if ROPE else q
        q0 = 0 if ROPE else head0
        if MMA:                     # leaves each warp's sums in s_red itself
            tiles(qsrc, q0, k_words, v_words, k_scale, v_scale, r_begin, r_end, ctx - 1, warp, lane,
                  kvh, n_kv, n_ctx, ring0, s_m, s_l, s_mw, s_lw, s_red, ra)
        else:
            tiles(qsrc, q0, k_words, v_words, k_scale, v_scale, r_begin, r_end, ctx - 1, warp, lane,
                  slot, c, kvh, n_kv, n_ctx, ring0, qv, acc, s_m, s_l, s_p, s_alpha, s_mw, s_lw, ra)
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
            if n_active == 1:                    # block-uniform; NRED, NT multiples of 32
                o = v / s_l[h]
                out[head0 * HD + idx] = o
                if Q8:
                    q8_put(o, head0 * HD + idx, xq, xs)
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
        pf = cuda.local.array(NPF, float32)      # merge_pf: the first idx's partials,
        if MPF:                                          # in flight with the (max, sum) reads
            for s in range(MPF):
                if s < n_active and tid < NRED:
                    pf[s] = part_o[s, head0 * HD + tid]
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
            if MPF and idx == tid:               # the prefetched partials, in the order below
                for g in range(MPF // 4):
                    b = 4 * g
                    if s == b:
                        if b + 4 <= n_active:
                            a0 += s_w[h, b] * pf[b]
                            a1 += s_w[h, b + 1] * pf[b + 1]
                            a2 += s_w[h, b + 2] * pf[b + 2]
                            a3 += s_w[h, b + 3] * pf[b + 3]
                            s = b + 4
                        else:                    # the last 0-3 partials go to a0, as below
                            for j in range(3):
                                if b + j < n_active:
                                    a0 += s_w[h, b + j] * pf[b + j]
                            s = n_active
            while s + 4 <= n_active:             # four independent loads in flight
                a0 += s_w[h, s] * part_o[s, col]
                a1 += s_w[h, s + 1] * part_o[s + 1, col]
                a2 += s_w[h, s + 2] * part_o[s + 2, col]
                a3 += s_w[h, s + 3] * part_o[s + 3, col]
                s += 4
            while s < n_active:
                a0 += s_w[h, s] * part_o[s, col]
                s += 1
            o = (a0 + a1 + a2 + a3) / s_alpha[h]
            out[col] = o
            if Q8:
                q8_put(o, col, xq, xs)
        if tid == 0:
            tickets[kvh * n_sub + sub] = 0       # ready for the next launch (graph replay)

    if ROPE and Q8:
        @cuda.jit
        def kernel(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_words, v_words, k_scale,
                   v_scale, state, out, part_o, part_ml, tickets, xq, xs):
            launch_dependents()
            wait_first()
            body((qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_scale, v_scale), out,
                 k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets, xq, xs)
    elif ROPE:
        @cuda.jit
        def kernel(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_words, v_words, k_scale,
                   v_scale, state, out, part_o, part_ml, tickets):
            launch_dependents()
            wait_first()
            body((qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_scale, v_scale), out,
                 k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets, tickets, out)
    elif Q8:
        @cuda.jit
        def kernel(q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets,
                   xq, xs):
            launch_dependents()
            wait_first()
            body((q,), q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets,
                 xq, xs)
    else:
        @cuda.jit
        def kernel(q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets):
            # xq, xs are never touched without Q8: any arrays of the right kinds stand in
            launch_dependents()
            wait_first()
            body((q,), q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, tickets,
                 tickets, out)

    kernel.tile = TILE
    return kernel_cache.attach(kernel)


DECODE_SIGNATURE = ("void(float32[::1], uint32[::1], uint32[::1], float32[:, ::1], "
                    "float32[:, ::1], int32[::1], float32[::1], float32[:, ::1], "
                    "float32[:, ::1], int32[::1])")
DECODE_SIGNATURE_Q8 = DECODE_SIGNATURE[:-1] + ", int8[::1], float32[::1])"


def rope_signature(kv_dtype: str, q8: bool = False) -> str:
    """The signature of a ROPE build (decode_kernel(rope=...)) for an int8 or f16 cache."""
    cache = {"int8": "int8", "f16": "float16"}[kv_dtype]
    head = ("void(float32[:, ::1], float32[::1], float32[::1], float32, float32[:, ::1], "
            f"float32[:, ::1], {cache}[:, :, ::1], {cache}[:, :, ::1], ")
    sig = head + DECODE_SIGNATURE[len("void(float32[::1], "):]
    return sig[:-1] + ", int8[::1], float32[::1])" if q8 else sig
