"""Saving: which rank writes what, staging into reused CPU buffers, background persist, commit.

The call sequence of one save (DESIGN.md section 4):

1. (every rank, caller's thread) ``plan_writes``: a pure function of the flat state that picks one
   writer per distinct chunk, balancing bytes across replicas; cached while the state's shapes do
   not change.
2. (every rank, caller's thread) ``Stager.stage``: copy the chunks this rank writes into one flat
   CPU buffer laid out exactly like the safetensors data section.  Allocated once, reused; pinned
   when a GPU is present.  ``save`` returns after this step.
3. (every rank, background thread) ``persist``: checksum blocks (in parallel threads) while writing
   header + buffer to ``rank_NNNNN.safetensors``; fsync.
4. (every rank, background thread) report the written chunks to the coordinator over the c10d
   store; (coordinator) wait for every report, check coverage, write MANIFEST.json atomically, run
   retention, publish the outcome; (other ranks) wait for the outcome.

Never a collective from a background thread: the training process group stays the loop's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from resilient.checkpoint.catalog import Catalog, committed_step, remember_commit, summary_of
from resilient.checkpoint.codec import block_checksums, compress, crc_pool, safetensors_header
from resilient.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ChunkEntry,
    FileEntry,
    Manifest,
    ManifestSummary,
    TensorEntry,
    check_variable_parts,
    dtype_info,
    dtype_name,
    manifest_of_step,
    manifest_summary,
    manifest_to_bytes,
    parse_step_dir,
    step_dir_name,
)
from resilient.checkpoint.retention import retire_steps
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointCorruptError, LeaseError, ResilientError, StorageError
from resilient.layout import Layout, Placement, Shard, placement_to_json, unique_chunks

if TYPE_CHECKING:  # torch is imported where tensors are: the persister process never needs it
    import torch

    from resilient.checkpoint.state import TensorLeaf

__all__ = [
    "WriteItem",
    "WritePlan",
    "plan_writes",
    "Stager",
    "persist_rank_file",
    "Committer",
    "CommitError",
    "next_generation",
    "rank_file_metadata",
    "publish_commit",
]

log = logging.getLogger(__name__)


def rank_file_metadata(step: int) -> dict[str, str]:
    """The ``__metadata__`` of a rank file's safetensors header (docs/FORMAT.md section 2)."""
    return {"format": "resilient-v2", "step": str(step)}


@dataclass(frozen=True)
class WriteItem:
    key: str
    dtype: str
    local_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    begin: int  # in the staged data buffer
    end: int


@dataclass(frozen=True)
class WritePlan:
    """What one rank writes, and the global tensor table every rank agrees on."""

    rank: int
    items: tuple[WriteItem, ...]
    data_bytes: int
    tensors: Mapping[str, tuple[str, tuple[int, ...], Placement]]  # key -> dtype, shape, placement
    digest: str  # of the tensor table: ranks with different states must not commit together
    bytes_per_rank: tuple[int, ...]


def tensor_table(
    leaves: Mapping[str, TensorLeaf],
) -> dict[str, tuple[str, tuple[int, ...], Placement]]:
    """key -> (dtype name, global shape, placement), sorted by key."""
    return {k: (dtype_name(v.local.dtype), v.shape, v.placement) for k, v in sorted(leaves.items())}


