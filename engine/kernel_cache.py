"""The persistent kernel cache: every compiled CUDA kernel kept on disk, so a restart
loads cubins instead of compiling them (178 s of the 182 s a synthetic Qwen3-4B `serve`
took to answer /health on the H200 was compilation, 2026-12-02).

    <root>/<key>/<kernel>.<entry>.kc       engine/kernel_store.py (format, atomic writes)
    key = hash of sources, versions, toolchain, device; entry = hash of one specialisation
                                           engine/kernel_key.py

root: `configure(DIR | "off")` (the CLI's --kernel-cache / --no-kernel-cache), else
$GENIE_RT_KERNEL_CACHE (a folder, or "off"), else $XDG_CACHE_HOME/genie-rt/kernels, else
~/.cache/genie-rt/kernels. Under the CUDA simulator nothing is cached (nothing compiles).

Why not numba's own `cache=True`, nor its Cache class with another locator: its index
is one pickle per function, shared by every closure of a factory (two processes that
write it lose each other's entries; a garbled index raises out of `compile`); entries
carry no checksum; freshness is the mtime of the function's own file only (an edited
device function in another module is not seen); and it refuses to pickle kernels that
link the cuda_fp16 shims (numba's float16 arithmetic). So each dispatcher gets a
`_cache` object that speaks numba's cache protocol - `CUDADispatcher.compile` calls
load_overload before compiling and save_overload after, whether the compile is eager
(`kernel.compile(sig)`) or comes from a first launch - and stores the *linked* cubin (and
PTX) in our own checked entries. A hit is rebuilt with numba-cuda's `CUDACodeLibrary._rebuild` and
`_Kernel._rebuild` (what its own cache does) and loaded into the context at once, so a
bad image is a miss, and launches and graph capture run exactly numba's code. The cubin
is the one the miss compiled: no kernel's code changes.

Hooks (the only coupling): kernel modules call `attach_module(globals())` for their
module-level kernels and `attach(kernel)` on what their factories return; the back-end
appends `run_summary()` to its "kernels compiled" log line. A kernel that is not
attached compiles as before. Not cached: device functions on their own (each kernel's
cubin contains its callees), kernels that link NRT, have module setup callbacks or
capture device arrays (counted as "not cachable"); nothing under the simulator.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import time
from dataclasses import asdict
from pathlib import Path

from .kernel_key import entry_hash, key_components, make_key
from .kernel_store import ENV_VAR, STATS, EntryStore, _warned, warn_once

log = logging.getLogger("genie_rt.kernel_cache")

OFF_WORDS = ("off", "0", "no", "false", "none")

# =====================================================================================
# Where the cache lives
# =====================================================================================
_configured: object = None       # None: environment/default; False: off; Path: that folder


def default_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "genie-rt" / "kernels"


def configure(folder=None) -> None:
    """None: $GENIE_RT_KERNEL_CACHE or the default; "off" / False: no disk cache; a path:
    that folder. Takes effect for compiles from now on (the CLI calls it before loading)."""
    global _configured, _state
    if isinstance(folder, str) and not folder.strip():
        raise ValueError("the kernel cache folder is empty: name a folder, or 'off'")
    if folder is False or (isinstance(folder, str) and folder.strip().lower() in OFF_WORDS):
        _configured = False
    elif folder is None:
        _configured = None
    else:
        _configured = Path(os.path.expanduser(str(folder)))
    _state = None


def configured_root() -> tuple[Path, str, bool]:
    """(folder, where it came from, whether the cache is on), the simulator aside: the
    folder is the one that would be used (`genie-rt cache info` shows it when off)."""
    env = os.environ.get(ENV_VAR, "").strip()
    env_off = env.lower() in OFF_WORDS
    fallback = Path(os.path.expanduser(env)) if env and not env_off else default_root()
    if _configured is False:
        return fallback, "--no-kernel-cache", False
    if isinstance(_configured, Path):
        return _configured, "--kernel-cache", True
    if env_off:
        return default_root(), f"{ENV_VAR}={env}", False
    return fallback, ENV_VAR if env else "default", True


def resolve_root() -> tuple[Path | None, str]:
    """(the folder, or None when the cache is off, and where that came from)."""
    if _simulator():
        return None, "CUDA simulator"
    folder, source, on = configured_root()
    return (folder if on else None), source


def reset() -> None:
    """Forget the folder state, counters and given warnings (tests; a fresh load)."""
    global _state
    _state = None
    STATS.__init__()
    _warned.clear()


def _simulator() -> bool:
    try:
        from numba.cuda import config
        if getattr(config, "ENABLE_CUDASIM", False):
            return True
    except ImportError:
        pass
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


# =====================================================================================
# numba: the `_cache` of a dispatcher
# =====================================================================================
class NumbaCodec:
    """A compiled numba-cuda `_Kernel` to bytes and back: the linked cubin and PTX per
    compute capability and the launch fields, rebuilt with numba-cuda's own
    `CUDACodeLibrary._rebuild` / `_Kernel._rebuild` (what its cache does on a hit); the
    LLVM IR is not kept (inspect_llvm() of a cached kernel is empty). Tests use a fake
    with the same five methods."""

    def argtypes(self, sig) -> tuple:
        from numba.cuda.core import sigutils
        return tuple(sigutils.normalize_signature(sig)[0])

    def uncachable(self, kernel) -> str | None:
        from numba.cuda.memory_management.nrt import NRT_LIBRARY
        lib = kernel._codelibrary
        if getattr(kernel, "launch_config_sensitive", False):
            return "its code depends on the launch configuration"
        if not lib._cubin_cache:
            return "no cubin"
        if NRT_LIBRARY in lib._linking_files:
            return "links numba's runtime (NRT)"
        if not all(_harmless(f) for f in list(lib._setup_functions) + list(lib._teardown_functions)):
            return "its module has setup/teardown callbacks"
        if any(getattr(o, "__cuda_array_interface__", None) is not None for o in lib.referenced_objects.values()):
            return "it references global device arrays"
        return None

    def dumps(self, kernel) -> bytes:
        from numba.cuda.serialize import dumps
        lib = kernel._codelibrary
        return dumps({
            "kernel": dict(cooperative=kernel.cooperative, name=kernel.entry_name, signature=kernel.signature,
                           debug=kernel.debug, lineinfo=kernel.lineinfo, call_helper=kernel.call_helper,
                           extensions=kernel.extensions, shared_memory_carveout=kernel.shared_memory_carveout,
                           launch_config_sensitive=False),
            "library": dict(name=lib.name, entry_name=lib._entry_name, ptx_cache=dict(lib._ptx_cache),
                            cubin_cache=dict(lib._cubin_cache), linkerinfo_cache=dict(lib._linkerinfo_cache),
                            max_registers=lib._max_registers, nvvm_options=dict(lib._nvvm_options),
                            needs_cudadevrt=lib.needs_cudadevrt, use_cooperative=lib.use_cooperative,
                            lto=lib._lto)})

    def loads(self, payload: bytes):
        from numba.cuda.codegen import CUDACodeLibrary
        from numba.cuda.dispatcher import _Kernel
        state = pickle.loads(payload)
        lib = CUDACodeLibrary._rebuild(codegen=None, llvm_strs=[], nrt=False, **state["library"])
        return _Kernel._rebuild(codelibrary=lib, **state["kernel"])

    def bind(self, kernel) -> None:
        kernel.bind()            # load the cubin into the context now: a bad image is a miss


def _harmless(fn) -> bool:
    """numba-cuda's fp16/bf16 shims add a module setup callback that only warns when
    nvJitLink is missing; that warning was given when the kernel was compiled."""
    return getattr(fn, "__name__", "") == "lto_warning_callback" and \
        getattr(fn, "__module__", "").startswith("numba.cuda._internal.")


_state: dict | None = None       # {"root": Path, "stores": {cc: EntryStore | None}}


def current_store() -> EntryStore | None:
    """The key folder for the current device (created and pruned on first use), or None
    when the cache is off or its key cannot be made here."""
    global _state
    root, _ = resolve_root()
    if root is None:
        return None
    if _state is None or _state["root"] != root:
        _state = {"root": root, "stores": {}}
    from numba import cuda
    cc = tuple(cuda.get_current_device().compute_capability)
    stores = _state["stores"]
    if cc not in stores:
        try:
            comps = key_components()
            stores[cc] = EntryStore(root, make_key(comps), comps)
            stores[cc].prepare()
        except Exception as exc:            # a toolchain query failed: compile as if off
            warn_once("key", "kernel cache: cannot make its key (%s); compiling in memory", exc)
            stores[cc] = None
    return stores[cc]


class KernelDiskCache:
    """numba's cache protocol for one kernel dispatcher (its `_cache`, set by attach()):
    `CUDADispatcher.compile` asks load_overload before compiling and hands the result
    to save_overload after. Never raises: a cache problem is a compile."""

    def __init__(self, dispatcher, codec=None, store=current_store):
        self._disp = dispatcher
        self._codec = codec if codec is not None else NumbaCodec()
        self._store = store
        self._name = getattr(dispatcher.py_func, "__qualname__", "kernel").replace(".<locals>", "")
        self._enabled = True
        self._pending: dict[tuple, tuple[str, float]] = {}   # argtypes -> (entry, time of its miss)
        self._paths: set[Path] = set()

    @property
    def cache_path(self):
        store = self._store()
        return None if store is None else str(store.folder)

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def flush(self) -> None:
        """Forget this kernel's entries (numba calls it from recompile())."""
        for p in self._paths:
            try:
                p.unlink()
            except OSError:
                pass
        self._paths.clear()

    def _entry(self, argtypes) -> str:
        return entry_hash(self._disp.py_func, self._disp.targetoptions, argtypes)

    def load_overload(self, sig, target_context=None):
        STATS.lookups += 1              # numba asks before every compile, whether the cache is on or not
        t0 = time.perf_counter()
        try:
            store = self._store() if self._enabled else None
            if store is None:
                return None
            argtypes = self._codec.argtypes(sig)
            entry = self._entry(argtypes)
        except Exception as exc:
            log.debug("kernel cache: %s not looked up (%s)", self._name, exc)
            return None
        self._paths.add(store.path(self._name, entry))
        kernel, payload = None, store.load(self._name, entry)
        if payload is not None:
            try:
                kernel = self._codec.loads(payload)
                self._codec.bind(kernel)
            except Exception as exc:
                store.reject(store.path(self._name, entry), f"cannot be loaded: {type(exc).__name__}: {exc}")
                kernel = None
        now = time.perf_counter()
        if kernel is None:
            STATS.misses += 1
            self._pending[tuple(map(str, argtypes))] = (entry, now)     # save_overload follows the compile
        else:
            STATS.hits += 1
            STATS.load_seconds += now - t0
        return kernel

    def save_overload(self, sig, kernel) -> None:
        try:
            store = self._store() if self._enabled else None
            if store is None:
                return
            argtypes = self._codec.argtypes(sig)
            entry, started = self._pending.pop(tuple(map(str, argtypes)), (None, None))
            if started is not None:
                STATS.compile_seconds += time.perf_counter() - started
            else:
                entry = self._entry(argtypes)
            why = self._codec.uncachable(kernel)
            payload = self._codec.dumps(kernel) if why is None else None
        except Exception as exc:
            why, payload = f"{type(exc).__name__}: {exc}", None
        if payload is None:
            STATS.uncachable += 1
            log.debug("kernel cache: %s not stored: %s", self._name, why)
            return
        store.save(self._name, entry, payload)


