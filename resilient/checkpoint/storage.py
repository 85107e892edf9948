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
import functools
import logging
import os
import posixpath
import re
import secrets
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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

__all__ = [
    "RetryPolicy",
    "Storage",
    "PinnedFiles",
    "LocalOps",
    "set_local_ops",
    "is_transient",
    "ATOMIC_PUT_PROTOCOLS",
    "COMMIT_METHODS",
    "WriteConflict",
    "SetAside",
    "fs_type",
    "fs_type_in",
]

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
    errno.ELOOP,
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
# An exclusive write that found its name taken compares what is there in pieces this large.
_COMPARE_BYTES = 64 << 20


# a file a local remove_if set aside: ``<name>.released-[<tag>-]<12 hex>`` (the tag: whose release)
_ASIDE_RE = re.compile(r"\.released-(?:([0-9a-f]{1,64})-)?[0-9a-f]{12}")


@dataclass(frozen=True)
class SetAside:
    """A file that a local :meth:`Storage.remove_if` renamed aside to judge it, and that is still
    there: its judging is in progress, or was cut short (a crash between the rename and the
    removal or the putting back)."""

    rel: str  # where it is now
    tag: str  # what the remove_if was tagged with (a lease: the releasing lease's token), or ""
    age_s: float  # since it was set aside (its status change time, on this host's clock)


class WriteConflict(StorageError):
    """An exclusive write (a rank file) found something at its name: another writer was first."""


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


# Filesystems on which one write of a whole object (a PUT) is all-or-nothing: a reader sees the old
# object or the new one, never part of one.  Every other non-local filesystem (sftp, hdfs, ftp,
# caching wrappers, ...) may show a half-written file, so commits there need a method the user
# names (``commit_method``) or are refused.
ATOMIC_PUT_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "memory"}
)
COMMIT_METHODS = ("rename", "put")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# Local filesystems: a stat of a file there shows a change made by any process at once (a
# network filesystem's client may serve a cached one for seconds: NFS's attribute cache)
_COHERENT_FS = frozenset(
    {
        "tmpfs",
        "ramfs",
        "hugetlbfs",
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "zfs",
        "overlay",
    }
)
_OCTAL = re.compile(r"\\([0-7]{3})")  # /proc/self/mounts escapes space, tab, newline, backslash


@functools.lru_cache(maxsize=64)
def fs_type(directory: str) -> str:
    """The type of the filesystem ``directory`` (a real path) is on, or "" where that cannot be
    read."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = f.read()
    except OSError as e:
        log.info("cannot read /proc/self/mounts (%s): filesystem types unknown", e)
        return ""
    return fs_type_in(mounts, directory)


def fs_type_in(mounts: str, directory: str) -> str:
    """The type of the filesystem of the longest mount point above ``directory`` in ``mounts``
    (/proc/self/mounts' text, whose paths escape space, tab, newline and backslash in octal)."""
    best, kind = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), parts[1])
        under = directory == mnt or directory.startswith(mnt.rstrip("/") + "/")
        if under and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def _stat_key_of(st: os.stat_result) -> tuple[Any, ...]:
    """A local file's ``Storage.stat_key()`` from its stat: what changes when it is replaced."""
    return (st.st_size, st.st_mtime_ns, st.st_ino, stat.S_IFMT(st.st_mode))


class LocalOps:
    """The system calls that change things on a local disk, in one place.

    A seam for fault injection: tests and the chaos harness install a subclass (``set_local_ops``)
    that fails a write, an fsync or a rename, or runs out of space, so the real local write path
    (not a wrapper filesystem) is what gets tested.  Production code uses this class as it is.
    """

    def open(self, name: str, flags: int, mode: int = 0o644, *, dir_fd: int | None = None) -> int:
        return os.open(name, flags, mode, dir_fd=dir_fd)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def rename(self, src: str, dst: str, *, dir_fd: int) -> None:
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def link(self, src: str, dst: str, *, dir_fd: int) -> None:
        os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    def rename_noreplace(self, src: str, dst: str, *, dir_fd: int) -> bool:
        """Rename ``src`` to ``dst`` only where nothing is at ``dst`` (FileExistsError), as one
        step (Linux's ``renameat2`` with ``RENAME_NOREPLACE``); False where the system or the
        file system cannot (the caller links, then unlinks: two steps)."""
        return _renameat2_noreplace(src, dst, dir_fd)

    def unlink(self, name: str, *, dir_fd: int) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def mkdir(self, name: str, *, dir_fd: int) -> None:
        os.mkdir(name, 0o755, dir_fd=dir_fd)


_RENAME_NOREPLACE = 1
_renameat2: Any = None  # (libc's, looked up once; False where there is none)


