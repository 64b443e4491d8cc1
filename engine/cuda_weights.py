"""The CUDA back-end's weights: packed from the memory-mapped file into the arena, then bound
to the architecture's typed weights (engine/models/weights.py) as device views.

`upload` copies tensor by tensor (host planes are temporaries of one tensor), so the peak
host memory is one matrix; on an integrated GPU it drops the file's pages behind it, so
the weights live once in the shared memory (arena), not twice (arena + page cache). A BF16 layer
matrix is refused there if a weight is beyond fp16's range (the prefill GEMM converts
BF16 weights to fp16: quant/mmq_float.py).

`bind` gives each matrix a `CudaMatrix` (its GEMV view for decode and its planes for the
GEMM), each 1-D tensor its float32 device array, and returns the stacked groups by the
names they hold, which the prefill ops use for one GEMM over Wq|Wk|Wv. `upload_rope_tables`
writes each RoPE variant's cos / sin tables (the frequency factors folded in on the host).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from genie_rt.quant.formats import QType, dequantize
from genie_rt.quant.layout import PLANES, PackedWeight, pack, release_threads

from .cuda_layout import CudaLayout, WeightGroup
from .gguf_file import GGUFError, GGUFFile
from .models.weights import bind_weights
from .progress import NO_PROGRESS, Progress

log = logging.getLogger("genie_rt.cuda")


@dataclass
class CudaMatrix:
    """One GGUF matrix on the device: what the decode GEMV and the prefill GEMM read."""
    name: str                 # GGUF tensor name
    gemv: object              # quant.gemv.GemvWeight (flat views of the planes below)
    packed: PackedWeight      # the matrix's rows of its group's planes

    @property
    def rows(self) -> int:
        return self.packed.rows


def _drop_file_pages(fd: int, offset: int, nbytes: int, path) -> bool:
    """posix_fadvise(DONTNEED) over one tensor's bytes of the mapped file, so that on an
    integrated GPU the weights live once in the shared memory (arena), not twice (arena +
    page cache). Only advice: a file system that refuses it costs memory, not correctness,
    so a failure is logged and the caller stops asking (returns False)."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return True
    except OSError as exc:
        log.warning("%s: cannot drop the file's pages after copying them (posix_fadvise: %s); "
                    "the page cache keeps a second copy of the weights until the kernel evicts it",
                    path, exc)
        return False


def upload(arena, lay: CudaLayout, g: GGUFFile, stream, integrated: bool, progress: Progress = NO_PROGRESS) -> None:
    """Pack each tensor from the mapped file into its arena rows (and norms as float32),
    reported as the step "reading weights" (bytes of the file, tensor by tensor)."""
    matrices = [name for gs in lay.groups.values() for grp in gs for name, _ in grp.members]
    progress.start("reading weights", sum(g.tensors[n].nbytes for n in matrices + list(lay.norms)), "B")
    fd = os.open(g.path, os.O_RDONLY) if integrated and hasattr(os, "posix_fadvise") else None
    try:
        for gs in lay.groups.values():
            for grp in gs:
                r0 = 0
                for name, rows in grp.members:
                    t = g.tensors[name]
                    host = pack(t.data, t.qtype, t.shape)
                    if t.qtype == QType.BF16 and name.startswith("blk."):
                        _check_bf16(host, name, g.path)
                    for plane, arr in host.planes.items():
                        arena[f"{grp.name}.{plane}"][r0:r0 + rows].copy_to_device(arr, stream=stream)
                    stream.synchronize()          # host planes are temporaries
                    r0 += rows
                    progress.advance(t.nbytes)
                    if fd is not None and not _drop_file_pages(fd, t.offset, t.nbytes, g.path):
                        os.close(fd)
                        fd = None
        for n in lay.norms:
            t = g.tensors[n]
            arena[n].copy_to_device(dequantize(t.data, t.qtype, t.shape).astype(np.float32), stream=stream)
            progress.advance(t.nbytes)
        stream.synchronize()
        progress.done()
    finally:
        release_threads()
        if fd is not None:
            os.close(fd)


def _check_bf16(host: PackedWeight, name: str, path) -> None:
    """A layer matrix in BF16 feeds the prefill GEMM, which converts its weights to fp16
    (quant/mmq_float.py): refuse one with a weight beyond fp16's range, naming it."""
    from genie_rt.quant.mmq_float import check_bf16_range
    try:
        check_bf16_range(host.planes["w"], name)
    except ValueError as exc:
        raise GGUFError(f"{path}: {exc}") from exc


