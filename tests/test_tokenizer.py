"""Tokenizer tests: exact ids against llama.cpp, the pre-tokenizer against a port of llama.cpp's
own splitter, special tokens, decoding and streaming, and the errors for what is unsupported.

The fixture vocabulary is the real Qwen2 vocabulary cut to its first 4,096 tokens (plus the 26
Qwen3 specials at 4096..4121), so ids of ordinary tokens are the real Qwen ids: byte-level
alphabet at 0..255 ('!' = 0, ..., 'Ġ' (space) = 220, 'Ċ' (newline) = 198), 'user' = 872.
"""
import random
import unicodedata

import gguf
import numpy as np
import pytest

from genie_rt.engine.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, StreamDecoder, Tokenizer


def gguf_metadata(path) -> dict:
    """The mapping the engine hands to Tokenizer/ChatTemplate: GGUF key -> Python value."""
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


@pytest.fixture(scope="module")
def meta(fixture_gguf):
    return gguf_metadata(fixture_gguf)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_gguf_metadata(meta)


def with_keys(meta, **changes):
    """Copy of `meta` with keys (dots written as __) replaced; None deletes the key."""
    out = dict(meta)
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            out.pop(key, None)
        else:
            out[key] = v
    return out


def byte_id(b: int) -> int:
    """Id of the single-byte token for byte b in a Qwen2/GPT-2 vocabulary: ids 0..255 hold
    GPT-2's bytes_to_unicode alphabet in its order (printable bytes first, then the rest)."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    order = printable + [x for x in range(256) if x not in printable]
    return order.index(b)


# --- exact ids ---------------------------------------------------------------------------------
def test_fixture_prompts_give_llamacpp_ids(tok, llamacpp_logits):
    for i in range(3):
        prompt = str(llamacpp_logits[f"prompt_{i}"])
        expected = llamacpp_logits[f"tokens_{i}"].tolist()
        assert tok.encode(prompt) == expected, f"prompt_{i}: {prompt!r}"
        assert tok.decode(expected) == prompt


def test_byte_alphabet_ids(tok):
    assert [tok.encode(c) for c in "!0 \n"] == [[0], [15], [220], [198]]
    assert byte_id(ord(" ")) == 220 and byte_id(ord("\n")) == 198


def test_digits_are_split_one_by_one(tok):
    # Qwen2 pre-tokenizer: \p{N} matches a single digit, so no digit merges can apply.
    assert tok.encode("12345") == [byte_id(ord(c)) for c in "12345"] == [16, 17, 18, 19, 20]
    assert tok.pre_tokenize("in 2024, x") == ["in", " ", "2", "0", "2", "4", ",", " x"]


def test_multibyte_characters_without_merges_become_byte_tokens(tok, meta):
    merges = set(meta["tokenizer.ggml.merges"])
    for text in ("😀", "日", "€"):
        raw = text.encode("utf-8")
        chars = [tok.token_text(byte_id(b)) for b in raw]
        # precondition: the cut vocabulary has no merge joining these bytes
        assert not any(f"{a} {b}" in merges for a, b in zip(chars, chars[1:]))
        assert tok.encode(text) == [byte_id(b) for b in raw]


def test_chat_markup_with_parse_special(tok):
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tok.encode(text, parse_special=True)
    assert ids[:3] == [4097, 872, 198]  # <|im_start|> user \n
    assert ids.count(4097) == 2 and ids.count(4098) == 1
    assert 4120 in ids and 4121 in ids
    assert tok.decode(ids) == text


def test_control_tokens_are_plain_text_without_parse_special(tok):
    ids = tok.encode("<|im_start|>user")
    assert 4097 not in ids
    assert tok.decode(ids) == "<|im_start|>user"
    assert ids[-1] == 872


def test_user_defined_tokens_always_match(tok):
    # llama.cpp (tokenizer_st_partition) and HF both split USER_DEFINED tokens out of raw text.
    assert tok.encode("<tool_call></tool_call><think>") == [4110, 4111, 4120]
    assert tok.encode("<think>", parse_special=True) == [4120]


def test_longest_special_token_wins_like_llamacpp(meta):
    # llama.cpp partitions by each special token in turn, longest text first: with user-defined
    # "ab" and "bcd", "abcd" gives "a" + <bcd> (a leftmost regex alternation would give <ab> c d).
    tokens = list(meta["tokenizer.ggml.tokens"]) + ["ab", "bcd"]
    types = list(meta["tokenizer.ggml.token_type"]) + [TOKEN_USER_DEFINED, TOKEN_USER_DEFINED]
    t = Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__tokens=tokens,
                                               tokenizer__ggml__token_type=types))
    ab, bcd = len(tokens) - 2, len(tokens) - 1
    assert t.encode("abcd") == [t.encode("a")[0], bcd]
    assert t.encode("xab") == t.encode("x") + [ab]


def test_bos_eos_added_only_when_the_gguf_asks(meta, tok):
    assert tok.encode("Hi", add_special=True) == tok.encode("Hi")  # Qwen: add_bos_token false
    t = Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__add_bos_token=True,
                                               tokenizer__ggml__add_eos_token=True))
    assert t.encode("Hi", add_special=True) == [4096] + tok.encode("Hi") + [4098]
    assert t.encode("Hi") == tok.encode("Hi")


def test_properties(tok):
    assert tok.vocab_size == 4122
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (4096, 4098, False)
    assert tok.special_ids == frozenset(range(4096, 4122))
    assert tok.token_id("<tool_call>") == 4110
    assert tok.token_id("<think>") == 4120 and tok.token_id("</think>") == 4121
    assert tok.token_id("no such token") is None
    assert tok.pre_tokenizer == "qwen2"


def test_eot_ids_follow_llamacpp_rules(tok):
    # EOS, the EOG texts <|endoftext|> and <|im_end|>, and the FIM pad/repo/sep tokens.
    names = {tok.token_text(i) for i in tok.eot_ids}
    assert names == {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    assert tok.eos_id in tok.eot_ids
    assert tok.token_id("<|im_start|>") not in tok.eot_ids


def test_eog_looking_token_is_forced_to_control(meta):
    # llama.cpp overrides the type of an EOG-looking token that the GGUF calls USER_DEFINED.
    types = list(meta["tokenizer.ggml.token_type"])
    types[4098] = TOKEN_USER_DEFINED
    t = Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__token_type=types))
    assert t.is_control(4098) and 4098 not in t.encode("<|im_end|>")


# --- the pre-tokenizer against llama.cpp's own matcher -----------------------------------------
_WHITESPACE = set(map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                            0x2028, 0x2029, 0x202F, 0x205F, 0x3000]))  # Unicode White_Space


def llamacpp_qwen2_split(text: str) -> list[str]:
    """Python port of llama.cpp's unicode_regex_split_custom_qwen2 (src/unicode.cpp)."""
    n, out, prev = len(text), [], 0

    def cat(p):
        return unicodedata.category(text[p])[0] if 0 <= p < n else ""

    def is_ws(p):
        return 0 <= p < n and text[p] in _WHITESPACE

    def other(p):  # in range and not whitespace/letter/number
        return 0 <= p < n and not (is_ws(p) or cat(p) in "LN")

    def add(end):
        nonlocal prev
        length = end - prev
        if length > 0:
            out.append(text[prev:end])
        prev = end
        return length

    pos = 0
    while pos < n:
        c = text[pos]
        if c == "'" and pos + 1 < n:  # (?i:'s|'t|'re|'ve|'m|'ll|'d)
            c1 = text[pos + 1].lower()
            if c1 in ("s", "t", "m", "d"):
                pos += add(pos + 2)
                continue
            if pos + 2 < n and (c1, text[pos + 2].lower()) in {("r", "e"), ("v", "e"), ("l", "l")}:
                pos += add(pos + 3)
                continue
        if not (c in "\r\n" or cat(pos) == "N") and (cat(pos) == "L" or cat(pos + 1) == "L"):
            pos += 1  # [^\r\n\p{L}\p{N}]?\p{L}+
            while cat(pos) == "L":
                pos += 1
            add(pos)
            continue
        if cat(pos) == "N":  # \p{N}
            pos += 1
            add(pos)
            continue
        p2 = pos + 1 if c == " " else pos  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        if not (is_ws(p2) or cat(p2) in ("L", "N")):
            pos += c == " "
            while other(pos):
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        num_ws, last_rn = 0, 0
        while is_ws(pos + num_ws):
            if text[pos + num_ws] in "\r\n":
                last_rn = pos + num_ws + 1
            num_ws += 1
        if last_rn > 0:  # \s*[\r\n]+
            pos = last_rn
        elif num_ws > 1 and pos + num_ws < n:  # \s+(?!\S)
            pos += num_ws - 1
        elif num_ws > 0:  # \s+
            pos += num_ws
        else:
            pos += 1
        add(pos)
    return out


