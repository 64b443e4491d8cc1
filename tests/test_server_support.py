"""Helpers shared by the server tests (no tests here).

- `running_server(app)`: the app in a real uvicorn on a free loopback port, in a thread.
- `ScriptedEngine`: the fixture GGUF's real tokenizer and chat template, with replies
  scripted per test (text pieces, delays, exceptions), for what a random-weight model
  cannot show: tool calls, reasoning, failures, slow generations.
- `sse_events(response)`: reads an SSE body the way a llama-server client does: only
  `data: ` lines, JSON or [DONE].
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from genie_rt.engine.engine import Engine

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
