"""GPU sampler, the first two kernels: logit_bias and penalties in place, then the max and
the argmax (and, for greedy requests, the token).

Part of the GPU sampler: engine/gpu_sampling.py has the story and launches these
(`sample` and `sample_greedy` both start with them); the device helpers and the slots
they read are in gpu_sampling_device.py. Their reference is the host sampler itself
(engine/sampling.py): `Sampler.apply_penalties` for the first kernel (bit-equal, the
tests check it), np.argmax for the second (lowest index wins ties; NaN counts as -inf).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, int64, uint32

from . import kernel_cache
from .device_state import S_HIST
from .gpu_sampling_device import (P_FREQUENCY, P_LASTN, P_NBIAS, P_PRESENCE, P_REPEAT, P_TEMP,
                                  W_ARGMAX, W_DONE, W_TICKET_ARGMAX, W_TOKEN, _argmax_code,
                                  _block_max, _code_index, _emit, _fma32, _last_block)


# =====================================================================================
# Kernels
# =====================================================================================
@cuda.jit
def _penalties_kernel(logits, params_f, params_i, bias_ids, bias_vals, ring, state, pen_cnt, ws_i):
    """One block. logits float32[V] (in place), bias_ids int32[max_bias],
    bias_vals float32[max_bias], ring int32[R], state int32[>=4], pen_cnt int32[V]
    (all zero between launches), ws_i int32[16].

    Matches Sampler.apply_penalties: bias first; then for each distinct token t of the
    last repeat_last_n tokens with count c: z = z / rp if z > 0 else z * rp;
    z -= c * freq + pres. Distinct tokens are found with atomics on pen_cnt: one pass
    counts, a second takes the count with atomic.exch (first taker applies, and the
    table is left zeroed)."""
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    if tid == 0:
        ws_i[W_DONE] = 0               # a new step: nothing emitted yet
    n_bias = params_i[P_NBIAS]
    for j in range(tid, n_bias, bdim):
        t = bias_ids[j]
        logits[t] = logits[t] + bias_vals[j]       # -inf bans (x + -inf = -inf)
    cuda.syncthreads()                 # biased values before the penalties read them
    rp = params_f[P_REPEAT]
    pres = params_f[P_PRESENCE]
    freq = params_f[P_FREQUENCY]
    if rp == float32(1) and pres == float32(0) and freq == float32(0):
        return
    count = state[S_HIST]
    cap = ring.shape[0]
    lastn = params_i[P_LASTN]
    w = count if lastn < 0 else min(lastn, count)
    w = min(w, cap)
    for j in range(tid, w, bdim):
        pos = uint32(count - 1 - j) % uint32(cap)
        cuda.atomic.add(pen_cnt, ring[pos], 1)
    cuda.syncthreads()
    for j in range(tid, w, bdim):
        pos = uint32(count - 1 - j) % uint32(cap)
        t = ring[pos]
        c = cuda.atomic.exch(pen_cnt, t, 0)
        if c > 0:
            z = logits[t]
            if rp != float32(1):
                z = z / rp if z > float32(0) else z * rp
            logits[t] = z - _fma32(float32(c), freq, pres)


@cuda.jit
def _argmax_kernel(logits, params_f, state, ring, out, ws_i, ws_f, part, force):
    """nb blocks, block b owns logits[b*chunk : (b+1)*chunk]. part int64[nb]: per-block
    argmax codes (_argmax_code). The last block reduces them: ws_i[W_ARGMAX] = argmax,
    ws_f[0] = its logit (the max); if force != 0, temperature <= 0 or the max is not
    finite, it emits the argmax and sets ws_i[W_DONE] (later kernels then return)."""
    sh = cuda.shared.array(33, int64)
    flag = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    nb = cuda.gridDim.x
    b = cuda.blockIdx.x
    n = logits.shape[0]
    chunk = (n + nb - 1) // nb
    lo = b * chunk
    hi = min(n, lo + chunk)
    best = int64(-9223372036854775807)
    for i in range(lo + tid, hi, bdim):
        best = max(best, _argmax_code(logits[i], i))
    best = _block_max(best, sh)
    if tid == 0:
        part[b] = best
    if not _last_block(ws_i, W_TICKET_ARGMAX, flag):
        return
    best = int64(-9223372036854775807)
    for j in range(tid, nb, bdim):
        best = max(best, part[j])
    best = _block_max(best, sh)
    if tid == 0:
        bi = _code_index(best)
        bv = logits[bi]
        ws_f[0] = bv
        ws_i[W_ARGMAX] = bi
        temp = params_f[P_TEMP]
        if force != 0 or not (temp > float32(0)) or not (abs(bv) < float32(math.inf)):
            _emit(bi, state, out, ring)
            ws_i[W_TOKEN] = bi
            ws_i[W_DONE] = 1

kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)
