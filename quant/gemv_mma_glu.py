"""Gate, up and the gated activation in one launch of the int8 tensor-core GEMV (lab, 2026-12-05).

    out[t, r] = act(x Wg^T)[t, r] * (x Wu^T)[t, r]        act: silu (SwiGLU) or gelu (tanh form)

for 1-8 tokens of q8_K activations and two Q4_K weights of the same shape (a Q4_K_M file's
ffn_gate and ffn_up). It is gemv_mma_k.py's kernel with a second A operand: a thread block takes
the same 16 rows of both weights, each trip loads the token's q8_K values once (`make_token_loads`)
and both weights' blocks, and runs the block's mma twice (`_tokens` into accumulators 0..3 for the
gate, 4..7 for the up rows). The warps' sums meet in shared memory as gemv_mma_k's do; warp 0
then writes act(gate) * up. The gate and up outputs are never stored, and the activation is no
launch of its own: the short prefill's FFN (engine/cuda_short_prefill.py) goes from three
launches to one.

The activation's arithmetic is engine/norm.py's swiglu / geglu kernels' (the same float32
expressions), so only the products' rounding differs from gemv_mma_k twice plus norm.swiglu:
the sums are the same integers, in the same order, so the bits are equal (tests/test_gemv_mma_glu.py).

Status: checked in the simulator and by ptxas; on an H100 (2026-12-06) the same bits as its parts,
15.9 us for 8 tokens of the 4B's 9,728 x 2,560 against 23.1 for the three launches (kernels/gemv.md
8h). Used by the short prefill (a lab switch, off), not by the engine's default path.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .formats import QType
from .gemv_mma import ROWS, _dev, _flat, lanes, make_block_loop
from .gemv_mma_k import _bases, _fits, _tokens, make_token_loads, make_weight_loads, plan_ksplit, q8k_inputs
from .gemv_mma_k_w16 import _bases16, split16
from .q8k_layout import xd_base
from .pdl import triggers as pdl_triggers

SIGNATURE = ("void(uint32[::1], uint32[::1], uint32[::1], uint32[::1], int64, int64, uint32[::1], float32[::1], "
             "int32[::1], int64, int64, int64, float32[::1])")
GELU_A = float32(0.044715)                        # ggml's GELU_COEF_A (engine/norm.py)
GELU_S = float32(0.79788456080286535587989211986876)
ACTS = ("silu", "gelu")


def _make_finish(NW: int, ACT: str):
    """finish(acc, warp, lane, r0, t0, rows, ldy, n_tok, y): the block's warps' 8 sums added in
    shared memory, then warp 0 stores act(acc[k]) * acc[k + 4] at y[token * ldy + row]
    (gemv_mma.make_finish's layout for k < 4)."""
    @_dev
    def finish(acc, warp, lane, r0, t0, rows, ldy, n_tok, y):
        if NW > 1:
            red = cuda.shared.array((NW, 32, 8), float32)
            for k in range(8):
                red[warp, lane, k] = acc[k]
            cuda.syncthreads()
            if warp != 0:
                return
            for other in range(1, NW):
                for k in range(8):
                    acc[k] += red[other, lane, k]
        for k in range(4):
            r = r0 + 8 * ((k >> 1) & 1)
            tk = t0 + (k & 1)
            if r < rows and tk < n_tok:
                a = acc[k]
                if ACT == "silu":
                    v = a / (float32(1) + math.exp(-a)) * acc[k + 4]
                else:
                    t = math.tanh(GELU_S * a * (float32(1) + GELU_A * a * a))
                    v = float32(0.5) * a * (float32(1) + t) * acc[k + 4]
                y[uint32(tk * ldy + r)] = v
    return finish


# The PDL build's register cap (cuda.jit max_registers; None: none). Uncapped it takes 173 registers
# against the plain build's 167 (sm_90 ptxas, k-split 2, pipelined): 5 thread blocks of 64 threads
# an SM instead of 6. At 168 ptxas spills nothing. The gate/up launch's PDL build cost ~7 us a layer
# of the short graph uncapped (H100, 2026-12-06; docs/kernels/gemv.md 8i).
PDL_MAX_REGISTERS = 168


def _both_weights(weight_loads):
    """make_block_loop's wloads for the gate and up rows: weight_loads (gemv_mma_k.make_weight_loads)
    of both weights' block blk."""
    @_dev
    def wloads(wa, wb, wa2, wb2, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, nsb, nb, blk):
        return (weight_loads(wa, wb, nblk, rr0, rr1, wi0, wi1, blk),
                weight_loads(wa2, wb2, nblk, rr0, rr1, wi0, wi1, blk))
    return wloads


@functools.lru_cache(maxsize=None)
def mma_glu_q4k_q8k_kernel(KSPLIT: int = 2, PIPE: bool = True, ACT: str = "silu", PDL: int = 0,
                           MAXREG: int | None = None, W16: bool = False):
    """The kernel: grid ceil(rows / 16) blocks of 32 * KSPLIT threads. Arguments: wa, wb (the gate
    weight's Q4_K planes), wa2, wb2 (the up weight's), nu, rows, xq, xd, xb (q8_K, gemv_mma_k's),
    cols, n_tok (<= 8), ldy, y (float32, token t's row at t * ldy). PDL: as gemv_mma_k's (both
    weights' first block loaded before the wait). MAXREG: cuda.jit's max_registers (a GPU build).
    W16: both weights by 16-byte lane loads (quant/gemv_mma_k_w16.py;
    the short graph's build, unpipelined, since 2026-12-06)."""
    if ACT not in ACTS:
        raise ValueError(f"mma_glu_q4k_q8k_kernel: ACT {ACT!r} must be one of {ACTS}")
    NW = KSPLIT
    finish = _make_finish(NW, ACT)

    token_loads = make_token_loads(PDL, W16)
    wloads = _both_weights(make_weight_loads(PDL, W16))         # PDL: loads that stay above the wait
    wloads_ro = _both_weights(make_weight_loads(False, W16))    # the later blocks' (read-only: make_block_loop's wrest)
    trigger_first, trigger_late = pdl_triggers(PDL)

    @_dev
    def tloads(wa, wb, wa2, wb2, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, nsb, nb, blk):
        return token_loads(xq, xd, xb, tok, nsb, nb, blk)

    @_dev
    def block(acc, W, X):
        _tokens(acc, 0, split16(W[0]) if W16 else W[0], X)     # gate rows
        _tokens(acc, 4, split16(W[1]) if W16 else W[1], X)     # up rows: the same B fragment

    run = make_block_loop(wloads, tloads, block, PIPE, PDL, wrest=wloads_ro if PDL else None)
    jit = cuda.jit(max_registers=MAXREG) if MAXREG and not ptx.SIMULATOR else cuda.jit

    @jit
    def kernel(wa, wb, wa2, wb2, nu, rows, xq, xd, xb, cols, n_tok, ldy, y):
        trigger_first()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        g, t, rr0, rr1, nblk, b_lo, b_hi, tb, ta, tc, _, _, _ = lanes(cuda.blockIdx.x, warp, lane, rows, nu, n_tok, NW)
        nsb = cols >> 5
        nb = cols >> 8
        acc = cuda.local.array(8, float32)           # k < 4: gate, as gemv_mma_k's; k >= 4: up
        for k in range(8):
            acc[k] = float32(0)
        if W16:
            wi0, wi1, xi, xj = _bases16(nu, rr0, rr1, t, tb, cols)
            tok = (g < n_tok, xi, xd_base(ta, nb), xd_base(tc, nb), xj)
        else:
            wi0, wi1, xi = _bases(nu, rr0, rr1, t, tb, cols)
            tok = (g < n_tok, xi, xd_base(ta, nb), xd_base(tc, nb))
        run(acc, (wa, wb, wa2, wb2, xq, xd, xb, nblk, rr0, rr1, wi0, wi1, tok, nsb, nb), b_lo, b_hi, nblk)
        trigger_late()
        finish(acc, warp, lane, cuda.blockIdx.x * ROWS + g, 2 * t, rows, ldy, n_tok, y)
    return kernel_cache.attach(kernel)


def gemv_mma_glu(wg, wu, xq, xd, xb, y, n_tok: int, act: str = "silu", ksplit: int | None = None,
                 pipe: bool = True, stream=0, pdl: bool = False, w16: bool = False) -> None:
    """y [n_tok, rows] = act(x Wg^T) * (x Wu^T) for two Q4_K GemvWeights of one shape (dp4a mode)
    and q8_K activations (gemv_mma_k's xq, xd, xb); 1 <= n_tok <= 8. ksplit None: plan_ksplit's
    for the shape. pdl: as gemv_mma_k's. w16: the weights by 16-byte lane loads (unpipelined,
    the short graph's since 2026-12-06: 14.4 against 15.4 us a layer on an H100, docs/kernels/gemv.md
    8k; pipelined, gemv_mma_k's held 164 registers). No allocation, no
    synchronization."""
    from . import pdl as P
    for name, w in (("gate", wg), ("up", wu)):
        if w.qtype != QType.Q4_K:
            raise ValueError(f"gemv_mma_glu: the {name} weight is {w.qtype.name}; only Q4_K (else gemv_mma_k "
                             "twice and the activation)")
    if (wg.rows, wg.cols) != (wu.rows, wu.cols):
        raise ValueError(f"gemv_mma_glu: gate {wg.rows}x{wg.cols} and up {wu.rows}x{wu.cols} differ")
    if not 1 <= n_tok <= 8:
        raise ValueError(f"gemv_mma_glu: n_tok {n_tok} must be 1..8")
    if act not in ACTS:
        raise ValueError(f"gemv_mma_glu: act {act!r} must be one of {ACTS}")
    rows, cols = wg.rows, wg.cols
    ksplit = plan_ksplit(rows, cols, n_tok) if ksplit is None else ksplit
    if not 1 <= ksplit <= 16:
        raise ValueError(f"gemv_mma_glu: ksplit {ksplit} must be 1..16")
    xq, xd, xb = q8k_inputs("gemv_mma_glu", (wg, wu), xq, xd, xb, n_tok, cols, read_xb=True, w16=bool(w16))
    yf = _flat(y, np.float32, n_tok * rows, "y", "gemv_mma_glu")
    maxreg = PDL_MAX_REGISTERS if pdl else None
    build = P.build(bool(pdl))
    kern = mma_glu_q4k_q8k_kernel(ksplit, bool(pipe), act, build, maxreg, bool(w16))
    if not ptx.SIMULATOR:
        _fits(kern, SIGNATURE, (f"Q4_K {act}", ksplit, bool(pipe), 8, build, maxreg, bool(w16)))
    P.launch_or_plain(kern, (rows + ROWS - 1) // ROWS, 32 * ksplit, stream, SIGNATURE, bool(pdl), wg.wa, wg.wb,
                      wu.wa, wu.wb, wg.units, rows, xq, xd, xb, cols, n_tok, rows, yf)


if __name__ == "__main__":      # python -m genie_rt.quant.gemv_mma_glu [--json PATH]: GPU only (and gemv_mma_qkv)
    from .gemv_mma_k_bench import bench_glu
    raise SystemExit(bench_glu())
