"""llama-server's streamed telemetry on the fixture model (real engine, CPU, real uvicorn):
`return_progress` (prompt_progress chunks, one per -b/--batch-size tokens of the prompt) and
`timings_per_token` (the timings so far on every streamed chunk), on /completion,
/v1/completions, /v1/chat/completions and /v1/responses; and the engine's Progress events
behind them (a prompt run in pieces gives the same tokens as in one pass)."""
from __future__ import annotations

import math

import httpx
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import Delta, Done, GenerationRequest, Progress
from genie_rt.engine.sampling import SamplingParams
from genie_rt.server.app import ServerSettings, create_app

from test_server_support import running_server, sse_events

N_BATCH = 16
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


@pytest.fixture(scope="module")
def engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=256))


@pytest.fixture(scope="module")
def client(engine):
    with running_server(create_app(engine, ServerSettings(n_batch=N_BATCH))) as (base, _, _):
        with httpx.Client(base_url=base, timeout=60) as c:
            yield c


def _events(engine, prompt, progress_batch):
    engine.kv_tokens = []            # no reused prefix: every run processes the whole prompt
    return list(engine.generate(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0),
                                                  max_tokens=4, progress_batch=progress_batch)))


@pytest.mark.parametrize("bad", ["8", None, 2.5, True, -3])
def test_engine_refuses_a_progress_batch_that_is_not_a_count(engine, bad):
    with pytest.raises(ValueError, match="progress_batch"):
        _events(engine, engine.raw_prompt(PROMPT), bad)


def test_engine_reports_progress_per_batch_with_the_same_tokens(engine):
    prompt = engine.raw_prompt(PROMPT)
    assert len(prompt) > 2 * 8
    plain = _events(engine, prompt, 0)
    events = _events(engine, prompt, 8)
    progress = [e for e in events if isinstance(e, Progress)]
    assert not any(isinstance(e, Progress) for e in plain)
    assert [p.processed for p in progress] == [0, *range(8, len(prompt), 8), len(prompt)]
    assert all(p.total == len(prompt) and p.cache == 0 for p in progress)
    assert progress[0].prompt_ms == 0.0 and progress[-1].prompt_ms > 0
    assert events.index(progress[-1]) < min(i for i, e in enumerate(events) if isinstance(e, Delta))
    tokens = [t for e in events if isinstance(e, Delta) for t in e.tokens]
    assert tokens == [t for e in plain if isinstance(e, Delta) for t in e.tokens]
    assert all(e.stats.n_generated >= 1 and e.stats.prompt_ms > 0 for e in events if isinstance(e, Delta))
    # a reused prefix: the first report has processed == cache > 0
    again = list(engine.generate(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0),
                                                   max_tokens=1, progress_batch=8)))
    first = next(e for e in again if isinstance(e, Progress))
    assert first.cache == first.processed == len(prompt) - 1
    assert isinstance(again[-1], Done)


def _n_prompt(client, prompt) -> int:
    return client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"].__len__()


def test_completion_stream_reports_progress_and_timings(client):
    body = {"prompt": PROMPT, "n_predict": 4, "stream": True, "return_progress": True, "timings_per_token": True,
            "cache_prompt": False, "ignore_eos": True}
    with client.stream("POST", "/completion", json=body) as r:
        chunks = sse_events(r)
    progress = [c for c in chunks if "prompt_progress" in c]
    n = progress[0]["prompt_progress"]["total"]
    assert n == _n_prompt(client, PROMPT)
    assert len(progress) == 1 + math.ceil((n - progress[0]["prompt_progress"]["cache"]) / N_BATCH)
    assert progress[-1]["prompt_progress"]["processed"] == n
    first = progress[0]["timings"]
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0 and first["predicted_n"] == 0
    assert all(c["content"] == "" and c["tokens"] == [] and c["stop"] is False for c in progress)
    ms = [c["timings"]["prompt_ms"] for c in progress]
    assert ms == sorted(ms) and ms[-1] > 0
    text = [c for c in chunks if c.get("tokens")]
    assert text and all(c["timings"]["predicted_n"] == c["tokens_predicted"] for c in text)
    assert chunks[-1]["stop"] is True and chunks[-1]["generation_settings"]["timings_per_token"] is True