_FUZZ_ALPHABET = (list("aZé'sStTmMdDrReEvVlL09 .,!?-_()[]{}<>/\\\"#@") + [" "] * 6
                  + ["\t", "\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u2009", "\u3000",
                     "日", "本", "ſ", "ß", "\u0301", "²", "٣", "Ⅻ", "😀", "👍", "\u200d", "€", "°"])


def test_pre_tokenizer_matches_llamacpp_splitter_on_fuzz(tok):
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(_FUZZ_ALPHABET) for _ in range(rng.randint(1, 40)))
        assert tok.pre_tokenize(text) == llamacpp_qwen2_split(text), repr(text)


@pytest.mark.parametrize("text, words", [
    ("Hello  world\n\n  12", ["Hello", " ", " world", "\n\n", " ", " ", "1", "2"]),
    ("don't DON'T it'll", ["don", "'t", " DON", "'T", " it", "'ll"]),
    ("a\r\n\tb", ["a", "\r\n", "\tb"]),
    ("x = (y+1);\n", ["x", " =", " (", "y", "+", "1", ");\n"]),
    ("end   ", ["end", "   "]),
])
def test_pre_tokenizer_examples(tok, text, words):
    assert tok.pre_tokenize(text) == words == llamacpp_qwen2_split(text)


