"""engine/kernel_cache.py: the cache object numba's dispatchers ask, its configuration,
and the real compile path.

Checked on the CPU: a miss then a hit, garbled or unloadable entries recompiled, codec
failures never fail a compile (a stand-in for numba's kernels); where the cache is, the
simulator's no-op, every kernel module attaching its kernels; numba-cuda's own kernel
objects round-trip through the codec (a subprocess without the simulator: real NVVM, a
stand-in cubin).
GPU (-m gpu): a kernel cached and loaded in a fresh process gives the same result; an
edited source in a package copy recompiles; two processes starting together both compute
correctly; garbled entries are rebuilt; a whole engine loads from the cache with no
compile and the same greedy tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from genie_rt.engine import kernel_cache, kernel_store
from genie_rt.engine.kernel_cache import KernelDiskCache
from genie_rt.engine.kernel_store import STATS, encode_entry
from kernel_cache_helpers import (KEY, MODEL, Dispatcher, child_env, copy_package, fresh_state,  # noqa: F401
                                  make_kernel, store, warnings_of)


# =====================================================================================
# The dispatcher's cache object, with a stand-in for numba's kernels
# =====================================================================================
class FakeKernel:
    def __init__(self, code: bytes):
        self.code, self.bound = code, False


class FakeCodec:
    """NumbaCodec's five methods over FakeKernel."""

    def __init__(self):
        self.bind_error = None

    def argtypes(self, sig):
        return tuple(sig)

    def uncachable(self, k):
        return None if k.code else "no code"

    def dumps(self, k):
        return b"FAKE" + k.code

    def loads(self, payload):
        if not payload.startswith(b"FAKE"):
            raise ValueError("not a fake kernel")
        return FakeKernel(payload[4:])

    def bind(self, k):
        if self.bind_error is not None:
            raise self.bind_error
        k.bound = True


def compile_like_numba(cache, sig, code: bytes):
    """What CUDADispatcher.compile does around its cache: ask, else compile and hand over."""
    k = cache.load_overload(sig, None)
    if k is None:
        k = FakeKernel(code)
        cache.save_overload(sig, k)
    return k


def cache_for(st, fn=None, codec=None):
    return KernelDiskCache(Dispatcher(fn or make_kernel(3)), codec or FakeCodec(), store=lambda: st)


def test_miss_then_hit_in_a_new_cache_object(tmp_path):
    st = store(tmp_path)
    sig = ("float32[::1]",)
    k1 = compile_like_numba(cache_for(st), sig, b"cubin-1")
    assert (STATS.hits, STATS.misses, STATS.saved) == (0, 1, 1)
    k2 = compile_like_numba(cache_for(st), sig, b"SHOULD-NOT-COMPILE")
    assert k2.code == k1.code == b"cubin-1" and k2.bound
    assert (STATS.hits, STATS.misses) == (1, 1)
    k3 = compile_like_numba(cache_for(st), ("int32[::1]",), b"cubin-2")   # another signature: a miss
    assert k3.code == b"cubin-2" and STATS.misses == 2
    k4 = compile_like_numba(cache_for(st, make_kernel(4)), sig, b"cubin-3")  # another constant: a miss
    assert k4.code == b"cubin-3" and STATS.misses == 3


def test_garbled_entry_is_recompiled_and_stored_again(tmp_path, caplog):
    st = store(tmp_path)
    sig = ("float32[::1]",)
    compile_like_numba(cache_for(st), sig, b"cubin")
    (path,) = st.folder.glob("*.kc")
    path.write_bytes(path.read_bytes()[:-3])
    k = compile_like_numba(cache_for(st), sig, b"cubin")
    assert k.code == b"cubin" and STATS.rejected == 1 and STATS.misses == 2
    assert compile_like_numba(cache_for(st), sig, b"x").code == b"cubin" and STATS.hits == 1


