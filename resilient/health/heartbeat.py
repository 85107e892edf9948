"""Heartbeats through the c10d store, the leader's scan, and what every rank does on a verdict.

Every rank runs one daemon thread ("resilient-heartbeat") that, each interval, publishes its
liveness, and reads two keys: the verdict and the leader's liveness (O(1) per rank).  A second
thread ("resilient-verdict") blocks in a store wait on the rank's wake key, which the leader sets
with the verdict, so that every rank acts on a verdict at once rather than at its next beat (the
rank that must kill a frozen peer on another node, and the survivors leaving a broken group).  The leader
(rank 0; if its heartbeat stops, or it never registers, the next live rank takes over with an
atomic compare-and-set) also reads every registered rank's keys in one batch, runs the Detector and
publishes a verdict (O(world)).  The loop publishes progress (step, phase, a sequence number) from
its own thread.

A rank registers (appends itself to ``<prefix>/joined``) when its monitor starts, which under
torchrun is inside ``resilient.launch.init_process_group``, before the process group exists: a rank
that froze in its imports or in the launcher never registers, and the leader declares it DEAD
("never joined") ``join_timeout_s`` after its own start.

Times: each heartbeat carries the sender's monotonic clock; the observer maps it onto its own
(``resilient.health.clocks``), so a skewed or stepped wall clock on any host never causes a verdict.
The skew the leader sees goes to the event log ("clock_skew").

Collectives: when the collective ring is installed (``resilient.health.ring``, by
``resilient.launch.init_process_group``), the heartbeat thread publishes its summary with the
liveness beat whenever it changed (one ``multi_set``, so no extra round trip); on HUNG every rank
publishes its main thread's stack, and the leader compares the rings
(``resilient.health.attribution``) and logs which collective the job is stuck in and which ranks
never entered it (``hang_attribution``), waiting a few intervals at most for the stacks of the
ranks it names.

On DEAD or HUNG every live rank writes its Python stacks (faulthandler), its flight recorder
dump when PyTorch's is on (``resilient.health.flight_recorder``), and the failure record to the
event log; one live rank on the failed rank's node SIGKILLs it (first, on DEAD: the survivors'
collectives wait on it; on HUNG after its stack, and from a killer that is not the leader after
the leader's attribution).  That is the lowest-numbered, which the leader
names in the verdict, ``kill_by``; a rank on the same host when none is left on its node; for a
rank that never registered, a rank of its node by torchelastic's contiguous numbering, which finds
it by its launcher environment.  A stopped process never exits, so its agent would never see the
failure (torchrun waits 30 s for it; in-job recovery would never hand its rank to a spare).  A node is the host and the launcher's agent
(torchelastic's ``GROUP_RANK``), so that agents sharing one machine count as separate nodes.
Then every rank exits with ``EXIT_RANK_FAILURE`` so that torchrun (``--max-restarts``) restarts the
group, which resumes from the newest committed checkpoint.  A rank blocked inside a collective
cannot be interrupted from Python: exiting is the reliable way.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient.health import flight_recorder
from resilient.health.attribution import RankRing, attribute_hang, decode_summary
from resilient.health.clocks import PeerClock, boot_id
from resilient.health.detector import (
    GONE_PHASES,
    UNREGISTERED,
    Detector,
    DetectorConfig,
    Finding,
    RankStatus,
    Verdict,
)
from resilient.health.events import EventLog
from resilient.health.ring import CollectiveRing, installed

log = logging.getLogger(__name__)

__all__ = [
    "Monitor",
    "proc_stat",
    "EXIT_RANK_FAILURE",
    "encode_info",
    "decode_info",
    "encode_alive",
    "decode_alive",
    "encode_progress",
    "decode_progress",
    "local_rank_pid",
    "main_thread_stack",
    "decode_stack",
    "node_label",
]

# sysexits EX_TEMPFAIL: "try again" - a peer failed and the group must restart.
EXIT_RANK_FAILURE = 75
# how far past a deadline the leader looks (verdicts need the timeout strictly exceeded)
_PAST = 0.005
ENV_ROUND = "RESILIENT_RDZV_ROUND"  # set by `resilient launch`: the rendezvous round
# in a persister process's environment (resilient/checkpoint/persister.py sets it): it inherits
# its worker's RANK and may outlive it, and must never be taken for that rank's worker
PERSISTER_MARK = b"RESILIENT_PERSISTER_PROCESS=1"
# a store wait's timeout: close() and the exit end the wait sooner, through the rank's wake key
# (c10d logs a warning at every wait that times out, hence a day)
_VERDICT_WAIT_S = 86400.0
_LIVE: weakref.WeakSet[Monitor] = weakref.WeakSet()  # monitors not closed yet
# process states (process_state) of a rank that is not running: gone, zombie, dead, stopped
# (SIGSTOP) or traced (a debugger holds it)
_NOT_RUNNING = frozenset({"gone", "Z", "X", "x", "T", "t"})
# a stack another rank published for the hang's record: main_thread_stack's 12 frames are a
# few KB; a value past these bounds is not one
MAX_STACK_BYTES = 64 << 10
MAX_STACK_CHARS = 8 << 10
MAX_PATH_CHARS = 4096
PID_MAX_LIMIT = 1 << 22  # Linux's largest pid_max: a larger "pid" is none
_PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is exiting (a SIGKILLed one tearing down)
# a store error that repeats (one per interval while the store is down) is logged once, then as a
# count this often, and with the total when the store answers again
ERROR_SUMMARY_S = 300.0


@atexit.register
def _stop_monitors() -> None:
    """Monitors nobody closed stop quietly (as a killed rank does) before the interpreter goes:
    a daemon thread still inside a store call then (the heartbeat's, or the verdict waiter's
    day-long wait) aborts the process ("terminate called without an active exception")."""
    for monitor in list(_LIVE):
        monitor.close(announce=False, at_exit=True)


_PROCESS_RING = object()  # Monitor(ring=...) default: the ring this process installed, if any


class Monitor:
    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        config: DetectorConfig | None = None,
        *,
        events: EventLog | None = None,
        on_failure: Callable[[Finding], None] | None = None,
        kill_local: bool = True,
        ring: CollectiveRing | None | object = _PROCESS_RING,
    ) -> None:
        """``ring``: the collective ring to publish (default: the one this process installed,
        looked up at every beat; None: none)."""
        self.store, self.prefix, self.rank, self.world_size = (
            store,
            prefix.rstrip("/"),
            rank,
            world_size,
        )
        self.config = config or DetectorConfig()
        self.started_mono = time.monotonic()
        self.detector = Detector(
            self.config, start=self.started_mono, running=self._running, probe=self._note_cpu
        )
        # (the leader) when its own loop last missed its wake time, and when it ran again
        # (Detector.observe's ``stalled``)
        self._stalled: tuple[float, float] | None = None
        # (the leader) when its loop last woke: a scan that reads the heartbeats more than half an
        # interval later was starved on the way (the beat, the store round trips before the scan,
        # each a wait for the GIL), and judges them as after a missed wake time
        self._woke: float | None = None
        # (the leader) rank -> (the heartbeat its silence follows, its process's CPU time at a
        # look, whether the log has said it runs, when that look was): one entry per silence
        self._silent: dict[int, tuple[float, int, bool, float]] = {}
        self.events = events or EventLog(None)
        self.on_failure = on_failure or self._exit
        # in-job recovery: called (from the monitor's thread) on a verdict about another rank
        self.on_peer_failure: Callable[[Finding], None] | None = None
        # in-job recovery: the loop took a peer's failure over (``hand_over``)
        self._handed_over = False
        self.kill_local = kill_local
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.node = node_label()
        # one store client, several threads; reentrant because the SIGTERM handler announces
        # "exiting" from the main thread, which the signal may have interrupted holding it
        # (handlers run between bytecodes, never inside a store call, so reentry is safe)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by close() and by the verdict's waiter
        self._verdict: Finding | None = None
        self._failure_called = False  # (this verdict's on_failure was called: _watch)
        self._reported: set[tuple[str, int | None]] = set()
        self.scans = 0
        self.last_scan_s = 0.0
        self._seq = 0
        self.phase: str | None = None
        self._joined: set[int] = set()
        self._keys: list[str] = []
        self._clocks: dict[int, PeerClock] = {}
        self._cache: dict[int, tuple[bytes, bytes, RankStatus, PeerClock]] = {}
        self._beats: dict[int, float] = {}  # rank -> the monotonic time of its last beat read
        self._intervals: dict[int, float | None] = {}  # rank -> the interval its beats announce
        self._interval_text: dict[int, bytes] = {}  # rank -> that interval's text, last read
        self._skew_reported: dict[int, float] = {}
        self._malformed: set[tuple[int | None, str]] = set()  # (rank, key) logged already
        self._key_leader = f"{self.prefix}/leader"
        self._info: dict[int, tuple[str, int, str, str]] = {}  # rank -> (host, pid, boot, node)
        self._starts: dict[int, int] = {}  # rank -> its process's start time (process_start)
        self._blocks: dict[int, tuple[int, int]] = {}  # rank -> its node's (first rank, count)
        self._published = False  # (the leader) a verdict is out: it is published once
        self._ring_arg = ring
        # the newest progress announcement a store error kept from the store: the heartbeat
        # thread publishes it with its next beat (guarded by the lock)
        self._unsent_progress: str | None = None
        self._beat_errors = _ErrorSeries(self, "heartbeat")
        self._progress_errors = _ErrorSeries(self, "progress")
        self._ring_sent: CollectiveRing | None | object = _PROCESS_RING  # nothing published yet
        # (a rank watching the leader) the leader and the monotonic time of its last beat read
        self._leader_beat: tuple[int, float] | None = None
        self.attribution: dict[str, Any] | None = None  # the leader's, on a HUNG verdict
        self._set(
            "info",
            encode_info(
                self.host, self.pid, boot_id(), self.node, node_block(), process_start(self.pid)
            ),
        )
        # a verdict reaches every rank at once, not at its next beat: the rank that must kill a
        # frozen peer on another node (and every survivor, to leave) waits on its wake key, on a
        # connection of its own (a blocked client serializes every other request behind it).  A
        # wake key left by an earlier monitor of this rank and prefix goes first (a verdict
        # already out is read at the first beat all the same).
        self._waiter: threading.Thread | None = None
        waiter_store = None
        if hasattr(store, "clone"):
            try:
                waiter_store = store.clone()
                with self._lock:
                    self.store.delete_key(f"{self.prefix}/wake/{rank}")
            except Exception as e:  # no second connection: verdicts arrive at the beats
                self.events.write("monitor_error", rank=rank, error=f"verdict waiter: {e!r}")
                waiter_store = None
        self._beat()
        self._publish_progress(self._announce(None, "init"))
        with self._lock:
            self.store.compare_set(self._key_leader, "", "0")
            self.store.append(f"{self.prefix}/joined", f"{rank},")
        self._thread = threading.Thread(target=self._loop, name="resilient-heartbeat", daemon=True)
        self._thread.start()
        if waiter_store is not None:
            self._waiter = threading.Thread(
                target=self._await_verdict,
                args=(waiter_store,),
                name="resilient-verdict",
                daemon=True,
            )
            self._waiter.start()
        _LIVE.add(self)

    # --- what the loop calls ------------------------------------------------------------------
    def progress(self, step: int | None, phase: str, busy_s: float | None = None) -> None:
        """Announce ``step`` and ``phase``; ``busy_s``: the time this rank computed in its last
        step, without waiting in collectives (what tells a straggler apart in a synchronous job,
        where every rank's step takes equally long).

        The loop calls this at every step: a store error does not reach it (a training run must
        not die of its monitor's store).  The announcement is kept, and the heartbeat thread
        publishes the newest one with its next beat; the errors are logged as a series (the
        first, then a count every ``ERROR_SUMMARY_S``, and the total once the store answers)."""
        value = self._announce(step, phase, busy_s)
        try:
            self._publish_progress(value)
        except Exception as e:
            self._progress_errors.failed(e)
        else:
            self._progress_errors.ok()

    def _announce(self, step: int | None, phase: str, busy_s: float | None = None) -> str:
        self._seq += 1
        self.phase = phase
        return encode_progress(step, phase, self._seq, time.monotonic(), busy_s)

    def _publish_progress(self, value: str) -> None:
        """Write a progress announcement (raises what the store raises); until it is written,
        it is the one the next beat publishes."""
        with self._lock:
            self._unsent_progress = value
            self._set("progress", value)
            self._unsent_progress = None

    def leaving(self, step: int | None) -> None:
        """Say this rank is being stopped by its launcher (not failing by itself), so that no
        verdict blames it and a leader's place passes on at once."""
        try:
            self.progress(step, "exiting")
        except Exception:  # the store may be gone already
            pass

    def verdict(self) -> Finding | None:
        return self._verdict

    def hand_over(self) -> None:
        """(in-job recovery; the loop) This rank's loop took a peer's failure over and goes on to
        the next generation of the group.  A verdict about that peer that this monitor has not
        answered yet (its thread may read it only now, on a loaded machine) is still answered
        (the record, the stacks, a kill this rank is named for) but neither exits the rank nor
        calls ``on_peer_failure``, which would abort the checkpointer the next generation keeps."""
        self._handed_over = True
        self.on_peer_failure = None

    def _in_job(self) -> bool:
        """Whether a verdict about a peer is in-job recovery's to answer, not an exit."""
        return self.on_peer_failure is not None or self._handed_over

    def close(self, *, announce: bool = True, at_exit: bool = False) -> None:
        """Stop heartbeating.  With ``announce`` (a normal end), say "done" first, so that peers
        still finishing do not take the silence for a death; without it the rank just goes quiet,
        as a killed one does (its wake key says "close": the leader does not take its process,
        still tearing down, for a running one with a starved heartbeat)."""
        done, first = False, not self._stop.is_set()
        if announce and first and self._verdict is None:
            try:
                self._publish_progress(self._announce(None, "done"))
                done = True
            except Exception:  # the store may be gone at shutdown
                pass
        self._stop.set()
        self._wake.set()
        _LIVE.discard(self)
        self._release_waiter(at_exit=at_exit, mark=not done and not at_exit)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            timeout = 5 * self.config.interval_s
            verdict = self._verdict
            if verdict is not None and verdict.verdict is Verdict.HUNG:
                # the thread answers it (it ends the process): the attribution's waits first
                timeout += self.attribution_wait_s()
            self._thread.join(timeout=timeout)
        missed = self._handed_over and self._verdict is None and first and not at_exit
        if missed and not self._thread.is_alive():
            # The loop took a peer's failure over (its collective failed) before this monitor's
            # thread read the verdict, and the thread is stopped now: a verdict already out may
            # name this rank the failed one's killer.  Answered here (no exit: handed over), or
            # a frozen rank that no one else kills would never let the next generation form.
            # (Once, at the close the loop makes: not again at exit, when the store may be gone.)
            try:
                self._watch()
            except Exception as e:  # the store is gone: the failed rank's agent is too
                self.events.write("monitor_error", rank=self.rank, error=repr(e))

    def reconfigure(self, config: DetectorConfig) -> None:
        """Take ``config``'s settings over this monitor's (``Run`` adopting the monitor that
        ``resilient.launch.init_process_group`` started): the heartbeat thread beats on the new
        interval from now on, not from its next beat on the old one, and every beat says which
        interval it keeps, so the leader never judges a rank that has not switched yet on the
        shorter one."""
        for name in config.__dataclass_fields__:
            setattr(self.config, name, getattr(config, name))
        self._wake.set()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    @property
    def is_leader(self) -> bool:
        return self._leader() == self.rank

    # --- the heartbeat thread -----------------------------------------------------------------
    def _loop(self) -> None:
        # Beats on a fixed schedule: the work after a beat (store round trips, the leader's scan)
        # does not stretch the period, which on a loaded machine would eat the DEAD margin.  The
        # leader also looks again the moment a verdict could fall due (the detector's deadline),
        # so a verdict comes when its timeout runs out, not up to an interval later.
        interval = self.config.interval_s
        next_beat = time.monotonic() + interval
        while True:
            if self.config.interval_s != interval:  # reconfigured (Run adopting this monitor)
                interval = self.config.interval_s
                next_beat = min(next_beat, time.monotonic() + interval)
            wake = next_beat
            deadline = self.detector.next_deadline
            if deadline is not None and deadline + _PAST < wake:
                wake = max(deadline + _PAST, time.monotonic() + interval / 20)
            poked = self._wake.wait(max(0.0, wake - time.monotonic()))
            if self._stop.is_set():
                return
            now = time.monotonic()
            if not poked and now - wake > interval / 2:
                self._stalled = (wake, now)  # starved: so, likely, were the others on this host
            self._woke = now
            beat = now >= next_beat
            if poked:  # the verdict is in the store (or close() said stop): act on it now
                self._wake.clear()
                if self._stop.is_set():  # close() set it between the check above and the clear
                    return
                if not beat:
                    try:
                        self._watch()
                    except Exception as e:
                        self.events.write("monitor_error", rank=self.rank, error=repr(e))
                    continue
            if beat:
                late = now - next_beat
                next_beat += interval
                if next_beat <= now:  # starved past a whole beat: restart the schedule from now
                    next_beat = now + interval
                if late > interval / 2 and not self._beat_errors.failing:
                    # (while the store fails, the beats are late because of it: said already)
                    self.events.write(
                        "heartbeat_late", rank=self.rank, phase=self.phase, late_s=round(late, 3)
                    )
            else:
                self.detector.next_deadline = None  # looked at once; the scan sets a new one
            try:
                if beat:
                    self._beat()
                try:
                    if beat:
                        self._maybe_take_over()
                    if self.is_leader:
                        self._scan()
                finally:  # a verdict already out is acted on whatever went wrong above
                    self._watch()
            except Exception as e:  # the store going away ends monitoring, not the run
                # once per interval while the store is down: logged as a series, not each time
                self._beat_errors.failed(e)
                if self._stop.wait(interval):
                    return
                # the wait was this loop's own: not a starved machine, not a late beat
                next_beat = time.monotonic()
            else:
                if beat:
                    self._beat_errors.ok()

    def _await_verdict(self, store: Any) -> None:
        """(the "resilient-verdict" thread) Block on this rank's wake key, which the leader sets
        with a verdict (and ``close`` to end the wait); then wake the heartbeat thread.  A store
        that keeps failing (rather than timing out) ends the wait: the heartbeat thread still
        reads the verdict at every beat."""
        key, failures = f"{self.prefix}/wake/{self.rank}", 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                store.wait([key], timedelta(seconds=_VERDICT_WAIT_S))
            except Exception as e:  # the wait timed out, or the store is gone
                if time.monotonic() - t0 < _VERDICT_WAIT_S / 2:
                    failures += 1
                    if failures >= 3 and not self._stop.is_set():
                        self.events.write(
                            "monitor_error",
                            rank=self.rank,
                            error=f"verdict waiter gave up (verdicts come at the beats): {e!r}",
                        )
                        return
                    if self._stop.wait(self.config.interval_s):
                        return
                continue
            self._wake.set()
            return

    def _release_waiter(self, at_exit: bool = False, mark: bool = False) -> None:
        """End the verdict waiter's blocking wait and join it: a thread blocked inside a store
        call when the interpreter exits aborts the process ("terminate called...").  At exit the
        key is set on a connection of its own with a short timeout, without the monitor's lock
        (a heartbeat stuck in a call to a dead store holds it): the exit is not held for long."""
        waiter = self._waiter
        waiting = waiter is not None and waiter.is_alive()
        if not waiting and not mark:  # ``mark``: say "close" all the same
            return
        key = f"{self.prefix}/wake/{self.rank}"
        try:
            if at_exit:
                quick = self.store.clone()
                quick.set_timeout(timedelta(seconds=2))
                quick.set(key, "close")
            else:
                with self._lock:
                    self.store.set(key, "close")
        except Exception:  # the store is gone: its wait fails by itself
            pass
        if waiter is not None and waiting:
            waiter.join(timeout=2.0)

    def _beat(self) -> None:
        alive = encode_alive(time.monotonic(), time.time(), self.config.interval_s)
        keys, values = [f"{self.prefix}/alive/{self.rank}"], [alive]
        ring = self._ring()
        if ring is not self._ring_sent or (ring is not None and ring.changed()):
            # the ring's summary rides with the beat, in one round trip ("" : no ring here)
            keys.append(f"{self.prefix}/ring/{self.rank}")
            values.append("" if ring is None else ring.summary())
            self._ring_sent = ring
        with self._lock:
            unsent = self._unsent_progress
            if unsent is not None:  # an announcement a store error kept back (see progress)
                keys.append(f"{self.prefix}/progress/{self.rank}")
                values.append(unsent)
            if len(keys) == 1:
                self.store.set(keys[0], alive)
            else:
                self.store.multi_set(keys, values)
            self._unsent_progress = None

    def _ring(self) -> CollectiveRing | None:
        if self._ring_arg is _PROCESS_RING:
            return installed()
        return self._ring_arg  # type: ignore[return-value]

    def _maybe_take_over(self) -> None:
        leader = self._leader()
        if leader == self.rank:
            return
        # the next rank after the leader takes over first; rank leader+k waits k timeouts
        distance = (self.rank - leader - 1) % self.world_size + 1
        c = self.config
        key = f"{self.prefix}/alive/{leader}"
        # ages are judged as of before the read (a slow read must not age what it returns); the
        # clock observes the value as of after it (when it was there for sure: observed earlier,
        # a value the leader wrote during a slow read would set the offset too small, for good)
        now = time.monotonic()
        with self._lock:
            raw = self.store.get(key) if self.store.check([key]) else None
        seen, wall = time.monotonic(), time.time()
        parsed = None if raw is None else self._parse_alive(leader, raw)
        clock = self._clocks.get(leader)
        if parsed is not None:
            clock = clock or self._clock(leader, self._fetch_info([leader]))
            clock.observe(raw, parsed[0], parsed[1], seen, wall)
            self._leader_beat = (leader, parsed[0])
        last = self._leader_beat
        if raw is None or last is None or last[0] != leader or clock is None:
            # the leader never registered (frozen in its imports?), or never published a
            # heartbeat this rank could read: wait as long as the leader would wait for any
            # rank, then take its place and judge it
            gone = now - self.started_mono > c.join_timeout_s + (distance - 1) * c.dead_timeout_s
        else:
            # a malformed value is no new heartbeat: the last one read still ages; on the
            # leader's own interval where it beats less often than this rank's
            timeout = c.dead_timeout_in("train", self._intervals.get(leader))
            gone = (
                self._phase(leader) in GONE_PHASES
                or now - clock.local(last[1]) > distance * timeout
            )
        if gone:
            with self._lock:
                got = self.store.compare_set(self._key_leader, str(leader), str(self.rank)).decode()
            if got == str(self.rank):
                self.events.write(
                    "leader",
                    rank=self.rank,
                    replaced=leader,
                    reason="never registered" if raw is None else "no heartbeat or done",
                )

    def _scan(self) -> None:
        t0 = time.perf_counter()
        n = self.world_size
        if len(self._joined) < n:
            joined_key = f"{self.prefix}/joined"
            with self._lock:
                raw = self.store.get(joined_key) if self.store.check([joined_key]) else b""
            now_joined = self._parse_joined(raw)
            if now_joined != self._joined:
                self._fetch_info(sorted(now_joined - set(self._info)))
                self._joined = now_joined
                ranks = sorted(now_joined)
                self._keys = [f"{self.prefix}/alive/{r}" for r in ranks] + [
                    f"{self.prefix}/progress/{r}" for r in ranks
                ]
        ranks = sorted(self._joined)
        # heartbeats are judged as of when they were asked for: a read that the store (or this
        # process) was slow to answer must not age what it returns
        asked = time.monotonic()
        woke = self._woke
        if woke is not None and asked - woke > self.config.interval_s / 2:
            # starved since this loop woke, on time: as much a stall of the machine as a missed
            # wake time (the leader's own heartbeat, beaten before, had aged with the others')
            self._stalled = (woke, asked)
        self._woke = None  # (one look per wake: a scan called outside the loop measures nothing)
        with self._lock:
            values = self.store.multi_get(self._keys) if self._keys else []
        seen, wall = time.monotonic(), time.time()
        k = len(ranks)
        statuses = []
        for i, r in enumerate(ranks):
            statuses.append(self._status(r, values[i], values[k + i], seen, wall))
        if k < n:
            statuses += [
                RankStatus(r, None, None, UNREGISTERED) for r in range(n) if r not in self._joined
            ]
        now = asked
        findings = self.detector.observe(statuses, now, stalled=self._stalled)
        self.scans += 1
        self.last_scan_s = time.perf_counter() - t0
        self._report_skew(ranks)
        for f in findings:
            tag = (f.verdict.value, f.rank)
            if f.verdict is Verdict.STRAGGLER:
                if tag not in self._reported:
                    self._reported.add(tag)
                    self.events.write("straggler", **f.to_json())
                continue
            self._publish(dataclasses.replace(f, kill_by=self._killer(f, statuses, now)))
            break

    def _publish(self, f: Finding) -> None:
        """(the leader) The verdict, once; on DEAD every rank's verdict waiter wakes at once (one
        more request), not at its next beat.  A leader that goes on scanning (in-job recovery) finds
        the same failure again: it is not published again."""
        if self._published:
            return
        self._published = True
        with self._lock:
            self.store.compare_set(f"{self.prefix}/verdict", "", json.dumps(f.to_json()))
            if f.verdict is Verdict.HUNG:
                # not at once: the leader first gathers the stacks and attributes the hang, and
                # a rank acting at once (the hung one exits, its launcher tears the group down)
                # would end the leader before it wrote the attribution; the ranks read it at
                # their next beat, as the hung rank's stack is awaited anyway
                return
            wake = [f"{self.prefix}/wake/{r}" for r in range(self.world_size)]
            self.store.multi_set(wake, ["verdict"] * len(wake))

    def _killer(self, f: Finding, statuses: list[RankStatus], now: float) -> int | None:
        """Who SIGKILLs the rank ``f`` names: the lowest-numbered live rank on its node, else on
        its host (a process can be killed only from its own machine: the same host name and boot
        id, so that two machines with one name are not mistaken for one); for a rank that never
        registered, a live rank of its node by the launcher's numbering, else the leader (either
        finds it by its launcher environment on its own machine); None when no live rank shares
        its host, or for the whole group."""
        if f.rank is None:
            return None
        live = [
            s.rank
            for s in statuses
            if s.rank != f.rank
            and s.rank in self._info
            and s.alive_t is not None
            and s.phase not in GONE_PHASES
            and now - s.alive_t <= self.config.dead_timeout_in(s.phase, s.interval_s)
        ]
        if not f.pid:
            if f.cause != "never_joined":
                return None
            # where it is, nobody published: torchelastic gives each node a contiguous block of
            # ranks, which every rank publishes, so a live rank whose block holds it is on its
            # node and finds it by its launcher environment; else the leader looks on its own
            same = [
                r
                for r in live
                if r in self._blocks
                and self._blocks[r][0] <= f.rank < self._blocks[r][0] + self._blocks[r][1]
            ]
            return min(same, default=self.rank)
        host, _, boot, node = self._info.get(f.rank, (f.host, f.pid, "", ""))
        if not host:
            return None
        on_host, on_node = [], []
        for r in live:
            info = self._info[r]
            if info[0] != host or info[2] != boot:  # the same machine: its name and its boot
                continue
            on_host.append(r)
            if info[3] == node:
                on_node.append(r)
        return min(on_node or on_host, default=None)

    def _status(self, r: int, alive: bytes, progress: bytes, now: float, wall: float) -> RankStatus:
        """Rank ``r``'s status on this leader's clock.  The leader does this for every rank every
        interval (4,096 ranks: every microsecond here is 4 ms of scan), so it parses only what
        changed, and only the fields a verdict needs (host and pid were read once, at join)."""
        cached = self._cache.get(r)
        if cached is not None and cached[0] == alive and cached[1] == progress:
            cached[3].unchanged(now)  # a value seen anew later was written after this read
            return cached[2]
        clock = self._clocks.get(r)
        if clock is None:
            clock = self._clock(r, self._info.get(r, ("", 0, "", ""))[2])
        # a value that does not parse (another version's, a stray writer's) is no new heartbeat:
        # the rank keeps what was last read of it, and its liveness timeout runs on; it must not
        # stop the scan, which judges every other rank too
        old = None if cached is None else cached[2]
        parsed = self._parse_alive(r, alive)
        if parsed is not None:
            a_mono = parsed[0]
            clock.observe(alive, a_mono, parsed[1], now, wall)
            self._beats[r] = a_mono
        if cached is not None and cached[1] == progress:
            assert old is not None
            step, phase, progress_t, busy, seq = _progress_of(old)
        else:
            try:
                step_b, phase_b, seq_b, p_mono_b, busy_b = progress.split(b"|", 4)
                p_mono = _finite(p_mono_b)
                step = int(step_b) if step_b else None
                phase = _PHASES.get(phase_b) or phase_b.decode()
                busy = float(busy_b) if busy_b else None
                seq = int(seq_b)
            except (ValueError, UnicodeDecodeError):
                self._note_malformed(r, "progress", progress)
                if old is not None:
                    step, phase, progress_t, busy, seq = _progress_of(old)
                else:  # nothing read of it yet: what its monitor says first
                    step, phase, progress_t, busy, seq = None, "init", None, None, None
            else:
                clock.note(p_mono, now)
                progress_t = clock.local(p_mono)
        host, pid = self._info.get(r, ("", 0, "", ""))[:2]
        beat = self._beats.get(r)
        alive_t = None if beat is None or clock.offset_s is None else clock.local(beat)
        status = RankStatus(
            r, alive_t, step, phase, progress_t, host, pid, busy, seq, self._intervals.get(r)
        )
        self._cache[r] = (alive, progress, status, clock)
        return status

    def _parse_alive(self, r: int, raw: bytes) -> tuple[float, bytes] | None:
        """A liveness value's monotonic time and its wall time's text, or None (logged once per
        rank) when it is not one.  The interval it says the rank beats at is kept (``_intervals``;
        a value without one, or with one that is not a positive finite time, keeps none)."""
        mono_b, _, wall_b = raw.partition(b"|")
        wall_b, bar, interval_b = wall_b.partition(b"|")
        try:
            mono = _finite(mono_b)
        except ValueError:
            self._note_malformed(r, "alive", raw)
            return None
        if self._interval_text.get(r) != interval_b:  # (the same at every beat: parsed once)
            self._interval_text[r] = interval_b
            interval = None
            if bar:
                try:
                    interval = _finite(interval_b)
                except ValueError:
                    self._note_malformed(r, "alive", raw)
            self._intervals[r] = interval if interval is not None and interval > 0 else None
        return mono, wall_b

    def _note_malformed(self, r: int | None, what: str, raw: bytes) -> None:
        if (r, what) in self._malformed:
            return
        self._malformed.add((r, what))
        whose = "the join list" if r is None else f"rank {r}'s {what} key"
        self.events.write(
            "heartbeat_malformed",
            rank=r,
            key=what,
            value=repr(raw[:200]),
            leader=self.rank,
            detail=f"{whose} holds {raw[:200]!r}, which is not a heartbeat of this version; "
            "it is taken for no new heartbeat (the rank's liveness timeout runs on). Another "
            "version of resilient, or another job with the same store prefix, writes there",
        )

    def _parse_joined(self, raw: bytes) -> set[int]:
        """The ranks in the join list (``0,1,2,``); an entry that is not a rank is skipped."""
        ranks = set()
        for x in raw.split(b","):
            try:
                if x:
                    r = int(x)
                    if 0 <= r < self.world_size:
                        ranks.add(r)
                        continue
            except ValueError:
                pass
            if x:
                self._note_malformed(None, "joined", raw)
        return ranks

    def _local(self, s: RankStatus) -> tuple[int, int] | None:
        """The pid and start time of ``s``'s process when it is on this machine (None when it is
        on another one, or its start time is unknown: a pid in another pid namespace could be
        mistaken for it)."""
        host, pid, boot, _ = self._info.get(s.rank, ("", 0, "", ""))
        start = self._starts.get(s.rank)
        if not pid or start is None or host != self.host or not boot or boot != boot_id():
            return None
        return pid, start

    def _note_cpu(self, s: RankStatus) -> None:
        """(the detector, about a rank whose heartbeat is late: between its timeout less one and a
        half intervals and its timeout less half an interval) Note the CPU time its process has
        used, once per silence: at the timeout ``_running`` counts any CPU used since as running,
        though none of its threads be on a CPU at that moment."""
        local = self._local(s)
        seen = self._silent.get(s.rank)
        if local is None or s.alive_t is None or (seen is not None and seen[0] == s.alive_t):
            return
        cpu = process_cpu(*local)
        if cpu is not None:
            self._silent[s.rank] = (s.alive_t, cpu, False, time.monotonic())

    def _running(self, s: RankStatus) -> bool | None:
        """(the detector, about a rank whose heartbeat is overdue) Whether its process is still
        running here (``process_activity``; a monitor that closed itself is not): None when it is
        on another machine (``_local``).  A process that is there and not stopped, none of whose
        threads is on a CPU, counts as running until a look at least half an interval old says
        it used no CPU since (then it is stuck): on a loaded machine a starved process is often
        between two slices of CPU when it is looked at."""
        local = self._local(s)
        if local is None:
            return None
        key = f"{self.prefix}/wake/{s.rank}"
        with self._lock:
            if self.store.check([key]) and self.store.get(key) == b"close":
                return False  # it closed its monitor without a word: it is going away
        prev = self._silent.get(s.rank)
        if prev is not None and prev[0] != s.alive_t:
            prev = None  # a look at an earlier silence
        now = time.monotonic()
        aged = prev is not None and now - prev[3] >= self.config.interval_s / 2
        looked = process_activity(*local, prev[1] if aged and prev is not None else None)
        if looked is None:
            return None
        activity, cpu = looked
        said = prev is not None and prev[2]
        if s.alive_t is not None and cpu is not None:
            # a look too young to judge by keeps the older one: it says more
            cpu_at, at = (prev[1], prev[3]) if prev is not None and not aged else (cpu, now)
            self._silent[s.rank] = (s.alive_t, cpu_at, said or activity == "running", at)
        if activity == "idle" and not aged:
            # no look old enough to tell stuck from starved: look again, while the running
            # timeout has not run out (past it, the benefit would only say "running" in a verdict)
            running_s = self.config.interval_s * self.config.running_dead_after_intervals
            return now - s.alive_t < running_s if s.alive_t is not None else False
        running = activity == "running"
        if running and not said:
            try:
                self.events.write(
                    "heartbeat_silent",
                    rank=s.rank,
                    pid=local[0],
                    leader=self.rank,
                    phase=s.phase,
                    detail=f"rank {s.rank}'s heartbeat is overdue but its process is running: "
                    f"waiting up to {self.config.running_dead_after_intervals:g} intervals",
                )
            except OSError:  # the log is not worth a verdict
                pass
        return running

    def _clock(self, rank: int, boot: str) -> PeerClock:
        clock = self._clocks.get(rank)
        if clock is None:
            clock = self._clocks[rank] = PeerClock(same_kernel=bool(boot) and boot == boot_id())
        return clock

    def _fetch_info(self, ranks: list[int]) -> str:
        """Host, pid and boot id of newly joined ranks (written once, before they join); returns
        the boot id of the last one."""
        if not ranks:
            return ""
        keys = [f"{self.prefix}/info/{r}" for r in ranks]
        with self._lock:
            if not self.store.check(keys):
                return ""
            values = self.store.multi_get(keys)
        for r, raw in zip(ranks, values):
            self._info[r] = decode_info(raw)
            start = decode_start(raw)
            if start is not None:
                self._starts[r] = start
            block = decode_block(raw)
            if block is not None:
                self._blocks[r] = block
        return self._info[ranks[-1]][2]

    def _report_skew(self, ranks: list[int]) -> None:
        """Clock skew between a rank and the leader, once per rank (and again if it moves by more
        than the threshold): it costs no verdict, but logs with wall times will disagree."""
        limit = self.config.skew_report_s
        for r in ranks:
            clock = self._clocks.get(r)
            if clock is None or clock.skew_s is None or clock.changes < 2:
                continue
            last = self._skew_reported.get(r, 0.0)
            if abs(clock.skew_s) >= limit and abs(clock.skew_s - last) >= limit:
                self._skew_reported[r] = clock.skew_s
                status = self._cache[r][2]
                self.events.write(
                    "clock_skew",
                    rank=r,
                    host=status.host,
                    skew_s=round(clock.skew_s, 3),
                    leader=self.rank,
                    leader_host=self.host,
                    detail=f"rank {r}'s wall clock is {abs(clock.skew_s):.1f}s "
                    f"{'ahead of' if clock.skew_s > 0 else 'behind'} the leader's (rank "
                    f"{self.rank}); verdicts use each rank's monotonic clock, not its wall clock",
                )

    def _watch(self) -> None:
        key = f"{self.prefix}/verdict"
        with self._lock:
            if not self.store.check([key]):
                return
            raw = self.store.get(key).decode()
        if not raw or self._verdict is not None:
            return
        finding = Finding.from_json(json.loads(raw))
        self._verdict = finding  # (answered once: the next pass returns above)
        # (as _respond decides: the loop may take the failure over meanwhile, see hand_over)
        in_job = self._in_job()
        self._failure_called = False
        try:
            self._respond(finding)
        except Exception:
            # what the response does before the exit (the log, a kill, a dump) failed: this rank
            # still goes (the launcher restarts the job), unless in-job recovery takes a peer's
            # failure over; left waiting, it would sit in a collective until its timeout
            log.exception("answering %s failed", finding)
            peer = finding.rank is not None and finding.rank != self.rank
            # (a hand-over since the verdict was read counts, as in _respond: the hook may have
            # been unset when it was read, the monitor started before its Run)
            if not self._failure_called and not ((in_job or self._handed_over) and peer):
                self.on_failure(finding)

    def _respond(self, finding: Finding) -> None:
        leader = self.is_leader
        # in-job recovery: the loop may take the failure over meanwhile (a collective fails once
        # the rank is killed below; see hand_over), or have taken it over already, before this
        # thread read the verdict: it then answers it, not this thread
        in_job = self._in_job()
        if leader:
            self.events.write("verdict", leader=self.rank, **finding.to_json())
        if finding.verdict is not Verdict.HUNG:
            # a dead or frozen rank first: every survivor's collective waits for it to go, and
            # nothing of its is read (a hung one publishes its stack first, below)
            self._kill(finding, leader)
        fr = None
        try:
            fr = flight_recorder.dump(self.rank)
        except Exception as e:  # a failed dump must not stop the response
            self.events.write("flight_recorder", rank=self.rank, error=repr(e))
        if fr is not None:
            self.events.write(
                "flight_recorder",
                rank=self.rank,
                host=self.host,
                path=fr,
                analyse=flight_recorder.ANALYSE_HINT,
            )
        # the event first: once a rank's stack is in the store, the leader may kill that rank
        self.events.write("stacks", rank=self.rank, pid=self.pid, host=self.host, stacks=_stacks())
        awaited = False
        if finding.verdict is Verdict.HUNG:
            stack = main_thread_stack()
            try:
                self._set("stack", json.dumps({"stack": stack, "flight_recorder": fr}))
            except Exception:
                pass
            if leader:
                try:
                    self._attribute(finding, stack, fr)
                finally:  # (the others exit once it is written: see _await_attribution)
                    try:
                        with self._lock:
                            self.store.set(self._key_attributed(finding), str(self.rank))
                    except Exception:
                        pass
            elif self._is_killer(finding) and not in_job:
                # the kill makes the launcher tear the job down, the leader with it: not before
                # the leader has written the attribution (which waited for the stacks); in-job
                # recovery keeps the leader alive, and the spare must not wait
                self._await_attribution(finding)
                awaited = True
            self._kill(finding, leader, stacks_awaited=awaited)  # once the hung rank's stack is in
        hook = self.on_peer_failure
        if hook is not None and finding.rank is not None and finding.rank != self.rank:
            # in-job recovery (resilient launch; Run sets the hook): the failed rank's process is
            # gone or killed, this rank's collectives fail, and it forms the next generation with
            # a spare
            hook(finding)
            return
        if (in_job or self._handed_over) and finding.rank is not None and finding.rank != self.rank:
            return  # the loop's in-job recovery took it over (hand_over): no exit
        if finding.verdict is Verdict.HUNG and not leader and not awaited:
            self._await_attribution(finding)
        self._failure_called = True  # (once: a callback that raises is not called again)
        self.on_failure(finding)

    def _await_attribution(self, finding: Finding) -> bool:
        """(a rank that is not the leader, on HUNG, before it exits or kills) Wait until the
        leader has written the hang's attribution, at most as long as the leader waits for
        stacks and two beats more: the first rank to exit makes the launcher tear the job down,
        the leader with it, and the record would be lost to a rank that answered fast.  One
        round trip a poll (the key names the verdict: a restart may reuse the prefix, not the
        pid), ten polls a beat.  True once it is written."""
        interval = self.config.interval_s
        deadline = time.monotonic() + self.attribution_wait_s()
        key, poll = self._key_attributed(finding), max(0.05, interval / 10)
        while True:
            try:
                with self._lock:
                    if self.store.check([key]):
                        return True
            except Exception:  # the store is gone (the leader's agent): nothing to wait for
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll, left))

    def attribution_wait_s(self) -> float:
        """The longest a rank waits for the leader's attribution of a hang (the leader's own
        wait for stacks, and two beats)."""
        interval = self.config.interval_s
        return max(2.0, 3 * interval) + 2 * interval

    def _key_attributed(self, finding: Finding) -> str:
        return f"{self.prefix}/attributed/{_verdict_id(finding)}"

    def _is_killer(self, finding: Finding) -> bool:
        return self.kill_local and finding.rank is not None and finding.kill_by == self.rank

    def _kill(self, finding: Finding, leader: bool, *, stacks_awaited: bool = False) -> None:
        """SIGKILL the failed rank when the verdict names this rank its killer."""
        if not self._is_killer(finding):
            return
        pid = finding.pid if finding.host == self.host else 0
        if pid and not self._same_process(finding.rank, pid):
            return  # that process is gone: its pid may be another's by now
        if not pid and finding.cause == "never_joined":
            pid = local_rank_pid(finding.rank) or 0  # no pid in the store: find it here
        if (
            pid
            and pid != self.pid
            and finding.verdict is Verdict.HUNG
            and not leader
            and not stacks_awaited
        ):
            # a hung rank publishes its stack for the leader's attribution first (the leader
            # waited for it already)
            try:
                self._wait_for_stacks({finding.rank})
            except Exception:  # the kill matters more than the stack
                pass
        if 0 < pid <= PID_MAX_LIMIT and pid != self.pid:
            # a stopped rank never exits: its agent would never see it fail (torchrun holds
            # the restart 30 s for it; in-job recovery would never give its rank to a spare)
            try:
                os.kill(pid, signal.SIGKILL)
                self.events.write(
                    "killed",
                    rank=finding.rank,
                    pid=pid,
                    by=self.rank,
                    host=self.host,
                    node=self.node,
                )
            except ProcessLookupError:
                pass

    def _same_process(self, rank: int, pid: int) -> bool:
        """Whether ``pid`` is still rank ``rank``'s process (its start time as the rank published
        it); True where that cannot be told (no start time published, no /proc)."""
        if rank not in self._starts:
            try:
                self._fetch_info([rank])
            except Exception:  # the store is going: kill on the pid alone
                return True
        start = self._starts.get(rank)
        return start is None or process_state(pid, start) != "gone"

    def _attribute(self, finding: Finding, own_stack: str, own_fr: str | None) -> None:
        """(the leader, on HUNG) Compare every rank's ring, fetch the Python stacks of the ranks
        it names, and log the attribution.  Waits at most ``max(2 s, 3 intervals)`` for stacks
        (a rank answers at its next beat), beating meanwhile so that no one takes the lead."""
        try:
            ranks = sorted(self._joined) or list(range(self.world_size))
            rings = self._read_rings(ranks)
            att = attribute_hang(rings, self.world_size, time.monotonic())
            want = set(att.culprits)
            if finding.rank is not None:
                want.add(finding.rank)
            published = {self.rank: {"stack": own_stack, "flight_recorder": own_fr}}
            published.update(self._wait_for_stacks(want - {self.rank}))
            stacks = {r: p["stack"] for r, p in published.items() if r in want and p.get("stack")}
            att = attribute_hang(rings, self.world_size, time.monotonic(), stacks)
            record = att.to_json()
            no_stack = sorted(want - set(stacks))
            if no_stack:
                record["no_stack"] = no_stack
            if flight_recorder.buffer_size() > 0:
                record["flight_recorder"] = {
                    "paths": {
                        str(r): p["flight_recorder"]
                        for r, p in sorted(published.items())
                        if p.get("flight_recorder")
                    },
                    "note": "every rank dumps to "
                    + flight_recorder.dump_path("<rank>")
                    + " on its host (its flight_recorder event); analyse with "
                    + flight_recorder.ANALYSE_HINT,
                }
            else:
                record["flight_recorder"] = "off (TORCH_FR_BUFFER_SIZE is not set)"
        except Exception as e:  # the attribution is a courtesy: the response must go on
            self.events.write("hang_attribution", leader=self.rank, error=repr(e))
            return
        self.attribution = record
        self.events.write("hang_attribution", leader=self.rank, verdict_rank=finding.rank, **record)

    def _read_rings(self, ranks: list[int]) -> dict[int, RankRing | None]:
        keys = [f"{self.prefix}/ring/{r}" for r in ranks]
        with self._lock:
            if self.store.check(keys):
                values = dict(zip(ranks, self.store.multi_get(keys)))
            else:  # a rank that joined but never beat with this code: read the others one by one
                values = {
                    r: self.store.get(k) for r, k in zip(ranks, keys) if self.store.check([k])
                }
        rings: dict[int, RankRing | None] = {}
        for r in range(self.world_size):
            raw = values.get(r)
            if not raw:
                rings[r] = None
                continue
            clock = self._clocks.get(r)
            to_local = (lambda t: t) if r == self.rank or clock is None else clock.local
            try:
                rings[r] = decode_summary(raw, r, to_local, self.world_size)
            except Exception:  # whatever a rank published, the others' rings still count
                rings[r] = None
        return rings

    def _wait_for_stacks(self, ranks: set[int]) -> dict[int, dict[str, Any]]:
        interval = self.config.interval_s
        deadline = time.monotonic() + max(2.0, 3 * interval)
        next_beat = time.monotonic() + interval
        got: dict[int, dict[str, Any]] = {}
        todo = sorted(ranks)
        while todo:
            for r in list(todo):
                key = f"{self.prefix}/stack/{r}"
                with self._lock:
                    raw = self.store.get(key) if self.store.check([key]) else None
                if raw is not None:
                    got[r] = decode_stack(raw)
                    todo.remove(r)
            now = time.monotonic()
            if not todo or now > deadline:
                break
            if now >= next_beat:
                self._beat()
                next_beat = now + interval
            time.sleep(0.05)
        return got

    def _exit(self, finding: Finding) -> None:
        self.events.write("exit", rank=self.rank, code=EXIT_RANK_FAILURE, reason=str(finding))
        os._exit(EXIT_RANK_FAILURE)

    # --- store helpers --------------------------------------------------------------------------------
    def _set(self, what: str, value: Any) -> None:
        with self._lock:
            self.store.set(f"{self.prefix}/{what}/{self.rank}", str(value))

    def _phase(self, rank: int) -> str | None:
        key = f"{self.prefix}/progress/{rank}"
        with self._lock:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        try:
            return decode_progress(raw)[1]
        except (ValueError, UnicodeDecodeError):  # not a phase this version knows: none said
            self._note_malformed(rank, "progress", raw)
            return None

    def _leader(self) -> int:
        with self._lock:
            return int(self.store.get(self._key_leader).decode())


