"""The Checkpointer: the public save/load interface (DESIGN.md section 5).

Owns the lifecycle of saves (one in flight, background failures re-raised at the next call),
finding steps, and load with resharding and optional fallback.  The pieces it drives live in
state.py (what a state is), writer.py (save), reader.py (load), retention.py and storage.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient.checkpoint import snapshots as _snapshots
from resilient.checkpoint.buffers import scratch_for
from resilient.checkpoint.catalog import Catalog, line_of, scan
from resilient.checkpoint.format import (  # (_short: a value's repr, cut for a message)
    ANCHOR_EXACT_KEY,
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    MAX_INT,
    MAX_MANIFEST_BYTES,
    MAX_NAME_CHARS,
    MAX_OLDER,
    MAX_RUN,
    PARENT_KEY,
    RUN_KEY,
    RUN_UNCOUNTED_KEY,
    RUNS_SEEN_KEY,
    ChunkEntry,
    Manifest,
    ManifestEncoder,
    _short,
    manifest_of_step,
    manifest_summary,
    parent_known,
    parent_record,
    rank_file_name,
    recorded_chain,
    step_dir_name,
    summary_from_line,
    summary_line,
)
from resilient.checkpoint.lease import WriterLease, _boot_id, default_job_id
from resilient.checkpoint.persister import PersisterClient, link_to_outbox, state_of
from resilient.checkpoint.reader import (
    READ_THREADS,
    ReadItem,
    ReadRing,
    ReadStats,
    execute_reads,
    plan_reads,
    read_manifest,
    verify_step,
    watching_retirement,
)
from resilient.checkpoint.replicas import NodeMap, Replicas, node_map
from resilient.checkpoint.retention import Sweep, delete_dirs
from resilient.checkpoint.seal import (
    NodeLocal,
    is_record_name,
    newest_plausible_seq,
    seal_staged,
)
from resilient.checkpoint.seal_nodes import has_peer_pairs, seal_across_nodes
from resilient.checkpoint.slots import STAGING_DIR, Slots, StagedInfo, _Slot
from resilient.checkpoint.snapshots import (
    ANCHOR_KEY,
    IMPLAUSIBLE_SEQ,
    RUN_SHIFT,
    MemoryPlace,
    _fmt,
    _parse_anchor,
    default_root,
    exact_anchor,
    line_mark,
    mark_line_start,
    memory_place,
    newer_line,
    number_this_run,
    runs_counted,
    stale_snapshot,
)
from resilient.checkpoint.state import DescribeCache, FlatState, flatten_state, is_dtensor
from resilient.checkpoint.storage import PinnedFiles, RetryPolicy, Storage
from resilient.checkpoint.worker import Job, Worker
from resilient.checkpoint.writer import (
    CommitError,
    Committer,
    Stager,
    WritePlan,
    build_manifest,
    next_generation,
    persist_rank_file,
    plan_writes,
    publish_commit,
)
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    LeaseError,
    MemoryTierError,
    ResilientError,
    StateMismatchError,
    StepRetiredError,
    StorageError,
)
from resilient.layout import Layout, from_device_mesh

__all__ = ["Checkpointer", "SaveHandle", "SaveStats", "LoadStats"]

log = logging.getLogger(__name__)


# Checkpointers dropped unclosed, collected, and let go of by a thread of their own
# (Checkpointer.__del__): a collection runs on whichever thread allocates, possibly one in the
# middle of what letting go takes (a lease's renewal thread holding its lock: a deadlock had the
# finalizer released the lease there).  SimpleQueue.put may be called from a finalizer; the
# thread is started with the first checkpointer of the process, not by a finalizer.
_DROPPED: queue.SimpleQueue[Checkpointer] = queue.SimpleQueue()
_REAPER: list[threading.Thread] = []
_REAPER_LOCK = threading.Lock()


def _reap_dropped() -> None:
    while True:
        ck = _DROPPED.get()
        if ck._owner_pid != os.getpid():  # (queued before a fork: its process lets go of it)
            del ck
            continue
        try:
            ck._let_go()
        except Exception as e:  # (said, as a save's failure is)
            log.warning("letting go of a checkpointer of %s dropped unclosed: %s", ck.url, e)
        del ck


def _collect_dropped(timeout_s: float = 60.0) -> None:
    """A collection, then the letting go of every checkpointer it (or an earlier one) dropped:
    ``snapshots.collect_dropped``, for a rank's lock this process holds itself.  Bounded: the
    lock's own wait then says what holds it."""
    gc.collect()
    _start_reaper()
    done = threading.Event()
    _DROPPED.put(_Marker(done))  # (after every checkpointer queued before it)
    done.wait(timeout_s)


class _Marker:
    """(the reaper's) Sets ``done`` when its turn comes."""

    def __init__(self, done: threading.Event) -> None:
        self._owner_pid, self.url, self._done = os.getpid(), "", done

    def _let_go(self) -> None:
        self._done.set()


def _start_reaper() -> None:
    with _REAPER_LOCK:
        if not _REAPER or not _REAPER[0].is_alive():  # (a fork's child has no threads)
            _REAPER[:] = [
                threading.Thread(target=_reap_dropped, name="resilient-ckpt-reaper", daemon=True)
            ]
            _REAPER[0].start()


_snapshots.collect_dropped = _collect_dropped


def _version() -> str:
    from resilient import __version__

    return __version__


@dataclass
class SaveStats:
    step: int
    stage_s: float = 0.0  # the part the caller waits for
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    committed: bool = False
    # (a memory snapshot) sealed by its staged record, its commit deferred (memory_commit_every)
    sealed: bool = False


@dataclass
class LoadStats:
    step: int
    bytes_read: int = 0
    bytes_verified: int = 0
    num_requests: int = 0
    resharded: bool = False
    seconds: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)
    source: str = "durable"  # the tier it came from: "memory" or "durable"
    peer_files: int = 0  # (memory, across nodes) files brought from other nodes' memory first
    # (memory, rank 0) the step was committed by this load from its ranks' staged records: a
    # sealed snapshot, or one whose commit a fault cut short (seal.py)
    sealed: bool = False
    # (memory, rank 0) the newest snapshot this load could restore, on any node (across nodes,
    # rank 0's own node may hold none of them)
    newest_memory: int | None = None


def _optional_names(names: Any) -> frozenset[str]:
    """``load``'s ``optional``: an iterable of value names (not one str, whose letters would be
    taken for names)."""
    try:
        listed = () if isinstance(names, (str, bytes)) else tuple(names)
    except TypeError:
        listed = ()
    if not listed and names or not all(isinstance(n, str) for n in listed):
        raise TypeError(
            f"optional must be value names such as ('config.corpus',), got {_short(names)}"
        )
    return frozenset(listed)


def _check_step(step: Any, call: str, *, optional: bool = False) -> None:
    """A step given to ``call`` is an int in [0, 2**63 - 1] (not a bool, a float, a str: a step
    number that only looks like one, such as '12', names no step; True would be step 1)."""
    if (optional and step is None) or (type(step) is int and 0 <= step <= MAX_INT):
        return
    shown = _short(step)
    expected = "None (the newest commit) or an int" if optional else "an int"
    hint = (
        "a step is a count from 0 that fits an int64"
        if type(step) is int
        else "pass the step number as an int, such as step=int(s)"
    )
    raise ValueError(
        f"{call}(step=...) must be {expected} in [0, 2**63 - 1], got {shown} "
        f"({type(step).__name__}); {hint}"
    )


class SaveHandle:
    """A save in progress.  ``wait()`` blocks until it is committed and re-raises its failure."""

    def __init__(self, step: int, lineage: int = 0) -> None:
        self.step = step
        self.stats = SaveStats(step)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._error_reported = False
        self._lineage = lineage  # the checkpointer's when this save began (see _advance_anchor)
        # (a durable save) the commits its state descends from when it began: its parent, then
        # what that one descends from, newest first (empty: not known exactly)
        self._parent: tuple[tuple[int, int], ...] = ()
        # the newest durable commit_seq known when that parent was set: a commit above it when
        # this save commits (a save of an earlier process or lineage, or one given up on, that
        # committed since) may be what the state descends from, so the parent is not recorded
        self._parent_seen = 0
        self._replica_epoch: int | None = None  # its peer replicas' groups when it began
        # (a sealed memory snapshot) its slot, or why it has none; and (layout, plan, values)
        self._sealed: Any = None
        self._sealed_meta: tuple | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """The background failure of a finished save (None while running or on success)."""
        return self._error

    def wait(self, timeout: float | None = None) -> SaveStats:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            self._error_reported = True
            raise self._error
        return self.stats

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self.finished_at = time.time()
        self._done.set()


