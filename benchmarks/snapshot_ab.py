"""A memory snapshot's fixed cost, this tree against another one, interleaved in one run.

Two measurements, each run alternately with each tree (``PYTHONPATH``) so that the machine's
moods fall on both alike:

- ``small``: one process, a small state (92 fp32 tensors, 1 MB in all, as the tiny preset's,
  plus a 625-int list as a Python RNG state is), ``--small-snapshots`` snapshots from the call to
  the commit; CPU and wall time per snapshot.
- ``trainer``: the reference trainer, ``--preset`` on 2 ranks (dp 2), ``--steps`` steps, with no
  snapshots (this tree) and with a snapshot every step (each tree); the median time between two
  steps after the first ``--skip`` (the persister's start-up is over by then), and the median of
  the step's own compute time; per tree, the median of the rounds' ratios to the run without
  snapshots of the same round (the machine's mood changes from run to run more than the
  difference to resolve).

- ``--blocks`` (instead of ``trainer``): per tree and round, one run of the reference trainer with
  a snapshot every step in every other block of ``--block`` steps (benchmarks/snapshot_blocks.py,
  this checkout's, over each tree's library and trainer); per tree, the median of the runs'
  ratios of the steps with snapshots to those without.  Steadier than separate runs.

Usage: ``python benchmarks/snapshot_ab.py --other /path/to/a/checkout [--rounds 4] [--blocks]
[--commit-every 0] [--two-nodes]``
(make a checkout of another commit with ``git worktree add /tmp/base <commit>``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SMALL = """
import os, sys, tempfile, time, torch
shm = tempfile.mkdtemp(dir=sys.argv[2])
os.environ["RESILIENT_MEMORY_ROOT"] = shm
from resilient import Checkpointer
g = torch.Generator().manual_seed(0)
state = {f"l{i}.w": torch.randn(2**20 // 4 // 92, generator=g) for i in range(92)}
state["rng"] = list(range(625))
ck = Checkpointer(os.path.join(tempfile.mkdtemp(dir=sys.argv[3]), "ckpt"), memory_every=1,
                  persister=False, **({"memory_commit_every": int(sys.argv[4])}
                                      if sys.argv[4] != "1" else {}))
for step in range(1, 31):
    ck.snapshot(step, state).wait()
n = int(sys.argv[1])
c0, t0 = time.process_time(), time.perf_counter()
for step in range(31, 31 + n):
    ck.snapshot(step, state).wait()
print((time.process_time() - c0) / n, (time.perf_counter() - t0) / n)
ck.release_memory()
ck.close()
import shutil
shutil.rmtree(shm, ignore_errors=True)
"""


def small(tree: str, args, tmp: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _SMALL,
            str(args.small_snapshots),
            args.shm,
            tmp,
            str(args.commit_every),
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    ).stdout.split()
    return float(out[-2]), float(out[-1])


def trainer(tree: str, args, tmp: str, snapshots: bool) -> tuple[float, float]:
    d = tempfile.mkdtemp(dir=tmp)
    memory = tempfile.mkdtemp(dir=args.shm)
    env = {
        **os.environ,
        "PYTHONPATH": tree,
        "OMP_NUM_THREADS": "1",
        "RESILIENT_MEMORY_ROOT": memory,
    }
    cmd = [
        sys.executable, "-m", "reference_trainer", "--nproc", "2", "--dp", "2",
        "--preset", args.preset, "--steps", str(args.steps), "--ckpt", d + "/ckpt",
        "--metrics", d + "/metrics.jsonl", *(["--memory-every", "1"] if snapshots else []),
    ]  # fmt: skip
    try:
        subprocess.run(cmd, env=env, capture_output=True, check=True, cwd=tree)
        with open(d + "/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f if line.strip()][args.skip :]
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    times = [r["wall_time"] for r in rows]
    gap = statistics.median(b - a for a, b in zip(times, times[1:]))
    return gap, statistics.median(r["compute_s"] for r in rows)


def blocks(tree: str, args, tmp: str) -> tuple[float, float]:
    """One run of benchmarks/snapshot_blocks.py (this checkout's) over ``tree``'s library and
    trainer: the median step with a snapshot every step, and without, in the same run."""
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    from snapshot_blocks import run_blocks

    memory = tempfile.mkdtemp(dir=args.shm)
    try:
        res = run_blocks(
            tempfile.mkdtemp(dir=tmp),
            preset=args.preset,
            steps=args.block_steps,
            block=args.block,
            skip=args.skip,
            tree=tree,
            env={"RESILIENT_MEMORY_ROOT": memory},
            commit_every=args.commit_every,
            split_nodes=args.two_nodes,
        )
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return res["on"], res["off"]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--other", required=True, help="a checkout of the tree to compare with")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--small-snapshots", type=int, default=400)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=40, help="steps dropped at the start of a run")
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument(
        "--blocks",
        action="store_true",
        help="measure the trainer with snapshots on and off in alternate blocks of steps within "
        "each run (benchmarks/snapshot_blocks.py: --block-steps steps, blocks of --block), one "
        "run per tree and round, instead of separate runs with and without snapshots",
    )
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--block-steps", type=int, default=400)
    p.add_argument(
        "--commit-every",
        type=int,
        default=1,
        help="memory_commit_every of the small state's checkpointer and the trainer's "
        "--memory-commit-every under --blocks (0: sealed snapshots; both trees must have it)",
    )
    p.add_argument(
        "--two-nodes",
        action="store_true",
        help="under --blocks: each rank's memory tier under a root of its own, so each rank "
        "stands for a node (every snapshot committed and sent to the other as its peer replica)",
    )
    args = p.parse_args()
    trees = {"this tree": HERE, "other tree": os.path.abspath(args.other)}
    res: dict[str, list] = {}
    tmp = tempfile.mkdtemp(prefix="snapshot-ab-")
    try:
        for r in range(args.rounds):
            for name, tree in trees.items():
                cpu, wall = small(tree, args, tmp)
                res.setdefault(f"small, {name}", []).append((cpu, wall))
            if args.skip_trainer:
                continue
            if args.blocks:
                for name, tree in trees.items():
                    res.setdefault(f"blocks, {name}", []).append(blocks(tree, args, tmp))
                print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
                continue
            res.setdefault("trainer, no snapshots", []).append(trainer(HERE, args, tmp, False))
            for name, tree in trees.items():
                res.setdefault(f"trainer, a snapshot every step, {name}", []).append(
                    trainer(tree, args, tmp, True)
                )
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"other tree: {trees['other tree']}; {args.rounds} rounds")
    for name, rows in res.items():
        a = ", ".join(f"{x * 1e3:.1f}" for x, _ in rows)
        b = ", ".join(f"{y * 1e3:.1f}" for _, y in rows)
        first, second = (
            ("CPU", "wall")
            if name.startswith("small")
            else ("with snapshots", "without")
            if name.startswith("blocks")
            else ("gap", "compute")
        )
        print(f"{name}: {first} ms [{a}] (median {statistics.median(x for x, _ in rows) * 1e3:.1f}); "
              f"{second} ms [{b}]")  # fmt: skip
    for name in trees:
        rows = res.get(f"blocks, {name}")
        if rows:
            ratios = [on / off for on, off in rows]
            print(f"blocks, {name}: with vs without snapshots in the same run, per round "
                  f"[{', '.join(f'{r:.3f}' for r in ratios)}], median "
                  f"{(statistics.median(ratios) - 1) * 100:+.1f}%")  # fmt: skip
    base = res.get("trainer, no snapshots")
    for name in trees:
        rows = res.get(f"trainer, a snapshot every step, {name}")
        if base and rows:
            ratios = [g / b[0] for (g, _), b in zip(rows, base)]
            print(f"trainer, {name}: gap vs no snapshots, per round "
                  f"[{', '.join(f'{r:.3f}' for r in ratios)}], median "
                  f"{(statistics.median(ratios) - 1) * 100:+.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
