"""Failure detection: the pure detector, and monitors heartbeating into a real TCPStore."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import resilient.health.heartbeat as heartbeat_module
from resilient.health import Detector, DetectorConfig, EventLog, Monitor, RankStatus, Verdict
from resilient.health.clocks import PeerClock
from resilient.health.detector import Finding
from resilient.health.heartbeat import (
    boot_id,
    decode_block,
    decode_info,
    decode_start,
    encode_alive,
    encode_info,
    process_running,
    process_start,
    process_state,
)
from resilient.launch import free_port
from tests.monitor_fakes import DictStore, fake_time, quiet_monitors


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


def test_start_up_phases_get_a_longer_liveness_timeout():
    """Imports and model building starve a heartbeat thread on a loaded machine; a training step
    does not.  So a start-up phase gets startup_dead_after_intervals, the rest dead_after."""
    d = Detector(
        DetectorConfig(interval_s=1.0, dead_after_intervals=2, startup_dead_after_intervals=5)
    )
    now = 1000.0

    def rank1(phase, age):
        return [
            RankStatus(0, now, 3, "train", now, "h", 100, seq=9),
            RankStatus(1, now - age, None if phase == "setup" else 3, phase, now - age, "h", 101),
        ]

    assert d.observe(rank1("setup", 3.0), now) == []
    out = d.observe(rank1("setup", 5.5), now)
    assert [(f.verdict, f.rank, f.timeout_s) for f in out] == [(Verdict.DEAD, 1, 5.0)]
    assert "(timeout 5.0s in phase setup)" in out[0].detail
    assert [f.verdict for f in d.observe(rank1("train", 3.0), now)] == [Verdict.DEAD]
    with pytest.raises(ValueError, match="startup_dead_after_intervals"):
        DetectorConfig(dead_after_intervals=3, startup_dead_after_intervals=2)


def test_a_rank_is_judged_on_the_interval_its_heartbeat_says_when_longer():
    """Ranks take Run's heartbeat interval over the early monitor's one by one: a leader already
    on 0.25 s judged a rank still beating every 1.5 s on 0.25 s, and declared it DEAD between
    two of its beats."""
    d = Detector(DetectorConfig(interval_s=0.25, dead_after_intervals=4))
    now = 1000.0

    def two(age: float, says: float | None) -> list[RankStatus]:
        return [
            RankStatus(0, now, 3, "train", now, "h", 100),
            RankStatus(1, now - age, 3, "train", now, "h", 101, interval_s=says),
        ]

    assert d.observe(two(2.0, 1.5), now) == []  # within 4 of its 1.5 s beats
    out = d.observe(two(6.5, 1.5), now)
    assert [(f.verdict, f.rank, f.timeout_s) for f in out] == [(Verdict.DEAD, 1, 6.0)]
    # a shorter interval than the leader's, or none said (an older version): the leader's own
    assert [f.timeout_s for f in d.observe(two(1.5, 0.05), now)] == [1.0]
    assert [f.timeout_s for f in d.observe(two(1.5, None), now)] == [1.0]


def test_a_heartbeat_says_its_interval_and_one_without_it_still_parses():
    m = Monitor.__new__(Monitor)  # only the parser, which needs no store
    m._intervals, m._interval_text, m._malformed = {}, {}, set()
    m.events, m.rank = EventLog(None), 0
    assert m._parse_alive(1, encode_alive(5.0, 7.0, 1.5).encode()) == (5.0, b"7.0")
    assert m._intervals[1] == 1.5
    assert m._parse_alive(2, encode_alive(5.0, 7.0).encode()) == (5.0, b"7.0")
    assert m._intervals[2] is None
    for bad in (b"5.0|7.0|nan", b"5.0|7.0|-1.0", b"5.0|7.0|x"):
        assert m._parse_alive(3, bad) == (5.0, b"7.0") and m._intervals[3] is None


def test_a_reconfigured_monitor_beats_on_the_new_interval_at_once(tmp_path):
    """Run adopts the monitor resilient.launch.init_process_group started: its interval used to
    be read once, when the heartbeat thread started, so the rank went on beating on the old
    one while the leader judged it on the new one."""
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False)
    m = Monitor(client, "run/0", 0, 1, DetectorConfig(interval_s=30.0), kill_local=False)
    try:
        key = "run/0/alive/0"
        assert _wait(lambda: server.check([key]), 30.0)
        first = server.get(key)
        m.reconfigure(DetectorConfig(interval_s=0.1))
        seen = {first}
        # (30 s beats: without the change, no second value would come within the bound)
        assert _wait(lambda: seen.add(server.get(key)) or len(seen) >= 4, 20.0)
        assert all(v.endswith(b"|0.1") for v in seen - {first})
    finally:
        m.close()


ADOPTION = """
import os, sys, time
rank, port, log, delay = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                  TORCHELASTIC_RUN_ID="adopt", TORCHELASTIC_USE_AGENT_STORE="True",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GROUP_RANK="0")
import torch
import resilient.launch as launch
from resilient import Run
from resilient.health import DetectorConfig
launch.init_process_group("gloo", detector=DetectorConfig(interval_s=6.0))
time.sleep(delay)  # rank 1 takes Run's interval late: until then it beats every 6 s
with Run(None, heartbeat_interval_s=0.5, event_log=log) as run:
    run.track(x=torch.zeros(1))
    for step in run.steps(60):
        time.sleep(0.1)
print("finished", flush=True)
"""


def test_run_adopting_the_early_monitor_brings_no_false_verdict(tmp_path):
    """resilient.launch.init_process_group starts a monitor (6 s beats here) that Run adopts with
    its own settings (0.5 s): a rank still before its Run beat every 6 s while the leader,
    already in its own, judged it on 0.5 s intervals, and declared it DEAD.  (That the adopted
    monitor beats on the new interval at once: test_a_reconfigured_monitor_beats_on_...)"""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    log = tmp_path / "events.jsonl"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADOPTION, str(r), str(port), str(log), str(7.0 * r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    del server
    verdicts = [e for e in EventLog(str(log)).read() if e["event"] in ("verdict", "exit")]
    assert [p.returncode for p in procs] == [0, 0] and not verdicts, (outs, verdicts)


def test_a_heartbeat_store_that_stops_answering_is_warned_about(tmp_path, caplog):
    """The agent's store gone: detection is off until it answers again.  That was only an event
    in the event log, which a job checkpointing to S3 has none of: nothing said a failed rank
    would now be found by the collective timeout alone."""
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=2))
        m = Monitor(client, "run/0", 0, 1, DetectorConfig(interval_s=0.1), kill_local=False)
        try:
            assert _wait(lambda: client.check(["run/0/alive/0"]), 30.0)  # (a first beat)
            with caplog.at_level("WARNING", logger="resilient.health.heartbeat"):
                server.kill()
                server.wait()
                assert _wait(lambda: "the heartbeat store does not answer" in caplog.text, 60.0)
            assert "failed rank is not detected" in caplog.text
        finally:
            m.close(announce=False)
    finally:
        server.kill()
        server.wait()


STORE_SERVER = """
import time
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
print(s.port, flush=True)
time.sleep(600)
"""


def _wait(cond, timeout_s: float) -> bool:
    """Poll for an event (the bound only ends a broken test)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(
    "field, value",
    [
        ("startup_dead_after_intervals", float("nan")),
        ("running_dead_after_intervals", float("nan")),
        ("hang_factor", 0),
        ("hang_floor_s", -1),
        ("hang_floor_s", False),
        ("first_step_budget_s", float("inf")),
        ("straggler_factor", 1.0),
        ("straggler_windows", 0),
        ("window", True),
        ("phase_budgets_s", {"eval": True}),
        ("phase_budgets_s", {"eval": "5"}),
        ("phase_budgets_s", {"eval": float("inf")}),
        ("phase_budgets_s", {"": 5.0}),
        ("phase_budgets_s", [("eval", 5.0)]),
    ],
)
def test_detector_settings_that_are_not_numbers_of_their_kind_are_refused(field, value):
    """NaN multipliers passed the "at least dead_after_intervals" comparison (a rank in start-up
    would never be DEAD); a budget of True was 1 s, of "5" a bare TypeError."""
    with pytest.raises(ValueError, match=re.escape(field)):
        DetectorConfig(**{field: value})


