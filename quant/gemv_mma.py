"""A GEMV for 1-8 tokens on the int8 tensor cores (lab): Q4_K weights, q8 activations.

Why. The dp4a GEMV (gemv_kernels.py) decodes each weight once but multiplies it once per
token: at 8 tokens it holds 8 accumulators a row, 190 registers a thread, and is compute-bound
(docs/kernels/gemv.md: ffn_gate/up 31.19 us at 8 tokens against 6.84 at one), which is why a
short prefill after a cached prefix (1-16 new tokens: every chat turn) runs on the 16-row MMQ
GEMM and costs more than a decode step (docs/forward-pass.md). Here one `mma.sync.m16n8k32`
(s8 x s8 -> s32) multiplies 16 rows x 32 weights by 32 x 8 token values: the eight tokens
cost one instruction where dp4a needs 64, and a weight is still read and decoded once.

The math is the dp4a GEMV's (w = d*sc*q - dmin*m per 32-weight sub-block of a Q4_K block;
x ~ xd*xq per 32 values, xs holding (xd, xd*sum q[0:16], xd*sum q[16:32], xd*sum q[0:32])):

    y[t, r] = sum over sub-blocks s of  d_r*sc_rs * xd_ts * sum_i q_ri xq_ti  -  dmin_r*m_rs * xd_ts*sum_i xq_ti

The integer dot of a sub-block is exact (int32), so the result differs from the dp4a GEMV's
only by the order of the float additions.

Who owns what. Block = KSPLIT warps on the same 16 rows (row tile = blockIdx.x), warp w takes
the k-range of chunks [w*cpw, (w+1)*cpw) (a chunk = 64 weights of a row = two Q4_K units =
sub-blocks 2c and 2c+1 of a 256-weight block); the warps' partial sums meet in shared memory.
Lane l: g = l // 4 (rows g and g+8 of the tile, and token g of the B fragment), t = l % 4
(tokens 2t and 2t+1 of the accumulators). Since the k order inside one mma is ours to choose
(A and B only have to agree), the lane's A bytes are word t of each of the chunk's two units -
low nibbles for sub-block 2c, high nibbles for 2c+1 - and its B bytes the four q8 values
of token g at the same weight positions (gemv_formats.py's unit layout):

    unit 2c (p even):   byte j low nibble = weight 64c + j,        high = 64c + 32 + j
    unit 2c+1 (p odd):  byte j low nibble = weight 64c + 16 + j,   high = 64c + 48 + j
    a0, a1 (rows g, g+8)  = word t of unit 2c   -> k = 4t..4t+3      (weights 64c + 4t ..)
    a2, a3 (rows g, g+8)  = word t of unit 2c+1 -> k = 16+4t..16+4t+3 (weights 64c + 16 + 4t ..)
    b0 = xq[g, 64c + 4t ..], b1 = xq[g, 64c + 16 + 4t ..]   (+32 for sub-block 2c+1)

D's (row g, token 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) are then scaled by the rows' block
header (d, dmin, 6-bit scales/mins: gemv_formats._k_scales) and the tokens' xs.

Status: checked in the simulator (tests/test_gemv_mma.py) and timed on the H200 (2026-12-03:
flat in the tokens, but 2-4x the dp4a GEMV at one token) and profiled on an H100 (2026-12-05: 2.15x
the dp4a GEMV's instructions at one token; docs/kernels/gemv.md 8b says where they go). `python -m
genie_rt.quant.gemv_mma` times it against the dp4a GEMV at 1-8 tokens. Not used by the engine.
Deliberately not here (yet): Q6_K (its 16-weight scales need k = 16 steps), epilogues other
than the residual add, more than 8 tokens (a second B fragment), loads pipelined across chunks.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .formats import QType
from .gemv_formats import _k_scales
from .pdl import hooks as pdl_hooks

LO4 = 0x0F0F0F0F
ROWS = 16                   # rows of an mma tile
MAX_TOK = 8                 # the mma's n
SIGNATURE = ("void(uint32[::1], uint32[::1], int64, int64, uint32[::1], float32[::1], int64, int64, "
             "float32[::1], float32[::1], int64)")


if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


@_dev
def _loads(wa, wb, xq, xs, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols, sxw, ch):
    """Everything chunk ch needs, loaded: word t of its two units for rows rr0 and rr1, the
    rows' block headers, token tb's four q8 words (zero when okb is false), and tokens ta / tc's
    (d, d * sum32) of the chunk's two sub-blocks."""
    blk = ch >> 2
    c = ch & 3
    u0 = blk * 8 + 2 * c                             # the chunk's first unit in the row
    w0a = wa[(rr0 * nu + u0) * 4 + t]
    w0b = wa[(rr0 * nu + u0 + 1) * 4 + t]
    w1a = wa[(rr1 * nu + u0) * 4 + t]
    w1b = wa[(rr1 * nu + u0 + 1) * 4 + t]
    h0 = ptx.ldg_v4(wb, (rr0 * nblk + blk) * 4)
    h1 = ptx.ldg_v4(wb, (rr1 * nblk + blk) * 4)
    xo = (tb * cols + blk * 256 + c * 64) >> 2       # token tb's word of weight 64c
    xa0 = xq[xo + t] if okb else uint32(0)
    xa1 = xq[xo + 4 + t] if okb else uint32(0)
    xb0 = xq[xo + 8 + t] if okb else uint32(0)
    xb1 = xq[xo + 12 + t] if okb else uint32(0)
    sb = (blk * 8 + 2 * c) * 4                       # xs of sub-block 2c (4 floats), 2c+1 next
    s0 = (xs[ta * sxw + sb], xs[ta * sxw + sb + 3], xs[ta * sxw + sb + 4], xs[ta * sxw + sb + 7])
    s1 = (xs[tc * sxw + sb], xs[tc * sxw + sb + 3], xs[tc * sxw + sb + 4], xs[tc * sxw + sb + 7])
    return w0a, w0b, w1a, w1b, h0, h1, xa0, xa1, xb0, xb1, s0, s1


