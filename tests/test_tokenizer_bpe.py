"""Byte-level BPE pre-tokenizers beyond Qwen2: Llama 3 (`llama-bpe`: \\p{N}{1,3}, ignore_merges,
BOS by default), SmolLM/StarCoder (`smollm`: every digit alone, then GPT-2) and GPT-2, each
checked against a Python port of llama.cpp's own hand-written matcher (src/unicode.cpp) on
random strings, and the table's names against llama.cpp's.

Exact ids against llama.cpp for real SmolLM2 / Llama 3 vocabularies: tests/test_tokenizer_llamacpp.py.
"""
import random
import unicodedata

import gguf
import pytest

from genie_rt.engine.tokenizer import Tokenizer
from genie_rt.engine.tokenizer_bpe import PRE_TOKENIZERS


@pytest.fixture(scope="module")
def meta(fixture_gguf):
    return {k: f.contents() for k, f in gguf.GGUFReader(fixture_gguf).fields.items()}


def with_pre(meta, pre, **changes):
    out = {**meta, "tokenizer.ggml.pre": pre}
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            out.pop(key, None)
        else:
            out[key] = v
    return out


_WHITESPACE = set(map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                            0x2028, 0x2029, 0x202F, 0x205F, 0x3000]))  # Unicode White_Space


class _Text:
    """Character classes as llama.cpp's matchers see them (out of range: no class)."""

    def __init__(self, text):
        self.t, self.n = text, len(text)

    def cat(self, p):
        return unicodedata.category(self.t[p])[0] if 0 <= p < self.n else ""

    def ws(self, p):
        return 0 <= p < self.n and self.t[p] in _WHITESPACE

    def other(self, p):  # in range and not whitespace / letter / number
        return 0 <= p < self.n and not (self.ws(p) or self.cat(p) in "LN")


def llamacpp_llama3_split(text: str, max_digits: int = 3) -> list[str]:
    """Port of unicode_regex_split_custom_llama3 (max_digits=1: ..._qwen2, the same matcher
    with \\p{N} instead of \\p{N}{1,3})."""
    x, out, prev = _Text(text), [], 0
    n = x.n

    def add(end):
        nonlocal prev
        if end > prev:
            out.append(text[prev:end])
        length, prev = end - prev, end
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
        if not (c in "\r\n" or x.cat(pos) == "N") and (x.cat(pos) == "L" or x.cat(pos + 1) == "L"):
            pos += 1  # [^\r\n\p{L}\p{N}]?\p{L}+
            while x.cat(pos) == "L":
                pos += 1
            add(pos)
            continue
        if x.cat(pos) == "N":  # \p{N}{1,max_digits}
            start = pos
            while x.cat(pos) == "N":
                pos += 1
                if pos - start >= max_digits:
                    add(pos)
                    start = pos
            add(pos)
            continue
        p2 = pos + 1 if c == " " else pos  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        if not (x.ws(p2) or x.cat(p2) in ("L", "N")):
            pos += c == " "
            while x.other(pos):
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        num_ws, last_rn = 0, 0
        while x.ws(pos + num_ws):
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


def llamacpp_gpt2_split(text: str) -> list[str]:
    """Port of unicode_regex_split_custom_gpt2."""
    x, out, prev = _Text(text), [], 0
    n = x.n

    def add(end):
        nonlocal prev
        if end > prev:
            out.append(text[prev:end])
        length, prev = end - prev, end
        return length

    pos = 0
    while pos < n:
        c = text[pos]
        if c == "'" and pos + 1 < n:  # 's|'t|'re|'ve|'m|'ll|'d (case-sensitive)
            c1 = text[pos + 1]
            if c1 in "stmd":
                pos += add(pos + 2)
                continue
            if pos + 2 < n and c1 + text[pos + 2] in ("re", "ve", "ll"):
                pos += add(pos + 3)
                continue
        p2 = pos + 1 if c == " " else pos
        kind = "L" if x.cat(p2) == "L" else "N" if x.cat(p2) == "N" else None
        if kind:  # ' ?\p{L}+' / ' ?\p{N}+'
            pos = p2
            while x.cat(pos) == kind:
                pos += 1
            add(pos)
            continue
        if x.other(p2):  # ' ?[^\s\p{L}\p{N}]+'
            pos = p2
            while x.other(pos):
                pos += 1
            add(pos)
            continue
        num_ws = 0
        while x.ws(pos + num_ws):
            num_ws += 1
        if num_ws > 1 and pos + num_ws < n:  # \s+(?!\S)
            pos += num_ws - 1
        elif num_ws > 0:  # \s+
            pos += num_ws
        else:
            pos += 1
        add(pos)
    return out


def llamacpp_starcoder_split(text: str) -> list[str]:
    """\\p{N} (std::regex in llama.cpp: every number character alone), then GPT-2 on the rest."""
    words, run = [], ""
    for ch in text:
        if unicodedata.category(ch)[0] == "N":
            words += llamacpp_gpt2_split(run) + [ch]
            run = ""
        else:
            run += ch
    return words + llamacpp_gpt2_split(run)


