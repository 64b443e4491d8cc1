"""The int8 tensor-core GEMV for 1-8 tokens with an integer epilogue (lab, 2026-12-05).

Why. gemv_mma.py's kernel is flat in the tokens but issues 2.15x the dp4a GEMV's instructions
at one token (Nsight Compute, H100, 2026-12-05: 8.54 M against 3.97 M warp instructions for
ffn_gate, both at 0.58 issued a scheduler-cycle; docs/kernels/gemv.md 8b). Most of its extra
work is the float epilogue of every 32-weight sub-block: each integer dot is scaled by the
row's d * sc and the token's q8 scale, and dmin * m * (the token's scaled sum) is taken off -
~40 FP32 operations and 8 conversions a chunk, with 8 float loads of the token scales.

What changes. The activations come quantized per 256 values, as llama.cpp's q8_K: one scale xd
a token and 256-weight block, plus each 32-value sub-block's integer sum xb. Within a block the
row's d and dmin and the token's xd are then constants, so the sub-blocks add up as integers:

    y[t, r] = sum over blocks b of  xd[t, b] * (d[r, b] * S[r, t, b] - dmin[r, b] * M[r, t, b])
    S = sum_s sc[r, s] * dot(q[r, s], xq[t, s])     M = sum_s m[r, s] * xb[t, s]

(S, M int32: |S| <= 8 * 63 * 32 * 15 * 127 < 2^25, |M| <= 8 * 63 * 32 * 127). A chunk (two
sub-blocks) costs 16 integer multiply-adds a lane; the float work is once a block. Who owns
which rows and the two chunks' loads of a trip issued before the first mma are gemv_mma.py's
(see its docstring). The k order inside an mma differs (since 2026-12-05, afternoon): lane t's
bytes of a chunk are bytes 8 (t & 1) .. + 7 of unit 2c + (t >> 1) - weights 64c + 8t .. + 7
(low nibbles) and + 32 (high) - and its q8 values of token g the same positions, so each is one
8-byte load (`ptx.ldg_v2`) where gemv_mma reads two words: 4 loads a chunk instead of 8.

The price is the activation's quantization: one scale for 256 values instead of 32 (q8_K, what
llama.cpp's CPU K-quant dot products use). `quantize_q8k` is its numpy reference; a device
quantizer (one block a token) comes with the engine's use of this kernel, not yet.

Status: checked in the simulator (tests/test_gemv_mma_k.py); not yet timed on a GPU (`python -m
genie_rt.quant.gemv_mma_k` times it against gemv_mma and the dp4a GEMV). Not used by the engine.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .gemv_formats import _k_scales
from .gemv_mma import LO4, ROWS, _check, _dev, _flat, make_finish

QK = 256                    # values a q8_K block (one scale)
SIGNATURE = ("void(uint32[::1], uint32[::1], int64, int64, uint32[::1], float32[::1], int32[::1], int64, "
             "int64, float32[::1], float32[::1], int64)")
SUB = 32                    # values a sub-block sum


def quantize_q8k(x: np.ndarray):
    """numpy q8_K of x [n_tok, cols] (cols a multiple of 256): (xq int8 [n_tok, cols], xd float32
    [n_tok, cols / 256], xb int32 [n_tok, cols / 32]); xq = round(x / xd), xd = max |x| / 127 of
    each block (0 for an all-zero block), xb the sum of xq over each 32 values."""
    x = np.asarray(x, np.float32)
    n_tok, cols = x.shape
    if cols % QK:
        raise ValueError(f"quantize_q8k: cols {cols} must be a multiple of {QK}")
    blocks = x.reshape(n_tok, cols // QK, QK)
    amax = np.abs(blocks).max(axis=2)
    xd = (amax / 127).astype(np.float32)
    inv = np.divide(1.0, xd, out=np.zeros_like(xd), where=xd > 0)
    xq = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8).reshape(n_tok, cols)
    xb = xq.reshape(n_tok, cols // SUB, SUB).astype(np.int32).sum(axis=2).astype(np.int32)
    return xq, xd, xb


def dequantize_q8k(xq: np.ndarray, xd: np.ndarray) -> np.ndarray:
    n_tok, cols = xq.shape
    return (xq.reshape(n_tok, -1, QK).astype(np.float32) * xd[..., None]).reshape(n_tok, cols)


@_dev
def _bases(nu, rr0, rr1, t, tb, cols):
    """The lane's first 32-bit word of rows rr0 and rr1 (chunk 0: unit 0 for lanes 0, 1, unit 1
    for lanes 2, 3; bytes 8 (t & 1) ..) and of token tb's q8 values (8 t ..), unsigned (no
    negative-index wrap-around code). The lane's 8 weights of a sub-block are then 8t .. 8t + 7
    of its 32, and its 8 q8 values the same: one 8-byte load each (`_loads`)."""
    off = uint32(4 * (t >> 1) + 2 * (t & 1))
    return (uint32(rr0 * nu * 4) + off, uint32(rr1 * nu * 4) + off, uint32((tb * cols) >> 2) + uint32(2 * t))


@_dev
def _loads(wa, wb, xq, xd, xb, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols, ch, wi0, wi1, xi):
    """Everything chunk ch needs: the lane's 8 bytes of the chunk's units for rows rr0 and rr1
    (one 8-byte load a row: weights 64c + 8t .. + 7, low and high nibbles), the rows' block
    headers, token tb's q8 values at the same positions (one 8-byte load a sub-block; zero when
    okb is false), tokens ta / tc's sums of the chunk's two sub-blocks and their block scales.
    wi0, wi1, xi: the lane's first word in rows rr0, rr1 and in token tb's q8 (`_bases`); chunk ch
    of a row starts 8 * ch words further (two 16-byte units), of a token 16 * ch words (64 values)."""
    blk = ch >> 2
    w0a, w0b = ptx.ldg_v2(wa, wi0 + uint32(8) * uint32(ch))
    w1a, w1b = ptx.ldg_v2(wa, wi1 + uint32(8) * uint32(ch))
    h0 = ptx.ldg_v4(wb, (rr0 * nblk + blk) * 4)
    h1 = ptx.ldg_v4(wb, (rr1 * nblk + blk) * 4)
    xo = xi + uint32(16) * uint32(ch)               # token tb's values 64c + 8t ..
    xa0, xa1 = ptx.ldg_v2(xq, xo) if okb else (uint32(0), uint32(0))
    xb0, xb1 = ptx.ldg_v2(xq, xo + uint32(8)) if okb else (uint32(0), uint32(0))   # 64c + 32 + 8t ..
    c = ch & 3
    nsb = cols >> 5
    sb = blk * 8 + 2 * c
    ja = uint32(ta * nsb + sb)
    jc = uint32(tc * nsb + sb)
    s0 = (xb[ja], xb[ja + uint32(1)])
    s1 = (xb[jc], xb[jc + uint32(1)])
    nb = cols >> 8
    return w0a, w0b, w1a, w1b, h0, h1, xa0, xa1, xb0, xb1, s0, s1, xd[uint32(ta * nb + blk)], xd[uint32(tc * nb + blk)]


@_dev
def _dots(v, c):
    """Chunk c's (0..3 in its block) integer contributions to the lane's four (row, token) sums:
    (S0, S1, S2, S3, M0, M1, M2, M3), k = row g + 8 * (k >> 1), token 2t + (k & 1)."""
    w0a, w0b, w1a, w1b, h0, h1, xa0, xa1, xb0, xb1, s0, s1, _, _ = v
    ia = ptx.mma_s8_s32(w0a & LO4, w1a & LO4, w0b & LO4, w1b & LO4, xa0, xa1,
                        int32(0), int32(0), int32(0), int32(0))
    ib = ptx.mma_s8_s32((w0a >> 4) & LO4, (w1a >> 4) & LO4, (w0b >> 4) & LO4, (w1b >> 4) & LO4,
                        xb0, xb1, int32(0), int32(0), int32(0), int32(0))
    sca0, mna0, scb0, mnb0 = _k_scales(h0, c)
    sca1, mna1, scb1, mnb1 = _k_scales(h1, c)
    return (sca0 * ia[0] + scb0 * ib[0], sca0 * ia[1] + scb0 * ib[1],
            sca1 * ia[2] + scb1 * ib[2], sca1 * ia[3] + scb1 * ib[3],
            mna0 * s0[0] + mnb0 * s0[1], mna0 * s1[0] + mnb0 * s1[1],
            mna1 * s0[0] + mnb1 * s0[1], mna1 * s1[0] + mnb1 * s1[1])


@_dev
def _flush(acc, si, h0, h1, xd0, xd1):
    """A block's integer sums si (S0..3, M0..3) into the float accumulators: xd * (d S - dmin M)."""
    dm0 = ptx.unpack_half2(h0[0])
    dm1 = ptx.unpack_half2(h1[0])
    acc[0] += xd0 * (dm0[0] * float32(si[0]) - dm0[1] * float32(si[4]))
    acc[1] += xd1 * (dm0[0] * float32(si[1]) - dm0[1] * float32(si[5]))
    acc[2] += xd0 * (dm1[0] * float32(si[2]) - dm1[1] * float32(si[6]))
    acc[3] += xd1 * (dm1[0] * float32(si[3]) - dm1[1] * float32(si[7]))
    for k in range(8):
        si[k] = int32(0)