def test_a_silent_rank_whose_process_still_runs_gets_the_longer_running_timeout():
    """A heartbeat thread starved on a loaded machine (or behind native code holding the GIL) is
    not a dead rank, and a restart would not cure it: the leader, seeing the process running on
    its own machine, waits running_dead_after_intervals; a gone or stopped one, the usual."""
    asked = []

    def running(s):
        asked.append(s.rank)
        return {1: True, 2: False}.get(s.rank)  # 3: on another machine

    cfg = DetectorConfig(interval_s=1.0, dead_after_intervals=2, running_dead_after_intervals=6)
    d = Detector(cfg, running=running)
    now = 1000.0
    out = d.observe(statuses(now, [5, 5, 5, 5], alive_age={1: 3.0, 2: 3.0, 3: 3.0}), now)
    assert [(f.verdict, f.rank, f.timeout_s) for f in out] == [
        (Verdict.DEAD, 2, 2.0),
        (Verdict.DEAD, 3, 2.0),
    ]
    assert sorted(set(asked)) == [1, 2, 3]  # only the overdue ranks are looked at
    assert d.observe(statuses(now, [5, 5, 5, 5], alive_age={1: 3.0}), now) == []
    assert d.observe(statuses(now, [5, 5, 5, 5], alive_age={1: 5.9}), now) == []
    out = d.observe(statuses(now, [5, 5, 5, 5], alive_age={1: 6.5}), now)
    assert [(f.verdict, f.rank, f.timeout_s) for f in out] == [(Verdict.DEAD, 1, 6.0)]
    assert "for 6.5s although its process is running" in out[0].detail
    with pytest.raises(ValueError, match="running_dead_after_intervals"):
        DetectorConfig(dead_after_intervals=3, running_dead_after_intervals=2)


def test_a_late_rank_is_probed_half_an_interval_before_it_is_judged():
    """From its timeout less one and a half intervals to its timeout less half an interval (a
    window an interval long: one of the leader's scans falls into it), a silent rank's process
    gets a first look (its CPU time noted), so that at the timeout "used CPU since" can tell a
    starved process from a stuck one; ranks on time, or nearly or already overdue, are not."""
    probed = []
    cfg = DetectorConfig(interval_s=1.0, dead_after_intervals=4)
    d = Detector(cfg, running=lambda s: None, probe=lambda s: probed.append(s.rank))
    now = 1000.0
    ages = {0: 2.4, 1: 2.6, 2: 3.5, 3: 3.6, 4: 4.5}  # timeout 4 s: probed from 2.5 s to 3.5 s
    d.observe(statuses(now, [5] * 5, alive_age=ages), now)
    assert probed == [1, 2]


def test_no_rank_is_dead_until_it_could_beat_after_the_leader_itself_was_starved():
    """The leader's own loop woke late: the machine stalled, every heartbeat thread with it, and
    the leader looks before they ran again.  A rank whose timeout ran out during the stall gets an
    interval from its end to beat; nothing else is judged meanwhile (a silent rank must not pass
    for a hung one); a rank already overdue before the stall, or after a later stall, gets none."""
    d = Detector(DetectorConfig(interval_s=1.0, dead_after_intervals=2, hang_timeout_s=10.0))
    now = 1000.0
    stall = (now - 1.5, now - 0.5)  # rank 1 beat at 997, due at 999: during the stall
    quiet = statuses(now, [5, 5, 5], alive_age={1: 3.0, 2: 3.0}, progress_age={1: 30.0})
    quiet[1] = RankStatus(1, now - 3.0, 4, "train", now - 30.0, "h", 101)  # behind, no progress
    assert d.observe(quiet, now, stalled=stall) == []  # not DEAD yet, and not HUNG either
    assert d.next_deadline == pytest.approx(now + 0.5)
    later = now + 0.6  # rank 2 beat when the stall ended; rank 1 did not
    out = d.observe(statuses(later, [5, 5, 5], alive_age={1: 3.6}), later, stalled=stall)
    assert [(f.verdict, f.rank) for f in out] == [(Verdict.DEAD, 1)]
    assert [f.rank for f in d.observe(quiet, now)] == [1, 2]  # no stall: judged at once
    overdue_before = (now - 0.9, now - 0.5)  # rank 1's timeout ran out at 999, before it
    assert [f.rank for f in d.observe(quiet, now, stalled=overdue_before)] == [1, 2]
    # a leader that stalls at every look still judges: the grace is for the stall the rank's
    # timeout ran out in, and the next stall begins after that
    d = Detector(DetectorConfig(interval_s=1.0, dead_after_intervals=2))
    alive = now - 2.2  # due at now - 0.2, inside the stall below
    assert d.observe(statuses(now, [5, 5], alive_age={1: 2.2}), now, stalled=(now - 0.6, now)) == []
    wake = d.next_deadline
    assert wake == pytest.approx(now + 1.0)
    t = wake + 0.6  # late again
    out = d.observe(statuses(t, [5, 5], alive_age={1: t - alive}), t, stalled=(wake, t))
    assert [(f.verdict, f.rank) for f in out] == [(Verdict.DEAD, 1)]


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


def test_a_rank_that_never_registers_is_dead_after_the_join_timeout():
    d = Detector(DetectorConfig(join_timeout_s=10.0), start=100.0)
    missing = RankStatus(1, None, None, "unregistered")

    def ranks(now):
        return [RankStatus(0, now - 0.1, None, "rendezvous", 101.0, "h", 1, seq=2), missing]

    assert d.observe(ranks(105.0), 105.0) == []  # still within the join timeout
    out = d.observe(ranks(110.5), 110.5)
    assert [(f.verdict, f.rank, f.cause) for f in out] == [(Verdict.DEAD, 1, "never_joined")]
    assert "never joined: no heartbeat registered 10.5s after the leader started" in out[0].detail
    assert out[0].timeout_s == 10.0 and out[0].waited_s == 10.5


@pytest.mark.parametrize(
    "phase,peers",
    [("init", "rendezvous"), ("restore", "first_step"), ("commit", "done-ish")],
    ids=["stuck-before-the-rendezvous", "stuck-in-a-restore", "stuck-in-a-commit"],
)
def test_every_phase_before_and_around_steps_has_a_budget(phase, peers):
    """A rank stuck in a start-up phase, a restore or a commit, while its peers went further (a
    higher progress sequence number: there is no step yet to compare), is HUNG after that phase's
    budget, and named with its phase."""
    budgets = {"init": 5.0, "restore": 20.0, "commit": 30.0}
    d = Detector(DetectorConfig(phase_budgets_s={phase: budgets[phase]}, hang_timeout_s=1e9))
    step = 10 if phase == "commit" else None
    stuck_since = 100.0

    def look(now):
        peer_phase = "train" if peers == "done-ish" else peers
        peer_step = 11 if phase == "commit" else (1 if peers == "first_step" else None)
        return d.observe(
            [
                RankStatus(0, now, peer_step, peer_phase, now - 0.5, "h", 10, seq=9),
                RankStatus(1, now, step, phase, stuck_since, "h", 11, seq=6),
                RankStatus(2, now, peer_step, peer_phase, now - 0.5, "h", 12, seq=9),
            ],
            now,
        )

    assert look(stuck_since + budgets[phase] - 1) == []  # within its budget
    out = look(stuck_since + budgets[phase] + 1)
    assert [(f.verdict, f.rank, f.phase, f.cause) for f in out] == [
        (Verdict.HUNG, 1, phase, "no_progress")
    ]
    assert f"(budget {budgets[phase]:.1f}s in phase {phase})" in out[0].detail


def test_the_detector_says_when_the_next_verdict_could_fall_due():
    """The leader looks again at that moment, so a verdict comes when its timeout runs out."""
    d = Detector(DetectorConfig(interval_s=1.0, dead_after_intervals=2, hang_timeout_s=3.0))
    now = 100.0
    ranks = [
        RankStatus(0, 99.8, 5, "train", 99.9, "h", 1, seq=10),
        RankStatus(1, 99.5, 4, "train", 98.0, "h", 2, seq=9),  # behind: budget runs out at 101
        RankStatus(2, 99.9, 5, "train", 99.9, "h", 3, seq=10),
    ]
    assert d.observe(ranks, now) == []
    assert d.next_deadline == pytest.approx(101.0)  # rank 1's hang budget, before any liveness
    ranks[1] = RankStatus(1, 99.0, 5, "train", 99.9, "h", 2, seq=10)  # caught up
    assert d.observe(ranks, now) == []
    assert d.next_deadline == pytest.approx(101.0)  # now rank 1's heartbeat: 99.0 + 2 s
    assert d.observe(ranks, 101.01)[0].verdict is Verdict.DEAD
    assert d.next_deadline is None  # a verdict is out: nothing pending


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


