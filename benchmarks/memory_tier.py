"""Memory-tier benchmark: one process, the same state, side by side in one run.

- Snapshot stall: how long ``Checkpointer.snapshot`` keeps the caller, against a bare ``copy_``
  of the same tensors into preallocated buffers (the floor for a consistent snapshot).  Measured
  twice: with the previous snapshot's background write finished (a step long enough to hide it),
  and back to back (every call also waits for the previous write: the worst case of a snapshot
  every step).
- Background write: the snapshot's write into the node's memory (tmpfs; serialize, checksum,
  commit), against a bare memcpy and a raw write of the same bytes to the same tmpfs.
- Restore: ``load`` from the memory tier against ``load`` from durable storage on the local disk,
  the same step and state: warm (the disk's files in the page cache, just written) and, where
  this process may drop the page cache (root), cold, as after a reboot or on another node's disk.
  Dropping the cache does not touch the memory tier: tmpfs pages are not cache.

- Training with the tier (``--trainer-runs N``): the reference trainer, ``--preset`` on 2 ranks
  (dp 2), with a snapshot every step against none, N runs of each, interleaved; the median time
  between consecutive steps (wall clock, so it includes the snapshot's stall) after the first 5.

    python benchmarks/memory_tier.py [--gib 0.5] [--dir /path/on/disk] [--repeats 5]
                                     [--trainer-runs 3] [--preset tiny] [--steps 40]
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import drop_caches, gib, machine, markdown_table, median, write_results  # noqa: E402

from resilient import Checkpointer  # noqa: E402


def make_state(total_bytes: int, num_tensors: int = 64) -> dict[str, torch.Tensor]:
    per = total_bytes // num_tensors // 2
    g = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(per, generator=g).bfloat16().reshape(-1, 1024)
        for i in range(num_tensors)
    }


def bench(args) -> dict:
    state = make_state(int(args.gib * 2**30))
    total = sum(t.numel() * t.element_size() for t in state.values())
    disk = tempfile.mkdtemp(prefix="mem-bench-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="mem-bench-", dir=args.shm)
    os.environ["RESILIENT_MEMORY_ROOT"] = shm
    out: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        out.setdefault(name, []).append(seconds)

    try:
        buffers = {k: torch.empty_like(v) for k, v in state.items()}
        ck = Checkpointer(os.path.join(disk, "ckpt"), memory_every=1)
        step = 0
        for r in range(args.repeats + 1):
            # bare copy: the floor
            t0 = time.perf_counter()
            for k, v in state.items():
                buffers[k].copy_(v)
            bare = time.perf_counter() - t0
            # a snapshot after the previous one finished writing
            ck.wait_snapshot()
            step += 1
            t0 = time.perf_counter()
            h = ck.snapshot(step, state)
            stall = time.perf_counter() - t0
            h.wait()
            write = time.perf_counter() - t0 - stall
            # back to back: the next snapshot at once, so it waits for the previous write
            step += 1
            h = ck.snapshot(step, state)
            t0 = time.perf_counter()
            step += 1
            ck.snapshot(step, state)
            b2b = time.perf_counter() - t0
            ck.wait_snapshot()
            # raw write of the same bytes into the same tmpfs
            raw_path = os.path.join(shm, "raw.bin")
            t0 = time.perf_counter()
            with open(raw_path, "wb") as f:
                for v in buffers.values():
                    f.write(memoryview(v.view(torch.uint8).numpy()))
            raw = time.perf_counter() - t0
            os.unlink(raw_path)
            if r == 0:
                continue  # warm-up
            add("bare copy", bare)
            add("snapshot stall", stall)
            add("snapshot stall, back to back", b2b)
            add("background write to memory", write)
            add("raw write to tmpfs", raw)
        # restore: memory against durable (the same step in both tiers)
        step += 1
        ck.snapshot(step, state).wait()
        ck.save(step, state).wait()
        target = {k: torch.empty_like(v) for k, v in state.items()}
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            ck.load(target, step=step)
            mem = time.perf_counter() - t0
            assert ck.last_load.source == "memory"
            durable = Checkpointer(os.path.join(disk, "ckpt"))
            t0 = time.perf_counter()
            durable.load(target, step=step)
            dur = time.perf_counter() - t0
            cold = None
            if drop_caches():
                t0 = time.perf_counter()
                durable.load(target, step=step)
                cold = time.perf_counter() - t0
            durable.close()
            if r:
                add("restore from memory", mem)
                add("restore from durable (local disk, page cache)", dur)
                if cold is not None:
                    add("restore from durable (local disk, cold)", cold)
        assert all(torch.equal(target[k], state[k]) for k in state)
        ck.release_memory()
        ck.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    medians = {k: median(v) for k, v in out.items()}
    return {"bytes": total, "median_s": medians, "samples_s": out, "machine": machine()}


def trainer_runs(args) -> dict[str, list[float]]:
    """Median seconds between steps of the reference trainer, per run, with and without a
    snapshot every step."""
    out: dict[str, list[float]] = {"no snapshots": [], "a snapshot every step": []}
    root = tempfile.mkdtemp(prefix="mem-bench-trainer-", dir=args.dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_MEMORY_ROOT": os.path.join(root, "m")}
    try:
        for r in range(args.trainer_runs):
            for name, extra in (
                ("no snapshots", []),
                ("a snapshot every step", ["--memory-every", "1"]),
            ):
                d = os.path.join(root, f"{r}-{len(extra)}")
                cmd = [
                    sys.executable, "-m", "reference_trainer", "--nproc", "2", "--dp", "2",
                    "--preset", args.preset, "--steps", str(args.steps), "--ckpt", d + "/ckpt",
                    "--metrics", d + "/metrics.jsonl", *extra,
                ]  # fmt: skip
                subprocess.run(cmd, check=True, env=env, capture_output=True)
                with open(d + "/metrics.jsonl") as f:
                    times = [json.loads(line)["wall_time"] for line in f if line.strip()]
                gaps = [b - a for a, b in zip(times, times[1:])][5:]
                out[name].append(median(gaps))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--dir", default=None, help="durable storage (a local disk); default: $TMPDIR")
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--trainer-runs", type=int, default=0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    res = bench(args)
    if args.trainer_runs:
        res["trainer_step_s"] = trainer_runs(args)
    m = res["median_s"]
    total = res["bytes"]
    floor = {
        "snapshot stall": "bare copy",
        "snapshot stall, back to back": "bare copy",
        "background write to memory": "raw write to tmpfs",
        "restore from memory": "restore from durable (local disk, page cache)",
        "restore from durable (local disk, cold)": "restore from memory",
    }
    rows = []
    for name, s in m.items():
        ratio = f"{s / m[floor[name]]:.2f}x {floor[name]}" if name in floor else ""
        rows.append([name, f"{s * 1000:.0f}", f"{total / s / 2**30:.2f}", ratio])
    print(f"{res['machine']}; state {gib(total)} in 64 bf16 tensors, medians of {args.repeats}")
    print(markdown_table(["what", "ms", "GiB/s", "ratio"], rows))
    if args.trainer_runs:
        t = res["trainer_step_s"]
        off, on = median(t["no snapshots"]), median(t["a snapshot every step"])
        print(
            f"\ntrainer, preset {args.preset}, 2 ranks (dp 2), {args.steps} steps, median of "
            f"{args.trainer_runs} runs' median step: no snapshots {off * 1000:.1f} ms, a "
            f"snapshot every step {on * 1000:.1f} ms ({(on / off - 1) * 100:+.1f}%)"
        )
    write_results(args.json, res)


if __name__ == "__main__":
    main()
