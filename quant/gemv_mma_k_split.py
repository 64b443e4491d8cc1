"""gemv_mma_k with each 16-row tile's k-range split over KB thread blocks (lab, 2026-12-06; not timed).

Why: the 4B's attn_output and ffn_down have 2,560 rows, 160 tiles of 16, and an H100 has 132 SMs,
so 28 SMs run two tiles and the rest one. A tile's time is its SM's (docs/kernels/gemv.md 8i: t = a
+ b x the tiles on the busiest SM), so the launch takes two tiles' time for 1.21 tiles of work an SM.
With KB = 2 the grid is 320 half-tiles, at most three an SM: 1.5 tiles' time. Worth ~2-3 us of each
of those launches in the short prefill's graph (decode-step.md 7) - before the cost of the fix-up
below, which is what a GPU call has to weigh.

How: grid block b is part h = b % KB of tile b // KB. Its NW warps are warps h * NW .. h * NW + NW - 1
of the tile's NW * KB (gemv_mma_k.make_trips with NW * KB warps: each takes its share of the row's
256-weight blocks, as in one block of NW * KB warps). The block adds its warps' sums in shared memory
(gemv_mma.make_warp_sum), warp 0 writes them to the workspace (`part`: the tile's KB parts of 16 rows
x NT tokens, 512 bytes a part at NT 8, a tile's lines its own), fences, and counts the block in
cnt[tile]; the block that counts KB - 1 (the last) fences again, adds the KB parts in the order
h = 0 .. KB - 1 - the same sum whichever block is last - adds the residual, stores y and puts the
count back to 0 for the next launch (`cnt` starts at zeros: `workspace`).

The last block reads its siblings' parts with ordinary loads: no block of another tile touches a
tile's lines, and the last block never read them before it counted, so its L1 holds no stale copy.

Bits: not gemv_mma_k's at the same total warps (the parts are added after each part's warps, not in
one warp order), the same on every run. Q4_K weights only (W16 or the 8-byte loads), up to 16 tokens,
no PDL build.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .formats import QType
from .gemv_mma import ROWS, _dev, _flat, make_warp_sum
from .gemv_mma_k import MAX_TOK, _fits, default_build, make_trips, q8k_inputs

SIGNATURE = ("void(uint32[::1], uint32[::1], int64, int64, uint32[::1], float32[::1], int32[::1], int64, "
             "int64, int64, float32[::1], float32[::1], int64, float32[::1], int32[::1])")
FULL = 0xFFFFFFFF


def workspace(rows: int, kb: int, nt: int = 8) -> tuple:
    """(part float32, cnt int32) device arrays for a launch of `rows` rows split kb ways at NT nt
    (8 up to 8 tokens, else 16); cnt zeroed. One pair per launch that may run at the same time."""
    tiles = -(-rows // ROWS)
    return cuda.device_array(tiles * kb * ROWS * nt, np.float32), cuda.to_device(np.zeros(tiles, np.int32))


def make_split_finish(NW: int, NACC: int, KB: int, NT: int):
    """finish(acc, warp, lane, tile, part_no, rows, ldy, n_tok, y, res, resid, part, cnt): the module's
    fix-up. The lane's NACC sums are gemv_mma.make_finish's layout (row 16 tile + g + 8 ((k >> 1) & 1),
    token 2t + (k & 1) + 8 (k >> 2))."""
    warp_sum = make_warp_sum(NW, NACC)
    SPAN = ROWS * NT

    @_dev
    def finish(acc, warp, lane, tile, part_no, rows, ldy, n_tok, y, res, resid, part, cnt):
        if not warp_sum(acc, warp, lane):
            return
        g, t = lane >> 2, lane & 3
        base = uint32(tile * KB) * uint32(SPAN)
        for k in range(NACC):                        # this part's sums: [token][row of the tile]
            tk = 2 * t + (k & 1) + 8 * (k >> 2)
            part[base + uint32(part_no * SPAN + tk * ROWS + g + 8 * ((k >> 1) & 1))] = acc[k]
        cuda.threadfence()
        ticket = 0
        if lane == 0:
            ticket = cuda.atomic.add(cnt, tile, 1)
        ticket = cuda.shfl_sync(FULL, ticket, 0)
        if ticket != KB - 1:
            return
        cuda.threadfence()
        for k in range(NACC):
            r = tile * ROWS + g + 8 * ((k >> 1) & 1)
            tk = 2 * t + (k & 1) + 8 * (k >> 2)
            if r < rows and tk < n_tok:
                j = base + uint32(tk * ROWS + g + 8 * ((k >> 1) & 1))
                s = part[j]
                for h in range(1, KB):
                    s += part[j + uint32(h * SPAN)]
                i = uint32(tk * ldy + r)
                y[i] = s + res[i] if resid != 0 else s
        if lane == 0:
            cnt[tile] = 0
    return finish


@functools.lru_cache(maxsize=None)
def mma_q4k_split_kernel(KSPLIT: int, KB: int, PIPE: bool, NT: int = 8, W16: bool = False):
    """gemv_mma_k's Q4_K kernel (gemv_mma_k.mma_q4k_q8k_kernel: its arguments, then part and cnt) with
    grid ceil(rows / 16) * KB blocks of 32 * KSPLIT threads: KSPLIT * KB warps a tile (module docstring)."""
    if NT not in (8, 16):
        raise ValueError(f"mma_q4k_split_kernel: NT {NT} must be 8 or 16")
    NACC = NT // 2
    trips = make_trips(KSPLIT * KB, NT, PIPE, False, W16)
    finish = make_split_finish(KSPLIT, NACC, KB, NT)

    @cuda.jit
    def kernel(wa, wb, nu, rows, xq, xd, xb, cols, n_tok, ldy, y, res, resid, part, cnt):
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        tile = cuda.blockIdx.x // KB
        part_no = cuda.blockIdx.x - tile * KB
        acc = cuda.local.array(NACC, float32)
        for k in range(NACC):
            acc[k] = float32(0)
        trips(acc, wa, wb, wa, wb, nu, rows, tile, part_no * KSPLIT + warp, lane, xq, xd, xb, cols, n_tok)
        finish(acc, warp, lane, tile, part_no, rows, ldy, n_tok, y, res, resid, part, cnt)
    return kernel_cache.attach(kernel)


def gemv_mma_k_split(w, xq, xd, xb, y, n_tok: int, part, cnt, kb: int = 2, residual=None,
                     ksplit: int | None = None, stream=0, pipe: bool | None = None, w16: bool | None = None) -> None:
    """y [n_tok, rows] = x W^T (+ residual) as gemv_mma_k (a Q4_K GemvWeight, q8_K activations in the
    tiled layout) with each tile's k-range over kb thread blocks of ksplit warps (None: gemv_mma_k's
    default_build's k-split, pipe and w16, its warps then shared by the kb blocks: ksplit // kb each, at
    least 1). part, cnt: `workspace(w.rows, kb, 8 or 16)`'s (cnt all zero between launches; the kernel
    leaves it so). No allocation, no synchronization."""
    if w.qtype != QType.Q4_K:
        raise ValueError(f"gemv_mma_k_split: Q4_K weights only (got {w.qtype.name})")
    if not 1 <= n_tok <= MAX_TOK:
        raise ValueError(f"gemv_mma_k_split: n_tok {n_tok} must be 1..{MAX_TOK}")
    if not 2 <= kb <= 8:
        raise ValueError(f"gemv_mma_k_split: kb {kb} must be 2..8 (1: gemv_mma_k)")
    planned, pipe, w16 = default_build(w, n_tok, None, pipe, w16)
    ksplit = max(1, planned // kb) if ksplit is None else ksplit
    if not 1 <= ksplit <= 16:
        raise ValueError(f"gemv_mma_k_split: ksplit {ksplit} must be 1..16")
    rows, cols = w.rows, w.cols
    nt = 8 if n_tok <= 8 else 16
    tiles = -(-rows // ROWS)
    part = _flat(part, np.float32, tiles * kb * ROWS * nt, "part", "gemv_mma_k_split")
    cnt = _flat(cnt, np.int32, tiles, "cnt", "gemv_mma_k_split")
    xq, xd, xb = q8k_inputs("gemv_mma_k_split", (w,), xq, xd, xb, n_tok, cols, read_xb=True, w16=w16)
    yf = _flat(y, np.float32, n_tok * rows, "y", "gemv_mma_k_split")
    rf = yf if residual is None else _flat(residual, np.float32, n_tok * rows, "residual", "gemv_mma_k_split")
    kern = mma_q4k_split_kernel(ksplit, kb, bool(pipe), nt, bool(w16))
    if not ptx.SIMULATOR:
        _fits(kern, SIGNATURE, ("Q4_K", ksplit, bool(pipe), nt, False, w16, "split", kb))
    kern[tiles * kb, 32 * ksplit, stream](w.wa, w.wb, w.units, rows, xq, xd, xb, cols, n_tok, rows, yf, rf,
                                          int(residual is not None), part, cnt)
