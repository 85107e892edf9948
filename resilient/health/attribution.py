"""Hang attribution: which collective a hung job is stuck in, and which ranks never entered it.

Pure logic over the rings the ranks published (``resilient.health.ring``): no store, no clocks of
its own; times are already on the leader's monotonic clock.  The leader calls
``attribute_hang`` when it declares HUNG and writes the result to the event log
(``hang_attribution``) next to the verdict.

Calls are matched across ranks by their group's *key* (the process group's name: the same on
every member, unique to the group) and sequence number; the group's *label* (``tp [0, 1]``, which
two groups may share) is what the messages show.

For every collective some rank is inside (a group and a sequence number), the members of the
group are sorted into: *waiting* (inside it), *mismatched* (inside the same sequence number of the
group with another operation: the ranks called different collectives), *done* (they already
left it), *missing* (they never entered it: their newest sequence number on the group is lower,
or their summary does not have the group and left none out) and *unknown* (they published no
ring, or their summary does not have the group but left some out: a rank that used more groups
than a summary carries, ``resilient.health.ring.SUMMARY_GROUPS``, sends the most recently entered
ones, so an absent group says nothing about it).  A missing rank that is inside no collective
itself is a *culprit*: the job waits for it while it runs (or hangs) outside any collective, and
its Python stack says where.  The outcomes:

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
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient.health.ring import (
    MAX_NAME_CHARS,
    SUMMARY_CALLS,
    SUMMARY_GROUPS,
    SUMMARY_VERSION,
    format_ranks,
    unpack_ranks,
)

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
    group: str  # the group's key
    seq: int
    nbytes: int | None
    entered_t: float
    left_t: float | None  # None: still inside
    pending: bool = False  # asynchronous: issued, its work not completed
    label: str = ""  # the group's label ("": the key is the label)

    @property
    def inside(self) -> bool:
        return self.left_t is None or self.pending

    def name(self) -> str:
        return f"{self.op} #{self.seq} on {self.label or self.group}"


@dataclass(frozen=True)
class GroupState:
    ranks: tuple[int, ...]
    entered: int  # the newest sequence number the rank entered on this group
    left: int
    label: str = ""  # ("": the key is the label)


@dataclass(frozen=True)
class RankRing:
    rank: int
    calls: tuple[Call, ...]  # the newest few, oldest first (and any still inside)
    groups: dict[str, GroupState] = field(default_factory=dict)  # by key
    count: int = 0  # calls entered since the ring started
    # groups its summary left out (it carries SUMMARY_GROUPS): a group absent from ``groups``
    # is one the rank never entered only when this is 0
    more: int = 0

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


MAX_SUMMARY_BYTES = 1 << 20  # a summary is a few KB; anything larger is not one


def decode_summary(
    raw: bytes | str,
    rank: int,
    to_local: Callable[[float], float],
    world_size: int | None = None,
) -> RankRing:
    """A rank's published summary (``CollectiveRing.summary``, version 2), its times mapped by
    ``to_local`` onto the reader's clock.  Another process wrote it: anything that is not a
    summary (another version, its size, its shape, its types, keys or labels longer than
    ``MAX_NAME_CHARS``, ranks outside the world, a call on a group it does not describe) is a
    ValueError."""
    if len(raw) > MAX_SUMMARY_BYTES:
        raise ValueError(f"rank {rank}'s ring summary is {len(raw)} bytes, not a summary")
    try:
        d = json.loads(raw)
    except RecursionError:
        raise ValueError(f"rank {rank}'s ring summary nests too deeply") from None
    if not isinstance(d, dict):
        raise ValueError(f"rank {rank}'s ring summary is not an object")
    version = d.get("v")
    if type(version) is not int or version != SUMMARY_VERSION:
        raise ValueError(
            f"rank {rank}'s ring summary is version {version!r:.20}, this reader reads version "
            f"{SUMMARY_VERSION}: every rank must run the same resilient"
        )
    raw_calls, raw_groups = d.get("calls", []), d.get("groups", {})
    if not isinstance(raw_calls, list) or not isinstance(raw_groups, dict):
        raise ValueError(f"rank {rank}'s ring summary has no calls list / groups object")
    if len(raw_calls) > 4096 or len(raw_groups) > 4096:
        raise ValueError(f"rank {rank}'s ring summary is too large")
    more, count = d.get("more", 0), d.get("n", len(raw_calls))
    if not _is_count(more) or not _is_count(count):
        raise ValueError(
            f"rank {rank}'s ring summary has a malformed count (n {count!r:.40}, more "
            f"{more!r:.40}): expected integers >= 0"
        )
    groups = {}
    # a summary's groups are at most SUMMARY_GROUPS and the groups of its calls, each at most the
    # world: 4096 ranges of the world (250 KB of JSON) unpacked to 16 million ranks
    members_left = (SUMMARY_GROUPS + SUMMARY_CALLS) * (
        world_size if world_size is not None else 1 << 20
    )
    for key, value in raw_groups.items():
        if len(key) > MAX_NAME_CHARS:
            raise ValueError(
                f"rank {rank}'s ring summary has a group key of {len(key)} characters "
                f"(at most {MAX_NAME_CHARS}): {key!r:.80}"
            )
        if not isinstance(value, list) or len(value) != 4:
            raise ValueError(
                f"rank {rank}'s ring summary has a malformed group {key!r:.80}: expected "
                f"[ranks, entered, left, label], got {value!r:.80}"
            )
        ranks, entered, left, label = value
        if not isinstance(label, str) or len(label) > MAX_NAME_CHARS:
            raise ValueError(
                f"rank {rank}'s ring summary has a malformed label for group {key!r:.80}: "
                f"expected a string of at most {MAX_NAME_CHARS} characters, got {label!r:.80}"
            )
        if not _is_count(entered) or not _is_count(left):
            raise ValueError(
                f"rank {rank}'s ring summary has malformed sequence numbers for group "
                f"{key!r:.80}: {value!r:.80}"
            )
        try:
            members = unpack_ranks(ranks, world_size, at_most=members_left)
            if len(members) > members_left:
                raise ValueError(f"{len(members)} ranks, more than the {members_left} left to it")
        except ValueError as e:
            raise ValueError(
                f"rank {rank}'s ring summary, group {key!r:.80}: {e} (a summary lists at most "
                f"{SUMMARY_GROUPS + SUMMARY_CALLS} groups' worth of the world's ranks)"
            ) from None
        members_left -= len(members)
        groups[key] = GroupState(members, entered, left, label)
    calls = []
    for item in raw_calls:
        if not isinstance(item, list) or len(item) != 7:
            raise ValueError(f"rank {rank}'s ring summary has a malformed call {item!r:.80}")
        op, group, seq, nbytes, entered, left, pending = item
        if (
            not isinstance(op, str)
            or not isinstance(group, str)
            or not _is_count(seq)
            or not _is_time(entered)
            or not (left is None or _is_time(left))
        ):
            raise ValueError(f"rank {rank}'s ring summary has a malformed call {item!r:.80}")
        if nbytes is not None and not _is_count(nbytes):
            raise ValueError(f"rank {rank}'s ring summary has a malformed size {nbytes!r:.40}")
        state = groups.get(group)
        if state is None:
            raise ValueError(
                f"rank {rank}'s ring summary has a call on group {group!r:.80} that its groups "
                f"do not describe (a summary carries the group of every call it carries)"
            )
        calls.append(
            Call(
                op,
                group,
                seq,
                nbytes,
                to_local(float(entered)),
                None if left is None else to_local(float(left)),
                bool(pending),
                state.label,
            )
        )
    return RankRing(rank, tuple(calls), groups, count, more)


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_time(x: Any) -> bool:
    if type(x) is int:
        return abs(x) < 1 << 53  # (a float's range: math.isfinite(10**400) raises)
    return type(x) is float and math.isfinite(x)


@dataclass(frozen=True)
class Stuck:
    """A collective that ranks are waiting in."""

    op: str
    group: str  # the group's key
    label: str  # the group's label (what people read)
    seq: int
    ranks: tuple[int, ...]  # the group's members
    waiting: tuple[int, ...]
    missing: tuple[int, ...]  # never entered it
    mismatched: dict[int, str]  # rank -> the other operation it is in at this sequence number
    done: tuple[int, ...]  # left it already
    unknown: tuple[int, ...]  # published no ring, or a summary that left this group out
    waited_s: float  # since the first waiting rank entered it

    def name(self) -> str:
        return f"{self.op} #{self.seq} on {self.label}"


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
            state = None if ring is None else ring.groups.get(group)
            if state is not None:
                (done if state.entered >= seq else missing).append(m)
            elif ring is None or ring.more:  # no ring, or its summary left the group out
                unknown.append(m)
            else:
                missing.append(m)
        entered = min(c.entered_t for _, c in members)
        stuck.append(
            Stuck(
                op,
                group,
                next((c.label for _, c in members if c.label), "")
                or _group_label(group, [known[r] for r, _ in members]),
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
    # ranks whose summary left out the group of a collective others wait in
    capped = sorted({m for s in stuck for m in s.unknown if m in known})

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
            f"{s.name()} {s.waited_s:.1f} s ago and "
            + (
                f"no member is known to have missed it ({format_rank_list(s.unknown)} "
                f"{_are(s.unknown)} unknown): the hang is inside the collective (the transport "
                f"or a device) or with {'it' if len(s.unknown) == 1 else 'them'}"
                if s.unknown
                else "every member is in it: the hang is inside the collective (the transport "
                "or a device), not a rank that never came"
            )
            for s in stuck[:3]
        ]
        if no_ring_here := sorted({m for s in stuck for m in s.unknown if m not in known}):
            lines.append(f"{format_rank_list(no_ring_here)} published no ring")
    elif behind := _behind(known, inside):
        # nobody is inside a collective, yet some members of a group never entered its newest
        # call: on NCCL a collective returns once it is queued, so the ranks waiting for a
        # missing peer block later (a synchronize, an .item()), outside the collective
        kind = "behind"
        culprits = tuple(sorted({r for b in behind for r in b[4] if r not in inside}))
        described = {r: _describe(r, known.get(r), now, stacks.get(r)) for r in culprits}
        lines = [
            f"no rank is inside a collective, but {format_rank_list(ahead)} entered "
            f"{op} #{seq} on {label} and {format_rank_list(late)} never did"
            + "".join(
                f"; rank {r} last left "
                + (
                    f"{d['last_left']['op']} #{d['last_left']['seq']} on {d['last_left']['group']}"
                    if "last_left" in d
                    else "no collective"
                )
                + (f", at {_frames(stacks[r])}" if stacks.get(r) else "")
                for r in late
                if (d := described.get(r)) is not None
            )
            + " (on NCCL a collective returns before it completes: the others wait beyond it)"
            for _, label, op, seq, late, ahead in behind[:3]
        ]
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
    if capped:
        on = [s.name() for s in stuck if set(s.unknown) & set(capped)]
        lines.append(
            f"whether {format_rank_list(capped)} entered "
            + ", ".join(on[:3])
            + (f" and {len(on) - 3} more" if len(on) > 3 else "")
            + f" is unknown: {'its' if len(capped) == 1 else 'their'} ring summary left the "
            f"group out (a summary carries the {SUMMARY_GROUPS} groups used most recently)"
        )
    return Attribution(
        kind,
        culprits,
        tuple(stuck[:MAX_STUCK]),
        described,
        "; ".join(lines),
        len(stuck),
    )


def _behind(
    known: dict[int, RankRing], inside: dict[int, Call]
) -> list[tuple[str, str, str, int, tuple[int, ...], tuple[int, ...]]]:
    """Groups some of whose members never entered the group's newest call: (group key, its
    label, its op, its sequence number, the members behind, the members that entered it).  A
    member whose summary left the group out is neither."""
    out = []
    keys = {key for ring in known.values() for key in ring.groups}
    for key in sorted(keys):
        members = _group_ranks(key, list(known.values()))
        seqs = {}
        for m in members:
            ring = known.get(m)
            if ring is None:
                continue
            state = ring.groups.get(key)
            if state is not None:
                seqs[m] = state.entered
            elif not ring.more:  # else its summary left the group out: not known to be behind
                seqs[m] = 0
        if not seqs:
            continue
        top = max(seqs.values())
        late = tuple(sorted(m for m, q in seqs.items() if q < top))
        if not late or top == 0:
            continue
        ahead = tuple(sorted(m for m, q in seqs.items() if q == top))
        op = next(
            (c.op for m in ahead for c in known[m].calls if c.group == key and c.seq == top),
            "call",
        )
        out.append((key, _group_label(key, list(known.values())), op, top, late, ahead))
    # the groups whose late members are inside nothing (the ones to name) first
    out.sort(key=lambda b: (all(r in inside for r in b[4]), -len(b[5]), b[1], b[0]))
    return out


def _frames(stack: str, n: int = 3) -> str:
    return " <- ".join(line.strip() for line in stack.splitlines()[:n])


def _group_ranks(group: str, rings: list[RankRing]) -> tuple[int, ...]:
    for ring in rings:
        state = ring.groups.get(group)
        if state is not None and state.ranks:
            return state.ranks
    return tuple(sorted(r.rank for r in rings))


def _group_label(group: str, rings: list[RankRing]) -> str:
    """The label the rings give group key ``group`` (the key when none does)."""
    for ring in rings:
        state = ring.groups.get(group)
        if state is not None and state.label:
            return state.label
    return group


def _describe(r: int, ring: RankRing | None, now: float, stack: str | None) -> dict[str, Any]:
    if ring is None:
        return {"ring": None}
    last = ring.last_left()
    d: dict[str, Any] = {"calls": ring.count}
    if last is not None:
        d["last_left"] = {
            "op": last.op,
            "group": last.label or last.group,  # the label, for people
            "group_key": last.group,
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
