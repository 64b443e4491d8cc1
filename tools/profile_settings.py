"""The ways tools/profile_decode.py compares (--settings): each sets one configuration of the
CUDA decode step up (an EngineConfig field, a module knob, the attention plans), and
`same_bits_then_times` checks every way's logits against the first's (the same bits, or a cosine
for a way that adds floats in another order) before it times them all, twice. Also the step's
timing primitives (`record_step`, `time_step`). GPU only; imported by profile_decode.py.
"""
import numpy as np


def record_step(be) -> None:
    """One greedy decode step at the state's position, as the engine's graph of that position runs
    it (the short-context graph below EngineConfig.decode_short_ctx)."""
    from genie_rt.engine.device_state import S_POS
    be._record_decode("greedy", be.short_at(int(be._host_state[S_POS])))   # the position _set_state wrote


def time_step(be, reps: int = 30) -> float:
    """Median ms of one decode step, recorded fresh into its own graph."""
    from genie_rt.engine.cuda_graph import time_us
    return time_us(lambda: record_step(be), be.stream, per=1, reps=reps) / 1000


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


def knob_settings(be, module, names: tuple, ways, what: str, min_cos: float | None = None) -> dict:
    """The step with the module attributes `names` (lab knobs) set to each tuple of `ways`, the
    first the reference: the logits' bits (min_cos None) or cosine, then the times; the knobs are
    restored after. Labels are "NAME=value, ..."."""
    base = tuple(getattr(module, n) for n in names)

    def way(values):
        def setup():
            for n, v in zip(names, values):
                setattr(module, n, v)
        return setup
    try:
        return same_bits_then_times(be, {", ".join(f"{n}={v}" for n, v in zip(names, values)): way(values)
                                         for values in ways}, what, min_cos=min_cos)
    finally:
        way(base)()


def gemv_knob_settings(be, name: str, values, min_cos: float | None = None) -> dict:
    """knob_settings of the quant/gemv.py lab knob `name` at each of `values`: SWIGLU_PAIR (a warp's
    gate and up rows streamed together), PDL_EARLY_TRIPS (the plain GEMVs' first trips' loads
    issued before their PDL wait), KSPLIT_WARPS_PER_SM."""
    from genie_rt.quant import gemv
    return knob_settings(be, gemv, (name,), [(v,) for v in values], name, min_cos)


# (PDL_PIN_WEIGHTS, PDL_EARLY_TRIPS, PDL_EARLY_TRIPS_Q6K, SWIGLU_PAIR): the first is the build of
# 2026-12-04 to 12-06, whose early weight loads ptxas scheduled below the wait (quant/gemv.py)
PIN_WAYS = ((False, 2, None, False), (True, 2, 1, False), (True, 1, None, False), (True, 2, None, False),
            (True, 2, 1, True), (True, 1, None, True))


def pin_settings(be, ways=PIN_WAYS) -> dict:
    """The step with the decode GEMVs' pre-wait weight loads pinned above their PDL wait or not
    (quant/gemv.py PDL_PIN_WEIGHTS), at each count of early trips, with and without the SwiGLU
    GEMV's paired rows: the same bits as the first way, then the times."""
    from genie_rt.quant import gemv
    return knob_settings(be, gemv, ("PDL_PIN_WEIGHTS", "PDL_EARLY_TRIPS", "PDL_EARLY_TRIPS_Q6K", "SWIGLU_PAIR"),
                         ways, "pinned pre-wait weight loads")


# (PDL_EARLY_TRIPS, PDL_EARLY_TRIPS_Q6K, PDL_MAX_REGISTERS), pinned and paired: the default first (since
# 2026-12-06 07:50 UTC), then the default before it, then three Q4_K trips / two Q6_K trips pinned,
# uncapped (4 blocks an SM) and capped at 96 registers (5 blocks an SM: a 2,560-row output in one
# wave on 132 SMs)
TRIP_WAYS = ((2, 2, 96), (2, 1, None), (3, 1, None), (3, 1, 96), (3, 2, 96))


