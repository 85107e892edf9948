"""The one seam between the checkpointer and bytes on storage: fsspec plus retries.

Every storage call the checkpointer makes goes through :class:`Storage`.  It owns URL handling
(paths stay ``str``: pathlib would collapse the ``//`` of ``s3://``), retrying transient errors
with exponential backoff and jitter (tenacity), turning permanent errors into ``StorageError`` that
names the URL and the operation, and the atomic publish of small files (temp + rename where rename
is atomic, a single PUT on object stores).  It does not know what a checkpoint is.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from resilient.errors import ResilientError, StorageError

__all__ = ["RetryPolicy", "Storage", "is_transient"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that say "this will not get better by trying again".
_PERMANENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOENT,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.EINVAL,
    errno.EFBIG,
}


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error is worth retrying (network hiccups, throttling, timeouts)."""
    if isinstance(exc, ResilientError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(
        exc,
        (
            FileNotFoundError,
            PermissionError,
            IsADirectoryError,
            NotADirectoryError,
            FileExistsError,
        ),
    ):
        return False
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    # botocore / aiohttp errors that s3fs lets through are transient by nature.
    name = type(exc).__name__
    return any(
        s in name
        for s in (
            "Timeout",
            "Connection",
            "Throttl",
            "SlowDown",
            "ServerError",
            "EndpointConnectionError",
            "ClientPayloadError",
        )
    )


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounded retries of transient storage errors: attempts and total time, backoff with jitter."""

    max_attempts: int = 6
    max_total_s: float = 120.0
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_total_s <= 0 or self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"RetryPolicy times must be positive, got {self}")


# While a stream is written to a file, the disk is asked to start writing back every this many
# bytes, so the final fsync waits for the tail only rather than for the whole file.
WRITEBACK_BYTES = 8 << 20


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start write-back of the dirty pages in the range; do not wait


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the disk now
    (``sync_file_range``; advisory, a no-op where unavailable).  Without it, write-back of a file
    written through the page cache starts only at its fsync or after the kernel's dirty timeout,
    so the disk idles while the file is produced.  Durability still comes from the fsync."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class Storage:
    """A checkpoint root URL on any fsspec filesystem, with retries.

    ``Storage("s3://bucket/run1", storage_options={...})``; paths given to methods are relative to
    the root and use ``/``.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"checkpoint URL must be a non-empty string, got {url!r}")
        self.url = url.rstrip("/") or url
        self.retry = retry or RetryPolicy()
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            missing = isinstance(e, ImportError) or str(e).startswith("Protocol not known")
            hint = (
                "install the fsspec backend for its protocol (for example s3fs for s3://)"
                if missing
                else "check the storage options given with it"
            )
            raise StorageError(
                f"cannot open checkpoint URL {url!r}: {e}; {hint}",
                url=url,
                operation="open",
            ) from e
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.retries_done = (
            0  # how many retries this Storage has made (for the event log and tests)
        )

    # --- paths --------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root not in ("", "/") else f"{self.root}{rel}"

    def display(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    # --- retry core ---------------------------------------------------------------------------
    def _call(self, operation: str, rel: str, fn: Callable[[], T]) -> T:
        def before_sleep(state: RetryCallState) -> None:
            self.retries_done += 1
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "storage %s %s failed (attempt %d): %r; retrying in %.2fs",
                operation,
                self.display(rel),
                state.attempt_number,
                exc,
                state.next_action.sleep if state.next_action else 0.0,
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.retry.max_attempts)
            | stop_after_delay(self.retry.max_total_s),
            # exponential backoff plus random jitter, so that many ranks do not retry in lockstep
            wait=wait_exponential(
                multiplier=self.retry.initial_backoff_s, max=self.retry.max_backoff_s
            )
            + wait_random(0, self.retry.initial_backoff_s),
            retry=retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        start = time.monotonic()
        try:
            return retrying(fn)
        except ResilientError:
            raise  # not a storage failure: e.g. corrupt bytes found while streaming a write
        except Exception as e:
            attempts = retrying.statistics.get("attempt_number", 1)
            why = "kept failing" if is_transient(e) else "failed"
            hint = _hint(e)
            raise StorageError(
                f"storage {operation} of {self.display(rel)} {why} after {attempts} attempt(s) in "
                f"{time.monotonic() - start:.1f}s: {type(e).__name__}: {e}{hint}",
                url=self.display(rel),
                operation=operation,
            ) from e

    # --- operations ---------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        self._call("makedirs", rel, lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def _fresh(self, rel: str) -> str:
        """The path, with any cached listing of it dropped (other ranks write here too)."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        return path

    def exists(self, rel: str) -> bool:
        return self._call("exists", rel, lambda: self.fs.exists(self._fresh(rel)))

    def size(self, rel: str) -> int:
        return int(self._call("size", rel, lambda: self.fs.size(self._fresh(rel))))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self._fresh(rel), detail=False)
            except FileNotFoundError:
                return []
            base = self.path(rel).rstrip("/")
            return sorted(
                {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base}
            )

        return self._call("list", rel, ls)

    def read(self, rel: str) -> bytes:
        return self._call("read", rel, lambda: self.fs.cat_file(self.path(rel)))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        data = self._call(
            f"read [{start}, {end})",
            rel,
            lambda: self.fs.cat_file(self.path(rel), start=start, end=end),
        )
        return data

    def read_into(self, rel: str, start: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes at ``start`` into ``out``; the count read (short at end of file).

        On a local disk this is a ``preadv`` straight into the caller's (reused) memory: no fresh
        buffer to fault in for every read, which is most of a page-cache read's cost.
        """
        out = memoryview(out).cast("B")
        if not self.is_local:
            data = self.read_range(rel, start, start + len(out))
            out[: len(data)] = data
            return len(data)

        def pread() -> int:
            fd = os.open(self.path(rel), os.O_RDONLY)
            try:
                n = 0
                while n < len(out):
                    got = os.preadv(fd, [out[n:]], start + n)
                    if got == 0:
                        break
                    n += got
                return n
            finally:
                os.close(fd)

        return self._call(f"read [{start}, {start + len(out)})", rel, pread)

    def write_file(
        self,
        rel: str,
        parts: Iterable[memoryview | bytes] | Callable[[], Iterable[memoryview | bytes]],
        *,
        fsync: bool = True,
        on_written: Callable[[], None] | None = None,
    ) -> int:
        """Stream ``parts`` into a new file at ``rel`` (replacing it) and make it durable.

        ``parts`` is a list, or a function returning a fresh iterable (a stream too large to hold,
        regenerated if the write is retried).  ``on_written`` runs once, after the bytes are handed
        to the filesystem and before the flush that makes them durable (fsync, or the final
        upload), so CPU work such as checksumming overlaps the wait for the disk.  The retry unit
        is the whole file: a partly written file is simply rewritten.
        """
        make_parts = parts if callable(parts) else (lambda fixed=list(parts): fixed)
        # A stream is produced as it is written: the disk is asked to start on each WRITEBACK_BYTES
        # as they come, so it writes while the rest is produced.  Bytes already in memory go to
        # the page cache at memory speed and the flush follows at once: measured, asking earlier
        # made no difference there.
        streamed = callable(parts)
        hook = [on_written]

        def written() -> None:
            if hook[0] is not None:
                fn, hook[0] = hook[0], None
                fn()

        def write_local() -> int:
            n = kicked = 0
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                with _closing(make_parts()) as stream:
                    for p in stream:
                        mv = memoryview(p).cast("B")
                        while mv:
                            w = os.write(fd, mv)
                            n += w
                            mv = mv[w:]
                        if streamed and n - kicked >= WRITEBACK_BYTES:
                            _start_writeback(fd, kicked, n - kicked)
                            kicked = n
                written()
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return n

        def write_fs() -> int:
            n = 0
            with self.fs.open(self.path(rel), "wb") as f, _closing(make_parts()) as stream:
                for p in stream:
                    n += len(memoryview(p).cast("B"))
                    f.write(p)
                written()
            return n

        return self._call("write", rel, write_local if self.is_local else write_fs)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Publish a small file so that readers see all of it or nothing."""
        if self.is_local:

            def publish() -> None:
                final = self.path(rel)
                tmp = f"{final}.tmp.{os.getpid()}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
                dfd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

            self._call("atomic write", rel, publish)
        else:
            # Object stores make a single PUT visible all at once; memory:// likewise.
            self._call("atomic write", rel, lambda: self.fs.pipe_file(self.path(rel), data))

    def sync_file(self, rel: str) -> None:
        """Make a file written with ``fsync=False`` durable (a no-op where writes are uploads)."""
        self._fsync(rel)

    def sync_dir(self, rel: str) -> None:
        """Make directory entries (new files) durable where that means anything."""
        self._fsync(rel)

    def _fsync(self, rel: str) -> None:
        if self.is_local:

            def sync() -> None:
                fd = os.open(self.path(rel), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

            self._call("sync", rel, sync)

    def remove(self, rel: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm(self.path(rel))
            except FileNotFoundError:
                pass

        self._call("remove", rel, rm)

    def remove_tree(self, rel: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

        self._call("remove", rel, rm)

    def read_ranges(self, rel: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Several byte ranges of one file (concurrently where the backend can)."""
        if not ranges:
            return []
        path = self.path(rel)

        def cat() -> list[bytes]:
            out = self.fs.cat_ranges(
                [path] * len(ranges),
                [r[0] for r in ranges],
                [r[1] for r in ranges],
                on_error="raise",
            )
            return list(out)

        return self._call(f"read {len(ranges)} ranges", rel, cat)


@contextlib.contextmanager
def _closing(parts: Iterable[memoryview | bytes]) -> Iterator[Iterable[memoryview | bytes]]:
    """Close a generator of parts when the write ends, failed or not, before any retry starts:
    a stream that reuses its buffers (the resharder's) must not run twice at once."""
    try:
        yield parts
    finally:
        close = getattr(parts, "close", None)
        if close is not None:
            close()


def _hint(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "; free space on the checkpoint storage or lower keep_last"
    if isinstance(e, PermissionError):
        return "; check write permissions and credentials for the checkpoint URL"
    if isinstance(e, FileNotFoundError):
        return "; the path does not exist"
    return ""
