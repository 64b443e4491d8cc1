"""kvcache/persist.py + kvfile.py: per-conversation KV files on the CPU back-end.

Checked here: a 2-turn conversation restored from disk by a fresh engine equals the
uninterrupted one (identical greedy tokens, logits cosine >= 0.999, the pool's bytes
exactly) for int8, f16 and f32 KV; every attack on the file (truncation at each
boundary class, flipped bytes, another model, other shapes and dtype, unknown version,
absurd sizes, garbage, symlinks, bad ids, a process killed mid-save) leaves the request
cold, the bad file deleted, nothing written outside the folder and no exception;
stale temp files, LRU eviction, a full disk; the `genie-rt kv` commands.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import importlib.util
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np

from genie_rt.kvcache.pool import quantize_rows_int8
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import GenerationRequest
from genie_rt.engine.sampling import SamplingParams
from genie_rt.kvcache import kvfile, persist
from genie_rt.kvcache.cli import run_kv_command
from genie_rt.kvcache.persist import InvalidConversationId, KVStore, validate_conversation_id

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "qwen3-micro-q4km.gguf"
N_CTX = 192
GREEDY = SamplingParams(temperature=0)


def load(kv_dtype: str = "int8", kv_dir: Path | None = None, model: Path = MODEL) -> Engine:
    return Engine.load(model, EngineConfig(backend="cpu", n_ctx=N_CTX, kv_dtype=kv_dtype,
                                           kv_cache_dir=str(kv_dir) if kv_dir else None))


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 4000, n)]


def greedy(engine: Engine, prompt: list[int], cid: str | None = None, max_tokens: int = 6):
    req = GenerationRequest(prompt=prompt, params=GREEDY, max_tokens=max_tokens, conversation_id=cid)
    return list(engine.generate(req))[-1].result


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def folder_files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.fixture(scope="module")
def engine() -> Engine:
    """A shared int8 engine for the attack tests (kv_tokens reset by each use)."""
    return load("int8")


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory) -> dict:
    """A valid conversation file of `engine` and the prompt that matches all of it."""
    folder = tmp_path_factory.mktemp("saved")
    engine.kv_tokens = []
    p = prompt_of(40, seed=1)
    greedy(engine, p)
    tokens = list(engine.kv_tokens)
    assert KVStore(folder).save(engine, "c")
    data = (folder / "c.kv").read_bytes()
    engine.kv_tokens = []
    return {"data": data, "tokens": tokens, "prompt": tokens + [7, 8]}


def split(data: bytes) -> tuple[dict, bytes]:
    """(header dict, body) of a file's bytes, trusting it (test helper)."""
    _, h_len, _ = kvfile.PREAMBLE.unpack_from(data)
    raw = data[kvfile.PREAMBLE.size:kvfile.PREAMBLE.size + h_len]
    return msgpack.unpackb(raw, raw=False), data[kvfile.PREAMBLE.size + h_len:]


def rewrite(data: bytes, body: bytes | None = None, **changes) -> bytes:
    """The same file with header fields changed; header digest and body digest redone so
    the file is well-formed and only the changed fields can make it fail."""
    h, old_body = split(data)
    body = old_body if body is None else body
    h.update(body_bytes=len(body), body_digest=hashlib.sha256(body).digest())
    h.update(changes)
    return kvfile.pack_header(h) + body


def raw_header(raw: bytes) -> bytes:
    """A preamble with a correct digest around arbitrary header bytes."""
    return kvfile.PREAMBLE.pack(kvfile.MAGIC, len(raw), hashlib.blake2b(raw, digest_size=32).digest()) + raw


