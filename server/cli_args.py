"""`genie-rt serve`'s command line: our options, and the llama-server flags people copy from
their scripts, read into a `ServerSettings` (state.py) plus the engine's config.

    add_serve_parser(subparsers, add_model_args, engine_config)   # engine/cli.py registers it

What each llama-server flag means here (docs/server.md has the table):
- the same thing: -m, --host, --port, -c/--ctx-size, -n/--n-predict, --temp, --top-k, --top-p,
  --min-p, --seed, --repeat-penalty, --repeat-last-n, --presence-penalty, --frequency-penalty
  (the defaults of requests that leave a field out), -a/--alias (comma separated: several
  names), --tags, --api-key (comma separated: several keys), --api-key-file (one key a line),
  --chat-template NAME|JINJA, --chat-template-file, --reasoning on|off|auto, --reasoning-budget
  -1|0, --reasoning-format, --slots/--no-slots, --slot-save-path, --no-webui/--no-ui, --metrics,
  --cors-origins, -ctk/-ctv (f32, f16, q8_0 -> our int8), -ub/--ubatch-size (prefill chunk),
  -b/--batch-size (the logical batch: a streamed request with return_progress gets one
  prompt_progress chunk per batch);
- accepted with a different meaning: -np/--parallel N (N slots are reported and each gets
  ctx/N positions as in llama-server - the whole context with --kv-unified - but one engine
  worker serves them one after another);
  --jinja/--no-jinja (templates are always Jinja);
- accepted and ignored (llama.cpp's own tuning; a log line says so): -t, -tb, -ngl, -fa,
  -cb/-nocb, --swa-full, --mlock, --no-mmap, --cache-ram, --no-cache-idle-slots,
  --no-warmup, --log-*, -bs/--backend-sampling (the CUDA back-end samples on the device anyway);
- as llama-server, a long option may be spelled with underscores (--backend_sampling,
  --ctx_size): `dash_long_options` rewrites the ones that name an option;
- refused with a sentence saying why (the feature does not exist here): --embedding,
  --reranking, --lora, --mmproj, --model-draft, --context-shift, ... Any other unknown flag is
  argparse's error ("unrecognized arguments"), exit status 2.

Deliberately not here: starting the server (app.serve) or loading the model.
"""
from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

log = logging.getLogger("genie_rt.server")

# llama.cpp's KV cache type names -> ours
CACHE_TYPES = {"f32": "f32", "f16": "f16", "q8_0": "int8", "int8": "int8"}

IGNORED_WITH_VALUE = ["-tb", "--threads-batch", "-ngl", "--gpu-layers", "--n-gpu-layers",
                      "--cache-ram", "-cram", "--log-file", "--log-verbosity", "-lv",
                      "-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu", "--numa",
                      "--timeout", "--threads-http", "--keep", "--n-keep"]
IGNORED_FLAGS = ["-cb", "--cont-batching", "-nocb", "--no-cont-batching", "--no-kv-unified",
                 "--swa-full", "--mlock", "--no-mmap", "--mmap", "--no-cache-idle-slots", "--no-warmup",
                 "--log-disable", "--log-colors", "--log-prefix", "--log-timestamps", "--no-perf",
                 "--no-context-shift", "--cache-reuse-disable", "--offline",
                 # sampling on the device: what the CUDA back-end does anyway (engine/gpu_sampling.py)
                 "-bs", "--backend-sampling"]
UNSUPPORTED = {
    "--embedding": "embeddings are not supported (a generation-only engine)",
    "--embeddings": "embeddings are not supported (a generation-only engine)",
    "--reranking": "reranking is not supported",
    "--rerank": "reranking is not supported",
    "--pooling": "embeddings are not supported (a generation-only engine)",
    "--lora": "LoRA adapters are not supported",
    "--lora-scaled": "LoRA adapters are not supported",
    "--mmproj": "images and audio are not supported (a text-only engine)",
    "--mmproj-url": "images and audio are not supported (a text-only engine)",
    "--media-path": "images and audio are not supported (a text-only engine)",
    "-md": "speculative decoding is not supported",
    "--model-draft": "speculative decoding is not supported",
    "--spec-type": "speculative decoding is not supported",
    "--spec-draft-n-max": "speculative decoding is not supported",
    "--spec-draft-n-min": "speculative decoding is not supported",
    "--context-shift": "context shift is not supported: a generation stops at the end of the context "
                       "(truncated: true in /completion)",
    "--grp-attn-n": "self-extend (group attention) is not supported",
    "--grp-attn-w": "self-extend (group attention) is not supported",
    "--models-dir": "the multi-model router is not supported: one model per server",
    "--models-preset": "the multi-model router is not supported: one model per server",
    "--models-max": "the multi-model router is not supported: one model per server",
    "--sleep-idle-seconds": "sleeping (unloading the model when idle) is not supported",
    "--tools": "built-in server tools are not supported",
    "--mcp-servers-config": "MCP servers are not supported",
    "--mcp-servers-json": "MCP servers are not supported",
    "--ui-mcp-proxy": "the web UI's MCP proxy is not supported",
    "--hf-repo": "models are not downloaded: give a local GGUF file with -m",
    "-hf": "models are not downloaded: give a local GGUF file with -m",
    "--model-url": "models are not downloaded: give a local GGUF file with -m",
}


