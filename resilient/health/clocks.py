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

Monotonic clocks drift apart, though: a crystal runs 10-100 ppm off, and NTP's slew (chrony's, up
to 83,333 ppm while it pulls a wall clock back) slows or speeds CLOCK_MONOTONIC too.  A minimum
over all time then holds an offset the clocks have since left behind, and a peer whose clock runs
slow is judged older than it is, more every hour: a false DEAD.  So the minimum is taken over the
observations of the last ``window_s`` only (the error from drift is at most the drift over that
window: 6 ms at 100 ppm over 60 s), and a newly seen value is mapped no earlier than the
observer's previous read of the peer, which still saw the value before it: the value was written
after that read, so under any drift an age is longer than the truth by at most the time between
two reads (one scan interval), and it is never shorter than "time since the observer saw it".

Processes under one kernel (same boot id) share CLOCK_MONOTONIC exactly: for them the offset is 0
from the first look, so a peer that froze before the observer first saw it is judged by its true
age, as fast as before.

The sender's wall clock is only used to *report* skew (``skew_s``), from the freshest observation.
"""

from __future__ import annotations

import functools
import math
from collections import deque

__all__ = ["PeerClock", "boot_id", "OFFSET_WINDOW_S"]

# how far back the offset's minimum looks (observer seconds): long enough to hold reads that
# crossed the store quickly, short enough that drift over it is negligible
OFFSET_WINDOW_S = 60.0


class PeerClock:
    """One peer's monotonic clock as this process sees it."""

    def __init__(self, *, same_kernel: bool = False, window_s: float = OFFSET_WINDOW_S) -> None:
        # min(o - m) over the window: peer monotonic -> observer monotonic (exactly 0 under one
        # kernel)
        self.offset_s: float | None = 0.0 if same_kernel else None
        self.same_kernel = same_kernel
        self.window_s = window_s
        self.skew_s: float | None = None  # peer wall clock minus observer wall clock (estimate)
        self.last_raw: bytes | None = None
        self.changes = 0
        self._best = float("inf")
        # (o, o - m), increasing in both: the candidates for the window's minimum, oldest first
        self._bounds: deque[tuple[float, float]] = deque()
        self._read_o: float | None = None  # when the observer last read the peer's value
        # (m, o): the newest value seen and the observer's read before it (the value was
        # written after it): a peer time from m on maps to no earlier than o
        self._floor: tuple[float, float] | None = None

    def observe(
        self,
        raw: bytes,
        peer_mono: float,
        peer_wall: float | bytes,
        now_mono: float,
        now_wall: float,
    ) -> bool:
        """Note a heartbeat value read at ``now_mono`` (the time *after* the read: the value was
        there by then); returns whether it changed since the last look (an unchanged value says
        nothing new about the clocks, except that it was not replaced before ``now_mono``).
        ``peer_wall``: the sender's wall time, or its text (parsed only when it is needed:
        rarely)."""
        before, self._read_o = self._read_o, now_mono
        if raw == self.last_raw:
            return False
        self.last_raw = raw
        self.changes += 1
        bound = now_mono - peer_mono
        if self.same_kernel:
            bound = max(bound, 0.0)  # how stale this value is: the skew is wall minus that
            peer = _wall(peer_wall)
            if peer is not None and (self.skew_s is None or bound <= self._best):
                self._best = bound
                self.skew_s = peer - (now_wall - bound)
            return True
        if before is not None and before <= now_mono:
            self._floor = (peer_mono, before)
        if self._add(now_mono, bound):
            # the tightest observation is the freshest one: its wall clock difference is the skew
            peer = _wall(peer_wall)
            if peer is not None:
                self.skew_s = peer - now_wall
        return True

    def unchanged(self, now_mono: float) -> None:
        """The observer read the peer's value again at ``now_mono`` and found the one it last
        observed (what ``observe`` of that value would note, for a caller that skips it)."""
        self._read_o = now_mono

    def note(self, peer_mono: float, now_mono: float) -> None:
        """Another value from the same peer process (its progress key): one more bound."""
        if not self.same_kernel:
            self._add(now_mono, now_mono - peer_mono)

    def local(self, peer_mono: float) -> float:
        """``peer_mono`` on the observer's monotonic clock (never later than when it was seen;
        a value from the newest one seen on, never earlier than the read before it)."""
        if self.offset_s is None:
            raise ValueError("no observation of this peer yet")
        t = peer_mono + self.offset_s
        floor = self._floor
        if floor is not None and peer_mono >= floor[0] and t < floor[1]:
            return floor[1]
        return t

    def _add(self, o: float, bound: float) -> bool:
        """One observation ``o - m`` at ``o``; returns whether it is the window's minimum."""
        bounds = self._bounds
        while bounds and bounds[-1][1] >= bound:
            bounds.pop()  # a later, tighter bound: the older one is never the minimum again
        bounds.append((o, bound))
        while bounds[0][0] < o - self.window_s:
            bounds.popleft()
        self.offset_s = bounds[0][1]
        return len(bounds) == 1


@functools.cache
def boot_id() -> str:
    """This kernel's boot id (Linux), shortened: equal ids mean one CLOCK_MONOTONIC; "" elsewhere
    (then no two processes are assumed to share a clock)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:16]
    except OSError:
        return ""


def _wall(x: float | bytes) -> float | None:
    """A sender's wall time, or None where its text is not one (it only serves the skew report):
    ``inf`` or ``nan`` from a broken sender made an "inf s ahead" clock_skew event, and a JSON
    log with Infinity in it."""
    if not isinstance(x, float):
        try:
            x = float(x)
        except ValueError:
            return None
    return x if math.isfinite(x) else None
