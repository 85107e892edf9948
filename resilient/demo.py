"""``resilient demo``: the end-to-end story on CPU, in a couple of minutes on 2 cores.

1. The bundled MoE trainer runs on 4 ranks (``resilient launch``, torch.distributed.elastic's
   agent, gloo; tp 2 x ep 2, ZeRO-1) with asynchronous checkpoints every 5 steps and a snapshot in
   the node's memory after every step (the memory tier), next to a fault-free reference run of
   the same job.
2. Rank 1 is killed at step 14: the launcher sees the process exit, restarts the group (no
   spares here: the restart path), and it resumes from the newest snapshot in memory, losing at
   most one step.  Rank 2 freezes at step 29, which the launcher cannot see: the detector
   declares it DEAD within seconds (stacks in the event log), kills it, and the group restarts
   again.
3. The chaos harness verifies the run against the reference: bit-identical weights, every
   checkpoint intact, every sample consumed exactly once, at most one step lost per fault.
4. The final checkpoint is resharded to another layout (dp 2 x ep 2 x tp 1) with ``reshape``, and
   training continues there, next to the reference continuing in the original layout.
5. report.json, report.md, the event log and timeline.png are written to ``--out``.

The trainer and ``reshape`` run as commands, the way a user runs them (``resilient`` imports
neither).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from resilient.chaos.harness import RunPaths, forked_launcher, launch_job, run_reference
from resilient.chaos.report import write_reports
from resilient.chaos.scenario import parse_scenario
from resilient.chaos.verify import lineage, read_jsonl, verify_run

__all__ = ["run_demo", "SCENARIO"]

STEPS, MORE, KILL_AT, FREEZE_AT, SAVE_EVERY, MEMORY_EVERY = 40, 10, 14, 29, 5, 1
TARGET = {"dp": 2, "ep": 2, "tp": 1}
LOSS_RTOL = 1e-4

SCENARIO = f"""
name = "demo"
description = "The tiny MoE on 4 ranks (tp 2 x ep 2, ZeRO-1); rank 1 is killed at step {KILL_AT}, rank 2 freezes at step {FREEZE_AT}"

[job]
nproc = 4
max_restarts = 2
timeout_s = 300

[job.trainer]
tp = 2
ep = 2
zero = true
steps = {STEPS}
save_every = {SAVE_EVERY}
memory_every = {MEMORY_EVERY}

[[faults]]
id = "kill-rank-1"
kind = "kill"
rank = 1
step = {KILL_AT}

[[faults]]
id = "freeze-rank-2"
kind = "stop"
rank = 2
step = {FREEZE_AT}

