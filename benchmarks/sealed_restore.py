"""What a restore costs on two nodes: a committed memory snapshot, a sealed one (the load commits
it first, from every node's copies: resilient/checkpoint/seal_nodes.py), a sealed one with node 1
lost (its ranks' files from node 0's peer pairs), and durable storage; side by side in one run.

Two processes on this host stand for two nodes (two memory roots, a gloo group over loopback),
each with ``--mib`` of fp32 state; durable storage on ``--disk`` (a local disk: its page cache
is warm, as right after the save).  Per case and round: snapshots of steps 1-3 (and a durable save
of step 3 for the durable case), the checkpointers closed, new ones made (as a restarted job's),
and ``load()`` timed on each rank; the table gives rank 0's, the median of the rounds.

    python benchmarks/sealed_restore.py [--mib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table  # noqa: E402

CASES = ("committed", "sealed", "sealed, node 1 lost", "durable")


def _state(rank: int, mib: float, value: float) -> dict:
    """Eight tensors, each rank's own half of them (its file holds bytes no other rank has)."""
    from resilient import Shard, sharded

    n = max(1, int(mib * (1 << 20) / 4 / 8))
    return {
        f"t{i}": sharded(
            torch.full((n,), value + rank + i, dtype=torch.float32),
            {"dp": Shard(0)},
            global_shape=(2 * n,),
        )
        for i in range(8)
    }


def _rank(rank: int, port: int, base: str, disk: str, args, out) -> None:
    # (WORLD_SIZE: the job's id is then the group's, the same on both ranks, as under torchrun;
    # a sealed step's records must agree on it)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from resilient import Checkpointer

    for r in range(args.rounds):
        for case in CASES:
            root = f"{base}/{r}-{CASES.index(case)}"
            kw = {
                "memory_every": 1,
                "memory_root": f"{root}/node{rank}",
                "persister": False,
                "memory_commit_every": 1 if case == "committed" else 0,
            }
            url = f"{disk}/{r}-{CASES.index(case)}"
            ck = Checkpointer(url, **kw)
            if case == "durable":
                ck.save(3, _state(rank, args.mib, 3.0)).wait()
                ck.close()
                shutil.rmtree(f"{root}/node{rank}", ignore_errors=True)  # memory given back
            else:
                for s in (1, 2, 3):
                    ck.snapshot(s, _state(rank, args.mib, float(s)))
                ck.close()
            dist.barrier()
            if case == "sealed, node 1 lost" and rank == 1:
                shutil.rmtree(f"{root}/node1", ignore_errors=True)
            dist.barrier()
            ck = Checkpointer(url, **kw)
            state = _state(rank, args.mib, 0.0)
            dist.barrier()
            t0 = time.perf_counter()
            step = ck.load(state)
            seconds = time.perf_counter() - t0
            got = float(state["t0"][0])
            assert step == 3 and got == 3.0 + rank, (case, step, got)
            assert ck.last_load.source == ("durable" if case == "durable" else "memory"), case
            out[(case, r, rank)] = seconds
            ck.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(url, ignore_errors=True)
            dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=float, default=256.0, help="each rank's state")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--disk", default=None, help="where durable storage is (default: the temp dir)")
    args = p.parse_args()
    from resilient.launch import free_port

    out = mp.Manager().dict()
    base = tempfile.mkdtemp(dir=args.shm, prefix="sealed-restore-")
    disk = tempfile.mkdtemp(dir=args.disk, prefix="sealed-restore-")
    try:
        mp.spawn(_rank, args=(free_port(), base, disk, args, out), nprocs=2)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    print(
        f"{machine()}; two processes as two nodes, {args.mib:g} MiB of fp32 state each, "
        f"load() on rank 0, median of {args.rounds} rounds (each round's in brackets)"
    )
    rows = []
    durable = statistics.median(out[("durable", r, 0)] for r in range(args.rounds))
    for case in CASES:
        vals = [out[(case, r, 0)] for r in range(args.rounds)]
        med = statistics.median(vals)
        each = ", ".join(f"{v * 1e3:.0f}" for v in vals)
        rows.append([case, f"{med * 1e3:.0f} ({each})", f"{med / durable:.2f}"])
    print(markdown_table(["restore of", "ms", "against durable"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
