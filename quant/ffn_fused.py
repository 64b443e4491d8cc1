"""The decode step's second half of a layer in one launch: a persistent kernel with grid barriers.

What one launch computes, for one token (x the residual stream, a the attention output as q8):

    1. x += Wo a                                   (the output projection, residual)
    2. h = rmsnorm(x) * ffn_norm  -> q8            (every block computes the sum of squares,
                                                   each warp quantizes its 32-value blocks)
    3. f = act(Wg h) * (Wu h)                      (SwiGLU / GeGLU)
    4. f -> q8
    5. x += Wd f                                   (the down projection, residual)
    6. (next) h = rmsnorm(x) * next_norm -> q8     (the next layer's attention norm)

Today's decode step runs these as six to seven launches (gemv, rmsnorm_q8, gemv_swiglu,
quantize_q8, gemv, rmsnorm_q8); here one grid of blocks that are all resident at once runs
them in order, with a grid barrier between phases instead of a kernel boundary: no launch,
no ramp of a new grid, no tail of a finished one (docs/decode-journal.md, section 7). Every
phase is today's arithmetic in today's order - the same row loop and warp reduction as
gemv_kernels.py (one warp a row, LPR 32, no k-split: what the launchers choose for the
layers' GEMVs), rmsnorm_q8's order of additions (norm_q8_device.make_norm_scale) and the
q8 store of quantize_q8_kernel - so the launch gives the separate kernels' bits exactly,
which is what the tests check.

Grid barrier (`_barrier`): every thread fences its stores (threadfence), the block syncs,
thread 0 counts the block with an atomic add on ctr[k] and spins with ld.relaxed.gpu until
all gridDim blocks have arrived, fences again (acquire), and the block syncs. Data written
by other blocks before a barrier is read after it either with ld.relaxed.gpu (x, f: their
lines may sit in this SM's L1 from before) or through loads that never touched those
addresses earlier in the launch (the q8 buffers). The last block to leave resets the
counters to 0 for the next launch (graph replays included).

The one rule a persistent kernel adds: every block of the grid must be resident at once,
or the resident ones spin forever waiting for the others. `grid_blocks` asks the driver
how many blocks of this kernel fit on the device at once (occupancy) and launches that
many or fewer; the spin gives up after SPIN_LIMIT polls and sets ctr[ERROR] (the host
checks it: `failed`), so a device that runs fewer blocks than the occupancy says (MPS
partitions) gets an error, not a hang.

Weights: the dp4a formats of gemv_kernels.py (Q4_K, Q6_K, Q8_0, Q5_0, ...), specialized per
launch at compile time (a Q4_K_M file has two or three combinations). Lab: used by the
engine when EngineConfig.decode_fused_ffn is on (engine/cuda_ops.py).
"""
from __future__ import annotations

import logging
import math

import numpy as np
from numba import cuda, float32

from genie_rt.engine import kernel_cache

from . import gemv_kernels as K
from . import ptx
from .gemv import _flat, _w_args
from .norm_q8_device import make_norm_scale, norm_block, norm_scale_values, q8_put

log = logging.getLogger("genie_rt.cuda")
BLOCK = K.BLOCK                 # 128 threads, 4 warps: the GEMVs' block
WARPS = K.WARPS
N_BARRIERS = 5                  # after 1, 2, 3, 4, 5 (the last only with the next norm)
EXIT = N_BARRIERS               # ctr[EXIT]: blocks that have left
ERROR = N_BARRIERS + 1          # ctr[ERROR]: 1 once a spin gave up (never reset by the kernel)
N_COUNTERS = 8                  # ctr[7] spare (engine/cuda_layout.py's ffn_counters)
SPIN_LIMIT = 1 << 23            # polls (~0.3 us each) before a barrier gives up: seconds
ACTS = K.ACTS

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


