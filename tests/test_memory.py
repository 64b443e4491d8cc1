"""MemoryBudget: fits, picks the context, refuses with every term named."""
import pytest

from genie_rt.engine.memory import GiB, MiB, MemoryBudget, MemoryBudgetError, mem_available_bytes


def budget(available, weights=2 * GiB, per_tok=72 * 1024):
    return MemoryBudget(weights=weights, kv_bytes_per_token=per_tok, scratch=64 * MiB, overhead=300 * MiB,
                        reserve=1536 * MiB, available=available, where="test", n_ctx_train=40960)


def test_explicit_context_fits():
    plan = budget(8 * GiB).plan(4096)
    assert plan.n_ctx == 4096 and plan.kv == 4096 * 72 * 1024
    assert plan.total == 2 * GiB + plan.kv + 64 * MiB + 300 * MiB + 1536 * MiB


def test_default_context_is_largest_fitting_multiple_capped_at_training():
    plan = budget(5 * GiB).plan(None)
    room = 5 * GiB - (2 * GiB + 64 * MiB + 300 * MiB + 1536 * MiB)
    assert plan.n_ctx == (room // (72 * 1024)) // 256 * 256
    assert plan.total <= 5 * GiB
    assert budget(1000 * GiB).plan(None).n_ctx == 40960


def test_refuses_with_numbers():
    with pytest.raises(MemoryBudgetError) as info:
        budget(3 * GiB).plan(None)
    msg = str(info.value)
    for term in ("weights", "KV cache", "scratch", "runtime overhead", "reserve", "needed in total", "available"):
        assert term in msg
    assert "2.00 GiB" in msg  # the weights figure itself
    with pytest.raises(MemoryBudgetError):
        budget(4 * GiB).plan(40960)


def test_mem_available_reads_proc():
    n = mem_available_bytes()
    assert n is None or n > 0


def test_refusal_advice_names_real_flags():
    from dataclasses import replace
    with pytest.raises(MemoryBudgetError) as info:
        replace(budget(3 * GiB), kv_dtype="f16").plan(4096)
    assert "--kv int8" in str(info.value) and "--reserve-mb" in str(info.value)
    with pytest.raises(MemoryBudgetError) as info:
        replace(budget(3 * GiB), kv_dtype="int8").plan(4096)     # already int8: not advised
    assert "--kv int8" not in str(info.value)
