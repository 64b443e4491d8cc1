"""Server pieces without HTTP: request validation, the streaming parser, metrics text, the worker."""
from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from genie_rt.engine.generate import Delta, Done, GenerationRequest, GenerationResult
from genie_rt.server import chat_request, completion_request, schemas
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


def _stream(pieces, **kw):
    """(content, reasoning, calls) added up from the streamed deltas of `pieces`, and the
    non-streamed (content, reasoning, calls) of the same text; kw go to ChatOutput."""
    stream = ChatOutput(**kw)
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.feed("", final=True)
    final = ChatOutput(**kw)
    final.text = "".join(pieces)
    msg, _ = final.message()
    streamed = ("".join(d.get("content", "") for d in deltas),
                "".join(d.get("reasoning_content", "") for d in deltas),
                [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d])
    plain = (msg["content"] or "", msg.get("reasoning_content", ""),
             [c["function"] for c in msg.get("tool_calls", [])])
    return streamed, plain


def test_stream_whitespace_before_think_is_held_back():
    # Case A of the review: "\n\n" went out as content, then "Done." never did.
    streamed, plain = _stream(["\n\n", "<think>", "pondering", "</think>", "Done."],
                              parse_reasoning=True, think_open=False, parse_tools=False)
    assert plain == ("Done.", "pondering", [])
    assert streamed == plain
    # whitespace that no <think> follows is released verbatim, as the non-streamed message has it
    streamed, plain = _stream(["\n", "\n", "Hi"], parse_reasoning=True, think_open=False, parse_tools=False)
    assert streamed == plain == ("\n\nHi", "", [])


STRAY = ["Let me ", "check. ", "</think>", "\n\nThe kitchen ", "is dimmed."]


@pytest.mark.parametrize("tools", [False, True])
def test_stream_stray_think_end(tools):
    # Case B of the review: the text before '</think>' went out as content and then again as
    # reasoning, and what followed was dropped.
    kw = dict(parse_reasoning=True, parse_tools=tools)
    # the prompt opened the block: the text before </think> is reasoning
    streamed, plain = _stream(STRAY, think_open=True, **kw)
    assert streamed == plain == ("The kitchen is dimmed.", "Let me check.", [])
    # it did not (as llama-server): a stray </think> is ordinary content
    streamed, plain = _stream(STRAY, think_open=False, **kw)
    text = "".join(STRAY)
    assert streamed == plain == (text.strip() if tools else text, "", [])
    # split_reasoning's inference (infer_open): reasoning, and the stream holds content back for it
    streamed, plain = _stream(STRAY, think_open=False, infer_open=True, **kw)
    assert streamed == plain == ("The kitchen is dimmed.", "Let me check.", [])


def test_stream_sends_plain_content_without_waiting():
    out = ChatOutput(parse_reasoning=True, think_open=False, parse_tools=True)
    assert out.feed("  ") == [] and out.feed("<thi") == []          # could still be <think>
    assert out.feed("s is") == [{"content": "<this is"}]
    assert out.feed(" it </thi") == [{"content": " it </thi"}]    # no block: content as it comes
    assert out.feed("nk> <tool_c") == [{"content": "nk>"}]         # a tool tag being written waits


_ATOMS = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}',
          '{"name": "g"}', "{bad", "<thi", "</thi", "<tool_c", "</tool_", "<", "/", "\n", "\n\n", " ",
          "  ", "Done.", "Hi", "ok", "é"]


