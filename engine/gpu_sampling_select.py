"""GPU sampler, the last two kernels: top_k / top_p / min_p / temperature and the draw,
without a sort; with their numpy reference.

Part of the GPU sampler: engine/gpu_sampling.py has the story (why every filter keeps a
prefix of the (logit desc, index asc) order, so "key > kappa plus the first q ties" is
the kept set) and launches these after gpu_sampling_greedy.py's two; the device helpers
and slots are in gpu_sampling_device.py. In order:
1. numpy reference: `reference_kept` (the kept set), `reference_weights` (fixed-point
   draw weights), `reference_draw` (inverse CDF in index order), `reference_sample`;
2. `_hist_kernel`: a histogram of (max - z) finds a bin that surely holds the cut;
3. `_select_kernel`: compacts the tokens above that bin; the last block does the exact
   top_k / top_p (`_radix_select`, `_sum_above`), min_p, the weights and the draw.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from . import kernel_cache
from .device_state import S_DRAWS as S_COUNTER
from .gpu_sampling_device import (BIN_SCALE, FULL, L_STOTAL, MASS_ONE, MAX_BLOCKS, NBINS, P_MINP,
                                  P_SEED_HI, P_SEED_LO, P_TEMP, P_TOPK, P_TOPP, W_ARGMAX, W_BCUT,
                                  W_DONE, W_KBIND, W_NCOMPACT, W_NFIN, W_TICKET_HIST,
                                  W_TICKET_SELECT, W_TOKEN, _block_count, _block_scan, _emit,
                                  _exp32, _key, _last_block, _mass, _splitmix_u32, _topp_target,
                                  reference_mass, reference_uniform32, topp_target)


# =====================================================================================
# numpy reference (the exact semantics the kernels implement)
# =====================================================================================
def reference_kept(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Boolean mask of the tokens the chain may draw from, for logits after bias and
    penalties (temperature > 0). Ties are ordered by index. A non-finite maximum keeps
    only the argmax, as the host does."""
    z = np.asarray(z, np.float32)
    keep = np.zeros(z.size, bool)
    zmax = z.max()
    if not np.isfinite(zmax):
        keep[int(np.argmax(z))] = True
        return keep
    order = np.lexsort((np.arange(z.size), -z.astype(np.float64)))
    zs = z[order]
    n_fin = int(np.isfinite(zs).sum())
    L = top_k if 0 < top_k < n_fin else n_fin
    m = reference_mass(zs[:L], zmax)
    if top_p < 1.0:
        t = topp_target(int(m.sum()), top_p)
        cum = np.cumsum(m)
        hit = np.nonzero(cum >= t)[0]
        if hit.size:
            L = min(L, int(hit[0]) + 1)
    sel = np.arange(L)
    if min_p > 0.0:
        sel = sel[_exp32(zs[:L] - zmax) >= np.float32(min_p)]
    keep[order[sel]] = True
    return keep


def reference_weights(z: np.ndarray, keep: np.ndarray, temperature: float) -> np.ndarray:
    """int64 fixed-point draw weights int64(float32(exp((z - max) / T)) * 2**32), 0 outside keep."""
    z = np.asarray(z, np.float32)
    zmax = z[keep].max()
    with np.errstate(over="ignore", invalid="ignore"):
        e = _exp32((z - zmax) / np.float32(temperature))
    w = (e * np.float32(MASS_ONE)).astype(np.int64)
    return np.where(keep, w, 0)


def reference_draw(weights: np.ndarray, u32: int) -> int:
    """Inverse CDF in index order: the first token whose cumulative weight exceeds
    floor(W * u / 2**32)."""
    total = int(weights.sum())
    target = (total * int(u32)) >> 32
    return int(np.searchsorted(np.cumsum(weights), target, side="right"))


def reference_sample(z, params, step: int, seed: int) -> int:
    """The token the kernels draw from logits z already biased and penalised."""
    z = np.asarray(z, np.float32)
    if params.temperature <= 0 or not np.isfinite(z.max()):
        return int(np.argmax(z))
    keep = reference_kept(z, params.top_k, params.top_p, params.min_p)
    return reference_draw(reference_weights(z, keep, params.temperature),
                          reference_uniform32(seed, step))



