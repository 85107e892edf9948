"""Pairwise send/recv bandwidth between ordered pairs of ranks: the matrix that finds one slow
link or one slow node.

A sample from rank i to rank j is ``k`` sends of one message, acknowledged by one tiny message
back, timed at the sender: the acknowledgement makes the time cover the bytes' arrival, not just
their hand-over to the transport.  Every pair gets ``repeats`` samples, interleaved (round after
round over all pairs), and the figure is their median, so a burst of load on the machine touches
every pair alike.  Up to ``SEQUENTIAL_UP_TO`` ranks the pairs go one at a time (clean figures);
beyond, the pairs of a round are disjoint and run at once (the circle method: n-1 matchings, each
two rounds, one per direction), so the check grows with n, not with n squared.

Each round costs a barrier as well as its bytes (and each new peer a first contact), and at a
thousand ranks even the 2(n-1) rounds (2n when n is odd) do not fit a budget of seconds:
``plan_links`` prices a round at the measured barrier time plus its bytes, and where every
matching does not fit, it takes an evenly spread subset of them, so that each rank meets
``partners`` peers or more (both directions), never fewer than ``MIN_PARTNERS``; it cuts sends,
and message sizes down to a millisecond's bytes (a size that still measures bandwidth), first.  That still finds a slow
*node* (every link it has is slow, so its score, the median of its links, is; a healthy rank meets
it on at most one of its links), but a single slow link between two healthy ranks is seen only
when the plan met it: the report says how many peers each rank met at least.

A single link is judged on its own figure, and on a loaded machine a burst of someone else's work
can halve one link's samples; so before one is named, ``confirm_links`` measures each suspect
again, alone (one pair at a time), and keeps the better of the two figures: a link is named only
if it was slow both times.  The second figure is the best of its samples, not their median:
load only ever slows a sample down, so a link slowed by the network is slow in every sample, and
a healthy one is named only if every sample of it was hit (a CI run once saw a healthy link at
0.17x of the median over the median of three).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from resilient.preflight.group import Group
from resilient.preflight.outliers import human_bytes

__all__ = [
    "SEQUENTIAL_UP_TO",
    "MIN_PARTNERS",
    "LinkPlan",
    "matchings",
    "pair_rounds",
    "plan_links",
    "probe_links",
    "run_links",
    "confirm_links",
]

SEQUENTIAL_UP_TO = 8
MIN_PARTNERS = 3  # a rank's score is the median of its links: three outvote one slow peer
QUICK_PARTNERS = 4  # the start-of-training subset meets at most this many peers (large worlds)
CONFIRM_AT_MOST = 32  # suspect links measured again, alone, before one is named
_ROUND_S = 2e-4  # a round's fixed cost besides the barrier: the acknowledgement, the scheduling


def _matching(world: int, t: int) -> list[tuple[int, int]]:
    """Round ``t`` of the circle method: rank 0 fixed, the others (and a bye when ``world`` is
    odd) rotated ``t`` places; disjoint unordered pairs (a < b)."""
    m = world + world % 2

    def at(p: int) -> int:
        return 0 if p == 0 else 1 + (p - 1 - t) % (m - 1)

    pairs = ((at(k), at(m - 1 - k)) for k in range(m // 2))
    return [(min(a, b), max(a, b)) for a, b in pairs if a < world and b < world]


def _count(world: int) -> int:
    return world - 1 + world % 2 if world > 1 else 0


def matchings(world: int) -> list[list[tuple[int, int]]]:
    """The circle method: ``world - 1`` (``world`` when odd) rounds of disjoint unordered pairs
    (a < b) that between them hold every pair once."""
    return [_matching(world, t) for t in range(_count(world))]


def _chosen(world: int, partners: int | None) -> range | list[int]:
    """Which of the circle method's matchings give every rank ``partners`` peers or more (None:
    all of them): that many (one more in an odd world), evenly spread."""
    count = _count(world)
    if partners is None or partners + world % 2 >= count:
        return range(count)
    want = partners + world % 2
    step = count / want
    return [int(i * step) for i in range(want)]


def pair_rounds(
    world: int, concurrent: bool | None = None, partners: int | None = None
) -> list[list[tuple[int, int]]]:
    """Rounds of ordered (src, dst) pairs; no rank is in two pairs of one round.  Every ordered
    pair of distinct ranks is in exactly one round, unless ``partners`` (concurrent only) asks
    that every rank meet at least that many peers: that many matchings (one more in an odd world,
    where each matching leaves one rank out), spread evenly over the circle method's, each in
    both directions."""
    if partners is not None and partners < 1:
        raise ValueError(f"partners must be >= 1, got {partners}")
    if concurrent is None:
        concurrent = world > SEQUENTIAL_UP_TO
    if not concurrent:
        return [[(i, j)] for i in range(world) for j in range(world) if i != j]
    rounds = []
    for t in _chosen(world, partners):
        pairs = _matching(world, t)
        rounds.append(pairs)
        rounds.append([(b, a) for a, b in pairs])
    return rounds


@dataclass(frozen=True)
class LinkPlan:
    """What ``run_links`` does: the message size, sends per sample, samples per pair, the
    rounds (``partners``: the fewest peers any rank meets; None: every one) and what the budget
    cut, as lines for the report."""

    message_bytes: int
    sends: int
    repeats: int
    rounds: list[list[tuple[int, int]]]
    partners: int | None = None
    cuts: list[str] = field(default_factory=list)


_BANDWIDTH_FLOOR = 256 << 10  # messages shrink to this (or a millisecond's bytes) before peers go
_MESSAGE_FLOOR = 64 << 10


def plan_links(
    *,
    world: int,
    budget_s: float,
    est_bytes_per_s: float,
    message_bytes: int,
    sync_s: float = 0.0,
    connect_s: float = 0.0,
    repeats: int = 5,
    quick: bool = False,
    slowest_bytes_per_s: float | None = None,
) -> LinkPlan:
    """The plan whose rounds fit ``budget_s`` at the estimated bandwidth, barrier time
    (``sync_s``, every round) and first-contact time (``connect_s``, every new peer): fewer sends
    per sample, then smaller messages down to a millisecond's bytes at the estimated bandwidth
    (256 KiB at least), then, past ``SEQUENTIAL_UP_TO`` ranks,
    fewer peers per rank (down to ``MIN_PARTNERS``), then messages down to 64 KiB, then fewer
    repeats (down to 3).  ``quick`` (the start-of-training subset) meets at most
    ``QUICK_PARTNERS`` peers in a world that large.  ``slowest_bytes_per_s``: the slowest pair's
    rate (the probe's), priced on one pair of the plan: a link at 1 MiB/s took 4 s a sample of
    4 MiB, whatever the others' median."""
    concurrent = world > SEQUENTIAL_UP_TO
    est = max(est_bytes_per_s, 1.0)
    overhead = sync_s + _ROUND_S
    every = _count(world) if concurrent else 0
    partners = every
    if concurrent and quick:
        partners = min(every, QUICK_PARTNERS)

    def matchings_of(p: int) -> int:
        return len(_chosen(world, p))

    def rounds_of(p: int) -> int:
        return 2 * matchings_of(p) if concurrent else world * (world - 1)

    slow_extra = 0.0  # per byte, on one pair: its round takes as long as the slow pair
    if slowest_bytes_per_s is not None and 0 < slowest_bytes_per_s < est:
        slow_extra = 1 / slowest_bytes_per_s - 1 / est

    def cost(m: int, k: int, r: int, p: int) -> float:
        connect = matchings_of(p) * connect_s if concurrent else (world - 1) * connect_s
        return rounds_of(p) * r * (k * m / est + overhead) + r * k * m * slow_extra + connect

    m, r = message_bytes, repeats
    sample_s = budget_s / max(rounds_of(partners) * repeats, 1) - overhead
    k = int(max(1, min(64, sample_s * est / m)))
    while cost(m, k, r, partners) > budget_s and k > 1:
        k = max(1, k // 2)
    # a sample's bytes should take a millisecond or more to move, or it measures latency
    floor = min(message_bytes, max(_BANDWIDTH_FLOOR, int(est * 1e-3)))
    while cost(m, k, r, partners) > budget_s and m > floor:
        m //= 2
    if concurrent and cost(m, k, r, partners) > budget_s:
        per = 2 * r * (k * m / est + overhead) + connect_s  # one matching
        fits = int(budget_s / per) - world % 2  # (finite: the cost of a finite plan is over it)
        partners = max(min(partners, MIN_PARTNERS), min(partners, fits))
    while cost(m, k, r, partners) > budget_s and m > _MESSAGE_FLOOR:
        m //= 2
    while cost(m, k, r, partners) > budget_s and r > 3:
        r -= 1
    cuts: list[str] = []
    if m < message_bytes:
        cuts.append(
            f"pairwise links: {human_bytes(m)} messages instead of {human_bytes(message_bytes)} "
            f"(budget)"
        )
    if r < repeats:
        cuts.append(f"pairwise links: {r} samples per pair instead of {repeats} (budget)")
    sampled = concurrent and partners < every
    if sampled:
        why = "the quick subset" if quick and partners == QUICK_PARTNERS else "budget"
        cuts.append(
            f"pairwise links: each rank met {partners} or more of its {world - 1} peers ({why}); "
            f"a slow node is still named, a single slow link only if it was met"
        )
    rounds = pair_rounds(world, concurrent, partners if sampled else None)
    return LinkPlan(m, k, r, rounds, partners if sampled else None, cuts)


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


def probe_links(
    group: Group, nbytes: int, *, budget_s: float | None = None
) -> tuple[float, float, float, float]:
    """(bytes per second, seconds per barrier, seconds per first contact, the slowest pair's
    bytes per second), the same on every rank.  One tiny message, one of ``PROBE_BYTES`` and then one of ``nbytes`` over the pairs of
    a few matchings (every pair up to ``SEQUENTIAL_UP_TO`` ranks): the bandwidth is the median
    over them, so that one slow link or rank does not set the sample length of all the others,
    and the first contact (NCCL builds a communicator per pair) the slowest rank's median; and
    the slowest rank's median time of a few barriers, what every round of the plan pays; the
    slowest pair, so that the plan fits one slow link's samples in the budget too.  The
    ``nbytes`` message is smaller (not below ``PROBE_BYTES``) where, at the slowest pair's rate
    on the small one, it would take more than a tenth of ``budget_s`` over the pairs (a 4 MiB
    message on a 1 MiB/s link took 4 s a pair)."""
    rounds = pair_rounds(group.world, partners=MIN_PARTNERS)
    small = min(nbytes, PROBE_BYTES)
    buf = torch.zeros(max(nbytes // 4, 1), device=group.device)
    ack = torch.zeros(1, device=group.device)
    first: list[float] = []
    mine = _probe_rates(group, rounds, buf[: max(small // 4, 1)], ack, first)
    message = nbytes
    if budget_s is not None and nbytes > small:
        (slowest,) = group.agree_min([min(mine) if mine else float("inf")])
        while message > small and len(rounds) * message / max(slowest, 1.0) > budget_s / 10:
            message //= 2
    if message > small:
        mine = _probe_rates(group, rounds, buf[: max(message // 4, 1)], ack, None)
    syncs = []
    for _ in range(5):
        t0 = time.perf_counter()
        group.sync()
        syncs.append(time.perf_counter() - t0)
    rates = [r for r in group.collect(statistics.median(mine) if mine else 0.0) if r > 0]
    med = statistics.median
    sync_s, connect_s = group.agree_max([med(syncs), med(first) if first else 0.0])
    (slowest,) = group.agree_min([min(mine) if mine else float("inf")])
    est = med(rates) if rates else 1e9
    return est, sync_s, connect_s, min(slowest, est)


PROBE_BYTES = 64 << 10  # the first probe's message: 64 ms on a 1 MiB/s link


def _probe_rates(
    group: Group,
    rounds: list[list[tuple[int, int]]],
    buf: torch.Tensor,
    ack: torch.Tensor,
    first: list[float] | None,
) -> list[float]:
    """One send of ``buf`` over every pair of ``rounds``: this rank's rates as a sender (and,
    into ``first``, its first contacts: one tiny message per pair before)."""
    mine = []
    for pairs in rounds:
        group.sync()
        for src, dst in pairs:
            if first is not None:
                took = _exchange(src, dst, group.rank, buf[:1], ack, 1)
                if took is not None:
                    first.append(took)
            took = _exchange(src, dst, group.rank, buf, ack, 1)
            if took is not None:
                mine.append(buf.numel() * 4 / max(took, 1e-9))
    return mine


def run_links(
    group: Group, plan: LinkPlan, *, budget_s: float | None = None
) -> tuple[list[list[float | None]] | None, dict[str, int]]:
    """The median bandwidth (bytes/s) from each rank to each peer the plan meets:
    ``matrix[i][j]`` at rank 0 (None where not met; None elsewhere), and the sends per sample,
    repeats and message size used.  When the first round over the plan's pairs shows it will not
    fit ``budget_s``, the rest of the samples are shortened (fewer sends, then a smaller message,
    not below ``PROBE_BYTES``: one send of it can be what a slow link cannot fit) and, if need
    be, fewer (not below 3)."""
    n, rank = group.world, group.rank
    rounds, sends, repeats = plan.rounds, plan.sends, plan.repeats
    buf = torch.zeros(max(plan.message_bytes // 4, 1), device=group.device)
    ack = torch.zeros(1, device=group.device)
    tiny = buf[:1]
    for pairs in rounds:  # warm-up: every pair connected (NCCL builds a communicator per pair)
        for src, dst in pairs:
            _exchange(src, dst, rank, tiny, ack, 1)
    samples: dict[int, list[float]] = {}
    t_start = time.perf_counter()
    rep = 0
    while rep < repeats:
        for pairs in rounds:
            group.sync()
            for src, dst in pairs:
                took = _exchange(src, dst, rank, buf, ack, sends)
                if took is not None:
                    rate = buf.numel() * 4 * sends / max(took, 1e-9)
                    samples.setdefault(dst, []).append(rate)
        rep += 1
        if rep == 1 and budget_s is not None and repeats > 1:
            (first,) = group.agree_max([time.perf_counter() - t_start])  # the same everywhere
            room = max(budget_s - first, 0.0)
            if first * (repeats - 1) > room:
                scale = room / (first * (repeats - 1))  # of each later round's bytes
                new_sends = max(1, int(sends * scale))
                per_rep = first * new_sends / sends
                shrink = sends * scale / new_sends  # below 1: one send is already too much
                floor = min(buf.numel(), max(PROBE_BYTES // 4, 1))
                if shrink < 1 and buf.numel() > floor:
                    numel = max(floor, int(buf.numel() * shrink))
                    per_rep *= numel / buf.numel()
                    buf = buf[:numel]
                sends = new_sends
                repeats = max(3, min(repeats, 1 + int(room / max(per_rep, 1e-9))))
    # only what was met travels (a thousand ranks' rows are mostly empty)
    row = {str(j): statistics.median(v) for j, v in samples.items()}
    rows = group.gather("links", row)
    matrix = None
    if rows is not None:
        matrix = [[None] * n for _ in range(n)]
        for i, got in enumerate(rows):
            for j, v in got.items():
                if 0 <= int(j) < n and int(j) != i:
                    matrix[i][int(j)] = float(v)
    ran = {"sends_per_sample": sends, "repeats": repeats, "message_bytes": buf.numel() * 4}
    return matrix, ran


def confirm_links(
    group: Group,
    matrix: list[list[float | None]] | None,
    suspects: list[tuple[int, int]] | None,
    *,
    message_bytes: int,
    sends: int,
    repeats: int = 5,
    budget_s: float | None = None,
) -> tuple[list[list[float | None]] | None, dict[str, int]]:
    """Measure rank 0's ``suspects`` (pairs ``(src, dst)``, the slowest first; None on the other
    ranks) again, one pair at a time, ``repeats`` samples each (fewer, never none, where the
    first round shows they would not fit ``budget_s``: agreed, every rank stops together), and
    put the better of the first figure and the best sample in rank 0's ``matrix``.  At most
    ``CONFIRM_AT_MOST`` pairs.  Returns the matrix (None off rank 0) and how many pairs were
    measured again."""
    pairs = group.share("links-suspects", suspects if group.rank == 0 else None) or []
    pairs = [(int(a), int(b)) for a, b in pairs][:CONFIRM_AT_MOST]
    if not pairs:
        return matrix, {"measured_again": 0}
    buf = torch.zeros(max(message_bytes // 4, 1), device=group.device)
    ack = torch.zeros(1, device=group.device)
    samples: dict[int, list[float]] = {}
    t_start = time.perf_counter()
    rep = 0
    while rep < repeats:
        for src, dst in pairs:
            group.sync()
            took = _exchange(src, dst, group.rank, buf, ack, sends)
            if took is not None:
                samples.setdefault(dst, []).append(buf.numel() * 4 * sends / max(took, 1e-9))
        rep += 1
        if budget_s is not None and rep < repeats:
            (spent,) = group.agree_max([time.perf_counter() - t_start])  # the same everywhere
            if spent / rep * (rep + 1) > budget_s:
                break
    row = {str(j): max(v) for j, v in samples.items()}  # load only slows a sample down
    rows = group.gather("links-again", row)
    if rows is not None and matrix is not None:
        n = len(matrix)
        for i, got in enumerate(rows):
            for j, v in got.items():
                j = int(j)
                if 0 <= j < n and j != i and (i, j) in pairs:
                    before = matrix[i][j]
                    matrix[i][j] = float(v) if before is None else max(float(before), float(v))
    return matrix, {"measured_again": len(pairs)}
