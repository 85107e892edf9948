"""The floor of a snapshot every step, inside the trainer: one rank of the reference trainer whose
every step first copies the tensors this rank's snapshot saves (its plan's: the model and the
optimizer's state, and of the tensors every rank holds the ones the plan gives this rank) into a
buffer allocated once, and checksums that buffer in one crc32 pass (ISA-L where installed, as the
checkpointer's).  No files, no commit, no Python per tensor beyond one batched copy: what any
snapshot of the same bytes must at least spend.

Run by ``benchmarks/memory_tier.py --trainer-runs N`` as a third kind of run beside "no
snapshots" and "a snapshot every step", under ``resilient launch`` with the reference trainer's
own flags::

    python -m resilient.cli launch --standalone --nproc-per-node 2 benchmarks/snapshot_floor.py \\
        --dp 2 --preset tiny --steps 150 --ckpt DIR --metrics FILE
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reference_trainer.__main__ import config_from, parser  # noqa: E402  (disables gc, as a rank)


class Floor:
    """The hook: at each step, copy the state into the buffer and checksum it."""

    def __init__(self) -> None:
        self.dests: list = []
        self.srcs: list = []
        self.buf = None
        self.cpu_s = 0.0
        self.steps = 0

    def _setup(self, run) -> None:
        """The tensors this rank's snapshot copies: its plan's items (a tensor that every rank
        holds is saved by one of them), of the state as it is after a step (the optimizer
        creates its state at its first step)."""
        import torch

        from resilient.checkpoint.state import flatten_state

        ck = run.checkpointer
        layout = ck._layout_for(run.state)  # as its saves flatten it
        flat = flatten_state(run.state, layout, run.rank)
        leaves = [flat.tensors[it.key].local for it in ck._plan(flat, layout)[0].items]
        total = sum(t.numel() * t.element_size() for t in leaves)
        self.buf = torch.empty(total, dtype=torch.uint8)
        at = 0
        for t in leaves:
            n = t.numel() * t.element_size()
            self.dests.append(self.buf[at : at + n].view(t.dtype).view(t.shape))
            self.srcs.append(t)
            at += n

    def at_step(self, step: int, run) -> None:
        import torch

        from resilient.checkpoint.codec import crc32

        if step < 2:  # before the first step the optimizer has no state to copy
            return
        t0 = time.thread_time()
        if self.buf is None:
            self._setup(run)
        with torch.no_grad():
            torch._foreach_copy_(self.dests, self.srcs)
        crc32(memoryview(self.buf.numpy()))
        self.cpu_s += time.thread_time() - t0
        self.steps += 1


def main() -> int:
    args = parser().parse_args(sys.argv[1:])
    cfg = config_from(args, int(os.environ["WORLD_SIZE"]))
    from reference_trainer.train import train

    floor = Floor()
    train(cfg, hooks=[floor])
    if floor.steps:
        print(
            f"rank {os.environ.get('RANK')}: {floor.buf.numel()} bytes, "
            f"{floor.cpu_s / floor.steps * 1e3:.3f} ms of CPU per step",
            file=sys.stderr,
        )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
