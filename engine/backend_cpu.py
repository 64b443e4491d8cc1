"""The numpy back-end: the reference forward (engine/qwen3.py) with a host KV pool.

Weights are dequantized to float32 once at load, so this back-end is for small models
(the README demo, tests, machines without a GPU). Its memory budget counts the
dequantized weights, not the file size.
"""
from __future__ import annotations

import numpy as np

from genie_rt.kvcache.pool import HostKVPool, KVShape

from .config import ModelConfig
from .gguf_file import GGUFFile
from .memory import MemoryBudget, mem_available_bytes
from .qwen3 import Qwen3Weights, check_tensors, forward
from .sampling import Sampler

DEFAULT_RESERVE = 512 << 20
INTERPRETER_OVERHEAD = 256 << 20


def cpu_budget(g: GGUFFile, cfg: ModelConfig, kv_dtype: str, prefill_chunk: int,
               reserve: int | None) -> MemoryBudget:
    tensors = check_tensors(g, cfg)
    n_weights = sum(int(np.prod(t.shape)) for t in tensors.values())
    kv = KVShape(cfg.n_layers, 1, cfg.n_head_kv, cfg.head_dim, kv_dtype)
    # per prefill chunk: residual, norms, q/k/v, attention out, ffn gate/up, logits row
    act = prefill_chunk * (4 * cfg.n_embd + cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.n_ff) * 4
    available = mem_available_bytes()
    return MemoryBudget(
        weights=n_weights * 4,
        kv_bytes_per_token=kv.bytes_per_position + cfg.n_head * prefill_chunk * 4,  # + scores row
        scratch=act + cfg.vocab_size * 4 * 2,
        overhead=INTERPRETER_OVERHEAD,
        reserve=DEFAULT_RESERVE if reserve is None else reserve,
        available=available if available is not None else 1 << 62,
        where="host memory (MemAvailable)",
        n_ctx_train=cfg.n_ctx_train,
        kv_dtype=kv_dtype,
    )


class CPUBackend:
    name = "cpu"

    def __init__(self, g: GGUFFile, cfg: ModelConfig, n_ctx: int, kv_dtype: str = "f32",
                 prefill_chunk: int = 512, dtype=np.float32):
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.weights = Qwen3Weights.load(g, cfg, dtype)
        self.kv = HostKVPool(KVShape(cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim, kv_dtype))

    def device_info(self) -> dict:
        return {"backend": "cpu", "device": "numpy"}

    def prefill(self, tokens, start: int, cancel=None, all_logits: bool = False) -> np.ndarray | None:
        """Run prompt tokens at start.. in chunks; logits of the last (or every) position.

        Returns None if `cancel` (a threading.Event) was set between chunks."""
        tokens = np.asarray(tokens, np.int32)
        if start + len(tokens) > self.n_ctx:
            raise IndexError(f"{start + len(tokens)} positions exceed the context of {self.n_ctx}")
        outs = []
        for i in range(0, len(tokens), self.prefill_chunk):
            if cancel is not None and cancel.is_set():
                return None
            chunk = tokens[i:i + self.prefill_chunk]
            outs.append(forward(self.weights, self.cfg, chunk, start + i, self.kv, all_logits))
        return np.concatenate(outs) if all_logits else outs[-1]

    def decode(self, token: int, pos: int) -> np.ndarray:
        return forward(self.weights, self.cfg, np.array([token], np.int32), pos, self.kv)

    # The generation loop calls these; the CUDA back-end samples on the device instead.
    def prefill_sample(self, tokens, start: int, sampler: Sampler, history: list[int], cancel=None) -> int | None:
        logits = self.prefill(tokens, start, cancel)
        return None if logits is None else sampler.sample(logits, history)

    def decode_sample(self, token: int, pos: int, sampler: Sampler, history: list[int]) -> int:
        return sampler.sample(self.decode(token, pos), history)

    def decode_tokens(self, token: int, pos: int, sampler: Sampler, history: list[int]):
        """Yield the tokens after `token` (at `pos`), one decode step per next(); the caller
        appends each yielded token to `history` before asking for the next."""
        while True:
            token = self.decode_sample(token, pos, sampler, history)
            pos += 1
            yield token
