"""The ``reshape`` command line: inspect, verify, plan, convert, export and import checkpoints.

A thin typer layer over reshape.plan / reshape.execute / reshape.export and the checkpoint reader:
rich tables and progress bars for people, ``--json`` for scripts.  Exit codes: 0 success, 1 a
failed verification or corrupt/unreadable source, 2 bad usage (bad flags, a layout that does not
fit, a missing step, an existing destination).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from resilient.checkpoint.catalog import scan
from resilient.checkpoint.format import step_dir_name
from resilient.checkpoint.reader import bytes_to_verify, read_manifest, verify_step
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointCorruptError, ResilientError, StorageError
from resilient.layout import placement_to_json
from resilient.progress import byte_progress

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


def _progress(total: int, label: str, enabled: bool):
    return byte_progress(total, label, enabled=enabled, console=err)


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
        total = bytes_to_verify(read_manifest(storage, s))
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


def _json_file(path: str | None, what: str) -> Any:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(16 << 20)
        return json.loads(data)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{what} {path}: cannot read it as JSON ({e})") from None


@app.command()
def export(
    src: str,
    out: str,
    fmt: str = typer.Option(
        ...,
        "--format",
        help="hf: Hugging Face transformers (a reference-trainer checkpoint becomes a Qwen2-MoE "
        "or Mixtral directory that AutoModelForCausalLM loads; any other checkpoint: its model. "
        "tensors as safetensors shards under their own names). dcp: a "
        "torch.distributed.checkpoint directory, every tensor whole under its key and the JSON "
        "values as non-tensor entries, which dcp.load reads into plain tensors or DTensors on "
        "any mesh (one tensor in memory at a time; read back and checked after writing)",
    ),
    dtype: str = typer.Option(
        None, "--dtype", help="hf: cast weights to a floating dtype, e.g. bfloat16"
    ),
    step: int = STEP,
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="hf: split files at this size"
    ),
    model_config: str = typer.Option(
        None,
        "--model-config",
        help="hf: a JSON file of the reference trainer's ModelConfig fields, for a checkpoint "
        "written before the trainer recorded them",
    ),
    name_map: str = typer.Option(
        None,
        "--name-map",
        help="hf, not a reference-trainer checkpoint: a JSON file mapping tensor names to the "
        "names to write",
    ),
    overwrite: bool = typer.Option(False, "--overwrite"),
    as_json: bool = JSON,
) -> None:
    """Export a step: Hugging Face transformers weights (hf) or a DCP checkpoint (dcp)."""
    from reshape.export import check_export_dtype, export_bytes, export_hf, parse_size
    from reshape.formats.hf import (
        export_reference_hf,
        is_reference_checkpoint,
        reference_export_bytes,
    )

    with _errors():
        if fmt not in ("hf", "dcp"):
            raise ValueError(f"--format {fmt!r}: one of 'hf', 'dcp'")
        storage = Storage(src)
        s = _resolve(storage, step)
        m = read_manifest(storage, s)
        if fmt == "dcp":
            from reshape.formats.dcp import export_dcp

            total = sum(t.nbytes for t in m.tensors.values())
            with _progress(total, f"exporting step {s} as DCP", not as_json) as advance:
                report: Any = export_dcp(src, out, step=s, overwrite=overwrite, progress=advance)
            if as_json:
                print(json.dumps(asdict(report), indent=1))
                return
            console.print(
                f"step {s}: {report.tensors} tensors, {_human(report.total_bytes)} as a DCP "
                f"checkpoint under {report.out} (dcp.load reads it)"
            )
            return
        reference = is_reference_checkpoint(m)
        if name_map is not None and reference:
            raise ValueError(
                f"--name-map: step {s} of {src} is a reference-trainer checkpoint, exported under "
                f"transformers' own names; --name-map is for other checkpoints"
            )
        check_export_dtype(dtype)
        max_shard_bytes = parse_size(max_shard_size, "--max-shard-size")
        if reference:
            config = _json_file(model_config, "--model-config")
            total = reference_export_bytes(m, f"step {s} of {storage.url}", dtype, config)
        else:
            total = export_bytes(m, dtype)
        with _progress(total, f"exporting step {s}", not as_json) as advance:
            if reference:
                report = export_reference_hf(
                    src,
                    out,
                    step=s,
                    dtype=dtype,
                    max_shard_bytes=max_shard_bytes,
                    overwrite=overwrite,
                    model_config=config,
                    progress=advance,
                )
            else:
                report = export_hf(
                    src,
                    out,
                    step=s,
                    dtype=dtype,
                    max_shard_bytes=max_shard_bytes,
                    overwrite=overwrite,
                    progress=advance,
                    name_map=_json_file(name_map, "--name-map"),
                )
        if as_json:
            print(json.dumps(asdict(report), indent=1))
            return
        if report.architecture:
            console.print(
                f"step {s}: {report.tensors} tensors, {_human(report.total_bytes)} in "
                f"{len(report.files)} files under {report.out} as {report.architecture} "
                f"(config.json + model.safetensors.index.json): "
                f"AutoModelForCausalLM.from_pretrained({report.out!r}) loads it"
            )
        else:
            console.print(
                f"step {s}: {report.tensors} tensors, {_human(report.total_bytes)} in "
                f"{len(report.files)} files under {report.out} (+ model.safetensors.index.json). "
                f"Not a reference-trainer checkpoint: the tensors keep "
                f"{'the names --name-map gave them' if name_map else 'their checkpoint names'} "
                f"and no config.json is written, so transformers cannot load it as a model"
            )


@app.command("import")
def import_(
    src: str,
    out: str,
    fmt: str = typer.Option(
        ...,
        "--format",
        help="hf: a Qwen2-MoE or Mixtral directory (config.json + safetensors) as a "
        "reference-trainer checkpoint (model weights, step 0; start with --init-from OUT). "
        "dcp: a torch.distributed.checkpoint directory (needs --trust-pickle), split the "
        "reference trainer's way and checked bit for bit against dcp.load (holds the whole "
        "state in memory)",
    ),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel size of the checkpoint written"),
    ep: int = typer.Option(1, "--ep", help="expert-parallel size"),
    dp: int = typer.Option(1, "--dp", help="data-parallel size"),
    trust_pickle: bool = typer.Option(
        False,
        "--trust-pickle",
        help="dcp: allow reading DCP's .metadata, which is a Python pickle: unpickling a file "
        "can run any code its author put in it, so pass this only for a directory you trust (non-tensor "
        "entries are still decoded with torch's restricted unpickler and kept only when they "
        "are JSON values)",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace step 0 in OUT"),
    as_json: bool = JSON,
) -> None:
    """Import weights from Hugging Face (hf) or torch.distributed.checkpoint (dcp) into a
    checkpoint in the layout --tp/--ep/--dp."""
    with _errors():
        if fmt not in ("hf", "dcp"):
            raise ValueError(f"--format {fmt!r}: one of 'hf', 'dcp'")
        for name, v in (("--tp", tp), ("--ep", ep), ("--dp", dp)):
            if v < 1:
                raise ValueError(f"{name} {v}: a layout axis size is an int >= 1")
        sizes = {"tp": tp, "ep": ep, "dp": dp}
        if fmt == "hf":
            from reshape.formats.hf import import_hf

            report: Any = import_hf(src, out, sizes=sizes, overwrite=overwrite)
            summary = (
                f"{src} ({report['architecture']}) -> step 0 of {report['out']}: "
                f"{report['tensors']} tensors, {_human(report['bytes_written'])}, layout "
                f"{' x '.join(f'{a}={n}' for a, n in report['layout'])}; train from it with "
                f"python -m reference_trainer --preset checkpoint --init-from {report['out']} ..."
            )
        else:
            from reshape.formats.dcp import import_dcp

            report = asdict(import_dcp(src, out, sizes=sizes, trust_pickle=trust_pickle,
                                       overwrite=overwrite))  # fmt: skip
            summary = (
                f"{src} -> step 0 of {report['out']}: {report['tensors']} tensors, "
                f"{_human(report['total_bytes'])}, verified against dcp.load"
            )
        if as_json:
            print(json.dumps(report, indent=1))
            return
        console.print(summary)


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
