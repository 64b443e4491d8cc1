"""The two ASGI middlewares in front of every route: CORS and the API key, as llama-server does them.

CORS (llama-server's defaults: origins "*", credentials allowed, methods
"GET, POST, DELETE, OPTIONS", headers "*"):
- every response carries `Access-Control-Allow-Origin`: with the default, the request's Origin
  echoed (so credentials work from any page); with `--cors-origins localhost`, the Origin only
  when its host is localhost, 127.0.0.1 or ::1 (any scheme and port); with a list of origins,
  the Origin only when it is in the list (llama-server copies the raw list into the header,
  which a browser rejects whenever the list has more than one entry);
- every OPTIONS request (a preflight) is answered here, 200 with an empty body, with
  `Access-Control-Allow-Credentials`, `-Methods` and `-Headers`; it never needs the API key
  (browsers do not send one on a preflight).

API key: `Authorization: Bearer KEY` or `X-Api-Key: KEY` (Anthropic's header) on every route but
the public ones (/health, the chat page). Keys are compared in constant time; any of several
keys (--api-key a,b or --api-key-file) is accepted. A failure is llama-server's 401
`authentication_error`.

Deliberately not here: routing, or anything about request bodies.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from .errors import ApiError

CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "*"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def origin_is_localhost(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in LOOPBACK_HOSTS


class CORSMiddleware:
    def __init__(self, app, origins: list[str] | None):
        self.app = app
        self.origins = origins          # None: any (echoed)

    def allowed_origin(self, origin: str | None) -> str | None:
        if not origin:
            return None if self.origins is not None else None
        if self.origins is None or "*" in self.origins:
            return origin
        if "localhost" in self.origins and origin_is_localhost(origin):
            return origin
        return origin if origin in self.origins else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = self.allowed_origin(Headers(scope=scope).get("origin"))
        if scope["method"] == "OPTIONS":
            # header names in llama-server's casing: HTTP does not care, but clients that copy
            # headers into a plain dict (as llama.cpp's own tests do) look them up that way
            headers = [(b"Access-Control-Allow-Credentials", b"true"),
                       (b"Access-Control-Allow-Methods", CORS_METHODS.encode()),
                       (b"Access-Control-Allow-Headers", CORS_HEADERS.encode()),
                       (b"Content-Type", b"text/html"), (b"Content-Length", b"0")]
            if origin is not None:
                headers.append((b"Access-Control-Allow-Origin", origin.encode("latin-1", "replace")))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if origin is None:
            return await self.app(scope, receive, send)

        value = origin.encode("latin-1", "replace")

        async def send_with_origin(message):
            if message["type"] == "http.response.start":
                raw = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"access-control-allow-origin"]
                message = {**message, "headers": raw + [(b"Access-Control-Allow-Origin", value)]}
            await send(message)

        await self.app(scope, receive, send_with_origin)


class APIKeyMiddleware:
    """Authorization: Bearer KEY or X-Api-Key: KEY on every route but the public ones."""

    def __init__(self, app, keys: list[str], public_paths: tuple[str, ...]):
        self.app = app
        self.keys = [k.encode() for k in keys if k]
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send):
        if not self.keys or scope["type"] != "http" or scope["path"] in self.public_paths:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        auth = headers.get("authorization", "")
        candidates = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
        candidates += headers.getlist("x-api-key")
        for given in candidates:
            given_b = given.encode("utf-8", "replace")
            # every key compared, in constant time each: the time does not say which key was near
            if sum(hmac.compare_digest(given_b, k) for k in self.keys):
                return await self.app(scope, receive, send)
        response = ApiError(401, "Invalid API Key", headers={"WWW-Authenticate": "Bearer"}).response()
        await response(scope, receive, send)
