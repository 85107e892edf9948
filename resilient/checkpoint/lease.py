"""The writer lease: one job at a time writes to a checkpoint URL.

Two jobs saving to one URL would damage each other: each would garbage-collect the other's steps in
progress, and both could write the same step.  So the coordinator of a job takes a lease before its
first save (``LEASE.json`` at the root: job id, host, pid and a random token), renews it from a
daemon thread, checks it is still its own before every commit, and removes it at ``close()``
(only while it is its own: ``Storage.remove_if``).  A job that finds another job's lease gets a
:class:`~resilient.errors.LeaseError` naming that owner.

Only a taker ever writes ``LEASE.json``; the holder's heartbeat is a file of its own,
``LEASE.beat.<token>`` (a counter), so a renewal can never write over a takeover: a holder that
read its own token, then was overtaken before its write, would otherwise have put its record back
over its successor's and held the lease again (a stale writer committing over the successor).

Who may take a lease held by someone else:

* the same job (same ``job_id``: a torchrun restart of the same run) takes it at once;
* a lease whose owner ran on this host and whose process is gone (pid not running, or running a
  different process) is taken at once, and so is one this very process left behind (a lease of
  its own released while the file could not be read);
* any other lease is stale only when neither its record nor its heartbeat file has changed for
  ``timeout_s`` as measured here, on this host's monotonic clock (never by comparing clocks across
  hosts): the taker watches them for that long, and fails as soon as it sees a heartbeat.

A lease file that does not parse is treated like a silent owner (watched, then taken).  Races
between two takers are settled by re-reading after writing: a taker that does not find its own
token afterwards has lost.  On a local disk the first lease is created with ``link()``, which
fails if the file appeared meanwhile.

A release on a local disk judges ``LEASE.json`` by renaming it aside
(``LEASE.json.released-<its token>-<hex>``, ``Storage.remove_if``), so for a moment there is no
``LEASE.json``; and a release cut short there (a crash) leaves it so.  Whoever then finds no
``LEASE.json`` (a check, a renewal, a taker) first puts back a set-aside record that is not its
releaser's own, which is all the release would have done with it: that is the record of a
successor who took the lease over just before the rename, still the lease (``link()``, so never
over a lease written since; then the set-aside name goes).  A set-aside record that is its releaser's own is released: the
lease is free.  A holder removes set-aside files older than ``timeout_s`` (or whose releaser is
gone) at its acquire and release; a younger one may be in a release's hands still.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from resilient.checkpoint.storage import Storage
from resilient.errors import LeaseError, ResilientError, StorageError

__all__ = ["LEASE_NAME", "LeaseRecord", "WriterLease", "default_job_id"]

log = logging.getLogger(__name__)

LEASE_NAME = "LEASE.json"
BEAT_PREFIX = "LEASE.beat."  # + the holder's token: its heartbeat (written by the holder only)
_TOKEN_RE = re.compile(r"[0-9a-f]{16}")
_MAX_LEASE_BYTES = 64 << 10
# A lease record's own timeout is honoured up to this (a record cannot make takers wait a year).
MAX_WATCH_S = 3600.0


def default_job_id() -> str:
    """The job's identity, the same in every rank and across torchrun restarts of one run:
    torchrun's run id (``--rdzv-id``); when it is torchrun's default ``none``, which does not tell
    two jobs apart, with the address of the job's store; without torchrun, the process group's
    store address; in a single process, a fresh id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    where = f"{addr}:{port}" if addr and port else ""
    if where and _host_local(addr or ""):  # 127.0.0.1:29500 on two hosts is two jobs
        where = f"{where}@{socket.gethostname()}/{_boot_id()}"
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    if run_id:
        return f"torchrun:{run_id}@{where}"
    if where and _world_size() > 1:
        return f"pg@{where}"
    return f"process:{uuid.uuid4().hex[:12]}"


