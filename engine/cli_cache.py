"""`genie-rt cache info|clear` and `genie-rt warmup`: the compiled-kernel cache from the
command line (engine/kernel_cache.py is the cache itself).

    genie-rt cache info [--kernel-cache DIR] [--json]   folder, key, entries, size, last run
    genie-rt cache clear [--kernel-cache DIR]           delete every cached kernel
    genie-rt warmup -m MODEL [--ctx N] [--backend cuda] [engine options]
                                                        load once (compile + cache), exit 0

`warmup` is for image builds (JetPack) and a systemd `ExecStartPre=`: it loads the model
with the same engine options `serve` will get, which compiles and caches every kernel
and captures the graphs, then exits; the next `serve` loads cubins instead. On a machine
without a GPU (`--backend auto` choosing the CPU) it compiles the Numba CPU kernels into
their own disk cache (cpu/jit.py; `--kernel-cache` is for CUDA kernels) and exits 0.
`--kernel-cache DIR` / `--no-kernel-cache` (added to every command that loads a model)
move or disable the cache for that run. The long steps show their progress on stderr
(engine/progress.py; `-q` hides it).

It does not build the cache without loading a model: which kernels exist depends on the
model's shapes and types and on the engine options.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_kernel_cache_args(p: argparse.ArgumentParser) -> None:
    """--kernel-cache DIR / --no-kernel-cache, for every command that loads a model."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--kernel-cache", metavar="DIR", default=None,
                   help="folder of compiled CUDA kernels (default: $GENIE_RT_KERNEL_CACHE, else "
                        "$XDG_CACHE_HOME/genie-rt/kernels or ~/.cache/genie-rt/kernels)")
    g.add_argument("--no-kernel-cache", action="store_true",
                   help="compile every CUDA kernel at load and keep nothing on disk")


def apply_kernel_cache_args(args) -> None:
    """Configure the kernel cache from parsed arguments (before anything loads); without
    either flag: $GENIE_RT_KERNEL_CACHE or the default."""
    from . import kernel_cache
    folder = getattr(args, "kernel_cache", None)
    if getattr(args, "no_kernel_cache", False):
        kernel_cache.configure("off")
    elif folder is not None:
        d = Path(folder).expanduser()
        if not folder.strip() or (d.exists() and not d.is_dir()):
            raise ValueError(f"--kernel-cache {folder!r} is not a folder; name a folder (it is created "
                             "if missing) or use --no-kernel-cache")
        kernel_cache.configure(folder)
    else:
        kernel_cache.configure(None)


def add_commands(sub, add_model_args) -> None:
    """Register `cache` and `warmup` on the CLI's subparsers."""
    cache = sub.add_parser("cache", help="the compiled CUDA kernel cache: where it is, what it holds; clear it")
    cache.add_argument("action", choices=("info", "clear"))
    cache.add_argument("--kernel-cache", metavar="DIR", default=None,
                       help="the cache folder (default: $GENIE_RT_KERNEL_CACHE or ~/.cache/genie-rt/kernels)")
    cache.add_argument("--json", action="store_true", help="info as JSON")
    cache.set_defaults(func=cmd_cache)

    warm = sub.add_parser("warmup", help="load a model once to compile and cache its CUDA kernels, then exit "
                                         "(image builds, systemd ExecStartPre)")
    add_model_args(warm)
    warm.set_defaults(func=cmd_warmup)


# =====================================================================================
# cache info / clear
# =====================================================================================
def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _current_key() -> tuple[str | None, str]:
    """(this machine's key, or None without a usable GPU; the digest of the sources)."""
    from . import kernel_cache
    from .kernel_key import key_components, make_key, source_digest
    digest = source_digest()
    if kernel_cache._simulator():
        return None, digest
    try:
        from numba import cuda
        if not cuda.is_available():
            return None, digest
        return make_key(key_components(sources_digest=digest)), digest
    except Exception:
        return None, digest


