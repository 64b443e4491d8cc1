"""The HTTP server: llama-server's routes (and Ollama's, Anthropic's, the Responses API) over one engine worker.

    app = create_app(engine, ServerSettings())            # an engine already loaded
    app = create_app(lambda: Engine.load(path), settings)  # loads in the background
    serve(args, engine_config, settings)                  # `genie-rt serve`: uvicorn, signals

Routes (docs/server.md has every field):
- OpenAI: POST /v1/chat/completions, /v1/completions, /v1/responses (responses.py); GET /v1/models
- llama-server: POST /completion (/completions), /tokenize, /detokenize, /apply-template; GET /health,
  /props, /metrics, /slots; POST /slots/{id}?action=save|restore|erase (slots.py)
- Anthropic: POST /v1/messages, /v1/messages/count_tokens (anthropic.py)
- Ollama: /api/chat, /api/generate, /api/tags, /api/show, /api/version, /api/ps (ollama.py)
- GET /: the chat page (webui.py; --no-webui: 404), with /manifest.webmanifest, /_app/version.json,
  and /sw.js (a service worker that removes the one llama-server's web UI left in a browser)
While the model loads, every route but the page answers 503 "Loading model"; the port is
bound first so a supervisor can watch that. A path with a trailing slash is not another
spelling of a route: 404, as llama-server (no redirect).

Modules: jobs.py (prompt -> job -> events, shared by every API), generation.py (the OpenAI and
llama-server generation routes), info.py (the others), state.py (settings, engine, worker),
worker.py (the engine thread and its bounded queue), streaming.py (body limit, disconnects,
SSE), openai_format.py (response objects and the tool-call/reasoning stream parser),
schemas.py, chat_request.py, completion_request.py (validation), prompt_limits.py (bounded
tokenization), http_middleware.py (CORS, API key), cli_args.py (the command line), metrics.py,
errors.py. This file puts them together.

SIGTERM / SIGINT: stop accepting, let running and queued requests finish for up to
`shutdown_timeout` seconds, then cancel what is left - a running stream ends with its API's
error event, a queued request gets the 503 JSON error - stop the worker, exit 0 (conversation
caches are saved at the end of each turn, a cancelled one included).

What it deliberately does not do: batching (several slots are reported with -np, one worker
serves them in turn), embeddings. (Constrained output and logprobs: server/constraints.py.)
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from genie_rt.engine.generate import GenerationRequest

from . import anthropic, info, ollama, responses, slots, webui
from .errors import ApiError
from .generation import chat_completions, chat_input_tokens, completion_native, completions
from .http_middleware import APIKeyMiddleware, CORSMiddleware
from .state import ServerSettings, ServerState

__all__ = ["GracefulServer", "ServerSettings", "ServerState", "create_app", "serve", "warm_up"]

log = logging.getLogger("genie_rt.server")

PUBLIC_PATHS = ("/health", "/v1/health") + webui.PUBLIC_PATHS


async def _not_found(request: Request, exc) -> Response:
    return ApiError(404, "File Not Found").response()


async def _method_not_allowed(request: Request, exc) -> Response:
    return ApiError(405, f"method {request.method} is not allowed on {request.url.path}").response()


async def _internal_error(request: Request, exc) -> Response:
    return ApiError(500, f"internal error: {type(exc).__name__}").response()


def routes(settings: ServerSettings) -> list[Route]:
    out = [
        Route("/health", info.health, methods=["GET"]),
        Route("/v1/health", info.health, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completion", completion_native, methods=["POST"]),
        Route("/completions", completion_native, methods=["POST"]),
        Route("/v1/models", info.models, methods=["GET"]),
        Route("/models", info.models, methods=["GET"]),
        Route("/props", info.props, methods=["GET"]),
        Route("/metrics", info.metrics, methods=["GET"]),
        Route("/tokenize", info.tokenize, methods=["POST"]),
        Route("/detokenize", info.detokenize, methods=["POST"]),
        Route("/apply-template", info.apply_template, methods=["POST"]),
        Route("/slots", slots.list_slots, methods=["GET"]),
        Route("/slots/{id_slot}", slots.slot_action, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/responses", responses.create, methods=["POST"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    ]
    out += ollama.routes()
    out += webui.routes(settings.webui)     # /sw.js also without the page
    return out


def create_app(engine_or_loader, settings: ServerSettings | None = None) -> Starlette:
    """The Starlette app around an engine, or around a callable that loads one (then the
    model loads in a background thread when the app starts, and /health says 503 meanwhile)."""
    settings = settings or ServerSettings()
    state = ServerState(engine_or_loader, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await run_in_threadpool(int)   # the thread pool's first use (its imports) before any request
        state.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.shutdown)

    middleware = [
        Middleware(CORSMiddleware, origins=settings.cors_origins),
        Middleware(APIKeyMiddleware, keys=settings.keys(), public_paths=PUBLIC_PATHS),
    ]
    app = Starlette(routes=routes(settings), middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: _not_found, 405: _method_not_allowed, 500: _internal_error})
    app.router.redirect_slashes = False      # "/health/" is a 404, as llama-server, not a 307 to /health
    app.state.genie = state
    return app


# --- `genie-rt serve` -------------------------------------------------------------------------------------
def warm_up(engine) -> None:
    """Run one short generation so kernels compile (CUDA) before the server says ready."""
    from genie_rt.engine.sampling import SamplingParams
    prompt = engine.raw_prompt("Hello") or [0]
    for _ in engine.generate(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0), max_tokens=2)):
        pass
    # the prompt path's one-time costs, which the first request would otherwise wait for (0.7 s
    # for Gemma 3's vocabulary on the first request, 2026-12-03): the vocabulary's longest piece
    # (prompt_limits), SentencePiece's pair table, the chat template's first render
    engine.tokenizer.prepare()
    from .jobs import render_chat
    try:
        text, _ = render_chat(engine.template, [{"role": "system", "content": "You are a home assistant."},
                                                {"role": "user", "content": "Turn the kitchen lights down."}], None, {})
    except Exception as exc:      # a template that needs more than this: requests show its error
        log.debug("chat template warm-up: %s", exc)
        text = "Turn the kitchen lights down.\n"
    engine.tokenizer.encode(text, add_special=True, parse_special=True)
    # constrained output's vocabulary (engine/constrain.py): seconds for a large vocabulary,
    # holding the GIL, so now rather than inside the first JSON-schema request
    from genie_rt.engine import constrain
    try:
        constrain.prepare(engine.tokenizer)
    except Exception as exc:   # constrained requests will then fail with the reason
        log.warning("constrained output is unavailable: %s", exc)


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: a signal first stops new jobs (503 while draining); after
    `shutdown_timeout` seconds the jobs still running or queued are cancelled, so each one is
    answered by its own handler (a stream's error event, a queued request's 503 JSON) before
    uvicorn's own deadline (a few seconds later) would cut connections; a graceful SIGTERM
    exits 0 instead of re-raising the signal once shutdown is done."""

    CUT_MARGIN_S = 5.0      # uvicorn's timeout_graceful_shutdown = shutdown_timeout + this

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._abort_timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        worker = self.state.worker
        if worker is not None:
            worker.drain()
            if self._abort_timer is None:
                timeout = max(0.0, float(self.state.settings.shutdown_timeout))
                self._abort_timer = threading.Timer(timeout, worker.abort_all)
                self._abort_timer.daemon = True
                self._abort_timer.start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def chat_template_override(args, engine):
    """The template --chat-template / --chat-template-file name, or None to keep the GGUF's."""
    from genie_rt.engine.chat import ChatTemplate

    from .builtin_templates import TEMPLATES
    meta = engine.gfile.metadata
    common = dict(bos_token=engine.template.bos_token, eos_token=engine.template.eos_token,
                  add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    path = getattr(args, "chat_template_file", None)
    if path:
        return ChatTemplate(Path(path).read_text(encoding="utf-8"), origin=f"--chat-template-file {path}", **common)
    name = getattr(args, "chat_template", None)
    if not name:
        return None
    if f"tokenizer.chat_template.{name}" in meta:
        return ChatTemplate.from_gguf_metadata(meta, name=name)
    if name in TEMPLATES:
        return ChatTemplate(TEMPLATES[name], origin=f"built-in {name} template", **common)
    if getattr(args, "jinja", False) or any(c in name for c in "{} \n"):
        # not a name: Jinja source, as llama-server --jinja reads an unknown --chat-template value
        return ChatTemplate(name, origin="--chat-template", **common)
    named = sorted(k.rsplit(".", 1)[1] for k in meta if k.startswith("tokenizer.chat_template."))
    raise ValueError(f"--chat-template {name!r}: not a template this server knows; use one of "
                     f"{', '.join(TEMPLATES)}" + (f", one of the GGUF's ({', '.join(named)})" if named else "")
                     + ", Jinja source, or --chat-template-file")


def bind_sockets(hosts: str, port: int) -> list[socket.socket]:
    """Listening sockets for a comma-separated host list (llama-server's `--host 127.0.0.1,::1`);
    port 0 picks one free port for all of them."""
    out: list[socket.socket] = []
    try:
        for host in [h.strip().strip("[]") for h in hosts.split(",") if h.strip()]:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                                       flags=socket.AI_PASSIVE)
            family, _, proto, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(2048)
            sock.set_inheritable(True)
            port = port or sock.getsockname()[1]
            out.append(sock)
    except OSError:
        for sock in out:
            sock.close()
        raise
    if not out:
        raise ValueError(f"--host {hosts!r} names no address")
    return out


