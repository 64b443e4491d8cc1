"""MMQ helper kernels: prepare_x (activations -> fp16 in MMQ order) and the mma.sync
peak probe used by the benchmark. The GEMM itself is in mmq_kernels.py; the launchers
are in mmq.py, the numpy twins in mmq_reference.py.
"""
import math

import numpy as np
from numba import cuda, float32, uint32

from genie_rt.engine import kernel_cache

from .ptx import SIMULATOR, mma_f16_f32, pack_half2
from .pdl import hooks

U = np.uint32

# =====================================================================================
# prepare_x: float32 activations -> float16 in MMQ order + per-token power-of-two scale.
# =====================================================================================
# Threads per token row. Each thread walks the row with this stride, and every step of
# its loop waits on the load before it (the sums carry from step to step), so the block is
# latency-bound. With N of 16-48 tokens there are only N blocks: 512 threads keep each
# thread's chain to cols / 512 loads. The simulator runs one Python thread per CUDA thread,
# so there it uses 128 (same code).
PREP_THREADS = 128 if SIMULATOR else 512
X_LIMIT = 16384.0       # |x / scale| stays below this: fp16 max is 65504, and the products
                        # of the mma are summed in float32, so only the inputs must fit.


@cuda.jit(device=True)
def _pair_pos(q):
    """x position p of fp16 pair q of a row in MMQ order: the pair holds x[p], x[p + 2]
    (mmq_order's permutation, two slots at a time)."""
    return ((q >> 3) << 4) + ((q & 3) << 2) + ((q >> 2) & 1)


@cuda.jit(device=True)
def _norm_and_scale(m, ss, cols, eps, has_norm, xscale, row, tid):
    """From the row's max |x * w| and sum x^2: (1 / rms or 1, 1 / scale); thread 0 stores
    the per-token scale, the power of two that brings max |v| below X_LIMIT."""
    rinv = float32(1.0)
    if has_norm:
        rinv = float32(1.0) / math.sqrt(ss / float32(cols) + float32(eps))
    amax = m * rinv
    scale = float32(1.0)
    inv = float32(1.0)
    # powers of two keep v / scale exact; a non-finite row keeps scale 1 (and stays inf/nan)
    while amax * inv > float32(X_LIMIT) and scale < float32(1e30):
        scale *= float32(2.0)
        inv *= float32(0.5)
    if tid == 0:
        xscale[row] = scale
    return rinv, inv


