"""The persisters' flush of sealed snapshots across three nodes (joint_flush.seal_together): no
node holds every rank's copy of the newest sealed step (each has its own ranks' and its source
node's pairs), so the persisters seal it together through the URL (url_group.py), each in its
own node's memory, and then write it out together, so that a job killed and run again elsewhere
resumes from it.  Nodes are memory roots, as in test_memory_nodes.py."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.checkpoint.joint_flush import seal_together
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.url_group import GroupBroken, UrlGroup
from tests.dist import run_distributed
from tests.test_joint_flush import _await_steps, _restore
from tests.test_joint_flush import _persister_logs as _logs
from tests.test_memory_nodes import _root
from tests.test_sealed_nodes import _state

pytestmark = [pytest.mark.distributed]


def _open(
    url: str,
    base: str,
    node: int,
    wait_s: float,
    job_id: str | None = None,
    persister=True,
    options: dict | None = None,
) -> Checkpointer:
    ck = Checkpointer(
        url,
        memory_every=1,
        memory_root=_root(base, node),
        persister=persister,
        memory_commit_every=0,
        job_id=job_id,
        storage_options=options,
    )
    if ck._persister_config is not None:
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
    options: dict | None = None,
) -> int | None:
    """Durable step 1, sealed snapshots 2 and 3 on nodes of one rank each, then the close (the
    persisters flush; ``close`` False: none, every rank's process ends as in a torchrun
    teardown).  ``then``: ``lost:N`` node N's memory is gone first; ``kill-persister-0`` node
    0's persister (the seal's root) is killed.  ``options``: the URL's storage options."""
    import os
    import signal

    import torch.distributed as dist

    ck = _open(url, base, rank, wait_s, job_id, options=options)
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


def _restarted_and_saved(rank: int, world: int, url: str, base: str, persister: bool) -> dict:
    ck = _open(url, base, rank, 60.0, JOB, persister)
    t = time.monotonic()
    got = ck.load(_state(rank, world, 0.0))
    ck.save(4, _state(rank, world, 4.0)).wait()
    took = time.monotonic() - t
    ck.close()
    return {"loaded": got, "source": ck.last_load.source, "save_s": took}


@pytest.mark.parametrize("persister", [True, False], ids=["persisters", "load-alone"])
def test_a_restart_is_not_held_up_by_its_predecessors_seal(tmp_path, persister):
    """torchrun restarts the workers at once: the predecessor's persisters open and join a seal
    while the new ones wait for their node's lock (or, without persisters, the restarted ranks'
    load waits for the seal lock); a seal's waits are cut short once a successor waits (the job
    runs again here, and its load seals), so the restarted job restores the sealed step 3 from
    memory, and its load and first durable save never wait out join_wait_s (60 s here)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_job, 3, url, base, "", 60.0, False, JOB)
    results = run_distributed(_restarted_and_saved, 3, url, base, persister)
    assert [(r["loaded"], r["source"]) for r in results] == [(3, "memory")] * 3, _logs(base)
    assert max(r["save_s"] for r in results) < 30.0, (results, _logs(base)[-6000:])
    assert 4 in Checkpointer(url).steps()


def _two_nodes_node_1_lost(rank: int, world: int, url: str, base: str, wait_s: float):
    """Durable step 1, sealed snapshots 2 and 3 on two nodes of one rank each; node 1 is then
    lost whole (its persister killed, as its host would take it), and rank 0 says goodbye."""
    import os
    import signal

    import torch.distributed as dist

    ck = _open(url, base, rank, wait_s)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck._memory._join_pending()  # (the last pair)
    dist.barrier()
    if rank == 1:
        os.kill(ck._persister.pid, signal.SIGKILL)
        ck._persister._proc.wait()
    dist.barrier()
    took = None
    if rank == 0:
        t = time.monotonic()
        ck.close()  # (told goodbye, its persister flushes; the close waits for it)
        took = time.monotonic() - t
    return took


def test_on_two_nodes_node_0_seals_alone_without_waiting_for_a_lost_node(tmp_path):
    """Node 0 holds its own rank's copy of step 3 and node 1's pair: its persister seals step 3
    alone and flushes it at once, without waiting for node 1's persister, which is gone with its
    node (it waited out join_wait_s for it in a seal through the URL first; found by a review)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    took = run_distributed(_two_nodes_node_1_lost, 2, url, base, 120.0)[0]
    assert Checkpointer(url).steps() == [1, 3], _logs(base)[-3000:]
    assert took < 60.0, f"rank 0's close (its persister's flush) took {took:.0f}s"
    assert "the seal through" not in _logs(base)


