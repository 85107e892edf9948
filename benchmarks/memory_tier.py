"""Memory-tier benchmark: one process, the same state, side by side in one run.

- Snapshot stall: how long ``Checkpointer.snapshot`` keeps the caller, against a bare ``copy_``
  of the same tensors into preallocated buffers (the floor for a consistent snapshot).  Measured
  with the previous snapshot's background write finished (a step long enough to hide it), back
  to back (every call also waits for the previous write: a snapshot every step of a step that
  computes nothing), and with a training step's worth of torch compute between two snapshots,
  from a quarter of a bare copy to two copies long.
- Background write: the snapshot's write into the node's memory (tmpfs; serialize, checksum,
  commit), against a bare memcpy and a raw write of the same bytes to the same tmpfs.
- Restore: ``load`` from the memory tier against ``load`` from durable storage on the local disk,
  the same step and state: warm (the disk's files in the page cache, just written) and, where
  this process may drop the page cache (root), cold, as after a reboot or on another node's disk.
  Dropping the cache does not touch the memory tier: tmpfs pages are not cache.

- The fixed cost of a snapshot (a small state: 92 fp32 tensors, 1 MB, as the tiny preset's):
  wall and CPU time per snapshot, from the call to the commit, in one process.
- The persister's work for one durable save (check the snapshot, copy it to the disk, commit),
  timed in this process for its CPU time, against a raw write + fsync of the same bytes.
- Interference (``--interference-runs N``): the reference trainer, ``--interference-preset``
  (``small``) on 2 ranks, a durable save every ``--save-every`` steps: written by the trainer's
  own thread without the memory tier; with the tier (a snapshot at each save), written by the
  trainer's thread (``RESILIENT_PERSISTER=0``) or by the persister process; and no saves.
- Training with the tier (``--trainer-runs N``): the reference trainer, ``--preset`` on 2 ranks
  (dp 2), with a snapshot every step, with none, and with the floor of one (each rank's state
  copied into a buffer and checksummed at every step, nothing else: benchmarks/snapshot_floor.py),
  N rounds of the three, interleaved; the median time between consecutive steps (wall clock, so
  it includes the snapshot's stall) after the first ``--trainer-skip`` (40: the persister's start
  takes over a second of CPU), and per round the ratio to the round's run without snapshots.
  With ``--trainer-parts`` two more kinds: a snapshot every step cut short after the caller's
  part, and after the background checksums (benchmarks/snapshot_parts.py: no commit protocol).
- Training with the tier, on and off in one run (``--trainer-blocks N``): the reference trainer,
  ``--preset`` on 2 ranks, ``--block-steps`` steps, a snapshot every step in every other block of
  ``--block`` steps (benchmarks/snapshot_blocks.py); per run, the median time between steps with
  snapshots and without.  Runs differ from each other more than the effect (rounds of
  ``--trainer-runs`` range widely); within one run both kinds share the processes and the minutes.
  ``--block-commit-every 1,0`` runs each round with committed and with sealed snapshots, and
  ``--block-two-nodes`` adds a run whose two ranks stand for two nodes (a memory root each): every
  snapshot committed and replicated to the peer.  With ``--block-floors`` each run's blocks cycle
  through three kinds, the third the floor of its snapshots: each rank's state copied and
  checksummed, and on two nodes also exchanged with the other rank over a raw socket.

    python benchmarks/memory_tier.py [--gib 0.5] [--dir /path/on/disk] [--repeats 5]
                                     [--trainer-runs 8] [--trainer-parts] [--preset tiny]
                                     [--steps 150] [--trainer-blocks 3] [--block 20]
                                     [--block-steps 400] [--block-commit-every 1,0]
                                     [--block-two-nodes] [--block-floors]
                                     [--interference-runs 2] [--save-every 2] [--skip-bench]
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
from common import (  # noqa: E402
    Samples,
    drop_caches,
    gib,
    machine,
    markdown_table,
    median,
    scratch,
    snapshot_times,
    write_results,
)

from resilient import Checkpointer  # noqa: E402
from resilient.checkpoint.persister import OUTBOX, Promoter, link_to_outbox  # noqa: E402


def make_state(total_bytes: int, num_tensors: int = 64) -> dict[str, torch.Tensor]:
    per = total_bytes // num_tensors // 2
    g = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(per, generator=g).bfloat16().reshape(-1, 1024)
        for i in range(num_tensors)
    }


GAPS = (0.25, 0.5, 1.0, 1.5, 2.0)  # compute between snapshots, in bare copies


def gap_name(frac: float) -> str:
    return f"snapshot stall, {frac:g} bare copies of compute after the previous one"


_A = torch.randn(128, 128)


def compute(seconds: float) -> None:
    """Keep one core busy with torch for ``seconds``, as a training step does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(_A, _A)


