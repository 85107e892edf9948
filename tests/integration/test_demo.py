"""`resilient demo` end to end, as a new user runs it: the main job, its faults, the report.

In tests/integration/ so that the scheduler of `make test` (a file per worker) starts this long
test early, next to the chaos suites, instead of last."""

import json

import pytest
from typer.testing import CliRunner

from resilient.cli import app

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = runner.invoke(app, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["passed"], report["checks"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["final state matches the reference"]["ok"]
    assert checks["DEAD verdict on the faulty rank"]["ok"]
    assert report["measurements"]["restarts"] >= 2  # the kill and the freeze
    assert report["reshard"]["ok"] and report["reshard"]["target_layout"] == {
        "dp": 2,
        "ep": 2,
        "tp": 1,
    }
    for name in ("report.md", "events.jsonl", "timeline.png"):
        assert (out / name).exists(), name
    assert "detector: DEAD rank 2" in result.output and "all checks passed" in result.output
    # the memory tier: both restarts restored a snapshot newer than the newest durable step
    assert report["measurements"]["restore_sources"] == ["memory", "memory"]
    assert max(report["measurements"]["steps_lost"], default=0) <= 1
    assert "newest snapshot in the node's memory" in result.output
    # a second run may replace its own output, never a directory it did not write
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    refused = runner.invoke(app, ["demo", "--out", str(other)])
    assert refused.exit_code == 2 and (other / "precious.txt").exists()
