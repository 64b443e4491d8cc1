"""The device-state slots: the per-step values CUDA graphs read from device memory.

Pointers and scalar arguments are frozen into a captured graph, so everything that
changes between replays lives in one small int32 array in the arena (`state`, 8 slots).
This table is its one definition; every kernel that reads or writes a slot imports its
name from here.

    slot        written by                              read by
    S_POS   0   a prefill graph's first copy (from the   rope_write, decode/prefill attention:
                mirror the host wrote); host before a    the position of the chunk's first row
                decode run; advance_state (+1 after      (decode: of the token); rope_write and
                each decode step)                        the prefill attention read state[0]
    S_LAST  1   a prefill graph's first copy             gather_row: the last real row of a
                                                         padded chunk (its logits are wanted)
    S_SPLIT 2,3 a prefill graph's first copy: the        prefill attention and its merge
                context splits of the chunk's launch     (splits_at): the split count of
                for prefill plan 0 / 1 (global,          prefill plan i is state[S_SPLIT + i],
                sliding window)                          so a bucket is one graph
    S_TOKEN 4   host before a decode run; the sampler    embed (the decode step's input token)
                (the token it drew)
    S_DRAWS 5   set_request (0); the sampler (+1 per     the sampler: the RNG step, and the
                draw)                                    output slot out[S_DRAWS % len(out)]
    S_HIST  6   set_request (the prompt's length); the   the sampler's repetition penalties
                sampler (+1 per draw)                    (tokens in the recent-token ring)
    7           free

A prefill chunk's slots (S_POS .. S_SPLIT + plans - 1) are adjacent, so they are one copy: the host
writes their pinned mirror (CUDABackend._set_state(copy=False)) and the prefill's graph copies it as its
first node (_record_prefill); S_DRAWS and S_HIST are one copy too (gpu_sampling.set_request).
"""
S_POS, S_LAST = 0, 1
S_SPLIT = 2                      # S_SPLIT + i: prefill plan i's attention splits (i < MAX_PLANS)
S_TOKEN, S_DRAWS, S_HIST = 4, 5, 6
MAX_PLANS = 2
N_SLOTS = 8
