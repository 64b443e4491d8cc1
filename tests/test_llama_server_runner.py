"""tools/llama_server_tests: which of llama.cpp's server tests count for issue 16's figure (only the
issue's exclusions: the test models' exact text, embeddings, reranking, infill, images), and the
docs block rendered from a results JSON (figure, command, device, date). The run itself is
`python tools/llama_server_tests/run.py --fetch DIR` (minutes; see docs/server.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "llama_server_tests"))
from categories import classify  # noqa: E402
import run  # noqa: E402


@pytest.mark.parametrize("nodeid,category", [
    ("unit/test_basic.py::test_server_props", "real"),
    ("unit/test_basic.py::test_load_split_model", "real"),                  # a feature we lack still counts
    ("unit/test_ctx_shift.py::test_ctx_shift_enabled", "real"),
    ("unit/test_chat_completion.py::test_completion_with_grammar[False-x]", "real"),
    ('unit/test_chat_completion.py::test_completion_with_response_format[response_format0-6-"42"]', "real"),
    ("unit/test_chat_completion.py::test_completion_with_response_format[response_format1-10-[ -3000 ]]",
     "model-text"),
    ("unit/test_completion.py::test_completion[I believe-8]", "model-text"),
    ("unit/test_chat_completion.py::test_return_progress[64-4-False]", "model-text"),   # the batch count only
    ("unit/test_chat_completion.py::test_return_progress[64-2-True]", "real"),
    ("unit/test_security.py::test_local_media_file[a-b-True]", "excluded"),
    ("unit/test_metrics.py::test_metrics_embedding_prompt_is_counted", "excluded"),
    ("unit/test_metrics.py::test_metrics_disabled", "real"),
    ("unit/test_embedding.py::test_embedding_single", "not-selected"),
    ("unit/test_lora.py::test_lora", "not-selected"),
    ("unit/test_some_new_file.py::test_x", "not-selected"),
])
def test_classify(nodeid, category):
    cat, why = classify(nodeid)
    assert cat == category
    assert cat == "real" or why                                             # every exclusion says why


def test_docs_block_comes_from_the_results(tmp_path):
    results = {"unit/test_basic.py::test_a": {"outcome": "passed", "message": ""},
               "unit/test_basic.py::test_b": {"outcome": "failed", "message": "assert 400 == 200"},
               "unit/test_lora.py::test_c": {"outcome": "failed", "message": "died"}}
    summary = run.report(results, as_markdown=False)
    for k, r in results.items():
        r["category"], r["why"] = classify(k)
    assert summary["real_pass_rate"] == 0.5
    data = {"date": "2026-12-02 20:00 UTC", "device": "some CPU, 2 cores", "commit": "abc1234",
            "source": "PyPI x", "command": "python tools/llama_server_tests/run.py --fetch d",
            "summary": summary, "results": results}
    doc = tmp_path / "server.md"
    doc.write_text(f"intro\n{run.BEGIN}\nold numbers\n{run.END}\nrest\n")
    run.write_docs(doc, data)
    text = doc.read_text()
    assert "old numbers" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "**real: 1 of 2 pass (50.0 %)**" in text and "| not-selected | 0 | 1 | 0 |" in text
    assert "2026-12-02 20:00 UTC" in text and "some CPU, 2 cores" in text and "--fetch d" in text
    assert "`test_basic.py::test_b`: assert 400 == 200" in text
    (tmp_path / "bare.md").write_text("no block")
    with pytest.raises(SystemExit):
        run.write_docs(tmp_path / "bare.md", data)


def test_report_of_several_runs_is_their_union(tmp_path):
    def write(name, results, command):
        path = tmp_path / name
        path.write_text(json.dumps({"date": "d", "device": "cpu", "commit": "c", "source": "s",
                                    "command": command, "results": results}))
        return path
    a = write("a.json", {"unit/test_basic.py::test_a": {"outcome": "failed", "message": "x"},
                         "unit/test_basic.py::test_b": {"outcome": "passed", "message": ""}}, "run a")
    b = write("b.json", {"unit/test_basic.py::test_a": {"outcome": "passed", "message": ""}}, "run b")
    out = tmp_path / "out.json"
    assert run.main(["--report-only", str(a), str(b), "--json", str(out), "--min-rate", "1.0"]) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["real"] == {"passed": 2} and "run a" in data["command"] and "run b" in data["command"]
    assert run.main(["--report-only", str(b), str(a), "--min-rate", "1.0"]) == 1     # a's failure wins now
