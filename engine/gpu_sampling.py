"""Token sampling on the GPU for one sequence: llama.cpp's chain, graph-capturable.

Same chain and semantics as the host sampler (engine/sampling.py, the reference):

    logit_bias -> penalties (repeat / presence / frequency over the last repeat_last_n
    tokens) -> top_k -> top_p -> min_p -> temperature -> draw
    temperature <= 0: greedy argmax (lowest index wins ties, like np.argmax)

Everything a step needs lives in device memory, so one captured CUDA graph serves every
token: the logits, the request's parameters (copied once per request by `set_request`),
the recent-token ring for the penalties, the RNG step counter, and the sampled token,
which is written to state[1] (the next step's input) and to an output slot the host
reads to stream text.

No sort. Every filter keeps a prefix of the candidates ordered by (logit descending,
index ascending), so the kept set is "key > kappa, plus the first q tokens (by index)
whose key == kappa", where key is the logit's float bits made monotone:
  - top_k: kappa = the k-th largest key, found by a 4-round radix select (8 bits a round)
    with block-wide counting;
  - top_p: the same radix select weighted by the softmax mass exp(z - max) (as 32.32
    fixed-point integers, so sums are exact and order-independent), then the number of
    tied tokens needed to reach top_p * S;
  - min_p: exp(z - max) >= min_p (a plain threshold on the logit);
  - temperature: weights exp((z - max) / T), the draw is an inverse CDF over the kept set
    in index order (a valid sample of the same distribution; the order does not matter),
    from a counter-based RNG (splitmix64 of seed + step), so the same seed gives the same
    tokens and every graph replay draws a fresh number.
To keep that exact work small, a histogram of (max - z) in 1/8-nat bins first finds a
bin that surely contains the cut; only tokens above it (usually a few dozen) are
compacted and handed to a single block. Any size still works, only slower.

Kernels, in launch order (`sample` launches all four, `sample_greedy` the first two):
  1. _penalties_kernel  1 block    logit_bias and penalties, in place on the logits
  2. _argmax_kernel     nb blocks  max and argmax; greedy (or a non-finite max): emits
  3. _hist_kernel       nb blocks  (max - z) histogram of counts and masses -> the cut bin
  4. _select_kernel     nb blocks  compacts the tokens above the cut; the last block to
                                   finish does the exact top_k / top_p / min_p and the draw
Each multi-block kernel ends with "the last block to finish" (a threadfence, an atomic
ticket): no grid-wide barrier, safe in the simulator and in any grid size.
`advance_state` (state[0] += 1) is a separate tiny kernel so the caller orders it.

Device state (int32, owned by the caller; the slots are defined in engine/device_state.py):
    S_POS     position of the current token      (advance_state adds 1)
    S_TOKEN   current token id                   (written by the sampler)
    S_DRAWS   sample counter: draws so far in this request; the RNG step, and the output
              slot is out[state[S_DRAWS] % len(out)]   (set to 0 by set_request)
    S_HIST    tokens pushed into the recent-token ring so far (prompt + generated); the
              sampler pushes each sampled token (set to len(history) by set_request)
Parameters (set per request by `set_request`, never per token):
    params_f float32[8]: temperature, top_p, min_p, repeat_penalty, presence_penalty,
                         frequency_penalty, -, -
    params_i int32[8]:   top_k, repeat_last_n, n_bias, seed_lo, seed_hi, -, -, -
    bias_ids int32[max_bias], bias_vals float32[max_bias]: the logit_bias pairs
    ring int32[ring_capacity]: recent tokens, token j of the history at ring[j % capacity]

Grammar masks (engine/constrain.py): `apply_mask` bans, in place, every token whose bit is clear
in ws.mask (int32[(V + 31) // 32], bit i % 32 of word i // 32: llguidance's bitmask layout);
`upload_mask` copies the host's mask for the next step there (through a pinned mirror, async on
the stream). Launched before `sample`, in the same graph: the mask is the step's input like the
token id, so one captured graph serves every step of a constrained request.

Deliberately not here: batches of sequences, logprobs, mirostat / typical /
DRY samplers. The logits buffer is modified in place (bias and penalties). NaN logits
are treated as banned (the host's np.argmax would pick them). The GPU's RNG is not
numpy's: for the same seed the CPU and CUDA back-ends draw different (equally
distributed) tokens.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from genie_rt.quant import ptx   # simulator: installs warp shuffles on the fake cuda module

from . import kernel_cache
from .arena import Arena, ArenaLayout
from .device_state import S_DRAWS as S_COUNTER
from .device_state import S_HIST, S_POS, S_TOKEN
from .h2d import pinned_like, upload

SIMULATOR = ptx.SIMULATOR
FULL = 0xFFFFFFFF

# params_f slots
P_TEMP, P_TOPP, P_MINP, P_REPEAT, P_PRESENCE, P_FREQUENCY = 0, 1, 2, 3, 4, 5
# params_i slots
P_TOPK, P_LASTN, P_NBIAS, P_SEED_LO, P_SEED_HI = 0, 1, 2, 3, 4
# state slots: S_POS, S_TOKEN, S_COUNTER (= S_DRAWS), S_HIST from engine/device_state.py
# ws_i (workspace int32) slots
W_TICKET_ARGMAX, W_TICKET_HIST, W_TICKET_SELECT = 0, 1, 2
W_DONE = 3        # 1: the token of this step is already emitted (greedy / non-finite max)
W_ARGMAX = 4      # argmax index (after bias and penalties)
W_BCUT = 5        # histogram bin of the cut: tokens in bins <= W_BCUT are compacted
W_NFIN = 6        # number of finite logits
W_KBIND = 7       # 1 if top_k binds (0 < top_k < n_finite)
W_NCOMPACT = 8    # tokens handed to the exact stage (diagnostic)
W_TOKEN = 9       # last sampled token (diagnostic)
WS_I_LEN = 16
# ws_l (workspace int64) slots
L_STOTAL = 0      # fixed-point softmax mass of all finite logits
WS_L_LEN = 8

NBINS = 512                   # histogram bins of (max - z)
BIN_SCALE = 8.0               # bins per nat: the bins cover 64 nats, the last one the rest
MASS_ONE = 4294967296.0       # fixed point: exp(z - max) in (0, 1] -> int64(e * 2**32)
INT32_MAX = 2147483647
MAX_BLOCKS = 1024              # grid size limit of the multi-block kernels
GOLDEN = 0x9E3779B97F4A7C15   # splitmix64 increment


# =====================================================================================
# numpy reference (the exact semantics the kernels implement)
# =====================================================================================
def splitmix64(x: int) -> int:
    """One splitmix64 output for state x (Python ints, mod 2**64)."""
    m = (1 << 64) - 1
    z = (x + GOLDEN) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def reference_uniform32(seed: int, step: int) -> int:
    """The 32 random bits of draw number `step` (0, 1, ...) for a 64-bit seed."""
    x = (seed + (step & 0xFFFFFFFF) * GOLDEN) & ((1 << 64) - 1)
    return splitmix64(x) >> 32


def float_key(z: np.ndarray) -> np.ndarray:
    """float32 -> uint32 whose unsigned order is the float order (-0.0 and +0.0 equal)."""
    b = (np.asarray(z, np.float32) + np.float32(0)).view(np.uint32)
    return np.where(b >> 31, ~b, b | np.uint32(0x80000000)).astype(np.uint32)


def _exp32(x: np.ndarray) -> np.ndarray:
    """float32 exp, correctly rounded (the kernels' expf is within 2 ulp of it)."""
    return np.exp(np.asarray(x, np.float64)).astype(np.float32)


def reference_mass(z: np.ndarray, zmax) -> np.ndarray:
    """int64 fixed-point softmax numerators: int64(float32(exp(z - max)) * 2**32)."""
    e = _exp32(np.asarray(z, np.float32) - np.float32(zmax))
    return (e * np.float32(MASS_ONE)).astype(np.int64)


def topp_target(s: int, top_p: float) -> int:
    """Smallest cumulative mass that satisfies top_p: ceil(float32(S) * top_p), >= 1."""
    x = np.float32(s) * np.float32(top_p)
    t = int(x)
    if np.float32(t) < x:
        t += 1
    return max(t, 1)


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
# Device helpers
# =====================================================================================
if SIMULATOR:
    def _f32_bits(v):
        return np.uint32(np.float32(v).view(np.uint32))

    def _fma32(a, b, c):
        # the host computes count * fp + pp in float64; so do we (then round once)
        return np.float32(float(a) * float(b) + float(c))

    def _splitmix_u32(seed_lo, seed_hi, step):
        seed = (int(seed_lo) & 0xFFFFFFFF) | ((int(seed_hi) & 0xFFFFFFFF) << 32)
        return np.uint32(reference_uniform32(seed, int(step)))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _f32_bits(v):
        return uint32(libdevice.float_as_int(v))

    @cuda.jit(device=True)
    def _fma32(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True)
    def _splitmix_u32(seed_lo, seed_hi, step):
        seed = uint64(int64(seed_lo) & 0xFFFFFFFF) | (uint64(int64(seed_hi) & 0xFFFFFFFF) << uint64(32))
        x = seed + uint64(int64(step) & 0xFFFFFFFF) * uint64(GOLDEN)
        z = x + uint64(GOLDEN)
        z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
        z = z ^ (z >> uint64(31))
        return uint32(z >> uint64(32))


@cuda.jit(device=True)
def _key(v):
    """Monotone uint32 key of a float32 (+0.0 and -0.0 map to the same key)."""
    b = _f32_bits(v + float32(0))
    if b >= uint32(0x80000000):
        return b ^ uint32(0xFFFFFFFF)
    return b | uint32(0x80000000)


@cuda.jit(device=True)
def _mass(v, zmax):
    """Fixed-point softmax numerator int64(float32(exp(v - max)) * 2**32); identical
    in every kernel so the histogram and the exact stage agree to the last unit."""
    e = float32(math.exp(v - zmax))
    return int64(e * float32(MASS_ONE))


@cuda.jit(device=True)
def _topp_target(s, top_p):
    """ceil(float32(s) * top_p) as int64, at least 1 (see topp_target)."""
    x = float32(s) * top_p
    t = int64(x)
    if float32(t) < x:
        t += 1
    if t < 1:
        t = int64(1)
    return t


@cuda.jit(device=True)
def _argmax_code(v, i):
    """int64 whose signed order is the argmax order: larger value first, then lower
    index (np.argmax's tie rule). NaN counts as -inf."""
    if v != v:
        v = float32(-math.inf)
    return (int64(_key(v)) - 2147483648) * 4294967296 + (INT32_MAX - int64(i))


@cuda.jit(device=True)
def _code_index(code):
    return int32(INT32_MAX - (code & 0xFFFFFFFF))


@cuda.jit(device=True)
def _block_max(x, sh):
    """Block-wide max of int64 x; every thread gets it. sh: shared int64[33]."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    nw = cuda.blockDim.x >> 5
    off = 16
    while off > 0:
        x = max(x, cuda.shfl_xor_sync(FULL, x, off))
        off >>= 1
    if nw == 1:                        # one warp: done, no barrier needed
        return x
    if lane == 0:
        sh[tid >> 5] = x
    cuda.syncthreads()
    x = sh[lane] if lane < nw else sh[0]
    off = 16
    while off > 0:
        x = max(x, cuda.shfl_xor_sync(FULL, x, off))
        off >>= 1
    cuda.syncthreads()                 # sh may be reused right after
    return x


@cuda.jit(device=True)
def _warp_incl_scan(x, lane):
    off = 1
    while off < 32:
        y = cuda.shfl_up_sync(FULL, x, off)
        if lane >= off:
            x += y
        off <<= 1
    return x


@cuda.jit(device=True)
def _block_scan(x, sh):
    """Block-wide exclusive prefix sum of int64 x in thread order; returns
    (exclusive, total). sh: shared int64[33]. Every thread must call it."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    nw = cuda.blockDim.x >> 5
    inc = _warp_incl_scan(x, lane)
    if nw == 1:                        # one warp: the total is lane 31's, no barrier
        return inc - x, cuda.shfl_sync(FULL, inc, 31)
    if lane == 31:
        sh[warp] = inc
    cuda.syncthreads()
    if warp == 0:
        t = sh[lane] if lane < nw else int64(0)
        t2 = _warp_incl_scan(t, lane)
        if lane < nw:
            sh[lane] = t2 - t          # exclusive offset of warp `lane`
        if lane == 31:
            sh[32] = t2                # block total
    cuda.syncthreads()
    ex = inc - x + sh[warp]
    total = sh[32]
    cuda.syncthreads()                 # sh may be reused right after
    return ex, total


@cuda.jit(device=True)
def _block_count(flag, sh):
    """_block_scan for a 0/1 flag through warp ballots: (rank among the flagged threads
    before this one, number flagged). sh: shared int64[33]."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    nw = cuda.blockDim.x >> 5
    bits = uint32(cuda.ballot_sync(FULL, flag))
    rank = int64(cuda.popc(bits & cuda.lanemask_lt()))
    cnt = int64(cuda.popc(bits))
    if nw == 1:
        return rank, cnt
    if lane == 0:
        sh[warp] = cnt
    cuda.syncthreads()
    if warp == 0:
        t = sh[lane] if lane < nw else int64(0)
        t2 = _warp_incl_scan(t, lane)
        if lane < nw:
            sh[lane] = t2 - t
        if lane == 31:
            sh[32] = t2
    cuda.syncthreads()
    rank += sh[warp]
    total = sh[32]
    cuda.syncthreads()
    return rank, total


@cuda.jit(device=True)
def _last_block(ticket, slot, flag):
    """Every block calls this after writing its results: returns True in the last block
    to arrive (which resets the ticket for the next launch). flag: shared int32[1]."""
    cuda.threadfence()                 # this block's global writes before its ticket
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        old = cuda.atomic.add(ticket, slot, 1)
        last = old == cuda.gridDim.x - 1
        flag[0] = 1 if last else 0
        if last:
            ticket[slot] = 0
    cuda.syncthreads()
    is_last = flag[0] == 1
    if is_last:
        cuda.threadfence()             # then read the other blocks' results
    return is_last


@cuda.jit(device=True)
def _emit(token, state, out, ring):
    """One thread: publish the sampled token (state[1], the output slot, the ring)."""
    cnt = state[S_COUNTER]
    state[S_TOKEN] = token
    out[uint32(cnt) % uint32(out.shape[0])] = token
    state[S_COUNTER] = cnt + 1
    h = state[S_HIST]
    ring[uint32(h) % uint32(ring.shape[0])] = token
    state[S_HIST] = h + 1


# =====================================================================================
# Kernels
# =====================================================================================
@cuda.jit
def _penalties_kernel(logits, params_f, params_i, bias_ids, bias_vals, ring, state, pen_cnt, ws_i):
    """One block. logits float32[V] (in place), bias_ids int32[max_bias],
    bias_vals float32[max_bias], ring int32[R], state int32[>=4], pen_cnt int32[V]
    (all zero between launches), ws_i int32[16].

    Matches Sampler.apply_penalties: bias first; then for each distinct token t of the
    last repeat_last_n tokens with count c: z = z / rp if z > 0 else z * rp;
    z -= c * freq + pres. Distinct tokens are found with atomics on pen_cnt: one pass
    counts, a second takes the count with atomic.exch (first taker applies, and the
    table is left zeroed)."""
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    if tid == 0:
        ws_i[W_DONE] = 0               # a new step: nothing emitted yet
    n_bias = params_i[P_NBIAS]
    for j in range(tid, n_bias, bdim):
        t = bias_ids[j]
        logits[t] = logits[t] + bias_vals[j]       # -inf bans (x + -inf = -inf)
    cuda.syncthreads()                 # biased values before the penalties read them
    rp = params_f[P_REPEAT]
    pres = params_f[P_PRESENCE]
    freq = params_f[P_FREQUENCY]
    if rp == float32(1) and pres == float32(0) and freq == float32(0):
        return
    count = state[S_HIST]
    cap = ring.shape[0]
    lastn = params_i[P_LASTN]
    w = count if lastn < 0 else min(lastn, count)
    w = min(w, cap)
    for j in range(tid, w, bdim):
        pos = uint32(count - 1 - j) % uint32(cap)
        cuda.atomic.add(pen_cnt, ring[pos], 1)
    cuda.syncthreads()
    for j in range(tid, w, bdim):
        pos = uint32(count - 1 - j) % uint32(cap)
        t = ring[pos]
        c = cuda.atomic.exch(pen_cnt, t, 0)
        if c > 0:
            z = logits[t]
            if rp != float32(1):
                z = z / rp if z > float32(0) else z * rp
            logits[t] = z - _fma32(float32(c), freq, pres)


@cuda.jit
def _argmax_kernel(logits, params_f, state, ring, out, ws_i, ws_f, part, force):
    """nb blocks, block b owns logits[b*chunk : (b+1)*chunk]. part int64[nb]: per-block
    argmax codes (_argmax_code). The last block reduces them: ws_i[W_ARGMAX] = argmax,
    ws_f[0] = its logit (the max); if force != 0, temperature <= 0 or the max is not
    finite, it emits the argmax and sets ws_i[W_DONE] (later kernels then return)."""
    sh = cuda.shared.array(33, int64)
    flag = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    nb = cuda.gridDim.x
    b = cuda.blockIdx.x
    n = logits.shape[0]
    chunk = (n + nb - 1) // nb
    lo = b * chunk
    hi = min(n, lo + chunk)
    best = int64(-9223372036854775807)
    for i in range(lo + tid, hi, bdim):
        best = max(best, _argmax_code(logits[i], i))
    best = _block_max(best, sh)
    if tid == 0:
        part[b] = best
    if not _last_block(ws_i, W_TICKET_ARGMAX, flag):
        return
    best = int64(-9223372036854775807)
    for j in range(tid, nb, bdim):
        best = max(best, part[j])
    best = _block_max(best, sh)
    if tid == 0:
        bi = _code_index(best)
        bv = logits[bi]
        ws_f[0] = bv
        ws_i[W_ARGMAX] = bi
        temp = params_f[P_TEMP]
        if force != 0 or not (temp > float32(0)) or not (abs(bv) < float32(math.inf)):
            _emit(bi, state, out, ring)
            ws_i[W_TOKEN] = bi
            ws_i[W_DONE] = 1


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
         of (seed, state[2]), target = floor(W * u / 2**32), the token where the
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


@cuda.jit
def _mask_kernel(logits, mask):
    """One thread per token: logits[i] = -inf where bit i of the mask is clear."""
    i = cuda.grid(1)
    if i < logits.shape[0]:
        if (uint32(mask[i >> 5]) >> uint32(i & 31)) & uint32(1) == uint32(0):
            logits[i] = float32(-math.inf)


@cuda.jit
def _advance_state_kernel(state):
    """state[0] += 1 (the position of the next token)."""
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        state[S_POS] += 1


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)


# =====================================================================================
# Launchers
# =====================================================================================
_SIG_PENALTIES = ("void(float32[::1], float32[::1], int32[::1], int32[::1], float32[::1], "
                  "int32[::1], int32[::1], int32[::1], int32[::1])")
_SIG_ARGMAX = ("void(float32[::1], float32[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
               "float32[::1], int64[::1], int32)")
_SIG_HIST = ("void(float32[::1], float32[::1], int32[::1], int32[::1], float32[::1], int64[::1], "
             "int32[::1], int64[::1])")
_SIG_SELECT = ("void(float32[::1], float32[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
               "int32[::1], float32[::1], int64[::1], int32[::1], uint32[::1], float32[::1], "
               "int32[::1], uint32[::1], float32[::1], int32[::1], int64[::1], int8[::1])")
_SIG_ADVANCE = "void(int32[::1])"
_SIG_MASK = "void(float32[::1], int32[::1])"
KERNEL_SIGNATURES = {
    "_mask_kernel": _SIG_MASK,
    "_penalties_kernel": _SIG_PENALTIES,
    "_argmax_kernel": _SIG_ARGMAX,
    "_hist_kernel": _SIG_HIST,
    "_select_kernel": _SIG_SELECT,
    "_advance_state_kernel": _SIG_ADVANCE,
}
_compiled = False


def compile_kernels() -> None:
    """Compile every kernel for the current GPU now (call at load, never on a request).
    No-op under the simulator."""
    global _compiled
    if _compiled or SIMULATOR:
        return
    for name, sig in KERNEL_SIGNATURES.items():
        globals()[name].compile(sig)
    _compiled = True


@dataclass
class SamplerWorkspace:
    """Device buffers of one sequence's sampler (shapes in comments; V = vocab,
    nb = n_blocks, C = chunk). All live in an arena and never move."""
    vocab: int
    n_blocks: int
    chunk: int
    block: int
    ring_capacity: int
    max_bias: int
    params_f: object      # float32[8]  request parameters (see module docs)
    params_i: object      # int32[8]
    bias_ids: object      # int32[max_bias]
    bias_vals: object     # float32[max_bias]
    ring: object          # int32[ring_capacity] recent tokens (prompt + generated)
    pen_cnt: object       # int32[V] penalty counts, all zero between steps
    ws_i: object          # int32[16] tickets, flags, cut, diagnostics (W_* slots)
    ws_f: object          # float32[8] ws_f[0] = max logit
    ws_l: object          # int64[8] ws_l[0] = fixed-point mass of all finite logits
    part: object          # int64[nb] per-block argmax codes
    hist_c: object        # int32[NBINS] histogram counts, zero between steps
    hist_m: object        # int64[NBINS] histogram masses, zero between steps
    blk_cnt: object       # int32[nb] compacted tokens per block
    reg_k: object         # uint32[nb*C] per-block runs: keys
    reg_v: object         # float32[nb*C] values
    reg_i: object         # int32[nb*C] token ids
    den_k: object         # uint32[V] dense runs (exact stage)
    den_v: object         # float32[V]
    den_i: object         # int32[V]
    den_w: object         # int64[V] masses, then draw weights
    kept: object          # int8[V] with debug_kept (tests), else int8[1]
    mask: object = None   # int32[(V+31)//32] grammar bitmask of the step (apply_mask)
    host: dict = None     # pinned host mirrors of the per-request buffers (set_request)


_BUFFERS = [  # name, dtype, length as a function of (V, nb, C, R, B)
    ("params_f", np.float32, lambda V, nb, C, R, B: 8),
    ("params_i", np.int32, lambda V, nb, C, R, B: 8),
    ("bias_ids", np.int32, lambda V, nb, C, R, B: B),
    ("bias_vals", np.float32, lambda V, nb, C, R, B: B),
    ("ring", np.int32, lambda V, nb, C, R, B: R),
    ("pen_cnt", np.int32, lambda V, nb, C, R, B: V),
    ("ws_i", np.int32, lambda V, nb, C, R, B: WS_I_LEN),
    ("ws_f", np.float32, lambda V, nb, C, R, B: 8),
    ("ws_l", np.int64, lambda V, nb, C, R, B: WS_L_LEN),
    ("part", np.int64, lambda V, nb, C, R, B: nb),
    ("hist_c", np.int32, lambda V, nb, C, R, B: NBINS),
    ("hist_m", np.int64, lambda V, nb, C, R, B: NBINS),
    ("blk_cnt", np.int32, lambda V, nb, C, R, B: nb),
    ("reg_k", np.uint32, lambda V, nb, C, R, B: nb * C),
    ("reg_v", np.float32, lambda V, nb, C, R, B: nb * C),
    ("reg_i", np.int32, lambda V, nb, C, R, B: nb * C),
    ("den_k", np.uint32, lambda V, nb, C, R, B: V),
    ("den_v", np.float32, lambda V, nb, C, R, B: V),
    ("den_i", np.int32, lambda V, nb, C, R, B: V),
    ("den_w", np.int64, lambda V, nb, C, R, B: V),
    ("mask", np.int32, lambda V, nb, C, R, B: (V + 31) // 32),
]


def _geometry(vocab: int, block: int, chunk: int) -> tuple[int, int]:
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    if block < 32 or block > 1024 or block & (block - 1):
        raise ValueError(f"block must be a power of two in 32..1024, got {block}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    nb = -(-vocab // chunk)
    if nb > MAX_BLOCKS:
        raise ValueError(f"vocab {vocab} / chunk {chunk} = {nb} blocks > {MAX_BLOCKS}: use a larger chunk")
    return nb, -(-vocab // nb)


def workspace_layout(layout: ArenaLayout, vocab: int, *, prefix: str = "sampler.",
                     ring_capacity: int = 4096, max_bias: int = 256, block: int = 256,
                     chunk: int = 1024, debug_kept: bool = False) -> None:
    """Add the sampler's buffers to an arena layout (the same arguments go to
    workspace_from_arena). ring_capacity bounds repeat_last_n; repeat_last_n = -1 (the
    whole context) is exact while the history fits: give it n_ctx."""
    nb, ch = _geometry(vocab, block, chunk)
    for name, dt, size in _BUFFERS:
        layout.add(prefix + name, (size(vocab, nb, ch, ring_capacity, max_bias),), dt)
    layout.add(prefix + "kept", (vocab if debug_kept else 1,), np.int8)


def workspace_from_arena(arena: Arena, vocab: int, *, prefix: str = "sampler.",
                         ring_capacity: int = 4096, max_bias: int = 256, block: int = 256,
                         chunk: int = 1024, debug_kept: bool = False, stream=0) -> SamplerWorkspace:
    """The workspace's views of an arena laid out by workspace_layout; zeroes the buffers
    that must start at zero (a host copy: call at load)."""
    nb, ch = _geometry(vocab, block, chunk)
    views = {name: arena[prefix + name] for name, _, _ in _BUFFERS}
    ws = SamplerWorkspace(vocab=vocab, n_blocks=nb, chunk=ch, block=block,
                          ring_capacity=ring_capacity, max_bias=max_bias,
                          kept=arena[prefix + "kept"], **views)
    for name in ("params_f", "params_i", "pen_cnt", "ws_i", "ws_f", "ws_l", "hist_c", "hist_m", "kept"):
        buf = getattr(ws, name)
        buf.copy_to_device(np.zeros(buf.shape, buf.dtype), stream=stream)
    ws.host = _host_mirrors(ws)
    return ws


def make_workspace(vocab: int, **kw) -> SamplerWorkspace:
    """A workspace in its own allocation (tests, benchmarks); see workspace_layout."""
    prefix = kw.pop("prefix", "sampler.")
    stream = kw.pop("stream", 0)
    layout = ArenaLayout()
    workspace_layout(layout, vocab, prefix=prefix, **kw)
    ws = workspace_from_arena(Arena(layout), vocab, prefix=prefix, stream=stream, **kw)
    return ws


_is_device_array = ptx.is_device_array


def _check(name, a, dtype, min_len=1, length=None):
    if not _is_device_array(a):
        raise TypeError(f"{name} must be a device array (cuda.device_array / an arena view / "
                        f"cuda.mapped_array), got {type(a).__name__}")
    if a.dtype != np.dtype(dtype) or a.ndim != 1:
        raise TypeError(f"{name} must be a 1-d {np.dtype(dtype).name} array, got {a.dtype} {a.shape}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have {length} elements, got {a.shape[0]}")
    if a.shape[0] < min_len:
        raise ValueError(f"{name} must have at least {min_len} elements, got {a.shape[0]}")
    if a.strides[0] != a.dtype.itemsize:
        raise ValueError(f"{name} must be contiguous")


def _check_step(ws: SamplerWorkspace, logits, state, out) -> None:
    _check("logits", logits, np.float32, length=ws.vocab)
    _check("state", state, np.int32, min_len=4)
    _check("out", out, np.int32)


def set_request(ws: SamplerWorkspace, params, history, state, stream=0) -> int:
    """Per request, before its first sample: copy the parameters, the logit_bias pairs, the
    history (prompt tokens; the ring keeps the last ring_capacity) and state[2] = 0,
    state[3] = len(history) to the device. Returns the 64-bit seed used (a random one when
    params.seed is None or negative). Raises ValueError for what the kernels cannot do."""
    params.validate(ws.vocab)
    penalised = (params.repeat_penalty != 1.0 or params.presence_penalty != 0.0
                 or params.frequency_penalty != 0.0)
    if penalised and params.repeat_last_n > ws.ring_capacity:
        raise ValueError(f"repeat_last_n = {params.repeat_last_n} exceeds the ring capacity "
                         f"{ws.ring_capacity} (make the workspace with a larger ring_capacity)")
    if len(params.logit_bias) > ws.max_bias:
        raise ValueError(f"{len(params.logit_bias)} logit_bias entries; this workspace holds "
                         f"at most {ws.max_bias}")
    hist = np.asarray(list(history), np.int64)
    if hist.size and (hist.min() < 0 or hist.max() >= ws.vocab):
        raise ValueError(f"history holds token ids outside 0..{ws.vocab - 1}")
    if params.seed is not None and params.seed >= 0:
        seed = int(params.seed) & ((1 << 64) - 1)
    else:
        seed = int.from_bytes(os.urandom(8), "little")
    pf = np.zeros(8, np.float32)
    pf[[P_TEMP, P_TOPP, P_MINP, P_REPEAT, P_PRESENCE, P_FREQUENCY]] = [
        params.temperature, params.top_p, params.min_p, params.repeat_penalty,
        params.presence_penalty, params.frequency_penalty]
    pi = np.zeros(8, np.int64)
    pi[[P_TOPK, P_LASTN, P_NBIAS]] = [params.top_k, params.repeat_last_n, len(params.logit_bias)]
    pi[P_SEED_LO], pi[P_SEED_HI] = seed & 0xFFFFFFFF, seed >> 32
    pi = (pi & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    ids = np.zeros(ws.max_bias, np.int32)
    vals = np.zeros(ws.max_bias, np.float32)
    for j, (tok, bias) in enumerate(sorted(params.logit_bias.items())):
        ids[j], vals[j] = tok, bias           # -inf stays -inf: adding it bans the token
    ring = np.zeros(ws.ring_capacity, np.int32)
    keep = hist[max(0, hist.size - ws.ring_capacity):]
    ring[np.arange(hist.size - keep.size, hist.size) % ws.ring_capacity] = keep
    # pinned mirrors (made at load) and raw async copies: no driver synchronisation per
    # copy (engine/h2d.py). A copy of the previous request may still be pending on the
    # stream: wait for it before the mirrors are rewritten (free when the stream is idle).
    if stream:
        stream.synchronize()
    if ws.host is None:                      # a workspace not made by workspace_from_arena
        ws.host = _host_mirrors(ws)
    h = ws.host
    if h.get("state") is not state:          # the state slots' view, made once per state array
        h["state"], h["state_view"] = state, state[S_COUNTER:S_HIST + 1]
    h["params_f"][:] = pf
    h["params_i"][:] = pi
    h["bias_ids"][:] = ids
    h["bias_vals"][:] = vals
    h["ring"][:] = ring
    h["counters"][:] = (0, hist.size)
    for name in ("params_f", "params_i", "bias_ids", "bias_vals", "ring"):
        upload(getattr(ws, name), h[name], stream)
    upload(h["state_view"], h["counters"], stream)
    return seed


def _host_mirrors(ws: SamplerWorkspace) -> dict:
    """Pinned host mirrors of the buffers set_request uploads (allocated at load)."""
    m = {name: pinned_like(getattr(ws, name)) for name in ("params_f", "params_i", "bias_ids",
                                                          "bias_vals", "ring")}
    m["counters"] = pinned_like(ws.params_i[:2])
    if ws.mask is not None:
        m["mask"] = pinned_like(ws.mask)
    return m


def sample(ws: SamplerWorkspace, logits, state, out, stream=0) -> None:
    """The full chain on logits float32[V] (modified in place): writes the token to
    state[1] and out[state[2] % len(out)], pushes it into the ring, state[2] += 1,
    state[3] += 1. Four launches; no allocation, no synchronisation (graph-capturable)."""
    _check_step(ws, logits, state, out)
    nb, bs = ws.n_blocks, ws.block
    _penalties_kernel[1, bs, stream](logits, ws.params_f, ws.params_i, ws.bias_ids, ws.bias_vals,
                                     ws.ring, state, ws.pen_cnt, ws.ws_i)
    _argmax_kernel[nb, bs, stream](logits, ws.params_f, state, ws.ring, out, ws.ws_i, ws.ws_f,
                                   ws.part, np.int32(0))
    _hist_kernel[nb, bs, stream](logits, ws.params_f, ws.params_i, ws.ws_i, ws.ws_f, ws.ws_l,
                                 ws.hist_c, ws.hist_m)
    _select_kernel[nb, bs, stream](logits, ws.params_f, ws.params_i, state, ws.ring, out, ws.ws_i,
                                   ws.ws_f, ws.ws_l, ws.blk_cnt, ws.reg_k, ws.reg_v, ws.reg_i,
                                   ws.den_k, ws.den_v, ws.den_i, ws.den_w, ws.kept)


def sample_greedy(ws: SamplerWorkspace, logits, state, out, stream=0) -> None:
    """Greedy only (whatever the temperature): bias, penalties, argmax; emits like
    `sample`. Two launches: capture it as its own graph for greedy requests."""
    _check_step(ws, logits, state, out)
    _penalties_kernel[1, ws.block, stream](logits, ws.params_f, ws.params_i, ws.bias_ids,
                                           ws.bias_vals, ws.ring, state, ws.pen_cnt, ws.ws_i)
    _argmax_kernel[ws.n_blocks, ws.block, stream](logits, ws.params_f, state, ws.ring, out,
                                                  ws.ws_i, ws.ws_f, ws.part, np.int32(1))


def mask_words(ws: SamplerWorkspace) -> np.ndarray:
    """The pinned host mirror of ws.mask: compute the next mask into it, then upload_mask.
    Rewrite it only after the previous upload finished (the caller syncs each step)."""
    return ws.host["mask"]


def upload_mask(ws: SamplerWorkspace, stream=0) -> None:
    """Copy mask_words(ws) to ws.mask, asynchronously on `stream`."""
    upload(ws.mask, ws.host["mask"], stream)


def apply_mask(ws: SamplerWorkspace, logits, stream=0) -> None:
    """logits[i] = -inf where ws.mask's bit i is clear (one launch; graph-capturable)."""
    _check("logits", logits, np.float32, length=ws.vocab)
    _check("mask", ws.mask, np.int32, length=(ws.vocab + 31) // 32)
    threads = 256
    _mask_kernel[-(-ws.vocab // threads), threads, stream](logits, ws.mask)


def advance_state(state, stream=0) -> None:
    """state[0] += 1 on the device (one tiny launch)."""
    _check("state", state, np.int32, min_len=4)
    _advance_state_kernel[1, 32, stream](state)


# =====================================================================================
# Benchmark: python -m genie_rt.engine.gpu_sampling
# =====================================================================================
def _bench_geometry(vocab):
    return {} if vocab >= 65536 else dict(block=32, chunk=128)     # small: simulator dry runs


def _validate(ws, state, out, rng, vocab):
    from .sampling import SamplingParams
    ws_dbg = make_workspace(vocab, debug_kept=True, **_bench_geometry(vocab))
    for it in range(6):
        z = (rng.standard_normal(vocab) * 3).astype(np.float32)
        if it % 2:
            z = np.round(z).astype(np.float32)              # ties everywhere
        set_request(ws_dbg, SamplingParams(temperature=0.0), [], state)
        sample(ws_dbg, cuda.to_device(z), state, out)
        tok = int(state.copy_to_host()[S_TOKEN])
        assert tok == int(np.argmax(z)), f"greedy: {tok} != argmax {int(np.argmax(z))}"
        for kw in (dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
                   dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
                   dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)):
            p = SamplingParams(seed=int(rng.integers(1 << 60)), **kw)
            seed = set_request(ws_dbg, p, [], state)
            ws_dbg.kept.copy_to_device(np.zeros(vocab, np.int8))
            sample(ws_dbg, cuda.to_device(z), state, out)
            kept = ws_dbg.kept.copy_to_host().astype(bool)
            ref = reference_kept(z, p.top_k, p.top_p, p.min_p)
            assert np.array_equal(kept, ref), f"{kw}: kept {kept.sum()} != reference {ref.sum()}"
            tok = int(state.copy_to_host()[S_TOKEN])
            assert ref[tok], f"{kw}: token {tok} outside the kept set"
            rt = reference_sample(z, p, 0, seed)
            if tok != rt:
                print(f"  note: draw {tok} != reference {rt} ({kw}); expf ulp at a CDF step?")


def _bench(vocab: int = 151936, reps: int = 15) -> list[tuple[str, float, int]]:
    from .cuda_graph import time_us as _time_us
    from .sampling import SamplingParams
    compile_kernels()
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    state = cuda.to_device(np.zeros(4, np.int32))
    out = cuda.to_device(np.zeros(1, np.int32))
    ws = make_workspace(vocab, **_bench_geometry(vocab))
    _validate(ws, state, out, rng, vocab)
    z = (rng.standard_normal(vocab) * 3).astype(np.float32)   # a plausible logit spread
    logits = cuda.to_device(z)
    rows = []
    configs = [
        ("greedy (sample_greedy)", dict(temperature=0.0), True),
        ("greedy (sample)", dict(temperature=0.0), False),
        ("default k40 p0.95 m0.05 T0.8", dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05), False),
        ("+ repeat penalty 1.1/64", dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                         repeat_penalty=1.1), False),
        ("top_p 0.9 only", dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0), False),
        ("min_p 0.05 only", dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05), False),
        ("temperature only (all kept)", dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), False),
    ]
    history = rng.integers(0, vocab, 64).tolist()
    for name, kw, greedy in configs:
        set_request(ws, SamplingParams(seed=1, **kw), history, state, stream)
        logits.copy_to_device(z, stream=stream)
        fn = (lambda: sample_greedy(ws, logits, state, out, stream)) if greedy else \
             (lambda: sample(ws, logits, state, out, stream))
        us = _time_us(fn, stream, reps=reps)
        stream.synchronize()
        rows.append((name, us, int(ws.ws_i.copy_to_host()[W_NCOMPACT])))
    # per-kernel split of the default chain
    set_request(ws, SamplingParams(seed=1, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
                history, state, stream)
    logits.copy_to_device(z, stream=stream)
    nb, bs = ws.n_blocks, ws.block
    parts = [
        ("  1 penalties (no-op)", lambda: _penalties_kernel[1, bs, stream](
            logits, ws.params_f, ws.params_i, ws.bias_ids, ws.bias_vals, ws.ring, state, ws.pen_cnt, ws.ws_i)),
        ("  2 argmax", lambda: _argmax_kernel[nb, bs, stream](
            logits, ws.params_f, state, ws.ring, out, ws.ws_i, ws.ws_f, ws.part, np.int32(0))),
        ("  3 hist", lambda: _hist_kernel[nb, bs, stream](
            logits, ws.params_f, ws.params_i, ws.ws_i, ws.ws_f, ws.ws_l, ws.hist_c, ws.hist_m)),
        ("  4 select", lambda: _select_kernel[nb, bs, stream](
            logits, ws.params_f, ws.params_i, state, ws.ring, out, ws.ws_i, ws.ws_f, ws.ws_l,
            ws.blk_cnt, ws.reg_k, ws.reg_v, ws.reg_i, ws.den_k, ws.den_v, ws.den_i, ws.den_w, ws.kept)),
    ]
    for name, fn in parts:
        rows.append((name, _time_us(fn, stream, reps=reps), -1))
    rows.append(("advance_state", _time_us(lambda: advance_state(state, stream), stream, reps=reps), -1))
    return rows


if __name__ == "__main__":
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"# engine/gpu_sampling.py, vocab 151936, on {name}: validated against the "
          f"numpy reference, then timed (CUDA graph of 20 samples, median of 15)")
    print(f"{'chain':<32} {'us/token':>9} {'compacted':>10}")
    for name, us, n in _bench():
        print(f"{name:<32} {us:>9.2f} {n if n >= 0 else '':>10}")
