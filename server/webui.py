"""GET /: a small chat page (server/static/index.html: plain HTML and JavaScript, no build step).

It streams from /v1/chat/completions, shows reasoning apart from the answer and tool calls as
they come, tokens/s from the response's timings, and has a stop button (the request is
aborted: the server cancels the generation). The page itself needs no API key (a browser
cannot send one on navigation, as llama-server's web UI); the key typed into it is sent with
every API call. --no-webui turns it off (404).

Tools (an OpenAI tools array, typed into the page) are sent with each request when given.

Beside the page, the three files a browser that used llama-server's web UI (a SvelteKit PWA)
still asks for, all public and `Cache-Control: no-cache` as there:
- /sw.js: that UI's service worker keeps serving the old UI from its cache until an update check
  of /sw.js brings a new worker; this one removes itself, drops the caches and reloads the
  open tabs, so they get this server's page (llama-server serves the same kind of worker when
  its UI is off or replaced). Served with --no-webui too.
- /manifest.webmanifest: this page as an installable app (linked from the page).
- /_app/version.json: the version an open tab of the old UI polls; a new one makes it reload.

Deliberately not here: llama.cpp's web UI bundle, conversation storage, settings beyond thinking
and tools.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from .state import VERSION

PUBLIC_PATHS = ("/", "/index.html", "/sw.js", "/manifest.webmanifest", "/_app/version.json")
NO_CACHE = {"Cache-Control": "no-cache"}

# A service worker that takes over from an earlier one at once, unregisters itself, deletes every
# cache of this origin and reloads its open pages (which then load from the server).
REMOVING_WORKER = """self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil((async () => {
  await self.registration.unregister();
  for (const name of await caches.keys()) await caches.delete(name);
  for (const client of await self.clients.matchAll({type: "window"})) client.navigate(client.url);
})()));
"""

MANIFEST = {"name": "genie-rt chat", "short_name": "genie-rt", "start_url": "/", "scope": "/",
            "display": "standalone", "background_color": "#ffffff", "theme_color": "#222233"}


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files("genie_rt.server").joinpath("static/index.html").read_text(encoding="utf-8")


async def index(request: Request) -> Response:
    return HTMLResponse(page(), headers=NO_CACHE)


async def service_worker(request: Request) -> Response:
    return Response(REMOVING_WORKER, media_type="application/javascript", headers=NO_CACHE)


async def manifest(request: Request) -> Response:
    return JSONResponse(MANIFEST, media_type="application/manifest+json", headers=NO_CACHE)


async def version(request: Request) -> Response:
    return JSONResponse({"version": f"genie-rt-{VERSION}"}, headers=NO_CACHE)


def routes(page_on: bool = True) -> list[Route]:
    """The page's routes; without the page (--no-webui) only /sw.js, which removes an old worker."""
    out = [Route("/sw.js", service_worker, methods=["GET"])]
    if page_on:
        out += [Route("/", index, methods=["GET"]), Route("/index.html", index, methods=["GET"]),
                Route("/manifest.webmanifest", manifest, methods=["GET"]),
                Route("/_app/version.json", version, methods=["GET"])]
    return out
