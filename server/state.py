"""What the routes share: settings, the engine once loaded, its worker, the metrics.

`ServerState` loads the model in a background thread when given a loader (the port is
already bound, /health says 503 "Loading model" meanwhile), then starts the one engine
worker. It knows nothing about HTTP beyond the ApiError it raises while not ready.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from genie_rt.engine.sampling import SamplingParams

from .errors import ApiError, loading_error
from .metrics import Metrics
from .worker import EngineWorker

log = logging.getLogger("genie_rt.server")

VERSION = "0.1.0"
FINGERPRINT = f"b0-genie-rt-{VERSION}"   # system_fingerprint and build_info ("b": llama.cpp's build-number form, which clients parse)


@dataclass
class RequestDefaults:
    """What a request that leaves a field out gets (llama-server's launch flags --temp, --seed,
    -n, --reasoning, ...). n_predict > 0 also caps what a request may ask for, as llama-server."""
    params: SamplingParams = field(default_factory=SamplingParams)
    top_k: int = 40                     # as given (<= 0: off); params.top_k is set per vocabulary
    n_predict: int = -1                 # -1: no server-wide limit
    reasoning: str = "off"              # on | off | auto (the template's own default)
    reasoning_format: str = "auto"


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None           # one key (kept for create_app callers); api_keys: several
    api_keys: list[str] = field(default_factory=list)
    max_queue: int = 16                  # requests waiting behind the one generating
    alias: str | None = None             # model name reported by the API (the first of aliases)
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    model_path: str | None = None
    max_body_bytes: int = 8 << 20        # larger bodies: 413
    shutdown_timeout: float = 10.0       # SIGTERM: seconds in-flight requests get to finish
    retry_after_s: int = 1               # Retry-After on 503 queue full
    verbose: bool = False
    n_parallel: int = 1                  # slots reported (-np); one worker serves them in turn
    n_batch: int = 2048                  # -b: prompt tokens per prompt_progress step (return_progress)
    slots_endpoint: bool = True          # GET /slots (501 with --no-slots)
    slot_save_path: str | None = None    # POST /slots/N?action=save|restore (KV files, kvcache/persist.py)
    webui: bool = True                   # the chat page at /
    metrics_endpoint: bool = True        # GET /metrics (the command line: only with --metrics, as llama-server)
    cors_origins: list[str] | None = None   # None: any origin (echoed); "localhost": loopback origins
    defaults: RequestDefaults = field(default_factory=RequestDefaults)

    def keys(self) -> list[str]:
        return ([self.api_key] if self.api_key else []) + [k for k in self.api_keys if k != self.api_key]

    @classmethod
    def from_args(cls, args) -> "ServerSettings":
        def arg(name, default):
            value = getattr(args, name, None)
            return default if value is None else value
        aliases = [a.strip() for a in (arg("alias", "") or "").split(",") if a.strip()]
        alias = sorted(aliases)[0] if aliases else None   # llama-server: the id is the first in sorted order
        reasoning = arg("reasoning", None) or "off"
        if arg("reasoning_budget", None) == 0:
            reasoning = "off"
        seed = arg("seed", -1)
        defaults = RequestDefaults(
            params=SamplingParams(temperature=arg("temp", 0.8), top_p=arg("top_p", 0.95), min_p=arg("min_p", 0.05),
                                  seed=None if seed < 0 or seed == 0xFFFFFFFF else seed,
                                  repeat_penalty=arg("repeat_penalty", 1.0), repeat_last_n=arg("repeat_last_n", 64),
                                  presence_penalty=arg("presence_penalty", 0.0),
                                  frequency_penalty=arg("frequency_penalty", 0.0)),
            top_k=arg("top_k", 40), n_predict=arg("n_predict", -1), reasoning=reasoning,
            reasoning_format=arg("reasoning_format", None) or "auto")
        cors = arg("cors_origins", None)
        return cls(host=arg("host", cls.host), port=arg("port", cls.port), api_key=None,
                   api_keys=list(arg("api_keys", [])) or ([args.api_key] if arg("api_key", None) else []),
                   max_queue=arg("max_queue", cls.max_queue), alias=alias, aliases=aliases,
                   tags=[t.strip() for t in (arg("tags", "") or "").split(",") if t.strip()],
                   model_path=arg("model", None), shutdown_timeout=float(arg("shutdown_timeout", cls.shutdown_timeout)),
                   max_body_bytes=int(float(arg("max_body_mb", 8)) * (1 << 20)),
                   verbose=bool(arg("verbose", False)), n_parallel=int(arg("parallel", 1)),
                   n_batch=int(arg("batch_size", cls.n_batch)),
                   slots_endpoint=bool(arg("slots", True)), slot_save_path=arg("slot_save_path", None),
                   webui=bool(arg("webui", True)), metrics_endpoint=bool(arg("metrics", True)),
                   cors_origins=None if cors is None else [o.strip() for o in cors.split(",") if o.strip()],
                   defaults=defaults)


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
