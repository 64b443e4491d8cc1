"""Where a CUDA decode step spends its time, by kernel family (GPU only).

    python tools/profile_decode.py -m MODEL.gguf [--ctx 2048] [--depth 512] [--json PATH] [--no-pdl] [--lab]
        [--settings pdl,pair,loop,early] [--no-ablation]
    nsys profile --cuda-graph-trace=node --capture-range=cudaProfilerApi -o step \
        python tools/profile_decode.py -m MODEL.gguf --trace 10     # then tools/trace_report.py

--trace N replays the captured decode graph N times between cuProfilerStart/Stop and exits
(no ablation): under Nsight Systems each kernel node's own duration and the gaps between
them; under Nsight Compute (--graph-profiling node) each kernel's stall reasons.

Times the captured decode graph (greedy sampling included), then, for each launcher the
step calls, a graph recorded with that launcher replaced by a no-op: the difference is
what that family costs inside the step (its kernels plus their graph nodes). The step's
values are garbage in the ablated graphs; the timing of the remaining kernels does not
depend on them. Each time is the median of several replays, measured with CUDA events.
The step is also timed (--lab) on an sm_90+ device with and without EngineConfig.decode_pdl
(programmatic dependent launch, quant/pdl.py), and with EngineConfig.decode_attention_q8 flipped
(the attention launch writing its output's q8), and (--settings) with each of the decode
attention's loops, with rope_write inside the attention's launch or on its own
(EngineConfig.decode_fused_rope), and the other comparisons --help lists; the families are then
taken apart for the configured one.
"""
import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_settings import (attention_chain_settings, attention_knob_settings, config_settings,  # noqa: E402
                              gemv_knob_settings, heads_ways, loop_settings,
                              mma_ways, pdl_settings, pin_settings, plan_settings, record_step,
                              short_shape_ways, splits_settings, time_step, trip_settings)

# (module, function) the decode step launches through
FAMILIES = [
    ("genie_rt.quant.embed", "embed"),
    ("genie_rt.engine.norm", "rmsnorm_q8"),
    ("genie_rt.quant.gemv", "gemv_qkv"),
    ("genie_rt.kvcache.rope_write", "rope_write"),
    ("genie_rt.kvcache.attention", "decode_attention"),
    ("genie_rt.kvcache.attention", "decode_rope_attention"),    # the two above in one (decode_fused_rope)
    ("genie_rt.quant.gemv", "quantize_q8"),
    ("genie_rt.quant.gemv", "gemv"),
    ("genie_rt.quant.gemv", "gemv_swiglu"),
    ("genie_rt.engine.gpu_sampling", "sample_greedy"),
    ("genie_rt.engine.gpu_sampling", "advance_state"),
]


