"""The back-end interface: what the engine (engine/engine.py), the benchmark and the server
need from a back-end. Two implement it: `CPUBackend` (engine/backend_cpu.py) and
`CUDABackend` (engine/backend_cuda.py).

A back-end owns the model's weights and its KV pool, runs the forward of the model's
architecture (engine/models/) over positions it is told, and samples. It does not know
which tokens the pool holds - the engine tracks that (`Engine.kv_tokens`) - except that it
answers `reusable_prefix`: a sliding-window layer kept as a ring may have overwritten what
a shorter prefix needs.
"""
from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np


class Backend(Protocol):
    name: str            # "cpu" | "cuda"
    n_ctx: int           # positions the KV pool holds
    kv: object           # the KV pool: .shape (kvcache.pool.KVShape), export/import for persistence

    def device_info(self) -> dict:
        """What runs it: {"backend", "device", ...} (the server's /props, bench's JSON)."""

    def prefill(self, tokens, start: int, cancel=None, all_logits: bool = False) -> np.ndarray | None:
        """Run tokens at positions start.. (in chunks); logits of the last position (every
        position with all_logits). None if `cancel` was set between chunks."""

    def decode(self, token: int, pos: int) -> np.ndarray:
        """One token at `pos`; its logits."""

    def prefill_sample(self, tokens, start: int, sampler, history: list[int], cancel=None,
                       checked: bool = False) -> int | None:
        """prefill, then the first generated token drawn by `sampler` (None when cancelled).
        checked: the caller has already validated the sampler's parameters and every id of
        `history` against the vocabulary (Engine.generate does, for every request), so a back-end
        need not repeat that before it queues the prefill; it still refuses what it cannot take."""

    def sample_logits(self, logits: np.ndarray, sampler, history: list[int]) -> int:
        """The first token of a reply drawn by `sampler` from `logits` a prefill returned (left
        unchanged): the engine's further choices of one prompt. Drawn as prefill_sample draws."""

    def decode_tokens(self, token: int, pos: int, sampler, history: list[int]) -> Iterator[int]:
        """The tokens after `token` (at `pos`), one decode step per next(); the caller
        appends each to `history` before asking for the next. May run ahead (CUDA: one step)."""

    def reusable_prefix(self, n: int) -> int:
        """The longest prefix (at most n positions) whose K/V the next request may keep."""

    def ring_first(self, end: int) -> int:
        """The first position every sliding-window ring still holds of 0 .. end-1 (0 without
        rings): what a conversation file can store of those layers."""

    def kv_imported(self, first: int, end: int) -> None:
        """A conversation file put positions first .. end-1 into the rings (tracking)."""

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def roofline(self) -> dict | None:
        """{"bytes_per_token", "bandwidth"} for the decode roofline, or None."""

    def peak_memory_bytes(self) -> int | None:
        """Device memory in use, or None."""