class _ErrorSeries:
    """Errors of one kind that repeat (a store gone fails every beat, or every step's progress):
    the first is logged (``monitor_error``), then a count every ``ERROR_SUMMARY_S`` while they go
    on, and the total (``monitor_recovered``) when a call succeeds again.  One thread each."""

    def __init__(self, monitor: Monitor, where: str) -> None:
        self.monitor, self.where = monitor, where  # (its event log may be replaced: Run adopts it)
        self.count = 0  # errors since the last success
        self._since = 0.0  # when the first of them happened
        self._logged = 0.0  # when the series was last logged
        self._unlogged = 0  # errors since then

    @property
    def failing(self) -> bool:
        return self.count > 0

    def failed(self, e: BaseException) -> None:
        now = time.monotonic()
        self.count += 1
        if self.count == 1:
            self._since = self._logged = now
            self._write("monitor_error", error=repr(e))
            if self.where == "heartbeat":  # (the progress series fails alike: said once)
                log.warning(
                    "rank %d: the heartbeat store does not answer (%r): until it does, a failed "
                    "rank is not detected (the job waits for its collective timeout instead); "
                    "is the launcher's agent (torchrun, rank 0's node) still running?",
                    self.monitor.rank,
                    e,
                )
            return
        self._unlogged += 1
        if now - self._logged >= ERROR_SUMMARY_S:
            if self.where == "heartbeat":
                log.warning(
                    "rank %d: the heartbeat store has not answered for %.0fs (%d failures; the "
                    "latest: %r): failed ranks are still not detected",
                    self.monitor.rank,
                    now - self._since,
                    self.count,
                    e,
                )
            self._write(
                "monitor_error",
                error=repr(e),
                repeated=self._unlogged,
                failures=self.count,
                since_s=round(now - self._since, 3),
                detail=f"{self.where}: {self._unlogged} more failures in the last "
                f"{now - self._logged:.0f}s ({self.count} since the first); the latest is shown",
            )
            self._logged, self._unlogged = now, 0

    def ok(self) -> None:
        if not self.count:
            return
        now = time.monotonic()
        if self.where == "heartbeat":
            log.warning(
                "rank %d: the heartbeat store answers again after %.1fs (%d failures); failed "
                "ranks are detected again",
                self.monitor.rank,
                now - self._since,
                self.count,
            )
        self._write(
            "monitor_recovered",
            failures=self.count,
            lasted_s=round(now - self._since, 3),
            detail=f"{self.where}: the store answers again after {self.count} failures",
        )
        self.count, self._unlogged = 0, 0

    def _write(self, event: str, **fields: Any) -> None:
        try:
            self.monitor.events.write(event, rank=self.monitor.rank, where=self.where, **fields)
        except OSError:  # the log is not worth the caller (the training loop, for progress)
            pass


