"""Executing a conversion plan: stream bytes from the source checkpoint into the target's files.

One producer thread fills batches of target chunks, file after file (ranged reads of only the
spans the plan names, every block verified, overlaps copied into place), while this thread writes
the previous batch, so reads and writes overlap, and reads run on into the next file while the
last batch of a file is written.  Memory stays at a few batches of at most
``max(largest chunk, 8 MiB)`` bytes (twice that while a failed write of a file is retried: the
retry streams that file again on its own).  The target is committed like a save: every rank file is
written and made durable, then MANIFEST.json is published atomically, so an interrupted conversion
leaves no committed target.  The result is an ordinary checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from reshape.plan import TargetChunk, plan, target_layout
from resilient.checkpoint.catalog import scan
from resilient.checkpoint.codec import block_checksums, safetensors_header
from resilient.checkpoint.format import (
    MANIFEST_NAME,
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    dtype_info,
    manifest_to_bytes,
    rank_file_name,
    step_dir_name,
    user_extras,
)
from resilient.checkpoint.lease import WriterLease, default_job_id
from resilient.checkpoint.reader import (
    ReadBatch,
    ReadRing,
    ReadStats,
    check_file_sizes,
    read_manifest,
    stream_reads,
    watching_retirement,
)
from resilient.checkpoint.retention import step_dirs
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.writer import next_generation, rank_file_metadata
from resilient.errors import CheckpointCorruptError, CheckpointNotFoundError, ResilientError

__all__ = [
    "AllocationError",
    "ConvertReport",
    "DestinationExistsError",
    "allocate",
    "resolve_step",
    "convert",
    "stream_chunks",
    "ChunkStream",
    "StreamBuffers",
    "single_threaded_torch",
]

MIN_BATCH_BYTES = 8 << 20


class DestinationExistsError(ResilientError, FileExistsError):
    """The destination already holds a checkpoint and --overwrite was not given."""


class AllocationError(ResilientError, MemoryError):
    """Memory a conversion or export needs (a batch buffer, a whole tensor) could not be had."""


def allocate(shape: tuple[int, ...] | int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``, or an AllocationError naming ``what`` and the bytes it
    needed (the allocator's RuntimeError says neither which tensor nor what to do)."""
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as e:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        raise AllocationError(
            f"{what}: needs {nbytes} bytes ({nbytes / 2**30:.1f} GiB) of memory, and the "
            f"allocator refused them ({type(e).__name__}: {str(e).strip()[:200]}); free memory or "
            f"run on a machine with more"
        ) from None


@dataclass
class ConvertReport:
    step: int
    source: str
    target: str
    source_layout: list
    target_layout: list
    files: int
    bytes_read: int
    bytes_written: int
    seconds: float
    read_amplification: float
    largest_chunk_bytes: int
    batch_bytes: int
    per_rank: dict[int, dict[str, int]] = field(default_factory=dict)


def resolve_step(storage: Storage, step: int | None) -> int:
    """``step`` if it is committed under ``storage`` (else an error that says why: not there, or
    there but damaged); by default the newest commit."""
    catalog = scan(storage)
    if step is None:
        if not catalog.steps():
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {storage.url}; check the URL"
            )
        return catalog.newest().step
    info = catalog.get(step)
    if info is not None and info.state == "damaged":
        raise CheckpointCorruptError(
            f"step {step} under {storage.url} is not a usable commit: {info.problem}"
        )
    if info is None or info.state != "committed":
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint under {storage.url}; committed steps: "
            f"{', '.join(map(str, catalog.steps()[-10:]))}"
        )
    return step


