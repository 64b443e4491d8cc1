"""MMQ variant v2: int8 tensor cores (mma.m16n8k32.s8) with q8_1-style activations, Q4_K.

What changes against v1 (the package kernel, quant/mmq_kernels.py: fp16 mma, weights
dequantized to fp16 in registers):
- X is quantized per 32 values to int8 (x ~ dx * qx, round to nearest) with dx and
  sx = dx * sum(qx) per block (llama.cpp's q8_1), by `prepare_x_q8`; natural order.
- weights stay integers: a Q4_K nibble word becomes an s8 fragment with one AND
  (`w & 0x0F0F0F0F`); the mma runs on k32 = one Q4_K sub-block.
- after every k32 mma each lane rescales its 4 int32 results:
      acc += float(D) * (s_row * dx_tok) - m_row * sx_tok
  (s = d*sc, m = dmin*mn of the row's sub-block): 4 I2F + 4 FMUL + 8 FFMA per mma.
Same staging (cp.async ring of 128-weight stages, raw Q4_K rows in shared memory, a
block-wide scale decode per stage), same 128-row tiles; "store" epilogue only, no
split-K: enough to compare the arithmetic of the two designs at N = 33 and 512.

Error: q8 rounding of X (|err| <= dx/2 per value, ~2^-8 relative) dominates;
`q8_error_bound` states it. Self-test and benchmark: tools/mmq_variants/bench_variants.py.
"""
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.quant import mmq_defs as D
from genie_rt.quant.mmq_defs import U, _inline, _wait_group
from genie_rt.quant.ptx import (cp_async16_zfill, cp_async_commit, f16_bits_to_f32,
                                ldmatrix_x4, mma_s8_s32)

XW8 = 36          # words per token per stage: 128 int8 = 32 words + 16 B pad (ldmatrix rows 144 B apart)
XSW = 12          # words per token per stage of block scales: 4 dx, (pad), 4 sx; 48 B stride
RAW_W = 20        # Q4_K raw words per row per stage (as v1)
SCW8 = 9          # scale table: 4 sub-blocks x (s, m) float32 + 1 pad


def smem_bytes(wm, mt, nt, stages):
    bm, bn = 16 * mt * wm, 8 * nt
    return 4 * (stages * (bm * RAW_W + bn * XW8 + bn * XSW) + 2 * bm * SCW8)


# =====================================================================================
# prepare_x_q8: float32 -> int8 per-32 blocks + (dx, sx) per block
# =====================================================================================
@cuda.jit
def mma_s8_peak_kernel(out, iters):
    """Each warp runs 8 independent m16n8k32 s8 accumulator chains for `iters` rounds."""
    lane = uint32(cuda.threadIdx.x) & U(31)
    a0 = lane * U(0x01010101)
    a1 = a0 ^ U(0x00010000)
    acc = cuda.local.array((8, 4), int32)
    for c in range(8):
        for e in range(4):
            acc[c, e] = int32(0)
    for _ in range(iters):
        for c in range(8):
            r = mma_s8_s32(a0, a1, a0, a1, a1, a0, acc[c, 0], acc[c, 1], acc[c, 2], acc[c, 3])
            acc[c, 0] = r[0]
            acc[c, 1] = r[1]
            acc[c, 2] = r[2]
            acc[c, 3] = r[3]
    s = int32(0)
    for c in range(8):
        for e in range(4):
            s += acc[c, e]
    out[cuda.grid(1)] = s


@cuda.jit
def prepare_x_q8_kernel(x, q, dx, sx, nblk):
    """x float32 [N, cols]; q uint32 [N, cols/4] (int8 x4, natural order);
    dx, sx float32 [N, cols/32]: x ~ dx * q, sx = dx * sum(q) over the block."""
    row = cuda.blockIdx.x
    b = cuda.threadIdx.x
    while b < nblk:
        amax = float32(0.0)
        for k in range(32):
            amax = max(amax, abs(x[row, 32 * b + k]))
        d = amax / float32(127.0)
        inv = float32(0.0) if d == float32(0.0) else float32(1.0) / d
        s = int32(0)
        for w in range(8):
            word = uint32(0)
            for e in range(4):
                v = int32(math.floor(x[row, 32 * b + 4 * w + e] * inv + float32(0.5)))
                s += v
                word |= uint32(v & 0xFF) << uint32(8 * e)
            q[row, 8 * b + w] = word
        dx[row, b] = d
        sx[row, b] = d * float32(s)
        b += cuda.blockDim.x


