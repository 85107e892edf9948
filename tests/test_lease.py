"""Two jobs, one URL: the writer lease keeps a second job from damaging the first."""

import contextlib
import json
import multiprocessing as mp
import os
import time

import pytest
import torch

import resilient.checkpoint.storage as storage_module
from resilient import Checkpointer
from resilient.checkpoint.lease import BEAT_PREFIX
from resilient.errors import LeaseError, StorageError

LEASE = "LEASE.json"


def state(v: float) -> dict:
    return {"w": torch.full((256,), v)}


def test_the_first_save_takes_the_lease_and_close_releases_it(tmp_path):
    with Checkpointer(str(tmp_path), job_id="job-A") as ck:
        assert not (tmp_path / LEASE).exists()  # readers and idle writers take nothing
        ck.save(1, state(1)).wait()
        record = json.loads((tmp_path / LEASE).read_text())
        assert record["job_id"] == "job-A" and record["pid"] == os.getpid()
        assert ck.manifest(1).job_id == "job-A"
    assert not (tmp_path / LEASE).exists()


def test_a_second_job_gets_a_lease_error_naming_the_owner_and_damages_nothing(tmp_path):
    # (A renews every 2 s: B, watching for 8 s, sees a heartbeat even when a loaded machine
    # delays a renewal's fsync by seconds; with a 2 s lease a 1.5 s delay made A look stale)
    a = Checkpointer(str(tmp_path), job_id="job-A", lease_timeout_s=8.0)
    a.save(1, state(1)).wait()
    # job A has a save in flight: its step directory exists, uncommitted, while it writes
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "rank_00000.safetensors.tmp-0123456789ab").write_bytes(b"x")
    b = Checkpointer(str(tmp_path), job_id="job-B", lease_timeout_s=2.0)
    t0 = time.monotonic()
    b.save(5, state(5))
    with pytest.raises(LeaseError, match=r"is being written by job 'job-A' \(host .*, pid \d+"):
        b.wait()
    assert time.monotonic() - t0 < 30  # it saw A's heartbeat; it did not hang
    # B wrote nothing and collected nothing of A's
    names = sorted(p.name for p in tmp_path.iterdir())
    beats = [n for n in names if n.startswith(BEAT_PREFIX)]  # (A's heartbeat, once it renewed)
    assert beats in ([], [BEAT_PREFIX + a._lease.token])
    assert [n for n in names if n not in beats] == [LEASE, "step_00000001", "step_00000002"]
    assert (tmp_path / "step_00000002" / "rank_00000.safetensors.tmp-0123456789ab").exists()
    assert a.steps() == [1]
    a.save(2, state(2)).wait()  # A goes on
    assert a.steps() == [1, 2]
    b.close()
    a.close()


def test_a_stale_lease_is_taken_over_after_the_timeout(tmp_path):
    record = {
        "format": "resilient-lease-v1",
        "job_id": "job-gone",
        "token": "feedfeedfeedfeed",
        "host": "some-other-host",
        "machine": "some-other-host/boot/pid:[1]",
        "pid": 12345,
        "pid_start": "1",
        "acquired_unix_s": 0.0,
        "heartbeat_unix_s": 0.0,
        "beat": 7,
        "timeout_s": 3.0,  # the owner's timeout, longer than the taker's: the taker honours it
    }
    (tmp_path / LEASE).write_text(json.dumps(record))
    with Checkpointer(str(tmp_path), job_id="job-new", lease_timeout_s=1.0) as ck:
        t0 = time.monotonic()
        ck.save(1, state(1)).wait()
        assert time.monotonic() - t0 >= 3.0  # it watched the silent lease for the owner's timeout
        assert json.loads((tmp_path / LEASE).read_text())["job_id"] == "job-new"
    assert not (tmp_path / LEASE).exists()


