"""tools/orin_predict.py: the prediction's byte model matches what was measured, and it prints."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import orin_predict as op  # noqa: E402


def test_bytes_per_token_match_the_measured_qwen3_4b():
    # genie-rt bench on the synthetic Qwen3-4B Q4_K_M: 2.491 GB per token (docs/forward-pass.md)
    _, layers, out = op.shapes(op.MODELS["Qwen3-4B"])
    assert abs(layers + out - 2.491e9) / 2.491e9 < 0.02


def test_prediction_is_labelled_and_ordered(capsys):
    assert op.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PREDICTION") and "not measured" in out
    p = {n: op.predict(m, op.BOARDS["super"], 33, 6 * op.GiB) for n, m in op.MODELS.items()}
    assert p["Qwen3-0.6B"]["decode_low"] > p["Qwen3-1.7B"]["decode_low"] > p["Qwen3-4B"]["decode_low"]
    assert all(v["decode_high"] <= v["roofline"] for v in p.values())      # never above the roofline
