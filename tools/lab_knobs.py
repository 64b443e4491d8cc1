#!/usr/bin/env python3
"""Run a Python command with lab knobs (module attributes of the package) set first.

A lab knob (e.g. quant/gemv.py PDL_PIN_WEIGHTS) is read when a kernel is built, so a benchmark
of another setting needs it set in the process before anything compiles. This does that, then
runs the rest of the command line as `python` would:

    python tools/lab_knobs.py quant.gemv.PDL_PIN_WEIGHTS=False -- -m genie_rt.engine.cli bench ...
    python tools/lab_knobs.py quant.gemv.PDL_EARLY_TRIPS=1 -- tools/bench_prefix.py --backend cuda ...

Each assignment is `module.NAME=value` (module relative to genie_rt; value a Python literal). The
attribute must exist: a typo is an error, not a silently ignored setting.
"""
from __future__ import annotations

import ast
import importlib
import runpy
import sys


def target(assignment: str) -> tuple:
    """(the module, NAME) an assignment `module.NAME=value` sets; SystemExit for anything else
    (no '=', no such module, no such attribute)."""
    path, sep, _ = assignment.partition("=")
    module, _, name = path.rpartition(".")
    if not sep or not module or not name:
        raise SystemExit(f"lab_knobs: {assignment!r} is not module.NAME=value")
    try:
        mod = importlib.import_module(f"genie_rt.{module}")
    except ImportError:
        raise SystemExit(f"lab_knobs: no module genie_rt.{module} (in {assignment!r})") from None
    if not hasattr(mod, name):
        raise SystemExit(f"lab_knobs: genie_rt.{module} has no attribute {name!r}")
    return mod, name


def value(assignment: str):
    """The value an assignment `module.NAME=value` sets; SystemExit where it is not a Python literal."""
    target_name, _, text = assignment.partition("=")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"lab_knobs: {text!r} (for {target_name}) is not a Python literal") from None


def apply(assignment: str) -> None:
    mod, name = target(assignment)
    parsed = value(assignment)
    setattr(mod, name, parsed)
    print(f"lab_knobs: genie_rt.{assignment.partition('=')[0]} = {parsed!r}", file=sys.stderr)


class Ways:
    """Lab knobs set one way at a time (a way: a list of assignments) in one process, each way from the
    values every knob had when this was made: `use(way)`, then `restore()` puts them all back. Every
    assignment is checked here (the module, the attribute, a literal value), so a typo fails before
    anything runs."""

    def __init__(self, ways: list):
        self._saved = {}
        for way in ways:
            for a in way:
                mod, name = target(a)
                value(a)
                self._saved.setdefault((mod, name), getattr(mod, name))

    def use(self, way: list) -> None:
        self.restore()
        for a in way:
            apply(a)

    def restore(self) -> None:
        for (mod, name), kept in self._saved.items():
            setattr(mod, name, kept)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: lab_knobs.py module.NAME=value ... -- (-m module | -c code | script) [args]")
    split = argv.index("--")
    for a in argv[:split]:
        apply(a)
    rest = argv[split + 1:]
    if not rest:
        raise SystemExit("lab_knobs: nothing to run after --")
    if rest[0] == "-m" and len(rest) > 1:
        sys.argv = [rest[1]] + rest[2:]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    elif rest[0] == "-c" and len(rest) > 1:
        sys.argv = ["-c"] + rest[2:]
        exec(compile(rest[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