def test_a_lease_whose_process_is_gone_is_taken_at_once(tmp_path):
    # a job on this machine that was killed: its pid no longer runs
    p = mp.get_context("fork").Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    with Checkpointer(str(tmp_path), job_id="job-A") as ck:
        ck.save(1, state(1)).wait()
        rec = json.loads((tmp_path / LEASE).read_text())
    rec["pid"], rec["token"], rec["job_id"] = p.pid, "0" * 16, "job-killed"
    (tmp_path / LEASE).write_text(json.dumps(rec))
    with Checkpointer(str(tmp_path), job_id="job-B", lease_timeout_s=300.0) as ck:
        t0 = time.monotonic()
        ck.save(2, state(2)).wait()
        assert time.monotonic() - t0 < 60  # not the 300 s timeout
        assert ck.steps() == [1, 2]


def test_the_same_job_restarted_takes_its_lease_at_once(tmp_path):
    a = Checkpointer(str(tmp_path), job_id="torchrun:run-7", lease_timeout_s=300.0)
    a.save(1, state(1)).wait()
    # a restart of the same job (same run id) while the old process's lease is still there
    with Checkpointer(str(tmp_path), job_id="torchrun:run-7", lease_timeout_s=300.0) as b:
        t0 = time.monotonic()
        b.save(2, state(2)).wait()
        assert time.monotonic() - t0 < 60
        # the old instance lost the lease: it may not commit any more
        a.save(3, state(3))
        with pytest.raises(LeaseError, match="was taken over by job 'torchrun:run-7'"):
            a.wait()
        assert b.steps() == [1, 2]
    a.save(4, state(4))  # not after the new owner has gone either
    with pytest.raises(LeaseError, match="must not commit there any more"):
        a.wait()
    assert Checkpointer(str(tmp_path)).steps() == [1, 2]
    a.close()


def test_a_lease_file_unreadable_for_a_moment_fails_that_commit_only(tmp_path):
    """A lease file that cannot be read back (torn, replaced by something that is not a record)
    says nothing about who holds the lease: that commit fails with a StorageError that says so,
    and once the file reads again the job commits again (it was not given up for good)."""
    with Checkpointer(str(tmp_path), job_id="job-A", lease_timeout_s=60.0) as ck:
        ck.save(1, state(1)).wait()
        good = (tmp_path / LEASE).read_bytes()
        (tmp_path / LEASE).write_bytes(b'{"format": "resilient-lease-v1", "tok')
        ck.save(2, state(2))
        with pytest.raises(StorageError, match="could not be read back"):  # a failed save, no more
            ck.wait()
        ck._lease.renew()  # a renewal meanwhile neither gives it up nor writes over it
        assert (tmp_path / LEASE).read_bytes().endswith(b'"tok')
        (tmp_path / LEASE).write_bytes(good)
        ck.save(3, state(3)).wait()
        assert ck.steps() == [1, 3]
        # another owner's record is a loss for good, as before
        other = json.loads(good)
        other["token"] = "0" * 16
        (tmp_path / LEASE).write_text(json.dumps(other))
        ck.save(4, state(4))
        with pytest.raises(LeaseError, match="was taken over"):
            ck.wait()
        (tmp_path / LEASE).write_bytes(good)
        ck.save(5, state(5))
        with pytest.raises(LeaseError, match="must not commit there any more"):
            ck.wait()
        assert ck.steps() == [1, 3]


def test_a_record_this_process_left_behind_is_taken_even_cautiously(tmp_path):
    """A lease released while its file could not be read leaves its record behind: the next lease
    of the same process (a persister's, which takes no live holder's lease) takes it, rather than
    refusing itself for as long as it lives; another live lease of this process is still refused."""
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    storage = Storage(str(tmp_path))
    first = WriterLease(storage, "job-A", timeout_s=60.0)
    first.acquire()
    left = (tmp_path / LEASE).read_bytes()
    (tmp_path / LEASE).write_bytes(b"torn")  # unreadable at the release: the file stays
    first.release()
    (tmp_path / LEASE).write_bytes(left)  # readable again: this process's record, not held
    second = WriterLease(storage, "job-A", timeout_s=60.0)
    t0 = time.monotonic()
    second.acquire(cautious=True)
    assert time.monotonic() - t0 < 30 and second.held
    third = WriterLease(storage, "job-A", timeout_s=60.0)
    with pytest.raises(LeaseError, match="whose lease is alive"):
        third.acquire(cautious=True)  # the second is held: a writer like any other
    second.release()
    assert not (tmp_path / LEASE).exists()


