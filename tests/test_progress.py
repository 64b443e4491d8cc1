"""Progress of the long load steps (engine/progress.py) and the loaders that report to it:
plain lines when stderr is not a terminal, a redrawn bar when it is, nothing by default."""
import io
import os
import sys
from types import MethodType, SimpleNamespace

import numpy as np
import pytest

from genie_rt.engine.cli import main
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import MemoryPlan
from genie_rt.engine.progress import NO_PROGRESS, StreamProgress, for_stream


class Clock:
    """A clock the test moves: each read advances by `step` seconds."""

    def __init__(self, step=0.25):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class Recorder:
    """A Progress that keeps every call: (what, args)."""

    def __init__(self):
        self.calls = []

    def start(self, step, total=None, unit="", done=0, detail=""):
        self.calls.append(("start", step, total))

    def advance(self, n=1, detail=""):
        self.calls.append(("advance", n))

    def done(self, detail=""):
        self.calls.append(("done", detail))

    def steps(self):
        """{step: (total, sum of advances)}, checking that every step was started and done."""
        out, current = {}, None
        for call in self.calls:
            if call[0] == "start":
                assert current is None, f"{call[1]} started inside {current}"
                current = call[1]
                out[current] = [call[2], 0]
            elif call[0] == "advance":
                assert current is not None, "advance outside a step"
                out[current][1] += call[1]
            else:
                assert current is not None, "done outside a step"
                current = None
        assert current is None, f"{current} never done"
        return {k: tuple(v) for k, v in out.items()}


def test_plain_lines_name_the_step_and_the_counts():
    out = io.StringIO()
    p = StreamProgress(out, clock=Clock())
    assert not p.tty                                   # a StringIO is no terminal
    p.start("compiling kernels, capturing graphs", 8, "graphs")
    for _ in range(8):
        p.advance(1, "prefill 16")
    p.done("kernel cache: 3 loaded")
    assert out.getvalue().splitlines() == [
        "compiling kernels, capturing graphs: started (8 graphs)",
        "compiling kernels, capturing graphs: 25% (2 of 8 graphs)",
        "compiling kernels, capturing graphs: 50% (4 of 8 graphs)",
        "compiling kernels, capturing graphs: 75% (6 of 8 graphs)",
        "compiling kernels, capturing graphs: 100% (8 of 8 graphs)",
        "compiling kernels, capturing graphs: done, 8 graphs in 2.2 s; kernel cache: 3 loaded",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_plain_lines_of_bytes_and_of_an_unknown_total():
    out = io.StringIO()
    p = StreamProgress(out, clock=Clock(), every=50)
    p.start("reading weights", 300_000_000, "B", done=100_000_000)
    p.advance(200_000_000)
    p.start("compiling CPU kernels", None, "compiled", detail="first use")   # ends the step before
    p.advance(1, "linear_q4_k")
    p.advance(1)                                   # no detail, under interval_plain: no line
    p.advance(1, "_rope")
    p.done("cached in /x")
    lines = out.getvalue().splitlines()
    assert lines[0] == "reading weights: started (300 MB; 100 MB already here)"
    assert lines[1].startswith("reading weights: 100% (300 of 300 MB, ") and lines[1].endswith(" MB/s)")
    assert lines[2].startswith("reading weights: done, 300 MB in ")
    assert lines[3:] == ["compiling CPU kernels: started (first use)",
                         "compiling CPU kernels: 1 compiled (linear_q4_k)",
                         "compiling CPU kernels: 3 compiled (_rope)",
                         "compiling CPU kernels: done, 3 compiled in 1.0 s; cached in /x"]


def test_a_terminal_gets_one_redrawn_line_per_step():
    out = FakeTTY()
    p = StreamProgress(out, clock=Clock(step=0.05))    # a stream that is a TTY: asked, not told
    assert p.tty
    p.start("reading weights", 4_000_000, "B")
    for _ in range(4):
        p.advance(1_000_000)
    p.done()
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1             # one line, ended once
    frames = text[:-1].split("\r")[1:]
    assert len(frames) >= 3 and all(f.startswith("reading weights [") for f in frames)
    assert len(frames) < 1 + 4 + 1                     # redrawn at most every 0.1 s (clock step 0.05)
    assert "100% 4/4 MB" in frames[-1] and "done in" in frames[-1]
    assert f"[{'#' * 30}]" in frames[-1] and "[" + "." * 30 + "]" in frames[0]
    # a shorter frame blanks what the longer one before it left
    p.start("compiling CPU kernels", None, "compiled")
    p.advance(1, "a_very_long_kernel_name_indeed")
    p.done()
    last = out.getvalue().split("\n")[-2].split("\r")
    assert len(last[-1]) >= len(last[-2]) and last[-1].rstrip().endswith("1 compiled, done in 0.2 s")


def test_quiet_and_library_calls_print_nothing(capsys):
    assert for_stream(io.StringIO(), quiet=True) is NO_PROGRESS
    assert isinstance(for_stream(io.StringIO()), StreamProgress)
    NO_PROGRESS.start("x", 3)
    NO_PROGRESS.advance(1, "y")
    NO_PROGRESS.done()
    with pytest.raises(ValueError, match="every"):
        StreamProgress(io.StringIO(), every=0)


def test_a_cpu_load_reports_each_step(fixture_gguf, capsys):
    rec = Recorder()
    eng = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=64, kv_dtype="int8"), progress=rec)
    steps = rec.steps()
    assert list(steps) == ["reading weights", "compiling CPU kernels"]
    total, read = steps["reading weights"]
    assert total == read == sum(t.nbytes for t in eng.gfile.tensors.values())
    assert steps["compiling CPU kernels"][0] is None
    # the warm-up forward left no trace in the KV pool; without a renderer nothing is printed
    assert not eng.backend.kv.k.any() and not eng.backend.kv.k_scale.any()
    Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=64))
    assert capsys.readouterr().err == ""