def dash_long_options(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with `--foo_bar` (and `--foo_bar=value`) read as `--foo-bar` where that names an option
    of the parser or of one of its subcommands, as llama-server's argument parser (common/arg.cpp)
    reads every long option. Anything else, values included, is left as it is."""
    known: set[str] = set()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            known.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name.startswith("--") and "_" in name and name not in known and name.replace("_", "-") in known:
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        kwargs["nargs"] = "?"
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {UNSUPPORTED[option_string]}")


class _Ignored(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        getattr(namespace, "ignored_flags").append(option_string)


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def _add_llama_server_args(p: argparse.ArgumentParser) -> None:
    p.set_defaults(ignored_flags=[])
    p.add_argument("--ctx-size", dest="ctx", type=int, default=None, help="same as -c/--ctx")
    p.add_argument("-a", "--alias", default=None,
                   help="model name(s) reported by the API; comma separated for several (the first sorted is the id)")
    p.add_argument("--tags", default=None, help="comma-separated tags reported by /v1/models")
    # request defaults (llama-server's common params)
    p.add_argument("-n", "--n-predict", "--max-tokens", dest="n_predict", type=int, default=-1,
                   help="largest number of tokens a request may generate; -1 = no limit (default)")
    p.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8, help="default 0.8")
    p.add_argument("--top-k", type=int, default=40, help="default 40; <= 0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    p.add_argument("--min-p", type=float, default=0.05, help="default 0.05")
    p.add_argument("-s", "--seed", type=int, default=-1, help="default seed of requests; -1 = random (default)")
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    # templates and reasoning
    p.add_argument("--jinja", action="store_true", help="accepted: templates are always Jinja")
    p.add_argument("--no-jinja", action="store_true", help="accepted: templates are always Jinja")
    p.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help="'chatml', a template named in the GGUF (tokenizer.chat_template.NAME), or Jinja source")
    p.add_argument("--chat-template-file", default=None, metavar="PATH", help="Jinja chat template file")
    p.add_argument("--reasoning", choices=("on", "off", "auto"), default=None,
                   help="thinking: on, off, auto = the template's default (default: off)")
    p.add_argument("--reasoning-budget", type=int, default=None, help="-1 = unrestricted, 0 = thinking off")
    p.add_argument("--reasoning-format", choices=("auto", "deepseek", "deepseek-legacy", "none"), default=None,
                   help="default reasoning_format of requests (none: <think> stays in content)")
    # slots, parallelism
    p.add_argument("-np", "--parallel", type=_positive_int("--parallel"), default=1,
                   help="slots reported; each gets ctx/N positions; one engine worker serves them in turn")
    p.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="with -np: every slot may use the whole context (one KV pool here in any case)")
    p.add_argument("--slots", dest="slots", action="store_true", default=True, help="GET /slots on (default)")
    p.add_argument("--no-slots", dest="slots", action="store_false", help="GET /slots answers 501")
    p.add_argument("--slot-save-path", default=None, metavar="DIR", help="folder of POST /slots/0?action=save files")
    # KV types and batches
    p.add_argument("-ctk", "--cache-type-k", default=None, choices=sorted(CACHE_TYPES))
    p.add_argument("-ctv", "--cache-type-v", default=None, choices=sorted(CACHE_TYPES))
    p.add_argument("-ub", "--ubatch-size", type=_positive_int("--ubatch-size"), default=None,
                   help="same as --prefill-chunk")
    p.add_argument("-b", "--batch-size", type=_positive_int("--batch-size"), default=None,
                   help="prompt tokens per prompt_progress report of a request with return_progress "
                        "(default 2048, as llama-server's logical batch)")
    # HTTP
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="file of API keys, one per line")
    p.add_argument("--no-webui", "--no-ui", dest="webui", action="store_false", default=True,
                   help="no chat page at /")
    p.add_argument("--cors-origins", default=None, metavar="LIST",
                   help="comma-separated allowed origins; 'localhost' = any loopback origin; default: any")
    p.add_argument("--metrics", action="store_true", default=False,
                   help="GET /metrics on (Prometheus text); without it /metrics answers 501, as llama-server")
    for flag in IGNORED_WITH_VALUE:
        p.add_argument(flag, action=_Ignored, nargs=1, dest="ignored_" + flag.lstrip("-").replace("-", "_"),
                       help=argparse.SUPPRESS)
    p.add_argument("-fa", "--flash-attn", action=_Ignored, nargs="?", dest="ignored_fa", help=argparse.SUPPRESS)
    for flag in IGNORED_FLAGS:
        p.add_argument(flag, action=_Ignored, nargs=0, dest="ignored_" + flag.lstrip("-").replace("-", "_"),
                       help=argparse.SUPPRESS)
    for flag in UNSUPPORTED:
        p.add_argument(flag, action=_Refuse, dest="refused_" + flag.lstrip("-").replace("-", "_"),
                       help=argparse.SUPPRESS)


def add_serve_parser(sub, add_model_args, engine_config) -> argparse.ArgumentParser:
    """Register `serve` on the CLI's subparsers. add_model_args and engine_config are engine/cli.py's
    shared model options and their EngineConfig builder."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (llama-server drop-in)")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=None, help="API key; comma separated for several")
    serve.add_argument("--max-queue", type=int, default=16)
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests get to finish on SIGTERM")
    serve.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, MiB (default 8)")
    _add_llama_server_args(serve)
    serve.set_defaults(func=lambda args: cmd_serve(args, engine_config))
    return serve


