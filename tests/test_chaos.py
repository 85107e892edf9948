"""The chaos harness's parts, without launching jobs: scenarios, lineage, checks, injectors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resilient.chaos.faults import ChaosHook, damage_newest_checkpoint, kill_tree, throttle
from resilient.chaos.runner import QUICK, builtin_scenarios
from resilient.chaos.scenario import KINDS, parse_scenario
from resilient.chaos.verify import _samples_once, _verdict_checks, join_wait, lineage
from resilient.errors import ScenarioError
from resilient.health.events import EventLog

GOOD = """
name = "t"
description = "a test"

[job]
nproc = 4
[job.trainer]
tp = 2
ep = 2
steps = 30
save_every = 5

[[faults]]
kind = "kill"
rank = 1
step = 12

[expect]
final_state = "exact"
"""


def test_builtin_suite_parses_and_covers_every_injector():
    full = builtin_scenarios()
    kinds = {f.kind for s in full for f in s.faults}
    assert kinds == set(KINDS), set(KINDS) - kinds
    errors = {f.error for s in full for f in s.faults if f.kind == "storage"}
    assert {"transient", "enospc"} <= errors
    assert any(f.latency_s for s in full for f in s.faults)  # slow storage
    assert any(f.at_s for s in full for f in s.faults)  # a time trigger
    assert any(f.when == "save" for s in full for f in s.faults)  # the save-phase trigger
    assert any(s.job.elastic and s.job.nodes == 2 for s in full)  # elastic shrink
    # start-up freezes: before the heartbeat exists (import) and in process-group init
    assert {("stop", "import"), ("stop", "init")} <= {
        (f.kind, f.when) for s in full for f in s.faults
    }
    skew = [s for s in full if any(f.kind == "skew" for f in s.faults)]
    assert skew and skew[0].job.nodes == 2 and skew[0].expect.verdict == "none"
    assert [s.name for s in builtin_scenarios(quick=True)] == sorted(QUICK)


def test_a_good_scenario_parses_with_defaults():
    s = parse_scenario(GOOD, "good.toml")
    assert s.job.trainer == {"dp": 1, "tp": 2, "ep": 2, "steps": 30, "save_every": 5}
    assert s.faults[0].id == "kill-0" and s.faults[0].when == "step"
    assert s.expect.samples_exactly_once and s.expect.max_steps_lost is None


@pytest.mark.parametrize(
    "change,expected",
    [
        (
            ('kind = "kill"', 'kind = "explode"'),
            "bad.toml:14: faults[0].kind: 'explode' is not a fault kind",
        ),
        (
            ("rank = 1", "rank = 7"),
            "bad.toml:15: faults[0].rank: 7 is not a rank of this 4-rank job",
        ),
        (
            ("step = 12", "step = 99"),
            "bad.toml:16: faults[0].step: 99 is outside the job's steps 1..30",
        ),
        (
            ("steps = 30", 'steps = "30"'),
            "bad.toml:10: job.trainer.steps: expected int, found str '30'",
        ),
        (
            ("ep = 2", "ep = 2\ndp = 2"),
            "job.trainer.dp: dp 2 x ep 2 x tp 2 = 8, but the job has 4 ranks",
        ),
        (
            ('final_state = "exact"', 'final_state = "perfect"'),
            "bad.toml:19: expect.final_state: 'perfect'",
        ),
        (
            ("step = 12", "step = 12\nat_s = 3.0"),
            "faults[0].step: a kill fault needs exactly one trigger",
        ),
        (("[expect]", "[expect]\nspeed = 3"), "bad.toml:19: expect.speed: unknown field"),
        (
            ("nproc = 4", "nproc = 4\nnodes = 3"),
            "bad.toml:7: job.nodes: 3: localhost jobs take 1 or 2",
        ),
        (
            ("rank = 1", "rank = 1\nnode = 1"),  # (the rank is global: the node would be unread)
            "faults[0].node: a kill fault has no node; its fields are",
        ),
        (
            ("step = 12", 'when = "import"'),
            None,  # a start-up phase is a trigger of its own
        ),
        (
            ("step = 12", 'step = 12\nwhen = "import"'),
            "bad.toml:17: faults[0].when: 'import' is the trigger: give no step or at_s with it",
        ),
        (
            ("step = 12", 'when = "boot"'),
            "faults[0].when: 'boot': 'step' (before the step), 'save' (during its save), or a "
            "start-up phase: 'import', 'init', 'restore'",
        ),
        (
            ('kind = "kill"\nrank = 1\nstep = 12', 'kind = "skew"\nrank = 1'),
            "faults[0].seconds: a skew fault needs seconds != 0",
        ),
        (
            ('kind = "kill"\nrank = 1\nstep = 12', 'kind = "skew"\nrank = 1\nseconds = -30.0'),
            None,
        ),
        (
            (
                'kind = "kill"\nrank = 1\nstep = 12',
                'kind = "skew"\nrank = 1\nstep = 3\nseconds = 5',
            ),
            "faults[0].step: a skew fault holds from the start of every attempt: no trigger",
        ),
        (
            (
                'kind = "kill"\nrank = 1\nstep = 12',
                'kind = "slow"\nrank = 1\nwhen = "init"\nfactor = 2.0',
            ),
            "faults[0].kind: a slow fault cannot fire in the 'init' phase",
        ),
        (("step = 12", 'step = 12\nafter = "kill-0"'), "faults[0].after: 'kill-0' is not another"),
        (("step = 12", 'step = 12\nafter = "nope"'), "faults[0].after: 'nope' is not another"),
        (
            (
                "step = 12",
                'step = 12\nid = "a"\n\n[[faults]]\nkind = "kill"\nrank = 2\n'
                'when = "init"\nafter = "a"',
            ),
            None,  # a second fault armed by the first
        ),
        (
            (
                "step = 12",
                'at_s = 3.0\nid = "a"\n\n[[faults]]\nkind = "kill"\nrank = 2\n'
                'when = "init"\nafter = "a"',
            ),
            "faults[1].after: 'a' is not an in-rank fault",
        ),
        (
            (
                "step = 12",
                'step = 12\nid = "a"\nafter = "b"\n\n[[faults]]\nid = "b"\n'
                'kind = "kill"\nrank = 2\nstep = 3\nafter = "a"',
            ),
            "faults[0].after: 'a' waits, through 'b', for itself",
        ),
        (
            (
                "step = 12",
                'step = 12\nid = "a"\n\n[[faults]]\nkind = "skew"\nrank = 2\n'
                'seconds = 5.0\nafter = "a"',
            ),
            "faults[1].after: only an in-rank fault with a step or phase trigger waits",
        ),
    ],
)
def test_scenario_errors_name_the_file_line_and_field(change, expected):
    text = GOOD.replace(*change)
    if expected is None:
        parse_scenario(text, "bad.toml")
        return
    with pytest.raises(ScenarioError) as e:
        parse_scenario(text, "bad.toml")
    assert expected in str(e.value)


def test_scenario_needs_a_job_and_valid_toml():
    with pytest.raises(ScenarioError, match="bad.toml: job: missing"):
        parse_scenario('name = "x"', "bad.toml")
    with pytest.raises(ScenarioError, match="bad.toml: not valid TOML"):
        parse_scenario("name = ", "bad.toml")
    kill_node = GOOD.replace('kind = "kill"\nrank = 1', 'kind = "kill_node"\nnode = 1')
    with pytest.raises(ScenarioError, match="kill_node needs a job with nodes = 2"):
        parse_scenario(kill_node, "bad.toml")


def _rec(step, t, first=None):
    first = (step - 1) * 8 if first is None else first
    return {"step": step, "wall_time": t, "loss": 1.0, "samples": [first, 8]}


def test_lineage_replaces_rolled_back_steps_and_counts_the_loss():
    records = [_rec(s, s) for s in range(1, 13)] + [_rec(s, 20 + s) for s in range(11, 16)]
    history, rollbacks = lineage(records)
    assert [r["step"] for r in history] == list(range(1, 16))
    assert history[10]["wall_time"] == 31  # the replay of step 11, not the lost one
    assert rollbacks == [{"reached": 12, "resumed_after": 10, "lost": 2, "first_step_time": 31}]
    ok = _samples_once(history, 15)
    assert ok.ok and "samples 0..119 each once" in ok.detail


def test_a_save_whose_commit_the_fault_cut_short_costs_one_more_interval_and_no_more():
    """Killed at step 12 while the save of step 10 was still committing (a loaded machine), the
    run resumes from step 5, the newest step committed anywhere when the restore began, and
    loses 6: the price of an asynchronous save, allowed.  A restore that left a newer commit
    behind (durable or in memory), one that says nothing of what there was, or one from before
    the fault is not excused."""
    from resilient.chaos.verify import _cut_short

    rollback = {"reached": 11, "resumed_after": 5, "lost": 6, "first_step_time": 100.0}
    restore = {
        "event": "restore",
        "step": 5,
        "source": "durable",
        "time": 95.0,
        "newest_durable": 5,
        "newest_memory": None,
    }
    assert _cut_short(rollback, [restore], [90.0], 5) == 10
    assert _cut_short(rollback, [{**restore, "newest_durable": 10}], [90.0], 5) is None
    assert _cut_short(rollback, [{**restore, "newest_memory": 11}], [90.0], 5) is None
    old = {k: v for k, v in restore.items() if k not in ("newest_durable", "newest_memory")}
    assert _cut_short(rollback, [old], [90.0], 5) is None
    assert _cut_short(rollback, [{**restore, "time": 80.0}], [90.0], 5) is None
    assert _cut_short({**rollback, "reached": 9, "lost": 4}, [restore], [90.0], 5) is None
    assert _cut_short(rollback, [restore], [], 5) is None


def test_samples_check_catches_a_replay_that_reads_other_samples():
    # a resumed loader that lost its position serves step 11's replay the samples of step 1
    records = [_rec(s, s) for s in range(1, 13)] + [_rec(11, 30, first=0)]
    records += [_rec(s, 30 + s) for s in range(12, 16)]
    bad = _samples_once(lineage(records)[0], 15)
    assert bad.ok is False and "repeated" in bad.detail and "skipped" in bad.detail
    short = _samples_once(lineage([_rec(s, s) for s in range(1, 10)])[0], 15)
    assert short.ok is False  # samples of steps 10..15 never consumed


def test_verdict_checks():
    s = parse_scenario(GOOD.replace('final_state = "exact"', 'verdict = "DEAD"'))
    dead = [{"verdict": "DEAD", "rank": 1, "detail": "no liveness", "time": 1.0}]
    assert _verdict_checks(s, dead, [], {})[0].ok
    wrong = [{"verdict": "DEAD", "rank": 2, "detail": "", "time": 1.0}]
    assert _verdict_checks(s, wrong, [], {})[0].ok is False
    none = parse_scenario(GOOD.replace('final_state = "exact"', 'verdict = "none"'))
    assert _verdict_checks(none, [], [], {})[0].ok
    assert _verdict_checks(none, dead, [], {})[0].ok is False
    slow_ = [{"verdict": "STRAGGLER", "rank": 0, "detail": "1.5x", "time": 1.0}]
    reported = _verdict_checks(none, [], slow_, {})[0]  # a report is not a verdict that acts
    assert reported.ok and "reported only: [('STRAGGLER', 0)]" in reported.detail
    slow = parse_scenario(GOOD.replace('final_state = "exact"', 'verdict = "STRAGGLER"'))
    strag = [{"verdict": "STRAGGLER", "rank": 1, "detail": "2.1x", "time": 1.0}]
    checks = _verdict_checks(slow, [], strag, {"restarts": 0})
    assert [c.ok for c in checks] == [True, True]
    checks = _verdict_checks(slow, dead, strag, {"restarts": 1})
    assert [c.ok for c in checks] == [True, False]  # the straggler was killed: a failure


def test_in_rank_faults_fire_once_across_restarts(tmp_path):
    plan = {
        "marker_dir": str(tmp_path / "faults"),
        "faults": [
            {"id": "p", "kind": "pause", "rank": 1, "step": 3, "seconds": 0.01},
            {"id": "r", "kind": "raise", "rank": 1, "step": 5, "when": "save"},
        ],
    }
    events = EventLog(str(tmp_path / "events.jsonl"))
    other_rank = ChaosHook(plan, 0, events)
    for step in range(1, 8):
        other_rank.at_step(step, None)
        other_rank.during_save(step, None)
    assert events.read() == []
    for _attempt in range(2):  # the second attempt is a restart: nothing fires again
        agent = ChaosHook(plan, 1, events)
        for step in range(1, 8):
            agent.at_step(step, None)
            if step == 5 and _attempt == 0:
                with pytest.raises(RuntimeError, match="injected exception on rank 1 at step 5"):
                    agent.during_save(step, None)
            else:
                agent.during_save(step, None)
    fired = [(e["id"], e["step"], e["when"]) for e in events.read() if e["event"] == "fault"]
    assert fired == [("p", 3, "step"), ("r", 5, "save")]


def test_a_command_job_with_in_rank_faults_must_install_the_hook():
    job = (
        '[job]\nnproc = 2\ncommand = ["x.py", "--ckpt", "{ckpt}"]\n'
        '[[faults]]\nkind = "kill"\nrank = 1\nstep = 3\n'
    )
    with pytest.raises(ScenarioError, match=r"job.command: in-rank faults \(kill-0\) need the job"):
        parse_scenario('name = "x"\n' + job, "bad.toml")
    ok = job.replace('"{ckpt}"]', '"{ckpt}", "--chaos", "{chaos}"]')
    assert parse_scenario('name = "x"\n' + ok, "ok.toml").faults[0].kind == "kill"


def test_the_harness_preloads_what_a_trainer_rank_imports():
    """The harness's fork server list is a copy (resilient imports no sibling package): a module
    the trainer's ranks import that it lacks would be imported again in every rank."""
    from reference_trainer import PRELOAD
    from resilient.chaos.harness import _PRELOAD

    assert set(PRELOAD) <= set(_PRELOAD.split(","))


