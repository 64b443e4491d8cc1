"""kvcache/cli.py: the `genie-rt kv` commands (list, show, rm, clear) on a folder of KV
files, directly and through `genie-rt`'s main.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from genie_rt.kvcache.cli import run_kv_command
from genie_rt.kvcache.persist import KVStore
from kv_persist_helpers import engine, folder_files, saved  # noqa: F401  (engine, saved: fixtures)


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
