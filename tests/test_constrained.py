"""Constrained decoding below the server: engine/constrain.py, the host sampler's mask and
probability records, gpu_mask.apply_mask (simulator here, PTX for sm_87 / sm_90, the device with
-m gpu) and the CUDA back-end's constrained steps (gpu).

GPU command (the lead): pytest -q -m gpu tests/test_constrained.py
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from genie_rt.engine import constrain
from genie_rt.engine import gpu_mask as gm
from genie_rt.engine import gpu_sampling as gs
from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import Done, GenerationRequest
from genie_rt.engine.sampling import Sampler, SamplingParams
from ptx_helpers import assert_no_f64, compile_in_subprocess

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["on", "level"],
          "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.fixture(scope="module")
def cpu_engine(fixture_gguf):
    return Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=256))


def run(engine, spec, temperature=0.0, seed=0, max_tokens=40, **kw):
    prompt = engine.chat_prompt([{"role": "user", "content": "Lamp state?"}])
    req = GenerationRequest(prompt, SamplingParams(temperature=temperature, seed=seed), max_tokens=max_tokens,
                            constraint=spec, **kw)
    return [e for e in engine.generate(req) if isinstance(e, Done)][0].result


def test_errors_name_the_problem():
    with pytest.raises(constrain.ConstraintError, match="objekt"):
        constrain.json_schema_constraint({"type": "objekt"})
    with pytest.raises(constrain.ConstraintError, match="nope"):
        constrain.gbnf_constraint("root ::= nope")
    with pytest.raises(constrain.ConstraintError, match="JSON schema object"):
        constrain.json_schema_constraint(["not", "a", "schema"])
    with pytest.raises(constrain.ConstraintError, match="non-empty"):
        constrain.gbnf_constraint("   ")


def test_vocab_marks_control_tokens_special(cpu_engine):
    tok = cpu_engine.tokenizer
    pieces = constrain.vocab_tokens(tok)
    im_end = tok.token_id("<|im_end|>")
    assert pieces[im_end] == b"\xff<|im_end|>"
    assert pieces[tok.encode("a")[0]] == b"a"


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (1.0, 1), (1.5, 2)])
def test_schema_output_validates_on_cpu(cpu_engine, temperature, seed):
    r = run(cpu_engine, constrain.json_schema_constraint(SCHEMA), temperature, seed)
    assert r.finish_reason == "stop"
    obj = json.loads(r.text)
    assert set(obj) == {"on", "level"} and isinstance(obj["on"], bool) and 0 <= obj["level"] <= 9


def test_mask_is_what_the_sampler_obeys(cpu_engine):
    """Every token of a constrained reply was allowed by the mask of its step: replaying the
    tokens through a fresh matcher accepts all of them, and the reply is in the grammar."""
    spec = constrain.gbnf_constraint('root ::= "on" | "off" | "dim " [1-9]')
    for seed in range(4):
        r = run(cpu_engine, spec, 1.0, seed)
        assert r.text in {"on", "off"} | {f"dim {d}" for d in "123456789"}
        c = constrain.Constraint.start(cpu_engine.tokenizer, spec)
        for t in r.tokens:
            allowed = c.allowed()
            assert allowed[t]
            c.accept(t)
        assert c.allowed()[sorted(cpu_engine.tokenizer.eot_ids)].all()    # every EOG token may end it


def test_lazy_trigger_constrains_only_after_it(cpu_engine):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    spec = constrain.tool_call_constraint(tools, "auto", cpu_engine.tokenizer.token_id)
    c = constrain.Constraint.start(cpu_engine.tokenizer, spec)
    assert c.fill() is None                                  # free text first
    for t in cpu_engine.tokenizer.encode("Sure. <tool_call>\n{\"name\": \"f\", "):
        c.accept(t)
    assert c.constraining
    allowed = c.allowed()
    ok = cpu_engine.tokenizer.encode('"arguments"')[0]
    bad = cpu_engine.tokenizer.encode("hello")[0]
    assert allowed[ok] and not allowed[bad]


def test_probability_records(cpu_engine):
    r = run(cpu_engine, None, max_tokens=5, n_probs=4)
    assert len(r.probs) == 5
    for p, t in zip(r.probs, r.tokens):
        assert p.token == t and p.top[0][0] == t and len(p.top) == 4     # greedy: the likeliest
        assert all(a[1] >= b[1] for a, b in zip(p.top, p.top[1:]))
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=1), n_probs=10, post_sampling=True)
    s.sample(np.array([3.0, 2.0, 1.0, 0.0, -1.0], np.float32))
    rec = s.records[0]
    assert rec.post_sampling and len(rec.top) == 3
    assert math.isclose(sum(math.exp(v) for _, v in rec.top), 1.0, rel_tol=1e-9)


def test_banned_tokens_have_zero_probability(cpu_engine):
    r = run(cpu_engine, constrain.gbnf_constraint('root ::= "yes"'), max_tokens=4, logprobs=True, n_probs=3)
    assert r.text == "yes"
    for p in r.probs:
        assert p.logprob == pytest.approx(0.0, abs=1e-9) and len(p.top) == 1


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_apply_mask_kernel_matches_numpy(vocab):
    from numba import cuda
    rng = np.random.default_rng(vocab)
    words = rng.integers(-(1 << 31), 1 << 31, (vocab + 31) // 32, dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal(vocab).astype(np.float32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    want = np.where(bits, logits, -np.inf).astype(np.float32)
    ws = gs.make_workspace(vocab, chunk=max(1, vocab // 2 + 1))
    gm.mask_words(ws)[:] = words
    gm.upload_mask(ws)
    d = cuda.to_device(logits)
    gm.apply_mask(ws, d)
    np.testing.assert_array_equal(d.copy_to_host(), want)


@pytest.mark.slow                       # compiles in a child process (about 10 s)
def test_mask_kernel_compiles_for_orin_and_hopper_without_f64():
    ptx = compile_in_subprocess("genie_rt.engine.gpu_mask", gm.KERNEL_SIGNATURES)
    assert set(ptx["_mask_kernel"]) == {(8, 7), (9, 0)}
    for cc, text in ptx["_mask_kernel"].items():
        assert_no_f64(text, where=f"_mask_kernel sm_{cc[0]}{cc[1]}")


# --- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_constrained_matches_host_path(fixture_gguf):
    """On the device: schema-valid output; the GPU-masked greedy tokens equal the tokens the host
    sampler draws from the same back-end's logits (the logprobs path); tool calls validate."""
    eng = Engine.load(fixture_gguf, EngineConfig(backend="cuda", n_ctx=512))
    spec = constrain.json_schema_constraint(SCHEMA)
    for temperature, seed in [(0.0, 0), (1.0, 3), (1.0, 4)]:
        r = run(eng, spec, temperature, seed)
        obj = json.loads(r.text)
        assert set(obj) == {"on", "level"} and 0 <= obj["level"] <= 9
    fast = run(eng, spec, 0.0)
    host = run(eng, spec, 0.0, logprobs=True)
    assert fast.tokens == host.tokens and host.probs is not None
    grammar = constrain.gbnf_constraint('root ::= "dim " [1-9] " of " [1-9]')
    for seed in range(3):
        assert run(eng, grammar, 1.0, seed).text.startswith("dim ")
    free = run(eng, None, 0.0, max_tokens=16)          # the next unconstrained request is unaffected
    cpu = Engine.load(fixture_gguf, EngineConfig(backend="cuda", n_ctx=512))
    assert run(cpu, None, 0.0, max_tokens=16).tokens == free.tokens



