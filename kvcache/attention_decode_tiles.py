"""The decode attention's walk over its split of the context: two ways, one contract.

The kernel (attention_decode_kernels.py) gives a block the rows r_begin .. r_end-1 of one
(KV head, head subgroup) and two register arrays; a loop below loads the thread's q slice of
the block's GH heads into `qv[h * VEC + e]` (pre-scaled: its LPR-lane column c of a row, heads
head0 ..), zeroes `acc`, walks the rows and leaves:

    acc[h * VEC + e]   this lane's share of sum_rows p(row) * v(row) for head h, every share
                       scaled to the block's running max s_m[h] (the row slots of a warp and
                       the warps are summed afterwards by the kernel's epilogue)
    s_m[h], s_l[h]     (shared) the block's max score (log2 domain) and sum of p = 2^(s - m)

Rows are read as before: a warp takes RPW = 32 / LPR rows per load instruction (lane slot =
lane // LPR, 16 bytes of the row a lane), RPT rows a lane per trip, so a tile (one trip of the
block's NW warps) is TILE = NW * RPW * RPT rows and a lane's rows are
t0 + i * STEP + warp * RPW + slot.

`block_tiles` (the first kernel, 2026-11-29): the block steps through a tile together -
scores to shared memory, one warp per head computes the tile's softmax, the warps rescale
and add P V - three barriers a tile, and a tile's loads are issued only when the one before
is done.

`warp_tiles` (2026-12-04): every lane slot is its own little split - it keeps its own
running max m and sum l per head, so a trip needs no shared memory and no barrier, and
(PF) the next trip's K/V loads are issued before this trip's arithmetic. The slots and
warps are brought to one max at the end (one barrier, a shuffle tree). The same math in
another order of float additions: tested against numpy like the other (tests/
test_attention_decode.py), not bit for bit against it. EARLY (its PDL build): the first
trip's rows of earlier positions are loaded before `griddepcontrol.wait` - they were written
by earlier decode steps or the prefill (earlier graph launches, complete), as was the
position itself (state[S_POS]: advance_state, the last node of the step before); only q and
the new position's row come from rope_write, the kernel before (in a build that ropes its own
token: from the QKV GEMV's row, by the block itself after the wait), and are read after the wait
(quant/pdl.py rule 2). The block loop waits before anything (the kernel does it).

`ra` (the loops' last argument) is what the kernel's `ready(ra)` hook needs: the warp loop's
EARLY build calls it in place of the bare wait - the wait, and in a build that ropes its own
token (attention_decode_rope.py) the block's rope rows and a barrier, before the new row is read.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.quant import ptx

FULL = 0xFFFFFFFF
NEG_INF = float32(-math.inf)

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


def geometry(head_dim: int, kv_dtype: str, warps: int, rows_per_thread: int):
    """(VEC values a 16-byte load, EPW values a word, LPR lanes a row, RPW rows a warp's load,
    STEP rows a block's load, TILE rows a trip, WPR words a row)."""
    I8 = kv_dtype == "int8"
    VEC = 16 if I8 else 8
    EPW = 4 if I8 else 2
    LPR = head_dim // VEC
    assert head_dim % VEC == 0 and 32 % LPR == 0, f"head_dim {head_dim} unsupported for {kv_dtype}"
    RPW = 32 // LPR
    STEP = warps * RPW
    return VEC, EPW, LPR, RPW, STEP, STEP * rows_per_thread, head_dim // EPW


def make_slot_of(WIN):
    """slot_of(r, n_ctx, ring0): the cache slot of position r - r itself, or in a windowed build
    (WIN > 0) its place in the ring of n_ctx slots whose slot 0 holds position ring0 (r is in
    ring0 .. ring0 + 2 n_ctx - 1: the window's positions)."""
    @_dev
    def slot_of(r, n_ctx, ring0):
        if WIN != 0:
            r -= ring0
            if r >= n_ctx:
                r -= n_ctx
        return r
    return slot_of


def make_load_trip(head_dim, kv_dtype, warps, RPT, WIN, ld4):
    """load_trip(k_words, v_words, k_scale, v_scale, t0, r_end, warp, slot, c, kvh, n_kv,
    n_ctx, ring0, kw, vw, ks, vs): this lane's RPT rows of the trip at t0 - K and V words
    (2 * RPT 16-byte loads in flight), int8 row scales; rows past r_end read as zero."""
    I8 = kv_dtype == "int8"
    VEC, EPW, LPR, RPW, STEP, TILE, WPR = geometry(head_dim, kv_dtype, warps, RPT)
    slot_of = make_slot_of(WIN)

    @_dev
    def load_trip(k_words, v_words, k_scale, v_scale, t0, r_end, warp, slot, c, kvh, n_kv, n_ctx,
                  ring0, kw, vw, ks, vs):
        for i in range(RPT):
            r = t0 + i * STEP + warp * RPW + slot
            if r < r_end:
                r = slot_of(r, n_ctx, ring0)             # position -> ring slot
                wi = (r * n_kv + kvh) * WPR + c * 4
                w4 = ld4(k_words, wi)
                u4 = ld4(v_words, wi)
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
    return load_trip


def make_row_scores(head_dim, kv_dtype, GH, byte, qk8=False):
    """row_scores(kw, i, qv, qw, sc): sc[h] = q[h] . k(row i of the trip) for the GH heads, summed
    over the row's LPR lanes (every lane of the slot gets the total), before the int8 row scale.
    qk8 (int8 caches): q is the lane's int8 words qw[h * 4 + x] with the scale qv[h * VEC]
    (make_load_q): four dp4a a head instead of 16 conversions and 16 FMAs."""
    I8 = kv_dtype == "int8"
    VEC = 16 if I8 else 8
    LPR = head_dim // VEC
    QK8 = bool(qk8) and I8

    @_dev
    def row_scores(kw, i, qv, qw, sc):
        for h in range(GH):
            sc[h] = float32(0)
        if QK8:
            for h in range(GH):
                d = int32(0)
                for x in range(4):
                    d = ptx.dp4a(kw[i * 4 + x], qw[h * 4 + x], d)
                sc[h] = float32(d) * qv[h * VEC]
        else:
            for x in range(4):
                word = kw[i * 4 + x]
                if I8:
                    for b in range(4):
                        kval = byte(word, b)
                        for h in range(GH):
                            sc[h] += qv[h * VEC + x * 4 + b] * kval
                else:
                    lo, hi = ptx.unpack_half2(word)
                    for h in range(GH):
                        sc[h] += qv[h * VEC + x * 2] * lo + qv[h * VEC + x * 2 + 1] * hi
        for h in range(GH):
            s = sc[h]
            off = LPR >> 1
            while off > 0:
                s += cuda.shfl_xor_sync(FULL, s, off)
                off >>= 1
            sc[h] = s
    return row_scores


def make_add_pv(head_dim, kv_dtype, GH, byte):
    """add_pv(vw, i, w, acc): acc[h * VEC + e] += w[h] * v(row i of the trip)[e]."""
    I8 = kv_dtype == "int8"
    VEC = 16 if I8 else 8

    @_dev
    def add_pv(vw, i, w, acc):
        for x in range(4):
            word = vw[i * 4 + x]
            if I8:
                for b in range(4):
                    vval = byte(word, b)
                    for h in range(GH):
                        acc[h * VEC + x * 4 + b] += w[h] * vval
            else:
                lo, hi = ptx.unpack_half2(word)
                for h in range(GH):
                    acc[h * VEC + x * 2] += w[h] * lo
                    acc[h * VEC + x * 2 + 1] += w[h] * hi
    return add_pv


MAGIC_RINT = float32(12582912.0)     # 1.5 * 2^23: (x + M) - M rounds |x| < 2^22 to an integer, ties to even
Q8_FLOOR = float32(1e-30)            # q slices with a smaller amax quantize to zeros


def make_load_q(head_dim, kv_dtype, GH, qscale, qk8=False):
    """load_q(q, head0, c, qv, qw, acc): qv[h * VEC + e] = q[(head0 + h) * HD + c * VEC + e] * qscale
    (log2(e) * the attention scale), acc = 0. qk8 (int8 caches): the lane's VEC values of each head
    quantized instead - s = amax / 127, q8 = rint(v * (127 / amax)) packed into qw[h * 4 .. + 3]
    (byte b of word x: value 4x + b), s in qv[h * VEC] (`q8_slices_reference` is the host's copy)."""
    VEC = 16 if kv_dtype == "int8" else 8
    HD = head_dim
    QK8 = bool(qk8) and kv_dtype == "int8"

    @_dev
    def load_q(q, head0, c, qv, qw, acc):
        for h in range(GH):
            for e in range(VEC):
                qv[h * VEC + e] = q[(head0 + h) * HD + c * VEC + e] * qscale
                acc[h * VEC + e] = float32(0)
        if QK8:
            for h in range(GH):
                amax = float32(0)
                for e in range(VEC):
                    amax = max(amax, abs(qv[h * VEC + e]))
                inv = float32(0)
                if amax > Q8_FLOOR:             # (not 0, nor so small that 127 / amax is inf)
                    inv = float32(127) / amax
                for x in range(4):
                    w = uint32(0)
                    for b in range(4):
                        r = (qv[h * VEC + x * 4 + b] * inv + MAGIC_RINT) - MAGIC_RINT
                        w |= (uint32(int32(r)) & uint32(0xFF)) << uint32(8 * b)
                    qw[h * 4 + x] = w
                qv[h * VEC] = amax / float32(127)
    return load_q


def q8_slices_reference(q, qscale, vec=16):
    """The q a qk8 build scores with (make_load_q), float64 [..., hd]: each vec-value slice of
    q * qscale quantized to int8 with its own scale, dequantized, divided by qscale again."""
    v = np.asarray(q, np.float32) * np.float32(qscale)
    sl = v.reshape(*v.shape[:-1], -1, vec)
    amax = np.abs(sl).max(axis=-1, keepdims=True)
    big = amax > Q8_FLOOR
    inv = np.where(big, np.float32(127) / np.where(big, amax, np.float32(1)), np.float32(0))
    r = (sl * inv.astype(np.float32) + MAGIC_RINT) - MAGIC_RINT
    deq = r.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)
    return (deq / np.float64(np.float32(qscale))).reshape(v.shape)


