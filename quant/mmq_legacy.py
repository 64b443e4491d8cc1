"""MMQ for the 32-weight formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 at any K that is a
multiple of 32 (Gemma 3 270M's 640, SmolLM2's 576), as device-function factories that
`mmq_kernels.build_mmq_kernel` plugs into its pipeline. Read mmq_kernels.py first: the
stage ring, the MMQ order of X and the fragment layout are the same.

What differs from the k-quant path:
- a stage is 128 weights = 4 blocks of a row. Only the bulk quants (qs: 16 B a block,
  Q8_0 32 B) go through cp.async; they are 16-byte aligned at every K. The small fields
  (fp16 d, the uint32 dm = d | m << 16 of Q4_1/Q5_1, the uint32 qh of Q5_0/Q5_1) sit in
  rows of 2 or 4 bytes a block, which are only 4-byte aligned when the block count is not
  a multiple of 8. They are read with scalar global loads by the threads that build the
  scale table, one stage ahead (`prefetch`: issued before the current stage's decode, used
  one stage later, so their latency hides behind a stage of mma work).
- K need not be a whole number of stages: in the last stage the chunks past the row end
  are zero-filled (cp.async with 0 source bytes) and their blocks get d = m = 0, so they
  add exactly 0 (X past the row is zero-filled too).
- the scale table holds per row and block: d2 = (d, d) fp16x2, then m2 = (m, m) for
  Q4_1/Q5_1, then the qh word for Q5_0/Q5_1.

Dequantization into mma fragments (lane t of a quad, MMQ order: a fragment register holds
weights 4t, 4t+2 (a0/a1) or 4t+1, 4t+3 (a2/a3) of a k16 group):
    4-bit: block b's 16 qs bytes are 4 words; word t holds weights 4t..4t+3 (low nibbles,
           k16 group 2b) and 16+4t..16+4t+3 (high nibbles, group 2b + 1)
    Q5:    plus bit j of qh = 5th bit of weight j, moved to bit 4 of its half
    Q8_0:  block b is 8 words; word t holds weights 4t..4t+3 (group 2b), word t + 4 group 2b+1
    w16 = fp16((1024 + u) - (1024 + OFF)) * d + m    (u unsigned; the first result is exact)
with OFF = 8 (Q4_0), 16 (Q5_0), 128 (Q8_0, the int8 biased by 128), 0 (Q4_1, Q5_1; m added).

The numpy reference and the error bound are mmq_reference.py's (dequantize, then a float64
GEMM).
"""
import numpy as np
from numba import cuda, uint32

from .ptx import SIMULATOR, cp_async16_zfill, hfma2

U = np.uint32

# Format codes, after mmq_kquants' Q4_K = 0, Q6_K = 1, Q8_0 = 2 (its Q8_0 needs K % 256 == 0)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0L = 3, 4, 5, 6, 7
LEGACY = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0L)
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0L: "Q8_0"}
HAS_MIN = (Q4_1, Q5_1)
HAS_QH = (Q5_0, Q5_1)
# raw 16-byte chunks per row per stage: qs 64 B (+ 16 B pad: row stride 20 words puts
# the 8 rows of a warp in distinct banks, as Q4_K's 80-byte rows) or Q8_0's 128 B (+ 16)
RAW_CHUNKS = {Q4_0: 5, Q4_1: 5, Q5_0: 5, Q5_1: 5, Q8_0L: 9}
QS_LOG2_CHUNKS = {Q4_0: 2, Q4_1: 2, Q5_0: 2, Q5_1: 2, Q8_0L: 3}
ENTRY_WORDS = {Q4_0: 1, Q4_1: 2, Q5_0: 2, Q5_1: 3, Q8_0L: 1}
SC_WORDS = {Q4_0: 5, Q4_1: 10, Q5_0: 10, Q5_1: 13, Q8_0L: 5}   # 4 entries + pad (distinct banks)
SC_ENTRIES = 4                                                  # blocks per stage


def _f16x2(v):
    h = int(np.array([v], np.float16).view(np.uint16)[0])
    return U(h | (h << 16))


ONE2 = _f16x2(1.0)
MAGIC = U(0x64006400)
NEG_OFF = {Q4_0: _f16x2(-1032.0), Q4_1: _f16x2(-1024.0), Q5_0: _f16x2(-1040.0),
           Q5_1: _f16x2(-1024.0), Q8_0L: _f16x2(-1152.0)}

