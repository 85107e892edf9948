"""Finishing a memory snapshot whose commit was cut short: every rank's copy is complete, the commit
is not (the memory tier; docs/FORMAT.md section 9).

A snapshot's stall is the copy into the rank file; its checksums and its commit run in the
background while the next training step computes, and the next snapshot waits for them.  A fault
in between (the whole job SIGKILLed, a rank killed, an OOM) would leave the newest committed
snapshot two steps behind the newest step the job finished: the step whose commit was cut short,
and the step after it.  So that a fault loses at most one step, each rank records, once its copy
is complete, what its commit report will say (the *staged record*: the step, the file, its chunks
without checksums, the state's non-tensor values, the tensor table and the layout), and the
record is removed when the snapshot's save is over, committed or not.

:func:`seal_staged` runs where nothing is writing the tier: in the persister when the trainer is
gone (before it flushes), and on rank 0 at a load.  It takes the newest step for which every rank
of the job left a record, each written by a process that is gone, newer than the newest committed
snapshot, checksums each rank's file (found by its inode: at its staging name, or already moved
into the step's directory), and commits the step in the node's memory exactly as the trainer's
commit would have (the same manifest, validated the way readers validate it).  Anything that does
not add up (a rank's record missing, a file replaced or of another size, records that disagree, a
record that does not parse) leaves the step uncommitted: the load and the flush then use the
newest committed snapshot, as before.  Records are this job's own files in its own directory
(mode 0700; snapshots.py); they are read with a size cap and parsed defensively all the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import struct
import time
from concurrent.futures import FIRST_EXCEPTION, wait
from types import SimpleNamespace
from typing import Any

from resilient.checkpoint.catalog import Catalog, scan
from resilient.checkpoint.codec import CRC_THREADS, crc32, crc_pool
from resilient.checkpoint.format import (
    MAX_RUN,
    Manifest,
    TensorEntry,
    rank_file_name,
    step_dir_name,
)
from resilient.checkpoint.lease import _machine, _process_start
from resilient.checkpoint.retention import delete_dirs
from resilient.checkpoint.snapshots import IMPLAUSIBLE_SEQ, RUN_SHIFT, STAGING_DIR, STEPS_DIR
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.writer import build_manifest, next_generation, publish_commit
from resilient.layout import Layout

__all__ = [
    "RECORD_FORMAT",
    "NodeLocal",
    "is_record_name",
    "newest_plausible_seq",
    "record_name",
    "seal_staged",
]

log = logging.getLogger(__name__)

RECORD_FORMAT = "resilient-staged-v1"
_RECORD_RE = re.compile(r"^rank_(\d{5,9})\.step_(\d{1,19})\.json$")
_LOCK = "seal.lock"
_MAX_HEADER = 100 << 20
# a rank file checksummed on the checksum threads, in a few contiguous runs of blocks: from this
# size on, with blocks of at least _PARALLEL_BLOCK bytes and at most _PARALLEL_CHUNKS chunks (the
# blocks are listed first; a record of a million tiny chunks streams through here instead)
_PARALLEL_BYTES = 16 << 20
_PARALLEL_BLOCK = 1 << 20
_PARALLEL_CHUNKS = 1 << 16
_MAX_RECORD = 64 << 20
_MAX_WORLD = 1 << 16
# what every rank's record of one snapshot says alike (one run's ranks: a rank of an earlier run
# that died later must not fill a gap)
SHARED_KEYS = ("digest", "job_id", "block_bytes", "layout", "run")


def record_name(rank: int, step: int) -> str:
    return f"rank_{rank:05d}.step_{step}.json"


def is_record_name(name: str) -> bool:
    return _RECORD_RE.match(name) is not None


class _Unsealable(Exception):
    """Why a step's records cannot be sealed (logged; the step stays uncommitted)."""


class NodeLocal:
    """The lease of a node's own memory directory: nobody else writes there (it is this job's,
    claimed; see snapshots.py), so there is nothing to check."""

    def check(self) -> None:
        return None


