"""Failure detection: recovery on real torchrun jobs, detection latency at scale, monitoring cost.

Recovery trials (``--recovery-trials N``): the tiny MoE on 4 ranks (tp 2 x ep 2), one
fault per trial (SIGKILL, SIGSTOP, or a hang with a 3 s hang timeout) on a rotating rank and step,
run through the chaos harness; per trial the time from the fault to the verdict and to the first
step completed after the recovery, broken into detection, teardown and restart, start and
rendezvous, checkpoint load, and the first step (torchrun's restart), or detection, teardown,
regroup with the spare, rebuild, load and the first step (in-job recovery, ``--paths injob,...``).

Scale simulation: one real TCPStore; the leader is a real ``Monitor`` (the code every job runs);
the other N-1 ranks are lightweight simulated clients in another process, whose liveness and
progress keys a publisher refreshes every interval with batched ``multi_set``.  One simulated rank
stops; we measure the leader's scan time (batched read of 2N keys + the detector) and the time from
the stop to the verdict, in heartbeat intervals.

Overhead: the reference trainer under torchrun with monitoring on and off, in one run (median
step time).

Side by side (``--baseline TREE``): the same measurements on another checkout of the project (for
example ``git worktree add /tmp/before <commit>``) and on this one, interleaved trial by trial (each
in its own process, run from its own tree), so both see the same machine.

    python benchmarks/detection.py [--sizes 64,512,4096] [--interval 0.5] [--trials 5]
                                   [--recovery-trials 20] [--skip-scale]
    python benchmarks/detection.py --baseline /tmp/before [--recovery-trials 6] [--kinds stop,hang]
    python benchmarks/detection.py --skip-scale --recovery-trials 20 --kinds kill,stop \\
        --memory-every 1      (each trial without and with the memory tier, side by side)
    python benchmarks/detection.py --skip-scale --recovery-trials 20 --kinds kill,stop \
        --paths injob,restart --heartbeat 0.25
                              (in-job recovery with a hot spare against torchrun's restart, a
                               memory snapshot every step, side by side trial by trial)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table  # noqa: E402


def _publisher(port: int, prefix: str, world: int, interval: float, victim: int, stop, halt):
    """The N-1 simulated ranks, in their own process (as other hosts would be)."""
    import torch.distributed as dist

    from resilient.health.clocks import boot_id
    from resilient.health.heartbeat import encode_alive, encode_info, encode_progress

    client = dist.TCPStore("127.0.0.1", port, 1, False)
    step = 0
    ranks = list(range(1, world))
    # every simulated rank registers, as a monitor does when it starts
    client.multi_set(
        [f"{prefix}/info/{r}" for r in ranks], [encode_info("sim", 0, boot_id())] * len(ranks)
    )
    client.append(f"{prefix}/joined", "".join(f"{r}," for r in ranks))
    while not halt.is_set():
        now, mono = time.time(), time.monotonic()
        step += 1
        ranks = [r for r in range(1, world) if not (stop.is_set() and r == victim)]
        alive = encode_alive(mono, now)
        progress = encode_progress(step, "train", step, mono)
        client.multi_set(
            [f"{prefix}/alive/{r}" for r in ranks] + [f"{prefix}/progress/{r}" for r in ranks],
            [alive] * len(ranks) + [progress] * len(ranks),
        )
        halt.wait(interval)


def simulate(world: int, interval: float, victim: int) -> dict:
    import multiprocessing as mp

    import torch.distributed as dist

    from resilient.health import DetectorConfig, Monitor

    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    prefix = f"sim/{world}/{time.time_ns()}"
    ctx = mp.get_context("spawn")
    stop, halt = ctx.Event(), ctx.Event()
    pub = ctx.Process(
        target=_publisher, args=(server.port, prefix, world, interval, victim, stop, halt)
    )
    pub.start()
    verdicts: list[tuple[float, object]] = []
    leader_store = dist.TCPStore("127.0.0.1", server.port, 1, False)
    monitor = Monitor(
        leader_store,
        prefix,
        0,
        world,
        DetectorConfig(interval_s=interval, hang_floor_s=1e9),
        on_failure=lambda f: verdicts.append((time.time(), f)),
        kill_local=False,
    )
    try:
        warm = time.time() + max(5 * interval, 5.0)  # the publisher process starts
        while time.time() < warm:
            monitor.progress(1, "train")
            time.sleep(interval / 4)
        scan_times = []
        t_stop = time.time()
        stop.set()
        while not verdicts and time.time() - t_stop < 30 * interval:
            monitor.progress(1, "train")
            scan_times.append(monitor.last_scan_s)
            time.sleep(interval / 10)
        latency = verdicts[0][0] - t_stop if verdicts else float("inf")
        ok = bool(verdicts) and verdicts[0][1].rank == victim
        return {
            "latency_s": latency,
            "intervals": latency / interval,
            "scan_s": max(scan_times),
            "ok": ok,
        }
    finally:
        halt.set()
        monitor.close(announce=False)
        pub.join()


RECOVERY_JOB = """
name = "{name}"
description = "benchmark trial"
[job]
nproc = 4
max_restarts = 2
timeout_s = 240{spares}
[job.trainer]
tp = 2
ep = 2
steps = 24
save_every = 5
hang_timeout_s = 3.0{heartbeat}{memory}
[[faults]]
id = "fault"
kind = "{kind}"
rank = {rank}
step = {step}
[expect]
final_state = "any"
"""


def recovery_variants(memory_every: int, paths: list[str]) -> list[tuple[str, str, str]]:
    """(name suffix, [job] lines, [job.trainer] lines) of each variant a trial runs, in order.
    Paths ``restart`` alone: without the memory tier, and with it when ``memory_every``; paths
    ``injob,restart``: the same job (a memory snapshot every ``memory_every`` steps, default 1)
    under ``resilient launch --spares 1`` and under torchrun, one after the other."""
    if paths == ["restart"]:
        mem = [("_mem", "", f"\nmemory_every = {memory_every}")] if memory_every else []
        return [("", "", ""), *mem]
    memory = f"\nmemory_every = {memory_every or 1}"
    spares = {"injob": "\nspares = 1", "restart": ""}
    # torchft paths run through torchft_trial; here they only keep their place in the order
    return [(f"_{p}", spares.get(p, ""), memory) for p in paths]


def torchft_timeout(path: str) -> float | None:
    """``torchft``: torchft with a 3 s collective timeout (the trials' hang timeout: what a
    collective may wait for a slow peer before the rank is declared failed); ``torchft-1s``: 1 s.
    None: not a torchft path."""
    if not path.startswith("torchft"):
        return None
    return float(path.split("-", 1)[1].rstrip("s")) if "-" in path else 3.0


def recovery_trials(
    kinds: list[str],
    trials: int,
    out: str,
    memory_every: int = 0,
    paths: list[str] | None = None,
    heartbeat_s: float | None = None,
) -> dict[str, list[dict]]:
    """Per kind, ``trials`` real runs with one fault each; the verdict and recovery timings the
    chaos harness measured, per variant (``recovery_variants``), interleaved trial by trial."""
    from pathlib import Path

    from resilient.chaos.harness import RunPaths, launch_job
    from resilient.chaos.scenario import parse_scenario

    results: dict[str, list[dict]] = {}
    variants = recovery_variants(memory_every, paths or ["restart"])
    heartbeat = f"\nheartbeat_interval_s = {heartbeat_s}" if heartbeat_s else ""
    for kind in kinds:
        for t in range(trials):
            for suffix, spares, memory in variants:
                name = f"{kind}{suffix}-{t}"
                ft = torchft_timeout(suffix[1:])
                if ft is not None:
                    r = torchft_trial(kind, t, out, heartbeat_s or 1.0, ft, suffix[1:])
                    results.setdefault(f"{kind}{suffix}", []).append(r)
                    print(f"  {name}: recovery {r['recovery_s']}s (torchft)", flush=True)
                    continue
                text = RECOVERY_JOB.format(
                    name=name,
                    kind=kind,
                    rank=1 + t % 3,
                    step=8 + t % 5,
                    memory=memory,
                    spares=spares,
                    heartbeat=heartbeat,
                )
                scenario = parse_scenario(text, name)
                run_dir = Path(out) / name
                launch = launch_job(
                    scenario.job, RunPaths(run_dir), list(scenario.faults), say=print
                )
                (run_dir / "scenario.toml").write_text(text)  # so `resilient report` can redo it
                results.setdefault(f"{kind}{suffix}", []).append(
                    trial_result(scenario, run_dir, launch)
                )
                r = results[f"{kind}{suffix}"][-1]
                print(
                    f"  {name}: verdict {r['verdict']}, detection {r['detection_s']}, "
                    f"recovery {r['recovery_s']}s ({r['path']}), steps lost {r['steps_lost']}",
                    flush=True,
                )
    return results


def torchft_trial(
    kind: str,
    t: int,
    out: str,
    heartbeat_s: float,
    timeout_s: float = 3.0,
    path: str = "torchft",
    replicas: int = 4,
) -> dict:
    """The same fault on torchft (benchmarks/torchft_job.py): the tiny MoE data parallel over
    ``replicas`` replica groups of one rank, a lighthouse on localhost whose heartbeat timeout is
    two of our heartbeat intervals (our DEAD verdict's), collectives timing out after
    ``timeout_s``; the fault hits replica 1 + t % 3 once every replica has committed step
    8 + t % 5 in a full quorum.  Recovery: from the fault to the first step a survivor commits in
    the quorum without it (torchft goes on with the survivors at three quarters of the batch;
    nothing replaces the lost replica here)."""
    import signal

    from torchft.coordination import LighthouseServer

    run_dir = os.path.join(out, f"{kind}_{path}-{t}")
    os.makedirs(run_dir, exist_ok=True)
    victim, at_step = 1 + t % 3, 8 + t % 5
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=replicas - 1,
        join_timeout_ms=2000,
        heartbeat_timeout_ms=int(2 * heartbeat_s * 1000),
    )
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_job.py")
    logs = [open(os.path.join(run_dir, f"replica{r}.log"), "w") for r in range(replicas)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                job,
                str(r),
                str(replicas),
                lighthouse.address(),
                run_dir,
                "200",
                str(timeout_s),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs[r],
        )  # fmt: skip
        for r in range(replicas)
    ]

    def records() -> list[dict]:
        rows = []
        for r in range(replicas):
            path = os.path.join(run_dir, f"replica{r}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    rows += [json.loads(line) for line in f if line.endswith("\n")]
        return rows

    result = {"completed": False, "path": path, "recovery_s": None, "detection_s": None,
              "verdict": None, "breakdown": {}, "steps_lost": None, "restore_sources": [],
              "wrong_verdicts": 0, "restarts": 0}  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            full = [x for x in records() if x["committed"] and x["participants"] == replicas]
            if {x["replica"] for x in full if x["step"] >= at_step} == set(range(replicas)):
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a torchft replica exited early; see {run_dir}")
            time.sleep(0.01)
        else:
            raise RuntimeError(f"torchft replicas did not reach step {at_step}; see {run_dir}")
        fault_t = time.time()
        procs[victim].send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        before = max(x["step"] for x in records() if x["committed"])
        while time.monotonic() < deadline:
            after = [
                x
                for x in records()
                if x["replica"] != victim
                and x["committed"]
                and x["participants"] == replicas - 1
                and x["time"] > fault_t
            ]
            if after:
                first = min(after, key=lambda x: x["time"])
                result.update(
                    completed=True,
                    recovery_s=round(first["time"] - fault_t, 3),
                    # the step committed just now is the survivors' next: nothing rolled back
                    steps_lost=max(0, before - (first["step"] - 1)),
                )
                break
            if all(p.poll() is not None for i, p in enumerate(procs) if i != victim):
                raise RuntimeError(f"every torchft survivor exited; see {run_dir}")
            time.sleep(0.01)
    except RuntimeError as e:  # this trial did not recover: recorded, the others go on
        result["error"] = str(e)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
        lighthouse.shutdown()
    return result


def trial_result(scenario, run_dir, launch) -> dict:
    """What one trial measured: the first verdict and the first recovery."""
    from resilient.chaos.verify import verify_run

    m = verify_run(scenario, run_dir, launch, None).measurements
    rec = (m.get("recoveries") or [{}])[0]
    return {
        "completed": launch.succeeded,
        "path": rec.get("path"),
        "restarts": m.get("restarts"),
        # DEAD or HUNG verdicts on a rank the fault did not hit: false ones
        "wrong_verdicts": sum(
            1
            for v in m.get("verdicts", [])
            if v.get("verdict") in ("DEAD", "HUNG") and v.get("rank") != scenario.faults[0].rank
        ),
        "verdict": (m.get("verdicts") or [{}])[0].get("verdict"),
        "detection_s": m.get("detection_s"),
        "recovery_s": rec.get("seconds"),
        "breakdown": rec.get("breakdown", {}),
        "steps_lost": max(m.get("steps_lost") or [0]),
        "restore_sources": m.get("restore_sources", []),
    }


def reanalyze(out: str) -> dict[str, list[dict]]:
    from pathlib import Path

    from resilient.chaos.harness import load_launch
    from resilient.chaos.scenario import load_scenario

    results: dict[str, list[dict]] = {}
    dirs = sorted(
        Path(out).glob("*-*"), key=lambda d: (d.name.split("-")[0], int(d.name.split("-")[1]))
    )
    for d in dirs:
        if (d / "run.json").exists() and (d / "scenario.toml").exists():
            kind = d.name.split("-")[0]
            results.setdefault(kind, []).append(
                trial_result(load_scenario(d / "scenario.toml"), d, load_launch(d))
            )
    return results


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


PHASES = [
    "detection",
    "teardown",  # in-job: to the first healthy rank leaving the broken group
    "regroup",  # in-job: to the last rank in the new group with the spare
    "rebuild",  # in-job: the model built again
    "teardown_restart",  # restart: to the new workers' processes
    "start_rendezvous",  # restart: imports, rendezvous, the new group
    "load",
    "first_step",
    "spare_takeover",  # in-job, overlapping the others: fault to the spare given the rank
]


def recovery_table(results: dict[str, list[dict]]) -> str:
    phases = [p for p in PHASES if any(p in t["breakdown"] for ts in results.values() for t in ts)]
    rows = []
    for kind, trials in results.items():
        done = [t for t in trials if t["completed"] and t["recovery_s"] is not None]
        verdicts = [t for t in trials if t["verdict"]]
        det = [t["detection_s"] for t in verdicts if t["detection_s"] is not None]
        rec = [t["recovery_s"] for t in done]
        paths = sorted({t.get("path") or "restart" for t in done})
        cells = [
            kind,
            f"{len(done)}/{len(trials)}",
            ", ".join(f"{p} {sum(t.get('path') == p for t in done)}" for p in paths) or "-",
            f"{len(verdicts)}/{len(trials)}",
            str(sum(t.get("wrong_verdicts", 0) for t in trials)),
            f"{statistics.median(det):.2f} / {_pct(det, 0.99):.2f}" if det else "-",
            f"{statistics.median(rec):.2f} / {_pct(rec, 0.99):.2f}" if rec else "-",
        ]
        for ph in phases:
            xs = [t["breakdown"][ph] for t in done if ph in t["breakdown"]]
            cells.append(f"{statistics.median(xs):.2f}" if xs else "-")
        lost = [t.get("steps_lost", 0) for t in done]
        cells.append(f"{statistics.median(lost):.0f} / {max(lost)}" if lost else "-")
        rows.append(cells)
    table = markdown_table(
        [
            "fault",
            "recovered",
            "path",
            "verdicts",
            "wrong verdicts",
            "fault to verdict s (median / p99)",
            "fault to first step s (median / p99)",
            *[f"{p} (median s)" for p in phases],
            "steps lost (median / max)",
        ],
        rows,
    )
    return table + "\n" + _ratios(results)


def _ratios(results: dict[str, list[dict]]) -> str:
    """Per fault kind: in-job recovery's median against each other path's run beside it."""

    def med(key: str) -> float | None:
        xs = [t["recovery_s"] for t in results[key] if t["completed"] and t["recovery_s"]]
        return statistics.median(xs) if xs else None

    lines = []
    for key in results:
        if not key.endswith("_injob") or med(key) is None:
            continue
        kind, ours = key[: -len("_injob")], med(key)
        for other in results:
            if other.startswith(kind + "_") and other != key and med(other):
                path = other[len(kind) + 1 :]
                lines.append(
                    f"- {kind}: in-job {ours:.2f} s, {path} {med(other):.2f} s (median fault to "
                    f"first step): {path} / in-job = {med(other) / ours:.2f}"
                )
    return "\n".join(lines) + ("\n" if lines else "")


def _hog(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def fault_free(minutes: float, heartbeat_s: float, out: str) -> dict:
    """No false verdicts on a busy machine: the reference trainer (tiny MoE, 4 ranks, tp 2 x ep 2,
    a memory snapshot every step) under ``resilient launch --spares 1`` for ``minutes``, its
    heartbeat every ``heartbeat_s``, beside one busy process per core; then SIGTERM (the
    preemption save).  Counts what the detector and the launcher did: verdicts, stragglers,
    in-job recoveries, restarts."""
    import multiprocessing as mp
    import signal

    os.makedirs(out, exist_ok=True)
    events, metrics = os.path.join(out, "events.jsonl"), os.path.join(out, "metrics.jsonl")
    cmd = [sys.executable, "-m", "reference_trainer", "--nproc", "4", "--spares", "1",
           "--tp", "2", "--ep", "2", "--steps", "1000000", "--save-every", "100",
           "--memory-every", "1", "--heartbeat-interval-s", str(heartbeat_s),
           "--ckpt", os.path.join(out, "ckpt"), "--events", events,
           "--metrics", metrics]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    hogs = [ctx.Process(target=_hog, args=(stop,)) for _ in range(os.cpu_count() or 2)]
    for h in hogs:
        h.start()
    t0 = time.time()
    try:
        with open(os.path.join(out, "job.log"), "w") as log:
            job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                job.wait(timeout=minutes * 60)
            except subprocess.TimeoutExpired:
                pass
            t_end = time.time()
            if job.poll() is None:
                job.send_signal(signal.SIGTERM)
                try:
                    job.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
    finally:
        stop.set()
        for h in hogs:
            h.join()
    with open(events) as f:
        ev = [json.loads(line) for line in f if line.strip()]
    with open(metrics) as f:
        steps = [json.loads(line)["step_s"] for line in f if line.strip()]
    return {
        "minutes": round((time.time() - t0) / 60, 2),
        "heartbeat_s": heartbeat_s,
        "exit_code": job.returncode,
        "steps": len(steps),
        "step_s_median": round(statistics.median(steps), 3) if steps else None,
        "step_s_max": round(max(steps), 3) if steps else None,
        # before the SIGTERM that ends the run: what a healthy run should never see
        "verdicts": [e for e in ev if e["event"] == "verdict" and e["time"] < t_end],
        "stragglers": sum(1 for e in ev if e["event"] == "straggler" and e["time"] < t_end),
        "injob_recoveries": sum(1 for e in ev if e["event"] == "spare_takeover"),
        "restarts": max((int(e.get("restart", 0)) for e in ev if e["event"] == "start"), default=0),
    }


def overhead(steps: int) -> dict:
    out = {}
    for flag in ("0", "1"):
        with tempfile.TemporaryDirectory() as d:
            metrics = os.path.join(d, "m.jsonl")
            cmd = [
                sys.executable,
                "-m",
                "reference_trainer",
                "--nproc",
                "2",
                "--dp",
                "2",
                "--steps",
                str(steps),
                "--global-batch",
                "32",
                "--save-every",
                "0",
                "--ckpt",
                os.path.join(d, "ck"),
                "--metrics",
                metrics,
            ]
            subprocess.run(
                cmd,
                check=True,
                capture_output=True,
                env=dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_DETECT=flag),
            )
            rows = [json.loads(line) for line in open(metrics)][5:]
            out["on" if flag == "1" else "off"] = statistics.median(r["step_s"] for r in rows)
    return out


_SIMULATE = """
import json, sys
sys.path.insert(0, "benchmarks")
import detection
print("RESULT" + json.dumps(detection.simulate(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))))
"""

_TRIAL = """
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import detection
from resilient.chaos.harness import RunPaths, launch_job
from resilient.chaos.scenario import parse_scenario
name, kind, rank, step, out = sys.argv[1:6]
text = detection.RECOVERY_JOB.format(name=name, kind=kind, rank=rank, step=step)
scenario = parse_scenario(text, name)
run_dir = Path(out) / name
launch = launch_job(scenario.job, RunPaths(run_dir), list(scenario.faults), say=lambda *a: None)
(run_dir / "scenario.toml").write_text(text)
print("RESULT" + json.dumps(detection.trial_result(scenario, run_dir, launch)))
"""


def _in_tree(tree: str, code: str, *args: object) -> dict:
    """Run ``code`` with ``tree`` as the working directory (so it imports that tree's packages,
    and the jobs it launches do too); returns the JSON it printed after RESULT."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=tree,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"{tree}: no result (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT") :])


def compare(args: argparse.Namespace) -> None:
    """The baseline tree and this one, trial by trial, alternating which goes first."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": os.path.abspath(args.baseline), "after": here}
    print(f"machine: {machine()}")
    print(f"before: {trees['before']}\nafter:  {trees['after']}\n")
    if args.recovery_trials:
        out = args.out or tempfile.mkdtemp(prefix="detection-compare-")
        results: dict[str, dict[str, list[dict]]] = {"before": {}, "after": {}}
        for kind in args.kinds.split(","):
            for t in range(args.recovery_trials):
                order = ["before", "after"] if t % 2 == 0 else ["after", "before"]
                for label in order:
                    name = f"{kind}-{t}"
                    res = _in_tree(
                        trees[label], _TRIAL, name, kind, 1 + t % 3, 8 + t % 5, f"{out}/{label}"
                    )
                    results[label].setdefault(kind, []).append(res)
                    print(
                        f"  {label} {name}: verdict {res['verdict']}, detection "
                        f"{res['detection_s']}, recovery {res['recovery_s']}s",
                        flush=True,
                    )
        with open(os.path.join(out, "compare.json"), "w") as f:
            json.dump(results, f, indent=1)
        for label in ("before", "after"):
            print(f"\n{label}:")
            print(recovery_table(results[label]))
    if args.skip_scale:
        return
    rows = []
    for world in map(int, args.sizes.split(",")):
        got: dict[str, list[dict]] = {"before": [], "after": []}
        for t in range(args.trials):
            order = ["before", "after"] if t % 2 == 0 else ["after", "before"]
            for label in order:
                got[label].append(
                    _in_tree(trees[label], _SIMULATE, world, args.interval, world // 2 + t)
                )
        for label in ("before", "after"):
            trials = got[label]
            assert all(x["ok"] for x in trials), (label, trials)
            lat = sorted(x["intervals"] for x in trials)
            rows.append(
                [
                    str(world),
                    label,
                    str(len(trials)),
                    f"{statistics.median(lat):.2f}",
                    f"{lat[-1]:.2f}",
                    f"{max(x['scan_s'] for x in trials) * 1e3:.1f}",
                ]
            )
        print(f"  {world} ranks done", flush=True)
    print(f"\nheartbeat interval {args.interval}s, DEAD after 2 intervals")
    print(
        markdown_table(
            [
                "simulated ranks",
                "code",
                "trials",
                "detection (intervals), median",
                "worst",
                "leader scan ms (worst)",
            ],
            rows,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="64,512,4096")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--recovery-trials", type=int, default=0)
    p.add_argument(
        "--memory-every",
        type=int,
        default=0,
        help="also run every recovery trial with the memory tier (a snapshot every N steps)",
    )
    p.add_argument("--kinds", default="kill,stop,hang")
    p.add_argument(
        "--paths",
        default="restart",
        help="recovery paths to run each trial through: restart (torchrun), or injob and any of "
        "restart, torchft, torchft-1s (resilient launch --spares 1, torchrun, torchft 0.2.0 with "
        "a 3 s or 1 s collective timeout; side by side, trial by trial; a memory snapshot every "
        "step unless --memory-every says otherwise)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=None,
        help="the trainer's heartbeat interval in the recovery trials (default: its own, 1 s)",
    )
    p.add_argument("--skip-scale", action="store_true")
    p.add_argument(
        "--fault-free",
        type=float,
        default=0,
        metavar="MINUTES",
        help="run the trainer (4 ranks, resilient launch --spares 1) this long beside one busy "
        "process per core, at --heartbeat (default 0.25 s), and count its verdicts",
    )
    p.add_argument(
        "--reanalyze", default=None, help="verify the trials under this directory again, no runs"
    )
    p.add_argument("--out", default=None, help="where the recovery trials' runs go (default: tmp)")
    p.add_argument(
        "--baseline",
        default=None,
        help="another checkout: measure it and this one side by side, trial by trial",
    )
    args = p.parse_args()
    if args.baseline:
        compare(args)
        return
    if args.fault_free:
        out = args.out or tempfile.mkdtemp(prefix="detection-fault-free-")
        r = fault_free(args.fault_free, args.heartbeat or 0.25, out)
        with open(os.path.join(out, "fault_free.json"), "w") as f:
            json.dump(r, f, indent=1)
        print(f"machine: {machine()}; {json.dumps({**r, 'verdicts': len(r['verdicts'])})}")
        for v in r["verdicts"]:
            print(f"  verdict: {v.get('verdict')} rank {v.get('rank')}: {v.get('detail')}")
        return
    if args.reanalyze:
        print(recovery_table(reanalyze(args.reanalyze)))
        return
    if args.recovery_trials:
        out = args.out or tempfile.mkdtemp(prefix="detection-bench-")
        paths = args.paths.split(",")
        try:
            bad = [x for x in paths if x not in ("injob", "restart") and torchft_timeout(x) is None]
        except ValueError:
            bad = paths
        if bad or (paths != ["restart"] and "injob" not in paths):
            p.error(f"--paths {args.paths}: restart, or injob with any of restart, torchft[-Ns]")
        if any(torchft_timeout(x) for x in paths) and not set(args.kinds.split(",")) <= {
            "kill",
            "stop",
        }:
            p.error("torchft paths take --kinds kill,stop (the torchft job has no hang injector)")
        results = recovery_trials(
            args.kinds.split(","),
            args.recovery_trials,
            out,
            args.memory_every,
            paths,
            args.heartbeat,
        )
        with open(os.path.join(out, "recovery.json"), "w") as f:
            json.dump(results, f, indent=1)
        print(
            f"\nmachine: {machine()}; tiny MoE, 4 ranks (tp 2 x ep 2), heartbeat "
            f"{args.heartbeat or 1.0} s; in-job: resilient launch --spares 1; restart: torchrun"
        )
        print(recovery_table(results))
    if args.skip_scale:
        return
    rows = []
    for world in map(int, args.sizes.split(",")):
        trials = [simulate(world, args.interval, victim=world // 2 + t) for t in range(args.trials)]
        assert all(t["ok"] for t in trials), trials
        lat = sorted(t["intervals"] for t in trials)
        rows.append(
            [
                str(world),
                str(len(trials)),
                f"{statistics.median(lat):.2f}",
                f"{lat[-1]:.2f}",
                f"{max(t['scan_s'] for t in trials) * 1e3:.1f}",
            ]
        )
        print(f"  {world} ranks: median {statistics.median(lat):.2f} intervals", flush=True)
    print()
    print(f"machine: {machine()}; heartbeat interval {args.interval}s, DEAD after 2 intervals")
    print(
        markdown_table(
            [
                "simulated ranks",
                "trials",
                "detection (intervals), median",
                "worst",
                "leader scan ms (worst)",
            ],
            rows,
        )
    )
    o = overhead(args.steps)
    print(
        f"\nmonitoring overhead (2 ranks, tiny preset, median step time): off {o['off'] * 1e3:.2f} ms, "
        f"on {o['on'] * 1e3:.2f} ms ({100 * (o['on'] / o['off'] - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
