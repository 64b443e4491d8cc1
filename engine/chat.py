"""Chat templates from GGUF metadata, and parsers for what a chat model writes back.

What it does
- `ChatTemplate` renders OpenAI-style messages with the model's own Jinja template
  (`tokenizer.chat_template`) the way HF transformers' apply_chat_template and llama.cpp's
  `--jinja` do: an ImmutableSandboxedEnvironment with trim_blocks/lstrip_blocks, loop controls,
  `tojson` (ensure_ascii=False; indent/separators/sort_keys), `raise_exception`, `strftime_now`,
  `{% generation %}` blocks, `bos_token`/`eos_token`, `tools`, `add_generation_prompt` and any
  extra keyword (`enable_thinking`, ...).
- Validates and normalises messages first (roles, content as str / None / text parts, tool
  calls); every problem, in the messages or in the template, is a `ChatTemplateError` (a
  ValueError: the server answers HTTP 400) that says which message and field, or which line.
- Falls back to a built-in ChatML template (`CHATML_TEMPLATE`, `is_builtin`) when the GGUF has
  none.
- `split_reasoning` and `parse_tool_calls` turn Qwen3-style output (`<think>...</think>`,
  `<tool_call>{json}</tool_call>`) into reasoning, content and tool calls; both are pure functions
  of the text so far, never raise on model output, and with `partial=True` hold back a tag that
  is still being written, so a streaming server can send the difference between two calls.

What it deliberately does not do
- Images, audio or any non-text content part: refused with a clear error (text-only engine).
- Tokenization (engine/tokenizer.py) or choosing stop tokens; tool-call formats other than
  Qwen/Hermes `<tool_call>` JSON; JSON-schema validation of tool arguments.
- Executing templates outside the sandbox: a GGUF's template is untrusted input.
"""
from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_fallback import CHATML_TEMPLATE, PLAIN_STOP, PLAIN_TEMPLATE  # noqa: F401 (CHATML_TEMPLATE re-exported)

