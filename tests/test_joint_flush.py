"""The persisters' flush across three nodes (joint_flush.py): no node holds every file of the newest
committed snapshot (each has its own ranks' and its source node's replicas), yet when the job
closes or dies it reaches durable storage: rank 0's node's persister asks through the URL, the
others write their own ranks' files.  Nodes are memory roots, as in test_memory_nodes.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.checkpoint.joint_flush import (
    FLUSH_NAME,
    WAITING_PREFIX,
    _parse,
    _read_record,
    join_flush,
    mark_waiting,
    publish_done,
    record_id,
    seen_now,
    successor_waiting,
)
from resilient.checkpoint.storage import Storage
from tests.dist import run_distributed
from tests.test_memory_nodes import _root
from tests.test_sealed_nodes import _state

pytestmark = [pytest.mark.distributed]


def _job(
    rank: int,
    world: int,
    url: str,
    base: str,
    then: str = "",
    wait_s: float = 20.0,
    job_id: str | None = None,
    close: bool = True,
) -> dict:
    """Durable step 1, committed snapshots 2 and 3 on nodes of one rank each, then ``then``
    before the close (``close`` False: none, every worker dies as in a torchrun teardown):
    ``lost:1,2`` those nodes' memory is gone; ``wipe-0`` node 0's memory is gone (rank 0 on a
    new host); ``kill-persister-0`` node 0's persister is killed; ``foreign`` an invitation for
    step 3 of another state is at the URL (node 0's memory gone); ``planted`` a record nested
    too deep is at the URL.  Returns what the close took and the files its node holds of step 3."""
    import signal

    import torch.distributed as dist

    ck = Checkpointer(
        url, memory_every=1, memory_root=_root(base, rank), persister=True, job_id=job_id
    )
    ck._persister_config["join_wait_s"] = wait_s
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    held = sorted(p.name for p in (Path(ck.memory.dir) / "steps" / "step_00000003").iterdir())
    dist.barrier()
    steps = Path(ck.memory.dir) / "steps"
    if then.startswith("lost:") and rank in [int(r) for r in then[5:].split(",")]:
        _wipe(steps)
    if rank == 0 and then in ("wipe-0", "foreign"):
        _wipe(steps)
    if rank == 0 and then == "foreign":
        (Path(url) / FLUSH_NAME).write_text(json.dumps(_invitation(ck.job_id, manifest="0" * 64)))
    if rank == 0 and then == "planted":  # someone else's bucket: a FLUSH.json is already there
        (Path(url) / FLUSH_NAME).write_bytes(b"[" * 4000)
    if rank == 0 and then == "kill-persister-0":
        os.kill(ck._persister.pid, signal.SIGKILL)
        ck._persister._proc.wait()
    dist.barrier()
    t = time.monotonic()
    if close:
        ck.close()
    return {"held": held, "close_s": time.monotonic() - t}


def _wipe(steps: Path) -> None:
    """A node's memory gone: its steps' directory removed (the tier's own thread may still be
    retiring an old step in it meanwhile)."""
    deadline = time.monotonic() + 30
    while steps.exists():
        shutil.rmtree(steps, ignore_errors=True)
        assert time.monotonic() < deadline, f"{steps} cannot be removed"


def _restore(rank: int, world: int, url: str, base: str) -> dict:
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=False)
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = {"step": got, "source": ck.last_load.source, "w": state["w"].tolist()}
    ck.close()
    return out


def _await_steps(url: str, want: list[int], timeout_s: float = 120.0) -> list[int]:
    """The persisters flush after the job's processes are gone: wait for their commit."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = Checkpointer(url).steps()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _persister_logs(base: str) -> str:
    return "\n".join(p.read_text() for p in sorted(Path(base).rglob("persister.log")))


def test_on_three_nodes_the_persisters_flush_the_newest_snapshot_together(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    got = run_distributed(_job, 3, url, base)
    # no node holds every rank file of step 3: its own rank's and one replica
    assert all(sum(n.startswith("rank_") for n in g["held"]) == 2 for g in got), got
    assert _await_steps(url, [1, 3]) == [1, 3], _persister_logs(base)
    assert _parse((tmp_path / "ckpt" / FLUSH_NAME).read_bytes())["done"]  # the flush's word
    shutil.rmtree(base)  # every node's memory gone: the job runs again elsewhere
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["source"]) for r in results] == [(3, "durable")] * 3
    assert [r["w"][0] for r in results] == [3.0, 4.0, 5.0]


