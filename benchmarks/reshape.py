"""Resharding benchmark: ``reshape convert`` against the disk and against DCP, side by side.

A state of row-sharded weights, expert tensors (ep x tp) and replicated norms is saved by 4 ranks
in layout (dp1, ep2, tp2), then moved to (dp1, ep1, tp4):

* raw disk: a cold sequential read of the source files plus a sequential write + fsync of the same
  number of bytes (the floor for any conversion that reads everything once and writes it once);
* ``reshape convert`` in a subprocess (cold caches): throughput, and its peak memory above the
  process's baseline against the largest chunk;
* torch.distributed.checkpoint: the same tensors saved by DCP as DTensors, then ``dcp.load`` into
  the new placements by 4 ranks (load-time resharding), and that load followed by ``dcp.save`` in the
  new layout (what a conversion with DCP amounts to).

    python benchmarks/reshape.py [--mib 512] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_load import _drop_caches, run  # noqa: E402
from common import machine, markdown_table  # noqa: E402

SRC = {"dp": 1, "ep": 2, "tp": 2}
DST = {"dp": 1, "ep": 1, "tp": 4}
TARGETS = {"tp4": {"dp": 1, "ep": 1, "tp": 4}, "ep4": {"dp": 1, "ep": 4, "tp": 1}}


def tensors(mib: int) -> dict[str, tuple[tuple[int, ...], str, dict]]:
    """name -> (shape, dtype, placement as {axis: dim})."""
    layers = max(1, mib // 80)
    out = {}
    for i in range(layers):
        out[f"model.layers.{i}.wq"] = ((2048, 2048), "float32", {"tp": 0})  # 16 MiB
        out[f"model.layers.{i}.experts"] = (
            (8, 2048, 2048),
            "bfloat16",
            {"ep": 0, "tp": 2},
        )  # 64 MiB
        out[f"model.layers.{i}.norm"] = ((2048,), "float32", {})
    return out


def _global(name, shape, dtype):
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def save_task(rank, world, url, spec):
    from resilient import Checkpointer, Layout, Shard
    from resilient.checkpoint.state import shard_of

    lay = Layout(**SRC)
    state = {
        k: shard_of(_global(k, s, d), {a: Shard(dim) for a, dim in p.items()}, lay, rank)
        for k, (s, d, p) in spec.items()
    }
    with Checkpointer(url, layout=lay) as ck:
        ck.save(1, state).wait()
    return True


def _mesh_and_placements(sizes, p):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (sizes["ep"], sizes["tp"]), mesh_dim_names=("ep", "tp"))
    return mesh, [Shard(p[a]) if a in p else Replicate() for a in ("ep", "tp")]


def dcp_save_task(rank, world, path, spec):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for k, (s, d, p) in spec.items():
        mesh, placements = _mesh_and_placements(SRC, p)
        state[k] = distribute_tensor(_global(k, s, d), mesh, placements)
    dcp.save(state, checkpoint_id=path)
    return True


def dcp_load_task(rank, world, path, out_path, spec):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for k, (s, d, p) in spec.items():
        mesh, placements = _mesh_and_placements(DST, p)
        state[k] = distribute_tensor(torch.zeros(s, dtype=getattr(torch, d)), mesh, placements)
    dist.barrier()
    if rank == 0:
        _drop_caches()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    dist.barrier()
    load_s = time.perf_counter() - t0
    dcp.save(state, checkpoint_id=out_path)
    for dirpath, _, files in os.walk(out_path):  # durable, like the other writers
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    dist.barrier()
    total_s = time.perf_counter() - t0
    return {"load_s": load_s, "total_s": total_s}


CONVERT_CHILD = r"""
import json, resource, sys, time
import torch  # the fixed overhead: interpreter, torch, the toolkit
import resilient, reshape.execute
from reshape.cli import tune_allocator
tune_allocator()  # as the reshape CLI does
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from reshape.execute import convert
t0 = time.perf_counter()
report = convert(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "base_rss": base, "peak_rss": peak, "bytes_read": report.bytes_read,
                  "bytes_written": report.bytes_written, "largest_chunk": report.largest_chunk_bytes,
                  "batch_bytes": report.batch_bytes}))