def test_a_lease_of_this_process_still_settling_is_not_taken_for_an_orphan(tmp_path):
    """On storage without exclusive create a new lease settles (re-reads after writing) before it
    holds: another job's lease in the same process that looks meanwhile sees a live writer, not a
    record this process left behind."""
    import threading

    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    url = f"faulty://{tmp_path / 'ck'}"
    options = {"target_protocol": "file", "faults": []}
    a = WriterLease(Storage(url, options), "job-A", timeout_s=4.0)  # settles 0.4 s
    b = WriterLease(Storage(url, options), "job-B", timeout_s=4.0)
    assert a.settle_s > 0.2
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(a=a.acquire()))
    t.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "ck" / LEASE).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(LeaseError, match="job 'job-A'"):
        b.acquire()  # inside A's settle: A's record is a live writer's
    t.join(timeout=30)
    assert a.held and not b.held
    a.release()


def _job(url: str, job_id: str, steps: list[int], started, stop, out) -> None:
    torch.set_num_threads(1)
    try:
        # (renewals every 2 s, watched for 8 s: a renewal delayed on a loaded machine is not
        # taken for a stale lease)
        with Checkpointer(url, job_id=job_id, lease_timeout_s=8.0, keep_last=2) as ck:
            for s in steps:
                ck.save(s, state(float(s))).wait()
                started.set()
                if stop.wait(0.2):
                    break
        out.put((job_id, "ok", None))
    except LeaseError as e:
        out.put((job_id, "lease", str(e)))
    except BaseException as e:  # reported, not hidden
        out.put((job_id, "error", f"{type(e).__name__}: {e}"))


def test_two_processes_on_one_url(tmp_path):
    ctx = mp.get_context("forkserver")
    started, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    url = str(tmp_path)
    a = ctx.Process(target=_job, args=(url, "job-A", list(range(1, 200)), started, stop, out))
    a.start()
    assert started.wait(60), "job A did not save"
    b_events = ctx.Event(), ctx.Event()  # kept referenced until B has started
    b = ctx.Process(target=_job, args=(url, "job-B", [1000], *b_events, out))
    b.start()
    job, status, msg = out.get(timeout=120)
    assert (job, status) == ("job-B", "lease"), (job, status, msg)
    assert "job 'job-A'" in msg
    stop.set()
    assert out.get(timeout=120)[:2] == ("job-A", "ok")
    a.join(30)
    b.join(30)
    with Checkpointer(url) as ck:
        steps = ck.steps()
        assert 1000 not in steps and len(steps) == 2  # A's retention, untouched by B
        out_state = state(0.0)
        s = ck.load(out_state)
        assert torch.equal(out_state["w"], torch.full((256,), float(s)))


@pytest.mark.parametrize("backend", ["local", "memory", "s3"])
def test_the_first_lease_is_created_exclusively_on_every_backend(tmp_path, backend, request):
    """link() on a local disk, a conditional PUT (If-None-Match) on S3, an exclusive open on
    memory://: of two first takers exactly one creates the lease."""
    import uuid

    from resilient.checkpoint.storage import Storage

    if backend == "local":
        st = Storage(str(tmp_path))
    elif backend == "memory":
        st = Storage(f"memory://lease-{uuid.uuid4().hex[:8]}")
    else:
        s3 = request.getfixturevalue("s3")
        st = Storage(f"s3://{s3.new_bucket()}/r", s3.options)
    assert st.create_exclusive(LEASE, b"first") is True
    assert st.create_exclusive(LEASE, b"second") is False
    assert st.read(LEASE) == b"first"


