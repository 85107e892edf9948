"""The persisters' flush across nodes: a snapshot no one node holds whole, written out together.

Across nodes the memory tier's committed snapshot of a step is spread: each node holds its own
ranks' files and its source node's replicas, so on three nodes or more no node holds every file
(and on two, none does where the newest replicas never arrived).  When the whole job dies, the
newest snapshot must still reach durable storage (the job may run again elsewhere, where none of
this memory is), and there is no process group left to say who writes what: the persisters talk
through the checkpoint URL itself, as the durable saves' ``begin``/``copy``/``commit`` do through
the trainer.  ``FLUSH.json`` at the URL's root carries one record (FORMAT.md section 9):

* Rank 0's node's persister (the *committer*) picks the snapshot to flush as always; where its
  node lacks some of its files it takes the lease and the step's next generation (``begin``),
  publishes an *invitation* (the step, the generation, the SHA-256 of its copy of the step's
  manifest, a random id), writes the files it holds, waits for the rest to appear at the URL with
  their sizes (for as long again as it has seen no new file), and commits (the usual commit:
  every file's size checked again).  Whatever its flush came to, it then publishes a *done*
  record naming the manifests of the snapshots its node holds (``seen``).
* Every other node's persister (a *joiner*), once its trainer is gone, takes its node's newest
  committed snapshot as its *target* and reads the record until a done record names the target
  among those seen (the committer has flushed or judged that very state) or a done record comes
  that was not there when its persister started (a flush ended without it: rank 0's node lacks
  it), until a successor
  persister waits for its node's lock (the job runs again here: it restores from this memory), or
  for ``join_wait_s`` (rank 0's node gone).  Meanwhile it serves an invitation that names a step
  its memory holds under the very same manifest: it checks each of its own ranks' files against
  the manifest's checksums and writes it under the invitation's generation, exclusively (never
  over a file that is there, unless it holds these very bytes), then the replicas it holds of
  files still missing once their own node had as long again (a lost node's ranks).  It never
  commits, and takes no lease.

The record is untrusted input: read with a size cap and checked field by field; all it can make a
joiner do is write that joiner's own, checked bytes of a step it holds, under a generation number,
where nothing is yet.  An invitation left by a committer that died is served at most once per
joiner: its files are of a generation that is never committed.  A stale done record ends a joiner
only where it names the joiner's own newest state, which was then judged already.
"""

from __future__ import annotations

import contextlib
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
from resilient.checkpoint.lease import _dead, _process_start
from resilient.checkpoint.seal import WAITING_PREFIX, wait_for_writers, write_waiting_marker
from resilient.checkpoint.seal_nodes import seal_across_nodes
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.url_group import SEAL_DIR, UrlGroup
from resilient.checkpoint.writer import CommitError
from resilient.errors import ResilientError

if TYPE_CHECKING:  # (persister.py imports this module)
    from resilient.checkpoint.persister import Promoter

log = logging.getLogger(__name__)

__all__ = [
    "FLUSH_NAME",
    "WAITING_PREFIX",
    "FilesMissing",
    "held_files",
    "join_flush",
    "persist_jointly",
    "mark_waiting",
    "publish_done",
    "open_seal",
    "seal_together",
    "seen_now",
    "with_sealed",
]

