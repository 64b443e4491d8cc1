"""Helpers shared by the server tests (no tests here).

- `running_server(app)`: the app in a real uvicorn on a free loopback port, in a thread.
- `ScriptedEngine`: the fixture GGUF's real tokenizer and chat template, with replies
  scripted per test (text pieces, delays, exceptions), for what a random-weight model
  cannot show: tool calls, reasoning, failures, slow generations.
- `sse_events(response)`: reads an SSE body the way a llama-server client does: only
  `data: ` lines, JSON or [DONE].
- `serve_fixture_model` / `greedy_reference`: what conftest.py's `server` and `reference` fixtures
  are (the fixture model on the CPU back-end behind a real uvicorn, one per module, and its greedy
  answer to GREEDY); `chat`, `stream_chat`, `metric_values` (a strict Prometheus reader) and
  `wait_idle` are test_server.py's and test_server_invalid.py's.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import threading
import time

import httpx

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import ServerSettings, create_app

import uvicorn

from genie_rt.engine.generate import Delta, Done, GenerationResult


@contextlib.contextmanager
def running_server(app, server_cls=uvicorn.Server, graceful_timeout: float = 2.0):
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when proto is TCP
    # (with proto 0, every response waits ~40 ms for a delayed ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_timeout)
    server = server_cls(config) if server_cls is uvicorn.Server else server_cls(config, app.state.genie)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def sse_events(response) -> list:
    """JSON objects of `data: ` lines, and the string "[DONE]"; other lines are ignored."""
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class ScriptedEngine:
    """Real tokenizer/template, scripted generation. `reply(request)` returns a list of text
    pieces (str), floats (sleep that many seconds, checking cancel) and exceptions (raised)."""

    def __init__(self, real, n_ctx: int = 512):
        self.tokenizer = real.tokenizer
        self.template = real.template
        self.cfg = real.cfg
        self.n_ctx = n_ctx
        self.model_name = "scripted-model"
        self.kv_tokens: list[int] = []
        self.reply = lambda req: ["Hello"]
        self.requests = []              # every GenerationRequest seen
        self.finished = []              # finish_reason of each generation

    def raw_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    chat_prompt_text = Engine.chat_prompt_text  # only needs .template and .tokenizer

    def generate(self, req):
        self.requests.append(req)
        t0 = time.perf_counter()
        n, finish, text = 0, "stop", ""
        for item in self.reply(req):
            if req.cancel is not None and req.cancel.is_set():
                finish = "cancelled"
                break
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, float):
                end = time.monotonic() + item
                while time.monotonic() < end and not (req.cancel is not None and req.cancel.is_set()):
                    time.sleep(0.002)
                continue
            n += 1
            text += item
            yield Delta(item, [0])
            if req.max_tokens is not None and n >= req.max_tokens:
                finish = "length"
                break
        self.finished.append(finish)
        ms = (time.perf_counter() - t0) * 1000
        yield Done(GenerationResult(text=text, tokens=[0] * n, finish_reason=finish, stop_word=None,
                                    n_prompt=len(req.prompt), n_cached=0, prompt_ms=ms / 2,
                                    n_generated=n, gen_ms=ms / 2))


N_CTX = 1024
MESSAGES = [{"role": "system", "content": "You are a home assistant."},
            {"role": "user", "content": "Turn on the kitchen light"}]
# A random-weight model repeats itself at temperature 0; a presence penalty makes a reply varied
# enough to test stop strings with.
GREEDY = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "presence_penalty": 1.0}


def serve_fixture_model(fixture_gguf):
    """(a generator for a module's `server` fixture) an httpx client of the fixture model on the CPU
    back-end behind a real uvicorn."""
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=N_CTX))
    app = create_app(engine, ServerSettings(max_queue=4, model_path=str(fixture_gguf)))
    with running_server(app) as (base, _, _):
        with httpx.Client(base_url=base, timeout=60) as client:
            yield client


def greedy_reference(server) -> str:
    """(a module's `reference` fixture) the greedy answer to GREEDY: every later check of 'the next
    answer is unchanged' uses it."""
    r = server.post("/v1/chat/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def chat(client, **fields) -> httpx.Response:
    return client.post("/v1/chat/completions", json={**GREEDY, **fields})


def stream_chat(client, **fields) -> tuple[httpx.Headers, list]:
    with client.stream("POST", "/v1/chat/completions", json={**GREEDY, "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        return r.headers, sse_events(r)


def metric_values(text: str) -> dict[str, float]:
    """A strict reader of Prometheus text format 0.0.4: fails on any malformed line."""
    name_re = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    sample = re.compile(rf"^({name_re})(\{{{name_re}=\"[^\"]*\"(,{name_re}=\"[^\"]*\")*\}})? (\S+)$")
    values, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP ") or not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge"), line
            typed.add(name)
            continue
        m = sample.match(line)
        assert m, f"malformed metrics line: {line!r}"
        assert m.group(1) in typed, f"{m.group(1)} has no TYPE line"
        value = float(m.group(4))
        assert not math.isnan(value)
        values[m.group(1) + (m.group(2) or "")] = value
    return values


def wait_idle(client, timeout=10.0) -> dict:
    """/metrics once the worker holds no request (it may still be between Done and idle)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(client.get("/metrics").text)
        if m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0:
            return m
        assert time.monotonic() < deadline, "the worker is still busy"
        time.sleep(0.02)
