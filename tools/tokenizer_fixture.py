"""Make tests/fixtures/tokenizer-llamacpp-ids.npz: llama.cpp's token ids for the corpus.

For every model given and every string of tools/tokenizer_corpus.py, runs llama.cpp's
`llama-tokenize` twice - raw text (`--no-bos --no-parse-special`: add_special=False,
parse_special=False) and a prompt (BOS/EOS as the GGUF asks, special tokens parsed) - on the
string written byte for byte to a file (`-f`, `--no-escape`), and stores the strings, the ids
and a fingerprint of each vocabulary (tests skip a model file whose vocabulary differs).

    python tools/tokenizer_fixture.py --llama-tokenize /path/to/llama-tokenize -j 2 \\
        gemma-3-270m=/tmp/models/gemma-3-270m-q4_k_m.gguf \\
        smollm2-135m=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf ...

llama-tokenize loads the vocabulary on every call (about 0.7 s of CPU for Gemma's 262,144
tokens), so a full run is a few thousand processes: use -j.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_corpus import corpus  # noqa: E402

MODES = {"raw": ["--no-bos", "--no-parse-special"], "prompt": []}   # mode -> llama-tokenize flags


def vocab_fingerprint(meta: dict) -> str:
    """sha256 of everything that decides the ids: model, pre, tokens, types, scores, merges and
    the add_*/space-prefix flags (the same vocabulary in another quantization matches)."""
    import hashlib
    h = hashlib.sha256()
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                "tokenizer.ggml.add_space_prefix"):
        value = meta.get(key)
        if isinstance(value, list) and value and isinstance(value[0], float):
            value = np.asarray(value, np.float32).tobytes().hex()
        h.update(json.dumps([key, value], ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def run_one(exe: str, model: str, text: str, flags: list[str], tmpdir: str) -> list[int]:
    fd, path = tempfile.mkstemp(dir=tmpdir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        cmd = [exe, "-m", model, "-f", path, "--ids", "--log-disable", "--no-escape", *flags]
        out = subprocess.run(cmd, capture_output=True, check=True).stdout.decode("utf-8")
    finally:
        os.unlink(path)
    line = [ln for ln in out.splitlines() if ln.startswith("[")][-1]
    return list(ast.literal_eval(line))


def main(argv=None) -> int:
    from genie_rt.engine.gguf_file import open_gguf
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="name=path.gguf")
    ap.add_argument("--llama-tokenize", required=True, help="path of llama.cpp's llama-tokenize")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("-o", "--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "tests/fixtures/tokenizer-llamacpp-ids.npz")
    ap.add_argument("--llamacpp-version", default="", help="recorded in the fixture (e.g. the build)")
    args = ap.parse_args(argv)
    strings = corpus()
    arrays: dict[str, np.ndarray] = {}
    info = {"strings": strings, "modes": MODES, "models": {},
            "made": datetime.date.today().isoformat(), "llama_cpp": args.llamacpp_version}
    with tempfile.TemporaryDirectory() as tmpdir, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for spec in args.models:
            name, _, path = spec.partition("=")
            meta = open_gguf(path).metadata
            info["models"][name] = {"file": Path(path).name, "vocab_sha256": vocab_fingerprint(meta)}
            for mode, flags in MODES.items():
                ids = list(pool.map(lambda s: run_one(args.llama_tokenize, path, s, flags, tmpdir), strings))
                arrays[f"{name}/{mode}/ids"] = np.concatenate([np.asarray(i, np.int32) for i in ids])
                arrays[f"{name}/{mode}/offsets"] = np.cumsum([0] + [len(i) for i in ids]).astype(np.int32)
                print(f"{name} {mode}: {len(strings)} strings, {sum(map(len, ids))} ids", flush=True)
    np.savez_compressed(args.out, info=np.array(json.dumps(info, ensure_ascii=False)), **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
