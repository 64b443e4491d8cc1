"""SentencePiece-style vocabularies (`tokenizer.ggml.model = "llama"`), token-for-token as
llama.cpp's llm_tokenizer_spm: Gemma, Llama 2, TinyLlama, Mistral 7B v0.1, Phi-3.

The algorithm (llama.cpp src/llama-vocab.cpp, llm_tokenizer_spm_session::tokenize)
1. The fragment's spaces are U+2581 "▁" (engine/tokenizer.py escapes them, after putting a space
   in front when the vocabulary asks for a space prefix).
2. Every character is a symbol. Every adjacent pair of symbols whose concatenation is a
   vocabulary entry - of any type - is a candidate, ranked by that entry's score
   (`tokenizer.ggml.scores`, higher first); equal scores: the leftmost pair first.
3. Take the best candidate. If either of its symbols has changed since it was queued, drop it;
   otherwise merge the two into one symbol and queue the new symbol's pairs with its left and
   right neighbours. Repeat until no candidate is left.
4. Each final symbol is a token, except a single character that is not in the vocabulary: its
   UTF-8 bytes become the byte tokens `<0xNN>` (byte fallback; a byte without such a token is
   the one-character token for an ASCII byte, as in llama.cpp, or an error).

Why a text can be cut into parts that are merged separately
A merged symbol is always a vocabulary entry, so a symbol can only ever span two adjacent
characters "a", "b" if some entry contains "ab". Where no entry does, no candidate crosses that
point, the two sides never interact and the result is the concatenation of the two sides'
results (the queue's order within each side does not change). `SPMModel` cuts long texts at every
such point (numpy, one pass) and memoizes the parts, which in prose are about one word each: the
merge loop runs only for parts it has not seen.

What it deliberately does not do
- Special tokens, BOS/EOS, the space prefix, decoding: engine/tokenizer.py does those.
- SentencePiece's own normalisation (NFKC, removing extra whitespace): llama.cpp applies none
  to these vocabularies, so neither do we (HF's Gemma/Llama tokenizers agree).
"""
from __future__ import annotations

import heapq
import threading

import numpy as np

SPACE = "\u2581"          # "▁": how SentencePiece vocabularies write a space

_SPLIT_MIN_CHARS = 64     # shorter fragments are merged whole (no numpy pass)
_MEMO_MAX_CHARS = 64      # parts at most this long are memoized
_MEMO_ENTRIES = 1 << 16   # the memo is emptied when it reaches this many parts (<= ~10 MB)
_MASK32 = 0xFFFFFFFF       # one field of a queue entry (see _merge)
_SMALL_CHARS = 12         # parts up to this long are merged by scanning instead of a queue


def _pair_keys(cps: np.ndarray) -> np.ndarray:
    """uint64 key of every adjacent pair of code points: (first << 21) | second."""
    return (cps[:-1].astype(np.uint64) << np.uint64(21)) | cps[1:].astype(np.uint64)


