"""GGUF loading: the fixture opens; broken and hostile files give clean GGUFErrors fast."""
import struct
import time

import numpy as np
import pytest

from genie_rt.engine.config import ModelConfig
from genie_rt.engine.gguf_file import GGUFError, open_gguf
from genie_rt.engine.models.weights import check_tensors


def test_fixture_opens(fixture_gguf):
    g = open_gguf(fixture_gguf)
    cfg = ModelConfig.from_gguf(g)
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == \
        ("qwen3", 2, 256, 4, 2, 64, 768)
    assert cfg.vocab_size == 4122 and cfg.tied_embeddings and cfg.eos_id == 4098
    assert cfg.rope_base == 1e6 and abs(cfg.rms_eps - 1e-6) < 1e-12
    assert (cfg.q_dim, cfg.kv_dim, cfg.n_group) == (256, 128, 2)
    assert "<|im_start|>" in cfg.chat_template
    emb = g.tensors["token_embd.weight"]
    assert emb.shape == (4122, 256) and emb.data.shape == (4122, 210) and emb.data.dtype == np.uint8
    assert len(check_tensors(g, cfg)) == 3 + 11 * 2 - 1


def _write(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _expect_error(path, *fragments):
    t0 = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        g = open_gguf(path)
        check_tensors(g, ModelConfig.from_gguf(g))
    assert time.perf_counter() - t0 < 5, "a hostile file must fail fast, not hang"
    msg = str(info.value)
    assert str(path) in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_not_gguf(tmp_path):
    _expect_error(_write(tmp_path, b"PK\x03\x04" + b"\0" * 100), "not a GGUF file")


def test_empty_and_tiny(tmp_path):
    _expect_error(_write(tmp_path, b""), "too small")
    _expect_error(_write(tmp_path, b"GGUF\x03\0\0\0"), "too small")


def test_missing_file_and_directory(tmp_path):
    _expect_error(tmp_path / "nope.gguf", "no such file")
    _expect_error(tmp_path, "directory")


def test_bad_version(tmp_path):
    _expect_error(_write(tmp_path, b"GGUF" + struct.pack("<IQQ", 99, 0, 0)), "version 99")


def test_huge_counts_rejected_without_hanging(tmp_path):
    _expect_error(_write(tmp_path, b"GGUF" + struct.pack("<IQQ", 3, 1 << 62, 1 << 62) + b"\0" * 64),
                  "more than the file can hold")


def test_huge_string_length(tmp_path):
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 60) + b"abc" * 20
    _expect_error(_write(tmp_path, data), "runs past the end")


def test_huge_array(tmp_path):
    key = b"tokenizer.ggml.tokens"
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, 1 << 40) + b"\0" * 64)
    _expect_error(_write(tmp_path, data), "more than the file can hold")


def test_truncated_at_every_region(fixture_gguf, tmp_path):
    raw = fixture_gguf.read_bytes()
    g = open_gguf(fixture_gguf)
    # header, metadata, tensor table, and several points inside the data section
    cuts = [10, 30, 200, 5000, 60000, g.data_offset - 7, g.data_offset + 1000, len(raw) - 1]
    for cut in cuts:
        _expect_error(_write(tmp_path, raw[:cut], f"cut{cut}.gguf"))


def test_truncated_data_names_tensor(fixture_gguf, tmp_path):
    raw = fixture_gguf.read_bytes()
    msg = _expect_error(_write(tmp_path, raw[:-100]), "truncated")
    assert "tensor '" in msg


