"""A real `genie-rt serve` process for the reliability harnesses (soak.py, fuzz_server.py, faults.py).

    with ServerProcess(model, ["--ctx", "2048"], kv_dir=d) as srv:
        httpx.get(srv.base + "/health")
        srv.sample()            # {"rss_anon_kb", "vm_swap_kb", "fds", "threads", "kv_bytes", "gpu_mb"}
    srv.exit_code, srv.stop_seconds, srv.log_text()

The server's stdout and stderr go through a pipe read by a thread (never a file: faults.py
limits the process's file size with prlimit, which must not hit the log). `log_problems()`
lists the lines a healthy run never prints (tracebacks, ERROR lines, ASGI exceptions).
Also: `run_info()` - the command, device, date and commit every JSON report carries - and
`write_report()`, which puts them in front of a harness's report and writes it as JSON.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3-micro-q4km.gguf"
BAD_LOG = ("Traceback", "Exception in ASGI", "CancelledError")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def run_info(argv: list[str] | None = None) -> dict:
    """What every report records: the command, the device, the date (UTC) and the commit."""
    argv = sys.argv if argv is None else argv
    return {"command": " ".join(["python"] + [os.path.relpath(argv[0], ROOT) if argv and argv[0].endswith(".py")
                                              else argv[0]] + argv[1:]) if argv else "",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": {"cpu": _cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
                       "gpu": _gpu_name(), "python": platform.python_version()},
            "commit": _git_commit()}


def write_report(path: Path | None, report: dict, main_argv: list[str] | None = None) -> dict:
    """`report` after run_info() (main_argv: what the tool's main() was given, None for
    sys.argv), written as indented JSON to `path` (its folder made) when a path is given.
    Returns the full report."""
    full = {**run_info(sys.argv if main_argv is None else [sys.argv[0]] + main_argv), **report}
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(full, indent=1) + "\n")
    return full


def dir_bytes(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def proc_status(pid: int) -> dict:
    """RssAnon, VmSwap (KiB), open descriptors and threads of a live process."""
    out = {"rss_anon_kb": None, "vm_swap_kb": None, "threads": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "RssAnon":
                out["rss_anon_kb"] = int(value.split()[0])
            elif key == "VmSwap":
                out["vm_swap_kb"] = int(value.split()[0])
            elif key == "Threads":
                out["threads"] = int(value)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        out["fds"] = None
    return out


def gpu_memory_mb(pid: int) -> int | None:
    """This process's GPU memory from nvidia-smi (None without a GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


class ServerProcess:
    """`python -m genie_rt.engine.cli serve` on a free port; ready when /health answers 200."""

    def __init__(self, model: Path | str = FIXTURE, extra: list[str] | None = None, kv_dir: Path | None = None,
                 backend: str = "cpu", ready_timeout: float = 300.0, env: dict | None = None):
        self.model, self.kv_dir, self.backend = Path(model), kv_dir, backend
        self.extra = list(extra or [])
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._reader: threading.Thread | None = None
        self.exit_code: int | None = None
        self.stop_seconds: float | None = None
        self.start_seconds: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def argv(self) -> list[str]:
        cmd = [sys.executable, "-m", "genie_rt.engine.cli", "serve", "-m", str(self.model), "--backend", self.backend,
               "--port", str(self.port)] + self.extra
        if self.kv_dir is not None:
            cmd += ["--kv-cache-dir", str(self.kv_dir)]
        return cmd

    def start(self) -> "ServerProcess":
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=self.env, text=True, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = t0 + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready:\n"
                                   + self.log_text()[-3000:])
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server not ready in {self.ready_timeout:.0f} s:\n" + self.log_text()[-3000:])
            time.sleep(0.1)
        self.start_seconds = time.monotonic() - t0
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    def log_text(self) -> str:
        return "".join(self._lines)

    def log_problems(self) -> list[str]:
        return [line.rstrip() for line in self._lines
                if line.startswith(("ERROR", "CRITICAL")) or any(bad in line for bad in BAD_LOG)]

    def sample(self) -> dict:
        s = proc_status(self.pid)
        s["kv_bytes"] = dir_bytes(self.kv_dir)
        s["gpu_mb"] = gpu_memory_mb(self.pid) if self.backend != "cpu" else None
        return s

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig`, wait; record the exit code and how long it took."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.exit_code = None
        self.stop_seconds = time.monotonic() - t0
        if self._reader is not None:
            self._reader.join(5)
        return self.exit_code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        self.kill()
