#!/usr/bin/env python3
"""Lab probe (GPU, sm_90+): where programmatic dependent launch goes wrong in a CUDA graph.

On the H200 (2026-12-03) the engine's decode step with PDL GEMVs gave the right logits when
run on the stream and wrong ones when its captured graph was replayed. This runs one chain of
n dependent f32-mode GEMVs (each reads the output of the one before) four ways - the kernel
build (plain / PDL) x the launch path (numba's / cuda.core's without the attribute / with it)
- on the stream and as replays of a captured graph, and says which match the plain build
launched by numba on the stream.

    python tools/pdl_probe.py
"""
import sys

import numpy as np


def main() -> int:
    from numba import cuda

    from genie_rt.engine.cuda_graph import CUDAGraph
    from genie_rt.quant import gemv as G
    from genie_rt.quant import gemv_kernels as K
    from genie_rt.quant import pdl
    from genie_rt.quant.formats import QType
    from genie_rt.quant.gemv_bench import random_weight
    print("pdl available:", pdl.available(), flush=True)
    rng = np.random.default_rng(0)
    s = cuda.stream()
    n, d = 10, 2560
    mats = [G.prepare_weight(G.to_device(random_weight(QType.Q4_K, d, d, rng), stream=s), "f32") for _ in range(2)]
    x0 = (rng.standard_normal((1, d)) * 1e-3).astype(np.float32)
    bufs = [cuda.device_array((1, d), np.float32, stream=s) for _ in range(n + 1)]
    kern = {b: G._gemv_kernel(mats[0].spec, 1, 1, False, 32, 0, b) for b in (False, True)}
    for k in kern.values():
        G._compile(k, G.SIG_GEMV)
    grid = G._blocks(d, 1, 32)

    def chain(build, path):
        k = kern[build]
        for i in range(n):
            w = mats[i % 2]
            args = (*G._w_args(w), w.rows, G._flat(bufs[i]), G._flat(bufs[i]).view(np.uint32),
                    G._flat(bufs[i]), d, G._flat(bufs[i + 1]), G._flat(bufs[i + 1]))
            if path == "numba":
                k[grid, K.BLOCK, s](*args)
            else:
                pdl.launch(k, grid, K.BLOCK, s, *args, programmatic=(path == "core+attr"))

    def result():
        s.synchronize()
        return np.stack([b.copy_to_host() for b in bufs])

    bufs[0].copy_to_device(x0, stream=s)
    chain(False, "numba")
    ref = result()
    ok = True
    for build, path in ((False, "numba"), (True, "numba"), (True, "core"), (True, "core+attr"), (False, "core")):
        for b in bufs[1:]:
            b.copy_to_device(np.full((1, d), np.nan, np.float32), stream=s)
        chain(build, path)
        stream_ok = np.array_equal(result(), ref)
        g = CUDAGraph(s)
        for b in bufs[1:]:
            b.copy_to_device(np.full((1, d), np.nan, np.float32), stream=s)
        s.synchronize()
        with g.capture():
            chain(build, path)
        reps = []
        for _ in range(3):
            g.replay()
            reps.append(np.array_equal(result(), ref))
        g.close()
        print(f"build {'PDL' if build else 'plain'} launched by {path:9s}: stream {'ok' if stream_ok else 'WRONG'}, "
              f"graph replays {['ok' if r else 'WRONG' for r in reps]}", flush=True)
        ok &= stream_ok and all(reps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