def _read_api_keys(args) -> list[str]:
    keys: list[str] = []
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without "
                             "one (an unset variable in `--api-key \"$KEY\"` would otherwise turn "
                             "authentication off)")
        keys += [k.strip() for k in args.api_key.split(",") if k.strip()]
    if args.api_key_file is not None:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {path}: cannot be read ({exc})") from None
        found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {path} holds no key (one key a line)")
        keys += found
    return keys


def check_serve_args(args) -> None:
    """Every value checked before minutes of loading; a ValueError names the flag."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise ValueError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if args.n_predict < -1:
        raise ValueError(f"-n/--n-predict must be >= 0, or -1 for no limit; got {args.n_predict}")
    if args.reasoning_budget is not None and args.reasoning_budget not in (-1, 0):
        raise ValueError(f"--reasoning-budget {args.reasoning_budget}: only -1 (unrestricted) and 0 (thinking "
                         "off) are supported; a token budget for thinking is not")
    if args.chat_template is not None and args.chat_template_file is not None:
        raise ValueError("--chat-template and --chat-template-file both given: use one")
    if args.chat_template_file is not None and not Path(args.chat_template_file).is_file():
        raise ValueError(f"--chat-template-file {args.chat_template_file}: no such file")
    for flag, v in (("--cache-type-k", args.cache_type_k), ("--cache-type-v", args.cache_type_v)):
        if v is not None and args.cache_type_k and args.cache_type_v and \
                CACHE_TYPES[args.cache_type_k] != CACHE_TYPES[args.cache_type_v]:
            raise ValueError(f"{flag}: K and V must have the same type here "
                             f"(got {args.cache_type_k} and {args.cache_type_v})")
    if args.slot_save_path is not None:
        d = Path(args.slot_save_path)
        if d.exists() and not d.is_dir():
            raise ValueError(f"--slot-save-path {d} is not a folder")
    from genie_rt.engine.sampling import SamplingParams
    try:
        SamplingParams(temperature=args.temp, top_p=args.top_p, min_p=args.min_p,
                       repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                       frequency_penalty=args.frequency_penalty).validate(1 << 30)
    except ValueError as exc:
        raise ValueError(f"sampling default: {exc}") from None


def apply_engine_overrides(args) -> None:
    """llama-server spellings of engine options, folded into the engine's own (before the config)."""
    kv = args.cache_type_k or args.cache_type_v
    if kv is not None:
        args.kv = CACHE_TYPES[kv]
    if args.ubatch_size is not None:
        args.prefill_chunk = args.ubatch_size
    if args.parallel > 1 and args.ctx is not None and not args.kv_unified:
        if args.ctx // args.parallel < 2:
            raise ValueError(f"--ctx {args.ctx} split over --parallel {args.parallel} slots leaves no room")
        args.ctx_total = args.ctx
        args.ctx = args.ctx // args.parallel   # llama-server: each slot has n_ctx / n_parallel


def cmd_serve(args, engine_config) -> int:
    from .app import serve
    from .state import ServerSettings
    check_serve_args(args)
    args.api_keys = _read_api_keys(args)
    apply_engine_overrides(args)
    if args.ignored_flags:
        log.info("llama-server flags accepted and ignored here: %s", " ".join(args.ignored_flags))
    ecfg = engine_config(args)
    from genie_rt.engine.cli import resolve_model_arg      # no -m: the built-in default model
    resolve_model_arg(args)
    return serve(args, ecfg, ServerSettings.from_args(args))
