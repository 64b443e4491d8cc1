"""`genie-rt kv list|show|rm|clear --kv-cache-dir DIR`: inspect and manage conversation caches.

    list        one line per conversation: id, tokens, KV dtype, size, last used
    show ID     the header, and whether header and body checksums hold
    rm ID       delete one conversation's cache
    clear       delete every conversation's cache (prints how many)

Read-only commands never modify or delete a file (an invalid one is reported, and is
deleted the next time a request loads it); none of them creates the folder. The model
is not loaded, so `show` cannot tell whether a file belongs to a given model; the
engine checks that when a request loads it.
"""
from __future__ import annotations

import os
import sys
import time

from .kvfile import KVFileError, read_header
from .persist import InvalidConversationId, KVStore


def _nofollow(path, flags):
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _list(store: KVStore) -> int:
    entries = store.entries()[::-1]          # most recently used first
    if not entries:
        missing = "" if store.folder.is_dir() else " (the folder does not exist yet)"
        print(f"no conversation caches in {store.folder}{missing}")
        return 0
    print(f"{'ID':<32} {'TOKENS':>8} {'KV':<5} {'SIZE':>10}  LAST USED")
    for e in entries:
        try:
            with open(e.path, "rb", buffering=0, opener=_nofollow) as f:
                meta = read_header(f, e.size)
            tokens, dtype = str(meta.n_positions), meta.kv_dtype
        except (KVFileError, OSError) as exc:
            tokens, dtype = "-", f"invalid ({exc})"
        print(f"{e.id:<32} {tokens:>8} {dtype:<5} {_size(e.size):>10}  {_when(e.mtime)}")
    total = sum(e.size for e in entries)
    print(f"{len(entries)} conversation(s), {_size(total)} of a {_size(store.budget_bytes)} budget")
    return 0


def _show(store: KVStore, cid: str) -> int:
    meta, verdict = store.inspect(cid)
    path = store.path_for(cid)
    print(f"file:         {path}")
    if meta is not None:
        shape = f"{meta.n_layers} layers x {meta.n_kv_heads} kv heads x {meta.head_dim}"
        print(f"format:       version {meta.version}, header {meta.header_bytes} bytes, "
              f"body {meta.body_bytes} bytes")
        print(f"model:        {meta.model}")
        print(f"fingerprint:  {meta.fingerprint.hex()}")
        print(f"KV:           {meta.kv_dtype}, {shape}, {meta.n_positions} positions")
        print(f"created:      {_when(meta.created)}")
        print(f"last used:    {_when(path.stat().st_mtime)}")
        print("layout:       " + ", ".join(f"{n} {d}{list(s)}" for n, d, s in meta.layout()))
        print(f"body digest:  {meta.body_digest.hex()}")
    print(f"validation:   {verdict}")
    return 0 if verdict.startswith("ok") else 1


def run_kv_command(args) -> int:
    """Entry point of `genie-rt kv` (args.action, args.id, args.kv_cache_dir)."""
    try:
        store = KVStore(args.kv_cache_dir, create=False)
        if args.action == "list":
            return _list(store)
        if args.action == "clear":
            n = store.clear()
            print(f"removed {n} conversation cache(s) from {store.folder}")
            return 0
        if args.action in ("show", "rm"):
            if args.id is None:
                print(f"genie-rt kv {args.action}: error: give a conversation id", file=sys.stderr)
                return 1
            if args.action == "show":
                return _show(store, args.id)
            if store.remove(args.id):
                print(f"removed {args.id}")
                return 0
            print(f"genie-rt kv rm: no cache for conversation '{args.id}' in {store.folder}", file=sys.stderr)
            return 1
        print(f"genie-rt kv: error: unknown action '{args.action}' (list, show, rm, clear)", file=sys.stderr)
        return 1
    except InvalidConversationId as exc:
        print(f"genie-rt kv {args.action}: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"genie-rt kv {args.action}: error: {exc}", file=sys.stderr)
        return 1
