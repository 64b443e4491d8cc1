"""The op vocabulary (engine/models/ops.py) on the CPU kernels of genie_rt.cpu.

The weights stay in their GGUF format: every matrix is a `CPUWeight`, a zero-copy view of
the memory-mapped file's bytes, read by the quantized kernels (8-bit activations per block,
exact integer block dots, as llama.cpp's CPU back-end). Norm weights are float32 arrays.
The KV pool is kvcache/pool.py's HostKVPool, written and read by genie_rt.cpu.attention
(its INT8 row format, bit for bit).

Every kernel computes each output row by the same operations whatever the number of rows,
so a prompt prefilled in one chunk, in several, or token by token gives the same bits - a
seeded reply is the same whether its prompt came from the cache or not (issue 18).

The kernels release the GIL and run on `genie_rt.cpu.threads.set_threads` threads. Small
per-call temporaries (q/k/v splits, gate and up) are numpy arrays; the CPU path has no
graph to keep buffers fixed for.
"""
from __future__ import annotations

import numpy as np

from genie_rt.cpu import attention as cpu_attention
from genie_rt.cpu import ops as cpu
from genie_rt.cpu.linear import linear as cpu_linear

from .models.ops import AttnLayer
from .models.reference import rope_tables


class CPUOps:
    """The ops for one chunk: positions start .. start+n-1 of a HostKVPool."""

    def __init__(self, cfg, kv, start: int, n: int):
        self.cfg, self.kv, self.start, self.n = cfg, kv, start, n
        self._rope = {}

    def embed(self, table, ids, out, scale: float | None = None) -> None:
        cpu.embed(np.asarray(ids, np.int32), table, out=out, scale=scale)

    def norm(self, x, w, out) -> None:
        cpu.rmsnorm(x, w, self.cfg.rms_eps, out=out)

    def linear(self, x, w, out, add: bool = False) -> None:
        ws = w if isinstance(w, tuple) else (w,)
        if len(ws) == 1 and not add:
            cpu_linear(x, ws[0], out=out)
            return
        if add:
            out += cpu_linear(x, ws[0])
            return
        c = 0
        for m in ws:                  # concatenated outputs: a temporary per part
            out[:, c:c + m.rows] = cpu_linear(x, m)
            c += m.rows

    def gated(self, x, w, out, act: str) -> None:
        wg, wu = w
        g, u = cpu_linear(x, wg), cpu_linear(x, wu)
        (cpu.silu_mul if act == "silu" else cpu.gelu_tanh_mul)(g, u, out=out)

    def post_norm_add(self, x, y, w) -> None:
        x += cpu.rmsnorm(np.ascontiguousarray(y), w, self.cfg.rms_eps)

    def _tables(self, a: AttnLayer):
        key = (a.rope_base, a.rope_scale, a.rope_factors is not None)
        if key not in self._rope:
            pos = np.arange(self.start, self.start + self.n)
            cos, sin = rope_tables(self.cfg.rope_dim, pos, a.rope_base, np.float32, a.rope_scale, a.rope_factors)
            self._rope[key] = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))
        return self._rope[key]

    def _layer(self, i: int):
        kv = self.kv
        if kv.shape.dtype == "int8":
            return kv.k[i], kv.v[i], kv.k_scale[i], kv.v_scale[i]
        return kv.k[i], kv.v[i], None, None

    def rope_write(self, qkv, a: AttnLayer, q_out) -> None:
        cfg, n, hd = self.cfg, self.n, self.cfg.head_dim
        q = np.ascontiguousarray(qkv[:, :cfg.q_dim]).reshape(n, cfg.n_head, hd)
        k = np.ascontiguousarray(qkv[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim]).reshape(n, cfg.n_head_kv, hd)
        v = np.ascontiguousarray(qkv[:, cfg.q_dim + cfg.kv_dim:]).reshape(n, cfg.n_head_kv, hd)
        if a.q_norm is not None:
            q = cpu.rmsnorm(q, a.q_norm, cfg.rms_eps)
            k = cpu.rmsnorm(k, a.k_norm, cfg.rms_eps)
        cos, sin = self._tables(a)
        neox = cfg.rope_style == "neox"
        cpu.rope(q, cos, sin, neox=neox)
        cpu.rope(k, cos, sin, neox=neox)
        q_out[...] = q.reshape(n, cfg.q_dim)
        cpu_attention.kv_write(k, v, *self._layer(a.index), self.start)

    def attention(self, q, a: AttnLayer, out) -> None:
        cfg = self.cfg
        q3 = np.ascontiguousarray(q).reshape(self.n, cfg.n_head, cfg.head_dim)
        cpu_attention.attention(q3, *self._layer(a.index), self.start, a.scale,
                                window=a.window or 0, out=out)

    def head(self, x, norm_w, w, logits, softcap: float | None = None) -> None:
        h = cpu.rmsnorm(np.ascontiguousarray(x), norm_w, self.cfg.rms_eps)
        cpu_linear(h, w, out=logits)
        if softcap:
            np.multiply(np.tanh(logits / softcap), softcap, out=logits)