def test_random_bytes_after_magic(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(30):
        body = rng.integers(0, 256, 2000, dtype=np.uint8).tobytes()
        p = _write(tmp_path, b"GGUF" + struct.pack("<I", 3) + body, f"rand{i}.gguf")
        with pytest.raises(GGUFError):
            open_gguf(p)


def test_flipped_header_bytes_never_crash(fixture_gguf, tmp_path):
    """Corrupt single bytes of the header: either a clean GGUFError or a valid open."""
    raw = bytearray(fixture_gguf.read_bytes())
    g = open_gguf(fixture_gguf)
    rng = np.random.default_rng(1)
    for i, pos in enumerate(rng.integers(4, g.data_offset, 60)):
        bad = bytearray(raw)
        bad[pos] ^= 0xFF
        p = _write(tmp_path, bytes(bad), f"flip{i}.gguf")
        try:
            g2 = open_gguf(p)
            check_tensors(g2, ModelConfig.from_gguf(g2))
        except GGUFError:
            pass


def _rewrite_metadata(fixture_gguf, tmp_path, key, value_bytes_fn):
    """Copy the fixture with one metadata value replaced (same type, new bytes)."""
    import gguf
    r = gguf.GGUFReader(fixture_gguf)
    f = r.fields[key]
    raw = bytearray(fixture_gguf.read_bytes())
    part = f.parts[f.data[0]]
    off = part.ctypes.data - r.data.ctypes.data
    raw[off:off + part.nbytes] = value_bytes_fn(part)
    return _write(tmp_path, bytes(raw), "edited.gguf")


def test_unsupported_architecture(fixture_gguf, tmp_path):
    p = _rewrite_metadata(fixture_gguf, tmp_path, "general.architecture", lambda part: b"mamba")
    _expect_error(p, "architecture 'mamba' is not supported")


def test_inconsistent_shapes(fixture_gguf, tmp_path):
    p = _rewrite_metadata(fixture_gguf, tmp_path, "qwen3.feed_forward_length",
                          lambda part: struct.pack("<I", 512))
    _expect_error(p, "has shape", "expected")


def test_missing_tensor(fixture_gguf, tmp_path):
    raw = bytearray(fixture_gguf.read_bytes())
    i = raw.index(b"blk.1.ffn_up.weight")
    raw[i:i + 5] = b"blk.9"
    _expect_error(_write(tmp_path, bytes(raw)), "blk.1.ffn_up.weight", "missing")


def test_unsupported_tensor_type(fixture_gguf, tmp_path):
    import gguf
    raw = bytearray(fixture_gguf.read_bytes())
    name = b"blk.0.attn_q_norm.weight"
    i = raw.index(name) + len(name)          # then n_dims, ne[1], type, offset
    (n_dims,) = struct.unpack_from("<I", raw, i)
    type_at = i + 4 + 8 * n_dims
    raw[type_at:type_at + 4] = struct.pack("<I", int(gguf.GGMLQuantizationType.IQ2_XXS))
    msg = _expect_error(_write(tmp_path, bytes(raw)))
    assert "attn_q_norm" in msg


def test_tensor_reading_its_neighbours_bytes_is_refused(fixture_gguf, tmp_path):
    """A type changed to a bigger one (Q4_K -> Q8_0) or an offset moved onto another
    tensor: the extents overlap, which llama.cpp refuses too; never run on garbage."""
    import gguf
    raw = bytearray(fixture_gguf.read_bytes())
    name = b"blk.0.attn_q.weight"
    i = raw.index(name) + len(name)
    (n_dims,) = struct.unpack_from("<I", raw, i)
    type_at = i + 4 + 8 * n_dims
    bigger = bytearray(raw)
    bigger[type_at:type_at + 4] = struct.pack("<I", int(gguf.GGMLQuantizationType.Q8_0))
    _expect_error(_write(tmp_path, bytes(bigger), "type.gguf"), "blk.0.attn_q.weight", "overlaps")
    moved = bytearray(raw)
    moved[type_at + 4:type_at + 12] = struct.pack("<Q", 0)
    _expect_error(_write(tmp_path, bytes(moved), "offset.gguf"), "overlaps")


def test_corrupt_key_length_gives_a_short_printable_message(fixture_gguf, tmp_path):
    """A key length grown by a flipped byte swallows kilobytes of binary into the 'name':
    the message stays short and escaped (no raw control bytes on the user's terminal)."""
    raw = bytearray(fixture_gguf.read_bytes())
    key = b"tokenizer.ggml.pre"
    at = raw.index(key) - 8                   # the uint64 length before the key's bytes
    raw[at + 1] = 0x50                        # len += 0x5000 bytes
    msg = _expect_error(_write(tmp_path, bytes(raw)))
    assert len(msg) < 600, msg[:200]
    assert all(c.isprintable() for c in msg), repr(msg[:200])


def test_block_count_smaller_than_the_tensors(fixture_gguf, tmp_path):
    p = _rewrite_metadata(fixture_gguf, tmp_path, "qwen3.block_count", lambda part: struct.pack("<I", 1))
    _expect_error(p, "block_count says 1 layers", "blk.1.")


def test_infinite_rope_base(fixture_gguf, tmp_path):
    p = _rewrite_metadata(fixture_gguf, tmp_path, "qwen3.rope.freq_base", lambda part: struct.pack("<f", float("inf")))
    _expect_error(p, "rope.freq_base", "out of range")


# ------------------------------------------------------------------------------------
# Our header reader against the gguf package's, and metadata of the wrong kind
# ------------------------------------------------------------------------------------
def test_metadata_and_tensors_match_the_gguf_reader(fixture_gguf):
    import gguf
    g, r = open_gguf(fixture_gguf), gguf.GGUFReader(fixture_gguf)
    ref = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert g.metadata.keys() == ref.keys()
    for k, v in ref.items():
        v = v.item() if isinstance(v, np.generic) else v
        assert g.metadata[k] == v and type(g.metadata[k]) is type(v), k
    assert [t.name for t in r.tensors] == list(g.tensors)
    for t in r.tensors:
        mine = g.tensors[t.name]
        assert mine.offset == t.data_offset and mine.qtype == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        np.testing.assert_array_equal(mine.data.reshape(-1), t.data.view(np.uint8).reshape(-1))


def _with_metadata(src, dst, changes, extra=()):
    """Copy GGUF `src` to `dst` with metadata entries replaced or added
    ({key: raw value bytes (type + value)}) or dropped ({key: None}); tensors unchanged."""
    import gguf
    r = gguf.GGUFReader(src)
    raw = src.read_bytes()
    fields = [f for k, f in r.fields.items() if not k.startswith("GGUF.")]
    kvs = {}
    for f in fields:
        end = f.offset + sum(int(p.nbytes) for p in f.parts)
        kvs[f.name] = raw[f.offset:end]
    info_start = max(f.offset + sum(int(p.nbytes) for p in f.parts) for f in fields)
    info_stop = max(t.field.offset + sum(int(p.nbytes) for p in t.field.parts) for t in r.tensors)
    info_end = open_gguf(src).data_offset
    tensor_info = raw[info_start:info_stop]
    for key, value in changes.items():
        if value is None:
            kvs.pop(key, None)
        else:
            kb = key.encode()
            kvs[key] = struct.pack("<Q", len(kb)) + kb + value
    entries = list(kvs.values()) + list(extra)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(r.tensors), len(entries)) + b"".join(entries) + tensor_info
    pad = -len(head) % 32
    dst.write_bytes(head + b"\0" * pad + raw[info_end:])
    return dst


