"""Embedding lookup on the GPU: rows of a quantized token_embd table -> float32.

    out[t, :] = dequantize(table[ids[t], :])          ids int32[n] on the device

The ids are read on the device, so one captured graph serves every decode step: for
decode pass a view of the state array holding the current token (`state[S_TOKEN:S_TOKEN + 1]`,
engine/device_state.py), for
prefill the ids buffer. The result is bit-exact with `formats.dequantize` of the same
rows: every weight is computed with the reference's float32 operations in the same
order, and the two products of Q4_K / Q5_K ((d*sc)*q - dmin*m) use round-to-nearest
multiplies that the compiler may not fuse into an FMA.

Who does what: the grid is (n tokens, cols / 256); a block of 256 threads covers 256
consecutive weights of one row (one k-quant super-block, eight 32-weight blocks) and
thread t computes weight t: it reads its quant bits and its block's scales (bytes shared
by neighbouring threads come through the same cache lines). Traffic per token: one
table row (cols * bits / 8 bytes) read, 4 * cols bytes written. The table uses the
planar device layout of quant/layout.py (fp16 planes are read as uint16 bits).

One table, `_FORMATS`, says per format: its kernel's name, the device function that
computes one weight from the planes (`_w_q6_k`, ...) and the planes in order. Every
format's kernel is the same body (`_embed_kernel`: which weight this thread owns, is the
id inside the table, weight * scale), specialised on that function; the launcher passes
the planes as one tuple (`device_planes`).

`scale` multiplies every weight in float32 after dequantization (Gemma scales its
embeddings by sqrt(hidden)); with the default 1 the result is the dequantized row.

Formats: Q6_K (token_embd of Q4_K_M files), Q4_K, Q5_K, Q8_0, Q5_0, Q5_1, Q4_0, Q4_1,
F16, BF16, F32. Deliberately not here: the output projection (a GEMV), the IQ/TQ and
Q2_K/Q3_K formats.
A token id outside the table gives a row of zeros (ids cannot be checked on the host
without a synchronisation).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from genie_rt.engine import kernel_cache

from . import ptx
from .formats import BLOCK_SIZES, QType, dequantize
from .layout import PackedWeight, unpack

SIMULATOR = ptx.SIMULATOR
ROW_TILE = 256                      # weights per CUDA block (= threads per block)


# =====================================================================================
# numpy reference
# =====================================================================================
def embed_reference(table: PackedWeight, ids, scale: float = 1.0) -> np.ndarray:
    """float32 [n, cols]: formats.dequantize of the table rows `ids` (host planes), times
    float32(scale) (llama.cpp's ggml_scale of the embeddings: Gemma's sqrt(n_embd))."""
    ids = np.asarray(ids, np.int64)
    raw = unpack(table)[ids]
    return dequantize(raw, table.qtype, (len(ids), table.cols)) * np.float32(scale)


# =====================================================================================
# Kernels
# =====================================================================================
@cuda.jit(device=True)
def _f16(plane, r, k):
    """float32 of the fp16 at plane[r, k] (plane: uint16 bits)."""
    return ptx.f16_bits_to_f32(uint32(plane[r, k]))


@cuda.jit(device=True)
def _where(ids, rows, out):
    """(token row or -1, output column) of this thread; zero-fills a bad id's row."""
    t = cuda.blockIdx.x
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    tok = ids[t]
    if i >= out.shape[1]:
        return -1, i
    if tok < 0 or tok >= rows:
        out[t, i] = float32(0)
        return -1, i
    return tok, i


# ---- the weight of each format: (planes, row, column) -> float32, unscaled -------------
@cuda.jit(device=True)
def _w_q6_k(p, tok, i):
    """p = (ql uint8[rows, nb*128], qh uint8[rows, nb*64], sc int8[rows, nb*16],
    d uint16[rows, nb] (fp16 bits)). Weight i of super-block s:
    half h = i>>7, quarter k = (i>>5)&3, lane l = i&31;
    q = ((ql[64h + 32(k&1) + l] >> 4(k>>1)) & 15 | ((qh[32h + l] >> 2k) & 3) << 4) - 32;
    w = (d * sc[i>>4]) * q."""
    ql, qh, sc, d = p
    s = i >> 8
    j = i & 255
    h = j >> 7
    k = (j >> 5) & 3
    lane = j & 31
    lo = (int32(ql[tok, s * 128 + 64 * h + 32 * (k & 1) + lane]) >> (4 * (k >> 1))) & 15
    hi = (int32(qh[tok, s * 64 + 32 * h + lane]) >> (2 * k)) & 3
    q = (lo | (hi << 4)) - 32
    f = _f16(d, tok, s) * float32(sc[tok, s * 16 + (j >> 4)])
    return f * float32(q)


