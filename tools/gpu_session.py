"""Several GPU measurements in one process, so the kernels compile once (GPU only).

    python tools/gpu_session.py -m MODEL.gguf [--out DIR]

Numba compiles each specialised kernel once per process (there is no on-disk cache yet,
about 1.5 minutes for Qwen3-4B); every tool below loads its own engine, but after the
first only the CUDA graphs are captured again. Runs, in order: `genie-rt bench`
(pp18/33/128/512, tg128), tools/bench_prefix.py on the CUDA back-end,
tools/profile_prefill.py and tools/profile_decode.py.
"""
import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--skip", default="", help="comma-separated steps to skip: bench,prefix,prefill,decode")
    p.add_argument("--prefill-sizes", default="24,40,64,512", help="tools/profile_prefill.py --sizes")
    p.add_argument("--prefill-start", default="0", help="tools/profile_prefill.py --start")
    args = p.parse_args(argv)
    out, skip = Path(args.out), set(filter(None, args.skip.split(",")))
    import bench_prefix
    import profile_decode
    import profile_prefill
    from genie_rt.engine.cli import main as cli
    steps = [
        ("bench", lambda: cli(["bench", "-m", args.model, "-p", "18,33,128,512", "-n", "128", "-r", "3",
                               "--kv", "int8", "--ctx", "2048"])),
        ("prefix", lambda: bench_prefix.main(["--backend", "cuda", "-m", args.model])),
        ("prefill", lambda: profile_prefill.main(["-m", args.model, "--sizes", args.prefill_sizes,
                                                  "--start", args.prefill_start,
                                                  "--json", str(out / "profile_prefill.json")])),
        ("decode", lambda: profile_decode.main(["-m", args.model, "--json", str(out / "profile_decode.json")])),
    ]
    rc = 0
    for name, run in steps:
        if name in skip:
            continue
        t0 = time.perf_counter()
        print(f"\n===== {name}", flush=True)
        try:
            rc |= int(run() or 0)
        except Exception as exc:          # keep going: the other measurements still count
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            rc |= 1
        gc.collect()
        print(f"===== {name} took {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
