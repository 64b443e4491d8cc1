"""The decode attention that ropes its own token: rope_write's work inside the attention launch.

A decode layer used to run `rope_write` (QK-norm, RoPE, the new K/V row into the cache: 12
blocks of a few microseconds, launch-bound) and then the attention, which waited for it. Its
work is small and splits cleanly along the attention's blocks: a block of the attention owns
GH query heads of one KV head and a split of the context, so it needs only

- its GH query rows, normed and roped (every block: a few hundred floats), and
- the new position's K and V rows, and only if its split holds the new position (the last
  active split; the other splits stop before it).

So every block runs rope_write's per-row device code (kvcache/rope_write.py `make_head_row`,
the same function: the same bits) for those rows, one warp a row: its q rows land in shared
memory, where the attention reads its q slice from, and the last split's blocks write the
new K/V row to the cache (the n_sub blocks of a KV head write the same bytes), then a
barrier, then the attention reads the rows as always - with coherent loads (`ptx.ld_v4`, not
the read-only path: the block wrote one of them itself). One launch a layer fewer, and the
attention waits for the QKV GEMV instead of for rope_write.

`make_rope_prologue` builds the device function; attention_decode_kernels.decode_kernel
calls it (its `rope` argument) after its wait - inside the "warp" loop's PDL build after the
first trip's loads of earlier positions (attention_decode_tiles.py), which this work does not
touch. The launcher is kvcache/attention.py `decode_rope_attention`; the engine uses it when
EngineConfig.decode_fused_rope is on (engine/cuda_ops.py: rope_write is kept pending and
launched with the attention that reads its q).

The rows a block ropes ("rope rows"), one warp each, in trips of NW warps:
    r < GH           query head head0 + r        -> s_rows[r * HD : (r + 1) * HD]
    r == GH          K row of KV head kvh        -> the cache (last split only)
    r == GH + 1      V row of KV head kvh        -> the cache (last split only)
"""
from __future__ import annotations

from numba import cuda

from genie_rt.quant.ptx import SIMULATOR

from .rope_write import ROPE_MODES, make_head_row

if SIMULATOR:
    _dev = cuda.jit(device=True)
else:
    _dev = cuda.jit(device=True, forceinline=True)


def rows_needed(heads_per_block: int) -> int:
    """Rope rows of a block: its query heads, the new K row, the new V row."""
    return heads_per_block + 2


def make_rope_prologue(head_dim: int, heads_per_block: int, warps: int, rope: str, qk_norm: bool,
                       ring: bool, kv_dtype: str):
    """prologue(ra): rope_write's work for one attention block (module docstring), with
    ra = (qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_scale, v_scale, s_rows,
    head0, kvh, last, pos):
      qkv      f32 [1, (n_head + 2 n_kv) * HD]   the QKV GEMV's output row
      q_norm, k_norm f32 [HD] (any f32 array without QK-norm), eps f32
      cos, sin f32 [n_ctx_max, HD / 2]
      k_cache, v_cache int8|f16 [R, n_kv, HD], k_scale, v_scale f32 [R, n_kv]: the layer
      s_rows   f32 shared [(GH + 2) * HD]         the block's q rows come out here
      head0, kvh: the block's first query head and its KV head; last: the block's split
      holds the new position (write its K/V row); pos: the new position
    Every thread of the block calls it (it has barriers); the caller adds one more barrier
    before anything reads s_rows or the new row."""
    if rope not in ROPE_MODES:
        raise ValueError(f"decode attention rope must be one of {ROPE_MODES}, not '{rope}'")
    HD, GH, NW = head_dim, heads_per_block, warps
    NR = rows_needed(GH)
    head_row = make_head_row(rope == "neox", qk_norm, ring, kv_dtype == "int8")

    @_dev
    def prologue(ra):
        (qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, k_scale, v_scale, s_rows, head0, kvh,
         last, pos) = ra
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        n_kv = k_cache.shape[1]
        n_head = qkv.shape[1] // HD - 2 * n_kv
        none = n_head + 2 * n_kv                 # head_row's "no row" (still at its barriers)
        for r0 in range(0, NR, NW):              # constant trips: every thread, every barrier
            r = r0 + warp
            row = none
            if r < GH:
                row = head0 + r
            elif r == GH and last:
                row = n_head + kvh
            elif r == GH + 1 and last:
                row = n_head + n_kv + kvh
            head_row(qkv, 0, row, HD, n_head, n_kv, q_norm, k_norm, eps, cos, sin, pos, s_rows,
                     min(r, NR - 1) * HD, lane, k_cache, v_cache, k_scale, v_scale)
    return prologue
