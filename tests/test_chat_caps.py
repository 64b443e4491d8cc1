"""engine/chat_caps.py: what a chat template can show the model, found by rendering probes."""
from genie_rt.engine.chat import ChatTemplate
from genie_rt.engine.chat_caps import template_caps

from test_chat import QWEN3_CHAT_TEMPLATE


def test_template_caps_by_probes():
    """engine/chat_caps.py: what a template shows the model, found by rendering needles - the
    base-model transcript shows no tools and writes no calls; ChatML and Qwen3 do both; a template
    that raises on a probe lacks that capability; the result is computed once."""
    plain = template_caps(ChatTemplate.plain())
    assert plain == {"supports_tools": False, "supports_tool_calls": False, "supports_parallel_tool_calls": False,
                     "supports_system_role": True}
    qwen3 = ChatTemplate(QWEN3_CHAT_TEMPLATE, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    for t in (ChatTemplate.chatml(), qwen3):
        assert all(template_caps(t).values()), template_caps(t)
    no_system = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}"
                             "{{ raise_exception('no system role') }}{% endif %}{{ m.content }}{% endfor %}")
    assert template_caps(no_system) == {"supports_tools": False, "supports_tool_calls": False,
                                        "supports_parallel_tool_calls": False, "supports_system_role": False}
    assert template_caps(no_system) is template_caps(no_system)
