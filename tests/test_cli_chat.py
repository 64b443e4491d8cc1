"""`genie-rt chat` and `run --conversation` (engine/cli_chat.py, engine/conversation.py): history
kept and replayed, streaming to stdout, /reset, persistence, and the default folders."""
from __future__ import annotations

import io
import json

import pytest

from genie_rt.engine import cli_chat
from genie_rt.engine.cli import main
from genie_rt.engine.conversation import ConversationLog


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "genie-rt"


@pytest.fixture
def prompts(monkeypatch):
    """Every chat_turn's messages, as the template saw them."""
    seen = []
    real = cli_chat.chat_turn

    def spy(engine, messages, args, cid):
        seen.append([dict(m) for m in messages])
        return real(engine, messages, args, cid)
    monkeypatch.setattr(cli_chat, "chat_turn", spy)
    return seen


def chat(monkeypatch, fixture_gguf, lines: str, *extra) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return main(["chat", "-m", str(fixture_gguf), "--backend", "cpu", "--ctx", "256", "-n", "3", "--temp", "0",
                 *extra])


def test_chat_keeps_history_and_reset_forgets_it(monkeypatch, fixture_gguf, prompts, capsys, cache):
    assert chat(monkeypatch, fixture_gguf, "Hi\n\nLights?\n/reset\nAgain\n/exit\nnever read\n",
                "--system", "Be brief.") == 0
    out, err = capsys.readouterr()
    assert [[m["role"] for m in p] for p in prompts] == [
        ["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    assert prompts[1][1]["content"] == "Hi" and prompts[1][3]["content"] == "Lights?"
    assert prompts[2][1]["content"] == "Again"
    assert "conversation forgotten" in err and err.count("finish:") == 3 and "ready in" in err
    assert not (cache / "conversations").exists()          # nothing saved without --conversation


def test_chat_conversation_persists_and_continues(monkeypatch, fixture_gguf, prompts, capsys, cache):
    assert chat(monkeypatch, fixture_gguf, "Hi\n", "--conversation", "kitchen") == 0
    saved = ConversationLog("kitchen").load()
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[0]["content"] == "Hi"
    assert (cache / "kv" / "kitchen.kv").is_file()         # the KV cache in the default folder
    # a later run --conversation replays the earlier turn
    assert main(["run", "-m", str(fixture_gguf), "--backend", "cpu", "--ctx", "256", "-n", "3", "--temp", "0",
                 "-p", "And now?", "--conversation", "kitchen"]) == 0
    assert [m["content"] for m in prompts[-1]][::2] == ["Hi", "And now?"]
    assert len(ConversationLog("kitchen").load()) == 4
    capsys.readouterr()
    # chat again: it says so, and /reset deletes the history
    assert chat(monkeypatch, fixture_gguf, "/reset\n", "--conversation", "kitchen") == 0
    assert "conversation kitchen (2 earlier turns)" in capsys.readouterr().err
    assert ConversationLog("kitchen").load() == []


def test_a_damaged_history_is_refused_with_its_path(monkeypatch, fixture_gguf, capsys, cache):
    d = cache / "conversations"
    d.mkdir(parents=True)
    (d / "k.json").write_text(json.dumps({"format": 1, "messages": [{"role": "user"}]}))
    assert chat(monkeypatch, fixture_gguf, "Hi\n", "--conversation", "k") == 1
    err = capsys.readouterr().err
    assert "k.json is not a format-1 history" in err and "delete it" in err
    assert (d / "k.json").read_text().startswith("{")     # left as it was


def test_kv_uses_the_default_folder(cache, capsys):
    assert main(["kv", "list"]) == 0
    assert str(cache / "kv") in capsys.readouterr().out
