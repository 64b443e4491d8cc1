"""The HTTP server's answers to what a hostile or careless client sends (the fixture model on a real
uvicorn, as test_server.py): every malformed body and invalid field a 400 naming the field, never
a crash or a changed answer afterwards; a disconnect or client timeout that frees the worker at
once; no memory growth over many requests; malformed tools and bad token ids named.
"""
from __future__ import annotations

import gc
import socket
import time

import httpx
import pytest

from test_server_support import GREEDY, MESSAGES, N_CTX, chat, metric_values, stream_chat, wait_idle


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
def test_disconnect_mid_stream_cancels_and_frees_the_worker(server, reference):
    before = wait_idle(server)
    long = {**GREEDY, "max_tokens": N_CTX, "ignore_eos": True, "stream": True}
    with server.stream("POST", "/v1/chat/completions", json=long) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
    # the stream is closed: the generation must stop long before N_CTX tokens
    after = wait_idle(server)
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
    wait_idle(server)
    assert chat(server).json()["choices"][0]["message"]["content"] == reference


def test_client_timeout_cancels_non_streamed_request(server, reference):
    before = wait_idle(server)
    long = {**GREEDY, "max_tokens": N_CTX, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(server.base_url) + "/v1/chat/completions", json=long, timeout=0.2)
    after = wait_idle(server)
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