def decode_stack(raw: bytes) -> dict[str, str]:
    """A rank's published stack value (``{"stack": ..., "flight_recorder": path or null}``) as
    ``{"stack", "flight_recorder"}`` where each is a string; another process wrote it (a broken
    rank, another job under the key), so anything else is left out: a value over
    ``MAX_STACK_BYTES`` is not read, a stack over ``MAX_STACK_CHARS`` is cut, and what is not an
    object of strings is no stack (it cost the whole attribution: ``p.get`` on a list)."""
    if len(raw) > MAX_STACK_BYTES:
        return {}
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):  # (a UnicodeDecodeError is a ValueError)
        return {}
    if not isinstance(d, dict):
        return {}
    out = {}
    stack, fr = d.get("stack"), d.get("flight_recorder")
    if isinstance(stack, str) and stack:
        out["stack"] = stack if len(stack) <= MAX_STACK_CHARS else stack[:MAX_STACK_CHARS] + " ..."
    if isinstance(fr, str) and 0 < len(fr) <= MAX_PATH_CHARS:
        out["flight_recorder"] = fr
    return out


def _verdict_id(finding: Finding) -> str:
    """Which verdict an attribution was written for: the rank and its process."""
    return f"{finding.rank}:{finding.pid}"


def encode_info(
    host: str,
    pid: int,
    boot: str,
    node: str = "",
    block: tuple[int, int] | None = None,
    start: int | None = None,
) -> str:
    """``host|pid|boot|node|first:count|start``: what does not change while a rank lives, written
    once when it joins (``node``: ``node_label()``; ``block``: ``node_block()``, empty where none;
    ``start``: ``process_start()``, which tells the process apart from a later one with its pid)."""
    tail = "" if block is None else f"{block[0]}:{block[1]}"
    if start is not None:
        tail += f"|{start}"
    return f"{host}|{pid}|{boot}|{node}|{tail}" if tail else f"{host}|{pid}|{boot}|{node}"


