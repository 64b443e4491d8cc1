"""Request bodies -> typed, validated parameters.

What it does
- Parses a body as strict UTF-8 JSON (no NaN/Infinity literals, bounded nesting) into a dict.
- Reads each field llama-server's OpenAI routes accept, checks its type and range, and builds
  the engine's `SamplingParams` plus the rest of a generation request. Every failure is an
  `ApiError(400, invalid_request_error)` whose message names the field - never an `assert`.
  Messages speak JSON (null, object, array, string, number, boolean) and show an offending
  value through engine/chat.py's `show_json`: a scalar as JSON, cut to about 64 characters,
  a container by its type only, so an error never echoes a megabyte string or a 300-digit
  number back.
- Accepts llama-server's spellings: max_tokens / max_completion_tokens / n_predict (n_predict
  wins, then max_completion_tokens), stop as a string or a list, logit_bias as an object
  ({"15043": -100} or {"text": bias}) or a list ([[15043, -100], ["text", false]]), seed -1
  (or 0xFFFFFFFF) for a random seed, top_k <= 0 for "off", thinking through
  chat_template_kwargs.enable_thinking or `think`.

What it deliberately does not do
- Validate messages in depth: engine/chat.py (normalize_messages, the template) does that and
  its ChatTemplateError is a 400 too. `chat_messages` checks only their shape (objects, roles,
  content types, tool calls with JSON arguments) so those messages are bounded; tools are
  checked by engine/chat.py's `validate_tools`, whatever `tool_choice` says.
- Output constraints and logprobs: server/constraints.py reads them into GenerationFields.
- Honour fields that need machinery this engine lacks (echo, suffix, best_of > 1): they are refused
  with a 400 saying so, rather than silently ignored. Unknown fields are ignored, as llama-server ignores them.
"""
from __future__ import annotations

import datetime
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from genie_rt.engine.chat import ChatTemplateError, json_kind, validate_tool_call, validate_tools
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
REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")
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


@dataclass
class ChatRequest:
    gen: GenerationFields
    messages: Any                          # validated by the chat template (engine/chat.py)
    tools: list | None                     # None when absent or tool_choice is "none"
    enable_thinking: bool
    # tool_choice "required" (True) or a named function (its name): the reply must be a call
    forced_tool: bool | str | None
    parse_reasoning: bool                  # reasoning_format != "none"
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True     # false: the last turn is not followed by the assistant's
    verbose: bool = False                  # llama-server's "verbose": the prompt in "__verbose"


@dataclass
class CompletionRequest:
    gen: GenerationFields
    prompt: str | list                     # text, token ids, or a mixed list of both
    return_tokens: bool = False            # /completion: the generated ids in "tokens"
    response_fields: list | None = None    # /completion: only these fields ("a/b": nested)
    batch: list | None = None              # several prompts (each like `prompt`), answered as a list


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


def parse_tool_choice(body: dict, tools: list | None) -> bool | str | None:
    """What parse_tools checked, read: True for "required", the function's name for a named
    function (which must be one of `tools`), None otherwise."""
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return True
    name = choice["function"]["name"]
    names = [t.get("function", {}).get("name") for t in tools]
    if name not in names:
        raise bad_request(f"'tool_choice.function.name' {_show(name)} is not one of the tools "
                          f"({', '.join(_show(n) for n in names[:8])}{', ...' if len(names) > 8 else ''})")
    return name


