"""Verdicts from heartbeats: DEAD, HUNG and STRAGGLER (DESIGN.md section 6), as pure logic.

The leader feeds ``Detector.observe`` a snapshot of every rank's last liveness and progress times,
already on the leader's own monotonic clock (``resilient.health.clocks`` maps them there, so a
sender's skewed wall clock never enters a verdict); it returns findings.  No store, no threads, no
clocks of its own: tested by feeding snapshots.

* DEAD: no liveness heartbeat for ``dead_after_intervals`` intervals (a killed or frozen process:
  SIGSTOP freezes its heartbeat thread too; ``startup_dead_after_intervals`` in the start-up phases
  before the checkpoint is loaded, where imports and model building keep the CPU and the GIL busy
  and a loaded machine can starve the heartbeat thread for seconds; ``running_dead_after_intervals``
  when the leader sees the rank's process still running on its own machine, neither gone nor
  stopped nor stuck; and a rank whose timeout ran out while the leader itself was starved gets an
  interval after that to beat); or never registered at all within ``join_timeout_s`` of the leader's own start ("never
  joined": frozen or stuck in imports or the launcher before its heartbeat started).
* HUNG: alive, but no progress for its phase's budget while peers wait (they are further along:
  a higher progress sequence number, which orders ranks before the first step too), or every rank
  stalled at once.  The budget is ``hang_timeout_s`` when set, else the rolling 95th percentile of
  observed step times times ``hang_factor``, never below ``hang_floor_s``.  Every phase from process
  start to the first step (init, rendezvous, setup, restore), the first step itself, and the phases
  the loop declares later (checkpoint, commit, eval) have budgets of their own.
* STRAGGLER: a rank whose recent step time exceeds the median rank's by ``straggler_factor`` for
  ``straggler_windows`` consecutive new measurements of its step (not scans: one slow step seen by
  several scans counts once); reported, never killed.  The first step (the loop's ``first_step``
  phase: compiling, warming caches) is measured for neither this nor the hang budget.  When the loop reports
  each rank's compute time (without collective waits), that is compared instead: in a synchronous
  job every rank's wall-clock step is as long as the slowest rank's.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "Verdict",
    "RankStatus",
    "Finding",
    "DetectorConfig",
    "Detector",
    "STARTUP_PHASES",
    "DEFAULT_PHASE_BUDGETS_S",
    "UNREGISTERED",
]


# "done": the loop finished; "exiting": the launcher is tearing the group down after a failure
# it saw itself (a rank that exits then is not the one that failed).
GONE_PHASES = ("done", "exiting")


class Verdict(StrEnum):
    DEAD = "DEAD"
    HUNG = "HUNG"
    STRAGGLER = "STRAGGLER"


# What a rank goes through before its first step, in order; each has a budget.
STARTUP_PHASES = ("init", "rendezvous", "setup", "restore")
# where the liveness timeout is startup_dead_after_intervals (heavy imports and model building)
STARTUP_LIVENESS_PHASES = ("init", "rendezvous", "setup")
DEFAULT_PHASE_BUDGETS_S = {
    "init": 300.0,  # heartbeat started: before the process group (launch.init_process_group)
    "rendezvous": 300.0,  # inside dist.init_process_group, waiting for the peers
    "setup": 300.0,  # process group up: building the model, the first collectives
    "restore": 600.0,  # loading the newest committed checkpoint (Run.track)
    "checkpoint": 600.0,  # staging a save (and joining the previous one)
    "commit": 600.0,  # waiting for a save to commit (final, preemption)
    "eval": 900.0,
}
UNREGISTERED = "unregistered"  # a rank with no heartbeat key yet


@dataclass(frozen=True)
class RankStatus:
    rank: int
    alive_t: float | None  # last liveness heartbeat, on the leader's clock (None: never joined)
    step: int | None  # last step the loop announced
    phase: str = "train"
    progress_t: float | None = None  # when it announced that step or phase (leader's clock)
    host: str = ""
    pid: int = 0
    busy_s: float | None = None  # compute time of its last step, without collective waits
    seq: int | None = None  # how many progress announcements it made: orders ranks before step 1
    interval_s: float | None = None  # how often it says it beats (None: not said)


@dataclass(frozen=True)
class Finding:
    verdict: Verdict
    rank: int | None  # None: the whole group stalled
    host: str
    pid: int
    last_step: int | None
    phase: str
    seconds_since_progress: float | None
    seconds_since_alive: float | None
    detail: str
    # why: "no_heartbeat", "never_joined", "no_progress" (behind waiting peers), "group_stall",
    # "slow"; and the bound that was exceeded (dead timeout, join timeout, phase budget)
    cause: str = ""
    timeout_s: float | None = None
    waited_s: float | None = None  # never joined: how long the leader had waited for it
    # the rank that SIGKILLs the failed one (the leader picks it: a live rank on its node, else on
    # its host; None: no live rank there, its launcher must stop it)
    kill_by: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Finding:
        names = set(cls.__dataclass_fields__)
        return cls(
            **{**{k: v for k, v in d.items() if k in names}, "verdict": Verdict(d["verdict"])}
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d

    def __str__(self) -> str:
        if self.rank is None:
            who = "all ranks"
        elif self.pid:
            who = f"rank {self.rank} ({self.host}, pid {self.pid})"
        else:
            who = f"rank {self.rank} (never registered)"
        return f"{self.verdict.value}: {who} at step {self.last_step} ({self.phase}): {self.detail}"


@dataclass(kw_only=True)
class DetectorConfig:
    """Heartbeat and verdict settings.  ``phase_budgets_s`` overrides the defaults
    (``DEFAULT_PHASE_BUDGETS_S``) phase by phase; ``join_timeout_s``: how long the leader waits,
    from its own start, for a rank that never registered before declaring it DEAD."""

    interval_s: float = 1.0
    dead_after_intervals: float = 2.0
    startup_dead_after_intervals: float = 5.0  # phases init, rendezvous, setup
    # a silent rank whose process the leader sees running on its own machine (not gone, not
    # stopped): its heartbeat thread is starved (a loaded machine, native code holding the GIL),
    # which a restart of the whole job would not cure; it gets this many intervals
    running_dead_after_intervals: float = 10.0
    join_timeout_s: float = 120.0
    hang_timeout_s: float | None = None
    hang_factor: float = 5.0
    hang_floor_s: float = 30.0
    phase_budgets_s: dict[str, float] = field(default_factory=dict)
    first_step_budget_s: float = 300.0
    straggler_factor: float = 1.4
    straggler_windows: int = 3
    window: int = 50  # step times kept per rank
    skew_report_s: float = 1.0  # clock skew worth an event in the log

    def __post_init__(self) -> None:
        check_seconds("interval_s", self.interval_s)
        check_seconds("dead_after_intervals", self.dead_after_intervals, unit="intervals")
        check_seconds("join_timeout_s", self.join_timeout_s)
        check_seconds("hang_timeout_s", self.hang_timeout_s, none_ok=True)
        for name in (
            "startup_dead_after_intervals",
            "running_dead_after_intervals",
            "hang_factor",
            "straggler_factor",
        ):
            check_seconds(name, getattr(self, name), unit="multiples")
        check_seconds("skew_report_s", self.skew_report_s)
        for name in ("hang_floor_s", "first_step_budget_s"):  # (0: none of its own)
            value = getattr(self, name)
            if isinstance(value, bool) or value != 0:
                check_seconds(name, value)
        if self.straggler_factor <= 1:
            raise ValueError(
                f"straggler_factor must be > 1 (a rank this many times slower than the median is "
                f"a straggler), got {self.straggler_factor!r}"
            )
        for name in ("straggler_windows", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("startup_dead_after_intervals", "running_dead_after_intervals"):
            if getattr(self, name) < self.dead_after_intervals:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be at least dead_after_intervals "
                    f"({self.dead_after_intervals})"
                )
        if not isinstance(self.phase_budgets_s, Mapping):
            raise ValueError(
                f"phase_budgets_s must map phase names to seconds, got {self.phase_budgets_s!r}"
            )
        for phase, budget in self.phase_budgets_s.items():
            if not isinstance(phase, str) or not phase:
                raise ValueError(f"phase_budgets_s: a phase is named by a string, got {phase!r}")
            check_seconds(f"phase_budgets_s[{phase!r}]", budget)
        self.phase_budgets_s = {**DEFAULT_PHASE_BUDGETS_S, **self.phase_budgets_s}

    @property
    def dead_timeout_s(self) -> float:
        return self.interval_s * self.dead_after_intervals

    def interval_of(self, beats_every_s: float | None) -> float:
        """The interval a rank that says it beats every ``beats_every_s`` is judged on: the
        longer of that and this setting's (None: this setting's)."""
        if beats_every_s is not None and beats_every_s > self.interval_s:
            return beats_every_s
        return self.interval_s

    def dead_timeout_in(self, phase: str, beats_every_s: float | None = None) -> float:
        """The liveness timeout of a rank in ``phase`` that beats every ``beats_every_s`` (what its
        heartbeat says), on ``interval_of`` it."""
        interval = self.interval_of(beats_every_s)
        if phase in STARTUP_LIVENESS_PHASES:
            return interval * self.startup_dead_after_intervals
        return interval * self.dead_after_intervals


def check_seconds(name: str, value: Any, *, none_ok: bool = False, unit: str = "seconds") -> None:
    """Refuse a setting ``name`` that is not a finite real number > 0 (a bool, a string, NaN,
    infinity; None unless ``none_ok``): a ValueError naming it, what it takes and what it got."""
    if none_ok and value is None:
        return
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return
    raise ValueError(
        f"{name} must be positive {unit}: a finite int or float > 0"
        f"{' (or None)' if none_ok else ''}, got {value!r} ({type(value).__name__}); pass a "
        f"number (a value read as text, from a config file or the command line: float() it)"
    )


class Detector:
    """``start``: when the leader started watching, on the clock ``observe`` gets as ``now``; a rank
    with no heartbeat ``join_timeout_s`` after it is declared DEAD ("never joined").
    ``running``: asked about a rank whose heartbeat is overdue, says whether its process is
    running on the leader's machine (True), is gone or stopped (False), or cannot be seen (None,
    another machine); a running one gets ``running_dead_after_intervals``.  ``probe``: told of a
    rank whose heartbeat is late, between its timeout less one and a half intervals and its
    timeout less half an interval, so that ``running`` can say at the timeout whether the process
    used CPU since (a starved process does, in a second, even when none of its
    threads is on a CPU at the moment it is looked at; a stuck one does not)."""

    def __init__(
        self,
        config: DetectorConfig,
        *,
        start: float = 0.0,
        running: Callable[[RankStatus], bool | None] | None = None,
        probe: Callable[[RankStatus], None] | None = None,
    ) -> None:
        self.config = config
        self.start = start
        self._running = running
        self._probe = probe
        # rank -> (its last step, when it announced it, in which phase)
        self._last: dict[int, tuple[int | None, float | None, str]] = {}
        self._step_times: dict[int, deque[float]] = {}
        self._busy_times: dict[int, deque[float]] = {}
        self._samples: dict[int, int] = {}  # rank -> how many step times were recorded for it
        # rank -> (consecutive slow samples, the sample count the last one was)
        self._slow_streak: dict[int, tuple[int, int]] = {}
        self._hang_s = config.hang_timeout_s or config.hang_floor_s
        # the earliest moment a verdict could become due on what the last scan saw (a heartbeat
        # crossing its timeout, a rank behind its peers crossing its budget): the leader looks
        # again then, instead of up to an interval later.  None: nothing is pending.
        self.next_deadline: float | None = None

    def hang_timeout_s(self) -> float:
        c = self.config
        if c.hang_timeout_s is not None:
            return c.hang_timeout_s
        times = sorted(t for d in self._step_times.values() for t in d)
        if not times:
            return c.hang_floor_s
        p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
        return max(c.hang_floor_s, p95 * c.hang_factor)

    def _budget(self, s: RankStatus) -> float:
        if s.phase in self.config.phase_budgets_s:
            return self.config.phase_budgets_s[s.phase]
        if s.phase == "first_step":  # compiling, warming caches: the loop says so
            return max(self.config.first_step_budget_s, self._hang_s)
        return self._hang_s

    def _record(self, s: RankStatus) -> None:
        prev = self._last.get(s.rank)
        if s.step is not None:
            # the step after the loop's first one measures the first step: compiling, warming
            # caches, often minutes, and longer on one rank than another; it calibrates neither
            # the hang budget (p95 x factor) nor the straggler comparison
            if (
                prev
                and prev[0] is not None
                and s.step > prev[0]
                and prev[1]
                and s.progress_t
                and prev[2] != "first_step"
            ):
                per_step = (s.progress_t - prev[1]) / (s.step - prev[0])
                self._step_times.setdefault(s.rank, deque(maxlen=self.config.window)).append(
                    per_step
                )
                if s.busy_s is not None:
                    self._busy_times.setdefault(s.rank, deque(maxlen=self.config.window)).append(
                        s.busy_s
                    )
                self._samples[s.rank] = self._samples.get(s.rank, 0) + 1
        if prev is None or prev[0] != s.step:
            self._last[s.rank] = (s.step, s.progress_t, s.phase)

    def observe(
        self,
        statuses: list[RankStatus],
        now: float,
        *,
        stalled: tuple[float, float] | None = None,
    ) -> list[Finding]:
        """``stalled``: (from, to), the leader's own last stall (its loop missed its wake time at
        ``from`` and ran again at ``to``): the machine stalled, the other ranks' heartbeat threads
        with it.  A rank whose timeout ran out after the stall began gets an interval from its
        end to beat; one already overdue before it does not, and a later stall gives none again.
        Nothing else is judged meanwhile (a silent rank must not pass for a hung one)."""
        c = self.config
        for s in statuses:
            self._record(s)
        # once per scan, not once per rank: it sorts every recorded step time (O(N log N) at
        # 4,096 ranks, and O(N^2 log N) when it was called for each rank)
        self._hang_s = self.hang_timeout_s()
        findings: list[Finding] = []
        # finished ranks, and ranks a launcher's teardown is stopping, owe no heartbeat
        statuses = [s for s in statuses if s.phase not in GONE_PHASES]
        waited = now - self.start
        deadline = float("inf")
        graced = False
        for s in statuses:
            if s.alive_t is None:
                deadline = min(deadline, self.start + c.join_timeout_s)
                if waited > c.join_timeout_s:
                    findings.append(
                        self._finding(
                            Verdict.DEAD,
                            s,
                            now,
                            f"never joined: no heartbeat registered {waited:.1f}s after the "
                            f"leader started (join timeout {c.join_timeout_s:.1f}s); it froze or "
                            f"is stuck before its monitor started (imports, the launcher, "
                            f"resilient.launch.init_process_group)",
                            cause="never_joined",
                            timeout_s=c.join_timeout_s,
                            waited_s=waited,
                        )
                    )
                continue
            since_alive = now - s.alive_t
            timeout = c.dead_timeout_in(s.phase, s.interval_s)
            # (a rank that says it beats less often than this setting is judged on its interval)
            beats = c.interval_of(s.interval_s)
            running = False
            # a look at least half an interval before the timeout, from a window an interval
            # long, so that one of the leader's scans (one per interval) falls into it
            if (
                self._probe is not None
                and timeout - 1.5 * c.interval_s < since_alive <= timeout - c.interval_s / 2
            ):
                self._probe(s)
            if since_alive > timeout:
                if (
                    stalled is not None
                    and now - stalled[1] < c.interval_s
                    and s.alive_t + timeout > stalled[0]
                ):
                    deadline = min(deadline, stalled[1] + c.interval_s)
                    graced = True
                    continue
                if self._running is not None and self._running(s):
                    running = True
                    timeout = max(timeout, beats * c.running_dead_after_intervals)
            deadline = min(deadline, s.alive_t + timeout)
            if since_alive > timeout:
                why = (
                    f"although its process is running on the leader's machine (timeout "
                    f"{timeout:.1f}s in phase {s.phase} for a running process: its heartbeat "
                    f"thread cannot run, native code holding the GIL or a starved machine)"
                    if running
                    else f"(timeout {timeout:.1f}s in phase {s.phase})"
                )
                findings.append(
                    self._finding(
                        Verdict.DEAD,
                        s,
                        now,
                        f"no liveness heartbeat for {since_alive:.1f}s {why}",
                        cause="no_heartbeat",
                        timeout_s=timeout,
                    )
                )
        if findings:
            self.next_deadline = None
            return findings
        if graced:
            self.next_deadline = deadline
            return []
        known = [s for s in statuses if s.progress_t is not None and s.alive_t is not None]
        if known:
            stalled = [s for s in known if now - s.progress_t > self._budget(s)]
            order = _order_of(known)
            ahead = max(order(s) for s in known)
            for s in known:
                if order(s) < ahead:  # a peer went further: its budget is a deadline
                    deadline = min(deadline, s.progress_t + self._budget(s))
            behind = [s for s in stalled if order(s) < ahead]
            further = max(known, key=order) if behind else None
            for s in behind:
                assert further is not None
                where = (
                    f"step {further.step}"
                    if further.step is not None and further.step != s.step
                    else f"phase {further.phase}"
                )
                findings.append(
                    self._finding(
                        Verdict.HUNG,
                        s,
                        now,
                        f"alive but no progress for {now - s.progress_t:.1f}s (budget "
                        f"{self._budget(s):.1f}s in phase {s.phase}) while peers reached {where}",
                        cause="no_progress",
                        timeout_s=self._budget(s),
                    )
                )
            if not behind and stalled and len(stalled) == len(statuses):
                s = min(stalled, key=lambda x: x.progress_t)
                findings.append(
                    Finding(
                        Verdict.HUNG,
                        None,
                        "",
                        0,
                        s.step,
                        s.phase,
                        now - s.progress_t,
                        None,
                        f"every rank stalled at step {s.step} (phase {s.phase}) for over "
                        f"{self._budget(s):.1f}s",
                        cause="group_stall",
                        timeout_s=self._budget(s),
                    )
                )
        findings += self._stragglers(statuses, now)
        due = [f for f in findings if f.verdict is not Verdict.STRAGGLER]
        self.next_deadline = None if due or deadline == float("inf") else deadline
        return findings

    def _stragglers(self, statuses: list[RankStatus], now: float) -> list[Finding]:
        # In a synchronous job every rank's step takes as long as the slowest one's, so compare
        # the compute time the loop reports when every rank reports it; else the step times.
        times = (
            self._busy_times
            if self._busy_times and len(self._busy_times) >= len(self._step_times)
            else self._step_times
        )
        recent = {r: statistics.median(list(d)[-5:]) for r, d in times.items() if len(d) >= 2}
        if len(recent) < 3:
            return []
        median = statistics.median(recent.values())
        out = []
        for s in statuses:
            t = recent.get(s.rank)
            if t is not None and median > 0 and t > self.config.straggler_factor * median:
                # a streak of measurements, not of scans: the leader scans every interval, and
                # one slow step seen over three scans is one observation, not three
                streak, counted = self._slow_streak.get(s.rank, (0, 0))
                samples = self._samples.get(s.rank, 0)
                if samples == counted:
                    continue
                self._slow_streak[s.rank] = (streak + 1, samples)
                if streak + 1 == self.config.straggler_windows:
                    out.append(
                        self._finding(
                            Verdict.STRAGGLER,
                            s,
                            now,
                            f"{t / median:.1f}x slower than the median rank ({t:.3f}s vs "
                            f"{median:.3f}s per step{' of compute' if times is self._busy_times else ''})",
                            cause="slow",
                        )
                    )
            else:
                self._slow_streak[s.rank] = (0, self._samples.get(s.rank, 0))
        return out

    @staticmethod
    def _finding(
        v: Verdict,
        s: RankStatus,
        now: float,
        detail: str,
        *,
        cause: str = "",
        timeout_s: float | None = None,
        waited_s: float | None = None,
    ) -> Finding:
        return Finding(
            v,
            s.rank,
            s.host,
            s.pid,
            s.step,
            s.phase,
            None if s.progress_t is None else now - s.progress_t,
            None if s.alive_t is None else now - s.alive_t,
            detail,
            cause,
            timeout_s,
            waited_s,
        )


def _order_of(known: list[RankStatus]) -> Callable[[RankStatus], int]:
    """How far a rank got: its progress sequence number when every rank sends one (it counts
    phases before the first step too), else its step.  Decided once per scan (O(N))."""
    if all(k.seq is not None for k in known):
        return lambda s: s.seq  # type: ignore[return-value]
    return lambda s: -1 if s.step is None else s.step
