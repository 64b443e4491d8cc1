#!/usr/bin/env python3
"""Run llama.cpp's own server tests against `genie-rt serve`, and classify the results.

    python tools/llama_server_tests/run.py /path/to/llama.cpp            # the default test files
    python tools/llama_server_tests/run.py /path/to/llama.cpp test_basic.py test_tokenize.py
    python tools/llama_server_tests/run.py LLAMA_CPP --json results.json --markdown

How: llama.cpp's `tools/server/tests/utils.py` starts `$LLAMA_SERVER_BIN_PATH` with
llama-server's flags. We point that at fake_llama_server.py, which swaps the model source for
our fixture model on the CPU back-end and passes every other flag to `genie-rt serve`
unchanged; genie_plugin.py turns off the preset downloads and records each outcome. Nothing
of llama.cpp is copied into this repository: the tests are read from the checkout given.

Each test then falls in one category (categories.py says which and why):
  real         - what the test checks is behaviour a drop-in must have: its failures are
                 real differences
  model-text   - the test expects the exact text (or token counts) of llama.cpp's test models
                 (stories260K, ...), which our random-weight fixture cannot write
  unsupported  - embeddings, reranking, infill, images/audio, LoRA, speculative decoding, the
                 multi-model router, MCP / built-in tools: features this server does not have
The figure of merit is the pass rate of `real` tests. Needs `pytest`, `requests`, `wget`,
`filelock` and `openai` (llama.cpp's tests/requirements.txt), installed in this environment.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from categories import classify  # noqa: E402

DEFAULT_FILES = [
    "test_basic.py", "test_chat_completion.py", "test_completion.py", "test_security.py",
    "test_tokenize.py", "test_tool_call.py", "test_ctx_shift.py", "test_slot_save.py",
    "test_ignore_eos.py", "test_template.py", "test_compat_oai_responses.py", "test_compat_anthropic.py",
    "test_metrics.py", "test_stream.py", "test_kv_keep_only_active.py", "test_compat_gcp.py",
    "test_sleep.py", "test_infill.py", "test_embedding.py", "test_rerank.py", "test_lora.py",
    "test_speculative.py", "test_vision_api.py",
]


def run_tests(llama_cpp: Path, files: list[str], results_path: Path, extra: list[str]) -> int:
    tests_dir = llama_cpp / "tools" / "server" / "tests"
    if not (tests_dir / "utils.py").is_file():
        raise SystemExit(f"{tests_dir}/utils.py not found: give the root of a llama.cpp checkout")
    with tempfile.TemporaryDirectory(prefix="genie-llama-tests-") as tmp:
        wrapper = Path(tmp) / "llama-server"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "fake_llama_server.py"}" "$@"\n')
        wrapper.chmod(0o755)
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper), "GENIE_LLAMA_RESULTS": str(results_path),
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        env.setdefault("PORT", "18080")
        # -m "not slow": as llama.cpp's tests.sh runs them by default (the slow ones download 1-8B models)
        cmd = [sys.executable, "-m", "pytest", "-p", "genie_plugin", "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", "-m", "not slow", *extra, *[f"unit/{f}" for f in files]]
        print("running:", " ".join(cmd), f"(in {tests_dir})", flush=True)
        return subprocess.call(cmd, cwd=tests_dir, env=env, stdout=sys.stderr if extra else None)


def report(results: dict, as_markdown: bool) -> dict:
    by_cat: dict[str, Counter] = defaultdict(Counter)
    failures: list[tuple[str, str, str]] = []
    for nodeid, r in sorted(results.items()):
        cat, why = classify(nodeid)
        by_cat[cat][r["outcome"]] += 1
        if r["outcome"] in ("failed", "error") and cat == "real":
            failures.append((nodeid, r["message"], why))
    summary = {cat: dict(c) for cat, c in sorted(by_cat.items())}
    real = by_cat.get("real", Counter())
    ran = real["passed"] + real["failed"] + real["error"]
    summary["real_pass_rate"] = round(real["passed"] / ran, 4) if ran else None
    summary["total"] = sum(sum(c.values()) for c in by_cat.values())
    summary["passed"] = sum(c["passed"] for c in by_cat.values())
    if as_markdown:
        print("| category | passed | failed | skipped |\n|---|---|---|---|")
        for cat, c in sorted(by_cat.items()):
            print(f"| {cat} | {c['passed']} | {c['failed'] + c['error']} | {c['skipped']} |")
    else:
        for cat, c in sorted(by_cat.items()):
            print(f"{cat:12s} passed {c['passed']:4d}  failed {c['failed'] + c['error']:4d}  skipped {c['skipped']:4d}")
    print(f"real: {real['passed']} of {ran} passed ({100 * (summary['real_pass_rate'] or 0):.1f} %); "
          f"all: {summary['passed']} of {summary['total']}")
    for nodeid, msg, why in failures:
        print(f"  REAL FAIL {nodeid}: {msg}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("llama_cpp", type=Path, help="root of a llama.cpp checkout (its tools/server/tests are run)")
    p.add_argument("files", nargs="*", help="test files under tools/server/tests/unit (default: %(default)s)",
                   default=DEFAULT_FILES)
    p.add_argument("--json", type=Path, default=None, help="write the raw results and the summary here")
    p.add_argument("--markdown", action="store_true", help="print the summary as a markdown table")
    p.add_argument("--report-only", type=Path, default=None, help="classify a results JSON written before")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--update", type=Path, default=None,
                   help="a results JSON of an earlier run: this run's outcomes replace its ones (a rerun of "
                        "some tests after a fix), and the report covers both")
    args = p.parse_args(argv)
    if args.report_only:
        results = json.loads(args.report_only.read_text())["results"]
    else:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            results_path = Path(f.name)
        run_tests(args.llama_cpp.resolve(), args.files, results_path, ["-k", args.k] if args.k else [])
        results = json.loads(results_path.read_text() or "{}")
        results_path.unlink()
        if args.update:
            earlier = json.loads(args.update.read_text())["results"]
            results = {**earlier, **results}
    summary = report(results, args.markdown)
    if args.json:
        for nodeid, r in results.items():
            r["category"], r["why"] = classify(nodeid)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "summary": summary,
                                         "results": results}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
