"""The HTTP server with the real fixture model (random weights, 2 layers) on a real uvicorn.

What a client written against llama-server relies on: response and chunk shapes, SSE
framing, the official openai client streaming and not, deterministic text at temperature 0
and with a seed, every kind of invalid request answered 400 (never a crash, never a changed
answer afterwards), a disconnect that frees the worker at once, /metrics that parses, no
memory growth over many requests. Scripted replies (tool calls, reasoning, failures, the
queue) are in test_server_scripted.py.
"""
from __future__ import annotations

import gc
import math
import re
import socket
import time

import httpx
import openai
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import ServerSettings, create_app

from test_server_support import running_server, sse_events

N_CTX = 1024
MESSAGES = [{"role": "system", "content": "You are a home assistant."},
            {"role": "user", "content": "Turn on the kitchen light"}]
# A random-weight model repeats itself at temperature 0; a presence penalty makes a reply varied
# enough to test stop strings with.
GREEDY = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "presence_penalty": 1.0}


@pytest.fixture(scope="module")
def server(fixture_gguf):
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=N_CTX))
    app = create_app(engine, ServerSettings(max_queue=4, model_path=str(fixture_gguf)))
    with running_server(app) as (base, _, _):
        with httpx.Client(base_url=base, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def reference(server) -> str:
    """The greedy answer to GREEDY: every later check of 'the next answer is unchanged' uses it."""
    r = server.post("/v1/chat/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def chat(client, **fields) -> httpx.Response:
    return client.post("/v1/chat/completions", json={**GREEDY, **fields})


def stream_chat(client, **fields) -> tuple[httpx.Headers, list]:
    with client.stream("POST", "/v1/chat/completions", json={**GREEDY, "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        return r.headers, sse_events(r)


def metric_values(text: str) -> dict[str, float]:
    """A strict reader of Prometheus text format 0.0.4: fails on any malformed line."""
    name_re = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    sample = re.compile(rf"^({name_re})(\{{{name_re}=\"[^\"]*\"(,{name_re}=\"[^\"]*\")*\}})? (\S+)$")
    values, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP ") or not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge"), line
            typed.add(name)
            continue
        m = sample.match(line)
        assert m, f"malformed metrics line: {line!r}"
        assert m.group(1) in typed, f"{m.group(1)} has no TYPE line"
        value = float(m.group(4))
        assert not math.isnan(value)
        values[m.group(1) + (m.group(2) or "")] = value
    return values


# --- shapes ------------------------------------------------------------------------------------------
def test_health_reports_model_memory_device(server):
    r = server.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["model"] == "qwen3-micro-q4km.gguf"
    assert body["n_ctx"] == N_CTX
    assert body["device"]["backend"] == "cpu"
    assert body["memory"]["n_ctx"] == N_CTX and body["memory"]["weights"] > 0


def test_chat_response_has_llama_server_shape(server, reference):
    r = chat(server)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert body["model"] == "qwen3-micro-q4km.gguf"
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": reference}
    usage = body["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # same prompt again
    t = body["timings"]
    assert set(t) >= {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                      "predicted_per_second", "cache_n"}
    assert t["predicted_n"] == 24 and t["prompt_n"] == 1 and t["cache_n"] == usage["prompt_tokens"] - 1


def test_stream_equals_non_stream_at_temperature_0(server, reference):
    headers, events = stream_chat(server, stream_options={"include_usage": True})
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == reference
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 24
    assert usage_chunk["timings"]["predicted_n"] == 24


def test_stream_without_usage_ends_with_finish_chunk(server, reference):
    _, events = stream_chat(server)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last and "timings" in last


def test_openai_client_stream_and_not(server, reference):
    client = openai.OpenAI(base_url=str(server.base_url) + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=24, temperature=0,
                                          presence_penalty=1.0)
    assert resp.choices[0].message.content == reference
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 24
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=24, temperature=0,
                                                presence_penalty=1.0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == reference
    assert usage.completion_tokens == 24 and usage.prompt_tokens_details.cached_tokens > 0
    models = client.models.list()
    assert models.data[0].id == "qwen3-micro-q4km.gguf"


def test_same_seed_same_text(server):
    fields = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1234, "max_tokens": 16}
    a = chat(server, **fields).json()["choices"][0]["message"]["content"]
    b = chat(server, **fields).json()["choices"][0]["message"]["content"]
    _, events = stream_chat(server, **fields)
    c = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert a == b == c


def test_stop_string_and_max_tokens_aliases(server, reference):
    word = reference.strip()[1:4]
    r = chat(server, stop=[word], max_tokens=None, n_predict=24)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == reference[:reference.index(word)]
    r = chat(server, max_tokens=99, max_completion_tokens=5)
    assert r.json()["usage"]["completion_tokens"] == 5


def test_completions_raw_prompt(server):
    body = {"prompt": "The kitchen light", "max_tokens": 12, "temperature": 0}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "text_completion"
    text = out["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 12
    with server.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
    ids = server.post("/tokenize", json={"content": "The kitchen light"}).json()["tokens"]
    by_ids = server.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert by_ids["choices"][0]["text"] == text


def test_native_completion_matches_v1_and_stops_on_a_word(server):
    body = {"prompt": "The kitchen light", "n_predict": 12, "temperature": 0}
    v1 = server.post("/v1/completions", json=body).json()["choices"][0]["text"]
    native = server.post("/completion", json=body).json()
    assert native["content"] == v1 and native["stop_type"] == "limit" and native["tokens_predicted"] == 12
    word = v1[3:6]                           # a stop string the greedy text is known to contain
    stopped = server.post("/completion", json={**body, "stop": [word]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == v1[:v1.index(word)]


def test_completions_parse_special_tokens_and_mixed_prompts(server):
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = server.post("/tokenize", json={"content": text}).json()["tokens"]
    body = {"max_tokens": 6, "temperature": 0}
    as_text = server.post("/v1/completions", json={**body, "prompt": text}).json()
    assert as_text["usage"]["prompt_tokens"] == len(ids)  # <|im_start|> is one token, as in llama-server
    as_ids = server.post("/v1/completions", json={**body, "prompt": ids}).json()
    n_head = 1 + len(server.post("/tokenize", json={"content": "user\nhi"}).json()["tokens"])
    mixed = server.post("/v1/completions", json={**body, "prompt": [ids[0], "user\nhi", *ids[n_head:]]}).json()
    assert as_text["choices"][0]["text"] == as_ids["choices"][0]["text"] == mixed["choices"][0]["text"]


def test_completions_stream_usage_appears_once(server):
    # ignore_eos: at the default temperature a random-weight model may end after 2 tokens
    body = {"prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True}
    for include, expect in ((False, 1), (True, 1)):
        with server.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": include}}) as r:
            events = sse_events(r)[:-1]
        assert sum("usage" in e for e in events) == expect
        assert events[-1]["timings"]["predicted_n"] == 4


def test_developer_role_is_a_system_message(server):
    dev = [{"role": "developer", "content": "You are a home assistant."}, MESSAGES[1]]
    assert chat(server, messages=dev).json()["choices"][0]["message"] == chat(server).json()["choices"][0]["message"]


def test_conversation_id_persists_across_restarts(fixture_gguf, tmp_path):
    cfg = EngineConfig(backend="cpu", n_ctx=512, kv_cache_dir=str(tmp_path))
    body = {**GREEDY, "max_tokens": 8, "conversation_id": "kitchen-1"}
    with running_server(create_app(Engine.load(fixture_gguf, cfg))) as (base, _, _):
        first = httpx.post(base + "/v1/chat/completions", json=body, timeout=30).json()
    assert any("kitchen-1" in f.name for f in tmp_path.iterdir())
    follow_up = MESSAGES + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "and the hall"}]
    with running_server(create_app(Engine.load(fixture_gguf, cfg))) as (base, _, _):  # a fresh, empty pool
        r = httpx.post(base + "/v1/chat/completions", json={**body, "messages": follow_up}, timeout=30).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert r["timings"]["cache_n"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]


# --- other routes --------------------------------------------------------------------------------------
def test_tokenize_detokenize_apply_template(server):
    r = server.post("/tokenize", json={"content": "Hello <|im_end|> ü", "with_pieces": True})
    tokens = r.json()["tokens"]
    assert all(set(t) == {"id", "piece"} for t in tokens)
    ids = [t["id"] for t in tokens]
    assert server.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello <|im_end|> ü"}
    plain = server.post("/tokenize", json={"content": "Hello <|im_end|> ü", "parse_special": False}).json()["tokens"]
    assert len(plain) > len(ids)  # the control token is spelled out as text
    prompt = server.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert "Turn on the kitchen light" in prompt and prompt.rstrip().endswith("</think>")  # thinking off
    thinking = server.post("/apply-template", json={"messages": MESSAGES,
                                                    "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert "</think>" not in thinking["prompt"]
    assert server.post("/apply-template", json={"messages": MESSAGES, "think": True}).json() == thinking
    # the same messages chat completions renders: "developer" is the system role there too
    dev = [{**m, "role": "developer"} if m["role"] == "system" else m for m in MESSAGES]
    assert server.post("/apply-template", json={"messages": dev}).json()["prompt"] == prompt
    # template variables that collide with the renderer's own arguments are dropped, not a 500
    for body in ({"messages": MESSAGES, "chat_template_kwargs": {"self": 1, "messages": []}},):
        assert server.post("/apply-template", json=body).json()["prompt"] == prompt
        r = server.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_props_and_models(server):
    props = server.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX
    assert props["total_slots"] == 1 and "chat_template" in props and props["model_path"].endswith(".gguf")
    # llama-server's capability probes: the fixture's Qwen3 template shows tools and writes calls
    assert props["chat_template_caps"] == {"supports_tools": True, "supports_tool_calls": True,
                                           "supports_parallel_tool_calls": True, "supports_system_role": True}
    models = server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["meta"]["n_vocab"] == 4122


def test_metrics_parse_and_count(server, reference):
    chat(server)
    before = metric_values(server.get("/metrics").text)
    chat(server)
    after = _wait_idle(server)  # the worker thread may still be between Done and idle
    assert server.get("/metrics").headers["content-type"].startswith("text/plain")
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"] + 24
    assert after["genie_rt_prefix_cache_hits_total"] == before["genie_rt_prefix_cache_hits_total"] + 1
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    assert 0 < after["llamacpp:kv_cache_usage_ratio"] < 1
    assert after["llamacpp:predicted_tokens_seconds"] > 0
    # a 400 from the template (a role it does not know) counts as invalid like any other
    key = 'genie_rt_requests_rejected_total{reason="invalid"}'
    bad = server.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert bad.status_code == 400
    assert metric_values(server.get("/metrics").text).get(key, 0) == after.get(key, 0) + 1


# --- invalid requests -------------------------------------------------------------------------------------
def _post_raw(client, path, content: bytes):
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("content, needle", [
    (b"{", "invalid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
    (b"[" * 100000, "JSON"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1e999}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}", "JSON"),
])
def test_malformed_bodies_are_400(server, content, needle):
    r = _post_raw(server, "/v1/chat/completions", content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and needle in err["message"]


BAD_FIELDS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "include_usage"),
    ({"max_tokens": "12"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": -2}, "max_tokens"),
    ({"max_tokens": 10 ** 30}, "max_tokens"),
    ({"max_tokens": 1e300}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"n_predict": [1]}, "n_predict"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": None, "min_p": -0.5}, "min_p"),
    ({"top_k": 1e40}, "top_k"),
    ({"top_k": "40"}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2 ** 70}, "seed"),
    ({"repeat_penalty": -1}, "repeat_penalty"),
    ({"repeat_last_n": -5}, "repeat_last_n"),
    ({"presence_penalty": 1e9}, "presence_penalty"),
    ({"frequency_penalty": {}}, "frequency_penalty"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", None]}, "stop[1]"),
    ({"stop": ["x" * 100000]}, "stop[0]"),
    ({"stop": [f"s{i}" for i in range(5000)]}, "stop"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"12": "high"}}, "logit_bias"),
    ({"logit_bias": {"12": 1e30}}, "logit_bias"),
    ({"logit_bias": [[12]]}, "logit_bias"),
    ({"logit_bias": [[99999, 1.0]]}, "logit_bias"),
    ({"logit_bias": 3}, "logit_bias"),
    ({"n": 0}, "'n' must be between 1 and 16"),
    ({"n": 17}, "'n' must be between 1 and 16"),
    ({"n": 1.5}, "'n' must be an integer"),
    ({"n": "2"}, "'n' must be an integer"),
    ({"n_cmpl": -1}, "'n_cmpl' must be between 1 and 16"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n_probs": -1}, "n_probs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "objekt"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tool_choice": 7}, "tool_choice"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "enable_thinking"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"think": 1}, "think"),
    ({"reasoning_format": "weird"}, "reasoning_format"),
    ({"conversation_id": "../../etc/passwd"}, "conversation_id"),
    ({"conversation_id": 12}, "conversation_id"),
    ({"model": ["a"]}, "model"),
]


@pytest.mark.parametrize("fields, needle", BAD_FIELDS, ids=[str(i) for i in range(len(BAD_FIELDS))])
def test_invalid_fields_are_400_naming_the_field(server, fields, needle):
    for stream in (False, True):
        r = server.post("/v1/chat/completions", json={**GREEDY, **fields, **({"stream": True} if stream and
                                                                                "stream" not in fields else {})})
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert needle in err["message"], err["message"]


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "vocabulary"),
    ("/v1/completions", {"prompt": [1, -3]}, "vocabulary"),
    ("/v1/completions", {"prompt": [[1, 2], {"prompt_string": 3}]}, "prompt_string"),
    ("/completion", {"prompt": {"prompt_string": "hi", "multimodal_data": ["x"]}}, "images"),
    ("/completion", {"prompt": ["a", "b"], "stream": True}, "cannot be streamed"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/detokenize", {"tokens": [5, 100000]}, "vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"content": {"a": 1}}, "content"),
    ("/tokenize", {"content": ["hi", 99999]}, "vocabulary"),
    ("/tokenize", {"content": "hi", "with_pieces": "yes"}, "with_pieces"),
    ("/apply-template", {"messages": [{"role": "user", "content": None}]}, "content"),
])
def test_other_routes_validate(server, path, body, needle):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_megabyte_prompt_is_exceed_context_error(server):
    prompt = "turn on the kitchen light " * 40000  # ~1 MB
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "stream": True})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error"
    assert err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX
    r = server.post("/v1/completions", json={"prompt": prompt})
    assert r.json()["error"]["type"] == "exceed_context_size_error"


def test_oversized_body_is_413(server):
    r = _post_raw(server, "/v1/chat/completions", b'{"messages": "' + b"x" * (9 << 20) + b'"}')
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_unknown_route_and_method(server):
    r = server.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = server.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_hostile_requests_do_not_change_the_next_answer(server, reference):
    for fields, _ in BAD_FIELDS[:10]:
        chat(server, **fields)
    _post_raw(server, "/v1/chat/completions", b"\x00\xff{{{")
    assert chat(server).json()["choices"][0]["message"]["content"] == reference
    # different sampling settings in between do not leak into the next request either
    chat(server, temperature=1.5, seed=7, logit_bias={"5": 50}, repeat_penalty=1.3, stop=["a"])
    assert chat(server).json()["choices"][0]["message"]["content"] == reference


# --- cancellation ------------------------------------------------------------------------------------------
def _wait_idle(client, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(client.get("/metrics").text)
        if m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0:
            return m
        assert time.monotonic() < deadline, "the worker is still busy"
        time.sleep(0.02)


def test_disconnect_mid_stream_cancels_and_frees_the_worker(server, reference):
    before = _wait_idle(server)
    long = {**GREEDY, "max_tokens": N_CTX, "ignore_eos": True, "stream": True}
    with server.stream("POST", "/v1/chat/completions", json=long) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
    # the stream is closed: the generation must stop long before N_CTX tokens
    after = _wait_idle(server)
    cancelled = after['genie_rt_requests_finished_total{reason="cancelled"}']
    assert cancelled == before['genie_rt_requests_finished_total{reason="cancelled"}'] + 1
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < N_CTX - 100
    t0 = time.monotonic()
    assert chat(server).json()["choices"][0]["message"]["content"] == reference
    assert time.monotonic() - t0 < 30  # generous: a fresh request is not stuck behind the old one


def test_repeated_disconnects_and_half_sent_bodies(server, reference):
    port = server.base_url.port
    for i in range(5):
        with socket.create_connection(("127.0.0.1", port)) as s:  # half a body, then gone
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999\r\n\r\n{\"mess")
        long = {**GREEDY, "max_tokens": N_CTX, "ignore_eos": True, "stream": True}
        with server.stream("POST", "/v1/chat/completions", json=long) as r:  # gone after i + 1 chunks
            lines = r.iter_lines()
            for _ in range(2 * i + 1):
                next(lines)
    _wait_idle(server)
    assert chat(server).json()["choices"][0]["message"]["content"] == reference


def test_client_timeout_cancels_non_streamed_request(server, reference):
    before = _wait_idle(server)
    long = {**GREEDY, "max_tokens": N_CTX, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(server.base_url) + "/v1/chat/completions", json=long, timeout=0.2)
    after = _wait_idle(server)
    assert after['genie_rt_requests_finished_total{reason="cancelled"}'] == \
        before['genie_rt_requests_finished_total{reason="cancelled"}'] + 1
    assert chat(server).json()["choices"][0]["message"]["content"] == reference


# --- memory ---------------------------------------------------------------------------------------------------
def test_no_memory_growth_over_many_requests(server, reference):
    def batch(n):
        for i in range(n):
            kind = i % 4
            if kind == 0:
                assert chat(server, max_tokens=2).status_code == 200
            elif kind == 1:
                stream_chat(server, max_tokens=2)
            elif kind == 2:
                assert chat(server, temperature="x").status_code == 400
            else:
                assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    batch(20)  # warm every code path (caches, pools, lazily built tables) before measuring
    gc.collect()
    objects, rss = len(gc.get_objects()), rss_kib()
    batch(200)
    gc.collect()
    grown_objects, grown_rss = len(gc.get_objects()) - objects, rss_kib() - rss
    # A leaked job, queue, task or response per request would add hundreds of objects each time.
    assert grown_objects < 500, f"{grown_objects} more live objects after 200 requests"
    assert grown_rss < 8 * 1024, f"RSS grew by {grown_rss} KiB over 200 requests"
    assert chat(server).json()["choices"][0]["message"]["content"] == reference


# --- review fixes: malformed tools, element indexes, bounded messages -----------------------------------
@pytest.mark.parametrize("tools, tool_choice, needle", [
    ([{"type": 5}], None, "tools[0].type"),
    ([{"type": None, "function": None}], None, "tools[0].type"),
    ([{"function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "retrieval", "x": 1}], "auto", "unsupported tool type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "not an object"}}], None,
     "tools[0].function.parameters"),
    ([5, "x", None], "none", "tools[0]"),
])
def test_malformed_tools_are_400(server, reference, tools, tool_choice, needle):
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    for path, body in (("/v1/chat/completions", {**GREEDY, "tools": tools, **extra}),
                       ("/apply-template", {"messages": MESSAGES, "tools": tools, **extra})):
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert needle in r.json()["error"]["message"]
    assert chat(server).json()["choices"][0]["message"]["content"] == reference


def test_tool_call_arguments_that_are_not_json_are_400(server):
    msgs = MESSAGES + [{"role": "assistant", "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{bad json"}}]},
                       {"role": "tool", "content": "ok"}]
    for path, body in (("/v1/chat/completions", {**GREEDY, "messages": msgs}), ("/apply-template", {"messages": msgs})):
        r = server.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "messages[2].tool_calls[0].function.arguments is not valid JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"prompt": ["turn on", 5, 6, 99999], "max_tokens": 2}, "'prompt[3]' = 99999"),
    ("/tokenize", {"content": ["turn on", 5, 99999]}, "'content[2]' = 99999"),
    ("/tokenize", {"content": [5, 99999]}, "'content[1]' = 99999"),
])
def test_bad_token_id_errors_name_the_element(server, path, body, needle):
    r = server.post(path, json=body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert needle in message and "][0]" not in message, message


@pytest.mark.parametrize("fields, needle", [
    ({"reasoning_format": "x" * 2_000_000}, "reasoning_format"),
    ({"messages": [{"role": "x" * 2_000_000, "content": "hi"}]}, "messages[0].role"),
    ({"response_format": {"type": "x" * 2_000_000}}, "response_format"),
    ({"max_tokens": 1e300}, "max_tokens"),
    ({"logit_bias": {"x" * 2_000_000 + "0": "a"}}, "logit_bias"),
])
def test_error_messages_do_not_echo_huge_values(server, fields, needle):
    r = chat(server, **fields)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert needle in message and len(message) < 300, message[:400]


def test_rejected_too_large_series_is_exported(server):
    assert 'genie_rt_requests_rejected_total{reason="too_large"}' in metric_values(server.get("/metrics").text)


def test_serve_warm_up_leaves_the_prompt_path_nothing_to_build(fixture_gguf, monkeypatch):
    """`genie-rt serve` warms the prompt path before it says ready: the first request's
    length bound (prompt_limits.TextBudget) must not walk the vocabulary (0.7 s for Gemma 3's,
    2026-12-03)."""
    from genie_rt.engine.tokenizer import Tokenizer
    from genie_rt.server.app import warm_up
    from genie_rt.server.prompt_limits import TextBudget
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=N_CTX))
    assert engine.tokenizer._max_piece is None
    warm_up(engine)
    assert engine.tokenizer._max_piece is not None
    walked = []
    monkeypatch.setattr(Tokenizer, "_piece", lambda self, i: walked.append(i))
    monkeypatch.setattr(Tokenizer, "token_to_piece", lambda self, i: walked.append(i))
    assert TextBudget(engine.tokenizer).max_token_chars > 1 and not walked
