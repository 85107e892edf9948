"""Where a committed memory snapshot's background work goes on two nodes, part by part.

Two processes on this host stand for two nodes (as ``benchmarks/replica_cpu.py``: two memory
roots, a gloo group over loopback, the replicas on the tier's own connections), each snapshotting
``--mib`` of fp32 state (92 tensors, as the tiny preset's) ``--snapshots`` times back to back,
every snapshot committed and replicated to the other.  Each part of the commit and the
replication is timed on its own thread with ``time.thread_time()`` (the functions are wrapped in
this process only; nothing in the library changes), so a part's figure is the CPU that thread
spent in it, nested parts included: a part is a share of its caller's figure, not an addition to
it.  Per snapshot, averaged over the run; ``calls`` is calls per snapshot.

    python benchmarks/commit_parts.py [--snapshots 300] [--mib 1.8] [--commit-every 0]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import sys
import tempfile
import time

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table  # noqa: E402
from replica_cpu import WARM, _snapshots  # noqa: E402

# (module, owner in it or None for the module itself, function, label)
_PARTS = [
    ("checkpointer", "Checkpointer", "_persist", "the background work of one snapshot"),
    ("checkpointer", "Checkpointer", "_begin", "taking the lease and the generation (rank 0)"),
    ("checkpointer", "Checkpointer", "_coordinate", "the commit's coordination (rank 0)"),
    ("checkpointer", None, "build_manifest", "building the manifest (rank 0)"),
    ("checkpointer", None, "publish_commit", "publishing the manifest, retention"),
    ("checkpointer", None, "scan", "listing the steps (rank 0)"),
    ("checkpointer", "Checkpointer", "_publish_on_this_node", "the manifest on the other node"),
    ("checkpointer", None, "delete_dirs", "deleting the retired step"),
    ("lease", "WriterLease", "check", "lease checks"),
    ("slots", "Slots", "persist", "the file's checksums and move"),
    ("replicas", "Replicas", "replicate", "the replication"),
    ("writer", "Committer", "gather", "gathering the reports (rank 0)"),
    ("writer", "Committer", "report", "sending the report (rank 1)"),
    # sealed snapshots (--commit-every 0): the copy, its record, and the pair sent to the peer
    ("slots", "Slots", "stage", "the copy, its checksums and its record (main thread)"),
    ("checkpointer", "Checkpointer", "_replicate_sealed", "a sealed snapshot's background work"),
    ("replicas", "Replicas", "replicate_sealed", "the pair sent and the source's received"),
    ("replicas", None, "_write_peer_record", "the received pair's record"),
    ("replicas", "Replicas", "_drop_older", "dropping the source's older pair"),
    ("slots", "Slots", "seal", "keeping the sealed slot"),
]


def _instrument(acc: dict, calls: collections.Counter) -> None:
    import importlib

    for module, owner, name, label in _PARTS:
        mod = importlib.import_module(f"resilient.checkpoint.{module}")
        holder = getattr(mod, owner) if owner else mod
        fn = getattr(holder, name)

        def timed(*a, _fn=fn, _label=label, **k):
            t = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] += time.thread_time() - t
                calls[_label] += 1

        setattr(holder, name, functools.wraps(fn)(timed))


def _rank(rank: int, port: int, base: str, args, out) -> None:
    acc: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    _instrument(acc, calls)
    _snapshots(rank, port, base, "links", args, out)
    n = args.snapshots + WARM  # (_snapshots' warm-up snapshots run through the parts too)
    out[("parts", rank)] = {k: (v / n, calls[k] / n) for k, v in acc.items()}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--snapshots", type=int, default=300)
    p.add_argument("--mib", type=float, default=1.8, help="each rank's state")
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument(
        "--commit-every",
        type=int,
        default=1,
        help="memory_commit_every (0: every snapshot sealed and its pair sent to the other node)",
    )
    args = p.parse_args()
    from resilient.launch import free_port

    out = mp.Manager().dict()
    base = tempfile.mkdtemp(dir=args.shm, prefix="commit-parts-")
    try:
        mp.spawn(_rank, args=(free_port(), base, args, out), nprocs=2)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"{machine()}; two processes as two nodes, {args.mib} MiB of fp32 state each (92 "
        f"tensors), {args.snapshots} snapshots back to back (memory_commit_every="
        f"{args.commit_every}), each replicated; thread "
        f"CPU ms per snapshot in each part (nested parts included in their callers')"
    )
    parts = [label for *_, label in _PARTS]
    rows = []
    for label in parts:
        cells = []
        for rank in (0, 1):
            ms, n = out[("parts", rank)].get(label, (0.0, 0.0))
            cells.append(f"{ms * 1e3:.3f} ({n:.1f} calls)" if n else "-")
        rows.append([label, *cells])
    for rank in (0, 1):
        per, _ = out[("links", rank)]
        rows.append([f"rank {rank}: the whole process, wall per snapshot", "", ""])
        rows[-1][1 + rank] = f"{per['the process'] * 1e3:.2f}, {per['wall per snapshot'] * 1e3:.2f}"
    print(markdown_table(["part", "rank 0", "rank 1"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