[expect]
final_state = "exact"
verdict = "DEAD"
max_steps_lost = {MEMORY_EVERY}
detect_within_s = 5.0
recover_within_s = 30.0
"""


def run_demo(out: str | Path) -> bool:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)
    out = Path(out)
    _fresh(out)
    scenario = parse_scenario(SCENARIO, "resilient demo")
    (out / "scenario.toml").write_text(SCENARIO)
    t_start = time.monotonic()
    console.rule("[bold]resilient: a training job that loses a rank and loses nothing")

    console.print(
        "[bold]1.[/] The bundled MoE transformer trains on 4 CPU ranks (`resilient launch`, gloo) in "
        f"layout tp 2 x ep 2 with ZeRO-1,\n   saving sharded checkpoints asynchronously every "
        f"{SAVE_EVERY} steps and a snapshot into the node's memory\n   after every step. First, a "
        f"fault-free reference run of the same job:"
    )
    t0 = time.monotonic()
    ref = run_reference(scenario.job, out / "reference", say=lambda *_: None)
    if not ref.succeeded:
        console.print(f"[red]the reference run failed; see {out / 'reference'}/node0.log[/]")
        return False
    ref_records = read_jsonl(RunPaths(out / "reference").metrics, "step")
    console.print(
        f"   {STEPS} steps in {time.monotonic() - t0:.0f}s, loss {ref_records[0]['loss']:.3f} -> "
        f"{ref_records[-1]['loss']:.3f}"
    )

    console.print(
        f"\n[bold]2.[/] The same job again, with two faults: rank 1 is killed (SIGKILL) at step "
        f"{KILL_AT}, and rank 2\n   freezes (SIGSTOP, as a rank does when its GPU or its node "
        f"stalls) at step {FREEZE_AT}."
    )
    paths = RunPaths(out)
    narrator = _Narrator(paths, console)
    narrator.start()
    try:
        launch = launch_job(scenario.job, paths, list(scenario.faults), say=console.print)
    finally:
        narrator.stop()
    launch.reference = str(out / "reference")
    paths.run_json.write_text(json.dumps(launch.to_json(), indent=1))

    console.print(
        "\n[bold]3.[/] The chaos harness checks the run against the fault-free reference:"
    )
    outcome = verify_run(scenario, out, launch, out / "reference")
    table = Table(show_header=True, header_style="bold")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for c in outcome.checks:
        mark = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "n/a"}[c.ok]
        table.add_row(c.name, mark, c.detail)
    console.print(table)
    for fault, r in zip(scenario.faults, outcome.measurements.get("recoveries", [])):
        console.print(
            f"   {fault.id}: {r['seconds']:.1f}s from the fault to the first step after the "
            "restart: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.2f}s" for k, v in r["breakdown"].items())
        )

    console.print(
        f"\n[bold]4.[/] The final checkpoint (step {STEPS}) moves to layout dp {TARGET['dp']} x "
        f"ep {TARGET['ep']} x tp {TARGET['tp']} with [cyan]reshape[/], and training continues\n"
        f"   there for {MORE} more steps, next to the reference continuing in its own layout."
    )
    reshard = _reshard_and_continue(out, console)
    extra = {"reshard": reshard, "appendix_md": _reshard_markdown(reshard), "passed": reshard["ok"]}
    report = write_reports(scenario, out, launch, outcome, extra)
    ok = report["passed"]
    console.print(
        f"\n[bold]5.[/] Reports in [cyan]{out}[/]: report.md (the summary table), report.json, "
        "events.jsonl (verdicts, stacks, saves, restarts)"
        + (", timeline.png" if report.get("timeline") else "")
        + "."
    )
    if not report.get("timeline"):
        console.print(
            f"   (no picture: pip install 'resilient[plot]' and run: resilient report {out})"
        )
    console.rule(
        f"[bold green]all checks passed in {time.monotonic() - t_start:.0f}s"
        if ok
        else "[bold red]a check failed: see report.md"
    )
    return ok


class _Narrator:
    """Tells the run's story live from its metrics and event log."""

    def __init__(self, paths: RunPaths, console: Console) -> None:
        self.paths, self.console = paths, console
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._seen_events = 0
        self._seen_records = 0
        self._restarts: set[int] = set()
        self._fault_t: float | None = None
        self._durable: int | None = None  # the newest durable commit seen

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

    def _poll(self) -> None:
        records = read_jsonl(self.paths.metrics, "step")
        for r in records[self._seen_records :]:
            if r["step"] % 10 == 0 or r["step"] == 1:
                self.console.print(
                    f"   step {r['step']:3d}  loss {r['loss']:.3f}  "
                    f"{r['tokens_per_s']:8.0f} tokens/s"
                )
        self._seen_records = len(records)
        events = read_jsonl(self.paths.events, "event")
        for e in events[self._seen_events :]:
            self._tell(e)
        self._seen_events = len(events)

    def _tell(self, e: dict[str, Any]) -> None:
        say = self.console.print
        kind = e["event"]
        if kind == "save" and e.get("ok"):
            self._durable = e["step"]
            say(
                f"   [green]checkpoint[/] step {e['step']} committed: {e['bytes'] / 1e6:.1f} MB "
                f"written in the background; the loop waited {e['stage_s'] * 1e3:.0f} ms"
            )
        elif kind == "fault":
            self._fault_t = e["time"]
            if e["kind"] == "kill":
                say(
                    f"   [bold red]FAULT[/] rank {e['rank']} killed (SIGKILL) before step "
                    f"{e['step']}: the launcher sees the process exit"
                )
            else:
                say(
                    f"   [bold red]FAULT[/] rank {e['rank']} frozen (SIGSTOP) before step "
                    f"{e['step']}: the process is still there, so the launcher sees nothing; the "
                    "others wait in a collective"
                )
        elif kind == "verdict":
            after = f" {e['time'] - self._fault_t:.1f}s after the fault" if self._fault_t else ""
            say(
                f"   [bold yellow]detector[/]: {e['verdict']} rank {e['rank']} "
                f"(pid {e['pid']}, last step {e['last_step']}): {e['detail']}{after}"
            )
            say("   every live rank writes its Python stacks to the event log and exits (code 75)")
        elif kind == "start" and e.get("restart", 0) > 0 and e["restart"] not in self._restarts:
            self._restarts.add(e["restart"])
            say(f"   [bold]the launcher[/] restarts the group (restart {e['restart']})")
        elif kind == "restore":
            skipped = e.get("skipped_steps") or []
            where = (
                "the newest snapshot in the node's memory"
                if e.get("source") == "memory"
                else "the newest committed checkpoint"
            )
            say(
                f"   resumed from {where}, step {e['step']}, loaded and verified in "
                f"{e['seconds']:.2f}s"
                + (f"; skipped corrupt steps {skipped}" if skipped else "")
                + (
                    f" (durable storage holds step {self._durable})"
                    if e.get("source") == "memory" and self._durable is not None
                    else ""
                )
            )