@_dev
def _math(v, c):
    """Chunk c's (c = 0..3 inside its block) contribution to the lane's four sums: one mma for
    sub-block 2c (low nibbles), one for 2c+1 (high), each scaled per row and token."""
    w0a, w0b, w1a, w1b, h0, h1, xa0, xa1, xb0, xb1, s0, s1 = v
    ia = ptx.mma_s8_s32(w0a & LO4, w1a & LO4, w0b & LO4, w1b & LO4, xa0, xa1,
                        int32(0), int32(0), int32(0), int32(0))
    ib = ptx.mma_s8_s32((w0a >> 4) & LO4, (w1a >> 4) & LO4, (w0b >> 4) & LO4, (w1b >> 4) & LO4,
                        xb0, xb1, int32(0), int32(0), int32(0), int32(0))
    dm0 = ptx.unpack_half2(h0[0])                    # (d, dmin) of row g's block
    dm1 = ptx.unpack_half2(h1[0])
    sca0, mna0, scb0, mnb0 = _k_scales(h0, c)
    sca1, mna1, scb1, mnb1 = _k_scales(h1, c)
    fa0 = dm0[0] * float32(sca0)
    fb0 = dm0[0] * float32(scb0)
    ma0 = dm0[1] * float32(mna0)
    mb0 = dm0[1] * float32(mnb0)
    fa1 = dm1[0] * float32(sca1)
    fb1 = dm1[0] * float32(scb1)
    ma1 = dm1[1] * float32(mna1)
    mb1 = dm1[1] * float32(mnb1)
    # s = (d of sub-block 2c, d * sum32 of 2c, d of 2c+1, d * sum32 of 2c+1) for token 2t / 2t+1
    return ((fa0 * s0[0] * float32(ia[0]) - ma0 * s0[1]) + (fb0 * s0[2] * float32(ib[0]) - mb0 * s0[3]),
            (fa0 * s1[0] * float32(ia[1]) - ma0 * s1[1]) + (fb0 * s1[2] * float32(ib[1]) - mb0 * s1[3]),
            (fa1 * s0[0] * float32(ia[2]) - ma1 * s0[1]) + (fb1 * s0[2] * float32(ib[2]) - mb1 * s0[3]),
            (fa1 * s1[0] * float32(ia[3]) - ma1 * s1[1]) + (fb1 * s1[2] * float32(ib[3]) - mb1 * s1[3]))


