"""Real torchrun: a frozen (SIGSTOPped) rank is declared DEAD within seconds, its stacks and the
failure record reach the event log, the leader kills it, and every live rank exits with the
documented code so that torchrun can restart the group."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resilient.health import EXIT_RANK_FAILURE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def worker_pid(launcher: int, rank: int) -> int | None:
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            stat = (child / "stat").read_text().split()
            env = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[3]) == launcher and f"RANK={rank}".encode() in env:
            return int(child.name)
    return None


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def test_frozen_rank_is_declared_dead_killed_and_the_group_exits_for_a_restart(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_DETECT="1")
    cmd = [
        sys.executable,
        "-m",
        "reference_trainer",
        "--nproc",
        "2",
        "--dp",
        "2",
        "--steps",
        "100000",
        "--save-every",
        "5",
        "--global-batch",
        "32",
        "--ckpt",
        str(tmp_path / "ck"),
        "--metrics",
        str(tmp_path / "m.jsonl"),
    ]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.time() + 120
        while (
            last_step(tmp_path / "m.jsonl") < 8 and time.time() < deadline and proc.poll() is None
        ):
            time.sleep(0.02)
        pid = worker_pid(proc.pid, 1)
        assert pid is not None, (tmp_path / "run.log").read_text()[-3000:]
        os.kill(pid, signal.SIGSTOP)  # frozen: its heartbeat thread stops with it
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1  # no --max-restarts: torchrun reports the failed group
    events = [
        json.loads(line) for line in (tmp_path / "ck" / "events.jsonl").read_text().splitlines()
    ]
    verdict = next(e for e in events if e["event"] == "verdict")
    assert verdict["verdict"] == "DEAD" and verdict["rank"] == 1 and verdict["pid"] == pid
    assert verdict["last_step"] >= 8 and verdict["seconds_since_alive"] < 10
    assert any(e["event"] == "killed" and e["pid"] == pid for e in events)
    stacks = next(e for e in events if e["event"] == "stacks" and e["rank"] == 0)
    assert "most recent call first" in stacks["stacks"]
    assert any(
        e["event"] == "exit" and e["rank"] == 0 and e["code"] == EXIT_RANK_FAILURE for e in events
    )


@pytest.mark.parametrize(
    "sig,victim",
    [("SIGSTOP", 1), ("SIGKILL", 1), ("SIGSTOP", 0)],
    ids=["frozen-rank", "killed-rank", "frozen-leader"],
)
def test_recovery_under_torchrun_restarts_is_bit_exact(tmp_path, sig, victim):
    from tests.integration.trainer_runs import gather_checkpoint

    steps = 40
    env = dict(os.environ, OMP_NUM_THREADS="1", RESILIENT_DETECT="1")

    def cmd(name):
        return [
            sys.executable,
            "-m",
            "reference_trainer",
            "--nproc",
            "2",
            "--dp",
            "2",
            "--max-restarts",
            "2",
            "--steps",
            str(steps),
            "--save-every",
            "5",
            "--global-batch",
            "32",
            "--ckpt",
            str(tmp_path / name),
            "--metrics",
            str(tmp_path / f"{name}.jsonl"),
        ]

    ref = subprocess.run(cmd("ref"), env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(
        cmd("ck"), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.time() + 120
        while (
            last_step(tmp_path / "ck.jsonl") < 12 and time.time() < deadline and proc.poll() is None
        ):
            time.sleep(0.01)
        pid = worker_pid(proc.pid, victim)
        assert pid is not None
        os.kill(pid, getattr(signal, sig))  # frozen (only our detector sees it) or dead
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    events = [
        json.loads(line) for line in (tmp_path / "ck" / "events.jsonl").read_text().splitlines()
    ]
    if sig == "SIGSTOP":  # a dead process is also seen by torchrun itself, which may act first
        assert any(e["event"] == "verdict" and e["rank"] == victim for e in events)
    if victim == 0:  # the leader froze: the next rank took over and issued the verdict
        assert any(e["event"] == "leader" and e["rank"] == 1 for e in events)
    restarts = [e.get("restart", 0) for e in events if e["event"] == "monitor"]
    assert max(restarts) >= 1  # the group restarted and resumed
    a, b = (
        gather_checkpoint(str(tmp_path / "ref"), steps),
        gather_checkpoint(str(tmp_path / "ck"), steps),
    )
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigterm_to_the_whole_job_saves_the_current_step_exits_0_and_resumes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def cmd(steps):
        return [
            sys.executable,
            "-m",
            "reference_trainer",
            "--nproc",
            "2",
            "--dp",
            "2",
            "--steps",
            str(steps),
            "--save-every",
            "1000",
            "--global-batch",
            "32",
            "--ckpt",
            str(tmp_path / "ck"),
            "--metrics",
            str(tmp_path / "m.jsonl"),
        ]

    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(
        cmd(100_000), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.time() + 120
        while (
            last_step(tmp_path / "m.jsonl") < 8 and time.time() < deadline and proc.poll() is None
        ):
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGTERM)  # the scheduler preempts every process of the job
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
    from resilient import Checkpointer

    stopped_at = last_step(tmp_path / "m.jsonl")
    assert Checkpointer(str(tmp_path / "ck")).steps() == [stopped_at]  # the current step, no other
    again = subprocess.run(
        cmd(stopped_at + 3), env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps[-3:] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]  # resumed after it
