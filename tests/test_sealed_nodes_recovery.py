"""Sealed snapshots across nodes: in-job recovery (its survivors, a spare in a failed rank's
place), a damaged run number, and a flush whose commit fails."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.dist import run_distributed
from tests.test_memory_nodes import _root
from tests.test_sealed_nodes import _open, _restore, _sealed_run, _state

pytestmark = [pytest.mark.distributed]


def _regroup(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _sealed_then_aborted(rank: int, world: int, url: str, base: str, port: int, join: bool):
    """Sealed snapshots 1-3 (the last one's replication joined or not), then the group broken
    and formed again: in-job recovery's part up to the carrying over of the checkpointer."""
    ck = _open(url, base, rank * 2 // world)
    for s in (1, 2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    if join:
        ck._memory._join_pending()
    ck.abort()
    _regroup(rank, world, port)
    return ck


def _load_and_close(ck, rank: int, world: int) -> dict:
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = {"step": got, "source": ck.last_load.source, "b": state["b"].tolist()}
    ck.close()
    return out


def _injob(rank: int, world: int, url: str, base: str, port: int, join: bool) -> dict:
    """In-job recovery's survivors: rebind, load."""
    ck = _sealed_then_aborted(rank, world, url, base, port, join)
    ck.rebind()
    return _load_and_close(ck, rank, world)


@pytest.mark.parametrize("join", [True, False])
def test_injob_survivors_restore_the_newest_sealed_step(tmp_path, join):
    from resilient.launch import free_port

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    got = run_distributed(_injob, 2, url, base, free_port(), join)
    assert [(r["step"], r["source"], r["b"]) for r in got] == [(3, "memory", [3.0] * 3)] * 2, got


def _injob_spare(rank: int, world: int, url: str, base: str, port: int, spare: int) -> dict:
    """As _injob, rank ``spare``'s process replaced by a spare: a new checkpointer on its node
    (the old one's sealed snapshots left as a dead process leaves them: released)."""
    ck = _sealed_then_aborted(rank, world, url, base, port, True)
    if rank == spare:
        import gc

        ck._memory._slots.release()  # (its writer gone)
        ck._memory._replicas.drop_groups()
        del ck
        gc.collect()
        ck = _open(url, base, rank * 2 // world)
    else:
        ck.rebind()
    return _load_and_close(ck, rank, world)


@pytest.mark.parametrize("spare", [0, 1])
def test_injob_with_a_spare_restores_the_newest_sealed_step(tmp_path, spare):
    from resilient.launch import free_port

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    got = run_distributed(_injob_spare, 2, url, base, free_port(), spare)
    assert [(r["step"], r["source"], r["b"]) for r in got] == [(3, "memory", [3.0] * 3)] * 2, got


def test_a_pairs_run_beyond_rank_0s_is_not_numbered_above_later_commits(tmp_path):
    """Node 0 is lost; node 1's pair of rank 0's step 3 says ``job_run`` 1000, beyond rank 0's
    run (the damage ``void_reason`` clamps to 0 where the sealer knows its run; only rank 0
    knows it).  Run B seals and restores step 3, then commits snapshots 4 and 5; run C must
    restore step 5, not step 3."""
    import json

    from tests.test_sealed_nodes import _committed_run

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    shutil.rmtree(_root(base, 0))
    pair = next(Path(_root(base, 1)).rglob("peer_00000.step_3.json"))
    wrap = json.loads(pair.read_text())
    wrap["record"]["job_run"] = 1000
    tmp = pair.with_suffix(".tmp")
    tmp.write_text(json.dumps(wrap))
    os.replace(tmp, pair)
    assert run_distributed(_committed_run, 2, url, base) == [3] * 2
    got = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["b"]) for r in got] == [(5, [5.0] * 3)] * 2, got


def test_a_flush_whose_commit_fails_keeps_the_records_and_pairs(tmp_path, monkeypatch):
    """The persister's flush on node 0 (``seal_across_nodes`` alone, ``clear=False``) finds
    every rank's copy of step 3, but committing it in node 0's memory fails (the tmpfs is full
    as the manifest is written): the step is not counted as sealed, and node 0's staged records
    and peer pairs stay, so the next seal (the next run's load) still commits it."""
    from resilient.checkpoint import seal_nodes

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    job = str(next(Path(_root(base, 0)).glob("job-*")))

    def full(*_a, **_k):
        raise OSError(28, "No space left on device (the test)")

    monkeypatch.setattr(seal_nodes, "publish_commit", full)
    got = seal_nodes.seal_across_nodes(job, rank=0, leader=True, group=None, floor=0, clear=False)
    monkeypatch.undo()
    assert got is None, "said sealed, yet nothing was committed"
    # the space is back: the next seal (the next run's load) still commits step 3
    again = seal_nodes.seal_across_nodes(job, rank=0, leader=True, group=None, floor=0)
    assert again == 3