@functools.lru_cache(maxsize=None)
def mma_q4k_q8k_kernel(KSPLIT: int = 4):
    """y[t, r] = sum_c W[r, c] x[t, c] (+ res[t, r]) for t < n_tok <= 8, x as q8_K; grid
    ceil(rows / 16) blocks of 32 * KSPLIT threads. Arguments: wa, wb, nu, rows (the Q4_K GEMV
    planes), xq (uint32 words of int8 [n_tok * cols]; both read 8 bytes at a time), xd (float32 [n_tok * cols / 256]), xb
    (int32 [n_tok * cols / 32]), cols, n_tok, y (float32 [n_tok * rows]), res, resid."""
    NW = KSPLIT
    SH = KSPLIT.bit_length() - 1                     # KSPLIT is a power of two: >> for //
    finish = make_finish(NW)

    @cuda.jit
    def kernel(wa, wb, nu, rows, xq, xd, xb, cols, n_tok, y, res, resid):
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        r0 = cuda.blockIdx.x * ROWS + g
        r1 = r0 + 8
        rr0 = r0 if r0 < rows else 0                 # clamped rows: loads stay in bounds
        rr1 = r1 if r1 < rows else 0
        nblk = nu >> 3
        chunks = nblk * 4
        cpw = (chunks + NW - 1) >> SH
        c_lo = warp * cpw
        c_hi = min(c_lo + cpw, chunks)
        t0 = 2 * t
        t1 = t0 + 1
        tb = g if g < n_tok else 0                   # token of the B fragment (zeroed past n_tok)
        okb = g < n_tok
        ta = t0 if t0 < n_tok else 0                 # clamped tokens: loads stay in bounds
        tc = t1 if t1 < n_tok else 0
        acc = cuda.local.array(4, float32)           # k: row g + 8 * (k >> 1), token 2t + (k & 1)
        si = cuda.local.array(8, int32)              # the current block's S0..3, M0..3
        for k in range(4):
            acc[k] = float32(0)
        for k in range(8):
            si[k] = int32(0)
        ch = c_lo
        cur = c_lo >> 2                              # the block si belongs to
        wi0, wi1, xi = _bases(nu, rr0, rr1, t, tb, cols)
        v = _loads(wa, wb, xq, xd, xb, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols, min(ch, chunks - 1),
                   wi0, wi1, xi)
        while ch < c_hi:                             # the same trips for every lane of the warp
            v0 = _loads(wa, wb, xq, xd, xb, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols, ch, wi0, wi1, xi)
            v1 = _loads(wa, wb, xq, xd, xb, nu, nblk, rr0, rr1, t, tb, okb, ta, tc, cols,
                        min(ch + 1, c_hi - 1), wi0, wi1, xi)
            if (ch >> 2) != cur:                     # warp-uniform: the block before is done
                _flush(acc, si, v[4], v[5], v[12], v[13])
                cur = ch >> 2
            p = _dots(v0, ch & 3)
            for k in range(8):
                si[k] += p[k]
            v = v0
            if ch + 1 < c_hi:
                if ((ch + 1) >> 2) != cur:
                    _flush(acc, si, v[4], v[5], v[12], v[13])
                    cur = (ch + 1) >> 2
                p = _dots(v1, (ch + 1) & 3)
                for k in range(8):
                    si[k] += p[k]
                v = v1
            ch += 2
        if c_lo < c_hi:
            _flush(acc, si, v[4], v[5], v[12], v[13])
        finish(acc, warp, lane, r0, t0, rows, n_tok, y, res, resid)
    return kernel_cache.attach(kernel)