def test_a_lost_nodes_files_are_flushed_from_their_replicas(tmp_path):
    """Node 1's memory is gone: node 2, which holds rank 1's replica, writes it once rank 1's
    own node has not."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_job, 3, url, base, "lost:1", 5.0)
    assert _await_steps(url, [1, 3]) == [1, 3], _persister_logs(base)
    assert "writing the replica this node holds" in _persister_logs(base)
    shutil.rmtree(base)
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["w"][0]) for r in results] == [(3, 3.0), (3, 4.0), (3, 5.0)]


def test_a_file_no_node_holds_leaves_the_snapshot_in_memory(tmp_path):
    """Nodes 1 and 2's memory is gone, and with it every copy of rank 1's file: step 3 is not
    committed (durable storage stays at step 1) and the invitation goes."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_job, 3, url, base, "lost:1,2", 5.0)
    log = ""
    deadline = time.monotonic() + 120
    while "is not flushed" not in log and time.monotonic() < deadline:
        time.sleep(0.2)
        log = _persister_logs(base)
    assert "is not flushed: 1 of its 3 files never reached" in log, log
    assert Checkpointer(url).steps() == [1]
    assert _parse((tmp_path / "ckpt" / FLUSH_NAME).read_bytes())["done"]


def test_on_two_nodes_a_step_whose_replicas_never_arrived_is_flushed_with_the_other_node(
    tmp_path,
):
    """Node 0 lacks rank 1's file of step 4 (its replica never arrived): node 1's persister
    writes it where node 0's asks, and step 4, not step 3, becomes durable."""
    from tests.test_sealed_nodes import _k2_commit_4_replica_lost

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_k2_commit_4_replica_lost, 2, url, base, True)
    assert _await_steps(url, [4]) == [4], _persister_logs(base)
    assert "the other nodes' persisters are asked for the rest" in _persister_logs(base)
    shutil.rmtree(base)
    results = run_distributed(_restore, 2, url, base)
    assert [(r["step"], r["source"], r["w"][0]) for r in results] == [
        (4, "durable", 4.0),
        (4, "durable", 5.0),
    ]


def _rolled_back_then_closed(rank: int, world: int, url: str, base: str) -> None:
    """Durable saves 10 and 20, a rollback to 10, snapshots 11 and 12 (numbered below 20), then
    the job ends with no durable save since (tests/test_rollback.py, on three nodes)."""
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=True)
    ck._persister_config["join_wait_s"] = 20.0
    for s in (10, 20):
        ck.save(s, _state(rank, world, float(s))).wait()
    assert ck.load(_state(rank, world, 0.0), step=10) == 10
    for s in (11, 12):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    ck.close()


