"""Sealed snapshots across nodes (seal_nodes.py): every snapshot sealed on its rank and sent, with
its staged record, to the peer node; the load after a fault commits the newest step every rank
sealed from what the nodes hold, and restores it.  Nodes are memory roots, as two torchrun agents
on one host stand for two nodes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer, Shard, sharded
from resilient.checkpoint.seal_nodes import _candidates
from tests.dist import run_distributed
from tests.test_memory_nodes import _root


def _state(rank: int, world: int, value: float) -> dict:
    # every rank holds its own slice of "w" (16 values, 12 on three ranks), and a replicated "b"
    n = 12 if world == 3 else 16
    w = torch.full((n // world,), value + rank, dtype=torch.float32)
    return {
        "w": sharded(w, {"dp": Shard(0)}, global_shape=(n,)),
        "b": torch.full((3,), value, dtype=torch.float32),
        "meta": {"value": value},
    }


pytestmark = [pytest.mark.distributed]


def _open(url: str, base: str, node: int, persister: bool = False) -> Checkpointer:
    return Checkpointer(
        url,
        memory_every=1,
        memory_root=_root(base, node),
        persister=persister,
        memory_commit_every=0,
    )


def _sealed_run(rank: int, world: int, url: str, base: str, per_node: int, steps: list[int]):
    """Sealed snapshots of ``steps``, then the checkpointer closed (its sealed snapshots left for
    the next run, as a fault leaves them); what each node's staging directory holds then."""
    import torch.distributed as dist

    ck = _open(url, base, rank // per_node)
    for s in steps:
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck._memory._join_pending()  # (the last replica)
    dist.barrier()
    staging = sorted(p.name for p in (Path(ck.memory.dir) / "staging").iterdir())
    out = {"memory_steps": ck.memory_steps(), "pairs": [n for n in staging if "peer_" in n]}
    ck.close()
    return out


def _restore(rank: int, world: int, url: str, base: str, node_of: list[int]) -> dict:
    ck = _open(url, base, node_of[rank])
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = {
        "step": got,
        "source": ck.last_load.source,
        "sealed": ck.last_load.sealed,
        "w": state["w"].tolist(),
        "b": state["b"].tolist(),
    }
    ck.close()
    return out


def _expected(world: int, step: int) -> list[dict]:
    return [
        {
            "step": step,
            "source": "memory",
            "sealed": True,
            "w": [float(step + r)] * ((12 if world == 3 else 16) // world),
            "b": [float(step)] * 3,
        }
        for r in range(world)
    ]


def test_a_job_run_again_commits_and_restores_the_newest_sealed_step(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    for rank, r in enumerate(results):
        assert r["memory_steps"] == []  # nothing committed as it was taken
        # each node keeps its source's newest pair only
        source = 1 - rank
        assert r["pairs"] == [f"peer_{source:05d}.step_3.{e}" for e in ("json", "safetensors")]
    assert run_distributed(_restore, 2, url, base, [0, 1]) == _expected(2, 3)
    # every node committed it, and the pairs and records it was sealed from are gone
    for node in (0, 1):
        staging = Path(_root(base, node))
        assert not [p for p in staging.rglob("peer_*")]
        assert [p.name for p in staging.rglob("rank_*.step_*.json")] == []


def test_a_lost_node_is_restored_from_the_pairs_its_peer_holds(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    shutil.rmtree(_root(base, 1))  # node 1 is lost: its replacement's memory is empty
    assert run_distributed(_restore, 2, url, base, [0, 1]) == _expected(2, 3)


def test_after_an_elastic_shrink_the_survivors_restore_the_sealed_step_resharded(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    shutil.rmtree(_root(base, 1))
    (r0,) = run_distributed(_restore, 1, url, base, [0])  # (node 0 alone: its rank 0 seals)
    assert (r0["step"], r0["source"], r0["sealed"]) == (3, "memory", True)
    assert r0["w"] == [3.0] * 8 + [4.0] * 8


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a byte of the last tensor's data: the header still parses
    path.write_bytes(bytes(data))


def test_a_damaged_own_copy_is_replaced_by_the_peers_verified_one(tmp_path):
    """Rank 0's own file of step 3 on node 0 no longer matches its record's checksums: node 1's
    peer pair of it does, so step 3 is sealed all the same and rank 0 reads node 1's copy."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    staging = Path(_root(base, 0))
    record = next(staging.rglob("rank_00000.step_3.json"))
    import json

    name = json.loads(record.read_text())["path"]
    _damage(record.parent / name)
    assert run_distributed(_restore, 2, url, base, [0, 1]) == _expected(2, 3)


def _durable_then_sealed(rank: int, world: int, url: str, base: str) -> None:
    ck = _open(url, base, rank * 2 // world)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck._memory._join_pending()
    ck.close()


def test_with_both_copies_of_a_rank_damaged_every_rank_falls_back_together(tmp_path):
    """Node 1 is lost and node 0's pair of rank 1's step 3 is damaged: no node holds rank 1's
    file whole, step 3 is not sealed (its step 2 pairs went once step 3's were in everywhere),
    and every rank restores durable step 1 instead, without a hang."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_sealed, 2, url, base)
    shutil.rmtree(_root(base, 1))
    _damage(next(Path(_root(base, 0)).rglob("peer_00001.step_3.safetensors")))
    results = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["source"], r["sealed"]) for r in results] == [(1, "durable", False)] * 2
    assert [r["b"] for r in results] == [[1.0] * 3] * 2


def test_on_three_nodes_a_lost_nodes_records_reach_rank_0_from_the_next_node(tmp_path):
    """Three nodes of one rank: node 1 is lost, node 0 holds rank 0's file and rank 2's pair, node
    2 holds rank 2's file and rank 1's pair: rank 0 builds the manifest with rank 1's record from
    node 2, and every rank restores step 3."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 3, url, base, 1, [1, 2, 3])
    shutil.rmtree(_root(base, 1))
    results = run_distributed(_restore, 3, url, base, [0, 1, 2])
    assert [(r["step"], r["source"], r["sealed"]) for r in results] == [(3, "memory", True)] * 3
    assert [r["b"] for r in results] == [[3.0] * 3] * 3


def _seal_fails_on_rank_3_at_step_3(rank: int, world: int, url: str, base: str) -> list:
    import torch.distributed as dist

    ck = _open(url, base, rank * 2 // world)
    sealed = []
    for s in (1, 2, 3):
        if rank == 3 and s == 3:  # its copy fails (as a full tmpfs does)
            ck._memory._slots.stage = _raise
        sealed.append(ck.snapshot(s, _state(rank, world, float(s))).stats.sealed)
    ck._memory._join_pending()
    dist.barrier()
    ck.close()
    return sealed


def _raise(*_a, **_k):
    raise OSError(28, "No space left on device (the test)")


def test_a_seal_that_fails_on_one_rank_leaves_the_step_before_whole_on_every_node(tmp_path):
    """Two ranks a node.  Rank 3's snapshot of step 3 fails: it sends its peer (rank 1) nothing,
    while rank 2's pair of step 3 reaches rank 0; the reduction says not every rank holds its
    source's pair of step 3, so rank 0 keeps rank 2's pair of step 2 too.  Node 1 lost then,
    node 0 holds step 2 whole and restores it (rank 3's file of step 3 was never written)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    sealed = run_distributed(_seal_fails_on_rank_3_at_step_3, 4, url, base)
    assert sealed == [[True] * 3] * 3 + [[True, True, False]]
    shutil.rmtree(_root(base, 1))
    assert run_distributed(_restore, 4, url, base, [0, 0, 1, 1]) == _expected(4, 2)


def test_the_candidates_are_the_newest_steps_every_rank_is_offered_for():
    def offer(copies, rules):
        return {"copies": copies, "rules": rules}

    offers = [
        offer([[3, 0, "k", 2], [2, 0, "k", 2], [4, 0, "k", 2]], {"3/k": [5, 1], "2/k": [5, 1]}),
        offer([[3, 1, "k", 2], [2, 1, "k", 2], [2, 1, "x", 2]], {"4/k": [5, 1]}),
        None,  # a rank that offers nothing
        "garbage",
        offer([[9, 1, "k", 2], ["9", 0, "k", 2], [9, 5, "k", 2], [9, -1, "k", 2]], {"9/k": [0, 0]}),
        offer([[7, 0, "k", 1 << 40]], {"7/k": [0, 0]}),  # a world beyond any job's
        # (offers through the URL are anything: url_group.py) the wrong shapes
        {"copies": 5, "rules": [1, 2]},
        {"copies": {"a": 1}, "rules": "x"},
        offer([[8, 0, "k", 1], "row"], {"\u00b2/k": [0, 0], "8/k": [0, 0], "-8/k": [0, 0]}),
    ]
    assert _candidates(offers) == [(8, "k", 1, [0, 0]), (3, "k", 2, [5, 1]), (2, "k", 2, [5, 1])]


def _snapshot_then_save(rank: int, world: int, url: str, base: str) -> dict:
    ck = _open(url, base, rank * 2 // world, persister=True)
    for s in (1, 2):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck.save(2, _state(rank, world, 2.0)).wait()  # commits the sealed step 2 first
    steps = ck.memory_steps()
    ck.close()
    return {"memory_steps": steps, "durable": ck.steps()}


def test_a_durable_save_of_a_sealed_step_commits_it_across_nodes(tmp_path):
    """Through the nodes' persisters: the sealed snapshot of step 2 is committed in memory (its
    replica following the commit), then every node's persister writes its node's files."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_snapshot_then_save, 2, url, base)
    assert [r["memory_steps"] for r in results] == [[2]] * 2
    assert [r["durable"] for r in results] == [[2]] * 2
    got = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["b"]) for r in got] == [(2, [2.0] * 3)] * 2
    assert torch.tensor([r["w"][0] for r in got]).tolist() == [2.0, 3.0]


def _sealed_then_closed_with_persisters(rank: int, world: int, url: str, base: str) -> None:
    ck = _open(url, base, rank * 2 // world, persister=True)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck.close()  # node 0's persister flushes: its node holds every rank's copy of step 3


def test_on_two_nodes_the_persisters_flush_seals_the_newest_step_from_its_nodes_copies(tmp_path):
    """Nothing of step 3 was committed anywhere; node 0's persister, told goodbye, seals it from
    its own ranks' copies and node 1's pairs, and writes it to durable storage (its files and the
    pairs' bytes), so the job resumes from it even with every node's memory gone."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_then_closed_with_persisters, 2, url, base)
    assert Checkpointer(url).steps() == [1, 3]
    shutil.rmtree(base)
    results = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["source"]) for r in results] == [(3, "durable")] * 2
    assert [r["w"][0] for r in results] == [3.0, 4.0]


def test_losing_node_0_restores_the_sealed_step_from_node_1(tmp_path):
    """Rank 0's own node is lost: rank 0 holds no copy, node 1's leader sends every record."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    shutil.rmtree(_root(base, 0))
    assert run_distributed(_restore, 2, url, base, [0, 1]) == _expected(2, 3)


def test_a_replaced_peer_file_is_not_taken_for_its_pair(tmp_path):
    """Node 0's pair file of rank 1 is replaced by a copy of itself (the same bytes, another
    inode: not the file its record names); node 1 lost, step 3 is not sealed, and every rank
    restores durable step 1."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_sealed, 2, url, base)
    shutil.rmtree(_root(base, 1))
    pair = next(Path(_root(base, 0)).rglob("peer_00001.step_3.safetensors"))
    shutil.copyfile(pair, pair.with_suffix(".copy"))
    os.replace(pair.with_suffix(".copy"), pair)
    results = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["source"]) for r in results] == [(1, "durable")] * 2


def _committed_run(rank: int, world: int, url: str, base: str) -> int:
    ck = Checkpointer(
        url, memory_every=1, memory_root=_root(base, rank * 2 // world), persister=False
    )
    got = ck.load(_state(rank, world, 0.0))  # (seals the sealed step 3 and restores it)
    for s in (4, 5):
        ck.snapshot(s, _state(rank, world, float(s))).wait()
    ck.close()
    return got


def test_an_older_lines_sealed_snapshots_never_win_over_later_commits(tmp_path):
    """Run A seals steps 1-3; run B restores 3 and commits snapshots 4 and 5.  Run A's records
    and pairs of step 3, put back as they were (an abandoned line's, as a node that did not take
    part in B's load would still hold them), are vetoed by every node's commits since their line
    began: run C restores step 5, not the older line's step 3."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 2, url, base, 1, [1, 2, 3])
    aside = tmp_path / "aside"
    for node in (0, 1):
        staging = next(Path(_root(base, node)).glob("job-*")) / "staging"
        (aside / str(node)).mkdir(parents=True)
        for p in staging.iterdir():
            if "step_3" in p.name or p.name.endswith(".safetensors"):
                os.link(p, aside / str(node) / p.name)  # (the same inodes, as records name)
    assert run_distributed(_committed_run, 2, url, base) == [3] * 2
    for node in (0, 1):
        staging = next(Path(_root(base, node)).glob("job-*")) / "staging"
        for p in (aside / str(node)).iterdir():
            with contextlib.suppress(FileNotFoundError):
                (staging / p.name).unlink()
            os.link(p, staging / p.name)
    results = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["source"], r["sealed"]) for r in results] == [(5, "memory", False)] * 2
    assert [r["b"] for r in results] == [[5.0] * 3] * 2


def _durable_save_of_a_sealed_step(rank: int, world: int, url: str, base: str) -> None:
    import torch.distributed as dist

    ck = _open(url, base, rank * 2 // world, persister=True)
    for s in (1, 2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    # the fault: step 3's commit in memory (for the durable save) gets through on every node,
    # its committed replicas never arrive (the sealed pairs of step 3 did, as it was sealed)
    ck._memory._replicas.replicate = lambda *a, **k: None
    ck.save(3, _state(rank, world, 3.0)).wait()
    dist.barrier()
    ck.close()


def test_a_commit_whose_replicas_never_arrived_is_completed_from_its_pairs(tmp_path):
    """A durable save of sealed step 3 commits it in memory, then replicates it as a committed
    snapshot; node 1 lost before that replica arrives leaves node 0 with step 3 committed
    (its own ranks' files) and node 1's pairs of step 3: the load links the pairs in (checked
    against the manifest's checksums), and every rank restores step 3 from memory."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_save_of_a_sealed_step, 2, url, base)
    shutil.rmtree(_root(base, 1))
    results = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["source"]) for r in results] == [(3, "memory")] * 2, results
    assert [r["w"][0] for r in results] == [3.0, 4.0]


def _k2_commit_4_replica_lost(
    rank: int, world: int, url: str, base: str, persister: bool = False
) -> list:
    import torch.distributed as dist

    ck = Checkpointer(
        url,
        memory_every=1,
        memory_root=_root(base, rank * 2 // world),
        memory_commit_every=2,
        persister=persister,  # (with one, the close's flush writes step 4: test_joint_flush.py)
    )
    sealed = [bool(ck.snapshot(s, _state(rank, world, float(s))).stats.sealed) for s in (1, 2, 3)]
    ck._memory._join_pending()
    ck._memory._replicas.replicate = lambda *a, **k: None  # step 4's replicas never arrive
    h = ck.snapshot(4, _state(rank, world, 4.0))
    sealed.append(bool(h.stats.sealed))
    h.wait()
    ck._memory._join_pending()
    dist.barrier()
    ck.close()
    return sealed


def test_across_nodes_memory_commit_every_above_1_commits_every_snapshot(tmp_path):
    """K > 1 is a one-node setting: across nodes a sealed step older than a commit would be
    vetoed by it (it got through), yet that commit is whole only once its replicas are in.  So
    every snapshot is committed, and node 1 lost before step 4's replicas arrive restores step 3
    (its replicas on node 0 stay until step 4's are in everywhere)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    assert run_distributed(_k2_commit_4_replica_lost, 2, url, base) == [[False] * 4] * 2
    shutil.rmtree(_root(base, 1))
    got = run_distributed(_restore, 2, url, base, [0, 1])
    assert [(r["step"], r["source"]) for r in got] == [(3, "memory")] * 2, got


def test_writing_a_pairs_record_never_opens_what_is_already_there(tmp_path):
    """The record's temporary is a name of its own, made with O_EXCL: a FIFO (or a link to
    another file) at any other name in the directory is never opened or written."""
    from resilient.checkpoint.replicas import _write_peer_record

    os.mkfifo(tmp_path / "peer_00002.record.tmp")
    (tmp_path / "other").write_bytes(b"x")
    os.link(tmp_path / "other", tmp_path / "peer_00002.record.tmp-0")

    class Kept:
        ino = 7

    done: list[bool] = []
    t = threading.Thread(
        target=lambda: done.append(_write_peer_record(str(tmp_path), 2, 3, Kept(), b"{}")),
        daemon=True,
    )
    t.start()
    t.join(30)
    assert done == [True] and (tmp_path / "other").read_bytes() == b"x"
    rec = json.loads((tmp_path / "peer_00002.step_3.json").read_text())
    assert rec == {"format": "resilient-peer-v1", "source": 2, "step": 3, "ino": 7, "record": {}}


def _links_break_at_step_2(rank: int, world: int, url: str, base: str) -> list:
    import torch.distributed as dist

    ck = _open(url, base, rank * 2 // world)
    reps = ck._memory._replicas
    real = reps.replicate_sealed

    def breaking(storage, step, *a, **k):
        out = real(storage, step, *a, **k)
        if step == 2:
            reps.links.failed = True  # as the reduction that saw a failure sets it, everywhere
        return out

    reps.replicate_sealed = breaking
    sealed = [bool(ck.snapshot(s, _state(rank, world, float(s))).stats.sealed) for s in (1, 2, 3)]
    ck._memory._join_pending()
    dist.barrier()
    steps = ck.memory_steps()
    ck.close()
    return [sealed, steps]


def test_after_the_connections_break_the_next_snapshot_is_committed(tmp_path):
    """Snapshot 3 was decided (sealed) before the replication of 2 failed; once that is joined,
    every rank sees it, and snapshot 3 is committed at once (its replica through gloo)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    out = run_distributed(_links_break_at_step_2, 2, url, base)
    assert out == [[[True, True, False], [3]]] * 2, out


def test_hostile_peer_pairs_are_ignored_without_a_crash(tmp_path):
    """Peer records that do not parse, nest too deep, say another format or a bool inode, FIFOs
    and a symbolic link: the seal on one process offers nothing and returns None."""
    from resilient.checkpoint.seal_nodes import seal_across_nodes

    job = tmp_path / "job"
    staging = job / "staging"
    (job / "steps").mkdir(parents=True)
    staging.mkdir()
    (staging / "peer_00001.step_3.json").write_text("{" * 5000)
    (staging / "peer_00002.step_3.json").write_text('{"format": "resilient-peer-v1", "ino": true}')
    (staging / "peer_00003.step_3.json").write_text(
        '{"format": "resilient-peer-v1", "ino": 1, "record": {"format": "x", "rank": 3, "step": 3}}'
    )
    os.mkfifo(staging / "peer_00000.step_3.json")
    os.mkfifo(staging / "peer_00004.step_3.safetensors")
    (staging / "peer_00004.step_3.json").write_text(
        '{"format": "resilient-peer-v1", "ino": 1, "record": {"format": "resilient-staged-v1",'
        ' "rank": 4, "step": 3, "world": 5, "ino": 1, "sums": {}, "size": 100}}'
    )
    os.symlink("/etc/passwd", staging / "peer_00005.step_3.json")
    assert seal_across_nodes(str(job), rank=0, leader=True, group=None, floor=0) is None