def gemv_mma_k(w, xq, xd, xb, y, n_tok: int, residual=None, ksplit: int = 4, stream=0) -> None:
    """y [n_tok, rows] = x W^T (+ residual) for a Q4_K GemvWeight `w` (gemv.prepare_weight, dp4a
    mode) and q8_K activations xq int8 [n_tok, cols], xd float32 [n_tok, cols / 256], xb int32
    [n_tok, cols / 32] (`quantize_q8k`); 1 <= n_tok <= 8. No allocation, no synchronization."""
    _check(w, n_tok, ksplit, "gemv_mma_k")
    rows, cols = w.rows, w.cols
    xq = _flat(xq, np.int8, n_tok * cols, "xq", "gemv_mma_k").view(np.uint32)
    wa = w.wa                                       # 8-byte loads: both must be 8-byte aligned
    for name, a in (("the weight's quants plane", wa), ("xq", xq)):
        if not ptx.SIMULATOR and a.__cuda_array_interface__["data"][0] % 8:
            raise ValueError(f"gemv_mma_k: {name} must start on an 8-byte boundary")
    xd = _flat(xd, np.float32, n_tok * cols // QK, "xd", "gemv_mma_k")
    xb = _flat(xb, np.int32, n_tok * cols // SUB, "xb", "gemv_mma_k")
    yf = _flat(y, np.float32, n_tok * rows, "y", "gemv_mma_k")
    rf = yf if residual is None else _flat(residual, np.float32, n_tok * rows, "residual", "gemv_mma_k")
    kern = mma_q4k_q8k_kernel(ksplit)
    kern[(rows + ROWS - 1) // ROWS, 32 * ksplit, stream](
        wa, w.wb, w.units, rows, xq, xd, xb, cols, n_tok, yf, rf, int(residual is not None))


SHAPES = (("attn_q", 4096, 2560), ("ffn_gate", 9728, 2560), ("attn_output", 2560, 4096), ("ffn_down", 2560, 9728))


def _bench(argv=None) -> int:
    """Time gemv_mma_k against gemv_mma and the dp4a GEMV at the 4B's Q4_K shapes, 1-8 tokens
    (GPU only); every kernel is checked against numpy before it is timed."""
    import argparse
    import json

    from . import gemv as G
    from .gemv_mma import _activations, _weight, _within, gemv_mma
    from genie_rt.engine.cuda_graph import time_us
    ap = argparse.ArgumentParser(description="gemv_mma_k (int8 tensor cores, integer epilogue) vs gemv_mma "
                                             "and the dp4a GEMV")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if ptx.SIMULATOR:
        raise SystemExit("needs a GPU")
    stream = cuda.stream()
    out = []
    for name, rows, cols in SHAPES:
        W, gw = _weight(rows, cols)
        for n_tok in (1, 2, 4, 8):
            dx, xq, xs, y, ref, bound = _activations(W, n_tok, stream)       # q8: gemv_mma and dp4a
            k8 = quantize_q8k(dx.copy_to_host())                            # q8_K: gemv_mma_k
            kx = [cuda.to_device(a) for a in k8]
            xt = dequantize_q8k(k8[0], k8[1])
            kref, kbound = G.gemv_reference(W, xt), G.error_bound(W, xt, "f32")
            row = dict(gemv=name, rows=rows, cols=cols, n_tok=n_tok)
            for ks in (2, 4, 8):
                for label, fn, r, b in (
                        (f"mmak_ks{ks}", lambda ks=ks: gemv_mma_k(gw, *kx, y, n_tok, ksplit=ks, stream=stream),
                         kref, kbound),
                        (f"mma_ks{ks}", lambda ks=ks: gemv_mma(gw, xq, xs, y, n_tok, ksplit=ks, stream=stream),
                         ref, bound)):
                    fn()
                    stream.synchronize()
                    row[f"{label}_ok"] = ok = _within(y, r, b)
                    if ok:
                        row[f"{label}_us"] = time_us(fn, stream)
            G.gemv(gw, dx, y, xq=xq, xs=xs, stream=stream)
            row["dp4a_us"] = time_us(lambda: G.gemv(gw, dx, y, xq=xq, xs=xs, stream=stream), stream)
            print(row, flush=True)
            out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(v for r in out for k, v in r.items() if k.endswith("_ok")) else 1


if __name__ == "__main__":      # python -m genie_rt.quant.gemv_mma_k [--json PATH]
    raise SystemExit(_bench())
