"""Reports of a chaos run: report.json, report.md (the summary table) and timeline.png.

The timeline draws the steps the job completed against wall-clock time (steps a restart rolled back
in grey), with faults, verdicts, restarts and committed saves marked.  matplotlib is an optional
extra (``pip install 'resilient[plot]'``); without it the report says how to get the picture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resilient.chaos.harness import Launch, RunPaths
from resilient.chaos.scenario import Scenario
from resilient.chaos.verify import Outcome, lineage, read_jsonl, recovery_starts

__all__ = ["write_reports", "draw_timeline", "suite_markdown"]

PLOT_HINT = "pip install 'resilient[plot]' (matplotlib), then: resilient report {run_dir}"


def write_reports(
    scenario: Scenario,
    run_dir: Path,
    launch: Launch,
    outcome: Outcome,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write report.json, report.md and timeline.png.  ``extra``: more sections (``appendix_md``
    is appended to report.md); a rebuild keeps the extra sections of the report it replaces."""
    previous = run_dir / "report.json"
    if extra is None and previous.exists():
        old = json.loads(previous.read_text())
        extra = {k: v for k, v in old.items() if k in old.get("extra_keys", [])}
    extra = extra or {}
    picture = draw_timeline(run_dir, scenario.name)
    report = {
        "scenario": scenario.name,
        "description": scenario.description,
        "passed": outcome.passed,
        "checks": [c.to_json() for c in outcome.checks],
        "measurements": outcome.measurements,
        "exit_codes": launch.exit_codes,
        "run_dir": str(run_dir),
        "reference": launch.reference,
        "timeline": picture,
        **extra,
        "extra_keys": sorted(extra),
    }
    if "passed" in extra:
        report["passed"] = outcome.passed and extra["passed"]
    (run_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (run_dir / "report.md").write_text(markdown(report))
    return report


def markdown(report: dict[str, Any]) -> str:
    m = report["measurements"]
    lines = [
        f"# Chaos run: {report['scenario']} ({'PASSED' if report['passed'] else 'FAILED'})",
        "",
        report["description"],
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    for c in report["checks"]:
        mark = {True: "pass", False: "**FAIL**", None: "n/a"}[c["ok"]]
        lines.append(f"| {c['name']} | {mark} | {c['detail'].replace('|', '/')} |")
    lines += ["", "| measurement | value |", "|---|---|"]
    for key in (
        "wall_s",
        "restarts",
        "steps_lost",
        "detection_s",
        "recovery_s",
        "loss_max_rel_diff",
        "layouts",
    ):
        if key in m:
            lines.append(f"| {key} | {m[key]} |")
    for r in m.get("recoveries", []):
        lines.append(f"| recovery path | {r.get('path', 'restart')}: {r['seconds']} s |")
    for phase, secs in m.get("breakdown", {}).items():
        lines.append(f"| recovery: {phase} (s) | {secs} |")
    for v in m.get("verdicts", []):
        lines.append(f"| verdict | {v['verdict']} rank {v['rank']}: {v['detail']} |")
    for a in m.get("hang_attributions", []):
        lines.append(f"| hang attribution | {a.replace('|', '/')} |")
    lines.append("")
    if report.get("timeline"):
        lines.append(f"![timeline]({Path(report['timeline']).name})")
    else:
        lines.append("No timeline picture: " + PLOT_HINT.format(run_dir=report["run_dir"]))
    return "\n".join(lines) + "\n" + report.get("appendix_md", "")


def draw_timeline(run_dir: Path, title: str) -> str | None:
    """timeline.png of the run; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    paths = RunPaths(run_dir)
    records = read_jsonl(paths.metrics, "step")
    events = read_jsonl(paths.events, "event")
    t0 = min(
        [e["time"] for e in events if e["event"] == "job_start"]
        or [r["wall_time"] for r in records]
        or [0.0]
    )
    history, _ = lineage(records)
    kept = {id(r) for r in history}
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    lost = [r for r in records if id(r) not in kept]
    ax.scatter(
        [r["wall_time"] - t0 for r in history],
        [r["step"] for r in history],
        s=6,
        color="tab:blue",
        label="step completed",
    )
    if lost:
        ax.scatter(
            [r["wall_time"] - t0 for r in lost],
            [r["step"] for r in lost],
            s=6,
            color="0.65",
            label="rolled back",
        )
    marks = [
        ("fault", "tab:red", "-", "fault"),
        ("verdict", "tab:orange", "--", "verdict"),
        ("straggler", "gold", "--", "straggler"),
    ]
    for event, color, style, label in marks:
        for i, e in enumerate(x for x in events if x["event"] == event):
            ax.axvline(
                e["time"] - t0, color=color, ls=style, lw=1.5, label=label if i == 0 else None
            )
            text = e.get("kind") or e.get("verdict") or ""
            ax.annotate(
                text,
                (e["time"] - t0, ax.get_ylim()[1]),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )
    restarts = sorted(t - t0 for (_, gen), t in recovery_starts(events).items() if gen == 0)
    for i, t in enumerate(restarts):
        ax.axvline(t, color="tab:purple", ls=":", lw=1.5, label="restart" if i == 0 else None)
    saves = [e for e in events if e["event"] == "save" and e.get("ok")]
    if saves:
        ax.scatter(
            [e["committed_at"] - t0 for e in saves],
            [e["step"] for e in saves],
            marker="D",
            s=22,
            facecolors="none",
            edgecolors="tab:green",
            label="checkpoint committed",
        )
    ax.set_xlim(left=0)
    ax.set_xlabel("wall-clock time since launch (s)")
    ax.set_ylabel("training step")
    ax.set_title(f"{title}: steps, faults, verdicts, restarts and saves")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    # fixed margins: tight_layout measured every label first, a quarter of the drawing's CPU
    fig.subplots_adjust(left=0.07, right=0.985, top=0.92, bottom=0.11)
    out = run_dir / "timeline.png"
    fig.savefig(out)
    plt.close(fig)
    return str(out)


def suite_markdown(reports: list[dict[str, Any]]) -> str:
    lines = [
        "# Chaos suite",
        "",
        "| scenario | result | verdicts | restarts | steps lost | detection (s) | recovery (s) "
        "| failed checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        m = r["measurements"]
        failed = "; ".join(f"{c['name']}: {c['detail']}" for c in r["checks"] if c["ok"] is False)
        verdicts = ", ".join(f"{v['verdict']} r{v['rank']}" for v in m.get("verdicts", [])) or "-"
        lines.append(
            f"| {r['scenario']} | {'pass' if r['passed'] else '**FAIL**'} | {verdicts} "
            f"| {m.get('restarts', 0)} "
            f"| {max(m.get('steps_lost') or [0])} | {m.get('detection_s', '-')} "
            f"| {m.get('recovery_s', '-')} | {failed.replace('|', '/') or '-'} |"
        )
    return "\n".join(lines) + "\n"
