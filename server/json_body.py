"""Request bodies as strict JSON: bytes -> a dict, or a 400 that says what is wrong.

- strict UTF-8 (the byte offset of a bad sequence is named), an object at the top;
- no NaN / Infinity literals (Python's json reads them, JSON has none);
- nesting at most MAX_JSON_DEPTH levels, checked without recursion;
- an integer literal too long for int() (sys.get_int_max_str_digits) is a 400 naming its field
  ('logit_bias[1][0]'), found by parsing again with a hook only on that error path.

Deliberately not here: what the fields mean (schemas.py).
"""
from __future__ import annotations

import json
import re
import sys
from typing import Any

from genie_rt.engine.chat import MAX_SHOWN_CHARS, json_kind
from genie_rt.engine.chat import show_json as _show

from .errors import bad_request

MAX_JSON_DEPTH = 64
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _kind(v: Any) -> str:
    k = json_kind(v)
    return k if k == "null" else ("an " if k[0] in "aeiou" else "a ") + k


class _NotJSON(ValueError):
    """NaN / Infinity / -Infinity: Python's json reads them, JSON has no such literals."""


def _reject_constant(name: str):
    raise _NotJSON(f"{name} is not valid JSON")


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, iteratively (no recursion on hostile input)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        if isinstance(value, dict):
            stack.extend((v, d + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, d + 1) for v in value)
    return deepest


class _LongInt:
    """Stands in, while parsing, for an integer literal too long for int() (sys.get_int_max_str_digits)."""
    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits


def _field_path(parts: list) -> str:
    """'messages[0].content' from ["messages", 0, "content"]; odd keys are quoted (and cut)."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _IDENT.fullmatch(p) and len(p) <= MAX_SHOWN_CHARS:
            out += f".{p}" if out else p
        else:
            out += f"[{_show(p)}]"
    return out


def _find_long_int(obj: Any) -> tuple[str, int] | None:
    """(path, digits) of the first _LongInt in a parsed body, depth first, without recursion."""
    stack = [(obj, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _LongInt):
            return _field_path(path), value.digits
        if isinstance(value, dict):
            stack.extend((v, path + [k]) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, path + [k]) for k, v in reversed(list(enumerate(value))))
    return None


def _long_integer_error(text: str):
    """The 400 for a body with an integer literal too long to convert, naming its field (only
    on this error path is the body parsed again, with a hook that keeps such literals aside)."""
    def parse_int(literal: str):
        try:
            return int(literal)
        except ValueError:
            return _LongInt(len(literal.lstrip("-")))

    try:
        found = _find_long_int(json.loads(text, parse_constant=_reject_constant, parse_int=parse_int))
    except (ValueError, RecursionError):
        found = None
    limit = sys.get_int_max_str_digits()
    if found is None:
        return bad_request(f"invalid JSON: an integer is longer than {limit} digits")
    where = f"'{found[0]}'" if found[0] else "the request body"
    return bad_request(f"invalid JSON: the integer in {where} has {found[1]} digits; the limit is {limit}")


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("invalid JSON: nested too deeply") from None
    except (json.JSONDecodeError, _NotJSON) as e:
        raise bad_request(f"invalid JSON: {e}") from None
    except ValueError:  # an integer literal too long for Python to convert
        raise _long_integer_error(text) from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_kind(body)}")
    if _depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise bad_request(f"invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    return body


