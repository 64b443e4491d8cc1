"""Token probabilities (engine/sampling.py TokenProbs) in each API's own shape.

- chat.completion(.chunk): choices[].logprobs = {"content": [{"id", "token", "logprob",
  "bytes", "top_logprobs": [{"id", "token", "logprob", "bytes"}]}], "refusal": null} (OpenAI's
  shape; llama-server adds the ids too).
- text_completion: choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs" (one
  {token: logprob} object per token), "text_offset"} (OpenAI's legacy shape).
- llama-server's /completion: "completion_probabilities": [{"id", "token", "bytes", "logprob",
  "top_logprobs": [...]}], or with post_sampling_probs {"prob", "top_probs": [{.., "prob"}]}.

A token the grammar or logit_bias banned has probability 0: its logprob is written -9999.0 (JSON
has no -inf; OpenAI uses the same floor).
"""
from __future__ import annotations

import math

FLOOR = -9999.0


def _lp(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


def _tok(tokenizer, token: int) -> tuple[str, list[int]]:
    piece = tokenizer.token_to_piece(token)
    return piece.decode("utf-8", errors="replace"), list(piece)


def _entry(tokenizer, token: int, lp: float, post: bool) -> dict:
    text, raw = _tok(tokenizer, token)
    if post:
        return {"id": token, "token": text, "bytes": raw, "prob": math.exp(lp) if math.isfinite(lp) else 0.0}
    return {"id": token, "token": text, "bytes": raw, "logprob": _lp(lp)}


def chat_content(tokenizer, probs) -> list[dict]:
    out = []
    for p in probs:
        e = _entry(tokenizer, p.token, p.logprob, False)
        e["top_logprobs"] = [_entry(tokenizer, t, v, False) for t, v in p.top]
        out.append(e)
    return out


def chat_logprobs(tokenizer, probs) -> dict | None:
    if probs is None:
        return None
    return {"content": chat_content(tokenizer, probs), "refusal": None}


def completion_logprobs(tokenizer, probs, offset: int = 0) -> tuple[dict | None, int]:
    """The legacy shape, and the text offset after these tokens (for the next stream chunk)."""
    if probs is None:
        return None, offset
    tokens, lps, tops, offsets = [], [], [], []
    for p in probs:
        text, _ = _tok(tokenizer, p.token)
        tokens.append(text)
        lps.append(_lp(p.logprob))
        top: dict = {}
        for t, v in p.top:
            top.setdefault(_tok(tokenizer, t)[0], _lp(v))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def native_probs(tokenizer, probs) -> list[dict]:
    """llama-server's completion_probabilities."""
    out = []
    for p in probs or []:
        post = p.post_sampling
        e = _entry(tokenizer, p.token, p.logprob, post)
        e["top_probs" if post else "top_logprobs"] = [_entry(tokenizer, t, v, post) for t, v in p.top]
        out.append(e)
    return out