@cuda.jit
def prepare_x_kernel(x, norm_w, out, xscale, cols, eps, has_norm):
    """One block per token row: optional RMSNorm, per-token scale, fp16 in MMQ order.

    x       float32 [N, cols]   activations (residual stream if has_norm, else normed)
    norm_w  float32 [cols]      RMSNorm weight (read only if has_norm)
    out     uint32 [N, cols/2]  the float16 [N, cols] output viewed as pairs, MMQ order:
            word q of a row holds v[p], v[p + 2], p = 16 (q >> 3) + 4 (q & 3) + ((q >> 2) & 1)
    xscale  float32 [N]         power of two s with max|v| / s <= X_LIMIT (1 for normal rows)
    v = x / sqrt(mean(x^2) + eps) * norm_w  (has_norm)  or  v = x
    Two passes over the row (the second from L1/L2): reduce sum(x^2) and max|x * w|, then
    convert and write 4-byte words (coalesced).
    """
    red_max = cuda.shared.array(PREP_THREADS, float32)
    red_ss = cuda.shared.array(PREP_THREADS, float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    m = float32(0.0)
    ss = float32(0.0)
    k = tid
    while k < cols:
        v = x[row, k]
        if has_norm:
            ss += v * v
            v *= norm_w[k]
        m = max(m, abs(v))
        k += PREP_THREADS
    red_max[tid] = m
    red_ss[tid] = ss
    cuda.syncthreads()
    step = PREP_THREADS // 2
    while step > 0:
        if tid < step:
            red_max[tid] = max(red_max[tid], red_max[tid + step])
            red_ss[tid] += red_ss[tid + step]
        cuda.syncthreads()
        step //= 2
    rinv, inv = _norm_and_scale(red_max[0], red_ss[0], cols, eps, has_norm, xscale, row, tid)
    q = tid
    half_cols = cols >> 1
    while q < half_cols:
        p = _pair_pos(q)
        v0 = x[row, p]
        v1 = x[row, p + 2]
        if has_norm:
            v0 = v0 * rinv * norm_w[p]
            v1 = v1 * rinv * norm_w[p + 2]
        out[row, q] = pack_half2(v0 * inv, v1 * inv)
        q += PREP_THREADS


# The register-resident variant: every thread loads all of its pairs at once (the loads
# are independent, so they are in flight together), keeps them in registers through the
# reduction (warp shuffles, then one word per warp in shared memory) and converts them
# without reading x again: one round trip to memory instead of 2 * cols / (2 * 512)
# dependent ones. Specialised on J = pairs per thread; rows up to 2 * 512 * PREP_PAIRS_MAX
# values (16384), wider rows use prepare_x_kernel. Same arithmetic in the same order per
# element; sum(x^2) is added up in another order (last-bit differences in the norm).
PREP_PAIRS_MAX = 16
_WARPS = PREP_THREADS // 32
_FULL = 0xFFFFFFFF
_RESIDENT = {}


def prepare_x_kernel_for(cols: int, pdl: bool = False):
    """The prepare_x kernel for rows of `cols` values (same arguments and launch as
    prepare_x_kernel: one block of PREP_THREADS per row). pdl: the programmatic-dependent-launch
    build (sm_90+, quant/pdl.py): griddepcontrol.launch_dependents first, so the mmq launched
    after it starts copying its weights at once, then griddepcontrol.wait before it reads x;
    launched with programmatic stream serialization (mmq.prepare_x). Rows wider than the
    resident kernel's keep prepare_x_kernel (plain)."""
    j = -(-(cols // 2) // PREP_THREADS)
    if j > PREP_PAIRS_MAX:
        return prepare_x_kernel
    key = (j, bool(pdl))
    if key not in _RESIDENT:
        _RESIDENT[key] = _make_resident(max(j, 1), bool(pdl))
    return _RESIDENT[key]


def _make_resident(J, PDL=False):
    wait, launch_dependents, _ = hooks(PDL)

    @cuda.jit
    def prepare_x_resident(x, norm_w, out, xscale, cols, eps, has_norm):
        launch_dependents()
        wait()                                   # PDL: x is the kernel before's output
        red_max = cuda.shared.array(_WARPS, float32)
        red_ss = cuda.shared.array(_WARPS, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        half_cols = cols >> 1
        v0 = cuda.local.array(J, float32)
        v1 = cuda.local.array(J, float32)
        for j in range(J):                       # all loads first: they do not depend on each other
            q = tid + j * PREP_THREADS
            a = float32(0.0)
            b = float32(0.0)
            if q < half_cols:
                p = _pair_pos(q)
                a = x[row, p]
                b = x[row, p + 2]
            v0[j] = a
            v1[j] = b
        m = float32(0.0)
        ss = float32(0.0)
        for j in range(J):
            q = tid + j * PREP_THREADS
            a = v0[j]
            b = v1[j]
            if has_norm and q < half_cols:
                p = _pair_pos(q)
                ss += a * a + b * b
                a *= norm_w[p]
                b *= norm_w[p + 2]
            m = max(m, max(abs(a), abs(b)))
        for off in (16, 8, 4, 2, 1):
            m = max(m, cuda.shfl_xor_sync(_FULL, m, off))
            ss += cuda.shfl_xor_sync(_FULL, ss, off)
        if (tid & 31) == 0:
            red_max[tid >> 5] = m
            red_ss[tid >> 5] = ss
        cuda.syncthreads()
        m = red_max[0]
        ss = red_ss[0]
        for w in range(1, _WARPS):
            m = max(m, red_max[w])
            ss += red_ss[w]
        rinv, inv = _norm_and_scale(m, ss, cols, eps, has_norm, xscale, row, tid)
        for j in range(J):
            q = tid + j * PREP_THREADS
            if q < half_cols:
                a = v0[j]
                b = v1[j]
                if has_norm:
                    p = _pair_pos(q)
                    a = a * rinv * norm_w[p]
                    b = b * rinv * norm_w[p + 2]
                out[row, q] = pack_half2(a * inv, b * inv)
    return kernel_cache.attach(prepare_x_resident)


def mmq_order(cols):
    """Permutation: x_mmq = x[..., mmq_order(cols)] (the value each fp16 slot holds)."""
    s = np.arange(cols)
    grp, s16 = s >> 4, s & 15
    return 16 * grp + 4 * ((s16 & 7) >> 1) + 2 * (s16 & 1) + (s16 >> 3)


# =====================================================================================
# Tensor-core peak probe: back-to-back independent mma.sync from registers.
# =====================================================================================
@cuda.jit
def mma_peak_kernel(out, iters):
    """Each warp runs 8 independent m16n8k16 accumulator chains for `iters` rounds."""
    lane = uint32(cuda.threadIdx.x) & U(31)
    a0 = pack_half2(float32(lane) * float32(1e-3), float32(1e-3))
    a1 = a0 ^ U(0x00010000)
    acc = cuda.local.array((8, 4), float32)
    for c in range(8):
        for e in range(4):
            acc[c, e] = float32(0.0)
    for _ in range(iters):
        for c in range(8):
            r = mma_f16_f32(a0, a1, a0, a1, a1, a0, acc[c, 0], acc[c, 1], acc[c, 2], acc[c, 3])
            acc[c, 0] = r[0]
            acc[c, 1] = r[1]
            acc[c, 2] = r[2]
            acc[c, 3] = r[3]
    s = float32(0.0)
    for c in range(8):
        for e in range(4):
            s += acc[c, e]
    out[cuda.grid(1)] = s


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)