def check_rejected(engine: Engine, tmp_path: Path, content, prompt: list[int], caplog,
                   why: str | None = None) -> None:
    """Put `content` (bytes, or a callable making the entry) at <folder>/c.kv, restore:
    the request must run cold, the entry be gone, the pool untouched, nothing else written."""
    folder = tmp_path / "cache"
    store = KVStore(folder)
    path = folder / "c.kv"
    if callable(content):
        content(path)
    else:
        path.write_bytes(content)
    outside = sorted(p.name for p in tmp_path.iterdir())
    engine.kv_tokens = []
    before = engine.backend.kv.export_positions(len(prompt))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="genie_rt.kvcache"):
        n = store.restore(engine, "c", prompt, 0)
    assert n == 0 and engine.kv_tokens == []
    assert not os.path.lexists(path), "the bad file must be deleted"
    assert folder_files(folder) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == outside
    after = engine.backend.kv.export_positions(len(prompt))
    assert all(np.array_equal(before[k], after[k]) for k in before), "the pool changed"
    assert any("kv cache c.kv" in r.getMessage() for r in caplog.records), "no log line says why"
    if why:
        assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


# -- round trips ------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["int8", "f16", "f32"])
def test_two_turns_restored_from_disk_match_uninterrupted(kv_dtype, tmp_path):
    folder = tmp_path / "cache"
    a = load(kv_dtype, folder)                       # the uninterrupted conversation (saving as it goes)
    p1 = prompt_of(50, seed=2)
    r1 = greedy(a, p1, "conv-1")
    turn1_file = (folder / "conv-1.kv").read_bytes()
    saved_tokens = list(a.kv_tokens)
    assert saved_tokens == p1 + r1.tokens[:-1]
    p2 = p1 + r1.tokens + prompt_of(12, seed=3)      # turn 2: history + the new user words
    r2_uninterrupted = greedy(a, p2)                 # same engine, in-memory reuse
    assert r2_uninterrupted.n_cached == len(saved_tokens)

    b = load(kv_dtype, folder)                       # a new process: the pool is empty
    r2_restored = greedy(b, p2, "conv-1")
    assert r2_restored.n_cached == len(saved_tokens)
    assert r2_restored.tokens == r2_uninterrupted.tokens

    # logits after hydrating turn 1's file vs a cold prefill of the whole prompt
    (folder / "conv-1.kv").write_bytes(turn1_file)   # b has saved turn 2 over it
    b.kv_tokens = []
    n = KVStore(folder).restore(b, "conv-1", p2, 0)
    assert n == len(saved_tokens) and b.kv_tokens == saved_tokens
    warm = b.backend.prefill(p2[n:], n)
    a.kv_tokens = []
    cold = a.backend.prefill(p2, 0)
    assert cosine(warm, cold) >= 0.999
    assert int(np.argmax(warm)) == int(np.argmax(cold))


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_restored_pool_bytes_are_exactly_the_saved_ones(kv_dtype, tmp_path):
    a = load(kv_dtype)
    p = prompt_of(33, seed=4)
    greedy(a, p, max_tokens=3)
    store = KVStore(tmp_path / "cache")
    assert store.save(a, "x")
    exported = a.backend.kv.export_positions(len(a.kv_tokens))
    b = load(kv_dtype)
    n = store.restore(b, "x", a.kv_tokens + [1], 0)
    assert n == len(a.kv_tokens) and b.kv_tokens == a.kv_tokens
    got = b.backend.kv.export_positions(n)
    assert set(got) == set(exported) == ({"k", "v", "k_scale", "v_scale"} if kv_dtype == "int8" else {"k", "v"})
    for name in exported:
        assert got[name].dtype == exported[name].dtype
        assert np.array_equal(got[name], exported[name]), name


def test_partial_prefix_hydrates_only_the_common_part(engine, saved, tmp_path):
    folder = tmp_path / "cache"
    store = KVStore(folder)
    (folder / "c.kv").write_bytes(saved["data"])
    p = saved["tokens"][:25] + prompt_of(10, seed=5)   # diverges at position 25
    engine.kv_tokens = []
    assert store.restore(engine, "c", p, 0) == 25
    assert engine.kv_tokens == saved["tokens"][:25]
    warm = engine.backend.prefill(p[25:], 25)
    engine.kv_tokens = []
    cold = engine.backend.prefill(p, 0)
    assert cosine(warm, cold) >= 0.999