_ALPHABET = (list("aZé'sStTmMdDrReEvVlL0123456789 .,!?-_()[]{}<>/\\\"#@") + [" "] * 6
             + ["\t", "\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u2009", "\u3000",
                "日", "本", "ſ", "ß", "\u0301", "²", "٣", "Ⅻ", "😀", "👍", "\u200d", "€", "°"])


def _fuzz(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("pre, port", [
    ("llama-bpe", llamacpp_llama3_split),
    ("qwen2", lambda t: llamacpp_llama3_split(t, max_digits=1)),
    ("gpt-2", llamacpp_gpt2_split),
    ("smollm", llamacpp_starcoder_split),
    ("starcoder", llamacpp_starcoder_split),
])
def test_pre_tokenizer_matches_llamacpp_matcher_on_fuzz(meta, pre, port):
    tok = Tokenizer.from_gguf_metadata(with_pre(meta, pre))
    for text in _fuzz(400, hash(pre) % 1000):
        assert tok.pre_tokenize(text) == port(text), repr(text)


def test_llama3_digits_in_threes_and_contractions(meta):
    tok = Tokenizer.from_gguf_metadata(with_pre(meta, "llama-bpe"))
    assert tok.pre_tokenize("1234567 x") == ["123", "456", "7", " x"]
    assert tok.pre_tokenize("I'M here") == ["I", "'M", " here"]
    smol = Tokenizer.from_gguf_metadata(with_pre(meta, "smollm"))
    assert smol.pre_tokenize("1234 it's") == ["1", "2", "3", "4", " it", "'s"]
    assert smol.pre_tokenize("a  \n b") == ["a", "  \n", " b"]   # GPT-2: \s+(?!\S), then " b"


def test_llama3_ignore_merges_takes_whole_words_from_the_vocabulary(meta):
    # "xyz" is a token no merge can build: Llama 3 (ignore_merges) emits it whole, Qwen2 merges.
    tokens = list(meta["tokenizer.ggml.tokens"]) + ["xyz"]
    types = list(meta["tokenizer.ggml.token_type"]) + [1]
    llama3 = Tokenizer.from_gguf_metadata(with_pre(meta, "llama-bpe", tokenizer__ggml__tokens=tokens,
                                                   tokenizer__ggml__token_type=types))
    qwen = Tokenizer.from_gguf_metadata(with_pre(meta, "qwen2", tokenizer__ggml__tokens=tokens,
                                                 tokenizer__ggml__token_type=types))
    assert llama3.encode("xyz") == [len(tokens) - 1]
    assert len(qwen.encode("xyz")) > 1 and len(tokens) - 1 not in qwen.encode("xyz")


def test_llama3_adds_bos_unless_the_gguf_says_no(meta):
    on = Tokenizer.from_gguf_metadata(with_pre(meta, "llama-bpe", tokenizer__ggml__add_bos_token=None))
    assert on.add_bos and on.encode("hi", add_special=True)[0] == on.bos_id
    off = Tokenizer.from_gguf_metadata(with_pre(meta, "llama-bpe", tokenizer__ggml__add_bos_token=False))
    assert not off.add_bos
    assert not Tokenizer.from_gguf_metadata(with_pre(meta, "smollm", tokenizer__ggml__add_bos_token=None)).add_bos


def test_table_names_are_llamacpp_names():
    # every name of llama.cpp's table that maps to these regexes; "gpt2" is our old alias
    llama3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
              "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5"}
    starcoder = {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"}
    gpt2 = {"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "a.x-4.0", "mellum", "exaone4",
            "mpt", "olmo", "jais", "trillion", "granite-docling"}
    qwen2 = {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"}
    assert set(PRE_TOKENIZERS) == llama3 | starcoder | gpt2 | qwen2 | {"default"}
    assert {name for name in llama3 if PRE_TOKENIZERS[name].ignore_merges} == llama3 - {"dbrx", "smaug-bpe", "chatglm-bpe"}
    assert len({PRE_TOKENIZERS[n].regexes for n in llama3}) == 1
    assert len({PRE_TOKENIZERS[n].regexes for n in starcoder}) == 1
    assert len({PRE_TOKENIZERS[n].regexes for n in gpt2}) == 1
    assert len({PRE_TOKENIZERS[n].regexes for n in qwen2}) == 1


def test_detokenize_clean_spaces_only_where_llamacpp_cleans(meta):
    ids = Tokenizer.from_gguf_metadata(meta).encode("Hi , you 're ok . ' x ' ?")
    qwen = Tokenizer.from_gguf_metadata(meta)            # Qwen2: no clean-up
    assert qwen.detokenize(ids) == qwen.decode(ids) == "Hi , you 're ok . ' x ' ?"
    gpt2 = Tokenizer.from_gguf_metadata(with_pre(meta, "gpt-2"))
    assert gpt2.detokenize(ids) == "Hi, you're ok.'x '?"
    assert gpt2.decode(ids) == "Hi , you 're ok . ' x ' ?"   # decode: pieces joined, as /detokenize