ROLES = ("system", "user", "assistant", "tool")

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that cannot be compiled or run."""


class _RaisedByTemplate(jinja2.TemplateError):
    """raise_exception(...) called by the template itself."""


# --- Jinja environment (what HF transformers' _compile_jinja_template sets up) ----------------
def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _template_line(exc: BaseException) -> int | None:
    """Line of the template source where a render error happened (Jinja rewrites tracebacks
    so template frames carry the template's file name and line numbers)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# --- message validation ------------------------------------------------------------------------
def _content_text(content: Any, where: str) -> str:
    """A message's content as one string: str as is, text parts joined by newlines (as
    llama.cpp does for templates without typed content)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ChatTemplateError(f"{where}[{k}] must be an object, got {type(part).__name__}")
            kind = part.get("type")
            if kind != "text":
                raise ChatTemplateError(f"{where}[{k}] has type {kind!r}: only text content parts "
                                        "are supported (this model is text-only)")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"{where}[{k}].text must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise ChatTemplateError(f"{where} must be a string, null or a list of text parts, "
                            f"got {type(content).__name__}")


def json_kind(v: Any) -> str:
    """The JSON type of a value, for error messages (never Python's type names)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, Mapping):
        return "object"
    if isinstance(v, Sequence):
        return "array"
    return type(v).__name__


MAX_SHOWN_CHARS = 64           # an offending value quoted in an error message is cut to about this


def show_json(v: Any) -> str:
    """An offending value for an error message (here and in server/schemas.py): null / true /
    false, a number or a string as JSON cut to about MAX_SHOWN_CHARS characters (with '...'
    and the full length), an object or an array by its type only."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        try:
            text = str(v)
        except ValueError:               # longer than Python will print
            return "an integer with thousands of digits"
        if len(text) <= MAX_SHOWN_CHARS:
            return text
        return f"{text[:24]}... (an integer of {len(text.lstrip('-'))} digits)"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("Infinity" if v > 0 else "-Infinity" if v < 0 else "NaN")
    if isinstance(v, str):
        if len(v) <= MAX_SHOWN_CHARS:
            return json.dumps(v, ensure_ascii=False)
        return json.dumps(v[:MAX_SHOWN_CHARS], ensure_ascii=False)[:-1] + f'..." ({len(v)} characters)'
    k = json_kind(v)
    return ("an " if k[0] in "aeiou" else "a ") + k


def decode_tool_arguments(args: str, where: str) -> dict:
    """A tool call's `arguments` string as the JSON object it must encode ("" or blanks: {}).
    Raises ChatTemplateError naming `where` (e.g. messages[1].tool_calls[0].function.arguments)."""
    if not args.strip():
        return {}
    try:
        decoded = json.loads(args)
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{where} is not valid JSON: {e}") from None
    except (ValueError, RecursionError):      # integers too long to convert, nesting too deep
        raise ChatTemplateError(f"{where} is not valid JSON") from None
    if not isinstance(decoded, dict):
        raise ChatTemplateError(f"{where} must encode a JSON object, got {show_json(decoded)}")
    return decoded


def _normalize_tool_call(call: Any, where: str, object_arguments: bool) -> dict:
    if not isinstance(call, Mapping):
        raise ChatTemplateError(f"{where} must be an object, got {json_kind(call)}")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise ChatTemplateError(f"{where}.function must be an object with name and arguments, "
                                f"got {json_kind(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ChatTemplateError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        if object_arguments:  # template writes `arguments | tojson`: give it the object
            args = decode_tool_arguments(args, f"{where}.function.arguments")
    elif isinstance(args, Mapping):
        args = dict(args)
    else:
        raise ChatTemplateError(f"{where}.function.arguments must be a JSON string or an object, "
                                f"got {json_kind(args)}")
    out = {k: v for k, v in call.items() if k != "function"}
    out.setdefault("type", "function")
    out["function"] = {**fn, "name": name, "arguments": args}
    return out


def validate_tool_call(call: Any, where: str) -> None:
    """Check one assistant tool call strictly: a function object with a non-empty name and
    arguments that are an object or a string encoding one (what docs/server.md promises,
    whatever the template does with them). Raises ChatTemplateError naming `where`."""
    _normalize_tool_call(call, where, object_arguments=True)


def normalize_messages(messages: Any, *, object_arguments: bool = False) -> list[dict]:
    """Validated copies of `messages`: content always a string (None -> "", as llama.cpp passes
    it), tool calls as {"type", "function": {"name", "arguments"}}. Unknown keys are kept.
    Raises ChatTemplateError naming the message index and field."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}")
        m = dict(msg)
        calls = msg.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ChatTemplateError(f"{where}.tool_calls is only allowed on assistant messages")
            if not isinstance(calls, list):
                raise ChatTemplateError(f"{where}.tool_calls must be a list")
            m["tool_calls"] = [_normalize_tool_call(c, f"{where}.tool_calls[{k}]", object_arguments)
                               for k, c in enumerate(calls)]
            if not m["tool_calls"]:
                del m["tool_calls"]
        content = msg.get("content")
        if content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise ChatTemplateError(f"{where}.content is missing or null; only an assistant "
                                        "message with tool_calls may omit it")
            m["content"] = ""
        else:
            m["content"] = _content_text(content, f"{where}.content")
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatTemplateError(f"{where}.reasoning_content must be a string or null")
        for key in ("name", "tool_call_id"):
            if key in msg and msg[key] is not None and not isinstance(msg[key], str):
                raise ChatTemplateError(f"{where}.{key} must be a string")
        out.append(m)
    return out


def validate_tools(tools: Any) -> list[dict] | None:
    """`tools` as the template gets it (unchanged), after checking each entry is an OpenAI
    function tool: {"type": "function", "function": {"name": non-empty string, "description":
    string, "parameters": object}} ("type" absent or null is read as "function"; description and
    parameters may be absent). As llama-server, any other tool type is refused ("Unsupported tool
    type"), as is a tool without a function. Raises ChatTemplateError naming tools[k]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatTemplateError(f"tools must be a list of tool definitions, got {json_kind(tools)}")
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"{where} must be an object, got {json_kind(tool)}")
        kind = tool.get("type")
        if kind is not None and kind != "function":
            raise ChatTemplateError(f"{where}.type is {show_json(kind)}: unsupported tool type; "
                                    'only "function" tools are supported')
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ChatTemplateError(f"{where}.function must be an object with a string name "
                                    f"(missing tool function), got {json_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError(f"{where}.function.name must be a non-empty string, got {show_json(name)}")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ChatTemplateError(f"{where}.function.description must be a string, got {json_kind(description)}")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ChatTemplateError(f"{where}.function.parameters must be a JSON Schema object, "
                                    f"got {json_kind(parameters)}")
    return tools


# --- the template ------------------------------------------------------------------------------
class ChatTemplate:
    """One compiled chat template. Immutable; render() is thread-safe."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 add_bos: bool = False, is_builtin: bool = False, origin: str = "template",
                 stop_strings: tuple[str, ...] = ()):
        """origin names where `source` came from, for error messages (a GGUF key); stop_strings
        end a chat reply besides EOS (the plain fallback's next "User:" line)."""
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{origin} is empty")
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{origin} is not valid Jinja (line {e.lineno}): {e.message}") from e
        self._source = source
        self._bos_token, self._eos_token = bos_token, eos_token
        self._add_bos = add_bos
        self._is_builtin = is_builtin
        self._origin = origin
        self._stop_strings = tuple(stop_strings)
        self._requires_object_arguments = self._probe_requires_object_arguments()

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, name: str | None = None) -> ChatTemplate:
        """The GGUF's `tokenizer.chat_template` (or `tokenizer.chat_template.<name>`), with BOS/EOS
        text from its vocabulary. If there is none: the built-in ChatML template when the
        vocabulary has ChatML's tokens, else the plain transcript (a base model)."""
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token_text(key: str) -> str:
            i = meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        bos, eos = token_text("tokenizer.ggml.bos_token_id"), token_text("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        source = meta.get(key)
        if source is None:
            if name:
                raise ChatTemplateError(f"GGUF has no {key}")
            if tokens and "<|im_start|>" not in tokens:
                return cls.plain(bos_token=bos, eos_token=eos, add_bos=add_bos)
            return cls.chatml(bos_token=bos, eos_token=eos, add_bos=add_bos)
        if not isinstance(source, str):
            raise ChatTemplateError(f"{key} must be a string, got {type(source).__name__}")
        return cls(source, bos_token=bos, eos_token=eos, add_bos=add_bos, origin=f"GGUF {key}")

    @classmethod
    def chatml(cls, *, bos_token: str = "", eos_token: str = "", add_bos: bool = False) -> ChatTemplate:
        """The built-in ChatML template."""
        return cls(CHATML_TEMPLATE, bos_token=bos_token, eos_token=eos_token, add_bos=add_bos,
                   is_builtin=True, origin="built-in ChatML template")

    @classmethod
    def plain(cls, *, bos_token: str = "", eos_token: str = "", add_bos: bool = False) -> ChatTemplate:
        """The built-in plain transcript for base models ("User: ..." / "Assistant:")."""
        return cls(PLAIN_TEMPLATE, bos_token=bos_token, eos_token=eos_token, add_bos=add_bos,
                   is_builtin=True, origin="built-in plain transcript template", stop_strings=PLAIN_STOP)

    @property
    def is_plain(self) -> bool:
        """True for the plain transcript fallback: the model is a base model (`run` gives it
        the prompt as raw text)."""
        return self._source == PLAIN_TEMPLATE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a chat reply besides EOS (empty for a GGUF's own template)."""
        return self._stop_strings

    @property
    def source(self) -> str:
        return self._source

    @property
    def is_builtin(self) -> bool:
        """True when the GGUF had no template and a built-in one (ChatML or plain) is used."""
        return self._is_builtin

    @property
    def bos_token(self) -> str:
        return self._bos_token

    @property
    def eos_token(self) -> str:
        return self._eos_token

    @property
    def requires_object_arguments(self) -> bool:
        """True when the template writes tool-call arguments with `| tojson` (Qwen2.5 style), so
        JSON-string arguments from an OpenAI client are decoded to objects before rendering
        (llama.cpp does the same probe). Templates that print strings verbatim (Qwen3) get them
        as sent, which reproduces the model's own tokens."""
        return self._requires_object_arguments

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages`. Extra keywords (enable_thinking, ...) reach the
        template as variables. If the GGUF adds BOS itself (add_bos_token) and the template also
        starts with the BOS text, that leading copy is removed (as llama.cpp does), so the
        caller always encodes with add_special=True, parse_special=True."""
        msgs = normalize_messages(messages, object_arguments=self._requires_object_arguments)
        text = self._render(msgs, validate_tools(tools), add_generation_prompt, kwargs)
        if self._add_bos and self._bos_token and text.startswith(self._bos_token):
            text = text[len(self._bos_token):]
        return text

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                kwargs: Mapping[str, Any]) -> str:
        context = {"bos_token": self._bos_token, "eos_token": self._eos_token, **kwargs,
                   "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except _RaisedByTemplate as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e.message}") from e
        except Exception as e:  # the template is untrusted code: any failure is a bad request
            line = _template_line(e)
            at = f" at line {line}" if line is not None else ""
            raise ChatTemplateError(f"{self._origin} failed{at}: {type(e).__name__}: {e}") from e

    def _probe_requires_object_arguments(self) -> bool:
        def rendered_with(arguments: Any) -> bool:
            msgs = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"id": "call_0", "type": "function",
                                     "function": {"name": "probe", "arguments": arguments}}]}]
            try:
                out = self._render(msgs, None, False, {})
            except ChatTemplateError:
                return False
            return '"argument_needle":' in out or "'argument_needle':" in out

        needle = {"argument_needle": "print('Hello, World!')"}
        return not rendered_with(json.dumps(needle)) and rendered_with(needle)


# --- parsing model output ----------------------------------------------------------------------
def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, *, partial: bool = False, think_open: bool = False,
                    infer_open: bool = True) -> tuple[str, str]:
    """(reasoning, content) of a reply that may start with `<think>...</think>`.

    think_open: the prompt already opened the block (its generation prompt ends with `<think>`),
    so the reply starts inside it. infer_open (default): a reply with `</think>` but no leading
    `<think>` is read that way too (everything before its first `</think>` is reasoning); a caller
    that knows think_open from the prompt (the server, as llama-server) passes infer_open=False,
    and such a `</think>` is then ordinary content.
    Reasoning is stripped of surrounding whitespace, content of leading whitespace; a reply
    without a block is returned verbatim as content.
    partial=True (streaming): text whose reading can still change is held back - leading
    whitespace and a `<thi` that may still become `<think>`, a tag still being written (`</thi`)
    and, with infer_open and no think_open, all content until a `</think>` or the end (a later
    `</think>` would turn it into reasoning). So every partial result is a prefix of the final
    one, for any cut of the text, and successive results only ever grow at the end.
    Unclosed reasoning at the end of a final reply is returned as reasoning."""
    body = text.lstrip()
    if partial and THINK_START.startswith(body) and body != THINK_START:
        return "", ""  # could still become "<think>" (also when think_open: it is dropped then)
    if body.startswith(THINK_START):
        body = body[len(THINK_START):]
    elif think_open or (infer_open and THINK_END in text):
        body = text  # already inside the block
    else:
        if partial and infer_open:
            return "", ""  # a later "</think>" would make all of it reasoning
        return "", text
    end = body.find(THINK_END)
    if end < 0:
        if partial:
            body = body[:len(body) - _partial_tag_suffix(body, THINK_END)]
        return body.strip(), ""
    return body[:end].strip(), body[end + len(THINK_END):].lstrip()


def _parse_call(body: str) -> dict | None:
    """{"name", "arguments": JSON string} from a tool-call body, or None if malformed."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str, *, partial: bool = False) -> tuple[str, list[dict]]:
    """(content, calls) from a reply with Qwen/Hermes `<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>` blocks; calls are {"name", "arguments": JSON string}. Apply to the
    content part after split_reasoning.

    A block that is not valid JSON with a string name and object arguments stays in the content
    verbatim; nothing here raises. A final unclosed block is accepted if its JSON is complete.
    partial=True (streaming): an unclosed block and a tag still being written are held back;
    content only grows at the end and a call appears once its block is closed.
    Content is stripped of surrounding whitespace."""
    content: list[str] = []
    calls: list[dict] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start < 0:
            tail = text[pos:]
            if partial:
                tail = tail[:len(tail) - _partial_tag_suffix(tail, TOOL_CALL_START)]
            content.append(tail)
            break
        content.append(text[pos:start])
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        if end < 0:  # unclosed block at the end of the text
            if not partial:
                call = _parse_call(text[body_start:].strip())
                if call is not None:
                    calls.append(call)
                else:
                    content.append(text[start:])
            break
        call = _parse_call(text[body_start:end].strip())
        if call is not None:
            calls.append(call)
        else:
            content.append(text[start:end + len(TOOL_CALL_END)])
        pos = end + len(TOOL_CALL_END)
    return "".join(content).strip(), calls