def test_file_not_used_when_memory_holds_as_much(engine, saved, tmp_path):
    folder = tmp_path / "cache"
    store = KVStore(folder)
    (folder / "c.kv").write_bytes(saved["data"])
    engine.kv_tokens = list(saved["tokens"])
    assert store.restore(engine, "c", saved["prompt"], len(saved["tokens"])) == 0
    assert engine.kv_tokens == saved["tokens"]
    assert (folder / "c.kv").exists()                 # a good file is kept
    # the whole prompt matching caps the reuse at len(prompt) - 1 (one token for the logits)
    engine.kv_tokens = []
    assert store.restore(engine, "c", saved["tokens"], 0) == len(saved["tokens"]) - 1
    engine.kv_tokens = []


def test_engine_runs_cold_with_a_corrupt_file_then_saves_a_good_one(saved, tmp_path):
    folder = tmp_path / "cache"
    e = load("int8", folder)
    bad = bytearray(saved["data"])
    bad[-5] ^= 0x40
    (folder / "c.kv").write_bytes(bytes(bad))
    r = greedy(e, saved["prompt"], "c")
    cold = greedy(load("int8"), saved["prompt"])
    assert r.n_cached == 0 and r.tokens == cold.tokens
    assert folder_files(folder) == ["c.kv"]           # rewritten at the end of the turn
    with open(folder / "c.kv", "rb") as f:
        meta = kvfile.read_header(f, (folder / "c.kv").stat().st_size)
    assert list(meta.tokens) == e.kv_tokens


# -- attacks on the file ---------------------------------------------------------------

def test_truncated_at_every_boundary_class(engine, saved, tmp_path, caplog):
    data = saved["data"]
    _, h_len, _ = kvfile.PREAMBLE.unpack_from(data)
    body0 = kvfile.PREAMBLE.size + h_len
    meta = kvfile.read_header(io.BytesIO(data), len(data))
    cuts = {0, 1, 4, 7, 8, 9, 11, 12, 20, 43, 44, 45, body0 - h_len // 2, body0 - 1, body0, body0 + 1,
            len(data) - 1, len(data) - 4096}
    at = body0
    for _, dt, shape in meta.layout():                 # array and layer boundaries of the body
        size = int(np.prod(shape)) * np.dtype(dt).itemsize
        cuts |= {at + size // shape[0] - 1, at + size // shape[0], at + size - 1, at + size}
        at += size
    cuts |= set(np.random.default_rng(6).integers(0, len(data), 12).tolist())
    cuts = sorted(c for c in cuts if 0 <= c < len(data))
    for i, cut in enumerate(cuts):
        check_rejected(engine, tmp_path / f"t{i}", data[:cut], saved["prompt"], caplog)
    check_rejected(engine, tmp_path / "extended", data + b"\0", saved["prompt"], caplog, "extended")


def test_flipped_bytes_in_header_and_body(engine, saved, tmp_path, caplog):
    data = saved["data"]
    _, h_len, _ = kvfile.PREAMBLE.unpack_from(data)
    body0 = kvfile.PREAMBLE.size + h_len
    rng = np.random.default_rng(7)
    offsets = list(rng.integers(0, body0, 20)) + list(rng.integers(body0, len(data), 12))
    offsets += [0, 8, 11, 12, 43, 44, body0, len(data) - 1]
    for i, off in enumerate(offsets):
        bad = bytearray(data)
        bad[off] ^= int(rng.integers(1, 256))
        check_rejected(engine, tmp_path / f"f{i}", bytes(bad), saved["prompt"], caplog)


def test_header_from_another_model(engine, saved, tmp_path, caplog):
    check_rejected(engine, tmp_path / "fp", rewrite(saved["data"], fingerprint=b"\x01" * 32),
                   saved["prompt"], caplog, "another model")


def test_real_other_model_with_the_same_tensor_table(tmp_path, caplog):
    """Two synthetic GGUFs differing only in their random weights (same header, size
    and KV shape) must not share caches: the fingerprint samples the tensor data."""
    spec = importlib.util.spec_from_file_location("synth_gguf", ROOT / "tools" / "synth_gguf.py")
    sg = importlib.util.module_from_spec(spec)
    sys.modules["synth_gguf"] = sg
    spec.loader.exec_module(sg)
    shape = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=1026, tied=True)
    m0 = sg.write_synthetic_qwen3(tmp_path / "m0.gguf", shape, seed=0)
    m1 = sg.write_synthetic_qwen3(tmp_path / "m1.gguf", shape, seed=1)
    assert m0.stat().st_size == m1.stat().st_size
    e0, e1 = load("int8", model=m0), load("int8", model=m1)
    store = KVStore(tmp_path / "cache")
    assert store.fingerprint(e0) != store.fingerprint(e1)
    p = prompt_of(20, seed=8)
    p = [t % 1000 for t in p]
    greedy(e0, p, max_tokens=2)
    assert store.save(e0, "c")
    data = (tmp_path / "cache" / "c.kv").read_bytes()
    (tmp_path / "cache" / "c.kv").unlink()
    check_rejected(e1, tmp_path / "x", data, e0.kv_tokens + [1], caplog, "another model")