def test_on_three_nodes_a_flush_after_a_rollback_commits_the_new_line(tmp_path):
    """The joiners wait for their newest state to be judged, not for durable storage to reach
    its step number (20 is above 12 here, and is the line the rollback left)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_rolled_back_then_closed, 3, url, base)
    assert _await_steps(url, [10, 12, 20]) == [10, 12, 20], _persister_logs(base)[-5000:]
    shutil.rmtree(base)
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["w"][0]) for r in results] == [(12, 12.0), (12, 13.0), (12, 14.0)]


JOB = "torchrun:joint-flush"  # (torchrun's run id: one job id across restarts of one run)


def _restarted_and_saved(rank: int, world: int, url: str, base: str) -> dict:
    ck = Checkpointer(
        url, memory_every=1, memory_root=_root(base, rank), persister=True, job_id=JOB
    )
    got = ck.load(_state(rank, world, 0.0))
    t = time.monotonic()
    ck.save(4, _state(rank, world, 4.0)).wait()
    took = time.monotonic() - t
    ck.close()
    return {"loaded": got, "save_s": took}


@pytest.mark.parametrize(
    "node_0", ["", "wipe-0", "kill-persister-0"], ids=["same-hosts", "new-host", "no-persister"]
)
def test_a_restart_is_not_held_up_by_its_predecessors_joiners(tmp_path, node_0):
    """torchrun restarts the workers at once: the predecessor's persisters flush (or join) while
    the new ones wait for their node's lock; a joiner stops once a successor waits (the job runs
    again on its node, from its memory), and so does the committer's wait for files, so the
    restarted job's first durable save never waits out join_wait_s (60 s here)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_job, 3, url, base, node_0, 60.0, JOB, False)
    results = run_distributed(_restarted_and_saved, 3, url, base)
    assert max(r["save_s"] for r in results) < 30.0, (results, _persister_logs(base)[-6000:])
    assert {r["loaded"] for r in results} == {3}  # (node 0's ranks' files from the replicas)
    assert 4 in Checkpointer(url).steps()


@pytest.mark.parametrize("wipe_node_0", [False, True], ids=["whole-on-node-0", "node-0-empty"])
def test_on_two_nodes_a_close_does_not_wait_for_what_cannot_come(tmp_path, wipe_node_0):
    """Node 0 holds the newest snapshot whole, or nothing at all: its persister asks no one, and
    its done record ends node 1's wait at once (the close waits for its persister)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    got = run_distributed(_job, 2, url, base, "wipe-0" if wipe_node_0 else "", 60.0)
    took = [g["close_s"] for g in got]
    assert max(took) < 30.0, (took, _persister_logs(base)[-3000:])
    assert Checkpointer(url).steps() == ([1] if wipe_node_0 else [1, 3])


_SLOW_SITE = str(Path(__file__).parent / "slow_persister_site")


def _slow_storage_close(rank: int, world: int, url: str, base: str) -> None:
    import os

    os.environ["PYTHONPATH"] = os.pathsep.join([_SLOW_SITE, os.environ.get("PYTHONPATH", "")])
    os.environ["SLOW_PERSISTER_WRITE_S"] = "4"  # each rank file's upload: 4 s (a large file)
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=True)
    ck._persister_config["join_wait_s"] = 3.0  # (scaled with it: uploads longer than the wait)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    ck.close()


def test_uploads_longer_than_the_wait_neither_fail_the_flush_nor_go_twice(tmp_path):
    """join_wait_s bounds how long a node waits for the others' next file, not their uploads:
    every node's own file takes longer than it, and the flush still commits, with no replica
    written (no node was lost)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_slow_storage_close, 3, url, base, timeout_s=300)
    assert _await_steps(url, [1, 3], timeout_s=60) == [1, 3], _persister_logs(base)[-4000:]
    assert "writing the replica this node holds" not in _persister_logs(base)


def _invitation(job_id: str = "j", **fields) -> dict:
    return {
        "format": 1,
        "job_id": job_id,
        "id": "0123456789abcdef",
        "done": False,
        "step": 3,
        "generation": 5,
        "manifest": "a" * 64,
        "seen": [],
        **fields,
    }


def test_an_invitation_for_another_state_of_the_step_is_not_served(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_job, 3, url, base, "foreign", 4.0)
    step3 = tmp_path / "ckpt" / "step_00000003"
    written = sorted(p.name for p in step3.iterdir()) if step3.exists() else []
    assert not [n for n in written if n.startswith("rank_")], written
    assert "is not the one invited" in _persister_logs(base)


