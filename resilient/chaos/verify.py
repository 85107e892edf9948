"""What must hold after a chaos run, checked from the run directory alone.

The committed history of a run is its *lineage*: the per-step records (metrics.jsonl, appended
across restarts) with every step that a restart rolled back replaced by its replay.  On it the
checks are: the job completed; every fault fired; the final state equals the fault-free
reference's (bit for bit, or within a tolerance when the layout changed); the loss curve matches;
every committed checkpoint verifies; no rollback lost more than the allowed steps; every global
sample was consumed exactly once; the expected verdict (or none) was issued; detection and recovery
were within their bounds.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilient.chaos.faults import DAMAGE_KINDS
from resilient.chaos.harness import Launch, RunPaths
from resilient.chaos.jsonl import read_jsonl
from resilient.chaos.scenario import Scenario
from resilient.checkpoint.format import BOOKKEEPING_KEYS
from resilient.health.detector import STARTUP_LIVENESS_PHASES, DetectorConfig

__all__ = [
    "Check",
    "Outcome",
    "lineage",
    "verify_run",
    "read_jsonl",
    "recovery_breakdown",
    "join_wait",
    "design_wait",
]


@dataclass
class Check:
    name: str
    ok: bool | None  # None: does not apply to this run
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Outcome:
    checks: list[Check]
    measurements: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]


def lineage(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the committed history, the rollbacks).  A record whose step is not after the previous one
    starts a replay: the steps from it on are replaced.  A rollback notes the newest step reached
    before it, the step it resumed after, and the steps lost."""
    history: list[dict[str, Any]] = []
    rollbacks: list[dict[str, Any]] = []
    for r in records:
        if history and r["step"] <= history[-1]["step"]:
            reached = history[-1]["step"]
            history = [h for h in history if h["step"] < r["step"]]
            rollbacks.append(
                {
                    "reached": reached,
                    "resumed_after": r["step"] - 1,
                    "lost": reached - (r["step"] - 1),
                    "first_step_time": r.get("wall_time"),
                }
            )
        elif history and r["step"] > history[-1]["step"] + 1:
            rollbacks.append({"gap": [history[-1]["step"], r["step"]]})
        history.append(r)
    return history, rollbacks


def _cut_short(
    rollback: dict[str, Any], events: list[dict[str, Any]], fault_at: list[float], interval: int
) -> int | None:
    """The step of a durable save that was due among a rollback's lost steps but not committed
    when the restore began (the fault cut its commit short), where the run resumed from the
    newest step committed anywhere then (its 'restore' event says what there was): what an
    asynchronous save costs beyond one interval, up to two, with nothing committed lost.  None
    when that is not what happened."""
    first = rollback.get("first_step_time")
    fault = max((t for t in fault_at if first is None or t <= first), default=None)
    if fault is None or not interval:
        return None
    resumed = rollback["resumed_after"]
    restore = next(
        (
            e
            for e in events
            if e["event"] == "restore"
            and e["time"] >= fault
            and (first is None or e["time"] <= first)
        ),
        None,
    )
    if restore is None or restore.get("step") != resumed or "newest_durable" not in restore:
        return None
    newest = [s for s in (restore["newest_durable"], restore.get("newest_memory")) if s is not None]
    if max(newest, default=0) > resumed:
        return None  # a step committed before the restore was not restored: that is a loss
    due = [s for s in range(resumed + 1, rollback["reached"] + 1) if s % interval == 0]
    return due[0] if due else None


def _attempt(start: dict[str, Any]) -> str:
    """The workers' attempt a "start" event belongs to (``attempt_key``; the restart count in
    older logs).  Not the restart count under ``resilient launch``: a node that joined counts its
    own from 0 in the same round."""
    return str(start.get("attempt", start.get("restart", 0)))


