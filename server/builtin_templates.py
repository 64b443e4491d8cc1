"""Chat templates by name for `--chat-template NAME`, for the names llama-server scripts use most.

Each is our own Jinja for a published prompt format (written from the model cards' descriptions
of the format, not copied from any implementation), rendered like any GGUF template
(engine/chat.py's sandbox):

- chatml     `<|im_start|>role\\n...<|im_end|>\\n` (engine/chat.py's CHATML_TEMPLATE, with tools)
- llama3     `<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`
- command-r  `<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>...<|END_OF_TURN_TOKEN|>`, user turns with
             <|USER_TOKEN|>, replies opened with <|CHATBOT_TOKEN|>
- gemma      `<start_of_turn>user\\n...<end_of_turn>\\n`, the system message folded into the first user
             turn, replies opened with `<start_of_turn>model\\n`

None writes the BOS text: as with llama.cpp's built-in templates, the tokenizer adds BOS where
the GGUF asks for it.

Deliberately not here: the other formats llama.cpp knows by name (a GGUF's own template, or
--chat-template-file, covers them), or tool calls for anything but chatml.
"""
from __future__ import annotations

from genie_rt.engine.chat import CHATML_TEMPLATE

LLAMA3 = (
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

COMMAND_R = (
    "{%- for message in messages %}"
    "{%- set token = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>',"
    " 'tool': '<|SYSTEM_TOKEN|>'}[message.role] %}"
    "{{- '<|START_OF_TURN_TOKEN|>' + token + message.content + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}"
)

GEMMA = (
    "{%- set system = namespace(text='') %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- set system.text = message.content + '\\n\\n' %}"
    "{%- else %}"
    "{%- set role = 'model' if message.role == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + system.text + message.content | trim + '<end_of_turn>\\n' }}"
    "{%- set system.text = '' %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3, "command-r": COMMAND_R, "gemma": GEMMA}