def _is_kernel_dispatcher(obj) -> bool:
    return type(obj).__name__ == "CUDADispatcher" and hasattr(obj, "_cache") and \
        not getattr(obj, "targetoptions", {}).get("device", False)


def attach(kernel):
    """Give a `@cuda.jit` kernel the disk cache (no-op for device functions, under the
    simulator, or when it already has a cache); returns it. Touches no file: the cache
    is consulted when the kernel compiles."""
    if not _simulator() and _is_kernel_dispatcher(kernel) and type(kernel._cache).__name__ == "NullCache":
        kernel._cache = KernelDiskCache(kernel)
    return kernel


def attach_module(namespace: dict) -> None:
    """attach() every module-level kernel of a module: `attach_module(globals())`."""
    if not _simulator():
        for v in list(namespace.values()):
            attach(v)


def run_summary() -> str:
    """One line for the load log: hits, misses, seconds, folder; also written to the key
    folder as last-run.json (what `genie-rt cache info` shows)."""
    root, source = resolve_root()
    if root is None:
        return f"kernel cache off ({source})"
    s = STATS
    parts = [f"kernel cache: {s.hits} loaded in {s.load_seconds:.1f} s, {s.misses} compiled in "
             f"{s.compile_seconds:.1f} s"]
    if s.rejected:
        parts.append(f"{s.rejected} bad entries rebuilt")
    if s.uncachable:
        parts.append(f"{s.uncachable} not cachable")
    stores = [st for st in (_state or {}).get("stores", {}).values() if st is not None]
    for st in stores:
        if not st.writable:
            parts.append("not writable")
        else:
            try:
                st._write_atomic(st.folder / "last-run.json", json.dumps(
                    {"time": time.time(), "pid": os.getpid(), **asdict(s)}).encode())
            except OSError:
                pass
    parts.append(str(stores[0].folder) if stores else str(root))
    return ", ".join(parts)