def _random_cut(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_streamed_deltas_add_up_for_random_replies_and_cuts():
    rng = random.Random(20240601)
    failures = []
    for trial in range(3000):
        text = "".join(rng.choice(_ATOMS) for _ in range(rng.randint(0, 9)))
        kw = dict(parse_reasoning=trial % 7 != 0, think_open=rng.random() < 0.3,
                  parse_tools=rng.random() < 0.5, infer_open=rng.random() < 0.25)
        pieces = list(text) if trial % 3 == 0 else _random_cut(rng, text)  # token by token, or chunks
        streamed, plain = _stream(pieces, **kw)
        if streamed != plain:
            failures.append((text, pieces, kw, streamed, plain))
    assert not failures, f"{len(failures)} mismatches, first: {failures[0]}"


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


def test_metrics_count_a_request_once_whatever_its_choices():
    """n choices: the prompt, cache use and finish count with choice 0; every choice's tokens."""
    m = Metrics()
    for i in range(4):
        m.on_result(_result(n_cached=0 if i == 0 else 10, prompt_ms=5.0 if i == 0 else 0.5), 0.1, index=i)
    text = m.render(processing=0, queued=0, kv_tokens=0, n_ctx=0)
    assert "llamacpp:prompt_tokens_total 10\n" in text and "genie_rt_prefix_cache_hits_total 0\n" in text
    assert "llamacpp:tokens_predicted_total 12\n" in text
    assert 'genie_rt_requests_finished_total{reason="stop"} 1' in text


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


def test_worker_logs_each_requests_timings_once(caplog):
    """One "request timings" line per request (llama-server prints its timings likewise): the
    queue, the first event and first text, the prompt's counts and prefill time."""
    import logging
    worker = EngineWorker(FlakyEngine(), max_queue=2)
    worker.start()
    try:
        with caplog.at_level(logging.INFO, logger="genie_rt.server"):
            assert asyncio.run(_run_jobs(worker, 2)) == ["Done", "RuntimeError"]
    finally:
        assert worker.stop(timeout=5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request timings")]
    r = _result()
    assert len(lines) == 1 and f"prompt {r.n_prompt} tokens, {r.n_cached} reused" in lines[0]
    assert "first text after" in lines[0] and " - ms" not in lines[0]


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


# --- review fixes: tools, token-id indexes, bounded error messages, metrics -------------------------------
def _api_error(fn, *args) -> str:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value.message


SET_LIGHT = {"type": "function", "function": {"name": "set_light", "description": "Switch a light.",
                                              "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("tools, needle", [
    ([{"type": 5}], "tools[0].type is 5"),
    ([{"type": None, "function": None}], "'tools[0].type' is missing"),     # as llama-server: a type is required
    ([{"function": {"name": "f"}}], "'tools[0].type' is missing"),
    ([{"type": "function", "function": None}], "tools[0].function must be an object"),
    ([{"type": "retrieval", "x": 1}], 'tools[0].type is "retrieval": unsupported tool type'),
    ([{"type": "function", "function": {"name": "f", "parameters": "not an object"}}], "tools[0].function.parameters"),
    ([SET_LIGHT, {"type": "function", "function": {"name": ""}}], "tools[1].function.name"),
    ([SET_LIGHT, {"type": "function", "function": {"name": "f", "description": 3}}], "tools[1].function.description"),
    ([5, "x", None], "tools[0] must be an object, got number"),
])
@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_malformed_tools_are_400_whatever_tool_choice(tools, needle, choice):
    body = {"tools": tools, **({"tool_choice": choice} if choice else {})}
    assert needle in _api_error(chat_request.parse_tools, body)


def test_well_formed_tools_pass_unchanged():
    tools = [SET_LIGHT, {"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g", "parameters": None}}]
    assert chat_request.parse_tools({"tools": tools}) is tools
    assert chat_request.parse_tools({"tools": tools, "tool_choice": "none"}) is None


@pytest.mark.parametrize("arguments, needle", [
    ("{bad json", "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ("[1, 2]", "messages[1].tool_calls[0].function.arguments must encode a JSON object"),
    (5, "messages[1].tool_calls[0].function.arguments must be a JSON string or an object, got number"),
])
def test_tool_call_arguments_must_be_a_json_object(arguments, needle):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    assert needle in _api_error(chat_request.chat_messages, {"messages": msgs})
    msgs[1]["tool_calls"][0]["function"]["arguments"] = '{"room": "hall"}'
    assert chat_request.chat_messages({"messages": msgs})[1] == msgs[1]          # good ones pass as sent


def test_token_id_errors_name_the_element():
    assert "'prompt[3]' = 99999" in _api_error(completion_request.parse_prompt, ["turn on", 5, 6, 99999], VOCAB)
    assert "'prompt[2]'" in _api_error(completion_request.parse_prompt, [5, 6, 99999], VOCAB)
    assert "'tokens[1]' = 99999" in _api_error(completion_request.validate_token_ids, [5, 99999], "tokens", VOCAB)
    # /tokenize's mixed content: strings and ids, the bad id named by its own index
    from types import SimpleNamespace

    from genie_rt.server.jobs import tokenize_content
    st = SimpleNamespace(engine=SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text, **kw: [1, 2])),
                         vocab_size=VOCAB)
    assert tokenize_content(st, ["turn on", 5], False, True) == [1, 2, 5]
    message = _api_error(tokenize_content, st, ["turn on", 5, 99999], False, True)
    assert "'content[2]' = 99999" in message and "[2][0]" not in message
    assert "'content[1]' = 99999" in _api_error(tokenize_content, st, [5, 99999], False, True)


