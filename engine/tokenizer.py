"""Text <-> token ids from GGUF metadata, token-for-token compatible with llama.cpp.

What it does
- Reads `tokenizer.ggml.*` from a GGUF metadata mapping and builds the model llama.cpp would:
  byte-level BPE for `tokenizer.ggml.model = "gpt2"` (engine/tokenizer_bpe.py: Qwen, Llama 3.x,
  SmolLM, ...) or SentencePiece-style merging by score with byte fallback for "llama"
  (engine/tokenizer_spm.py: Gemma, Llama 2, TinyLlama, Mistral, Phi-3).
- Splits special tokens out of the text first, exactly as llama.cpp's `tokenizer_st_partition`:
  longest token text first; USER_DEFINED tokens (`<tool_call>`, `<think>`, Gemma's `\\n\\n` and
  HTML tags) always, CONTROL tokens (`<|im_start|>`, `<start_of_turn>`) only with
  `parse_special=True`; the whitespace after tokens llama.cpp marks rstrip (Phi-3) is dropped.
- SentencePiece vocabularies: a space in front of each text fragment that starts the text or
  follows a special token when `tokenizer.ggml.add_space_prefix` (default true; Gemma: false),
  spaces written "▁".
- Decodes ids to bytes per token as llama.cpp's `token_to_piece` (NORMAL tokens byte-level
  decoded or "▁" -> space, BYTE tokens `<0xNN>` -> the byte, CONTROL/USER_DEFINED tokens as their
  text), streams text without ever emitting half a UTF-8 character (`stream_decoder()`), and
  `detokenize` mirrors `llama_detokenize` (the leading-space strip, the BPE clean-up passes).
- Knows the end-of-generation set (`eot_ids`) by llama.cpp's rules: EOS, EOT, EOM, FIM pad/repo/sep
  and the tokens whose text llama.cpp treats as EOG (`<|im_end|>`, `<end_of_turn>`, ...).

What it deliberately does not do
- WordPiece, Unigram, RWKV vocabularies and BPE pre-tokenizers not in
  tokenizer_bpe.PRE_TOKENIZERS: refused with a ValueError naming the GGUF key, never approximated.
- Chat templates (engine/chat.py) and reading GGUF files (the model loader passes the mapping in).
"""
from __future__ import annotations

import codecs
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .gguf_file import short_repr
from .tokenizer_bpe import PRE_TOKENIZERS, BPEModel, byte_level_to_bytes, clean_spaces, parse_merges
from .tokenizer_special import (SPECIAL_TYPES, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL,
                                TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED, eog_ids, meta_int,
                                SpecialTokens, rstrip_ids)
from .tokenizer_spm import SPACE, SPMModel

