"""The memory tier on a GPU: a snapshot of the model and optimizer from device memory into the
node's memory, against a bare ``copy_`` of the same tensors into pinned host memory, side by side
in one process and one run.

The state is the reference trainer's (``--preset``, default ``small``: the model and its AdamW
state, fp32, on one device, after a training step so that the optimizer holds its moments).

- Bare copy: every tensor ``copy_``'d (``non_blocking``) into a pinned host buffer allocated
  once, then one ``torch.cuda.synchronize()``: the floor of any device-to-host snapshot.  The
  same into pageable buffers, for scale.
- Snapshot stall: how long ``Checkpointer.snapshot`` keeps the caller, with the previous
  snapshot's background write finished, and back to back (the previous one still writing);
  committed (``memory_commit_every=1``) and sealed (``0``).  The background part (the write into
  the node's memory, checksums, commit), from the call's return to ``wait()``.
- Restore: ``load`` back onto the device from the memory tier, against ``load`` from durable
  storage on the local disk (the same step, warm page cache).
- Training: the same process trains with a snapshot every step in one kind of block of
  ``--block`` steps and none in the other (and sealed in a third), alternating, ``--train-steps``
  steps in all; per kind the median step time (the step ends with a ``torch.cuda.synchronize()``
  and the snapshot call, as the trainer's loop).

    python benchmarks/gpu_snapshot.py [--device cuda] [--preset small] [--json out.json]

On a machine without a GPU ``--device cpu`` runs the same code (a smoke test; the "bare copy"
is then a host-to-host copy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import Samples, machine, markdown_table, scratch, snapshot_times  # noqa: E402

from reference_trainer.config import preset  # noqa: E402
from reference_trainer.model import MoETransformer, init_parameters  # noqa: E402
from reference_trainer.optim import AdamW  # noqa: E402
from reference_trainer.parallel import ParallelContext  # noqa: E402
from reference_trainer.train import _param_groups  # noqa: E402
from resilient import Checkpointer  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Job:
    """The model, its optimizer and one training step, on one device (a world of one)."""

    def __init__(self, name: str, device: torch.device, batch: int) -> None:
        self.device = device
        self.cfg = preset(name)
        self.pc = pc = ParallelContext.create(1, 1, 1, device.type)
        self.model = MoETransformer(self.cfg, pc).to(device)
        init_parameters(self.model, pc, 0)
        names = {p: f"model.{n}" for n, p in self.model.named_parameters()}
        self.optim = AdamW(
            _param_groups(self.model, 0.1), names=names, lr=3e-4, betas=(0.9, 0.95), eps=1e-8
        )
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.cfg.vocab_size, (batch, self.cfg.seq_len + 1), generator=g)
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )

    def step(self) -> float:
        with self.autocast:
            logits, aux = self.model(self.x)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), self.y.reshape(-1))
        (ce + self.cfg.aux_loss_coef * aux).backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        sync(self.device)
        return float(ce.detach())

    def state(self) -> dict:
        return {"model": self.model, "optim": self.optim}

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.model.parameters()]
        for s in self.optim.state.values():
            out += [v for v in s.values() if isinstance(v, torch.Tensor)]
        return out


def med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def measure(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    job = Job(args.preset, device, args.batch)
    for _ in range(3):  # the optimizer's state exists after its first step
        job.step()
    tensors = job.tensors()
    total = sum(t.numel() * t.element_size() for t in tensors)
    pin = device.type == "cuda"
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
    pageable = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    disk, shm = scratch("gpu-snap-", args.dir, args.shm)
    out = Samples()
    add = out.add

    def bare(into: list[torch.Tensor]) -> float:
        sync(device)
        t0 = time.perf_counter()
        for dst, src in zip(into, tensors):
            dst.copy_(src, non_blocking=True)
        sync(device)
        return time.perf_counter() - t0

    state, layout = job.state(), job.pc.layout
    try:
        kinds = {
            "committed": Checkpointer(os.path.join(disk, "c"), layout=layout, memory_every=1),
            "sealed": Checkpointer(
                os.path.join(disk, "s"), layout=layout, memory_every=1, memory_commit_every=0
            ),
        }
        step = 0
        for r in range(args.repeats + 1):
            b = bare(pinned)
            p = bare(pageable)
            if r:
                add("bare copy_ into pinned host memory", b)
                add("bare copy_ into pageable host memory", p)
            for kind, ck in kinds.items():
                stall, write, b2b, step = snapshot_times(ck, step, state, lambda: sync(device))
                if r:
                    add(f"snapshot stall, {kind}", stall)
                    add(f"snapshot background part, {kind}", write)
                    add(f"snapshot stall, {kind}, back to back", b2b)
        slots = kinds["committed"]._memory._slots  # (whether its files are page-locked)
        pinned = [bool(x.pinned) for x in (*slots._committed, *slots._staged)]
        # restore onto the device: memory against durable (local disk, warm)
        ck = kinds["committed"]
        step += 1
        ck.snapshot(step, state).wait()
        ck.save(step, state).wait()
        expect = [t.clone() for t in tensors]
        for r in range(args.repeats + 1):
            for t in tensors:  # scribble, so that a restore that did nothing shows
                t.zero_()
            sync(device)
            t0 = time.perf_counter()
            ck.load(state, step=step)
            sync(device)
            mem = time.perf_counter() - t0
            assert ck.last_load.source == "memory", ck.last_load
            durable = Checkpointer(os.path.join(disk, "c"), layout=layout)
            t0 = time.perf_counter()
            durable.load(state, step=step)
            sync(device)
            dur = time.perf_counter() - t0
            durable.close()
            if r:
                add("restore onto the device from memory", mem)
                add("restore onto the device from durable (local disk, page cache)", dur)
        tensors = job.tensors()
        assert all(torch.equal(a, b) for a, b in zip(tensors, expect)), "restore differs"
        # training with a snapshot every step, in alternate blocks
        order = ["none", "committed", "sealed"]
        steps: dict[str, list[float]] = {k: [] for k in order}
        t_prev = None
        for i in range(args.train_steps):
            kind = order[(i // args.block) % len(order)]
            job.step()
            if kind != "none":
                step += 1
                kinds[kind].snapshot(step, state)
            now = time.perf_counter()
            if t_prev is not None and i % args.block >= 2:  # a block's first two: the kind before
                steps[kind].append(now - t_prev)
            t_prev = now
        for ck in kinds.values():
            ck.wait_snapshot()
            ck.release_memory()
            ck.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "preset": args.preset,
        "device": gpu or "cpu",
        "bytes": total,
        "tensors": len(tensors),
        "median_s": {k: statistics.median(v) for k, v in out.items()},
        "samples_s": out,
        "train_step_median_s": {k: statistics.median(v) for k, v in steps.items()},
        "train_steps_each": {k: len(v) for k, v in steps.items()},
        "tier_files_page_locked": pinned,
        "machine": machine(),
        "torch": torch.__version__,
    }


def report(res: dict) -> str:
    m = res["median_s"]
    base = m["bare copy_ into pinned host memory"]
    gbps = res["bytes"] / 1e9
    rows = [
        [name, f"{s * 1e3:.2f}", f"{s / base:.2f}x", f"{gbps / s:.1f}"] for name, s in m.items()
    ]
    lines = [
        f"{res['device']}, preset {res['preset']}: {res['tensors']} tensors, "
        f"{res['bytes'] / 2**20:.0f} MiB (the model and AdamW's moments, fp32); {res['machine']}",
        f"the tier's files page-locked for the GPU: {res['tier_files_page_locked']}",
        "",
        markdown_table(["what", "median ms", "vs bare pinned copy", "GB/s"], rows),
        "",
    ]
    t = res["train_step_median_s"]
    off = t["none"]
    rows = [
        [k, f"{v * 1e3:.2f}", f"{v / off - 1:+.1%}", str(res["train_steps_each"][k])]
        for k, v in t.items()
    ]
    lines.append(
        markdown_table(
            ["training, snapshot every step", "median step ms", "vs none", "steps"], rows
        )
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=180)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--dir", default=None, help="durable storage (a local disk); default: $TMPDIR")
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    backends = ["nccl", "gloo"] if args.device.startswith("cuda") else ["gloo"]
    for i, backend in enumerate(backends):  # a world of one; gloo if nccl fails here
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            res = measure(args)
            res["backend"] = backend
            break
        except Exception:
            if i == len(backends) - 1:
                raise
            traceback.print_exc()
            print(f"(with {backend}; again with {backends[i + 1]})", flush=True)
        finally:
            dist.destroy_process_group()
    if args.json:  # first: the numbers come back even if the table fails
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(report(res), flush=True)


if __name__ == "__main__":
    main()
