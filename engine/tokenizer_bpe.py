"""Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`), token-for-token as llama.cpp.

What it does
- Builds a `tokenizers` BPE from the GGUF vocabulary and merges (merge rank = position in
  `tokenizer.ggml.merges`) behind the pre-tokenizer llama.cpp selects by `tokenizer.ggml.pre`:
  the regex Split(s) of `PRE_TOKENIZERS` ("isolated": matches and the gaps between them both
  become words), then the GPT-2 byte-to-unicode mapping (ByteLevel without its own regex and
  without a prefix space). Encodes one raw text fragment; special tokens are cut out before this
  by engine/tokenizer.py.
- `byte_level_to_bytes`: the bytes a NORMAL byte-level token stands for (llama.cpp
  llama_decode_text), for decoding.

What it deliberately does not do
- Pre-tokenizers not in the table (they are refused by engine/tokenizer.py, never approximated),
  special tokens, BOS/EOS, decoding policy: engine/tokenizer.py does those for every model type.
- Unicode normalisation (llama.cpp does none for BPE; HF's Qwen2 tokenizer applies NFC, so ids
  can differ from HF for non-NFC input, e.g. decomposed accents).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import tokenizers
from tokenizers import Regex, models, pre_tokenizers

# --- pre-tokenizers ----------------------------------------------------------------------------
# Each entry is the list of regexes llama.cpp's llm_tokenizer_bpe applies one after the other
# (src/llama-vocab.cpp), every one a Split with "isolated" behaviour. llama.cpp runs the
# GPT-2, Llama 3 and Qwen2 regexes through hand-written matchers (src/unicode.cpp
# unicode_regex_split_custom_*); the strings below are regexes with the same results (tests
# compare them with Python ports of those matchers), the others run through std::regex there.
#
# Qwen2 / Llama 3: HF's tokenizer.json has "(?i:'s|'t|'re|'ve|'m|'ll|'d)|...". llama.cpp's
# rewrite has explicit [sS] classes (its matcher lowercases only the ASCII letters that matter);
# the two differ only where Unicode case folding maps a non-ASCII letter onto s/t/m/d/r/e/v/l
# (e.g. U+017F LONG S); we follow llama.cpp. Qwen2 splits digits one by one (\p{N}), Llama 3 in
# runs of up to three (\p{N}{1,3}).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2: llama.cpp's string omits the final "|\s+", but its hand-written matcher
# (unicode_regex_split_custom_gpt2) implements the full original regex, given here. With
# "isolated" splitting an unmatched whitespace character becomes its own word anyway.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes in sequence.
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
# StarCoder / SmolLM: every digit alone first, then GPT-2.
_STARCODER_REGEXES = (r"\p{N}", _GPT2_REGEX)


@dataclass(frozen=True)
class PreTokenizer:
    """One row of llama.cpp's pre-tokenizer table (llama_vocab::impl::load)."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a word that is itself a token is not merged (Llama 3)
    add_bos: bool = False         # add_bos default when tokenizer.ggml.add_bos_token is absent
    clean_spaces: bool = True     # llama_detokenize's " ," / " 's" clean-up passes


_QWEN2 = PreTokenizer((_QWEN2_REGEX,), clean_spaces=False)
_LLAMA3 = PreTokenizer((_LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_GPT2 = PreTokenizer((_GPT2_REGEX,))

# `tokenizer.ggml.pre` value -> pre-tokenizer, for every name llama.cpp maps to one of these
# regex lists without other rules we lack (add_sep, <mask> lstrip: BERT-style embedders).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT_REGEXES),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2 (and STABLELM2, HUNYUAN, SOLAR_OPEN: the same regex)
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "kormo": _QWEN2, "f2llmv2": _QWEN2,
    "megrez": PreTokenizer((_QWEN2_REGEX,)), "stablelm2": PreTokenizer((_QWEN2_REGEX,)),
    "hunyuan": _QWEN2, "solar-open": _QWEN2,
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3 (Llama 3.x, Falcon 3, ...); DBRX and Smaug: the same regex
    **{name: _LLAMA3 for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                  "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")},
    "dbrx": PreTokenizer((_LLAMA3_REGEX,)), "smaug-bpe": PreTokenizer((_LLAMA3_REGEX,)),
    # CHATGLM4 (its default BOS is none: a GGUF bos_token_id still sets one, as here)
    "chatglm-bpe": PreTokenizer((_LLAMA3_REGEX,)),
    "glm4": PreTokenizer((_LLAMA3_REGEX,), ignore_merges=True),
    "glm5": PreTokenizer((_LLAMA3_REGEX,), ignore_merges=True),
    # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2
    **{name: PreTokenizer(_STARCODER_REGEXES) for name in ("starcoder", "refact", "codeshell",
                                                            "exaone", "minerva-7b", "mellum2")},
    "smollm": PreTokenizer(_STARCODER_REGEXES, clean_spaces=False),
    "command-r": PreTokenizer(_STARCODER_REGEXES, clean_spaces=False),
    # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING ("gpt2" is not a llama.cpp name; kept
    # because earlier genie-rt versions accepted it)
    **{name: _GPT2 for name in ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat",
                                "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais")},
    "trillion": PreTokenizer((_GPT2_REGEX,), clean_spaces=False),
    "granite-docling": PreTokenizer((_GPT2_REGEX,), clean_spaces=False),
}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable stand-in character -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()
# str.translate table: stand-in char -> chr(byte); every other char below U+0100 -> U+FFFF so that
# .encode("latin-1") fails on any text that is not pure byte-level and the slow path takes over.
_BYTE_TRANSLATE = {cp: 0xFFFF for cp in range(256)}
_BYTE_TRANSLATE.update({ord(c): b for c, b in _BYTE_DECODER.items()})