__all__ = ["Tokenizer", "StreamDecoder", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_CONTROL",
           "TOKEN_USER_DEFINED", "TOKEN_UNUSED", "TOKEN_BYTE"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _clean_surrogates(text: str) -> str:
    """Join valid surrogate pairs, replace lone surrogates with U+FFFD (one each)."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _meta_bool(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, int)):
        raise ValueError(f"GGUF key {key} must be a boolean, got {short_repr(value)}")
    return bool(value)


def _scores(meta: Mapping[str, Any], n_vocab: int) -> np.ndarray:
    """Token scores as llama.cpp holds them: float32 (integer scores are rounded to float32)."""
    raw = meta.get("tokenizer.ggml.scores")
    if raw is None:
        return np.zeros(n_vocab, np.float32)   # llama.cpp: every score 0, ties by position
    if not isinstance(raw, list) or len(raw) < n_vocab:
        got = f"{len(raw)} entries" if isinstance(raw, list) else short_repr(raw)
        raise ValueError(f"tokenizer.ggml.scores must be an array of at least {n_vocab} numbers, "
                         f"got {got}")
    try:
        arr = np.asarray(raw[:n_vocab])
    except ValueError:   # ragged nested lists
        arr = np.asarray(raw[:n_vocab], dtype=object)
    if arr.dtype.kind not in "iuf" or arr.ndim != 1 or (arr.dtype.kind == "f" and np.isnan(arr).any()):
        i = next(i for i, s in enumerate(raw[:n_vocab])
                 if isinstance(s, bool) or not isinstance(s, (int, float)) or s != s)
        raise ValueError(f"tokenizer.ggml.scores[{i}] = {short_repr(raw[i])} is not a number")
    return arr.astype(np.float32)


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Immutable after construction; thread-safe."""

    def __init__(self, *, tokens: list[str], token_types: list[int], text_to_id: dict[str, int],
                 model: BPEModel | SPMModel, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool, add_space_prefix: bool, clean_spaces: bool,
                 eot_ids: frozenset[int], pre: str | None, rstrip: frozenset[int] = frozenset()):
        # Prefer from_gguf_metadata(); this constructor trusts its (already validated) arguments.
        self._tokens = tokens                          # id -> token text
        self._types = token_types                      # id -> TOKEN_* after llama.cpp's overrides
        self._text_to_id = text_to_id                  # text -> id; last id wins, as llama.cpp's map
        self._model = model
        self._spm = isinstance(model, SPMModel)
        self._pre = pre
        self._bos_id, self._eos_id = bos_id, eos_id
        self._add_bos, self._add_eos = add_bos, add_eos
        self._add_space_prefix = add_space_prefix
        self._clean_spaces = clean_spaces
        self._eot_ids = eot_ids
        # id -> bytes it decodes to, filled on first use (262k entries for Gemma: computing them
        # all would be most of the load time). Racing threads write the same value.
        self._pieces: list[bytes | None] = [None] * len(tokens)
        self._max_piece: int | None = None

        type_arr = np.asarray(token_types)
        self._hidden = frozenset(np.flatnonzero(   # dropped by skip_special
            (type_arr == TOKEN_CONTROL) | (type_arr == TOKEN_UNKNOWN)).tolist())
        # Special-token partition order: longest text first, ties by id (llama.cpp's sort is not
        # stable; ties only matter for two equally long specials overlapping in the text).
        special = np.flatnonzero(np.isin(type_arr, SPECIAL_TYPES)).tolist()
        special.sort(key=lambda i: (-len(tokens[i]), i))
        self._special_all = SpecialTokens([(tokens[i], i) for i in special], rstrip)
        self._special_user = SpecialTokens(
            [(tokens[i], i) for i in special if token_types[i] == TOKEN_USER_DEFINED], rstrip)
        self._special_ids = frozenset(special)

    def _piece(self, i: int) -> bytes:
        """llama.cpp token_to_piece(special=true) of a valid id."""
        piece = self._pieces[i]
        if piece is None:
            piece = self._pieces[i] = self._piece_of(self._tokens[i], self._types[i])
        return piece

    def _piece_of(self, text: str, ttype: int) -> bytes:
        """The bytes an entry of this text and type stands for (uncached)."""
        if ttype in SPECIAL_TYPES:
            return text.encode("utf-8")
        if ttype == TOKEN_NORMAL:
            return text.replace(SPACE, " ").encode("utf-8") if self._spm else byte_level_to_bytes(text)
        if ttype == TOKEN_BYTE and (m := _BYTE_TOKEN.fullmatch(text)):
            return bytes([int(m.group(1), 16)])
        return b""      # UNUSED, UNDEFINED (and a BYTE token not written <0xNN>): nothing

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
        if model not in ("gpt2", "llama"):
            kind = {"bert": "WordPiece", "t5": "Unigram", "rwkv": "RWKV"}.get(model, "unknown")
            raise ValueError(f"tokenizer.ggml.model = {model!r} ({kind}) is not supported: "
                             "genie-rt implements byte-level BPE ('gpt2') and SentencePiece "
                             "('llama') vocabularies")
        spm = model == "llama"
        pre_name = None if spm else meta.get("tokenizer.ggml.pre", "default")  # missing: 'default'
        if not spm and pre_name not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre = {pre_name!r} is not a supported pre-tokenizer "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")

        tokens = meta.get("tokenizer.ggml.tokens")
        try:
            if not isinstance(tokens, list) or not tokens:
                raise TypeError
            "".join(tokens)            # TypeError unless all are strings (C speed)
        except TypeError:
            raise ValueError("tokenizer.ggml.tokens must be a non-empty list of strings") from None
        n_vocab = len(tokens)
        if "" in tokens:   # llama.cpp renames empty entries
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TOKEN_NORMAL] * n_vocab  # llama.cpp's default attribute
        elif not isinstance(types, list) or np.asarray(types).dtype.kind not in "iu":
            raise ValueError(f"tokenizer.ggml.token_type must be an array of integers, got "
                             f"{short_repr(types)}")
        elif len(types) != n_vocab:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{n_vocab} tokens")
        types = list(types)            # a copy: llama.cpp's overrides are applied to it
        text_to_id = dict(zip(tokens, range(n_vocab)))   # last id wins, as in llama.cpp

        if spm:
            engine: BPEModel | SPMModel = SPMModel(tokens, text_to_id, _scores(meta, n_vocab))
            add_bos_default, clean_spaces = True, False
        else:
            pre = PRE_TOKENIZERS[pre_name]
            merges = parse_merges(meta.get("tokenizer.ggml.merges"), text_to_id)
            engine = BPEModel(text_to_id, merges, pre)
            add_bos_default, clean_spaces = pre.add_bos, pre.clean_spaces

        bos_id = meta_int(meta, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = meta_int(meta, "tokenizer.ggml.eos_token_id", n_vocab)
        if spm:  # llama.cpp's defaults for SentencePiece files without the keys
            bos_id = 1 if bos_id is None and n_vocab > 1 else bos_id
            eos_id = 2 if eos_id is None and n_vocab > 2 else eos_id
        add_bos = _meta_bool(meta, "tokenizer.ggml.add_bos_token", add_bos_default)
        add_eos = _meta_bool(meta, "tokenizer.ggml.add_eos_token", False)
        add_space_prefix = _meta_bool(meta, "tokenizer.ggml.add_space_prefix", spm)
        if add_bos and bos_id is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id "
                             "is missing")
        if add_eos and eos_id is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id "
                             "is missing")

        eog = eog_ids(meta, tokens, types, n_vocab, text_to_id, eos_id)

        return cls(tokens=tokens, token_types=types, text_to_id=text_to_id, model=engine, bos_id=bos_id, eos_id=eos_id,
                   add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
                   clean_spaces=clean_spaces, eot_ids=eog, pre=pre_name,
                   rstrip=rstrip_ids(meta, types, text_to_id))

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
    def add_space_prefix(self) -> bool:
        """SentencePiece: a space is put before text that starts the input or follows a special
        token (tokenizer.ggml.add_space_prefix; false for Gemma)."""
        return self._add_space_prefix

    @property
    def model(self) -> str:
        """`tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""
        return "llama" if self._spm else "gpt2"

    @property
    def special_ids(self) -> frozenset[int]:
        """CONTROL, USER_DEFINED and UNKNOWN ids: the tokens matched whole in text."""
        return self._special_ids

    @property
    def pre_tokenizer(self) -> str | None:
        """The `tokenizer.ggml.pre` name in use (None for SentencePiece, which has none)."""
        return self._pre

    @property
    def max_piece_bytes(self) -> int:
        """Bytes of the longest piece (token_to_piece) in the vocabulary: a text of C characters
        has at least C / this many tokens. Computed once, without filling the piece cache or
        checking each id (token_to_piece over Gemma's 262k entries took 0.7 s on the first request)."""
        if self._max_piece is None:
            self._max_piece = max(1, max(map(len, map(self._piece_of, self._tokens, self._types)), default=0))
        return self._max_piece

    def prepare(self) -> None:
        """Build now what the first long text would build lazily (the longest piece; for
        SentencePiece the table of pairs inside entries: 0.1 s for Gemma), so that a server's
        first request does not wait for it."""
        self.max_piece_bytes
        if self._spm:
            self._model.prepare()

    def token_id(self, text: str) -> int | None:
        """Id of the token whose text is exactly `text` ("<tool_call>", "<think>"), else None."""
        return self._text_to_id.get(text)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry itself (byte-level or "▁" text for NORMAL tokens)."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """TOKEN_* of this id, after llama.cpp's overrides (EOG-looking tokens are CONTROL)."""
        return self._types[self._check_id(token_id)]

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
        model = self._model
        after_special = True          # SentencePiece: the input's start counts as a special token
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            elif self._spm:
                if self._add_space_prefix and after_special:
                    fragment = " " + fragment
                ids.extend(model.encode(fragment.replace(" ", SPACE)))
                after_special = False
            else:
                ids.extend(model.encode(fragment))
        if add_special and self._add_eos:
            ids.append(self._eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        return (self._special_all if parse_special else self._special_user).partition(text)

    def pre_tokenize(self, text: str) -> list[str]:
        """The words BPE merges within, as plain text (for debugging and tests); special tokens
        are not split out here. SentencePiece vocabularies have no pre-tokenizer: ValueError."""
        if self._spm:
            raise ValueError("a SentencePiece ('llama') vocabulary has no pre-tokenizer")
        return self._model.pre_tokenize(_clean_surrogates(text))

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
        return self._piece(self._check_id(token_id))

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`: the pieces joined, as llama-server's /detokenize and its streams give
        them (no leading-space strip: see detokenize). skip_special drops CONTROL/UNKNOWN tokens
        (USER_DEFINED ones such as `<think>` stay, as in llama.cpp). Invalid UTF-8 becomes U+FFFD."""
        out = []
        for t in ids:
            i = self._check_id(t)
            if skip_special and i in self._hidden:
                continue
            out.append(self._piece(i))
        return b"".join(out).decode("utf-8", "replace")

    def detokenize(self, ids: Iterable[int], *, remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """llama.cpp's llama_detokenize(ids, remove_special, unparse_special): without
        unparse_special CONTROL/UNKNOWN tokens give nothing; remove_special drops a leading BOS
        and a trailing EOS the tokenizer would add; with add_space_prefix the first piece loses
        one leading space (not after a removed BOS); BPE vocabularies but Qwen2/SmolLM-style
        ones then drop spaces before ?!., and in " 's", " 'm", " 're", " 've", " ' "."""
        ids = [self._check_id(t) for t in ids]
        strip_space = self._add_space_prefix
        if remove_special and self._add_bos and ids and ids[0] == self._bos_id:
            strip_space = False
            ids = ids[1:]
        if remove_special and self._add_eos and ids and ids[-1] == self._eos_id:
            ids = ids[:-1]
        out = []
        for i in ids:
            piece = b"" if not unparse_special and i in self._hidden else self._piece(i)
            if strip_space and piece[:1] == b" ":
                piece = piece[1:]
            strip_space = False
            out.append(piece)
        text = b"".join(out)
        if self._clean_spaces:
            text = clean_spaces(text)
        return text.decode("utf-8", "replace")

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

    @property
    def holding(self) -> bool:
        """True while bytes of an incomplete UTF-8 character are held back."""
        return bool(self._utf8.getstate()[0])

    def flush(self) -> str:
        """End of the stream: emit what is buffered and reset for reuse."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
