"""kvcache/persist.py: crash safety and the folder.

Checked here: a process killed with SIGKILL at each point of a save leaves the old file
or the new one; stale temp files are removed at start; a full disk keeps the old file; a
folder removed while running is made again; a bad file that cannot be deleted is not
said to be; LRU eviction never evicts the newest file.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from genie_rt.kvcache import persist
from genie_rt.kvcache.persist import KVStore
from kv_persist_helpers import MODEL, engine, folder_files, saved  # noqa: F401  (engine, saved: fixtures)


# -- crash safety ------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.generate import GenerationRequest
    from genie_rt.engine.sampling import SamplingParams
    from genie_rt.kvcache import persist
    model, folder, target = sys.argv[1:4]
    signal.alarm(60)                                   # never outlive a broken test

    def mark(what):
        print(what, flush=True)
        if what == target:
            time.sleep(60)                             # the parent kills us here

    e = Engine.load(model, EngineConfig(backend="cpu", n_ctx=128, kv_dtype="int8"))
    store = persist.KVStore(folder)
    greedy = SamplingParams(temperature=0)
    p = [int(t) for t in range(100, 140)]
    list(e.generate(GenerationRequest(prompt=p, params=greedy, max_tokens=4)))
    assert store.save(e, "c")
    print("A", json.dumps(e.kv_tokens), flush=True)
    p2 = e.kv_tokens + [5, 6, 7, 8, 9]
    list(e.generate(GenerationRequest(prompt=p2, params=greedy, max_tokens=4)))
    print("B", json.dumps(e.kv_tokens), flush=True)

    real_write, real_fsync, real_replace = persist._write_all, os.fsync, os.replace
    n_writes = [0]
    def slow_write(fd, data):
        half = len(data) // 2
        real_write(fd, data[:half])
        mark(f"half-{n_writes[0]}")
        real_write(fd, data[half:])
        mark(f"wrote-{n_writes[0]}")
        n_writes[0] += 1
    def fsync(fd):
        real_fsync(fd)
        mark("fsynced")
    def replace(a, b):
        real_replace(a, b)
        mark("renamed")
    persist._write_all, os.fsync, os.replace = slow_write, fsync, replace
    assert store.save(e, "c")
    mark("saved")
""")

# marker after which the child is killed -> the state that must load afterwards
KILL_POINTS = {"half-0": "A", "wrote-0": "A", "half-2": "A", "fsynced": "A", "renamed": "B"}


