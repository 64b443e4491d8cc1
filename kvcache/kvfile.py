"""The persistent KV file: one conversation's cached positions, byte by byte.

    offset   size  field
    0        8     magic b"GENIEKV\\0"
    8        4     H: header length in bytes, uint32 little-endian, 1 .. 64 MiB
    12       32    blake2b-256 of the H header bytes
    44       H     header: one msgpack map (fields below)
    44 + H   B     body: the arrays of `layout`, in order, C order, little-endian, no padding
    end            the file is exactly 44 + H + B bytes long

Header map (string keys; the reader checks every field's type and range before use):

    version      int    FORMAT_VERSION; any other version is refused
    fingerprint  bin    32 bytes: which GGUF computed the K/V (kvcache/persist.py)
    model        str    the model's file name (informational)
    kv_dtype     str    "int8" | "f16" | "f32"
    n_layers     int    \\
    n_kv_heads   int     > the pool's shape
    head_dim     int    /
    n_positions  int    N, 1 .. MAX_POSITIONS: positions 0 .. N-1 are stored
    tokens       bin    4N bytes, uint32 little-endian: the token id at each position
    ring_layers  array  (version 3) the layers kept as a ring (sliding-window layers of a
                        CUDA pool, kvcache/pool.py): they store only their last positions
    ring_first   int    (version 3) F: the first position the ring layers store (0 without)
    layout       array  [[name, dtype, shape], ...], exactly `layout_for(...)`, G = n_layers
                        minus the ring layers, Rn = len(ring_layers):
                          k        <dtype> [G, N, n_kv_heads, head_dim]     every other layer
                          v        <dtype> [G, N, n_kv_heads, head_dim]
                          k_scale  <f4     [G, N, n_kv_heads]   (int8 only)
                          v_scale  <f4     [G, N, n_kv_heads]   (int8 only)
                          rk, rv, rk_scale, rv_scale: the same for the ring layers, positions
                                   F .. N-1 ([Rn, N - F, ...]; only when Rn > 0)
    body_bytes   int    B = the sum of the layout's array sizes
    body_digest  bin    32 bytes: SHA-256 of the B body bytes (version 1: blake2b-256)
    created      float  unix time of the save (informational)

Why it cannot be trusted by accident: the header digest covers every header byte, the
body digest every body byte, and the lengths must add up to the file size exactly - a
truncated, extended or bit-flipped file fails one of the three. Sizes are checked from
the numbers before anything large is allocated (a header claiming 10**12 positions is
refused by arithmetic, not by trying), and the body is read layer by layer into arrays
that hold only the positions that will be used.

This module knows the bytes only; which folder, which model and when to save is
kvcache/persist.py's business.
"""
from __future__ import annotations

import hashlib
import math
import struct
import time
from dataclasses import dataclass

import msgpack
import numpy as np

MAGIC = b"GENIEKV\x00"
FORMAT_VERSION = 3      # 3: ring layers (sliding windows) store their last positions only;
                        # 2: the body digest is SHA-256 (hardware-accelerated on x86 and on the
                        # Jetson's ARMv8 cores: 21 vs 40 ms for 38 MB on the CI VM); 1 used blake2b
READ_VERSIONS = (2, 3)  # a version-2 file is a version-3 file without ring layers
PREAMBLE = struct.Struct("<8sI32s")          # magic, header length, header digest: 44 bytes
MAX_HEADER_BYTES = 64 << 20
MAX_POSITIONS = 1 << 24
DIGEST_BYTES = 32
_READ_CHUNK = 4 << 20                        # bytes per read/hash step when skipping

_STORAGE = {"int8": "|i1", "f16": "<f2", "f32": "<f4"}   # numpy dtype strings on disk
_SCALE = "<f4"
_HEADER_KEYS = {"version": int, "fingerprint": bytes, "model": str, "kv_dtype": str,
                "n_layers": int, "n_kv_heads": int, "head_dim": int, "n_positions": int,
                "tokens": bytes, "layout": list, "body_bytes": int, "body_digest": bytes,
                "created": float}


