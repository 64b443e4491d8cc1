"""Benchmark of the CPU kernels: validate, then time them on real model shapes.

    python -m genie_rt.cpu.bench [--threads N] [--gemma PATH] [--qwen PATH] [--quick]
                                 [--compile-times] [--json FILE]

1. Validation: every op against its numpy reference on small awkward shapes (linear of
   each GGML type within its error bound, attention over INT8 with a window and a ring,
   the small ops); any failure stops the benchmark with exit status 1.
2. Memory bandwidth: a streaming read of 512 MiB (int8 sums, the linear kernels' access
   pattern) on 1 and N threads - the roofline's denominator.
3. Every distinct matmul of Gemma 3 270M (the real GGUF if present, else the same shapes
   and types with random blocks) and Qwen3-0.6B (tools/synth_gguf.py --shape 0.6b):
   GB/s of weights and G multiply-adds/s, at n = 1 (decode) and 33 (prefill).
4. One step of each model's op sequence (embedding, per layer: norms, q/k/v, QK-norm,
   RoPE, K/V write, attention, o, FFN; final norm and the output matmul for the last
   token): decode of one token at context 64 and prefill of 33 tokens, as tokens/s,
   with the time per kind of op and the roofline (weight bytes per token / bandwidth).
   This is the ops in the order a model file calls them, not the model file itself (no
   sampling, no tokenizer); the logits are not checked here.
5. --compile-times: first-call time of the linear kernels with an empty numba cache (a
   fresh process and cache folder) and the time to load them from that cache.

Times: the best of several repetitions, wall clock. On a shared machine the wall time
includes other processes' share of the cores, so the process CPU time per thread is
printed too (what the kernels cost when they run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from numba import prange

from genie_rt.quant.formats import BLOCK_SIZES, QType, quantize

from . import attention as A
from . import ops
from .jit import kernel
from .simd import dot_i8
from .linear import linear, linear_error_bound, linear_quantized_reference, linear_reference
from .threads import get_threads, set_threads
from .topk import top_k, top_k_reference
from .weights import CPUWeight

GEMMA = "/tmp/models/gemma-3-270m-q4_k_m.gguf"
QWEN = "/tmp/qwen3-0.6b.gguf"


# -- 1. validation ---------------------------------------------------------------------

def validate(quick: bool) -> list[str]:
    failures = []
    rng = np.random.default_rng(0)
    types = ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "F16"] if quick else [q.name for q in BLOCK_SIZES]
    for qt in types:
        cols = 512 if qt.endswith("_K") else 576
        w = CPUWeight.from_bytes(quantize(rng.standard_normal((7, cols)).astype(np.float32) * 0.05, qt),
                                 qt, (7, cols), qt)
        for n in (1, 3):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            y = linear(x, w)
            ok = (np.abs(y - linear_reference(x, w)) <= linear_error_bound(x, w)).all() and \
                (np.abs(y - linear_quantized_reference(x, w)) <= linear_error_bound(x, w, True)).all()
            if not ok:
                failures.append(f"linear {qt} n={n}")
    from genie_rt.kvcache.pool import HostKVPool, KVShape, quantize_rows_int8
    pool = HostKVPool(KVShape(1, 22, 1, 256, "int8"))
    kk = rng.standard_normal((47, 1, 256)).astype(np.float32)
    vv = rng.standard_normal((47, 1, 256)).astype(np.float32)
    for p in range(0, 40, 7):
        A.kv_write(kk[p:p + 7], vv[p:p + 7], pool.k[0], pool.v[0], pool.k_scale[0], pool.v_scale[0], p, 22)
    A.kv_write(kk[40:], vv[40:], pool.k[0], pool.v[0], pool.k_scale[0], pool.v_scale[0], 40, 22)
    q = rng.standard_normal((7, 4, 256)).astype(np.float32)
    out = A.attention(q, pool.k[0], pool.v[0], pool.k_scale[0], pool.v_scale[0], 40, 0.0625, 16, 22)
    kq, ks = quantize_rows_int8(kk)
    vq, vs = quantize_rows_int8(vv)
    ref = A.attention_reference(q, kq, vq, ks, vs, 40, 0.0625, 16, 0)
    if np.abs(out - ref).max() > 2e-6 * np.abs(ref).max() + 1e-6:
        failures.append("attention int8 window 16 ring 22")
    x = rng.standard_normal((5, 640)).astype(np.float32)
    wn = rng.standard_normal(640).astype(np.float32)
    from genie_rt.engine.models.reference import rmsnorm
    if np.abs(ops.rmsnorm(x, wn, 1e-6) - rmsnorm(x.astype(np.float64), wn, 1e-6)).max() > 1e-5:
        failures.append("rmsnorm")
    g = rng.standard_normal(3000).astype(np.float32) * 5
    for fn, ref_fn in ((ops.silu_mul, ops.silu_reference), (ops.gelu_tanh_mul, ops.gelu_tanh_reference)):
        if not np.allclose(fn(g, g), ref_fn(g) * g, rtol=3e-6, atol=1e-6):
            failures.append(fn.__name__)
    return failures


# -- 2. bandwidth -------------------------------------------------------------------------

@kernel(parallel=True)
def _stream_read(a, nt, out):
    """Sum the int8 bytes of a [m] (m % (256 nt) == 0) in nt chunks with simd.dot_i8 (the
    loads the linear kernels issue): reads every byte once."""
    m = a.size // 256
    for c in prange(nt):
        s = np.int64(0)
        for i in range(m * c // nt, m * (c + 1) // nt):
            s += dot_i8(a, i * 256, a, i * 256, 256)
        out[c] = s


def bandwidth(threads: int) -> dict[int, float]:
    a = np.ones(512 << 20, np.uint8)
    res = {}
    for nt in sorted({1, threads}):
        out = np.zeros(nt, np.int64)
        _stream_read(a, nt, out)
        res[nt] = a.nbytes / _best(lambda: _stream_read(a, nt, out), 10)[0] / 1e9
    return res


# -- timing helpers ---------------------------------------------------------------------

def _best(fn, reps: int) -> tuple[float, float]:
    """(best wall seconds, best process-CPU seconds per thread) over reps calls."""
    nt = get_threads()
    wall, cpu = 1e30, 1e30
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, (time.process_time() - c0) / nt)
    return wall, cpu


# -- 3./4. models ----------------------------------------------------------------------

class Model:
    """One model's weights as the benchmark uses them: CPUWeights over the GGUF (or random
    blocks of the same types), float32 norms, and its shape."""

    def __init__(self, label: str, arch: str, hp: dict, tensors: dict, source: str):
        self.label, self.arch, self.hp, self.t, self.source = label, arch, hp, tensors, source

    def w(self, name):
        return self.t[name]

    @property
    def layer_matmuls(self):
        return ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]

    def weight_bytes_per_token(self) -> int:
        total = sum(self.t[f"blk.{i}.{m}.weight"].nbytes for i in range(self.hp["layers"]) for m in self.layer_matmuls)
        return total + self.t["output.weight"].nbytes


def _random_weight(qtype: QType, shape, rng) -> CPUWeight:
    """Random blocks with small fp16 scales: the right bytes to read, meaningless values."""
    block, nbytes = BLOCK_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    offs = {QType.Q6_K: [208], QType.Q4_K: [0, 2], QType.Q5_K: [0, 2], QType.Q4_1: [0, 2], QType.Q5_1: [0, 2]}
    if block > 1:
        for o in offs.get(qtype, [0]):
            raw[..., o:o + 2] = half
    elif qtype == QType.F32:
        raw = (rng.standard_normal((rows, cols)).astype(np.float32) * 0.02).view(np.uint8)
    else:
        raw = (rng.standard_normal((rows, cols)).astype(np.float16) * 0.02).view(np.uint8)
    return CPUWeight.from_bytes(raw, qtype, shape)


GEMMA_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
               "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}


def load_model(path: str | None, arch: str) -> Model:
    if arch == "gemma3":
        hp = dict(layers=18, embd=640, heads=4, kv_heads=1, head_dim=256, ff=2048, vocab=262144,
                  window=512, eps=1e-6, scale=256 ** -0.5)
    else:
        hp = dict(layers=28, embd=1024, heads=16, kv_heads=8, head_dim=128, ff=3072, vocab=151936,
                  window=0, eps=1e-6, scale=128 ** -0.5)
    shapes = {"attn_q": (hp["heads"] * hp["head_dim"], hp["embd"]), "attn_k": (hp["kv_heads"] * hp["head_dim"], hp["embd"]),
              "attn_v": (hp["kv_heads"] * hp["head_dim"], hp["embd"]), "attn_output": (hp["embd"], hp["heads"] * hp["head_dim"]),
              "ffn_gate": (hp["ff"], hp["embd"]), "ffn_up": (hp["ff"], hp["embd"]), "ffn_down": (hp["embd"], hp["ff"])}
    t = {}
    if path and Path(path).exists():
        from genie_rt.engine.gguf_file import open_gguf
        g = open_gguf(path)
        for name, ti in g.tensors.items():
            if len(ti.shape) == 2:
                t[name] = CPUWeight.from_tensor(ti)
            else:
                t[name] = np.ascontiguousarray(ti.data).view(np.float32).reshape(ti.shape)
        if "output.weight" not in t:
            t["output.weight"] = t["token_embd.weight"]
        source = path
    else:
        rng = np.random.default_rng(0)
        types = GEMMA_TYPES if arch == "gemma3" else {m: "Q4_K" for m in shapes} | {"attn_v": "Q6_K", "ffn_down": "Q6_K"}
        shared = {m: _random_weight(QType[types[m]], shapes[m], rng) for m in shapes}
        for i in range(hp["layers"]):
            for m in shapes:
                t[f"blk.{i}.{m}.weight"] = shared[m]          # same bytes each layer (cache effects noted)
        emb_t = QType.Q8_0 if arch == "gemma3" else QType.Q6_K
        t["token_embd.weight"] = t["output.weight"] = _random_weight(emb_t, (hp["vocab"], hp["embd"]), rng)
        source = "random blocks (file absent)"
    ones = lambda d: np.ones(d, np.float32)  # noqa: E731
    for i in range(hp["layers"]):
        for nm, d in (("attn_norm", hp["embd"]), ("ffn_norm", hp["embd"]), ("attn_q_norm", hp["head_dim"]),
                      ("attn_k_norm", hp["head_dim"]), ("post_attention_norm", hp["embd"]), ("post_ffw_norm", hp["embd"])):
            t.setdefault(f"blk.{i}.{nm}.weight", ones(d))
    t.setdefault("output_norm.weight", ones(hp["embd"]))
    label = "Gemma 3 270M" if arch == "gemma3" else "Qwen3-0.6B"
    return Model(label, arch, hp, t, source)


def bench_matmuls(m: Model, ns=(1, 33)) -> list[dict]:
    rows = []
    seen = set()
    names = [f"blk.0.{k}.weight" for k in m.layer_matmuls] + [f"blk.{m.hp['layers'] - 1}.ffn_down.weight", "output.weight"]
    rng = np.random.default_rng(1)
    for name in names:
        w = m.w(name)
        key = (w.qtype, w.shape)
        if key in seen:
            continue
        seen.add(key)
        for n in ns:
            if name == "output.weight" and n > 1:
                continue
            x = rng.standard_normal((n, w.cols)).astype(np.float32)
            out = np.empty((n, w.rows), np.float32)
            linear(x, w, out)
            reps = int(min(50, max(3, 3e8 / (w.nbytes * max(1, n // 8)))))
            wall, cpu = _best(lambda: linear(x, w, out), reps)
            rows.append(dict(tensor=name.replace("blk.0.", "").replace(".weight", ""), type=w.qtype.name,
                             shape=list(w.shape), n=n, wall_ms=wall * 1e3, cpu_ms=cpu * 1e3,
                             gbps=w.nbytes / wall / 1e9, gmacs=n * w.rows * w.cols / wall / 1e9))
    return rows


def step(m: Model, tokens: np.ndarray, start: int, cache, timer) -> np.ndarray:
    """One forward step's op sequence (Gemma 3 or Qwen3 order); timer(kind, fn) runs fn."""
    hp, t = m.hp, m.t
    n, hd, H, KV = len(tokens), hp["head_dim"], hp["heads"], hp["kv_heads"]
    gemma = m.arch == "gemma3"
    x = timer("embed", lambda: ops.embed(tokens, t["token_embd.weight"], scale=hp["embd"] ** 0.5 if gemma else None))
    pos = np.arange(start, start + n, dtype=np.float64)
    inv = hp.get("rope_base", 1e6) ** (-np.arange(0, hd, 2) / hd)
    cos = np.cos(pos[:, None] * inv).astype(np.float32)
    sin = np.sin(pos[:, None] * inv).astype(np.float32)
    for i in range(hp["layers"]):
        L = lambda s: t[f"blk.{i}.{s}.weight"]  # noqa: E731
        h = timer("norms", lambda: ops.rmsnorm(x, L("attn_norm"), hp["eps"]))
        q = timer("linear", lambda: linear(h, L("attn_q"))).reshape(n, H, hd)
        k = timer("linear", lambda: linear(h, L("attn_k"))).reshape(n, KV, hd)
        v = timer("linear", lambda: linear(h, L("attn_v"))).reshape(n, KV, hd)
        q = timer("norms", lambda: ops.rmsnorm(q, L("attn_q_norm"), hp["eps"]))
        k = timer("norms", lambda: ops.rmsnorm(k, L("attn_k_norm"), hp["eps"]))
        timer("rope", lambda: (ops.rope(q, cos, sin), ops.rope(k, cos, sin)))
        local = gemma and (i + 1) % 6 != 0
        ck, cv, cks, cvs, ring = cache[i]
        window = hp["window"] if local else 0
        timer("attention", lambda: A.kv_write(k, v, ck, cv, cks, cvs, start, ring))
        a = timer("attention", lambda: A.attention(q, ck, cv, cks, cvs, start, hp["scale"], window, ring))
        o = timer("linear", lambda: linear(a, L("attn_output")))
        if gemma:
            o = timer("norms", lambda: ops.rmsnorm(o, L("post_attention_norm"), hp["eps"]))
        x = x + o
        h = timer("norms", lambda: ops.rmsnorm(x, L("ffn_norm"), hp["eps"]))
        g = timer("linear", lambda: linear(h, L("ffn_gate")))
        u = timer("linear", lambda: linear(h, L("ffn_up")))
        f = timer("act", lambda: (ops.gelu_tanh_mul if gemma else ops.silu_mul)(g, u))
        d = timer("linear", lambda: linear(f, L("ffn_down")))
        if gemma:
            d = timer("norms", lambda: ops.rmsnorm(d, L("post_ffw_norm"), hp["eps"]))
        x = x + d
    h = timer("norms", lambda: ops.rmsnorm(x[-1:], t["output_norm.weight"], hp["eps"]))
    return timer("output", lambda: linear(h, t["output.weight"]))