# =====================================================================================
# Kernels
# =====================================================================================
@cuda.jit
def _hist_kernel(logits, params_f, params_i, ws_i, ws_f, ws_l, hist_c, hist_m):
    """nb blocks. Histogram of d = max - z over NBINS bins of 1/BIN_SCALE nat (the last
    bin takes everything beyond): counts hist_c int32[NBINS] and fixed-point masses
    hist_m int64[NBINS] (exact integer sums, so the order of the atomics does not matter).
    Tokens in bins <= cut are a prefix of the order (logit desc, index asc) that surely
    holds every token the filters keep. The last block finds the cut:
      top_k binds (0 < k < n_finite): b_k = the bin holding the k-th largest logit;
      top_k does not bind, top_p < 1: b_p = the first bin where the cumulative mass
        reaches ceil(top_p * S), S = the mass of every finite logit (+1 bin of slack);
      min_p > 0: b_m = the bin of d = -ln(min_p) (+1 bin of slack).
    cut = b_k when top_k binds and top_p < 1 (the exact stage needs the whole top-k set
    for its S), else the smallest that applies. It zeroes the global histograms."""
    sh_c = cuda.shared.array(NBINS, int32)
    sh_m = cuda.shared.array(NBINS, int64)
    sh = cuda.shared.array(33, int64)
    sel = cuda.shared.array(4, int64)
    flag = cuda.shared.array(1, int32)
    if ws_i[W_DONE] != 0:
        return
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    nb = cuda.gridDim.x
    n = logits.shape[0]
    chunk = (n + nb - 1) // nb
    lo = cuda.blockIdx.x * chunk
    hi = min(n, lo + chunk)
    zmax = ws_f[0]
    for j in range(tid, NBINS, bdim):
        sh_c[j] = 0
        sh_m[j] = 0
    cuda.syncthreads()
    for i in range(lo + tid, hi, bdim):
        v = logits[i]
        d = zmax - v
        if d < float32(math.inf):                  # skips -inf (banned) and NaN
            dd = d * float32(BIN_SCALE)
            bin_ = NBINS - 1 if dd >= float32(NBINS - 1) else int32(dd)
            cuda.atomic.add(sh_c, bin_, 1)
            cuda.atomic.add(sh_m, bin_, _mass(v, zmax))
    cuda.syncthreads()
    for j in range(tid, NBINS, bdim):
        if sh_c[j] != 0:
            cuda.atomic.add(hist_c, j, sh_c[j])
            cuda.atomic.add(hist_m, j, sh_m[j])
    if not _last_block(ws_i, W_TICKET_HIST, flag):
        return
    # ---- last block: thread t owns bins [t*per, (t+1)*per)
    per = (NBINS + bdim - 1) // bdim
    b0 = min(NBINS, tid * per)
    b1 = min(NBINS, b0 + per)
    cseg = int64(0)
    mseg = int64(0)
    for j in range(b0, b1):
        c = int64(hist_c[j])
        m = hist_m[j]
        sh_c[j] = int32(c)
        sh_m[j] = m
        cseg += c
        mseg += m
        hist_c[j] = 0                  # ready for the next step
        hist_m[j] = 0
    cex, n_fin = _block_scan(cseg, sh)
    mex, s_total = _block_scan(mseg, sh)
    top_k = params_i[P_TOPK]
    top_p = params_f[P_TOPP]
    min_p = params_f[P_MINP]
    kbind = top_k > 0 and int64(top_k) < n_fin
    if tid == 0:
        sel[0] = NBINS - 1             # b_k
        sel[2] = NBINS - 1             # b_p
    cuda.syncthreads()
    if kbind:
        c = cex
        for j in range(b0, b1):
            c += sh_c[j]
            if c >= top_k and c - sh_c[j] < top_k:
                sel[0] = j
    cuda.syncthreads()
    if top_p < float32(1) and not kbind:
        t = _topp_target(s_total, top_p)
        m = mex
        for j in range(b0, b1):
            m += sh_m[j]
            if m >= t and m - sh_m[j] < t:
                sel[2] = min(j + 1, NBINS - 1)
    cuda.syncthreads()
    if tid == 0:
        b_k = sel[0]
        b_p = sel[2]
        b_m = int64(NBINS - 1)
        if min_p > float32(0):
            dm = -math.log(min_p) * float32(BIN_SCALE)
            if dm < float32(NBINS - 2):
                b_m = int64(dm) + 1
        if kbind:
            cut = b_k if top_p < float32(1) else min(b_k, b_m)
        else:
            cut = min(b_p, b_m)
        ws_i[W_BCUT] = int32(cut)
        ws_i[W_NFIN] = int32(n_fin)
        ws_i[W_KBIND] = 1 if kbind else 0
        ws_l[L_STOTAL] = s_total


