"""Constrained decoding: grammars and JSON schemas as a token mask per step (llguidance).

    spec = json_schema_constraint({"type": "object", ...})      # ConstraintError: 400 material
    c = Constraint.start(tokenizer, spec)                        # per request (engine.generate)
    words = c.fill()        # the allowed next tokens as a bitmask (None: nothing constrained)
    c.accept(token)         # the token that was sampled

What it does
- Turns what a client asks for into one llguidance grammar (`ConstraintSpec.grammar`, the JSON
  form llguidance's LLMatcher takes): a JSON schema (response_format json_schema / json_object,
  llama-server's `json_schema`, Ollama's `format`), a GBNF grammar as llama-server takes it
  (converted by llguidance's gbnf_to_lark; Lark text starting `%llguidance` passes through, as
  llama.cpp allows), and tool calls written the Qwen/Hermes way
  (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the format
  engine/chat.py parses) whose arguments follow each tool's `parameters` schema. Every grammar is
  checked when it is built: a schema or grammar llguidance cannot compile raises
  ConstraintError with llguidance's own message.
- Builds llguidance's tokenizer from our GGUF vocabulary (engine/tokenizer.py): each id's bytes
  as llama.cpp's token_to_piece gives them, CONTROL tokens and `<...>` USER_DEFINED tokens marked
  special (llguidance's 0xFF prefix, as its llama.cpp binding does), so a grammar's text is never
  matched by a control token. Built once per tokenizer and cached: about 1 s for SmolLM2's 49k
  tokens, 10 s for Gemma 3's 262k on the 2-core CI machine, holding the GIL throughout (Rust), so
  the server builds it while loading (`prepare`), before it answers ready.
- Per request, `Constraint` holds one LLMatcher: `fill()` computes the mask of the next token
  (the end-of-generation ids are allowed exactly when the grammar may end, whichever of the
  model's EOG tokens it is), `accept()` advances it. A *lazy* constraint (tool calls with
  tool_choice "auto") is inactive until the generated text contains its trigger
  (`<tool_call>`), then the text after the trigger is fed to the matcher and it constrains the
  rest: in between the model may answer in plain text.

Not here: applying the mask (engine/sampling.py on the host, engine/gpu_mask.py on a GPU),
the request fields (server/constraints.py).
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import numpy as np

from .tokenizer_special import TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED

log = logging.getLogger("genie_rt")

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# JSON is written compact with a space after ',' and ':' (`{"a": 1, "b": [2, 3]}`): with
# llguidance's default (any whitespace between tokens) a small model can loop on blanks forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A schema or grammar that cannot be compiled (the server answers 400 with the message)."""


def _llg():
    try:
        import llguidance
    except ImportError as exc:   # a declared dependency: only a broken install gets here
        raise ConstraintError(f"constrained output needs the 'llguidance' package ({exc})") from None
    return llguidance


@dataclass(frozen=True)
class ConstraintSpec:
    grammar: str                     # llguidance's grammar JSON (LLMatcher's argument)
    trigger: str | None = None       # lazy: constrain only after this text was generated
    what: str = "grammar"            # for messages: "response_format", "grammar", "tools", ...


def _check(grammar: str, what: str) -> str:
    err = _llg().LLMatcher.validate_grammar(grammar)
    if err:
        raise ConstraintError(f"'{what}' cannot be compiled: {err.strip()}")
    return grammar


def _json_options(strict: bool) -> dict:
    # not strict: keywords llguidance does not implement are ignored instead of refused
    return {**JSON_LAYOUT, "lenient": not strict}


