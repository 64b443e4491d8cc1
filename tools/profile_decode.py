"""Where a CUDA decode step spends its time, by kernel family (GPU only).

    python tools/profile_decode.py -m MODEL.gguf [--ctx 2048] [--depth 512] [--json PATH] [--fuse-norm] [--no-pdl] [--lab]
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
The step is also timed with every setting of EngineConfig.fuse_decode_norm (the norm
after each residual GEMV folded into that GEMV's launch, or launched on its own) and, on an
sm_90+ device, of EngineConfig.decode_pdl (programmatic dependent launch, quant/pdl.py), and
with EngineConfig.decode_attention_q8 flipped (the attention launch writing its output's q8),
and with each of the decode attention's loops, and with rope_write inside the attention's launch
or on its own (EngineConfig.decode_fused_rope) (--settings);
the families are then taken apart for the configured one. With the fusion on, removing
`gemv` removes those norms too.
"""
import argparse
import json
import sys
from contextlib import contextmanager

import numpy as np

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


def record_step(be) -> None:
    """One greedy decode step at the state's position, as the engine's graph of that position runs
    it (the short-context graph below EngineConfig.decode_short_ctx)."""
    from genie_rt.engine.device_state import S_POS
    be._record_decode("greedy", be.short_at(int(be._host_state[S_POS])))   # the position _set_state wrote


def time_step(be, reps: int = 30) -> float:
    """Median ms of one decode step, recorded fresh into its own graph."""
    from genie_rt.engine.cuda_graph import time_us
    return time_us(lambda: record_step(be), be.stream, per=1, reps=reps) / 1000


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
    p.add_argument("--json", default=None)
    p.add_argument("--fuse-norm", action="store_true", help="profile with the decode norms folded into the GEMVs")
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="profile without programmatic dependent launch (on by default on sm_90+)")
    p.add_argument("--settings", default="pdl,pair,loop,early,rope",
                   help="which comparisons to check and time before the ablation, comma-separated: pdl "
                        "(each set of PDL kinds), pair (SWIGLU_PAIR), loop (the attention's loops), early "
                        "(gemv.PDL_EARLY_TRIPS), splits (the attention plans' split count), plan "
                        "(their warps and rows a thread), heads (one or two heads an attention block), "
                        "short (the one-head blocks' shapes), rope (EngineConfig.decode_fused_rope), "
                        "q8 (decode_attention_q8), chain (the attention's new-row stash and merge "
                        "prefetch: kvcache/attention.py NEW_ROW_STASH, MERGE_PREFETCH), qk8 (the "
                        "attention's scores by dp4a, QK_DP4A: cosine >= 0.999, not bits), ksplit "
                        "(gemv.KSPLIT_WARPS_PER_SM 16 / 32: the residual GEMVs' rows over one or two "
                        "warps, so all of ffn_down's row is loaded before its PDL wait; cosine), lpr16 "
                        "(gemv.LPR16_LAYER, LAYER_EARLY_TRIPS: QKV and gate/up at 16 lanes a row, "
                        "their whole row before the wait; cosine); '' "
                        "for none")
    p.add_argument("--no-ablation", dest="ablation", action="store_false",
                   help="skip timing the step without each family of kernels")
    p.add_argument("--lab", action="store_true",
                   help="also time the lab switches (the norm folded into the GEMVs, the attention's q8 "
                        "output, the fused FFN at 2/4/8 blocks an SM): each compiles its own kernels")
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
    plan_kinds = {"loop", "splits", "plan", "heads", "short"} & set(args.settings.split(","))
    if args.short_ctx is None and plan_kinds:
        args.short_ctx = 0
        print(f"--settings {','.join(sorted(plan_kinds))}: profiling with --short-ctx 0 (one decode graph)")
    short = {} if args.short_ctx is None else {"decode_short_ctx": args.short_ctx}
    eng = Engine.load(args.model, EngineConfig(backend="cuda", n_ctx=args.ctx, kv_dtype=args.kv, **short,
                                                 fuse_decode_norm=args.fuse_norm, decode_pdl=args.pdl))
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
    known = {"pdl", "pair", "loop", "early", "rope", "q8", "splits", "plan", "heads", "short", "chain", "qk8", "ksplit",
             "lpr16"}
    if wanted - known:
        raise SystemExit(f"--settings: unknown {sorted(wanted - known)}")
    settings = pdl_settings(be) if "pdl" in wanted and pdl.available() else {}
    if "pair" in wanted:
        settings.update(gemv_knob_settings(be, "SWIGLU_PAIR", (False, True)))
    if "loop" in wanted:
        settings.update(loop_settings(be))
    if "early" in wanted and pdl.available():
        settings.update(gemv_knob_settings(be, "PDL_EARLY_TRIPS", (1, 2, 3)))
    if "splits" in wanted:
        settings.update(splits_settings(be))
    if "heads" in wanted:
        settings.update(plan_settings(be, heads_ways(be), "the attention's heads a block"))
    if "short" in wanted:
        settings.update(plan_settings(be, short_shape_ways(be), "the short graph's block shape"))
    if "plan" in wanted:
        settings.update(plan_settings(be))
    if "chain" in wanted:
        settings.update(attention_chain_settings(be))
    if "ksplit" in wanted:      # 32: the residual GEMVs (2,560 rows) in two k-parts (a row in flight
        settings.update(gemv_knob_settings(be, "KSPLIT_WARPS_PER_SM", (16, 32), min_cos=0.9999))   # pre-wait)
    if "qk8" in wanted:
        settings.update(attention_knob_settings(be, "QK_DP4A", (False, True), min_cos=0.999))
    if "lpr16" in wanted:
        settings.update(lpr16_settings(be))
    if "rope" in wanted:
        settings.update(config_settings(be, "decode_fused_rope", (True, False)))
    if "q8" in wanted:
        settings.update(config_settings(be, "decode_attention_q8", (False, True)))
    full = time_step(be)
    fused, use_pdl = be.ecfg.fuse_decode_norm, be.ecfg.decode_pdl
    if args.lab:
        for f in (False, True):
            for d in ((False, True) if pdl.available() else (False,)):
                be.ecfg = dataclasses.replace(be.ecfg, fuse_decode_norm=f, decode_pdl=d)   # read by each recording
                settings[f"fuse_decode_norm={f}, decode_pdl={d}"] = time_step(be)
        q8 = not be.ecfg.decode_attention_q8                  # the switch flipped, the rest as configured
        be.ecfg = dataclasses.replace(be.ecfg, fuse_decode_norm=fused, decode_pdl=use_pdl, decode_attention_q8=q8)
        settings[f"decode_attention_q8={q8}"] = time_step(be)
        be.ecfg = dataclasses.replace(be.ecfg, decode_attention_q8=not q8)
        settings.update(fused_ffn_settings(be, pdl.available()))
    rows = [("whole step", full, 100.0)]
    rows += [(f"whole step, {label}", ms, 100 * ms / full) for label, ms in settings.items()]
    n_settings = len(settings)
    for module, name in (FAMILIES if args.ablation else ()):
        with without(module, name):
            rest = time_step(be)
        rows.append((f"{module.rsplit('.', 1)[1]}.{name}", full - rest, 100 * (full - rest) / full))
    print(f"decode step at depth {args.depth}, {be.device_info()['device']}: {full:.3f} ms "
          f"({1000 / full:.0f} tokens/s if nothing else ran), fuse_decode_norm={fused}")
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


