"""The CUDA back-end's steps for constrained requests and for requests that want probabilities
(a mixin of CUDABackend, engine/backend_cuda.py; it uses that class's graphs, state and sampler
workspace).

- A grammar (sampler.constraint, engine/constrain.py): the mask of each draw is computed on the
  host into the sampler workspace's pinned mirror, uploaded (async, 4 bytes per 32 tokens) and
  applied by the sampling graph ("sample", mode, masked, advance): gpu_mask.apply_mask, the
  draw, S_POS += 1. The forward graph ("decode", None) of step t+1 (or its short-context twin,
  CUDABackend._decode_step) is queued before the host
  reads token t, so the host's accept of token t and mask of step t+1 overlap the device's
  forward; every step stays two graph replays.
- Probabilities (sampler.want_probs): the host sampler draws from each step's logits (copied
  back by prefill() / decode()), so what it reports is the distribution it drew from.
"""
from __future__ import annotations

from .h2d import event


class ConstrainedSteps:
    def _mask_step(self, sampler) -> bool:
        """The constraint's mask for the next draw into sws.mask; False when none applies."""
        from genie_rt.engine import gpu_mask
        c = sampler.constraint
        if c is None or c.fill(out=gpu_mask.mask_words(self.sws)) is None:
            return False
        gpu_mask.upload_mask(self.sws, self.stream)
        return True

    def _draw_graph(self, masked: bool, advance: bool) -> None:
        mode = "greedy" if self._req.greedy else "full"
        self._run(("sample", mode, masked, advance), lambda: self._record_sample(mode, masked, advance))

    def _host_sampled(self, token: int, pos: int, sampler, history):
        while True:
            token = sampler.sample(self.decode(token, pos), history)
            pos += 1
            yield token

    def _constrained(self, pos: int, sampler):
        """decode_tokens under a grammar: the forward of step t+1 is queued before the host
        reads token t, so the host's accept + mask of step t+1 overlap the device's forward."""
        c = sampler.constraint
        step = [pos]

        def forward():
            self._wrote(step[0], 1)
            self._decode_step(None, step[0])
            step[0] += 1

        def draw():
            self._draw_graph(self._mask_step(sampler), advance=True)
            ev = event()
            ev.record(self.stream)
            return ev

        try:
            forward()
            ev = draw()
            while True:
                forward()                 # the device's next step: its token is in the state
                ev.synchronize()
                token = self._read_token()
                c.accept(token)
                ev = draw()
                yield token
        finally:
            self.stream.synchronize()
