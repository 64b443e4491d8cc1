"""Which llama.cpp server tests check behaviour a drop-in must have, and which cannot pass here.

`classify(nodeid)` -> (category, why). The first matching rule wins; a test no rule names is
`real`. Rules match a test file, or a test name inside one (before its parameters), with
fnmatch patterns. Keep the reason with each rule: a rule without one hides a difference.
"""
from __future__ import annotations

import fnmatch

MODEL_TEXT = "model-text"
UNSUPPORTED = "unsupported"
REAL = "real"

# (pattern on "file::test", category, why)
RULES: list[tuple[str, str, str]] = [
    # --- features this server does not have ------------------------------------------------------------
    ("test_embedding.py::*", UNSUPPORTED, "embeddings"),
    ("test_rerank.py::*", UNSUPPORTED, "reranking"),
    ("test_infill.py::*", UNSUPPORTED, "infill (fill-in-the-middle)"),
    ("test_vision_api.py::*", UNSUPPORTED, "images"),
    ("test_lora.py::*", UNSUPPORTED, "LoRA adapters"),
    ("test_speculative.py::*", UNSUPPORTED, "speculative decoding (a draft model)"),
    ("test_router.py::*", UNSUPPORTED, "the multi-model router"),
    ("test_sleep.py::*", UNSUPPORTED, "unloading the model when idle (--sleep-idle-seconds)"),
    ("test_mcp_servers.py::*", UNSUPPORTED, "MCP servers"),
    ("test_tools_builtin.py::*", UNSUPPORTED, "built-in server tools"),
    ("test_proxy.py::*", UNSUPPORTED, "the web UI's CORS proxy"),
    ("test_systemone.py::*", UNSUPPORTED, "tinylaya/tinyopenjev multimodal presets"),
    ("test_stream.py::*", UNSUPPORTED, "the router's resumable streams (/v1/stream)"),
    ("test_kv_keep_only_active.py::*", UNSUPPORTED, "checks llama.cpp's own log lines (__TEST_TAG_...__)"),
    ("test_compat_gcp.py::*", UNSUPPORTED, "Google Cloud Vertex AI prediction mode (AIP_MODE, /predict)"),
    ("test_metrics.py::test_metrics_embedding_prompt_is_counted", UNSUPPORTED, "embeddings"),
    ("test_security.py::test_local_media_file", UNSUPPORTED, "images (local media files)"),
    ("test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers", UNSUPPORTED, "the web UI's CORS proxy"),
    ("test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled", UNSUPPORTED,
     "built-in server tools (--tools)"),
    ("test_security.py::test_access_static_assets_without_api_key", UNSUPPORTED,
     "llama.cpp's web UI bundle (sw.js, manifest.webmanifest, _app/): our page is one file at /"),
    ("test_compat_anthropic.py::test_anthropic_vision*", UNSUPPORTED, "images"),
    ("test_compat_anthropic.py::test_anthropic_tool_result_with_image", UNSUPPORTED, "images"),
    ("test_slot_save.py::test_slot_save_restore_*image*", UNSUPPORTED, "images"),
    ("test_slot_save.py::test_slot_save_restore_text_only_on_multimodal", UNSUPPORTED, "images (a multimodal preset)"),
    ("test_slot_save.py::test_slot_restore_media_file_without_mmproj", UNSUPPORTED, "images"),
    ("test_ctx_shift.py::test_ctx_shift_enabled", UNSUPPORTED, "context shift (--context-shift)"),
    ("test_basic.py::test_load_split_model", UNSUPPORTED, "split GGUF files (a model in several files)"),
    ("test_completion.py::test_json_prompt_mtm_error_when_not_supported", REAL, ""),
    # --- the exact text and token counts of llama.cpp's test models -----------------------------------
    ("test_chat_completion.py::test_chat_completion", MODEL_TEXT,
     "expects stories260K's text and its tokenizer's prompt_tokens"),
    ("test_chat_completion.py::test_chat_completion_stream", MODEL_TEXT, "expects stories260K's text and token counts"),
    ("test_chat_completion.py::test_chat_completion_with_openai_library", MODEL_TEXT, "expects stories260K's text"),
    ("test_chat_completion.py::test_chat_completion_cached_tokens", MODEL_TEXT,
     "expects stories260K's tokenizer's prompt and cached token counts"),
    ("test_chat_completion.py::test_completion_with_response_format", MODEL_TEXT,
     "expects stories260K's text under a grammar (and grammars are another helper's work)"),
    ("test_chat_completion.py::test_completion_with_json_schema", MODEL_TEXT, "expects stories260K's text"),
    ("test_chat_completion.py::test_completion_with_grammar", MODEL_TEXT, "expects stories260K's text"),
    ("test_chat_completion.py::test_chat_template", MODEL_TEXT,
     "expects the prompt detokenized by stories260K's SentencePiece tokenizer ('<s> ...')"),
    ("test_chat_completion.py::test_apply_chat_template", REAL, ""),
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
    ("test_slot_save.py::test_slot_restore_legacy_token_list", MODEL_TEXT, "expects llama.cpp's own slot file format"),
    ("test_compat_oai_responses.py::test_responses_with_openai_library", MODEL_TEXT, "expects stories260K's text"),
    ("test_compat_oai_responses.py::test_responses_stream_with_openai_library", MODEL_TEXT,
     "expects stories260K's text"),
]


def classify(nodeid: str) -> tuple[str, str]:
    path, _, rest = nodeid.partition("::")
    name = rest.split("[", 1)[0]
    key = f"{path.rsplit('/', 1)[-1]}::{name}"
    for pattern, category, why in RULES:
        if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(nodeid, pattern):
            return category, why
    return REAL, ""
