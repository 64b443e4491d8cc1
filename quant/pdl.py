"""Programmatic dependent launch (PDL, sm_90+): a kernel that starts before the one before it
has finished.

In a CUDA graph of dependent kernels every boundary costs the next kernel's launch and the
ramp-up of its first memory reads after the previous kernel's last block is done. With PDL
the next kernel is launched with the *programmatic stream serialization* attribute: it may
start as soon as every block of the previous one has executed `griddepcontrol.launch_
dependents` (our PDL kernels do that first thing), and it runs until its own
`griddepcontrol.wait`, which returns once the previous grid has completed and its writes are
visible. A decode GEMV issues its weight loads (which depend on nothing) before that wait,
so they overlap the previous kernel's tail. Stream capture turns the attribute into a
programmatic edge of the graph.

Rules for a PDL build (the factories' `PDL=True` / `pdl=True`):
1. `griddepcontrol.launch_dependents` first: the next kernel may launch at once. (The one exception:
   the short prefill's mma GEMVs trigger after their last trip, TRIGGER_LATE below.)
2. Before `griddepcontrol.wait` it reads only constants (weights, norm weights) and writes
   nothing: a PDL launch may start while the kernel before it still runs. "Constant" means
   what no kernel of the running step writes: the decode attention's "warp" loop also reads
   the position (state[S_POS], written by advance_state, the last node of the step before)
   and the first trip's K/V rows of earlier positions (written by earlier steps or the
   prefill) before its wait - never the new position's row or q, which rope_write, the
   kernel before, writes (kvcache/attention_decode_tiles.py) - or, in the build that ropes its
   own token (the default: kvcache/attention_decode_rope.py), the attention block itself writes
   from the QKV GEMV's row after its wait. On a ring layer the slot the new row overwrites held
   position pos - R, outside the window (W <= R), never read.
   What it loads there must be loaded by an ordinary load (`ptx.ldw_v4` / `ldw_v2` for weights),
   not the read-only `ld.global.nc` (`ptx.ldg_v4`): ptxas (12.9, 13.0) schedules a read-only
   load next to its use, below the wait - the PTX has it before, the SASS after (LDG ... CONSTANT
   after ACQBULK). Every GEMV build had its early weight loads sunk that way until 2026-12-06;
   tests/test_pdl_sass.py checks each build's SASS.
3. What another kernel wrote is read after the wait by ordinary (coherent) loads, never by
   `ld.global.nc` (`ptx.ldg_v4`): a non-coherent load promises data that does not change
   while the kernel runs, and ptxas may then schedule it above the wait. That was the wrong
   logits of 2026-12-03 (the GEMVs read their q8 activations through ldg_v4; the failure came
   and went with the timing) and of the first whole-chain run on 2026-12-04; with `ptx.ld_v4`
   for activations every kind of kernel, alone and together, gives the plain graph's bits
   (tools/profile_decode.py, tests/test_decode_switches.py, H200 2026-12-04). tests/test_pdl_ptx.py
   checks 1-3 on each build's PTX.
PDL builds contain sm_90 instructions and are made only for devices of compute capability 9.0
or more (`available()`); the Jetson (sm_87) and other sm_80+ GPUs keep the plain kernels.
The engine launches every kernel of a decode layer this way by default there
(EngineConfig.decode_pdl, engine/cuda_ops.py PDL_KINDS; `--no-pdl` turns it off).

`hooks(PDL)` gives a kernel factory its three device functions - the wait, the trigger and
the load of what another kernel wrote - so every PDL build follows the rules the same way.

`launch` does what numba's own `kernel[grid, block, stream](*args)` does for a kernel with
one compiled signature (numba-cuda 0.30: the dispatcher's overload, its argument
marshalling, cuda.core's `launch`) with one more field in the launch configuration.
"""
from __future__ import annotations

import functools

from numba import cuda

from . import ptx


@cuda.jit(device=True, inline=True)
def _no_op():
    pass


def hooks(PDL: bool):
    """(wait, launch_dependents, ld_v4) for a kernel factory: on a PDL build (sm_90+)
    griddepcontrol.wait / .launch_dependents and the coherent 16-byte load (rule 3) for data
    another kernel wrote; otherwise no-ops that inline to nothing and the read-only ldg_v4 -
    so the sm_80/87 kernels are the same code as before PDL existed."""
    if PDL:
        return ptx.griddep_wait, ptx.griddep_launch_dependents, ptx.ld_v4
    return _no_op, _no_op, ptx.ldg_v4


