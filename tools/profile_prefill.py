"""Where a CUDA prefill spends its time, by kernel family and GEMM (GPU only).

    python tools/profile_prefill.py -m MODEL.gguf [--sizes 16,32,48,64,128,512] [--json PATH]
    python tools/profile_prefill.py -m MODEL.gguf --short --start 500 [--pdl both] [--pdl-kinds "norm,q8k;all"]

--short: the short prefill's graph (EngineConfig.short_prefill, engine/cuda_short_prefill.py: up
to 8 new tokens by the int8 tensor-core GEMV), its own families; its --pdl turns on the lab knob
cuda_short_prefill.PDL and toggles EngineConfig.decode_pdl (together they chain its launches), the
buckets' is prefill_pdl.

For each prefill size n: times the layer-major prefill of n tokens recorded into a CUDA
graph, then the same with one family's launches (or one GEMM of the layer) replaced by a
no-op: the difference is what that family costs inside the prefill. The values are
garbage in the ablated graphs; the timing of the remaining kernels does not depend on
them (no kernel's work depends on the data). Medians of several replays (CUDA events).
"""
import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import without  # noqa: E402

MODULES = ["genie_rt.quant.embed", "genie_rt.quant.mmq", "genie_rt.kvcache.rope_write",
           "genie_rt.kvcache.attention_prefill", "genie_rt.quant.quantize_q8k", "genie_rt.quant.gemv_mma_k",
           "genie_rt.quant.gemv_mma_glu", "genie_rt.quant.gemv_mma_qkv", "genie_rt.kvcache.attention_merge"]


def families(cfg):
    """(label, module, function, predicate on the call's positional args or None).
    mmq(w, x16, xscale, out, mode, ...): the layer's GEMMs differ by mode and columns."""
    mm = "genie_rt.quant.mmq"
    return [
        ("embed", "genie_rt.quant.embed", "embed", None),
        ("prepare_x (norm + fp16)", mm, "prepare_x", None),
        ("mmq qkv", mm, "mmq", lambda a: a[4] == "store"),
        ("mmq attn_output", mm, "mmq", lambda a: a[4] == "add" and a[0].cols == cfg.q_dim),
        ("mmq gate+up swiglu", mm, "mmq", lambda a: a[4] == "swiglu"),
        ("mmq ffn_down", mm, "mmq", lambda a: a[4] == "add" and a[0].cols == cfg.n_ff),
        ("rope + KV write", "genie_rt.kvcache.rope_write", "rope_write", None),
        ("prefill attention", "genie_rt.kvcache.attention_prefill", "prefill_attention", None),
    ]


def short_families(cfg):
    """The short graph's (ShortPrefillOps'): rmsnorm_q8k(x, w, eps, ...) with a norm weight is a
    norm, without one the q8_K of the attention's output (cols q_dim; since 2026-12-06 in the
    attention's merge_q8k, so none) or of the SwiGLU's (n_ff);
    gemv_mma_k(w, ...) is attn_output or ffn_down by its columns."""
    q8k, k = "genie_rt.quant.quantize_q8k", "genie_rt.quant.gemv_mma_k"
    return [
        ("embed", "genie_rt.quant.embed", "embed", None),
        ("norm -> q8_K", q8k, "rmsnorm_q8k", lambda a: a[1] is not None),
        ("q8_K of the attention out", q8k, "rmsnorm_q8k", lambda a: a[1] is None and a[0].shape[1] != cfg.n_ff),
        ("q8_K of the SwiGLU out", q8k, "rmsnorm_q8k", lambda a: a[1] is None and a[0].shape[1] == cfg.n_ff),
        ("q, k, v (one launch)", "genie_rt.quant.gemv_mma_qkv", "gemv_mma_qkv", None),
        ("attn_output + residual", k, "gemv_mma_k", lambda a: a[0].cols == cfg.q_dim),
        ("gate, up, SwiGLU", "genie_rt.quant.gemv_mma_glu", "gemv_mma_glu", None),
        ("ffn_down + residual", k, "gemv_mma_k", lambda a: a[0].cols == cfg.n_ff),
        ("rope + KV write", "genie_rt.kvcache.rope_write", "rope_write", None),
        ("prefill attention", "genie_rt.kvcache.attention_prefill", "prefill_attention", None),
        ("attention merge + q8_K", "genie_rt.kvcache.attention_merge", "merge_q8k", None),
    ]