def test_other_kv_dtype_and_shapes(engine, saved, tmp_path, caplog):
    f16 = load("f16")
    f16.kv_tokens = []
    greedy(f16, saved["prompt"][:30], max_tokens=2)
    store = KVStore(tmp_path / "mk")
    assert store.save(f16, "c")
    check_rejected(engine, tmp_path / "dtype", (tmp_path / "mk" / "c.kv").read_bytes(), saved["prompt"],
                   caplog, "differ from the pool's")
    h, _ = split(saved["data"])
    n = h["n_positions"]
    for field, value in [("n_layers", 3), ("n_kv_heads", 1), ("head_dim", 32)]:
        dims = {"n_layers": h["n_layers"], "n_kv_heads": h["n_kv_heads"], "head_dim": h["head_dim"], field: value}
        layout = kvfile.layout_for("int8", n=n, **dims)
        body = bytes(sum(int(np.prod(s)) * np.dtype(d).itemsize for _, d, s in layout))
        data = rewrite(saved["data"], body=body, layout=[[a, b, list(c)] for a, b, c in layout], **dims)
        check_rejected(engine, tmp_path / field, data, saved["prompt"], caplog, "differ from the pool's")
    # a layout that does not follow from dtype and shape
    h_layout = [list(x) for x in h["layout"]][::-1]
    check_rejected(engine, tmp_path / "layout", rewrite(saved["data"], layout=h_layout), saved["prompt"],
                   caplog, "body layout")


def test_unknown_version_and_bad_fields(engine, saved, tmp_path, caplog):
    data = saved["data"]
    cases = {
        "version1": (rewrite(data, version=1), "version 1"),
        "version4": (rewrite(data, version=4), "version 4"),
        "version_str": (rewrite(data, version="1"), "version"),
        "dtype": (rewrite(data, kv_dtype="q4"), "KV dtype"),
        "tokens_short": (rewrite(data, tokens=split(data)[0]["tokens"][:-4]), "token ids"),
        "bool_layers": (rewrite(data, n_layers=True), "n_layers"),
        "neg_layers": (rewrite(data, n_layers=-2), "n_layers"),
        "no_created": (rewrite(data, created=None), "created"),
        "not_a_map": (kvfile.pack_header([1, 2, 3]) + split(data)[1], "not a map"),
        "int_keys": (kvfile.pack_header({1: 2}) + split(data)[1], "not valid msgpack"),
        "trailing": (raw_header(b"\x90\x90"), "not valid msgpack"),
        "deep": (raw_header(b"\x91" * 5000 + b"\xc0"), "not valid msgpack"),     # [[[[...]]]] 5000 deep
        "magic": (b"GGUF" + data[4:], "bad magic"),
    }
    for name, (content, why) in cases.items():
        check_rejected(engine, tmp_path / name, content, saved["prompt"], caplog, why)


