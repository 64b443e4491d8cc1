"""MMQ kernels: prefill GEMM Y = X W^T on tensor cores, straight from the planar quantized layout.

This file holds the GEMM kernel factory of the MMQ family; prepare_x and the peak probe
are in `mmq_prep.py`, the split-K reduction kernel (RED_KERNEL) in `mmq_reduce.py`, the
fp16x2 FMA intrinsic in `ptx.py`, the numpy reference, the launchers and the plans in
`mmq.py` (read its docstring first), the lesson in docs/kernels/mmq.md.

What the kernels compute (all shapes row-major):
    W  [rows, cols]  Q4_K / Q5_K / Q6_K / Q8_0 PackedWeight planes (quant/layout.py); the
                     32-weight formats (mmq_legacy.py) and F16 / BF16 (mmq_float.py) plug in
    X  [N, cols]     float16 in "MMQ order" + a per-token power-of-two scale (prepare_x)
    Y  [N, rows]     float32: Y = (X W^T) * xscale[token]   (or Y += ..., or SwiGLU)

One block owns a tile of BM weight rows x BN tokens and a range of K (split-K). The K
loop runs in stages of 128 weights (half a k-quant super-block, four Q8_0 blocks):

    cp.async: raw weight bytes of BM rows  -> smem raw[stage]   (4.5-8.5 bits per weight)
              fp16 X of the BN tokens      -> smem x[stage]     (STAGES-deep ring)
    decode:   the block turns the stage's packed sub-block scales into fp16x2 (scale, -min)
              pairs in smem (one entry per row per sub-block)
    compute:  each warp dequantizes ITS OWN mma A fragments in registers from the raw
              bytes (2 fp16x2 FMAs per pair of weights), loads the B fragments (X) with
              ldmatrix, and issues mma.sync.m16n8k16 (f16 x f16 -> f32)

Weights are never written to shared memory as fp16: the raw tile is 3.6x smaller than
an fp16 tile, which buys pipeline depth and occupancy (and fits Orin's 163 KB).

"MMQ order" of X: inside every aligned group of 16 values, slot s holds value
p = 4 * ((s & 7) >> 1) + 2 * (s & 1) + (s >> 3). Then lane t of an mma quad finds the
four consecutive weights 4t..4t+3 of a group in ONE 32-bit word of the weight plane
(bytes 0,2 -> register a0/a1, bytes 1,3 -> a2/a3) and the matching activations in the
standard ldmatrix B fragment. The dot product does not care about the order of k, as
long as both operands use the same one.

Indices: every index into shared memory is built from uint32 values (np.uint32
constants below), so numba emits no negative-index wrap-around; a signed index would
add a compare and select to every shared-memory access in the inner loop.
"""
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import mmq_float as F
from . import mmq_legacy as L
from .ptx import hfma2
from .ptx import (SIMULATOR, cp_async16_zfill, cp_async_commit, cp_async_wait_group_0,
                  cp_async_wait_group_1, cp_async_wait_group_2, f16_bits_to_f32,
                  ldmatrix_x2, ldmatrix_x4, mma_f16_f32, pack_half2)

U = np.uint32

# Formats (plane order of the kernel arguments p0..p3; unused slots get a dummy plane).
# Q5_K (8) is Q4_K plus the qh plane of 5th bits: Q4_K's code paths with a fifth bit.
Q4_K, Q6_K, Q8_0, Q5_K = 0, 1, 2, 8
KQ45 = (Q4_K, Q5_K)                # the formats with Q4_K's header (d, dmin, packed scales/mins)
FORMAT_NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K", Q8_0: "Q8_0", Q5_K: "Q5_K", **L.NAMES, **F.NAMES}
# Epilogues.
EPI_STORE, EPI_ADD, EPI_SWIGLU, EPI_GEGLU = 0, 1, 2, 3
EPI_NAMES = {EPI_STORE: "store", EPI_ADD: "add", EPI_SWIGLU: "swiglu", EPI_GEGLU: "geglu"}
GATED = (EPI_SWIGLU, EPI_GEGLU)     # W = [gate; up]: y = act(x G^T) * (x U^T), act silu / gelu-tanh
_GELU_A = float32(0.044715)                               # ggml's GELU_COEF_A
_GELU_S = float32(0.79788456080286535587989211986876)     # ggml's SQRT_2_OVER_PI
# Split-K reductions (splits > 1):
#   RED_LAST    every block publishes its partial tile; the last block of a tile to finish
#               (an atomic counter) sums the partials in split order and runs the epilogue
#   RED_KERNEL  every block stores its raw partial sums at P[split, token, weight row] and
#               exits; mmq_reduce.py's kernel (the next launch) sums them over the splits for
#               every output in parallel and runs the epilogue. No counters, no fences, and
#               the reduction is spread over the whole GPU instead of one block per tile.
RED_LAST, RED_KERNEL = 0, 1
RED_NAMES = {RED_LAST: "last", RED_KERNEL: "kernel"}

