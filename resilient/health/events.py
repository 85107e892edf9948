"""The run's event log: JSON lines appended by every rank (verdicts, stacks, saves, restarts)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

__all__ = ["EventLog", "default_event_log"]

log = logging.getLogger(__name__)


class EventLog:
    """Append-only JSON lines.  Each event is one ``write`` on an O_APPEND descriptor, so lines
    from several processes never interleave."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        # reentrant: the SIGTERM handler (Run) writes from the main thread, which the signal may
        # have interrupted inside a write; a plain lock deadlocked that rank until torchrun's
        # SIGKILL 30 s later
        self._lock = threading.RLock()
        self.failed = 0  # events dropped since the log last took one
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        """Append one event.  Best effort: a log that cannot be written (a full disk, a removed
        directory) is warned about once, never raised, so that nothing a verdict or a save does
        after it is skipped (a frozen rank left unkilled, the job waiting in a collective)."""
        if not self.path:
            return
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            except OSError as e:
                self.failed += 1
                if self.failed == 1:
                    log.warning(
                        "cannot write the event log %s (%s); events are dropped until it can "
                        "be written again (free space, or point event_log elsewhere)",
                        self.path,
                        e,
                    )
            else:
                if self.failed:
                    log.warning(
                        "the event log %s is written again; %d events were dropped",
                        self.path,
                        self.failed,
                    )
                    self.failed = 0

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
