"""The fork server's host forking the server from the launcher (this tree) against a tree where it
starts the server as a new interpreter, side by side in one run.

Each round runs one chaos scenario (default ``memory-kill-rank``: 4 ranks of the tiny MoE on one
torchrun agent, a fault-free reference run, then the run with a rank SIGKILLed and the workers
restarted) from each tree, the order alternating from round to round, with ``OMP_NUM_THREADS=1``
(as the test suite has it: the host forks the server only where it is set).  Per run: the wall
time of ``resilient chaos run`` and the CPU (user + sys) of every process it started, read from
``/proc`` every 0.1 s (each process's last reading: a forked server leaves by ``os._exit``, so an
``atexit`` hook would miss it), in all and for the launcher, the server and the ranks (all but the
harness, the workers' stand-ins and the persister).

With ``--trainer`` each round runs ``python -m reference_trainer --nproc 2`` instead (the tiny
preset, 2 data-parallel ranks, 8 steps, a save every 4): ``resilient launch --preload`` forking
the server from the launcher itself, against a tree where it starts a new interpreter.

Usage: ``python benchmarks/fork_host.py --other /path/to/other/tree [--rounds 3]
[--scenario memory-kill-rank | --trainer]``
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK")


def _table() -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, CPU seconds, command line) for every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, cmd)
    return out


def _run(tree: Path, scenario: str | None, tmp: Path) -> dict:
    """One run of ``scenario`` (None: the trainer's ``--nproc 2``) from ``tree``."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    if scenario is None:
        cmd = [sys.executable, "-m", "reference_trainer", "--nproc", "2", "--dp", "2"]
        cmd += ["--steps", "8", "--save-every", "4", "--ckpt", str(out / "ckpt")]
    else:
        path = tree / "resilient" / "chaos" / "scenarios" / f"{scenario}.toml"
        cmd = [sys.executable, "-m", "resilient.cli", "chaos", "run", str(path), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    seen: dict[int, tuple[float, str]] = {}
    while proc.poll() is None:
        table, family = _table(), {proc.pid}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _, _) in table.items():
                if ppid in family and pid not in family:
                    family.add(pid)
                    grew = True
        for pid in family & table.keys():
            seen[pid] = (table[pid][1], table[pid][2] or seen.get(pid, (0, ""))[1])
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    text = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"{scenario} failed in {tree}:\n{text[-3000:]}")
    by = collections.Counter()
    for cpu, cmdline in seen.values():
        head = " ".join(a for a in cmdline.split()[1:5] if a != "-u")  # (the process's own)
        other = ("-m resilient.cli chaos", "-m resilient.forkserver run", "-c from resilient")
        by["other" if head.startswith(other) else "host"] += cpu
    return {"wall": wall, "cpu": sum(c for c, _ in seen.values()), "host": by["host"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="the other tree (a git worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scenario", default="memory-kill-rank")
    ap.add_argument("--trainer", action="store_true", help="the trainer's --nproc 2 instead")
    args = ap.parse_args()
    job = None if args.trainer else args.scenario
    trees = {"this tree": HERE, "other": Path(args.other).resolve()}
    got: dict[str, list[dict]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                got[name].append(_run(trees[name], job, Path(d)))
                g = got[name][-1]
                print(f"round {r + 1} {name}: wall {g['wall']:.1f} s, CPU {g['cpu']:.1f} s "
                      f"(launcher, server, ranks {g['host']:.1f} s)", flush=True)  # fmt: skip
    print(
        f"\n| tree | wall s (median) | CPU s (median) | launcher, server and ranks: CPU s "
        f"| {job or 'reference_trainer --nproc 2'} |"
    )
    print("|---|---|---|---|---|")
    for name, rows in got.items():
        med = {k: statistics.median(x[k] for x in rows) for k in ("wall", "cpu", "host")}
        each = ", ".join(f"{x['cpu']:.1f}" for x in rows)
        print(f"| {name} | {med['wall']:.1f} | {med['cpu']:.1f} ({each}) | {med['host']:.1f} | |")


if __name__ == "__main__":
    main()
