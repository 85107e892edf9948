"""Durable writes out of the trainer's process: with the memory tier on, a durable save is a memory
snapshot that the persister process (resilient/checkpoint/persister.py) verifies, copies to the URL
and commits; when the trainer dies, the persister writes out the newest snapshot that durable
storage lacks."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient import CheckpointCorruptError, Checkpointer, LeaseError, ResilientError
from resilient.checkpoint.persister import OUTBOX, Promoter, link_to_outbox
from tests.dist import run_distributed
from tests.test_memory_tier import _bump, _model, _weights


def _same(m: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(m.state_dict()[k], want[k]) for k in want)


def _wait_for(what: str, cond, timeout_s: float = 120.0) -> None:
    """An event, not a time: poll until ``cond()`` holds (the bound only ends a broken test)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (our child, not yet reaped) is gone for this purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_durable_saves_are_committed_by_another_process(tmp_path):
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1) as ck:
        _bump(m, 1.0)
        ck.save(3, {"model": m}).wait()
        want = _weights(m)
        pid = ck.persister_pid
        assert pid is not None and pid != os.getpid() and _alive(pid)
        # the writer lease of the URL is held by the persister, not by this process
        lease = json.loads((url / "LEASE.json").read_text())
        assert lease["pid"] == pid
        _bump(m, 1.0)
        ck.save(4, {"model": m}).wait()
        assert ck.persister_pid == pid  # one process for the job, not one per save
        # it checked, copied and committed two steps without torch (a second of CPU and about
        # 190 MB less at its start, taken from the trainer's node)
        maps = Path(f"/proc/{pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text()
    assert not _alive(pid)  # close() said goodbye and waited
    assert not (url / "LEASE.json").exists()
    fresh = Checkpointer(str(url))
    assert fresh.steps() == [3, 4] and fresh.verify(3).ok and fresh.verify(4).ok
    m2 = _model(1)
    assert fresh.load({"model": m2}, step=3) == 3 and _same(m2, want)
    manifest = fresh.manifest(3)
    assert "_resilient_durable_anchor" not in json.dumps(manifest.to_json())
    assert manifest.commit_seq == 1 and fresh.manifest(4).commit_seq == 2


def test_where_another_process_cannot_write_the_trainer_does(tmp_path):
    # an in-process fsspec filesystem, or compression (the persister copies bytes as they are)
    with Checkpointer("memory://persister-test", memory_every=1) as ck:
        ck.save(1, {"model": _model()}).wait()
        assert ck.persister_pid is None and ck.steps() == [1]
    with Checkpointer(str(tmp_path / "z"), memory_every=1, compression="zstd") as ck:
        ck.save(1, {"model": _model()}).wait()
        assert ck.persister_pid is None and ck.steps() == [1]
    with pytest.raises(ValueError, match="persister=True cannot work here.*memory"):
        Checkpointer("memory://persister-test-2", memory_every=1, persister=True)


_TRAINER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from resilient import Checkpointer
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    ck = Checkpointer(sys.argv[1], memory_every=1)
    own = sys.argv[3] == "own"  # the durable save written by this process, not the persister
    for step in range(1, 9):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        if own and step == 2:  # the tmpfs is full for a moment: this snapshot fails
            ck.wait_snapshot()
            persist = ck._memory._slots.persist
            def full(*a, **k):
                raise OSError(28, "No space left on device (injected)")
            ck._memory._slots.persist = full
            ck.snapshot(step, {"model": m})
            try:
                ck.wait_snapshot()
            except Exception:
                pass
            ck._memory._slots.persist = persist
            continue
        ck.snapshot(step, {"model": m})
        # own: the persister writes step 1, this process step 3 (after the failed snapshot)
        if step in ((1, 3) if own else (4,)):
            ck.save(step, {"model": m}).wait()
    ck.wait_snapshot()
    torch.save(m.state_dict(), sys.argv[2])  # (the test's reference: not a checkpoint)
    if os.fork() == 0:  # a forked child (a data loader's worker) keeps the persister's pipe open
        import time
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # (not the test's output pipe: the test would wait for it)
        os.dup2(null, 2)
        done = os.path.join(sys.argv[1], "step_00000008", "MANIFEST.json")
        for _ in range(1200):  # until the persister has flushed (or 2 minutes)
            if os.path.exists(done):
                break
            time.sleep(0.1)
        os._exit(0)
    print(ck.persister_pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no goodbye: the trainer is gone
    """
)


@pytest.mark.parametrize("saved_by", ["persister", "own"])
def test_a_killed_trainers_newest_snapshot_is_flushed_to_durable_storage(tmp_path, saved_by):
    """``own``: the durable save was written by the trainer itself (its memory tier's last
    snapshot had failed), which took the writer lease over from the persister: the persister
    takes it anew to flush (it was lost to it for good: the flush failed with a LeaseError)."""
    url = tmp_path / "ckpt"
    ref = tmp_path / "reference.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _TRAINER, str(url), str(ref), saved_by],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.split()[-1])
    # the persister saw the trainer go (its pipe is still held open by the forked child), wrote
    # step 8 out and exited
    _wait_for("the persister's exit", lambda: not _alive(pid))
    ck = Checkpointer(str(url))
    assert ck.steps() == ([1, 3, 8] if saved_by == "own" else [4, 8])
    assert ck.verify(8).ok
    m = _model(1)
    ck.load({"model": m})
    want = torch.load(ref, weights_only=True)
    assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
    log = next(Path(os.environ["RESILIENT_MEMORY_ROOT"]).glob("job-*/persister.log")).read_text()
    assert "is gone" in log and "flushed step 8" in log


def _promoter(ck: Checkpointer) -> Promoter:
    """The persister's worker, in this process, for a checkpointer without a persister."""
    assert ck.memory is not None
    outbox = os.path.join(ck.memory.dir, OUTBOX, "test")
    return Promoter(dict(_config(ck), job_dir=ck.memory.dir, outbox=outbox))


def test_a_damaged_snapshot_is_never_promoted(tmp_path):
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        ck.snapshot(5, {"model": m}).wait()
        promoter = _promoter(ck)
        src = link_to_outbox(ck.memory.steps, 5, promoter.outbox)
        rank_file = Path(src) / "rank_00000.safetensors"
        data = bytearray(rank_file.read_bytes())
        data[-3] ^= 0xFF  # the outbox holds links: the snapshot itself is damaged
        rank_file.write_bytes(bytes(data))
        with pytest.raises(CheckpointCorruptError, match="does not match its checksums"):
            promoter.persist(5)
        promoter.close()
        assert not Path(src).exists()  # the outbox entry goes, whatever happened
    assert Checkpointer(str(url)).steps() == []


def _config(ck: Checkpointer) -> dict:
    return {
        "url": ck.url,
        "storage_options": {},
        "retry": {},
        "commit_method": ck.storage.commit_method,
        "job_id": ck.job_id,
        "keep_last": 3,
        "keep_every": None,
        "lease_timeout_s": 60.0,
    }


def test_a_stale_snapshot_is_never_flushed(tmp_path):
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        ck.save(30, {"model": m}).wait()
        ck.save(40, {"model": m}).wait()
        ck.snapshot(100, {"model": m}).wait()  # descends from 40
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        ck.load({"model": m}, step=30)  # a rollback to 30: 40 and snapshot 100 are abandoned
        ck.save(35, {"model": m}).wait()
        promoter = _promoter(ck)
        assert promoter.flush() is None
        promoter.close()
        assert ck.latest_step() == 35 and ck.commits() == [30, 40, 35]


@pytest.mark.parametrize("commit_every", [1, 0], ids=["committed", "sealed"])
def test_an_older_runs_snapshot_is_not_flushed_over_a_later_runs_durable_commit(
    tmp_path, commit_every
):
    """tests/test_memory_runs.py's older_then_later_run: run 3's flush on X must not persist run
    1's snapshot 20 (descended from 10, still on the line; if only sealed, the flush seals it as
    run 1's) over run 2's newer line."""
    from tests.test_memory_runs import older_then_later_run

    with older_then_later_run(tmp_path, commit_every)() as ck:
        assert ck.memory_steps() == ([20] if commit_every else [])  # (sealed: not committed)
        promoter = _promoter(ck)
        assert promoter.flush() is None
        promoter.close()
        assert ck.latest_step() == 15 and ck.commits() == [10, 15]


def _fail_a_snapshot(ck: Checkpointer, step: int, state: dict) -> None:
    """The tmpfs is full for a moment: the snapshot of ``step`` fails (the next durable save is
    written by the trainer itself, which takes the writer lease over from the persister)."""
    ck.wait_snapshot()
    persist = ck._memory._slots.persist

    def full(*a, **k):
        raise OSError(28, "No space left on device (injected)")

    ck._memory._slots.persist = full
    try:
        with pytest.raises(ResilientError, match="No space left"):
            ck.snapshot(step, state).wait()
    finally:
        ck._memory._slots.persist = persist


@pytest.mark.parametrize("last_saved_by", ["persister", "trainer"])
def test_a_newer_snapshot_is_flushed_when_the_trainer_closes(tmp_path, last_saved_by):
    """``trainer``: the last durable save was written by the trainer itself, holding the lease
    the persister had before: the goodbye says it released it, and the flush takes it anew."""
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1) as ck:
        ck.save(2, {"model": m}).wait()
        if last_saved_by == "trainer":
            _fail_a_snapshot(ck, 3, {"model": m})
            ck.save(4, {"model": m}).wait()
        _bump(m, 1.0)
        ck.snapshot(5, {"model": m}).wait()
        want = _weights(m)
    # nothing newer in memory is lost when the job ends: the goodbye flushes step 5
    ck = Checkpointer(str(url))
    assert ck.steps() == ([2, 4, 5] if last_saved_by == "trainer" else [2, 5])
    if last_saved_by == "trainer":  # (released before the goodbye: no renewal races the flush)
        log = next(Path(os.environ["RESILIENT_MEMORY_ROOT"]).glob("job-*/persister.log"))
        assert "released it; taking it anew" in log.read_text()
    m2 = _model(1)
    assert ck.load({"model": m2}) == 5 and _same(m2, want)


def test_a_dead_persister_fails_its_save_and_is_replaced(tmp_path):
    m = _model()
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1) as ck:
        ck.save(1, {"model": m}).wait()
        first = ck.persister_pid
        os.kill(first, signal.SIGKILL)
        _wait_for("the persister's death", lambda: not _alive(first))
        _bump(m, 1.0)
        ck.snapshot(2, {"model": m}).wait()  # rank 0 starts another with the snapshot
        ck.save(2, {"model": m}).wait()
        assert ck.persister_pid not in (None, first)
        assert ck.steps() == [1, 2]