def bench(args) -> dict:
    state = make_state(int(args.gib * 2**30))
    total = sum(t.numel() * t.element_size() for t in state.values())
    disk, shm = scratch("mem-bench-", args.dir, args.shm)
    out = Samples()
    add = out.add

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
            # a snapshot after the previous one finished writing, and back to back (the next
            # snapshot at once, so it waits for the previous write)
            stall, write, b2b, step = snapshot_times(ck, step, state)
            # with compute between snapshots (a training step), a fraction of a bare copy long:
            # how much of a step the background work needs before the stall is one copy again
            for frac in GAPS:
                step += 1
                ck.snapshot(step, state)
                compute(frac * bare)
                step += 1
                t0 = time.perf_counter()
                ck.snapshot(step, state)
                gapped = time.perf_counter() - t0
                ck.wait_snapshot()
                if r:
                    add(gap_name(frac), gapped)
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
        # the persister's work for one durable save: check the snapshot's checksums, copy it to
        # the disk, commit (run here, in this process, to time its CPU), against a raw write +
        # fsync of the same bytes to the same disk
        for r in range(args.repeats + 1):
            step += 1
            ck.snapshot(step, state).wait()
            outbox = os.path.join(ck.memory.dir, OUTBOX, "bench")
            promoter = Promoter(
                {**ck._persister_config, "job_dir": ck.memory.dir, "outbox": outbox}
            )
            src = link_to_outbox(ck.memory.steps, step, outbox)
            c0, t0 = time.process_time(), time.perf_counter()
            promoter.persist(step, src)
            persist, persist_cpu = time.perf_counter() - t0, time.process_time() - c0
            promoter.close()
            raw_path = os.path.join(disk, "raw.bin")
            t0 = time.perf_counter()
            with open(raw_path, "wb") as f:
                for v in state.values():
                    f.write(memoryview(v.view(torch.uint8).numpy()))
                f.flush()
                os.fsync(f.fileno())
            raw_disk = time.perf_counter() - t0
            os.unlink(raw_path)
            if r:
                add("persister: check, copy to disk, commit", persist)
                add("persister: its CPU time", persist_cpu)
                add("raw write + fsync to the disk", raw_disk)
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
        # restore of a sealed snapshot (memory_commit_every=0): the load commits it first
        # (checks every file against its record's checksums, computes the manifest's, publishes)
        sealed = Checkpointer(os.path.join(disk, "sealed"), memory_every=1, memory_commit_every=0)
        for r in range(args.repeats + 1):
            step += 1
            sealed.snapshot(step, state).wait()
            t0 = time.perf_counter()
            assert sealed.load(target) == step
            took = time.perf_counter() - t0
            assert sealed.last_load.source == "memory" and sealed.last_load.sealed
            if r:
                add("restore from memory, a sealed snapshot (committed by the load)", took)
        assert all(torch.equal(target[k], state[k]) for k in state)
        sealed.release_memory()
        sealed.close()
        ck.release_memory()
        ck.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    medians = {k: median(v) for k, v in out.items()}
    return {"bytes": total, "median_s": medians, "samples_s": out, "machine": machine()}


