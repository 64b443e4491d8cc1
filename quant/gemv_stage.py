"""The residual decode GEMV with its rows staged in shared memory by cp.async (lab knob).

Why: a PDL build of the plain GEMV (gemv_kernels.gemv_kernel) can only hold in registers the
loads it issues before `griddepcontrol.wait` - two trips of three 16-byte units a lane
(`PDL_EARLY_TRIPS`); ffn_down's rows of 9,728 columns are 304 units, 3.2 trips of a warp, so a
third of the row is still fetched after the wait, one dependent DRAM round trip a trip. Here
each warp first copies its whole row's weight planes into shared memory with `cp.async.cg`
(16 bytes a copy, sm_80+, no registers held), then waits for the kernel before, then for its
copies, and multiplies from shared memory. Every byte of a block's rows is in flight before
the wait (docs/decode-step.md 7).

Same bits: the units are decoded by the same multipliers (gemv_formats.MULTIPLIERS) in the
same order as gemv_kernels._make_row_dot (lane l: units l, l + 32, ...), only read from shared
memory (`ptx.lds_v4`) instead of global. tests/test_gemv_stage.py checks it in the simulator.

Layout of one row in shared memory (32-bit words; nb = nu / 8 blocks of 256 weights):

    Q4_K   [0, 4 nu)  qs units        [4 nu, 4 nu + 4 nb)  headers (16 B a block)
    Q6_K   [0, 4 nu)  ql units        [4 nu, 4 nu + 16 nb) qh (64 B a block)
           [4 nu + 16 nb, 4 nu + 20 nb) scales (16 B a block); d (2 B a block) stays global

Block = 4 warps, warp w owns row 4 * blockIdx + w and words [w * W, (w + 1) * W) of the
dynamic shared array, W = stage_words(qtype, nu). x is read as in the plain kernel (NT tokens,
after the wait). What it does not do: k-splits, two rows a warp, the f32 mode, the fused norm
tail, rows over 48 KB a block (`stageable`; the plain kernel runs those).
"""
from __future__ import annotations

from numba import cuda, float32, uint32

from genie_rt.engine import kernel_cache

from . import pdl, ptx
from .formats import QType
from .gemv_formats import MULTIPLIERS, UNIT_SHIFT
from .gemv_kernels import WARPS, _make_reduce

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)

# 16-byte chunks of a row's staged planes per block of 256 weights (8 units), past the units
_EXTRA_CHUNKS = {QType.Q4_K: 1, QType.Q6_K: 5}
STAGE_FORMATS = tuple(_EXTRA_CHUNKS)
MAX_STAGE_BYTES = 48 * 1024         # dynamic shared memory without the opt-in attribute


def stage_words(qtype, nu: int) -> int:
    """32-bit words of shared memory one row of `nu` units takes."""
    return 4 * (nu + _EXTRA_CHUNKS[qtype] * (nu >> 3))


def stage_bytes(qtype, nu: int) -> int:
    """Dynamic shared memory of one block (WARPS rows)."""
    return 4 * WARPS * stage_words(qtype, nu)


def stageable(qtype, mode: str, n_tok: int, ks: int, lpr: int, nu: int) -> bool:
    """Whether gemv_stage_kernel runs this GEMV: Q4_K / Q6_K rows of whole 256-weight blocks,
    one warp a row (no k-split, 32 lanes), a block's rows within 48 KB."""
    return (qtype in _EXTRA_CHUNKS and mode == "dp4a" and 1 <= n_tok <= 8 and ks == 1 and lpr == 32
            and nu % 8 == 0 and stage_bytes(qtype, nu) <= MAX_STAGE_BYTES)


def _make_copy_row(qtype):
    """copy_row(sm, so, wa, wb, wc, row, nu, lane): cp.async of row `row`'s planes into
    sm[so:so + stage_words], the 32 lanes taking every 32nd chunk."""
    if qtype == QType.Q4_K:
        @_dev
        def copy_row(sm, so, wa, wb, wc, row, nu, lane):
            nb = nu >> 3
            c = lane
            while c < nu:
                ptx.cp_async16(sm, so + 4 * c, wa, (row * nu + c) * 4)
                c += 32
            c = lane
            while c < nb:
                ptx.cp_async16(sm, so + 4 * (nu + c), wb, (row * nb + c) * 4)
                c += 32
        return copy_row

    @_dev
    def copy_row_q6k(sm, so, wa, wb, wc, row, nu, lane):
        nb = nu >> 3
        c = lane
        while c < nu:
            ptx.cp_async16(sm, so + 4 * c, wa, (row * nu + c) * 4)
            c += 32
        c = lane
        while c < 4 * nb:
            ptx.cp_async16(sm, so + 4 * (nu + c), wb, (row * 4 * nb + c) * 4)
            c += 32
        c = lane
        while c < nb:
            ptx.cp_async16(sm, so + 4 * (nu + 4 * nb + c), wc, (row * nb + c) * 4)
            c += 32
    return copy_row_q6k