def weight_loads(PDL: bool):
    """(8-byte, 16-byte) weight loads for a kernel factory (rule 2): on a PDL build ptx.ldw_v2 /
    ldw_v4, which stay above griddepcontrol.wait; otherwise the read-only ldg_v2 / ldg_v4, which
    the compilers may schedule freely (and ptxas sinks below a wait)."""
    return (ptx.ldw_v2, ptx.ldw_v4) if PDL else (ptx.ldg_v2, ptx.ldg_v4)


# The short prefill's mma GEMVs (gemv_mma_k's Q4_K and Q6_K builds, gemv_mma_glu, gemv_mma_qkv): their
# PDL builds trigger after their last trip instead of first thing (rule 1's one exception), so the next
# kernel launches near their end. On an H200 (2026-12-06) that took the 4B's short graph from 2.35 ms
# (trigger first: slower than no PDL at all, 2.33) to 2.16, the same bits (docs/kernels/gemv.md 8m). These
# grids hold several blocks an SM, and a tile's time is its SM's: a dependent launched at once parks its
# blocks at their wait on whichever SMs have room while the grid before still runs - the likely cost,
# not profiled. The decode step's GEMVs (quant/gemv_kernels.py) keep the trigger first: the same change
# there made the step 2-3 % slower (H100, 2026-12-06). A lab knob (False: trigger first, to time against);
# `build(pdl)` gives the factories' PDL argument.
TRIGGER_LATE = True


def build(pdl: bool) -> int:
    """The PDL argument of a kernel factory that has the late trigger: 0 plain, 1 a PDL build that
    triggers first, 2 one that triggers after its last trip (TRIGGER_LATE)."""
    return (2 if TRIGGER_LATE else 1) if pdl else 0


def triggers(PDL: int):
    """(first, late): griddepcontrol.launch_dependents at the kernel's start or after its last
    trip, as build() chose; the other one (both on a plain build) inlines to nothing."""
    trigger = hooks(bool(PDL))[1]
    return (_no_op, trigger) if PDL == 2 else (trigger, _no_op)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """A real device of compute capability >= 9.0 and a cuda.core that knows the attribute."""
    if ptx.SIMULATOR:
        return False
    try:
        from cuda.core import LaunchConfig
        LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
        from numba import cuda
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:               # noqa: BLE001 - no GPU, an old cuda.core: not available
        return False


def _dim3(d) -> tuple:
    d = (d,) if isinstance(d, int) else tuple(d)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


def launch(dispatcher, grid, block, stream, *args, programmatic: bool = True, shmem: int = 0) -> None:
    """dispatcher[grid, block, stream, shmem](*args), launched with programmatic stream
    serialization. The dispatcher must have exactly one compiled signature (the engine
    compiles every kernel eagerly at load) and be a PDL build; shmem: bytes of dynamic
    shared memory (above 48 KB the kernel's attribute must allow it: quant/mmq.py
    `_ensure_compiled`)."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv import driver

    overloads = list(dispatcher.overloads.values())
    if len(overloads) != 1:
        raise RuntimeError(f"pdl.launch: {getattr(dispatcher, '__name__', dispatcher)} has "
                           f"{len(overloads)} compiled signatures; compile exactly one first")
    kernel = overloads[0]
    cufunc = kernel._codelibrary.get_cufunc()
    retr, kernelargs = [], []
    for t, v in zip(kernel.argument_types, args):
        kernel._prepare_args(t, v, stream, retr, kernelargs)
    config = LaunchConfig(grid=_dim3(grid), block=_dim3(block), shmem_size=int(shmem),
                          programmatic_stream_serialization=programmatic)
    core_launch(driver._to_core_stream(stream), config, cufunc.kernel, *kernelargs)
    for wb in retr:                 # numba's write-backs (none for device arrays)
        wb()


def wanted(asked) -> bool:
    """Whether a launcher asked for a PDL build (`pdl=True`) takes one: where the device has
    programmatic dependent launch, or under the simulator (which runs the builds plainly,
    griddepcontrol as no-ops); elsewhere (sm_80 / sm_87) the plain build, as the PDL one
    would not compile there."""
    return bool(asked) and (ptx.SIMULATOR or available())


def launch_or_plain(kern, grid, block, stream, sig: str, pdl: bool, *args, shmem: int = 0) -> None:
    """kern[grid, block, stream, shmem](*args), or - pdl - the same launch with programmatic
    stream serialization (`launch`), compiling `sig` first if the kernel has no compiled
    signature yet (it must then have exactly one). The one path every launcher of a PDL build
    takes."""
    if not pdl or ptx.SIMULATOR:    # the simulator runs a PDL build's griddepcontrol as no-ops
        kern[grid, block, stream, shmem](*args)
        return
    if not kern.overloads:
        kern.compile(sig)
    launch(kern, grid, block, stream, *args, shmem=shmem)
