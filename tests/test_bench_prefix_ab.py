"""tools/bench_prefix.py --ab (ab_ways), on a stand-in engine: the ways take turns round by round,
each way's measurements see its knobs set (and the others' as they were), each way's prefill
graphs are dropped and captured again (an untimed request) before it is timed, and every knob
is put back after, also when a measurement fails."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from bench_prefix import ab_ways  # noqa: E402

from genie_rt.engine import backend_cuda, cuda_short_prefill  # noqa: E402


class _Graph:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def close(self):
        self.log.append(("closed", self.key))


def _engine(log):
    graphs = {}
    be = SimpleNamespace(_graphs=graphs, synchronize=lambda: None)

    def capture():                                  # what an untimed request does: its graphs again
        for key in (("prefill_short", 8, (4,)), ("prefill", 512, (1,))):
            graphs.setdefault(key, _Graph(log, key))
    capture()
    graphs[("decode", "greedy")] = _Graph(log, ("decode", "greedy"))
    return SimpleNamespace(backend=be), capture


def test_ab_ways_alternate_with_their_knobs_and_put_them_back():
    log = []
    engine, capture = _engine(log)
    split0, copy0 = cuda_short_prefill.SPLIT_LAUNCH, backend_cuda.SAMPLER_COPY_STREAM
    seen = []

    def measure(i):
        capture()
        seen.append((i, cuda_short_prefill.SPLIT_LAUNCH, backend_cuda.SAMPLER_COPY_STREAM))
        return float(i), 1.0

    specs = [["engine.backend_cuda.SAMPLER_COPY_STREAM=True"], ["engine.cuda_short_prefill.SPLIT_LAUNCH=1"], []]
    out = ab_ways(engine, specs, rounds=2, per=3, measure=measure)
    assert list(out) == ["engine.backend_cuda.SAMPLER_COPY_STREAM=True", "engine.cuda_short_prefill.SPLIT_LAUNCH=1",
                         "(as is)"]
    assert all(len(runs) == 6 for runs in out.values())
    # per round and way: one untimed request (10_000 + 100 r), then `per` timed ones
    ways = [(True, split0), (copy0, 1), (copy0, split0)]
    expect = [(10_000 + 100 * r + i, w[1], w[0]) for r in range(2) for w in ways for i in range(4)]
    assert seen == expect
    assert out["(as is)"][:3] == [(10_001.0, 1.0), (10_002.0, 1.0), (10_003.0, 1.0)]
    assert (cuda_short_prefill.SPLIT_LAUNCH, backend_cuda.SAMPLER_COPY_STREAM) == (split0, copy0)
    closed = [k for what, k in log if what == "closed"]
    assert ("decode", "greedy") not in closed and closed.count(("prefill_short", 8, (4,))) == 2 * 3 + 1


def test_ab_ways_put_the_knobs_back_when_a_measurement_fails():
    engine, _ = _engine([])
    split0 = cuda_short_prefill.SPLIT_LAUNCH

    def measure(i):
        raise RuntimeError("the device went away")

    with pytest.raises(RuntimeError):
        ab_ways(engine, [["engine.cuda_short_prefill.SPLIT_LAUNCH=2"]], rounds=1, per=1, measure=measure)
    assert cuda_short_prefill.SPLIT_LAUNCH == split0


def test_ab_ways_refuse_a_way_given_twice_or_a_bad_value_before_timing_anything():
    engine, _ = _engine([])
    timed = []
    for specs in ([["engine.cuda_short_prefill.SPLIT_LAUNCH=1"], ["engine.cuda_short_prefill.SPLIT_LAUNCH=1"]],
                  [[], []],
                  [["engine.cuda_short_prefill.SPLIT_LAUNCH=1"], ["engine.cuda_short_prefill.SPLIT_LAUNCH=one"]],
                  [["engine.cuda_short_prefill.NO_SUCH_KNOB=1"]]):
        with pytest.raises(SystemExit):
            ab_ways(engine, specs, rounds=1, per=1, measure=lambda i: timed.append(i) or (0.0, 0.0))
    assert not timed