def seal_staged(
    job_dir: str,
    *,
    wait_s: float = 0.0,
    lock_s: float = 120.0,
    newer_than: int | None = None,
    max_run: int | None = None,
) -> int | None:
    """Commit, in the node's memory at ``job_dir``, the snapshots every rank staged whose commit
    was cut short (newest first; the first that seals ends it); returns its step, or None when
    there is none to seal.  ``wait_s``: how long to wait for the writers of records newer than
    the newest commit to be gone (the persister: the trainer's other ranks are being torn down).
    ``newer_than``: only steps after it are worth sealing (the persister's flush: the newest
    durable step; a snapshot no newer is never persisted, and sealing it costs a checksum pass).
    A step is numbered as the run that staged it (its rank 0's record's ``job_run``:
    snapshots.number_this_run), and a step staged by an earlier run than one that committed in
    this memory since is not sealed: that later run did not take it up, its line is newer.
    ``max_run``: the sealer's own run, where it knows it; a record that claims a later one is
    damaged (it would set every later run's number beyond what the count allows).
    Never raises: a step that cannot be sealed is logged and left as it is."""
    staging = os.path.join(job_dir, STAGING_DIR)
    steps_dir = os.path.join(job_dir, STEPS_DIR)
    if os.path.islink(staging):  # (MemoryPlace.claim refuses it: records are removed there)
        log.warning(
            "%s is a symbolic link, not this job's staging directory: nothing sealed", staging
        )
        return None
    if not os.path.isdir(staging):
        return None
    try:
        wait_for_writers(job_dir, wait_s, newer_than)
        lock = _lock(os.path.join(job_dir, _LOCK), lock_s)
    except Exception as e:
        log.warning("cannot seal staged snapshots in %s: %s: %s", job_dir, type(e).__name__, e)
        return None
    if lock is None:
        log.warning("sealing staged snapshots in %s: its lock stayed taken; skipped", job_dir)
        return None
    try:
        records, dead, live = _records(staging)
        mem = Storage(steps_dir)
        catalog = scan(mem)
        committed = catalog.newest()
        newest = -1 if committed is None else committed.step
        try:
            wanted = {s: r for s, r in records.items() if newer_than is None or s > newer_than}
            sealed = _seal_newest(wanted, staging, mem, catalog, max_run)
            if sealed is not None:
                newest = max(newest, sealed)
        finally:
            for step, path in dead:
                # a dead rank's record may still be needed while another rank of its step lives
                if live and step > newest:
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return sealed
    except Exception as e:  # a seal is a bonus: the committed snapshots still serve
        log.warning("sealing staged snapshots in %s failed: %s: %s", job_dir, type(e).__name__, e)
        return None
    finally:
        os.close(lock)


def wait_for_writers(job_dir: str, wait_s: float, newer_than: int | None = None) -> None:
    """Wait up to ``wait_s`` for the writers of the staged records (of steps after
    ``newer_than``) at ``job_dir`` to be gone (the persister: the trainer's other ranks are
    being torn down)."""
    staging = os.path.join(job_dir, STAGING_DIR)
    deadline = time.monotonic() + wait_s
    while _live_writers(staging, newer_than) and time.monotonic() < deadline:
        time.sleep(0.2)  # (each look parses the records)


def newest_plausible_seq(catalog: Catalog) -> int:
    """The newest commit order in a node's memory that a run's counter could have reached (a
    damaged manifest's, 2^62 or more, is left out); 0 for none."""
    return max(
        (i.commit_seq for i in catalog.infos.values() if i.commit_seq < IMPLAUSIBLE_SEQ),
        default=0,
    )


