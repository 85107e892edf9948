"""Where a snapshot's cost goes, inside the trainer: the reference trainer with a snapshot every
step, the memory tier's background work cut short at one of two points, so that each run measures
what a snapshot costs up to there.

* ``--part staged``: the caller's part only.  ``snapshot()`` runs as always (the state flattened
  and described, copied into the mapped rank file, the staged record written, a background thread
  started), and the background thread settles the file at once: no checksums, no commit.
* ``--part checksummed``: the caller's part and the background checksums of every chunk (crc32 per
  block, as a commit computes them), then the file is settled: no commit protocol (no store
  handshake, no manifest, no publish, no retention).

That is the lower bound of a commit without a per-step handshake (each rank's file and record its
own commit, the manifest built when a step is read), which the tier does not have (BENCHMARKS.md).
The snapshot of the run's last step is committed as usual, so that the run's final durable save
(through the persister, from that snapshot) works as in any run.  This patches the checkpointer
inside this benchmark's processes only; nothing here is a mode of the library.

Run by ``benchmarks/memory_tier.py --trainer-runs N --trainer-parts`` beside the other kinds,
under ``resilient launch`` with the reference trainer's own flags::

    python -m resilient.cli launch --standalone --nproc-per-node 2 benchmarks/snapshot_parts.py \\
        --part staged --dp 2 --preset tiny --steps 150 --memory-every 1 --ckpt DIR --metrics FILE
"""

from __future__ import annotations

import os
import sys

# this checkout, or the one RESILIENT_BENCH_TREE names (benchmarks/snapshot_blocks.py)
sys.path.insert(
    0,
    os.environ.get("RESILIENT_BENCH_TREE")
    or os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
)

from reference_trainer.__main__ import config_from, parser  # noqa: E402  (disables gc, as a rank)

PARTS = ("staged", "checksummed")


def cut_short(part: str, last_step: int) -> None:
    """Make every memory-tier snapshot before ``last_step`` stop after ``part``."""
    from resilient.checkpoint.checkpointer import Checkpointer
    from resilient.checkpoint.codec import block_checksums
    from resilient.checkpoint.slots import _Slot

    persist = Checkpointer._persist

    def _persist(self, handle, step, layout, plan, data, values, committer):
        if self._slots is None or not isinstance(data, _Slot) or step >= last_step:
            return persist(self, handle, step, layout, plan, data, values, committer)
        if part == "checksummed":
            view = memoryview(data.mm)[data.prefix :]
            try:
                for it in plan.items:
                    block_checksums(view[it.begin : it.end], self.block_bytes, parallel=False)
            finally:
                view.release()
        self._slots.settled(data, False)  # never committed: the next snapshot reuses its file
        handle._finish(None)

    Checkpointer._persist = _persist


def main() -> int:
    argv = sys.argv[1:]
    if "--part" not in argv or argv.index("--part") + 1 >= len(argv):
        print(
            f"usage: snapshot_parts.py --part {{{','.join(PARTS)}}} TRAINER_FLAGS", file=sys.stderr
        )
        return 2
    i = argv.index("--part")
    part = argv[i + 1]
    if part not in PARTS:
        print(f"--part must be one of {', '.join(PARTS)}, got {part!r}", file=sys.stderr)
        return 2
    args = parser().parse_args(argv[:i] + argv[i + 2 :])
    cfg = config_from(args, int(os.environ["WORLD_SIZE"]))
    cut_short(part, cfg.steps)
    from reference_trainer.train import train

    train(cfg)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
