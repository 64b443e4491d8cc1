"""Token sampling on the GPU for one sequence: llama.cpp's chain, graph-capturable.

Same chain and semantics as the host sampler (engine/sampling.py, the reference):

    logit_bias -> penalties (repeat / presence / frequency over the last repeat_last_n
    tokens) -> top_k -> top_p -> min_p -> temperature -> draw
    temperature <= 0: greedy argmax (lowest index wins ties, like np.argmax)

Everything a step needs lives in device memory, so one captured CUDA graph serves every
token: the logits, the request's parameters (copied once per request by `set_request`),
the recent-token ring for the penalties, the RNG step counter, and the sampled token,
which is written to state[S_TOKEN] (the next step's input) and to an output slot the host
reads to stream text.

No sort. Every filter keeps a prefix of the candidates ordered by (logit descending,
index ascending), so the kept set is "key > kappa, plus the first q tokens (by index)
whose key == kappa", where key is the logit's float bits made monotone:
  - top_k: kappa = the k-th largest key, found by a 4-round radix select (8 bits a round)
    with block-wide counting;
  - top_p: the same radix select weighted by the softmax mass exp(z - max) (as 32.32
    fixed-point integers, so sums are exact and order-independent), then the number of
    tied tokens needed to reach top_p * S;
  - min_p: exp(z - max) >= min_p (a plain threshold on the logit);
  - temperature: weights exp((z - max) / T), the draw is an inverse CDF over the kept set
    in index order (a valid sample of the same distribution; the order does not matter),
    from a counter-based RNG (splitmix64 of seed + step), so the same seed gives the same
    tokens and every graph replay draws a fresh number.
To keep that exact work small, a histogram of (max - z) in 1/8-nat bins first finds a
bin that surely contains the cut; only tokens above it (usually a few dozen) are
compacted and handed to a single block. Any size still works, only slower.

Kernels, in launch order (`sample` launches all four, `sample_greedy` the first two):
  1. _penalties_kernel  1 block    logit_bias and penalties, in place on the logits
  2. _argmax_kernel     nb blocks  max and argmax; greedy (or a non-finite max): emits
  3. _hist_kernel       nb blocks  (max - z) histogram of counts and masses -> the cut bin
  4. _select_kernel     nb blocks  compacts the tokens above the cut; the last block to
                                   finish does the exact top_k / top_p / min_p and the draw
Each multi-block kernel ends with "the last block to finish" (a threadfence, an atomic
ticket): no grid-wide barrier, safe in the simulator and in any grid size.
`advance_state` (state[0] += 1) is a separate tiny kernel so the caller orders it.

Files (one role each):
    gpu_sampling.py          this story, the workspace (buffers in an arena), the
                             launchers (`set_request`, `sample`, `sample_greedy`,
                             `advance_state`), `compile_kernels`
    gpu_sampling_device.py   slots and constants; the device helpers beside their numpy
                             references (RNG, float key, fixed-point mass, block scans)
    gpu_sampling_greedy.py   kernels 1 and 2 (reference: engine/sampling.py itself)
    gpu_sampling_select.py   the chain's numpy reference (`reference_kept`,
                             `reference_sample`, ...), kernels 3 and 4
    gpu_sampling_bench.py    `python -m genie_rt.engine.gpu_sampling`: validate, then time
    gpu_mask.py              the grammar mask (constrained output), launched before `sample`

Device state (int32, owned by the caller; the slots are defined in engine/device_state.py):
    S_POS     position of the current token      (advance_state adds 1)
    S_TOKEN   current token id                   (written by the sampler)
    S_DRAWS   sample counter: draws so far in this request; the RNG step, and the output
              slot is out[state[S_DRAWS] % len(out)]   (set to 0 by set_request)
    S_HIST    tokens pushed into the recent-token ring so far (prompt + generated); the
              sampler pushes each sampled token (set to len(history) by set_request)
Parameters (set per request by `set_request`, never per token):
    params_f float32[8]: temperature, top_p, min_p, repeat_penalty, presence_penalty,
                         frequency_penalty, -, -
    params_i int32[8]:   top_k, repeat_last_n, n_bias, seed_lo, seed_hi, -, -, -
    bias_ids int32[max_bias], bias_vals float32[max_bias]: the logit_bias pairs
    ring int32[ring_capacity]: recent tokens, token j of the history at ring[j % capacity]

Deliberately not here: batches of sequences, logprobs, mirostat / typical /
DRY samplers. The logits buffer is modified in place (bias and penalties). NaN logits
are treated as banned (the host's np.argmax would pick them). The GPU's RNG is not
numpy's: for the same seed the CPU and CUDA back-ends draw different (equally
distributed) tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from numba import cuda

from genie_rt.quant import ptx

from . import kernel_cache
from .arena import Arena, ArenaLayout
from .device_state import S_DRAWS as S_COUNTER
from .device_state import N_SLOTS, S_HIST, S_POS
from .gpu_sampling_device import (MAX_BLOCKS, NBINS, P_FREQUENCY, P_LASTN, P_MINP, P_NBIAS,
                                  P_PRESENCE, P_REPEAT, P_SEED_HI, P_SEED_LO, P_TEMP, P_TOPK,
                                  P_TOPP, SIMULATOR, WS_I_LEN, WS_L_LEN)
from .gpu_sampling_greedy import _argmax_kernel, _penalties_kernel
from .gpu_sampling_select import _hist_kernel, _select_kernel
from .h2d import event, pinned_like, upload


# =====================================================================================
# Kernel: advance_state (the sampler's four are in gpu_sampling_greedy.py and _select.py)
# =====================================================================================
@cuda.jit
def _advance_state_kernel(state):
    """state[0] += 1 (the position of the next token)."""
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        state[S_POS] += 1


kernel_cache.attach_module(globals())   # compiled kernels persist on disk (engine/kernel_cache.py)


# =====================================================================================
# Launchers
# =====================================================================================
_SIG_PENALTIES = ("void(float32[::1], float32[::1], int32[::1], int32[::1], float32[::1], "
                  "int32[::1], int32[::1], int32[::1], int32[::1])")
_SIG_ARGMAX = ("void(float32[::1], float32[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
               "float32[::1], int64[::1], int32)")
_SIG_HIST = ("void(float32[::1], float32[::1], int32[::1], int32[::1], float32[::1], int64[::1], "
             "int32[::1], int64[::1])")
_SIG_SELECT = ("void(float32[::1], float32[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
               "int32[::1], float32[::1], int64[::1], int32[::1], uint32[::1], float32[::1], "
               "int32[::1], uint32[::1], float32[::1], int32[::1], int64[::1], int8[::1])")
_SIG_ADVANCE = "void(int32[::1])"
KERNEL_SIGNATURES = {
    "_penalties_kernel": _SIG_PENALTIES,
    "_argmax_kernel": _SIG_ARGMAX,
    "_hist_kernel": _SIG_HIST,
    "_select_kernel": _SIG_SELECT,
    "_advance_state_kernel": _SIG_ADVANCE,
}
_compiled = False


def compile_kernels() -> None:
    """Compile every kernel for the current GPU now (call at load, never on a request).
    No-op under the simulator."""
    global _compiled
    if _compiled or SIMULATOR:
        return
    for name, sig in KERNEL_SIGNATURES.items():
        globals()[name].compile(sig)
    _compiled = True


@dataclass
class SamplerWorkspace:
    """Device buffers of one sequence's sampler (shapes in comments; V = vocab,
    nb = n_blocks, C = chunk). All live in an arena and never move."""
    vocab: int
    n_blocks: int
    chunk: int
    block: int
    ring_capacity: int
    max_bias: int
    params_f: object      # float32[8]  request parameters (see module docs)
    params_i: object      # int32[8]
    bias_ids: object      # int32[max_bias]
    bias_vals: object     # float32[max_bias]
    ring: object          # int32[ring_capacity] recent tokens (prompt + generated)
    pen_cnt: object       # int32[V] penalty counts, all zero between steps
    ws_i: object          # int32[16] tickets, flags, cut, diagnostics (W_* slots)
    ws_f: object          # float32[8] ws_f[0] = max logit
    ws_l: object          # int64[8] ws_l[0] = fixed-point mass of all finite logits
    part: object          # int64[nb] per-block argmax codes
    hist_c: object        # int32[NBINS] histogram counts, zero between steps
    hist_m: object        # int64[NBINS] histogram masses, zero between steps
    blk_cnt: object       # int32[nb] compacted tokens per block
    reg_k: object         # uint32[nb*C] per-block runs: keys
    reg_v: object         # float32[nb*C] values
    reg_i: object         # int32[nb*C] token ids
    den_k: object         # uint32[V] dense runs (exact stage)
    den_v: object         # float32[V]
    den_i: object         # int32[V]
    den_w: object         # int64[V] masses, then draw weights
    kept: object          # int8[V] with debug_kept (tests), else int8[1]
    mask: object = None   # int32[(V+31)//32] grammar bitmask of the step (gpu_mask.py)
    host: dict = None     # pinned host mirrors of the per-request buffers (set_request)


_BUFFERS = [  # name, dtype, length as a function of (V, nb, C, R, B)
    ("params_f", np.float32, lambda V, nb, C, R, B: 8),
    ("params_i", np.int32, lambda V, nb, C, R, B: 8),
    ("bias_ids", np.int32, lambda V, nb, C, R, B: B),
    ("bias_vals", np.float32, lambda V, nb, C, R, B: B),
    ("ring", np.int32, lambda V, nb, C, R, B: R),
    ("pen_cnt", np.int32, lambda V, nb, C, R, B: V),
    ("ws_i", np.int32, lambda V, nb, C, R, B: WS_I_LEN),
    ("ws_f", np.float32, lambda V, nb, C, R, B: 8),
    ("ws_l", np.int64, lambda V, nb, C, R, B: WS_L_LEN),
    ("part", np.int64, lambda V, nb, C, R, B: nb),
    ("hist_c", np.int32, lambda V, nb, C, R, B: NBINS),
    ("hist_m", np.int64, lambda V, nb, C, R, B: NBINS),
    ("blk_cnt", np.int32, lambda V, nb, C, R, B: nb),
    ("reg_k", np.uint32, lambda V, nb, C, R, B: nb * C),
    ("reg_v", np.float32, lambda V, nb, C, R, B: nb * C),
    ("reg_i", np.int32, lambda V, nb, C, R, B: nb * C),
    ("den_k", np.uint32, lambda V, nb, C, R, B: V),
    ("den_v", np.float32, lambda V, nb, C, R, B: V),
    ("den_i", np.int32, lambda V, nb, C, R, B: V),
    ("den_w", np.int64, lambda V, nb, C, R, B: V),
    ("mask", np.int32, lambda V, nb, C, R, B: (V + 31) // 32),
]


def _geometry(vocab: int, block: int, chunk: int) -> tuple[int, int]:
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    if block < 32 or block > 1024 or block & (block - 1):
        raise ValueError(f"block must be a power of two in 32..1024, got {block}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    nb = -(-vocab // chunk)
    if nb > MAX_BLOCKS:
        raise ValueError(f"vocab {vocab} / chunk {chunk} = {nb} blocks > {MAX_BLOCKS}: use a larger chunk")
    return nb, -(-vocab // nb)


def workspace_layout(layout: ArenaLayout, vocab: int, *, prefix: str = "sampler.",
                     ring_capacity: int = 4096, max_bias: int = 256, block: int = 256,
                     chunk: int = 1024, debug_kept: bool = False) -> None:
    """Add the sampler's buffers to an arena layout (the same arguments go to
    workspace_from_arena). ring_capacity bounds repeat_last_n; repeat_last_n = -1 (the
    whole context) is exact while the history fits: give it n_ctx."""
    nb, ch = _geometry(vocab, block, chunk)
    for name, dt, size in _BUFFERS:
        layout.add(prefix + name, (size(vocab, nb, ch, ring_capacity, max_bias),), dt)
    layout.add(prefix + "kept", (vocab if debug_kept else 1,), np.int8)


def workspace_from_arena(arena: Arena, vocab: int, *, prefix: str = "sampler.",
                         ring_capacity: int = 4096, max_bias: int = 256, block: int = 256,
                         chunk: int = 1024, debug_kept: bool = False, stream=0) -> SamplerWorkspace:
    """The workspace's views of an arena laid out by workspace_layout; zeroes the buffers
    that must start at zero (a host copy: call at load)."""
    nb, ch = _geometry(vocab, block, chunk)
    views = {name: arena[prefix + name] for name, _, _ in _BUFFERS}
    ws = SamplerWorkspace(vocab=vocab, n_blocks=nb, chunk=ch, block=block,
                          ring_capacity=ring_capacity, max_bias=max_bias,
                          kept=arena[prefix + "kept"], **views)
    for name in ("params_f", "params_i", "pen_cnt", "ws_i", "ws_f", "ws_l", "hist_c", "hist_m", "kept"):
        buf = getattr(ws, name)
        buf.copy_to_device(np.zeros(buf.shape, buf.dtype), stream=stream)
    ws.host = _host_mirrors(ws)
    return ws


def make_workspace(vocab: int, **kw) -> SamplerWorkspace:
    """A workspace in its own allocation (tests, benchmarks); see workspace_layout."""
    prefix = kw.pop("prefix", "sampler.")
    stream = kw.pop("stream", 0)
    layout = ArenaLayout()
    workspace_layout(layout, vocab, prefix=prefix, **kw)
    ws = workspace_from_arena(Arena(layout), vocab, prefix=prefix, stream=stream, **kw)
    return ws


_is_device_array = ptx.is_device_array


def _check(name, a, dtype, min_len=1, length=None):
    if not _is_device_array(a):
        raise TypeError(f"{name} must be a device array (cuda.device_array / an arena view / "
                        f"cuda.mapped_array), got {type(a).__name__}")
    if a.dtype != np.dtype(dtype) or a.ndim != 1:
        raise TypeError(f"{name} must be a 1-d {np.dtype(dtype).name} array, got {a.dtype} {a.shape}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have {length} elements, got {a.shape[0]}")
    if a.shape[0] < min_len:
        raise ValueError(f"{name} must have at least {min_len} elements, got {a.shape[0]}")
    if a.strides[0] != a.dtype.itemsize:
        raise ValueError(f"{name} must be contiguous")


def _check_step(ws: SamplerWorkspace, logits, state, out) -> None:
    _check("logits", logits, np.float32, length=ws.vocab)
    _check("state", state, np.int32, min_len=N_SLOTS)
    _check("out", out, np.int32)


def check_workspace(ws: SamplerWorkspace, params) -> None:
    """What this workspace limits beyond SamplingParams.validate: the penalty ring and the
    logit_bias slots (ValueError)."""
    penalised = (params.repeat_penalty != 1.0 or params.presence_penalty != 0.0
                 or params.frequency_penalty != 0.0)
    if penalised and params.repeat_last_n > ws.ring_capacity:
        raise ValueError(f"repeat_last_n = {params.repeat_last_n} exceeds the ring capacity "
                         f"{ws.ring_capacity} (make the workspace with a larger ring_capacity)")
    if len(params.logit_bias) > ws.max_bias:
        raise ValueError(f"{len(params.logit_bias)} logit_bias entries; this workspace holds "
                         f"at most {ws.max_bias}")


def check_request(ws: SamplerWorkspace, params, history) -> np.ndarray:
    """set_request's checks, on the host only (a caller may run them before it queues any device
    work for the request): ValueError for what the kernels cannot do. Returns the history as int64."""
    params.validate(ws.vocab)
    check_workspace(ws, params)
    if isinstance(history, np.ndarray):
        hist = history.astype(np.int64, copy=False).reshape(-1)
    elif hasattr(history, "__len__"):       # a prompt's list, without the copy list() made
        hist = np.fromiter(history, np.int64, count=len(history))
    else:
        hist = np.fromiter(history, np.int64)
    if hist.size and (hist.min() < 0 or hist.max() >= ws.vocab):
        raise ValueError(f"history holds token ids outside 0..{ws.vocab - 1}")
    return hist


def set_request(ws: SamplerWorkspace, params, history, state, stream=0) -> int:
    """Per request, before its first sample: copy the parameters, the logit_bias pairs, the
    history (prompt tokens; the ring keeps the last ring_capacity) and state[S_DRAWS] = 0,
    state[S_HIST] = len(history) to the device. Returns the 64-bit seed used (a random one when
    params.seed is None or negative). Raises ValueError for what the kernels cannot do
    (check_request)."""
    hist = check_request(ws, params, history)
    _check("state", state, np.int32, min_len=N_SLOTS)
    if params.seed is not None and params.seed >= 0:
        seed = int(params.seed) & ((1 << 64) - 1)
    else:
        seed = int.from_bytes(os.urandom(8), "little")
    pf = np.zeros(8, np.float32)
    pf[[P_TEMP, P_TOPP, P_MINP, P_REPEAT, P_PRESENCE, P_FREQUENCY]] = [
        params.temperature, params.top_p, params.min_p, params.repeat_penalty,
        params.presence_penalty, params.frequency_penalty]
    pi = np.zeros(8, np.int64)
    pi[[P_TOPK, P_LASTN, P_NBIAS]] = [params.top_k, params.repeat_last_n, len(params.logit_bias)]
    pi[P_SEED_LO], pi[P_SEED_HI] = seed & 0xFFFFFFFF, seed >> 32
    pi = (pi & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    ids = np.zeros(ws.max_bias, np.int32)
    vals = np.zeros(ws.max_bias, np.float32)
    for j, (tok, bias) in enumerate(sorted(params.logit_bias.items())):
        ids[j], vals[j] = tok, bias           # -inf stays -inf: adding it bans the token
    ring = np.zeros(ws.ring_capacity, np.int32)
    keep = hist[max(0, hist.size - ws.ring_capacity):]
    ring[np.arange(hist.size - keep.size, hist.size) % ws.ring_capacity] = keep
    # pinned mirrors (made at load) and raw async copies: no driver synchronisation per
    # copy (engine/h2d.py). A copy of the previous request may still be pending on the
    # stream: wait for it (its event) before the mirrors are rewritten - not for the whole
    # stream, so a caller may begin a request while the device runs its prefill.
    if ws.host is None:                      # a workspace not made by workspace_from_arena
        ws.host = _host_mirrors(ws)
    h = ws.host
    if h.get("copied") is not None:
        h["copied"].synchronize()
    if h.get("state") is not state:          # the state slots' view, made once per state array
        h["state"], h["state_view"] = state, state[S_COUNTER:S_HIST + 1]
    h["params_f"][:] = pf
    h["params_i"][:] = pi
    h["bias_ids"][:] = ids
    h["bias_vals"][:] = vals
    h["ring"][:] = ring
    h["counters"][:] = (0, hist.size)
    for name in ("params_f", "params_i", "bias_ids", "bias_vals", "ring"):
        upload(getattr(ws, name), h[name], stream)
    upload(h["state_view"], h["counters"], stream)
    if stream:                               # the copies' end, for the next request's wait
        h["copied"] = h.get("copied") or event()
        h["copied"].record(stream)           # (stream 0: the copies were synchronous)
    return seed


def _host_mirrors(ws: SamplerWorkspace) -> dict:
    """Pinned host mirrors of the buffers set_request uploads (allocated at load)."""
    m = {name: pinned_like(getattr(ws, name)) for name in ("params_f", "params_i", "bias_ids",
                                                          "bias_vals", "ring")}
    m["counters"] = pinned_like(ws.params_i[:2])
    if ws.mask is not None:
        m["mask"] = pinned_like(ws.mask)
    return m


def sample(ws: SamplerWorkspace, logits, state, out, stream=0) -> None:
    """The full chain on logits float32[V] (modified in place): writes the token to
    state[S_TOKEN] and out[state[S_DRAWS] % len(out)], pushes it into the ring, state[S_DRAWS] += 1,
    state[S_HIST] += 1 (the slots: engine/device_state.py). Four launches; no allocation, no
    synchronisation (graph-capturable)."""
    _check_step(ws, logits, state, out)
    nb, bs = ws.n_blocks, ws.block
    _penalties_kernel[1, bs, stream](logits, ws.params_f, ws.params_i, ws.bias_ids, ws.bias_vals,
                                     ws.ring, state, ws.pen_cnt, ws.ws_i)
    _argmax_kernel[nb, bs, stream](logits, ws.params_f, state, ws.ring, out, ws.ws_i, ws.ws_f,
                                   ws.part, np.int32(0))
    _hist_kernel[nb, bs, stream](logits, ws.params_f, ws.params_i, ws.ws_i, ws.ws_f, ws.ws_l,
                                 ws.hist_c, ws.hist_m)
    _select_kernel[nb, bs, stream](logits, ws.params_f, ws.params_i, state, ws.ring, out, ws.ws_i,
                                   ws.ws_f, ws.ws_l, ws.blk_cnt, ws.reg_k, ws.reg_v, ws.reg_i,
                                   ws.den_k, ws.den_v, ws.den_i, ws.den_w, ws.kept)


def sample_greedy(ws: SamplerWorkspace, logits, state, out, stream=0) -> None:
    """Greedy only (whatever the temperature): bias, penalties, argmax; emits like
    `sample`. Two launches: capture it as its own graph for greedy requests."""
    _check_step(ws, logits, state, out)
    _penalties_kernel[1, ws.block, stream](logits, ws.params_f, ws.params_i, ws.bias_ids,
                                           ws.bias_vals, ws.ring, state, ws.pen_cnt, ws.ws_i)
    _argmax_kernel[ws.n_blocks, ws.block, stream](logits, ws.params_f, state, ws.ring, out,
                                                  ws.ws_i, ws.ws_f, ws.part, np.int32(1))


def advance_state(state, stream=0) -> None:
    """state[0] += 1 on the device (one tiny launch)."""
    _check("state", state, np.int32, min_len=N_SLOTS)
    _advance_state_kernel[1, 32, stream](state)


if __name__ == "__main__":
    from .gpu_sampling_bench import main
    main()
