"""Ranks forked from a fork server against ranks started the usual way, side by side in one run.

Each round runs one chaos scenario (default ``kill-rank``: 4 ranks of the tiny MoE on one torchrun
agent, a fault-free reference run, then the run with a rank SIGKILLed and the workers restarted)
twice, with ranks forked from the node's fork server (``resilient/forkserver.py``) and with
``RESILIENT_FORK_RANKS=0`` (each rank its own interpreter, as plain torchrun starts them), the
order alternating from round to round.  Per run:

- the wall time of ``resilient chaos run`` (reference and faulty run, verification);
- the CPU (user + sys) of every process of it, each read by the process itself at exit (a
  ``sitecustomize`` on ``PYTHONPATH``: a fork server's ranks are not their launcher's children,
  so ``getrusage(RUSAGE_CHILDREN)`` would miss them; a rank killed by the fault reports nothing,
  in both kinds of run), in all and for the ranks alone;
- the recovery: the scenario's own figure, from the fault to the first step after the restart.

Usage: ``python benchmarks/fork_ranks.py [--rounds 3] [--scenario kill-rank]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

_SITE = """
import atexit, os, resource, sys
def _dump():
    r = resource.getrusage(resource.RUSAGE_SELF)
    with open(os.environ["FORK_BENCH_CPU"], "a") as f:
        f.write(f"{r.ru_utime + r.ru_stime:.4f} {' '.join(sys.argv)[:200]}\\n")
atexit.register(_dump)
"""


def _run(scenario: Path, forked: bool, tmp: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=tmp))
    cpu = out / "cpu.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "site"), str(HERE), env.get("PYTHONPATH", "")])
    env["FORK_BENCH_CPU"] = str(cpu)
    env["RESILIENT_FORK_RANKS"] = "1" if forked else "0"
    cmd = [sys.executable, "-m", "resilient.cli", "chaos", "run", str(scenario), "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{scenario.name} failed (forked={forked}):\n{done.stdout[-3000:]}")
    lines = [line.split(" ", 1) for line in cpu.read_text().splitlines()]
    total = sum(float(c) for c, _ in lines)
    ranks = [
        float(c) for c, argv in lines if argv.split()[0].endswith("reference_trainer/__main__.py")
    ]
    report = json.loads(next(out.glob("*/report.json")).read_text())
    recovery = None
    for check in report["checks"]:
        m = re.search(r"([\d.]+)s from fault to the first step", str(check.get("detail", "")))
        if m:
            recovery = float(m.group(1))
    return {"wall": wall, "cpu": total, "rank_cpu": ranks, "recovery": recovery}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenario", default="kill-rank")
    args = p.parse_args()
    scenario = HERE / "resilient" / "chaos" / "scenarios" / f"{args.scenario}.toml"
    tmp = Path(tempfile.mkdtemp(prefix="fork-bench-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(_SITE)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for forked in (True, False) if r % 2 == 0 else (False, True):
            got = _run(scenario, forked, tmp)
            runs[forked].append(got)
            kind = "forked" if forked else "usual "
            print(
                f"round {r + 1} {kind}: wall {got['wall']:.1f} s, CPU {got['cpu']:.1f} s, "
                f"rank CPU median {statistics.median(got['rank_cpu']):.2f} s "
                f"({len(got['rank_cpu'])} ranks), recovery {got['recovery']} s",
                flush=True,
            )
    print(f"\n{args.scenario}, {args.rounds} rounds, medians:")
    print("| ranks started | wall s | CPU s, all processes | CPU s per rank | recovery s |")
    print("|---|---|---|---|---|")
    for forked in (False, True):
        rs = runs[forked]
        med = statistics.median
        print(
            f"| {'forked from the fork server' if forked else 'each its own interpreter'} | "
            f"{med(r['wall'] for r in rs):.1f} | {med(r['cpu'] for r in rs):.1f} | "
            f"{med(c for r in rs for c in r['rank_cpu']):.2f} | "
            f"{med(r['recovery'] for r in rs if r['recovery'] is not None):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