def prepare_x_q8_host(x):
    """numpy twin of prepare_x_q8_kernel: (q int8 [N, cols], dx, sx float32 [N, cols/32])."""
    n, cols = x.shape
    xb = x.reshape(n, cols // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=2) / np.float32(127.0)).astype(np.float32)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.floor(xb * inv[:, :, None] + np.float32(0.5)).astype(np.int32)
    return q.astype(np.int8).reshape(n, cols), d, (d * q.sum(axis=2)).astype(np.float32)


def q8_error_bound(wd, x):
    """Bound on |y - x @ wd.T| for q8 activations: sum over blocks of dx/2 * sum |w|,
    plus float32 accumulation (wd: float64 [rows, cols] dequantized weights)."""
    n, cols = x.shape
    _, d, _ = prepare_x_q8_host(x)
    half = np.repeat(d.astype(np.float64) / 2, 32, axis=1)           # [N, cols]
    aw = np.abs(wd)
    return (half + np.abs(x) * 2.0 ** -20) @ aw.T + 1e-30


# =====================================================================================
# The s8 GEMM kernel
# =====================================================================================
def build_s8_kernel(wm, mt, nt, stages):
    """kernel(qs, hdr, xq, dx, sx, y, n_tok, rows, n_stages): Y = X W^T, Q4_K, "store".
    xq uint8 [N, cols] (int8 bits), dx/sx float32 [N, cols/32], y float32 [N, rows].
    Warps side by side over rows (wn = 1): warp = 16 mt rows x 8 nt tokens.
    grid (ceil(rows/BM), ceil(N/BN)), block 32*wm, dynamic smem smem_bytes(...)."""
    assert nt % 2 == 0
    NTH = 32 * wm
    BM, BN = 16 * mt * wm, 8 * nt
    PER_T = BM * 4 // NTH
    assert PER_T * NTH == BM * 4
    RAW_STAGE = BM * RAW_W
    X_OFF = stages * RAW_STAGE
    XS_OFF = X_OFF + stages * BN * XW8
    SC_OFF = XS_OFF + stages * BN * XSW
    uBM, uBN, uNTH = U(BM), U(BN), U(NTH)
    wait_group = _wait_group(stages)

    @_inline
    def load_stage(smem, qs, hdr, xq, dxa, sxa, st, buf, m0, n0, n_tok, rows, tid):
        c = tid
        while c < uBM * U(5):
            lr = c // U(5)
            part = c - lr * U(5)
            row = m0 + lr
            nb = U(16)
            if row >= rows:
                row = U(0)
                nb = U(0)
            dst = buf * U(RAW_STAGE) + lr * U(RAW_W) + part * U(4)
            if part < U(4):
                cp_async16_zfill(smem, dst, qs, (row, st * U(64) + part * U(16)), nb)
            else:
                cp_async16_zfill(smem, dst, hdr, (row, (st >> U(1)) * U(16)), nb)
            c += uNTH
        c = tid
        while c < uBN * U(10):                     # 8 chunks of int8 + dx + sx per token
            tk = c // U(10)
            part = c - tk * U(10)
            tok = n0 + tk
            nb = U(16)
            if tok >= n_tok:
                tok = U(0)
                nb = U(0)
            if part < U(8):
                cp_async16_zfill(smem, U(X_OFF) + buf * uBN * U(XW8) + tk * U(XW8) + part * U(4),
                                 xq, (tok, st * U(128) + part * U(16)), nb)
            elif part == U(8):
                cp_async16_zfill(smem, U(XS_OFF) + buf * uBN * U(XSW) + tk * U(XSW),
                                 dxa, (tok, st * U(4)), nb)
            else:
                cp_async16_zfill(smem, U(XS_OFF) + buf * uBN * U(XSW) + tk * U(XSW) + U(8),
                                 sxa, (tok, st * U(4)), nb)
            c += uNTH

    @_inline
    def decode(smem, smf, st, buf, scbuf, tid):
        h = st & U(1)
        for k in range(PER_T):
            e = tid + U(k) * uNTH
            lr = e >> U(2)
            ent = e & U(3)
            row = buf * U(RAW_STAGE) + lr * U(RAW_W)
            w0 = smem[row + U(16)]
            d = f16_bits_to_f32(w0 & U(0xFFFF))
            dmin = f16_bits_to_f32(w0 >> U(16))
            j = h * U(4) + ent
            if j < U(4):
                sc = (smem[row + U(17) + (j >> U(2))] >> (U(8) * (j & U(3)))) & U(63)
                jm = j + U(4)
                mn = (smem[row + U(17) + (jm >> U(2))] >> (U(8) * (jm & U(3)))) & U(63)
            else:
                jl = j - U(4)
                jh = j + U(4)
                bl = (smem[row + U(17) + (jl >> U(2))] >> (U(8) * (jl & U(3)))) & U(0xFF)
                bj = (smem[row + U(17) + (j >> U(2))] >> (U(8) * (j & U(3)))) & U(0xFF)
                bh = (smem[row + U(17) + (jh >> U(2))] >> (U(8) * (jh & U(3)))) & U(0xFF)
                sc = (bh & U(15)) | ((bl >> U(6)) << U(4))
                mn = (bh >> U(4)) | ((bj >> U(6)) << U(4))
            o = U(SC_OFF) + scbuf * uBM * U(SCW8) + lr * U(SCW8) + U(2) * ent
            smf[o] = d * float32(sc)
            smf[o + U(1)] = dmin * float32(mn)

    @_inline
    def subblock(smem, smf, acc, afr, bfr, rb, scb, xb, xsb, lane, g, t, cc, nib):
        # sub-block 2cc + nib of the stage = k32 step 2cc + nib: weights 64cc + 32nib + 0..31
        j_sub = U(2) * cc + nib
        for i in range(mt):
            r0 = rb + U(16 * i) * U(RAW_W) + U(8) * cc
            sh = U(4) * nib
            afr[i, 0] = (smem[r0] >> sh) & U(0x0F0F0F0F)                          # row g, k 4t..
            afr[i, 2] = (smem[r0 + U(4)] >> sh) & U(0x0F0F0F0F)                   # row g, k 16+4t..
            afr[i, 1] = (smem[r0 + U(8 * RAW_W)] >> sh) & U(0x0F0F0F0F)           # row g+8
            afr[i, 3] = (smem[r0 + U(8 * RAW_W) + U(4)] >> sh) & U(0x0F0F0F0F)
        # B: int8 rows of the stage, bytes 32 j_sub .. +31 = words 8 j_sub ..
        for jj in range(nt // 2):
            b = ldmatrix_x4(smem, xb + U(jj * 16 * XW8) + U(8) * j_sub)
            bfr[2 * jj, 0] = b[0]
            bfr[2 * jj, 1] = b[1]
            bfr[2 * jj + 1, 0] = b[2]
            bfr[2 * jj + 1, 1] = b[3]
        blk = j_sub                                  # the x block of this k32 step
        for i in range(mt):
            so = scb + U(16 * i) * U(SCW8) + U(2) * j_sub
            s_g = smf[so]
            m_g = smf[so + U(1)]
            s_8 = smf[so + U(8 * SCW8)]
            m_8 = smf[so + U(8 * SCW8) + U(1)]
            for j in range(nt):
                tok = U(8 * j) + U(2) * t
                d0 = smf[xsb + tok * U(XSW) + blk]
                d1 = smf[xsb + (tok + U(1)) * U(XSW) + blk]
                z0 = smf[xsb + tok * U(XSW) + U(8) + blk]
                z1 = smf[xsb + (tok + U(1)) * U(XSW) + U(8) + blk]
                r = mma_s8_s32(afr[i, 0], afr[i, 1], afr[i, 2], afr[i, 3], bfr[j, 0], bfr[j, 1],
                               int32(0), int32(0), int32(0), int32(0))
                acc[i, j, 0] += float32(r[0]) * (s_g * d0) - m_g * z0
                acc[i, j, 1] += float32(r[1]) * (s_g * d1) - m_g * z1
                acc[i, j, 2] += float32(r[2]) * (s_8 * d0) - m_8 * z0
                acc[i, j, 3] += float32(r[3]) * (s_8 * d1) - m_8 * z1

    @cuda.jit
    def kernel(qs, hdr, xq, dxa, sxa, y, n_tok_, rows_, n_stages_):
        smem = cuda.shared.array(0, uint32, alignment=16)
        smf = cuda.shared.array(0, float32, alignment=16)
        tid = uint32(cuda.threadIdx.x) & U(NTH - 1)
        lane = tid & U(31)
        warp = tid >> U(5)
        g = lane >> U(2)
        t = lane & U(3)
        n_tok = uint32(n_tok_)
        rows = uint32(rows_)
        n_stages = uint32(n_stages_)
        m0 = uint32(cuda.blockIdx.x) * uBM
        n0 = uint32(cuda.blockIdx.y) * uBN
        wrow0 = warp * U(16 * mt)
        xrow_lane = ((lane & U(7)) + ((lane >> U(4)) << U(3))) * U(XW8) + ((lane >> U(3)) & U(1)) * U(4)
        for s in range(stages - 1):
            if U(s) < n_stages:
                load_stage(smem, qs, hdr, xq, dxa, sxa, U(s), U(s), m0, n0, n_tok, rows, tid)
            cp_async_commit()
        acc = cuda.local.array((mt, nt, 4), float32)
        for i in range(mt):
            for j in range(nt):
                for e in range(4):
                    acc[i, j, e] = float32(0.0)
        afr = cuda.local.array((mt, 4), uint32)
        bfr = cuda.local.array((nt, 2), uint32)
        buf = U(0)
        st = U(0)
        while st < n_stages:
            wait_group()
            cuda.syncthreads()
            nxt = st + U(stages - 1)
            nbuf = buf + U(stages - 1)
            if nbuf >= U(stages):
                nbuf -= U(stages)
            if nxt < n_stages:
                load_stage(smem, qs, hdr, xq, dxa, sxa, nxt, nbuf, m0, n0, n_tok, rows, tid)
            cp_async_commit()
            scbuf = st & U(1)
            decode(smem, smf, st, buf, scbuf, tid)
            cuda.syncthreads()
            rb = buf * U(RAW_STAGE) + (wrow0 + g) * U(RAW_W) + t
            scb = U(SC_OFF) + scbuf * uBM * U(SCW8) + (wrow0 + g) * U(SCW8)
            xb = U(X_OFF) + buf * uBN * U(XW8) + xrow_lane
            xsb = U(XS_OFF) + buf * uBN * U(XSW)
            subblock(smem, smf, acc, afr, bfr, rb, scb, xb, xsb, lane, g, t, U(0), U(0))
            subblock(smem, smf, acc, afr, bfr, rb, scb, xb, xsb, lane, g, t, U(0), U(1))
            subblock(smem, smf, acc, afr, bfr, rb, scb, xb, xsb, lane, g, t, U(1), U(0))
            subblock(smem, smf, acc, afr, bfr, rb, scb, xb, xsb, lane, g, t, U(1), U(1))
            buf += U(1)
            if buf == U(stages):
                buf = U(0)
            st += U(1)
        for i in range(mt):
            for j in range(nt):
                for e in range(4):
                    row = m0 + wrow0 + U(16 * i + 8 * (e >> 1)) + g
                    tok = n0 + U(8 * j + (e & 1)) + U(2) * t
                    if row < rows and tok < n_tok:
                        y[tok, row] = acc[i, j, e]

    kernel.meta = dict(bm=BM, bn=BN, threads=NTH, smem=smem_bytes(wm, mt, nt, stages))
    return kernel


SIGNATURE = ("void(uint8[:, ::1], uint8[:, ::1], uint8[:, ::1], float32[:, ::1], float32[:, ::1], "
             "float32[:, ::1], int64, int64, int64)")
PREP_SIGNATURE = "void(float32[:, ::1], uint32[:, ::1], float32[:, ::1], float32[:, ::1], int64)"


def launch(kern, w, xq, dx, sx, y, stream=0):
    """Y = X W^T (store) with the q8 activations of prepare_x_q8; no checks (a variant)."""
    n = xq.shape[0]
    grid = (-(-w.rows // kern.meta["bm"]), -(-n // kern.meta["bn"]))
    kern[grid, kern.meta["threads"], stream, kern.meta["smem"]](
        w.planes["qs"], w.planes["hdr"], xq, dx, sx, y, n, w.rows, w.cols // D.STAGE_K)
