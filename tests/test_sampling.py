"""Sampler chain: greedy, seeded reproducibility, each filter, penalties, validation."""
import numpy as np
import pytest

from genie_rt.engine.generate import StopMatcher
from genie_rt.engine.sampling import Sampler, SamplingParams


def logits_fixture():
    rng = np.random.default_rng(0)
    return rng.standard_normal(1000).astype(np.float32) * 3


def test_greedy_is_argmax():
    lg = logits_fixture()
    assert Sampler(SamplingParams(temperature=0)).sample(lg) == int(lg.argmax())


def test_same_seed_same_tokens_and_different_seed_differs():
    lg = logits_fixture()
    draw = lambda seed: [Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=seed)).sample(lg)
                         for _ in range(1)]
    a = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=42))
    b = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=42))
    sa = [a.sample(lg) for _ in range(50)]
    sb = [b.sample(lg) for _ in range(50)]
    assert sa == sb
    c = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=43))
    assert [c.sample(lg) for _ in range(50)] != sa
    assert draw(1) == draw(1)


def test_top_k_limits_candidates():
    lg = logits_fixture()
    top5 = set(np.argsort(-lg)[:5].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, top_p=1, min_p=0, seed=0))
    assert {s.sample(lg) for _ in range(300)} <= top5


def test_top_p_keeps_smallest_nucleus():
    lg = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0, seed=0))
    assert {s.sample(lg) for _ in range(300)} == {0, 1}


def test_min_p_drops_unlikely():
    lg = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1, min_p=0.25, seed=0))
    assert {s.sample(lg) for _ in range(300)} == {0, 1, 2}


def test_temperature_sharpens_distribution():
    lg = np.log(np.array([0.4, 0.35, 0.25], np.float32))
    cold = Sampler(SamplingParams(temperature=0.01, top_k=0, top_p=1, min_p=0, seed=0))
    assert all(cold.sample(lg) == 0 for _ in range(100))


def test_logit_bias_and_ban():
    lg = np.zeros(10, np.float32)
    s = Sampler(SamplingParams(temperature=0, logit_bias={7: 5.0}))
    assert s.sample(lg) == 7
    s = Sampler(SamplingParams(temperature=0, logit_bias={0: float("-inf")}))
    assert s.sample(np.arange(10, dtype=np.float32)[::-1].copy()) == 1


def test_penalties():
    lg = np.array([2.0, 1.9, 0.0], np.float32)
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5)).sample(lg, [0]) == 1
    assert Sampler(SamplingParams(temperature=0, presence_penalty=0.5)).sample(lg, [0]) == 1
    assert Sampler(SamplingParams(temperature=0, frequency_penalty=0.05)).sample(lg, [0, 0, 0]) == 1
    assert Sampler(SamplingParams(temperature=0, frequency_penalty=0.05)).sample(lg, [0]) == 0
    # outside the window: no penalty
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=1)).sample(lg, [0, 2]) == 0


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 1.5), ("min_p", -0.1),
    ("top_k", -3), ("top_k", 2.5), ("repeat_penalty", float("inf")), ("seed", "abc"),
    ("repeat_last_n", -5), ("logit_bias", {99999: 1.0}), ("logit_bias", {1: "x"}),
])
def test_validation_names_field(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        p.validate(1000)


def test_stop_matcher_holds_back_partial_and_cuts():
    m = StopMatcher(["</tool_call>", "STOP"])
    out = []
    for piece in ["Hello </to", "ol_", "call> trailing"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped and m.stop_word == "</tool_call>"


def test_stop_matcher_releases_false_alarm():
    m = StopMatcher(["STOP"])
    a, _ = m.feed("go ST")
    assert a == "go "
    b, stopped = m.feed("ART")
    assert b == "START" and not stopped
    assert m.flush() == ""


def test_stop_matcher_earliest_wins_and_no_stops():
    m = StopMatcher(["bb", "a"])
    text, stopped = m.feed("xxbba")
    assert text == "xx" and m.stop_word == "bb"
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
