"""The fork server (resilient/forkserver.py): a rank forked from a process that has its imports
done behaves like one ``python -m`` started: arguments, environment, working directory, standard
streams, exit code, signals, ``atexit``; its stand-in (torchrun's worker) ends as it ends, and a
stand-in killed takes its rank with it.  Real processes throughout (the server imports ``json``
only, so that these run fast)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.forkserver import ENV, rank_pid

PROBE = """
import atexit, json, os, random, signal, sys, time
out = os.environ["PROBE_OUT"]
mode = sys.argv[1]
from resilient.forkserver import launcher_pid
info = {"argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("PROBE_X"),
        "pid": os.getpid(), "ppid": os.getppid(), "rand": random.random(), "name": __name__,
        "rank": os.environ.get("RANK"), "argv0": sys.argv[0], "path0": sys.path[0],
        "file": __file__, "spec": __spec__ is None, "launcher": launcher_pid(),
        "cpus": sorted(os.sched_getaffinity(0)), "nice": os.nice(0),
        "sock": os.environ.get("RESILIENT_FORKSERVER")}
with open(os.path.join(out, f"probe-{os.getpid()}.json"), "w") as f:
    json.dump(info, f)
print("hello from the probe", flush=True)
def at_exit():
    with open(os.path.join(out, f"atexit-{os.getpid()}"), "w") as f:
        f.write(sys.argv[0])
atexit.register(at_exit)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise RuntimeError("boom in the probe")
if mode == "selfkill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
if mode == "child":  # a rank with a child of its own (a helper, a data loader's worker)
    import subprocess
    helper = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(out, f"helper-{os.getpid()}"), "w") as f:
        f.write(str(helper.pid))
if mode == "unclosed":  # a file left open at exit: the interpreter's finalization flushes it
    kept = open(os.path.join(out, "unclosed"), "w")
    kept.write("written at exit")
if mode == "libs":  # the server preloaded numpy and torch
    import numpy, torch
    with open(os.path.join(out, f"libs-{os.getpid()}.json"), "w") as f:
        json.dump({"numpy": numpy.random.random(), "threads": torch.get_num_threads(),
                   "omp": os.environ.get("OMP_NUM_THREADS")}, f)
if mode == "late":  # still working when its launcher has gone
    time.sleep(1.5)
    open(os.path.join(out, f"finished-{os.getpid()}"), "w").close()
if mode in ("term", "sleep", "child", "int"):
    open(os.path.join(out, f"ready-{os.getpid()}"), "w").close()
    try:
        time.sleep(60)
    except KeyboardInterrupt:  # the rank itself got the SIGINT
        open(os.path.join(out, f"interrupted-{os.getpid()}"), "w").close()
        raise
"""

# a launcher that stays alive (as torchrun's agent does) with two workers that are stand-ins
LAUNCHER = """
import os, subprocess, sys, time
cmd = [sys.executable, "-m", "resilient.forkserver", "run", "-m", "probe"]
cmd += os.environ.get("PROBE_MODE", "sleep").split()
def placed():  # the first worker pinned to CPU 0 and niced (numactl, taskset, nice)
    os.sched_setaffinity(0, {0})
    os.nice(3)
procs, codes = [], []
for i in (1, 2):  # each its own thread count, as workers of different jobs might have
    env = {**os.environ, "OMP_NUM_THREADS": str(i)}
    procs.append(subprocess.Popen(cmd, start_new_session=True, env=env,
                                  preexec_fn=placed if i == 1 else None))
    if os.environ.get("PROBE_SEQ"):  # one after the other: the first rank has ended
        codes.append(procs[-1].wait())
with open(os.path.join(os.environ["PROBE_OUT"], "stand_ins"), "w") as f:
    f.write(" ".join(str(p.pid) for p in procs))
if os.environ.get("PROBE_LEAVE"):  # the launcher goes; its workers do not (their sessions)
    out = os.environ["PROBE_OUT"]
    while len([n for n in os.listdir(out) if n.startswith("probe-")]) < 2:
        time.sleep(0.02)  # once both ranks are at work
    os._exit(0)
codes = codes or [p.wait() for p in procs]
with open(os.path.join(os.environ["PROBE_OUT"], "codes"), "w") as f:
    f.write(" ".join(str(c) for c in codes))