def small_state(args) -> dict[str, float]:
    """The fixed cost of a snapshot: a small state (``--small-tensors`` fp32 tensors, 1 MB in
    all, as the tiny preset's), one process, from the call to the commit; wall and CPU time of
    this process (the trainer's thread and the snapshot's background thread) per snapshot.  The
    same for a sealed snapshot (``memory_commit_every=0``: the call to its staged record), the two
    kinds alternately, three times each."""
    g = torch.Generator().manual_seed(0)
    n = args.small_tensors
    state = {f"l{i}.w": torch.randn(2**20 // 4 // n, generator=g) for i in range(n)}
    disk = tempfile.mkdtemp(prefix="mem-bench-small-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="mem-bench-small-", dir=args.shm)
    os.environ["RESILIENT_MEMORY_ROOT"] = shm
    out: dict[int, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in (1, 0)}
    try:
        for r in range(3):
            for every in (1, 0):
                ck = Checkpointer(
                    os.path.join(disk, f"ckpt-{r}-{every}"),
                    memory_every=1,
                    memory_commit_every=every,
                )
                for step in range(1, 31):  # warm-up
                    ck.snapshot(step, state).wait()
                count = args.small_snapshots
                c0, t0 = time.process_time(), time.perf_counter()
                for step in range(31, 31 + count):
                    ck.snapshot(step, state).wait()
                out[every]["wall"].append((time.perf_counter() - t0) / count)
                out[every]["cpu"].append((time.process_time() - c0) / count)
                ck.release_memory()
                ck.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return {
        "wall_s": median(out[1]["wall"]),
        "cpu_s": median(out[1]["cpu"]),
        "sealed_wall_s": median(out[0]["wall"]),
        "sealed_cpu_s": median(out[0]["cpu"]),
        "tensors": n,
    }


TRAINER_KINDS = ("no snapshots", "a snapshot every step", "the floor: copy + crc32 every step")
# --trainer-parts: a snapshot every step cut short (benchmarks/snapshot_parts.py)
PART_KINDS = {
    "staged only (the caller's part)": "staged",
    "staged + checksums, no commit": "checksummed",
}


def trainer_runs(args) -> dict[str, list[float]]:
    """Median seconds between steps of the reference trainer, per run, interleaved: no
    snapshots, a snapshot every step, and the floor of one (benchmarks/snapshot_floor.py: the
    same rank's state copied into a buffer and checksummed at every step, nothing else).  The
    first ``--trainer-skip`` steps are dropped: they hold the start of the persister process (its
    imports, over a second of CPU) and the first allocations."""
    kinds = [*TRAINER_KINDS, *(PART_KINDS if args.trainer_parts else ())]
    out: dict[str, list[float]] = {k: [] for k in kinds}
    root = tempfile.mkdtemp(prefix="mem-bench-trainer-", dir=args.dir)
    memory = tempfile.mkdtemp(prefix="mem-bench-trainer-", dir=args.shm)  # host memory, not disk
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_MEMORY_ROOT": memory}
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        for r in range(args.trainer_runs):
            for i, name in enumerate(kinds):
                d = os.path.join(root, f"{r}-{i}")
                flags = [
                    "--dp", "2", "--preset", args.preset, "--steps", str(args.steps),
                    "--ckpt", d + "/ckpt", "--metrics", d + "/metrics.jsonl",
                ]  # fmt: skip
                if i == 0:
                    cmd = [sys.executable, "-m", "reference_trainer", "--nproc", "2", *flags]
                elif i == 1:
                    cmd = [sys.executable, "-m", "reference_trainer", "--nproc", "2", *flags]
                    cmd += ["--memory-every", "1"]
                elif i == 2:
                    cmd = [
                        sys.executable, "-m", "resilient.cli", "launch", "--standalone",
                        "--nproc-per-node", "2", os.path.join(here, "snapshot_floor.py"), *flags,
                    ]  # fmt: skip
                else:
                    cmd = [
                        sys.executable, "-m", "resilient.cli", "launch", "--standalone",
                        "--nproc-per-node", "2", os.path.join(here, "snapshot_parts.py"),
                        "--part", PART_KINDS[name], *flags, "--memory-every", "1",
                    ]  # fmt: skip
                subprocess.run(cmd, check=True, env=env, capture_output=True)
                with open(d + "/metrics.jsonl") as f:
                    times = [json.loads(line)["wall_time"] for line in f if line.strip()]
                gaps = [b - a for a, b in zip(times, times[1:])][args.trainer_skip :]
                out[name].append(median(gaps))
                shutil.rmtree(d, ignore_errors=True)
            print(
                f"  round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in out.items()),
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return out


def block_kinds(args) -> list[tuple[int, bool, str | None]]:
    """The runs of a round of --trainer-blocks: (--memory-commit-every, two nodes, the floor in
    a third kind of block: "copy", "replica" or None)."""
    kinds: list[tuple[int, bool, str | None]] = [(k, False, None) for k in args.block_commit_every]
    if args.block_two_nodes:
        kinds.append((1, True, None))
    if args.block_floors:  # each run's third kind of block: the floor of its snapshots
        kinds = [(k, two, "replica" if two else "copy") for k, two, _ in kinds]
    if args.block_sealed_replica:  # sealed on one node, and a third kind with a raw replica
        kinds.append((0, False, "sealed-replica"))
    return kinds


def block_kind_name(commit_every: int, two_nodes: bool) -> str:
    where = ", two nodes (committed, a replica each)" if two_nodes else ""
    return f"--memory-commit-every {commit_every}{where}"


def trainer_blocks(args) -> list[dict[str, float]]:
    """Per run of benchmarks/snapshot_blocks.py (a snapshot every step in alternate blocks of
    ``--block`` steps): the median time between steps with snapshots and without, after the
    first ``--trainer-skip`` steps.  With several ``--block-commit-every`` values each round runs
    each of them, one after the other."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from snapshot_blocks import run_blocks

    root = tempfile.mkdtemp(prefix="mem-bench-blocks-", dir=args.dir)
    memory = tempfile.mkdtemp(prefix="mem-bench-blocks-", dir=args.shm)
    out = []
    try:
        kinds = block_kinds(args)
        for r in range(args.trainer_blocks):
            for i, (k, split, floor) in enumerate(kinds):
                res = run_blocks(
                    os.path.join(root, f"{r}-{i}"),
                    preset=args.preset,
                    steps=args.block_steps,
                    block=args.block,
                    skip=args.trainer_skip,
                    part=args.block_part,
                    env={"RESILIENT_MEMORY_ROOT": memory},
                    commit_every=k,
                    split_nodes=split,
                    floor=floor,
                )
                res["kind"] = i
                out.append(res)
                print(
                    f"  run {r}, {block_kind_name(k, split)}: without "
                    f"{res['off'] * 1e3:.1f} ms, "
                    f"with a snapshot every step {res['on'] * 1e3:.1f} ms "
                    f"({res['on'] / res['off'] - 1:+.1%}; {res['steps']} steps each way)"
                    + (
                        f"; its floor ({floor}) {res['floor'] * 1e3:.1f} ms "
                        f"({res['floor'] / res['off'] - 1:+.1%})"
                        if "floor" in res
                        else ""
                    ),
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return out


INTERFERENCE = {
    "no saves": ["--save-every", "0"],
    "saves from the trainer's thread": ["--save-every", "{k}"],
    "memory tier, saves from the trainer's thread": [
        "--save-every", "{k}", "--memory-every", "{k}", "env:RESILIENT_PERSISTER=0",
    ],
    "memory tier, saves through the persister": ["--save-every", "{k}", "--memory-every", "{k}"],
}  # fmt: skip


def interference_runs(args) -> dict[str, dict[str, list[float]]]:
    """The reference trainer (``--preset``, 2 ranks, dp 2) with a durable save every
    ``--save-every`` steps written by the trainer's own background thread, the same saves handed
    to the persister process (the memory tier: a snapshot of the step into the node's memory,
    copied to durable storage by another process), and no saves; interleaved runs.  Per run: the
    median time between consecutive steps after ``--warmup`` steps, and the median of the steps
    right after a save (their gap holds the save's stall and the start of its background work)."""
    out: dict[str, dict[str, list[float]]] = {
        name: {"median": [], "after a save": []} for name in INTERFERENCE
    }
    root = tempfile.mkdtemp(prefix="mem-bench-interference-", dir=args.dir)
    memory = tempfile.mkdtemp(prefix="mem-bench-interference-", dir=args.shm)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_MEMORY_ROOT": memory}
    k = args.save_every
    try:
        for r in range(args.interference_runs):
            for i, (name, flags) in enumerate(INTERFERENCE.items()):
                d = os.path.join(root, f"{r}-{i}")
                extra_env = dict(f[4:].split("=", 1) for f in flags if f.startswith("env:"))
                cmd = [
                    sys.executable, "-m", "reference_trainer", "--nproc", "2", "--dp", "2",
                    "--preset", args.interference_preset, "--steps", str(args.interference_steps),
                    "--ckpt", d + "/ckpt", "--metrics", d + "/metrics.jsonl",
                    *[f.format(k=k) for f in flags if not f.startswith("env:")],
                ]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, env={**env, **extra_env}, capture_output=True)
                print(f"  {name}: run {r} took {time.perf_counter() - t0:.0f}s", flush=True)
                with open(d + "/metrics.jsonl") as f:
                    rows = [json.loads(line) for line in f if line.strip()]
                wall = {row["step"]: row["wall_time"] for row in rows}
                gaps = {s: wall[s] - wall[s - 1] for s in wall if s - 1 in wall and s > args.warmup}
                after = [g for s, g in gaps.items() if (s - 1) % k == 0]
                out[name]["median"].append(median(list(gaps.values())))
                out[name]["after a save"].append(median(after))
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
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
    p.add_argument("--interference-runs", type=int, default=0)
    p.add_argument("--interference-preset", default="small")
    p.add_argument("--interference-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--trainer-skip", type=int, default=40, help="steps dropped at the start")
    p.add_argument(
        "--trainer-parts",
        action="store_true",
        help="the trainer runs also cut a snapshot short: staged only, and staged + checksums "
        "(benchmarks/snapshot_parts.py)",
    )
    p.add_argument(
        "--trainer-blocks",
        type=int,
        default=0,
        help="runs of the trainer with snapshots on and off in alternate blocks of steps "
        "(benchmarks/snapshot_blocks.py)",
    )
    p.add_argument("--block", type=int, default=20, help="steps per block (--trainer-blocks)")
    p.add_argument("--block-steps", type=int, default=400, help="steps per run (--trainer-blocks)")
    p.add_argument(
        "--block-part",
        choices=("staged", "checksummed"),
        default=None,
        help="(--trainer-blocks) cut every snapshot short (benchmarks/snapshot_parts.py)",
    )
    p.add_argument(
        "--block-commit-every",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1],
        help="(--trainer-blocks) the trainer's --memory-commit-every, or several (1,0): each "
        "round runs each, one after the other",
    )
    p.add_argument(
        "--block-two-nodes",
        action="store_true",
        help="(--trainer-blocks) each round also runs the two ranks as two nodes (a memory root "
        "each): every snapshot committed and sent to the peer as its replica",
    )
    p.add_argument(
        "--block-floors",
        action="store_true",
        help="(--trainer-blocks) each run's blocks cycle through three kinds: none, a snapshot "
        "every step, and its floor (the rank's state copied and checksummed, "
        "benchmarks/snapshot_floor.py; on two nodes also exchanged with the other rank over a "
        "raw socket)",
    )
    p.add_argument(
        "--block-sealed-replica",
        action="store_true",
        help="(--trainer-blocks) each round also runs sealed snapshots on one node with a third "
        "kind of block: the sealed snapshot and a raw socket exchange of its bytes with the other "
        "rank (the least a sealed snapshot with a peer replica would cost; not built)",
    )
    p.add_argument("--skip-bench", action="store_true", help="only the trainer runs")
    p.add_argument("--small-tensors", type=int, default=92)
    p.add_argument("--small-snapshots", type=int, default=400)
    args = p.parse_args()
    res = {"median_s": {}, "bytes": 0, "machine": machine()} if args.skip_bench else bench(args)
    if not args.skip_bench:
        res["small_state"] = small = small_state(args)
    if args.trainer_runs:
        res["trainer_step_s"] = trainer_runs(args)
    m = res["median_s"]
    total = res["bytes"]
    floor = {
        "snapshot stall": "bare copy",
        "snapshot stall, back to back": "bare copy",
        **{gap_name(f): "bare copy" for f in GAPS},
        "background write to memory": "raw write to tmpfs",
        "restore from memory": "restore from durable (local disk, page cache)",
        "restore from durable (local disk, cold)": "restore from memory",
        "restore from memory, a sealed snapshot (committed by the load)": "restore from memory",
        "persister: check, copy to disk, commit": "raw write + fsync to the disk",
    }
    rows = []
    for name, s in m.items():
        ratio = f"{s / m[floor[name]]:.2f}x {floor[name]}" if name in floor else ""
        rows.append([name, f"{s * 1000:.0f}", f"{total / s / 2**30:.2f}", ratio])
    if rows:
        print(f"{res['machine']}; state {gib(total)} in 64 bf16 tensors, medians of {args.repeats}")
        print(markdown_table(["what", "ms", "GiB/s", "ratio"], rows))
    if not args.skip_bench:
        print(
            f"\nsmall state ({small['tensors']} fp32 tensors, 1 MB), one process, call to commit: "
            f"{small['wall_s'] * 1000:.1f} ms per snapshot, {small['cpu_s'] * 1000:.1f} ms of CPU; "
            f"sealed (call to record): {small['sealed_wall_s'] * 1000:.1f} ms, "
            f"{small['sealed_cpu_s'] * 1000:.1f} ms of CPU (medians of 3)"
        )
    if args.interference_runs:
        res["interference_s"] = t = interference_runs(args)
        base = median(t["no saves"]["median"])
        rows = []
        for name, v in t.items():
            med, after = median(v["median"]), median(v["after a save"])
            rows.append(
                [name, f"{med:.2f}", f"{(med / base - 1) * 100:+.0f}%", f"{after:.2f}",
                 f"{(after / base - 1) * 100:+.0f}%"]
            )  # fmt: skip
        print(
            f"\ntrainer, preset {args.interference_preset}, 2 ranks (dp 2), "
            f"{args.interference_steps} steps, a save every {args.save_every}; median of "
            f"{args.interference_runs} runs"
        )
        print(
            markdown_table(
                ["saves", "median step s", "vs no saves", "step after a save s", "vs no saves"],
                rows,
            )
        )
    if args.trainer_runs:
        t = res["trainer_step_s"]
        off = t["no snapshots"]
        rows = []
        for name, v in t.items():
            ratios = [on / o for on, o in zip(v, off)]
            rows.append(
                [name, f"{median(v) * 1000:.1f}", f"{(median(ratios) - 1) * 100:+.1f}%",
                 f"{(min(ratios) - 1) * 100:+.1f}% .. {(max(ratios) - 1) * 100:+.1f}%"]
            )  # fmt: skip
        print(
            f"\ntrainer, preset {args.preset}, 2 ranks (dp 2), {args.steps} steps (the first "
            f"{args.trainer_skip} dropped), {args.trainer_runs} interleaved rounds"
        )
        print(
            markdown_table(
                ["every step", "median gap ms", "vs none (median of rounds)", "rounds' range"],
                rows,
            )
        )
    if args.trainer_blocks:
        res["trainer_blocks_s"] = b = trainer_blocks(args)
        print(
            f"\ntrainer, preset {args.preset}, 2 ranks (dp 2), {args.block_steps} steps in blocks "
            f"of {args.block} (the first {args.trainer_skip} steps and two per block dropped), "
            + (
                "blocks of three kinds: none, a snapshot every step, its floor"
                if args.block_floors
                else "snapshots every step in every other block"
            )
            + (f" (cut short: {args.block_part})" if args.block_part else "")
            + f"; {args.trainer_blocks} runs"
        )
        rows = []
        floors = args.block_floors or args.block_sealed_replica
        for i, kind in enumerate(block_kinds(args)):
            mine = [x for x in b if x["kind"] == i]
            name = block_kind_name(*kind[:2])
            if kind[2] == "sealed-replica":
                name += " (its 'floor': the snapshot and a raw replica of its bytes)"
            has = bool(mine) and all("floor" in x for x in mine)
            for x in mine:
                row = [name, f"{x['off'] * 1e3:.1f}", f"{x['on'] * 1e3:.1f}"]
                row.append(f"{x['on'] / x['off'] - 1:+.1%}")
                if floors:
                    row += (
                        [f"{x['floor'] * 1e3:.1f}", f"{x['floor'] / x['off'] - 1:+.1%}"]
                        + [f"{x['on'] / x['floor'] - 1:+.1%}"]
                        if has
                        else ["", "", ""]
                    )
                rows.append(row)
            row = [name, "median", "", f"{median([x['on'] / x['off'] for x in mine]) - 1:+.1%}"]
            if floors:
                row += (
                    ["", f"{median([x['floor'] / x['off'] for x in mine]) - 1:+.1%}"]
                    + [f"{median([x['on'] / x['floor'] for x in mine]) - 1:+.1%}"]
                    if has
                    else ["", "", ""]
                )
            rows.append(row)
        head = ["every step in the blocks with", "without ms", "with ms", "with vs without"]
        if floors:
            head += ["floor ms", "floor vs without", "with vs floor"]
        print(markdown_table(head, rows))
    write_results(args.json, res)


if __name__ == "__main__":
    main()
