"""Regenerate the figures of docs/reliability.md from the JSON reports in docs/reliability/.

    python tools/reliability_report.py          # rewrites the part between the FIGURES markers

Every table says the command, device, date and commit its JSON recorded.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- FIGURES BEGIN (tools/reliability_report.py) -->", "<!-- FIGURES END -->"


def _where(r: dict) -> str:
    d = r.get("device", {})
    dev = f"{d.get('cpu')} ({d.get('cores')} cores{', ' + d['gpu'] if d.get('gpu') else ''})"
    return f"`{r.get('command')}` - {dev}, {r.get('date')}, commit {r.get('commit')}, model {r.get('model')}"


def soak_section(r: dict) -> list[str]:
    m = r["memory"]
    out = [f"### Soak ({r['backend']}, {r['requests']} requests)", "", _where(r), "",
           "| concurrency | requests | seconds | p50 ms | p95 ms |", "|---|---|---|---|---|"]
    out += [f"| {p['concurrency']} | {p['requests']} | {p['seconds']} | {p['p50_ms']} | {p['p95_ms']} |"
            for p in r["phases"]]
    out += ["", f"- failures: {r['failures'] or 'none'}; mix: {r['mix']}",
            f"- memory (RssAnon + VmSwap) slope over the second half: {m['slope_kb_per_request']} KB per request "
            f"(RssAnon {m['rss_anon_kb_start']} -> {m['rss_anon_kb_end']} KiB); KV folder at most "
            f"{m['kv_folder_bytes_max']} bytes",
            f"- descriptors {r['descriptors']['start']} -> {r['descriptors']['end']}, threads "
            f"{r['threads']['start']} -> {r['threads']['end']}",
            f"- greedy answers the same before and after: {r['greedy_before'] == r['greedy_after']}; "
            f"{r['distinct_deterministic_bodies']} distinct deterministic (greedy or seeded) bodies, each reply "
            "identical every time it was sent",
            f"- SIGTERM: exit {r['sigterm']['exit_code']} in {r['sigterm']['seconds']} s; log problems: "
            f"{len(r['log_problems'])}",
            f"- verdict: {'PASS' if r['passed'] else 'FAIL'} {r['checks']}", ""]
    return out


def fuzz_section(r: dict) -> list[str]:
    out = ["### Fuzzing", "", _where(r), "", "| target | rounds | examples | failures | notes |", "|---|---|---|---|---|"]
    for name, t in r["targets"].items():
        notes = {k: v for k, v in t.items() if k not in ("rounds", "examples", "failures", "seconds")}
        out.append(f"| {name} | {t['rounds']} | {t['examples']} | {len(t['failures'])} | {json.dumps(notes)} |")
    for name, t in r["targets"].items():
        for f in t["failures"][:2]:
            out.append(f"\n- {name} failure: `{f.splitlines()[0][:300]}`")
    return out + [""]


def faults_section(r: dict) -> list[str]:
    out = ["### Faults", "", _where(r), "", "| case | passed | seconds | details |", "|---|---|---|---|"]
    for name, c in r["cases"].items():
        details = {k: v for k, v in c.items() if k not in ("passed", "seconds")}
        out.append(f"| {name} | {c['passed']} | {c['seconds']} | {json.dumps(details)[:400]} |")
    return out + [""]


def render(folder: Path) -> str:
    lines = []
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        lines += [f"<!-- from {path.relative_to(ROOT)} -->"]
        lines += {"soak": soak_section, "fuzz": fuzz_section, "faults": faults_section}[r["tool"]](r)
    return "\n".join(lines)


def main() -> int:
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + BEGIN + "\n" + render(DOC.parent / "reliability") + "\n" + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
