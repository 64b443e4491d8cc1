"""numpy quantizers for GGUF formats: the writer side of `legacy.py` and `kquants.py`.

What it does: float32 blocks -> raw GGUF blocks (uint8[n_blocks, bytes_per_block]) for
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (llama.cpp's one-pass reference rules, bit
for bit, as `gguf.quants.quantize` also does) and for Q4_K, Q5_K, Q6_K (llama.cpp's
reference scale searches, `quantize_row_q{4,5,6}_K_ref` with `make_qkx2_quants` and
`make_qx_quants`, rewritten to run on every sub-block of a chunk at once).

What it deliberately does not do: importance-matrix (imatrix) weighting, the IQ / Q2_K /
Q3_K formats, or bit-identical k-quant output: the searches make the same choices as
llama.cpp's except at floating-point near-ties (sums are accumulated in a different
order), which changes no measurable error. Shape checks and row chunking live in
`formats.py`; the block layouts are documented in `legacy.py` and `kquants.py`.

Run `python -m genie_rt.quant.quantize` to print the relative RMSE of each quantizer on
N(0, 1) weights, its speed and the dequantizers' speed.
"""
import numpy as np

from .kquants import Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES

_F32 = np.float32
GROUP_MAX_EPS = _F32(1e-15)    # llama.cpp: a sub-block with max |x| below this is all zero


def _to_fp16_bytes(values: np.ndarray, what: str) -> np.ndarray:
    """float32[n] -> uint8[n, 2] (fp16, round to nearest even); refuse overflow to inf."""
    with np.errstate(over="ignore"):
        h = values.astype("<f2")
    if not np.isfinite(h).all():
        worst = float(np.max(np.abs(values)))
        raise ValueError(f"{what} {worst:g} does not fit in fp16 (max 65504): "
                         "the weights are too large for this format")
    return h.view(np.uint8).reshape(-1, 2)


def _round_away(x: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero (np.rint would round them to even)."""
    a = np.abs(x)
    fl = np.floor(a)
    return np.copysign(fl + np.floor(_F32(2) * (a - fl)), x)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8[n, 32] in 0..15 -> uint8[n, 16]: weight j low nibble, weight j + 16 high nibble."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _pack_bit4(q: np.ndarray) -> np.ndarray:
    """uint8[n, 32] in 0..31 -> uint8[n, 4]: little-endian uint32 whose bit j is bit 4 of q[j]."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


# ---------------------------------------------------------------- float types

def quantize_f32(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 1] -> uint8[n, 4]."""
    return np.ascontiguousarray(blocks, dtype="<f4").view(np.uint8)


def quantize_f16(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 1] -> uint8[n, 2] (round to nearest even; overflow to inf is refused)."""
    return _to_fp16_bytes(blocks.reshape(-1), "F16 value")


def quantize_bf16(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 1] -> uint8[n, 2]: top 16 bits, rounded to nearest even (ggml_compute_fp32_to_bf16)."""
    bits = np.ascontiguousarray(blocks, dtype=np.float32).view(np.uint32).reshape(-1).astype(np.uint64)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 64                      # keep the sign, force a quiet NaN
    out = np.where(is_nan, quiet_nan, rounded).astype("<u2")
    return out.view(np.uint8).reshape(-1, 2)


# ---------------------------------------------------------------- 32-weight blocks
# One pass each, exactly llama.cpp's quantize_row_q*_ref: the scale comes from the
# block's extreme value, every weight is rounded once.

def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """(n, k) -> (n, 1): the value of largest magnitude, first one on ties (C's strict '<')."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(np.float32)


def quantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 32] -> Q4_0 uint8[n, 18]. d = max / -8 so the extreme maps to q = 0."""
    d = _signed_absmax(blocks) / _F32(-8)                          # (n, 1)
    q = np.minimum(np.trunc(blocks * _inverse(d) + _F32(8.5)), 15).astype(np.uint8)
    return np.concatenate([_to_fp16_bytes(d[:, 0], "Q4_0 scale"), _pack_nibbles(q)], axis=1)


def quantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 32] -> Q4_1 uint8[n, 20]. d = (max - min) / 15, m = min."""
    vmin = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - vmin) / _F32(15)
    q = np.minimum(np.trunc((blocks - vmin) * _inverse(d) + _F32(0.5)), 15).astype(np.uint8)
    return np.concatenate([_to_fp16_bytes(d[:, 0], "Q4_1 scale"), _to_fp16_bytes(vmin[:, 0], "Q4_1 min"),
                           _pack_nibbles(q)], axis=1)


def quantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 32] -> Q5_0 uint8[n, 22]. d = max / -16."""
    d = _signed_absmax(blocks) / _F32(-16)
    q = np.minimum(np.trunc(blocks * _inverse(d) + _F32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_to_fp16_bytes(d[:, 0], "Q5_0 scale"), _pack_bit4(q),
                           _pack_nibbles(q & np.uint8(15))], axis=1)


def quantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 32] -> Q5_1 uint8[n, 24]. d = (max - min) / 31, m = min."""
    vmin = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - vmin) / _F32(31)
    q = np.minimum(np.trunc((blocks - vmin) * _inverse(d) + _F32(0.5)), 31).astype(np.uint8)
    return np.concatenate([_to_fp16_bytes(d[:, 0], "Q5_1 scale"), _to_fp16_bytes(vmin[:, 0], "Q5_1 min"),
                           _pack_bit4(q), _pack_nibbles(q & np.uint8(15))], axis=1)


def quantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 32] -> Q8_0 uint8[n, 34]. d = max|x| / 127, q = roundf(x / d)."""
    d = np.abs(blocks).max(axis=1, keepdims=True) / _F32(127)
    q = _round_away(blocks * _inverse(d)).astype(np.int8)
    return np.concatenate([_to_fp16_bytes(d[:, 0], "Q8_0 scale"), q.view(np.uint8)], axis=1)


# ---------------------------------------------------------------- k-quant searches
# Each search runs on every sub-block of a chunk at once: x is (N, n) with one
# sub-block per row; every per-row quantity is an (N,) vector. Only the scale (and min)
# are searched for; the quants are recomputed afterwards from the fp16/6-bit-rounded
# scales, as llama.cpp does, so the search does not keep them.

def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, n), (N, n) -> (N,): sum over each row of a * b."""
    return np.einsum("ij,ij->i", a, b)


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """Best (scale, min) per row for x ~ scale * q - min, q in 0..nmax (llama.cpp make_qkx2_quants).

    x, weights: float32[N, n]. Returns (scale float32[N], the_min float32[N]) with the_min >= 0.
    Start from the range [min(x, 0), max(x)] split into nmax steps; then try nstep + 1
    grids with nmax + rmin + rdelta * k steps over the current range; for each, round x
    onto it and solve the weighted least squares for scale and offset in closed form;
    keep the candidate with the smallest weighted squared error. The offset is kept <= 0.
    """
    vmin = np.minimum(x.min(axis=1), _F32(0))                      # (N,) offset, <= 0
    vmax = x.max(axis=1)                                           # (N,)
    flat = vmax == vmin                                            # nothing to quantize
    sum_w = weights.sum(axis=1)
    wx = weights * x                                               # (N, n)
    sum_x = wx.sum(axis=1)
    sum_x2 = _rowdot(wx, x).astype(np.float64)

    def candidate_error(scale, offset, sum_l, sum_l2, sum_xl):
        # sum w (scale * l + offset - x)^2 expanded into the row sums, in float64
        s, m = scale.astype(np.float64), offset.astype(np.float64)
        return (s * s * sum_l2 + 2 * s * m * sum_l - 2 * s * sum_xl
                + m * m * sum_w - 2 * m * sum_x + sum_x2)

    def grid_sums(iscale, offset):
        lv = np.rint(iscale[:, None] * (x - offset[:, None]))        # nearest_int: half to even
        np.clip(lv, 0, nmax, out=lv)
        wl = weights * lv
        return wl.sum(axis=1), _rowdot(wl, lv), _rowdot(wl, x)

    with np.errstate(divide="ignore", invalid="ignore"):
        span = np.where(flat, _F32(1), vmax - vmin)
        iscale = _F32(nmax) / span
        scale = _F32(1) / iscale
        best = candidate_error(scale, vmin, *grid_sums(iscale, vmin))
        for step in range(nstep + 1):
            span = vmax - vmin                                     # vmin follows the best candidate
            iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / np.where(span > 0, span, _F32(1))
            sum_l, sum_l2, sum_xl = grid_sums(iscale, vmin)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0                                # an offset above zero is not allowed:
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)   # refit the scale alone
            this_min = np.where(positive, _F32(0), this_min)
            err = candidate_error(this_scale, this_min, sum_l, sum_l2, sum_xl)
            better = (det > 0) & (span > 0) & ~flat & (err < best)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            vmin = np.where(better, this_min, vmin)
    scale = np.where(flat, _F32(0), scale).astype(np.float32)
    return scale, (-vmin).astype(np.float32)


