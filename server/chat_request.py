"""Chat completion requests: messages, tools, tool_choice and template variables, checked.

What it does
- `parse_chat` builds a `ChatRequest`: the shared generation fields (schemas.py
  `parse_generation`), the messages, the tools, the template's keyword arguments (thinking
  through chat_template_kwargs.enable_thinking, `think` or `enable_thinking`), reasoning_format,
  add_generation_prompt / continue_final_message. Every failure is a 400 naming the field.
- Also used alone by /apply-template (info.py) and through parse_chat by the Anthropic and
  Responses translations.

What it deliberately does not do
- Validate messages in depth: engine/chat.py (normalize_messages, the template) does that and
  its ChatTemplateError is a 400 too. `chat_messages` checks only their shape (objects, roles,
  content types, tool calls with JSON arguments) so those messages are bounded; tools are
  checked by engine/chat.py's `validate_tools`, whatever `tool_choice` says.
"""
from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from genie_rt.engine.chat import ChatTemplateError, validate_tool_call, validate_tools
from genie_rt.engine.chat import show_json as _show

from .errors import bad_request
from .schemas import GenerationFields, _kind, get_bool, get_object, get_str, parse_generation

REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")


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
    # parallel_tool_calls: more than one call a reply (None: absent, the template decides; jobs.py)
    parallel_tool_calls: bool | None = None




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
                       parallel_tool_calls=get_bool(body, "parallel_tool_calls", None),
                       parse_reasoning=fmt != "none", template_kwargs=kwargs)


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
