"""Progress of the long steps (reading weights, compiling kernels, capturing graphs,
downloading), for the command line: a bar on a terminal, plain lines in a log.

    progress = for_stream(sys.stderr, quiet=args.quiet)      # the CLI decides
    progress.start("reading weights", total=n_bytes, unit="B")
    for t in tensors:
        ...
        progress.advance(t.nbytes)
    progress.done()

The loaders (Engine.load, the back-ends, pull) take a `progress` argument that defaults
to NO_PROGRESS, so a Python caller gets no output unless it passes a renderer.

On a terminal (`out.isatty()`) a step is one line redrawn with a carriage return (at most
every `interval` seconds) and ended with a newline. Anywhere else (a pipe, a file, the
systemd journal) there are no control characters: a line when the step starts, one at
every `every` percent, and one when it is done with the time it took. A step of unknown
length (total None) counts what was done; in plain mode it writes a line per `advance`
that names what it did (`detail`), at most one per `interval_plain` seconds otherwise.

Units: "B" prints megabytes (and MB/s); any other unit prints counts ("3/14 graphs").

What it deliberately does not do: nest steps, run from several threads at once, or know
anything about what is being loaded.
"""
from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO


class Progress(Protocol):
    """What the loaders call; `start` begins a step, `done` ends it."""

    def start(self, step: str, total: int | None = None, unit: str = "", done: int = 0,
              detail: str = "") -> None: ...

    def advance(self, n: int = 1, detail: str = "") -> None: ...

    def done(self, detail: str = "") -> None: ...


class _Silent:
    """No output (the default for every library call)."""

    def start(self, step: str, total: int | None = None, unit: str = "", done: int = 0,
              detail: str = "") -> None:
        pass

    def advance(self, n: int = 1, detail: str = "") -> None:
        pass

    def done(self, detail: str = "") -> None:
        pass


NO_PROGRESS = _Silent()


class StreamProgress:
    """Renders steps on a text stream (stderr by default); `tty` None asks the stream."""

    def __init__(self, out: TextIO | None = None, tty: bool | None = None, *, every: int = 25,
                 interval: float = 0.1, interval_plain: float = 5.0, width: int = 30, clock=time.monotonic):
        self.out = out if out is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.out, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        if not 0 < every <= 100:
            raise ValueError(f"every must be a percentage in 1..100, got {every}")
        self.tty, self.every, self.interval, self.interval_plain = tty, every, interval, interval_plain
        self.width, self.clock = width, clock
        self.step: str | None = None

    # -- the Progress interface -------------------------------------------------------------
    def start(self, step: str, total: int | None = None, unit: str = "", done: int = 0,
              detail: str = "") -> None:
        """Begin `step` of `total` units (None: unknown), `done` of them already done (a
        resumed download); `detail` is said once, with the start."""
        if self.step is not None:
            self.done()
        self.step, self.total, self.unit = step, (total if total and total > 0 else None), unit
        self.count = self.first = done
        self.t0 = self.shown_at = self.clock()
        self.shown_pct, self.line_len = self._pct() if self.total else 0, 0
        if self.tty:
            self._draw(detail)
        else:
            about = ([self._amount(self.total)] if self.total else []) + \
                    ([f"{self._amount(done)} already here"] if done else []) + ([detail] if detail else [])
            self._line(f"{step}: started" + (f" ({'; '.join(about)})" if about else ""))

    def advance(self, n: int = 1, detail: str = "") -> None:
        if self.step is None:
            return
        self.count += n
        now = self.clock()
        if self.tty:
            if now - self.shown_at >= self.interval or (self.total and self.count >= self.total):
                self._draw(detail)
                self.shown_at = now
            return
        if self.total:
            pct = self._pct()
            if pct // self.every > self.shown_pct // self.every or (pct == 100 and self.shown_pct < 100):
                self._line(f"{self.step}: {pct}% ({self._amount(self.count, self.total)}{self._rate(now)})")
                self.shown_pct = pct
        elif detail or now - self.shown_at >= self.interval_plain:
            self._line(f"{self.step}: {self._amount(self.count)}" + (f" ({detail})" if detail else ""))
            self.shown_at = now

    def done(self, detail: str = "") -> None:
        if self.step is None:
            return
        seconds = self.clock() - self.t0
        if self.tty:
            self._draw(f"done in {seconds:.1f} s" + (f"; {detail}" if detail else ""), final=True)
            self.out.write("\n")
            self.out.flush()
        else:
            amount = self._amount(self.count) if self.count or self.total else ""
            self._line(f"{self.step}: done" + (f", {amount}" if amount else "") + f" in {seconds:.1f} s"
                       + (f"; {detail}" if detail else ""))
        self.step = None

    # -- rendering --------------------------------------------------------------------------
    def _pct(self) -> int:
        return min(100, self.count * 100 // self.total)

    def _amount(self, n: int, total: int | None = None) -> str:
        if self.unit == "B":
            return f"{n / 1e6:,.0f}" + (f" of {total / 1e6:,.0f}" if total else "") + " MB"
        return f"{n}" + (f" of {total}" if total else "") + (f" {self.unit}" if self.unit else "")

    def _rate(self, now: float) -> str:
        if self.unit != "B" or now <= self.t0 or self.count == self.first:
            return ""
        return f", {(self.count - self.first) / (now - self.t0) / 1e6:.1f} MB/s"

    def _draw(self, detail: str, final: bool = False) -> None:
        now = self.clock()
        if self.total:
            pct = self._pct()
            filled = pct * self.width // 100
            text = (f"{self.step} [{'#' * filled}{'.' * (self.width - filled)}] {pct:3d}% "
                    f"{self._amount(self.count, self.total).replace(' of ', '/')}{self._rate(now)}")
        else:
            text = f"{self.step}: {self._amount(self.count)}" + ("" if final else f", {now - self.t0:.0f} s")
        if detail:
            text += f", {detail}" if final else f" ({detail})"
        pad = max(0, self.line_len - len(text))        # clear what a longer line left behind
        self.out.write("\r" + text + " " * pad)
        self.out.flush()
        self.line_len = len(text)

    def _line(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def for_stream(out: TextIO | None = None, quiet: bool = False) -> Progress:
    """The CLI's renderer: NO_PROGRESS when quiet, else a StreamProgress on `out` (stderr)."""
    return NO_PROGRESS if quiet else StreamProgress(out)
