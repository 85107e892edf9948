"""Can NCCL run two ranks on one GPU?  Two processes, one device, ``init_process_group("nccl")``
and one all-reduce; prints what each rank got (its result, or the error NCCL raised).

In-job recovery's NCCL breakdown (issue 15) needs one GPU per rank; on a machine with one GPU
this records why it cannot run there (NCCL 2.5 and later refuse a second rank on the same
device: "Duplicate GPU detected").

    python benchmarks/nccl_ranks_per_gpu.py [--ranks 2] [--timeout 90]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.perf_counter()
    try:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        x = torch.full((1024,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        queue.put({"rank": rank, "ok": True, "sum": float(x[0]), "s": time.perf_counter() - t0})
        dist.destroy_process_group()
    except BaseException as e:  # the point: what NCCL says
        queue.put(
            {"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
             "s": time.perf_counter() - t0}
        )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to try", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, port, queue)) for r in range(args.ranks)
    ]
    for pr in procs:
        pr.start()
    results, deadline = [], time.monotonic() + args.timeout
    while len(results) < args.ranks and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=1.0))
        except Exception:
            if not any(pr.is_alive() for pr in procs):
                break
    for pr in procs:
        pr.join(timeout=5)
        if pr.is_alive():
            pr.kill()
    out = {
        "ranks": args.ranks,
        "devices": torch.cuda.device_count(),
        "device": torch.cuda.get_device_name(0),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "torch": torch.__version__,
        "results": sorted(results, key=lambda r: r["rank"]),
        "hung": args.ranks - len(results),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
