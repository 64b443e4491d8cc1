#!/usr/bin/env python3
"""Markdown table from `genie-rt bench --json` files (docs numbers are regenerated, not typed):

    python tools/bench_table.py docs/bench/h200-2026-12-02-*.json
"""
import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    tests: list[str] = []
    rows = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        info = d["info"]
        res = {r["test"]: r["avg_ts"] for r in d["results"]}
        tests += [t for t in res if t not in tests]
        rows.append((Path(info["model"]).stem, info["device"], info["kv_dtype"], info["date"][:10], res))
    print("| file | device | KV | date | " + " | ".join(tests) + " |")
    print("|---" * (4 + len(tests)) + "|")
    for name, dev, kv, date, res in rows:
        cells = [f"{res[t]:,.0f}" if t in res else "" for t in tests]
        print(f"| {name} | {dev} | {kv} | {date} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
