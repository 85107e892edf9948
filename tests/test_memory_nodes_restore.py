"""The restore across nodes chooses from every node's memory, not only rank 0's: what a node
offers, and what it must not (stale or older snapshots, values that do not fit, a damaged commit
order), never leaves a rank waiting or loses a newer step.  Four ranks, two memory roots per run
stand for two nodes (as in tests/test_memory_nodes.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer
from tests.dist import run_distributed
from tests.test_memory_nodes import (
    _durable_then_snapshots,
    _restore,
    _restore_with_rank_0_on_the_new_node,
    _root,
    _snapshot_on_two_nodes,
    _snapshots_then_a_durable_save,
    _state,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # real multi-process jobs, seconds each


def _manifests(base: str, node: int, step: int) -> list[Path]:
    return list(Path(_root(base, node)).glob(f"job-*/steps/step_{step:08d}/MANIFEST.json"))


def _edit_manifest(path: Path, **changes) -> None:
    d = json.loads(path.read_bytes())
    for key, value in changes.items():
        if key == "anchor":
            d["extras"]["_resilient_durable_anchor"] = value
        else:
            d[key] = value
    path.write_text(json.dumps(d))


def _load_on(rank: int, world: int, url: str, base: str, roots: list[int], then: list[int]):
    """Rank r's memory root is roots[r]; load, report, then snapshot the steps in ``then``."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, roots[rank]), persister=False)
    state = _state(rank, world, 0.0)
    try:
        got = ck.load(state)
        out = {"step": got, "source": ck.last_load.source, "w": state["w"].tolist()}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    out["anchor"] = ck._anchor
    out["floor"] = ck._memory._seq_floor
    snaps = []
    for step in then:
        try:
            ck.snapshot(step, _state(rank, world, float(step))).wait()
            snaps.append("ok")
        except Exception as e:
            snaps.append(f"{type(e).__name__}: {str(e)[:160]}")
    if then:
        dist.barrier()
    out["snaps"] = snaps
    out["memory_steps"] = ck.memory_steps()
    ck.close()
    return out


def _snap_only(rank: int, world: int, url: str, base: str, roots: list[int], steps: list[int]):
    """A checkpointer that never loads (a fresh start at the URL): it only snapshots."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, roots[rank]), persister=False)
    for step in steps:
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    dist.barrier()
    out = ck.memory_steps()
    ck.close()
    return out


# --- a leader raising between its listing and the all_gather: every other rank waits --------
def test_a_node_whose_anchor_overflows_int64_does_not_hang_the_restore(tmp_path):
    """A snapshot anchor of 19 digits parses (_parse_anchor allows < 20 digits) and passes
    _stale (a newer durable commit is on the line), but does not fit the int64 row of
    _memory_of_every_node: node 1's leader raises before the all_gather."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    (m,) = _manifests(base, 1, 3)
    _edit_manifest(m, anchor="9999999999999999999:0")
    results = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [])  # (a hang: its timeout)
    # node 1 offers nothing; rank 0's node holds step 3 (its manifest intact), and the exchange
    # brings node 1's ranks rank 0's version of it
    assert [(r.get("step"), r.get("source")) for r in results] == [(3, "memory")] * 4, results


