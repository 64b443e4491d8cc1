"""HTTP errors in llama-server's shape, and the JSON encoder every response goes through.

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}

The `type` strings are llama-server's (server-common.cpp, format_error_response); a prompt
that does not fit adds `n_prompt_tokens` and `n_ctx` to the error object, as it does.
`api_error` maps every exception a request can meet to one of these; the `endpoint`
decorator applies it to each route, so no exception reaches uvicorn.

Messages are short: validation (schemas.py and its kin) quotes offending values cut to ~64 characters,
and as a last guard any message longer than MAX_MESSAGE_CHARS (one a template or the engine
built from request data, say) is cut there.
"""
from __future__ import annotations

import functools
import json
import logging

from starlette.concurrency import run_in_threadpool

from starlette.requests import Request
from starlette.responses import Response

from genie_rt.engine.chat import ChatTemplateError
from genie_rt.engine.generate import ContextOverflowError

from .worker import Cancelled, QueueFull, ShuttingDown

log = logging.getLogger("genie_rt.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
MAX_MESSAGE_CHARS = 1024


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS - 40] + f"... ({len(message)} characters, cut)"


class ApiError(Exception):
    """An error answered to the client; never a crash."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 headers: dict[str, str] | None = None, **extra):
        message = _bounded(str(message))
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}
        self.extra = extra

    def error_object(self) -> dict:
        return {"code": self.status, "message": self.message, "type": self.type, **self.extra}

    def response(self) -> Response:
        return JSONResp({"error": self.error_object()}, status_code=self.status, headers=self.headers)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def exceed_context(n_prompt_tokens: int, n_ctx: int) -> ApiError:
    return ApiError(400, f"the request ({n_prompt_tokens} prompt tokens) exceeds the available context "
                         f"size ({n_ctx} tokens)", "exceed_context_size_error",
                    n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def loading_error() -> ApiError:
    return ApiError(503, "Loading model", "unavailable_error")


def json_bytes(obj) -> bytes:
    """Compact UTF-8 JSON (nlohmann's dump() style). A lone surrogate a client smuggled in
    through a \\ud800 escape becomes '?' instead of an encoding crash."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8", "replace")


class JSONResp(Response):
    media_type = "application/json; charset=utf-8"

    def render(self, content) -> bytes:
        return json_bytes(content)


def api_error(exc: BaseException, retry_after_s: int = 1) -> ApiError:
    """The response for any exception a request can meet."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return exceed_context(exc.n_prompt_tokens, exc.n_ctx)
    if isinstance(exc, QueueFull):
        return ApiError(503, "the server is busy: too many requests are waiting; retry shortly",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, ShuttingDown):
        return ApiError(503, "the server is shutting down", headers={"Connection": "close"})
    if isinstance(exc, Cancelled):
        return ApiError(503, "the request was cancelled")
    if isinstance(exc, (ChatTemplateError, ValueError)):  # bad input the engine or template found
        return bad_request(str(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


BIG_BODY_BYTES = 1 << 20       # after a request this large, freed heap is given back to the system


def _is_big(request: Request) -> bool:
    try:
        return int(request.headers.get("content-length") or 0) >= BIG_BODY_BYTES
    except ValueError:
        return False


def endpoint(fn):
    """Every handler: errors become JSON responses; nothing escapes to uvicorn. After a big
    request (a megabyte body) the heap its parsing and tokenization freed goes back to the
    system (prompt_limits.release_memory), so one large prompt does not keep the process large."""
    @functools.wraps(fn)
    async def wrapped(request: Request) -> Response:
        if not _is_big(request):
            return await _handle(fn, request)
        try:
            return await _handle(fn, request)
        finally:
            from .prompt_limits import release_memory   # (prompt_limits imports nothing of the server)
            await run_in_threadpool(release_memory)
    return wrapped


async def _handle(fn, request: Request) -> Response:
    st = request.app.state.genie   # state.ServerState
    try:
        return await fn(request, st)
    except ApiError as exc:
        # without its traceback: kept, it would make a cycle (traceback -> this frame -> err) that
        # holds the request's body and parsed text until the cyclic GC runs (+30 MB of RSS after
        # four 8 MB prompts, every other burst, tests/test_server_memory.py)
        err = exc.with_traceback(None)
    except Exception as exc:
        err = api_error(exc, st.settings.retry_after_s)
        if err.status >= 500:
            log.exception("%s %s failed", request.method, request.url.path)
    if err.status == 400:            # raised here or mapped from the template / tokenizer
        st.metrics.on_rejected("invalid")
    elif err.status == 413:
        st.metrics.on_rejected("too_large")
    return err.response()
