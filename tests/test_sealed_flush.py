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


def _open(url: str, base: str, node: int, wait_s: float) -> Checkpointer:
    ck = Checkpointer(
        url, memory_every=1, memory_root=_root(base, node), persister=True, memory_commit_every=0
    )
    ck._persister_config["join_wait_s"] = wait_s
    return ck


def _sealed_job(rank: int, world: int, url: str, base: str, then: str = "", wait_s: float = 20.0):
    """Durable step 1, sealed snapshots 2 and 3 on nodes of one rank each, then the close (the
    persisters flush).  ``then``: ``lost:N`` node N's memory is gone first."""
    import torch.distributed as dist

    ck = _open(url, base, rank, wait_s)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck._memory._join_pending()  # (the last pair)
    dist.barrier()
    if then.startswith("lost:") and rank == int(then[5:]):
        shutil.rmtree(ck.memory.dir)
    dist.barrier()
    ck.close()


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