# --- anchors after restoring a step rank 0's node did not hold, and the restart after ------
def test_snapshots_after_a_restore_from_another_node_are_restored_by_the_next_restart(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)  # durable 1; memory 2, 3
    shutil.rmtree(_root(base, 0))
    # rank 0's node is new (root 2): it restores step 3 from node 1, then snapshots 4 and 5
    first = run_distributed(_load_on, 4, url, base, [2, 2, 1, 1], [4, 5])
    for r in first:
        assert (r["step"], r["source"]) == (3, "memory"), first
        assert r["anchor"] == (1, 1), first  # step 3 descends from durable step 1 (commit 1)
        assert r["snaps"] == ["ok", "ok"] and r["memory_steps"] == [5, 4], first
    for node in (1, 2):
        (m,) = _manifests(base, node, 5)
        assert json.loads(m.read_bytes())["extras"]["_resilient_durable_anchor"] == "1:1"
    # the next restart (the same nodes) takes step 5; then node 1 is lost as well
    again = run_distributed(_load_on, 4, url, base, [2, 2, 1, 1], [])
    assert [(r["step"], r["source"]) for r in again] == [(5, "memory")] * 4, again
    shutil.rmtree(_root(base, 1))
    last = run_distributed(_load_on, 4, url, base, [2, 2, 3, 3], [])
    assert [(r["step"], r["source"]) for r in last] == [(5, "memory")] * 4, last
    assert [r["w"] for r in last] == [[5.0 + rank] * 4 for rank in range(4)]


# --- the commit order's floor where the checkpointer never loads --------------------------------------
def test_a_checkpointer_that_never_loads_commits_above_the_other_nodes_older_snapshots(tmp_path):
    """Rank 0 on a new node snapshots without a load first: its commit order restarts at 1, and
    the survivor node's older snapshots (commits 2 and 3) outrank the new ones there."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshot_on_two_nodes, 4, url, base)  # memory 1, 2, 3 on both nodes
    shutil.rmtree(_root(base, 0))
    held = run_distributed(_snap_only, 4, url, base, [2, 2, 1, 1], [10, 11])
    restart = run_distributed(_load_on, 4, url, base, [2, 2, 1, 1], [])
    assert held[2] == [11, 10] and restart[0]["step"] == 11, (held, restart)


# --- a listing that fails on one rank ------------------------------------------------------
def _load_with_a_listing_failing(rank: int, world: int, url: str, base: str, who: int, what: str):
    """Rank ``who`` cannot list its node's memory (``what`` "memory") or durable storage
    ("durable": a transient outage, its retries spent)."""
    from resilient.errors import StorageError

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    if rank == who:

        def broken():
            raise (OSError if what == "memory" else StorageError)(f"{what} cannot be listed (test)")

        if what == "memory":
            ck._memory.catalog = broken
        else:
            ck.catalog = broken
    state = _state(rank, world, 0.0)
    try:
        out = (ck.load(state), ck.last_load.source)
    except Exception as e:
        out = f"{type(e).__name__}: {e}"
    ck.close()
    return out


def test_rank_0s_memory_failing_to_list_still_restores_the_durable_step(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshots_then_a_durable_save, 4, url, base)
    results = run_distributed(_load_with_a_listing_failing, 4, url, base, 0, "memory")
    assert results == [(4, "durable")] * 4, results


def test_a_leader_that_cannot_list_durable_storage_does_not_offer_older_snapshots(tmp_path):
    """Snapshots 1-3 were taken before any durable commit (anchor ""), then step 4 was saved
    durably.  Rank 0 offers no memory step (all older than 4); node 1's leader, unable to list
    durable storage, cannot tell that its 3 and 2 are older (and "" is not stale without a
    catalog): it offers none, and rank 0 would drop them anyway."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshots_then_a_durable_save, 4, url, base)
    results = run_distributed(_load_with_a_listing_failing, 4, url, base, 2, "durable")
    assert results == [(4, "durable")] * 4, results


# --- a node whose manifest says an absurd commit order --------------------------------------
def test_one_nodes_manifest_with_a_huge_commit_seq_does_not_stop_every_later_snapshot(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshot_on_two_nodes, 4, url, base)
    (m,) = _manifests(base, 1, 3)
    _edit_manifest(m, commit_seq=(1 << 63) - 1)
    results = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [4, 5])
    assert [r["snaps"] for r in results] == [["ok", "ok"]] * 4, results


# --- three nodes: a copy of the manifest that fails the full check -------------------------
def _three(rank: int, world: int, value: float) -> dict:  # 4 values per rank
    from resilient import Shard, sharded

    w = torch.full((4,), value + rank, dtype=torch.float32)
    return {"w": sharded(w, {"dp": Shard(0)}, global_shape=(4 * world,))}


