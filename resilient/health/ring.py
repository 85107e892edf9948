"""The collective ring: every rank's record of the collectives it entered and left.

``install()`` wraps ``torch.distributed``'s collective functions (``all_reduce``, ``all_gather``,
``all_to_all_single``, ``broadcast``, ``barrier``, ``send``/``recv``, ...) once per process;
``resilient.launch.init_process_group`` calls it before joining the group, unless
``RESILIENT_COLLECTIVE_RING=0``.  Each call writes one slot of a fixed ring (``size`` slots, 128 by
default): the operation, the process group, the call's sequence number on that group (this rank's
count of wrapped calls on it, which matches across the members as long as they call the same
collectives in the same order), the bytes this rank contributes, and the monotonic times it
entered and left (``None`` while inside).  The hot path is two clock reads, two dict lookups and
one small list; no lock (each call takes its index from an ``itertools.count``, atomic under the
GIL; a reader copies the ring, then a slot at a time).

A group has two names.  Its *key* identifies it: the process group's ``group_name``, which every
member of the group spells the same way and no other group shares (``"<group_name>:(a, b)"`` for
the pair of a point-to-point call); calls are matched across ranks by key.  Its *label* is for
people: ``tp [0, 1]`` for a device mesh's axis, ``world [0-3]``, the ``group_desc`` of a group made
with ``new_group`` (``group 5 [0, 2]`` when it has none), ``p2p [0, 1]`` for a pair.  Labels can
repeat (two meshes with a ``dp`` axis over the same ranks, a mesh rebuilt on the same ranks, two
groups with the same ``group_desc``), so they are never used to match.

Asynchronous calls (``async_op=True``) count as left when the call returns its ``Work``; the slot
keeps a weak reference to it, and the summary marks the call ``pending`` while that work reports
not completed, so a rank blocked in ``wait()`` shows as inside it.

Wrappers compose: a later wrapper (the chaos harness's ``slow`` fault wraps the same names) calls
this one and the other way round; parameters are found by the signatures of
``torch.distributed.distributed_c10d``'s functions, never of whatever is installed.  Calls made
through other paths (functional collectives, DTensor's redistributions, C++ such as DDP's
reducer, ``isend``/``irecv``, which torch tells apart by identity) are not seen, and under
``torch.compile`` the wrappers step aside (dynamo remaps torch's own functions only).

On NCCL a collective called with ``async_op=False`` returns as soon as it is queued on the
stream: ranks waiting for a missing peer have "left" it and block later (a ``.item()``, a
synchronize).  The comparison (attribution.py) therefore also compares each group's newest
sequence number across its members: a member behind the others never entered the newest call.

The monitor's heartbeat thread publishes ``summary()`` to the store with its liveness beat when it
changed; the leader reads every rank's when it declares HUNG (``resilient.health.attribution``).
The summary (version 2) is JSON::

    {"v": 2, "n": calls entered, "t": now,
     "calls": [[op, group key, seq, bytes, entered, left, pending], ...],
     "groups": {group key: [ranks, entered, left, label], ...},
     "more": groups left out}

``calls``: the last few calls and any call still inside; ``groups``: the newest sequence numbers
this rank entered and left on each group (``ranks`` as ``pack_ranks`` packs them).  A summary
carries the groups of its calls, then the most recently entered others, up to ``SUMMARY_GROUPS``
in all (more only when its calls span more); ``more`` counts the groups it left out, so a reader
knows that a group absent from it may still have been entered (attribution counts such a member
*unknown* for a collective on that group, never *missing*).  Keys and labels are at most ``MAX_NAME_CHARS`` characters.
"""

from __future__ import annotations

import hashlib
import heapq
import inspect
import itertools
import json
import os
import time
import weakref
from typing import Any

import torch