def byte_level_to_bytes(text: str) -> bytes:
    """Bytes of a NORMAL token's byte-level text (llama.cpp llama_decode_text).

    A character outside the byte-level alphabet (a malformed vocabulary) is kept as its UTF-8
    bytes; llama.cpp would write an "[UNK_BYTE_0x..]" marker instead."""
    try:
        return text.translate(_BYTE_TRANSLATE).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([_BYTE_DECODER[c]]) if c in _BYTE_DECODER else c.encode("utf-8")
                        for c in text)


def parse_merges(raw_merges, vocab) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as (left, right) pairs; ValueError naming the entry if one is not
    'left right' or uses or makes a text missing from the vocabulary."""
    if not isinstance(raw_merges, list):
        raise ValueError("GGUF has no tokenizer.ggml.merges: a BPE vocabulary needs its merges")
    merges: list[tuple[str, str]] = []
    for k, m in enumerate(raw_merges):
        pos = m.find(" ", 1) if isinstance(m, str) else -1  # llama.cpp: word.find(' ', 1)
        if pos < 0:
            raise ValueError(f"tokenizer.ggml.merges[{k}] = {m!r} is not 'left right'")
        left, right = m[:pos], m[pos + 1:]
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise ValueError(f"tokenizer.ggml.merges[{k}] = {m!r} uses or makes a token "
                             "missing from tokenizer.ggml.tokens")
        merges.append((left, right))
    return merges


def clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's three clean-up passes (clean_spaces), on the joined bytes."""
    text = re.sub(rb" (?=[?!.,])", b"", text)          # " ?", " !", " .", " ,"
    if b" ' " in text:                                  # " ' " -> "'" (as llama.cpp's loop does it)
        buf = bytearray(text)
        out = bytearray(buf[:1])
        i = 1
        while i < len(buf):
            x = buf[i]
            if x == 0x27 and i + 1 < len(buf) and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
                out.pop()               # the space before
                i += 1
                buf[i] = 0              # the space after is skipped; llama.cpp also zeroes it
            out.append(x)
            i += 1
        text = bytes(out)
    return re.sub(rb" '(?=[sm]|re|ve)", b"'", text)   # " 's", " 'm", " 're", " 've"


# Texts at least this long are encoded through encode_batch, which releases the GIL while
# the Rust tokenizer runs (`encode` keeps it): a server thread tokenizing a megabyte prompt
# then no longer stops the event loop for a second per megabyte (`python
# tools/bench_tokenize_gil.py`, tokenizers 0.23 on the 2-core CI machine, 2026-12-02: a
# 4.3 MB text, the same ids both ways, stalled a thread ticking every 5 ms for 4.2 s through
# encode, 0.21 s through encode_batch).
GIL_FREE_CHARS = 16384


class BPEModel:
    """Raw text fragment -> ids for one byte-level BPE vocabulary. Immutable; thread-safe."""

    def __init__(self, text_to_id: dict[str, int], merges: list[tuple[str, str]], pre: PreTokenizer):
        bpe = models.BPE(vocab=dict(text_to_id), merges=merges, ignore_merges=pre.ignore_merges)
        hf = tokenizers.Tokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self.hf = hf   # the `tokenizers` object itself (tools/bench_tokenize_gil.py times it)

    def encode(self, fragment: str) -> list[int]:
        if len(fragment) < GIL_FREE_CHARS:
            return self.hf.encode(fragment, add_special_tokens=False).ids
        # same result; encode_batch runs without the GIL (encode holds it: ~1 s per MB)
        return self.hf.encode_batch([fragment], add_special_tokens=False)[0].ids

    def pre_tokenize(self, text: str) -> list[str]:
        return [text[a:b] for _, (a, b) in self.hf.pre_tokenizer.pre_tokenize_str(text)]
