"""The HTTP server with scripted replies: tool calls, reasoning, failures, the queue,
loading, API keys, shutdown. The engine is the fixture GGUF's real tokenizer and chat
template with a generate() that yields prepared pieces (test_server_support.ScriptedEngine),
so the openai client sees exactly what a Qwen3 model would write.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server import app as app_module
from genie_rt.server.app import ServerSettings, create_app

from test_server_support import ScriptedEngine, running_server, sse_events

TOOLS = [{"type": "function", "function": {
    "name": "light_set", "description": "Set a light's brightness",
    "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "level": {"type": "integer"}},
                   "required": ["room", "level"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "light_set", "arguments": {"room": "kitchen", "level": 30}}\n</tool_call>'
ASK = [{"role": "user", "content": "Dim the kitchen to 30%"}]


@pytest.fixture(scope="module")
def real_engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=256))


@pytest.fixture(scope="module")
def scripted(real_engine):
    engine = ScriptedEngine(real_engine)
    app = create_app(engine, ServerSettings(max_queue=1))
    with running_server(app) as (base, _, _):
        with httpx.Client(base_url=base, timeout=30) as client:
            yield engine, client


@pytest.fixture
def engine(scripted):
    engine, _ = scripted
    engine.reply = lambda req: ["Hello"]
    return engine


@pytest.fixture
def client(scripted):
    return scripted[1]


def oai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="k", max_retries=0)


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


# --- tool calls -----------------------------------------------------------------------------------------
def test_tool_call_non_streamed_with_openai_client(engine, client):
    engine.reply = lambda req: [CALL_TEXT]
    resp = oai(client).chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "light_set" and call.id
    assert json.loads(call.function.arguments) == {"room": "kitchen", "level": 30}
    # the tools reached the template: the prompt lists the function
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt)
    assert '"name": "light_set"' in prompt


@pytest.mark.parametrize("size", [1, 3, 200])
def test_tool_call_streamed_with_openai_client(engine, client, size):
    engine.reply = lambda req: pieces_of("Sure. " + CALL_TEXT, size)
    calls: dict[int, dict] = {}
    content, finish, usage = "", None, None
    for chunk in oai(client).chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True,
                                                     stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert usage.completion_tokens == len(pieces_of("Sure. " + CALL_TEXT, size))
    assert content == "Sure."  # no tag text leaks into content, however the reply was split
    assert list(calls) == [0] and calls[0]["name"] == "light_set" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"room": "kitchen", "level": 30}


def test_tool_call_raw_sse_shape_and_parallel_calls(engine, client):
    second = CALL_TEXT.replace("kitchen", "hall").replace("30", "0")
    engine.reply = lambda req: pieces_of(CALL_TEXT + "\n" + second, 7)
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": ASK, "tools": TOOLS, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [d["index"] for d in tool_deltas] == [0, 1]
    assert all(d["type"] == "function" and d["id"] for d in tool_deltas)
    assert [json.loads(d["function"]["arguments"])["room"] for d in tool_deltas] == ["kitchen", "hall"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)


def test_tool_choice_none_and_no_tools_leave_text_alone(engine, client):
    engine.reply = lambda req: [CALL_TEXT]
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = client.post("/v1/chat/completions", json={"messages": ASK, **extra}).json()
        assert r["choices"][0]["message"]["content"] == CALL_TEXT
        assert r["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in r["choices"][0]["message"]
    assert '"light_set"' not in engine.tokenizer.decode(engine.requests[-1].prompt)


CALL_BODY = '{"name": "light_set", "arguments": {"room": "kitchen", "level": 30}}\n</tool_call>'
CALL_ARGS = '{"room": "kitchen", "level": 30}}\n</tool_call>'


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize("choice, reply, forced", [
    ("required", CALL_BODY, "<tool_call>\n"),
    ({"type": "function", "function": {"name": "light_set"}}, CALL_ARGS,
     '<tool_call>\n{"name": "light_set", "arguments": '),
])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_start_the_reply_with_the_call(engine, client, choice, reply,
                                                                      forced, stream, think):
    """Without grammar sampling, a forced call is enforced by writing its start into the
    prompt: the model continues inside the <tool_call> block, the reply is parsed with it."""
    engine.reply = lambda req: pieces_of(reply, 5)
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "stream": stream, "think": think}
    if stream:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = sse_events(r)
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
        assert not any(d.get("content") or d.get("reasoning_content") for d in deltas)
        finish = events[-2]["choices"][0]["finish_reason"]
    else:
        msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        calls, finish = [c["function"] for c in msg["message"]["tool_calls"]], msg["finish_reason"]
        assert msg["message"]["content"] is None and "reasoning_content" not in msg["message"]
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["light_set"]
    assert json.loads(calls[0]["arguments"]) == {"room": "kitchen", "level": 30}
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt)
    assert prompt.endswith(forced), prompt[-80:]
    # right after the assistant header (thinking off: after the template's empty think block);
    # a forced call does not think first
    header = "<|im_start|>assistant\n" + ("" if think else "<think>\n\n</think>\n\n")
    assert prompt.endswith(header + forced), prompt[-80:]


def test_tool_choice_auto_and_a_named_function_that_is_not_a_tool(engine, client):
    engine.reply = lambda req: ["It is done."]
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "auto"})
    assert r.json()["choices"][0]["message"]["content"] == "It is done."
    assert not engine.tokenizer.decode(engine.requests[-1].prompt).endswith("<tool_call>\n")
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "garage_open"}}})
    assert r.status_code == 400 and "'tool_choice.function.name' \"garage_open\" is not one of the tools" \
        in r.json()["error"]["message"]


@pytest.mark.parametrize("content", ["Sure, the kitchen", [{"type": "text", "text": "Sure,"},
                                                          {"type": "text", "text": "the kitchen"}]])
def test_final_assistant_message_is_continued(engine, client, content):
    """As llama-server: a final assistant message is a prefill, continued without an end of
    turn; the reply is the continuation. Its text parts are joined with a blank line, as
    llama-server joins them (llama.cpp's test_chat_template_assistant_prefill)."""
    expected = "Sure, the kitchen" if isinstance(content, str) else "Sure,\n\nthe kitchen"
    engine.reply = lambda req: [" lights are at 30%."]
    msgs = ASK + [{"role": "assistant", "content": content}]
    r = client.post("/v1/chat/completions", json={"messages": msgs}).json()
    assert r["choices"][0]["message"]["content"] == " lights are at 30%."   # appended as is
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + expected), prompt[-80:]
    shown = client.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert shown.endswith(expected) and shown.count("<|im_start|>assistant") == 1
    r = client.post("/v1/chat/completions", json={"messages": msgs + [{"role": "assistant", "content": "x"}]})
    assert r.status_code == 400 and "two assistant messages" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/completion", "/completions"])