__all__ = [
    "CollectiveRing",
    "GroupInfo",
    "install",
    "installed",
    "uninstall",
    "ring_enabled",
    "COLLECTIVES",
    "ENV_RING",
    "SUMMARY_GROUPS",
    "SUMMARY_VERSION",
    "MAX_NAME_CHARS",
    "pack_ranks",
    "unpack_ranks",
    "format_ranks",
]

ENV_RING = "RESILIENT_COLLECTIVE_RING"
DEFAULT_SIZE = 128
SUMMARY_CALLS = 8  # the newest calls a summary carries (plus any still inside)
SUMMARY_GROUPS = 64  # the groups a summary carries (besides those of its calls, if more)
SUMMARY_VERSION = 2
MAX_NAME_CHARS = 200  # a group's key or label in a summary

# name -> (the parameter that holds what this rank sends, or None; the peer parameters of a
# point-to-point call, global then group rank)
COLLECTIVES: dict[str, tuple[str | None, tuple[str, str] | None]] = {
    "all_reduce": ("tensor", None),
    "all_reduce_coalesced": ("tensors", None),
    "all_gather": ("tensor", None),
    "all_gather_into_tensor": ("input_tensor", None),
    "all_gather_object": (None, None),
    "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None),
    "reduce_scatter": ("input_list", None),
    "reduce_scatter_tensor": ("input", None),
    "broadcast": ("tensor", None),
    "broadcast_object_list": (None, None),
    "reduce": ("tensor", None),
    "gather": ("tensor", None),
    "gather_object": (None, None),
    "scatter": ("tensor", None),
    "scatter_object_list": (None, None),
    "barrier": (None, None),
    "monitored_barrier": (None, None),
    "send": ("tensor", ("dst", "group_dst")),
    "recv": ("tensor", ("src", "group_src")),
}
# isend and irecv are not wrapped: torch tells them apart by identity (P2POp checks ``op in
# [isend, irecv]``, batch_isend_irecv ``op.op is isend``), so a wrapper would break P2POp,
# batch_isend_irecv and torch.distributed.pipelining.  The ring does not see them.
_ALWAYS_ASYNC: tuple[str, ...] = ()

# slot fields: [op, GroupInfo, seq, nbytes, entered, left, weakref to an async call's Work,
# the call's index since the reset]
_OP, _GROUP, _SEQ, _BYTES, _ENTERED, _LEFT, _WORK, _INDEX = range(8)


def ring_enabled() -> bool:
    """On unless ``RESILIENT_COLLECTIVE_RING`` is 0 (or false, no, off)."""
    return os.environ.get(ENV_RING, "1").strip().lower() not in ("0", "false", "no", "off", "")


class GroupInfo:
    """One process group as the ring knows it: ``key`` (the same on every member, unique to the
    group: what calls are matched by), ``label`` (for people; may repeat); ``entered``/``left``:
    the newest sequence numbers this rank entered and left on it; ``used``: the ring's call count
    when this rank last entered it (which groups a capped summary keeps)."""

    __slots__ = ("key", "label", "ranks", "entered", "left", "used")

    def __init__(self, key: str, label: str, ranks: tuple[int, ...]) -> None:
        self.key, self.label, self.ranks = key, label, ranks
        self.entered = 0
        self.left = 0
        self.used = -1


