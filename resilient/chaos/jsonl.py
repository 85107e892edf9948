"""Reading the JSON-lines files a run appends to (metrics, events, the storage record), where a
kill may have cut the last record mid-write.

The process that restarts appends its first record to the cut one's line, so a line that does
not parse is not simply dropped: its trailing complete record (the restart's, which tells of a
rollback) is recovered, and the cut head too where it happens to be complete.  Owns no files and
writes nothing; the harness tails the metrics file with it, the verifier reads whole files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "records_of_line"]


def records_of_line(line: str, key: str | None = None) -> list[dict[str, Any]]:
    """The records (JSON objects) one line holds: itself, or, for a record cut by a kill onto
    which the next attempt appended its own, the complete ones of the two; none for a line that
    holds no complete record.  ``key``: what every record of this file has (``step``, ``event``):
    objects without it are not records (a record cut just after one of its nested objects closed
    leaves that object parseable at the end of the line: never taken for a record)."""
    line = line.strip()
    if not line:
        return []
    whole = _object(line, key)
    if whole is not None:
        return [whole]
    # the leftmost '{"' after the start whose rest parses: the outermost trailing record (a
    # nested object's '{"' lies further right and parses alone, but is not the record)
    i = line.find('{"', 1)
    while i != -1:
        tail = _object(line[i:], key)
        if tail is not None:
            head = _object(line[:i], key)
            return [head, tail] if head is not None else [tail]
        i = line.find('{"', i + 1)
    return []


def read_jsonl(path: Path, key: str | None = None) -> list[dict[str, Any]]:
    """Every record in ``path`` (``[]`` where there is no such file); with ``key``, only objects
    that have it (see :func:`records_of_line`)."""
    if not path.exists():
        return []
    return [r for line in path.read_text().splitlines() for r in records_of_line(line, key)]


def _object(text: str, key: str | None = None) -> dict[str, Any] | None:
    try:
        x = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return x if isinstance(x, dict) and (key is None or key in x) else None