@pytest.mark.parametrize("record", ["torn", "another's"])
def test_a_lease_handed_back_to_the_persister_vouches_only_for_its_own_record(tmp_path, record):
    """The trainer hands its lease back to its persister (its token: the persister may take the
    record that token names).  A record that cannot be read just now may still be the trainer's
    (its release then leaves it behind), so the token goes along; a record of another owner's
    means the lease was lost, and nothing is vouched for."""
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    url = str(tmp_path / "ck")
    with Checkpointer(url) as ck:
        lease = WriterLease(Storage(url), ck.job_id, timeout_s=30.0)
        lease.acquire()
        if record == "torn":  # a record being rewritten, read halfway
            (tmp_path / "ck" / LEASE).write_bytes((tmp_path / "ck" / LEASE).read_bytes()[:20])
        else:
            other = json.loads((tmp_path / "ck" / LEASE).read_text())
            (tmp_path / "ck" / LEASE).write_text(json.dumps({**other, "token": "f" * 32}))
        ck._lease = lease
        ck._hand_lease_back()
        assert ck._lease_returned == (lease.token if record == "torn" else None)
        assert ck._lease is None and not lease.held


def test_no_heartbeat_file_outlives_its_lease(tmp_path):
    """A holder's LEASE.beat.<token> whose LEASE.json is gone (a release cut short, an operator
    who removed a dead job's LEASE.json) was removed by nobody: every acquire removes other
    holders' heartbeats now, and a release removes its own first."""
    from resilient.checkpoint.lease import LEASE_NAME

    orphan = tmp_path / (BEAT_PREFIX + "feedfeedfeedfeed")
    orphan.write_text('{"token": "feedfeedfeedfeed", "beat": 9, "heartbeat_unix_s": 0}')
    for v in range(2):  # two jobs in a row, each saving, renewing and closing cleanly
        with Checkpointer(str(tmp_path), job_id=f"job-{v}") as ck:
            ck.save(v + 1, state(v)).wait()
            ck._lease.renew()  # (a heartbeat file of its own)
            assert (tmp_path / (BEAT_PREFIX + ck._lease.token)).exists()
            assert not orphan.exists()
    assert not (tmp_path / LEASE_NAME).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(BEAT_PREFIX)] == []


def _wait_for(path, what: str) -> None:
    deadline = time.monotonic() + 120
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists(), f"{what} never happened"


def test_a_writer_that_loses_its_lease_during_retention_retires_no_more_steps(tmp_path):
    """Retention retired its steps after one lease check: a writer whose lease was taken over
    while it removed them (slow removals on an object store) went on uncommitting steps its
    successor keeps.  The lease is checked before each removal of a manifest now."""
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    root = tmp_path / "ck"
    with Checkpointer(str(root), job_id="J", keep_last=10) as first:
        for s in (1, 2, 3, 4):
            first.save(s, state(s)).wait()
    fired = tmp_path / "fired.jsonl"
    # (the successor takes the lease over while this removal waits: a few milliseconds of 3 s)
    slow = {"op": "remove", "path": "step_00000001/MANIFEST.json", "latency_s": 3.0, "count": 1}
    opts = {"target_protocol": "file", "record": str(fired), "faults": [slow]}
    a = Checkpointer(f"faulty://{root}", storage_options=opts, job_id="J", keep_last=1)
    b = WriterLease(Storage(str(root)), "J", timeout_s=60.0)  # the same job restarted
    saved = a.save(5, state(5))  # its retention drops 1, 2, 3 and 4: the first removal is slow
    _wait_for(fired, "the removal of step 1's manifest")
    b.acquire()
    saved.wait()  # (committed; what retention could not do is logged)
    a.wait()
    left = sorted(p.parent.name for p in root.glob("step_*/MANIFEST.json"))
    assert left == [f"step_0000000{s}" for s in (2, 3, 4, 5)]  # (1 went before the takeover)
    b.check()  # still the successor's
    a.close()
    b.release()


