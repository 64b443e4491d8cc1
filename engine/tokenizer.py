"""Byte-level BPE tokenizer built from GGUF metadata, token-for-token compatible with llama.cpp.

What it does
- Reads `tokenizer.ggml.*` from a GGUF metadata mapping (tokens, token types, merges, pre-tokenizer
  name, BOS/EOS ids and flags) and builds a byte-level BPE with the `tokenizers` library: a regex
  Split (the pre-tokenizer llama.cpp selects by `tokenizer.ggml.pre`), ByteLevel byte-to-unicode
  mapping without its own regex and without a prefix space, then BPE merges by rank.
- Splits special tokens out of the text first, exactly as llama.cpp's `tokenizer_st_partition`:
  longest token text first; USER_DEFINED tokens (`<tool_call>`, `<think>`, ...) always, CONTROL
  tokens (`<|im_start|>`, ...) only with `parse_special=True`.
- Decodes ids to bytes per token the way llama.cpp's `token_to_piece` does (NORMAL tokens
  byte-level decoded, CONTROL/USER_DEFINED tokens as their literal text) and streams text without
  ever emitting half a UTF-8 character (`Tokenizer.stream_decoder()` -> `StreamDecoder`).
- Knows the end-of-generation set (`eot_ids`) by llama.cpp's rules: EOS, EOT, EOM, FIM pad/repo/sep
  and the tokens whose text llama.cpp treats as EOG (`<|im_end|>`, `<|endoftext|>`, ...).

What it deliberately does not do
- SentencePiece ("llama"), WordPiece, Unigram or RWKV vocabularies, and pre-tokenizers other than
  the table below: they are refused with a ValueError naming the GGUF key, never approximated.
- Unicode normalisation (llama.cpp does none for BPE; HF's Qwen2 tokenizer applies NFC, so ids
  can differ from HF for non-NFC input, e.g. decomposed accents).
- `clean_up_tokenization_spaces`: decode() returns the concatenated pieces, which is also what
  llama-server streams to its clients.
- Chat templates (engine/chat.py) and reading GGUF files (the model loader passes the mapping in).
"""
from __future__ import annotations

import codecs
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers
from tokenizers import Regex, models, pre_tokenizers

from .gguf_file import short_repr

# GGUF `tokenizer.ggml.token_type` values (gguf.TokenType, llama.cpp LLAMA_TOKEN_TYPE_*).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# --- pre-tokenizers ----------------------------------------------------------------------------
# Each entry is the list of regexes llama.cpp's llm_tokenizer_bpe applies one after the other
# (src/llama-vocab.cpp), every one a Split with "isolated" behaviour: matches and the gaps between
# them both become words.
#
# Qwen2: HF's tokenizer.json has "(?i:'s|'t|'re|'ve|'m|'ll|'d)|...". llama.cpp runs the rewrite
# below with explicit [sS] classes (its regex engine lacks inline flags) through a hand-written
# matcher (unicode_regex_split_custom_qwen2). They differ only where Unicode case folding maps a
# non-ASCII letter onto s/t/m/d/r/e/v/l (e.g. U+017F LONG S); we follow llama.cpp.
# Digits are split one by one (\p{N}, not \p{N}{1,3} as in Llama 3).
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2: llama.cpp's string omits the final "|\s+", but it is dispatched to a hand-written matcher
# (unicode_regex_split_custom_gpt2) that implements the full original regex, given here. With
# "isolated" splitting an unmatched whitespace character becomes its own word anyway.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes in sequence.
_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# `tokenizer.ggml.pre` value -> regexes (names as llama.cpp's llama_vocab::impl::load maps them).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "qwen2": (_QWEN2_REGEX,),
    "deepseek-r1-qwen": (_QWEN2_REGEX,),
    "megrez": (_QWEN2_REGEX,),
    "gpt-2": (_GPT2_REGEX,),
    "gpt2": (_GPT2_REGEX,),
    "phi-2": (_GPT2_REGEX,),
    "default": _DEFAULT_REGEXES,
}

