"""HTTP plumbing between a client connection and a worker job.

- `read_body` / `read_json`: the request body with a size limit enforced while reading (413),
  never buffered past the limit; big JSON is parsed off the event loop.
- `JobStream`: reads one job's events and watches the connection; when the client goes
  away (closes, times out) the job is cancelled at once - out of the queue, or stopped by
  the engine between tokens or prefill chunks - and the reader wakes up.
- `SSEResponse`: a text/event-stream response that sends each chunk as it comes and,
  however it ends (done, client gone, server shutdown), closes its source so the job is
  cancelled.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from . import schemas
from .errors import ApiError
from .worker import DISCONNECTED, EngineWorker, Job

log = logging.getLogger("genie_rt.server")

DRAIN_LIMIT = 64 << 20   # an oversized body is read (and dropped) up to this, so the client sees the 413


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is larger than the limit of {limit} bytes",
                       headers={"Connection": "close"})
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
        if n > DRAIN_LIMIT:
            raise too_big
    body, size = bytearray(), 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                if size > DRAIN_LIMIT:
                    raise too_big
                body = None          # keep reading to the end, keep nothing
                continue
            if body is not None:
                body += chunk
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the body") from None
    if body is None:
        raise too_big
    return bytes(body)


async def read_json(request: Request, limit: int) -> dict:
    raw = await read_body(request, limit)
    if len(raw) < 64 << 10:
        return schemas.parse_json_body(raw)
    return await run_in_threadpool(schemas.parse_json_body, raw)  # megabytes: keep the event loop free


class JobStream:
    """Events of one job, for one HTTP request; cancels the job when the client leaves.

    `close()` is synchronous so it can run from a `finally` in a cancelled task."""

    def __init__(self, worker: EngineWorker, job: Job, receive):
        self.worker = worker
        self.job = job
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        try:
            while True:
                message = await receive()
                if message.get("type") == "http.disconnect":
                    break
        except asyncio.CancelledError:
            raise
        except Exception:  # a receive that fails means the connection is gone too
            pass
        if not self.job.finished:
            log.info("client disconnected; cancelling its generation")
        self.worker.cancel(self.job)
        self.job.events.put_nowait(DISCONNECTED)

    async def next(self):
        return await self.job.next()

    def close(self) -> None:
        self._watcher.cancel()
        if not self.job.finished:
            self.worker.cancel(self.job)


class SSEResponse(StreamingResponse):
    """`data: ...` chunks as they come; headers as llama-server sends them."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        super().__init__(chunks, status_code=200, media_type=None,
                         headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                  "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        chunks = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            pass
        finally:
            await chunks.aclose()