SWITCH_INTERVAL_S = 0.0005


def serve(args, engine_config, settings: ServerSettings | None = None) -> int:
    """`genie-rt serve`: bind, load the model in the background, serve until SIGTERM/SIGINT."""
    settings = settings or ServerSettings.from_args(args)
    model_path = args.model
    if not Path(model_path).is_file():  # fail before binding the port, with the CLI's error line
        raise FileNotFoundError(f"model file not found: {model_path}")

    def load():
        from genie_rt.engine.engine import Engine
        from genie_rt.engine.cli import load_progress
        engine = Engine.load(model_path, engine_config, progress=load_progress(args))
        template = chat_template_override(args, engine)
        if template is not None:
            engine.template = template
        from genie_rt.engine.load_report import ready_summary
        log.info("model %s on %s, context %d; warming up\n%s", engine.model_name,
                 getattr(engine.backend, "name", "?"), engine.n_ctx, ready_summary(engine))
        warm_up(engine)
        return engine

    # The engine worker holds the GIL between its kernels (which release it); every request
    # the event loop answers needs it several times, and Python hands it over every 5 ms by
    # default. At 0.5 ms /health answered in 2.1 ms (p50; max 8.7) instead of 4.4 (max 15)
    # while the CPU back-end generated (Gemma 3 270M, 2 cores, keep-alive client, 2026-12-02).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(load, settings)
    state: ServerState = app.state.genie
    config = uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                            log_level="debug" if settings.verbose else "info", access_log=settings.verbose,
                            timeout_graceful_shutdown=settings.shutdown_timeout + GracefulServer.CUT_MARGIN_S,
                            server_header=False)
    server = GracefulServer(config, state)
    state.on_load_failed = lambda: setattr(server, "should_exit", True)
    sockets = bind_sockets(settings.host, settings.port)   # bound before the model loads: /health says 503
    log.info("listening on %s (loading %s)", ", ".join(
        "http://%s:%d" % (f"[{s.getsockname()[0]}]" if s.family == socket.AF_INET6 else s.getsockname()[0],
                          s.getsockname()[1]) for s in sockets), model_path)
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    return 1 if state.status == "error" else 0