def _lock(path: str, timeout_s: float) -> int | None:
    """The seal lock (a persister flushing and a restarted rank 0 loading), or None when it is
    still taken after ``timeout_s``.  While it waits, its waiting marker (write_waiting_marker)
    is in the lock's directory: a flush that holds the lock cuts its waits for other nodes short
    (joint_flush.successor_waiting: the job runs again here, and its load seals)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    deadline = time.monotonic() + timeout_s
    marker: str | None = None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    return None
                if marker is None:
                    marker = write_waiting_marker(os.path.dirname(path)) or ""
                time.sleep(0.05)
            except BaseException:
                os.close(fd)
                raise
    finally:
        if marker:
            with contextlib.suppress(OSError):
                os.unlink(marker)


WAITING_PREFIX = "persister.waiting."  # <job>/persister.waiting.<pid>: a successor at a lock


def write_waiting_marker(job_dir: str) -> str | None:
    """``<job>/persister.waiting.<pid>``, holding this process's start time: this process (a
    persister at the node's lock, a restarted rank at the seal lock) waits for a predecessor's
    flush; None where it cannot be written."""
    path = os.path.join(job_dir, f"{WAITING_PREFIX}{os.getpid()}")
    part = f"{path}.part"  # (whole once at its name: a marker read empty counts as dead)
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(_process_start(os.getpid()))
        os.replace(part, path)
    except OSError as e:  # (a predecessor joining a flush waits out its time)
        log.warning("could not mark this process as waiting (%s): %s", path, e)
        return None
    return path


def writer_alive(pid: Any, start: Any, machine: Any) -> bool:
    """Whether the process that wrote a record may still be running: another machine or pid
    namespace, or no start time to check it by, counts as running (never touched); a zombie, a
    process gone, or another process under that pid counts as gone."""
    if type(pid) is not int or not isinstance(start, str) or not start or machine != _machine():
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    if len(fields) < 20 or fields[19].decode() != start:
        return False
    return fields[0] not in (b"Z", b"X")


def _live_writers(staging: str, newer_than: int | None = None) -> bool:
    """Whether a record (of a step after ``newer_than``) may still be being written."""
    for path in _records(staging)[2]:
        m = _RECORD_RE.match(os.path.basename(path))
        if newer_than is None or (m is not None and int(m.group(2)) > newer_than):
            return True
    return False


def newest_staged_step(job_dir: str) -> int | None:
    """The newest step of the staged records at ``job_dir`` (this node's ranks'), by name."""
    try:
        names = os.listdir(os.path.join(job_dir, STAGING_DIR))
    except OSError:
        return None
    steps = [int(m.group(2)) for m in map(_RECORD_RE.match, names) if m]
    return max(steps, default=None)


def _records(
    staging: str,
) -> tuple[dict[int, dict[int, dict[str, Any]]], list[tuple[int, str]], list[str]]:
    """step -> rank -> record, of writers that are gone; (step, path) of those records (step -1:
    not a record at all); and the paths of the records whose writers may be running."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    dead: list[tuple[int, str]] = []
    live: list[str] = []
    for name in sorted(os.listdir(staging)):
        m = _RECORD_RE.match(name)
        if not m:
            continue
        path = os.path.join(staging, name)
        rank, step = int(m.group(1)), int(m.group(2))
        try:
            rec = _read_record(path)
        except (OSError, ValueError, RecursionError) as e:
            log.warning("staged record %s does not parse (%s); ignored", path, e)
            dead.append((-1, path))
            continue
        if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
            log.warning("staged record %s is not a %s record; ignored", path, RECORD_FORMAT)
            dead.append((-1, path))
            continue
        if writer_alive(rec.get("pid"), rec.get("start"), rec.get("machine")):
            live.append(path)  # its own commit decides
            continue
        dead.append((step, path))
        if rec.get("rank") != rank or rec.get("step") != step:
            log.warning("staged record %s names another rank or step; ignored", path)
            continue
        found.setdefault(step, {})[rank] = rec
    return found, dead, live


def _read_record(path: str) -> Any:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO must not block)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = f.read(_MAX_RECORD + 1)
    if len(data) > _MAX_RECORD:
        raise ValueError(f"larger than {_MAX_RECORD} bytes")
    return json.loads(data)


_COMMITTED = "a commit of it or of a later step got through since its line began"