def test_a_planted_record_nested_too_deep_does_not_stop_the_flush(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_job, 3, url, base, "planted")
    assert _await_steps(url, [1, 3]) == [1, 3], _persister_logs(base)[-3000:]
    assert "RecursionError" not in _persister_logs(base)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"[]",
        b"[" * 4000,
        b'{"format": 1}',
        b'{"format": 1, "step": ' + b"9" * 4000 + b"}",
        json.dumps(_invitation(step=-1)).encode(),
        json.dumps(_invitation(step=10**30)).encode(),
        json.dumps(_invitation(generation=True)).encode(),
        json.dumps(_invitation(manifest="../x")).encode(),
        json.dumps(_invitation(id="../../etc")).encode(),
        json.dumps(_invitation(done=None)).encode(),
        json.dumps(_invitation(seen=["a" * 63])).encode(),
        json.dumps(_invitation(seen=["a" * 64] * 17)).encode(),
        json.dumps(_invitation(done=True, seen="a" * 64)).encode(),
        b'{"format": 1, "job_id": "\xff\xfe"}',
    ],
)
def test_a_hostile_record_is_ignored(text):
    assert _parse(text) is None


@pytest.mark.parametrize("kind", ["fifo", "symlink", "huge", "dir"])
def test_a_record_that_is_no_file_to_read_is_ignored_at_once(tmp_path, kind, caplog):
    storage = Storage(str(tmp_path))
    target = tmp_path / FLUSH_NAME
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text(json.dumps(_invitation()))
        target.symlink_to(tmp_path / "elsewhere")
    elif kind == "huge":
        with open(target, "wb") as f:
            f.truncate(10 << 30)  # sparse: 10 GiB
    else:
        target.mkdir()
    assert _read_record(storage, set()) is None


def test_well_formed_records_are_read():
    assert _parse(json.dumps(_invitation()).encode())["generation"] == 5
    done = _parse(json.dumps(_invitation(done=True, step=None, seen=["b" * 64])).encode())
    assert done["seen"] == ["b" * 64]


# --- from a second review ------------------------------------------------------------------------


