"""Chat template tests: the fixture GGUF's template, the real Qwen3 template, the Jinja features
HF/llama.cpp templates rely on, message validation, and the model-output parsers."""
import json
import random

import gguf
import pytest

from genie_rt.engine.chat import (CHATML_TEMPLATE, ChatTemplate, ChatTemplateError,
                                  normalize_messages, parse_tool_calls, split_reasoning)
from genie_rt.engine.tokenizer import Tokenizer

# The chat template Qwen ships with its Qwen3 models (tokenizer_config.json of Qwen/Qwen3-*, the
# revision that reads `message.reasoning_content is string`); real Qwen3 GGUFs carry it as
# tokenizer.chat_template. Kept verbatim: the tests below check that real models render.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

SET_LIGHT = {"type": "function", "function": {
    "name": "set_light", "description": "Switch a light.",
    "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
                   "required": ["room", "on"]}}}
SET_LIGHT_JSON = ('{"type": "function", "function": {"name": "set_light", "description": "Switch a light.", '
                  '"parameters": {"type": "object", "properties": {"room": {"type": "string"}, '
                  '"on": {"type": "boolean"}}, "required": ["room", "on"]}}}')


def call(name, arguments, id_="call_0"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def meta(fixture_gguf):
    return {k: f.contents() for k, f in gguf.GGUFReader(fixture_gguf).fields.items()}


@pytest.fixture(scope="module")
def fixture_template(meta):
    return ChatTemplate.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def qwen3():
    return ChatTemplate(QWEN3_CHAT_TEMPLATE, bos_token="<|endoftext|>", eos_token="<|im_end|>")


# --- the fixture GGUF's template -------------------------------------------------------------
def test_fixture_template_comes_from_the_gguf(fixture_template, meta):
    assert not fixture_template.is_builtin
    assert fixture_template.source == meta["tokenizer.chat_template"]
    assert (fixture_template.bos_token, fixture_template.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert not fixture_template.requires_object_arguments  # it prints string arguments verbatim


def test_fixture_template_turns(fixture_template):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Lights?"}]
    assert fixture_template.render(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nLights?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert fixture_template.render(msgs, add_generation_prompt=False).endswith("Lights?<|im_end|>\n")


def test_fixture_template_tools_and_results(fixture_template):
    msgs = [{"role": "user", "content": "Kitchen light on"},
            {"role": "assistant", "content": None,
             "tool_calls": [call("set_light", '{"room": "kitchen", "on": true}')]},
            {"role": "tool", "tool_call_id": "call_0", "content": '{"ok": true}'}]
    assert fixture_template.render(msgs, tools=[SET_LIGHT]) == (
        "<|im_start|>system\nAvailable tools, one JSON signature per line:\n<tools>\n"
        + SET_LIGHT_JSON + "\n</tools>\nTo call a tool, answer with "
        '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>.<|im_end|>\n'
        "<|im_start|>user\nKitchen light on<|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "set_light", "arguments": '
        '{"room": "kitchen", "on": true}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")


def test_fixture_template_enable_thinking(fixture_template):
    msgs = [{"role": "user", "content": "Hi"}]
    assert fixture_template.render(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert fixture_template.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert fixture_template.render(msgs).endswith("<|im_start|>assistant\n")


def test_rendered_prompt_tokenizes_to_special_ids(fixture_template, meta):
    tok = Tokenizer.from_gguf_metadata(meta)
    prompt = fixture_template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    # each marker is one special id; the text between is tokenized on its own ('ĊĊ' = 271)
    assert ids == ([4097, 872, 198] + tok.encode("Hi") + [4098, 198, 4097] + tok.encode("assistant")
                   + [198, 4120, 271, 4121, 271])
    assert tok.decode(ids) == prompt


# --- the real Qwen3 template -------------------------------------------------------------------
def test_qwen3_multi_turn_with_tool_calls_and_thinking_off(qwen3):
    msgs = [
        {"role": "system", "content": "You are a home assistant."},
        {"role": "user", "content": "Turn on the kitchen light."},
        {"role": "assistant", "content": "", "reasoning_content": "The user wants the light on.",
         "tool_calls": [call("set_light", '{"room": "kitchen", "on": true}')]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"ok": true}'},
        {"role": "assistant", "content": "Done, the kitchen light is on.", "reasoning_content": "It worked."},
        {"role": "user", "content": "Thanks! And the porch?"},
    ]
    # Reasoning of turns before the last user query is dropped by the template.
    assert qwen3.render(msgs, tools=[SET_LIGHT], enable_thinking=False) == (
        "<|im_start|>system\nYou are a home assistant.\n\n# Tools\n\nYou may call one or more "
        "functions to assist with the user query.\n\nYou are provided with function signatures "
        "within <tools></tools> XML tags:\n<tools>\n" + SET_LIGHT_JSON + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nTurn on the kitchen light.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "set_light", "arguments": '
        '{"room": "kitchen", "on": true}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nDone, the kitchen light is on.<|im_end|>\n"
        "<|im_start|>user\nThanks! And the porch?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_reasoning_kept_inside_the_current_tool_loop(qwen3):
    msgs = [
        {"role": "user", "content": "Porch light on, and the heating to 21."},
        {"role": "assistant", "content": None, "reasoning_content": "Two calls.",
         "tool_calls": [call("set_light", {"room": "porch", "on": True}, "a"),
                        call("set_heating", '{"celsius": 21}', "b")]},
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
        {"role": "tool", "tool_call_id": "b", "content": "ok"},
    ]
    assert qwen3.render(msgs) == (
        "<|im_start|>user\nPorch light on, and the heating to 21.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\n"
        '<tool_call>\n{"name": "set_light", "arguments": {"room": "porch", "on": true}}\n</tool_call>\n'
        '<tool_call>\n{"name": "set_heating", "arguments": {"celsius": 21}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response>\n<tool_response>\nok\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_think_block_in_content_of_the_last_turn(qwen3):
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nPonder.\n</think>\n\nHello!"}]
    assert qwen3.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nPonder.\n</think>\n\nHello!<|im_end|>\n")


def test_qwen3_text_parts_are_joined(qwen3):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Line one."},
                                         {"type": "text", "text": "Line two."}]}]
    assert qwen3.render(msgs, add_generation_prompt=False) == \
        "<|im_start|>user\nLine one.\nLine two.<|im_end|>\n"


# --- Jinja features ----------------------------------------------------------------------------
def render_source(source, **kwargs):
    return ChatTemplate(source).render([{"role": "user", "content": "x"}], **kwargs)


def test_tojson_matches_hf():
    assert render_source("{{ v | tojson }}", v={"é": [1, "ü"]}) == '{"é": [1, "ü"]}'
    assert render_source("{{ v | tojson(indent=2) }}", v={"a": 1}) == '{\n  "a": 1\n}'
    assert render_source("{{ v | tojson(separators=(',', ':')) }}", v={"a": [1, 2]}) == '{"a":[1,2]}'
    assert render_source("{{ v | tojson(ensure_ascii=True, sort_keys=True) }}",
                         v={"b": "é", "a": 0}) == '{"a": 0, "b": "\\u00e9"}'


def test_loop_controls_generation_blocks_and_strftime():
    assert render_source("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}"
                         "{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "02"
    assert render_source("a{% generation %}b{% endgeneration %}c") == "abc"
    year = render_source("{{ strftime_now('%Y') }}")
    assert year.isdigit() and len(year) == 4


def test_trim_and_lstrip_blocks():
    assert render_source("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB"


def test_extra_kwargs_and_special_tokens_reach_the_template():
    t = ChatTemplate("{{ bos_token }}{{ custom }}|{{ messages[0].content }}", bos_token="<s>")
    assert t.render([{"role": "user", "content": "x"}], custom=42) == "<s>42|x"


def test_leading_bos_is_removed_when_the_tokenizer_adds_it():
    src = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "x"}]
    assert ChatTemplate(src, bos_token="<s>", add_bos=True).render(msgs) == "x"
    assert ChatTemplate(src, bos_token="<s>", add_bos=False).render(msgs) == "<s>x"


def test_object_arguments_for_templates_that_tojson_them():
    # Qwen2.5 writes `tool_call.arguments | tojson`: string arguments would be double-encoded.
    src = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
           "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    t = ChatTemplate(src)
    assert t.requires_object_arguments
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": 1}')]}]
    assert t.render(msgs) == '{"a": 1}'


def test_string_arguments_stay_verbatim_when_the_template_prints_them(qwen3):
    assert not qwen3.requires_object_arguments
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a":1,  "b":2}')]}]
    assert '"arguments": {"a":1,  "b":2}}' in qwen3.render(msgs)


# --- built-in fallback -------------------------------------------------------------------------
def test_builtin_chatml_when_the_gguf_has_no_template(meta):
    t = ChatTemplate.from_gguf_metadata({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    assert t.is_builtin and t.source == CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    assert t.render(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                              "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nV<|im_end|>\n"
                              "<|im_start|>assistant\n")


def test_plain_transcript_for_a_base_model_without_chatml_tokens():
    # Gemma 3 270M (the default model): no template, no <|im_start|> in the vocabulary
    meta = {"tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "a"], "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_bos_token": True}
    t = ChatTemplate.from_gguf_metadata(meta)
    assert t.is_builtin and t.is_plain and t.stop_strings == ("\nUser:", "\nAssistant:")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    assert t.render(msgs) == "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: Capital of France?\nAssistant:"
    assert t.render(msgs[:2], add_generation_prompt=False) == "Be brief.\n\nUser: Hi\n"


def test_chatml_fallback_keeps_no_extra_stops(meta, fixture_template):
    t = ChatTemplate.from_gguf_metadata({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    assert not t.is_plain and t.stop_strings == ()
    assert not fixture_template.is_plain and fixture_template.stop_strings == ()


def test_builtin_chatml_tools_round_trip_through_the_parser():
    t = ChatTemplate.chatml()
    msgs = [{"role": "user", "content": "U"},
            {"role": "assistant", "content": None, "tool_calls": [call("set_light", {"room": "hall"})]},
            {"role": "tool", "content": "ok"}]
    out = t.render(msgs, tools=[SET_LIGHT])
    assert "<tools>\n" + SET_LIGHT_JSON + "\n</tools>" in out
    turn = out.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(turn) == ("", [{"name": "set_light", "arguments": '{"room": "hall"}'}])
    assert "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n" in out


def test_named_template_variant(meta):
    m = dict(meta, **{"tokenizer.chat_template.tool_use": "T{{ messages | length }}"})
    assert ChatTemplate.from_gguf_metadata(m, name="tool_use").render([{"role": "user", "content": "x"}]) == "T1"
    with pytest.raises(ChatTemplateError, match=r"tokenizer\.chat_template\.rag"):
        ChatTemplate.from_gguf_metadata(m, name="rag")


# --- errors ------------------------------------------------------------------------------------
def test_raise_exception_becomes_chat_template_error():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="refused these messages: first must be user"):
        t.render([{"role": "system", "content": "s"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_syntax_error_names_the_key_and_line(meta):
    m = dict(meta, **{"tokenizer.chat_template": "ok\n{% for m in messages %}\n{{ m.content }"})
    with pytest.raises(ChatTemplateError, match=r"GGUF tokenizer\.chat_template is not valid Jinja \(line 3\)"):
        ChatTemplate.from_gguf_metadata(m)


def test_runtime_errors_name_the_line():
    t = ChatTemplate("line1\n{{ messages[0].content }}\n{{ nothing.attribute }}")
    with pytest.raises(ChatTemplateError, match=r"failed at line 3: UndefinedError"):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        t.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_access():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{% set _ = messages.append(1) %}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        t.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, match", [
    ([], "at least one message"),
    ("hello", "must be a list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"role": "developer", "content": "x"}], r"messages\[0\]\.role is 'developer'"),
    ([{"content": "x"}], r"messages\[0\]\.role is None"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "assistant", "content": None}], r"messages\[0\]\.content is missing or null"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\] has type 'image_url'.*text-only"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"tool_calls is only allowed on assistant"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "assistant", "content": "", "tool_calls": [call("f", 5)]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be"),
    ([{"role": "assistant", "content": "x", "reasoning_content": 3}], r"reasoning_content must be"),
    ([{"role": "tool", "content": "x", "tool_call_id": 7}], r"messages\[0\]\.tool_call_id must be a string"),
])
def test_invalid_messages_are_refused(fixture_template, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        fixture_template.render(messages)


def test_invalid_tools_are_refused(fixture_template):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="tools must be a list"):
        fixture_template.render(msgs, tools={"name": "f"})
    with pytest.raises(ChatTemplateError, match=r"tools\[0\]\.function"):
        fixture_template.render(msgs, tools=[{"type": "function"}])


def test_bad_json_arguments_refused_only_when_objects_are_needed():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call("f", "{not json")]}]
    assert normalize_messages(msgs)[0]["tool_calls"][0]["function"]["arguments"] == "{not json"
    with pytest.raises(ChatTemplateError, match=r"arguments is not valid JSON"):
        normalize_messages(msgs, object_arguments=True)


def test_normalize_does_not_mutate_the_input():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call("f", "{}")], "extra": 1}]
    before = json.dumps(msgs)
    out = normalize_messages(msgs)
    assert json.dumps(msgs) == before
    assert out[0]["content"] == "" and out[0]["extra"] == 1


# --- split_reasoning ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("<think>\nLet me see.\n</think>\n\nIt is 21 °C.", ("Let me see.", "It is 21 °C.")),
    ("No thinking here.", ("", "No thinking here.")),
    ("<think>\n\n</think>\n\nHi", ("", "Hi")),
    ("  <think>a</think>b", ("a", "b")),
    ("Reasoned.\n</think>\n\nAnswer", ("Reasoned.", "Answer")),  # template opened <think>
    ("<think>\ncut off by max_tokens", ("cut off by max_tokens", "")),
    ("Text with <think> inside", ("", "Text with <think> inside")),
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_split_reasoning_think_open():
    assert split_reasoning("still thinking", think_open=True) == ("still thinking", "")
    assert split_reasoning("r</think>c", think_open=True) == ("r", "c")


def test_split_reasoning_partial_holds_back_tags():
    assert split_reasoning("<thi", partial=True) == ("", "")
    assert split_reasoning("<thi") == ("", "<thi")
    assert split_reasoning("<think>\nabc\n</thi", partial=True) == ("abc", "")


def _grows(prev: str, cur: str) -> bool:
    return cur.startswith(prev)


def test_split_reasoning_streaming_only_grows():
    final = "<think>\nThe user asks about the <heating>.\n\nCheck it.\n</think>\n\nIt is <b>on</b>."
    last = ("", "")
    for n in range(len(final) + 1):
        cur = split_reasoning(final[:n], partial=True)
        assert _grows(last[0], cur[0]) and _grows(last[1], cur[1]), final[:n]
        last = cur
    assert last == split_reasoning(final) == ("The user asks about the <heating>.\n\nCheck it.", "It is <b>on</b>.")


def test_split_reasoning_stray_end_only_inferred_when_asked():
    text = "Let me check. </think>\n\nThe kitchen is dimmed."
    assert split_reasoning(text) == ("Let me check.", "The kitchen is dimmed.")   # documented default
    assert split_reasoning(text, infer_open=False) == ("", text)                   # the server's reading
    assert split_reasoning(text, think_open=True, infer_open=False) == ("Let me check.", "The kitchen is dimmed.")
    # streaming holds back what a later </think> or <think> could still change
    assert split_reasoning("\n\n", partial=True) == ("", "")
    assert split_reasoning("\n\n", partial=True, infer_open=False) == ("", "")
    assert split_reasoning("\n\nHi", partial=True, infer_open=False) == ("", "\n\nHi")
    assert split_reasoning("Let me check. ", partial=True) == ("", "")   # inferred: may become reasoning
    assert split_reasoning(" <thi", partial=True, think_open=True) == ("", "")


def test_split_reasoning_partial_is_a_prefix_of_the_final_for_every_cut():
    rng = random.Random(11)
    atoms = ["<think>", "</think>", "<thi", "</thi", "<", "/", "\n", " ", "Done.", "x"]
    for _ in range(1500):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 8)))
        for think_open in (False, True):
            for infer_open in (False, True):
                kw = dict(think_open=think_open, infer_open=infer_open)
                final = split_reasoning(text, **kw)
                last = ("", "")
                for n in range(len(text) + 1):
                    cur = split_reasoning(text[:n], partial=True, **kw)
                    assert _grows(last[0], cur[0]) and _grows(last[1], cur[1]), (text[:n], kw)
                    assert _grows(cur[0], final[0]) and _grows(cur[1], final[1]), (text[:n], text, kw)
                    last = cur


