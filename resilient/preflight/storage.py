"""The checkpoint URL: write and read throughput and time to first byte, in a scratch directory.

Every rank writes its own file (``rank_NNNNN.bin``, random bytes, flushed and synced as a
checkpoint's are) into ``<url>/.resilient-preflight-<random>/``, reads it back whole, and times
a one-byte ranged read (time to first byte: a GET's latency on an object store).  Nothing outside
that scratch directory is touched, and it is removed afterwards, whatever happened.  On a local
disk the file's pages are dropped from the page cache before the read (``posix_fadvise``), so the
read comes from the disk rather than from memory.  The figures go through the same fsspec seam the
checkpointer uses (``resilient.checkpoint.storage``), with fewer retries: a check should fail fast.
"""

from __future__ import annotations

import os
import secrets
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
    data = os.urandom(min(nbytes, 1 << 20))
    parts = [data] * max(nbytes // len(data), 1)
    written = sum(len(p) for p in parts)
    t0 = time.perf_counter()
    storage.write_file(rel, parts, fsync=True)
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
    # every block, not the first only: a store that loses or zeroes a tail passes that
    bad = next(
        (at for at in range(0, written, len(data)) if view[at : at + len(data)] != data), None
    )
    if got != written or first != data[:1] or bad is not None:
        where = f" (first difference in the block at byte {bad})" if bad is not None else ""
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


def remove_scratch(storage: Storage, scratch: str, *, created_root: bool = False) -> None:
    """Remove the scratch directory (only it) and whatever is left in it; and the URL's own
    directory when preflight created it and it is empty."""
    storage.remove_tree(scratch)
    if created_root:
        try:
            os.rmdir(storage.path())
        except OSError:  # not empty: someone else writes there now; leave it
            pass
