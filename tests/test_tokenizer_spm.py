"""SentencePiece-style ("llama") vocabularies on small hand-made vocabularies: the merge order
(scores, leftmost among equal scores), byte fallback, the space prefix, cutting texts into
independent parts, decoding, metadata errors - and the whole against a textbook statement of
llama.cpp's algorithm on random vocabularies full of equal scores.

Exact ids against llama.cpp for Gemma 3 and the Llama 2 / TinyLlama vocabulary:
tests/test_tokenizer_llamacpp.py.
"""
import concurrent.futures
import random

import pytest

import genie_rt.engine.tokenizer_spm as spm_module
from genie_rt.engine.tokenizer import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN,
                                       TOKEN_USER_DEFINED, Tokenizer)

N_FIXED = 3 + 256      # <unk> <s> </s>, then <0x00>..<0xFF>


def spm_meta(pieces, *, byte_tokens=True, extra=(), **keys):
    """GGUF metadata of a SentencePiece vocabulary: <unk>=0, <s>=1, </s>=2, the 256 byte
    tokens, then `pieces` ({text: score}, NORMAL), then `extra` ((text, type, score) tuples)."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL]
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    for text, score in pieces.items():
        tokens.append(text)
        types.append(TOKEN_NORMAL)
        scores.append(score)
    for text, ttype, score in extra:
        tokens.append(text)
        types.append(ttype)
        scores.append(score)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": True}
    for k, v in keys.items():
        key = "tokenizer.ggml." + k
        if v is None:
            meta.pop(key, None)
        else:
            meta[key] = v
    return meta


def build(pieces, **kw):
    meta = spm_meta(pieces, **kw)
    tok = Tokenizer.from_gguf_metadata(meta)
    tok._test_scores = meta["tokenizer.ggml.scores"]     # for textbook()
    return tok


def ids_of(tok, *texts):
    return [tok.token_id(t) for t in texts]


def textbook(text, tok, scores=None):
    """llama.cpp's SPM merge stated plainly: while some adjacent pair of symbols forms a token,
    merge the pair whose token has the highest score (float32), the leftmost of equal ones;
    symbols left that are not tokens become their UTF-8 bytes."""
    import numpy as np
    scores = np.asarray(tok._test_scores if scores is None else scores, np.float32)
    syms = list(text)
    while True:
        best = None
        for k in range(len(syms) - 1):
            i = tok.token_id(syms[k] + syms[k + 1])
            if i is not None:
                score = scores[i]
                if best is None or score > best[0]:
                    best = (score, k)
        if best is None:
            break
        k = best[1]
        syms[k:k + 2] = [syms[k] + syms[k + 1]]
    out = []
    for s in syms:
        i = tok.token_id(s)
        out += [i] if i is not None else [tok.token_id(f"<0x{b:02X}>") for b in s.encode()]
    return out


# --- the merge order ---------------------------------------------------------------------------
def test_higher_score_merges_first():
    pieces = {"a": -1, "b": -1, "c": -1, "ab": -2, "bc": -3}
    tok = build(pieces, add_space_prefix=False)
    assert tok.encode("abc") == ids_of(tok, "ab", "c")
    tok = build({**pieces, "bc": -1.5}, add_space_prefix=False)
    assert tok.encode("abc") == ids_of(tok, "a", "bc")


def test_equal_scores_merge_leftmost_first():
    # a merge-rank BPE would take whichever pair it lists first; llama.cpp takes the leftmost
    tok = build({"a": -1, "b": -1, "c": -1, "ab": -2, "bc": -2}, add_space_prefix=False)
    assert tok.encode("abc") == ids_of(tok, "ab", "c")
    assert tok.encode("bcab") == ids_of(tok, "bc", "ab")
    assert tok.encode("abcabc") == ids_of(tok, "ab", "c", "ab", "c")


def test_a_run_of_equal_scores():
    # "ababa": ab@0 (leftmost of four equal-score pairs), then ab@2, then "ab"+"a" -> "aba"
    tok = build({"a": -1, "b": -1, "ab": -2, "ba": -2, "aba": -4}, add_space_prefix=False)
    assert tok.encode("ababa") == textbook("ababa", tok) == ids_of(tok, "ab", "aba")


def test_a_grown_symbol_invalidates_its_queued_pairs():
    # "bc" merges first; the queued pair "ab" is then stale ("b" has grown) and must not merge
    tok = build({"a": -1, "b": -1, "c": -1, "bc": -2, "ab": -3, "abc": -9}, add_space_prefix=False)
    assert tok.encode("abc") == ids_of(tok, "abc")          # [a][bc] -> "abc"
    tok = build({"a": -1, "b": -1, "c": -1, "bc": -2, "ab": -3}, add_space_prefix=False)
    assert tok.encode("abc") == ids_of(tok, "a", "bc")


def test_any_token_type_can_be_merged_into():
    # llama.cpp looks the concatenation up among all tokens: literal "<s>" text becomes <s>
    # by merging when parse_special is off (and the pieces exist)
    tok = build({"<": -1, "s": -1, ">": -1, "<s": -2}, add_space_prefix=False)
    assert tok.encode("<s>") == [1]
    assert tok.encode("<s>", parse_special=True) == [1]


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_textbook_algorithm_on_random_vocabularies(seed):
    rng = random.Random(seed)
    alphabet = "ab▁c"
    pieces = {ch: -1.0 for ch in alphabet[:3]}
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5)))
        pieces[text] = rng.choice([-1.0, -2.0, -3.0, 0.0, -0.0, -2.5])   # many equal scores
    tok = build(pieces, add_space_prefix=False)
    for _ in range(150):       # up to 100 characters: long ones are cut into parts first
        text = "".join(rng.choice(alphabet + "d") for _ in range(rng.randint(1, 100)))
        assert tok.encode(text.replace("▁", " ")) == textbook(text, tok), text


def test_parts_are_cut_only_where_no_token_spans():
    tok = build({"a": -1, "b": -1, "c": -1, "ab": -2, "▁a": -2, "bc▁": -4}, add_space_prefix=False)
    model = tok._model
    text = "ab▁ac▁abbc▁▁a" * 8
    parts = model.parts(text)
    assert "".join(parts) == text and len(parts) > 8
    inner = {t[k:k + 2] for t in tok._tokens for k in range(len(t) - 1)}
    for left, right in zip(parts, parts[1:]):
        assert left[-1] + right[0] not in inner
    for part in parts:
        assert all(part[k:k + 2] in inner for k in range(len(part) - 1))


def test_memo_and_threads_give_the_same_ids(monkeypatch):
    rng = random.Random(3)
    pieces = {"a": -1, "b": -1, "▁": -1, "ab": -2, "▁a": -3, "ba": -2, "▁ab": -4, "abab": -5}
    tok = build(pieces)
    texts = [" ".join("".join(rng.choice("ab") for _ in range(rng.randint(1, 9)))
                      for _ in range(rng.randint(10, 40))) for _ in range(60)]
    expected = [textbook("▁" + t.replace(" ", "▁"), tok) for t in texts]
    monkeypatch.setattr(spm_module, "_MEMO_ENTRIES", 7)       # the memo is emptied often
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(tok.encode, texts * 3)) == expected * 3


# --- byte fallback -----------------------------------------------------------------------------
def test_characters_not_in_the_vocabulary_become_byte_tokens():
    tok = build({"a": -1, "▁": -1}, add_space_prefix=False)
    byte = [N_FIXED - 256 + b for b in "日".encode()]
    assert tok.encode("a日a") == [tok.token_id("a"), *byte, tok.token_id("a")]
    assert tok.decode(tok.encode("a日😀a\x00")) == "a日😀a\x00"
    assert tok.token_to_piece(byte[0]) == b"\xe6"


def test_byte_fallback_without_byte_tokens():
    # llama.cpp: "<0xNN>", else the one-character token for an ASCII byte, else it fails
    tok = build({"a": -1, "\x07": -1}, byte_tokens=False, add_space_prefix=False)
    assert tok.encode("a") == [tok.token_id("a")]
    with pytest.raises(ValueError, match=r"no byte token <0xE6> for '日'"):
        tok.encode("日")


# --- space prefix, BOS, special tokens ---------------------------------------------------------
def test_space_prefix_at_the_start_and_after_special_tokens():
    pieces = {"a": -1, "b": -1, "▁": -2, "▁a": -3, "▁b": -3}
    tok = build(pieces)          # add_space_prefix missing: llama.cpp's default for SPM is true
    assert tok.add_space_prefix and tok.add_bos
    assert tok.encode("a") == ids_of(tok, "▁a")
    assert tok.encode("a", add_special=True) == [1, *ids_of(tok, "▁a")]
    assert tok.encode("a b") == ids_of(tok, "▁a", "▁b")
    assert tok.encode("a</s>b", parse_special=True) == [*ids_of(tok, "▁a"), 2, *ids_of(tok, "▁b")]
    assert tok.encode("") == [] and tok.encode("", add_special=True) == [1]
    gemma_like = build(pieces, add_space_prefix=False)
    assert gemma_like.encode("a b") == ids_of(gemma_like, "a", "▁b")
    assert gemma_like.encode("a</s>b", parse_special=True) == [*ids_of(gemma_like, "a"), 2,
                                                               *ids_of(gemma_like, "b")]


def test_user_defined_tokens_are_cut_out_before_merging():
    # Gemma's "\n\n", runs of spaces and HTML tags are USER_DEFINED: always matched whole
    tok = build({"a": -1, "▁": -1, "▁a": -2}, add_space_prefix=False,
                extra=[("\n", TOKEN_USER_DEFINED, -1000), ("\n\n", TOKEN_USER_DEFINED, -1000),
                       ("  ", TOKEN_USER_DEFINED, -1000), ("<b>", TOKEN_USER_DEFINED, -1000)])
    nl, nn, sp, b = ids_of(tok, "\n", "\n\n", "  ", "<b>")
    assert tok.encode("a\n\n\na  <b>a") == [tok.token_id("a"), nn, nl, tok.token_id("a"), sp, b,
                                            tok.token_id("a")]
    assert tok.decode(tok.encode("a\n\n\na  <b>a")) == "a\n\n\na  <b>a"


def test_eos_and_eog_defaults():
    meta = spm_meta({"a": -1}, bos_token_id=None, eos_token_id=None, add_bos_token=None)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
    assert tok.eot_ids == {2} and tok.is_control(2) and tok.model == "llama"
    assert tok.pre_tokenizer is None


# --- decoding ----------------------------------------------------------------------------------
def test_pieces_and_detokenize():
    tok = build({"a": -1, "▁": -2, "▁a": -3, "▁▁": -4})
    ids = tok.encode("a  a", add_special=True)
    assert tok.decode(ids) == "<s> a  a"                 # pieces joined: "▁" -> " "
    assert tok.decode(ids, skip_special=True) == " a  a"
    # llama_detokenize: the first piece loses one space, unless a removed BOS came first
    assert tok.detokenize(ids[1:]) == "a  a"
    assert tok.detokenize(ids) == " a  a"                # <s> hidden, its lstrip spent
    assert tok.detokenize(ids, unparse_special=True) == "<s> a  a"
    assert tok.detokenize(ids, remove_special=True) == " a  a"
    assert tok.token_to_piece(tok.token_id("▁a")) == b" a"
    assert tok.token_to_piece(0) == b"<unk>" and tok.is_control(0)


def test_stream_decoder_joins_byte_tokens_into_characters():
    tok = build({"a": -1}, add_space_prefix=False)
    ids = tok.encode("a€a")
    assert len(ids) == 5
    stream = tok.stream_decoder()
    assert [stream.feed(i) for i in ids] == ["a", "", "", "€", "a"]


# --- metadata errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("keys, match", [
    ({"scores": [0.0, 1.0]}, r"tokenizer\.ggml\.scores must be an array of at least 260 numbers, got 2 entries"),
    ({"scores": "x"}, r"tokenizer\.ggml\.scores must be an array"),
    ({"add_space_prefix": "yes"}, r"tokenizer\.ggml\.add_space_prefix must be a boolean"),
    ({"bos_token_id": 5000}, r"bos_token_id = 5000 is outside"),
])
def test_malformed_metadata_is_refused(keys, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(spm_meta({"a": -1}, **keys))


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), ("x", "'x'"), (None, "None")])
def test_bad_score_is_named(bad, shown):
    meta = spm_meta({"a": -1, "b": -1})
    meta["tokenizer.ggml.scores"][N_FIXED + 1] = bad
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.scores\[{N_FIXED + 1}\] = {shown} is not a number"):
        Tokenizer.from_gguf_metadata(meta)


def test_missing_scores_mean_all_zero():
    meta = spm_meta({"a": -1, "b": -1, "ab": -5, "ba": -1}, add_space_prefix=False)
    del meta["tokenizer.ggml.scores"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("aba", add_special=False) == textbook("aba", tok, [0.0] * 263) == [tok.token_id("ab"),
                                                                            tok.token_id("a")]


def test_integer_scores_are_rounded_to_float32_like_llamacpp():
    # 16777217 and 16777216 are one float32: equal scores, so the leftmost pair wins
    tok = build({"a": -1, "b": -1, "c": -1, "ab": 16777216, "bc": 16777217}, add_space_prefix=False)
    assert tok.encode("abc") == ids_of(tok, "ab", "c")


def test_empty_token_texts_are_renamed_like_llamacpp():
    meta = spm_meta({"a": -1})
    meta["tokenizer.ggml.tokens"][N_FIXED] = ""
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.token_text(N_FIXED) == f"[EMPTY_{N_FIXED}]"


def test_max_piece_bytes_is_the_longest_piece():
    # "▁▁▁" is 9 bytes of text but 3 bytes of piece; the control token's text counts whole
    tok = build({"▁▁▁": -1, "ab": -1, "üü": -1}, extra=[("<start_of_turn>", TOKEN_CONTROL, 0.0)])
    assert tok.max_piece_bytes == max(len(tok.token_to_piece(i)) for i in range(tok.vocab_size)) == 15
    tok = build({"▁▁▁▁": -1, "ab": -1, "üüüü": -1})      # 4 spaces (4 bytes), 4 ü (8 bytes)
    assert tok.max_piece_bytes == 8


def test_prepare_builds_the_pair_table_the_first_long_text_would():
    tok = build({"▁▁▁": -1, "ab": -1})
    assert tok._model._pairs is None
    tok.prepare()
    assert tok._model._pairs is not None and tok._max_piece is not None
    assert tok.encode("ab ab ab " * 20, add_special=False) == build({"▁▁▁": -1, "ab": -1}).encode(
        "ab ab ab " * 20, add_special=False)
