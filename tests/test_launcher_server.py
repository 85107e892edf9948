"""A fork server for launchers (resilient/forkserver.py, ``start_launchers``): a program that starts
many jobs (the chaos harness) forks each job's launcher from one process that imported torch,
rather than paying ``import torch`` per launcher.  Real torchrun jobs, the probes of
test_forkserver.py as their ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resilient.chaos.faults import descendants, kill_tree
from resilient.forkserver import ENV, rank_pid, start_launchers, stop
from resilient.health.heartbeat import proc_stat
from tests.test_forkserver import _cmdline, _env, _gone, _probes, _spawn, _wait_for, where

pytestmark = pytest.mark.distributed

__all__ = ["where"]  # (a fixture, from test_forkserver.py)


@pytest.fixture
def launchers(where):
    """A server for launchers started with the jobs' environment (``_job``'s): it forks them."""
    from resilient.chaos.harness import _LAUNCHER_PRELOAD

    server, path = start_launchers(_LAUNCHER_PRELOAD, _job_env(where), cwd=str(where / "wd"))
    assert os.environ.get(ENV) != path  # this process's environment is left as it was
    yield server, path
    stop(server)


def _job_env(where: Path) -> dict[str, str]:
    return _env(where, OMP_NUM_THREADS="1")


def _ppid(pid: int) -> int:
    stat = proc_stat(f"/proc/{pid}/stat")
    assert stat is not None, f"process {pid} is gone"
    return int(stat[1])


def _job(where: Path, path: str, mode: str, launcher: str) -> subprocess.Popen:
    """A torchrun job of two probes, its launcher started as the chaos harness starts one: the
    stand-in of the server at ``path``.  The probes are forked by the job's own fork server
    (``host`` in front of torchrun, or ``resilient launch --preload``), or are torchrun's
    workers themselves (``plain``)."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0"]
    cmd = [sys.executable, "-m", "resilient.forkserver", "run"]
    if launcher == "launch":
        cmd += ["-m", "resilient.cli", "launch", "--preload", "json", "--spares", "0", *rdzv]
        cmd += ["--nproc-per-node", "2", "-m", "probe", *mode.split()]
    else:
        if launcher == "host":
            cmd += ["-m", "resilient.forkserver", "host", "--preload", "json", "--"]
        else:
            cmd += ["-m"]
        cmd += ["torch.distributed.run", "--nproc-per-node", "2", *rdzv]
        if launcher == "host":
            cmd += ["-m", "resilient.forkserver", "run"]
        cmd += ["-m", "probe", *mode.split()]
    return _spawn(where, cmd, {**_job_env(where), ENV: path})


@pytest.mark.parametrize("launcher", ["host", "launch", "plain"])
def test_a_launcher_forked_from_the_server_runs_its_job_as_torchrun_would(
    where, launchers, launcher
):
    """The launcher is the server's child (not its stand-in's), in the server's image; its
    workers find it as their launcher, and its ranks are forked by a fork server of its own
    (forked from it: torch is imported there), never by the launchers' server; the harness's
    process tree walk reaches all of it from the stand-in, and a kill of that tree leaves
    nothing running, the launchers' server serving on.  A second job from the same server fails
    as torchrun fails: exit 1, a rank's traceback on the stand-in's stderr."""
    server, path = launchers
    proc = _job(where, path, "sleep", launcher)
    _wait_for(lambda: len(list((where / "out").glob("ready-*"))) == 2, timeout_s=120)
    agent = rank_pid(proc.pid)
    assert agent not in (None, proc.pid)
    assert _ppid(agent) == server.pid and "--launchers" in _cmdline(agent)
    infos = _probes(where)
    assert {i["launcher"] for i in infos} == {agent}
    parents = {i["ppid"] for i in infos}
    if launcher == "plain":
        assert parents == {agent} and {i["sock"] for i in infos} == {None}
    else:
        (ranks_server,) = parents
        # forked from the launcher, which had torch (its command line), not a new interpreter
        assert _ppid(ranks_server) == agent and _cmdline(ranks_server) == _cmdline(agent)
        assert {Path(i["sock"]).parent for i in infos} != {Path(path).parent}
        parents.add(agent)
    tree = descendants(proc.pid)
    assert {proc.pid, *parents, *(i["pid"] for i in infos)} <= set(tree)
    killed = kill_tree(proc.pid)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    for pid in killed:
        _wait_for(lambda pid=pid: _gone(pid), timeout_s=30)
    assert server.poll() is None

    for f in (where / "out").iterdir():
        f.unlink()
    proc = _job(where, path, "raise", launcher)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    # (a rank that had not started when another failed is stopped by torchrun before it could)
    assert "RuntimeError: boom in the probe" in err
    assert "Warning" not in err, err  # (runpy's, had the server imported what it runs)


def test_chaos_harness_jobs_are_launched_from_its_launcher_server(tmp_path):
    """A chaos job's agent is forked from the harness's server for launchers: a worker's parent
    (torchrun's agent) has the server's command line, and the server is a child of this
    process.  A job whose environment sets what is read at a start (its ``job.env``: LOGLEVEL
    here) gets a server of its own, started with it."""
    from resilient.chaos import harness
    from resilient.chaos.runner import run_scenario

    (tmp_path / "parent.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            ppid = os.getppid()
            with open(os.path.join(sys.argv[1], "parent.txt"), "w") as f:
                f.write(open(f"/proc/{ppid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
                f.write("|" + os.environ.get("LOGLEVEL", "-"))
            """
        )
    )
    servers = {}
    for name, env in (("plain", ""), ("loglevel", '[job.env]\nLOGLEVEL = "ERROR"')):
        (tmp_path / f"{name}.toml").write_text(
            textwrap.dedent(
                f"""
                name = "{name}"
                [job]
                nproc = 1
                max_restarts = 0
                timeout_s = 120
                command = ["{tmp_path / "parent.py"}", "{{run_dir}}"]
                """
            )
            + env
            + '\n[expect]\nfinal_state = "any"\n'
        )
        run_scenario(tmp_path / f"{name}.toml", tmp_path / "out", say=lambda *_: None)
        parent, level = (tmp_path / "out" / name / "parent.txt").read_text().split("|")
        assert "resilient.forkserver serve" in parent and "--launchers" in parent, parent
        assert level == ("ERROR" if env else os.environ.get("LOGLEVEL", "-"))
        servers[name] = parent
        assert os.getpid() in {_ppid(s.pid) for s, _path in harness._launchers.values()}
    assert servers["plain"] != servers["loglevel"]  # (each server's socket is in its command line)
