"""The checkpoint demonstration that ``make demo`` runs until the end-to-end demo exists.

Four gloo ranks launched by torchrun save a small sharded training state asynchronously in layout
(dp=2, ep=1, tp=2), with fused QKV, uneven vocabulary splits, experts and ZeRO-style optimizer
shards; four new ranks in layout (dp=1, ep=2, tp=2) load the newest step (resharding on the fly,
reading only the byte ranges they need) and check every tensor bit for bit; then every byte of
every committed step is verified against its checksums.  The parent prints what happened.

``python -m resilient.demo --phase save|load --url U --out DIR`` is the per-rank worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from resilient.launch import free_port

__all__ = ["run_demo"]

SAVE_LAYOUT = {"dp": 2, "ep": 1, "tp": 2}
LOAD_LAYOUT = {"dp": 1, "ep": 2, "tp": 2}
STEPS = (10, 20, 30)


def _placements():
    from resilient.layout import Shard

    return {
        "model.embed": {"tp": Shard(0)},  # vocab 1001: uneven over tp
        "model.attn.qkv": {"tp": Shard(0, parts=3)},  # fused q, k, v
        "model.attn.out": {"tp": Shard(1)},
        "model.norm": {},
        "model.experts.w_in": {"ep": Shard(0), "tp": Shard(2)},  # 4 experts, split over ep
        "optim.exp_avg.embed": {"dp": Shard(0), "tp": Shard(0)},  # ZeRO-1: dp splits the tp chunk
    }


def _global(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = {
        "model.embed": torch.randn(1001, 64, generator=g).bfloat16(),
        "model.attn.qkv": torch.randn(3 * 128, 64, generator=g),
        "model.attn.out": torch.randn(64, 128, generator=g),
        "model.norm": torch.ones(64),
        "model.experts.w_in": torch.randn(4, 64, 256, generator=g).bfloat16(),
        "optim.exp_avg.embed": torch.randn(1001, 64, generator=g),
    }
    return {k: v + step for k, v in base.items()}  # "training": every step changes every weight


def _local(layout, rank: int, step: int) -> dict:
    from resilient.checkpoint.state import shard_of

    return {k: shard_of(g, _placements()[k], layout, rank) for k, g in _global(step).items()}


def _worker(phase: str, url: str, out: str) -> None:
    import torch.distributed as dist

    from resilient import Checkpointer, Layout

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    result: dict = {"rank": rank}
    if phase == "save":
        layout = Layout(**SAVE_LAYOUT)
        with Checkpointer(url, layout=layout, keep_last=2) as ck:
            handles = []
            for step in STEPS:
                state = _local(layout, rank, step)
                state["data"] = {"epoch": 0, "position": step * 64}
                h = ck.save(step, state)
                handles.append(h)
                for t in state.values():  # the training step overwrites the live tensors at once
                    if isinstance(t, torch.Tensor):
                        t.zero_()
            ck.wait()
            result["saves"] = [vars(h.stats) for h in handles]
            result["steps"] = ck.steps()
    else:
        layout = Layout(**LOAD_LAYOUT)
        state = {k: torch.zeros_like(v) for k, v in _local(layout, rank, 0).items()}
        from resilient.checkpoint.state import sharded

        for k, v in state.items():
            sharded(v, _placements()[k], global_shape=tuple(_global(0)[k].shape))
        state["data"] = {"epoch": -1, "position": -1}
        with Checkpointer(url, layout=layout) as ck:
            step = ck.load(state)
            expect = _local(layout, rank, step)
            result["mismatches"] = [k for k in expect if not torch.equal(expect[k], state[k])]
            result["step"] = step
            result["data"] = state["data"]
            result["load"] = vars(ck.last_load)
            result["needed_bytes"] = sum(v.numel() * v.element_size() for v in expect.values())
    Path(out, f"{phase}_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _torchrun(phase: str, url: str, out: str, nproc: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "-m",
        "resilient.demo",
        "--phase",
        phase,
        "--url",
        url,
        "--out",
        out,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun {phase} phase failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run_demo(out: str = "runs/demo") -> bool:
    """Run the demonstration; returns True when every check passed."""
    from rich.console import Console
    from rich.table import Table

    from resilient import Checkpointer

    console = Console()
    out_dir = Path(out)
    url = str(out_dir / "checkpoints")
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    console.rule("[bold]resilient: sharded asynchronous checkpoints")
    console.print(
        f"1. 4 ranks (torchrun, gloo) train in layout dp=2 x ep=1 x tp=2 and save steps "
        f"{', '.join(map(str, STEPS))} asynchronously to [cyan]{url}[/] (keep_last=2)."
    )
    t0 = time.monotonic()
    _torchrun("save", url, str(out_dir), 4)
    saves = [json.loads((out_dir / f"save_rank{r}.json").read_text()) for r in range(4)]
    console.print(f"   done in {time.monotonic() - t0:.1f}s; committed steps: {saves[0]['steps']}")
    table = Table(title="Saves (per rank; the training loop waits only for 'stage')")
    for col in ("rank", "step", "stage ms", "write ms", "commit ms", "bytes written"):
        table.add_column(col, justify="right")
    for s in saves:
        for st in s["saves"]:
            table.add_row(
                str(s["rank"]),
                str(st["step"]),
                f"{st['stage_s'] * 1e3:.1f}",
                f"{st['write_s'] * 1e3:.1f}",
                f"{st['commit_s'] * 1e3:.1f}",
                _fmt_bytes(st["bytes_written"]),
            )
    console.print(table)

    console.print(
        "2. 4 new ranks in layout dp=1 x ep=2 x tp=2 load the newest step, resharding on "
        "the fly, and compare every tensor with the expected values bit for bit."
    )
    t0 = time.monotonic()
    _torchrun("load", url, str(out_dir), 4)
    loads = [json.loads((out_dir / f"load_rank{r}.json").read_text()) for r in range(4)]
    console.print(f"   done in {time.monotonic() - t0:.1f}s")
    table = Table(title="Resharded load (per rank)")
    for col in ("rank", "step", "bytes needed", "bytes read", "verified", "requests", "mismatches"):
        table.add_column(col, justify="right")
    for r in loads:
        ld = r["load"]
        table.add_row(
            str(r["rank"]),
            str(r["step"]),
            _fmt_bytes(r["needed_bytes"]),
            _fmt_bytes(ld["bytes_read"]),
            _fmt_bytes(ld["bytes_verified"]),
            str(ld["num_requests"]),
            "[green]none[/]" if not r["mismatches"] else f"[red]{r['mismatches']}[/]",
        )
    console.print(table)

    console.print("3. Every byte of every committed step is checked against its block checksums.")
    with Checkpointer(url) as ck:
        reports = [ck.verify(s) for s in ck.steps()]
    for rep in reports:
        status = "[green]ok[/]" if rep.ok else f"[red]{len(rep.problems)} problems[/]"
        console.print(
            f"   step {rep.step}: {rep.files_checked} files, {_fmt_bytes(rep.bytes_checked)}, "
            f"{rep.tensors} tensors: {status}"
        )
    ok = (
        all(not r["mismatches"] and r["step"] == STEPS[-1] for r in loads)
        and all(rep.ok for rep in reports)
        and saves[0]["steps"] == list(STEPS[-2:])
        and all(r["data"] == {"epoch": 0, "position": STEPS[-1] * 64} for r in loads)
    )
    summary = {
        "ok": ok,
        "saves": saves,
        "loads": loads,
        "verified": [{"step": r.step, "ok": r.ok, "bytes": r.bytes_checked} for r in reports],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.rule("[bold green]all checks passed" if ok else "[bold red]a check failed")
    console.print(f"summary: {out_dir / 'summary.json'}")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    _worker(a.phase, a.url, a.out)


if __name__ == "__main__":
    main()
