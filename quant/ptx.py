"""Inline-PTX intrinsics for the Numba CUDA kernels, each with a simulator fallback.

Every instruction that numba-cuda does not expose (tensor-core mma, ldmatrix, cp.async,
dp4a, 128-bit read-only loads, f16x2 packing) is imported from this one module, so kernels
stay plain Python and a later move away from numba-cuda touches one place: this module and
its parts ptx_reference.py, ptx_device.py, ptx_sim.py and ptx_fallbacks.py.

Two implementations of every public function, chosen once at import, each in its own
module; this one only picks and re-exports them:

- device (default, `ptx_device.py`): a `numba.cuda.extending.intrinsic` that emits
  `llvmlite.ir.InlineAsm`. Callable only from `@cuda.jit` code.
- simulator (`NUMBA_ENABLE_CUDASIM=1`, `ptx_fallbacks.py`): a pure-Python/numpy function
  with the same arguments and results. Warp-wide instructions (mma, ldmatrix, shuffles)
  gather the lanes of one warp through a warp exchange (`ptx_sim._warp_collective`),
  compute the result in numpy from the PTX-ISA fragment layouts, and hand each lane its
  part. Importing this module under the simulator also imports `ptx_sim.py`, which
  installs `cuda.shfl_*_sync`, `cuda.ballot_sync`, `cuda.all_sync`, `cuda.any_sync`,
  `cuda.eq_sync`, `cuda.activemask` and `cuda.lanemask_lt` on the simulator's
  `FakeCUDAModule`, and lets `cuda.shared.array` / `cuda.local.array` take `alignment=`.

The numpy references (`mma_f16_f32_reference`, `frag_a_f16`, ...; `ptx_reference.py`) are
always defined: the fallbacks use them, and tests use them to check the hardware.

Fragment layouts, constraints and the fallbacks' limits: docs/ptx-intrinsics.md.

Deliberately not here: wgmma/TMA (sm_90-only), bf16/fp8 mma, stmatrix, anything that
numba-cuda already provides (`cuda.shfl_*_sync`, atomics, `cuda.fp16`).
"""
import os

__all__ = [
    "SIMULATOR", "is_device_array", "device_address",
    # tensor cores
    "mma_f16_f32", "mma_s8_s32", "mma_s8_k16",
    "ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4",
    "ldmatrix_x1_trans", "ldmatrix_x2_trans", "ldmatrix_x4_trans",
    # memory
    "cp_async16", "cp_async16_zfill", "cp_async_commit", "cp_async_wait_all",
    "cp_async_wait_group", "cp_async_wait_group_0", "cp_async_wait_group_1",
    "cp_async_wait_group_2", "ldg_v2", "ldg_v4", "ld_v2", "ld_v4", "ldw_v2", "ldw_v4", "ld_relaxed_f32", "ld_relaxed_i32",
    # programmatic dependent launch (sm_90+)
    "griddep_wait", "griddep_launch_dependents",
    # scalar
    "dp4a", "hfma2", "pack_half2", "unpack_half2", "f16_bits_to_f32", "bits_to_f32", "mul_rn",
    # host-side fragment packing and numpy references
    "frag_a_f16", "frag_b_f16", "frag_a_s8", "frag_b_s8", "frag_c", "unfrag_c",
    "unfrag_a_f16", "unfrag_b_f16", "unfrag_a_s8", "unfrag_b_s8",
    "mma_f16_f32_reference", "mma_s8_s32_reference", "mma_s8_k16_reference", "ldmatrix_reference",
    "dp4a_reference", "hfma2_reference",
]


def _simulator_enabled() -> bool:
    try:
        from numba.cuda import config as cuda_config
        if getattr(cuda_config, "ENABLE_CUDASIM", False):
            return True
    except ImportError:
        pass
    try:
        from numba import config
        if getattr(config, "ENABLE_CUDASIM", False):
            return True
    except ImportError:
        pass
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


SIMULATOR: bool = _simulator_enabled()


def is_device_array(a) -> bool:
    """A CUDA array kernels can take: numba's device arrays (mapped and pinned-device
    ones too, which are also numpy arrays), any __cuda_array_interface__ object, or the
    simulator's stand-in. Launchers use it to refuse host arrays, which numba would
    silently copy on every launch."""
    return hasattr(a, "__cuda_array_interface__") or type(a).__name__ == "FakeCUDAArray"


def device_address(a) -> int:
    """Address of a device array's first element (the simulator's arrays: their host memory's),
    for alignment and aliasing checks in launchers."""
    cai = getattr(a, "__cuda_array_interface__", None)      # the simulator's arrays have none
    return int(cai["data"][0]) if cai is not None else int(a.ctypes.data)


# the numpy references and host-side fragment packing: always
from .ptx_reference import (dp4a_reference, frag_a_f16, frag_a_s8, frag_b_f16, frag_b_s8,  # noqa: E402
                            frag_c, hfma2_reference, ldmatrix_reference, mma_f16_f32_reference,
                            mma_s8_k16_reference, mma_s8_s32_reference, unfrag_a_f16, unfrag_a_s8, unfrag_b_f16,
                            unfrag_b_s8, unfrag_c)

# the intrinsics: inline PTX on a GPU, numpy fallbacks under the simulator
if SIMULATOR:
    from .ptx_fallbacks import (bits_to_f32, cp_async16, cp_async16_zfill, cp_async_commit,
                                cp_async_wait_all, cp_async_wait_group, cp_async_wait_group_0,
                                cp_async_wait_group_1, cp_async_wait_group_2, dp4a, f16_bits_to_f32,
                                griddep_launch_dependents, griddep_wait, hfma2, ld_relaxed_f32, ld_relaxed_i32, ld_v2, ld_v4, ldg_v2, ldg_v4, ldw_v2, ldw_v4, ldmatrix_x1, ldmatrix_x1_trans, ldmatrix_x2,
                                ldmatrix_x2_trans, ldmatrix_x4, ldmatrix_x4_trans, mma_f16_f32,
                                mma_s8_k16, mma_s8_s32, mul_rn, pack_half2, unpack_half2)   # noqa: E402
else:
    from .ptx_device import (bits_to_f32, cp_async16, cp_async16_zfill, cp_async_commit,
                             cp_async_wait_all, cp_async_wait_group, cp_async_wait_group_0,
                             cp_async_wait_group_1, cp_async_wait_group_2, dp4a, f16_bits_to_f32,
                             griddep_launch_dependents, griddep_wait, hfma2, ld_relaxed_f32, ld_relaxed_i32, ld_v2, ld_v4, ldg_v2, ldg_v4, ldw_v2, ldw_v4, ldmatrix_x1, ldmatrix_x1_trans, ldmatrix_x2,
                             ldmatrix_x2_trans, ldmatrix_x4, ldmatrix_x4_trans, mma_f16_f32,
                             mma_s8_k16, mma_s8_s32, mul_rn, pack_half2, unpack_half2)   # noqa: E402