def choices(engine, spec, n, seed, **kw):
    """The results of a request's n choices, from a cold in-memory prefix."""
    engine.kv_tokens = []
    prompt = engine.chat_prompt([{"role": "user", "content": "Lamp state?"}])
    req = GenerationRequest(prompt, SamplingParams(temperature=1.0, seed=seed), max_tokens=40, constraint=spec,
                            n=n, **kw)
    return [e.result for e in engine.generate(req) if isinstance(e, Done)]


@pytest.mark.gpu
@pytest.mark.parametrize("logprobs", [False, True])
def test_cuda_constrained_choices(fixture_gguf, logprobs):
    """n choices under a grammar on the device (its masked draw from the prompt's logits, or the
    host's with logprobs): every choice validates, choice i is the one-choice reply with seed + i."""
    eng = Engine.load(fixture_gguf, EngineConfig(backend="cuda", n_ctx=512))
    spec = constrain.json_schema_constraint(SCHEMA)
    many = choices(eng, spec, 3, 21, logprobs=logprobs)
    for r in many:
        obj = json.loads(r.text)
        assert set(obj) == {"on", "level"} and 0 <= obj["level"] <= 9
        assert (r.probs is not None) == logprobs
    assert [r.tokens for r in many] == [choices(eng, spec, 1, 21 + i, logprobs=logprobs)[0].tokens
                                        for i in range(3)]