class CollectiveRing:
    """A fixed ring of this process's collective calls.  ``enter``/``leave`` are the hot path
    (the wrappers call them); ``summary`` is what the heartbeat thread publishes."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 1:
            raise ValueError(f"the collective ring needs at least 1 slot, got {size}")
        self.size = size
        self.reset()

    def reset(self) -> None:
        """Forget every call and group (a new process group: sequence numbers start again)."""
        self._slots: list[list[Any] | None] = [None] * self.size
        self._tickets = itertools.count()  # the next call's index (its slot: index % size)
        self._by_id: dict[Any, tuple[GroupInfo, Any]] = {}  # id(pg) or (id(pg), peer) -> group, ref
        self._by_key: dict[str, GroupInfo] = {}  # group key -> its group
        self._published: tuple[int, bool] | None = None
        self._pending_any = False

    # --- the hot path (the wrappers inline the same steps) ---------------------------------------
    def enter(self, op: str, group: GroupInfo, nbytes: int | None) -> list[Any]:
        group.entered += 1
        # threads call collectives at once (resilient's replication thread runs gloo calls while
        # the main thread trains): next() on an itertools.count is one C call, atomic under the
        # GIL, so each call gets its own slot; reading and then writing back a count lost slots
        # (a thread inside a call showed in none) and wound the count back
        group.used = i = next(self._tickets)
        slot = [op, group, group.entered, nbytes, time.monotonic(), None, None, i]
        self._slots[i % self.size] = slot
        return slot

    def leave(self, slot: list[Any], work: Any = None) -> None:
        slot[_LEFT] = time.monotonic()
        if work is not None:
            self.watch(slot, work)
        slot[_GROUP].left = slot[_SEQ]

    def watch(self, slot: list[Any], work: Any) -> None:
        """Keep a weak reference to an asynchronous call's work (pending until it completes)."""
        try:
            slot[_WORK] = weakref.ref(work)
        except TypeError:  # not a Work (an object of another backend's making)
            pass

    def group(self, pg: Any) -> GroupInfo:
        """The ring's name for process group ``pg`` (None: the default group)."""
        hit = self._by_id.get(id(pg))
        if hit is not None and (hit[1] is None or hit[1]() is pg):
            return hit[0]
        return self._new_group(pg, id(pg), None)

    def pair(self, pg: Any, peer: int) -> GroupInfo:
        """The ring's name for the pair (this rank, ``peer``; -1: any source) in ``pg``:
        point-to-point calls count on the pair, so a send and its matching receive get the same
        sequence number."""
        key = (id(pg), peer)
        hit = self._by_id.get(key)
        if hit is not None and (hit[1] is None or hit[1]() is pg):
            return hit[0]
        return self._new_group(pg, key, peer)

    def named(
        self, name: str, ranks: tuple[int, ...] | list[int], *, key: str | None = None
    ) -> GroupInfo:
        """A group labelled ``name`` with key ``key`` (default: ``name``), for tests and
        simulations: no process group behind it."""
        key = name if key is None else key
        g = self._by_key.get(key)
        if g is None:
            g = self._by_key[key] = GroupInfo(_bounded(key), name[:MAX_NAME_CHARS], tuple(ranks))
        return g

    def _new_group(self, pg: Any, key: Any, peer: int | None) -> GroupInfo:
        import torch.distributed as dist

        try:
            real = pg if pg is not None else dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(real))
            pg_name = real.group_name
            desc = getattr(real, "group_desc", "") or ""
            me = dist.get_rank()
        except Exception:  # no default group yet: the call itself will say so
            return GroupInfo("?", "group ?", ())
        if peer is not None:
            pair = (me,) if peer < 0 else (min(me, peer), max(me, peer))
            label = "p2p " + format_ranks(pair) + ("" if peer >= 0 else " from any")
            if desc != "default_pg":
                label += f" in group {pg_name}"
            unique, ranks = f"{pg_name}:{pair}", pair
        else:
            if desc == "default_pg":
                label = "world"
            elif desc.startswith("mesh_"):
                label = desc[len("mesh_") :]  # a device mesh's axis: tp, ep, dp, ...
            elif desc and desc != "undefined":
                label = desc
            else:
                label = f"group {pg_name}"
            label, unique = f"{label} {format_ranks(ranks)}", pg_name
        # one GroupInfo per group name: the default group reached as None and as WORLD counts
        # once, and a freed group whose id is reused by another is not mistaken for it
        g = self._by_key.get(unique)
        if g is None or g.ranks != ranks:
            g = self._by_key[unique] = GroupInfo(_bounded(unique), label[:MAX_NAME_CHARS], ranks)
        try:
            ref = None if pg is None else weakref.ref(pg)
        except TypeError:  # cannot be watched: look it up again next time
            return g
        self._by_id[key] = (g, ref)
        return g

    # --- what the heartbeat thread reads ---------------------------------------------------------
    @property
    def count(self) -> int:
        """Calls entered since the reset (the newest slot's index + 1: never goes back)."""
        newest = self._newest(list(self._slots))
        return 0 if newest is None else newest[_INDEX] + 1

    @staticmethod
    def _newest(slots: list[list[Any] | None]) -> list[Any] | None:
        return max((s for s in slots if s is not None), key=_index, default=None)

    def _ordered(self) -> list[list[Any]]:
        """The slots, oldest first (one copy of the ring: the writers do not wait for readers)."""
        slots = [s for s in list(self._slots) if s is not None]
        if not slots:
            return []
        slots.sort(key=_index)
        # a slot written late by a thread preempted between its ticket and its write holds an
        # index older than the ring's span: not one of the newest calls
        return [s for s in slots if s[_INDEX] > slots[-1][_INDEX] - self.size]

    def calls(self) -> list[list[Any]]:
        """Copies of the slots, oldest first."""
        return [list(s) for s in self._ordered()]

    def changed(self) -> bool:
        """Whether a summary would differ from the last one published (a pending asynchronous
        call counts as a change until it completes)."""
        return self._published != self._mark() or self._pending_any

    def _mark(self) -> tuple[int, bool]:
        # calls entered, and whether the newest is still inside: what a stuck rank changes when
        # it gets out (a call of another thread that returns out of order waits for the next)
        newest = self._newest(list(self._slots))
        if newest is None:
            return 0, False
        return newest[_INDEX] + 1, newest[_LEFT] is None

    def summary(self, last: int = SUMMARY_CALLS) -> str:
        """The JSON the heartbeat publishes (version 2, described in the module docstring): the
        newest ``last`` calls and any older one still inside; the groups of those calls, then the
        most recently entered others up to ``SUMMARY_GROUPS`` in all, and how many were left out.
        Times are this process's monotonic clock."""
        mark = self._mark()
        calls = self.calls()
        keep = calls[-last:]
        inside = [c for c in calls[:-last] if c[_LEFT] is None or _pending(c)]
        out, pending_any = [], False
        groups: dict[str, list[Any]] = {}
        for c in inside + keep:
            pending = c[_LEFT] is not None and _pending(c)
            pending_any |= pending
            g: GroupInfo = c[_GROUP]
            groups[g.key] = _group_entry(g)  # a newer call's wins (a key reused: see _new_group)
            out.append([c[_OP], g.key, c[_SEQ], c[_BYTES], c[_ENTERED], c[_LEFT], int(pending)])
        others = [g for g in list(self._by_key.values()) if g.entered and g.key not in groups]
        room = max(0, SUMMARY_GROUPS - len(groups))
        # past the cap, the most recently entered: the groups a hang can be in now
        kept = others if len(others) <= room else heapq.nlargest(room, others, key=_recency)
        for g in kept:
            groups[g.key] = _group_entry(g)
        self._published, self._pending_any = mark, pending_any
        return json.dumps(
            {
                "v": SUMMARY_VERSION,
                "n": mark[0],
                "t": time.monotonic(),
                "calls": out,
                "groups": groups,
                "more": len(others) - len(kept),
            },
            separators=(",", ":"),
        )


