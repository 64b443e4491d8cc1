"""The short prefill's attention chain in one launch: rope_write, the attention, its split merge and q8_K.

Why. A short prefill (1-8 new tokens after a cached prefix, engine/cuda_short_prefill.py) ran three
launches a layer around its attention: rope_write (QK-norm, RoPE, the new K/V rows into the cache),
the prefill attention (kvcache/attention_prefill_kernels.py, its key range split over blocks) and
merge_q8k (the splits merged, the output quantized to q8_K for the O-projection). On an H200 they took
3.2 + 8.6 + 3.4 of a layer's 60 us (docs/decode-step.md 7), each mostly a chain of dependent reads
and a launch; PDL on the last two saved nothing. Here the attention kernel's `fuse` build does all of
it (prefill_kernel(..., fuse=(neox, qk_norm, n_max)); one row tile: n x group <= 64 packed rows):

- every block ropes the query rows it owns (n tokens x the group's heads) into shared memory, where
  its Q fragments come from, and the blocks whose keys reach the chunk's own (the last split or
  two) rope and write the chunk's K and V rows of their KV head to the cache, then read them
  back with coherent loads (two blocks may write the same row: the same bytes). A warp takes its
  rows together - all loads first, then the norms, one warp barrier, the rotations, another,
  the int8 rows - so the prologue waits on memory about once, not once a row;
- the arithmetic is rope_write's (kvcache/rope_write.py `make_head_row`) op for op: the same q and
  cache bits, so the attention's output is the three launches' bits;
- the last split of a KV head to finish (an atomic ticket, as the decode attention's merge) merges
  the splits (attention_prefill_kernels' merge_weights / merge_value, op for op: the same bits) - every
  (row, split)'s max and sum loaded at once into shared memory, a row's weights worked out once, every
  split's values of a lane's columns loaded together before the sums - writes the
  float output and its q8_K values: a KV head's group x head_dim columns are whole 256-value
  blocks (Qwen3-4B: 4 x 128, two blocks a token), a warp a block, 8 values a lane (merge_q8k's
  arithmetic, the same bits). With one split the block itself holds every row.

Reference: rope_write, then prefill_attention(merge=False), then merge_q8k - the same bits
(tests/test_attention_short.py, in the simulator and on an H100). `fusable` says when a layer can take it.

Status: a lab build (engine/cuda_short_prefill.FUSED_ATTENTION, off). On an H100 (2026-12-07, 08:05 UTC)
its first version made the 4B's short graph 4.415 ms against 2.246 ms without: its last block called
merge_value per value, whose loop over the splits waits on each load - about 40 dependent L2 reads an item,
4 items a warp, ~60 us a layer - where merge_q8k spreads the same reads over 128 blocks. The merge above
(the same bits, tests/test_attention_short.py) has about three dependent reads an item; not yet timed
(docs/decode-step.md 7).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int8, int32

from genie_rt.quant.norm_q8_device import q8k_round, q8k_scale
from genie_rt.quant.ptx import SIMULATOR
from genie_rt.quant.q8k_layout import check as check_q8k
from genie_rt.quant.q8k_layout import xd_base, xq_word

from .attention_decode_kernels import NEG_INF
from .attention_prefill_kernels import BM, THREADS, block_n
from .rope_write import _MAGIC, ROPE_MODES, _warp_max, _warp_sum, check_rope_args

_dev = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)
if SIMULATOR:      # no syncwarp there; every thread of the block reaches rope_rows' warp barriers
    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncthreads()
else:
    @cuda.jit(device=True, forceinline=True)
    def _syncwarp():
        cuda.syncwarp()
FULL = 0xFFFFFFFF
QK = 256                      # values of a q8_K block
SHARED_MAX = 48 * 1024        # static shared memory of a block
MAX_MERGE = 8                 # the most splits the fused build merges (its shared weights; the plans' default)
# lab knob (tools/bench_short_attention.py): parts of the fused build left out, to time what each costs -
# "rope" (no rope_rows: s_q unset, no cache rows), "writes" (the query rows only), "tail" (no merge or
# q8_K). Wrong results by design; short_attention passes it to the build (prefill_kernel's fuse key)
ABLATE: tuple = ()
FUSED_SIGNATURE = ("void(float32[:, ::1], float32[::1], float32[::1], float32, float32[:, ::1], float32[:, ::1], "
                   "{c}[:, :, ::1], {c}[:, :, ::1], uint32[::1], uint32[::1], float32[:, ::1], float32[:, ::1], "
                   "int32[::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], int32, int32[::1], "
                   "int8[::1], float32[::1], int32[::1])")


def shared_rows(group: int, n_max: int) -> int:
    """Rows of the prologue's shared staging: the query rows, then the new K and V rows."""
    return n_max * group + 2 * n_max


