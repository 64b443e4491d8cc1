"""A prediction (not a measurement) of decode and prefill speed, and of the context that fits,
on a Jetson Orin Nano 8 GB, from the model shapes and our kernels' efficiencies measured on
the H200. docs/jetson.md prints its table; every input is named here.

    python tools/orin_predict.py [--super|--classic] [--available-gib 6.0] [--markdown]

The model (per token of decode; per prompt of N tokens for prefill):

    decode_s  = B / (BW * e_gemv) + L * t_small
    prefill_s = sum over layers of max(W_l / (BW * e_gemv), 2 N P_l / (TC * e_mma)) + L * t_small
                + B_out / (BW * e_gemv)                  (the output projection of one row)

    B        bytes one decode step streams (every layer matrix once, the output projection)
    BW       the board's DRAM bandwidth (datasheet: 102 GB/s Super, 68 GB/s classic)
    e_gemv   fraction of it the GEMVs reach: 0.34 (low: the whole decode step's GEMVs on the
             H200, 37 % of the 4.37 TB/s measured there, which is 91 % of its datasheet) to 0.64
             (high: the output projection's 70 % there) - docs/kernels/gemv.md, 2026-12-01
    t_small  the rest of a step per layer (norms, RoPE, attention at short depth, q8), read
             from the H200's decode profile (PROFILE: tools/profile_decode.py's JSON, depth 512):
             the whole step minus what removing the GEMV families saves, over 36 layers - 23.1 us
             on 2026-12-03 night (2.154 ms - 1.322 ms; 35.8 us on 2026-11-29), latency-bound, so
             scaled by the clock ratio 1.98 / 1.02 GHz (Super)
    TC       fp16 tensor-core peak: 32 tensor cores x 256 FMA/clock x 2 x 1.02 GHz = 16.7 TFLOP/s
             (Super; 0.625 GHz classic: 10.2)
    e_mma    0.07-0.32 of that peak: low, what a layer's seven GEMMs reach at N = 33 on the H200
             (6.7 GFLOP in 139-148 us = 45 of the 637 TFLOP/s mma.sync peak there, held back by
             per-GEMM fixed costs over 132 SMs); high, what they reach at N = 512 (157-205 TFLOP/s;
             docs/kernels/mmq.md), the regime 8 SMs with 16x the work each are nearer to

Shapes are the published configs; bytes are at Q4_K_M's mix: layer matrices at 4.85 bits per
weight on average (Qwen3-4B's measured 2.491 GB per token gives 4.8), the tied output in Q6_K
(6.5625 bits). Gemma 3 270M's bytes are its real file's. The context that fits uses the
integrated budget of engine/cuda_layout.py (overhead 512 MiB, reserve 1536 MiB) and the INT8
KV (1 byte per value + one float32 scale per head and position; docs/memory-budget.md) against an assumed MemAvailable, capped at the
training context (Gemma's sliding-window layers keep rings, so its KV is smaller still).
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
LAYER_BPW = 4.85
OUT_BPW = 6.5625

# name: layers, hidden, q width, kv width, ffn, vocab, tied output, or a measured byte count
MODELS = {
    "Qwen3-0.6B": dict(L=28, d=1024, q=2048, kv=1024, ff=3072, vocab=151936, ctx=40960, hd=128),
    "Qwen3-1.7B": dict(L=28, d=2048, q=2048, kv=1024, ff=6144, vocab=151936, ctx=40960, hd=128),
    "Qwen3-4B": dict(L=36, d=2560, q=4096, kv=1024, ff=9728, vocab=151936, ctx=40960, hd=128),
    "Gemma 3 270M": dict(L=18, d=640, q=1024, kv=256, ff=2048, vocab=262144, ctx=32768, hd=256,
                         measured_layers=68.1e6, measured_out=170.0 * MiB),   # the Q4_K_M file's tensors
    "Gemma 3 1B": dict(L=26, d=1152, q=1024, kv=256, ff=6912, vocab=262144, ctx=32768, hd=256),
}
BOARDS = {"super": dict(bw=102e9, clock=1.02e9, name="Orin Nano 8 GB Super (MAXN_SUPER)"),
          "classic": dict(bw=68e9, clock=0.625e9, name="Orin Nano 8 GB (15 W)")}
H200_CLOCK = 1.98e9
PROFILE = Path(__file__).resolve().parent.parent / "docs/bench/profile-decode-h200-2026-12-03c.json"
GEMV_FAMILIES = ("gemv.gemv_qkv", "gemv.gemv", "gemv.gemv_swiglu")


@functools.lru_cache(maxsize=None)
def t_small_h200(path: Path = PROFILE, layers: int = 36) -> float:
    """Seconds a layer of the H200's decode step spends outside the GEMVs (see t_small above)."""
    rows = {r["family"]: r["ms"] for r in json.loads(path.read_text())}
    return (rows["whole step"] - sum(rows[f] for f in GEMV_FAMILIES)) / layers / 1e3


