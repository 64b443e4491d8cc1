"""The one engine worker: a thread that owns the model, fed by a bounded queue.

    job = Job(GenerationRequest(...), loop)
    worker.submit(job)             # QueueFull / ShuttingDown when it cannot take it
    event = await job.next()       # Delta..., then Done or an exception, posted from the thread
    worker.cancel(job)             # client gone: out of the queue, or stop between tokens

Only the worker thread calls `engine.generate`. Events cross to the asyncio side with
`loop.call_soon_threadsafe`, so the HTTP handlers never block on the model. A request
that raises - anything, from a bad value the checks missed to a back-end failure - is
answered with its exception and the worker carries on with the next job; after an
unexpected failure the engine's prefix cache is dropped, so a half-written KV pool cannot
change the answer to the next request.

What it deliberately does not do: batching (one home assistant, one sequence at a time),
priorities, or any HTTP: generation.py turns events into responses.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from genie_rt.engine.generate import ContextOverflowError, Done

log = logging.getLogger("genie_rt.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Cancelled(Exception):
    """The job was cancelled before the engine started it."""


class Disconnected:
    """Posted by the async side when the client went away."""


DISCONNECTED = Disconnected()


class _Result:
    """What a task job (a callable instead of a GenerationRequest) returned."""
    def __init__(self, value):
        self.value = value


class Job:
    """A generation, or a task: a callable run with the engine on the worker thread (its return
    value is posted as the one event, wrapped in a _Result)."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        if callable(request):
            self.cancel = threading.Event()
        else:
            if request.cancel is None:
                request.cancel = threading.Event()
            self.cancel = request.cancel        # threading.Event; the engine polls it
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = False                   # set on the worker thread when the job is over
        self.enqueued_at = time.monotonic()

    def post(self, item) -> None:
        """From the worker thread: hand an event to the waiting handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            self.cancel.set()

    async def next(self):
        return await self.events.get()

    async def result(self):
        """A task job's return value (its exception raised)."""
        event = await self.next()
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, _Result):
            return event.value
        raise Cancelled()


class EngineWorker:
    def __init__(self, engine, max_queue: int, metrics=None):
        self.engine = engine
        self.max_queue = max(0, int(max_queue))
        self.metrics = metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._current: Job | None = None
        self._stopping = False
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="genie-engine-worker", daemon=True)

    # -- state, read by /metrics and /health ---------------------------------------------------
    @property
    def n_queued(self) -> int:
        return len(self._pending)

    @property
    def n_processing(self) -> int:
        return 0 if self._current is None else 1

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_draining(self) -> bool:
        return self._draining or self._stopping

    # -- the async side ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping or self._draining:
                raise ShuttingDown()
            if len(self._pending) + (self._current is not None) > self.max_queue:
                raise QueueFull()
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job` as soon as possible: drop it from the queue, or let the engine stop it
        between tokens / prefill chunks. Safe to call at any time, more than once."""
        job.cancel.set()
        with self._cv:
            try:
                self._pending.remove(job)
            except ValueError:
                return
        job.finished = True

    def drain(self) -> None:
        """Stop taking new jobs (SIGTERM); queued and running ones go on."""
        with self._cv:
            self._draining = True

    def abort_all(self) -> None:
        """The shutdown deadline passed: cancel the running job (the engine stops between tokens
        or prefill chunks; its handler sends the error event) and answer every queued job with
        ShuttingDown (its handler answers 503). The thread goes on, idle."""
        with self._cv:
            self._draining = True
            pending, self._pending = list(self._pending), collections.deque()
            current = self._current
        if current is not None:
            current.cancel.set()
        for job in pending:
            job.cancel.set()
            job.finished = True
            job.post(ShuttingDown("the server is shutting down"))
        if current is not None or pending:
            log.info("shutdown deadline: cancelled %d running and %d queued requests",
                     int(current is not None), len(pending))

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel everything and wait for the thread; True if it ended within `timeout`."""
        with self._cv:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            if self._current is not None:
                self._current.cancel.set()
            self._cv.notify_all()
        for job in pending:
            job.cancel.set()
            job.finished = True
            job.post(ShuttingDown("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the worker thread -----------------------------------------------------------------------
    def _next_job(self) -> Job | None:
        with self._cv:
            while not self._pending and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            self._current = self._pending.popleft()
            return self._current

    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            try:
                if job.cancel.is_set():
                    job.post(ShuttingDown("the server is shutting down") if self._stopping else Cancelled())
                else:
                    self._generate(job)
            finally:
                with self._cv:
                    self._current = None
                job.finished = True

    def _generate(self, job: Job) -> None:
        if callable(job.request):   # a task on the engine's thread (slots.py: save, restore, erase)
            try:
                job.post(_Result(job.request(self.engine)))
            except Exception as exc:
                log.warning("engine task failed: %s", exc)
                job.post(exc)
            return
        done = False
        started = time.monotonic()
        first_event = first_text = None
        try:
            for event in self.engine.generate(job.request):
                if first_event is None:
                    first_event = time.monotonic()
                if first_text is None and getattr(event, "text", None):
                    first_text = time.monotonic()
                if isinstance(event, Done):
                    done = True
                    if self.metrics is not None:
                        self.metrics.on_result(event.result, time.monotonic() - job.enqueued_at, event.index)
                    if event.index == 0:
                        _log_timings(job, started, first_event, first_text, event.result)
                job.post(event)
            if not done:
                raise RuntimeError("the engine ended a generation without a result")
        except ContextOverflowError as exc:  # checked before anything touched the KV pool
            job.post(exc)
        except Exception as exc:
            if isinstance(exc, ValueError):
                log.warning("request refused by the engine: %s", exc)
            else:
                log.exception("generation failed; the worker goes on with the next request")
            if hasattr(self.engine, "kv_tokens"):
                self.engine.kv_tokens = []   # never reuse a KV prefix a failed request may have touched
            if self.metrics is not None:
                self.metrics.on_error()
            job.post(exc)


def _log_timings(job: Job, started: float, first_event, first_text, r) -> None:
    """One line per request (its first choice), as llama-server prints its timings: where the
    time to the first token went - the queue, the prompt (prefill), the rest until the first
    text - so a slow first request after a start shows which part is slow."""
    ms = lambda a, b: "-" if a is None or b is None else f"{(b - a) * 1000:.1f}"   # noqa: E731
    log.info("request timings: queued %s ms; first event after %s ms, first text after %s ms "
             "(prompt %d tokens, %d reused, prefill %.1f ms); %d tokens generated in %.1f ms",
             ms(job.enqueued_at, started), ms(started, first_event), ms(started, first_text),
             r.n_prompt, r.n_cached, r.prompt_ms, r.n_generated, r.gen_ms)