def merge_shared_bytes(group: int, n_max: int) -> int:
    """q8k_tail's shared memory: each row's splits' max, sum and weight, and its 1 / sum."""
    return n_max * group * (3 * MAX_MERGE + 1) * 4


def fusable(head_dim: int, group: int, kv_dtype: str, n: int, window: int = 0, ring: bool = False,
            max_splits: int = 1) -> str | None:
    """Why a layer's short prefill of n tokens (at most max_splits splits) cannot take the fused
    launch (None: it can)."""
    if max_splits > MAX_MERGE:
        return f"{max_splits} splits (the fused launch merges at most {MAX_MERGE})"
    if window or ring:
        return "a sliding-window layer (the fused launch reads no ring)"
    if head_dim > 128 or head_dim % 32:
        return f"head_dim {head_dim} (the fused launch takes multiples of 32 up to 128)"
    if n * group > BM:
        return f"{n} tokens x {group} heads a KV head are more than one row tile ({BM})"
    if (group * head_dim) % QK:
        return f"a KV head's {group} x {head_dim} columns are not whole q8_K blocks of {QK}"
    bn = block_n(head_dim, kv_dtype)
    tiles = 2 * bn * (head_dim // 2 + 4) * 4 + bn * 4        # the K and V tiles as f16 pairs, K's scales
    if shared_rows(group, n) * head_dim * 4 + tiles + merge_shared_bytes(group, n) + 16 > SHARED_MAX:
        return f"{n} tokens x {group} heads of head_dim {head_dim} do not fit a block's shared memory"
    return None


@functools.lru_cache(maxsize=None)
def fused_parts(HD: int, G: int, WARPS: int, neox: bool, qk_norm: bool, NMAX: int, I8: bool, ablate: tuple = ()):
    """(rope_rows, q8k_tail, shared floats) of prefill_kernel's fuse build (module docstring);
    ablate: the parts left out (ABLATE)."""
    bad = set(ablate) - {"rope", "writes", "tail"}
    if bad:
        raise ValueError(f"attention_short.ABLATE: unknown parts {sorted(bad)} (rope, writes, tail)")
    NO_ROPE, NO_WRITES, NO_TAIL = "rope" in ablate, "writes" in ablate, "tail" in ablate
    NEOX, QK_NORM = bool(neox), bool(qk_norm)
    QR = NMAX * G                          # query rows (packed: token t, head g at t G + g)
    RPW = -(-shared_rows(G, NMAX) // WARPS)    # rows a warp
    NVH = HD // 32                         # values of a row a lane holds (d = lane + 32 j)
    HALF = HD // 2
    NPH = -(-HALF // 32)                   # rotation pairs a lane holds
    QB = G * HD // QK                      # q8_K blocks of a token's KV-head columns
    MS, NSW = MAX_MERGE, QR * MAX_MERGE        # q8k_tail's shared (row, split) slots
    NPV = MAX_MERGE * 8                    # a lane's partials of one item (8 columns x every split)
    NXV, NCS = RPW * NVH, RPW * NPH        # local array sizes (constants where the kernel reads them)

    @_dev
    def pair(i):
        if NEOX:
            return i, i + HALF
        return 2 * i, 2 * i + 1

    @_dev
    def row_of(rr, n, writes, start, n_pos):
        """(kind: 0 none, 1 q, 2 k, 3 v; token) of the block's row rr (recomputed where needed: as
        local arrays they went to memory)."""
        k = 0
        t = 0
        if rr < QR:
            if rr < n * G:
                k = 1
                t = rr // G
        else:
            j = rr - QR
            if writes and j < 2 * n:
                t = j >> 1
                k = 2 + (j & 1)
        if start + t >= n_pos:                 # no table row: no work (head_row's `active`)
            k = 0
        return k, t

    @_dev
    def rope_rows(ra, s_q, n, n_head, kvh, start, writes, warp, lane):
        """make_head_row's work on the block's rows (module docstring): query row r (token r // G,
        head kvh G + r % G) to s_q[r HD ..]; with `writes` the chunk's K and V rows of KV head kvh
        to the cache. Every row is warp-uniform; no block barrier inside."""
        if NO_ROPE:
            return
        if NO_WRITES:
            writes = False
        qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_scale, v_scale = ra
        n_kv = k_cache.shape[1]
        n_slots = k_cache.shape[0]
        n_pos = cos.shape[0]
        xv = cuda.local.array(NXV, float32)
        cs = cuda.local.array(NCS, float32)
        sn = cuda.local.array(NCS, float32)
        wqa = cuda.local.array(NPH, float32)
        wqb = cuda.local.array(NPH, float32)
        wka = cuda.local.array(NPH, float32)
        wkb = cuda.local.array(NPH, float32)
        for p in range(NPH):                       # every load first: the norm weights ...
            i = lane + 32 * p
            wqa[p] = float32(1)
            wqb[p] = float32(1)
            wka[p] = float32(1)
            wkb[p] = float32(1)
            if QK_NORM and i < HALF:
                ia, ib = pair(i)
                wqa[p] = q_norm[ia]
                wqb[p] = q_norm[ib]
                wka[p] = k_norm[ia]
                wkb[p] = k_norm[ib]
        for r in range(RPW):                       # ... the rows and their table rows
            rr = warp + WARPS * r
            k, t = row_of(rr, n, writes, start, n_pos)
            base = (kvh * G + rr - t * G) * HD                        # a query row
            if k >= 2:
                base = (n_head + (k - 2) * n_kv + kvh) * HD           # K, V
            pos = start + t
            for jj in range(NVH):
                xv[r * NVH + jj] = qkv[t, base + lane + 32 * jj] if k != 0 else float32(0)
            for p in range(NPH):
                i = lane + 32 * p
                cs[r * NPH + p] = float32(0)
                sn[r * NPH + p] = float32(0)
                if (k == 1 or k == 2) and i < HALF:
                    cs[r * NPH + p] = cos[pos, i]
                    sn[r * NPH + p] = sin[pos, i]
        inv_rms = cuda.local.array(RPW, float32)
        for r in range(RPW):                       # staged and summed in load order, as head_row
            bo = (warp + WARPS * r) * HD
            ss = float32(0)
            k, t = row_of(warp + WARPS * r, n, writes, start, n_pos)
            if k != 0:
                for jj in range(NVH):
                    x = xv[r * NVH + jj]
                    s_q[bo + lane + 32 * jj] = x
                    ss += x * x
            inv_rms[r] = ss
        for r in range(RPW):
            ss = inv_rms[r]
            inv_rms[r] = float32(0)
            k, t = row_of(warp + WARPS * r, n, writes, start, n_pos)
            if QK_NORM and k != 0:                 # warp-uniform
                ss = _warp_sum(ss)
                inv_rms[r] = float32(1) / math.sqrt(ss / float32(HD) + eps)
        _syncwarp()                            # a rotation reads other lanes' elements
        for r in range(RPW):
            k, t = row_of(warp + WARPS * r, n, writes, start, n_pos)
            if k == 1 or k == 2:
                bo = (warp + WARPS * r) * HD
                for p in range(NPH):
                    i = lane + 32 * p
                    if i < HALF:
                        ia, ib = pair(i)
                        x1 = s_q[bo + ia]
                        x2 = s_q[bo + ib]
                        if QK_NORM:
                            if k == 1:
                                x1 = x1 * inv_rms[r] * wqa[p]
                                x2 = x2 * inv_rms[r] * wqb[p]
                            else:
                                x1 = x1 * inv_rms[r] * wka[p]
                                x2 = x2 * inv_rms[r] * wkb[p]
                        c = cs[r * NPH + p]
                        s = sn[r * NPH + p]
                        s_q[bo + ia] = x1 * c - x2 * s
                        s_q[bo + ib] = x2 * c + x1 * s
        _syncwarp()
        for r in range(RPW):                       # the K / V rows into the cache (slot = position)
            k, t = row_of(warp + WARPS * r, n, writes, start, n_pos)
            pos = start + t
            if k >= 2 and pos < n_slots:           # warp-uniform
                bo = (warp + WARPS * r) * HD
                if I8:
                    amax = float32(0)
                    for jj in range(NVH):
                        amax = max(amax, abs(s_q[bo + lane + 32 * jj]))
                    amax = _warp_max(amax)
                    scale = amax / float32(127)    # pool.quantize_rows_int8, op for op
                    inv = float32(0)
                    if scale > float32(0):
                        inv = float32(1) / scale
                    for jj in range(NVH):
                        d = lane + 32 * jj
                        q = (s_q[bo + d] * inv + _MAGIC) - _MAGIC      # rint, ties to even
                        q = min(max(q, float32(-127)), float32(127))
                        if k == 3:
                            v_cache[pos, kvh, d] = int32(q)
                        else:
                            k_cache[pos, kvh, d] = int32(q)
                    if lane == 0:
                        if k == 3:
                            v_scale[pos, kvh] = scale
                        else:
                            k_scale[pos, kvh] = scale
                else:
                    for jj in range(NVH):
                        d = lane + 32 * jj
                        if k == 3:
                            v_cache[pos, kvh, d] = s_q[bo + d]
                        else:
                            k_cache[pos, kvh, d] = s_q[bo + d]

    @_dev
    def q8k_tail(ea, out, part_o, part_ml, n_splits, kvh, n, n_head, tid, warp, lane):
        """The last split of KV head kvh (ticket) merges its rows into out and writes their q8_K
        values; one split: out as the block wrote it. Every thread of the block calls it."""
        if NO_TAIL:
            return
        tickets, xq, xd, xb = ea
        s_flag = cuda.shared.array(1, int32)
        s_m = cuda.shared.array(NSW, float32)      # (row, split): the partials' max, sum, weight
        s_l = cuda.shared.array(NSW, float32)
        s_w = cuda.shared.array(NSW, float32)
        s_inv = cuda.shared.array(QR, float32)     # a row's 1 / sum
        if n_splits > 1:                           # block-uniform
            cuda.threadfence()                     # partials visible before the ticket
            cuda.syncthreads()
            if tid == 0:
                ticket = cuda.atomic.add(tickets, kvh, 1)
                s_flag[0] = 1 if ticket == n_splits - 1 else 0
            cuda.syncthreads()
            if s_flag[0] == 0:
                return
            cuda.threadfence()
        else:
            cuda.syncthreads()                     # out's rows, written by the block's threads
        cols = out.shape[1]
        if n_splits > 1:
            # merge_weights' work once a row, from shared memory: every (row, split)'s max and sum loaded
            # at once (a thread each), then a thread a row sums them in merge_weights' order (its bits)
            idx = tid
            while idx < n * G * n_splits:
                r = idx // n_splits
                sp = idx - r * n_splits
                t = r // G
                prow = t * n_head + kvh * G + r - t * G
                s_m[r * MS + sp] = part_ml[sp, prow, 0]
                s_l[r * MS + sp] = part_ml[sp, prow, 1]
                idx += cuda.blockDim.x
            cuda.syncthreads()
            if tid < n * G:
                mx = NEG_INF
                for sp in range(n_splits):
                    mx = max(mx, s_m[tid * MS + sp])
                den = float32(0)
                for sp in range(n_splits):
                    w = math.exp2(s_m[tid * MS + sp] - mx)
                    s_w[tid * MS + sp] = w
                    den += w * s_l[tid * MS + sp]
                s_inv[tid] = float32(1) / den
            cuda.syncthreads()
        v = cuda.local.array(8, float32)
        pv = cuda.local.array(NPV, float32)
        for it in range(warp, n * QB, WARPS):      # a warp a (token, q8_K block)
            t = it // QB
            blk = kvh * QB + it - t * QB
            c0 = blk * QK + lane * 8               # 8 values of one head (HD is a multiple of 32)
            head = c0 // HD
            d0 = c0 - head * HD
            if n_splits > 1:                       # merge_value's sums, every split's loads first
                row = t * n_head + head
                r = t * G + head - kvh * G
                for sp in range(MS):
                    if sp < n_splits:
                        for e in range(8):
                            pv[sp * 8 + e] = part_o[sp, row, d0 + e]
                for e in range(8):
                    acc = float32(0)
                    for sp in range(MS):
                        if sp < n_splits:
                            acc += s_w[r * MS + sp] * pv[sp * 8 + e]
                    x = acc * s_inv[r]
                    out[t, c0 + e] = x
                    v[e] = x
            else:
                for e in range(8):
                    v[e] = out[t, c0 + e]
            a = float32(0)
            for e in range(8):
                a = max(a, abs(v[e]))
            for off in (16, 8, 4, 2, 1):
                a = max(a, cuda.shfl_xor_sync(FULL, a, off))
            scale, qinv = q8k_scale(a)             # merge_q8k's arithmetic: the same bits
            tot = int32(0)
            base = 4 * xq_word(t, cols)
            for e in range(8):
                q = q8k_round(v[e], qinv)
                c = c0 + e
                xq[base + (c >> 5) * 256 + (c & 31)] = int8(q)      # tiled (q8k_layout)
                tot = int32(tot + q)
            tot = int32(tot + cuda.shfl_xor_sync(FULL, tot, 1))     # lanes 4s .. 4s + 3: sub-block s
            tot = int32(tot + cuda.shfl_xor_sync(FULL, tot, 2))
            ix = xd_base(t, cols // QK) + 8 * blk
            if lane & 3 == 0:
                xb[ix * 8 + (lane >> 2)] = tot
            if lane == 0:
                xd[ix] = scale
        if n_splits > 1 and tid == 0:
            tickets[kvh] = 0                       # ready for the next launch (graph replay)

    return rope_rows, q8k_tail, shared_rows(G, NMAX) * HD


def short_attention(qkv, q_norm, k_norm, eps, cos, sin, layer, state, out, ws, n_splits: int, plan,
                    splits_at: int | None, xq, xd, xb, rope: str = "neox", stream=0) -> None:
    """rope_write(qkv, ...) + prefill_attention(q, layer, state, out, ws, n_splits, plan=plan,
    splits_at=splits_at, merge=False) + merge_q8k(..., out, xq, xd, xb) in one launch: the same
    bits in the cache, out and (xq, xd, xb) (module docstring). n = qkv's rows (one row tile);
    `fusable` must have said yes for the plan and n. No allocation, no synchronization."""
    if rope not in ROPE_MODES:
        raise ValueError(f"short_attention: rope must be one of {ROPE_MODES}, not '{rope}'")
    n = qkv.shape[0]
    hd, n_kv = plan.head_dim, plan.n_kv
    kv_dtype = {np.dtype(np.int8): "int8", np.dtype(np.float16): "f16"}.get(np.dtype(layer.k.dtype))
    if kv_dtype != plan.kv_dtype:
        raise ValueError(f"short_attention: cache dtype {layer.k.dtype} but the plan is {plan.kv_dtype}")
    why = fusable(hd, plan.group, kv_dtype, n, plan.window, bool(getattr(layer, "ring", False)), n_splits)
    if why:
        raise ValueError(f"short_attention: {why}; use rope_write + prefill_attention + merge_q8k")
    if tuple(layer.k.shape[1:]) != (n_kv, hd):
        raise ValueError(f"short_attention: cache rows {tuple(layer.k.shape[1:])} != plan ({n_kv}, {hd})")
    if qkv.dtype != np.float32 or qkv.shape[1] != (plan.n_head + 2 * n_kv) * hd:
        raise ValueError(f"short_attention: qkv must be float32 [n, {(plan.n_head + 2 * n_kv) * hd}], "
                         f"got {qkv.dtype} {tuple(qkv.shape)}")
    if out.dtype != np.float32 or tuple(out.shape) != (n, plan.n_head * hd):
        raise ValueError(f"short_attention: out must be float32 [{n}, {plan.n_head * hd}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    q_norm, k_norm, qk_norm = check_rope_args(hd, q_norm, k_norm, cos, sin, rope, "short_attention")
    if not 1 <= n_splits <= min(plan.max_splits, ws.plan.max_splits):
        raise ValueError(f"short_attention: n_splits {n_splits} outside 1 .. {plan.max_splits}")
    if n_splits > 1 and n > ws.plan.n_max:
        raise ValueError(f"short_attention: {n} tokens > the workspace's n_max {ws.plan.n_max} with splits")
    if ws.tickets.size < n_kv:
        raise ValueError(f"short_attention: the workspace has {ws.tickets.size} tickets, the plan {n_kv} KV heads")
    if state.dtype != np.int32 or state.ndim != 1:
        raise ValueError("short_attention: state must be a 1-d int32 device array")
    if splits_at is not None and not 0 <= splits_at < state.shape[0]:
        raise ValueError(f"short_attention: splits_at {splits_at} is not a slot of the state")
    check_q8k("short_attention", n, out.shape[1], xq, xd, xb)
    from .attention_prefill_kernels import prefill_kernel
    fuse = (rope == "neox", qk_norm, n) + ((tuple(ABLATE),) if ABLATE else ())
    kern = prefill_kernel(hd, plan.group, kv_dtype, plan.bn, 0, plan.scale, fuse)
    kern[(1, n_kv, n_splits), THREADS, stream](
        qkv, q_norm, k_norm, float32(eps), cos, sin, layer.k, layer.v, layer.k_words, layer.v_words,
        layer.k_scale, layer.v_scale, state, out, ws.part_o, ws.part_ml,
        np.int32(-1 if splits_at is None else splits_at), ws.tickets,
        xq.reshape(xq.size), xd.reshape(xd.size), xb.reshape(xb.size))

