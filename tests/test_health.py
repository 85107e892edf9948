"""Failure detection: the pure detector, and monitors heartbeating into a real TCPStore."""

import threading
import time

import pytest
import torch.distributed as dist

from resilient.health import Detector, DetectorConfig, EventLog, Monitor, RankStatus, Verdict


def statuses(now, steps, alive_age=None, progress_age=None):
    alive_age = alive_age or {}
    progress_age = progress_age or {}
    return [
        RankStatus(
            r, now - alive_age.get(r, 0.1), s, "train", now - progress_age.get(r, 0.1), "h", 100 + r
        )
        for r, s in enumerate(steps)
    ]


def test_dead_when_liveness_stops():
    d = Detector(DetectorConfig(interval_s=1.0, dead_after_intervals=2))
    now = 1000.0
    assert d.observe(statuses(now, [5, 5, 5]), now) == []
    out = d.observe(statuses(now, [5, 5, 5], alive_age={1: 2.5}), now)
    assert [(f.verdict, f.rank) for f in out] == [(Verdict.DEAD, 1)]
    assert "no liveness heartbeat for 2.5s" in out[0].detail and out[0].pid == 101


def test_hung_when_behind_waiting_peers_and_group_stall():
    d = Detector(DetectorConfig(hang_timeout_s=10.0, first_step_budget_s=0.0))
    now = 1000.0
    out = d.observe(statuses(now, [8, 7, 8], progress_age={0: 12, 1: 15, 2: 12}), now)
    assert [(f.verdict, f.rank) for f in out] == [(Verdict.HUNG, 1)]
    assert "while peers reached step 8" in out[0].detail
    out = d.observe(statuses(now, [8, 8, 8], progress_age={0: 12, 1: 15, 2: 11}), now)
    assert [(f.verdict, f.rank) for f in out] == [(Verdict.HUNG, None)]
    assert (
        d.observe(statuses(now, [8, 8, 8], progress_age={0: 5, 1: 15, 2: 5}), now) == []
    )  # peers still working


def test_hang_timeout_is_calibrated_from_step_times_and_phases_have_budgets():
    cfg = DetectorConfig(hang_factor=5.0, hang_floor_s=1.0, phase_budgets_s={"checkpoint": 100.0})
    d = Detector(cfg)
    t = 0.0
    for step in range(1, 20):  # every rank takes 2 s per step
        t += 2.0
        d.observe([RankStatus(r, t, step, "train", t) for r in range(2)], t)
    assert d.hang_timeout_s() == pytest.approx(10.0)
    now = t + 30
    ckpt = [RankStatus(0, now, 19, "checkpoint", t), RankStatus(1, now, 20, "train", now)]
    assert d.observe(ckpt, now) == []  # 30 s in a checkpoint: within its 100 s budget
    hung = [RankStatus(0, now, 19, "train", t), RankStatus(1, now, 20, "train", now)]
    assert [f.verdict for f in d.observe(hung, now)] == [Verdict.HUNG]


def test_only_the_step_the_loop_calls_first_gets_the_first_step_budget():
    cfg = DetectorConfig(hang_timeout_s=3.0, first_step_budget_s=300.0)
    d = Detector(cfg)
    now = 100.0
    # the leader's first look at rank 1 finds it at step 12, already stuck for 5 s: that is a
    # hang, not a first step, however late the leader started watching
    late = [RankStatus(0, now, 13, "train", now), RankStatus(1, now, 12, "train", now - 5)]
    assert [f.verdict for f in Detector(cfg).observe(late, now)] == [Verdict.HUNG]
    first = [RankStatus(0, now, 2, "train", now), RankStatus(1, now, 1, "first_step", now - 60)]
    assert d.observe(first, now) == []  # 60 s into its first step: within the budget


def test_straggler_reported_after_consecutive_windows():
    d = Detector(DetectorConfig(straggler_factor=2.0, straggler_windows=3, hang_timeout_s=1e9))
    t = {r: 0.0 for r in range(4)}
    found = []
    for step in range(1, 12):
        for r in range(4):
            t[r] += 3.0 if r == 3 else 1.0
        now = max(t.values())
        found += d.observe([RankStatus(r, now, step, "train", t[r]) for r in range(4)], now)
    assert [(f.verdict, f.rank) for f in found] == [(Verdict.STRAGGLER, 3)]
    assert "3.0x slower than the median rank" in found[0].detail


