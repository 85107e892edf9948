"""Peer replication of the memory tier against a raw socket copy, side by side in one run.

Two processes on this host stand for two nodes (two memory roots, a gloo group over loopback).
Each holds one rank file of ``--mib`` MiB in its memory tier; a replication sends each rank's file
to the other (both directions at once, as every rank does after every snapshot) and writes the
received one into the receiver's memory root.  The anchor: the same bytes through a plain TCP
socket pair over loopback, both directions at once, into a preallocated buffer (no file write).

- Throughput: bytes moved per second, replication against the raw socket copy.
- Restore exchange: a replaced node's rank fetching its file from the peer's replica, against the
  raw socket copy one way.

    python benchmarks/replication.py [--mib 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table, median, write_results  # noqa: E402

from resilient.checkpoint.format import rank_file_name, step_dir_name  # noqa: E402
from resilient.checkpoint.replicas import NodeMap, Replicas  # noqa: E402
from resilient.checkpoint.storage import Storage  # noqa: E402


def _raw_both_ways(rank: int, nbytes: int, port: int) -> float:
    """Both processes send ``nbytes`` to each other over one TCP connection; seconds."""
    payload = memoryview(bytearray(os.urandom(1 << 20) * (nbytes >> 20)))
    into = bytearray(nbytes)
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", port))
        conn, _ = srv.accept()
        srv.close()
    else:
        for _ in range(200):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dist.barrier()
    t0 = time.perf_counter()
    sender = threading.Thread(target=conn.sendall, args=(payload,))
    sender.start()
    view, got = memoryview(into), 0
    while got < nbytes:
        got += conn.recv_into(view[got:], nbytes - got)
    sender.join()
    dist.barrier()
    seconds = time.perf_counter() - t0
    conn.close()
    return seconds


def _worker(rank: int, args, port: int, roots: list[str], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    nbytes = args.mib << 20
    storage = Storage(os.path.join(roots[rank], "steps"))
    step_rel = step_dir_name(1)
    storage.makedirs(step_rel)
    own = rank_file_name(rank, 0)
    storage.write_file(f"{step_rel}/{own}", [os.urandom(1 << 20) * args.mib], fsync=False)
    replicas = Replicas(NodeMap((0, 1)), rank, timeout_s=300, spare_dir=roots[rank])
    out: dict[str, list[float]] = {"replication": [], "raw socket, both ways": []}
    out["exchange (one file, one way)"] = []
    out["raw socket, one way"] = []
    for r in range(args.repeats + 1):
        # a new step each time, as after every snapshot: its own file moves along (not timed)
        prev, step_rel = step_rel, step_dir_name(r + 2)
        storage.makedirs(step_rel)
        os.replace(storage.path(f"{prev}/{own}"), storage.path(f"{step_rel}/{own}"))
        dist.barrier()
        t0 = time.perf_counter()
        replicas.replicate(storage, step_rel, own, 0)
        dist.barrier()
        rep = time.perf_counter() - t0
        raw = _raw_both_ways(rank, nbytes, port + 1 + 2 * r)
        # a replaced node: rank 1's node lost rank 1's file; rank 0 holds the replica
        theirs = rank_file_name(1, 0)
        if rank == 1:
            storage.remove(f"{step_rel}/{theirs}")
        dist.barrier()
        t0 = time.perf_counter()
        need = {theirs} if rank == 1 else set()
        files = {rank_file_name(0, 0): nbytes, theirs: nbytes}
        replicas.fetch(storage, step_rel, files, need)
        exchange = time.perf_counter() - t0
        one_way = _raw_one_way(rank, nbytes, port + 2 + 2 * r)
        if r:
            out["replication"].append(rep)
            out["raw socket, both ways"].append(raw)
            out["exchange (one file, one way)"].append(exchange)
            out["raw socket, one way"].append(one_way)
    if rank == 0:
        results.update({k: v for k, v in out.items()})
    dist.destroy_process_group()


def _raw_one_way(rank: int, nbytes: int, port: int) -> float:
    payload = memoryview(bytearray(os.urandom(1 << 20) * (nbytes >> 20)))
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", port))
        dist.barrier()
        conn, _ = srv.accept()
        srv.close()
        t0 = time.perf_counter()
        conn.sendall(payload)
        conn.recv(1)
    else:
        dist.barrier()
        conn = socket.create_connection(("127.0.0.1", port))
        into = memoryview(bytearray(nbytes))
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            got += conn.recv_into(into[got:], nbytes - got)
        conn.sendall(b"k")
    seconds = time.perf_counter() - t0
    conn.close()
    dist.barrier()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    roots = [tempfile.mkdtemp(prefix=f"repl-bench-node{n}-", dir=shm) for n in range(2)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    try:
        mp.spawn(_worker, args=(args, port, roots, results), nprocs=2, join=True)
    finally:
        import shutil

        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    res = {k: list(v) for k, v in results.items()}
    nbytes = args.mib << 20
    rows = []
    for name, anchor, moved in (
        ("replication", "raw socket, both ways", 2 * nbytes),
        ("raw socket, both ways", None, 2 * nbytes),
        ("exchange (one file, one way)", "raw socket, one way", nbytes),
        ("raw socket, one way", None, nbytes),
    ):
        s = median(res[name])
        ratio = f"{median(res[anchor]) / s:.2f}x the raw socket's throughput" if anchor else ""
        rows.append([name, f"{s * 1000:.0f}", f"{moved / s / 2**30:.2f}", ratio])
    print(f"{machine()}; {args.mib} MiB per rank file, 2 processes, medians of {args.repeats}")
    print(markdown_table(["what", "ms", "GiB/s moved", "vs anchor"], rows))
    write_results(args.json, {"mib": args.mib, "samples_s": res, "machine": machine()})


if __name__ == "__main__":
    main()
