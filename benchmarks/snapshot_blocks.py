"""A snapshot every step against none, inside one training run: the reference trainer with the
memory tier, its snapshots switched on and off in alternate blocks of steps.

Two runs of the same job on this machine differ by more than the effect to measure (the tiny
preset's median step ranged from 28 to 33 ms between runs without snapshots in one sitting, and a
round's ratio of a run with snapshots to one without from 1.04 to 1.33). Here the two kinds share
the processes, the placement on the cores, and the minutes: blocks of ``--block`` steps alternate,
starting without snapshots, and each step's time is filed under the kind of the block it belongs
to. The first two steps of each block are dropped (the snapshot before a block's first step, or
its commit, belongs to the kind before it).

The switch is a hook that sets ``Run.memory_every`` at each step (1, or None for no snapshot);
the tier itself (its directory, the persister process, the worker thread) stays up throughout, as
in any run with the tier. This patches nothing in the library.

With ``--floor copy`` (or ``replica``) the blocks cycle through three kinds: none, a snapshot
every step, and the floor of one (the rank's state copied into a buffer and checksummed; with
``replica`` also exchanged with the other rank over a raw socket), so that the snapshot is set
against its floor within one run as well.  With ``--floor sealed-replica`` (one node, sealed
snapshots) the third kind is the snapshot and a raw socket exchange of as many bytes with the
other rank: the least that sealed snapshots with a peer replica each step would cost.

With ``--part staged`` or ``--part checksummed`` every snapshot is cut short as
benchmarks/snapshot_parts.py does: what the caller's part alone costs, measured the same way.

Run by ``benchmarks/memory_tier.py --trainer-blocks N [--block-part staged]``, under ``resilient launch`` with the
reference trainer's own flags (``--memory-every 1`` included: it sets the tier up)::

    python -m resilient.cli launch --standalone --nproc-per-node 2 benchmarks/snapshot_blocks.py \\
        --block 20 --dp 2 --preset tiny --steps 400 --memory-every 1 --ckpt DIR --metrics FILE
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DROP = 2  # steps dropped at the start of each block


def kind_of(step: int, block: int, kinds: int = 2) -> int:
    """The kind of the block ``step`` is in: 0 none, 1 a snapshot, 2 (of three) the floor."""
    return ((step - 1) // block) % kinds


def kept(step: int, block: int) -> bool:
    """Whether the time of ``step`` (from the end of the step before) counts."""
    return (step - 1) % block >= DROP


def run_blocks(
    out_dir: str,
    *,
    preset: str = "tiny",
    steps: int = 400,
    block: int = 20,
    skip: int = 40,
    part: str | None = None,
    tree: str | None = None,
    env: dict[str, str] | None = None,
    commit_every: int = 1,
    split_nodes: bool = False,
    floor: str | None = None,
) -> dict[str, float]:
    """(the driver) One run: the median seconds between steps with snapshots ("on") and without
    ("off"), after the first ``skip`` steps.  ``tree``: a checkout whose library and trainer to
    measure (default: this one); ``env`` should give the run a RESILIENT_MEMORY_ROOT of its own;
    ``commit_every``: the trainer's ``--memory-commit-every`` (1: every snapshot committed);
    ``split_nodes``: each rank's memory tier under a root of its own (a directory of the
    RESILIENT_MEMORY_ROOT ``env`` gives), so that each rank stands for a node: every snapshot is
    committed and sent to the other rank as its peer replica; ``floor`` ("copy" or "replica"):
    three kinds of blocks, the third with the floor of a snapshot instead (``"floor"``, the
    median seconds between its steps: Blocks)."""
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    if tree is not None:
        env["RESILIENT_BENCH_TREE"] = tree
        env["PYTHONPATH"] = tree  # (the launcher too)
    cmd = [
        sys.executable, "-m", "resilient.cli", "launch", "--standalone", "--nproc-per-node", "2",
        os.path.join(HERE, "snapshot_blocks.py"), "--block", str(block), "--dp", "2",
        "--preset", preset, "--steps", str(steps), "--memory-every", "1",
        "--ckpt", out_dir + "/ckpt", "--metrics", out_dir + "/metrics.jsonl",
        *(["--part", part] if part else []),
        *(["--memory-commit-every", str(commit_every)] if commit_every != 1 else []),
        *(["--split-nodes"] if split_nodes else []),
        *(["--floor", floor] if floor else []),
    ]  # fmt: skip
    try:
        subprocess.run(
            cmd,
            check=True,
            env=env,
            capture_output=True,
            cwd=tree or os.getcwd(),
            timeout=600 + 2 * steps,  # (a step takes tens of milliseconds)
        )
        with open(out_dir + "/metrics.jsonl") as f:
            wall = {
                row["step"]: row["wall_time"] for row in map(json.loads, f) if "wall_time" in row
            }
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    kinds = 3 if floor else 2
    gaps: list[list[float]] = [[] for _ in range(kinds)]
    for s in sorted(wall):
        if s - 1 in wall and s > skip and kept(s, block):
            gaps[kind_of(s, block, kinds)].append(wall[s] - wall[s - 1])
    out = {
        "on": statistics.median(gaps[1]),
        "off": statistics.median(gaps[0]),
        "steps": len(gaps[1]),
    }
    if floor:
        out["floor"] = statistics.median(gaps[2])
    return out


class Blocks:
    """The hook: before each step, whether its snapshot is taken.  With ``floor`` ("copy" or
    "replica", ``--floor``) a third kind of block takes no snapshot but does what one must at
    least cost, from step 2 on: the rank's state copied into a buffer and checksummed
    (benchmarks/snapshot_floor.py); with "replica", the buffer also sent to the other rank over a
    raw TCP socket on loopback and the other's received, on two background threads, the exchange
    of the step before joined first (one in flight, as the tier's replication)."""

    def __init__(self, block: int, floor: str | None = None) -> None:
        self.block, self.kinds = block, 3 if floor else 2
        self.floor: Any = None
        if floor:
            from snapshot_floor import Floor

            self.floor = Floor()
        self.replica = floor in ("replica", "sealed-replica")
        # "sealed-replica": the snapshot itself (sealed, one node) and a raw exchange of its
        # bytes with the other rank: what sealed snapshots across nodes would at least cost
        self.with_snapshot = floor == "sealed-replica"
        self._go: list[threading.Semaphore] = []
        self._done: list[threading.Semaphore] = []
        self._busy = False
        self.exchanges = 0
        self.error: BaseException | None = None  # an exchange's, raised at the next step

    def at_step(self, step: int, run) -> None:
        kind = kind_of(step, self.block, self.kinds)
        # ("sealed-replica": the third kind takes the snapshot too, and sends its bytes)
        run.memory_every = 1 if kind == 1 or (kind == 2 and self.with_snapshot) else None
        if kind != 2 or step < 2:
            return
        if self._busy:
            for done in self._done:
                done.acquire()
            self._busy = False
            if self.error is not None:
                raise RuntimeError(f"the floor's exchange failed: {self.error}")
        if not self.with_snapshot:
            self.floor.at_step(step, run)
        elif self.floor.buf is None:  # (only its size: the snapshot copies and checksums)
            self.floor._setup(run)
        if self.replica:
            if not self._go:
                self._connect()
            for go in self._go:
                go.release()
            self._busy = True

    def _connect(self) -> None:
        """A socket to the other rank (its port through the job's store), and the two threads."""
        import socket

        import torch
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        rank, buf = dist.get_rank(), self.floor.buf
        store.set(f"blocks-floor-size-{rank}", str(buf.numel()))
        peer_size = int(store.get(f"blocks-floor-size-{1 - rank}"))
        if rank == 0:
            server = socket.create_server(("127.0.0.1", 0))
            store.set("blocks-floor-port", str(server.getsockname()[1]))
            conn, _ = server.accept()
            server.close()
        else:
            conn = socket.create_connection(("127.0.0.1", int(store.get("blocks-floor-port"))))
        mine = memoryview(buf.numpy())
        theirs = memoryview(torch.empty(peer_size, dtype=torch.uint8).numpy())

        def send() -> None:
            conn.sendall(mine)
            self.exchanges += 1

        def receive() -> None:
            got = 0
            while got < len(theirs):
                n = conn.recv_into(theirs[got:])
                if not n:
                    raise ConnectionError("the other rank closed the floor's socket")
                got += n

        for work in (send, receive):
            go, done = threading.Semaphore(0), threading.Semaphore(0)

            def loop(work=work, go=go, done=done) -> None:
                while True:
                    go.acquire()
                    try:
                        work()
                    except BaseException as e:  # raised by the next step (at_step)
                        self.error = e
                    finally:
                        done.release()

            threading.Thread(target=loop, daemon=True).start()
            self._go.append(go)
            self._done.append(done)


def main() -> int:
    argv = sys.argv[1:]
    block = 20
    if "--block" in argv:
        i = argv.index("--block")
        block = int(argv[i + 1])
        del argv[i : i + 2]
    if "--split-nodes" in argv:  # each rank a node of its own: its own memory root
        argv.remove("--split-nodes")
        rank = os.environ.get("RANK")  # (none yet in the launcher's hot spare, never used here)
        if rank is not None:
            root = os.path.join(os.environ["RESILIENT_MEMORY_ROOT"], f"node-{rank}")
            os.makedirs(root, exist_ok=True)
            os.environ["RESILIENT_MEMORY_ROOT"] = root
    floor = None  # "copy" or "replica" (Blocks)
    if "--floor" in argv:
        i = argv.index("--floor")
        floor = argv[i + 1]
        del argv[i : i + 2]
    part = None
    if "--part" in argv:  # cut every snapshot short (benchmarks/snapshot_parts.py)
        i = argv.index("--part")
        part = argv[i + 1]
        del argv[i : i + 2]
    # the library and trainer measured: this checkout's, or the one RESILIENT_BENCH_TREE names (a
    # checkout of another commit: benchmarks/snapshot_ab.py --blocks)
    sys.path.insert(0, os.environ.get("RESILIENT_BENCH_TREE") or os.path.dirname(HERE))
    from reference_trainer.__main__ import config_from, parser  # (disables gc, as a rank)

    args = parser().parse_args(argv)
    if not args.memory_every:
        raise SystemExit("snapshot_blocks.py needs --memory-every 1 (it sets the tier up)")
    cfg = config_from(args, int(os.environ["WORLD_SIZE"]))
    from reference_trainer.train import train

    if part is not None:  # this checkout's snapshot_parts.py, over the tree measured
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "snapshot_parts", os.path.join(HERE, "snapshot_parts.py")
        )
        assert spec is not None and spec.loader is not None
        parts = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(parts)
        parts.cut_short(part, cfg.steps)

    sys.path.insert(0, HERE)  # (snapshot_floor, this checkout's)
    hook = Blocks(block, floor)
    train(cfg, hooks=[hook])
    if hook.floor is not None:
        print(
            f"rank {os.environ.get('RANK')}: {hook.floor.steps} floor copies of "
            f"{hook.floor.buf.numel() if hook.floor.buf is not None else 0} bytes, "
            f"{hook.exchanges} sent to the other rank",
            file=sys.stderr,
        )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
