"""The chaos scenarios whose jobs differ from the quick suite's (each pair with the same job shares
a reference), a user's own loop on @fault_tolerant, and a scenario that must fail: the harness
reports the failure with its reason.  The rest of the suite is in test_chaos.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.chaos.runner import QUICK, builtin_scenarios, run_scenario
from tests.integration.test_chaos import (
    IN_JOB,
    MEMORY_TIER,
    WITH_QUICK_JOBS,
    _assert_passed,
    chaos_out,
)
from tests.integration.test_chaos_hang_attribution import SCENARIO as HANG_ATTRIBUTION

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """One output directory for the module, so scenarios with the same job share a reference."""
    return chaos_out(tmp_path_factory, "chaos-other-jobs")


OWN_JOBS = [
    s.name
    for s in builtin_scenarios()
    if s.name
    not in set(QUICK) | set(WITH_QUICK_JOBS) | set(MEMORY_TIER) | set(IN_JOB) | {HANG_ATTRIBUTION}
]


def test_every_builtin_scenario_is_run_by_one_of_the_chaos_files():
    here, there, memory = set(OWN_JOBS), set(QUICK) | set(WITH_QUICK_JOBS), set(MEMORY_TIER)
    injob = set(IN_JOB)
    assert here and memory and injob and not here & there and not (here | there) & memory
    assert not (here | there | memory) & injob
    # test_chaos_hang_attribution.py runs hang-between-collectives and reads its record
    assert here | there | memory | injob | {HANG_ATTRIBUTION} == {
        s.name for s in builtin_scenarios()
    }
    assert {"stop-rank-at-time", "clock-skew", "kill-node-shrink"} <= here


@pytest.mark.slow
@pytest.mark.parametrize("name", OWN_JOBS)
def test_scenario_with_its_own_job(out, name):
    scenario = next(s for s in builtin_scenarios() if s.name == name)
    _assert_passed(run_scenario(scenario, out, say=lambda *_: None))


@pytest.mark.slow
def test_any_command_under_torchrun(out, monkeypatch):
    """A user's own loop on @fault_tolerant (examples/), not the reference trainer."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the scenario names the script relative to the repository
    report = run_scenario(root / "examples" / "kill-my-loop.toml", out, say=lambda *_: None)
    _assert_passed(report)
    names = {c["name"]: c["ok"] for c in report["checks"]}
    assert names["every sample consumed exactly once"] is True
    assert names["final state matches the reference"] is True
    assert report["measurements"]["restarts"] >= 1


FAILING = """
name = "corrupt-no-fallback"
description = "Bit rot in the newest checkpoint, a kill, and fallback disabled: the job cannot resume"

[job]
nproc = 2
max_restarts = 1
timeout_s = 180
[job.trainer]
dp = 2
steps = 20
save_every = 5
no_fallback = true

[[faults]]
kind = "corrupt"
step = 7

[[faults]]
kind = "kill"
rank = 1
step = 8

[expect]
final_state = "any"     # no reference run: the job cannot finish, so there is no state to compare
"""


@pytest.mark.slow
def test_the_harness_reports_failure_with_the_reason(out, tmp_path):
    path = tmp_path / "corrupt-no-fallback.toml"
    path.write_text(FAILING)
    r = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "chaos", "run", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads((out / "corrupt-no-fallback" / "report.json").read_text())
    assert not report["passed"]
    failed = {c["name"]: c["detail"] for c in report["checks"] if c["ok"] is False}
    assert "job completed" in failed and "checksum mismatch" in failed["job completed"]
    fired = next(c for c in report["checks"] if c["name"] == "faults fired")
    assert fired["ok"]  # the faults did fire: it is the invariant that broke
    assert "FAILED" in r.stdout

    # the same run judged against a bound it cannot meet: `resilient report` fails it too
    run_dir = out / "corrupt-no-fallback"
    text = FAILING.replace(
        'final_state = "any"', 'completed = false\nerror_contains = "CheckpointCorruptError"'
    )
    (run_dir / "scenario.toml").write_text(text)
    from typer.testing import CliRunner  # (in this process: no interpreter and torch import)

    from resilient.cli import app

    again = CliRunner().invoke(app, ["report", str(run_dir)])
    assert again.exit_code == 0, again.output  # a failure the scenario expects passes
    (run_dir / "scenario.toml").write_text(text.replace("CheckpointCorruptError", "no such text"))
    third = CliRunner().invoke(app, ["report", str(run_dir)])
    assert third.exit_code == 1 and "lacks 'no such text'" in third.output
