"""n > 1 choices (`n`, llama-server's `n_cmpl`) on the CPU back-end with the fixture model.

What is promised (docs/server.md): the prompt is prefilled once and every choice draws its
first token from the logits it left; choice i uses seed + i, so it is the reply a one-choice
request with seed + i gets from the same (cold) cache; at temperature 0 all choices are the
same; constraints hold in every choice; chunks carry their choice's index and each choice
ends with its own finish chunk; usage counts the prompt once and the generated tokens of
all; a disconnect cancels the choices not written yet. The engine's sliding-window ring
restore (the CUDA back-end's Gemma 3 layers) is checked here on a CPU back-end that emulates
a ring; tests/test_cuda_archs.py checks it on the device (marker gpu).
"""
from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import Delta, Done, GenerationRequest
from genie_rt.engine.sampling import SamplingParams
from genie_rt.server.app import ServerSettings, create_app

from test_server import metric_values
from test_server_support import running_server, sse_events

N_CTX = 512
ASK = [{"role": "user", "content": "Say something about lights."}]
RANDOM = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["room", "level"],
          "properties": {"room": {"enum": ["kitchen", "hall"]},
                         "level": {"type": "integer", "minimum": 0, "maximum": 100}}}


@pytest.fixture(scope="module")
def engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=N_CTX))


@pytest.fixture(scope="module")
def base(engine):
    with running_server(create_app(engine, ServerSettings(max_queue=4))) as (url, _, _):
        yield url


def post(base, path, cold_engine=None, **body) -> httpx.Response:
    """POST; with `cold_engine`, its in-memory prefix is dropped first (the worker is idle between
    these sequential requests), so every request prefills its whole prompt."""
    if cold_engine is not None:
        cold_engine.kv_tokens = []
    return httpx.post(base + path, json=body, timeout=120)


def chat_texts(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["message"]["content"] for c in choices]


# --- the engine --------------------------------------------------------------------------------------
class CountingBackend:
    """The CPU back-end, with every prompt position it runs counted."""

    def __init__(self, backend):
        self._backend = backend
        self.prefills: list[tuple[int, int]] = []       # (start, n) of every prefill

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def prefill(self, tokens, start, cancel=None, all_logits=False):
        self.prefills.append((start, len(tokens)))
        return self._backend.prefill(tokens, start, cancel, all_logits)

    def prefill_sample(self, tokens, start, sampler, history, cancel=None, checked=False):
        self.prefills.append((start, len(tokens)))
        return self._backend.prefill_sample(tokens, start, sampler, history, cancel, checked)


def run(engine, prompt, n, seed, max_tokens=12):
    """(texts, results) of each choice, from a cold in-memory prefix."""
    engine.kv_tokens = []
    texts, results = [""] * n, [None] * n
    req = GenerationRequest(prompt=prompt, params=SamplingParams(**RANDOM, seed=seed), max_tokens=max_tokens,
                            ignore_eos=True, n=n)
    order = []
    for ev in engine.generate(req):
        if isinstance(ev, Delta):
            texts[ev.index] += ev.text
        else:
            assert isinstance(ev, Done)
            results[ev.index] = ev.result
            order.append(ev.index)
    assert order == list(range(n))
    return texts, results


def test_the_prompt_is_prefilled_once_and_choice_i_is_seed_plus_i(engine):
    prompt = engine.chat_prompt(ASK)
    counting = CountingBackend(engine.backend)
    engine.backend, real = counting, engine.backend
    stats_before = (engine.stats.requests, engine.stats.prompt_tokens, engine.stats.prompt_tokens_cached)
    try:
        texts, results = run(engine, prompt, 3, seed=40)
    finally:
        engine.backend = real
    assert counting.prefills == [(0, len(prompt))]       # one prefill for the three choices
    assert [r.n_cached for r in results] == [0, len(prompt), len(prompt)]
    assert all(r.n_prompt == len(prompt) and r.n_generated == 12 for r in results)
    s = engine.stats
    assert (s.requests, s.prompt_tokens, s.prompt_tokens_cached) == \
        (stats_before[0] + 1, stats_before[1] + len(prompt), stats_before[2])
    # choice i is the one-choice reply with seed 40 + i (the same cold cache): nothing of an
    # earlier choice leaks into a later one
    singles = [run(engine, prompt, 1, seed=40 + i)[0][0] for i in range(3)]
    assert texts == singles and len(set(texts)) > 1
    assert run(engine, prompt, 2, seed=40)[0] == texts[:2]     # n does not change a choice


