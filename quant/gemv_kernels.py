"""Device code of the decode GEMV: the row loop, the reduction and the kernel factories.

The story and the public launchers are in `gemv.py`, the numpy reference in
`gemv_reference.py`; this file is the part that runs on the GPU. Read it in this order:

1. the *unit* (its decoders are in `gemv_formats.py` and `gemv_units.py`): every format
   is streamed in units of 16 bytes of its bulk quants plane (one `ld.global.nc.v4`),
   which hold 32 weights for Q4_K / Q6_K / Q5_0, 16 for Q8_0 and 8 for F16. `load_*`
   reads one unit (plus the block header it needs), `*_dp4a` / `*_f32` turns it into
   `acc[t] += sum_i w_i * x[t, i]` for the NT tokens; `LOADERS` / `MULTIPLIERS` /
   `UNIT_SHIFT` look them up by format (`MODES`, `UNIT_WEIGHTS` re-exported from there).
2. `_make_row_dot`: a lane walks the units of one row with stride 32 * KSPLIT, three
   units per trip so that three 16-byte loads are in flight before the first is used.
3. `_make_reduce`: warp-shuffle sum, then (KSPLIT > 1) the warps that share a row add
   their partial sums through shared memory.
4. the three kernel factories: `gemv_kernel` (y = W x (+ r)), `qkv_kernel` (three
   weights, rows partitioned between blocks, one concatenated output) and
   `swiglu_kernel` (h = silu(Wg x) * (Wu x)), plus `quantize_q8_kernel`.

Who owns what (block = 4 warps = 128 threads):
    warp   -> one (row, k-part): row = global_warp // KSPLIT, k-part = global_warp % KSPLIT
    lane l -> units l + 32 * k-part, then + 32 * KSPLIT, ... of that row
    lane 0 of the k-part-0 warp -> writes y[t, row] for every token t
    (LPR = 16 lanes per row, KSPLIT = 1: a warp holds two rows, one per half-warp, and
    lanes 0 and 16 write; see _make_assign)

Two ways to multiply (the "mode" of a weight):
    dp4a: x was quantized to q8 (int8 per weight + one float scale per 32), see
          `quantize_q8_kernel`; each run of 16 weights becomes 4 `dp4a` on packed
          int8 quants, plus a few float ops per run. Q4_K: ~100 PTX instructions per
          32-weight unit at NT = 1, loads and address math included.
    f32:  weights are dequantized to float32 (nibbles/bytes become floats through the
          fp16 "1024 + q" bit trick, no int->float conversion unit) and dotted with the
          float32 x; exact up to fp32 rounding. Q4_K: ~290 PTX instructions per unit.
The kernels are specialized at compile time on the formats, the modes, NT (tokens,
1..8, accumulators live in registers) and KSPLIT (1, 2, 4); `gemv.py` keeps the cache.

What it deliberately does not do: choose grids, check arguments, allocate (gemv.py),
or use tensor cores (batches > 8 belong to the MMQ GEMM).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from genie_rt.engine import kernel_cache

from . import pdl, ptx
from .gemv_formats import LOADERS, MODES, MULTIPLIERS, UNIT_SHIFT, UNIT_WEIGHTS, loaders  # noqa: F401
from .norm_q8_device import q8_of_warp, q8_write   # quantize_q8_kernel's

WARPS = 4                 # warps per block
BLOCK = 32 * WARPS        # threads per block
FULL = 0xFFFFFFFF         # shuffle mask: the whole warp
_GELU_A = float32(0.044715)
_GELU_S = float32(0.79788456080286535587989211986876)

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


@_dev
def _warp_sum(v):
    for off in (16, 8, 4, 2, 1):
        v += cuda.shfl_xor_sync(FULL, v, off)
    return v


# =====================================================================================
# Row loop and reduction
# =====================================================================================
_row_dots = {}


def _make_row_dot(qtype, mode, NT, PDL=False, EARLY=1, PIN=True):
    """Device function row_dot(wa, wb, wc, wd, nu, row, u, step, xf, xq, xs, cols, acc, ao):
    acc[ao + t] += the lane's share (units u, u + step, ...) of row `row` times x[t].
    PDL: each trip's weight loads are issued before `griddepcontrol.wait` - on the first trip
    that overlaps them with the end of the kernel before (whose output x is), later trips
    pass the wait at once. EARLY (PDL builds, 1-3): the first EARLY trips' loads (3 units
    each) all go out before the wait - a long row (ffn_down's 304 units: 3.2 trips of 32
    lanes) then has more of itself in flight while the kernel before finishes. The units are
    multiplied in the same order either way: the same bits. PIN (PDL builds): the loads before
    the wait by ptx.ldw_v4, which the compilers leave there (False: the read-only ldg_v4, which
    ptxas sinks below the wait - the build of 2026-12-04 to 12-06, kept to time against)."""
    key = (qtype, mode, NT, PDL, EARLY, PIN)
    if key in _row_dots:
        return _row_dots[key]
    assert EARLY in (1, 2, 3) and (PDL or EARLY == 1), EARLY
    # a PDL build's activations are written by the kernel before while this one starts: read
    # them coherently (ld_v4), not by the non-coherent path the compiler may move above the wait
    wait, _, xl = pdl.hooks(PDL)
    # a PDL build's loads before its wait must stay there (ptx.ldw_v4: ptxas sinks the read-only
    # ldg_v4 below griddepcontrol.wait); the trips after the early ones may use the read-only path
    early_load = loaders(PDL and PIN)[qtype]
    mul = MULTIPLIERS[(qtype, mode)](NT, xl)
    SH = UNIT_SHIFT[qtype]
    PM = (1 << SH) - 1

    def make_load3(load):
        @_dev
        def load3(wa, wb, wc, wd, base, last, u, step):
            # 3 units' loads; past the end of the row a lane re-reads its last unit (harmless:
            # L1 or L2) instead of branching around a load
            return (load(wa, wb, wc, wd, base + min(u, last)), load(wa, wb, wc, wd, base + min(u + step, last)),
                    load(wa, wb, wc, wd, base + min(u + 2 * step, last)))
        return load3
    load3 = make_load3(early_load)
    late_load3 = load3 if EARLY == 1 else make_load3(LOADERS[qtype])   # EARLY 1: `rest` is the first trip

    @_dev
    def mul3(v, nu, u, step, blk, bstep, p, xf, xq, xs, cols, acc, ao):
        if u < nu:
            mul(v[0], blk, p, xf, xq, xs, cols, acc, ao)
        if u + step < nu:
            mul(v[1], blk + bstep, p, xf, xq, xs, cols, acc, ao)
        if u + 2 * step < nu:
            mul(v[2], blk + 2 * bstep, p, xf, xq, xs, cols, acc, ao)

    @_dev
    def rest(wa, wb, wc, wd, nu, base, last, u, step, blk, bstep, p, xf, xq, xs, cols, acc, ao):
        while u < nu:
            # 3 units' loads issued before the first multiply
            v = late_load3(wa, wb, wc, wd, base, last, u, step)
            wait()                  # x is the previous kernel's output (PDL builds only)
            mul3(v, nu, u, step, blk, bstep, p, xf, xq, xs, cols, acc, ao)
            u += 3 * step
            blk += 3 * bstep

    if EARLY == 1:
        @_dev
        def row_dot(wa, wb, wc, wd, nu, row, u, step, xf, xq, xs, cols, acc, ao):
            p = u & PM              # piece of the block: fixed per lane (step % 8 == 0)
            rest(wa, wb, wc, wd, nu, row * nu, nu - 1, u, step, u >> SH, step >> SH, p, xf, xq, xs,
                 cols, acc, ao)
    else:
        @_dev
        def row_dot(wa, wb, wc, wd, nu, row, u, step, xf, xq, xs, cols, acc, ao):
            base = row * nu
            last = nu - 1
            p = u & PM
            blk = u >> SH
            bstep = step >> SH
            if u < nu:              # lanes past the row's end take no part (and do not wait)
                v0 = load3(wa, wb, wc, wd, base, last, u, step)
                v1 = load3(wa, wb, wc, wd, base, last, u + 3 * step, step)
                if EARLY == 3:
                    v2 = load3(wa, wb, wc, wd, base, last, u + 6 * step, step)
                wait()
                mul3(v0, nu, u, step, blk, bstep, p, xf, xq, xs, cols, acc, ao)
                mul3(v1, nu, u + 3 * step, step, blk + 3 * bstep, bstep, p, xf, xq, xs, cols, acc, ao)
                if EARLY == 3:
                    mul3(v2, nu, u + 6 * step, step, blk + 6 * bstep, bstep, p, xf, xq, xs, cols, acc, ao)
                rest(wa, wb, wc, wd, nu, base, last, u + 3 * EARLY * step, step, blk + 3 * EARLY * bstep,
                     bstep, p, xf, xq, xs, cols, acc, ao)
    _row_dots[key] = row_dot
    return row_dot


_pair_dots = {}


def make_pair_dot(qa, qb, PDL=False, PIN=True):
    """pair_dot(Wa, Wb, nu, row, row_b, u, step, xf, xq, xs, cols, acc): row_dot of row `row`
    of Wa and row `row_b` of Wb (two weights of the same width, or one weight twice) at once,
    one token, dp4a - each trip issues both rows' three 16-byte loads before the first
    multiply, so a warp waits for memory once a trip, not twice (and a PDL build has both
    rows' first loads in flight before its wait). acc[0] gets Wa's units and acc[1] Wb's in
    row_dot's order: the same bits as two row_dot calls. Used by the SwiGLU GEMV (PAIR). PIN: as
    _make_row_dot's."""
    key = (qa, qb, PDL, PIN)
    if key in _pair_dots:
        return _pair_dots[key]
    wait, _, xl = pdl.hooks(PDL)
    load_a, load_b = loaders(PDL and PIN)[qa], loaders(PDL and PIN)[qb]
    mul_a, mul_b = MULTIPLIERS[(qa, "dp4a")](1, xl), MULTIPLIERS[(qb, "dp4a")](1, xl)
    SA, SB = UNIT_SHIFT[qa], UNIT_SHIFT[qb]
    MA, MB = (1 << SA) - 1, (1 << SB) - 1

    @_dev
    def pair_dot(aa, ab, ac, ad, ba, bb, bc, bd, nu, row, row_b, u, step, xf, xq, xs, cols, acc):
        base = row * nu
        off_b = (row_b - row) * nu                # Wb's row row_b (= row for gate / up)
        last = nu - 1
        pa, pb = u & MA, u & MB
        ka, kb = u >> SA, u >> SB
        sa, sb = step >> SA, step >> SB
        while u < nu:
            u1 = u + step
            u2 = u1 + step
            i1, i2 = base + min(u1, last), base + min(u2, last)
            a0 = load_a(aa, ab, ac, ad, base + u)
            a1 = load_a(aa, ab, ac, ad, i1)
            a2 = load_a(aa, ab, ac, ad, i2)
            b0 = load_b(ba, bb, bc, bd, base + u + off_b)
            b1 = load_b(ba, bb, bc, bd, i1 + off_b)
            b2 = load_b(ba, bb, bc, bd, i2 + off_b)
            wait()                  # x is the previous kernel's output (PDL builds only)
            mul_a(a0, ka, pa, xf, xq, xs, cols, acc, 0)
            if u1 < nu:
                mul_a(a1, ka + sa, pa, xf, xq, xs, cols, acc, 0)
            if u2 < nu:
                mul_a(a2, ka + 2 * sa, pa, xf, xq, xs, cols, acc, 0)
            mul_b(b0, kb, pb, xf, xq, xs, cols, acc, 1)
            if u1 < nu:
                mul_b(b1, kb + sb, pb, xf, xq, xs, cols, acc, 1)
            if u2 < nu:
                mul_b(b2, kb + 2 * sb, pb, xf, xq, xs, cols, acc, 1)
            u = u2 + step
            ka += 3 * sa
            kb += 3 * sb
    _pair_dots[key] = pair_dot
    return pair_dot


def pairable(gate, up, NT) -> bool:
    """Whether the SwiGLU GEMV can stream its gate and up rows together (make_pair_dot): one
    token, dp4a both, the same units per row."""
    return (NT == 1 and gate[1] == up[1] == "dp4a" and UNIT_SHIFT[gate[0]] == UNIT_SHIFT[up[0]]
            and UNIT_WEIGHTS[gate[0]] == UNIT_WEIGHTS[up[0]])


def _make_reduce(M, KSPLIT, LPR=32):
    """reduce(acc, warp, lane, ks): acc[0:M] of every lane -> the row total in the lanes of
    the k-part-0 warp (warp shuffles over the LPR lanes of a row, then shared memory
    across the KSPLIT warps). With LPR = 16 a warp holds two rows, one per half."""
    assert LPR == 32 or KSPLIT == 1, "two rows per warp only without a k-split"

    @_dev
    def reduce(acc, warp, lane, ks):
        for i in range(M):
            v = acc[i]
            if LPR == 32:
                v += cuda.shfl_xor_sync(FULL, v, 16)
            v += cuda.shfl_xor_sync(FULL, v, 8)      # offsets < 16 stay inside a half-warp
            v += cuda.shfl_xor_sync(FULL, v, 4)
            v += cuda.shfl_xor_sync(FULL, v, 2)
            v += cuda.shfl_xor_sync(FULL, v, 1)
            acc[i] = v
        if KSPLIT > 1:
            red = cuda.shared.array((WARPS, M), float32)
            if lane == 0:
                for i in range(M):
                    red[warp, i] = acc[i]
            cuda.syncthreads()          # every warp of the block reaches this, rows or not
            if ks == 0:
                for k in range(1, KSPLIT):
                    for i in range(M):
                        acc[i] += red[warp + k, i]
    return reduce


def _make_assign(KSPLIT, LPR):
    """assign(gw, lane) -> (row, k-part, first unit, unit step) of a lane of global warp gw:
    LPR = 32: one (row, k-part) per warp, lanes stride 32 * KSPLIT units;
    LPR = 16: two rows per warp (lanes 0-15 and 16-31), each lane strides 16 units. For
    rows of 80 units (2560 columns of Q4_K / Q6_K) that is 5 units per lane instead of
    2 or 3 (the warp's third trip half empty)."""
    LOG = _LOG2[KSPLIT]

    @_dev
    def assign(gw, lane):
        if LPR == 32:
            ks = gw & (KSPLIT - 1)
            return gw >> LOG, ks, lane + 32 * ks, 32 * KSPLIT
        return gw * 2 + (lane >> 4), 0, lane & 15, 16
    return assign


_LOG2 = {1: 0, 2: 1, 4: 2}


# =====================================================================================
# Kernels
# =====================================================================================
def gemv_kernel(qtype, mode, NT, KSPLIT, RESID, LPR=32, PDL=False, EARLY=1, PIN=True, MAXREG=None):
    """y[t, r] = sum_c W[r, c] x[t, c] (+ res[t, r]) for t < NT:
    grid = ceil(rows * KSPLIT / (4 * 32 / LPR)) blocks.

    Arguments (flat, C-contiguous):
      wa, wb, wc: uint32 planes, wd: uint16 plane   the weight (gemv.prepare_weight)
      nu:   units per row                           rows: rows of W
      xf:   float32 [NT * cols]                     xq: uint32 [NT * cols / 4] (int8 q8)
      xs:   float32 [NT * cols / 32] q8 scales      cols: columns of W
      y:    float32 [NT * rows] output              res: float32 [NT * rows] residual (may be y)
    PDL: built for programmatic dependent launch (sm_90+, quant/pdl.py): the next kernel may
    launch at once, and the weight loads start before this one waits for the one before
    (EARLY: the first 1-3 trips' loads of a row, _make_row_dot). MAXREG: ptxas's register cap
    (None: ptxas chooses; ignored by the simulator).

    (A build that also ran rmsnorm_q8 of the new y in the block that finished last was measured
    slower and removed: docs/decode-step.md 6.)
    """
    row_dot = _make_row_dot(qtype, mode, NT, PDL, EARLY, PIN)
    launch_dependents = pdl.hooks(PDL)[1]
    reduce = _make_reduce(NT, KSPLIT, LPR)
    assign = _make_assign(KSPLIT, LPR)
    SUB = LPR - 1

    @_dev
    def body(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res):
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        row, ks, u0, step = assign(cuda.blockIdx.x * WARPS + warp, lane)
        acc = cuda.local.array(NT, float32)
        for t in range(NT):
            acc[t] = float32(0)
        if row < rows:
            row_dot(wa, wb, wc, wd, nu, row, u0, step, xf, xq, xs, cols, acc, 0)
        reduce(acc, warp, lane, ks)
        if (lane & SUB) == 0 and ks == 0 and row < rows:       # (these lanes passed the wait)
            for t in range(NT):
                i = t * rows + row
                if RESID:
                    y[i] = acc[t] + res[i]      # same thread reads then writes: y may be res
                else:
                    y[i] = acc[t]

    jit = cuda.jit(max_registers=MAXREG) if MAXREG and not ptx.SIMULATOR else cuda.jit

    @jit
    def gemv(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res):
        launch_dependents()
        body(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res)
    return kernel_cache.attach(gemv)


def qkv_kernel(specs, NT, KSPLIT, LPR=32, PDL=False, PIN=True):
    """Three weights in one launch; segment s owns blocks [start_s, start_s+1) and writes
    y[t, off_s + r] with off = (0, rows0, rows0 + rows1), ldy = rows0 + rows1 + rows2.
    specs = ((qtype, mode),) * 3. Arguments: per weight (wa, wb, wc, wd, nu, rows), then
    blk1, blk2 (first block of segments 1 and 2), xf, xq, xs, cols, y [NT * ldy]."""
    dots = [_make_row_dot(q, m, NT, PDL, PIN=PIN) for q, m in specs]
    dot0, dot1, dot2 = dots
    launch_dependents = pdl.hooks(PDL)[1]
    reduce = _make_reduce(NT, KSPLIT, LPR)
    assign = _make_assign(KSPLIT, LPR)
    SUB = LPR - 1

    @cuda.jit
    def qkv(a0, b0, c0, d0, nu0, rows0, a1, b1, c1, d1, nu1, rows1, a2, b2, c2, d2, nu2, rows2,
            blk1, blk2, xf, xq, xs, cols, y):
        launch_dependents()
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        bid = cuda.blockIdx.x
        ldy = rows0 + rows1 + rows2
        acc = cuda.local.array(NT, float32)
        for t in range(NT):
            acc[t] = float32(0)
        if bid < blk1:                      # block-uniform branch: no divergence
            row, ks, u0, step = assign(bid * WARPS + warp, lane)
            nrows = rows0
            off = 0
            if row < nrows:
                dot0(a0, b0, c0, d0, nu0, row, u0, step, xf, xq, xs, cols, acc, 0)
        elif bid < blk2:
            row, ks, u0, step = assign((bid - blk1) * WARPS + warp, lane)
            nrows = rows1
            off = rows0
            if row < nrows:
                dot1(a1, b1, c1, d1, nu1, row, u0, step, xf, xq, xs, cols, acc, 0)
        else:
            row, ks, u0, step = assign((bid - blk2) * WARPS + warp, lane)
            nrows = rows2
            off = rows0 + rows1
            if row < nrows:
                dot2(a2, b2, c2, d2, nu2, row, u0, step, xf, xq, xs, cols, acc, 0)
        reduce(acc, warp, lane, ks)
        if (lane & SUB) == 0 and ks == 0 and row < nrows:
            for t in range(NT):
                y[t * ldy + off + row] = acc[t]
    return kernel_cache.attach(qkv)


GELU_A = np.float32(0.044715)                             # ggml's GELU_COEF_A
GELU_S = np.float32(0.79788456080286535587989211986876)   # ggml's SQRT_2_OVER_PI
ACTS = ("silu", "gelu")


def swiglu_kernel(gate, up, NT, KSPLIT, LPR=32, ACT="silu", PDL=False, PAIR=False, PIN=True):
    """h[t, r] = act(Wg x)[t, r] * (Wu x)[t, r]: each warp streams row r of both weights
    (gate then up; mixed formats just mean two different row loops). act = silu (SwiGLU:
    Qwen, Llama) or gelu, the tanh form (GeGLU: Gemma; engine/norm.py's gelu_reference).
    gate/up = (qtype, mode). Arguments: (wa, wb, wc, wd, nu) of Wg, then of Wu, rows,
    xf, xq, xs, cols, h [NT * rows]. PAIR (where `pairable`): both rows' loads of a trip
    issued together (make_pair_dot), the same bits."""
    assert ACT in ACTS, ACT
    assert not PAIR or pairable(gate, up, NT), (gate, up, NT)
    GELU = ACT == "gelu"
    dot_g = _make_row_dot(gate[0], gate[1], NT, PDL, PIN=PIN)
    dot_u = _make_row_dot(up[0], up[1], NT, PDL, PIN=PIN)
    pair = make_pair_dot(gate[0], up[0], PDL, PIN) if PAIR else dot_g
    launch_dependents = pdl.hooks(PDL)[1]
    NT2 = 2 * NT
    reduce = _make_reduce(NT2, KSPLIT, LPR)
    assign = _make_assign(KSPLIT, LPR)
    SUB = LPR - 1

    @cuda.jit
    def swiglu(ga, gb, gc, gd, gnu, ua, ub, uc, ud, unu, rows, xf, xq, xs, cols, h):
        launch_dependents()
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        row, ks, u0, step = assign(cuda.blockIdx.x * WARPS + warp, lane)
        acc = cuda.local.array(NT2, float32)        # [0, NT): gate, [NT, 2 NT): up
        for t in range(NT2):
            acc[t] = float32(0)
        if row < rows:
            if PAIR:
                pair(ga, gb, gc, gd, ua, ub, uc, ud, gnu, row, row, u0, step, xf, xq, xs, cols, acc)
            else:
                dot_g(ga, gb, gc, gd, gnu, row, u0, step, xf, xq, xs, cols, acc, 0)
                dot_u(ua, ub, uc, ud, unu, row, u0, step, xf, xq, xs, cols, acc, NT)
        reduce(acc, warp, lane, ks)
        if (lane & SUB) == 0 and ks == 0 and row < rows:
            for t in range(NT):
                g = acc[t]
                if GELU:
                    th = math.tanh(_GELU_S * g * (float32(1) + _GELU_A * g * g))
                    h[t * rows + row] = float32(0.5) * g * (float32(1) + th) * acc[NT + t]
                else:
                    h[t * rows + row] = g / (float32(1) + math.exp(-g)) * acc[NT + t]
    return kernel_cache.attach(swiglu)


def _make_quantize_q8(PDL):
    wait, launch_dependents, _ = pdl.hooks(PDL)

    @cuda.jit
    def quantize_q8_kernel(x, xq, xs, n):
        """x float32 [n] -> q8: per 32 values (one warp, one lane each) d = amax / 127 and
        q = rint(x / d) in -127..127 -> xq int8 [n]; xs float32 [n / 8] gets 4 floats per 32:
        (d, d * sum q[0:16], d * sum q[16:32], d * sum q[0:32]). n % 32 == 0.
        Grid: ceil(n / 128) blocks of 128 threads. PDL: the next kernel may launch at once
        (it waits for this one's output itself), and this one waits for the kernel before it
        (launched with programmatic serialization it may start before x is written)."""
        launch_dependents()
        wait()
        i = cuda.grid(1)
        v = float32(0)
        if i < n:
            v = x[i]
        q, d, s, s_hi = q8_of_warp(v)
        if i < n:
            q8_write(q, d, s, s_hi, i, xq, xs)
    return kernel_cache.attach(quantize_q8_kernel)   # compiled kernels persist on disk


quantize_q8_kernel = _make_quantize_q8(False)
quantize_q8_pdl_kernel = _make_quantize_q8(True)     # sm_90+ only (quant/pdl.py)
