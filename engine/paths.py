"""Where genie-rt keeps its files by default: one cache root, one folder per kind.

    cache_root()         $XDG_CACHE_HOME/genie-rt (an absolute XDG_CACHE_HOME), else ~/.cache/genie-rt
    models_dir()         $GENIE_RT_MODELS, else cache_root()/models   (the default model, pulled GGUFs)
    kv_dir()             cache_root()/kv              (`kv` and `--conversation` without --kv-cache-dir)
    conversations_dir()  cache_root()/conversations   (chat histories of `chat`/`run --conversation`)

The compiled-kernel cache (engine/kernel_cache.py) lives under the same root, in kernels/.
Nothing is created here: callers make a folder when they write to it.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "genie-rt"


def models_dir() -> Path:
    env = os.environ.get("GENIE_RT_MODELS", "")
    return Path(env).expanduser() if env else cache_root() / "models"


def kv_dir() -> Path:
    return cache_root() / "kv"


def conversations_dir() -> Path:
    return cache_root() / "conversations"