_inline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def make_row_loader(log2_chunks, NTH, BM, uRW, weight_row):
    """load(smem, p0, rb, st, m0, rows_out, tid): stage st's 2^log2_chunks 16-byte chunks of
    every staged row of the uint8 plane p0 (row bytes: p0.shape[1]) to smem words rb + lr * uRW
    (cp.async); chunks past the row end and rows past the matrix are zero-filled. Shared by the
    32-weight formats' qs and the float formats' weights (mmq_float.py)."""
    LOG2 = U(log2_chunks)
    uNTH, uBM = U(NTH), U(BM)

    @_inline
    def load_qs(smem, p0, rb, st, m0, rows_out, tid):
        row_bytes = uint32(p0.shape[1])
        col0 = st << (LOG2 + U(4))                       # byte of the stage in the plane row
        c = tid
        while c < (uBM << LOG2):
            lr = c >> LOG2
            part = c & ((U(1) << LOG2) - U(1))
            row, ok = weight_row(lr, m0, rows_out)
            col = col0 + part * U(16)
            nbytes = U(16)
            if not ok or col >= row_bytes:
                row = U(0)                               # keep the address valid; copy 0 bytes
                col = U(0)
                nbytes = U(0)
            cp_async16_zfill(smem, rb + lr * uRW + part * U(4), p0, (row, col), nbytes)
            c += uNTH

    return load_qs


