"""Which llama.cpp server tests count for issue 16's figure, and why the others do not.

`classify(nodeid)` -> (category, why):
  real          - counts: a test of a selected file that no rule below takes out
  model-text    - depends on llama.cpp's test models' exact text, tokenizer or token counts
  excluded      - depends on embeddings, reranking, infill or images (the issue's exclusions)
  not-selected  - a file the issue does not name (LoRA, speculative decoding, ...): run, reported,
                  not in the figure
The first matching rule wins; a test of a selected file no rule names is `real`. Rules match a test file, or a test name inside one (before its parameters), with
fnmatch patterns. Keep the reason with each rule: a rule without one hides a difference.
"""
from __future__ import annotations

import fnmatch

MODEL_TEXT = "model-text"
EXCLUDED = "excluded"
NOT_SELECTED = "not-selected"
REAL = "real"

# The files issue 16 names ("test_basic, test_chat_completion, ... test_compat_anthropic and
# others"), and test_metrics (/metrics is one of our routes). Any other file of llama.cpp's suite
# is run and reported too, as `not-selected`, with the feature it tests: it is not in the figure.
SELECTED_FILES = {
    "test_basic.py", "test_chat_completion.py", "test_completion.py", "test_security.py", "test_tokenize.py",
    "test_tool_call.py", "test_ctx_shift.py", "test_slot_save.py", "test_ignore_eos.py", "test_template.py",
    "test_compat_oai_responses.py", "test_compat_anthropic.py", "test_metrics.py",
}
NOT_SELECTED_WHY = {
    "test_embedding.py": "embeddings", "test_rerank.py": "reranking", "test_infill.py": "infill",
    "test_vision_api.py": "images", "test_lora.py": "LoRA adapters",
    "test_speculative.py": "speculative decoding (a draft model)", "test_router.py": "the multi-model router",
    "test_sleep.py": "unloading the model when idle (--sleep-idle-seconds)", "test_mcp_servers.py": "MCP servers",
    "test_tools_builtin.py": "built-in server tools", "test_proxy.py": "the web UI's CORS proxy",
    "test_systemone.py": "multimodal presets", "test_stream.py": "the router's resumable streams (/v1/stream)",
    "test_kv_keep_only_active.py": "llama.cpp's own log lines (__TEST_TAG_...__)",
    "test_compat_gcp.py": "Google Cloud Vertex AI prediction mode (AIP_MODE, /predict)",
}