def decode_info(raw: bytes) -> tuple[str, int, str, str]:
    """``encode_info``'s first four fields; a value that is not one (another version's three
    fields, a bad pid) reads as unknown (no host, pid 0) rather than stopping the monitor that
    reads it."""
    try:
        parts = raw.decode().split("|")
        if len(parts) == 3:  # host|pid|boot: no node
            parts.append("")
        host, pid, boot, node = parts[:4]
        # a process id, nothing else: the verdict's killer sends SIGKILL to it, and os.kill
        # reads -1 as every process this user may signal, -N as process group N
        if not (pid.isascii() and pid.isdigit() and 0 < int(pid) <= PID_MAX_LIMIT):
            raise ValueError(f"not a process id: {pid!r:.40}")
        return host, int(pid), boot, node
    except (ValueError, UnicodeDecodeError):
        return "", 0, "", ""


def decode_block(raw: bytes) -> tuple[int, int] | None:
    """``encode_info``'s block (the first rank of the rank's node, and how many it runs), or None
    where there is none or it is not one."""
    try:
        parts = raw.decode().split("|")
        if len(parts) < 5:
            return None
        first, count = (int(x) for x in parts[4].split(":"))
        return (first, count) if first >= 0 and count > 0 else None
    except (ValueError, UnicodeDecodeError):
        return None