def make_cache(m: Model, n_ctx: int):
    hp = m.hp
    cache = []
    for i in range(hp["layers"]):
        local = m.arch == "gemma3" and (i + 1) % 6 != 0
        slots = hp["window"] + 64 if local else n_ctx                  # a ring of window + chunk - 1 or more
        ring = slots if local else 0
        k = np.zeros((slots, hp["kv_heads"], hp["head_dim"]), np.int8)
        s = np.zeros((slots, hp["kv_heads"]), np.float32)
        cache.append((k, k.copy(), s, s.copy(), ring))
    return cache


def bench_steps(m: Model, reps: int) -> dict:
    res = {}
    for label, n, start in (("decode", 1, 64), ("prefill", 33, 0)):
        cache = make_cache(m, 1024)
        toks = np.arange(n, dtype=np.int64) + 100
        times: dict[str, float] = {}

        def timer(kind, fn):
            t0 = time.perf_counter()
            r = fn()
            times[kind] = times.get(kind, 0.0) + time.perf_counter() - t0
            return r

        step(m, toks, start, cache, lambda k, f: f())            # warm up (and compile)
        best, best_times, cpu = 1e30, None, 1e30
        for _ in range(reps):
            times.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            step(m, toks, start, cache, timer)
            wall = time.perf_counter() - t0
            cpu = min(cpu, (time.process_time() - c0) / get_threads())
            if wall < best:
                best, best_times = wall, dict(times)
        res[label] = dict(n=n, wall_ms=best * 1e3, cpu_ms=cpu * 1e3, tokens_per_s=n / best,
                          tokens_per_s_cpu=n / cpu, breakdown_ms={k: v * 1e3 for k, v in best_times.items()})
    return res


