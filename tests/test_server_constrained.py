"""Constrained output and logprobs through the server's APIs, with the official clients.

The fixture model (random weights, CPU) shows the guarantees that hold whatever a model
prefers: a JSON schema's output parses and validates, a GBNF grammar's output is in its
language, tool calls' arguments match the tool's schema; bad schemas and grammars are 400s
and the next request is unaffected; logprobs come in each API's shape, streamed and not.
SmolLM2-135M-Instruct (tests/models, slow) answers 50 varied prompts with schema-valid JSON.
"""
from __future__ import annotations

import json
import math
import pathlib
import re

import httpx
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import ServerSettings, create_app

from test_server_support import running_server

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

SMOLLM2 = pathlib.Path(__file__).parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
TOOLS = [{"type": "function", "function": {
    "name": "light_set", "description": "Set a light's brightness", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["room", "level"],
                   "properties": {"room": {"enum": ["kitchen", "hall"]},
                                  "level": {"type": "integer", "minimum": 0, "maximum": 100}}}}}]


def check_person(obj) -> None:
    """PERSON's rules, written out (no jsonschema dependency)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "tags"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 20
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b", "c"}


def check_light(args) -> None:
    assert set(args) == {"room", "level"} and args["room"] in ("kitchen", "hall")
    assert isinstance(args["level"], int) and 0 <= args["level"] <= 100


@pytest.fixture(scope="module")
def real(fixture_gguf):
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=512))
    with running_server(create_app(engine, ServerSettings(max_queue=4))) as (base, _, _):
        yield base


def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)


ASK = [{"role": "user", "content": "Make up a person."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(real, temperature):
    r = oai(real).chat.completions.create(
        model="x", messages=ASK, max_tokens=120, temperature=temperature, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    check_person(json.loads(r.choices[0].message.content))


def test_parse_with_pydantic(real):
    class Person(pydantic.BaseModel):
        name: str
        age: int

    r = oai(real).beta.chat.completions.parse(model="x", messages=ASK, max_tokens=200, temperature=0.7,
                                              seed=1, response_format=Person) \
        if hasattr(oai(real), "beta") and hasattr(oai(real).beta.chat.completions, "parse") else \
        oai(real).chat.completions.parse(model="x", messages=ASK, max_tokens=200, temperature=0.7, seed=1,
                                         response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_llama_server_json_schema(real):
    r = oai(real).chat.completions.create(model="x", messages=ASK, max_tokens=60, temperature=0.9, seed=2,
                                          response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                                   # cut by max_tokens: still a JSON object's prefix
        assert r.choices[0].message.content.lstrip().startswith("{")
    out = httpx.post(real + "/completion", json={"prompt": "Person:", "n_predict": 120, "json_schema": PERSON,
                                                 "temperature": 0.8, "seed": 5}, timeout=60).json()
    check_person(json.loads(out["content"]))


def test_gbnf_grammar(real):
    grammar = 'root ::= ("yes" | "no") " " [0-9]{1,3}'
    for seed in range(3):
        out = httpx.post(real + "/completion", json={"prompt": "Answer:", "n_predict": 20, "grammar": grammar,
                                                     "temperature": 1.0, "seed": seed}, timeout=60).json()
        assert re.fullmatch(r"(yes|no) [0-9]{1,3}", out["content"]), out["content"]
        assert out["stop_type"] == "eos"


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "objekt"),
    ({"json_schema": {"$ref": "#/defs/nope"}}, "defs/nope"),
    ({"grammar": "root ::= missing"}, "missing"),
    ({"grammar": 'root ::= "a" |||| ('}, "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "use one of"),
])
def test_bad_constraints_are_400(real, body, needle):
    r = httpx.post(real + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(real + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "light_set"}}])
def test_forced_tool_call_arguments_validate(real, choice):
    for seed in range(3):
        r = oai(real).chat.completions.create(model="x", messages=[{"role": "user", "content": "Dim the kitchen"}],
                                              tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=1.0,
                                              seed=seed)
        calls = r.choices[0].message.tool_calls
        # random weights may keep calling until max_tokens; every closed call is valid
        assert calls and r.choices[0].finish_reason in ("tool_calls", "length"), r.choices[0].message
        for c in calls:
            assert c.function.name == "light_set"
            check_light(json.loads(c.function.arguments))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "light_set"}}])
def test_parallel_tool_calls_false_makes_one_call(real, choice):
    """parallel_tool_calls false: one call, then the reply ends (finish_reason tool_calls, no text),
    where the same random weights keep calling until max_tokens when it is left to the template."""
    for seed in range(3):
        r = oai(real).chat.completions.create(model="x", messages=[{"role": "user", "content": "Dim the kitchen"}],
                                              tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=1.0,
                                              seed=seed, parallel_tool_calls=False)
        m = r.choices[0].message
        assert len(m.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls", m
        assert not m.content
        check_light(json.loads(m.tool_calls[0].function.arguments))
    bad = httpx.post(real + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "parallel_tool_calls": "no"},
                     timeout=60)
    assert bad.status_code == 400 and "parallel_tool_calls" in bad.json()["error"]["message"]


def test_auto_tool_choice_with_schema_answer(real):
    """auto + response_format: the reply is the JSON answer or calls whose arguments validate."""
    for seed in range(4):
        r = oai(real).chat.completions.create(
            model="x", messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        m = r.choices[0].message
        if m.tool_calls:
            for c in m.tool_calls:
                check_light(json.loads(c.function.arguments))
        else:
            check_person(json.loads(m.content))


def test_chat_logprobs_stream_and_not(real):
    kw = dict(model="x", messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    whole = oai(real).chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 8
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.token == e.top_logprobs[0].token     # greedy: the chosen token is the likeliest
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    streamed = [e for c in oai(real).chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_shapes(real):
    r = oai(real).completions.create(model="x", prompt="The light", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    native = httpx.post(real + "/completion", json={"prompt": "The light", "n_predict": 4, "temperature": 0,
                                                    "n_probs": 3}, timeout=60).json()
    probs = native["completion_probabilities"]
    assert len(probs) == 4 and all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 for p in probs)
    post = httpx.post(real + "/completion", json={"prompt": "The light", "n_predict": 4, "temperature": 0.8,
                                                  "top_k": 5, "seed": 1, "n_probs": 10,
                                                  "post_sampling_probs": True}, timeout=60).json()
    for p in post["completion_probabilities"]:
        assert len(p["top_probs"]) <= 5 and 0 < p["prob"] <= 1      # only what top_k kept
        assert math.isclose(sum(t["prob"] for t in p["top_probs"]), 1.0, rel_tol=1e-5)


def test_logprobs_of_a_constrained_reply_exclude_banned_tokens(real):
    r = httpx.post(real + "/completion", json={"prompt": "x", "n_predict": 3, "grammar": 'root ::= "ab"',
                                               "n_probs": 5, "temperature": 0}, timeout=60).json()
    assert r["content"] == "ab"
    for p in r["completion_probabilities"]:
        # the grammar leaves one choice per step (the end token among the EOG ids at the end)
        assert p["logprob"] == pytest.approx(0.0, abs=1e-6)


PROMPTS = [f"{verb} a {what}." for verb in ("Describe", "Invent", "Write about", "Imagine", "Tell me about")
           for what in ("teacher", "pilot", "child", "grandmother", "chef", "robot", "farmer", "singer",
                        "doctor", "sailor")]


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.exists(), reason="tests/models/SmolLM2-135M-Instruct.Q4_1.gguf is not here")
def test_smollm2_50_prompts_schema_valid():
    engine = Engine.load(SMOLLM2, EngineConfig(backend="cpu", n_ctx=1024))
    with running_server(create_app(engine, ServerSettings(max_queue=4))) as (base, _, _):
        client = oai(base)
        assert len(PROMPTS) == 50
        for k, prompt in enumerate(PROMPTS):
            r = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": prompt + " Answer in JSON."}], max_tokens=150,
                temperature=0.7 if k % 2 else 0.0, seed=k,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
            assert r.choices[0].finish_reason == "stop", (prompt, r.choices[0].message.content)
            check_person(json.loads(r.choices[0].message.content))
        for seed in range(5):
            r = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Set the hall light to 40"}], tools=TOOLS,
                tool_choice="required", max_tokens=100, temperature=0.7, seed=seed)
            for c in r.choices[0].message.tool_calls:
                check_light(json.loads(c.function.arguments))


def test_ollama_format_and_responses_text_format(real):
    r = httpx.post(real + "/api/chat", json={"model": "x", "messages": ASK, "stream": False, "format": PERSON,
                                             "options": {"temperature": 0.9, "seed": 4, "num_predict": 120}},
                   timeout=60)
    assert r.status_code == 200, r.text
    check_person(json.loads(r.json()["message"]["content"]))
    r = oai(real).responses.create(model="x", input="Make up a person.", max_output_tokens=120, temperature=0.5,
                                   extra_body={"seed": 5},
                                   text={"format": {"type": "json_schema", "name": "p", "schema": PERSON}})
    check_person(json.loads(r.output_text))
