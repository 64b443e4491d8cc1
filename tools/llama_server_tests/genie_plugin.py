"""pytest plugin loaded into llama.cpp's server test run (run.py passes `-p genie_plugin`).

- Turns off `ServerPreset.load_all()` (it starts every preset once to download its model from
  a hub; our stand-in always serves the fixture model, so there is nothing to fetch).
- Records every test's outcome (setup and call phases) with the first line of its failure,
  and writes them as JSON to $GENIE_LLAMA_RESULTS for run.py to classify.

Deliberately not here: any change to a test or to what the server answers.
"""
from __future__ import annotations

import json
import os

_results: dict[str, dict] = {}


def pytest_collection_modifyitems(session, config, items):
    import utils  # llama.cpp's tests/utils.py, imported by its conftest
    utils.ServerPreset.load_all = staticmethod(lambda: None)


def _first_line(report) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    line = (lines[0][2:].strip() if lines else text.strip().splitlines()[-1] if text.strip() else "")
    return line[:300]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
        entry["message"] = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else "")[:300]
    elif report.failed and entry["outcome"] != "failed":
        entry["outcome"] = "failed" if report.when != "teardown" else "error"
        entry["message"] = _first_line(report)
    if report.when == "teardown":
        _write()            # after every test: a run cut short still leaves its results


def _write():
    path = os.environ.get("GENIE_LLAMA_RESULTS")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def pytest_sessionfinish(session, exitstatus):
    _write()