def block_tiles(head_dim, GH, kv_dtype, warps, RPT, WIN, ld4, byte, qscale, qk8=False):
    """The block-synchronous loop (module docstring). Shared arrays: s_p (GH, TILE), s_alpha (GH)."""
    I8 = kv_dtype == "int8"
    NW = warps
    VEC, EPW, LPR, RPW, STEP, TILE, WPR = geometry(head_dim, kv_dtype, warps, RPT)
    NKW = RPT * 4
    load_trip = make_load_trip(head_dim, kv_dtype, warps, RPT, WIN, ld4)
    row_scores = make_row_scores(head_dim, kv_dtype, GH, byte, qk8)
    add_pv = make_add_pv(head_dim, kv_dtype, GH, byte)
    load_q = make_load_q(head_dim, kv_dtype, GH, qscale, qk8)
    NQW = 4 * GH if qk8 else 1                  # q's int8 words (make_load_q)

    @_dev
    def tiles(q, head0, k_words, v_words, k_scale, v_scale, r_begin, r_end, new_row, warp, lane, slot,
              c, kvh, n_kv, n_ctx, ring0, qv, acc, s_m, s_l, s_p, s_alpha, s_mw, s_lw, ra):
        kw = cuda.local.array(NKW, uint32)
        vw = cuda.local.array(NKW, uint32)
        ks = cuda.local.array(RPT, float32)
        vs = cuda.local.array(RPT, float32)
        sc = cuda.local.array(GH, float32)
        qw = cuda.local.array(NQW, uint32)
        load_q(q, head0, c, qv, qw, acc)
        if cuda.threadIdx.x < GH:
            s_m[cuda.threadIdx.x] = NEG_INF
            s_l[cuda.threadIdx.x] = float32(0)
        cuda.syncthreads()
        t0 = r_begin
        while t0 < r_end:
            # 1. this thread's K and V words for the whole tile: 2 * RPT loads in flight
            load_trip(k_words, v_words, k_scale, v_scale, t0, r_end, warp, slot, c, kvh, n_kv,
                      n_ctx, ring0, kw, vw, ks, vs)
            # 2. scores of the tile's rows -> s_p
            for i in range(RPT):
                row_scores(kw, i, qv, qw, sc)
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
                add_pv(vw, i, sc, acc)
            cuda.syncthreads()                   # s_p is rewritten by the next tile
            t0 += TILE
    return tiles


