"""Save and load, this checkout against another (a baseline commit), side by side in one run.

Each trial runs the same save and load work in a fresh process per tree (``PYTHONPATH`` set to
that tree), the two trees in alternating order from trial to trial, so the disk's drift hits both
alike; medians and per-trial ratios are reported.  Through the public API only, so it measures any
two versions:

* save: one process, a ~1 GiB bf16 state (64 tensors), ``Checkpointer.save`` then ``wait``: the
  blocking part (the snapshot) and the total (durable and committed), three saves per trial after
  a warm-up save;
* load: 4 ranks save a ~512 MiB state in tp=4, then it is loaded cold (page caches dropped when
  the process may) by 4 ranks in the same layout and by 2 ranks in tp=2 (resharding).

    git worktree add /tmp/base <commit>
    python benchmarks/checkpoint_ab.py --baseline /tmp/base [--trials 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# --- the work, in a process whose ``resilient`` is the tree being measured ----------------------


def save_worker(root: str, gib_: float, saves: int) -> dict:
    import torch

    from resilient import Checkpointer

    torch.set_num_threads(1)
    n = int(gib_ * 2**30) // 64 // 2
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(n, generator=g).bfloat16() for i in range(64)}
    out = {"blocking": [], "total": []}
    with Checkpointer(os.path.join(root, "ckpt"), keep_last=1) as ck:
        for step in range(saves + 1):
            ck.wait()
            os.sync()
            gc.collect()  # a full collection falling inside one tree's timing is luck, not code
            t0 = time.perf_counter()
            h = ck.save(step + 1, state)
            blocking = time.perf_counter() - t0
            h.wait()
            total = time.perf_counter() - t0
            if step:  # the first is the warm-up
                out["blocking"].append(blocking)
                out["total"].append(total)
    return out


def load_worker(root: str, mib: int) -> dict:
    sys.path.insert(0, HERE)
    import checkpoint_load as cl

    shapes = cl._shapes(mib << 20)
    url = os.path.join(root, "ckpt")
    drop = cl.drop_caches()
    cl.run(cl.save_task, 4, url, shapes)
    out = {}
    for label, world in (("same layout, 4 ranks", 4), ("tp=4 -> tp=2, 2 ranks", 2)):
        res = cl.run(cl.load_task, world, url, shapes, drop)
        assert all(r["ok"] for r in res), label
        out[label] = max(r["seconds"] for r in res)
    return out


# --- the driver -------------------------------------------------------------------------------------


def run_in(tree: str, what: str, args) -> dict:
    root = tempfile.mkdtemp(prefix="ckpt-ab-", dir=args.dir)
    try:
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", what, "--root", root]
        cmd += ["--gib", str(args.gib), "--mib", str(args.mib), "--saves", str(args.saves)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if res.returncode:
            raise RuntimeError(f"{what} in {tree} failed:\n{res.stderr[-3000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--baseline", help="another checkout of the repository (e.g. a git worktree)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "save":
        print(json.dumps(save_worker(args.root, args.gib, args.saves)))
        return
    if args.worker == "load":
        print(json.dumps(load_worker(args.root, args.mib)))
        return
    if not args.baseline:
        p.error("--baseline TREE is required")
    sys.path.insert(0, HERE)
    from common import machine, markdown_table, median

    trees = {"baseline": os.path.abspath(args.baseline), "this": REPO}
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for trial in range(args.trials):
        order = list(trees) if trial % 2 == 0 else list(trees)[::-1]
        for name in order:
            save = run_in(trees[name], "save", args)
            load = run_in(trees[name], "load", args)
            row = {
                "save blocking": median(save["blocking"]),
                "save total": median(save["total"]),
                **{f"load {k}": v for k, v in load.items()},
            }
            for k, v in row.items():
                samples[name].setdefault(k, []).append(v)
            print(
                f"trial {trial + 1} {name}: " + ", ".join(f"{k} {v:.3f}s" for k, v in row.items()),
                flush=True,
            )
    rows = []
    for k in samples["this"]:
        b, t = samples["baseline"][k], samples["this"][k]
        ratios = sorted(x / y for x, y in zip(t, b))
        rows.append(
            [
                k,
                f"{median(b):.3f} ({min(b):.3f}-{max(b):.3f})",
                f"{median(t):.3f} ({min(t):.3f}-{max(t):.3f})",
                f"{median(t) / median(b):.2f}x",
                f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
            ]
        )
    print()
    print(f"machine: {machine()}; {args.trials} trials, trees alternating")
    print(
        markdown_table(
            [
                "",
                "baseline s, median (range)",
                "this s, median (range)",
                "this / baseline",
                "per-trial ratios",
            ],
            rows,
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f, indent=1)


if __name__ == "__main__":
    main()