def test_absurd_sizes_are_refused_by_arithmetic(engine, saved, tmp_path, caplog):
    data = saved["data"]
    huge = {
        "positions": rewrite(data, n_positions=10 ** 12),
        "body_bytes": rewrite(data, body_bytes=10 ** 15),
        "dims": rewrite(data, n_layers=1 << 16, head_dim=1 << 16),
        "header_len": kvfile.PREAMBLE.pack(kvfile.MAGIC, 0xFFFFFFFF, bytes(32)) + data[44:],
        "header_len_in_range": kvfile.PREAMBLE.pack(kvfile.MAGIC, 60 << 20, bytes(32)) + data[44:],
    }
    h, body = split(data)
    # a claimed count that agrees with the token bytes and layout, but not with the file size
    n = 1 << 20
    layout = kvfile.layout_for("int8", h["n_layers"], h["n_kv_heads"], h["head_dim"], n)
    h2 = dict(h, n_positions=n, tokens=bytes(4 * n), layout=[[a, b, list(c)] for a, b, c in layout],
              body_bytes=sum(int(np.prod(s)) * np.dtype(d).itemsize for _, d, s in layout))
    huge["consistent_header"] = kvfile.pack_header(h2) + body
    for name, content in huge.items():
        tracemalloc.start()
        t0 = time.perf_counter()
        check_rejected(engine, tmp_path / name, content, saved["prompt"] + [1] * 100, caplog)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 << 20, f"{name}: {peak} bytes allocated for a file that does not validate"
        assert time.perf_counter() - t0 < 10, f"{name}: rejection must not read or allocate the claim"


def test_garbage_empty_and_directory(engine, saved, tmp_path, caplog):
    rng = np.random.default_rng(9)
    check_rejected(engine, tmp_path / "empty", b"", saved["prompt"], caplog, "shorter than")
    check_rejected(engine, tmp_path / "garbage", rng.bytes(5000), saved["prompt"], caplog)
    check_rejected(engine, tmp_path / "magic_garbage", kvfile.MAGIC + rng.bytes(5000), saved["prompt"], caplog)
    # a directory where the file should be: ignored and left alone (never rmtree'd)
    folder = tmp_path / "dir" / "cache"
    store = KVStore(folder)
    (folder / "c.kv").mkdir()
    (folder / "c.kv" / "keep").write_text("x")
    engine.kv_tokens = []
    assert store.restore(engine, "c", saved["prompt"], 0) == 0
    assert (folder / "c.kv" / "keep").exists()


def test_symlinks_are_never_followed(engine, saved, tmp_path, caplog):
    # a valid file outside the folder, linked in: rejected, the link removed, the target intact
    outside = tmp_path / "outside.kv"
    outside.write_bytes(saved["data"])
    check_rejected(engine, tmp_path / "a", lambda p: p.symlink_to(outside), saved["prompt"], caplog, "symbolic link")
    assert outside.read_bytes() == saved["data"]
    check_rejected(engine, tmp_path / "b", lambda p: p.symlink_to("/dev/zero"), saved["prompt"], caplog)
    check_rejected(engine, tmp_path / "c", lambda p: p.symlink_to(tmp_path / "missing"), saved["prompt"], caplog)
    # saving over a symlink replaces the link, never writes through it
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "save" / "cache"
    store = KVStore(folder)
    (folder / "c.kv").symlink_to(victim)
    engine.kv_tokens = list(saved["tokens"])
    assert store.save(engine, "c")
    engine.kv_tokens = []
    assert victim.read_text() == "precious"
    assert not (folder / "c.kv").is_symlink() and (folder / "c.kv").read_bytes()[:8] == kvfile.MAGIC


BAD_IDS = ["", "../x", "..", ".", "a/b", "/etc/passwd", "a\\b", "x" * 65, "a.b", "a b", "ä", "a\x00b",
           "conv\n", "~root", None, 12, b"abc", ["a"]]


@pytest.mark.parametrize("cid", BAD_IDS, ids=lambda c: repr(c)[:20])
def test_bad_conversation_ids(engine, tmp_path, cid):
    store = KVStore(tmp_path / "cache")
    engine.kv_tokens = [1, 2, 3]
    with pytest.raises(InvalidConversationId):
        store.restore(engine, cid, [1, 2, 3, 4], 3)
    with pytest.raises(InvalidConversationId):
        store.save(engine, cid)
    with pytest.raises(ValueError):                    # the server maps it to 400
        validate_conversation_id(cid)
    engine.kv_tokens = []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"] and folder_files(tmp_path / "cache") == []


