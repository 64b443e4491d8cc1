"""Soak a real `genie-rt serve`: N mixed requests at several concurrencies, then a verdict.

    python tools/soak.py --requests 5000 --concurrency 1,2,4,8 --json docs/reliability/soak-cpu.json
    python tools/soak.py --model tests/models/SmolLM2-135M-Instruct.Q4_1.gguf --requests 600
    python tools/soak.py --short            # what tests/test_reliability.py runs (~1 minute)

The mix (a fixed random sequence from --seed): chat (streamed or not, greedy or seeded), raw
completions, tool requests, stop strings, conversation ids (their KV files in a temporary
folder, so requests are cold, prefix-reused and restored from disk in turn), /tokenize +
/detokenize round trips, and --disconnect of the streams closed after the first chunk.

Checked per request: the status (200 expected everywhere), a reply every deterministic request
(greedy, or seeded) gives the same text as the first time that body was sent - whatever ran
before, whatever ran beside it, whatever the cache held - streamed content pieces never more than
completion_tokens, the streamed text equal to the same body's non-streamed text, and the round trip.
Sampled every --sample-s: RssAnon + VmSwap, open descriptors, threads, GPU memory (nvidia-smi),
the KV folder's size. The verdict: failures by kind, memory slope per request over the second half,
descriptor and thread growth, p50/p95 by concurrency, greedy answers before and after, the server's
log (no tracebacks, no ERROR lines), SIGTERM exit code and time. Exit 1 when it fails.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import FIXTURE, ServerProcess, write_report  # noqa: E402

SLOPE_LIMIT_KB = 10.0
USERS = ["Turn on the kitchen light", "What is the weather like tomorrow?", "Set a timer for ten minutes",
         "Tell me a joke about cats", "Écris une phrase en français, s'il te plaît ✨", "Dim the lights to 30%"]
SYSTEM = "You are a helpful home assistant. Answer briefly."
TOOLS = [{"type": "function", "function": {"name": "set_light", "description": "Switch a light",
                                           "parameters": {"type": "object", "properties": {
                                               "room": {"type": "string"}, "on": {"type": "boolean"}}}}}]


def make_request(rng: random.Random, max_tokens: int, n_convs: int) -> dict:
    """One request of the mix: {"kind", "route", "body", "stream", "disconnect"}."""
    kind = rng.choices(["chat", "chat_seed", "completion", "tools", "stop", "conversation", "tokenize"],
                       [3, 3, 2, 1, 2, 2, 1])[0]
    user = rng.choice(USERS)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    n = rng.choice([max_tokens // 2, max_tokens])
    if kind == "tokenize":
        return {"kind": kind, "route": "/tokenize", "body": {"content": user + " " + rng.choice(USERS)},
                "stream": False, "disconnect": False}
    if kind == "completion":
        body = {"prompt": user, "max_tokens": n, "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(4)}
        route = "/v1/completions"
    else:
        body = {"messages": msgs, "max_tokens": n, "temperature": 0}
        route = "/v1/chat/completions"
        if kind in ("chat_seed", "stop", "conversation"):
            body.update(temperature=0.7, seed=rng.randrange(4), top_k=0, top_p=1.0, min_p=0.0)
        if kind == "tools":
            body["tools"] = TOOLS
        if kind == "stop":      # short stops: they match, or are held back as a prefix and flushed at the end
            body["stop"] = [rng.choice(["e", "th", "a ", ".", "\n", "zz", "er", "s"])]
        if kind == "conversation":
            body["conversation_id"] = f"soak-{rng.randrange(n_convs)}"
            if rng.random() < 0.5:   # a second turn: the history of the first is in the KV file
                body["messages"] = msgs + [{"role": "assistant", "content": "Sure."},
                                           {"role": "user", "content": rng.choice(USERS)}]
    stream = rng.random() < 0.5
    return {"kind": kind, "route": route, "body": body, "stream": stream,
            "disconnect": False}


def _key(req: dict) -> str:
    return req["route"] + json.dumps(req["body"], sort_keys=True)


def _text(route: str, obj: dict) -> str:
    choice = obj["choices"][0]
    if route == "/v1/completions":
        return choice["text"]
    msg = choice["message"]
    return (msg.get("reasoning_content") or "") + (msg.get("content") or "") + json.dumps(msg.get("tool_calls"))


def _stream(client: httpx.Client, req: dict) -> tuple[str, int, int]:
    """(text, content pieces, completion_tokens) of a streamed reply; ('', -1, -1) after a disconnect."""
    body = {**req["body"], "stream": True, "stream_options": {"include_usage": True}}
    text, pieces, usage, calls = "", 0, None, []
    with client.stream("POST", req["route"], json=body) as r:
        if r.status_code != 200:
            r.read()
            raise StatusError(r.status_code, r.text[:300])
        for line in r.iter_lines():
            if req["disconnect"]:
                return "", -1, -1          # closes the connection after the first chunk
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise StatusError(obj["error"].get("code", 0), json.dumps(obj["error"])[:300])
            if obj.get("usage"):
                usage = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices", []):
                piece = ch.get("text") if req["route"] == "/v1/completions" else \
                    (ch["delta"].get("reasoning_content") or "") + (ch["delta"].get("content") or "")
                if ch.get("delta", {}).get("tool_calls"):
                    calls += ch["delta"]["tool_calls"]
                if piece:
                    text += piece
                    pieces += 1
    if req["route"] != "/v1/completions":
        text += json.dumps([{"type": c["type"], "function": c["function"], "id": c["id"]} for c in calls] or None)
    return text, pieces, usage if usage is not None else -1


class StatusError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"{status}: {detail}")
        self.status = status


class Soak:
    def __init__(self, srv: ServerProcess, timeout: float):
        self.srv = srv
        self.client = httpx.Client(base_url=srv.base, timeout=timeout)
        self.lock = threading.Lock()
        self.first: dict[str, str] = {}            # deterministic body -> its first text
        self.failures: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.latency: dict[int, list[float]] = defaultdict(list)
        self.kinds: Counter = Counter()
        self.done = 0

    def fail(self, kind: str, detail: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            self.examples.setdefault(kind, detail[:500])

    def check_same(self, req: dict, text: str) -> None:
        key = _key(req)
        with self.lock:
            seen = self.first.setdefault(key, text)
        if seen != text:
            self.fail("different_text_same_request", f"{key[:300]}: {seen[:120]!r} then {text[:120]!r}")

    def one(self, req: dict, concurrency: int) -> None:
        t0 = time.perf_counter()
        try:
            if req["kind"] == "tokenize":
                r = self.client.post("/tokenize", json=req["body"])
                if r.status_code != 200:
                    raise StatusError(r.status_code, r.text[:300])
                d = self.client.post("/detokenize", json={"tokens": r.json()["tokens"]})
                if d.status_code != 200:
                    raise StatusError(d.status_code, d.text[:300])
                if d.json()["content"].lstrip() != req["body"]["content"].lstrip():
                    self.fail("tokenize_round_trip", f"{req['body']['content']!r} -> {d.json()['content']!r}")
            elif req["stream"]:
                text, pieces, tokens = _stream(self.client, req)
                if not req["disconnect"]:
                    if pieces > tokens:
                        self.fail("pieces_over_completion_tokens", f"{_key(req)[:300]}: {pieces} > {tokens}")
                    self.check_same(req, text)
            else:
                r = self.client.post(req["route"], json=req["body"])
                if r.status_code != 200:
                    raise StatusError(r.status_code, r.text[:300])
                self.check_same(req, _text(req["route"], r.json()))
        except StatusError as exc:
            self.fail(f"status_{exc.status}", f"{_key(req)[:200]}: {exc}")
        except Exception as exc:  # noqa: BLE001 - every failure is counted by kind
            self.fail(f"exception_{type(exc).__name__}", f"{_key(req)[:200]}: {exc!r}")
        with self.lock:
            self.latency[concurrency].append(time.perf_counter() - t0)
            self.kinds[req["kind"] + ("_disconnect" if req["disconnect"] else "")] += 1
            self.done += 1


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else 0.0


def slope_per_request(samples: list[dict], key: str) -> float | None:
    """Least-squares slope of samples[key] against completed requests, over the second half."""
    pts = [(s["done"], s[key]) for s in samples[len(samples) // 2:] if s.get(key) is not None]
    if len(pts) < 3 or pts[-1][0] == pts[0][0]:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def greedy_probe(base: str) -> list[str]:
    """Greedy replies to three prompts, on a connection closed afterwards."""
    out = []
    with httpx.Client(base_url=base, timeout=300) as client:
        _greedy(client, out)
    time.sleep(0.3)                       # the server closes its side of the connection
    return out


def _greedy(client: httpx.Client, out: list[str]) -> None:
    for user in USERS[:3]:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": user}],
                                                      "max_tokens": 16, "temperature": 0})
        out.append(r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"status {r.status_code}")


def settled_sample(srv, base: dict, wait_s: float = 15.0, every_s: float = 0.2) -> dict:
    """The server's sample once it is idle: short-lived threads and descriptors (a KV file
    being saved, a cancelled job's last step, a closing connection) come and go under load
    (the 5,000-request CPU soak of 2026-12-03 saw 5-8 threads), so a single sample right after
    the last request can catch one and call it growth. Polls until threads and descriptors are
    back at or below the start's, for at most wait_s; a leak never gets there and is reported
    with the smallest counts seen."""
    def load(s: dict) -> tuple[int, int]:
        return s["threads"] or 0, s["fds"] or 0

    best, deadline = srv.sample(), time.monotonic() + wait_s
    while load(best)[0] > (base["threads"] or 0) or load(best)[1] > (base["fds"] or 0):
        if time.monotonic() >= deadline:
            break
        time.sleep(every_s)
        s = srv.sample()
        if sum(load(s)) <= sum(load(best)):
            best = s
    return best


def run_soak(model: Path, n_requests: int, levels: list[int], disconnect: float, max_tokens: int, seed: int,
             ctx: int, sample_s: float, timeout: float, backend: str = "cpu", extra: list[str] | None = None,
             progress=None) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="genie-soak-kv-") as kv:
        srv = ServerProcess(model, ["--ctx", str(ctx), "--max-queue", str(max(levels) * 2 + 4)] + (extra or []),
                            kv_dir=Path(kv), backend=backend)
        srv.start()
        try:
            soak = Soak(srv, timeout)
            greedy_before = greedy_probe(srv.base)
            base = srv.sample()
            samples, stop = [dict(base, done=0, t=0.0)], threading.Event()
            t_start = time.monotonic()

            def sampler():
                while not stop.wait(sample_s):
                    samples.append(dict(srv.sample(), done=soak.done, t=time.monotonic() - t_start))
            th = threading.Thread(target=sampler, daemon=True)
            th.start()
            per_level = max(1, n_requests // len(levels))
            phases = []
            for level in levels:
                reqs = [make_request(rng, max_tokens, n_convs=4) for _ in range(per_level)]
                for req in reqs:
                    req["disconnect"] = req["stream"] and req["kind"] != "tokenize" and rng.random() < disconnect
                t0 = time.monotonic()
                with ThreadPoolExecutor(level) as pool:
                    list(pool.map(lambda q, lv=level: soak.one(q, lv), reqs))
                phases.append({"concurrency": level, "requests": len(reqs), "seconds": round(time.monotonic() - t0, 2),
                               "p50_ms": round(_pct(soak.latency[level], 0.5), 1),
                               "p95_ms": round(_pct(soak.latency[level], 0.95), 1)})
                if progress:
                    progress(phases[-1])
            stop.set()
            th.join()
            soak.client.close()
            greedy_after = greedy_probe(srv.base)          # also lets the last cancelled job finish
            end = settled_sample(srv, base)                # no client connection open, as at the start
            samples.append(dict(end, done=soak.done, t=time.monotonic() - t_start))
        finally:
            rc = srv.stop()
        problems = srv.log_problems()
    mem = [dict(s, mem_kb=(s["rss_anon_kb"] or 0) + (s["vm_swap_kb"] or 0)) for s in samples]
    slope = slope_per_request(mem, "mem_kb")
    fd_growth = (end["fds"] or 0) - (base["fds"] or 0)
    thread_growth = (end["threads"] or 0) - (base["threads"] or 0)
    checks = {
        "no_failed_requests": sum(soak.failures.values()) == 0,
        "memory_slope_below_10kb_per_request": slope is not None and slope < SLOPE_LIMIT_KB,
        "no_descriptor_growth": fd_growth <= 0,
        "no_thread_growth": thread_growth <= 0,
        "greedy_same_before_and_after": greedy_before == greedy_after,
        "log_clean": not problems,
        "sigterm_exit_0": rc == 0,
    }
    return {
        "tool": "soak", "model": model.name, "backend": backend, "requests": soak.done, "seed": seed,
        "max_tokens": max_tokens, "ctx": ctx, "disconnect_fraction": disconnect, "mix": dict(soak.kinds),
        "failures": dict(soak.failures), "failure_examples": soak.examples, "phases": phases,
        "memory": {"slope_kb_per_request": None if slope is None else round(slope, 3),
                   "rss_anon_kb_start": base["rss_anon_kb"], "rss_anon_kb_end": end["rss_anon_kb"],
                   "vm_swap_kb_end": end["vm_swap_kb"], "gpu_mb_start": base["gpu_mb"], "gpu_mb_end": end["gpu_mb"],
                   "kv_folder_bytes_max": max(s["kv_bytes"] for s in samples)},
        "descriptors": {"start": base["fds"], "end": end["fds"], "growth": fd_growth},
        "threads": {"start": base["threads"], "end": end["threads"], "growth": thread_growth},
        "greedy_before": greedy_before, "greedy_after": greedy_after,
        "distinct_deterministic_bodies": len(soak.first),
        "log_problems": problems[:20], "sigterm": {"exit_code": rc, "seconds": round(srv.stop_seconds or 0, 2)},
        "server_start_seconds": round(srv.start_seconds or 0, 1),
        "samples": [{k: s[k] for k in ("done", "t", "mem_kb", "fds", "threads", "kv_bytes")} for s in mem],
        "checks": checks, "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=FIXTURE)
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts, one phase each")
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of streams closed after the first chunk")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--short", action="store_true", help="40 requests at 1 and 4 clients, 6 tokens (the test's mode)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args(argv)
    if a.short:
        a.requests, a.concurrency, a.max_tokens, a.sample_s = 40, "1,4", 6, 0.2
    levels = [int(x) for x in a.concurrency.split(",")]
    report = run_soak(a.model, a.requests, levels, a.disconnect, a.max_tokens, a.seed, a.ctx, a.sample_s, a.timeout,
                      a.backend, progress=lambda ph: print(json.dumps(ph), flush=True))
    summary = {k: report[k] for k in ("requests", "failures", "memory", "descriptors", "threads", "sigterm", "checks",
                                      "passed")}
    print(json.dumps(summary, indent=1))
    report = write_report(a.json, report, argv)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
