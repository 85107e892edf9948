"""The persisters' flush across nodes: a snapshot no one node holds whole, written out together.

Across nodes the memory tier's committed snapshot of a step is spread: each node holds its own
ranks' files and its source node's replicas, so on three nodes or more no node holds every file.
When the whole job dies, the newest snapshot must still reach durable storage (the job may run
again elsewhere, where none of this memory is), and there is no process group left to say who
writes what: the persisters talk through the checkpoint URL itself, as the durable saves'
``begin``/``copy``/``commit`` do through the trainer.

* Rank 0's node's persister (the *committer*) picks the snapshot to flush as always; where its
  node lacks some of its files it takes the lease and the step's next generation (``begin``),
  publishes an *invitation* at ``FLUSH.json`` in the URL's root (the job, the step, the
  generation, the SHA-256 of its copy of the step's manifest and a random id), writes the files
  its node holds, waits for the rest to appear at the URL with their sizes, and commits (the
  usual commit: every file's size checked again).  The invitation goes once the commit is made or
  given up on.
* Every other node's persister (a *joiner*), once its trainer is gone, reads the invitation until
  durable storage holds its newest committed snapshot or its wait is over.  It serves an
  invitation that names a step its memory holds under the very same manifest: it checks each of
  its own ranks' files against the manifest's checksums and writes it under the invitation's
  generation, exclusively (never over a file that is there, unless it holds these very bytes).
  It never commits, and takes no lease.

The invitation is untrusted input: it is read with a size cap and checked field by field; all it
can make a joiner do is write that joiner's own, checked bytes of a step it holds, under a
generation number, where nothing is yet.  An invitation left by a committer that died is served
at most once per joiner: its files are of a generation that is never committed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from typing import TYPE_CHECKING, Any

from resilient.checkpoint.catalog import scan
from resilient.checkpoint.format import (
    MANIFEST_NAME,
    MAX_INT,
    MAX_MANIFEST_BYTES,
    Manifest,
    rank_file_name,
    step_dir_name,
)
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.writer import CommitError
from resilient.errors import ResilientError

if TYPE_CHECKING:  # (persister.py imports this module)
    from resilient.checkpoint.persister import Promoter

log = logging.getLogger(__name__)

__all__ = ["FLUSH_NAME", "FilesMissing", "held_files", "join_flush", "persist_jointly"]

FLUSH_NAME = "FLUSH.json"
_FORMAT = 1
_MAX_INVITATION = 4096
# how long a joiner waits for an invitation, and a committer for the other nodes' files
JOIN_WAIT_S = 60.0
_POLL_S = 0.5


def held_files(steps_dir: str, step: int, snap: Manifest) -> set[str]:
    """The files of ``snap`` this node's memory holds in the step's directory."""
    where = os.path.join(steps_dir, step_dir_name(step))
    return {f for f in snap.files if os.path.isfile(os.path.join(where, f))}


def _digest(path: str) -> str:
    from resilient.checkpoint.persister import _read_small

    return hashlib.sha256(_read_small(path, MAX_MANIFEST_BYTES)).hexdigest()


def persist_jointly(
    promoter: Promoter,
    step: int,
    src: str,
    held: set[str],
    parent: tuple[tuple[int, int], ...],
    parent_seen: int | None,
    wait_s: float,
) -> dict[str, Any]:
    """(the committer) Commit the snapshot of ``step`` linked into ``src`` (the files of
    ``held``, and its manifest) with the other nodes' persisters writing the rest."""
    t0 = time.monotonic()
    storage = promoter.storage
    snap = promoter._snapshot(step, src)
    generation = promoter.begin(step)["generation"]
    token = secrets.token_hex(8)
    invitation = {
        "format": _FORMAT,
        "job_id": promoter.job_id,
        "step": step,
        "generation": generation,
        "manifest": _digest(os.path.join(src, MANIFEST_NAME)),
        "id": token,
    }
    storage.publish(FLUSH_NAME, json.dumps(invitation).encode())
    log.info(
        "flush across nodes: step %d, generation %d: this node writes %d of its %d files; the "
        "other nodes' persisters are asked for the rest (%s)",
        step,
        generation,
        len(held),
        len(snap.files),
        storage.display(FLUSH_NAME),
    )
    try:
        _write_held(promoter, step, generation, src, snap, held, t0 + wait_s)
        _await_files(storage, step, generation, snap, t0 + wait_s)
        return promoter.commit(
            step, generation, src, t0=t0, snap=snap, parent=parent, parent_seen=parent_seen
        )
    finally:
        try:
            storage.remove_if(
                FLUSH_NAME,
                lambda data: (_parse(data) or {}).get("id") == token,
                _MAX_INVITATION,
                tag=token,
            )
        except Exception as e:  # (a joiner serves it at most once; its wait ends)
            log.warning("could not remove the flush invitation %s: %s", FLUSH_NAME, e)


