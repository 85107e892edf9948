"""Trainer throughput: tokens/s and the step-time breakdown for each layout, side by side.

Each layout runs ``python -m reference_trainer --nproc W`` (real torchrun ranks, gloo on CPU) for
``--steps`` steps and writes per-step metrics; the first ``--warmup`` steps are dropped and medians
reported.  Breakdown: compute (forward + backward, what is left), all-to-all (expert dispatch),
all-reduce (tp reductions, gradient averaging, clipping), all-gather (ZeRO-1), optimizer.

    python benchmarks/trainer_throughput.py [--preset tiny] [--global-batch 32] [--steps 25]
    python benchmarks/trainer_throughput.py --preset small --device cuda --layouts 1x1x1 --peak-tflops 989

On a GPU, ``--peak-tflops`` (the device's dense bf16 peak) turns the measured throughput into MFU
with the usual estimate of 6 x active parameters + attention FLOPs per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, markdown_table  # noqa: E402

LAYOUTS = {
    "1x1x1": (1, []),
    "dp2": (2, ["--dp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "tp2": (2, ["--tp", "2"]),
    "dp1 ep2 tp2": (4, ["--ep", "2", "--tp", "2"]),
    "dp2 + ZeRO-1": (2, ["--dp", "2", "--zero"]),
}
PARTS = ("compute_s", "all_to_all_s", "all_reduce_s", "all_gather_s", "optimizer_s")


def run_layout(name: str, args) -> dict:
    world, flags = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        cmd = [
            sys.executable,
            "-m",
            "reference_trainer",
            "--nproc",
            str(world),
            *flags,
            "--preset",
            args.preset,
            "--steps",
            str(args.steps),
            "--global-batch",
            str(args.global_batch),
            "--device",
            args.device,
            "--metrics",
            metrics,
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(metrics)][args.warmup :]
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "step_s": statistics.median(r["step_s"] for r in rows),
    }
    for part in PARTS:
        out[part] = statistics.median(r.get(part, 0.0) for r in rows)
    return out


def flops_per_token(preset_name: str) -> float:
    from reference_trainer.config import preset

    m = preset(preset_name)
    attn = (
        12 * m.num_layers * m.num_heads * m.head_dim * m.seq_len
    )  # QK^T and AV, fwd + bwd, causal-avg x2
    return 6 * m.active_params + attn


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {}
    for name in args.layouts.split(","):
        results[name] = run_layout(name, args)
        print(f"  {name}: {results[name]['tokens_per_s']:.0f} tokens/s", flush=True)
    rows = []
    for name, r in results.items():
        row = [name, str(LAYOUTS[name][0]), f"{r['tokens_per_s']:.0f}", f"{r['step_s'] * 1e3:.1f}"]
        row += [f"{r[part] * 1e3:.1f}" for part in PARTS]
        if args.peak_tflops:
            mfu = (
                r["tokens_per_s"]
                * flops_per_token(args.preset)
                / (args.peak_tflops * 1e12 * LAYOUTS[name][0])
            )
            row.append(f"{100 * mfu:.1f}%")
        rows.append(row)
    headers = [
        "layout",
        "ranks",
        "tokens/s",
        "step ms",
        "compute ms",
        "all-to-all ms",
        "all-reduce ms",
        "all-gather ms",
        "optimizer ms",
    ] + (["MFU"] if args.peak_tflops else [])
    print()
    print(
        f"machine: {machine()}; preset {args.preset}, global batch {args.global_batch}, device {args.device}"
    )
    print(markdown_table(headers, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