@pytest.mark.parametrize("last", ["snapshot", "save in flight"])
def test_a_checkpointer_dropped_unclosed_lets_go_once_collected(tmp_path, last):
    """A checkpointer dropped without close() (``del`` in a notebook) lets go once it is
    collected, as close() would: its persister flushes what durable storage lacks and exits,
    its rank's lock and its lease in memory go, and a new one of the URL in this process
    snapshots and saves at once (its persister waited for ever on the dropped one's lock, its
    snapshot met a live lease).  A save still in flight keeps its checkpointer until it is over."""
    url, m = str(tmp_path / "ckpt"), _model()
    ck = Checkpointer(url, memory_every=1)
    ck.save(1, {"model": m}).wait()
    _bump(m, 1.0)
    if last == "snapshot":
        ck.snapshot(2, {"model": m}).wait()  # newer than durable storage: for the flush
    else:
        ck.save(2, {"model": m})
    want, pid = _weights(m), ck.persister_pid
    del ck
    gc.collect()
    _wait_for("the dropped checkpointer's persister to exit", lambda: not _alive(pid), 30)
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.steps() == [1, 2]
        m2 = _model(1)
        assert ck.load({"model": m2}) == 2 and _same(m2, want)
        _bump(m2, 1.0)
        ck.snapshot(3, {"model": m2}).wait()
        ck.save(3, {"model": m2}).wait()
    assert Checkpointer(url).steps() == [1, 2, 3]