def _world_size() -> int:
    """The job's world size: the environment's (env:// launchers), else the default process
    group's where one is initialized (``init_process_group(rank=..., world_size=...)`` with only
    MASTER_ADDR and MASTER_PORT set: every rank must still get the same id, or the memory tier's
    staged records of one snapshot disagree and are never sealed).  torch.distributed is looked
    up, not imported: the persister runs this module without torch."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            world = max(world, dist.get_world_size())
    except Exception:  # (a group being torn down)
        pass
    return world


def _host_local(addr: str) -> bool:
    return addr in ("localhost", "::1", "0.0.0.0") or addr.startswith("127.")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class LeaseRecord:
    job_id: str
    token: str
    host: str
    machine: str  # hostname, boot id and pid namespace: where ``pid`` means something
    pid: int
    pid_start: str  # the owner process's start time (/proc), to tell a reused pid apart
    acquired_unix_s: float
    heartbeat_unix_s: float  # for people reading the file; never compared across hosts
    beat: int  # (1: the heartbeat counter is in the holder's LEASE.beat.<token>)
    timeout_s: float

    def describe(self) -> str:
        return (
            f"job {self.job_id!r} (host {self.host}, pid {self.pid}, lease taken at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.acquired_unix_s))})"
        )

    def to_bytes(self) -> bytes:
        return json.dumps({"format": "resilient-lease-v1", **asdict(self)}, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord | None:
        """The record, or None when the file is not one (torn, foreign, a field of the wrong type
        or out of range): such a lease is treated as a silent owner of unknown identity."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.pop("format", None) != "resilient-lease-v1":
                return None
            r = cls(**d)
        except (ValueError, TypeError, RecursionError):
            return None
        strings = ("job_id", "token", "host", "machine", "pid_start")
        if not all(isinstance(getattr(r, f), str) and len(getattr(r, f)) <= 1024 for f in strings):
            return None
        if not all(
            isinstance(getattr(r, f), int) and not isinstance(getattr(r, f), bool)
            for f in ("pid", "beat")
        ) or not (1 <= r.pid < 1 << 31 and 0 <= r.beat < 1 << 62):
            return None
        for f in ("acquired_unix_s", "heartbeat_unix_s", "timeout_s"):
            v = getattr(r, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e12:
                return None
        return r if r.timeout_s > 0 else None

    def watch_s(self, own_timeout_s: float) -> float:
        """How long a taker must see this lease unchanged before taking it over: the longer of
        its own timeout and the owner's (the owner renews only every ``timeout_s / 4``), capped
        at MAX_WATCH_S."""
        return max(own_timeout_s, min(self.timeout_s, MAX_WATCH_S))


def _process_start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _machine() -> str:
    """This host, boot and pid namespace: two containers on one host share a hostname or a boot id
    but not a pid namespace, and a pid is only meaningful inside its own."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "/".join(parts)


def _gone(record: LeaseRecord) -> bool:
    """Whether the owner ran on this machine (same host, boot and pid namespace) and is no longer
    running."""
    if not record.machine or record.machine != _machine() or "//" in record.machine:
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: running
        return False
    start = _process_start(record.pid)
    if start and record.pid_start and start != record.pid_start:
        return True  # the pid is another process's now
    return _dead(record.pid)  # (a zombie: exited, its parent has not reaped it yet)


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited and awaits its parent's wait() (state Z or X)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


# the tokens of this process's leases that are held now (a record of this process with another
# token is an orphan: its lease was released without removing the file, or lost)
_HELD: set[str] = set()


def _this_process(record: LeaseRecord) -> bool:
    """Whether ``record`` is an orphan of this very process: written by a lease of its own that is
    no longer held (released when its file could not be read, so it stayed); not another live
    Checkpointer's of this process, which is a writer like any other.  Only where the machine and
    the process's start time are known (``/proc``): a host name and a pid alone prove nothing."""
    if record.token in _HELD or "//" in record.machine or not record.pid_start:
        return False
    return is_process(record, os.getpid(), _process_start(os.getpid()))


def is_process(record: LeaseRecord, pid: object, start: object) -> bool:
    """Whether ``record`` was written by the process ``pid`` (started at ``start``) on this
    machine."""
    return record.machine == _machine() and record.pid == pid and record.pid_start == start


class WriterLease:
    """The lease of one Checkpointer's coordinator on one URL (see the module docstring).

    ``acquire()`` (blocking, up to ``timeout_s`` when a silent owner must be watched), ``check()``
    before each commit, ``release()`` at close.  Renewal runs on a daemon thread every
    ``timeout_s / 4``; a renewal that finds another owner's token marks the lease lost, and the
    next ``check()`` raises.
    """

    def __init__(
        self,
        storage: Storage,
        job_id: str,
        *,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be positive, got {timeout_s}")
        self.storage, self.job_id, self.timeout_s = storage, job_id, timeout_s
        self.clock, self.sleep = clock, sleep
        # a local disk creates the first lease exclusively (link); elsewhere two takers can race
        self.settle_s = 0.0 if storage.is_local else min(1.0, timeout_s / 10)
        self.token = secrets.token_hex(8)
        self.record: LeaseRecord | None = None  # ours, while held
        self.taken_over: LeaseRecord | None = None  # whose lease we took, if anyone's
        self._lost: str | None = None
        # our record as the last check read it, held open, and its stat key (see check); the
        # renewal thread may let go of it (_lose) while a check takes it: under _held_lock
        self._held_file: tuple[int, tuple[Any, ...]] | None = None
        self._held_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0

    @property
    def held(self) -> bool:
        return self.record is not None and self._lost is None

    # --- reading and writing the record -------------------------------------------------------
    def _read(self) -> tuple[bytes | None, LeaseRecord | None]:
        try:
            data = self.storage.read_small(LEASE_NAME, _MAX_LEASE_BYTES)
        except ResilientError as e:
            if not self.storage.exists(LEASE_NAME):
                return None, None
            # there, but unreadable (too large, a link, ...): a silent owner of unknown identity
            return f"unreadable: {e}".encode(), None
        return data, LeaseRecord.from_bytes(data)

    def _read_settled(self) -> tuple[bytes | None, LeaseRecord | None]:
        """``_read()``, where a missing lease file that a release set aside (in progress, or
        cut short) and that was not its releaser's own is put back first (see the module
        docstring): a successor's record is never taken for "no lease" (its holder would give
        it up for good, and another job would take the lease while it writes)."""
        data, current = self._read()
        if data is not None or not self.storage.is_local:
            return data, current
        for _ in range(4):  # (each round: another release set it aside again meanwhile)
            if not self._put_back_aside():
                break
            data, current = self._read()
            if data is not None:
                return data, current
        return self._read()  # (a release may have put it back itself since the first read)

    def _put_back_aside(self) -> bool:
        """Put back a set-aside lease file that is not its releaser's own record, if there is
        one; True when one was found (put back now, or by someone else just before)."""
        for aside in self.storage.set_aside(LEASE_NAME):
            try:
                data = self.storage.read_small(aside.rel, _MAX_LEASE_BYTES)
            except ResilientError:
                if not self.storage.exists(aside.rel):
                    return True  # its release ended just now: read LEASE.json again
                continue  # (not a lease file: left to the sweep)
            record = LeaseRecord.from_bytes(data)
            if aside.tag and record is not None and record.token == aside.tag:
                continue  # its releaser's own record, being removed: released
            if aside.age_s > (record.watch_s(self.timeout_s) if record else self.timeout_s):
                # set aside longer ago than its holder renews (a renewal puts it back): no live
                # holder's, but left by a crash (an earlier version's untagged one, a successor
                # dead since), and the lease is free (the file is left to the sweep)
                continue
            if self.storage.put_back(aside.rel, LEASE_NAME):
                log.warning(
                    "%s: put back the writer lease of %s (%s) that a release had set aside",
                    self.storage.display(aside.rel),
                    self.storage.url,
                    record.describe() if record else f"unreadable: {data[:80]!r}",
                )
            return True
        return False

    def _sweep_asides(self) -> None:
        """(the holder, best effort) Remove lease files that releases cut short left set aside:
        those set aside over ``timeout_s`` ago, and a releaser's own record whose releaser is
        gone; never a younger one, which a release may still be judging."""
        try:
            for aside in self.storage.set_aside(LEASE_NAME):
                stale = aside.age_s > self.timeout_s
                if not stale and aside.tag:
                    try:
                        record = LeaseRecord.from_bytes(
                            self.storage.read_small(aside.rel, _MAX_LEASE_BYTES)
                        )
                    except ResilientError:
                        continue
                    stale = (
                        record is not None
                        and record.token == aside.tag
                        and (_gone(record) or _this_process(record))
                    )
                if stale:
                    log.info("removing %s, left by a release cut short", aside.rel)
                    self.storage.remove(aside.rel)
        except Exception as e:
            log.info("removing set-aside lease files of %s failed: %s", self.storage.url, e)

    def _beat_of(self, record: LeaseRecord | None) -> bytes:
        """The holder's heartbeat file's bytes (empty where there is none, or no valid token)."""
        if record is None or not _TOKEN_RE.fullmatch(record.token):
            return b""
        try:
            return self.storage.read_small(BEAT_PREFIX + record.token, 4096)
        except ResilientError:
            return b""

    def _forget_beats(self) -> None:
        """(the holder, best effort) Remove heartbeat files of earlier holders."""
        try:
            for name in self.storage.listdir(""):
                if name.startswith(BEAT_PREFIX) and name != BEAT_PREFIX + self.token:
                    self.storage.remove(name)
        except Exception as e:
            log.info("removing old lease heartbeats of %s failed: %s", self.storage.url, e)

    def _new_record(self, beat: int) -> LeaseRecord:
        now = time.time()
        acquired = self.record.acquired_unix_s if self.record else now
        return LeaseRecord(
            job_id=self.job_id,
            token=self.token,
            host=socket.gethostname(),
            machine=_machine(),
            pid=os.getpid(),
            pid_start=_process_start(os.getpid()),
            acquired_unix_s=acquired,
            heartbeat_unix_s=now,
            beat=beat,
            timeout_s=self.timeout_s,
        )

    def _write(self, record: LeaseRecord, *, exclusive: bool) -> bool:
        """Publish ``record``; with ``exclusive``, only if no lease exists (False when one
        appeared meanwhile): link() on a local disk, a conditional PUT where the store has one."""
        if exclusive:
            return self.storage.create_exclusive(LEASE_NAME, record.to_bytes())
        self.storage.publish(LEASE_NAME, record.to_bytes())
        return True

    # --- acquire, check, renew, release ------------------------------------------------------
    def acquire(self, *, cautious: bool = False, only_from: str | None = None) -> None:
        """Take the lease, or raise LeaseError naming the owner who holds it.  A lease once lost
        is never taken again by this instance (a job that was taken over as stale must not come
        back and commit an older state over its successor's).

        ``cautious`` (a persister taking the lease back for its trainer's saves, or to flush
        after it): take over no lease whose holder may be alive, not even the same job's (it may
        be a successor's), except the one with token ``only_from`` (the trainer's own, which it
        says it released); a free lease, a dead holder's on this host, or one this process left
        behind (``_this_process``), is taken as usual."""
        if self.record is not None:
            self.check()
            return
        # from before our record can be written: a record of ours is never an orphan to another
        # lease of this process (_this_process), not even while it settles
        _HELD.add(self.token)
        try:
            self._acquire(cautious, only_from)
        except BaseException:
            _HELD.discard(self.token)
            raise

    def _acquire(self, cautious: bool, only_from: str | None) -> None:
        watched: tuple[bytes, float] | None = None
        self.storage.makedirs("")
        while True:
            data, current = self._read_settled()
            if data is not None and current is None:
                self._refuse_a_directory()
            if data is None:
                mine = self._new_record(1)
                if not self._write(mine, exclusive=True):
                    continue  # someone created one just now: look at it
            elif current is not None and current.token == self.token:
                mine = current  # already ours (a second acquire after a transient failure)
            elif cautious and not (
                current is not None
                and (current.token == only_from or _gone(current) or _this_process(current))
            ):
                raise self._held_by(current, data)
            elif current is not None and current.job_id == self.job_id:
                log.info("taking over the lease of %s: the same job, restarted", self.storage.url)
                mine = self._take_over(current)
            elif current is not None and (_gone(current) or _this_process(current)):
                log.warning(
                    "taking over the lease of %s from %s: %s",
                    self.storage.url,
                    current.describe(),
                    "this process left it (an earlier lease of its own, released while the "
                    "file could not be read)"
                    if _this_process(current)
                    else "its process is gone",
                )
                mine = self._take_over(current)
            else:
                now = self.clock()
                data += b"\n" + self._beat_of(current)  # (the record and its heartbeat)
                if watched is None or watched[0] != data:
                    if watched is not None:  # it changed while we watched: the owner is alive
                        raise self._held_by(current, data)
                    watched = (data, now)
                    log.warning(
                        "%s holds the writer lease of %s; waiting up to %.0fs for its heartbeat "
                        "before taking the lease over",
                        current.describe() if current else "an unreadable lease file",
                        self.storage.url,
                        current.watch_s(self.timeout_s) if current else self.timeout_s,
                    )
                watch = current.watch_s(self.timeout_s) if current else self.timeout_s
                if now - watched[1] < watch:
                    self.sleep(min(watch / 20, 1.0))
                    continue
                log.warning(
                    "taking over the stale lease of %s from %s: no heartbeat for %.0fs",
                    self.storage.url,
                    current.describe() if current else "an unreadable lease file",
                    now - watched[1],
                )
                mine = self._take_over(current)
            # settle a race between two takers: whoever's token is there after a moment holds the
            # lease (a taker that read "free" just before our write wrote just after it)
            self.sleep(self.settle_s)
            data, after = self._read_settled()
            if data is not None and after is None:
                raise self._unconfirmed(data)
            if after is None:
                raise LeaseError(
                    f"{self.storage.display(LEASE_NAME)}: the writer lease of {self.storage.url} "
                    f"was gone right after this job ({self.job_id!r}) wrote it: another writer "
                    f"is at work on this URL (released it, or removed it); use another URL, or "
                    f"stop the other job"
                )
            if after.token != self.token:
                raise self._held_by(after, b"")
            self.record, self._lost = mine, None
            self._beats = 0
            self._forget_beats()  # (earlier holders', and orphans whose LEASE.json is gone)
            self._sweep_asides()
            self._start_renewing()
            return

    def _refuse_a_directory(self) -> None:
        """A directory at the lease's name (on a local disk) is no lease: no writer made it, no
        taker could replace it (after watching it for ``timeout_s``, every save), so say so now."""
        key = self.storage.stat_key(LEASE_NAME) if self.storage.is_local else None
        if key is not None and key[-1] == stat.S_IFDIR:
            raise LeaseError(
                f"{self.storage.display(LEASE_NAME)}: expected the writer lease of "
                f"{self.storage.url} (a file of at most {_MAX_LEASE_BYTES} bytes) or nothing, "
                f"found a directory, which no writer made and none can replace; remove it if no "
                f"job writes this URL, or use another URL"
            )

    def _take_over(self, previous: LeaseRecord | None) -> LeaseRecord:
        self.taken_over = previous
        mine = self._new_record(1)
        self._write(mine, exclusive=False)
        return mine

    def _held_by(self, current: LeaseRecord | None, data: bytes) -> LeaseError:
        owner = current.describe() if current else f"an unreadable lease file ({data[:80]!r})"
        return LeaseError(
            f"{self.storage.display(LEASE_NAME)}: the checkpoint URL {self.storage.url} is being "
            f"written by {owner}, whose lease is alive; two jobs writing one URL would damage each "
            f"other's steps — use another URL, stop the other job, or (if it is gone) wait "
            f"{self.timeout_s:.0f}s (lease_timeout_s) for its lease to go stale"
        )

    def check(self) -> None:
        """Before a commit: raise LeaseError unless the lease is still ours.  A lease file that
        is there but cannot be read or parsed just now (a read that failed where a listing
        worked, a record being replaced on a store without atomic writes) is a StorageError for
        this check only: the lease is lost for good only to another owner's record, or to no
        file at all."""
        if self.record is None:
            raise LeaseError(f"no writer lease held on {self.storage.url}; acquire it first")
        if self._lost is None:
            # Where a stat shows any replacement at once (a local filesystem), the file this
            # check last read as ours, still there (the same inode, size and mtime: every writer
            # of LEASE.json replaces it, never writes into it), is still ours: a stat instead of
            # an open, a read and a parse (a memory snapshot's commit checks the lease six
            # times).  That file is held open meanwhile, so that its inode's number cannot be
            # taken by another record, which a rename over it would otherwise free.
            key = self.storage.stat_key(LEASE_NAME) if self.storage.coherent_stat else None
            held = self._held_file
            if key is not None and held is not None and key == held[1]:
                return
            self._let_go_of_file()
            data, current = self._read_settled()
            if data is not None and current is None:
                # a storage failure, not a loss: Run counts it among failed saves (max_failed_saves)
                # and a persister takes it for a hiccup, as any failed read
                raise self._unconfirmed(data)
            if current is None or current.token != self.token:
                self._lose(current)
            elif key is not None:
                # (the file read: the one there before the read, with the same key after it)
                held = self.storage.hold(LEASE_NAME)
                if held is not None:
                    try:
                        with self._held_lock:  # (not after a loss or a release meanwhile)
                            if (
                                held[1] == key
                                and self._lost is None
                                and self.record is not None
                                and self._held_file is None
                            ):
                                self._held_file, held = held, None
                    finally:
                        if held is not None:
                            os.close(held[0])
        if self._lost is not None:
            raise LeaseError(
                f"the writer lease of {self.storage.url} was taken over by {self._lost} while "
                f"this job ({self.job_id!r}) was writing; this job must not commit there any "
                f"more — it looked stale (no heartbeat for {self.timeout_s:.0f}s?); use another "
                f"URL or a longer lease_timeout_s"
            )

    def _unconfirmed(self, data: bytes) -> StorageError:
        return StorageError(
            f"{self.storage.display(LEASE_NAME)}: the writer lease of {self.storage.url} could "
            f"not be read back ({data[:160]!r}), so this job cannot confirm that it holds it; it "
            f"commits and deletes nothing under it until it can, and the next save looks again; "
            f"if this persists, check the storage (or who replaced {LEASE_NAME})",
            url=self.storage.url,
            operation="lease check",
        )

    def _let_go_of_file(self) -> None:
        with self._held_lock:
            held, self._held_file = self._held_file, None
        if held is not None:
            os.close(held[0])

    def __del__(self) -> None:  # (a lease let go of after a check raced its release)
        try:
            self._let_go_of_file()
        except Exception:
            pass

    def _lose(self, current: LeaseRecord | None) -> None:
        self._lost = current.describe() if current else "nobody (the lease file is gone)"
        self._let_go_of_file()
        _HELD.discard(self.token)

    def _start_renewing(self) -> None:
        self._stop.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._renew_loop, name="resilient-lease", daemon=True
            )
            self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                self.renew()
            except Exception as e:  # a storage hiccup: the next renewal tries again
                log.warning("renewing the writer lease of %s failed: %s", self.storage.url, e)

    def renew(self) -> None:
        with self._lock:
            if self.record is None or self._lost is not None:
                return
            data, current = self._read_settled()
            if data is not None and current is None:  # not now: the next renewal looks again
                log.warning(
                    "renewing the writer lease of %s: the lease file could not be read (%r)",
                    self.storage.url,
                    data[:160],
                )
                return
            if current is None or current.token != self.token:
                self._lose(current)
                log.error("lost the writer lease of %s to %s", self.storage.url, self._lost)
                return
            # the heartbeat goes to a file of its own: LEASE.json is written by takers only, so
            # this renewal cannot put our record back over a takeover since the read above
            self._beats += 1
            beat = {"token": self.token, "beat": self._beats, "heartbeat_unix_s": time.time()}
            self.storage.publish(BEAT_PREFIX + self.token, json.dumps(beat).encode())

    def release(self) -> None:
        """Stop renewing and remove the lease file if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self.record is None:
                _HELD.discard(self.token)
                return
            try:
                # another's record (the lease was lost) is never touched, not even set aside
                _, current = self._read_settled() if self._lost is None else (None, None)
                if self._beats:  # (first: a release cut short leaves no orphan heartbeat)
                    self.storage.remove(BEAT_PREFIX + self.token)
                if current is not None and current.token == self.token:
                    self._sweep_asides()  # (while it is still the holder)
                    # judged again and removed as one: a successor of the same job may have
                    # taken the lease over since the read, and removing by name after a read
                    # removed the successor's lease; set aside under our token, so that who
                    # finds no LEASE.json meanwhile tells our record (released) from a
                    # successor's (put back)
                    self.storage.remove_if(
                        LEASE_NAME, self._is_ours, _MAX_LEASE_BYTES, tag=self.token
                    )
            except Exception as e:  # best effort: a stale lease is taken over later
                log.warning("releasing the writer lease of %s failed: %s", self.storage.url, e)
            self.record = None
            self._let_go_of_file()
            _HELD.discard(self.token)  # (only now: the file is gone, or left as an orphan)

    def _is_ours(self, data: bytes) -> bool:
        record = LeaseRecord.from_bytes(data)
        return record is not None and record.token == self.token

    def describe(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "token": self.token, "held": self.held}
