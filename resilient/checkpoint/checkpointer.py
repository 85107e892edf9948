"""The Checkpointer: the public save/load interface (DESIGN.md section 5).

Owns the lifecycle of saves (one in flight, background failures re-raised at the next call),
finding steps, and load with resharding and optional fallback.  The pieces it drives live in
state.py (what a state is), writer.py (save), reader.py (load), retention.py and storage.py.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient.checkpoint.format import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    Manifest,
    rank_file_name,
    step_dir_name,
)
from resilient.checkpoint.reader import (
    ReadStats,
    execute_reads,
    plan_reads,
    read_manifest,
    verify_step,
)
from resilient.checkpoint.retention import committed_steps, delete_dirs, retire_steps
from resilient.checkpoint.state import FlatState, flatten_state, is_dtensor
from resilient.checkpoint.storage import RetryPolicy, Storage
from resilient.checkpoint.writer import (
    CommitError,
    Committer,
    Stager,
    WritePlan,
    build_manifest,
    next_generation,
    persist_rank_file,
    plan_writes,
)
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ResilientError,
    StateMismatchError,
)
from resilient.layout import Layout, from_device_mesh

__all__ = ["Checkpointer", "SaveHandle", "SaveStats", "LoadStats"]

log = logging.getLogger(__name__)


def _version() -> str:
    from resilient import __version__

    return __version__


@dataclass
class SaveStats:
    step: int
    stage_s: float = 0.0  # the part the caller waits for
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    committed: bool = False


@dataclass
class LoadStats:
    step: int
    bytes_read: int = 0
    bytes_verified: int = 0
    num_requests: int = 0
    resharded: bool = False
    seconds: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)


class SaveHandle:
    """A save in progress.  ``wait()`` blocks until it is committed and re-raises its failure."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.stats = SaveStats(step)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._error_reported = False
        self.started_at = time.time()
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """The background failure of a finished save (None while running or on success)."""
        return self._error

    def wait(self, timeout: float | None = None) -> SaveStats:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            self._error_reported = True
            raise self._error
        return self.stats

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self.finished_at = time.time()
        self._done.set()


