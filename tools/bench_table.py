#!/usr/bin/env python3
"""Markdown table from benchmark JSON files (docs numbers are regenerated, not typed):

    python tools/bench_table.py docs/bench/h200-2026-12-03-*.json docs/bench/llama-bench-h200-2026-12-03-*.json

Takes `genie-rt bench --json` files and llama-bench `-o json` files (a list of results) alike,
and llama-bench `-o md` tables (*.md: no device in them - `--md-device NAME` names it, else the
backend column; KV llama-bench's default f16; the date the YYYY-MM-DD in the file's name);
one row per file, named by the model file and the engine. When both engines ran the same
model file, a third row gives genie-rt's speed as a multiple of llama.cpp's.
"""
import json
import re
import sys
from pathlib import Path


def read_md(path: str, device: str = "") -> tuple[str, str, str, str, str, dict]:
    """A llama-bench `-o md` table: | model | size | params | backend | ngl | test | t/s |."""
    res, backend = {}, ""
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or cells[0] in ("model", "") or set(cells[0]) <= {"-", ":"}:
            continue
        test, ts = cells[-2].replace(" ", ""), cells[-1].split()[0]
        res[test] = float(ts)
        backend = cells[3]
    if not res:
        raise SystemExit(f"{path}: no llama-bench rows")
    date = re.search(r"\d{4}-\d{2}-\d{2}", Path(path).name)
    model = re.sub(r"^llama-bench-[a-z0-9]+-\d{4}-\d{2}-\d{2}[a-z]?-", "", Path(path).stem)
    return model, "llama.cpp", device or backend, "f16", date.group(0) if date else "", res


def read(path: str, md_device: str = "") -> tuple[str, str, str, str, str, dict]:
    """(model, engine, device, KV type, date, {test: tokens/s}) of one JSON or md file."""
    if path.endswith(".md"):
        return read_md(path, md_device)
    d = json.loads(Path(path).read_text())
    if isinstance(d, list):                              # llama-bench -o json
        if not d:
            raise SystemExit(f"{path}: no llama-bench results")
        res = {(f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}")
               + (f"@d{r['n_depth']}" if r.get("n_depth") else ""): r["avg_ts"] for r in d}
        r0 = d[0]
        return (Path(r0["model_filename"]).stem, "llama.cpp", r0["gpu_info"] or r0["cpu_info"],
                r0["type_k"], r0["test_time"][:10], res)
    info = d["info"]
    return (Path(info["model"]).stem, "genie-rt", info["device"], info["kv_dtype"], info["date"][:10],
            {r["test"] + (f"@d{r['n_depth']}" if r.get("n_depth") else ""): r["avg_ts"] for r in d["results"]})


def main(args: list[str]) -> int:
    md_device = ""
    if "--md-device" in args:
        i = args.index("--md-device")
        if i + 1 >= len(args):
            raise SystemExit("bench_table: --md-device needs a name (e.g. \"NVIDIA H200\")")
        md_device = args[i + 1]
        args = args[:i] + args[i + 2:]
    rows = [read(p, md_device) for p in args]
    tests: list[str] = []
    for row in rows:
        tests += [t for t in row[5] if t not in tests]
    rows.sort(key=lambda r: (r[0], r[1] != "genie-rt"))
    print("| file | engine | device | KV | date | " + " | ".join(tests) + " |")
    print("|---" * (5 + len(tests)) + "|")
    by_model: dict[str, dict[str, dict]] = {}
    for model, engine, dev, kv, date, res in rows:
        by_model.setdefault(model, {})[engine] = res
        cells = [f"{res[t]:,.0f}" if t in res else "" for t in tests]
        print(f"| {model} | {engine} | {dev} | {kv} | {date} | " + " | ".join(cells) + " |")
        both = by_model[model]
        if engine == "llama.cpp" and "genie-rt" in both:
            g = both["genie-rt"]
            cells = [f"**{g[t] / res[t]:.2f}x**" if t in g and t in res else "" for t in tests]
            print(f"| {model} | genie-rt / llama.cpp | | | | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
