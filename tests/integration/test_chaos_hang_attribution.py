"""Hang attribution on a real torchrun job: the chaos scenario ``hang-between-collectives`` hangs
rank 2 of a tp 2 x ep 2 job between two collectives (before a step), and the failure record must
name rank 2, the collectives the other ranks wait in, rank 2's last collective and its stack; the
flight recorder (on for this job) is dumped by the ranks that answer the verdict, and named."""

import json
from pathlib import Path

import pytest

from resilient.chaos.runner import builtin_scenarios, run_scenario

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCENARIO = "hang-between-collectives"  # run here only (test_chaos_other_jobs.py leaves it out)


def test_the_hung_rank_and_the_collective_are_named(tmp_path):
    scenario = next(s for s in builtin_scenarios() if s.name == SCENARIO)
    report = run_scenario(scenario, tmp_path, say=lambda *_: None)
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if c["ok"] is False]
    assert report["passed"] and not failed, failed
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["faults fired"]["ok"] and checks["hang attributed"]["ok"]
    assert checks["flight recorder dumped"]["ok"]

    run_dir = Path(report["run_dir"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (verdict,) = [e for e in events if e["event"] == "verdict"]
    assert verdict["verdict"] == "HUNG" and verdict["rank"] == 2
    (record,) = [e for e in events if e["event"] == "hang_attribution"]
    assert record["kind"] == "missing_rank" and record["culprits"] == [2]
    assert record["verdict_rank"] == 2
    # every collective that names rank 2 as missing is one rank 2 shares with the waiting ranks
    waits = [s for s in record["stuck"] if 2 in s["missing"]]
    assert waits and all(2 in s["ranks"] and s["waiting"] for s in waits)
    assert any(s["op"] == "all_reduce" for s in waits)
    # what rank 2 last did, and where it is: the chaos hook's hang, before the step
    last = record["ranks"]["2"]["last_left"]
    assert last["op"] and last["seq"] >= 1 and last["left_s_ago"] >= 0
    assert "in _fire" in record["ranks"]["2"]["stack"]
    assert "rank 2 never entered" in record["summary"] and "in _fire" in record["summary"]
    # the flight recorder: every rank that answered the verdict dumped it before its stacks
    # (torchrun may stop a rank that had not seen the verdict yet once the others exit), the
    # leader and the hung rank among them, where the record says
    dumps = [e for e in events if e["event"] == "flight_recorder" and e.get("path")]
    answered = {e["rank"] for e in events if e["event"] == "stacks"}
    assert {0, 2} <= answered <= {e["rank"] for e in dumps}
    assert all(Path(e["path"]).exists() for e in dumps)
    assert set(record["flight_recorder"]["paths"]) == {"0", "2"}
    assert str(run_dir / "flight_recorder" / "rank_") in record["flight_recorder"]["note"]
    # the report shows the attribution next to the verdict
    assert "| hang attribution | " in (run_dir / "report.md").read_text()
