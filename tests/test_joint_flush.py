"""The persisters' flush across three nodes (joint_flush.py): no node holds every file of the newest
committed snapshot (each has its own ranks' and its source node's replicas), yet when the job
closes or dies it reaches durable storage: rank 0's node's persister asks through the URL, the
others write their own ranks' files.  Nodes are memory roots, as in test_memory_nodes.py."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.checkpoint.joint_flush import FLUSH_NAME, _parse
from tests.dist import run_distributed
from tests.test_memory_nodes import _root
from tests.test_sealed_nodes import _state

pytestmark = [pytest.mark.distributed]


def _committed_then_closed(rank: int, world: int, url: str, base: str, steps: list[int]) -> dict:
    """Durable step 1, then committed snapshots of ``steps``, then close: each node's persister
    is told goodbye and flushes (rank 0's) or joins (the others')."""
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=True)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in steps:
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    held = sorted(
        p.name for p in (Path(ck.memory.dir) / "steps" / f"step_{steps[-1]:08d}").iterdir()
    )
    ck.close()
    return {"held": held}


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
    got = run_distributed(_committed_then_closed, 3, url, base, [2, 3])
    # no node holds every rank file of step 3: its own rank's and one replica
    assert all(sum(n.startswith("rank_") for n in g["held"]) == 2 for g in got), got
    assert _await_steps(url, [1, 3]) == [1, 3], _persister_logs(base)
    assert not (tmp_path / "ckpt" / FLUSH_NAME).exists()  # the invitation is gone
    shutil.rmtree(base)  # every node's memory gone: the job runs again elsewhere
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["source"]) for r in results] == [(3, "durable")] * 3
    assert [r["w"][0] for r in results] == [3.0, 4.0, 5.0]


def _lost_nodes_run(rank: int, world: int, url: str, base: str, lost: list[int]) -> None:
    """As _committed_then_closed, but the memory of the nodes ``lost`` is gone before the flush
    (their persisters find nothing to write)."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=True)
    ck._persister_config["join_wait_s"] = 5.0  # (how long the persisters wait for each other)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    dist.barrier()
    if rank in lost:
        shutil.rmtree(Path(ck.memory.dir) / "steps")
    dist.barrier()
    ck.close()


def test_a_lost_nodes_files_are_flushed_from_their_replicas(tmp_path):
    """Node 1's memory is gone: node 2, which holds rank 1's replica, writes it once rank 1's
    own node has not."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_lost_nodes_run, 3, url, base, [1])
    assert _await_steps(url, [1, 3]) == [1, 3], _persister_logs(base)
    assert "writing the replica this node holds" in _persister_logs(base)
    shutil.rmtree(base)
    results = run_distributed(_restore, 3, url, base)
    assert [(r["step"], r["w"][0]) for r in results] == [(3, 3.0), (3, 4.0), (3, 5.0)]


def test_a_file_no_node_holds_leaves_the_snapshot_in_memory(tmp_path):
    """Nodes 1 and 2's memory is gone, and with it every copy of rank 1's file: step 3 is not
    committed (durable storage stays at step 1) and the invitation goes."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_lost_nodes_run, 3, url, base, [1, 2])
    log = ""
    deadline = time.monotonic() + 120
    while "is not flushed" not in log and time.monotonic() < deadline:
        time.sleep(0.2)
        log = _persister_logs(base)
    assert "is not flushed: 1 of its 3 files never reached" in log, log
    assert Checkpointer(url).steps() == [1]
    assert not (tmp_path / "ckpt" / FLUSH_NAME).exists()


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


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"[]",
        b'{"format": 1}',
        b'{"format": 1, "job_id": "j", "step": -1, "generation": 0, "manifest": "'
        + b"0" * 64
        + b'", "id": "0123456789abcdef"}',
        b'{"format": 1, "job_id": "j", "step": 3, "generation": true, "manifest": "'
        + b"0" * 64
        + b'", "id": "0123456789abcdef"}',
        b'{"format": 1, "job_id": "j", "step": 3, "generation": 1, "manifest": "../x", '
        b'"id": "0123456789abcdef"}',
        b'{"format": 1, "job_id": "j", "step": 3, "generation": 1, "manifest": "'
        + b"0" * 64
        + b'", "id": "../../etc"}',
    ],
)
def test_a_hostile_invitation_is_ignored(text):
    assert _parse(text) is None


def test_a_well_formed_invitation_is_read():
    text = json.dumps(
        {
            "format": 1,
            "job_id": "j",
            "step": 3,
            "generation": 2,
            "manifest": "a" * 64,
            "id": "0123456789abcdef",
        }
    ).encode()
    assert _parse(text)["generation"] == 2
