"""Open a GGUF file safely: a bounded structural check, then the `gguf` package's reader.

A GGUF file is (all little-endian):

    offset  field
    0       magic "GGUF" (4 bytes)
    4       version: uint32 (2 or 3)
    8       tensor_count: uint64
    16      kv_count: uint64
    24      kv_count x { key: string, value_type: uint32, value }
            tensor_count x { name: string, n_dims: uint32, ne: uint64[n_dims],
                             type: uint32, offset: uint64 (relative to the data section) }
            padding to `general.alignment` (default 32)
            data section: each tensor at its offset, ne[0] fastest-varying

    string  = uint64 byte length + UTF-8 bytes (no terminator)
    array   = element type uint32 + count uint64 + elements

`open_gguf` reads the header itself, in one pass, with every length checked against the
bytes that remain before anything is allocated, and maps the tensors' bytes read-only.
Errors are `GGUFError`, naming the file, the field or tensor, and what is wrong. The
`gguf` package gives the quantization types and block sizes; its `GGUFReader` is not used
to load: it trusts every length it reads (a count of 2**62 or a string running past the
end makes it hang or allocate without bound), and it builds several numpy views per array
element: for a Qwen3 vocabulary (151,936 tokens, their types and 151,387 merges) it takes
9.9 s and 541 MB of peak memory where this walk takes 0.24 s and 69 MB, with the same
metadata (whole processes; `python tools/bench_gguf_open.py` on the 2-core CI machine,
2026-12-02).

This module knows the container, not the model: which tensors a model needs and what
their shapes must be is checked by the architecture (engine/models/weights.py).
"""
from __future__ import annotations

import mmap
import os
import reprlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# value type -> (struct format, size) for fixed-size scalars
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file, as stored.

    shape is numpy order (rows, cols) - the reverse of GGUF's ne order - so a weight
    matrix `W` of `y = W @ x` has shape (n_out, n_in). data is a read-only memory-mapped
    uint8 view of its bytes, (rows, row_bytes) for matrices.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 (rows, row_bytes) or (nbytes,) for 1-D; memory-mapped
    offset: int       # absolute byte offset in the file

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class GGUFFile:
    """An opened GGUF file: metadata as Python values and tensors by name."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    file_size: int
    data_offset: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key '{key}' is missing; "
                            "the file was not written by a converter that supports this model")
        return self.metadata[key]

    def fingerprint_bytes(self) -> bytes:
        """The header bytes (metadata + tensor table): identifies the exact model file
        together with the file size. Used by the persistent KV cache."""
        with open(self.path, "rb") as f:
            return f.read(self.data_offset)


class _Walker:
    """Bounds-checked cursor over the header bytes."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (at byte {self.pos} of {self.end}); "
                         "the file is truncated or corrupt - download or convert it again")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(f"{what} runs past the end of the file")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, size: int, what: str):
        start = self.take(size, what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str, index: int | None = None) -> str:
        """A length-prefixed UTF-8 string; `index` names an array element in errors (the
        name is only formatted when there is an error: vocabularies have 150k strings)."""
        if self.pos + 8 > self.end:
            raise self.fail(f"length of {_elem(what, index)} runs past the end of the file")
        n = struct.unpack_from("<Q", self.buf, self.pos)[0]
        start = self.pos + 8
        if n > self.end - start:
            self.pos = start
            raise self.fail(f"{_elem(what, index)} runs past the end of the file")
        self.pos = start + n
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{_elem(what, index)} is not valid UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Read one metadata value: int, float, bool, str, or a list of them (nested up to
        3 levels), as gguf's ReaderField.contents() gives them."""
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.unpack(fmt, size, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        if depth > 2:
            raise self.fail(f"{what}: arrays nested too deeply")
        etype = self.unpack("<I", 4, f"element type of {what}")
        count = self.unpack("<Q", 8, f"element count of {what}")
        if etype in _SCALARS:
            fmt, size = _SCALARS[etype]
            start = self.take(count * size, f"{count} elements of {what}")
            return np.frombuffer(self.buf, np.dtype(fmt), count, start).tolist()
        if etype not in (_STRING, _ARRAY):
            raise self.fail(f"{what}: unknown array element type {etype}")
        # each element needs at least 8 bytes: reject absurd counts before looping
        if count * 8 > self.end - self.pos:
            raise self.fail(f"{what} claims {count} elements, more than the file can hold")
        if etype == _STRING:
            return [self.string(what, i) for i in range(count)]
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]


def _elem(what: str, index: int | None) -> str:
    return what if index is None else f"{what}[{index}]"


