"""Constrained output on the GPU: ban, in place, every token the grammar's bitmask excludes.

engine/constrain.py computes, per step, the tokens the grammar allows next as a bitmask
(int32[(V + 31) // 32], bit i % 32 of word i // 32: llguidance's layout). `apply_mask`
bans, in place, every token whose bit is clear in ws.mask; `upload_mask` copies the host's
mask for the next step there (through a pinned mirror, `mask_words`, async on the stream).
Launched before engine/gpu_sampling.py's `sample`, in the same graph: the mask is the
step's input like the token id, so one captured graph serves every step of a constrained
request. The mask buffer and its pinned mirror belong to the sampler's workspace
(gpu_sampling.SamplerWorkspace: `mask`, `host["mask"]`).

Reference: the host path, engine/sampling.py (`logits[~allowed] = -inf`, where
Constraint.allowed() unpacks the same words); tests/test_constrained.py checks the kernel
against numpy at awkward vocabulary sizes.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from . import kernel_cache
from .gpu_sampling import SamplerWorkspace, _check
from .h2d import upload


# =====================================================================================
# Kernel
# =====================================================================================
@cuda.jit
def _mask_kernel(logits, mask):
    """One thread per token: logits[i] = -inf where bit i of the mask is clear."""
    i = cuda.grid(1)
    if i < logits.shape[0]:
        if (uint32(mask[i >> 5]) >> uint32(i & 31)) & uint32(1) == uint32(0):
            logits[i] = float32(-math.inf)


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)


# =====================================================================================
# Launchers
# =====================================================================================
_SIG_MASK = "void(float32[::1], int32[::1])"
KERNEL_SIGNATURES = {"_mask_kernel": _SIG_MASK}   # tests compile it to PTX; it compiles at first launch


def mask_words(ws: SamplerWorkspace) -> np.ndarray:
    """The pinned host mirror of ws.mask: compute the next mask into it, then upload_mask.
    Rewrite it only after the previous upload finished (the caller syncs each step)."""
    return ws.host["mask"]


def upload_mask(ws: SamplerWorkspace, stream=0) -> None:
    """Copy mask_words(ws) to ws.mask, asynchronously on `stream`."""
    upload(ws.mask, ws.host["mask"], stream)


def apply_mask(ws: SamplerWorkspace, logits, stream=0) -> None:
    """logits[i] = -inf where ws.mask's bit i is clear (one launch; graph-capturable)."""
    _check("logits", logits, np.float32, length=ws.vocab)
    _check("mask", ws.mask, np.int32, length=(ws.vocab + 31) // 32)
    threads = 256
    _mask_kernel[-(-ws.vocab // threads), threads, stream](logits, ws.mask)
