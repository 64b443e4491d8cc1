"""End to end on the CPU back-end: load, chat prompt, generate, stop, reuse, refuse."""
import threading

import numpy as np
import pytest

from genie_rt.engine.cli import main
from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import ContextOverflowError, Delta, Done, GenerationRequest
from genie_rt.engine.gguf_file import GGUFError
from genie_rt.engine.memory import MemoryBudgetError
from genie_rt.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=512, kv_dtype="f16"))


def run(engine, req):
    deltas, done = [], None
    for ev in engine.generate(req):
        if isinstance(ev, Delta):
            deltas.append(ev)
        else:
            done = ev.result
    return deltas, done


def test_greedy_is_deterministic_and_streams_the_whole_text(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Turn the kitchen lights down"}])
    d1, r1 = run(engine, GenerationRequest(prompt, GREEDY, max_tokens=20, ignore_eos=True))
    d2, r2 = run(engine, GenerationRequest(prompt, GREEDY, max_tokens=20, ignore_eos=True))
    assert r1.tokens == r2.tokens and len(r1.tokens) == 20 and r1.finish_reason == "length"
    assert "".join(d.text for d in d1) == r1.text == engine.tokenizer.decode(r1.tokens, skip_special=True)
    assert sum(len(d.tokens) for d in d1) == 20
    assert r2.n_cached == len(prompt) - 1  # the second request reused the whole prompt but one token


def test_greedy_matches_reference_logits(engine, fixture_gguf):
    """The loop's first token is argmax of the reference forward's last-position logits."""
    prompt = engine.raw_prompt("The capital of France is")
    _, r = run(engine, GenerationRequest(prompt, GREEDY, max_tokens=1, ignore_eos=True))
    engine.kv_tokens = []
    logits = engine.backend.prefill(prompt, 0)
    assert r.tokens[0] == int(np.argmax(logits))


def test_seeded_sampling_reproducible(engine):
    prompt = engine.raw_prompt("Once upon a time")
    p = SamplingParams(temperature=1.0, seed=1234)
    _, a = run(engine, GenerationRequest(prompt, p, max_tokens=16, ignore_eos=True))
    _, b = run(engine, GenerationRequest(prompt, SamplingParams(temperature=1.0, seed=1234), max_tokens=16,
                                         ignore_eos=True))
    _, c = run(engine, GenerationRequest(prompt, SamplingParams(temperature=1.0, seed=99), max_tokens=16,
                                         ignore_eos=True))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stop_string_cuts_text(engine):
    prompt = engine.raw_prompt("Hello")
    _, full = run(engine, GenerationRequest(prompt, GREEDY, max_tokens=30, ignore_eos=True))
    stop = full.text[5:9]
    assert stop
    deltas, r = run(engine, GenerationRequest(prompt, GREEDY, max_tokens=30, stop=[stop], ignore_eos=True))
    assert r.finish_reason == "stop" and r.stop_word == stop
    assert r.text == full.text[:full.text.index(stop)]
    assert "".join(d.text for d in deltas) == r.text


def test_eos_stops(engine):
    prompt = engine.raw_prompt("Hi")
    eos = engine.tokenizer.eos_id
    p = SamplingParams(temperature=0, logit_bias={eos: 1000.0})
    _, r = run(engine, GenerationRequest(prompt, p, max_tokens=10))
    assert r.finish_reason == "stop" and r.tokens == []


def test_context_overflow_and_bad_tokens(engine):
    with pytest.raises(ContextOverflowError) as info:
        list(engine.generate(GenerationRequest([1] * 600, GREEDY)))
    assert info.value.n_prompt_tokens == 600 and info.value.n_ctx == 512
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(engine.generate(GenerationRequest([1, 99999], GREEDY)))
    with pytest.raises(ValueError, match="empty"):
        list(engine.generate(GenerationRequest([], GREEDY)))
    with pytest.raises(ValueError, match="top_p"):
        list(engine.generate(GenerationRequest([1, 2], SamplingParams(top_p=2.0))))


def test_generation_stops_at_context_end(engine):
    prompt = engine.raw_prompt("x " * 200)[:500]
    _, r = run(engine, GenerationRequest(prompt, GREEDY, ignore_eos=True))
    assert r.finish_reason == "length" and len(prompt) + r.n_generated == 512


def test_cancel_stops_promptly(engine):
    cancel = threading.Event()
    prompt = engine.raw_prompt("Tell me a story")
    n = 0
    for ev in engine.generate(GenerationRequest(prompt, GREEDY, max_tokens=200, ignore_eos=True, cancel=cancel)):
        if isinstance(ev, Delta):
            n += 1
            if n == 3:
                cancel.set()
        else:
            r = ev.result
    assert r.finish_reason == "cancelled" and r.n_generated < 10


def test_prefix_reuse_shares_system_prompt(engine):
    system = {"role": "system", "content": "You control a smart home. Devices: " + "lamp, " * 40}
    a = engine.chat_prompt([system, {"role": "user", "content": "Turn on the lamp"}])
    b = engine.chat_prompt([system, {"role": "user", "content": "What is the time?"}])
    run(engine, GenerationRequest(a, GREEDY, max_tokens=4, ignore_eos=True))
    _, rb = run(engine, GenerationRequest(b, GREEDY, max_tokens=4, ignore_eos=True))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert rb.n_cached == shared
    # and the result equals a cold run
    engine.kv_tokens = []
    _, cold = run(engine, GenerationRequest(b, GREEDY, max_tokens=4, ignore_eos=True))
    assert cold.n_cached == 0 and cold.tokens == rb.tokens


def test_budget_refuses_before_loading(fixture_gguf):
    cfg = EngineConfig(backend="cpu", n_ctx=4096, reserve_bytes=1 << 50)
    with pytest.raises(MemoryBudgetError, match="reserve"):
        Engine.load(fixture_gguf, cfg)


def test_cli_run(fixture_gguf, capsys):
    assert main(["run", "-m", str(fixture_gguf), "-p", "Turn the kitchen lights down", "-n", "8", "--temp", "0",
                 "--backend", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "tok/s" in err and "[cpu]" in err
    # the one-screen summary when ready (engine/load_report.py)
    for needle in ("ready in", "qwen3-micro-q4km.gguf", "qwen3, 2 layers", "back-end  cpu", "context ",
                   "KV cache  f16", "memory    needs", "available"):
        assert needle in err, (needle, err)


def test_cli_clean_error_for_bad_model(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model")
    assert main(["run", "-m", str(bad), "-p", "hi", "--backend", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "genie-rt: error:" in err and "too small to be a GGUF file" in err


@pytest.mark.parametrize("argv, needle", [
    (["--ctx", "0"], "--ctx must be >= 1"),
    (["--ctx", "-5"], "--ctx must be >= 1"),
    (["-n", "-2"], "--max-tokens must be >= 0, or -1"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "7"], "--top-p must be <= 1"),
    (["--conversation", "../kitchen"], "conversation id '../kitchen' is invalid"),
    (["--reserve-mb", "-5"], "--reserve-mb must be >= 0"),
    (["--kv-cache-budget-mb", "-1"], "--kv-cache-budget-mb must be >= 1"),
    (["--conversation", "k", "--kv-cache-dir", __file__], "is not a folder"),
])
def test_cli_refuses_bad_arguments_in_one_line(argv, needle, fixture_gguf, capsys):
    assert main(["run", "-m", str(fixture_gguf), "-p", "hi", "-n", "2", "--backend", "cpu", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("genie-rt: error:") and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--port", "99999"], "--port must be 0..65535"),
    (["--port", "-1"], "--port must be 0..65535"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be"),
    (["--kv-cache-dir", __file__], "is not a folder"),
])
def test_cli_serve_refuses_bad_arguments_before_loading(argv, needle, tmp_path, capsys):
    # the model path does not exist: the flags must be refused before anything is loaded
    assert main(["serve", "-m", str(tmp_path / "absent.gguf"), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("genie-rt: error:") and needle in err and "Traceback" not in err, err


def test_cli_no_token_limit_runs_to_the_context(fixture_gguf, capsys):
    assert main(["run", "-m", str(fixture_gguf), "-p", "hi", "-n", "-1", "--ctx", "64", "--temp", "0",
                 "--backend", "cpu", "--raw"]) == 0
    err = capsys.readouterr().err
    assert "finish:" in err and "generated 0 tokens" not in err


def test_cuda_requested_without_a_gpu_is_a_clean_error(fixture_gguf, monkeypatch):
    import genie_rt.engine.engine as E
    monkeypatch.setattr(E, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="no usable CUDA GPU"):
        Engine.load(fixture_gguf, EngineConfig(backend="cuda"))


def test_tokenizer_metadata_errors_name_the_file(fixture_gguf, tmp_path):
    import struct
    raw = bytearray(fixture_gguf.read_bytes())
    key = b"tokenizer.ggml.eos_token_id"
    at = raw.index(key) + len(key)            # then the value type (uint32) and the value
    raw[at + 4:at + 8] = struct.pack("<I", 99999)
    bad = tmp_path / "eos.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(GGUFError) as info:
        Engine.load(bad, EngineConfig(backend="cpu"))
    assert str(bad) in str(info.value) and "99999" in str(info.value)


@pytest.mark.parametrize("field, value, needle", [
    ("n_ctx", 0, "n_ctx must be an integer >= 1"),
    ("n_ctx", -5, "n_ctx must be an integer >= 1"),
    ("prefill_chunk", 0, "prefill_chunk must be an integer >= 1"),
    ("kv_dtype", "q4", "kv_dtype must be"),
    ("backend", "tpu", "backend must be"),
    ("reserve_bytes", -1, "reserve_bytes must be"),
    ("kv_cache_budget", 1.5, "kv_cache_budget must be"),
    ("gemv_mode", "fast", "gemv_mode must be"),
])
def test_engine_config_refuses_what_the_cli_refuses(field, value, needle):
    from genie_rt.engine.config import EngineConfig
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**{field: value})


def test_sampling_refuses_a_bias_too_large_for_a_float():
    from genie_rt.engine.sampling import SamplingParams
    with pytest.raises(ValueError, match="'logit_bias' value for token 5 is out of range"):
        SamplingParams(logit_bias={5: 10 ** 400}).validate(100)
    SamplingParams(logit_bias={5: float("-inf"), 6: -100}).validate(100)


@pytest.mark.parametrize("k", ["-1", "100000"])
def test_cli_top_k_out_of_range_is_off_as_in_the_server(k, fixture_gguf, capsys):
    assert main(["run", "-m", str(fixture_gguf), "-p", "hi", "-n", "2", "--backend", "cpu", "--top-k", k, "--seed", "1"]) == 0