def _tensor_nbytes(path: Path, name: str, qtype_raw: int, ne: list[int]) -> tuple[GGMLQuantizationType, int]:
    try:
        qtype = GGMLQuantizationType(qtype_raw)
    except ValueError:
        raise GGUFError(f"{path}: tensor {_q(name)} has unknown type id {qtype_raw}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if any(d <= 0 for d in ne):
        raise GGUFError(f"{path}: tensor {_q(name)} has a zero or negative dimension {ne}")
    if ne[0] % block:
        raise GGUFError(f"{path}: tensor {_q(name)} ({qtype.name}) has {ne[0]} columns, "
                        f"not a multiple of its block size {block}")
    n_rows = 1
    for d in ne[1:]:
        n_rows *= d
    return qtype, n_rows * (ne[0] // block) * type_size


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist = 64, 64, 4


def short_repr(value: Any) -> str:
    """repr() of a metadata value, bounded (a corrupt file can hold a megabyte string or a
    150k-element list where a number belongs): for error messages."""
    return _REPR.repr(value)


def _q(name: str, limit: int = 64) -> str:
    """A key or tensor name as it can be printed: quoted, control characters escaped and
    shortened (a corrupt length can make a 'name' of thousands of binary bytes)."""
    return repr(name if len(name) <= limit else name[:limit] + "...")


def _parse(buf: mmap.mmap, path: Path) -> tuple[int, int, dict[str, Any], list[tuple]]:
    """Read the header with bounds checks: (version, data_offset, metadata, tensor entries
    (name, qtype, ne, offset relative to the data section, nbytes))."""
    w = _Walker(buf, path)
    if len(buf) < 24 or bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it does not start with the magic 'GGUF'); "
                        "pass a .gguf model file")
    w.pos = 4
    version = w.unpack("<I", 4, "version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise GGUFError(f"{path}: big-endian GGUF files are not supported")
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = w.unpack("<Q", 8, "tensor count")
    n_kv = w.unpack("<Q", 8, "metadata count")
    # Every metadata entry needs >= 8+4+1 bytes, every tensor entry >= 8+4+8+4+8.
    if n_kv * 13 > w.end - w.pos or n_tensors * 32 > w.end - w.pos:
        raise w.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, "
                     "more than the file can hold")
    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = w.string(f"metadata key #{i}")
        kq = _q(key)
        if key in metadata:
            raise w.fail(f"metadata key {kq} appears twice")
        vtype = w.unpack("<I", 4, f"type of {kq}")
        if key == "general.alignment":
            if vtype != 4:
                raise w.fail("general.alignment must be a uint32")
            alignment = w.unpack("<I", 4, "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise w.fail(f"general.alignment {alignment} is not a power of two")
            metadata[key] = alignment
        else:
            metadata[key] = w.value(vtype, kq)
    entries, seen = [], set()
    for i in range(n_tensors):
        name = w.string(f"tensor name #{i}")
        nq = _q(name)
        if name in seen:
            raise w.fail(f"tensor {nq} appears twice")
        seen.add(name)
        n_dims = w.unpack("<I", 4, f"dimension count of {nq}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.fail(f"tensor {nq} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        ne = [w.unpack("<Q", 8, f"dimensions of {nq}") for _ in range(n_dims)]
        qtype_raw = w.unpack("<I", 4, f"type of {nq}")
        offset = w.unpack("<Q", 8, f"offset of {nq}")
        qtype, nbytes = _tensor_nbytes(path, name, qtype_raw, ne)
        entries.append((name, qtype, ne, offset, nbytes))
    data_offset = -(-w.pos // alignment) * alignment
    for name, _, _, offset, nbytes in entries:
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {_q(name)} offset {offset} is not aligned to {alignment}")
        if data_offset + offset + nbytes > w.end:
            raise GGUFError(f"{path}: tensor {_q(name)} needs bytes up to {data_offset + offset + nbytes} "
                            f"but the file has {w.end}; the file is truncated - download it again")
    # Tensors never share bytes: a type or offset changed by corruption would otherwise
    # make a tensor read its neighbours' data and run on garbage.
    ordered = sorted(entries, key=lambda e: e[3])
    for (name, _, _, offset, nbytes), (nxt, _, _, nxt_offset, _) in zip(ordered, ordered[1:]):
        if offset + nbytes > nxt_offset:
            raise GGUFError(f"{path}: tensor {_q(name)} (data bytes {offset}..{offset + nbytes} after the "
                            f"header) overlaps tensor {_q(nxt)} (from {nxt_offset}): the tensor table "
                            "is corrupt - download the file again")
    return version, data_offset, metadata, entries


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open `path`, validate its structure, and return metadata and memory-mapped tensors."""
    path = Path(path)
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too small to be a GGUF file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        version, data_offset, metadata, entries = _parse(buf, path)
    # the tensors: read-only views of one mapping of the file, which lives as long as they do
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, qtype, ne, offset, nbytes in entries:
        shape = tuple(int(d) for d in reversed(ne))
        start = data_offset + offset
        data = mapped[start:start + nbytes]
        if len(shape) > 1:
            data = data.reshape(*shape[:-1], -1)
        tensors[name] = TensorInfo(name, qtype, shape, data, start)
    return GGUFFile(path, version, metadata, tensors, size, data_offset)
