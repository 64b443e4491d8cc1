"""kvcache/persist.py + kvfile.py: attacks on a KV file and on conversation ids.

Checked here: every attack on the file (truncation at each boundary class, flipped
bytes, another model, other shapes and dtype, unknown version, absurd sizes, garbage,
symlinks) leaves the request cold, the bad file deleted, nothing written outside the
folder and no exception; bad conversation ids are refused before any file is touched.
"""
from __future__ import annotations

import importlib.util
import io
import sys
import time
import tracemalloc

import numpy as np
import pytest

from genie_rt.engine.generate import GenerationRequest
from genie_rt.kvcache import kvfile
from genie_rt.kvcache.persist import InvalidConversationId, KVStore, validate_conversation_id
from kv_persist_helpers import (  # noqa: F401  (engine, saved: fixtures)
    GREEDY, ROOT, check_rejected, engine, folder_files, greedy, load, prompt_of, raw_header, rewrite,
    saved, split,
)


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