# kinds of kernel launched by programmatic dependent launch, checked and timed one set at a time
# (cuda_ops.PDL_KINDS): nothing, each kind alone, the GEMVs with quantize_q8 (2026-12-03's form),
# and all of them (the default)
PDL_SETS = ((), ("gemv",), ("q8",), ("norm",), ("rope",), ("attention",), ("gemv", "q8"),
            ("gemv", "q8", "norm", "rope", "attention"))


def same_bits_then_times(be, ways: dict, what: str, min_cos: float | None = None) -> dict:
    """ways: label -> a function that sets one configuration up (the first is the reference).
    Three decode steps each way from the same state (a capture and run, then two replays):
    every way is reported and the logits must be the reference's bits (min_cos None) or, for
    a way that adds floats in another order, have a cosine >= min_cos with them (the GPU-vs-CPU
    parity bar; the argmax is reported, not required: a synthetic model's logits are flat, and
    a near tie may flip), else the profile stops; then the time of each way. The caller
    restores its configuration; the graphs and the state are reset here."""
    pos = int(be.state.copy_to_host()[0])
    out, bad, ref = {}, [], None
    try:
        for label, setup in ways.items():
            setup()
            be._graphs.clear()
            steps = [be.decode(77, pos) for _ in range(3)]     # capture + run, then two replays
            be._set_state(pos=pos)
            if ref is None:
                ref = steps[0]
            coss = [float(np.dot(x.astype(np.float64).ravel(), ref.astype(np.float64).ravel())
                          / np.linalg.norm(x.astype(np.float64)) / np.linalg.norm(ref.astype(np.float64)))
                    for x in steps]
            cos = min(coss)
            if min_cos is None:
                same = [np.array_equal(x.view(np.int32), ref.view(np.int32)) for x in steps]
            else:
                same = [c >= min_cos for c in coss]
            diff = max(float(np.max(np.abs(x - ref))) for x in steps)
            argmax = all(int(np.argmax(x)) == int(np.argmax(ref)) for x in steps)
            kind = "the same bits" if min_cos is None else f"cosine >= {min_cos}"
            print(f"  {label}: logits {kind if all(same) else 'DIFFERENT'} as the first "
                  f"way's (steps {same}, max |diff| {diff:.3g} of max |logit| "
                  f"{float(np.max(np.abs(ref))):.3g}, cosine {cos:.6f}, same argmax {argmax})", flush=True)
            if not all(same):
                bad.append(label)
        be._graphs.clear()
        if bad:
            raise SystemExit(f"{what} changed the logits: {', '.join(bad)}")
        # two passes over the ways, the faster of each way's two times reported: the first steps
        # timed in a process can be slow (a GPU that idled through the compile), and one pass
        # would charge that to whichever way comes first
        for rnd in (1, 2):
            for label, setup in ways.items():
                setup()
                ms = time_step(be)
                out[label] = min(ms, out.get(label, ms))
                print(f"  {label}: {ms:.3f} ms (pass {rnd})", flush=True)
    finally:
        be._graphs.clear()
        be._set_state(pos=pos)
    return out


