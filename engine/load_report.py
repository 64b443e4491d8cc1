"""What a loaded engine is, on one screen: printed by `genie-rt run` (stderr) and logged by
`genie-rt serve` when the model is ready.

    print(ready_summary(engine), file=sys.stderr)

`genie-rt run -p "The capital of France is" --temp 0 -n 16 --backend cpu` with the default
model, 2026-12-02, on the shared 2-core dev machine (loaded, hence the slow 4.3 s):

    ready in 4.3 s: gemma-3-270m-q4_k_m.gguf
      model     Gemma 3 270m - gemma3, 18 layers, 640 hidden, vocabulary 262144, Q4_K_M; a base model (no chat template)
      back-end  cpu (numba, 2 threads)
      context   32768 tokens (trained for 32768)
      KV cache  f16, 832.0 MiB for 32768 tokens (sliding-window layers keep only their window)
      memory    needs 1.32 GiB of 22.18 GiB available (host memory (MemAvailable)); 20.86 GiB left
                weights 235.2 MiB, KV 832.0 MiB, scratch 24.8 MiB, runtime 256.0 MiB, reserve 512.0 MiB

Only reads what the engine already holds (its MemoryPlan, config and device_info()).
"""
from __future__ import annotations

from .memory import fmt_bytes

# general.file_type -> llama.cpp's name (the common ones; others print as the number)
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime), or None where that cannot be read."""
    import os
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def timeline(marks: list[tuple[str, float]], backend) -> str:
    """The load's phases in one log line: `marks` are (name, seconds) in order; then, inside
    the back-end's seconds, the CUDA back-end's warm-up and its weights read beside it."""
    parts = [f"{name} {sec:.2f} s" for name, sec in marks]
    up = getattr(backend, "upload_seconds", None)
    if up is not None:
        parts.append(f"(of which weights read beside the warm-up {up:.2f} s)")
    warm = getattr(backend, "compile_seconds", None)
    if warm:
        parts.append(f"(of which warm-up {warm:.2f} s)")
    return "; ".join(parts)


def _device(info: dict) -> str:
    backend = info.get("backend", "?")
    device = info.get("device", "?")
    extra = []
    if "threads" in info:
        extra.append(f"{info['threads']} threads")
    if "compute_capability" in info:
        extra.append(f"sm {info['compute_capability']}")
    if info.get("integrated"):
        extra.append("integrated, memory shared with the CPU")
    if info.get("graphs"):
        extra.append(f"{info['graphs']} graphs")
    if info.get("compile_seconds"):
        extra.append(f"kernels ready in {info['compile_seconds']:.1f} s")
    return f"{backend} ({', '.join([device, *extra])})"


def ready_summary(engine) -> str:
    cfg, plan = engine.cfg, engine.plan
    ftype = FILE_TYPES.get(cfg.file_type, f"file type {cfg.file_type}") if cfg.file_type is not None else "?"
    try:
        info = engine.backend.device_info()
    except Exception:                   # a summary must never fail a load
        info = {"backend": getattr(engine.backend, "name", "?")}
    windowed = any(w for w in cfg.layer_windows)
    left = plan.available - plan.total + plan.reserve
    lines = [
        f"ready in {engine.load_seconds:.1f} s: {engine.model_name}",
        f"  model     {cfg.name or '?'} - {cfg.arch}, {cfg.n_layers} layers, {cfg.n_embd} hidden, "
        f"vocabulary {cfg.vocab_size}, {ftype}" + ("" if not engine.template.is_plain else
                                                  "; a base model (no chat template)"),
        f"  back-end  {_device(info)}",
        f"  context   {engine.n_ctx} tokens (trained for {cfg.n_ctx_train})",
        f"  KV cache  {engine.ecfg.kv_dtype}, {fmt_bytes(plan.kv)} for {plan.n_ctx} tokens"
        + (" (sliding-window layers keep only their window)" if windowed else ""),
        f"  memory    needs {fmt_bytes(plan.total - plan.reserve)} ({fmt_bytes(plan.total)} with the reserve, "
        f"genie-rt info's total) of {fmt_bytes(plan.available)} available ({plan.where}); {fmt_bytes(left)} left",
        f"            weights {fmt_bytes(plan.weights)}, KV {fmt_bytes(plan.kv)}, scratch {fmt_bytes(plan.scratch)}, "
        f"runtime {fmt_bytes(plan.overhead)}, reserve {fmt_bytes(plan.reserve)}",
    ]
    return "\n".join(lines)
