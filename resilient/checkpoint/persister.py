"""The persister: durable writes from a process that is not the trainer (the memory tier).

With the memory tier on, a durable save is a memory snapshot that a separate process promotes to
the checkpoint URL, so the trainer's GIL and cores are not taken by copies, checksums and uploads,
and a snapshot newer than the newest durable commit is still written out when the trainer dies.

* Rank 0 starts the persister (a ``python`` running :func:`main`) at its first
  snapshot or save, one per job on its node, in a session of its own: it outlives the workers
  (torchrun's teardown signals their process groups, not it).  Its log is ``persister.log`` in the
  job's memory directory.
* A save of step S snapshots the state into memory (or reuses the snapshot of S just taken).  Once
  that snapshot is committed, rank 0 hard-links its files into ``<job>/outbox/step_S`` (the memory
  tier's retention may drop the step meanwhile; the bytes stay until the copy is done) and asks
  the persister, over a pipe, to persist S.  Every other rank waits for rank 0's word on the store,
  as for any commit.
* The persister checks every chunk of every rank file against the snapshot's checksums, copies the
  files to the URL under the step's next generation, commits a manifest there like any save (the
  next commit_seq, the job id, the writer lease it holds, retention) and answers.  Nothing the
  trainer does waits for it except the next durable save (one in flight, as always).
* When the trainer says goodbye, or the pipe closes without one (rank 0 is gone: a crash, SIGKILL,
  torchrun tearing the workers down, an OOM), the persister flushes: it persists the newest
  snapshot of the node's memory that is newer than the newest durable commit and restorable (the
  checks a load makes), if there is one, then exits.  One persister per job at a time (a lock in the job directory): a restarted
  trainer's persister waits for its predecessor's flush.

* Across nodes there is one persister per node, its lowest rank's.  Each leader links its node's
  ranks' files of the snapshot into its outbox; rank 0's persister takes the lease and picks the
  generation (``begin``), every node's persister checks and writes its node's files (``copy``),
  and rank 0's commits once every node has reported over the store (``commit``).  When the
  trainer dies, rank 0's node's persister flushes; with three nodes or more no node holds the
  snapshot whole, and the other nodes' persisters write their files where it asks, through the
  URL (joint_flush.py).

Messages are JSON lines: the trainer sends the configuration, then ``{"op": "persist", "id": n,
"step": S}`` (or ``begin``; ``copy`` with ``generation``, ``files`` and ``last``; ``commit`` with
``generation``; ``persist`` and ``commit`` with ``parent``, ``[[step, commit_seq], ...]`` (newest first), where the
trainer knows what the state descends from) and finally ``{"op": "close"}``; the persister answers ``{"id": n, "ok": true,
...}`` (``commit_seq``, ``bytes``, ``seconds``; ``generation`` for ``begin``) or ``{"id": n,
"ok": false, "type": ..., "error": ...}``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import mmap
import os
import queue
import secrets
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from typing import Any

from resilient.checkpoint.catalog import StepInfo, scan
from resilient.checkpoint.codec import block_checksums
from resilient.checkpoint.format import (
    ANCHOR_EXACT_KEY,
    BOOKKEEPING_KEYS,
    MANIFEST_NAME,
    MAX_INT,
    MAX_MANIFEST_BYTES,
    MAX_OLDER,
    MAX_RUN,
    PARENT_KEY,
    RUN_KEY,
    RUN_UNCOUNTED_KEY,
    Manifest,
    chain_of,
    manifest_of_step,
    parent_known,
    parent_record,
    rank_file_name,
    recorded_uncounted,
    step_dir_name,
)
from resilient.checkpoint.joint_flush import (
    JOIN_WAIT_S,
    FilesMissing,
    held_files,
    join_flush,
    mark_waiting,
    open_seal,
    persist_jointly,
    publish_done,
    record_id,
    seal_together,
    seen_now,
    with_sealed,
)
from resilient.checkpoint.lease import WriterLease, _dead, _gone, _process_start, is_process
from resilient.checkpoint.retention import Sweep, delete_dirs
from resilient.checkpoint.seal import newest_staged_step, seal_staged
from resilient.checkpoint.seal_nodes import has_peer_pairs
from resilient.checkpoint.snapshots import (
    PERSISTER_LOCK,
    RUN_SHIFT,
    exact_anchor,
    line_mark,
    newer_line,
    stale_snapshot,
)
from resilient.checkpoint.storage import RetryPolicy, Storage
from resilient.checkpoint.url_group import UrlGroup
from resilient.checkpoint.writer import CommitError, next_generation, publish_commit
from resilient.errors import (
    CheckpointCorruptError,
    LeaseError,
    MemoryTierError,
    ResilientError,
)

__all__ = ["OUTBOX", "PersisterClient", "link_to_outbox", "main"]

log = logging.getLogger(__name__)

OUTBOX = "outbox"
# how long a flush waits for the trainer's other ranks to be gone before it seals their snapshot
_SEAL_WAIT_S = 15.0
LOCK_NAME = PERSISTER_LOCK
LOG_NAME = "persister.log"
_MAX_MESSAGE = 1 << 20
# How long a persister whose trainer is gone waits for the lock (a predecessor flushing) before
# it gives up: its trainer's snapshots stay in memory for the next run.
_ORPHAN_WAIT_S = 600.0
# not "-m resilient.checkpoint.persister": the package imports this module before runpy would
_ENTRY = "from resilient.checkpoint.persister import run; run()"


# --- the trainer's side ------------------------------------------------------------------------------


def link_to_outbox(
    steps_dir: str, step: int, outbox: str, ranks: Collection[int] | None = None
) -> str:
    """Hard-link a committed snapshot's manifest and rank files (those written by ``ranks``, or
    all) into ``<outbox>/step_S`` (replacing an older entry of that step); returns that directory.
    Microseconds: no bytes move, and the memory tier may retire the step from now on without
    taking them from the copy."""
    name = step_dir_name(step)
    src = os.path.join(steps_dir, name)
    job_dir = os.path.dirname(os.path.dirname(outbox))  # (<job>/outbox/<trainer>)
    if not os.path.isdir(job_dir):  # given back: not made again here, by an outbox
        raise MemoryTierError(
            f"the job's memory directory {job_dir} is gone (given back, or removed by hand): "
            "nothing can be persisted from it"
        )
    os.makedirs(outbox, mode=0o700, exist_ok=True)
    for d in (os.path.dirname(outbox), outbox):
        if os.path.islink(d):
            raise MemoryTierError(f"{d} is a symbolic link, not this job's outbox; remove it")
    tmp = os.path.join(outbox, f".{name}.tmp-{secrets.token_hex(4)}")
    os.mkdir(tmp, 0o700)
    try:
        manifest = _read_small(os.path.join(src, MANIFEST_NAME), MAX_MANIFEST_BYTES)
        files = manifest_of_step(manifest, f"{src}/{MANIFEST_NAME}", step).files
        for f, entry in files.items():
            if ranks is not None and entry.rank not in ranks:
                continue
            os.link(os.path.join(src, f), os.path.join(tmp, f), follow_symlinks=False)
        # the manifest last, and as a copy of what was read: what the files were checked against
        fd = os.open(os.path.join(tmp, MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(manifest)
        dest = os.path.join(outbox, name)
        if os.path.lexists(dest):
            shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
        return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class PersisterClient:
    """Rank 0's handle on the job's persister process: start it, ask it to persist a step, say
    goodbye.  Thread-safe; a persister that died is restarted at the next request."""

    def __init__(self, job_dir: str, config: dict[str, Any]) -> None:
        self.job_dir = job_dir
        # this trainer's own outbox: a predecessor's persister, flushing, cleans only its own
        self.outbox = os.path.join(job_dir, OUTBOX, f"{os.getpid()}-{secrets.token_hex(4)}")
        self.config = dict(
            config,
            job_dir=job_dir,
            outbox=self.outbox,
            parent_pid=os.getpid(),
            parent_start=_process_start(os.getpid()),
        )
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._gone: str | None = None  # why the current process can answer no more
        self.started = 0  # how many processes this client started

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._gone is None:
                return
            if self._proc is not None:
                try:
                    self._proc.kill()  # dying or stuck: make sure it is gone before another starts
                except OSError:
                    pass
                _close_quietly(self._proc.stdin)  # its reader closes its stdout
            if self._proc is not None:
                log.warning(
                    "the persister of %s (pid %d) is gone (%s); starting another",
                    self.config["url"],
                    self._proc.pid,
                    self._gone or f"exit code {self._proc.poll()}",
                )
            self._spawn()

    def _spawn(self) -> None:
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        # not its worker, though it inherits its RANK and may outlive it (the detector's
        # local_rank_pid skips it: resilient/health/heartbeat.py PERSISTER_MARK)
        env["RESILIENT_PERSISTER_PROCESS"] = "1"
        log_path = os.path.join(self.job_dir, LOG_NAME)
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise MemoryTierError(
                f"cannot open the persister's log {log_path}: {e}; the job's memory directory "
                f"must be this job's own (remove what is in the way)"
            ) from e
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fd,
                env=env,
                start_new_session=True,  # not in the workers' process group: it outlives them
                close_fds=True,
            )
        finally:
            os.close(fd)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(self.config).encode() + b"\n")
        proc.stdin.flush()
        self._proc, self._gone = proc, None
        self.started += 1
        threading.Thread(
            target=self._read_replies, args=(proc,), name="resilient-persister-replies", daemon=True
        ).start()

    def _read_replies(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                reply = json.loads(line[:_MAX_MESSAGE])
                rid = int(reply["id"])
            except (ValueError, KeyError, TypeError):
                log.warning("the persister said something unexpected: %r", line[:200])
                continue
            with self._cond:
                self._replies[rid] = reply
                self._cond.notify_all()
        _close_quietly(proc.stdout)
        code = proc.wait()
        with self._cond:
            if self._proc is proc:
                self._gone = f"it exited with code {code}; see {self.job_dir}/{LOG_NAME}"
            self._cond.notify_all()

    def persist(self, step: int, timeout_s: float) -> dict[str, Any]:
        """Ask the persister to persist ``step`` (its outbox entry); its reply.  A persister that
        dies before it answers is replaced once and asked again (persisting a step twice only
        commits it again)."""
        return self.request("persist", step, timeout_s)

    def request(self, op: str, step: int, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Ask for ``op`` on ``step`` (``persist``; across nodes ``begin``, ``copy``, ``commit``)
        and wait for the reply; a persister that dies first is replaced and asked once more."""
        try:
            return self._request_once(op, step, timeout_s, fields)
        except _Gone as e:
            log.warning("%s; starting another and asking again", e)
            try:
                return self._request_once(op, step, timeout_s, fields)
            except _Gone as again:
                raise CommitError(str(again)) from None

    def _request_once(
        self, op: str, step: int, timeout_s: float, fields: dict[str, Any]
    ) -> dict[str, Any]:
        self.start()
        with self._cond:
            self._next_id += 1
            rid = self._next_id
            proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(
                json.dumps({"op": op, "id": rid, "step": step, **fields}).encode() + b"\n"
            )
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            with self._cond:
                if self._proc is proc and self._gone is None:
                    self._gone = f"its pipe is closed ({e})"
            raise _Gone(
                f"cannot ask the persister (pid {proc.pid}) to persist step {step}: {e}; see "
                f"{self.job_dir}/{LOG_NAME}"
            ) from e
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while rid not in self._replies:
                if self._gone is not None and self._proc is proc:
                    raise _Gone(
                        f"the persister (pid {proc.pid}) did not persist step {step}: {self._gone}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommitError(
                        f"the persister (pid {proc.pid}) did not persist step {step} within "
                        f"{timeout_s:.0f}s (commit_timeout_s); it goes on in the background; "
                        f"see {self.job_dir}/{LOG_NAME}"
                    )
                self._cond.wait(min(left, 1.0))
            return self._replies.pop(rid)

    def close(self, timeout_s: float = 60.0, *, lease_returned: str | None = None) -> None:
        """Say goodbye and wait for the process to exit (after it has persisted the newest
        snapshot that durable storage lacks, if any), so the job's memory can be given back.
        ``lease_returned``: the token of a lease the trainer took for saves of its own and
        released (the flush may take it anew; see ``Promoter.lease_returned``)."""
        proc = self.goodbye(lease_returned=lease_returned)
        if proc is None:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "the persister (pid %d) did not exit within %.0fs of being closed; it is left "
                "to finish; see %s/%s",
                proc.pid,
                timeout_s,
                self.job_dir,
                LOG_NAME,
            )

    def goodbye(self, *, lease_returned: str | None = None) -> subprocess.Popen | None:
        """Say goodbye without waiting (``close`` waits): the process flushes, then exits, and
        its reply reader reaps it.  Returns the process, or None when none was started."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            assert proc.stdin is not None
            goodbye = {
                "op": "close",
                **({"lease_returned": lease_returned} if lease_returned else {}),
            }
            proc.stdin.write(json.dumps(goodbye).encode() + b"\n")
        except (BrokenPipeError, OSError):
            pass
        _close_quietly(proc.stdin)
        return proc


# --- the persister's side --------------------------------------------------------------------------


class Promoter:
    """Copies committed snapshots from the node's memory to the URL and commits them there."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.job_dir: str = config["job_dir"]
        self.steps_dir = os.path.join(self.job_dir, "steps")
        self.outbox: str = config["outbox"]
        self.storage = Storage(
            config["url"],
            config.get("storage_options"),
            RetryPolicy(**config.get("retry", {})),
            commit_method=config.get("commit_method"),
        )
        self.job_id: str = config["job_id"]
        self.keep_last: int = config["keep_last"]
        self.keep_every: int | None = config.get("keep_every")
        self.lease = self._new_lease()
        self._take_from: str | None = None  # the trainer's released lease (lease_returned)
        self._flushing = False
        self._seen: list[str] | None = None  # (across nodes) what the flush judges: _announce
        self._seal_group: UrlGroup | None = None  # (sealed across nodes) the flush's seal
        self.flush_ids: list[str] = []  # (across nodes) the records its flush published
        self._sweep = Sweep()  # as the Checkpointer's

    @property
    def across_nodes(self) -> bool:
        """Whether the trainer's job is on several nodes (a persister on each)."""
        return self.config.get("nodes", 1) > 1

    def _new_lease(self) -> WriterLease:
        return WriterLease(self.storage, self.job_id, timeout_s=self.config["lease_timeout_s"])

    def lease_returned(self, token: str) -> None:
        """(the trainer says so) It wrote durable saves itself, as it does while its memory
        tier's last snapshot failed (a full tmpfs), taking the lease over from this persister as
        the same job may, and it has released that lease (``token``) since.  Such a loss is not
        a takeover by a successor: the next save takes the lease anew, cautiously (only a free
        lease, a dead holder's, or the one with ``token``; see WriterLease.acquire)."""
        if self.lease.record is not None:  # (never held: its first acquire comes)
            if self._still_ours():
                return  # the trainer never took it
            log.info(
                "the trainer (pid %s) took the writer lease of %s over for saves of its own and "
                "has released it; taking it anew",
                self.config.get("parent_pid"),
                self.storage.url,
            )
            self._renew_lease()
        self._take_from = token

    def _refuse_the_trainers_lease(self) -> None:
        """A request that meets the lease in the hands of the live trainer, which writes a save
        of its own (the request timed out and is answered late, by a persister that never held
        the lease or took it anew): refused, unless the trainer released that lease and said so
        (its token).  The same job's lease is otherwise taken at once (WriterLease.acquire)."""
        try:
            _, current = self.lease._read()
        except Exception:  # acquire() reads it again and decides
            return
        trainer = self.config.get("parent_pid"), self.config.get("parent_start")
        if (
            current is not None
            and current.job_id == self.job_id
            and current.token != self._take_from
            and is_process(current, *trainer)
            and not _gone(current)
        ):
            raise LeaseError(
                f"the trainer (pid {current.pid}) holds the writer lease of {self.storage.url} "
                f"for a save of its own; this request came too late and is not committed"
            )

    def _still_ours(self) -> bool:
        """Whether this persister holds the lease (None held yet: it is taken as usual)."""
        if self.lease.record is None:
            return True
        try:
            self.lease.check()
            return True
        except LeaseError:
            return False
        except Exception:  # (a storage hiccup: what comes next reads it again and decides)
            return True

    def _renew_lease(self) -> None:
        self.lease.release()  # (not ours any more: only its renewing stops)
        self.lease = self._new_lease()

    def persist(
        self,
        step: int,
        src: str | None = None,
        parent: tuple[tuple[int, int], ...] = (),
        parent_seen: int | None = None,
    ) -> dict[str, Any]:
        """Commit the snapshot in ``src`` (default: the outbox entry of ``step``) as durable step
        ``step``; the outbox entry is removed afterwards, whatever happened.  ``parent``: the
        durable commit its state descends from, as the trainer knows it (none for a flush)."""
        src = src or os.path.join(self.outbox, step_dir_name(step))
        t0 = time.monotonic()
        try:
            return self._persist(step, src, t0, parent, parent_seen)
        finally:
            shutil.rmtree(src, ignore_errors=True)

    def done(self, step: int) -> None:
        """(across nodes) Drop the outbox entry of ``step``."""
        shutil.rmtree(os.path.join(self.outbox, step_dir_name(step)), ignore_errors=True)

    def _persist(
        self,
        step: int,
        src: str,
        t0: float,
        parent: tuple[tuple[int, int], ...],
        parent_seen: int | None,
    ) -> dict[str, Any]:
        snap = self._snapshot(step, src)  # read once for both phases
        generation = self.begin(step)["generation"]
        total = self.copy(step, generation, None, src, snap=snap)["bytes"]
        commit = self.commit(
            step, generation, src, t0=t0, snap=snap, parent=parent, parent_seen=parent_seen
        )
        return {**commit, "bytes": total}

    def _snapshot(self, step: int, src: str) -> Manifest:
        where = f"the memory snapshot of step {step} ({src})"
        try:
            data = _read_small(os.path.join(src, MANIFEST_NAME), MAX_MANIFEST_BYTES)
        except OSError as e:
            raise CheckpointCorruptError(f"{where} has no readable manifest: {e}") from e
        return manifest_of_step(data, f"{src}/{MANIFEST_NAME}", step)

    def begin(self, step: int) -> dict[str, Any]:
        """Take the writer lease, make the step's directory, pick its generation."""
        if self.storage.commit_method is None:
            raise self.storage.refusal_to_commit()
        step_rel = step_dir_name(step)
        if self.lease.record is None and not self._flushing:
            self._refuse_the_trainers_lease()
        if self.lease.record is None and (self._flushing or self._take_from is not None):
            self.lease.acquire(cautious=True, only_from=self._take_from)
        else:
            self.lease.acquire()
        self._take_from = None
        self.storage.makedirs(step_rel)
        self._sweep.began.add(step_rel)
        return {"generation": next_generation(self.storage, step_rel)}

    def copy(
        self,
        step: int,
        generation: int,
        files: list[str] | None,
        src: str | None = None,
        *,
        snap: Manifest | None = None,
    ) -> dict[str, Any]:
        """Check and write ``files`` of the snapshot in ``src`` (all of them: None) to the URL
        under ``generation`` (across nodes, each node's persister writes its own node's files,
        with no lease: rank 0's persister commits)."""
        src = src or os.path.join(self.outbox, step_dir_name(step))
        snap = snap or self._snapshot(step, src)
        unknown = sorted(set(files or ()) - set(snap.files))
        if unknown:
            raise CheckpointCorruptError(
                f"the memory snapshot of step {step} names no file {unknown[0]!r}"
            )
        names = {old: rank_file_name(entry.rank, generation) for old, entry in snap.files.items()}
        chunks_of: dict[str, list[tuple[str, Any]]] = {f: [] for f in snap.files}
        for key, t in snap.tensors.items():
            for c in t.chunks:
                chunks_of[c.file].append((key, c))
        step_rel = step_dir_name(step)
        if files is not None:
            self.storage.makedirs(step_rel)
        total = 0
        chosen = sorted(snap.files if files is None else files)
        for old in chosen:
            size = snap.files[old].size_bytes
            total += self._copy(src, old, size, chunks_of[old], snap, step_rel, names)
        log.info(
            "wrote %d file(s) of step %d (%d bytes, generation %d)",
            len(chosen),
            step,
            total,
            generation,
        )
        return {"bytes": total}

    def commit(
        self,
        step: int,
        generation: int,
        src: str | None = None,
        *,
        t0: float | None = None,
        snap: Manifest | None = None,
        parent: tuple[tuple[int, int], ...] = (),
        parent_seen: int | None = None,
    ) -> dict[str, Any]:
        """Commit the snapshot's manifest at the URL once every file is written there (by this
        persister or, across nodes, by each node's).  ``parent`` is recorded only where nothing
        was committed above ``parent_seen`` (the newest commit_seq known when it was set): a
        commit since (a save of an earlier process, or one given up on) may be what the state
        descends from."""
        t0 = time.monotonic() if t0 is None else t0
        src = src or os.path.join(self.outbox, step_dir_name(step))
        snap = snap or self._snapshot(step, src)
        step_rel = step_dir_name(step)
        names = {old: rank_file_name(entry.rank, generation) for old, entry in snap.files.items()}
        total = 0
        for old, entry in sorted(snap.files.items()):
            try:
                found = self.storage.size(f"{step_rel}/{names[old]}")
            except Exception as e:
                raise CommitError(
                    f"step {step} is not committed: {names[old]} was not written ({e})"
                ) from e
            if found != entry.size_bytes:
                raise CommitError(
                    f"step {step} is not committed: {names[old]} has {found} bytes, the snapshot's "
                    f"file {entry.size_bytes}"
                )
            total += found
        seq = scan(self.storage).next_commit_seq()
        if not parent_known(seq, parent_seen):
            parent = ()
        manifest = _promoted(snap, names, generation, seq, self.job_id, parent)
        garbage = publish_commit(
            self.storage,
            self.lease,
            manifest,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            collect=self._sweep,
        )
        self._sweep.committed()
        try:
            delete_dirs(self.storage, garbage, check=self.lease.check)
        except Exception as e:
            log.warning("deleting retired checkpoint files failed: %s", e)
        seconds = time.monotonic() - t0
        log.info("persisted step %d (%d bytes, commit %d) in %.2fs", step, total, seq, seconds)
        return {"commit_seq": seq, "generation": generation, "bytes": total, "seconds": seconds}

    def _copy(
        self,
        src: str,
        name: str,
        size: int,
        chunks: list[tuple[str, Any]],
        snap: Manifest,
        step_rel: str,
        names: dict[str, str],
    ) -> int:
        """Check one rank file's chunks against the snapshot's checksums and write it to the URL."""
        path = os.path.join(src, name)
        fd = os.open(path, _READ_FLAGS)  # (a FIFO planted there must not block the open)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise CheckpointCorruptError(
                    f"memory snapshot file {path} has {st.st_size} bytes, its manifest says "
                    f"{size}; the snapshot is damaged and is not persisted"
                )
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
            view = memoryview(mm) if mm is not None else memoryview(b"")
            try:
                for key, c in chunks:
                    b, e = c.byte_range
                    if block_checksums(view[b:e], snap.block_bytes, parallel=False) != list(
                        c.checksums
                    ):
                        raise CheckpointCorruptError(
                            f"memory snapshot file {path}: chunk {key!r} does not match its "
                            f"checksums; the snapshot is damaged and is not persisted"
                        )
                self.storage.write_file(f"{step_rel}/{names[name]}", [view], exclusive=True)
            finally:
                view.release()
                if mm is not None:
                    mm.close()
        finally:
            os.close(fd)
        return size

    def flush(self) -> dict[str, Any] | None:
        """``_flush``; across nodes, the done record the other nodes' persisters wait for comes
        once none of them is needed: before a flush this node makes alone, or after the flush,
        whatever it came to (joint_flush.py)."""
        self._seen = seen_now(self) if self.across_nodes else None
        try:
            return self._flush()
        finally:
            self._announce()
            if self._seal_group is not None:
                self._seal_group.close()
                self._seal_group = None

    def _announce(self) -> None:
        """(across nodes) The done record, once: the other nodes' persisters are not needed."""
        if self._seen is not None:
            seen, self._seen = self._seen, None
            publish_done(self, seen)

    def _flush(self) -> dict[str, Any] | None:
        """Persist the newest restorable snapshot newer than the newest durable commit, if any
        (first committing, in memory, a snapshot every rank staged whose commit was cut short).

        The trainer is gone or closing, and its successor (a restart of the same job) may
        already be writing: a lease this persister does not hold is taken cautiously (see
        WriterLease.acquire): a free one, a dead holder's (the trainer's, when it died holding
        it), or the one the trainer said it released (``lease_returned``); never a live
        holder's.  What it flushes must still descend from the newest durable commit (the
        snapshot's anchor), so a successor's commits are never overwritten."""
        self._flushing = True
        if not self._still_ours():
            self._renew_lease()
        durable = scan(self.storage)
        newest = durable.newest()
        max_run = self.config.get("max_run")
        newer_than = None if newest is None else newest.step
        sealed_nodes = self.across_nodes and self.config.get("sealed_nodes")
        sealed = None
        alone = has_peer_pairs(self.job_dir) and (not sealed_nodes or self.config.get("nodes") == 2)
        if alone:
            # sealed on several nodes: this node may hold every rank's copy (two nodes: its own
            # ranks' and the peer pairs of the other's, which may be gone with its node; a job
            # on one node now, after an elastic shrink): sealed here, with no other node; on
            # two nodes only the newest step its own ranks staged (an older one whole here is
            # no reason not to ask the other node for the newest)
            own = newest_staged_step(self.job_dir) if sealed_nodes else None
            sealed = seal_together(self, None, _SEAL_WAIT_S, only_from=own or 0, durable=newer_than)
        if sealed_nodes and sealed is None:
            # no node need hold every rank's copy (three nodes or more; a pair that did not
            # arrive): the nodes' persisters seal together, through the URL; where they cannot,
            # the records and pairs stay for the next run's load, which seals across the nodes
            wait_s = float(self.config.get("join_wait_s", JOIN_WAIT_S))
            self._seal_group = open_seal(self, wait_s)
            if self._seal_group is not None:
                sealed = seal_together(self, self._seal_group, _SEAL_WAIT_S, durable=newer_than)
        if sealed is not None and self._seen is not None:  # (judged by this flush too)
            self._seen = with_sealed(self._seen, self.steps_dir, sealed)
        if not alone and not sealed_nodes:  # (one node: its staged records, cut-short commits)
            seal_staged(
                self.job_dir,
                wait_s=_SEAL_WAIT_S,
                newer_than=newer_than,
                max_run=max_run if type(max_run) is int else None,
            )
        mem = Storage(self.steps_dir)
        snaps = scan(mem)
        line = set(durable.line())
        after, restored = line_mark(self.job_dir)
        joint_failed = False
        for s in snaps.line():
            try:
                data = _read_small(
                    os.path.join(self.steps_dir, step_dir_name(s), MANIFEST_NAME),
                    MAX_MANIFEST_BYTES,
                )
                snap = manifest_of_step(data, f"memory step {s}", s)
            except (OSError, ResilientError) as e:
                log.warning("flush: memory step %d is not readable (%s); trying an older one", s, e)
                continue
            # below the newest durable step: only a snapshot of the line a rollback began, with
            # nothing committed durably since (snapshots.newer_line); its flush is the durable
            # save of it the trainer would have made (its parent the anchor: the line skips the
            # branch the rollback left)
            newer = None
            if newest is not None and s < newest.step:
                newer = newer_line(snap, durable, after, restored)
                if newer is None:
                    log.info("flush: nothing newer than durable step %d in memory", newest.step)
                    return None
            why = None if newer is not None else stale_snapshot(snap, durable, line)
            if snap.job_id != self.job_id:  # a later job's trainer took it: not ours to write
                why = f"it was taken by job {snap.job_id!r}, not by this persister's"
            if why:
                log.warning("flush: memory step %d is not persisted: %s", s, why)
                continue
            if newest is not None and s == newest.step and not self._supersedes(newest, snap):
                return None
            try:
                parent, seen = _flush_parent(snap, durable, line)
                held = held_files(self.steps_dir, s, snap)
                if len(held) < len(snap.files) and self.across_nodes:
                    if joint_failed:  # (the other nodes did not write theirs just now)
                        log.warning("flush: memory step %d is not whole on this node", s)
                        continue
                    # across nodes (three or more): the other nodes' persisters write the rest
                    return {"step": s, **self._persist_jointly(s, snap, held, parent, seen)}
                self._announce()  # (whole here: the other nodes' persisters may go)
                link_to_outbox(self.steps_dir, s, self.outbox)
                return {"step": s, **self.persist(s, parent=parent, parent_seen=seen)}
            except FilesMissing as e:  # an older step this node holds whole may still go
                log.warning("flush: %s; trying an older one held whole here", e)
                joint_failed = True
                continue
            except (OSError, ResilientError) as e:  # damaged, or retired meanwhile
                log.warning(
                    "flush: memory step %d was not persisted (%s); trying an older one", s, e
                )
                continue
        log.info("flush: no snapshot in memory to persist")
        return None

    def _persist_jointly(
        self,
        step: int,
        snap: Manifest,
        held: set[str],
        parent: tuple[tuple[int, int], ...],
        parent_seen: int | None,
    ) -> dict[str, Any]:
        """(joint_flush.py) Commit ``step`` with this node's files, the other nodes' persisters
        writing theirs."""
        ranks = {snap.files[f].rank for f in held}
        src = link_to_outbox(self.steps_dir, step, self.outbox, ranks)
        try:
            wait_s = float(self.config.get("join_wait_s", JOIN_WAIT_S))
            return persist_jointly(self, step, src, held, parent, parent_seen, wait_s)
        finally:
            shutil.rmtree(src, ignore_errors=True)

    def _supersedes(self, info: StepInfo, snap: Manifest) -> bool:
        """Whether a snapshot of the same step number as the newest durable commit ``info`` is
        to be written over it: after a rollback (a load of an older step, then snapshots up to
        the same number on the new line: a load on this node restores the snapshot, so the
        flush must make it durable too).  Not when the durable step holds the same state (it
        was made from it), nor when it may be a successor's: one that records no run of the
        tier, or a later run than the snapshot's (a job of the same URL that resumed elsewhere
        from the snapshot's anchor and saved that step number), whose line is the newer."""
        run = snap.commit_seq >> RUN_SHIFT
        if not 0 < info.run <= run:
            log.info(
                "flush: durable step %d (run %d of the tier; the snapshot's is run %d) may be a "
                "later run's: nothing newer in memory",
                info.step,
                info.run,
                run,
            )
            return False
        if self._durable_holds(info, snap):
            log.info("flush: durable step %d holds the newest snapshot's state", info.step)
            return False
        return True

    def _durable_holds(self, info: StepInfo, snap: Manifest) -> bool:
        """Whether durable step ``info`` (of the snapshot's step number) holds the snapshot's
        state: it was made from it (or from the same state).  Not after a rollback: a load of an
        older step, then snapshots up to the same number on the new line (a load on this node
        restores the snapshot, so the flush must make it durable too).  A manifest that cannot
        be read counts as another state (the flush then writes the step again)."""
        try:
            data = self.storage.read_small(f"{info.dir}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
            held = manifest_of_step(data, self.storage.display(info.dir), info.step)
        except ResilientError as e:
            log.warning("flush: durable step %d cannot be read to compare (%s)", info.step, e)
            return False
        return state_of(held) == state_of(snap)

    def close(self) -> None:
        if self.lease.held:
            self.lease.release()


def _flush_parent(
    snap: Manifest, durable: Any, line: set[int]
) -> tuple[tuple[tuple[int, int], ...], int | None]:
    """The parent a flush of ``snap`` records, and the newest commit_seq known when it was set:
    its anchor where it is exactly the commit the state descends from (snapshots.exact_anchor)
    and not the step itself (a step loaded and snapshotted again says nothing of what it descends
    from); else none, and the line goes on by step numbers there."""
    anchor = exact_anchor(snap, durable, line)
    if anchor is None or anchor[0] == snap.step:
        return (), None
    return (anchor,), snap.extras.get(ANCHOR_EXACT_KEY)


def state_of(m: Manifest) -> tuple[Any, ...]:
    """What a manifest says of the state (not of where its bytes are or who wrote them): every
    tensor with its chunks' checksums, the values, and the layout."""
    tensors = {
        k: (
            t.dtype,
            t.shape,
            t.placement,
            # (a chunk's checksums are of its own blocks: the same bytes anywhere in any file)
            [(c.offsets, c.sizes, c.checksums, c.codec, c.raw_bytes, _length(c)) for c in t.chunks],
        )
        for k, t in m.tensors.items()
    }
    extras = {k: v for k, v in m.extras.items() if k not in BOOKKEEPING_KEYS}
    rank_extras = {
        r: kept
        for r, values in m.rank_extras.items()
        if (kept := {k: v for k, v in values.items() if k not in BOOKKEEPING_KEYS})
    }
    return tensors, extras, rank_extras, m.layout, m.block_bytes


def _length(c: Any) -> int:
    b, e = c.byte_range
    return e - b


def _promoted(
    snap: Manifest,
    names: dict[str, str],
    generation: int,
    seq: int,
    job_id: str,
    parent: tuple[tuple[int, int], ...] = (),
) -> Manifest:
    """The durable manifest of a snapshot: its files renamed to the durable generation, this
    commit's place in the durable commit order, and no memory-tier bookkeeping.  ``parent``: the
    durable commit its state descends from where the trainer knows it exactly (the line follows
    it, catalog.py).  Not the snapshot's anchor: that is the newest durable commit known when the
    snapshot was taken, and a durable save in flight then is not it, so the line would skip that
    save's commit (a flush records it only where the snapshot says it is exact: _flush_parent)."""
    tensors = {
        k: dataclasses.replace(
            t, chunks=tuple(dataclasses.replace(c, file=names[c.file]) for c in t.chunks)
        )
        for k, t in snap.tensors.items()
    }
    # (the snapshot's bookkeeping is about it, not about this commit: this commit's is set here)
    extras = {k: v for k, v in snap.extras.items() if k not in BOOKKEEPING_KEYS}
    if parent:
        extras[PARENT_KEY] = parent_record(parent, seq)
    run = snap.commit_seq >> RUN_SHIFT  # (the run that took it: number_this_run)
    if 0 < run < MAX_RUN:
        extras[RUN_KEY] = run
        if recorded_uncounted(snap.extras):  # (a run that was not counted: its number shared)
            extras[RUN_UNCOUNTED_KEY] = True
    rank_extras = {}
    for r, values in snap.rank_extras.items():
        kept = {k: v for k, v in values.items() if k not in BOOKKEEPING_KEYS}
        if kept:
            rank_extras[r] = kept
    return dataclasses.replace(
        snap,
        tensors=tensors,
        files={names[f]: e for f, e in snap.files.items()},
        extras=extras,
        rank_extras=rank_extras,
        generation=generation,
        commit_seq=seq,
        job_id=job_id,
        created_unix_s=time.time(),
    )


def _close_quietly(f: Any) -> None:
    """Close one end of a pipe to a persister that may already be gone."""
    if f is not None:
        try:
            f.close()
        except OSError:
            pass


class _Gone(ResilientError):
    """The persister process went away before it answered."""


# never through a link, and never blocked by a FIFO in a file's place (fstat then refuses it)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def _read_small(path: str, cap: int) -> bytes:
    fd = os.open(path, _READ_FLAGS)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointCorruptError(f"{path} is not a regular file")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointCorruptError(f"{path} is larger than {cap} bytes")
    return data


def _reclaim_outboxes(root: str) -> None:
    """Remove the outboxes of trainers that are gone (``<pid>-<token>``): a predecessor's
    persister is done with them (this one holds the lock), and what they hold is older than what
    the memory tier holds."""
    if os.path.islink(root):
        log.warning("%s is a symbolic link: not this job's outbox; left alone", root)
        return
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        pid = name.split("-", 1)[0]
        if pid.isdigit() and len(pid) < 10 and _running(int(pid)):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _dead(pid)  # (a zombie has exited: its parent has not reaped it yet)


def _unlink_quietly(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _parent_alive(pid: Any, start: Any) -> bool:
    """Whether the trainer is still running (True when it is not known)."""
    if not isinstance(pid, int) or isinstance(pid, bool):
        return True
    return _running(pid) and (not start or _process_start(pid) == start)


def _watch_parent(pid: Any, start: Any, requests: queue.Queue) -> None:
    """Say the trainer is gone when its process is, even if a process it forked (a data loader's
    worker) still holds the pipe open."""
    if not isinstance(pid, int):
        return
    while _parent_alive(pid, start):
        time.sleep(0.2)
    log.info("the trainer (pid %d) is gone", pid)
    requests.put(None)


def _reply(out: Any, message: dict[str, Any]) -> None:
    try:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()
    except (BrokenPipeError, OSError):  # the trainer is gone; the log has it
        pass


def _run(promoter: Promoter, op: str, step: int, msg: dict[str, Any]) -> dict[str, Any]:
    """One request: ``persist`` (one node: all of it); across nodes ``begin`` (rank 0's node),
    ``copy`` (every node: its own ranks' files) and ``commit`` (rank 0's node)."""
    if isinstance(msg.get("lease_returned"), str):
        promoter.lease_returned(msg["lease_returned"])
    parent, seen = _parent_of(msg)
    if op == "persist":
        return promoter.persist(step, parent=parent, parent_seen=seen)
    if op == "begin":
        return promoter.begin(step)
    generation, files = msg.get("generation"), msg.get("files")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise ResilientError(f"{op} request without a valid generation: {msg!r}")
    try:
        if op == "copy":
            if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
                raise ResilientError(f"copy request without a list of files: {msg!r}")
            return promoter.copy(step, generation, files)
        return promoter.commit(step, generation, parent=parent, parent_seen=seen)
    finally:
        if op == "commit" or msg.get("last"):
            promoter.done(step)


def _parent_of(msg: dict[str, Any]) -> tuple[tuple[tuple[int, int], ...], int | None]:
    """The ``parent`` of a request, the commits the state descends from, newest first, as
    [[step, commit_seq], ...] (empty where it gives none that is one), and its ``parent_seen``
    (None where it is no commit_seq)."""
    seen = msg.get("parent_seen")
    if type(seen) is not int or not 0 <= seen <= MAX_INT:
        seen = None
    return chain_of(msg.get("parent"), 1 + MAX_OLDER) or (), seen


def _serve(promoter: Promoter, requests: queue.Queue, out: Any) -> bool:
    """Answer requests until a goodbye (True) or the pipe's end without one (False)."""
    while True:
        msg = requests.get()
        if msg is None:
            return False
        if msg.get("op") == "close":
            if isinstance(msg.get("lease_returned"), str):
                try:
                    promoter.lease_returned(msg["lease_returned"])
                except Exception as e:  # the flush comes all the same
                    log.warning("taking the trainer's lease back failed: %s", e)
            return True
        op, rid, step = msg.get("op"), msg.get("id"), msg.get("step")
        if op not in ("persist", "begin", "copy", "commit"):
            log.warning("unknown request %r", msg)
            continue
        try:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ResilientError(f"{op} request without a valid step: {msg!r}")
            _reply(out, {"id": rid, "ok": True, **_run(promoter, op, step, msg)})
        except Exception as e:
            log.error("persisting step %s failed: %s: %s", step, type(e).__name__, e)
            _reply(out, {"id": rid, "ok": False, "type": type(e).__name__, "error": str(e)[:4000]})


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s persister[{os.getpid()}] %(levelname)s %(message)s",
    )
    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    config = json.loads(stdin.readline(_MAX_MESSAGE))
    job_dir = config["job_dir"]
    lock = os.open(os.path.join(job_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    log.info(
        "started for %s (trainer pid %s); waiting for the lock",
        config["url"],
        config.get("parent_pid"),
    )
    # a predecessor may still be flushing: wait (to flush this trainer's newest snapshot once it
    # is done, if this trainer dies meanwhile), but not for ever once the trainer is gone (a
    # predecessor stopped, holding the lock): its snapshots stay for the next run of the job
    orphan_wait_s = float(config.get("orphan_wait_s", _ORPHAN_WAIT_S))
    gone_at = None
    waiting = None  # (a predecessor joining a flush across nodes stops waiting for one: see
    while not _try_lock(lock):  # joint_flush.successor_waiting)
        if waiting is None:
            waiting = mark_waiting(job_dir)
        if gone_at is None and not _parent_alive(
            config.get("parent_pid"), config.get("parent_start")
        ):
            gone_at = time.monotonic()
        if gone_at is not None and time.monotonic() - gone_at > orphan_wait_s:
            log.warning(
                "the trainer is gone, and the lock was not free within %.0fs of it: exiting; "
                "its snapshots stay in memory for the next run of the job",
                orphan_wait_s,
            )
            _unlink_quietly(waiting)
            return 0
        time.sleep(0.2)
    _unlink_quietly(waiting)
    _reclaim_outboxes(os.path.join(job_dir, OUTBOX))
    requests: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stdin:
            try:
                requests.put(json.loads(line[:_MAX_MESSAGE]))
            except ValueError:
                log.warning("unreadable request %r", line[:200])
        requests.put(None)

    threading.Thread(target=read, name="requests", daemon=True).start()
    threading.Thread(
        target=_watch_parent,
        args=(config.get("parent_pid"), config.get("parent_start"), requests),
        name="parent",
        daemon=True,
    ).start()
    promoter = Promoter(config)
    # (across nodes, not rank 0's node) the flush record there before this trainer's flush: read
    # beside the requests (a slow store must not hold up the first save's copy)
    baseline: list[str | None] = []
    if not config.get("flush", True) and promoter.across_nodes:
        threading.Thread(
            target=lambda: baseline.append(record_id(promoter.storage)),
            name="flush-baseline",
            daemon=True,
        ).start()
    try:
        if _serve(promoter, requests, out):
            log.info("closed by the trainer; flushing what durable storage lacks, if anything")
        else:
            log.info("the trainer is gone without a goodbye: flushing the newest snapshot")
        if not config.get("flush", True):  # across nodes, rank 0's node's persister flushes;
            if promoter.across_nodes:  # the others write their files where it asks
                wait_s = float(config.get("join_wait_s", JOIN_WAIT_S))
                join_flush(promoter, wait_s, baseline[0] if baseline else None)
            return 0
        try:
            done = promoter.flush()
            if done:
                log.info("flushed step %d (commit %d)", done["step"], done["commit_seq"])
        except Exception as e:
            log.error("flush failed: %s: %s", type(e).__name__, e)
            return 1
        return 0
    finally:
        promoter.close()
        shutil.rmtree(promoter.outbox, ignore_errors=True)


def run() -> None:
    """The process's entry: ``main()``, then exit at once: the thread reading the trainer's pipe
    may still block in it (the trainer gone, a process it forked holding the pipe), and the
    interpreter's shutdown would abort on that read's lock (SIGABRT, a core file)."""
    try:
        code = main()
    except BaseException:
        logging.exception("the persister failed")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
