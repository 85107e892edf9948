"""Which committed steps to keep, and removing the rest safely.

Owns the retention rule (keep the newest ``keep_last`` committed steps plus every step that is a
multiple of ``keep_every``; never the newest committed step) and garbage collection of step
directories that never committed.  Only the coordinator runs it, after a new manifest is durable.
A step is uncommitted by deleting its manifest first, so a crash mid-delete leaves a directory
readers ignore and the next collection removes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from resilient.checkpoint.format import MANIFEST_NAME, parse_step_dir, step_dir_name
from resilient.checkpoint.storage import Storage

__all__ = ["steps_to_delete", "committed_steps", "apply_retention"]

log = logging.getLogger(__name__)


def steps_to_delete(committed: Iterable[int], keep_last: int, keep_every: int | None) -> list[int]:
    """Pure: the committed steps that retention removes."""
    steps = sorted(set(committed))
    if not steps:
        return []
    keep = set(steps[-max(keep_last, 1) :])  # the newest is always among them
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def step_dirs(storage: Storage) -> dict[int, str]:
    out = {}
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is not None:
            out[step] = name
    return out


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists, ascending (a directory without one does not exist to readers)."""
    return sorted(
        s for s, name in step_dirs(storage).items() if storage.exists(f"{name}/{MANIFEST_NAME}")
    )


def apply_retention(
    storage: Storage, keep_last: int, keep_every: int | None, *, in_progress: int | None = None
) -> list[int]:
    """Delete steps retention drops and uncommitted step directories; returns what was removed."""
    dirs = step_dirs(storage)
    committed = [s for s, name in dirs.items() if storage.exists(f"{name}/{MANIFEST_NAME}")]
    removed = []
    for step in steps_to_delete(committed, keep_last, keep_every):
        name = step_dir_name(step)
        storage.remove(f"{name}/{MANIFEST_NAME}")  # uncommit first
        storage.remove_tree(name)
        removed.append(step)
    for step, name in dirs.items():
        if step not in committed and step != in_progress:
            storage.remove_tree(name)  # a save that never committed
            removed.append(step)
    if removed:
        log.info("retention removed steps %s from %s", sorted(removed), storage.url)
    return sorted(removed)