def json_schema_constraint(schema, what: str = "json_schema", strict: bool = True) -> ConstraintSpec:
    """Output that is one JSON value matching `schema` (a dict, or True / {} for any JSON object
    when used as json_object)."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"'{what}' must be a JSON schema object")
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_json_options(strict))
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"'{what}' is not a valid JSON schema: {exc}") from None
    return ConstraintSpec(_check(grammar, what), what=what)


def json_object_constraint(what: str = "response_format") -> ConstraintSpec:
    return json_schema_constraint({"type": "object"}, what)


def gbnf_constraint(text: str, what: str = "grammar") -> ConstraintSpec:
    """A GBNF grammar as llama-server's `grammar` field takes it (root rule `root`), or Lark text
    starting with `%llguidance`."""
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError(f"'{what}' must be a non-empty grammar string")
    llg = _llg()
    try:
        if text.lstrip().startswith("%llguidance"):
            grammar = llg.LLMatcher.grammar_from_lark(text)
        else:
            grammar = llg.grammar_from("gbnf", text)
    except ValueError as exc:
        raise ConstraintError(f"'{what}' cannot be parsed: {exc}") from None
    return ConstraintSpec(_check(grammar, what), what=what)


def _lark_string(s: str) -> str:
    return json.dumps(s)          # a Lark string literal is a JSON string


def closed(schema):
    """The schema with every object that lists `properties` but says nothing of other keys
    (`additionalProperties`, `patternProperties`) closed to them, as llama.cpp's schema-to-grammar
    converter reads such objects: a tool's arguments are the keys it names. Without this a small
    model can invent keys forever (`"city": "Paris", "country": ..., "time": ...`) and never close
    the call. Branches of `allOf` stay as they are (each names only part of the keys), and so does
    a `not` (closing what it excludes would let more through)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: closed(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and "patternProperties" not in out and "allOf" not in out:
            out["additionalProperties"] = False
    for key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties"):
        if key in out and isinstance(out[key], (dict, list)):
            out[key] = closed(out[key])
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    return out


def _params(fn: dict) -> dict:
    return closed(fn.get("parameters") or {"type": "object", "properties": {}})


def _call_schema(tool: dict, strict: bool) -> dict:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": _params(fn)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tag(text: str, token_id: int | None) -> str:
    """A tag written out or as its one special token (Qwen's vocabulary has both)."""
    lit = _lark_string(text)
    return f"({lit} | <[{token_id}]>)" if token_id is not None else lit


def tool_call_constraint(tools: list[dict], mode, token_id=None, response: ConstraintSpec | None = None,
                         response_schema: dict | None = None, parallel: bool = True) -> ConstraintSpec:
    """Tool calls in the `<tool_call>` format with arguments that follow each tool's schema.

    mode: "auto" (lazy: text until `<tool_call>`, then calls; with `response_schema` the reply is
    either that JSON or calls), True ("required": the prompt already ends with `<tool_call>\\n`)
    or a function name (named: the prompt ends with `{"name": "f", "arguments": `), or "open"
    (a call is required but the prompt did not start it: the reply opens the first block).
    `token_id(text)` gives the id of a single token spelling `text`, or None. parallel: more
    calls may follow the first (OpenAI's parallel_tool_calls); False: the reply ends after one."""
    token_id = token_id or (lambda text: None)
    strict_all = all(bool(t.get("function", {}).get("strict")) for t in tools)
    opts = _json_options(strict_all)

    def js(schema):          # a %json block with our JSON options
        return json.dumps({**schema, "x-guidance": opts})
    open_tag = _tag(TOOL_CALL_START, token_id(TOOL_CALL_START))
    close_tag = _tag(TOOL_CALL_END, token_id(TOOL_CALL_END))
    head = "%llguidance {}\n\n"
    common = 'WS: /[ \\t\\n]{0,4}/\n'
    more = " more" if parallel else ""
    if parallel:
        common += f"more: (WS {open_tag} call)*\n"
    if isinstance(mode, str) and mode not in ("auto", "open"):
        tool = next((t for t in tools if t["function"]["name"] == mode), None)
        if tool is None:
            raise ConstraintError(f"'tool_choice' names {mode!r}, which is not one of the tools")
        params = _params(tool["function"])
        lark = head + (f"start: %json {js(params)} WS \"}}\" WS {close_tag}\n"
                       f'WS: /[ \\t\\n]{{0,4}}/\n')
        trigger = None
    else:
        calls = {"anyOf": [_call_schema(t, strict_all) for t in tools]}
        body = f"call: WS %json {js(calls)} WS {close_tag}\n" + common
        if mode == "auto" and response_schema is not None:
            lark = head + f"start: %json {js(response_schema)} | {open_tag} call{more}\n" + body
            trigger = None
        elif mode == "auto":
            lark = head + f"start: call{more}\n" + body
            trigger = TOOL_CALL_START
        elif mode == "open":              # a call is required and nothing opened it yet
            lark = head + f"start: WS {open_tag} call{more}\n" + body
            trigger = None
        else:                             # required: the prompt opened the first block
            lark = head + f"start: call{more}\n" + body
            trigger = None
    llg = _llg()
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    return ConstraintSpec(_check(grammar, "tools"), trigger=trigger, what="tools")


# --- the vocabulary -------------------------------------------------------------------------------
_VOCABS: dict[int, tuple[object, object]] = {}
_VOCAB_LOCK = threading.Lock()


class _Encoder:
    """What llguidance.TokenizerWrapper reads: tokens (bytes per id), eos/bos, an encoder."""

    def __init__(self, tokenizer, tokens: list[bytes], eos: int):
        self._tok = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text):
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")   # TypeError tells the wrapper to pass str
        return self._tok.encode(text)