def test_native_completion_route_in_llama_servers_shape(engine, client, route):
    engine.reply = lambda req: ["The kitchen", " lights", "\nare dimmed", "."]
    body = {"prompt": "Q: kitchen?\nA:", "n_predict": 16, "stop": [" STOP"], "temperature": 0}
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["content"] == "The kitchen lights\nare dimmed." and j["stop"] is True
    assert j["stop_type"] == "eos" and j["stopping_word"] == "" and j["has_new_line"] is True
    assert j["tokens_evaluated"] == len(engine.requests[-1].prompt) and j["tokens_predicted"] == 4
    assert j["generation_settings"]["n_predict"] == 16 and j["generation_settings"]["stop"] == [" STOP"]
    assert set(j["timings"]) >= {"prompt_n", "predicted_n", "predicted_per_second"}
    assert j["prompt"] == body["prompt"] and j["truncated"] is False
    # streamed: content pieces with stop false, a last object with stop true, no [DONE]
    with client.stream("POST", route, json={**body, "stream": True}) as rs:
        events = sse_events(rs)
    assert "[DONE]" not in events
    keys = {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"}
    assert all(e["stop"] is False and set(e) == keys for e in events[:-1])
    # each piece carries its token ids and the running counts, as llama-server's partial results
    assert all(e["tokens"] and all(isinstance(t, int) for t in e["tokens"]) for e in events[:-1])
    assert [e["tokens_predicted"] for e in events[:-1]] == list(range(1, len(events)))
    assert all(e["tokens_evaluated"] == j["tokens_evaluated"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == j["content"]
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "eos" and events[-1]["content"] == ""
    # the token limit and the end of generation
    engine.reply = lambda req: ["a", "b", "c"]
    assert client.post(route, json={"prompt": "x", "n_predict": 2}).json()["stop_type"] == "limit"
    r = client.post(route, json={"prompt": ""})
    assert r.status_code == 400 and "'prompt' is empty" in r.json()["error"]["message"]


def test_tool_round_trip_messages_render(engine, client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "light_set", "arguments": '{"room": "kitchen", "level": 30}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'}]
    engine.reply = lambda req: ["Done, the kitchen is at 30%."]
    resp = oai(client).chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert resp.choices[0].message.content == "Done, the kitchen is at 30%."
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt)
    assert "<tool_response>" in prompt and '"level": 30' in prompt


def test_unclosed_tool_call_at_length_limit(engine, client):
    engine.reply = lambda req: [CALL_TEXT[:-len("</tool_call>")]]
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()
    assert r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "light_set"


# --- reasoning -------------------------------------------------------------------------------------------
THOUGHT = "<think>\nThe user wants the kitchen dimmed.\n</think>\n\nDimming the kitchen."


@pytest.mark.parametrize("size", [1, 4, 100])
def test_reasoning_content_streamed_and_not(engine, client, size):
    engine.reply = lambda req: pieces_of(THOUGHT, size)
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Dimming the kitchen.",
                   "reasoning_content": "The user wants the kitchen dimmed."}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])