# -- 5. compile times ---------------------------------------------------------------------

_COMPILE_PROBE = """
import time, numpy as np
t0 = time.perf_counter()
from genie_rt.cpu.linear import linear
from genie_rt.cpu.weights import CPUWeight
from genie_rt.quant.formats import quantize
t1 = time.perf_counter()
out = {}
for qt in ("Q8_0", "Q5_0", "Q4_K", "Q6_K"):
    cols = 512
    w = CPUWeight.from_bytes(quantize(np.ones((4, cols), np.float32), qt), qt, (4, cols))
    t = time.perf_counter(); linear(np.ones((1, cols), np.float32), w); out[qt] = time.perf_counter() - t
print(repr({"import": t1 - t0, **out}))
"""


def compile_times() -> dict:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        res = {}
        for label in ("cold (compile, then save to the cache)", "warm (load from the cache)"):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(p.stderr)
            res[label] = dict(eval(p.stdout.strip().splitlines()[-1]), process=time.perf_counter() - t0)
        return res


# -- main ---------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m genie_rt.cpu.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="threads (0: the physical cores)")
    ap.add_argument("--gemma", default=GEMMA)
    ap.add_argument("--qwen", default=QWEN, help="e.g. python tools/synth_gguf.py --shape 0.6b -o " + QWEN)
    ap.add_argument("--quick", action="store_true", help="fewer types, fewer repetitions")
    ap.add_argument("--compile-times", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    nt = set_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"genie_rt.cpu.bench  {time.strftime('%Y-%m-%d %H:%M')}  {platform.processor() or platform.machine()}  "
          f"{os.cpu_count()} CPUs, {nt} threads, load average {load:.1f}")
    failures = validate(args.quick)
    print("validation:", "ok" if not failures else "FAILED: " + ", ".join(failures))
    if failures:
        return 1
    out = {"threads": nt, "load_average": load, "date": time.strftime("%Y-%m-%d")}
    bw = bandwidth(nt)
    out["bandwidth_gbps"] = bw
    print("memory bandwidth (stream read): " + ", ".join(f"{k} thread{'s' if k > 1 else ''} {v:.1f} GB/s" for k, v in bw.items()))
    for arch, path in (("gemma3", args.gemma), ("qwen3", args.qwen)):
        m = load_model(path, arch)
        print(f"\n== {m.label} ({m.source})")
        mm = bench_matmuls(m)
        print(f"{'tensor':<16}{'type':<6}{'shape':>14}{'n':>4}{'wall ms':>10}{'cpu ms':>9}{'GB/s':>8}{'GMAC/s':>8}")
        for r in mm:
            print(f"{r['tensor']:<16}{r['type']:<6}{str(tuple(r['shape'])):>14}{r['n']:>4}{r['wall_ms']:>10.3f}"
                  f"{r['cpu_ms']:>9.3f}{r['gbps']:>8.1f}{r['gmacs']:>8.1f}")
        steps = bench_steps(m, 2 if args.quick else 4)
        wb = m.weight_bytes_per_token()
        roof = bw[nt] * 1e9 / wb
        for label, s in steps.items():
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["breakdown_ms"].items(), key=lambda kv: -kv[1]))
            print(f"{label} {s['n']} token{'s' if s['n'] > 1 else ''}: {s['wall_ms']:.1f} ms = {s['tokens_per_s']:.1f} tokens/s "
                  f"(cpu/thread {s['cpu_ms']:.1f} ms = {s['tokens_per_s_cpu']:.1f} tokens/s); ms: {parts}")
        print(f"roofline: {wb / 1e6:.1f} MB of weights per token / {bw[nt]:.1f} GB/s = {roof:.1f} tokens/s decode")
        logits = np.random.default_rng(2).standard_normal(m.hp["vocab"]).astype(np.float32)
        if not np.array_equal(top_k(logits, 40), top_k_reference(logits, 40)):
            print("top_k: FAILED")
            return 1
        tk = _best(lambda: top_k(logits, 40), 20)[0]
        npk = _best(lambda: (lambda i: i[np.argsort(-logits[i], kind="stable")])(np.argpartition(-logits, 39)[:40]), 20)[0]
        print(f"top-40 of {m.hp['vocab']} logits: cpu.topk {tk * 1e3:.3f} ms, numpy argpartition + sort {npk * 1e3:.3f} ms")
        out[m.label] = dict(source=m.source, matmuls=mm, steps=steps, weight_bytes_per_token=wb, roofline_tps=roof,
                            top_k_ms=tk * 1e3, numpy_top_k_ms=npk * 1e3)
    if args.compile_times:
        ct = compile_times()
        out["compile_times_s"] = ct
        for label, r in ct.items():
            print(f"first calls, {label}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
