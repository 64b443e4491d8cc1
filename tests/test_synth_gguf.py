"""tools/synth_gguf.py: a synthetic Qwen3 Q4_K_M GGUF must look exactly like llama.cpp's.

Checked here: the file parses with gguf's own reader; every key, tensor name, shape, type
and offset; the Q4_K_M type rule at the real layer counts and against the llama.cpp-made
fixture; the weight distribution; the tokenizer metadata; the real 4B size (computed, not
written); determinism; the CLI.
"""
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_4B_Q4_K_M_BYTES = 2_497_280_096   # llama-quantize's file (docs/synthetic-models.md)


def _load_tool():
    spec = importlib.util.spec_from_file_location("synth_gguf", ROOT / "tools" / "synth_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synth_gguf"] = mod   # dataclasses look the module up while it executes
    spec.loader.exec_module(mod)
    return mod


sg = _load_tool()
QT = gguf.GGMLQuantizationType
TINY = dict(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=1026, tied=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    sg.write_synthetic_qwen3(path, TINY, seed=7)
    return path


@pytest.fixture(scope="module")
def tiny_reader(tiny):
    return gguf.GGUFReader(tiny)


def _value(reader, key):
    return reader.fields[key].contents()


# ---------------------------------------------------------------- metadata and tensors

def test_metadata_keys_and_values(tiny_reader):
    r = tiny_reader
    expected = {
        "general.architecture": "qwen3",
        "qwen3.context_length": 40960,
        "qwen3.embedding_length": 256,
        "qwen3.block_count": 3,
        "qwen3.feed_forward_length": 768,
        "qwen3.attention.head_count": 4,
        "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 64,
        "qwen3.attention.value_length": 64,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.eos_token_id": 1002,      # <|im_end|>
        "tokenizer.ggml.padding_token_id": 1000,  # <|endoftext|>
        "tokenizer.ggml.bos_token_id": 1000,
        "tokenizer.ggml.add_bos_token": False,
        "general.quantization_version": 2,
        "general.file_type": 15,                  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    }
    for key, want in expected.items():
        assert _value(r, key) == want, key
    assert _value(r, "qwen3.rope.freq_base") == pytest.approx(1e6)
    assert _value(r, "qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert r.fields["qwen3.context_length"].types == [gguf.GGUFValueType.UINT32]
    assert _value(r, "tokenizer.chat_template") == sg.CHAT_TEMPLATE


def test_same_keys_in_same_order_as_llamacpp_fixture(tiny_reader, fixture_gguf):
    ref = gguf.GGUFReader(fixture_gguf)
    assert list(tiny_reader.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        assert tiny_reader.fields[key].types == field.types, key


def test_tensor_names_shapes_types(tiny_reader):
    h, q, kv, hd, ff, V = 256, 256, 128, 64, 768, 1026
    want = [("output_norm.weight", [h], QT.F32), ("token_embd.weight", [h, V], QT.Q6_K)]
    # use_more_bits(i, 3): 3 // 8 = 0, 7 * 3 // 8 = 2 -> only layer 2 (and (1 - 0) % 3 != 2)
    for i, more in enumerate([False, False, True]):
        big = QT.Q6_K if more else QT.Q4_K
        want += [
            (f"blk.{i}.attn_k.weight", [h, kv], QT.Q4_K),
            (f"blk.{i}.attn_k_norm.weight", [hd], QT.F32),
            (f"blk.{i}.attn_norm.weight", [h], QT.F32),
            (f"blk.{i}.attn_output.weight", [q, h], QT.Q4_K),
            (f"blk.{i}.attn_q.weight", [h, q], QT.Q4_K),
            (f"blk.{i}.attn_q_norm.weight", [hd], QT.F32),
            (f"blk.{i}.attn_v.weight", [h, kv], big),
            (f"blk.{i}.ffn_down.weight", [ff, h], big),
            (f"blk.{i}.ffn_gate.weight", [h, ff], QT.Q4_K),
            (f"blk.{i}.ffn_norm.weight", [h], QT.F32),
            (f"blk.{i}.ffn_up.weight", [h, ff], QT.Q4_K),
        ]
    got = [(t.name, t.shape.tolist(), t.tensor_type) for t in tiny_reader.tensors]
    assert got == want
    for t in tiny_reader.tensors:
        assert t.data_offset % 32 == 0, t.name


def test_tensor_table_matches_llamacpp_fixture(fixture_gguf):
    """Same shape as the fixture -> same names, order, shapes and types as llama-quantize."""
    ref = gguf.GGUFReader(fixture_gguf)
    shape = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=4122, tied=True)
    ours = [(t.name, list(t.ne), t.qtype) for t in sg.tensor_table(shape)]
    theirs = [(t.name, t.shape.tolist(), t.tensor_type) for t in ref.tensors]
    assert ours == theirs
    # and the rule the brief states: blk.0 attn_v/ffn_down Q4_K, blk.1 Q6_K, token_embd Q6_K
    types = {n: q for n, _, q in ours}
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == QT.Q4_K
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == QT.Q6_K
    assert types["token_embd.weight"] == QT.Q6_K


# ---------------------------------------------------------------- the Q4_K_M rule

@pytest.mark.parametrize("n_layer, picked", [
    # llama.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, C++ integer division
    (36, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]),   # 4B, 8B
    (28, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]),                  # 0.6B, 1.7B
    (2, [1]),                                                                   # the fixture
])
def test_use_more_bits_real_layer_counts(n_layer, picked):
    assert [i for i in range(n_layer) if sg.use_more_bits(i, n_layer)] == picked
    table = sg.tensor_table(dict(TINY, layers=n_layer))
    for kind in ("attn_v", "ffn_down"):
        q6 = [i for i in range(n_layer)
              if next(t for t in table if t.name == f"blk.{i}.{kind}.weight").qtype == QT.Q6_K]
        assert q6 == picked, kind


