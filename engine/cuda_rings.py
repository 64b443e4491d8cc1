"""Which positions the CUDA back-end's sliding-window rings hold: the host's record that prefix
reuse and KV files need, since a ring layer's slots are overwritten in place.

A mixin of CUDABackend (engine/backend_cuda.py). `_init_rings` makes its two fields; every write
of positions to the KV pool calls `_wrote` (a prefill chunk, a decode step), a restored file
`kv_imported`. Without sliding-window layers both fields are empty and every answer is the
trivial one.
"""
from __future__ import annotations

import numpy as np


class RingPositions:
    def _init_rings(self, kv_shape, cfg) -> None:
        """For each ring size (sliding-window layers): the position each slot holds now (-1: none),
        so that prefix reuse knows which positions survived later writes (reusable_prefix), and the
        window of the layers of that size."""
        sizes = {kv_shape.layer_slots(i) for i in kv_shape.ring_layers}
        self._ring_pos = {r: np.full(r, -1, np.int64) for r in sizes}
        self._ring_window = {kv_shape.layer_slots(i): cfg.window(i) for i in kv_shape.ring_layers}

    def _wrote(self, start: int, n: int, reset: bool = False) -> None:
        """Positions start .. start+n-1 were (or are about to be) written to every layer."""
        for r, held in self._ring_pos.items():
            if reset:
                held[:] = -1
            if n:
                pos = np.arange(start, start + n)
                held[pos[-r:] % r] = pos[-r:]

    def ring_first(self, end: int) -> int:
        """The first position p such that every ring still holds p .. end-1 (what a KV file
        can store of the ring layers); 0 without rings."""
        first = 0
        for r, held in self._ring_pos.items():
            p = end
            while p > max(0, end - r) and held[(p - 1) % r] == p - 1:
                p -= 1
            first = max(first, p)
        return first

    def kv_imported(self, first: int, end: int) -> None:
        """Positions first .. end-1 were just imported into every ring (a restored file)."""
        self._wrote(0, 0, reset=True)
        self._wrote(first, end - first)

    def reusable_prefix(self, n: int) -> int:
        """The longest prefix of at most n positions a request may keep: n when every ring
        still holds the window the first new token attends to (n - W + 1 .. n - 1), else 0
        (a ring is overwritten in place: after a long reply, a rollback of more than one
        prefill chunk finds its window gone). Without rings: n."""
        for r, held in self._ring_pos.items():
            w = self._ring_window[r]
            need = np.arange(max(0, n - w + 1), n)
            if len(need) and not (held[need % r] == need).all():
                return 0
        return n
