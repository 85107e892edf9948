"""The checkpoint URL: write and read throughput and time to first byte, in a scratch directory.

Every rank writes its own file (``rank_NNNNN.bin``, random bytes, each 4 KiB stamped with the rank,
block and offset so that no part repeats another; flushed and synced as a checkpoint's are) into
``<url>/.resilient-preflight-<random>/``, reads it back whole and in a range inside the last block
(compared byte for byte), and times a one-byte ranged read (time to first byte: a GET's latency on
an object store).  Nothing outside
that scratch directory is touched, and it is removed afterwards, whatever happened.  On a local
disk the file's pages are dropped from the page cache before the read (``posix_fadvise``), so the
read comes from the disk rather than from memory.  The figures go through the same fsspec seam the
checkpointer uses (``resilient.checkpoint.storage``), with fewer retries: a check should fail fast.
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from typing import Any

from resilient.checkpoint.storage import RetryPolicy, Storage
from resilient.errors import StorageError

__all__ = ["scratch_name", "open_storage", "make_scratch", "storage_sample", "remove_scratch"]

_RETRY = RetryPolicy(max_attempts=2, max_total_s=20.0)


def scratch_name() -> str:
    return f".resilient-preflight-{secrets.token_hex(6)}"


def open_storage(url: str, options: dict | None) -> Storage:
    return Storage(url, options, _RETRY)


def make_scratch(storage: Storage, scratch: str) -> bool:
    """Create the scratch directory; returns whether the URL's own directory had to be created
    too (a local path that does not exist yet: it is removed again with the scratch)."""
    created_root = storage.is_local and not os.path.isdir(storage.path())
    storage.makedirs(scratch)
    return created_root


def _drop_cache(storage: Storage, rel: str) -> bool:
    if not storage.is_local or not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(storage.path(rel), os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def storage_sample(storage: Storage, scratch: str, rank: int, nbytes: int) -> dict[str, Any]:
    """Write, read back and first-byte-time ``nbytes`` in this rank's scratch file; raises
    ``StorageError`` (naming the URL and the operation) when the storage cannot do it."""
    rel = f"{scratch}/rank_{rank:05d}.bin"
    # every block (and every 4 KiB of it) different: a store that writes one part again and
    # again, or reads every offset as the first, returned the same bytes when the blocks were
    # one random block repeated (made before the clock starts: generating is no write time)
    blocks = _blocks(rank, min(nbytes, 1 << 20), max(nbytes // (1 << 20), 1))
    block = len(blocks[0])
    written = block * len(blocks)
    t0 = time.perf_counter()
    storage.write_file(rel, blocks, fsync=True)
    write_s = time.perf_counter() - t0
    dropped = _drop_cache(storage, rel)
    t0 = time.perf_counter()
    first = storage.read_range(rel, 0, 1)
    first_byte_s = time.perf_counter() - t0
    buf = bytearray(written)
    t0 = time.perf_counter()
    got = storage.read_into(rel, 0, memoryview(buf))
    read_s = time.perf_counter() - t0
    view = memoryview(buf)
    # a ranged read inside the last block, not at 0: a store that ignores the offset of a
    # ranged read (an object store's Range header) returns the file's start there
    inner = block // 2 + 3 if block > 16 else 0
    at = written - block + inner
    ranged = storage.read_range(rel, at, at + min(8192, block - inner))
    # every block, not the first only: a store that loses or zeroes a tail passes that
    bad = next(
        (
            i * block + _first_difference(view[i * block : (i + 1) * block], b)
            for i, b in enumerate(blocks)
            if view[i * block : (i + 1) * block] != b
        ),
        None,
    )
    if bad is None and first != blocks[0][:1]:
        bad = 0
    if bad is None and (not ranged or ranged != blocks[-1][inner : inner + len(ranged)]):
        bad = at + _first_difference(ranged, blocks[-1][inner:])
    if got != written or bad is not None:
        where = ""
        if bad is not None:
            where = f" (first difference at byte {bad}, in the block at byte {bad - bad % block})"
        raise StorageError(
            f"checkpoint URL {storage.display(rel)}: read back {got} bytes that differ from the "
            f"{written} written{where}; the storage returns wrong data: do not checkpoint there",
            url=storage.url,
            operation="verify",
        )
    storage.remove(rel)
    return {
        "bytes": written,
        "write_bytes_per_s": written / max(write_s, 1e-9),
        "read_bytes_per_s": written / max(read_s, 1e-9),
        "first_byte_s": first_byte_s,
        "page_cache_dropped": dropped,
    }


_STAMP_EVERY = 4096


def _blocks(rank: int, size: int, count: int) -> list[bytes]:
    """``count`` blocks of ``size`` bytes: one random block, each copy stamped every 4 KiB with
    (rank, block index, offset), so no 4 KiB of the file repeats another."""
    base = os.urandom(size)
    out = []
    for i in range(count):
        b = bytearray(base)
        for at in range(0, size - 15, _STAMP_EVERY):
            b[at : at + 16] = struct.pack("<IIQ", rank, i, at)
        out.append(bytes(b))
    return out


def _first_difference(got: bytes | memoryview, want: bytes) -> int:
    """The first offset where ``got`` differs from ``want`` (or where it ends early)."""
    n = min(len(got), len(want))
    step = _STAMP_EVERY
    for start in range(0, n, step):
        if got[start : start + step] != want[start : start + step]:
            return next(j for j in range(start, min(start + step, n)) if got[j] != want[j])
    return n


def remove_scratch(storage: Storage, scratch: str, *, created_root: bool = False) -> None:
    """Remove the scratch directory (only it) and whatever is left in it; and the URL's own
    directory when preflight created it and it is empty."""
    storage.remove_tree(scratch)
    if created_root:
        try:
            os.rmdir(storage.path())
        except OSError:  # not empty: someone else writes there now; leave it
            pass