def trip_settings(be, ways=TRIP_WAYS) -> dict:
    """The step with the residual GEMVs' pinned early trips (quant/gemv.py PDL_EARLY_TRIPS,
    PDL_EARLY_TRIPS_Q6K) and their register cap (PDL_MAX_REGISTERS): the same bits, then the times."""
    from genie_rt.quant import gemv
    return knob_settings(be, gemv, ("PDL_EARLY_TRIPS", "PDL_EARLY_TRIPS_Q6K", "PDL_MAX_REGISTERS"), ways,
                         "pinned early trips and the register cap")


def attention_chain_settings(be) -> dict:
    """The step with the decode attention's merge prefetch (kvcache/attention.py MERGE_PREFETCH)
    off (the default, the reference), on, and on for the mma loop's plans alone: the same bits, then
    the times."""
    from genie_rt.kvcache import attention as A
    return knob_settings(be, A, ("MERGE_PREFETCH",), ((False,), (True,), ("mma",)),
                         "the attention's merge prefetch")


def attention_knob_settings(be, name: str, values, min_cos: float | None = None) -> dict:
    """knob_settings of kvcache/attention.py's knob `name` at each of `values` (QK_DP4A)."""
    from genie_rt.kvcache import attention as A
    return knob_settings(be, A, (name,), [(v,) for v in values], name, min_cos)


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
    # (the "mma" loop takes its own block shapes: --settings mma, mma_ways)
    order = (DEFAULT_LOOP,) + tuple(x for x in LOOPS if x not in (DEFAULT_LOOP, "mma"))
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


def mma_ways(be) -> dict:
    """plan_settings' ways for the tensor-core attention loop ("mma", kvcache/attention_decode_
    mma.py: the whole GQA group a block) against the loaded plans (the first way) and the short
    graph's one-head blocks (the default below position 1,024): its default shape (MMA_SHAPE: 8 warps
    of one 16-row chunk, 161 registers, one block an SM) and split count, half those splits, 4 warps
    (158: three blocks an SM), two chunks a trip (248: two blocks), 2 warps (6 blocks)."""
    from genie_rt.engine.config import EngineConfig
    from genie_rt.kvcache.attention import MMA_SHAPE, plan_decode
    p = next(x for x in be.lay.decode_plans if not x.window)
    n_ctx = be.lay.kv_shape.n_ctx

    def mma(warps, chunks, n_splits=None):
        m = plan_decode(p.n_head, p.n_kv, p.head_dim, p.kv_dtype, n_ctx, loop="mma", warps=warps,
                        rows_per_thread=chunks, n_splits=n_splits)
        return dict(loop="mma", n_sub=m.n_sub, warps=warps, rows_per_thread=chunks, n_splits=m.n_splits)
    d = mma(*MMA_SHAPE)
    short = plan_decode(p.n_head, p.n_kv, p.head_dim, p.kv_dtype, min(n_ctx, EngineConfig().decode_short_ctx),
                        heads_per_block=1)       # the short-context graph's plan (cuda_layout.short_plans)
    ways = {f"loop={p.loop}, {p.warps} x {p.rows_per_thread}, {p.n_splits} splits (the loaded plan)": {},
            f"loop={short.loop}, one head a block, {short.n_splits} splits (the short graph's plan)":
                dict(loop=short.loop, n_sub=short.n_sub, warps=short.warps,
                     rows_per_thread=short.rows_per_thread, n_splits=short.n_splits),
            f"loop=mma, {MMA_SHAPE[0]} warps x {MMA_SHAPE[1]} chunk, {d['n_splits']} splits": d}
    for label, kw in ((f"{MMA_SHAPE[0]} warps x {MMA_SHAPE[1]} chunk", mma(*MMA_SHAPE, max(1, d["n_splits"] // 2))),
                      ("4 warps x 1 chunk", mma(4, 1)), ("4 warps x 2 chunks", mma(4, 2)),
                      ("2 warps x 1 chunk", mma(2, 1))):
        ways[f"loop=mma, {label}, {kw['n_splits']} splits"] = kw
    return ways


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
            "one head a block, 8 x 1, 16 splits": dict(n_sub=g, n_splits=16, rows_per_thread=1),
            # fewer splits: at depth 64 (two 64-row tiles) one split is two trips and no merge
            "one head a block, 8 x 2, 1 split": dict(n_sub=g, n_splits=1),
            "one head a block, 8 x 2, 2 splits": dict(n_sub=g, n_splits=2),
            "one head a block, 8 x 2, 4 splits": dict(n_sub=g, n_splits=4)}
