#!/usr/bin/env python3
"""Markdown table of decode profiles side by side (docs numbers are regenerated, not typed):

    python tools/profile_table.py docs/bench/profile-decode-h200-2026-12-03b.json \\
        docs/bench/profile-decode-h200-2026-12-03c.json

Each file is `tools/profile_decode.py --json` output: the whole step's time under each
setting, then what removing each kernel family saves. One column per file (named by the
file's last dash-separated word), us per step; the step rows in ms with tokens/s.
"""
import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    cols = [{r["family"]: r["ms"] for r in json.loads(Path(p).read_text())} for p in paths]
    names = [Path(p).stem.rsplit("-", 1)[-1] for p in paths]
    rows: list[str] = []
    for c in cols:
        rows += [f for f in c if f not in rows]
    print("| decode step, depth 512 | " + " | ".join(names) + " |")
    print("|---" + "|---:" * len(paths) + "|")
    for f in rows:
        if f.startswith("whole step"):
            cells = [f"{c[f]:.3f} ms ({1000 / c[f]:.0f}/s)" if f in c else "" for c in cols]
        else:
            cells = [f"{c[f] * 1000:.0f} us" if f in c else "" for c in cols]
        print(f"| {f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