def test_another_jobs_lease_is_a_lease_error(tmp_path):
    url = tmp_path / "ckpt"
    # heartbeats every 2.5 s: the persister sees one long before the lease could count as stale
    with Checkpointer(str(url), job_id="other-job", lease_timeout_s=10) as other:
        other.save(1, {"model": _model()}).wait()  # holds the lease until closed
        with Checkpointer(str(url), memory_every=1, job_id="this-job", lease_timeout_s=10) as ck:
            with pytest.raises(LeaseError, match="other-job"):
                ck.save(2, {"model": _model()}).wait()
            assert ck.steps() == [1]


def _two_ranks(rank: int, world: int, url: str) -> tuple:
    m = _model()
    ck = Checkpointer(url, memory_every=1)
    _bump(m, float(rank))  # rank 1 holds other values: each rank's share is its own
    ck.snapshot(1, {"model": m}).wait()
    stats = ck.save(1, {"model": m}).wait()
    pid = ck.persister_pid
    ck.close()
    return stats.committed, pid


def test_two_ranks_save_through_rank_zeros_persister(tmp_path):
    results = run_distributed(_two_ranks, 2, str(tmp_path / "ckpt"))
    assert results[0][0] and results[1][0]
    assert results[0][1] is not None and results[1][1] is None  # one persister: rank 0's
    ck = Checkpointer(str(tmp_path / "ckpt"))
    assert ck.steps() == [1] and ck.verify(1).ok