E_GEMV = (0.34, 0.64)
E_MMA = (0.07, 0.32)
OVERHEAD, RESERVE = 512 * MiB, 1536 * MiB


def shapes(m: dict) -> tuple[float, float, float]:
    """(parameters per layer, layer bytes per token, output bytes per token)."""
    per_layer = m["d"] * (m["q"] + 2 * m["kv"]) + m["q"] * m["d"] + 3 * m["d"] * m["ff"]
    layer_bytes = m.get("measured_layers", m["L"] * per_layer * LAYER_BPW / 8)
    out_bytes = m.get("measured_out", m["vocab"] * m["d"] * OUT_BPW / 8)
    return per_layer, layer_bytes, out_bytes


def predict(m: dict, board: dict, n_prompt: int, available: float) -> dict:
    per_layer, layer_bytes, out_bytes = shapes(m)
    B = layer_bytes + out_bytes
    t_small = t_small_h200() * H200_CLOCK / board["clock"]
    tc = 32 * 256 * 2 * board["clock"]
    out = {"bytes": B, "roofline": board["bw"] / B}
    for tag, e_g, e_m in (("low", E_GEMV[0], E_MMA[0]), ("high", E_GEMV[1], E_MMA[1])):
        bw = board["bw"] * e_g
        decode = B / bw + m["L"] * t_small
        per_layer_read = layer_bytes / m["L"] / bw
        per_layer_math = 2 * n_prompt * per_layer / (tc * e_m)
        prefill = m["L"] * (max(per_layer_read, per_layer_math) + t_small) + out_bytes / bw
        out[f"decode_{tag}"] = 1 / decode
        out[f"prefill_{tag}"] = n_prompt / prefill
    kv_per_token = m["L"] * 2 * m["kv"] * (1 + 4 / m["hd"])     # INT8 + one float32 scale per head
    room = available - B - OVERHEAD - RESERVE - 64 * MiB          # 64 MiB: scratch, roughly
    out["ctx"] = min(m["ctx"], max(0, int(room // kv_per_token) // 256 * 256))   # at most the trained context
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Orin Nano speed and fit: a prediction from a model")
    ap.add_argument("--board", choices=sorted(BOARDS), default="super")
    ap.add_argument("--prompt", type=int, default=33, help="prefill size (default 33: a home command)")
    ap.add_argument("--available-gib", type=float, default=6.0,
                    help="MemAvailable assumed at load (default 6.0: a headless 8 GB board with the voice stack "
                         "not yet started; the reserve then keeps 1.5 GiB for it)")
    args = ap.parse_args(argv)
    board = BOARDS[args.board]
    print(f"PREDICTION for {board['name']}, {board['bw'] / 1e9:.0f} GB/s, prompt {args.prompt} tokens, "
          f"MemAvailable {args.available_gib} GiB (tools/orin_predict.py; not measured)")
    print(f"| model (Q4_K_M) | GB per token | decode roofline | decode tok/s | pp{args.prompt} tok/s | "
          "ctx that fits (INT8 KV) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, m in MODELS.items():
        p = predict(m, board, args.prompt, args.available_gib * GiB)
        print(f"| {name} | {p['bytes'] / 1e9:.3f} | {p['roofline']:.0f} | {p['decode_low']:.0f}-{p['decode_high']:.0f}"
              f" | {p['prefill_low']:.0f}-{p['prefill_high']:.0f} | {p['ctx']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