def parse_tools(body: dict) -> list | None:
    """The tools for the template, or None. Each tool is checked (engine/chat.py validate_tools:
    a function tool with a name, object parameters; llama-server refuses other tool types and
    tools without a function) even when tool_choice is "none" and they are then not used."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"'tools' must be an array, got {_kind(tools)}")
    for k, tool in enumerate(tools or []):   # as llama-server: a tool names its type
        if isinstance(tool, dict) and tool.get("type") is None:
            raise bad_request(f"'tools[{k}].type' is missing: it must be \"function\"")
    try:
        validate_tools(tools)
    except ChatTemplateError as e:
        raise bad_request(str(e)) from None
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "required"):
        pass  # "required": the server starts the reply with a tool-call tag (generation.py)
    elif choice == "none":
        return None
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
    else:
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or a function object")
    return tools or None


def parse_thinking(body: dict, kwargs: dict, default: str = "off") -> bool | None:
    """Whether the template is asked to think: the request's chat_template_kwargs.enable_thinking,
    `think` or `enable_thinking`, else the server's --reasoning (off by default: a home
    assistant answers fast; "on" and "auto": on, as llama-server passes it to the template)."""
    if "enable_thinking" in kwargs and kwargs["enable_thinking"] is not None:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise bad_request("'chat_template_kwargs.enable_thinking' must be a boolean")
        return kwargs["enable_thinking"]
    think = get_bool(body, "think", None)
    if think is not None:
        return think
    flag = get_bool(body, "enable_thinking", None)
    if flag is not None:
        return flag
    return default != "off"          # "on" and "auto" (llama-server: thinking where the template has it)


# Names the template call itself binds: a chat_template_kwargs key with one of them would
# collide with the call's own arguments (a TypeError, not the user's variable).
_RESERVED_TEMPLATE_KWARGS = ("self", "messages", "tools", "add_generation_prompt")


def template_kwargs(body: dict, reasoning_default: str = "off") -> dict:
    """chat_template_kwargs (extra template variables) with enable_thinking resolved
    (parse_thinking; left out when neither the request nor the server decides) and the names
    the renderer binds itself dropped."""
    kwargs = dict(get_object(body, "chat_template_kwargs"))
    # as llama-server: today's date for templates that print it (Llama 3.x: "26 Jul 2024" otherwise)
    kwargs.setdefault("date_string", datetime.date.today().strftime("%d %b %Y"))
    # as llama-server gives firefunction-v2's template: the time, and the tools as indented JSON text
    kwargs.setdefault("datetime", datetime.datetime.now().strftime("%b %d %Y %H:%M:%S GMT"))
    tools = body.get("tools")
    kwargs.setdefault("functions", json.dumps(tools, indent=2, ensure_ascii=False) if tools else "")
    thinking = parse_thinking(body, kwargs, reasoning_default)
    kwargs.pop("enable_thinking", None)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    for reserved in _RESERVED_TEMPLATE_KWARGS:
        kwargs.pop(reserved, None)
    return kwargs


MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer")


def _check_message_shape(i: int, m: Any) -> None:
    """What of messages[i] an error message would otherwise quote unbounded or in Python's
    words: the object itself, its role, its content's type and parts, its tool calls (with
    arguments that must be JSON). The rest (content null only with tool_calls, tool_calls only
    on assistant messages, ...) is the template's check (engine/chat.py normalize_messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object, got {_kind(m)}")
    role = m.get("role")
    if role not in MESSAGE_ROLES:
        got = "it is missing" if role is None else f"got {_show(role)}"
        raise bad_request(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}; {got}")
    content = m.get("content")
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not isinstance(part, dict):
                raise bad_request(f"'{where}.content[{k}]' must be an object, got {_kind(part)}")
            if part.get("type") != "text":
                raise bad_request(f"'{where}.content[{k}].type' is {_show(part.get('type'))}: only text "
                                  "content parts are supported (this model is text-only)")
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string, null or an array of text parts, "
                          f"got {_kind(content)}")
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for k, call in enumerate(calls):
            try:
                validate_tool_call(call, f"{where}.tool_calls[{k}]")
            except ChatTemplateError as e:
                raise bad_request(str(e)) from None
    elif calls is not None:
        raise bad_request(f"'{where}.tool_calls' must be an array, got {_kind(calls)}")