def _reshard_and_continue(out: Path, console: Console) -> dict[str, Any]:
    src, dst = out / "ckpt", out / "resharded"
    layout = ["--tp", str(TARGET["tp"]), "--ep", str(TARGET["ep"]), "--dp", str(TARGET["dp"])]
    plan = _reshape(["plan", str(src), *layout, "--step", str(STEPS), "--json"])
    plan_info = json.loads(plan.stdout) if plan.returncode == 0 else {}
    t0 = time.monotonic()
    conv = _reshape(["convert", str(src), str(dst), *layout, "--step", str(STEPS)])
    convert_s = time.monotonic() - t0
    if conv.returncode != 0:
        console.print(f"[red]reshape convert failed:[/] {conv.stderr[-2000:]}")
        return {"ok": False, "error": conv.stderr[-2000:]}
    amp = plan_info.get("read_amplification")
    console.print(
        f"   reshape convert: {convert_s:.1f}s"
        + (f", read amplification {amp:.2f}" if isinstance(amp, int | float) else "")
        + f" -> {dst}"
    )
    common = ["--steps", str(STEPS + MORE), "--save-every", str(SAVE_EVERY), "--zero"]
    there = _trainer(
        [*common, *layout, "--ckpt", str(dst), "--metrics", str(out / "continued.jsonl")]
    )
    here = _trainer(
        [
            *common,
            "--tp",
            "2",
            "--ep",
            "2",
            "--ckpt",
            str(out / "reference" / "ckpt"),
            "--metrics",
            str(out / "reference" / "continued.jsonl"),
        ]
    )
    if there.returncode or here.returncode:
        err = (there.stderr or here.stderr)[-2000:]
        console.print(f"[red]continuing failed:[/] {err}")
        return {"ok": False, "error": err}
    a = lineage(read_jsonl(out / "continued.jsonl", "step"))[0]
    b = {
        r["step"]: r["loss"]
        for r in lineage(read_jsonl(out / "reference" / "continued.jsonl", "step"))[0]
    }
    rows = [(r["step"], r["loss"], b.get(r["step"])) for r in a]
    worst = max((abs(x - y) / abs(y) for _, x, y in rows if y is not None), default=float("inf"))
    ok = [s for s, _, _ in rows] == list(range(STEPS + 1, STEPS + MORE + 1)) and worst <= LOSS_RTOL
    table = Table(show_header=True, header_style="bold")
    table.add_column("step", justify="right")
    table.add_column(
        f"loss, dp {TARGET['dp']} x ep {TARGET['ep']} x tp {TARGET['tp']}", justify="right"
    )
    table.add_column("loss, tp 2 x ep 2 (reference)", justify="right")
    for s, x, y in rows:
        table.add_row(str(s), f"{x:.6f}", "-" if y is None else f"{y:.6f}")
    console.print(table)
    console.print(
        f"   the curves agree within {worst:.1e} relative (allowed {LOSS_RTOL:.0e}): "
        + ("[green]pass[/]" if ok else "[red]FAIL[/]")
    )
    return {
        "ok": ok,
        "target_layout": TARGET,
        "convert_s": round(convert_s, 2),
        "plan": plan_info,
        "losses": [{"step": s, "resharded": x, "reference": y} for s, x, y in rows],
        "max_rel_diff": worst,
        "allowed": LOSS_RTOL,
    }


def _reshard_markdown(r: dict[str, Any]) -> str:
    if "losses" not in r:
        return f"\n## Reshard and continue: FAILED\n\n{r.get('error', '')}\n"
    t = r["target_layout"]
    lines = [
        "",
        f"## Reshard to dp {t['dp']} x ep {t['ep']} x tp {t['tp']} and continue "
        f"({'pass' if r['ok'] else '**FAIL**'})",
        "",
        f"`reshape convert` took {r['convert_s']} s. The loss curve continued in the new layout "
        f"agrees with the reference continuing in the old one within {r['max_rel_diff']:.1e} "
        f"relative (allowed {r['allowed']:.0e}).",
        "",
        "| step | loss (resharded) | loss (reference) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {x['step']} | {x['resharded']:.6f} | "
        f"{'-' if x['reference'] is None else format(x['reference'], '.6f')} |"
        for x in r["losses"]
    ]
    return "\n".join(lines) + "\n"


def _reshape(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from reshape.cli import main; main()", *args],
        capture_output=True,
        text=True,
    )


def _trainer(args: list[str]) -> subprocess.CompletedProcess:
    import os

    # forked from the server for launchers the chaos jobs above forked from (the same start
    # settings as theirs: harness.py's job environment), not an interpreter importing torch
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd, env = forked_launcher([sys.executable, "-m", "reference_trainer", "--nproc", "4"], env)
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=600)


def _fresh(out: Path) -> None:
    """Start from an empty ``out``; only ever delete a directory an earlier demo wrote."""
    marker = out / ".resilient-demo"
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; give a new or empty directory")
    if out.exists() and any(out.iterdir()):
        if not marker.exists():
            raise FileExistsError(
                f"--out {out} exists, is not empty and was not written by `resilient demo`; give "
                "a new or empty directory"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by `resilient demo`; the next demo run may delete this directory\n")