def make_warp_sum(NW: int, NACC: int = 4):
    """warp_sum(acc, warp, lane) -> bool: the lane's NACC sums added over the block's NW warps in
    shared memory, in warp order, into warp 0's acc; True for warp 0's threads (which go on with
    the sums), False for the others. Every thread of the block calls it (a barrier)."""
    @_dev
    def warp_sum(acc, warp, lane):
        if NW > 1:                                   # the warps' k-ranges meet in shared memory
            red = cuda.shared.array((NW, 32, NACC), float32)
            for k in range(NACC):
                red[warp, lane, k] = acc[k]
            cuda.syncthreads()
            if warp != 0:
                return False
            for other in range(1, NW):
                for k in range(NACC):
                    acc[k] += red[other, lane, k]
        return True
    return warp_sum


def make_finish(NW: int, NACC: int = 4):
    """finish(acc, warp, lane, r0, t0, rows, ldy, n_tok, y, res, resid), how both mma GEMVs end:
    the lane's NACC sums (the mma's D layout: row r0 + 8 * ((k >> 1) & 1), token t0 + (k & 1),
    plus 8 tokens for k >= 4 - a second B fragment, gemv_mma_k's NT 16) added over the block's NW
    warps in shared memory (`make_warp_sum`), then stored by warp 0 at y[token * ldy + row] (plus
    res there where resid != 0; an unsigned index: no negative-index wrap-around code)."""
    warp_sum = make_warp_sum(NW, NACC)

    @_dev
    def finish(acc, warp, lane, r0, t0, rows, ldy, n_tok, y, res, resid):
        if not warp_sum(acc, warp, lane):
            return
        for k in range(NACC):
            r = r0 + 8 * ((k >> 1) & 1)
            tk = t0 + (k & 1) + 8 * (k >> 2)
            if r < rows and tk < n_tok:
                i = uint32(tk * ldy + r)
                y[i] = acc[k] + res[i] if resid != 0 else acc[k]
    return finish


@_dev
def lanes(tile, warp, lane, rows, nu, n_tok, NW):
    """What a lane of warp `warp` works on in the 16-row tile `tile` (every mma GEMV build):
    (g, t, rr0, rr1, nblk, b_lo, b_hi, tb, ta, tc, tb2, ta2, tc2) - its mma group and thread, its
    rows clamped into the matrix (loads stay in bounds; finish skips the rows past it), the
    256-weight blocks [b_lo, b_hi) of its warp (NW warps split a row), the token of its B fragment
    and of its accumulators (clamped likewise; tb2 .. : the NT 16 builds' second fragment)."""
    g = lane >> 2
    t = lane & 3
    r0 = tile * ROWS + g
    r1 = r0 + 8
    nblk = nu >> 3
    bpw = (nblk + NW - 1) // NW                      # (once a thread: signed is fine)
    b_lo = warp * bpw
    t0 = 2 * t
    return (g, t, r0 if r0 < rows else 0, r1 if r1 < rows else 0, nblk, b_lo, min(b_lo + bpw, nblk),
            g if g < n_tok else 0, t0 if t0 < n_tok else 0, t0 + 1 if t0 + 1 < n_tok else 0,
            g + 8 if g + 8 < n_tok else 0, t0 + 8 if t0 + 8 < n_tok else 0, t0 + 9 if t0 + 9 < n_tok else 0)


