"""An fsspec filesystem that wraps any other and injects latency and errors.

``faulty://`` URLs: ``Storage("faulty:///tmp/ckpt", {"target_protocol": "file", "faults": [...]})``.
Each fault rule is a dict (JSON-able, so it can cross process boundaries in storage_options):

* ``op``: ``read``, ``write``, ``list``, ``exists``, ``remove``, ``mkdir`` or ``any``
* ``error``: ``transient`` (ConnectionError), ``timeout`` (TimeoutError), ``permanent``
  (PermissionError), ``enospc`` (OSError ENOSPC)
* ``path``: only paths containing this substring (default: all)
* ``skip``: let this many matching calls through first (default 0)
* ``count``: fire this many times, then stop (default: always)
* ``probability``: fire on this share of matching calls (default 1; seeded by ``seed``)
* ``latency_s``: with no ``error``, delay matching calls by this much instead of failing them
* ``id``: a name for the rule in the record (default: its index)

``record``: a path to which every fired fault is appended as a JSON line, so that another process
(a chaos harness) can prove it fired.  With a record, ``count`` holds across processes: a restarted
job that finds its rule already fired ``count`` times does not fire it again.

A failing write writes half of its bytes to the target before raising, like a real partial write.
Every fault that fires is appended to ``fs.fired``, so a test can prove the fault happened.
"""

from __future__ import annotations

import errno
import json
import os
import random
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
        record: str | None = None,
        seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.target = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.latency_s = latency_s
        self.rules = [dict(r) for r in (faults or [])]
        for i, r in enumerate(self.rules):
            slow_only = r.get("error") is None and r.get("latency_s")
            if r.get("op", "any") not in OPS or not (slow_only or r.get("error") in ERRORS):
                raise ValueError(
                    f"bad fault rule {r}: op in {OPS}, error in {ERRORS} (or latency_s alone)"
                )
            r.setdefault("id", str(i))
            r["_seen"] = 0
            r["_fired"] = 0
        self.record = record
        self.fired: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    @property
    def resilient_commit_method(self) -> str | None:
        """How a checkpoint commits through this wrapper: as on its target (temp + ``mv`` over a
        local disk, through this filesystem, so write faults fire on it; one PUT on an object
        store); None where the target has neither."""
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(self.target, LocalFileSystem):
            return "rename"
        protocols = self.target.protocol
        protocols = protocols if isinstance(protocols, (tuple, list)) else (protocols,)
        from resilient.checkpoint.storage import ATOMIC_PUT_PROTOCOLS

        return "put" if set(protocols) & ATOMIC_PUT_PROTOCOLS else None

    @property
    def resilient_exclusive_open(self) -> bool:
        """Whether an exclusive open ("xb") is exclusive on the target: as the target's."""
        from resilient.checkpoint.storage import exclusive_open_ok

        return exclusive_open_ok(self.target)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = path[len("faulty://") :] if path.startswith("faulty://") else path
        return path.rstrip("/") or "/"

    # --- fault core ---------------------------------------------------------------------------
    def _maybe_fail(self, op: str, path: str) -> BaseException | None:
        if self.latency_s:
            time.sleep(self.latency_s)
        delay = 0.0
        with self._lock:
            for r in self.rules:
                if r.get("op", "any") not in (op, "any") or r.get("path", "") not in path:
                    continue
                r["_seen"] += 1
                if r["_seen"] <= r.get("skip", 0):
                    continue
                if r.get("count") is not None and self._fired_count(r) >= r["count"]:
                    continue
                if self._rng.random() >= r.get("probability", 1.0):
                    continue
                r["_fired"] += 1
                kind = r.get("error") or "latency"
                self.fired.append((op, path, kind))
                self._record(r, op, path, kind)
                if r.get("error") is None:
                    delay += r["latency_s"]
                    continue
                return make_error(r["error"], op, path)
        if delay:
            time.sleep(delay)  # outside the lock: concurrent calls are slowed, not serialized
        return None

    def _fired_count(self, rule: dict[str, Any]) -> int:
        if not self.record or not os.path.exists(self.record):
            return rule["_fired"]
        with open(self.record) as f:
            return sum(1 for line in f if json.loads(line).get("rule") == rule["id"])

    def _record(self, rule: dict[str, Any], op: str, path: str, kind: str) -> None:
        if not self.record:
            return
        line = json.dumps(
            {"time": time.time(), "rule": rule["id"], "op": op, "path": path, "fault": kind}
        )
        fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

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