@pytest.mark.parametrize("where", ["loads", "bind"])
def test_entry_that_cannot_be_loaded_is_a_miss(tmp_path, caplog, where):
    st = store(tmp_path)
    sig = ("float32[::1]",)
    compile_like_numba(cache_for(st), sig, b"cubin")
    codec = FakeCodec()
    if where == "bind":                                                   # e.g. the driver refuses the image
        codec.bind_error = RuntimeError("CUDA_ERROR_INVALID_IMAGE")
    else:
        (path,) = st.folder.glob("*.kc")
        path.write_bytes(encode_entry(b"NOT A KERNEL", KEY, decode_entry_entry(path), "k"))
    k = compile_like_numba(cache_for(st, codec=codec), sig, b"recompiled")
    assert k.code == b"recompiled" and STATS.rejected == 1
    assert warnings_of(caplog, "cannot be loaded")


def decode_entry_entry(path: Path) -> str:
    blob = path.read_bytes()
    n = int.from_bytes(blob[8:12], "little")
    return json.loads(blob[12:12 + n])["entry"]


def test_uncachable_kernels_and_codec_failures_never_fail_a_compile(tmp_path):
    st = store(tmp_path)

    class Exploding(FakeCodec):
        def dumps(self, k):
            raise RuntimeError("Cannot pickle CUDACodeLibrary with linking files")
    assert compile_like_numba(cache_for(st), ("a",), b"").code == b""   # uncachable: no code
    assert compile_like_numba(cache_for(st, codec=Exploding()), ("b",), b"c").code == b"c"
    assert STATS.uncachable == 2 and STATS.saved == 0


def test_cache_off_or_unknown_key_compiles_normally(tmp_path):
    off = KernelDiskCache(Dispatcher(make_kernel(3)), FakeCodec(), store=lambda: None)
    assert compile_like_numba(off, ("a",), b"c").code == b"c"
    assert (STATS.hits, STATS.misses, STATS.saved) == (0, 0, 0)


def test_flush_forgets_this_kernels_entries(tmp_path):
    st = store(tmp_path)
    c = cache_for(st)
    compile_like_numba(c, ("a",), b"c")
    compile_like_numba(cache_for(st, make_kernel(9)), ("a",), b"d")
    c.flush()
    assert len(list(st.folder.glob("*.kc"))) == 1


