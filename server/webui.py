"""GET /: a small chat page (server/static/index.html: plain HTML and JavaScript, no build step).

It streams from /v1/chat/completions, shows reasoning apart from the answer and tool calls as
they come, tokens/s from the response's timings, and has a stop button (the request is
aborted: the server cancels the generation). The page itself needs no API key (a browser
cannot send one on navigation, as llama-server's web UI); the key typed into it is sent with
every API call. --no-webui turns it off (404).

Tools (an OpenAI tools array, typed into the page) are sent with each request when given.

Deliberately not here: llama.cpp's web UI bundle, conversation storage, settings beyond thinking
and tools.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

PUBLIC_PATHS = ("/", "/index.html")


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files("genie_rt.server").joinpath("static/index.html").read_text(encoding="utf-8")


async def index(request: Request) -> Response:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})


def routes() -> list[Route]:
    return [Route("/", index, methods=["GET"]), Route("/index.html", index, methods=["GET"])]
