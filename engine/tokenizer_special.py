"""llama.cpp's rules for special tokens, shared by every vocabulary type.

What it does
- The token types (`tokenizer.ggml.token_type`) and llama.cpp's overrides of them: tokens whose
  text looks like end-of-turn / end-of-generation / fill-in-the-middle markers are forced to
  CONTROL, gpt-oss's channel markers are USER_DEFINED, and the exceptions llama.cpp makes
  (o200k_harmony's `<|end|>`, gemma4's `</s>`) - `eog_ids()` (llama_vocab::impl::load).
- Which tokens drop the whitespace after them in text (Phi-3: `rstrip_ids()`), and cutting a
  text into raw fragments and special-token ids (`SpecialTokens.partition`,
  tokenizer_st_partition).

What it deliberately does not do
- Encoding or decoding text (engine/tokenizer.py and the tokenizer_bpe/tokenizer_spm models).
- LSTRIP (llama.cpp sets it only for the <mask> token of BERT-style embedding vocabularies).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from .gguf_file import short_repr

# GGUF `tokenizer.ggml.token_type` values (gguf.TokenType, llama.cpp LLAMA_TOKEN_TYPE_*).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6
SPECIAL_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)

# --- special-token texts llama.cpp recognises (llama_vocab::impl::load) -----------------------
# Tokens whose text is in EOG_TEXTS end generation; FIM pad/repo/sep tokens do too. Every token
# llama.cpp auto-detects by text (EOT, EOM, FIM_*, EOG) is forced to CONTROL if the GGUF says
# otherwise. Note "</s>" and "<eos>": Gemma 3's "</s>" (an HTML tag, USER_DEFINED) becomes an
# EOG CONTROL token there, so it is matched in text only with parse_special.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
EOT_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
})
FIM_TEXTS = {  # GGUF key suffix -> texts
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss
C_SPACE = " \t\n\v\f\r"   # C isspace(): what lstrip/rstrip tokens drop beside them


def meta_int(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
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


def eog_ids(meta, tokens, types, n_vocab, text_to_id, eos_id) -> frozenset[int]:
    """llama.cpp's EOT/EOM/FIM detection and EOG set; updates `types` in place as llama.cpp
    updates the token attributes."""
    eot_id = meta_int(meta, "tokenizer.ggml.eot_token_id", n_vocab)
    eom_id = meta_int(meta, "tokenizer.ggml.eom_token_id", n_vocab)
    forced = set()
    if eot_id is None:
        eot_id = next((text_to_id[t] for t in sorted(EOT_TEXTS) if t in text_to_id), None)
        if eot_id is not None:
            forced.add(eot_id)
    if eom_id is None and "<|eom_id|>" in text_to_id:
        eom_id = text_to_id["<|eom_id|>"]
        forced.add(eom_id)
    fim: dict[str, int | None] = {}
    for name, texts in FIM_TEXTS.items():
        fim[name] = meta_int(meta, f"tokenizer.ggml.{name}_token_id", n_vocab)
        if fim[name] is None:
            fim[name] = next((text_to_id[t] for t in texts if t in text_to_id), None)
            if fim[name] is not None:
                forced.add(fim[name])
    eog = {fim[name] for name in _FIM_EOG if fim[name] is not None}
    for text in EOG_TEXTS:
        if text in text_to_id:
            eog.add(text_to_id[text])
            forced.add(text_to_id[text])
    for i in forced:
        types[i] = TOKEN_CONTROL
    for text in _ALWAYS_RENDERED:
        if text in text_to_id:
            types[text_to_id[text]] = TOKEN_USER_DEFINED
    eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)
    # o200k_harmony / solar-open: with <|return|> and <|call|> (or <|calls|> and <|flush|>),
    # <|end|> does not end generation and is rendered
    present = {tokens[i] for i in eog}
    if "<|end|>" in present and (("<|return|>" in present and present & {"<|call|>", "<|calls|>"})
                                 or ({"<|call|>", "<|calls|>"} & present and "<|flush|>" in present)):
        end = next(i for i in eog if tokens[i] == "<|end|>")
        eog.discard(end)
        types[end] = TOKEN_USER_DEFINED
    # gemma4 / plamo: "</s>" is an ordinary token there
    if "</s>" in present and present & {"<|tool_response>", "<|plamo:eos|>"}:
        s = next(i for i in eog if tokens[i] == "</s>")
        eog.discard(s)
        types[s] = TOKEN_NORMAL
    return frozenset(eog)




def rstrip_ids(meta: Mapping[str, Any], types: list[int], text_to_id: dict[str, int]) -> frozenset[int]:
    """Tokens after which llama.cpp drops whitespace in text, set by model name: Phi-3 marks
    every special token but <unk>, <s> and <|endoftext|>, and "</s>"."""
    name = meta.get("general.name")
    if not (isinstance(name, str) and ("phi-3" in name.lower() or "phi3" in name.lower())):
        return frozenset()
    ids = {i for i, t in enumerate(types) if t in SPECIAL_TYPES}
    ids |= {text_to_id[t] for t in ("</s>",) if t in text_to_id}
    ids -= {text_to_id[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in text_to_id}
    return frozenset(ids)


class SpecialTokens:
    """The special tokens matched whole in text, in llama.cpp's order (longest text first, ties
    by id), and the partition of a text around them."""

    _PREFIX = 4   # texts are first tested by their first characters: one scan per distinct prefix

    def __init__(self, specials: list[tuple[str, int]], rstrip: frozenset[int]):
        self._rstrip = rstrip
        self._groups: dict[str, list[tuple[int, str, int]]] = {}   # prefix -> [(order, text, id)]
        for order, (text, sid) in enumerate(specials):             # specials: longest first
            self._groups.setdefault(text[:self._PREFIX], []).append((order, text, sid))

    def partition(self, text: str) -> list[str | int]:
        """Split `text` into raw-text fragments and special-token ids (tokenizer_st_partition):
        for each special token, longest first, cut every remaining text fragment at each
        non-overlapping occurrence, left to right; after an rstrip token the whitespace that
        follows (C isspace) is dropped."""
        fragments: list[str | int] = [text] if text else []
        # only tokens whose first characters occur (Gemma: ~60 scans of the text, not 6,400)
        found = sorted(entry for prefix, group in self._groups.items() if prefix in text
                       for entry in group if entry[1] in text)
        for _, special, sid in found:
            strip = sid in self._rstrip
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(special)
                for k, part in enumerate(parts):
                    if k:
                        out.append(sid)
                        if strip:
                            part = part.lstrip(C_SPACE)
                    if part:
                        out.append(part)
            fragments = out
        return fragments
