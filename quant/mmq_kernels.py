"""MMQ kernels: prefill GEMM Y = X W^T on tensor cores, straight from the planar quantized layout.

This file holds the GEMM kernel factory of the MMQ family: the stage ring, the X loader,
the mma step, the split-K paths and the epilogue. The epilogue and reduction codes, the
format names and the shared-memory geometry are in `mmq_defs.py`; each format's code,
stage loader, scale decode and fragment dequantization in `mmq_kquants.py` (Q4_K, Q5_K,
Q6_K, Q8_0), `mmq_legacy.py` (the 32-weight formats) and `mmq_float.py` (F16, BF16);
prepare_x and the peak probe in `mmq_prep.py`, the split-K reduction kernel
(RED_KERNEL) in `mmq_reduce.py`, the fp16x2 FMA intrinsic in `ptx.py`; the launchers in
`mmq.py` (read its docstring first), the plans in `mmq_plan.py`, the numpy reference in
`mmq_reference.py`; the lesson in docs/kernels/mmq.md.

What the kernels compute (all shapes row-major):
    W  [rows, cols]  Q4_K / Q5_K / Q6_K / Q8_0 PackedWeight planes (quant/layout.py;
                     mmq_kquants.py), the 32-weight formats (mmq_legacy.py) or F16 / BF16
                     (mmq_float.py): each format plugs its device functions in
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
constants), so numba emits no negative-index wrap-around; a signed index would
add a compare and select to every shared-memory access in the inner loop.
"""
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import mmq_float as F
from . import mmq_kquants as Q
from . import mmq_legacy as L
from .mmq_defs import (EPI_ADD, EPI_GEGLU, EPI_STORE, EPI_SWIGLU, GATED, MAX_REGISTERS, RAW_CHUNKS,
                       RED_KERNEL, RED_LAST, SC_ENTRIES, SC_WORDS, U, X_WORDS, _gate_act, _inline,
                       _wait_group, register_capped)
from .mmq_kquants import KQ45, Q4_K, Q5_K, Q6_K, Q8_0
from .pdl import hooks
from .ptx import (SIMULATOR, cp_async16_zfill, cp_async_commit, ldmatrix_x2, ldmatrix_x4,
                  mma_f16_f32)


# =====================================================================================
# The GEMM kernel factory. Compile-time constants are closure variables (numba freezes
# them); each (format, tile shape, stages, epilogue) is its own kernel.
# =====================================================================================
def build_mmq_kernel(fmt, wm, wn, mt, nt, stages, epi, red=RED_LAST, pdl=False):
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

    pdl: the programmatic-dependent-launch build (sm_90+, quant/pdl.py): it lets the next kernel
    launch at once, copies the prologue stages' weights before griddepcontrol.wait and reads X,
    xscale, y and the workspace only after it (rules 1-3 of pdl.py; X by cp.async, which goes
    through L2). Same operations in the same order after the copies land: the same bits.
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
    PDL = bool(pdl)
    wait, launch_dependents, _ = hooks(PDL)
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
    def load_weights(smem, p0, p1, p2, st, buf, m0, rows_out, tid):
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

    @_inline
    def load_x(smem, x, st, buf, n0, n_tok, x_rows_blk, tid):
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

    @_inline
    def load_stage(smem, p0, p1, p2, x, st, buf, m0, n0, n_tok, rows_out, x_rows_blk, tid):
        load_weights(smem, p0, p1, p2, st, buf, m0, rows_out, tid)
        load_x(smem, x, st, buf, n0, n_tok, x_rows_blk, tid)

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

    # the k-quants' plane loader, scale decode and compute (mmq_kquants.py; built for
    # every format, the branches that call them are pruned for the others)
    load_plane, decode_scales, load_d6, q4k_chunk, q6k_half, q8_block = Q.make(
        fmt, mt, NTH, BM, PER_T, uRW, uSCW, uSCE, uRAW_STAGE, uSC_OFF, uSC_BUF, weight_row, mma_group)

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
        launch_dependents()                              # PDL: the next kernel may launch
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

        # prologue: stages st0 .. st0 + stages - 2 in flight. A PDL build issues their weight
        # copies (constants) before griddepcontrol.wait and X's (prepare_x's output) after it;
        # the first commit group then holds every prologue stage's weights (a wait_group for
        # stage st0 waits for all of them: they were issued first anyway)
        if PDL:
            for s in range(stages - 1):
                if st0 + U(s) < st1:
                    load_weights(smem, p0, p1, p2, st0 + U(s), U(s), m0, rows_out, tid)
            wait()
        for s in range(stages - 1):
            if st0 + U(s) < st1:
                if not PDL:
                    load_weights(smem, p0, p1, p2, st0 + U(s), U(s), m0, rows_out, tid)
                load_x(smem, x, st0 + U(s), U(s), n0, n_tok, x_rows_blk, tid)
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

    kernel.mmq_meta = dict(fmt=fmt, wm=wm, wn=wn, mt=mt, nt=nt, stages=stages, epi=epi, red=red, pdl=PDL,
                           threads=NTH, bm=BM, bm_out=BM // 2 if swiglu else BM, bn=8 * nt * wn)
    return kernel_cache.attach(kernel)
