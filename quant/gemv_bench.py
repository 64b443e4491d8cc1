"""Benchmark of the decode GEMV: `python -m genie_rt.quant.gemv [--json PATH]` on a GPU.

What it does, in one run (llm.c style: nothing is timed before it matches numpy):
1. measures the device's read bandwidth with a plain 128-bit streaming kernel;
2. for each Qwen3-4B GEMV shape and each variant (format x mode x n_tok x ksplit):
   checks a sample of output rows against numpy (`gemv.error_bound`), then times the
   kernel with CUDA events around a CUDA graph of back-to-back launches (median);
3. times a whole decode step's GEMVs (36 layers x QKV, O + residual, gate/up + SiLU,
   down + residual, then the output projection; Q4_K_M formats, every layer its own
   weights) captured in one CUDA graph, with and without the q8 quantization launches;
4. prints time, GB/s and the fraction of the measured bandwidth and of 4.37 TB/s
   (the H200 reference), and writes everything to --json.

Also here: `random_weight`, synthetic but valid blocks at any shape (random bytes with
sane fp16 scales, as tools/synth_gguf.py does), used by the tests too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from .formats import BLOCK_SIZES, QType, quantize_bf16
from .layout import PackedWeight, pack

H200_READ_TBS = 4.37        # measured 128-bit read bandwidth on the project's H200 (notes)

# Qwen3-4B (tied embeddings: the output projection is token_embd, Q6_K in Q4_K_M)
HIDDEN, Q_DIM, KV_DIM, FFN, VOCAB, LAYERS = 2560, 4096, 1024, 9728, 151936, 36


# =====================================================================================
# Synthetic weights
# =====================================================================================
def _fp16_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint16)


def random_weight(qtype, rows: int, cols: int, rng: np.random.Generator) -> PackedWeight:
    """A [rows, cols] weight of random valid blocks (host planes): every quant bit random,
    fp16 scales set to values that give weights of std ~0.02 (Q6_K's d is an fp16
    subnormal, as in real files). Seconds for a 389M-weight matrix; no quantizer run."""
    qtype = QType(qtype) if not isinstance(qtype, str) else QType[qtype]
    block, nbytes = BLOCK_SIZES[qtype]
    n_blocks = rows * cols // block
    if qtype in (QType.F16, QType.BF16):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        if qtype == QType.F16:
            return pack(w.astype(np.float16).view(np.uint8), qtype, (rows, cols))
        return pack(quantize_bf16(w.reshape(-1, 1)).reshape(rows, -1), qtype, (rows, cols))
    raw = np.frombuffer(rng.bytes(n_blocks * nbytes), np.uint8).copy().reshape(n_blocks, nbytes)
    f = rng.uniform(0.75, 1.25, n_blocks).astype(np.float32)
    u16 = raw.view(np.uint16)                       # every block size here is even
    if qtype == QType.Q4_K:                         # w = d*sc*q - dmin*m, E[w] = 0 for dmin = 7.5 d
        d = _fp16_bits(np.float32(7.7e-5) * f)
        u16[:, 0] = d
        u16[:, 1] = _fp16_bits(d.view(np.float16).astype(np.float32) * 7.5)
    elif qtype == QType.Q6_K:                       # w = d*sc*(q-32), random sign of d
        sign = np.where(rng.random(n_blocks) < 0.5, np.float32(-1), np.float32(1))
        u16[:, 104] = _fp16_bits(np.float32(1.45e-5) * f * sign)
    elif qtype == QType.Q8_0:                       # w = d*q, q ~ U(-128..127)
        u16[:, 0] = _fp16_bits(np.float32(0.02 / 74) * f)
    elif qtype == QType.Q5_0:                       # w = d*(q-16), q ~ U(0..31)
        u16[:, 0] = _fp16_bits(np.float32(0.02 / 9.2) * f)
    elif qtype == QType.Q4_0:                       # w = d*(q-8), q ~ U(0..15)
        u16[:, 0] = _fp16_bits(np.float32(0.02 / 4.6) * f)
    elif qtype in (QType.Q4_1, QType.Q5_1):         # w = d*q + m, m ~ -d*qmax/2: E[w] ~ 0
        qmax = 15 if qtype == QType.Q4_1 else 31
        d = _fp16_bits(np.float32(0.02 / (0.29 * qmax)) * f)
        u16[:, 0] = d
        u16[:, 1] = _fp16_bits(d.view(np.float16).astype(np.float32) * np.float32(-qmax / 2)
                               * rng.uniform(0.8, 1.2, n_blocks).astype(np.float32))
    elif qtype == QType.Q5_K:                       # as Q4_K with 5-bit q: dmin = 15.5 d
        d = _fp16_bits(np.float32(3.8e-5) * f)
        u16[:, 0] = d
        u16[:, 1] = _fp16_bits(d.view(np.float16).astype(np.float32) * 15.5)
    else:
        raise ValueError(f"random_weight: no generator for {qtype.name}")
    return pack(raw.reshape(rows, -1), qtype, (rows, cols))


def rows_of(w: PackedWeight, idx: np.ndarray) -> PackedWeight:
    """The rows idx of a host PackedWeight (for checking a sample of a huge output)."""
    return PackedWeight(w.qtype, len(idx), w.cols, {k: np.ascontiguousarray(v[idx]) for k, v in w.planes.items()})


# =====================================================================================
# CUDA graph + event timing: the engine's own (engine/cuda_graph.py)
# =====================================================================================
def time_graph(stream, fn, per_graph: int, replays: int = 7) -> float:
    """Median seconds of one fn() call, timed as a graph of `per_graph` calls
    (engine/cuda_graph.time_us, the engine's own graph capture and event timing)."""
    from genie_rt.engine.cuda_graph import time_us
    return time_us(fn, stream, per=per_graph, reps=replays) * 1e-6


def _read_kernel():
    from numba import cuda, uint32

    from . import ptx

    @cuda.jit
    def read_v4(a, out):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        acc = uint32(0)
        n4 = a.size // 4
        while i < n4:
            v = ptx.ldg_v4(a, i * 4)
            acc ^= v[0] ^ v[1] ^ v[2] ^ v[3]
            i += stride
        out[cuda.grid(1)] = acc
    return read_v4


def measure_bandwidth(stream, nbytes: int = 1 << 30) -> dict:
    """Read bandwidth of a grid-stride ld.global.nc.v4 kernel (best of 8 and 16 blocks/SM)."""
    from numba import cuda
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    a = cuda.device_array(nbytes // 4, np.uint32, stream=stream)
    k = _read_kernel()
    out = {}
    for bps in (8, 16):
        grid = sms * bps
        o = cuda.device_array(grid * 256, np.uint32, stream=stream)
        k[grid, 256, stream](a, o)
        t = time_graph(stream, lambda: k[grid, 256, stream](a, o), per_graph=10, replays=5)
        out[f"{bps}_blocks_per_sm_tbs"] = nbytes / t / 1e12
    out["read_tbs"] = max(out.values())
    return out


# =====================================================================================
# Variants
# =====================================================================================
def _check(name, got, ref, bound) -> float:
    """Compare; return max |err| / bound (<= 1 passes). Raise with the worst element."""
    err = np.abs(got.astype(np.float64) - ref)
    ratio = err / bound
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    r = float(ratio[worst])
    if not r <= 1.0:
        raise AssertionError(f"{name}: |y - ref| exceeds the bound at {worst}: got {got[worst]!r}, "
                             f"ref {ref[worst]!r}, bound {bound[worst]:.3g} ({r:.3g}x)")
    return r


class Bench:
    def __init__(self, args):
        from numba import cuda

        from . import gemv as G
        self.G, self.cuda, self.args = G, cuda, args
        self.stream = cuda.stream()
        self.rng = np.random.default_rng(args.seed)
        self.results = []
        self.peak = None

    # -- buffers ---------------------------------------------------------------------
    def activations(self, n_tok, cols):
        cuda, G = self.cuda, self.G
        x = self.rng.standard_normal((n_tok, cols), dtype=np.float32)
        dx = cuda.to_device(x, stream=self.stream)
        xq = cuda.device_array((n_tok, cols), np.int8, stream=self.stream)
        xs = cuda.device_array((n_tok, cols // 8), np.float32, stream=self.stream)
        G.quantize_q8(dx, xq, xs, stream=self.stream)
        return x, dx, xq, xs

    def report(self, rec):
        self.results.append(rec)
        peak = self.peak or H200_READ_TBS
        print(f"  {rec['name']:<44s} {rec['us']:9.2f} us {rec['gbs']:8.0f} GB/s "
              f"{rec['gbs'] / 1e3 / peak:6.1%} of measured {rec['gbs'] / 1e3 / H200_READ_TBS:6.1%} of 4.37"
              + (f"  (err/bound {rec['err_ratio']:.2g})" if 'err_ratio' in rec else ""), flush=True)

    # -- one GEMV variant ------------------------------------------------------------
    def gemv_variant(self, label, qtype, mode, rows, cols, n_tok=1, ksplit=None, sample=1024):
        G, cuda, s = self.G, self.cuda, self.stream
        hw = random_weight(qtype, rows, cols, self.rng)
        w = G.prepare_weight(G.to_device(hw, stream=s), mode)
        x, dx, xq, xs = self.activations(n_tok, cols)
        y = cuda.device_array((n_tok, rows), np.float32, stream=s)
        ks = G.choose_ksplit(rows, w.units) if ksplit is None else ksplit
        G.compile_gemv(w, n_tok, ksplit=ks)
        G.compile_quantize_q8()

        def launch():
            G.gemv(w, dx, y, xq=xq, xs=xs, stream=s, ksplit=ks)
        launch()
        s.synchronize()
        idx = np.sort(self.rng.choice(rows, min(sample, rows), replace=False))
        W = G.dequantize_weight(rows_of(hw, idx))
        ref = G.gemv_reference(W, x)
        xs_h = xs.copy_to_host() if mode == "dp4a" else None
        ratio = _check(label, y.copy_to_host()[:, idx], ref, G.error_bound(W, x, mode, xs_h))
        t = time_graph(s, launch, per_graph=max(3, min(200, int(2e-3 * 4e12 / w.nbytes))))
        t0 = time.perf_counter()
        for _ in range(50):
            launch()
        host_us = (time.perf_counter() - t0) / 50 * 1e6
        s.synchronize()
        nbytes = w.nbytes + n_tok * (cols * 4 + rows * 4)
        self.report(dict(name=label, kind="gemv", qtype=w.qtype.name, mode=mode, rows=rows, cols=cols,
                         n_tok=n_tok, ksplit=ks, bytes=nbytes, us=t * 1e6, gbs=nbytes / t / 1e9,
                         host_us_per_launch=host_us, err_ratio=ratio))
        return w

    # -- experimental versions from tools/gemv_variants (repository checkout only) ----
    def tool_variants(self, shapes):
        """Validate and time every tools/gemv_variants/v*.py on the Q4_K shapes."""
        import importlib.util
        folder = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
                              "tools", "gemv_variants")
        files = sorted(f for f in os.listdir(folder) if f.startswith("v") and f.endswith(".py")) \
            if os.path.isdir(folder) else []
        if not files:
            return
        print(f"experimental versions ({folder}):", flush=True)
        G, cuda, s = self.G, self.cuda, self.stream
        for f in files:
            spec = importlib.util.spec_from_file_location(f"gemv_variant_{f[:-3]}", os.path.join(folder, f))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            for name, rows, cols in shapes:
                hw = random_weight(mod.QTYPE, rows, cols, self.rng)
                w = G.prepare_weight(G.to_device(hw, stream=s), mod.MODE)
                x, dx, xq, xs = self.activations(1, cols)
                y = cuda.device_array((1, rows), np.float32, stream=s)
                launch = mod.launcher(w, dx, y, xq, xs, s)     # compiles, returns a no-arg launch
                launch()
                s.synchronize()
                idx = np.sort(self.rng.choice(rows, min(1024, rows), replace=False))
                W = G.dequantize_weight(rows_of(hw, idx))
                label = f"{mod.NAME} {name} {cols}->{rows}"
                xs_h = xs.copy_to_host() if mod.MODE == "dp4a" else None
                ratio = _check(label, y.copy_to_host()[:, idx], G.gemv_reference(W, x),
                               G.error_bound(W, x, mod.MODE, xs_h))
                t = time_graph(s, launch, per_graph=max(3, min(200, int(2e-3 * 4e12 / w.nbytes))))
                nbytes = w.nbytes + cols * 4 + rows * 4
                self.report(dict(name=label, kind="tool-variant", variant=f[:-3], rows=rows, cols=cols,
                                 n_tok=1, bytes=nbytes, us=t * 1e6, gbs=nbytes / t / 1e9, err_ratio=ratio))

    # -- fused variants --------------------------------------------------------------
    def fused_variants(self, n_tok=1):
        G, cuda, s, rng = self.G, self.cuda, self.stream, self.rng
        hq = random_weight(QType.Q4_K, Q_DIM, HIDDEN, rng)
        hk = random_weight(QType.Q4_K, KV_DIM, HIDDEN, rng)
        hv = random_weight(QType.Q6_K, KV_DIM, HIDDEN, rng)
        wq, wk, wv = (G.prepare_weight(G.to_device(h, stream=s)) for h in (hq, hk, hv))
        x, dx, xq, xs = self.activations(n_tok, HIDDEN)
        xs_h = xs.copy_to_host()
        total = Q_DIM + 2 * KV_DIM
        y = cuda.device_array((n_tok, total), np.float32, stream=s)
        G.compile_qkv(wq, wk, wv, n_tok)

        def qkv():
            G.gemv_qkv(wq, wk, wv, dx, y, xq=xq, xs=xs, stream=s)
        qkv()
        s.synchronize()
        got = y.copy_to_host()
        ratio = 0.0
        for (h, lo) in ((hq, 0), (hk, Q_DIM), (hv, Q_DIM + KV_DIM)):
            idx = np.sort(rng.choice(h.rows, min(256, h.rows), replace=False))
            W = G.dequantize_weight(rows_of(h, idx))
            ratio = max(ratio, _check("qkv", got[:, lo + idx], G.gemv_reference(W, x),
                                      G.error_bound(W, x, "dp4a", xs_h)))
        nbytes = wq.nbytes + wk.nbytes + wv.nbytes
        t = time_graph(s, qkv, per_graph=50)
        self.report(dict(name=f"qkv Q4_K+Q4_K+Q6_K {HIDDEN}->{total} n{n_tok}", kind="qkv", n_tok=n_tok,
                         bytes=nbytes, us=t * 1e6, gbs=nbytes / t / 1e9, err_ratio=ratio))

        hg = random_weight(QType.Q4_K, FFN, HIDDEN, rng)
        hu = random_weight(QType.Q4_K, FFN, HIDDEN, rng)
        wg, wu = (G.prepare_weight(G.to_device(h, stream=s)) for h in (hg, hu))
        h_out = cuda.device_array((n_tok, FFN), np.float32, stream=s)
        G.compile_swiglu(wg, wu, n_tok)

        def swiglu():
            G.gemv_swiglu(wg, wu, dx, h_out, xq=xq, xs=xs, stream=s)
        swiglu()
        s.synchronize()
        idx = np.sort(rng.choice(FFN, min(512, FFN), replace=False))
        Wg, Wu = G.dequantize_weight(rows_of(hg, idx)), G.dequantize_weight(rows_of(hu, idx))
        xt = G.dequantize_q8(xq.copy_to_host(), xs_h)          # what the kernel multiplies
        ref = G.swiglu_reference(Wg, Wu, xt)
        # silu(g) * u with g, u each within their f32 bound: first-order propagation
        g, u = G.gemv_reference(Wg, xt), G.gemv_reference(Wu, xt)
        bg, bu = G.error_bound(Wg, xt, "f32"), G.error_bound(Wu, xt, "f32")
        sg = 1 / (1 + np.exp(-g))
        bound = np.abs(sg * (1 + g * (1 - sg)) * u) * bg + np.abs(g * sg) * bu + 1e-30
        ratio = _check("swiglu", h_out.copy_to_host()[:, idx], ref, 2 * bound)
        nbytes = wg.nbytes + wu.nbytes
        t = time_graph(s, swiglu, per_graph=20)
        self.report(dict(name=f"gate+up+silu Q4_K {HIDDEN}->2x{FFN} n{n_tok}", kind="swiglu", n_tok=n_tok,
                         bytes=nbytes, us=t * 1e6, gbs=nbytes / t / 1e9, err_ratio=ratio))

    # -- a whole decode step -----------------------------------------------------------
    def decode_step(self, n_layers=LAYERS):
        G, cuda, s, rng = self.G, self.cuda, self.stream, self.rng

        def more_bits(i):       # llama.cpp Q4_K_M: attn_v / ffn_down Q6_K in these layers
            return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2

        def dev(qt, rows, cols):
            return G.prepare_weight(G.to_device(random_weight(qt, rows, cols, rng), stream=s))
        t0 = time.perf_counter()
        if getattr(self, "_step_weights", (None,))[0] == n_layers:   # made once per Bench
            _, layers, out = self._step_weights
        else:
            layers = []
            for i in range(n_layers):
                big = QType.Q6_K if more_bits(i) else QType.Q4_K
                layers.append(dict(q=dev(QType.Q4_K, Q_DIM, HIDDEN), k=dev(QType.Q4_K, KV_DIM, HIDDEN),
                                   v=dev(big, KV_DIM, HIDDEN), o=dev(QType.Q4_K, HIDDEN, Q_DIM),
                                   g=dev(QType.Q4_K, FFN, HIDDEN), u=dev(QType.Q4_K, FFN, HIDDEN),
                                   d=dev(big, HIDDEN, FFN)))
            out = dev(QType.Q6_K, VOCAB, HIDDEN)
            self._step_weights = (n_layers, layers, out)
        s.synchronize()
        nbytes = sum(w.nbytes for L in layers for w in L.values()) + out.nbytes
        print(f"  {n_layers} layers + output of random weights ({nbytes / 1e9:.2f} GB) "
              f"ready in {time.perf_counter() - t0:.1f} s", flush=True)

        def f32(n):             # float32 [1, n] activation, random
            return cuda.to_device(rng.standard_normal((1, n), dtype=np.float32), stream=s)

        def q8(n):              # (xq int8 [1, n], xs float32 [1, n / 8]) q8 buffers
            return (cuda.device_array((1, n), np.int8, stream=s),
                    cuda.device_array((1, n // 8), np.float32, stream=s))
        x, xa, x2 = f32(HIDDEN), f32(Q_DIM), f32(HIDDEN)
        qkv, h, res, logits = f32(Q_DIM + 2 * KV_DIM), f32(FFN), f32(HIDDEN), f32(VOCAB)
        (q_h, s_h), (q_a, s_a), (hq, hs) = q8(HIDDEN), q8(Q_DIM), q8(FFN)
        G.compile_quantize_q8()
        for L in layers:
            G.compile_qkv(L["q"], L["k"], L["v"])
            G.compile_gemv(L["o"], residual=True)
            G.compile_swiglu(L["g"], L["u"])
            G.compile_gemv(L["d"], residual=True)
        G.compile_gemv(out)

        def step(quantize=True):
            for L in layers:
                if quantize:
                    G.quantize_q8(x, q_h, s_h, stream=s)            # (engine: fused in RMSNorm)
                G.gemv_qkv(L["q"], L["k"], L["v"], x, qkv, xq=q_h, xs=s_h, stream=s)
                if quantize:
                    G.quantize_q8(xa, q_a, s_a, stream=s)           # attention output
                G.gemv(L["o"], xa, res, xq=q_a, xs=s_a, residual=res, stream=s)
                if quantize:
                    G.quantize_q8(x2, q_h, s_h, stream=s)           # (engine: fused in RMSNorm)
                G.gemv_swiglu(L["g"], L["u"], x2, h, xq=q_h, xs=s_h, stream=s)
                if quantize:
                    G.quantize_q8(h, hq, hs, stream=s)           # (engine: SwiGLU epilogue)
                G.gemv(L["d"], h, res, xq=hq, xs=hs, residual=res, stream=s)
            if quantize:
                G.quantize_q8(x, q_h, s_h, stream=s)
            G.gemv(out, x, logits, xq=q_h, xs=s_h, stream=s)
        step()
        s.synchronize()
        n_launch = n_layers * 4 + 1
        for quantize in (True, False):
            t = time_graph(s, lambda: step(quantize), per_graph=1, replays=9)
            label = f"decode step GEMVs, {n_layers} layers, {n_launch}" + \
                (f" + {n_launch} q8 launches" if quantize else " launches (q8 fused elsewhere)")
            self.report(dict(name=label, kind="step", quantize=quantize, layers=n_layers, bytes=nbytes,
                             us=t * 1e6, gbs=nbytes / t / 1e9, tokens_per_s_gemv_only=1 / t))

    def pdl_chain_check(self, n: int = 10) -> bool:
        """Programmatic dependent launch where it can go wrong: a chain of n dependent
        f32-mode GEMVs (each reads the previous one's output as x) replayed as one CUDA
        graph. The PDL build (quant/pdl.py) must give the plain build's bits."""
        G, cuda, s, rng = self.G, self.cuda, self.stream, self.rng
        mats = [G.prepare_weight(G.to_device(random_weight(QType.Q4_K, HIDDEN, HIDDEN, rng), stream=s), "f32")
                for _ in range(2)]
        x0 = (rng.standard_normal((1, HIDDEN)) * 1e-3).astype(np.float32)
        bufs = [cuda.device_array((1, HIDDEN), np.float32, stream=s) for _ in range(n + 1)]
        outs = {}
        saved = G.PDL
        try:
            for pdl in (False, True):
                G.PDL = pdl
                for m in mats:
                    G.compile_gemv(m)

                def chain():
                    for i in range(n):
                        G.gemv(mats[i % 2], bufs[i], bufs[i + 1], stream=s)
                bufs[0].copy_to_device(x0, stream=s)
                time_graph(s, chain, per_graph=1, replays=3)       # captured, replayed
                outs[pdl] = np.stack([b.copy_to_host(stream=s) for b in bufs])
                s.synchronize()
        finally:
            G.PDL = saved
        same = bool(np.array_equal(outs[False], outs[True]) and np.isfinite(outs[True]).all())
        print(f"PDL chain of {n} dependent GEMVs in a graph: {'bit-identical to the plain build' if same else 'DIFFERENT'}"
              f" (|y_n| max {np.abs(outs[True][-1]).max():.3g})", flush=True)
        self.report(dict(name=f"pdl chain check, {n} GEMVs", kind="pdl_check", ok=same))
        return same

    # -- the whole run -----------------------------------------------------------------
    def run(self):
        args = self.args
        dev = self.cuda.get_current_device()
        t0 = time.perf_counter()
        print(f"device: {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
              f"cc {dev.compute_capability}, {dev.MULTIPROCESSOR_COUNT} SMs", flush=True)
        bw = measure_bandwidth(self.stream)
        self.peak = bw["read_tbs"]
        print(f"measured read bandwidth (ld.global.nc.v4): {self.peak:.3f} TB/s "
              f"({bw['8_blocks_per_sm_tbs']:.3f} at 8 blocks/SM, {bw['16_blocks_per_sm_tbs']:.3f} at 16)",
              flush=True)
        print("single GEMVs (validated on a sample of rows, then timed in a CUDA graph):", flush=True)
        Q4, Q6 = QType.Q4_K, QType.Q6_K
        shapes = [("attn_q", Q_DIM, HIDDEN), ("attn_k/v", KV_DIM, HIDDEN), ("attn_output", HIDDEN, Q_DIM),
                  ("ffn_gate/up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)]
        for name, rows, cols in shapes:
            for mode in ("dp4a", "f32"):
                self.gemv_variant(f"{name} Q4_K {mode} {cols}->{rows}", Q4, mode, rows, cols)
        for mode in ("dp4a", "f32"):
            self.gemv_variant(f"ffn_down Q6_K {mode} {FFN}->{HIDDEN}", Q6, mode, HIDDEN, FFN)
        for mode in ("dp4a", "f32"):
            self.gemv_variant(f"output Q6_K {mode} {HIDDEN}->{VOCAB}", Q6, mode, VOCAB, HIDDEN, sample=2048)
        print("ksplit (warps per row) sweep, Q4_K dp4a:", flush=True)
        for name, rows, cols in (("attn_k/v", KV_DIM, HIDDEN), ("ffn_down", HIDDEN, FFN)):
            for ks in (1, 2, 4):
                self.gemv_variant(f"{name} Q4_K dp4a ks{ks} {cols}->{rows}", Q4, "dp4a", rows, cols, ksplit=ks)
        print("other formats and batches:", flush=True)
        self.gemv_variant(f"Q8_0 dp4a {HIDDEN}->{FFN}", QType.Q8_0, "dp4a", FFN, HIDDEN)
        self.gemv_variant(f"Q5_0 dp4a {HIDDEN}->{FFN}", QType.Q5_0, "dp4a", FFN, HIDDEN)
        self.gemv_variant(f"F16 f32 {HIDDEN}->{FFN}", QType.F16, "f32", FFN, HIDDEN)
        for n_tok, mode in ((2, "dp4a"), (8, "dp4a"), (8, "f32")):
            self.gemv_variant(f"ffn_gate/up Q4_K {mode} n{n_tok}", Q4, mode, FFN, HIDDEN, n_tok=n_tok)
        self.tool_variants(shapes)
        print("fused launches:", flush=True)
        self.fused_variants(1)
        self.fused_variants(8)
        print("whole decode step:", flush=True)
        self.decode_step(args.layers)
        # every kernel was compiled by compile_* before its first launch: a second overload
        # means the eager signature did not match the launch types (it would compile lazily)
        lazy = [str(key) for key, k in self.G._kernels.items() if len(getattr(k, "overloads", {})) > 1]
        print("eager compile signatures matched every launch" if not lazy else
              f"WARNING: kernels compiled again at launch (eager signature mismatch): {lazy}", flush=True)
        print(f"total run time {time.perf_counter() - t0:.0f} s", flush=True)
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return dict(device=name, cc=list(dev.compute_capability), sms=dev.MULTIPROCESSOR_COUNT,
                    bandwidth=bw, h200_reference_tbs=H200_READ_TBS, results=self.results, lazy_compiles=lazy,
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), python=platform.python_version(),
                    argv=sys.argv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m genie_rt.quant.gemv",
                                description="Validate and time the decode GEMV kernels on the GPU.")
    p.add_argument("--json", help="write all results to this file")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers in the decode-step test (default 36)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("the benchmark needs a real GPU (NUMBA_ENABLE_CUDASIM=1 is set)", file=sys.stderr)
        return 2
    from numba import cuda
    if not cuda.is_available():
        print("no CUDA GPU found: run this on the GPU machine", file=sys.stderr)
        return 2
    out = Bench(args).run()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0
