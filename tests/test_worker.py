"""The checkpointer's background worker: one thread for a run of saves, another only when none is
idle, nothing of a finished job kept alive."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from resilient import Checkpointer
from resilient.checkpoint.worker import IDLE_NAME, Worker, join_running


def test_a_run_of_jobs_shares_one_thread_named_after_each_job():
    w = Worker(idle_s=30)
    seen: list[tuple[int, str, int]] = []

    def job(i: int) -> None:
        t = threading.current_thread()
        seen.append((i, t.name, t.ident))

    for i in range(5):  # each after the one before, as a checkpointer's saves
        j = w.submit(f"job-{i}", job, i)
        j.join(10)
        assert not j.is_alive()
    assert [s[1] for s in seen] == [f"job-{i}" for i in range(5)]
    assert len({s[2] for s in seen}) == 1  # one thread for all five
    (t,) = w.threads
    deadline = time.monotonic() + 10
    while t.name != IDLE_NAME and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.name == IDLE_NAME
    w.stop()


def test_a_job_never_waits_behind_one_that_is_still_running():
    """The old group's save after an in-job recovery may still wait on a broken peer: the new
    group's saves must run meanwhile (their handshake needs every rank's thread)."""
    w = Worker(idle_s=30)
    stuck = threading.Event()
    old = w.submit("resilient-ckpt-save-5", stuck.wait, 60)
    ran = threading.Event()
    new = w.submit("resilient-ckpt-snapshot-8", ran.set)
    assert ran.wait(30) and not new.is_alive() and old.is_alive()
    assert len(w.threads) == 2
    stuck.set()
    old.join(10)
    w.stop()


def test_an_idle_worker_ends_its_thread_and_starts_another_for_the_next_job():
    w = Worker(idle_s=0.05)
    w.submit("a", lambda: None).join(10)
    deadline = time.monotonic() + 10
    while w.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not w.threads
    ran = threading.Event()
    w.submit("b", ran.set).join(10)
    assert ran.is_set()
    w.stop()


def test_a_finished_job_holds_nothing_of_what_it_ran():
    class Payload:
        pass

    w = Worker(idle_s=30)
    p = Payload()
    ref = weakref.ref(p)
    job = w.submit("holds", lambda x: None, p)
    job.join(10)
    del p
    gc.collect()
    assert ref() is None and not job.is_alive()
    w.stop()


def test_a_failing_job_is_done_and_the_worker_goes_on():
    w = Worker(idle_s=30)

    def boom() -> None:
        raise RuntimeError("boom")

    failed = w.submit("boom", boom)
    ok = threading.Event()
    after = w.submit("after", ok.set)
    failed.join(10)
    after.join(10)
    assert not failed.is_alive() and ok.is_set()
    w.stop()


def _join_in_background(prefix: str) -> threading.Event:
    """``join_running(prefix, 60)`` on a thread of its own; the event is set when it returns."""
    returned = threading.Event()

    def joiner() -> None:
        join_running(prefix, 60)
        returned.set()

    threading.Thread(target=joiner, daemon=True).start()
    return returned


def test_join_running_waits_for_the_jobs_of_a_kind_only():
    w, other = Worker(idle_s=30), Worker(idle_s=30)
    release, hold = threading.Event(), threading.Event()
    started = threading.Event()

    def slow(ev: threading.Event) -> None:
        started.set()
        ev.wait(60)

    save = other.submit("resilient-ckpt-save-7", slow, hold)
    assert started.wait(10)
    snap = w.submit("resilient-ckpt-snapshot-7", slow, release)
    join_running("resilient-ckpt-snapshot", 0.2)  # gives up on the snapshot: still running
    assert snap.is_alive()
    returned = _join_in_background("resilient-ckpt-snapshot")
    release.set()
    # it returns once the snapshot is done, while the save (another kind) still runs
    assert returned.wait(30) and not snap.is_alive() and save.is_alive()
    hold.set()
    save.join(10)
    w.stop()
    other.stop()


def test_join_running_waits_for_every_live_job_of_the_kind():
    w = Worker(idle_s=30)
    gate, gate2 = threading.Event(), threading.Event()
    first = w.submit("resilient-ckpt-snapshot-1", gate.wait, 60)
    second = w.submit("resilient-ckpt-snapshot-2", gate2.wait, 60)  # on a thread of its own
    returned = _join_in_background("resilient-ckpt-snapshot")
    gate.set()
    first.join(10)
    assert not first.is_alive() and second.is_alive()
    assert not returned.wait(2)  # the second job is waited for too
    gate2.set()
    assert returned.wait(30) and not second.is_alive()
    w.stop()


def test_a_thread_that_cannot_start_queues_nothing_and_the_next_save_runs(tmp_path, monkeypatch):
    ck = Checkpointer(str(tmp_path / "ck"))
    state = {"w": torch.arange(4.0)}
    real = threading.Thread.start
    calls = {"n": 0}

    def flaky(self) -> None:
        if self.name.startswith("resilient-ckpt") and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", flaky)
    with pytest.raises(RuntimeError, match="can't start"):
        ck.save(1, state)
    assert not ck._worker._jobs and not ck._worker.threads and ck._pending is None
    done = threading.Event()

    def later() -> None:
        ck.save(2, state).wait(60)
        done.set()

    threading.Thread(target=later, daemon=True).start()
    assert done.wait(60)  # before the fix: the failed save stayed pending and this hung
    assert ck.steps() == [2]
    ck.close()


def test_snapshots_commit_on_one_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(tmp_path / "shm"))
    state = {"w": torch.arange(8.0)}
    ck = Checkpointer(str(tmp_path / "ck"), memory_every=1, persister=False)
    ck._memory._worker.idle_s = 600  # so that only close() ends the thread below
    threads = set()
    for step in range(1, 6):
        state["w"] += 1
        ck.snapshot(step, state).wait()
        threads |= ck._memory._worker.threads
    assert len(threads) == 1
    assert ck.memory_steps()[0] == 5
    ck.release_memory()
    ck.close()
    # closing lets the thread end
    t = threads.pop()
    t.join(10)
    assert not t.is_alive()


def test_a_forked_child_runs_its_jobs_on_a_thread_of_its_own():
    import multiprocessing as mp

    w = Worker(idle_s=30)
    w.submit("parent", lambda: None).join(10)
    assert w.threads  # the parent's thread, idle: the child has no such thread

    def child(q) -> None:
        ran = threading.Event()
        w.submit("child", ran.set).join(10)
        q.put(ran.is_set())

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=30) is True
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    w.stop()