def _u32(v):
    return struct.pack("<II", 4, v)


def _f32(v):
    return struct.pack("<If", 6, v)


def _string(s):
    b = s.encode()
    return struct.pack("<IQ", 8, len(b)) + b


def _str_array(items):
    return struct.pack("<IIQ", 9, 8, len(items)) + b"".join(struct.pack("<Q", len(s.encode())) + s.encode() for s in items)


def test_the_copy_helper_round_trips(fixture_gguf, tmp_path):
    g = open_gguf(_with_metadata(fixture_gguf, tmp_path / "same.gguf", {}))
    ref = open_gguf(fixture_gguf)
    assert g.metadata == ref.metadata and list(g.tensors) == list(ref.tensors)
    check_tensors(g, ModelConfig.from_gguf(g))


@pytest.mark.parametrize("key,value,fragments", [
    ("qwen3.attention.head_count", _f32(4.7), ["'qwen3.attention.head_count' = 4.69", "not an integer"]),
    ("qwen3.attention.head_count", _string("4"), ["'qwen3.attention.head_count' = '4'", "not an integer"]),
    ("qwen3.rope.freq_base", _string("1e6"), ["'qwen3.rope.freq_base'", "not a number"]),
    ("qwen3.block_count", struct.pack("<I?", 7, True), ["'qwen3.block_count' = True", "not an integer"]),
    ("tokenizer.ggml.tokens", _u32(5), ["'tokenizer.ggml.tokens' must be an array of strings"]),
    ("tokenizer.ggml.eos_token_id", struct.pack("<I?", 7, True), ["'tokenizer.ggml.eos_token_id' = True",
                                                                   "not a token id"]),
    ("qwen3.block_count", _u32(1 << 24), ["block_count says 16777216 layers", "tensors for 2 layers"]),
])
def test_metadata_of_the_wrong_kind_is_named(fixture_gguf, tmp_path, key, value, fragments):
    p = _with_metadata(fixture_gguf, tmp_path / "typed.gguf", {key: value})
    _expect_error(p, *fragments)


