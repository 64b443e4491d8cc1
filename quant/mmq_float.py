"""MMQ for unquantized weights: F16 and BF16, as device-function factories that
`mmq_kernels.build_mmq_kernel` plugs into its pipeline (read mmq_kernels.py first: the
stage ring, the MMQ order of X and the fragment layout are the same).

The same fp16 mma (m16n8k16, f32 accumulate) and the same fp16 X in MMQ order as every
other format (docs/kernels/mmq.md says why not bf16 mma on bf16 activations, or q8 dp4a):
- F16: the weights are the A operand as they are. Lane t needs weights 4t..4t+3 of a k16
  group, which are two consecutive words W0 = (w0, w1), W1 = (w2, w3) of the row: one 64-bit
  shared load, then a0 = (w0, w2) and a2 = (w1, w3) by selecting halves (no arithmetic).
- BF16: the same two words, each half widened to float32 (a bf16 is the high half of a
  float32: a shift or a mask) and rounded to fp16 (cvt.rn.f16x2.f32). Exact for
  2^-14 <= |w| <= 65504 (bf16 has 8 significant bits, fp16 11); below, fp16 subnormals
  round to 2^-25 absolute; above 65504 a weight would become inf, so the CUDA back-end
  refuses such a file at load (`check_bf16_range`).

A stage is 128 weights = 256 bytes of a row, 16 chunks of cp.async, staged with the
32-weight formats' row loader (mmq_legacy.make_row_loader) on the plane viewed as bytes;
K only needs to be a multiple of 16 (prepare_x's unit): the chunks of the last, partial
stage past the row end are zero-filled, as are their activations, so they add exactly 0.
Rows are 72 words apart (64 + 8 of padding): the 64-bit loads of a half-warp (rows g =
0..3, lanes t = 0..3: words 72 g + 8 grp + 2t, +1) cover 32 distinct banks.
There is no scale table: nothing is decoded per stage.
"""
import numpy as np
from numba import cuda, uint32, uint64

from .ptx import SIMULATOR, bits_to_f32, pack_half2

U = np.uint32
U64 = np.uint64

# Format codes, after mmq_kquants' Q4_K = 0, Q6_K = 1, Q8_0 = 2, mmq_legacy's 3..7, Q5_K = 8
F16, BF16 = 9, 10
FLOAT = (F16, BF16)
NAMES = {F16: "F16", BF16: "BF16"}
LOG2_CHUNKS = 4                          # 16 chunks of 16 bytes: 128 weights of 2 bytes
RAW_CHUNKS = {F16: 18, BF16: 18}         # + 2 chunks of padding (row stride 72 words)
SC_WORDS = {F16: 0, BF16: 0}             # no scale table
FP16_MAX_BF16_BITS = 0x477F              # the largest bf16 (65280) that fp16 holds; 0x4780 = 65536 is not

_inline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def check_bf16_range(bits: np.ndarray, name: str) -> None:
    """Raise ValueError if a BF16 weight (uint16 bits) is beyond fp16's range, which the
    prefill GEMM converts BF16 weights to (inf and nan included)."""
    mag = np.asarray(bits).view(np.uint16).reshape(-1) & np.uint16(0x7FFF)
    if mag.size and int(mag.max()) > FP16_MAX_BF16_BITS:
        value = float(np.array([int(mag.max()) << 16], np.uint32).view(np.float32)[0])
        raise ValueError(f"BF16 tensor '{name}' holds a weight of magnitude {value:g}, beyond the "
                         "float16 range (65504) that the CUDA prefill GEMM converts BF16 weights "
                         "to; use --backend cpu for this file")


def make(fmt, mt, uRW, uRAW_STAGE, mma_group):
    """compute(smem, acc, buf, wrow0, g, t, xrow): the 8 k16 groups of one stage for a kernel
    of these constants (see build_mmq_kernel)."""
    assert fmt in FLOAT
    bf16 = fmt == BF16
    uRW2 = U(int(uRW) // 2)                  # row stride in 64-bit words
    assert int(uRW) % 2 == 0 and int(uRAW_STAGE) % 2 == 0

    @_inline
    def frag(lo, hi):
        """(a0, a2) of lane t from words W0 = (w0, w1), W1 = (w2, w3): (w0, w2), (w1, w3)."""
        if bf16:
            a0 = pack_half2(bits_to_f32(lo << U(16)), bits_to_f32(hi << U(16)))
            a2 = pack_half2(bits_to_f32(lo & U(0xFFFF0000)), bits_to_f32(hi & U(0xFFFF0000)))
        else:
            a0 = (lo & U(0xFFFF)) | (hi << U(16))
            a2 = (lo >> U(16)) | (hi & U(0xFFFF0000))
        return a0, a2

    @_inline
    def groups4(s64, smem, acc, afr, r64, xrow, half):
        # k16 groups 4 half .. 4 half + 3: words 8 grp + 2t, +1 of rows g, g + 8 of each m-tile
        for q in range(4):
            grp = U(4) * half + U(q)
            for i in range(mt):
                r = r64 + U(16 * i) * uRW2 + U(4) * grp
                vg = s64[r]
                v8 = s64[r + U(8) * uRW2]
                a0, a2 = frag(uint32(vg & U64(0xFFFFFFFF)), uint32(vg >> U64(32)))
                a1, a3 = frag(uint32(v8 & U64(0xFFFFFFFF)), uint32(v8 >> U64(32)))
                afr[i, 0] = a0
                afr[i, 1] = a1
                afr[i, 2] = a2
                afr[i, 3] = a3
            mma_group(smem, acc, afr, xrow, grp)

    @_inline
    def compute(smem, acc, buf, wrow0, g, t, xrow):
        s64 = cuda.shared.array(0, uint64, alignment=16)      # the same dynamic shared memory
        r64 = ((buf * uRAW_STAGE + (wrow0 + g) * uRW) >> U(1)) + t
        afr = cuda.local.array((mt, 4), uint32)
        groups4(s64, smem, acc, afr, r64, xrow, U(0))
        groups4(s64, smem, acc, afr, r64, xrow, U(1))

    return compute
