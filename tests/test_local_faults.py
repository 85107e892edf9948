"""Faults injected into the real local-disk write path (os.write, fsync, rename, link), not through
a wrapper filesystem: whatever fails, nothing committed is lost and nothing broken is committed."""

import errno
import os
import stat
import threading

import pytest
import torch

from resilient import Checkpointer, RetryPolicy
from resilient.checkpoint import storage as storage_mod
from resilient.checkpoint.storage import LocalOps
from resilient.errors import StorageError

FAST = RetryPolicy(max_attempts=3, max_total_s=10, initial_backoff_s=0.001, max_backoff_s=0.01)


class FailingOps(LocalOps):
    """The real system calls, except that ``op`` on a name containing ``match`` fails with
    ``errno`` (a write first writes half of its bytes, as a disk that fills up does), ``count``
    times (None: always).  ``fired`` records each fault, to prove it happened."""

    def __init__(self, op: str, match: str, err: int, count: int | None = None) -> None:
        self.op, self.match, self.err, self.count = op, match, err, count
        self.fired: list[tuple[str, str]] = []
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()

    def _hit(self, op: str, name: str) -> bool:
        with self._lock:
            if op != self.op or self.match not in name:
                return False
            if self.count is not None and len(self.fired) >= self.count:
                return False
            self.fired.append((op, name))
            return True

    def _fail(self, name: str):
        return OSError(self.err, f"{os.strerror(self.err)} (injected)", name)

    def open(self, name, flags, mode=0o644, *, dir_fd=None):
        fd = super().open(name, flags, mode, dir_fd=dir_fd)
        self._names[fd] = name
        return fd

    def write(self, fd, data):
        name = self._names.get(fd, "")
        if self._hit("write", name):
            super().write(fd, memoryview(data)[: len(data) // 2])
            raise self._fail(name)
        return super().write(fd, data)

    def fsync(self, fd):
        # a directory's descriptor is opened with os.open, not here: its number may be one a
        # file opened here had before it was closed, so it is told by what it is, not by number
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        name = "<directory>" if is_dir else self._names.get(fd, "<unknown>")
        if self._hit("fsync", name):
            raise self._fail(name)
        super().fsync(fd)

    def rename(self, src, dst, *, dir_fd):
        if self._hit("rename", dst):
            raise self._fail(dst)
        super().rename(src, dst, dir_fd=dir_fd)

    def link(self, src, dst, *, dir_fd):
        if self._hit("link", dst):
            raise self._fail(dst)
        super().link(src, dst, dir_fd=dir_fd)

    def unlink(self, name, *, dir_fd):
        if self._hit("unlink", name):
            raise self._fail(name)
        super().unlink(name, dir_fd=dir_fd)


@pytest.fixture
def inject():
    installed = []

    def install(ops: LocalOps) -> LocalOps:
        installed.append(storage_mod.set_local_ops(ops))
        return ops

    yield install
    if installed:
        storage_mod.set_local_ops(installed[0])


def state(v: float) -> dict:
    return {"w": torch.arange(50_000.0) * v, "v": {"s": v}}


def assert_intact(path, step: int) -> None:
    with Checkpointer(str(path)) as ck:
        assert ck.latest_step() == step
        out = {"w": torch.zeros(50_000), "v": {"s": 0.0}}
        assert ck.load(out) == step
        assert torch.equal(out["w"], torch.arange(50_000.0) * step) and ck.verify(step).ok


def leftovers(path) -> list[str]:
    return sorted(p.name for p in path.rglob("*.tmp-*"))


@pytest.mark.parametrize(
    "op,match,err,hint",
    [
        ("write", "rank_", errno.ENOSPC, "free space on the checkpoint storage"),
        ("fsync", "rank_", errno.EIO, "kept failing"),
        ("link", "rank_", errno.EROFS, "failed after 1 attempt"),  # (rank files: never replaced)
        ("write", "MANIFEST", errno.ENOSPC, "free space"),
        ("fsync", "MANIFEST", errno.EDQUOT, "free space"),
        ("rename", "MANIFEST", errno.EACCES, "check write permissions"),
    ],
)
def test_a_failing_local_write_loses_nothing_committed(tmp_path, inject, op, match, err, hint):
    with Checkpointer(str(tmp_path), retry=FAST) as ck:
        ck.save(1, state(1)).wait()
        ops = inject(FailingOps(op, match, err))
        ck.save(2, state(2))
        with pytest.raises(StorageError, match=hint):
            ck.wait()
        assert ops.fired, "the fault never fired"
        assert ck.steps() == [1]  # the failed step is not committed
        assert_intact(tmp_path, 1)
        assert leftovers(tmp_path) == []  # no temporary left behind
        inject(LocalOps())  # the disk has room again: the next save commits and collects
        ck.save(3, state(3)).wait()
        assert ck.steps() == [1, 3]
    assert not (tmp_path / "step_00000002").exists()
    assert_intact(tmp_path, 3)


def test_a_transient_fsync_error_is_retried_and_the_save_commits(tmp_path, inject):
    with Checkpointer(str(tmp_path), retry=FAST) as ck:
        ck.save(1, state(1)).wait()
        ops = inject(FailingOps("fsync", "rank_", errno.EIO, count=1))
        ck.save(2, state(2)).wait()
        assert ops.fired == [("fsync", ops.fired[0][1])]
    assert_intact(tmp_path, 2)


def test_a_rank_file_put_in_place_before_a_transient_error_is_not_a_conflict(tmp_path, inject):
    """A rank file is linked where nothing is (never replaced); the link took, then the
    temporary's removal failed (a transient error): the retry finds the name taken, by these very
    bytes, and the save commits."""
    with Checkpointer(str(tmp_path), retry=FAST) as ck:
        ck.save(1, state(1)).wait()
        ops = inject(FailingOps("unlink", ".safetensors.tmp-", errno.EIO, count=1))
        ck.save(2, state(2)).wait()
        assert len(ops.fired) == 1 and ops.fired[0][1].startswith("rank_00000")
        assert leftovers(tmp_path) == []
    assert_intact(tmp_path, 2)


def test_a_directory_fsync_failing_at_the_commit_keeps_the_older_steps(tmp_path, inject):
    with Checkpointer(str(tmp_path), retry=FAST, keep_last=1) as ck:
        ck.save(1, state(1)).wait()
        ops = inject(FailingOps("fsync", "<directory>", errno.EIO))
        ck.save(2, state(2))
        with pytest.raises(StorageError):
            ck.wait()
        assert ops.fired
        inject(LocalOps())
        # retention never ran for the failed commit: step 1 is still there and readable
        out = {"w": torch.zeros(50_000), "v": {"s": 0.0}}
        assert ck.load(out, step=1) == 1 and ck.verify(1).ok


def test_enospc_on_one_rank_fails_the_commit_on_every_rank(tmp_path):
    from tests.dist import run_distributed

    out = run_distributed(_enospc_rank, 2, str(tmp_path))
    assert out[1][0] and "No space left on device (injected)" in out[1][1]
    assert "rank 1 failed to write" in out[0][1]
    assert out[0][2] == out[1][2] == [1]
    assert_intact(tmp_path, 1)


def _enospc_rank(rank, world, url):
    from resilient import Layout, Shard, sharded
    from resilient.errors import ResilientError

    lay = Layout(dp=2)
    with Checkpointer(url, layout=lay, retry=FAST) as ck:
        s = {
            "w": sharded(
                torch.arange(50_000.0)[rank * 25_000 : (rank + 1) * 25_000], {"dp": Shard(0)}
            ),
            "v": {"s": 1.0},
        }
        ck.save(1, s).wait()
        if rank == 1:
            storage_mod.set_local_ops(FailingOps("write", "rank_00001", errno.ENOSPC))
        s2 = {
            "w": sharded(
                torch.arange(50_000.0)[rank * 25_000 : (rank + 1) * 25_000] * 2, {"dp": Shard(0)}
            ),
            "v": {"s": 2.0},
        }
        ck.save(2, s2)
        try:
            ck.wait()
            return False, "", ck.steps()
        except ResilientError as e:
            return True, str(e), ck.steps()