def decode_start(raw: bytes) -> int | None:
    """``encode_info``'s process start time, or None where there is none or it is not one."""
    try:
        parts = raw.decode().split("|")
        return int(parts[5]) if len(parts) >= 6 and parts[5] else None
    except (ValueError, UnicodeDecodeError):
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``), or None
    where that cannot be read (no such process, no /proc)."""
    stat = proc_stat(f"/proc/{pid}/stat")
    return None if stat is None else int(stat[19])


def process_state(pid: int, start: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``Z`` zombie...),
    ``"gone"`` when no process with that pid and start time exists, None when /proc cannot say."""
    if not Path("/proc/self/stat").exists():
        return None
    stat = proc_stat(f"/proc/{pid}/stat")
    if stat is None or int(stat[19]) != start:
        return "gone"
    return stat[0]


def process_activity(
    pid: int, start: int, cpu_before: int | None = None
) -> tuple[str, int | None] | None:
    """What process ``pid`` (the one with that start time) is doing, and the CPU time it used so
    far (clock ticks; None when it is gone); None when /proc cannot say.  ``"gone"``;
    ``"stopped"``: exiting, a zombie, stopped or traced; ``"running"``: one of its threads is on a
    CPU or waiting for one (state R), or it used CPU since ``cpu_before``; ``"idle"``: every
    thread asleep (and no CPU used since ``cpu_before``, when given: stuck, a deadlock or the
    cgroup freezer, not starved)."""
    if not Path("/proc/self/stat").exists():
        return None
    stat = proc_stat(f"/proc/{pid}/stat")
    if stat is None or int(stat[19]) != start:
        return "gone", None
    cpu = int(stat[11]) + int(stat[12])  # utime + stime
    if stat[0] in _NOT_RUNNING or int(stat[6]) & _PF_EXITING:
        return "stopped", cpu
    if cpu_before is not None and cpu > cpu_before:
        return "running", cpu
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return "stopped", cpu  # its threads are going: it is exiting
    for task in tasks:
        t = proc_stat(str(task / "stat"))
        if t is not None and t[0] == "R":
            return "running", cpu
    return "idle", cpu


