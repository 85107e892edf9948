"""A user's own training loop on ``@fault_tolerant``: the smallest complete example.

Data-parallel linear regression on every rank (gradients all-reduced), checkpointed every
``--save-every`` steps; a restart under torchrun resumes after the newest committed step, and the
loader's position comes back with it.  Rank 0 appends one JSON line per step to ``--metrics``
(step, loss, wall_time, and the sample ids it consumed), which is what the chaos harness reads:

    torchrun --nproc-per-node 2 --max-restarts 2 examples/fault_tolerant_loop.py --ckpt runs/ex
    resilient chaos run examples/kill-my-loop.toml

``--chaos PLAN`` installs the chaos harness's hook (``hooks=[...]``): the harness hands the plan
to the job, and only a job that installs the hook can have faults injected.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from resilient import Run, fault_tolerant


class Loader:
    """Batch ``i`` of a fixed synthetic dataset; Stateful, so its position is checkpointed."""

    def __init__(self, batch: int, dim: int) -> None:
        self.batch, self.dim, self.position = batch, dim, 0
        g = torch.Generator().manual_seed(0)
        self.w_true = torch.randn(dim, 1, generator=g)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        g = torch.Generator().manual_seed(1000 + self.position)
        x = torch.randn(self.batch, self.dim, generator=g)
        ids = [self.position * self.batch, self.batch]
        self.position += 1
        return x, x @ self.w_true, ids

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--metrics", default=None)
    p.add_argument("--events", default=None)
    p.add_argument("--chaos", default=None, help="a chaos plan (from `resilient chaos run`)")
    a = p.parse_args()
    hooks = []
    if a.chaos:
        from resilient.chaos.faults import ChaosHook

        hooks.append(ChaosHook.from_file(a.chaos))

    @fault_tolerant(a.ckpt, save_every=a.save_every, event_log=a.events, hooks=hooks)
    def train(run: Run) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = Loader(batch=32, dim=16)
        run.track(model=model, optim=optim, data=loader)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = open(a.metrics, "a", buffering=1) if a.metrics and rank == 0 else None
        for step in run.steps(a.steps):
            x, y, ids = loader.next()
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            for p_ in model.parameters():  # data parallel: average gradients
                if world > 1:
                    dist.all_reduce(p_.grad)
                    p_.grad /= world
            optim.step()
            time.sleep(0.02)  # a step that takes a moment, so faults land mid-run
            if out is not None:
                out.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": float(loss),
                            "wall_time": time.time(),
                            "samples": ids,
                        }
                    )
                    + "\n"
                )

    train()


if __name__ == "__main__":
    main()
