#!/usr/bin/env python3
"""A `llama-server` stand-in for llama.cpp's server tests: it translates only launch options
and then becomes `genie-rt serve` (os.execv, so the tests' SIGTERM reaches our server).

- Where the model comes from (--model, --hf-repo, --hf-file, --model-url, -hf, --offline) is
  replaced by our fixture model (tests/fixtures/qwen3-micro-q4km.gguf, or $GENIE_TEST_MODEL)
  on `--backend cpu`: llama.cpp's test models are downloaded from a hub, ours ships with the
  repository.
- A chat-template path relative to the tests' folder is made absolute (the tests run there).
- Every other option is passed to `genie-rt serve` unchanged: the flags people copy from
  llama-server scripts are genie-rt's own (server/cli_args.py); one it does not know is its
  clear error, and the test that needed it fails at start-up, as it should.

Deliberately not here: any change of behaviour. What the tests see is what `genie-rt serve`
does with those flags.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "qwen3-micro-q4km.gguf"

MODEL_SOURCE_WITH_VALUE = {"-m", "--model", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"}
MODEL_SOURCE_FLAGS = {"--offline"}
PATH_OPTIONS = {"--chat-template-file", "--slot-save-path", "--api-key-file"}


def translate(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in MODEL_SOURCE_WITH_VALUE:
            i += 2
            continue
        if a in MODEL_SOURCE_FLAGS:
            i += 1
            continue
        if a in PATH_OPTIONS and i + 1 < len(argv):
            out += [a, os.path.abspath(argv[i + 1])]
            i += 2
            continue
        out.append(a)
        i += 1
    model = os.environ.get("GENIE_TEST_MODEL") or str(FIXTURE)
    return ["serve", "-m", model, "--backend", "cpu", *out]


def main() -> None:
    args = [sys.executable, "-m", "genie_rt.engine.cli", *translate(sys.argv[1:])]
    sys.stdout.write("fake_llama_server: " + " ".join(args) + "\n")
    sys.stdout.flush()
    os.execv(sys.executable, args)


if __name__ == "__main__":
    main()