def process_running(
    pid: int, start: int, cpu_before: int | None = None
) -> tuple[bool, int | None] | None:
    """Whether process ``pid`` is running (``process_activity``), and the CPU time it used so
    far; None when /proc cannot say."""
    looked = process_activity(pid, start, cpu_before)
    return None if looked is None else (looked[0] == "running", looked[1])


def process_cpu(pid: int, start: int) -> int | None:
    """The CPU time process ``pid`` (the one with that start time) used so far, in clock ticks;
    None when it is gone or /proc cannot say (one read: not its threads)."""
    stat = proc_stat(f"/proc/{pid}/stat")
    if stat is None or int(stat[19]) != start:
        return None
    return int(stat[11]) + int(stat[12])


def proc_stat(path: str) -> list[str] | None:
    """A ``/proc/.../stat`` file's fields from the state on (the command name, which may hold
    spaces, parentheses or bytes that are not UTF-8, cut off)."""
    try:
        raw = Path(path).read_bytes()
        fields = raw.rsplit(b")", 1)[1].decode("ascii").split()
        int(fields[19])
        return fields
    except (OSError, IndexError, ValueError):
        return None


def node_label() -> str:
    """Which of the host's launcher agents runs this rank: torchelastic's ``GROUP_RANK`` ("" outside
    torchrun).  With one agent per machine it adds nothing to the host name; with several agents on
    one machine (the multi-node tests) it keeps their workers apart as nodes."""
    return os.environ.get("GROUP_RANK", "")