STAGE_K = 128            # weights of K per pipeline stage
MAX_REGISTERS = 128      # per thread, for warp tiles of <= 16 mma tiles (see build_mmq_kernel)
# Raw bytes of one weight row for one stage, in 16-byte chunks (what cp.async moves):
#   Q4_K: qs 64 B (4 chunks) + header 16 B (d, dmin, 12 packed 6-bit scales/mins)
#   Q6_K: ql 64 B (4) + qh 32 B (2) + sc 16 B (1)       (d comes from global, see below)
#   Q8_0: qs 128 B (8) + d of the super-block's 8 blocks 16 B (1)
#   Q5_K: as Q4_K (qs words 0-15, header 16-19) + the super-block's qh 32 B (2): words 20-27
RAW_CHUNKS = {Q4_K: 5, Q6_K: 7, Q8_0: 9, Q5_K: 7, **L.RAW_CHUNKS, **F.RAW_CHUNKS}
# (+ the 32-weight formats: mmq_legacy.py; F16/BF16: mmq_float.py)
# Row strides 80 / 112 / 144 bytes = 20 / 28 / 36 words: the 8 rows g = 0..7 that a warp
# reads at once start in banks 20g / 28g / 36g mod 32, all different multiples of 4, so
# the quad's 4 words (t = 0..3) never collide: conflict-free without padding.
# Scale table: words per row per stage (entries: Q4_K 4 sub-blocks x (scale2, -min2);
# Q6_K 8 sub-blocks x scale2; Q8_0 4 blocks x scale2), padded to an odd/even stride
# that spreads the 8 rows of a warp over distinct banks.
SC_WORDS = {Q4_K: 10, Q6_K: 9, Q8_0: 5, Q5_K: 10, **L.SC_WORDS, **F.SC_WORDS}
SC_ENTRIES = {Q4_K: 4, Q6_K: 8, Q8_0: 4, Q5_K: 4, **{f: L.SC_ENTRIES for f in L.LEGACY},
              **{f: 4 for f in F.FLOAT}}          # (F16/BF16: no table; 4 keeps the loops' shape)
X_WORDS = 68             # one token's 128 fp16 per stage = 64 words, + 4 pad: ldmatrix rows
                         # 272 B apart start in different 16-byte bank groups (conflict-free)


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


def _wait_group(stages):
    """cp.async.wait_group(stages - 2) as a device function (the count is a PTX immediate)."""
    if stages == 2:
        return cp_async_wait_group_0
    if stages == 3:
        return cp_async_wait_group_1
    if stages == 4:
        return cp_async_wait_group_2
    raise ValueError(f"stages must be 2, 3 or 4, got {stages}")


def register_capped(mt, nt, threads, epi):
    """Kernels compiled with max_registers = MAX_REGISTERS. Warp tiles of <= 16 mma tiles
    fit in 128 registers without spills (ptxas -v, sm_90: 64-142 before the cap), which
    lets two 256-thread blocks share an SM; the 256-thread SwiGLU kernel would spill
    (two accumulator sets in the epilogue) and stays uncapped (135 registers)."""
    return mt * nt <= 16 and not (epi in GATED and threads >= 256)


def smem_bytes(fmt, wm, wn, mt, nt, stages):
    """Dynamic shared memory of one block, in bytes."""
    bm, bn = 16 * mt * wm, 8 * nt * wn
    words = stages * bm * 4 * RAW_CHUNKS[fmt] + 2 * bm * SC_WORDS[fmt] + 4 + stages * bn * X_WORDS
    return 4 * words


@_inline
def _silu(v):
    return v / (float32(1.0) + math.exp(-v))


@_inline
def _gelu(v):
    """gelu, tanh form (engine/norm.py's gelu_reference: llama.cpp's Gemma FFN)."""
    return float32(0.5) * v * (float32(1.0) + math.tanh(_GELU_S * v * (float32(1.0) + _GELU_A * v * v)))


