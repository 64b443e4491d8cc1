"""The CPU back-end: an architecture's forward (engine/models/) run by CPU ops, a host KV pool.

Two sets of ops run the same forward:
- `CPUOps` (engine/cpu_ops.py, the default): the Numba kernels of genie_rt.cpu on the
  weights as the file stores them (memory-mapped, no expanded copy): resident memory is
  about the file plus the KV pool and a small scratch, and the budget says so.
- `ReferenceOps` (engine/models/reference.py, `exact=True`): numpy on weights dequantized
  to float32 (or float64) once at load - the oracle, for tests; its budget counts the
  dequantized weights.

Per chunk of prompt tokens (or one decode token) at positions start..start+n-1:

    body(ops, weights, attn, s)        embed s.ids into s.x, run every layer
    head(ops, weights, s.x[-1:])       logits of the last row (every row with all_logits)
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from genie_rt.kvcache.pool import HostKVPool, KVShape
from genie_rt.quant.formats import dequantize

from .config import ModelConfig
from .gguf_file import GGUFFile
from .memory import MemoryBudget, mem_available_bytes
from .models import architecture
from .models.ops import attn_layers, scratch_widths
from .models.reference import ReferenceOps
from .models.weights import bind_weights, check_tensors
from .progress import NO_PROGRESS, Progress
from .sampling import Sampler

PAGE_BYTES = 4096
DEFAULT_RESERVE = 512 << 20
INTERPRETER_OVERHEAD = 256 << 20


def cpu_budget(g: GGUFFile, cfg: ModelConfig, kv_dtype: str, prefill_chunk: int,
               reserve: int | None, exact: bool = False) -> MemoryBudget:
    tensors = check_tensors(g, cfg)
    # the tied output projection is the embedding table itself: counted once. The kernels
    # read the file's pages (resident as the page cache), norms are float32 copies
    if exact:
        weight_bytes = sum(int(np.prod(t.shape)) for t in tensors.values()) * 4
    else:
        weight_bytes = sum(t.nbytes if len(t.shape) == 2 else int(np.prod(t.shape)) * 4
                           for t in tensors.values())
    kv = KVShape(cfg.n_layers, 1, cfg.n_head_kv, cfg.head_dim, kv_dtype)
    widths = scratch_widths(cfg)
    act = prefill_chunk * (sum(widths.values()) + 2 * cfg.n_ff) * 4   # + gate/up temporaries
    available = mem_available_bytes()
    return MemoryBudget(
        weights=weight_bytes,
        kv_bytes_per_token=kv.bytes_per_position + cfg.n_head * prefill_chunk * 4,  # + scores row
        scratch=act + cfg.vocab_size * 4 * 2,
        overhead=INTERPRETER_OVERHEAD,
        reserve=DEFAULT_RESERVE if reserve is None else reserve,
        available=available if available is not None else 1 << 62,
        where="host memory (MemAvailable)",
        n_ctx_train=cfg.n_ctx_train,
        kv_dtype=kv_dtype,
    )


def _read_weights(g: GGUFFile, cfg: ModelConfig, bind, progress: Progress):
    """bind_weights as the step "reading weights": bytes of the file, tensor by tensor."""
    tensors = check_tensors(g, cfg)
    progress.start("reading weights", sum(t.nbytes for t in tensors.values()), "B")

    def each(t):
        value = bind(t)
        progress.advance(t.nbytes)
        return value
    weights = bind_weights(g, cfg, each, tensors=tensors)
    progress.done()
    return weights


def reference_weights(g: GGUFFile, cfg: ModelConfig, dtype=np.float32, progress: Progress = NO_PROGRESS):
    """Every tensor dequantized to `dtype` (the tied output is the embedding array itself)."""
    def bind(t):
        return dequantize(t.data, t.qtype, t.shape).astype(dtype, copy=False)
    return _read_weights(g, cfg, bind, progress)


def _touch_pages(data: np.ndarray) -> None:
    """Read one byte of every page of a mapped tensor: the file is read now, at load, not
    during the first prompt (the kernels would fault in the same pages)."""
    if data.size:
        data[::PAGE_BYTES].max()


def fast_weights(g: GGUFFile, cfg: ModelConfig, progress: Progress = NO_PROGRESS):
    """Matrices as CPUWeight views of the mapped file (its pages read once, here); 1-D
    tensors as float32 arrays."""
    from genie_rt.cpu.weights import CPUWeight

    def bind(t):
        if len(t.shape) == 2:
            w = CPUWeight.from_tensor(t)
            _touch_pages(w.data)
            return w
        return np.ascontiguousarray(dequantize(t.data, t.qtype, t.shape), np.float32)
    return _read_weights(g, cfg, bind, progress)


def forward(w, cfg: ModelConfig, tokens, start: int, kv, all_logits=False,
            dtype=np.float32, ops=None) -> np.ndarray:
    """The reference forward of any architecture: `tokens` at positions start.., K/V into `kv`.

    Returns logits [vocab] of the last token, [n, vocab] with all_logits=True, or the rows
    of the chunk indices given as all_logits (an index array: tests of long prompts)."""
    spec = architecture(cfg.arch)
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    s = SimpleNamespace(ids=tokens, **{name: np.zeros((n, width), dtype)
                                       for name, width in scratch_widths(cfg).items()})
    ops = ReferenceOps(cfg, kv, start, n, dtype) if ops is None else ops(cfg, kv, start, n)
    spec.body(ops, w, attn_layers(cfg, w.layers, w.rope_freqs), s, cfg)
    pick = isinstance(all_logits, np.ndarray)
    rows = s.x[all_logits] if pick else s.x if all_logits else s.x[-1:]
    logits = np.empty((len(rows), cfg.vocab_size), dtype)
    spec.head(ops, w, rows, logits, cfg)
    return logits if pick or all_logits else logits[0]


class CPUBackend:
    """engine/backend.py's Backend on the CPU."""

    name = "cpu"

    def __init__(self, g: GGUFFile, cfg: ModelConfig, n_ctx: int, kv_dtype: str = "f32",
                 prefill_chunk: int = 512, dtype=np.float32, exact: bool = False,
                 threads: int | None = None, progress: Progress = NO_PROGRESS):
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.dtype = dtype
        self.exact = exact
        if exact:
            self.weights, self._ops = reference_weights(g, cfg, dtype, progress), None
        else:
            from genie_rt.cpu.threads import set_threads

            from .cpu_ops import CPUOps
            self.threads = set_threads(threads)
            self.weights, self._ops, self.dtype = fast_weights(g, cfg, progress), CPUOps, np.float32
        self.kv = HostKVPool(KVShape(cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim, kv_dtype))

    def warm_up(self, progress: Progress = NO_PROGRESS) -> None:
        """Compile every Numba kernel this model runs (or load it from the disk cache,
        cpu/jit.py) now, by a 2-token prefill and one decode step, so that the first prompt
        does not wait for the compiler; the KV positions written are zeroed again. One
        progress step, advanced per kernel compiled. Nothing to do for the reference ops."""
        if self.exact:
            return
        from genie_rt.cpu.jit import cache_dir, cache_is_empty, watch_compiles
        first_use = cache_is_empty()
        progress.start("compiling CPU kernels", None, "compiled",
                       detail="first use: minutes on a small machine, once" if first_use else "")
        n = min(2, self.n_ctx)
        with watch_compiles(lambda name: progress.advance(1, name)) as compiled:
            self.prefill(np.zeros(n, np.int32), 0)
            if n < self.n_ctx:
                self.decode(0, n)
        for a in (self.kv.k, self.kv.v, getattr(self.kv, "k_scale", None), getattr(self.kv, "v_scale", None)):
            if a is not None:
                a[:, :n + 1] = 0
        folder = cache_dir()
        if not compiled:
            detail = "every kernel loaded from the disk cache"
        else:
            detail = (f"cached in {folder}: later starts load them" if folder else
                      "no writable cache folder: every run compiles")
        progress.done(detail)

    def device_info(self) -> dict:
        if self.exact:
            return {"backend": "cpu", "device": "numpy (reference)"}
        return {"backend": "cpu", "device": "numba", "threads": self.threads}

    def synchronize(self) -> None:
        """Nothing runs asynchronously here."""

    def roofline(self) -> None:
        return None

    def peak_memory_bytes(self) -> None:
        return None

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
            outs.append(forward(self.weights, self.cfg, chunk, start + i, self.kv, all_logits, self.dtype,
                                self._ops))
        return np.concatenate(outs) if all_logits else outs[-1]

    def ring_first(self, end: int) -> int:
        return 0                      # the host pool keeps every position of every layer

    def kv_imported(self, first: int, end: int) -> None:
        """Nothing to track: the host pool has no rings."""

    def reusable_prefix(self, n: int) -> int:
        """Every position of the host pool survives until rewritten: any prefix is reusable."""
        return n

    def decode(self, token: int, pos: int) -> np.ndarray:
        return forward(self.weights, self.cfg, np.array([token], np.int32), pos, self.kv, dtype=self.dtype,
                       ops=self._ops)

    # The generation loop calls these; the CUDA back-end samples on the device instead.
    def prefill_sample(self, tokens, start: int, sampler: Sampler, history: list[int], cancel=None,
                       checked: bool = False) -> int | None:
        logits = self.prefill(tokens, start, cancel)
        return None if logits is None else sampler.sample(logits, history)

    def sample_logits(self, logits: np.ndarray, sampler: Sampler, history: list[int]) -> int:
        return sampler.sample(logits.copy(), history)      # the sampler edits its input in place

    def decode_sample(self, token: int, pos: int, sampler: Sampler, history: list[int]) -> int:
        return sampler.sample(self.decode(token, pos), history)

    def decode_tokens(self, token: int, pos: int, sampler: Sampler, history: list[int]):
        """Yield the tokens after `token` (at `pos`), one decode step per next(); the caller
        appends each yielded token to `history` before asking for the next."""
        while True:
            token = self.decode_sample(token, pos, sampler, history)
            pos += 1
            yield token
