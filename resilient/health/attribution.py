"""Hang attribution: which collective a hung job is stuck in, and which ranks never entered it.

Pure logic over the rings the ranks published (``resilient.health.ring``): no store, no clocks of
its own; times are already on the leader's monotonic clock.  The leader calls
``attribute_hang`` when it declares HUNG and writes the result to the event log
(``hang_attribution``) next to the verdict.

For every collective some rank is inside (a group and a sequence number), the members of the
group are sorted into: *waiting* (inside it), *mismatched* (inside the same sequence number of the
group with another operation: the ranks called different collectives), *done* (they already
left it) and *missing* (they never entered it: their newest sequence number on the group is
lower).  A missing rank that is inside no collective itself is a *culprit*: the job waits for it
while it runs (or hangs) outside any collective, and its Python stack says where.  The outcomes:

* ``missing_rank``: culprits found ("ranks 0, 3 are in all_reduce #57 on tp [0, 1]; rank 1 never
  entered it: it last left all_reduce #40 on world [0-3] 4.1 s ago and is in no collective");
* ``mismatch``: ranks are inside the same call of a group with different operations;
* ``circular``: every missing rank waits inside another collective (the ranks called collectives in
  different orders: a deadlock);
* ``inside_collective``: every member entered every collective that ranks wait in: the hang is
  inside the collective (the transport, a device), not a rank that never came;
* ``no_collective``: no rank is inside a collective: the hang is outside them;
* ``no_ring``: no rank published a ring (the ring is off).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient.health.ring import format_ranks, unpack_ranks

__all__ = [
    "Call",
    "GroupState",
    "RankRing",
    "Stuck",
    "Attribution",
    "decode_summary",
    "attribute_hang",
    "format_rank_list",
]

MAX_STUCK = 16  # collectives listed in a record (the rest are counted)
STACK_FRAMES_IN_SUMMARY = 3


@dataclass(frozen=True)
class Call:
    op: str
    group: str
    seq: int
    nbytes: int | None
    entered_t: float
    left_t: float | None  # None: still inside
    pending: bool = False  # asynchronous: issued, its work not completed

    @property
    def inside(self) -> bool:
        return self.left_t is None or self.pending

    def name(self) -> str:
        return f"{self.op} #{self.seq} on {self.group}"


@dataclass(frozen=True)
class GroupState:
    ranks: tuple[int, ...]
    entered: int  # the newest sequence number the rank entered on this group
    left: int


@dataclass(frozen=True)
class RankRing:
    rank: int
    calls: tuple[Call, ...]  # the newest few, oldest first (and any still inside)
    groups: dict[str, GroupState] = field(default_factory=dict)
    count: int = 0  # calls entered since the ring started

    def inside(self) -> Call | None:
        """The newest call the rank is inside, if any."""
        for c in reversed(self.calls):
            if c.inside:
                return c
        return None

    def last_left(self) -> Call | None:
        for c in reversed(self.calls):
            if not c.inside:
                return c
        return None


def decode_summary(raw: bytes | str, rank: int, to_local: Callable[[float], float]) -> RankRing:
    """A rank's published summary (``CollectiveRing.summary``), its times mapped by ``to_local``
    onto the reader's clock."""
    d = json.loads(raw)
    calls = tuple(
        Call(
            op,
            group,
            int(seq),
            nbytes,
            to_local(entered),
            None if left is None else to_local(left),
            bool(pending),
        )
        for op, group, seq, nbytes, entered, left, pending in d.get("calls", [])
    )
    groups = {
        name: GroupState(unpack_ranks(ranks), int(entered), int(left))
        for name, (ranks, entered, left) in d.get("groups", {}).items()
    }
    return RankRing(rank, calls, groups, int(d.get("n", len(calls))))


@dataclass(frozen=True)
class Stuck:
    """A collective that ranks are waiting in."""

    op: str
    group: str
    seq: int
    ranks: tuple[int, ...]  # the group's members
    waiting: tuple[int, ...]
    missing: tuple[int, ...]  # never entered it
    mismatched: dict[int, str]  # rank -> the other operation it is in at this sequence number
    done: tuple[int, ...]  # left it already
    unknown: tuple[int, ...]  # published no ring
    waited_s: float  # since the first waiting rank entered it

    def name(self) -> str:
        return f"{self.op} #{self.seq} on {self.group}"


