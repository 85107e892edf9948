"""A starved heartbeat against a dead rank: the false DEAD verdicts the detector avoids, and the
real ones it still gives in time.

Two processes heartbeat through one TCPStore: the leader (rank 0, this process) and rank 1 (a
child), every 0.2 s, DEAD after 2 intervals (0.4 s).  Each case runs side by side with the
detector's running timeout off (``running_dead_after_intervals`` = ``dead_after_intervals``: a
running process gets no more time, as before) and on (10 intervals, 2 s, the default):

* ``compute``: rank 1's main thread holds the interpreter lock for H s in one C call (a sort of a
  list of floats), so its heartbeat thread cannot run; the rank is healthy, so a verdict is false.
* ``stuck``: rank 1's main thread holds the lock asleep (``usleep`` through ``ctypes.PyDLL``) for
  H s: no thread of it runs or uses CPU, which is how a deadlocked rank looks; a verdict is right.
* ``kill``: rank 1 is SIGKILLed while the leader's own main thread holds the lock asleep in bursts
  of H s (a starved leader): the time from the kill to the verdict.

    python benchmarks/starvation.py [--holds 0.3,0.8,1.5,3] [--trials 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table, write_results  # noqa: E402

INTERVAL, DEAD_AFTER = 0.2, 2.0

CHILD = """
import ctypes, random, sys, time
import torch.distributed as dist
from resilient.health import DetectorConfig, Monitor

port, prefix, running, kind, hold = sys.argv[1:6]
hold = float(hold)
config = DetectorConfig(interval_s={interval}, dead_after_intervals={dead},
                        running_dead_after_intervals=float(running))
data, n = [], 200_000
for _ in range(3 if kind == "compute" else 0):  # size one sort to last about ``hold`` seconds
    data = [random.random() for _ in range(n)]
    copy = list(data)
    t0 = time.perf_counter(); copy.sort(); took = time.perf_counter() - t0
    n = int(n * hold / took)
data = [random.random() for _ in range(n)] if kind == "compute" else []
store = dist.TCPStore("127.0.0.1", int(port), 2, False)
m = Monitor(store, prefix, 1, 2, config, kill_local=False, on_failure=lambda f: None)


def beat_for(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m.progress(step[0], "train")
        step[0] += 1
        time.sleep(0.05)


step = [1]
beat_for(1.5)
t0 = time.perf_counter()
if kind == "compute":
    data.sort()  # one C call: the interpreter lock is never released
elif kind == "stuck":
    ctypes.PyDLL(None).usleep(int(hold * 1e6))
held = time.perf_counter() - t0
beat_for(1.5 if kind != "kill" else 600)
print("held", held, flush=True)
m.close()
"""


def _trial(store, port: int, prefix: str, running: float, kind: str, hold: float) -> dict:
    from resilient.health import DetectorConfig, Monitor

    config = DetectorConfig(
        interval_s=INTERVAL, dead_after_intervals=DEAD_AFTER, running_dead_after_intervals=running
    )
    verdicts: list[tuple[float, object]] = []
    leader = Monitor(
        store,
        prefix,
        0,
        2,
        config,
        kill_local=False,
        on_failure=lambda f: verdicts.append((time.monotonic(), f)),
    )
    code = CHILD.format(interval=INTERVAL, dead=DEAD_AFTER)
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(port), prefix, str(running), kind, str(hold)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out: dict = {"kind": kind, "hold_s": hold, "running_intervals": running}
    try:
        joined = time.monotonic() + 120
        while 1 not in leader._cache and time.monotonic() < joined:
            leader.progress(1, "train")
            time.sleep(0.05)
        if kind == "kill":
            time.sleep(1.0)
            child.kill()
            child.wait()
            killed = time.monotonic()
            usleep = ctypes.PyDLL(None).usleep
            while not verdicts and time.monotonic() - killed < 30:
                usleep(int(hold * 1e6))  # the leader's main thread holds the lock asleep
                time.sleep(0.01)
            out["verdict_after_s"] = verdicts[0][0] - killed if verdicts else None
        else:
            while child.poll() is None:
                leader.progress(1, "train")
                time.sleep(0.05)
            held = [line for line in child.stdout.read().splitlines() if line.startswith("held")]
            out["held_s"] = float(held[0].split()[1]) if held else None
            out["verdict"] = bool(verdicts)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        leader.close()
    return out


def main() -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--holds", default="0.3,0.8,1.5,3")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    holds = [float(h) for h in args.holds.split(",")]
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False)
    results, n = [], 0
    for kind in ("compute", "stuck", "kill"):
        for hold in holds:
            for _ in range(args.trials):
                for running in (DEAD_AFTER, 10.0):  # off and on, interleaved
                    n += 1
                    r = _trial(client, server.port, f"bench/{n}", running, kind, hold)
                    results.append(r)
                    print(r, flush=True)
    rows = []
    for kind in ("compute", "stuck", "kill"):
        for hold in holds:
            row = [kind, f"{hold:g}"]
            for running in (DEAD_AFTER, 10.0):
                rs = [
                    r
                    for r in results
                    if (r["kind"], r["hold_s"], r["running_intervals"]) == (kind, hold, running)
                ]
                if kind == "kill":
                    lat = [r["verdict_after_s"] for r in rs if r["verdict_after_s"] is not None]
                    row.append(
                        f"{statistics.median(lat):.2f} s ({len(lat)}/{len(rs)})" if lat else "none"
                    )
                else:
                    held = [r["held_s"] for r in rs if r.get("held_s") is not None]
                    row.append(
                        f"{sum(r['verdict'] for r in rs)}/{len(rs)} (held {max(held):.2f} s)"
                        if held
                        else f"{sum(r['verdict'] for r in rs)}/{len(rs)}"
                    )
            rows.append(row)
    print(f"\nmachine: {machine()}")
    print(f"heartbeat {INTERVAL} s, DEAD after {DEAD_AFTER:g} intervals; a running rank: 10\n")
    print(
        markdown_table(
            [
                "case",
                "hold s",
                "running timeout off: verdicts (kill: s to verdict)",
                "on (2 s)",
            ],
            rows,
        )
    )
    write_results(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