def test_rejected_series_all_start_at_zero():
    text = Metrics().render(processing=0, queued=0, kv_tokens=0, n_ctx=0)
    for reason in ("queue_full", "invalid", "too_large"):
        assert f'genie_rt_requests_rejected_total{{reason="{reason}"}} 0\n' in text


BIG = "x" * 2_000_000


@pytest.mark.parametrize("fields, needle", [
    ({"reasoning_format": BIG}, "'reasoning_format'"),
    ({"messages": [{"role": BIG, "content": "hi"}]}, "'messages[0].role'"),
    ({"messages": [{"role": None, "content": "hi"}]}, "'messages[0].role'"),
    ({"messages": [{"role": "user", "content": [{"type": BIG}]}]}, "'messages[0].content[0].type'"),
    ({"messages": [5]}, "'messages[0]' must be an object, got a number"),
    ({"messages": [{"role": "user", "content": {}}]}, "got an object"),
    ({"messages": [{"role": "user", "content": [None]}]}, "'messages[0].content[0]' must be an object, got null"),
    ({"messages": {"a": 1}}, "'messages' must be an array"),
    ({"response_format": {"type": BIG}}, "'response_format.type'"),
    ({"logit_bias": {BIG + "0": "a"}}, "'logit_bias'"),
    ({"logit_bias": [[10 ** 4000, 1]]}, "an integer of 4001 digits"),
    ({"max_tokens": 1e300}, "'max_tokens' must be between -1 and 2147483647, got 1e+300"),
    ({"max_tokens": 10 ** 300}, "'max_tokens'"),
    ({"prompt_tokens_x": 1, "seed": 2 ** 70}, "'seed'"),
    ({"tools": [{"type": BIG}]}, "tools[0].type"),
])
def test_error_messages_are_short_json_worded_and_name_the_field(fields, needle):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    message = _api_error(chat_request.parse_chat, body, VOCAB, tokenize)
    assert needle in message and len(message) < 300, message[:400]
    for python_word in ("NoneType", "got dict", "got int", "got str", "got list", "sys.set_int_max_str_digits"):
        assert python_word not in message, message


def test_overlong_integer_literals_name_their_field():
    raw = b'{"messages": [], "max_tokens": 1' + b"0" * 5000 + b"}"
    message = _api_error(schemas.parse_json_body, raw)
    assert "'max_tokens'" in message and "5001 digits" in message and "sys." not in message
    raw = b'{"logit_bias": [[5, 1], [-' + b"9" * 6000 + b", 2]]}"
    assert "'logit_bias[1][0]' has 6000 digits" in _api_error(schemas.parse_json_body, raw)


def test_api_errors_are_capped_whatever_built_them():
    err = ApiError(400, "the chat template refused these messages: " + BIG)
    assert len(err.message) <= 1024 and err.message.endswith("characters, cut)")


def test_forced_tool_start_closes_an_open_think_block_and_needs_tool_call_blocks():
    from types import SimpleNamespace

    from genie_rt.server.generation import forced_tool_start
    hermes = SimpleNamespace(source="... <tool_call> ...")
    assert forced_tool_start(hermes, "<|im_start|>assistant\n", None) == ""
    assert forced_tool_start(hermes, "<|im_start|>assistant\n", True) == "<tool_call>\n"
    assert forced_tool_start(hermes, "<|im_start|>assistant\n<think>\n", True) == "</think>\n\n<tool_call>\n"
    assert forced_tool_start(hermes, "x", 'l"ight') == '<tool_call>\n{"name": "l\\"ight", "arguments": '
    other = SimpleNamespace(source="{{ messages }} [TOOL_CALLS]")       # another call format
    assert forced_tool_start(other, "x", True) == ""


def test_a_forced_call_after_an_open_think_block_parses_as_a_call_without_reasoning():
    import json as _json

    from genie_rt.server.openai_format import ChatOutput
    out = ChatOutput(parse_reasoning=True, think_open=True, parse_tools=True)
    out.text = "</think>\n\n<tool_call>\n"                            # forced_tool_start's text
    deltas = []
    for piece in ('{"name": "light_set", ', '"arguments": {"level": 3}}', "\n</tool_call>"):
        deltas += out.feed(piece)
    deltas += out.feed("", final=True)
    msg, has_calls = out.message()
    assert has_calls and "reasoning_content" not in msg and msg["content"] is None
    assert _json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"level": 3}
    assert not any("content" in d or "reasoning_content" in d for d in deltas)


