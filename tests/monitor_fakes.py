"""Monitors without a TCPStore or a real clock: the tests drive their beats and scans.

``DictStore`` answers the c10d store calls a monitor makes, in memory, and can fail every call (a
store gone) or run a hook before a read answers (a slow read); ``fake_time`` replaces the clock of
``resilient.health.heartbeat`` only; ``quiet_monitors`` starts monitors whose heartbeat threads
are stopped at once."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable

import resilient.health.heartbeat as hb
from resilient.health import DetectorConfig, EventLog, Monitor


class DictStore:
    """The c10d store calls the monitor makes (no ``clone``: no verdict waiter)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.fail = False  # every call raises, as a store whose server is gone
        self.calls = 0
        self.on_get: Callable[[str], None] | None = None  # runs before a get answers

    def _check_up(self) -> None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("store down (connection reset by peer)")

    @staticmethod
    def _b(v: object) -> bytes:
        return v if isinstance(v, bytes) else str(v).encode()

    def set(self, k: str, v: object) -> None:
        self._check_up()
        with self.lock:
            self.d[k] = self._b(v)

    def get(self, k: str) -> bytes:
        self._check_up()
        if self.on_get is not None:
            self.on_get(k)
        with self.lock:
            return self.d[k]

    def check(self, keys: list[str]) -> bool:
        self._check_up()
        with self.lock:
            return all(k in self.d for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._check_up()
        with self.lock:
            return [self.d[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[object]) -> None:
        self._check_up()
        with self.lock:
            for k, v in zip(keys, values):
                self.d[k] = self._b(v)

    def compare_set(self, k: str, expected: object, desired: object) -> bytes:
        self._check_up()
        expected, desired = self._b(expected), self._b(desired)
        with self.lock:
            cur = self.d.get(k)
            if cur is None:
                if expected == b"":
                    self.d[k] = desired
                    return desired
                return expected
            if cur == expected:
                self.d[k] = desired
                return desired
            return cur

    def append(self, k: str, v: object) -> None:
        self._check_up()
        with self.lock:
            self.d[k] = self.d.get(k, b"") + self._b(v)

    def delete_key(self, k: str) -> bool:
        self._check_up()
        with self.lock:
            return self.d.pop(k, None) is not None


class FakeClock:
    """Monotonic time ``t``; the wall clock is ``t`` plus 1.7e9."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t


def fake_time(monkeypatch) -> FakeClock:  # type: ignore[no-untyped-def]
    """Replace the clock of ``resilient.health.heartbeat`` (only) with a ``FakeClock``."""
    clock = FakeClock()
    fake = types.SimpleNamespace(
        monotonic=lambda: clock.t,
        time=lambda: clock.t + 1.7e9,
        perf_counter=time.perf_counter,
        sleep=time.sleep,
    )
    monkeypatch.setattr(hb, "time", fake)
    return clock


def quiet_monitors(
    store: DictStore,
    world_size: int,
    config: DetectorConfig,
    ranks: list[int] | None = None,
    events: EventLog | None = None,
) -> dict[int, Monitor]:
    """Monitors of ranks ``ranks`` (default: all) whose heartbeat threads are stopped at once:
    the test calls ``_beat``, ``_scan`` and ``_maybe_take_over`` itself."""
    monitors = {}
    for r in range(world_size) if ranks is None else ranks:
        m = Monitor(
            store,
            "run/0",
            r,
            world_size,
            config,
            kill_local=False,
            ring=None,
            events=events or EventLog(None),
            on_failure=lambda f: None,
        )
        m._stop.set()
        m._wake.set()
        m._thread.join(timeout=5)
        monitors[r] = m
    return monitors
