"""Kernel cache entries on disk: one key folder, checked reads, atomic writes, pruning.

    <root>/<key>/key.json                  what the key was made of
    <root>/<key>/last-run.json             hits, misses and seconds of the last load
    <root>/<key>/<kernel>.<entry>.kc       MAGIC, u32 header length, JSON header, payload

The header names the format, the folder key, the entry hash, the payload length and
its SHA-256; `decode_entry` checks them all, so a truncated, garbled or misplaced file
is refused (and `EntryStore.load` deletes it). A write goes to a temporary file in the
same folder, is fsynced and renamed into place: two processes writing one entry both
leave a whole file (the last rename wins), and a reader never sees half of one. A
folder that cannot be written (read-only, full disk) gives one warning per process and
the store stops writing; reading still works (a read-only image can ship a filled cache).
Entries are code the process runs, so a key folder that another user (not root) owns or
that group or others may write is not used at all (one warning); folders are made 0700.
Pruning keeps the most recently used KEEP_KEYS folders, never one used in the last
STALE_SECONDS, and deletes only the files this module writes (`cache clear` in a folder
the user named cannot remove anything else). The payload is opaque bytes here: what a
kernel becomes is engine/kernel_cache.py's business.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .kernel_key import FORMAT

log = logging.getLogger("genie_rt.kernel_cache")

MAGIC = b"GRTKC\x00\x01\n"       # 8 bytes
KEEP_KEYS = 3                    # key folders kept by pruning (the current one included)
STALE_SECONDS = 3600             # temp files and key folders younger than this are never deleted
ENV_VAR = "GENIE_RT_KERNEL_CACHE"
_KEY_RE = re.compile(r"[0-9a-f]{20}")
_OURS = re.compile(r"(key\.json|last-run\.json|[A-Za-z0-9_.-]+\.[0-9a-f]{24}\.kc|\..+\.tmp)")


@dataclass
class CacheStats:
    lookups: int = 0             # every new specialisation numba asked for (cache on or off)
    hits: int = 0
    misses: int = 0              # compiled (the cache was consulted and had nothing usable)
    rejected: int = 0            # corrupt, truncated or unloadable entries deleted
    saved: int = 0
    uncachable: int = 0          # compiled kernels that could not be stored (NRT, ...)
    load_seconds: float = 0.0    # reading, checking and loading hits
    compile_seconds: float = 0.0  # numba's compile of the misses


STATS = CacheStats()
_warned: set[str] = set()


def warn_once(what: str, msg: str, *args) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(msg, *args)


class EntryStore:
    """One key folder: checked reads, atomic writes, one warning when it cannot write."""

    def __init__(self, root: Path, key: str, components: dict | None = None):
        self.root, self.key, self.folder = Path(root), key, Path(root) / key
        self.components = components
        self.writable = True
        self.write_error: str | None = None     # why writing stopped (warned at the first save)
        self.trusted = True                     # False: others may write here; never loaded from
        self._prepared = False

    def path(self, name: str, entry: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "kernel"
        return self.folder / f"{safe}.{entry[:24]}.kc"

    def prepare(self) -> None:
        """First use: create the folder, check who may write it, describe the key, prune
        old keys and dead temps."""
        if self._prepared:
            return
        self._prepared = True
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(self.folder):
                self.trusted = self.writable = False
                warn_once("trust", "kernel cache: %s may be written by other users; it is not used (entries "
                          "are code that this process would run: chmod go-w it, or choose another folder)",
                          self.folder)
                return
            if self.components is not None and not (self.folder / "key.json").exists():
                self._write_atomic(self.folder / "key.json", json.dumps(
                    {"key": self.key, "created": time.time(), **self.components}, indent=1).encode())
            os.utime(self.folder)                   # last used: pruning keeps the newest
        except OSError as exc:          # read-only: entries may still be read; warn if one must be written
            self.writable, self.write_error = False, exc.strerror or str(exc)
            return
        remove_ours(self.folder, only_temps_older_than=STALE_SECONDS)
        prune(self.root, keep=KEEP_KEYS, protect=self.key)

    def load(self, name: str, entry: str) -> bytes | None:
        self.prepare()
        if not self.trusted:
            return None
        path = self.path(name, entry)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            warn_once("read", "kernel cache: cannot read %s (%s); compiling instead", path, exc)
            return None
        payload, why = decode_entry(blob, self.key, entry)
        if payload is None:
            self.reject(path, why)
        return payload

    def reject(self, path: Path, why: str) -> None:
        STATS.rejected += 1
        log.warning("kernel cache: %s is unusable (%s); deleted, the kernel is recompiled", path.name, why)
        try:
            path.unlink()
        except OSError:
            pass

    def save(self, name: str, entry: str, payload: bytes) -> bool:
        self.prepare()
        if not self.trusted:
            return False
        if not self.writable:
            self._warn_unwritable()
            return False
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)   # a pruner may have removed it
            self._write_atomic(self.path(name, entry), encode_entry(payload, self.key, entry, name))
        except OSError as exc:
            self.writable, self.write_error = False, exc.strerror or str(exc)
            self._warn_unwritable()
            return False
        STATS.saved += 1
        return True

    def _write_atomic(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _warn_unwritable(self) -> None:
        warn_once("write", "kernel cache: cannot write to %s (%s); kernels that are not cached are "
                  "compiled in memory this run (point --kernel-cache or %s at a writable folder, "
                  "or switch it off)", self.folder, self.write_error, ENV_VAR)


def encode_entry(payload: bytes, key: str, entry: str, name: str) -> bytes:
    header = json.dumps({"format": FORMAT, "key": key, "entry": entry, "name": name,
                         "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_entry(blob: bytes, key: str, entry: str) -> tuple[bytes | None, str]:
    """(payload, "") if the file is whole and belongs to (key, entry), else (None, why)."""
    n = len(MAGIC) + 4
    if len(blob) < n or not blob.startswith(MAGIC):
        return None, "not a kernel cache entry, or truncated"
    (hlen,) = struct.unpack("<I", blob[len(MAGIC):n])
    try:
        h = json.loads(blob[n:n + hlen])
        ok = isinstance(h, dict)
    except ValueError:
        ok = False
    if not ok or len(blob) < n + hlen:
        return None, "header unreadable"
    payload = blob[n + hlen:]
    if h.get("format") != FORMAT or h.get("key") != key or h.get("entry") != entry:
        return None, "written for another key"
    if h.get("bytes") != len(payload):
        return None, f"truncated ({len(payload)} of {h.get('bytes')} payload bytes)"
    if h.get("sha256") != hashlib.sha256(payload).hexdigest():
        return None, "checksum mismatch"
    return payload, ""


def _is_ours(p: Path) -> bool:
    return p.is_file() and _OURS.fullmatch(p.name) is not None


def remove_ours(folder: Path, only_temps_older_than: float | None = None) -> int:
    """Delete this module's files in one key folder (or only old temp files); then the
    folder itself if that emptied it. Anything else in it is left alone."""
    n, now = 0, time.time()
    try:
        items = list(folder.iterdir())
    except OSError:
        return 0
    for p in items:
        try:
            if not _is_ours(p):
                continue
            if only_temps_older_than is not None and not (
                    p.name.endswith(".tmp") and now - p.stat().st_mtime > only_temps_older_than):
                continue
            p.unlink()
            n += 1
        except OSError:
            pass
    if only_temps_older_than is None:
        try:
            folder.rmdir()
        except OSError:
            pass
    return n


def key_folders(root: Path) -> list[Path]:
    try:
        return [p for p in Path(root).iterdir() if p.is_dir() and _KEY_RE.fullmatch(p.name)]
    except OSError:
        return []


def prune(root: Path, keep: int = KEEP_KEYS, protect: str | None = None) -> list[str]:
    """Delete all but the `keep` most recently used key folders (never `protect`, never
    one used in the last STALE_SECONDS: another process may be loading from it)."""
    others = sorted((p for p in key_folders(root) if p.name != protect), key=_mtime, reverse=True)
    budget, removed, now = keep - (protect is not None), [], time.time()
    for i, p in enumerate(others):
        if i >= budget and now - _mtime(p) >= STALE_SECONDS:
            remove_ours(p)
            removed.append(p.name)
    return removed


def _private(folder: Path) -> bool:
    """Owned by this user (or root) and not writable by group or others."""
    st = folder.stat()
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:                     # removed meanwhile by another process
        return time.time()
