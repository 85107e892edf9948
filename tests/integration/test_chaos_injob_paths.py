"""In-job recovery's other paths (``resilient launch`` with a spare) on the reference trainer: ZeRO-1
killed before any snapshot, a frozen rank on the node that is not the leader's, and the fallbacks to
a restart (no spare left, a fault during recovery); each verified bit-exact against the fault-free
run with every sample consumed once.  A file of its own so that pytest-xdist runs it beside
test_chaos_injob.py (the two share the session's reference runs)."""

from pathlib import Path

import pytest

from tests.integration.test_chaos import chaos_out
from tests.integration.test_chaos_injob import _pids, _run

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return chaos_out(tmp_path_factory, "chaos-injob-paths")


def _models(events: list[dict]) -> dict[tuple[int, int], list[bool]]:
    """(rank, generation) -> whether each of the trainer's "model" events kept the model."""
    out: dict[tuple[int, int], list[bool]] = {}
    for e in events:
        if e["event"] == "model":
            out.setdefault((int(e["rank"]), int(e["generation"])), []).append(bool(e["kept"]))
    return out


@pytest.mark.slow
def test_zero_state_is_kept_and_started_again_when_nothing_was_snapshotted(out):
    """Killed after two updates and before the first snapshot: the healthy rank keeps its model
    and ZeRO-1 optimizer (new groups), initialises both again as a new build would (nothing to
    restore), and the run is bit-identical to the fault-free one."""
    report, events = _run(out, "injob-zero-early-kill")
    m = report["measurements"]
    assert m["restarts"] == 0 and [r["path"] for r in m["recoveries"]] == ["in-job"]
    models = _models(events)
    assert models[(0, 0)] == [False] and models[(0, 1)] == [True], models
    assert models[(1, 1)] == [False], models  # the spare
    assert len(set(_pids(events, 0))) == 1 and len(set(_pids(events, 1))) == 2
    # two updates were made and lost (no snapshot yet): the kept rank started again from the
    # initial weights, not from step 2's
    assert not [e for e in events if e["event"] == "restore"], "nothing was there to restore"
    assert max(m["steps_lost"]) == 2
    _freed(events)


def _freed(events: list[dict], how: set[str] = frozenset({"collected"})) -> None:
    """The broken groups were freed by the recovery's collection (nothing kept them: the kept
    model's context and ZeRO-1's slices let go of them)."""
    freed = [e["freed"] for e in events if e["event"] == "injob_rejoin"]
    assert freed and set(freed) <= how, freed


@pytest.mark.slow
def test_a_frozen_rank_on_another_node_is_replaced_in_job(out):
    """Two nodes (two `resilient launch` agents on this machine, the rendezvous store shared with
    the workers) x 2 ranks: rank 2 freezes on the node that is not the leader's.  Rank 3, on the
    same node, kills it (not the leader), that node's agent gives rank 2 to its spare, and the
    group forms again across both nodes: no restart, nothing restored but from memory."""
    report, events = _run(out, "injob-two-nodes")
    m = report["measurements"]
    assert m["restarts"] == 0
    assert [r["path"] for r in m["recoveries"]] == ["in-job"]
    assert set(m["breakdown"]) >= {"teardown", "regroup", "load"}
    for rank in range(4):
        pids = set(_pids(events, rank))
        assert len(pids) == (2 if rank == 2 else 1), (rank, pids)
    # from memory ("peer": some files came from the other node's memory first)
    assert m["restore_sources"] in (["memory"], ["peer"]), m["restore_sources"]
    assert max(m["steps_lost"], default=0) <= 1
    killed = [e for e in events if e["event"] == "killed"]
    assert len(killed) == 1, killed
    # by rank 3, on rank 2's node: the agent with GROUP_RANK 1 runs ranks 2 and 3 (torchelastic
    # gives each agent a contiguous block of ranks); the leader, rank 0, runs on the other
    assert (killed[0]["rank"], killed[0]["by"], killed[0]["node"]) == (2, 3, "1")
    assert killed[0]["pid"] == _pids(events, 2)[0]
    # the healthy ranks on both nodes kept their model and ZeRO-1 optimizer; the spare built its
    models = _models(events)
    assert [models[(r, 1)] for r in range(4)] == [[True], [True], [False], [True]], models
    # freed by the recovery's collection: the failed snapshot's frames no longer hold the old
    # checkpointer (and through it the replicas' group), which is carried now, its replica
    # groups dropped at the abort and formed again
    _freed(events)
    rejoined = [e for e in events if e["event"] == "injob_rejoin"]
    assert len(rejoined) == 3 and all(e["kept_checkpointer"] for e in rejoined), rejoined


@pytest.mark.slow
def test_two_failures_with_one_spare_fall_back_to_a_restart(out):
    report, events = _run(out, "injob-no-spare-left")
    m = report["measurements"]
    assert m["restarts"] == 1
    assert [r["path"] for r in m["recoveries"]] == ["restart"]
    assert len(set(_pids(events, 0))) == 2  # every worker started again


@pytest.mark.slow
def test_a_fault_during_in_job_recovery_falls_back_to_a_restart(out):
    """Rank 2 dies as it joins the generation the spare was given rank 1 for: that generation
    never forms, and every worker restarts (from the node's memory), nothing lost."""
    report, events = _run(out, "injob-fault-during-recovery")
    m = report["measurements"]
    assert m["restarts"] == 1
    assert [r["path"] for r in m["recoveries"]] == ["restart"]
    assert m["restore_sources"] == ["memory"]
    # the second fault hit rank 2's first process, in its regroup: before any restart began
    second = next(
        e for e in events if e["event"] == "fault" and e["id"] == "kill-rank-2-in-regroup"
    )
    first_pid = next(int(e["pid"]) for e in events if e["event"] == "start" and int(e["rank"]) == 2)
    assert int(second["pid"]) == first_pid
    assert any(e["event"] == "injob_leave" and int(e["rank"]) == 2 for e in events)
    restarted = min(e["time"] for e in events if e["event"] == "start" and e.get("restart", 0))
    assert second["time"] < restarted
    assert len(set(_pids(events, 0))) == 2


@pytest.mark.slow
def test_a_lost_node_falls_back_to_a_restart_and_restores_from_the_replicas(out):
    """Node 1's agent, workers and spare are lost with its memory, and a new agent takes its
    place: no spare can answer, so the surviving agent restarts its workers as torchrun would,
    and the new node's ranks restore from the replicas node 0 holds."""
    report, events = _run(out, "injob-replace-node")
    m = report["measurements"]
    assert m["restarts"] == 1
    assert [r["path"] for r in m["recoveries"]] == ["restart"]
    # from memory, the lost node's files from the replicas the other node holds; or the same
    # step from durable storage, where the surviving node's persister flushed it when its
    # workers were stopped for the new round (seen once under load)
    assert m["restore_sources"] in (["peer"], ["durable"]), m["restore_sources"]
    for rank in range(4):
        assert len(set(_pids(events, rank))) == 2  # every worker started again
