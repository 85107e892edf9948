"""The ``reshape`` command line: inspect, verify, plan, convert and export checkpoints.

A thin typer layer over reshape.plan / reshape.execute / reshape.export and the checkpoint reader:
rich tables and progress bars for people, ``--json`` for scripts.  Exit codes: 0 success, 1 a
failed verification or corrupt/unreadable source, 2 bad usage (bad flags, a layout that does not
fit, a missing step, an existing destination).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from resilient.checkpoint.catalog import scan
from resilient.checkpoint.format import step_dir_name
from resilient.checkpoint.reader import read_manifest, verify_step
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointCorruptError, ResilientError, StorageError
from resilient.layout import placement_to_json

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Move resilient checkpoints between parallel layouts, verify them, export them.",
)
console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, soft_wrap=True, highlight=False)

TP = typer.Option(None, "--tp", help="target tensor-parallel size (default: the source's)")
EP = typer.Option(None, "--ep", help="target expert-parallel size")
DP = typer.Option(None, "--dp", help="target data-parallel size")
STEP = typer.Option(None, "--step", help="default: the newest committed step")
JSON = typer.Option(False, "--json", help="print JSON for scripts")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@contextmanager
def _errors():
    """Map the toolkit's errors to exit codes with a one-line message."""
    try:
        yield
    except typer.Exit:
        raise
    except (CheckpointCorruptError, StorageError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(1) from None
    except (ResilientError, ValueError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None


@contextmanager
def _progress(total: int, label: str, enabled: bool):
    if not enabled:
        yield lambda n: None
        return
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as prog:
        task = prog.add_task(label, total=total)
        yield lambda n: prog.advance(task, n)


def _resolve(storage: Storage, step: int | None) -> int:
    from reshape.execute import resolve_step

    return resolve_step(storage, step)


@app.command()
def inspect(url: str, step: int = STEP, as_json: bool = JSON) -> None:
    """Show a checkpoint step: layout, files, and every tensor's shape, dtype and placement."""
    with _errors():
        storage = Storage(url)
        s = _resolve(storage, step)
        m = read_manifest(storage, s)
        tensors = {
            k: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "placement": placement_to_json(t.placement),
                "chunks": len(t.chunks),
                "bytes": t.nbytes,
            }
            for k, t in sorted(m.tensors.items())
        }
        catalog = scan(storage)
        info = {
            "url": storage.url,
            "step": s,
            "steps": catalog.steps(),
            "commits": catalog.commits(),  # commit order: the last is the latest
            "damaged": {str(i.step): i.problem for i in catalog.damaged()},
            "layout": m.layout.to_json(),
            "format_version": m.format_version,
            "toolkit_version": m.toolkit_version,
            "files": {k: v.to_json() for k, v in sorted(m.files.items())},
            "total_bytes": sum(t.nbytes for t in m.tensors.values()),
            "tensors": tensors,
            "extras": dict(m.extras),
        }
        if as_json:
            print(json.dumps(info, indent=1))
            return
        console.print(
            f"[bold]{storage.url}[/] step {s} (committed steps: {info['steps']}; in commit order: "
            f"{info['commits']})"
        )
        for step_, problem in info["damaged"].items():
            err.print(f"[yellow]step {step_} is not a usable commit:[/] {problem}")
        console.print(
            f"layout {m.layout.describe()}; {len(m.files)} files; "
            f"{_human(info['total_bytes'])} in {len(m.tensors)} tensors; format v{m.format_version}"
        )
        table = Table()
        for col in ("tensor", "dtype", "shape", "placement", "chunks", "size"):
            table.add_column(col, justify="right" if col in ("chunks", "size") else "left")
        for k, t in tensors.items():
            pl = (
                ", ".join(
                    f"{a}:{p['dim']}" + (f"/{p['parts']}" if p["parts"] > 1 else "")
                    for a, p in t["placement"].items()
                )
                or "replicated"
            )
            table.add_row(k, t["dtype"], str(t["shape"]), pl, str(t["chunks"]), _human(t["bytes"]))
        console.print(table)


@app.command()
def verify(url: str, step: int = STEP, as_json: bool = JSON) -> None:
    """Read every byte of a step and check it against its checksums: exit 0 when all check, 1 otherwise."""
    with _errors():
        storage = Storage(url)
        s = _resolve(storage, step)
        total = sum(f.size_bytes for f in read_manifest(storage, s).files.values())
        with _progress(total, f"verifying step {s}", not as_json) as advance:
            report = verify_step(storage, s, progress=advance)
        if as_json:
            print(json.dumps({**asdict(report), "ok": report.ok}, indent=1))
        else:
            for p in report.problems:
                err.print(f"[red]{p}[/]")
            status = "[green]ok[/]" if report.ok else "[red]FAILED[/]"
            console.print(
                f"step {s}: {report.files_checked} files, {_human(report.bytes_checked)}, "
                f"{report.tensors} tensors: {status}"
            )
        if not report.ok:
            raise typer.Exit(1)


@app.command()
def plan(
    src: str, tp: int = TP, ep: int = EP, dp: int = DP, step: int = STEP, as_json: bool = JSON
) -> None:
    """Show what a conversion reads and writes per target rank, and the read amplification."""
    from reshape.plan import plan as make_plan
    from reshape.plan import target_layout

    with _errors():
        storage = Storage(src)
        s = _resolve(storage, step)
        m = read_manifest(storage, s)
        p = make_plan(m, target_layout(m.layout, {"tp": tp, "ep": ep, "dp": dp}))
        ranks = {
            r: {
                "bytes_read": p.bytes_read(r),
                "bytes_written": p.bytes_written(r),
                "chunks": len(p.for_rank(r)),
            }
            for r in range(p.target.world_size)
        }
        out = {
            "step": s,
            "source_layout": m.layout.to_json(),
            "target_layout": p.target.to_json(),
            "bytes_read": p.bytes_read(),
            "bytes_written": p.bytes_written(),
            "read_amplification": p.read_amplification,
            "largest_chunk_bytes": p.largest_chunk_bytes,
            "copy_items": len(p.copy_items),
            "ranks": ranks,
        }
        if as_json:
            print(json.dumps(out, indent=1))
            return
        console.print(f"step {s}: {m.layout.describe()} -> {p.target.describe()}")
        table = Table(title="I/O per target rank")
        for col in ("rank", "chunks", "bytes read", "bytes written"):
            table.add_column(col, justify="right")
        for r, v in ranks.items():
            table.add_row(
                str(r), str(v["chunks"]), _human(v["bytes_read"]), _human(v["bytes_written"])
            )
        console.print(table)
        console.print(
            f"total read {_human(out['bytes_read'])}, written {_human(out['bytes_written'])}; "
            f"read amplification {p.read_amplification:.3f}; {out['copy_items']} copy items; "
            f"largest chunk {_human(p.largest_chunk_bytes)}"
        )


@app.command()
def convert(
    src: str,
    dst: str,
    tp: int = TP,
    ep: int = EP,
    dp: int = DP,
    step: int = STEP,
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the step in DST"),
    as_json: bool = JSON,
) -> None:
    """Convert a checkpoint step to another layout (an ordinary checkpoint at DST)."""
    from reshape.execute import convert as run_convert
    from reshape.plan import plan as make_plan
    from reshape.plan import target_layout

    with _errors():
        storage = Storage(src)
        s = _resolve(storage, step)
        m = read_manifest(storage, s)
        total = make_plan(
            m, target_layout(m.layout, {"tp": tp, "ep": ep, "dp": dp})
        ).bytes_written()
        with _progress(total, f"converting step {s}", not as_json) as advance:
            report = run_convert(
                src,
                dst,
                {"tp": tp, "ep": ep, "dp": dp},
                step=s,
                overwrite=overwrite,
                progress=advance,
            )
        if as_json:
            print(json.dumps(asdict(report), indent=1))
            return
        console.print(
            f"step {s} -> {report.target}/{step_dir_name(s)}: {report.files} files, "
            f"{_human(report.bytes_written)} written, {_human(report.bytes_read)} read "
            f"(amplification {report.read_amplification:.3f}) in {report.seconds:.2f}s "
            f"({_human(report.bytes_written / max(report.seconds, 1e-9))}/s)"
        )


@app.command()
def export(
    src: str,
    out: str,
    fmt: str = typer.Option(..., "--format", help="output format: hf (Hugging Face safetensors)"),
    dtype: str = typer.Option(None, "--dtype", help="cast weights, e.g. bfloat16"),
    step: int = STEP,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="split files at this size"),
    overwrite: bool = typer.Option(False, "--overwrite"),
    as_json: bool = JSON,
) -> None:
    """Export the model weights (keys under model.) as Hugging Face safetensors shards + index."""
    from reshape.export import export_hf, parse_size

    with _errors():
        if fmt != "hf":
            raise ValueError(f"--format {fmt!r}: the only format is 'hf'")
        storage = Storage(src)
        s = _resolve(storage, step)
        m = read_manifest(storage, s)
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
        total = sum(
            math.prod(t.shape) * itemsize.get(dtype or t.dtype, 4)
            for k, t in m.tensors.items()
            if k.startswith("model.")
        )
        with _progress(total, f"exporting step {s}", not as_json) as advance:
            report = export_hf(
                src,
                out,
                step=s,
                dtype=dtype,
                max_shard_bytes=parse_size(max_shard_size),
                overwrite=overwrite,
                progress=advance,
            )
        if as_json:
            print(json.dumps(asdict(report), indent=1))
            return
        console.print(
            f"step {s}: {report.tensors} tensors, {_human(report.total_bytes)} in "
            f"{len(report.files)} files under {report.out} (+ model.safetensors.index.json)"
        )


def tune_allocator() -> None:
    """Make glibc return large transient buffers to the OS at once.

    glibc raises its mmap threshold after a large block is freed, so later blocks of the same size
    come from heaps it keeps: a streaming conversion's peak memory then grows to several times its
    working set.  A fixed 1 MiB threshold keeps every large buffer an mmap that is unmapped on free.
    Process-wide, so only the CLI (a process of its own) does it.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def main() -> None:
    tune_allocator()
    app()


_: Callable[..., Any] = main
