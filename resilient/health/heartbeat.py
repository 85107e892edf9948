"""Heartbeats through the c10d store, the leader's scan, and what every rank does on a verdict.

Every rank runs one daemon thread ("resilient-heartbeat") that, each interval, publishes its
liveness, and reads two keys: the verdict and the leader's liveness (O(1) per rank).  The leader
(rank 0; if its heartbeat stops, the next live rank takes over with an atomic compare-and-set)
also reads every rank's keys in one batch, runs the Detector and publishes a verdict (O(world)).
The loop publishes progress (step, phase) from its own thread.

On DEAD or HUNG every live rank writes its Python stacks (faulthandler) and the failure record to
the event log, the leader SIGKILLs a hung or frozen rank on its own host (torchrun waits 30 s for
a stopped process otherwise), and every rank exits with ``EXIT_RANK_FAILURE`` so that torchrun
(``--max-restarts``) restarts the group, which resumes from the newest committed checkpoint.  A rank
blocked inside a collective cannot be interrupted from Python: exiting is the reliable way.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from resilient.health.detector import (
    GONE_PHASES,
    Detector,
    DetectorConfig,
    Finding,
    RankStatus,
    Verdict,
)
from resilient.health.events import EventLog

__all__ = ["Monitor", "EXIT_RANK_FAILURE"]

# sysexits EX_TEMPFAIL: "try again" - a peer failed and the group must restart.
EXIT_RANK_FAILURE = 75


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
    ) -> None:
        self.store, self.prefix, self.rank, self.world_size = (
            store,
            prefix.rstrip("/"),
            rank,
            world_size,
        )
        self.config = config or DetectorConfig()
        self.detector = Detector(self.config)
        self.events = events or EventLog(None)
        self.on_failure = on_failure or self._exit
        self.kill_local = kill_local
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._lock = threading.Lock()  # one store client, several threads
        self._stop = threading.Event()
        self._verdict: Finding | None = None
        self._reported: set[tuple[str, int | None]] = set()
        self.scans = 0
        self.last_scan_s = 0.0
        self._all_present = False
        self._set("alive", time.time())
        self.progress(None, "start")
        self._key_leader = f"{self.prefix}/leader"
        with self._lock:
            self.store.compare_set(self._key_leader, "", "0")
        self._thread = threading.Thread(target=self._loop, name="resilient-heartbeat", daemon=True)
        self._thread.start()

    # --- what the loop calls ------------------------------------------------------------------
    def progress(self, step: int | None, phase: str, busy_s: float | None = None) -> None:
        """Announce ``step`` and ``phase``; ``busy_s``: the time this rank computed in its last
        step, without waiting in collectives (what tells a straggler apart in a synchronous job,
        where every rank's step takes equally long)."""
        self._set(
            "progress", encode_progress(step, phase, time.time(), self.host, self.pid, busy_s)
        )

    def leaving(self, step: int | None) -> None:
        """Say this rank is being stopped by its launcher (not failing by itself), so that no
        verdict blames it and a leader's place passes on at once."""
        try:
            self.progress(step, "exiting")
        except Exception:  # the store may be gone already
            pass

    def verdict(self) -> Finding | None:
        return self._verdict

    def close(self, *, announce: bool = True) -> None:
        """Stop heartbeating.  With ``announce`` (a normal end), say "done" first, so that peers
        still finishing do not take the silence for a death; without it the rank just goes quiet,
        as a killed one does."""
        if announce and not self._stop.is_set() and self._verdict is None:
            try:
                self.progress(None, "done")
            except Exception:  # the store may be gone at shutdown
                pass
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5 * self.config.interval_s)

    @property
    def is_leader(self) -> bool:
        return self._leader() == self.rank

    # --- the heartbeat thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self._set("alive", time.time())
                self._maybe_take_over()
                if self.is_leader:
                    self._scan()
                self._watch()
            except Exception as e:  # the store going away ends monitoring, not the run
                self.events.write("monitor_error", rank=self.rank, error=repr(e))
                if self._stop.wait(self.config.interval_s):
                    return

    def _maybe_take_over(self) -> None:
        leader = self._leader()
        if leader == self.rank:
            return
        alive = self._get_float(f"alive/{leader}")
        done = self._phase(leader) in GONE_PHASES
        # the next rank after the leader takes over first; rank leader+k waits k timeouts
        distance = (self.rank - leader - 1) % self.world_size + 1
        if done or (
            alive is not None and time.time() - alive > distance * self.config.dead_timeout_s
        ):
            with self._lock:
                got = self.store.compare_set(self._key_leader, str(leader), str(self.rank)).decode()
            if got == str(self.rank):
                self.events.write("leader", rank=self.rank, replaced=leader)

    def _scan(self) -> None:
        t0 = time.perf_counter()
        keys = [f"{self.prefix}/alive/{r}" for r in range(self.world_size)]
        keys += [f"{self.prefix}/progress/{r}" for r in range(self.world_size)]
        with self._lock:
            if not self._all_present:  # once every rank has started, its keys stay
                self._all_present = self.store.check(keys)
            values = self.store.multi_get(keys) if self._all_present else None
        if values is None:
            return  # some rank has not started yet
        n = self.world_size
        statuses = [
            RankStatus(r, float(values[r]), *decode_progress(values[n + r])) for r in range(n)
        ]
        findings = self.detector.observe(statuses, time.time())
        self.scans += 1
        self.last_scan_s = time.perf_counter() - t0
        for f in findings:
            tag = (f.verdict.value, f.rank)
            if f.verdict is Verdict.STRAGGLER:
                if tag not in self._reported:
                    self._reported.add(tag)
                    self.events.write("straggler", **f.to_json())
                continue
            with self._lock:
                self.store.compare_set(f"{self.prefix}/verdict", "", json.dumps(f.to_json()))
            break

    def _watch(self) -> None:
        key = f"{self.prefix}/verdict"
        with self._lock:
            if not self.store.check([key]):
                return
            raw = self.store.get(key).decode()
        if not raw or self._verdict is not None:
            return
        d = json.loads(raw)
        finding = Finding(
            Verdict(d["verdict"]),
            d["rank"],
            d["host"],
            d["pid"],
            d["last_step"],
            d["phase"],
            d["seconds_since_progress"],
            d["seconds_since_alive"],
            d["detail"],
        )
        self._verdict = finding
        self._respond(finding)

    def _respond(self, finding: Finding) -> None:
        if self.is_leader:
            self.events.write("verdict", leader=self.rank, **finding.to_json())
        self.events.write("stacks", rank=self.rank, pid=self.pid, host=self.host, stacks=_stacks())
        if (
            self.is_leader
            and self.kill_local
            and finding.rank is not None
            and finding.rank != self.rank
            and finding.host == self.host
            and finding.pid
        ):
            try:  # a frozen rank would hold torchrun's restart for 30 s
                os.kill(finding.pid, signal.SIGKILL)
                self.events.write("killed", rank=finding.rank, pid=finding.pid)
            except ProcessLookupError:
                pass
        self.on_failure(finding)

    def _exit(self, finding: Finding) -> None:
        self.events.write("exit", rank=self.rank, code=EXIT_RANK_FAILURE, reason=str(finding))
        os._exit(EXIT_RANK_FAILURE)

    # --- store helpers --------------------------------------------------------------------------------
    def _set(self, what: str, value: Any) -> None:
        with self._lock:
            self.store.set(f"{self.prefix}/{what}/{self.rank}", str(value))

    def _get_float(self, what: str) -> float | None:
        key = f"{self.prefix}/{what}"
        with self._lock:
            if not self.store.check([key]):
                return None
            return float(self.store.get(key).decode())

    def _phase(self, rank: int) -> str | None:
        key = f"{self.prefix}/progress/{rank}"
        with self._lock:
            if not self.store.check([key]):
                return None
            return decode_progress(self.store.get(key))[1]

    def _leader(self) -> int:
        with self._lock:
            return int(self.store.get(self._key_leader).decode())


def encode_progress(
    step: int | None, phase: str, t: float, host: str, pid: int, busy_s: float | None = None
) -> str:
    """``step|phase|time|host|pid|busy``: cheaper for the leader to parse than JSON at 4,096
    ranks."""
    busy = "" if busy_s is None else repr(busy_s)
    return f"{'' if step is None else step}|{phase}|{t!r}|{host}|{pid}|{busy}"


def decode_progress(raw: bytes) -> tuple[int | None, str, float, str, int, float | None]:
    step, phase, t, host, pid, busy = raw.decode().split("|", 5)
    return (
        (int(step) if step else None),
        phase,
        float(t),
        host,
        int(pid),
        (float(busy) if busy else None),
    )


def _stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()
