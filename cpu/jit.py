"""The one decorator every CPU kernel is compiled with, and the on-disk cache it uses.

    @kernel(parallel=True)
    def _linear_q8_0(...): ...

is `numba.njit(fastmath=False, nogil=True, **options)` plus a compilation cache on
disk, like `cache=True`, with one difference that matters here: **the cache is keyed by
a hash of every source file of this package (cpu/*.py), not only the file that defines
the kernel.**

Why: numba's own `cache=True` checks only the defining file's contents. Our kernels
inline code from other files of this package - the SIMD primitives of `simd.py` (LLVM
IR emitted into the caller) and small `@njit` helpers - so after an edit to `simd.py`
numba would happily load a kernel compiled against the old primitive. With the
package-wide key, editing any file under cpu/ makes every kernel recompile on its next
first call (numba overwrites the stale entries in place; nothing accumulates). Code
outside cpu/ is never called from a kernel (tests/test_cpu_kernels.py checks that every
jitted function a kernel references is defined in this package), so nothing else can
make an entry stale. numba's version and the CPU model and features are part of numba's
own key (an index written by another numba version, or for another CPU, is ignored).

Where: `$NUMBA_CACHE_DIR/<pkg>_<hash of the path>/` when NUMBA_CACHE_DIR is set (as
numba does), else cpu/__pycache__/ when it is writable, else numba's user-wide folder
(~/.cache/numba/...). The first call of each specialisation compiles (seconds); later
processes load it from disk (milliseconds): `python -m genie_rt.cpu.bench` prints both.

error_model="numpy" (float division by zero gives inf/nan, as in numpy, instead of a
branch that raises and keeps loops scalar). fastmath stays off: LLVM may then not reorder float operations, so each kernel's
float results are fixed by its source - the property batch invariance rests on (see
linear.py). nogil=True: the GIL is released while a kernel runs.

What it deliberately does not do: choose threads (threads.py), or touch numba's global
cache settings - the locator is attached to our dispatchers only. It uses numba's
caching classes (numba.core.caching); if a numba release changes them, `kernel` falls
back to compiling without a disk cache and warns once (slow first calls, never wrong
results).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import warnings
from pathlib import Path

import numba

PACKAGE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _sources_hash(stamps: tuple) -> str:
    """sha256 over (name, bytes) of the package's .py files; `stamps` (name, mtime, size)
    is only the memo key, so an edit while the process runs is re-hashed."""
    h = hashlib.sha256()
    for name, _, _ in stamps:
        h.update(name.encode() + b"\0" + (PACKAGE_DIR / name).read_bytes() + b"\0")
    return h.hexdigest()


def sources_hash() -> str:
    """The cache key of every kernel in this package: a hash of all cpu/*.py files."""
    stamps = []
    for p in sorted(PACKAGE_DIR.glob("*.py")):
        st = p.stat()
        stamps.append((p.name, st.st_mtime_ns, st.st_size))
    return _sources_hash(tuple(stamps))


def _make_cache_class():
    """A numba FunctionCache whose locator keys entries by sources_hash(); None if
    numba's caching internals are not what this was written against."""
    try:
        from numba.core import caching
        base_locator = caching._CacheLocator
        base_impl = caching.CompileResultCacheImpl
        base_cache = caching.FunctionCache
    except (ImportError, AttributeError):
        return None

    class PackageSourcesLocator(base_locator):
        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            sub = self.get_suitable_cache_subpath(py_file)
            if numba.config.CACHE_DIR:
                self._cache_path = os.path.join(numba.config.CACHE_DIR, sub)
            else:
                self._cache_path = os.path.join(os.path.dirname(py_file), "__pycache__")

        def get_cache_path(self):
            return self._cache_path

        def get_source_stamp(self):
            return sources_hash()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            if not os.path.exists(py_file):
                return None
            self = cls(py_func, py_file)
            try:
                self.ensure_cache_path()
            except OSError:             # read-only install: numba's user-wide folder
                user = os.path.join(os.path.expanduser("~"), ".cache", "numba",
                                    cls.get_suitable_cache_subpath(py_file))
                self._cache_path = user
                try:
                    self.ensure_cache_path()
                except OSError:
                    return None
            return self

    class PackageSourcesImpl(base_impl):
        _locator_classes = [PackageSourcesLocator]

    class PackageSourcesCache(base_cache):
        _impl_class = PackageSourcesImpl

    return PackageSourcesCache


_CACHE_CLASS = _make_cache_class()
_warned = False


def kernel(**options):
    """Decorator: numba.njit(fastmath=False, nogil=True, error_model="numpy", **options)
    with the package cache. error_model="numpy": a float division by zero gives inf/nan
    instead of a branch that raises ZeroDivisionError (the branch stops LLVM from
    vectorising the loop around it).

    options are njit's (parallel=True for kernels with prange). Callers pass the thread
    count explicitly (threads.get_threads()); a kernel must not call
    numba.get_num_threads() itself - that reads a ctypes pointer, which numba cannot
    cache."""
    for bad in ("cache", "fastmath"):
        if bad in options:
            raise TypeError(f"kernel(): '{bad}' is fixed by genie_rt.cpu.jit, do not pass it")

    def wrap(fn):
        options.setdefault("error_model", "numpy")
        disp = numba.njit(fastmath=False, nogil=True, cache=False, **options)(fn)
        global _warned
        if _CACHE_CLASS is None:
            if not _warned:
                warnings.warn("genie_rt.cpu: this numba's caching internals are unknown; CPU kernels "
                              "compile without a disk cache (slow first calls)", RuntimeWarning, 2)
                _warned = True
            return disp
        try:
            disp._cache = _CACHE_CLASS(disp.py_func)
        except Exception as e:   # no writable folder anywhere: compile every time
            if not _warned:
                warnings.warn(f"genie_rt.cpu: no disk cache for CPU kernels ({e})", RuntimeWarning, 2)
                _warned = True
        return disp

    return wrap


def cache_dir() -> str | None:
    """Where the kernels of this package are cached (None without a disk cache)."""
    if _CACHE_CLASS is None:
        return None
    loc = _CACHE_CLASS._impl_class._locator_classes[0].from_function(kernel, __file__)
    return None if loc is None else loc.get_cache_path()


def cache_is_empty() -> bool:
    """True when no kernel of this package is in the disk cache yet (a first use: every
    kernel a model runs compiles, minutes on a small machine), or there is no cache."""
    folder = cache_dir()
    return not folder or not any(Path(folder).glob("*.nbi"))


@contextlib.contextmanager
def watch_compiles(on_compiled=None):
    """Within the block, call on_compiled(name) as each function finishes compiling, and
    yield the list of their names. Counts numba's "numba:compile" events at the outermost
    level (a kernel's helpers compile inside it); a load from the disk cache is no compile.
    Without numba's event API (numba.core.event, numba >= 0.53) it reports nothing."""
    names: list[str] = []
    try:
        from numba.core import event
    except ImportError:
        yield names
        return
    depth = [0]

    class Listener(event.Listener):
        def on_start(self, ev):
            depth[0] += 1

        def on_end(self, ev):
            depth[0] -= 1
            if depth[0] == 0:
                disp = (ev.data or {}).get("dispatcher")
                name = getattr(getattr(disp, "py_func", None), "__name__", "?")
                names.append(name)
                if on_compiled is not None:
                    on_compiled(name)

    with event.install_listener("numba:compile", Listener()):
        yield names


__all__ = ["kernel", "sources_hash", "cache_dir", "cache_is_empty", "watch_compiles", "PACKAGE_DIR"]
