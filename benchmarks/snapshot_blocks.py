"""A snapshot every step against none, inside one training run: the reference trainer with the
memory tier, its snapshots switched on and off in alternate blocks of steps.

Two runs of the same job on this machine differ by more than the effect to measure (the tiny
preset's median step ranged from 28 to 33 ms between runs without snapshots in one sitting, and a
round's ratio of a run with snapshots to one without from 1.04 to 1.33). Here the two kinds share
the processes, the placement on the cores, and the minutes: blocks of ``--block`` steps alternate,
starting without snapshots, and each step's time is filed under the kind of the block it belongs
to. The first two steps of each block are dropped (the snapshot before a block's first step, or
its commit, belongs to the kind before it).

The switch is a hook that sets ``Run.memory_every`` at each step (1, or None for no snapshot);
the tier itself (its directory, the persister process, the worker thread) stays up throughout, as
in any run with the tier. This patches nothing in the library.

With ``--part staged`` or ``--part checksummed`` every snapshot is cut short as
benchmarks/snapshot_parts.py does: what the caller's part alone costs, measured the same way.

Run by ``benchmarks/memory_tier.py --trainer-blocks N [--block-part staged]``, under ``resilient launch`` with the
reference trainer's own flags (``--memory-every 1`` included: it sets the tier up)::

    python -m resilient.cli launch --standalone --nproc-per-node 2 benchmarks/snapshot_blocks.py \\
        --block 20 --dp 2 --preset tiny --steps 400 --memory-every 1 --ckpt DIR --metrics FILE
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DROP = 2  # steps dropped at the start of each block


def snapshots_on(step: int, block: int) -> bool:
    """Whether the snapshot after ``step`` is taken: odd blocks, from step 1 on."""
    return ((step - 1) // block) % 2 == 1


def kept(step: int, block: int) -> bool:
    """Whether the time of ``step`` (from the end of the step before) counts."""
    return (step - 1) % block >= DROP


def run_blocks(
    out_dir: str,
    *,
    preset: str = "tiny",
    steps: int = 400,
    block: int = 20,
    skip: int = 40,
    part: str | None = None,
    tree: str | None = None,
    env: dict[str, str] | None = None,
    commit_every: int = 1,
) -> dict[str, float]:
    """(the driver) One run: the median seconds between steps with snapshots ("on") and without
    ("off"), after the first ``skip`` steps.  ``tree``: a checkout whose library and trainer to
    measure (default: this one); ``env`` should give the run a RESILIENT_MEMORY_ROOT of its own;
    ``commit_every``: the trainer's ``--memory-commit-every`` (1: every snapshot committed)."""
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    if tree is not None:
        env["RESILIENT_BENCH_TREE"] = tree
        env["PYTHONPATH"] = tree  # (the launcher too)
    cmd = [
        sys.executable, "-m", "resilient.cli", "launch", "--standalone", "--nproc-per-node", "2",
        os.path.join(HERE, "snapshot_blocks.py"), "--block", str(block), "--dp", "2",
        "--preset", preset, "--steps", str(steps), "--memory-every", "1",
        "--ckpt", out_dir + "/ckpt", "--metrics", out_dir + "/metrics.jsonl",
        *(["--part", part] if part else []),
        *(["--memory-commit-every", str(commit_every)] if commit_every != 1 else []),
    ]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=tree or os.getcwd())
        with open(out_dir + "/metrics.jsonl") as f:
            wall = {
                row["step"]: row["wall_time"] for row in map(json.loads, f) if "wall_time" in row
            }
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for s in sorted(wall):
        if s - 1 in wall and s > skip and kept(s, block):
            gaps[snapshots_on(s, block)].append(wall[s] - wall[s - 1])
    return {
        "on": statistics.median(gaps[True]),
        "off": statistics.median(gaps[False]),
        "steps": len(gaps[True]),
    }


class Blocks:
    """The hook: before each step, whether its snapshot is taken."""

    def __init__(self, block: int) -> None:
        self.block = block

    def at_step(self, step: int, run) -> None:
        run.memory_every = 1 if snapshots_on(step, self.block) else None


def main() -> int:
    argv = sys.argv[1:]
    block = 20
    if "--block" in argv:
        i = argv.index("--block")
        block = int(argv[i + 1])
        del argv[i : i + 2]
    part = None
    if "--part" in argv:  # cut every snapshot short (benchmarks/snapshot_parts.py)
        i = argv.index("--part")
        part = argv[i + 1]
        del argv[i : i + 2]
    # the library and trainer measured: this checkout's, or the one RESILIENT_BENCH_TREE names (a
    # checkout of another commit: benchmarks/snapshot_ab.py --blocks)
    sys.path.insert(0, os.environ.get("RESILIENT_BENCH_TREE") or os.path.dirname(HERE))
    from reference_trainer.__main__ import config_from, parser  # (disables gc, as a rank)

    args = parser().parse_args(argv)
    if not args.memory_every:
        raise SystemExit("snapshot_blocks.py needs --memory-every 1 (it sets the tier up)")
    cfg = config_from(args, int(os.environ["WORLD_SIZE"]))
    from reference_trainer.train import train

    if part is not None:  # this checkout's snapshot_parts.py, over the tree measured
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "snapshot_parts", os.path.join(HERE, "snapshot_parts.py")
        )
        assert spec is not None and spec.loader is not None
        parts = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(parts)
        parts.cut_short(part, cfg.steps)

    train(cfg, hooks=[Blocks(block)])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