def encode_alive(mono: float, wall: float, interval_s: float | None = None) -> str:
    """``monotonic|wall|interval``: the monotonic time is what the observer maps onto its own clock
    (exactly, when the boot ids say it is the same kernel's); the wall time only serves to report
    skew; the interval is how often this rank beats, so that the leader never times it out on a
    shorter one of its own (ranks take ``Run``'s setting over the early monitor's one by one)."""
    return f"{mono!r}|{wall!r}" + ("" if interval_s is None else f"|{interval_s!r}")


def _progress_of(status: Any) -> tuple[Any, Any, Any, Any, Any]:
    """What a rank's last known status says of its progress: step, phase, time, busy, seq."""
    return status.step, status.phase, status.progress_t, status.busy_s, status.seq


def _finite(text: bytes) -> float:
    """A heartbeat's time: a finite float (a NaN would never age, an infinity age everyone)."""
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"not a finite time: {text!r}")
    return x


def decode_alive(raw: bytes) -> tuple[float, float]:
    mono, wall = raw.split(b"|", 2)[:2]
    return float(mono), float(wall)


def encode_progress(
    step: int | None, phase: str, seq: int, mono: float, busy_s: float | None = None
) -> str:
    """``step|phase|seq|monotonic|busy``: cheaper for the leader to parse than JSON at 4,096
    ranks."""
    busy = "" if busy_s is None else repr(busy_s)
    return f"{'' if step is None else step}|{phase}|{seq}|{mono!r}|{busy}"


