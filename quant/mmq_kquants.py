"""MMQ for the k-quants Q4_K, Q5_K, Q6_K and for Q8_0 at K a multiple of 256: their format
codes, stage geometry and the device-function factory that `mmq_kernels.build_mmq_kernel`
plugs into its pipeline. Read mmq_kernels.py first: the stage ring, the MMQ order of X and
the fragment layout are the same for every format (the 32-weight formats are in
mmq_legacy.py, F16 / BF16 in mmq_float.py).

A stage is 128 weights: half a k-quant super-block, four Q8_0 blocks. Its raw bytes go to
shared memory with cp.async (`load_plane`); the block then turns the stage's packed
sub-block scales into a table of fp16x2 (scale, -min) pairs, one entry per row per
sub-block (`decode_scales`; Q6_K's super-block d comes from global memory, a super-block
ahead: `load_d6`); and each warp dequantizes ITS OWN mma A fragments in registers from
the raw words (`q4k_chunk`, `q6k_half`, `q8_block`):

    nibble (or 6-bit u, or the int8 biased by 128) -> OR into the exponent of fp16 1024
    -> minus 1024 (+ the format's offset): q exactly -> q * s - m     (2 fp16x2 FMAs per
    pair of weights; the scale table holds s and -m as fp16x2)

Q5_K is Q4_K plus the qh plane of fifth bits: Q4_K's code paths with a fifth bit.
"""
import numpy as np
from numba import cuda, float32, int32

from .ptx import SIMULATOR, cp_async16_zfill, f16_bits_to_f32, hfma2, pack_half2

U = np.uint32

# Formats (plane order of the kernel arguments p0..p3; unused slots get a dummy plane).
# Q5_K (8) is Q4_K plus the qh plane of 5th bits: Q4_K's code paths with a fifth bit.
Q4_K, Q6_K, Q8_0, Q5_K = 0, 1, 2, 8
KQ45 = (Q4_K, Q5_K)                # the formats with Q4_K's header (d, dmin, packed scales/mins)
NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K", Q8_0: "Q8_0", Q5_K: "Q5_K"}
# Raw bytes of one weight row for one stage, in 16-byte chunks (what cp.async moves):
#   Q4_K: qs 64 B (4 chunks) + header 16 B (d, dmin, 12 packed 6-bit scales/mins)
#   Q6_K: ql 64 B (4) + qh 32 B (2) + sc 16 B (1)       (d comes from global: load_d6)
#   Q8_0: qs 128 B (8) + d of the super-block's 8 blocks 16 B (1)
#   Q5_K: as Q4_K (qs words 0-15, header 16-19) + the super-block's qh 32 B (2): words 20-27
RAW_CHUNKS = {Q4_K: 5, Q6_K: 7, Q8_0: 9, Q5_K: 7}
# Row strides 80 / 112 / 144 bytes = 20 / 28 / 36 words: the 8 rows g = 0..7 that a warp
# reads at once start in banks 20g / 28g / 36g mod 32, all different multiples of 4, so
# the quad's 4 words (t = 0..3) never collide: conflict-free without padding.
# Scale table: words per row per stage (entries: Q4_K 4 sub-blocks x (scale2, -min2);
# Q6_K 8 sub-blocks x scale2; Q8_0 4 blocks x scale2), padded to an odd/even stride
# that spreads the 8 rows of a warp over distinct banks.
SC_WORDS = {Q4_K: 10, Q6_K: 9, Q8_0: 5, Q5_K: 10}
SC_ENTRIES = {Q4_K: 4, Q6_K: 8, Q8_0: 4, Q5_K: 4}


def _f16x2(v):
    """uint32 of the fp16x2 (v, v)."""
    h = int(np.array([v], np.float16).view(np.uint16)[0])
    return U(h | (h << 16))


ONE2 = _f16x2(1.0)
NEG1024 = _f16x2(-1024.0)      # 0x6400 | q is the fp16 number 1024 + q  (q < 1024)
NEG1056 = _f16x2(-1056.0)      # Q6_K: 1024 + 6-bit u, minus the 32 offset
NEG1152 = _f16x2(-1152.0)      # Q8_0: 1024 + (q + 128), the int8 quant biased by 128
ZERO2 = U(0)
MAGIC = U(0x64006400)

