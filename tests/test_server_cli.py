"""`genie-rt serve`'s command line (server/cli_args.py): the llama-server flags people copy from
scripts are accepted and mean what docs/server.md says; unknown or unsupported ones are clear
errors before anything loads."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from genie_rt.engine.chat import ChatTemplateError
from genie_rt.engine.cli import build_parser, main
from genie_rt.server import cli_args
from genie_rt.server.app import chat_template_override
from genie_rt.server.state import ServerSettings

MODEL = "tests/fixtures/qwen3-micro-q4km.gguf"


def parse(*flags: str):
    return build_parser().parse_args(["serve", "-m", MODEL, *flags])


def settings(*flags: str) -> ServerSettings:
    args = parse(*flags)
    cli_args.check_serve_args(args)
    args.api_keys = cli_args._read_api_keys(args)
    cli_args.apply_engine_overrides(args)
    return ServerSettings.from_args(args)


def test_a_llama_server_script_line_parses():
    args = parse("--jinja", "-c", "4096", "-np", "2", "--temp", "0.7", "--top-k", "20", "--top-p", "0.8",
                 "--min-p", "0", "-n", "256", "--seed", "42", "--alias", "qwen,assistant", "-ngl", "99",
                 "-t", "4", "-fa", "on", "--cont-batching", "-b", "1024", "-ub", "256", "--no-webui",
                 "--metrics", "-ctk", "q8_0", "-ctv", "q8_0", "--reasoning", "off", "--repeat-penalty", "1.1")
    cli_args.check_serve_args(args)
    args.api_keys = cli_args._read_api_keys(args)
    cli_args.apply_engine_overrides(args)
    s = ServerSettings.from_args(args)
    assert args.ctx == 2048 and args.prefill_chunk == 256 and args.kv == "int8"   # -np 2: ctx/2 per slot
    assert s.n_parallel == 2 and not s.webui and s.alias == "assistant" and s.aliases == ["qwen", "assistant"]
    d = s.defaults
    assert (d.params.temperature, d.top_k, d.params.top_p, d.params.min_p, d.params.seed, d.n_predict) == \
        (0.7, 20, 0.8, 0.0, 42, 256)
    assert d.reasoning == "off" and d.params.repeat_penalty == 1.1
    assert set(args.ignored_flags) == {"-ngl", "-fa", "--cont-batching"}   # -t sets the CPU threads
    assert s.n_batch == 1024 and settings().n_batch == 2048       # -b: the prompt_progress step


def test_long_options_may_be_spelled_with_underscores():
    """As llama-server reads them (its own tests start it with --backend_sampling)."""
    parser = build_parser()
    argv = ["serve", "-m", MODEL, "--backend_sampling", "--ctx_size=64", "--alias", "my_model", "--n_predict", "5"]
    args = parser.parse_args(cli_args.dash_long_options(argv, parser))
    assert args.ctx == 64 and args.n_predict == 5 and "--backend-sampling" in args.ignored_flags
    assert args.alias == "my_model"                         # values are left as they are
    with pytest.raises(SystemExit):
        parser.parse_args(cli_args.dash_long_options(["serve", "-m", MODEL, "--no_such_flag"], parser))


def test_kv_unified_keeps_the_whole_context_per_slot():
    args = parse("-c", "256", "-np", "4", "--kv-unified")
    cli_args.apply_engine_overrides(args)
    assert args.ctx == 256


@pytest.mark.parametrize("flags, needle", [
    (["--embedding"], "embeddings are not supported"),
    (["--lora", "x.gguf"], "LoRA adapters are not supported"),
    (["--context-shift"], "context shift is not supported"),
    (["--hf-repo", "ggml-org/x"], "models are not downloaded"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--reasoning", "maybe"], "invalid choice"),
])
def test_unknown_and_unsupported_flags_are_clear_errors(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*flags)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--reasoning-budget", "512"], "only -1 (unrestricted) and 0"),
    (["--chat-template", "chatml", "--chat-template-file", "x.jinja"], "use one"),
    (["--chat-template-file", "/no/such.jinja"], "no such file"),
    (["-n", "-5"], "-n/--n-predict"),
    (["--api-key", "  "], "--api-key is empty"),
    (["-ctk", "f16", "-ctv", "q8_0"], "K and V must have the same type"),
])
def test_bad_values_are_refused_before_loading(flags, needle, capsys):
    assert main(["serve", "-m", MODEL, "--port", "0", *flags]) == 1
    assert needle in capsys.readouterr().err


def test_api_keys_from_a_list_and_a_file(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# home assistant\nkey-two\n\nkey-three\n")
    s = settings("--api-key", "key-one", "--api-key-file", str(keyfile))
    assert s.keys() == ["key-one", "key-two", "key-three"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        settings("--api-key-file", str(empty))


def test_reasoning_budget_zero_and_auto():
    assert settings("--reasoning-budget", "0").defaults.reasoning == "off"
    assert settings("--reasoning", "auto").defaults.reasoning == "auto"
    assert settings().defaults.reasoning == "off"          # our default: a home assistant answers fast


def test_chat_template_names(fixture_gguf, tmp_path):
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=64))
    assert chat_template_override(SimpleNamespace(chat_template=None, chat_template_file=None), engine) is None
    chatml = chat_template_override(SimpleNamespace(chat_template="chatml", chat_template_file=None), engine)
    assert chatml.is_builtin is False and "<|im_start|>" in chatml.render([{"role": "user", "content": "hi"}])
    inline = chat_template_override(SimpleNamespace(chat_template="{{ messages[0].content }}!",
                                                    chat_template_file=None), engine)
    assert inline.render([{"role": "user", "content": "hi"}]) == "hi!"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    from_file = chat_template_override(SimpleNamespace(chat_template=None, chat_template_file=str(path)), engine)
    assert from_file.render([{"role": "user", "content": "hi"}]) == "[user]hi"
    msgs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    command_r = chat_template_override(SimpleNamespace(chat_template="command-r", chat_template_file=None), engine)
    assert command_r.render(msgs) == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
                                      "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                                      "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    llama3 = chat_template_override(SimpleNamespace(chat_template="llama3", chat_template_file=None), engine)
    assert llama3.render(msgs) == ("<|start_header_id|>system<|end_header_id|>\n\nYou are a test.<|eot_id|>"
                                   "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    gemma = chat_template_override(SimpleNamespace(chat_template="gemma", chat_template_file=None), engine)
    assert gemma.render(msgs) == "<start_of_turn>user\nYou are a test.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ValueError, match="not a template this server knows"):
        chat_template_override(SimpleNamespace(chat_template="vicuna", chat_template_file=None), engine)
    # with --jinja an unknown value is Jinja source (llama-server), even plain text
    literal = chat_template_override(SimpleNamespace(chat_template="vicuna", chat_template_file=None, jinja=True),
                                     engine)
    assert literal.render([{"role": "user", "content": "hi"}]) == "vicuna"
    path.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError):
        chat_template_override(SimpleNamespace(chat_template=None, chat_template_file=str(path)), engine)


def test_unknown_flag_exits_2_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "genie_rt.engine.cli", "serve", "-m", MODEL, "--embeddings"],
                       capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 2 and "--embeddings: embeddings are not supported" in r.stderr


def test_metrics_only_with_the_flag_as_llama_server(fixture_gguf):
    assert settings().metrics_endpoint is False and settings("--metrics").metrics_endpoint is True
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.server.app import create_app
    from starlette.testclient import TestClient
    engine = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=64))
    with TestClient(create_app(engine, settings())) as c:
        r = c.get("/metrics")
        assert r.status_code == 501 and "--metrics" in r.json()["error"]["message"]
    with TestClient(create_app(engine, settings("--metrics"))) as c:
        assert c.get("/metrics").status_code == 200