def test_token_embd_rule_tied_and_untied():
    tied = {t.name: t.qtype for t in sg.tensor_table("4b")}
    untied = {t.name: t.qtype for t in sg.tensor_table("8b")}
    assert "output.weight" not in tied and tied["token_embd.weight"] == QT.Q6_K
    assert untied["output.weight"] == QT.Q6_K and untied["token_embd.weight"] == QT.Q4_K
    assert list(untied)[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]


# ---------------------------------------------------------------- weights

def test_weights_finite_with_intended_distribution(tiny_reader):
    for t in tiny_reader.tensors:
        w = dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.tensor_type == QT.F32:   # norms: 1 + N(0, 0.1^2)
            assert abs(w.mean() - 1) < 0.05 and 0.05 < w.std() < 0.15, (t.name, w.mean(), w.std())
        else:
            tol = 4 * 0.02 / np.sqrt(w.size / 32)   # sub-block offsets dominate the noise
            assert abs(w.mean()) < max(tol, 1e-3), (t.name, w.mean())
            assert 0.018 < w.std() < 0.022, (t.name, w.std())


def test_block_scales_in_range(tiny_reader):
    for t in tiny_reader.tensors:
        raw = np.asarray(t.data).reshape(-1)
        if t.tensor_type == QT.Q4_K:
            half = raw.reshape(-1, 144)[:, :4].copy().view(np.float16).astype(np.float32)
            d, dmin = half[:, 0], half[:, 1]
            assert (0.75 * sg.Q4K_D * 0.99 <= d).all() and (d <= 1.25 * sg.Q4K_D * 1.01).all()
            assert np.allclose(dmin, 7.5 * d, rtol=2e-3)
        elif t.tensor_type == QT.Q6_K:
            d = np.abs(raw.reshape(-1, 210)[:, 208:].copy().view(np.float16).astype(np.float32))
            assert (0.75 * sg.Q6K_D * 0.99 <= d).all() and (d <= 1.25 * sg.Q6K_D * 1.01).all()


def test_deterministic(tiny, tmp_path):
    again = sg.write_synthetic_qwen3(tmp_path / "again.gguf", TINY, seed=7, threads=3)
    assert again.read_bytes() == tiny.read_bytes()
    other = sg.write_synthetic_qwen3(tmp_path / "other.gguf", TINY, seed=8)
    a, b = tiny.read_bytes(), other.read_bytes()
    assert len(a) == len(b) and a != b
    data_start = sg.plan(TINY).data_start
    assert a[:data_start] == b[:data_start]   # the seed changes weights, not metadata


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_self_consistent(tiny_reader):
    _check_vocab(_value(tiny_reader, "tokenizer.ggml.tokens"),
                 _value(tiny_reader, "tokenizer.ggml.token_type"),
                 _value(tiny_reader, "tokenizer.ggml.merges"), n_vocab=1026, n_text=1000)


def test_real_size_vocab_self_consistent():
    v = sg.build_vocab("4b")
    _check_vocab(v.tokens, v.token_types, v.merges, n_vocab=151936, n_text=151643)
    assert v.tokens[151643] == "<|endoftext|>" and v.tokens[151645] == "<|im_end|>"
    assert v.tokens[151667] == "<think>" and v.tokens[151668] == "</think>"
    assert v.tokens[151669] == "[PAD151669]" and v.tokens[-1] == "[PAD151935]"
    assert max(len(t.encode()) for t in v.tokens[4096:151643]) <= sg.SYNTH_MAX_TOKEN_BYTES


