"""In-job recovery's chaos scenarios (``resilient launch`` with a spare) on the reference trainer,
each verified bit-exact against the fault-free run with every sample consumed once, plus what the
path itself must show: the healthy ranks kept their processes, the failed rank's was replaced by a
spare in a new generation of the group, and the restore came from the node's memory."""

import json
from pathlib import Path

import pytest

from resilient.chaos.runner import builtin_scenarios, run_scenario
from tests.integration.test_chaos import IN_JOB, _assert_passed, chaos_out

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """One output directory: the scenarios share one fault-free reference run."""
    return chaos_out(tmp_path_factory, "chaos-injob")


def _run(out: Path, name: str) -> tuple[dict, list[dict]]:
    scenario = next(s for s in builtin_scenarios() if s.name == name)
    report = run_scenario(scenario, out, say=lambda *_: None)
    _assert_passed(report)
    path = Path(report["run_dir"]) / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return report, events


def _pids(events: list[dict], rank: int) -> list[int]:
    return [int(e["pid"]) for e in events if e["event"] == "start" and int(e["rank"]) == rank]


def test_the_in_job_scenarios_are_the_ones_these_two_files_run():
    assert set(IN_JOB) == {
        "injob-kill-rank",
        "injob-stop-rank",
        "injob-raise-in-rank",
        "injob-hang-rank",
        "injob-two-faults",
        "injob-fault-during-recovery",
        "injob-no-spare-left",
        "injob-zero-early-kill",
        "injob-two-nodes",
        "injob-replace-node",
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, failed",
    [("injob-kill-rank", [1]), ("injob-stop-rank", [2]), ("injob-raise-in-rank", [3]),
     ("injob-hang-rank", [1]), ("injob-two-faults", [1, 2])],
)  # fmt: skip
def test_failed_ranks_are_replaced_in_job(out, name, failed):
    report, events = _run(out, name)
    m = report["measurements"]
    assert m["restarts"] == 0
    assert [r["path"] for r in m["recoveries"]] == ["in-job"] * len(failed)
    assert set(m["breakdown"]) >= {"teardown", "regroup", "load"}
    for rank in range(4):  # a healthy rank keeps its process; a failed one gets a spare's
        pids = set(_pids(events, rank))
        assert len(pids) == (2 if rank in failed else 1), (rank, pids)
    assert m["restore_sources"] == ["memory"] * len(failed)
    assert max(m["steps_lost"], default=0) <= 1
    # the broken groups were freed without a collection of the frozen heap (nothing held them:
    # torch.distributed.nn imported before the first group, the trainer's kept model let go of
    # its groups)
    freed = [e["freed"] for e in events if e["event"] == "injob_rejoin"]
    assert freed and set(freed) == {"collected"}, freed
    # a process that trained in an earlier generation kept its model and optimizer; each spare
    # built its own
    seen, kept = set(), []
    for e in (e for e in events if e["event"] == "model"):
        me = (int(e["rank"]), int(e["pid"]))
        assert bool(e["kept"]) == (me in seen), e
        kept.append(bool(e["kept"]))
        seen.add(me)
    assert kept.count(True) == 3 * len(failed), kept  # each recovery: the three other ranks