def assign_writers(
    table: Mapping[str, tuple[str, tuple[int, ...], Placement]], layout: Layout
) -> tuple[dict[int, tuple[WriteItem, ...]], tuple[int, ...]]:
    """Pick one writer for every distinct non-empty chunk, spreading bytes evenly over replicas.

    Pure and deterministic: every rank computes the same assignment from the same tensor table.
    Largest chunks are placed first, each on the replica with the fewest bytes so far (ties to the
    lower rank).  Returns each rank's items, laid out in its data section (larger elements first,
    which keeps every tensor aligned to its element size), and the bytes per rank.
    """
    load = [0] * layout.world_size
    jobs = []
    for key, (dt, shape, placement) in sorted(table.items()):
        itemsize = dtype_info(dt).itemsize
        parts = {p.dim: p.parts for _, p in placement if isinstance(p, Shard)}
        for offsets, sizes, replicas in unique_chunks(shape, placement, layout):
            nbytes = math.prod(sizes) * math.prod(parts.values()) * itemsize
            if nbytes:
                local = tuple(s * parts.get(d, 1) for d, s in enumerate(sizes))
                jobs.append((-nbytes, key, offsets, sizes, local, replicas, itemsize))
    jobs.sort(key=lambda j: (j[0], j[1], j[2]))
    chosen: dict[int, list] = {}
    for neg, key, offsets, sizes, local, replicas, itemsize in jobs:
        writer = min(replicas, key=lambda r: (load[r], r))
        load[writer] -= neg
        chosen.setdefault(writer, []).append((itemsize, key, offsets, sizes, local, -neg))
    out = {}
    for rank, mine in chosen.items():
        items, pos = [], 0
        for _itemsize, key, offsets, sizes, local, n in sorted(mine, key=lambda m: (-m[0], m[1])):
            items.append(WriteItem(key, table[key][0], local, offsets, sizes, pos, pos + n))
            pos += n
        out[rank] = tuple(items)
    return out, tuple(load)


def plan_writes(leaves: Mapping[str, TensorLeaf], layout: Layout, rank: int) -> WritePlan:
    """What ``rank`` writes of ``leaves`` (see :func:`assign_writers`)."""
    table = tensor_table(leaves)
    digest = hashlib.sha256(
        json.dumps(
            [[k, d, list(s), placement_to_json(p)] for k, (d, s, p) in table.items()]
        ).encode()
    ).hexdigest()
    per_rank, load = assign_writers(table, layout)
    items = per_rank.get(rank, ())
    return WritePlan(rank, items, items[-1].end if items else 0, table, digest, load)


