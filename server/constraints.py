"""The request fields that constrain output or ask for probabilities -> engine settings.

- Output constraints (engine/constrain.py builds and checks the grammar): OpenAI's
  `response_format` ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}; llama-server's {"type": "json_object", "schema":
  {...}} too), llama-server's `json_schema` (a schema object) and `grammar` (GBNF, or Lark text
  starting `%llguidance`); Ollama's `format` arrives as response_format (ollama.py). At most one
  of them per request. Tools are constrained in jobs.py (the template decides how a forced call
  starts): `tool_constraint`.
- Probabilities: `logprobs` (chat: a boolean, with `top_logprobs` 0..20; /v1/completions: the
  number of alternatives, 0..MAX_N_PROBS) and llama-server's `n_probs` / `post_sampling_probs`.

Every problem is a 400 naming the field; a schema or grammar llguidance cannot compile is a 400
with llguidance's message.
"""
from __future__ import annotations

from genie_rt.engine.constrain import (ConstraintError, ConstraintSpec, gbnf_constraint, json_object_constraint,
                                       json_schema_constraint, tool_call_constraint)

from genie_rt.engine.chat import show_json

from .errors import bad_request

MAX_TOP_LOGPROBS = 20          # OpenAI's limit for top_logprobs
MAX_N_PROBS = 100              # n_probs / completions' logprobs: enough for any client, bounded work


def _int_field(body: dict, name: str, hi: int) -> int:
    v = body.get(name)
    if v is None or v is False:
        return 0
    if v is True:
        return 0
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or not 0 <= v <= hi:
        raise bad_request(f"'{name}' must be an integer in 0..{hi}, got {show_json(v)}")
    return v


def parse_probs(body: dict, chat: bool) -> tuple[bool, int, bool]:
    """(logprobs wanted, alternatives per token, post_sampling_probs)."""
    lp = body.get("logprobs")
    if chat:
        if lp not in (None, True, False):
            raise bad_request("'logprobs' must be a boolean")
        want = bool(lp)
        top = _int_field(body, "top_logprobs", MAX_TOP_LOGPROBS)
        if top and not want:
            raise bad_request("'top_logprobs' needs 'logprobs': true")
    else:
        want = lp not in (None, False)
        top = _int_field(body, "logprobs", MAX_N_PROBS) if lp is not True else 0
    n_probs = _int_field(body, "n_probs", MAX_N_PROBS)
    post = body.get("post_sampling_probs", False)
    if not isinstance(post, bool):
        raise bad_request("'post_sampling_probs' must be a boolean")
    return want or n_probs > 0, max(top, n_probs), post


def _schema_of(fmt: dict) -> tuple[dict | None, bool]:
    kind = fmt.get("type", "text")
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad_request("'response_format.schema' must be a JSON schema object")
        return schema or {"type": "object"}, True
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if js is None and "schema" in fmt:     # llama-server also reads response_format.schema
            js = {"schema": fmt["schema"]}
        if not isinstance(js, dict):
            raise bad_request("'response_format.json_schema' must be an object with a 'schema'")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object")
        strict = js.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise bad_request("'response_format.json_schema.strict' must be a boolean")
        return schema, bool(strict)
    raise bad_request(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", "
                      f"got {show_json(kind)}")


def parse_output(body: dict) -> tuple[ConstraintSpec | None, dict | None]:
    """The output constraint of a request and, when it is a JSON schema, the schema (tools in
    "auto" combine it with calls)."""
    given = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise bad_request("'response_format' must be an object")
        if fmt.get("type", "text") != "text":
            given.append("response_format")
    for name in ("json_schema", "grammar"):
        if body.get(name) not in (None, "", {}):
            given.append(name)
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"use one of {', '.join(repr(g) for g in given)}: they each constrain the whole reply")
    what = given[0]
    try:
        if what == "response_format":
            schema, strict = _schema_of(fmt)
            if schema == {"type": "object"}:
                return json_object_constraint(what), schema
            return json_schema_constraint(schema, what, strict), schema
        if what == "json_schema":
            schema = body["json_schema"]
            if not isinstance(schema, dict):
                raise bad_request("'json_schema' must be a JSON schema object")
            return json_schema_constraint(schema, what), schema
        return gbnf_constraint(body["grammar"], what), None
    except ConstraintError as exc:
        raise bad_request(str(exc)) from None


def tool_constraint(tools: list, mode, tokenizer, response_schema: dict | None,
                    parallel: bool = True) -> ConstraintSpec:
    """Tool-call arguments that follow each tool's `parameters` (see engine/constrain.py); one
    call a reply unless `parallel`."""
    def token_id(text):
        return tokenizer.token_id(text) if tokenizer is not None else None
    try:
        return tool_call_constraint(tools, mode, token_id, response_schema=response_schema, parallel=parallel)
    except ConstraintError as exc:
        raise bad_request(str(exc)) from None