def _renameat2_noreplace(src: str, dst: str, dir_fd: int) -> bool:
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                f = ctypes.CDLL(None, use_errno=True).renameat2
            except (AttributeError, OSError):  # (glibc before 2.28, another libc)
                pass
            else:
                f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
                f.argtypes += [ctypes.c_uint]
                f.restype = ctypes.c_int
                _renameat2 = f
    if _renameat2 is False:
        return False
    import ctypes

    if _renameat2(dir_fd, os.fsencode(src), dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # (this file system cannot)
        return False
    raise OSError(err, os.strerror(err), dst)


_local_ops = LocalOps()


def set_local_ops(ops: LocalOps) -> LocalOps:
    """Install ``ops`` for every local-disk Storage in this process; returns the previous ones."""
    global _local_ops
    previous, _local_ops = _local_ops, ops
    return previous


def _unwrap_dirfs(fs: Any, root: str) -> tuple[Any, str]:
    """``dir::`` over a local disk is the local disk (so it gets the local path: rename commits,
    no symlinks followed)."""
    # not imported unless someone made one (importing it costs fsspec's async machinery, 0.2 s)
    mod = sys.modules.get("fsspec.implementations.dirfs")
    if mod is None:
        return fs, root
    while isinstance(fs, mod.DirFileSystem):
        root, fs = fs._join(root), fs.fs
    return fs, root


class Storage:
    """A checkpoint root URL on any fsspec filesystem, with retries.

    ``Storage("s3://bucket/run1", storage_options={...})``; paths given to methods are relative to
    the root and use ``/``.  On a local disk, nothing below the root is reached through a symbolic
    link (every component is opened with ``O_NOFOLLOW``), reads refuse anything but a regular file,
    and every write goes to a fresh temporary file (``O_EXCL``) renamed over its name, so a planted
    link or hard link never redirects a write.

    ``commit_method``: how :meth:`publish` makes a small file visible all at once: ``"rename"``
    (local disks: temp + fsync + rename + directory fsync), ``"put"`` (object stores: one PUT), or
    None to detect it; a filesystem with neither known is refused when something is published.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        *,
        commit_method: str | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"checkpoint URL must be a non-empty string, got {url!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ValueError(
                f"storage_options must be None or a mapping of fsspec options for {url!r} (such "
                f"as {{'anon': True}}), got {type(storage_options).__name__} {storage_options!r:.80}"
            )
        if commit_method is not None and commit_method not in COMMIT_METHODS:
            raise ValueError(
                f"commit_method must be one of {COMMIT_METHODS} or None, got {commit_method!r}"
            )
        stripped = url.rstrip("/")
        # a trailing slash goes, but not the "//" of "memory://" or "dir::memory://"
        self.url = stripped if stripped and not stripped.endswith(":") else url
        self.retry = retry or RetryPolicy()
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
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
        self.fs, root = _unwrap_dirfs(fs, root)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.commit_method = commit_method or _detect_commit_method(self.fs, self.is_local)
        self.retries_done = 0  # how many retries this Storage has made (event log, tests)
        self._warned: set[str] = set()  # (what this client cannot do, said once)

    @functools.cached_property
    def coherent_stat(self) -> bool:
        """Whether ``stat_key()`` sees another process's replacement of a file at once: a local
        filesystem, not a network one whose client caches attributes (NFS).  A lease check may
        then skip reading a lease file whose key has not changed since it read its own record."""
        return self.is_local and fs_type(os.path.realpath(self.root or ".")) in _COHERENT_FS

    # --- paths --------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root not in ("", "/") else f"{self.root}{rel}"

    def display(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    @property
    def protocol(self) -> str:
        p = self.fs.protocol
        return p[0] if isinstance(p, (tuple, list)) else p

    def location(self) -> tuple[str, ...]:
        """Where the root really is, for telling whether two URLs name the same place: the real
        path on a local disk (symlinks, ``..``, ``./`` and trailing slashes resolved), else the
        protocol, the endpoint and the normalised path."""
        fs = self.fs
        cached = sys.modules.get("fsspec.implementations.cached")
        while cached is not None and isinstance(fs, cached.CachingFileSystem):
            fs = fs.fs  # simplecache::, filecache::, blockcache:: read and write their target
        if isinstance(fs, LocalFileSystem):
            return ("file", os.path.realpath(self.root))
        opts = getattr(fs, "storage_options", {}) or {}
        endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get(
            "endpoint_url", ""
        )
        protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        return (protocol, str(endpoint), posixpath.normpath("/" + self.root.strip("/")))

    # --- retry core ---------------------------------------------------------------------------
    def _call(self, operation: str, rel: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        try:  # the common case, without building the retry machinery (a commit makes ~20 calls)
            return fn()
        except ResilientError:
            raise  # not a storage failure: e.g. corrupt bytes found while streaming a write
        except Exception as e:
            first = e
        # The first attempt failed: the retrying machinery replays that failure as its own first
        # attempt (the same log line, backoff and attempt count as when it ran the call itself).
        replay = [first]

        def attempt() -> T:
            if replay:
                raise replay.pop()
            return fn()

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
            # the time budget counts from the first attempt, which ran before this machinery
            | stop_after_delay(max(0.0, self.retry.max_total_s - (time.monotonic() - start))),
            # exponential backoff plus random jitter, so that many ranks do not retry in lockstep
            wait=wait_exponential(
                multiplier=self.retry.initial_backoff_s, max=self.retry.max_backoff_s
            )
            + wait_random(0, self.retry.initial_backoff_s),
            # (an Exception only, as the first attempt above: a BaseException is never retried)
            retry=retry_if_exception(lambda e: isinstance(e, Exception) and is_transient(e)),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(attempt)
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

    # --- the local disk, without following links ------------------------------------------------
    def _refuse(self, rel: str, what: str, operation: str) -> StorageError:
        return StorageError(
            f"refusing to {operation} {self.display(rel)}: it is {what}; a checkpoint holds only "
            f"regular files and directories (a link could point anywhere) — remove it, or copy the "
            f"checkpoint without links",
            url=self.display(rel),
            operation=operation,
        )

    def _dir_fd(self, rel_dir: str, *, create: bool = False, operation: str = "open") -> int:
        """A descriptor of directory ``rel_dir`` under the root, reached without following a
        symbolic link below the root (the root itself is the user's path and may be one)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root or ".", os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        walked = ""
        try:
            for part in rel_dir.split("/"):
                if not part:
                    continue
                walked = f"{walked}/{part}" if walked else part
                if part in (".", ".."):
                    raise self._refuse(walked, f"a relative component {part!r}", operation)
                flags = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
                try:
                    nfd = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        _local_ops.mkdir(part, dir_fd=fd)
                        # the new entry must survive a power loss before anything in it counts
                        _local_ops.fsync(fd)
                    nfd = os.open(part, flags, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise self._refuse(walked, _kind_of(part, fd), operation) from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open_regular(self, rel: str, operation: str) -> tuple[int, os.stat_result]:
        """Open a regular file for reading, refusing links, devices, FIFOs and directories."""
        d, _, name = rel.rpartition("/")
        dfd = self._dir_fd(d, operation=operation)
        try:
            try:
                # O_NONBLOCK: opening a planted FIFO must not wait for a writer
                fd = os.open(
                    name, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd
                )
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise self._refuse(rel, "a symbolic link", operation) from None
                raise
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise self._refuse(rel, _describe_mode(st.st_mode), operation)
        return fd, st

    def _write_local(
        self,
        rel: str,
        make_parts: Callable[[], Iterable[memoryview | bytes]],
        *,
        fsync: bool,
        streamed: bool,
        written: Callable[[], None],
        sync_dir: bool = False,
        exclusive: bool = False,
    ) -> int:
        """Write a fresh temporary (``O_EXCL|O_NOFOLLOW``: never through a planted link or into
        someone else's file), make it durable, rename it over ``rel`` (``exclusive``: ``link()``
        it there, which fails with FileExistsError where anything is at that name)."""
        d, _, name = rel.rpartition("/")
        ops = _local_ops
        dfd = self._dir_fd(d, operation="write")
        tmp = f"{name}.tmp-{secrets.token_hex(6)}"
        try:
            n = kicked = 0
            fd = ops.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd
            )
            try:
                with _closing(make_parts()) as stream:
                    for p in stream:
                        mv = memoryview(p).cast("B")
                        while mv:
                            w = ops.write(fd, mv)
                            n += w
                            mv = mv[w:]
                        if streamed and n - kicked >= WRITEBACK_BYTES:
                            _start_writeback(fd, kicked, n - kicked)
                            kicked = n
                written()
                if fsync:
                    ops.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                ops.link(tmp, name, dir_fd=dfd)
                ops.unlink(tmp, dir_fd=dfd)
            else:
                ops.rename(tmp, name, dir_fd=dfd)
            if sync_dir:
                ops.fsync(dfd)
            return n
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)  # gone already after a successful rename
            raise
        finally:
            os.close(dfd)

    # --- operations ---------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self.is_local:
            self._call("makedirs", rel, lambda: os.close(self._dir_fd(rel, create=True)))
            return
        self._call("makedirs", rel, lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def _fresh(self, rel: str) -> str:
        """The path, with any cached listing of it dropped (other ranks write here too)."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        return path

    def exists(self, rel: str) -> bool:
        if self.is_local:
            return self.stat_key(rel) is not None
        return self._call("exists", rel, lambda: self.fs.exists(self._fresh(rel)))

    def hold(self, rel: str) -> tuple[int, tuple[Any, ...]] | None:
        """(a local disk) A descriptor of the regular file at ``rel``, kept open by the caller,
        and its ``stat_key()``: while it is open, no other file there can have its inode (its
        number is not reused), so a key that matches it later is this very file.  None where
        it cannot be opened (or elsewhere than on a local disk)."""
        if not self.is_local:
            return None
        try:
            fd, st = self._open_regular(rel, "hold")
        except Exception:
            return None
        return fd, _stat_key_of(st)

    def stat_key(self, rel: str) -> tuple[Any, ...] | None:
        """Something that changes whenever the file at ``rel`` is replaced (size, mtime, inode or
        ETag), or None when nothing is there: the key of a cache of parsed files."""
        if self.is_local:

            def lstat() -> tuple[Any, ...] | None:
                d, _, name = rel.rpartition("/")
                try:
                    dfd = self._dir_fd(d, operation="stat")
                except FileNotFoundError:
                    return None
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return None
                finally:
                    os.close(dfd)
                return _stat_key_of(st)

            return self._call("stat", rel, lstat)

        def info() -> tuple[Any, ...] | None:
            try:
                i = self.fs.info(self._fresh(rel))
            except FileNotFoundError:
                return None
            tag = next(
                (
                    i[k]
                    for k in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "created")
                    if i.get(k) is not None
                ),
                None,
            )
            return (i.get("size"), i.get("type"), str(tag))

        return self._call("stat", rel, info)

    def size(self, rel: str) -> int:
        if self.is_local:

            def fstat_size() -> int:
                fd, st = self._open_regular(rel, "stat")
                os.close(fd)
                return st.st_size

            return self._call("size", rel, fstat_size)
        return int(self._call("size", rel, lambda: self.fs.size(self._fresh(rel))))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        if self.is_local:

            def scan() -> list[str]:
                try:
                    fd = self._dir_fd(rel, operation="list")
                except FileNotFoundError:
                    return []
                try:
                    return sorted(os.listdir(fd))
                finally:
                    os.close(fd)

            return self._call("list", rel, scan)

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
        if self.is_local:
            return self._call("read", rel, lambda: self._pread_all(rel, None))
        return self._call("read", rel, lambda: self.fs.cat_file(self.path(rel)))

    def read_small(self, rel: str, max_bytes: int) -> bytes:
        """A whole file that must not exceed ``max_bytes`` (a manifest, a lease): its size is
        checked before it is read, and a file that is not a regular file is refused, so a file
        that never ends (a link to ``/dev/zero``, a 100 GB file) costs neither time nor memory."""
        if self.is_local:
            return self._call("read", rel, lambda: self._pread_all(rel, max_bytes))

        def cat() -> bytes:
            data = self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
            if len(data) > max_bytes:
                raise _too_large(self, rel, None, max_bytes)
            return data

        return self._call("read", rel, cat)

    def _pread_all(self, rel: str, max_bytes: int | None) -> bytes:
        fd, st = self._open_regular(rel, "read")
        try:
            if max_bytes is not None and st.st_size > max_bytes:
                raise _too_large(self, rel, st.st_size, max_bytes)
            chunks, n, want = [], 0, st.st_size
            while True:  # to the end, even if it grew since the fstat (up to the limit)
                b = os.pread(fd, max(want - n, 1 << 16), n)  # never ask for more than is there
                if not b:
                    break
                chunks.append(b)
                n += len(b)
                if max_bytes is not None and n > max_bytes:
                    raise _too_large(self, rel, n, max_bytes)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        if self.is_local:
            buf = bytearray(max(end - start, 0))
            n = self.read_into(rel, start, memoryview(buf))
            return bytes(buf[:n])
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
            fd, _ = self._open_regular(rel, "read")
            try:
                return _pread_into(fd, start, out)
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
        exclusive: bool = False,
    ) -> int:
        """Stream ``parts`` into a new file at ``rel`` (replacing it) and make it durable.

        ``exclusive``: only where nothing is at ``rel`` (a ``link()`` of the temporary on a local
        disk, ``If-None-Match: *`` on the upload's final request on S3, where a store can say so):
        a rank file is never replaced, so a writer whose lease was taken over, still writing,
        can never replace its successor's committed file, whatever generation both picked.
        Something there already raises :class:`WriteConflict`, unless it holds these very bytes
        and an earlier attempt of this call may have written it (its answer lost).

        ``parts`` is a list, or a function returning a fresh iterable (a stream too large to hold,
        regenerated if the write is retried).  ``on_written`` runs once, after the bytes are handed
        to the filesystem and before the flush that makes them durable (fsync, or the final
        upload), so CPU work such as checksumming overlaps the wait for the disk.  The retry unit
        is the whole file: a partly written file is simply rewritten.  On a local disk the bytes
        go to a fresh temporary that is renamed over ``rel``.
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

        exclusive_open = exclusive and exclusive_open_ok(self.fs)
        leftover = [False]  # a partial file this call created in place, its removal failed

        def write_fs() -> int:
            if leftover[0]:  # (this call's own: its exclusive open had created it)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.path(rel))
                leftover[0] = False
            n = 0
            f, created = self._open_for_write(rel, exclusive_open)
            try:
                with _closing(make_parts()) as stream:
                    for p in stream:
                        n += len(memoryview(p).cast("B"))
                        f.write(p)
                    written()
                f.close()  # (an object store's upload is published here, If-None-Match and all)
            except BaseException:
                leftover[0] = not self._abandon(f, rel, created=created)
                raise
            return n

        def write_local() -> int:
            return self._write_local(
                rel,
                make_parts,
                fsync=fsync,
                streamed=streamed,
                written=written,
                exclusive=exclusive,
            )

        write = write_local if self.is_local else write_fs
        if not exclusive:
            return self._call("write", rel, write)

        def write_once() -> int:
            try:
                return write()
            except FileExistsError:
                # These very bytes there: an earlier attempt's, its answer lost (a retry here,
                # or one the client library made by itself); taking them is harmless.
                if self._holds(rel, make_parts):
                    return self.size(rel)
                raise WriteConflict(
                    f"refusing to write {self.display(rel)}: a file is there already, and a save "
                    f"never replaces one (another writer wrote it first: a job whose writer "
                    f"lease was taken over while it was still saving, or a second job writing "
                    f"this URL); this save fails and what is committed stays as it is — make "
                    f"sure one job writes this URL",
                    url=self.display(rel),
                    operation="write",
                ) from None

        return self._call("write", rel, write_once)

    def _open_for_write(self, rel: str, exclusive: bool) -> tuple[Any, bool]:
        """The file to write, and whether it is exclusive: a client too old for the exclusive
        mode (fsspec and s3fs before 2024.12) writes plainly, said once."""
        if exclusive:
            try:
                return self.fs.open(self.path(rel), "xb"), True
            except (ValueError, NotImplementedError, TypeError) as e:
                self._cannot("write only where nothing is (open mode 'xb')", e)
        return self.fs.open(self.path(rel), "wb"), False

    def _cannot(self, what: str, e: BaseException, *, server: bool = False) -> None:
        """Warn once per ``what`` that this client (or, ``server``, the server) cannot do it, so
        it is done plainly."""
        if what in self._warned:
            return
        self._warned.add(what)
        consequence = (
            "doing it plainly (read, then act: a window of one request)"
            if server
            else "writing plainly, so only the lease and the generation claims keep a stale "
            "writer off committed files; upgrade fsspec and s3fs to 2024.12 or later (and "
            "botocore with them)"
        )
        log.warning(
            "%s: this %s cannot %s (%s: %s); %s",
            self.display(""),
            "server" if server else "client",
            what,
            type(e).__name__,
            e,
            consequence,
        )

    def _abandon(self, f: Any, rel: str, *, created: bool) -> bool:
        """A write that failed (part-way, or at its close) publishes nothing of what it wrote;
        False where a partial file it created may still be at ``rel``.

        A file that can be discarded (an object store's upload, published at its close, is
        aborted; a local temporary meant for upload is dropped) is marked closed, so that no
        later close publishes it; a file that appeared at its open (``memory://``, filesystems)
        is closed and, when this write created it (an exclusive open), removed."""
        discard = getattr(f, "discard", None)
        if callable(discard):
            try:
                discard()
                f.closed = True  # (its close, here or when it is collected, would publish it)
                return True
            except Exception:  # (a file that cannot be discarded, or whose `closed` is fixed)
                pass
        with contextlib.suppress(Exception):
            f.close()
        if not created:
            return True
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass
        except Exception:
            return False  # (the next attempt removes it first)
        return True

    def _holds(self, rel: str, make_parts: Callable[[], Iterable[memoryview | bytes]]) -> bool:
        """Whether ``rel`` holds exactly the bytes ``make_parts`` produces (read in pieces, to the
        first that differs)."""
        size, pos = self.size(rel), 0
        with _closing(make_parts()) as stream:
            for p in stream:
                mv = memoryview(p).cast("B")
                for b in range(0, len(mv), _COMPARE_BYTES):
                    piece = mv[b : b + _COMPARE_BYTES]
                    if pos + len(piece) > size:
                        return False
                    if self.read_range(rel, pos, pos + len(piece)) != piece:
                        return False
                    pos += len(piece)
        return pos == size

    def publish(self, rel: str, data: bytes) -> None:
        """Make a small file (a manifest) visible all at once: readers see all of it or nothing,
        by the commit method (class docstring); refused where no method is known."""
        method = self.commit_method
        if method is None:
            raise self.refusal_to_commit()
        if self.is_local:
            self._call(
                "atomic write",
                rel,
                lambda: self._write_local(
                    rel,
                    lambda: [data],
                    fsync=True,
                    streamed=False,
                    written=lambda: None,
                    sync_dir=True,
                ),
            )
        elif method == "put":
            self._call("atomic write", rel, lambda: self.fs.pipe_file(self.path(rel), data))
        else:  # "rename" on a filesystem the user vouches renames atomically

            def put_and_rename() -> None:
                tmp = f"{self.path(rel)}.tmp-{secrets.token_hex(6)}"
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, self.path(rel))

            self._call("atomic write", rel, put_and_rename)

    write_atomic = publish  # the earlier name

    def version_of(self, rel: str) -> str | None:
        """An opaque token of what is at ``rel`` now, for :meth:`publish_if`: where the store can
        replace a file conditionally (S3's ETag; ``""``: nothing there), else None."""
        if self.is_local or not _conditional_put_ok(self.fs):
            return None

        def head() -> str:
            try:
                info = self.fs.info(self.path(rel), refresh=True)
            except FileNotFoundError:
                return ""
            etag = info.get("ETag") or info.get("etag")
            if not isinstance(etag, str) or not etag:
                raise StorageError(
                    f"{self.display(rel)}: the store gave no ETag for it; a commit cannot be "
                    f"made conditional here",
                    url=self.display(rel),
                    operation="stat",
                )
            return etag

        return self._call("stat", rel, head)

    def publish_if(self, rel: str, data: bytes, version: str | None) -> None:
        """:meth:`publish`, only if ``rel`` still holds ``version`` (from :meth:`version_of`;
        None: unconditionally).  Another writer's file there since raises
        :class:`WriteConflict`."""
        if version is None:
            return self.publish(rel, data)

        def put() -> None:
            try:
                if version:
                    self.fs.pipe_file(self.path(rel), data, IfMatch=version)
                else:
                    self.fs.pipe_file(self.path(rel), data, mode="create")
            except Exception as e:
                if _unknown_parameter(e):  # an older s3fs or botocore
                    self._cannot("publish conditionally (If-Match, If-None-Match)", e)
                    self.fs.pipe_file(self.path(rel), data)
                    return
                if not isinstance(e, OSError):
                    raise
                if not isinstance(e, FileExistsError) and not (
                    "pre-condition" in str(e) or "PreconditionFailed" in repr(e) or "412" in str(e)
                ):
                    raise
                # These very bytes there: an earlier attempt's, its answer lost (a retry here or
                # in the client library), not another writer's
                if self._holds(rel, lambda: [data]):
                    return
                raise self._changed(rel) from None

        self._call("atomic write", rel, put)

    def _changed(self, rel: str) -> WriteConflict:
        return WriteConflict(
            f"refusing to replace {self.display(rel)}: it changed since this commit began "
            f"(another writer committed it: this job's writer lease was taken over?); what is "
            f"committed there stays as it is — make sure one job writes this URL",
            url=self.display(rel),
            operation="atomic write",
        )

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Publish a small file only if nothing is at ``rel`` yet; False when something is there.

        Local disks: written to a temporary, made durable, then ``link()``ed into place, which
        fails if the name exists.  Elsewhere a conditional PUT (``If-None-Match: *`` on S3, an
        exclusive open on ``memory://``); a store that cannot do one (fsspec raises) gets a plain
        publish, and the caller must settle races itself (the lease re-reads after a moment).
        """
        if not self.is_local:

            def put_if_absent() -> bool:
                try:
                    self.fs.pipe_file(self.path(rel), data, mode="create")
                    return True
                except FileExistsError:
                    return False
                except (TypeError, NotImplementedError, ValueError):  # no conditional PUT here
                    self.fs.pipe_file(self.path(rel), data)
                    return True
                except Exception as e:
                    if "PreconditionFailed" in repr(e) or "412" in str(e):
                        return False
                    raise

            return self._call("exclusive create", rel, put_if_absent)

        def create() -> bool:
            d, _, name = rel.rpartition("/")
            ops = _local_ops
            dfd = self._dir_fd(d, create=True, operation="write")
            tmp = f"{name}.tmp-{secrets.token_hex(6)}"
            try:
                fd = ops.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                    dir_fd=dfd,
                )
                try:
                    mv = memoryview(data)
                    while mv:
                        mv = mv[ops.write(fd, mv) :]
                    ops.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    ops.link(tmp, name, dir_fd=dfd)
                except FileExistsError:
                    return False
                ops.fsync(dfd)
                return True
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                os.close(dfd)

        return self._call("exclusive create", rel, create)

    def refusal_to_commit(self) -> StorageError:
        """Why nothing can be committed here (no atomic publish is known for this filesystem)."""
        return StorageError(
            f"cannot commit checkpoints to {self.url}: the {self.protocol!r} filesystem "
            f"({type(self.fs).__name__}) is neither a local disk (atomic rename) nor an object "
            f"store whose single PUT is all-or-nothing, so a reader could see a half-written "
            f"MANIFEST.json and take a broken step for a committed one; pass "
            f"commit_method='rename' if its rename atomically replaces the target, or "
            f"commit_method='put' if one write is all-or-nothing",
            url=self.url,
            operation="commit",
        )

    def sync_file(self, rel: str) -> None:
        """Make a file written with ``fsync=False`` durable (a no-op where writes are uploads)."""
        if self.is_local:

            def sync() -> None:
                fd, _ = self._open_regular(rel, "sync")
                try:
                    _local_ops.fsync(fd)
                finally:
                    os.close(fd)

            self._call("sync", rel, sync)

    def sync_dir(self, rel: str) -> None:
        """Make directory entries (new files) durable where that means anything."""
        if self.is_local:

            def sync() -> None:
                fd = self._dir_fd(rel, operation="sync")
                try:
                    _local_ops.fsync(fd)
                finally:
                    os.close(fd)

            self._call("sync", rel, sync)

    def remove(self, rel: str) -> None:
        if self.is_local:

            def unlink() -> None:
                d, _, name = rel.rpartition("/")
                try:
                    dfd = self._dir_fd(d, operation="remove")
                except FileNotFoundError:
                    return
                try:
                    _local_ops.unlink(name, dir_fd=dfd)  # a link is removed, never followed
                except FileNotFoundError:
                    pass
                finally:
                    os.close(dfd)

            self._call("remove", rel, unlink)
            return

        def rm() -> None:
            try:
                self.fs.rm(self.path(rel))
            except FileNotFoundError:
                pass

        self._call("remove", rel, rm)

    def remove_if(
        self, rel: str, holds: Callable[[bytes], bool], max_bytes: int, *, tag: str = ""
    ) -> bool:
        """Remove the small file ``rel`` only if ``holds(its bytes)``: never a file that another
        writer put at that name after it was read (a lease its successor took over meanwhile).
        True when removed; False when it did not hold, or nothing was there.

        Local disks: the file is first renamed aside (atomic) to ``<name>.released-<tag>-<hex>``,
        so what is judged is exactly what is removed; a file that does not hold is linked back
        (unless a new one appeared there meanwhile).  For that moment nothing is at ``rel``:
        readers that must not take that for "removed" look for :meth:`set_aside` files (the tag
        says who judges them).  S3: a conditional DELETE (``If-Match`` on the ETag of what was
        read).  Elsewhere (no rename that replaces, no conditional delete): read, then remove, a
        window of one round trip in which a file put there since is removed too."""
        if not re.fullmatch(r"[0-9a-f]{0,64}", tag):
            raise ValueError(
                f"remove_if's tag must be at most 64 lowercase hex digits, got {tag!r}"
            )
        if self.is_local:
            return self._call(
                "remove", rel, lambda: self._remove_local_if(rel, holds, max_bytes, tag)
            )
        version = self.version_of(rel)  # (the ETag, read before the bytes: a later one differs)
        if version == "":
            return False
        try:
            data = self.read_small(rel, max_bytes)
        except StorageError:
            if not self.exists(rel):
                return False
            raise
        if not holds(data):
            return False
        if version is None:
            self.remove(rel)
            return True

        def delete() -> bool:
            bucket, key, _ = self.fs.split_path(self.path(rel))
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
            except FileNotFoundError:
                return True  # (an earlier attempt's, its answer lost)
            except Exception as e:
                # an older botocore, or an S3-compatible server without conditional deletes
                if _unknown_parameter(e) or _not_implemented(e):
                    server = not _unknown_parameter(e)
                    what = "remove conditionally (If-Match" + (" on DELETE)" if server else ")")
                    self._cannot(what, e, server=server)
                    self.fs.rm(self.path(rel))
                    return True
                if "pre-condition" in str(e) or "PreconditionFailed" in repr(e) or "412" in str(e):
                    return False  # replaced since it was read: another writer's now
                raise
            self.fs.invalidate_cache(self.path(rel))
            return True

        return self._call("remove", rel, delete)

    def _remove_local_if(
        self, rel: str, holds: Callable[[bytes], bool], max_bytes: int, tag: str
    ) -> bool:
        d, _, name = rel.rpartition("/")
        try:
            dfd = self._dir_fd(d, operation="remove")
        except FileNotFoundError:
            return False
        aside = f"{name}.released-{tag + '-' if tag else ''}{secrets.token_hex(6)}"
        try:
            try:
                _local_ops.rename(name, aside, dir_fd=dfd)
            except FileNotFoundError:
                return False
            ours = False
            try:
                ours = holds(self._pread_all(f"{d}/{aside}" if d else aside, max_bytes))
            except ResilientError:
                pass  # (not a regular file, too large: not the file that was meant)
            except FileNotFoundError:
                pass  # put back already, by a reader that found nothing at the name (put_back)
            finally:
                if not ours:  # put back; a file that appeared at the name meanwhile stays
                    _put_back(aside, name, dfd)
            with contextlib.suppress(FileNotFoundError):
                _local_ops.unlink(aside, dir_fd=dfd)
            _local_ops.fsync(dfd)
            return ours
        finally:
            os.close(dfd)

    def set_aside(self, rel: str) -> list[SetAside]:
        """The files a local :meth:`remove_if` of ``rel`` set aside and that are still there,
        the most recently set aside first (none elsewhere: no other store sets anything aside)."""
        if not self.is_local:
            return []
        d, _, name = rel.rpartition("/")

        def scan() -> list[SetAside]:
            try:
                dfd = self._dir_fd(d, operation="list")
            except FileNotFoundError:
                return []
            found = []
            try:
                for entry in os.listdir(dfd):
                    m = _ASIDE_RE.fullmatch(entry[len(name) :]) if entry.startswith(name) else None
                    if m is None:
                        continue
                    try:  # (a rename changes the status change time, not the modification time)
                        ctime = os.stat(entry, dir_fd=dfd, follow_symlinks=False).st_ctime
                    except FileNotFoundError:
                        continue  # (its judging just ended)
                    age = time.time() - ctime
                    found.append(SetAside(f"{d}/{entry}" if d else entry, m.group(1) or "", age))
            finally:
                os.close(dfd)
            return sorted(found, key=lambda a: a.age_s)

        return self._call("list", rel, scan)

    def put_back(self, aside: str, rel: str) -> bool:
        """Give the set-aside file ``aside`` its name ``rel`` again, only if nothing is at
        ``rel`` (a link, then the set-aside name goes: its content is safe at ``rel``); False
        when something is there, or ``aside`` is gone.  A remove_if still judging ``aside``
        finds it gone and leaves things as they are."""
        d, _, name = rel.rpartition("/")

        def link() -> bool:
            dfd = self._dir_fd(d, operation="write")
            try:
                # one step where the system can: linked, then unlinked, the set-aside name stays
                # a moment beside the lease, and a release of that lease then leaves it for
                # another reader to put back (a released lease, held until its timeout)
                if _local_ops.rename_noreplace(aside.rpartition("/")[2], name, dir_fd=dfd):
                    _local_ops.fsync(dfd)
                    return True
                _local_ops.link(aside.rpartition("/")[2], name, dir_fd=dfd)
            except (FileExistsError, FileNotFoundError):
                return False
            else:
                with contextlib.suppress(FileNotFoundError):
                    _local_ops.unlink(aside.rpartition("/")[2], dir_fd=dfd)
                _local_ops.fsync(dfd)
                return True
            finally:
                os.close(dfd)

        return self._call("put back", rel, link)

    def remove_tree(self, rel: str) -> None:
        if self.is_local:

            def rmtree() -> None:
                d, _, name = rel.rpartition("/")
                try:
                    dfd = self._dir_fd(d, operation="remove")
                except FileNotFoundError:
                    return
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        # fd-based: a link inside is removed, never followed out of the tree
                        shutil.rmtree(name, dir_fd=dfd)
                    else:
                        _local_ops.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(dfd)

            self._call("remove", rel, rmtree)
            return

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
        if self.is_local:
            return [self.read_range(rel, a, b) for a, b in ranges]
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


class PinnedFiles:
    """Files of a local step held open and read by descriptor, so a second read of a range sees
    the bytes a first one checked: a path renamed over (a re-save) or deleted (retention) meanwhile
    does not change an open file, and checkpoint files are never written in place.  Close it
    (or use it as a context manager)."""

    def __init__(self, storage: Storage) -> None:
        if not storage.is_local:
            raise ValueError("PinnedFiles holds local files only")
        self.storage = storage
        self._files: dict[str, tuple[int, int]] = {}  # rel -> (fd, size at open)
        self._lock = threading.Lock()  # reader threads open files concurrently

    def _open(self, rel: str) -> tuple[int, int]:
        with self._lock:
            got = self._files.get(rel)
        if got is not None:
            return got

        def open_() -> tuple[int, int]:
            fd, st = self.storage._open_regular(rel, "read")
            return fd, st.st_size

        fd, size = self.storage._call("open", rel, open_)
        with self._lock:
            if rel in self._files:  # another thread opened it first
                os.close(fd)
                return self._files[rel]
            self._files[rel] = (fd, size)
            return fd, size

    def size(self, rel: str) -> int:
        return self._open(rel)[1]

    def read_into(self, rel: str, start: int, out: memoryview) -> int:
        """As ``Storage.read_into``, from the file as it was when first opened here."""
        out = memoryview(out).cast("B")
        fd, _ = self._open(rel)
        return self.storage._call(
            f"read [{start}, {start + len(out)})", rel, lambda: _pread_into(fd, start, out)
        )

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for fd, _ in files.values():
            os.close(fd)

    def __enter__(self) -> PinnedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pread_into(fd: int, start: int, out: memoryview) -> int:
    n = 0
    while n < len(out):
        got = os.preadv(fd, [out[n:]], start + n)
        if got == 0:
            break
        n += got
    return n


# Filesystems whose exclusive open ("xb") is exclusive on the target itself: s3fs sends
# If-None-Match: * with the upload's final request; memory:// and local files create exclusively.
# Elsewhere a rank file is written plainly, and the generation claim alone keeps writers apart.
_EXCLUSIVE_OPEN_PROTOCOLS = frozenset({"s3", "s3a", "memory", "file", "local"})


def _unknown_parameter(e: BaseException) -> bool:
    """Whether ``e`` says the client does not know a parameter it was given (``mode`` for an
    s3fs before 2024.12, ``IfMatch`` for an older botocore)."""
    return isinstance(e, TypeError) or type(e).__name__ == "ParamValidationError"


def _not_implemented(e: BaseException) -> bool:
    """Whether ``e`` is a server's refusal of a request's conditional header (S3's 501
    NotImplemented; s3fs turns it into OSError ENOSYS)."""
    return (
        getattr(e, "errno", None) == errno.ENOSYS
        or "NotImplemented" in repr(e)
        or "NotImplemented" in str(e)
    )


def _conditional_put_ok(fs: Any) -> bool:
    """Whether ``pipe_file(..., IfMatch=etag)`` replaces a file only if it holds ``etag`` (s3fs)."""
    if getattr(fs, "resilient_conditional_put", None) is not None:
        return bool(fs.resilient_conditional_put)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(set(protocols) & {"s3", "s3a"})


def exclusive_open_ok(fs: Any) -> bool:
    """Whether ``fs.open(path, "xb")`` creates ``path`` only where nothing is, on the target (a
    wrapper such as ``simplecache::`` is exclusive on its local cache file, not on the target)."""
    declared = getattr(fs, "resilient_exclusive_open", None)  # a filesystem may say (faulty://)
    if declared is not None:
        return bool(declared)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(set(protocols) & _EXCLUSIVE_OPEN_PROTOCOLS)


def _detect_commit_method(fs: Any, is_local: bool) -> str | None:
    declared = getattr(fs, "resilient_commit_method", None)  # a filesystem may say (faulty://)
    if declared in COMMIT_METHODS:
        return declared
    if is_local:
        return "rename"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "put" if set(protocols) & ATOMIC_PUT_PROTOCOLS else None


def _put_back(aside: str, name: str, dir_fd: int) -> None:
    """Give ``aside`` its name ``name`` again, unless something is at ``name`` now (one rename
    where the system can, see Storage.put_back; else a link, whose set-aside name the caller
    removes)."""
    try:
        if _local_ops.rename_noreplace(aside, name, dir_fd=dir_fd):
            return
        _local_ops.link(aside, name, dir_fd=dir_fd)
    except (FileExistsError, FileNotFoundError):
        pass  # (FileNotFoundError: put back already, Storage.put_back)
    except OSError:  # not a file (a directory cannot be linked): renamed back, where nothing is
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            _local_ops.rename(aside, name, dir_fd=dir_fd)


def _kind_of(name: str, dir_fd: int) -> str:
    try:
        return _describe_mode(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return "not a directory"


def _describe_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory, not a regular file"
    if stat.S_ISREG(mode):
        return "a regular file, not a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO, not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "not a regular file"


def _too_large(storage: Storage, rel: str, size: int | None, max_bytes: int) -> StorageError:
    found = f"{size} bytes" if size is not None else "larger than that"
    return StorageError(
        f"refusing to read {storage.display(rel)}: it is {found}, over the limit of {max_bytes} "
        f"bytes for such a file — it is damaged or not what it claims to be",
        url=storage.display(rel),
        operation="read",
    )


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
