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
    out: str = typer.Option("runs/demo", "--out", help="Directory for the runs and the reports."),
) -> None:
    """The end-to-end story: a 4-rank MoE job loses a rank, recovers, is verified against a
    fault-free reference, is resharded to another layout and trains on; reports in --out."""
    from resilient.demo import run_demo

    try:
        ok = run_demo(out)
    except FileExistsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if ok else 1)


@app.command()
def verify(
    url: str, step: int = typer.Option(None, "--step", help="Default: the newest committed step.")
) -> None:
    """Read every byte of a checkpoint step and check it against its checksums.

    Exit codes, as ``reshape verify``: 0 every byte checks; 1 failed verification, or a corrupt or
    unreadable checkpoint (manifest, storage); 2 bad usage (no such step, a bad URL or option)."""
    from resilient import Checkpointer
    from resilient.errors import CheckpointCorruptError, ResilientError, StorageError

    try:
        with Checkpointer(url) as ck:
            report = ck.verify(step)
    except (CheckpointCorruptError, StorageError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except (ResilientError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for p in report.problems:
        typer.echo(p, err=True)
    typer.echo(
        f"step {report.step}: {report.files_checked} files, {report.bytes_checked} bytes, "
        f"{report.tensors} tensors: {'ok' if report.ok else 'FAILED'}"
    )
    raise typer.Exit(0 if report.ok else 1)


chaos_app = typer.Typer(
    no_args_is_help=True,
    help="Chaos testing: run a job with injected faults and prove nothing was lost.",
)
app.add_typer(chaos_app, name="chaos")


@chaos_app.command("run")
def chaos_run(
    scenario: str = typer.Argument(..., help="A scenario TOML file."),
    out: str = typer.Option("runs/chaos", "--out", help="Directory for the run and its reference."),
) -> None:
    """Run one scenario: a fault-free reference, the faulty run, verification, reports
    (exit 0 when every check passed, 1 when one failed, 2 on a bad scenario)."""
    from resilient.chaos.runner import run_scenario
    from resilient.errors import ScenarioError

    try:
        report = run_scenario(scenario, out, say=typer.echo)
    except ScenarioError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if report["passed"] else 1)


@chaos_app.command("suite")
def chaos_suite(
    quick: bool = typer.Option(False, "--quick", help="Only the CI-sized scenarios."),
    out: str = typer.Option("runs/chaos-suite", "--out", help="Directory for the runs."),
) -> None:
    """Run the built-in scenarios (each injector at least once); writes suite.md and suite.json."""
    from resilient.chaos.runner import run_suite

    reports = run_suite(out, quick=quick, say=typer.echo)
    failed = [r["scenario"] for r in reports if not r["passed"]]
    typer.echo(
        f"{len(reports) - len(failed)}/{len(reports)} scenarios passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + f" -> {out}/suite.md"
    )
    raise typer.Exit(1 if failed else 0)


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="A directory `resilient chaos run` wrote."),
) -> None:
    """Verify a chaos run again and rebuild report.json, report.md and timeline.png."""
    from resilient.chaos.runner import rebuild_report
    from resilient.errors import ResilientError

    try:
        result = rebuild_report(run_dir, say=typer.echo)
    except (FileNotFoundError, ResilientError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if result["passed"] else 1)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def launch(ctx: typer.Context) -> None:
    """torchrun with hot spares and in-job recovery: resilient launch [torchrun's flags]
    [--spares K] SCRIPT|-m MODULE [ARGS].  A failed rank is taken over by a spare (default 1 per
    node) while the healthy ranks stay alive; without a spare it restarts the workers as torchrun
    does.  The loop must use @fault_tolerant (or Run with resilient.launch.regroup)."""
    args = list(ctx.args)
    if not args or args[0] in ("-h", "--help"):
        typer.echo(
            "usage: resilient launch [torchrun's flags] [--spares K] SCRIPT|-m MODULE [ARGS]\n\n"
            + (launch.__doc__ or "")
            + "\n\ntorchrun's flags: see `torchrun --help`."
        )
        raise typer.Exit(0 if args else 2)
    from resilient.launch.agent import launch_main

    raise typer.Exit(launch_main(args))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