def test_start_up_phase_triggers_fire_through_the_hook_protocol(tmp_path):
    plan = {
        "marker_dir": str(tmp_path / "faults"),
        "faults": [
            {"id": "p", "kind": "pause", "rank": 1, "when": "import", "seconds": 0.01},
            {"id": "r", "kind": "raise", "rank": 1, "when": "init"},
            {"id": "q", "kind": "pause", "rank": 1, "when": "restore", "seconds": 0.01},
        ],
    }
    events = EventLog(str(tmp_path / "events.jsonl"))
    for attempt in range(2):  # a restart: nothing fires twice
        hook = ChaosHook(plan, 1, events)
        hook.at_phase("import", None)
        if attempt == 0:
            with pytest.raises(RuntimeError, match="injected exception on rank 1 at phase init"):
                hook.at_phase("init_process_group", None)
        else:
            hook.at_phase("init_process_group", None)
        hook.at_phase("restore", None)
        hook.at_step(1, None)
    fired = [(e["id"], e["when"], e["step"]) for e in events.read() if e["event"] == "fault"]
    assert fired == [("p", "import", None), ("r", "init", None), ("q", "restore", None)]


def test_a_fault_with_after_waits_until_the_one_it_follows_has_fired(tmp_path):
    """`after`: the second fault of "a fault during recovery" must not fire in the first
    process-group init, only in the one after the first fault fired (any process)."""
    plan = {
        "marker_dir": str(tmp_path / "faults"),
        "faults": [
            {"id": "first", "kind": "pause", "rank": 1, "step": 4, "when": "step", "seconds": 0},
            {"id": "second", "kind": "raise", "rank": 2, "when": "init", "after": "first"},
        ],
    }
    events = EventLog(str(tmp_path / "events.jsonl"))
    one, two = ChaosHook(plan, 1, events), ChaosHook(plan, 2, events)
    two.at_phase("init_process_group", None)  # not armed yet: nothing happens
    one.at_step(4, None)
    with pytest.raises(RuntimeError, match="injected exception on rank 2 at phase init"):
        two.at_phase("init_process_group", None)
    two.at_phase("init_process_group", None)  # once only
    fired = [e["id"] for e in events.read() if e["event"] == "fault"]
    assert fired == ["first", "second"]