class RingBackend(CountingBackend):
    """The CPU back-end as if layer 0 were a sliding-window ring of R slots (as the CUDA back-end
    keeps Gemma 3's windowed layers): writing position p overwrites p - R, here with values large
    enough to change every later reply that reads them. The engine must put the prompt's
    positions back (export_window / import_window, as it does on the device) between choices."""

    def __init__(self, backend, ring: int):
        super().__init__(backend)
        self.ring = ring
        pool = backend.kv
        slots = tuple(ring if i == 0 else pool.shape.n_ctx for i in range(pool.shape.n_layers))
        self.kv = SimpleNamespace(shape=dataclasses.replace(pool.shape, slots=slots),
                                  export_window=pool.export_window, import_window=pool.import_window)
        self.imported: list[tuple[int, int]] = []

    def ring_first(self, end):
        return max(0, end - self.ring)

    def kv_imported(self, first, end):
        self.imported.append((first, end))

    def decode_tokens(self, token, pos, sampler, history):
        while True:
            if pos >= self.ring:
                self._backend.kv.k[0, pos - self.ring] = 30.0
                self._backend.kv.v[0, pos - self.ring] = 30.0
            token = self._backend.decode_sample(token, pos, sampler, history)
            pos += 1
            yield token


def test_sliding_window_rings_are_put_back_between_choices(engine, monkeypatch, request):
    # the pool ends up holding scribbles: nothing in it may be reused after this test
    request.addfinalizer(lambda: setattr(engine, "kv_tokens", []))
    prompt = engine.chat_prompt(ASK)
    ring = RingBackend(engine.backend, 8)
    monkeypatch.setattr(engine, "backend", ring)
    texts, _ = run(engine, prompt, 3, seed=60, max_tokens=16)
    assert ring.prefills == [(0, len(prompt))]
    assert ring.imported == [(len(prompt) - 8, len(prompt))] * 2
    singles = [run(engine, prompt, 1, seed=60 + i, max_tokens=16)[0][0] for i in range(3)]
    assert texts == singles
    # the check above can fail: without the rings put back, the later choices read the scribbles
    monkeypatch.setattr(engine, "_ring_restore", lambda snapshot, end: None)
    broken, _ = run(engine, prompt, 3, seed=60, max_tokens=16)
    assert broken[0] == singles[0] and broken[1:] != singles[1:]


def test_a_cancel_between_choices_ends_with_a_cancelled_done(engine):
    """The server's shutdown sets the cancel flag at any time; a handler waits for a Done."""
    import threading
    cancel = threading.Event()
    req = GenerationRequest(prompt=engine.chat_prompt(ASK), max_tokens=3, ignore_eos=True, n=3, cancel=cancel)
    dones = []
    for ev in engine.generate(req):
        if isinstance(ev, Done):
            dones.append((ev.index, ev.result.finish_reason, ev.result.n_generated))
            cancel.set()
    assert dones == [(0, "length", 3), (1, "cancelled", 0)]


def test_n_is_checked_by_the_engine(engine):
    with pytest.raises(ValueError, match="'n'"):
        list(engine.generate(GenerationRequest(prompt=[1, 2], n=0)))


# --- /v1/chat/completions ------------------------------------------------------------------------------
def test_chat_choices_usage_and_seeds(base, engine):
    m0 = metric_values(httpx.get(base + "/metrics").text)
    r = post(base, "/v1/chat/completions", engine, messages=ASK, n=3, max_tokens=10, ignore_eos=True, seed=7,
             **RANDOM)
    texts = chat_texts(r)
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    one = post(base, "/v1/chat/completions", engine, messages=ASK, max_tokens=10, ignore_eos=True, seed=7,
               **RANDOM).json()
    assert body["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]       # counted once
    assert body["usage"]["completion_tokens"] == 30
    assert body["usage"]["total_tokens"] == 30 + one["usage"]["prompt_tokens"]
    m1 = metric_values(httpx.get(base + "/metrics").text)
    # the n = 3 request and the one-choice request each prefilled the prompt once
    assert m1["llamacpp:prompt_tokens_total"] - m0["llamacpp:prompt_tokens_total"] == \
        2 * one["usage"]["prompt_tokens"]
    assert texts[0] == one["choices"][0]["message"]["content"]
    for i in (1, 2):   # choice i: seed + i
        single = post(base, "/v1/chat/completions", engine, messages=ASK, max_tokens=10, ignore_eos=True,
                      seed=7 + i, **RANDOM)
        assert chat_texts(single) == [texts[i]]
    again = post(base, "/v1/chat/completions", engine, messages=ASK, n=3, max_tokens=10, ignore_eos=True,
                 seed=7, **RANDOM)
    assert chat_texts(again) == texts and len(set(texts)) > 1


def test_temperature_0_choices_are_equal(base):
    texts = chat_texts(post(base, "/v1/chat/completions", messages=ASK, n=3, max_tokens=8, temperature=0))
    assert len(texts) == 3 and texts[0] and texts[0] == texts[1] == texts[2]


def test_chat_stream_has_each_choice_with_its_finish_and_usage_at_the_end(base, engine):
    fields = dict(messages=ASK, n=3, max_tokens=10, ignore_eos=True, seed=11, **RANDOM)
    whole = chat_texts(post(base, "/v1/chat/completions", engine, **fields))
    engine.kv_tokens = []
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=120,
                      json={**fields, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    events = events[:-1]
    texts, roles, finishes, order = ["", "", ""], [0, 0, 0], [0, 0, 0], []
    for ev in events:
        for c in ev["choices"]:
            i = c["index"]
            assert finishes[i] == 0, "a chunk after its choice's finish chunk"
            if not order or order[-1] != i:
                order.append(i)
            roles[i] += c["delta"].get("role") == "assistant"
            texts[i] += c["delta"].get("content") or ""
            finishes[i] += c["finish_reason"] is not None
    assert order == [0, 1, 2]                     # one choice after another
    assert roles == [1, 1, 1] and finishes == [1, 1, 1] and texts == whole
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 30 and "timings" in last
    assert sum("usage" in ev for ev in events) == 1


def test_openai_client_n_3(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model="x", messages=ASK, n=3, max_tokens=6, temperature=0.9, seed=5)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in resp.choices)
    assert resp.usage.completion_tokens == sum(
        client.chat.completions.create(model="x", messages=ASK, max_tokens=6, temperature=0.9,
                                       seed=5 + i).usage.completion_tokens for i in range(3))
    pieces = {}
    for chunk in client.chat.completions.create(model="x", messages=ASK, n=3, max_tokens=6, temperature=0.9,
                                                seed=5, stream=True):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
    assert sorted(pieces) == [0, 1, 2] and all(pieces.values())


def test_constraints_and_logprobs_apply_to_every_choice(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="x", messages=ASK, n=3, max_tokens=60, temperature=1.0, seed=3, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "l", "schema": SCHEMA, "strict": True}})
    for c in r.choices:
        args = json.loads(c.message.content)
        assert set(args) == {"room", "level"} and args["room"] in ("kitchen", "hall")
        # each choice's own tokens; the grammar leaves some steps a single allowed token
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        assert all(1 <= len(t.top_logprobs) <= 2 for t in c.logprobs.content)
    tools = [{"type": "function", "function": {"name": "light_set", "parameters": SCHEMA}}]
    r = client.chat.completions.create(model="x", messages=ASK, n=2, max_tokens=60, temperature=1.0, seed=4,
                                       tools=tools, tool_choice="required")
    for c in r.choices:
        assert c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            assert call.function.name == "light_set" and json.loads(call.function.arguments)["room"]


