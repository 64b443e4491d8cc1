"""What a compiled kernel's code depends on: the key of a kernel cache folder and the
hash of one kernel's specialisation (engine/kernel_cache.py uses both).

Folder key (`make_key(key_components())`): the bytes of every .py file of the genie_rt
packages as imported (an edit anywhere - a device function in another module, a constant,
a PTX string in quant/ptx_device.py - gives a new key), the Python, numpy, numba,
numba-cuda, llvmlite and cuda-bindings versions, every NUMBA_* environment variable, the
NVVM, NVRTC, nvJitLink and driver versions and the compute capability of the current device.

Entry hash (`entry_hash(py_func, targetoptions, argtypes)`): the kernel function's
bytecode, constants, first line, closure cells, default arguments and the globals it
names, followed recursively into the device functions, intrinsics and plain functions it
reaches (and the attributes it reads through genie_rt modules), plus numba's target
options (max_registers, fastmath, lto, ...) and the argument types. So two closures of
one factory specialised on different constants never share an entry, and a value
computed at import (an SM count, a flag) is seen even though no source changed.

It deliberately does not look at anything numba cannot freeze into code: an object
with only an address in its repr counts by its type. Nothing here touches files other
than reading the package sources; only toolchain() needs a GPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import types
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path

FORMAT = 1                       # bump to invalidate every entry of every key
PACKAGES = ("genie_rt.engine", "genie_rt.quant", "genie_rt.kvcache", "genie_rt.server")
_IGNORED_NUMBA_ENV = ("NUMBA_CACHE_DIR", "NUMBA_DEBUG_CACHE")


# =====================================================================================
# The key of a folder: sources, versions, toolchain, device
# =====================================================================================
def package_sources() -> list[tuple[str, Path]]:
    """(name, path) of every .py file of the genie_rt packages, as imported."""
    import importlib.util
    out = []
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        for base in (spec.submodule_search_locations or []) if spec else []:
            for p in sorted(Path(base).rglob("*.py")):
                if "__pycache__" not in p.parts:
                    out.append((f"{pkg}/{p.relative_to(base).as_posix()}", p))
    return out


def source_digest(sources=None) -> str:
    """SHA-256 over the names and bytes of the sources (default: package_sources())."""
    h = hashlib.sha256()
    for name, path in sorted(package_sources() if sources is None else sources):
        data = Path(path).read_bytes()
        h.update(b"%s\0%d\0" % (name.encode(), len(data)))
        h.update(data)
    return h.hexdigest()


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def software_versions() -> dict:
    return {"python": "%d.%d.%d" % sys.version_info[:3], "numpy": _version("numpy"),
            "numba": _version("numba"), "numba-cuda": _version("numba-cuda"),
            "llvmlite": _version("llvmlite"), "cuda-bindings": _version("cuda-bindings"),
            "numba_env": {k: v for k, v in sorted(os.environ.items())
                          if k.startswith("NUMBA_") and k not in _IGNORED_NUMBA_ENV}}


def toolchain() -> dict:
    """Compiler, driver and device of the current CUDA context (needs a GPU)."""
    from numba import cuda
    from numba.cuda.cudadrv import driver, nvvm, runtime
    out = {"cc": "%d.%d" % tuple(cuda.get_current_device().compute_capability),
           "nvvm": list(nvvm.NVVM().get_version()), "nvvm_ir": list(nvvm.NVVM().get_ir_version()),
           "nvrtc": list(runtime.get_version()), "driver": list(driver.get_version()),
           "nvjitlink": None}
    if driver._have_nvjitlink():
        from cuda.bindings import nvjitlink
        out["nvjitlink"] = list(nvjitlink.version())
    return out


def key_components(sources_digest: str | None = None, versions: dict | None = None,
                   tools: dict | None = None) -> dict:
    return {"format": FORMAT,
            "sources": source_digest() if sources_digest is None else sources_digest,
            "versions": software_versions() if versions is None else versions,
            "toolchain": toolchain() if tools is None else tools}


def make_key(components: dict) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:20]


# =====================================================================================
# The key of an entry: what one kernel was specialised on
# =====================================================================================
class _Describer:
    """A canonical text of a value as compiled code sees it; see fingerprint()."""

    def __init__(self):
        self.memo: dict[int, tuple[object, str]] = {}   # id -> (kept alive, text)
        self.busy: set[int] = set()

    def __call__(self, v) -> str:
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return f"{type(v).__name__}:{v!r}"
        hit = self.memo.get(id(v))
        if hit is not None and hit[0] is v:
            return hit[1]
        if id(v) in self.busy:                      # recursion (a self-calling device function)
            return f"cycle:{getattr(v, '__qualname__', type(v).__name__)}"
        self.busy.add(id(v))
        try:
            text = self._describe(v)
        finally:
            self.busy.discard(id(v))
        self.memo[id(v)] = (v, text)
        return text

    def _describe(self, v) -> str:
        import numpy as np
        d = self
        if isinstance(v, Enum):
            return f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}={d(v.value)}"
        if isinstance(v, (tuple, list)):
            return f"{type(v).__qualname__}({','.join(d(x) for x in v)})"
        if isinstance(v, (set, frozenset)):
            return "set(" + ",".join(sorted(d(x) for x in v)) + ")"
        if isinstance(v, dict):
            return "dict(" + ",".join(sorted(f"{d(k)}:{d(x)}" for k, x in v.items())) + ")"
        if isinstance(v, np.ndarray):
            return f"ndarray:{v.dtype.str}:{v.shape}:{hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()}"
        if isinstance(v, (np.generic, np.dtype)):
            return f"np:{type(v).__name__}:{v!r}"
        if isinstance(v, types.ModuleType):
            return f"module:{v.__name__}"
        if isinstance(v, type):
            return f"class:{v.__module__}.{v.__qualname__}"
        if isinstance(v, types.FunctionType):
            return self._function(v)
        if hasattr(v, "py_func") and hasattr(v, "targetoptions"):          # a numba dispatcher
            return f"dispatcher:{type(v).__name__}({d(v.py_func)};{d(dict(v.targetoptions))})"
        if hasattr(v, "_defn") and callable(getattr(v, "_defn")):           # a numba @intrinsic
            return f"intrinsic:{getattr(v, '_name', '')}({d(v._defn)})"
        if isinstance(v, (types.BuiltinFunctionType, types.MethodType)):
            return f"builtin:{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
        if is_dataclass(v):
            return f"dataclass:{type(v).__qualname__}(" + ",".join(
                f"{f.name}={d(getattr(v, f.name))}" for f in fields(v)) + ")"
        tname = f"{type(v).__module__}.{type(v).__qualname__}"
        if tname.startswith("numba"):                 # numba types: their str is their identity
            return f"numba:{tname}:{v}"
        r = repr(v) if type(v).__repr__ is not object.__repr__ else ""
        return f"object:{tname}:{r if ' at 0x' not in r else ''}"

    def _function(self, fn) -> str:
        d, code = self, fn.__code__
        names = _code_names(code)
        g = fn.__globals__
        referenced = []
        for n in sorted(names):
            if n in g:
                val = g[n]
                referenced.append(f"{n}={d(val)}")
                # attributes read through one of our modules (ptx.dp4a, config.X)
                if isinstance(val, types.ModuleType) and val.__name__.startswith("genie_rt"):
                    referenced += [f"{n}.{a}={d(getattr(val, a))}" for a in sorted(names)
                                   if hasattr(val, a) and not a.startswith("__")]
        cells = [d(c.cell_contents) if _cell_full(c) else "empty" for c in (fn.__closure__ or ())]
        return (f"function:{fn.__module__}.{fn.__qualname__}[{_code_text(code)}]"
                f"defaults({d(fn.__defaults__)};{d(fn.__kwdefaults__)})"
                f"closure({','.join(zip_names(code.co_freevars, cells))})"
                f"globals({','.join(referenced)})")


def zip_names(names, values) -> list[str]:
    return [f"{n}={v}" for n, v in zip(names, values)]


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _code_text(code) -> str:
    consts = ",".join(_code_text(c) if isinstance(c, types.CodeType) else f"{type(c).__name__}:{c!r}"
                      for c in code.co_consts)
    return (f"{code.co_name}@{code.co_firstlineno}:{hashlib.sha256(code.co_code).hexdigest()[:32]}"
            f":{','.join(code.co_names)}:{','.join(code.co_varnames)}:({consts})")


def fingerprint(obj) -> str:
    """SHA-256 of what compiled code can see of `obj`: for a function (or dispatcher) its
    bytecode, constants, closure cells, defaults and the globals it names, recursively;
    plain values by type and repr. Objects with an address in their repr count by type
    only (numba cannot freeze them into code anyway)."""
    return hashlib.sha256(_Describer()(obj).encode()).hexdigest()


def entry_hash(py_func, targetoptions: dict, argtypes) -> str:
    d = _Describer()
    text = "\n".join((f"entry:{FORMAT}", d(py_func), d(dict(targetoptions)),
                      ",".join(str(t) for t in argtypes)))
    return hashlib.sha256(text.encode()).hexdigest()
