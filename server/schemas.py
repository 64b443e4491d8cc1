"""Request bodies -> typed, validated parameters: the fields every generation route shares.

What it does
- Parses a body as strict UTF-8 JSON (no NaN/Infinity literals, bounded nesting) into a dict
  (json_body.py; `parse_json_body` is reached through here).
- Reads each field llama-server's OpenAI routes accept, checks its type and range, and builds
  the engine's `SamplingParams` plus the rest of a generation request (`GenerationFields`).
  Every failure is an `ApiError(400, invalid_request_error)` whose message names the field -
  never an `assert`. Messages speak JSON (null, object, array, string, number, boolean) and
  show an offending value through engine/chat.py's `show_json`: a scalar as JSON, cut to about
  64 characters, a container by its type only, so an error never echoes a megabyte string or a
  300-digit number back.
- Accepts llama-server's spellings: max_tokens / max_completion_tokens / n_predict (n_predict
  wins, then max_completion_tokens), stop as a string or a list, logit_bias as an object
  ({"15043": -100} or {"text": bias}) or a list ([[15043, -100], ["text", false]]), seed -1
  (or 0xFFFFFFFF) for a random seed, top_k <= 0 for "off".
- The scalar readers (get_bool, get_int, ...) are shared by every route's own fields.

What it deliberately does not do
- Chat messages, tools and template variables: chat_request.py. Completion prompts and token
  ids: completion_request.py. Both build on the readers and `parse_generation` here.
- Output constraints and logprobs: server/constraints.py reads them into GenerationFields.
- Unknown fields are ignored, as llama-server ignores them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from genie_rt.engine.chat import json_kind
from genie_rt.engine.chat import show_json as _show
from genie_rt.engine.sampling import SamplingParams, requested_top_k

from .errors import bad_request

MAX_INT32 = (1 << 31) - 1
MAX_STOP_STRINGS = 64          # per request, after dropping empty strings
MAX_STOP_CHARS = 512           # per stop string
MAX_LOGIT_BIAS_ABS = 1e9       # |bias|; `false` means "ban" (-inf)
MAX_CHOICES = 16               # n / n_cmpl: replies are generated one after another
MAX_LOGIT_BIAS = 4096          # entries (after text keys are tokenized); the sampler loops over them
RANDOM_SEED = 0xFFFFFFFF       # llama.cpp's LLAMA_DEFAULT_SEED: "pick one at random"
_INT_KEY = re.compile(r"-?\d+")
_CONVERSATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


# --- JSON (json_body.py: strict UTF-8 JSON, bounded nesting, long integers named by field) -------
from .json_body import MAX_JSON_DEPTH, parse_json_body  # noqa: E402,F401  (schemas.parse_json_body)


def _kind(v: Any) -> str:
    """'null', 'a boolean', 'an array', ...: a value's JSON type for error messages."""
    k = json_kind(v)
    return k if k == "null" else ("an " if k[0] in "aeiou" else "a ") + k


# --- scalar fields ------------------------------------------------------------------------------
def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_kind(v)}")
    return v


def get_int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{name}' must be an integer, got {_kind(v)}")
    shown = v
    if isinstance(v, float):
        if not math.isfinite(v) or not v.is_integer():
            raise bad_request(f"'{name}' must be an integer, got {_show(v)}")
        v = int(v)
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {_show(shown)}")
    return v


def get_float(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{name}' must be a number, got {_kind(v)}")
    v = float(v) if abs(v) < 1e308 else math.inf
    if not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number")
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo:g} and {hi:g}, got {v:g}")
    return v