def test_a_relative_url_means_the_same_directory_to_the_persister(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with Checkpointer("ckpt", memory_every=1) as ck:
        monkeypatch.chdir(tmp_path / "b")  # the persister starts from here, at the first save
        ck.save(1, {"model": _model()}).wait()
    assert Checkpointer(str(tmp_path / "a" / "ckpt")).steps() == [1]
    assert not (tmp_path / "b" / "ckpt").exists()


def _durable_1_then_snapshots_2_3(ck: Checkpointer, m: torch.nn.Module) -> tuple[dict, Path]:
    """Durable step 1, snapshots 2 and 3 (each a step further): step 2's weights, and step 3's
    rank file in memory."""
    ck.save(1, {"model": m}).wait()
    _bump(m, 1.0)
    ck.snapshot(2, {"model": m}).wait()
    want = _weights(m)
    _bump(m, 1.0)
    ck.snapshot(3, {"model": m}).wait()
    return want, Path(ck.memory.steps) / "step_00000003" / "rank_00000.safetensors"


def test_the_flush_skips_a_damaged_newest_snapshot_for_an_older_one(tmp_path):
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        want, step3 = _durable_1_then_snapshots_2_3(ck, m)
        data = bytearray(step3.read_bytes())
        data[-3] ^= 0xFF
        step3.write_bytes(bytes(data))
        promoter = _promoter(ck)
        # (the trainer's goodbye: it releases the lease it took for its own save of step 1;
        # a flush takes no lease from a live holder, not even the same job's)
        ck._lease.release()
        assert promoter.flush()["step"] == 2
        promoter.close()
    fresh = Checkpointer(str(url))
    assert fresh.steps() == [1, 2]
    m2 = _model(1)
    assert fresh.load({"model": m2}) == 2 and _same(m2, want)


def test_a_fifo_in_place_of_a_snapshots_rank_file_is_skipped_not_waited_on(tmp_path):
    """The memory directory is untrusted: a FIFO planted as the newest snapshot's rank file
    used to block the flush's open() forever, holding PERSISTER.lock and renewing the URL's
    writer lease.  Now the flush refuses it and persists the snapshot before it."""
    import threading

    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        want, rank_file = _durable_1_then_snapshots_2_3(ck, m)
        rank_file.unlink()
        os.mkfifo(rank_file)
        ck._lease.release()
        promoter, result = _promoter(ck), {}
        flush = threading.Thread(target=lambda: result.update(out=promoter.flush()), daemon=True)
        flush.start()
        flush.join(120.0)
        if flush.is_alive():  # (let the blocked open() go, so that the test can end)
            os.close(os.open(rank_file, os.O_WRONLY | os.O_NONBLOCK))
            flush.join(30.0)
            pytest.fail("the flush blocked on a FIFO in place of a rank file")
        promoter.close()
        assert result["out"]["step"] == 2, result
    m2 = _model(1)
    assert Checkpointer(str(url)).load({"model": m2}) == 2 and _same(m2, want)


@pytest.mark.parametrize("then", ["rolled-back", "same-state"])
def test_the_flush_after_a_rollback_to_the_same_step_number(tmp_path, then):
    """Durable 3 and 5; the job rolls back to 3 and its new line reaches step 5 in memory (a load
    on this node restores that snapshot).  The flush used to compare step numbers only and wrote
    nothing, so a rerun on nodes with empty memory resumed the abandoned line's 5.  A durable 5
    that holds the same state as the snapshot is not written again."""
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        ck.save(3, {"model": m}).wait()
        _bump(m, 100.0)
        ck.save(5, {"model": m}).wait()
    old5 = _weights(m)
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        if then == "rolled-back":
            assert ck.load({"model": m}, step=3) == 3
            _bump(m, 1.0)
            ck.snapshot(4, {"model": m}).wait()
            _bump(m, 1.0)
        else:
            assert ck.load({"model": m}) == 5
        ck.snapshot(5, {"model": m}).wait()
        want = _weights(m)
        if ck._lease is not None:
            ck._lease.release()
        promoter = _promoter(ck)
        flushed = promoter.flush()
        promoter.close()
    fresh = Checkpointer(str(url))
    m2 = _model(1)
    assert fresh.load({"model": m2}) == 5 and _same(m2, want)
    if then == "rolled-back":
        assert flushed is not None and flushed["step"] == 5 and not _same(m2, old5)
    else:
        assert flushed is None and fresh.commits() == [3, 5]


def test_durable_saves_go_on_when_the_memory_tier_fails(tmp_path):
    import shutil

    m = _model()
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1) as ck:
        shutil.rmtree(ck.memory.steps)
        Path(ck.memory.steps).write_text("not a directory")  # every snapshot fails from now on
        with pytest.raises(ResilientError):
            ck.snapshot(1, {"model": m}).wait()
        # the persister cannot serve (its snapshots fail): this process writes the save
        ck.save(2, {"model": m}).wait()
        assert ck.steps() == [2]
    with Checkpointer(str(tmp_path / "ckpt2"), memory_every=1) as ck:
        ck.close_memory()  # the tier is closed: durable saves are this process's again
        ck.save(1, {"model": m}).wait()
        assert ck.steps() == [1]