def make(fmt, mt, NTH, PER_T, uRW, uSCW, uRAW_STAGE, uSC_OFF, uSC_BUF, weight_row, mma_group):
    """Device functions of format `fmt` for a kernel of these constants (see build_mmq_kernel):
    (load_qs, prefetch, decode, compute)."""
    assert fmt in LEGACY
    EW = U(ENTRY_WORDS[fmt])
    uNTH = U(NTH)
    has_min, has_qh, q8 = fmt in HAS_MIN, fmt in HAS_QH, fmt == Q8_0L
    NEG = NEG_OFF[fmt]

    load_qs = make_row_loader(QS_LOG2_CHUNKS[fmt], NTH, NTH * PER_T // SC_ENTRIES, uRW, weight_row)

    @_inline
    def prefetch(p1, p2, pf, st, m0, rows_out, tid):
        """pf[k, 0..1] = (d bits or dm, qh) of the blocks this thread decodes in stage st
        (0 past the matrix: the block adds nothing)."""
        nb = uint32(p1.shape[1])
        for k in range(PER_T):
            e = tid + U(k) * uNTH
            lr = e >> U(2)
            blk = st * U(4) + (e & U(3))
            row, ok = weight_row(lr, m0, rows_out)
            a = U(0)
            b = U(0)
            if ok and blk < nb:
                a = uint32(p1[row, blk])                 # dm, or d's fp16 bits (uint16 plane)
                if has_qh:
                    b = uint32(p2[row, blk])
            pf[k, 0] = a
            pf[k, 1] = b

    @_inline
    def decode(smem, pf, scbuf, tid):
        """The scale table of the stage: per row and block d2 [, m2] [, qh]."""
        scb = uSC_OFF + scbuf * uSC_BUF
        for k in range(PER_T):
            e = tid + U(k) * uNTH
            lr = e >> U(2)
            o = scb + lr * uSCW + (e & U(3)) * EW
            a = pf[k, 0]
            if has_min:                                  # dm = d | m << 16: split into d2, m2
                smem[o] = (a & U(0xFFFF)) | (a << U(16))
                smem[o + U(1)] = (a >> U(16)) | (a & U(0xFFFF0000))
                if has_qh:
                    smem[o + U(2)] = pf[k, 1]
            else:
                smem[o] = a | (a << U(16))
                if has_qh:
                    smem[o + U(1)] = pf[k, 1]

    @_inline
    def frags(afr, wq, scl, sh, hb):
        # wq (mt, 2) words of rows g / g+8, shifted by sh; scl (mt, 4) = d2 g, m2 g, d2 g+8,
        # m2 g+8; hb (mt, 2) the 5th bits already at bits 4 / 20 (zero for 4-bit formats)
        for i in range(mt):
            wg = wq[i, 0] >> sh
            w8 = wq[i, 1] >> sh
            afr[i, 0] = hfma2(hfma2((wg & U(0x000F000F)) | hb[i, 0] | MAGIC, ONE2, NEG), scl[i, 0], scl[i, 1])
            afr[i, 2] = hfma2(hfma2(((wg >> U(8)) & U(0x000F000F)) | hb[i, 1] | MAGIC, ONE2, NEG),
                              scl[i, 0], scl[i, 1])
            afr[i, 1] = hfma2(hfma2((w8 & U(0x000F000F)) | hb[i, 2] | MAGIC, ONE2, NEG), scl[i, 2], scl[i, 3])
            afr[i, 3] = hfma2(hfma2(((w8 >> U(8)) & U(0x000F000F)) | hb[i, 3] | MAGIC, ONE2, NEG),
                              scl[i, 2], scl[i, 3])

    @_inline
    def fifth_bits(hb, qw, i, j, t4):
        # qh bits 4t..4t+3 (+16 for the high half) of one row -> bit 4 / 20 of the fragment
        # halves: weights 4t, 4t+2 (a0) and 4t+1, 4t+3 (a2)
        v = qw >> t4
        hb[i, j] = ((v & U(1)) << U(4)) | ((v & U(4)) << U(18))
        hb[i, j + 1] = ((v & U(2)) << U(3)) | ((v & U(8)) << U(17))

    @_inline
    def block4(smem, acc, afr, wq, scl, hb, rb, scb, xrow, b, t):
        # block b (0..3) of the stage, 4-bit formats: k16 groups 2b (low nibbles) and 2b + 1
        for i in range(mt):
            r0 = rb + U(16 * i) * uRW + U(4) * b
            wq[i, 0] = smem[r0]
            wq[i, 1] = smem[r0 + U(8) * uRW]
            s0 = scb + U(16 * i) * uSCW + b * EW
            scl[i, 0] = smem[s0]
            scl[i, 2] = smem[s0 + U(8) * uSCW]
            if has_min:
                scl[i, 1] = smem[s0 + U(1)]
                scl[i, 3] = smem[s0 + U(8) * uSCW + U(1)]
            else:
                scl[i, 1] = U(0)
                scl[i, 3] = U(0)
        for half in range(2):
            for i in range(mt):
                if has_qh:
                    s0 = scb + U(16 * i) * uSCW + b * EW + EW - U(1)
                    fifth_bits(hb, smem[s0], i, 0, t * U(4) + U(16 * half))
                    fifth_bits(hb, smem[s0 + U(8) * uSCW], i, 2, t * U(4) + U(16 * half))
                else:
                    hb[i, 0] = U(0)
                    hb[i, 1] = U(0)
                    hb[i, 2] = U(0)
                    hb[i, 3] = U(0)
            frags(afr, wq, scl, U(4 * half), hb)
            mma_group(smem, acc, afr, xrow, U(2) * b + U(half))

    @_inline
    def block8(smem, acc, afr, scl, rb, scb, xrow, b):
        # block b of the stage, Q8_0: words 8b + t (group 2b) and 8b + 4 + t (group 2b + 1)
        for i in range(mt):
            s0 = scb + U(16 * i) * uSCW + b
            scl[i, 0] = smem[s0]
            scl[i, 1] = smem[s0 + U(8) * uSCW]
        for hh in range(2):
            grp = U(2) * b + U(hh)
            for i in range(mt):
                r0 = rb + U(16 * i) * uRW + U(4) * grp
                ug = smem[r0] ^ U(0x80808080)            # int8 -> biased uint8 (q + 128)
                u8 = smem[r0 + U(8) * uRW] ^ U(0x80808080)
                afr[i, 0] = hfma2(hfma2((ug & U(0x00FF00FF)) | MAGIC, ONE2, NEG), scl[i, 0], U(0))
                afr[i, 2] = hfma2(hfma2(((ug >> U(8)) & U(0x00FF00FF)) | MAGIC, ONE2, NEG), scl[i, 0], U(0))
                afr[i, 1] = hfma2(hfma2((u8 & U(0x00FF00FF)) | MAGIC, ONE2, NEG), scl[i, 1], U(0))
                afr[i, 3] = hfma2(hfma2(((u8 >> U(8)) & U(0x00FF00FF)) | MAGIC, ONE2, NEG), scl[i, 1], U(0))
            mma_group(smem, acc, afr, xrow, grp)

    @_inline
    def compute(smem, acc, buf, scbuf, wrow0, g, t, xrow):
        rb = buf * uRAW_STAGE + (wrow0 + g) * uRW + t    # this lane's word in row g, m-tile 0
        scb = uSC_OFF + scbuf * uSC_BUF + (wrow0 + g) * uSCW
        afr = cuda.local.array((mt, 4), uint32)
        if q8:
            scl = cuda.local.array((mt, 2), uint32)
            block8(smem, acc, afr, scl, rb, scb, xrow, U(0))
            block8(smem, acc, afr, scl, rb, scb, xrow, U(1))
            block8(smem, acc, afr, scl, rb, scb, xrow, U(2))
            block8(smem, acc, afr, scl, rb, scb, xrow, U(3))
        else:
            wq = cuda.local.array((mt, 2), uint32)
            scl = cuda.local.array((mt, 4), uint32)
            hb = cuda.local.array((mt, 4), uint32)
            block4(smem, acc, afr, wq, scl, hb, rb, scb, xrow, U(0), t)
            block4(smem, acc, afr, wq, scl, hb, rb, scb, xrow, U(1), t)
            block4(smem, acc, afr, wq, scl, hb, rb, scb, xrow, U(2), t)
            block4(smem, acc, afr, wq, scl, hb, rb, scb, xrow, U(3), t)

    return load_qs, prefetch, decode, compute