def _index(slot: list[Any]) -> int:
    return slot[_INDEX]


def _recency(g: GroupInfo) -> int:
    return g.used


def _group_entry(g: GroupInfo) -> list[Any]:
    return [pack_ranks(g.ranks), g.entered, g.left, g.label]


def _bounded(key: str) -> str:
    """A key a summary can carry: one longer than ``MAX_NAME_CHARS`` (a user's ``group_name``)
    becomes a digest of it, the same on every rank."""
    if len(key) <= MAX_NAME_CHARS:
        return key
    return key[:80] + "~" + hashlib.sha1(key.encode()).hexdigest()


def _pending(slot: list[Any]) -> bool:
    ref = slot[_WORK]
    if ref is None:
        return False
    work = ref()
    if work is None:  # dropped by its caller: waited for, or never to be
        return False
    try:
        return not work.is_completed()
    except Exception:
        return False


def _nbytes(x: Any) -> int | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(t.nbytes for t in x if isinstance(t, torch.Tensor))
    return None


def _wrap(ring: CollectiveRing, op: str, fn: Any, reference: Any) -> Any:
    """``fn`` (whatever ``torch.distributed.<op>`` is now), recording into ``ring``; parameters are
    located by ``reference``'s signature (torch's own function)."""
    params = list(inspect.signature(reference).parameters)
    size_name, peer_names = COLLECTIVES[op]
    size_i = params.index(size_name) if size_name in params else 1 << 30
    group_i = params.index("group") if "group" in params else 1 << 30
    async_i = params.index("async_op") if "async_op" in params else 1 << 30
    always_async = op in _ALWAYS_ASYNC
    if peer_names is not None:
        peer_name, group_peer_name = peer_names
        peer_i = params.index(peer_name)
        gpeer_i = params.index(group_peer_name) if group_peer_name in params else 1 << 30

        def where(args: tuple, kwargs: dict, group: Any) -> GroupInfo:
            n = len(args)
            peer = args[peer_i] if n > peer_i else kwargs.get(peer_name)
            if peer is None:
                gpeer = args[gpeer_i] if n > gpeer_i else kwargs.get(group_peer_name)
                if gpeer is not None:
                    import torch.distributed as dist

                    try:
                        peer = dist.get_global_rank(group or dist.group.WORLD, gpeer)
                    except Exception:
                        peer = None
            return ring.pair(group, -1 if peer is None else peer)
    else:
        where = None  # type: ignore[assignment]

    monotonic, tensor, take = time.monotonic, torch.Tensor, next
    size = ring.size
    compiling = torch.compiler.is_compiling

    # CollectiveRing.group + enter + leave, inlined: about 1 us a call instead of 2
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # torch.compile traces torch's own function (it remaps collectives)
            return fn(*args, **kwargs)
        n = len(args)
        group = args[group_i] if n > group_i else kwargs.get("group")
        if where is None:
            hit = ring._by_id.get(id(group))
            if hit is not None and (hit[1] is None or hit[1]() is group):
                g = hit[0]
            else:
                g = ring.group(group)
        else:
            g = where(args, kwargs, group)
        x = args[size_i] if n > size_i else kwargs.get(size_name)
        nbytes = x.nbytes if type(x) is tensor else _nbytes(x)
        seq = g.entered = g.entered + 1
        i = g.used = take(ring._tickets)  # its own index, atomic: see CollectiveRing.enter
        slot = [op, g, seq, nbytes, monotonic(), None, None, i]
        ring._slots[i % size] = slot
        result = None
        try:
            result = fn(*args, **kwargs)
            return result
        finally:
            slot[5] = monotonic()
            g.left = seq
            if result is not None and (
                always_async or (args[async_i] if n > async_i else kwargs.get("async_op"))
            ):
                ring.watch(slot, result)

    wrapper.__name__ = getattr(fn, "__name__", op)
    wrapper.__qualname__ = getattr(fn, "__qualname__", op)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper._resilient_ring = ring  # type: ignore[attr-defined]
    return wrapper