def test_durable_saves_go_back_to_the_persister_once_snapshots_work_again(tmp_path):
    """A snapshot fails (a full tmpfs, for a moment): the next durable save is written by this
    process, which takes the writer lease over from the persister, as the same job may.  Once
    snapshots work again, the persister commits the saves again: this process releases the
    lease first, and the persister takes it anew (it had lost it for good: every later save
    failed with a LeaseError)."""
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1) as ck:
        state = {"model": m}

        def lease_holder() -> int:
            return json.loads((url / "LEASE.json").read_text())["pid"]

        _bump(m, 1.0)
        ck.save(1, state).wait()
        persister = ck.persister_pid
        assert persister is not None and lease_holder() == persister
        _bump(m, 1.0)
        _fail_a_snapshot(ck, 2, state)
        _bump(m, 1.0)
        ck.save(3, state).wait()  # written by this process
        assert lease_holder() == os.getpid() and ck.steps()[-1] == 3
        for step in (4, 5, 6):
            _bump(m, 1.0)
            ck.snapshot(step, state).wait()
            ck.save(step, state).wait()
        assert ck.persister_pid == persister and lease_holder() == persister
        want = _weights(m)
        assert ck.steps()[-3:] == [4, 5, 6]
    log = next(Path(os.environ["RESILIENT_MEMORY_ROOT"]).glob("job-*/persister.log")).read_text()
    assert "taking it anew" in log
    m2 = _model(1)
    fresh = Checkpointer(str(url))
    assert fresh.load({"model": m2}) == 6 and _same(m2, want) and fresh.verify(6).ok


