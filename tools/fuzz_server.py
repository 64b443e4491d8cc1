"""Fuzz the server, the tokenizer, GGUF headers and KV files with hypothesis, bounded in time.

    python tools/fuzz_server.py --seconds 600 --json docs/reliability/fuzz-cpu.json
    python tools/fuzz_server.py --targets http --seconds 120 --model tests/models/SmolLM2-135M-Instruct.Q4_1.gguf

Targets (each a function of a few hypothesis examples; the tool runs rounds of them, each round
with a new seed, until its share of --seconds is spent; tests/test_fuzz.py runs one small
derandomized round of each):
- http: request bodies for every generation, token and template route - every field given wrong
  types, extremes (2^64, 1e308, -0.0), NaN/Infinity literals, huge strings, lone surrogates,
  invalid UTF-8 bytes, deep JSON, truncated bodies, random keys. Property: a status below 500
  with a JSON `error.message` for every refusal, no 5xx error event in a stream, /health
  still 200 - and at the end the greedy reference reply is unchanged and the log is clean.
- tokenizer: decode(encode(s)) == s for any text (the fixture's byte-level BPE; SmolLM2 and
  Gemma 3 too when tests/models has them).
- gguf: the fixture's header with one count, length, type or dimension replaced (by an
  extreme or random value): open_gguf + ModelConfig + check_tensors either load or raise
  GGUFError/ValueError naming the file, no hang (30 s) and 64 MiB of Python allocations.
- kvfile: a saved conversation file truncated, with bytes flipped or replaced: the next request
  of that conversation runs cold (nothing restored), gives the cold greedy reply, the bad file
  is deleted.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import tracemalloc
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import FIXTURE, ROOT, ServerProcess, write_report  # noqa: E402

# -- http ------------------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "Turn on the kitchen light"}]
BASES = {
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 2},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/completion": {"prompt": "Hello", "n_predict": 2},
    "/tokenize": {"content": "Hello world"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": MSG},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": MSG},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 2},
    "/v1/chat/completions/input_tokens": {"messages": MSG},
}
FIELDS = ["messages", "prompt", "content", "tokens", "max_tokens", "n_predict", "temperature", "top_k", "top_p",
          "min_p", "seed", "stop", "stream", "stream_options", "presence_penalty", "frequency_penalty",
          "repeat_penalty", "repeat_last_n", "logit_bias", "ignore_eos", "tools", "tool_choice", "conversation_id",
          "chat_template_kwargs", "response_format", "n", "add_special", "with_pieces", "input", "system",
          "max_output_tokens", "cache_prompt", "n_probs", "logprobs", "id_slot", "samplers", "model", "options"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
    st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, 1e308, 5e-324, 0.5]),
    st.text(max_size=40), st.sampled_from(["", "\ud800", "\udfff x", "\x00", "<|im_start|>", "\u202e", "🦙" * 50]),
    st.builds(lambda n: "x" * n, st.sampled_from([10_000, 200_000])))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]),
                                                             values),
                                           "content": values}), max_size=3)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """(route, raw body): a valid base body with fields replaced, then maybe broken as bytes."""
    route = draw(st.sampled_from(sorted(BASES)))
    body = dict(BASES[route])
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)))
        body[name] = draw(messages if name == "messages" and draw(st.booleans()) else values)
    if draw(st.booleans()):
        body["stream"] = True
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as is", "as is", "truncate", "invalid utf-8", "deep", "not an object", "garbage"]))
    if how == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "invalid utf-8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + raw[at:]
    elif how == "deep":
        depth = draw(st.sampled_from([100, 5_000, 100_000]))
        raw = raw[:-1] + b', "z": ' + b"[" * depth + b"]" * depth + b"}"
    elif how == "not an object":
        raw = draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"NaN", b""]))
    elif how == "garbage":
        raw = draw(st.binary(max_size=64))
    return route, raw


def check_reply(route: str, raw: bytes, r: httpx.Response, text: str) -> str | None:
    """None if the answer is acceptable, else what is wrong."""
    if r.status_code >= 500:
        return f"{route} answered {r.status_code}: {text[:300]}"
    if r.status_code >= 400:
        try:
            msg = json.loads(text)["error"]["message"]
            if not isinstance(msg, str) or not msg:
                return f"{route} {r.status_code} without an error message: {text[:300]}"
        except (ValueError, KeyError, TypeError):
            if "error" not in text:
                return f"{route} {r.status_code} body is not a JSON error: {text[:300]}"
    elif "text/event-stream" in r.headers.get("content-type", ""):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:]).get("error", {})
                if isinstance(err, dict) and int(err.get("code", 0) or 0) >= 500:
                    return f"{route} stream error event {err}"
    return None


def fuzz_http(base: str, max_examples: int, derandomize: bool, seed: int | None = None) -> dict:
    """One round of request bodies against a running server; raises AssertionError on a bad reply."""
    client = httpx.Client(base_url=base, timeout=120)
    seen = {"examples": 0, "by_status": {}}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(bodies())
    def one(case):
        route, raw = case
        r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
        text = r.text
        seen["examples"] += 1
        seen["by_status"][str(r.status_code)] = seen["by_status"].get(str(r.status_code), 0) + 1
        bad = check_reply(route, raw, r, text)
        assert bad is None, bad + f"\nbody: {raw[:400]!r}"
        assert client.get("/health").status_code == 200, f"/health failed after {route} {raw[:400]!r}"

    if seed is not None:
        one = _seeded(one, seed)
    try:
        one()
    finally:
        client.close()
    return seen


def _seeded(fn, seed: int):
    from hypothesis import seed as hseed
    return hseed(seed)(fn)


# -- tokenizer ------------------------------------------------------------------------------------
def fuzz_tokenizer(tokenizer, max_examples: int, derandomize: bool, seed: int | None = None) -> dict:
    seen = {"examples": 0}
    text = st.one_of(st.text(max_size=200),
                     st.text(st.characters(codec="utf-8"), max_size=60),
                     st.text(st.sampled_from(list(" \n\t\r abc\u00e9\u4e2d\u0301🦙\u200d<>|_")), max_size=60))

    spm = tokenizer.model == "llama"
    alone: dict[str, bool] = {}
    seen["unrepresentable_chars"] = 0

    def representable(ch: str) -> bool:
        """A byte-level vocabulary may lack some bytes (SmolLM2 has no 0xF1 token, as llama.cpp
        drops such bytes, so do we): characters that do not survive alone are left out."""
        if ch not in alone:
            alone[ch] = tokenizer.decode(tokenizer.encode(ch)) == (ch.replace("\u2581", " ") if spm else ch)
            seen["unrepresentable_chars"] += not alone[ch]
        return alone[ch]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(text)
    def one(s):
        seen["examples"] += 1
        s = "".join(ch for ch in s if representable(ch))
        # SentencePiece writes spaces as U+2581: a literal one reads back as a space (llama.cpp too)
        want = s.replace("\u2581", " ") if spm else s
        ids = tokenizer.encode(s, add_special=False, parse_special=False)
        assert tokenizer.decode(ids) == want, (s, ids, tokenizer.decode(ids))

    (one if seed is None else _seeded(one, seed))()
    return seen


# -- GGUF headers ---------------------------------------------------------------------------------
HANG_S = 30.0       # a hang detector, not a speed limit (a file opens in well under 1 s when idle)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, what) of every count, length, type and dimension field of a GGUF header."""
    out = [(8, 8, "tensor count"), (16, 8, "kv count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(what):
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        out.append((pos, 8, what + " length"))
        pos += 8 + n

    def value(vtype, what, record=True):
        nonlocal pos
        if vtype in _SCALAR:
            pos += _SCALAR[vtype]
        elif vtype == 8:
            if record:
                string(what)
            else:
                (n,) = struct.unpack_from("<Q", data, pos)
                pos += 8 + n
        elif vtype == 9:
            (etype, count) = struct.unpack_from("<IQ", data, pos)
            out.append((pos, 4, what + " array type"))
            out.append((pos + 4, 8, what + " array count"))
            pos += 12
            for i in range(count):
                value(etype, what, record=i < 2)     # the first strings of a vocabulary, not all
    for i in range(n_kv):
        string(f"key {i}")
        (vtype,) = struct.unpack_from("<I", data, pos)
        out.append((pos, 4, f"key {i} type"))
        pos += 4
        value(vtype, f"key {i}")
    for i in range(n_tensors):
        string(f"tensor {i} name")
        (nd,) = struct.unpack_from("<I", data, pos)
        out.append((pos, 4, f"tensor {i} n_dims"))
        pos += 4
        for d in range(nd):
            out.append((pos, 8, f"tensor {i} dim {d}"))
            pos += 8
        out.append((pos, 4, f"tensor {i} type"))
        out.append((pos + 4, 8, f"tensor {i} offset"))
        pos += 12
    return out


def load_checked(path: Path) -> None:
    from genie_rt.engine.config import ModelConfig
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.engine.models.weights import check_tensors
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    check_tensors(g, cfg)


def fuzz_gguf(source: Path, workdir: Path, max_examples: int, derandomize: bool, seed: int | None = None) -> dict:
    data = source.read_bytes()
    fields = gguf_fields(data)
    seen = {"examples": 0, "loaded": 0, "refused": 0, "fields": len(fields), "max_seconds": 0.0, "max_alloc_mb": 0.0}
    extremes = {1: [0, 0xFF], 2: [0, 0xFFFF], 4: [0, 1, 13, 0x7FFFFFFF, 0xFFFFFFFF],
                8: [0, 1, 2 ** 31, 2 ** 32 + 1, 2 ** 62, 2 ** 63, 2 ** 64 - 1]}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(fields), st.data())
    def one(field, draw):
        off, size, what = field
        value = draw.draw(st.one_of(st.sampled_from(extremes[size]), st.integers(0, 2 ** (8 * size) - 1)))
        mutated = bytearray(data)
        mutated[off:off + size] = value.to_bytes(size, "little")
        path = workdir / "fuzz.gguf"
        path.write_bytes(bytes(mutated))
        seen["examples"] += 1
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            load_checked(path)
            seen["loaded"] += 1
        except ValueError as exc:           # GGUFError is a ValueError
            seen["refused"] += 1
            assert str(path) in str(exc) or path.name in str(exc), f"{what}={value}: error names no file: {exc}"
        finally:
            dt = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
            tracemalloc.stop()
        seen["max_seconds"] = max(seen["max_seconds"], round(dt, 3))
        seen["max_alloc_mb"] = max(seen["max_alloc_mb"], round(peak, 1))
        assert dt < HANG_S, f"{what}={value}: {dt:.1f} s (a hang?)"
        assert peak < 64, f"{what}={value}: {peak:.0f} MiB allocated"

    (one if seed is None else _seeded(one, seed))()
    return seen


# -- KV files -------------------------------------------------------------------------------------
def fuzz_kvfile(model: Path, workdir: Path, max_examples: int, derandomize: bool, seed: int | None = None) -> dict:
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.generate import Done, GenerationRequest
    from genie_rt.engine.sampling import SamplingParams

    kv_dir = workdir / "kv"
    engine = Engine.load(model, EngineConfig(backend="cpu", n_ctx=128, kv_cache_dir=str(kv_dir)))
    prompt = engine.chat_prompt(MSG)

    def run(conv):
        out = None
        for ev in engine.generate(GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=4,
                                                    conversation_id=conv)):
            out = ev.result if isinstance(ev, Done) else out
        return out
    cold = run("good")
    path = engine.kv_store.path_for("good")
    good = path.read_bytes()
    seen = {"examples": 0, "file_bytes": len(good)}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["truncate", "flip", "replace"]), st.data())
    def one(how, draw):
        data = bytearray(good)
        if how == "truncate":
            data = data[:draw.draw(st.integers(0, len(good) - 1))]
        elif how == "flip":
            for _ in range(draw.draw(st.integers(1, 4))):
                at = draw.draw(st.integers(0, len(good) - 1))
                data[at] ^= 1 << draw.draw(st.integers(0, 7))
            if bytes(data) == good:          # two flips of one bit: the file is the good one
                return
        else:
            at = draw.draw(st.integers(0, len(good) - 1))
            new = draw.draw(st.binary(min_size=1, max_size=16))
            data[at:at + len(new)] = new
            if bytes(data) == good:
                return
        bad = engine.kv_store.path_for("fuzzed")
        bad.write_bytes(bytes(data))
        engine.kv_tokens = []                      # memory holds nothing: the file is the only source
        seen["examples"] += 1
        r = run("fuzzed")
        assert r.n_cached == 0, f"{how}: a mutated file was trusted ({r.n_cached} positions restored)"
        assert r.tokens == cold.tokens, f"{how}: the reply changed"
        engine.kv_tokens = []
    (one if seed is None else _seeded(one, seed))()
    return seen


