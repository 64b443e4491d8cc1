"""The decode attention's walk on the tensor cores: scores and P x V by `mma.sync.m16n8k16`.

The third way a block can walk its rows (`decode_kernel(loop="mma")`, int8 caches; the other two
are in attention_decode_tiles.py). Its contract with the kernel is theirs, with one difference:
it leaves the block's result in shared memory itself - `s_red[warp, h * HD + d]` (each warp's
sum of p * v for head h, scaled to the block's max) and `s_m[h]`, `s_l[h]` - so the kernel skips
the row slots' shuffle tree. Why (docs/decode-journal.md 6h and 7): the FMA loops issue ~2,200 PTX
instructions a lane for 16 rows of 4 heads (two blocks of 2 heads); here one block takes the
whole GQA group (up to 8 query heads, every K/V byte read and converted once) and a 16-row chunk
of 4 heads is ~660. A warp walks its own chunks of 16 rows (U of them a trip) with its own
running softmax, like the "warp" loop.

A warp's chunk of 16 rows, lane = 4 g + t (the PTX fragment names):

  scores   S^T (16 rows x 8 heads) = K (16 rows x HD) . Q^T, HD / 16 mma k-steps. K is the A
           operand straight from the cache: lane (g, t) holds rows 2g and 2g + 1, words
           t * HD/16 .. of each (two 16-byte loads a row at HD 128); k-step j takes word
           W = t * HD/16 + j, whose four int8 values are the fragment's four k positions of
           the row (the k order inside an mma is free; q's B fragment is permuted the same).
           An int8 byte b becomes f16 1152 + b by `prmt` with 0x64 high bytes (the GEMV's
           0x6400 trick, after flipping the sign bit), then exactly b by an hfma2 (x 1 - 1152).
           (Leaving the 1152 in and subtracting 1152 * sum(q) after the mma was tried first: the
           f32 accumulator then carries 1152 * sum(q), and its rounding grows with q's mean - 5e-4
           of max |v| at a q offset of 50 in the simulator, 4x the tolerance; a review found it.)
           q is two f16 parts, hi + lo, each its own mma on the same K fragment: one f16 q (11
           bits) had 3-6 times the error of everything else here (simulator, 2026-12-05: 1.1-1.6e-3
           against 2-4e-4 at head_dim 128), so the scores are as good as a float32 q's.
           C: lane (g, t) has rows 2g, 2g + 1 of heads 2t, 2t + 1.
  softmax  s = S * k_scale (log2 domain: q is pre-scaled by log2(e) / sqrt(HD)), and
           s' = s + log2(v_scale) (v_scale clamped at VS_FLOOR): the V row's int8 scale rides in the
           exponent, so P' = 2^(s' - m') <= 1 holds p * v_scale relative to the running max m'
           of s' in f16 (a row far below the max goes subnormal or 0 there, as its p would in
           f16; the scale does not push the rest under), and l = sum 2^(s - m') (P' is that term times
           v_scale: one ex2 a score). (m', P' x V, l) is the usual flash triple with another
           reference max; the splits' merge takes it as is.
           The max of a head over the chunk: 3 shuffles; the lanes of a head share one m'.
  P x V    O^T (HD dims x 8 heads) = V^T (HD x 16 rows) . P'^T (16 rows x 8 heads), HD / 16 m-tiles.
           V is the A operand, which wants two rows' values of one dimension in a register: lane
           (g, t) loads rows 4t .. 4t + 3, bytes g * HD/8 .. + HD/8 (16 bytes at HD 128), and
           `prmt` pairs rows (4t, 4t+1), (4t+2, 4t+3) byte by byte: the transpose happens in
           registers, the cache layout is the one every other reader uses. Its f16 values are
           exact (an hfma2 takes the 1152 off). P'^T is the B operand: its lane (g, t) needs head
           g's P' of rows 4t .. 4t + 3, which the score lanes 8t + g/2 and 8t + 4 + g/2 hold
           (4 shuffles, then a select by g's parity). C: lane (g, t) holds dims
           g * HD/8 + 2mt, + 1 of heads 2t, 2t + 1 - all of its dims' accumulators for two heads.
           O is rescaled only when some head's max grew (a warp vote): alpha is exactly 1 else.

Heads 8 .. 15 of the mma's n = 8 columns do not exist (a block takes at most 8 heads); heads
GH .. 7 are zero columns of q, whose lanes compute and drop. Rows past r_end read as zeros
(no load) and score -inf.

The numbers are not the FMA loops': q and P' are rounded to f16 (11 bits), and the tensor core
sums in its own order. q * log2(e) / sqrt(HD) must fit f16 (|q| below ~5e5 at head_dim 128; a
QK-normed q is far inside), else its head's output is NaN. Tested against numpy with a tolerance (tests/test_attention_decode_mma.py),
as the "warp" loop is; the int8 K/V values themselves are exact.

EARLY (the PDL build): the first trip's rows of earlier positions are loaded before `wait(ra)`,
and the trip is loaded again, whole, if it holds the new row (attention_decode_tiles.py says
why that is safe).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32

from genie_rt.quant import ptx

from genie_rt.engine.config import DECODE_ATTENTION_LOOPS

from .attention_decode_tiles import make_block_stats, make_slot_of

FULL = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
VS_FLOOR = float32(2.0 ** -100)  # log2(v_scale) >= -100: a zero V row (scale 0) stays finite
C64 = uint32(0x64646464)         # high bytes of f16 1024 + u
SIGN = uint32(0x80808080)
LOW = uint32(0x00FF00FF)
# q as hi + lo f16 parts (2), or one f16 (1: a test shows what that loses); read when a kernel is built
Q_PARTS = 2
HI64 = uint32(0x64806480)        # 0x64 high bytes, the sign flip of the low ones
ONE2 = uint32(0x3C003C00)        # f16x2 (1, 1)
NEG2 = uint32(0xE480E480)        # f16x2 (-1152, -1152)

if ptx.SIMULATOR:
    _dev = cuda.jit(device=True)

    @cuda.jit(device=True)
    def _prmt(x, y, s):
        """__byte_perm(x, y, s): byte n of the result is byte (s >> 4n) & 7 of {y:x}."""
        src = int(x) & 0xFFFFFFFF | (int(y) & 0xFFFFFFFF) << 32
        out = 0
        for n in range(4):
            out |= ((src >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n)
        return uint32(out)
else:
    from numba.cuda import libdevice
    _dev = cuda.jit(device=True, forceinline=True)

    @cuda.jit(device=True, forceinline=True)
    def _prmt(x, y, s):
        """__byte_perm(x, y, s): one PRMT."""
        return uint32(libdevice.byte_perm(int32(x), int32(y), int32(s)))


def check_mma(kv_dtype: str, head_dim: int) -> None:
    """ValueError unless the mma loop can take this layer: an int8 cache, head_dim 32 .. 128 in
    steps of 32 (256 takes 255 registers and spills: ptxas sm_87, 2026-12-05)."""
    if kv_dtype != "int8":
        others = ", ".join(x for x in DECODE_ATTENTION_LOOPS if x != "mma")
        raise ValueError("the 'mma' decode attention loop reads int8 caches only: use the int8 KV "
                         f"cache or another loop ({others})")
    if head_dim % 32 or head_dim > 128:
        raise ValueError(f"the 'mma' decode attention loop needs head_dim a multiple of 32 up to 128, "
                         f"not {head_dim}: use the 'warp' loop")


def mma_geometry(head_dim: int, warps: int, chunks: int):
    """(KS k-steps = K words a lane holds of a row, VWD V words a lane holds of a row, CH rows a
    warp's trip, TILE rows a block's trip) of an mma build with `chunks` 16-row chunks a trip
    (a head_dim check_mma takes)."""
    return head_dim // 16, head_dim // 32, 16 * chunks, 16 * chunks * warps


def mma_tiles(head_dim, GH, warps, U, WIN, ld4, qscale, wait=None):
    """The tensor-core walk (module docstring): U chunks of 16 rows a warp's trip, the next
    trip's loads issued before this trip's arithmetic; wait (EARLY): the wait for the kernel
    before (and the rope rows), called after the first trip's loads of earlier positions.
    Shared arrays: s_mw, s_lw (NW, GH), s_red (NW, GH * HD)."""
    NQB = Q_PARTS                 # q's f16 parts (module docstring)
    QL = NQB == 2
    assert 1 <= GH <= 8, "the mma loop takes at most 8 query heads a block"
    EARLY = wait is not None
    HD, NW = head_dim, warps
    KS, VWD, CH, TILE = mma_geometry(HD, NW, U)
    WPR = HD // 4
    MT = HD // 16                 # m-tiles of P x V: 16 dims each, 2 of them a lane's
    NKW = U * 2 * KS              # K words a lane a trip: rows 2g, 2g + 1 of each chunk
    NVW = U * 4 * VWD             # V words: rows 4t .. 4t + 3 of each chunk
    NSC = U * 4                   # k_scale, v_scale of rows 2g, 2g + 1 of each chunk
    NQW = 2 * NQB * KS            # q's B fragments
    NO = 4 * MT                   # accumulators of P x V
    K4 = KS % 4 == 0              # 16-byte loads (else word by word: head_dim 32 or 64)
    V4 = VWD % 4 == 0
    block_stats = make_block_stats(GH, NW)
    slot_of = make_slot_of(WIN)                          # position -> ring slot

    def row_loader(n, by4):
        """words(src, wi, dst, o): dst[o .. o + n - 1] = src[wi ..] (16-byte loads where n allows)."""
        @_dev
        def words(src, wi, dst, o):
            if by4:
                for x4 in range(n // 4):
                    w4 = ld4(src, wi + 4 * x4)
                    for x in range(4):
                        dst[o + 4 * x4 + x] = w4[x]
            else:
                for x in range(n):
                    dst[o + x] = src[wi + x]
        return words
    k_row = row_loader(KS, K4)
    v_row = row_loader(VWD, V4)

    @_dev
    def load(k_words, v_words, k_scale, v_scale, t0, r_end, g, t, kvh, n_kv, n_ctx, ring0, kw, vw, sc):
        for u in range(U):
            for i in range(2):                           # K rows 2g + i: KS words from t * KS
                r = t0 + 16 * u + 2 * g + i
                o = (u * 2 + i) * KS
                if r < r_end:
                    s = slot_of(r, n_ctx, ring0)
                    k_row(k_words, (s * n_kv + kvh) * WPR + t * KS, kw, o)
                    sc[u * 4 + i] = k_scale[s, kvh]
                    sc[u * 4 + 2 + i] = v_scale[s, kvh]
                else:
                    for x in range(KS):
                        kw[o + x] = uint32(0)
                    sc[u * 4 + i] = float32(0)
                    sc[u * 4 + 2 + i] = float32(0)
            for i in range(4):                           # V rows 4t + i: VWD words from g * VWD
                r = t0 + 16 * u + 4 * t + i
                o = (u * 4 + i) * VWD
                if r < r_end:
                    v_row(v_words, (slot_of(r, n_ctx, ring0) * n_kv + kvh) * WPR + g * VWD, vw, o)
                else:
                    for x in range(VWD):
                        vw[o + x] = uint32(0)

    @_dev
    def load_q(q, head0, g, t, qb):
        """qb[NQB * 2j + 2P], [.. + 1]: the B fragment of k-step j, part P (head g's q at dims
        4W .. 4W + 3, W = t * KS + j, pre-scaled, f16: P 0 the value, P 1 (q_lo) what f16 left
        of it)."""
        for j in range(KS):
            w = t * KS + j
            for x in range(2):                       # b0: dims 4W, 4W + 1; b1: 4W + 2, 4W + 3
                v0 = float32(0)
                v1 = float32(0)
                if g < GH:
                    base = (head0 + g) * HD + 4 * w + 2 * x
                    v0 = q[base] * qscale
                    v1 = q[base + 1] * qscale
                hi = ptx.pack_half2(v0, v1)
                qb[NQB * 2 * j + x] = hi
                if QL:
                    h0, h1 = ptx.unpack_half2(hi)
                    qb[NQB * 2 * j + 2 + x] = ptx.pack_half2(v0 - h0, v1 - h1)

    @_dev
    def trip(kw, vw, sc, t0, r_end, g, t, qb, o, m, l, s, p, al):
        # scores of the U chunks: s[u * 4 + 2i + e] = row 2g + i, head 2t + e (log2 domain)
        for u in range(U):
            c0 = float32(0)
            c1 = float32(0)
            c2 = float32(0)
            c3 = float32(0)
            for j in range(KS):
                xa = kw[(u * 2) * KS + j] ^ SIGN
                xb = kw[(u * 2 + 1) * KS + j] ^ SIGN
                ka0 = ptx.hfma2(_prmt(xa, C64, 0x4140), ONE2, NEG2)     # bytes 0, 1 of row 2g
                ka1 = ptx.hfma2(_prmt(xb, C64, 0x4140), ONE2, NEG2)     # of row 2g + 1
                ka2 = ptx.hfma2(_prmt(xa, C64, 0x4342), ONE2, NEG2)     # bytes 2, 3
                ka3 = ptx.hfma2(_prmt(xb, C64, 0x4342), ONE2, NEG2)
                for x in range(NQB):
                    c0, c1, c2, c3 = ptx.mma_f16_f32(ka0, ka1, ka2, ka3, qb[NQB * 2 * j + 2 * x],
                                                     qb[NQB * 2 * j + 2 * x + 1], c0, c1, c2, c3)
            r0 = t0 + 16 * u + 2 * g
            ks0 = sc[u * 4]
            ks1 = sc[u * 4 + 1]
            s[u * 4] = c0 * ks0 if r0 < r_end else NEG_INF
            s[u * 4 + 1] = c1 * ks0 if r0 < r_end else NEG_INF
            s[u * 4 + 2] = c2 * ks1 if r0 + 1 < r_end else NEG_INF
            s[u * 4 + 3] = c3 * ks1 if r0 + 1 < r_end else NEG_INF
        # the running max m' of s' = s + log2(v_scale), one per head: the chunk's 16 rows lie in
        # the 8 lanes of a t (g = 0 .. 7)
        for u in range(U):
            for i in range(2):
                lv = math.log2(max(sc[u * 4 + 2 + i], VS_FLOOR))
                for e in range(2):
                    p[u * 4 + 2 * i + e] = s[u * 4 + 2 * i + e] + lv       # s' (NEG_INF stays)
        for e in range(2):
            mx = m[e]
            for u in range(U):
                for i in range(2):
                    mx = max(mx, p[u * 4 + 2 * i + e])
            mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 4))
            mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 8))
            mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 16))
            mu = mx if mx > NEG_INF else float32(0)                       # no valid row yet
            alpha = math.exp2(m[e] - mu)
            m[e] = mx
            lsum = l[e] * alpha
            for u in range(U):
                for i in range(2):
                    x = u * 4 + 2 * i + e
                    pe = math.exp2(s[x] - mu)                              # <= 2^100 (VS_FLOOR)
                    lsum += pe
                    p[x] = pe * sc[u * 4 + 2 + i]        # P' = 2^(s' - m') <= 1 (v_scale 0: 0)
            l[e] = lsum
            al[e] = alpha
        a0 = al[0]
        a1 = al[1]
        # (a head past GH has q = 0: its max follows v_scale alone and must not force the rescale)
        if cuda.any_sync(FULL, (a0 != float32(1) and 2 * t < GH) or (a1 != float32(1) and 2 * t + 1 < GH)):
            for mt in range(MT):
                o[mt * 4] *= a0
                o[mt * 4 + 1] *= a1
                o[mt * 4 + 2] *= a0
                o[mt * 4 + 3] *= a1
        # P' x V, chunk by chunk
        for u in range(U):
            wlo = ptx.pack_half2(p[u * 4], p[u * 4 + 2])                   # head 2t: rows 2g, 2g+1
            whi = ptx.pack_half2(p[u * 4 + 1], p[u * 4 + 3])               # head 2t + 1
            src = 8 * t + (g >> 1)
            wlo = int32(wlo)                                               # (shuffles take int32)
            whi = int32(whi)
            xl = cuda.shfl_sync(FULL, wlo, src)                            # rows 4t, 4t + 1
            xh = cuda.shfl_sync(FULL, whi, src)
            yl = cuda.shfl_sync(FULL, wlo, src + 4)                        # rows 4t + 2, 4t + 3
            yh = cuda.shfl_sync(FULL, whi, src + 4)
            pb0 = uint32(xh if g & 1 else xl)
            pb1 = uint32(yh if g & 1 else yl)
            if g >= GH:
                pb0 = uint32(0)
                pb1 = uint32(0)
            for mt in range(MT):
                x = mt >> 1                                                # the lane's word of a row
                i = 2 * (mt & 1)                                           # its bytes i, i + 1
                r0w = vw[(u * 4) * VWD + x]
                r1w = vw[(u * 4 + 1) * VWD + x]
                r2w = vw[(u * 4 + 2) * VWD + x]
                r3w = vw[(u * 4 + 3) * VWD + x]
                sel0 = i | (4 + i) << 8
                sel1 = (i + 1) | (5 + i) << 8
                va0 = ptx.hfma2((_prmt(r0w, r1w, sel0) & LOW) ^ HI64, ONE2, NEG2)
                va1 = ptx.hfma2((_prmt(r0w, r1w, sel1) & LOW) ^ HI64, ONE2, NEG2)
                va2 = ptx.hfma2((_prmt(r2w, r3w, sel0) & LOW) ^ HI64, ONE2, NEG2)
                va3 = ptx.hfma2((_prmt(r2w, r3w, sel1) & LOW) ^ HI64, ONE2, NEG2)
                d0, d1, d2, d3 = ptx.mma_f16_f32(va0, va1, va2, va3, pb0, pb1, o[mt * 4],
                                                 o[mt * 4 + 1], o[mt * 4 + 2], o[mt * 4 + 3])
                o[mt * 4] = d0
                o[mt * 4 + 1] = d1
                o[mt * 4 + 2] = d2
                o[mt * 4 + 3] = d3

    @_dev
    def tiles(q, head0, k_words, v_words, k_scale, v_scale, r_begin, r_end, new_row, warp, lane,
              kvh, n_kv, n_ctx, ring0, s_m, s_l, s_mw, s_lw, s_red, ra):
        g = lane >> 2
        t = lane & 3
        kw = cuda.local.array(NKW, uint32)
        vw = cuda.local.array(NVW, uint32)
        sc = cuda.local.array(NSC, float32)
        kn = cuda.local.array(NKW, uint32)
        vn = cuda.local.array(NVW, uint32)
        scn = cuda.local.array(NSC, float32)
        qb = cuda.local.array(NQW, uint32)
        o = cuda.local.array(NO, float32)
        s = cuda.local.array(NSC, float32)
        p = cuda.local.array(NSC, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        al = cuda.local.array(2, float32)
        for e in range(2):
            m[e] = NEG_INF
            l[e] = float32(0)
        for x in range(NO):
            o[x] = float32(0)
        t0 = r_begin + warp * CH
        if EARLY:       # rows before the new one: earlier steps wrote them; then the wait
            load(k_words, v_words, k_scale, v_scale, t0, min(r_end, new_row), g, t, kvh, n_kv, n_ctx,
                 ring0, kw, vw, sc)
            wait(ra)
            if t0 <= new_row and new_row < t0 + CH:     # the trip holds the new row: load it again, whole
                load(k_words, v_words, k_scale, v_scale, t0, r_end, g, t, kvh, n_kv, n_ctx, ring0,
                     kw, vw, sc)
        else:
            load(k_words, v_words, k_scale, v_scale, t0, r_end, g, t, kvh, n_kv, n_ctx, ring0,
                 kw, vw, sc)
        load_q(q, head0, g, t, qb)
        while t0 < r_end:
            # the next trip's loads (zeros past r_end: no load) before this trip's math
            load(k_words, v_words, k_scale, v_scale, t0 + TILE, r_end, g, t, kvh, n_kv, n_ctx,
                 ring0, kn, vn, scn)
            trip(kw, vw, sc, t0, r_end, g, t, qb, o, m, l, s, p, al)
            for x in range(NKW):
                kw[x] = kn[x]
            for x in range(NVW):
                vw[x] = vn[x]
            for x in range(NSC):
                sc[x] = scn[x]
            t0 += TILE
        # l over the 8 lanes of a t; then one max per head for the block (warps in shared)
        for e in range(2):
            le = l[e]
            le += cuda.shfl_xor_sync(FULL, le, 4)
            le += cuda.shfl_xor_sync(FULL, le, 8)
            le += cuda.shfl_xor_sync(FULL, le, 16)
            l[e] = le
            h = 2 * t + e
            if g == 0 and h < GH:
                s_mw[warp, h] = m[e]
        cuda.syncthreads()
        dim0 = g * (HD // 8)
        for e in range(2):
            h = 2 * t + e
            if h < GH:
                mb = NEG_INF
                for w in range(NW):
                    mb = max(mb, s_mw[w, h])            # finite: the split has a valid row
                f = math.exp2(m[e] - mb)                # 0 for a warp that saw no valid row
                if g == 0:
                    s_lw[warp, h] = l[e] * f
                for mt in range(MT):
                    s_red[warp, h * HD + dim0 + 2 * mt] = o[mt * 4 + e] * f
                    s_red[warp, h * HD + dim0 + 2 * mt + 1] = o[mt * 4 + 2 + e] * f
        cuda.syncthreads()
        block_stats(s_m, s_l, s_mw, s_lw)
        # (the kernel's epilogue has a barrier before it reads s_m, s_l and s_red)
    return tiles