@dataclass(frozen=True)
class Attribution:
    kind: str
    culprits: tuple[int, ...]
    stuck: tuple[Stuck, ...]
    ranks: dict[int, dict[str, Any]]  # what the culprits (and ranks without a ring) last did
    summary: str
    stuck_total: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stuck"] = [
            {**asdict(s), "mismatched": {str(k): v for k, v in s.mismatched.items()}}
            for s in self.stuck
        ]
        d["ranks"] = {str(k): v for k, v in self.ranks.items()}
        return d


def attribute_hang(
    rings: dict[int, RankRing | None],
    world_size: int,
    now: float,
    stacks: dict[int, str] | None = None,
) -> Attribution:
    """Compare the ranks' rings.  ``rings``: every rank's (None: it published none);
    ``stacks``: Python stacks (innermost frame first, one per line) of the ranks the leader could
    get them from."""
    stacks = stacks or {}
    known = {r: ring for r, ring in rings.items() if ring is not None}
    no_ring = tuple(sorted(r for r in range(world_size) if rings.get(r) is None))
    if not known:
        return Attribution(
            "no_ring",
            (),
            (),
            {},
            "no rank published a collective ring (RESILIENT_COLLECTIVE_RING=0, or the process "
            "group was not made by resilient.launch.init_process_group): no attribution",
        )
    inside = {r: c for r, ring in known.items() if (c := ring.inside()) is not None}

    # every collective some rank is inside, by (group, sequence number)
    by_call: dict[tuple[str, int], list[tuple[int, Call]]] = {}
    for r, c in inside.items():
        by_call.setdefault((c.group, c.seq), []).append((r, c))
    stuck: list[Stuck] = []
    for (group, seq), members in by_call.items():
        ops: dict[str, list[int]] = {}
        for r, c in members:
            ops.setdefault(c.op, []).append(r)
        # the operation most ranks are in is the collective; the others called something else
        op = max(ops, key=lambda o: (len(ops[o]), -min(ops[o])))
        waiting = tuple(sorted(ops[op]))
        mismatched = {r: o for o, rs in ops.items() if o != op for r in rs}
        ranks = _group_ranks(group, [known[r] for r, _ in members])
        missing, done, unknown = [], [], []
        for m in ranks:
            if m in waiting or m in mismatched:
                continue
            ring = known.get(m)
            if ring is None:
                unknown.append(m)
                continue
            state = ring.groups.get(group)
            if state is not None and state.entered >= seq:
                done.append(m)
            else:
                missing.append(m)
        entered = min(c.entered_t for _, c in members)
        stuck.append(
            Stuck(
                op,
                group,
                seq,
                ranks,
                waiting,
                tuple(missing),
                mismatched,
                tuple(done),
                tuple(unknown),
                round(now - entered, 3),
            )
        )
    missing_all = {m for s in stuck for m in s.missing}
    culprits = tuple(sorted(m for m in missing_all if m not in inside))
    mismatch = [s for s in stuck if s.mismatched]
    # the collectives that name a culprit first, then the most waited-in ones
    stuck.sort(
        key=lambda s: (not set(s.missing) & set(culprits), -len(s.waiting), -s.waited_s, s.group)
    )
    described = {r: _describe(r, known.get(r), now, stacks.get(r)) for r in culprits}
    for r in no_ring:
        if r in rings or any(r in s.unknown for s in stuck):
            described[r] = {"ring": None}

    if culprits:
        kind = "missing_rank"
        lines = [_culprit_line(r, stuck, described[r], stacks.get(r)) for r in culprits]
        others = [s for s in stuck if not set(s.missing) & set(culprits) and s.missing]
        if others:
            lines.append(
                "meanwhile "
                + "; ".join(
                    f"{format_rank_list(s.waiting)} {_are(s.waiting)} in {s.name()}, waiting for "
                    f"{format_rank_list(s.missing)} (in "
                    + ", ".join(inside[m].name() for m in s.missing if m in inside)
                    + ")"
                    for s in others[:3]
                )
                + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            )
    elif mismatch:
        kind = "mismatch"
        lines = [
            f"{format_rank_list(s.waiting)} {_are(s.waiting)} in {s.name()} but "
            + ", ".join(f"rank {r} is in {o} #{s.seq}" for r, o in sorted(s.mismatched.items()))
            + " on the same group: the ranks called different collectives"
            for s in mismatch[:3]
        ]
    elif missing_all:
        kind = "circular"
        lines = [
            "every rank that has not entered a collective others wait in is itself waiting in "
            "another (the ranks called collectives in different orders): "
            + "; ".join(
                f"{format_rank_list(s.waiting)} in {s.name()} {_wait_for(s.missing)} "
                + ", ".join(f"{m} (in {inside[m].name()})" for m in s.missing)
                for s in stuck[:4]
            )
        ]
    elif stuck:
        kind = "inside_collective"
        lines = [
            f"{format_rank_list(s.waiting)} {'all ' if len(s.waiting) > 1 else ''}entered "
            f"{s.name()} {s.waited_s:.1f} s ago and every member is in it: the hang is inside "
            f"the collective (the transport or a device), not a rank that never came"
            for s in stuck[:3]
        ]
        if any(s.unknown for s in stuck):
            lines.append(
                f"{format_rank_list(sorted({m for s in stuck for m in s.unknown}))} published "
                f"no ring"
            )
    else:
        kind = "no_collective"
        last: dict[str, list[int]] = {}
        for r, ring in sorted(known.items()):
            c = ring.last_left()
            last.setdefault(c.name() if c else "no collective yet", []).append(r)
        lines = [
            "no rank is inside a collective: the hang is outside them (Python, data loading, "
            "device code); last collectives: "
            + "; ".join(f"{format_rank_list(rs)} {name}" for name, rs in list(last.items())[:4])
        ]
    if no_ring and kind != "inside_collective":
        lines.append(f"{format_rank_list(no_ring)} published no ring")
    return Attribution(
        kind,
        culprits,
        tuple(stuck[:MAX_STUCK]),
        described,
        "; ".join(lines),
        len(stuck),
    )


