"""engine/cuda_graph_steps.py's warm-up order, on a stand-in back-end (no kernels): with the
weights still being read on a thread, nothing runs before they are in; without, the first
bucket, the heads and the decodes run once before their capture, as they always did."""
from genie_rt.engine.cuda_graph_steps import GraphSteps


class _Upload:
    def __init__(self, log):
        self.log, self.seconds, self.reading = log, 1.5, True

    def wait(self, progress=None):
        self.log.append("weights in")
        self.reading = False

    def join(self):
        self.log.append("joined")


class _Stub(GraphSteps):
    """What _warm_one reads of CUDABackend; each capture-only try succeeds per `captures`."""

    def __init__(self, upload: bool, captures):
        self.log = []
        self.use_graphs = True
        self._upload = _Upload(self.log) if upload else None
        self.upload_seconds = None
        self._waited = 0.0                  # warm_up's count of seconds waited for the upload
        self._captures = iter(captures)

    def _capture_only(self, key, record):
        ok = next(self._captures)
        self.log.append(("capture-only", key, ok))
        return ok

    def _run(self, key, record):
        self.log.append(("run", key))


def test_with_a_background_upload_nothing_runs_before_the_weights_are_in():
    b = _Stub(True, [False, True])                 # the first try compiled kernels: discarded
    b._warm_one(("prefill", 16, (1,)), None, first_try_capture=False)
    assert b.log == [("capture-only", ("prefill", 16, (1,)), False), ("capture-only", ("prefill", 16, (1,)), True)]
    b = _Stub(True, [False, False])                # cannot be captured without a run
    b._warm_one(("decode", None), None, first_try_capture=False)
    assert b.log[-2:] == ["weights in", ("run", ("decode", None))]
    b._warm_one(("decode", "greedy"), None, first_try_capture=False)   # weights in: as without,
    assert b.log[-2:] == ["weights in", ("run", ("decode", "greedy"))]  # (its error checked first)
    b._weights_ready()                  # after the warm-up: the step shown, the upload let go
    assert b._upload is None and b.upload_seconds == 1.5


def test_without_one_the_first_sequence_runs_first_and_later_buckets_are_tried_capture_only():
    b = _Stub(False, [True])
    b._warm_one(("prefill", 16, (1,)), None, first_try_capture=False)
    b._warm_one(("prefill", 32, (1,)), None, first_try_capture=True)
    assert b.log == [("run", ("prefill", 16, (1,))), ("capture-only", ("prefill", 32, (1,)), True)]


def test_a_discarded_capture_is_counted_in_the_load_log():
    """A capture that fails (here: no CUDA driver at all) is thrown away and counted, with its
    seconds, under "discarded <kind> (error)" in capture_stats (the "graphs by kind" log line)."""
    from types import SimpleNamespace
    b = SimpleNamespace(stream=SimpleNamespace(handle=0, synchronize=lambda: None), capture_stats={},
                        _recorded=lambda record: None)
    b._discarded = lambda kind, t0: GraphSteps._discarded(b, kind, t0)
    assert GraphSteps._capture_only(b, ("prefill", 16, (1,)), None) is False
    n, _, seconds, _ = b.capture_stats["discarded prefill (error)"]
    assert n == 1 and seconds >= 0


def test_overlap_load_is_off_by_default_and_the_cli_turns_it_on():
    import argparse

    import pytest

    from genie_rt.engine.cli import _add_model_args, _engine_config
    from genie_rt.engine.config import EngineConfig
    assert EngineConfig().overlap_load is False
    with pytest.raises(ValueError, match="overlap_load"):
        EngineConfig(overlap_load="yes")
    p = argparse.ArgumentParser()
    _add_model_args(p)
    assert _engine_config(p.parse_args([])).overlap_load is False
    assert _engine_config(p.parse_args(["--overlap-load"])).overlap_load is True


