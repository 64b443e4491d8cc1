"""The tokenizer test corpus: a few hundred varied strings, the same on every run.

`corpus()` returns them: prose with every kind of whitespace run, digits, apostrophes, many
scripts (Latin with NFC and NFD accents, Greek, Cyrillic, Arabic, Hebrew, Devanagari, Thai,
Chinese, Japanese, Korean), emoji sequences (ZWJ, skin tones, flags), characters no vocabulary
has (byte fallback: private use, astral CJK), control characters, literal "▁" and "<0x41>",
code, JSON, HTML and Markdown, runs of one character (equal-score ties), chat-templated turns
of Gemma, ChatML (Qwen, SmolLM), Llama 3, Llama 2 and Zephyr/TinyLlama with their special
tokens, and seeded random strings over an alphabet of the characters tokenizers get wrong.

tools/tokenizer_fixture.py runs llama.cpp's llama-tokenize on them to make
tests/fixtures/tokenizer-llamacpp-ids.npz. Run this file to print the corpus.
"""
from __future__ import annotations

import random
import unicodedata

_PROSE = [
    "Hello world", " Hello world", "Hello World!", "  two leading spaces", "trailing spaces   ",
    "Turn the kitchen lights to 40% and lock the front door.",
    "I'm sure it's fine; you'll see they've done what we'd said. DON'T SHOUT, it'S ok.",
    "The quick brown fox jumps over the lazy dog.\nThe end.\n",
    "Set a timer for 25 minutes, then remind me at 7:30 pm on 2025-03-14.",
    "Temperature: 21.5°C, humidity 48%, pressure 1013.25 hPa",
    "a  b   c    d     e      f       g        h",
    "tabs\tand\t\ttabs\t\t\tand\n\nnewlines\n\n\n\nend",
    "windows\r\nline\r\nendings\r\n\r\n",
    "mixed \t \n \r\n \u00a0 \u3000 \u2009 whitespace \x0b \x0c \x85 end",
    "\n", "\n\n", " \n", "\n ", "\t", " ", "  ", "   ", "    \n    ", "\n\n\n\n\n\n\n\n\n\n",
    "12345", "3.14159e-10", "1,234,567.89", "0000000000", "2024 1999 007 42", "+1 (555) 123-4567",
    "version 3.10.12 build 20240101", "١٢٣٤ ٥٦٧", "Ⅻ ② ¾ ²³",
]

_SCRIPTS = [
    "café naïve Ærø façade résumé", unicodedata.normalize("NFD", "café naïve résumé Ångström"),
    "Ελληνικά: Καλημέρα κόσμε", "Русский текст: Привет, мир! Съешь же ещё этих булок.",
    "Українська: Ґанок, їжак, єнот", "العربية: مرحبا بالعالم", "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया", "ไทย: สวัสดีชาวโลก", "中文：你好，世界。这是一个测试。",
    "日本語：こんにちは世界、カタカナとひらがな。", "한국어: 안녕하세요 세계", "Tiếng Việt: Xin chào thế giới",
    "Türkçe: İstanbul'da ılık bir gün", "Deutsch: Straße, Größe, Äpfel, ÖL", "ſt ﬁ ﬂ Ⅷ ℌ",
    "emoji 😀👍🏽👨‍👩‍👧 🇺🇸🇯🇵 ❤️ 🦙.cpp", "🏳️‍🌈 🧑🏿‍💻 ✋🏻 #️⃣",
    "rare: \ue000\uf8ff \U000f0000 \U0010fffd 𠀀𠀁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚",
    "controls \x00\x01\x02\x1b[0m\x7f and zero width \u200b\u200c\u200d\ufeff",
    "combining a\u0301\u0302\u0303 e\u0308 o\u0338 \u0300 alone",
]

_CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    'const x = {"key": "value", "n": [1, 2, 3], "ok": true, "nested": {"a": null}};',
    '{"name":"set_light","arguments":{"room":"kitchen","level":0.4}}',
    "<table><tr><td>cell</td></tr></table> <h1>Title</h1><b>bold</b> <s>strike</s> </s>",
    "<div class=\"x\">Hello&nbsp;<br/>world</div><!-- comment -->",
    "| col1 | col2 |\n|------|------|\n| a    | b    |\n",
    "```python\nimport numpy as np\nprint(np.arange(10))\n```",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "C:\\Users\\name\\file.txt /usr/local/bin/python3",
    "    indented four\n        indented eight\n\t\ttabbed\n",
    "x=1;y=2;z=x+y;print(z)//comment/*block*/",
    "#!/bin/bash\nset -euo pipefail\necho \"$HOME\" | grep -v '^#'\n",
]

_RUNS = [
    "aaaa", "aaaaaaaaaaaaaaaaa", "==========", "----------------------------------------",
    "............", "!!!!!!??????", "\u2581\u2581\u2581 literal\u2581block\u2581", "▁▁hello▁", "<0x41><0x0A>",
    "<unused0> <unused99>", "[multimodal] [PAD] <mask> <pad>", "ababababab", "abcabcabcabc", "    ",
    "\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t", " " * 40, "\n" * 40,
    "zzzzzzzzzz", "😀😀😀😀", "日日日日日日", "1111111111111111",
]

# Chat-templated turns; each vocabulary knows its own special tokens, the others see text.
_CHAT = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nTurn on the lights.<end_of_turn>\n<start_of_turn>model\nDone.<end_of_turn>\n",
    "<start_of_turn>system\nYou are a home assistant.<end_of_turn><eos>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCall a tool<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"x\"}\n</tool_call><|im_end|>",
    "<|endoftext|>Once upon a time<|endoftext|>",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHello [/INST] Hi!</s><s>[INST] Again [/INST]",
    "<|system|>\nYou are a chatbot.</s>\n<|user|>\nHello!</s>\n<|assistant|>\n",
    "<|user|>\nWhat's up?<|end|>\n<|assistant|>\nNothing much.<|end|>\n<|endoftext|>",
    "text<start_of_turn>glued<end_of_turn>text", "<start_of_turn><start_of_turn><end_of_turn>",
    "<|im_start|><|im_end|><|im_start|>", "  <|im_start|>  spaced  <|im_end|>  ",
    "<start_of_image><end_of_image> <img> </img>", "<bos>", "<eos>", "<s>", "</s>", "<unk>",
]

# The characters tokenizers get wrong, for the random strings.
_ALPHABET = (list("aZé'sStTmMdDrReEvVlL09 .,!?-_()[]{}<>/\\\"#@=+*&%$^~`|;:") + [" "] * 8
             + ["\t", "\n", "\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u2009", "\u3000", "\u2581",
                "日", "本", "ſ", "ß", "\u0301", "²", "٣", "Ⅻ", "😀", "👍", "\u200d", "€", "°", "й",
                "ا", "ก", "\ue000", "\U0010fffd", "<s>", "</s>", "<0x20>", "\n\n", "  ", "ing", "the"])


def _random_strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 48))) for _ in range(n)]


def _mix(n: int, seed: int) -> list[str]:
    """Pieces of the other groups glued together at random."""
    rng = random.Random(seed)
    pool = _PROSE + _SCRIPTS + _CODE + _RUNS + _CHAT
    return ["".join(rng.choice(pool) for _ in range(rng.randint(2, 4))) for _ in range(n)]


def corpus() -> list[str]:
    """The corpus, in a fixed order, without duplicates."""
    items = _PROSE + _SCRIPTS + _CODE + _RUNS + _CHAT + _random_strings(150, 1234) + _mix(60, 99)
    return list(dict.fromkeys(items))


if __name__ == "__main__":
    strings = corpus()
    for s in strings:
        print(repr(s))
    print(f"# {len(strings)} strings, {sum(map(len, strings))} characters")
