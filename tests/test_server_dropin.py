"""The llama-server behaviours added for a true drop-in (issue 16), on the fixture model (real
engine, CPU) in a real uvicorn: /completion's stream tokens and counts, return_tokens,
generation_settings, truncated, several prompts, n choices; /apply-template's add_generation_prompt and
continue_final_message; /slots save / restore / erase on persistent KV files with path
containment; CORS as llama-server and --cors-origins; the web UI files a browser asks for; a trailing slash is a 404; a tool without a
type is a 400; -np slots and request defaults from launch flags."""
from __future__ import annotations

import httpx
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import ServerSettings, create_app
from genie_rt.server.state import RequestDefaults
from genie_rt.engine.sampling import SamplingParams

from test_server_support import running_server, sse_events

N_CTX = 128
PROMPT = "The kitchen light is"


@pytest.fixture(scope="module")
def engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=N_CTX))


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    slot_dir = tmp_path_factory.mktemp("slots")
    settings = ServerSettings(n_parallel=2, slot_save_path=str(slot_dir),
                              defaults=RequestDefaults(params=SamplingParams(temperature=0.0, seed=42), n_predict=32))
    app = create_app(engine, settings)
    with running_server(app) as (base, _, _):
        with httpx.Client(base_url=base, timeout=60) as c:
            c.slot_dir = slot_dir
            yield c


def test_streamed_completion_chunks_carry_token_ids_and_counts(client):
    whole = client.post("/completion", json={"prompt": PROMPT, "n_predict": 6, "return_tokens": True}).json()
    assert len(whole["tokens"]) == 6 and all(isinstance(t, int) for t in whole["tokens"])
    with client.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 6, "stream": True}) as r:
        events = sse_events(r)
    pieces, last = events[:-1], events[-1]
    assert [t for e in pieces for t in e["tokens"]] == whole["tokens"]          # the same ids, piece by piece
    assert pieces[-1]["tokens_predicted"] == 6 and all(e["tokens_evaluated"] == whole["tokens_evaluated"]
                                                        for e in pieces)
    assert last["stop"] is True and last["stop_type"] == "limit" and last["tokens"] == []
    assert client.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()["tokens"] == []


def test_generation_settings_are_llama_servers(client, engine):
    g = client.post("/completion", json={"prompt": PROMPT, "n_predict": 64, "ignore_eos": True}).json()
    s = g["generation_settings"]
    assert s["n_predict"] == 32 and s["seed"] == 42 and s["temperature"] == 0.0   # capped by -n, server seed
    assert {"adaptive_target", "adaptive_decay", "dry_sequence_breakers", "samplers", "grammar_lazy",
            "reasoning_in_content", "timings_per_token", "speculative.types"} <= set(s)
    assert {e["token"] for e in s["logit_bias"]} == set(engine.tokenizer.eot_ids)
    assert all(e["bias"] is None for e in s["logit_bias"])
    plain = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()["generation_settings"]
    assert plain["logit_bias"] == []
    fields = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2,
                                              "response_fields": ["content", "generation_settings/n_predict"]}).json()
    assert set(fields) == {"content", "generation_settings/n_predict"} and fields["generation_settings/n_predict"] == 2


def test_truncated_when_the_context_fills(client):
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": -1, "ignore_eos": True,
                                         "temperature": 0}).json()
    # -n 32 caps n_predict: stopped by the limit, not the context
    assert r["truncated"] is False and r["stop_type"] == "limit"
    long = "light " * 110
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 2}).json()
    n_prompt = r["usage"]["prompt_tokens"]
    assert n_prompt + 32 > N_CTX
    r = client.post("/completion", json={"prompt": long, "n_predict": 32, "ignore_eos": True}).json()
    assert r["truncated"] is True and r["tokens_predicted"] == N_CTX - n_prompt