"""


def raw_copy(src_root: str, scratch: str) -> tuple[float, int]:
    """Cold sequential read of every source file, then write + fsync of as many bytes."""
    _drop_caches()
    t0 = time.perf_counter()
    total = 0
    for dirpath, _, files in os.walk(src_root):
        for f in sorted(files):
            with open(os.path.join(dirpath, f), "rb") as fh:
                while chunk := fh.read(64 << 20):
                    total += len(chunk)
    read_s = time.perf_counter() - t0
    block = os.urandom(64 << 20)
    t0 = time.perf_counter()
    fd = os.open(os.path.join(scratch, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = total
    while left > 0:
        left -= os.write(fd, block[: min(left, len(block))])
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    os.remove(os.path.join(scratch, "raw.bin"))
    return read_s + write_s, total


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--dir", default=None)
    p.add_argument(
        "--to",
        choices=sorted(TARGETS),
        default="tp4",
        help="tp4: experts re-split along their innermost dim; ep4: experts move whole",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    global DST
    DST = TARGETS[args.to]
    spec = tensors(args.mib)
    root = tempfile.mkdtemp(prefix="reshape-bench-", dir=args.dir)
    src, dst = os.path.join(root, "src"), os.path.join(root, "dst")
    run(save_task, 4, src, spec)
    run(dcp_save_task, 4, os.path.join(root, "dcp"), spec)
    raw_s, raw_bytes = raw_copy(src, root)
    _drop_caches()
    child = subprocess.run(
        [sys.executable, "-c", CONVERT_CHILD, src, dst, json.dumps(DST)],
        capture_output=True,
        text=True,
        check=True,
    )
    ours = json.loads(child.stdout.strip().splitlines()[-1])
    dcp = run(dcp_load_task, 4, os.path.join(root, "dcp"), os.path.join(root, "dcp_out"), spec)
    dcp_load = max(r["load_s"] for r in dcp)
    dcp_total = max(r["total_s"] for r in dcp)
    shutil.rmtree(root, ignore_errors=True)

    written = ours["bytes_written"]
    raw_bw = raw_bytes / raw_s
    ours_bw = written / ours["seconds"]
    extra = ours["peak_rss"] - ours["base_rss"]
    rows = [
        ["raw disk: read + write + fsync", f"{raw_s:.3f}", f"{raw_bw / 2**20:.0f}", "1.00x", "-"],
        [
            "reshape convert",
            f"{ours['seconds']:.3f}",
            f"{ours_bw / 2**20:.0f}",
            f"{ours_bw / raw_bw:.2f}x",
            f"{extra / 2**20:.0f} MiB ({extra / ours['largest_chunk']:.2f}x largest chunk)",
        ],
        [
            "dcp.load into new placements (4 ranks)",
            f"{dcp_load:.3f}",
            f"{written / dcp_load / 2**20:.0f}",
            f"{written / dcp_load / raw_bw:.2f}x",
            "-",
        ],
        [
            "dcp.load + dcp.save in the new layout",
            f"{dcp_total:.3f}",
            f"{written / dcp_total / 2**20:.0f}",
            f"{written / dcp_total / raw_bw:.2f}x",
            "-",
        ],
    ]
    print()
    print(f"machine: {machine()}")
    print(
        f"state: {len(spec)} tensors, {written / 2**20:.0f} MiB; {SRC} -> {DST}; largest chunk "
        f"{ours['largest_chunk'] / 2**20:.0f} MiB; bytes read {ours['bytes_read'] / 2**20:.0f} MiB "
        f"(read / written {ours['bytes_read'] / written:.2f})"
    )
    print(
        markdown_table(
            ["method", "seconds", "MiB/s", "vs raw disk", "peak memory above baseline"], rows
        )
    )
    print(
        f"\nthroughput vs raw disk: {ours_bw / raw_bw:.2f}x (target >= 0.7x); peak memory "
        f"{extra / ours['largest_chunk']:.2f}x largest chunk + baseline {ours['base_rss'] / 2**20:.0f} MiB "
        f"(target <= 4x); vs DCP load: {dcp_load / ours['seconds']:.2f}x faster"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"ours": ours, "raw_s": raw_s, "raw_bytes": raw_bytes, "dcp": dcp}, f, indent=1
            )


if __name__ == "__main__":
    main()