def test_thinking_is_off_by_default_and_switchable(engine, client):
    engine.reply = lambda req: ["ok"]
    client.post("/v1/chat/completions", json={"messages": ASK})
    assert "<think>\n\n</think>" in engine.tokenizer.decode(engine.requests[-1].prompt)
    for on in ({"chat_template_kwargs": {"enable_thinking": True}}, {"think": True}):
        client.post("/v1/chat/completions", json={"messages": ASK, **on})
        assert "</think>" not in engine.tokenizer.decode(engine.requests[-1].prompt)


def test_reasoning_format_none_keeps_tags_in_content(engine, client):
    engine.reply = lambda req: [THOUGHT]
    r = client.post("/v1/chat/completions", json={"messages": ASK, "reasoning_format": "none"}).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}


# --- request fields reach the engine ------------------------------------------------------------------------
def test_fields_reach_the_generation_request(engine, client):
    client.post("/v1/chat/completions", json={
        "messages": ASK, "max_completion_tokens": 7, "stop": "END", "seed": 5, "temperature": 0.5, "top_k": 7,
        "top_p": 0.5, "min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.3,
        "frequency_penalty": 0.2, "logit_bias": [[11, -2.5], [12, False]], "ignore_eos": True,
        "conversation_id": "kitchen-1"})
    req = engine.requests[-1]
    p = req.params
    assert (req.max_tokens, req.stop, req.ignore_eos, req.conversation_id) == (7, ["END"], True, "kitchen-1")
    assert (p.seed, p.temperature, p.top_k, p.top_p, p.min_p) == (5, 0.5, 7, 0.5, 0.1)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.1, 32, 0.3, 0.2)
    assert p.logit_bias == {11: -2.5, 12: float("-inf")}
    client.post("/v1/chat/completions", json={"messages": ASK, "logit_bias": {"11": 1, "Hello": -1}, "seed": -1,
                                              "top_k": -1})
    p = engine.requests[-1].params
    assert p.logit_bias[11] == 1 and len(p.logit_bias) >= 2 and p.seed is None and p.top_k == 0