def test_good_conversation_ids():
    for cid in ["a", "A-z_09", "x" * 64, "-", "_", "kitchen-2026-08-01"]:
        assert validate_conversation_id(cid) == cid


def test_engine_refuses_a_bad_id_cleanly(engine, tmp_path):
    e = load("int8", tmp_path / "cache")
    with pytest.raises(InvalidConversationId):
        list(e.generate(GenerationRequest(prompt=[1, 2, 3], params=GREEDY, max_tokens=2, conversation_id="../x")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"] and folder_files(tmp_path / "cache") == []


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


# -- the file format and the CLI ---------------------------------------------------------

def test_file_format_layout(engine, saved):
    data = saved["data"]
    magic, h_len, h_digest = kvfile.PREAMBLE.unpack_from(data)
    assert kvfile.PREAMBLE.size == 44 and magic == b"GENIEKV\x00"
    h, body = split(data)
    assert h_digest == hashlib.blake2b(data[44:44 + h_len], digest_size=32).digest()
    assert set(h) == {"version", "fingerprint", "model", "kv_dtype", "n_layers", "n_kv_heads", "head_dim",
                      "n_positions", "tokens", "layout", "body_bytes", "body_digest", "created",
                      "ring_layers", "ring_first"}
    n = len(saved["tokens"])
    assert h["version"] == 3 and h["n_positions"] == n and h["kv_dtype"] == "int8"
    assert h["ring_layers"] == [] and h["ring_first"] == 0      # the host pool keeps every position
    assert np.frombuffer(h["tokens"], "<u4").tolist() == saved["tokens"]
    assert h["layout"] == [["k", "|i1", [2, n, 2, 64]], ["v", "|i1", [2, n, 2, 64]],
                           ["k_scale", "<f4", [2, n, 2]], ["v_scale", "<f4", [2, n, 2]]]
    assert len(body) == h["body_bytes"] == n * engine.backend.kv.shape.bytes_per_position
    assert h["body_digest"] == hashlib.sha256(body).digest()


def kv_cli(folder: Path, action: str, cid: str | None = None) -> int:
    return run_kv_command(argparse.Namespace(action=action, id=cid, kv_cache_dir=str(folder)))


def test_cli_list_show_rm_clear(engine, saved, tmp_path, capsys):
    folder = tmp_path / "cache"
    store = KVStore(folder)
    engine.kv_tokens = list(saved["tokens"])
    for cid in ("kitchen", "hall"):
        assert store.save(engine, cid)
    engine.kv_tokens = []
    (folder / "broken.kv").write_bytes(b"junk")
    capsys.readouterr()
    assert kv_cli(folder, "list") == 0
    out = capsys.readouterr().out
    assert "kitchen" in out and "hall" in out and str(len(saved["tokens"])) in out and "int8" in out
    assert "broken" in out and "invalid" in out
    assert kv_cli(folder, "show", "kitchen") == 0
    out = capsys.readouterr().out
    assert "ok" in out and "fingerprint" in out and "k_scale" in out
    assert kv_cli(folder, "show", "broken") == 1
    assert "invalid" in capsys.readouterr().out
    assert kv_cli(folder, "show", "nope") == 1
    assert kv_cli(folder, "rm", "hall") == 0 and not (folder / "hall.kv").exists()
    assert kv_cli(folder, "rm", "hall") == 1
    capsys.readouterr()
    assert kv_cli(folder, "clear") == 0
    assert "2" in capsys.readouterr().out
    assert folder_files(folder) == []
    for action in ("show", "rm"):
        assert kv_cli(folder, action, "../x") == 1
        assert "invalid" in capsys.readouterr().err
        assert kv_cli(folder, action, None) == 1
    capsys.readouterr()
    assert kv_cli(tmp_path / "missing", "list") == 0
    assert "the folder does not exist yet" in capsys.readouterr().out     # a typo shows
    assert not (tmp_path / "missing").exists()


def test_cli_through_genie_rt_main(tmp_path, capsys):
    from genie_rt.engine.cli import main
    assert main(["kv", "list", "--kv-cache-dir", str(tmp_path)]) == 0
    assert main(["kv", "rm", "../etc", "--kv-cache-dir", str(tmp_path)]) == 1


def test_ring_layers_round_trip_through_a_file_into_both_kinds_of_pool(tmp_path):
    """A CUDA pool keeps Gemma's sliding-window layers as rings: its file stores those layers
    from the first position every ring still holds (format 3). Such a file restores into a
    ring pool and into a host pool (which reads only the window), and a host pool's file
    restores into a ring pool - each layer gets the positions it can hold."""
    from types import SimpleNamespace

    from genie_rt.kvcache.device_pool import DeviceKVPool
    from genie_rt.kvcache.persist import export_kv, import_kv
    from genie_rt.kvcache.pool import HostKVPool, KVShape
    rng = np.random.default_rng(0)
    L, n_ctx, R, n = 3, 40, 12, 30            # layers 0, 1 rings of 12 slots (window 8 + chunk 5 - 1)
    ring_shape = KVShape(L, n_ctx, 1, 16, "int8", slots=(R, R, n_ctx))
    host_shape = KVShape(L, n_ctx, 1, 16, "int8")
    rows = {name: rng.standard_normal((L, n, 1, 16)).astype(np.float32) for name in ("k", "v")}

    class Fake(SimpleNamespace):             # the back-end's two ring hooks
        def ring_first(self, end):
            return max(0, end - R) if self.kv.shape.slots else 0

        def kv_imported(self, first, end):
            self.imported = (first, end)

    def filled(shape):
        pool = DeviceKVPool(shape) if shape.slots else HostKVPool(shape)
        for layer in range(L):
            for p in range(n):                 # in order, as generation writes them
                q, s = quantize_rows_int8(rows["k"][layer, p:p + 1])
                qv, sv = quantize_rows_int8(rows["v"][layer, p:p + 1])
                pool.import_window({"k": q[None], "v": qv[None], "k_scale": s[None], "v_scale": sv[None]},
                                   p, p + 1, layers=[layer])
        return Fake(kv=pool)

    def meta_of(arrays, rings, first):
        chunks = kvfile.encode(arrays, list(range(n)), fingerprint=b"f" * 32, model="m", kv_dtype="int8",
                               n_layers=L, n_kv_heads=1, head_dim=16, ring_layers=rings, ring_first=first)
        path = tmp_path / "x.kv"
        path.write_bytes(b"".join(bytes(c) for c in chunks))
        with open(path, "rb") as f:
            meta = kvfile.read_header(f, path.stat().st_size)
            return meta, kvfile.read_body(f, meta, n)

    for src, dst in ((ring_shape, ring_shape), (ring_shape, host_shape), (host_shape, ring_shape)):
        meta, arrays = meta_of(*export_kv(filled(src), n))
        assert list(meta.ring_layers) == ([0, 1] if src.slots else []) and meta.ring_first == (n - R if src.slots else 0)
        target = Fake(kv=DeviceKVPool(dst) if dst.slots else HostKVPool(dst))
        ring_first = import_kv(target, arrays, meta, n)
        assert ring_first == (n - R if dst.slots else 0)
        got = export_kv(target, n)[0]
        want = export_kv(filled(dst), n)[0]
        for name in want:                      # every position each layer holds is the original
            g, w = got[name], want[name]
            if name.startswith("r") or dst.slots:  # rings (R positions), or the one full layer
                np.testing.assert_array_equal(g, w, err_msg=f"{src} -> {dst}: {name}")
            else:                              # a host pool from a ring file: layer 2 whole,
                np.testing.assert_array_equal(g[2], w[2], err_msg=name)       # the windowed
                np.testing.assert_array_equal(g[:2, -R:], w[:2, -R:], err_msg=name)   # ones' tail