def _three_nodes(rank: int, world: int, url: str, base: str, roots: list[int], load: bool):
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, roots[rank]), persister=False)
    if not load:
        for step in (1, 2, 3):
            ck.snapshot(step, _three(rank, world, float(step))).wait()
        ck.close()
        return None
    state = _three(rank, world, 0.0)
    try:
        out = (ck.load(state), ck.last_load.source, state["w"].tolist())
    except Exception as e:
        out = f"{type(e).__name__}: {e}"
    ck.close()
    return out


def test_a_manifest_copy_that_fails_the_full_check_does_not_hide_a_good_one(tmp_path):
    """Three nodes of one rank each; node 0 (rank 0's) is lost and rank 0 restarts on an empty
    one.  Node 1 holds rank 0's file of step 3 (the replica) but a manifest whose tensor table
    is damaged (its top level intact: it still lists as a commit); node 2's manifest is good.
    The restore takes node 2's, and rank 0's file from node 1."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_three_nodes, 3, url, base, [0, 1, 2], False)
    shutil.rmtree(_root(base, 0))
    (m,) = _manifests(base, 1, 3)
    d = json.loads(m.read_bytes())
    d["tensors"]["w"]["shape"] = [7]  # (the chunks no longer tile it)
    m.write_text(json.dumps(d))
    results = run_distributed(_three_nodes, 3, url, base, [3, 1, 2], True)
    assert [r[:2] for r in results] == [(3, "memory")] * 3, results
    assert [r[2] for r in results] == [[3.0 + rank] * 4 for rank in range(3)]


# --- a rollback some node missed, and a node unlisted when the checkpointer is made ----------
def _rollback_then_resave(rank, world, url, base, roots, to, then, value):
    """load(step=to) (a rollback), then snapshot the steps in ``then`` with values ``value``."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, roots[rank]), persister=False)
    state = _state(rank, world, 0.0)
    got = ck.load(state, step=to)
    for step in then:
        ck.snapshot(step, _state(rank, world, value * step)).wait()
    dist.barrier()
    out = {"step": got, "floor": ck._memory._seq_floor, "memory_steps": ck.memory_steps()}
    ck.close()
    return out


def _seqs(base, node, step):
    return [json.loads(m.read_bytes())["commit_seq"] for m in _manifests(base, node, step)]


