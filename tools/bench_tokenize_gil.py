"""How long a long text's tokenization holds up the other threads of the process (the
server's event loop): a thread ticking every 5 ms measures its longest stall while another
thread encodes, once through `tokenizers`' encode (holds the GIL) and once through
Tokenizer.encode (encode_batch for long texts: releases it). The two id lists are compared
first. The fixture model's vocabulary by default. A SentencePiece vocabulary (Gemma) has one
path, pure Python that hands the GIL over every switch interval: only it is measured.

    python tools/bench_tokenize_gil.py [-m MODEL.gguf] [--mb 4.3]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "engine" / "data" / "qwen3-micro-q4km.gguf"


def longest_stall(work) -> tuple[float, float]:
    """(seconds `work` took on its own thread, longest gap of a 5 ms ticker meanwhile)."""
    gaps, done = [0.0], threading.Event()

    def tick():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    took = time.perf_counter() - t0
    done.set()
    ticker.join()
    return took, max(gaps)


def main(argv=None) -> int:
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.engine.tokenizer import Tokenizer
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--mb", type=float, default=4.3, help="text size in MB (default 4.3)")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_gguf_metadata(open_gguf(args.model).metadata)
    unit = "turn the kitchen lights down please "
    text = unit * max(1, int(args.mb * 1e6 / len(unit)))
    ids = tok.encode(text)
    if tok.model == "llama":
        took, stall = longest_stall(lambda: tok.encode(text))
        print(f"{len(text) / 1e6:.1f} MB, {len(ids)} ids; Tokenizer.encode (SentencePiece) "
              f"{took:6.2f} s, longest stall of other threads {stall:6.3f} s")
        return 0
    if tok._model.hf.encode(text, add_special_tokens=False).ids != ids:
        print("FAILED: the two paths give different ids", file=sys.stderr)
        return 1
    print(f"{len(text) / 1e6:.1f} MB, {len(ids)} ids, the same on both paths")
    for label, work in (("tokenizers encode (GIL held)", lambda: tok._model.hf.encode(text, add_special_tokens=False)),
                        ("Tokenizer.encode (GIL released)", lambda: tok.encode(text))):
        took, stall = longest_stall(work)
        print(f"{label:<34} {took:6.2f} s, longest stall of other threads {stall:6.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