def time_prefill(be, n: int, reps: int = 20, splits: tuple = (1,)) -> float:
    """Median ms of one prefill of n rows, recorded fresh into its own graph (the short prefill's
    where the back-end was loaded with it: --short)."""
    from genie_rt.engine.cuda_graph import time_us
    return time_us(lambda: be._record_prefill(n, splits, be.short_prefill), be.stream, per=1, reps=reps) / 1000


def compare_split_tiles(be, n: int, start: int, values: list, short: bool = False) -> dict:
    """The n-row prefill graph at `start` with attention_prefill.MIN_SPLIT_TILES (short: the short
    graph's SHORT_SPLIT_TILES) at each value (then back to the default): ms and the splits in use
    each time."""
    from genie_rt.kvcache import attention_prefill as AP
    name = "SHORT_SPLIT_TILES" if short else "MIN_SPLIT_TILES"
    default, res = getattr(AP, name), {}
    try:
        for k in values:
            setattr(AP, name, k)
            be._max_splits_of.clear()
            be._splits_of.clear()
            used, most = be._splits(n, start, short), be._max_splits(n, short)
            be._set_state(pos=start, last=n - 1, splits=used)
            ms = time_prefill(be, n, splits=most)
            res[k] = dict(ms=ms, splits=list(used))
            print(f"  {name}={k}: {ms:.3f} ms ({used} splits in use, at most {most})", flush=True)
    finally:
        setattr(AP, name, default)
        be._max_splits_of.clear()
        be._splits_of.clear()
    return res


def time_ways(be, n: int, splits: tuple, ways: list, what: str) -> tuple:
    """The n-row prefill graph each of ways [(label, setup)] - setup() sets the knobs of that way -
    twice in turn: ({label: [ms, ms]}, {label: the residual stream after the last layer, host}),
    a line each time printed as "<what> <label>"."""
    res, bits = {}, {}
    for rnd in (1, 2):
        for label, setup in ways:
            setup()
            ms = time_prefill(be, n, splits=splits)
            res.setdefault(label, []).append(ms)
            bits.setdefault(label, be._prefill_scratch[n].x.copy_to_host())
            print(f"  {what}{label}: {ms:.3f} ms (pass {rnd})", flush=True)
    return res, bits


def compare_pdl(be, n: int, splits: tuple, field: str = "prefill_pdl") -> dict:
    """The n-row prefill graph with EngineConfig.<field> (prefill_pdl; the short graph's decode_pdl)
    off and on, twice in turn: ms each time, and whether the residual stream after the last layer
    has the same bits both ways."""
    import numpy as np

    def setter(on):
        return lambda: setattr(be, "ecfg", dataclasses.replace(be.ecfg, **{field: on}))   # read by each recording
    res, bits = time_ways(be, n, splits, [(f"={on}", setter(on)) for on in (False, True)], field)
    off, on = bits["=False"], bits["=True"]
    same, diff = bool(np.array_equal(off, on)), float(np.max(np.abs(off - on)))
    print(f"  {field} on against off: same bits {same} (max |diff| {diff:.3g})", flush=True)
    return dict(ms={field + k: v for k, v in res.items()}, same_bits=same, max_abs_diff=diff)


def compare_pdl_kinds(be, n: int, splits: tuple, specs: list) -> dict:
    """The short graph with cuda_short_prefill.PDL set to each spec (a tuple of its PDL_KINDS) and
    EngineConfig.decode_pdl on, beside the plain graph, twice in turn: ms each time, and whether the
    residual stream after the last layer has the plain graph's bits."""
    import numpy as np
    from genie_rt.engine import cuda_short_prefill as S

    def setter(kinds):
        def setup():
            S.PDL = kinds
            be.ecfg = dataclasses.replace(be.ecfg, decode_pdl=bool(kinds))
        return setup
    knob = S.PDL
    try:
        res, bits = time_ways(be, n, splits, [("plain", setter(()))] +
                              [(",".join(k) or "none", setter(k)) for k in specs], "PDL kinds ")
    finally:
        S.PDL = knob
        be.ecfg = dataclasses.replace(be.ecfg, decode_pdl=False)
    same = {k: bool(np.array_equal(v, bits["plain"])) for k, v in bits.items()}
    print(f"  the plain graph's bits: {same}", flush=True)
    return dict(ms=res, same_bits=same)


