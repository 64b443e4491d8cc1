#!/usr/bin/env python3
"""Start-up time of `genie-rt serve` with an empty and with a filled kernel cache.

Each phase starts a real server process (`python -m genie_rt.engine.cli serve -m MODEL
--kernel-cache DIR [serve args]`), times process start -> first `GET /health` 200, then
sends three streamed chat requests that share a long system prompt (each with another
user question) and times each one's first token (the first SSE chunk carrying text),
then stops the server with SIGTERM:

    cold   DIR is empty: every kernel is compiled (and written to DIR)
    warm   the same DIR, now filled: kernels are loaded from it

The server's "CUDA kernels compiled and N graphs captured in S s; kernel cache: ..." log
line is kept for each phase. Prints a table; writes everything to --json.

    python tools/synth_gguf.py --shape 4b -o /tmp/qwen3-4b.gguf
    python tools/bench_start.py -m /tmp/qwen3-4b.gguf --json start-h200.json
    python tools/bench_start.py -m model.gguf --phases warm --cache-dir /var/cache/genie-rt -- --ctx 4096

Arguments after `--` go to `serve` unchanged. Without --cache-dir a temporary folder is
used and removed at the end; a given --cache-dir must hold no kernel cache yet when the
cold phase runs (clear it with `genie-rt cache clear --kernel-cache DIR`).
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("kitchen light living room thermostat evening scene motion sensor hallway door lock "
         "garage weather forecast reminder calendar music volume bedroom blinds window garden "
         "sprinkler energy report temperature humidity morning routine alarm camera porch").split()


def system_prompt(n_words: int) -> str:
    """A deterministic home-assistant style system prompt of n_words words."""
    body = " ".join(WORDS[(i * 7 + i // 5) % len(WORDS)] for i in range(n_words))
    return "You are a home assistant. Devices and context follow. " + body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_health(port: int, timeout: float = 2.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        body = r.read()
        return r.status, (json.loads(body) if body else {})
    finally:
        conn.close()


def chat_ttft(port: int, system: str, question: str, max_tokens: int, timeout: float) -> dict:
    """One streamed chat request: ms to the first chunk with text, ms to the end, usage."""
    req = {"model": "bench", "stream": True, "temperature": 0, "max_tokens": max_tokens,
           "stream_options": {"include_usage": True},
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    first = None
    usage = timings = None
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(req),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"chat request answered {r.status}: {r.read()[:500]!r}")
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for ch in chunk.get("choices") or []:
                d = ch.get("delta") or {}
                if first is None and (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")):
                    first = time.perf_counter()
    finally:
        conn.close()
    end = time.perf_counter()
    return {"ttft_ms": None if first is None else round((first - t0) * 1e3, 1),
            "total_ms": round((end - t0) * 1e3, 1),
            "prompt_ms": None if not timings else round(float(timings.get("prompt_ms", 0)), 1),
            "usage": usage, "timings": timings}


def compile_line(log_path: Path) -> str | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if "CUDA kernels compiled" in line:
            return line.split(": ", 1)[-1].strip()
    return None


def load_lines(log_path: Path) -> list[str]:
    """The serve log's account of the load: the timeline, each step's "done in" line and the
    graphs-by-kind line (engine/engine.py, engine/progress.py, engine/backend_cuda.py)."""
    keep = ("load timeline", ": done", "graphs by kind", "ready in", "request timings")
    return [line.strip() for line in log_path.read_text(errors="replace").splitlines()
            if any(k in line for k in keep)][:40]


def folder_size(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*.kc") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


PHASE_ARGS = {"cold": [], "warm": [], "warm-overlap": ["--overlap-load"]}   # phase -> more serve arguments


def run_phase(name: str, args, cache: Path, logs: Path) -> dict:
    port = args.port or free_port()
    log_path = logs / f"serve-{name}.log"
    cmd = [sys.executable, "-m", "genie_rt.engine.cli", "serve", "-m", args.model, "--port", str(port),
           "--kernel-cache", str(cache)] + args.serve_args + PHASE_ARGS[name]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    print(f"[{name}] {' '.join(cmd)}", file=sys.stderr)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            health = None
            while time.perf_counter() - t0 < args.timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {proc.returncode} before /health was 200; "
                                       f"log tail:\n{log_path.read_text(errors='replace')[-3000:]}")
                try:
                    status, body = get_health(port)
                    if status == 200:
                        health = body
                        break
                except (OSError, http.client.HTTPException, ValueError):
                    pass
                time.sleep(0.1)
            if health is None:
                raise RuntimeError(f"/health was not 200 within {args.timeout} s (log: {log_path})")
            health_s = time.perf_counter() - t0
            system = system_prompt(args.system_words)
            reqs = [chat_ttft(port, system, f"Question {i + 1}: is the {WORDS[i]} on?", args.max_tokens,
                              args.timeout) for i in range(args.requests)]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    entries, nbytes = folder_size(cache)
    return {"phase": name, "health_s": round(health_s, 2), "requests": reqs, "device": health.get("device"),
            "n_ctx": health.get("n_ctx"), "compile_log": compile_line(log_path),
            "load_log": load_lines(log_path),
            "cache_entries": entries, "cache_bytes": nbytes, "log": str(log_path)}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_table(runs: list[dict]) -> None:
    print(f"{'phase':6s} {'/health 200':>12s} {'first token, ms (prefill ms)':>40s} {'entries':>8s} {'MiB':>7s}"
          "  compile log")
    for r in runs:
        ttft = " / ".join(f"{_ms(q['ttft_ms'])} ({_ms(q['prompt_ms'])})" for q in r["requests"])
        print(f"{r['phase']:6s} {r['health_s']:10.1f} s {ttft:>40s} {r['cache_entries']:8d} "
              f"{r['cache_bytes'] / 2**20:7.1f}  {r['compile_log'] or '(no CUDA compile line: CPU back-end?)'}")
    for i, q in enumerate(runs[0]["requests"] if runs else []):
        u = q.get("usage") or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        print(f"request {i + 1}: {u.get('prompt_tokens')} prompt tokens, {cached} reused from the previous one")
    print("first token = the first streamed chunk with text (a client's view); prefill = the server's "
          "timings.prompt_ms")


def _timeline(run: dict) -> dict[str, float]:
    """The serve log's "load timeline" line as {phase: seconds}."""
    line = next((l for l in run.get("load_log", []) if "load timeline" in l), "")
    out = {}
    for part in line.split("load timeline:", 1)[-1].split(";"):
        m = re.match(r"\s*\(?(?:of which )?(.+?) ([0-9.]+) s\)?\s*$", part)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def markdown(path: str) -> str:
    """A docs table from a saved --json file (docs numbers are regenerated, not typed)."""
    d = json.loads(Path(path).read_text())
    rows = ["| phase | /health 200 | first token, ms (prefill ms), requests 1 / 2 / 3 | warm-up | back-end | "
            "before the back-end |", "|---|---|---|---|---|---|"]

    def sec(v):
        return "-" if v is None else f"{v:.1f} s"
    for r in d["runs"]:
        t = _timeline(r)
        ttft = " / ".join(f"{_ms(q['ttft_ms'])} ({_ms(q['prompt_ms'])})" for q in r["requests"])
        parts = [t[k] for k in ("process start to load", "file, tokenizer, template", "device query", "memory plan")
                 if k in t]
        rows.append(f"| {r['phase']} | {r['health_s']:.1f} s | {ttft} | {sec(t.get('warm-up'))} | "
                    f"{sec(t.get('back-end'))} | {sec(sum(parts) if parts else None)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--markdown"]:
        if len(argv) != 2:
            raise SystemExit("usage: bench_start.py --markdown RESULT.json")
        print(markdown(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--phases", default="cold,warm",
                    help="comma separated: cold, warm, warm-overlap (a warm start with --overlap-load); "
                         "default cold,warm")
    ap.add_argument("--cache-dir", default=None, help="kernel cache folder (default: a temporary one)")
    ap.add_argument("--keep-cache", action="store_true", help="do not delete the temporary cache folder")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=600, help="words in the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for /health and each request")
    ap.add_argument("--json", default="bench_start.json", help="where to write the results")
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for `genie-rt serve`")
    args = ap.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASE_ARGS for p in phases):
        ap.error(f"--phases takes {', '.join(PHASE_ARGS)}, got {args.phases!r}")
    if not Path(args.model).is_file():
        ap.error(f"model {args.model!r} is not a file")
    temp = args.cache_dir is None
    cache = Path(tempfile.mkdtemp(prefix="genie-kernels-")) if temp else Path(args.cache_dir).expanduser()
    if "cold" in phases and any(cache.glob("*/*.kc")):
        ap.error(f"{cache} already holds cached kernels: the cold phase needs an empty folder "
                 f"(genie-rt cache clear --kernel-cache {cache})")
    logs = Path(tempfile.mkdtemp(prefix="genie-bench-start-"))
    runs = []
    try:
        for name in phases:
            runs.append(run_phase(name, args, cache, logs))
    finally:
        if temp and not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
              "command": " ".join([sys.executable, *sys.argv]), "model": args.model,
              "serve_args": args.serve_args, "system_words": args.system_words, "runs": runs}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print_table(runs)
    print(f"wrote {args.json}; server logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