def _live_sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_waiting_marker_of_another_process_is_no_successor(tmp_path):
    """A persister SIGKILLed while it waited leaves its marker; once its pid is reused (here: a
    process that never wrote it) the marker must not end every later joiner at once."""
    unrelated = _live_sleeper()
    try:
        (tmp_path / f"{WAITING_PREFIX}{unrelated.pid}").write_text("12345")
        assert not successor_waiting(str(tmp_path))
        (tmp_path / f"{WAITING_PREFIX}{unrelated.pid}").write_text("")
        assert not successor_waiting(str(tmp_path))
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_waiting_marker_of_a_zombie_is_no_successor_and_a_live_one_is(tmp_path):
    from resilient.checkpoint.lease import _process_start

    z = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{z.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    live = _live_sleeper()
    try:
        (tmp_path / f"{WAITING_PREFIX}{z.pid}").write_text(str(_process_start(z.pid)))
        assert not successor_waiting(str(tmp_path))
        (tmp_path / f"{WAITING_PREFIX}{live.pid}").write_text(str(_process_start(live.pid)))
        assert successor_waiting(str(tmp_path))  # (the control: this is what a marker says)
        (tmp_path / f"{WAITING_PREFIX}{live.pid}").unlink()
        mark_waiting(str(tmp_path))  # this process's own is never a successor's...
        assert not successor_waiting(str(tmp_path))
        assert not (tmp_path / f"{WAITING_PREFIX}{z.pid}").exists()  # ...and a dead one goes
    finally:
        z.wait()
        live.kill()
        live.wait()


class _Promoter:
    """What join_flush and publish_done read of a Promoter: a node's memory and the URL."""

    def __init__(self, memory_dir: str, url: str, job_id: str) -> None:
        self.job_dir, self.steps_dir = memory_dir, os.path.join(memory_dir, "steps")
        self.storage, self.job_id, self.config = Storage(url), job_id, {}
        self.flush_ids: list[str] = []


def test_a_done_record_names_only_what_the_flush_found_when_it_began(tmp_path):
    """A restart's trainer snapshots step 4 into the node's memory while its predecessor's flush
    still uploads: the predecessor's done record must not name step 4 (judged by no flush), or
    the successor's joiners would stop at it without serving their own committer."""
    import torch

    url, mem = str(tmp_path / "ckpt"), str(tmp_path / "mem")
    ck = Checkpointer(url, memory_every=1, memory_root=mem, persister=False)
    ck.snapshot(3, {"w": torch.ones(4)}).wait()
    p = _Promoter(ck.memory.dir, url, ck.job_id)
    seen = seen_now(p)  # the predecessor's flush begins, with step 3 its newest
    ck.snapshot(4, {"w": torch.ones(4) * 4}).wait()  # the successor's, meanwhile
    publish_done(p, seen)
    baseline = record_id(p.storage)  # (the successor's persister starts after it)
    t = time.monotonic()
    join_flush(p, 3.0, baseline)  # the successor dies, step 4 its newest: nothing judged it
    took = time.monotonic() - t
    ck.close()
    assert took > 2.5, took


def test_a_done_record_published_after_the_joiners_persister_started_ends_its_wait(tmp_path):
    import torch

    url, mem = str(tmp_path / "ckpt"), str(tmp_path / "mem")
    ck = Checkpointer(url, memory_every=1, memory_root=mem, persister=False)
    ck.snapshot(3, {"w": torch.ones(4)}).wait()
    p = _Promoter(ck.memory.dir, url, ck.job_id)
    baseline = record_id(p.storage)  # none yet: this joiner's persister starts
    publish_done(p, [])  # rank 0's node, its memory gone, flushed nothing (before this read)
    t = time.monotonic()
    join_flush(p, 30.0, baseline)
    ck.close()
    assert time.monotonic() - t < 10.0


def _two_nodes_newest_replica_lost_then_node_1_lost(rank, world, url, base):
    """Snapshots 2 and 3 committed and replicated (node 0 holds step 3 whole), step 4's
    replicas never arrive, then node 1's memory is lost before the close's flush."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=True)
    ck._persister_config["join_wait_s"] = 3.0
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    ck._memory._join_pending()
    ck._memory._replicas.replicate = lambda *a, **k: None  # step 4's replicas never arrive
    ck.snapshot(4, _state(rank, world, 4.0)).wait()
    ck._memory._join_pending()
    dist.barrier()
    held = {}
    for s in (3, 4):
        d = Path(ck.memory.dir) / "steps" / f"step_{s:08d}"
        held[s] = sorted(n.name for n in d.iterdir()) if d.exists() else []
    if rank == 1:
        _wipe(Path(ck.memory.dir) / "steps")  # node 1 lost (its memory with it)
    dist.barrier()
    ck.close()
    return held


def test_a_failed_joint_flush_falls_back_to_an_older_snapshot_held_whole(tmp_path):
    """Step 4 cannot be flushed (rank 1's file is nowhere now), but node 0 holds step 3 whole:
    it becomes durable, as a flush always fell back to an older snapshot."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    held = run_distributed(_two_nodes_newest_replica_lost_then_node_1_lost, 2, url, base)
    assert sum(n.startswith("rank_") for n in held[0][3]) == 2, held  # step 3 whole on node 0
    assert sum(n.startswith("rank_") for n in held[0][4]) == 1, held  # step 4: rank 0's only
    assert _await_steps(url, [1, 3], timeout_s=60) == [1, 3], _persister_logs(base)[-4000:]


def _two_nodes_slow_flush_close(rank, world, url, base):
    import torch.distributed as dist

    os.environ["PYTHONPATH"] = os.pathsep.join([_SLOW_SITE, os.environ.get("PYTHONPATH", "")])
    os.environ["SLOW_PERSISTER_WRITE_S"] = "6"  # each rank file's upload: 6 s
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=True)
    for s in (2, 3):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    dist.barrier()
    t = time.monotonic()
    ck.close()
    return time.monotonic() - t


def test_on_two_nodes_node_1s_close_does_not_wait_for_node_0s_upload(tmp_path):
    """Node 0 holds step 3 whole: its done record comes before its upload, so node 1's persister
    (nothing to write) and close are done at once."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    took = run_distributed(_two_nodes_slow_flush_close, 2, url, base, timeout_s=300)
    assert took[0] > 10.0, took  # node 0 uploads two 6 s files
    assert took[1] < 8.0, took