def make_block_loop(wloads, tloads, block, PIPE: bool, PDL: bool = False, wrest=None):
    """run(acc, largs, b_lo, b_hi, nblk): the trips of the gemv_mma_k builds over a warp's blocks
    [b_lo, b_hi) - W = wloads(*largs, blk) (the weights'), X = tloads(*largs, blk) (the tokens'),
    then block(acc, W, X) - each trip's loads issued before the trip before it multiplies where
    PIPE (the last block's loads repeated: every lane makes the same trips), one trip at a time
    otherwise. PDL (a programmatic-dependent-launch build, quant/pdl.py): the first trip's weight
    loads are issued, then griddepcontrol.wait, then everything another kernel wrote (tloads must
    read it by coherent loads, rule 3). Every thread waits, with or without blocks of its own: the
    stores after it must not overtake the kernel before. Without PDL the loads are the same, in
    the same order, as before the split. wrest: the weight loads of every trip after the first
    (default wloads) - a PDL build's read-only ones: only the first trip's must stay above the wait
    (quant/pdl.py rule 2), and the read-only path was 5-9 % faster at 8 tokens (H100, 2026-12-06:
    the PDL builds launched plainly, docs/kernels/gemv.md 8i)."""
    wait = pdl_hooks(PDL)[0]
    wlater = wloads if wrest is None else wrest

    @_dev
    def run(acc, largs, b_lo, b_hi, nblk):
        b = b_lo
        if PIPE:
            first = min(b_lo, nblk - 1)
            W = wloads(*largs, first)
            wait()
            X = tloads(*largs, first)
            while b < b_hi:
                nxt = min(b + 1, b_hi - 1)
                Wn = wlater(*largs, nxt)
                Xn = tloads(*largs, nxt)
                block(acc, W, X)
                W = Wn
                X = Xn
                b += 1
        else:
            if PDL:
                W = wloads(*largs, min(b_lo, nblk - 1))
                wait()
                if b < b_hi:
                    block(acc, W, tloads(*largs, b))
                    b += 1
            while b < b_hi:
                block(acc, wlater(*largs, b), tloads(*largs, b))
                b += 1
    return run


@functools.lru_cache(maxsize=None)
def mma_q4k_kernel(KSPLIT: int = 4):
    """y[t, r] = sum_c W[r, c] x[t, c] (+ res[t, r]) for t < n_tok <= 8; grid ceil(rows / 16)
    blocks of 32 * KSPLIT threads. Arguments: wa (Q4_K qs words), wb (headers, 4 words a
    block), nu (units a row), rows, xq (uint32 words of the int8 q8 values [n_tok * cols]),
    xs (float32 [n_tok * cols / 8]), cols, n_tok, y (float32 [n_tok * rows]), res (read when
    resid != 0; may be y), resid."""
    NW = KSPLIT
    finish = make_finish(NW)

    @cuda.jit
    def kernel(wa, wb, nu, rows, xq, xs, cols, n_tok, y, res, resid):
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        r0 = cuda.blockIdx.x * ROWS + g
        r1 = r0 + 8
        ok0 = r0 < rows
        ok1 = r1 < rows
        rr0 = r0 if ok0 else 0                       # clamped rows: loads stay in bounds
        rr1 = r1 if ok1 else 0
        nblk = nu >> 3
        chunks = nblk * 4
        cpw = (chunks + NW - 1) // NW
        c_lo = warp * cpw
        c_hi = min(c_lo + cpw, chunks)
        t0 = 2 * t
        t1 = t0 + 1
        tb = g if g < n_tok else 0                   # token of the B fragment (zeroed past n_tok)
        okb = g < n_tok
        ok_t0 = t0 < n_tok
        ok_t1 = t1 < n_tok
        sxw = cols >> 3                              # xs floats a token
        ta = t0 if ok_t0 else 0                      # clamped tokens: loads stay in bounds
        tc = t1 if ok_t1 else 0
        # acc[k]: row g + 8 * (k >> 1), token 2t + (k & 1) (the mma's D layout)
        acc = cuda.local.array(4, float32)
        for k in range(4):
            acc[k] = float32(0)
        ch = c_lo
        while ch < c_hi:                             # the same trips for every lane of the warp
            # two chunks a trip, every load of both issued before the first multiply (past the
            # end of the range the second re-reads the last chunk and is not added)
            v0 = _loads(wa, wb, xq, xs, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols, sxw, ch)
            v1 = _loads(wa, wb, xq, xs, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols, sxw,
                        min(ch + 1, c_hi - 1))
            p = _math(v0, ch & 3)
            for k in range(4):
                acc[k] += p[k]
            if ch + 1 < c_hi:                        # warp-uniform
                p = _math(v1, (ch + 1) & 3)
                for k in range(4):
                    acc[k] += p[k]
            ch += 2
        finish(acc, warp, lane, r0, t0, rows, rows, n_tok, y, res, resid)
    return kernel_cache.attach(kernel)