class StreamBuffers:
    """The memory a conversion streams through, reused from one target file to the next.

    Two batch buffers of ``budget`` bytes take turns (one filled while the other is written), and
    one ring holds the source reads in flight (``budget`` bytes, or one read if larger): about three
    times the budget in all, allocated and faulted in once.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.batches = [
            allocate(budget, torch.uint8, "a batch buffer of the conversion (its largest chunk)")
            for _ in range(2)
        ]
        self.ring = ReadRing()


class ChunkStream:
    """The data sections of target files, in order, batch by batch, filled by one producer thread.

    The producer fills one batch buffer while the caller writes the other.  Its reads stay in
    flight across batches and across files (``stream_reads``): as soon as a buffer comes back
    from the caller, the next batch's reads start, while the last reads of the batch before are
    still landing, even when that next batch opens the next file.  Staged reads in flight take at
    most ``buffers.budget`` bytes of the ring.

    ``file(k)`` yields file ``k``'s batches, once, in file order.  A file whose iteration stops
    early (a failed write) is abandoned: its remaining batches are dropped when the next file is
    asked for, and a retry of it needs its own stream.  ``checksums[k]`` and ``read_bytes[k]``
    hold each file's target block checksums and the bytes read from the source for it.
    """

    def __init__(
        self,
        source: Storage,
        manifest: Manifest,
        files: list[list[TargetChunk]],
        buffers: StreamBuffers,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.source, self.manifest, self.files, self.buffers = source, manifest, files, buffers
        self.on_bytes = on_bytes
        self.checksums: list[dict[str, list[int]]] = [{} for _ in files]
        self.read_bytes = [0] * len(files)
        self._free: queue.Queue = queue.Queue()
        for buf in buffers.batches:
            self._free.put(buf)
        self._full: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._next = 0  # the next file the caller may ask for
        self._producer = threading.Thread(target=self._produce, name="reshape-read", daemon=True)
        self._producer.start()

    def _take_free(self) -> torch.Tensor | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _batches(self) -> Iterator[ReadBatch]:
        budget = self.buffers.budget
        for k, chunks in enumerate(self.files):
            batches = list(_batches(chunks, budget))
            for i, batch in enumerate(batches):
                buf = self._take_free()  # the other buffer may still be with the writer
                if buf is None:
                    return
                base = batch[0].item.begin
                dests = {}
                for c in batch:
                    info = dtype_info(c.item.dtype)
                    part = buf[c.item.begin - base : c.item.end - base]
                    dests[c.item.key] = part.view(info.torch_dtype).view(c.item.local_shape)
                last = i == len(batches) - 1

                def done(stats: ReadStats, k=k, batch=batch, buf=buf, base=base, last=last) -> None:
                    self.read_bytes[k] += stats.bytes_read
                    mv = memoryview(buf.numpy())[: batch[-1].item.end - base]
                    for c in batch:
                        span = mv[c.item.begin - base : c.item.end - base]
                        self.checksums[k][c.item.key] = block_checksums(
                            span, self.manifest.block_bytes
                        )
                    self._full.put((k, last, buf, mv))

                yield ReadBatch([r for c in batch for r in c.reads], dests, done)

    def _produce(self) -> None:
        try:
            stream_reads(
                self.source,
                self.manifest,
                self._batches(),
                max_inflight_bytes=self.buffers.budget,
                ring=self.buffers.ring,
                max_open_batches=len(self.buffers.batches),
            )
            self._full.put(None)
        except BaseException as e:  # handed to the writing thread, which raises it
            self._full.put(e)

    def file(self, k: int) -> Iterator[memoryview]:
        if k < self._next:
            raise RuntimeError(
                f"target file {k} was already streamed; a retry needs its own stream"
            )
        self._next = k + 1
        held = None  # the buffer the caller is writing from
        try:
            while True:
                x = self._full.get()
                if x is None:
                    raise RuntimeError(f"the stream ended before target file {k} did")
                if isinstance(x, BaseException):
                    raise x
                fk, last, buf, mv = x
                if fk < k:  # what is left of an abandoned file
                    self._free.put(buf)
                    continue
                assert fk == k, f"target file {k} has no batches"
                held = buf
                yield mv  # the caller has written it when it asks for the next one
                held = None
                self._free.put(buf)
                if self.on_bytes is not None:
                    self.on_bytes(len(mv))
                if last:
                    return
        finally:
            if held is not None:  # stopped while writing this batch: the buffer is free again
                self._free.put(held)

    def close(self) -> None:
        self._stop.set()
        self._producer.join()


def stream_chunks(
    source: Storage,
    manifest: Manifest,
    chunks: list[TargetChunk],
    buffers: StreamBuffers,
    checksums: dict[str, list[int]] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    read_bytes: list[int] | None = None,
) -> Iterator[memoryview]:
    """The data section of one target file, batch by batch (a ``ChunkStream`` of one file).
    ``read_bytes[0]`` accumulates the bytes actually read from the source."""
    stream = ChunkStream(source, manifest, [chunks], buffers, on_bytes)
    try:
        yield from stream.file(0)
    finally:
        stream.close()
        if checksums is not None:
            checksums.update(stream.checksums[0])
        if read_bytes is not None:
            read_bytes[0] += stream.read_bytes[0]


def _batches(chunks: list[TargetChunk], budget: int) -> Iterator[list[TargetChunk]]:
    batch: list[TargetChunk] = []
    for c in chunks:
        if batch and c.item.end - batch[0].item.begin > budget:
            yield batch
            batch = []
        batch.append(c)
    if batch:
        yield batch


def convert(
    src: str,
    dst: str,
    sizes: dict[str, int | None],
    *,
    step: int | None = None,
    overwrite: bool = False,
    src_options: dict | None = None,
    dst_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> ConvertReport:
    """Convert ``src`` (one committed step) into ``dst`` in the layout ``sizes`` asks for."""
    with single_threaded_torch():
        return _convert(src, dst, sizes, step, overwrite, src_options, dst_options, progress)


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one intra-op thread for the duration (then restore the setting).

    The copies that place bytes are memory-bound, so a second OpenMP thread does not speed them
    up; its spin-waiting between ops does take a core from the threads that read, checksum and
    write.  Measured on 2 cores: a conversion used 1.5 s of CPU with torch's default and 0.65 s
    with one thread, and took 1.2 s instead of 0.75 s.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _convert(src, dst, sizes, step, overwrite, src_options, dst_options, progress) -> ConvertReport:
    source = Storage(src, src_options)
    destination = Storage(dst, dst_options)
    if source.location() == destination.location():
        raise DestinationExistsError(
            f"the destination {dst} is the source {src} (the same place, spelled differently); "
            f"convert into another URL"
        )
    if destination.commit_method is None:
        raise destination.refusal_to_commit()
    step = resolve_step(source, step)
    with watching_retirement(source, step):  # the source step retired while read: said so
        manifest = read_manifest(source, step)
        layout = target_layout(manifest.layout, sizes)
        conversion = plan(manifest, layout)  # raises LayoutError before anything is written
        # buffers are sized from the manifest's chunks: its files must be the size it says first
        check_file_sizes(
            source, manifest, {r.chunk.file for c in conversion.chunks for r in c.reads}
        )
        existing = sorted(step_dirs(destination))
        if existing and not overwrite:
            raise DestinationExistsError(
                f"the destination {destination.url} already holds checkpoint steps "
                f"{existing[-10:]}; pass --overwrite to replace step {step} there, or choose an "
                f"empty destination"
            )
        # The converted step is committed as the destination's newest: over later steps there, it
        # would abandon them (a load, a resume, `inspect` would all go back to it)
        later = [s for s in scan(destination).line() if s > step] if existing else []
        if later:
            raise DestinationExistsError(
                f"the destination {destination.url} holds later steps {sorted(later)[-10:]} than "
                f"step {step}; its conversion would be committed after them and abandon them (a "
                f"resume would go back to step {step}); convert into an empty destination, or "
                f"delete those steps there first"
            )
        lease = WriterLease(destination, default_job_id())
        lease.acquire()  # the destination is written by this conversion alone
        try:
            return _convert_step(source, destination, lease, manifest, layout, conversion, progress)
        finally:
            lease.release()


def _convert_step(
    source, destination, lease, manifest, layout, conversion, progress
) -> ConvertReport:
    t0 = time.perf_counter()
    step = manifest.step
    step_rel = step_dir_name(step)
    destination.makedirs(step_rel)
    # A step already there (--overwrite) stays committed until the new manifest replaces it: the
    # new files take a generation no file there has, and the old ones go only after the commit.
    generation = next_generation(destination, step_rel)
    buffers = StreamBuffers(max(conversion.largest_chunk_bytes, MIN_BATCH_BYTES))
    entries: dict[str, list[ChunkEntry]] = {k: [] for k in manifest.tensors}
    files: dict[str, FileEntry] = {}
    per_rank: dict[int, dict[str, int]] = {}
    bytes_read = 0
    per_target: dict[int, list[TargetChunk]] = {}
    for c in conversion.chunks:
        per_target.setdefault(c.rank, []).append(c)
    ranks = sorted(per_target)
    # one stream for every file: its reads run ahead into the next file while this one is written
    stream = ChunkStream(source, manifest, [per_target[r] for r in ranks], buffers, progress)
    # each file is made durable in the background while the next one is produced
    with (
        ThreadPoolExecutor(2, thread_name_prefix="reshape-sync") as syncs,
        contextlib.closing(stream),
    ):
        pending = []
        for k, rank in enumerate(ranks):
            chunks = per_target[rank]
            file = rank_file_name(rank, generation)
            header = safetensors_header(
                [
                    (
                        c.item.key,
                        dtype_info(c.item.dtype).safetensors,
                        c.item.local_shape,
                        c.item.begin,
                        c.item.end,
                    )
                    for c in chunks
                ],
                rank_file_metadata(step),
            )
            retry: dict[str, Any] = {}

            def parts(k=k, chunks=chunks, header=header, retry=retry):
                yield header
                if "attempted" not in retry:
                    retry["attempted"] = True
                    yield from stream.file(k)
                    return
                # a retried write streams the file again on its own (with its own buffers: the
                # shared ones are with the stream, which has moved on to the next file)
                retry["checksums"], retry["read"] = {}, [0]
                yield from stream_chunks(
                    source,
                    manifest,
                    chunks,
                    StreamBuffers(buffers.budget),
                    retry["checksums"],
                    progress,
                    retry["read"],
                )

            size = destination.write_file(f"{step_rel}/{file}", parts, fsync=False)
            pending.append(syncs.submit(destination.sync_file, f"{step_rel}/{file}"))
            files[file] = FileEntry(rank=rank, size_bytes=size)
            checksums = retry.get("checksums", stream.checksums[k])
            read = retry["read"][0] if "read" in retry else stream.read_bytes[k]
            for c in chunks:
                it = c.item
                entries[it.key].append(
                    ChunkEntry(
                        offsets=it.offsets,
                        sizes=it.sizes,
                        file=file,
                        name=it.key,
                        byte_range=(len(header) + it.begin, len(header) + it.end),
                        checksums=tuple(checksums[it.key]),
                        codec="none",
                        raw_bytes=it.end - it.begin,
                    )
                )
            bytes_read += read
            per_rank[rank] = {"bytes_read": read, "bytes_written": size}
        for f in pending:
            f.result()
    target = Manifest(
        step=step,
        layout=layout,
        tensors={
            k: TensorEntry(
                t.dtype, t.shape, t.placement, tuple(sorted(entries[k], key=lambda c: c.offsets))
            )
            for k, t in manifest.tensors.items()
        },
        files=files,
        extras=user_extras(manifest.extras),  # (not the source's bookkeeping of its commits)
        rank_extras={r: v for r, v in manifest.rank_extras.items() if r < layout.world_size},
        block_bytes=manifest.block_bytes,
        generation=generation,
        created_unix_s=time.time(),
        toolkit_version=_version(),
        commit_seq=scan(destination).next_commit_seq(),
        job_id=lease.job_id,
    )
    target.validate()
    destination.sync_dir(step_rel)
    lease.check()
    destination.publish(f"{step_rel}/{MANIFEST_NAME}", manifest_to_bytes(target))
    for name in destination.listdir(step_rel):  # an older generation's files, temporaries
        if name != MANIFEST_NAME and name not in files:
            destination.remove(f"{step_rel}/{name}")
    return ConvertReport(
        step=step,
        source=source.url,
        target=destination.url,
        source_layout=manifest.layout.to_json(),
        target_layout=layout.to_json(),
        files=len(files),
        bytes_read=bytes_read,
        bytes_written=sum(f.size_bytes for f in files.values()),
        seconds=time.perf_counter() - t0,
        read_amplification=conversion.read_amplification,
        largest_chunk_bytes=conversion.largest_chunk_bytes,
        batch_bytes=buffers.budget,
        per_rank=per_rank,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("resilient")
    except PackageNotFoundError:
        return "unknown"
