"""engine/device_state.py: the slot table's contract (kernels and copies rely on it)."""
from genie_rt.engine import device_state as D


def test_slots_are_distinct_and_fit_the_state_array():
    slots = [D.S_POS, D.S_LAST, *range(D.S_SPLIT, D.S_SPLIT + D.MAX_PLANS), D.S_TOKEN, D.S_DRAWS, D.S_HIST]
    assert len(set(slots)) == len(slots)
    assert all(0 <= s < D.N_SLOTS for s in slots)


def test_position_is_slot_0():
    # rope_write and the prefill attention read the chunk's start as state[0]
    assert D.S_POS == 0


def test_a_prefill_chunks_slots_are_one_run_and_the_samplers_counters_another():
    # CUDABackend._set_state writes a prefill chunk's position, last row and splits in one copy;
    # gpu_sampling.set_request writes S_DRAWS .. S_HIST through one view
    assert (D.S_LAST, D.S_SPLIT) == (D.S_POS + 1, D.S_POS + 2)
    assert D.S_HIST == D.S_DRAWS + 1