def _make_barrier(FENCE_ALL: bool):
    """barrier(ctr, k): grid barrier k (see the module docstring); the whole block calls.
    FENCE_ALL: every thread fences its own stores before the block syncs (as the fused
    GEMV + norm does); else thread 0 alone fences after the sync (cooperative groups'
    grid sync: bar.sync orders the block's stores before thread 0's cumulative fence).
    Measured (docs/kernels/ffn-fused.md): ~2 us a barrier at 528 blocks either way; polling a
    flag the last arrival raises, or sleeping between polls, did not change it (removed)."""
    @_dev
    def barrier(ctr, k):
        if FENCE_ALL:
            cuda.threadfence()              # this thread's stores, visible GPU-wide ...
        cuda.syncthreads()                  # ... for every thread, before the count
        if cuda.threadIdx.x == 0:
            if not FENCE_ALL:
                cuda.threadfence()
            nb = cuda.gridDim.x
            cuda.atomic.add(ctr, k, 1)
            n = 0
            while ptx.ld_relaxed_i32(ctr, k) < nb:
                n += 1
                if n >= SPIN_LIMIT:
                    ctr[ERROR] = 1          # not every block is resident: give up, say so
                    break
            cuda.threadfence()              # acquire: the others' stores before our loads
        cuda.syncthreads()
    return barrier


@_dev
def _leave(ctr):
    """The last block out resets the barrier counters (all others have passed every spin)."""
    if cuda.threadIdx.x == 0:
        done = cuda.atomic.add(ctr, EXIT, 1)
        if done == cuda.gridDim.x - 1:
            for k in range(EXIT + 1):
                ctr[k] = 0


ALL_PHASES = 0b111111