def test_gpt2_and_default_pre_tokenizers(meta):
    gpt2 = Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__pre="gpt-2"))
    assert gpt2.pre_tokenize("Hello world 12345!!") == ["Hello", " world", " 12345", "!!"]
    # llama.cpp's 'default': punctuation runs, then GPT-2, then \p{N}+, then [0-9]{3}
    default = Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__pre="default"))
    assert default.pre_tokenize("a+b=3,000") == ["a", "+", "b", "=", "3", ",", "000"]
    assert default.pre_tokenize("12345") == ["123", "45"]
    missing = Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__pre=None))
    assert missing.pre_tokenizer == "default"  # llama.cpp's choice for old files
    for t in (gpt2, default):
        text = "Hello, world! 12345 ünïcödé\n\t x"
        assert t.decode(t.encode(text)) == text


# --- round trips on hard inputs ----------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "", " ", "   ", "\t\t", "\n", "\r\n", "\n\n\n", " \n \n ", "a  b   c    d", "trailing   ",
    "12345", "3.14159e-10", "日本語のテキスト、中文。", "😀👍🏽👨‍👩‍👧", "café naïve Ærø",
    "e\u0301", "\x00\x01\x7f", "tab\there", "<|im_start|>", "<think>x</think>", "'s 'S 'll",
])
def test_decode_encode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, parse_special=True)) == text


def test_lone_surrogates_become_replacement_characters(tok):
    ids = tok.encode("a\ud83d\ude00b\udc00c")  # a valid pair is joined, a lone one replaced
    assert tok.decode(ids) == "a😀b\ufffdc"


def test_large_prompt(tok):
    text = ("The kitchen light is 30% on; set it to 75 at 21:00 please.\n\t" * 1700)[:100_000]
    ids = tok.encode(text)
    assert len(ids) > 20_000 and tok.decode(ids) == text


# --- decode, pieces, streaming -----------------------------------------------------------------
def test_token_to_piece(tok):
    assert tok.token_to_piece(220) == b" "
    assert tok.token_to_piece(4098) == b"<|im_end|>"
    assert tok.token_to_piece(byte_id(0xF0)) == b"\xf0"  # part of a UTF-8 character