def test_native_completion_stop_type_and_stopping_word():
    from genie_rt.engine.generate import GenerationResult
    from genie_rt.server.openai_format import NativeCompletionFormatter, stop_type

    def result(finish, word):
        return GenerationResult(text="x", tokens=[1], finish_reason=finish, stop_word=word, n_prompt=5,
                                n_cached=2, prompt_ms=1.0, n_generated=1, gen_ms=1.0)
    assert stop_type(result("stop", None)) == "eos"
    assert stop_type(result("stop", "\n\n")) == "word"
    assert stop_type(result("length", None)) == "limit"
    from types import SimpleNamespace
    gen = schemas.parse_generation({"stop": ["\n\n"]}, VOCAB, lambda t: [])
    st = SimpleNamespace(model_name="m", engine=SimpleNamespace(n_ctx=64, tokenizer=SimpleNamespace(eot_ids={7})))
    req = completion_request.CompletionRequest(gen=gen, prompt="hi")
    j = NativeCompletionFormatter(st, req, [1] * 5).response("x", [9], result("stop", "\n\n"))
    assert (j["stop_type"], j["stopping_word"], j["tokens_cached"], j["tokens_evaluated"]) == ("word", "\n\n", 6, 5)
    assert j["generation_settings"]["n_predict"] == -1 and j["timings"]["cache_n"] == 2
    assert j["tokens"] == [] and j["truncated"] is False and j["generation_settings"]["logit_bias"] == []
    # every key llama-server's generation_settings has
    assert {"adaptive_target", "adaptive_decay", "dry_multiplier", "mirostat", "samplers", "n_keep", "grammar",
            "top_n_sigma", "xtc_probability", "typical_p", "reasoning_format", "lora"} <= set(j["generation_settings"])
    # ignore_eos: the end-of-generation tokens are reported banned (bias null = -inf), as llama-server
    gen = schemas.parse_generation({"ignore_eos": True}, VOCAB, lambda t: [])
    j = NativeCompletionFormatter(st, completion_request.CompletionRequest(gen=gen, prompt="hi", return_tokens=True),
                                  [1] * 5).response("x", [9], result("length", None))
    assert j["generation_settings"]["logit_bias"] == [{"bias": None, "token": 7}] and j["tokens"] == [9]
    # the context filled (5 + 59 = 64) before any n_predict: truncated
    full = GenerationResult(text="x", tokens=[1] * 59, finish_reason="length", stop_word=None, n_prompt=5,
                            n_cached=0, prompt_ms=1.0, n_generated=59, gen_ms=1.0)
    assert NativeCompletionFormatter(st, req, [1] * 5).response("x", [], full)["truncated"] is True


def test_ollama_generate_gives_a_base_model_its_prompt_as_is():
    """/api/generate applies the chat template, except with `raw` or for a base model (the plain
    transcript fallback), whose prompt is continued as is - as Ollama's `{{ .Prompt }}` template
    and `genie-rt run` do; a `system` is then its first paragraph."""
    from genie_rt.server.ollama import generate_body
    body = {"prompt": "The capital of France is", "system": "Be brief.", "stream": False}
    chat = generate_body(body)
    assert "prompt" not in chat and chat["messages"][-1] == {"role": "user", "content": body["prompt"]}
    assert generate_body(body, base_model=True)["prompt"] == "Be brief.\n\nThe capital of France is"
    assert generate_body({**body, "system": None}, base_model=True)["prompt"] == body["prompt"]
    assert generate_body({**body, "raw": True})["prompt"] == body["prompt"]     # raw: no system either


def test_parallel_tool_calls_reaches_the_chat_body_from_every_api():
    """Responses' parallel_tool_calls and Anthropic's tool_choice.disable_parallel_tool_use become the
    chat body's parallel_tool_calls (one call a reply; server/jobs.py tool_grammar)."""
    from genie_rt.server import anthropic, responses
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    r = responses.to_chat_body({"input": "hi", "tools": tools, "parallel_tool_calls": False})
    assert r["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in responses.to_chat_body({"input": "hi", "tools": tools})
    a_tools = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tools": a_tools}
    one = anthropic.to_chat_body({**body, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert one["parallel_tool_calls"] is False and one["tool_choice"] == "required"
    assert "parallel_tool_calls" not in anthropic.to_chat_body({**body, "tool_choice": {"type": "auto"}})
    with pytest.raises(ApiError, match="disable_parallel_tool_use' must be a boolean"):
        anthropic.to_chat_body({**body, "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}})
