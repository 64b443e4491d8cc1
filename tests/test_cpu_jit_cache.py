"""The first-use test of the CPU kernels' disk cache (cpu/jit.py), which decides what the
CPU warm-up step says (engine/backend_cpu.py, engine/progress.py)."""
from genie_rt.cpu import jit


def test_the_cpu_kernel_cache_is_empty_until_an_index_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "cache_dir", lambda: str(tmp_path))
    assert jit.cache_is_empty()
    (tmp_path / "linear.py._linear_q8_0-58.py311.nbi").write_bytes(b"")
    assert not jit.cache_is_empty()
    monkeypatch.setattr(jit, "cache_dir", lambda: None)      # no writable folder: every run compiles
    assert jit.cache_is_empty()
