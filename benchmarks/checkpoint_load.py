"""Load benchmark: the same checkpoint loaded with and without a layout change.

A ~512 MiB bf16 state is saved by 4 ranks in layout tp=4 (row- and column-sharded weights, one
replicated).  Then it is loaded by: 4 ranks in the same layout; 2 ranks in tp=2 (resharding);
1 rank (everything); and verified whole (``reshape verify``).  For each: the slowest rank's time, bytes read against bytes needed (read
amplification), and, side by side, torch.distributed.checkpoint doing the same tp=4 -> tp=2 change
with DTensors (dcp.load into the new placements), and a raw sequential read of the files.  Page
caches are dropped before each load when the process may (root), so reads come from the disk.

    python benchmarks/checkpoint_load.py [--mib 512] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import drop_caches, machine, markdown_table, read_tree  # noqa: E402

NUM_ROWS = 8


def _shapes(total_bytes: int) -> dict[str, tuple[int, int]]:
    cols = 4096
    rows = total_bytes // NUM_ROWS // 2 // cols
    return {f"w{i}": (rows, cols) for i in range(NUM_ROWS)}


def _placement(key: str):
    from resilient import Shard

    if key == "w0":
        return {}  # replicated
    if key == "w1":
        return {"tp": Shard(1)}
    return {"tp": Shard(0)}


def _global(key: str, shape):
    import torch

    g = torch.Generator().manual_seed(int(key[1:]))
    return torch.randn(shape, generator=g).bfloat16()


def _worker(rank, world, port, task, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # as torchrun sets them: every rank of these runs is on this machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, task(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def run(task, world, *args):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world, port, task, args, q)) for r in range(world)]
    for p in ps:
        p.start()
    out = dict(q.get(timeout=600) for _ in ps)
    for p in ps:
        p.join()
    return [out[r] for r in range(world)]


def _local(key, shape, layout, rank):
    from resilient.checkpoint.state import shard_of

    return shard_of(_global(key, shape), _placement(key), layout, rank)


def save_task(rank, world, url, shapes):
    from resilient import Checkpointer, Layout

    lay = Layout(tp=world)
    with Checkpointer(url, layout=lay) as ck:
        ck.save(1, {k: _local(k, s, lay, rank) for k, s in shapes.items()}).wait()
    return True


def load_task(rank, world, url, shapes, drop):
    import torch

    from resilient import Checkpointer, Layout

    lay = Layout(tp=world)
    state = {k: _local(k, s, lay, rank) for k, s in shapes.items()}
    expect = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        v.zero_()
    needed = sum(v.numel() * v.element_size() for v in state.values())
    cold_start(rank, drop)
    t0 = time.perf_counter()
    with Checkpointer(url, layout=lay) as ck:
        ck.load(state)
        stats = ck.last_load
    dt = time.perf_counter() - t0
    ok = all(torch.equal(state[k], expect[k]) for k in state)
    return {
        "seconds": dt,
        "bytes_read": stats.bytes_read,
        "needed": needed,
        "ok": ok,
        "resharded": stats.resharded,
    }


def dcp_save_task(rank, world, path, shapes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    state = {}
    for k, s in shapes.items():
        p = _placement(k)
        placements = [Shard(p["tp"].dim)] if p else [Replicate()]
        state[k] = distribute_tensor(_global(k, s), mesh, placements)
    dcp.save(state, checkpoint_id=path)
    return True


def dcp_load_task(rank, world, path, shapes, drop):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    state = {}
    for k, s in shapes.items():
        p = _placement(k)
        placements = [Shard(p["tp"].dim)] if p else [Replicate()]
        state[k] = distribute_tensor(torch.zeros(s, dtype=torch.bfloat16), mesh, placements)
    cold_start(rank, drop)
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    dt = time.perf_counter() - t0
    ok = all(torch.equal(state[k].full_tensor(), _global(k, s)) for k, s in shapes.items())
    return {"seconds": dt, "ok": ok}


def cold_start(rank: int, drop: bool = True) -> None:
    """Every rank waits while rank 0 drops the page caches: the timed part starts cold.  A full
    garbage collection first: in a process that imported torch one costs 0.1-1 s, and when it
    falls inside the timed part depends on how many objects the imports allocated, not on the
    code measured (seen: the same load measured 0.06 s or 1.1 s with the collector's counters
    one module apart)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    if rank == 0 and drop:
        drop_caches()
    dist.barrier()