def vocab_tokens(tokenizer) -> list[bytes]:
    """Each id's bytes for llguidance; special tokens prefixed with 0xFF."""
    out = []
    for i in range(tokenizer.vocab_size):
        piece, kind = tokenizer.token_to_piece(i), tokenizer.token_type(i)
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) or (
                kind == TOKEN_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        out.append(piece)
    return out


def end_id(tokenizer) -> int:
    """The token llguidance treats as the end: EOS, else the first end-of-generation id."""
    if tokenizer.eos_id is not None:
        return tokenizer.eos_id
    if tokenizer.eot_ids:
        return min(tokenizer.eot_ids)
    raise ConstraintError("constrained output needs an end-of-generation token; this vocabulary has none")


def prepare(tokenizer) -> None:
    """Build the vocabulary now (at load) rather than on the first constrained request."""
    ll_tokenizer(tokenizer)


def ll_tokenizer(tokenizer):
    """llguidance's LLTokenizer for one of our tokenizers (built once, then cached)."""
    with _VOCAB_LOCK:
        hit = _VOCABS.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        llg = _llg()
        enc = _Encoder(tokenizer, vocab_tokens(tokenizer), end_id(tokenizer))
        # llguidance's JSON slices: Gemma 3's 262k tokens build in ~8 s on a busy 2-core machine
        # (the general slices: ~19 s; none: ~3 s but masks twice as slow), masks ~0.2 ms
        lt = llg.LLTokenizer(llg.TokenizerWrapper(enc), n_vocab=tokenizer.vocab_size,
                             slices=llg.LLTokenizer.json_slices())
        if len(_VOCABS) >= 4:
            _VOCABS.clear()
        _VOCABS[id(tokenizer)] = (tokenizer, lt)
        return lt


# --- per request ----------------------------------------------------------------------------------
class Constraint:
    """One request's matcher and its mask (see the module docstring)."""

    def __init__(self, tokenizer, spec: ConstraintSpec, matcher, vocab_size: int):
        self.spec = spec
        self._tok = tokenizer
        self._m = matcher
        self.vocab_size = vocab_size
        self.words = np.zeros((vocab_size + 31) // 32, np.int32)   # the mask of the next token
        self._eot = np.array(sorted(t for t in tokenizer.eot_ids if t < vocab_size), np.int64)
        self._end = end_id(tokenizer)
        self.active = spec.trigger is None
        self.failed = False          # the matcher refused a token: unconstrained from then on
        self._seen = b""             # lazy: generated bytes, until the trigger shows up

    @classmethod
    def start(cls, tokenizer, spec: ConstraintSpec, vocab_size: int | None = None) -> "Constraint":
        llg = _llg()
        lt = ll_tokenizer(tokenizer)
        m = llg.LLMatcher(lt, spec.grammar, log_level=0)
        if m.is_error():
            raise ConstraintError(f"'{spec.what}' cannot be compiled: {m.get_error().strip()}")
        return cls(tokenizer, spec, m, vocab_size or tokenizer.vocab_size)

    @property
    def constraining(self) -> bool:
        return self.active and not self.failed

    def fill(self, out: np.ndarray | None = None) -> np.ndarray | None:
        """The bitmask (int32 words, bit i % 32 of word i // 32) of the tokens allowed next, or
        None when this step is not constrained. `out`: an int32 array of the same length to
        write it to (a GPU upload's pinned buffer) instead of self.words."""
        if not self.constraining:
            return None
        w = self.words if out is None else out
        if w.dtype != np.int32 or w.shape != self.words.shape or not w.flags.c_contiguous:
            raise ValueError(f"mask buffer must be a contiguous int32[{self.words.size}] array")
        self._m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        if self._m.is_error():
            return self._fail(self._m.get_error())
        end = self._end
        if (w[end >> 5] >> (end & 31)) & 1:         # the grammar may end: any EOG token ends it
            wv = w.view(np.uint32)
            for t in self._eot:
                wv[t >> 5] |= np.uint32(1 << (int(t) & 31))
        return w

    def allowed(self) -> np.ndarray | None:
        """fill() as a bool array over the vocabulary (the host sampler's form)."""
        w = self.fill()
        if w is None:
            return None
        return np.unpackbits(w.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def accept(self, token: int) -> None:
        """The sampled token (an end-of-generation token needs no accepting: generation stops)."""
        if self.failed or token in self._tok.eot_ids:
            return
        if not self.active:
            self._seen += self._tok.token_to_piece(token)
            at = self._seen.find(self.spec.trigger.encode())
            if at < 0:
                self._seen = self._seen[-64:]
                return
            self.active = True
            tail = self._seen[at + len(self.spec.trigger):]
            self._seen = b""
            if tail:
                ids = ll_tokenizer(self._tok).tokenize_bytes(tail)
                if not self._m.consume_tokens(ids):
                    self._fail(f"the text after the trigger does not fit: {self._m.get_error()}")
            return
        if not self._m.consume_token(int(token)):
            self._fail(self._m.get_error())

    def _fail(self, why: str) -> None:
        log.warning("constrained output: the matcher stopped (%s); the rest is unconstrained", why)
        self.failed = True
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end."""
        return self.constraining and self._m.is_stopped()