class Checkpointer:
    """Sharded, asynchronous, checksummed checkpoints of a (distributed) training state.

    ``Checkpointer(url, *, layout=None, keep_last=3, keep_every=None, compression=None,
    storage_options=None)``.  In a process group every rank makes the same calls with the same
    step.  ``layout`` defaults to the mesh of the first DTensor in the state, or ``Layout(dp=W)``.

    Options beyond the contract: ``retry`` (a RetryPolicy for transient storage errors),
    ``block_bytes`` (checksum block size), ``commit_timeout_s`` (how long a commit waits for a
    rank), ``store`` (the c10d store of the commit handshake; default: the process group's),
    ``job_id`` (this job's identity in the writer lease; default: torchrun's run id, else the
    process group's store address, else a fresh id), ``lease_timeout_s`` (after how long without a
    heartbeat another job's lease may be taken over), ``commit_method`` (``"rename"`` or
    ``"put"``, for a filesystem that is neither a local disk nor a known object store).

    The memory tier: ``memory_every=N`` keeps snapshots in the node's host memory
    (``memory_root``, default ``$RESILIENT_MEMORY_ROOT`` or ``/dev/shm/resilient-<uid>``), in this same
    format, so they outlive the training processes: ``snapshot(step, state)`` takes one when
    ``step`` is a multiple of ``N`` (the two newest are kept), and ``load()`` restores the newest
    step of either tier, memory first, falling back to durable storage when a snapshot is missing
    or damaged.  ``save()`` keeps its meaning: a durable commit to ``url``.
    ``memory_commit_every=K``: only one snapshot in ``K`` is committed as it is taken (0:
    none); the others are *sealed*: each rank's copy and its staged record (with every chunk's
    checksums) are all there is: no handshake, no manifest.  A restore after a fault, the
    persister's flush and a durable save of the step commit a sealed snapshot when they need it
    (seal.py), so a fault still loses at most one step.  Across nodes K is 0 or 1 (K > 1
    commits every snapshot there): a sealed snapshot's file and record are sent to the peer
    node in the background, and a load commits the newest step every rank sealed from what the
    nodes hold (seal_nodes.py).
    """

    def __init__(
        self,
        url: str,
        *,
        layout: Layout | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        commit_timeout_s: float = 600.0,
        store: Any | None = None,
        job_id: str | None = None,
        lease_timeout_s: float = 60.0,
        commit_method: str | None = None,
        memory_every: int | None = None,
        memory_root: str | None = None,
        persister: bool | None = None,
        memory_commit_every: int = 1,
        _namespace: str = "ckpt",
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last must be an int >= 1 (the newest step is always kept), got {keep_last!r}"
            )
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be None or an int >= 1, got {keep_every!r}")
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        if not 4096 <= block_bytes <= 1 << 30:
            raise ValueError(f"block_bytes must be in [4 KiB, 1 GiB], got {block_bytes}")
        if not lease_timeout_s > 0:
            raise ValueError(f"lease_timeout_s must be positive, got {lease_timeout_s!r}")
        if not commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s must be positive, got {commit_timeout_s!r}")
        if job_id is not None and (type(job_id) is not str or len(job_id) > MAX_NAME_CHARS):
            shown = _short(job_id)
            raise ValueError(
                f"job_id must be a str of at most {MAX_NAME_CHARS} characters (it names this job "
                f"in the writer lease and in every manifest, where readers refuse longer ones), "
                f"got {shown}; pass a shorter name"
            )
        check_memory_options(memory_every, memory_commit_every)
        self.storage = Storage(url, storage_options, retry, commit_method=commit_method)
        self.url = self.storage.url
        self.keep_last, self.keep_every, self.compression = keep_last, keep_every, compression
        self.block_bytes = block_bytes
        self.commit_timeout_s = commit_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.job_id = job_id or default_job_id()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        if layout is not None:
            layout.check_world_size(self.world_size)
        self.layout = layout
        self._store = store
        self._store_given = store is not None
        self._namespace = _namespace  # the store keys of this checkpointer's handshakes
        self._uid: int | None = None
        self._seq = 0
        self._loads = 0
        self._lease: WriterLease | None = None
        # (rank 0) the token of the lease it took for saves of its own and released, still
        # its own until then: the persister may take it anew (persister.Promoter.lease_returned)
        self._lease_returned: str | None = None
        self._sweep = Sweep()  # the uncommitted step directories this job may delete
        self._stager = Stager()
        self._slots: Slots | None = None  # (the memory tier's own) the lean snapshot path
        # the newest plan: (its signature, the plan, whether a tensor is on the GPU, the
        # DescribeCache generation of its flatten)
        self._plan_cache: tuple[Any, WritePlan, bool, int] | None = None
        self._checked_shape: tuple | None = None  # (memory tier) see _coordinate
        self._described = DescribeCache()  # each save describes the tensors of the one before
        self._static_reports: dict[str, Any] = {}  # (the coordinator) writer.report_chunks
        self._encoder = ManifestEncoder()  # (memory tier) a manifest's text, per shape
        self._pending: SaveHandle | None = None
        # a save's commit runs as a job on a waiting thread of the worker (a thread per save made
        # the caller wait for it to be scheduled); ``join()`` and ``is_alive()`` as a thread's
        self._worker = Worker()
        self._thread: Job | threading.Thread | None = None
        self._closed = False
        self.last_load: LoadStats | None = None
        # (the memory tier's own checkpointer) what to run on its coordinator right after a
        # step commits, before the step can be retired: the outer one pins it for the persister
        self._after_commit: dict[int, Any] = {}
        self._shared_manifest: str | None = None  # the store key of the newest shared manifest
        self._last_outcome_key: str | None = None  # the previous commit's outcome (store key)
        # (the coordinator) the keys of the commits that failed since the last one every rank
        # reported to: the next such commit deletes them (no rank reads them any more)
        self._stale_keys: list[str] = []
        self._doomed: list[str] = []  # those of them to delete after this commit's outcome
        self._last_outcome: str | None = None  # the failure of the last joined save, if any
        # (in-job recovery) the pending save is the previous group's: a load need not wait for it
        self._pending_is_old = False
        self._hook_lock = threading.Lock()
        # (the memory tier's own) memory_commit_every, and every how many steps that is (0:
        # never; else the snapshots of the other steps are sealed: see _defers)
        self._commit_every, self._commit_period = 1, 1
        # (the memory tier's own, across nodes) whether sealed snapshots can be replicated:
        # Replicas.sealed_ready, read where a background job was joined (the same on every rank)
        self._sealed_replicas = False
        # the memory tier across nodes: where each rank is, and peer replicas (replicas.py)
        self.nodes = NodeMap((0,) * self.world_size)
        self._memory_root = memory_root
        self._replicas: Replicas | None = None
        self._memory_asked = memory_every is not None  # (rebind runs what this runs)
        if memory_every is not None and self._distributed and self.world_size > 1:
            self.nodes = node_map(
                self.world_size, self.rank, memory_root or default_root(), _boot_id()
            )
        if memory_every is not None and self.nodes.nodes > 1 and not self.nodes.uniform:
            counts = sorted({len(self.nodes.ranks_of(n)) for n in range(self.nodes.nodes)})
            message = (
                f"memory_every={memory_every}: this job's {self.nodes.nodes} nodes hold different "
                f"numbers of ranks ({counts}), and peer replicas pair the ranks of neighbouring "
                f"nodes; the tier is off, durable saves to {self.url} protect the run"
            )
            _tell(message)
            memory_every = None
        self.memory_every = memory_every
        self.memory: MemoryPlace | None = None
        self._memory: Checkpointer | None = None
        self._abort = threading.Event()
        self._live_committer: Committer | None = None
        # The newest durable commit (step, commit_seq) this job's state descends from: every
        # snapshot records it, and a snapshot whose durable commit is no longer on the durable
        # line (a rollback, deleted steps, a fresh start at the URL) is never restored.
        self._anchor: tuple[int, int] | None = None
        # whether _anchor is the very commit the state descends from (a durable load, or this
        # process's last durable commit): a memory snapshot's anchor is only the newest commit
        # known when it was taken (a save in flight then is not it), so a durable commit records
        # its parent (format.PARENT_KEY) only from an exact one
        self._anchor_exact = False
        # (with _anchor_exact) the newest durable commit_seq known when _anchor was set: a commit
        # above it at or below a snapshot's step was made since (a flush or a save of it)
        self._anchor_seen = 0
        # what _anchor's commit descends from, as its record says (its parent first)
        self._anchor_chain: tuple[tuple[int, int], ...] = ()
        self._lineage = 0  # one more at every restore: a save begun before it anchors nothing
        self._anchors: dict[int, tuple[int, int] | None] = {}  # (rank 0) per memory candidate
        self._exact_anchors: set[int] = set()  # (rank 0) the candidates whose anchor is exact
        # (rank 0) the candidates numbered below the newest durable step that are nonetheless the
        # job's newest state (snapshots.newer_line: snapshots after a rollback)
        self._newer_line: set[int] = set()
        # (rank 0, memory tier) the newest commit order in this node's memory at this load's
        # start (None: not listed), recorded as where the line begins once the load succeeds
        self._line_base: int | None = None
        self._durable_seen = 0  # (rank 0) the newest durable commit_seq its last listing saw
        # (the memory tier across nodes) the newest commit order in any node's memory, agreed
        # where the checkpointer is made or carried to a new group, and raised by each load's
        # exchange: rank 0's next commits rank above it
        self._seq_floor = 0
        # (rank 0, memory tier) this run's number (snapshots.number_this_run); None where it could
        # not be counted
        self._run: int | None = None
        # (rank 0, memory tier) the run its durable commits record (format.RUN_KEY): this run's,
        # or where it was not counted the run its commits in memory are numbered as (as the
        # persister's commits of its snapshots record); 0 for none
        self._commit_run = 0
        # (rank 0, without the tier) the runs with it counted at the URL, read at the first commit
        self._runs_seen: int | None = None
        self._newest_offered: int | None = None  # (rank 0) see LoadStats.newest_memory
        if memory_every is not None:
            # a local path is its absolute path: "ckpt" run from two directories is two jobs
            key = os.path.abspath(self.storage.path()) if self.storage.is_local else self.url
            self.memory = memory_place(key, memory_root)
            self.memory.claim()
            # (before any file of the tier is touched: a second live process of this rank, of
            # another job of this URL or this one started twice, is refused, its files left be)
            hold = self.memory.hold(self.rank)
            self._memory = Checkpointer(
                self.memory.steps,
                layout=layout,
                keep_last=2,
                block_bytes=block_bytes,
                commit_timeout_s=commit_timeout_s,
                # its own connection: the two checkpointers' handshakes run on two threads at
                # once, and one store client serializes them (each would wait inside the other)
                store=store.clone() if store is not None and hasattr(store, "clone") else None,
                job_id=self.job_id,
                lease_timeout_s=lease_timeout_s,
                _namespace="mem",
            )
            self._memory._slots = Slots(self.memory.dir, self.memory.steps, self.rank, hold)
            self._memory._commit_every = memory_commit_every
            self._memory._commit_period = memory_commit_every * memory_every
            if self.nodes.nodes > 1:
                self._memory.nodes = self.nodes
                self._memory._replicas = Replicas(
                    self.nodes,
                    self.rank,
                    timeout_s=min(commit_timeout_s, 300.0),
                    spare_dir=os.path.join(self.memory.dir, STAGING_DIR),
                )
                self._agree_memory_floor()
                self._memory._sealed_replicas = self._memory._replicas.sealed_ready()
                if memory_commit_every > 1:
                    _tell(
                        f"memory_commit_every={memory_commit_every} applies on one node: across "
                        f"this job's {self.nodes.nodes} nodes it is 0 (every snapshot sealed) or "
                        f"1, and every memory snapshot is committed (README, 'Sealed snapshots "
                        f"across nodes')"
                    )
                elif memory_commit_every == 0 and not self._memory._sealed_replicas:
                    _tell(
                        f"memory_commit_every=0: the peer replicas' connections between this "
                        f"job's {self.nodes.nodes} nodes could not be made, and a sealed "
                        f"snapshot's replica travels only over them: every memory snapshot is "
                        f"committed (README, 'Sealed snapshots across nodes')"
                    )
            if self.rank == 0:  # (it numbers the commits in memory) above every earlier run's
                self._run = self._number_this_run()
                # (its staged records say it: a seal numbers a sealed step as the run's, seal.py;
                # a run that could not be counted, as the newest run this memory holds)
                self._memory._slots.job_run = (
                    self._run
                    if self._run is not None
                    else max(self._memory._seq_floor, self._node_newest_seq()) >> RUN_SHIFT
                )
                self._commit_run = self._memory._slots.job_run
                self._begin_line()
        # Durable saves through the persister process (persister.py) when the tier is on, one per
        # node (its leader's); RESILIENT_PERSISTER=0 asks for the trainer's own thread where the
        # code says nothing.
        if persister is None and os.environ.get(ENV_PERSISTER, "").strip() == "0":
            persister = False
        self._snap: SaveHandle | None = None  # the newest snapshot this checkpointer took
        self._persister: PersisterClient | None = None
        self._persister_config: dict[str, Any] | None = None
        if self._memory is not None and persister is not False:
            why_not = self._persister_unavailable(storage_options, retry, compression)
            if why_not and persister:
                raise ValueError(f"persister=True cannot work here: {why_not}")
            if why_not:
                log.info("durable saves stay in the trainer's process: %s", why_not)
            else:
                self._persister_config = {
                    # a local path made absolute: the persister does not share our directory
                    "url": self.storage.path() if self.storage.is_local else self.url,
                    "storage_options": storage_options or {},
                    "retry": dataclasses.asdict(self.storage.retry),
                    "commit_method": self.storage.commit_method,
                    "job_id": self.job_id,
                    "keep_last": keep_last,
                    "keep_every": keep_every,
                    "lease_timeout_s": lease_timeout_s,
                    # the flush when the trainer dies: rank 0's node's (across nodes, it holds
                    # the newest snapshot whole only with two nodes: its files and the replicas)
                    "flush": self.nodes.node_of[self.rank] == self.nodes.node_of[0],
                    # (on three nodes or more no node holds every file: the other nodes'
                    # persisters write theirs where rank 0's asks, joint_flush.py)
                    "nodes": self.nodes.nodes,
                    "node_ranks": list(self.nodes.ranks_of(self.nodes.node_of[self.rank])),
                    "node": self.nodes.node_of[self.rank],
                    # sealed snapshots across nodes: the flush seals with every node's
                    # persister first, through the URL (joint_flush.seal_together)
                    "sealed_nodes": self.nodes.nodes > 1
                    and memory_commit_every == 0
                    and self._memory._sealed_replicas,
                    # (rank 0's: its flush seals no staged step of a later run than this one)
                    "max_run": self._run,
                }
        # (the memory tier's own) goodbyes to persisters that a dropped checkpointer handed it
        # while its last snapshot was still being committed: see _let_go
        self._goodbyes: list[tuple[PersisterClient, str | None]] = []
        _start_reaper()
        self._owner_pid = os.getpid()  # (last: __del__ lets go of a whole one, in this process)

    def _persister_unavailable(
        self, storage_options: Any, retry: RetryPolicy | None, compression: str | None
    ) -> str | None:
        """Why durable saves cannot be handed to a persister process, or None."""
        if self.storage.protocol == "memory":
            return f"{self.url} is in this process's memory, which another process cannot see"
        if compression is not None:
            return "compression re-encodes the bytes; the persister copies snapshots as they are"
        try:
            json.dumps(storage_options or {})
        except (TypeError, ValueError):
            return "the storage options are not plain JSON, so they cannot be handed over"
        return None

    @property
    def persister_pid(self) -> int | None:
        """The pid of the process that writes this job's durable saves (a node's leader rank,
        memory tier)."""
        return None if self._persister is None else self._persister.pid

    # --- context manager ------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- queries ----------------------------------------------------------------------------
    def catalog(self) -> Catalog:
        """Every step directory, classified (committed, uncommitted, damaged), in commit order."""
        return scan(self.storage)

    def steps(self) -> list[int]:
        """Committed steps by number, ascending (abandoned branches included)."""
        return self.catalog().steps()

    def commits(self) -> list[int]:
        """Committed steps in the order they were committed, oldest first."""
        return self.catalog().commits()

    def latest_step(self) -> int | None:
        """The most recently committed step (not the highest number: see README, rollback)."""
        newest = self.catalog().newest()
        return None if newest is None else newest.step

    @property
    def snapshots(self) -> Checkpointer | None:
        """The memory tier's own checkpointer (its steps, manifests, verify), or None."""
        return self._memory

    def memory_steps(self) -> list[int]:
        """The steps this node's memory tier holds, newest first ([] without the tier)."""
        if self._memory is None:
            return []
        return self._memory.catalog().line()

    def _has_staged(self) -> bool:
        """Whether this node's memory tier holds staged records (sealed snapshots, or a commit
        cut short): not in ``memory_steps()``, yet a load may seal and restore one (seal.py)."""
        if self.memory is None:
            return False
        try:
            names = os.listdir(os.path.join(self.memory.dir, STAGING_DIR))
        except OSError:
            return False
        return any(is_record_name(name) for name in names)

    def manifest(self, step: int | None = None) -> Manifest:
        _check_step(step, "manifest", optional=True)
        return read_manifest(self.storage, self._resolve_step(step))

    def verify(self, step: int | None = None, *, progress: Callable[[int], None] | None = None):
        """Read every byte of a step and check it; returns a VerifyReport.  ``progress(n)``: n
        more bytes checked (a progress bar's)."""
        _check_step(step, "verify", optional=True)
        return verify_step(self.storage, self._resolve_step(step), progress=progress)

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` and persist it in the background; returns once the snapshot is staged.

        Waits for the previous save first (one in flight) and re-raises its failure, if any.
        """
        return self._save(step, state, defer=False)

    def _save(self, step: int, state: Mapping[str, Any], *, defer: bool) -> SaveHandle:
        """save(); with ``defer`` (the memory tier's own, see _defers) the snapshot is sealed
        instead of committed (_seal_snapshot)."""
        self._check_open()
        _check_step(step, "save")
        lean = self._slots is not None
        if not lean:
            self._join_pending()
        # (a durable save, the previous one joined: its commit counts) what it descends from;
        # saving the step it loaded again (that commit is replaced), what that one descends from
        parent: tuple[tuple[int, int], ...] = ()
        if self._anchor_exact and not lean and self._anchor is not None:
            parent = (self._anchor, *self._anchor_chain)
            if self._anchor[0] == step:
                parent = self._anchor_chain
            parent = parent[: 1 + MAX_OLDER]  # (what a record keeps: not a chain per save)
        if self._persister_config is not None and self._through_persister(step):
            return self._save_through_persister(step, state, parent)
        t0 = time.monotonic()
        layout = self._layout_for(state)
        flat = flatten_state(state, layout, self.rank, cache=self._described)
        plan, on_gpu, known = self._plan(flat, layout, described=True)
        data: torch.Tensor | _Slot | Exception
        if lean:
            assert self._slots is not None
            if defer:
                return self._seal_snapshot(step, layout, plan, flat, t0, known=known, gpu=on_gpu)
            # Straight into the tmpfs rank file, while the snapshot before this one finishes
            # committing on another core; it is committed (or its failure raised) before this
            # one returns, so a fault loses at most the step being staged.  A failure here (no
            # room on the tmpfs) is this rank's alone: it is reported through the commit, like a
            # failed write, so that every rank counts this save and hears the same outcome.
            try:
                info = StagedInfo(layout, flat.values, self.job_id, self.block_bytes)
                data = self._slots.stage(
                    plan, flat.tensors, step, info, self.block_bytes, fits=known, gpu=on_gpu
                )
            except Exception as e:
                data = e
            try:
                self._join_pending()
            except BaseException:
                if isinstance(data, _Slot):
                    self._slots.settled(data, False)
                raise
        else:
            self._join_pending()
            data = self._stager.stage(plan, flat.tensors)
        handle = SaveHandle(step, self._lineage)
        handle._parent, handle._parent_seen = parent, self._anchor_seen
        if self._replicas is not None:  # its replication uses these groups, not later ones
            handle._replica_epoch = self._replicas.epoch
        handle.stats.stage_s = time.monotonic() - t0
        committer = self._committer(step)
        try:
            job = self._worker.submit(
                self._thread_name(step),
                self._persist,
                *(handle, step, layout, plan, data, dict(flat.values), committer),
            )
        except BaseException:  # no thread could start: nothing is pending, the slot is free
            if isinstance(data, _Slot) and self._slots is not None:
                self._slots.settled(data, False)
            raise
        self._pending, self._thread = handle, job
        return handle

    def _defers(self, step: int) -> bool:
        """(the memory tier's own) Whether the snapshot of ``step`` is sealed rather than
        committed: decided alike on every rank, by the step, and across nodes (0 only: a sealed
        step older than a commit is never sealed after it, and a commit waits for its replicas
        to be whole) by whether the replicas' connections were up on every rank when the last
        background job was joined (a sealed snapshot's replica travels over them only:
        ``Replicas.replicate_sealed``; see ``_seal_snapshot`` for the snapshot after they
        broke)."""
        period = self._commit_period
        return (
            self._commit_every != 1
            and self._slots is not None
            and (self._replicas is None or (self._sealed_replicas and period == 0))
            and (period == 0 or step % period != 0)
        )

    def _seal_snapshot(
        self,
        step: int,
        layout: Layout,
        plan: WritePlan,
        flat: FlatState,
        t0: float,
        *,
        gpu: bool = False,
        known: bool = False,
    ) -> SaveHandle:
        """(the memory tier's own) A snapshot sealed by its staged record: the copy into the rank
        file (from the GPU too: ``gpu``), the checksums of every chunk (a large tensor's as it is
        copied) and the record that carries them, on the caller's thread; no handshake (across
        nodes, the file and record go to the peer node in the background: _replicate_sealed).
        What a failure leaves (no file, no record) is this rank's alone: the step is then not
        restorable, the one before it is."""
        assert self._slots is not None
        values = dict(flat.values)
        handle = SaveHandle(step, self._lineage)
        handle._sealed_meta = (layout, plan, values)
        slot: _Slot | None = None
        error: BaseException | None = None
        try:
            info = StagedInfo(layout, flat.values, self.job_id, self.block_bytes)
            slot = self._slots.stage(
                plan, flat.tensors, step, info, self.block_bytes, sum_all=True, fits=known, gpu=gpu
            )
        except Exception as e:
            error = e
        try:
            # (a committed snapshot before it: its outcome, as save()'s; across nodes, the
            # replication of the sealed one before it)
            self._join_pending()
        except BaseException:
            if slot is not None:
                self._slots.settled(slot, False)
            raise
        meta = (step, layout, plan, values)
        across = self._replicas is not None
        if slot is not None and (
            slot.record is None if across else not self._slots.seal(slot, meta)
        ):
            if across:
                self._slots.settled(slot, False)
                slot = None
            error = MemoryTierError(
                f"the staged record of snapshot {step} on rank {self.rank} could not be written "
                f"in {self._slots.staging}; the snapshot is not kept"
            )
        handle.stats.stage_s = time.monotonic() - t0
        if error is None:
            handle._sealed, handle.stats.sealed = slot, True
        else:
            if not isinstance(error, ResilientError):
                wrapped = CommitError(
                    f"snapshot of step {step} failed on rank {self.rank}: {_describe(error)}"
                )
                wrapped.__cause__ = error
                error = wrapped
            handle._sealed = error
            log.error("memory snapshot of step %d failed on rank %d: %s", step, self.rank, error)
        handle._finish(error)
        if across and not self._sealed_replicas:
            # the connections broke while the snapshot before it travelled (the same on every
            # rank once that one is joined, unlike when this one was decided): committed, so
            # that its replica goes through gloo, as every later snapshot's
            if slot is not None and error is None:
                self._slots.seal(slot, meta)
            return self._commit_sealed(handle)
        if across:
            # Its replica goes to the peer node in the background, while the next step trains
            # (every rank, a failed one too: it tells its peer there is nothing); the slot is
            # one of the rank's two newest snapshots only once the replica is in, so that the
            # next snapshot never takes the file of the one before it while this one's
            # replicas are on their way (a node lost then would leave no step whole)
            job_handle = SaveHandle(step, self._lineage)
            job_handle._replica_epoch = self._replicas.epoch  # type: ignore[union-attr]
            try:
                job = self._worker.submit(
                    self._thread_name(step),
                    self._replicate_sealed,
                    *(job_handle, slot if error is None else None, meta),
                )
            except BaseException:
                if slot is not None and error is None:
                    self._slots.seal(slot, meta)
                raise
            self._pending, self._thread = job_handle, job
        return handle

    def _replicate_sealed(self, handle: SaveHandle, slot: _Slot | None, meta: tuple) -> None:
        """(the memory tier's own, across nodes; a background job) Send the sealed snapshot's
        file and record to the peer node and keep the source's (``Replicas.replicate_sealed``),
        then keep the slot as one of the rank's two newest snapshots.  Its failure is logged
        (the snapshot is sealed on this node all the same); its handle never fails, so that a
        rank's own failure does not decide, for it alone, how later saves go."""
        assert self._replicas is not None and self._slots is not None
        step = handle.step
        data = None
        try:
            if slot is not None:
                data = memoryview(slot.mm)
            self._replicas.replicate_sealed(
                self.storage,
                step,
                data,
                None if slot is None else slot.record_text.encode(),
                epoch=handle._replica_epoch,
            )
        except Exception as e:  # sealed here all the same; the replica is a bonus
            log.warning("replicating sealed snapshot %d to the peer node failed: %s", step, e)
        finally:
            if data is not None:
                data.release()
            if slot is not None and not self._slots.seal(slot, meta):
                log.warning("sealed snapshot %d on rank %d is not kept", step, self.rank)
            handle._finish(None)

    def _commit_sealed(self, snap: SaveHandle) -> SaveHandle:
        """(the memory tier's own) Commit the sealed snapshot ``snap`` now, through the usual
        handshake: every rank calls this for the same step (a durable save of it goes through
        the persister).  A rank whose snapshot failed reports its failure there."""
        assert snap._sealed_meta is not None and self._slots is not None
        step = snap.step
        layout, plan, values = snap._sealed_meta
        data = snap._sealed
        self._join_pending()  # (across nodes: its replication, which keeps the slot after it)
        if isinstance(data, _Slot) and not self._slots.unseal(data):
            data = MemoryTierError(
                f"the sealed snapshot of step {step} on rank {self.rank} is no longer held"
            )
        try:
            self._join_pending()
        except BaseException:
            if isinstance(data, _Slot):
                self._slots.settled(data, False)
            raise
        handle = SaveHandle(step, self._lineage)
        committer = self._committer(step)
        try:
            job = self._worker.submit(
                self._thread_name(step),
                self._persist,
                *(handle, step, layout, plan, data, values, committer),
            )
        except BaseException:
            if isinstance(data, _Slot):
                self._slots.settled(data, False)
            raise
        self._pending, self._thread = handle, job
        return handle

    def snapshot(self, step: int, state: Mapping[str, Any]) -> SaveHandle | None:
        """Snapshot ``state`` into the node's memory when ``step`` is a multiple of
        ``memory_every`` (else do nothing and return None); returns once the snapshot is staged.
        Waits for the previous committed snapshot first and re-raises its failure, if any (a
        sealed snapshot is over when this returns: its handle says how it went)."""
        self._check_open()
        if self._memory is None or self.memory_every is None:
            raise ResilientError(
                f"Checkpointer({self.url!r}) has no memory tier; pass memory_every=N to use "
                f"snapshot()"
            )
        _check_step(step, "snapshot")
        if step % self.memory_every:
            return None
        return self._take_snapshot(step, state)

    def _take_snapshot(
        self, step: int, state: Mapping[str, Any], *, defer: bool = True
    ) -> SaveHandle:
        assert self._memory is not None
        if self._memory.layout is None:
            self._memory.layout = self._layout_for(state)
        if self._persister_config is not None and self.nodes.is_leader(self.rank):
            self._start_persister()  # early: it flushes this snapshot should the trainer die
        anchor = "" if self._anchor is None else f"{self._anchor[0]}:{self._anchor[1]}"
        # (rank 0's is what the manifest says) a durable save in flight now, once committed, is
        # what this state descends from, not the anchor: exact only with none
        pending = self._pending
        exact = bool(anchor) and self._anchor_exact and (pending is None or pending.done())
        values = {
            **state,
            ANCHOR_KEY: anchor,
            ANCHOR_EXACT_KEY: self._anchor_seen if exact else False,
        }
        if self._run is None and 0 < self._commit_run < MAX_RUN:  # (rank 0 only: else 0)
            # an uncounted run (_commit_run) says so in its snapshots too: the persister's
            # commits of them (a save handed over, a flush) record it as the trainer's do
            values[RUN_UNCOUNTED_KEY] = True
        self._snap = self._memory._save(step, values, defer=defer and self._memory._defers(step))
        return self._snap

    def _persister_client(self) -> PersisterClient:
        assert self.memory is not None and self._persister_config is not None
        if self._persister is None:
            self._persister = PersisterClient(self.memory.dir, self._persister_config)
        return self._persister

    def _start_persister(self) -> None:
        try:
            self._persister_client().start()
        except Exception as e:  # the save that needs it says so; training goes on
            log.warning("could not start the persister process: %s", e)

    def _through_persister(self, step: int) -> bool:
        """Whether this durable save goes through the persister, decided alike on every rank:
        not once the tier is closed, nor while the tier's newest finished snapshot failed (a
        full tmpfs must not fail the durable saves too: this process writes them meanwhile)."""
        assert self._memory is not None
        if self._memory._closed:
            return False
        pending = self._memory._pending
        if pending is not None and pending.step != step:  # an older snapshot: its outcome first
            try:
                self._memory._join_pending()
            except Exception:  # its own handle reports it
                pass
        failed = self._memory._last_outcome
        if failed is not None:
            log.warning(
                "the memory tier's last snapshot failed (%s); this durable save is written by the "
                "trainer's own thread",
                failed,
            )
            return False
        return True

    def _save_through_persister(
        self, step: int, state: Mapping[str, Any], parent: tuple[tuple[int, int], ...]
    ) -> SaveHandle:
        """A durable save with the memory tier: the snapshot of ``step`` (the one just taken, or
        a new one) is committed to the URL by the persister process (persister.py), recording
        ``parent`` (what its state descends from, where known exactly)."""
        assert self._memory is not None and self.memory is not None
        t0 = time.monotonic()
        snap = self._snap
        if snap is None or snap.step != step:  # (never on timing: every rank decides alike)
            snap = self._take_snapshot(step, state, defer=False)
        elif snap._sealed_meta is not None:  # sealed (or failed so, on some rank): commit it now
            snap = self._snap = self._memory._commit_sealed(snap)
        handle = SaveHandle(step, self._lineage)
        handle._parent, handle._parent_seen = parent, self._anchor_seen
        handle.stats.stage_s = time.monotonic() - t0
        pinned: dict[str, Any] = {}
        self._hand_lease_back()  # (rank 0, if it wrote saves itself: never both at once)
        if self.nodes.is_leader(self.rank):  # (rank 0 on one node)
            outbox = self._persister_client().outbox  # (started in the background thread)
            steps_dir = self.memory.steps
            # across nodes, each node's persister writes the files its node's ranks wrote
            ranks = (
                set(self.nodes.ranks_of(self.nodes.node_of[self.rank]))
                if self.nodes.nodes > 1
                else None
            )

            def pin() -> None:  # hard links: retention may retire the step, not its bytes
                try:
                    pinned["dir"] = link_to_outbox(steps_dir, step, outbox, ranks)
                    pinned["files"] = sorted(os.listdir(pinned["dir"]))
                except Exception as e:
                    pinned["error"] = e

            with self._memory._hook_lock:
                if snap.done():
                    if snap.error is None:
                        pin()
                else:
                    self._memory._after_commit[step] = pin
        committer = self._committer(step)
        job = self._worker.submit(
            self._thread_name(step), self._persist_elsewhere, handle, snap, pinned, committer
        )
        self._pending, self._thread = handle, job
        return handle

    def _persist_elsewhere(
        self, handle: SaveHandle, snap: SaveHandle, pinned: dict[str, Any], committer: Committer
    ) -> None:
        step = handle.step
        error: BaseException | None = None
        t0 = time.monotonic()
        try:
            snap._done.wait()
            if snap.error is not None:
                raise CommitError(
                    f"step {step} was not saved: its memory snapshot failed: {snap.error}"
                ) from snap.error
            handle.stats.write_s = time.monotonic() - t0
            if self.nodes.nodes > 1:
                self._persist_across_nodes(handle, pinned, committer)
            elif committer.is_coordinator:
                # the keys of earlier commits (saves this process wrote, failed ones): every
                # rank is past them once it read this outcome; the last to read it deletes them
                old = self._stale_keys + [k for k in (self._last_outcome_key,) if k]
                handed = committer.hand_over(old)
                self._stale_keys, self._last_outcome_key = old[handed:], None
                try:
                    reply = self._ask_persister("persist", step, pinned, **_parent_field(handle))
                    self._advance_anchor(handle, step, int(reply["commit_seq"]))
                    handle.stats.bytes_written = int(reply.get("bytes", 0))
                except BaseException as e:
                    _publish_failure(committer, e)
                    raise
                committer.publish("ok")
            else:
                # rank 0's persister may take up to commit_timeout_s to answer: then rank 0 says
                _await_outcome(committer, step, extra_s=self.commit_timeout_s, count_read=True)
            handle.stats.commit_s = time.monotonic() - t0 - handle.stats.write_s
            handle.stats.committed = True
        except BaseException as e:
            error = e if isinstance(e, ResilientError) else CommitError(f"{_describe(e)}")
            if error is not e:
                error.__cause__ = e
            log.error("checkpoint save of step %d failed on rank %d: %s", step, self.rank, error)
        handle._finish(error)

    def _ask_persister(
        self, op: str, step: int, pinned: dict[str, Any], **fields: Any
    ) -> dict[str, Any]:
        """(a node's leader) One request to this node's persister; its failure raised."""
        if "error" in pinned:
            raise CommitError(
                f"cannot hand step {step} to the persister: linking its snapshot into the "
                f"outbox failed: {_describe(pinned['error'])}"
            ) from pinned["error"]
        assert self._persister is not None
        if self._lease_returned and op in ("persist", "begin"):  # (the ones that take it)
            fields["lease_returned"], self._lease_returned = self._lease_returned, None
        reply = self._persister.request(op, step, self.commit_timeout_s, **fields)
        if not reply.get("ok"):
            cls = LeaseError if reply.get("type") == "LeaseError" else CommitError
            raise cls(
                f"step {step} was not committed to {self.url} by the persister ({op}): "
                f"{reply.get('type')}: {reply.get('error')}"
            )
        return reply

    def _persist_across_nodes(
        self, handle: SaveHandle, pinned: dict[str, Any], committer: Committer
    ) -> None:
        """A durable save from the memory tier on several nodes: rank 0's persister takes the
        lease and picks the generation, every node's persister writes the files its node's ranks
        wrote, and rank 0's commits once every node reported; the ranks hear the outcome over
        the store, as for any commit."""
        step, coordinator = handle.step, committer.is_coordinator
        leader = self.nodes.is_leader(self.rank)
        if coordinator:
            try:
                generation = int(self._ask_persister("begin", step, pinned)["generation"])
            except BaseException as e:
                committer.publish_begin({"error": _describe(e), "type": type(e).__name__})
                self._drop_outbox(step)
                self._failed_commit(committer, e)
                raise
            committer.publish_begin({"generation": generation})
        else:
            try:
                begin = committer.wait_begin(extra_s=self.lease_timeout_s + self.commit_timeout_s)
            except BaseException:
                self._drop_outbox(step)  # (a leader) the step will not be copied
                raise
            generation = int(begin["generation"])
        own: BaseException | None = None
        report: dict[str, Any] = {"rank": self.rank}
        try:
            if leader:
                files = [f for f in pinned.get("files", ()) if f != MANIFEST_NAME]
                reply = self._ask_persister(
                    "copy", step, pinned, generation=generation, files=files, last=not coordinator
                )
                handle.stats.bytes_written = int(reply.get("bytes", 0))
        except BaseException as e:
            own, report = e, {"rank": self.rank, "error": _describe(e)}
            if not coordinator:
                self._drop_outbox(step)  # (its persister drops it too, if it got that far)
        if not coordinator:
            committer.report(report)
            if own is not None:
                raise own
            # rank 0 waits for every node's copy, then its persister commits: each may take up
            # to commit_timeout_s
            _await_outcome(committer, step, extra_s=2 * self.commit_timeout_s)
            return
        try:
            reports = committer.gather(report)
            self._forget_previous_outcome(committer, reports)
            failed = [r for r in reports if r.get("error")]
            if failed:
                raise CommitError(
                    "; ".join(f"rank {r['rank']} failed to write: {r['error']}" for r in failed)
                )
            reply = self._ask_persister(
                "commit", step, pinned, generation=generation, **_parent_field(handle)
            )
            self._advance_anchor(handle, step, int(reply["commit_seq"]))
        except BaseException as e:
            self._drop_outbox(step)
            self._failed_commit(committer, e)
            self._forget_doomed(committer)
            raise
        committer.publish("ok")
        committer.cleanup()
        self._forget_doomed(committer)

    def continue_line_of(self, other: Checkpointer) -> None:
        """This checkpointer goes on where ``other`` (closed, of the same job and URL) left off:
        its next snapshots descend from the durable commit ``other``'s state descended from."""
        self._anchor, self._anchor_exact = other._anchor, other._anchor_exact
        self._anchor_seen = other._anchor_seen
        self._anchor_chain = other._anchor_chain

    def _advance_anchor(self, handle: SaveHandle, step: int, seq: int) -> None:
        """A durable commit is what the next snapshots descend from, unless a restore came
        between its save and its commit (an in-job recovery leaves the old group's save running
        while the state is restored, maybe to an older step): then the restore's anchor stands."""
        if handle._lineage == self._lineage:
            self._anchor, self._anchor_exact = (step, seq), True
            self._anchor_seen = seq  # (the newest commit: this job holds the writer lease)
            self._anchor_chain = handle._parent

    def _drop_outbox(self, step: int) -> None:
        """(a node's leader, across nodes) Let go of a step its persister will not copy or
        commit."""
        if self._persister is not None:
            shutil.rmtree(os.path.join(self._persister.outbox, step_dir_name(step)), True)

    def wait_snapshot(self) -> SaveStats | None:
        """Block until the pending memory snapshot is committed; re-raise its failure (a sealed
        snapshot has nothing pending: its own handle holds its outcome)."""
        self._check_open()
        return None if self._memory is None else self._memory.wait()

    def close_memory(self) -> None:
        """Wait for the pending memory snapshot and stop using the tier (its snapshots stay); the
        persister process, if any, is told goodbye and waited for (it first persists a
        snapshot newer than the newest durable commit, if there is one)."""
        try:
            if self._persister_config is not None:
                self._join_pending()  # durable saves need the tier
        finally:
            if self._persister is not None:  # (its goodbye may flush: no renewal races it)
                self._hand_lease_back()
            self._close_tier()

    def _hand_lease_back(self) -> None:
        """Release the lease this process took for durable saves of its own (as after a failed
        snapshot) before the persister commits again, in a save or its goodbye's flush, and keep
        its token to send along when it was still this process's up to then: the persister
        takes it anew on that word (persister.Promoter.lease_returned), else vouches nothing."""
        if self._lease is None:
            return
        lease, self._lease = self._lease, None
        try:
            lease.check()
            self._lease_returned = lease.token
        except StorageError:
            # unreadable just now: the record there may still be ours (a release that cannot
            # read it leaves it behind); the token vouches for that record only, never another's
            self._lease_returned = lease.token
        except Exception:  # lost to another owner: vouch for nothing
            self._lease_returned = None
        lease.release()

    def _close_tier(self) -> None:
        """Stop using the memory tier: its pending snapshot first, then the persister."""
        try:
            if self._memory is not None:
                self._memory.close()
        finally:
            self._close_persister()

    def _close_persister(self) -> None:
        if self._persister is not None:
            persister, self._persister = self._persister, None
            returned, self._lease_returned = self._lease_returned, None
            persister.close(timeout_s=self.commit_timeout_s, lease_returned=returned)

    def release_memory(self) -> None:
        """Give this job's host memory back (after its final durable commit): every snapshot of
        this job on this node is removed.  Call it on one rank per node, once every rank of the
        node is done with the tier."""
        self.close_memory()
        if self.memory is not None:
            self.memory.release()

    def check_memory_room(self, state: Mapping[str, Any]) -> int:
        """Raise MemoryTierError, before training, when this node's memory root cannot hold the
        tier: two snapshots, one peer replica and one snapshot being persisted, of every local rank's
        share of ``state``
        (ranks on a node are assumed to hold about the same bytes).  Returns the bytes needed."""
        if self.memory is None:
            return 0
        flat = flatten_state(state, self._layout_for(state), self.rank)
        mine = sum(leaf.local.numel() * leaf.local.element_size() for leaf in flat.tensors.values())
        if self._distributed and self.world_size > 1:  # every rank decides on the same number
            most = torch.tensor([mine], dtype=torch.int64, device=collective_device())
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            mine = int(most.item())
        local_ranks = len(self.nodes.ranks_of(self.nodes.node_of[self.rank]))
        # two snapshots and the file the next one is written into, the snapshot pinned for the
        # persister (the outbox); across nodes, the peer's replica and the file the next one is
        # received into
        copies = 6 if self.nodes.nodes > 1 else 4
        need = copies * mine * max(1, local_ranks)
        error: MemoryTierError | None = None
        try:
            self.memory.check_room(need)
        except MemoryTierError as e:
            error = e
        if self._distributed and self.world_size > 1:  # ... and on the outcome: all or none
            failed = torch.tensor(
                [0 if error is None else 1], dtype=torch.int64, device=collective_device()
            )
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if error is None and int(failed.item()):
                error = MemoryTierError(
                    f"another rank's node cannot hold the memory tier ({_fmt(need)} "
                    f"needed); see its error"
                )
        if error is not None:
            slots = self._memory._slots if self._memory is not None else None
            # (nothing of this job's is in it yet)
            self.memory.release_if_empty(slots.hold if slots is not None else None)
            raise error
        return need

    def wait(self) -> SaveStats | None:
        """Block until the pending save is committed; re-raise its failure."""
        self._check_open()
        return self._join_pending()

    def close(self) -> None:
        """Wait for the pending save, release the writer lease and the buffers; re-raises a
        background failure."""
        if self._closed:
            return
        try:
            try:
                self._join_pending()
            finally:
                if self._persister is not None:
                    self._hand_lease_back()
                self._close_tier()
        finally:
            self._closed = True
            self._worker.stop()
            self._stager = Stager()
            if self._slots is not None:
                self._slots.close()
            if self._replicas is not None:
                self._replicas.close()
            if self._lease is not None:
                self._lease.release()
                self._lease = None

    def __del__(self) -> None:
        # (not a fork's copy, which shares its parent's persister and lease; nor at the
        # interpreter's exit, where the persister flushes once its pipe closes and the kernel
        # lets go of the rank's lock, as when the process is killed)
        if getattr(self, "_owner_pid", None) != os.getpid() or self._closed:
            return
        if sys.is_finalizing():
            return
        _DROPPED.put(self)  # (kept until the reaper thread has let go of it: _reap_dropped)

    def _let_go(self) -> None:
        """What ``close`` releases, for a checkpointer dropped unclosed and collected (``del``
        in a notebook, a function that returned without closing it), without waiting for
        anything: none of its own saves is in flight (a save's background job keeps its
        checkpointer referenced until it is over).  Its writer lease is released, its rank's lock and files in the
        memory tier let go, and its persister told goodbye (it flushes the newest snapshot that
        durable storage lacks, then exits), so that a new checkpointer of the URL in this
        process starts as after ``close``, instead of meeting a lock, a lease and a persister
        (which holds the job's lock and the URL's lease) that nothing would ever let go of."""
        self._closed = True
        goodbyes, self._goodbyes = self._goodbyes, []
        try:
            self._worker.stop()
            if self._persister is not None:
                self._hand_lease_back()
                goodbyes.append((self._persister, self._lease_returned))
                self._persister, self._lease_returned = None, None
            if self._lease is not None:
                lease, self._lease = self._lease, None
                lease.release()
            if self._slots is not None:
                self._slots.close()
            if self._replicas is not None:
                self._replicas.close()
        finally:
            tier = self._memory if self._memory is not None and not self._memory._closed else None
            if tier is not None and tier._thread is not None and tier._thread.is_alive():
                # its last snapshot is still being committed: the persister's flush must not
                # race that commit, so the tier lets go and says goodbye once it is over (on a
                # thread of its own; else once it is collected)
                tier._goodbyes.extend(goodbyes)
                with contextlib.suppress(Exception):
                    tier._worker.submit("resilient-ckpt-let-go", tier._let_go_after_pending)
            else:
                try:
                    if tier is not None:
                        tier._let_go()
                finally:
                    for persister, returned in goodbyes:
                        persister.goodbye(lease_returned=returned)

    def _let_go_after_pending(self) -> None:
        """(the memory tier's own, a worker's job) ``_let_go`` once the pending snapshot is over."""
        if self._thread is not None:
            self._thread.join()
        if not self._closed:
            self._let_go()

    def _join_pending(self) -> SaveStats | None:
        handle = self._pending
        if handle is None:
            return None
        if self._thread is not None:
            self._thread.join()
        self._pending, self._thread, self._pending_is_old = None, None, False
        if self._replicas is not None:  # (the job joined may have seen a connection fail)
            self._sealed_replicas = self._replicas.sealed_ready()
        # what the last joined save came to: the same on every rank (a commit's outcome is)
        self._last_outcome = None if handle._error is None else _describe(handle._error)
        if handle._error is not None and handle._error_reported:
            return handle.stats  # the caller already saw this failure through the handle
        return handle.wait()

    def _persist(
        self,
        handle: SaveHandle,
        step: int,
        layout: Layout,
        plan: WritePlan,
        data: torch.Tensor | _Slot | Exception,
        values: dict[str, Any],
        committer: Committer,
    ) -> None:
        error: BaseException | None = None
        step_rel = step_dir_name(step)
        garbage: list[str] = []
        coordinator = committer.is_coordinator
        file, generation = "", -1
        try:
            try:
                t0 = time.monotonic()
                # 1. the coordinator takes the lease and says where to write; others wait for it
                if coordinator:
                    try:
                        begin = self._begin(step_rel)
                    except BaseException as e:
                        committer.publish_begin({"error": _describe(e), "type": type(e).__name__})
                        raise
                    committer.publish_begin(begin)
                else:
                    begin = committer.wait_begin(extra_s=self.lease_timeout_s)
                generation = int(begin["generation"])
                file = rank_file_name(self.rank, generation)
                if self._replicas is not None and not coordinator:
                    self.storage.makedirs(step_rel)  # this node's memory: its own directory
                if isinstance(data, Exception):
                    raise data  # staging failed on this rank (save())
                if isinstance(data, _Slot):
                    assert self._slots is not None
                    res = self._slots.persist(data, step_rel, file, plan, self.block_bytes)
                else:
                    res = persist_rank_file(
                        self.storage,
                        step_rel,
                        file,
                        plan,
                        data,
                        block_bytes=self.block_bytes,
                        compression=self.compression,
                        step=step,
                    )
                handle.stats.write_s = time.monotonic() - t0
                handle.stats.bytes_written = res.size_bytes
                report = {
                    "rank": self.rank,
                    "file": res.file,
                    "size_bytes": res.size_bytes,
                    "digest": plan.digest,
                    "num_tensors": len(plan.tensors),
                    "values": values,
                }
                if coordinator:  # its own report is not sent: its entries as they are
                    report["chunks"] = dict(res.chunks)
                    if res.static is not None:  # (what _manifest_shape compares)
                        report["static"] = res.static
                elif res.static is not None:  # the text the coordinator parsed last time, if
                    # the layout is the same, and the checksums (writer.report_chunks)
                    report["static"] = res.static
                    report["sums"] = [list(c.checksums) for c in res.chunks.values()]
                else:
                    report["chunks"] = {k: c.to_json() for k, c in res.chunks.items()}
            except BaseException as e:
                report = {"rank": self.rank, "error": _describe(e)}
                raise
            finally:
                if not coordinator:
                    committer.report(report)
            t1 = time.monotonic()
            if coordinator:
                garbage = self._coordinate(
                    committer, report, step, step_rel, layout, plan, generation, handle
                )
            else:
                _await_outcome(committer, step)
                if self._replicas is not None and self.nodes.is_leader(self.rank):
                    try:
                        garbage = self._publish_on_this_node(committer, step)
                    except Exception as e:  # committed all the same; restores bring what lacks
                        log.warning(
                            "publishing snapshot %d in this node's memory failed: %s", step, e
                        )
            handle.stats.commit_s = time.monotonic() - t1
            handle.stats.committed = True
        except BaseException as e:  # stored, re-raised at the next save/wait/close
            error = (
                e
                if isinstance(e, ResilientError)
                else CommitError(
                    f"save of step {step} to {self.url} failed on rank {self.rank}: {_describe(e)}"
                )
            )
            if error is not e:
                error.__cause__ = e
            if coordinator:
                self._failed_commit(committer, e)
            log.error("checkpoint save of step %d failed on rank %d: %s", step, self.rank, error)
        if self._replicas is not None:  # every rank, whatever happened: the peers agree first
            try:
                ok = error is None and handle.stats.committed
                self._replicas.replicate(
                    self.storage,
                    step_rel,
                    file if ok else None,
                    generation,
                    epoch=handle._replica_epoch,
                )
            except Exception as e:  # the snapshot is committed; its replica is a bonus
                log.warning("replicating snapshot %d to the peer node failed: %s", step, e)
        # A committed file is reused, and settling it lets the next snapshot take the file of
        # the one before it (Slots.stage): across nodes only once its replica is in, or a node
        # lost meanwhile would leave no step whole (the older step's own files taken, this
        # step's replicas not yet on the peer)
        if isinstance(data, _Slot) and self._slots is not None:
            self._slots.settled(data, error is None and handle.stats.committed)
        if coordinator:  # (after the outcome, before the handle says this save is over)
            self._forget_doomed(committer)
        with self._hook_lock:  # save() of the outer checkpointer checks done() under it
            hook = self._after_commit.pop(step, None)
            if hook is not None and error is None:
                hook()
            handle._finish(error)
        # Deleting retired bytes is not part of making this step durable, but it stays on this
        # thread, so the next save (which joins it) never overlaps it.
        try:
            lease = self._lease
            delete_dirs(self.storage, garbage, check=lease.check if lease is not None else None)
        except Exception as e:
            log.warning("deleting retired checkpoint files failed: %s", e)

    def _begin(self, step_rel: str) -> dict[str, Any]:
        """(coordinator) Hold the writer lease, create the step directory, pick the generation."""
        if self.storage.commit_method is None:
            raise self.storage.refusal_to_commit()
        if self._lease is None:
            self._lease = WriterLease(self.storage, self.job_id, timeout_s=self.lease_timeout_s)
        self._lease.acquire()
        self.storage.makedirs(step_rel)
        self._sweep.began.add(step_rel)
        return {"generation": next_generation(self.storage, step_rel)}

    def _coordinate(
        self,
        committer: Committer,
        own: dict[str, Any],
        step: int,
        step_rel: str,
        layout: Layout,
        plan: WritePlan,
        generation: int,
        handle: SaveHandle,
    ) -> list[str]:
        reports = committer.gather(own) if committer.store is not None else [own]
        self._forget_previous_outcome(committer, reports)
        catalog = scan(self.storage)
        # (across nodes: above the newest commit in every node's memory, not only this one's)
        seq = max(catalog.next_commit_seq(), self._seq_floor + 1)
        if seq > MAX_INT:
            top = max(catalog.infos.values(), key=lambda i: i.commit_seq)
            raise CommitError(
                f"cannot commit step {step}: step {top.step} under {self.url} claims the largest "
                f"commit_seq there can be ({top.commit_seq}), so no later commit could be newer; "
                f"it was not written by this toolkit's counter — delete or move it"
            )
        manifest = build_manifest(
            step,
            layout,
            plan,
            reports,
            block_bytes=self.block_bytes,
            generation=generation,
            version=_version(),
            commit_seq=seq,
            job_id=self.job_id,
            validate=False,  # publish_commit checks the bytes it publishes, as readers will
            static_cache=self._static_reports,
        )
        if 0 < self._commit_run < MAX_RUN:  # (a durable commit of a run with the memory tier)
            run: dict[str, Any] = {RUN_KEY: self._commit_run}
            if self._run is None:  # (a number shared with an earlier run: said so)
                run[RUN_UNCOUNTED_KEY] = True
            manifest = dataclasses.replace(manifest, extras={**manifest.extras, **run})
        elif self._slots is None and self.memory is None:
            # (a durable commit without the tier) the runs with it that had begun: their
            # snapshots are older than this commit, whatever their anchor (snapshots.stale_snapshot)
            if self._runs_seen is None:
                self._runs_seen = runs_counted(self.storage)
            if self._runs_seen:
                extras = {**manifest.extras, RUNS_SEEN_KEY: self._runs_seen}
                manifest = dataclasses.replace(manifest, extras=extras)
        known = parent_known(catalog.next_commit_seq(), handle._parent_seen)
        if self._slots is None and handle._parent and known:
            # (a durable commit) what it descends from: the line follows it past the steps a
            # rollback abandoned (catalog.py); the memory tier's commits record none; nor does
            # one with a commit above the one its parent was known as of (_parent_seen)
            parent = parent_record(handle._parent, seq)
            manifest = dataclasses.replace(manifest, extras={**manifest.extras, PARENT_KEY: parent})
        # A memory snapshot's manifest differs from the previous one's in its numbers, checksums
        # and values only: once one of a shape passed the readers' full check, the next ones of
        # that shape get the check of those parts (format.check_variable_parts), and its text is
        # that shape's template filled in (format.ManifestEncoder).
        shape = (
            _manifest_shape(layout, plan, reports, block_bytes=self.block_bytes)
            if self._slots is not None
            else None
        )
        checked = shape is not None and shape == self._checked_shape
        data = self._encoder.encode(manifest, shape)
        if self._replicas is not None:  # every node's leader publishes it in its own memory
            # with its summary ahead of it, on a line of its own: a leader needs only that
            committer.store.set(
                f"{committer.prefix}/manifest", summary_line(manifest) + b"\n" + data
            )
            if self._shared_manifest is not None:  # every leader has read the previous one
                committer.store.delete_key(self._shared_manifest)
            self._shared_manifest = f"{committer.prefix}/manifest"
        garbage = publish_commit(
            self.storage,
            self._lease,
            manifest,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            collect=self._sweep,
            shape_checked=checked,
            data=data,
            catalog=catalog,
        )
        self._checked_shape = shape
        self._advance_anchor(handle, step, seq)  # snapshots from now on descend from it
        self._sweep.committed()
        committer.publish("ok")
        committer.cleanup()
        return garbage

    def _forget_previous_outcome(self, committer: Committer, reports: list[dict[str, Any]]) -> None:
        """(the coordinator, every rank's report of this commit in hand) Each rank read the
        previous commit's outcome before it began this one: its key goes, and this commit's
        outcome is the next one to go.  Not when a report is a failure: it may be one this
        rank's abort() filled in for a rank that is still reading the previous outcome."""
        if committer.store is None or any(r.get("error") for r in reports):
            return
        if committer is not self._live_committer:  # (a group rebind() left behind)
            return
        if self._last_outcome_key is not None:
            self._stale_keys.append(self._last_outcome_key)
        self._last_outcome_key = committer.done_key
        # deleted once this commit's outcome is out (_forget_doomed), a bounded number per
        # commit: a long run of failed commits does not put thousands of requests into one
        self._doomed += self._stale_keys[:STALE_KEYS_PER_COMMIT]
        del self._stale_keys[:STALE_KEYS_PER_COMMIT]

    def _forget_doomed(self, committer: Committer) -> None:
        doomed, self._doomed = self._doomed, []
        committer.forget(doomed)

    def _failed_commit(self, committer: Committer, e: BaseException) -> None:
        """(the coordinator) Publish the failure of this commit, and keep its keys for the next
        commit every rank reports to: a failed commit's ``begin`` and reports stay otherwise
        (a rank that failed, or read a failure, leaves its report alone; see ``wait_outcome``)."""
        _publish_failure(committer, e)
        # (not a commit of a group left behind: rebind() forgot that group's key names, which
        # may be the new group's)
        if committer.store is not None and committer is self._live_committer:
            self._stale_keys.extend(committer.keys())

    def _publish_on_this_node(self, committer: Committer, step: int) -> list[str]:
        """(a node's leader, memory tier across nodes) Publish the manifest rank 0 committed in
        this node's own directory, and run retention there; returns what to delete.  Rank 0
        checked these very bytes as readers will before it committed them (publish_commit), and
        sent their summary on the line before them, so only that line is parsed here, for
        retention and the catalog (parsing and checking the whole tensor table again took two
        full parses, 8 ms a snapshot of the tiny preset, on the node leader's background thread;
        parsing only its top level still took 0.4 ms); a reader checks it all when it reads the
        step."""
        line, _, data = committer.store.get(f"{committer.prefix}/manifest").partition(b"\n")
        step_rel = step_dir_name(step)
        summary = summary_from_line(line, self.storage.display(f"{step_rel}/{MANIFEST_NAME}"), step)
        garbage = publish_commit(
            self.storage,
            NodeLocal(),
            summary,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            collect=self._sweep,
            sweep_step=False,  # the node's other ranks may be receiving replicas into it
            data=data,
            verified=True,
        )
        self._sweep.committed()
        return garbage

    def _get_store(self) -> Any:
        if self._store is None:
            store = dist.distributed_c10d._get_default_store()
            # the memory tier's handshakes run beside the durable ones: a connection of its own
            self._store = store.clone() if self._namespace != "ckpt" else store
        return self._store

    def _ensure_uid(self) -> int:
        if self._uid is None:
            # Every rank increments one counter once per Checkpointer; ranks agree on the result
            # without a collective, and a store that outlives a restart never reuses a prefix.
            n = self._get_store().add(f"resilient/{self._namespace}/instances", 1)
            self._uid = (n - 1) // self.world_size
        return self._uid

    def _committer(self, step: int | None = None) -> Committer:
        if self.world_size == 1:
            return Committer(None, "", 0, 1, self.commit_timeout_s, step=step)
        uid = self._ensure_uid()
        self._seq += 1
        self._live_committer = Committer(
            self._get_store(),
            f"resilient/{self._namespace}/{uid}/{self._seq}",
            self.rank,
            self.world_size,
            self.commit_timeout_s,
            step=step,
            abort=self._abort,
        )
        return self._live_committer

    @property
    def can_rebind(self) -> bool:
        """Whether ``rebind`` can carry this checkpointer into the next generation of the group
        (peer replicas form their groups again there)."""
        return not self._closed and (self._memory is None or not self._memory._closed)

    def rebind(self) -> None:
        """(in-job recovery, after ``abort``) The process group formed again, a spare in the
        failed rank's place: forget the old group's store and handshake counters, so that this
        checkpointer meets the spare's new one on the new group's keys, and keep the rest (the
        memory tier and its persister process, the writer lease).  A save the abort abandoned is
        not raised again by the next one."""
        if not self.can_rebind:
            raise ResilientError(f"Checkpointer({self.url!r}) cannot be carried to a new group")
        if not self._store_given:
            self._store = None
        self._uid, self._seq, self._loads = None, 0, 0
        # the new group's store starts its counters again: a key named from the old group's
        # commits may be one of the new group's (deleting it would take a live key away)
        self._shared_manifest, self._last_outcome_key, self._stale_keys = None, None, []
        self._doomed = []
        self._snap = None  # a snapshot of the old generation is never a durable save's source
        self._abort, self._live_committer = threading.Event(), None
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._pending is not None:
            self._pending._error_reported = True
        if self._thread is not None and self._slots is not None:
            # (the memory tier's) the abandoned snapshot ends at once; it must have released
            # its slot before the next one is staged, and its failure must not count as the
            # last snapshot's outcome: that decides, alike on every rank, how durable saves go
            # (the spare's new checkpointer has no such failure)
            self._thread.join(timeout=self.commit_timeout_s)
            if not self._thread.is_alive():
                self._pending, self._thread = None, None
        self._last_outcome = None
        # A durable save of the old group still in flight (rank 0: the persister writing a step
        # every rank had snapshotted, which it may still commit; the others: already abandoned)
        # is joined by the next save, not by the restore: it reads nothing the restore reads.
        self._pending_is_old = self._pending is not None
        if self._memory is not None:
            # first (no collective): it joins the abandoned snapshot, which must not hold up
            # the new group's collectives below while the spare waits in them
            self._memory.rebind()
        if self._memory_asked and self._distributed and self.world_size > 1:
            # the collective a new checkpointer runs in its constructor (the spare's does): every
            # rank of the new group must run the same ones, in the same order
            nodes = node_map(
                self.world_size, self.rank, self._memory_root or default_root(), _boot_id()
            )
            if nodes != self.nodes:
                raise ResilientError(
                    f"Checkpointer({self.url!r}): the ranks' nodes changed in the new group "
                    f"({self.nodes} -> {nodes}); a new checkpointer is needed"
                )
        if self._memory is not None and self._memory._replicas is not None:
            # the collectives a new checkpointer's constructor runs next (the spare's)
            self._memory._replicas.regroup()
            self._agree_memory_floor()
            self._memory._sealed_replicas = self._memory._replicas.sealed_ready()

    def _thread_name(self, step: int) -> str:
        """A save's background thread: a memory snapshot's ("resilient-ckpt-snapshot", which
        replicates to the peer node over the replicas' groups: in-job recovery waits for it to
        let go of them) or a durable save's."""
        return f"resilient-ckpt-{'snapshot' if self._namespace == 'mem' else 'save'}-{step}"

    def abort(self) -> None:
        """The process group broke (a peer died; in-job recovery): a save or snapshot whose commit
        handshake is waiting for a peer gives up at once (it fails; what is committed stays), so
        that closing this checkpointer does not wait ``commit_timeout_s`` for a dead rank."""
        self._abort.set()
        committer = self._live_committer
        if committer is not None and (self._thread is not None and self._thread.is_alive()):
            committer.abandon(f"rank {self.rank} left the broken process group")
        if self._memory is not None:
            self._memory.abort()
        if self._replicas is not None:
            self._replicas.drop_groups()  # the broken group is freed before the next forms

    def _plan(
        self, flat: FlatState, layout: Layout, *, described: bool = False
    ) -> tuple[WritePlan, bool, bool]:
        """The plan of ``flat``, whether a tensor of it is on the GPU, and whether it is known to
        fit: with ``described`` (``flat`` is the newest flatten through ``self._described``),
        when that flatten described the very tensors of the one the newest plan was made of,
        unchanged by the cache's checks (no signature to build, nothing to compare)."""
        cache, cached = self._described, self._plan_cache
        if (
            described
            and cached is not None
            and cache.unchanged
            and cached[3] == cache.generation - 1
            and cached[0][0] == layout
        ):
            self._plan_cache = (*cached[:3], cache.generation)
            return cached[1], cached[2], True
        # (in the walk's order: the same state walks alike, and another order only costs a new
        # plan, which comes out the same)
        sig = (
            layout,
            tuple(
                (k, v.local.dtype, v.shape, v.placement, v.local.shape)
                for k, v in flat.tensors.items()
            ),
        )
        plan = (
            cached[1]
            if cached is not None and cached[0] == sig
            else plan_writes(flat.tensors, layout, self.rank)
        )
        on_gpu = any(t.local.is_cuda for t in flat.tensors.values())
        # (a plan of a flatten made elsewhere is never taken for the cache's newest)
        self._plan_cache = (sig, plan, on_gpu, cache.generation if described else -2)
        return plan, on_gpu, False

    def _layout_for(self, state: Mapping[str, Any]) -> Layout:
        if self.layout is None:
            mesh = _find_mesh(state)
            if mesh is not None and mesh.size() == self.world_size:
                self.layout = from_device_mesh(mesh)
            else:
                self.layout = Layout(dp=self.world_size)
        return self.layout

    # --- load ---------------------------------------------------------------------------------
    def load(
        self,
        state: Mapping[str, Any],
        step: int | None = None,
        *,
        fallback: bool = False,
        optional: Iterable[str] = (),
    ) -> int:
        """Fill ``state`` in place from ``step`` (default: the newest commit); returns the step.

        Reshards when the saving layout differs.  All or nothing: the bytes are read and checked
        into scratch memory, and ``state`` changes only once every rank has read its part.  In a
        process group every rank loads the step rank 0 picks, and any failure on any rank is seen
        by every rank: with ``fallback=True`` and ``step=None``, a newest step that fails to read
        (corrupt bytes, a missing file, a storage error after retries) is skipped, with a warning,
        for the one before it on the current line, by every rank together; any other failure (the
        state does not match) is raised by every rank.

        ``optional``: names of values (``"config.corpus"``, as ``StateMismatchError`` names them)
        that a step may lack, saved by an older version of the training script: such a value
        keeps its current one.  Any other value or tensor a step lacks is a mismatch.
        """
        self._check_open()
        _check_step(step, "load", optional=True)  # (on every rank, before any collective)
        optional = _optional_names(optional)
        if not self._pending_is_old:
            self._join_pending()
        if self._memory is not None and self._memory._thread is not None:
            # the snapshot in flight (and its replica) first: the exchange below uses the same
            # group; its failure, if any, is reported by its own handle
            self._memory._thread.join()
        t0 = time.monotonic()
        self._loads += 1
        sealed: int | None = None
        across = self._memory is not None and self._memory._replicas is not None
        if self._memory is not None and (self.nodes.nodes == 1 or across):
            if self._memory._commit_every != 1 or across:
                # this process's sealed snapshots are let go first, so that rank 0 may commit
                # the newest one (in-job recovery keeps this process, and its snapshots, alive);
                # every rank's, before rank 0 (across nodes: every node's leader) looks
                assert self._memory._slots is not None
                self._memory._slots.release()
                if self._snap is not None and self._snap._sealed_meta is not None:
                    self._snap = None  # (let go: a durable save of its step takes a new one)
                if self._distributed and self.world_size > 1:
                    _barrier()
            if across:
                # the newest step every rank sealed, from what every node holds (its own ranks'
                # and its peer pairs): committed in every node's memory first (seal_nodes.py)
                assert self.memory is not None and self._memory._replicas is not None
                sealed = seal_across_nodes(
                    self.memory.dir,
                    rank=self.rank,
                    leader=self.nodes.is_leader(self.rank),
                    group=self._memory._replicas._groups()[0],
                    floor=self._memory._seq_floor,
                    max_run=self._run,
                )
            elif self.rank == 0:
                # a snapshot whose copy every rank finished but whose commit a fault cut short
                # (or never began: a sealed one) is committed first (seal.py): the fault then
                # loses at most one step
                assert self.memory is not None
                if has_peer_pairs(self.memory.dir):  # (sealed on several nodes, one now)
                    sealed = seal_across_nodes(
                        self.memory.dir,
                        rank=0,
                        leader=True,
                        group=None,
                        floor=self._memory._seq_floor,
                        max_run=self._run,
                    )
                else:
                    sealed = seal_staged(self.memory.dir, max_run=self._run)
        if self._memory is not None and self.rank == 0:
            self._begin_line()  # (whatever this load restores, what memory holds now is older)
        elif across:
            if self.nodes.is_leader(self.rank):  # (every node's leader marks its node's too)
                self._line_base = self._node_line_base()
        candidates = self._candidates(step, fallback)
        layout = self._layout_for(state)
        skipped: list[int] = []
        for i, (tier, s, seq, generation) in enumerate(candidates):
            pending: _PendingLoad | None = None
            error: BaseException | None = None
            source = self._memory if tier == _MEMORY and self._memory is not None else self
            try:
                if s < 0:
                    raise self._not_found_error(step, None)
                pending = source._read_step(state, s, layout, (seq, generation), optional)
            except Exception as e:  # every rank must reach the agreement below, whatever failed
                error = e
            # anything wrong with a snapshot (even a state it does not match: a stale one) falls
            # back to durable storage, which then says what is wrong, if anything
            code = 0 if error is None else (1 if _retryable(error) or tier == _MEMORY else 2)
            try:
                worst, who = self._agree(code, error, s)
            except BaseException:  # the group failed or the user interrupted: let the files go
                if pending is not None:
                    pending.discard()
                raise
            if worst == 0:
                stats = pending.apply()
                stats.source = "memory" if source is not self else "durable"
                stats.sealed = source is not self and s == sealed
                stats.newest_memory = self._newest_offered
                self._anchor = (s, seq) if source is self else self._anchors.get(s, self._anchor)
                # (a snapshot: exact where it says so; what its anchor descends from is not
                # carried, so its job's first durable commit records the parent alone)
                self._anchor_exact = source is self or (
                    s in self._exact_anchors and self._anchor is not None
                )
                self._anchor_seen = self._durable_seen
                self._anchor_chain = pending.chain if source is self else ()
                self._lineage += 1
                across = self._memory is not None and self._memory._replicas is not None
                if (
                    self._memory is not None
                    and self.memory is not None
                    and (self.rank == 0 or (across and self.nodes.is_leader(self.rank)))
                ):
                    # only snapshots taken from now on descend from this state: one of the line
                    # this load left is not taken for a newer line (snapshots.newer_line), but
                    # the snapshot it restored is this state (a fault before the next one
                    # resumes it again).  Across nodes, on every node (a node's mark left from
                    # a run where rank 0 was there would count the line this load left), above
                    # the newest commit in any node's memory
                    base = self._line_base
                    if across and base is not None:
                        base = max(base, self._memory._seq_floor)
                    mark_line_start(self.memory.dir, base, seq if tier == _MEMORY else None)
                # a snapshot taken before this restore holds the state before it: a durable save
                # of its step number must take a new one, not commit that one (a rollback to 100
                # and save(300) committed the abandoned state of 300)
                self._snap = None
                stats.skipped_steps = skipped
                stats.seconds = time.monotonic() - t0
                self.last_load = stats
                return s
            if pending is not None:
                pending.discard()
            if code != worst:  # another rank failed worse (or alone): raise what it saw
                error = _peer_error(who, s, worst, self._peer_message(who, s))
            if worst == 2 or i + 1 == len(candidates) or candidates[i + 1][1] < 0:
                raise error
            after = f"step {candidates[i + 1][1]}"
            if self._memory is not None:
                after += " (memory)" if candidates[i + 1][0] == _MEMORY else " (durable)"
            warnings.warn(f"{error}; falling back to {after}", stacklevel=2)
            log.warning("step %d failed to load (%s); falling back to %s", s, error, after)
            skipped.append(s)
        raise AssertionError("unreachable")

    def _candidates(self, step: int | None, fallback: bool) -> list[tuple[int, int, int, int]]:
        """The steps to try, newest first, as rank 0 sees them (every rank loads the same ones):
        (tier, step, commit_seq, generation).  The version (commit_seq, generation) is the one
        rank 0 saw: a rank that reads another version (the step was re-saved meanwhile) treats it
        as retired, so no two ranks ever load different data.  With the memory tier, its steps
        at least as new as the newest durable one come first (a step in both tiers is read from
        memory), and a snapshot that fails falls back through the tiers whatever ``fallback``
        says.  Step -1 stands for "nothing to load" (every rank then raises
        CheckpointNotFoundError)."""
        found: list[tuple[int, int, int, int]] = []
        memory: list[tuple[int, int, int, int]] = []
        across = self._memory is not None and self._memory._replicas is not None
        if self.rank == 0 or (across and self.nodes.is_leader(self.rank)):
            found = self._durable_candidates(step, fallback)
            if self._memory is not None:
                try:
                    memory = self._memory_candidates(step, found, strict=across and self.rank != 0)
                except Exception as e:
                    if not across:
                        raise
                    # A node's leader that cannot tell which of its snapshots are stale (durable
                    # storage or its memory cannot be listed here) offers none; it still takes
                    # part below, and rank 0 keeps the durable steps
                    log.warning(
                        "rank %d: this node's snapshots are not offered for the restore: %s: %s",
                        self.rank,
                        type(e).__name__,
                        e,
                    )
                    memory = []
        if across:  # every node's snapshots, not only rank 0's node's (every rank, a collective)
            newest_durable = found[0][1] if found and step is None else -1
            memory = [
                c
                for c in self._memory_of_every_node(memory)
                if step is not None or c[1] >= newest_durable or c[1] in self._newer_line
            ]
        if self.rank == 0 and step is None and found:
            found = self._after_newer_line(memory, found, fallback)
        found = memory + found
        self._newest_offered = max((c[1] for c in memory), default=None)
        if self.rank == 0:
            found = found[:_MAX_FALLBACKS] or [(_DURABLE, -1, 0, 0)]
        if not self._distributed or self.world_size == 1:
            return found
        buf = torch.full(
            (1 + 4 * _MAX_FALLBACKS,), -2, dtype=torch.int64, device=collective_device()
        )
        if self.rank == 0:
            buf[0] = len(found)
            buf[1 : 4 * len(found) + 1] = torch.tensor(
                [x for c in found for x in c], dtype=torch.int64
            )
        dist.broadcast(buf, src=0)
        n = int(buf[0].item())
        flat = [int(x) for x in buf[1 : 4 * n + 1].tolist()]
        return [tuple(flat[i : i + 4]) for i in range(0, len(flat), 4)]

    def _after_newer_line(
        self,
        memory: list[tuple[int, int, int, int]],
        durable: list[tuple[int, int, int, int]],
        fallback: bool,
    ) -> list[tuple[int, int, int, int]]:
        """(rank 0) The durable steps to fall back to after the memory candidates: where the
        newest of these is of a newer line than the newest durable step (a rollback, then
        snapshots: snapshots.newer_line), the line from that snapshot's anchor, never the
        branch the rollback left."""
        newest_durable = durable[0][1]
        newer = [c for c in memory if c[1] < newest_durable and c[1] in self._newer_line]
        anchor = self._anchors.get(newer[0][1]) if newer else None
        if anchor is None or memory[0] != newer[0]:  # (a newer-numbered snapshot comes first)
            return durable
        try:
            catalog = self.catalog()
        except (CheckpointNotFoundError, CheckpointCorruptError, StorageError):
            return durable
        line = catalog.line()
        steps = line[line.index(anchor[0]) :] if anchor[0] in line else [anchor[0]]
        out = []
        for s in steps[: (_MAX_FALLBACKS if fallback else 1)]:
            info = catalog.get(s)
            if info is not None and info.state == "committed":
                out.append((_DURABLE, s, info.commit_seq, info.generation))
        return out

    def _memory_of_every_node(
        self, mine: list[tuple[int, int, int, int]]
    ) -> list[tuple[int, int, int, int]]:
        """(memory tier across nodes; every rank, a collective) The memory candidates of every
        node, as its leader found them (``mine``; other ranks pass []), merged newest first: rank
        0's node may hold none of them (torchrun's rendezvous can give rank 0 to a node that
        replaced a lost one: its memory is empty, while the other nodes hold the snapshots and
        the replicas of the lost node's files)."""
        assert self._memory is not None
        n = _MAX_MEMORY_CANDIDATES
        row = torch.full((2 + 6 * n,), -1, dtype=torch.int64)
        row[1] = self._node_newest_seq() if self.nodes.is_leader(self.rank) else 0
        try:
            entries = []
            for _, s, seq, generation in mine[:n]:
                if seq >= IMPLAUSIBLE_SEQ:
                    continue  # (not offered: see _node_newest_seq)
                anchor = self._anchors.get(s)
                # (1: its anchor is exact; 2: of a newer line than the newest durable step's)
                exact = int(anchor is not None and s in self._exact_anchors)
                exact |= 2 if anchor is not None and s in self._newer_line else 0
                a = anchor if anchor is not None else (-1, -1)
                entries.append([s, seq, generation, *a, exact])
            if entries:  # (a value beyond int64 raises here, before the collective)
                row[2 : 2 + 6 * len(entries)] = torch.tensor(entries, dtype=torch.int64).flatten()
            row[0] = len(entries)
        except Exception as e:
            log.warning("rank %d: this node's snapshots cannot be offered: %s", self.rank, e)
            row[2:] = -1
            row[0] = 0
        every = [torch.empty_like(row, device=collective_device()) for _ in range(self.world_size)]
        dist.all_gather(every, row.to(collective_device()))
        # A step's newest version wins: a node that missed a rollback's commits (it was not in
        # the job meanwhile) holds an older one, whose manifest must not be restored nor put over
        # the newer one (both name the same files when their generations agree)
        best: dict[int, tuple[int, int, tuple[int, int] | None, int]] = {}
        floor = self._memory._seq_floor
        for t in every:
            vals = [int(x) for x in t.tolist()]
            floor = max(floor, vals[1])
            for i in range(min(max(vals[0], 0), n)):
                s, seq, generation, a_step, a_seq, exact = vals[2 + 6 * i : 8 + 6 * i]
                if s >= 0 and (s not in best or (seq, generation) > best[s][:2]):
                    anchor = (a_step, a_seq) if a_step >= 0 else None
                    best[s] = (seq, generation, anchor, exact if anchor is not None else 0)
        # (each node's newest commit, seen again: a node that could not be listed when this
        # checkpointer was made, or has joined since, sets the floor too)
        self._memory._seq_floor = floor
        # the line of the merged commits (as each node's own: newest first, each older commit
        # numbered below every step taken so far)
        by_order = sorted(best, key=lambda s: (best[s][0], s))
        out = []
        self._newer_line.clear()
        for s in line_of(by_order):
            seq, generation, anchor, exact = best[s]
            self._anchors[s] = anchor
            (self._exact_anchors.add if exact & 1 else self._exact_anchors.discard)(s)
            if exact & 2:
                self._newer_line.add(s)
            out.append((_MEMORY, s, seq, generation))
        return out

    def _begin_line(self) -> None:
        """(rank 0, memory tier: where the checkpointer is made, at every load) This process's
        line begins here: its staged records say so (``after``, seal.py), so that a seal does
        not take the commits of the line a rollback left, numbered above its steps, for its
        own."""
        assert self._memory is not None and self._memory._slots is not None
        self._line_base = self._node_line_base()
        if self._line_base is not None:
            self._memory._slots.line_base = self._line_base

    def _node_line_base(self) -> int | None:
        """The newest commit order in this node's memory (None: it cannot be listed)."""
        assert self._memory is not None
        try:
            return newest_plausible_seq(self._memory.catalog())
        except Exception as e:  # (the load says what is wrong with this node's memory)
            log.warning("the memory tier of %s cannot be listed: %s", self.url, e)
            return None

    def _node_newest_seq(self) -> int:
        """The newest commit order in this node's memory (0 where it cannot be listed, or where
        it is a number no run counts up to: a damaged manifest's, which then sets nothing)."""
        assert self._memory is not None
        try:
            newest = self._memory.catalog().next_commit_seq() - 1
        except Exception as e:  # (the load says what is wrong with this node's memory)
            log.warning("the memory tier of %s cannot be listed: %s", self.url, e)
            return 0
        if newest >= IMPLAUSIBLE_SEQ:  # not this toolkit's counter: a damaged manifest
            log.warning(
                "the memory tier at %s holds a commit numbered %d, which no run counts up to; "
                "it does not set the commit order of this job's snapshots",
                self._memory.url,
                newest,
            )
            return 0
        return newest

    def _number_this_run(self) -> int | None:
        """(rank 0, memory tier, where the checkpointer is made: after the nodes agreed the
        floor) This run's number (snapshots.number_this_run), above the runs that the count and
        any node's memory record (and the durable commits, where the count is lost or
        damaged); the floor of its commits."""
        assert self._memory is not None
        seen = max(self._memory._seq_floor, self._node_newest_seq()) >> RUN_SHIFT

        def recorded() -> int:  # (a listing: only where the count is lost or damaged)
            # the runs the durable commits record: each one's own, or (the tier off) the runs it
            # saw counted, which a run numbered no higher would be taken as older than
            try:
                committed = self.catalog().committed
            except ResilientError as e:  # (the load says what is wrong with durable storage)
                log.warning("the durable steps of %s cannot be listed: %s", self.url, e)
                return 0
            return max((max(i.run, i.runs_seen) for i in committed), default=0)

        run = number_this_run(self.storage, seen, recorded)
        if run is not None:
            self._memory._seq_floor = max(self._memory._seq_floor, run << RUN_SHIFT)
        return run

    def _agree_memory_floor(self) -> None:
        """(memory tier across nodes; every rank, a collective on the replicas' group, where a
        checkpointer is made and where in-job recovery carries one to a new group) The newest
        commit order in any node's memory: rank 0's commits in memory rank above it, on every
        node.  Rank 0's own node may hold none (it replaced a lost node), and a node whose
        memory holds commits ranked above rank 0's next ones would take those for older and
        retire them at once."""
        assert self._memory is not None and self._memory._replicas is not None
        newest = self._node_newest_seq() if self.nodes.is_leader(self.rank) else 0
        # (rank 0's: this run's number, see snapshots.number_this_run)
        t = torch.tensor([max(newest, self._memory._seq_floor)], dtype=torch.int64)
        group, _ = self._memory._replicas._groups()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        self._memory._seq_floor = int(t.item())

    def _durable_candidates(
        self, step: int | None, fallback: bool
    ) -> list[tuple[int, int, int, int]]:
        try:
            catalog = self.catalog()
            self._durable_seen = max(catalog.next_commit_seq() - 1, 0)
            if step is not None:
                steps = [self._resolve_step(step)]
            else:
                steps = catalog.line()[: (_MAX_FALLBACKS if fallback else 1)]
            found = []
            for s in steps:
                info = catalog.get(s)
                found.append((_DURABLE, s, info.commit_seq, info.generation))
            return found
        except (CheckpointNotFoundError, CheckpointCorruptError, StorageError):
            return []

    def _memory_candidates(
        self, step: int | None, durable: list[tuple[int, int, int, int]], *, strict: bool = False
    ) -> list[tuple[int, int, int, int]]:
        """This node's restorable snapshots.  ``strict`` (a node's leader other than rank 0,
        across nodes): none where durable storage cannot be listed here, since which of them
        are stale or older than the newest durable step cannot then be told."""
        assert self._memory is not None
        try:
            catalog = self._memory.catalog()
            newest_durable = durable[0][1] if durable else -1
            try:
                durable_catalog: Catalog | None = self.catalog()
                line = set(durable_catalog.line())
            except (CheckpointNotFoundError, CheckpointCorruptError, StorageError) as e:
                if strict and not isinstance(e, CheckpointNotFoundError):
                    log.warning(
                        "rank %d: durable storage cannot be listed here (%s); this node's "
                        "snapshots are not offered for the restore",
                        self.rank,
                        e,
                    )
                    return []
                durable_catalog, line = None, set()
            found = []
            after, restored = (
                line_mark(self.memory.dir) if self.memory is not None else (None, None)
            )
            self._newer_line.clear()
            for s in catalog.line():
                newer = None
                if step is None and s < newest_durable:
                    # below the newest durable step: only a snapshot of the line a rollback
                    # began, with nothing durable committed since (that step is on the branch
                    # the rollback left)
                    if after is None or durable_catalog is None:
                        continue
                    try:
                        snap = read_manifest(self._memory.storage, s)
                    except ResilientError as e:  # (older than what is restored: no matter)
                        log.info("memory snapshot of step %d is not read: %s", s, e)
                        continue
                    newer = newer_line(snap, durable_catalog, after, restored)
                    if newer is None:
                        continue
                elif step is not None and s != step:
                    continue
                else:
                    snap = read_manifest(self._memory.storage, s)
                why = None if newer is not None else stale_snapshot(snap, durable_catalog, line)
                anchor = snap.extras.get(ANCHOR_KEY)
                if why:
                    log.warning("memory snapshot of step %d is not restored: %s", s, why)
                    continue
                info = catalog.get(s)
                found.append((_MEMORY, s, info.commit_seq, info.generation))
                # what a job restored from it descends from: its anchor, or (taken before its
                # job knew of one) the newest durable commit, which the check above found its own
                newest = durable_catalog.newest() if durable_catalog is not None else None
                self._anchors[s] = _parse_anchor(anchor) or (
                    (newest.step, newest.commit_seq) if newest is not None else None
                )
                exact = newer is not None or exact_anchor(snap, durable_catalog, line) is not None
                if step is not None and durable_catalog is not None:
                    own = self._durable_commit_of(snap, durable_catalog)
                    if own is not None:  # (a rollback to it by name: it is that durable commit)
                        self._anchors[s], exact = own, True
                (self._exact_anchors.add if exact else self._exact_anchors.discard)(s)
                if newer is not None:
                    self._newer_line.add(s)
            return found
        except (CheckpointNotFoundError, CheckpointCorruptError, StorageError) as e:
            log.warning(
                "the memory tier of %s cannot be read (%s); using durable storage", self.url, e
            )
            return []

    def _durable_commit_of(self, snap: Manifest, durable: Catalog) -> tuple[int, int] | None:
        """(rank 0, a load of a step by name that both tiers hold) The durable commit of the
        snapshot's step where it holds the snapshot's state (the persister made it from it): a
        job restored from the snapshot descends from that commit exactly, not from the snapshot's
        anchor (the commit before it), nor (anchor "") from the newest durable commit, which
        after a rollback to it is on the branch it leaves.  None where it cannot be told."""
        info = durable.get(snap.step)
        if info is None or info.state != "committed":
            return None
        try:
            held = read_manifest(self.storage, snap.step)
        except (CheckpointNotFoundError, CheckpointCorruptError, StorageError) as e:
            log.info("durable step %d cannot be compared with its snapshot: %s", snap.step, e)
            return None
        if held.commit_seq != info.commit_seq or state_of(held) != state_of(snap):
            return None
        return (snap.step, info.commit_seq)

    def _not_found_error(self, step: int | None, _unused: Any) -> CheckpointNotFoundError:
        if step is not None and step in self.memory_steps():
            return CheckpointNotFoundError(
                f"step {step} of {self.url} is in this node's memory tier only, and rank 0 could "
                f"not read it there; it is not a durable commit either"
            )
        if step is None:
            return CheckpointNotFoundError(
                f"no committed checkpoint under {self.url}; save one first, or check the URL"
            )
        return self._missing(step, self.catalog())

    def _agree(self, code: int, error: BaseException | None, step: int) -> tuple[int, int]:
        """Every rank's outcome of reading ``step``: (the worst code, the first rank with it).
        0 ok, 1 could not read this step (an older one may do), 2 anything else."""
        if not self._distributed or self.world_size == 1:
            return code, self.rank
        if code and error is not None:
            self._publish_error(step, error)
        codes = torch.zeros(self.world_size, dtype=torch.int32, device=collective_device())
        codes[self.rank] = code
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        worst = int(codes.max().item())
        who = int(torch.nonzero(codes == worst)[0].item())
        return worst, who

    def _load_key(self, rank: int, step: int) -> str:
        return f"resilient/{self._namespace}/{self._ensure_uid()}/load{self._loads}/{step}/{rank}"

    def _publish_error(self, step: int, error: BaseException) -> None:
        try:
            payload = {"type": type(error).__name__, "message": str(error)[:4000]}
            self._get_store().set(self._load_key(self.rank, step), json.dumps(payload))
        except Exception as e:  # the message is a courtesy; the codes decide
            log.warning("could not share this rank's load error through the store: %s", e)

    def _peer_message(self, rank: int, step: int) -> dict[str, str]:
        try:
            store = self._get_store()
            store.wait([self._load_key(rank, step)], timedelta(seconds=30))
            return json.loads(store.get(self._load_key(rank, step)))
        except Exception:
            return {"type": "ResilientError", "message": "(its message did not come through)"}

    def _read_step(
        self,
        state: Mapping[str, Any],
        step: int,
        layout: Layout,
        version: tuple[int, int] | None = None,
        optional: frozenset[str] = frozenset(),
    ) -> _PendingLoad:
        """Read and check every byte this rank needs of ``step`` into scratch memory; the step's
        manifest must be ``version`` (commit_seq, generation) when given; the values named in
        ``optional`` that it lacks keep their current ones."""
        peer_files = (
            self._gather_files(state, step, layout, version) if self._replicas is not None else 0
        )
        with watching_retirement(self.storage, step):
            manifest = read_manifest(self.storage, step)
            if version is not None and (manifest.commit_seq, manifest.generation) != version:
                raise StepRetiredError(
                    f"step {step} of {self.url} was re-saved while it was being loaded (rank 0 "
                    f"picked commit {version[0]}, generation {version[1]}; this rank found commit "
                    f"{manifest.commit_seq}, generation {manifest.generation}); load again"
                )
            flat = FlatState()
            scratch: dict[str, torch.Tensor] = {}
            in_place: _InPlace | None = None
            try:
                flatten_state(state, layout, self.rank, for_load=True, flat=flat)
                items = plan_reads(manifest, flat.tensors, layout, self.rank)
                if self._in_place(manifest, items, flat):
                    # check every byte now, through a small reused ring, with the files held
                    # open; apply() reads them again (from the page cache) into the state
                    files, ring = PinnedFiles(self.storage), ReadRing()
                    in_place = _InPlace(self.storage, manifest, items, files, ring)
                    rs: ReadStats = in_place.read({}, check=True)
                else:
                    scratch = scratch_for({k: leaf.local for k, leaf in flat.tensors.items()})
                    rs = execute_reads(self.storage, manifest, items, scratch)
                lacks = {
                    k
                    for k in flat.values
                    if k not in manifest.extras and k not in manifest.rank_extras.get(self.rank, {})
                }
                missing = [k for k in flat.values if k in lacks and k not in optional]
                if missing:
                    raise StateMismatchError(
                        f"step {step} has no values for {missing[:8]}; it was saved from a "
                        f"different state"
                    )
                mine = manifest.rank_extras.get(self.rank, {})
                values = {}
                for key, current in flat.values.items():
                    if key in lacks:  # (optional: keeps its current value)
                        continue
                    value = mine.get(key, manifest.extras.get(key))
                    if isinstance(current, tuple) and isinstance(value, list):
                        value = tuple(value)
                    if key not in flat.setters and value != current:
                        raise StateMismatchError(
                            f"state key {key!r} holds {current!r} inside an immutable container; "
                            f"step {step} has {value!r} — use a list or dict so it can be restored"
                        )
                    values[key] = value
            except BaseException:
                if in_place is not None:
                    in_place.files.close()
                for undo in flat.undo:
                    undo()
                raise
        stats = LoadStats(
            step, rs.bytes_read, rs.bytes_verified, rs.num_requests, manifest.layout != layout
        )
        stats.peer_files = peer_files
        pending = _PendingLoad(flat, scratch, values, stats, in_place)
        pending.chain = recorded_chain(manifest.extras, manifest.commit_seq)
        return pending

    def _gather_files(
        self,
        state: Mapping[str, Any],
        step: int,
        layout: Layout,
        version: tuple[int, int] | None = None,
    ) -> int:
        """(memory tier across nodes; every rank, a collective) Bring the files of ``step`` that
        this rank needs and its node lacks from the nodes that hold them (replicas.py); returns
        how many files moved between nodes (the same on every rank).  The manifest comes from
        rank 0's node, or, where that node lacks the step (or holds another ``version`` of it),
        from the first node whose leader holds it."""
        assert self._replicas is not None
        step_rel = step_dir_name(step)
        rel = f"{step_rel}/{MANIFEST_NAME}"
        local = None
        if self.nodes.is_leader(self.rank):
            try:
                local = self.storage.read_small(rel, MAX_MANIFEST_BYTES)
                # (checked in full: a copy that fails the full check must not hide a good one
                # on another node)
                held = manifest_of_step(local, self.storage.display(rel), step)
                if version is not None and (held.commit_seq, held.generation) != version:
                    local = None  # (another node's may be the one rank 0 picked)
            except Exception as e:  # (a node that lacks the step: another node's, then)
                log.info("memory step %d: rank %d cannot read its manifest: %s", step, self.rank, e)
                local = None
        try:
            data = self._replicas.share_manifest(local)
        except RuntimeError as e:  # the replica group failed (a peer is gone): not from memory
            raise CheckpointNotFoundError(
                f"memory step {step}: the exchange between nodes failed: {e}"
            ) from e
        manifest = manifest_of_step(data, self.storage.display(rel), step)
        need: set[str] | None = None
        error: BaseException | None = None
        flat = FlatState()
        try:
            flatten_state(state, layout, self.rank, for_load=True, flat=flat)
            need = {it.chunk.file for it in plan_reads(manifest, flat.tensors, layout, self.rank)}
        except Exception as e:  # said below, after taking part (nobody waits for this rank)
            error = e
        finally:
            for undo in flat.undo:
                undo()
        sizes = {name: entry.size_bytes for name, entry in manifest.files.items()}
        try:
            mine: bytes | None = self.storage.read_small(rel, MAX_MANIFEST_BYTES)
        except Exception:  # a node that had nothing of this step (a replacement node)
            mine = None
        try:
            # A node that holds another version of the step (it missed a rollback's commits)
            # holds files of the same names that are not this version's: they count as absent,
            # and the ones its ranks need come from a node that has them.  (A manifest that does
            # not parse says no version: its node's files count, and the read checks them.)
            moved, cleared = self._replicas.fetch(
                self.storage, step_rel, sizes, need, stale=_other_version(mine, manifest, rel)
            )
        except CheckpointNotFoundError:
            if error is not None:
                raise error from None  # this rank's own reason, not "a rank failed"
            raise
        except RuntimeError as e:  # the replica group failed (a peer is gone)
            raise CheckpointNotFoundError(
                f"memory step {step}: the exchange between nodes failed: {e}"
            ) from e
        if error is not None:
            raise error
        # this node now holds rank 0's version of the step (the read checks it); where another
        # version's files could not all be removed, it keeps saying "another version" instead
        if mine != data and cleared:
            self.storage.makedirs(step_rel)
            self.storage.publish(rel, data)
        return moved

    def _in_place(self, manifest: Manifest, items: list[ReadItem], flat: FlatState) -> bool:
        """Whether a load can check every byte first and then read it again straight into the
        state (local files held open, so the second read sees what the first checked): no
        scratch copy of the state, whose fresh memory costs more to fault in than a second read
        from the page cache costs to copy.  Not for compressed chunks (the second read would
        decompress what the first did not), destinations that are not contiguous, or more files
        than a rank should hold open at once."""
        if not self.storage.is_local:
            return False
        if len({it.chunk.file for it in items}) > _MAX_PINNED_FILES:
            return False
        if any(it.chunk.codec != "none" for it in items):
            return False
        return all(leaf.local.is_contiguous() for leaf in flat.tensors.values())

    def _resolve_step(self, step: int | None) -> int:
        catalog = self.catalog()
        if step is None:
            newest = catalog.newest()
            if newest is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.url}; save one first, or check the URL"
                )
            return newest.step
        info = catalog.get(step)
        if info is not None and info.state == "committed":
            return step
        raise self._missing(step, catalog)

    def _missing(self, step: int, catalog: Catalog) -> ResilientError:
        info = catalog.get(step)
        if info is not None and info.state == "damaged":
            return CheckpointCorruptError(
                f"step {step} under {self.url} is not a usable commit: {info.problem}"
            )
        steps = catalog.steps()
        shown = ", ".join(map(str, steps[-10:])) if steps else "none"
        return CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint under {self.url}; committed steps: {shown}"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ResilientError(f"Checkpointer({self.url!r}) is closed")


# The persister's switch for jobs whose code does not say (persister=None): "0" turns it off.
ENV_PERSISTER = "RESILIENT_PERSISTER"

# A load falls back at most this many steps along the line.
_MAX_FALLBACKS = 64
# keys of failed commits (and outcomes) deleted after a commit every rank reported to, at most
STALE_KEYS_PER_COMMIT = 64
# The tiers a load candidate comes from.
_DURABLE, _MEMORY = 0, 1
# per node, in the exchange of memory candidates across nodes (a node keeps two snapshots, and
# those sealed or left by a rollback: a few)
_MAX_MEMORY_CANDIDATES = 8


# A load reads in place (checks first, then reads again into the state) from at most this many
# files per rank; beyond it, into scratch memory.
_MAX_PINNED_FILES = 256

# A local load reads in pieces of this size, at least the readahead window that block devices are
# commonly given (8 MiB here): 4 MiB pieces left the disk idle between reads (a cold 512 MiB
# 4-rank load read at 1.0 GiB/s, 8 MiB pieces at 1.6, the disk's raw speed).
_LOCAL_PIECE_BYTES = 8 << 20


def _local_read_threads() -> int:
    """Reader threads for a local load: the cores this process may use, shared with the other
    ranks on the node (torchrun's ``LOCAL_WORLD_SIZE``; a rank pinned to fewer cores than the
    machine has keeps its own), between 1 and ``READ_THREADS``.  A local
    read is copying and checksumming, CPU work: four ranks with four threads each on two cores
    fought over them (a cold 4-rank load took 1.6x as long as with one thread each).  Object
    stores keep ``READ_THREADS`` (their reads wait on the network, not on a core)."""
    machine = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = machine
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if cores < machine:  # pinned (numactl, srun --cpu-bind): these cores are this rank's own
        local = 1
    return max(1, min(READ_THREADS, cores // local))


@dataclass
class _InPlace:
    """A step checked with its files held open, to be read again straight into the state."""

    storage: Storage
    manifest: Manifest
    items: list[ReadItem]
    files: PinnedFiles
    ring: ReadRing
    threads: int = field(default_factory=lambda: _local_read_threads())

    def read(self, dests: Mapping[str, torch.Tensor], *, check: bool) -> ReadStats:
        """Check every byte (``check``: into the ring, ``dests`` untouched), or read the checked
        bytes again into ``dests``, through the same open files, threads and piece size."""
        return execute_reads(
            self.storage,
            self.manifest,
            self.items,
            dests,
            files=self.files,
            ring=self.ring,
            place=not check,
            verify=check,
            threads=self.threads,
            piece_bytes=_LOCAL_PIECE_BYTES,
        )


class _PendingLoad:
    """A step read and checked (into scratch memory, or with its files held open to be read in
    place), not yet in the caller's state."""

    def __init__(
        self,
        flat: FlatState,
        scratch: dict[str, torch.Tensor],
        values: dict[str, Any],
        stats: LoadStats,
        in_place: _InPlace | None = None,
    ) -> None:
        self.flat, self.scratch, self.values, self.stats = flat, scratch, values, stats
        self.in_place = in_place
        # what the step's commit records it descends from (its parent first)
        self.chain: tuple[tuple[int, int], ...] = ()

    def apply(self) -> LoadStats:
        if self.in_place is not None:
            self._read_in_place(self.in_place)
        else:
            with torch.no_grad():
                for key, leaf in self.flat.tensors.items():
                    leaf.local.copy_(self.scratch[key])
        for key, value in self.values.items():
            setter = self.flat.setters.get(key)
            if setter is not None:
                setter(value)
        for fin in self.flat.finalizers:
            fin()
        self.scratch = {}
        return self.stats

    def _read_in_place(self, p: _InPlace) -> None:
        dests = {key: leaf.local for key, leaf in self.flat.tensors.items()}
        try:
            p.read(dests, check=False)
        except ResilientError as e:
            # the bytes were all read and checked a moment ago, from these open files: only a
            # failing disk, or someone writing into the files in place, gets here
            raise type(e)(
                f"{e} — the state was partly overwritten: this step's files could be read and "
                f"checked but not read again; load again, or an earlier step"
            ) from e
        except BaseException as e:  # interrupted (Ctrl-C) or a destination that refused a copy
            e.add_note(
                "resilient: the state was partly overwritten (interrupted while a checked step "
                "was read into it); load again"
            )
            raise
        finally:
            p.files.close()
            self.in_place = None
            # the reads wrote into the tensors' memory behind autograd's back: count it as the
            # in-place write it is, so a graph that saved one of them refuses to backward
            for t in dests.values():
                if not t.is_inference():  # inference tensors keep no version
                    torch.autograd.graph.increment_version(t)

    def discard(self) -> None:
        if self.in_place is not None:
            self.in_place.files.close()
            self.in_place = None
        for undo in self.flat.undo:
            undo()
        self.scratch = {}


def _manifest_shape(
    layout: Layout, plan: WritePlan, reports: list[dict[str, Any]], *, block_bytes: int
) -> tuple:
    """All of a commit's manifest but its numbers (step, commit_seq, time), checksum values and
    values: the layout, the tensor table (its digest), the files and every chunk's place."""
    return (
        layout,
        plan.digest,
        block_bytes,
        tuple(
            (
                r.get("rank"),
                r.get("file"),
                r.get("size_bytes"),
                r.get("digest"),
                # a report of the static text of its chunks (writer.chunks_static) and their
                # checksums, or the coordinator's own entries with their text: the text says all
                # but the checksums (build_manifest refused a report that has both before this)
                (
                    "static",
                    r["static"],
                    tuple(len(cs) for cs in r["sums"])
                    if "chunks" not in r
                    else tuple(len(c.checksums) for c in r["chunks"].values()),
                )
                if "static" in r
                and (
                    "chunks" not in r
                    or all(isinstance(c, ChunkEntry) for c in r["chunks"].values())
                )
                else tuple(
                    (
                        k,
                        *(
                            (c.offsets, c.sizes, c.file, c.name, c.byte_range, c.codec)
                            + (c.raw_bytes, len(c.checksums))
                            if isinstance(c, ChunkEntry)
                            else (
                                tuple(c.get("offsets") or ()),
                                tuple(c.get("sizes") or ()),
                                c.get("file"),
                                c.get("name"),
                                tuple(c.get("byte_range") or ()),
                                c.get("codec"),
                                c.get("raw_bytes"),
                                len(c.get("checksums") or ()),
                            )
                        ),
                    )
                    for k, c in (r.get("chunks") or {}).items()
                ),
            )
            for r in reports
        ),
    )


def _nodes(world_size: int) -> int:
    """How many nodes the job spans, as torchrun says (one without torchrun)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)) or world_size)
    return max(1, -(-world_size // max(1, local)))


def _retryable(error: BaseException) -> bool:
    """A failure to read this step that an older step may not share (corrupt or missing bytes, a
    storage error after retries); not a state that does not match."""
    return isinstance(error, (CheckpointCorruptError, StorageError, CheckpointNotFoundError))


def _peer_error(rank: int, step: int, code: int, msg: dict[str, str]) -> ResilientError:
    import resilient.errors as errors

    cls = getattr(errors, msg.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, ResilientError)):
        cls = CheckpointCorruptError if code == 1 else ResilientError
    return cls(f"step {step} failed to load on rank {rank}: {msg.get('message', '')}")


def _await_outcome(
    committer: Committer, step: int, extra_s: float = 0.0, *, count_read: bool = False
) -> None:
    """(not the coordinator) Wait for the coordinator's word on ``step``; its failure raised (a
    LeaseError stays a LeaseError).  ``count_read``: a commit without reports, whose last
    reader deletes its keys (``Committer.read_outcome``)."""
    outcome = committer.wait_outcome(extra_s=extra_s)
    if count_read:
        committer.read_outcome()
    if outcome != "ok":
        cls = LeaseError if outcome.startswith("LeaseError: ") else CommitError
        raise cls(f"step {step} was not committed: {outcome}")


def _parent_field(handle: SaveHandle) -> dict[str, Any]:
    """A persister request's ``parent``: the commit the save's state descends from, if known."""
    if not handle._parent:
        return {}
    return {"parent": [list(p) for p in handle._parent], "parent_seen": handle._parent_seen}


def _publish_failure(committer: Committer, e: BaseException) -> None:
    """(the coordinator) Tell every rank the save failed; best effort: the store may be gone."""
    if committer.store is not None:
        try:
            committer.publish(_describe(e))
        except Exception:
            pass


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _tell(message: str) -> None:
    """(the constructor) A warning to the code that made the checkpointer, and to the log."""
    warnings.warn(message, stacklevel=3)
    log.warning(message)


def check_memory_options(memory_every: Any, memory_commit_every: Any) -> None:
    """ValueError unless these are a memory tier's options (Checkpointer's, Run's)."""
    if memory_every is not None and (
        isinstance(memory_every, bool) or not isinstance(memory_every, int) or memory_every < 1
    ):
        raise ValueError(
            f"memory_every must be None (no memory tier) or an int >= 1, got {memory_every!r}"
        )
    if (
        isinstance(memory_commit_every, bool)
        or not isinstance(memory_commit_every, int)
        or memory_commit_every < 0
    ):
        raise ValueError(
            f"memory_commit_every must be an int >= 0 (1: commit every memory snapshot; 0: only "
            f"when a restore, a flush or a durable save needs it), got {memory_commit_every!r}"
        )


def _barrier() -> None:
    """A barrier of the default group; under NCCL on this rank's own device (without
    ``device_ids`` NCCL guesses the device from the rank, and a wrong guess can hang)."""
    device = collective_device()
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _other_version(mine: bytes | None, chosen: Manifest, where: str) -> bool:
    """Whether a node's manifest bytes of a step (None: it has none) are a version of the step
    other than ``chosen`` (another commit order or generation)."""
    if mine is None:
        return False
    try:
        held = manifest_summary(mine, where, chosen.step)
    except Exception:
        return False
    return (held.commit_seq, held.generation) != (chosen.commit_seq, chosen.generation)


def collective_device() -> torch.device:
    """Where a collective's tensor must live: the GPU under NCCL (RCCL), else the CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _find_mesh(state: Any) -> Any:
    if is_dtensor(state):
        return state.device_mesh
    if isinstance(state, torch.nn.Module):
        for p in state.parameters():
            if is_dtensor(p):
                return p.device_mesh
        return None
    if isinstance(state, Mapping):
        for v in state.values():
            m = _find_mesh(v)
            if m is not None:
                return m
    return None
