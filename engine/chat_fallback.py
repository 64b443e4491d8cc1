"""The built-in chat templates for GGUFs that have none (ChatTemplate.from_gguf_metadata picks):

- CHATML_TEMPLATE: a chat model without a template whose vocabulary has ChatML's tokens
  (what llama.cpp falls back to as well);
- PLAIN_TEMPLATE: a base model (no template and no ChatML tokens, e.g. Gemma 3 270M, the
  default model): a plain "User:" / "Assistant:" transcript, the reply ended by PLAIN_STOP.

docs/tokenizer-and-templates.md shows both.
"""

# Built-in fallback for GGUFs without a template: ChatML, with tools and tool calls written the
# Qwen/Hermes way (the format parse_tool_calls reads back). No BOS: ChatML models do not use one.
CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + message.content }}
        {%- for call in message.tool_calls or [] %}
            {%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
            {%- set args = call.function.arguments %}
            {{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}
            {{- (args if args is string else (args | tojson)) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Built-in fallback for a base model (no template, and no ChatML tokens in its vocabulary: Gemma 3
# 270M, the default model): a plain transcript it can continue. Roles are written as
# "User:" / "Assistant:" lines, a system message as a first paragraph, tool results as
# "Tool:" lines; the turn ends where the model starts the next "User:" line, or another
# "Assistant:" line of its own (PLAIN_STOP).
# Tools are not offered: a base model does not follow a tool-call format.
PLAIN_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- message.content + '\n\n' }}
    {%- elif message.role == 'assistant' %}
        {{- 'Assistant: ' + (message.content or '') + '\n' }}
    {%- elif message.role == 'tool' %}
        {{- 'Tool: ' + message.content + '\n' }}
    {%- else %}
        {{- 'User: ' + message.content + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- 'Assistant:' }}
{%- endif %}
"""
PLAIN_STOP = ("\nUser:", "\nAssistant:")