@contextmanager
def without(module: str, name: str, pred=None):
    """module.name replaced by a no-op for the calls whose positional args satisfy
    pred (every call when pred is None); the others still run."""
    mod = sys.modules[module]
    original = getattr(mod, name)

    def stub(*a, **k):
        if pred is not None and not pred(a):
            return original(*a, **k)
        return None
    setattr(mod, name, stub)
    try:
        yield
    finally:
        setattr(mod, name, original)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--depth", type=int, default=512, help="context position of the profiled step")
    p.add_argument("--kv", default="int8")
    p.add_argument("--short-ctx", type=int, default=None, metavar="N",
                   help="EngineConfig.decode_short_ctx (default: its default, or 0 with --settings that "
                        "change the plans - loop, splits, plan, heads, short - which are the other graph's): "
                        "the step below position N runs the short-context graph")
    p.add_argument("--attention-loop", default=None, metavar="LOOP",
                   help="EngineConfig.decode_attention_loop (the profile's loaded plans; e.g. mma)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="profile without programmatic dependent launch (on by default on sm_90+)")
    p.add_argument("--settings", default="pdl,pair,loop,early,rope",
                   help="which comparisons to check and time before the ablation, comma-separated: pdl "
                        "(each set of PDL kinds), pair (SWIGLU_PAIR), loop (the attention's loops), early "
                        "(gemv.PDL_EARLY_TRIPS), pin (the GEMVs' pre-wait weight loads pinned above the PDL wait or "
                        "not, by early trips and SWIGLU_PAIR: gemv.PDL_PIN_WEIGHTS), trips (the pinned early trips of Q4_K / "
                        "Q6_K with and without ptxas's register cap gemv.PDL_MAX_REGISTERS), splits (the attention plans' split count), plan "
                        "(their warps and rows a thread), heads (one or two heads an attention block), "
                        "short (the one-head blocks' shapes), rope (EngineConfig.decode_fused_rope), "
                        "q8 (decode_attention_q8), chain (the attention's merge prefetch: "
                        "kvcache/attention.py MERGE_PREFETCH), qk8 (the "
                        "attention's scores by dp4a, QK_DP4A: cosine >= 0.999, not bits), ksplit "
                        "(gemv.KSPLIT_WARPS_PER_SM 16 / 32: the residual GEMVs' rows over one or two "
                        "warps, so all of ffn_down's row is loaded before its PDL wait; cosine), mma (the "
                        "attention on the tensor cores, loop 'mma', in five block shapes; cosine), even (its splits cut by 16-row chunks or by whole tiles, "
                        "MMA_EVEN_SPLITS; cosine), skip (the warp loops' "
                        "rescale only when a max grew, SKIP_RESCALE: the same bits); '' for none")
    p.add_argument("--min-cos", type=float, default=None, metavar="C",
                   help="the logits cosine the ways of qk8 and ksplit must keep with the default's "
                        "before they are timed (default 0.999, 0.9999); lower it to time a way "
                        "that fails its bar - the cosine is printed either way")
    p.add_argument("--no-ablation", dest="ablation", action="store_false",
                   help="skip timing the step without each family of kernels")
    p.add_argument("--lab", action="store_true",
                   help="also time the step with and without PDL and with the attention's q8 output "
                        "flipped (EngineConfig.decode_attention_q8): each compiles its own kernels")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="replay the decode graph N times inside cuProfilerStart/Stop and exit (for nsys / ncu)")
    args = p.parse_args(argv)
    import dataclasses
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    from genie_rt.engine.sampling import Sampler, SamplingParams
    import importlib
    for module, _ in FAMILIES:
        importlib.import_module(module)
    # the settings that change the plans change the other graph's (lay.decode_plans): profile without
    # the short-context graph then, unless asked otherwise
    plan_kinds = {"loop", "splits", "plan", "heads", "short", "mma"} & set(args.settings.split(","))
    if args.short_ctx is None and plan_kinds:
        args.short_ctx = 0
        print(f"--settings {','.join(sorted(plan_kinds))}: profiling with --short-ctx 0 (one decode graph)")
    short = {} if args.short_ctx is None else {"decode_short_ctx": args.short_ctx}
    if args.attention_loop:
        short["decode_attention_loop"] = args.attention_loop
    elif args.short_ctx == 0 and plan_kinds:
        # one graph, with the loop the default long-context graph takes (cuda_layout.decode_loop:
        # mma on sm_90 for the 4B), not the loop a config without the short graph would get
        from genie_rt.engine.cuda_layout import decode_loop, mma_measured_here
        from genie_rt.engine.gguf_file import open_gguf
        from genie_rt.engine.config import ModelConfig
        mc = ModelConfig.from_gguf(open_gguf(args.model))
        loop = decode_loop(mc, EngineConfig(backend="cuda", kv_dtype=args.kv),
                           [mc.window(i) for i in range(mc.n_layers)], mma_measured_here())
        if loop:
            short["decode_attention_loop"] = loop
            print(f"  the loaded plans: the long-context graph's default loop, {loop}")
    eng = Engine.load(args.model, EngineConfig(backend="cuda", n_ctx=args.ctx, kv_dtype=args.kv, **short,
                                                 decode_pdl=args.pdl))
    be = eng.backend
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, eng.cfg.vocab_size, args.depth).astype(np.int32)
    sampler = Sampler(SamplingParams(temperature=0))
    be.prefill_sample(prompt, 0, sampler, list(prompt))
    be._set_state(pos=args.depth)
    from genie_rt.quant import pdl
    if args.trace:
        from numba import cuda
        from genie_rt.engine.cuda_graph import CUDAGraph
        record_step(be)                             # compiled already; once more outside capture
        be.stream.synchronize()
        graph = CUDAGraph(be.stream)
        with graph.capture():
            record_step(be)
        for _ in range(3):
            graph.replay()
        be.stream.synchronize()
        cuda.profile_start()
        for _ in range(args.trace):
            be._set_state(pos=args.depth)
            graph.replay()
            be.stream.synchronize()                 # one replay at a time: clean step boundaries
        cuda.profile_stop()
        print(f"traced {args.trace} decode steps at depth {args.depth}")
        return 0
    wanted = {x for x in args.settings.split(",") if x}
    known = {"pdl", "pair", "loop", "early", "pin", "rope", "q8", "splits", "plan", "heads", "short", "chain", "qk8", "ksplit",
             "mma", "even", "skip", "trips"}
    if wanted - known:
        raise SystemExit(f"--settings: unknown {sorted(wanted - known)}")
    settings = pdl_settings(be) if "pdl" in wanted and pdl.available() else {}
    if "pair" in wanted:
        settings.update(gemv_knob_settings(be, "SWIGLU_PAIR", (False, True)))
    if "loop" in wanted:
        settings.update(loop_settings(be))
    if "early" in wanted and pdl.available():
        settings.update(gemv_knob_settings(be, "PDL_EARLY_TRIPS", (1, 2, 3)))
    if "pin" in wanted and pdl.available():
        settings.update(pin_settings(be))
    if "trips" in wanted and pdl.available():
        settings.update(trip_settings(be))
    if "splits" in wanted:
        settings.update(splits_settings(be))
    if "heads" in wanted:
        settings.update(plan_settings(be, heads_ways(be), "the attention's heads a block"))
    if "short" in wanted:
        settings.update(plan_settings(be, short_shape_ways(be), "the short graph's block shape"))
    if "plan" in wanted:
        settings.update(plan_settings(be))
    if "mma" in wanted:
        settings.update(plan_settings(be, mma_ways(be), "the tensor-core attention loop"))
    if "chain" in wanted:
        settings.update(attention_chain_settings(be))
    def bar(default: float) -> float:       # --min-cos, where given, replaces a way's cosine bar
        return default if args.min_cos is None else args.min_cos

    if "ksplit" in wanted:      # 32: the residual GEMVs (2,560 rows) in two k-parts (a row in flight
        settings.update(gemv_knob_settings(be, "KSPLIT_WARPS_PER_SM", (16, 32),
                                           min_cos=bar(0.9999)))   # pre-wait)
    if "even" in wanted:        # the mma loop's splits by chunks or by tiles: other groupings, cosine
        settings.update(attention_knob_settings(be, "MMA_EVEN_SPLITS", (True, False), min_cos=bar(0.999)))
    if "skip" in wanted:        # the same bits
        settings.update(attention_knob_settings(be, "SKIP_RESCALE", (False, True)))
    if "qk8" in wanted:
        settings.update(attention_knob_settings(be, "QK_DP4A", (False, True), min_cos=bar(0.999)))
    if "rope" in wanted:
        settings.update(config_settings(be, "decode_fused_rope", (True, False)))
    if "q8" in wanted:
        settings.update(config_settings(be, "decode_attention_q8", (False, True)))
    full = time_step(be)
    use_pdl = be.ecfg.decode_pdl
    if args.lab:
        for d in ((False, True) if pdl.available() else (False,)):
            be.ecfg = dataclasses.replace(be.ecfg, decode_pdl=d)   # read by each recording
            settings[f"decode_pdl={d}"] = time_step(be)
        q8 = not be.ecfg.decode_attention_q8                  # the switch flipped, the rest as configured
        be.ecfg = dataclasses.replace(be.ecfg, decode_pdl=use_pdl, decode_attention_q8=q8)
        settings[f"decode_attention_q8={q8}"] = time_step(be)
        be.ecfg = dataclasses.replace(be.ecfg, decode_attention_q8=not q8)
    rows = [("whole step", full, 100.0)]
    rows += [(f"whole step, {label}", ms, 100 * ms / full) for label, ms in settings.items()]
    n_settings = len(settings)
    for module, name in (FAMILIES if args.ablation else ()):
        with without(module, name):
            rest = time_step(be)
        rows.append((f"{module.rsplit('.', 1)[1]}.{name}", full - rest, 100 * (full - rest) / full))
    print(f"decode step at depth {args.depth}, {be.device_info()['device']}: {full:.3f} ms "
          f"({1000 / full:.0f} tokens/s if nothing else ran)")
    for label, ms, pct in rows[1:1 + n_settings]:
        print(f"  {label}: {ms:.3f} ms ({1000 / ms:.0f} tokens/s)")
    for label, ms, pct in rows[1 + n_settings:]:
        print(f"  {label:<36} {ms * 1000:8.1f} us  {pct:5.1f} %")
    accounted = sum(ms for _, ms, _ in rows[1 + n_settings:])
    print(f"  {'(sum of the families)':<36} {accounted * 1000:8.1f} us  {100 * accounted / full:5.1f} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(family=l, ms=ms, percent=pct) for l, ms, pct in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
