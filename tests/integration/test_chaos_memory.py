"""The memory tier's chaos scenarios on real torchrun jobs, each verified bit-exact against the
fault-free run with every sample consumed once, plus what the tier itself must show: the restore
came from memory (or fell back as it should), at most one step was lost, and the job's memory was
given back at the end."""

import json
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.chaos.runner import builtin_scenarios, run_scenario
from tests.integration.test_chaos import MEMORY_TIER, _assert_passed, chaos_out

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """One output directory: the scenarios share one fault-free reference run."""
    return chaos_out(tmp_path_factory, "chaos-memory")


def _run(out: Path, name: str) -> dict:
    scenario = next(s for s in builtin_scenarios() if s.name == name)
    report = run_scenario(scenario, out, say=lambda *_: None)
    _assert_passed(report)
    return report


def _events(report: dict) -> list[dict]:
    path = Path(report["run_dir"]) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# what the nodes' logs say of a restore that did not take the step or tier a test expects
_RESTORE_WORDS = ("falling back", "is not restored", "cannot be read", "fetched from other nodes")


def _restore(report: dict) -> tuple[dict, str]:
    """The run's first restore event, and (for an assertion's message) that event with the
    nodes' log lines that say why a step or tier was skipped."""
    restore = next(e for e in _events(report) if e["event"] == "restore")
    lines = [
        f"{log.name}: {line.strip()[:400]}"
        for log in sorted(Path(report["run_dir"]).glob("node*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if any(w in line for w in _RESTORE_WORDS)
    ]
    return restore, "\n".join([json.dumps(restore), *lines[:40]])


def _reached(report: dict, restore: dict) -> int:
    """The newest step the run had trained before the restore: the fault fires once the harness
    sees its planned step, and on a loaded machine the run may be a step or two past it."""
    path = Path(report["run_dir"]) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max(r["step"] for r in rows if r["wall_time"] < restore["start"])


def test_the_memory_scenarios_are_the_ones_this_file_runs():
    assert set(MEMORY_TIER) == {
        "memory-kill-rank",
        "memory-sealed-kill-rank",
        "memory-corrupt",
        "memory-kill-job",
        "memory-sealed-kill-job",
        "memory-crash-job",
        "memory-kill-node-shrink",
        "memory-replace-node",
        "memory-too-small",
    }


@pytest.mark.slow
def test_killed_rank_restores_from_memory(out):
    report = _run(out, "memory-kill-rank")
    m = report["measurements"]
    assert m["restore_sources"] == ["memory"]
    assert max(m["steps_lost"], default=0) <= 1  # 0 when the snapshot before the kill committed
    restore, why = _restore(report)
    # durable storage held step 10; the snapshot of step 12 was committed before the one of step
    # 13 was taken (a snapshot waits for the one before it), and the kill came before step 14
    assert restore["step"] in (12, 13), why
    assert any(c["name"] == "memory tier released" and c["ok"] for c in report["checks"])


@pytest.mark.slow
def test_killed_rank_restores_a_sealed_snapshot_from_memory(out):
    """No snapshot was committed as it was taken (--memory-commit-every 0) but the durable saves'
    steps: the restart's load commits the newest step every rank sealed, and restores it."""
    report = _run(out, "memory-sealed-kill-rank")
    m = report["measurements"]
    assert m["restore_sources"] == ["memory"]
    assert max(m["steps_lost"], default=0) <= 1
    restore, why = _restore(report)
    assert restore["step"] in (12, 13) and restore["sealed"], why
    assert any(c["name"] == "memory tier released" and c["ok"] for c in report["checks"])


@pytest.mark.slow
def test_corrupt_snapshot_falls_back_without_a_restart_loop(out):
    report = _run(out, "memory-corrupt")
    events = _events(report)
    damaged = next(e for e in events if e["event"] == "fault_detail")
    assert damaged["tier"] == "memory" and damaged["step"] == 12
    restore, why = _restore(report)
    assert restore["source"] == "memory" and restore["step"] == 11, why
    assert restore["skipped_steps"] == [12], why
    assert report["measurements"]["restarts"] == 1  # one fault, one restart: no loop


@pytest.mark.slow
def test_killed_job_resumes_from_memory_when_run_again(out):
    report = _run(out, "memory-kill-job")
    events = _events(report)
    assert any(e["event"] == "job_rerun" for e in events)
    restore, why = _restore(report)
    # durable storage held step 10; the rerun found a newer snapshot in the node's memory
    assert restore["source"] == "memory" and restore["step"] > 10, why
    assert max(report["measurements"]["steps_lost"], default=0) <= 1


@pytest.mark.slow
def test_killed_job_with_sealed_snapshots_resumes_from_memory(out):
    """Every process of the job SIGKILLed with sealed snapshots (never committed as taken): the
    rerun's load commits the newest step every rank sealed, or takes the one the persister's
    flush committed, and restores it from the node's memory."""
    report = _run(out, "memory-sealed-kill-job")
    assert any(e["event"] == "job_rerun" for e in _events(report))
    restore, why = _restore(report)
    # durable storage held step 10; the kill came at step 14 (12 when it lands in a copy)
    assert restore["source"] == "memory" and restore["step"] >= 12, why
    assert max(report["measurements"]["steps_lost"], default=0) <= 1


@pytest.mark.slow
def test_crashed_job_resumes_from_what_its_persister_flushed(out):
    report = _run(out, "memory-crash-job")
    events = _events(report)
    crash = next(e for e in events if e["event"] == "fault" and e["kind"] == "crash_job")
    assert next(e for e in events if e["event"] == "memory_dropped")
    restore, why = _restore(report)
    # the nodes' memory was empty at the rerun: what it resumed from, newer than durable step
    # 10, is what the persister wrote out after the job's processes were killed
    assert restore["source"] == "durable" and restore["step"] > 10, why
    assert restore["step"] >= crash["step"] - 1
    assert max(report["measurements"]["steps_lost"], default=0) <= 1


@pytest.mark.slow
def test_lost_node_restores_from_its_peers_replica(out):
    report = _run(out, "memory-kill-node-shrink")
    events = _events(report)
    lost = next(e for e in events if e["event"] == "fault" and e["kind"] == "kill_node")
    restore, why = _restore(report)
    # durable storage held step 10; node 0 restored a newer step from memory, which needed the
    # replicas of node 1's files (node 1's ranks wrote their own shards), resharded to dp 1
    assert restore["source"] == "memory" and restore["resharded"], why
    reached = _reached(report, restore)
    assert lost["step"] <= reached and reached - 1 <= restore["step"] <= reached, why
    assert max(report["measurements"]["steps_lost"], default=0) <= 1


@pytest.mark.slow
def test_a_replaced_node_restores_its_ranks_from_the_peers_replicas(out):
    report = _run(out, "memory-replace-node")
    events = _events(report)
    lost = next(e for e in events if e["event"] == "fault" and e["kind"] == "replace_node")
    assert next(e for e in events if e["event"] == "node_replaced")["node"] == 1
    restore, why = _restore(report)
    # node 1 came back with empty memory: the newest step every rank sealed was committed from
    # node 0's copies (its own ranks' and node 1's pairs), by the restart's load or, first, by
    # node 0's persister's seal as node 0's trainer went down (nothing is committed as it is
    # taken), which then writes it to durable storage; its ranks' files came from node 0, and
    # the layout is the same (no reshard), so the run is bit-identical to the fault-free one
    assert restore["source"] == "memory" and not restore["resharded"], why
    assert restore["sealed"] or restore["newest_memory"] == restore["step"], why
    if not restore["sealed"]:
        durable = Checkpointer(str(Path(report["run_dir"]) / "ckpt")).steps()
        assert restore["step"] in durable, (durable, why)
    assert restore["peer_files"] >= 2, why  # at least ranks 2 and 3's files, from node 0's replicas
    assert report["measurements"]["restore_sources"] == ["peer"]
    reached = _reached(report, restore)
    assert lost["step"] <= reached and reached - 1 <= restore["step"] <= reached, why
    assert max(report["measurements"]["steps_lost"], default=0) <= 1


@pytest.mark.slow
def test_too_little_memory_is_a_clear_error_before_training(out):
    report = _run(out, "memory-too-small")
    log = (Path(report["run_dir"]) / "node0.log").read_text()
    assert "MemoryTierError" in log and "RESILIENT_MEMORY_LIMIT=64K" in log
    metrics = Path(report["run_dir"]) / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # not one step was trained
