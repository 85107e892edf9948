"""The preflight report: built from every rank's figures, judged, and shown three ways.

``build_report`` (pure: tested without processes) turns the gathered per-rank results into the
report: every figure per rank, their medians, the named outliers, what failed, what was skipped
and why, what the budget cut.  ``PreflightReport`` is JSON both ways (``--json FILE``; version 1).
``print_report`` draws the rich tables rank 0 prints; ``plot`` draws bus bandwidth against message
size per collective and the pairwise matrix as a heatmap (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient.preflight.config import PreflightConfig
from resilient.preflight.outliers import (
    FIGURES,
    Outlier,
    human,
    human_bytes,
    link_outliers,
    rank_outliers,
)

__all__ = ["PreflightReport", "build_report", "print_report", "plot", "require_matplotlib"]

REPORT_VERSION = 1

# (figure key, where in a rank's result) for every per-rank figure in the report
_RANK_FIGURES = {
    "memory_bytes_per_s": ("memory_bytes_per_s",),
    "numpy_copy_bytes_per_s": ("numpy_copy_bytes_per_s",),  # the anchor: shown, never judged
    "matmul_flops_per_s": ("matmul_flops_per_s",),
    "store_round_trip_s": ("store_round_trip_s",),
    "h2d_bytes_per_s": ("h2d_bytes_per_s",),
    "d2h_bytes_per_s": ("d2h_bytes_per_s",),
    "storage_write_bytes_per_s": ("storage", "write_bytes_per_s"),
    "storage_read_bytes_per_s": ("storage", "read_bytes_per_s"),
    "storage_first_byte_s": ("storage", "first_byte_s"),
}


@dataclass
class PreflightReport:
    """Everything one preflight measured and decided (the ``--json`` file)."""

    ok: bool
    world_size: int
    backend: str | None
    device: str
    factor: float
    budget_s: float
    used_s: float
    quick: bool
    hosts: list[str]
    figures: dict[str, list[float | None]]  # figure -> value per rank
    medians: dict[str, float]
    outliers: list[Outlier]
    failures: list[str]
    skipped: list[str]
    cut: list[str]
    collectives: list[dict[str, Any]] = field(default_factory=list)
    links: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    checkpoint_url: str | None = None
    # per-rank figures that named some rank at first and were measured again on every rank
    measured_again: list[str] = field(default_factory=list)
    version: int = REPORT_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outliers"] = [{**asdict(o), "ratio": o.ratio} for o in self.outliers]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreflightReport:
        if d.get("version") != REPORT_VERSION:
            raise ValueError(
                f"preflight report version {d.get('version')!r}; this toolkit reads version "
                f"{REPORT_VERSION}"
            )
        # fields a later version of this report added (additive within a version) are left out:
        # a report is read by the toolkit that wrote it or a later one, and a field it lacks
        # (``measured_again`` before it existed) takes its default
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k in known}
        fields["outliers"] = [
            Outlier(**{k: v for k, v in o.items() if k != "ratio"}) for o in d["outliers"]
        ]
        return cls(**fields)

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def summary(self) -> str:
        """One paragraph: passed, or every failure."""
        if self.ok:
            return f"preflight passed on {self.world_size} rank(s) in {self.used_s:.1f} s"
        return "; ".join(self.failures)


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d if isinstance(d, int | float) and not isinstance(d, bool) else None


def build_report(
    *,
    config: PreflightConfig,
    ranks: list[dict[str, Any]],
    matrix: list[list[float | None]] | None,
    link_plan: dict[str, Any],
    collectives: list[dict[str, Any]],
    backend: str | None,
    device: str,
    used_s: float,
    timings_s: dict[str, float],
    skipped: list[str],
    cut: list[str],
) -> PreflightReport:
    """Judge the gathered figures: outliers by ``config.factor`` against the median over ranks
    (and links), plus every rank's own failures (device, storage)."""
    hosts = {r["rank"]: r["host"] for r in ranks}
    figures = {key: [_get(r, path) for r in ranks] for key, path in _RANK_FIGURES.items()}
    figures = {k: v for k, v in figures.items() if any(x is not None for x in v)}
    medians = {k: statistics.median([x for x in v if x is not None]) for k, v in figures.items()}
    outliers: list[Outlier] = []
    for key, values in figures.items():
        if key in FIGURES and key != "link_bytes_per_s":
            per_rank = {r["rank"]: v for r, v in zip(ranks, values) if v is not None}
            outliers += rank_outliers(per_rank, FIGURES[key], config.factor, hosts)
    links: dict[str, Any] = {}
    if matrix is not None:
        outliers += link_outliers(matrix, config.factor, hosts)
        values = [v for row in matrix for v in row if v is not None]
        links = {
            "matrix_bytes_per_s": matrix,
            "median_bytes_per_s": statistics.median(values) if values else None,
            **link_plan,
        }
    failures = [f for r in ranks for f in r.get("failures", [])]
    failures += [o.message for o in outliers]
    notes = sorted(
        {r["device"]["vendor"]["note"] for r in ranks if r["device"]["vendor"].get("note")}
    )
    return PreflightReport(
        ok=not failures,
        world_size=len(ranks),
        backend=backend,
        device=device,
        factor=config.factor,
        budget_s=config.budget_s,
        used_s=used_s,
        quick=config.quick,
        hosts=[hosts[r] for r in sorted(hosts)],
        figures=figures,
        medians=medians,
        outliers=outliers,
        failures=failures,
        skipped=[*skipped, *notes],
        cut=cut,
        collectives=collectives,
        links=links,
        ranks=ranks,
        timings_s={k: round(v, 3) for k, v in timings_s.items()},
        checkpoint_url=config.checkpoint_url,
        measured_again=list(ranks[0].get("measured_again", [])) if ranks else [],
    )