@cuda.jit(device=True)
def _radix_select(keys, wts, n, use_w, target, restrict, key_lo, hist, sh, sel):
    """Single block. Over the n tokens (keys uint32[n], wts int64[n]) whose key is
    > key_lo when `restrict`, find the key kappa at which the cumulative weight, taken
    in descending key order, first reaches `target` (weight = wts[i] if use_w else 1):
        W(key > kappa) < target <= W(key >= kappa).
    Returns (kappa, W(key > kappa)). Four rounds of 8 bits; each round histograms the
    next digit of the tokens that match the digits found so far.
    hist int64[256], sh int64[33], sel int64[4] shared scratch."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    bdim = cuda.blockDim.x
    prefix = uint32(0)
    mask = uint32(0)
    above = int64(0)
    per = (256 + bdim - 1) // bdim
    p0 = min(256, tid * per)
    p1 = min(256, p0 + per)
    for rnd in range(4):
        shift = uint32(24 - 8 * rnd)
        for j in range(tid, 256, bdim):
            hist[j] = 0
        cuda.syncthreads()
        for base in range(0, n, bdim):          # uniform trip count: warp collectives below
            i = base + tid
            ok = False
            d = int32(-1)
            w = int64(0)
            if i < n:
                k = keys[i]
                if (k & mask) == prefix and (not restrict or k > key_lo):
                    ok = True
                    d = int32((k >> shift) & uint32(255))
                    w = wts[i] if use_w else int64(1)
            # lanes sharing lane 0's digit add through one atomic (ties and the first
            # round put most tokens in one bin); the others add their own
            d0 = cuda.shfl_sync(FULL, d, 0)
            same = ok and d == d0
            s = w if same else int64(0)
            off = 16
            while off > 0:
                s += cuda.shfl_xor_sync(FULL, s, off)
                off >>= 1
            if lane == 0 and d0 >= 0:
                cuda.atomic.add(hist, d0, s)
            if ok and not same:
                cuda.atomic.add(hist, d, w)
        cuda.syncthreads()
        # descending digits: position p holds digit 255 - p
        seg = int64(0)
        for p in range(p0, p1):
            seg += hist[255 - p]
        ex, total = _block_scan(seg, sh)
        rem = target - above
        if tid == 0:
            sel[0] = 0                           # not found (cannot happen): digit 0
            sel[1] = total - hist[0]
        cuda.syncthreads()
        c = ex
        for p in range(p0, p1):
            h = hist[255 - p]
            if c < rem and rem <= c + h:
                sel[0] = 255 - p
                sel[1] = c
            c += h
        cuda.syncthreads()
        digit = uint32(sel[0])
        above += sel[1]
        prefix = prefix | (digit << shift)
        mask = mask | (uint32(255) << shift)
        cuda.syncthreads()                       # sel and hist reused next round
    return prefix, above


@cuda.jit(device=True)
def _sum_above(keys, wts, n, kappa, sh, sel):
    """Single block: (sum of wts over key > kappa, count of key > kappa, the weight of a
    token whose key == kappa)."""
    tid = cuda.threadIdx.x
    s = int64(0)
    c = int64(0)
    for i in range(tid, n, cuda.blockDim.x):
        k = keys[i]
        if k > kappa:
            s += wts[i]
            c += 1
        elif k == kappa:
            sel[3] = wts[i]                      # all tied tokens share it: benign race
    ex, s_tot = _block_scan(s, sh)
    ex, c_tot = _block_scan(c, sh)
    return s_tot, c_tot, sel[3]


@cuda.jit
def _select_kernel(logits, params_f, params_i, state, ring, out, ws_i, ws_f, ws_l,
                   blk_cnt, reg_k, reg_v, reg_i, den_k, den_v, den_i, den_w, kept):
    """nb blocks. Block b compacts its tokens with bin(max - z) <= cut, in index order,
    into reg_*[b*chunk ...] (keys uint32, values float32, ids int32) and their count into
    blk_cnt int32[nb]. The last block packs the runs densely into den_* (size V;
    den_w int64 holds masses, then draw weights), then:
      1. top_k  (if it binds): kappa_k = radix select of the k-th key; q_k ties kept;
      2. top_p  (if < 1): S = mass of the top-k set; kappa_p = mass-weighted radix select
         of target T = ceil(top_p * S); q_p = tied tokens needed to reach T;
         the kept prefix is the shorter one: (kappa, q) = top_p's if active;
      3. min_p: exp(z - max) >= min_p;
      4. weights exp((z - max) / T) of the kept tokens, W = their sum, u = 32 random bits
         of (seed, state[S_DRAWS]), target = floor(W * u / 2**32), the token where the
         cumulative weight in index order passes target. Emits it.
    kept int8: if len(kept) >= V, 1 is written at every kept token (tests)."""
    sh = cuda.shared.array(33, int64)
    sel = cuda.shared.array(4, int64)
    hist = cuda.shared.array(256, int64)
    run_off = cuda.shared.array(MAX_BLOCKS, int32)
    flag = cuda.shared.array(1, int32)
    if ws_i[W_DONE] != 0:
        return
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    nb = cuda.gridDim.x
    b = cuda.blockIdx.x
    n_v = logits.shape[0]
    chunk = (n_v + nb - 1) // nb
    lo = b * chunk
    hi = min(n_v, lo + chunk)
    zmax = ws_f[0]
    cut = ws_i[W_BCUT]
    # ---- compaction of this block's chunk, in index order
    run = int64(0)
    for base in range(lo, hi, bdim):
        i = base + tid
        take = False
        v = float32(0)
        if i < hi:
            v = logits[i]
            d = zmax - v
            if d < float32(math.inf):
                dd = d * float32(BIN_SCALE)
                bin_ = NBINS - 1 if dd >= float32(NBINS - 1) else int32(dd)
                take = bin_ <= cut
        ex, tot = _block_count(int32(take), sh)
        if take:
            dst = b * chunk + run + ex
            reg_k[dst] = _key(v)
            reg_v[dst] = v
            reg_i[dst] = i
        run += tot
    if tid == 0:
        blk_cnt[b] = int32(run)
    if not _last_block(ws_i, W_TICKET_SELECT, flag):
        return

    # ---- last block: pack the runs densely, run r at offset sum(blk_cnt[:r])
    per = (nb + bdim - 1) // bdim
    r0 = min(nb, tid * per)
    r1 = min(nb, r0 + per)
    seg = int64(0)
    for r in range(r0, r1):
        seg += blk_cnt[r]
    off, n = _block_scan(seg, sh)
    for r in range(r0, r1):
        run_off[r] = int32(off)
        off += blk_cnt[r]
    cuda.syncthreads()
    s_loc = int64(0)
    for p in range(tid, n, bdim):                # dense position p: find its run by
        lo_r = 0                                 # binary search (last r: run_off[r] <= p)
        hi_r = nb - 1
        while lo_r < hi_r:
            mid = (lo_r + hi_r + 1) >> 1
            if run_off[mid] <= p:
                lo_r = mid
            else:
                hi_r = mid - 1
        src = lo_r * chunk + (p - run_off[lo_r])
        vv = reg_v[src]
        m = _mass(vv, zmax)
        den_k[p] = reg_k[src]
        den_v[p] = vv
        den_i[p] = reg_i[src]
        den_w[p] = m
        s_loc += m
    ex, s_c = _block_scan(s_loc, sh)             # mass of the compacted tokens
    # (the scan's barriers also make den_* visible to the whole block)

    top_k = int64(params_i[P_TOPK])
    top_p = params_f[P_TOPP]
    min_p = params_f[P_MINP]
    temp = params_f[P_TEMP]
    # The compacted tokens are the n best of the vocabulary (a prefix of the order
    # "logit descending, index ascending"). A filter whose prefix is longer than n does
    # not bind here: top_k > n happens only when min_p already cut (top_p is then off),
    # a top_p target above the compacted mass only when min_p cut first.
    kbind = ws_i[W_KBIND] != 0 and top_k <= n
    has_pref = False                             # kept prefix: key > kf, or key == kf and
    kf = uint32(0)                               # among the first qf such tokens by index
    qf = int64(0)
    # ---- 1. top_k
    kk = uint32(0)
    qk = int64(0)
    g_k = int64(0)
    if kbind:
        kk, g_k = _radix_select(den_k, den_w, n, False, top_k, False, uint32(0), hist, sh, sel)
        qk = top_k - g_k
        has_pref = True
        kf = kk
        qf = qk
    # ---- 2. top_p (softmax over the top-k set, as the host normalises)
    if top_p < float32(1):
        a_k = int64(0)
        m_k = int64(0)
        if kbind:
            a_k, c_k, m_k = _sum_above(den_k, den_w, n, kk, sh, sel)
            s = a_k + qk * m_k
        else:
            s = ws_l[L_STOTAL]
        t = _topp_target(s, top_p)
        if t <= s and t <= s_c:
            if kbind and t > a_k:                # the cut falls among the ties at kappa_k
                kp = kk
                a_p = a_k
                m_p = m_k
            else:
                kp, a_p = _radix_select(den_k, den_w, n, True, t, kbind, kk, hist, sh, sel)
                a_chk, g_p, m_p = _sum_above(den_k, den_w, n, kp, sh, sel)
            has_pref = True
            kf = kp
            qf = (t - a_p + m_p - 1) // m_p      # ties needed: least r with a_p + r*m_p >= t
    # ---- 3. kept set (prefix and min_p), temperature weights into den_w, their total.
    # Thread t owns the contiguous dense positions [p0, p1): index order is thread order,
    # so one scan of per-thread counts gives each thread the tie rank it starts from,
    # and one scan of per-thread weight sums gives the cumulative weight it starts from.
    seg = (n + bdim - 1) // bdim
    p0 = min(n, tid * seg)
    p1 = min(n, p0 + seg)
    c_eq = int64(0)
    if has_pref:
        for p in range(p0, p1):
            if den_k[p] == kf:
                c_eq += 1
    rank, tot = _block_scan(c_eq, sh)            # ties at kf before this thread's run
    write_kept = kept.shape[0] >= n_v
    w_loc = int64(0)
    for p in range(p0, p1):
        k = den_k[p]
        v = den_v[p]
        keep = not has_pref or k > kf
        if has_pref and k == kf:
            keep = rank < qf                     # the first qf tied tokens by index
            rank += 1
        if keep and min_p > float32(0):
            keep = float32(math.exp(v - zmax)) >= min_p
        w = int64(0)
        if keep:
            w = int64(float32(math.exp((v - zmax) / temp)) * float32(MASS_ONE))
            if write_kept:
                kept[den_i[p]] = 1
        den_w[p] = w
        w_loc += w
    w_ex, total = _block_scan(w_loc, sh)
    # ---- 4. draw: target = floor(total * u / 2**32), exact in 64-bit pieces; the thread
    # whose weight range holds it walks its positions to the token
    u = _splitmix_u32(params_i[P_SEED_LO], params_i[P_SEED_HI], state[S_COUNTER])
    tw = uint64(total)
    uu = uint64(u)
    target = int64((tw >> uint64(32)) * uu + (((tw & uint64(0xFFFFFFFF)) * uu) >> uint64(32)))
    if tid == 0:
        sel[0] = -1
    cuda.syncthreads()
    if w_ex <= target and target < w_ex + w_loc:
        c = w_ex
        for p in range(p0, p1):
            w = den_w[p]
            if c <= target and target < c + w:
                sel[0] = den_i[p]
                break
            c += w
    cuda.syncthreads()
    if tid == 0:
        tok = int32(sel[0])
        if tok < 0:                              # cannot happen (the max is always kept)
            tok = int32(ws_i[W_ARGMAX])
        _emit(tok, state, out, ring)
        ws_i[W_TOKEN] = tok
        ws_i[W_NCOMPACT] = int32(n)

kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)