def _synchronous_steps(d, steps_busy, step_s, scans_per_step, t0=0.0):
    """Ranks of a synchronous job: every step ends at the same time, ``step_s[i]`` after the one
    before; ``steps_busy[i][r]`` is rank r's compute in step i (reported with the next step's
    announcement, as the loop does); the first step is announced as ``first_step``.  The leader
    scans ``scans_per_step`` times a step; returns every finding."""
    found, t = [], t0
    n = len(steps_busy[0])
    for i in range(len(steps_busy) + 1):
        length = step_s[min(i, len(step_s) - 1)]
        for j in range(scans_per_step):
            now = t + j * length / scans_per_step
            sts = [
                RankStatus(
                    r,
                    now,
                    i + 1,
                    "first_step" if i == 0 else "train",
                    t,
                    "h",
                    r,
                    busy_s=None if i == 0 else steps_busy[i - 1][r],
                    seq=i + 1,
                )
                for r in range(n)
            ]
            found += d.observe(sts, now)
        t += length
    return found


@pytest.mark.parametrize("windows", [1, 3])
def test_a_slower_first_step_compile_is_not_reported_as_a_straggler(windows):
    """Rank 3 compiled its first step in 40 s, its peers in 20 s; every later step takes 8 s of
    compute on every rank (steps of 10 s, ten scans a step).  Rank 3 is not a straggler, even
    where one slow measurement would make one: the first step is measured for no comparison."""
    d = Detector(DetectorConfig(hang_timeout_s=1e9, straggler_windows=windows))
    busy = [[20.0, 20.0, 20.0, 40.0], [8.0, 8.0, 8.0, 8.0], [8.0, 8.0, 8.0, 8.0]]
    found = _synchronous_steps(d, busy, step_s=[40.0, 10.0], scans_per_step=10, t0=1000.0)
    assert [f for f in found if f.verdict is Verdict.STRAGGLER] == []


def test_a_straggler_needs_that_many_slow_measurements_not_that_many_scans():
    """One slow step seen by many scans of the leader is one measurement: straggler_windows (3)
    consecutive slow steps make a straggler, not three looks at the same one."""
    d = Detector(DetectorConfig(hang_timeout_s=1e9, straggler_windows=3))
    # steps 1 (first), then rank 3 is slow in one step (the median of its last two: 19 s vs 8 s)
    busy = [[9.0] * 4, [8.0] * 4, [8.0, 8.0, 8.0, 30.0]]
    found = _synchronous_steps(d, busy, step_s=[10.0], scans_per_step=10)
    assert [f for f in found if f.verdict is Verdict.STRAGGLER] == []
    # ...and three slow steps in a row are a straggler
    busy += [[8.0, 8.0, 8.0, 30.0]] * 2
    found = _synchronous_steps(Detector(d.config), busy, step_s=[10.0], scans_per_step=10)
    assert [(f.verdict, f.rank) for f in found] == [(Verdict.STRAGGLER, 3)]


def test_the_first_step_does_not_stretch_the_calibrated_hang_timeout():
    """A 120 s first step (compile) then 1 s steps on 4 ranks: once 15 ordinary steps are
    measured, a hang is caught at the floor (30 s), not after 5 x the compile time."""
    d = Detector(DetectorConfig())
    t = 1000.0
    d.observe([RankStatus(r, t, 1, "first_step", t, seq=1) for r in range(4)], t)
    t += 120.0
    for step in range(2, 18):
        d.observe([RankStatus(r, t, step, "train", t, seq=step) for r in range(4)], t)
        t += 1.0
    assert d.hang_timeout_s() == 30.0


class Sim:
    """Monitors, one per simulated rank, heartbeating into one TCPStore.  Beats every 0.2 s and
    DEAD after 1 s: five missed beats, so a loaded 2-core machine that stalls a thread for a
    moment does not fail a test that expects no verdict.  ``ranks``: the ranks that start (the
    others never register)."""

    def __init__(self, tmp_path, world=4, ranks=None, events_path=None, **cfg):
        self.server = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
        self.port = self.server.port
        self.events = EventLog(events_path or str(tmp_path / "events.jsonl"))
        self.failures: dict[int, list] = {r: [] for r in range(world)}
        cfg = {"interval_s": 0.2, "dead_after_intervals": 5, "hang_floor_s": 2.0, **cfg}
        self.config = DetectorConfig(**cfg)
        self.monitors = {}
        for r in range(world) if ranks is None else ranks:
            client = dist.TCPStore("127.0.0.1", self.server.port, world + 1, False)
            self.monitors[r] = Monitor(
                client,
                "run/0",
                r,
                world,
                self.config,
                events=self.events,
                on_failure=self.failures[r].append,
                kill_local=False,
            )

    def wait_for(self, cond, timeout=60.0):
        return _wait(cond, timeout)

    def close(self):
        for m in self.monitors.values():
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
        # its monitor closed itself (its wake key says so): not taken for a starved one
        assert f.timeout_s == pytest.approx(1.0) and "although" not in f.detail
        events = sim.events.read()
        verdict = next(i for i, e in enumerate(events) if e["event"] == "verdict")
        assert events[verdict]["rank"] == 2
        # (before the verdict: the leader's thread writes both, so the log's order is theirs.
        # After it the leader scans on, as in in-job recovery, and rank 2's "process" is this
        # one, running: on a loaded machine the next scan came before this read, seen once)
        assert not any(e["event"] == "heartbeat_silent" for e in events[:verdict])
        stacks = [e for e in events if e["event"] == "stacks"]
        assert {e["rank"] for e in stacks} >= {0, 1, 3}
        assert all("most recent call first" in e["stacks"] for e in stacks)  # faulthandler's dump
    finally:
        sim.close()


def test_a_verdict_is_answered_when_the_event_log_cannot_be_written(tmp_path, monkeypatch):
    """A full disk: every write of the event log fails (here /dev/full: ENOSPC), and so does the
    temporary file faulthandler's stack dump needs.  The leader wrote the verdict to the log
    before killing, every rank its stacks before exiting: the error ended the response, the
    verdict counted as answered, and nobody killed or exited (the job waited in a collective
    for its timeout)."""

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_space)
    sim = Sim(tmp_path, events_path="/dev/full")
    try:
        sim.monitors[2].close(announce=False)
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (0, 1, 3)))
        assert all(sim.failures[r][0].rank == 2 for r in (0, 1, 3))
        assert sim.events.failed > 0
    finally:
        sim.close()


def test_a_verdict_is_answered_whatever_fails_in_the_response(tmp_path, monkeypatch):
    """Anything that raises while a rank answers a verdict (here the stack dump) still ends in
    the rank's exit, not in a verdict counted as answered that nothing acted on."""

    def broken() -> str:
        raise RuntimeError("no stacks today")

    monkeypatch.setattr(heartbeat_module, "_stacks", broken)
    sim = Sim(tmp_path)
    try:
        sim.monitors[2].close(announce=False)
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (0, 1, 3)))
        assert all(sim.failures[r][0].rank == 2 for r in (0, 1, 3))
    finally:
        sim.close()


def _answer_by_hand(tmp_path, finding, on_failure, in_job=None, *, handed_over=False):
    """A rank's monitor with its threads stopped, answering ``finding`` on this thread;
    ``handed_over``: its loop took the failure over (``Monitor.hand_over``) before."""
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    m = Monitor(
        server,
        "run/0",
        1,
        2,
        DetectorConfig(interval_s=30.0),
        events=EventLog(str(tmp_path / "events.jsonl")),
        on_failure=on_failure,
        kill_local=False,
    )
    m.close()
    m.on_peer_failure = in_job
    if handed_over:
        m.hand_over()
    server.set("run/0/verdict", json.dumps(finding.to_json()))
    try:
        m._watch()
    finally:
        del server


