"""The official client libraries against a real server on loopback: `openai` (chat, completions,
responses, streaming, tools), `anthropic` (messages, streaming, tools, count_tokens) and `ollama`
(chat, generate, list, show, ps, streaming, tools) - what Home Assistant's Ollama integration and
Anthropic / Responses clients call, used unchanged.

Two servers per module: the fixture model itself (random weights, CPU) for shapes, streaming and
determinism, and the fixture's tokenizer and template with scripted replies
(test_server_support.ScriptedEngine) for tool calls and reasoning, which a random-weight model
cannot be made to write.
"""
from __future__ import annotations

import json

import httpx
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import ServerSettings, create_app

from test_server_support import ScriptedEngine, running_server

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "light_set", "description": "Set a light's brightness",
    "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "level": {"type": "integer"}},
                   "required": ["room", "level"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "light_set", "arguments": {"room": "kitchen", "level": 30}}\n</tool_call>'
ASK = [{"role": "user", "content": "Dim the kitchen to 30%"}]


@pytest.fixture(scope="module")
def real_engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=512))


@pytest.fixture(scope="module")
def real(real_engine):
    app = create_app(real_engine, ServerSettings(max_queue=4))
    with running_server(app) as (base, _, _):
        yield base


@pytest.fixture(scope="module")
def scripted_server(real_engine):
    engine = ScriptedEngine(real_engine)
    app = create_app(engine, ServerSettings(max_queue=4))
    with running_server(app) as (base, _, _):
        yield engine, base


@pytest.fixture
def scripted(scripted_server):
    engine, base = scripted_server
    engine.reply = lambda req: ["Hello", " there"]
    return engine, base


def oai(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)


