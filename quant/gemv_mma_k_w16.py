"""W16: the mma GEMV's Q4_K weights by 16-byte lane loads (quant/gemv_mma_k.py's lane mapping).

The 8-byte build gives lane t bytes 8 t .. 8 t + 7 of each 32-byte chunk of its rows: four loads a
row and 256-weight block, each warp instruction 8 rows' 32 bytes (8 lines for 256 bytes). Here lane
t loads bytes 16 t .. 16 t + 15 of each 64-byte chunk pair: two loads a row and block. Lanes 0, 1
then hold the even chunk and lanes 2, 3 the odd one, but an mma needs all four lanes on one
sub-block (its 6-bit scale multiplies the whole integer dot), so lanes t and t ^ 2 swap their
upper 8 bytes (two shuffles a load) and each picks its halves (`split16`). A lane ends with bytes
(0, 16, 8, 24)[t] .. + 7 of an even chunk and (8, 24, 0, 16)[t] .. + 7 of an odd one; the token
loads read the q8 values at the same bytes (`_bases16`), so the integer sums are the 8-byte
build's, in the same order. Timed in docs/kernels/gemv.md 8k.

`transpose4` is the Q6_K build's exchange (quant/gemv_mma_q6k.py W16, docs/kernels/gemv.md 8n): a 4 x 4
transpose of words over each lane quad.
"""
from __future__ import annotations

from numba import cuda, int32, uint32

from .gemv_mma import _dev
from .q8k_layout import xq_word


@_dev
def _bases16(nu, rr0, rr1, t, tb, cols):
    """W16's (`make_weight_loads`): the lane's first word of rows rr0 and rr1 (16 bytes at byte 16 t
    of each 64-byte chunk pair: lanes 0, 1 the even chunk, 2, 3 the odd one) and its token words in
    the even and the odd chunks' sub-blocks. After `split16` the lane holds bytes (0, 16, 8, 24)[t]
    .. + 7 of an even chunk and (8, 24, 0, 16)[t] .. + 7 of an odd one; the q8 values the same."""
    e = xq_word(tb, cols) + uint32(2 * ((t >> 1) + 2 * (t & 1)))
    return (uint32(rr0 * nu * 4) + uint32(4 * t), uint32(rr1 * nu * 4) + uint32(4 * t), e, e ^ uint32(2))


@_dev
def split16(raw):
    """W16's weights as `make_weight_loads` returns them without it: each row's two 16-byte loads a
    block (chunks 0-1, 2-3) -> its four chunks' 8 bytes. Lanes t and t ^ 2 swap their upper 8 bytes
    (two shuffles a load): lanes 0, 1 keep their lower 8 bytes for the even chunk and take the odd
    one's from lane t ^ 2; lanes 2, 3 the other way round. Called by the trip's multiply, not by the
    loads, so a pipelined build does not wait for the next block's loads at their issue."""
    hi = (cuda.laneid & 2) != 0
    r0, r1, h0, h1 = raw
    out0 = _split_pair(r0[0], hi) + _split_pair(r0[1], hi)
    out1 = _split_pair(r1[0], hi) + _split_pair(r1[1], hi)
    return out0, out1, h0, h1


@_dev
def _split_pair(v, hi):
    """One 16-byte load (words v0..v3, bytes 16 t ..) -> ((even chunk's 2 words), (odd chunk's))."""
    r2 = uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(v[2]), 2))     # (shuffles take int32)
    r3 = uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(v[3]), 2))
    own = (v[0], v[1])
    got = (r2, r3)
    return ((got if hi else own), (own if hi else got))


@_dev
def transpose4(v):
    """The Q6_K W16 build's exchange (quant/gemv_mma_q6k.py): lane t of each quad (lanes 4g .. 4g + 3)
    holds words 0..3 of a 16-byte group, group t of four; afterwards it holds word t of groups 0..3, in
    that order - a 4 x 4 transpose in two rounds of two shuffles. Round one (with lane t ^ 2) swaps the
    off-diagonal 2 x 2 blocks, round two (with t ^ 1) the off-diagonal words of each block."""
    lane = cuda.laneid
    lo = (lane & 2) == 0
    s0 = v[2] if lo else v[0]
    s1 = v[3] if lo else v[1]
    r0 = uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(s0), 2))
    r1 = uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(s1), 2))
    a = (v[0], v[1], r0, r1) if lo else (r0, r1, v[2], v[3])
    even = (lane & 1) == 0
    s0 = a[1] if even else a[0]
    s1 = a[3] if even else a[2]
    r0 = uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(s0), 1))
    r1 = uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(s1), 1))
    return (a[0], r0, a[2], r1) if even else (r0, a[1], r1, a[3])
