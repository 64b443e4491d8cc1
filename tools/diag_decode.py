"""Step through one CUDA decode step and compare every intermediate with numpy.

    python tools/diag_decode.py        (a developer tool: prints where GPU and CPU part)
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_gguf import write_synthetic_qwen3  # noqa: E402

from genie_rt.engine import norm
from genie_rt.engine.backend_cuda import CUDABackend
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import MemoryPlan
from genie_rt.engine.qwen3 import Qwen3Weights, rmsnorm, rope_neox, rope_tables, silu
from genie_rt.kvcache.attention import decode_attention
from genie_rt.kvcache.rope_write import rope_write
from genie_rt.quant import embed, gemv


def rel(got, ref):
    got, ref = np.asarray(got, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))


def main():
    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    path = Path("/tmp/diag1.gguf")
    write_synthetic_qwen3(path, dict(layers=1, hidden=hidden, heads=hidden // 64, kv_heads=hidden // 128, head_dim=128,
                                     ffn=3 * hidden, vocab=4122, text_tokens=4096), seed=0)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    be = CUDABackend(g, cfg, EngineConfig(backend="cuda", n_ctx=64, kv_dtype="f16", prefill_chunk=64),
                     MemoryPlan(64, 0, 0, 0, 0, 0, 1 << 50, "diag"), use_graphs=False, warm=False)
    W = Qwen3Weights.load(g, cfg)
    L, Lw, A, s = W.layers[0], be.layers[0], be.arena, be.stream
    tok = 123
    be._set_state(pos=0, token=tok)
    x = A["x"][:1]
    embed.embed(be.embd, be.state[1:2], x, stream=s, planes=be.embd_planes)
    xr = W.tok_embd[tok][None]
    print("embed", rel(x.copy_to_host(), xr))
    h = A["h"]
    norm.rmsnorm(x, Lw["attn_norm"], h, cfg.rms_eps, stream=s)
    hr = rmsnorm(xr, L.attn_norm, cfg.rms_eps)
    print("rmsnorm", rel(h.copy_to_host(), hr))
    xq, xs = be._q8(h, "E", Lw["g_q"], Lw["g_k"], Lw["g_v"])
    qkv = A["qkv"][:1]
    gemv.gemv_qkv(Lw["g_q"], Lw["g_k"], Lw["g_v"], h, qkv, xq=xq, xs=xs, stream=s)
    qr, kr, vr = hr @ L.wq.T, hr @ L.wk.T, hr @ L.wv.T
    got = qkv.copy_to_host()[0]
    Q, KV = cfg.q_dim, cfg.kv_dim
    print("q", rel(got[:Q], qr), "k", rel(got[Q:Q + KV], kr), "v", rel(got[Q + KV:], vr))
    q = A["q"][:1]
    rope_write(qkv, Lw["q_norm"], Lw["k_norm"], cfg.rms_eps, A["rope.cos"], A["rope.sin"], be.state, q, Lw["kv"], stream=s)
    cos, sin = rope_tables(cfg.head_dim, np.arange(1), cfg.rope_base)
    qn = rope_neox(rmsnorm(qr.reshape(1, cfg.n_head, -1), L.q_norm, cfg.rms_eps), cos, sin)
    kn = rope_neox(rmsnorm(kr.reshape(1, cfg.n_head_kv, -1), L.k_norm, cfg.rms_eps), cos, sin)
    print("q roped", rel(q.copy_to_host(), qn), "k cache", rel(be.kv.k[0][0].copy_to_host(), kn[0]),
          "v cache", rel(be.kv.v[0][0].copy_to_host(), vr.reshape(cfg.n_head_kv, -1)))
    attn = A["attn"][:1]
    decode_attention(q, Lw["kv"], be.state, attn, be.dws, stream=s)
    ar = np.repeat(vr.reshape(cfg.n_head_kv, -1), cfg.n_group, axis=0).reshape(1, -1)
    print("attn (pos 0 = own V)", rel(attn.copy_to_host(), ar))
    xq, xs = be._q8(attn, "Q", Lw["g_o"])
    gemv.gemv(Lw["g_o"], attn, x, xq=xq, xs=xs, residual=x, stream=s)
    xr2 = xr + ar @ L.wo.T
    print("x after o", rel(x.copy_to_host(), xr2))
    norm.rmsnorm(x, Lw["ffn_norm"], h, cfg.rms_eps, stream=s)
    hr2 = rmsnorm(xr2, L.ffn_norm, cfg.rms_eps)
    xq, xs = be._q8(h, "E", Lw["g_gate"], Lw["g_up"])
    ff = A["ff"][:1]
    gemv.gemv_swiglu(Lw["g_gate"], Lw["g_up"], h, ff, xq=xq, xs=xs, stream=s)
    fr = silu(hr2 @ L.w_gate.T) * (hr2 @ L.w_up.T)
    print("swiglu", rel(ff.copy_to_host(), fr))
    xq, xs = be._q8(ff, "F", Lw["g_down"])
    gemv.gemv(Lw["g_down"], ff, x, xq=xq, xs=xs, residual=x, stream=s)
    xr3 = xr2 + fr @ L.w_down.T
    print("x after down", rel(x.copy_to_host(), xr3))
    be._record_head(x, None)
    lr = rmsnorm(xr3, W.output_norm, cfg.rms_eps) @ W.output.T
    print("logits", rel(A["logits"].copy_to_host(), lr))


if __name__ == "__main__":
    main()