# --- the terminal ---------------------------------------------------------------------------------

_COLUMNS = [
    ("memory_bytes_per_s", "memory", "B/s"),
    ("numpy_copy_bytes_per_s", "numpy", "B/s"),
    ("matmul_flops_per_s", "matmul", "FLOP/s"),
    ("store_round_trip_s", "store", "s"),
    ("h2d_bytes_per_s", "host->dev", "B/s"),
    ("d2h_bytes_per_s", "dev->host", "B/s"),
    ("storage_write_bytes_per_s", "ckpt write", "B/s"),
    ("storage_read_bytes_per_s", "ckpt read", "B/s"),
    ("storage_first_byte_s", "ckpt 1st", "s"),
]


def _scale(value: float, unit: str) -> tuple[float, str]:
    """A display unit for a column whose typical value is ``value``."""
    table = {
        "B/s": ((1 << 30, "GiB/s"), (1 << 20, "MiB/s"), (1 << 10, "KiB/s"), (1, "B/s")),
        "FLOP/s": ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1, "FLOP/s")),
        "s": ((1, "s"), (1e-3, "ms"), (1e-6, "us")),
    }[unit]
    for scale, name in table:
        if abs(value) >= scale:
            return scale, name
    return table[-1]


def print_report(report: PreflightReport, console: Any = None) -> None:
    """The report as rich tables (per rank, collectives, links) and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    named = {(o.figure, o.rank) for o in report.outliers if o.kind == "rank"}
    link_ranks = {
        o.rank for o in report.outliers if o.figure == "link_bytes_per_s" and o.kind == "rank"
    }
    cols = [c for c in _COLUMNS if c[0] in report.figures]
    t = Table(
        title=f"preflight: {report.world_size} rank(s), {report.backend or 'no group'}, "
        f"{report.device} (figures per rank; red: named)"
    )
    t.add_column("rank", justify="right")
    t.add_column("host")
    scales = []
    for key, label, unit in cols:
        scale, name = _scale(report.medians[key], unit)
        scales.append(scale)
        t.add_column(f"{label}\n{name}", justify="right")
    t.add_column("checks")
    for r, rank in enumerate(report.ranks):
        cells = [str(rank["rank"]), rank["host"]]
        for (key, _, _), scale in zip(cols, scales):
            v = report.figures[key][r]
            text = "-" if v is None else f"{v / scale:.3g}"
            cells.append(f"[bold red]{text}[/]" if (key, rank["rank"]) in named else text)
        cells.append("[bold red]FAILED[/]" if rank.get("failures") else "ok")
        if rank["rank"] in link_ranks:
            cells[0] = f"[bold red]{cells[0]}[/]"
        t.add_row(*cells)
    medians = [f"{report.medians[k] / sc:.3g}" for (k, _, _), sc in zip(cols, scales)]
    t.add_row("", "median", *medians, "", style="dim")
    console.print(t)

    if report.collectives:
        ops = list(dict.fromkeys(c["op"] for c in report.collectives))
        sizes = sorted({c["size_bytes"] for c in report.collectives})
        by = {(c["op"], c["size_bytes"]): c for c in report.collectives}
        top = max(c["busbw_bytes_per_s"] for c in report.collectives)
        scale, name = _scale(top, "B/s")
        ct = Table(title=f"collectives: bus bandwidth in {name} (time per iteration)")
        ct.add_column("size", justify="right")
        for op in ops:
            ct.add_column(op, justify="right")
        for size in sizes:
            row = [human_bytes(size)]
            for op in ops:
                c = by.get((op, size))
                row.append(
                    "-" if c is None
                    else f"{c['busbw_bytes_per_s'] / scale:.3g} ({human(c['time_s'], 's')})"
                )  # fmt: skip
            ct.add_row(*row)
        console.print(ct)

    matrix = report.links.get("matrix_bytes_per_s")
    if matrix and len(matrix) <= 16:
        slow = {(o.src, o.dst) for o in report.outliers if o.kind == "link"}
        scale, name = _scale(report.links["median_bytes_per_s"], "B/s")
        lt = Table(
            title=f"pairwise send/recv in {name}, row -> column "
            f"({human_bytes(report.links['message_bytes'])} messages, "
            f"{report.links['schedule']})"
        )
        lt.add_column("from\\to", justify="right")
        for j in range(len(matrix)):
            lt.add_column(str(j), justify="right")
        for i, row in enumerate(matrix):
            cells = []
            for j, v in enumerate(row):
                text = "-" if v is None else f"{v / scale:.3g}"
                cells.append(f"[bold red]{text}[/]" if (i, j) in slow else text)
            lt.add_row(str(i), *cells)
        console.print(lt)
    elif matrix:
        console.print(
            f"pairwise links: {len(matrix)} ranks, each meeting "
            f"{report.links.get('peers_per_rank', len(matrix) - 1)} peers, median "
            f"{human(report.links['median_bytes_per_s'], 'B/s')} (the matrix is in --json)"
        )

    if report.measured_again:
        labels = [FIGURES[k].label for k in report.measured_again if k in FIGURES]
        console.print(
            f"[dim]per-rank figures: {', '.join(labels)} named a rank at first and "
            f"{'were' if len(labels) > 1 else 'was'} measured again on every rank; each rank's "
            f"better pass counts[/]"
        )
    again = report.links.get("measured_again")
    if again:
        console.print(
            f"[dim]pairwise links: {again} that looked slow measured again, alone; "
            f"the better figure counts[/]"
        )
    for s in report.skipped:
        console.print(f"[dim]skipped: {s}[/]")
    for c in report.cut:
        console.print(f"[yellow]cut: {c}[/]")
    for f in report.failures:
        console.print(f"[bold red]FAILED[/] {f}")
    verdict = "[bold green]PASSED[/]" if report.ok else "[bold red]FAILED[/]"
    console.print(
        f"{verdict}: {report.world_size} rank(s) on {len(set(report.hosts))} host(s), "
        f"{report.used_s:.1f} s of a {report.budget_s:g} s budget, outliers below "
        f"{report.factor:g}x the median"
    )


# --- the plot -------------------------------------------------------------------------------------


def require_matplotlib() -> None:
    """Raise ImportError with what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot FILE needs matplotlib, which is not installed; install the plot extra "
            "(pip install 'resilient[plot]') or leave --plot out"
        ) from None


