"""`genie-rt chat` and the conversation side of `genie-rt run`: streamed replies in the terminal.

    genie-rt chat [-m MODEL] [--system TEXT] [--conversation ID]
        > Turn the kitchen lights down          a turn: the reply streams as it is generated
        > /reset                                forget the conversation (and its saved history)
        > /exit  (or Ctrl-D)                    end

    genie-rt run -p TEXT --conversation ID      one turn of conversation ID: the earlier turns
                                                are replayed through the chat template first

History: every turn keeps the earlier messages, so the reply has their context. With
--conversation ID the history is saved after each turn (engine/conversation.py, under
~/.cache/genie-rt/conversations) and the conversation's KV cache under --kv-cache-dir (default
~/.cache/genie-rt/kv), so a later `chat`/`run --conversation ID` continues where it stopped
without recomputing the context. A base model (no chat template) gets the plain transcript
template (engine/chat_fallback.py) and its reply ends at the next "User:" line.

Ctrl-C during a reply ends the program (exit status 130) without saving that turn.
"""
from __future__ import annotations

import sys

from .chat import split_reasoning


def sampling(args, engine):
    from .sampling import SamplingParams, requested_top_k
    return SamplingParams(temperature=args.temp, top_k=requested_top_k(args.top_k, engine.cfg.vocab_size),
                          top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)


def stream_reply(engine, prompt: list[int], args, stop: list[str], conversation_id: str | None = None,
                 out=None):
    """Generate, writing the text to `out` as it comes; the result (GenerationResult) at the end.
    Prints run's statistics line to stderr."""
    from .generate import Delta, Done, GenerationRequest
    out = out or sys.stdout
    max_tokens = None if args.max_tokens == -1 else args.max_tokens   # None: until EOS or the context ends
    req = GenerationRequest(prompt=prompt, params=sampling(args, engine), max_tokens=max_tokens, stop=stop,
                            conversation_id=conversation_id)
    result = None
    for event in engine.generate(req):
        if isinstance(event, Delta):
            out.write(event.text)
            out.flush()
        elif isinstance(event, Done):
            result = event.result
            out.write("\n")
            out.flush()
            r = result
            print(f"[{engine.backend.name}] prompt {r.n_prompt} tokens ({r.n_cached} reused) in "
                  f"{r.prompt_ms:.0f} ms ({r.prompt_per_second:.1f} tok/s); generated {r.n_generated} "
                  f"tokens at {r.gen_per_second:.1f} tok/s; finish: {r.finish_reason}", file=sys.stderr)
    return result


def chat_turn(engine, messages: list[dict], args, conversation_id: str | None) -> str:
    """One assistant reply to `messages` (streamed); its content (reasoning removed) is returned."""
    prompt = engine.chat_prompt(messages, enable_thinking=args.think)
    stop = list(args.stop) + [s for s in engine.template.stop_strings if s not in args.stop]
    result = stream_reply(engine, prompt, args, stop, conversation_id)
    return split_reasoning(result.text)[1].strip() if result is not None else ""


def _history(args) -> tuple[list[dict], object]:
    from .conversation import ConversationLog
    log = ConversationLog(args.conversation) if args.conversation else None
    messages = log.load() if log else []
    if args.system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": args.system})
    return messages, log


def run_conversation_turn(engine, args) -> int:
    """`run -p TEXT --conversation ID`: the earlier turns, this prompt, the reply; saved."""
    messages, log = _history(args)
    messages.append({"role": "user", "content": args.prompt})
    reply = chat_turn(engine, messages, args, args.conversation)
    log.save(messages + [{"role": "assistant", "content": reply}])
    return 0


def cmd_chat(args) -> int:
    from .cli import load_for_command
    engine = load_for_command(args)
    messages, log = _history(args)
    turns = sum(m["role"] == "user" for m in messages)
    err = sys.stderr
    print(f"chat with {engine.model_name}" + (f", conversation {args.conversation} ({turns} earlier turns)"
                                               if log else "") + "; /reset forgets it, /exit or Ctrl-D ends",
          file=err)
    if engine.template.is_plain:
        print("(a base model: it continues a plain User:/Assistant: transcript; expect rambling)", file=err)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = [m for m in messages[:1] if m["role"] == "system"]
            if log:
                log.clear()
            print("(conversation forgotten)", file=err)
            continue
        messages.append({"role": "user", "content": line})
        reply = chat_turn(engine, messages, args, args.conversation)
        messages.append({"role": "assistant", "content": reply})
        if log:
            log.save(messages)
    return 0


def add_chat_parser(sub, add_model_args, add_sampling_args) -> None:
    chat = sub.add_parser("chat", help="an interactive conversation in the terminal (history, streaming, /reset)")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--think", action="store_true", help="let a thinking model think (off by default)")
    chat.add_argument("--conversation", default=None, metavar="ID",
                      help="keep this conversation (history and KV cache) on disk and continue it next time")
    chat.set_defaults(func=cmd_chat)
