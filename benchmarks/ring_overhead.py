"""What the collective ring (resilient.health.ring) costs: per call, and on the trainer's step time.

Per call: a world of one (gloo, in this process), ``dist.all_reduce`` of a 4-element tensor, bare
and through the ring's wrapper, interleaved block by block (median ns per call over the blocks);
and the wrapper alone around a function that does nothing (the ring's own cost, without gloo).

Step time: the reference trainer (tiny preset, 2 ranks, tp 2: an all_reduce per layer each way)
under ``--nproc 2``, with ``RESILIENT_COLLECTIVE_RING=1`` and ``=0`` alternately in one run
(``--trials`` each), median step time over the steps after the first five; also the median of
the on/off ratios of adjacent runs (robust to a machine whose load drifts between runs).

    python benchmarks/ring_overhead.py [--trials 3] [--steps 60] [--calls 2000] [--blocks 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine  # noqa: E402


def per_call(calls: int, blocks: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from resilient.health.ring import CollectiveRing, _wrap, install, uninstall

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    bare = dist.all_reduce
    ring = install(force=True)
    assert ring is not None
    wrapped = dist.all_reduce
    t = torch.ones(4)

    def run(fn) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(t)
        return (time.perf_counter_ns() - t0) / calls

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    alone = _wrap(CollectiveRing(), "all_reduce", noop, c10d.all_reduce)
    out: dict[str, list[float]] = {"bare": [], "ring": [], "noop": [], "noop_ring": []}
    for fn in (bare, wrapped):  # warm up both paths
        run(fn)
    for _ in range(blocks):
        out["bare"].append(run(bare))
        out["ring"].append(run(wrapped))
        out["noop"].append(run(noop))
        out["noop_ring"].append(run(alone))
    uninstall()
    dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "all_reduce_bare_ns": round(med["bare"]),
        "all_reduce_ring_ns": round(med["ring"]),
        "added_ns": round(med["ring"] - med["bare"]),
        "wrapper_alone_ns": round(med["noop_ring"] - med["noop"]),
    }


def step_times(trials: int, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(trials):
        for flag in ("1", "0"):
            with tempfile.TemporaryDirectory() as d:
                metrics = os.path.join(d, "m.jsonl")
                cmd = [sys.executable, "-m", "reference_trainer", "--nproc", "2", "--tp", "2",
                       "--preset", "tiny", "--steps", str(steps), "--global-batch", "16",
                       "--save-every", "0", "--ckpt", os.path.join(d, "ck"),
                       "--metrics", metrics]  # fmt: skip
                subprocess.run(
                    cmd,
                    check=True,
                    capture_output=True,
                    env=dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_COLLECTIVE_RING=flag),
                )
                with open(metrics) as f:
                    rows = [json.loads(line) for line in f][5:]
                out["on" if flag == "1" else "off"].append(
                    statistics.median(r["step_s"] for r in rows)
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=15)
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    c = per_call(args.calls, args.blocks)
    print(
        f"per call (world of 1, gloo, 4-element all_reduce, median of {args.blocks} blocks of "
        f"{args.calls}): bare {c['all_reduce_bare_ns']} ns, with the ring "
        f"{c['all_reduce_ring_ns']} ns (+{c['added_ns']} ns); the wrapper alone around a no-op: "
        f"{c['wrapper_alone_ns']} ns",
        flush=True,
    )
    s = step_times(args.trials, args.steps)
    on, off = statistics.median(s["on"]), statistics.median(s["off"])
    print(
        f"step time (reference trainer, tiny, 2 ranks tp 2, median of per-run medians, "
        f"{args.trials} runs each, interleaved): ring on {on * 1e3:.2f} ms, off "
        f"{off * 1e3:.2f} ms ({(on / off - 1) * 100:+.1f}%); median ratio of adjacent runs "
        f"{statistics.median(a / b for a, b in zip(s['on'], s['off'])):.3f}; per run: on "
        f"{[round(x * 1e3, 2) for x in s['on']]}, off {[round(x * 1e3, 2) for x in s['off']]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