@pytest.mark.parametrize("case", ["taken-over", "taken-over-no-hook-yet", "group"])
def test_a_response_that_fails_exits_as_the_response_would_have(tmp_path, monkeypatch, case):
    """Where the response raised, the rank exited unless in-job recovery held the hook at that
    moment: a survivor whose loop had just taken a peer's failure over (and unset the hook) was
    exited, and a whole-group HUNG under in-job recovery was left waiting.  And where the hook
    was not set yet when the verdict was read (the monitor init_process_group started, before
    its Run), a hand-over during the response still counted for the response, not for its
    failure: the survivor was exited."""
    failures: list = []
    if case.startswith("taken-over"):  # the loop takes it over (Run.close: hand_over) meanwhile
        finding = Finding(Verdict.DEAD, 0, "h", 1, 5, "train", 1.0, 9.0, "x")
        holder: dict = {}

        def broken() -> str:
            holder["m"].hand_over()
            raise RuntimeError("boom")

        real_watch = Monitor._watch

        def watch(self):
            holder["m"] = self
            return real_watch(self)

        monkeypatch.setattr(Monitor, "_watch", watch)
        want = 0
    else:
        finding = Finding(Verdict.HUNG, None, "", 0, 5, "train", 9.0, 0.1, "group stall")

        def broken() -> str:
            raise RuntimeError("boom")

        want = 1
    monkeypatch.setattr(heartbeat_module, "_stacks", broken)
    hook = None if case == "taken-over-no-hook-yet" else (lambda f: None)
    _answer_by_hand(tmp_path, finding, failures.append, in_job=hook)
    assert len(failures) == want


@pytest.mark.parametrize("verdict", [Verdict.DEAD, Verdict.HUNG])
def test_a_verdict_read_after_the_loop_took_the_failure_over_exits_no_one(tmp_path, verdict):
    """On a loaded machine a survivor's collective can fail (the peer was killed) and its loop
    take the failure over into the next generation before its monitor's thread has even read
    the verdict: answered then, it exited the survivor (code 75), and the launcher gave up the
    in-job recovery it was forming for a restart of the whole group.  A verdict about this rank
    itself still exits it."""
    peer = Finding(verdict, 0, "h", 1, 5, "train", 1.0, 9.0, "x")
    failures: list = []
    _answer_by_hand(tmp_path, peer, failures.append, handed_over=True)
    assert failures == []
    own = Finding(Verdict.DEAD, 1, "h", 1, 5, "train", 1.0, 9.0, "x")
    _answer_by_hand(tmp_path, own, failures.append, handed_over=True)
    assert [f.rank for f in failures] == [1]