_RING: CollectiveRing | None = None
_ORIGINALS: dict[str, Any] = {}
_WRAPPERS: dict[str, Any] = {}


def install(size: int = DEFAULT_SIZE, *, force: bool = False) -> CollectiveRing | None:
    """Wrap ``torch.distributed``'s collectives once per process and return the ring; called
    again (a new process group: in-job recovery forms one per generation), the ring starts over.
    None when ``RESILIENT_COLLECTIVE_RING=0`` (unless ``force``)."""
    global _RING
    if not (force or ring_enabled()):
        return None
    if _RING is not None:
        _RING.reset()
        return _RING
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    ring = CollectiveRing(size)
    for op in COLLECTIVES:
        fn, reference = getattr(dist, op, None), getattr(c10d, op, None)
        if fn is None or reference is None:
            continue
        _ORIGINALS[op] = fn
        _WRAPPERS[op] = _wrap(ring, op, fn, reference)
        setattr(dist, op, _WRAPPERS[op])
    _RING = ring
    return ring


def installed() -> CollectiveRing | None:
    """This process's ring, if ``install`` ran."""
    return _RING


def uninstall() -> None:
    """Put torch's functions back where this module's wrappers are still the outermost (a wrapper
    installed on top of them keeps calling them; they keep recording into the old ring)."""
    global _RING
    import torch.distributed as dist

    for op, wrapper in _WRAPPERS.items():
        if getattr(dist, op, None) is wrapper:
            setattr(dist, op, _ORIGINALS[op])
    _WRAPPERS.clear()
    _ORIGINALS.clear()
    _RING = None