def pdl_settings(be) -> dict:
    """The step with programmatic dependent launch on each set of PDL_SETS (the first: none),
    the same bits, then the times; the configuration is restored after."""
    import dataclasses

    from genie_rt.engine import cuda_ops
    base, kinds = be.ecfg, cuda_ops.PDL_KINDS

    def way(ks):
        def setup():
            be.ecfg, cuda_ops.PDL_KINDS = dataclasses.replace(base, decode_pdl=bool(ks)), frozenset(ks)
        return setup
    try:
        return same_bits_then_times(be, {"decode_pdl=" + ("+".join(ks) if ks else "off"): way(ks)
                                         for ks in PDL_SETS}, "programmatic dependent launch")
    finally:
        be.ecfg, cuda_ops.PDL_KINDS = base, kinds


def gemv_knob_settings(be, name: str, values, min_cos: float | None = None) -> dict:
    """The step with the lab knob quant/gemv.py `name` at each of `values`, the first the
    reference: the same bits, then the times; the knob is restored after. SWIGLU_PAIR (a warp's
    gate and up rows streamed together), PDL_EARLY_TRIPS (the plain GEMVs' first trips' loads
    issued before their PDL wait)."""
    from genie_rt.quant import gemv
    base = getattr(gemv, name)
    try:
        return same_bits_then_times(be, {f"{name}={v}": lambda v=v: setattr(gemv, name, v) for v in values},
                                    name, min_cos=min_cos)
    finally:
        setattr(gemv, name, base)


def attention_chain_settings(be) -> dict:
    """The step with the decode attention's two same-bits shortcuts of its last block's path
    (kvcache/attention.py NEW_ROW_STASH, MERGE_PREFETCH) off (the default, the reference), each
    alone, and both: the same bits, then the times; the knobs are restored after."""
    from genie_rt.kvcache import attention as A
    base = (A.NEW_ROW_STASH, A.MERGE_PREFETCH)

    def way(stash, merge):
        def setup():
            A.NEW_ROW_STASH, A.MERGE_PREFETCH = stash, merge
        return setup
    ways = {f"stash={a}, merge_pf={b}": way(a, b)
            for a, b in ((False, False), (True, False), (False, True), (True, True))}
    try:
        return same_bits_then_times(be, ways, "the attention's stash / merge prefetch")
    finally:
        A.NEW_ROW_STASH, A.MERGE_PREFETCH = base


def lpr16_settings(be) -> dict:
    """The step with the QKV and gate/up GEMVs at 32 lanes a row (the default, the reference), at
    16 (gemv.LPR16_LAYER: two rows a warp, half the blocks), and at 16 with both trips of a row
    issued before the PDL wait (LAYER_EARLY_TRIPS 2): cosine >= 0.9999 (the lanes' sums are added
    in another order), then the times; restored after."""
    from genie_rt.quant import gemv
    base = (gemv.LPR16_LAYER, gemv.LAYER_EARLY_TRIPS)

    def way(lpr16, early):
        def setup():
            gemv.LPR16_LAYER, gemv.LAYER_EARLY_TRIPS = lpr16, early
        return setup
    ways = {f"LPR16_LAYER={a}, LAYER_EARLY_TRIPS={b}": way(a, b) for a, b in ((False, 1), (True, 1), (True, 2))}
    try:
        return same_bits_then_times(be, ways, "the layer GEMVs' lanes a row", min_cos=0.9999)
    finally:
        gemv.LPR16_LAYER, gemv.LAYER_EARLY_TRIPS = base


