"""Progress bars for the command lines (``reshape``, ``resilient``): long work shows progress.

Owns one helper: a byte-counting rich progress bar on stderr, transient (it leaves no trace once
done), or nothing at all where output is for scripts (``--json``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

__all__ = ["byte_progress"]


@contextmanager
def byte_progress(
    total: int, label: str, *, enabled: bool = True, console: Console | None = None
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``: ``n`` more of ``total`` bytes done, shown on ``console`` (stderr by
    default) while the block runs; a no-op where not ``enabled``."""
    if not enabled:
        yield lambda n: None
        return
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console or Console(stderr=True, soft_wrap=True, highlight=False),
        transient=True,
    ) as prog:
        task = prog.add_task(label, total=total)
        yield lambda n: prog.advance(task, n)