def test_several_prompts_answer_a_list(client):
    ids = client.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    r = client.post("/completion", json={"prompt": [ids, PROMPT, {"prompt_string": PROMPT}], "n_predict": 3,
                                         "temperature": 0})
    assert r.status_code == 200
    out = r.json()
    assert [o["index"] for o in out] == [0, 1, 2] and len({o["content"] for o in out}) == 1
    r = client.post("/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 3,
                                                "ignore_eos": True}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["usage"]["completion_tokens"] == 6


def test_n_choices_are_not_bounded_by_the_slots(client):
    """n (n_cmpl): llama.cpp's test_chat_completions_multiple_choices, and more choices than the
    server has slots (-np 2 here): the choices come one after another from one prefill, so -np
    does not bound them (1 .. 16); streamed too."""
    msgs = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    for _ in range(2):                    # the second time from the cached prefix
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "n": 2, "ignore_eos": True,
                                                      "id_slot": 0})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)
    one = client.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "n_cmpl": 2, "temperature": 0}).json()
    assert [o["index"] for o in one] == [0, 1] and one[0]["content"] == one[1]["content"]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for body in ({"n": 3}, {"n_cmpl": 3}):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **body})
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2], body
    with client.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "n": 3,
                                                             "stream": True}) as r:
        finishes = [c["choices"][0]["index"] for c in sse_events(r)
                    if isinstance(c, dict) and c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [0, 1, 2]
    for body in ({"n": 17}, {"n_cmpl": 0}):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **body})
        assert r.status_code == 400 and "'n" in r.json()["error"]["message"], body


def test_apply_template_generation_prompt_flags(client):
    msgs = [{"role": "user", "content": "Hi"}]
    on = client.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    off = client.post("/apply-template", json={"messages": msgs, "add_generation_prompt": False}).json()["prompt"]
    assert on.startswith(off) and on != off and "assistant" in on[len(off):]
    both = client.post("/apply-template", json={"messages": msgs + [{"role": "assistant", "content": "He"}],
                                                "continue_final_message": True})
    assert both.status_code == 400 and "cannot both be true" in both.json()["error"]["message"]
    cont = client.post("/apply-template", json={"messages": msgs + [{"role": "assistant", "content": "He"}],
                                                "continue_final_message": True, "add_generation_prompt": False})
    assert cont.status_code == 200 and cont.json()["prompt"].endswith("He")
    chat = client.post("/v1/chat/completions", json={"messages": msgs, "add_generation_prompt": True,
                                                     "continue_final_message": True, "max_tokens": 2})
    assert chat.status_code == 400


def test_slots_save_restore_erase(client, engine):
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and slots[0]["n_ctx"] == N_CTX
    client.post("/completion", json={"prompt": PROMPT, "n_predict": 4})
    n = len(engine.kv_tokens)
    r = client.post("/slots/1?action=save", json={"filename": "kitchen.bin"}).json()
    assert r["n_saved"] == n and r["n_written"] > 0 and (client.slot_dir / "kitchen.kv").is_file()
    assert client.post("/slots/0?action=erase").json() == {"id_slot": 0, "n_erased": n}
    assert engine.kv_tokens == []
    r = client.post("/slots/0?action=restore", json={"filename": "kitchen.bin"}).json()
    assert r["n_restored"] == n and len(engine.kv_tokens) == n
    again = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4}).json()
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1           # the restored prefix is reused
    for bad in ("../kitchen", "/etc/passwd", "a/b", "x.kv", ".hidden", "", "a" * 61):
        r = client.post("/slots/0?action=save", json={"filename": bad})
        assert r.status_code == 400, bad
    assert sorted(p.name for p in client.slot_dir.iterdir()) == ["kitchen.kv"]
    assert client.post("/slots/0?action=restore", json={"filename": "nothing"}).status_code == 404
    assert client.post("/slots/7?action=erase").status_code == 400
    assert client.post("/slots/0?action=dance").status_code == 400


