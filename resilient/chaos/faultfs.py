"""An fsspec filesystem that wraps any other and injects latency and errors.

``faulty://`` URLs: ``Storage("faulty:///tmp/ckpt", {"target_protocol": "file", "faults": [...]})``.
Each fault rule is a dict (JSON-able, so it can cross process boundaries in storage_options):

* ``op``: ``read``, ``write``, ``list``, ``exists``, ``remove``, ``mkdir`` or ``any``
* ``error``: ``transient`` (ConnectionError), ``timeout`` (TimeoutError), ``permanent``
  (PermissionError), ``enospc`` (OSError ENOSPC)
* ``path``: only paths containing this substring (default: all)
* ``skip``: let this many matching calls through first (default 0)
* ``count``: fire this many times, then stop (default: always)

A failing write writes half of its bytes to the target before raising, like a real partial write.
Every fault that fires is appended to ``fs.fired``, so a test can prove the fault happened.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

__all__ = ["FaultyFileSystem", "make_error"]

ERRORS = ("transient", "timeout", "permanent", "enospc")
OPS = ("read", "write", "list", "exists", "remove", "mkdir", "any")


def make_error(kind: str, op: str, path: str) -> BaseException:
    what = f"injected {kind} fault on {op} of {path}"
    if kind == "transient":
        return ConnectionError(what)
    if kind == "timeout":
        return TimeoutError(what)
    if kind == "permanent":
        return PermissionError(errno.EACCES, what)
    if kind == "enospc":
        return OSError(errno.ENOSPC, f"No space left on device ({what})")
    raise ValueError(f"unknown fault error {kind!r}; one of {ERRORS}")


class FaultyFileSystem(AbstractFileSystem):
    protocol = "faulty"
    cachable = False

    def __init__(
        self,
        target_protocol: str = "file",
        target_options: dict | None = None,
        latency_s: float = 0.0,
        faults: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.target = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.latency_s = latency_s
        self.rules = [dict(r) for r in (faults or [])]
        for r in self.rules:
            if r.get("op", "any") not in OPS or r.get("error") not in ERRORS:
                raise ValueError(f"bad fault rule {r}: op in {OPS}, error in {ERRORS}")
            r["_seen"] = 0
            r["_fired"] = 0
        self.fired: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = path[len("faulty://") :] if path.startswith("faulty://") else path
        return path.rstrip("/") or "/"

    # --- fault core ---------------------------------------------------------------------------
    def _maybe_fail(self, op: str, path: str) -> BaseException | None:
        if self.latency_s:
            time.sleep(self.latency_s)
        with self._lock:
            for r in self.rules:
                if r.get("op", "any") not in (op, "any") or r.get("path", "") not in path:
                    continue
                r["_seen"] += 1
                if r["_seen"] <= r.get("skip", 0):
                    continue
                if r.get("count") is not None and r["_fired"] >= r["count"]:
                    continue
                r["_fired"] += 1
                self.fired.append((op, path, r["error"]))
                return make_error(r["error"], op, path)
        return None

    def _check(self, op: str, path: str) -> None:
        err = self._maybe_fail(op, path)
        if err is not None:
            raise err

    # --- the filesystem -------------------------------------------------------------------------
    def ls(self, path, detail=True, **kwargs):
        self._check("list", path)
        out = self.target.ls(path, detail=detail)
        return out

    def info(self, path, **kwargs):
        self._check("exists", path)
        return self.target.info(path)

    def exists(self, path, **kwargs):
        self._check("exists", path)
        return self.target.exists(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._check("read", path)
        return self.target.cat_file(path, start=start, end=end)

    def pipe_file(self, path, value, **kwargs):
        err = self._maybe_fail("write", path)
        if err is not None:
            raise err
        self.target.pipe_file(path, value)

    def makedirs(self, path, exist_ok=False):
        self._check("mkdir", path)
        self.target.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path, create_parents=True, **kwargs):
        self._check("mkdir", path)
        self.target.mkdir(path, create_parents=create_parents)

    def rm(self, path, recursive=False, maxdepth=None):
        self._check("remove", path if isinstance(path, str) else str(path))
        self.target.rm(path, recursive=recursive)

    def rm_file(self, path):
        self._check("remove", path)
        self.target.rm_file(path)

    def mv(self, path1, path2, **kwargs):
        self._check("write", path2)
        self.target.mv(path1, path2, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self._check("read", path)
            return self.target.open(path, mode)
        return _FaultyWriter(self, path, self.target.open(path, mode))


class _FaultyWriter:
    """A write handle that fails part-way through when a write fault fires."""

    def __init__(self, fs: FaultyFileSystem, path: str, inner: Any) -> None:
        self.fs, self.path, self.inner = fs, path, inner

    def write(self, data) -> int:
        err = self.fs._maybe_fail("write", self.path)
        if err is not None:
            mv = memoryview(data).cast("B")
            self.inner.write(mv[: len(mv) // 2])
            raise err
        return self.inner.write(data)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