_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage
    WriterLease(Storage(sys.argv[1]), sys.argv[2], timeout_s=60.0).acquire()
    print("held", flush=True)
    if sys.argv[3] == "dies":
        os._exit(0)  # dead, holding the lease; its parent (the test) does not reap it yet
    time.sleep(600)
    """
)


def _holder(url: Path, job_id: str, fate: str) -> subprocess.Popen:
    """Another process of the same job that takes the lease over: it ``stays`` alive (a
    restart's successor) or ``dies`` at once (a trainer that died holding it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(url), job_id, fate], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _holding_promoter(ck: Checkpointer, m: torch.nn.Module) -> Promoter:
    """Snapshots 1 and 2 in memory, and a persister's worker in this process that committed
    step 1 (it holds the lease)."""
    for step in (1, 2):
        _bump(m, 1.0)
        ck.snapshot(step, {"model": m}).wait()
    promoter = _promoter(ck)
    link_to_outbox(ck.memory.steps, 1, promoter.outbox)
    promoter.persist(1)
    return promoter


def test_a_lease_lost_to_a_live_holder_is_not_taken_back(tmp_path):
    """The persister takes the lease anew only from its trainer (after it says it released it,
    or from its record once it is dead), never from another live holder, not even one of the
    same job (a restart's successor): neither for a save the trainer vouches for with another
    token, nor for the flush."""
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        promoter = _holding_promoter(ck, m)
        successor = _holder(url, ck.job_id, "stays")
        try:
            promoter.lease_returned("0123456789abcdef")  # not the holder's token
            link_to_outbox(ck.memory.steps, 2, promoter.outbox)
            with pytest.raises(LeaseError):
                promoter.persist(2)
            assert promoter.flush() is None  # (it tries each snapshot, and gives up)
            assert json.loads((url / "LEASE.json").read_text())["pid"] == successor.pid
        finally:
            successor.kill()
            successor.wait()
        promoter.close()
    assert Checkpointer(str(url)).steps() == [1]


@pytest.mark.parametrize("held_before", [True, False], ids=["held before", "never held"])
@pytest.mark.parametrize("released", ["removed", "left behind"])
def test_a_persister_takes_the_lease_back_only_once_the_trainer_released_it(
    tmp_path, held_before, released
):
    """The trainer took the lease over for a save of its own: a persist request that comes
    before the trainer handed the lease back (one that timed out, answered late) must not take
    it from the live trainer, whether the persister held it before or never did; once the
    trainer released it and said so, the persister takes it, also where the trainer's record
    was left behind (a release that could not remove the file): by its token."""
    from resilient.checkpoint.lease import _process_start

    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        for step in (1, 2):
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m}).wait()
        promoter = _promoter(ck)
        promoter.config.update(parent_pid=os.getpid(), parent_start=_process_start(os.getpid()))
        if held_before:
            link_to_outbox(ck.memory.steps, 1, promoter.outbox)
            promoter.persist(1)
        ck.save(3, {"model": m}).wait()  # written by the trainer: it takes the lease over
        link_to_outbox(ck.memory.steps, 2, promoter.outbox)
        with pytest.raises(LeaseError):
            promoter.persist(2)
        ck._lease.check()  # still the trainer's
        token = ck._lease.token
        if released == "removed":
            ck._lease.release()
        else:  # its renewals stop; its record (this live process's) stays
            ck._lease._stop.set()
            ck._lease._thread.join()
        ck._lease = None
        promoter.lease_returned(token)
        link_to_outbox(ck.memory.steps, 2, promoter.outbox)
        promoter.persist(2)
        promoter.close()
    assert Checkpointer(str(url)).steps() == ([1, 2, 3] if held_before else [2, 3])