def warp_tiles(head_dim, GH, kv_dtype, warps, RPT, WIN, ld4, byte, qscale, PF=True, wait=None,
               qk8=False, skip_rescale=False):
    """The barrier-free loop (module docstring); PF: the next trip's loads go out before this
    trip's arithmetic (twice the K/V registers). wait (a PDL build with PF: EARLY): wait(ra), the
    wait for the kernel before (and the rope rows), called here after the first trip's loads of
    earlier positions. skip_rescale: a head's VEC accumulators are multiplied by its alpha only
    when some lane of the warp has alpha != 1 (a vote; the same bits: x * 1 is x). Shared arrays:
    s_mw, s_lw (NW, GH)."""
    SKIP = bool(skip_rescale)
    EARLY = wait is not None
    assert PF or not EARLY, "the early loads are the first trip's prefetch"
    I8 = kv_dtype == "int8"
    NW = warps
    VEC, EPW, LPR, RPW, STEP, TILE, WPR = geometry(head_dim, kv_dtype, warps, RPT)
    NKW = RPT * 4
    NS = RPT * GH
    load_trip = make_load_trip(head_dim, kv_dtype, warps, RPT, WIN, ld4)
    row_scores = make_row_scores(head_dim, kv_dtype, GH, byte, qk8)
    add_pv = make_add_pv(head_dim, kv_dtype, GH, byte)
    load_q = make_load_q(head_dim, kv_dtype, GH, qscale, qk8)
    NQW = 4 * GH if qk8 else 1                  # q's int8 words (make_load_q)
    block_stats = make_block_stats(GH, NW)

    @_dev
    def trip(kw, vw, ks, vs, t0, r_end, warp, slot, qv, qw, acc, m, l, s, sc):
        # scores of the lane's RPT rows (NEG_INF past r_end), then the slot's online softmax
        for i in range(RPT):
            row_scores(kw, i, qv, qw, sc)
            valid = t0 + i * STEP + warp * RPW + slot < r_end
            for h in range(GH):
                if not valid:
                    s[i * GH + h] = NEG_INF
                elif I8:
                    s[i * GH + h] = sc[h] * ks[i]
                else:
                    s[i * GH + h] = sc[h]
        for h in range(GH):
            mx = m[h]
            for i in range(RPT):
                mx = max(mx, s[i * GH + h])
            mu = mx if mx > NEG_INF else float32(0)      # no valid row yet: alpha = p = 0
            alpha = math.exp2(m[h] - mu)
            m[h] = mx
            lsum = l[h] * alpha
            if not SKIP or cuda.any_sync(FULL, alpha != float32(1)):
                for e in range(VEC):
                    acc[h * VEC + e] *= alpha
            for i in range(RPT):
                p = math.exp2(s[i * GH + h] - mu)
                lsum += p
                s[i * GH + h] = p * vs[i] if I8 else p
            l[h] = lsum
        for i in range(RPT):
            for h in range(GH):
                sc[h] = s[i * GH + h]
            add_pv(vw, i, sc, acc)

    @_dev
    def tiles(q, head0, k_words, v_words, k_scale, v_scale, r_begin, r_end, new_row, warp, lane, slot,
              c, kvh, n_kv, n_ctx, ring0, qv, acc, s_m, s_l, s_p, s_alpha, s_mw, s_lw, ra):
        kw = cuda.local.array(NKW, uint32)
        vw = cuda.local.array(NKW, uint32)
        ks = cuda.local.array(RPT, float32)
        vs = cuda.local.array(RPT, float32)
        kn = cuda.local.array(NKW, uint32)
        vn = cuda.local.array(NKW, uint32)
        ksn = cuda.local.array(RPT, float32)
        vsn = cuda.local.array(RPT, float32)
        m = cuda.local.array(GH, float32)
        l = cuda.local.array(GH, float32)
        s = cuda.local.array(NS, float32)
        sc = cuda.local.array(GH, float32)
        for h in range(GH):
            m[h] = NEG_INF
            l[h] = float32(0)
        t0 = r_begin
        if EARLY:       # rows before the new one: earlier steps wrote them; then the wait
            load_trip(k_words, v_words, k_scale, v_scale, t0, min(r_end, new_row), warp, slot, c, kvh,
                      n_kv, n_ctx, ring0, kw, vw, ks, vs)
            wait(ra)
            if new_row < t0 + TILE:         # the trip holds the new row: load it again, whole
                load_trip(k_words, v_words, k_scale, v_scale, t0, r_end, warp, slot, c, kvh, n_kv,
                          n_ctx, ring0, kw, vw, ks, vs)
        elif PF:
            load_trip(k_words, v_words, k_scale, v_scale, t0, r_end, warp, slot, c, kvh, n_kv,
                      n_ctx, ring0, kw, vw, ks, vs)
        qw = cuda.local.array(NQW, uint32)
        load_q(q, head0, c, qv, qw, acc)
        while t0 < r_end:
            if PF:      # the next trip's loads (zeros past r_end: no load) before this one's math
                load_trip(k_words, v_words, k_scale, v_scale, t0 + TILE, r_end, warp, slot, c, kvh,
                          n_kv, n_ctx, ring0, kn, vn, ksn, vsn)
            else:
                load_trip(k_words, v_words, k_scale, v_scale, t0, r_end, warp, slot, c, kvh, n_kv,
                          n_ctx, ring0, kw, vw, ks, vs)
            trip(kw, vw, ks, vs, t0, r_end, warp, slot, qv, qw, acc, m, l, s, sc)
            if PF:
                for x in range(NKW):
                    kw[x] = kn[x]
                    vw[x] = vn[x]
                for i in range(RPT):
                    ks[i] = ksn[i]
                    vs[i] = vsn[i]
            t0 += TILE
        # one max per head for the block: the slots of a warp by shuffles, the warps in shared
        for h in range(GH):
            mw = m[h]
            off = LPR
            while off < 32:
                mw = max(mw, cuda.shfl_xor_sync(FULL, mw, off))
                off <<= 1
            if lane == 0:
                s_mw[warp, h] = mw
        cuda.syncthreads()
        for h in range(GH):
            mb = NEG_INF
            for w in range(NW):
                mb = max(mb, s_mw[w, h])             # finite: the split has a valid row
            f = math.exp2(m[h] - mb)                 # 0 for a slot that saw no valid row
            for e in range(VEC):
                acc[h * VEC + e] *= f
            lf = l[h] * f
            off = LPR                                # one l per slot: sum over the slots
            while off < 32:
                lf += cuda.shfl_xor_sync(FULL, lf, off)
                off <<= 1
            if lane == 0:
                s_lw[warp, h] = lf
        cuda.syncthreads()
        block_stats(s_m, s_l, s_mw, s_lw)
        # (the kernel's epilogue has a barrier before it reads s_m, s_l)
    return tiles


def make_block_stats(GH, NW):
    """block_stats(s_m, s_l, s_mw, s_lw): the block's max and sum of each head from its warps'
    (s_mw, s_lw (NW, GH): every warp's sum already scaled to the block's max), by threads 0 .. GH-1
    after a barrier; the warp loop's and the mma loop's end."""
    @_dev
    def block_stats(s_m, s_l, s_mw, s_lw):
        if cuda.threadIdx.x < GH:
            h = cuda.threadIdx.x
            mb = NEG_INF
            lb = float32(0)
            for w in range(NW):
                mb = max(mb, s_mw[w, h])
                lb += s_lw[w, h]
            s_m[h] = mb
            s_l[h] = lb
    return block_stats