def test_without_the_fields_no_telemetry(client):
    with client.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 3, "stream": True}) as r:
        chunks = sse_events(r)
    assert not any("prompt_progress" in c for c in chunks)
    assert not any("timings" in c for c in chunks[:-1]) and "timings" in chunks[-1]
    # not streamed: return_progress has nothing to report on, the answer is the usual one
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "return_progress": True})
    assert r.status_code == 200 and "prompt_progress" not in r.json()
    r = client.post("/completion", json={"prompt": PROMPT, "return_progress": "yes"})
    assert r.status_code == 400 and "return_progress" in r.json()["error"]["message"]


def test_chat_stream_progress_counts_the_reused_prefix(client):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True,
            "return_progress": True}
    runs = []
    for _ in range(2):
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            runs.append([c["prompt_progress"] for c in sse_events(r) if isinstance(c, dict) and "prompt_progress" in c])
    cold, warm = runs
    assert cold[0]["cache"] == cold[0]["processed"] and cold[-1]["processed"] == cold[-1]["total"]
    assert [p["processed"] for p in cold] == sorted(set(p["processed"] for p in cold))
    assert warm[0]["cache"] == warm[0]["processed"] == warm[0]["total"] - 1 and len(warm) == 2


def test_v1_completions_and_responses_stream_telemetry(client):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "return_progress": True, "timings_per_token": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [c for c in sse_events(r) if isinstance(c, dict)]
    progress = [c for c in chunks if "prompt_progress" in c]
    assert progress and all(c["choices"][0]["text"] == "" and "timings" in c for c in progress)
    assert all("timings" in c for c in chunks if c["choices"] and c["choices"][0]["text"])
    body = {"input": PROMPT, "max_output_tokens": 3, "stream": True, "return_progress": True,
            "timings_per_token": True, "temperature": 0}
    with client.stream("POST", "/v1/responses", json=body) as r:
        events = sse_events(r)
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    assert "timings" in events[-1] and events[-1]["type"] == "response.completed"


def test_n_choices_share_one_prompt_progress(engine, client):
    """n > 1: the prompt is processed once, so its Progress events come once, before choice 0;
    every choice's Deltas carry their own counts (a later choice has the whole prompt cached)."""
    prompt = engine.raw_prompt(PROMPT)
    engine.kv_tokens = []
    events = list(engine.generate(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0),
                                                    max_tokens=3, ignore_eos=True, progress_batch=8, n=2)))
    progress = [i for i, e in enumerate(events) if isinstance(e, Progress)]
    assert progress == list(range(len(progress))) and len(progress) == 1 + math.ceil(len(prompt) / 8)
    assert events[progress[-1]].processed == len(prompt)
    assert [e.index for e in events if isinstance(e, Done)] == [0, 1]
    deltas = [e for e in events if isinstance(e, Delta)]
    assert {e.index for e in deltas} == {0, 1}
    assert all(e.stats.n_cached == (0 if e.index == 0 else len(prompt)) for e in deltas)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True, "n": 2,
            "ignore_eos": True, "return_progress": True, "timings_per_token": True, "cache_prompt": False}
    engine.kv_tokens = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [c for c in sse_events(r) if isinstance(c, dict)]
    kinds = ["p" if "prompt_progress" in c else "t" for c in chunks
             if "prompt_progress" in c or (c["choices"] and (c["choices"][0]["delta"].get("content")
                                                             or c["choices"][0]["finish_reason"]))]
    n_progress = kinds.count("p")
    assert n_progress >= 2 and kinds[:n_progress] == ["p"] * n_progress    # progress once, before any text
    assert all(c["choices"][0]["index"] == 0 for c in chunks if "prompt_progress" in c)
    last_progress = [c for c in chunks if "prompt_progress" in c][-1]["prompt_progress"]
    assert last_progress["processed"] == last_progress["total"]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [0, 1]
    assert all("timings" in c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
