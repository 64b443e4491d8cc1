"""What a chat template can express, found by rendering probes (llama-server's /props
`chat_template_caps`): whether it shows the model the tools, writes an assistant's tool calls,
writes several of them, and keeps a system message.

    caps = template_caps(template)      # {"supports_tools": bool, ...}; computed once, cached

Each probe renders a tiny conversation with a needle (a name no real template contains) and looks
for it in the output; a template that raises on a probe lacks that capability. The server puts the
result in /props and warns once when a request's tools cannot reach the model (server/jobs.py).

Not here: rendering itself (engine/chat.py), parsing replies.
"""
from __future__ import annotations

from typing import Any

from .chat import ChatTemplateError

_NEEDLE = "caps_needle_tool"
_SYSTEM = "caps needle system text"
_cache: dict[int, tuple[Any, dict]] = {}     # id(template) -> (template, caps): templates are immutable


def _renders(template, messages, tools=None, needle=_NEEDLE, count: int = 1) -> bool:
    try:
        out = template.render(messages, tools=tools, add_generation_prompt=False)
    except (ChatTemplateError, ValueError, TypeError, AttributeError):
        return False
    return out.count(needle) >= count


def template_caps(template) -> dict[str, bool]:
    """The template's capabilities (bools; the names llama-server's /props uses)."""
    hit = _cache.get(id(template))
    if hit is not None and hit[0] is template:
        return hit[1]
    user = {"role": "user", "content": "Hi"}
    tool = {"type": "function", "function": {"name": _NEEDLE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}

    def call(i):
        return {"id": f"call_{i}", "type": "function", "function": {"name": _NEEDLE, "arguments": {"n": i}}}
    one = [user, {"role": "assistant", "content": "", "tool_calls": [call(0)]}]
    two = [user, {"role": "assistant", "content": "", "tool_calls": [call(0), call(1)]}]
    caps = {"supports_tools": _renders(template, [user], [tool]),
            "supports_tool_calls": _renders(template, one),
            "supports_parallel_tool_calls": _renders(template, two, count=2),
            "supports_system_role": _renders(template, [{"role": "system", "content": _SYSTEM}, user],
                                             needle=_SYSTEM)}
    _cache[id(template)] = (template, caps)
    return caps
