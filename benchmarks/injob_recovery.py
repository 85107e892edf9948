"""In-job recovery against a restart, side by side in one run: fault to the first step after it.

Each trial runs ``tests/injob_job.py`` (2 gloo ranks, ``@fault_tolerant``, a memory snapshot every
step, durable saves every 5) under ``resilient launch`` twice, interleaved: with a spare (in-job
recovery: the healthy rank stays, the spare takes the killed rank) and without (``--spares 0
--max-restarts 1``: every worker restarts, as under torchrun).  Rank 1 SIGKILLs itself after a
rotating step.  From the job's event log: the fault (rank 1's last step end, approximated by rank
0's first failed collective for in-job, by the restart's first event otherwise) to the first step
completed after recovery, and steps lost.

    python benchmarks/injob_recovery.py [--trials 4] [--steps 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table, median, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "injob_job.py")
MODES = {
    "in-job (1 spare)": ["--spares", "1"],
    "restart (no spare)": ["--spares", "0", "--max-restarts", "1"],
}


def trial(root: str, mode: str, kill_step: int, steps: int) -> dict[str, float]:
    out = tempfile.mkdtemp(dir=root)
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "OMP_NUM_THREADS": "1",
        "INJOB_KILL": f"1:{kill_step}",
        "RESILIENT_MEMORY_ROOT": tempfile.mkdtemp(
            dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ),
    }
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--nproc-per-node", "2", *MODES[mode],
           JOB, f"{out}/ckpt", str(steps), f"{out}/out.json"]  # fmt: skip
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise SystemExit(f"{mode} trial failed ({p.returncode}):\n{p.stderr[-4000:]}")
        with open(f"{out}/ckpt/events.jsonl") as f:
            ev = [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(env["RESILIENT_MEMORY_ROOT"], ignore_errors=True)
    t = lambda e: float(e["time"])  # noqa: E731
    # the fault: rank 1's process died right after step kill_step; its monitor's last beat is
    # within an interval of it; the survivor's failed collective (in-job) or the verdict marks it
    marks = [t(e) for e in ev if e["event"] in ("error", "verdict", "injob_leave")]
    fault = min(marks)
    restore = [e for e in ev if e["event"] == "restore" and t(e) > fault]
    first = min(t(e) for e in ev if e["event"] == "first_step" and t(e) > fault)
    # the rank dies before step kill_step's update: kill_step - 1 steps were completed
    lost = kill_step - 1 - (int(restore[0]["step"]) if restore else 0)
    return {"fault_to_first_step_s": first - fault, "steps_lost": lost}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="injob-bench-")
    res: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for i in range(a.trials):
            k = 7 + i % 6
            for mode in MODES:
                r = trial(root, mode, k, a.steps)
                res[mode].append(r)
                print(f"trial {i} kill after step {k} {mode}: {r}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for mode, rs in res.items():
        f = sorted(r["fault_to_first_step_s"] for r in rs)
        rows.append([mode, str(len(rs)), f"{median(f):.2f}", f"{f[-1]:.2f}",
                     f"{median([r['steps_lost'] for r in rs]):g}", f"{max(r['steps_lost'] for r in rs):g}"])  # fmt: skip
    print(machine())
    print(
        markdown_table(
            [
                "path",
                "trials",
                "fault to first step, median s",
                "max s",
                "steps lost median",
                "max",
            ],
            rows,
        )
    )
    if a.json:
        write_results(a.json, {"machine": machine(), "results": res})


if __name__ == "__main__":
    main()
