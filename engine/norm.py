"""RMSNorm, fused residual + RMSNorm, and SwiGLU on the GPU (float32 math).

The math (engine/models/reference.py is the reference):

    rmsnorm(x) * w       = x / sqrt(mean(x^2) + eps) * w          rows of x: [n, d]
    add_rmsnorm          : x += delta (in place); h = rmsnorm(x) * w   one pass over x
    rmsnorm_q8           : h = rmsnorm(x) * w -> q8 activations of h (xq, xs) for the dp4a
                           GEMVs (quant/gemv.py), optionally h too; one launch
    post_norm_add        : x += rmsnorm(y) * w_post (Gemma 3's post-attention / post-FFN
                           norm before the residual add), optionally then
                           h = rmsnorm(x) * w_next (f32 / f16) or its q8 (post_norm_add_q8)
    swiglu(g, u)         = silu(g) * u = g / (1 + exp(-g)) * u    [n, n_ff]
    geglu(g, u)          = gelu(g) * u, gelu the tanh form ggml uses (Gemma 3's FFN)

Who does what: one block per row for the norms (thread t owns elements t, t + B, ...,
coalesced; sum of squares reduced by warp shuffles, then across warps through shared
memory); a 2-D grid for SwiGLU (blockIdx.y = row, threads over columns). Outputs are
float32, or float16 for a tensor-core GEMM input (the cast is the last operation).
The per-element formula is the reference's, op for op (x / s * w, not x * (1/s) * w):
results differ from numpy only by the order of the sum of squares.

Traffic per row of d floats: rmsnorm reads 4d bytes and writes 4d (2d for float16);
add_rmsnorm reads 8d (x, delta) and writes 8d (x, h). Decode (n = 1) is latency-bound
(~a few us); prefill streams at memory bandwidth.

rmsnorm_q8 quantizes h as quant/gemv.py's quantize_q8 does (one warp per 32 values:
amax by shuffles, q = rint(h * (127 / amax)), 4 floats of xs per 32 values), with the
same float32 operations in the same order as rmsnorm followed by quantize_q8_kernel, so
its xq / xs are bit-identical to the two launches (at the same block size: the block
fixes the order of the sum of squares). It saves the launch of quantize_q8 and the
write + read of h when no GEMV reads float h.

post_norm_add is bit-identical to rmsnorm(y, w_post) -> add_rmsnorm(x, ., w_next) (and the
q8 form to rmsnorm, an add, then rmsnorm_q8) at the same block size: the product
y / s * w_post is rounded to float32 before the add (`mul.rn`, which NVVM never contracts
into an FMA with it), as the two-launch sequence stores it.

Deliberately not here: stand-alone activation quantization (quant/gemv.py's
quantize_q8), QK-norm fused with RoPE (kvcache/rope_write.py); rmsnorm over heads works
by viewing q as [n*heads, head_dim]; the embedding scale of Gemma (quant/embed.py's
caller); soft-capping.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from genie_rt.quant import ptx   # simulator: installs warp shuffles
# the block-wide sum and the warp's q8 store, shared with the GEMV that folds this norm into
# its last block (quant/gemv_kernels.py NORM): one definition, the same bits
from genie_rt.quant.norm_q8_device import block_sum as _block_sum
from genie_rt.quant.norm_q8_device import norm_block
from genie_rt.quant.norm_q8_device import q8_store as _q8_store
from genie_rt.quant import pdl
from genie_rt.quant.pdl import launch_or_plain

from . import kernel_cache

SIMULATOR = ptx.SIMULATOR
Q8_BLOCK = 32                      # values per q8 scale (quant/gemv.py)
Q8_FLOATS = 4                      # floats of xs per 32 values


# =====================================================================================
# numpy reference
# =====================================================================================
def rmsnorm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x[..., d] / sqrt(mean(x^2) + eps) * w[d], float32 (engine/models/reference.py's rmsnorm)."""
    x = np.asarray(x, np.float32)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + np.float32(eps)) * np.asarray(w, np.float32)


def rmsnorm_q8_reference(x: np.ndarray, w: np.ndarray, eps: float):
    """(h, xq, xs): h = rmsnorm_reference(x, w, eps) and its q8 activations
    (quant/gemv.py's quantize_q8_reference: xq int8 [n, d], xs float32 [n, d // 8])."""
    from genie_rt.quant.gemv import quantize_q8_reference
    h = rmsnorm_reference(x, w, eps)
    xq, xs = quantize_q8_reference(h.reshape(-1, h.shape[-1]))
    return h, xq, xs


