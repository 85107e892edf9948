"""Collectives through the checkpoint URL, for processes that share no process group: the
persisters of a job on several nodes sealing its newest snapshot together once the whole job is
gone (joint_flush.seal_together; seal_nodes.py runs the same seal on a load over the replicas'
process group).

One *session* is a folder ``FLUSH.seal/<id>/`` at the URL's root.  Its members are the job's
nodes, ``0`` to ``nodes - 1``; node 0 (rank 0's, whose persister flushes) is the root.  Each
collective is one *round* ``k``, numbered alike on every member (they run the same seal on the
same data, so they call the same collectives in the same order):

* a member posts ``<k>.<node>.json`` (one atomic publish);
* the root reads the posts of the members it waits for, for as long as ``wait_s`` (a few seconds
  once a successor persister waits on its node: the job runs again, and its load seals), and
  takes a member that did not post in time as one that holds nothing (it is no longer waited
  for in later rounds; a post that is there when the root looks still counts, and the member is
  waited for again from then on);
* where every member needs the outcome (an all-gather, a broadcast), the root publishes
  ``<k>.all.json``, and the members read it.

Everything read is untrusted (someone else's bucket): each read has a size cap, JSON that does
not parse or has the wrong shape counts as nothing posted, and a member that waits longer than
``wait_s`` three times over for the root (a few seconds once hurried) raises ``GroupBroken``
(the seal gives up; nothing is committed that the members did not each verify).  The round
that decides whether to commit is *patient*: the root waits half a minute at most for the
posts, and a member for the outcome half a minute longer, hurried or not, so that a member
does not leave once its word may count (seal_nodes._try).  The root removes the session's folder once
every member said it is done with it, or once its time is out (``close``), and any other
session's folder when it opens one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from resilient.checkpoint.storage import Storage
from resilient.errors import ResilientError

log = logging.getLogger(__name__)

__all__ = ["SEAL_DIR", "GroupBroken", "UrlGroup"]

SEAL_DIR = "FLUSH.seal"
_POLL_S = 0.2
_MAX_ROW = 1 << 16  # the ints of one all-gathered row
_MAX_ALL = 64 << 20  # the bytes of one round's published outcome
_SHORT_WAIT_S = 5.0  # (the root, once ``hurry`` says so) for a member's post
# a patient round (the word on whether to commit): the root waits this long at most for the
# members' posts (each is a moment's work after the round before), and a member this much longer
# for the outcome, hurried or not: under the seal lock a restarted load waits 120 s for
_WORD_WAIT_S = 30.0
_WORD_MARGIN_S = 30.0


class GroupBroken(ResilientError):
    """The session's root did not publish a round's outcome in time (gone, or its node lost)."""


class UrlGroup:
    """One member of a session (module docstring); ``rank`` is its node, ``size`` the nodes."""

    def __init__(
        self,
        storage: Storage,
        session: str,
        rank: int,
        size: int,
        wait_s: float,
        hurry: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"node {rank} is not one of the session's {size}")
        self.storage, self.dir = storage, f"{SEAL_DIR}/{session}"
        self.rank, self._size, self.wait_s = rank, size, wait_s
        self._hurry = hurry or (lambda: False)
        self._round = 0
        self._awaited = set(range(1, size))  # (the root) the members it still waits for
        try:  # (a local path's folder: an object store needs none)
            storage.makedirs(self.dir)
        except Exception as e:  # (its posts fail, and the seal with them)
            log.warning("could not make %s: %s", storage.display(self.dir), e)

    def size(self) -> int:
        return self._size

    def all_gather_json(self, data: bytes, cap: int, *, patient: bool = False) -> list[Any]:
        """Every member's ``data`` parsed (None: nothing posted in time, more than ``cap``
        bytes, or not JSON), the same list on every member.  ``patient`` (the word on whether to
        commit): the root waits for the posts ``_WORD_WAIT_S`` at most, and a member for the
        outcome ``_WORD_MARGIN_S`` longer, hurried or not (its post may already count)."""
        posts = self._gather(data, cap, word=patient)
        if self.rank == 0:
            assert posts is not None
            every = [_parse(p) for p in posts]
            out = json.dumps(every).encode()
            if len(out) > _MAX_ALL:
                log.warning("the seal's round %d is too large to publish", self._round - 1)
                every = [every[0], *([None] * (self._size - 1))]
                out = json.dumps(every).encode()
            self._publish_all(out)
            return every
        got = _parse(self._read_all(_MAX_ALL, patient=patient))
        if not isinstance(got, list) or len(got) != self._size:
            raise GroupBroken(f"{self.storage.display(self.dir)}: the root's outcome is damaged")
        return got

    def all_gather_ints(self, row: list[int], *, patient: bool = False) -> list[list[int]]:
        """Every member's ``row`` (one length: a member that posted none, or another shape,
        counts as a row of zeros)."""
        every = self.all_gather_json(json.dumps(row).encode(), 16 + 24 * len(row), patient=patient)
        zeros = [0] * len(row)
        return [r if _ints(r, len(row)) else list(zeros) for r in every]

    def gather_to_root(self, data: bytes, cap: int, expect: set[int]) -> list[Any] | None:
        """(the root) The members' ``data`` parsed, waiting only for those in ``expect``; on the
        others, None once posted."""
        posts = self._gather(data, cap, expect)
        return None if posts is None else [_parse(p) for p in posts]

    def broadcast(self, data: bytes, cap: int) -> bytes:
        """The root's ``data`` on every member (b"": nothing)."""
        k = self._round
        self._round += 1
        if self.rank == 0:
            self._publish_all(data)
            return data
        return self._read_all(cap, k)

    def close(self) -> None:
        """The session is over for this member: a member says so (``end.<node>.json``, whatever
        its seal came to); the root waits for the members it still waits for to say so (they may
        still be reading its last outcome), then removes the session's folder."""
        if self.rank != 0:
            try:
                self.storage.publish(f"{self.dir}/end.{self.rank}.json", b"{}")
            except Exception as e:  # (the root waits out its time)
                log.info("could not end the seal at %s: %s", self.storage.display(self.dir), e)
            return
        waiting = set(self._awaited)
        start = time.monotonic()
        while waiting:
            waiting = {m for m in waiting if self._read(f"{self.dir}/end.{m}.json", 16) is None}
            limit = _SHORT_WAIT_S if self._hurry() else self.wait_s
            if waiting and time.monotonic() - start > limit:
                break
            if waiting:
                time.sleep(_POLL_S)
        try:
            self.storage.remove_tree(self.dir)
        except Exception as e:  # (the next session's root removes it)
            log.info("could not remove %s: %s", self.storage.display(self.dir), e)

    def _name(self, k: int, who: str) -> str:
        return f"{self.dir}/{k}.{who}.json"

    def _gather(
        self, data: bytes, cap: int, expect: set[int] | None = None, word: bool = False
    ) -> list[bytes | None] | None:
        k = self._round
        self._round += 1
        if self.rank != 0:
            self.storage.publish(self._name(k, str(self.rank)), data)
            return None
        got: dict[int, bytes] = {0: data}
        waiting = set(range(1, self._size)) if expect is None else expect - {0}
        patient = waiting & self._awaited
        start = time.monotonic()
        while True:
            for m in sorted(waiting):
                post = self._read(self._name(k, str(m)), cap)
                if post is not None:
                    got[m] = post
                    waiting.discard(m)
                    patient.discard(m)
                    self._awaited.add(m)  # (heard from again: waited for from now on)
            limit = _SHORT_WAIT_S if self._hurry() else self.wait_s
            if word:
                limit = min(limit, _WORD_WAIT_S)
            if not patient or time.monotonic() - start > limit:
                break
            time.sleep(_POLL_S)
        if patient:
            log.warning(
                "the seal through %s: no word from node(s) %s in round %d; taken as holding "
                "nothing",
                self.storage.display(self.dir),
                sorted(patient),
                k,
            )
            self._awaited -= patient
        return [got.get(m) for m in range(self._size)]

    def _publish_all(self, data: bytes) -> None:
        self.storage.publish(self._name(self._round - 1, "all"), data)

    def _read_all(self, cap: int, k: int | None = None, patient: bool = False) -> bytes:
        """(a member) The root's outcome of round ``k``: waited for ``wait_s`` three times over,
        or, once hurried (a successor waits on this node), a few seconds; ``patient`` (the root's
        word on whether to commit: a member that left after its post counted would leave a step
        committed on the others and not here), for as long as the root waits for the words and
        half a minute more, hurried or not."""
        k = self._round - 1 if k is None else k
        name = self._name(k, "all")
        start = time.monotonic()
        while True:
            got = self._read(name, cap)
            if got is not None:
                return got
            took = time.monotonic() - start
            hurried = not patient and took > _SHORT_WAIT_S and self._hurry()
            limit = min(self.wait_s, _WORD_WAIT_S) + _WORD_MARGIN_S if patient else 3 * self.wait_s
            if took > limit or hurried:
                raise GroupBroken(
                    f"{self.storage.display(name)} did not come within {took:.0f}s "
                    f"(node 0's persister, which publishes it, is gone or stuck)"
                )
            time.sleep(_POLL_S)

    def _read(self, rel: str, cap: int) -> bytes | None:
        try:
            return self.storage.read_small(rel, cap)
        except Exception:  # (not there yet, or too large: as nothing posted)
            return None


def _parse(data: bytes | None) -> Any:
    if not data:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _ints(row: Any, n: int) -> bool:
    return (
        isinstance(row, list)
        and len(row) == n <= _MAX_ROW
        and all(type(v) is int and 0 <= v < 1 << 63 for v in row)
    )