def test_a_release_never_removes_the_lease_a_successor_took_meanwhile(tmp_path):
    """release() read the lease (its own), removed its heartbeat, then removed LEASE.json: a
    successor of the same job that took the lease over in between lost its lease file, and its
    next commit failed with a LeaseError (nobody's lease: another job could take it at once)."""
    import threading

    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    root = tmp_path / "ck"
    fired = tmp_path / "fired.jsonl"
    slow = {"op": "remove", "path": BEAT_PREFIX, "latency_s": 2.0, "count": 1}
    opts = {"target_protocol": "file", "record": str(fired), "faults": [slow]}
    a = WriterLease(Storage(f"faulty://{root}", opts), "J", timeout_s=60.0)
    a.acquire()
    a.renew()  # (a heartbeat file of its own, removed at the release)
    releasing = threading.Thread(target=a.release)
    releasing.start()
    _wait_for(fired, "the removal of the heartbeat")
    b = WriterLease(Storage(str(root)), "J", timeout_s=60.0)  # the same job restarted
    b.acquire()
    releasing.join(timeout=120)
    b.check()
    assert json.loads((root / LEASE).read_text())["token"] == b.token
    b.release()
    assert not (root / LEASE).exists()


@pytest.mark.parametrize("what", ["empty", "with a file"])
def test_a_directory_at_the_lease_name_is_refused_by_name_at_once(tmp_path, what):
    """A directory named LEASE.json is no lease: it was watched for the lease timeout, then the
    takeover's rename failed with a bare IsADirectoryError, at every save."""
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    (tmp_path / LEASE).mkdir()
    if what == "with a file":
        (tmp_path / LEASE / "x").write_text("x")
    lease = WriterLease(Storage(str(tmp_path)), "job-me", timeout_s=1.0)
    with pytest.raises(LeaseError, match=r"LEASE\.json: expected the writer lease .* found a dir"):
        lease.acquire()
    assert (tmp_path / LEASE).is_dir() and not lease.held


def test_a_writer_that_lost_its_lease_leaves_its_successors_record_alone_at_close(tmp_path):
    """A release judges LEASE.json by setting it aside (a rename) only while it read its own
    record there: the record of a successor that took the lease over is never moved, not for a
    moment (its own check or renewal would find no lease then, and give it up for good)."""
    from resilient.checkpoint import storage as storage_mod
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    renamed: list[str] = []

    class Recording(storage_mod.LocalOps):
        def rename(self, src: str, dst: str, *, dir_fd: int) -> None:
            renamed.append(src)
            super().rename(src, dst, dir_fd=dir_fd)

    a = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)
    a.acquire()
    b = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)  # the same job restarted
    b.acquire()
    previous = storage_mod.set_local_ops(Recording())
    try:
        a.release()
    finally:
        storage_mod.set_local_ops(previous)
    assert LEASE not in renamed
    b.check()
    b.release()
    assert LEASE in renamed or not (tmp_path / LEASE).exists()


def _set_aside_names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(LEASE + ".released-"))


def _stalling_release_ops(before=None):
    """Local ops that hold a release right after it set LEASE.json aside (``set_aside`` is set
    then), until ``go`` is set; ``before`` runs just before the rename."""
    import threading

    from resilient.checkpoint import storage as storage_mod

    class Stalling(storage_mod.LocalOps):
        set_aside, go = threading.Event(), threading.Event()

        def rename(self, src: str, dst: str, *, dir_fd: int) -> None:
            if src != LEASE:
                return super().rename(src, dst, dir_fd=dir_fd)
            if before is not None:
                before()
            super().rename(src, dst, dir_fd=dir_fd)
            self.set_aside.set()
            assert self.go.wait(60)

    return Stalling()


