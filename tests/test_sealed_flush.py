"""The persisters' flush of sealed snapshots across three nodes (joint_flush.seal_together): no
node holds every rank's copy of the newest sealed step (each has its own ranks' and its source
node's pairs), so the persisters seal it together through the URL (url_group.py), each in its
own node's memory, and then write it out together, so that a job killed and run again elsewhere
resumes from it.  Nodes are memory roots, as in test_memory_nodes.py."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from tests.dist import run_distributed
from tests.test_memory_nodes import _root
from tests.test_sealed_nodes import _state

pytestmark = [pytest.mark.distributed]


def _open(url: str, base: str, node: int, wait_s: float, job_id: str | None = None):
    ck = Checkpointer(
        url,
        memory_every=1,
        memory_root=_root(base, node),
        persister=True,
        memory_commit_every=0,
        job_id=job_id,
    )
    ck._persister_config["join_wait_s"] = wait_s
    return ck


def _sealed_job(
    rank: int,
    world: int,
    url: str,
    base: str,
    then: str = "",
    wait_s: float = 20.0,
    close: bool = True,
    job_id: str | None = None,
) -> int | None:
    """Durable step 1, sealed snapshots 2 and 3 on nodes of one rank each, then the close (the
    persisters flush; ``close`` False: none, every rank's process ends as in a torchrun
    teardown).  ``then``: ``lost:N`` node N's memory is gone first; ``kill-persister-0`` node
    0's persister (the seal's root) is killed."""
    import os
    import signal

    import torch.distributed as dist

    ck = _open(url, base, rank, wait_s, job_id)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck._memory._join_pending()  # (the last pair)
    dist.barrier()
    if then.startswith("lost:") and rank == int(then[5:]):
        shutil.rmtree(ck.memory.dir)
    if then == "kill-persister-0" and rank == 0:
        os.kill(ck._persister.pid, signal.SIGKILL)
        ck._persister._proc.wait()
    dist.barrier()
    pid = ck._persister.pid if ck._persister is not None else None
    if close:
        ck.close()
    return pid


def _await_steps(url: str, want: list[int], timeout_s: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = Checkpointer(url).steps()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _restore(rank: int, world: int, url: str, base: str) -> dict:
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=False)
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = {"step": got, "source": ck.last_load.source, "w": state["w"].tolist()}
    ck.close()
    return out


def _logs(base: str) -> str:
    return "\n".join(p.read_text() for p in sorted(Path(base).rglob("persister.log")))


def test_on_three_nodes_the_persisters_seal_and_flush_the_newest_sealed_step(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_job, 3, url, base)
    assert _await_steps(url, [1, 3]) == [1, 3], _logs(base)
    assert not (tmp_path / "ckpt" / "FLUSH.seal").exists() or not list(
        (tmp_path / "ckpt" / "FLUSH.seal").iterdir()
    )
    shutil.rmtree(base)  # every node's memory gone: the job runs again elsewhere
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["source"]) for r in results] == [(3, "durable")] * 3
    assert [r["w"] for r in results] == [[3.0] * 4, [4.0] * 4, [5.0] * 4]


def test_a_lost_nodes_ranks_are_sealed_and_flushed_from_the_next_nodes_pairs(tmp_path):
    """Node 1's memory is gone before the flush: rank 1's copy of step 3 is node 2's pair, which
    node 2's persister verifies, sends rank 0 the record of, and writes out."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_job, 3, url, base, "lost:1", 5.0)
    assert _await_steps(url, [1, 3]) == [1, 3], _logs(base)
    shutil.rmtree(base)
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["w"][0]) for r in results] == [(3, 3.0), (3, 4.0), (3, 5.0)]


def test_when_every_rank_dies_the_persisters_seal_and_flush_it(tmp_path):
    """No goodbye: every rank's process ends (the job killed), and each node's persister, its
    trainer gone, takes part in the seal."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_job, 3, url, base, "", 20.0, False)
    assert _await_steps(url, [1, 3]) == [1, 3], _logs(base)
    shutil.rmtree(base)
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["w"][0]) for r in results] == [(3, 3.0), (3, 4.0), (3, 5.0)]


def test_without_the_root_the_others_give_up_and_the_next_load_seals_from_memory(tmp_path):
    """Node 0's persister is gone: no seal is opened, the other nodes' persisters end once their
    wait is over, durable storage stays at step 1, and the records and pairs stay in memory: the
    job run again on those nodes seals step 3 from them."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    pids = run_distributed(_sealed_job, 3, url, base, "kill-persister-0", 3.0)[1:]
    deadline = time.monotonic() + 120
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), _logs(base)
    assert "the job runs again" not in _logs(base)  # (they ended of themselves)
    assert Checkpointer(url).steps() == [1], _logs(base)
    assert not (tmp_path / "ckpt" / "FLUSH.seal").exists()
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["source"]) for r in results] == [(3, "memory")] * 3, _logs(base)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


JOB = "torchrun:sealed-flush"  # (torchrun's run id: one job id across restarts of one run)


def _restarted_and_saved(rank: int, world: int, url: str, base: str) -> dict:
    ck = _open(url, base, rank, 60.0, JOB)
    t = time.monotonic()
    got = ck.load(_state(rank, world, 0.0))
    ck.save(4, _state(rank, world, 4.0)).wait()
    took = time.monotonic() - t
    ck.close()
    return {"loaded": got, "source": ck.last_load.source, "save_s": took}


def test_a_restart_is_not_held_up_by_its_predecessors_seal(tmp_path):
    """torchrun restarts the workers at once: the predecessor's persisters open and join a seal
    while the new ones wait for their node's lock; a seal's waits are cut short once a successor
    waits (the job runs again here, and its load seals), so the restarted job restores the sealed
    step 3 from memory, and its load and first durable save never wait out join_wait_s (60 s
    here)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_job, 3, url, base, "", 60.0, False, JOB)
    results = run_distributed(_restarted_and_saved, 3, url, base)
    assert [(r["loaded"], r["source"]) for r in results] == [(3, "memory")] * 3, _logs(base)
    assert max(r["save_s"] for r in results) < 30.0, (results, _logs(base)[-6000:])
    assert 4 in Checkpointer(url).steps()
