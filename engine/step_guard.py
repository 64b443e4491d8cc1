"""Between generated tokens: end a reply before the shared memory runs out, slow down when hot.

On an integrated GPU (a Jetson) CPU and GPU draw on one pool, and another tenant (speech
to text, Home Assistant, a browser) can take memory after the model loaded. The engine
allocates nothing while it generates, but the kernel's OOM killer picks the largest
process - us - when the pool runs dry. The guard reads MemAvailable every `every` tokens
(one read of /proc/meminfo, ~20 us) and, when it falls below `min_headroom`, ends the
reply as if it had reached its length: finish_reason "length", a warning in the log,
`memory_stops` counted (genie_rt_memory_guard_stops_total in /metrics).

With `thermal_limit_c` set, the hottest thermal zone is read every `every` tokens too;
while it is at or above the limit each token waits `backoff_s` (the GPU idles; the
governor and the fan catch up), counted in `backoff_seconds`. Off by default: L4T throttles
by itself at its passive trip points; this is for keeping well below them (fan-less boxes).

    guard = StepGuard(GuardConfig(min_headroom=256 << 20), probe=Probe())
    verdict = guard.after_token()    # None: go on; "memory": end the reply now

Readers are injectable (`read_available`, `read_hottest`, `sleep`) for tests.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .platform_probe import Probe

log = logging.getLogger("genie_rt")
DEFAULT_HEADROOM_INTEGRATED = 256 << 20


@dataclass(frozen=True)
class GuardConfig:
    min_headroom: int | None = None       # bytes of MemAvailable to keep; None or 0: no memory guard
    thermal_limit_c: float | None = None  # °C; None: no back-off
    backoff_s: float = 0.05               # wait per token while at or above the limit
    every: int = 8                        # tokens between readings

    @property
    def active(self) -> bool:
        return bool(self.min_headroom) or self.thermal_limit_c is not None


class StepGuard:
    def __init__(self, cfg: GuardConfig, probe: Probe | None = None, read_available=None, read_hottest=None,
                 sleep=time.sleep):
        if cfg.every < 1:
            raise ValueError(f"the guard's reading interval must be >= 1 token, got {cfg.every}")
        probe = probe or Probe()
        self.cfg = cfg
        self._available = read_available or probe.mem_available
        self._hottest = read_hottest or probe.hottest_c
        self._sleep = sleep
        self._lock = threading.Lock()
        self._n = 0
        self._hot = False
        self.memory_stops = 0
        self.backoff_seconds = 0.0
        self.last_available: int | None = None
        self.last_hottest_c: float | None = None

    def start_reply(self) -> None:
        """Read on the first token of each reply."""
        self._n = 0

    def after_token(self) -> str | None:
        cfg = self.cfg
        read = self._n % cfg.every == 0
        self._n += 1
        if read and cfg.thermal_limit_c is not None:
            self.last_hottest_c = t = self._hottest()
            hot = t is not None and t >= cfg.thermal_limit_c
            if hot != self._hot:
                log.warning("thermal back-off %s: hottest zone %.1f °C (limit %.1f °C)",
                            "on" if hot else "off", t if t is not None else float("nan"), cfg.thermal_limit_c)
            self._hot = hot
        if self._hot and cfg.backoff_s > 0:
            self._sleep(cfg.backoff_s)
            with self._lock:
                self.backoff_seconds += cfg.backoff_s
        if read and cfg.min_headroom:
            self.last_available = a = self._available()
            if a is not None and a < cfg.min_headroom:
                with self._lock:
                    self.memory_stops += 1
                log.warning("memory guard: %d MiB available, below the %d MiB kept free; ending the reply "
                            "(finish_reason 'length')", a >> 20, cfg.min_headroom >> 20)
                return "memory"
        return None

    def snapshot(self) -> dict:
        with self._lock:
            return {"min_headroom": self.cfg.min_headroom, "thermal_limit_c": self.cfg.thermal_limit_c,
                    "memory_stops": self.memory_stops, "backoff_seconds": round(self.backoff_seconds, 3),
                    "backing_off": self._hot, "last_available": self.last_available,
                    "last_hottest_c": self.last_hottest_c}