def _flat(a, dtype, n, what, who="gemv_mma"):
    if a.dtype != dtype or a.size != n:
        raise ValueError(f"{who}: {what} must be {np.dtype(dtype).name} with {n} elements, "
                         f"got {a.dtype} {tuple(a.shape)}")
    return a.reshape(n) if a.ndim != 1 else a


def _check(w, n_tok: int, ksplit: int, who="gemv_mma") -> None:
    """The launch arguments both mma GEMVs take: a Q4_K weight, 1-8 tokens, a k-split of 1-8 warps."""
    if w.qtype != QType.Q4_K:
        raise ValueError(f"{who}: only Q4_K weights (got {w.qtype.name})")
    if not 1 <= n_tok <= MAX_TOK:
        raise ValueError(f"{who}: n_tok {n_tok} must be 1..{MAX_TOK}")
    if ksplit not in (1, 2, 4, 8):
        raise ValueError(f"{who}: ksplit {ksplit} must be 1, 2, 4 or 8")


def gemv_mma(w, xq, xs, y, n_tok: int, residual=None, ksplit: int = 4, stream=0) -> None:
    """y [n_tok, rows] = x W^T (+ residual) for a Q4_K GemvWeight `w` (gemv.prepare_weight, dp4a
    mode) and q8 activations xq int8 [n_tok, cols] / xs float32 [n_tok, cols / 8]
    (gemv.quantize_q8); 1 <= n_tok <= 8. No allocation, no synchronization."""
    _check(w, n_tok, ksplit)
    rows, cols = w.rows, w.cols
    xq = _flat(xq, np.int8, n_tok * cols, "xq").view(np.uint32)
    xs = _flat(xs, np.float32, n_tok * cols // 8, "xs")
    yf = _flat(y, np.float32, n_tok * rows, "y")
    rf = yf if residual is None else _flat(residual, np.float32, n_tok * rows, "residual")
    kern = mma_q4k_kernel(ksplit)
    kern[(rows + ROWS - 1) // ROWS, 32 * ksplit, stream](
        w.wa, w.wb, w.units, rows, xq, xs, cols, n_tok, yf, rf, int(residual is not None))


def _weight(rows: int, cols: int, qtype: QType = QType.Q4_K, seed: int = 0):
    """A random weight for the lab runs: (its dequantized float matrix, the GemvWeight)."""
    from . import gemv as G
    from .gemv_bench import random_weight
    hw = random_weight(qtype, rows, cols, np.random.default_rng(seed))
    return G.dequantize_weight(hw), G.prepare_weight(G.to_device(hw), "dp4a")


def _activations(W, n_tok: int, stream):
    """n_tok random rows quantized to q8 on the device, an output buffer, and numpy's result and
    error bound for W: (dx, xq, xs, y, ref, bound)."""
    from . import gemv as G
    rows, cols = W.shape
    x = np.random.default_rng(1).standard_normal((n_tok, cols)).astype(np.float32)
    dx = cuda.to_device(x)
    xq = cuda.device_array((n_tok, cols), np.int8)
    xs = cuda.device_array((n_tok, cols // 8), np.float32)
    G.quantize_q8(dx, xq, xs, stream=stream)
    y = cuda.device_array((n_tok, rows), np.float32)
    stream.synchronize()
    xt = G.dequantize_q8(xq.copy_to_host(), xs.copy_to_host())
    return dx, xq, xs, y, G.gemv_reference(W, xt), G.error_bound(W, xt, "f32")


def _within(y, ref, bound) -> bool:
    return bool(np.all(np.abs(y.copy_to_host() - ref) <= bound))


def _bench(argv=None) -> int:
    """Time gemv_mma against the dp4a GEMV at the 4B's Q4_K shapes (GPU only)."""
    import argparse
    import json

    from . import gemv as G
    from genie_rt.engine.cuda_graph import time_us
    ap = argparse.ArgumentParser(description="gemv_mma (int8 tensor cores, 1-8 tokens) vs the dp4a GEMV")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true",
                    help="ffn_gate only: each kernel (mma ks4 and dp4a at 1 and 8 tokens) checked, then launched "
                         "once between cuProfilerStart/Stop, for ncu --profile-from-start off (no timing)")
    args = ap.parse_args(argv)
    if ptx.SIMULATOR:
        raise SystemExit("needs a GPU")
    stream = cuda.stream()
    if args.ncu:
        return _ncu(stream)
    out = []
    for name, rows, cols in (("attn_q", 4096, 2560), ("ffn_gate", 9728, 2560), ("attn_output", 2560, 4096),
                             ("ffn_down", 2560, 9728)):
        W, gw = _weight(rows, cols)
        for n_tok in (1, 2, 4, 8):
            dx, xq, xs, y, ref, bound = _activations(W, n_tok, stream)
            row = dict(gemv=name, rows=rows, cols=cols, n_tok=n_tok)
            for ks in (2, 4, 8):
                gemv_mma(gw, xq, xs, y, n_tok, ksplit=ks, stream=stream)
                stream.synchronize()
                ok = _within(y, ref, bound)
                row[f"mma_ks{ks}_ok"] = ok
                if ok:
                    row[f"mma_ks{ks}_us"] = time_us(lambda: gemv_mma(gw, xq, xs, y, n_tok, ksplit=ks,
                                                                        stream=stream), stream)
            G.gemv(gw, dx, y, xq=xq, xs=xs, stream=stream)
            row["dp4a_us"] = time_us(lambda: G.gemv(gw, dx, y, xq=xq, xs=xs, stream=stream), stream)
            print(row, flush=True)
            out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(v for r in out for k, v in r.items() if k.endswith("_ok")) else 1


def _ncu(stream, rows: int = 9728, cols: int = 2560) -> int:
    """--ncu: why the mma GEMV is 2-4x the dp4a GEMV at one token (docs/kernels/gemv.md 8b) - one
    profiled launch each of ffn_gate (9728 x 2560 Q4_K) by mma (k-split 4) and by dp4a, at 1 and 8
    tokens, after a check against numpy."""
    from . import gemv as G
    W, gw = _weight(rows, cols)
    runs = []
    for n_tok in (1, 8):
        dx, xq, xs, y, ref, bound = _activations(W, n_tok, stream)

        def mma(xq=xq, xs=xs, y=y, n=n_tok):               # this token count's buffers, bound now
            gemv_mma(gw, xq, xs, y, n, ksplit=4, stream=stream)

        def dp4a(dx=dx, xq=xq, xs=xs, y=y):
            G.gemv(gw, dx, y, xq=xq, xs=xs, stream=stream)
        for label, fn in ((f"mma ks4 n_tok={n_tok}", mma), (f"dp4a n_tok={n_tok}", dp4a)):
            fn()
            stream.synchronize()
            if not _within(y, ref, bound):
                raise SystemExit(f"{label}: outside the error bound of numpy")
            runs.append((label, fn))
    return profile_once(runs, stream)


def profile_once(runs, stream) -> int:
    """Each (label, fn) of runs launched once between cuProfilerStart / Stop (for ncu
    --profile-from-start off: only these launches are profiled), synchronized after each. 0."""
    cuda.profile_start()
    for label, fn in runs:
        fn()
        stream.synchronize()
        print("profiled", label, flush=True)
    cuda.profile_stop()
    return 0


if __name__ == "__main__":      # python -m genie_rt.quant.gemv_mma [--json PATH | --ncu]
    raise SystemExit(_bench())