def make_qx_quants(x: np.ndarray, nmax: int) -> np.ndarray:
    """Best signed scale per row for x ~ scale * q, q in -nmax..nmax-1 (llama.cpp make_qx_quants, rmse_type 1).

    x: float32[N, n] -> scale float32[N] (0 for an all-zero row). Weights are x^2 (large
    values matter most). The first grid maps the value of largest magnitude to -nmax;
    18 more grids with nmax + 0.1 k steps (k = -9..9) are tried, each with the least
    squares scale for its rounding; the one with the largest sumlx^2 / suml2 (the
    smallest weighted error) wins. The scale's sign is opposite to that of the extreme.
    """
    vmax = _signed_absmax(x)[:, 0]                                 # (N,) signed extreme
    zero = np.abs(vmax) < GROUP_MAX_EPS
    vmax = np.where(zero, _F32(1), vmax)
    w = x * x
    wx = w * x

    def fit(iscale):
        lv = np.rint(iscale[:, None] * x)
        np.clip(lv, -nmax, nmax - 1, out=lv)
        return _rowdot(wx, lv), _rowdot(w * lv, lv)                # sumlx, suml2

    with np.errstate(divide="ignore", invalid="ignore"):
        sumlx, suml2 = fit(_F32(-nmax) / vmax)
        scale = np.where(suml2 > 0, sumlx / suml2, _F32(0))
        best = scale * sumlx
        for k in range(-9, 10):
            if k == 0:
                continue
            sumlx, suml2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(k)) / vmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, _F32(0), scale).astype(np.float32)


