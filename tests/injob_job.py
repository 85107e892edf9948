"""A data-parallel loop on ``@fault_tolerant`` with a memory snapshot every step, for the in-job
recovery tests: ``INJOB_KILL=RANK:STEP[:SIGNAL]`` sends that rank SIGKILL (or SIGSTOP: ``STOP``)
once, before that step's update (a marker file next to the checkpoint makes it once per job).  Rank 0 writes the final weights (their
exact bytes, hex) and the pids that ran each rank to ``OUT.json``."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from resilient import Run, fault_tolerant

URL, STEPS, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3]


@fault_tolerant(URL, save_every=5, memory_every=1)
def train(run: Run) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(model=model, optim=optim)
    rank, world = dist.get_rank(), dist.get_world_size()
    kill = os.environ.get("INJOB_KILL")
    for step in run.steps(STEPS):
        # before the step's update, as the chaos harness's in-rank faults: the snapshot of the
        # step before may still be committing, the one before that is committed
        marker = os.path.join(os.path.dirname(OUT), "killed")
        spec = (kill or "-1:-1").split(":")
        if (rank, step) == (int(spec[0]), int(spec[1])) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), getattr(signal, "SIG" + (spec[2] if len(spec) > 2 else "KILL")))
        g = torch.Generator().manual_seed(step * 1000 + rank)
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        weights = {k: v.detach().numpy().tobytes().hex() for k, v in model.state_dict().items()}
        with open(OUT, "w") as f:
            json.dump({"weights": weights, "pids": pids, "step": run.step}, f)


if __name__ == "__main__":
    train()
