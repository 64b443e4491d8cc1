"""The prefill attention's split merge, fused into the O-projection's input conversion.

A short chunk after a long cached prefix splits its key range over several blocks
(kvcache/attention_prefill.py, `prefill_splits`); each writes (O, m, l) per query row to the
workspace and `prefill_merge` combines them into the attention output, which the prefill
GEMM then converts to fp16 (quant/mmq.py `prepare_x`). A bucket's one graph launches the
most splits any start may need and reads the count in use from the device state, so at a
shallow start (one split) the merge launch is a node that returns at once - paid in every
layer of every short prompt (2026-12-03, H200: pp18 -6 %, pp33 -8 %).

`merge_prepare_x` is both in one launch, one block per token row (prepare_x's grid): with
one split it is prepare_x of the attention output; with more it merges each value as
prefill_merge does (its device functions merge_weights / merge_value, so the same float32 bits),
writes it to the attention output (which then holds what the merge would have written) and
converts it. The engine uses it when the next op after the attention is the GEMM that reads
its output (engine/cuda_ops.py `PrefillOps`); anything else gets the merge launch.

`merge_q8k` is the same for the short prefill's graph (engine/cuda_short_prefill.py), whose
O-projection reads q8_K activations (quant/gemv_mma_k.py): one launch that merges (or, with one
split, reads) the attention output and writes its q8_K values - a thread block of 256 threads a
token's 256-value block, a thread a value - where the graph had the merge and then
quant/quantize_q8k.py's launch.

Reference: `prefill_merge` followed by `prepare_x`, or by `rmsnorm_q8k` without a norm weight
(tests/test_attention_merge.py compares bits under the simulator).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int8, int32

from genie_rt.engine import kernel_cache
from genie_rt.quant.mmq_prep import PREP_THREADS, _norm_and_scale, _pair_pos
from genie_rt.quant.pdl import hooks, wanted
from genie_rt.quant.norm_q8_device import FULL, q8k_round, q8k_scale
from genie_rt.quant.ptx import SIMULATOR, pack_half2
from genie_rt.quant.q8k_layout import check, xd_base, xq_word

from .attention_prefill_kernels import merge_value, merge_weights

MAX_HEADS = 128                       # query heads per token row (shared memory per block)
_dev = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def _make_merge_prepare_x(PDL: bool):
    _, launch_dependents, _ = hooks(PDL)

    @cuda.jit
    def merge_prepare_x_kernel(part_o, part_ml, n_splits, state, splits_at, x, out16, xscale):
        launch_dependents()        # the PDL build: the O-projection's mmq may launch at once
        _merge_prepare_x_body(part_o, part_ml, n_splits, state, splits_at, x, out16, xscale)
    return kernel_cache.attach(merge_prepare_x_kernel)


@_dev
def _merge_prepare_x_body(part_o, part_ml, n_splits, state, splits_at, x, out16, xscale):
    # part_o  f32 [S, >= n*n_head, hd]; part_ml f32 [S, >= n*n_head, 2] (the split workspace)
    # n_splits i32: the launch's most splits; splits_at i32 >= 0: the count in use is
    #          state[splits_at] (clamped to 1 .. n_splits), < 0: n_splits
    # x       f32 [n, n_head * hd]: the attention output (one split: written by the attention
    #         kernel; more: written here with the merged values)
    # out16   u32 [n, n_head * hd / 2], xscale f32 [n]: prepare_x's outputs (no norm)
    mx_h = cuda.shared.array(MAX_HEADS, float32)
    inv_h = cuda.shared.array(MAX_HEADS, float32)
    red = cuda.shared.array(PREP_THREADS, float32)
    tok = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    cols = x.shape[1]
    hd = part_o.shape[2]
    n_head = cols // hd
    count = n_splits
    if splits_at >= 0:
        count = min(max(state[splits_at], 1), n_splits)
    if count > 1:                               # block-uniform
        h = tid
        while h < n_head:                       # prefill_merge's weights, per head
            mx_h[h], inv_h[h] = merge_weights(part_ml, count, tok * n_head + h)
            h += PREP_THREADS
        cuda.syncthreads()
    m = float32(0.0)
    k = tid
    while k < cols:
        if count > 1:
            h = k // hd
            v = merge_value(part_o, part_ml, count, tok * n_head + h, k - h * hd, mx_h[h], inv_h[h])
            x[tok, k] = v
        else:
            v = x[tok, k]
        m = max(m, abs(v))
        k += PREP_THREADS
    red[tid] = m
    cuda.syncthreads()                          # also: this block's merged x, visible to it
    step = PREP_THREADS // 2
    while step > 0:
        if tid < step:
            red[tid] = max(red[tid], red[tid + step])
        cuda.syncthreads()
        step //= 2
    _, inv = _norm_and_scale(red[0], float32(0), cols, float32(0), 0, xscale, tok, tid)
    q = tid
    while q < cols >> 1:
        p = _pair_pos(q)
        out16[tok, q] = pack_half2(x[tok, p] * inv, x[tok, p + 2] * inv)
        q += PREP_THREADS


@functools.lru_cache(maxsize=None)
def merge_prepare_x_kernel_for(pdl: bool = False):
    """The merge + prepare_x kernel; pdl: the build that executes griddepcontrol.launch_dependents
    first (sm_90+), so the O-projection's mmq launched after it by programmatic dependent launch
    copies its weights at once (quant/pdl.py). Launched as always either way."""
    return _make_merge_prepare_x(bool(pdl))


merge_prepare_x_kernel = merge_prepare_x_kernel_for(False)
MERGE_PREPARE_SIGNATURE = ("void(float32[:, :, ::1], float32[:, :, ::1], int32, int32[::1], int32, "
                           "float32[:, ::1], uint32[:, ::1], float32[::1])")


def merge_prepare_x(part_o, part_ml, n_splits: int, state, splits_at: int | None, x, x16, xscale,
                    stream=0, pdl: bool = False) -> None:
    """The split merge of a prefill attention launch (its workspace part_o / part_ml, its most
    splits n_splits, the count in use from state[splits_at] or n_splits when None) into x
    float32 [n, n_head * hd], then prepare_x(x) into x16 float16 [n, cols] and xscale float32
    [n] - one launch. Same bits as prefill_merge then quant.mmq.prepare_x. pdl: the build that
    lets the next kernel launch at once (merge_prepare_x_kernel_for)."""
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"merge_prepare_x: x must be float32 [n, cols], got {x.dtype} {tuple(x.shape)}")
    n, cols = x.shape
    hd = part_o.shape[2]
    if cols % hd or cols // hd > MAX_HEADS or cols % 16:
        raise ValueError(f"merge_prepare_x: {cols} columns are not n_head x head_dim {hd} with "
                         f"n_head <= {MAX_HEADS} and a multiple of 16")
    if part_o.shape[0] < n_splits or part_ml.shape[0] < n_splits or part_o.shape[1] < n * (cols // hd):
        raise ValueError(f"merge_prepare_x: the workspace {tuple(part_o.shape)} holds fewer than "
                         f"{n_splits} splits of {n * (cols // hd)} rows")
    if tuple(x16.shape) != (n, cols) or x16.dtype != np.float16:
        raise ValueError(f"merge_prepare_x: x16 must be float16 [{n}, {cols}], got {x16.dtype} {tuple(x16.shape)}")
    if tuple(xscale.shape) != (n,) or xscale.dtype != np.float32:
        raise ValueError(f"merge_prepare_x: xscale must be float32 [{n}], got {xscale.dtype} {tuple(xscale.shape)}")
    at = np.int32(-1 if splits_at is None else splits_at)
    merge_prepare_x_kernel_for(wanted(pdl))[n, PREP_THREADS, stream](part_o, part_ml, np.int32(n_splits), state,
                                                             at, x, x16.view(np.uint32), xscale)


QK = 256                              # values of a q8_K block (one scale)


@cuda.jit
def merge_q8k_kernel(part_o, part_ml, n_splits, state, splits_at, x, xq, xd, xb):
    # part_o, part_ml, n_splits, state, splits_at, x: as _merge_prepare_x_body's
    # xq int8, xd f32, xb i32: q8_K of x (quantize_q8k), tiled (quant/q8k_layout.py: whole groups of 8 rows)
    # grid (n, cols / 256), 256 threads: thread i holds column 256 * blockIdx.y + i of token blockIdx.x
    sh = cuda.shared.array(8, float32)
    tok = cuda.blockIdx.x
    blk = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    lane = tid & 31
    cols = x.shape[1]
    hd = part_o.shape[2]
    n_head = cols // hd
    c = blk * QK + tid
    count = n_splits
    if splits_at >= 0:
        count = min(max(state[splits_at], 1), n_splits)
    if count > 1:                               # block-uniform
        h = c // hd
        row = tok * n_head + h
        mx, inv = merge_weights(part_ml, count, row)
        v = merge_value(part_o, part_ml, count, row, c - h * hd, mx, inv)
        x[tok, c] = v
    else:
        v = x[tok, c]
    a = abs(v)
    for off in (16, 8, 4, 2, 1):
        a = max(a, cuda.shfl_xor_sync(FULL, a, off))
    if lane == 0:
        sh[tid >> 5] = a
    cuda.syncthreads()
    a = sh[0]
    for w in range(1, 8):
        a = max(a, sh[w])
    # quantize_q8k's arithmetic (and rmsnorm_q8k's without a norm weight): the same bits
    scale, qinv = q8k_scale(a)
    q = q8k_round(v, qinv)
    xq[4 * xq_word(tok, cols) + (c >> 5) * 256 + (c & 31)] = int8(q)      # tiled (q8k_layout)
    tot = q
    for off in (16, 8, 4, 2, 1):                # a warp is one 32-value sub-block
        tot = int32(tot + cuda.shfl_xor_sync(FULL, tot, off))
    ix = xd_base(tok, cols // QK) + 8 * blk                           # the tiled xd, xb (q8k_layout)
    if lane == 0:
        xb[ix * 8 + (tid >> 5)] = tot
    if tid == 0:
        xd[ix] = scale


kernel_cache.attach(merge_q8k_kernel)
MERGE_Q8K_SIGNATURE = ("void(float32[:, :, ::1], float32[:, :, ::1], int32, int32[::1], int32, float32[:, ::1], "
                       "int8[::1], float32[::1], int32[::1])")


def merge_q8k(part_o, part_ml, n_splits: int, state, splits_at: int | None, x, xq, xd, xb, stream=0) -> None:
    """The split merge of a prefill attention launch (as merge_prepare_x: its workspace, its most
    splits n_splits, the count in use from state[splits_at] or n_splits when None) into x float32
    [n, n_head * hd], then the q8_K of x into xq int8, xd float32, xb int32 tiled (quant/q8k_layout.py:
    whole groups of 8 rows, any shapes of its `sizes`) - one launch. Same bits as prefill_merge then
    quant/quantize_q8k.rmsnorm_q8k(x, None, ...). n_splits 1: x as the attention kernel wrote it,
    quantized; the workspace (then a placeholder) is not read. No allocation, no synchronization."""
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"merge_q8k: x must be float32 [n, cols], got {x.dtype} {tuple(x.shape)}")
    n, cols = x.shape
    hd = part_o.shape[2]
    if cols % hd or cols % QK:
        raise ValueError(f"merge_q8k: {cols} columns must be n_head x head_dim {hd} and a multiple of {QK}")
    if n_splits > 1 and (part_o.shape[0] < n_splits or part_ml.shape[0] < n_splits or
                         part_o.shape[1] < n * (cols // hd)):     # (one split reads no workspace)
        raise ValueError(f"merge_q8k: the workspace {tuple(part_o.shape)} holds fewer than "
                         f"{n_splits} splits of {n * (cols // hd)} rows")
    check("merge_q8k", n, cols, xq, xd, xb)
    at = np.int32(-1 if splits_at is None else splits_at)
    merge_q8k_kernel[(n, cols // QK), QK, stream](part_o, part_ml, np.int32(n_splits), state, at, x,
                                                  xq.reshape(xq.size), xd.reshape(xd.size), xb.reshape(xb.size))
