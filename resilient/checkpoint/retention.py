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

__all__ = ["steps_to_delete", "committed_steps", "retire_steps", "delete_dirs"]

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


def retire_steps(
    storage: Storage, keep_last: int, keep_every: int | None, *, in_progress: int | None = None
) -> list[str]:
    """Uncommit the steps retention drops (their manifests go first, which is quick) and return
    the step directories to delete: those, and directories of saves that never committed.

    Readers stop seeing a retired step as soon as this returns; deleting its bytes
    (:func:`delete_dirs`) can happen later, off the critical path.
    """
    dirs = step_dirs(storage)
    committed = [s for s, name in dirs.items() if storage.exists(f"{name}/{MANIFEST_NAME}")]
    doomed = []
    for step in steps_to_delete(committed, keep_last, keep_every):
        storage.remove(f"{step_dir_name(step)}/{MANIFEST_NAME}")
        doomed.append(step_dir_name(step))
    doomed += [name for step, name in dirs.items() if step not in committed and step != in_progress]
    return sorted(doomed)


def delete_dirs(storage: Storage, names: Iterable[str]) -> None:
    for name in names:
        storage.remove_tree(name)
        log.info("removed %s", storage.display(name))