FLUSH_NAME = "FLUSH.json"
_FORMAT = 1
_MAX_INVITATION = 4096
# how long a joiner waits for its target to be judged, and a committer for a new file to appear
JOIN_WAIT_S = 60.0
# ... and, once a successor persister waits for its node's lock, a committer for a new file
_SUCCESSOR_WAIT_S = 5.0
_POLL_S = 0.5
_WRITERS_WAIT_S = 15.0  # (a joiner's seal) as the persister's flush waits for its trainer's ranks
_MAX_SEEN = 16  # the done record's manifests: the newest the committer's memory holds
_MAX_OF = 8  # the done record's ids of the records its flush published before it


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
    ``held``, and its manifest) with the other nodes' persisters writing the rest.  The done
    record comes after, from the flush (publish_done)."""
    t0 = time.monotonic()
    storage = promoter.storage
    snap = promoter._snapshot(step, src)
    generation = promoter.begin(step)["generation"]
    invitation = {
        "format": _FORMAT,
        "job_id": promoter.job_id,
        "id": _record_id(promoter),
        "done": False,
        "step": step,
        "generation": generation,
        "manifest": _digest(os.path.join(src, MANIFEST_NAME)),
        "seen": [],
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
    _write_held(promoter, step, generation, src, snap, held)
    _await_files(promoter, step, generation, snap, wait_s)
    return promoter.commit(
        step, generation, src, t0=t0, snap=snap, parent=parent, parent_seen=parent_seen
    )


def seen_now(promoter: Promoter) -> list[str]:
    """The manifests of the snapshots this node's memory holds, newest first: what a flush that
    begins now judges (taken at its start: a restarted trainer's later snapshots are not)."""
    seen: list[str] = []
    try:
        for s in scan(Storage(promoter.steps_dir)).line()[:_MAX_SEEN]:
            with contextlib.suppress(OSError, ResilientError):
                seen.append(_manifest_digest(promoter.steps_dir, s))
    except ResilientError as e:
        log.warning("flush across nodes: cannot list this node's memory (%s)", e)
    return seen


def with_sealed(seen: list[str], steps_dir: str, step: int) -> list[str]:
    """``seen`` (seen_now, at the flush's start) with the manifest of ``step`` first: the flush's
    seal committed it since (not what a restarted run committed meanwhile)."""
    try:
        digest = _manifest_digest(steps_dir, step)
    except (OSError, ResilientError):
        return seen
    return [digest, *(d for d in seen if d != digest)][:_MAX_SEEN]


def _record_id(promoter: Promoter) -> str:
    """A new record's id, kept by the flush that publishes it (the done record names them)."""
    rid = secrets.token_hex(8)
    promoter.flush_ids.append(rid)
    return rid


def _since(record: dict[str, Any], baseline: str | None) -> bool:
    """Whether ``record`` comes from a flush other than the one whose record was ``baseline``
    (the record there when this persister started: a predecessor's flush may end later)."""
    return record["id"] != baseline and baseline not in record.get("of", ())


def publish_done(promoter: Promoter, seen: list[str]) -> None:
    """(the committer, once its flush needs no other node: before a flush it makes alone, or at
    its end) Say what it judged: ``seen`` (seen_now, at the flush's start)."""
    done = {
        "format": _FORMAT,
        "job_id": promoter.job_id,
        "id": secrets.token_hex(8),
        "done": True,
        "step": None,
        "generation": None,
        "manifest": None,
        "seen": seen,
        # the records this flush published before (its seal, its invitation): a joiner that
        # started while they were there does not take this for a later flush's end
        "of": list(promoter.flush_ids[-_MAX_OF:]),
    }
    try:
        promoter.storage.publish(FLUSH_NAME, json.dumps(done).encode())
    except Exception as e:  # (the joiners wait out their time)
        log.warning("flush across nodes: could not publish %s: %s", FLUSH_NAME, e)


def _manifest_digest(steps_dir: str, step: int) -> str:
    return _digest(os.path.join(steps_dir, step_dir_name(step), MANIFEST_NAME))


def successor_waiting(job_dir: str) -> bool:
    """Whether another persister of the job waits for this node's lock (a restarted trainer's:
    the job runs again on this node, and restores from its memory): a marker (mark_waiting)
    whose process is that very process (its start time), alive and not a zombie."""
    return any(pid != os.getpid() and _marker_live(path, pid) for path, pid in _markers(job_dir))


def _markers(job_dir: str) -> list[tuple[str, int]]:
    """The waiting markers in ``job_dir``: (path, pid)."""
    try:
        names = os.listdir(job_dir)
    except OSError:
        return []
    pids = [(n, n[len(WAITING_PREFIX) :]) for n in names if n.startswith(WAITING_PREFIX)]
    return [(os.path.join(job_dir, n), int(p)) for n, p in pids if p.isdigit() and len(p) < 10]


def _marker_live(path: str, pid: int) -> bool:
    return _marker_state(path, pid) == "live"


def _marker_state(path: str, pid: int) -> str:
    """The marker's state: live, dead (its process is gone, or it cannot be read), or gone
    (removed already: its process may write its next marker at that name meanwhile, which a
    removal by this name would take)."""
    try:
        with open(path, "rb") as f:
            start = f.read(64).decode(errors="replace").strip()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "dead"
    return "live" if start and _process_start(pid) == start and not _dead(pid) else "dead"


def mark_waiting(job_dir: str) -> str:
    """``<job>/persister.waiting.<pid>`` (seal.write_waiting_marker): this persister waits for
    the node's lock (its path, made or not).  Markers whose process is gone are removed first."""
    for old, pid in _markers(job_dir):
        if _marker_state(old, pid) == "dead":
            with contextlib.suppress(OSError):
                os.unlink(old)
    return write_waiting_marker(job_dir) or os.path.join(job_dir, f"{WAITING_PREFIX}{os.getpid()}")


def _write_held(
    promoter: Promoter,
    step: int,
    generation: int,
    src: str,
    snap: Manifest,
    held: set[str],
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

    grace = time.monotonic() + (time.monotonic() - t) + 1.0
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
    promoter: Promoter, step: int, generation: int, snap: Manifest, wait_s: float
) -> None:
    """Until every file of ``snap`` is at the URL under ``generation`` with its size, for as long
    as new ones keep coming: ``wait_s`` since the last one (a few seconds once a successor
    persister waits for this node's lock: the job runs again, and restores from memory)."""
    storage = promoter.storage
    step_rel = step_dir_name(step)
    want = {rank_file_name(e.rank, generation): e.size_bytes for e in snap.files.values()}
    last = time.monotonic()
    while True:
        for name in [n for n, size in want.items() if _there(storage, f"{step_rel}/{n}", size)]:
            del want[name]  # (there: not asked for again)
            last = time.monotonic()
        if not want:
            return
        idle = time.monotonic() - last
        limit = _SUCCESSOR_WAIT_S if successor_waiting(promoter.job_dir) else wait_s
        if idle > limit:
            raise FilesMissing(
                f"step {step} is not flushed: {len(want)} of its {len(snap.files)} files never "
                f"reached {storage.display(step_rel)} (the first: {min(want)}; none came for "
                f"{idle:.0f}s); the nodes that hold them did not write them out (gone, or their "
                f"memory with them), so the snapshot stays in memory for the next run of the job"
            )
        time.sleep(_POLL_S)


def _there(storage: Storage, rel: str, size: int) -> bool:
    try:
        return storage.size(rel) == size
    except Exception:
        return False


def _parse(data: bytes) -> dict[str, Any] | None:
    """A record's fields, checked; None for anything else."""
    try:
        got = json.loads(data)
    except (ValueError, RecursionError):  # (not JSON; nested too deep for the parser)
        return None
    if not isinstance(got, dict) or got.get("format") != _FORMAT:
        return None
    if not isinstance(got.get("job_id"), str) or not _hex(got.get("id"), 16):
        return None
    seen = got.get("seen")
    if not isinstance(seen, list) or len(seen) > _MAX_SEEN or not all(_hex(d, 64) for d in seen):
        return None
    of = got.get("of", [])
    if not isinstance(of, list) or len(of) > _MAX_OF or not all(_hex(d, 16) for d in of):
        return None
    if got.get("done") is True:
        return got
    if got.get("done") is not False:
        return None
    if got.get("seal") is True:  # (a seal's session: its id names its folder)
        return got
    step, generation = got.get("step"), got.get("generation")
    ints = all(type(v) is int and 0 <= v <= MAX_INT for v in (step, generation))
    return got if ints and _hex(got.get("manifest"), 64) else None


def _hex(value: Any, n: int) -> bool:
    return isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{n}}}", value) is not None