def test_required_call_without_a_template_tag(cpu_engine):
    """tool_choice "required" where the template does not open the block: the reply must."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    spec = constrain.tool_call_constraint(tools, "open", cpu_engine.tokenizer.token_id)
    r = run(cpu_engine, spec, 1.0, 3, max_tokens=60)
    assert r.text.lstrip().startswith("<tool_call>")
    body = r.text.lstrip()[len("<tool_call>"):].split("</tool_call>")[0]
    assert json.loads(body)["name"] == "f" and isinstance(json.loads(body)["arguments"]["x"], int)
    with pytest.raises(constrain.ConstraintError, match="not one of the tools"):
        constrain.tool_call_constraint(tools, "g")


def test_tool_arguments_name_only_their_keys(cpu_engine):
    """An object that lists its properties and says nothing of others is closed to others, as
    llama.cpp's schema converter reads it (constrain.closed): after the last named key the call's
    arguments can only close, where an open object let a small model add keys forever."""
    assert constrain.closed({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                                              "c": {"type": "array", "items": {
                                                                  "type": "object", "properties": {"d": {}}}}}}) == {
        "type": "object", "additionalProperties": False, "properties": {
            "a": {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
            "c": {"type": "array", "items": {"type": "object", "properties": {"d": {}}, "additionalProperties": False}}}}
    for kept in ({"type": "object"}, {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
                 {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
                 {"not": {"type": "object", "properties": {"a": {}}}}):
        assert constrain.closed(kept) == kept
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    tok = cpu_engine.tokenizer
    for open_tools in (tools, [{**tools[0], "function": {**tools[0]["function"], "parameters": {
            **tools[0]["function"]["parameters"], "additionalProperties": True}}}]):
        c = constrain.Constraint.start(tok, constrain.tool_call_constraint(open_tools, "open", tok.token_id))
        for t in tok.encode('<tool_call>\n{"name": "f", "arguments": {"x": 12'):
            c.accept(t)
        allowed = c.allowed()
        comma = [i for i in range(len(allowed)) if tok.decode([i]).startswith(",")]
        assert allowed[tok.encode("}")[0]]
        assert allowed[comma].any() == (open_tools is not tools), "another key only where the schema allows it"


@pytest.mark.parametrize("mode", ["open", "auto"])
def test_one_call_without_parallel_tool_calls(cpu_engine, mode):
    """parallel=False (parallel_tool_calls false, or a template that cannot write several): after
    the first block closes the grammar can only end, so the reply is exactly one call and ends
    there (EOS), however often the model would go on calling (random weights at temperature 1)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
        "additionalProperties": False}}}]
    for seed in range(3):
        spec = constrain.tool_call_constraint(tools, mode, cpu_engine.tokenizer.token_id, parallel=False)
        c = constrain.Constraint.start(cpu_engine.tokenizer, spec)
        for t in cpu_engine.tokenizer.encode('<tool_call>\n{"name": "f", "arguments": {"x": ' + str(seed) + '}}\n'):
            c.accept(t)
        for t in cpu_engine.tokenizer.encode("</tool_call>"):
            c.accept(t)
        allowed = c.allowed()
        eog = sorted(cpu_engine.tokenizer.eot_ids)
        assert allowed[eog].all() and allowed.sum() == len(eog), "only the end may follow the one call"
        if mode == "open":
            r = run(cpu_engine, spec, 1.0, seed, max_tokens=80)
            assert r.text.count("<tool_call>") == 1 and r.finish_reason == "stop", r.text
    many = constrain.tool_call_constraint(tools, "open", cpu_engine.tokenizer.token_id)    # parallel
    c = constrain.Constraint.start(cpu_engine.tokenizer, many)
    for t in cpu_engine.tokenizer.encode('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'):
        c.accept(t)
    assert c.allowed().sum() > len(cpu_engine.tokenizer.eot_ids)          # another call may follow
