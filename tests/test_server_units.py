"""Server pieces without HTTP: request validation, the streaming parser, metrics text, the worker."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from genie_rt.engine.generate import Delta, Done, GenerationRequest, GenerationResult
from genie_rt.server import schemas
from genie_rt.server.errors import ApiError, json_bytes
from genie_rt.server.metrics import Metrics
from genie_rt.server.openai_format import ChatOutput
from genie_rt.server.worker import EngineWorker, Job, QueueFull, ShuttingDown

VOCAB = 1000


def tokenize(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def gen(**body):
    return schemas.parse_generation(body, VOCAB, tokenize)


# --- schemas ----------------------------------------------------------------------------------------------
def test_max_tokens_spellings_and_precedence():
    assert gen().max_tokens is None
    assert gen(max_tokens=-1).max_tokens is None
    assert gen(max_tokens=5).max_tokens == 5
    assert gen(max_tokens=5, max_completion_tokens=6).max_tokens == 6
    assert gen(max_tokens=5, max_completion_tokens=6, n_predict=7).max_tokens == 7
    assert gen(max_tokens=8.0).max_tokens == 8
    assert gen(max_tokens=None).max_tokens is None


def test_llama_server_conventions():
    p = gen(seed=-1, top_k=-1, repeat_penalty=0).params
    assert p.seed is None and p.top_k == 0 and p.repeat_penalty == 1.0
    assert gen(seed=0xFFFFFFFF).params.seed is None
    assert gen(seed=0).params.seed == 0
    assert gen(top_k=VOCAB + 5).params.top_k == 0
    assert gen(stop="x").stop == ["x"]
    assert gen(stop=["a", "", "a", "b"]).stop == ["a", "b"]
    assert gen(stream=True, stream_options={"include_usage": True}).include_usage


def test_logit_bias_forms():
    assert gen(logit_bias={"5": 1.5, "6": False}).params.logit_bias == {5: 1.5, 6: -math.inf}
    assert gen(logit_bias=[[5, -1], [7, False]]).params.logit_bias == {5: -1.0, 7: -math.inf}
    assert gen(logit_bias={"ab": 2}).params.logit_bias == {ord("a"): 2.0, ord("b"): 2.0}
    assert gen(logit_bias=[["ab", 2]]).params.logit_bias == {ord("a"): 2.0, ord("b"): 2.0}
    for bad in ({str(VOCAB): 1}, {"5": "x"}, {"5": True}, [[5, 1, 2]], [5], {"5": 1e10},
                {"99999999999999": 3}, [["99999999999999", 3]], {"9" * 5000: 1}):   # ids, never text
        with pytest.raises(ApiError):
            gen(logit_bias=bad)


def test_stop_limits():
    assert len(gen(stop=[str(i) for i in range(schemas.MAX_STOP_STRINGS)]).stop) == schemas.MAX_STOP_STRINGS
    with pytest.raises(ApiError, match="limit"):
        gen(stop=[str(i) for i in range(schemas.MAX_STOP_STRINGS + 1)])
    # the limit counts distinct strings, and is applied while reading: a body with 200,000
    # stop strings is refused after the first MAX_STOP_STRINGS + 1 (parsing runs on the
    # event loop; a check after a quadratic de-duplication once froze the server)
    assert gen(stop=["x"] * 10_000 + ["y"]).stop == ["x", "y"]
    seen = []

    class Spy(list):
        def __iter__(self):
            for i, w in enumerate(list.__iter__(self)):
                seen.append(i)
                yield w
    with pytest.raises(ApiError, match="limit"):
        schemas.parse_stop({"stop": Spy(str(i) for i in range(200_000))})
    assert len(seen) == schemas.MAX_STOP_STRINGS + 1
    with pytest.raises(ApiError, match="limit"):
        gen(stop=["x" * (schemas.MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize("raw", [b'{"a": ' * 70 + b"1" + b"}" * 70, b'{"a": Infinity}', b"\xc3\x28", b"null", b"  "])
def test_json_body_rejects(raw):
    with pytest.raises(ApiError) as e:
        schemas.parse_json_body(raw)
    assert e.value.status == 400


def test_json_output_survives_lone_surrogates():
    body = schemas.parse_json_body(b'{"messages": "\\ud800 x"}')
    assert json.loads(json_bytes(body)) == {"messages": "? x"}


def test_conversation_id_rule():
    assert gen(conversation_id="kitchen_2-a").conversation_id == "kitchen_2-a"
    for bad in ("", "a/b", "x" * 65, "..", "é"):
        with pytest.raises(ApiError):
            gen(conversation_id=bad)


# --- streaming parser ---------------------------------------------------------------------------------------
REPLIES = [
    ("Plain answer with < and <tool and </think but no tags.", False, False),
    ('  Sure.\n<tool_call>\n{"name": "light_set", "arguments": {"room": "hall"}}\n</tool_call>\n'
     '<tool_call>{"name": "fan", "arguments": "{\\"on\\": true}"}</tool_call>', True, False),
    ('<tool_call>{"name": broken json}</tool_call> text after', True, False),
    ("<think>\nplan: dim lights\n</think>\n\nOK, dimming.", False, False),
    ("still thinking about it\n</think>\nDone.", False, True),
    ('<think>x</think>\n<tool_call>{"name": "a", "arguments": {}}</tool_call>', True, False),
]


@pytest.mark.parametrize("text, tools, think_open", REPLIES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_deltas_add_up_to_the_final_message(text, tools, think_open, size):
    stream = ChatOutput(parse_reasoning=True, think_open=think_open, parse_tools=tools)
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i:i + size])
    deltas += stream.feed("", final=True)
    final = ChatOutput(parse_reasoning=True, think_open=think_open, parse_tools=tools)
    final.text = text
    msg, has_calls = final.message()
    assert "".join(d.get("content", "") for d in deltas) == (msg["content"] or "")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg.get("reasoning_content", "")
    streamed_calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed_calls == [c["function"] for c in msg.get("tool_calls", [])]
    assert has_calls == bool(streamed_calls)
    for d in deltas:
        if "tool_calls" in d:
            json.loads(d["tool_calls"][0]["function"]["arguments"])


def test_reasoning_format_none_returns_text_verbatim():
    out = ChatOutput(parse_reasoning=False, think_open=False, parse_tools=False)
    out.text = "<think>a</think> b"
    assert out.message() == ({"role": "assistant", "content": "<think>a</think> b"}, False)


# --- metrics ---------------------------------------------------------------------------------------------------
def _result(**kw) -> GenerationResult:
    base = dict(text="", tokens=[], finish_reason="stop", stop_word=None, n_prompt=10, n_cached=4,
                prompt_ms=5.0, n_generated=3, gen_ms=6.0)
    return GenerationResult(**{**base, **kw})


def test_metrics_text_counts():
    m = Metrics()
    text0 = m.render(processing=0, queued=0, kv_tokens=0, n_ctx=0)
    assert "llamacpp:kv_cache_usage_ratio 0.0" in text0
    m.on_result(_result(), 0.1)
    m.on_result(_result(finish_reason="cancelled", n_cached=0), 0.1)
    m.on_tool_calls()
    text = m.render(processing=1, queued=2, kv_tokens=13, n_ctx=100)
    assert "llamacpp:prompt_tokens_total 16\n" in text
    assert "llamacpp:tokens_predicted_total 6\n" in text
    assert "genie_rt_prefix_cache_hits_total 1\n" in text
    assert 'genie_rt_requests_finished_total{reason="tool_calls"} 1' in text
    assert 'genie_rt_requests_finished_total{reason="cancelled"} 1' in text
    assert "llamacpp:requests_deferred 2\n" in text and "llamacpp:kv_cache_tokens 13\n" in text


# --- worker --------------------------------------------------------------------------------------------------
class FlakyEngine:
    """Fails every other request; records the KV reset after a failure."""

    def __init__(self):
        self.calls = 0
        self.kv_tokens = [1, 2, 3]

    def generate(self, req):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("boom")
        yield Delta("x", [1])
        yield Done(_result())


async def _run_jobs(worker, n):
    loop = asyncio.get_running_loop()
    outcomes = []
    for _ in range(n):
        job = Job(GenerationRequest(prompt=[1]), loop)
        worker.submit(job)
        while True:
            ev = await asyncio.wait_for(job.next(), 10)
            if isinstance(ev, (Done, BaseException)):
                outcomes.append(type(ev).__name__)
                break
    return outcomes


def test_worker_survives_failures_and_drops_the_kv_prefix():
    engine = FlakyEngine()
    worker = EngineWorker(engine, max_queue=2, metrics=Metrics())
    worker.start()
    try:
        assert asyncio.run(_run_jobs(worker, 4)) == ["Done", "RuntimeError", "Done", "RuntimeError"]
        assert engine.kv_tokens == []
    finally:
        assert worker.stop(timeout=5)


def test_worker_queue_bound_cancel_and_stop():
    async def scenario():
        loop = asyncio.get_running_loop()
        worker = EngineWorker(FlakyEngine(), max_queue=1)   # not started: jobs stay queued
        a, b, c = (Job(GenerationRequest(prompt=[1]), loop) for _ in range(3))
        worker.submit(a)
        worker.submit(b)
        with pytest.raises(QueueFull):
            worker.submit(c)
        worker.cancel(b)
        assert worker.n_queued == 1 and b.finished and b.cancel.is_set()
        worker.submit(c)
        worker.drain()   # SIGTERM: nothing new, the queue goes on
        assert worker.is_draining and worker.n_queued == 2
        with pytest.raises(ShuttingDown):
            worker.submit(Job(GenerationRequest(prompt=[1]), loop))
        worker.stop(timeout=1)
        ev = await asyncio.wait_for(a.next(), 5)
        assert isinstance(ev, ShuttingDown)
        with pytest.raises(ShuttingDown):
            worker.submit(Job(GenerationRequest(prompt=[1]), loop))
    asyncio.run(scenario())
