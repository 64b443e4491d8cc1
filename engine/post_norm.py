"""Gemma 3's post-norms on the GPU: x += rmsnorm(y) * w_post, then the next pre-norm.

The math (llama.cpp src/models/gemma3.cpp): after attention and after the FFN the block
output y is normed *before* the residual add, and the sum is normed again as the next
block's input:

    x = x + rmsnorm(y) * w_post            (attn_post_norm, or ffn_post_norm)
    h = rmsnorm(x) * w_next                (ffn_norm, or the next layer's attn_norm /
                                            output_norm), float32 / float16, or the q8
                                            activations (xq, xs) of h for the dp4a GEMVs

    rmsnorm(x) = x / sqrt(mean(x^2) + eps)          rows of x, y: [n, d]

Kernels (one block per row, engine/norm.py's layout: thread t owns elements t, t + B, ..;
sums by warp shuffles then shared memory):
    post_norm_add      x += rmsnorm(y) * w_post                     (prefill: then MMQ's
                       prepare_x does the next norm)
                       + out = rmsnorm(x) * w_next with w_next / out given
    post_norm_add_q8   x += rmsnorm(y) * w_post; xq, xs = q8 of rmsnorm(x) * w_next
                       (+ out = h): decode, where the next GEMVs read q8

Exactness: bit-identical to the unfused launches at the same block size -
rmsnorm(y, w_post, t); add_rmsnorm(x, t, w_next, out)   for post_norm_add, and
rmsnorm(y, w_post, t); x += t; rmsnorm_q8(x, w_next, ..) for post_norm_add_q8.
Each thread adds its squares in the same order, `y / s * w_post` is rounded to float32
before the add (`mul.rn.f32`: an FMA would round once, as the stored t is not), and
h = x / s * w_next, q8 are engine/norm.py's own device code. Decode rows (n = 1) of at
most RESIDENT_MAX values per thread keep y and x in registers (all loads issued first),
bit-identical to the loop form.

Traffic per row of d floats: reads y, x (8d bytes), writes x (4d), plus the outputs
(4d / 2d for out, 1.5d for xq + xs). Launch-bound in decode, bandwidth in prefill.

Deliberately not here: the plain norms, SwiGLU / GeGLU (engine/norm.py), soft-capping,
Gemma's embedding scale.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from genie_rt.quant.ptx import SIMULATOR

from . import kernel_cache

from .norm import (Q8_BLOCK, Q8_FLOATS, RESIDENT_MAX, _OUT, _block_sum, _check2d, _check_weight,
                   _q8_store, norm_block, post_norm_add_reference)

__all__ = ["post_norm_add", "post_norm_add_q8", "post_norm_add_reference",
           "post_norm_add_q8_reference", "compile_kernels"]


def post_norm_add_q8_reference(x, y, w_post, w_next, eps):
    """(x_new, h, xq, xs): post_norm_add_reference's x and h, and quant/gemv.py's
    quantize_q8_reference of h."""
    from genie_rt.quant.gemv import quantize_q8_reference
    x_new, h = post_norm_add_reference(x, y, w_post, eps, w_next)
    xq, xs = quantize_q8_reference(h.reshape(-1, h.shape[-1]))
    return x_new, h, xq, xs


# =====================================================================================
# kernels
# =====================================================================================
if SIMULATOR:
    def _mul_rn(a, b):
        # the simulator's y / s is a Python float, as in its rmsnorm kernel: round the
        # product once to float32, as that kernel's store does
        return np.float32(a * b)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _mul_rn(a, b):
        return libdevice.fmul_rn(a, b)          # mul.rn.f32: never contracted into the add


@cuda.jit(device=True)
def _post_add_rows(x, y, w_post, eps, sh, r):
    """x[r] += rmsnorm(y[r]) * w_post (loop form); returns this thread's sum of the new
    x[r]'s squares (not yet reduced). Passes: sum y^2 (rmsnorm's order), then the add."""
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    d = x.shape[1]
    ss = float32(0)
    for i in range(tid, d, bdim):
        v = y[r, i]
        ss += v * v
    ss = _block_sum(ss, sh)
    s = math.sqrt(ss / float32(d) + eps)
    ss2 = float32(0)
    for i in range(tid, d, bdim):
        v = x[r, i] + _mul_rn(y[r, i] / s, w_post[i])     # add_rmsnorm's x + delta
        x[r, i] = v                   # each element is owned by one thread: re-read below
        ss2 += v * v
    return ss2


@cuda.jit
def _post_norm_add_kernel(x, y, w_post, eps):
    """Block r: x[r] += rmsnorm(y[r]) * w_post. x, y float32[n, d], w_post float32[d]."""
    sh = cuda.shared.array(32, float32)
    _post_add_rows(x, y, w_post, eps, sh, cuda.blockIdx.x)


@cuda.jit
def _post_norm_add_norm_kernel(x, y, w_post, w_next, out, eps):
    """Block r: x[r] += rmsnorm(y[r]) * w_post; out[r] = rmsnorm(x[r]) * w_next
    (out float32 or float16)."""
    sh = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    ss = _block_sum(_post_add_rows(x, y, w_post, eps, sh, r), sh)
    d = x.shape[1]
    s = math.sqrt(ss / float32(d) + eps)
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        out[r, i] = x[r, i] / s * w_next[i]


@functools.lru_cache(maxsize=None)
def _post_norm_add_q8_kernel(write_h: bool, J: int):
    """x += rmsnorm(y) * w_post, then q8 of h = rmsnorm(x) * w_next as rmsnorm_q8 does
    (out = h too if write_h). J = 0: loop form; J >= 1: J values per thread in registers
    (J = ceil(d / block)). Block a multiple of 32, d % 32 == 0 (warps hold whole q8
    blocks, every lane of a warp runs the same iterations)."""
    if J == 0:
        @cuda.jit
        def loop_kernel(x, y, w_post, w_next, out, xq, xs, eps):
            # x, y f32 [n, d]; w_post, w_next f32 [d]; out f32 [n, d] (h; x stands in when
            # not write_h); xq int8 [n, d]; xs f32 [n, d // 8]; eps f32
            sh = cuda.shared.array(32, float32)
            r = cuda.blockIdx.x
            ss = _block_sum(_post_add_rows(x, y, w_post, eps, sh, r), sh)
            d = x.shape[1]
            s = math.sqrt(ss / float32(d) + eps)
            for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
                v = float32(x[r, i] / s * w_next[i])      # rmsnorm_q8's value, op for op
                if write_h:
                    out[r, i] = v
                _q8_store(v, xq, xs, r, i)
        return kernel_cache.attach(loop_kernel)

    @cuda.jit
    def kernel(x, y, w_post, w_next, out, xq, xs, eps):
        # the loop kernel's arguments; thread t holds y and x of t, t + B, .. (J values)
        sh = cuda.shared.array(32, float32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        bdim = cuda.blockDim.x
        d = x.shape[1]
        yv = cuda.local.array(J, float32)
        xv = cuda.local.array(J, float32)
        for j in range(J):                        # every load first: one memory wait
            i = tid + j * bdim
            yv[j] = y[r, i] if i < d else float32(0)
            xv[j] = x[r, i] if i < d else float32(0)
        ss = float32(0)
        for j in range(J):
            if tid + j * bdim < d:
                ss += yv[j] * yv[j]
        ss = _block_sum(ss, sh)
        s = math.sqrt(ss / float32(d) + eps)
        ss2 = float32(0)
        for j in range(J):
            i = tid + j * bdim
            if i < d:
                v = xv[j] + _mul_rn(yv[j] / s, w_post[i])
                xv[j] = v
                x[r, i] = v
                ss2 += v * v
        ss2 = _block_sum(ss2, sh)
        s2 = math.sqrt(ss2 / float32(d) + eps)
        for j in range(J):
            i = tid + j * bdim
            if i < d:                             # warp-uniform: d and bdim multiples of 32
                v = float32(xv[j] / s2 * w_next[i])
                if write_h:
                    out[r, i] = v
                _q8_store(v, xq, xs, r, i)
    return kernel_cache.attach(kernel)


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)


def _q8_kernel_for(write_h: bool, d: int, block: int):
    j = -(-d // block)
    return _post_norm_add_q8_kernel(write_h, 0 if j > RESIDENT_MAX else j)


# =====================================================================================
# launchers
# =====================================================================================
_SIG_ADD = "void(float32[:, ::1], float32[:, ::1], float32[::1], float32)"
_SIG_NORM = ("void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], {}[:, ::1], "
             "float32)")
_SIG_Q8 = ("void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[:, ::1], "
           "int8[:, ::1], float32[:, ::1], float32)")


def compile_kernels(d: int | None = None, block: int | None = None) -> None:
    """Compile the kernels now (at load); with d, the q8 variants that row width uses
    (at `block`, default norm_block(d)). No-op in the simulator."""
    if SIMULATOR:
        return
    _post_norm_add_kernel.compile(_SIG_ADD)
    for out in ("float32", "float16"):
        _post_norm_add_norm_kernel.compile(_SIG_NORM.format(out))
    if d is not None:
        for write_h in (False, True):
            _q8_kernel_for(write_h, d, block or norm_block(d)).compile(_SIG_Q8)


def _check_xy(x, y):
    _check2d("x", x, (np.float32,))
    _check2d("y", y, (np.float32,), x.shape)
    return x.shape


def post_norm_add(x, y, w_post, eps: float, stream=0, w_next=None, out=None,
                  block: int | None = None) -> None:
    """x += rmsnorm(y) * w_post (in place); with w_next and out also
    out = rmsnorm(x) * w_next (out float32 or float16).

    x, y float32 [n, d] device, C-contiguous; w_post, w_next float32 [d]. Bit-identical
    to rmsnorm(y, w_post) then add_rmsnorm(x, ., w_next, out) at the same block."""
    n, d = _check_xy(x, y)
    _check_weight(w_post, d)
    if (w_next is None) != (out is None):
        raise ValueError("post_norm_add: pass w_next and out together (or neither)")
    if out is not None:
        _check_weight(w_next, d)
        _check2d("out", out, _OUT, (n, d))
    if n == 0:
        return
    bdim = block or norm_block(d)
    if out is None:
        _post_norm_add_kernel[n, bdim, stream](x, y, w_post, np.float32(eps))
    else:
        _post_norm_add_norm_kernel[n, bdim, stream](x, y, w_post, w_next, out, np.float32(eps))


def post_norm_add_q8(x, y, w_post, w_next, xq, xs, eps: float, stream=0, out=None,
                     block: int | None = None) -> None:
    """x += rmsnorm(y) * w_post (in place), then the q8 activations of
    h = rmsnorm(x) * w_next: xq int8 [n, d], xs float32 [n, d // 8] (quant/gemv.py's
    layout); out float32 [n, d] gets h too when given. d % 32 == 0; block a multiple of
    32 (default norm_block(d)). Bit-identical to rmsnorm + add + rmsnorm_q8."""
    n, d = _check_xy(x, y)
    if d % Q8_BLOCK:
        raise ValueError(f"post_norm_add_q8: d = {d} is not a multiple of {Q8_BLOCK}")
    _check_weight(w_post, d)
    _check_weight(w_next, d)
    _check2d("xq", xq, (np.int8,), (n, d))
    _check2d("xs", xs, (np.float32,), (n, d // Q8_BLOCK * Q8_FLOATS))
    if out is not None:
        _check2d("out", out, (np.float32,), (n, d))
    bdim = block or norm_block(d)
    if bdim % 32 or not 32 <= bdim <= 1024:
        raise ValueError(f"post_norm_add_q8: block = {bdim} must be a multiple of 32 in 32..1024")
    if n == 0:
        return
    kern = _q8_kernel_for(out is not None, d, bdim)
    kern[n, bdim, stream](x, y, w_post, w_next, x if out is None else out, xq, xs,
                          np.float32(eps))
