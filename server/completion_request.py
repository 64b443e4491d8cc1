"""Completion requests: prompts (text, token ids, mixed, JSON prompt objects, batches), checked.

What it does
- `parse_completion` builds a `CompletionRequest` for /v1/completions and /completion: the
  shared generation fields (schemas.py `parse_generation`) and the prompt or prompts, as
  llama-server reads them. `validate_token_id(s)` check token ids against the vocabulary for
  every route that takes them (prompts, /tokenize's mixed content, /detokenize). Every failure
  is a 400 naming the field, and the element ('prompt[3]').

What it deliberately does not do
- Honour fields that need machinery this engine lacks (echo, suffix, best_of > 1): they are
  refused with a 400 saying so, rather than silently ignored.
- Tokenize: strings in a prompt are tokenized later (jobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from genie_rt.engine.chat import show_json as _show

from .errors import bad_request
from .schemas import MAX_INT32, GenerationFields, _kind, get_bool, get_int, get_str, parse_generation


@dataclass
class CompletionRequest:
    gen: GenerationFields
    prompt: str | list                     # text, token ids, or a mixed list of both
    return_tokens: bool = False            # /completion: the generated ids in "tokens"
    response_fields: list | None = None    # /completion: only these fields ("a/b": nested)
    batch: list | None = None              # several prompts (each like `prompt`), answered as a list


PROMPT_STRING_KEY = "prompt_string"      # llama-server's JSON prompt object {"prompt_string": ...}
MAX_BATCH_PROMPTS = 64


def _prompt_object(value: dict, where: str) -> str:
    if value.get("multimodal_data"):
        raise bad_request(f"'{where}.multimodal_data': images and audio are not supported (a text-only engine)")
    text = value.get(PROMPT_STRING_KEY)
    if not isinstance(text, str):
        raise bad_request(f"'{where}' must have a string '{PROMPT_STRING_KEY}'")
    return text


def _one_prompt(value: Any, vocab_size: int, where: str) -> str | list:
    if isinstance(value, dict):
        value = _prompt_object(value, where)
    if isinstance(value, str):
        if not value:
            raise bad_request(f"'{where}' is empty")
        return value
    if isinstance(value, list):
        if not value:
            raise bad_request(f"'{where}' is empty")
        if any(isinstance(t, (list, dict)) for t in value):
            raise bad_request(f"'{where}' must be a string, an array of token ids, or a mixed array of "
                              "strings and token ids")
        if any(isinstance(t, str) for t in value):  # mixed: strings are tokenized in place, ids checked now
            return [t if isinstance(t, str) else validate_token_id(t, f"{where}[{k}]", vocab_size)
                    for k, t in enumerate(value)]
        return validate_token_ids(value, where, vocab_size)
    raise bad_request(f"'{where}' must be a string or an array of token ids, got {_kind(value)}")


def parse_prompts(value: Any, vocab_size: int) -> list:
    """The prompts of a completion request, as llama-server reads them: a string, a JSON prompt
    object, an array of token ids, a mixed array of strings and token ids (one prompt), or an
    array whose elements are each one of those (several prompts: an array of strings, of
    token-id arrays, of objects)."""
    if isinstance(value, list) and value and (all(isinstance(t, str) for t in value) and len(value) > 1
                                              or any(isinstance(t, (list, dict)) for t in value)):
        if len(value) > MAX_BATCH_PROMPTS:
            raise bad_request(f"'prompt' has {len(value)} prompts; the limit is {MAX_BATCH_PROMPTS}")
        return [_one_prompt(v, vocab_size, f"prompt[{k}]") for k, v in enumerate(value)]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    return [_one_prompt(value, vocab_size, "prompt")]


def parse_prompt(value: Any, vocab_size: int) -> str | list:
    """One completion prompt (several: 400)."""
    prompts = parse_prompts(value, vocab_size)
    if len(prompts) != 1:
        raise bad_request("'prompt' must be one prompt here: a string, an array of token ids, or a mixed "
                          "array of strings and token ids")
    return prompts[0]


def validate_token_id(t: Any, where: str, vocab_size: int) -> int:
    """One token id; `where` names it in errors (e.g. 'prompt[3]')."""
    shown = t
    if isinstance(t, float) and t.is_integer():
        t = int(t)
    if isinstance(t, bool) or not isinstance(t, int):
        raise bad_request(f"'{where}' must be an integer token id, got {_kind(t)}")
    if not 0 <= t < vocab_size:
        raise bad_request(f"'{where}' = {_show(shown)} is outside the vocabulary (0..{vocab_size - 1})")
    return t


def validate_token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """An array of token ids named `name`; errors name the element ('tokens[2]')."""
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be an array of token ids, got {_kind(value)}")
    return [validate_token_id(t, f"{name}[{k}]", vocab_size) for k, t in enumerate(value)]


def parse_completion(body: dict, vocab_size: int, tokenize: Callable[[str], list[int]], defaults=None,
                     allow_batch: bool = True) -> CompletionRequest:
    if "prompt" not in body:
        raise bad_request("'prompt' is required")
    if get_bool(body, "echo", False):
        raise bad_request("'echo' is not supported by this server")
    if get_str(body, "suffix", None):
        raise bad_request("'suffix' is not supported by this server")
    if get_int(body, "best_of", 1, 1, MAX_INT32) != 1:
        raise bad_request("'best_of' must be 1")
    prompts = parse_prompts(body["prompt"], vocab_size)
    gen = parse_generation(body, vocab_size, tokenize, defaults)
    return_tokens = get_bool(body, "return_tokens", False)
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise bad_request("'response_fields' must be an array of strings")
    if len(prompts) == 1:
        return CompletionRequest(gen=gen, prompt=prompts[0], return_tokens=return_tokens, response_fields=fields)
    if not allow_batch:
        raise bad_request("several prompts per request are not supported on this route")
    return CompletionRequest(gen=gen, prompt=prompts[0], return_tokens=return_tokens, batch=prompts)
