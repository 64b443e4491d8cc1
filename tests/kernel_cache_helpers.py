"""What the kernel-cache tests share (test_kernel_key.py, test_kernel_store.py,
test_kernel_cache.py, test_kernel_cache_cli.py): paths, a key, the log's warnings, a child
process without the simulator, a copy of the packages, stand-in numba dispatchers, an
entry store in a temporary folder, and `fresh_state`, the autouse fixture each of those
modules imports (the cache's configuration and counters reset around every test).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from genie_rt.engine import kernel_cache
from genie_rt.engine.kernel_store import EntryStore

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "qwen3-micro-q4km.gguf"
KEY = "0123456789abcdef0123"
LOG = "genie_rt.kernel_cache"


@pytest.fixture(autouse=True)
def fresh_state():
    kernel_cache.configure(None)
    kernel_cache.reset()
    yield
    kernel_cache.configure(None)
    kernel_cache.reset()


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(extra)
    return env


def warnings_of(caplog, text: str) -> list:
    return [r for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING and text in r.getMessage()]



def copy_package(dest: Path) -> Path:
    """A copy of the genie_rt packages at dest/genie_rt (a regular package, so it wins
    over the editable install when dest is first on sys.path)."""
    pkg = dest / "genie_rt"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for sub in ("engine", "quant", "kvcache", "server"):
        shutil.copytree(ROOT / sub, pkg / sub, ignore=shutil.ignore_patterns("__pycache__", "data"))
    return pkg


class Dispatcher:
    """The two attributes of a numba dispatcher that the entry hash reads."""

    def __init__(self, fn, **options):
        self.py_func = fn
        self.targetoptions = {"fastmath": False, "max_registers": None, **options}


def make_kernel(n, scale=1.0, dev=None):
    def kernel(x):
        x[0] = n * scale + (dev(x) if dev is not None else 0)
    return kernel


def store(tmp_path, key=KEY) -> EntryStore:
    return EntryStore(tmp_path / "cache", key, {"sources": "s", "toolchain": {"cc": "8.7"}})
