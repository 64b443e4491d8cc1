"""Time opening a GGUF file whose metadata carries a Qwen3-sized vocabulary: our reader
(engine/gguf_file.open_gguf) against the gguf package's GGUFReader, each in a fresh
process (peak memory is the process's).

    python tools/bench_gguf_open.py [--tokens 151936] [--merges 151387] [--keep PATH]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = """
import hashlib, resource, sys, time
path, which = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if which == "genie_rt":
    from genie_rt.engine.gguf_file import open_gguf
    meta = open_gguf(path).metadata
else:
    import gguf
    meta = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
dt = time.perf_counter() - t
digest = hashlib.sha256(repr(sorted((k, meta[k]) for k in meta)).encode()).hexdigest()[:16]
print(f"{which:<18} {dt:7.2f} s  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:6.0f} MB  "
      f"({len(meta['tokenizer.ggml.tokens'])} tokens, metadata digest {digest})")
"""


def write(path: Path, n_tokens: int, n_merges: int) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(n_tokens)])
    w.add_array("tokenizer.ggml.token_type", [1] * n_tokens)
    w.add_array("tokenizer.ggml.merges", [f"t{i} k{i}" for i in range(n_merges)])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=151936)
    ap.add_argument("--merges", type=int, default=151387)
    ap.add_argument("--keep", type=Path, default=None, help="write the file here and keep it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "vocab.gguf"
        write(path, args.tokens, args.merges)
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB, {args.tokens} tokens, {args.merges} merges")
        digests = set()
        for which in ("genie_rt", "gguf.GGUFReader"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), which], check=True,
                                 capture_output=True, text=True).stdout
            print(out, end="")
            digests.add(out.rsplit("digest ", 1)[1].rstrip(")\n"))
        if len(digests) != 1:
            print("FAILED: the two readers give different metadata", file=sys.stderr)
            return 1
        print("same metadata from both readers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