class SPMModel:
    """Escaped text fragment -> ids for one SentencePiece-style vocabulary.

    Thread-safe: the only mutable state is a memo of already merged parts (plain dict reads and
    writes) and the pair table, built once under a lock on first use."""

    def __init__(self, tokens: list[str], text_to_id: dict[str, int], scores: np.ndarray):
        self._tokens = tokens             # id -> text, for the pair table
        self._text_to_id = text_to_id     # text -> id, last id wins (llama.cpp token_to_id)
        # id -> rank of its score among the distinct scores, 0 for the highest: all the merge
        # loop needs (equal scores, -0.0 and 0.0 included, share a rank). `scores`: float32.
        distinct = np.unique(scores)      # ascending
        self._rank: list[int] = (len(distinct) - 1 - np.searchsorted(distinct, scores)).tolist()
        byte_ids: list[int | None] = []   # byte -> id of <0xNN>, else of the 1-char ASCII token
        for b in range(256):
            i = text_to_id.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = text_to_id.get(chr(b))
            byte_ids.append(i)
        self._byte_ids = byte_ids
        self._pairs: np.ndarray | None = None   # sorted keys of the pairs found inside entries
        self._pairs_lock = threading.Lock()
        self._memo: dict[str, list[int]] = {}

    # --- encode ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of an escaped fragment (spaces already "▁")."""
        if len(text) < _SPLIT_MIN_CHARS:
            return list(self._merge_memo(text))
        out: list[int] = []
        memo = self._memo
        for part in self.parts(text):
            ids = memo.get(part)
            if ids is None:
                ids = self._merge(part)
                if len(part) <= _MEMO_MAX_CHARS:
                    if len(memo) >= _MEMO_ENTRIES:
                        memo.clear()
                    memo[part] = ids
            out.extend(ids)
        return out

    def _merge_memo(self, part: str) -> list[int]:
        ids = self._memo.get(part)
        if ids is None:
            ids = self._merge(part)
            if len(self._memo) >= _MEMO_ENTRIES:
                self._memo.clear()
            self._memo[part] = ids
        return ids

    def parts(self, text: str) -> list[str]:
        """`text` cut between every two adjacent characters that no vocabulary entry contains
        side by side: the pieces the merge loop can work on separately."""
        if len(text) < 2:
            return [text] if text else []
        pairs = self._pair_table()
        keys = _pair_keys(np.frombuffer(text.encode("utf-32-le"), dtype="<u4"))
        if len(pairs):
            at = np.searchsorted(pairs, keys)
            at[at == len(pairs)] = 0
            free = pairs[at] != keys
        else:
            free = np.ones(len(keys), dtype=bool)
        bounds = [0, *(np.flatnonzero(free) + 1).tolist(), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def prepare(self) -> None:
        """Build the pair table now rather than on the first long text."""
        self._pair_table()

    def _pair_table(self) -> np.ndarray:
        if self._pairs is None:
            with self._pairs_lock:
                if self._pairs is None:
                    tokens = self._tokens
                    cps = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype="<u4")
                    ends = np.cumsum(np.fromiter(map(len, tokens), np.int64, len(tokens)))
                    inside = np.ones(max(len(cps) - 1, 0), dtype=bool)
                    inside[ends[:-1] - 1] = False   # the pair across two entries' boundary
                    self._pairs = np.unique(_pair_keys(cps)[inside])
        return self._pairs

    def _merge(self, text: str) -> list[int]:
        """The merge loop of the module docstring on one part; returns its ids."""
        get = self._text_to_id.get
        n = len(text)
        if n == 1:
            i = get(text)
            return [i] if i is not None else self._byte_fallback(text)
        if n == 2:   # one candidate at most
            i = get(text)
            return [i] if i is not None else self._merge(text[0]) + self._merge(text[1])
        if n <= _SMALL_CHARS:
            return self._merge_small(text)
        rank = self._rank
        piece = list(text)                  # piece[i]: text of the symbol starting at char i, "" once merged away
        nxt = list(range(1, n + 1))         # next live symbol, -1 at the end
        nxt[-1] = -1
        prv = list(range(-1, n - 1))        # previous live symbol, -1 at the start
        # The queue holds one int per candidate: rank of its token's score (0 = highest),
        # left symbol, right symbol, length of left + right when queued, in 32-bit fields
        # (ints compare faster than tuples). heapq pops the smallest: the highest score, then
        # the smallest (leftmost) left index - llama.cpp's order.
        heap = []
        for k in range(n - 1):
            i = get(text[k:k + 2])
            if i is not None:
                heap.append(rank[i] << 96 | k << 64 | (k + 1) << 32 | 2)
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            key = pop(heap)
            left, right, size = key >> 64 & _MASK32, key >> 32 & _MASK32, key & _MASK32
            a, b = piece[left], piece[right]
            if not a or not b or len(a) + len(b) != size:
                continue                    # a side was merged away or has grown: stale
            a += b
            piece[left], piece[right] = a, ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
                s = a + piece[after]
                i = get(s)
                if i is not None:
                    push(heap, rank[i] << 96 | left << 64 | after << 32 | len(s))
            before = prv[left]
            if before >= 0:
                s = piece[before] + a
                i = get(s)
                if i is not None:
                    push(heap, rank[i] << 96 | before << 64 | left << 32 | len(s))
        out: list[int] = []
        for p in piece:
            if p:
                i = get(p)
                out.extend((i,) if i is not None else self._byte_fallback(p))
        return out

    def _merge_small(self, text: str) -> list[int]:
        """The same merge loop for a short part, without the queue: find the best candidate by
        scanning the pairs (the first of equal ranks wins, i.e. the leftmost)."""
        get, rank = self._text_to_id.get, self._rank
        syms = list(text)                   # the symbols' texts, left to right
        ids: list[int | None] = [None] * len(syms)   # token id of each merged symbol
        cand: list[int | None] = []         # cand[k]: token made by syms[k] + syms[k + 1]
        for k in range(len(syms) - 1):
            cand.append(get(text[k:k + 2]))
        while True:
            best, at = None, -1
            for k, i in enumerate(cand):
                if i is not None and (best is None or rank[i] < best):
                    best, at = rank[i], k
            if at < 0:
                break
            syms[at] += syms.pop(at + 1)
            ids[at] = cand[at]
            del ids[at + 1], cand[at]
            if at > 0:
                cand[at - 1] = get(syms[at - 1] + syms[at])
            if at < len(cand):
                cand[at] = get(syms[at] + syms[at + 1])
        out: list[int] = []
        for sym, i in zip(syms, ids):
            if i is None:                   # never merged: one character
                i = get(sym)
                if i is None:
                    out.extend(self._byte_fallback(sym))
                    continue
            out.append(i)
        return out

    def _byte_fallback(self, char: str) -> list[int]:
        out = []
        for b in char.encode("utf-8"):
            i = self._byte_ids[b]
            if i is None:
                raise ValueError(f"the vocabulary has no byte token <0x{b:02X}> for {char!r}: "
                                 "this text cannot be encoded with it (llama.cpp fails too)")
            out.append(i)
        return out
