"""``resilient launch --finish-timeout``: a worker still running that long after a worker of the job
finished (exit code 0) is named, with what /proc says it is doing, and killed; torchrun's policy
takes it from there (a restart, or the job fails).  Before it, a rank frozen (SIGSTOP) or hung
after its last step kept the job from ending forever, its peers done and its checkpoint committed
(torchrun waits for every worker; seen in the chaos suite as a job that only the harness's timeout
ended).  The workers here are plain Python (no process group): the launcher is what is tested."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.chaos.harness import forked_launcher
from resilient.launch import free_port
from resilient.launch.agent import describe_process

ROOT = Path(__file__).resolve().parents[1]

# RANK 1 of the first attempt stays behind in the way argv[1] says (every rank but 0, for
# "hang-others"); every other worker leaves at once (exit code 0), rank 0 noting when.  Each
# start leaves a file: start-<rank>-<restart>.
_WORKER = """
import os, signal, subprocess, sys, time
from pathlib import Path
mode, out = sys.argv[1], Path(sys.argv[2])
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
(out / f"start-{rank}-{restart}").write_text(str(os.getpid()))
if rank == 0:
    (out / "rank0-left").write_text(repr(time.time()))
elif mode == "hang-others":  # the first time this rank number runs (torch's restart for a
    # node that joins a new round keeps the other nodes' restart count)
    if not (out / f"hung-{rank}").exists():
        (out / f"hung-{rank}").touch()
        time.sleep(3600)
elif restart == 0 and rank == 1:
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "hang":
        time.sleep(3600)
    elif mode == "hang-stacks":  # as a rank of the toolkit: it dumps its stacks when asked
        from resilient.launch import dump_stacks_on_signal
        dump_stacks_on_signal()
        def stuck_in_teardown():
            time.sleep(3600)
        stuck_in_teardown()
    elif mode == "busy":  # working on alone (an export) for a few bounds' time, then done
        t = time.monotonic()
        while time.monotonic() - t < 4:
            pass
    elif mode == "child-busy":  # the same work in a child process, the rank waiting for it
        code = "import time\\nt = time.monotonic()\\nwhile time.monotonic() - t < 4: pass\\n"
        subprocess.run([sys.executable, "-c", code], check=True)
    elif mode == "late-busy":  # idle (an upload) for most of the bound, then computing
        while not (out / "rank0-left").exists():
            time.sleep(0.01)
        t0 = float((out / "rank0-left").read_text())
        time.sleep(max(0.0, t0 + float(sys.argv[3]) - time.time()))
        t = time.monotonic()
        while time.monotonic() - t < 4:
            pass
    elif mode == "flag":
        while not (out / "go").exists():
            time.sleep(0.02)