@cuda.jit(device=True)
def _k_scale_min(hdr, tok, s, j):
    """(sc, m) 6-bit scale and min of sub-block j of super-block s (Q4_K/Q5_K header)."""
    b = s * 16 + 4
    if j < 4:
        sc = int32(hdr[tok, b + j]) & 63
        m = int32(hdr[tok, b + j + 4]) & 63
    else:
        sc = (int32(hdr[tok, b + j + 4]) & 15) | ((int32(hdr[tok, b + j - 4]) >> 6) << 4)
        m = (int32(hdr[tok, b + j + 4]) >> 4) | ((int32(hdr[tok, b + j]) >> 6) << 4)
    return sc, m


@cuda.jit(device=True)
def _k_dmin(hdr, tok, s):
    b = s * 16
    d = ptx.f16_bits_to_f32(uint32(hdr[tok, b]) | (uint32(hdr[tok, b + 1]) << 8))
    dmin = ptx.f16_bits_to_f32(uint32(hdr[tok, b + 2]) | (uint32(hdr[tok, b + 3]) << 8))
    return d, dmin


@cuda.jit(device=True)
def _k_weight(hdr, qs, hi, tok, i):
    """Q4_K / Q5_K: hdr uint8[rows, nb*16] (d, dmin fp16; 12 bytes of packed 6-bit
    scales/mins), qs uint8[rows, nb*128], hi = the 5th bit of q (0 for Q4_K). Weight i of
    super-block s: sub-block j = i>>5, lane l = i&31; q = (qs[32(j>>1) + l] >> 4(j&1)) & 15
    | hi; w = (d*sc[j]) * q - dmin*m[j], both products rounded (never an FMA)."""
    s = i >> 8
    j = (i & 255) >> 5
    lane = i & 31
    q = (int32(qs[tok, s * 128 + 32 * (j >> 1) + lane]) >> (4 * (j & 1))) & 15
    q |= hi
    sc, m = _k_scale_min(hdr, tok, s, j)
    d, dmin = _k_dmin(hdr, tok, s)
    return ptx.mul_rn(d * float32(sc), float32(q)) - ptx.mul_rn(dmin, float32(m))


@cuda.jit(device=True)
def _w_q4_k(p, tok, i):
    """p = (hdr, qs): see _k_weight."""
    hdr, qs = p
    return _k_weight(hdr, qs, 0, tok, i)


@cuda.jit(device=True)
def _w_q5_k(p, tok, i):
    """p = (hdr, qh uint8[rows, nb*32], qs): bit j of qh[l] is the 5th bit of sub-block j."""
    hdr, qh, qs = p
    hi = ((int32(qh[tok, (i >> 8) * 32 + (i & 31)]) >> ((i & 255) >> 5)) & 1) << 4
    return _k_weight(hdr, qs, hi, tok, i)


@cuda.jit(device=True)
def _q4_32(qs, tok, i):
    """The low 4 bits of weight i of a 32-weight block format (Q4_0, Q4_1, Q5_0, Q5_1):
    qs uint8[rows, nb*16]; weight j < 16 of a block is the low nibble of qs[j], weight
    j + 16 the high nibble."""
    j = i & 31
    return (int32(qs[tok, (i >> 5) * 16 + (j & 15)]) >> (4 * (j >> 4))) & 15


@cuda.jit(device=True)
def _q5_32(qs, qh, tok, i):
    """The 5-bit quant of weight i of Q5_0 / Q5_1: _q4_32 | bit j of the block's qh
    (uint8[rows, nb*4], a little-endian uint32) << 4."""
    j = i & 31
    return _q4_32(qs, tok, i) | (((int32(qh[tok, (i >> 5) * 4 + (j >> 3)]) >> (j & 7)) & 1) << 4)


@cuda.jit(device=True)
def _w_q8_0(p, tok, i):
    """p = (qs int8[rows, nb*32], d uint16[rows, nb]): w = q * d."""
    qs, d = p
    return float32(qs[tok, i]) * _f16(d, tok, i >> 5)


@cuda.jit(device=True)
def _w_q4_0(p, tok, i):
    """p = (qs, d uint16[rows, nb]): w = (q - 8) * d."""
    qs, d = p
    return float32(_q4_32(qs, tok, i) - 8) * _f16(d, tok, i >> 5)


@cuda.jit(device=True)
def _w_q5_0(p, tok, i):
    """p = (qs, qh, d uint16[rows, nb]): w = (q - 16) * d."""
    qs, qh, d = p
    return float32(_q5_32(qs, qh, tok, i) - 16) * _f16(d, tok, i >> 5)


@cuda.jit(device=True)
def _w_q4_1(p, tok, i):
    """p = (qs, dm uint32[rows, nb] (fp16 d | fp16 m << 16)): w = d * q + m, q unsigned
    0..15 (the product rounded on its own, as the reference: never an FMA)."""
    qs, dm = p
    d, m = ptx.unpack_half2(dm[tok, i >> 5])
    return ptx.mul_rn(d, float32(_q4_32(qs, tok, i))) + m


