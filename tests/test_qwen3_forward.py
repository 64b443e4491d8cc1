"""The numpy Qwen3 forward against llama.cpp's logits for the fixture (three prompts)."""
import numpy as np
import pytest

from genie_rt.engine.config import ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.backend_cpu import forward, reference_weights
from genie_rt.engine.models.reference import attention, rope_neox, rope_tables
from genie_rt.kvcache.pool import HostKVPool, KVShape


@pytest.fixture(scope="module")
def model(fixture_gguf):
    g = open_gguf(fixture_gguf)
    cfg = ModelConfig.from_gguf(g)
    return g, cfg


def cosine_rows(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def check_against_llamacpp(logits, ref, min_cos):
    cos = cosine_rows(logits.astype(np.float64), ref.astype(np.float64))
    top2 = np.sort(ref, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 0.01
    agree = logits.argmax(1) == ref.argmax(1)
    worst = int(np.argmin(cos))
    assert cos.min() >= min_cos, f"position {worst}: cosine {cos[worst]:.6f} < {min_cos}"
    bad = np.nonzero(decisive & ~agree)[0]
    assert bad.size == 0, f"top-1 differs from llama.cpp at positions {bad.tolist()}"
    return cos


@pytest.mark.parametrize("dtype,kv", [(np.float64, "f32"), (np.float32, "f32"), (np.float32, "f16"),
                                      (np.float32, "int8")])
def test_logits_match_llamacpp(model, llamacpp_logits, dtype, kv):
    g, cfg = model
    w = reference_weights(g, cfg, dtype)
    min_cos = 0.9995 if kv != "int8" else 0.999
    for i in range(3):
        tokens = llamacpp_logits[f"tokens_{i}"]
        pool = HostKVPool(KVShape(cfg.n_layers, 64, cfg.n_head_kv, cfg.head_dim, kv))
        logits = forward(w, cfg, tokens, 0, pool, all_logits=True, dtype=w.tok_embd.dtype)
        check_against_llamacpp(logits, llamacpp_logits[f"logits_{i}"], min_cos)


def test_incremental_decode_equals_batch(model, llamacpp_logits):
    """Prefill in pieces and one token at a time give the same logits as one batch."""
    g, cfg = model
    w = reference_weights(g, cfg, np.float64)
    tokens = llamacpp_logits["tokens_2"]
    full = forward(w, cfg, tokens, 0, HostKVPool(KVShape(2, 64, 2, 64, "f32")), all_logits=True,
                   dtype=w.tok_embd.dtype)
    pool = HostKVPool(KVShape(2, 64, 2, 64, "f32"))
    first = forward(w, cfg, tokens[:7], 0, pool, all_logits=True, dtype=w.tok_embd.dtype)
    rest = [forward(w, cfg, tokens[t:t + 1], t, pool, dtype=w.tok_embd.dtype) for t in range(7, len(tokens))]
    np.testing.assert_allclose(np.vstack([first, np.stack(rest)]), full, rtol=1e-9, atol=1e-9)


def test_rope_is_a_rotation_and_relative():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8))
    cos, sin = rope_tables(8, np.arange(5), 10000.0, np.float64)
    y = rope_neox(x, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(y[0], x[0])  # position 0: identity
    # q.k after RoPE depends only on the position difference
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    def dot(pq, pk):
        c, s = rope_tables(8, np.array([pq, pk]), 10000.0, np.float64)
        r = rope_neox(np.stack([q, k])[:, None], c, s)[:, 0]
        return r[0] @ r[1]
    assert abs(dot(3, 1) - dot(12, 10)) < 1e-9


def test_attention_is_causal_and_grouped():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 4, 8))
    k = rng.standard_normal((4, 2, 8))
    v = rng.standard_normal((4, 2, 8))
    out = attention(q, k, v, 0).reshape(4, 4, 8)
    # the first position attends only to itself: output = its own V (of its KV head)
    np.testing.assert_allclose(out[0, 0], v[0, 0])
    np.testing.assert_allclose(out[0, 3], v[0, 1])
    # brute force for the last position, head 3 (KV head 1)
    s = k[:, 1] @ q[3, 3] / np.sqrt(8)
    p = np.exp(s - s.max()); p /= p.sum()
    np.testing.assert_allclose(out[3, 3], p @ v[:, 1])
