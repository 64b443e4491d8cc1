"""The HTTP server: llama-server's OpenAI-compatible routes over one engine worker.

    app = create_app(engine, ServerSettings())            # an engine already loaded
    app = create_app(lambda: Engine.load(path), settings)  # loads in the background
    serve(args, engine_config)                            # `genie-rt serve`: uvicorn, signals

Routes: POST /v1/chat/completions, POST /v1/completions, POST /completion (llama-server's own
format; also /completions), GET /v1/models, GET /health,
GET /props, GET /metrics, POST /tokenize, /detokenize, /apply-template (docs/server.md has
every field). While the model loads, /health (and every other route) answers 503
"Loading model"; the port is bound first so a supervisor can watch that.

Modules: generation.py (the two generation routes), info.py (the others), state.py
(settings, engine, worker), worker.py (the engine thread and its bounded queue),
streaming.py (body limit, disconnects, SSE), openai_format.py (response objects and the
tool-call/reasoning stream parser), schemas.py (validation), metrics.py, errors.py. This
file puts them together: routes, CORS, the API key, and `serve`.

SIGTERM / SIGINT: stop accepting, let running and queued requests finish for up to
`shutdown_timeout` seconds, cancel what is left (conversation caches are saved at the end
of each turn, a cancelled one included), stop the worker, exit 0.

What it deliberately does not do: batching or several slots, grammar-constrained sampling,
logprobs, embeddings, the web UI, llama-server's non-OpenAI /completion route.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import signal
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from genie_rt.engine.generate import GenerationRequest

from . import info
from .errors import ApiError
from .generation import chat_completions, completion_native, completions
from .state import ServerSettings, ServerState

__all__ = ["GracefulServer", "ServerSettings", "ServerState", "create_app", "serve", "warm_up"]

log = logging.getLogger("genie_rt.server")

PUBLIC_PATHS = ("/health", "/v1/health")


class APIKeyMiddleware:
    """Authorization: Bearer KEY or X-Api-Key: KEY on every route but /health (and CORS preflight)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if (self.key is None or scope["type"] != "http" or scope["path"] in PUBLIC_PATHS
                or scope["method"] == "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        auth = headers.get("authorization", "")
        candidates = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
        candidates += headers.getlist("x-api-key")
        if any(hmac.compare_digest(k.encode("utf-8", "replace"), self.key) for k in candidates):
            return await self.app(scope, receive, send)
        response = ApiError(401, "Invalid API Key", headers={"WWW-Authenticate": "Bearer"}).response()
        await response(scope, receive, send)


async def _not_found(request: Request, exc) -> Response:
    return ApiError(404, "File Not Found").response()


async def _method_not_allowed(request: Request, exc) -> Response:
    return ApiError(405, f"method {request.method} is not allowed on {request.url.path}").response()


async def _internal_error(request: Request, exc) -> Response:
    return ApiError(500, f"internal error: {type(exc).__name__}").response()


def create_app(engine_or_loader, settings: ServerSettings | None = None) -> Starlette:
    """The Starlette app around an engine, or around a callable that loads one (then the
    model loads in a background thread when the app starts, and /health says 503 meanwhile)."""
    settings = settings or ServerSettings()
    state = ServerState(engine_or_loader, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.shutdown)

    routes = [
        Route("/health", info.health, methods=["GET"]),
        Route("/v1/health", info.health, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
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
    ]
    middleware = [
        Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]),
        Middleware(APIKeyMiddleware, api_key=settings.api_key),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: _not_found, 405: _method_not_allowed, 500: _internal_error})
    app.state.genie = state
    return app


# --- `genie-rt serve` -------------------------------------------------------------------------------------
def warm_up(engine) -> None:
    """Run one short generation so kernels compile (CUDA) before the server says ready."""
    from genie_rt.engine.sampling import SamplingParams
    prompt = engine.raw_prompt("Hello") or [0]
    for _ in engine.generate(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0), max_tokens=2)):
        pass


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: a signal first stops new jobs (503 while draining), and a graceful
    SIGTERM exits 0 instead of re-raising the signal once shutdown is done."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if self.state.worker is not None:
            self.state.worker.drain()
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


def serve(args, engine_config) -> int:
    """`genie-rt serve`: bind, load the model in the background, serve until SIGTERM/SIGINT."""
    settings = ServerSettings.from_args(args)
    model_path = args.model
    if not Path(model_path).is_file():  # fail before binding the port, with the CLI's error line
        raise FileNotFoundError(f"model file not found: {model_path}")

    def load():
        from genie_rt.engine.engine import Engine
        engine = Engine.load(model_path, engine_config)
        log.info("model %s on %s, context %d; warming up", engine.model_name,
                 getattr(engine.backend, "name", "?"), engine.n_ctx)
        warm_up(engine)
        return engine

    app = create_app(load, settings)
    state: ServerState = app.state.genie
    config = uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                            log_level="debug" if settings.verbose else "info", access_log=settings.verbose,
                            timeout_graceful_shutdown=settings.shutdown_timeout, server_header=False)
    server = GracefulServer(config, state)
    state.on_load_failed = lambda: setattr(server, "should_exit", True)
    log.info("listening on http://%s:%d (loading %s)", settings.host, settings.port, model_path)
    server.run()
    return 1 if state.status == "error" else 0
