"""The server for launchers (resilient/forkserver.py ``start_launchers``, the chaos harness's agents
as its stand-ins) against the same launcher exec'd (``python -m LAUNCHER``, as the harness started
it before): what a launcher or the interpreter reads once, at its start, is the job's own, whether
the server forked it (the job's start settings are the server's) or its stand-in ran it itself
(they are not).  Each test compares with an exec'd control in the same environment (an adversarial
review's repros: every one failed against the first version of the server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.forkserver import ENV, ENV_STAND_IN, start_launchers, stop

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def mods(tmp_path):
    (tmp_path / "wd").mkdir()
    return tmp_path


def _server(mods: Path, preload: list[str], **env: str) -> tuple[subprocess.Popen, str]:
    """A server for launchers started as a harness starts one: with the first job's
    environment (``env`` added to ``_env``), in the jobs' working directory."""
    return start_launchers(preload, _env(mods, **env), cwd=str(mods / "wd"))


# (in a launcher: whether it was forked from a server, which has the server's command line)
FORKED = 'print("serve" in __import__("sys").orig_argv)'


def _env(mods: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, ENV_STAND_IN)}
    env["PYTHONPATH"] = os.pathsep.join([str(mods), ROOT])
    env.update(extra)
    return env


def _run(mods: Path, module: str, *, path: str | None, timeout: float = 120, **env):
    """``module`` as the harness starts a job's agent: the stand-in of the launchers' server at
    ``path``; exec'd (``python -m module``) where ``path`` is None."""
    cmd = [sys.executable, "-m"]
    extra = dict(env)
    if path is not None:
        cmd += ["resilient.forkserver", "run", "-m"]
        extra[ENV] = path
    proc = subprocess.run(
        [*cmd, module],
        cwd=mods / "wd",
        env=_env(mods, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


# --- 1. module state from the first job's environment ---------------------------------------------

LOGLEVEL_PROBE = f"""
import torch.distributed.run as run
print(run.logger.level)
{FORKED}
"""


def test_torchruns_loglevel_is_the_jobs_not_the_first_jobs(mods):
    """The launchers' server imports torch.distributed.run once, in the *first* job's
    environment (_preload), and torch's elastic loggers read LOGLEVEL at import: every later
    job's torchrun kept the first job's log level, whatever its own LOGLEVEL said.  Now a job
    whose LOGLEVEL is not the server's is run by its stand-in."""
    (mods / "lvl.py").write_text(LOGLEVEL_PROBE)
    control = _run(mods, "lvl", path=None, LOGLEVEL="DEBUG")
    assert control.returncode == 0, control.stderr
    assert control.stdout.split() == ["10", "False"]

    server, path = _server(mods, ["torch.distributed.run"], LOGLEVEL="ERROR")
    try:
        first = _run(mods, "lvl", path=path, LOGLEVEL="ERROR")
        assert first.returncode == 0, first.stderr
        assert first.stdout.split() == ["40", "True"]  # forked
        second = _run(mods, "lvl", path=path, LOGLEVEL="DEBUG")
    finally:
        stop(server)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["10", "False"], "the second job got the first job's LOGLEVEL"


DEBUG_LAUNCHER = f"""
import subprocess, sys
import torch.distributed  # as torchrun has it
{FORKED}
sys.stdout.flush()
from resilient import forkserver
# what `host` does where fork_ready(): the ranks' server is this launcher, forked
server = forkserver.start([], fork=True)
rc = subprocess.call([sys.executable, "-m", "resilient.forkserver", "run", "-m", "dbg_rank"])
forkserver.stop(server)
sys.exit(rc)
"""

DEBUG_RANK = """
import torch.distributed as dist
print(dist.get_debug_level())
"""


def test_a_ranks_torch_distributed_debug_level_is_its_jobs_not_the_first_jobs(mods):
    """``import torch.distributed`` reads TORCH_DISTRIBUTED_DEBUG once (set_debug_level_from_env),
    and the launchers' server does that import in the first job's environment.  The ranks a
    chaos job's `host` forks from its launcher (itself forked from that server) inherited the
    first job's debug level: a scenario that set TORCH_DISTRIBUTED_DEBUG=DETAIL in its
    ``job.env`` got no collective checks unless it happened to be the first job."""
    (mods / "dbg_launcher.py").write_text(DEBUG_LAUNCHER)
    (mods / "dbg_rank.py").write_text(DEBUG_RANK)
    env = {"OMP_NUM_THREADS": "1"}
    control = _run(mods, "dbg_launcher", path=None, TORCH_DISTRIBUTED_DEBUG="INFO", **env)
    assert control.returncode == 0, control.stderr
    assert control.stdout.split() == ["False", "DebugLevel.INFO"]

    server, path = _server(mods, ["torch.distributed.run"], TORCH_DISTRIBUTED_DEBUG="OFF", **env)
    try:
        first = _run(mods, "dbg_launcher", path=path, TORCH_DISTRIBUTED_DEBUG="OFF", **env)
        assert first.returncode == 0, first.stderr
        assert first.stdout.split() == ["True", "DebugLevel.OFF"]
        second = _run(mods, "dbg_launcher", path=path, TORCH_DISTRIBUTED_DEBUG="INFO", **env)
    finally:
        stop(server)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["False", "DebugLevel.INFO"], "the first job's debug level"


BLAS_PROBE = f"""
import os
import numpy as np
a = np.ones((600, 600))
for _ in range(3):
    a @ a  # BLAS's threads start (OpenBLAS: at import, or again after a fork)
print(len(os.listdir("/proc/self/task")))
{FORKED}
"""


def test_numpys_blas_threads_are_the_jobs_not_the_first_jobs(mods):
    """numpy (preloaded by the chaos harness's server for launchers: numpy.random) sizes its
    BLAS thread pool from OMP_NUM_THREADS when it is imported, in the first job's environment.
    A later job's launcher (and the ranks `host` forks from it) ran the first job's pool: a
    job with OMP_NUM_THREADS=1 after one with 2 got 2 BLAS threads (exec'd: 1)."""
    (mods / "blas.py").write_text(BLAS_PROBE)
    control = _run(mods, "blas", path=None, OMP_NUM_THREADS="1")
    assert control.returncode == 0, control.stderr
    assert control.stdout.split() == ["1", "False"]

    server, path = _server(mods, ["numpy.random"], OMP_NUM_THREADS="2")
    try:
        first = _run(mods, "blas", path=path, OMP_NUM_THREADS="2")
        assert first.returncode == 0, first.stderr
        assert first.stdout.split()[1:] == ["True"]
        second = _run(mods, "blas", path=path, OMP_NUM_THREADS="1")
    finally:
        stop(server)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["1", "False"], "the first job's BLAS pool"


# --- 2. interpreter settings from the job's environment ---------------------------------------

INTERP_PROBE = """
import faulthandler, json, sys
print(json.dumps({"hash": hash("resilient"), "faulthandler": faulthandler.is_enabled(),
                  "optimize": sys.flags.optimize, "forked": "serve" in sys.orig_argv,
                  "encoding": sys.stdout.encoding}))
"""


@pytest.mark.parametrize(
    "var,value,key",
    [
        ("PYTHONHASHSEED", "0", "hash"),
        ("PYTHONFAULTHANDLER", "1", "faulthandler"),
        ("PYTHONOPTIMIZE", "1", "optimize"),  # fork_ready: "the workers get alike"
        ("PYTHONIOENCODING", "latin-1", "encoding"),
    ],
)
@pytest.mark.parametrize("server_has_it", [True, False])
def test_interpreter_settings_in_the_jobs_environment_reach_its_launcher(
    mods, var, value, key, server_has_it, monkeypatch
):
    """A job's PYTHON* variables (a scenario's ``job.env``: PYTHONHASHSEED for a reproducible
    run, PYTHONFAULTHANDLER to see where a hung rank is) set up the interpreter at its start:
    a launcher forked from the launchers' server has the server's interpreter (so do the ranks
    ``host`` forks from that launcher): forked from a server started with the same, or run by
    its stand-in, which the server leaves it to otherwise."""
    monkeypatch.delenv(var, raising=False)  # (the server without it has none of this process's)
    (mods / "interp.py").write_text(INTERP_PROBE)
    control = _run(mods, "interp", path=None, **{var: value})
    assert control.returncode == 0, control.stderr
    want = json.loads(control.stdout)[key]

    server, path = _server(mods, [], **({var: value} if server_has_it else {}))
    try:
        job = _run(mods, "interp", path=path, **{var: value})
    finally:
        stop(server)
    assert job.returncode == 0, job.stderr
    assert json.loads(job.stdout)[key] == want
    assert json.loads(job.stdout)["forked"] is server_has_it


# --- 3. the fallback: a stand-in that runs its launcher itself --------------------------------

ENV_PROBE = """
import json, os
print(json.dumps({"sock": os.environ.get("RESILIENT_FORKSERVER"),
                  "stand_in": os.environ.get("RESILIENT_FORKSERVER_STAND_IN")}))
"""


def test_a_launcher_run_by_its_stand_in_has_no_launchers_socket_in_its_environment(mods):
    """Where the launchers' server cannot be reached (killed outright: its directory stays), the
    stand-in runs the launcher itself.  It kept RESILIENT_FORKSERVER (the launchers' socket,
    which the harness put there) in its environment: its workers inherited it (plain torchrun
    execs them with it), and `resilient launch --preload` took it for a host's server (no
    forked server for its ranks).  A launcher forked from the server has it removed (_child,
    launchers=True); exec'd by the harness as before, it never had it."""
    (mods / "envp.py").write_text(ENV_PROBE)
    server, path = _server(mods, [])
    try:
        ok = _run(mods, "envp", path=path)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout) == {"sock": None, "stand_in": None}
        server.send_signal(signal.SIGKILL)
        server.wait()
        assert os.path.isdir(os.path.dirname(path))  # what a SIGKILL leaves (swept later)
        fallback = _run(mods, "envp", path=path)
    finally:
        stop(server)
        import shutil

        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    assert fallback.returncode == 0, fallback.stderr
    assert json.loads(fallback.stdout) == {"sock": None, "stand_in": None}


# --- 4. the harness killed outright -----------------------------------------------------------

HARNESS = """
import os, signal, subprocess, sys
from resilient.forkserver import ENV, start_launchers
server, path = start_launchers([])
job = subprocess.Popen(
    [sys.executable, "-m", "resilient.forkserver", "run", "-m", "sleeper"],
    env={**os.environ, ENV: path}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    stdin=subprocess.DEVNULL, start_new_session=True,  # as the harness starts an agent
)
print(server.pid, job.pid, flush=True)
import time
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(os.environ["MARK"], "started")):  # the launcher runs
    assert time.monotonic() < deadline
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)  # a CI timeout, the OOM killer
"""

SLEEPER = """
import os, time
open(os.path.join(os.environ["MARK"], "started"), "w").close()
time.sleep(40)
"""


def test_a_harness_killed_outright_releases_its_output_streams(mods):
    """A job's agent writes to its own log, so a harness killed outright (SIGKILL: a CI timeout)
    left nothing holding its stdout/stderr: whoever reads them (a pipe to `tee`, a runner
    waiting for EOF) gets EOF at once.  The launchers' server outlives the harness while a
    job's launcher runs (by design): it inherited the harness's stdout and stderr, which then
    stayed open until the orphaned job ended; now its own output goes nowhere."""
    (mods / "harness_probe.py").write_text(HARNESS)
    (mods / "sleeper.py").write_text(SLEEPER)
    (mods / "mark").mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(mods / "harness_probe.py")],
        cwd=mods / "wd",
        env=_env(mods, MARK=str(mods / "mark")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stdout.readline().split()
    server, job = int(first[0]), int(first[1])
    try:
        assert proc.wait(timeout=60) == -signal.SIGKILL
        try:
            proc.communicate(timeout=10)
            eof = True
        except subprocess.TimeoutExpired:
            eof = False
        assert eof, "the harness's stdout/stderr are held open after it died"
    finally:
        try:  # its directory: `serve PATH ...`
            root = os.path.dirname(Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")[4])
        except (OSError, IndexError):
            root = None
        for pid in (job, server):  # the stand-in (its launcher goes with it), then the server
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=30)
        if root:
            import shutil

            shutil.rmtree(root.decode(), ignore_errors=True)
