"""What the routes share: settings, the engine once loaded, its worker, the metrics.

`ServerState` loads the model in a background thread when given a loader (the port is
already bound, /health says 503 "Loading model" meanwhile), then starts the one engine
worker. It knows nothing about HTTP beyond the ApiError it raises while not ready.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ApiError, loading_error
from .metrics import Metrics
from .worker import EngineWorker

log = logging.getLogger("genie_rt.server")

VERSION = "0.1.0"
FINGERPRINT = f"genie-rt-{VERSION}"   # system_fingerprint and build_info


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 16                  # requests waiting behind the one generating
    alias: str | None = None             # model name reported by the API
    model_path: str | None = None
    max_body_bytes: int = 8 << 20        # larger bodies: 413
    shutdown_timeout: float = 10.0       # SIGTERM: seconds in-flight requests get to finish
    retry_after_s: int = 1               # Retry-After on 503 queue full
    verbose: bool = False

    @classmethod
    def from_args(cls, args) -> "ServerSettings":
        def arg(name, default):
            value = getattr(args, name, None)
            return default if value is None else value
        return cls(host=arg("host", cls.host), port=arg("port", cls.port), api_key=arg("api_key", None) or None,
                   max_queue=arg("max_queue", cls.max_queue), alias=arg("alias", None),
                   model_path=arg("model", None), shutdown_timeout=float(arg("shutdown_timeout", cls.shutdown_timeout)),
                   verbose=bool(arg("verbose", False)))


# --- state ------------------------------------------------------------------------------------------
class ServerState:
    """What the routes share: the engine (once loaded), its worker, metrics, settings."""

    def __init__(self, engine_or_loader, settings: ServerSettings):
        self.settings = settings
        self.metrics = Metrics()
        self.engine = None
        self.loader: Callable[[], Any] | None = None
        self.worker: EngineWorker | None = None
        self.status = "loading"          # loading -> ready | error
        self.error: str | None = None
        self.started = int(time.time())
        self.on_load_failed: Callable[[], None] | None = None
        if hasattr(engine_or_loader, "generate"):
            self.engine = engine_or_loader
        elif callable(engine_or_loader):
            self.loader = engine_or_loader
        else:
            raise TypeError("create_app needs an engine (with generate) or a callable that loads one")

    def start(self) -> None:
        if self.engine is not None:
            self._ready(self.engine)
        else:
            threading.Thread(target=self._load, name="genie-model-loader", daemon=True).start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self.loader()
        except BaseException as exc:  # a loader that fails must not leave the server "loading" forever
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "error"
            log.error("the model failed to load: %s", self.error)
            if self.on_load_failed is not None:
                self.on_load_failed()
            return
        self._ready(engine)
        log.info("model loaded in %.1f s; ready", time.perf_counter() - t0)

    def _ready(self, engine) -> None:
        self.engine = engine
        self.worker = EngineWorker(engine, self.settings.max_queue, self.metrics)
        self.worker.start()
        self.status = "ready"

    def shutdown(self) -> None:
        if self.worker is not None and not self.worker.stop(timeout=5.0):
            log.warning("the engine worker did not stop within 5 s")
        store = getattr(self.engine, "kv_store", None)
        close = getattr(store, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                log.exception("closing the conversation cache failed")

    # -- engine facts the routes need ---------------------------------------------------------------
    def ready_engine(self):
        if self.status == "loading":
            raise loading_error()
        if self.status != "ready":
            raise ApiError(500, f"the model failed to load: {self.error}")
        return self.engine

    @property
    def model_name(self) -> str:
        return self.settings.alias or getattr(self.engine, "model_name", None) or "model"

    @property
    def vocab_size(self) -> int:
        cfg = getattr(self.engine, "cfg", None)
        return int(getattr(cfg, "vocab_size", 0) or self.engine.tokenizer.vocab_size)

    def tokenize_text(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special=False, parse_special=False)