# -- the tool -------------------------------------------------------------------------------------
def _rounds(name: str, fn, seconds: float, per_round: int, report: dict) -> None:
    t0, rnd, totals = time.monotonic(), 0, {"rounds": 0, "examples": 0, "failures": []}
    while time.monotonic() - t0 < seconds:
        try:
            seen = fn(per_round, False, 1000 + rnd)
            totals["examples"] += seen.get("examples", 0)
            for k, v in seen.items():
                if k == "by_status":
                    bs = totals.setdefault("by_status", {})
                    for code, n in v.items():
                        bs[code] = bs.get(code, 0) + n
                elif k != "examples" and isinstance(v, (int, float)):
                    totals[k] = max(totals.get(k, 0), v) if k.startswith("max") or k in ("fields", "file_bytes") \
                        else totals.get(k, 0) + v
        except AssertionError as exc:
            totals["failures"].append(str(exc)[:1500])
        except Exception as exc:  # noqa: BLE001 - a crash of the code under test is a finding
            totals["failures"].append(f"{type(exc).__name__}: {exc}"[:1500])
        rnd += 1
        totals["rounds"] = rnd
    totals["seconds"] = round(time.monotonic() - t0, 1)
    report[name] = totals
    print(name, json.dumps({k: v for k, v in totals.items() if k != "failures"}), len(totals["failures"]), "failures",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=FIXTURE, help="served model and KV-file model (default: fixture)")
    p.add_argument("--targets", default="http,tokenizer,gguf,kvfile")
    p.add_argument("--seconds", type=float, default=300, help="total time, shared by the targets (http gets half)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    targets = a.targets.split(",")
    import tempfile
    report: dict = {"tool": "fuzz", "model": a.model.name, "targets": {}}
    share = {t: (0.5 if t == "http" else 0.5 / max(1, len(targets) - 1)) if "http" in targets and len(targets) > 1
             else 1.0 / len(targets) for t in targets}
    with tempfile.TemporaryDirectory(prefix="genie-fuzz-") as tmp:
        tmp = Path(tmp)
        if "http" in targets:
            with ServerProcess(a.model, ["--ctx", "512", "-n", "4", "--max-queue", "64"]) as srv:
                ref = lambda: httpx.post(srv.base + "/v1/chat/completions", timeout=120,  # noqa: E731
                                         json={"messages": MSG, "max_tokens": 8, "temperature": 0}).json()
                before = ref()
                _rounds("http", lambda n, d, s: fuzz_http(srv.base, n, d, s), a.seconds * share["http"], 50,
                        report["targets"])
                after = ref()
                report["targets"]["http"]["greedy_unchanged"] = before == after or \
                    before["choices"][0]["message"] == after["choices"][0]["message"]
                srv.stop()
                report["targets"]["http"]["log_problems"] = srv.log_problems()[:20]
                report["targets"]["http"]["sigterm_exit"] = srv.exit_code
        if "tokenizer" in targets:
            from genie_rt.engine.gguf_file import open_gguf
            from genie_rt.engine.tokenizer import Tokenizer
            models = [FIXTURE] + sorted((ROOT / "tests" / "models").glob("*.gguf"))
            for m in models:
                tok = Tokenizer.from_gguf_metadata(open_gguf(m).metadata)
                _rounds(f"tokenizer:{m.name}", lambda n, d, s, t=tok: fuzz_tokenizer(t, n, d, s),
                        a.seconds * share["tokenizer"] / len(models), 200, report["targets"])
        if "gguf" in targets:
            _rounds("gguf", lambda n, d, s: fuzz_gguf(FIXTURE, tmp, n, d, s), a.seconds * share["gguf"], 100,
                    report["targets"])
        if "kvfile" in targets:
            _rounds("kvfile", lambda n, d, s: fuzz_kvfile(FIXTURE, tmp / f"kv{s}", n, d, s),
                    a.seconds * share["kvfile"], 60, report["targets"])
    t = report["targets"]
    report["passed"] = all(not v["failures"] for v in t.values()) and \
        all(v.get("greedy_unchanged", True) and not v.get("log_problems") and v.get("sigterm_exit", 0) == 0
            for v in t.values())
    report = write_report(a.json, report, argv)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "failures"} | {"failures": len(v["failures"])}
                      for k, v in t.items()}, indent=1))
    for k, v in t.items():
        for f in v["failures"][:3]:
            print(f"--- {k}: {f}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
