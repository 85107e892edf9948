"""Which rank or link is worse than the others: pure arithmetic on the gathered figures.

A figure is judged against the median of the same figure over every rank (or link).  A rank is
named when its figure is worse than the median by the user's factor (default 0.7): a bandwidth
below ``factor x median``, a latency above ``median / factor``.  Latencies also need an absolute
slack (``Figure.slack``): a store round trip of 3 ms against a median of 0.1 ms is 30x the median
and still harmless (the store carries heartbeats a second apart and a few round trips a
rendezvous; a healthy rank on a busy machine measured 2.3 ms); 10 ms more than the median is a
path to the store's host worth naming.

Checkpoint storage figures are reported, not judged: ranks share the storage, and its per-rank
figures move with the storage's load, not with the node; a storage error fails the check.

Links are judged in two passes, so that one slow rank is named once rather than as the 2(N-1)
links that touch it: first each rank's link score (the median of the bandwidths of every link it
sends or receives on) is judged like any rank figure; then each link that touches none of the ranks
named that way is judged against the median of those links.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Figure",
    "FIGURES",
    "Outlier",
    "rank_outliers",
    "link_outliers",
    "suspect_links",
    "human",
    "human_bytes",
]


@dataclass(frozen=True)
class Figure:
    """A per-rank figure: its report key, label in messages, unit, and which way is better."""

    key: str
    label: str
    unit: str  # "B/s", "FLOP/s" or "s"
    higher_is_better: bool = True
    slack: float = 0.0  # a difference from the median below this (in ``unit``) is never named


FIGURES = {
    f.key: f
    for f in (
        Figure("memory_bytes_per_s", "host memory bandwidth", "B/s"),
        Figure("matmul_flops_per_s", "matmul throughput", "FLOP/s"),
        Figure("store_round_trip_s", "store round trip", "s", higher_is_better=False, slack=1e-2),
        Figure("h2d_bytes_per_s", "host-to-device copy", "B/s"),
        Figure("d2h_bytes_per_s", "device-to-host copy", "B/s"),
        Figure("link_bytes_per_s", "pairwise send/recv bandwidth (median of its links)", "B/s"),
    )
}


@dataclass(frozen=True)
class Outlier:
    """A rank (``kind="rank"``) or a link (``kind="link"``, ``src -> dst``) named by a figure."""

    kind: str
    figure: str  # a key of FIGURES, or "link_bytes_per_s"
    value: float
    median: float
    message: str
    rank: int | None = None
    src: int | None = None
    dst: int | None = None
    host: str | None = None

    @property
    def ratio(self) -> float:
        return self.value / self.median if self.median else float("inf")


def human(value: float, unit: str) -> str:
    """``3.1 GiB/s``, ``412 MiB/s``, ``12.3 GFLOP/s``, ``0.41 ms``."""
    if unit == "B/s":
        for scale, name in ((1 << 30, "GiB/s"), (1 << 20, "MiB/s"), (1 << 10, "KiB/s")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.3g} B/s"
    if unit == "FLOP/s":
        for scale, name in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.3g} FLOP/s"
    if unit == "s":
        if abs(value) >= 1:
            return f"{value:.3g} s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.3g} ms"
        return f"{value * 1e6:.3g} us"
    return f"{value:.3g} {unit}"


def human_bytes(n: float) -> str:
    """``4 KiB``, ``256 MiB``, ``1.5 GiB``."""
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {name}"
    return f"{n:.0f} B"


def _worse(value: float, median: float, figure: Figure, factor: float) -> bool:
    if figure.higher_is_better:
        return value < factor * median and median - value > figure.slack
    return value > median / factor and value - median > figure.slack


def _ratio(value: float, median: float) -> str:
    """``0.32x``, ``55x``, ``200x`` (never ``2e+02x``)."""
    if not median:
        return "infx"
    r = value / median
    return f"{r:.2g}x" if r < 100 else f"{r:.0f}x"


def _where(rank: int, hosts: Mapping[int, str] | None) -> str:
    host = (hosts or {}).get(rank)
    return f"rank {rank} ({host})" if host else f"rank {rank}"


def rank_outliers(
    values: Mapping[int, float],
    figure: Figure,
    factor: float,
    hosts: Mapping[int, str] | None = None,
) -> list[Outlier]:
    """The ranks whose ``figure`` is worse than the median over ``values`` by ``factor``.  Fewer
    than two ranks with a value: nothing to compare, nothing named."""
    present = {r: float(v) for r, v in values.items() if v is not None}
    if len(present) < 2:
        return []
    median = statistics.median(present.values())
    out = []
    for rank, value in sorted(present.items()):
        if not _worse(value, median, figure, factor):
            continue
        message = (
            f"{_where(rank, hosts)}: {figure.label} {human(value, figure.unit)}, median "
            f"{human(median, figure.unit)} ({_ratio(value, median)})"
        )
        out.append(
            Outlier(
                kind="rank",
                figure=figure.key,
                value=value,
                median=median,
                message=message,
                rank=rank,
                host=(hosts or {}).get(rank),
            )
        )
    return out


def link_outliers(
    matrix: Sequence[Sequence[float | None]],
    factor: float,
    hosts: Mapping[int, str] | None = None,
) -> list[Outlier]:
    """Slow ranks (by their links' median) and then slow links among the rest; ``matrix[i][j]``
    is the bandwidth from rank i to rank j in bytes/s (None on the diagonal and where not
    measured)."""
    n = len(matrix)
    links = {
        (i, j): float(matrix[i][j])
        for i in range(n)
        for j in range(n)
        if i != j and matrix[i][j] is not None
    }
    if len(links) < 2:
        return []
    per_rank: dict[int, list[float]] = {}
    for (i, j), v in links.items():  # one pass: a thousand ranks' matrix is a million links
        per_rank.setdefault(i, []).append(v)
        per_rank.setdefault(j, []).append(v)
    score = {r: statistics.median(mine) for r, mine in sorted(per_rank.items())}
    ranks = rank_outliers(score, FIGURES["link_bytes_per_s"], factor, hosts)
    named = {o.rank for o in ranks}
    rest = {k: v for k, v in links.items() if k[0] not in named and k[1] not in named}
    if len(rest) < 2:
        return ranks
    median = statistics.median(rest.values())
    figure = Figure("link_bytes_per_s", "link", "B/s")
    several_hosts = len(set((hosts or {}).values())) > 1
    out = list(ranks)
    for (i, j), value in sorted(rest.items()):
        if not _worse(value, median, figure, factor):
            continue
        where = f" ({hosts[i]} -> {hosts[j]})" if several_hosts and hosts else ""
        message = (
            f"link {i}->{j}{where}: {human(value, 'B/s')}, median {human(median, 'B/s')} "
            f"({_ratio(value, median)})"
        )
        out.append(
            Outlier(
                kind="link",
                figure="link_bytes_per_s",
                value=value,
                median=median,
                message=message,
                src=i,
                dst=j,
            )
        )
    return out


def suspect_links(matrix: Sequence[Sequence[float | None]], factor: float) -> list[tuple[int, int]]:
    """The links ``link_outliers`` would name or count against a named rank, the slowest first:
    the ones to measure again before naming anything."""
    n = len(matrix)
    pairs: set[tuple[int, int]] = set()
    for o in link_outliers(matrix, factor):
        if o.kind == "link":
            pairs.add((o.src, o.dst))
        else:
            r = o.rank
            pairs |= {(r, j) for j in range(n) if j != r and matrix[r][j] is not None}
            pairs |= {(i, r) for i in range(n) if i != r and matrix[i][r] is not None}
    return sorted(pairs, key=lambda p: (matrix[p[0]][p[1]], p))
