"""MMQ: the prefill GEMM  Y = X W^T  for quantized weights, on tensor cores (mma.sync).

Prefill multiplies N prompt tokens by every weight matrix of a layer. Each weight is
read once and used N times, so from N of a few hundred on the GEMM is compute-bound;
at the N = 18..33 of a home-assistant command it is still bound by reading the weights
once. One kernel family serves both: weights stay in the GGUF bits in global memory
(the planar layout of quant/layout.py), are staged raw into shared memory with cp.async,
and each warp dequantizes them straight into fp16 mma fragments in registers.

    W   PackedWeight [rows, cols], planes on the device: Q4_K, Q5_K, Q6_K, Q8_0 (K a multiple
        of 256: mmq_kquants.py), Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (of 32: mmq_legacy.py), F16,
        BF16 (of 16: mmq_float.py)
    X   float32 [N, cols] activations (the RMSNorm output)
        -> prepare_x -> x16 float16 [N, cols] in "MMQ order" + xscale float32 [N]
    Y   float32 [N, rows]:  mode "store"   Y  = X W^T
                            mode "add"     Y += X W^T        (residual stream)
                            mode "swiglu"  Y  = silu(X G^T) * (X U^T), W = [G; U] stacked
                                           by rows (2 I rows -> Y [N, I])
                            mode "geglu"   Y  = gelu(X G^T) * (X U^T), gelu's tanh form
                                           (Gemma), same stacking

Public API. This file, the launchers (no allocation, no synchronisation, any numba stream):
    prepare_x(x, x16, xscale, stream=0, norm_weight=None, eps=1e-6)   (+ fused RMSNorm)
    mmq(w, x16, xscale, y, mode="store", workspace=None, stream=0, config=None, splits=None)
    compile_for(weights, n_values, modes) -> None                eager compile at load
mmq_plan.py, the plans (plain Python):
    workspace_bytes(w, n, mode="store", config=None) -> int
    plan(qtype, rows_out, cols, n, mode, config=None, splits=None) -> Plan   what mmq launches
    SUPPORTED (the GGUF types), TileConfig, small_config, LARGE, device_limits
mmq_reference.py, the host side (numpy): reference(w, x, mode, y0, rows) (float64),
error_bound(...) (the guaranteed bound the tests use), prepare_x_reference(x, norm_weight,
eps), random_weight(qtype, rows, cols, rng) (valid random blocks), stack_rows(gate, up).
The kernels: mmq_kernels.py (the GEMM factory; read its docstring for the pipeline),
mmq_defs.py (codes and shared-memory geometry), mmq_kquants.py / mmq_legacy.py /
mmq_float.py (each format's device functions), mmq_prep.py (prepare_x), mmq_reduce.py
(the split-K reduction).

Why fp16 mma and not int8 (llama.cpp's MMQ quantizes X to q8_1 and uses s8 mma): the
k-quant scales change every 16 or 32 weights, so the int8 path converts and rescales
its int32 partial sums after every k32 step (4 cvt + 8 FMA per mma per lane), and Q4_K's
mins need a second sum. With fp16, scales and mins are folded into the weights once
(2 fp16x2 FMAs per pair of weights, per warp) and the accumulators never leave the
tensor cores. tools/mmq_variants/ has the int8 variant to measure against.

What this module does not do: attention, F32 or the other GGUF types (the launcher
refuses them with a message), decode (N = 1 is the GEMV's job, although MMQ
accepts it), or picking fused QKV layouts for the engine.

Numbers: docs/kernels/mmq.md (the lesson and the measured table); the benchmark
(mmq_bench.py) is `python -m genie_rt.quant.mmq`.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .formats import QType
from .layout import PackedWeight
from . import mmq_defs as D
from . import mmq_float as F
from . import mmq_kernels as K
from . import mmq_kquants as Q
from . import mmq_legacy as L
from . import mmq_plan as MP
from . import mmq_prep as P
from . import mmq_reduce as R
from .pdl import launch_or_plain, wanted
from .ptx import SIMULATOR

_KERNELS = {}


def _kernel(fmt, cfg: MP.TileConfig, epi, red=D.RED_LAST, pdl: bool = False):
    key = (fmt, cfg, epi, red, bool(pdl))
    if key not in _KERNELS:
        _KERNELS[key] = K.build_mmq_kernel(fmt, cfg.wm, cfg.wn, cfg.mt, cfg.nt, cfg.stages, epi, red,
                                           pdl=bool(pdl))
    return _KERNELS[key]


def _reduce_kernel(epi, pdl: bool = False):
    key = ("reduce", epi, bool(pdl))
    if key not in _KERNELS:
        _KERNELS[key] = R.build_reduce_kernel(epi, bool(pdl))
    return _KERNELS[key]


REDUCE_SIGNATURE = "void(float32[::1], float32[::1], float32[:, ::1], int64, int64, int64)"


_PLANE_TYPES = {   # fmt -> kernel plane slots p0..p3: (plane name, numba dtype)
    Q.Q4_K: (("qs", "uint8"), ("hdr", "uint8"), ("qs", "uint8"), ("qs", "uint8")),
    Q.Q6_K: (("ql", "uint8"), ("qh", "uint8"), ("sc", "int8"), ("d", "float16")),
    Q.Q8_0: (("qs", "int8"), ("d", "float16"), ("qs", "int8"), ("qs", "int8")),
    # the 32-weight formats: d as its fp16 bits, qh (uint8 in the layout) as a uint32 a block
    L.Q4_0: (("qs", "uint8"), ("d", "uint16"), ("qs", "uint8"), ("qs", "uint8")),
    L.Q4_1: (("qs", "uint8"), ("dm", "uint32"), ("qs", "uint8"), ("qs", "uint8")),
    L.Q5_0: (("qs", "uint8"), ("d", "uint16"), ("qh", "uint32"), ("qs", "uint8")),
    L.Q5_1: (("qs", "uint8"), ("dm", "uint32"), ("qh", "uint32"), ("qs", "uint8")),
    L.Q8_0L: (("qs", "int8"), ("d", "uint16"), ("qs", "int8"), ("qs", "int8")),
    Q.Q5_K: (("qs", "uint8"), ("hdr", "uint8"), ("qh", "uint8"), ("qs", "uint8")),
    # F16 / BF16: the weights as bytes (mmq_float.py stages them with the byte-row loader)
    F.F16: (("w", "uint8"),) * 4,
    F.BF16: (("w", "uint8"),) * 4,
}
# plane name -> (dtypes it is stored as, the dtype it is passed as when the kernel's differs)
_PLANE_DTYPES = {"d": ((np.float16,), np.uint16), "qh": ((np.uint8,), np.uint32),
                 "w": ((np.float16, np.uint16), np.uint8)}
_REST_SIG = ("float16[:, ::1], float32[::1], float32[:, ::1], float32[::1], int32[::1], "
             "int64, int64, int64, int64, int64")


def kernel_signature(fmt) -> str:
    planes = ", ".join(f"{dt}[:, ::1]" for _, dt in _PLANE_TYPES[fmt])
    return f"void({planes}, {_REST_SIG})"


PREPARE_X_SIGNATURE = "void(float32[:, ::1], float32[::1], uint32[:, ::1], float32[::1], int64, float32, int64)"
_READY = set()


def _ensure_compiled(kern, fmt):
    """Compile for the one signature the launcher uses and allow > 48 KB of dynamic
    shared memory (cuFuncSetAttribute; numba has no option for it)."""
    if SIMULATOR:
        return
    from numba import cuda
    dev = cuda.get_current_device().id
    key = (id(kern), dev)
    if key in _READY:
        return
    compiled = kern.compile(kernel_signature(fmt))
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver
    cufunc = compiled._codelibrary.get_cufunc()
    _, limit = MP.device_limits()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(limit), cufunc.handle, dev)
    _READY.add(key)


def _check(cond, msg):
    if not cond:
        raise ValueError("mmq: " + msg)


def _c_contig(a):
    if hasattr(a, "is_c_contiguous"):                  # numba device arrays (and simulated)
        return bool(a.is_c_contiguous())
    return bool(a.flags.c_contiguous)


def compile_for(weights, n_values=(18, 33, 128, 512), modes=("store",), pdl: bool = False) -> None:
    """Compile at load, before the first request, every kernel mmq will launch for these
    weights (PackedWeights: their exact plans; QTypes: every candidate config), token
    counts and modes; also prepare_x. pdl: the programmatic-dependent-launch builds (the
    launches' pdl=True; sm_90+) instead. A kernel takes a few seconds to compile; anything
    not compiled here compiles on first use. No-op under the simulator."""
    if SIMULATOR:
        return
    pdl = wanted(pdl)               # (the PDL builds carry sm_90 instructions)
    keys = set()
    for item in weights:
        for n in n_values:
            for mode in modes:
                if isinstance(item, PackedWeight):
                    qtype = item.qtype
                    if mode in MP.GATED and item.rows % 2:
                        continue
                    p = MP.plan(qtype, MP._rows_out(item, mode), item.cols, n, mode)
                    cfgs = [(p.config, p.red)]
                    fmt = p.fmt
                else:
                    qtype = QType(item)
                    fmt = MP.SUPPORTED[qtype]
                    red = MP.REDUCTIONS[MP.DEFAULT_REDUCE]
                    cfgs = [(MP.small_config(n), red)] if n <= 64 else \
                        [(MP.LARGE, red), (replace(MP.LARGE, stages=2), red)]
                for cfg, red in cfgs:
                    keys.add((fmt, cfg, MP.MODES[mode], red))
    for fmt, cfg, epi, red in sorted(keys, key=str):
        _ensure_compiled(_kernel(fmt, cfg, epi, red, pdl), fmt)
        if red == D.RED_KERNEL:                   # (compiled even if no plan splits K)
            _reduce_kernel(epi, pdl).compile(REDUCE_SIGNATURE)
    P.prepare_x_kernel.compile(PREPARE_X_SIGNATURE)
    for cols in {item.cols for item in weights if isinstance(item, PackedWeight)}:
        P.prepare_x_kernel_for(cols, pdl).compile(PREPARE_X_SIGNATURE)   # the register-resident variants


def prepare_x(x, x16, xscale, stream=0, norm_weight=None, eps: float = 1e-6, pdl: bool = False) -> None:
    """x float32 [N, cols] -> x16 float16 [N, cols] (MMQ order), xscale float32 [N].

    With norm_weight (float32 [cols]) the RMSNorm is fused in: the values converted are
    x / sqrt(mean(x^2) + eps) * norm_weight (engine/models/reference.py's rmsnorm), so the residual
    stream feeds MMQ in one kernel. xscale[t] is 1 unless max|v[t]| > 16384, then the
    power of two that brings the row below it (fp16 overflows at 65504; mmq multiplies
    it back in its epilogue). pdl: the programmatic-dependent-launch build and launch (sm_90+;
    ignored elsewhere): it starts while the kernel before it finishes and waits for it on the
    device, and lets the next kernel (an mmq launched with pdl=True) launch at once."""
    _check(len(x.shape) == 2 and x.dtype == np.float32 and _c_contig(x),
           f"x must be a C-contiguous float32 [N, cols], got {x.dtype}{tuple(x.shape)}")
    n, cols = x.shape
    _check(cols % 16 == 0, f"cols = {cols} must be a multiple of 16")
    _check(tuple(x16.shape) == (n, cols) and x16.dtype == np.float16 and _c_contig(x16),
           f"x16 must be a C-contiguous float16 [{n}, {cols}], got {x16.dtype}{tuple(x16.shape)}")
    _check(tuple(xscale.shape) == (n,) and xscale.dtype == np.float32,
           f"xscale must be float32 [{n}], got {xscale.dtype}{tuple(xscale.shape)}")
    if norm_weight is not None:
        _check(tuple(norm_weight.shape) == (cols,) and norm_weight.dtype == np.float32,
               f"norm_weight must be float32 [{cols}], got {norm_weight.dtype}{tuple(norm_weight.shape)}")
        w, has_norm = norm_weight, 1
    else:
        w, has_norm = xscale, 0                          # never read
    pdl = wanted(pdl)
    kern = P.prepare_x_kernel_for(cols, pdl)         # (wide rows: the plain prepare_x_kernel)
    launch_or_plain(kern, n, P.PREP_THREADS, stream, PREPARE_X_SIGNATURE, pdl and kern is not P.prepare_x_kernel,
                    x, w, x16.view(np.uint32), xscale, cols, np.float32(eps), has_norm)


def mmq(w: PackedWeight, x16, xscale, y, mode: str = "store", workspace=None, stream=0,
        config: MP.TileConfig = None, splits: int = None, reduce: str = None, pdl: bool = False) -> None:
    """Y = X W^T on the tensor cores (see the module docstring for the modes).

    w          PackedWeight, planes are device arrays ([rows, bytes], C-contiguous rows)
    x16        float16 [N, cols] from prepare_x; xscale float32 [N] from prepare_x
    y          float32 [N, rows] ("store", "add": read and written), [N, rows/2] ("swiglu",
               "geglu")
    workspace  uint8 device array >= workspace_bytes(w, N, mode) bytes (zeroed once after
               allocation; may be shared by every launch on this stream, whatever its
               plan - see mmq_plan.COUNTER_BYTES), or None when that is 0
    stream     numba stream (or 0); config/splits/reduce override the automatic plan
               (benchmarks)
    With a split K and reduce "kernel" this is two launches: the GEMM, then the reduction.
    pdl        the GEMM's programmatic-dependent-launch build, launched with programmatic stream
               serialization (quant/pdl.py; sm_90+, ignored on other devices; the simulator runs
               the build plainly): it copies its first weights while the kernel before it
               (prepare_x's pdl build, or anything) finishes; the split-K reduction's build
               (RED_KERNEL) is launched the same way and waits for the GEMM on the device.
    """
    _check(w.qtype in MP.SUPPORTED, f"{QType(w.qtype).name} weights are not supported "
           f"(supported: {', '.join(sorted(q.name for q in MP.SUPPORTED))})")
    _check(len(x16.shape) == 2 and x16.dtype == np.float16 and _c_contig(x16),
           f"x16 must be a C-contiguous float16 [N, cols] from prepare_x, got "
           f"{x16.dtype}{tuple(x16.shape)}")
    n, cols = x16.shape
    _check(cols == w.cols, f"x16 has {cols} columns, the weight {w.cols}")
    _check(tuple(xscale.shape) == (n,) and xscale.dtype == np.float32,
           f"xscale must be float32 [{n}], got {xscale.dtype}{tuple(xscale.shape)}")
    rows_out = MP._rows_out(w, mode)
    _check(tuple(y.shape) == (n, rows_out) and y.dtype == np.float32 and _c_contig(y),
           f"y must be a C-contiguous float32 [{n}, {rows_out}] for mode {mode!r}, got "
           f"{y.dtype}{tuple(y.shape)}")
    p = MP.plan(w.qtype, rows_out, cols, n, mode, config, splits, reduce=reduce)
    fmt = p.fmt
    slots = []
    for name, dt in _PLANE_TYPES[fmt]:
        plane = w.planes.get(name)
        _check(plane is not None, f"{QType(w.qtype).name} weight lacks plane {name!r}")
        stored, passed = _PLANE_DTYPES.get(name, ((), None))
        if passed == np.dtype(dt) and plane.dtype in stored:
            plane = plane.view(passed)                  # a reinterpretation (no copy)
        _check(len(plane.shape) == 2 and plane.shape[0] == w.rows and plane.dtype == np.dtype(dt)
               and _c_contig(plane), f"plane {name!r} must be a C-contiguous {dt} [{w.rows}, *], "
               f"got {plane.dtype}{tuple(plane.shape)}")
        slots.append(plane)
    if p.splits > 1:
        _check(workspace is not None and workspace.dtype == np.uint8 and len(workspace.shape) == 1
               and workspace.shape[0] >= p.workspace,
               f"this shape splits K {p.splits} ways and needs a uint8 workspace of "
               f"{p.workspace} bytes (workspace_bytes(w, {n}, {mode!r}))")
        ws = workspace[MP.COUNTER_BYTES:p.workspace].view(np.float32)
        cnt = workspace[:4 * max(p.counters, 4)].view(np.int32)   # RED_KERNEL: never touched
    else:
        flat = y.reshape(y.shape[0] * y.shape[1])        # never touched with one split
        ws, cnt = flat, flat.view(np.int32)
    pdl = wanted(pdl)
    kern = _kernel(fmt, p.config, p.epi, p.red, pdl)   # (one split: either reduction, same path)
    _ensure_compiled(kern, fmt)
    launch_or_plain(kern, p.grid, p.config.threads, stream, kernel_signature(fmt), pdl,
                    slots[0], slots[1], slots[2], slots[3], x16, xscale, y, ws, cnt,
                    n, rows_out, p.n_stages, p.stages_per_split, p.splits, shmem=p.smem)
    if p.red == D.RED_KERNEL and p.splits > 1:
        grid = (-(-rows_out // R.REDUCE_THREADS), n)
        launch_or_plain(_reduce_kernel(p.epi, pdl), grid, R.REDUCE_THREADS, stream, REDUCE_SIGNATURE, pdl,
                        ws, xscale, y, n, rows_out, p.splits)


if __name__ == "__main__":
    from .mmq_bench import main
    main()