# =====================================================================================
# Configuration and hooks
# =====================================================================================
def test_where_the_cache_is(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_store.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.configured_root() == (tmp_path / "xdg" / "genie-rt" / "kernels", "default", True)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert kernel_cache.configured_root()[0] == Path.home() / ".cache" / "genie-rt" / "kernels"
    monkeypatch.setenv(kernel_store.ENV_VAR, str(tmp_path / "env"))
    assert kernel_cache.configured_root() == (tmp_path / "env", kernel_store.ENV_VAR, True)
    monkeypatch.setenv(kernel_store.ENV_VAR, "OFF")
    assert kernel_cache.configured_root()[2] is False
    kernel_cache.configure(tmp_path / "flag")                             # the flag beats the variable
    assert kernel_cache.configured_root() == (tmp_path / "flag", "--kernel-cache", True)
    kernel_cache.configure("off")
    assert kernel_cache.configured_root()[2] is False
    with pytest.raises(ValueError):
        kernel_cache.configure("  ")


@pytest.mark.skipif(not kernel_cache._simulator(), reason="checks the simulator")
def test_simulator_is_a_no_op(tmp_path):
    from numba import cuda
    kernel_cache.configure(tmp_path)

    @cuda.jit
    def k(x):
        x[0] = 1
    assert kernel_cache.attach(k) is k and not hasattr(k, "_cache")
    assert kernel_cache.resolve_root() == (None, "CUDA simulator")
    assert kernel_cache.run_summary() == "kernel cache off (CUDA simulator)"
    assert not (tmp_path / "x").exists() and list(tmp_path.iterdir()) == []


_ATTACH_CHILD = """
import importlib, json, pkgutil
import genie_rt.engine, genie_rt.quant, genie_rt.kvcache
from genie_rt.engine import norm, kernel_cache
from genie_rt.quant import embed, mmq_prep, mmq_reduce, gemv_kernels as G, mmq_defs as M
from genie_rt.quant.formats import QType
from genie_rt.kvcache import attention_decode_kernels, attention_prefill_kernels
ks = []
for pkg in (genie_rt.engine, genie_rt.quant, genie_rt.kvcache):       # every module-level kernel
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in ("cli", "__main__"):
            continue
        m = importlib.import_module(pkg.__name__ + "." + info.name)
        ks += [v for v in vars(m).values() if type(v).__name__ == "CUDADispatcher"
               and not v.targetoptions.get("device") and v.py_func.__module__ == m.__name__]
ks += list(embed._KERNELS.values())                                  # made from one table
from genie_rt.quant import gemv_mma, gemv_mma_k
ks += [gemv_mma.mma_q4k_kernel(4), gemv_mma_k.mma_q4k_q8k_kernel(4)]  # the lab's factories too
ks += [G.gemv_kernel(QType.Q4_K, "dp4a", 1, 1, False), G.gemv_kernel(QType.Q4_K, "dp4a", 1, 2, False),
       G.gemv_kernel(QType.Q4_K, "dp4a", 1, 1, True, 32, True),                # a PDL build
       G.qkv_kernel(((QType.Q4_K, "dp4a"),) * 3, 1, 1), G.swiglu_kernel((QType.Q4_K, "dp4a"), (QType.Q4_K, "dp4a"), 1, 1),
       mmq_reduce.build_reduce_kernel(M.EPI_STORE), attention_decode_kernels.decode_kernel(128, 2, "int8"),
       attention_prefill_kernels.prefill_kernel(128, 4, "int8"), norm._rmsnorm_q8_for(True, 5024, 1024),
       mmq_prep.prepare_x_kernel_for(2560)]
unattached = [k.py_func.__qualname__ for k in ks if not isinstance(k._cache, kernel_cache.KernelDiskCache)]
g = ks[-10:-7]
print(json.dumps({"n": len(ks), "unattached": unattached,
                  "gemv_entries_differ": len({k._cache._entry(("int32",)) for k in g}) == 3}))
"""


@pytest.mark.slow
def test_every_kernel_module_attaches_its_kernels():
    """Without the simulator (no GPU needed: kernels are lazy), every kernel of the kernel
    modules and of their factories has the disk cache."""
    out = subprocess.run([sys.executable, "-c", _ATTACH_CHILD], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] > 30 and res["unattached"] == [] and res["gemv_entries_differ"]


_CODEC_CHILD = """
import json, types
import numpy as np
import numba.cuda.dispatcher as D
import numba.cuda.codegen as CG
D.get_current_device = lambda: types.SimpleNamespace(compute_capability=(8, 7))
CG.CUDACodeLibrary._ensure_cc = lambda self, cc: cc if cc is not None else (8, 7, "")
from cuda.core import ObjectCode
from numba import cuda
from numba.cuda.core import sigutils
from genie_rt.engine.kernel_cache import NumbaCodec

@cuda.jit
def halves(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * np.float16(2) + np.float16(1)     # fp16 arithmetic: links the cuda_fp16 shim

codec = NumbaCodec()
args = codec.argtypes("void(float16[::1], float16[::1])")
k = D._Kernel(halves.py_func, args, **{o: v for o, v in halves.targetoptions.items() if o != "device"})
lib = k._codelibrary
out = {"before_cubin": codec.uncachable(k), "links": len(lib._linking_files)}
lib._cubin_cache[(8, 7, "")] = ObjectCode.from_cubin(b"stand-in cubin bytes", name="halves")
out["uncachable"] = codec.uncachable(k)
k2 = codec.loads(codec.dumps(k))
lib2 = k2._codelibrary
out.update(same_cubin=lib2.get_cubin((8, 7, "")).code == b"stand-in cubin bytes",
           same_ptx=lib2.get_asm_str((8, 7, "")) == lib.get_asm_str((8, 7, "")),
           same_entry=k2.entry_name == k.entry_name and lib2._entry_name == lib._entry_name,
           same_sig=k2.signature == k.signature and k2.argument_types == k.argument_types,
           links_after=len(lib2._linking_files), setup_after=len(lib2._setup_functions))
lib._setup_functions.append(print)
out["foreign_setup"] = codec.uncachable(k)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_numba_kernel_round_trips_through_the_codec():
    """numba-cuda's real _Kernel / CUDACodeLibrary (NVVM runs, no GPU: a stand-in cubin)."""
    out = subprocess.run([sys.executable, "-c", _CODEC_CHILD], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    if out.returncode != 0 and "NVVM" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("NVVM is not installed (numba-cuda[cu12])")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before_cubin"] == "no cubin" and r["links"] >= 1            # the shim is a link-time input
    assert r["uncachable"] is None                                        # ... and still cachable
    assert r["same_cubin"] and r["same_ptx"] and r["same_entry"] and r["same_sig"]
    assert r["links_after"] == 0 and r["setup_after"] == 0               # the cubin is already linked
    assert "callbacks" in r["foreign_setup"]


_PROTOCOL_CHILD = r"""
import json, sys, types
import numpy as np
import numba.cuda.dispatcher as D
import numba.cuda.codegen as CG
import numba.cuda
fake_dev = lambda: types.SimpleNamespace(compute_capability=(8, 7), id=0)
D.get_current_device = fake_dev
numba.cuda.get_current_device = fake_dev
CG.CUDACodeLibrary._ensure_cc = lambda self, cc: cc if cc is not None else (8, 7, "")
from cuda.core import ObjectCode
_orig_get_cubin = CG.CUDACodeLibrary.get_cubin
def get_cubin(self, cc=None):            # no driver here: a stand-in for the linked cubin
    cc = self._ensure_cc(cc)
    if cc not in self._cubin_cache:
        self._cubin_cache[cc] = ObjectCode.from_cubin(b"stand-in " + self._entry_name.encode(), name="x")
    return self._cubin_cache[cc]
CG.CUDACodeLibrary.get_cubin = get_cubin
D._Kernel.bind = lambda self: self._codelibrary.get_cubin()   # what bind() does first
from genie_rt.engine import kernel_key, kernel_cache
kernel_key.toolchain = lambda: {"cc": "8.7", "nvvm": "stand-in"}
kernel_cache.configure(sys.argv[1])
from genie_rt.engine.kernel_store import STATS
from genie_rt.engine import copy_kernels
from numba import cuda

@cuda.jit
def halves(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * np.float16(2) + np.float16(1)
kernel_cache.attach(halves)

k = copy_kernels._copy_cols_kernel
if sys.argv[2] == "eager":
    a = k.compile("void(float32[:, ::1], float32[:, ::1], int64)")
    b = halves.compile("void(float16[::1], float16[::1])")
else:                                    # what a first launch does
    a = k._compile_for_args(np.zeros((2, 3), np.float32), np.zeros((2, 5), np.float32), np.int64(1))
    b = halves._compile_for_args(np.zeros(3, np.float16), np.zeros(3, np.float16))
print(json.dumps({"hits": STATS.hits, "misses": STATS.misses, "saved": STATS.saved, "uncachable": STATS.uncachable,
                  "cubins": [x._codelibrary.get_cubin().code.decode() for x in (a, b)],
                  "types": [type(x).__name__ for x in (a, b)], "overloads": len(k.overloads),
                  "summary": kernel_cache.run_summary()}))
"""


@pytest.mark.slow
def test_numba_compile_uses_the_cache_eager_then_lazy(tmp_path):
    """numba's own CUDADispatcher.compile and first-launch path (_compile_for_args) with the
    disk cache, a stand-in for the device (no GPU: the cubin is fake bytes, bind() only
    fetches it): a process that compiles with a signature string fills the cache; a fresh
    process whose first launch types the arguments loads the same entries."""
    def child(mode):
        out = subprocess.run([sys.executable, "-c", _PROTOCOL_CHILD, str(tmp_path / "kc"), mode],
                             capture_output=True, text=True, env=child_env(), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    eager = child("eager")
    assert (eager["hits"], eager["misses"], eager["saved"], eager["uncachable"]) == (0, 2, 2, 0)
    lazy = child("lazy")
    assert (lazy["hits"], lazy["misses"], lazy["saved"]) == (2, 0, 0)
    assert lazy["cubins"] == eager["cubins"] and lazy["types"] == ["_Kernel", "_Kernel"]
    assert lazy["overloads"] == 1 and "2 loaded" in lazy["summary"]


# =====================================================================================
# GPU: the real compile path
# =====================================================================================
_GPU_CHILD = """
import json, sys
if len(sys.argv) > 2:
    sys.path.insert(0, sys.argv[2])                 # a copy of the package
import numpy as np
from numba import cuda
from genie_rt.engine import kernel_cache
from genie_rt.engine.kernel_store import STATS
from genie_rt.engine.copy_kernels import copy_cols, copy_cols_reference
from genie_rt.engine import norm

@cuda.jit
def halves(x, y):                                   # links the cuda_fp16 shim
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * np.float16(2) + np.float16(1)
kernel_cache.attach(halves)

rng = np.random.default_rng(int(sys.argv[1]))
src = rng.standard_normal((5, 37)).astype(np.float32)
dst = rng.standard_normal((5, 100)).astype(np.float32)
d = cuda.to_device(dst)
copy_cols(cuda.to_device(src), d, 11)
ok = bool(np.array_equal(d.copy_to_host(), copy_cols_reference(src, dst, 11)))
x = rng.standard_normal((3, 5024)).astype(np.float32)
w = rng.standard_normal(5024).astype(np.float32)
out = cuda.device_array((3, 5024), np.float32)
xq = cuda.device_array((3, 5024), np.int8)
xs = cuda.device_array((3, 5024 // 32 * 4), np.float32)
norm.rmsnorm_q8(cuda.to_device(x), cuda.to_device(w), xq, xs, 1e-6, out=out)   # made by a factory on first use
ok &= bool(np.allclose(out.copy_to_host(), norm.rmsnorm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5))
h = rng.standard_normal(999).astype(np.float16)
y = cuda.device_array(999, np.float16)
halves[4, 256](cuda.to_device(h), y)
ok &= bool(np.array_equal(y.copy_to_host(), h * np.float16(2) + np.float16(1)))
cuda.synchronize()
print(json.dumps({"ok": ok, "hits": STATS.hits, "misses": STATS.misses, "saved": STATS.saved,
                  "rejected": STATS.rejected, "uncachable": STATS.uncachable, "folder": kernel_cache.run_summary()}))
"""


def run_gpu_child(cache: Path, seed: int = 0, package: Path | None = None, wait: bool = True):
    args = [sys.executable, "-c", _GPU_CHILD, str(seed)] + ([str(package)] if package else [])
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env(GENIE_RT_KERNEL_CACHE=str(cache)))
    return finish(p) if wait else p


def finish(p) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_kernels_cached_then_loaded_by_a_fresh_process(tmp_path):
    cache = tmp_path / "kc"
    cold = run_gpu_child(cache, seed=1)
    assert cold["ok"] and cold["hits"] == 0 and cold["misses"] >= 3 and cold["saved"] == cold["misses"]
    warm = run_gpu_child(cache, seed=2)                                   # other data, same kernels
    assert warm["ok"] and warm["misses"] == 0 and warm["hits"] == cold["misses"] and warm["rejected"] == 0


@pytest.mark.gpu
def test_gpu_edited_package_source_recompiles(tmp_path):
    pkg = copy_package(tmp_path / "pkg")
    cache = tmp_path / "kc"
    assert run_gpu_child(cache, package=tmp_path / "pkg")["misses"] >= 3
    assert run_gpu_child(cache, package=tmp_path / "pkg")["misses"] == 0
    with open(pkg / "quant" / "ptx_device.py", "a") as f:                 # not the kernels' own files
        f.write("\n# an edit\n")
    edited = run_gpu_child(cache, package=tmp_path / "pkg")
    assert edited["ok"] and edited["hits"] == 0 and edited["misses"] >= 3
    assert len(kernel_store.key_folders(cache)) == 2


@pytest.mark.gpu
def test_gpu_two_processes_starting_together(tmp_path):
    cache = tmp_path / "kc"
    procs = [run_gpu_child(cache, seed=s, wait=False) for s in (3, 4)]
    a, b = (finish(p) for p in procs)
    assert a["ok"] and b["ok"] and a["rejected"] == b["rejected"] == 0
    third = run_gpu_child(cache, seed=5)
    assert third["ok"] and third["misses"] == 0 and third["rejected"] == 0


@pytest.mark.gpu
def test_gpu_garbled_entries_are_rebuilt(tmp_path):
    cache = tmp_path / "kc"
    n = run_gpu_child(cache)["misses"]
    entries = list(cache.glob("*/*.kc"))
    assert len(entries) == n
    for i, p in enumerate(entries):
        blob = p.read_bytes()
        p.write_bytes(blob[: len(blob) // 2] if i % 2 else blob[:-64] + os.urandom(64))
    rebuilt = run_gpu_child(cache, seed=6)
    assert rebuilt["ok"] and rebuilt["rejected"] == n and rebuilt["misses"] == n
    assert run_gpu_child(cache, seed=7)["hits"] == n


_ENGINE_CHILD = """
import dataclasses, hashlib, json, logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO)
from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import GenerationRequest
from genie_rt.engine.sampling import SamplingParams
from genie_rt.engine.kernel_store import STATS
e = Engine.load(sys.argv[1], EngineConfig(backend="cuda", n_ctx=256, overlap_load=sys.argv[2] == "overlap"))
prompt = e.raw_prompt("The kernel cache")
req = GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0), max_tokens=12)
res = list(e.generate(req))[-1].result
logits = [e.backend.prefill(np.asarray(prompt, np.int32), 0), e.backend.decode(int(res.tokens[0]), len(prompt))]
bits = hashlib.sha256(b"".join(np.ascontiguousarray(x, np.float32).tobytes() for x in logits)).hexdigest()
print(json.dumps({"tokens": [int(t) for t in res.tokens], "hits": STATS.hits, "misses": STATS.misses,
                  "logits": bits, "graphs": e.backend.capture_stats}))
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_engine_loads_from_the_cache_with_the_same_tokens(tmp_path):
    """A warm start gives the cold start's bits, both when it loads its cached kernels inside
    the captures of an overlapped load (--overlap-load) and when it reads the weights first."""
    cache = tmp_path / "kc"

    def load(mode):
        out = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, str(MODEL), mode], capture_output=True, text=True,
                             env=child_env(GENIE_RT_KERNEL_CACHE=str(cache)), timeout=1200)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    cold, warm, serial = load("overlap"), load("overlap"), load("serial")
    assert cold["misses"] > 20 and warm["misses"] == 0 and warm["hits"] == cold["misses"]
    assert serial["misses"] == 0
    assert warm["tokens"] == cold["tokens"] == serial["tokens"]
    assert warm["logits"] == cold["logits"] == serial["logits"]
    # the warm start kept the captures that loaded cached kernels: none discarded
    assert not [k for k in warm["graphs"] if k.startswith("discarded")], warm["graphs"]
