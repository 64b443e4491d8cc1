"""MMQ kernel family: the codes and the shared-memory geometry that the GEMM kernels
(mmq_kernels.py), the split-K reduction (mmq_reduce.py) and the planner (mmq_plan.py)
share, and the small device functions both kernels inline.

    FORMAT_NAMES                    kernel format codes (mmq_kquants.py, mmq_legacy.py,
                                    mmq_float.py define them) -> GGUF names
    EPI_*, GATED                    epilogues: store, add, SwiGLU, GeGLU
    RED_*                           how a split K is summed
    STAGE_K, RAW_CHUNKS, SC_WORDS,  the stage ring's geometry per format: smem_bytes(...)
    SC_ENTRIES, X_WORDS             is what one block needs, without building the kernel
    MAX_REGISTERS, register_capped  which kernels compile under a register cap
    _inline, _wait_group, _gate_act device-function helpers (silu / gelu-tanh)
"""
import math

import numpy as np
from numba import cuda, float32

from . import mmq_float as F
from . import mmq_kquants as Q
from . import mmq_legacy as L
from .ptx import SIMULATOR, cp_async_wait_group_0, cp_async_wait_group_1, cp_async_wait_group_2

U = np.uint32

FORMAT_NAMES = {**Q.NAMES, **L.NAMES, **F.NAMES}
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
MAX_REGISTERS = 128      # per thread, for warp tiles of <= 16 mma tiles (see register_capped)
# Raw 16-byte chunks of one weight row for one stage (what cp.async moves) and words of
# the scale table per row per stage, per format: the k-quants' in mmq_kquants.py (with
# the bank arithmetic of the row strides), the 32-weight formats' in mmq_legacy.py,
# F16/BF16's in mmq_float.py.
RAW_CHUNKS = {**Q.RAW_CHUNKS, **L.RAW_CHUNKS, **F.RAW_CHUNKS}
SC_WORDS = {**Q.SC_WORDS, **L.SC_WORDS, **F.SC_WORDS}
SC_ENTRIES = {**Q.SC_ENTRIES, **{f: L.SC_ENTRIES for f in L.LEGACY},
              **{f: 4 for f in F.FLOAT}}          # (F16/BF16: no table; 4 keeps the loops' shape)
X_WORDS = 68             # one token's 128 fp16 per stage = 64 words, + 4 pad: ldmatrix rows
                         # 272 B apart start in different 16-byte bank groups (conflict-free)

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
