"""Pairwise send/recv bandwidth between every ordered pair of ranks: the matrix that finds one
slow link or one slow node.

A sample from rank i to rank j is ``k`` sends of one message, acknowledged by one tiny message
back, timed at the sender: the acknowledgement makes the time cover the bytes' arrival, not just
their hand-over to the transport.  Every pair gets ``repeats`` samples, interleaved (round after
round over all pairs), and the figure is their median, so a burst of load on the machine touches
every pair alike.  Up to ``SEQUENTIAL_UP_TO`` ranks the pairs go one at a time (clean figures);
beyond, the pairs of a round are disjoint and run at once (the circle method: 2(n-1) rounds for n
ranks), so the check grows with n, not with n squared.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from resilient.preflight.group import Group
from resilient.preflight.outliers import human_bytes

__all__ = ["SEQUENTIAL_UP_TO", "pair_rounds", "plan_links", "probe_links", "run_links"]

SEQUENTIAL_UP_TO = 8


def pair_rounds(world: int, concurrent: bool | None = None) -> list[list[tuple[int, int]]]:
    """Rounds of ordered (src, dst) pairs; no rank is in two pairs of one round, and every
    ordered pair of distinct ranks is in exactly one round."""
    if concurrent is None:
        concurrent = world > SEQUENTIAL_UP_TO
    if not concurrent:
        return [[(i, j)] for i in range(world) for j in range(world) if i != j]
    ranks = list(range(world)) + ([None] if world % 2 else [])
    m = len(ranks)
    rounds = []
    for _ in range(m - 1):  # the circle method: rank 0 fixed, the rest rotate
        pairs = [(ranks[k], ranks[m - 1 - k]) for k in range(m // 2)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        rounds.append([(a, b) for a, b in pairs])
        rounds.append([(b, a) for a, b in pairs])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return [r for r in rounds if r]


def plan_links(
    *, world: int, budget_s: float, est_bytes_per_s: float, message_bytes: int, repeats: int = 5
) -> tuple[int, int, int, list[str]]:
    """(message bytes, sends per sample, repeats, cuts) so that every round's samples fit
    ``budget_s`` at the estimated bandwidth: fewer sends, then smaller messages (down to 64 KiB),
    then fewer repeats (down to 3)."""
    rounds = len(pair_rounds(world))
    cuts: list[str] = []
    est = max(est_bytes_per_s, 1.0)

    def cost(m: int, k: int, r: int) -> float:
        return rounds * r * (k * m / est + 2e-4)

    sample_s = budget_s / max(rounds * repeats, 1)
    k = int(max(1, min(64, sample_s * est / message_bytes)))
    m, r = message_bytes, repeats
    while cost(m, k, r) > budget_s and m > 64 << 10:
        m //= 2
    while cost(m, k, r) > budget_s and r > 3:
        r -= 1
    if m < message_bytes:
        cuts.append(
            f"pairwise links: {human_bytes(m)} messages instead of {human_bytes(message_bytes)} "
            f"(budget)"
        )
    if r < repeats:
        cuts.append(f"pairwise links: {r} samples per pair instead of {repeats} (budget)")
    return m, k, r, cuts


def _exchange(src: int, dst: int, rank: int, buf: torch.Tensor, ack: torch.Tensor, k: int):
    """One sample of the pair (src, dst): the sender's elapsed seconds (None elsewhere)."""
    if rank == src:
        t0 = time.perf_counter()
        for _ in range(k):
            dist.send(buf, dst)
        dist.recv(ack, dst)
        return time.perf_counter() - t0
    if rank == dst:
        for _ in range(k):
            dist.recv(buf, src)
        dist.send(ack, src)
    return None


def probe_links(group: Group, nbytes: int) -> float:
    """One message over every pair (which also connects them): the median bytes per second over
    all links, the same on every rank.  The median, so that one slow link or rank does not set
    the sample length of all the others."""
    buf = torch.zeros(max(nbytes // 4, 1), device=group.device)
    ack = torch.zeros(1, device=group.device)
    mine = []
    for pairs in pair_rounds(group.world):
        group.sync()
        for src, dst in pairs:
            took = _exchange(src, dst, group.rank, buf, ack, 1)
            if took is not None:
                mine.append(buf.numel() * 4 / max(took, 1e-9))
    rates = [r for r in group.collect(statistics.median(mine) if mine else 0.0) if r > 0]
    return statistics.median(rates) if rates else 1e9


def run_links(
    group: Group, *, message_bytes: int, sends: int, repeats: int, budget_s: float | None = None
) -> tuple[list[list[float | None]], dict[str, int]]:
    """The median bandwidth (bytes/s) from each rank to each other one: ``matrix[i][j]`` at rank 0
    (this rank's row elsewhere, other rows None), and the sends per sample and repeats used.  When
    the first round over all pairs shows the plan will not fit ``budget_s``, the rest of the samples
    are shortened (fewer sends) and, if need be, fewer (not below 3)."""
    n, rank = group.world, group.rank
    rounds = pair_rounds(n)
    buf = torch.zeros(max(message_bytes // 4, 1), device=group.device)
    ack = torch.zeros(1, device=group.device)
    tiny = buf[:1]
    for pairs in rounds:  # warm-up: every pair connected (NCCL builds a communicator per pair)
        for src, dst in pairs:
            _exchange(src, dst, rank, tiny, ack, 1)
    samples: dict[int, list[float]] = {j: [] for j in range(n) if j != rank}
    t_start = time.perf_counter()
    rep = 0
    while rep < repeats:
        for pairs in rounds:
            group.sync()
            for src, dst in pairs:
                took = _exchange(src, dst, rank, buf, ack, sends)
                if took is not None:
                    samples[dst].append(buf.numel() * 4 * sends / max(took, 1e-9))
        rep += 1
        if rep == 1 and budget_s is not None and repeats > 1:
            (first,) = group.agree_max([time.perf_counter() - t_start])  # the same everywhere
            room = max(budget_s - first, 0.0)
            if first * (repeats - 1) > room:
                new_sends = max(1, int(sends * room / (first * (repeats - 1))))
                per_rep = first * new_sends / sends
                sends = new_sends
                repeats = max(3, min(repeats, 1 + int(room / max(per_rep, 1e-9))))
    row = [statistics.median(samples[j]) if j != rank else None for j in range(n)]
    rows = group.gather("links", row)
    matrix = rows if rows is not None else [row if i == rank else [None] * n for i in range(n)]
    return matrix, {"sends_per_sample": sends, "repeats": repeats}