@contextlib.contextmanager
def _releasing(lease, ops):
    """``lease`` released on another thread with ``ops`` as the local ops (stalling ones, from
    ``_stalling_release_ops``), held right after it set LEASE.json aside; on leaving, the release
    goes on and the ops are put back."""
    import threading

    from resilient.checkpoint import storage as storage_mod

    previous = storage_mod.set_local_ops(ops)
    releasing = threading.Thread(target=lease.release)
    try:
        releasing.start()
        assert ops.set_aside.wait(60)
        yield
    finally:
        ops.go.set()
        releasing.join(timeout=60)
        storage_mod.set_local_ops(previous)


def test_a_release_in_progress_never_makes_a_successor_give_up_its_lease(tmp_path):
    """A release renames LEASE.json aside to judge it: a successor of the same job that took
    the lease over just before that rename found no LEASE.json meanwhile, took its lease for
    lost to nobody, and its job could never commit again.  It puts its record back now."""

    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    a = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)
    a.acquire()
    b = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)  # the same job restarted
    ops = _stalling_release_ops(before=b.acquire)  # (after A read its own record there)
    with _releasing(a, ops):
        assert not (tmp_path / LEASE).exists() and len(_set_aside_names(tmp_path)) == 1
        b.check()  # (was: LeaseError, taken over by nobody)
        b.renew()
        assert json.loads((tmp_path / LEASE).read_text())["token"] == b.token
        assert _set_aside_names(tmp_path) == []  # (moved back)
    b.check()
    assert json.loads((tmp_path / LEASE).read_text())["token"] == b.token
    assert _set_aside_names(tmp_path) == []
    b.release()
    assert not (tmp_path / LEASE).exists()


def _release_and_die(root: str, before, go) -> None:
    """Take the lease, then release it and die right after LEASE.json was set aside (between
    ``before`` set and ``go`` awaited, someone may take the lease over)."""
    from resilient.checkpoint import storage as storage_mod
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    class Dying(storage_mod.LocalOps):
        def rename(self, src: str, dst: str, *, dir_fd: int) -> None:
            if src != LEASE:
                return super().rename(src, dst, dir_fd=dir_fd)
            before.set()
            go.wait(60)
            super().rename(src, dst, dir_fd=dir_fd)
            os._exit(9)

    lease = WriterLease(Storage(root), "J", timeout_s=60.0)
    lease.acquire()
    storage_mod.set_local_ops(Dying())
    lease.release()


def test_a_release_cut_short_leaves_a_successors_lease_to_nobody_else(tmp_path):
    """A release killed between setting LEASE.json aside and putting back a successor's record
    left no LEASE.json: another job took the lease at once (two writers, each holding it) and
    the successor gave it up at its next check.  The set-aside record is the lease now."""
    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    ctx = mp.get_context("fork")
    before, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_release_and_die, args=(str(tmp_path), before, go))
    p.start()
    assert before.wait(60)
    b = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)  # the same job, again
    b.acquire()
    go.set()
    p.join(60)
    assert p.exitcode == 9 and not (tmp_path / LEASE).exists()
    assert len(_set_aside_names(tmp_path)) == 1
    other = WriterLease(Storage(str(tmp_path)), "K", timeout_s=60.0)
    with pytest.raises(LeaseError, match=r"being written by job 'J'"):
        other.acquire(cautious=True)  # (was: took the lease, free)
    b.check()
    assert json.loads((tmp_path / LEASE).read_text())["token"] == b.token
    assert _set_aside_names(tmp_path) == []
    b.release()
    assert not (tmp_path / LEASE).exists()


