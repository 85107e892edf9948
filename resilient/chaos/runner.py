"""Run a scenario or the built-in suite: reference, faulty run, verification, reports."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from resilient.chaos.harness import (
    Launch,
    RunPaths,
    launch_job,
    load_launch,
    reference_dir,
    run_reference,
)
from resilient.chaos.report import suite_markdown, write_reports
from resilient.chaos.scenario import Scenario, load_scenario, parse_scenario
from resilient.chaos.verify import verify_run
from resilient.errors import ScenarioError

__all__ = ["run_scenario", "run_suite", "rebuild_report", "builtin_scenarios", "QUICK"]

# The quick suite: one scenario per in-rank injector family and the storage seam, sized for CI.
QUICK = (
    "kill-rank",
    "stop-rank-during-save",
    "raise-in-rank",
    "storage-transient",
    "corrupt-then-kill",
)


def builtin_scenarios(quick: bool = False) -> list[Scenario]:
    root = resources.files("resilient.chaos") / "scenarios"
    out = [
        parse_scenario(p.read_text(), f"resilient/chaos/scenarios/{p.name}")
        for p in sorted(root.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".toml")
    ]
    if quick:
        out = [s for s in out if s.name in QUICK]
    return out


def run_scenario(
    scenario: Scenario | str | Path, out: str | Path, *, say: Any = print
) -> dict[str, Any]:
    """Run one scenario under ``out/<name>`` (its reference under ``out/references``); returns
    the report (``report["passed"]``)."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    out = Path(out)
    run_dir = _run_dir(out, scenario)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(scenario.text)
    say(f"scenario {scenario.name}: {scenario.description}")
    ref = None
    if scenario.expect.final_state != "any":
        ref_launch = run_reference(scenario.job, reference_dir(out, scenario.job), say=say)
        if not ref_launch.succeeded:
            raise RuntimeError(
                f"the fault-free reference run of {scenario.name} failed (exit codes "
                f"{ref_launch.exit_codes}); see the logs in {ref_launch.run_dir}"
            )
        ref = Path(ref_launch.run_dir)
    say(f"  faulty run -> {run_dir}")
    launch = launch_job(scenario.job, RunPaths(run_dir), list(scenario.faults), say=say)
    launch.reference = None if ref is None else str(ref)
    RunPaths(run_dir).run_json.write_text(json.dumps(launch.to_json(), indent=1))
    return _verify_and_report(scenario, run_dir, launch, say)


def _run_dir(out: Path, scenario: Scenario) -> Path:
    """``out/<name>``, which the run empties first: refused unless it lies strictly inside
    ``out`` (a name such as '..', or a link at its place, would have it delete elsewhere)."""
    run_dir = out / scenario.name
    root, resolved = out.resolve(), run_dir.resolve()
    if root not in resolved.parents or resolved == root / "references":
        raise ScenarioError(
            f"{scenario.source}: name: scenario {scenario.name!r} would run in {resolved}, which "
            f"is not a directory of its own inside the output directory {root} (the run deletes "
            f"what is there first); give the scenario a plain name (letters, digits, '-', '_', "
            f"'.') and remove any link at {run_dir}"
        )
    return run_dir


def rebuild_report(run_dir: str | Path, *, say: Any = print) -> dict[str, Any]:
    """Verify a finished run directory again and rewrite its reports."""
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    if not paths.run_json.exists() or not (run_dir / "scenario.toml").exists():
        raise FileNotFoundError(
            f"{run_dir} is not a chaos run directory (no run.json / scenario.toml); give the "
            f"directory `resilient chaos run` wrote"
        )
    scenario = load_scenario(run_dir / "scenario.toml")
    return _verify_and_report(scenario, run_dir, load_launch(run_dir), say)


def _verify_and_report(
    scenario: Scenario, run_dir: Path, launch: Launch, say: Any
) -> dict[str, Any]:
    ref = Path(launch.reference) if launch.reference else None
    outcome = verify_run(scenario, run_dir, launch, ref)
    report = write_reports(scenario, run_dir, launch, outcome)
    for c in outcome.checks:
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c.ok]
        say(f"  [{mark}] {c.name}: {c.detail}")
    say(f"  {'PASSED' if outcome.passed else 'FAILED'} -> {run_dir / 'report.md'}")
    return report


def run_suite(out: str | Path, *, quick: bool = False, say: Any = print) -> list[dict[str, Any]]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for scenario in builtin_scenarios(quick):
        try:
            reports.append(run_scenario(scenario, out, say=say))
        except Exception as e:  # one broken scenario does not hide the others' results
            say(f"  ERROR: {e}")
            reports.append(
                {
                    "scenario": scenario.name,
                    "passed": False,
                    "checks": [{"name": "harness", "ok": False, "detail": str(e)}],
                    "measurements": {},
                }
            )
    (out / "suite.json").write_text(json.dumps(reports, indent=1, default=str))
    (out / "suite.md").write_text(suite_markdown(reports))
    return reports
