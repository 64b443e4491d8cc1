"""Tokenizing request text within bounded memory, and refusing what cannot fit before it is tokenized.

- `TextBudget(tokenizer)`: the most characters one token can stand for (the longest piece of
  the vocabulary, in bytes, which bounds its characters too; special tokens' text included).
  A text of C characters then has at least C / max_token_chars tokens, so a prompt far longer
  than the context is refused from its length alone, before any tokenization.
- `encode_bounded(tokenizer, text, ..., limit)`: the token ids of `text`, exactly what
  `tokenizer.encode` gives, or `TooManyTokens` as soon as more than `limit` tokens are certain.
  A long text is encoded in slices cut after a newline that stands between two non-blank
  characters: every regex pre-tokenizer llama.cpp uses (and so engine/tokenizer.py) ends a word
  there, so the slices' ids joined are the whole text's ids (tests/test_server_memory.py checks
  it); the Rust tokenizer's working memory is then that of one slice, not of megabytes. A
  vocabulary with a special token holding a newline is encoded whole (it could span a cut).
- `iter_encode`: the same slices one by one (POST /tokenize streams its answer from them).
- `release_memory()`: gives freed heap back to the system (glibc malloc_trim) after a big request.

Deliberately not here: the context check itself (generation.py) or any HTTP.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import re
from typing import Iterator

SLICE_CHARS = 64 << 10            # characters per encode call for long texts
WHOLE_CHARS = 256 << 10           # texts shorter than this are encoded in one call
_CUT = re.compile(r"(?<=[^\s]\n)(?=[^\s])")


class TooManyTokens(ValueError):
    def __init__(self, n_at_least: int, limit: int):
        super().__init__(f"the text has at least {n_at_least} tokens; the limit is {limit}")
        self.n_at_least = n_at_least
        self.limit = limit


class TextBudget:
    """Facts about a vocabulary that bound a text's token count from its length."""

    def __init__(self, tokenizer):
        self.max_token_chars = tokenizer.max_piece_bytes
        specials = [tokenizer.token_text(i) for i in getattr(tokenizer, "special_ids", ())]
        self.can_slice = not any("\n" in s for s in specials)

    def min_tokens(self, n_chars: int) -> int:
        return -(-n_chars // self.max_token_chars)


def _slices(text: str) -> Iterator[str]:
    """Cuts of `text` of about SLICE_CHARS characters, each after a newline between two
    non-blank characters (a word boundary for every regex pre-tokenizer); a stretch without such a
    newline stays whole."""
    start, n = 0, len(text)
    while n - start > SLICE_CHARS:
        m = _CUT.search(text, start + SLICE_CHARS)
        if m is None:
            break
        yield text[start:m.start()]
        start = m.start()
    yield text[start:]


def iter_encode(tokenizer, text: str, add_special: bool, parse_special: bool, budget: TextBudget | None = None
                ) -> Iterator[list[int]]:
    """Ids of `text` in consecutive groups; joined, exactly tokenizer.encode(text, ...)."""
    if len(text) < WHOLE_CHARS or (budget is not None and not budget.can_slice):
        yield tokenizer.encode(text, add_special=add_special, parse_special=parse_special)
        return
    bos = tokenizer.bos_id if add_special and tokenizer.add_bos else None
    eos = tokenizer.eos_id if add_special and tokenizer.add_eos else None
    if bos is not None:
        yield [bos]
    for piece in _slices(text):
        yield tokenizer.encode(piece, add_special=False, parse_special=parse_special)
    if eos is not None:
        yield [eos]


def encode_bounded(tokenizer, text: str, add_special: bool, parse_special: bool, limit: int | None,
                   budget: TextBudget | None = None) -> list[int]:
    """tokenizer.encode(text, ...), or TooManyTokens once more than `limit` tokens are certain
    (from the length alone when `budget` is given, else while encoding)."""
    if limit is not None and budget is not None:
        at_least = budget.min_tokens(len(text))
        if at_least > limit:
            raise TooManyTokens(at_least, limit)
    ids: list[int] = []
    for group in iter_encode(tokenizer, text, add_special, parse_special, budget):
        ids += group
        if limit is not None and len(ids) > limit:
            raise TooManyTokens(len(ids), limit)
    return ids


_libc = None


def release_memory() -> None:
    """Return freed heap pages to the system where glibc offers malloc_trim (no-op elsewhere)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        try:
            _libc.malloc_trim(0)
        except (OSError, AttributeError):
            pass
