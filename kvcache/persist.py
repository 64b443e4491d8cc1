"""Persistent KV per conversation: save a turn's cache, hydrate it at the next turn.

    store = KVStore("/var/cache/genie-kv", budget_bytes=1 << 30)
    n = store.restore(engine, "kitchen-1", prompt, n_in_memory)   # at the start of a turn
    store.save(engine, "kitchen-1")                               # at the end of a turn

One file per conversation, `<folder>/<id>.kv` (format: kvcache/kvfile.py). restore()
hydrates the longest common prefix of the file's tokens and the new prompt into the
pool when that beats what the pool already holds; save() writes the pool's used
positions and their token ids.

Policy, and why it is safe:
- A file that does not validate (truncated, corrupt, another model, another KV dtype
  or shape, unknown version, absurd sizes, a symlink) is logged with the reason,
  deleted, and the request runs cold. restore() never raises for a file.
- Writes are atomic: a temp file in the same folder (O_EXCL, 0600), fsync, rename over
  the old file, fsync of the folder. A process killed at any point leaves the old file
  or the new one; a torn temp file is never read (and fails its digests if it were).
  Temp files of dead processes are removed when a store opens the folder.
- Conversation ids are `[A-Za-z0-9_-]{1,64}` (`InvalidConversationId` otherwise), so a
  path is always `<folder>/<id>.kv`, never a separator, `..` or an absolute path;
  entries that are symlinks are never followed.
- A size budget (default 1 GiB) evicts least-recently-used files after each save; the
  file just written is never evicted. "Used" = mtime, set on save and on restore.

Deliberately not here: locking between processes sharing a folder (last rename wins,
each file stays valid), incremental (append-only) saves, GPU code - the pools'
export_window / import_window do the device copies (`export_kv` / `import_kv` below).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import kvfile
from .kvfile import KVFileError, KVFileMeta

log = logging.getLogger("genie_rt.kvcache")

DEFAULT_BUDGET = 1 << 30
SUFFIX = ".kv"
STALE_TEMP_SECONDS = 3600          # a temp file this old is stale even if its pid is alive (pid reuse)
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TEMP = re.compile(r"\.([A-Za-z0-9_-]{1,64})\.(\d{1,10})\.[0-9a-f]{8}\.tmp")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WRITE_SLICE = 8 << 20


class InvalidConversationId(ValueError):
    """A conversation id outside [A-Za-z0-9_-]{1,64} (the server answers 400)."""


def validate_conversation_id(cid) -> str:
    if not isinstance(cid, str) or not _ID.fullmatch(cid):
        shown = repr(cid) if not isinstance(cid, str) or len(cid) <= 80 else repr(cid[:80]) + "..."
        raise InvalidConversationId(f"conversation id {shown} is invalid: use 1 to 64 characters "
                                    "from A-Z, a-z, 0-9, '_' and '-'")
    return cid


def model_fingerprint(gfile) -> bytes:
    """blake2b-256 over the GGUF's size, its header (metadata + tensor table) and 16
    evenly spaced 4 KiB samples of its tensor data: same file -> same fingerprint;
    another model, quantization or fine-tune with the same tensor table -> another.
    Reads header + 64 KiB, once per engine."""
    h = hashlib.blake2b(digest_size=kvfile.DIGEST_BYTES, person=b"genie-kv-model")
    h.update(int(gfile.file_size).to_bytes(8, "little"))
    h.update(gfile.fingerprint_bytes())
    start, end = int(gfile.data_offset), int(gfile.file_size)
    with open(gfile.path, "rb") as f:
        for i in range(16):
            f.seek(start + max(0, end - start - 4096) * i // 15)
            h.update(f.read(4096))
    return h.digest()


def _pid_alive(pid: int) -> bool:
    if not 0 < pid < 1 << 22:          # never os.kill(0 or -1, ...): those mean process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                    # EPERM: someone else's live process
        return True
    return True


def _write_all(fd: int, data: memoryview) -> None:
    """Write every byte (in slices; os.write may write less than asked)."""
    for start in range(0, len(data), _WRITE_SLICE):
        part = data[start:start + _WRITE_SLICE]
        while len(part):
            part = part[os.write(fd, part):]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _common_prefix(tokens: np.ndarray, prompt: list[int]) -> int:
    m = min(len(tokens), len(prompt))
    diff = np.flatnonzero(tokens[:m].astype(np.int64) != np.asarray(prompt[:m], np.int64))
    return int(diff[0]) if len(diff) else m


@dataclass(frozen=True)
class KVEntry:
    """A conversation file in the folder (not yet validated)."""
    id: str
    path: Path
    size: int
    mtime: float


class KVStore:
    def __init__(self, folder: str | os.PathLike, budget_bytes: int = DEFAULT_BUDGET, create: bool = True):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"KV cache budget must be a byte count >= 0, got {budget_bytes!r}")
        self.folder = Path(folder).expanduser().resolve()
        if create:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.folder.exists() and not self.folder.is_dir():
            raise ValueError(f"KV cache folder {self.folder} is not a folder")
        self.budget_bytes = budget_bytes
        self._fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.n_stale_removed = self._remove_stale_temps() if self.folder.is_dir() else 0

    def path_for(self, cid: str) -> Path:
        path = self.folder / f"{validate_conversation_id(cid)}{SUFFIX}"
        if path.parent != self.folder:  # cannot happen with a valid id; checked anyway
            raise InvalidConversationId(f"conversation id {cid!r} resolves outside {self.folder}")
        return path

    def fingerprint(self, engine) -> bytes:
        fp = self._fingerprints.get(engine)
        if fp is None:
            fp = self._fingerprints[engine] = model_fingerprint(engine.gfile)
        return fp

    # -- the engine's hooks -------------------------------------------------------
    def restore(self, engine, conversation_id: str, prompt: list[int], n_in_memory: int) -> int:
        """Hydrate the file's longest common prefix with `prompt` (at most len(prompt)-1
        positions) into engine.backend.kv when it beats `n_in_memory`; set
        engine.kv_tokens and return that length, else return 0. Raises only
        InvalidConversationId (and back-end errors while importing into the pool)."""
        path = self.path_for(conversation_id)
        loaded = self._load(engine, path, prompt, n_in_memory)
        if loaded is None:
            return 0
        tokens, arrays, meta = loaded
        n = len(tokens)
        engine.kv_tokens = []                     # the pool's positions are being replaced
        first = import_kv(engine.backend, arrays, meta, n)
        engine.backend.kv_imported(first, n)
        engine.kv_tokens = tokens
        log.info("kv cache %s: restored %d positions", path.name, n)
        return n

    def save(self, engine, conversation_id: str) -> bool:
        """Write engine.kv_tokens and their K/V atomically; evict over budget. Returns
        whether a file was written. Raises only InvalidConversationId: a full disk, a
        read-only folder or a failing export is logged and the old file stays."""
        path = self.path_for(conversation_id)
        tokens = list(engine.kv_tokens)
        if not tokens:
            return False
        try:
            sh = engine.backend.kv.shape
            arrays, rings, first = export_kv(engine.backend, len(tokens))
            chunks = kvfile.encode(arrays, tokens, fingerprint=self.fingerprint(engine),
                                   model=Path(engine.gfile.path).name, kv_dtype=sh.dtype, n_layers=sh.n_layers,
                                   n_kv_heads=sh.n_kv_heads, head_dim=sh.head_dim, ring_layers=rings,
                                   ring_first=first)
        except Exception:
            log.exception("kv cache %s: cannot export the KV pool; not saved", path.name)
            return False
        if not self._write_atomic(path, chunks):
            return False
        self.evict(keep=path)
        return True

    # -- reading ------------------------------------------------------------------
    def _load(self, engine, path: Path, prompt: list[int], n_in_memory: int):
        """(tokens, arrays) worth hydrating, or None. Never raises for the file."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kv cache %s: cannot stat (%s); running cold", path.name, exc)
            return None
        if stat.S_ISLNK(st.st_mode):
            self._reject(path, st, "is a symbolic link (never followed)")
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("kv cache %s: not a regular file; ignored (left in place)", path.name)
            return None
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        except OSError as exc:   # ELOOP: replaced by a symlink since lstat
            log.warning("kv cache %s: cannot open (%s); running cold", path.name, exc)
            if exc.errno == errno.ELOOP:
                self._reject(path, None, "is a symbolic link (never followed)")
            return None
        with os.fdopen(fd, "rb", buffering=0) as f:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise KVFileError("not a regular file")
                meta = kvfile.read_header(f, st.st_size)
                self._check_model(engine, meta)
                n = min(_common_prefix(meta.tokens, prompt), len(prompt) - 1, engine.backend.kv.shape.n_ctx)
                if meta.ring_layers:
                    # the first new token needs its window of every windowed layer (positions
                    # n - W + 1 .. n - 1); the file holds those layers from ring_first on
                    windows = [engine.cfg.window(i) for i in meta.ring_layers]
                    if None in windows:
                        raise KVFileError(f"layers {list(meta.ring_layers)} are stored as windows but "
                                          "this model's layers there are not sliding-window layers")
                    if n - min(windows) + 1 < meta.ring_first and n > 0:
                        log.info("kv cache %s: %d matching positions, but the file's windowed layers "
                                 "start at %d; running cold", path.name, n, meta.ring_first)
                        return None
                self._touch(path)
                if n <= n_in_memory:
                    log.debug("kv cache %s: %d matching positions, the pool already holds %d",
                              path.name, n, n_in_memory)
                    return None
                arrays = kvfile.read_body(f, meta, n)
                return [int(t) for t in meta.tokens[:n]], arrays, meta
            except KVFileError as exc:
                self._reject(path, st, str(exc))
            except (OSError, MemoryError) as exc:
                log.warning("kv cache %s: cannot be read (%s); running cold", path.name, exc)
            except Exception:   # a bug here must not take the request down
                log.exception("kv cache %s: unexpected error while loading; running cold", path.name)
        return None

    def _check_model(self, engine, meta: KVFileMeta) -> None:
        if meta.fingerprint != self.fingerprint(engine):
            raise KVFileError(f"saved by another model ('{meta.model}' with a different fingerprint)")
        sh = engine.backend.kv.shape
        mine = (sh.dtype, sh.n_layers, sh.n_kv_heads, sh.head_dim)
        theirs = (meta.kv_dtype, meta.n_layers, meta.n_kv_heads, meta.head_dim)
        if theirs != mine:
            raise KVFileError(f"KV dtype/layers/kv heads/head dim {theirs} differ from the pool's {mine}")

    def _reject(self, path: Path, st: os.stat_result | None, why: str) -> None:
        """Log why, delete the entry (the one that was examined, not a newer one)."""
        done = "deleted"
        try:
            now = os.lstat(path)
            if st is None or (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            done = f"could not delete it ({exc.strerror or exc})"
        log.warning("kv cache %s: %s; %s, running cold", path.name, why, done)

    @staticmethod
    def _touch(path: Path) -> None:
        try:
            os.utime(path, follow_symlinks=False)
        except OSError:
            pass

    # -- writing ------------------------------------------------------------------
    def _write_atomic(self, path: Path, chunks: list[memoryview]) -> bool:
        tmp = self.folder / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd, renamed = None, False
        try:
            if not self.folder.is_dir() and not self.folder.is_symlink():
                # removed while the server ran (a cleanup, `rm -rf`): made again, not lost for good
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                log.warning("kv cache folder %s was missing; created it again", self.folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
            for chunk in chunks:
                _write_all(fd, chunk)
            os.fsync(fd)
            os.close(fd)
            fd = None
            os.replace(tmp, path)       # atomic: readers see the old file or the new one
            renamed = True
            _fsync_dir(self.folder)     # make the rename itself durable
            return True
        except OSError as exc:
            if renamed:
                log.warning("kv cache %s: saved, but syncing the folder failed (%s)", path.name, exc)
                return True
            log.error("kv cache %s: not saved (%s); the previous file, if any, is kept", path.name, exc)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def _remove_stale_temps(self) -> int:
        """Remove temp files left by killed processes (dead pid, or older than an hour)."""
        n = 0
        now = time.time()
        for name in os.listdir(self.folder):
            m = _TEMP.fullmatch(name)
            if not m:
                continue
            path = self.folder / name
            try:
                st = os.lstat(path)
                if _pid_alive(int(m.group(2))) and now - st.st_mtime < STALE_TEMP_SECONDS:
                    continue
                os.unlink(path)
                n += 1
                log.info("kv cache: removed stale temp file %s", name)
            except OSError:
                pass
        return n

    # -- the folder -----------------------------------------------------------------
    def entries(self) -> list[KVEntry]:
        """Regular `<id>.kv` files, least recently used first."""
        out = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        for name in names:
            cid = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
            if not _ID.fullmatch(cid):
                continue
            try:
                st = os.lstat(self.folder / name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(KVEntry(cid, self.folder / name, st.st_size, st.st_mtime))
        return sorted(out, key=lambda e: (e.mtime, e.id))

    def evict(self, keep: Path | None = None) -> list[str]:
        """Delete least-recently-used files until the total fits the budget; never `keep`."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed = []
        for e in entries:
            if total <= self.budget_bytes:
                break
            if e.path == keep:
                continue
            try:
                os.unlink(e.path)
            except OSError:
                continue
            total -= e.size
            removed.append(e.id)
            log.info("kv cache: evicted %s (%d bytes, least recently used)", e.path.name, e.size)
        if total > self.budget_bytes:
            log.warning("kv cache: %d bytes on disk exceed the budget of %d (the newest file alone is larger)",
                        total, self.budget_bytes)
        return removed

    def remove(self, cid: str) -> bool:
        path = self.path_for(cid)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def clear(self) -> int:
        n = 0
        for e in self.entries():
            try:
                os.unlink(e.path)
                n += 1
            except OSError:
                pass
        return n

    def inspect(self, cid: str) -> tuple[KVFileMeta | None, str]:
        """(header or None, validation verdict) without modifying anything."""
        path = self.path_for(cid)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None, "no such conversation"
        if stat.S_ISLNK(st.st_mode):
            return None, "invalid: a symbolic link (would be deleted on use)"
        if not stat.S_ISREG(st.st_mode):
            return None, "invalid: not a regular file"
        meta = None
        try:
            with open(path, "rb", buffering=0, opener=lambda p, fl: os.open(p, fl | _NOFOLLOW | _CLOEXEC)) as f:
                meta = kvfile.read_header(f, os.fstat(f.fileno()).st_size)
                kvfile.verify_body(f, meta)
        except KVFileError as exc:
            return meta, f"invalid: {exc}"
        except OSError as exc:
            return meta, f"unreadable: {exc}"
        return meta, "ok: header and body checksums match (the model is checked when a request loads it)"


# -- between a back-end's pool and a file's arrays ---------------------------------------------
def export_kv(backend, n: int):
    """(arrays, ring layers, ring_first) of positions 0 .. n-1 for kvfile.encode: the pool's
    full layers as k, v (, scales); its sliding-window rings ("r" arrays) from the first
    position every ring still holds."""
    kv = backend.kv
    sh = kv.shape
    rings = list(sh.ring_layers) if sh.slots is not None else []
    full = [i for i in range(sh.n_layers) if i not in rings]
    _, arrays = kv.export_window(n, layers=full, first=0)
    first = 0
    if rings:
        first = backend.ring_first(n)
        _, ring = kv.export_window(n, layers=rings, first=first)
        arrays.update({"r" + name: a for name, a in ring.items()})
    return arrays, rings, first


def import_kv(backend, arrays: dict, meta, n: int) -> int:
    """Put positions 0 .. n-1 of a file's arrays into the back-end's pool, each layer as much
    as it holds (a ring: its last slots); returns the first position the rings now hold."""
    kv = backend.kv
    sh = kv.shape
    file_rings = set(meta.ring_layers)
    groups: dict[tuple, list[int]] = {}     # (file part, first position imported) -> layers
    for i in range(sh.n_layers):
        stored_from = meta.ring_first if i in file_rings else 0
        first = max(stored_from, n - sh.layer_slots(i))
        groups.setdefault(("r" if i in file_rings else "", first), []).append(i)
    index = {"": [i for i in range(sh.n_layers) if i not in file_rings], "r": sorted(file_rings)}
    ring_first = 0
    for (part, first), layers in groups.items():
        rows = [index[part].index(i) for i in layers]
        offset = meta.ring_first if part == "r" else 0      # the file array's first position
        names = [k for k in arrays if (k.startswith("r") if part == "r" else not k.startswith("r"))]
        window = {k.removeprefix(part) if part else k: np.asarray(arrays[k])[rows, first - offset:n - offset]
                  for k in names}
        kv.import_window(window, first, n, layers=layers)
        if sh.slots is not None and any(sh.is_ring(i) for i in layers):
            ring_first = max(ring_first, first)
    return ring_first
