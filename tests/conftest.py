"""Test configuration shared by every test module.

Three kinds of kernel tests live side by side:
- simulator tests: the real kernels run by Numba's CUDA simulator at tiny shapes. On a
  machine without a GPU the simulator is switched on here, before anything imports
  numba.cuda; on a GPU machine the same tests run on the device.
- PTX tests: every kernel compiled for sm_87 and sm_90 in a subprocess without the
  simulator (compile_ptx needs only NVRTC/NVVM from the cu12/cu13 wheels).
- GPU tests (marker `gpu`): real shapes on a real device, skipped without one.
"""
import ctypes.util
import os
import pathlib
import shutil

import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _has_cuda_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    if ctypes.util.find_library("cuda") is None and shutil.which("nvidia-smi") is None:
        return False
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


HAS_GPU = _has_cuda_gpu()
if not HAS_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # Simulated threads hand the GIL over every 5 ms by default, so each barrier costs
    # ~10 ms; a short switch interval makes it ~1 ms (only the simulator runs threads here).
    import sys
    sys.setswitchinterval(5e-5)


# Modules whose tests run GPU kernels (or compile them to PTX): under the simulator, on a machine
# without a GPU, they take most of the suite's time (several minutes on 2 cores), so there they
# are all `slow` and the README's quick suite (`-m "not slow"`) leaves them to the full suite.
# On a GPU machine they run on the device in seconds and stay in the quick suite.
SIMULATOR_MODULES = frozenset({
    "test_attention_chain.py", "test_attention_decode.py", "test_attention_decode_mma.py", "test_attention_gpu.py",
    "test_attention_merge.py",
    "test_attention_prefill.py", "test_attention_ptx.py", "test_attention_window.py",
    "test_backend_cuda.py", "test_decode_switches.py", "test_device_pool.py", "test_embed.py", "test_gemv.py",
    "test_gemv_pdl.py",
    "test_gpu_sampling.py", "test_h2d.py", "test_integrated_gpu.py", "test_mmq.py", "test_mmq_types.py",
    "test_norm.py",
    "test_ptx.py", "test_ptx_mma.py", "test_rope_write.py",
})


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on a GPU machine)")
    slow = pytest.mark.slow(reason="GPU kernels under the CUDA simulator (conftest.SIMULATOR_MODULES)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        if item.path.name in SIMULATOR_MODULES:
            item.add_marker(slow)


@pytest.fixture(scope="session")
def fixture_gguf() -> pathlib.Path:
    return FIXTURES / "qwen3-micro-q4km.gguf"


@pytest.fixture(scope="session")
def llamacpp_logits():
    import numpy as np
    return np.load(FIXTURES / "qwen3-micro-llamacpp-logits.npz")


@pytest.fixture(scope="module")
def server(fixture_gguf):
    """An httpx client of the fixture model on the CPU back-end behind a real uvicorn, one per module
    that asks (test_server.py, test_server_invalid.py; test_server_support.serve_fixture_model)."""
    from test_server_support import serve_fixture_model
    yield from serve_fixture_model(fixture_gguf)


@pytest.fixture(scope="module")
def reference(server) -> str:
    """That server's greedy answer to test_server_support.GREEDY."""
    from test_server_support import greedy_reference
    return greedy_reference(server)
