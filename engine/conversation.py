"""A conversation's history on disk, for `genie-rt chat --conversation ID` and
`genie-rt run --conversation ID`: the messages of the earlier turns, replayed through the chat
template so the next reply has their context. (The KV cache of the same conversation, which
only saves recomputing that context, is kvcache/persist.py's, under --kv-cache-dir.)

    log = ConversationLog("kitchen")              # conversations_dir()/kitchen.json
    messages = log.load()                         # [] when new
    log.save(messages + [user, assistant])        # atomic: a crash leaves the old file or the new
    log.clear()                                   # /reset

File: JSON {"format": 1, "messages": [{"role": ..., "content": ...}, ...]}. A file that does not
read as that is refused with its path and what to do, never silently replaced.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from genie_rt.kvcache.persist import validate_conversation_id

from .paths import conversations_dir

FORMAT = 1
ROLES = ("system", "user", "assistant")


class ConversationLog:
    def __init__(self, cid: str, folder: str | os.PathLike | None = None):
        self.id = validate_conversation_id(cid)
        self.folder = Path(folder) if folder is not None else conversations_dir()
        self.path = self.folder / f"{cid}.json"

    def load(self) -> list[dict]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"conversation {self.id}: {self.path} cannot be read ({exc})") from None
        fix = "; delete it (or use another --conversation id) to start over"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"conversation {self.id}: {self.path} is not JSON ({exc}){fix}") from None
        messages = data.get("messages") if isinstance(data, dict) and data.get("format") == FORMAT else None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"conversation {self.id}: {self.path} is not a format-{FORMAT} history "
                             f"(a list of messages with role and text content){fix}")
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def save(self, messages: list[dict]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"format": FORMAT, "messages": messages}, ensure_ascii=False, indent=1),
                           encoding="utf-8")
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
