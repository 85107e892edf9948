"""Where a job's host-memory snapshots live on a node, and how much room they may take.

The memory tier stores snapshots in the checkpoint format itself (docs/FORMAT.md), in a directory
on the node's shared memory (``/dev/shm``, a tmpfs): the verified, resharding reader serves both
tiers, a snapshot outlives the processes that wrote it (not the node), and a crashed job's
snapshots are found again by the next run of the same job on that node.

Layout (docs/FORMAT.md, section 9)::

    <root>/                                 RESILIENT_MEMORY_ROOT, default /dev/shm/resilient-<uid>
      job-<16 hex>/                         one job: sha256 of its checkpoint URL (mode 0700)
        JOB.json                            {"url": ..., "created_unix_s": ...}: whose it is
        steps/                              a checkpoint directory (steps, manifests, lease)
        staging/rank_<R>.lock               held (flock) by the live process of rank R
        LINE.json                           where the job's line began at rank 0's last load

A job only ever reads, writes or deletes its own ``job-*`` directory: another job's snapshots
(another URL) are never touched, and a job directory that is not this user's own real directory
(a link, another owner, writable by others) or whose ``JOB.json`` is not a record of this URL is
refused, never adopted or removed.  Each rank holds a lock on its own name in ``staging/`` for
as long as it uses the tier (``MemoryPlace.hold``): a second job of the same URL on the same
memory root (whatever its job id), or a rank started twice, is refused there, before it reads,
replaces or removes any file of the live one's.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from resilient.checkpoint.catalog import Catalog, StepInfo
from resilient.checkpoint.format import (  # (ANCHOR_KEY: what every memory snapshot records)
    ANCHOR_EXACT_KEY,
    ANCHOR_KEY,
    MAX_INT,
    MAX_RUN,
    Manifest,
)
from resilient.checkpoint.storage import Storage
from resilient.errors import MemoryTierError, ResilientError

__all__ = [
    "ENV_LIMIT",
    "ENV_ROOT",
    "MemoryPlace",
    "RankHold",
    "default_root",
    "memory_place",
]

log = logging.getLogger(__name__)

ENV_ROOT = "RESILIENT_MEMORY_ROOT"
# An optional cap (bytes; K/M/G suffixes) on what this job's snapshots may use on a node, for nodes
# shared with other work; the tier refuses to start when its need exceeds it.
ENV_LIMIT = "RESILIENT_MEMORY_LIMIT"
JOB_FILE = "JOB.json"
STEPS_DIR = "steps"
STAGING_DIR = "staging"  # rank files being copied, sealed ones and their records (slots.py)
_MAX_JOB_FILE = 64 << 10
# How long a rank waits for the previous holder of its lock to let go (a process of the job's
# previous generation still exiting) before it takes the holder for another live job's
HOLD_WAIT_S = 3.0


def default_root() -> str:
    """``$RESILIENT_MEMORY_ROOT``, else ``/dev/shm/resilient-<uid>`` (else a temp dir, where there
    is no /dev/shm: memory only if that is a tmpfs)."""
    env = os.environ.get(ENV_ROOT)
    if env:
        return env
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/resilient-{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), f"resilient-memory-{os.getuid()}")


def job_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    try:
        value = int(float(digits) * scale)
    except (ValueError, OverflowError):  # "lots", "inf", "1e400"
        value = -1
    if value < 0:
        raise MemoryTierError(
            f"{ENV_LIMIT}={text!r} is not a size; expected bytes, optionally with K, M or G "
            f"(for example 8G)"
        )
    return value


def _overflow_uid() -> int:
    """The uid a user namespace shows for an owner it does not map (a rootless container sees
    the host's root, owner of the shared /dev/shm, as this): such a sticky root is taken as
    root's own, as it was before owners were checked."""
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 65534


class MemoryPlace:
    """One job's directory in a node's memory root."""

    def __init__(self, root: str, url: str) -> None:
        self.root = os.path.abspath(root)
        self.url = url
        self.dir = os.path.join(self.root, f"job-{job_key(url)}")
        self.steps = os.path.join(self.dir, STEPS_DIR)
        self.staging = os.path.join(self.dir, STAGING_DIR)

    def claim(self) -> None:
        """Create (or adopt) this job's directory; refuse one that is not this user's own real
        directory, or whose record names another URL (or is not a record at all)."""
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            self._check_root()
            try:
                os.mkdir(self.dir, 0o700)
            except FileExistsError:
                pass
            self._check_dir(self.dir, "directory")
            path = os.path.join(self.dir, JOB_FILE)
            owner = self._owner(path)
            if owner is None:
                record = {"url": self.url, "created_unix_s": time.time()}
                tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                os.replace(tmp, path)
            elif owner != self.url:
                raise MemoryTierError(
                    f"the memory tier's directory {self.dir} belongs to checkpoint URL "
                    f"{owner!r}, not {self.url!r} (a hash collision or a hand-made directory); it "
                    f"is left as it is: set {ENV_ROOT} to another directory"
                )
            # (the staging directory too: rank files are made, replaced and removed there by
            # name, and a link in its place would have that done wherever it points)
            for path, what in ((self.steps, "snapshot"), (self.staging, "staging")):
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    pass
                self._check_dir(path, f"{what} directory")
        except OSError as e:
            raise MemoryTierError(
                f"cannot use the memory tier's directory {self.dir}: {e}; set {ENV_ROOT} to a "
                f"writable directory on a tmpfs (such as /dev/shm), or turn the tier off "
                f"(memory_every=None)"
            ) from e

    def hold(self, rank: int, wait_s: float = HOLD_WAIT_S) -> RankHold:
        """Take rank ``rank``'s lock in this job's directory (after ``claim``), before any of its
        files is touched: the staging names, records and replicas of a rank are made, replaced
        and removed by name, so a second live process of that rank (another job of this URL on
        this memory root, or the same rank started twice) would destroy the first one's
        snapshots.  Raises MemoryTierError naming the holder when another live process has it."""
        path = os.path.join(self.staging, f"rank_{rank:05d}.lock")
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        deadline = time.monotonic() + wait_s
        collected = False
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:  # (a link or a FIFO planted there: O_NOFOLLOW, or no reader)
                raise MemoryTierError(
                    f"cannot open rank {rank}'s lock {path} of the memory tier: {e}; it is not "
                    f"this job's own: delete it if it is stale, or set {ENV_ROOT} to another "
                    f"directory"
                ) from e
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    raise MemoryTierError(
                        f"rank {rank}'s lock {path} of the memory tier is not a file of this "
                        f"user's (mode {st.st_mode:o}, uid {st.st_uid}): it is neither used nor "
                        f"removed; delete it if it is stale, or set {ENV_ROOT} to another "
                        f"directory"
                    )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
                    if holder == me and not collected:
                        # (this process's own: a checkpointer of this URL dropped unclosed
                        # lets go once it is collected; the finally closes this open first)
                        collected = True
                        os.close(fd)
                        fd = -1
                        collect_dropped()
                        # (the lock's own wait begins now: the letting go may end a moment
                        # after the reaper's turn, which may come past the first deadline)
                        deadline = time.monotonic() + wait_s
                        continue
                    if time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue  # (the finally closes fd)
                    if holder == me:
                        raise MemoryTierError(
                            f"rank {rank} of the memory tier's directory {self.dir} (checkpoint "
                            f"URL {self.url!r}) is in use by another checkpointer of this "
                            f"process ({me}), still referenced (by a name, such as the one a "
                            f"notebook cell run again rebinds only once this one is made, or by "
                            f"the traceback of an exception it raised) or still saving after "
                            f"{wait_s:.0f} s, and not closed; expected none: close it "
                            f"(Checkpointer.close) before making another for this URL, or drop "
                            f"every reference to it (one dropped unclosed lets go once it is "
                            f"collected)"
                        ) from None
                    raise MemoryTierError(
                        f"rank {rank} of the memory tier's directory {self.dir} (checkpoint URL "
                        f"{self.url!r}) is in use by another live process "
                        f"({holder or 'unknown'}): a second job of this checkpoint URL on this "
                        f"memory root, or this rank started twice; expected no live holder after "
                        f"{wait_s:.0f} s. Nothing of that job's was touched: stop it first, or "
                        f"give this job another checkpoint URL or {ENV_ROOT}"
                    ) from None
                if not os.path.lexists(path) or os.lstat(path).st_ino != st.st_ino:
                    # unlinked by a holder that was letting go: a lock on that file is nobody's
                    # (a third process may lock a new one at the name): take the name's
                    continue  # (the finally closes fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, me.encode(), 0)
                hold = RankHold(fd, path)
                fd = -1
                return hold
            finally:
                if fd >= 0:
                    os.close(fd)

    def _check_root(self) -> None:
        """The root holds the job's directory: not a link, not another user's (the owner of a
        directory may rename what is in it, sticky bit or not: root excepted, as for /dev/shm
        itself), and not a place where others could move it away (writable by others without
        the sticky bit)."""
        st = os.lstat(self.root)
        problem = None
        if stat.S_ISLNK(st.st_mode):
            problem = "is a symbolic link"
        elif st.st_uid not in (os.getuid(), 0) and not (
            st.st_mode & stat.S_ISVTX and st.st_uid == _overflow_uid()
        ):
            problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}) or root"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            problem = (
                f"is writable by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
            )
        if problem:
            raise MemoryTierError(
                f"the memory tier's root {self.root} {problem}: another user could replace this "
                f"job's directory; set {ENV_ROOT} to a directory of your own (for example "
                f"/dev/shm/resilient-{os.getuid()})"
            )

    def _check_dir(self, path: str, what: str) -> None:
        st = os.lstat(path)
        problem = None
        if stat.S_ISLNK(st.st_mode):
            problem = "is a symbolic link"
        elif not stat.S_ISDIR(st.st_mode):
            problem = "is not a directory"
        elif st.st_uid != os.getuid():
            problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        elif st.st_mode & 0o022:
            problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
        if problem:
            raise MemoryTierError(
                f"the memory tier's {what} {path} {problem}: it is not this job's own, so it is "
                f"neither used nor removed; delete it if it is stale, or set {ENV_ROOT} to "
                f"another directory"
            )

    def _owner(self, path: str) -> str | None:
        """The URL the job record names; None when there is no record yet."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_JOB_FILE:
            return "(not a job record)"
        try:
            with open(path, "rb") as f:
                record = json.loads(f.read(_MAX_JOB_FILE))
        except (OSError, ValueError, RecursionError):
            return "(not a job record)"
        url = record.get("url") if isinstance(record, dict) else None
        return url if isinstance(url, str) else "(not a job record)"

    def used_bytes(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.dir):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
        return total

    def check_room(self, need_bytes: int) -> None:
        """Raise MemoryTierError when the node cannot hold ``need_bytes`` of this job's snapshots
        (what the job holds there already counts as room: it is replaced)."""
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize + self.used_bytes()
        limit_text = os.environ.get(ENV_LIMIT)
        limit = _parse_bytes(limit_text) if limit_text else None
        room = free if limit is None else min(free, limit)
        if need_bytes <= room:
            return
        where = (
            f"{ENV_LIMIT}={limit_text}"
            if limit is not None and limit < free
            else f"{_fmt(free)} free in {self.root}"
        )
        raise MemoryTierError(
            f"the memory tier needs {_fmt(need_bytes)} of host memory on this node (two "
            f"snapshots, one peer replica and one snapshot being persisted, of this node's "
            f"ranks' state) but has {where}. "
            f"Give the node more shared memory (docker run --shm-size, or a larger /dev/shm), "
            f"point {ENV_ROOT} at a larger tmpfs, snapshot less state, or turn the tier off "
            f"(memory_every=None / --memory-every 0)"
        )

    def release(self) -> bool:
        """Give the memory back: remove this job's directory (never anything else: a link in
        its place is not followed), unless a persister process still holds its lock (a flush
        that outlived its trainer's wait: its step may be the newest, and it persists from
        here).  Whether the directory is gone; a kept one is reclaimed by the next run."""
        if not os.path.isdir(self.dir) or os.path.islink(self.dir):
            return True
        try:
            fd = os.open(os.path.join(self.dir, PERSISTER_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # no persister ever ran here (or the name is not a plain file)
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    log.warning(
                        "the memory tier's directory %s is kept: a persister process is still "
                        "writing a snapshot from it to durable storage (see its %s); the next "
                        "run of the job reclaims it",
                        self.dir,
                        "persister.log",
                    )
                    return False
            shutil.rmtree(self.dir, ignore_errors=True)  # (holding the lock: none starts here)
            return not os.path.lexists(self.dir)
        finally:
            if fd is not None:
                os.close(fd)

    def release_if_empty(self, hold: RankHold | None = None) -> None:
        """Remove this job's directory if it holds no snapshot (a start refused before its
        first one: a crashed run's snapshots are left for the next run to restore); ``hold``,
        this process's lock, goes first."""
        if hold is not None:
            hold.close(remove=True)
        try:
            for d in (self.steps, self.staging):
                if os.path.isdir(d) and not os.path.islink(d):
                    os.rmdir(d)  # only when empty
            left = sorted(os.listdir(self.dir))
            if left in ([JOB_FILE], [JOB_FILE, LINE_FILE]):  # (anything else: its record stays)
                for name in reversed(left):
                    os.unlink(os.path.join(self.dir, name))
                os.rmdir(self.dir)
        except OSError:  # something is in it (or another rank of the node removed it first)
            pass


