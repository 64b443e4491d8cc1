"""Tokenizer speed: construction from GGUF metadata and encode time for 10 kB and 1 MB texts.

    python tools/bench_tokenizer.py -m /tmp/models/gemma-3-270m-q4_k_m.gguf [--kinds prose,code]

Texts (each repeated to the size): prose (this repository's docs), code (this repository's
Python), CJK (a short Chinese / Japanese / Korean paragraph), base64 of random bytes, a run of
one letter. Reports CPU seconds of this process (`time.process_time`, steady on
a shared machine) and wall seconds; the first encode of a SentencePiece model also builds its
pair table, reported separately. Checks that every text decodes back before timing it.
"""
from __future__ import annotations

import argparse
import base64
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def texts() -> dict[str, str]:
    prose = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    code = "".join(p.read_text() for p in sorted((ROOT / "engine").glob("*.py")))
    cjk = ("智能家居助手可以帮助你控制灯光、调节温度、播放音乐，还可以提醒你每天的日程安排。"
           "如果你想在晚上七点半打开客厅的灯，只需要说一句话就可以了。今天天气晴朗，最高气温二十五度。\n"
           "スマートホームのアシスタントは、照明をつけたり、エアコンの温度を調整したりできます。"
           "明日の朝七時にアラームを設定してください。\n"
           "스마트 홈 비서는 조명을 켜고 온도를 조절할 수 있습니다. 내일 아침 일곱 시에 알람을 맞춰 주세요.\n")
    b64 = base64.b64encode(random.Random(0).randbytes(800_000)).decode()
    return {"prose": prose, "code": code, "cjk": cjk, "base64": b64, "one-letter": "a"}


def main(argv=None) -> int:
    from genie_rt.engine.gguf_file import open_gguf
    from genie_rt.engine.tokenizer import Tokenizer
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--kinds", default="prose,code,cjk,base64,one-letter")
    ap.add_argument("--sizes", default="10000,1000000")
    args = ap.parse_args(argv)
    meta = open_gguf(args.model).metadata
    best = None
    for _ in range(3):
        c0, w0 = time.process_time(), time.perf_counter()
        tok = Tokenizer.from_gguf_metadata(meta)
        c1, w1 = time.process_time(), time.perf_counter()
        best = min(best or (9e9, 9e9), (c1 - c0, w1 - w0))
    print(f"{args.model.name}: {tok.vocab_size} tokens, model {tok.model}; construction "
          f"{best[0]:.3f} s CPU ({best[1]:.3f} s wall), best of 3")
    model = getattr(tok, "_model", None)
    if hasattr(model, "_pair_table"):
        c0 = time.process_time()
        model._pair_table()
        print(f"  pair table (built by the first long text): {time.process_time() - c0:.3f} s CPU")
    sources = texts()
    for kind in args.kinds.split(","):
        src = sources[kind]
        for size in map(int, args.sizes.split(",")):
            text = (src * (size // len(src) + 1))[:size]
            if hasattr(model, "_memo"):
                model._memo.clear()           # a cold memo: the text is new to the tokenizer
            c0, w0 = time.process_time(), time.perf_counter()
            ids = tok.encode(text)
            c1, w1 = time.process_time(), time.perf_counter()
            back = text.replace("\u2581", " ") if tok.model == "llama" else text   # "▁" reads as a space
            assert tok.decode(ids) == (" " + back if tok.add_space_prefix else back), kind
            print(f"  {kind:10s} {size:>9,d} chars: {c1 - c0:7.3f} s CPU ({w1 - w0:6.2f} s wall), "
                  f"{len(ids):>8,d} ids", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