def recovery_starts(events: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(attempt, in-job generation) -> when its first rank started, for every start of the
    group but the job's own: restarts (generation 0) and in-job generations."""
    attempts: dict[tuple[str, int], float] = {}
    order: dict[str, tuple[int, int]] = {}  # attempt -> (restart count, round)
    for e in events:
        if e["event"] == "start":
            key = (_attempt(e), int(e.get("generation", 0)))
            attempts[key] = min(attempts.get(key, e["time"]), e["time"])
            order.setdefault(key[0], (int(e.get("restart", 0)), _round(key[0])))
    # the job's start: the first attempt, if it started at all (a rank frozen in its imports
    # stops the first attempt before any rank starts: then every attempt seen is a restart)
    first = min(order, key=lambda a: order[a], default=None)
    if first is not None and order[first][0] == 0:
        attempts.pop((first, 0), None)
    return attempts


def _restored_last(events: list[dict[str, Any]], began: float, steps: int | None) -> float | None:
    """When the group that started at ``began`` restored the job's last step (a fault the harness
    fired from outside landed after the job's last step, on a loaded machine): nothing is left to
    train, so its recovery ends with that restore; else None."""
    return next(
        (
            e["time"]
            for e in events
            if e["event"] == "restore" and e["time"] > began and steps and e.get("step") == steps
        ),
        None,
    )


def _round(attempt: str) -> int:
    """The rendezvous round of an attempt ``round_<n>`` (0 for a restart count)."""
    return int(attempt[6:]) if attempt.startswith("round_") and attempt[6:].isdigit() else 0


def _restarts(events: list[dict[str, Any]]) -> int:
    """How many times the group's workers started again: torchelastic's restart count, or the
    attempts (``resilient launch``'s rendezvous rounds) the workers started in, one less, where
    more (a node joining restarts the workers without moving the restart count)."""
    starts = [e for e in events if e["event"] == "start"]
    attempts = {_attempt(e) for e in starts}
    return max(max((e.get("restart", 0) for e in starts), default=0), len(attempts) - 1)


def _expected_skew(
    fault: Any, event: dict[str, Any], events: list[dict[str, Any]], nproc: int
) -> float:
    """The skew the leader should see for ``event``'s rank: the skewed ranks' offset, less the
    leader's own when the leader is one of them (which agent holds ranks 0..nproc-1 is the
    rendezvous's choice).  A node's ranks are contiguous; the rank that recorded the fault names
    the node (a fault with ``rank`` set skews that rank alone)."""
    s = float(fault.seconds or 0)
    if fault.rank is not None:
        skewed = {fault.rank}
    else:
        fired = [e["rank"] for e in events if e["event"] == "fault" and e.get("id") == fault.id]
        if not fired or not isinstance(fired[0], int):
            return s  # no record of where it fired: the skewed ranks' view from an unskewed leader
        node = fired[0] // max(nproc, 1)
        skewed = set(range(node * nproc, (node + 1) * nproc))
    return s * (event.get("rank") in skewed) - s * (event.get("leader") in skewed)


def verify_run(
    scenario: Scenario, run_dir: Path, launch: Launch, reference: Path | None
) -> Outcome:
    paths = RunPaths(run_dir)
    events = read_jsonl(paths.events, "event")
    records = read_jsonl(paths.metrics, "step")
    history, rollbacks = lineage(records)
    exp, job = scenario.expect, scenario.job
    checks: list[Check] = []
    m: dict[str, Any] = {
        "wall_s": round(launch.ended - launch.started, 2),
        "restarts": _restarts(events),
        "rollbacks": [r for r in rollbacks if "lost" in r],
    }
    layouts = []
    for r in history:
        if r.get("layout") and r["layout"] not in layouts:
            layouts.append(r["layout"])
    if layouts:
        m["layouts"] = layouts

    # 1. the job completed (or failed, as the scenario expects)
    final = history[-1]["step"] if history else 0
    log_text = "\n".join(
        paths.log(n).read_text(errors="replace") for n in range(job.nodes) if paths.log(n).exists()
    )
    if exp.completed:
        ok = launch.succeeded and (job.steps is None or final == job.steps)
        detail = (
            f"exit codes {launch.exit_codes}"
            + (f", nodes {launch.killed_nodes} killed on purpose" if launch.killed_nodes else "")
            + (f", final step {final}/{job.steps}" if job.steps else "")
            + (" (timed out)" if launch.timed_out else "")
        )
        if not ok:
            detail += f"; last error: {_last_error(log_text)}"
        checks.append(Check("job completed", ok, detail))
    else:
        failed = not launch.succeeded
        found = exp.error_contains is None or exp.error_contains in log_text
        checks.append(
            Check(
                "job failed as expected",
                failed and found,
                f"exit codes {launch.exit_codes}; "
                + (
                    f"log {'contains' if found else 'lacks'} {exp.error_contains!r}"
                    if exp.error_contains
                    else ""
                )
                + f"; last error: {_last_error(log_text)}",
            )
        )

    # 2. every fault fired
    fired = {e["id"]: e for e in events if e["event"] == "fault"}
    for rec in read_jsonl(paths.storage_record, "rule"):
        fired.setdefault(rec["rule"], {"time": rec["time"], "count": 0})
        fired[rec["rule"]]["count"] = fired[rec["rule"]].get("count", 0) + 1
    # a corrupt or truncate fault fired where it damaged something (its fault_detail event)
    damaged = {e["id"] for e in events if e["event"] == "fault_detail"}
    undamaged = [
        f.id
        for f in scenario.faults
        if f.kind in DAMAGE_KINDS and f.id in fired and f.id not in damaged
    ]
    for fid in undamaged:
        del fired[fid]
    missing = [f.id for f in scenario.faults if f.id not in fired]
    checks.append(
        Check(
            "faults fired",
            not missing,
            "all fired: "
            + ", ".join(
                f"{fid}" + (f" x{fired[fid]['count']}" if "count" in fired[fid] else "")
                for fid in fired
            )
            if not missing
            else f"never fired: {missing}"
            + (
                f" ({undamaged}: recorded, but no fault_detail: damaged nothing)"
                if undamaged
                else ""
            ),
        )
    )
    m["faults_fired"] = {
        k: {"time": v.get("time"), **({"count": v["count"]} if "count" in v else {})}
        for k, v in fired.items()
    }

    applies = exp.completed and launch.succeeded
    # 3. the final state against the fault-free reference
    ref_history: list[dict[str, Any]] = []
    compared = exp.final_state != "any" and applies
    if compared and reference is None:
        checks.append(
            Check(
                "final state matches the reference",
                False,
                f"no fault-free reference run is recorded for this run (run.json's reference is "
                f"null), so nothing vouches for final_state {exp.final_state!r}; run the scenario "
                f"with `resilient chaos run`, which runs the reference, or say final_state = 'any'",
            )
        )
    elif compared:
        ref_history = lineage(read_jsonl(RunPaths(reference).metrics, "step"))[0]
        checks.append(_compare_final(paths, RunPaths(reference), job.steps, exp))
    else:
        checks.append(Check("final state matches the reference", None, "not compared"))

    # 4. the loss curve (a side without records fails it: a job that records none on either
    # side, a command job's, has no curve to compare)
    if compared and reference is not None and not (ref_history and history):
        if ref_history or history or job.trainer is not None:
            checks.append(
                Check(
                    "loss curve matches the reference",
                    False,
                    (
                        f"the reference run {reference} recorded no step ("
                        f"{RunPaths(reference).metrics} is missing or empty); delete it so the "
                        f"next run makes it again"
                    )
                    if not ref_history
                    else f"this run recorded no step ({paths.metrics} is missing or empty)",
                )
            )
        else:
            checks.append(
                Check("loss curve matches the reference", None, "neither run records metrics")
            )
    elif compared and ref_history and history:
        ref_loss = {r["step"]: r["loss"] for r in ref_history}
        tol = (
            exp.loss_rtol
            if exp.loss_rtol is not None
            else (0.0 if exp.final_state == "exact" else exp.rtol)
        )
        worst, at = 0.0, None
        unmatched, nonfinite = [], []
        for r in history:
            if r["step"] not in ref_loss:
                unmatched.append(r["step"])  # a step the reference never ran: nothing vouches
                continue
            x, y = float(r["loss"]), float(ref_loss[r["step"]])
            if not (math.isfinite(x) and math.isfinite(y)):
                # (a NaN's difference is NaN, which no '>' catches) only the same non-finite
                # value on both sides matches
                if not (x == y or (math.isnan(x) and math.isnan(y))):
                    nonfinite.append((r["step"], x, y))
                continue
            d = abs(x - y) / max(abs(y), 1e-12)
            if d > worst:
                worst, at = d, r["step"]
        ok = worst <= tol and not unmatched and not nonfinite
        checks.append(
            Check(
                "loss curve matches the reference",
                ok,
                f"max relative difference {worst:.2e}"
                + (f" at step {at}" if at else "")
                + f" (allowed {tol:.0e})"
                + "".join(
                    f"; step {st}: loss {x}, the reference's {y}" for st, x, y in nonfinite[:3]
                )
                + (
                    f"; steps {unmatched[:5]} have no reference step (it ran "
                    f"{min(ref_loss)}..{max(ref_loss)})"
                    if unmatched
                    else ""
                ),
            )
        )
        m["loss_max_rel_diff"] = worst

    # 5. every committed checkpoint verifies (nothing committed is lost)
    if exp.checkpoints_verify:
        checks.append(_verify_checkpoints(paths, events, completed=exp.completed))

    # 6. steps lost per rollback
    lost = [r["lost"] for r in rollbacks if "lost" in r]
    gaps = [r["gap"] for r in rollbacks if "gap" in r]
    bound = exp.max_steps_lost if exp.max_steps_lost is not None else (job.save_every or 0)
    if (job.steps is not None or exp.max_steps_lost is not None) and applies:
        interval = job.save_every or bound
        fault_at = sorted(v["time"] for v in fired.values() if v.get("time"))
        # only where the bound is the durable interval (not a memory tier's one step, nor a
        # scenario's promise of no loss at all)
        durable_bound = interval and bound >= interval
        cut = {
            i: _cut_short(r, events, fault_at, interval) if durable_bound else None
            for i, r in enumerate(rollbacks)
            if r.get("lost", 0) > bound
        }
        ok = all(
            r["lost"] <= bound or (cut[i] is not None and r["lost"] <= bound + interval)
            for i, r in enumerate(rollbacks)
            if "lost" in r
        )
        excused = sorted({s for s in cut.values() if s is not None})
        checks.append(
            Check(
                "steps lost within bound",
                ok and not gaps,
                f"lost {lost or [0]} steps per rollback (allowed {bound}"
                + (
                    f", {interval} more where the fault cut short the commit of the save of "
                    f"step {', '.join(map(str, excused))}: nothing committed was lost)"
                    if excused
                    else ")"
                )
                + (f"; steps skipped between {gaps}" if gaps else ""),
            )
        )
    m["steps_lost"] = lost

    # 7. every global sample exactly once in the committed history
    if exp.samples_exactly_once and applies:
        checks.append(
            _samples_once(
                history,
                job.steps,
                reference=ref_history or None,
                global_batch=None if job.trainer is None else job.trainer.get("global_batch"),
                even=job.trainer is not None,
            )
        )
    # "peer": from memory, with files another node held (a replica, or a file of another node's)
    m["restore_sources"] = [
        "peer" if e.get("peer_files") else e.get("source", "durable")
        for e in events
        if e["event"] == "restore"
    ]
    if job.trainer and job.trainer.get("memory_every") and applies:
        checks.append(
            Check(
                "memory tier released",
                not launch.memory_left,
                "the job's snapshots were removed from host memory at the end"
                if not launch.memory_left
                else f"left in host memory: {launch.memory_left}",
            )
        )

    # 8. verdicts; 9. detection and recovery latency
    verdicts = [e for e in events if e["event"] == "verdict"]
    stragglers = [e for e in events if e["event"] == "straggler"]
    checks += _verdict_checks(scenario, verdicts, stragglers, m)
    # each verdict and each restart is timed from the newest fault before it
    fault_times = sorted(v["time"] for v in fired.values() if v.get("time"))

    def cause(t: float) -> float | None:
        return max((f for f in fault_times if f <= t), default=None)

    timed = [(v["time"] - cause(v["time"])) for v in verdicts if cause(v["time"]) is not None]
    if timed:
        m["detection_s"] = round(max(timed), 3)
    # A rank that froze before it registered can only be declared after the join timeout, and
    # one that froze during start-up after the longer start-up liveness timeout: those waits are
    # part of the design, not slowness, so they are allowed on top of the bounds, and named.
    paths = [
        (p, w)
        for v in verdicts
        if (c := cause(v["time"])) is not None
        for p, w in [design_wait(v, c)]
        if w > 0
    ]
    join_allowance = max((w for _, w in paths), default=0.0)
    path = (
        f"; {max(paths, key=lambda x: x[1])[0]} path: {join_allowance:.2f}s of it is that "
        f"timeout, allowed on top"
        if paths
        else ""
    )
    if paths:
        m["design_wait_s"] = round(join_allowance, 3)
    if exp.detect_within_s is not None:
        checks.append(
            _within(
                "detection within bound",
                m.get("detection_s"),
                exp.detect_within_s + join_allowance,
                "from fault to verdict" + path,
                "no verdict to time",
            )
        )
    # one recovery per restart of the group: from the newest fault before it to the first step
    # completed after it (a restart may resume exactly where the job stopped: no rollback)
    # (in-job recovery: a new generation of the group, the same restart)
    attempts = recovery_starts(events)
    recoveries = []
    for (_, gen), began in sorted(attempts.items(), key=lambda kv: kv[1]):
        first = next((r for r in records if r.get("wall_time", 0) > began), None)
        end = first["wall_time"] if first is not None else _restored_last(events, began, job.steps)
        c = cause(began)
        if end is not None and c is not None:
            recoveries.append(
                {
                    "seconds": round(end - c, 3),
                    "path": "in-job" if gen > 0 else "restart",
                    "breakdown": recovery_breakdown(events, c),
                }
            )
    if recoveries:
        m["recovery_s"] = max(r["seconds"] for r in recoveries)
        m["breakdown"] = recoveries[0]["breakdown"]
        m["recoveries"] = recoveries
    if exp.recover_within_s is not None:
        slowest = f" (the slowest of {len(recoveries)})" if len(recoveries) > 1 else ""
        checks.append(
            _within(
                "recovery within bound",
                m.get("recovery_s"),
                exp.recover_within_s + join_allowance,
                f"from fault to the first step after the restart{slowest}{path}",
                "no restart to time",
            )
        )
    # a skewed clock: the leader saw it (and, with verdict = "none", it cost nothing)
    for f in (f for f in scenario.faults if f.kind == "skew"):
        seen = [
            e
            for e in events
            if e["event"] == "clock_skew"
            and (want := _expected_skew(f, e, events, job.nproc)) != 0.0
            and abs(e["skew_s"] - want) < 1.0
        ]
        who = f"rank {f.rank}" if f.rank is not None else f"node {f.node}'s ranks"
        checks.append(
            Check(
                "clock skew reported",
                bool(seen),
                f"{who}: skew {f.seconds:+.0f}s seen by the leader for ranks "
                f"{sorted({e['rank'] for e in seen})}"
                if seen
                else f"{who}: no clock_skew event near {f.seconds:+.0f}s in the event log",
            )
        )
    checks += _attribution_checks(scenario, events, m)
    if exp.restarts is not None:
        checks.append(
            Check(
                "restarts as expected",
                m["restarts"] == exp.restarts,
                f"{m['restarts']} restart(s) of the group (expected {exp.restarts})"
                + _fallback_reason(log_text),
            )
        )
    failed = sorted({e["step"] for e in events if e["event"] == "save" and e.get("ok") is False})
    m["failed_saves"] = failed
    if exp.failed_saves is not None:
        errors = [e["error"] for e in events if e["event"] == "save" and e.get("ok") is False]
        checks.append(
            Check(
                "failed saves logged, training went on",
                len(failed) == exp.failed_saves,
                f"saves of steps {failed} failed and were logged (expected {exp.failed_saves})"
                + (f", e.g. {errors[0][:200]}" if errors else ""),
            )
        )
    return Outcome(checks, m)


def join_wait(verdict: dict[str, Any], fault_t: float) -> float:
    """For a "never joined" verdict, the part of fault-to-verdict that was the leader waiting out
    its join timeout after the fault: (leader's wait start + join timeout) - fault time."""
    if verdict.get("cause") != "never_joined" or verdict.get("waited_s") is None:
        return 0.0
    began = verdict["time"] - verdict["waited_s"]
    return max(0.0, began + (verdict.get("timeout_s") or 0.0) - fault_t)


def design_wait(verdict: dict[str, Any], fault_t: float) -> tuple[str, float]:
    """(which path, how much longer than a training-time DEAD verdict it must take by design)."""
    if verdict.get("cause") == "never_joined":
        return "never-joined", join_wait(verdict, fault_t)
    if verdict.get("cause") == "no_heartbeat" and verdict.get("phase") in STARTUP_LIVENESS_PHASES:
        c = DetectorConfig()
        timeout = verdict.get("timeout_s") or 0.0
        return "start-up liveness", timeout * (
            1 - c.dead_after_intervals / c.startup_dead_after_intervals
        )
    return "", 0.0


def _within(name: str, value: float | None, bound: float, what: str, missing: str) -> Check:
    if value is None:
        return Check(name, False, missing)
    return Check(name, value <= bound, f"{value:.2f}s {what} (allowed {bound:.1f}s)")


def recovery_breakdown(events: list[dict[str, Any]], fault_t: float) -> dict[str, float]:
    """Fault to first step after the restart, in phases: detection (fault to verdict, when the
    detector issued one before the restart), teardown and restart (to the new workers' process
    start), start and rendezvous (to the new process group), checkpoint load, and the first step.
    For an in-job recovery (a new generation, no restart): detection, teardown (to the first
    healthy rank leaving the broken group), regroup (to the last rank in the new group with the
    spare), rebuild (the model built again, to the last rank's start), load, first step; and, not
    part of the sum, the spare's takeover (from the fault to the spare given the rank)."""
    starts = [e for e in events if e["event"] == "start" and e["time"] > fault_t]
    if not starts:
        return {}
    attempt = (_attempt(starts[0]), starts[0].get("generation", 0))
    same = [e for e in starts if (_attempt(e), e.get("generation", 0)) == attempt]
    leave = next(
        (e["time"] for e in events if e["event"] == "injob_leave" and e["time"] >= fault_t), None
    )
    proc = min(e.get("process_start", e["time"]) for e in same)
    ready = max(e["time"] for e in same)
    verdict = next(
        (
            e["time"]
            for e in events
            if e["event"] == "verdict" and fault_t <= e["time"] <= starts[0]["time"]
        ),
        None,
    )
    restore = next((e for e in events if e["event"] == "restore" and e["time"] > ready - 1), None)
    first = next(
        (e["time"] for e in events if e["event"] == "first_step" and e["time"] > ready - 1), None
    )
    out: dict[str, float] = {}
    t = fault_t
    if verdict is not None:
        out["detection"] = verdict - t
        t = verdict
    if attempt[1] and leave is not None:
        # in-job: the healthy ranks leave the broken group (a pending commit abandoned), wait
        # for the spare's generation and form it; the spare was started long before
        rejoined = [
            e["time"]
            for e in events
            if e["event"] == "injob_rejoin"
            and int(e.get("generation", 0)) == attempt[1]
            and leave <= e["time"] <= ready
        ]
        formed = max(rejoined, default=ready)
        out["teardown"] = leave - t
        out["regroup"] = formed - leave
        out["rebuild"] = ready - formed
        takeover = next(
            (
                e["time"]
                for e in events
                if e["event"] == "spare_takeover"
                and int(e.get("generation", 0)) == attempt[1]
                and e["time"] >= fault_t
            ),
            None,
        )
        if takeover is not None:
            out["spare_takeover"] = takeover - fault_t
    else:
        out["teardown_restart"] = proc - t
        out["start_rendezvous"] = ready - proc
    if restore is not None:
        out["load"] = restore["seconds"]
    if first is not None and restore is not None:
        out["first_step"] = first - restore["time"]
    return {k: round(max(v, 0.0), 3) for k, v in out.items()}


def _verdict_checks(
    scenario: Scenario, verdicts: list[dict], stragglers: list[dict], m: dict[str, Any]
) -> list[Check]:
    exp = scenario.expect
    m["verdicts"] = [
        {k: v.get(k) for k in ("verdict", "rank", "detail", "time", "cause")}
        for v in verdicts + stragglers
    ]
    if exp.verdict is None:
        return []
    if exp.verdict == "none":
        # DEAD and HUNG act (a restart); STRAGGLER is a report, never acted on, and a loaded
        # machine (the suite on 2 busy cores) makes some rank persistently slower for a while:
        # listed, not failed.  A scenario that expects a straggler says verdict = "STRAGGLER".
        noted = (
            f"; reported only: {[('STRAGGLER', v['rank']) for v in stragglers]}"
            if stragglers
            else ""
        )
        return [
            Check(
                "no verdict",
                not verdicts,
                f"no rank was declared dead or hung{noted}"
                if not verdicts
                else f"unexpected: {[(v['verdict'], v['rank']) for v in verdicts]}",
            )
        ]
    ranks = {f.rank for f in scenario.faults if f.rank is not None}
    pool = stragglers if exp.verdict == "STRAGGLER" else verdicts
    match = [v for v in pool if v["verdict"] == exp.verdict and (not ranks or v["rank"] in ranks)]
    checks = [
        Check(
            f"{exp.verdict} verdict on the faulty rank",
            bool(match),
            f"{match[0]['verdict']} rank {match[0]['rank']}: {match[0]['detail']}"
            if match
            else f"expected {exp.verdict} on rank(s) {sorted(ranks)}; got "
            f"{[(v['verdict'], v['rank']) for v in pool] or 'none'}",
        )
    ]
    if exp.verdict == "STRAGGLER":
        checks.append(
            Check(
                "straggler not killed",
                not verdicts and not m.get("restarts"),
                "no DEAD/HUNG verdict and no restart"
                if not verdicts and not m.get("restarts")
                else f"verdicts {[(v['verdict'], v['rank']) for v in verdicts]}, restarts {m.get('restarts')}",
            )
        )
    return checks


def _attribution_checks(
    scenario: Scenario, events: list[dict[str, Any]], m: dict[str, Any]
) -> list[Check]:
    """The HUNG verdict's record names the hung rank and the collective the others wait in; with
    PyTorch's flight recorder on, every rank that answered the verdict dumped it."""
    exp, checks = scenario.expect, []
    found = [e for e in events if e["event"] == "hang_attribution" and "summary" in e]
    if found:
        m["hang_attributions"] = [e["summary"] for e in found]
    if exp.hang_rank is not None or exp.hang_collective is not None:

        def names(e: dict[str, Any]) -> bool:
            stuck = e.get("stuck", [])
            return (exp.hang_rank is None or exp.hang_rank in e.get("culprits", [])) and (
                exp.hang_collective is None
                or any(
                    s["op"] == exp.hang_collective
                    and (exp.hang_rank is None or exp.hang_rank in s["missing"])
                    for s in stuck
                )
            )

        match = [e for e in found if names(e)]
        want = " and ".join(
            x
            for x in (
                f"rank {exp.hang_rank}" if exp.hang_rank is not None else "",
                f"a {exp.hang_collective} it never entered" if exp.hang_collective else "",
            )
            if x
        )
        errors = [e["error"] for e in events if e["event"] == "hang_attribution" and "error" in e]
        checks.append(
            Check(
                "hang attributed",
                bool(match),
                (
                    match[0]["summary"]
                    if match
                    else f"no hang_attribution naming {want}; got "
                    + (repr([e["summary"] for e in found]) if found else "none")
                    + (f" (errors: {errors})" if errors else "")
                ),
            )  # fmt: skip
        )
    if _flight_recorder_on(scenario.job.env):
        dumps = [e for e in events if e["event"] == "flight_recorder"]
        missing = [e["path"] for e in dumps if e.get("path") and not Path(e["path"]).exists()]
        failed = [e["error"] for e in dumps if e.get("error")]
        ok = bool(dumps) and not missing and not failed
        checks.append(
            Check(
                "flight recorder dumped",
                ok,
                f"{len(dumps)} ranks dumped it, e.g. {dumps[0].get('path')}"
                if ok
                else f"dumps {[e.get('path') for e in dumps]}; missing {missing}; errors {failed}",
            )
        )
    return checks


def _flight_recorder_on(env: dict[str, str]) -> bool:
    raw = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    return raw.strip().isdigit() and int(raw) > 0


def _compare_final(run: RunPaths, ref: RunPaths, steps: int | None, exp: Any) -> Check:
    import torch

    from resilient import Checkpointer
    from resilient.errors import ResilientError

    name = "final state matches the reference"
    try:
        if steps is None:  # a command job: both runs' newest steps, which must be the same
            ref_step = Checkpointer(str(ref.ckpt)).latest_step()
            run_step = Checkpointer(str(run.ckpt)).latest_step()
            if ref_step is None or ref_step != run_step:
                return Check(
                    name,
                    False,
                    f"the run's newest committed step is {run_step}, the reference's "
                    f"{ref_step}: the final states of different steps are not comparable "
                    f"(did the run stop early, or commit a step the reference never reached?)",
                )
            steps = run_step
        a = gather_checkpoint(str(ref.ckpt), steps)
        b = gather_checkpoint(str(run.ckpt), steps)
        extras = _compare_extras(str(ref.ckpt), str(run.ckpt), steps, exp)
    except ResilientError as e:
        return Check(name, False, f"cannot read a final checkpoint: {e}")
    if a.keys() != b.keys():
        return Check(name, False, f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    differ, worst, why = [], {"weights": 0.0, "moments": 0.0}, ""
    for k in a:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape:
            # (torch.equal ignores the dtype: a float64 copy of a float32 weight is "equal")
            differ.append(k)
            why = why or (
                f"; {k} is {b[k].dtype} {tuple(b[k].shape)}, the reference's "
                f"{a[k].dtype} {tuple(a[k].shape)}"
            )
        elif exp.final_state == "exact":
            if not torch.equal(a[k], b[k]):
                differ.append(k)
        elif not _close(k, a[k], b[k], exp, worst):
            differ.append(k)
    step = steps if steps is not None else Checkpointer(str(run.ckpt)).latest_step()
    what = (
        "bit-identical"
        if exp.final_state == "exact"
        else f"within rtol {exp.rtol} and atol {exp.atol} (moments: {exp.moment_rtol}), in norm"
    )
    if differ:
        return Check(
            name,
            False,
            f"step {step}: {len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}{why}",
        )
    if extras:
        return Check(
            name,
            False,
            f"step {step}: tensors match, but {len(extras)} non-tensor values differ (loader "
            f"position, counters, optimizer settings: what a resumed run continues from), e.g. "
            + "; ".join(extras[:3]),
        )
    extra = (
        f" (largest relative difference in norm: weights {worst['weights']:.1e}, "
        f"moments {worst['moments']:.1e})"
        if exp.final_state == "close"
        else ""
    )
    return Check(
        name, True, f"step {step}: all {len(a)} tensors {what}{extra}, and its other values equal"
    )


# Non-tensor state that legitimately differs between a run and its reference: the processes'
# RNG states (python's and numpy's are seeded by the OS in each process; the trainer draws from
# its own seeded generators), measured different on every built-in quick scenario, faults or
# not; and the toolkit's own bookkeeping of each commit, not training state (BOOKKEEPING_KEYS:
# which memory-tier run made the commit, 2 after memory-kill-rank's restart, 1 in its reference;
# the commit it descends from, numbered by that run's own commits).
_UNCOMPARED_EXTRAS = ("rng.", *BOOKKEEPING_KEYS)


def _compare_extras(ref_url: str, run_url: str, step: int, exp: Any) -> list[str]:
    """The manifest's non-tensor values (the loader position, step and token counters, the
    optimizer's param_groups, the job's config) that differ at ``step``, as "key: value, the
    reference's value".  Rank 0's values always; other ranks' own values where both runs had the
    same layout (another layout has other ranks).  Numbers exactly, floats within rtol in
    "close"."""
    from resilient import Checkpointer

    with Checkpointer(ref_url) as ck:
        ref = ck.manifest(step)
    with Checkpointer(run_url) as ck:
        run = ck.manifest(step)

    def kept(d: Any) -> dict[str, Any]:
        return {k: v for k, v in d.items() if not k.startswith(_UNCOMPARED_EXTRAS)}

    pairs = [("", kept(ref.extras), kept(run.extras))]
    if ref.layout == run.layout:
        for r in sorted(set(ref.rank_extras) | set(run.rank_extras)):
            x, y = kept(ref.rank_extras.get(r, {})), kept(run.rank_extras.get(r, {}))
            pairs.append((f"rank {r}'s ", x, y))
    differ = []
    for who, x, y in pairs:
        for k in sorted(set(x) | set(y)):
            missing = "(absent)"
            a, b = x.get(k, missing), y.get(k, missing)
            if not _same_value(a, b, exp):
                differ.append(f"{who}{k}: {b!r}, the reference's {a!r}")
    return differ


def _same_value(a: Any, b: Any, exp: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], exp) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_value(x, y, exp) for x, y in zip(a, b))
    if isinstance(a, float) and exp.final_state == "close":
        return a == b or math.isclose(a, b, rel_tol=exp.rtol)
    return a == b