def test_the_flush_takes_the_lease_of_a_dead_trainer_not_yet_reaped(tmp_path):
    """The trainer dies holding the lease (it wrote a save itself); its launcher reaps it only a
    moment later, but the persister, whose pipe closed at once, flushes now: a zombie is gone
    (its lease taken), not alive (the newest snapshot was lost)."""
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        promoter = _holding_promoter(ck, m)
        trainer = _holder(url, ck.job_id, "dies")
        try:

            def state() -> str:
                with open(f"/proc/{trainer.pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0]

            _wait_for("the trainer's exit", lambda: state() == "Z")
            done = promoter.flush()
            assert state() == "Z"  # (it was a zombie throughout)
        finally:
            trainer.wait()
        promoter.close()
    assert done is not None and done["step"] == 2
    assert Checkpointer(str(url)).steps() == [1, 2]


@pytest.mark.parametrize("successor_memory", [False, True], ids=["no-tier", "tier-elsewhere"])
def test_the_flush_leaves_a_successors_commit_of_the_same_step_number(tmp_path, successor_memory):
    """An old run snapshots 4 and 5 (from durable 3) and dies; before its persister flushes, a
    successor of the same job on other nodes (with the tier or without) resumes from durable 3,
    saves its own 5 and ends.  The old run's flush must not write its 5 over the successor's
    newest commit (a flush of the same step number is for a rollback: a durable step of the
    tier's own run or an earlier one)."""
    url = tmp_path / "ckpt"
    m = _model()
    with Checkpointer(str(url), memory_every=1, persister=False) as ck:
        ck.save(3, {"model": m}).wait()
        _bump(m, 1.0)
        ck.snapshot(4, {"model": m}).wait()
        _bump(m, 1.0)
        ck.snapshot(5, {"model": m}).wait()
        if ck._lease is not None:
            ck._lease.release()
        kw = {"memory_every": 1, "persister": False, "memory_root": str(tmp_path / "elsewhere")}
        successor = Checkpointer(str(url), **(kw if successor_memory else {}))
        m2 = _model(1)
        assert successor.load({"model": m2}) == 3
        _bump(m2, 7.0)
        successor.save(5, {"model": m2}).wait()
        theirs = _weights(m2)
        successor.close()
        promoter = _promoter(ck)
        flushed = promoter.flush()
        promoter.close()
    m3 = _model(2)
    assert Checkpointer(str(url)).load({"model": m3}) == 5 and _same(m3, theirs)
    assert flushed is None, flushed


# --- a review of the whole job's loss: the memory given back, a zombie trainer, the exit ----------


def test_the_memory_is_not_given_back_while_a_persister_holds_its_lock(tmp_path):
    """(a review) release_memory() after a persister's close that timed out removed the job's
    directory under the flush still running: the newest step, in neither place."""
    import fcntl

    from resilient.checkpoint.snapshots import PERSISTER_LOCK, memory_place

    place = memory_place(str(tmp_path / "ckpt"), str(tmp_path / "mem"))
    place.claim()
    fd = os.open(os.path.join(place.dir, PERSISTER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (as a running persister holds it)
    try:
        assert place.release() is False and os.path.isdir(place.steps)
    finally:
        os.close(fd)
    assert place.release() is True and not os.path.exists(place.dir)
    with pytest.raises(ResilientError, match="memory directory .* is gone"):
        link_to_outbox(place.steps, 1, os.path.join(place.dir, OUTBOX, "1-x"))
    assert not os.path.exists(place.dir)  # (not made again)


def test_a_trainer_not_yet_reaped_is_gone_to_the_persister():
    """(a review) kill(pid, 0) succeeds on a zombie: the flush waited until its parent reaped it
    (for ever under a parent that does not)."""
    from resilient.checkpoint.persister import _running

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _wait_for("the child exits", lambda: _state(child.pid) == "Z")
        assert not _running(child.pid)
    finally:
        child.wait()
    assert _running(os.getpid())


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _persister_of_a_gone_trainer(tmp_path: Path, **config: Any) -> tuple[int, bytes]:
    """A persister process started for a trainer that is already gone, its pipe held open (a
    process the trainer forked holds it); its exit code and log."""
    from resilient.checkpoint import persister

    job_dir = tmp_path / "mem" / "job-x"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    config = {
        "url": str(tmp_path / "ckpt"),
        "job_id": "j",
        "keep_last": 2,
        "lease_timeout_s": 30,
        "job_dir": str(job_dir),
        "outbox": str(job_dir / OUTBOX / "1-x"),
        "parent_pid": gone.pid,
        "parent_start": None,
        "commit_method": "rename",
        **config,
    }
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", persister._ENTRY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write(json.dumps(config).encode() + b"\n")
    proc.stdin.flush()  # and held open
    try:
        code = proc.wait(120)
    finally:
        proc.kill()
        proc.stdin.close()
    return code, proc.stderr.read()


def test_a_persister_whose_trainer_is_gone_exits_cleanly_with_its_pipe_held_open(tmp_path):
    """(a review) Its reader thread still blocked in the pipe, the interpreter's shutdown
    aborted: SIGABRT at every such exit."""
    (tmp_path / "mem" / "job-x").mkdir(parents=True)
    code, log = _persister_of_a_gone_trainer(tmp_path)
    assert code == 0, log.decode()[-2000:]


def test_a_persister_waiting_for_a_stopped_predecessors_lock_leaves_once_its_trainer_is_gone(
    tmp_path,
):
    """(a review) It waited in flock for ever: a predecessor stopped (SIGSTOP) holding the lock,
    its own trainer gone, an orphan for good."""
    import fcntl

    from resilient.checkpoint import persister

    job_dir = tmp_path / "mem" / "job-x"
    job_dir.mkdir(parents=True)
    held = os.open(job_dir / persister.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # (the stopped predecessor)
    try:
        code, log = _persister_of_a_gone_trainer(tmp_path, orphan_wait_s=0.5)
    finally:
        os.close(held)
    assert code == 0 and b"the lock was not free" in log, log.decode()[-2000:]


def test_the_persisters_pipes_are_closed_when_it_is_replaced_and_when_it_closes(tmp_path):
    """The client's ends of a persister's pipes are closed, not left to the garbage collector
    (a ResourceWarning per persister, on every run with warnings shown)."""
    script = textwrap.dedent(
        """
        import gc, os, signal, sys, time
        import torch
        from resilient import Checkpointer
        m = torch.nn.Linear(4, 4)
        with Checkpointer(sys.argv[1], memory_every=1) as ck:
            ck.save(1, {"model": m}).wait()
            first = ck.persister_pid
            os.kill(first, signal.SIGKILL)
            while ck._persister._gone is None:  # its reader saw it go
                time.sleep(0.05)
            ck.snapshot(2, {"model": m}).wait()
            ck.save(2, {"model": m}).wait()  # a second persister
            assert ck.persister_pid != first
        import threading
        for t in threading.enumerate():  # the readers, once their persisters exited
            if t.name == "resilient-persister-replies":
                t.join(60)
        gc.collect()
        print("done")
        """
    )
    out = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", script, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    assert "ResourceWarning" not in out.stderr, out.stderr[-3000:]
