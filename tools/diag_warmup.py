"""Which arena buffers does warm_up() change that it must not (weights, norms, RoPE)?"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_gguf import write_synthetic_qwen3  # noqa: E402

from genie_rt.engine.backend_cpu import CPUBackend
from genie_rt.engine.backend_cuda import CUDABackend
from genie_rt.engine.config import EngineConfig, ModelConfig
from genie_rt.engine.gguf_file import open_gguf
from genie_rt.engine.memory import MemoryPlan

path = Path("/tmp/diagw.gguf")
write_synthetic_qwen3(path, dict(layers=1, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                                 vocab=4122, text_tokens=4096), seed=0)
g = open_gguf(path)
cfg = ModelConfig.from_gguf(g)
be = CUDABackend(g, cfg, EngineConfig(backend="cuda", n_ctx=128, kv_dtype="f16", prefill_chunk=64),
                 MemoryPlan(128, 0, 0, 0, 0, 0, 1 << 50, "diag"), use_graphs=False, warm=False)
cpu = CPUBackend(g, cfg, 128, "f16")
toks = (np.arange(40) * 37 % 4000).astype(np.int32)
ref = cpu.prefill(toks, 0)
got = be.prefill(toks, 0)
print("prefill before warm-up: cos", float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)), flush=True)
names = [n for n in be.lay.layout.entries if n.startswith(("blk.", "embd", "out", "output_norm", "rope."))]
before = {n: be.arena[n].copy_to_host() for n in names}
be.warm_up()
for n in names:
    after = be.arena[n].copy_to_host()
    if not np.array_equal(after.view(np.uint8), before[n].view(np.uint8)):
        bad = np.nonzero(after.view(np.uint8).ravel() != before[n].view(np.uint8).ravel())[0]
        print(f"CHANGED {n}: {bad.size} bytes, first at {bad[0]}, last at {bad[-1]} of {after.nbytes}", flush=True)
got = be.prefill(toks, 0)
print("prefill after warm-up: cos", float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)), flush=True)