def test_decode_skip_special(tok):
    ids = tok.encode("<|im_start|>user\n<think>Hi</think><|im_end|>", parse_special=True)
    assert tok.decode(ids, skip_special=True) == "user\n<think>Hi</think>"


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match="4122"):
        tok.decode([1, 4122])
    with pytest.raises(TypeError):
        tok.decode([1.5])
    assert tok.decode(np.array([16, 17], dtype=np.int32)) == "12"


def test_stream_never_splits_a_character(tok):
    ids = tok.encode("a😀b")
    assert len(ids) == 6
    stream = tok.stream_decoder()
    assert [stream.feed(i) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert stream.flush() == ""


def test_stream_flush_replaces_incomplete_bytes(tok):
    stream = StreamDecoder(tok)
    assert stream.feed(byte_id(0xF0)) == "" and stream.feed(byte_id(0x9F)) == ""
    assert stream.flush() == "\ufffd"
    assert stream.feed(byte_id(ord("x"))) == "x"  # reusable after flush
    s2 = tok.stream_decoder()
    assert s2.feed(byte_id(0xF0)) + s2.feed(byte_id(ord("a"))) == "\ufffda"  # invalid at once


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_equals_decode_on_random_ids(tok, skip_special):
    rng = random.Random(7)
    pool = list(range(0, 300)) + list(range(4090, 4122))  # many raw byte tokens + specials
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        stream = tok.stream_decoder(skip_special=skip_special)
        text = "".join(stream.feed(i) for i in ids) + stream.flush()
        assert text == tok.decode(ids, skip_special=skip_special), ids


# --- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model, kind", [("bert", "WordPiece"), ("t5", "Unigram"), ("rwkv", "RWKV"),
                                         ("plamo2", "unknown")])
def test_other_vocabulary_types_are_refused(meta, model, kind):
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.model = '{model}' \({kind}\) is not supported"):
        Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__model=model))


@pytest.mark.parametrize("pre", ["tekken", "gpt-4o", "no-such-pre", "jina-v2-code"])
def test_unknown_pre_tokenizer_is_refused(meta, pre):
    # tekken / gpt-4o need other regexes; jina-v2-code adds SEP tokens: not implemented
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.pre = '{pre}' is not a supported"):
        Tokenizer.from_gguf_metadata(with_keys(meta, tokenizer__ggml__pre=pre))


