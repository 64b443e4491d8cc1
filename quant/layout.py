"""The device layout of quantized weights: GGUF blocks split into aligned planes.

GGUF stores a row as an array of blocks (array of structs). Q6_K's 210-byte block is
only 2-byte aligned, so a row of them cannot be read with 128-bit loads, and every
format interleaves small header fields with the bulk quants. At load we split each
matrix [rows, cols] into planes (struct of arrays), each a C-contiguous 2-D array
[rows, n_blocks * field_bytes], so that:

- every plane row starts 16-byte aligned whenever field_bytes * n_blocks is a multiple
  of 16 (the bulk quants always are; the 2- and 4-byte fields of the 32-weight formats
  are not when n_blocks is not a multiple of 8, e.g. SmolLM2's 576 columns: kernels
  read those with scalar loads),
- the bulk quants of consecutive blocks are contiguous, so a warp reading a row reads
  one coalesced stream with `ld.global.nc.v4`,
- the total byte count equals the GGUF tensor's (no padding, no decoded scales):
  decode stays bound by exactly the file's bytes.

Planes per type (nb = blocks per row; field order inside a plane is GGUF's):

    type   block  plane   bytes/block  dtype    content
    Q4_K   256    hdr     16           uint8    d (fp16), dmin (fp16), scales[12] packed 6-bit
                  qs      128          uint8    4-bit quants, GGUF order
    Q5_K   256    hdr     16           uint8    as Q4_K
                  qh      32           uint8    5th bits
                  qs      128          uint8    low 4 bits
    Q6_K   256    ql      128          uint8    low 4 bits
                  qh      64           uint8    high 2 bits
                  sc      16           int8     16 sub-block scales
                  d       2            float16  super-block scale (plane dtype float16: [rows, nb])
    Q8_0   32     qs      32           int8     quants
                  d       2            float16  scale [rows, nb]
    Q5_0   32     qs      16           uint8    low 4 bits
                  qh      4            uint8    5th bits (a little-endian uint32 per block)
                  d       2            float16
    Q5_1   32     dm      4            uint32   d | m << 16, two fp16 (w = d q + m) [rows, nb]
                  qh      4            uint8    as Q5_0
                  qs      16           uint8    as Q5_0
    Q4_0   32     qs      16           uint8
                  d       2            float16
    Q4_1   32     dm      4            uint32   d | m << 16, two fp16 [rows, nb]
                  qs      16           uint8
    F16    1      w       2            float16  [rows, cols]
    BF16   1      w       2            uint16   [rows, cols] (bf16 bits)
    F32    1      w       4            float32  [rows, cols]

The numpy `pack` / `unpack` here are the definition; GPU kernels index these planes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import BLOCK_SIZES, QType, _qtype

# qtype -> list of (plane name, byte offset in the GGUF block, bytes per block, numpy dtype)
PLANES: dict[QType, list[tuple[str, int, int, str]]] = {
    QType.Q4_K: [("hdr", 0, 16, "u1"), ("qs", 16, 128, "u1")],
    QType.Q5_K: [("hdr", 0, 16, "u1"), ("qh", 16, 32, "u1"), ("qs", 48, 128, "u1")],
    QType.Q6_K: [("ql", 0, 128, "u1"), ("qh", 128, 64, "u1"), ("sc", 192, 16, "i1"), ("d", 208, 2, "<f2")],
    QType.Q8_0: [("d", 0, 2, "<f2"), ("qs", 2, 32, "i1")],
    QType.Q5_0: [("d", 0, 2, "<f2"), ("qh", 2, 4, "u1"), ("qs", 6, 16, "u1")],
    QType.Q5_1: [("dm", 0, 4, "<u4"), ("qh", 4, 4, "u1"), ("qs", 8, 16, "u1")],
    QType.Q4_0: [("d", 0, 2, "<f2"), ("qs", 2, 16, "u1")],
    QType.Q4_1: [("dm", 0, 4, "<u4"), ("qs", 4, 16, "u1")],
    QType.F16: [("w", 0, 2, "<f2")],
    QType.BF16: [("w", 0, 2, "<u2")],
    QType.F32: [("w", 0, 4, "<f4")],
}
PACKABLE = frozenset(PLANES)


@dataclass
class PackedWeight:
    """A weight matrix y = W x of shape (rows, cols), as planes (numpy or device arrays)."""

    qtype: QType
    rows: int
    cols: int
    planes: dict[str, np.ndarray]   # name -> 2-D array [rows, nb * bytes] (or [rows, nb] for d)

    @property
    def n_blocks(self) -> int:
        return self.cols // BLOCK_SIZES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.planes.values())


# Splitting a big matrix into its planes is a strided gather over the mapped file (and the
# page faults that read it): at load it was 2.4 of a 4B model's ~3 s of "reading weights" on
# the H200 host (kernel-cache.md). numpy releases the GIL while it copies, so row chunks of one
# matrix are gathered by a few threads at once; the planes are the same bytes either way and
# no more memory is held than one matrix's planes.
PARALLEL_MIN_BYTES = 8 << 20          # matrices below this are gathered by the calling thread
_pool = None                          # (ThreadPoolExecutor, its number of workers) while loading


def _executor():
    global _pool
    if _pool is None:
        import os
        from concurrent.futures import ThreadPoolExecutor
        workers = max(1, min(8, os.cpu_count() or 1))
        _pool = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="genie-pack"), workers)
    return _pool


def release_threads() -> None:
    """End the gather threads (after a model's weights are loaded: none lingers in a server)."""
    global _pool
    if _pool is not None:
        _pool[0].shutdown(wait=True)
        _pool = None


def pack(raw: np.ndarray, qtype, shape: tuple[int, int], parallel: bool = True) -> PackedWeight:
    """GGUF bytes of a (rows, cols) matrix -> PackedWeight with C-contiguous host planes
    (row chunks gathered by a few threads for a big matrix unless parallel=False)."""
    qtype = _qtype(qtype)
    if qtype not in PLANES:
        raise ValueError(f"no device layout for {qtype.name} weights (supported: "
                         f"{', '.join(sorted(q.name for q in PLANES))})")
    rows, cols = shape
    block, block_bytes = BLOCK_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} matrix with {cols} columns: not a multiple of its block size {block}")
    nb = cols // block
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, nb, block_bytes)
    fields = PLANES[qtype]
    out = {name: np.empty((rows, nb, size), np.uint8) for name, _, size, _ in fields}

    def gather(r0: int, r1: int) -> None:
        for name, off, size, _ in fields:
            np.copyto(out[name][r0:r1], blocks[r0:r1, :, off:off + size])

    pool = _executor() if parallel and blocks.nbytes >= PARALLEL_MIN_BYTES and rows > 1 else None
    if pool is None:
        gather(0, rows)
    else:
        pool, workers = pool
        n = min(workers * 2, rows)
        cuts = [rows * i // n for i in range(n + 1)]
        for f in [pool.submit(gather, a, b) for a, b in zip(cuts, cuts[1:])]:
            f.result()
    planes = {name: out[name].reshape(rows, nb * size).view(np.dtype(dt)) for name, _, size, dt in fields}
    return PackedWeight(qtype, rows, cols, planes)


def unpack(w: PackedWeight) -> np.ndarray:
    """PackedWeight (host planes) -> GGUF bytes uint8 [rows, row_bytes] (inverse of pack)."""
    block, block_bytes = BLOCK_SIZES[w.qtype]
    nb = w.cols // block
    out = np.empty((w.rows, nb, block_bytes), np.uint8)
    for name, off, size, _ in PLANES[w.qtype]:
        out[:, :, off:off + size] = np.asarray(w.planes[name]).view(np.uint8).reshape(w.rows, nb, size)
    return out.reshape(w.rows, nb * block_bytes)