def _packed(arena, grp: WeightGroup, r0: int = 0, rows: int | None = None) -> PackedWeight:
    rows = grp.rows if rows is None else rows
    planes = {p: arena[f"{grp.name}.{p}"][r0:r0 + rows] for p, *_ in PLANES[grp.qtype]}
    return PackedWeight(grp.qtype, rows, grp.cols, planes)


def bind(arena, lay: CudaLayout, g: GGUFFile, cfg, gemv_mode: str):
    """(typed weights with CUDA objects, {tensor names: [PackedWeight per stacked group]})."""
    from genie_rt.quant import gemv
    where: dict[str, PackedWeight] = {}          # tensor name -> its rows of its group
    stacks: dict[tuple, list[PackedWeight]] = {}
    for names, gs in lay.groups.items():
        stacks[names] = [_packed(arena, grp) for grp in gs]
        for grp in gs:
            r0 = 0
            for name, rows in grp.members:
                where[name] = _packed(arena, grp, r0, rows)
                r0 += rows

    def gemv_weight(w: PackedWeight):
        modes = gemv.K.MODES[QType(w.qtype)]
        return gemv.prepare_weight(w, gemv_mode if gemv_mode in modes else None)

    def bind_one(t):
        if t.name == "rope_freqs.weight":             # folded into the RoPE tables on the host
            return dequantize(t.data, t.qtype, t.shape)
        if len(t.shape) == 1:
            return arena[t.name]
        return CudaMatrix(t.name, gemv_weight(where[t.name]), where[t.name])

    return bind_weights(g, cfg, bind_one), stacks


def upload_rope_tables(arena, cfg, n_ctx: int, rope_freqs, stream) -> dict:
    """Each RoPE variant's (cos, sin) tables [n_ctx, head_dim/2] into the arena (rope.K.cos / .sin,
    cuda_layout.rope_keys); {(base, scale, has freq factors): (cos, sin) device views}."""
    from genie_rt.kvcache.rope_write import rope_table

    from .cuda_layout import rope_keys
    tables = {}
    for k, (base, scale, factors) in enumerate(rope_keys(cfg)):
        cos, sin = rope_table(n_ctx, cfg.head_dim, base, freq_scale=scale, freq_factors=rope_freqs if factors else None)
        arena[f"rope.{k}.cos"].copy_to_device(cos, stream=stream)
        arena[f"rope.{k}.sin"].copy_to_device(sin, stream=stream)
        tables[(base, scale, bool(factors))] = (arena[f"rope.{k}.cos"], arena[f"rope.{k}.sin"])
    return tables


class _Counted:
    """A Progress that only counts (the background upload's; the main thread shows it)."""

    def __init__(self):
        self.total, self.count = 0, 0

    def start(self, step, total=None, unit="", done=0, detail=""):
        self.total, self.count = total or 0, done

    def advance(self, n=1, detail=""):
        self.count += n

    def done(self, detail=""):
        pass


class BackgroundUpload:
    """`upload` on a thread of its own, with its own stream, while the main thread loads the
    kernels and captures the graphs (a capture only records pointers; it needs the buffers
    to exist, not their contents). `wait` joins it - before anything reads a weight - shows
    what is left as the step "reading weights", and raises what the upload raised.

    Used on a discrete GPU only: on an integrated one the CPU does both jobs and the host
    memory of the upload's temporaries would add to the compiler's."""

    def __init__(self, arena, lay: CudaLayout, g: GGUFFile):
        import threading

        from numba import cuda
        self._counted = _Counted()
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._stream = cuda.stream()
        self._thread = threading.Thread(target=self._work, args=(arena, lay, g), name="genie-upload", daemon=True)
        self._thread.start()

    def _work(self, arena, lay, g):
        import time
        t0 = time.perf_counter()
        try:
            upload(arena, lay, g, self._stream, False, self._counted)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = exc
        self.seconds = time.perf_counter() - t0

    @property
    def reading(self) -> bool:
        """The thread is still at work."""
        return self._thread.is_alive()

    def join(self) -> None:
        """Wait for the thread, dropping its error (the caller is already raising one)."""
        self._thread.join()

    def wait(self, progress: Progress = NO_PROGRESS) -> None:
        """Join the thread, showing the step "reading weights" (what was read beside the
        warm-up, then the rest); the thread has ended when this returns or raises."""
        c = self._counted
        try:
            progress.start("reading weights", c.total or None, "B", done=c.count,
                           detail="(beside the warm-up)")
            shown = c.count
            while self._thread.is_alive():
                self._thread.join(0.2)
                progress.advance(c.count - shown)
                shown = c.count
            progress.done()
        finally:
            self._thread.join()             # an interrupt or a display error: still no thread left
        if self._error is not None:
            err, self._error = self._error, None
            raise err
