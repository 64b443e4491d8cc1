"""engine/kernel_store.py: cache entries on disk.

Checked on the CPU: every corruption of an entry (truncation at each boundary, flipped
bytes, a garbled header, a file from another key) is refused, deleted and rebuilt; a
read-only or full disk and an unwritable folder give one warning and no failure; a folder
others may write is not used; two processes writing one entry (with a reader in between)
leave a valid one; pruning keeps the newest keys and never deletes foreign files.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest

from genie_rt.engine import kernel_store
from genie_rt.engine.kernel_store import STATS, EntryStore, decode_entry, encode_entry
from kernel_cache_helpers import KEY, child_env, fresh_state, store, warnings_of  # noqa: F401


# =====================================================================================
# Entries on disk
# =====================================================================================
ENTRY = "e" * 64


def test_round_trip_and_layout(tmp_path):
    st = store(tmp_path)
    assert st.load("gemv_kernel.gemv", ENTRY) is None
    assert st.save("gemv_kernel.gemv", ENTRY, b"payload" * 100)
    assert st.load("gemv_kernel.gemv", ENTRY) == b"payload" * 100
    files = sorted(p.name for p in st.folder.iterdir())
    assert files == ["gemv_kernel.gemv.eeeeeeeeeeeeeeeeeeeeeeee.kc", "key.json"]
    assert json.loads((st.folder / "key.json").read_text())["key"] == KEY
    assert (st.folder.stat().st_mode & 0o777) == 0o700


def blob_cuts():
    blob = encode_entry(b"x" * 1000, KEY, ENTRY, "k")
    hdr = len(kernel_store.MAGIC) + 4 + int.from_bytes(blob[8:12], "little")
    return blob, [0, 3, 8, 11, 12, hdr - 1, hdr, hdr + 1, len(blob) - 1]


def test_decode_refuses_every_truncation():
    blob, cuts = blob_cuts()
    assert decode_entry(blob, KEY, ENTRY) == (b"x" * 1000, "")
    for n in cuts:
        payload, why = decode_entry(blob[:n], KEY, ENTRY)
        assert payload is None and why, n


def test_decode_refuses_flipped_bytes_anywhere():
    blob, _ = blob_cuts()
    for i in range(0, len(blob), 7):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        payload, _ = decode_entry(bytes(bad), KEY, ENTRY)
        assert payload is None, i


def test_decode_refuses_another_key_or_entry_or_format():
    blob, _ = blob_cuts()
    assert decode_entry(blob, "f" * 20, ENTRY)[0] is None
    assert decode_entry(blob, KEY, "d" * 64)[0] is None
    other = blob.replace(b'"format": 1', b'"format": 9')
    assert decode_entry(other, KEY, ENTRY)[0] is None


@pytest.mark.parametrize("damage", ["empty", "truncated_header", "truncated_payload", "flipped",
                                    "garbage", "other_key"])
def test_bad_entry_on_disk_is_deleted_and_rebuilt(tmp_path, caplog, damage):
    st = store(tmp_path)
    st.save("k", ENTRY, b"good" * 500)
    path = st.path("k", ENTRY)
    blob = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated_header":
        path.write_bytes(blob[:20])
    elif damage == "truncated_payload":
        path.write_bytes(blob[:-1])
    elif damage == "flipped":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(blob)))
    else:
        path.write_bytes(encode_entry(b"good" * 500, "f" * 20, ENTRY, "k"))
    assert st.load("k", ENTRY) is None
    assert not path.exists() and STATS.rejected == 1
    assert len(warnings_of(caplog, "unusable")) == 1
    assert st.save("k", ENTRY, b"good" * 500) and st.load("k", ENTRY) == b"good" * 500


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_unwritable_folder_gives_one_warning_and_no_failure(tmp_path, caplog, monkeypatch, err):
    st = store(tmp_path)
    st.save("old", ENTRY, b"cached")                                      # filled before it went read-only

    def refuse(*a, **k):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(kernel_store.os, "fsync", refuse)                # the write fails mid-way
    for i in range(5):
        assert st.save(f"k{i}", ENTRY, b"new") is False
    assert len(warnings_of(caplog, "cannot write")) == 1
    assert not [p for p in st.folder.iterdir() if p.name.endswith(".tmp")]   # no half files left
    assert st.load("old", ENTRY) == b"cached"                           # what is there is still served


def test_read_only_folder_with_entries_serves_them_without_a_warning(tmp_path, caplog, monkeypatch):
    st = store(tmp_path)
    st.save("k", ENTRY, b"cached")

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(kernel_store.os, "utime", refuse)
    monkeypatch.setattr(kernel_store.tempfile, "mkstemp", refuse)
    ro = store(tmp_path)
    assert ro.load("k", ENTRY) == b"cached"
    assert not warnings_of(caplog, "cannot write")                       # nothing had to be written
    assert ro.save("k2", ENTRY, b"x") is False
    assert len(warnings_of(caplog, "cannot write")) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_really_read_only_folder(tmp_path, caplog):
    st = store(tmp_path)
    st.save("k", ENTRY, b"cached")
    os.chmod(st.folder, 0o500)
    try:
        ro = store(tmp_path)
        assert ro.load("k", ENTRY) == b"cached"
        assert ro.save("k2", ENTRY, b"x") is False and ro.save("k3", ENTRY, b"x") is False
        assert len(warnings_of(caplog, "cannot write")) == 1
    finally:
        os.chmod(st.folder, 0o700)


def test_root_that_is_a_file_gives_one_warning(tmp_path, caplog):
    (tmp_path / "cache").write_text("not a folder")
    st = store(tmp_path)
    assert st.load("k", ENTRY) is None
    assert st.save("k", ENTRY, b"x") is False and st.save("k2", ENTRY, b"x") is False
    assert len(warnings_of(caplog, "cannot write")) == 1


def test_folder_others_may_write_is_not_used(tmp_path, caplog):
    st = store(tmp_path)
    st.save("k", ENTRY, b"cached")
    os.chmod(st.folder, 0o777)
    shared = store(tmp_path)
    assert shared.load("k", ENTRY) is None and shared.save("k", ENTRY, b"x") is False
    assert len(warnings_of(caplog, "other users")) == 1
    assert st.path("k", ENTRY).exists()                                   # nothing deleted either


_WRITER = """
import hashlib, sys
from pathlib import Path
from genie_rt.engine.kernel_store import EntryStore
root, who, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
st = EntryStore(root, "0123456789abcdef0123", {"sources": "s"})
bad = 0
for i in range(n):
    if who == "reader":
        got = st.load("k", "e" * 64)
        if got is not None and not got.startswith((b"A", b"B")):
            bad += 1
    else:
        body = who.encode() * (300_000 + 997 * i)          # different sizes: a torn write would show
        st.save("k", "e" * 64, body)