def test_the_cpu_warm_up_reports_each_kernel_it_compiles(monkeypatch):
    from genie_rt.cpu import jit
    from genie_rt.engine.backend_cpu import CPUBackend
    kv = SimpleNamespace(k=np.ones((2, 8, 1, 4)), v=np.ones((2, 8, 1, 4)))
    calls = []

    def forward(*args):      # a "kernel" that compiles on its first call, as numba would
        import numba

        @numba.njit
        def kernel_under_test(x):
            return x + 1
        calls.append(args)
        kernel_under_test(1)
    be = SimpleNamespace(exact=False, n_ctx=8, kv=kv, prefill=forward, decode=forward)
    monkeypatch.setattr(jit, "cache_dir", lambda: None)
    rec = Recorder()
    CPUBackend.warm_up(be, rec)
    assert calls == [(calls[0][0], 0), (0, 2)] and list(calls[0][0]) == [0, 0]   # 2-token prefill, a decode
    assert rec.calls[0] == ("start", "compiling CPU kernels", None)
    assert rec.calls[1:] == [("advance", 1), ("advance", 1), ("done", "no writable cache folder: every run compiles")]
    assert not kv.k[:, :3].any() and kv.k[:, 3:].all()        # the positions written are zeroed


def test_the_cuda_load_reports_weights_and_each_graph(fixture_gguf):
    """Under the simulator: the weights upload as one step of every tensor's bytes; warm-up's
    loop (its sequences stubbed: each would run a forward) advances once per graph key."""
    from genie_rt.engine.backend_cuda import CUDABackend
    g = open_gguf(fixture_gguf)
    rec = Recorder()
    be = CUDABackend(g, ModelConfig.from_gguf(g), EngineConfig(backend="cuda", n_ctx=64, kv_dtype="f16"),
                     MemoryPlan(64, 0, 0, 0, 0, 0, 1 << 50, "test"), warm=False, progress=rec)
    total, read = rec.steps()["reading weights"]
    assert total == read == sum(t.nbytes for t in g.tensors.values())
    ran = []
    fake = SimpleNamespace(use_graphs=True, arena={"x_last": None}, _graphs={1: 1, 2: 2},
                           stream=SimpleNamespace(synchronize=lambda: None),
                           kv=SimpleNamespace(zero=lambda stream: None),
                           prefill_keys=lambda: [(16, (1,), 0, False), (64, (2,), 0, False), (128, (2,), 0, False)],
                           _splits=lambda n, start, short=False: (1,),
                           _set_state=lambda **kw: None, _wrote=lambda *a, **kw: None,
                           _run=lambda key, record: ran.append(key), capture_stats={},
                           _capture_only=lambda key, record: captured.append(key) or True,
                           _upload=None)
    fake._warm_one = lambda *a, **k: CUDABackend._warm_one(fake, *a, **k)
    fake._weights_ready = lambda *a, **k: CUDABackend._weights_ready(fake, *a, **k)
    fake.decode_graph_keys = lambda mode: CUDABackend.decode_graph_keys(fake, mode)   # no short graph
    rec, captured = Recorder(), []
    CUDABackend.warm_up(fake, rec)
    assert rec.calls[0] == ("start", "compiling kernels, capturing graphs", 3 + 6)
    # the first bucket runs then captures; the later buckets are tried capture-only first
    assert captured == [("prefill", 64, (2,)), ("prefill", 128, (2,))] and ("prefill", 16, (1,)) in ran
    assert [c for c in rec.calls[1:-1]] == [("advance", 1)] * 9 and len(ran) + len(captured) == 9
    assert rec.calls[-1][0] == "done" and "kernel cache" in rec.calls[-1][1]


def test_the_cli_shows_progress_in_plain_lines_and_q_hides_it(fixture_gguf, capsys):
    args = ["run", "-m", str(fixture_gguf), "--backend", "cpu", "--ctx", "64", "-p", "Hello", "-n", "2",
            "--temp", "0", "--raw"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "reading weights: started" in err and "reading weights: done" in err
    assert "compiling CPU kernels: done" in err and "\r" not in err
    assert err.index("compiling CPU kernels: done") < err.index("ready in")
    assert main(args + ["-q"]) == 0
    err = capsys.readouterr().err
    assert "reading weights" not in err and "compiling CPU kernels" not in err and "ready in" in err


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_stderr_a_real_terminal_gets_the_bar(fixture_gguf):
    """`genie-rt run` with stderr on a pseudo-terminal: carriage returns, each step ended by
    a newline; the reply itself (stdout, a pipe) has none of it."""
    import subprocess
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "genie_rt.engine.cli", "run", "-m", str(fixture_gguf),
                             "--backend", "cpu", "--ctx", "64", "-p", "Hello", "-n", "2", "--temp", "0",
                             "--raw"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    try:
        while True:                # read while it runs: a full terminal buffer would block it
            try:
                chunk = os.read(master, 65536)
            except OSError:        # EIO: the child closed its end
                break
            if not chunk:
                break
            err += chunk
        stdout = proc.stdout.read()
        proc.wait(timeout=300)
    finally:
        os.close(master)
        proc.stdout.close()
    assert proc.returncode == 0 and b"\r" not in stdout and stdout
    text = err.decode().replace("\r\n", "\n")          # the tty turns "\n" into "\r\n"
    weights = [ln for ln in text.split("\n") if "reading weights [" in ln]
    assert len(weights) == 1 and weights[0].startswith("\rreading weights [") and "done in" in weights[0]
    assert any(ln.startswith("\rcompiling CPU kernels") and "done in" in ln for ln in text.split("\n"))