def _make_load(qtype):
    """load(sm, so, wd, row, nu, u): unit u of the staged row, as gemv_formats' global loader
    of unit row * nu + u returns it."""
    if qtype == QType.Q4_K:
        @_dev
        def load_q4k(sm, so, wd, row, nu, u):
            return ptx.lds_v4(sm, so + 4 * u), ptx.lds_v4(sm, so + 4 * (nu + (u >> 3)))
        return load_q4k

    @_dev
    def load_q6k(sm, so, wd, row, nu, u):
        p = u & 7
        b = u >> 3
        nb = nu >> 3
        return (ptx.lds_v4(sm, so + 4 * u), ptx.lds_v4(sm, so + 4 * (nu + b * 4 + (p >> 2) * 2 + (p & 1))),
                ptx.lds_v4(sm, so + 4 * (nu + 4 * nb + b)), wd[uint32(row * nb + b)])
    return load_q6k


_kernels = {}


def gemv_stage_kernel(qtype, NT, RESID, PDL=False):
    """gemv_kernels.gemv_kernel(qtype, "dp4a", NT, 1, RESID, 32, PDL) with each warp's row staged
    in shared memory first: the same arguments, grid (ceil(rows / 4)) and bits; launched with
    stage_bytes(qtype, nu) bytes of dynamic shared memory."""
    key = (qtype, NT, RESID, PDL)
    if key in _kernels:
        return _kernels[key]
    wait, launch_dependents, xl = pdl.hooks(PDL)
    copy_row = _make_copy_row(qtype)
    load = _make_load(qtype)
    mul = MULTIPLIERS[(qtype, "dp4a")](NT, xl)
    SH = UNIT_SHIFT[qtype]
    PM = (1 << SH) - 1
    BSTEP = 32 >> SH
    EXTRA = _EXTRA_CHUNKS[qtype]
    reduce = _make_reduce(NT, 1, 32)

    @cuda.jit
    def gemv_stage(wa, wb, wc, wd, nu, rows, xf, xq, xs, cols, y, res):
        launch_dependents()
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        row = cuda.blockIdx.x * WARPS + warp
        sm = cuda.shared.array(0, uint32)
        so = warp * 4 * (nu + EXTRA * (nu >> 3))
        if row < rows:
            copy_row(sm, so, wa, wb, wc, row, nu, lane)   # weights only: before the wait
        wait()                      # x (and res) are the kernel before's output (PDL builds)
        ptx.cp_async_wait_all()     # this lane's copies have landed ...
        cuda.syncthreads()          # ... and every lane's (a warp reads only its own row, but the
        #                             simulator has no syncwarp; the block's copies are all out)
        acc = cuda.local.array(NT, float32)
        for t in range(NT):
            acc[t] = float32(0)
        if row < rows:
            u = lane
            p = u & PM
            blk = u >> SH
            while u + 32 < nu:      # gemv_kernels' order: units lane, lane + 32, ...; two
                v0 = load(sm, so, wd, row, nu, u)         # units' shared loads before the first
                v1 = load(sm, so, wd, row, nu, u + 32)    # multiply
                mul(v0, blk, p, xf, xq, xs, cols, acc, 0)
                mul(v1, blk + BSTEP, p, xf, xq, xs, cols, acc, 0)
                u += 64
                blk += 2 * BSTEP
            if u < nu:
                mul(load(sm, so, wd, row, nu, u), blk, p, xf, xq, xs, cols, acc, 0)
        reduce(acc, warp, lane, 0)
        if lane == 0 and row < rows:
            for t in range(NT):
                i = t * rows + row
                if RESID:
                    y[i] = acc[t] + res[i]      # same thread reads then writes: y may be res
                else:
                    y[i] = acc[t]
    _kernels[key] = k = kernel_cache.attach(gemv_stage)
    return k