class Stager:
    """One flat CPU buffer, reused across saves, holding the chunks this rank writes."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def stage(self, plan: WritePlan, leaves: Mapping[str, TensorLeaf]) -> torch.Tensor:
        import torch

        from resilient.checkpoint.buffers import huge_pages

        need = plan.data_bytes
        on_gpu = any(leaves[i.key].local.is_cuda for i in plan.items)
        if (
            self._buffer is None
            or self._buffer.numel() < need
            or (on_gpu and not self._buffer.is_pinned())
        ):
            self._buffer = None  # free the old one first: peak memory is one buffer
            self._buffer = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=on_gpu)
            if not on_gpu:  # the first snapshot faults it all in: 2 MiB pages make that cheap
                huge_pages(self._buffer)
        buf = self._buffer
        with torch.no_grad():
            for it in plan.items:
                src = leaves[it.key].local
                dst = buf[it.begin : it.end].view(src.dtype).view(src.shape)
                dst.copy_(src, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        return buf[:need]

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()


@dataclass(frozen=True)
class PersistResult:
    file: str
    size_bytes: int
    chunks: dict[str, ChunkEntry]
    write_s: float
    # ``chunks_static(chunks)``, where the writer keeps it from one save to the next (the memory
    # tier's rank files are laid out alike at every snapshot): the report then sends it and the
    # checksums apart (``report_chunks``)
    static: str | None = None


def chunks_static(chunks: Mapping[str, ChunkEntry]) -> str:
    """The JSON of ``chunks`` in their order, without their checksums: all that a rank's report
    says of its chunks but the checksums, the same from one save of a layout to the next."""
    return json.dumps(
        [[k, {**c.to_json(), "checksums": []}] for k, c in chunks.items()], allow_nan=False
    )


def report_chunks(
    report: Mapping[str, Any], static_cache: dict[str, list[tuple[str, ChunkEntry]]] | None = None
) -> list[tuple[str, ChunkEntry]]:
    """A rank's chunks from its commit report: ``chunks`` (entries, or their JSON), or ``static``
    (``chunks_static``) with ``sums``, each chunk's checksums in the same order (a report has one
    or the other; the coordinator's own, never sent, has its entries and their ``static`` text).
    ``static_cache`` keeps parsed static parts from one commit to the next: a rank sends the same
    text at every snapshot of a layout, and the coordinator then parses only the checksums.  What
    does not add up is a CommitError naming the rank."""
    rank = report.get("rank")
    if "chunks" in report:
        chunks = report["chunks"]
        if not isinstance(chunks, dict):
            raise CommitError(f"rank {rank} reported chunks that are not an object")
        own = all(isinstance(c, ChunkEntry) for c in chunks.values())
        if not own and ("static" in report or "sums" in report):
            raise CommitError(f"rank {rank} reported its chunks twice (chunks and static)")
        return [
            (key, c if own else ChunkEntry.from_json(c, f"rank {rank} chunk {key!r}"))
            for key, c in chunks.items()
        ]
    static, sums = report.get("static"), report.get("sums")
    if not isinstance(static, str) or not isinstance(sums, list):
        raise CommitError(f"rank {rank} reported no chunks (static text and checksums)")
    entries = static_cache.get(static) if static_cache is not None else None
    if entries is None:
        entries = []
        try:
            for key, c in json.loads(static):
                if type(key) is not str:
                    raise TypeError(f"a chunk under {key!r}, not a tensor name")
                entries.append((key, ChunkEntry.from_json(c, f"rank {rank} chunk {key!r}")))
        except (TypeError, ValueError, RecursionError) as e:
            raise CommitError(f"rank {rank} reported chunks that do not parse: {e}") from None
        if static_cache is not None:
            if len(static_cache) >= 16:  # (a layout per rank at a time; never more than a few)
                static_cache.clear()
            static_cache[static] = entries
    if len(sums) != len(entries):
        raise CommitError(
            f"rank {rank} reported checksums for {len(sums)} chunks and {len(entries)} chunks"
        )
    out = []
    for (key, e), cs in zip(entries, sums):
        if not isinstance(cs, list) or not all(type(x) is int and 0 <= x < 1 << 32 for x in cs):
            raise CommitError(
                f"rank {rank} reported checksums of chunk {key!r} that are not crc32 values"
            )
        out.append(
            (
                key,
                ChunkEntry(
                    offsets=e.offsets,
                    sizes=e.sizes,
                    file=e.file,
                    name=e.name,
                    byte_range=e.byte_range,
                    checksums=tuple(cs),
                    codec=e.codec,
                    raw_bytes=e.raw_bytes,
                ),
            )
        )
    return out


def persist_rank_file(
    storage: Storage,
    step_rel: str,
    file: str,
    plan: WritePlan,
    data: torch.Tensor,
    *,
    block_bytes: int,
    compression: str | None,
    step: int,
) -> PersistResult:
    """Write this rank's safetensors file (header + staged data), checksummed per block."""
    t0 = time.monotonic()
    view = memoryview(data.numpy()) if plan.data_bytes else memoryview(b"")
    codec = "none"
    if compression == "zstd":
        codec = "zstd+bytegroup"
        blobs = [
            compress(view[it.begin : it.end], dtype_info(it.dtype).itemsize, True)
            for it in plan.items
        ]
        spans, pos = [], 0
        for b in blobs:
            spans.append((pos, pos + len(b)))
            pos += len(b)
        header_entries = [(it.key, "U8", [e - b], b, e) for it, (b, e) in zip(plan.items, spans)]
        body: list[memoryview | bytes] = blobs
        payload = memoryview(b"".join(blobs))
    else:
        spans = [(it.begin, it.end) for it in plan.items]
        header_entries = [
            (it.key, dtype_info(it.dtype).safetensors, it.local_shape, it.begin, it.end)
            for it in plan.items
        ]
        body = [view]
        payload = view
    header = safetensors_header(header_entries, rank_file_metadata(step))
    # Checksums run in worker threads (crc32 drops the GIL) while the disk flushes the file.
    crc_futures: list = []

    def start_checksums() -> None:
        crc_futures.extend(
            crc_pool().submit(block_checksums, payload[b:e], block_bytes, parallel=False)
            for b, e in spans
        )

    size = storage.write_file(
        f"{step_rel}/{file}", [header, *body], on_written=start_checksums, exclusive=True
    )
    if not crc_futures:
        start_checksums()
    base = len(header)
    chunks = {}
    for it, (b, e), fut in zip(plan.items, spans, crc_futures):
        chunks[it.key] = ChunkEntry(
            offsets=it.offsets,
            sizes=it.sizes,
            file=file,
            name=it.key,
            byte_range=(base + b, base + e),
            checksums=tuple(fut.result()),
            codec=codec,
            raw_bytes=it.end - it.begin,
        )
    return PersistResult(file, size, chunks, time.monotonic() - t0)