@pytest.mark.parametrize("changes, match", [
    ({"tokenizer__ggml__model": None}, r"no tokenizer\.ggml\.model"),
    ({"tokenizer__ggml__merges": None}, r"tokenizer\.ggml\.merges"),
    ({"tokenizer__ggml__token_type": [1, 1]}, r"tokenizer\.ggml\.token_type has 2 entries"),
    ({"tokenizer__ggml__merges": ["Ġ Ġ", "nospace"]}, r"merges\[1\] = 'nospace'"),
    ({"tokenizer__ggml__merges": ["Ġ zzz"]}, r"merges\[0\].*missing"),
    ({"tokenizer__ggml__eos_token_id": 99999}, r"eos_token_id = 99999 is outside"),
    ({"tokenizer__ggml__bos_token_id": None, "tokenizer__ggml__add_bos_token": True},
     r"add_bos_token is true but .*bos_token_id"),
])
def test_malformed_metadata_is_refused(meta, changes, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(with_keys(meta, **changes))


def test_control_token_types_come_from_the_gguf(tok, meta):
    types = meta["tokenizer.ggml.token_type"]
    assert types[4097] == TOKEN_CONTROL and tok.is_control(4097)
    assert types[4120] == TOKEN_USER_DEFINED and not tok.is_control(4120)


def test_long_texts_take_the_gil_free_path_with_the_same_ids(tok, monkeypatch):
    import genie_rt.engine.tokenizer_bpe as T
    rng = np.random.default_rng(5)
    words = ["turn", " the", " kitchen", "\n\n", "  ", "lights", "42", "\u00fc", "\u65e5\u672c", "!!", "\t",
             " 3.14", "don't"]
    long_run = "".join(rng.choice(words, 8000))
    assert len(long_run) >= T.GIL_FREE_CHARS                # one fragment past the threshold
    text = "<|im_start|>user\n" + long_run + "<think>" + long_run[:500]
    fast = tok.encode(text, parse_special=True)
    monkeypatch.setattr(T, "GIL_FREE_CHARS", 1 << 40)         # everything through encode()
    assert tok.encode(text, parse_special=True) == fast and len(fast) > 1000


# --- llama.cpp's special-token rules (engine/tokenizer_special.py) ----------------------------
def with_tokens(meta, *extra):
    """`meta` with (text, type) tokens appended; returns (meta, first new id)."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    first = len(tokens)
    for text, ttype in extra:
        tokens.append(text)
        types.append(ttype)
    return with_keys(meta, tokenizer__ggml__tokens=tokens, tokenizer__ggml__token_type=types), first


def test_newer_eog_texts_are_eog_and_control(meta):
    m, first = with_tokens(meta, ("[EOS]", 1), ("<turn|>", TOKEN_USER_DEFINED), ("</s>", 1))
    t = Tokenizer.from_gguf_metadata(m)
    assert {first, first + 1, first + 2} <= t.eot_ids
    assert all(t.token_type(i) == TOKEN_CONTROL for i in (first, first + 1, first + 2))


def test_harmony_end_is_not_eog_beside_return_and_call(meta):
    # o200k_harmony (gpt-oss): <|end|> separates messages; <|return|> / <|call|> end generation
    m, first = with_tokens(meta, ("<|return|>", TOKEN_CONTROL), ("<|call|>", TOKEN_CONTROL),
                           ("<|end|>", TOKEN_CONTROL), ("<|channel|>", TOKEN_CONTROL))
    t = Tokenizer.from_gguf_metadata(m)
    assert first in t.eot_ids and first + 1 in t.eot_ids and first + 2 not in t.eot_ids
    assert t.token_type(first + 2) == TOKEN_USER_DEFINED
    assert t.token_type(first + 3) == TOKEN_USER_DEFINED        # always rendered, as llama.cpp
    assert t.encode("<|channel|>") == [first + 3]                # so matched without parse_special
    plain, _ = with_tokens(meta, ("<|end|>", TOKEN_CONTROL))
    assert len(meta["tokenizer.ggml.tokens"]) in Tokenizer.from_gguf_metadata(plain).eot_ids


def test_phi3_special_tokens_drop_the_whitespace_after_them(meta):
    m, first = with_tokens(meta, ("<|user|>", TOKEN_CONTROL))
    phi3 = Tokenizer.from_gguf_metadata({**m, "general.name": "Phi3"})
    other = Tokenizer.from_gguf_metadata(m)
    text = "<|user|>\n  Hi"
    assert phi3.encode(text, parse_special=True) == [first] + phi3.encode("Hi")
    assert other.encode(text, parse_special=True) == [first] + other.encode("\n  Hi")
    assert phi3.encode("<|endoftext|>  x", parse_special=True)[1:] == phi3.encode("  x")  # kept


def test_byte_tokens_decode_to_their_byte(meta):
    m, first = with_tokens(meta, ("<0x0A>", 6), ("<0xZZ>", 6))
    t = Tokenizer.from_gguf_metadata(m)
    assert t.token_to_piece(first) == b"\n" and t.token_to_piece(first + 1) == b""


@pytest.mark.parametrize("changes, match", [
    ({"tokenizer__ggml__token_type": ["1"] * 4122}, r"token_type must be an array of integers"),
    ({"tokenizer__ggml__tokens": ["a", 3]}, r"tokens must be a non-empty list of strings"),
    ({"tokenizer__ggml__add_bos_token": "no"}, r"add_bos_token must be a boolean"),
])
def test_more_malformed_metadata_is_refused(meta, changes, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(with_keys(meta, **changes))


def test_max_piece_bytes_is_the_longest_piece(tok, meta):
    assert tok.max_piece_bytes == max(len(tok.token_to_piece(i)) for i in range(tok.vocab_size))
    # a byte-level entry's characters are one byte each ("Ġ" is a space), not their UTF-8 length
    changed = Tokenizer.from_gguf_metadata(with_keys(
        meta, tokenizer__ggml__tokens=list(meta["tokenizer.ggml.tokens"]) + ["Ġ" * 70],
        tokenizer__ggml__token_type=list(meta["tokenizer.ggml.token_type"]) + [TOKEN_NORMAL]))
    assert changed.max_piece_bytes == 70 == len(changed.token_to_piece(changed.vocab_size - 1))