def test_a_spares_hook_takes_the_faults_of_the_rank_it_is_given(tmp_path, monkeypatch):
    """A spare of `resilient launch` builds its hook before it has a rank (no RANK): it must
    fire neither rank 0's faults nor any other until it is given one, then that rank's."""
    plan = {
        "marker_dir": str(tmp_path / "faults"),
        "faults": [
            {"id": "zero", "kind": "pause", "rank": 0, "step": 3, "when": "step", "seconds": 0},
            {"id": "one", "kind": "pause", "rank": 1, "step": 3, "when": "step", "seconds": 0},
        ],
    }
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan, "events": str(tmp_path / "events.jsonl")}))
    hook = ChaosHook.from_file(str(path))
    assert hook.rank is None and hook.faults == []
    monkeypatch.setenv("RANK", "1")  # what init_process_group sets when the agent assigns it
    hook.at_phase("init_process_group", None)
    assert hook.rank == 1 and [f["id"] for f in hook.faults] == ["one"]
    hook.at_step(3, None)
    fired = [
        e["id"] for e in EventLog(str(tmp_path / "events.jsonl")).read() if e["event"] == "fault"
    ]
    assert fired == ["one"]


def test_skew_shifts_the_wall_clock_of_the_targeted_node_only(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", time.time)  # restored after the test
    plan = {
        "marker_dir": str(tmp_path / "faults"),
        "faults": [{"id": "s", "kind": "skew", "node": 1, "seconds": -30.0, "when": "import"}],
    }
    events = EventLog(str(tmp_path / "events.jsonl"))
    true_time = time.time
    ChaosHook(plan, 0, events, node=0).at_phase("import", None)
    assert time.time is true_time  # node 0 keeps its clock
    before = time.time()
    ChaosHook(plan, 2, events, node=1).at_phase("import", None)
    assert -31 < time.time() - before < -29
    ChaosHook(plan, 2, events, node=1).at_phase("import", None)  # the next attempt: skewed once
    assert -31 < time.time() - before < -29
    fired = [e for e in events.read() if e["event"] == "fault"]
    assert [(e["id"], e["rank"], e["seconds"]) for e in fired] == [("s", 2, -30.0)]


def test_never_joined_verdicts_get_the_join_timeout_on_top_of_the_bound():
    verdict = {"time": 100.0, "cause": "never_joined", "waited_s": 15.0, "timeout_s": 10.0}
    # the leader began waiting at 85 s; the fault (a freeze in the imports) came at 88 s: the
    # verdict could not come before 95 s, so 7 s of the 12 s were the join timeout
    assert join_wait(verdict, 88.0) == pytest.approx(7.0)
    assert join_wait({**verdict, "cause": "no_heartbeat"}, 88.0) == 0.0
    assert join_wait(verdict, 99.0) == 0.0  # fault after the wait was over: nothing to add


def test_damaged_checkpoints_fail_verification_and_load_falls_back(tmp_path):
    from resilient import Checkpointer
    from resilient.errors import CheckpointCorruptError

    url = str(tmp_path / "ck")
    with Checkpointer(url) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((4096,), float(step))}).wait()
        detail = damage_newest_checkpoint(ck, "corrupt")
        assert detail["step"] == 2 and detail["damage"] == "corrupt"
        assert not ck.verify(2).ok and ck.verify(1).ok
        state = {"w": torch.zeros(4096)}
        with pytest.raises(CheckpointCorruptError):
            ck.load(state)
        assert ck.load(state, fallback=True) == 1 and torch.equal(state["w"], torch.ones(4096))
        ck.save(3, {"w": torch.full((4096,), 3.0)}).wait()
        damage_newest_checkpoint(ck, "truncate")
        assert not ck.verify(3).ok


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_kill_tree_reaches_workers_in_their_own_sessions():
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    agent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 20
        from resilient.chaos.faults import descendants

        while len(descendants(agent.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        pids = kill_tree(agent.pid)
        assert len(pids) == 2
        agent.wait(timeout=10)
        worker = pids[1]
        deadline = time.time() + 10
        while (
            time.time() < deadline and os.path.exists(f"/proc/{worker}") and _state(worker) != "Z"
        ):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{worker}") or _state(worker) == "Z"
    finally:
        if agent.poll() is None:
            agent.kill()


def test_throttle_stops_and_always_resumes_its_target():
    target = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        helper = throttle(target.pid, 4.0, seconds=1.0)
        seen = set()
        while helper.poll() is None:
            seen.add(_state(target.pid))
            time.sleep(0.003)
        assert "T" in seen  # it was stopped at times
        assert _state(target.pid) != "T"  # and left running
        with pytest.raises(ValueError, match="factor must be > 1"):
            throttle(target.pid, 1.0)
    finally:
        target.send_signal(signal.SIGKILL)
        target.wait()


def test_slow_compute_stretches_torch_ops_but_not_the_rest():
    code = (
        "import time, torch\n"
        "from resilient.chaos.faults import slow_compute\n"
        "x = torch.randn(256, 256)\n"
        "def work():\n"
        "    t, c = time.perf_counter(), time.thread_time()\n"
        "    for _ in range(200): x @ x\n"
        "    return time.perf_counter() - t, time.thread_time() - c\n"
        "def idle():\n"
        "    t = time.perf_counter(); time.sleep(0.2); return time.perf_counter() - t\n"
        # what the ops cost: their CPU time, which a busy machine does not inflate (wall time
        # before the fault, divided by that, only shows how busy the machine is); then the
        # fastest wall time of several tries with the fault: a busy machine only makes it slower
        "cpu, quiet = min(work()[1] for _ in range(3)), min(idle() for _ in range(3))\n"
        "slow_compute(4.0)\n"
        "print(min(work()[0] for _ in range(3)) / cpu, min(idle() for _ in range(3)) / quiet)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ops, other = map(float, r.stdout.split())
    assert ops > 3.0  # at least four times the ops' own time, far from 1
    assert other < 2.0  # time outside torch (a sleep, as a collective's wait) is not stretched 4x


def _slowed_rank_waits_for_a_late_peer(rank, world):
    import torch.distributed as dist

    from resilient.chaos.faults import slowed

    functional = torch.ops._c10d_functional  # what DTensor and FSDP2 call
    group = dist.group.WORLD.group_name

    def c10d():
        dist.all_reduce(torch.zeros(1))

    def funcol():
        functional.wait_tensor(functional.all_reduce(torch.zeros(1), "sum", group))

    waits = {"c10d": [], "functional": []}
    for name, collective in (("c10d", c10d), ("functional", funcol)):
        for _ in range(3):
            dist.barrier()  # outside the fault: each try starts with both ranks here
            if rank == 0:
                time.sleep(0.2)  # the peer is late: the slowed rank's collective waits for it
                collective()
            else:
                with slowed(20):
                    t = time.perf_counter()
                    collective()
                    waits[name].append(time.perf_counter() - t)
    return waits


@pytest.mark.distributed
def test_slow_fault_leaves_a_collectives_wait_unstretched():
    """c10d's collectives go through torch function modes; the slow fault stretched the wait for
    a late peer by its factor (0.2 s became 4 s), which the fault's contract (communication at
    full speed) rules out.  The fastest of three waits, against the 0.2 s the peer is late."""
    from tests.dist import run_distributed

    waits = run_distributed(_slowed_rank_waits_for_a_late_peer, 2, timeout_s=120)[1]
    assert min(waits["c10d"]) < 0.2 * 5, waits  # stretched 20x it would be 4 s
    assert min(waits["functional"]) < 0.2 * 5, waits


def test_faulty_fs_probability_record_and_count_across_processes(tmp_path):
    import fsspec

    from resilient.chaos.faultfs import FaultyFileSystem

    record = tmp_path / "fired.jsonl"
    rules = [{"id": "flaky", "op": "write", "error": "transient", "probability": 0.5}]
    fs = FaultyFileSystem(faults=rules, record=str(record), seed=1)
    failures = 0
    for i in range(40):
        try:
            fs.pipe_file(str(tmp_path / f"f{i}"), b"x")
        except ConnectionError:
            failures += 1
    assert 5 < failures < 35  # some, not all
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert len(lines) == failures and {x["rule"] for x in lines} == {"flaky"}
    # count=1 holds for a second filesystem (a restarted process) sharing the record
    once = [{"id": "once", "op": "write", "error": "enospc", "count": 1}]
    first = FaultyFileSystem(faults=once, record=str(record))
    with pytest.raises(OSError, match="No space left"):
        first.pipe_file(str(tmp_path / "a"), b"x")
    second = FaultyFileSystem(faults=once, record=str(record))
    second.pipe_file(str(tmp_path / "a"), b"x")
    # latency alone: a slow store, not a failing one
    slow = fsspec.filesystem("faulty", faults=[{"op": "write", "latency_s": 0.01}])
    slow.pipe_file(str(tmp_path / "b"), b"y")
    assert slow.fired == [("write", str(tmp_path / "b"), "latency")]


def test_report_without_matplotlib_says_how_to_get_the_picture(tmp_path, monkeypatch):
    from resilient.chaos.report import draw_timeline, markdown

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert draw_timeline(tmp_path, "x") is None
    md = markdown(
        {
            "scenario": "x",
            "passed": True,
            "description": "d",
            "checks": [{"name": "job completed", "ok": True, "detail": "exit codes [0]"}],
            "measurements": {"wall_s": 1.0},
            "run_dir": str(tmp_path),
            "timeline": None,
        }
    )
    assert "pip install 'resilient[plot]'" in md and "| job completed | pass |" in md


def test_cli_rejects_a_bad_scenario_and_a_non_run_directory(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD.replace("rank = 1", "rank = -1"))
    env = dict(os.environ)
    r = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "chaos", "run", str(bad), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "bad.toml:15: faults[0].rank: -1 is not a rank" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "is not a chaos run directory" in r.stderr


def test_an_in_job_recovery_breaks_down_into_its_phases():
    """Teardown to the first healthy rank leaving, regroup to the last one in the new group,
    rebuild to the last start, then load and first step; the spare's takeover beside them."""
    from resilient.chaos.verify import recovery_breakdown

    events = [
        {"event": "start", "time": 0.0, "rank": r, "restart": 0, "generation": 0} for r in range(2)
    ] + [
        {"event": "injob_leave", "time": 10.05, "rank": 0},
        {"event": "spare_takeover", "time": 10.08, "rank": 1, "generation": 1},
        {"event": "injob_rejoin", "time": 10.2, "rank": 0, "generation": 1},
        {"event": "start", "time": 10.4, "rank": 0, "restart": 0, "generation": 1},
        {"event": "start", "time": 10.5, "rank": 1, "restart": 0, "generation": 1},
        {"event": "restore", "time": 10.8, "rank": 0, "seconds": 0.25},
        {"event": "first_step", "time": 11.0, "rank": 0},
    ]
    assert recovery_breakdown(events, 10.0) == {
        "teardown": 0.05,
        "regroup": 0.15,
        "rebuild": 0.3,
        "spare_takeover": 0.08,
        "load": 0.25,
        "first_step": 0.2,
    }


def test_restarts_count_the_attempts_a_node_joining_included():
    """Under ``resilient launch`` a node that joins restarts the workers in a new rendezvous round
    without moving the restart count (and the new node's agent counts from 0): the attempts the
    workers started in are counted, not the restart count alone; in-job generations are not."""
    from resilient.chaos.verify import _restarts

    def starts(attempt, restarts, gen=0):
        return [
            {"event": "start", "rank": r, "restart": n, "attempt": attempt, "generation": gen}
            for r, n in enumerate(restarts)
        ]

    events = starts("round_0", [0, 0]) + starts("round_0", [0], gen=1)  # a spare took a rank
    assert _restarts(events) == 0
    events += starts("round_1", [0, 0])  # node 1 replaced: a new round, the same restart count
    assert _restarts(events) == 1
    events += starts("round_2", [1, 0])  # a failure: node 0's agent counts 1, the new node's 0
    assert _restarts(events) == 2
    # torchrun (no round: the attempt is the restart count), and logs from before attempts
    assert _restarts([{"event": "start", "restart": n} for n in (0, 0, 1, 1, 2)]) == 2


def test_a_restart_is_timed_when_the_first_attempt_never_started():
    """A rank frozen in its imports stops the first attempt before any rank starts: the only
    starts seen are the restart's, and that restart is still a recovery to time."""
    from resilient.chaos.verify import recovery_starts

    restarted = [
        {"event": "start", "time": 20.0 + r, "rank": r, "restart": 1, "attempt": "1"}
        for r in range(2)
    ]
    assert recovery_starts(restarted) == {("1", 0): 20.0}
    first = [{"event": "start", "time": 1.0, "rank": 0, "restart": 0, "attempt": "0"}]
    assert recovery_starts(first + restarted) == {("1", 0): 20.0}
    # resilient launch: a node joined (round 4, restart count 0), then a spare took a rank
    rounds = [
        {"event": "start", "time": 1.0, "rank": 0, "restart": 0, "attempt": "round_3"},
        {"event": "start", "time": 9.0, "rank": 0, "restart": 0, "attempt": "round_4"},
        {"event": "start", "time": 12.0, "rank": 1, "restart": 0, "attempt": "round_4",
         "generation": 1},
    ]  # fmt: skip
    assert recovery_starts(rounds) == {("round_4", 0): 9.0, ("round_4", 1): 12.0}


def test_a_restart_that_restored_the_last_step_is_timed_to_that_restore():
    """A node the harness replaced at step 14 of 20 on a loaded machine went down after step 20
    (its kill came 6 steps late): the restart restored step 20 and trained nothing, and with no
    step after the restart the recovery went untimed ("no restart to time", the scenario
    failed).  It ends with the restore of the last step; a restore of an earlier one does not
    end it (a step must follow)."""
    from resilient.chaos.verify import _restored_last

    events = [
        {"event": "restore", "time": 5.0, "step": 20},  # (before the restart)
        {"event": "restore", "time": 35.0, "step": 19},
        {"event": "restore", "time": 36.0, "step": 20},
    ]
    assert _restored_last(events, 30.0, 20) == 36.0
    assert _restored_last(events[:2], 30.0, 20) is None
    assert _restored_last(events, 30.0, None) is None


def test_close_final_states_are_compared_in_norm_the_moments_more_loosely(tmp_path):
    """A job that changed its layout is compared in norm: a last-step gradient that went a little
    the other way (a top-k routing near-tie) passes, although one element of a moment is off by
    more than any elementwise tolerance; a weight or a moment off by what a lost step moves them
    does not, nor a second moment of tiny values zeroed, a step counter off by one, an integer,
    a NaN or an infinity."""
    from resilient import Checkpointer
    from resilient.chaos.harness import RunPaths
    from resilient.chaos.scenario import Expect
    from resilient.chaos.verify import _compare_final

    g = torch.Generator().manual_seed(0)
    ref = {
        "model": {"w": torch.randn(64, 32, generator=g), "n": torch.arange(1000)},
        "optim": {
            "m": torch.randn(64, 32, generator=g) * 1e-2,
            "v": torch.rand(64, 32, generator=g) * 1e-8,
            "step": torch.tensor(20000.0),
        },
    }
    ref["optim"]["m"][5, 5] = float("nan")  # the reference's own NaN: the run must have it too
    Checkpointer(str(tmp_path / "ref" / "ckpt")).save(20, ref).wait()

    def check(name, change) -> tuple[bool, str]:
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in ref.items()}
        change(state)
        Checkpointer(str(tmp_path / name / "ckpt")).save(20, state).wait()
        expect = Expect(final_state="close")
        c = _compare_final(RunPaths(tmp_path / name), RunPaths(tmp_path / "ref"), 20, expect)
        return c.ok, c.detail

    def flip(s):  # 4e-3 of the moments' norm, and one element by 3e-5 (its value: ~1e-2)
        s["optim"]["m"].mul_(1.004)
        s["optim"]["m"][3, 7].add_(3e-5)
        s["optim"]["v"].mul_(1.004)
        s["model"]["w"].mul_(1 + 1e-6)

    ok, detail = check("flip", flip)
    assert ok, detail
    assert "moments 4.0e-03" in detail
    ok, detail = check("same", lambda s: None)
    assert ok, detail
    for name, change, tensor in [
        ("weights", lambda s: s["model"]["w"].mul_(1.01), "model.w"),
        ("moment", lambda s: s["optim"]["m"].mul_(1.05), "optim.m"),
        ("second", lambda s: s["optim"]["v"].zero_(), "optim.v"),
        ("step", lambda s: s["optim"]["step"].add_(1), "optim.step"),
        ("int", lambda s: s["model"]["n"][-1].add_(1), "model.n"),
        ("dtype", lambda s: s["model"].__setitem__("w", s["model"]["w"].double()), "model.w"),
        ("other-inf", lambda s: s["optim"]["m"].__setitem__((5, 5), float("-inf")), "optim.m"),
        ("nan", lambda s: s["model"]["w"].__setitem__((0, 0), float("nan")), "model.w"),
        ("inf", lambda s: s["optim"]["m"].__setitem__((0, 0), float("inf")), "optim.m"),
    ]:
        ok, detail = check(name, change)
        assert not ok and tensor in detail, (name, detail)


def test_a_skewed_node_that_holds_the_leader_is_seen_from_the_other_side():
    """Which agent's workers get ranks 0..nproc-1 is the rendezvous's choice: when the skewed
    node holds the leader, the leader sees the other node's ranks ahead by the skew."""
    from types import SimpleNamespace

    from resilient.chaos.verify import _expected_skew

    fault = SimpleNamespace(id="skew", seconds=-30.0, rank=None, node=1)
    fired_on = lambda r: [{"event": "fault", "id": "skew", "rank": r}]  # noqa: E731
    # node 1 got ranks 2, 3: the leader (rank 0) sees them 30 s behind
    events = fired_on(3)
    assert _expected_skew(fault, {"rank": 2, "leader": 0}, events, 2) == -30.0
    assert _expected_skew(fault, {"rank": 1, "leader": 0}, events, 2) == 0.0
    # node 1 got ranks 0, 1: the leader is skewed; ranks 2, 3 are 30 s ahead of it
    events = fired_on(1)
    assert _expected_skew(fault, {"rank": 2, "leader": 0}, events, 2) == 30.0
    assert _expected_skew(fault, {"rank": 1, "leader": 0}, events, 2) == 0.0
    # a fault on one rank skews that rank alone
    one = SimpleNamespace(id="skew", seconds=5.0, rank=3, node=None)
    assert _expected_skew(one, {"rank": 3, "leader": 0}, [], 2) == 5.0
    assert _expected_skew(one, {"rank": 2, "leader": 0}, [], 2) == 0.0