def _read_record(storage: Storage, warned: set[bytes]) -> dict[str, Any] | None:
    try:
        data = storage.read_small(FLUSH_NAME, _MAX_INVITATION)
    except Exception:  # (none there, or too large: read again at the next poll)
        return None
    got = _parse(data)
    if got is None and data not in warned:
        warned.add(data)
        log.warning("%s is not a flush record; ignored", storage.display(FLUSH_NAME))
    return got


def record_id(storage: Storage) -> str | None:
    """The id of the record at the URL now (None: none, or not one): a joiner's baseline, read
    when its persister starts, while its trainer lives (no flush of this trainer's yet)."""
    return (_read_record(storage, set()) or {}).get("id")


def open_seal(promoter: Promoter, wait_s: float) -> UrlGroup | None:
    """(the committer, its job on several nodes with sealed snapshots) Open a seal's session:
    the other sessions' folders go, and the record names this one (the joiners take part as
    they see it: join_flush).  None where the record cannot be published."""
    storage = promoter.storage
    session = _record_id(promoter)
    try:
        if storage.exists(SEAL_DIR):
            storage.remove_tree(SEAL_DIR)
        record = {
            "format": _FORMAT,
            "job_id": promoter.job_id,
            "id": session,
            "done": False,
            "seal": True,
            "seen": [],
        }
        storage.publish(FLUSH_NAME, json.dumps(record).encode())
    except Exception as e:
        log.warning("flush across nodes: could not open a seal at %s: %s", storage.display(), e)
        return None
    return _group(promoter, session, 0, wait_s)


def _group(promoter: Promoter, session: str, node: int, wait_s: float) -> UrlGroup:
    nodes = promoter.config.get("nodes", 1)
    job_dir = promoter.job_dir
    return UrlGroup(
        promoter.storage, session, node, nodes, wait_s, hurry=lambda: successor_waiting(job_dir)
    )