def _write_held(
    promoter: Promoter,
    step: int,
    generation: int,
    src: str,
    snap: Manifest,
    held: set[str],
    deadline: float,
) -> int:
    """Write this node's own ranks' files of ``held``, then the replicas it holds of the files
    still missing at the URL once their own node had as long again (a node that is gone: its
    ranks' files come from the replicas, checked as any)."""
    ranks = set(promoter.config.get("node_ranks") or ())
    own = sorted(f for f in held if snap.files[f].rank in ranks) if ranks else sorted(held)
    t = time.monotonic()
    written = promoter.copy(step, generation, own, src, snap=snap)["bytes"] if own else 0
    others = sorted(held - set(own))
    if not others:
        return written
    step_rel = step_dir_name(step)

    def absent(f: str) -> bool:
        entry = snap.files[f]
        rel = f"{step_rel}/{rank_file_name(entry.rank, generation)}"
        return not _there(promoter.storage, rel, entry.size_bytes)

    grace = min(deadline, time.monotonic() + (time.monotonic() - t) + 1.0)
    while any(absent(f) for f in others) and time.monotonic() < grace:
        time.sleep(_POLL_S)
    for f in others:
        if absent(f):  # (checked right before: its own node may have written it since)
            log.info(
                "flush across nodes: rank %d's file of step %d is not at the URL; writing the "
                "replica this node holds",
                snap.files[f].rank,
                step,
            )
            written += promoter.copy(step, generation, [f], src, snap=snap)["bytes"]
    return written


class FilesMissing(CommitError):
    """The other nodes' files did not all reach the URL in time: an older step would fare no
    better."""


def _await_files(
    storage: Storage, step: int, generation: int, snap: Manifest, deadline: float
) -> None:
    """Until every file of ``snap`` is at the URL under ``generation`` with its size."""
    step_rel = step_dir_name(step)
    want = {rank_file_name(e.rank, generation): e.size_bytes for e in snap.files.values()}
    while True:
        for name in [n for n, size in want.items() if _there(storage, f"{step_rel}/{n}", size)]:
            del want[name]  # (there: not asked for again)
        if not want:
            return
        if time.monotonic() > deadline:
            raise FilesMissing(
                f"step {step} is not flushed: {len(want)} of its {len(snap.files)} files never "
                f"reached {storage.display(step_rel)} (the first: {min(want)}); the nodes that "
                f"hold them did not write them out (gone, or their memory with them), so the "
                f"snapshot stays in memory for the next run of the job"
            )
        time.sleep(_POLL_S)


def _there(storage: Storage, rel: str, size: int) -> bool:
    try:
        return storage.size(rel) == size
    except Exception:
        return False


