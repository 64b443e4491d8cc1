"""MemoryBudget: every byte accounted before the first allocation.

    total = weights + KV pool (context x bytes per position, + the fixed rings of
            sliding-window layers) + scratch
            + runtime overhead (CUDA context, or the Python/numpy heap on the CPU)
            + reserve (left for the rest of the system: OS, speech-to-text, ...)

`total` is compared with what is really available: `MemAvailable` from /proc/meminfo
for the CPU back-end and for an integrated GPU (a Jetson shares one pool, where
cuMemGetInfo is misleading), cuMemGetInfo's free bytes on a discrete GPU. When the
context length is not given, it is the largest multiple of 256 that fits (capped at
the model's training context). When nothing fits, `MemoryBudgetError` names each
term, so the user sees what to change (a smaller model, a shorter --ctx, --kv int8,
a smaller --reserve-mb) - before anything is loaded.

This module does arithmetic and reads /proc; it allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
CTX_GRANULE = 256
MIN_CTX = 256


class MemoryBudgetError(RuntimeError):
    """The model does not fit; the message lists every term of the budget."""


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where there is no such file (read
    through engine/platform_probe.py, so $GENIE_RT_SYSFS_ROOT can stand in for the machine)."""
    from .platform_probe import Probe
    return Probe().mem_available()


def fmt_bytes(n: int) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    n_ctx: int
    weights: int
    kv: int
    scratch: int
    overhead: int
    reserve: int
    available: int
    where: str  # "host memory (MemAvailable)", "GPU memory (cuMemGetInfo free)", ...

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch + self.overhead + self.reserve

    def table(self) -> str:
        rows = [("weights", self.weights), (f"KV cache ({self.n_ctx} tokens)", self.kv),
                ("scratch", self.scratch), ("runtime overhead", self.overhead),
                ("reserve for the rest of the system", self.reserve), ("needed in total", self.total),
                (f"available ({self.where})", self.available)]
        return "\n".join(f"  {name:<40} {fmt_bytes(value):>12}" for name, value in rows)


@dataclass(frozen=True)
class MemoryBudget:
    """The terms that do not depend on the context length, plus the per-token KV cost."""

    weights: int                 # bytes the back-end keeps for weights
    kv_bytes_per_token: int      # K+V bytes per position, all layers (scales included)
    scratch: int                 # activations, logits, attention workspace
    overhead: int                # CUDA context / interpreter heap
    reserve: int                 # left free for the rest of the system
    available: int               # what can be used
    where: str
    n_ctx_train: int
    kv_dtype: str | None = None  # only to word the advice (no "--kv int8" when it is int8)
    kv_fixed: int = 0            # KV bytes that do not grow with the context (sliding-window rings)

    @property
    def fixed(self) -> int:
        """Every term that does not grow with the context."""
        return self.weights + self.kv_fixed + self.scratch + self.overhead + self.reserve

    def max_ctx(self) -> int:
        """The context `plan(None)` picks: the largest multiple of 256 that fits, capped at
        the training context (at least MIN_CTX); 0 when that does not fit."""
        room = self.available - self.fixed
        fit = room // self.kv_bytes_per_token if room > 0 else 0
        n = max(MIN_CTX, min(self.n_ctx_train, fit // CTX_GRANULE * CTX_GRANULE))
        return n if self.fixed + n * self.kv_bytes_per_token <= self.available else 0

    def plan(self, n_ctx: int | None) -> MemoryPlan:
        """Check the budget for n_ctx tokens (None: the largest context that fits)."""
        requested = n_ctx
        if n_ctx is None:
            n_ctx = self.max_ctx() or MIN_CTX   # nothing fits: report the smallest useful configuration
        plan = MemoryPlan(n_ctx, self.weights, self.kv_fixed + n_ctx * self.kv_bytes_per_token, self.scratch,
                          self.overhead, self.reserve, self.available, self.where)
        if plan.total > plan.available:
            largest = self.max_ctx() if requested is not None else 0
            raise MemoryBudgetError(
                f"the model does not fit: {fmt_bytes(plan.total)} needed, "
                f"{fmt_bytes(plan.available)} available\n{plan.table()}\n"
                + (f"The largest context that fits is {largest} tokens (--ctx {largest}).\n" if largest else "")
                + "Try a smaller model or quantization, a shorter context (--ctx)"
                + (", the int8 KV cache (--kv int8)" if self.kv_dtype != "int8" else "")
                + ", or a smaller --reserve-mb.")
        return plan
