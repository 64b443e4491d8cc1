"""Diagnose CUDA prefill against the CPU back-end by prompt length, chunk and graph use.

    python tools/diag_prefill.py [--layers 4 --hidden 1024 ...]
Prints the last-token logits cosine for each case; a developer tool, not a test.
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_gguf import write_synthetic_qwen3  # noqa: E402

from genie_rt.engine.backend_cpu import CPUBackend
from genie_rt.engine.backend_cuda import CUDABackend
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import MemoryPlan


def cos(a, b):
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def main():
    path = Path("/tmp/diag.gguf")
    write_synthetic_qwen3(path, dict(layers=2, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                                     vocab=4122, text_tokens=4096), seed=0)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    cpu = CPUBackend(g, cfg, 256, "f16")
    toks = (np.arange(200) * 37 % 4000).astype(np.int32)
    for chunk, graphs in ((128, False), (128, True), (64, True)):
        t = time.time()
        be = CUDABackend(g, cfg, EngineConfig(backend="cuda", n_ctx=256, kv_dtype="f16", prefill_chunk=chunk),
                         MemoryPlan(256, 0, 0, 0, 0, 0, 1 << 50, "diag"), use_graphs=graphs)
        print(f"chunk {chunk} graphs {graphs}: load {time.time() - t:.1f} s", flush=True)
        for n in (7, 33, 60, 64, 65, 90, 128, 129):
            got, ref = be.prefill(toks[:n], 0), cpu.prefill(toks[:n], 0)
            print(f"  n={n:4d} cos {cos(got, ref):.6f}", flush=True)
        got, ref = be.decode(11, 129), cpu.decode(11, 129)
        print(f"  decode after 129: cos {cos(got, ref):.6f}", flush=True)


if __name__ == "__main__":
    main()