"""


@pytest.fixture
def where(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "out").mkdir()
    (tmp_path / "wd").mkdir()
    yield tmp_path
    # whatever a failed test left running: its probes (ranks), stand-ins and launcher
    pids = [p["pid"] for p in _probes(tmp_path)]
    stand_ins = tmp_path / "out" / "stand_ins"
    pids += [int(p) for p in stand_ins.read_text().split()] if stand_ins.exists() else []
    for pid in pids + _started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _started.clear()


_started: list[int] = []


def _env(where: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([str(where), root])
    env["PROBE_OUT"] = str(where / "out")
    env["PROBE_X"] = "from the worker's environment"
    return {**env, **extra}


def _host(where: Path, *launcher: str, preload: str = "json", **env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "resilient.forkserver", "host", "--preload", preload, "--"]
    return _spawn(where, [*cmd, *launcher], _env(where, **env))


def _spawn(where: Path, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``cmd`` in the test's working directory, its output piped, in a session of its own (as
    torchrun starts its workers); killed after the test if it is still running."""
    proc = subprocess.Popen(
        cmd,
        cwd=where / "wd",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _started.append(proc.pid)
    return proc


def _probes(where: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((where / "out").glob("probe-*.json"))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie not reaped yet
    except OSError:
        return True


def test_a_forked_rank_gets_the_workers_arguments_environment_streams_and_exit_code(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "exit", "3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "hello from the probe" in out  # the stand-in's stdout, handed over
    (info,) = _probes(where)
    assert info["argv"] == ["exit", "3"] and info["cwd"] == str(where / "wd")
    assert info["x"] == "from the worker's environment" and info["name"] == "__main__"
    assert info["argv0"] == str(where / "probe.py") and info["path0"] == str(where / "wd")
    # forked by the server, not run in the stand-in (which is the host's pid, after its exec)
    assert info["pid"] != proc.pid and info["ppid"] != proc.pid
    # interpreter exit: atexit ran, with sys.argv[0] as `python -m` leaves it
    assert (where / "out" / f"atexit-{info['pid']}").read_text() == str(where / "probe.py")


def test_a_script_runs_as_python_script_would_run_it(where):
    proc = _host(where, "resilient.forkserver", "run", str(where / "probe.py"), "exit", "0")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    (info,) = _probes(where)
    assert info["argv0"] == str(where / "probe.py") and info["argv"] == ["exit", "0"]
    assert info["path0"] == str(where) and _forked(where, proc)  # the script's dir
    assert info["name"] == "__main__" and not (where / "__pycache__").exists()  # as python runs it
    assert info["file"] == str(where / "probe.py") and info["spec"]  # absolute; no __spec__


def test_a_rank_that_raises_exits_1_with_its_traceback_on_the_workers_stderr(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "raise")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: boom in the probe" in err
    assert _forked(where, proc)


def _forked(where: Path, proc: subprocess.Popen) -> bool:
    """Whether the probe ran in a rank forked by the server, not in the stand-in itself."""
    (info,) = _probes(where)
    return info["pid"] != proc.pid and info["ppid"] != proc.pid


def test_exit_codes_and_open_files_as_an_interpreter_leaves_them(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "exit", "-1")
    proc.communicate(timeout=120)
    assert proc.returncode == 255 and _forked(where, proc)  # as `python -c "exit(-1)"`
    for p in (where / "out").glob("probe-*"):
        p.unlink()
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "unclosed")
    proc.communicate(timeout=120)
    assert proc.returncode == 0 and _forked(where, proc)
    assert (where / "out" / "unclosed").read_text() == "written at exit"


def test_sigint_ends_the_rank_and_its_stand_in_as_it_ends_an_interpreter(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "int")
    _wait_for(lambda: any((where / "out").glob("ready-*")))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT and _forked(where, proc)  # KeyboardInterrupt
    assert "KeyboardInterrupt" in err
    assert list((where / "out").glob("interrupted-*"))  # in the rank, forwarded to it


def test_torchruns_teardown_reaches_the_ranks_own_children(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "child")
    _wait_for(lambda: any((where / "out").glob("ready-*")))
    (helper,) = (int(p.read_text()) for p in (where / "out").glob("helper-*"))
    os.killpg(proc.pid, signal.SIGTERM)  # what torchrun does to a worker's session
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and _forked(where, proc)
    _wait_for(lambda: _gone(helper), timeout_s=30)  # the rank's group got it too


def test_a_server_that_dies_takes_its_ranks_and_their_stand_ins_say_so(where):
    proc = _host(where, "launcher")
    stand_ins_file = where / "out" / "stand_ins"
    _wait_for(lambda: stand_ins_file.exists() and len(list((where / "out").glob("ready-*"))) == 2)
    os.kill(_server_of(int(stand_ins_file.read_text().split()[0])), signal.SIGKILL)
    proc.communicate(timeout=30)  # the ranks would sleep for 60 s: they are killed with it
    codes = (where / "out" / "codes").read_text().split()
    assert codes == [str(-signal.SIGKILL)] * 2  # not a made-up exit code
    for p in _probes(where):
        _wait_for(lambda p=p: _gone(p["pid"]), timeout_s=30)


def _server_of(stand_in: int) -> int:
    sock = next(
        e.split(b"=", 1)[1].decode()
        for e in Path(f"/proc/{stand_in}/environ").read_bytes().split(b"\0")
        if e.startswith(ENV.encode() + b"=")
    )
    return int(Path(sock).with_name("server.pid").read_text())


def test_preloaded_libraries_are_set_up_per_rank(where):
    proc = _host(where, "launcher", preload="numpy.random,torch", PROBE_MODE="libs")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    stand_ins = {int(p) for p in (where / "out" / "stand_ins").read_text().split()}
    probes = _probes(where)
    assert len(probes) == 2 and not {p["ppid"] for p in probes} & stand_ins  # forked
    libs = [json.loads(p.read_text()) for p in (where / "out").glob("libs-*.json")]
    assert len(libs) == 2 and libs[0]["numpy"] != libs[1]["numpy"]  # numpy seeded per rank
    assert sorted((x["omp"], x["threads"]) for x in libs) == [("1", 1), ("2", 2)]


def test_a_rank_killed_by_a_signal_takes_its_stand_in_the_same_way(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "selfkill")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and _forked(where, proc)


def test_signals_to_the_stand_in_reach_the_rank(where):
    proc = _host(where, "resilient.forkserver", "run", "-m", "probe", "term")
    _wait_for(lambda: any((where / "out").glob("ready-*")))
    proc.send_signal(signal.SIGTERM)  # torchrun's teardown
    proc.communicate(timeout=60)
    assert proc.returncode == 7 and _forked(where, proc)  # the rank's handler chose the code


def test_a_killed_stand_in_takes_its_rank_and_only_it(where):
    proc = _host(where, "launcher")
    stand_ins_file = where / "out" / "stand_ins"
    _wait_for(lambda: stand_ins_file.exists() and len(list((where / "out").glob("ready-*"))) == 2)
    a, b = (int(p) for p in stand_ins_file.read_text().split())
    ranks = {rank_pid(a), rank_pid(b)}
    assert None not in ranks and not ranks & {a, b}  # each stand-in maps to its own rank
    assert {p["pid"] for p in _probes(where)} == ranks
    assert len({p["rand"] for p in _probes(where)}) == 2  # each rank seeded afresh
    ra, rb = rank_pid(a), rank_pid(b)
    os.kill(a, signal.SIGKILL)  # torchrun's SIGKILL after its grace period
    _wait_for(lambda: _gone(ra), timeout_s=30)
    time.sleep(0.3)
    assert not _gone(rb) and not _gone(b)  # the other rank and its stand-in live on
    os.kill(rb, signal.SIGKILL)  # a rank killed from outside (a chaos fault, a hang's kill)
    proc.communicate(timeout=60)
    codes = (where / "out" / "codes").read_text().split()
    assert codes == [str(-signal.SIGKILL), str(-signal.SIGKILL)]


def test_the_server_leaves_with_its_launcher_and_removes_its_socket(where):
    proc = _host(where, "launcher")
    stand_ins_file = where / "out" / "stand_ins"
    _wait_for(lambda: stand_ins_file.exists() and len(list((where / "out").glob("ready-*"))) == 2)
    server = _server_of(int(stand_ins_file.read_text().split()[0]))
    assert "resilient.forkserver serve" in _cmdline(server)
    root = Path(_cmdline(server).split()[4]).parent
    for p in _probes(where):
        os.kill(p["pid"], signal.SIGKILL)
    proc.communicate(timeout=60)  # both workers ended: the launcher exits
    _wait_for(lambda: _gone(server), timeout_s=30)
    assert not root.exists()


def test_with_no_server_to_reach_the_worker_runs_the_module_itself(where):
    cmd = [sys.executable, "-m", "resilient.forkserver", "run", "-m", "probe", "exit", "0"]
    env = _env(where, **{ENV: str(where / "nowhere" / "sock")})
    done = subprocess.run(cmd, cwd=where / "wd", env=env, capture_output=True, timeout=60)
    assert done.returncode == 0
    (info,) = _probes(where)
    assert info["ppid"] == os.getpid()  # the worker itself: this test's child
    assert rank_pid(os.getpid()) == os.getpid()  # not a stand-in: itself


def test_usage_errors_exit_2():
    for argv in ([], ["host", "--preload"], ["host", "--bogus", "x", "--", "m"], ["serve"]):
        done = subprocess.run(
            [sys.executable, "-m", "resilient.forkserver", *argv], capture_output=True, text=True
        )
        assert done.returncode == 2 and "usage:" in done.stderr, argv


@pytest.mark.distributed
def test_ranks_of_a_torchrun_job_are_forked(where):
    launcher = ["torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    proc = _host(where, *launcher, "-m", "resilient.forkserver", "run", "-m", "probe", "exit", "0")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    infos = _probes(where)
    assert sorted(i["rank"] for i in infos) == ["0", "1"]
    assert all(i["ppid"] != proc.pid for i in infos)  # the server's children, not torchrun's
    assert out.count("hello from the probe") == 2


def test_a_server_killed_outright_leaves_a_directory_the_next_start_removes(tmp_path):
    from resilient.forkserver import _PREFIX, sweep

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, never waited for here
    _wait_for(lambda: _gone(zombie.pid))
    names = ("gone", "alive", "young", "reused", "zombie")
    dirs = {n: tmp_path / f"{_PREFIX}{n}" for n in names}
    for d in dirs.values():
        d.mkdir()
    (dirs["gone"] / "server.pid").write_text(str(dead.pid))  # SIGKILLed with its node
    # a live process whose command line names its directory (a server at work), and one whose
    # does not (the dead server's pid taken by another process)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    live = subprocess.Popen([*sleep, str(dirs["alive"])])
    other = subprocess.Popen(sleep)
    try:
        (dirs["alive"] / "server.pid").write_text(str(live.pid))
        (dirs["reused"] / "server.pid").write_text(str(other.pid))
        (dirs["zombie"] / "server.pid").write_text(str(zombie.pid))  # dead, not reaped
        for p in (live, other):  # past their exec (an empty command line is not judged)
            _wait_for(lambda p=p: _cmdline(p.pid).strip() != "")
        sweep(str(tmp_path))  # `young` has no pid file yet: a server being started
        left = {n for n, d in dirs.items() if d.exists()}
        assert left == {"alive", "young"}
    finally:
        for p in (live, other):
            p.kill()
            p.wait()
        zombie.wait()
    sweep(str(tmp_path))
    assert not dirs["alive"].exists() and dirs["young"].exists()


def test_ranks_are_forked_one_after_another_and_keep_their_workers_placement(where):
    proc = _host(where, "launcher", PROBE_MODE="exit 0", PROBE_SEQ="1")
    proc.communicate(timeout=120)
    assert (where / "out" / "codes").read_text().split() == ["0", "0"]
    stand_ins = [int(p) for p in (where / "out" / "stand_ins").read_text().split()]
    first, second = sorted(_probes(where), key=lambda p: p["pid"])
    # the second came after the first rank had ended: the server still serves
    assert first["ppid"] == second["ppid"] and not {first["ppid"]} & set(stand_ins)
    assert first["launcher"] == second["launcher"] == proc.pid  # its stand-in's parent
    assert (first["cpus"], first["nice"]) == ([0], 3)  # taskset / nice of the first worker
    assert second["cpus"] == sorted(os.sched_getaffinity(0)) and second["nice"] == os.nice(0)


def test_ranks_run_on_when_their_launcher_has_gone(where):
    proc = _host(where, "launcher", PROBE_MODE="late", PROBE_LEAVE="1")
    proc.communicate(timeout=60)  # the launcher leaves at once
    _wait_for(lambda: len(list((where / "out").glob("finished-*"))) == 2, timeout_s=60)
    stand_ins = {int(p) for p in (where / "out" / "stand_ins").read_text().split()}
    assert not {p["ppid"] for p in _probes(where)} & stand_ins  # forked ranks, not stand-ins


def _torchrun(
    where: Path, mode: str, *, omp: str | None = "1", launcher: str = "host"
) -> subprocess.Popen:
    """A job of two probes: torchrun under the fork server's host (``launcher="host"``), or
    ``resilient launch --preload`` as its own program (``"launch"``); ``omp``: its
    OMP_NUM_THREADS (None: not set)."""
    if launcher == "host":
        cmd = [sys.executable, "-m", "resilient.forkserver", "host", "--preload", "json", "--"]
        cmd += ["torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
        cmd += ["-m", "resilient.forkserver", "run", "-m", "probe", *mode.split()]
    else:
        cmd = [sys.executable, "-m", "resilient.cli", "launch", "--preload", "json"]
        cmd += ["--nproc-per-node", "2", "--max-restarts", "0", "--spares", "0"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "probe"]
        cmd += mode.split()
    env = {k: v for k, v in _env(where).items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return _spawn(where, cmd, env)


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["host", "launch"])
@pytest.mark.parametrize("omp", ["1", None])
def test_the_server_is_forked_from_the_launcher_where_torch_may_be(where, omp, launcher):
    """With OMP_NUM_THREADS set (torchrun passes it on as it is), the host imports torch once,
    forks the server from itself and runs torchrun in-process (``resilient launch --preload``,
    its own program, has torch imported already: it forks it from itself): the server is the
    launcher's child with the launcher's command line, the ranks are its children, and it
    leaves with the launcher, its directory with it.  Without it, a new interpreter serves (its
    own command line) and torchrun is exec'd: the pools libraries size at import are sized as
    the workers' are."""
    proc = _torchrun(where, "sleep", omp=omp, launcher=launcher)
    _wait_for(lambda: len(list((where / "out").glob("ready-*"))) == 2, timeout_s=120)
    infos = _probes(where)
    server = infos[0]["ppid"]
    assert {i["ppid"] for i in infos} == {server} and sorted(i["rank"] for i in infos) == ["0", "1"]
    assert int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid
    forked = "resilient.forkserver serve" not in _cmdline(server)
    assert forked == (omp is not None), _cmdline(server)
    if launcher == "launch":
        assert _cmdline(proc.pid).split()[1:4] == ["-m", "resilient.cli", "launch"]
    else:
        assert _cmdline(proc.pid).split()[1:3] == (
            ["-m", "resilient.forkserver"] if forked else ["-m", "torch.distributed.run"]
        )
    root = Path(infos[0]["sock"]).parent
    from resilient.forkserver import sweep

    sweep(str(root.parent))  # (another job's start): a live server's directory stays
    assert root.exists()
    for i in infos:
        os.kill(i["pid"], signal.SIGTERM)
    proc.communicate(timeout=120)
    _wait_for(lambda: _gone(server), timeout_s=30)
    _wait_for(lambda: not root.exists(), timeout_s=30)  # the server removed it, leaving


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["host", "launch"])
def test_a_rank_of_a_forked_server_exits_as_an_interpreter_would(where, launcher):
    """A rank of the forked server leaves through the launcher's stack (the host's, or
    ``resilient launch``'s), up to the interpreter: its exit code, its traceback, its atexit;
    the launcher's code never runs in it (``resilient launch`` starts the launcher before typer,
    so that typer's and click's handlers are not on that stack)."""
    proc = _torchrun(where, "raise", launcher=launcher)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err.count("RuntimeError: boom in the probe") >= 2  # each rank's traceback
    infos = _probes(where)
    assert len(infos) == 2
    for i in infos:
        assert (where / "out" / f"atexit-{i['pid']}").exists()
    assert out.count("hello from the probe") == 2


def _env_plain(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


@pytest.mark.parametrize("omp", [None, "1"], ids=["exec", "in-process"])
def test_a_launchers_exit_message_is_printed_whether_exec_d_or_in_process(tmp_path, omp):
    """``raise SystemExit("message")`` in the launcher (resilient launch does so for a
    non-script entrypoint, --run-path) prints the message and exits 1, exec'd or in-process (a
    review: host() had turned it into ``return 1``, the message lost)."""
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    env = _env_plain(OMP_NUM_THREADS=omp)
    if omp is None:
        env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "resilient.forkserver", "host", "--preload", "json", "--"]
    cmd += ["resilient.cli", "launch", "--nproc-per-node", "1", "--run-path", str(script)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1
    assert "the entrypoint must be a script or -m MODULE" in p.stderr, p.stderr[-2000:]