def decode_progress(raw: bytes) -> tuple[int | None, str, int, float, float | None]:
    step, phase, seq, mono, busy = raw.decode().split("|", 4)
    return (
        (int(step) if step else None),
        phase,
        int(seq),
        float(mono),
        (float(busy) if busy else None),
    )


# the phases the loop announces, pre-decoded: the leader parses one per rank per interval
_PHASES = {
    p.encode(): p
    for p in (
        "init",
        "rendezvous",
        "setup",
        "restore",
        "first_step",
        "train",
        "checkpoint",
        "commit",
        "eval",
        "done",
        "exiting",
    )
}


def node_block() -> tuple[int, int] | None:
    """This rank's node as a block of ranks: (its first rank, how many it runs), from the
    launcher's environment (torchelastic numbers a node's workers contiguously, whatever each
    node's ``--nproc-per-node``); None outside torchrun or ``resilient launch``."""
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        count = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank - local, count) if 0 <= local < count and rank >= local else None


def local_rank_pid(rank: int) -> int | None:
    """The pid of this torchrun job's worker ``rank`` on this host, found by its launcher
    environment (same run id, restart count and, under ``resilient launch``, rendezvous round),
    for a rank that never published its pid.  A worker's own children inherit that environment:
    the topmost match is the worker (a persister, which may outlive it, never matches).  A spare
    that took the rank has no RANK in its environment: it is not found."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    want = {
        b"RANK=" + str(rank).encode(),
        b"TORCHELASTIC_RUN_ID=" + run_id.encode(),
        b"TORCHELASTIC_RESTART_COUNT=" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").encode(),
    }
    rnd = os.environ.get(ENV_ROUND)
    if rnd is not None:  # resilient launch: a node joining keeps the restart count, not the round
        want.add(f"{ENV_ROUND}={rnd}".encode())
    found: dict[int, int] = {}  # pid -> parent pid
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            env = set((p / "environ").read_bytes().split(b"\0"))
            if not want <= env or PERSISTER_MARK in env:  # a persister outlives its worker
                continue
            found[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    top = [pid for pid, parent in found.items() if parent not in found]
    if not top:
        return None
    from resilient.forkserver import prefer_stand_ins, rank_pid

    # a worker that stands in for a rank its node's fork server started: the rank itself (killing
    # the stand-in would kill it too, but a stack dump must come from the rank); such a rank's
    # children also count as top (the rank's /proc environment is the server's)
    first = prefer_stand_ins(sorted(top))[0]
    return rank_pid(first) or first


def main_thread_stack(limit: int = 12) -> str:
    """The main thread's innermost ``limit`` frames, innermost first, one per line
    (``resilient/chaos/faults.py:210 in _fire``)."""
    main = threading.main_thread()
    if threading.current_thread() is main:
        frame = sys._getframe(1)  # the caller, not this function
    else:
        frame = sys._current_frames().get(main.ident or -1)
    if frame is None:
        return ""
    entries = traceback.extract_stack(frame, limit=limit)
    return "\n".join(f"{_short(e.filename)}:{e.lineno} in {e.name}" for e in reversed(entries))


def _short(path: str) -> str:
    """A source path relative to the ``sys.path`` entry it was imported from
    (``resilient/chaos/faults.py``, ``torch/distributed/distributed_c10d.py``)."""
    best = ""
    for root in sys.path:
        root = (root or os.getcwd()).rstrip(os.sep) + os.sep
        if path.startswith(root) and len(root) > len(best):
            best = root
    return path[len(best) :] if best else path


def _stacks() -> str:
    """Every thread's stack, as faulthandler dumps it; where no temporary file can be made (a
    full disk), as Python formats it: a verdict's response must not stop here."""
    try:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f.read()
    except OSError as e:
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"(faulthandler's dump needs a temporary file: {e}; Python's own format)"]
        for ident, frame in sys._current_frames().items():
            parts.append(f"Thread {ident:#x} ({names.get(ident, '?')}):")
            parts.append("".join(traceback.format_stack(frame)).rstrip())
        return "\n".join(parts)