def ffn_kernel(o_q, g_q, u_q, d_q, D: int, VB: int, ACT: str = "silu", NEXT: bool = True,
               PHASES: int = ALL_PHASES, FENCE_ALL: bool = True, PAIR: bool = True,
               ROWS2: bool = True):
    """The kernel for weights of formats o_q (Wo), g_q, u_q (Wg, Wu), d_q (Wd), all dp4a;
    D = n_embd (the norms' width), VB the norms' block (rmsnorm_q8's bits at that block);
    NEXT: also phase 6. Arguments (flat, C-contiguous):
      Wo, Wg, Wu, Wd   (wa, wb, wc, wd, nu) each          gemv.GemvWeight's slots
      acols            columns of Wo (n_head * head_dim)
      aq, as_          uint32 [acols / 4], float32 [acols / 8]: q8 of the attention output
      x                float32 [D], read and written (the residual stream)
      fw, eps          float32 [D] ffn_norm, float32
      hq8, hq, hs      int8 [D] and its uint32 view, float32 [D / 8]: q8 of h (written by 2
                       and 6, read by 3)
      nff              rows of Wg / Wu, columns of Wd
      f                float32 [nff] scratch (the activation's output)
      fq8, fq, fs      int8 [nff] and its uint32 view, float32 [nff / 8]: q8 of f
      nw               float32 [D] the next layer's attn_norm (any float32 [D] if not NEXT)
      ctr              int32 [N_COUNTERS], 0 but ctr[ERROR] before the launch; left so
    PHASES (bit p-1: phase p runs; the barriers always do), FENCE_ALL (_make_barrier), ROWS2
    (a warp's two rows of Wo / Wd by gemv_kernels.make_pair_dot) and PAIR (gate and up by make_pair_dot,
    else one after the other as gemv_swiglu does) are for tools/bench_ffn_fused.py, which
    times the parts; the engine runs every phase."""
    assert ACT in ACTS and D % 32 == 0 and VB % 32 == 0
    GELU = ACT == "gelu"
    _barrier = _make_barrier(FENCE_ALL)
    P1, P2, P3, P4, P5, P6 = (bool(PHASES >> i & 1) for i in range(6))
    PAIR = PAIR and K.UNIT_WEIGHTS[g_q] == K.UNIT_WEIGHTS[u_q]       # one unit count for both
    pair = K.make_pair_dot(g_q, u_q)
    dot_o = K._make_row_dot(o_q, "dp4a", 1)
    dot_g = K._make_row_dot(g_q, "dp4a", 1)
    dot_u = K._make_row_dot(u_q, "dp4a", 1)
    dot_d = K._make_row_dot(d_q, "dp4a", 1)
    reduce1 = K._make_reduce(1, 1, 32)
    reduce2 = K._make_reduce(2, 1, 32)
    NV = norm_scale_values(BLOCK, D, VB)
    NQ = D // 32                                  # q8 blocks of h

    def make_residual(dot, q):
        pair_rows = K.make_pair_dot(q, q)

        @_dev
        def residual(wa, wb, wc, wd, nu, xq, xs, cols, x, gw, nwarps, lane, warp, acc):
            row = gw                              # x[row] += W[row] . a, one warp a row
            while row < D:                        # (warp-uniform: no barrier inside)
                acc[0] = float32(0)
                acc[1] = float32(0)
                r2 = row + nwarps
                if ROWS2 and r2 < D:              # this warp's next row too, loads together
                    pair_rows(wa, wb, wc, wd, wa, wb, wc, wd, nu, row, r2, lane, 32, xs, xq, xs, cols, acc)
                    reduce2(acc, warp, lane, 0)
                    if lane == 0:
                        x[row] = acc[0] + x[row]
                        x[r2] = acc[1] + x[r2]
                    row = r2 + nwarps
                else:
                    dot(wa, wb, wc, wd, nu, row, lane, 32, xs, xq, xs, cols, acc, 0)
                    reduce1(acc, warp, lane, 0)
                    if lane == 0:
                        x[row] = acc[0] + x[row]
                    row += nwarps
        return residual

    def make_norm_q8(scale):
        @_dev
        def norm_q8(x, w, eps, hq8, hs, vals, gw, nwarps, lane):
            s = scale(x, eps, vals)               # every block: rmsnorm_q8's sum, its bits
            j = gw
            while j < NQ:                         # warp j: values 32 j .. 32 j + 31
                i = j * 32 + lane
                q8_put(float32(ptx.ld_relaxed_f32(x, i) / s * w[i]), i, hq8, hs)
                j += nwarps
        return norm_q8

    residual_o, residual_d = make_residual(dot_o, o_q), make_residual(dot_d, d_q)
    norm_a = make_norm_q8(make_norm_scale(BLOCK, D, VB))   # two call sites: two sets of shared
    norm_b = make_norm_q8(make_norm_scale(BLOCK, D, VB))   # arrays, no barrier between uses

    @cuda.jit
    def ffn(oa, ob, oc, od, onu, ga, gb, gc, gd, gnu, ua, ub, uc, ud, unu, da, db, dc, dd, dnu,
            acols, aq, as_, x, fw, eps, hq8, hq, hs, nff, f, fq8, fq, fs, nw, ctr):
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        gw = cuda.blockIdx.x * WARPS + warp
        nwarps = cuda.gridDim.x * WARPS
        acc = cuda.local.array(2, float32)
        vals = cuda.local.array(NV, float32)
        # 1. x += Wo a
        if P1:
            residual_o(oa, ob, oc, od, onu, aq, as_, acols, x, gw, nwarps, lane, warp, acc)
        _barrier(ctr, 0)
        # 2. h = rmsnorm(x) * fw -> q8
        if P2:
            norm_a(x, fw, eps, hq8, hs, vals, gw, nwarps, lane)
        _barrier(ctr, 1)
        # 3. f = act(Wg h) * (Wu h)
        row = gw if P3 else nff
        while row < nff:
            acc[0] = float32(0)
            acc[1] = float32(0)
            if PAIR:
                pair(ga, gb, gc, gd, ua, ub, uc, ud, gnu, row, row, lane, 32, hs, hq, hs, D, acc)
            else:
                dot_g(ga, gb, gc, gd, gnu, row, lane, 32, hs, hq, hs, D, acc, 0)
                dot_u(ua, ub, uc, ud, unu, row, lane, 32, hs, hq, hs, D, acc, 1)
            reduce2(acc, warp, lane, 0)
            if lane == 0:
                g = acc[0]
                if GELU:
                    th = math.tanh(K._GELU_S * g * (float32(1) + K._GELU_A * g * g))
                    f[row] = float32(0.5) * g * (float32(1) + th) * acc[1]
                else:
                    f[row] = g / (float32(1) + math.exp(-g)) * acc[1]
            row += nwarps
        _barrier(ctr, 2)
        # 4. f -> q8 (quantize_q8_kernel's bits)
        j = gw if P4 else nff
        while j < nff // 32:
            i = j * 32 + lane
            q8_put(ptx.ld_relaxed_f32(f, i), i, fq8, fs)
            j += nwarps
        _barrier(ctr, 3)
        # 5. x += Wd f
        if P5:
            residual_d(da, db, dc, dd, dnu, fq, fs, nff, x, gw, nwarps, lane, warp, acc)
        if NEXT:
            _barrier(ctr, 4)
            # 6. the next layer's h = rmsnorm(x) * nw -> q8
            if P6:
                norm_b(x, nw, eps, hq8, hs, vals, gw, nwarps, lane)
        _leave(ctr)
    return kernel_cache.attach(ffn)


