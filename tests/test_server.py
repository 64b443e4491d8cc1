"""The HTTP server with the real fixture model (random weights, 2 layers) on a real uvicorn.

What a client written against llama-server relies on: response and chunk shapes, SSE
framing, the official openai client streaming and not, deterministic text at temperature 0
and with a seed, the other routes, /metrics that parses. Invalid requests, disconnects and
memory growth are in test_server_invalid.py; scripted replies (tool calls, reasoning,
failures, the queue) in test_server_scripted.py.
"""
from __future__ import annotations


import httpx
import openai

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import create_app

from test_server_support import (GREEDY, MESSAGES, N_CTX, chat, metric_values, running_server, sse_events,
                                 stream_chat, wait_idle)


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
    after = wait_idle(server)  # the worker thread may still be between Done and idle
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
