"""Loading: plan which byte ranges each rank needs, read them ranged, verify, and place them.

1. ``plan_reads`` (pure): for every tensor of the target state, the overlap of this rank's target
   chunk with each stored chunk, in the expanded view (fused dims split into blocks), and the
   smallest block-aligned byte span of the stored chunk that holds it.
2. ``execute_reads``: coalesce spans per file, read them (ranged reads, concurrently where the
   backend can), verify the crc32 of every block read, and copy each overlap into its destination.

Also owns ``verify_step``: read every byte of a step and check it against the manifest.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from resilient.checkpoint.buffers import scratch_like
from resilient.checkpoint.codec import crc32, decompress, parse_safetensors_header
from resilient.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SAFETENSORS_HEADER_BYTES,
    ChunkEntry,
    Manifest,
    TensorEntry,
    dtype_info,
    manifest_of_step,
    step_dir_name,
)
from resilient.checkpoint.state import TensorLeaf
from resilient.checkpoint.storage import PinnedFiles, Storage
from resilient.errors import (
    CheckpointCorruptError,
    LayoutError,
    ResilientError,
    StateMismatchError,
    StepRetiredError,
    StorageError,
)
from resilient.layout import Box, Layout, Placement, Shard, chunk_offsets_sizes

__all__ = [
    "ReadItem",
    "plan_reads",
    "execute_reads",
    "stream_reads",
    "check_file_sizes",
    "ReadBatch",
    "ReadRing",
    "read_manifest",
    "verify_step",
    "VerifyReport",
    "watching_retirement",
    "scratch_like",
]

# The most bytes of staged reads in flight at once (bounds memory) and the reader threads (by
# default; twice as many reads are issued ahead of the one being placed).
BATCH_BYTES = 256 << 20
READ_THREADS = 4
# Reads are kept near this size: a large overlap is read in slabs that are placed (and their memory
# reused) one by one, and a read that is still larger is fetched and verified in pieces of about this
# size (cut at block boundaries) by the reader threads concurrently.
PIECE_BYTES = 4 << 20
# verify_step reads this much at a time (rounded to whole blocks), READ_THREADS reads at once.
VERIFY_READ_BYTES = 16 << 20


@dataclass(frozen=True)
class ReadItem:
    """Copy ``overlap`` (expanded, global coordinates) from a stored chunk into a destination."""

    key: str
    chunk: ChunkEntry
    src_box: Box  # the stored chunk, expanded global coordinates
    dst_box: Box  # this rank's target chunk, expanded global coordinates
    overlap: Box
    span: tuple[int, int]  # absolute, block-aligned byte span of the file to read


def read_manifest(storage: Storage, step: int) -> Manifest:
    """A step's manifest, read within the size cap and checked in full; it must be the manifest
    of ``step`` (a step directory copied under another number is not that step)."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    return manifest_of_step(storage.read_small(rel, MAX_MANIFEST_BYTES), storage.display(rel), step)