@pytest.mark.parametrize("key,value,fragment", [
    ("tokenizer.ggml.token_type", _u32(1), "tokenizer.ggml.token_type must be an array of integers"),
    ("tokenizer.ggml.token_type", None, None),                         # absent: defaults, loads
    ("tokenizer.ggml.pre", _str_array(["qwen2"]), "tokenizer.ggml.pre must be a string"),
    ("tokenizer.ggml.model", _str_array(["gpt2"]), "tokenizer.ggml.model must be a string"),
    ("tokenizer.ggml.bos_token_id", struct.pack("<I?", 7, True), "'tokenizer.ggml.bos_token_id' = True is not a token id"),
])
def test_tokenizer_metadata_of_the_wrong_kind_is_named(fixture_gguf, tmp_path, key, value, fragment):
    from genie_rt.engine.engine import Engine
    p = _with_metadata(fixture_gguf, tmp_path / "tok.gguf", {key: value})
    if fragment is None:
        assert Engine.load(p, _cpu_config()).tokenizer.encode("lights") != []
        return
    with pytest.raises(GGUFError) as info:
        Engine.load(p, _cpu_config())
    assert fragment in str(info.value) and str(p) in str(info.value)


def _cpu_config():
    from genie_rt.engine.config import EngineConfig
    return EngineConfig(backend="cpu", n_ctx=64)


def test_odd_layer_names_and_long_names_are_reported_cleanly(fixture_gguf, tmp_path):
    """A tensor 'blk.<superscript two>.x' is not a layer tensor (only ASCII digits are), and
    names in errors are quoted and shortened."""
    g = open_gguf(fixture_gguf)
    cfg = ModelConfig.from_gguf(g)
    from genie_rt.engine.gguf_file import TensorInfo
    odd = dict(g.tensors)
    t = g.tensors["blk.0.attn_norm.weight"]
    odd["blk.\u00b2.extra"] = TensorInfo("blk.\u00b2.extra", t.qtype, t.shape, t.data, t.offset)
    long_name = "blk.7." + "x" * 100_000
    odd[long_name] = TensorInfo(long_name, t.qtype, t.shape, t.data, t.offset)
    g.tensors = odd
    with pytest.raises(GGUFError) as info:
        check_tensors(g, cfg)
    msg = str(info.value)
    assert "layer 7" in msg and len(msg) < 600, msg[:300]


def test_duplicate_names_are_refused_and_quoted(fixture_gguf, tmp_path):
    raw = fixture_gguf.read_bytes()
    # rename the second tensor's name to the first one's: find two names of equal length
    g = open_gguf(fixture_gguf)
    names = list(g.tensors)
    a, b = next((x, y) for x in names for y in names if x != y and len(x) == len(y))
    bad = raw[:g.data_offset].replace(b.encode(), a.encode()) + raw[g.data_offset:]
    _expect_error(_write(tmp_path, bad, "dup.gguf"), f"tensor {a!r} appears twice")
    # a metadata key twice
    kb = b"qwen3.block_count"
    twice = _with_metadata(fixture_gguf, tmp_path / "dupkey.gguf", {},
                           extra=[struct.pack("<Q", len(kb)) + kb + _u32(2)])
    _expect_error(twice, "metadata key 'qwen3.block_count' appears twice")