def _close(k: str, x: Any, y: Any, exp: Any, worst: dict[str, float]) -> bool:
    """Whether the run's tensor ``y`` is close to the reference's ``x``: in norm, not element by
    element.  A job that changed its layout sums its gradients in another order, and a near-tie
    in the MoE's top-k routing can then go the other way for a token, which changes that step's
    gradient a little everywhere and single elements near zero by more than any elementwise
    tolerance.  Measured on the `tiny` job shrunk from dp 2 to dp 1: such a flip at the last step
    moved the moments by up to 2.5e-3 of their norm and the weights by 1e-5; three steps apart,
    every moment differs by more than 1e-1 and half the weights by more than 1e-1.  The
    optimizer's moments are compared within ``moment_rtol`` of their own norm, with no absolute
    floor (a second moment's values are 1e-10 to 1e-5: any floor would hide it); the weights
    within ``rtol`` of theirs plus ``atol`` per element; integers, step counters (an optimizer
    state of one value) and values that are not finite exactly."""
    import torch

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if not x.numel():
        return True
    moment = k.startswith("optim.")
    if not x.is_floating_point() or (moment and x.numel() == 1):
        return torch.equal(x, y)
    x, y = x.double(), y.double()
    nan, inf = torch.isnan(x), torch.isinf(x)
    if not torch.equal(nan, torch.isnan(y)) or not torch.equal(inf, torch.isinf(y)):
        return False  # a NaN or an infinity where the reference has none (or none where it has)
    if not torch.equal(x[inf], y[inf]):
        return False
    finite = ~(nan | inf)
    x, y = x[finite], y[finite]
    ref, diff = x.norm().item(), (x - y).norm().item()
    kind = "moments" if moment else "weights"
    worst[kind] = max(worst[kind], diff / max(ref, 1e-30))
    if moment:
        return diff <= exp.moment_rtol * ref
    return diff <= exp.rtol * ref + exp.atol * x.numel() ** 0.5