# --- rank lists: compact in the store, readable in the record ----------------------------------


def pack_ranks(ranks: tuple[int, ...] | list[int]) -> list[int] | dict[str, int]:
    """An arithmetic progression of 3 or more ranks as ``{"start", "stop", "step"}`` (a world of
    4,096 stays a few bytes in every heartbeat); else the list."""
    r = list(ranks)
    if len(r) >= 3:
        step = r[1] - r[0]
        if step > 0 and all(b - a == step for a, b in zip(r, r[1:])):
            return {"start": r[0], "stop": r[-1] + step, "step": step}
    return r


def unpack_ranks(
    packed: Any, world_size: int | None = None, *, at_most: int | None = None
) -> tuple[int, ...]:
    """The ranks ``pack_ranks`` packed; ranks of another process's summary are checked (ints,
    inside ``world_size`` when given, at most a million, and at most ``at_most`` of them when
    given, checked before a range is unpacked): anything else is a ValueError."""
    limit = world_size if world_size is not None else 1 << 20
    if isinstance(packed, dict):
        start, stop, step = packed.get("start"), packed.get("stop"), packed.get("step")
        if not all(type(x) is int for x in (start, stop, step)) or step <= 0 or start < 0:
            raise ValueError(f"not a packed rank range: {packed!r:.80}")
        out = range(start, min(stop, limit), step)
        if stop > limit:
            raise ValueError(f"rank range {packed!r:.80} reaches past the world ({limit} ranks)")
        if at_most is not None and len(out) > at_most:
            raise ValueError(
                f"rank range {packed!r:.80} holds {len(out)} ranks, more than the {at_most} "
                f"left to it"
            )
        return tuple(out)
    if not isinstance(packed, list) or len(packed) > limit:
        raise ValueError(f"not a list of ranks: {packed!r:.80}")
    if not all(type(x) is int and 0 <= x < limit for x in packed):
        raise ValueError(f"ranks outside the world ({limit} ranks): {packed!r:.80}")
    return tuple(packed)


def format_ranks(ranks: tuple[int, ...] | list[int]) -> str:
    """``[0, 1]``, ``[0-3]``, ``[0, 2, 4, 6]``, ``[0-7, 9-15]``: runs of 3 or more collapse."""
    r = sorted(ranks)
    parts, i = [], 0
    while i < len(r):
        j = i
        while j + 1 < len(r) and r[j + 1] == r[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{r[i]}-{r[j]}")
        else:
            parts += [str(x) for x in r[i : j + 1]]
        i = j + 1
    return "[" + ", ".join(parts) + "]"