def post_norm_add_reference(x: np.ndarray, y: np.ndarray, w_post: np.ndarray, eps: float,
                            w_next: np.ndarray | None = None):
    """(x + rmsnorm(y) * w_post, rmsnorm(that) * w_next or None), float32: Gemma 3's
    `x = x + post_norm(block(x))`, then the next block's pre-norm (llama.cpp gemma3.cpp:
    attn_post_norm -> add -> ffn_norm; ffn_post_norm -> add -> the next attn_norm)."""
    x_new = np.asarray(x, np.float32) + rmsnorm_reference(y, w_post, eps)
    h = None if w_next is None else rmsnorm_reference(x_new, w_next, eps)
    return x_new, h


GELU_A = np.float32(0.044715)                       # ggml's GELU_COEF_A
GELU_S = np.float32(0.79788456080286535587989211986876)   # ggml's SQRT_2_OVER_PI


def gelu_reference(g: np.ndarray) -> np.ndarray:
    """0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))), float32 (ggml_gelu_f32's
    formula; ggml's CPU build may read it from an f16 table instead)."""
    g = np.asarray(g, np.float32)
    return np.float32(0.5) * g * (np.float32(1) + np.tanh(GELU_S * g * (np.float32(1) + GELU_A * g * g)))


def geglu_reference(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gelu(g) * u, float32 (llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR: Gemma's FFN)."""
    return gelu_reference(g) * np.asarray(u, np.float32)


def swiglu_reference(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, float32 (engine/models/reference.py's silu)."""
    g = np.asarray(g, np.float32)
    return g / (np.float32(1) + np.exp(-g)) * np.asarray(u, np.float32)


# =====================================================================================
# Kernels
# =====================================================================================
@cuda.jit
def _rmsnorm_kernel(x, w, out, eps):
    """Block r normalises row r. x float32[n, d], w float32[d], out float32 or
    float16 [n, d], eps float32."""
    sh = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    d = x.shape[1]
    ss = float32(0)
    for i in range(tid, d, bdim):
        v = x[r, i]
        ss += v * v
    ss = _block_sum(ss, sh)
    s = math.sqrt(ss / float32(d) + eps)
    for i in range(tid, d, bdim):
        out[r, i] = x[r, i] / s * w[i]


@cuda.jit
def _add_rmsnorm_kernel(x, delta, w, out, eps):
    """Block r: x[r] += delta[r] (written back), out[r] = rmsnorm(x[r]) * w.
    x, delta float32[n, d], w float32[d], out float32 or float16 [n, d]."""
    sh = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    d = x.shape[1]
    ss = float32(0)
    for i in range(tid, d, bdim):
        v = x[r, i] + delta[r, i]
        x[r, i] = v                    # each element is owned by one thread: re-read below
        ss += v * v
    ss = _block_sum(ss, sh)
    s = math.sqrt(ss / float32(d) + eps)
    for i in range(tid, d, bdim):
        out[r, i] = x[r, i] / s * w[i]


def _make_rmsnorm_q8_kernel(write_h: bool):
    """The fused rmsnorm -> q8 kernel; write_h (a compile-time constant) also stores h."""
    @cuda.jit
    def kernel(x, w, out, xq, xs, eps):
        """Block r: h = rmsnorm(x[r]) * w, then q8 of h per 32 values exactly as
        quant/gemv_kernels.py's quantize_q8_kernel computes it: xq[r] int8, xs[r] 4 floats
        per 32 (d, d * sum q[0:16], d * sum q[16:32], d * sum q[0:32]); out[r] = h if
        write_h (otherwise out is not touched). x float32[n, d] with d % 32 == 0,
        w float32[d], out float32[n, d], xq int8[n, d], xs float32[n, d // 8], eps float32.
        Block size a multiple of 32: warp k's lanes take the 32 consecutive values
        32k + base .. + 31, a whole q8 block, and every lane of a warp runs the same
        number of iterations (d % 32 == 0), so the shuffles see the full warp."""
        sh = cuda.shared.array(32, float32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        bdim = cuda.blockDim.x
        d = x.shape[1]
        ss = float32(0)                # pass 1: _rmsnorm_kernel's, op for op
        for i in range(tid, d, bdim):
            v = x[r, i]
            ss += v * v
        ss = _block_sum(ss, sh)
        s = math.sqrt(ss / float32(d) + eps)
        for i in range(tid, d, bdim):
            v = float32(x[r, i] / s * w[i])        # rmsnorm's value, rounded to float32
            if write_h:
                out[r, i] = v
            _q8_store(v, xq, xs, r, i)
    return kernel_cache.attach(kernel)


_rmsnorm_q8_kernel = _make_rmsnorm_q8_kernel(False)
_rmsnorm_q8_h_kernel = _make_rmsnorm_q8_kernel(True)


# The register-resident form of the same kernel, specialised on J = ceil(d / block) values
# per thread and launched as J blocks per row (grid (n, J)): every block issues all J loads of
# x (and its one load of w) before the first is used and computes the whole row's sum of
# squares - the same operations in the same order as the loop kernel (thread t adds its values
# t, t + B, ... exactly as the loop does), so every block gets the same bits - and then block j
# quantizes only the values t + j * B. A decode-step norm (one row: latency-bound) thus waits on
# memory once instead of 2J times in a row, and its q8 part (10 shuffles and two IEEE divisions a
# value) runs on J SMs at once instead of J times over on one: on the H200 (Nsight Compute,
# 2026-12-03) the one-block form was ~8,000 cycles for d = 2560, 4 of its 5 phases the q8 part.
# Bit-identical to the loop kernel and to rmsnorm + quantize_q8. Rows of more than RESIDENT_MAX
# values per thread use the loop kernel.
RESIDENT_MAX = 16


def _make_rmsnorm_q8_resident(write_h: bool, J: int, PDL: bool = False):
    wait, launch_dependents, _ = pdl.hooks(PDL)  # griddepcontrol: sm_90+ PDL builds only

    @cuda.jit
    def kernel(x, w, out, xq, xs, eps):
        """_make_rmsnorm_q8_kernel's kernel (same arguments), J values per thread; grid
        (n, J): block (r, j) computes row r's sum of squares and h, xq, xs of the values
        t + j * blockDim. PDL: the next kernel may launch at once; the weight is read before
        waiting for the kernel before (x is its output)."""
        launch_dependents()
        sh = cuda.shared.array(32, float32)
        r = cuda.blockIdx.x
        jb = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        bdim = cuda.blockDim.x
        d = x.shape[1]
        mine = tid + jb * bdim                   # the value this thread quantizes
        wv = w[mine] if mine < d else float32(0)
        wait()
        vals = cuda.local.array(J, float32)
        for j in range(J):                       # every load first
            i = tid + j * bdim
            vals[j] = x[r, i] if i < d else float32(0)
        xv = x[r, mine] if mine < d else float32(0)    # = vals[jb], read again (an L1 hit):
        # picking vals[jb] out of the registers by a run-time jb put vals in local memory
        ss = float32(0)
        for j in range(J):
            if tid + j * bdim < d:
                ss += vals[j] * vals[j]
        ss = _block_sum(ss, sh)
        s = math.sqrt(ss / float32(d) + eps)
        if mine < d:                             # warp-uniform: d and bdim are multiples of 32
            v = float32(xv / s * wv)
            if write_h:
                out[r, mine] = v
            _q8_store(v, xq, xs, r, mine)
    return kernel_cache.attach(kernel)


_rmsnorm_q8_r4_kernel = _make_rmsnorm_q8_resident(False, 4)      # d = 4 * block: 1024-4096
_rmsnorm_q8_h_r4_kernel = _make_rmsnorm_q8_resident(True, 4)
_RESIDENT = {(False, 4, False): _rmsnorm_q8_r4_kernel, (True, 4, False): _rmsnorm_q8_h_r4_kernel}


def _rmsnorm_q8_for(write_h: bool, d: int, block: int, pdl: bool = False):
    """The kernel for rows of d values at this block size: the register-resident one (a PDL
    build when asked) up to RESIDENT_MAX values a thread, else the loop kernel (never PDL)."""
    j = -(-d // block)
    if j > RESIDENT_MAX:
        return _rmsnorm_q8_h_kernel if write_h else _rmsnorm_q8_kernel
    k = _RESIDENT.get((write_h, j, pdl))
    if k is None:
        k = _RESIDENT[(write_h, j, pdl)] = _make_rmsnorm_q8_resident(write_h, j, pdl)
    return k


@cuda.jit
def _swiglu_kernel(g, g_col, u, u_col, out):
    """out[r, j] = silu(g[r, g_col + j]) * u[r, u_col + j] for j < out.shape[1]; grid
    (ceil(n_ff / B), n). g and u may be one [n, 2*n_ff] array (gate then up)."""
    r = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < out.shape[1]:
        a = g[r, g_col + j]
        out[r, j] = a / (float32(1) + math.exp(-a)) * u[r, u_col + j]


_GELU_A = float32(GELU_A)
_GELU_S = float32(GELU_S)


@cuda.jit
def _geglu_kernel(g, g_col, u, u_col, out):
    """_swiglu_kernel with gelu (the tanh form) in place of silu: Gemma's FFN."""
    r = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < out.shape[1]:
        a = g[r, g_col + j]
        t = math.tanh(_GELU_S * a * (float32(1) + _GELU_A * a * a))
        out[r, j] = float32(0.5) * a * (float32(1) + t) * u[r, u_col + j]


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)


# =====================================================================================
# Launchers
# =====================================================================================
KERNEL_SIGNATURES = {
    "_rmsnorm_kernel": [
        "void(float32[:, ::1], float32[::1], float32[:, ::1], float32)",
        "void(float32[:, ::1], float32[::1], float16[:, ::1], float32)"],
    "_add_rmsnorm_kernel": [
        "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[:, ::1], float32)",
        "void(float32[:, ::1], float32[:, ::1], float32[::1], float16[:, ::1], float32)"],
    "_rmsnorm_q8_kernel": [
        "void(float32[:, ::1], float32[::1], float32[:, ::1], int8[:, ::1], float32[:, ::1], float32)"],
    "_rmsnorm_q8_h_kernel": [
        "void(float32[:, ::1], float32[::1], float32[:, ::1], int8[:, ::1], float32[:, ::1], float32)"],
    "_rmsnorm_q8_r4_kernel": [
        "void(float32[:, ::1], float32[::1], float32[:, ::1], int8[:, ::1], float32[:, ::1], float32)"],
    "_rmsnorm_q8_h_r4_kernel": [
        "void(float32[:, ::1], float32[::1], float32[:, ::1], int8[:, ::1], float32[:, ::1], float32)"],
    "_swiglu_kernel": [
        "void(float32[:, ::1], int32, float32[:, ::1], int32, float32[:, ::1])",
        "void(float32[:, ::1], int32, float32[:, ::1], int32, float16[:, ::1])"],
    "_geglu_kernel": [
        "void(float32[:, ::1], int32, float32[:, ::1], int32, float32[:, ::1])",
        "void(float32[:, ::1], int32, float32[:, ::1], int32, float16[:, ::1])"],
}
_compiled = False


def compile_kernels() -> None:
    """Compile every kernel for the current GPU now (at load). No-op in the simulator."""
    global _compiled
    if _compiled or SIMULATOR:
        return
    for name, sigs in KERNEL_SIGNATURES.items():
        for sig in sigs:
            globals()[name].compile(sig)
    _compiled = True


_is_device_array = ptx.is_device_array


def _check2d(name, a, dtypes, shape=None):
    if not _is_device_array(a):
        raise TypeError(f"{name} must be a device array, got {type(a).__name__}")
    if a.ndim != 2 or a.dtype not in [np.dtype(t) for t in dtypes]:
        raise TypeError(f"{name} must be a 2-d {'/'.join(np.dtype(t).name for t in dtypes)} "
                        f"array, got {a.dtype} {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if a.strides[1] != a.dtype.itemsize or a.strides[0] != a.shape[1] * a.dtype.itemsize:
        raise ValueError(f"{name} must be C-contiguous")


def _check_weight(w, d):
    if not _is_device_array(w):
        raise TypeError(f"w must be a device array, got {type(w).__name__}")
    if w.ndim != 1 or w.dtype != np.float32 or w.shape[0] != d:
        raise ValueError(f"w must be float32[{d}], got {w.dtype} {w.shape}")


_OUT = (np.float32, np.float16)


def rmsnorm(x, w, out, eps: float, stream=0, block: int | None = None) -> None:
    """out[n, d] = rmsnorm(x[n, d]) * w[d] (out float32 or float16)."""
    _check2d("x", x, (np.float32,))
    n, d = x.shape
    _check_weight(w, d)
    _check2d("out", out, _OUT, (n, d))
    if n == 0:
        return
    _rmsnorm_kernel[n, block or norm_block(d), stream](x, w, out, np.float32(eps))


def add_rmsnorm(x, delta, w, out, eps: float, stream=0, block: int | None = None) -> None:
    """x += delta (in place); out = rmsnorm(x) * w. All [n, d]; out float32 or float16."""
    _check2d("x", x, (np.float32,))
    n, d = x.shape
    _check2d("delta", delta, (np.float32,), (n, d))
    _check_weight(w, d)
    _check2d("out", out, _OUT, (n, d))
    if n == 0:
        return
    _add_rmsnorm_kernel[n, block or norm_block(d), stream](x, delta, w, out, np.float32(eps))


def rmsnorm_q8(x, w, xq, xs, eps: float, stream=0, out=None, block: int | None = None,
               pdl: bool = False) -> None:
    """q8 activations of h = rmsnorm(x) * w in one launch: xq int8 [n, d], xs float32
    [n, d // 8] (quant/gemv.py's quantize_q8 layout, bit-identical to rmsnorm followed by
    quantize_q8 at the same block); out float32 [n, d] gets h too when given (for a GEMV
    that reads float x). x float32 [n, d] with d % 32 == 0, w float32 [d]. pdl: the
    programmatic-dependent-launch build and launch (quant/pdl.py, sm_90+; rows of at most
    RESIDENT_MAX values a thread, the loop kernel launches plainly); the same bits."""
    _check2d("x", x, (np.float32,))
    n, d = x.shape
    if d % Q8_BLOCK:
        raise ValueError(f"rmsnorm_q8: d = {d} is not a multiple of {Q8_BLOCK}")
    _check_weight(w, d)
    _check2d("xq", xq, (np.int8,), (n, d))
    _check2d("xs", xs, (np.float32,), (n, d // Q8_BLOCK * Q8_FLOATS))
    if out is not None:
        _check2d("out", out, (np.float32,), (n, d))
    bdim = block or norm_block(d)
    if bdim % 32 or not 32 <= bdim <= 1024:
        raise ValueError(f"rmsnorm_q8: block = {bdim} must be a multiple of 32 in 32..1024")
    if n == 0:
        return
    if out is not None and ptx.device_address(out) == ptx.device_address(x):
        raise ValueError("rmsnorm_q8: out must not be x (the row's blocks read x while others "
                         "write h)")
    j = -(-d // bdim)
    pdl = bool(pdl) and j <= RESIDENT_MAX
    kern = _rmsnorm_q8_for(out is not None, d, bdim, pdl)
    grid = (n, j) if j <= RESIDENT_MAX else n          # the resident kernel: J blocks a row
    # out is not touched without write_h: x stands in for it
    launch_or_plain(kern, grid, bdim, stream, KERNEL_SIGNATURES["_rmsnorm_q8_r4_kernel"][0], pdl,
                    x, w, x if out is None else out, xq, xs, np.float32(eps))


def _glu_launch(kernel, g, g_col, u, u_col, out, stream, block):
    n, n_ff = out.shape
    if n == 0 or n_ff == 0:
        return
    grid = (-(-n_ff // block), n)
    kernel[grid, block, stream](g, np.int32(g_col), u, np.int32(u_col), out)


def _swiglu_launch(g, g_col, u, u_col, out, stream, block):
    _glu_launch(_swiglu_kernel, g, g_col, u, u_col, out, stream, block)


def swiglu(gate, up, out, stream=0, block: int = 256) -> None:
    """out[n, n_ff] = silu(gate) * up, gate and up float32[n, n_ff]."""
    _check2d("out", out, _OUT)
    _check2d("gate", gate, (np.float32,), out.shape)
    _check2d("up", up, (np.float32,), out.shape)
    _swiglu_launch(gate, 0, up, 0, out, stream, block)


def swiglu_fused(gate_up, out, stream=0, block: int = 256) -> None:
    """out[n, n_ff] = silu(gate_up[:, :n_ff]) * gate_up[:, n_ff:] (one GEMM's output
    with the gate rows first, then the up rows)."""
    _check2d("out", out, _OUT)
    n, n_ff = out.shape
    _check2d("gate_up", gate_up, (np.float32,), (n, 2 * n_ff))
    _swiglu_launch(gate_up, 0, gate_up, n_ff, out, stream, block)


def geglu(gate, up, out, stream=0, block: int = 256) -> None:
    """out[n, n_ff] = gelu(gate) * up (tanh form), gate and up float32[n, n_ff]."""
    _check2d("out", out, _OUT)
    _check2d("gate", gate, (np.float32,), out.shape)
    _check2d("up", up, (np.float32,), out.shape)
    _glu_launch(_geglu_kernel, gate, 0, up, 0, out, stream, block)


def geglu_fused(gate_up, out, stream=0, block: int = 256) -> None:
    """out[n, n_ff] = gelu(gate_up[:, :n_ff]) * gate_up[:, n_ff:]."""
    _check2d("out", out, _OUT)
    n, n_ff = out.shape
    _check2d("gate_up", gate_up, (np.float32,), (n, 2 * n_ff))
    _glu_launch(_geglu_kernel, gate_up, 0, gate_up, n_ff, out, stream, block)


# =====================================================================================
# Benchmark: python -m genie_rt.engine.norm
# =====================================================================================
def _bench(d: int = 2560, n_ff: int = 9728, ns=(1, 33, 512)) -> list[tuple]:
    from genie_rt.quant import gemv

    from .cuda_graph import time_us as _time_us
    rng = np.random.default_rng(0)
    eps = 1e-6
    stream = cuda.stream()
    compile_kernels()
    rows = []
    w_h = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    w = cuda.to_device(w_h)
    for n in ns:
        x_h = rng.standard_normal((n, d)).astype(np.float32)
        dl_h = rng.standard_normal((n, d)).astype(np.float32)
        x, dl = cuda.to_device(x_h), cuda.to_device(dl_h)
        o32 = cuda.device_array((n, d), np.float32)
        o16 = cuda.device_array((n, d), np.float16)
        # validate first
        rmsnorm(x, w, o32, eps)
        ref = rmsnorm_reference(x_h, w_h, eps)
        err = float(np.max(np.abs(o32.copy_to_host() - ref) / (1e-6 + np.abs(ref))))
        assert err < 1e-4, f"rmsnorm n={n}: relative error {err}"
        add_rmsnorm(x, dl, w, o16, eps)
        ref16 = rmsnorm_reference(x_h + dl_h, w_h, eps).astype(np.float16)
        assert np.allclose(o16.copy_to_host().astype(np.float32), ref16.astype(np.float32), rtol=2e-3, atol=1e-3)
        xq, xs = cuda.device_array((n, d), np.int8), cuda.device_array((n, d // 8), np.float32)
        xq2, xs2 = cuda.device_array((n, d), np.int8), cuda.device_array((n, d // 8), np.float32)
        rmsnorm(x, w, o32, eps)
        gemv.quantize_q8(o32, xq2, xs2)
        rmsnorm_q8(x, w, xq, xs, eps)
        assert np.array_equal(xq.copy_to_host(), xq2.copy_to_host()) and \
            np.array_equal(xs.copy_to_host().view(np.int32), xs2.copy_to_host().view(np.int32)), \
            f"rmsnorm_q8 n={n}: not bit-identical to rmsnorm + quantize_q8"
        gu_h = rng.standard_normal((n, 2 * n_ff)).astype(np.float32)
        gu = cuda.to_device(gu_h)
        h = cuda.device_array((n, n_ff), np.float32)
        swiglu_fused(gu, h)
        ref = swiglu_reference(gu_h[:, :n_ff], gu_h[:, n_ff:])
        assert np.allclose(h.copy_to_host(), ref, rtol=1e-5, atol=1e-6)
        cases = [("rmsnorm f32", lambda: rmsnorm(x, w, o32, eps, stream), 8 * n * d),
                 ("rmsnorm ->f16", lambda: rmsnorm(x, w, o16, eps, stream), 6 * n * d),
                 ("add_rmsnorm", lambda: add_rmsnorm(x, dl, w, o32, eps, stream), 16 * n * d),
                 ("rmsnorm_q8", lambda: rmsnorm_q8(x, w, xq, xs, eps, stream), 5.5 * n * d),
                 ("swiglu_fused", lambda: swiglu_fused(gu, h, stream), 12 * n * n_ff)]
        for name, fn, nbytes in cases:
            us = _time_us(fn, stream)
            rows.append((name, n, us, nbytes / us / 1e3))
    return rows


if __name__ == "__main__":
    dev = cuda.get_current_device()
    print(f"# engine/norm.py on {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}")
    print(f"{'kernel':<16} {'rows':>5} {'us':>9} {'GB/s':>8}")
    for name, n, us, gbs in _bench():
        print(f"{name:<16} {n:>5} {us:>9.2f} {gbs:>8.1f}")