# Device functions are inlined at the NVVM level: the accumulators and fragments they
# update are local arrays, which only become registers once everything is one function.
_inline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def make(fmt, mt, NTH, BM, PER_T, uRW, uSCW, uSCE, uRAW_STAGE, uSC_OFF, uSC_BUF, weight_row, mma_group):
    """Device functions of format `fmt` for a kernel of these constants (see build_mmq_kernel):
    (load_plane, decode_scales, load_d6, q4k_chunk, q6k_half, q8_block). Built for every
    format; the kernel's branches that call them are pruned unless fmt is one of this
    file's."""
    KQ = fmt in KQ45                       # Q4_K's header and nibbles (Q5_K: + a fifth bit)
    Q5 = fmt == Q5_K
    uNTH, uBM = U(NTH), U(BM)

    @_inline
    def load_plane(smem, plane, rb, word_off, log2_chunks, col0, elems16, m0, rows_out, tid):
        # 2^log2_chunks 16-byte chunks of every staged row, from element col0 of the plane
        # row, to word word_off of the smem row. One plane per loop: no divergence, and
        # consecutive threads copy consecutive 16-byte pieces of a row (coalesced).
        c = tid
        while c < (uBM << log2_chunks):
            lr = c >> log2_chunks
            part = c & ((U(1) << log2_chunks) - U(1))
            row, ok = weight_row(lr, m0, rows_out)
            nbytes = U(16)
            if not ok:
                row = U(0)                               # keep the address valid; copy 0 bytes
                nbytes = U(0)
            cp_async16_zfill(smem, rb + lr * uRW + word_off + part * U(4), plane,
                             (row, col0 + part * elems16), nbytes)
            c += uNTH

    # ---- scale decode: packed sub-block scales of the stage -> fp16x2 table ----------
    @_inline
    def decode_scales(smem, st, buf, scbuf, tid, dq6):
        rb = buf * uRAW_STAGE
        scb = uSC_OFF + scbuf * uSC_BUF
        h = st & U(1)                                    # which half of the super-block
        for k in range(PER_T):
            e = tid + U(k) * uNTH
            lr = e // uSCE
            ent = e - lr * uSCE
            row = rb + lr * uRW
            if KQ:
                # header words: [d | dmin << 16], then the 12 scale bytes S[0..11]
                w0 = smem[row + U(16)]
                d = f16_bits_to_f32(w0 & U(0xFFFF))
                dmin = f16_bits_to_f32(w0 >> U(16))
                j = h * U(4) + ent                       # sub-block 0..7 of the super-block
                if j < U(4):
                    sc = (smem[row + U(17) + (j >> U(2))] >> (U(8) * (j & U(3)))) & U(63)
                    jm = j + U(4)
                    mn = (smem[row + U(17) + (jm >> U(2))] >> (U(8) * (jm & U(3)))) & U(63)
                else:
                    jl = j - U(4)                        # S[j-4] and S[j] carry bits 4-5
                    jh = j + U(4)                        # S[j+4]: low 4 bits of sc and m
                    bl = (smem[row + U(17) + (jl >> U(2))] >> (U(8) * (jl & U(3)))) & U(0xFF)
                    bj = (smem[row + U(17) + (j >> U(2))] >> (U(8) * (j & U(3)))) & U(0xFF)
                    bh = (smem[row + U(17) + (jh >> U(2))] >> (U(8) * (jh & U(3)))) & U(0xFF)
                    sc = (bh & U(15)) | ((bl >> U(6)) << U(4))
                    mn = (bh >> U(4)) | ((bj >> U(6)) << U(4))
                s = d * float32(sc)                      # llama.cpp: (d * sc) * q - (dmin * m)
                mm = dmin * float32(mn)
                smem[scb + lr * uSCW + U(2) * ent] = pack_half2(s, s)
                smem[scb + lr * uSCW + U(2) * ent + U(1)] = pack_half2(-mm, -mm)
            elif fmt == Q6_K:
                j = h * U(8) + ent                       # 16-weight sub-block 0..15
                b = (smem[row + U(24) + (j >> U(2))] >> (U(8) * (j & U(3)))) & U(0xFF)
                v = int32(b ^ U(0x80)) - int32(128)      # int8 scale
                s = dq6[k] * float32(v)
                smem[scb + lr * uSCW + ent] = pack_half2(s, s)
            else:
                j = h * U(4) + ent                       # block 0..7 of the super-block
                bits = (smem[row + U(32) + (j >> U(1))] >> (U(16) * (j & U(1)))) & U(0xFFFF)
                smem[scb + lr * uSCW + ent] = bits | (bits << U(16))

    @_inline
    def load_d6(p3, dq, sb, m0, rows_out, tid):
        """Q6_K super-block scales d of the rows this thread decodes (plain global loads;
        issued a whole super-block ahead of use, so the latency hides behind two stages)."""
        for k in range(PER_T):
            lr = (tid + U(k) * uNTH) // uSCE
            row, ok = weight_row(lr, m0, rows_out)
            v = float32(0.0)
            if ok:
                v = float32(p3[row, sb])
            dq[k] = v

    # The helpers below take their shifts as arguments and are called with literal
    # values: after inlining every shift is a constant, so the dequantization is pure
    # 32-bit logic (a shift by a loop variable would be typed uint64 and stay 64-bit).
    @_inline
    def q4k_frags(afr, wq, wh, scl, sh):
        # wq (mt, 2) words of rows g / g+8; scl (mt, 4) = s2 g, -m2 g, s2 g+8, -m2 g+8.
        # nibble -> fp16 1024 + q (OR into the exponent) -> q exactly -> q * s - m.
        # Q5_K: wh (mt, 2) the rows' qh words, shifted so that bit 0 of each byte is the
        # fifth bit of the low-nibble sub-block and bit 1 that of the high-nibble one; it
        # goes to bit 4 of each half (bytes 0, 2 -> a0/a1; bytes 1, 3 -> a2/a3): q < 32.
        for i in range(mt):
            wg = wq[i, 0] >> sh
            w8 = wq[i, 1] >> sh
            g0 = wg & U(0x000F000F)
            g2 = (wg >> U(8)) & U(0x000F000F)
            e0 = w8 & U(0x000F000F)
            e2 = (w8 >> U(8)) & U(0x000F000F)
            if Q5:
                hg = wh[i, 0] >> (sh >> U(2))
                h8 = wh[i, 1] >> (sh >> U(2))
                g0 |= (hg << U(4)) & U(0x00100010)
                g2 |= (hg >> U(4)) & U(0x00100010)
                e0 |= (h8 << U(4)) & U(0x00100010)
                e2 |= (h8 >> U(4)) & U(0x00100010)
            afr[i, 0] = hfma2(hfma2(g0 | MAGIC, ONE2, NEG1024), scl[i, 0], scl[i, 1])
            afr[i, 2] = hfma2(hfma2(g2 | MAGIC, ONE2, NEG1024), scl[i, 0], scl[i, 1])
            afr[i, 1] = hfma2(hfma2(e0 | MAGIC, ONE2, NEG1024), scl[i, 2], scl[i, 3])
            afr[i, 3] = hfma2(hfma2(e2 | MAGIC, ONE2, NEG1024), scl[i, 2], scl[i, 3])

    @_inline
    def q6k_frags(afr, wl, wh, scl, par, shl, shh):
        # wl (mt, 2, 2) ql words [m-tile][quarter parity][row g / g+8], wh (mt, 2) qh words,
        # scl (mt, 2) s2 of rows g / g+8. 6-bit u = low nibble | 2 high bits << 4; q = u - 32.
        for i in range(mt):
            ug = ((wl[i, par, 0] >> shl) & U(0x0F0F0F0F)) | (((wh[i, 0] >> shh) & U(0x03030303)) << U(4))
            u8 = ((wl[i, par, 1] >> shl) & U(0x0F0F0F0F)) | (((wh[i, 1] >> shh) & U(0x03030303)) << U(4))
            afr[i, 0] = hfma2(hfma2((ug & U(0x00FF00FF)) | MAGIC, ONE2, NEG1056), scl[i, 0], ZERO2)
            afr[i, 2] = hfma2(hfma2(((ug >> U(8)) & U(0x00FF00FF)) | MAGIC, ONE2, NEG1056), scl[i, 0], ZERO2)
            afr[i, 1] = hfma2(hfma2((u8 & U(0x00FF00FF)) | MAGIC, ONE2, NEG1056), scl[i, 1], ZERO2)
            afr[i, 3] = hfma2(hfma2(((u8 >> U(8)) & U(0x00FF00FF)) | MAGIC, ONE2, NEG1056), scl[i, 1], ZERO2)

    @_inline
    def q4k_words(smem, acc, afr, wq, wh, sc0, sc1, r0, rh, half, csh, xrow, grp):
        # words of rows g, g+8 at r0 (+16 rows per m-tile): groups grp (low nibbles) and
        # grp + 2 (high nibbles); Q5_K: their qh words at rh, shifted right by 4 in the odd
        # stage of a super-block (a select of constant shifts: a shift by a variable would
        # be 64-bit) and by the literal csh
        for i in range(mt):
            wq[i, 0] = smem[r0 + U(16 * i) * uRW]
            wq[i, 1] = smem[r0 + U(16 * i + 8) * uRW]
            if Q5:
                h0 = smem[rh + U(16 * i) * uRW]
                h1 = smem[rh + U(16 * i + 8) * uRW]
                if half != U(0):
                    h0 = h0 >> U(4)
                    h1 = h1 >> U(4)
                wh[i, 0] = h0 >> csh
                wh[i, 1] = h1 >> csh
        q4k_frags(afr, wq, wh, sc0, U(0))
        mma_group(smem, acc, afr, xrow, grp)
        q4k_frags(afr, wq, wh, sc1, U(4))
        mma_group(smem, acc, afr, xrow, grp + U(2))

    @_inline
    def q4k_chunk(smem, acc, afr, wq, wh, sc0, sc1, rb, scb, xrow, cc, half):
        # 32-byte chunk cc of the stage: word w holds weights 4w..4w+3 of sub-block 2cc
        # (low nibbles) and of 2cc+1 (high nibbles). Lane t takes words t (weights 0-15 of
        # each sub-block: k16 groups 4cc, 4cc+2) and t+4 (16-31: groups 4cc+1, 4cc+3).
        # Q5_K: byte l of a chunk takes its fifth bits from qh byte l (the same words t,
        # t + 4 at raw word 20), bit 2 j / 2 j + 1 for the sub-blocks 2 j, 2 j + 1 of the
        # super-block: j = 2 (stage parity: half) + cc, so the words shift by 4 half + 2 cc.
        for i in range(mt):
            s0 = scb + U(16 * i) * uSCW + U(4) * cc
            sc0[i, 0] = smem[s0]
            sc0[i, 1] = smem[s0 + U(1)]
            sc0[i, 2] = smem[s0 + U(8) * uSCW]
            sc0[i, 3] = smem[s0 + U(8) * uSCW + U(1)]
            sc1[i, 0] = smem[s0 + U(2)]
            sc1[i, 1] = smem[s0 + U(3)]
            sc1[i, 2] = smem[s0 + U(8) * uSCW + U(2)]
            sc1[i, 3] = smem[s0 + U(8) * uSCW + U(3)]
        q4k_words(smem, acc, afr, wq, wh, sc0, sc1, rb + U(8) * cc, rb + U(20), half, U(2) * cc, xrow,
                  U(4) * cc)
        q4k_words(smem, acc, afr, wq, wh, sc0, sc1, rb + U(8) * cc + U(4), rb + U(24), half, U(2) * cc,
                  xrow, U(4) * cc + U(1))

    @_inline
    def q6k_half(smem, acc, afr, wl, wh, scl, rb, scb, xrow, s):
        # weights 16s..16s+15 of each quarter q (k16 group 2q + s). Quarter q of the half
        # = nibble q >> 1 of ql words 8 (q & 1) + 0..7 and bits 2q of qh words 0..7.
        for i in range(mt):
            r0 = rb + U(16 * i) * uRW + U(4) * s
            wl[i, 0, 0] = smem[r0]
            wl[i, 1, 0] = smem[r0 + U(8)]
            wh[i, 0] = smem[r0 + U(16)]
            wl[i, 0, 1] = smem[r0 + U(8) * uRW]
            wl[i, 1, 1] = smem[r0 + U(8) * uRW + U(8)]
            wh[i, 1] = smem[r0 + U(8) * uRW + U(16)]
        for q in range(4):
            grp = U(2 * q) + s
            for i in range(mt):
                s0 = scb + U(16 * i) * uSCW + grp
                scl[i, 0] = smem[s0]
                scl[i, 1] = smem[s0 + U(8) * uSCW]
            q6k_frags(afr, wl, wh, scl, q & 1, U(4 * (q >> 1)), U(2 * q))
            mma_group(smem, acc, afr, xrow, grp)

    @_inline
    def q8_block(smem, acc, afr, scl, rb, scb, xrow, blk):
        # Q8_0 block blk of the stage (32 int8 = k16 groups 2 blk, 2 blk + 1)
        for i in range(mt):
            s0 = scb + U(16 * i) * uSCW + blk
            scl[i, 0] = smem[s0]
            scl[i, 1] = smem[s0 + U(8) * uSCW]
        for hh in range(2):
            grp = U(2) * blk + U(hh)
            for i in range(mt):
                r0 = rb + U(16 * i) * uRW + U(4) * grp
                ug = smem[r0] ^ U(0x80808080)        # int8 -> biased uint8 (q + 128)
                u8 = smem[r0 + U(8) * uRW] ^ U(0x80808080)
                afr[i, 0] = hfma2(hfma2((ug & U(0x00FF00FF)) | MAGIC, ONE2, NEG1152), scl[i, 0], ZERO2)
                afr[i, 2] = hfma2(hfma2(((ug >> U(8)) & U(0x00FF00FF)) | MAGIC, ONE2, NEG1152), scl[i, 0], ZERO2)
                afr[i, 1] = hfma2(hfma2((u8 & U(0x00FF00FF)) | MAGIC, ONE2, NEG1152), scl[i, 1], ZERO2)
                afr[i, 3] = hfma2(hfma2(((u8 >> U(8)) & U(0x00FF00FF)) | MAGIC, ONE2, NEG1152), scl[i, 1], ZERO2)
            mma_group(smem, acc, afr, xrow, grp)

    return load_plane, decode_scales, load_d6, q4k_chunk, q6k_half, q8_block