def test_a_node_back_from_offline_does_not_win_with_its_older_version_of_a_step(tmp_path):
    """Job 1 on nodes 0 (rank 0) and 1: durable step 1, snapshots 2, 3 (memory commits 1, 2).
    Job 2 runs without node 0 (rank 0 on a new node 2, with node 1): it rolls back to durable
    step 1 and takes steps 2 and 3 again (memory commits 3 and 4, other values).  Job 3: node 0
    is back, with rank 0.  The newest commit of step 3 is job 2's (on node 1, commit 4); node 0
    still holds job 1's (commit 2), under the same file names: the newest version is restored,
    and node 0's own files of step 3 count as absent."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    r2 = run_distributed(_rollback_then_resave, 4, url, base, [2, 2, 1, 1], 1, [2, 3], 10.0)
    assert [r["step"] for r in r2] == [1] * 4, r2
    before = (_seqs(base, 0, 3), _seqs(base, 1, 3))
    assert len(before[0]) == len(before[1]) == 1 and before[1][0] > before[0][0], before
    r3 = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [])
    after = (_seqs(base, 0, 3), _seqs(base, 1, 3))
    got = [(r.get("step"), r.get("w")) for r in r3]
    # expected: job 2's step 3 (values 30 + rank), the newest commit there is
    assert got == [(3, [30.0 + rank] * 4) for rank in range(4)], (got, before, after)
    # and node 1 keeps the newest version (node 0 is given it, and fetches the files it needs)
    assert after == (before[1], before[1]), after


def test_a_node_unlisted_while_the_checkpointer_is_made_still_sets_the_floor(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshots_then_a_durable_save, 4, url, base)  # memory 1-3; durable 4
    shutil.rmtree(_root(base, 0))
    results = run_distributed(_restore_with_rank_0_on_the_new_node, 4, url, base, 5, True)
    assert [(r["step"], r["source"]) for r in results] == [(4, "durable")] * 4, results
    # node 1 keeps the new snapshots 6 and 5, as in test_memory_nodes.py's
    # test_rank_0_on_a_replaced_node_commits_above_the_other_nodes_older_snapshots
    assert [r["memory_steps"] for r in results] == [[6, 5]] * 4, results


def test_after_a_huge_commit_seq_on_one_node_that_node_keeps_the_new_snapshots(tmp_path):
    """As test_one_nodes_manifest_with_a_huge_commit_seq_does_not_stop_every_later_snapshot,
    and what node 1 keeps and what the next restart restores."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshot_on_two_nodes, 4, url, base)
    (m,) = _manifests(base, 1, 3)
    _edit_manifest(m, commit_seq=(1 << 63) - 1)
    first = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [4, 5])
    again = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [])
    report = ([r["memory_steps"] for r in first], [(r.get("step"), r.get("error")) for r in again])
    assert report == ([[5, 4]] * 4, [(5, None)] * 4), report


# --- runs that did not see each other's snapshots: the later run's line wins ------------------
def _resume_then_snapshot(rank, world, url, base, roots, then, value, commit_every=1):
    """Load the newest step, then snapshot the steps in ``then`` (values ``value * step``); the
    job then ends without a durable save (its snapshots stay in its nodes' memory)."""
    import torch.distributed as dist

    root = _root(base, roots[rank])
    ck = Checkpointer(
        url, memory_every=1, memory_root=root, persister=False, memory_commit_every=commit_every
    )
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    for step in then:
        ck.snapshot(step, _state(rank, world, value * step)).wait()
    dist.barrier()
    out = {"step": got, "source": ck.last_load.source, "w": state["w"].tolist()}
    out["memory_steps"] = ck.memory_steps()
    ck.close()
    return out