def gather_checkpoint(url: str, step: int | None = None) -> dict[str, Any]:
    """Every model and optimizer tensor of a checkpoint step, whole (loaded in a world of one)."""
    import torch

    from resilient import Checkpointer, Layout
    from resilient.checkpoint.state import sharded

    with Checkpointer(url, layout=Layout(dp=1, ep=1, tp=1)) as ck:
        m = ck.manifest(step)
        state = {
            k: sharded(torch.zeros(t.shape, dtype=getattr(torch, t.dtype)), {})
            for k, t in m.tensors.items()
            if k.startswith(("model.", "optim."))
        }
        ck.load(state, step=step)
    return state


def _verify_checkpoints(
    paths: RunPaths, events: list[dict[str, Any]], *, completed: bool = True
) -> Check:
    """Every committed step verifies but those the scenario's own faults damaged.  A run that
    is to complete must leave one that verifies; one that is to fail (a scenario that damages
    every step it saves) may leave none."""
    from resilient import Checkpointer
    from resilient.errors import ResilientError

    name = "committed checkpoints verify"
    if not paths.ckpt.exists():
        return Check(name, None, "no checkpoints")
    # the durable steps the scenario's own corrupt/truncate faults damaged (a memory-tier
    # fault's step number says nothing about the durable step of that number)
    damaged = {
        e["step"]
        for e in events
        if e["event"] == "fault_detail" and e.get("tier", "durable") == "durable"
    }
    bad, good = [], []
    with Checkpointer(str(paths.ckpt)) as ck:
        catalog = ck.catalog()
        for s in catalog.steps():
            try:
                ok = ck.verify(s).ok
            except ResilientError:
                ok = False
            (good if ok else bad).append(s)
    # a step whose manifest was damaged after its commit is no longer listed as committed:
    # the catalog still has it, as damaged
    torn = {i.step: i.problem for i in catalog.damaged()}
    bad = sorted({*bad, *torn})
    unexpected = [s for s in bad if s not in damaged]
    detail = f"steps {good} verify"
    if bad:
        detail += f"; steps {bad} fail" + (
            " (damaged by the scenario itself)" if not unexpected else f"; unexpected: {unexpected}"
        )
        why = [f"step {s}: {torn[s]}" for s in unexpected if s in torn]
        if why:
            detail += f" ({'; '.join(why[:2])})"
    if not good and not bad:
        return Check(name, None, "no committed step")
    if not good and completed:
        return Check(
            name, False, detail + "; no step verifies: nothing committed is left to resume from"
        )
    return Check(name, not unexpected, detail)


