"""The plan before the load: which back-end, every term of the memory budget, the context.

`make_plan(path, ecfg)` reads the GGUF header and tensor table (memory-mapped: no weight
is read), picks the back-end as Engine.load does (`choose_backend`), prices the budget
with the same code (`budget_for`: engine/cuda_layout.py `cuda_budget` on a GPU, which
plans the very arena that would be allocated; `cpu_budget` on the CPU) and says whether
it fits. It allocates no device memory; on the CUDA back-end it opens the CUDA context
(needed to ask the device what it is and, on a discrete GPU, how much is free).

`genie-rt info -m MODEL` (alias `plan`) and `--dry-run` on run/serve/bench print
`LoadPlan.text()` (or `--json`: `LoadPlan.as_dict()`) and exit 0 when it fits, 1 when
not. Engine.load raises MemoryBudgetError with the same numbers where this says no.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from .config import DEFAULT_KV, EngineConfig, ModelConfig
from .memory import MemoryBudget, MemoryBudgetError, MemoryPlan, fmt_bytes
from .platform_probe import Probe


def cuda_available() -> bool:
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # no driver, no toolkit, simulator: all mean "no GPU"
        return False


def choose_backend(requested: str, available=None) -> tuple[str, str]:
    """(back-end, why) for --backend auto|cpu|cuda; `available()` says whether CUDA is usable."""
    available = available or cuda_available
    if requested == "auto":
        if available():
            return "cuda", "auto: a CUDA GPU is usable"
        return "cpu", "auto: no usable CUDA GPU or driver"
    if requested == "cuda" and not available():
        raise ValueError("back-end 'cuda': no usable CUDA GPU or driver on this machine "
                         "(numba.cuda.is_available() is False); use --backend cpu or auto")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"unknown back-end '{requested}' (use auto, cpu or cuda)")
    return requested, f"--backend {requested}"


def budget_for(g, cfg: ModelConfig, ecfg: EngineConfig, backend: str) -> MemoryBudget:
    """The budget Engine.load checks (ecfg.kv_dtype already resolved)."""
    if backend == "cpu":
        from .backend_cpu import cpu_budget
        return cpu_budget(g, cfg, ecfg.kv_dtype, ecfg.prefill_chunk, ecfg.reserve_bytes)
    from .cuda_layout import cuda_budget
    return cuda_budget(g, cfg, ecfg)


def weights_by_type(g, cfg: ModelConfig) -> dict:
    """GGUF tensor type -> {"tensors": n, "bytes": bytes in the file} over the tensors used."""
    from .models.weights import check_tensors
    out: dict = {}
    for t in check_tensors(g, cfg).values():
        row = out.setdefault(t.qtype.name, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += int(t.nbytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def _device(backend: str) -> dict:
    if backend != "cuda":
        return {"backend": "cpu"}
    from .cuda_layout import device
    from .platform_probe import gpu_facts
    f = gpu_facts(device())
    return {"backend": "cuda", **dataclasses.asdict(f)}


def _platform(probe: Probe) -> dict:
    mi = probe.meminfo()
    board = probe.board()
    mode = probe.power_mode()
    return {"board": None if board is None else dataclasses.asdict(board),
            "power_mode": None if mode is None else {"id": mode.id, "name": mode.name, "default_id": mode.default_id,
                                                     "modes": {str(k): v for k, v in mode.modes.items()}},
            "mem_total": mi.get("MemTotal"), "mem_available": mi.get("MemAvailable"),
            "swap_free": mi.get("SwapFree")}


@dataclass
class LoadPlan:
    model: str
    arch: str
    backend: str
    backend_reason: str
    kv_dtype: str
    prefill_chunk: int
    requested_ctx: int | None
    n_ctx_train: int
    weights_by_type: dict
    budget: MemoryBudget
    max_ctx: int                      # largest context that fits (0: none)
    plan: MemoryPlan | None           # the plan at requested_ctx (or max_ctx); None when refused
    error: str | None                 # the refusal, as Engine.load would raise it
    device: dict = field(default_factory=dict)
    platform: dict = field(default_factory=dict)
    graphs: list = field(default_factory=list)   # CUDA prefill buckets captured at warm-up

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def n_ctx(self) -> int | None:
        return None if self.plan is None else self.plan.n_ctx

    def as_dict(self) -> dict:
        b = self.budget
        d = {k: getattr(self, k) for k in ("model", "arch", "backend", "backend_reason", "kv_dtype", "prefill_chunk",
                                           "requested_ctx", "n_ctx_train", "weights_by_type", "max_ctx", "error",
                                           "device", "platform", "graphs")}
        d.update(fits=self.fits, n_ctx=self.n_ctx, budget={
            "weights": b.weights, "kv_bytes_per_token": b.kv_bytes_per_token, "kv_fixed": b.kv_fixed,
            "scratch": b.scratch, "overhead": b.overhead, "reserve": b.reserve, "available": b.available,
            "where": b.where})
        if self.plan is not None:
            p = self.plan
            d["plan"] = {**dataclasses.asdict(p), "total": p.total, "margin": p.available - p.total}
        return d

    def text(self) -> str:
        b, cuda = self.budget, self.backend == "cuda"
        lines = [f"model      {self.model} ({self.arch})",
                 f"back-end   {self.backend} ({self.backend_reason})"]
        dev = self.device
        if cuda:
            cc = dev.get("compute_capability")
            lines.append(f"device     {dev.get('name')}" + (f", sm_{cc[0]}{cc[1]}" if cc else "")
                         + (f", {dev['sm_count']} SMs" if dev.get("sm_count") else "")
                         + (", integrated: CPU and GPU share one memory pool" if dev.get("integrated") else ", discrete"))
        pf = self.platform
        if pf.get("board"):
            lines.append(f"board      {pf['board']['model']}" + (f", L4T {pf['board']['l4t']}" if pf['board']['l4t'] else ""))
        if pf.get("power_mode"):
            pm = pf["power_mode"]
            lines.append(f"power mode {pm['name'] or '?'} (nvpmodel id {pm['id']}; modes: "
                         + ", ".join(f"{k}={v}" for k, v in pm["modes"].items()) + ")")
        if pf.get("mem_total"):
            lines.append(f"memory     {fmt_bytes(pf['mem_total'])} total, {fmt_bytes(pf['mem_available'] or 0)} "
                         f"available (/proc/meminfo)" + (f", swap free {fmt_bytes(pf['swap_free'])}"
                                                          if pf.get("swap_free") else ""))
        lines.append("")
        lines.append("weights in the file, by type:")
        for name, row in self.weights_by_type.items():
            lines.append(f"  {name:<10} {row['tensors']:>4} tensors {fmt_bytes(row['bytes']):>12}")
        n = self.n_ctx or self.max_ctx or self.requested_ctx or 0
        per = b.kv_bytes_per_token
        rows = [("weights" + (" (device layout)" if cuda else ""), b.weights),
                (f"KV cache, {self.kv_dtype}: {per:,} B/token x {n}"
                 + (" + sliding-window rings" if b.kv_fixed else ""), b.kv_fixed + n * per),
                ("scratch (activations, workspaces, logits)", b.scratch),
                ("CUDA context, modules, graphs" if cuda else "interpreter heap", b.overhead),
                ("reserve for the rest of the system", b.reserve)]
        total = sum(v for _, v in rows)
        lines.append("")
        lines.append(f"memory budget at ctx {n}:")
        for name, v in rows:
            lines.append(f"  {name:<58} {fmt_bytes(v):>12}")
        lines.append(f"  {'needed in total':<58} {fmt_bytes(total):>12}")
        lines.append(f"  {'available: ' + b.where:<58} {fmt_bytes(b.available):>12}")
        lines.append(f"  {'left over':<58} {fmt_bytes(b.available - total):>12}")
        if "integrated" in b.where:
            lines.append("  (the reserve is what speech-to-text, text-to-speech, Home Assistant and the OS keep; "
                         "--reserve-mb sets it)")
        if cuda and self.graphs:
            lines.append(f"  CUDA graphs: decode, and prefill buckets {', '.join(map(str, self.graphs))} "
                         "(captured at warm-up; their memory is in the context term)")
        lines.append("")
        if self.fits:
            why = ("requested with --ctx" if self.requested_ctx is not None else
                   "the model's training context" if self.n_ctx == self.n_ctx_train else
                   f"the largest that fits (the model was trained for {self.n_ctx_train})")
            lines.append(f"context    {self.n_ctx} tokens: {why}")
            lines.append("verdict    fits: the load would go ahead")
        else:
            lines.append("verdict    does NOT fit: the load would be refused")
            lines.append(self.error or "")
        return "\n".join(lines)


def make_plan(path: str | Path, ecfg: EngineConfig | None = None) -> LoadPlan:
    """The machine is read through Probe() - below $GENIE_RT_SYSFS_ROOT when it is set - by
    this function and by the budget code alike (memory.mem_available_bytes)."""
    from .gguf_file import open_gguf
    ecfg = ecfg or EngineConfig()
    probe = Probe()
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g)
    backend, why = choose_backend(ecfg.backend)
    if ecfg.kv_dtype is None:
        ecfg = dataclasses.replace(ecfg, kv_dtype=DEFAULT_KV[backend])
    budget = budget_for(g, cfg, ecfg, backend)
    plan, error = None, None
    try:
        plan = budget.plan(ecfg.n_ctx)
    except MemoryBudgetError as exc:
        error = str(exc)
    graphs = []
    if backend == "cuda":
        from .cuda_layout import BUCKETS
        graphs = [n for n in BUCKETS if n <= ecfg.prefill_chunk]
    return LoadPlan(model=str(path), arch=cfg.arch, backend=backend, backend_reason=why, kv_dtype=ecfg.kv_dtype,
                    prefill_chunk=ecfg.prefill_chunk, requested_ctx=ecfg.n_ctx, n_ctx_train=cfg.n_ctx_train,
                    weights_by_type=weights_by_type(g, cfg), budget=budget, max_ctx=budget.max_ctx(), plan=plan,
                    error=error, device=_device(backend), platform=_platform(probe), graphs=graphs)