@cuda.jit(device=True)
def _w_q5_1(p, tok, i):
    """p = (qs, qh, dm): as Q4_1 with a 5-bit unsigned q (0..31)."""
    qs, qh, dm = p
    d, m = ptx.unpack_half2(dm[tok, i >> 5])
    return ptx.mul_rn(d, float32(_q5_32(qs, qh, tok, i))) + m


@cuda.jit(device=True)
def _w_bf16(p, tok, i):
    """p = (w uint16[rows, cols] (bf16 bits),): the float32 with those 16 high bits."""
    return ptx.bits_to_f32(uint32(p[0][tok, i]) << 16)


@cuda.jit(device=True)
def _w_f16(p, tok, i):
    """p = (w uint16[rows, cols] (fp16 bits),)."""
    return _f16(p[0], tok, i)


@cuda.jit(device=True)
def _w_f32(p, tok, i):
    """p = (w float32[rows, cols],)."""
    return p[0][tok, i]


# ---- the kernel: one per format, the same body --------------------------------------
def _embed_kernel(name: str, weight):
    """The kernel of one format: thread (t, i) writes out[t, i] = weight(planes, ids[t], i)
    times scale (a zero for an id outside the table). ids int32[n], planes the format's
    planes as a tuple (device_planes), out float32[n, cols], scale float32."""
    def kernel(ids, planes, out, scale):
        tok, i = _where(ids, planes[0].shape[0], out)
        if tok < 0:
            return
        out[cuda.blockIdx.x, i] = ptx.mul_rn(weight(planes, tok, i), scale)
    kernel.__name__ = kernel.__qualname__ = name          # the name profilers show
    return kernel_cache.attach(cuda.jit(kernel))   # compiled kernels persist on disk (engine/kernel_cache.py)


# =====================================================================================
# Launcher
# =====================================================================================
_U8, _I8, _U16, _U32, _F32 = "uint8[:, ::1]", "int8[:, ::1]", "uint16[:, ::1]", "uint32[:, ::1]", "float32[:, ::1]"
# qtype -> (kernel name, weight of one element, [(plane name, plane signature)] in kernel order)
_FORMATS = {
    QType.Q6_K: ("_embed_q6_k", _w_q6_k, [("ql", _U8), ("qh", _U8), ("sc", _I8), ("d", _U16)]),
    QType.Q4_K: ("_embed_q4_k", _w_q4_k, [("hdr", _U8), ("qs", _U8)]),
    QType.Q5_K: ("_embed_q5_k", _w_q5_k, [("hdr", _U8), ("qh", _U8), ("qs", _U8)]),
    QType.Q8_0: ("_embed_q8_0", _w_q8_0, [("qs", _I8), ("d", _U16)]),
    QType.Q4_0: ("_embed_q4_0", _w_q4_0, [("qs", _U8), ("d", _U16)]),
    QType.Q5_0: ("_embed_q5_0", _w_q5_0, [("qs", _U8), ("qh", _U8), ("d", _U16)]),
    QType.Q4_1: ("_embed_q4_1", _w_q4_1, [("qs", _U8), ("dm", _U32)]),
    QType.Q5_1: ("_embed_q5_1", _w_q5_1, [("qs", _U8), ("qh", _U8), ("dm", _U32)]),
    QType.F16: ("_embed_f16", _w_f16, [("w", _U16)]),
    QType.BF16: ("_embed_bf16", _w_bf16, [("w", _U16)]),
    QType.F32: ("_embed_f32", _w_f32, [("w", _F32)]),
}
_KERNELS = {qt: _embed_kernel(name, w) for qt, (name, w, _) in _FORMATS.items()}
SUPPORTED = frozenset(_FORMATS)
KERNEL_SIGNATURES = {name: f"void(int32[::1], Tuple(({', '.join(s for _, s in planes)},)), float32[:, ::1], "
                           f"float32)" for name, _, planes in _FORMATS.values()}
_DTYPES = {_U8: np.uint8, _I8: np.int8, _U16: np.uint16, _U32: np.uint32, _F32: np.float32}
_compiled = False


def compile_kernels(qtypes=None) -> None:
    """Compile the kernels of `qtypes` (default: all) for the current GPU (at load).
    No-op in the simulator."""
    global _compiled
    if _compiled or SIMULATOR:
        return
    for qt in (qtypes or _FORMATS):
        qt = QType(qt)
        _KERNELS[qt].compile(KERNEL_SIGNATURES[_FORMATS[qt][0]])
    _compiled = qtypes is None


_is_device_array = ptx.is_device_array