def _samples_once(
    history: list[dict[str, Any]],
    steps: int | None,
    *,
    reference: list[dict[str, Any]] | None = None,
    global_batch: int | None = None,
    even: bool = False,
) -> Check:
    """Every global sample consumed exactly once in the committed history: the ids served cover
    0..total-1 once each, where the total is the steps times the global batch (the scenario's
    ``global_batch``, else the reference's first step, else the largest step's count) where
    every step serves a global batch (``even``: a trainer job); and each step served the same
    ids as the reference's step of that number, where there is a reference."""
    name = "every sample consumed exactly once"
    if not history:
        return Check(name, False, "no step recorded, so no sample either")
    unrecorded = [r.get("step") for r in history if "samples" not in r]
    if unrecorded:
        return Check(
            name,
            False,
            f"steps {unrecorded[:5]} (of {len(history)}) record no samples: the scenario expects "
            "every sample consumed exactly once, which needs each step's [first id, count] "
            "records; a job that cannot record them says samples_exactly_once = false",
        )
    seen: list[tuple[int, int]] = []
    per_step: dict[int, list[tuple[int, int]]] = {}
    for r in history:
        ranges = _sample_ranges(r.get("samples"))
        if ranges is None:
            return Check(
                name,
                False,
                f"step {r.get('step')} records samples {r.get('samples')!r}: expected "
                "[first id, count] or a list of them (one per data replica)",
            )
        per_step[r["step"]] = _merged([(a, a + n) for a, n in ranges if n])
        seen.extend((a, a + n) for a, n in ranges if n)
    if not seen:
        return Check(name, False, f"no sample in {len(history)} steps")
    seen.sort()
    total = sum(b - a for a, b in seen)
    problems = []
    if even:
        counts = {st: sum(b - a for a, b in v) for st, v in per_step.items()}
        ref_first = _sample_ranges(reference[0].get("samples")) if reference else None
        batch = (
            global_batch
            or (sum(n for _, n in ref_first) if ref_first else None)
            or max(counts.values())
        )
        short = [(st, n) for st, n in counts.items() if n != batch]
        if short:
            problems.append(
                f"steps served other than the global batch of {batch}: "
                + ", ".join(f"step {st}: {n}" for st, n in short[:3])
            )
        expected = batch * (steps if steps is not None else len(history))
    else:
        expected = total
    overlaps = [(p, q) for p, q in zip(seen, seen[1:]) if q[0] < p[1]]
    holes = [(p[1], q[0]) for p, q in zip(seen, seen[1:]) if q[0] > p[1]]
    end = max(b for _, b in seen)
    if seen[0][0] > 0:
        holes.insert(0, (0, seen[0][0]))
    if end < max(total, expected):  # ids 0..expected-1 should have been read: the rest unread
        holes.append((end, max(total, expected)))
    covered = not holes and not overlaps and total == expected
    if steps is not None:
        covered = covered and len(history) == steps
    if reference:
        ref_steps = {
            r["step"]: _merged([(a, a + n) for a, n in rs if n])
            for r in reference
            if (rs := _sample_ranges(r.get("samples"))) is not None
        }
        other = [st for st, ids in per_step.items() if ref_steps.get(st) != ids]
        if other:
            st = other[0]
            problems.append(
                f"steps {other[:5]} served other samples than the reference's, e.g. step {st}: "
                f"{per_step[st]}, the reference's {ref_steps.get(st, 'no such step')}"
            )
    if overlaps or holes or not covered or problems:
        return Check(
            name,
            False,
            f"{total} samples in {len(history)} steps (expected {expected}); repeated "
            f"{overlaps[:3]}, skipped {holes[:3]}" + "".join(f"; {p}" for p in problems),
        )
    return Check(name, True, f"samples 0..{end - 1} each once over {len(history)} steps")


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open id ranges, sorted and joined where they touch: a step's ids however the data
    replicas split them (a run in another layout splits the same ids otherwise)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _sample_ranges(v: Any) -> list[tuple[int, int]] | None:
    """A step's ``samples`` record as ``(first id, count)`` ranges: one pair, or a list of pairs
    (one per data replica, as each served them); ``None`` when it is neither."""

    def pair(p: Any) -> tuple[int, int] | None:
        ok = (
            isinstance(p, list)
            and len(p) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)
        )
        return (p[0], p[1]) if ok else None

    if (one := pair(v)) is not None:
        return [one]
    if not isinstance(v, list) or not v:
        return None
    ranges = [pair(p) for p in v]
    return None if None in ranges else ranges  # type: ignore[return-value]


_ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)")
_WRAPPERS = ("ChildFailedError", "SignalException")


def _fallback_reason(log: str) -> str:
    """Why the launcher restarted the workers instead of recovering in the job, as its log says
    (``resilient launch``'s "in-job recovery not possible (...)"), or ""."""
    for line in log.splitlines():
        if "in-job recovery not possible" in line:
            return f"; the launcher: {line.strip()[:300]}"
    return ""


def _last_error(log: str) -> str:
    """The root cause in a job's log: the last exception a worker raised, not torchrun's wrapper."""
    for line in reversed(log.splitlines()):
        m = _ERROR_LINE.search(line)
        if m and not any(w in m.group(1) for w in _WRAPPERS) and "Warning" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)}"[:500]
    return "none found in the logs"
