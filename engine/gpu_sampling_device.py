"""What the GPU sampler's kernels share: the slots of its device buffers, its constants,
and the device functions every kernel calls, each primitive beside its numpy reference.

Part of the GPU sampler: engine/gpu_sampling.py has the story, the buffer layout and
the launchers. Read this file in order:
1. slots and constants: where the request's parameters sit in params_f / params_i (the
   launchers write them, the kernels read them), the ws_i / ws_l workspace slots, the
   histogram geometry and the 32.32 fixed point of the softmax mass;
2. numpy references of the primitives: the counter-based RNG (splitmix64 of seed +
   step), the monotone float key, the fixed-point mass, the top_p target;
3. their device versions and the block-wide building blocks the kernels are made of:
   `_key`, `_mass`, `_topp_target`, `_argmax_code`; block max, exclusive scan, ballot
   count; `_last_block` (the "last block to finish" ticket that replaces a grid-wide
   barrier); `_emit` (publish the sampled token). Under the simulator `_f32_bits`,
   `_fma32` and `_splitmix_u32` are numpy functions with the device versions' results.

Deliberately not here: kernels (gpu_sampling_greedy.py, gpu_sampling_select.py) and
launchers (gpu_sampling.py). The chain's reference (which tokens are kept, the draw) is
beside the kernels that implement it, in gpu_sampling_select.py.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from genie_rt.quant import ptx   # simulator: installs warp shuffles on the fake cuda module

from .device_state import S_DRAWS as S_COUNTER
from .device_state import S_HIST, S_TOKEN

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
# numpy reference of the primitives (the exact semantics of the device helpers)
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