@pytest.mark.slow       # five writer processes killed at five points: ~30 s on 2 cores
def test_killed_mid_save_leaves_old_or_new_file(engine, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    procs = {}
    for point in KILL_POINTS:                          # all children at once
        folder = tmp_path / point
        procs[point] = subprocess.Popen([sys.executable, str(script), str(MODEL), str(folder), point],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for point, want in KILL_POINTS.items():
        proc, states = procs[point], {}
        try:
            for line in proc.stdout:
                word, _, rest = line.strip().partition(" ")
                if word in ("A", "B"):
                    states[word] = json.loads(rest)
                if word == point:
                    break
            else:
                pytest.fail(f"child ended before '{point}': {proc.stderr.read()}")
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
            proc.stderr.close()
        folder = tmp_path / point
        store = KVStore(folder)                        # removes the dead child's temp file
        assert store.n_stale_removed == (1 if want == "A" else 0), point
        assert folder_files(folder) == ["c.kv"], (point, folder_files(folder))
        engine.kv_tokens = []
        expect = states[want]
        n = store.restore(engine, "c", states["B"] + [1], 0)
        assert n == len(expect) and engine.kv_tokens == expect, f"kill at {point}: want state {want}"
    engine.kv_tokens = []


def test_stale_temp_files_are_removed_at_start(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = os.getpid()
    names = {
        f".c.{dead.pid}.0123abcd.tmp": False,           # its process is gone
        f".c.{me}.89abcdef.tmp": True,                  # a live writer: kept
        f".old.{me}.0badf00d.tmp": False,               # live pid but an hour old: pid reuse, stale
        "notes.tmp": True, ".c.tmp": True, "c.kv.tmp": True,   # not ours: never touched
    }
    for name in names:
        (folder / name).write_bytes(b"partial")
    os.utime(folder / f".old.{me}.0badf00d.tmp", (time.time() - 7200, time.time() - 7200))
    store = KVStore(folder)
    assert store.n_stale_removed == 2
    assert folder_files(folder) == sorted(n for n, keep in names.items() if keep)


def test_disk_full_keeps_the_old_file(engine, saved, tmp_path, monkeypatch, caplog):
    folder = tmp_path / "cache"
    store = KVStore(folder)
    (folder / "c.kv").write_bytes(saved["data"])
    real = persist._write_all
    calls = [0]

    def full(fd, data):
        calls[0] += 1
        if calls[0] == 3:
            real(fd, data[:len(data) // 3])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(persist, "_write_all", full)
    engine.kv_tokens = saved["tokens"] + [5, 6]
    with caplog.at_level(logging.ERROR, logger="genie_rt.kvcache"):
        assert store.save(engine, "c") is False
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert folder_files(folder) == ["c.kv"]
    engine.kv_tokens = []
    assert store.restore(engine, "c", saved["prompt"], 0) == len(saved["tokens"])
    assert engine.kv_tokens == saved["tokens"]
    engine.kv_tokens = []


def test_folder_removed_while_running_is_made_again(engine, saved, tmp_path, caplog):
    import shutil
    folder = tmp_path / "cache"
    store = KVStore(folder)
    shutil.rmtree(folder)
    engine.kv_tokens = list(saved["tokens"])
    with caplog.at_level(logging.WARNING, logger="genie_rt.kvcache"):
        assert store.save(engine, "c") is True
    assert folder_files(folder) == ["c.kv"] and "created it again" in caplog.text
    engine.kv_tokens = []
    assert store.restore(engine, "c", saved["prompt"], 0) == len(saved["tokens"])
    engine.kv_tokens = []


def test_a_bad_file_that_cannot_be_deleted_is_not_said_to_be(engine, saved, tmp_path, monkeypatch, caplog):
    folder = tmp_path / "cache"
    store = KVStore(folder)
    (folder / "c.kv").write_bytes(b"garbage" * 100)

    def refuse(path, *a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(persist.os, "unlink", refuse)
    engine.kv_tokens = []
    with caplog.at_level(logging.WARNING, logger="genie_rt.kvcache"):
        assert store.restore(engine, "c", saved["prompt"], 0) == 0
    assert "could not delete it (Operation not permitted)" in caplog.text and "; deleted" not in caplog.text
    assert engine.kv_tokens == []


# -- eviction ------------------------------------------------------------------------

def test_lru_eviction_never_evicts_the_newest(engine, saved, tmp_path):
    folder = tmp_path / "cache"
    size = len(saved["data"])
    store = KVStore(folder, budget_bytes=size * 5 // 2)           # room for two files
    engine.kv_tokens = list(saved["tokens"])
    for i, cid in enumerate(["a", "b"]):
        assert store.save(engine, cid)
        os.utime(folder / f"{cid}.kv", (1000 + i, 1000 + i))
    assert store.save(engine, "c")                                # a is the least recently used
    assert folder_files(folder) == ["b.kv", "c.kv"]
    os.utime(folder / "c.kv", (2000, 2000))
    engine.kv_tokens = []
    assert store.restore(engine, "b", saved["prompt"], 0) > 0     # touching b makes c the LRU
    assert (folder / "b.kv").stat().st_mtime > 2000
    engine.kv_tokens = list(saved["tokens"])
    assert store.save(engine, "d")
    assert folder_files(folder) == ["b.kv", "d.kv"]
    store.budget_bytes = 1                                        # smaller than any file
    assert store.save(engine, "e")
    assert folder_files(folder) == ["e.kv"]
    engine.kv_tokens = []