def device_planes(table: PackedWeight) -> tuple:
    """The table's planes as the kernel takes them, in order (fp16 planes as uint16
    bits), checked. Call once at load and keep the tuple; `embed` calls it too (views only)."""
    if table.qtype not in _FORMATS:
        raise ValueError(f"no embedding kernel for {table.qtype.name} tables (supported: "
                         f"{', '.join(sorted(q.name for q in SUPPORTED))})")
    block = BLOCK_SIZES[table.qtype][0]
    if table.cols % block:
        raise ValueError(f"{table.qtype.name} table with {table.cols} columns: not whole blocks")
    _, _, spec = _FORMATS[table.qtype]
    planes = []
    for name, sig in spec:
        p = table.planes[name]
        if not _is_device_array(p):
            raise TypeError(f"table plane '{name}' must be on the device (upload the planes "
                            f"of quant.layout.pack to the arena), got {type(p).__name__}")
        want = _DTYPES[sig]
        if p.dtype == np.float16 and want == np.uint16:
            p = p.view(np.uint16)
        if p.dtype != want or p.ndim != 2 or p.shape[0] != table.rows:
            raise ValueError(f"table plane '{name}' must be {np.dtype(want).name}[{table.rows}, ...], "
                             f"got {p.dtype} {p.shape}")
        planes.append(p)
    return tuple(planes)


def embed(table: PackedWeight, ids, out, stream=0, planes=None, scale: float = 1.0) -> None:
    """out[t, :] = row ids[t] of the table, dequantized to float32, times `scale`
    (Gemma: sqrt(hidden); one float32 multiply per weight, exact for scale 1).

    table: PackedWeight with device planes (quant/layout.py); ids: int32[n] device array
    (decode: state[S_TOKEN:S_TOKEN + 1]); out: float32[n, table.cols] device array. `planes`: the result
    of device_planes(table), to skip the checks on the hot path."""
    if planes is None:
        planes = device_planes(table)
    if not _is_device_array(ids) or ids.dtype != np.int32 or ids.ndim != 1:
        raise TypeError(f"ids must be an int32[n] device array, got {type(ids).__name__} "
                        f"{getattr(ids, 'dtype', '')}")
    n = ids.shape[0]
    if not _is_device_array(out) or out.dtype != np.float32 or tuple(out.shape) != (n, table.cols):
        raise ValueError(f"out must be a float32[{n}, {table.cols}] device array, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    if n == 0:
        return
    grid = (n, -(-table.cols // ROW_TILE))
    _KERNELS[table.qtype][grid, ROW_TILE, stream](ids, tuple(planes), out, np.float32(scale))


def to_device(table: PackedWeight, stream=0) -> PackedWeight:
    """A copy of a host PackedWeight with its planes on the device (tests, benchmarks;
    the engine places planes in its arena instead)."""
    planes = {k: cuda.to_device(np.ascontiguousarray(v), stream=stream) for k, v in table.planes.items()}
    return PackedWeight(table.qtype, table.rows, table.cols, planes)


# =====================================================================================
# Benchmark: python -m genie_rt.quant.embed
# =====================================================================================
def _bench(rows: int = 151936, cols: int = 2560, ns=(1, 33, 512)):
    from genie_rt.engine.cuda_graph import time_us as _time_us
    from .formats import quantize
    from .layout import pack
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    compile_kernels()
    results = []
    # one random block of rows, tiled: quantizing 151936 x 2560 on the host is slow
    base = rng.standard_normal((min(rows, 1024), cols)).astype(np.float32)
    for qt in (QType.Q6_K, QType.Q4_K, QType.Q8_0, QType.F16):
        raw = np.tile(quantize(base, qt), (rows // base.shape[0] + 1, 1))[:rows]
        host = pack(raw, qt, (rows, cols))
        dev = to_device(host)
        planes = device_planes(dev)
        for n in ns:
            ids_h = rng.integers(0, rows, n).astype(np.int32)
            ids = cuda.to_device(ids_h)
            out = cuda.device_array((n, cols), np.float32)
            embed(dev, ids, out, planes=planes)
            ref = embed_reference(host, ids_h)
            assert np.array_equal(out.copy_to_host(), ref), f"{qt.name} n={n}: not bit-exact"
            row_bytes = host.nbytes // rows
            us = _time_us(lambda: embed(dev, ids, out, stream, planes), stream)
            results.append((qt.name, n, us, (n * row_bytes + 4 * n * cols) / us / 1e3))
    return results


if __name__ == "__main__":
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"# quant/embed.py: token_embd rows (151936 x 2560) on {name}, validated bit-exact "
          f"first; CUDA graph of 20 launches, median")
    print(f"{'type':<6} {'ids':>5} {'us':>9} {'GB/s':>8}")
    for name, n, us, gbs in _bench():
        print(f"{name:<6} {n:>5} {us:>9.2f} {gbs:>8.1f}")
