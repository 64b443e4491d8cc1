"""The prefill attention kernels: `prefill_kernel(...)` (causal flash-attention 2 on tensor
cores, mma.sync m16n8k16 f16->f32, specialised at compile time) and `prefill_merge` (the
context splits combined). The math, the numpy reference, the plan, the workspace and the
launcher that checks every argument are in kvcache/attention_prefill.py.

GQA packing. The `group` query heads of one KV head read the same K/V rows, so they are
stacked along the M dimension of the matrix products: packed row r = token * group + g
(token-major, so a row's causal limit grows with r). A block owns 64 packed rows (4 warps
x 16 rows: one m16 tile each) of one KV head: at group 4 that is 16 tokens, so even a
33-token prompt fills the tensor cores' M dimension, and each K/V tile is read from
memory once per 64 rows instead of once per head.

Per block (grid: ceil(n*group/64) x n_kv x n_splits, 128 threads), flash-attention 2:
- Q fragments (hd/16 k-steps x 4 registers) are built once from global q, pre-scaled by
  log2(e)/sqrt(hd) and rounded to f16; they stay in registers.
- K/V tiles of BN keys (`block_n`: 32 at hd 128, 64 at hd 64) go global -> registers
  (128-bit read-only loads, issued one tile ahead so they fly during the math) ->
  shared memory as f16: int8 K as its exact integer values (the row scale multiplies the
  scores in f32, so K loses nothing), int8 V dequantized (q * scale, f16 rounding), f16
  rows copied. Rows are padded by 16 bytes so ldmatrix reads are conflict-free; rows past
  the keys this block needs are zero-filled (never garbage into the products).
- S = Q K^T: ldmatrix.x4 gives the B fragments of two 8-key tiles per k-step; scale,
  causal mask (key > start + token -> -inf), running max / sum per row (the 4 lanes of a
  row group combine by shuffles), rescale O.
- O += P V: the S accumulators are already in the A-fragment layout (FA2), packed to f16;
  V fragments come from ldmatrix.x4.trans.
- Long contexts with few query rows (a short prompt after a long reused prefix) split the
  key range over `n_splits` blocks; each writes (O, m, l) per row to a workspace and
  `prefill_merge` combines them (flash-decoding). The launch's grid holds the most splits
  its graph may need; the count in use can come from the device state (`splits_at`), so a
  bucket's one graph serves every start position: the blocks above the count exit at once,
  and with one split the kernel writes `out` itself and the merge returns.

Traffic: each row block reads the K/V rows its tokens may see, at most (start + n) *
hd * 2 bytes (int8, + 8 bytes of scales per row); over the grid that is
ceil(n * group / 64) times the context. Useful FLOPs: `prefill_flops` in
attention_prefill.py (4 * hd per visible (query, key) pair and head). For the prompt
sizes we see (33 .. 2048 tokens) the kernel is compute- and latency-bound, not
bandwidth-bound.

Compile-time variants (`prefill_kernel(..., window, scale)`):
- a sliding window W: query i sees keys start + i - W + 1 .. start + i (the mask adds
  key < start + i - W + 1 -> -inf; tiles start at max(0, start - W + 1)), read through a
  ring of R slots (key % R) when the layer is one: the launch reads W + n - 1 keys at
  once, so the launcher requires R >= W + n - 1 (docs/kv-pool.md);
- the attention scale (None: 1/sqrt(hd));
- head_dim 256 (Gemma 3): a warp cannot hold 16 rows x 256 O accumulators and the Q
  fragments in 255 registers, so O is computed in two column halves by two blocks
  (grid.x = row tiles x o_splits), each computing all of S = Q K^T and its half of P V.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from genie_rt.engine import kernel_cache
from genie_rt.quant import ptx

from .attention_decode_kernels import LOG2E, NEG_INF, _byte

FULL = 0xFFFFFFFF
BM = 64                  # packed query rows per block
WARPS = 4
THREADS = 32 * WARPS


# =====================================================================================
# kernels
# =====================================================================================
def block_n(head_dim: int, kv_dtype: str) -> int:
    """Keys per tile: each thread holds 4 (int8: plus the dequantization registers) or
    8 (f16) x 16 bytes of the next tile, K and V together; 255 registers is the budget.
    head_dim > 128 (two column halves of O per row block, see prefill_kernel): 16."""
    if head_dim > 128:
        return 16
    if kv_dtype == "int8":
        return min(64, THREADS * 4 * 16 // (2 * head_dim))
    return min(64, THREADS * 8 * 16 // (2 * head_dim * 2))


def o_splits(head_dim: int) -> int:
    """Column parts of O per row block: 1 up to head_dim 128, 2 above (registers: a warp
    holds 16 rows x head_dim / parts accumulators; each part recomputes S = Q K^T)."""
    return 1 if head_dim <= 128 else 2


@functools.lru_cache(maxsize=None)
def prefill_kernel(head_dim: int, group: int, kv_dtype: str, bn: int = 0, window: int = 0,
                   scale: float | None = None):
    """The prefill kernel specialised on (head_dim, group, cache dtype, keys per tile
    (0 = block_n()), sliding window (0 = none), attention scale (None = 1/sqrt(hd)))."""
    HD, G = head_dim, group
    I8 = kv_dtype == "int8"
    ES = 1 if I8 else 2
    BN = bn or block_n(HD, kv_dtype)
    WIN = int(window)
    ND = o_splits(HD)                # column parts of O: blockIdx.x = row tile * ND + part
    DV = HD // ND                    # O (and V) columns of this block
    CH = HD * ES // 16               # 16-byte chunks per cache row (K)
    CHV = DV * ES // 16              # 16-byte chunks of the V columns this block reads
    NCHT = BN * CH                   # chunks per tile (K)
    NCHTV = BN * CHV                 # chunks per tile (V)
    NCH = (NCHT + THREADS - 1) // THREADS      # per thread (K)
    NCHV = (NCHTV + THREADS - 1) // THREADS    # per thread (V)
    assert HD % (16 * ND) == 0 and HD <= 256 and BN % 16 == 0, \
        f"prefill: head_dim {HD} / {kv_dtype} / block_n {BN} unsupported"
    HDW = HD // 2 + 4                # shared words per K row: HD + 8 halves
    DVW = DV // 2 + 4                # shared words per V row
    WPR = HD * ES // 4               # global 32-bit words per cache row
    NKS = HD // 16                   # k-steps of Q K^T
    NNS = BN // 8                    # 8-key tiles of S
    NKP = BN // 16                   # k-steps of P V
    NNO = DV // 8                    # 8-dim tiles of O
    NQF, NO, NS, NP, NPV = NKS * 4, NNO * 4, NNS * 4, NCH * 4, NCHV * 4   # local array sizes
    QSCALE = float32(LOG2E / math.sqrt(HD) if scale is None else LOG2E * float(scale))

    @cuda.jit
    def kernel(q, k_words, v_words, k_scale, v_scale, state, out, part_o, part_ml, splits_at):
        # q        f32 [n, n_head, HD]         queries (normed, roped)
        # k_words  u32 [R * n_kv * WPR]        this layer's K cache (R slots) as 32-bit words
        # v_words  u32 [R * n_kv * WPR]
        # k_scale  f32 [R, n_kv]               int8 row scales (unused for f16)
        # v_scale  f32 [R, n_kv]
        # state    i32 [>=1]                   state[0] = start (position of token 0)
        # out      f32 [n, n_head * HD]        written when the launch has one split
        # part_o   f32 [S, n * n_head, HD]     per-split unnormalised O (more splits)
        # part_ml  f32 [S, n * n_head, 2]      per-split (max, sum), log2 domain
        # splits_at i32                        < 0: gridDim.z splits; else state[splits_at]
        #                                      (1 .. gridDim.z): one graph serves every
        #                                      split count, the blocks above it exit
        if ND == 1:
            mt = cuda.blockIdx.x
            dh = 0
        else:
            mt = cuda.blockIdx.x // ND
            dh = cuda.blockIdx.x - mt * ND    # which DV columns of O (and of V)
        kvh = cuda.blockIdx.y
        n_kv = cuda.gridDim.y
        split = cuda.blockIdx.z
        n_splits = cuda.gridDim.z
        if splits_at >= 0:
            n_splits = min(max(state[splits_at], 1), n_splits)
        if split >= n_splits:
            return                        # the whole block: before any barrier
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2                     # mma groupID: rows g and g + 8
        t4 = lane & 3                     # thread in group: columns 2*t4, 2*t4 + 1
        n = q.shape[0]
        n_head = q.shape[1]
        n_ctx = k_words.size // (n_kv * WPR)                 # slots R
        start = state[0]
        nrows = n * G
        row0 = mt * BM
        tok_hi = (min(row0 + BM, nrows) - 1) // G
        if WIN == 0:
            klo = 0                                          # keys of the launch: 0 .. total-1
            ring0 = 0
            kv_len = min(start + tok_hi + 1, n_ctx)          # keys this block may need
            total = min(start + n, n_ctx)
        else:
            # query start+t sees keys start+t-W+1 .. start+t; the launch's keys are
            # klo .. start+n-1, at most W-1+n <= R of them (the launcher checks), in
            # slots key % R: slot = key - ring0, minus R once past the end of the ring
            klo = max(start - WIN + 1, 0)
            ring0 = klo - klo % n_ctx
            kv_len = start + tok_hi + 1
            total = start + n
            t_first = (max(start + row0 // G - WIN + 1, 0) - klo) // BN   # first tile needed
        tiles_total = (total - klo + BN - 1) // BN
        tps = (tiles_total + n_splits - 1) // n_splits        # tiles per split
        if WIN == 0:
            tile_lo = split * tps
        else:
            tile_lo = max(split * tps, t_first)
        tile_hi = min(split * tps + tps, (kv_len - klo + BN - 1) // BN)

        # this lane's two packed rows
        ra = row0 + warp * 16 + g
        rb = ra + 8
        va = ra < nrows
        vb = rb < nrows
        tok_a = min(ra // G, n - 1)
        tok_b = min(rb // G, n - 1)
        head_a = kvh * G + ra % G
        head_b = kvh * G + rb % G
        lim_a = start + tok_a             # last key row a may see
        lim_b = start + tok_b
        low_a = lim_a - WIN + 1           # first key it may see (WIN > 0)
        low_b = lim_b - WIN + 1

        Ks = cuda.shared.array((BN, HDW), uint32, alignment=16)   # f16 pairs
        Vs = cuda.shared.array((BN, DVW), uint32, alignment=16)
        sks = cuda.shared.array(BN, float32)                      # K row scales

        qf = cuda.local.array(NQF, uint32)    # A fragments of Q, per k-step a0..a3
        for ks in range(NKS):
            for reg in range(4):
                col = ks * 16 + 2 * t4 + 8 * (reg >> 1)
                x0 = float32(0)
                x1 = float32(0)
                if reg & 1 == 0:
                    if va:
                        x0 = q[tok_a, head_a, col] * QSCALE
                        x1 = q[tok_a, head_a, col + 1] * QSCALE
                else:
                    if vb:
                        x0 = q[tok_b, head_b, col] * QSCALE
                        x1 = q[tok_b, head_b, col + 1] * QSCALE
                qf[ks * 4 + reg] = ptx.pack_half2(x0, x1)

        oacc = cuda.local.array(NO, float32)  # C fragments of O (this block's DV columns)
        for x in range(NNO * 4):
            oacc[x] = float32(0)
        sacc = cuda.local.array(NS, float32)  # C fragments of S, then P
        pk = cuda.local.array(NP, uint32)     # next tile's K words
        pv = cuda.local.array(NPV, uint32)    # next tile's V words
        pvs = cuda.local.array(NCHV, float32)      # V row scale of each chunk
        psk = float32(0)                           # K row scale (threads < BN)
        m_a = NEG_INF
        m_b = NEG_INF
        l_a = float32(0)                           # this lane's part of the row sums
        l_b = float32(0)

        # iteration i: issue loads of tile i, compute tile i-1 from shared memory,
        # then move tile i into shared memory
        i = tile_lo
        while i <= tile_hi:
            if i < tile_hi:
                kb = klo + i * BN
                if ND == 1:
                    # K and V chunks alike: one loop, both loads in flight together
                    for j in range(NCH):
                        cid = tid + j * THREADS
                        r = cid // CH
                        key = kb + r
                        if key < kv_len and cid < NCHT:
                            if WIN != 0:
                                key -= ring0         # position -> ring slot
                                if key >= n_ctx:
                                    key -= n_ctx
                            wi = (key * n_kv + kvh) * WPR + (cid % CH) * 4
                            w4 = ptx.ldg_v4(k_words, wi)
                            u4 = ptx.ldg_v4(v_words, wi)
                            for x in range(4):
                                pk[j * 4 + x] = w4[x]
                                pv[j * 4 + x] = u4[x]
                            if I8:
                                pvs[j] = v_scale[key, kvh]
                        else:
                            for x in range(4):
                                pk[j * 4 + x] = uint32(0)
                                pv[j * 4 + x] = uint32(0)
                            pvs[j] = float32(0)
                else:
                    for j in range(NCH):             # K: whole rows
                        cid = tid + j * THREADS
                        key = kb + cid // CH
                        if key < kv_len and cid < NCHT:
                            if WIN != 0:
                                key -= ring0
                                if key >= n_ctx:
                                    key -= n_ctx
                            w4 = ptx.ldg_v4(k_words, (key * n_kv + kvh) * WPR + (cid % CH) * 4)
                            for x in range(4):
                                pk[j * 4 + x] = w4[x]
                        else:
                            for x in range(4):
                                pk[j * 4 + x] = uint32(0)
                    for j in range(NCHV):            # V: this block's DV columns
                        cid = tid + j * THREADS
                        key = kb + cid // CHV
                        if key < kv_len and cid < NCHTV:
                            if WIN != 0:
                                key -= ring0
                                if key >= n_ctx:
                                    key -= n_ctx
                            u4 = ptx.ldg_v4(v_words, (key * n_kv + kvh) * WPR
                                            + (dh * CHV + cid % CHV) * 4)
                            for x in range(4):
                                pv[j * 4 + x] = u4[x]
                            if I8:
                                pvs[j] = v_scale[key, kvh]
                        else:
                            for x in range(4):
                                pv[j * 4 + x] = uint32(0)
                            pvs[j] = float32(0)
                if I8 and tid < BN:
                    psk = float32(0)
                    key = kb + tid
                    if key < kv_len:
                        if WIN != 0:
                            key -= ring0
                            if key >= n_ctx:
                                key -= n_ctx
                        psk = k_scale[key, kvh]

            if i > tile_lo:
                kb = klo + (i - 1) * BN
                # ---- S = Q K^T (log2 domain) ----
                for x in range(NNS * 4):
                    sacc[x] = float32(0)
                for ks in range(NKS):
                    for np2 in range(NNS // 2):
                        b = ptx.ldmatrix_x4(Ks, (np2 * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                 ks * 8 + ((lane >> 3) & 1) * 4))
                        for h in range(2):
                            o = (2 * np2 + h) * 4
                            d = ptx.mma_f16_f32(qf[ks * 4], qf[ks * 4 + 1], qf[ks * 4 + 2],
                                                qf[ks * 4 + 3], b[2 * h], b[2 * h + 1],
                                                sacc[o], sacc[o + 1], sacc[o + 2], sacc[o + 3])
                            for x in range(4):
                                sacc[o + x] = d[x]
                # ---- K scale, causal (and window) mask, running max ----
                mxa = NEG_INF
                mxb = NEG_INF
                for nt in range(NNS):
                    for e in range(4):
                        kl = nt * 8 + 2 * t4 + (e & 1)
                        s = sacc[nt * 4 + e]
                        if I8:
                            s *= sks[kl]
                        if e < 2:
                            if kb + kl > lim_a:
                                s = NEG_INF
                            if WIN != 0:
                                if kb + kl < low_a:
                                    s = NEG_INF
                            mxa = max(mxa, s)
                        else:
                            if kb + kl > lim_b:
                                s = NEG_INF
                            if WIN != 0:
                                if kb + kl < low_b:
                                    s = NEG_INF
                            mxb = max(mxb, s)
                        sacc[nt * 4 + e] = s
                mxa = max(mxa, cuda.shfl_xor_sync(FULL, mxa, 1))
                mxa = max(mxa, cuda.shfl_xor_sync(FULL, mxa, 2))
                mxb = max(mxb, cuda.shfl_xor_sync(FULL, mxb, 1))
                mxb = max(mxb, cuda.shfl_xor_sync(FULL, mxb, 2))
                mna = max(m_a, mxa)
                mnb = max(m_b, mxb)
                ba = mna if mna != NEG_INF else float32(0)   # a row with no key yet
                bb = mnb if mnb != NEG_INF else float32(0)
                alpha_a = math.exp2(m_a - ba)
                alpha_b = math.exp2(m_b - bb)
                m_a = mna
                m_b = mnb
                sa = float32(0)
                sb = float32(0)
                for nt in range(NNS):
                    for e in range(4):
                        if e < 2:
                            p = math.exp2(sacc[nt * 4 + e] - ba)
                            sa += p
                        else:
                            p = math.exp2(sacc[nt * 4 + e] - bb)
                            sb += p
                        sacc[nt * 4 + e] = p
                l_a = l_a * alpha_a + sa
                l_b = l_b * alpha_b + sb
                for nt in range(NNO):
                    oacc[nt * 4] *= alpha_a
                    oacc[nt * 4 + 1] *= alpha_a
                    oacc[nt * 4 + 2] *= alpha_b
                    oacc[nt * 4 + 3] *= alpha_b
                # ---- O += P V ----
                for kp in range(NKP):
                    o0 = 2 * kp * 4
                    o1 = o0 + 4
                    a0 = ptx.pack_half2(sacc[o0], sacc[o0 + 1])
                    a1 = ptx.pack_half2(sacc[o0 + 2], sacc[o0 + 3])
                    a2 = ptx.pack_half2(sacc[o1], sacc[o1 + 1])
                    a3 = ptx.pack_half2(sacc[o1 + 2], sacc[o1 + 3])
                    for dn in range(NNO // 2):
                        b = ptx.ldmatrix_x4_trans(Vs, (kp * 16 + (lane & 15),
                                                       dn * 8 + (lane >> 4) * 4))
                        for h in range(2):
                            o = (2 * dn + h) * 4
                            d = ptx.mma_f16_f32(a0, a1, a2, a3, b[2 * h], b[2 * h + 1],
                                                oacc[o], oacc[o + 1], oacc[o + 2], oacc[o + 3])
                            for x in range(4):
                                oacc[o + x] = d[x]

            if i < tile_hi:
                cuda.syncthreads()            # every warp is done reading the old tile
                if ND == 1:
                    for j in range(NCH):
                        cid = tid + j * THREADS
                        r = cid // CH
                        cc = cid % CH
                        if cid >= NCHT:
                            pass
                        elif I8:
                            sv = pvs[j]
                            for x in range(4):
                                w = pk[j * 4 + x]     # K: exact int8 values as f16
                                Ks[r, cc * 8 + 2 * x] = ptx.pack_half2(_byte(w, 0), _byte(w, 1))
                                Ks[r, cc * 8 + 2 * x + 1] = ptx.pack_half2(_byte(w, 2), _byte(w, 3))
                                w = pv[j * 4 + x]     # V: dequantized
                                Vs[r, cc * 8 + 2 * x] = ptx.pack_half2(_byte(w, 0) * sv,
                                                                       _byte(w, 1) * sv)
                                Vs[r, cc * 8 + 2 * x + 1] = ptx.pack_half2(_byte(w, 2) * sv,
                                                                           _byte(w, 3) * sv)
                        else:
                            for x in range(4):
                                Ks[r, cc * 4 + x] = pk[j * 4 + x]
                                Vs[r, cc * 4 + x] = pv[j * 4 + x]
                else:
                    for j in range(NCH):
                        cid = tid + j * THREADS
                        r = cid // CH
                        cc = cid % CH
                        if cid < NCHT:
                            for x in range(4):
                                w = pk[j * 4 + x]
                                if I8:        # K: exact int8 values as f16
                                    Ks[r, cc * 8 + 2 * x] = ptx.pack_half2(_byte(w, 0),
                                                                           _byte(w, 1))
                                    Ks[r, cc * 8 + 2 * x + 1] = ptx.pack_half2(_byte(w, 2),
                                                                               _byte(w, 3))
                                else:
                                    Ks[r, cc * 4 + x] = w
                    for j in range(NCHV):
                        cid = tid + j * THREADS
                        r = cid // CHV
                        cc = cid % CHV
                        if cid < NCHTV:
                            sv = pvs[j]
                            for x in range(4):
                                w = pv[j * 4 + x]
                                if I8:        # V: dequantized
                                    Vs[r, cc * 8 + 2 * x] = ptx.pack_half2(_byte(w, 0) * sv,
                                                                           _byte(w, 1) * sv)
                                    Vs[r, cc * 8 + 2 * x + 1] = ptx.pack_half2(_byte(w, 2) * sv,
                                                                               _byte(w, 3) * sv)
                                else:
                                    Vs[r, cc * 4 + x] = w
                if I8 and tid < BN:
                    sks[tid] = psk
                cuda.syncthreads()            # the new tile is visible
            i += 1

        # ---- epilogue: full row sums, normalise or write the split's partials ----
        l_a += cuda.shfl_xor_sync(FULL, l_a, 1)
        l_a += cuda.shfl_xor_sync(FULL, l_a, 2)
        l_b += cuda.shfl_xor_sync(FULL, l_b, 1)
        l_b += cuda.shfl_xor_sync(FULL, l_b, 2)
        for half in range(2):
            valid = va if half == 0 else vb
            if valid:
                tok = tok_a if half == 0 else tok_b
                head = head_a if half == 0 else head_b
                l_row = l_a if half == 0 else l_b
                m_row = m_a if half == 0 else m_b
                if n_splits == 1:
                    inv = float32(1) / l_row
                    for nt in range(NNO):
                        col = head * HD + dh * DV + nt * 8 + 2 * t4
                        out[tok, col] = oacc[nt * 4 + 2 * half] * inv
                        out[tok, col + 1] = oacc[nt * 4 + 2 * half + 1] * inv
                else:
                    prow = tok * n_head + head
                    for nt in range(NNO):
                        pc = dh * DV + nt * 8 + 2 * t4
                        part_o[split, prow, pc] = oacc[nt * 4 + 2 * half]
                        part_o[split, prow, pc + 1] = oacc[nt * 4 + 2 * half + 1]
                    if t4 == 0 and dh == 0:
                        part_ml[split, prow, 0] = m_row
                        part_ml[split, prow, 1] = l_row

    kernel.block_n = BN
    return kernel_cache.attach(kernel)


@cuda.jit(device=True)
def merge_weights(part_ml, n_splits, row):
    """(the largest running max m_s, 1 / sum_s 2^(m_s - max) l_s) of one query row's split
    partials: split s's O weighs 2^(m_s - max) / that sum (flash-decoding's merge)."""
    mx = NEG_INF
    for s in range(n_splits):
        mx = max(mx, part_ml[s, row, 0])
    den = float32(0)
    for s in range(n_splits):
        den += math.exp2(part_ml[s, row, 0] - mx) * part_ml[s, row, 1]
    return mx, float32(1) / den


@cuda.jit(device=True)
def merge_value(part_o, part_ml, n_splits, row, d, mx, inv):
    """Column d of one query row's merged output, from merge_weights' (mx, inv)."""
    acc = float32(0)
    for s in range(n_splits):
        acc += math.exp2(part_ml[s, row, 0] - mx) * part_o[s, row, d]
    return acc * inv


@cuda.jit
def prefill_merge(part_o, part_ml, n_splits, state, splits_at, out):
    # part_o  f32 [S, >= n*n_head, hd]; part_ml f32 [S, >= n*n_head, 2]
    # n_splits i32 (<= S) splits of the launch; splits_at i32: >= 0 reads the count from
    # state[splits_at] instead (clamped to 1 .. n_splits), and one split means the attention
    # kernel wrote out itself: nothing to merge. out f32 [n, n_head * hd]
    # grid (n * n_head,), any block size: one row (token, head) per block
    if splits_at >= 0:
        n_splits = min(max(state[splits_at], 1), n_splits)
        if n_splits == 1:
            return
    row = cuda.blockIdx.x
    hd = part_o.shape[2]
    n_head = out.shape[1] // hd
    tok = row // n_head
    head = row - tok * n_head
    mx, inv = merge_weights(part_ml, n_splits, row)
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        out[tok, head * hd + d] = merge_value(part_o, part_ml, n_splits, row, d, mx, inv)


def launch_merge(part_o, part_ml, n_splits: int, state, splits_at, out, n_head: int, stream=0) -> None:
    """prefill_merge of a split launch's partials into out float32 [n, n_head * hd]: one block
    of 128 threads per (token, head) row; splits_at None merges n_splits splits, a state slot
    reads the count in use there."""
    prefill_merge[out.shape[0] * n_head, 128, stream](part_o, part_ml, np.int32(n_splits), state,
                                                      np.int32(-1 if splits_at is None else splits_at), out)


PREFILL_SIGNATURE = ("void(float32[:, :, ::1], uint32[::1], uint32[::1], float32[:, ::1], "
                     "float32[:, ::1], int32[::1], float32[:, ::1], float32[:, :, ::1], "
                     "float32[:, :, ::1], int32)")
MERGE_SIGNATURE = "void(float32[:, :, ::1], float32[:, :, ::1], int32, int32[::1], int32, float32[:, ::1])"
kernel_cache.attach(prefill_merge)   # compiled kernels persist on disk (engine/kernel_cache.py)