# --- /v1/completions and /completion ------------------------------------------------------------------
def test_completions_choices_streamed_and_not(base, engine):
    fields = dict(prompt="The kitchen light", n=2, max_tokens=6, ignore_eos=True, seed=9, **RANDOM)
    body = post(base, "/v1/completions", engine, **fields).json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 12
    engine.kv_tokens = []
    with httpx.stream("POST", base + "/v1/completions", json={**fields, "stream": True}, timeout=120) as r:
        events = sse_events(r)
    assert events.pop() == "[DONE]"
    texts, finishes = ["", ""], []
    for ev in events:
        for c in ev["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finishes.append(c["index"])
    assert texts == [c["text"] for c in body["choices"]] and finishes == [0, 1]
    assert [ev["usage"]["completion_tokens"] for ev in events if "usage" in ev] == [12]


def test_native_completion_n_cmpl_answers_an_array(base, engine):
    fields = dict(prompt="The kitchen light", n_predict=6, ignore_eos=True, seed=9, **RANDOM)
    objs = post(base, "/completion", engine, n_cmpl=2, **fields).json()
    assert isinstance(objs, list) and [o["index"] for o in objs] == [0, 1]
    assert all(o["tokens_predicted"] == 6 and o["stop"] for o in objs)
    v1 = post(base, "/v1/completions", engine, n=2, max_tokens=6, **{k: v for k, v in fields.items()
                                                                      if k != "n_predict"}).json()
    assert [o["content"] for o in objs] == [c["text"] for c in v1["choices"]]
    engine.kv_tokens = []
    with httpx.stream("POST", base + "/completion", json={**fields, "n_cmpl": 2, "stream": True},
                      timeout=120) as r:
        events = sse_events(r)
    assert [e["index"] for e in events if e["stop"]] == [0, 1]
    assert "".join(e["content"] for e in events if e["index"] == 1) == objs[1]["content"]
    batch = post(base, "/completion", prompt=["a b", "c d"], n_cmpl=2, n_predict=2, temperature=0).json()
    assert [o["index"] for o in batch] == [0, 1, 2, 3]


# --- cancellation -----------------------------------------------------------------------------------------
def _idle(base) -> dict:
    deadline = time.monotonic() + 20
    while True:
        m = metric_values(httpx.get(base + "/metrics").text)
        if m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0:
            return m
        assert time.monotonic() < deadline, "the worker is still busy"
        time.sleep(0.02)


def test_disconnect_cancels_the_remaining_choices(base):
    before = _idle(base)
    long = dict(messages=ASK, n=4, max_tokens=N_CTX, ignore_eos=True, stream=True, temperature=0)
    with httpx.stream("POST", base + "/v1/chat/completions", json=long, timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        for _ in range(4):
            next(lines)
    after = _idle(base)
    # choice 0 is cancelled, choices 1..3 never start: far fewer tokens than 4 long replies
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < N_CTX
    finished = 'genie_rt_requests_finished_total{reason="cancelled"}'
    assert after[finished] == before[finished] + 1
    ok = post(base, "/v1/chat/completions", messages=ASK, n=2, max_tokens=3)
    assert len(chat_texts(ok)) == 2