def attention_knob_settings(be, name: str, values, min_cos: float | None = None) -> dict:
    """The step with kvcache/attention.py's knob `name` at each of `values` (the first the
    reference): the logits' bits (min_cos None) or cosine, then the times; restored after."""
    from genie_rt.kvcache import attention as A
    base = getattr(A, name)
    try:
        return same_bits_then_times(be, {f"{name}={v}": lambda v=v: setattr(A, name, v) for v in values},
                                    name, min_cos=min_cos)
    finally:
        setattr(A, name, base)


def config_settings(be, name: str, values) -> dict:
    """The step with EngineConfig field `name` at each of `values`, the first the reference: the
    same bits, then the times; the configuration is restored after (decode_fused_rope)."""
    import dataclasses
    base = be.ecfg

    def way(v):
        def setup():
            be.ecfg = dataclasses.replace(base, **{name: v})
        return setup
    try:
        return same_bits_then_times(be, {f"{name}={v}": way(v) for v in values}, name)
    finally:
        be.ecfg = base


def loop_settings(be) -> dict:
    """The step with each way the decode attention walks its rows (kvcache/attention_decode_
    tiles.py: "block", "warp", "warp-nopf"), the first the default: a logits cosine >= 0.999
    with it (the loops add in another order), then the times; the plans are restored."""
    import dataclasses

    from genie_rt.kvcache.attention import DEFAULT_LOOP, LOOPS
    plans = list(be.lay.decode_plans)

    def way(loop):
        def setup():
            be.lay.decode_plans[:] = [dataclasses.replace(p, loop=loop) for p in plans]
        return setup
    order = (DEFAULT_LOOP,) + tuple(x for x in LOOPS if x != DEFAULT_LOOP)
    try:
        return same_bits_then_times(be, {f"attention loop={x}": way(x) for x in order},
                                    "the attention loop", min_cos=0.999)
    finally:
        be.lay.decode_plans[:] = plans


def splits_settings(be, values=(16, 20, 24, 28, 32)) -> dict:
    """plan_settings with the global plans cut into each of `values` splits (DecodePlan.n_splits:
    blocks along the context per KV head and subgroup, fixed at capture; the kernels are the same).
    Measured 2026-12-04 with 4 x 4 blocks, whose 168 registers leave 3 an SM: one wave of 24 splits
    on the 4B's 8 KV heads x 2 subgroups."""
    return plan_settings(be, {f"splits={ns}": dict(n_splits=ns) for ns in values},
                         "the attention's split count")


# 4 warps of 4 rows (the default until 2026-12-04 night: 168 registers, 3 blocks an SM, 24 splits
# on the 4B), shorter tiles (2 or 1 rows a thread: 126 / 125 registers, 4 blocks an SM, so 32 splits
# are one wave too), and 8 warps of 2 rows (the same 64-row tile, half a warp's trip; 2 blocks an
# SM: 16 splits - the default since)
PLAN_WAYS = {"warps=4, rows/thread=4, 24 splits": dict(warps=4, rows_per_thread=4, n_splits=24),
             "warps=4, rows/thread=2": dict(warps=4, rows_per_thread=2),
             "warps=4, rows/thread=2, 32 splits": dict(warps=4, rows_per_thread=2, n_splits=32),
             "warps=4, rows/thread=1": dict(warps=4, rows_per_thread=1),
             "warps=8, rows/thread=2, 16 splits": dict(warps=8, rows_per_thread=2, n_splits=16)}


