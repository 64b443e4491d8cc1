"""kvcache/persist.py + kvfile.py: per-conversation KV files on the CPU back-end, the
round trips.

Checked here: a 2-turn conversation restored from disk by a fresh engine equals the
uninterrupted one (identical greedy tokens, logits cosine >= 0.999, the pool's bytes
exactly) for int8, f16 and f32 KV; a partial prefix hydrates only the common part; a
corrupt file means one cold turn and then a good file; the file's layout; ring layers
(format 3) between ring and host pools. Attacks on the file are in
test_kv_persist_attacks.py, crash safety and the folder in test_kv_persist_disk.py, the
`genie-rt kv` commands in test_kv_persist_cli.py.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from genie_rt.engine.generate import Delta, Done, GenerationRequest
from genie_rt.kvcache import kvfile
from genie_rt.kvcache.persist import KVStore
from genie_rt.kvcache.pool import quantize_rows_int8
from kv_persist_helpers import (  # noqa: F401  (engine, saved: fixtures)
    cosine, engine, folder_files, greedy, load, prompt_of, saved, split,
)


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


# -- the file format ---------------------------------------------------------------------

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


@pytest.mark.parametrize("n,at", [(1, Delta), (3, Delta), (3, Done)])
def test_a_turn_cancelled_after_its_prompt_is_saved(n, at, tmp_path):
    """docs/server.md: the conversation's cache is saved also when the turn is cancelled after its
    prompt was processed - mid-reply, or (n > 1) between two choices."""
    import threading
    from kv_persist_helpers import GREEDY
    eng = load("int8", kv_dir=tmp_path)
    cancel = threading.Event()
    req = GenerationRequest(prompt=prompt_of(40, 7), params=GREEDY, max_tokens=8, conversation_id="c1",
                            cancel=cancel, n=n, ignore_eos=True)
    done = []
    for ev in eng.generate(req):
        if isinstance(ev, at):
            cancel.set()
        if isinstance(ev, Done):
            done.append(ev.result.finish_reason)
    assert done[-1] == "cancelled" and len(done) <= n
    assert "c1.kv" in folder_files(tmp_path)
