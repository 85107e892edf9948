"""``resilient launch``: in-job recovery with a hot spare, and the fallback to a restart.

Real processes throughout: the launcher (torch.distributed.elastic's rendezvous, store and agent
loop, with this toolkit's worker policy), two gloo ranks running ``tests/injob_job.py`` under
``@fault_tolerant`` with a memory snapshot every step, and a spare.  A rank SIGKILLs itself once
after a given step; the job must finish with weights bit-identical to a fault-free run's.  Where
in-job recovery cannot work (a rank that fails before the group formed, or after another
finished), the launcher says why and falls back to torchrun's policy at once: the spare would
otherwise wait for a generation that cannot form until its bound (120 s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from resilient.chaos.harness import forked_launcher
from tests.test_launch_cli_errors import _alive

JOB = Path(__file__).with_name("injob_job.py")
ROOT = Path(__file__).resolve().parents[1]
STEPS = 14
# Ranks and spares forked from the launcher's fork server with torch and resilient imported
# (``--preload``, the launcher's own option): each saves the 2 s of CPU an interpreter takes to
# import them (the file took 169 s of CPU with every process its own interpreter, 136 s with all
# but one test preloaded), and their launcher forked from this process's server for launchers
# (``forked_launcher``: another ``import torch`` less a job; every test's).  The tests marked
# ``plain=True`` start every rank and spare as its own interpreter, as plain torchrun does (and
# ``resilient launch`` without ``--preload``): among them the faults at the job's
# end, whose order ("after rank 0's process is gone") is judged on the process the launcher
# watches, which under --preload is the fork server's stand-in, not the rank's own process.
# torch._dynamo is what torch.optim.AdamW imports when it is made: another 1.3 s in each rank.
PRELOAD = ("--preload", "torch,torch._dynamo,resilient")


JOB_VARS = ("INJOB_KILL", "INJOB_HELPER", "INJOB_SPARE_DIE", "INJOB_SPARE_CRASH")


def run_job(
    tmp: Path,
    name: str,
    *flags: str,
    kill: str | None = None,
    timeout_s: float = 240,
    plain: bool = False,
    **job: str,
) -> tuple[int, str, Path]:
    """``resilient launch`` of the job on 2 ranks; (exit code, the launcher's stderr, the job's
    output folder).  ``job``: the job's other variables (``INJOB_HELPER="1"``, ...); ``plain``:
    without ``PRELOAD``."""
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    for var in JOB_VARS:
        env.pop(var, None)
    env.update(job)
    if kill:
        env["INJOB_KILL"] = kill
    cmd = [
        sys.executable, "-m", "resilient.cli", "launch", "--nproc-per-node", "2",
        *(() if plain else PRELOAD), *flags, str(JOB), str(out / "ckpt"), str(STEPS), str(out / "out.json"),
    ]  # fmt: skip
    # the launcher forked from this process's server for launchers (its ranks and spares, with
    # ``plain``, still each a new interpreter: what a launcher starts is what is tested)
    cmd, env = forked_launcher(cmd, env)
    # a session of its own: at a timeout the launcher, its workers and spares go together
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(
            f"resilient launch did not finish in {timeout_s:.0f} s:\n{stderr[-6000:]}"
        ) from None
    (out / "launcher.log").write_text(stderr)
    return p.returncode, stdout[-3000:] + stderr, out


def launch(tmp: Path, name: str, *flags: str, **kw: Any) -> tuple[dict, list[dict]]:
    """A job that must succeed: (its OUT.json, its event log)."""
    rc, log, out = run_job(tmp, name, *flags, **kw)
    assert rc == 0, log[-9000:]
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
    got, events = launch(tmp_path, "injob", "--spares", "1", kill="1:7", plain=True)
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
    assert got["role_ranks"] == ["0", "1"]  # the spare took the rank's ROLE_RANK too


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


# --- where in-job recovery cannot work: torchrun's policy at once --------------------------------
# (the 100 s timeouts only bound a stall: the spare would wait 120 s for its generation)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_after_another_finished_falls_back_at_once(tmp_path):
    """Rank 1 dies after the last collective, once rank 0 has exited 0: no spare can form a group
    with a rank that is gone, so the launcher applies torchrun's policy (no restarts: fail)."""
    rc, log, out = run_job(
        tmp_path, "end", "--spares", "1", kill="1:end:KILL:last", timeout_s=100, plain=True
    )
    assert rc == 1, log[-6000:]
    assert "in-job recovery not possible (local rank 0 already finished (exit code 0))" in log
    assert "takes its rank" not in log, log[-6000:]
    assert "rank 1 (pid" in log and "failed with exit code -9" in log, log[-3000:]
    assert json.loads((out / "out.json").read_text())["step"] == STEPS


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} (the launcher exited with {proc.poll()})")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_after_one_on_another_node_finished_falls_back_at_once(tmp_path):
    """Two nodes (two launchers, one rank each): rank 1 dies once rank 0, on the other node, has
    exited 0.  Rank 1's agent cannot see that process; rank 0's agent says so in the store, so
    no spare waits for a generation that cannot form (120 s) before the job fails; nor does a
    restart (one is left) wait for a rendezvous that node 0, its workers done, never joins; and
    node 0's launcher does not wait out torchrun's exit barrier (300 s) for node 1's."""
    restarts = "1"
    from resilient.launch import free_port

    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    for var in JOB_VARS:
        env.pop(var, None)
    env["INJOB_KILL"] = "1:end:KILL:last"
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "resilient.cli", "launch", "--spares", "1", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", restarts, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"finished-{port}",
            str(JOB), str(out / "ckpt"), str(STEPS), str(out / "out.json"),
        ]  # fmt: skip
        mem = {"RESILIENT_MEMORY_ROOT": str(tmp_path / f"memory{node}")}
        cmd, node_env = forked_launcher(cmd, {**env, **mem})  # (its ranks new interpreters)
        procs.append(subprocess.Popen(
            cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        ))  # fmt: skip
        if node == 0:  # node 0's launcher hosts the rendezvous store, and outlives node 1's
            _wait_for_port(port, procs[0])
    logs = []
    try:
        for p in procs:  # node 0's launcher, its workers done, waits in the exit barrier for 1's
            logs.append(p.communicate(timeout=100)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(
            f"node {len(logs)}'s launcher did not finish in 100 s:\n"
            + procs[len(logs)].communicate()[0][-6000:]
        ) from None
    assert procs[0].returncode == 0, logs[0][-6000:]  # (its workers succeeded, as torchrun's)
    assert procs[1].returncode == 1, logs[1][-6000:]
    # ("... already finished": seen before the takeover; "... finished before generation 1
    # formed": rank 0's agent said so only once the spare had been given rank 1)
    said = "a rank on another node" in logs[1] and "finished (exit code 0)" in logs[1]
    assert said, logs[1][-6000:]
    assert "failed with exit code -9" in logs[1] and "exit code 75" not in logs[1], logs[1][-3000:]
    assert "not restarting the workers either" in logs[1], logs[1][-6000:]
    assert json.loads((out / "out.json").read_text())["step"] == STEPS


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_finishes_while_a_generation_forms_ends_the_recovery(tmp_path):
    """Rank 1 dies after the last collective, and rank 0 exits 0 once the launcher has given rank
    1 to the spare: generation 1 can never form, so the launcher stops waiting for it."""
    rc, log, out = run_job(
        tmp_path, "end-first", "--spares", "1", kill="1:end:KILL:first", timeout_s=100, plain=True
    )
    assert rc == 1, log[-6000:]
    assert "takes its rank, generation 1" in log, log[-6000:]
    assert "(local rank 0 finished (exit code 0) before generation 1 formed)" in log, log[-6000:]
    # the failure reported is rank 1's own, not the spare's (75, when it gave up on the group)
    assert "failed with exit code -9" in log and "exit code 75" not in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_lost_before_the_group_formed_restarts_the_workers(tmp_path, reference):
    """Rank 1 dies at import, while rank 0 waits in generation 0's rendezvous: a spare cannot
    join that rendezvous, so the workers restart (and finish bit-identical)."""
    got, events = launch(
        tmp_path, "import", "--spares", "1", "--max-restarts", "1", kill="1:import"
    )
    assert got["weights"] == reference["weights"]
    log = (tmp_path / "import" / "launcher.log").read_text()
    assert "(generation 0 of the group had not formed (0 of 2 ranks))" in log, log[-6000:]
    assert "takes its rank" not in log and "restarting the workers" in log, log[-6000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_takeover_before_a_restart_does_not_refuse_one_after_it(tmp_path, reference):
    """Rank 1 is taken over (step 3), fails again at once (step 5: a restart), and is killed once
    more after the restart (step 8): that is a new process, which no spare has taken over yet."""
    got, events = launch(
        tmp_path, "stale", "--spares", "1", "--max-restarts", "1", kill="1:3,1:5,1:8"
    )
    assert got["weights"] == reference["weights"]
    log = (tmp_path / "stale" / "launcher.log").read_text()
    assert log.count("failed again within") == 1, log[-6000:]
    assert log.count("restarting the workers") == 1, log[-6000:]
    assert log.count("takes its rank, generation 1") == 2, log[-6000:]  # before and after


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("plain", [True, False], ids=["", "preload"])
def test_a_failed_ranks_children_go_with_it(tmp_path, plain):
    """A rank's helper (a child in its process group) goes when the rank fails and a spare takes
    its place, as torchrun's stop of a worker's group takes it: it did not, and outlived the
    job.  With --preload the rank is forked by the fork server: its stand-in does it."""
    rc, log, out = run_job(
        tmp_path, "helper", "--spares", "1", kill="1:7", plain=plain, INJOB_HELPER="1"
    )
    helpers = {int(p.name.split(".")[1]): int(p.name.split(".")[2]) for p in out.glob("helper.*")}
    try:
        assert rc == 0, log[-6000:]
        got = json.loads((out / "out.json").read_text())
        killed = [h for r, h in helpers.items() if r not in got["pids"]]
        assert len(killed) == 1 and len(helpers) == 3, (helpers, got["pids"])
        deadline = time.monotonic() + 10  # (SIGKILL: gone at once; a margin for the reaper)
        while _alive(killed[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(killed[0]), "the killed rank's helper still runs after the job ended"
    finally:
        for pid in helpers.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.slow
@pytest.mark.distributed
def test_a_spare_that_dies_idle_is_replaced(tmp_path, reference):
    """The spare is killed while it waits for a rank; another starts in its place and takes rank
    1 when that is killed (step 7): in-job recovery, no restart (there is none to fall back to)."""
    got, events = launch(tmp_path, "sparedie", "--spares", "1", kill="1:7", INJOB_SPARE_DIE="1")
    assert got["weights"] == reference["weights"]
    log = (tmp_path / "sparedie" / "launcher.log").read_text()
    assert "spare 0 (pid" in log and "exited with -9: starting another" in log, log[-6000:]
    assert "takes its rank, generation 1" in log, log[-6000:]
    assert len(pids(events, 0)) == 1  # no restart


@pytest.mark.slow
@pytest.mark.distributed
def test_a_spare_that_fails_at_import_is_not_started_again(tmp_path):
    """A script that fails in a spare (at import, before it waits for a rank) would fail in every
    other spare too: reported once, not started again in a loop."""
    launch(tmp_path, "sparecrash", "--spares", "1", INJOB_SPARE_CRASH="1")
    log = (tmp_path / "sparecrash" / "launcher.log").read_text()
    assert log.count("spare 0 (pid") == 1 and "exited with 1, not replaced (before" in log, log
    assert "spare 1 (pid" not in log, log[-6000:]


_ENV_PROBE = """
import json, os, sys, time
if os.environ.get("RESILIENT_SPARE"):
    names = ("RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK")
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({k: os.environ.get(k) for k in names}, f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    sys.exit(0)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.distributed
def test_a_spare_starts_without_the_launchers_rank(tmp_path):
    """A spare has no rank until it is given one (README): not the RANK, LOCAL_RANK or ROLE_RANK
    that the launcher itself was started with (an outer launcher's, a shell's)."""
    (tmp_path / "w.py").write_text(_ENV_PROBE)
    probe = tmp_path / "spare.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "5", "LOCAL_RANK": "5", "ROLE_RANK": "5"}
    p = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "launch", "--nproc-per-node", "1", "--spares", "1",
         str(tmp_path / "w.py"), str(probe)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(probe.read_text())
    assert got == {"RANK": None, "LOCAL_RANK": None, "ROLE_RANK": None, "GROUP_RANK": "0"}
