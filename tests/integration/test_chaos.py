"""The chaos suite on real torchrun jobs: the quick suite, and every other built-in scenario whose job
is a quick-suite job (so they share its fault-free reference run).  The scenarios with other jobs,
a user's own loop and a failing scenario are in test_chaos_other_jobs.py: the two files run side by
side under `make test` (pytest-xdist, one file per worker); every chaos file shares the session's
reference runs (``chaos_out``)."""

import os
from pathlib import Path

import pytest

from resilient.chaos.harness import job_hash
from resilient.chaos.runner import QUICK, builtin_scenarios, run_scenario, run_suite

pytestmark = [pytest.mark.distributed]


def chaos_out(tmp_path_factory, name: str) -> Path:
    """A module's output directory whose ``references`` are the session's: scenarios with the
    same job share one fault-free reference run across files and pytest-xdist workers (the
    harness locks each reference while one process runs it)."""
    out = tmp_path_factory.mktemp(name)
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "chaos-references"
    shared.mkdir(exist_ok=True)
    (out / "references").symlink_to(shared, target_is_directory=True)
    return out


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """One output directory for the module, so scenarios with the same job share a reference."""
    return chaos_out(tmp_path_factory, "chaos")


# The memory tier's scenarios run in test_chaos_memory.py (with checks of their own); the other
# built-in scenarios whose job is a quick-suite job run here, next to the quick suite, and share
# its reference runs; the rest run in test_chaos_other_jobs.py.
MEMORY_TIER = [s.name for s in builtin_scenarios() if s.name.startswith("memory-")]
IN_JOB = [
    s.name for s in builtin_scenarios() if s.name.startswith("injob-")
]  # test_chaos_injob(_paths)
_QUICK_JOBS = {job_hash(s.job) for s in builtin_scenarios(quick=True)}
WITH_QUICK_JOBS = [
    s.name
    for s in builtin_scenarios()
    if s.name not in QUICK
    and s.name not in MEMORY_TIER
    and s.name not in IN_JOB
    and job_hash(s.job) in _QUICK_JOBS
]


def _assert_passed(report: dict) -> None:
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if c["ok"] is False]
    assert report["passed"] and not failed, f"{report['scenario']}: {failed}"
    fired = next(c for c in report["checks"] if c["name"] == "faults fired")
    assert fired["ok"] is True


@pytest.mark.slow  # a few minutes of real jobs; CI runs it, the fast loop does not
def test_quick_suite(out):
    reports = run_suite(out / "quick", quick=True, say=lambda *_: None)
    assert sorted(r["scenario"] for r in reports) == sorted(QUICK)
    for r in reports:
        _assert_passed(r)
        assert (Path(r["run_dir"]) / "report.md").exists()
        assert Path(r["timeline"]).exists()  # make test installs the plot extra
    by = {r["scenario"]: r for r in reports}
    # the fault cost a restart where it should, and none where retries absorb it
    assert by["kill-rank"]["measurements"]["restarts"] >= 1
    assert by["storage-transient"]["measurements"]["restarts"] == 0
    assert by["stop-rank-during-save"]["measurements"]["verdicts"][0]["verdict"] == "DEAD"
    assert "| kill-rank | pass |" in (out / "quick" / "suite.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_QUICK_JOBS)
def test_full_suite_scenario(out, name):
    scenario = next(s for s in builtin_scenarios() if s.name == name)
    # next to the quick suite's runs: the scenarios with the same job share one reference run
    _assert_passed(run_scenario(scenario, out / "quick", say=lambda *_: None))