def void_reason(
    step: int,
    first: dict[str, Any],
    catalog: Catalog,
    committed_run: int,
    max_run: int | None = None,
) -> tuple[str | None, int]:
    """Why the snapshot of ``step`` staged with rank 0's record ``first`` is not to be sealed in
    the memory that ``catalog`` lists (None: it may be), and the run it is numbered as.
    ``committed_run``: the newest run that committed there (``newest_plausible_seq >>
    RUN_SHIFT``); ``max_run``: the sealer's own run, where it knows it."""
    newest = catalog.newest()
    after = first.get("after")
    if type(after) is int and after >= 0:
        # Its line began after the commit numbered ``after`` (rank 0's load, or its start):
        # a commit since of this step or a later one is its own commit, got through, or a
        # newer one's.  A commit made before, of any step, is not: after a rollback (a load
        # of an older step) the abandoned line's steps are still in memory, numbered above.
        if any(
            i.state == "committed" and i.step >= step and after < i.commit_seq < IMPLAUSIBLE_SEQ
            for i in catalog.infos.values()
        ):
            return _COMMITTED, 0
    elif newest is not None and step <= newest.step:  # (a record of a version without it)
        return _COMMITTED, 0
    run = first.get("job_run")
    if run is None:  # (a record of a version that did not say)
        run = committed_run
    elif type(run) is not int or not 0 <= run < MAX_RUN or (max_run and run > max_run):
        run = 0  # (damaged: staged before any counted run)
    if run < committed_run:
        return (
            f"run {run} of the job staged it, and run {committed_run} committed in this "
            f"node's memory since without taking it up"
        ), run
    return None, run


def _seal_newest(
    records: dict[int, dict[int, dict[str, Any]]],
    staging: str,
    mem: Storage,
    catalog: Catalog,
    max_run: int | None = None,
) -> int | None:
    from resilient import __version__ as version

    if not records:
        return None
    committed_run = newest_plausible_seq(catalog) >> RUN_SHIFT
    for step in sorted(records, reverse=True):
        by_rank = records[step]
        why, run = void_reason(step, by_rank[min(by_rank)], catalog, committed_run, max_run)
        if why == _COMMITTED:
            return None  # the commit got through (or a newer one did): nothing to finish
        if why is not None:
            log.warning("memory snapshot of step %d is not sealed: %s", step, why)
            continue
        try:
            seq = max(catalog.next_commit_seq(), (run << RUN_SHIFT) + 1)
            _seal(step, by_rank, staging, mem, seq, version)
        except Exception as e:  # whatever a record or a file says, the step stays uncommitted
            log.warning("memory snapshot of step %d is not sealed: %s", step, e)
            continue
        log.info("sealed memory snapshot of step %d (its commit was cut short)", step)
        return step
    return None


def _seal(
    step: int,
    by_rank: dict[int, dict[str, Any]],
    staging: str,
    mem: Storage,
    commit_seq: int,
    version: str,
) -> None:
    first = by_rank[min(by_rank)]
    world = first.get("world")
    if (
        type(world) is not int
        or not 1 <= world <= _MAX_WORLD
        or len(by_rank) != world
        or set(by_rank) != set(range(world))
    ):
        raise _Unsealable(
            f"records of ranks {sorted(by_rank)[:8]} were found, the job has {world!r} ranks"
        )
    # one run's ranks (a rank of an earlier run that died later must not fill a gap)
    for key in SHARED_KEYS:
        if any(r.get(key) != first.get(key) for r in by_rank.values()):
            raise _Unsealable(f"the ranks' records disagree on {key}")
    step_rel = step_dir_name(step)
    step_dir = os.path.join(mem.path(), step_rel)
    opened: list[tuple[int, str, int]] = []  # (fd, path now, inode)
    try:
        reports = []
        for rank in range(world):
            rec = by_rank[rank]
            fd, path = _open_staged(rec, rank, step, staging, step_dir)
            opened.append((fd, path, rec["ino"]))
            reports.append(_report(rec, rank, fd))
        mem.makedirs(step_rel)
        generation = next_generation(mem, step_rel)
        manifest = manifest_of_records(step, first, reports, generation, commit_seq, version)
        for r, (fd, path, ino) in zip(reports, opened, strict=True):
            _move(fd, path, ino, os.path.join(step_dir, r["file"]))
        garbage = publish_commit(
            mem,
            NodeLocal(),
            manifest,
            keep_last=2,
            keep_every=None,
            collect=lambda _info: False,  # a step being written by a live trainer stays
        )
    finally:
        for fd, _path, _ino in opened:
            os.close(fd)
    with contextlib.suppress(Exception):
        delete_dirs(mem, garbage)