class Checkpointer:
    """Sharded, asynchronous, checksummed checkpoints of a (distributed) training state.

    ``Checkpointer(url, *, layout=None, keep_last=3, keep_every=None, compression=None,
    storage_options=None)``.  In a process group every rank makes the same calls with the same
    step.  ``layout`` defaults to the mesh of the first DTensor in the state, or ``Layout(dp=W)``.
    """

    _instances = 0

    def __init__(
        self,
        url: str,
        *,
        layout: Layout | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        commit_timeout_s: float = 600.0,
        store: Any | None = None,
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last must be an int >= 1 (the newest step is always kept), got {keep_last!r}"
            )
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be None or an int >= 1, got {keep_every!r}")
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        if not 4096 <= block_bytes <= 1 << 30:
            raise ValueError(f"block_bytes must be in [4 KiB, 1 GiB], got {block_bytes}")
        self.storage = Storage(url, storage_options, retry)
        self.url = self.storage.url
        self.keep_last, self.keep_every, self.compression = keep_last, keep_every, compression
        self.block_bytes = block_bytes
        self.commit_timeout_s = commit_timeout_s
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        if layout is not None:
            layout.check_world_size(self.world_size)
        self.layout = layout
        self._store = store
        self._uid: int | None = None
        self._seq = 0
        self._stager = Stager()
        self._plan_cache: tuple[Any, WritePlan] | None = None
        self._pending: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last_load: LoadStats | None = None

    # --- context manager ------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- queries ----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        return read_manifest(self.storage, self._resolve_step(step))

    def verify(self, step: int | None = None):
        """Read every byte of a step and check it; returns a VerifyReport."""
        return verify_step(self.storage, self._resolve_step(step))

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` and persist it in the background; returns once the snapshot is staged.

        Waits for the previous save first (one in flight) and re-raises its failure, if any.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._join_pending()
        t0 = time.monotonic()
        layout = self._layout_for(state)
        flat = flatten_state(state, layout, self.rank)
        plan = self._plan(flat, layout)
        data = self._stager.stage(plan, flat.tensors)
        handle = SaveHandle(step)
        handle.stats.stage_s = time.monotonic() - t0
        committer = self._committer()
        self._pending = handle
        self._thread = threading.Thread(
            target=self._persist,
            args=(handle, step, layout, plan, data, dict(flat.values), committer),
            name=f"resilient-ckpt-save-{step}",
            daemon=True,
        )
        self._thread.start()
        return handle

    def wait(self) -> SaveStats | None:
        """Block until the pending save is committed; re-raise its failure."""
        self._check_open()
        return self._join_pending()

    def close(self) -> None:
        """Wait for the pending save and release buffers; re-raises a background failure."""
        if self._closed:
            return
        try:
            self._join_pending()
        finally:
            self._closed = True
            self._stager = Stager()

    def _join_pending(self) -> SaveStats | None:
        handle = self._pending
        if handle is None:
            return None
        if self._thread is not None:
            self._thread.join()
        self._pending, self._thread = None, None
        if handle._error is not None and handle._error_reported:
            return handle.stats  # the caller already saw this failure through the handle
        return handle.wait()

    def _persist(
        self,
        handle: SaveHandle,
        step: int,
        layout: Layout,
        plan: WritePlan,
        data: torch.Tensor,
        values: dict[str, Any],
        committer: Committer,
    ) -> None:
        error: BaseException | None = None
        step_rel = step_dir_name(step)
        garbage: list[str] = []
        try:
            try:
                t0 = time.monotonic()
                self.storage.makedirs(step_rel)
                generation = next_generation(self.storage, step_rel)
                file = rank_file_name(self.rank, generation)
                res = persist_rank_file(
                    self.storage,
                    step_rel,
                    file,
                    plan,
                    data,
                    block_bytes=self.block_bytes,
                    compression=self.compression,
                    step=step,
                )
                handle.stats.write_s = time.monotonic() - t0
                handle.stats.bytes_written = res.size_bytes
                report = {
                    "rank": self.rank,
                    "file": res.file,
                    "size_bytes": res.size_bytes,
                    "chunks": {k: c.to_json() for k, c in res.chunks.items()},
                    "digest": plan.digest,
                    "num_tensors": len(plan.tensors),
                    "values": values,
                }
            except BaseException as e:
                report = {"rank": self.rank, "error": f"{type(e).__name__}: {e}"}
                raise
            finally:
                if not committer.is_coordinator:
                    committer.report(report)
            t1 = time.monotonic()
            if committer.is_coordinator:
                garbage = self._coordinate(
                    committer, report, step, step_rel, layout, plan, generation
                )
            else:
                outcome = committer.wait_outcome()
                if outcome != "ok":
                    raise CommitError(f"step {step} was not committed: {outcome}")
            handle.stats.commit_s = time.monotonic() - t1
            handle.stats.committed = True
        except BaseException as e:  # stored, re-raised at the next save/wait/close
            error = (
                e
                if isinstance(e, ResilientError)
                else CommitError(
                    f"save of step {step} to {self.url} failed on rank {self.rank}: {type(e).__name__}: {e}"
                )
            )
            if error is not e:
                error.__cause__ = e
            if committer.is_coordinator and committer.store is not None:
                try:
                    committer.publish(f"{type(e).__name__}: {e}")
                except Exception:  # the store itself may be gone
                    pass
            log.error("checkpoint save of step %d failed on rank %d: %s", step, self.rank, error)
        handle._finish(error)
        # Deleting retired bytes is not part of making this step durable, but it stays on this
        # thread, so the next save (which joins it) never overlaps it.
        try:
            delete_dirs(self.storage, garbage)
        except Exception as e:
            log.warning("deleting retired checkpoint files failed: %s", e)

    def _coordinate(
        self,
        committer: Committer,
        own: dict[str, Any],
        step: int,
        step_rel: str,
        layout: Layout,
        plan: WritePlan,
        generation: int,
    ) -> None:
        reports = committer.gather(own) if committer.store is not None else [own]
        manifest = build_manifest(
            step,
            layout,
            plan,
            reports,
            block_bytes=self.block_bytes,
            generation=generation,
            version=_version(),
        )
        self.storage.sync_dir(step_rel)
        from resilient.checkpoint.format import manifest_to_bytes

        self.storage.write_atomic(f"{step_rel}/{MANIFEST_NAME}", manifest_to_bytes(manifest))
        # Committed.  Housekeeping failures from here on are logged, never a failed save.  Steps
        # that retention drops are uncommitted before the outcome is published, so every rank's
        # wait() sees the same steps; their bytes are deleted after (see _persist).
        garbage: list[str] = []
        try:
            # Files of an older generation of this step, and temp files, are garbage now.
            for name in self.storage.listdir(step_rel):
                if name != MANIFEST_NAME and name not in manifest.files:
                    garbage.append(f"{step_rel}/{name}")
            garbage += retire_steps(self.storage, self.keep_last, self.keep_every, in_progress=step)
        except Exception as e:
            log.warning("retention after committing step %d failed: %s", step, e)
        committer.publish("ok")
        committer.cleanup()
        return garbage

    def _committer(self) -> Committer:
        if self.world_size == 1:
            return Committer(None, "", 0, 1, self.commit_timeout_s)
        store = self._store
        if store is None:
            store = dist.distributed_c10d._get_default_store()
            self._store = store
        if self._uid is None:
            # Every rank increments one counter once per Checkpointer; ranks agree on the result
            # without a collective, and a store that outlives a restart never reuses a prefix.
            n = store.add("resilient/ckpt/instances", 1)
            self._uid = (n - 1) // self.world_size
        self._seq += 1
        return Committer(
            store,
            f"resilient/ckpt/{self._uid}/{self._seq}",
            self.rank,
            self.world_size,
            self.commit_timeout_s,
        )

    def _plan(self, flat: FlatState, layout: Layout) -> WritePlan:
        sig = (
            layout,
            tuple(
                (k, v.local.dtype, v.shape, v.placement, tuple(v.local.shape))
                for k, v in sorted(flat.tensors.items())
            ),
        )
        if self._plan_cache is None or self._plan_cache[0] != sig:
            self._plan_cache = (sig, plan_writes(flat.tensors, layout, self.rank))
        return self._plan_cache[1]

    def _layout_for(self, state: Mapping[str, Any]) -> Layout:
        if self.layout is None:
            mesh = _find_mesh(state)
            if mesh is not None and mesh.size() == self.world_size:
                self.layout = from_device_mesh(mesh)
            else:
                self.layout = Layout(dp=self.world_size)
        return self.layout

    # --- load ---------------------------------------------------------------------------------
    def load(
        self, state: Mapping[str, Any], step: int | None = None, *, fallback: bool = False
    ) -> int:
        """Fill ``state`` in place from ``step`` (default: the newest committed); returns the step.

        Reshards when the saving layout differs.  With ``fallback=True`` and ``step=None``, a newest
        step that fails verification is skipped (with a warning) for the one before it; in a process
        group the ranks agree on the step (a collective, from the caller's thread).
        """
        self._check_open()
        self._join_pending()
        t0 = time.monotonic()
        if step is not None:
            candidates = [self._resolve_step(step)]
        else:
            candidates = self.steps()[::-1]
            if not candidates:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.url}; save one first, or check the URL"
                )
            if not fallback:
                candidates = candidates[:1]
        layout = self._layout_for(state)
        skipped: list[int] = []
        for i, s in enumerate(candidates):
            error: BaseException | None = None
            try:
                stats = self._load_step(state, s, layout)
            except Exception as e:  # every rank must reach the agreement below, whatever failed
                error = e
            if not self._all_ok(error is None) and error is None:
                error = CheckpointCorruptError(f"step {s} failed to load on another rank")
            if error is not None and not isinstance(error, CheckpointCorruptError):
                raise error  # a mismatched state or a storage failure: an older step will not help
            if error is None:
                stats.skipped_steps = skipped
                stats.seconds = time.monotonic() - t0
                self.last_load = stats
                return s
            if i + 1 == len(candidates):
                raise error
            warnings.warn(f"{error}; falling back to step {candidates[i + 1]}", stacklevel=2)
            log.warning(
                "step %d failed verification (%s); falling back to step %d",
                s,
                error,
                candidates[i + 1],
            )
            skipped.append(s)
        raise AssertionError("unreachable")

    def _all_ok(self, ok: bool) -> bool:
        if not self._distributed or self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _load_step(self, state: Mapping[str, Any], step: int, layout: Layout) -> LoadStats:
        manifest = read_manifest(self.storage, step)
        flat = flatten_state(state, layout, self.rank, for_load=True)
        items = plan_reads(manifest, flat.tensors, layout, self.rank)
        dests = {k: leaf.local for k, leaf in flat.tensors.items()}
        rs: ReadStats = execute_reads(self.storage, manifest, items, dests)
        missing = [
            k
            for k in flat.values
            if k not in manifest.extras and k not in manifest.rank_extras.get(self.rank, {})
        ]
        if missing:
            raise StateMismatchError(
                f"step {step} has no values for {missing[:8]}; it was saved from a different state"
            )
        mine = manifest.rank_extras.get(self.rank, {})
        for key, current in flat.values.items():
            value = mine.get(key, manifest.extras.get(key))
            if isinstance(current, tuple) and isinstance(value, list):
                value = tuple(value)
            setter = flat.setters.get(key)
            if setter is not None:
                setter(value)
            elif value != current:
                raise StateMismatchError(
                    f"state key {key!r} holds {current!r} inside an immutable container; step {step} "
                    f"has {value!r} — use a list or dict so it can be restored"
                )
        for fin in flat.finalizers:
            fin()
        return LoadStats(
            step,
            rs.bytes_read,
            rs.bytes_verified,
            rs.num_requests,
            resharded=manifest.layout != layout,
        )

    def _resolve_step(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.url}; save one first, or check the URL"
                )
            return steps[-1]
        if step not in steps:
            shown = ", ".join(map(str, steps[-10:])) if steps else "none"
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint under {self.url}; committed steps: {shown}"
            )
        return step

    def _check_open(self) -> None:
        if self._closed:
            raise ResilientError(f"Checkpointer({self.url!r}) is closed")


def _find_mesh(state: Any) -> Any:
    if is_dtensor(state):
        return state.device_mesh
    if isinstance(state, torch.nn.Module):
        for p in state.parameters():
            if is_dtensor(p):
                return p.device_mesh
        return None
    if isinstance(state, Mapping):
        for v in state.values():
            m = _find_mesh(v)
            if m is not None:
                return m
    return None
