"""SIGTERM drains as docs/server.md says, on a real `genie-rt serve` process (issue 20 item 6).

A stream still running when --shutdown-timeout expires ends with the documented error event
(a complete chunked body, no [DONE]); a request still queued then gets the 503 JSON error; the
process exits 0 and logs no exception (no traceback, no CancelledError).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ASK = [{"role": "user", "content": "Tell me a long story"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_cuts_streams_with_the_error_event_and_queued_requests_get_503(fixture_gguf):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "genie_rt.engine.cli", "serve", "-m", str(fixture_gguf),
                             "--backend", "cpu", "--ctx", "4096", "--port", str(port), "--shutdown-timeout", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.1)
        long_body = {"messages": ASK, "stream": True, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        queued: dict = {}

        def queued_request():     # waits behind the stream, still queued when the deadline comes
            try:
                r = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8}, timeout=30)
                queued["status"], queued["body"] = r.status_code, r.json()
            except Exception as exc:        # noqa: BLE001 - reported by the assert below
                queued["error"] = repr(exc)

        with httpx.stream("POST", base + "/v1/chat/completions", json=long_body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            waiter = threading.Thread(target=queued_request)
            waiter.start()
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]   # raises on a cut chunked body
        waiter.join(30)
        last = json.loads(rest[-1][6:])
        assert "error" in last and last["error"]["code"] == 503, rest[-3:]
        assert "data: [DONE]" not in rest
        assert queued.get("status") == 503, queued
        assert queued["body"]["error"]["type"] == "unavailable_error"
        assert proc.wait(20) == 0
        log = proc.stdout.read().decode()
        for bad in ("Traceback", "CancelledError", "Exception in ASGI", "ERROR"):
            assert bad not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