def _gate_act(epi):
    return _gelu if epi == EPI_GEGLU else _silu


# =====================================================================================
# The GEMM kernel factory. Compile-time constants are closure variables (numba freezes
# them); each (format, tile shape, stages, epilogue) is its own kernel.
# =====================================================================================
def build_mmq_kernel(fmt, wm, wn, mt, nt, stages, epi, red=RED_LAST):
    """Return the lazily-compiled `@cuda.jit` kernel

    kernel(p0, p1, p2, p3, x, xscale, y, ws, cnt,
           n_tok, rows_out, n_stages, stages_per_split, splits)

      p0..p3     weight planes, 2-D C-contiguous [rows_w, bytes] (rows_w = rows_out, or
                 2 * rows_out for SwiGLU: gate rows then up rows):
                   Q4_K: qs u8, hdr u8, (dummy), (dummy)
                   Q6_K: ql u8, qh u8, sc i8, d f16 [rows_w, nb]
                   Q8_0: qs i8, d f16 [rows_w, nb], (dummy), (dummy)
                   Q5_K: qs u8, hdr u8, qh u8, (dummy)
                   F16 / BF16 (mmq_float.py): w as u8 [rows_w, 2 cols], (dummies)
                   32-weight formats (mmq_legacy.py): qs u8 (Q8_0: i8), d bits u16
                   [rows_w, nb] or dm u32 [rows_w, nb], qh u32 [rows_w, nb] or (dummy), (dummy)
      x          float16 [N, cols] in MMQ order (prepare_x)
      xscale     float32 [N] power-of-two per-token scale (prepare_x)
      y          float32 [N, rows_out] output (or residual stream for EPI_ADD)
      ws, cnt    split-K partial tiles float32 [*] and per-tile counters int32 [*]
                 (counters start at 0 and are left at 0); unused when splits == 1.
                 RED_KERNEL: ws holds P float32 [splits, N, rows_w] (rows_w = weight
                 rows: 2 rows_out for SwiGLU), cnt is unused, y is not written.
      n_tok      N; rows_out: output rows; n_stages = ceil(cols / 128);
      stages_per_split: K stages per blockIdx.z (even); splits = gridDim.z

    grid = (ceil(rows_out / BM_out), ceil(N / BN), splits), block = 32 * wm * wn threads,
    dynamic shared memory = smem_bytes(...).
    """
    assert fmt in (Q4_K, Q6_K, Q8_0, Q5_K) + L.LEGACY + F.FLOAT
    assert epi in (EPI_STORE, EPI_ADD, EPI_SWIGLU, EPI_GEGLU)
    LG = fmt in L.LEGACY                   # a 32-weight format (mmq_legacy.py): K % 128 may be != 0
    FL = fmt in F.FLOAT                    # F16 / BF16 (mmq_float.py): K % 128 may be != 0 too
    PARTIAL = LG or FL                     # the last stage may be partial (zero-filled)
    KQ = fmt in KQ45                       # Q4_K's header and nibbles (Q5_K: + a fifth bit)
    Q5 = fmt == Q5_K
    assert red in (RED_LAST, RED_KERNEL)
    swiglu = epi in GATED                  # (SwiGLU or GeGLU: the same row layout)
    assert not swiglu or mt % 2 == 0, "SwiGLU needs an even number of m16 tiles per warp"
    NTH = 32 * wm * wn                     # threads per block
    BM = 16 * mt * wm                      # weight rows staged per block
    MTH = mt // 2 if swiglu else mt        # m16 tiles per warp that are outputs
    MTROWS = 16 * mt                       # rows per warp
    RC = RAW_CHUNKS[fmt]
    RW = 4 * RC                            # raw words per row per stage
    SCW = SC_WORDS[fmt]
    SCE = SC_ENTRIES[fmt]
    PER_T = BM * SCE // NTH                # scale entries each thread decodes per stage
    assert PER_T * NTH == BM * SCE
    assert NTH & (NTH - 1) == 0, "threads per block must be a power of two"
    RAW_STAGE = BM * RW                    # words
    SC_OFF = stages * RAW_STAGE
    SC_BUF = BM * SCW
    FLAG = SC_OFF + 2 * SC_BUF
    X_OFF = FLAG + 4
    assert X_OFF % 4 == 0
    wait_group = _wait_group(stages)
    gate_act = _gate_act(epi)
    ACC_WORDS = mt * nt * 4                # accumulators per thread
    # uint32 versions of the constants used in index math
    uNTH, uBM, uRW, uSCW, uSCE = U(NTH), U(BM), U(RW), U(SCW), U(SCE)
    uMT16, uXW, uSTAGES = U(MTROWS), U(X_WORDS), U(stages)
    uSC_OFF, uSC_BUF, uRAW_STAGE, uX_OFF = U(SC_OFF), U(SC_BUF), U(RAW_STAGE), U(X_OFF)
    uBM_OUT = U(BM // 2 if swiglu else BM)
    uBN = U(8 * nt * wn)

    # ---- which weight row does local raw row lr hold? --------------------------------
    @_inline
    def weight_row(lr, m0, rows_out):
        """(global weight row, valid) of local row lr of a block whose outputs start at m0."""
        if swiglu:
            # warp w owns local rows [16*mt*w, 16*mt*(w+1)); its m16 tiles i < mt/2 are
            # gate rows, tiles i >= mt/2 the up rows of the same outputs.
            w = lr // uMT16
            i = (lr // U(16)) % U(mt)
            r = lr & U(15)
            ih = i % U(MTH)
            o = m0 + (w * U(MTH) + ih) * U(16) + r
            ok = o < rows_out
            if i >= U(MTH):
                o = o + rows_out
            return o, ok
        o = m0 + lr
        return o, o < rows_out

    # ---- stage loader: raw weight chunks + X rows, all through cp.async ---------------
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

    @_inline
    def load_stage(smem, p0, p1, p2, x, st, buf, m0, n0, n_tok, rows_out, x_rows_blk, tid):
        rb = buf * uRAW_STAGE
        sb = st >> U(1)                                  # super-block (k-quants) index
        if LG:              # qs of the stage's 4 blocks (d, m, qh: lg_prefetch)
            lg_load_qs(smem, p0, rb, st, m0, rows_out, tid)
        elif FL:            # 256 B of the row (the plane as bytes), zero-filled past its end
            fl_load(smem, p0, rb, st, m0, rows_out, tid)
        elif KQ:            # qs: 64 B of the stage; header: 16 B of the super-block
            load_plane(smem, p0, rb, U(0), U(2), st * U(64), U(16), m0, rows_out, tid)
            load_plane(smem, p1, rb, U(16), U(0), sb * U(16), U(16), m0, rows_out, tid)
            if Q5:          # + qh: the super-block's 32 B (both halves read all of it)
                load_plane(smem, p2, rb, U(20), U(1), sb * U(32), U(16), m0, rows_out, tid)
        elif fmt == Q6_K:   # ql 64 B, qh 32 B of the stage; 16 int8 scales of the super-block
            load_plane(smem, p0, rb, U(0), U(2), st * U(64), U(16), m0, rows_out, tid)
            load_plane(smem, p1, rb, U(16), U(1), st * U(32), U(16), m0, rows_out, tid)
            load_plane(smem, p2, rb, U(24), U(0), sb * U(16), U(16), m0, rows_out, tid)
        else:               # qs 128 B of the stage; fp16 d of the super-block's 8 blocks
            load_plane(smem, p0, rb, U(0), U(3), st * U(128), U(16), m0, rows_out, tid)
            load_plane(smem, p1, rb, U(32), U(0), sb * U(8), U(8), m0, rows_out, tid)
        xb = uX_OFF + buf * uBN * uXW
        c = tid
        while c < x_rows_blk * U(16):                   # 16 chunks of 8 fp16 per token
            tk = c >> U(4)
            part = c & U(15)
            tok = n0 + tk
            nbytes = U(16)
            xc = st * U(128) + part * U(8)
            if PARTIAL:
                if xc >= uint32(x.shape[1]):             # past the row: the last stage is partial
                    xc = U(0)
                    nbytes = U(0)
            if tok >= n_tok:
                tok = U(0)
                nbytes = U(0)
            cp_async16_zfill(smem, xb + tk * uXW + part * U(4), x, (tok, xc), nbytes)
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

    # ---- tensor-core inner step: one k16 group, all m/n tiles of the warp ------------
    @_inline
    def mma_group(smem, acc, afr, xrow, group):
        # afr (mt, 4) uint32: A fragments of the warp's m16 tiles for this k16 group.
        # xrow: smem word of this lane's ldmatrix row in the current X stage: token
        # (lane & 7) + 8 (lane >> 4), k-half (lane >> 3) & 1 -> .x4 gives b0, b1 of n-tiles
        # j and j + 1. Every n-tile is computed; columns past N hold garbage and are
        # never stored (mma columns are independent).
        bfr = cuda.local.array((nt, 2), uint32)
        for jj in range(nt // 2):
            b = ldmatrix_x4(smem, xrow + U(jj * 16) * uXW + group * U(8))
            bfr[2 * jj, 0] = b[0]
            bfr[2 * jj, 1] = b[1]
            bfr[2 * jj + 1, 0] = b[2]
            bfr[2 * jj + 1, 1] = b[3]
        if nt % 2 == 1:
            b2 = ldmatrix_x2(smem, xrow + U((nt - 1) * 8) * uXW + group * U(8))
            bfr[nt - 1, 0] = b2[0]
            bfr[nt - 1, 1] = b2[1]
        for j in range(nt):
            for i in range(mt):
                r = mma_f16_f32(afr[i, 0], afr[i, 1], afr[i, 2], afr[i, 3], bfr[j, 0], bfr[j, 1],
                                acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
                acc[i, j, 0] = r[0]
                acc[i, j, 1] = r[1]
                acc[i, j, 2] = r[2]
                acc[i, j, 3] = r[3]

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

    # the 32-weight formats' stage loader, scale prefetch/decode and compute (for the other
    # formats the branches that call them are pruned; Q4_0's are built as stand-ins)
    lg_load_qs, lg_prefetch, lg_decode, lg_compute = L.make(
        fmt if LG else L.Q4_0, mt, NTH, PER_T, uRW, uSCW, uRAW_STAGE, uSC_OFF, uSC_BUF, weight_row, mma_group)

    # F16 / BF16: the stage loader (the 32-weight formats' one, on the plane as bytes) and
    # compute (for the other formats, F16's are built as stand-ins and pruned)
    fl_load = L.make_row_loader(F.LOG2_CHUNKS, NTH, BM, uRW, weight_row)
    fl_compute = F.make(fmt if FL else F.F16, mt, uRW if FL else U(72), uRAW_STAGE if FL else U(0),
                        mma_group)

    @_inline
    def compute_stage(smem, acc, buf, scbuf, wrow0, g, t, xrow, half):
        # Every helper is called with literal chunk numbers, so after inlining all shared
        # memory offsets are immediates and the whole stage is straight-line code.
        rb = buf * uRAW_STAGE + (wrow0 + g) * uRW + t    # this lane's word in row g, m-tile 0
        scb = uSC_OFF + scbuf * uSC_BUF + (wrow0 + g) * uSCW
        if LG:
            lg_compute(smem, acc, buf, scbuf, wrow0, g, t, xrow)
            return
        if FL:
            fl_compute(smem, acc, buf, wrow0, g, t, xrow)
            return
        afr = cuda.local.array((mt, 4), uint32)
        if KQ:
            wq = cuda.local.array((mt, 2), uint32)       # [m-tile][row g / g+8]
            wh = cuda.local.array((mt, 2), uint32)       # Q5_K: qh words of rows g / g+8
            sc0 = cuda.local.array((mt, 4), uint32)      # sub-block 2cc:   s2, -m2 of g, g+8
            sc1 = cuda.local.array((mt, 4), uint32)      # sub-block 2cc+1
            q4k_chunk(smem, acc, afr, wq, wh, sc0, sc1, rb, scb, xrow, U(0), half)
            q4k_chunk(smem, acc, afr, wq, wh, sc0, sc1, rb, scb, xrow, U(1), half)
        elif fmt == Q6_K:
            wl = cuda.local.array((mt, 2, 2), uint32)    # ql words [m-tile][quarter parity][row]
            wh = cuda.local.array((mt, 2), uint32)       # qh words [m-tile][row]
            scl = cuda.local.array((mt, 2), uint32)
            q6k_half(smem, acc, afr, wl, wh, scl, rb, scb, xrow, U(0))
            q6k_half(smem, acc, afr, wl, wh, scl, rb, scb, xrow, U(1))
        else:
            scl = cuda.local.array((mt, 2), uint32)
            q8_block(smem, acc, afr, scl, rb, scb, xrow, U(0))
            q8_block(smem, acc, afr, scl, rb, scb, xrow, U(1))
            q8_block(smem, acc, afr, scl, rb, scb, xrow, U(2))
            q8_block(smem, acc, afr, scl, rb, scb, xrow, U(3))

    # ---- epilogue: one output element, owned by exactly one thread -------------------
    @_inline
    def epilogue(y, xscale, acc, m0, n0, wrow_out0, g, t, xtok0, nt_w, n_tok, rows_out):
        for i in range(MTH):
            for j in range(nt):
                if U(j) < nt_w:
                    for e in range(4):
                        row = m0 + wrow_out0 + U(16 * i + 8 * (e >> 1)) + g
                        tok = n0 + xtok0 + U(8 * j + (e & 1)) + U(2) * t
                        if row < rows_out and tok < n_tok:
                            v = acc[i, j, e] * xscale[tok]
                            if epi == EPI_STORE:
                                y[tok, row] = v
                            elif epi == EPI_ADD:
                                y[tok, row] += v
                            else:
                                u = acc[i + MTH, j, e] * xscale[tok]
                                y[tok, row] = gate_act(v) * u

    jit_options = {} if SIMULATOR or not register_capped(mt, nt, NTH, epi) else {"max_registers": MAX_REGISTERS}

    @cuda.jit(**jit_options)
    def kernel(p0, p1, p2, p3, x, xscale, y, ws, cnt, n_tok_, rows_out_, n_stages_,
               stages_per_split_, splits_):
        smem = cuda.shared.array(0, uint32, alignment=16)
        tid = uint32(cuda.threadIdx.x) & U(NTH - 1)       # masked: provably < NTH
        lane = tid & U(31)
        warp = tid >> U(5)
        g = lane >> U(2)
        t = lane & U(3)
        wmi = warp % U(wm)                               # warp's row slot
        wni = warp // U(wm)                              # warp's token slot
        n_tok = uint32(n_tok_)
        rows_out = uint32(rows_out_)
        splits = uint32(splits_)
        m0 = uint32(cuda.blockIdx.x) * uBM_OUT
        n0 = uint32(cuda.blockIdx.y) * uBN
        split = uint32(cuda.blockIdx.z)
        st0 = split * uint32(stages_per_split_)
        st1 = min(st0 + uint32(stages_per_split_), uint32(n_stages_))
        # tokens this block stages (multiple of 8) and n8 tiles this warp computes
        left = n_tok - n0
        x_rows_blk = min(uBN, (left + U(7)) & ~U(7))
        xtok0 = wni * U(8 * nt)
        nt_w = U(0)
        if x_rows_blk > xtok0:
            nt_w = min(U(nt), (x_rows_blk - xtok0) >> U(3))
        wrow0 = wmi * uMT16                              # first local raw row of this warp
        # this lane's ldmatrix row in an X stage (see mma_group)
        xrow_lane = (xtok0 + (lane & U(7)) + ((lane >> U(4)) << U(3))) * uXW + ((lane >> U(3)) & U(1)) * U(4)

        dq6 = cuda.local.array(PER_T, float32)           # Q6_K d of the decoded rows
        dq6n = cuda.local.array(PER_T, float32)
        if fmt == Q6_K:
            load_d6(p3, dq6, st0 >> U(1), m0, rows_out, tid)
        pf = cuda.local.array((PER_T, 2), uint32)        # 32-weight formats: d/dm, qh of a stage
        pfn = cuda.local.array((PER_T, 2), uint32)
        if LG:
            lg_prefetch(p1, p2, pf, st0, m0, rows_out, tid)

        # prologue: stages st0 .. st0 + stages - 2 in flight
        for s in range(stages - 1):
            if st0 + U(s) < st1:
                load_stage(smem, p0, p1, p2, x, st0 + U(s), U(s), m0, n0, n_tok, rows_out,
                           x_rows_blk, tid)
            cp_async_commit()

        acc = cuda.local.array((mt, nt, 4), float32)
        for i in range(mt):
            for j in range(nt):
                for e in range(4):
                    acc[i, j, e] = float32(0.0)

        buf = U(0)
        st = st0
        while st < st1:
            wait_group()                                 # this thread's copies of stage st landed
            cuda.syncthreads()                           # ... everyone's; and stage st-1 is consumed
            nxt = st + uSTAGES - U(1)
            nbuf = buf + uSTAGES - U(1)
            if nbuf >= uSTAGES:
                nbuf -= uSTAGES
            if nxt < st1:                                # refill the buffer stage st-1 used
                load_stage(smem, p0, p1, p2, x, nxt, nbuf, m0, n0, n_tok, rows_out,
                           x_rows_blk, tid)
            cp_async_commit()
            scbuf = (st - st0) & U(1)
            if fmt == Q6_K:
                if (st & U(1)) == U(0) and (st >> U(1)) + U(1) < (st1 + U(1)) >> U(1):
                    load_d6(p3, dq6n, (st >> U(1)) + U(1), m0, rows_out, tid)
            if LG:                                       # next stage's fields in flight, this one's table
                if st + U(1) < st1:
                    lg_prefetch(p1, p2, pfn, st + U(1), m0, rows_out, tid)
                lg_decode(smem, pf, scbuf, tid)
                for k in range(PER_T):
                    pf[k, 0] = pfn[k, 0]
                    pf[k, 1] = pfn[k, 1]
            elif not FL:                                 # (F16/BF16: no scale table)
                decode_scales(smem, st, buf, scbuf, tid, dq6)
            if fmt == Q6_K:
                if (st & U(1)) == U(1):
                    for k in range(PER_T):
                        dq6[k] = dq6n[k]
            cuda.syncthreads()                           # scale table ready
            if nt_w > U(0):
                compute_stage(smem, acc, buf, scbuf, wrow0, g, t, uX_OFF + buf * uBN * uXW + xrow_lane,
                              st & U(1))
            buf += U(1)
            if buf == uSTAGES:
                buf = U(0)
            st += U(1)

        wrow_out0 = wmi * U(16 * MTH)
        if red == RED_KERNEL and splits > U(1):
            # raw partial sums to P[split, token, weight row]; the reduce kernel does the rest.
            # A warp store (fixed i, j, e) covers 8 consecutive rows of 4 tokens: 4 sectors.
            rows_w = rows_out * U(2) if swiglu else rows_out
            pbase = split * n_tok
            for i in range(mt):
                for j in range(nt):
                    if U(j) < nt_w:
                        for e in range(4):
                            wr, ok = weight_row(wrow0 + U(16 * i + 8 * (e >> 1)) + g, m0, rows_out)
                            tok = n0 + xtok0 + U(8 * j + (e & 1)) + U(2) * t
                            if ok and tok < n_tok:
                                ws[(pbase + tok) * rows_w + wr] = acc[i, j, e]
            return
        if splits > U(1):
            # split-K: publish this block's partial tile; the last block of the tile sums
            # all partials in split order (deterministic) and runs the epilogue.
            tile = uint32(cuda.blockIdx.x) + uint32(cuda.gridDim.x) * uint32(cuda.blockIdx.y)
            tile_words = uNTH * U(ACC_WORDS)
            base = (tile * splits + split) * tile_words + tid * U(4)
            for i in range(mt):
                for j in range(nt):
                    if U(j) < nt_w:
                        o = base + U((i * nt + j) * 4) * uNTH
                        for e in range(4):
                            ws[o + U(e)] = acc[i, j, e]
            cuda.threadfence()
            cuda.syncthreads()
            if tid == U(0):
                old = cuda.atomic.add(cnt, tile, int32(1))
                smem[FLAG] = U(1) if uint32(old) == splits - U(1) else U(0)
            cuda.syncthreads()
            if smem[FLAG] == U(0):
                return
            cuda.threadfence()
            for i in range(mt):
                for j in range(nt):
                    if U(j) < nt_w:
                        for e in range(4):
                            acc[i, j, e] = float32(0.0)
            sp = U(0)
            while sp < splits:
                pb = (tile * splits + sp) * tile_words + tid * U(4)
                for i in range(mt):
                    for j in range(nt):
                        if U(j) < nt_w:
                            o = pb + U((i * nt + j) * 4) * uNTH
                            for e in range(4):
                                acc[i, j, e] += ws[o + U(e)]
                sp += U(1)
            if tid == U(0):
                cnt[tile] = int32(0)                     # ready for the next launch
        epilogue(y, xscale, acc, m0, n0, wrow_out0, g, t, xtok0, nt_w, n_tok, rows_out)

    kernel.mmq_meta = dict(fmt=fmt, wm=wm, wn=wn, mt=mt, nt=nt, stages=stages, epi=epi, red=red,
                           threads=NTH, bm=BM, bm_out=BM // 2 if swiglu else BM, bn=8 * nt * wn)
    return kernel_cache.attach(kernel)