class _LeavesAtTheManifest(UrlGroup):
    """A node whose wait for the root ran out just as the root sent the manifest (its successor
    waits, or the root was slow): it leaves the seal there, having verified and offered its
    copies."""

    def broadcast(self, data: bytes, cap: int) -> bytes:
        raise GroupBroken("(the test) this node left the seal")


class _Promoter:  # (what seal_together reads of the persister's Promoter)
    def __init__(self, url: str, job_dir: str, node: int, nodes: int) -> None:
        self.storage = Storage(url)
        self.job_dir = job_dir
        self.config = {"nodes": nodes, "node": node}


def seal_nodes(url: str, jobs: list[Path], groups: list[UrlGroup]) -> list:
    """The persisters' seal through the URL, one thread a node (each closes its group after):
    what each node's seal_together returned."""
    out: list = [None] * len(groups)

    def seal(n: int) -> None:
        out[n] = seal_together(_Promoter(url, str(jobs[n]), n, len(groups)), groups[n], 1.0)
        groups[n].close()

    threads = [threading.Thread(target=seal, args=(n,)) for n in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_a_node_that_leaves_the_seal_leaves_it_uncommitted_on_every_node(tmp_path):
    """Node 2 leaves after its copies counted: the others must not commit the step (a step
    committed on some nodes and not on the node holding a rank's only copy voids that copy's
    record, and the next load would fall back past it); the next run's load seals it."""
    from tests.test_sealed_nodes import _expected, _restore, _sealed_run

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 3, url, base, 1, [1, 2, 3])
    jobs = [next(Path(_root(base, n)).glob("job-*")) for n in range(3)]
    groups = [
        (_LeavesAtTheManifest if n == 2 else UrlGroup)(Storage(url), "0" * 16, n, 3, 3.0)
        for n in range(3)
    ]
    assert seal_nodes(url, jobs, groups) == [None, None, None]
    assert [sorted((j / "steps").rglob("MANIFEST.json")) for j in jobs] == [[]] * 3
    assert run_distributed(_restore, 3, url, base, [0, 1, 2]) == _expected(3, 3)


def _restore_s3(rank: int, world: int, url: str, base: str, options: dict) -> dict:
    ck = Checkpointer(url, memory_root=_root(base, rank), storage_options=options)
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = {"step": got, "w": state["w"].tolist()}
    ck.close()
    return out


@pytest.mark.s3
def test_on_three_nodes_the_seal_goes_through_an_object_store(tmp_path, s3):
    """The persisters' seal through an s3:// URL (s3fs against a local S3 server over HTTP): the
    rounds' posts are objects, the session's folder a prefix, removed after."""
    url, base = f"s3://{s3.new_bucket()}/run1", str(tmp_path / "memory")
    run_distributed(_sealed_job, 3, url, base, "", 20.0, True, None, s3.options)
    deadline = time.monotonic() + 120
    while Checkpointer(url, storage_options=s3.options).steps() != [1, 3]:
        assert time.monotonic() < deadline, _logs(base)[-4000:]
        time.sleep(0.5)
    assert not Storage(url, s3.options).exists("FLUSH.seal")
    shutil.rmtree(base)  # every node's memory gone: the job runs again elsewhere
    results = run_distributed(_restore_s3, 3, url, base, s3.options)
    assert [(r["step"], r["w"][0]) for r in results] == [(3, 3.0), (3, 4.0), (3, 5.0)]