# --- failures --------------------------------------------------------------------------------------------------
def test_error_after_streaming_started_is_an_error_chunk(engine, client):
    engine.reply = lambda req: ["Hel", "lo", RuntimeError("device lost")]
    with client.stream("POST", "/v1/chat/completions", json={"messages": ASK, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == 500 and "device lost" in events[-1]["error"]["message"]
    engine.reply = lambda req: ["fine"]  # the worker survived
    assert client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]["content"] == "fine"


def test_error_before_the_first_token_is_an_http_error(engine, client):
    engine.reply = lambda req: [RuntimeError("kernel failed")]
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": ASK, "stream": stream})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    engine.reply = lambda req: [ValueError("bad value the checks missed")]
    r = client.post("/v1/chat/completions", json={"messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_longer_than_context(engine, client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 600}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 512


# --- the queue --------------------------------------------------------------------------------------------------
def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_queue_overflow_is_503_with_retry_after(engine, client):
    gate = threading.Event()
    engine.reply = lambda req: [gate.wait(10) and "done"]
    base = str(client.base_url)
    first, out1 = _in_thread(lambda: httpx.post(base + "/v1/chat/completions", json={"messages": ASK}, timeout=30))
    _wait(lambda: _metric(client, "llamacpp:requests_processing") == 1)
    second, out2 = _in_thread(lambda: httpx.post(base + "/v1/chat/completions", json={"messages": ASK}, timeout=30))
    _wait(lambda: _metric(client, "llamacpp:requests_deferred") == 1)
    r = client.post("/v1/chat/completions", json={"messages": ASK})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "unavailable_error"
    assert _metric(client, 'genie_rt_requests_rejected_total{reason="queue_full"}') >= 1
    gate.set()
    first.join(10)
    second.join(10)
    assert out1["r"].status_code == 200 and out2["r"].status_code == 200


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_disconnect_while_queued_leaves_the_queue(engine, client):
    gate = threading.Event()
    engine.reply = lambda req: [gate.wait(10) and "done"]
    base = str(client.base_url)
    first, out1 = _in_thread(lambda: httpx.post(base + "/v1/chat/completions", json={"messages": ASK}, timeout=30))
    _wait(lambda: _metric(client, "llamacpp:requests_processing") == 1)
    n_before = len(engine.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/chat/completions", json={"messages": ASK}, timeout=0.3)
    _wait(lambda: _metric(client, "llamacpp:requests_deferred") == 0)
    gate.set()
    first.join(10)
    assert out1["r"].status_code == 200
    engine.reply = lambda req: ["next"]
    assert client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]["content"] == "next"
    assert len(engine.requests) == n_before + 1  # the abandoned request never reached the engine


def test_disconnect_stops_a_slow_generation_promptly(engine, client):
    engine.reply = lambda req: ["a"] + [0.01, "b"] * 3000  # ~30 s if nobody stops it
    n = len(engine.finished)
    with client.stream("POST", "/v1/chat/completions", json={"messages": ASK, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    t0 = time.monotonic()
    _wait(lambda: len(engine.finished) > n, timeout=5)
    assert engine.finished[-1] == "cancelled" and time.monotonic() - t0 < 5


# --- loading, keys, CORS, routes ---------------------------------------------------------------------------------
def test_health_is_503_while_loading_then_ok(real_engine):
    release = threading.Event()

    def loader():
        release.wait(10)
        return ScriptedEngine(real_engine)

    with running_server(create_app(loader)) as (base, _, _):
        r = httpx.get(base + "/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert httpx.post(base + "/v1/chat/completions", json={"messages": ASK}).status_code == 503
        release.set()
        _wait(lambda: httpx.get(base + "/health").status_code == 200)
        assert httpx.get(base + "/health").json()["status"] == "ok"


def test_failed_load_is_reported(real_engine):
    def loader():
        raise RuntimeError("out of memory: model needs 9 GiB")

    with running_server(create_app(loader)) as (base, _, _):
        _wait(lambda: httpx.get(base + "/health").status_code != 503)
        r = httpx.get(base + "/health")
        assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]


def test_api_key(real_engine):
    app = create_app(ScriptedEngine(real_engine), ServerSettings(api_key="s3cret"))
    with running_server(app) as (base, _, _):
        assert httpx.get(base + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "nope"}, {"Authorization": "s3cret"}):
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(base + "/metrics", headers={"X-Api-Key": "s3cret"}).status_code == 200
        assert httpx.get(base + "/props", headers={"Authorization": "Bearer x", "X-Api-Key": "s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="bad", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="m", messages=ASK).choices[0].message.content == "Hello"


def test_cors_preflight_and_headers(client):
    r = client.options("/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    # llama-server's defaults: the origin echoed, credentials allowed, its method and header lists
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://example.com"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    r = client.get("/v1/models", headers={"Origin": "http://example.com"})
    assert r.headers["access-control-allow-origin"] == "http://example.com"
    assert "access-control-allow-origin" not in client.get("/v1/models").headers   # no Origin, nothing to echo


# --- shutdown -----------------------------------------------------------------------------------------------------
def test_shutdown_cancels_in_flight_work_within_the_bound(real_engine):
    engine = ScriptedEngine(real_engine)
    engine.reply = lambda req: ["a"] + [0.01, "b"] * 5000  # ~50 s unless cancelled
    app = create_app(engine, ServerSettings())
    with running_server(app, server_cls=app_module.GracefulServer, graceful_timeout=0.5) as (base, server, thread):
        got = []

        def consume():
            try:
                with httpx.stream("POST", base + "/v1/chat/completions",
                                  json={"messages": ASK, "stream": True}, timeout=30) as r:
                    for line in r.iter_lines():
                        got.append(line)
            except httpx.HTTPError:
                pass

        t, _ = _in_thread(consume)
        _wait(lambda: len(got) > 2)
        t0 = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)   # what the signal handler does
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - t0 < 5
        assert engine.finished[-1] == "cancelled"
        assert not app.state.genie.worker.is_alive
        t.join(5)


@pytest.mark.slow
def test_sigterm_finishes_the_running_request_saves_and_exits_0(fixture_gguf, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "genie_rt.engine.cli", "serve", "-m", str(fixture_gguf),
                             "--backend", "cpu", "--ctx", "512", "--port", str(port),
                             "--kv-cache-dir", str(tmp_path), "--shutdown-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).parent.parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.1)
        body = {"messages": ASK, "stream": True, "max_tokens": 450, "ignore_eos": True, "temperature": 0,
                "conversation_id": "before-sigterm"}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            try:  # no new work once the signal arrived: refused at the socket, or 503 while draining
                late = httpx.post(base + "/v1/chat/completions", json={"messages": ASK}, timeout=5)
                assert late.status_code == 503
            except httpx.TransportError:
                pass
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the running request was allowed to finish (within 120 s)
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(20) == 0
        assert any("before-sigterm" in f.name for f in tmp_path.iterdir())  # the turn's KV was saved
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tools_a_template_cannot_show_are_warned_about_once(engine, client, caplog):
    """A request's tools that the template does not render (the base-model transcript): the
    request runs, and the log says once that the model is not shown them (/props' caps agree)."""
    from genie_rt.engine.chat import ChatTemplate
    kept = engine.template
    engine.template = ChatTemplate.plain()
    try:
        for _ in range(2):
            r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "tools": TOOLS})
            assert r.status_code == 200, r.text
        warned = [m for m in caplog.messages if "does not render tools" in m]
        assert len(warned) == 1
        assert client.get("/props").json()["chat_template_caps"]["supports_tools"] is False
    finally:
        engine.template = kept


def test_plain_fallback_template_ends_chat_replies_at_the_next_user_line(engine, client):
    # a base model (the default Gemma 3 270M) gets the plain transcript: its chat replies stop where
    # it starts writing the user's next line; completions are raw text and get no such stop
    from genie_rt.engine.chat import ChatTemplate
    kept = engine.template
    engine.template = ChatTemplate.plain()
    try:
        r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "stop": ["x"]})
        assert r.status_code == 200, r.text
        assert engine.requests[-1].stop == ["x", "\nUser:", "\nAssistant:"]
        assert client.post("/completion", json={"prompt": "Hi", "n_predict": 2}).status_code == 200
        assert "\nUser:" not in engine.requests[-1].stop
    finally:
        engine.template = kept