def test_a_dead_releasers_own_record_is_swept_but_never_a_live_release(tmp_path):
    """A release cut short with its own record set aside leaves the lease free, and the file
    behind: nobody removed it.  The next holder removes it once its releaser is gone (or, on
    another host, once it is older than the lease timeout), but not the file of a release
    still in progress."""

    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    ctx = mp.get_context("fork")
    go = ctx.Event()
    go.set()
    p = ctx.Process(target=_release_and_die, args=(str(tmp_path), ctx.Event(), go))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    [dead] = _set_aside_names(tmp_path)
    record = json.loads((tmp_path / dead).read_text())
    record.update(token="0123456789abcdef", machine="elsewhere", host="elsewhere")
    elsewhere = f"{LEASE}.released-0123456789abcdef-0123456789ab"  # (a releaser on another host)
    (tmp_path / elsewhere).write_text(json.dumps(record))
    live = WriterLease(Storage(str(tmp_path)), "L", timeout_s=60.0)
    live.acquire()  # (a dead holder's lease: taken at once)
    ops = _stalling_release_ops()
    with _releasing(live, ops):
        [in_hand] = [n for n in _set_aside_names(tmp_path) if n not in (dead, elsewhere)]
        d = WriterLease(Storage(str(tmp_path)), "K", timeout_s=60.0)
        d.acquire(cautious=True)  # free: the set-aside records are their releasers' own
        assert _set_aside_names(tmp_path) == sorted([in_hand, elsewhere])
    assert _set_aside_names(tmp_path) == [elsewhere]
    d.check()
    d.release()
    time.sleep(0.3)  # (set aside longer ago than a short lease timeout then)
    e = WriterLease(Storage(str(tmp_path)), "K", timeout_s=0.2)
    e.acquire()
    assert _set_aside_names(tmp_path) == []
    e.release()
    assert not (tmp_path / LEASE).exists()


@pytest.mark.parametrize("tagged", [False, True], ids=["untagged", "successors"])
def test_a_record_set_aside_longer_ago_than_its_holder_renews_is_not_put_back(tmp_path, tagged):
    """(a review) A release cut short by a crash (of an earlier version, whose set-aside name
    carries no token; or a successor's record, whose holder then died too) left a record set
    aside and no LEASE.json.  Whoever came later put it back, long after: the lease, free, was
    held again by a holder that had not renewed for longer than its lease timeout, so a new job
    was refused (cautiously) or watched it for that timeout first.  A record set aside longer
    ago than its holder renews is no live holder's: it stays aside (for the sweep)."""
    from resilient.checkpoint.lease import LeaseRecord, WriterLease
    from resilient.checkpoint.storage import Storage

    record = LeaseRecord(
        job_id="J",
        token="0123456789abcdef",
        host="elsewhere",
        machine="elsewhere/boot/ns",
        pid=1,
        pid_start="1",
        acquired_unix_s=time.time(),
        heartbeat_unix_s=time.time(),
        beat=1,
        timeout_s=0.2,
    )
    tag = "fedcba9876543210-" if tagged else ""
    (tmp_path / f"{LEASE}.released-{tag}0123456789ab").write_bytes(record.to_bytes())
    time.sleep(0.5)  # (set aside longer ago than its holder's lease timeout)
    k = WriterLease(Storage(str(tmp_path)), "K", timeout_s=0.2)
    k.acquire(cautious=True)  # (was: LeaseError, held by job 'J', put back)
    assert json.loads((tmp_path / LEASE).read_text())["token"] == k.token
    assert _set_aside_names(tmp_path) == []  # (swept by the holder)
    k.release()
    assert not (tmp_path / LEASE).exists()


