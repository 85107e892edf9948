"""Which steps exist, which of them are committed, and in what order they were committed.

A step is *committed* when its ``MANIFEST.json`` is a regular file that passes every check a load
makes of a manifest (a version this toolkit reads, its own step, the caps, chunks that tile every
tensor).  Anything else is not
a commit: a torn manifest (a store without atomic writes can leave half of one), a manifest of
another step copied under this number, a manifest of a newer format.  Such a step is *damaged*:
readers skip it (with a warning), retention neither counts it nor deletes it, so it can never push
an older good step out.  A step directory without a manifest is *uncommitted*: garbage that only
the holder of the writer lease collects.

Order is the commit order, never the step number: each commit carries ``commit_seq``, one past the
newest commit's when it was written (v1 steps read as 0, ordered among themselves by step).  After a
rollback (``load(state, step=100)`` while 200 and 250 exist, then ``save(150)``), 150 is the newest
commit, so it is the latest step, and auto-resume picks it, not the abandoned 250.

The *line* is the history the newest commit continues.  A commit records the commit its state
descends from (its parent: what its job loaded, or that job's previous commit; format.PARENT_KEY),
and the line follows those links: after the rollback above, ``save(300)`` instead of 150 still
continues 100, not the abandoned 250.  Where a commit records none (written before parents were
recorded, a fresh job's first commit), the line goes on as it always did: to the newest older
commit numbered below every step already on the line.  Steps off the line (200 and 250 above)
belong to an abandoned branch; see :func:`resilient.checkpoint.retention.steps_to_delete` for how
long they are kept.  Fallback after a failed load walks the line, never into an abandoned branch.

Parsed manifests are cached per file version (size, mtime, inode or ETag), so listing steps again
reads only manifests that changed.  The cache outlives any one checkpoint directory, so what it
keeps of a manifest (untrusted text) is bounded: a summary's strings are capped by the format
(a job id's length, a rank file's name), a summary naming more files than a real job's manifest is
not cached, the cache's file names all together are capped, and why a damaged step is not a
commit is kept only as a short message.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from resilient.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_OLDER,
    Manifest,
    ManifestSummary,
    manifest_of_step,
    parse_step_dir,
    recorded_chain,
    recorded_run,
    recorded_runs_seen,
    recorded_uncounted,
    step_dir_name,
)
from resilient.checkpoint.storage import Storage
from resilient.errors import ResilientError

__all__ = [
    "StepInfo",
    "Catalog",
    "scan",
    "line_of",
    "remember_commit",
    "committed_step",
    "summary_of",
]

log = logging.getLogger(__name__)

State = Literal["committed", "uncommitted", "damaged"]


@dataclass(frozen=True)
class StepInfo:
    step: int
    dir: str  # the step directory's name under the root
    state: State
    commit_seq: int = 0
    generation: int = 0
    job_id: str = ""
    files: frozenset[str] = frozenset()  # the rank files its manifest names
    problem: str = ""  # why a damaged step is not a commit
    run: int = 0  # the memory tier's run that made the commit (format.RUN_KEY; 0: none)
    # the commits (step, commit_seq) it descends from, its parent first (PARENT_KEY)
    chain: tuple[tuple[int, int], ...] = ()
    uncounted: bool = False  # ``run`` is an uncounted run's (format.RUN_UNCOUNTED_KEY)
    runs_seen: int = 0  # (no ``run``) the runs with the tier counted then (format.RUNS_SEEN_KEY)

    @property
    def order(self) -> tuple[int, int]:
        """Its place in commit order (v1 steps, commit_seq 0, by step number)."""
        return (self.commit_seq, self.step)


def line_of(
    commits: Sequence[int],
    parents: Mapping[int, Any] | None = None,
    seqs: Sequence[int] | None = None,
) -> list[int]:
    """The steps of the current line, newest first, from step numbers in commit order (oldest
    first), the parents the commits record (step -> (parent step, parent commit_seq), or the
    chain (parent, what it descends from, ...), newest first) and their ``commit_seq`` (default:
    1, 2, ... in that order).  The newest commit, then from each step taken: its parent, where
    that is a commit with that commit_seq, numbered below it and older; where it is gone, the
    next of the chain that is there; where none is, the newest commit older than the last of the
    chain numbered below it (or the end); where none is recorded (or one that is not below and
    older), the newest older commit numbered below every step taken so far.  Positions only go
    back: O(n log n) whatever the links say."""
    if not commits:
        return []
    parents = parents or {}
    seqs = list(seqs) if seqs is not None else list(range(1, len(commits) + 1))
    orders = list(zip(seqs, commits))
    where = {s: i for i, s in enumerate(commits)}
    i = len(commits) - 1
    out = [commits[i]]
    while True:
        s = out[-1]
        bound, j = s, i - 1
        below = orders[i]  # each link of the chain must be below and older than the one before
        found = gone = None
        for p_step, p_seq in _chain(parents.get(s)):
            if not (p_step < below[1] and (p_seq, p_step) < below):
                break  # (a link that is not: the chain says nothing from there on)
            k = where.get(p_step)
            if k is not None and k < i and seqs[k] == p_seq:
                found = k
                break
            gone = below = (p_seq, p_step)
        if found is not None:
            i = found
            out.append(commits[found])
            continue
        if gone is not None:  # all gone: on from where the last stood in commit order, below it
            bound, j = gone[1], bisect.bisect_left(orders, gone, 0, i) - 1
        while j >= 0 and commits[j] >= bound:
            j -= 1
        if j < 0:
            break
        i = j
        out.append(commits[j])
    return out


def _chain(link: Any) -> tuple[tuple[int, int], ...]:
    """A parents value as a chain: one (step, commit_seq), or a sequence of them."""
    if not link:
        return ()
    if isinstance(link[0], int):
        return (link,)
    return tuple(link[: 1 + MAX_OLDER])


class Catalog:
    """A snapshot of a checkpoint root's steps (see the module docstring)."""

    def __init__(self, infos: Iterable[StepInfo]) -> None:
        self.infos = {i.step: i for i in infos}
        self.committed = sorted(
            (i for i in self.infos.values() if i.state == "committed"), key=lambda i: i.order
        )

    def get(self, step: int) -> StepInfo | None:
        return self.infos.get(step)

    def steps(self) -> list[int]:
        """Committed steps by number, ascending (abandoned branches included)."""
        return sorted(i.step for i in self.committed)

    def commits(self) -> list[int]:
        """Committed steps in commit order, oldest first."""
        return [i.step for i in self.committed]

    def newest(self) -> StepInfo | None:
        return self.committed[-1] if self.committed else None

    def line(self) -> list[int]:
        """The current line, newest first: what ``load`` falls back along."""
        return line_of(self.commits(), self.parents(), [i.commit_seq for i in self.committed])

    def parents(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """What each committed step records it descends from, its parent first (``line_of``
        judges them)."""
        return {i.step: i.chain for i in self.committed if i.chain}

    def next_commit_seq(self) -> int:
        seqs = [i.commit_seq for i in self.infos.values() if i.state != "uncommitted"]
        return max(seqs, default=0) + 1

    def uncommitted(self) -> list[StepInfo]:
        return sorted(
            (i for i in self.infos.values() if i.state == "uncommitted"), key=lambda i: i.step
        )

    def damaged(self) -> list[StepInfo]:
        return sorted(
            (i for i in self.infos.values() if i.state == "damaged"), key=lambda i: i.step
        )


# (where the root is, manifest path, its file version) -> its summary, or why it is not a commit
_CACHE: OrderedDict[tuple, ManifestSummary | str] = OrderedDict()
_CACHE_SIZE = 4096
# What the cache may keep of untrusted manifests: the file names of one summary (one per rank
# that wrote a file: a 65,536-rank job's), and of all of them together (tens of MiB at most)
_CACHE_MAX_FILES = 1 << 16
_CACHE_FILES_BUDGET = 1 << 18
_CACHE_MAX_MESSAGE = 2000  # characters of why a damaged step is not a commit
_cached_files = 0  # the file names the cache holds (under _LOCK)
_LOCK = threading.Lock()
_WARNED: set[tuple] = set()
_WARNED_SIZE = 4096


def scan(storage: Storage) -> Catalog:
    """List ``storage``'s step directories and classify each (one listing and one stat per step;
    a manifest is read only when it is new or changed)."""
    where = storage.location()
    infos = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        rel = f"{name}/{MANIFEST_NAME}"
        try:
            key = storage.stat_key(rel)
        except ResilientError as e:  # e.g. the step directory is a link: not a step of ours
            infos.append(_damaged(storage, step, name, str(e), (where, rel, "stat")))
            continue
        if key is None:
            infos.append(StepInfo(step, name, "uncommitted"))
            continue
        cache_key = (where, rel, key)
        with _LOCK:
            found = _CACHE.get(cache_key)
            if found is not None:
                _CACHE.move_to_end(cache_key)
        if found is None:
            try:  # in full: a step is a commit only if it can be loaded as far as JSON goes
                m = manifest_of_step(
                    storage.read_small(rel, MAX_MANIFEST_BYTES), storage.display(rel), step
                )
                found = summary_of(m)
            except ResilientError as e:
                found = _message(str(e))
            _remember(cache_key, found)
        if isinstance(found, str):
            infos.append(_damaged(storage, step, name, found, cache_key))
        else:
            infos.append(committed_step(name, found))
    return Catalog(infos)


def committed_step(name: str, summary: ManifestSummary) -> StepInfo:
    """The entry of a committed step (its directory ``name``) whose manifest says ``summary``."""
    return StepInfo(
        summary.step,
        name,
        "committed",
        commit_seq=summary.commit_seq,
        generation=summary.generation,
        job_id=summary.job_id,
        files=summary.files,
        run=summary.run,
        chain=summary.chain,
        uncounted=summary.uncounted,
        runs_seen=summary.runs_seen,
    )


def summary_of(m: Manifest) -> ManifestSummary:
    """What the catalog keeps of a manifest."""
    return ManifestSummary(
        m.step,
        m.commit_seq,
        m.generation,
        m.job_id,
        frozenset(m.files),
        recorded_run(m.extras),
        recorded_chain(m.extras, m.commit_seq),
        uncounted=bool(recorded_run(m.extras)) and recorded_uncounted(m.extras),
        runs_seen=0 if recorded_run(m.extras) else recorded_runs_seen(m.extras),
    )


def remember_commit(storage: Storage, m: Manifest | ManifestSummary) -> None:
    """Put the manifest a writer has just checked and published (or its summary) into the scan
    cache, so that the scans right after a commit (retention, the next save) do not parse it
    again.  Keyed by the file's stat like any entry: if the file changes, the entry is not used."""
    rel = f"{step_dir_name(m.step)}/{MANIFEST_NAME}"
    try:
        key = storage.stat_key(rel)
    except ResilientError:
        return
    if key is None:
        return
    summary = m if isinstance(m, ManifestSummary) else summary_of(m)
    _remember((storage.location(), rel, key), summary)


def _message(problem: str) -> str:
    """Why a step is not a commit, short enough to keep (it may quote the manifest)."""
    if len(problem) <= _CACHE_MAX_MESSAGE:
        return problem
    return problem[: _CACHE_MAX_MESSAGE - 40] + f" ... ({len(problem)} chars)"


def _files_of(entry: ManifestSummary | str) -> int:
    return 0 if isinstance(entry, str) else len(entry.files)


def _remember(cache_key: tuple, entry: ManifestSummary | str) -> None:
    """Cache ``entry`` (a summary, or a damaged step's message), within the cache's bounds."""
    global _cached_files
    if _files_of(entry) > _CACHE_MAX_FILES:
        return  # (read again at the next listing: no real job's manifest is this large)
    with _LOCK:
        old = _CACHE.pop(cache_key, None)
        if old is not None:
            _cached_files -= _files_of(old)
        _CACHE[cache_key] = entry
        _cached_files += _files_of(entry)
        while len(_CACHE) > _CACHE_SIZE or _cached_files > _CACHE_FILES_BUDGET:
            _, dropped = _CACHE.popitem(last=False)
            _cached_files -= _files_of(dropped)


def _damaged(storage: Storage, step: int, name: str, problem: str, key: tuple) -> StepInfo:
    problem = _message(problem)
    with _LOCK:
        first = key not in _WARNED
        if len(_WARNED) >= _WARNED_SIZE:
            _WARNED.clear()  # (warned again, at worst: a bound on what a hostile root adds)
        _WARNED.add(key)
    if first:
        log.warning(
            "step %d under %s is not a commit and is skipped (never deleted): %s",
            step,
            storage.url,
            problem,
        )
    return StepInfo(step, name, "damaged", problem=problem)
