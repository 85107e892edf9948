"""Peers' heartbeat times on this process's own monotonic clock, whatever their wall clocks say.

A rank's wall clock may be seconds or minutes off the leader's (no NTP, a bad host), and may jump
(NTP steps it).  Comparing a sender's ``time.time()`` with the leader's turns 30 s of skew into a
false DEAD verdict.  So no verdict uses a sender's wall clock: every heartbeat carries the sender's
*monotonic* time ``m``, and the observer notes its own monotonic time ``o`` when it sees a new
value.  ``o - m`` is the offset between the two monotonic clocks plus the delay from write to read,
so its minimum over observations bounds the offset from above; a peer time mapped with it,
``m + min(o - m)``, is never later than when the observer really saw the value.  The age of a
heartbeat computed from it is therefore never longer than the truth (skew and clock steps cannot
cause a verdict) and never shorter than "time since the observer saw it change".

Processes under one kernel (same boot id) share CLOCK_MONOTONIC exactly: for them the offset is 0
from the first look, so a peer that froze before the observer first saw it is judged by its true
age, as fast as before.

The sender's wall clock is only used to *report* skew (``skew_s``), from the freshest observation.
"""

from __future__ import annotations

import functools

__all__ = ["PeerClock", "boot_id"]


class PeerClock:
    """One peer's monotonic clock as this process sees it."""

    def __init__(self, *, same_kernel: bool = False) -> None:
        # min(o - m): peer monotonic -> observer monotonic (exactly 0 under one kernel)
        self.offset_s: float | None = 0.0 if same_kernel else None
        self.same_kernel = same_kernel
        self.skew_s: float | None = None  # peer wall clock minus observer wall clock (estimate)
        self.last_raw: bytes | None = None
        self.changes = 0
        self._best = float("inf")

    def observe(
        self,
        raw: bytes,
        peer_mono: float,
        peer_wall: float | bytes,
        now_mono: float,
        now_wall: float,
    ) -> bool:
        """Note a heartbeat value read at ``now_mono``; returns whether it changed since the last
        look (an unchanged value says nothing new about the clocks).  ``peer_wall``: the sender's
        wall time, or its text (parsed only when it is needed: rarely)."""
        if raw == self.last_raw:
            return False
        self.last_raw = raw
        self.changes += 1
        bound = now_mono - peer_mono
        if self.same_kernel:
            bound = max(bound, 0.0)  # how stale this value is: the skew is wall minus that
            if self.skew_s is None or bound <= self._best:
                self._best = bound
                self.skew_s = _wall(peer_wall) - (now_wall - bound)
            return True
        if self.offset_s is None or bound <= self.offset_s:
            self.offset_s = bound
            # the tightest observation is the freshest one: its wall clock difference is the skew
            self.skew_s = _wall(peer_wall) - now_wall
        return True

    def note(self, peer_mono: float, now_mono: float) -> None:
        """Another value from the same peer process (its progress key): one more bound."""
        bound = now_mono - peer_mono
        if not self.same_kernel and (self.offset_s is None or bound < self.offset_s):
            self.offset_s = bound

    def local(self, peer_mono: float) -> float:
        """``peer_mono`` on the observer's monotonic clock (never later than when it was seen)."""
        if self.offset_s is None:
            raise ValueError("no observation of this peer yet")
        return peer_mono + self.offset_s


@functools.cache
def boot_id() -> str:
    """This kernel's boot id (Linux), shortened: equal ids mean one CLOCK_MONOTONIC; "" elsewhere
    (then no two processes are assumed to share a clock)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:16]
    except OSError:
        return ""


def _wall(x: float | bytes) -> float:
    return x if isinstance(x, float) else float(x)
