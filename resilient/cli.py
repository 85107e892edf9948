"""The ``resilient`` command line (typer).  A thin layer: each command calls one library function."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fault tolerance and checkpoint management for PyTorch training.",
)


@app.command()
def demo(
    out: str = typer.Option("runs/demo", "--out", help="Directory for checkpoints and reports."),
) -> None:
    """Run the demonstration: a sharded async save from 4 ranks, a resharded load, verification."""
    from resilient.demo import run_demo

    raise typer.Exit(0 if run_demo(out) else 1)


@app.command()
def verify(
    url: str, step: int = typer.Option(None, "--step", help="Default: the newest committed step.")
) -> None:
    """Read every byte of a checkpoint step and check it against its checksums (exit 1 on failure)."""
    from resilient import Checkpointer
    from resilient.errors import ResilientError

    try:
        with Checkpointer(url) as ck:
            report = ck.verify(step)
    except ResilientError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for p in report.problems:
        typer.echo(p, err=True)
    typer.echo(
        f"step {report.step}: {report.files_checked} files, {report.bytes_checked} bytes, "
        f"{report.tensors} tensors: {'ok' if report.ok else 'FAILED'}"
    )
    raise typer.Exit(0 if report.ok else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
