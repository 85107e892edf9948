"""The memory tier's lean snapshot path: stage straight into the rank file on the tmpfs, and reuse
the file of the snapshot that is about to be retired.

A durable save stages into a CPU buffer and writes it out in the background.  On the node's
shared memory that is two copies of every byte, and the write lands in fresh tmpfs pages, which
the kernel allocates and zeroes at about 2 GiB/s, several times slower than a copy.  Here the
snapshot is copied once, into a rank file that is already laid out and mapped:

* The file is a plain rank file of the checkpoint format (docs/FORMAT.md section 2).  Its
  safetensors header is padded with spaces to a page, sized for the largest step number, so the
  data section starts at the same page-aligned offset at every step and the header of the next
  step overwrites the last one in place.
* A rank keeps its two newest committed snapshot files mapped.  The next snapshot takes the
  older one (the step that this snapshot's commit retires anyway) when it has the same layout and
  nothing else links it (the persister pins a step it writes out by a hard link), renames it to
  the rank's staging name, and copies the state into the pages it already has.  Otherwise a fresh
  file is made, with every page allocated up front (``posix_fallocate``), so that a full tmpfs is
  an error here and never a SIGBUS in the middle of a copy.
* A large plain tensor is copied in pieces of half a megabyte, each checksummed right after its
  copy, while it is still in the core's cache (``_copy_summed``), on as many threads as torch
  copies with.  Copying is bound by memory bandwidth; the checksums then read no memory of their
  own, so the stall stays about one bare copy, and the background has no pass over the bytes
  left: the next snapshot, staged while this one commits, does not share the memory bus with it.
  Small tensors (and tensor subclasses) are copied in one batched call and checksummed in the
  background.
* In the background the checksums still missing are computed from the mapped data and the file
  is renamed into the step's directory under the name the commit expects; the commit itself is
  the usual one.

So at any time a rank holds its two newest committed snapshots, or the newest one and the one
being staged; a crash while staging leaves the older step with a missing file (its checksums
refuse it: the newer one is restored) and the staging file, which the next run of the same rank
reuses.

Once a snapshot's copy is complete, the rank writes its *staged record* next to the staging files
(``rank_<R>.step_<S>.json``: what its commit report will say, less the checksums; seal.py), and
removes it when the save is over.  Should the commit be cut short (the job killed in between), the
persister's flush or the next load finishes it from the records, so that a fault loses at most one
step.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from resilient.checkpoint.codec import (
    CRC_THREADS,
    block_checksums,
    crc32,
    crc32_of,
    crc_pool,
    safetensors_header,
)
from resilient.checkpoint.format import ChunkEntry, TensorEntry, dtype_info
from resilient.checkpoint.lease import _machine, _process_start
from resilient.checkpoint.seal import RECORD_FORMAT, record_name
from resilient.checkpoint.snapshots import STAGING_DIR, RankHold
from resilient.checkpoint.state import TensorLeaf
from resilient.checkpoint.storage import fs_type
from resilient.checkpoint.writer import (
    PersistResult,
    WritePlan,
    chunks_static,
    rank_file_metadata,
)
from resilient.errors import MemoryTierError
from resilient.layout import Layout

log = logging.getLogger(__name__)
__all__ = ["STAGING_DIR", "Slots", "StagedInfo"]

_PAGE = 4096
_MAX_STEP = str(2**63 - 1)  # the widest step number a header must have room for
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# copied and then checksummed while still in the core's cache (L2 holds it); measured on 2 cores:
# 2 threads 36 ms for 0.5 GiB against 38 ms for torch's bare copy, 4 MiB pieces 43 ms
_PIECE = 512 << 10
_LONG_VALUE = 512  # characters: a string value whose JSON text a record reuses (_values_text)
_FUSE_MIN = 256 << 10  # smaller tensors: one batched copy, checksummed in the background


@dataclass(frozen=True)
class StagedInfo:
    """What a staged record says besides the plan (seal.py)."""

    layout: Layout
    values: Mapping[str, object]
    job_id: str
    block_bytes: int


class _Slot:
    """One rank file on the tmpfs, open and mapped."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, key: tuple, prefix: int) -> None:
        self.path, self.fd, self.mm, self.key, self.prefix = path, fd, mm, key, prefix
        self.size = len(mm)
        self.ino = os.fstat(fd).st_ino
        self.record: tuple[str, int] | None = None  # its staged record (path, inode), while
        # its save is not over, or while it is a sealed snapshot
        self.record_text = ""  # what the record says (release() rewrites it)
        # a sealed snapshot (its copy and record complete, its commit deferred: see seal()):
        # what committing it takes (the step, the layout, the plan, the values)
        self.sealed: tuple | None = None
        self.sums: dict[str, tuple[int, ...]] = {}  # the checksums taken while copying, by key
        self._views: tuple[WritePlan, list[torch.Tensor]] | None = None
        # page-locked for the GPU (cudaHostRegister: _pin): the mapping's address, else 0
        self.pinned = 0
        self.pin_device = -1  # the device current when it was page-locked
        self.pin_tried = False

    def data(self) -> torch.Tensor:
        # through numpy: a view of it is an export of the mapping's buffer, so close() cannot
        # unmap it under a tensor that still views it (torch.frombuffer holds a reference only,
        # and reading such a tensor after close() was a segfault: a traceback's repr did)
        return torch.from_numpy(np.frombuffer(self.mm, dtype=np.uint8, offset=self.prefix))

    def views(self, plan: WritePlan) -> list[torch.Tensor]:
        """Each of ``plan``'s chunks as a tensor over its bytes in the file (made once per plan:
        three view calls per chunk cost more than copying a small one)."""
        if self._views is None or self._views[0] is not plan:
            self._views = None
            data = self.data()
            views = [
                data[it.begin : it.end].view(dtype_info(it.dtype).torch_dtype).view(it.local_shape)
                for it in plan.items
            ]
            self._views = (plan, views)
        return self._views[1]

    def reusable(self) -> bool:
        """Still at its path, and linked nowhere else (not pinned for a persister)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_ino == self.ino and st.st_nlink == 1

    def close(self) -> None:
        self._views = None
        if self.pinned:  # before the mapping goes
            _unpin(self.pinned, self.pin_device, self.path)
            self.pinned = 0
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()  # a view still exported keeps the mapping until it is freed
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Slots:
    """(one rank of the memory tier) Where its snapshots are staged, and which files it reuses."""

    def __init__(
        self, job_dir: str, steps_dir: str, rank: int, hold: RankHold | None = None
    ) -> None:
        self.steps_dir = steps_dir
        # this process's lock on the rank's files (snapshots.MemoryPlace.hold), let go at close
        self.hold = hold
        self.rank = rank
        self.staging = os.path.join(job_dir, STAGING_DIR)
        # three names: a snapshot committing, the next one being staged, and the spare.  What a
        # crashed run of this rank left there is kept until this run needs the name (seal.py may
        # finish its snapshot first) and then replaced; never another rank's.
        self.names = tuple(
            os.path.join(self.staging, f"rank_{rank:05d}.{k}.safetensors") for k in range(3)
        )
        self._me = (os.getpid(), _process_start(os.getpid()), _machine())
        # (rank 0) the job's run that stages here (snapshots.number_this_run; 0: not counted):
        # a seal numbers the step as that run's commit
        self.job_run = 0
        # (rank 0) the newest commit order in this node's memory when this process's line began
        # (its start, its last load): a commit numbered above it, of the same step or a later
        # one, is what makes a staged record void; the abandoned line's after a rollback is not
        self.line_base = 0
        self._fresh_run = True  # a crashed run's staging files go at the first snapshot
        self._record_static: tuple[WritePlan, int, str] | None = None
        # the text of each long string value in the previous record, by the string itself: an
        # RNG state that has not moved is the same object from one snapshot to the next
        self._value_texts: dict[str, tuple[str, str]] = {}
        self._record_failed = False
        # this rank's two newest snapshots, oldest first: committed files (in their step's
        # directory) or sealed ones (at a staging name, with their staged record)
        self._committed: deque[_Slot] = deque()
        self._staged: list[_Slot] = []  # staged and not settled yet, oldest first
        self._spare: _Slot | None = None  # a retired snapshot's file, kept for the next one
        self._lock = threading.Lock()  # the caller stages while a background thread settles
        self._template: _HeaderTemplate | None = None  # the header's room and text, per plan
        # what its commit reports say of its chunks but the checksums (writer.chunks_static), per
        # plan, header size and file name: (plan, prefix, file, text)
        self._report_static: tuple[WritePlan, int, str, str] | None = None
        self.reused = 0  # snapshots staged into a reused file (for tests and benchmarks)

    def stage(
        self,
        plan: WritePlan,
        leaves: Mapping[str, TensorLeaf],
        step: int,
        record: StagedInfo | None = None,
        block_bytes: int | None = None,
        sum_all: bool = False,
        fits: bool = False,
        gpu: bool = False,
    ) -> _Slot:
        """Copy this rank's chunks into a laid-out rank file at a staging name (the caller's
        thread: this is the snapshot's stall), then write its staged record when ``record`` says
        what goes in it.  At most one earlier snapshot may be unsettled.  With ``block_bytes``
        the large tensors' checksums (blocks of that size) are taken as they are copied, and
        with ``sum_all`` the others' right after, and the record carries them all (a sealed
        snapshot's: seal.py checks its file against them).  ``fits``: the leaves are known to be
        those the plan was made of, unchanged (no need to check each against its place).
        ``gpu``: some leaves are on a GPU; they are copied straight into the file, whose mapping
        is page-locked for it once (_pin), and the copy is complete when this returns."""
        if record is not None:  # a record of this step from before a rollback is void from here
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.staging, record_name(self.rank, step)))
        if self._fresh_run:  # what a crashed run of this rank left, sealed or not by now
            self._fresh_run = False
            for name in self.names:
                with contextlib.suppress(OSError):
                    os.unlink(name)
        template = self._template
        if template is None or template.plan is not plan:
            self._template = template = _HeaderTemplate(plan)
        prefix = template.prefix
        header = template.text(step)
        key = (plan.digest, plan.rank, plan.data_bytes, prefix)
        with self._lock:
            slot, self._spare = self._spare, None
            if slot is None and len(self._committed) >= 2:
                # the older of two committed snapshots is retired by this snapshot's commit
                slot = self._take(self._committed.popleft())
            if slot is not None and slot.key != key:  # another layout: a file of its own
                self._discard(slot)
                slot = None
            if slot is None:
                slot = self._fresh(
                    self._free_name(),
                    key,
                    prefix + plan.data_bytes,
                    prefix,
                )
            else:
                self.reused += 1
            self._staged.append(slot)
        try:
            if gpu and not slot.pin_tried:
                _pin(slot)
            mm = slot.mm
            mm[:8] = struct.pack("<Q", prefix - 8)
            end = 8 + len(header)
            mm[8:end] = header
            mm[end:prefix] = b" " * (prefix - end)
            slot.sums = {}
            if plan.data_bytes:
                with torch.no_grad():
                    views, srcs = slot.views(plan), [leaves[it.key].local for it in plan.items]
                    if not fits:  # (the caller knows these leaves are the plan's own)
                        _check_fit(views, srcs)
                    fused = (
                        _fusable(plan, srcs, block_bytes, template.large)
                        if block_bytes is not None
                        else {}
                    )
                    if fused:
                        assert block_bytes is not None
                        slot.sums = _copy_summed(slot, plan, fused, block_bytes)
                    rest = [i for i in range(len(srcs)) if i not in fused]
                    if rest and gpu:
                        _copy_from_devices([views[i] for i in rest], [srcs[i] for i in rest])
                    elif rest:
                        _copy([views[i] for i in rest], [srcs[i] for i in rest])
                if sum_all and block_bytes is not None:  # (a GPU state's on the crc threads)
                    _sum_rest(slot, plan, block_bytes, template.small(block_bytes), parallel=gpu)
        except BaseException:
            self.settled(slot, False)  # half-written: the spare, never a snapshot
            raise
        if record is not None:
            self._write_record(slot, plan, prefix, step, record)
        return slot

    def _write_record(
        self, slot: _Slot, plan: WritePlan, prefix: int, step: int, info: StagedInfo
    ) -> None:
        """The staged record of a complete copy (seal.py); a failure costs only the seal."""
        try:
            if self._record_static is None or self._record_static[:2] != (plan, prefix):
                self._record_static = (plan, prefix, self._static(plan, prefix, info))
            sums = (
                f'"sums": {json.dumps(slot.sums)}, '
                if len(slot.sums) == len(plan.items) and plan.items
                else ""
            )
            text = (
                f'{{"step": {step}, "after": {self.line_base}, "ino": {slot.ino}, '
                f'"path": {json.dumps(os.path.basename(slot.path))}, '
                f'"values": {self._values_text(info.values)}, {sums}'
                f"{self._record_static[2]}}}"
            )
            final = os.path.join(self.staging, record_name(self.rank, step))
            ino = self._replace_record(final, text.encode())
            slot.record, slot.record_text = (final, ino), text
        except (OSError, ValueError, TypeError) as e:
            if not self._record_failed:
                log.warning("could not write the staged record of snapshot %d: %s", step, e)
                self._record_failed = True

    def _values_text(self, values: Mapping[str, Any]) -> str:
        """``json.dumps(values, allow_nan=False)``, but a long string value (an RNG state, 3 to
        7 KB of base64: escaping one costs microseconds per KB) that is the very object of the
        previous record's is not encoded again."""
        long = {k: v for k, v in values.items() if type(v) is str and len(v) >= _LONG_VALUE}
        if not long:
            self._value_texts = {}
            return json.dumps(values, allow_nan=False)
        texts: dict[str, tuple[str, str]] = {}
        for k, v in long.items():
            hit = self._value_texts.get(k)
            texts[k] = hit if hit is not None and hit[0] is v else (v, json.dumps(v))
        self._value_texts = texts
        parts: list[str] = []
        run: dict[str, Any] = {}  # (the values between two long ones, in one call, in order)
        for k, v in values.items():
            if k in texts:
                if run:
                    parts.append(json.dumps(run, allow_nan=False)[1:-1])
                    run = {}
                parts.append(f"{json.dumps(k)}: {texts[k][1]}")
            else:
                run[k] = v
        if run:
            parts.append(json.dumps(run, allow_nan=False)[1:-1])
        return "{" + ", ".join(parts) + "}"

    def _replace_record(self, final: str, data: bytes) -> int:
        """Put ``data`` at ``final`` whole (a temporary file renamed over it); its inode."""
        tmp = os.path.join(self.staging, f"rank_{self.rank:05d}.record.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return ino

    def _static(self, plan: WritePlan, prefix: int, info: StagedInfo) -> str:
        """What every staged record of this plan says: the JSON members without braces."""
        chunks = {
            it.key: ChunkEntry(
                offsets=it.offsets,
                sizes=it.sizes,
                file="",
                name=it.key,
                byte_range=(prefix + it.begin, prefix + it.end),
                checksums=(),
                codec="none",
                raw_bytes=it.end - it.begin,
            ).to_json()
            for it in plan.items
        }
        tensors = {
            k: TensorEntry(dtype=d, shape=s, placement=p, chunks=()).to_json()
            for k, (d, s, p) in plan.tensors.items()
        }
        static = {
            "format": RECORD_FORMAT,
            "rank": self.rank,
            "world": info.layout.world_size,
            "pid": self._me[0],
            "start": self._me[1],
            "machine": self._me[2],
            "run": _run_id(),
            "job_run": self.job_run,
            "size": prefix + plan.data_bytes,
            "block_bytes": info.block_bytes,
            "job_id": info.job_id,
            "digest": plan.digest,
            "layout": info.layout.to_json(),
            "tensors": tensors,
            "chunks": chunks,
        }
        return json.dumps(static, allow_nan=False)[1:-1]

    def persist(
        self, slot: _Slot, step_rel: str, file: str, plan: WritePlan, block_bytes: int
    ) -> PersistResult:
        """(background) Checksum the staged file and move it into the step's directory; keep
        the file of the snapshot this one retires as the spare, before the commit deletes it."""
        t0 = time.monotonic()
        view = memoryview(slot.mm)[slot.prefix :]
        try:
            chunks = {
                it.key: ChunkEntry(
                    offsets=it.offsets,
                    sizes=it.sizes,
                    file=file,
                    name=it.key,
                    byte_range=(slot.prefix + it.begin, slot.prefix + it.end),
                    checksums=slot.sums.get(it.key)
                    or tuple(block_checksums(view[it.begin : it.end], block_bytes, parallel=False)),
                    codec="none",
                    raw_bytes=it.end - it.begin,
                )
                for it in plan.items
            }
        finally:
            view.release()
        cached = self._report_static
        if cached is None or cached[0] is not plan or cached[1:3] != (slot.prefix, file):
            self._report_static = cached = (plan, slot.prefix, file, chunks_static(chunks))
        dest = os.path.join(self.steps_dir, step_rel, file)
        os.replace(slot.path, dest)
        slot.path = dest
        with self._lock:
            if self._spare is None and len(self._committed) >= 2:
                self._spare = self._take(self._committed.popleft())
        return PersistResult(file, slot.size, chunks, time.monotonic() - t0, static=cached[3])

    def settled(self, slot: _Slot, committed: bool) -> None:
        """A staged snapshot's save is over: keep its file for reuse when it was committed."""
        with self._lock:
            self._settle(slot, committed)

    def _settle(self, slot: _Slot, committed: bool) -> None:
        if slot not in self._staged:
            return
        self._staged.remove(slot)
        self._drop_record(slot)  # its save is over: nothing is left to seal
        if committed and slot.path not in self.names:
            self._committed.append(slot)
            while len(self._committed) > 2:  # retention retires the step: its file goes
                self._retire(self._committed.popleft())
        elif slot.path in self.names and self._spare is None:
            self._spare = slot  # staged, never committed: its file serves the next snapshot
        else:
            self._discard(slot)

    def seal(self, slot: _Slot, meta: tuple) -> bool:
        """A staged snapshot whose save ends with its copy: its staged record (stage()) stands
        for its commit.  It is kept, record and all, as one of the rank's two newest snapshots:
        a restore after a fault or the persister's flush commits it from the record (seal.py),
        and a durable save of its step commits it first (unseal()).  ``meta``: (step, layout,
        plan, values), what that commit takes.  False (and the slot let go) when it has no
        record: nothing could restore it."""
        with self._lock:
            if slot not in self._staged:
                return False
            if slot.record is None:
                self._settle(slot, False)
                return False
            self._staged.remove(slot)
            slot.sealed = meta
            self._committed.append(slot)
            while len(self._committed) > 2:  # (across nodes: sealed once its replica is in)
                old = self._committed.popleft()
                if self._spare is None and old.sealed is not None:
                    self._spare = self._take(old)  # (its record goes first)
                else:  # (a committed one's file stays in its step for retention to delete)
                    self._retire(old)
            return True

    def unseal(self, slot: _Slot) -> bool:
        """Take a sealed snapshot back to be committed now (persist(), then settled()); False
        when it is no longer held (a newer snapshot took its file, or release() let it go)."""
        with self._lock:
            if slot.sealed is None or slot not in self._committed:
                return False
            self._committed.remove(slot)
            slot.sealed = None
            self._staged.append(slot)
            return True

    def release(self) -> list[str]:
        """Let go of the sealed snapshots, file and record left for seal.py: each record is
        rewritten as its writer's last word (``pid`` 0: a writer that is gone), so that a
        restore or a flush may commit it while this process still runs.  It never touches them
        again.  Returns their paths."""
        kept: list[str] = []
        with self._lock:
            sealed = [x for x in self._committed if x.sealed is not None]
            for slot in sealed:
                self._committed.remove(slot)
                slot.sealed = None
                if slot.record is not None:
                    try:
                        rec = json.loads(slot.record_text)
                        rec["pid"] = 0  # (no process has it: seal.writer_alive)
                        self._replace_record(slot.record[0], json.dumps(rec).encode())
                        kept.append(slot.path)
                    except (OSError, ValueError) as e:
                        log.warning("could not release the staged record %s: %s", slot.record[0], e)
                slot.record = None
                slot.close()
        return kept

    def _drop_record(self, slot: _Slot) -> None:
        if slot.record is not None:
            path, ino = slot.record
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == ino:  # (not a later snapshot's of the same step)
                    os.unlink(path)
            slot.record = None

    def _retire(self, slot: _Slot) -> None:
        """One of the two newest snapshots no more: a committed file stays for retention to
        delete; a sealed one goes with its record."""
        if slot.sealed is not None:
            slot.sealed = None
            self._drop_record(slot)
            self._discard(slot)
        else:
            slot.close()

    def _free_name(self) -> str:
        """(under the lock) A staging name no file of this run's is at."""
        busy = {x.path for x in (*self._staged, *self._committed)}
        if self._spare is not None:
            busy.add(self._spare.path)
        for name in self.names:
            if name not in busy:
                return name
        raise MemoryTierError(f"every staging name of rank {self.rank} is taken; this is a bug")

    def _discard(self, slot: _Slot) -> None:
        """Close a slot; its file goes too when it is at a staging name (nothing else has it)."""
        slot.close()
        if slot.path in self.names:
            with contextlib.suppress(OSError):
                os.unlink(slot.path)

    def _take(self, old: _Slot) -> _Slot | None:
        """(under the lock) Move a committed snapshot's file to a free name, to be overwritten;
        None (and the file left alone) when something else links it or it is gone."""
        taken = None
        if old.sealed is not None:
            # its record goes first: from here on a fault restores the other snapshot, never
            # this file half overwritten; then it is reused where it is, if it is still there
            old.sealed = None
            self._drop_record(old)
            if old.reusable() and old.path in self.names:
                return old
            self._discard(old)
            return None
        if old.reusable():
            name = self._free_name()
            try:
                os.replace(old.path, name)
                old.path = name
                # a persister that linked it just before the move holds it now: its bytes stay
                # as they are, and this name is given up
                if os.fstat(old.fd).st_nlink == 1:
                    taken = old
                else:
                    os.unlink(name)
            except OSError:
                pass
        if taken is None:
            old.close()
        return taken

    def close(self) -> None:
        """Let every file go: the sealed snapshots are released (kept for a flush or the next
        run to commit: release()), the other staging files removed."""
        kept = self.release()
        with self._lock:
            while self._staged:
                self._settle(self._staged[0], False)
            for slot in (*self._committed, *((self._spare,) if self._spare else ())):
                slot.close()
            self._committed.clear()
            self._spare = None
            for name in self.names:
                if name not in kept:
                    with contextlib.suppress(OSError):
                        os.unlink(name)
        if self.hold is not None:  # (last: its files are let go of; its name goes with it)
            self.hold.close(remove=True)

    @staticmethod
    def _header(plan: WritePlan, step: int | str) -> bytes:
        return safetensors_header(
            [
                (it.key, dtype_info(it.dtype).safetensors, it.local_shape, it.begin, it.end)
                for it in plan.items
            ],
            rank_file_metadata(step),  # type: ignore[arg-type]
        )

    def _fresh(self, staging: str, key: tuple, size: int, prefix: int) -> _Slot:
        """A new file at the staging name (a crashed run's leftover is replaced), every page
        allocated now: a tmpfs with no room left fails here, not with a SIGBUS mid-copy."""
        fd = -1
        try:
            os.makedirs(os.path.dirname(staging), mode=0o700, exist_ok=True)
            try:
                os.unlink(staging)
            except FileNotFoundError:
                pass
            except IsADirectoryError:  # (not room: nothing frees it but its removal)
                raise MemoryTierError(
                    f"rank {self.rank}'s staging name {staging} is a directory; expected a rank "
                    f"file of the memory tier or nothing: remove it (this rank's snapshots fail "
                    f"until then; the durable saves still protect the run)"
                ) from None
            fd = os.open(
                staging,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                0o600,
            )
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(staging)
            raise MemoryTierError(
                f"cannot make room for a {size}-byte snapshot at {staging}: {e}; give the node "
                f"more shared memory, or snapshot less state"
            ) from e
        return _Slot(staging, fd, mm, key, prefix)


class _HeaderTemplate:
    """What a plan's snapshots share: the room of its header (sized for the largest step number,
    page-aligned), its safetensors header JSON (without its length and padding) around the step
    number, the one part that changes from one snapshot of the plan to the next (encoded once per
    plan: a JSON encode of every tensor's entry per snapshot otherwise), and the items large
    enough to copy in checksummed pieces."""

    _MARK = "\x00step\x00"

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan
        self.prefix = _round_up(len(Slots._header(plan, _MAX_STEP)), _PAGE)
        text = Slots._header(plan, self._MARK)[8:].rstrip(b" ")
        mark = json.dumps(self._MARK).encode()[1:-1]  # as the encoder writes it
        parts = text.split(mark)
        # a tensor key holding the mark would split elsewhere: such a plan is encoded each time
        self._parts = (parts[0], parts[1]) if len(parts) == 2 else None
        self.large = tuple(i for i, it in enumerate(plan.items) if it.end - it.begin >= _FUSE_MIN)
        self._small: dict[int, tuple[tuple[str, int, int], ...]] = {}

    def small(self, block_bytes: int) -> tuple[tuple[str, int, int], ...]:
        """The items never copied in pieces that fit one block: (key, begin, end) in the file."""
        out = self._small.get(block_bytes)
        if out is None:
            large, p = set(self.large), self.prefix
            out = self._small[block_bytes] = tuple(
                (it.key, p + it.begin, p + it.end)
                for i, it in enumerate(self.plan.items)
                if i not in large and 0 < it.end - it.begin <= block_bytes
            )
        return out

    def text(self, step: int) -> bytes:
        if self._parts is None:
            return Slots._header(self.plan, step)[8:].rstrip(b" ")
        # (str(step), as the full encode writes it: an int subclass may print otherwise)
        return b"%s%s%s" % (self._parts[0], json.dumps(str(step))[1:-1].encode(), self._parts[1])


def _sum_rest(
    slot: _Slot,
    plan: WritePlan,
    block_bytes: int,
    small: tuple[tuple[str, int, int], ...],
    parallel: bool = False,
) -> None:
    """The checksums the copy did not take (the small tensors', and a GPU state's), from the
    mapped file: a chunk of one block (``small``, most of them) in one call; with ``parallel``
    the blocks of the others on the checksum threads, all of them in one batch (the caller is
    not one of those threads)."""
    view, sums, prefix = memoryview(slot.mm), slot.sums, slot.prefix
    try:
        for key, a, b in small:
            sums[key] = (crc32_of(view[a:b]),)
        if len(sums) == len(plan.items):
            return
        todo = [it.key for it in plan.items if it.key not in sums]
        spans: list[tuple[str, int, int]] = []  # (key, begin, end) of each block, in order
        for it in plan.items:
            if it.key not in sums:
                a, b = prefix + it.begin, prefix + it.end
                spans += [(it.key, x, min(x + block_bytes, b)) for x in range(a, b, block_bytes)]

        def one(span: tuple[str, int, int]) -> int:
            return crc32(view[span[1] : span[2]])

        values = (
            list(crc_pool().map(one, spans)) if parallel and len(spans) >= 4 else map(one, spans)
        )
        out: dict[str, list[int]] = {key: [] for key in todo}
        for (key, _, _), value in zip(spans, values):
            out[key].append(value)
        for key in todo:  # (an empty tensor has no block: no checksum)
            sums[key] = tuple(out[key])
    finally:
        view.release()


def _check_fit(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, src in zip(dests, srcs):
        if d.dtype != src.dtype or d.shape != src.shape:  # the plan is of this state: never
            raise MemoryTierError(
                f"a snapshot's {src.dtype} tensor of shape {list(src.shape)} does not fit its "
                f"place in the rank file ({d.dtype}, {list(d.shape)}); this is a bug"
            )


def _copy(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each source into its destination, in one call where torch has one."""
    if hasattr(torch, "_foreach_copy_") and all(
        type(src) is torch.Tensor or type(src) is torch.nn.Parameter for src in srcs
    ):
        torch._foreach_copy_(dests, srcs)
    else:  # a tensor subclass gets the copy_ it implements (and an older torch has no batch)
        for d, src in zip(dests, srcs):
            d.copy_(src)


def _copy_from_devices(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each source, some on a GPU, into its destination in host memory: the device's copies
    queued on its current stream (after the kernels that computed the state), then waited for,
    so that the bytes are in place when this returns (into page-locked memory the copy engine
    writes them directly; into pageable memory the driver copies through a bounce buffer)."""
    devices = set()
    try:
        for d, src in zip(dests, srcs):
            if src.is_cuda:
                devices.add(src.device)
                d.copy_(src, non_blocking=True)
            else:
                d.copy_(src)
    finally:  # also when one copy failed: none still writes into the file after this returns
        for device in devices:
            torch.cuda.current_stream(device).synchronize()


_PIN_WARNED = False
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable (hipHostRegisterPortable)


def _pin(slot: _Slot) -> None:
    """Page-lock ``slot``'s mapping for the GPU (``cudaHostRegister``; HIP's on ROCm), so that a
    device-to-host copy into the node's memory runs at the copy engine's speed (on an H200, 11 ms
    against 57 ms for the small preset's 543 MiB).  Best effort, once per file: where the driver
    refuses (a sandbox, a locked-memory limit), copies go through the driver's bounce buffer."""
    global _PIN_WARNED
    slot.pin_tried = True
    if not slot.size or not torch.cuda.is_available() or not _in_ram(slot.path):
        return  # (a file on a disk's filesystem cannot be: the driver refuses its pages)
    t = torch.frombuffer(slot.mm, dtype=torch.uint8)
    ptr = t.data_ptr()
    del t
    try:
        device = torch.cuda.current_device()
        # portable: page-locked for every device's context, not only the current one's
        rc = torch.cuda.cudart().cudaHostRegister(ptr, slot.size, _HOST_REGISTER_PORTABLE)
        ok = _code(rc) == 0
    except (AttributeError, RuntimeError, TypeError) as e:
        ok, rc = False, e
    if ok:
        slot.pinned, slot.pin_device = ptr, device
        return
    _clear_device_error()  # else torch reports it at its next kernel launch, as that kernel's
    if not _PIN_WARNED:
        _PIN_WARNED = True
        log.warning(
            "could not page-lock the memory tier's file %s for the GPU (%s): snapshots copy "
            "from the device through the driver's bounce buffer, several times slower; check "
            "`ulimit -l`",
            slot.path,
            rc,
        )


_RAM_FS = ("tmpfs", "hugetlbfs", "ramfs")


def _in_ram(path: str) -> bool:
    return fs_type(os.path.dirname(os.path.realpath(path))) in _RAM_FS


def _clear_device_error() -> None:
    """Reset the CUDA (HIP) runtime's last error after a call that failed (torch's binding of
    cudaHostRegister leaves it set, and torch's next kernel launch would raise it), through
    each runtime library this process loaded; nothing where none can be found."""
    try:
        with open("/proc/self/maps") as f:
            paths = _runtime_libraries(f.read())
    except OSError:
        return
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = getattr(lib, "cudaGetLastError", None) or getattr(lib, "hipGetLastError", None)
        if fn is not None:
            fn()  # (the last error is per runtime and thread: each runtime loaded)


def _runtime_libraries(maps: str) -> list[str]:
    """The CUDA and HIP runtime libraries in /proc/self/maps' text, by path (which may hold
    spaces, or end in " (deleted)" when the file was replaced under the running process)."""
    paths = set()
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and ("/libcudart.so" in parts[5] or "/libamdhip64.so" in parts[5]):
            paths.add(parts[5].removesuffix(" (deleted)"))
    return sorted(paths)


def _unpin(ptr: int, device: int, path: str) -> None:
    """Undo ``_pin``, with its device current (this may run on a commit thread, whose current
    device is the first: the runtime would make a context there for nothing)."""
    try:
        with torch.cuda.device(device):
            rc = torch.cuda.cudart().cudaHostUnregister(ptr)
        if _code(rc) != 0:
            _clear_device_error()
            log.warning("could not release the page-lock of %s (%s)", path, rc)
    except (AttributeError, RuntimeError, TypeError) as e:
        log.warning("could not release the page-lock of %s (%s)", path, e)


def _code(rc: Any) -> int:
    """A CUDA error code from torch's binding (an enum, or an int)."""
    return int(getattr(rc, "value", rc))


def _fusable(
    plan: WritePlan, srcs: list[torch.Tensor], block_bytes: int, large: tuple[int, ...]
) -> dict[int, np.ndarray]:
    """The items that are copied and checksummed in pieces (large, plain, dense CPU tensors whose
    bytes numpy reads as they are), each with its bytes as a flat numpy array; ``large``: the
    indexes of the items of ``_FUSE_MIN`` bytes or more."""
    fused: dict[int, np.ndarray] = {}
    if block_bytes <= 0:
        return fused
    for i in large:
        it, src = plan.items[i], srcs[i]
        if not (
            (type(src) is torch.Tensor or type(src) is torch.nn.Parameter)
            and src.device.type == "cpu"
            and src.layout == torch.strided
            and src.is_contiguous()
            and not src.is_conj()
            and not src.is_neg()
        ):
            continue
        try:
            raw = src.detach().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError, ValueError):  # a kind numpy cannot read: torch copies it
            continue
        if raw.nbytes == it.end - it.begin:
            fused[i] = raw
    return fused


class _Jobs:
    """The blocks of one fused copy, each taken by whichever thread is free: the caller does
    every block no other thread has started, so the copy never waits behind other work queued on
    the checksum threads, and never deadlocks when called from one of them."""

    def __init__(self, jobs: list[tuple[str, int, np.ndarray, int, int]]) -> None:
        self.jobs = jobs
        self.errors: list[BaseException] = []
        self._next = 0
        self._halted = False
        self._active = 0  # helper threads inside the copy
        self._cv = threading.Condition()

    def take(self) -> tuple[str, int, np.ndarray, int, int] | None:
        with self._cv:
            if self._halted or self._next >= len(self.jobs):
                return None
            self._next += 1
            return self.jobs[self._next - 1]

    def enter(self) -> bool:
        with self._cv:
            if self._halted:
                return False
            self._active += 1
            return True

    def leave(self, error: BaseException | None) -> None:
        with self._cv:
            self._active -= 1
            if error is not None:
                self.errors.append(error)
                self._halted = True
            self._cv.notify_all()

    def halt_and_wait(self) -> None:
        """No block is taken from now on; returns once no helper is copying (an interrupt while
        waiting is raised after that: a helper writes into the file the caller gives up)."""
        interrupted: BaseException | None = None
        while True:
            try:
                with self._cv:
                    self._halted = True
                    while self._active:
                        self._cv.wait()
                break
            except BaseException as e:
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted


def _copy_summed(
    slot: _Slot, plan: WritePlan, raws: Mapping[int, np.ndarray], block_bytes: int
) -> dict[str, tuple[int, ...]]:
    """Copy the items ``raws`` holds (index into ``plan.items`` -> the source's bytes) into
    ``slot`` piece by piece, each piece checksummed right after its copy (the crc reads it from
    the cache, not from memory); returns every item's block checksums, as ``block_checksums`` of
    the file's bytes would give them.  Runs on as many threads as torch copies with, and returns
    (or raises) only once no thread copies any more."""
    dest = slot.mm
    jobs: list[tuple[str, int, np.ndarray, int, int]] = []  # key, block, source, at, size
    nblocks: dict[str, int] = {}
    for i in sorted(raws):
        it, raw = plan.items[i], raws[i]
        n = it.end - it.begin
        nblocks[it.key] = -(-n // block_bytes)
        for b, a in enumerate(range(0, n, block_bytes)):
            jobs.append((it.key, b, raw, slot.prefix + it.begin + a, min(n, a + block_bytes) - a))
    share = _Jobs(jobs)
    sums: dict[tuple[str, int], int] = {}

    def copy() -> None:
        out = piece = np.frombuffer(dest, dtype=np.uint8)
        try:
            while (job := share.take()) is not None:
                key, b, raw, at, size = job
                src0 = b * block_bytes
                value = 0
                for off in range(0, size, _PIECE):
                    m = min(size, off + _PIECE)
                    piece = out[at + off : at + m]
                    np.copyto(piece, raw[src0 + off : src0 + m])
                    value = crc32(piece, value)
                sums[(key, b)] = value
        finally:
            del out, piece  # no view of the mapping outlives the copy (a traceback keeps frames)

    def helper() -> None:
        if not share.enter():
            return
        error: BaseException | None = None
        try:
            copy()
        except BaseException as e:
            error = e
        finally:
            share.leave(error)

    threads = max(1, min(torch.get_num_threads(), CRC_THREADS, len(jobs)))
    pool = crc_pool()
    try:
        for _ in range(threads - 1):
            pool.submit(helper)
        copy()
    finally:
        share.halt_and_wait()
    if share.errors:
        raise share.errors[0]  # a helper's error is the snapshot's
    return {key: tuple(sums[(key, b)] for b in range(n)) for key, n in nblocks.items()}


def _run_id() -> str:
    """Which run of the job this process belongs to, as far as its launcher says (torchrun's run
    id and restart count, the rendezvous address): a seal never mixes two runs' ranks."""
    env = os.environ
    return ":".join(
        env.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    )


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
