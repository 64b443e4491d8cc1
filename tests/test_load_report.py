"""The one-screen summary and the first-use note (engine/load_report.py)."""
from types import SimpleNamespace

from genie_rt.cpu import jit
from genie_rt.engine.load_report import first_use_note


def test_first_use_note_only_when_the_cpu_kernel_cache_is_empty(tmp_path, monkeypatch):
    cpu = SimpleNamespace(backend=SimpleNamespace(name="cpu", exact=False))
    monkeypatch.setattr(jit, "cache_dir", lambda: str(tmp_path))
    note = first_use_note(cpu)
    assert note and "compile" in note and str(tmp_path) in note
    (tmp_path / "linear.py._linear_q8_0-58.py311.nbi").write_bytes(b"")
    assert first_use_note(cpu) is None
    monkeypatch.setattr(jit, "cache_dir", lambda: None)
    assert "every run compiles" in first_use_note(cpu)
    assert first_use_note(SimpleNamespace(backend=SimpleNamespace(name="cuda"))) is None
    assert first_use_note(SimpleNamespace(backend=SimpleNamespace(name="cpu", exact=True))) is None
