"""q, k and v in one launch of the int8 tensor-core GEMV, Q4_K and Q6_K mixed (lab, 2026-12-05).

A Q4_K_M file keeps attn_q and attn_k in Q4_K and attn_v in Q6_K in about half the layers, so
one launch over the three matrices holds both builds: the grid is the three matrices' 16-row
tiles in a row, and a thread block takes the tile of its index - in q's tiles, then k's, then
v's - with that matrix's format's trips (gemv_mma_k.make_trips / gemv_mma_q6k.make_trips, the
same code as their own kernels: the same bits), and writes it into its matrix's columns of
[q | k | v] (`make_finish`'s ldy). The branch is the same for every thread of a block. One
launch instead of three takes two launch gaps, ramps and tails off the short prefill's layer
(engine/cuda_short_prefill.py); registers are the larger build's (sm_90 ptxas: see
tests/test_gemv_mma_qkv.py's slow test).

Status: checked in the simulator (the same bits as gemv_mma_k per matrix at its k-split) and in the
short prefill's GPU tests (H100, 2026-12-06: 12.4 us a layer for 8 tokens in its graph); its own
bench's bits check ran at mismatched k-splits that night (fixed since), so not yet timed alone.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from genie_rt.engine import kernel_cache

from . import ptx
from . import gemv_mma_q6k as Q6
from .formats import QType
from .gemv_mma import ROWS, _flat, make_finish
from .gemv_mma_k import _fits, make_trips, plan_ksplit, q8k_inputs
from .pdl import triggers as pdl_triggers

_W = "uint32[::1], uint32[::1], uint32[::1], uint16[::1], int64"
SIGNATURE = (f"void({_W}, {_W}, {_W}, int64, uint32[::1], float32[::1], int32[::1], int64, int64, int64, "
             "float32[::1])")
FORMATS = (QType.Q4_K, QType.Q6_K)


@functools.lru_cache(maxsize=None)
def mma_qkv_kernel(FMTS: tuple, KSPLIT: int = 4, PIPE: bool = True, PDL: int = 0, W16: bool = False,
                   W16Q6: bool = False):
    """The kernel for the formats FMTS (three "Q4_K" / "Q6_K"): grid = the three matrices' tiles,
    32 * KSPLIT threads. Arguments: for each matrix its GEMV planes wa, wb, wc, wd and rows; then
    nu (units a row, the same for all: one input), xq, xd, xb (q8_K), cols, n_tok (<= 8), ldy, y
    ([q | k | v] rows of ldy floats). PIPE: the Q4_K matrices' (a Q6_K one's trips are unpipelined,
    as gemv_mma_k.default_pipe). PDL: as gemv_mma_k's. W16: the Q4_K matrices by 16-byte lane loads
    (quant/gemv_mma_k_w16.py;
    the short graph's build, unpipelined, since 2026-12-06). W16Q6: the Q6_K ones by 16-byte lane
    loads (gemv_mma_q6k.make_row_loads; the knob gemv_mma_q6k.W16, on)."""
    if len(FMTS) != 3 or any(f not in ("Q4_K", "Q6_K") for f in FMTS):
        raise ValueError(f"mma_qkv_kernel: FMTS {FMTS} must be three of Q4_K, Q6_K")
    NW = KSPLIT
    finish = make_finish(NW, 4)
    # (PIPE is the Q4_K matrices'; the Q6_K trips are unpipelined: gemv_mma_k.default_pipe)
    T0, T1, T2 = ((make_trips(NW, 8, PIPE, PDL, W16) if f == "Q4_K" else Q6.make_trips(NW, 8, False, PDL, W16Q6))
                  for f in FMTS)
    trigger_first, trigger_late = pdl_triggers(PDL)

    @cuda.jit
    def kernel(wa0, wb0, wc0, wd0, rows0, wa1, wb1, wc1, wd1, rows1, wa2, wb2, wc2, wd2, rows2,
               nu, xq, xd, xb, cols, n_tok, ldy, y):
        trigger_first()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        n0 = (rows0 + ROWS - 1) // ROWS
        n1 = (rows1 + ROWS - 1) // ROWS
        tile = cuda.blockIdx.x
        acc = cuda.local.array(4, float32)
        for k in range(4):
            acc[k] = float32(0)
        if tile < n0:                                # (block-uniform branches)
            T0(acc, wa0, wb0, wc0, wd0, nu, rows0, tile, warp, lane, xq, xd, xb, cols, n_tok)
            c, rows = 0, rows0
        elif tile < n0 + n1:
            tile -= n0
            T1(acc, wa1, wb1, wc1, wd1, nu, rows1, tile, warp, lane, xq, xd, xb, cols, n_tok)
            c, rows = rows0, rows1
        else:
            tile -= n0 + n1
            T2(acc, wa2, wb2, wc2, wd2, nu, rows2, tile, warp, lane, xq, xd, xb, cols, n_tok)
            c, rows = rows0 + rows1, rows2
        trigger_late()
        finish(acc, warp, lane, c + tile * ROWS + (lane >> 2), 2 * (lane & 3), c + rows, ldy, n_tok, y, y, 0)
    return kernel_cache.attach(kernel)


def gemv_mma_qkv(ws, xq, xd, xb, y, n_tok: int, ldy: int | None = None, ksplit: int | None = None,
                 pipe: bool = True, stream=0, pdl: bool = False, w16: bool = False,
                 w16q6: bool | None = None) -> None:
    """y[:, q | k | v] = x [Wq | Wk | Wv]^T for three GemvWeights (dp4a mode, Q4_K or Q6_K each, one
    column count) and q8_K activations (gemv_mma_k's xq, xd, xb; xb is read by the Q4_K ones);
    1 <= n_tok <= 8. y: [n_tok, ldy] rows (ldy None: the three matrices' rows), the first
    sum(rows) columns written. ksplit None: plan_ksplit of the three's rows. pdl: as gemv_mma_k's.
    w16: the Q4_K matrices by 16-byte lane loads (as gemv_mma_glu's; the short graph's since
    2026-12-06: 8.9 against 9.5 us a layer on an H100). w16q6: the Q6_K ones so (None: the knob
    gemv_mma_q6k.W16). No allocation, no synchronization."""
    from . import pdl as P
    ws = tuple(ws)
    if len(ws) != 3:
        raise ValueError(f"gemv_mma_qkv: three weights (q, k, v), got {len(ws)}")
    for w in ws:
        if w.qtype not in FORMATS:
            raise ValueError(f"gemv_mma_qkv: {w.qtype.name} weight; only Q4_K and Q6_K")
    cols = ws[0].cols
    if any(w.cols != cols or w.units != ws[0].units for w in ws):
        raise ValueError(f"gemv_mma_qkv: the weights' columns differ ({[w.cols for w in ws]})")
    if not 1 <= n_tok <= 8:
        raise ValueError(f"gemv_mma_qkv: n_tok {n_tok} must be 1..8")
    total = sum(w.rows for w in ws)
    ldy = total if ldy is None else ldy
    if ldy < total:
        raise ValueError(f"gemv_mma_qkv: ldy {ldy} below the three matrices' {total} rows")
    ksplit = plan_ksplit(total, cols, n_tok) if ksplit is None else ksplit
    if not 1 <= ksplit <= 16:
        raise ValueError(f"gemv_mma_qkv: ksplit {ksplit} must be 1..16")
    fmts = tuple(w.qtype.name for w in ws)
    w16q6 = bool(Q6.W16 if w16q6 is None else w16q6) and "Q6_K" in fmts
    xq, xd, xb = q8k_inputs("gemv_mma_qkv", ws, xq, xd, xb, n_tok, cols, read_xb=True, w16=bool(w16),  # (takes xb)
                            w16q6=w16q6)
    yf = _flat(y, np.float32, n_tok * ldy, "y", "gemv_mma_qkv")
    build = P.build(bool(pdl))
    kern = mma_qkv_kernel(fmts, ksplit, bool(pipe), build, bool(w16), w16q6)
    if not ptx.SIMULATOR:
        _fits(kern, SIGNATURE, ("qkv " + "/".join(fmts), ksplit, bool(pipe), 8, build, bool(w16), w16q6))
    grid = sum((w.rows + ROWS - 1) // ROWS for w in ws)
    args = [a for w in ws for a in (w.wa, w.wb, w.wc, w.wd, w.rows)]
    P.launch_or_plain(kern, grid, 32 * ksplit, stream, SIGNATURE, bool(pdl), *args, ws[0].units, xq, xd, xb, cols,
                      n_tok, ldy, yf)