def raw_read(root: str) -> tuple[float, int]:
    drop_caches()
    t0 = time.perf_counter()
    total = read_tree(root)
    return time.perf_counter() - t0, total


def verify_cold(url: str) -> tuple[float, int]:
    """``reshape verify``'s work from a cold page cache: (seconds, bytes checked)."""
    from resilient.checkpoint.reader import verify_step
    from resilient.checkpoint.storage import Storage

    storage = Storage(url)
    drop_caches()
    t0 = time.perf_counter()
    report = verify_step(storage, 1)
    seconds = time.perf_counter() - t0
    assert report.ok, report.problems
    return seconds, report.bytes_checked


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes = _shapes(args.mib << 20)
    root = tempfile.mkdtemp(prefix="ckpt-load-bench-", dir=args.dir)
    url, dcp_path = os.path.join(root, "resilient"), os.path.join(root, "dcp")
    drop = drop_caches()
    print(
        f"state: {len(shapes)} bf16 tensors of {shapes['w0']}, {args.mib} MiB; caches dropped: {drop}",
        flush=True,
    )
    run(save_task, 4, url, shapes)
    run(dcp_save_task, 4, dcp_path, shapes)
    raw_s, raw_bytes = raw_read(url)
    rows, results = [], {"raw_read_s": raw_s, "raw_bytes": raw_bytes}
    rows.append(
        [
            "raw sequential read of the files",
            "-",
            f"{raw_bytes / 2**20:.0f}",
            "-",
            "-",
            f"{raw_s:.3f}",
            f"{raw_bytes / raw_s / 2**30:.2f}",
        ]
    )
    for label, world in (
        ("resilient, same layout (tp=4, 4 ranks)", 4),
        ("resilient, tp=4 -> tp=2 (2 ranks)", 2),
        ("resilient, tp=4 -> 1 rank (everything)", 1),
    ):
        out = run(load_task, world, url, shapes, drop)
        assert all(o["ok"] for o in out), f"{label}: loaded values differ"
        read = sum(o["bytes_read"] for o in out)
        needed = sum(o["needed"] for o in out)
        slowest = max(o["seconds"] for o in out)
        results[label] = out
        rows.append(
            [
                label,
                str(world),
                f"{read / 2**20:.0f}",
                f"{needed / 2**20:.0f}",
                f"{read / needed:.2f}",
                f"{slowest:.3f}",
                f"{needed / slowest / 2**30:.2f}",
            ]
        )
        print(f"  {label}: {slowest:.3f}s", flush=True)
    verify_s, checked = verify_cold(url)
    results["verify_s"] = verify_s
    rows.append(
        [
            "resilient verify: every byte against its checksums (1 process)",
            "1",
            f"{checked / 2**20:.0f}",
            f"{checked / 2**20:.0f}",
            "1.00",
            f"{verify_s:.3f}",
            f"{checked / verify_s / 2**30:.2f}",
        ]
    )
    print(f"  verify: {verify_s:.3f}s", flush=True)
    out = run(dcp_load_task, 2, dcp_path, shapes, drop)
    assert all(o["ok"] for o in out)
    slowest = max(o["seconds"] for o in out)
    results["dcp tp=4 -> tp=2"] = out
    needed2 = sum(results["resilient, tp=4 -> tp=2 (2 ranks)"][r]["needed"] for r in range(2))
    rows.append(
        [
            "dcp.load, tp=4 -> tp=2 (2 ranks, DTensor)",
            "2",
            "?",
            f"{needed2 / 2**20:.0f}",
            "?",
            f"{slowest:.3f}",
            f"{needed2 / slowest / 2**30:.2f}",
        ]
    )
    shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"machine: {machine()}; page caches dropped before each load: {drop}")
    print(
        markdown_table(
            [
                "load",
                "ranks",
                "MiB read",
                "MiB needed",
                "read / needed",
                "slowest rank s",
                "GiB/s (needed / time)",
            ],
            rows,
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