@contextlib.contextmanager
def watching_retirement(storage: Storage, step: int) -> Iterator[None]:
    """Turn a failure to read ``step`` into StepRetiredError when the step's manifest was removed
    or replaced meanwhile (retention retired the step, or a re-save replaced it, while another
    process read it): that is not corruption, and reading again finds the newest step."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    before = _stat_or_none(storage, rel)
    if before is None:  # it was listed as committed a moment ago
        raise _retired(storage, step, None, "its manifest was gone when the read began")
    try:
        yield
    except (StorageError, CheckpointCorruptError) as e:
        after = _stat_or_none(storage, rel)
        if before is not None and after != before:
            raise _retired(storage, step, after, str(e)) from e
        raise


def _retired(storage: Storage, step: int, after: tuple | None, what: str) -> StepRetiredError:
    how = "retired (its manifest was removed)" if after is None else "re-saved"
    return StepRetiredError(
        f"step {step} of {storage.url} was {how} while it was being read ({what}); this is not "
        f"corruption: the writing job's retention or a re-save replaced it — read again to get "
        f"the newest step"
    )


def _stat_or_none(storage: Storage, rel: str) -> tuple | None:
    try:
        return storage.stat_key(rel)
    except ResilientError:
        return None


def _union_parts(key: str, src: Placement, dst: Placement, ndim: int) -> dict[int, int]:
    """The fused-dim view both placements can be expressed in (conflicts are a LayoutError)."""
    s = {p.dim: p.parts for _, p in src if isinstance(p, Shard)}
    d = {p.dim: p.parts for _, p in dst if isinstance(p, Shard)}
    out = {}
    for dim in set(s) | set(d):
        if dim in s and dim in d and s[dim] != d[dim]:
            raise LayoutError(
                f"tensor {key!r}: dim {dim} was saved split with parts={s[dim]} but the state splits "
                f"it with parts={d[dim]}; a fused dim must keep its number of parts"
            )
        out[dim] = s.get(dim, d.get(dim, 1))
    return {k: v for k, v in out.items() if v > 1 and k < ndim}


def _box_in_view(
    offsets, sizes, own_parts: Mapping[int, int], view_parts: Mapping[int, int], shape
) -> Box:
    """A chunk (per-dim offsets/sizes, per block for its own fused dims) in the expanded view."""
    eo, es = [], []
    for dim, (o, s) in enumerate(zip(offsets, sizes)):
        p = view_parts.get(dim, 1)
        if p == 1:
            eo.append(o)
            es.append(s)
        elif own_parts.get(dim, 1) == p:
            eo += [0, o]
            es += [p, s]
        else:  # not split along this dim: it covers the whole dim, i.e. every block entirely
            assert o == 0 and s == shape[dim], "an unsplit dim covers the whole dim"
            eo += [0, 0]
            es += [p, shape[dim] // p]
    return Box(tuple(eo), tuple(es))


def _strides(sizes) -> list[int]:
    st, acc = [], 1
    for s in reversed(sizes):
        st.append(acc)
        acc *= s
    return st[::-1]


def plan_reads(
    manifest: Manifest, leaves: Mapping[str, TensorLeaf], layout: Layout, rank: int
) -> list[ReadItem]:
    """Every (stored chunk, overlap) this rank needs to fill ``leaves``; pure arithmetic."""
    items: list[ReadItem] = []
    missing = sorted(set(leaves) - set(manifest.tensors))
    if missing:
        shown = ", ".join(repr(k) for k in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise StateMismatchError(
            f"step {manifest.step} has no tensors {shown} ({len(missing)} missing); the checkpoint "
            f"holds {len(manifest.tensors)} tensors — was it saved from a different model or optimizer?"
        )
    for key, leaf in sorted(leaves.items()):
        entry = manifest.tensors[key]
        _check_match(key, entry, leaf, manifest.step)
        do, ds = chunk_offsets_sizes(entry.shape, leaf.placement, layout, rank)
        items += plan_tensor_reads(key, entry, leaf.placement, do, ds, manifest.block_bytes)
    return items


def plan_tensor_reads(
    key: str,
    entry: TensorEntry,
    placement: Placement,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    block_bytes: int,
) -> list[ReadItem]:
    """The reads that fill one target chunk (``offsets``/``sizes`` under ``placement``), pure."""
    view = _union_parts(key, entry.placement, placement, len(entry.shape))
    dst_own = {p.dim: p.parts for _, p in placement if isinstance(p, Shard)}
    src_own = {p.dim: p.parts for _, p in entry.placement if isinstance(p, Shard)}
    dst_box = _box_in_view(offsets, sizes, dst_own, view, entry.shape)
    if dst_box.numel == 0:
        return []
    itemsize = dtype_info(entry.dtype).itemsize
    items = []
    for c in entry.chunks:
        src_box = _box_in_view(c.offsets, c.sizes, src_own, view, entry.shape)
        ov = src_box.intersect(dst_box)
        if ov is not None:
            items.append(
                ReadItem(key, c, src_box, dst_box, ov, _span(c, src_box, ov, itemsize, block_bytes))
            )
    return items


def _span(c: ChunkEntry, src: Box, ov: Box, itemsize: int, block: int) -> tuple[int, int]:
    start, end = c.byte_range
    if c.codec != "none":
        return start, end  # a compressed chunk is read whole
    st = _strides(src.sizes)
    rel = [o - so for o, so in zip(ov.offsets, src.offsets)]
    first = sum(r * s for r, s in zip(rel, st))
    last = sum((r + n - 1) * s for r, n, s in zip(rel, ov.sizes, st))
    b0, b1 = first * itemsize, (last + 1) * itemsize
    b0 = (b0 // block) * block
    b1 = min(-(-b1 // block) * block, end - start)
    return start + b0, start + b1


def _check_match(key: str, entry: TensorEntry, leaf: TensorLeaf, step: int) -> None:
    from resilient.checkpoint.format import dtype_name

    if tuple(entry.shape) != tuple(leaf.shape):
        raise StateMismatchError(
            f"tensor {key!r}: step {step} holds global shape {list(entry.shape)}, but the state "
            f"being loaded has global shape {list(leaf.shape)}; load into a model built with the "
            f"same configuration"
        )
    dt = dtype_name(leaf.local.dtype)
    if dt != entry.dtype:
        raise StateMismatchError(
            f"tensor {key!r}: step {step} holds {entry.dtype}, but the state being loaded has {dt}; "
            f"cast the model to {entry.dtype} before loading (or after)"
        )


class _Verifier:
    """Checks each block once, however many read items share it."""

    def __init__(self, manifest: Manifest, storage: Storage) -> None:
        self.m, self.storage = manifest, storage
        self.done: set[tuple[str, int, int]] = set()
        self.bytes_verified = 0
        self._lock = threading.Lock()  # reader threads verify concurrently

    def check(self, key: str, c: ChunkEntry, span: tuple[int, int], data: memoryview) -> None:
        bb = self.m.block_bytes
        start = c.byte_range[0]
        first_block = (span[0] - start) // bb
        for i in range(first_block, len(c.checksums)):
            b0 = start + i * bb
            if b0 >= span[1]:
                break
            b1 = min(b0 + bb, c.byte_range[1])
            tag = (c.file, start, i)
            with self._lock:
                if tag in self.done:
                    continue
            got = crc32(data[b0 - span[0] : b1 - span[0]])
            if got != c.checksums[i]:
                raise CheckpointCorruptError(
                    f"checksum mismatch in {self.storage.display(step_dir_name(self.m.step) + '/' + c.file)}, "
                    f"tensor {key!r}, step {self.m.step}, block {i} (bytes [{b0}, {b1})): expected "
                    f"crc32 {c.checksums[i]:08x}, found {got:08x}; the file is corrupt — load an "
                    f"earlier step (Checkpointer.load(..., fallback=True))"
                )
            with self._lock:
                if tag not in self.done:
                    self.done.add(tag)
                    self.bytes_verified += b1 - b0


def _uninitialized(n: int) -> memoryview:
    """Writable memory that is not zeroed first (``bytearray`` would touch every page up front)."""
    return memoryview(torch.empty(n, dtype=torch.uint8).numpy())


class ReadRing:
    """Reusable memory for the reads in flight, handed out and given back in FIFO order.

    Reads are consumed in the order they were issued, so their buffers can live in one ring: a
    region is taken at the head and released at the tail.  Reusing the memory matters: faulting in
    a fresh buffer for every read costs more than copying the bytes out of the page cache.  One
    ring can serve many ``execute_reads`` calls (the resharder passes the same one for every batch).
    """

    def __init__(self, capacity: int = 0) -> None:
        self._buf = _uninitialized(capacity)
        self._live: deque[tuple[int, int]] = deque()

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def reserve(self, capacity: int) -> None:
        """Grow to at least ``capacity`` bytes (only between uses)."""
        assert not self._live, "reserve() while regions are in use"
        if len(self._buf) < capacity:
            self._buf = _uninitialized(capacity)

    @property
    def idle(self) -> bool:
        """No region is in use."""
        return not self._live

    def take(self, n: int) -> memoryview | None:
        """``n`` bytes after the newest region, or None until older regions are released."""
        want, n = n, max(n, 1)  # an empty region still takes a byte, so regions never coincide
        cap = len(self._buf)
        if not self._live:
            start = 0 if n <= cap else None
        else:
            oldest, newest = self._live[0][0], self._live[-1]
            head = newest[1]
            if newest[0] >= oldest:  # not wrapped: free space at the end, then before the oldest
                start = head if head + n <= cap else (0 if n <= oldest else None)
            else:  # wrapped: free space between the newest and the oldest
                start = head if head + n <= oldest else None
        if start is None:
            return None
        self._live.append((start, start + n))
        return self._buf[start : start + want]

    def release(self) -> None:
        """Give back the oldest region."""
        self._live.popleft()

    def clear(self) -> None:
        self._live.clear()


@dataclass
class ReadStats:
    bytes_read: int = 0
    bytes_direct: int = 0  # read straight into the destination, no copy
    bytes_verified: int = 0
    num_requests: int = 0


@dataclass
class ReadBatch:
    """Items to read and the tensors they go to (``dests[key]`` receives ``key``'s target chunk,
    contiguous); ``done(stats)`` runs once every item of the batch is placed."""

    items: list[ReadItem]
    dests: Mapping[str, torch.Tensor]
    done: Callable[[ReadStats], None] | None = None


# (file, span, items, where the bytes go: the destination's memory, or None for the ring)
_Request = tuple[str, tuple[int, int], list[ReadItem], memoryview | None]


class _Batch:
    """A batch being read: its requests, its verifier (blocks are checked once per batch) and its
    statistics."""

    def __init__(self, batch: ReadBatch, requests: list[_Request], verifier: _Verifier) -> None:
        self.batch, self.requests, self.verifier = batch, requests, verifier
        self.left = len(requests)
        self.stats = ReadStats()

    def finish(self) -> None:
        self.stats.bytes_verified = self.verifier.bytes_verified
        if self.batch.done is not None:
            self.batch.done(self.stats)


def execute_reads(
    storage: Storage,
    manifest: Manifest,
    items: list[ReadItem],
    dests: Mapping[str, torch.Tensor],
    *,
    max_inflight_bytes: int | None = None,
    ring: ReadRing | None = None,
    files: PinnedFiles | None = None,
    place: bool = True,
    verify: bool = True,
    threads: int | None = None,
    piece_bytes: int | None = None,
) -> ReadStats:
    """Read, verify and place every item (one batch of ``stream_reads``)."""
    out: list[ReadStats] = []
    stream_reads(
        storage,
        manifest,
        [ReadBatch(items, dests, out.append)],
        max_inflight_bytes=max_inflight_bytes,
        ring=ring,
        files=files,
        place=place,
        verify=verify,
        threads=threads,
        piece_bytes=piece_bytes,
    )
    return out[0]


def check_file_sizes(
    storage: Storage,
    manifest: Manifest,
    names: Iterable[str],
    files: PinnedFiles | None = None,
) -> None:
    """Each of the step's files ``names`` against the size the manifest declares for it (one stat
    a file, through ``files`` where given): a CheckpointCorruptError naming the first that
    differs.  Whoever sizes memory from the manifest checks first: a manifest's chunk sizes are
    only as true as its files."""
    step_rel = step_dir_name(manifest.step)
    for file in sorted(set(names)):
        rel = f"{step_rel}/{file}"
        actual = storage.size(rel) if files is None else files.size(rel)
        declared = manifest.files[file].size_bytes
        if actual != declared:
            raise CheckpointCorruptError(
                f"{storage.display(rel)} (step {manifest.step}) is {actual} bytes, but the "
                f"manifest declares {declared}; the file is truncated or was replaced — "
                f"load an earlier step"
            )


def stream_reads(
    storage: Storage,
    manifest: Manifest,
    batches: Iterable[ReadBatch],
    *,
    max_inflight_bytes: int | None = None,
    ring: ReadRing | None = None,
    max_open_batches: int = 2,
    files: PinnedFiles | None = None,
    place: bool = True,
    verify: bool = True,
    threads: int | None = None,
    piece_bytes: int | None = None,
) -> None:
    """Read, verify and place the items of each batch, in order, with reads in flight across batch
    boundaries: the next batch is taken from ``batches`` (which may wait, e.g. for a free buffer)
    as soon as the current one's reads are all issued, so the disk never idles between batches.
    Each batch's ``done`` runs on this thread, in order, once all its items are placed.  At most
    ``max_open_batches`` are taken before the oldest is done: a source that hands out one of N
    buffers, freed after ``done``, must allow no more than N.

    An item whose bytes are one contiguous run both in the file and in its destination (a whole
    chunk, a band of rows) is read straight into the destination's memory.  The others are
    coalesced into reads of about ``PIECE_BYTES`` that land in reused memory (``ring``, or one
    sized here) and are placed from there by this thread, in order.  Reader threads fetch and
    verify (crc32 drops the GIL) concurrently.  The ring holds the staged reads in flight: at most
    ``2 * threads`` reads and ``max_inflight_bytes`` (default ``BATCH_BYTES``), or one read if it
    is larger.

    ``files`` reads through descriptors held open (the bytes a check read are the bytes a later
    read places); ``place=False`` only reads and verifies (every read lands in the ring, the
    destinations are not touched); ``verify=False`` skips the checksums (for bytes of ``files``
    already checked).  ``threads`` reader threads (``2 * threads`` reads in flight) and reads of
    about ``piece_bytes`` (defaults ``READ_THREADS``, ``PIECE_BYTES``).
    """
    threads = READ_THREADS if threads is None else threads
    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    max_inflight = 2 * threads
    budget = BATCH_BYTES if max_inflight_bytes is None else max_inflight_bytes
    step_rel = step_dir_name(manifest.step)
    bb = manifest.block_bytes
    sized: set[str] = set()  # files whose size was checked against the manifest
    if ring is None:
        ring = ReadRing()

    def requests_of(batch: ReadBatch) -> list[_Request]:
        by_file: dict[str, list[ReadItem]] = {}
        for it in batch.items:
            by_file.setdefault(it.chunk.file, []).append(it)
        requests: list[_Request] = []
        for file, file_items in sorted(by_file.items()):
            rel = f"{step_rel}/{file}"
            if file not in sized:
                check_file_sizes(storage, manifest, [file], files)
                sized.add(file)
            staged, file_requests = [], []
            for it in file_items:
                entry = manifest.tensors[it.key]
                target = _direct_target(it, entry, batch.dests[it.key]) if place else None
                if target is not None:
                    file_requests.append((rel, it.span, [it], target))
                else:
                    staged += _split(it, piece_bytes, dtype_info(entry.dtype).itemsize, bb)
            file_requests += [(rel, r, group, None) for r, group in _coalesce(staged, piece_bytes)]
            requests += sorted(file_requests, key=lambda r: r[1])
        if ring.idle:  # size the ring for what can be in flight (slabs keep reads near piece_bytes)
            staged_sizes = [b - a for _, (a, b), _, target in requests if target is None]
            depth = min(budget, sum(staged_sizes), max_inflight * piece_bytes)
            ring.reserve(max([depth, *staged_sizes]))
        return requests

    def fetch(
        v: _Verifier, rel: str, a: int, p0: int, p1: int, group: list[ReadItem], mv: memoryview
    ) -> None:
        """Read bytes [p0, p1) of a request starting at ``a`` into its place, and verify them."""
        reader = storage if files is None else files
        got = reader.read_into(rel, p0, mv[p0 - a : p1 - a])
        if got != p1 - p0:
            raise CheckpointCorruptError(
                f"{storage.display(rel)} (step {manifest.step}): read of bytes [{p0}, {p1}) "
                f"returned {got} bytes; the file is truncated — load an earlier step"
            )
        if not verify:
            return
        for it in group:
            s0, s1 = max(it.span[0], p0), min(it.span[1], p1)
            if s0 < s1:
                v.check(it.key, it.chunk, (s0, s1), mv[s0 - a : s1 - a])

    source = iter(batches)
    queued: deque[tuple[_Batch, _Request]] = deque()  # issued in this order, not yet in flight
    inflight: deque[tuple[_Batch, _Request, memoryview, list[Future[None]]]] = deque()
    more, open_batches = True, 0
    with ThreadPoolExecutor(threads, thread_name_prefix="resilient-read") as pool:
        try:
            while True:
                while len(inflight) < max_inflight:
                    if not queued:
                        if open_batches >= max_open_batches:
                            break  # the source may be waiting on memory only done() gives back
                        nb = next(source, None) if more else None
                        if nb is None:
                            more = False
                            break
                        batch = _Batch(nb, requests_of(nb), _Verifier(manifest, storage))
                        open_batches += 1
                        queued.extend((batch, r) for r in batch.requests)
                        if not batch.requests:  # nothing to read: it still finishes in its turn
                            queued.append((batch, None))
                            batch.left = 1
                        continue
                    batch, req = queued[0]
                    if req is None:  # an empty batch: nothing to read, only its turn to finish
                        inflight.append((batch, None, memoryview(b""), []))
                        queued.popleft()
                        continue
                    rel, (a, b), group, target = req
                    region = target
                    if region is None:
                        region = ring.take(b - a)
                        if region is None and not inflight:  # larger than the ring: grow it
                            ring.reserve(b - a)
                            region = ring.take(b - a)
                        if region is None:
                            break
                    futs = [
                        pool.submit(fetch, batch.verifier, rel, a, p0, p1, group, region)
                        for p0, p1 in _pieces(a, b, group, bb, piece_bytes)
                    ]
                    inflight.append((batch, req, region, futs))
                    queued.popleft()
                if not inflight:
                    break
                batch, req, mv, futs = inflight[0]
                for f in futs:
                    f.result()
                inflight.popleft()
                if req is not None:
                    rel, (a, b), group, target = req
                    batch.stats.bytes_read += b - a
                    batch.stats.num_requests += 1
                    if target is None:
                        for it in group if place else ():
                            piece = mv[it.span[0] - a : it.span[1] - a]
                            entry = manifest.tensors[it.key]
                            _place(it, piece, entry, batch.batch.dests[it.key], manifest.step)
                        ring.release()
                    else:
                        batch.stats.bytes_direct += b - a
                batch.left -= 1
                if batch.left == 0:
                    open_batches -= 1
                    batch.finish()
        except BaseException:
            futs = [f for *_, fs in inflight for f in fs]
            for f in futs:
                f.cancel()
            for f in futs:  # a reader still filling the ring must finish before it is reused
                if not f.cancelled():
                    f.exception()
            ring.clear()
            raise


def _pieces(
    a: int, b: int, group: list[ReadItem], block: int, piece_bytes: int | None = None
) -> list[tuple[int, int]]:
    """Cut the read [a, b) into pieces of about ``piece_bytes`` that reader threads fetch and
    verify concurrently; every cut falls on a block boundary of the stored chunk it lies in, so
    each piece verifies on its own."""
    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    if b - a <= piece_bytes:
        return [(a, b)]
    chunks = sorted({it.chunk.byte_range for it in group})
    out, pos = [], a
    while b - pos > piece_bytes:
        want = pos + piece_bytes
        c0, c1 = next(((c0, c1) for c0, c1 in chunks if c0 <= want < c1), (want, want))
        cut = c0 + (want - c0) // block * block if c1 > c0 else want
        if cut <= pos:
            cut = min(c0 + -(-(want - c0) // block) * block, c1)
        if cut >= b:
            break
        out.append((pos, cut))
        pos = cut
    out.append((pos, b))
    return out


def _coalesce(
    items: list[ReadItem], cap: int | None = None
) -> list[tuple[tuple[int, int], list[ReadItem]]]:
    """Merge the spans of one file into reads: overlapping spans always (they share a block),
    touching ones while the read stays within ``cap`` bytes (no limit without one)."""
    out: list[tuple[tuple[int, int], list[ReadItem]]] = []
    for it in sorted(items, key=lambda i: i.span):
        if out:
            (a, b), group = out[-1]
            s0, s1 = it.span
            if s0 < b or (s0 == b and (cap is None or max(b, s1) - a <= cap)):
                out[-1] = ((a, max(b, s1)), group)
                group.append(it)
                continue
        out.append((it.span, [it]))
    return out


def _run_start(inner: Box, outer: Box) -> int | None:
    """The flat (row-major) index in ``outer`` where ``inner`` starts, if ``inner`` is one
    contiguous run of it: leading dims of size 1, then one partial dim, then only full dims."""
    k = next((i for i, n in enumerate(inner.sizes) if n != 1), len(inner.sizes) - 1)
    if any(inner.sizes[j] != outer.sizes[j] for j in range(k + 1, len(outer.sizes))):
        return None
    strides = _strides(outer.sizes)
    return sum((o - oo) * st for o, oo, st in zip(inner.offsets, outer.offsets, strides))


def _direct_target(it: ReadItem, entry: TensorEntry, dest: torch.Tensor) -> memoryview | None:
    """The destination's own memory for an item that can be read straight into it: uncompressed,
    one contiguous run in the stored chunk whose block-aligned span is exactly that run, and one
    contiguous run of a contiguous CPU destination."""
    c, ov = it.chunk, it.overlap
    if c.codec != "none" or ov.numel == 0 or dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    s0, d0 = _run_start(ov, it.src_box), _run_start(ov, it.dst_box)
    if s0 is None or d0 is None:
        return None
    itemsize = dtype_info(entry.dtype).itemsize
    n = ov.numel * itemsize
    if (c.byte_range[0] + s0 * itemsize, c.byte_range[0] + s0 * itemsize + n) != it.span:
        return None  # the span holds bytes of other rows: they would land in the destination
    flat = dest.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat[d0 * itemsize : d0 * itemsize + n].numpy())


def _split(it: ReadItem, cap: int, itemsize: int, block: int) -> list[ReadItem]:
    """An item whose span exceeds ``cap`` as several, each a slab of its overlap along the outermost
    dim it spans, with its own (block-aligned) span: reads that can be placed, and their memory
    reused, one slab at a time instead of all at once."""
    if it.span[1] - it.span[0] <= cap or it.chunk.codec != "none":
        return [it]
    ov = it.overlap
    d = next((i for i, n in enumerate(ov.sizes) if n > 1), None)
    if d is None:
        return [it]
    n = ov.sizes[d]
    step = -(-n // min(n, -(-(it.span[1] - it.span[0]) // cap)))
    out = []
    for lo in range(0, n, step):
        offsets = ov.offsets[:d] + (ov.offsets[d] + lo,) + ov.offsets[d + 1 :]
        sizes = ov.sizes[:d] + (min(step, n - lo),) + ov.sizes[d + 1 :]
        sub = Box(offsets, sizes)
        span = _span(it.chunk, it.src_box, sub, itemsize, block)
        out.append(ReadItem(it.key, it.chunk, it.src_box, it.dst_box, sub, span))
    return out


def _place(
    it: ReadItem, data: memoryview, entry: TensorEntry, dest: torch.Tensor, step: int
) -> None:
    info = dtype_info(entry.dtype)
    c = it.chunk
    if c.codec != "none":
        try:
            raw = decompress(bytes(data), c.raw_bytes, info.itemsize, c.codec == "zstd+bytegroup")
        except Exception as e:
            raise CheckpointCorruptError(
                f"tensor {it.key!r} in {c.file} (step {step}) does not decompress ({e}); the file is "
                f"corrupt — load an earlier step"
            ) from None
        data = memoryview(raw)
        first_elem = 0
    else:
        first_elem = (it.span[0] - c.byte_range[0]) // info.itemsize
    if len(data):
        with warnings.catch_warnings():  # read-only bytes: we only ever read from this view
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8).view(info.torch_dtype)
    else:
        flat = torch.empty(0, dtype=info.torch_dtype)
    src_st = _strides(it.src_box.sizes)
    rel = [o - so for o, so in zip(it.overlap.offsets, it.src_box.offsets)]
    src = flat.as_strided(
        it.overlap.sizes, src_st, sum(r * s for r, s in zip(rel, src_st)) - first_elem
    )
    dst_full = dest.view(it.dst_box.sizes) if dest.is_contiguous() else None
    if dst_full is None:
        raise LayoutError(
            f"tensor {it.key!r}: cannot load into a non-contiguous tensor; call .contiguous() first"
        )
    drel = [o - do for o, do in zip(it.overlap.offsets, it.dst_box.offsets)]
    dst = dst_full
    for d, (o, n) in enumerate(zip(drel, it.overlap.sizes)):
        dst = dst.narrow(d, o, n)
    with torch.no_grad():
        dst.copy_(src)


# --- full verification -------------------------------------------------------------------------


@dataclass
class VerifyReport:
    step: int
    files_checked: int
    bytes_checked: int
    tensors: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def bytes_to_verify(manifest: Manifest) -> int:
    """How many bytes :func:`verify_step` checksums for ``manifest`` (what its ``progress`` adds
    up to, for a progress bar's total): every chunk's byte range."""
    return sum(
        c.byte_range[1] - c.byte_range[0] for t in manifest.tensors.values() for c in t.chunks
    )


def verify_step(storage: Storage, step: int, *, progress=None) -> VerifyReport:
    """Read every byte of ``step``: manifest, file sizes, safetensors headers, every checksum.

    Streams each chunk in ranged reads of whole blocks (``VERIFY_READ_BYTES`` at most), which
    ``READ_THREADS`` threads read and checksum concurrently into a few reused buffers, so memory
    stays at one buffer per thread however large the files are.  Problems are collected (not
    raised) so one run reports all of them, in file order; ``progress(nbytes)`` is called as bytes
    are checked.
    """
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    before = _stat_or_none(storage, rel)
    if before is None:  # listed as committed a moment ago (or never there: the read says which)
        if _stat_or_none(storage, step_dir_name(step)) is not None:
            raise _retired(storage, step, None, "its manifest was gone when the read began")
    report = _verify(storage, step, progress)
    if not report.ok:  # problems because the step was retired while it was read are not damage
        after = _stat_or_none(storage, rel)
        if before is not None and after != before:
            raise _retired(storage, step, after, "; ".join(report.problems[:3]))
    return report


def _verify(storage: Storage, step: int, progress) -> VerifyReport:
    problems: list[str] = []
    try:
        m = read_manifest(storage, step)
    except (CheckpointCorruptError, StorageError) as e:
        return VerifyReport(step, 0, 0, 0, [str(e)])
    rel = step_dir_name(step)
    by_file: dict[str, list[tuple[str, ChunkEntry]]] = {f: [] for f in m.files}
    for key, t in m.tensors.items():
        for c in t.chunks:
            by_file[c.file].append((key, c))
    bb = m.block_bytes
    per_read = max(VERIFY_READ_BYTES // bb, 1) * bb
    largest = max(
        (c.byte_range[1] - c.byte_range[0] for t in m.tensors.values() for c in t.chunks), default=0
    )
    # (path, where, key, chunk, r0, r1): one ranged read of whole blocks, in file order
    reads: list[tuple[str, str, str, ChunkEntry, int, int]] = []
    checked = 0
    for file, chunks in sorted(by_file.items()):
        path = f"{rel}/{file}"
        where = storage.display(path)
        header = _check_file_header(storage, path, where, m.files[file].size_bytes, problems)
        if header is None:
            continue
        data_start, entries = header
        checked += data_start
        for key, c in sorted(chunks, key=lambda kc: kc[1].byte_range):
            h = entries.get(c.name)
            offsets = h.get("data_offsets") if isinstance(h, dict) else None
            if offsets is None or [data_start + offsets[0], data_start + offsets[1]] != list(
                c.byte_range
            ):
                problems.append(
                    f"{where}: safetensors header disagrees with the manifest for tensor {key!r}"
                )
                continue
            start, end = c.byte_range
            reads += [
                (path, where, key, c, r0, min(r0 + per_read, end))
                for r0 in range(start, end, per_read)
            ]

    # one buffer per read in flight, reused: read j goes into buffer j % n once read j - n is done
    n_bufs = min(READ_THREADS, len(reads)) or 1
    buffers = [
        _uninitialized(max(min(per_read, largest, VERIFY_READ_BYTES), 1)) for _ in range(n_bufs)
    ]

    def check(j: int) -> tuple[list[str], int]:
        """Read ``reads[j]`` (whole blocks) and checksum its blocks: (problems, bytes checked).
        A block larger than the buffer is read and checksummed in slices (crc32 carries over),
        so a manifest's huge ``block_bytes`` never sizes a buffer."""
        path, where, key, c, r0, r1 = reads[j]
        buf = buffers[j % n_bufs]
        start, end = c.byte_range
        out = []
        whole = r1 - r0 <= len(buf)  # the usual case: one read for the whole range
        if whole and storage.read_into(path, r0, buf[: r1 - r0]) != r1 - r0:
            return [f"{where}: read of bytes [{r0}, {r1}) came back short"], 0
        for i in range((r0 - start) // bb, -(-(r1 - start) // bb)):
            b0, b1 = start + i * bb, min(start + (i + 1) * bb, end)
            if whole:
                got = crc32(buf[b0 - r0 : b1 - r0])
                pos = b1
            else:
                got, pos = 0, b0
            while pos < b1:
                n = min(len(buf), b1 - pos)
                if storage.read_into(path, pos, buf[:n]) != n:
                    return [f"{where}: read of bytes [{pos}, {pos + n}) came back short"], 0
                got = crc32(buf[:n], got)
                pos += n
            if got != c.checksums[i]:
                out.append(
                    f"{where}: tensor {key!r} (step {step}) block {i} bytes [{b0}, {b1}): "
                    f"crc32 expected {c.checksums[i]:08x}, found {got:08x}"
                )
        return out, r1 - r0

    with ThreadPoolExecutor(n_bufs, thread_name_prefix="resilient-verify") as pool:
        inflight: deque[Future[tuple[list[str], int]]] = deque()
        for j in range(len(reads) + n_bufs):
            if len(inflight) == n_bufs or j >= len(reads):
                if not inflight:
                    break
                found, nbytes = inflight.popleft().result()
                problems += found
                checked += nbytes
                if progress is not None:
                    progress(nbytes)
            if j < len(reads):
                inflight.append(pool.submit(check, j))
    return VerifyReport(step, len(m.files), checked, len(m.tensors), problems)


def _check_file_header(
    storage: Storage, path: str, where: str, declared: int, problems: list[str]
) -> tuple[int, dict] | None:
    """The file's size against the manifest and its safetensors header: (data start, header), or
    None after noting the problem."""
    try:
        size = storage.size(path)
        if size != declared:
            problems.append(f"{where}: {size} bytes, manifest declares {declared}")
            return None
        prefix = storage.read_range(path, 0, min(size, 8))
        header_len = int.from_bytes(prefix[:8], "little") if len(prefix) == 8 else -1
        if not 0 <= header_len <= min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
            problems.append(
                f"{where}: not a valid safetensors file (header length {header_len}; at most "
                f"{min(size - 8, MAX_SAFETENSORS_HEADER_BYTES)} here)"
            )
            return None
        return parse_safetensors_header(prefix + storage.read_range(path, 8, 8 + header_len))
    except CheckpointCorruptError:
        raise
    except Exception as e:
        problems.append(f"{where}: cannot be read as a safetensors file ({type(e).__name__}: {e})")
        return None