def _parse(data: bytes) -> dict[str, Any] | None:
    """An invitation's fields, checked; None for anything else."""
    try:
        got = json.loads(data)
    except ValueError:
        return None
    if not isinstance(got, dict) or got.get("format") != _FORMAT:
        return None
    step, generation = got.get("step"), got.get("generation")
    ints = all(type(v) is int and 0 <= v <= MAX_INT for v in (step, generation))
    strings = (
        isinstance(got.get("job_id"), str)
        and isinstance(got.get("id"), str)
        and re.fullmatch(r"[0-9a-f]{16}", got["id"]) is not None
        and isinstance(got.get("manifest"), str)
        and re.fullmatch(r"[0-9a-f]{64}", got["manifest"]) is not None
    )
    return got if ints and strings else None


def _read_invitation(storage: Storage, warned: set[str]) -> dict[str, Any] | None:
    try:
        data = storage.read_small(FLUSH_NAME, _MAX_INVITATION)
    except Exception:  # (none there, or too large: read again at the next poll)
        return None
    got = _parse(data)
    if got is None and data not in warned:
        warned.add(data)
        log.warning("%s is not a flush invitation; ignored", storage.display(FLUSH_NAME))
    return got


def join_flush(promoter: Promoter, wait_s: float) -> int:
    """(a joiner) Serve the committer's invitations until durable storage holds this node's
    newest committed snapshot, or for ``wait_s``; returns how many bytes it wrote."""
    deadline = time.monotonic() + wait_s
    mem = Storage(promoter.steps_dir)
    served: set[str] = set()
    warned: set[str] = set()
    written = 0
    while True:
        invitation = _read_invitation(promoter.storage, warned)
        if (
            invitation is not None
            and invitation["id"] not in served
            and invitation["job_id"] == promoter.job_id
        ):
            served.add(invitation["id"])
            try:
                written += _serve(promoter, invitation)
            except (OSError, ResilientError) as e:
                log.warning(
                    "flush across nodes: step %d's files were not written: %s",
                    invitation["step"],
                    e,
                )
        try:
            line = scan(mem).line()
            newest = scan(promoter.storage).newest()
        except ResilientError as e:
            log.warning("flush across nodes: cannot list what is held (%s); done", e)
            return written
        if not line or (newest is not None and newest.step >= max(line)):
            log.info("flush across nodes: durable storage holds this node's newest snapshot")
            return written
        if time.monotonic() > deadline:
            log.info(
                "flush across nodes: no invitation for this node's newest snapshot (step %d) "
                "within %.0fs; it stays in memory for the next run of the job",
                max(line),
                wait_s,
            )
            return written
        time.sleep(_POLL_S)


def _serve(promoter: Promoter, invitation: dict[str, Any]) -> int:
    """Write this node's files of the invited step (_write_held), if it holds that very
    snapshot; returns how many bytes."""
    from resilient.checkpoint.persister import link_to_outbox

    step, generation = invitation["step"], invitation["generation"]
    where = os.path.join(promoter.steps_dir, step_dir_name(step))
    try:
        digest = _digest(os.path.join(where, MANIFEST_NAME))
    except (OSError, ResilientError):
        log.info("flush across nodes: step %d is not in this node's memory", step)
        return 0
    if digest != invitation["manifest"]:
        log.warning(
            "flush across nodes: this node's manifest of step %d is not the one invited (%s); "
            "its files are not written",
            step,
            invitation["manifest"][:12],
        )
        return 0
    snap = promoter._snapshot(step, where)
    held = held_files(promoter.steps_dir, step, snap)
    src = link_to_outbox(
        promoter.steps_dir, step, promoter.outbox, {snap.files[f].rank for f in held}
    )
    try:
        snap = promoter._snapshot(step, src)  # (the copy linked: what its files are checked by)
        deadline = time.monotonic() + float(promoter.config.get("join_wait_s", JOIN_WAIT_S))
        written = _write_held(promoter, step, generation, src, snap, held, deadline)
        log.info(
            "flush across nodes: wrote %d bytes of step %d under generation %d",
            written,
            step,
            generation,
        )
        return written
    finally:
        shutil.rmtree(src, ignore_errors=True)
