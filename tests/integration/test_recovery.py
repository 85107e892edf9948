"""Real launches (``--nproc``: ``resilient launch``, torch.distributed.elastic's agent, no spares):
frozen, killed and preempted ranks.

A frozen (SIGSTOPped) rank is declared DEAD within seconds, its stacks and the failure record reach
the event log, the leader kills it, and every live rank exits with the documented code so that
the launcher restarts the group, which completes bit-identical to an uninterrupted run.  SIGTERM to the
whole job saves the current step and exits 0.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.chaos.faults import worker_pid
from resilient.chaos.harness import forked_launcher
from resilient.health import EXIT_RANK_FAILURE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def trainer(tmp_path: Path, name: str, steps: int, save_every: int, *extra: str) -> list[str]:
    """The reference trainer on 2 launched ranks (dp 2), checkpoints and metrics under tmp_path."""
    return [
        sys.executable,
        "-m",
        "reference_trainer",
        "--nproc",
        "2",
        "--dp",
        "2",
        *extra,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--global-batch",
        "32",
        "--ckpt",
        str(tmp_path / name),
        "--metrics",
        str(tmp_path / f"{name}.jsonl"),
    ]


def run_and_signal(
    tmp_path: Path,
    cmd: list[str],
    env: dict,
    metrics: Path,
    at_step: int,
    hit: Callable[[int], Any],
    *,
    forked: bool = True,
) -> tuple[int, Any]:
    """Launch ``cmd`` in its own session, call ``hit(launcher_pid)`` once ``metrics`` reach
    ``at_step``, wait for the job; returns (exit code, what ``hit`` returned).  ``forked``: the
    launcher forked from this process's server for launchers (``forked_launcher``: no
    ``import torch`` of its own; ``launcher_pid`` is then its stand-in's), else a new
    interpreter (a signal to the launcher's process group reaches the ranks too)."""
    if forked:
        cmd, env = forked_launcher(cmd, env)
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.time() + 120
        while last_step(metrics) < at_step and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        result = hit(proc.pid)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, result


def events_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def signal_rank(rank: int, sig: int, log: Path):
    def hit(launcher: int) -> int:
        pid = worker_pid(launcher, rank)
        assert pid is not None, log.read_text()[-3000:]
        os.kill(pid, sig)
        return pid

    return hit


def test_frozen_rank_is_declared_dead_killed_and_the_group_exits_for_a_restart(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_DETECT="1")
    # frozen: its heartbeat thread stops with it
    rc, pid = run_and_signal(
        tmp_path,
        trainer(tmp_path, "ck", 100_000, 5),
        env,
        tmp_path / "ck.jsonl",
        8,
        signal_rank(1, signal.SIGSTOP, tmp_path / "run.log"),
    )
    assert rc == 1  # no --max-restarts: the launcher reports the failed group
    events = events_of(tmp_path / "ck" / "events.jsonl")
    verdict = next(e for e in events if e["event"] == "verdict")
    assert verdict["verdict"] == "DEAD" and verdict["rank"] == 1 and verdict["pid"] == pid
    assert verdict["last_step"] >= 8 and verdict["seconds_since_alive"] < 10
    assert any(e["event"] == "killed" and e["pid"] == pid for e in events)
    stacks = next(e for e in events if e["event"] == "stacks" and e["rank"] == 0)
    assert "most recent call first" in stacks["stacks"]
    assert any(
        e["event"] == "exit" and e["rank"] == 0 and e["code"] == EXIT_RANK_FAILURE for e in events
    )


REFERENCE_STEPS = 40


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The fault-free run the recoveries must reproduce bit for bit (one for the module)."""
    root = tmp_path_factory.mktemp("reference")
    cmd, env = forked_launcher(
        trainer(root, "ref", REFERENCE_STEPS, 5, "--max-restarts", "2"),
        dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_DETECT="1"),
    )
    ref = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    return root / "ref"


@pytest.mark.parametrize(
    "sig,victim",
    [("SIGSTOP", 1), ("SIGKILL", 1), ("SIGSTOP", 0)],
    ids=["frozen-rank", "killed-rank", "frozen-leader"],
)
def test_recovery_by_restarts_is_bit_exact(tmp_path, reference, sig, victim):
    from tests.integration.trainer_runs import gather_checkpoint

    steps = REFERENCE_STEPS
    env = dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_DETECT="1")
    # frozen (only our detector sees it) or dead
    rc, _ = run_and_signal(
        tmp_path,
        trainer(tmp_path, "ck", steps, 5, "--max-restarts", "2"),
        env,
        tmp_path / "ck.jsonl",
        12,
        signal_rank(victim, getattr(signal, sig), tmp_path / "run.log"),
    )
    assert rc == 0, (tmp_path / "run.log").read_text()[-4000:]
    events = events_of(tmp_path / "ck" / "events.jsonl")
    if sig == "SIGSTOP":  # a dead process is also seen by the launcher itself, which may act first
        assert any(e["event"] == "verdict" and e["rank"] == victim for e in events)
    if victim == 0:  # the leader froze: the next rank took over and issued the verdict
        assert any(e["event"] == "leader" and e["rank"] == 1 for e in events)
    restarts = [e.get("restart", 0) for e in events if e["event"] == "monitor"]
    assert max(restarts) >= 1  # the group restarted and resumed
    a, b = (
        gather_checkpoint(str(reference), steps),
        gather_checkpoint(str(tmp_path / "ck"), steps),
    )
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigterm_to_the_whole_job_saves_the_current_step_exits_0_and_resumes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    metrics = tmp_path / "ck.jsonl"

    def preempt(launcher: int) -> None:
        os.killpg(launcher, signal.SIGTERM)  # the scheduler preempts every process of the job

    rc, _ = run_and_signal(
        tmp_path, trainer(tmp_path, "ck", 100_000, 1000), env, metrics, 8, preempt, forked=False
    )
    assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    from resilient import Checkpointer

    stopped_at = last_step(metrics)
    assert Checkpointer(str(tmp_path / "ck")).steps() == [stopped_at]  # the current step, no other
    again = subprocess.run(
        trainer(tmp_path, "ck", stopped_at + 3, 1000),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-3:] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]  # resumed after it
