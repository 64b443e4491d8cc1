"""tg with and without a grammar mask, same engine, same run (issue 15's check: a JSON-schema
mask costs at most 10 % of tg128).

    python tools/bench_constrained.py MODEL.gguf [--backend cuda] [-n 128] [-r 5]

Each repetition runs, alternating, n decode steps unconstrained (greedy, what `genie-rt bench`
times) and n steps under each mask: "json-string" (one JSON string: the mask of a string body
every step), "json-objects" (an array of objects with a string, an integer and a boolean: the
mask changes with the structure). Greedy with a random-weights model keeps the grammar busy;
the steps go on through the end-of-generation token (as a timed tg does), so every step
computes and applies a mask. Prints the median tokens/s of each and the cost against
unconstrained; --json FILE writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

SCHEMAS = {
    "json-string": {"type": "string"},
    "json-objects": {"type": "array", "items": {
        "type": "object", "required": ["name", "n", "ok"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                       "ok": {"type": "boolean"}}}},
}


def time_tg(engine, spec, n: int, depth: int, rng) -> float:
    from genie_rt.engine.constrain import Constraint
    from genie_rt.engine.sampling import Sampler, SamplingParams
    backend = engine.backend
    prompt = rng.integers(0, engine.cfg.vocab_size, depth).astype(np.int32)
    c = Constraint.start(engine.tokenizer, spec, engine.cfg.vocab_size) if spec is not None else None
    sampler = Sampler(SamplingParams(temperature=0), c)
    history = list(map(int, prompt))
    token = backend.prefill_sample(prompt, 0, sampler, history)
    history.append(token)
    backend.synchronize()
    t0 = time.perf_counter()
    steps = backend.decode_tokens(token, depth, sampler, history)
    for _ in range(n):
        history.append(next(steps))
    steps.close()
    backend.synchronize()
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-d", "--depth", type=int, default=16, help="prompt tokens before the timed steps")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from genie_rt.engine.config import EngineConfig
    from genie_rt.engine.constrain import json_schema_constraint
    from genie_rt.engine.engine import Engine
    engine = Engine.load(args.model, EngineConfig(backend=args.backend, n_ctx=max(512, args.depth + args.n + 8)))
    specs = {"none": None, **{k: json_schema_constraint(v) for k, v in SCHEMAS.items()}}
    rng = np.random.default_rng(0)
    for name, spec in specs.items():                 # warm-up: compile, capture, build the vocabulary
        time_tg(engine, spec, 8, args.depth, rng)
    runs = {k: [] for k in specs}
    for _ in range(args.repetitions):
        for name, spec in specs.items():
            runs[name].append(time_tg(engine, spec, args.n, args.depth, rng))
    base = statistics.median(runs["none"])
    info = engine.backend.device_info()
    print(f"model {args.model}  backend {info.get('backend')} ({info.get('device')})  tg{args.n}, "
          f"{args.repetitions} repetitions, medians")
    out = {"model": str(args.model), "device": info, "n": args.n, "runs": runs}
    for name in specs:
        med = statistics.median(runs[name])
        cost = (base / med - 1) * 100
        out[name] = {"tok_s": med, "cost_pct": cost}
        print(f"  {name:13s} {med:9.1f} tok/s   {'' if name == 'none' else f'{cost:+.1f} % time per token'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
