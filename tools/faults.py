"""Fault cases against a real `genie-rt serve` (CPU back-end by default), each a pass/fail with details.

    python tools/faults.py --json docs/reliability/faults-cpu.json
    python tools/faults.py --cases kill9_save,disk_full --model tests/models/SmolLM2-135M-Instruct.Q4_1.gguf

- kill9_save: SIGKILL right after a conversation's reply (the KV file is being written), five
  times; a restarted server on the same folder answers that conversation with the cold greedy
  reply, and every file left there is whole (a temp file is never read, a bad file is deleted).
- sigterm_stream: SIGTERM while a reply streams: the stream ends (error event, complete body),
  exit code 0, within --shutdown-timeout + 10 s.
- disk_full: the server's file-size limit set to 4 KiB (prlimit: writes fail with EFBIG as on
  a full disk): the reply still arrives, no partial file is left; limit lifted, the next save works.
- disconnect_storm: 16 streams closed after their first chunk, at once; the next request is
  served (same greedy text) within 60 s, the log is clean.
- oversized: a prompt longer than the context, a body over --max-body-mb, max_tokens 10^12:
  refused up front (400 / 413) or capped to the context, and the server still answers.
"""
from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import FIXTURE, ServerProcess, write_report  # noqa: E402

ASK = [{"role": "user", "content": "Turn on the kitchen light"}]
GREEDY = {"messages": ASK, "max_tokens": 8, "temperature": 0}
CTX = ["--ctx", "1024"]


def chat(base: str, **extra) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={**GREEDY, **extra}, timeout=300)


def content(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def kill9_save(model: Path, ref: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        kv = Path(d)
        for i in range(5):
            srv = ServerProcess(model, CTX, kv_dir=kv).start()
            r = chat(srv.base, conversation_id="conv", max_tokens=8 + i)
            srv.proc.send_signal(signal.SIGKILL)
            srv.kill()
            assert r.status_code == 200, r.text
        left = sorted(p.name for p in kv.iterdir())
        srv = ServerProcess(model, CTX, kv_dir=kv).start()
        try:
            r = chat(srv.base, conversation_id="conv")
            again = chat(srv.base, conversation_id="conv")
        finally:
            srv.stop()
        ok = r.status_code == 200 and content(r) == ref and content(again) == ref and not srv.log_problems()
        return {"passed": ok, "files_left_after_kills": left, "reply_after_restart_is_cold_greedy": content(r) == ref,
                "log_problems": srv.log_problems()[:5]}


def sigterm_stream(model: Path, ref: str) -> dict:
    srv = ServerProcess(model, CTX + ["--shutdown-timeout", "2"]).start()
    lines: list[str] = []
    with httpx.stream("POST", srv.base + "/v1/chat/completions", timeout=60,
                      json={"messages": ASK, "stream": True, "max_tokens": 900, "ignore_eos": True,
                            "temperature": 0}) as r:
        it = r.iter_lines()
        lines.append(next(it))
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        lines += [x for x in it if x]
    rc = srv.proc.wait(60)
    srv.kill()
    seconds = time.monotonic() - t0
    last = lines[-1] if lines else ""
    ok = rc == 0 and seconds < 12 and ('"error"' in last or last == "data: [DONE]") and not srv.log_problems()
    return {"passed": ok, "exit_code": rc, "exit_seconds": round(seconds, 2), "last_line": last[:200],
            "log_problems": srv.log_problems()[:5]}


def disk_full(model: Path, ref: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        kv = Path(d)
        srv = ServerProcess(model, CTX, kv_dir=kv).start()
        try:
            chat(srv.base)                                     # warm: nothing else is written later
            resource.prlimit(srv.pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            r = chat(srv.base, conversation_id="full")
            time.sleep(1.0)
            after_full = sorted(p.name for p in kv.iterdir())
            resource.prlimit(srv.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            r2 = chat(srv.base, conversation_id="full")
            time.sleep(1.0)
            after_lift = sorted(p.name for p in kv.iterdir())
        finally:
            srv.stop()
        ok = r.status_code == 200 and content(r) == ref and after_full == [] and after_lift == ["full.kv"] \
            and r2.status_code == 200 and srv.exit_code == 0
        logged = [x for x in srv.log_text().splitlines() if "full" in x and "kv cache" in x][:3]
        return {"passed": ok, "reply_status": r.status_code, "files_when_full": after_full,
                "files_after_limit_lifted": after_lift, "log": logged}


def disconnect_storm(model: Path, ref: str) -> dict:
    srv = ServerProcess(model, CTX + ["--max-queue", "64"]).start()
    try:
        def one():
            try:
                with httpx.stream("POST", srv.base + "/v1/chat/completions", timeout=120,
                                  json={"messages": ASK, "stream": True, "max_tokens": 200, "temperature": 0}) as r:
                    next(r.iter_lines())
            except httpx.HTTPError:
                pass
        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t0 = time.monotonic()
        r = chat(srv.base)
        seconds = time.monotonic() - t0
    finally:
        srv.stop()
    ok = r.status_code == 200 and content(r) == ref and seconds < 60 and not srv.log_problems()
    return {"passed": ok, "next_request_seconds": round(seconds, 2), "same_greedy_text": content(r) == ref,
            "log_problems": srv.log_problems()[:5]}


def oversized(model: Path, ref: str) -> dict:
    srv = ServerProcess(model, ["--ctx", "256", "--max-body-mb", "1"]).start()
    try:
        t0 = time.monotonic()
        long_prompt = httpx.post(srv.base + "/v1/completions", json={"prompt": "word " * 2000, "max_tokens": 2},
                                 timeout=120)
        long_s = time.monotonic() - t0
        big_body = httpx.post(srv.base + "/v1/chat/completions", timeout=120,
                              content=b'{"messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}',
                              headers={"Content-Type": "application/json"})
        huge_n = chat(srv.base, max_tokens=10 ** 12)
        after = chat(srv.base)
    finally:
        srv.stop()
    ok = long_prompt.status_code == 400 and big_body.status_code == 413 and huge_n.status_code in (200, 400) \
        and after.status_code == 200 and content(after) == ref
    return {"passed": ok, "prompt_over_context": [long_prompt.status_code, long_prompt.json()["error"]["message"][:160]],
            "refused_in_seconds": round(long_s, 2), "body_over_limit": big_body.status_code,
            "max_tokens_1e12": huge_n.status_code, "still_serving": after.status_code == 200}


CASES = {"kill9_save": kill9_save, "sigterm_stream": sigterm_stream, "disk_full": disk_full,
         "disconnect_storm": disconnect_storm, "oversized": oversized}


def reference(model: Path) -> str:
    with ServerProcess(model, CTX) as srv:
        return content(chat(srv.base))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=FIXTURE)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    ref = reference(a.model)
    results = {}
    for name in a.cases.split(","):
        t0 = time.monotonic()
        try:
            results[name] = CASES[name](a.model, ref)
        except Exception as exc:  # noqa: BLE001 - a case that crashes is a failed case
            results[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(name, json.dumps(results[name]), flush=True)
    report = write_report(a.json, {"tool": "faults", "model": a.model.name, "cases": results,
                                   "passed": all(r["passed"] for r in results.values())}, argv)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