class KVFileError(Exception):
    """The file does not validate; the message says why (for the log line)."""


@dataclass(frozen=True)
class KVFileMeta:
    """A validated header. tokens: uint32 [n_positions]."""

    version: int
    fingerprint: bytes
    model: str
    kv_dtype: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    tokens: np.ndarray
    body_bytes: int
    body_digest: bytes
    created: float
    header_bytes: int      # H
    ring_layers: tuple = ()
    ring_first: int = 0

    @property
    def n_positions(self) -> int:
        return len(self.tokens)

    @property
    def body_offset(self) -> int:
        return PREAMBLE.size + self.header_bytes

    @property
    def file_bytes(self) -> int:
        return self.body_offset + self.body_bytes

    def layout(self, n: int | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
        return layout_for(self.kv_dtype, self.n_layers, self.n_kv_heads, self.head_dim,
                          self.n_positions if n is None else n, self.ring_layers, self.ring_first)


def layout_for(kv_dtype: str, n_layers: int, n_kv_heads: int, head_dim: int,
               n: int, ring_layers=(), ring_first: int = 0) -> list[tuple[str, str, tuple[int, ...]]]:
    """The body's arrays (name, numpy dtype string, shape), in file order."""
    out = []
    parts = [("", n_layers - len(ring_layers), n)]
    if ring_layers:
        parts.append(("r", len(ring_layers), n - ring_first))
    for prefix, layers, positions in parts:
        dims = (layers, positions, n_kv_heads, head_dim)
        out += [(prefix + "k", _STORAGE[kv_dtype], dims), (prefix + "v", _STORAGE[kv_dtype], dims)]
        if kv_dtype == "int8":
            out += [(prefix + "k_scale", _SCALE, dims[:3]), (prefix + "v_scale", _SCALE, dims[:3])]
    return out


def _nbytes(layout) -> int:
    # Python ints: a hostile header's dimensions cannot overflow the arithmetic
    return sum(math.prod(shape) * np.dtype(dt).itemsize for _, dt, shape in layout)


def _bytes(a: np.ndarray) -> memoryview:
    """A flat uint8 view of a C-contiguous array (empty arrays included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _digest() -> "hashlib._Hash":
    """The body digest (SHA-256: the header keeps blake2b, it is small)."""
    return hashlib.sha256()


# -- writing ------------------------------------------------------------------------

def encode(arrays: dict[str, np.ndarray], tokens: list[int], *, fingerprint: bytes, model: str,
           kv_dtype: str, n_layers: int, n_kv_heads: int, head_dim: int, ring_layers=(),
           ring_first: int = 0) -> list[memoryview]:
    """The whole file as byte chunks (preamble + header, then one view per array).

    `arrays` is what a back-end's export_kv(len(tokens)) returns (the ring layers' arrays
    prefixed "r", holding positions ring_first ..); a mismatch with the layout (a name,
    dtype or shape) raises ValueError - nothing wrong is written."""
    n = len(tokens)
    if not 1 <= n <= MAX_POSITIONS:
        raise ValueError(f"{n} positions: a KV file holds 1 .. {MAX_POSITIONS}")
    if kv_dtype not in _STORAGE:
        raise ValueError(f"KV dtype '{kv_dtype}' is not one of {', '.join(_STORAGE)}")
    ring_layers = [int(i) for i in ring_layers]
    if ring_layers != sorted(set(ring_layers)) or any(not 0 <= i < n_layers for i in ring_layers) \
            or not (0 <= ring_first < n if ring_layers else ring_first == 0):
        raise ValueError(f"ring layers {ring_layers} / first position {ring_first} do not fit "
                         f"{n_layers} layers of {n} positions")
    layout = layout_for(kv_dtype, n_layers, n_kv_heads, head_dim, n, ring_layers, ring_first)
    if set(arrays) != {name for name, _, _ in layout}:
        raise ValueError(f"exported arrays {sorted(arrays)} do not match the layout {[x[0] for x in layout]}")
    body, digest = [], _digest()
    for name, dt, shape in layout:
        a = arrays[name]
        if a.shape != shape or a.dtype.kind != np.dtype(dt).kind or a.dtype.itemsize != np.dtype(dt).itemsize:
            raise ValueError(f"exported '{name}' is {a.dtype}{list(a.shape)}, the layout says {dt}{list(shape)}")
        view = _bytes(np.ascontiguousarray(a, dtype=dt))
        digest.update(view)
        body.append(view)
    tok = np.asarray(tokens, np.int64)
    if tok.min() < 0 or tok.max() >= 1 << 32:
        raise ValueError("token ids must fit in uint32")
    header = {
        "version": FORMAT_VERSION, "fingerprint": bytes(fingerprint), "model": str(model),
        "kv_dtype": kv_dtype, "n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
        "n_positions": n, "tokens": tok.astype("<u4").tobytes(),
        "ring_layers": ring_layers, "ring_first": int(ring_first),
        "layout": [[name, dt, list(shape)] for name, dt, shape in layout],
        "body_bytes": sum(v.nbytes for v in body), "body_digest": digest.digest(),
        "created": time.time(),
    }
    return [memoryview(pack_header(header))] + body


def pack_header(header: dict) -> bytes:
    """Preamble + msgpack header (also used by tests to craft hostile files)."""
    raw = msgpack.packb(header, use_bin_type=True)
    return PREAMBLE.pack(MAGIC, len(raw), hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()) + raw


# -- reading ------------------------------------------------------------------------

def _read_exact(f, n: int, what: str) -> bytes:
    buf = bytearray(n)
    _readinto_exact(f, memoryview(buf), what)
    return bytes(buf)


def _readinto_exact(f, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        r = f.readinto(view[got:])
        if not r:
            raise KVFileError(f"the file ends inside {what} (truncated)")
        got += r


def read_header(f, file_size: int) -> KVFileMeta:
    """Read and validate the preamble and header at the start of `f` (a binary file at
    offset 0, `file_size` bytes long). Checks structure only: not which model."""
    if file_size < PREAMBLE.size:
        raise KVFileError(f"{file_size} bytes is shorter than the {PREAMBLE.size}-byte preamble")
    magic, h_len, h_digest = PREAMBLE.unpack(_read_exact(f, PREAMBLE.size, "the preamble"))
    if magic != MAGIC:
        raise KVFileError("not a genie-rt KV file (bad magic)")
    if not 1 <= h_len <= MAX_HEADER_BYTES:
        raise KVFileError(f"header length {h_len} is outside 1 .. {MAX_HEADER_BYTES}")
    if PREAMBLE.size + h_len > file_size:
        raise KVFileError(f"header of {h_len} bytes runs past the end of the {file_size}-byte file (truncated)")
    raw = _read_exact(f, h_len, "the header")
    if hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest() != h_digest:
        raise KVFileError("header checksum mismatch (corrupt header)")
    try:
        h = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True,
                            max_str_len=1 << 16, max_bin_len=MAX_HEADER_BYTES,
                            max_array_len=64, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises ValueError, ExtraData, StackError, FormatError, ...
        raise KVFileError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(h, dict):
        raise KVFileError("header is not a map")
    version = h.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise KVFileError(f"format version {version!r} is not supported (this build reads "
                          f"{', '.join(map(str, READ_VERSIONS))})")
    if version == 2:
        h.setdefault("ring_layers", [])
        h.setdefault("ring_first", 0)
    for key, kind in _HEADER_KEYS.items():
        if type(h.get(key)) is not kind:
            raise KVFileError(f"header field '{key}' is missing or not a {kind.__name__}")
    if h["kv_dtype"] not in _STORAGE:
        raise KVFileError(f"KV dtype {h['kv_dtype']!r} is unknown")
    for key in ("n_layers", "n_kv_heads", "head_dim"):
        if not 1 <= h[key] <= 1 << 16:
            raise KVFileError(f"header field '{key}' = {h[key]} is out of range")
    n = h["n_positions"]
    if not 1 <= n <= MAX_POSITIONS:
        raise KVFileError(f"{n} positions is outside 1 .. {MAX_POSITIONS}")
    if len(h["tokens"]) != 4 * n:
        raise KVFileError(f"{len(h['tokens'])} bytes of token ids for {n} positions (want {4 * n})")
    if len(h["fingerprint"]) != DIGEST_BYTES or len(h["body_digest"]) != DIGEST_BYTES:
        raise KVFileError("fingerprint or body digest is not 32 bytes")
    rings, first = h.get("ring_layers"), h.get("ring_first")
    if type(rings) is not list or any(type(i) is not int for i in rings) or rings != sorted(set(rings)) \
            or any(not 0 <= i < h["n_layers"] for i in rings) or type(first) is not int \
            or not (0 <= first < n if rings else first == 0):
        raise KVFileError(f"ring layers {rings!r} / ring_first {first!r} do not fit {h['n_layers']} "
                          f"layers of {n} positions")
    layout = layout_for(h["kv_dtype"], h["n_layers"], h["n_kv_heads"], h["head_dim"], n, rings, first)
    if h["layout"] != [[name, dt, list(shape)] for name, dt, shape in layout]:
        raise KVFileError(f"body layout {h['layout']!r} is not the layout of its dtype and shape")
    if h["body_bytes"] != _nbytes(layout):
        raise KVFileError(f"body_bytes {h['body_bytes']} does not match the layout ({_nbytes(layout)})")
    if PREAMBLE.size + h_len + h["body_bytes"] != file_size:
        raise KVFileError(f"the file has {file_size} bytes, its header says "
                          f"{PREAMBLE.size + h_len + h['body_bytes']} (truncated or extended)")
    return KVFileMeta(version, h["fingerprint"], h["model"], h["kv_dtype"], h["n_layers"], h["n_kv_heads"],
                      h["head_dim"], np.frombuffer(h["tokens"], "<u4").copy(), h["body_bytes"],
                      h["body_digest"], h["created"], h_len, tuple(rings), first)


def read_body(f, meta: KVFileMeta, n_keep: int) -> dict[str, np.ndarray]:
    """Read the body after the header (f positioned at meta.body_offset); return the
    arrays of positions 0 .. n_keep-1 (the ring layers' "r" arrays: positions ring_first ..
    n_keep-1), only if the whole body matches its digest. Memory: the kept positions plus
    one read chunk."""
    if not 0 <= n_keep <= meta.n_positions:
        raise ValueError(f"n_keep {n_keep} is outside 0 .. {meta.n_positions}")
    digest = _digest()
    scratch = memoryview(bytearray(min(_READ_CHUNK, max(1, meta.body_bytes))))
    out = {}
    for name, dt, shape in meta.layout():
        keep_n = max(0, n_keep - meta.ring_first) if name.startswith("r") else n_keep
        keep = np.empty((shape[0], keep_n) + shape[2:], dt)
        row = math.prod(shape[2:]) * np.dtype(dt).itemsize   # bytes per position
        for layer in range(shape[0]):
            view = _bytes(keep[layer])
            _readinto_exact(f, view, f"'{name}' of layer {layer}")
            digest.update(view)
            skip = (shape[1] - keep_n) * row
            while skip:
                part = scratch[:min(skip, len(scratch))]
                _readinto_exact(f, part, f"'{name}' of layer {layer}")
                digest.update(part)
                skip -= len(part)
        out[name] = keep
    if digest.digest() != meta.body_digest:
        raise KVFileError("body checksum mismatch (corrupt body)")
    return out


def verify_body(f, meta: KVFileMeta) -> None:
    """Check the body's digest without keeping any of it (for `genie-rt kv show`)."""
    read_body(f, meta, 0)