def cache_info(folder: Path, current_key: str | None = None, sources: str | None = None) -> dict:
    """What a cache folder holds, per key folder (newest first)."""
    from .kernel_store import key_folders
    keys = []
    for d in key_folders(folder):
        entries = list(d.glob("*.kc"))
        size = 0
        for p in d.iterdir():
            try:
                size += p.stat().st_size
            except OSError:
                pass
        meta = _read_json(d / "key.json") or {}
        keys.append({"key": d.name, "entries": len(entries), "bytes": size, "used": d.stat().st_mtime,
                     "current": d.name == current_key,
                     "current_sources": sources is not None and meta.get("sources") == sources,
                     "toolchain": meta.get("toolchain"), "versions": meta.get("versions"),
                     "last_run": _read_json(d / "last-run.json")})
    keys.sort(key=lambda k: k["used"], reverse=True)
    return {"folder": str(folder), "current_key": current_key, "sources": sources, "keys": keys,
            "entries": sum(k["entries"] for k in keys), "bytes": sum(k["bytes"] for k in keys)}


def _print_info(info: dict, source: str, on: bool) -> None:
    mib = 1 << 20
    print(f"kernel cache: {info['folder']} ({source}{'' if on else '; the cache is OFF'})")
    if info["current_key"]:
        print(f"current key:  {info['current_key']} (this machine's GPU and toolchain)")
    else:
        print(f"current key:  unknown without a GPU here (sources {info['sources'][:12]})")
    print(f"key folders:  {len(info['keys'])}, {info['entries']} entries, {info['bytes'] / mib:.1f} MiB")
    for k in info["keys"]:
        mark = "current" if k["current"] else ("current sources" if k["current_sources"] else "")
        tc, vs = k["toolchain"] or {}, k["versions"] or {}
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(k["used"]))
        print(f"  {k['key']}  {mark:15s} {k['entries']:5d} entries {k['bytes'] / mib:8.1f} MiB  used {used}"
              f"  cc {tc.get('cc', '?')}  numba-cuda {vs.get('numba-cuda', '?')}")
        run = k["last_run"]
        if run:
            print(f"      last run: {run.get('hits', 0)} loaded in {run.get('load_seconds', 0):.1f} s, "
                  f"{run.get('misses', 0)} compiled in {run.get('compile_seconds', 0):.1f} s"
                  + (f", {run['rejected']} bad entries rebuilt" if run.get("rejected") else ""))


def cmd_cache(args) -> int:
    from . import kernel_cache
    from .kernel_store import key_folders, remove_ours
    if args.kernel_cache is not None:
        if not args.kernel_cache.strip():
            raise ValueError("--kernel-cache is empty: name the cache folder")
        folder, source, on = Path(args.kernel_cache).expanduser(), "--kernel-cache", True
    else:
        folder, source, on = kernel_cache.configured_root()
    if args.action == "info":
        key, digest = _current_key()
        info = cache_info(folder, key, digest)
        if args.json:
            print(json.dumps({**info, "source": source, "on": on}, indent=1))
        else:
            _print_info(info, source, on)
        return 0
    removed = files = 0
    for d in key_folders(folder):
        files += remove_ours(d)
        removed += 1
    left = [d.name for d in key_folders(folder)]
    print(f"kernel cache: removed {files} files in {removed} key folders from {folder}")
    if left:
        print(f"kernel cache: {len(left)} folders kept (they hold files this cache did not write): "
              + ", ".join(left), file=sys.stderr)
    return 0


# =====================================================================================
# warmup
# =====================================================================================
def cmd_warmup(args) -> int:
    from . import kernel_cache
    from .cli import _load
    t0 = time.perf_counter()
    engine = _load(args)
    seconds = time.perf_counter() - t0
    backend = engine.backend
    if backend.name != "cuda":
        from genie_rt.cpu.jit import cache_dir
        folder = cache_dir()
        print(f"warmup: {args.model} loaded on the {backend.name} back-end in {seconds:.1f} s; its Numba kernels "
              + (f"are in {folder}" if folder else "have no writable cache folder (every run compiles)")
              + " (the CUDA kernel cache is not used)")
        return 0
    dev = backend.device_info()
    print(f"warmup: {args.model} loaded on {dev.get('device', 'cuda')} with a {engine.n_ctx}-token context "
          f"in {seconds:.1f} s ({dev.get('graphs', 0)} graphs); {kernel_cache.run_summary()}")
    return 0
