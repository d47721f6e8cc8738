"""Server-sent events as the HTTP routes stream them: the one encoder (the ingress) and the one
parser (clients, load generators, tests)."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

DONE = "[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"


def encode(obj: Any) -> bytes:
    """One event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n".encode()


def events(lines: Iterable[bytes | str]) -> Iterator[Any]:
    """The events of a stream read line by line (`requests`' `iter_lines`): each `data:` payload
    parsed from JSON, then `DONE` for the closing `[DONE]`, after which nothing more is read.
    Other lines (blank separators, comments) are skipped. Keep a reference while reading part of
    a stream: a dropped generator closes `lines`, and with it (for `requests`) the connection."""
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else line
        if not text.startswith("data: "):
            continue
        data = text[len("data: "):]
        if data == DONE:
            yield DONE
            return
        yield json.loads(data)
