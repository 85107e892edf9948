"""Failure detection: detection latency at scale, and the cost of monitoring.

Scale simulation: one real TCPStore; the leader is a real ``Monitor`` (the code every job runs);
the other N-1 ranks are lightweight simulated clients whose liveness and progress keys a publisher
thread refreshes every interval with batched ``multi_set``.  One simulated rank stops; we measure
the leader's scan time (batched read of 2N keys + the detector) and the time from the stop to the
verdict, in heartbeat intervals.

Overhead: the reference trainer under torchrun with monitoring on and off, in one run (median
step time).

    python benchmarks/detection.py [--sizes 64,512,4096] [--interval 0.5] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table  # noqa: E402


def simulate(world: int, interval: float, victim: int) -> dict:
    import torch.distributed as dist

    from resilient.health import DetectorConfig, Monitor
    from resilient.health.heartbeat import encode_progress

    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    prefix = f"sim/{world}/{time.time_ns()}"
    stopped = threading.Event()
    halt = threading.Event()
    stop_time = [0.0]

    def publisher() -> None:
        client = dist.TCPStore("127.0.0.1", server.port, 1, False)
        step = 0
        while not halt.is_set():
            now = time.time()
            step += 1
            ranks = [r for r in range(1, world) if not (stopped.is_set() and r == victim)]
            progress = encode_progress(step, "train", now, "sim", 0)
            client.multi_set(
                [f"{prefix}/alive/{r}" for r in ranks] + [f"{prefix}/progress/{r}" for r in ranks],
                [str(now)] * len(ranks) + [progress] * len(ranks),
            )
            halt.wait(interval)

    pub = threading.Thread(target=publisher, daemon=True)
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
        warm = time.time() + 5 * interval
        while time.time() < warm:
            monitor.progress(1, "train")
            time.sleep(interval / 4)
        scan_times = []
        t_stop = time.time()
        stop_time[0] = t_stop
        stopped.set()
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


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="64,512,4096")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
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