# =====================================================================================
# Launcher
# =====================================================================================
_kernels: dict = {}
_grids: dict = {}
MAX_BLOCKS_PER_SM = 4           # resident blocks asked for per SM (fewer if they do not fit)


def _kernel(specs, D, VB, act, nxt, variant=()):
    key = (specs, D, VB, act, nxt, variant)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = ffn_kernel(*specs, D, VB, act, nxt, **dict(variant))
    return k


_W = "uint32[::1], uint32[::1], uint32[::1], uint16[::1], int64"
SIG = (f"void({_W}, {_W}, {_W}, {_W}, int64, uint32[::1], float32[::1], float32[::1], "
       "float32[::1], float32, int8[::1], uint32[::1], float32[::1], int64, float32[::1], "
       "int8[::1], uint32[::1], float32[::1], float32[::1], int32[::1])")


def grid_blocks(kern, max_per_sm: int = MAX_BLOCKS_PER_SM) -> int:
    """Blocks of `kern` that are resident together on the current device: SMs x
    min(max_per_sm, what the occupancy calculator allows). 1 under the simulator (which
    runs blocks one after another: a barrier with two would never open)."""
    if ptx.SIMULATOR:
        return 1
    key = id(kern)
    if key not in _grids:
        kern.compile(SIG)
        sms = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
        try:
            k = next(iter(kern.overloads.values()))
            fit = int(k.max_cooperative_grid_blocks(BLOCK))   # SMs x resident blocks per SM
        except Exception as exc:                              # noqa: BLE001 - one block an SM fits
            log.warning("ffn_fused: occupancy query failed (%s); one block per SM", exc)
            fit = sms
        _grids[key] = max(1, min(fit, sms * max_per_sm))
    return _grids[key]


def _check(name, a, dtype, n):
    if not ptx.is_device_array(a):
        raise TypeError(f"ffn_fused: {name} must be a device array, got {type(a).__name__}")
    if a.dtype != dtype or a.size != n or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"ffn_fused: {name} must be C-contiguous {np.dtype(dtype).name} with {n} "
                         f"values, got {a.dtype} {list(a.shape)}")