def test_a_node_that_sat_out_the_newest_run_does_not_win_with_an_older_runs_line(tmp_path):
    """Job 1 on nodes 0 and 1: durable step 1, snapshots 2, 3.  Job 2 runs on node 0 alone (2
    ranks): it restores step 3 and takes steps 4-8.  Job 3 runs on node 1 alone, after job 2:
    it restores step 3 (node 1 never saw job 2's steps) and takes steps 4 and 5, other values.
    Job 4 on both nodes restores job 3's step 5, the newest run's, not job 2's step 8: counted
    on each node alone, job 2's commits (five on node 0) rank above job 3's (two on node 1)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    two = run_distributed(_resume_then_snapshot, 2, url, base, [0, 0], [4, 5, 6, 7, 8], 1.0)
    three = run_distributed(_resume_then_snapshot, 2, url, base, [1, 1], [4, 5], 10.0)
    assert [(r["step"], r["memory_steps"][0]) for r in two + three] == [(3, 8)] * 2 + [(3, 5)] * 2
    four = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [6])
    got = [(r.get("step"), r.get("source"), r.get("w")) for r in four]
    assert got == [(5, "memory", [50.0 + rank // 2] * 4) for rank in range(4)], got
    counted = json.loads((Path(url) / "MEMORY_RUNS.json").read_text())
    assert counted["format"] == "resilient-memory-runs/1" and counted["runs"] == 4, counted
    # job 4's commits are numbered as its run's, on both nodes (rank 0's number is agreed)
    assert [seq >> 32 for node in (0, 1) for seq in _seqs(base, node, 6)] == [4, 4]


def test_a_sealed_step_of_the_newest_run_is_numbered_as_the_run_that_staged_it(tmp_path):
    """As above, with job 3's snapshots sealed (no commit per step) and job 4 on node 1 alone
    again: its load seals job 3's step 5 and numbers that commit as job 3's (its staged record
    says so), so that job 5, on both nodes, restores it rather than job 2's step 8."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    run_distributed(_resume_then_snapshot, 2, url, base, [0, 0], [4, 5, 6, 7, 8], 1.0)
    three = run_distributed(_resume_then_snapshot, 2, url, base, [1, 1], [4, 5], 10.0, 0)
    assert [r["memory_steps"][0] for r in three] == [3, 3], three  # sealed, not committed
    four = run_distributed(_resume_then_snapshot, 2, url, base, [1, 1], [], 0.0)
    assert [(r["step"], r["memory_steps"][0]) for r in four] == [(5, 5)] * 2, four
    assert [seq >> 32 for seq in _seqs(base, 1, 5)] == [3]
    five = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [])
    got = [(r.get("step"), r.get("source"), r.get("w")) for r in five]
    assert got == [(5, "memory", [50.0 + rank // 2] * 4) for rank in range(4)], got


def _resume_then_save(rank, world, url, base, roots, then, value, persister):
    """As _resume_then_snapshot, the last step of ``then`` a durable save (through the
    persister process, or the trainer's own thread)."""
    import torch.distributed as dist

    root = _root(base, roots[rank])
    ck = Checkpointer(url, memory_every=1, memory_root=root, persister=persister)
    got = ck.load(_state(rank, world, 0.0))
    for step in then[:-1]:
        ck.snapshot(step, _state(rank, world, value * step)).wait()
    ck.save(then[-1], _state(rank, world, value * then[-1])).wait()
    ck.wait()
    dist.barrier()
    ck.close()
    return got


@pytest.mark.parametrize("persister", [False, True], ids=["own-thread", "persister"])
def test_a_durable_commit_of_a_later_run_outranks_an_older_runs_snapshots(tmp_path, persister):
    """As above, job 3 (node 1 alone) ends with a durable save of its step 5, and node 1 is
    lost after it (its memory with it).  Job 4, on node 0 and a new node, restores that durable
    step 5, not job 2's step 8 in node 0's memory: job 2's line descends from durable step 1
    too, but job 3 committed to the durable line since, without seeing job 2's snapshots."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    run_distributed(_resume_then_snapshot, 2, url, base, [0, 0], [4, 5, 6, 7, 8], 1.0)
    three = run_distributed(_resume_then_save, 2, url, base, [1, 1], [4, 5], 10.0, persister)
    assert three == [3, 3], three
    manifest = json.loads((Path(url) / "step_00000005" / "MANIFEST.json").read_text())
    assert manifest["extras"]["_resilient_memory_run"] == 3, manifest["extras"]
    shutil.rmtree(_root(base, 1))
    four = run_distributed(_load_on, 4, url, base, [0, 0, 2, 2], [])
    got = [(r.get("step"), r.get("source"), r.get("w")) for r in four]
    assert got == [(5, "durable", [50.0 + rank // 2] * 4) for rank in range(4)], got


def _sealed_asked_on_two_nodes(rank, world, url, base):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = Checkpointer(
            url,
            memory_every=1,
            memory_root=_root(base, rank),
            persister=False,
            memory_commit_every=0,
        )
    sealed = ck.snapshot(1, _state(rank, world, 1.0)).stats.sealed
    ck._memory._join_pending()  # (its replica)
    staging = sorted(p.name for p in (Path(ck.memory.dir) / "staging").iterdir())
    out = {
        "memory_steps": ck.memory_steps(),
        "sealed": sealed,
        "warned": [str(w.message) for w in caught],
        "pairs": [n for n in staging if n.startswith("peer_")],
    }
    ck.close()
    return out


def test_sealed_snapshots_across_nodes_send_their_pair_to_the_peer(tmp_path):
    """memory_commit_every=0 on two nodes: every snapshot is sealed (nothing committed) and its
    file and staged record are kept on the peer node as a pair (seal_nodes.py)."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_sealed_asked_on_two_nodes, 2, url, base)
    for rank, r in enumerate(results):
        assert r["memory_steps"] == [] and r["sealed"] and not r["warned"], r
        source = 1 - rank
        assert r["pairs"] == [
            f"peer_{source:05d}.step_1.json",
            f"peer_{source:05d}.step_1.safetensors",
        ]


def test_without_the_replicas_connections_sealed_snapshots_are_committed_with_a_warning(
    tmp_path, monkeypatch
):
    """A sealed snapshot's replica travels over the replicas' own connections only: where they
    cannot be made (here: not asked for), every snapshot is committed (its replica follows the
    commit, through gloo), and the job is told so rather than silently."""
    monkeypatch.setenv("RESILIENT_REPLICA_LINKS", "0")
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_sealed_asked_on_two_nodes, 2, url, base)
    for r in results:
        assert r["memory_steps"] == [1] and not r["sealed"] and not r["pairs"], r
        assert any("every memory snapshot is committed" in w for w in r["warned"]), r


# --- a node lost while a snapshot's replicas are on their way ---------------------------------
def _lose_node_1_while_step_2_replicates(rank: int, world: int, url: str, base: str) -> dict:
    """Snapshots 1, 2, 3 on two nodes; step 2's replication waits (on every rank) until step 3
    was staged, and node 0's memory is copied then: what survives if node 1 is lost at that
    moment (its replicas of step 2 not in, the next snapshot already being copied)."""
    import shutil
    import threading
    import time

    import torch.distributed as dist

    from resilient.checkpoint.replicas import Replicas

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    sync = Path(base) / "sync"
    sync.mkdir(exist_ok=True)
    in_replicate, staged3 = threading.Event(), threading.Event()
    real_replicate, real_stage = Replicas.replicate, ck._memory._slots.stage

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 120
        while not path.exists():
            assert time.monotonic() < deadline, path
            time.sleep(0.01)

    def replicate(self, storage, step_rel, *a, **kw):
        if step_rel == "step_00000002":
            in_replicate.set()
            assert staged3.wait(120)
            (sync / f"in_{rank}").touch()
            if rank == 0:  # node 0's two ranks are here: node 1 is lost now
                wait_for(sync / "in_1")
                shutil.copytree(_root(base, 0), str(Path(base) / "survivor"), symlinks=True)
                (sync / "copied").touch()
            wait_for(sync / "copied")
        return real_replicate(self, storage, step_rel, *a, **kw)

    def stage(plan, leaves, step, *a, **kw):
        out = real_stage(plan, leaves, step, *a, **kw)
        if step == 3:
            staged3.set()
        return out

    Replicas.replicate = replicate
    ck._memory._slots.stage = stage
    ck.snapshot(1, _state(rank, world, 1.0)).wait()
    second = ck.snapshot(2, _state(rank, world, 2.0))
    assert in_replicate.wait(120)
    ck.snapshot(3, _state(rank, world, 3.0)).wait()
    second.wait()
    dist.barrier()
    ck.close()
    return {}


def test_a_node_lost_while_the_previous_snapshots_replicas_travel_leaves_a_step_whole(tmp_path):
    """The next snapshot's copy used to take the file of the snapshot two steps back as soon as
    the previous one committed, before its replicas were in: node 1 lost then left node 0 with
    neither step whole (step 1's own files taken, step 2's replicas missing), and the job fell
    back to durable storage.  A committed file is let go only once its replica is in, so step
    1 is whole on node 0: two steps lost, not everything since the last durable save."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_lose_node_1_while_step_2_replicates, 4, url, base)
    shutil.rmtree(_root(base, 0))
    shutil.rmtree(_root(base, 1))
    Path(base, "survivor").rename(_root(base, 0))
    results = run_distributed(_restore, 4, url, base, None)
    for rank, (step, source, w, b, _meta) in enumerate(results):
        assert (step, source) == (1, "memory"), (rank, step, source)
        assert w == [1.0 + rank] * 4 and b == [1.0] * 3, (rank, w, b)


def _snapshots_1_2(rank: int, world: int, url: str, base: str) -> str:
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    for step in (1, 2):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
        dist.barrier()
    steps = str(ck.memory.steps)
    ck.close()
    return steps


def test_a_node_given_the_restored_version_drops_the_other_versions_files(tmp_path):
    """(a review) A node holding another version of a step fetched only the files its ranks
    needed and then published the restored manifest over the other version's files of the same
    names: the node looked current, and a later restore of the step with other needs (an
    elastic change) read those files (held, by their size), failed the checksums, and every
    rank fell back to step 1, though node 0 held good copies."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    dirs = run_distributed(_snapshots_1_2, 4, url, base)
    node1 = _manifests(base, 1, 2)[0]
    _edit_manifest(node1, commit_seq=json.loads(node1.read_bytes())["commit_seq"] - 1)
    other = Path(dirs[2]) / "step_00000002" / "rank_00001.safetensors"  # that version's file
    data = bytearray(other.read_bytes())
    data[-1] ^= 0xFF
    other.unlink()
    other.write_bytes(bytes(data))
    first = run_distributed(_load_on, 4, url, base, [0, 0, 1, 1], [])
    assert [r.get("step") for r in first] == [2] * 4, first
    assert not other.exists()  # not fetched (no rank of node 1 needed it): removed
    # world 2, rank 0 on node 1: rank 0 reads ranks 0 and 1's files there
    second = run_distributed(_load_on, 2, url, base, [1, 0], [])
    assert [(r.get("step"), r.get("source")) for r in second] == [(2, "memory")] * 2, second


# --- where the line begins, on every node --------------------------------------------------------
def _ops(rank: int, world: int, url: str, base: str, roots: list[int], ops: list) -> list:
    """Rank r's memory root is roots[r]; ("save", s), ("snap", s) and ("load", s or None) in
    turn; returns each load's (step, source)."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, roots[rank]), persister=False)
    out = []
    for op, s in ops:
        if op == "save":
            ck.save(s, _state(rank, world, float(s))).wait()
        elif op == "snap":
            ck.snapshot(s, _state(rank, world, float(s))).wait()
            dist.barrier()
        else:
            state = _state(rank, world, 0.0)
            got = ck.load(state, step=s)
            out.append((got, ck.last_load.source, state["meta"]["value"]))
    ck.close()
    return out


def test_a_load_after_a_rollbacks_snapshots_begins_another_line_on_every_node(tmp_path):
    """Job 1, rank 0 on node 1: durable 10 and 20, a rollback to 10, snapshots 11 and 12 (node 1
    marks where its line began).  Job 2, rank 0 on node 0: a fault resumes 12, then a load of 20
    by name begins another line.  Job 3 (a fault before any snapshot) resumes 20: node 1's mark,
    left from job 1, must not make it offer 12 as the job's newest state."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    ops = [("save", 10), ("save", 20), ("load", 10), ("snap", 11), ("snap", 12)]
    one = run_distributed(_ops, 4, url, base, [1, 1, 0, 0], ops)
    assert [r[0][0] for r in one] == [10] * 4, one
    two = run_distributed(_ops, 4, url, base, [0, 0, 1, 1], [("load", None), ("load", 20)])
    assert [r[0][:2] for r in two] == [(12, "memory")] * 4, two
    assert [r[1][0] for r in two] == [20] * 4, two
    three = run_distributed(_ops, 4, url, base, [0, 0, 1, 1], [("load", None)])
    assert [r[0][0] for r in three] == [20] * 4, three