def _k_scales_and_mins(xs: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K/Q5_K first stage: search each sub-block's scale and min, round them to 6 bits.

    xs float32[n, 8, 32] -> (d, dmin float32[n] as stored in fp16, ls, lm uint8[n, 8] the
    6-bit scales and mins, header uint8[n, 16] = the block's first 16 bytes).
    """
    n = xs.shape[0]
    x = xs.reshape(n * 8, 32)
    av_x = np.sqrt(_rowdot(x, x) / _F32(32))                       # per sub-block RMS
    weights = av_x[:, None] + np.abs(x)                            # llama.cpp: av_x + |x|
    scales, mins = make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))            # (n,)
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    ls = np.clip(np.rint(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    header = np.empty((n, 16), dtype=np.uint8)
    header[:, 0:2] = _to_fp16_bytes(max_scale / _F32(63), "k-quant super-block scale")
    header[:, 2:4] = _to_fp16_bytes(max_min / _F32(63), "k-quant super-block min")
    header[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)          # see the table in kquants.py
    header[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    header[:, 12:16] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    d = header[:, 0:2].copy().view("<f2")[:, 0].astype(np.float32)
    dmin = header[:, 2:4].copy().view("<f2")[:, 0].astype(np.float32)
    return d, dmin, ls, lm, header


def _k_requantize(xs: np.ndarray, d, dmin, ls, lm, nmax: int) -> np.ndarray:
    """Round every weight onto its final (rounded) sub-block grid. -> uint8[n, 8, 32] in 0..nmax."""
    step = (d[:, None] * ls.astype(np.float32))[:, :, None]        # (n, 8, 1)
    offset = (dmin[:, None] * lm.astype(np.float32))[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((xs + offset) / step)
    q = np.where(step == 0, _F32(0), q)                            # scale 0: every weight is -offset
    return np.clip(q, 0, nmax).astype(np.uint8)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 256] -> Q4_K uint8[n, 144] (llama.cpp quantize_row_q4_K_ref)."""
    n = blocks.shape[0]
    xs = blocks.reshape(n, 8, 32)
    d, dmin, ls, lm, header = _k_scales_and_mins(xs, 15, -1.0, 0.1, 20)
    q = _k_requantize(xs, d, dmin, ls, lm, 15).reshape(n, 4, 2, 32)
    out = np.empty((n, Q4_K_BYTES), dtype=np.uint8)
    out[:, :16] = header
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)  # chunk c: sub-blocks 2c | 2c+1
    return out


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 256] -> Q5_K uint8[n, 176] (llama.cpp quantize_row_q5_K_ref)."""
    n = blocks.shape[0]
    xs = blocks.reshape(n, 8, 32)
    d, dmin, ls, lm, header = _k_scales_and_mins(xs, 31, -0.5, 0.1, 15)
    q = _k_requantize(xs, d, dmin, ls, lm, 31)                     # (n, 8, 32)
    out = np.empty((n, Q5_K_BYTES), dtype=np.uint8)
    out[:, :16] = header
    out[:, 16:48] = np.packbits((q >> 4) & 1, axis=1, bitorder="little")[:, 0, :]  # bit j: sub-block j
    low = (q & 15).reshape(n, 4, 2, 32)
    out[:, 48:] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    return out


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """float32[n, 256] -> Q6_K uint8[n, 210] (llama.cpp quantize_row_q6_K_ref)."""
    n = blocks.shape[0]
    xs = blocks.reshape(n, 16, 16)
    scales = make_qx_quants(xs.reshape(n * 16, 16), 32).reshape(n, 16)
    # the sub-block scale of largest magnitude (first on ties) becomes -128
    max_scale = _signed_absmax(scales)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS                      # all-zero super-block
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, _F32(0), _F32(-128) / max_scale)
        d_bytes = _to_fp16_bytes(np.where(zero, _F32(0), _F32(1) / iscale), "Q6_K super-block scale")
    sc = np.clip(np.rint(iscale[:, None] * scales), -128, 127).astype(np.int8)   # (n, 16)
    d = d_bytes.copy().view("<f2")[:, 0].astype(np.float32)
    step = (d[:, None] * sc.astype(np.float32))[:, :, None]        # (n, 16, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(xs / step)
    q = np.where(step == 0, _F32(0), q)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # (n, half, quarter, lane)
    out = np.empty((n, Q6_K_BYTES), dtype=np.uint8)
    low = q & 15
    out[:, 0:128] = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    high = q >> 4
    high = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)   # (n, half, lane)
    out[:, 128:192] = high.reshape(n, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d_bytes
    out[zero] = 0                                                 # as llama.cpp: an all-zero block
    return out


def _main() -> None:
    import time

    from .formats import QType, dequantize, quantize, row_bytes
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 4096), dtype=np.float32)
    big = rng.standard_normal((4096, 4096), dtype=np.float32)
    llama = {QType.Q4_K: "0.0713", QType.Q6_K: "0.0177"}
    print(f"relative RMSE ||w - deq(q(w))|| / ||w|| on N(0,1) weights {w.shape}; times for 4096 x 4096")
    print("type   rmse    llama.cpp  quantize           dequantize")
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K):
        rmse = np.linalg.norm(w - dequantize(quantize(w, qtype), qtype, w.shape)) / np.linalg.norm(w)
        t0 = time.perf_counter()
        q = quantize(big, qtype)
        t1 = time.perf_counter()
        dequantize(q, qtype, big.shape)
        t2 = time.perf_counter()
        print(f"{qtype.name:5s}  {rmse:.4f}  {llama.get(qtype, '-'):9s}"
              f"  {t1 - t0:5.2f} s {big.size / (t1 - t0) / 1e6:5.1f} Mw/s"
              f"  {t2 - t1:5.2f} s {big.size / (t2 - t1) / 1e6:5.0f} Mw/s")
    rows, cols = 151936, 2560                                      # Qwen3-4B's token embedding
    raw = rng.integers(0, 256, size=(rows, row_bytes(QType.Q6_K, cols)), dtype=np.uint8)
    raw.reshape(-1, Q6_K_BYTES)[:, 209] &= 0x3B                    # keep every fp16 d finite
    t0 = time.perf_counter()
    dequantize(raw, QType.Q6_K, (rows, cols))
    dt = time.perf_counter() - t0
    print(f"Q6_K {rows} x {cols} dequantize (1.56 GB of float32 out): {dt:.2f} s, {rows * cols / dt / 1e6:.0f} Mw/s")


if __name__ == "__main__":
    _main()