def plan_settings(be, ways=None, what="the attention's block shape") -> dict:
    """The step with the global attention plans changed by each way's DecodePlan fields (warps,
    rows_per_thread: the tile a block reads a trip, each a kernel of its own; n_splits; n_sub: the
    heads a block; a field a way leaves out keeps the loaded plan's), each way in a
    workspace carved for its splits and subgroups: a logits cosine >= 0.999 with the first way's
    (the merge and the lane slots add in another grouping), then the times. The plans and the
    workspace are restored."""
    import dataclasses

    from genie_rt.kvcache.attention import DecodeWorkspace
    from numba import cuda
    plans, dws = list(be.lay.decode_plans), be.dws
    ways = PLAN_WAYS if ways is None else ways

    def way(kw):
        shape = {k: v for k, v in kw.items() if k in ("n_splits", "n_sub")}
        wplan = dataclasses.replace(dws.plan, **shape)
        ws = DecodeWorkspace(wplan, cuda.device_array(wplan.workspace_bytes, np.uint8), stream=be.stream)

        def setup():
            be.dws = ws
            be.lay.decode_plans[:] = [p if p.window else dataclasses.replace(p, **kw) for p in plans]
        return setup
    try:
        return same_bits_then_times(be, {f"attention {label}": way(kw) for label, kw in ways.items()},
                                    what, min_cos=0.999)
    finally:
        be.lay.decode_plans[:] = plans
        be.dws = dws


# two query heads a block (the default plans) against one (n_sub = the group: twice the blocks on
# the 4B, each a shorter chain; the K/V rows read once a head, from L2) - what the short-context
# graph (EngineConfig.decode_short_ctx) runs - and the one-head blocks in other shapes (not measured
# yet): 4 warps of 2 rows (a 32-row tile, 96 registers: 5 blocks an SM, so twice the splits are one
# wave), and 8 warps of 1 row. The split counts are the 4B's on the H200 (132 SMs).
def heads_ways(be) -> dict:
    g = be.cfg.n_head // be.cfg.n_head_kv
    return {"two heads a block (default)": {}, "one head a block, 8 splits": dict(n_sub=g, n_splits=8)}


def short_shape_ways(be) -> dict:
    g = be.cfg.n_head // be.cfg.n_head_kv
    return {"one head a block, 8 x 2, 8 splits (the short graph)": dict(n_sub=g, n_splits=8),
            "one head a block, 4 x 2, 16 splits": dict(n_sub=g, n_splits=16, warps=4),
            "one head a block, 8 x 1, 16 splits": dict(n_sub=g, n_splits=16, rows_per_thread=1)}


def fused_ffn_settings(be, pdl_ok: bool) -> dict:
    """The step with EngineConfig.decode_fused_ffn (quant/ffn_fused.py) at 2, 4 and 8 resident
    blocks an SM (ffn_fused.MAX_BLOCKS_PER_SM), then at the default with decode_pdl too where
    the device has it; the configuration is restored after."""
    import dataclasses

    from genie_rt.quant import ffn_fused
    base, default = be.ecfg, ffn_fused.MAX_BLOCKS_PER_SM
    out = {}
    try:
        pos = int(be.state.copy_to_host()[0])
        logits = {}
        for on in (False, True):                  # one step both ways: the bits must agree
            be.ecfg = dataclasses.replace(base, decode_fused_ffn=on)
            be._graphs.clear()
            logits[on] = be.decode(77, pos)
        be._graphs.clear()
        be._set_state(pos=pos)
        diff = float(np.max(np.abs(logits[True] - logits[False])))
        same = np.array_equal(logits[True].view(np.int32), logits[False].view(np.int32))
        print(f"  fused FFN logits vs the separate launches: {'the same bits' if same else 'DIFFERENT'}"
              f" (max |diff| {diff:.3g}), grid {ffn_fused.grid_blocks(next(iter(ffn_fused._kernels.values())))}"
              f" blocks", flush=True)
        for bps in (2, 4, 8):
            ffn_fused.MAX_BLOCKS_PER_SM = bps
            ffn_fused._grids.clear()
            be.ecfg = dataclasses.replace(base, decode_fused_ffn=True)
            out[f"decode_fused_ffn=True, {bps} blocks/SM"] = time_step(be)
            print(f"  fused FFN, {bps} blocks/SM: {out[f'decode_fused_ffn=True, {bps} blocks/SM']:.3f} ms",
                  flush=True)
        ffn_fused.MAX_BLOCKS_PER_SM = default
        ffn_fused._grids.clear()
        for q8 in (False, True):
            be.ecfg = dataclasses.replace(base, decode_fused_ffn=True, decode_attention_q8=q8,
                                          decode_pdl=pdl_ok)
            out[f"decode_fused_ffn=True, decode_attention_q8={q8}, decode_pdl={pdl_ok}"] = time_step(be)
        assert not ffn_fused.failed(be.ffn_counters), "a fused FFN barrier gave up"
    finally:
        ffn_fused.MAX_BLOCKS_PER_SM = default
        ffn_fused._grids.clear()
        be.ecfg = base
    return out


if __name__ == "__main__":
    sys.exit(main())