def test_a_kill_this_rank_is_named_for_is_done_when_its_loop_took_the_failure_over_first(
    tmp_path,
):
    """The loop took a peer's failure over and closed this rank's monitor before its thread read
    the verdict (its collective failed for another reason first): the verdict named this rank
    the failed one's killer, and no one killed it, a frozen rank its agent never saw fail, so the
    next generation could never form.  The closing monitor answers the verdict it missed."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    failures: list = []
    try:
        m = Monitor(
            server,
            "run/0",
            1,
            3,
            DetectorConfig(interval_s=30.0),  # (no beat reads the verdict before the close)
            events=EventLog(str(tmp_path / "events.jsonl")),
            on_failure=failures.append,
        )
        host = socket.gethostname()
        finding = Finding(Verdict.DEAD, 2, host, victim.pid, 5, "train", 9.0, 9.0, "x", kill_by=1)
        server.set("run/0/verdict", json.dumps(finding.to_json()))  # (no wake key: unread)
        m.on_peer_failure = lambda f: None
        m.hand_over()
        m.close(announce=False)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert failures == []
    finally:
        victim.kill()
        victim.wait()
        del server


def test_an_on_failure_that_raises_is_called_once(tmp_path):
    calls: list = []

    def on_failure(f):
        calls.append(f)
        raise RuntimeError("cleanup failed")

    finding = Finding(Verdict.DEAD, 0, "h", 1, 5, "train", 1.0, 9.0, "x")
    _answer_by_hand(tmp_path, finding, on_failure)  # (its error is logged)
    assert len(calls) == 1


def test_stacks_are_dumped_without_a_temporary_file(monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_space)
    text = heartbeat_module._stacks()
    assert "No space left" in text and "test_stacks_are_dumped_without_a_temporary_file" in text


def test_a_starved_heartbeat_of_a_running_process_gets_the_longer_timeout(tmp_path):
    """Rank 2's heartbeat thread stops beating while its process (this one) runs on the leader's
    machine: a starved thread, not a dead rank.  It is declared DEAD only after
    running_dead_after_intervals, with a word in the log meanwhile."""
    sim = Sim(tmp_path, running_dead_after_intervals=8)
    try:
        sim.monitors[2]._beat = lambda: None  # starved: its thread runs, no beat gets out
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (0, 1, 3)))
        f = sim.failures[0][0]
        assert (f.verdict, f.rank, f.timeout_s) == (Verdict.DEAD, 2, pytest.approx(0.2 * 8))
        assert f.seconds_since_alive > 0.2 * 8
        assert "although its process is running" in f.detail
        silent = [e for e in sim.events.read() if e["event"] == "heartbeat_silent"]
        assert [e["rank"] for e in silent] == [2]
    finally:
        sim.close()


def test_a_verdict_reaches_every_rank_at_once_not_at_its_next_beat(tmp_path):
    """Beats a minute apart: a verdict published by the leader arrives through each rank's wait
    on its wake key (the rank that must kill a frozen peer on another node acts at once)."""
    sim = Sim(tmp_path, world=3, ranks=[0, 1], interval_s=60.0)
    try:
        dead = Finding(Verdict.DEAD, 2, "h", 1, 7, "train", 1.0, 2.0, "quiet", kill_by=1)
        sim.monitors[0]._publish(dead)
        assert sim.wait_for(lambda: sim.failures[0] and sim.failures[1], timeout=30.0)
        assert sim.failures[1] == [dead] and sim.failures[0] == [dead]
    finally:
        sim.close()
    waiters = [m._waiter for m in sim.monitors.values()]
    assert all(w is not None and not w.is_alive() for w in waiters)  # close() ended the waits


UNCLOSED = """
import sys
import torch.distributed as dist
from resilient.health import DetectorConfig, Monitor
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False)
m = Monitor(store, sys.argv[2], 1, 2, DetectorConfig(interval_s=0.05), kill_local=False)
print("started", flush=True)
"""


def test_a_monitor_never_closed_lets_its_process_exit_cleanly(tmp_path):
    """Its verdict waiter is inside a day-long store wait and its heartbeat thread beats every
    50 ms: the exit neither waits for them nor aborts (a daemon thread inside a store call when
    the interpreter goes: "terminate called without an active exception", exit -6, seen once
    here); an exit handler stops both first.  A few processes: the abort was a matter of timing."""
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    for i in range(3):
        done = subprocess.run(
            [sys.executable, "-c", UNCLOSED, str(server.port), f"run/{i}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode, done.stdout) == (0, "started\n"), done.stderr


def test_a_rank_that_stops_progressing_while_peers_wait_is_hung(tmp_path):
    sim = Sim(tmp_path, hang_timeout_s=3.0)
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=drive, args=(m, range(1, 8) if r == 1 else range(1, 10_000), 0.05, stop)
        )
        for r, m in sim.monitors.items()
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
    sim = Sim(tmp_path, hang_timeout_s=5.0)  # far above any stall a busy machine causes
    stop = threading.Event()
    threads = [
        threading.Thread(target=drive, args=(m, range(1, 10_000), 0.12 if r == 3 else 0.04, stop))
        for r, m in sim.monitors.items()
    ]
    for t in threads:
        t.start()
    try:
        assert sim.wait_for(lambda: any(e["event"] == "straggler" for e in sim.events.read()))
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
        # a leader that says "done" is replaced at once by whichever live rank beats first (1 or
        # 3: on a loaded machine either may); the one that took over keeps scanning
        live = (1, 3)
        assert sim.wait_for(lambda: any(sim.monitors[r].is_leader for r in live))
        leader = next(sim.monitors[r] for r in live if sim.monitors[r].is_leader)
        scans = leader.scans
        assert sim.wait_for(lambda: leader.scans >= scans + 10)  # many intervals
        assert leader.is_leader and all(not f for f in sim.failures.values())
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


@pytest.mark.parametrize(
    "blocks, killer",
    [
        (None, 0),  # no launcher: the leader looks on its own host
        ([(0, 2), (0, 2), (2, 2)], 2),  # two nodes of 2: rank 2 shares rank 3's node
        ([(0, 1), (1, 3), (1, 3)], 1),  # nodes of 1 and 3 ranks: rank 1 heads rank 3's node
        ([(0, 3), (0, 3), (0, 3)], 0),  # rank 3 alone on its node: the leader looks
    ],
)
def test_a_rank_that_never_registers_is_declared_dead_by_the_group(
    tmp_path, monkeypatch, blocks, killer
):
    """Rank 3 froze before its monitor started (in its imports): it has no keys at all.  The
    leader declares it DEAD after the join timeout, and every live rank acts on the verdict.
    Its killer is a live rank whose node's block of ranks (each rank publishes its node's first
    rank and count: torchelastic numbers a node's ranks contiguously, however many each node
    runs) holds rank 3; else the leader, which looks on its host."""
    import resilient.health.heartbeat as hb

    given = iter(blocks or [])
    monkeypatch.setattr(hb, "node_block", lambda: next(given, None))
    sim = Sim(tmp_path, ranks=[0, 1, 2], join_timeout_s=1.0)
    try:
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (0, 1, 2)))
        for r in (0, 1, 2):
            f = sim.failures[r][0]
            assert (f.verdict, f.rank, f.cause) == (Verdict.DEAD, 3, "never_joined")
            assert f.waited_s >= 1.0 and f.kill_by == killer
        verdict = next(e for e in sim.events.read() if e["event"] == "verdict")
        assert verdict["rank"] == 3 and "never joined" in verdict["detail"]
    finally:
        sim.close()


def test_a_leader_that_never_registers_is_replaced_and_declared(tmp_path):
    sim = Sim(tmp_path, ranks=[1, 2, 3], join_timeout_s=1.0)
    try:
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (1, 2, 3)))
        assert sim.monitors[1].is_leader
        assert all(
            (sim.failures[r][0].verdict, sim.failures[r][0].rank) == (Verdict.DEAD, 0)
            for r in (1, 2, 3)
        )
        leader = next(e for e in sim.events.read() if e["event"] == "leader")
        assert leader["rank"] == 1 and leader["reason"] == "never registered"
    finally:
        sim.close()


def test_a_rank_stuck_in_its_restore_is_hung_before_any_step(tmp_path):
    """Item 3 on real monitors: rank 2 stalls loading the checkpoint while its peers finished
    theirs and wait in the first step; no step exists yet, the phase budget names it."""
    sim = Sim(tmp_path, phase_budgets_s={"restore": 1.0}, hang_timeout_s=30.0)
    try:
        for r, m in sim.monitors.items():
            m.progress(None, "setup")
            m.progress(None, "restore")
            if r != 2:
                m.progress(None, "setup")
                m.progress(1, "first_step")
        assert sim.wait_for(lambda: sim.failures[0])
        f = sim.failures[0][0]
        assert (f.verdict, f.rank, f.phase) == (Verdict.HUNG, 2, "restore")
        assert "while peers reached step 1" in f.detail
    finally:
        sim.close()


def _peer_beats(rate, seconds, delay=0.01, start=5000.0):
    """A healthy peer on another machine beating once a second for ``seconds``, its monotonic
    clock running at ``rate`` observer seconds a second (a slow crystal, NTP slewing it); each
    beat reaches the observer ``delay`` after it is written, and the observer reads once a
    second.  Yields (the observer's time, the beat's peer time, the beat's true age)."""
    for k in range(1, seconds):
        written = float(k)
        yield written + delay, start + written * rate, delay


@pytest.mark.parametrize("rate", [1 - 0.083333, 1 + 0.083333], ids=["slewed-slow", "slewed-fast"])
def test_a_peer_whose_monotonic_clock_is_slewed_is_not_declared_dead(rate):
    """Rank 1's wall clock is 30 s off and chrony slews it at its maximum rate (83,333 ppm):
    CLOCK_MONOTONIC is slewed too ("affected by the incremental adjustments performed by
    adjtime(3) and NTP").  A minimum of (seen - sent) over all time holds an offset the clocks
    have since left: within a minute the healthy peer looked older than its 2 s timeout."""
    clock = PeerClock(same_kernel=False)
    d = Detector(DetectorConfig(interval_s=1.0, dead_after_intervals=2))
    found, ages = [], []
    for now, m, _ in _peer_beats(rate, 120):
        clock.observe(encode_alive(m, 0.0).encode(), m, 0.0, now, 0.0)
        ranks = [
            RankStatus(0, now, 1, "train", now, "h0", 10, seq=1),
            RankStatus(1, clock.local(m), 1, "train", clock.local(m), "h1", 11, seq=1),
        ]
        found += [f for f in d.observe(ranks, now) if f.verdict is Verdict.DEAD]
        ages.append(now - clock.local(m))
    assert found == []
    # the error is capped at the time between two reads (1 s), under any drift
    assert max(ages) <= 1.0 + 1e-6 and min(ages) >= -1e-9


@pytest.mark.parametrize("ppm", [-100, 0, 100])
def test_a_heartbeats_age_is_never_longer_than_the_truth_under_crystal_drift(ppm):
    """The promise of resilient.health.clocks: a heartbeat's age is never longer than the truth
    (here: a crystal 100 ppm off, no NTP, six hours of one beat a second; with a minimum over all
    time the slow one's age grew by 0.36 s an hour) and never shorter than the time since the
    observer saw it (0: it is seen as it arrives)."""
    clock = PeerClock(same_kernel=False)
    worst = 0.0
    for now, m, age in _peer_beats(1 + ppm * 1e-6, 6 * 3600, start=77.0):
        clock.observe(repr(m).encode(), m, 0.0, now, 0.0)
        judged = now - clock.local(m)
        assert judged >= -1e-9
        worst = max(worst, judged - age)
    assert worst <= 0.01  # the drift over the offset's window: 6 ms at 100 ppm over 60 s


@pytest.mark.parametrize("wall", [b"inf", b"-inf", b"nan", b"1e400", float("inf"), float("nan")])
@pytest.mark.parametrize("same_kernel", [False, True])
def test_a_wall_time_that_is_no_time_reports_no_skew(wall, same_kernel):
    """A broken sender's wall time (inf, nan) is no skew: it read as one "inf s ahead"."""
    clock = PeerClock(same_kernel=same_kernel)
    for i in range(3):
        clock.observe(f"{i}".encode(), 10.0 + i, wall, 10.0 + i, 1000.0 + i)
    assert clock.skew_s is None and clock.changes == 3
    clock.observe(b"3", 13.0, b"1003.5", 13.0, 1003.0)  # a real one is reported
    assert clock.skew_s == pytest.approx(0.5, abs=1e-6)


SKEWED_RANK = """
import os, sys, time
import torch.distributed as dist
from resilient.health import DetectorConfig, EventLog, Monitor

true_time = time.time
time.time = lambda: true_time() - 30.0  # this host's wall clock is 30 s behind
port, events, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 5, False)
config = DetectorConfig(interval_s=0.2, dead_after_intervals=5, hang_floor_s=2.0)
m = Monitor(store, "run/0", 3, 4, config, events=EventLog(events), kill_local=False,
            on_failure=lambda f: print("verdict", f, flush=True))
step = 0
while not os.path.exists(stop):
    step += 1
    m.progress(step, "train")
    time.sleep(0.05)
m.close()
"""


def test_a_skewed_wall_clock_gives_no_verdict_and_the_skew_is_logged(tmp_path):
    """Rank 3 runs in a process whose time.time() is 30 s behind the leader's, and is healthy:
    no verdict (liveness is judged on the leader's own clock), and the skew is in the event log."""
    sim = Sim(tmp_path, ranks=[0, 1, 2])
    stop = tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", SKEWED_RANK, str(sim.port), sim.events.path, str(stop)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    threads_stop = threading.Event()
    threads = [
        threading.Thread(target=drive, args=(m, range(1, 100_000), 0.05, threads_stop))
        for m in sim.monitors.values()
    ]
    for t in threads:
        t.start()
    try:

        def skew_logged():
            return [e for e in sim.events.read() if e["event"] == "clock_skew"]

        assert sim.wait_for(skew_logged)
        skew = skew_logged()[0]
        assert skew["rank"] == 3 and -31 < skew["skew_s"] < -29
        assert "30.0s behind the leader's" in skew["detail"] or "behind" in skew["detail"]
        scans = sim.monitors[0].scans
        assert sim.wait_for(lambda: sim.monitors[0].scans >= scans + 15)  # 3 s of scans
        assert all(not f for f in sim.failures.values())
        assert not [e for e in sim.events.read() if e["event"] == "verdict"]
    finally:
        stop.write_text("")
        threads_stop.set()
        out, _ = proc.communicate(timeout=60)
        sim.close()
    assert "verdict" not in out


def test_the_event_log_and_the_monitor_take_reentrant_locks(tmp_path):
    """Run's SIGTERM handler writes an event and announces "exiting" from the main thread, which
    the signal may have interrupted in the middle of a write: that must not deadlock (it held a
    rank until torchrun's SIGKILL, 30 s into a restart)."""
    log = EventLog(str(tmp_path / "events.jsonl"))
    sim = Sim(tmp_path, world=2)
    done = threading.Event()

    def interrupted_inside_a_write():
        with log._lock:  # as if the handler ran here
            log.write("exit", reason="SIGTERM")
        with sim.monitors[0]._lock:
            sim.monitors[0].leaving(3)
        done.set()

    t = threading.Thread(target=interrupted_inside_a_write, daemon=True)
    t.start()
    try:
        assert done.wait(30), "deadlocked"
        assert [e["event"] for e in log.read()] == ["exit"]
    finally:
        sim.close()


RANK_ON_NODE_1 = """
import os, signal, sys, time
import torch.distributed as dist
from resilient.health import DetectorConfig, EventLog, Monitor

port, events, rank, freeze = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
store = dist.TCPStore("127.0.0.1", port, 5, False)
config = DetectorConfig(interval_s=0.2, dead_after_intervals=5, hang_floor_s=2.0)


def failed(f):
    print("verdict", f.rank, f.kill_by, flush=True)
    os._exit(0)


m = Monitor(store, "run/0", rank, 4, config, events=EventLog(events), on_failure=failed)
for step in range(1, 100_000):
    if freeze and step == 20:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its heartbeat stops, it never exits
    m.progress(step, "train")
    time.sleep(0.05)
"""


def test_a_frozen_rank_is_killed_by_a_rank_on_its_own_node(tmp_path, monkeypatch):
    """Ranks 0 and 1 on node 0 (the leader's), 2 and 3 on node 1 (another torchrun agent, here
    on the same machine): rank 2 freezes.  The leader names rank 3 in the verdict, and rank 3,
    not the leader, SIGKILLs it, once: a stopped process never exits by itself, so its own
    agent would never see it fail."""
    monkeypatch.setenv("GROUP_RANK", "0")
    sim = Sim(tmp_path, ranks=[0, 1])
    env = dict(os.environ, OMP_NUM_THREADS="1", GROUP_RANK="1")
    procs = {
        r: subprocess.Popen(
            [sys.executable, "-c", RANK_ON_NODE_1, str(sim.port), sim.events.path, str(r), freeze],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r, freeze in ((2, "1"), (3, "0"))
    }
    try:
        try:
            code = procs[2].wait(timeout=120)
        except subprocess.TimeoutExpired:  # (once, under load: say what each side saw)
            procs[3].kill()
            raise AssertionError(
                f"rank 2 was not killed in 120 s; rank 3 said {procs[3].communicate()[0]!r}; "
                f"events {sim.events.read()[-12:]}; verdicts here {dict(sim.failures)}"
            ) from None
        assert code == -9  # killed, not left stopped
        out, _ = procs[3].communicate(timeout=60)
        assert "verdict 2 3" in out
        assert sim.wait_for(lambda: all(sim.failures[r] for r in (0, 1)))
        assert {(f.rank, f.kill_by) for r in (0, 1) for f in sim.failures[r]} == {(2, 3)}
        # a stopped process is not a running one: the usual timeout (5 beats), not the longer
        assert "(timeout 1.0s in phase train)" in sim.failures[0][0].detail
        killed = [e for e in sim.events.read() if e["event"] == "killed"]
        assert len(killed) == 1, killed
        assert (killed[0]["rank"], killed[0]["by"], killed[0]["node"]) == (2, 3, "1")
        assert killed[0]["pid"] == procs[2].pid
        # no live rank on its node: one on its host kills it; on no host of the job: nobody
        leader = sim.monitors[0]
        now = time.monotonic()
        live = [RankStatus(r, now, 5, "train", now, "h", 100 + r) for r in range(4)]
        leader._info = {r: ("h", 100 + r, "", "0" if r < 2 else "1") for r in range(4)}
        f = Detector(leader.config).observe(
            [*live[:2], RankStatus(2, now - 9, 5, "train", now, "h", 102), live[3]], now
        )[0]
        assert leader._killer(f, live, now) == 3
        assert leader._killer(f, live[:3], now) == 0
        leader._info[0] = leader._info[1] = ("elsewhere", 0, "", "0")
        assert leader._killer(f, live[:3], now) is None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        sim.close()


def test_process_state_tells_running_stopped_and_gone_apart_by_pid_and_start_time():
    """What the leader reads of a silent rank's process on its own machine, and what guards a
    kill against a pid that a new process took over."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        start = process_start(proc.pid)
        assert start is not None
        assert process_state(proc.pid, start) in ("R", "S")
        assert process_state(proc.pid, start + 1) == "gone"  # the pid is another process's
        # asleep, using no CPU: not running (stuck, not starved)
        assert Sim.wait_for(None, lambda: process_running(proc.pid, start)[0] is False)
        os.kill(proc.pid, signal.SIGSTOP)
        assert Sim.wait_for(None, lambda: process_state(proc.pid, start) == "T")
        assert process_running(proc.pid, start)[0] is False
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        start = process_start(busy.pid)
        # on a CPU or waiting for one, or using CPU since the last look: running
        looks = [process_running(busy.pid, start)]
        assert Sim.wait_for(
            None,
            lambda: looks.append(process_running(busy.pid, start, looks[-1][1])) or looks[-1][0],
        )
    finally:
        busy.kill()
        busy.wait()
    assert process_state(proc.pid, start) == "gone"
    assert process_running(proc.pid, start) == (False, None)
    info = encode_info("h", 7, "b", "1", None, 1234).encode()
    assert (decode_info(info), decode_start(info), decode_block(info)) == (
        ("h", 7, "b", "1"),
        1234,
        None,
    )
    old = encode_info("h", 7, "b", "1", (2, 2)).encode()  # another version: no start time
    assert (decode_start(old), decode_block(old)) == (None, (2, 2))


@pytest.mark.parametrize("pid", ["-1", "-4242", "0", "+7", " 7", "\u0667", "4194305", "9" * 30])
def test_a_pid_in_a_heartbeat_that_is_not_a_process_id_reads_as_unknown(pid):
    """The verdict's killer sends SIGKILL to the pid a rank published: os.kill(-1, ...) reaches
    every process of the user, os.kill(-N, ...) process group N."""
    assert decode_info(f"{socket.gethostname()}|{pid}|b|n".encode()) == ("", 0, "", "")
    assert decode_info(b"h|4194304|b|n") == ("h", 4194304, "b", "n")


def test_a_kill_checks_the_pid_is_still_the_failed_ranks_process(tmp_path):
    """A rank's pid names its process only while that process lives: the killer compares the
    start time the rank published before it sends SIGKILL."""
    sim = Sim(tmp_path, world=2, ranks=[0])
    proc = subprocess.Popen(["sleep", "60"])
    try:
        m = sim.monitors[0]
        m.kill_local = True
        f = Finding(Verdict.DEAD, 1, m.host, proc.pid, 3, "train", 1.0, 9.0, "quiet", kill_by=0)
        m._starts[1] = process_start(proc.pid) + 1  # a process the rank no longer is
        m._kill(f, leader=True)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # not killed (a kill would be reaped at once)
        assert not any(e["event"] == "killed" for e in sim.events.read())
        m._starts[1] -= 1
        m._kill(f, leader=True)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert [e["pid"] for e in sim.events.read() if e["event"] == "killed"] == [proc.pid]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sim.close()


def _slow_attribution(monitor, seconds):
    """The leader's attribution takes ``seconds`` longer (as on a loaded machine or at scale)."""
    attribute = monitor._attribute

    def slow(*args):
        time.sleep(seconds)
        attribute(*args)

    monitor._attribute = slow


def _hung_rank_killed_by_rank_1(tmp_path, *, slow_s: float, in_job: bool):
    """Ranks 0 (the leader), 1 and 3 of 4 monitor; rank 2 is a real process, hung, that rank 1
    must kill (its stack is in the store); the leader's attribution takes ``slow_s`` longer.
    Returns the order of the attribution and the kill in the log, once both happened, and the
    key the leader wrote."""
    sim = Sim(tmp_path, world=4, ranks=[0, 1, 3], interval_s=0.5)  # the wait's bound: 3 s
    hung = subprocess.Popen(["sleep", "60"])
    try:
        leader, killer = sim.monitors[0], sim.monitors[1]
        killer.kill_local = True
        if in_job:
            killer.on_peer_failure = lambda f: None  # (what Run sets under resilient launch)
        _slow_attribution(leader, slow_s)
        with leader._lock:  # the hung rank published its stack (its beat still runs)
            leader.store.set(
                "run/0/stack/2", json.dumps({"stack": "train.py:9", "flight_recorder": None})
            )
        f = Finding(
            Verdict.HUNG, 2, killer.host, hung.pid, 5, "train", 1.0, 9.0, "stuck", kill_by=1
        )
        leader._publish(f)
        assert hung.wait(timeout=60) == -signal.SIGKILL
        answered = (0, 3) if in_job else (0, 1, 3)  # (in-job, the killer calls its hook)
        assert sim.wait_for(lambda: all(sim.failures[r] for r in answered))
        assert sim.wait_for(
            lambda: any(e["event"] == "hang_attribution" for e in sim.events.read())
        )
        order = [
            e["event"] for e in sim.events.read() if e["event"] in ("hang_attribution", "killed")
        ]
        with leader._lock:
            key = f"run/0/attributed/2:{hung.pid}"
            written = leader.store.get(key).decode() if leader.store.check([key]) else None
        return order, written, sim.failures
    finally:
        if hung.poll() is None:
            hung.kill()
            hung.wait()
        sim.close()


def test_on_hung_a_killer_that_is_not_the_leader_kills_only_once_the_attribution_is_written(
    tmp_path,
):
    """The kill makes the launcher tear the job down, the leader with it: the rank that kills the
    hung one (here rank 1, not the leader) waits for the leader's attribution first; a rank that
    only exits waits for it too (test_a_close_while_the_monitor_answers_a_hang_lets_it_finish)."""
    order, written, failures = _hung_rank_killed_by_rank_1(tmp_path, slow_s=1.0, in_job=False)
    assert order == ["hang_attribution", "killed"]
    assert written == "0"  # the leader's, under the verdict's name
    assert failures[1]  # and the killer answered the verdict


def test_under_in_job_recovery_the_killer_of_a_hung_rank_does_not_wait_for_the_attribution(
    tmp_path,
):
    """In-job recovery keeps the leader alive through the kill, and the spare waits for it: the
    killer kills once the hung rank's stack is in, not after the leader's attribution."""
    order, _, _ = _hung_rank_killed_by_rank_1(tmp_path, slow_s=2.0, in_job=True)
    assert order == ["killed", "hang_attribution"]


def test_a_close_while_the_monitor_answers_a_hang_lets_it_finish(tmp_path):
    """The main thread may see the verdict first (between steps) and close the monitor: the
    monitor's thread is then waiting for the leader's attribution, and it ends the process with
    the verdict's exit code; close() waits for that, not five beats only."""
    sim = Sim(tmp_path, world=3, ranks=[0, 1])
    try:
        leader, other = sim.monitors[0], sim.monitors[1]
        _slow_attribution(leader, 1.6)  # longer than the five beats (1 s) close() waited before
        with leader._lock:
            leader.store.set(
                "run/0/stack/2", json.dumps({"stack": "x.py:1", "flight_recorder": None})
            )
        f = Finding(Verdict.HUNG, 2, "elsewhere", 99, 5, "train", 1.0, 9.0, "stuck", kill_by=None)
        leader._publish(f)
        assert sim.wait_for(lambda: other.verdict() is not None)
        other.close(announce=False)
        assert sim.failures[1] == [f]  # answered before close() returned
        assert any(e["event"] == "hang_attribution" for e in sim.events.read())
        # the wait ends at its bound when no attribution comes
        lone = Finding(Verdict.HUNG, 2, "elsewhere", 98, 5, "train", 1.0, 9.0, "stuck")
        t0 = time.monotonic()
        assert other._await_attribution(lone) is False
        assert time.monotonic() - t0 >= other.attribution_wait_s() - 0.01
    finally:
        sim.close()


BURN_ON_REQUEST = """
import sys, time
for line in sys.stdin:
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    print("burnt", flush=True)
"""


def test_a_silent_process_that_used_cpu_since_its_first_look_is_running(tmp_path):
    """A starved rank's process may have no thread on a CPU at the moment the leader looks; the CPU
    it used since the look at half the timeout says it runs.  A process that used none since, and
    sleeps, is stuck: not running."""
    sim = Sim(tmp_path, world=2, ranks=[0])
    proc = subprocess.Popen(
        [sys.executable, "-c", BURN_ON_REQUEST], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        m = sim.monitors[0]
        m._info[1] = (m.host, proc.pid, boot_id(), "")
        m._starts[1] = process_start(proc.pid)
        asleep = lambda: process_state(proc.pid, m._starts[1]) == "S"  # noqa: E731
        assert Sim.wait_for(None, asleep)
        silent = RankStatus(1, 100.0, 5, "train", 100.0, m.host, proc.pid)
        m._note_cpu(silent)  # half overdue: CPU time noted
        proc.stdin.write(b"burn\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"burnt\n"
        assert Sim.wait_for(None, asleep)
        assert m._running(silent) is True  # used CPU since: starved, not stuck
        half = m.config.interval_s / 2
        time.sleep(half)
        assert m._running(silent) is False  # none since the last look, asleep: stuck
        # a new silence with no first look: asleep now says nothing yet (a starved process is
        # often between two slices of CPU); a look half an interval later does
        now = time.monotonic()
        other = RankStatus(1, now - 1.0, 5, "train", now - 1.0, m.host, proc.pid)
        assert m._running(other) is True
        time.sleep(half)
        assert m._running(other) is False
        # no benefit of the doubt past the running timeout: it would only say "running" in the
        # verdict of a stuck rank
        late = RankStatus(1, now - 60.0, 5, "train", now - 60.0, m.host, proc.pid)
        assert m._running(late) is False
        said = [e for e in sim.events.read() if e["event"] == "heartbeat_silent"]
        assert [e["rank"] for e in said] == [1]  # once, for the silence it really ran in
        # stopped, or gone: not running at the first look, baseline or not
        third = RankStatus(1, 300.0, 5, "train", 300.0, m.host, proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        assert Sim.wait_for(None, lambda: process_state(proc.pid, m._starts[1]) == "T")
        assert m._running(third) is False
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        fourth = RankStatus(1, 400.0, 5, "train", 400.0, m.host, proc.pid)
        assert m._running(fourth) is False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sim.close()


# --- what the store holds, read by monitors on fake clocks ---------------------------------------


@pytest.fixture
def clk(monkeypatch):
    return fake_time(monkeypatch)


def _elsewhere(store, *ranks):
    """Ranks on other machines (other hosts, other boot ids): the leader judges them by their
    heartbeats alone, not by whether their process (this test's) runs."""
    for r in ranks:
        store.set(f"run/0/info/{r}", encode_info(f"host{r}", 4000 + r, f"{r:016x}"))


def _three_seen_alive(tmp_path):
    """Three quiet monitors (ranks 1 and 2 on other hosts), interval 1 s, DEAD after 2; every
    rank has announced a step and the leader has seen them all alive."""
    store, events = DictStore(), EventLog(str(tmp_path / "events.jsonl"))
    ms = quiet_monitors(
        store, 3, DetectorConfig(interval_s=1.0, dead_after_intervals=2), events=events
    )
    _elsewhere(store, 1, 2)
    for m in ms.values():
        m.progress(1, "train")
    ms[0]._scan()  # everyone seen alive
    return store, ms, events


@pytest.mark.parametrize(
    "key,value",
    [
        ("run/0/progress/1", "garbage"),  # not step|phase|seq|mono|busy
        ("run/0/alive/1", "not-a-number|1.0"),
        ("run/0/alive/1", b"\xff\xfe"),
        ("run/0/alive/1", "nan|1.0"),
    ],
    ids=["progress-garbage", "alive-not-a-float", "alive-not-utf8", "alive-nan"],
)
def test_a_malformed_heartbeat_of_one_rank_does_not_hide_anothers_death(clk, tmp_path, key, value):
    """Rank 1 (an older version, a stray writer) publishes a value that does not parse: it raised
    out of the leader's scan every interval, and no verdict came for any rank, ever.  It is no new
    heartbeat of rank 1 (logged once); rank 2's death is still found."""
    store, ms, events = _three_seen_alive(tmp_path)
    for k in range(1, 4):  # rank 2 died; rank 1 beats, then its key holds the malformed value
        clk.t += 1.0
        ms[0]._beat()
        if k <= 2 or "progress" in key:
            ms[1]._beat()
        if k == 2:
            store.set(key, value)
        ms[0]._scan()
    verdict = json.loads(store.d["run/0/verdict"])
    assert (verdict["verdict"], verdict["rank"]) == ("DEAD", 2)
    said = [(e["rank"], e["key"]) for e in events.read() if e["event"] == "heartbeat_malformed"]
    assert said == [(1, key.split("/")[2])]


def test_a_rank_whose_heartbeat_is_malformed_is_judged_by_its_last_one(clk, tmp_path):
    """A malformed value keeps no rank alive: its liveness timeout runs on from the last heartbeat
    read; a join list entry that is not a rank is skipped."""
    store, events = DictStore(), EventLog(str(tmp_path / "events.jsonl"))
    ms = quiet_monitors(
        store, 2, DetectorConfig(interval_s=1.0, dead_after_intervals=2), events=events
    )
    _elsewhere(store, 1)
    store.append("run/0/joined", "oops,7,")  # not a rank; no such rank
    for m in ms.values():
        m.progress(1, "train")
    ms[0]._scan()
    store.set("run/0/alive/1", "garbage")
    for _ in range(3):
        clk.t += 1.0
        ms[0]._beat()
        ms[0]._scan()
    verdict = json.loads(store.d["run/0/verdict"])
    assert (verdict["verdict"], verdict["rank"], verdict["cause"]) == ("DEAD", 1, "no_heartbeat")
    said = [(e["rank"], e["key"]) for e in events.read() if e["event"] == "heartbeat_malformed"]
    assert said == [(None, "joined"), (1, "alive")]


def test_a_leader_starved_after_it_woke_on_time_judges_no_heartbeat_by_the_stall(clk, tmp_path):
    """The leader's loop woke on time, then was starved on its way to the scan (the beat and the
    store round trips before it each wait for the GIL; seen on a loaded CI machine): every
    heartbeat, the leader's own among them, aged by the starvation, and the leader declared a
    rank DEAD (its own rank 0, in a test whose monitors share one process).  A stall measured up
    to the scan's read is a stall as a missed wake time is: each rank gets an interval from its
    end to beat; one that does not beat by then is DEAD as before."""
    store, ms, events = _three_seen_alive(tmp_path)
    for m in ms.values():
        m._beat()
    ms[0]._woke = clk.t  # (what the loop records when its wait ends, on time)
    clk.t += 5.0  # starved before the scan: longer than the 2 s liveness timeout
    ms[0]._scan()
    assert "run/0/verdict" not in store.d
    assert ms[0]._stalled == (clk.t - 5.0, clk.t)
    clk.t += 0.5  # within an interval of the stall's end: ranks 0 and 1 beat, rank 2 does not
    ms[0]._beat()
    ms[1]._beat()
    ms[0]._scan()
    assert "run/0/verdict" not in store.d
    clk.t += 0.6  # the interval after the stall is over: rank 2 is DEAD, as it would be anyway
    ms[0]._beat()
    ms[1]._beat()
    ms[0]._scan()
    verdict = json.loads(store.d["run/0/verdict"])
    assert (verdict["verdict"], verdict["rank"]) == ("DEAD", 2)


def test_a_verdict_is_acted_on_when_the_take_over_check_fails(tmp_path):
    """The take-over check (a read of the leader's heartbeat) raising every interval must not
    keep a rank from reading the verdict that is already out."""
    store = DictStore()
    cfg = DetectorConfig(interval_s=0.05, dead_after_intervals=2)
    failed = threading.Event()
    m0 = quiet_monitors(store, 2, cfg, ranks=[0])[0]
    m1 = Monitor(
        store,
        "run/0",
        1,
        2,
        cfg,
        kill_local=False,
        ring=None,
        events=EventLog(str(tmp_path / "events.jsonl")),
        on_failure=lambda f: failed.set(),
    )

    def broken(key):
        if key == "run/0/alive/0":
            raise RuntimeError("the take-over check fails")

    try:
        store.on_get = broken
        finding = Finding(Verdict.DEAD, 0, m0.host, 1, 1, "train", 1.0, 3.0, "test", "no_heartbeat")
        store.set("run/0/verdict", json.dumps(finding.to_json()))
        assert failed.wait(60)
        assert m1.verdict() is not None and m1.verdict().rank == 0
    finally:
        m1.close(announce=False)


def test_a_slow_read_of_the_leaders_beat_does_not_make_it_look_dead(clk):
    """Rank 1 watches leader 0 on another machine.  One read of the leader's beat is slow (rank
    1's heartbeat thread descheduled for 2 s, or the store slow) and the leader beats meanwhile:
    observed with the time taken before the read, that beat set the offset 2 s too small, for
    good, and rank 1 took the lead from a live leader whose last beat was 0.1 s old."""
    store = DictStore()
    ms = quiet_monitors(store, 2, DetectorConfig(interval_s=1.0, dead_after_intervals=2))
    skew = 50_000.0  # the leader's monotonic clock minus rank 1's

    def leader_beats():
        store.set("run/0/alive/0", encode_alive(clk.t + skew, clk.t + 1.7e9))

    _elsewhere(store, 0)
    leader_beats()
    clk.t += 0.1
    ms[1]._maybe_take_over()  # a normal look
    clk.t += 0.9
    leader_beats()

    def slow(key):
        if key == "run/0/alive/0":
            clk.t += 2.0  # the read takes 2 s; the leader beats at its end
            leader_beats()

    clk.t += 0.05
    store.on_get = slow
    ms[1]._maybe_take_over()
    store.on_get = None
    clk.t += 0.1  # the leader's newest beat is 0.1 s old
    ms[1]._maybe_take_over()
    assert store.d["run/0/leader"] == b"0"
    mono = float(store.d["run/0/alive/0"].split(b"|")[0])
    assert clk.t - ms[1]._clocks[0].local(mono) == pytest.approx(0.1)


def test_a_store_that_stays_down_is_logged_once_then_summarised(tmp_path):
    """One monitor_error an interval, forever, while the store is down: now the first, and the
    total when it answers again (no heartbeat_late either: the beats are late because of it)."""
    store, log = DictStore(), EventLog(str(tmp_path / "events.jsonl"))
    cfg = DetectorConfig(interval_s=0.02, dead_after_intervals=2)
    m = Monitor(
        store,
        "run/0",
        0,
        2,
        cfg,
        kill_local=False,
        ring=None,
        events=log,
        on_failure=lambda f: None,
    )

    def wait_for(what):
        end = time.monotonic() + 60
        while not what() and time.monotonic() < end:
            time.sleep(0.01)
        return what()

    try:
        store.fail = True
        calls = store.calls
        assert wait_for(lambda: store.calls >= calls + 100)  # many beats failed
        store.fail = False
        assert wait_for(lambda: any(e["event"] == "monitor_recovered" for e in log.read()))
    finally:
        m.close(announce=False)
    every = log.read()
    events = [e for e in every if e["event"] in ("monitor_error", "monitor_recovered")]
    assert [(e["event"], e["where"]) for e in events] == [
        ("monitor_error", "heartbeat"),
        ("monitor_recovered", "heartbeat"),
    ]
    assert events[1]["failures"] > 10
    # none while the store failed (the heartbeat thread writes all three, so the log's order is
    # theirs); a beat before the failure or after the recovery may be late on a loaded machine,
    # which is what heartbeat_late is for (under load: the first beat, 20 ms late on 20 ms)
    start, end = every.index(events[0]), every.index(events[1])
    late = [e for e in every[start:end] if e["event"] == "heartbeat_late"]
    assert not late, late


def test_a_series_of_store_errors_is_counted_every_few_minutes(clk, tmp_path):
    """While the errors go on, a count every ERROR_SUMMARY_S (300 s): an hour of a dead store at
    one beat a second is 13 events, not 3,600."""
    log = EventLog(str(tmp_path / "events.jsonl"))
    m = quiet_monitors(DictStore(), 1, DetectorConfig(), events=log)[0]
    for _ in range(3600):
        clk.t += 1.0
        m._beat_errors.failed(RuntimeError("store down"))
    m._beat_errors.ok()
    events = [e for e in log.read() if e["event"].startswith("monitor_")]
    assert len(events) == 1 + 11 + 1  # the first, a count every 300 s, the recovery
    assert [e.get("repeated") for e in events[1:-1]] == [300] * 11
    assert events[-1]["event"] == "monitor_recovered" and events[-1]["failures"] == 3600