# --- special-token texts llama.cpp recognises (llama_vocab::impl::load) -----------------------
# Tokens whose text is in _EOG_TEXTS end generation; FIM pad/repo/sep tokens do too. Every token
# llama.cpp auto-detects by text (EOT, EOM, FIM_*) is forced to CONTROL if the GGUF says otherwise.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})
_EOT_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
})
_FIM_TEXTS = {  # GGUF key suffix -> texts
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")

_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _byte_level_to_bytes(text: str) -> bytes:
    """Bytes of a NORMAL token's byte-level text (llama.cpp llama_decode_text).

    A character outside the byte-level alphabet (a malformed vocabulary) is kept as its UTF-8
    bytes; llama.cpp would write an "[UNK_BYTE_0x..]" marker instead."""
    try:
        return text.translate(_BYTE_TRANSLATE).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([_BYTE_DECODER[c]]) if c in _BYTE_DECODER else c.encode("utf-8")
                        for c in text)


def _clean_surrogates(text: str) -> str:
    """Join valid surrogate pairs, replace lone surrogates with U+FFFD (one each)."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


# Texts at least this long are encoded through encode_batch, which releases the GIL while
# the Rust tokenizer runs (`encode` keeps it): a server thread tokenizing a megabyte prompt
# then no longer stops the event loop for a second per megabyte (`python
# tools/bench_tokenize_gil.py`, tokenizers 0.23 on the 2-core CI machine, 2026-12-02: a
# 4.3 MB text, the same ids both ways, stalled a thread ticking every 5 ms for 4.2 s through
# encode, 0.21 s through encode_batch).
_GIL_FREE_CHARS = 16384


def _meta_int(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"GGUF key {key} must be an integer token id, got {short_repr(value)}") from None
    if not 0 <= value < n_vocab:
        raise ValueError(f"GGUF key {key} = {value} is outside the vocabulary (0..{n_vocab - 1})")
    return value


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Immutable after construction; thread-safe."""

    def __init__(self, *, tokens: list[str], token_types: list[int], merges: list[tuple[str, str]],
                 pre: str, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool,
                 eot_ids: frozenset[int]):
        # Prefer from_gguf_metadata(); this constructor trusts its (already validated) arguments.
        self._tokens = tokens                          # id -> token text (byte-level for NORMAL)
        self._types = token_types                      # id -> TOKEN_* after llama.cpp's overrides
        self._pre = pre
        self._bos_id, self._eos_id = bos_id, eos_id
        self._add_bos, self._add_eos = add_bos, add_eos
        self._eot_ids = eot_ids
        # Last id wins for duplicate texts, as in llama.cpp's token_to_id map.
        self._text_to_id = {t: i for i, t in enumerate(tokens)}

        # Pieces: what each id decodes to (llama.cpp token_to_piece with special=true).
        pieces: list[bytes] = []
        for text, ttype in zip(tokens, token_types):
            if ttype == TOKEN_NORMAL:
                pieces.append(_byte_level_to_bytes(text))
            elif ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
                pieces.append(text.encode("utf-8"))
            else:  # UNUSED, BYTE, UNDEFINED: llama.cpp's BPE path emits nothing for these
                pieces.append(b"")
        self._pieces = pieces
        self._hidden = frozenset(i for i, t in enumerate(token_types)
                                 if t in (TOKEN_CONTROL, TOKEN_UNKNOWN))  # dropped by skip_special

        # Special-token partition order: longest text first, ties by id (llama.cpp's sort is not
        # stable; ties only matter for two equally long specials overlapping in the text).
        special = [i for i, t in enumerate(token_types)
                   if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
        special.sort(key=lambda i: (-len(tokens[i]), i))
        self._special_all = [(tokens[i], i) for i in special]
        self._special_user = [(tokens[i], i) for i in special if token_types[i] == TOKEN_USER_DEFINED]
        self._special_ids = frozenset(special)

        bpe = models.BPE(vocab=dict(self._text_to_id), merges=merges)
        hf = tokenizers.Tokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)
             for rx in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._hf = hf

    # --- construction from GGUF metadata -------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from `{key: field.contents()}` of a GGUF file. Raises ValueError naming the key
        for anything missing, malformed or unsupported."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF has no tokenizer.ggml.model: the file carries no vocabulary")
        for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            if key in meta and not isinstance(meta[key], str):
                raise ValueError(f"{key} must be a string, got {short_repr(meta[key])}")
        if model != "gpt2":
            kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram",
                    "rwkv": "RWKV"}.get(model, "unknown")
            raise ValueError(f"tokenizer.ggml.model = {model!r} ({kind}) is not supported: "
                             "genie-rt implements byte-level BPE vocabularies ('gpt2') only")
        pre = meta.get("tokenizer.ggml.pre", "default")  # llama.cpp: missing -> 'default'
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre = {pre!r} is not a supported pre-tokenizer "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")

        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError("tokenizer.ggml.tokens must be a non-empty list of strings")
        n_vocab = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TOKEN_NORMAL] * n_vocab  # llama.cpp's default attribute
        elif not isinstance(types, list) or not all(type(t) is int for t in types):
            raise ValueError(f"tokenizer.ggml.token_type must be an array of integers, got "
                             f"{short_repr(types)}")
        elif len(types) != n_vocab:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{n_vocab} tokens")

        raw_merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(raw_merges, list):
            raise ValueError("GGUF has no tokenizer.ggml.merges: a BPE vocabulary needs its merges")
        vocab = set(tokens)
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

        bos_id = _meta_int(meta, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = _meta_int(meta, "tokenizer.ggml.eos_token_id", n_vocab)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if add_bos and bos_id is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id "
                             "is missing")
        if add_eos and eos_id is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id "
                             "is missing")

        # End of generation and llama.cpp's CONTROL overrides for control-looking texts.
        text_to_id = {t: i for i, t in enumerate(tokens)}
        eot_id = _meta_int(meta, "tokenizer.ggml.eot_token_id", n_vocab)
        eom_id = _meta_int(meta, "tokenizer.ggml.eom_token_id", n_vocab)
        forced = set()
        if eot_id is None:
            eot_id = next((text_to_id[t] for t in sorted(_EOT_TEXTS) if t in text_to_id), None)
            if eot_id is not None:
                forced.add(eot_id)
        if eom_id is None and "<|eom_id|>" in text_to_id:
            eom_id = text_to_id["<|eom_id|>"]
            forced.add(eom_id)
        fim: dict[str, int | None] = {}
        for name, texts in _FIM_TEXTS.items():
            fim[name] = _meta_int(meta, f"tokenizer.ggml.{name}_token_id", n_vocab)
            if fim[name] is None:
                fim[name] = next((text_to_id[t] for t in texts if t in text_to_id), None)
                if fim[name] is not None:
                    forced.add(fim[name])
        eog = {fim[name] for name in _FIM_EOG if fim[name] is not None}
        for text in _EOG_TEXTS:
            if text in text_to_id:
                eog.add(text_to_id[text])
                forced.add(text_to_id[text])
        eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)
        for i in forced:
            types[i] = TOKEN_CONTROL

        return cls(tokens=list(tokens), token_types=types, merges=merges, pre=pre, bos_id=bos_id,
                   eos_id=eos_id, add_bos=add_bos, add_eos=add_eos, eot_ids=frozenset(eog))

    # --- properties ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Every id that ends a turn / generation (llama.cpp's EOG set)."""
        return self._eot_ids

    @property
    def add_bos(self) -> bool:
        """Whether encode(add_special=True) prepends BOS (tokenizer.ggml.add_bos_token)."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def special_ids(self) -> frozenset[int]:
        """CONTROL, USER_DEFINED and UNKNOWN ids: the tokens matched whole in text."""
        return self._special_ids

    @property
    def pre_tokenizer(self) -> str:
        """The `tokenizer.ggml.pre` name in use."""
        return self._pre

    def token_id(self, text: str) -> int | None:
        """Id of the token whose text is exactly `text` ("<tool_call>", "<think>"), else None."""
        return self._text_to_id.get(text)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry itself (byte-level text for NORMAL tokens)."""
        return self._tokens[self._check_id(token_id)]

    def is_control(self, token_id: int) -> bool:
        """True for CONTROL/UNKNOWN tokens: the ones decode(skip_special=True) drops."""
        return self._check_id(token_id) in self._hidden

    # --- encode --------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        add_special: prepend BOS / append EOS where the GGUF asks for them (add_bos/add_eos).
        parse_special: match CONTROL tokens (`<|im_start|>`) in the text; USER_DEFINED tokens
        (`<tool_call>`, `<think>`) are matched either way, as in llama.cpp and HF.
        Lone surrogates in `text` are replaced with U+FFFD."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        text = _clean_surrogates(text)
        ids: list[int] = []
        if add_special and self._add_bos:
            ids.append(self._bos_id)
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            elif len(fragment) < _GIL_FREE_CHARS:
                ids.extend(self._hf.encode(fragment, add_special_tokens=False).ids)
            else:   # same result; encode_batch runs without the GIL (encode holds it: ~1 s per MB)
                ids.extend(self._hf.encode_batch([fragment], add_special_tokens=False)[0].ids)
        if add_special and self._add_eos:
            ids.append(self._eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` into raw-text fragments and special-token ids (tokenizer_st_partition):
        for each special token, longest first, cut every remaining text fragment at each
        non-overlapping occurrence, left to right."""
        fragments: list[str | int] = [text] if text else []
        for special, sid in (self._special_all if parse_special else self._special_user):
            if special not in text:  # cheap whole-text test; most specials never occur
                continue
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(special)
                for k, part in enumerate(parts):
                    if k:
                        out.append(sid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def pre_tokenize(self, text: str) -> list[str]:
        """The words BPE merges within, as plain text (for debugging and tests); special tokens
        are not split out here."""
        text = _clean_surrogates(text)
        return [text[a:b] for _, (a, b) in self._hf.pre_tokenizer.pre_tokenize_str(text)]

    # --- decode --------------------------------------------------------------------------------
    def _check_id(self, token_id: int) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TypeError(f"token id must be an integer, got {token_id!r}") from None
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return i

    def token_to_piece(self, token_id: int) -> bytes:
        """The bytes this token stands for; CONTROL tokens give their text (`<|im_end|>`).
        A piece may be part of a UTF-8 character: join pieces before decoding."""
        return self._pieces[self._check_id(token_id)]

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`. skip_special drops CONTROL/UNKNOWN tokens (USER_DEFINED ones such as
        `<think>` stay, as in llama.cpp). Invalid UTF-8 becomes U+FFFD."""
        pieces = self._pieces
        out = []
        for t in ids:
            i = self._check_id(t)
            if skip_special and i in self._hidden:
                continue
            out.append(pieces[i])
        return b"".join(out).decode("utf-8", "replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental decoder for one generation."""
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns token ids, one at a time, into text that is safe to send.

    feed(id) returns the text completed by this token (possibly ""); bytes of a UTF-8 character
    split across tokens are held back until the character is complete. flush() returns what is
    left, with any incomplete trailing bytes replaced by U+FFFD. The concatenation of all returns
    equals Tokenizer.decode(ids) of the same ids."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        tok = self._tokenizer
        if self._skip_special and tok.is_control(token_id):
            return ""
        return self._utf8.decode(tok.token_to_piece(token_id))

    def flush(self) -> str:
        """End of the stream: emit what is buffered and reset for reuse."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
