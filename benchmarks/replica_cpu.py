"""CPU per memory snapshot on two nodes, by thread: the replicas over their own connections
against gloo alone, side by side in one run; and what one small agreement costs through gloo and
through the c10d store.

Two processes on this host stand for two nodes (two memory roots, a gloo group over loopback),
each snapshotting ``--mib`` of fp32 state (92 tensors, as the tiny preset's) ``--snapshots``
times back to back, every snapshot replicated to the other.  Each thread's CPU
comes from ``/proc/self/task/*/stat`` (clock ticks: the per-snapshot figures are averages over
the run), so the CPU that gloo's transport thread spends is seen beside the snapshot's own.

- ``links``: the replicas on the tier's own TCP connections (the default).
- ``gloo``: ``RESILIENT_REPLICA_LINKS=0``: every replication through gloo.
- ``sealed``: ``memory_commit_every=0``: every snapshot sealed (no commit) and its file and
  staged record sent to the other node over the links (resilient/checkpoint/seal_nodes.py).
- ``agreement``: one 8-byte all-reduce between the two processes against the same agreement
  through the store (add, wait, get), ``--agreements`` of each, 2 ms apart; process CPU each.

    python benchmarks/replica_cpu.py [--snapshots 300] [--mib 1.8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table, write_results  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
WARM = 20  # snapshots before the measured ones


def _threads() -> dict[int, tuple[str, float]]:
    """Every thread of this process: native id -> (name, CPU seconds so far)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # (ended meanwhile)
            continue
        name = names.get(int(tid), comm)
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) * TICK_S)
    return out


def _kind(name: str) -> str:
    """A thread's row in the table."""
    if name.startswith("resilient-ckpt"):
        return "the snapshot's background thread"
    if name == "MainThread":
        return "the main thread (the snapshot call)"
    if name.startswith("gloo"):
        return "gloo's transport threads"
    if name.startswith("pt_gloo"):
        return "gloo's work threads"
    if name == "pt_tcpstore_uv":
        return "the store's server (rank 0)"
    if name == "resilient-replica-send":
        return "the connection's send thread"
    return "other"


def _snapshots(rank: int, port: int, base: str, mode: str, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if mode == "gloo":
        os.environ["RESILIENT_REPLICA_LINKS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from resilient import Checkpointer

    ck = Checkpointer(
        f"{base}/ckpt",
        memory_every=1,
        memory_root=f"{base}/node{rank}",
        persister=False,
        # (sealed: every snapshot sealed, its pair sent over the links)
        memory_commit_every=0 if mode == "sealed" else getattr(args, "commit_every", 1),
    )
    g = torch.Generator().manual_seed(rank)
    n = max(1, int(args.mib * (1 << 20) / 4 / 92))
    state = {f"t{i}": torch.randn(n, generator=g) for i in range(92)}
    for step in range(1, args.snapshots + WARM + 1):
        if step == WARM + 1:
            before, c0, t0 = _threads(), time.process_time(), time.perf_counter()
        for t in state.values():
            t.add_(1.0)
        ck.snapshot(step, state).wait()
    ck.wait_snapshot()
    ck._memory._join_pending()  # (a sealed snapshot's replica is in only then)
    after, c1, t1 = _threads(), time.process_time(), time.perf_counter()
    linked = ck._memory._replicas.links
    used = bool(linked is not None and linked.usable and not linked.failed)
    ck.close()
    per: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        spent = cpu - before.get(tid, (name, 0.0))[1]
        per[_kind(name)] = per.get(_kind(name), 0.0) + spent / args.snapshots
    per["the process"] = (c1 - c0) / args.snapshots
    per["wall per snapshot"] = (t1 - t0) / args.snapshots
    out[(mode, rank)] = (per, used)
    dist.destroy_process_group()


def _agreements(rank: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    store = dist.distributed_c10d._get_default_store()
    flag = torch.ones(1, dtype=torch.int64)

    def through_gloo(i: int) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)

    def through_the_store(i: int) -> None:
        if store.add(f"agree/{i}", 1) == 2:
            store.set(f"agreed/{i}", b"1")
        store.wait([f"agreed/{i}"], timedelta(seconds=60))
        store.get(f"agreed/{i}")

    res = {}
    for name, fn in (("gloo all-reduce", through_gloo), ("the store", through_the_store)):
        for i in range(20):
            fn(-1 - i) if name == "gloo all-reduce" else fn(10**6 + i)
        dist.barrier()
        c0 = time.process_time()
        for i in range(args.agreements):
            fn(i)
            time.sleep(0.002)
        res[name] = (time.process_time() - c0) / args.agreements
        dist.barrier()
    out[("agreement", rank)] = res
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--snapshots", type=int, default=300)
    p.add_argument("--mib", type=float, default=1.8, help="each rank's state")
    p.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternately")
    p.add_argument("--agreements", type=int, default=500)
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from resilient.launch import free_port

    out = mp.Manager().dict()
    runs: dict[str, list[dict[str, float]]] = {"links": [], "gloo": [], "sealed": []}
    for r in range(args.rounds):
        for mode in runs:
            base = tempfile.mkdtemp(dir=args.shm, prefix="replica-cpu-")
            try:
                mp.spawn(_snapshots, args=(free_port(), base, mode, args, out), nprocs=2)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            per, used = out[(mode, 0)]
            if used != (mode != "gloo"):
                print(f"round {r + 1}, {mode}: the links were {'' if used else 'not '}used")
                return 1
            runs[mode].append(per)
            print(f"round {r + 1} of {args.rounds}, {mode}: done", file=sys.stderr)
    mp.spawn(_agreements, args=(free_port(), args, out), nprocs=2)
    agreement = out[("agreement", 0)]

    print(
        f"{machine()}; two processes as two nodes, {args.mib} MiB of fp32 state each (92 "
        f"tensors), {args.snapshots} snapshots back to back, each replicated (committed, or "
        f"sealed with its pair sent over the links); rank 0's threads, CPU ms per snapshot (each "
        f"round's figure)"
    )
    kinds = sorted(
        {k for rows in runs.values() for per in rows for k in per},
        key=lambda k: (k in ("the process", "wall per snapshot"), k),
    )
    table = []
    for k in kinds:
        cells = []
        for mode in runs:
            vals = [per.get(k, 0.0) * 1e3 for per in runs[mode]]
            cells.append(", ".join(f"{v:.2f}" for v in vals))
        table.append([k, *cells])
    print(
        markdown_table(
            [
                "rank 0",
                "replicas over the links",
                "through gloo alone",
                "sealed, pairs over the links",
            ],
            table,
        )
    )
    print()
    print(
        f"One agreement between the two processes ({args.agreements}, 2 ms apart), rank 0's "
        f"process CPU each: gloo all-reduce {agreement['gloo all-reduce'] * 1e3:.2f} ms, the "
        f"store (add, wait, get) {agreement['the store'] * 1e3:.2f} ms"
    )
    write_results(
        args.json,
        {
            "machine": machine(),
            "args": vars(args),
            "per_snapshot_s": {m: rows for m, rows in runs.items()},
            "agreement_cpu_s": dict(agreement),
            "median_process_cpu_s": {
                m: statistics.median(per["the process"] for per in rows) for m, rows in runs.items()
            },
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