class RankHold:
    """A rank's lock on its files in the job's directory (``MemoryPlace.hold``), held until
    ``close`` (or until the process ends: the kernel lets go of a dead process's lock)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        _HOLDS.add(self)

    def close(self, remove: bool = False) -> None:
        """Let go; with ``remove``, its file goes first (while still held: a process that opens
        the name after that makes a file of its own)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if remove and os.lstat(self.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __del__(self) -> None:  # (a checkpointer dropped unclosed)
        self.close()


# Every live hold of this process: a fork of it (a DataLoader's worker, forked after the
# checkpointer was made) lets go of its copies at once (_let_go_in_child)
_HOLDS: weakref.WeakSet[RankHold] = weakref.WeakSet()


def _let_go_in_child() -> None:
    """(in a child forked from a process that holds ranks' locks) The child shares each lock's
    open file, and a lock (flock) lasts while any process has it open: a child that outlived its
    rank (a DataLoader worker is told of its parent's death only every few seconds) held the
    rank's lock, and the rank's restart was refused as a second live process.  Closing the
    child's copy leaves the parent's lock as it is; the child's holds do nothing from then on."""
    for hold in list(_HOLDS):
        with contextlib.suppress(OSError):
            hold.close()  # (not remove: the name is the parent's)


os.register_at_fork(after_in_child=_let_go_in_child)


def memory_place(url: str, root: str | None = None) -> MemoryPlace:
    return MemoryPlace(root or default_root(), url)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# The lock a persister process holds on its job's memory directory while it runs
# (persister.py): the directory is not given back under it.
PERSISTER_LOCK = "PERSISTER.lock"


def _collect() -> None:
    gc.collect()


# What a rank's lock held by this process itself waits for, once (MemoryPlace.hold): a collection,
# and (set by checkpointer.py) the letting go of the checkpointers it dropped, which a thread of
# their own does
collect_dropped: Callable[[], None] = _collect


def _parse_anchor(anchor: Any) -> tuple[int, int] | None:
    if isinstance(anchor, str) and anchor.count(":") == 1:
        a, q = anchor.split(":")
        # (ASCII digits: str.isdigit also takes "²", which int() refuses)
        if a.isascii() and q.isascii() and a.isdigit() and q.isdigit() and len(a) < 20 > len(q):
            return int(a), int(q)
    return None


def exact_anchor(snap: Manifest, durable: Catalog | None, line: set[int]) -> tuple[int, int] | None:
    """The durable commit a snapshot's state descends from exactly, or None: its anchor, where rank
    0 recorded that no durable save was in flight when the snapshot was taken (ANCHOR_EXACT_KEY:
    the newest durable commit_seq known when the anchor was set) and the durable line (``line``,
    steps of ``durable``) holds no commit above that numbered at or below the snapshot's step (a
    flush or a durable save of the snapshot since: its state's commit, which the line must not
    skip).  The parent a durable commit of a job restored from the snapshot, or of its flush,
    records (format.PARENT_KEY)."""
    seen = snap.extras.get(ANCHOR_EXACT_KEY)
    if type(seen) is not int or not 0 <= seen <= MAX_INT or durable is None:
        return None
    anchor = _parse_anchor(snap.extras.get(ANCHOR_KEY))
    if anchor is None or anchor[1] > seen:
        return None
    for s in line:
        info = durable.get(s)
        if info is not None and s <= snap.step and info.commit_seq > seen:
            return None
    return anchor


# (rank 0's node; across nodes, every node's) where the job's line began last: the newest
# commit order in memory when the job last loaded a step (docs/FORMAT.md, section 9)
LINE_FILE = "LINE.json"
LINE_FORMAT = "resilient-line/1"
_MAX_LINE_FILE = 4 << 10


def mark_line_start(job_dir: str, after: int | None, restored: int | None = None) -> None:
    """(rank 0, and across nodes every node's leader, after each load) The job's line begins
    here: only snapshots numbered above ``after`` (taken since this load) descend from what it
    restored, and the snapshot it restored (``restored``: its commit order in memory, where the
    load restored one) is that state itself.  None (the node's memory could not be listed)
    removes the mark: no snapshot is taken for a newer line then."""
    path = os.path.join(job_dir, LINE_FILE)
    try:
        if after is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                record: dict[str, Any] = {"format": LINE_FORMAT, "after": after}
                if restored is not None:
                    record["restored"] = restored
                json.dump(record, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # (else one is left at each load: a full tmpfs, a planted name)
            raise
    except OSError as e:
        log.warning("the memory tier cannot record where this job's line begins (%s): %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(path)  # (an older mark would let a snapshot of the line left count)


def line_start(job_dir: str) -> int | None:
    """Where the job's line began at rank 0's last load (``mark_line_start``), or None: no mark,
    or anything but a regular file of at most 4 KiB holding that record."""
    return line_mark(job_dir)[0]


def line_mark(job_dir: str) -> tuple[int | None, int | None]:
    """(``line_start``, the commit order of the snapshot rank 0's last load restored, or None)."""
    try:
        fd = os.open(os.path.join(job_dir, LINE_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None, None
    try:  # (a directory there: fdopen refuses it, so the type is asked first)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return None, None
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(_MAX_LINE_FILE + 1)
            record = json.loads(data) if len(data) <= _MAX_LINE_FILE else None
        except (OSError, ValueError, RecursionError):
            return None, None
    if not isinstance(record, dict) or record.get("format") != LINE_FORMAT:
        return None, None
    after, restored = record.get("after"), record.get("restored")
    if type(after) is not int or not 0 <= after <= MAX_INT:
        return None, None
    return after, restored if type(restored) is int and 0 <= restored <= MAX_INT else None


def newer_line(
    snap: Manifest, durable: Catalog | None, after: int | None, restored: int | None = None
) -> tuple[int, int] | None:
    """The durable commit a snapshot descends from, where the snapshot is the job's newest state
    although the newest durable step is numbered above it (a rollback to an older step, then
    snapshots, then a fault before any durable save: the newest durable step is on the branch
    the rollback left); else None.  So it is only where its anchor is exact (ANCHOR_EXACT_KEY:
    the newest durable commit_seq its job knew of when the anchor was set, ``seen``), that
    commit is still committed with that commit_seq, nothing was committed durably above
    ``seen`` since (no save of this job, or of a later run or another job, that would be newer),
    and the snapshot was taken since rank 0's last load (its commit order above ``after``, that
    load's ``line_start``: a load since, say of the newer step again, begins another line), or
    is the very snapshot that load restored (``restored``: a fault before the restored job's
    first snapshot still resumes it)."""
    if durable is None or after is None:
        return None
    if snap.commit_seq <= after and snap.commit_seq != restored:
        return None
    seen = snap.extras.get(ANCHOR_EXACT_KEY)
    if type(seen) is not int or not 0 <= seen <= MAX_INT:
        return None
    anchor = _parse_anchor(snap.extras.get(ANCHOR_KEY))
    if anchor is None or anchor[1] > seen or durable.next_commit_seq() - 1 > seen:
        return None
    info = durable.get(anchor[0])
    if info is None or info.state != "committed" or info.commit_seq != anchor[1]:
        return None
    run = snap.commit_seq >> RUN_SHIFT
    if run and any(_after_run(i, run) for i in durable.committed):
        # a commit made since all the same, at or below ``seen`` (the newest commit its job knew
        # of was deleted by hand, and a later commit took its commit_seq again)
        return None
    return anchor


def _after_run(info: StepInfo, run: int) -> bool:
    """Whether durable commit ``info`` was made after the memory tier counted run ``run``: it
    records a later run, or no run and having seen ``run`` counted (format.RUNS_SEEN_KEY)."""
    return info.run > run or (not info.run and info.runs_seen >= run)


def stale_snapshot(snap: Manifest, durable: Catalog | None, line: set[int]) -> str | None:
    """Why a snapshot (its manifest: its anchor, job, step, and run, its commit order's, see
    number_this_run; 0 for none) must not be restored, or None.  The run that made each durable
    commit is the one its manifest records, read with it when durable storage was listed (so no
    second read can fail and leave it unknown)."""
    anchor = snap.extras.get(ANCHOR_KEY)
    why = _stale(anchor, snap.job_id, durable, line)
    run = snap.commit_seq >> RUN_SHIFT
    if why is not None or not run or durable is None:
        return why
    # A durable commit on the line made after the snapshot's anchor by a later run of the job:
    # that run never saw this snapshot (its node sat the run out), and its line is the newer one
    # (as a durable commit supersedes older ones, not higher-numbered ones).  The same run's
    # commit is no such sign: a durable save in flight while the snapshot was taken.  Nor is a
    # commit of a later step (a rollback to this step by name: that run may descend from it).
    parsed = _parse_anchor(anchor)
    after = known = parsed[1] if parsed is not None else -1
    seen = snap.extras.get(ANCHOR_EXACT_KEY)
    if parsed is not None and type(seen) is int and parsed[1] <= seen <= MAX_INT:
        # nor one its job knew of when it set the anchor (a rollback by name past it: on the
        # branch the job left, made before this snapshot)
        known = seen
    for s in sorted(line, reverse=True):
        info = durable.get(s)
        if info is None or info.commit_seq <= after or s > snap.step:
            continue
        if info.commit_seq <= known and not _after_run(info, run):
            # (a commit that records a run counted after this snapshot's began, or having seen
            # it counted, was made since all the same: the newest commit this job knew of was
            # deleted by hand, and a later commit took its commit_seq again)
            continue
        later = info.run
        if later > run:
            return (
                f"durable step {s} was committed since by a later run of the job (run {later}, "
                f"this snapshot's is {run}), which did not see it: that run's line is newer"
            )
        if later and later != run and info.uncounted:
            # A run that could not be counted records the run its memory numbering uses, an
            # earlier run's: it numbers all its snapshots so, and a snapshot of a later run than
            # that is one it never saw (else its numbering would be above it): its line is newer.
            return (
                f"durable step {s} was committed since by a run of the job that was not counted "
                f"(numbered as run {later}, this snapshot's is {run}), which did not see it: "
                f"that run's line is newer"
            )
        if not later and (
            parsed is not None or info.job_id != snap.job_id or info.runs_seen >= run
        ):
            # A commit that records no run: the tier off (a later run without it, which did not
            # see this snapshot: its line is newer), whatever its job id (torchrun's --rdzv-id,
            # or one store address, is the same in every run).  Not this snapshot's own run: one
            # whose count could not be written records the run its commits in memory are
            # numbered as (none only where no memory held a run: its snapshots, run 0, are not
            # compared), so its save in flight when this was taken does not count against it.
            # (A snapshot taken before its job knew of any durable commit, anchor "", is
            # compared with commits made before its run too: only another job's count against
            # it, and one of this job's that records having seen the snapshot's run counted,
            # RUNS_SEEN_KEY: made after that run began, by a run that could not see its memory.)
            who = (
                f"another job ({info.job_id!r})"
                if info.job_id != snap.job_id
                else f"a run of this job ({info.job_id!r}) without the memory tier"
            )
            return (
                f"durable step {s} was committed since by {who} that did not see it: that line "
                f"is newer"
            )
    return None


def _stale(anchor: Any, job_id: str, durable: Catalog | None, line: set[int]) -> str | None:
    """Why a snapshot (taken by ``job_id``) descended from durable commit ``anchor`` must not be
    restored, as the anchor says, or None."""
    if anchor is None:
        return "it records no durable commit it descends from"
    if anchor == "":
        # taken before this job knew of any durable commit: fine while every commit on the line
        # is this job's own (its first save may have been in flight), not after another job's
        others = (
            sorted({info.job_id for s in line if (info := durable.get(s)) is not None} - {job_id})
            if durable is not None
            else []
        )
        if others:
            return (
                f"it was taken before any durable commit, and durable storage now has commits "
                f"by another job ({others[0]!r})"
            )
        return None
    parsed = _parse_anchor(anchor)
    if parsed is None:
        return f"its durable anchor {str(anchor)[:64]!r} does not parse"
    info = durable.get(parsed[0]) if durable is not None else None
    if info is None and durable is not None:
        # pruned by retention once a newer commit of the line landed (a save that was in
        # flight when the snapshot was taken), or deleted by hand (then nothing newer is there)
        newer = [i for t in line if (i := durable.get(t)) is not None and i.commit_seq > parsed[1]]
        if newer:
            return None
    if info is None or info.state != "committed" or info.commit_seq != parsed[1]:
        return (
            f"the durable commit it descends from (step {parsed[0]}, commit {parsed[1]}) is no "
            f"longer in durable storage"
        )
    if parsed[0] not in line:
        return (
            f"the durable commit it descends from (step {parsed[0]}) is on an abandoned branch "
            f"(a rollback happened since)"
        )
    return None


# The runs of a job that used the memory tier, counted in durable storage (docs/FORMAT.md,
# section 9).  Each node's memory outlives runs, and a node can sit out a run and come back with
# snapshots whose commit order was counted apart from that run's: a run's commits in memory are
# numbered from ``run << RUN_SHIFT`` up, so a later run's outrank an earlier one's on every node.
MEMORY_RUNS_NAME = "MEMORY_RUNS.json"
# The run that made a durable commit is in its manifest's extras (RUN_KEY, format.py; a memory
# snapshot's is in its commit order): a snapshot is stale once a later run committed to the
# durable line.
MEMORY_RUNS_FORMAT = "resilient-memory-runs/1"
RUN_SHIFT = 32  # commits per run, at most 2**32
# a commit order no run reaches counting one per commit (a damaged or hand-made manifest's)
IMPLAUSIBLE_SEQ = 1 << 62
# (MAX_RUN, format.py: run << RUN_SHIFT stays far below the commit order no run reaches)
_MAX_RUNS_FILE = 4 << 10


def number_this_run(
    storage: Storage, seen: int, recorded: Callable[[], int] = lambda: 0
) -> int | None:
    """(rank 0 of a job with the memory tier, where its checkpointer is made) One past the runs
    counted at the durable URL and past ``seen`` (the newest run the nodes' memory records),
    written back before it is returned; where there is no count, or a damaged one, past
    ``recorded()`` too (the newest run the durable commits record, their own or, the tier off,
    the runs they saw counted: a count lost or damaged never goes back below a run that
    committed, nor below one a commit without the tier came after).  None, with a warning,
    where the count cannot be read (a storage error: written from ``seen`` alone, it could go
    back below a run it missed) or written: the run's commits are then ordered as the nodes'
    memory alone says (README, "Across nodes")."""
    where = storage.display(MEMORY_RUNS_NAME)
    counted, why = 0, None
    try:
        data: bytes | None = storage.read_small(MEMORY_RUNS_NAME, _MAX_RUNS_FILE)
    except ResilientError as e:
        data = None
        if not isinstance(e.__cause__, FileNotFoundError):  # (none yet: the job's first run)
            if not _refused(e):
                _warn(
                    f"{where}, the memory tier's count of this job's runs, cannot be read ({e}); "
                    f"this run's snapshots are ordered as the nodes' memory alone says"
                )
                return None
            why = f"it cannot be read ({e})"
    if data is not None:
        try:
            counted = _parse_count(data)
        except (ValueError, RecursionError) as e:  # (json's errors; nesting beyond its depth)
            why = f"it is not a count of runs: {str(e)[:200]}"
    if why is not None:
        _warn(f"{where}, the memory tier's count of this job's runs: {why}; it is written anew")
    if data is None or why is not None:
        seen = max(seen, recorded())
    run = max(counted, seen) + 1
    if run >= MAX_RUN:
        _warn(f"{where}: {run} runs of this job is more than the tier counts ({MAX_RUN - 1})")
        return None
    record = {"format": MEMORY_RUNS_FORMAT, "runs": run, "unix_s": round(time.time(), 3)}
    try:
        if storage.is_local:  # (a job's first save makes it too; an object store has none)
            storage.makedirs("")
        storage.publish(MEMORY_RUNS_NAME, json.dumps(record).encode())
    except Exception as e:
        _warn(
            f"the memory tier's count of this job's runs cannot be written to {where} ({e}); "
            f"this run's snapshots are ordered as the nodes' memory alone says"
        )
        return None
    return run


def _parse_count(data: bytes) -> int:
    """The runs a MEMORY_RUNS.json record counts; ValueError (or json's RecursionError) where it
    is anything but that record."""
    record = json.loads(data)
    runs = record.get("runs") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != MEMORY_RUNS_FORMAT:
        raise ValueError(f"expected a {MEMORY_RUNS_FORMAT!r} record")
    if type(runs) is not int or not 0 <= runs < MAX_RUN:
        raise ValueError(f"expected 'runs' an int in [0, {MAX_RUN}), found {runs!r:.40}")
    return runs


def runs_counted(storage: Storage) -> int:
    """(a commit without the memory tier) The runs with the tier counted at the URL: 0 where
    there is no count, or it cannot be read or is damaged (the commit then records none, and
    orders nothing against a snapshot whose anchor is "", as before there was a count)."""
    try:
        return _parse_count(storage.read_small(MEMORY_RUNS_NAME, _MAX_RUNS_FILE))
    except (ResilientError, ValueError, RecursionError):
        return 0


def _refused(e: ResilientError) -> bool:
    """Whether a read refused the file itself (a link, a directory, too large: damaged, written
    anew) rather than failed (storage.py raises a failure from its cause)."""
    return e.__cause__ is None


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, stacklevel=4)