class Sim:
    """Four monitors, one per simulated rank, heartbeating into one TCPStore."""

    def __init__(self, tmp_path, world=4, **cfg):
        self.server = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
        self.events = EventLog(str(tmp_path / "events.jsonl"))
        self.failures: dict[int, list] = {r: [] for r in range(world)}
        config = DetectorConfig(interval_s=0.1, dead_after_intervals=3, hang_floor_s=0.5, **cfg)
        self.monitors = []
        for r in range(world):
            client = dist.TCPStore("127.0.0.1", self.server.port, world + 1, False)
            self.monitors.append(
                Monitor(
                    client,
                    "run/0",
                    r,
                    world,
                    config,
                    events=self.events,
                    on_failure=self.failures[r].append,
                    kill_local=False,
                )
            )

    def wait_for(self, cond, timeout=10.0):
        end = time.time() + timeout
        while time.time() < end:
            if cond():
                return True
            time.sleep(0.02)
        return False

    def close(self):
        for m in self.monitors:
            m.close()


def drive(monitor, steps, period, stop):
    for step in steps:
        if stop.is_set():
            return
        monitor.progress(step, "train")
        time.sleep(period)


def test_a_rank_whose_heartbeat_stops_is_declared_dead_everywhere(tmp_path):
    sim = Sim(tmp_path)
    try:
        sim.monitors[2].close(announce=False)  # it goes quiet, as in a SIGSTOP or SIGKILL
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (0, 1, 3)))
        for r in (0, 1, 3):
            f = sim.failures[r][0]
            assert f.verdict is Verdict.DEAD and f.rank == 2
        events = sim.events.read()
        assert any(e["event"] == "verdict" and e["rank"] == 2 for e in events)
        stacks = [e for e in events if e["event"] == "stacks"]
        assert {e["rank"] for e in stacks} >= {0, 1, 3}
        assert all("most recent call first" in e["stacks"] for e in stacks)  # faulthandler's dump
    finally:
        sim.close()


def test_a_rank_that_stops_progressing_while_peers_wait_is_hung(tmp_path):
    sim = Sim(tmp_path, hang_timeout_s=0.4)
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=drive, args=(m, range(1, 8) if r == 1 else range(1, 1000), 0.05, stop)
        )
        for r, m in enumerate(sim.monitors)
    ]
    for t in threads:
        t.start()
    try:
        assert sim.wait_for(lambda: sim.failures[0])
        f = sim.failures[0][0]
        assert f.verdict is Verdict.HUNG and f.rank == 1 and f.last_step == 7
    finally:
        stop.set()
        sim.close()


def test_clean_run_with_short_pauses_and_a_straggler_gets_no_verdict(tmp_path):
    sim = Sim(tmp_path, hang_timeout_s=1.0)
    stop = threading.Event()
    threads = [
        threading.Thread(target=drive, args=(m, range(1, 1000), 0.12 if r == 3 else 0.04, stop))
        for r, m in enumerate(sim.monitors)
    ]
    for t in threads:
        t.start()
    try:
        assert sim.wait_for(
            lambda: any(e["event"] == "straggler" for e in sim.events.read()), timeout=15
        )
        assert all(not f for f in sim.failures.values())  # reported, never killed
        straggler = [e for e in sim.events.read() if e["event"] == "straggler"]
        assert straggler[0]["rank"] == 3
    finally:
        stop.set()
        sim.close()


def test_ranks_that_finish_are_not_declared_dead(tmp_path):
    sim = Sim(tmp_path)
    try:
        sim.monitors[0].close()  # the leader finishes first, the others a little later
        sim.monitors[2].close()
        assert sim.wait_for(lambda: sim.monitors[1].is_leader)
        time.sleep(1.0)  # many heartbeat intervals
        assert all(not f for f in sim.failures.values())
    finally:
        sim.close()


def test_a_dead_leader_is_replaced_and_the_verdict_still_comes(tmp_path):
    sim = Sim(tmp_path)
    try:
        sim.monitors[0].close(announce=False)  # the leader dies
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (1, 2, 3)))
        assert sim.monitors[1].is_leader
        assert all(
            sim.failures[r][0].rank == 0 and sim.failures[r][0].verdict is Verdict.DEAD
            for r in (1, 2, 3)
        )
        assert any(e["event"] == "leader" and e["rank"] == 1 for e in sim.events.read())
    finally:
        sim.close()