# --- openai -------------------------------------------------------------------------------------------
def test_openai_chat_stream_equals_non_stream(real):
    client = oai(real)
    kw = dict(model="x", messages=ASK, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
              if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content


def test_openai_completions(real):
    client = oai(real)
    r = client.completions.create(model="x", prompt="The kitchen light is", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="The kitchen light is", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_openai_responses_create_and_stream(real):
    client = oai(real)
    r = client.responses.create(model="x", instructions="You are a home assistant.", input="Hi",
                                max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.status == "incomplete" and r.usage.output_tokens == 8
    assert r.output[0].status == "incomplete"             # the cut message too, as OpenAI marks it
    with client.responses.stream(model="x", instructions="You are a home assistant.", input="Hi",
                                 max_output_tokens=8, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.status == "incomplete" and final.output[0].status == "incomplete"


def test_openai_tool_call_chat_and_responses(scripted):
    engine, base = scripted
    engine.reply = lambda req: [CALL_TEXT[:20], CALL_TEXT[20:]]
    client = oai(base)
    chat = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    (call,) = chat.choices[0].message.tool_calls
    assert chat.choices[0].finish_reason == "tool_calls" and call.function.name == "light_set"
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    r = client.responses.create(model="m", input=ASK, tools=tools)
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name == "light_set" and json.loads(item.arguments) == {"room": "kitchen", "level": 30}
    # the result goes back as input items: a function_call and its output, rendered by the template
    engine.reply = lambda req: ["Done."]
    r2 = client.responses.create(model="m", tools=tools, input=ASK + [
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "ok, 30%"}])
    assert r2.output_text == "Done."
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt)
    assert "ok, 30%" in prompt and "light_set" in prompt
    engine.reply = lambda req: [CALL_TEXT]
    with client.responses.stream(model="m", input=ASK, tools=tools) as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["function_call"]


def test_openai_reasoning_stream_apart(scripted):
    engine, base = scripted
    engine.reply = lambda req: ["<think>", "dim it", "</think>", "OK."]
    client = oai(base)
    chunks = list(client.chat.completions.create(model="m", messages=ASK, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "dim it" and content == "OK."


# --- anthropic -------------------------------------------------------------------------------------------
def ant(base) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)


def test_anthropic_messages_and_stream(real):
    client = ant(real)
    kw = dict(model="x", max_tokens=10, system="You are a home assistant.", extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Hi"}])
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.content[0].type == "text" and msg.usage.output_tokens == 10
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text == final.content[0].text
    n = client.messages.count_tokens(model="x", messages=[{"role": "user", "content": "Hi"}])
    assert n.input_tokens > 0


def test_anthropic_tool_use_and_result(scripted):
    engine, base = scripted
    engine.reply = lambda req: [CALL_TEXT]
    client = ant(base)
    tools = [{"name": "light_set", "description": "Set a light", "input_schema": TOOLS[0]["function"]["parameters"]}]
    msg = client.messages.create(model="m", max_tokens=64, tools=tools, messages=ASK)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "light_set" and use.input == {"room": "kitchen", "level": 30}
    with client.messages.stream(model="m", max_tokens=64, tools=tools, messages=ASK) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input["level"] == 30
    engine.reply = lambda req: ["It is dimmed."]
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]
    reply = client.messages.create(model="m", max_tokens=64, tools=tools, messages=history)
    assert reply.content[0].text == "It is dimmed." and reply.stop_reason == "end_turn"
    assert "<tool_response>\nok\n</tool_response>" in engine.tokenizer.decode(engine.requests[-1].prompt)


def test_anthropic_errors_in_anthropics_shape(real):
    client = ant(real)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                    "data": "iVBOR"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]


# --- ollama -------------------------------------------------------------------------------------------------
def test_ollama_list_show_ps_version(real):
    client = ollama.Client(host=real)
    (model,) = client.list().models
    assert model.model == "qwen3-micro-q4km.gguf:latest" and model.details.format == "gguf" and model.size > 0
    shown = client.show(model.model)
    assert shown.details.family == "qwen3" and "completion" in shown.capabilities
    assert client.ps().models[0].model == model.model
    assert httpx.get(real + "/api/version").json()["version"]


def test_ollama_chat_and_generate_stream_and_not(real):
    client = ollama.Client(host=real)
    opts = {"temperature": 0, "num_predict": 8, "num_ctx": 4096}      # num_ctx: accepted, ignored
    whole = client.chat(model="any", messages=ASK, options=opts, stream=False)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    parts = list(client.chat(model="any", messages=ASK, options=opts, stream=True))
    assert parts[-1].done and "".join(p.message.content for p in parts) == whole.message.content
    gen = client.generate(model="any", prompt="Hello", options=opts, stream=False)
    assert gen.done and gen.eval_count == 8 and gen.context
    streamed = "".join(p.response for p in client.generate(model="any", prompt="Hello", options=opts, stream=True))
    assert streamed == gen.response


def test_ollama_tools_as_home_assistant_sends_them(scripted):
    engine, base = scripted
    engine.reply = lambda req: [CALL_TEXT[:30], CALL_TEXT[30:]]
    client = ollama.Client(host=base)
    parts = list(client.chat(model="qwen3:4b", messages=ASK, tools=TOOLS, stream=True, keep_alive=-1,
                             options={"num_ctx": 8192}))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "light_set"
    assert calls[0].function.arguments == {"room": "kitchen", "level": 30}
    # the tool result goes back as Home Assistant sends it: the assistant call, then a tool message
    engine.reply = lambda req: ["Done."]
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "light_set", "arguments": {"room": "kitchen", "level": 30}}}]},
        {"role": "tool", "content": '{"success": true}', "tool_name": "light_set"}]
    reply = client.chat(model="qwen3:4b", messages=history, tools=TOOLS, stream=False)
    assert reply.message.content == "Done."
    assert '{"success": true}' in engine.tokenizer.decode(engine.requests[-1].prompt)


def test_ollama_errors_in_ollamas_shape(real):
    client = ollama.Client(host=real)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="x", messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 501
    for call in (lambda o: client.generate(model="x", prompt="hi", options=o),
                 lambda o: client.chat(model="x", messages=[{"role": "user", "content": "hi"}], options=o)):
        with pytest.raises(ollama.ResponseError) as e:       # the option's name, not what it maps to
            call({"num_predict": "lots"})
        assert e.value.status_code == 400 and "'options.num_predict'" in e.value.error, e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            call({"temperature": -1})
        assert "'options.temperature'" in e.value.error, e.value.error
