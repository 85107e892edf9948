"""Which committed steps to keep, and removing the rest safely.

Owns the retention rule (:func:`steps_to_delete`) and garbage collection of step directories that
never committed.  Only the coordinator of the job that holds the writer lease runs it, after a new
manifest is durable.  A step is uncommitted by deleting its manifest first, so a crash mid-delete
leaves a directory readers ignore and the next collection removes.  A step whose manifest does not
parse (damaged, see catalog.py) is never counted and never deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from resilient.checkpoint.catalog import Catalog, StepInfo, line_of, scan
from resilient.checkpoint.format import MANIFEST_NAME, parse_step_dir
from resilient.checkpoint.storage import Storage

__all__ = ["steps_to_delete", "committed_steps", "retire_steps", "delete_dirs", "step_dirs"]

log = logging.getLogger(__name__)


def steps_to_delete(
    commits: Sequence[int],
    keep_last: int,
    keep_every: int | None,
    parents: Mapping[int, Any] | None = None,
    seqs: Sequence[int] | None = None,
) -> list[int]:
    """Pure: the committed steps retention removes, given step numbers in commit order (oldest
    commit first; for steps that were never rolled back that is ascending order), the parents
    the commits record and their commit_seq (see ``line_of``).

    Kept: the newest ``keep_last`` commits, whatever their branch; the newest ``keep_last`` steps
    of the current line (so the step a rollback resumed from stays until the new line has
    ``keep_last`` newer commits); and every multiple of ``keep_every``.  Steps of an abandoned
    branch are ordinary older commits: they go once ``keep_last`` newer commits exist.  The
    newest commit is always kept.
    """
    commits = list(commits)
    if not commits:
        return []
    n = max(keep_last, 1)
    keep = set(commits[-n:]) | set(line_of(commits, parents, seqs)[:n])
    if keep_every:
        keep |= {s for s in commits if s % keep_every == 0}
    return sorted({s for s in commits if s not in keep})


def step_dirs(storage: Storage) -> dict[int, str]:
    out = {}
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is not None:
            out[step] = name
    return out


def committed_steps(storage: Storage) -> list[int]:
    """Committed steps by number, ascending (a directory without a manifest that parses does not
    exist to readers)."""
    return scan(storage).steps()


class Sweep:
    """Which uncommitted step directories a writer may delete at its commits: one of its own
    saves that failed (``began``), or one that was already there, uncommitted, at its previous
    commit (so a directory another writer is filling right now, should two ever write at once,
    is never deleted under it).  Pass it as ``collect``; call ``committed()`` after each commit."""

    def __init__(self) -> None:
        self.began: set[str] = set()  # step directories this writer's saves created
        self._seen: set[str] = set()  # uncommitted at the previous commit
        self._next: set[str] = set()

    def __call__(self, info: StepInfo) -> bool:
        self._next.add(info.dir)
        return info.dir in self.began or info.dir in self._seen

    def committed(self) -> None:
        self._seen, self._next = self._next, set()


def retire_steps(
    storage: Storage,
    keep_last: int,
    keep_every: int | None,
    *,
    in_progress: int | None = None,
    catalog: Catalog | None = None,
    collect: Callable[[StepInfo], bool] | None = None,
    check: Callable[[], None] | None = None,
) -> list[str]:
    """Uncommit the steps retention drops (their manifests go first, which is quick) and return
    the step directories to delete: those, and directories of saves that never committed (except
    ``in_progress``, and those ``collect`` declines).  Damaged steps are left alone.  ``check``
    (the writer lease's) runs right before each manifest is removed and raises to stop: removals
    on an object store take a round trip each, and a writer whose lease was taken over while it
    retired a dozen steps must not go on uncommitting steps its successor keeps.

    Readers stop seeing a retired step as soon as this returns; deleting its bytes
    (:func:`delete_dirs`) can happen later, off the critical path.
    """
    catalog = catalog or scan(storage)
    doomed = []
    seqs = [i.commit_seq for i in catalog.committed]
    for step in steps_to_delete(catalog.commits(), keep_last, keep_every, catalog.parents(), seqs):
        info = catalog.get(step)
        if check is not None:
            check()
        storage.remove(f"{info.dir}/{MANIFEST_NAME}")
        doomed.append(info.dir)
    doomed += [
        i.dir
        for i in catalog.uncommitted()
        if i.step != in_progress and (collect is None or collect(i))
    ]
    return sorted(doomed)


def delete_dirs(
    storage: Storage, names: Iterable[str], *, check: Callable[[], None] | None = None
) -> None:
    """Remove ``names`` (step directories, files).  ``check`` (the writer lease's) runs right
    before each removal and raises to stop: what to delete was decided under the lease, maybe a
    while ago, and a successor that took the URL over since may have committed into a
    directory of the same name."""
    for name in names:
        if check is not None:
            check()
        storage.remove_tree(name)
        log.info("removed %s", storage.display(name))