def test_a_capture_that_only_loaded_cached_kernels_is_kept_one_that_compiled_is_not(monkeypatch):
    """_capture_only keeps a capture during which the kernel cache only hit (a cubin loaded into
    the context, nothing compiled) and discards one during which anything compiled."""
    import contextlib
    from types import SimpleNamespace

    from genie_rt.engine import cuda_graph
    from genie_rt.engine.kernel_store import STATS

    closed = []

    class FakeGraph:
        n_nodes = 3

        def __init__(self, stream):
            pass

        @contextlib.contextmanager
        def capture(self):
            yield

        def close(self):
            closed.append(self)

    monkeypatch.setattr(cuda_graph, "CUDAGraph", FakeGraph)
    for field in ("lookups", "hits", "misses"):       # the counters are put back afterwards
        monkeypatch.setattr(STATS, field, getattr(STATS, field))

    def hit():
        STATS.lookups += 1
        STATS.hits += 1

    def miss():
        STATS.lookups += 1
        STATS.misses += 1

    b = SimpleNamespace(stream=SimpleNamespace(synchronize=lambda: None), capture_stats={}, _graphs={},
                        pending_launch=None)
    for name in ("_recorded", "_keep_graph", "_discarded"):
        setattr(b, name, getattr(GraphSteps, name).__get__(b))
    assert GraphSteps._capture_only(b, ("prefill", 16, (1,)), lambda: (hit(), hit())) is True
    assert ("prefill", 16, (1,)) in b._graphs and not closed
    assert GraphSteps._capture_only(b, ("prefill", 32, (1,)), lambda: (hit(), miss())) is False
    assert ("prefill", 32, (1,)) not in b._graphs and len(closed) == 1
    assert b.capture_stats["discarded prefill (compiled kernels)"][0] == 1
    assert b.capture_stats["prefill"][0] == 1


def test_streaming_and_grammar_decodes_choose_each_steps_graph_by_its_position(monkeypatch):
    """CUDABackend.decode_tokens and the constrained steps (engine/cuda_constrained.py) run each
    step's forward in the graph of that step's position: the short-context one below
    EngineConfig.decode_short_ctx, the other from it on - across the threshold inside one stream
    (both graphs compute the same step, so only the keys show a wrong choice)."""
    from types import MethodType, SimpleNamespace

    import numba.cuda

    from genie_rt.engine.backend_cuda import CUDABackend
    ev = SimpleNamespace(record=lambda stream: None, synchronize=lambda: None)
    monkeypatch.setattr(numba.cuda, "event", lambda timing=False: ev, raising=False)
    keys = []
    be = SimpleNamespace(dws_short=object(), ecfg=SimpleNamespace(decode_short_ctx=5),
                         _run=lambda key, record: keys.append(key), _enter=lambda: None,
                         _begin_request=lambda sampler, history: None, _set_state=lambda **k: None,
                         _wrote=lambda *a, **k: None, _req=SimpleNamespace(greedy=True), _read_token=lambda: 1,
                         stream=SimpleNamespace(synchronize=lambda: None),
                         _draw_graph=lambda masked, advance: keys.append(("draw",)) or None,
                         _mask_step=lambda sampler: False)
    for name in ("short_at", "_decode_step", "_constrained"):
        setattr(be, name, MethodType(getattr(CUDABackend, name), be))
    short, other = ("decode", "greedy", "short"), ("decode", "greedy")
    steps = CUDABackend.decode_tokens(be, 7, 3, SimpleNamespace(want_probs=False, constraint=None), [])
    [next(steps) for _ in range(3)]          # the device runs one step ahead: positions 3 .. 6
    steps.close()
    assert keys == [short, short, other, other]
    keys.clear()
    grammar = SimpleNamespace(accept=lambda token: None)
    steps = CUDABackend.decode_tokens(be, 7, 3, SimpleNamespace(want_probs=False, constraint=grammar), [])
    [next(steps) for _ in range(2)]
    steps.close()
    assert [k for k in keys if k[0] == "decode"] == [("decode", None, "short")] * 2 + [("decode", None)]
    be.dws_short = None                      # no short graph (off, or one head a block anyway)
    keys.clear()
    steps = CUDABackend.decode_tokens(be, 7, 0, SimpleNamespace(want_probs=False, constraint=None), [])
    next(steps)
    steps.close()
    assert keys == [other, other]


def test_warm_up_skips_the_long_context_decode_graph_when_every_position_is_short():
    """decode_graph_keys: a pool no longer than EngineConfig.decode_short_ctx never runs the
    long-context decode graph, so warm_up does not capture it; a longer pool, or no short
    graph at all, captures what it did."""
    from types import SimpleNamespace
    b = _Stub(False, [])
    for n_ctx, short, keys in ((1024, True, [(("decode", "greedy", "short"), True)]),
                               (1025, True, [(("decode", "greedy"), False), (("decode", "greedy", "short"), True)]),
                               (512, False, [(("decode", "greedy"), False)])):
        b.n_ctx, b.ecfg = n_ctx, SimpleNamespace(decode_short_ctx=1024)
        b.dws_short = object() if short else None
        assert b.decode_graph_keys("greedy") == keys, (n_ctx, short)
