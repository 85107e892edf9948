"""Save benchmark: one process, the same ~1 GB bf16 state, side by side in one run.

Anchors: a bare copy into preallocated CPU buffers (the floor for a consistent snapshot), a raw
sequential write + fsync of the same bytes (the disk's floor), torch.save, and
torch.distributed.checkpoint save / async_save.  Every writer's total includes making its files
durable (fsync), as the raw write does.  Steady state: each method runs once to warm up, then
``--repeats`` times; medians are reported.

    python benchmarks/checkpoint_save.py [--gib 1.0] [--dir /path/on/the/disk] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fsync_dir_tree, gib, machine, markdown_table, median, write_results  # noqa: E402

from resilient import Checkpointer  # noqa: E402


def make_state(total_bytes: int, num_tensors: int = 64) -> dict[str, torch.Tensor]:
    per = total_bytes // num_tensors // 2
    g = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(per, generator=g)
        .bfloat16()
        .reshape(-1, 1024)[: per // 1024]
        for i in range(num_tensors)
    }


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def bench(args) -> dict:
    state = make_state(int(args.gib * 2**30))
    total = nbytes(state)
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    results: dict[str, dict[str, float]] = {}

    def settle():
        # The disk is shared and writes back lazily: flush what earlier runs left dirty so that
        # every sample of every method starts from the same quiet disk.
        os.sync()
        time.sleep(args.settle_s)

    methods: list[tuple[str, object]] = []

    def run_all():
        """Round-robin: every round runs every method once, so drift hits all methods alike."""
        for _, fn in methods:  # warm-up: allocations, first-touch page faults, imports
            settle()
            fn(-1)
        samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in methods}
        for i in range(args.repeats):
            for name, fn in methods:
                settle()
                samples[name].append(fn(i))
        for name, ss in samples.items():
            results[name] = {k: median([s[k] for s in ss]) for k in ss[0]}
            results[name]["samples"] = ss
            print(
                f"  {name}: "
                + ", ".join(f"{k}={v:.3f}s" for k, v in results[name].items() if k != "samples"),
                flush=True,
            )

    # 1. bare copy into preallocated buffers
    bufs = {k: torch.empty_like(v) for k, v in state.items()}

    def bare_copy(_):
        t0 = time.perf_counter()
        for k, v in state.items():
            bufs[k].copy_(v)
        return {"blocking": time.perf_counter() - t0}

    # 2. raw sequential write + fsync of the same bytes
    flat = torch.empty(total, dtype=torch.uint8)
    pos = 0
    for v in state.values():
        n = v.numel() * 2
        flat[pos : pos + n].copy_(v.reshape(-1).view(torch.uint8))
        pos += n
    mv = memoryview(flat.numpy())

    def raw_write(i):
        path = os.path.join(root, f"raw{i}.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = mv
        while view:
            w = os.write(fd, view[: 64 << 20])
            view = view[w:]
        os.fsync(fd)
        os.close(fd)
        dt = time.perf_counter() - t0
        os.remove(path)
        return {"total": dt}

    # 3. this checkpointer
    ck = Checkpointer(os.path.join(root, "resilient"), keep_last=1)
    step = [0]

    def ours(_):
        step[0] += 1
        ck.wait()  # training saves every N steps; the previous save's cleanup is long done by then
        os.sync()
        t0 = time.perf_counter()
        h = ck.save(step[0], state)
        blocking = time.perf_counter() - t0
        h.wait()
        return {"blocking": blocking, "total": time.perf_counter() - t0}

    # 4. torch.save (+ fsync)
    def tsave(i):
        path = os.path.join(root, f"torch{i}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        os.remove(path)
        return {"blocking": dt, "total": dt}

    # 5. DCP save and async_save
    def dcp_save(i):
        path = os.path.join(root, f"dcp{i}")
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        fsync_dir_tree(path)
        dt = time.perf_counter() - t0
        shutil.rmtree(path)
        return {"blocking": dt, "total": dt}

    def dcp_async(i):
        path = os.path.join(root, f"dcpa{i}")
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path)
        blocking = time.perf_counter() - t0
        fut.result()
        fsync_dir_tree(path)
        dt = time.perf_counter() - t0
        shutil.rmtree(path)
        return {"blocking": blocking, "total": dt}

    print(
        f"state: {len(state)} bf16 tensors, {gib(total)}; dir {root}; {args.repeats} rounds",
        flush=True,
    )
    methods += [
        ("bare copy", bare_copy),
        ("raw write+fsync", raw_write),
        ("resilient", ours),
        ("torch.save", tsave),
        ("dcp.save", dcp_save),
        ("dcp.async_save", dcp_async),
    ]
    run_all()
    ck.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": total, "results": results}


def _spread(samples: list[dict[str, float]]) -> str:
    key = "total" if "total" in samples[0] else "blocking"
    xs = [s[key] for s in samples]
    return f"{min(xs):.3f}-{max(xs):.3f}"


def report(out: dict) -> str:
    r = out["results"]
    copy, raw = r["bare copy"]["blocking"], r["raw write+fsync"]["total"]
    rows = []
    for name in (
        "bare copy",
        "raw write+fsync",
        "resilient",
        "torch.save",
        "dcp.save",
        "dcp.async_save",
    ):
        b, t = r[name].get("blocking"), r[name].get("total")
        rows.append(
            [
                name,
                f"{b:.3f}" if b is not None else "-",
                f"{b / copy:.2f}x" if b is not None else "-",
                f"{t:.3f}" if t is not None else "-",
                f"{t / raw:.2f}x" if t is not None else "-",
                f"{out['bytes'] / t / 2**30:.2f}" if t else "-",
                _spread(r[name]["samples"]),
            ]
        )
    return markdown_table(
        [
            "method",
            "blocking s",
            "blocking / bare copy",
            "total s",
            "total / raw write",
            "GiB/s",
            "total range s",
        ],
        rows,
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--settle-s", type=float, default=1.0, help="pause after os.sync() between samples"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's async path wants a group
    out = bench(args)
    dist.destroy_process_group()
    r = out["results"]
    print()
    print(f"machine: {machine()}")
    print(report(out))
    ours = r["resilient"]
    print()
    print(
        f"blocking vs bare copy: {ours['blocking'] / r['bare copy']['blocking']:.2f}x (target <= 1.3x)"
    )
    print(
        f"blocking vs DCP async_save blocking: {ours['blocking'] / r['dcp.async_save']['blocking']:.2f}x (target <= 0.33x)"
    )
    print(
        f"total vs raw write+fsync: {ours['total'] / r['raw write+fsync']['total']:.2f}x (target <= 1.25x)"
    )
    out["machine"] = machine()
    write_results(args.json, out)


if __name__ == "__main__":
    main()