(out / f"done-{rank}").write_text("1")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR", **extra}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _launch(tmp: Path, mode: str, *flags: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    (tmp / "w.py").write_text(_WORKER)
    # the launcher forked from this process's server for launchers (its workers as they were)
    cmd, env = forked_launcher(
        [sys.executable, "-m", "resilient.cli", "launch", "--spares", "0", *flags,
         str(tmp / "w.py"), mode, str(tmp), *extra],
        _env(),
    )  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _finish(p: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(
            f"the launcher did not end in {timeout} s:\n" + p.communicate()[0][-4000:]
        ) from None


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_rank_hung_after_its_peers_finished_is_killed_and_the_restart_ends_the_job(tmp_path):
    p = _launch(tmp_path, "hang", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                "1", "--finish-timeout", "1")  # fmt: skip
    log = _finish(p)
    assert p.returncode == 0, log[-4000:]
    hung = int((tmp_path / "start-1-0").read_text())
    assert "rank 1 (local rank 1, pid " in log and "--finish-timeout 1s); process" in log, log[
        -4000:
    ]
    assert "local rank 0 finished (exit code 0)" in log and "is sleeping" in log, log[-4000:]
    assert (tmp_path / "start-1-1").exists(), "the workers were not restarted"
    assert _gone(hung)


@pytest.mark.parametrize("preload", ["", "json"], ids=["worker", "forked-rank"])
def test_a_frozen_rank_with_no_restart_left_fails_the_job_by_name_and_is_not_left_behind(
    tmp_path, preload
):
    """With ``--preload`` the worker is a fork server's stand-in: the rank it stands for is the
    one described (the stand-in itself only waits) and killed."""
    p = _launch(tmp_path, "stop", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                "0", "--finish-timeout", "1", "--preload", preload)  # fmt: skip
    log = _finish(p)
    assert p.returncode == 1, log[-4000:]
    frozen = int((tmp_path / "start-1-0").read_text())
    assert f"process {frozen} " in log and "is stopped (SIGSTOP)" in log, log[-4000:]
    assert ("forked for stand-in" in log) == bool(preload), log[-4000:]
    assert re.search(r"rank 1 \(pid \d+\) failed with exit code -9", log), log[-4000:]
    assert not (tmp_path / "start-1-1").exists()
    assert _gone(frozen), "the frozen rank was left behind"


@pytest.mark.parametrize("preload", ["", "resilient.launch"], ids=["worker", "forked-rank"])
def test_a_hung_rank_writes_its_python_stacks_before_it_is_killed(tmp_path, preload):
    """A rank that joined through the toolkit (``dump_stacks_on_signal``) is asked for its
    Python stacks before the kill (``STACKS_SIGNAL``; a fork server's stand-in passes it on to
    the rank): the job's output says where it is stuck."""
    p = _launch(tmp_path, "hang-stacks", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "0", "--finish-timeout", "1", "--preload", preload)  # fmt: skip
    log = _finish(p)
    assert p.returncode == 1, log[-4000:]
    assert "rank 1 wrote its Python stacks to its stderr as it was killed" in log, log[-4000:]
    assert re.search(r'File ".*w\.py", line \d+ in stuck_in_teardown', log), log[-4000:]
    assert _gone(int((tmp_path / "start-1-0").read_text()))


# a rank of the toolkit (it dumps its stacks when asked), ready, then idle; argv[1]: "stop" to
# stop itself (SIGSTOP: a chaos stop fault, a debugger), "fork" to fork a child first (a
# DataLoader worker forked from the rank: it inherits the registration)
_TOOLKIT_RANK = """
import os, signal, sys, time
from resilient.forkserver import STACKS_SIGNAL
from resilient.launch import dump_stacks_on_signal
if sys.argv[1:] == ["fork"]:  # a handler before the toolkit's, which chains to it: the rank
    # ends 5 s after its dump, not at once, so that a child asked too has the time to dump
    signal.signal(STACKS_SIGNAL, lambda *a: (time.sleep(5), os._exit(0)))
dump_stacks_on_signal()
if sys.argv[1:] == ["fork"] and os.fork() == 0:
    def forked_helper():
        os.write(1, b"child ready\\n")  # (one write: the rank writes to the same pipe)
        time.sleep(120)
    forked_helper()
def stuck_in_teardown():
    os.write(1, b"ready\\n")  # (from here on its stack names this function)
    if sys.argv[1:] == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)
stuck_in_teardown()
"""


def _pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits to be delivered to process ``pid`` (ShdPnd, SigPnd)."""
    with open(f"/proc/{pid}/status") as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(m >> (sig - 1) & 1 for m in masks)


def test_workers_are_asked_for_stacks_together_and_only_those_that_can_answer(tmp_path):
    """``ask_for_stacks``: a worker that does not catch the signal is not sent it (its default
    would end it without a word); nor a stopped one (it could not answer before the kill); the
    others are asked at once and waited for together.  Whatever catches it is asked (its
    ``SigCgt`` bit), a program's own handler too."""
    from resilient.forkserver import STACKS_SIGNAL
    from resilient.launch.agent import ask_for_stacks

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip

    plain = start("-c", "import time; print('ready', flush=True); time.sleep(120)")
    own = start("-c", "import signal, sys, time\n"
                f"signal.signal({int(STACKS_SIGNAL)}, lambda *a: sys.exit(3))\n"
                "print('ready', flush=True)\ntime.sleep(120)")  # fmt: skip
    ranks = [start("-c", _TOOLKIT_RANK) for _ in range(2)]
    stopped = start("-c", _TOOLKIT_RANK, "stop")
    everyone = [plain, own, *ranks, stopped]
    try:
        for q in everyone:
            assert q.stdout.readline() == "ready\n"
        deadline = time.time() + 60
        while Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.time() < deadline, "the rank did not stop"
            time.sleep(0.05)
        dumped = ask_for_stacks(everyone, wait_s=60)
        assert dumped == {own.pid, *(r.pid for r in ranks)}
        assert own.returncode == 3 and [r.returncode for r in ranks] == [-STACKS_SIGNAL] * 2
        for r in ranks:
            err = r.stderr.read()
            assert "in stuck_in_teardown" in err, err
        assert plain.poll() is None and stopped.poll() is None
        assert not _pending(stopped.pid, STACKS_SIGNAL)  # never sent: nothing waits for it
    finally:
        for q in everyone:
            q.kill()
            q.wait()


# a launcher (run by the fork server's ``host``, so its workers fork from a server): one
# worker (a stand-in for the probe's rank, which forks a child), asked for its stacks
_ASKING_LAUNCHER = """
import json, os, subprocess, sys
from resilient import forkserver
from resilient.launch.agent import ask_for_stacks
out = sys.argv[1]
err = open(os.path.join(out, "rank.err"), "w")
p = subprocess.Popen([sys.executable, *forkserver.STAND_IN, "-m", "probe", "fork"],
                     stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
lines = sorted(p.stdout.readline() for _ in range(2))
assert lines == ["child ready\\n", "ready\\n"], lines
rank = forkserver.rank_pid(p.pid)
with open(f"/proc/{rank}/task/{rank}/children") as f:
    child = int(f.read().split()[0])
dumped = ask_for_stacks([p], wait_s=60)
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"stand_in": p.pid, "rank": rank, "child": child, "dumped": sorted(dumped)}, f)
"""


def test_a_forked_rank_is_asked_for_its_stacks_and_not_its_children(tmp_path):
    """Through a fork server's stand-in (which passes other signals on to the rank's process
    group): only the rank dumps; its forked child (which inherited the registration) does not
    dump into the same output, read as the rank's."""
    (tmp_path / "probe.py").write_text(_TOOLKIT_RANK)
    (tmp_path / "asking.py").write_text(_ASKING_LAUNCHER)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    host = subprocess.Popen(
        [sys.executable, "-m", "resilient.forkserver", "host", "--preload", "resilient.launch",
         "--", "asking", str(tmp_path)], env=env, cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        log = host.communicate(timeout=180)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(host.pid, signal.SIGKILL)
        host.wait()
    assert (tmp_path / "result.json").exists(), log[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    err = (tmp_path / "rank.err").read_text()
    try:
        assert result["rank"] != result["stand_in"], "not forked"
        assert result["dumped"] == [result["stand_in"]], err
        assert "in stuck_in_teardown" in err and "forked_helper" not in err, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(result["child"], signal.SIGKILL)


@pytest.mark.parametrize("mode", ["busy", "child-busy"], ids=["itself", "in-a-child"])
def test_a_rank_still_working_after_its_peers_finished_is_left_to_finish(tmp_path, mode):
    """Computing on alone, in its own process or in a child it waits for (a subprocess export,
    a shell wrapper's python): working, not idle."""
    p = _launch(tmp_path, mode, "--standalone", "--nproc-per-node", "2", "--max-restarts",
                "1", "--finish-timeout", "1")  # fmt: skip
    log = _finish(p)
    assert p.returncode == 0 and (tmp_path / "done-1").exists(), log[-4000:]
    assert "and working: left alone" in log, log[-4000:]
    assert "Killing it" not in log and not (tmp_path / "start-1-1").exists(), log[-4000:]


def test_a_rank_that_starts_computing_as_the_bound_ends_is_not_killed(tmp_path):
    """Idle for most of the bound, then working when it ends: the bound counts idle seconds
    up to the last one, not an average over the window (which killed it, "idle" and "running"
    in one line)."""
    bound = 6.0
    p = _launch(tmp_path, "late-busy", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "0", "--finish-timeout", str(bound),
                extra=(str(bound - 0.25),))  # fmt: skip
    log = _finish(p)
    assert p.returncode == 0 and (tmp_path / "done-1").exists(), log[-4000:]
    assert "Killing it" not in log, log[-4000:]


def test_finish_timeout_0_waits_for_the_last_rank_as_torchrun_does(tmp_path):
    p = _launch(tmp_path, "flag", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                "1", "--finish-timeout", "0")  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "start-0-0").exists() or not (tmp_path / "start-1-0").exists():
        assert p.poll() is None and time.monotonic() < deadline, _finish(p)[-4000:]
        time.sleep(0.05)
    time.sleep(3)  # rank 0 has long finished: a 1 s bound would have killed rank 1 by now
    assert p.poll() is None, _finish(p)[-4000:]
    (tmp_path / "go").touch()
    log = _finish(p)
    assert p.returncode == 0 and "finish-timeout" not in log, log[-4000:]
    assert not (tmp_path / "start-1-1").exists()


def _two_nodes(
    tmp: Path, mode: str, nproc: int, shared: bool = False
) -> tuple[list[subprocess.Popen], list[str]]:
    """Two agents of one job; each node's files in ``tmp/node<i>``, or both in ``tmp``."""
    port = free_port()
    procs = []
    for node in (0, 1):
        d = tmp if shared else tmp / f"node{node}"
        d.mkdir(exist_ok=True)
        procs.append(_launch(
            d, mode, "--nnodes", "2", "--nproc-per-node", str(nproc), "--max-restarts", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"finish-{port}", "--finish-timeout", "1",
        ))  # fmt: skip
    return procs, [_finish(p) for p in procs]


def test_a_rank_hung_after_a_rank_on_another_node_finished_fails_its_node_without_a_restart(
    tmp_path,
):
    """Two agents, a rank each: rank 0's node finishes and waits in torchrun's exit barrier;
    rank 1's agent learns it from the store, kills its rank after the bound, and does not restart
    (that node would never join a new rendezvous), so both launchers end."""
    procs, logs = _two_nodes(tmp_path, "hang", 1)
    hung = next(i for i in (0, 1) if (tmp_path / f"node{i}" / "start-1-0").exists())
    assert procs[1 - hung].returncode == 0, logs[1 - hung][-4000:]
    assert procs[hung].returncode == 1, logs[hung][-4000:]
    assert "after a rank on another node finished (exit code 0)" in logs[hung], logs[hung][-4000:]
    assert "not restarting the workers either" in logs[hung], logs[hung][-4000:]
    assert not (tmp_path / f"node{hung}" / "start-1-1").exists()


def test_nodes_that_each_have_a_rank_left_behind_restart_together(tmp_path):
    """Two agents, two ranks each, rank 0 finished and every other rank hung (once): neither
    node finished whole, so neither gives up its restart (a node taking the other's finished
    rank for a node in the exit barrier would fail alone while the other waited in a new
    rendezvous); both end 0, every rank finished in the next round."""
    procs, logs = _two_nodes(tmp_path, "hang-others", 2, shared=True)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
        assert "not restarting the workers" not in log, log[-4000:]
    assert any("Killing it" in log for log in logs), logs[0][-3000:] + logs[1][-3000:]
    for rank in range(4):
        assert (tmp_path / f"done-{rank}").exists(), rank


def test_several_ranks_left_behind_are_each_killed_and_named(tmp_path):
    p = _launch(tmp_path, "hang-others", "--standalone", "--nproc-per-node", "3",
                "--max-restarts", "0", "--finish-timeout", "1")  # fmt: skip
    log = _finish(p)
    assert p.returncode == 1 and log.count("Killing it") == 2, log[-4000:]
    for rank in (1, 2):
        assert f"rank {rank} (local rank {rank}, pid " in log, log[-4000:]
        assert re.search(rf"rank {rank} \(pid \d+\) failed with exit code -9", log), log[-4000:]


def test_describe_process_says_stopped_sleeping_or_gone():
    p = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while "sleeping" not in describe_process(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert describe_process(p.pid).startswith(
            f"process {p.pid} is sleeping (waiting on a lock, a socket, a timer)"
        )
        os.kill(p.pid, signal.SIGSTOP)
        while "stopped" not in describe_process(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert describe_process(p.pid).startswith(f"process {p.pid} is stopped (SIGSTOP)")
    finally:
        p.kill()
        p.wait()
    assert describe_process(p.pid) == (
        f"process {p.pid}: its state cannot be read ([Errno 2] No such file or directory: "
        f"'/proc/{p.pid}/task')"
    )


def test_describe_process_counts_threads_by_state():
    threads = 3
    code = (
        "import threading, time\n"
        + "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n" * (threads - 1)
        + "print('ok', flush=True)\ntime.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        deadline = time.monotonic() + 10
        while f"{threads} threads ({threads} sleeping)" not in describe_process(p.pid):
            assert time.monotonic() < deadline, describe_process(p.pid)
            time.sleep(0.01)
    finally:
        p.kill()
        p.wait()


def test_the_launchers_help_names_its_own_flags():
    out = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "launch", "--help"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--spares", "--max-recoveries", "--preload", "--finish-timeout"):
        assert flag in out.stdout, out.stdout