def manifest_of_records(
    step: int,
    first: dict[str, Any],
    reports: list[dict[str, Any]],
    generation: int,
    commit_seq: int,
    version: str,
) -> Manifest:
    """The manifest of ``step`` committed from its staged records: rank 0's record ``first``
    (the parts every rank's shares: ``SHARED_KEYS``) and every rank's report (``_report``,
    in rank order; each report's ``file`` is set here, for ``generation``)."""
    layout = Layout.from_json(first["layout"])
    tensors = first["tensors"]
    if not isinstance(tensors, dict):
        raise _Unsealable("the tensor table is not a mapping")
    table = {}
    for k, d in tensors.items():
        t = TensorEntry.from_json(d, layout, f"staged record tensors[{k!r}]")
        table[k] = (t.dtype, t.shape, t.placement)
    plan = SimpleNamespace(tensors=table, digest=first["digest"])
    block_bytes = first["block_bytes"]
    if type(block_bytes) is not int or not 4096 <= block_bytes <= 1 << 30:
        raise _Unsealable(f"block_bytes {block_bytes!r} is out of range")
    for r in reports:
        name = rank_file_name(r["rank"], generation)
        r["file"] = name
        for c in r["chunks"].values():
            c["file"] = name
    return build_manifest(
        step,
        layout,
        plan,  # type: ignore[arg-type]
        reports,
        block_bytes=block_bytes,
        generation=generation,
        version=version,
        commit_seq=commit_seq,
        job_id=first["job_id"] if isinstance(first["job_id"], str) else "",
    )


def _move(fd: int, path: str, ino: int, dest: str) -> None:
    """Give the open file ``fd`` (inode ``ino``, at ``path``) the name ``dest`` instead of
    ``path`` (``link_open_file``, then ``path`` unlinked where it is still that file)."""
    link_open_file(fd, path, ino, dest)
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == ino:
            os.unlink(path)


def link_open_file(fd: int, path: str, ino: int, dest: str) -> None:
    """Give the open file ``fd`` (inode ``ino``, at ``path``) the name ``dest`` too: linked by
    its descriptor, so that whatever was put at ``path`` meanwhile is never the one linked (by
    name where /proc cannot link it, checked after)."""
    try:
        os.link(f"/proc/self/fd/{fd}", dest, follow_symlinks=True)
    except OSError:
        os.link(path, dest)
        if os.lstat(dest).st_ino != ino:
            os.unlink(dest)
            raise _Unsealable(f"{path} was replaced while it was being sealed") from None


def open_record_file(path: str, ino: int, size: int, step: int) -> int | None:
    """``path`` opened (without following a link or blocking on a FIFO) where it is the file a
    record names, inode ``ino``; None where it is another file or cannot be opened.  The file
    must then have the record's ``size`` and ``step`` in its header (_Unsealable otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != ino:
            os.close(fd)
            return None
        if st.st_size != size:
            raise _Unsealable(f"{path} has {st.st_size} bytes, its record says {size}")
        _check_header_step(fd, size, step, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_staged(
    rec: dict[str, Any], rank: int, step: int, staging: str, step_dir: str
) -> tuple[int, str]:
    """The rank's staged file (by inode, at its staging name or moved into the step's directory),
    open, checked to be that record's file: its size, and the step in its header."""
    ino, size = rec.get("ino"), rec.get("size")
    if type(ino) is not int or type(size) is not int or size < 8:
        raise _Unsealable(f"rank {rank}'s record has no file inode or size")
    places = []
    staged = rec.get("path")
    if (
        isinstance(staged, str)
        and os.path.dirname(staged) == ""
        and staged.endswith(".safetensors")
    ):
        places.append(os.path.join(staging, staged))
    with contextlib.suppress(OSError):
        prefix = f"rank_{rank:05d}."
        places += [
            os.path.join(step_dir, n)
            for n in sorted(os.listdir(step_dir))
            if n.startswith(prefix) and n.endswith(".safetensors")
        ]
    for path in places:
        fd = open_record_file(path, ino, size, step)
        if fd is not None:
            return fd, path
    raise _Unsealable(f"rank {rank}'s staged file (inode {ino}) is gone")