def supported(wo, wg, wu, wd) -> str | None:
    """None if one launch can run this layer's FFN half, else why not (a sentence)."""
    for name, w in (("attn_output", wo), ("ffn_gate", wg), ("ffn_up", wu), ("ffn_down", wd)):
        if w.mode != "dp4a":
            return f"{name} is {w.qtype.name} in {w.mode} mode (the fused FFN reads q8 activations only)"
    D = wo.rows
    if wd.rows != D or wg.cols != D or wu.cols != D or wg.rows != wu.rows or wd.cols != wg.rows:
        return "the FFN weights' shapes do not chain"
    if D % 32 or wg.rows % 32 or wo.cols % 32:
        return "a width is not a multiple of 32"
    return None


def ffn_fused(wo, wg, wu, wd, aq, as_, x, ffn_norm, eps: float, hq, hs, f, fq, fs, ctr,
              next_norm=None, act: str = "silu", norm_blk: int | None = None, grid: int | None = None,
              stream=0, **variant) -> None:
    """One launch of ffn_kernel (phases 1-5, and 6 when next_norm is given), in place on x.
    wo, wg, wu, wd: gemv.GemvWeight (dp4a); aq int8 [1, q_dim], as_ float32 [1, q_dim / 8]
    (the attention output's q8); x float32 [1, D]; ffn_norm / next_norm float32 [D];
    hq int8 [1, D], hs float32 [1, D / 8] (the q8 of h: the next layer's qkv GEMV reads it);
    f float32 [1, n_ff] scratch; fq int8 [1, n_ff], fs float32 [1, n_ff / 8]; ctr int32
    [N_COUNTERS] zeros (the launch leaves them zero). norm_blk: the block of the rmsnorm_q8
    to reproduce (default engine/norm.py's). grid: blocks (default grid_blocks: all resident).
    variant: ffn_kernel's PHASES / FENCE_ALL / PAIR / ROWS2 (tools/bench_ffn_fused.py).
    Nothing is allocated: graph-capturable once compiled."""
    why = supported(wo, wg, wu, wd)
    if why:
        raise ValueError(f"ffn_fused: {why}")
    D, nff, acols = wo.rows, wg.rows, wo.cols
    if act not in ACTS:
        raise ValueError(f"ffn_fused: act must be one of {ACTS}, got {act!r}")
    for name, a, dt, n in (("aq", aq, np.int8, acols), ("as_", as_, np.float32, acols // 8),
                           ("x", x, np.float32, D), ("ffn_norm", ffn_norm, np.float32, D),
                           ("hq", hq, np.int8, D), ("hs", hs, np.float32, D // 8),
                           ("f", f, np.float32, nff), ("fq", fq, np.int8, nff),
                           ("fs", fs, np.float32, nff // 8), ("ctr", ctr, np.int32, N_COUNTERS)):
        _check(name, a, dt, n)
    if next_norm is not None:
        _check("next_norm", next_norm, np.float32, D)
    vb = norm_blk or norm_block(D)
    kern = _kernel((wo.qtype, wg.qtype, wu.qtype, wd.qtype), D, vb, act, next_norm is not None,
                   tuple(sorted(variant.items())))
    nb = grid_blocks(kern) if grid is None else int(grid)
    if ptx.SIMULATOR and nb != 1:
        raise ValueError("ffn_fused: the simulator runs blocks one after another; a grid barrier "
                         "needs them all at once: grid must be 1 there")
    hq8, fq8 = _flat(hq), _flat(fq)
    kern[nb, BLOCK, stream](*_w_args(wo), *_w_args(wg), *_w_args(wu), *_w_args(wd), acols,
                            _flat(aq, np.uint32), _flat(as_), _flat(x), ffn_norm, np.float32(eps), hq8, hq8.view(np.uint32), _flat(hs),
                            nff, _flat(f), fq8, fq8.view(np.uint32), _flat(fs),
                            ffn_norm if next_norm is None else next_norm, ctr)


def failed(ctr) -> bool:
    """True if a launch's barrier gave up waiting (not every block was resident)."""
    return bool(ctr.copy_to_host()[ERROR])


__all__ = ["ffn_fused", "ffn_kernel", "supported", "grid_blocks", "failed", "N_COUNTERS"]