def plot(report: PreflightReport, path: str) -> None:
    """Bus bandwidth against message size per collective, and the pairwise matrix as a
    heatmap, in one picture."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix = report.links.get("matrix_bytes_per_s")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    ops = list(dict.fromkeys(c["op"] for c in report.collectives))
    for op in ops:
        rows = sorted(
            (c for c in report.collectives if c["op"] == op), key=lambda c: c["size_bytes"]
        )
        ax.plot(
            [c["size_bytes"] for c in rows],
            [c["busbw_bytes_per_s"] / 2**30 for c in rows],
            marker="o",
            label=op,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GiB/s)")
    ax.set_title(f"collectives, {report.world_size} ranks ({report.backend})")
    if ops:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no collectives measured", ha="center", transform=ax.transAxes)
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    if matrix:
        n = len(matrix)
        data = [[float("nan") if v is None else v / 2**30 for v in row] for row in matrix]
        im = ax.imshow(data, cmap="viridis")
        fig.colorbar(im, ax=ax, label="GiB/s")
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        if n <= 8:
            for i in range(n):
                for j in range(n):
                    if matrix[i][j] is not None:
                        ax.text(j, i, f"{data[i][j]:.2g}", ha="center", va="center", color="w")
        ax.set_title("pairwise send/recv bandwidth")
    else:
        ax.text(0.5, 0.5, "no pairwise links (a world of one)", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