def _check_vocab(tokens, types, merges, n_vocab, n_text):
    assert len(tokens) == len(types) == n_vocab
    assert len(set(tokens)) == n_vocab
    assert tokens[:256] == sg.byte_alphabet()
    assert len(merges) == n_text - 256
    ids = {t: i for i, t in enumerate(tokens)}
    for j, m in enumerate(merges):
        left, right = m.split(" ")
        assert ids[left] < 256 + j and ids[right] < 256 + j, m   # parts exist before the merge
        assert tokens[256 + j] == left + right, m
    specials = list(sg.QWEN3_SPECIAL_TOKENS)
    assert tokens[n_text:n_text + 26] == specials
    assert types[:n_text] == [1] * n_text
    control = [3 if s.startswith("<|") else 4 for s in specials]
    assert types[n_text:n_text + 26] == control
    assert types[n_text + 26:] == [5] * (n_vocab - n_text - 26)
    assert [s for s, t in zip(specials, control) if t == 4] == [
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def test_vocab_prefix_is_the_real_qwen_vocab(fixture_gguf):
    ref = gguf.GGUFReader(fixture_gguf)
    v = sg.build_vocab(dict(TINY, vocab=4122))
    assert v.tokens == _value(ref, "tokenizer.ggml.tokens")
    assert v.token_types == _value(ref, "tokenizer.ggml.token_type")
    assert v.merges == _value(ref, "tokenizer.ggml.merges")
    assert sg.CHAT_TEMPLATE == _value(ref, "tokenizer.chat_template")


def test_vocab_loads_in_hf_tokenizers(tiny_reader):
    tokenizers = pytest.importorskip("tokenizers")
    tokens = _value(tiny_reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _value(tiny_reader, "tokenizer.ggml.merges")]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    text = "Turn on the kitchen lights, 21 degrees! ünïcödé"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and max(ids) < 1000


# ---------------------------------------------------------------- the real 4B shape

def test_real_4b_table_and_size_without_writing():
    lay = sg.plan("4b")
    counts = {q: sum(t.qtype == q for t in lay.tensors) for q in (QT.F32, QT.Q4_K, QT.Q6_K)}
    assert counts == {QT.F32: 145, QT.Q4_K: 216, QT.Q6_K: 37}
    shapes = {t.name: list(t.ne) for t in lay.tensors}
    assert shapes["token_embd.weight"] == [2560, 151936]
    assert shapes["blk.35.attn_q.weight"] == [2560, 4096]
    assert shapes["blk.35.attn_k.weight"] == [2560, 1024]
    assert shapes["blk.35.attn_output.weight"] == [4096, 2560]
    assert shapes["blk.35.ffn_down.weight"] == [9728, 2560]
    assert shapes["blk.35.attn_q_norm.weight"] == [128]
    data = lay.file_size - lay.data_start
    assert data == 2_491_323_904          # tensor bytes, every tensor a multiple of 32
    # llama.cpp's file has the same tensors; only the metadata (vocab strings, template) differs
    assert abs(lay.file_size - LLAMACPP_4B_Q4_K_M_BYTES) < 64 * 1024, lay.file_size


@pytest.mark.parametrize("name, size", [("0.6b", 396_726_016), ("1.7b", 1_107_430_144),
                                        ("8b", 5_027_805_088)])
def test_other_real_shapes_plan(name, size):
    assert sg.plan(name).file_size == size


def test_rejects_shapes_llamacpp_would_not_quantize_to_k_quants():
    with pytest.raises(ValueError, match="multiple of 256"):
        sg.Qwen3Shape.resolve(dict(TINY, hidden=320))
    with pytest.raises(ValueError, match="special tokens"):
        sg.Qwen3Shape.resolve(dict(TINY, vocab=1026, text_tokens=1001))


# ---------------------------------------------------------------- CLI and exact mode

def test_cli_writes_and_reports(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert sg.main(["--shape", "tiny", "--layers", "2", "--hidden", "256", "--vocab", "1026",
                    "--untied", "-o", str(out), "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert f"{out.stat().st_size:,d} bytes" in text and "Q6_K 3" in text and "elapsed" in text
    names = [t.name for t in gguf.GGUFReader(out).tensors]
    assert names[0] == "output.weight"
    assert not list(tmp_path.glob("*.partial"))


def test_exact_mode_plumbing_with_stub_quantizer(tmp_path, monkeypatch):
    """The exact path draws Gaussian rows and passes (rows, cols) float32 to quantize()."""
    import types
    seen = []

    def quantize(w, qtype):
        assert w.dtype == np.float32 and w.ndim == 2
        seen.append((qtype, w.shape, float(w.std())))
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block_elems * block_bytes), np.uint8)

    for name in ("genie_rt", "genie_rt.quant"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "genie_rt.quant.formats",
                        types.SimpleNamespace(quantize=quantize))
    path = sg.write_synthetic_qwen3(tmp_path / "exact.gguf", TINY, exact=True)
    assert path.stat().st_size == sg.plan(TINY).file_size
    assert {q for q, _, _ in seen} == {QT.Q4_K, QT.Q6_K}
    assert all(0.019 < s < 0.021 for _, shape, s in seen if shape[0] * shape[1] > 30000)


def test_exact_mode_real_quantizer(tmp_path):
    pytest.importorskip("genie_rt.quant.formats")
    path = sg.write_synthetic_qwen3(tmp_path / "exact.gguf", TINY, exact=True)
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type != QT.F32:
            w = dequantize(np.asarray(t.data), t.tensor_type)
            assert np.isfinite(w).all() and 0.018 < w.std() < 0.022, (t.name, w.std())
