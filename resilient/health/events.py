"""The run's event log: JSON lines appended by every rank (verdicts, stacks, saves, restarts)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["EventLog", "default_event_log"]


class EventLog:
    """Append-only JSON lines.  Each event is one ``write`` on an O_APPEND descriptor, so lines
    from several processes never interleave."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        # reentrant: the SIGTERM handler (Run) writes from the main thread, which the signal may
        # have interrupted inside a write; a plain lock deadlocked that rank until torchrun's
        # SIGKILL 30 s later
        self._lock = threading.RLock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        if not self.path or not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def default_event_log(checkpoint_url: str | None) -> str | None:
    """``events.jsonl`` next to the checkpoints when they are on a local disk; else none."""
    if checkpoint_url is None:
        return None
    if "://" not in checkpoint_url or checkpoint_url.startswith("file://"):
        return os.path.join(checkpoint_url.removeprefix("file://"), "events.jsonl")
    return None
