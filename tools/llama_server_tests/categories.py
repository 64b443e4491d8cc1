"""Which llama.cpp server tests check behaviour a drop-in must have, and which cannot pass here.

`classify(nodeid)` -> (category, why). The first matching rule wins; a test no rule names is
`real`. Rules match a test file, or a test name inside one (before its parameters), with
fnmatch patterns. Keep the reason with each rule: a rule without one hides a difference.
"""
from __future__ import annotations

import fnmatch

MODEL_TEXT = "model-text"
UNSUPPORTED = "unsupported"
REAL = "real"

# (pattern on "file::test", category, why)
RULES: list[tuple[str, str, str]] = [
]


def classify(nodeid: str) -> tuple[str, str]:
    path, _, rest = nodeid.partition("::")
    name = rest.split("[", 1)[0]
    key = f"{path.rsplit('/', 1)[-1]}::{name}"
    for pattern, category, why in RULES:
        if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(nodeid, pattern):
            return category, why
    return REAL, ""