# --- parse_tool_calls --------------------------------------------------------------------------
def test_parse_single_call():
    text = '<tool_call>\n{"name": "set_light", "arguments": {"room": "kitchen", "on": true}}\n</tool_call>'
    assert parse_tool_calls(text) == ("", [{"name": "set_light", "arguments": '{"room": "kitchen", "on": true}'}])


def test_parse_calls_with_content_and_unicode():
    text = ('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": "é"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"n\\": 1}"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert calls == [{"name": "a", "arguments": '{"x": "é"}'}, {"name": "b", "arguments": '{"n": 1}'}]
    assert json.loads(calls[0]["arguments"]) == {"x": "é"}


@pytest.mark.parametrize("block", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
    '<tool_call>\n["f"]\n</tool_call>',
])
def test_malformed_calls_stay_content(block):
    content, calls = parse_tool_calls("Before " + block + " after")
    assert calls == [] and content == "Before " + block + " after"


def test_missing_arguments_mean_no_arguments():
    assert parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>') == ("", [{"name": "ping", "arguments": "{}"}])


def test_unclosed_final_block():
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}') == ("", [{"name": "f", "arguments": "{}"}])
    assert parse_tool_calls('Hi <tool_call>\n{"name": "f", "argu') == ('Hi <tool_call>\n{"name": "f", "argu', [])