def _check_header_step(fd: int, size: int, step: int, path: str) -> None:
    head = os.pread(fd, 8, 0)
    (n,) = struct.unpack("<Q", head)
    if not 2 <= n <= min(_MAX_HEADER, size - 8):
        raise _Unsealable(f"{path} has no safetensors header")
    header = json.loads(os.pread(fd, n, 8))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("step") != str(step):
        raise _Unsealable(f"{path} holds another step than {step}")


def _in_parallel(checksums: Any, ranges: list[list[int]], block_bytes: int) -> list[int]:
    """``checksums`` of every block of ``ranges`` (in order), on the checksum threads: one job per
    thread, each a contiguous run of the blocks.  Returns (or raises the first failure) only once
    every job is over: none reads the file after its caller closes it."""
    blocks = [(at, min(block_bytes, e - at)) for b, e in ranges for at in range(b, e, block_bytes)]
    per = -(-len(blocks) // CRC_THREADS)
    jobs = [crc_pool().submit(checksums, blocks[i : i + per]) for i in range(0, len(blocks), per)]
    done, _ = wait(jobs, return_when=FIRST_EXCEPTION)
    if any(j.exception() is not None for j in done):
        wait(jobs)  # (the others still read: let them end first)
    return [crc for j in jobs for crc in j.result()]


def _report(rec: dict[str, Any], rank: int, fd: int) -> dict[str, Any]:
    """The rank's commit report, with the checksums of its chunks computed from the file (read,
    not mapped: a file cut short meanwhile is an error here, not a SIGBUS)."""
    chunks = rec.get("chunks")
    block_bytes, size = rec["block_bytes"], rec["size"]
    if not isinstance(chunks, dict) or not isinstance(rec.get("values"), dict):
        raise _Unsealable(f"rank {rank}'s record has no chunks or values")
    taken = rec.get("sums")  # (a sealed snapshot's) taken as it was copied
    if taken is not None and not isinstance(taken, dict):
        raise _Unsealable(f"rank {rank}'s record has malformed checksums")
    claimed = 0
    for key, c in chunks.items():
        if not isinstance(c, dict) or not isinstance(c.get("byte_range"), list):
            raise _Unsealable(f"rank {rank}'s chunk {key!r} is malformed")
        b, e = c["byte_range"]
        if not (type(b) is int and type(e) is int and 0 <= b <= e <= size):
            raise _Unsealable(f"rank {rank}'s chunk {key!r} lies outside its file")
        claimed += e - b
    if claimed > size:  # (a rank's chunks lie one after another in its file)
        raise _Unsealable(f"rank {rank}'s chunks claim {claimed} bytes of a {size}-byte file")

    def checksums(blocks: Any) -> list[int]:
        out = []
        for at, n in blocks:
            data = os.pread(fd, n, at)
            if len(data) != n:
                raise _Unsealable(f"rank {rank}'s file was cut short while it was being sealed")
            out.append(crc32(data))
        return out

    ranges = [c["byte_range"] for c in chunks.values()]
    if (
        claimed >= _PARALLEL_BYTES
        and block_bytes >= _PARALLEL_BLOCK
        and len(chunks) <= _PARALLEL_CHUNKS
        and CRC_THREADS > 1
    ):
        computed = iter(_in_parallel(checksums, ranges, block_bytes))
    else:  # (streamed: one block in memory at a time)
        computed = iter(
            checksums(
                (at, min(block_bytes, e - at)) for b, e in ranges for at in range(b, e, block_bytes)
            )
        )
    out: dict[str, Any] = {}
    for key, c in chunks.items():
        b, e = c["byte_range"]
        sums = [next(computed) for _ in range(b, e, block_bytes)]
        if taken is not None and taken.get(key) != sums:
            raise _Unsealable(
                f"rank {rank}'s chunk {key!r} does not match the checksums taken as it was "
                f"copied: the snapshot is damaged"
            )
        out[key] = {**c, "checksums": sums}
    return {
        "rank": rank,
        "file": "",
        "size_bytes": size,
        "chunks": out,
        "digest": rec["digest"],
        "num_tensors": len(rec.get("tensors") or ()),
        "values": rec["values"],
    }