def test_a_put_back_lease_released_at_once_is_not_put_back_again(tmp_path):
    """A reader that finds no LEASE.json puts a successor's set-aside record back.  Linked, then
    unlinked, the set-aside name stayed a moment beside the lease: the successor's release in
    that moment, then another reader finding no LEASE.json, put the released record back (a free
    lease held by a holder who had let it go, until its timeout).  One rename now."""

    from resilient.checkpoint.lease import WriterLease
    from resilient.checkpoint.storage import Storage

    a = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)
    a.acquire()
    b = WriterLease(Storage(str(tmp_path)), "J", timeout_s=60.0)  # the same job restarted
    stalling = _stalling_release_ops(before=b.acquire)

    class Window(type(stalling)):
        armed = True

        def unlink(self, name: str, *, dir_fd: int) -> None:
            if self.armed and name.startswith(LEASE + ".released-"):
                self.armed = False  # (in the put-back's window: the successor lets go, and a
                b.release()  # reader of another job finds no LEASE.json)
                other = WriterLease(Storage(str(tmp_path)), "K", timeout_s=60.0)
                other._read_settled()
            super().unlink(name, dir_fd=dir_fd)

    ops = Window()
    with _releasing(a, ops):
        # another job's reader finds no LEASE.json: puts b's record back (a's release set it
        # aside)
        WriterLease(Storage(str(tmp_path)), "K", timeout_s=60.0)._read_settled()
    assert not b.held
    assert not (tmp_path / LEASE).exists(), (tmp_path / LEASE).read_text()
    assert _set_aside_names(tmp_path) == []


def _open_files_under(path) -> list[str]:
    """What this process's descriptors have open under ``path``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed meanwhile)
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{path}/"):
                out.append(target)
    return out


def _counting_reads(storage, monkeypatch) -> list[str]:
    reads: list[str] = []
    real = storage.read_small
    monkeypatch.setattr(storage, "read_small", lambda rel, n: reads.append(rel) or real(rel, n))
    return reads


def test_a_check_reads_the_lease_file_again_only_once_it_was_replaced(tmp_path, monkeypatch):
    """On a local filesystem a check whose lease file is still the one it last read as its own
    (the same inode, size and mtime) does not read it again (a memory snapshot checks six times
    per commit); a takeover, which replaces the file, is seen at the next check all the same."""
    monkeypatch.setattr(storage_module, "fs_type", lambda directory: "ext4")  # (whatever /tmp is)
    with Checkpointer(str(tmp_path / "other"), job_id="job-B", lease_timeout_s=3600.0) as ck:
        ck.save(1, state(1)).wait()
        assert ck._lease._held_file is not None  # (its record, held open between checks)
        assert _open_files_under(tmp_path)
    assert not _open_files_under(tmp_path)  # closed at the release
    with Checkpointer(str(tmp_path), job_id="job-A", lease_timeout_s=3600.0) as ck:
        ck.save(1, state(1)).wait()
        assert ck.storage.coherent_stat  # (a local disk)
        reads = _counting_reads(ck.storage, monkeypatch)
        for _ in range(5):
            ck._lease.check()
        ck.save(2, state(2)).wait()
        assert reads.count(LEASE) == 0 and ck.steps() == [1, 2]
        # another owner's record, put in place as every writer of LEASE.json does: replaced
        other = json.loads((tmp_path / LEASE).read_text())
        other["token"] = "0" * 16
        (tmp_path / "next").write_text(json.dumps(other, indent=1))
        os.replace(tmp_path / "next", tmp_path / LEASE)
        ck.save(3, state(3))
        with pytest.raises(LeaseError, match="was taken over"):
            ck.wait()
        assert reads.count(LEASE) == 1 and ck.steps() == [1, 2]
        ck.save(4, state(4))  # (lost for good: no file is held any more)
        with pytest.raises(LeaseError, match="must not commit there any more"):
            ck.wait()
        assert ck._lease._held_file is None
    assert not _open_files_under(tmp_path)  # the file it held is closed


def test_on_a_network_filesystem_every_check_reads_the_lease_file(tmp_path, monkeypatch):
    """A stat there may be served from the client's cache for seconds (NFS): only a read says
    whose the lease is."""
    monkeypatch.setattr(storage_module, "fs_type", lambda directory: "nfs4")
    with Checkpointer(str(tmp_path), job_id="job-A", lease_timeout_s=3600.0) as ck:
        ck.save(1, state(1)).wait()
        assert not ck.storage.coherent_stat
        reads = _counting_reads(ck.storage, monkeypatch)
        for _ in range(5):
            ck._lease.check()
        assert reads.count(LEASE) == 5
