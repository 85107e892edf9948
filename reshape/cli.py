"""The ``reshape`` command line.  Not built yet beyond the entry point: see the resharder issue."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Move resilient checkpoints between parallel layouts (see the resharder issue).",
)


@app.callback()
def _root() -> None:
    """Topology resharding of resilient checkpoints."""


def main() -> None:
    app()