def get_str(body: dict, name: str, default: str | None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {_kind(v)}")
    return v


def get_object(body: dict, name: str) -> dict:
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request(f"'{name}' must be an object, got {_kind(v)}")
    return v


# --- composite fields ---------------------------------------------------------------------------
def parse_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list):
        raise bad_request(f"'stop' must be a string or an array of strings, got {_kind(v)}")
    out: list[str] = []
    seen: set[str] = set()
    for k, w in enumerate(words):
        if not isinstance(w, str):
            raise bad_request(f"'stop[{k}]' must be a string, got {_kind(w)}")
        if len(w) > MAX_STOP_CHARS:
            raise bad_request(f"'stop[{k}]' is {len(w)} characters long; the limit is {MAX_STOP_CHARS}")
        if w and w not in seen:
            if len(out) == MAX_STOP_STRINGS:      # refuse at once: this runs on the event loop
                raise bad_request(f"'stop' has more than {MAX_STOP_STRINGS} distinct strings; "
                                  f"the limit is {MAX_STOP_STRINGS}")
            seen.add(w)
            out.append(w)
    return out


def parse_logit_bias(body: dict, vocab_size: int, tokenize: Callable[[str], list[int]]) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = []
        for k, pair in enumerate(v):
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad_request(f"'logit_bias[{k}]' must be a [token, bias] pair")
            items.append((pair[0], pair[1]))
    else:
        raise bad_request(f"'logit_bias' must be an object or an array of [token, bias] pairs, got {_kind(v)}")
    if len(items) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(items)} entries; the limit is {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in items:
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_request(f"'logit_bias' value for {_show(key)} must be a number or false, got {_kind(bias)}")
        else:
            bias = float(bias) if abs(bias) < 1e308 else math.inf
            if not abs(bias) <= MAX_LOGIT_BIAS_ABS:
                raise bad_request(f"'logit_bias' value for {_show(key)} must be between "
                                  f"-{MAX_LOGIT_BIAS_ABS:g} and {MAX_LOGIT_BIAS_ABS:g}")
        if isinstance(key, bool):
            raise bad_request("'logit_bias' keys must be token ids or text")
        if isinstance(key, str) and _INT_KEY.fullmatch(key.strip()):
            digits = key.strip()
            if len(digits.lstrip("-")) > 12:      # no vocabulary is that large: don't parse it
                raise bad_request(f"'logit_bias' token id {_show(digits)} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})")
            key = int(digits)
        if isinstance(key, int):
            if not 0 <= key < vocab_size:
                raise bad_request(f"'logit_bias' token id {_show(key)} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})")
            out[key] = bias
        elif isinstance(key, str):  # llama-server: a text key biases each of its tokens
            for tok in tokenize(key):
                out[tok] = bias
        else:
            raise bad_request(f"'logit_bias' keys must be token ids or text, got {_kind(key)}")
    if len(out) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' covers {len(out)} tokens; the limit is {MAX_LOGIT_BIAS}")
    return out


def parse_conversation_id(body: dict) -> str | None:
    cid = get_str(body, "conversation_id", None)
    if cid is None:
        return None
    try:
        from genie_rt.kvcache.persist import InvalidConversationId, validate_conversation_id
    except ImportError:  # persistence not installed yet: apply the documented rule here
        if not _CONVERSATION_ID.fullmatch(cid):
            raise bad_request("'conversation_id' must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'") from None
        return cid
    try:
        validate_conversation_id(cid)
    except (InvalidConversationId, ValueError) as e:
        raise bad_request(f"'conversation_id': {e}") from None
    return cid


def parse_n(body: dict) -> int:
    """Choices per prompt: OpenAI's `n`, llama-server's `n_cmpl` (which wins), 1 .. MAX_CHOICES.
    The engine writes them one after another from one prefill, so each costs a whole reply's
    time on a device that decodes one sequence: hence the bound, far below OpenAI's 128."""
    n = get_int(body, "n", 1, 1, MAX_CHOICES)
    return get_int(body, "n_cmpl", n, 1, MAX_CHOICES)


# --- requests -------------------------------------------------------------------------------------
@dataclass
class GenerationFields:
    """What /v1/chat/completions and /v1/completions share."""
    params: SamplingParams
    max_tokens: int | None                 # None: until a stop or the end of the context
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    conversation_id: str | None
    constraint: Any = None                 # engine/constrain.py ConstraintSpec (server/constraints.py)
    response_schema: dict | None = None    # the JSON schema behind `constraint`, if it is one
    logprobs: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    n: int = 1                             # choices: replies to the one prompt, from one prefill (n / n_cmpl)
    return_progress: bool = False          # llama-server: prompt_progress chunks while streaming
    timings_per_token: bool = False        # llama-server: timings on every streamed chunk



def _default_params(defaults) -> tuple[SamplingParams, int, int]:
    """(sampling defaults, top_k as given, server n_predict) of the server's launch flags."""
    if defaults is None:
        return SamplingParams(), 40, -1
    return defaults.params, defaults.top_k, defaults.n_predict


def parse_generation(body: dict, vocab_size: int, tokenize: Callable[[str], list[int]],
                     defaults=None, chat: bool = False) -> GenerationFields:
    """The fields every generation route shares. `defaults` (state.RequestDefaults) are what
    the server was started with (--temp, --seed, -n, ...). The constrained-decoding fields
    (response_format, grammar, json_schema) and logprobs are read by server/constraints.py."""
    from .constraints import parse_output, parse_probs
    d, d_top_k, server_n_predict = _default_params(defaults)
    get_str(body, "model", None)  # any model name is accepted (one model per server), but it is a string
    max_tokens = get_int(body, "max_tokens", -1, -1, MAX_INT32)
    max_tokens = get_int(body, "max_completion_tokens", max_tokens, -1, MAX_INT32)
    max_tokens = get_int(body, "n_predict", max_tokens, -1, MAX_INT32)
    if server_n_predict is not None and server_n_predict >= 0:   # llama-server: -n caps every request
        max_tokens = server_n_predict if max_tokens < 0 else min(max_tokens, server_n_predict)

    default_seed = -1 if d.seed is None else d.seed
    seed = get_int(body, "seed", default_seed, -(1 << 63), (1 << 64) - 1)
    top_k = get_int(body, "top_k", d_top_k, -MAX_INT32, MAX_INT32)
    repeat_penalty = get_float(body, "repeat_penalty", d.repeat_penalty, 0.0, 100.0)
    params = SamplingParams(
        temperature=get_float(body, "temperature", d.temperature, 0.0, 100.0),
        top_k=requested_top_k(top_k, vocab_size),
        top_p=get_float(body, "top_p", d.top_p, 0.0, 1.0),
        min_p=get_float(body, "min_p", d.min_p, 0.0, 1.0),
        seed=None if seed < 0 or seed == RANDOM_SEED else seed,
        repeat_penalty=repeat_penalty if repeat_penalty > 0 else 1.0,  # 0 means "off", never divide by 0
        repeat_last_n=get_int(body, "repeat_last_n", d.repeat_last_n, -1, MAX_INT32),
        presence_penalty=get_float(body, "presence_penalty", d.presence_penalty, -100.0, 100.0),
        frequency_penalty=get_float(body, "frequency_penalty", d.frequency_penalty, -100.0, 100.0),
        logit_bias=parse_logit_bias(body, vocab_size, tokenize),
    )
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise bad_request(str(e)) from None

    stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options")
    include_usage = get_bool(options, "include_usage", False)
    logprobs, n_probs, post = parse_probs(body, chat)
    constraint, schema = parse_output(body)
    return GenerationFields(params=params, max_tokens=None if max_tokens < 0 else max_tokens,
                            stop=parse_stop(body), ignore_eos=get_bool(body, "ignore_eos", False),
                            stream=stream, include_usage=include_usage,
                            conversation_id=parse_conversation_id(body), constraint=constraint,
                            response_schema=schema, logprobs=logprobs, n_probs=n_probs,
                            post_sampling_probs=post, n=parse_n(body),
                            return_progress=get_bool(body, "return_progress", False),
                            timings_per_token=get_bool(body, "timings_per_token", False))