def chat_messages(body: dict):
    """body["messages"] as the template gets it (required; its shape checked here, the rest by
    the template)."""
    if "messages" not in body:
        raise bad_request("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array of message objects, got {_kind(messages)}")
    for i, m in enumerate(messages):
        _check_message_shape(i, m)
    # newer OpenAI clients send "developer" where they mean "system"
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def parse_chat(body: dict, vocab_size: int, tokenize: Callable[[str], list[int]], defaults=None) -> ChatRequest:
    messages = chat_messages(body)
    kwargs = template_kwargs(body, defaults.reasoning if defaults is not None else "off")
    enable_thinking = kwargs.get("enable_thinking") is not False
    fmt = get_str(body, "reasoning_format", defaults.reasoning_format if defaults is not None else "auto")
    if fmt not in REASONING_FORMATS:
        raise bad_request(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, got {_show(fmt)}")
    tools = parse_tools(body)
    add_generation_prompt = generation_prompt_flag(body, messages)
    return ChatRequest(add_generation_prompt=add_generation_prompt, verbose=get_bool(body, "verbose", False),
                       gen=parse_generation(body, vocab_size, tokenize, defaults, chat=True), messages=messages,
                       tools=tools, enable_thinking=enable_thinking,
                       forced_tool=parse_tool_choice(body, tools),
                       parse_reasoning=fmt != "none", template_kwargs=kwargs)


PROMPT_STRING_KEY = "prompt_string"      # llama-server's JSON prompt object {"prompt_string": ...}
MAX_BATCH_PROMPTS = 64


def _prompt_object(value: dict, where: str) -> str:
    if value.get("multimodal_data"):
        raise bad_request(f"'{where}.multimodal_data': images and audio are not supported (a text-only engine)")
    text = value.get(PROMPT_STRING_KEY)
    if not isinstance(text, str):
        raise bad_request(f"'{where}' must have a string '{PROMPT_STRING_KEY}'")
    return text


def _one_prompt(value: Any, vocab_size: int, where: str) -> str | list:
    if isinstance(value, dict):
        value = _prompt_object(value, where)
    if isinstance(value, str):
        if not value:
            raise bad_request(f"'{where}' is empty")
        return value
    if isinstance(value, list):
        if not value:
            raise bad_request(f"'{where}' is empty")
        if any(isinstance(t, (list, dict)) for t in value):
            raise bad_request(f"'{where}' must be a string, an array of token ids, or a mixed array of "
                              "strings and token ids")
        if any(isinstance(t, str) for t in value):  # mixed: strings are tokenized in place, ids checked now
            return [t if isinstance(t, str) else validate_token_id(t, f"{where}[{k}]", vocab_size)
                    for k, t in enumerate(value)]
        return validate_token_ids(value, where, vocab_size)
    raise bad_request(f"'{where}' must be a string or an array of token ids, got {_kind(value)}")


def parse_prompts(value: Any, vocab_size: int) -> list:
    """The prompts of a completion request, as llama-server reads them: a string, a JSON prompt
    object, an array of token ids, a mixed array of strings and token ids (one prompt), or an
    array whose elements are each one of those (several prompts: an array of strings, of
    token-id arrays, of objects)."""
    if isinstance(value, list) and value and (all(isinstance(t, str) for t in value) and len(value) > 1
                                              or any(isinstance(t, (list, dict)) for t in value)):
        if len(value) > MAX_BATCH_PROMPTS:
            raise bad_request(f"'prompt' has {len(value)} prompts; the limit is {MAX_BATCH_PROMPTS}")
        return [_one_prompt(v, vocab_size, f"prompt[{k}]") for k, v in enumerate(value)]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    return [_one_prompt(value, vocab_size, "prompt")]


def generation_prompt_flag(body: dict, messages: list) -> bool:
    """add_generation_prompt (default true) and continue_final_message as llama-server reads them:
    both true is a 400 (continuing the last message and opening a new turn exclude each other);
    a final assistant message is continued either way (a prefill)."""
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = body.get("continue_final_message")
    if cont not in (None, False):
        if add_gen:
            raise bad_request("'add_generation_prompt' and 'continue_final_message' cannot both be true: "
                              "continue the last message (add_generation_prompt: false), or start a new turn")
        if not (messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"):
            raise bad_request("'continue_final_message': the last message is not an assistant message")
    return add_gen


def parse_prompt(value: Any, vocab_size: int) -> str | list:
    """One completion prompt (several: 400)."""
    prompts = parse_prompts(value, vocab_size)
    if len(prompts) != 1:
        raise bad_request("'prompt' must be one prompt here: a string, an array of token ids, or a mixed "
                          "array of strings and token ids")
    return prompts[0]


def validate_token_id(t: Any, where: str, vocab_size: int) -> int:
    """One token id; `where` names it in errors (e.g. 'prompt[3]')."""
    shown = t
    if isinstance(t, float) and t.is_integer():
        t = int(t)
    if isinstance(t, bool) or not isinstance(t, int):
        raise bad_request(f"'{where}' must be an integer token id, got {_kind(t)}")
    if not 0 <= t < vocab_size:
        raise bad_request(f"'{where}' = {_show(shown)} is outside the vocabulary (0..{vocab_size - 1})")
    return t


def validate_token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """An array of token ids named `name`; errors name the element ('tokens[2]')."""
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be an array of token ids, got {_kind(value)}")
    return [validate_token_id(t, f"{name}[{k}]", vocab_size) for k, t in enumerate(value)]


def parse_completion(body: dict, vocab_size: int, tokenize: Callable[[str], list[int]], defaults=None,
                     allow_batch: bool = True) -> CompletionRequest:
    if "prompt" not in body:
        raise bad_request("'prompt' is required")
    if get_bool(body, "echo", False):
        raise bad_request("'echo' is not supported by this server")
    if get_str(body, "suffix", None):
        raise bad_request("'suffix' is not supported by this server")
    if get_int(body, "best_of", 1, 1, MAX_INT32) != 1:
        raise bad_request("'best_of' must be 1")
    prompts = parse_prompts(body["prompt"], vocab_size)
    gen = parse_generation(body, vocab_size, tokenize, defaults)
    return_tokens = get_bool(body, "return_tokens", False)
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise bad_request("'response_fields' must be an array of strings")
    if len(prompts) == 1:
        return CompletionRequest(gen=gen, prompt=prompts[0], return_tokens=return_tokens, response_fields=fields)
    if not allow_batch:
        raise bad_request("several prompts per request are not supported on this route")
    return CompletionRequest(gen=gen, prompt=prompts[0], return_tokens=return_tokens, batch=prompts)