def test_trailing_slash_is_404_not_a_redirect(client):
    for path in ("/health/", "/v1/models/", "/props/"):
        r = client.get(path)
        assert r.status_code == 404 and "location" not in r.headers


def test_tool_without_a_type_is_400(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [{"function": {"name": "f"}}]})
    assert r.status_code == 400 and "tools[0].type" in r.json()["error"]["message"]


def test_props_report_slots_and_server_defaults(client):
    p = client.get("/props").json()
    assert p["total_slots"] == 2 and p["default_generation_settings"]["params"]["seed"] == 42
    assert p["default_generation_settings"]["params"]["n_predict"] == 32


@pytest.mark.parametrize("origins, origin, allowed", [
    (None, "http://evil.example", True),              # llama-server's default: any origin, echoed
    (["localhost"], "http://localhost:3000", True),
    (["localhost"], "http://[::1]:8080", True),
    (["localhost"], "http://localhost.evil.com", False),
    (["https://ha.local", "https://app.local"], "https://app.local", True),
    (["https://ha.local"], "https://evil.local", False),
])
def test_cors_origins(engine, origins, origin, allowed):
    app = create_app(engine, ServerSettings(cors_origins=origins, api_key="k"))
    with running_server(app) as (base, _, _):
        pre = httpx.options(base + "/v1/chat/completions", headers={"Origin": origin,
                                                                    "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200                    # preflights never need the key
        got = httpx.get(base + "/health", headers={"Origin": origin}).headers.get("access-control-allow-origin")
    assert (got == origin) if allowed else (got is None)
    assert (pre.headers.get("access-control-allow-origin") == origin) == allowed


@pytest.mark.parametrize("webui", [True, False])
def test_web_ui_files_a_browser_asks_for_are_public(engine, webui):
    """What a browser that used llama-server's web UI still asks for, without the API key:
    a service worker that removes the old one (also with --no-webui), the manifest and the
    version file (with the page)."""
    app = create_app(engine, ServerSettings(api_key="k", webui=webui))
    with running_server(app) as (base, _, _):
        sw = httpx.get(base + "/sw.js")
        manifest = httpx.get(base + "/manifest.webmanifest")
        version = httpx.get(base + "/_app/version.json")
        page = httpx.get(base + "/")
        assert httpx.get(base + "/v1/models").status_code == 401
    assert sw.status_code == 200 and sw.headers["content-type"].startswith("application/javascript")
    assert "registration.unregister()" in sw.text and "caches.delete" in sw.text
    assert sw.headers["cache-control"] == "no-cache"
    if webui:
        assert manifest.status_code == 200 and manifest.json()["start_url"] == "/"
        assert manifest.headers["content-type"].startswith("application/manifest+json")
        assert version.status_code == 200 and version.json()["version"].startswith("genie-rt-")
        assert '<link rel="manifest" href="/manifest.webmanifest">' in page.text
    else:
        assert manifest.status_code == version.status_code == page.status_code == 404


def test_slots_endpoint_off_is_501(engine):
    app = create_app(engine, ServerSettings(slots_endpoint=False))
    with running_server(app) as (base, _, _):
        r = httpx.get(base + "/slots")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_firefunction_template_gets_its_functions_and_datetime():
    """llama-server gives firefunction-v2's template `functions` (the tools as indented JSON) and
    `datetime`; here every template gets both, as extra variables a request's chat_template_kwargs
    can override."""
    import datetime
    from genie_rt.server.chat_request import template_kwargs
    tools = [{"type": "function", "function": {"name": "light_set", "parameters": {"type": "object"}}}]
    kw = template_kwargs({"tools": tools})
    assert '"name": "light_set"' in kw["functions"] and kw["functions"].startswith("[\n  {")
    assert datetime.date.today().strftime("%b %d %Y") in kw["datetime"]
    assert template_kwargs({})["functions"] == ""
    assert template_kwargs({"chat_template_kwargs": {"functions": "mine"}})["functions"] == "mine"