from genie_rt.engine.kernel_store import STATS
print(bad, STATS.rejected)
"""


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    root = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), who, n], stdout=subprocess.PIPE,
                              text=True, env=child_env())
             for who, n in (("A", "25"), ("B", "25"), ("reader", "200"))]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[2] == ["0", "0"]                                          # the reader never saw a bad file
    st = EntryStore(root, KEY)
    final = st.load("k", ENTRY)
    assert final is not None and final[:1] in (b"A", b"B") and len(set(final)) == 1
    assert not [p for p in st.folder.iterdir() if p.name.endswith(".tmp")]


def test_pruning_keeps_the_newest_keys_and_only_deletes_our_files(tmp_path):
    root = tmp_path / "cache"
    now = time.time()
    ages = {0: 100, 1: 200, 8: 300, 2: 7200, 3: 7300, 4: 7400}           # seconds since last use
    for i, age in ages.items():
        old = EntryStore(root, f"{i:020x}", {"sources": "s"})
        old.save("k", ENTRY, b"x")
        if i == 4:
            (old.folder / "notes.txt").write_text("the user's")          # a foreign file
        os.utime(old.folder, (now - age,) * 2)
    (root / "unrelated").mkdir()
    fresh = EntryStore(root, f"{9:020x}", {"sources": "s"})
    fresh.prepare()
    left = sorted(p.name for p in kernel_store.key_folders(root))
    # the current one and the 2 newest (KEEP_KEYS = 3); 8 is beyond them but was used within
    # STALE_SECONDS (another process may be loading from it); 4 keeps the user's file only
    assert left == [f"{i:020x}" for i in (0, 1, 4, 8, 9)]
    assert [p.name for p in (root / f"{4:020x}").iterdir()] == ["notes.txt"]
    assert (root / "unrelated").is_dir()


def test_dead_writers_temp_files_are_removed_fresh_ones_kept(tmp_path):
    st = store(tmp_path)
    st.folder.mkdir(parents=True)
    old, new = st.folder / ".k.abc.kc.x1.tmp", st.folder / ".k.abc.kc.x2.tmp"
    old.write_bytes(b"half")
    new.write_bytes(b"half")
    os.utime(old, (time.time() - 2 * kernel_store.STALE_SECONDS,) * 2)
    st.prepare()
    assert not old.exists() and new.exists()
