"""FSDP2 (``fully_shard``) with ``@fault_tolerant``: sharded weights and optimizer state, resumable.

A tiny residual MLP is sharded per block and at the root over a 1-D DeviceMesh named ``dp``, and
trained with AdamW.  ``run.track(model=..., optim=...)`` is all the checkpointing it needs: the
parameters and AdamW's ``exp_avg``/``exp_avg_sq`` are DTensors, saved as this rank's shard
(the mesh dim ``dp`` becomes the checkpoint's layout axis), and a restart resumes bit for bit:

    torchrun --nproc-per-node 2 examples/fsdp2.py --ckpt runs/fsdp2 --steps 20 --save-every 5

``--load-only`` reads a checkpoint on any number of ranks, resharding it on load (FSDP over however
many ranks there are, or a plain model in one process without torchrun), and with ``--out`` writes
the full, unsharded weights and optimizer state as safetensors:

    torchrun --nproc-per-node 3 examples/fsdp2.py --ckpt runs/fsdp2 --load-only --out full.st
    python examples/fsdp2.py --ckpt runs/fsdp2 --load-only --out full.st

CPU ranks use gloo; with GPUs, each rank takes the one of its LOCAL_RANK and NCCL.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from resilient import Checkpointer, Run, fault_tolerant

DIM, HIDDEN, NUM_BLOCKS = 16, 40, 3  # odd sizes: 3 ranks get uneven (and empty) shards
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, DIM) -> (B, DIM)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, DIM) -> (B, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def pick_device() -> torch.device:
    """The GPU of this LOCAL_RANK when torch sees one (nccl), else the CPU (gloo)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def build(seed: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same initial weights on every rank, then sharded: per block first, the root last."""
    torch.manual_seed(seed)
    model = Model().to(device)
    if dist.is_initialized():  # one process without torchrun: a plain model, a world of one
        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def batch(seed: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step``: a pure function of (seed, step), whatever the
    world size, so a resumed run sees exactly the data an uninterrupted one would."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))  # (B, 1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n].to(device), y[rank * n : (rank + 1) * n].to(device)


def write_full(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Unsharded weights (``model.*``) and AdamW state (``optim.<param>.*``) as safetensors.  A
    collective: every rank gathers every DTensor; rank 0 writes."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()

    tensors = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in optim.state.get(p, {}).items():
            tensors[f"optim.{name}.{k}"] = full(v)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file(tensors, path)


def train(a: argparse.Namespace, device: torch.device) -> None:
    @fault_tolerant(a.ckpt, save_every=a.save_every)  # creates the process group under torchrun
    def loop(run: Run) -> None:
        model, optim = build(a.seed, device)
        restored = run.track(model=model, optim=optim)  # the newest committed step, if any
        if restored and run.rank == 0:
            print(f"resumed from step {restored}", flush=True)
        for step in run.steps(a.steps):  # saves every --save-every steps and at the end
            x, y = batch(a.seed, step, device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()  # FSDP2 reduce-scatters the gradients into the shards
            optim.step()
            mean = loss.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
            if run.rank == 0:
                print(f"step {step} loss {mean.item()!r}", flush=True)
        if a.out:
            write_full(a.out, model, optim)

    loop()


def load_only(a: argparse.Namespace, device: torch.device) -> None:
    """No training loop, so no Run: a Checkpointer reads the step into this world's shards."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model, optim = build(a.seed, device)
    with Checkpointer(a.ckpt) as ck:
        step = ck.load({"model": model, "optim": optim}, step=a.step)  # reshards to this world
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"loaded step {step} of {a.ckpt}", flush=True)
    if a.out:
        write_full(a.out, model, optim)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint URL (a directory, s3://...)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full weights and optimizer state here")
    p.add_argument("--load-only", action="store_true", help="load a checkpoint; do not train")
    p.add_argument("--step", type=int, default=None, help="with --load-only (default: newest)")
    a = p.parse_args()
    device = pick_device()
    (load_only if a.load_only else train)(a, device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Leave without the interpreter's teardown.  A gloo worker thread may still hold the last
        # DTensor collective's work (its tensors) after the call returned; one that drops it once
        # teardown has begun needs the GIL it can no longer take, and the process aborts
        # ("terminate called without an active exception", SIGABRT), now and then on a loaded
        # machine.  destroy_process_group() does not stop those threads here: DTensor's
        # redistribute cache keeps the device mesh, and with it the group, alive.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