def test_parse_tool_calls_partial_streaming():
    final = ('Checking.\n<tool_call>\n{"name": "get_temp", "arguments": {"room": "hall"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_temp", "arguments": {"room": "porch"}}\n</tool_call>')
    last_content, n_calls = "", 0
    for n in range(len(final) + 1):
        content, calls = parse_tool_calls(final[:n], partial=True)
        assert content.startswith(last_content) and "<tool" not in content, final[:n]
        assert len(calls) >= n_calls
        last_content, n_calls = content, len(calls)
    assert parse_tool_calls(final, partial=True) == parse_tool_calls(final)
    assert last_content == "Checking." and n_calls == 2


def test_parsers_never_raise_on_garbage():
    rng = random.Random(3)
    atoms = ["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", '"name"', ":", '"f"',
             '"arguments"', "[", "]", "\n", " ", "x", "<", "/", "\\", '"']
    for _ in range(500):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 30)))
        for partial in (False, True):
            reasoning, content = split_reasoning(text, partial=partial)
            parse_tool_calls(content, partial=partial)


# --- tool and tool-call validation (review fixes) ------------------------------------------------
@pytest.mark.parametrize("tools, match", [
    ([{"type": 5}], r"tools\[0\]\.type is 5: unsupported tool type"),
    ([{"type": None, "function": None}], r"tools\[0\]\.function must be an object .*got null"),
    ([{"type": "retrieval"}], r'tools\[0\]\.type is "retrieval"'),
    ([{"type": "function", "function": {"name": "f", "parameters": "not an object"}}],
     r"tools\[0\]\.function\.parameters must be a JSON Schema object, got string"),
    ([SET_LIGHT, "x"], r"tools\[1\] must be an object, got string"),
    ([{"type": "x" * 100_000}], r'tools\[0\]\.type is "x{64}\.\.\."'),
])
def test_render_refuses_malformed_tools(tools, match):
    with pytest.raises(ChatTemplateError, match=match) as e:
        ChatTemplate.chatml().render([{"role": "user", "content": "x"}], tools=tools)
    assert len(str(e.value)) < 200


def test_validate_tool_call_is_strict_about_arguments():
    from genie_rt.engine.chat import decode_tool_arguments, validate_tool_call
    where = "messages[1].tool_calls[0]"
    validate_tool_call(call("f", '{"a": 1}'), where)
    validate_tool_call(call("f", {"a": 1}), where)
    validate_tool_call(call("f", "  "), where)                       # blank: no arguments
    with pytest.raises(ChatTemplateError, match=r"tool_calls\[0\]\.function\.arguments is not valid JSON"):
        validate_tool_call(call("f", "{bad json"), where)
    with pytest.raises(ChatTemplateError, match=r"must encode a JSON object, got 5"):
        validate_tool_call(call("f", "5"), where)
    with pytest.raises(ChatTemplateError, match=r"tool_calls\[0\] must be an object, got array"):
        validate_tool_call([1], where)
    assert decode_tool_arguments('{"on": true}', "x") == {"on": True}