def next_generation(storage: Storage, step_rel: str) -> int:
    """The generation of a new save of a step (run by the coordinator only, which publishes it to
    every rank): 0 for a step directory with no rank files, else one past every generation in it,
    the committed manifest's and every claimed one included; claimed for this save before it is
    returned.

    So a save never writes under the name of a file that exists, least of all one the committed
    manifest names: the committed step stays intact until the new manifest replaces it, and a
    leftover of an interrupted save is never truncated under a reader.  The claim (a
    ``claim.g<N>`` holding a random token, made only where nothing is at that name: a ``link()`` on a local disk, a
    conditional PUT on an object store) covers what a listing cannot see: a writer whose lease
    was taken over may still be uploading its rank files (an upload in flight is invisible on an
    object store), and its successor, saving the same step, must not pick that generation and
    have its committed files replaced when the upload lands.  The commit's clean-up of the step
    directory removes the claims with the other generations' files.  Retention removes a
    directory left uncommitted over two commits, its claims with it, so a writer frozen that long
    can still meet a successor's later save of that step under the same generation: rank files
    are therefore written only where nothing is (``write_file(exclusive=True)``), and the stale
    write fails instead of replacing a committed file (docs/FORMAT.md section 1).
    """
    gens = [  # finished, temporary, claimed
        g for g in (_generation_of(n, default=-1) for n in storage.listdir(step_rel)) if g >= 0
    ]
    if storage.exists(f"{step_rel}/{MANIFEST_NAME}"):
        try:
            old = manifest_summary(
                storage.read_small(f"{step_rel}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES),
                storage.display(step_rel),
                parse_step_dir(step_rel.rsplit("/", 1)[-1]) or 0,
            )
            gens.append(old.generation)
        except ResilientError:  # a damaged manifest: the files present decide
            pass
    generation = max(gens) + 1 if gens else 0
    mine = secrets.token_hex(8).encode()  # (a retried create that had linked it finds it there)
    for _ in range(_CLAIM_TRIES):
        claim = f"{step_rel}/{claim_name(generation)}"
        if storage.create_exclusive(claim, mine):
            return generation
        with contextlib.suppress(ResilientError):
            if storage.read_small(claim, 64) == mine:
                return generation
        generation += 1  # (another writer claimed it meanwhile)
    raise CommitError(
        f"cannot claim a generation for a save of {storage.display(step_rel)}: "
        f"{_CLAIM_TRIES} in a row were claimed by other writers meanwhile"
    )


def _generation_of(name: str, *, default: int) -> int:
    """The generation a rank file (finished or temporary) or a claim in a step directory belongs
    to; ``default`` for any other name."""
    m = _RANK_FILE_RE.match(name) or _CLAIM_RE.match(name)
    return int(m.group(1) or 0) if m else default


def claim_name(generation: int) -> str:
    return f"claim.g{generation}"


_CLAIM_RE = re.compile(r"^claim\.g(\d{1,18})$")
_CLAIM_TRIES = 64


_RANK_FILE_RE = re.compile(r"^rank_\d{5,}(?:\.g(\d{1,18}))?\.safetensors(?:\.tmp-[0-9a-f]+)?$")


class CommitError(ResilientError):
    """A save could not be committed (a rank failed, timed out, or the chunks did not tile)."""


class Committer:
    """The commit handshake over the c10d store (or directly, in a world of one).

    1. (coordinator, rank 0) takes the writer lease, picks the generation, creates the step
       directory, and publishes ``{prefix}/begin``; every other rank waits for it before it writes
       anything, so a job that does not hold the lease never touches the step directory.
    2. Rank r publishes ``{prefix}/report/{r}`` once its file is durable (or failed).
    3. The coordinator waits for all reports, writes the manifest and publishes ``{prefix}/done``;
       every other rank waits for ``done``.

    Every wait names the rank it waits for and, every ``progress_every_s``, logs how long so far.
    """

    def __init__(
        self,
        store: Any | None,
        prefix: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        step: int | None = None,
        progress_every_s: float = 30.0,
        abort: threading.Event | None = None,
    ) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.timeout_s = timeout_s
        self.step = step
        self.progress_every_s = progress_every_s
        self.abort = abort  # set: every wait gives up at once (the group broke; see abort())

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _what(self) -> str:
        return "checkpoint" if self.step is None else f"checkpoint of step {self.step}"

    def _wait(self, key: str, peer: int, waiting_for: str, timeout_s: float) -> None:
        """Wait for ``key`` in slices, logging who is waited for and for how long; raise a
        CommitError naming the peer at the timeout."""
        self._wait_all({peer: key}, waiting_for, timeout_s)

    def _wait_all(self, keys: dict[int, str], waiting_for: str, timeout_s: float) -> None:
        """Wait until every one of ``keys`` (peer rank -> key) is set, in one store request per
        slice (not one per peer: rank 0 of a thousand ranks would make a thousand round trips per
        commit); the progress log and the timeout name the peers still missing."""
        start = time.monotonic()
        deadline = start + timeout_s
        next_log = start + self.progress_every_s
        while True:
            if self.abort is not None and self.abort.is_set():
                raise CommitError(
                    f"rank {self.rank}: the {self._what()} was abandoned while waiting for "
                    f"{self._name(keys)} to {waiting_for}: the process group broke (in-job "
                    f"recovery)"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = self._missing(keys)
                if not missing:
                    return  # every key came in just now
                raise CommitError(
                    f"rank {self.rank}: {self._name(missing)} did not {waiting_for} "
                    f"of the {self._what()} within {timeout_s:.0f}s (commit_timeout_s); it may "
                    f"have died or be hung"
                )
            try:
                self.store.wait(
                    list(keys.values()),
                    timedelta(seconds=min(remaining, self.progress_every_s)),
                )
                return
            except Exception:  # the store raises its own timeout types; try the next slice
                waited = time.monotonic() - start
                if waited + 0.05 < timeout_s and time.monotonic() >= next_log:
                    next_log = time.monotonic() + self.progress_every_s
                    log.warning(
                        "rank %d: waiting for %s to %s of the %s for %.0fs",
                        self.rank,
                        self._name(self._missing(keys) or keys),
                        waiting_for,
                        self._what(),
                        waited,
                    )

    def _missing(self, keys: dict[int, str]) -> dict[int, str]:
        """The peers whose key is not set yet (one request each, only when a wait ran long),
        through a connection of its own with a short timeout: a store that stopped answering
        must not hold this up for the store's own timeout.  Every peer when it cannot tell."""
        try:
            probe = self.store.clone()
            probe.set_timeout(timedelta(seconds=5))
            return {peer: key for peer, key in keys.items() if not probe.check([key])}
        except Exception:  # the store is unreachable, or cannot clone: say every peer
            return keys

    @staticmethod
    def _name(keys: dict[int, str]) -> str:
        peers = sorted(keys)
        if len(peers) == 1:
            return f"rank {peers[0]}"
        more = f" (and {len(peers) - 8} more)" if len(peers) > 8 else ""
        return f"ranks {', '.join(map(str, peers[:8]))}{more}"

    def _get_all(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, in one request where the store has ``multi_get``."""
        if len(keys) > 1 and hasattr(self.store, "multi_get"):
            try:
                return list(self.store.multi_get(keys))
            except Exception:  # a store that lists it but does not implement it: one by one
                pass
        return [self.store.get(k) for k in keys]

    # 1. begin
    def publish_begin(self, payload: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/begin", json.dumps(payload))

    def wait_begin(self, extra_s: float = 0.0) -> dict[str, Any]:
        """The coordinator's word to start writing: ``{"generation": G}``, or its failure raised
        here (a LeaseError stays a LeaseError on every rank)."""
        key = f"{self.prefix}/begin"
        self._wait(
            key, 0, "say where to write (the lease and the generation)", self.timeout_s + extra_s
        )
        payload = json.loads(self.store.get(key))
        if "error" in payload:
            cls = LeaseError if payload.get("type") == "LeaseError" else CommitError
            raise cls(payload["error"])
        return payload

    # 2. report
    def report(self, payload: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/report/{self.rank}", json.dumps(payload))

    def gather(self, own: dict[str, Any]) -> list[dict[str, Any]]:
        keys = {r: f"{self.prefix}/report/{r}" for r in range(1, self.world_size)}
        if not keys:
            return [own]
        self._wait_all(keys, "report its file", self.timeout_s)
        return [own] + [json.loads(v) for v in self._get_all(list(keys.values()))]

    # 3. outcome
    def publish(self, outcome: str) -> None:
        if self.store is not None:
            self.store.set(self.done_key, outcome)

    @property
    def done_key(self) -> str:
        return f"{self.prefix}/done"

    def wait_outcome(self, extra_s: float = 0.0) -> str:
        key = self.done_key
        self._wait(key, 0, "publish the commit outcome", self.timeout_s + extra_s)
        outcome = self.store.get(key).decode()
        if outcome == "ok":
            # the coordinator read every report before it published this: each rank deletes
            # its own (rank 0 deleting them all would be a request per rank per commit).  Any
            # other outcome may be a peer's abandon() while the coordinator still gathers: the
            # key stays, or the coordinator, whose abandon() left a set key alone, would wait
            # for it until commit_timeout_s
            self.forget([f"{self.prefix}/report/{self.rank}"])
        return outcome

    def keys(self) -> list[str]:
        """Every key this handshake may have set (its clean-up after a failed commit: see
        ``Checkpointer._forget_previous_outcome``)."""
        reports = [f"{self.prefix}/report/{r}" for r in range(1, self.world_size)]
        return [f"{self.prefix}/begin", *reports, self.done_key]

    def hand_over(self, keys: list[str], limit: int = 256) -> int:
        """(the coordinator of a commit without reports, before its outcome) Up to ``limit`` of
        ``keys`` of earlier commits, which every rank has left behind once it read this commit's
        outcome: the last rank to read it deletes them (``read_outcome``).  Returns how many it
        handed over; best effort (none, when the store fails)."""
        if self.store is None or not keys:
            return 0
        try:
            self.store.set(f"{self.prefix}/stale", json.dumps(keys[:limit]))
        except Exception:
            return 0
        return min(limit, len(keys))

    def read_outcome(self) -> None:
        """(not the coordinator, having read the outcome of a commit without reports) Count this
        rank as one that read it: the last of the ranks to do so deletes the outcome, which no
        later commit's gather tells the coordinator it may delete, and what ``hand_over`` left."""
        if self.store is None:
            return
        read, stale = f"{self.prefix}/read", f"{self.prefix}/stale"
        try:
            if int(self.store.add(read, 1)) < self.world_size - 1:
                return
            keys = [self.done_key, read]
            if self.store.check([stale]):
                keys += [k for k in json.loads(self.store.get(stale)) if isinstance(k, str)]
                keys.append(stale)
            self.forget(keys)
        except Exception:  # best effort: the store may be gone
            pass

    def forget(self, keys: list[str]) -> None:
        """Delete ``keys`` from the store; best effort (not every store deletes keys)."""
        if self.store is None:
            return
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:
                pass

    def abandon(self, why: str) -> None:
        """Wake every rank that waits in this handshake (the group broke): each key a rank may
        wait for that is not set yet gets a failure, so its wait returns and the save fails; a key
        already set keeps its value (a commit that completed stays completed)."""
        if self.store is None:
            return
        fail = json.dumps({"error": why, "type": "CommitError"})
        # a connection of its own: the waiting thread holds its client's connection in the wait,
        # and a request on that connection would queue behind it until the wait times out
        store = self.store
        try:
            store = store.clone()
        except Exception:  # a store without clone(): the same connection, best effort
            pass
        if self.is_coordinator:  # it waits for the reports; the others wait for it
            keys = [
                (f"report/{r}", json.dumps({"rank": r, "error": why}))
                for r in range(1, self.world_size)
            ]
        else:
            keys = [("begin", fail), ("done", f"CommitError: {why}")]
        for key, value in keys:
            try:
                store.compare_set(f"{self.prefix}/{key}", "", value)
            except Exception:  # best effort: the store may be gone
                pass

    def cleanup(self) -> None:
        """(the coordinator, after publishing the outcome) Delete ``begin``: every rank read it
        before it reported.  Each other rank deletes its report once it has the outcome
        (``wait_outcome``), and the outcome is deleted by the next commit's coordinator once
        every rank has reported again (``Checkpointer``): so the store holds a bounded number
        of this handshake's keys however many commits a run makes."""
        self.forget([f"{self.prefix}/begin"])


def build_manifest(
    step: int,
    layout: Layout,
    plan: WritePlan,
    reports: list[dict[str, Any]],
    *,
    block_bytes: int,
    generation: int,
    version: str,
    commit_seq: int = 0,
    job_id: str = "",
    validate: bool = True,
    static_cache: dict[str, list[tuple[str, ChunkEntry]]] | None = None,
) -> Manifest:
    """The coordinator's view: every rank's chunks, checked to tile every tensor exactly once
    (``validate=False`` where the caller commits through ``publish_commit``, which checks the
    bytes it publishes the way readers do, this check included).  ``static_cache``: see
    ``report_chunks``."""
    failed = [r for r in reports if r.get("error")]
    if failed:
        raise CommitError(
            "; ".join(f"rank {r['rank']} failed to write: {r['error']}" for r in failed)
        )
    for r in reports:
        if r["digest"] != plan.digest:
            raise CommitError(
                f"rank {r['rank']} saved a different state than rank 0 ({r['num_tensors']} tensors "
                f"vs {len(plan.tensors)}, or different shapes/dtypes/placements); every rank must save "
                f"the same keys with the same global shapes"
            )
    chunks: dict[str, list[ChunkEntry]] = {k: [] for k in plan.tensors}
    files = {}
    for r in reports:
        files[r["file"]] = FileEntry(rank=r["rank"], size_bytes=r["size_bytes"])
        for key, c in report_chunks(r, static_cache):
            chunks[key].append(c)
    tensors = {
        k: TensorEntry(
            dtype=d, shape=s, placement=p, chunks=tuple(sorted(chunks[k], key=lambda c: c.offsets))
        )
        for k, (d, s, p) in plan.tensors.items()
    }
    extras = reports[0]["values"]
    rank_extras = {}
    for r in reports[1:]:
        diff = {k: v for k, v in r["values"].items() if extras.get(k, _MISSING) != v}
        if diff:
            rank_extras[r["rank"]] = diff
    m = Manifest(
        step=step,
        layout=layout,
        tensors=tensors,
        files=files,
        extras=extras,
        rank_extras=rank_extras,
        block_bytes=block_bytes,
        generation=generation,
        created_unix_s=time.time(),
        toolkit_version=version,
        commit_seq=commit_seq,
        job_id=job_id,
    )
    if validate:
        try:
            m.validate()
        except CheckpointCorruptError as e:
            raise CommitError(f"refusing to commit step {step}: {e}") from None
    return m


_MISSING = object()


def publish_commit(
    storage: Storage,
    lease: Any,
    manifest: Manifest | ManifestSummary,
    *,
    keep_last: int,
    keep_every: int | None,
    collect: Callable[[Any], bool] | None = None,
    sweep_step: bool = True,
    shape_checked: bool = False,
    data: bytes | None = None,
    catalog: Catalog | None = None,
    verified: bool = False,
) -> list[str]:
    """Commit a step whose files are written: check that readers would accept the manifest,
    make the directory durable, check the writer lease, publish the manifest, then (under the
    lease still) run retention.  Returns what to delete afterwards: older generations and temp
    files of this step, and the directories retention dropped (uncommitted already).  ``data``:
    the manifest's bytes where the caller has them (``manifest_to_bytes`` otherwise);
    ``catalog``: the caller's scan of ``storage`` under the lease, before this commit (retention
    then lists the steps once per commit instead of twice).  ``verified``: ``data`` are bytes
    this check passed already, where they were made (a node's leader publishing the manifest
    rank 0 committed: ``manifest`` is then its ``ManifestSummary``, which rank 0 sent with
    ``data``)."""
    step = manifest.step
    step_rel = step_dir_name(step)
    if data is None:
        assert isinstance(manifest, Manifest)
        data = manifest_to_bytes(manifest)
    where = storage.display(f"{step_rel}/{MANIFEST_NAME}")
    try:  # never publish what a reader would refuse (the caps, JSON depth, ...)
        if verified:
            pass
        elif shape_checked:  # (the caller compared all but the variable parts with a checked one)
            check_variable_parts(data, manifest, where)
        else:
            manifest_of_step(data, where, step)
    except CheckpointCorruptError as e:
        raise CommitError(f"refusing to commit step {step}: readers would refuse it: {e}") from None
    summary = manifest if isinstance(manifest, ManifestSummary) else summary_of(manifest)
    storage.sync_dir(step_rel)
    # What is at the manifest's name now, read before the lease check: a successor that takes
    # the URL over after the check and commits this step first makes the publish fail, where the
    # store can replace conditionally (S3); elsewhere the check and the publish are adjacent
    version = storage.version_of(f"{step_rel}/{MANIFEST_NAME}")
    lease.check()  # nobody took the URL over while the files were written
    storage.publish_if(f"{step_rel}/{MANIFEST_NAME}", data, version)
    remember_commit(storage, summary)
    # Committed.  Housekeeping failures from here on are logged, never a failed save.  Steps that
    # retention drops are uncommitted before the outcome is published, so every rank's wait()
    # sees the same steps; their bytes are deleted after.  Nothing is deleted unless the lease is
    # still this job's after the commit.
    try:
        lease.check()
    except StorageError as e:  # (another owner's record is still a LeaseError: raised)
        log.warning(
            "committed step %d; the writer lease could not be read back right after (%s), so "
            "retention deletes nothing this time",
            step,
            str(e).split(";")[0],
        )
        return []
    garbage: list[str] = []
    try:
        # Files of an older generation of this step, and temp files, are garbage now; never a
        # later generation's (a successor that took the lease over since the check above may be
        # saving this step again, under a generation past ours: its files are not ours to judge)
        for name in storage.listdir(step_rel) if sweep_step else ():
            if name != MANIFEST_NAME and name not in summary.files:
                if _generation_of(name, default=-1) <= summary.generation:
                    garbage.append(f"{step_rel}/{name}")
        if catalog is not None:  # (the lease kept other writers out since: only this commit)
            catalog = Catalog(
                [
                    *(i for i in catalog.infos.values() if i.step != step),
                    committed_step(step_rel, summary),
                ]
            )
        garbage += retire_steps(
            storage,
            keep_last,
            keep_every,
            in_progress=step,
            catalog=catalog,
            collect=collect,
            check=lease.check,  # (before each removal: a slow one is a window for a takeover)
        )
    except Exception as e:
        log.warning("retention after committing step %d failed: %s", step, e)
    return garbage
