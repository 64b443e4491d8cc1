"""What the KV-persistence tests share (test_kv_persist.py, test_kv_persist_attacks.py,
test_kv_persist_disk.py, test_kv_persist_cli.py): the micro model, an engine loader, greedy
turns, the `engine` and `saved` module fixtures (each test module imports them and gets
its own), header surgery on a saved file (`split`, `rewrite`, `raw_header`) and
`check_rejected`, which asserts that a bad file leaves a request cold and nothing behind.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import GenerationRequest
from genie_rt.engine.sampling import SamplingParams
from genie_rt.kvcache import kvfile
from genie_rt.kvcache.persist import KVStore

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