def _group_ranks(group: str, rings: list[RankRing]) -> tuple[int, ...]:
    for ring in rings:
        state = ring.groups.get(group)
        if state is not None and state.ranks:
            return state.ranks
    return tuple(sorted(r.rank for r in rings))


def _describe(r: int, ring: RankRing | None, now: float, stack: str | None) -> dict[str, Any]:
    if ring is None:
        return {"ring": None}
    last = ring.last_left()
    d: dict[str, Any] = {"calls": ring.count}
    if last is not None:
        d["last_left"] = {
            "op": last.op,
            "group": last.group,
            "seq": last.seq,
            "bytes": last.nbytes,
            "left_s_ago": round(now - (last.left_t or now), 3),
        }
    if stack:
        d["stack"] = stack
    return d


def _culprit_line(r: int, stuck: list[Stuck], d: dict[str, Any], stack: str | None) -> str:
    waits = [s for s in stuck if r in s.missing]
    parts = [f"{format_rank_list(s.waiting)} {_are(s.waiting)} in {s.name()}" for s in waits[:4]]
    if len(waits) > 4:
        parts.append(f"{len(waits) - 4} more collectives")
    it = {1: "it", 2: "either of them"}.get(len(waits), "any of them")
    line = "; ".join(parts) + f"; rank {r} never entered {it}: "
    last = d.get("last_left")
    if last is not None:
        line += (
            f"it last left {last['op']} #{last['seq']} on {last['group']} "
            f"{last['left_s_ago']:.1f} s ago and is in no collective"
        )
    else:
        line += "it has recorded no collective"
    if stack:
        frames = [f.strip() for f in stack.splitlines() if f.strip()]
        line += ", at " + " <- ".join(frames[:STACK_FRAMES_IN_SUMMARY])
    return line


def _are(ranks: tuple[int, ...] | list[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _wait_for(missing: tuple[int, ...]) -> str:
    return "waiting for rank" if len(missing) == 1 else "waiting for ranks"


def format_rank_list(ranks: tuple[int, ...] | list[int]) -> str:
    """``rank 2``, ``ranks 0, 1, 3``, ``ranks 0-1023, 1025``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + format_ranks(ranks)[1:-1]
