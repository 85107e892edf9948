"""``resilient launch``: in-job recovery with a hot spare, and the fallback to a restart.

Real processes throughout: the launcher (torch.distributed.elastic's rendezvous, store and agent
loop, with this toolkit's worker policy), two gloo ranks running ``tests/injob_job.py`` under
``@fault_tolerant`` with a memory snapshot every step, and a spare.  A rank SIGKILLs itself once
after a given step; the job must finish with weights bit-identical to a fault-free run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("injob_job.py")
ROOT = Path(__file__).resolve().parents[1]
STEPS = 14


def launch(tmp: Path, name: str, *flags: str, kill: str | None = None) -> tuple[dict, list[dict]]:
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("INJOB_KILL", None)
    if kill:
        env["INJOB_KILL"] = kill
    cmd = [
        sys.executable, "-m", "resilient.cli", "launch", "--nproc-per-node", "2", *flags,
        str(JOB), str(out / "ckpt"), str(STEPS), str(out / "out.json"),
    ]  # fmt: skip
    # a session of its own: at a timeout the launcher, its workers and spares go together
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(
            f"resilient launch did not finish in 240 s:\n{stderr[-6000:]}"
        ) from None
    assert p.returncode == 0, stdout[-3000:] + stderr[-6000:]
    (out / "launcher.log").write_text(stderr)
    with open(out / "ckpt" / "events.jsonl") as f:
        events = [json.loads(line) for line in f if line.strip()]
    with open(out / "out.json") as f:
        return json.load(f), events


def pids(events: list[dict], rank: int) -> set[str]:
    return {e["pid"] for e in events if e["event"] == "start" and str(e["rank"]) == str(rank)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ref"), "ref", "--spares", "0")[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_rank_is_replaced_by_a_spare_while_the_healthy_rank_stays(tmp_path, reference):
    got, events = launch(tmp_path, "injob", "--spares", "1", kill="1:7")
    assert got["weights"] == reference["weights"]  # bit-identical to the fault-free run
    assert got["step"] == STEPS
    kinds = [e["event"] for e in events]
    assert "injob_leave" in kinds and "injob_rejoin" in kinds, kinds
    assert len(pids(events, 0)) == 1  # rank 0 never restarted: the same process throughout
    assert len(pids(events, 1)) == 2  # rank 1: the killed process, then the spare
    starts = [e["pid"] for e in events if e["event"] == "start" and str(e["rank"]) == "1"]
    assert int(starts[-1]) == got["pids"][1] != int(starts[0])  # the spare finished the job
    rejoin = next(e for e in events if e["event"] == "injob_rejoin")
    assert int(rejoin["generation"]) == 1
    restore = [e for e in events if e["event"] == "restore"]
    assert restore and restore[-1]["source"] == "memory"
    # killed before step 7's update: step 6's snapshot may still be committing (then it is
    # abandoned), step 5's is committed: at most one completed step is lost
    assert int(restore[-1]["step"]) >= 5
    log = (tmp_path / "injob" / "launcher.log").read_text()
    assert "takes its rank, generation 1" in log


@pytest.mark.slow
@pytest.mark.distributed
def test_frozen_rank_is_killed_on_the_verdict_and_replaced_in_job(tmp_path, reference):
    got, events = launch(tmp_path, "frozen", "--spares", "1", kill="1:7:STOP")
    assert got["weights"] == reference["weights"]
    verdicts = [(e["verdict"], str(e["rank"])) for e in events if e["event"] == "verdict"]
    assert ("DEAD", "1") in verdicts, verdicts
    assert len(pids(events, 0)) == 1 and len(pids(events, 1)) == 2
    assert "injob_rejoin" in [e["event"] for e in events]


@pytest.mark.slow
@pytest.mark.distributed
def test_without_a_spare_the_workers_restart_as_under_torchrun(tmp_path, reference):
    got, events = launch(tmp_path, "restart", "--spares", "0", "--max-restarts", "1", kill="1:7")
    assert got["weights"] == reference["weights"]
    assert "injob_rejoin" not in [e["event"] for e in events]
    assert len(pids(events, 0)) == 2  # every worker started again
    restarts = {str(e["restart"]) for e in events if e["event"] == "start"}
    assert restarts == {"0", "1"}


def test_spares_flag_is_checked_before_anything_starts():
    from resilient.launch.agent import parse_args

    assert parse_args(["--nproc-per-node", "2", "train.py"]).spares == 1
    assert parse_args(["--spares", "3", "train.py", "--spares", "9"]).spares == 3
    p = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "launch", "--spares", "-1", "train.py"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 2
    assert "--spares" in p.stderr and "whole number" in p.stderr