def seal_together(
    promoter: Promoter,
    group: UrlGroup | None,
    writers_s: float,
    *,
    only_from: int = 0,
    durable: int | None | str = "scan",
) -> int | None:
    """Commit in this node's memory the newest step every rank sealed, with the other nodes'
    persisters (seal_nodes.seal_across_nodes, its collectives through the URL: url_group.py);
    the step, or None (nothing whole newer than the newest durable step, or the seal broke
    off: the staged records and pairs stay for the next run's load).  ``group`` None: this node
    alone, from its own copies and pairs.  ``writers_s``: how long this node's ranks that staged
    a step may take to be gone; ``only_from``: no older step is sealed; ``durable``: the newest
    durable step (None: none), where the caller listed it already."""
    try:
        if durable == "scan":
            newest = scan(promoter.storage).newest()
            durable = None if newest is None else newest.step
        newer_than = max(-1 if durable is None else int(durable), only_from - 1)
        with contextlib.suppress(OSError):  # (this node's memory gone: it offers nothing)
            wait_for_writers(promoter.job_dir, writers_s, newer_than)
        max_run = promoter.config.get("max_run")
        return seal_across_nodes(
            promoter.job_dir,
            rank=0 if group is None else group.rank,
            leader=True,
            group=group,
            floor=0,
            max_run=max_run if type(max_run) is int else None,
            newer_than=newer_than,
            clear=False,
        )
    except Exception as e:  # (the URL is untrusted input: anything there ends the seal)
        log.warning(
            "flush across nodes: the seal with the other nodes broke off: %s: %s",
            type(e).__name__,
            e,
        )
        return None


def _await_seal(promoter: Promoter, baseline: str | None, deadline: float) -> str | None:
    """(a joiner) The id of the seal's session the committer opens (open_seal), or None once
    another record comes (its flush went on without one), a successor persister waits for this
    node's lock, or ``deadline`` passes."""
    warned: set[bytes] = set()
    while time.monotonic() < deadline and not successor_waiting(promoter.job_dir):
        record = _read_record(promoter.storage, warned)
        if record is not None and record["job_id"] == promoter.job_id:
            if _since(record, baseline):
                return record["id"] if record.get("seal") else None
        time.sleep(_POLL_S)
    return None


def join_flush(promoter: Promoter, wait_s: float, baseline: str | None) -> int:
    """(a joiner) Serve the committer's invitations until a done record names this node's
    newest committed snapshot or is not ``baseline`` (record_id: one published since this
    persister started, by a flush that ended without this snapshot), a successor persister
    waits for this node's lock, or ``wait_s`` is over; returns how many bytes it wrote.  With
    sealed snapshots, first the seal the committer opens, together (seal_together)."""
    node = promoter.config.get("node")
    if promoter.config.get("sealed_nodes") and type(node) is int and node > 0:
        session = _await_seal(promoter, baseline, time.monotonic() + wait_s)
        if session is not None:
            group = _group(promoter, session, node, wait_s)
            try:
                sealed = seal_together(promoter, group, _WRITERS_WAIT_S)
            finally:
                group.close()
            if sealed is not None:
                log.info("flush across nodes: sealed step %d with the other nodes", sealed)
    try:
        line = scan(Storage(promoter.steps_dir)).line()
        target = _manifest_digest(promoter.steps_dir, line[0]) if line else None
    except (OSError, ResilientError) as e:
        log.warning("flush across nodes: cannot read this node's newest snapshot (%s)", e)
        return 0
    if target is None:
        log.info("flush across nodes: no snapshot in this node's memory")
        return 0
    deadline = time.monotonic() + wait_s
    served: set[str] = set()
    warned: set[bytes] = set()
    written = 0
    while True:
        record = _read_record(promoter.storage, warned)
        if record is not None and record["job_id"] == promoter.job_id:
            if record["done"] and target in record["seen"]:
                log.info("flush across nodes: rank 0's node judged this node's newest snapshot")
                return written
            if record["done"] and _since(record, baseline):
                # a flush ended since this one began, and its node lacks this snapshot (its
                # memory gone, a new host): nothing asks for it now
                log.info(
                    "flush across nodes: rank 0's node flushed without this node's newest "
                    "snapshot (step %d); it stays in memory for the next run of the job",
                    line[0],
                )
                return written
            if not record["done"] and not record.get("seal") and record["id"] not in served:
                served.add(record["id"])
                try:
                    written += _serve(promoter, record)
                except Exception as e:  # (a damaged or retired step: the committer says so)
                    log.warning(
                        "flush across nodes: step %d's files were not written: %s: %s",
                        record["step"],
                        type(e).__name__,
                        e,
                    )
        if successor_waiting(promoter.job_dir):
            log.info("flush across nodes: the job runs again on this node; done")
            return written
        if time.monotonic() > deadline:
            log.info(
                "flush across nodes: rank 0's node did not judge this node's newest snapshot "
                "(step %d) within %.0fs; it stays in memory for the next run of the job",
                line[0],
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
        written = _write_held(promoter, step, generation, src, snap, held)
        log.info(
            "flush across nodes: wrote %d bytes of step %d under generation %d",
            written,
            step,
            generation,
        )
        return written
    finally:
        shutil.rmtree(src, ignore_errors=True)
