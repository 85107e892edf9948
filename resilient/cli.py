"""The ``resilient`` command line (typer).  A thin layer: each command calls one library function."""

from __future__ import annotations

import os
import sys

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
    from resilient.checkpoint.reader import bytes_to_verify
    from resilient.errors import CheckpointCorruptError, ResilientError, StorageError
    from resilient.progress import byte_progress

    try:
        with Checkpointer(url) as ck:
            s = step if step is not None else ck.latest_step()
            if s is None:  # (nothing committed: verify says so, by name)
                report = ck.verify(step)
            else:
                total = bytes_to_verify(ck.manifest(s))
                with byte_progress(total, f"verifying step {s}") as advance:
                    report = ck.verify(s, progress=advance)
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


def _check_plot_format(path: str) -> None:
    """A ValueError when matplotlib (if installed: without it, preflight_main says what to
    install) cannot write ``path``'s extension."""
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return
    supported = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in supported:
        raise ValueError(
            f"--plot {path}: matplotlib cannot write .{ext} files; expected one of "
            f"{', '.join('.' + e for e in sorted(supported))}: give a file name ending in one "
            f"of them (.png, say)"
        )


@app.command()
def preflight(
    nproc: int = typer.Option(
        None, "--nproc", help="Start this many local ranks (default: the launcher's, or one)."
    ),
    json_path: str = typer.Option(None, "--json", help="Write every figure, per rank, here."),
    checkpoint_url: str = typer.Option(
        None,
        "--checkpoint-url",
        help="Test this storage (any fsspec URL): write, read, time to first byte, in a scratch "
        "directory that is removed afterwards.  Default: skipped.",
    ),
    storage_options: str = typer.Option(
        None, "--storage-options", help="JSON options for --checkpoint-url's filesystem (fsspec)."
    ),
    budget_s: float = typer.Option(
        None,
        "--budget-s",
        help="Seconds the measurements may take (default 45, or 5 with --quick); message sizes "
        "and repeats shrink to fit, and the report says what was cut.",
    ),
    plot_path: str = typer.Option(
        None, "--plot", help="Draw bus bandwidth per collective and the link heatmap (PNG)."
    ),
    factor: float = typer.Option(
        None,
        "--factor",
        help="Name a rank or link below this fraction of the median (default 0.7; with --quick "
        "0.5, as Run(preflight=True)).",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="Only the few-second subset Run(preflight=True) runs."
    ),
    chaos: str = typer.Option(
        None,
        "--chaos",
        metavar="PLAN",
        help="Install the chaos harness's fault hook with this plan (tests of preflight itself).",
    ),
) -> None:
    """Check every rank before training: collectives over message sizes (bus bandwidth), pairwise
    links, memory and host-device bandwidth, checkpoint storage, store latency, device health.
    Runs on the job's ranks under torchrun / `resilient launch`, or on --nproc local ranks.
    Exit 0 when every check passed, 1 when one failed (an outlier rank or link, a device check,
    the storage), 2 on bad usage or a crashed rank."""
    import json

    from resilient.launch import MAX_PROCESSES_PER_NODE
    from resilient.preflight import PreflightConfig, preflight_main

    try:
        try:
            options = json.loads(storage_options) if storage_options else None
        except (ValueError, RecursionError) as e:
            raise ValueError(
                f"--storage-options {storage_options!r:.80}: not JSON ({str(e)[:120]}); expected "
                f"a JSON object of the filesystem's options, such as '{{\"anon\": true}}'"
            ) from None
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"--storage-options must be a JSON object, got {storage_options!r}")
        if nproc is not None and not 1 <= nproc <= MAX_PROCESSES_PER_NODE:
            raise ValueError(
                f"--nproc {nproc}: expected a number of local ranks from 1 to "
                f"{MAX_PROCESSES_PER_NODE}; for more ranks, run it under torchrun or `resilient "
                f"launch` on several nodes"
            )
        config = (PreflightConfig.quick_check if quick else PreflightConfig)(
            **({} if budget_s is None else {"budget_s": budget_s}),
            **({} if factor is None else {"factor": factor}),
            checkpoint_url=checkpoint_url,
            storage_options=options,
        )
        for flag, path in (("--json", json_path), ("--plot", plot_path)):
            # (checked before the measurements: the report is written after them)
            parent = os.path.dirname(os.path.abspath(path)) if path else None
            if parent is not None and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
                raise ValueError(
                    f"{flag} {path}: its directory {parent} does not exist or is not writable; "
                    f"create it, or give another path"
                )
            if path and os.path.isdir(path):
                raise ValueError(
                    f"{flag} {path}: is a directory; expected the path of a file to write: give "
                    f"a file name (in that directory, say)"
                )
        if json_path and plot_path and os.path.realpath(json_path) == os.path.realpath(plot_path):
            raise ValueError(
                f"--json {json_path} and --plot {plot_path}: the same file (the plot would "
                f"overwrite the report); give two paths"
            )
        if plot_path:
            _check_plot_format(plot_path)
    except ValueError as e:  # a JSONDecodeError is one too
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    hooks = []
    if chaos is not None:  # the chaos harness asked for its hook, by flag, explicitly
        from resilient.chaos.faults import ChaosHook

        try:
            hooks.append(ChaosHook.from_file(chaos))
        except (OSError, ValueError, KeyError, TypeError) as e:
            typer.echo(f"error: --chaos {chaos}: not a readable chaos plan ({e})", err=True)
            raise typer.Exit(2) from None
    # what the ranks --nproc starts need (the report comes back here for --json and --plot)
    argv = ["--budget-s", repr(config.budget_s), "--factor", repr(config.factor)]
    argv += ["--checkpoint-url", checkpoint_url] if checkpoint_url else []
    argv += ["--storage-options", storage_options] if storage_options else []
    argv += ["--quick"] if quick else []
    argv += ["--chaos", chaos] if chaos else []
    try:
        code = preflight_main(
            config,
            nproc=nproc,
            json_path=json_path,
            plot_path=plot_path,
            hooks=hooks,
            argv=argv,
            say=typer.echo,
        )
    except ImportError as e:  # --plot without matplotlib
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


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
            + "\n\nIts own flags, with torchrun's (see `torchrun --help`):\n"
            "  --spares K            spare processes per node (default 1; 0: restarts only)\n"
            "  --max-recoveries N    in-job recoveries per node before a restart (default 10)\n"
            "  --preload MOD[,MOD]   start the workers from a fork server that imported these\n"
            "  --finish-timeout S    kill a worker idle this long after another finished\n"
            "                        (default 300; 0: wait for it forever, as torchrun does)"
        )
        raise typer.Exit(0 if args else 2)
    from resilient.launch.agent import launch_main

    raise typer.Exit(launch_main(args))


def main() -> None:
    argv = sys.argv[1:]
    args = argv[1:]
    if "--" in args:
        args.remove("--")  # (as click's parser takes it out of the command's arguments)
    if argv[:1] == ["launch"] and args[:1] and args[0] not in ("-h", "--help"):
        # the launcher straight from here, not under typer's and click's handlers: the ranks of
        # --preload may fork from this process and leave through this stack (launch_main)
        from resilient.launch.agent import launch_main

        sys.exit(launch_main(args, program=True))
    app()


if __name__ == "__main__":
    main()