def compare_knobs(be, n: int, splits: tuple, specs: list) -> dict:
    """The n-row graph with lab knobs set each way (specs: lists of tools/lab_knobs.py
    assignments, module.NAME=value) beside the default, twice in turn: ms each time, and whether
    the residual stream after the last layer has the default's bits. Every knob is put back."""
    import numpy as np
    from lab_knobs import Ways
    knobs = Ways(specs)

    def setter(spec):
        return lambda: knobs.use(spec)
    try:
        res, bits = time_ways(be, n, splits, [("default", setter([]))] +
                              [(",".join(spec), setter(spec)) for spec in specs], "knobs ")
    finally:
        knobs.restore()
    same = {k: bool(np.array_equal(v, bits["default"])) for k, v in bits.items()}
    ref = bits["default"].ravel().astype(np.float64)
    cos = {k: float(v.ravel() @ ref / (np.linalg.norm(v) * np.linalg.norm(ref) or 1.0)) for k, v in bits.items()}
    print(f"  the default's bits: {same}", flush=True)
    print("  cosine with the default's residual stream: " + ", ".join(f"{k} {c:.7f}" for k, c in cos.items()),
          flush=True)
    return dict(ms=res, same_bits=same, cosine=cos)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--sizes", default="16,32,64,128,512")
    p.add_argument("--kv", default="int8")
    p.add_argument("--json", default=None)
    p.add_argument("--start", type=int, default=0, help="first position of the prefill (tokens already "
                   "in the cache, as after prefix reuse; default 0)")
    p.add_argument("--pdl", choices=("off", "on", "both"), default=None,
                   help="EngineConfig.prefill_pdl (sm_90+: the GEMMs by programmatic dependent launch; default "
                        "off), with --short the short graph's (EngineConfig.decode_pdl with cuda_short_prefill.PDL; "
                        "on, the engine's default); "
                        "both: time the graph each way in turn and check that the residual stream has "
                        "the same bits (the ablation then runs with it off; --short: on)")
    p.add_argument("--pdl-kinds", default=None, metavar="K,K;K;...",
                   help="with --short: time the graph with the lab knob cuda_short_prefill.PDL set to each "
                        "';'-separated list of its PDL_KINDS (all: every kind) beside the plain graph, twice "
                        "in turn, bits compared (which launches PDL pays for)")
    p.add_argument("--split-tiles", default=None, metavar="K,K,...",
                   help="also time the graph with kvcache/attention_prefill.MIN_SPLIT_TILES at each value "
                        "(the fewest key tiles a split of the attention keeps; default 4), with --short "
                        "SHORT_SPLIT_TILES (the short graph's; default 2)")
    p.add_argument("--knobs", default=None, metavar="M.K=V,M.K=V;...",
                   help="also time the graph with lab knobs set each ';'-separated way (','-separated "
                        "tools/lab_knobs.py assignments, e.g. engine.cuda_short_prefill.GLU_KSPLIT=4) beside the "
                        "default, twice in turn, bits compared (a knob read when a kernel is built or a "
                        "launch recorded)")
    p.add_argument("--short", action="store_true",
                   help="the short prefill's graph (EngineConfig.short_prefill; sizes up to 8, default 8)")
    p.add_argument("--no-ablation", dest="ablation", action="store_false",
                   help="time the whole graph only, not each family's share")
    args = p.parse_args(argv)
    if args.start < 0:
        p.error(f"--start must be >= 0, got {args.start}")
    args.pdl = args.pdl or ("on" if args.short else "off")
    knob_specs = [[a for a in spec.split(",") if a] for spec in args.knobs.split(";")] if args.knobs else []
    if knob_specs:                                     # a typo fails now, not after the compile
        from lab_knobs import Ways
        Ways(knob_specs)
    kind_specs = None
    if args.pdl_kinds is not None:
        from genie_rt.engine import cuda_short_prefill
        if not args.short:
            p.error("--pdl-kinds is the short graph's (add --short)")
        kind_specs = [tuple(cuda_short_prefill.PDL_KINDS) if spec.strip() == "all" else
                      tuple(k for k in spec.split(",") if k) for spec in args.pdl_kinds.split(";")]
        try:
            for spec in kind_specs:
                cuda_short_prefill.pdl_kinds(spec)
        except ValueError as e:
            p.error(f"--pdl-kinds: {e}")
    if args.short and args.pdl != "off":
        from genie_rt.engine import cuda_short_prefill
        cuda_short_prefill.PDL = True               # then decode_pdl decides (compare_pdl toggles it)
    if args.short and args.sizes == p.get_default("sizes"):
        args.sizes = "8"
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.engine import Engine
    for module in MODULES:
        importlib.import_module(module)
    pdl_field = "decode_pdl" if args.short else "prefill_pdl"
    eng = Engine.load(args.model, EngineConfig(backend="cuda", n_ctx=args.ctx, kv_dtype=args.kv,
                                               short_prefill=args.short, **{pdl_field: args.pdl != "off"}))
    be = eng.backend
    if args.short and not be.short_prefill:
        p.error(f"--short: the short prefill does not take this model ({be.device_info().get('short_prefill')})")
    out = []
    for n in (int(v) for v in args.sizes.split(",")):
        if n > (8 if args.short else be.lay.chunk) or args.start + n > be.n_ctx:
            print(f"prefill of {n} tokens at position {args.start}: skipped (chunk {be.lay.chunk}, "
                  f"context {be.n_ctx}; raise --ctx; --short: at most 8)", flush=True)
            continue
        used = be._splits(n, args.start, args.short)     # in use at this start (device state)
        be._set_state(pos=args.start, last=n - 1, splits=used)
        splits = be._max_splits(n, args.short)           # the bucket graph's grid, as served
        ways = {}
        if args.split_tiles:
            ways["split_tiles"] = compare_split_tiles(be, n, args.start, [int(v) for v in args.split_tiles.split(",")],
                                                      args.short)
            used, splits = be._splits(n, args.start, args.short), be._max_splits(n, args.short)
            be._set_state(pos=args.start, last=n - 1, splits=used)
        if kind_specs:
            ways["pdl_kinds"] = compare_pdl_kinds(be, n, splits, kind_specs)
        if knob_specs:
            ways["knobs"] = compare_knobs(be, n, splits, knob_specs)
        if args.pdl == "both":
            ways = compare_pdl(be, n, splits, pdl_field)
            be.ecfg = dataclasses.replace(be.ecfg, **{pdl_field: False})       # the ablation: plain
        full = time_prefill(be, n, splits=splits)
        print(f"prefill of {n} tokens at position {args.start} ({used} of at most {splits} attention splits), "
              f"{be.device_info()['device']}: {full:.3f} ms "
              f"({n / full * 1000:.0f} tokens/s, graph only), {pdl_field}={getattr(be.ecfg, pdl_field)}"
              f"{', short graph' if args.short else ''}", flush=True)
        if not args.ablation:
            out.append(dict(n=n, start=args.start, ms=full, pdl=ways))
            continue
        rows = []
        for label, module, name, pred in (short_families if args.short else families)(be.cfg):
            with without(module, name, pred):
                rest = time_prefill(be, n, splits=splits)
            rows.append(dict(n=n, family=label, ms=full - rest, percent=100 * (full - rest) / full))
            print(f"  {label:<28} {(full - rest) * 1000:8.1f} us  {100 * (full - rest) / full:5.1f} %"
                  f"  ({(full - rest) * 1000 / be.cfg.n_layers:6.1f} us per layer)", flush=True)
        acc = sum(r["ms"] for r in rows)
        print(f"  {'(sum of the families)':<28} {acc * 1000:8.1f} us  {100 * acc / full:5.1f} %", flush=True)
        out.append(dict(n=n, start=args.start, ms=full, families=rows, pdl=ways))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