# Inside the selected files the only exclusions are the issue's: a test that depends on
# llama.cpp's test models' exact text (or tokenizer, or token counts), or on embeddings,
# reranking, infill or images. Everything else is `real`, also a feature we lack (split GGUF
# files, context shift, grammars, logprobs, n > 1, ...): its failure counts.
# (pattern on "file::test" or on the whole node id, category, why)
RULES: list[tuple[str, str, str]] = [
    # --- the excluded features ------------------------------------------------------------------
    ("test_metrics.py::test_metrics_embedding_prompt_is_counted", EXCLUDED, "embeddings"),
    ("test_security.py::test_local_media_file", EXCLUDED, "images (local media files)"),
    ("test_compat_anthropic.py::test_anthropic_vision*", EXCLUDED, "images"),
    ("test_compat_anthropic.py::test_anthropic_tool_result_with_image", EXCLUDED, "images"),
    ("test_slot_save.py::test_slot_save_restore_*image*", EXCLUDED, "images"),
    ("test_slot_save.py::test_slot_save_restore_text_only_on_multimodal", EXCLUDED,
     "images (a multimodal model preset with its projector)"),
    ("test_slot_save.py::test_slot_restore_media_file_without_mmproj", EXCLUDED, "images"),
    # --- the exact text and token counts of llama.cpp's test models -----------------------------------
    ("test_chat_completion.py::test_chat_completion", MODEL_TEXT,
     "expects stories260K's text and its tokenizer's prompt_tokens"),
    ("test_chat_completion.py::test_chat_completion_stream", MODEL_TEXT, "expects stories260K's text and token counts"),
    ("test_chat_completion.py::test_chat_completion_with_openai_library", MODEL_TEXT, "expects stories260K's text"),
    ("test_chat_completion.py::test_chat_completion_cached_tokens", MODEL_TEXT,
     "expects stories260K's tokenizer's prompt and cached token counts"),
    ("*test_completion_with_response_format[[]response_format1-*", MODEL_TEXT,
     "expects stories260K's '[ -3000 ]' for a schema any integer list satisfies"),
    ("test_chat_completion.py::test_chat_template", MODEL_TEXT,
     "expects the prompt detokenized by stories260K's SentencePiece tokenizer ('<s> ...')"),
    ("test_chat_completion.py::test_apply_chat_template", REAL, ""),
    ("*test_return_progress[[]64-4-False]", MODEL_TEXT,
     "expects stories260K's tokenizer to make the chat prompt 129-192 tokens (3 batches of 64: 4 "
     "reports); ours makes 54, one batch: 2 reports. Every other check of the test passes, and the "
     "[64-2-True] case (one batch after the cached prefix) counts"),
    ("test_completion.py::test_completion", MODEL_TEXT, "expects stories260K's text and its tokenizer's prompt_n"),
    ("test_completion.py::test_completion_stream", MODEL_TEXT, "expects stories260K's text and token counts"),
    ("test_completion.py::test_completion_with_openai_library", MODEL_TEXT, "expects stories260K's text"),
    ("test_completion.py::test_completion_stream_with_openai_library", MODEL_TEXT, "expects stories260K's text"),
    ("test_completion.py::test_completion_prompt_cache", MODEL_TEXT,
     "expects stories260K's tokenizer: ' Hello 3' x 43 = 217 tokens"),
    ("test_completion.py::test_completion_response_fields", MODEL_TEXT,
     "expects the prompt detokenized by stories260K's SentencePiece tokenizer ('<s> ' + prompt)"),
    ("test_completion.py::test_completion_unified", MODEL_TEXT,
     "expects the test model never to end its text before n_predict (ours samples an end-of-turn at 61)"),
    ("test_tokenize.py::test_tokenize_with_bos", MODEL_TEXT, "expects BOS id 1 (stories260K); Qwen3 adds no BOS"),
    ("test_ctx_shift.py::test_ctx_shift_disabled_short_prompt", MODEL_TEXT,
     "expects stories260K's tokenizer: 'Hi how are you' = 8 tokens, and an EOS never sampled"),
    ("test_ctx_shift.py::test_ctx_shift_disabled_long_prompt", MODEL_TEXT,
     "expects stories260K's tokenizer to make LONG_TEXT longer than 256 tokens (ours: 192)"),
    ("test_slot_save.py::test_slot_save_restore", MODEL_TEXT, "expects stories260K's text and prompt_n (21 / 6 tokens)"),
    ("test_slot_save.py::test_slot_erase", MODEL_TEXT, "expects stories260K's text and prompt_n (21 tokens)"),
    ("test_slot_save.py::test_slot_restore_legacy_token_list", MODEL_TEXT,
     "expects stories260K's tokenizer (n_saved == 84) before it rewrites llama.cpp's own slot file layout"),
    ("test_compat_oai_responses.py::test_responses_with_openai_library", MODEL_TEXT, "expects stories260K's text"),
    ("test_compat_oai_responses.py::test_responses_stream_with_openai_library", MODEL_TEXT,
     "expects stories260K's text"),
]


def classify(nodeid: str) -> tuple[str, str]:
    path, _, rest = nodeid.partition("::")
    name = rest.split("[", 1)[0]
    file = path.rsplit('/', 1)[-1]
    if file not in SELECTED_FILES:
        return NOT_SELECTED, NOT_SELECTED_WHY.get(file, "a test file the issue does not name")
    key = f"{file}::{name}"
    for pattern, category, why in RULES:
        if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(nodeid, pattern):
            return category, why
    return REAL, ""
