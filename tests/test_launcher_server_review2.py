"""A second adversarial review of the server for launchers (resilient/forkserver.py
``start_launchers``, the chaos harness's ``_launcher_server``): a launcher forked from it must start
as the one its stand-in would have exec'd.  Each test starts a job's "launcher" (a small script)
through a stand-in, the way the harness does, and compares what it sees with what an exec'd
launcher sees; each failed against the version before its fix (the umask, the resource limits and
the ignored signals a stand-in was started with; TZ, the locale, PYTORCH_*, FSSPEC_* as start
settings; the job's own RESILIENT_FORK_RANKS; the servers kept; a server stopped as it started)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resilient.forkserver import ENV, start_launchers, stop

ROOT = str(Path(__file__).resolve().parents[1])

_REPORT = textwrap.dedent(
    """
    import json, os, resource, sys, time
    out = {"pid": os.getpid(), "ppid": os.getppid()}
    p = os.path.join(os.environ["REVIEW_DIR"], "made-%d" % os.getpid())
    open(p, "w").close()
    out["mode"] = os.stat(p).st_mode & 0o777
    out["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    out["timezone"] = time.timezone
    if "fsspec.config" in sys.modules:
        out["fsspec"] = sys.modules["fsspec.config"].conf
    else:
        import fsspec.config
        out["fsspec"] = fsspec.config.conf
    print(json.dumps(out))
    """
)


def _base_env(tmp: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV and not k.startswith("FSSPEC_")}
    env["PYTHONPATH"] = ROOT
    env["REVIEW_DIR"] = str(tmp)
    env["TZ"] = "UTC0"
    env.update(extra)
    return env


def _stop_ready(srv, sock: str) -> None:
    """stop() once the server listens (an earlier SIGTERM leaks its directory: see
    test_a_server_stopped_early_leaves_no_directory)."""
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(sock) and srv.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    stop(srv)


@pytest.fixture
def job(tmp_path):
    """``run(env, preexec=None, server=None)``: the report of the launcher script started through
    a stand-in (forked when ``server`` is a socket whose server agrees), and whether it was
    forked (its parent is not the stand-in)."""
    script = tmp_path / "launcher.py"
    script.write_text(_REPORT)
    procs: list[subprocess.Popen] = []

    def run(env, preexec=None, server=None):
        env = dict(env)
        if server is not None:
            env[ENV] = server
        cmd = [sys.executable, "-m", "resilient.forkserver", "run", str(script)]
        p = subprocess.Popen(
            cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=preexec, start_new_session=True,
        )  # fmt: skip
        procs.append(p)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        report = json.loads(out.decode().strip().splitlines()[-1])
        report["forked"] = report["pid"] != p.pid
        return report

    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture
def server(tmp_path):
    started = []

    def start(env, preload=("fsspec",)):
        old = os.umask(0o022)  # the harness's, when it started the server
        try:
            srv, path = start_launchers(list(preload), env, cwd=str(tmp_path))
        finally:
            os.umask(old)
        started.append((srv, path))
        return path

    yield start
    for srv, path in started:
        _stop_ready(srv, path)


def test_umask_of_the_stand_in_is_the_launchers(tmp_path, job, server):
    """A job started under ``umask 077`` (``sh -c 'umask 077; exec ...'``, a supervisor's
    setting): its exec'd launcher creates 0600 files; a forked one has the server's umask and
    creates 0644 files (checkpoints, logs readable by others).  The request carries no umask."""
    env = _base_env(tmp_path)
    plain = job(env, preexec=lambda: os.umask(0o077))
    assert not plain["forked"] and plain["mode"] == 0o600
    forked = job(env, preexec=lambda: os.umask(0o077), server=server(env))
    assert forked["forked"]
    assert forked["mode"] == plain["mode"], oct(forked["mode"])


def test_rlimits_of_the_stand_in_are_the_launchers(tmp_path, job, server):
    """``ulimit -n`` (or ``prlimit``) in front of a job: the exec'd launcher has the limit, a
    forked one the server's (RLIMIT_NOFILE, RLIMIT_CORE, RLIMIT_AS ... are not in the request)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 200) - 1

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    env = _base_env(tmp_path)
    plain = job(env, preexec=limit)
    assert not plain["forked"] and plain["nofile"] == low
    forked = job(env, preexec=limit, server=server(env))
    assert forked["forked"]
    assert forked["nofile"] == low


def test_tz_is_a_start_setting(tmp_path, job, server):
    """``TZ`` is read by the interpreter at its start (``time.timezone``, ``time.tzname``), and
    not in ``start_settings``: a job with another TZ is forked from the server and keeps the
    server's (logging's %z, a launcher's timestamps computed from time.timezone)."""
    path = server(_base_env(tmp_path, TZ="UTC0"))
    env = _base_env(tmp_path, TZ="JST-9")
    plain = job(env)
    assert plain["timezone"] == -9 * 3600
    forked = job(env, server=path)
    # either refused (runs itself) or forked with the job's own TZ
    assert forked["timezone"] == plain["timezone"], (forked["forked"], forked["timezone"])


def test_fsspec_settings_of_a_later_job(tmp_path, job, server):
    """fsspec (in the harness's launcher preload, and imported by a forked ``host``'s ranks from
    their launcher) reads ``FSSPEC_*`` variables (and ``FSSPEC_CONFIG_DIR``/``~/.config/fsspec``)
    once, at import: the server imports it in the *first* job's environment, and every later job
    with the same start settings is forked with the first job's fsspec configuration."""
    path = server(_base_env(tmp_path, FSSPEC_FILE_AUTO_MKDIR="1"), preload=("fsspec",))
    first = job(_base_env(tmp_path, FSSPEC_FILE_AUTO_MKDIR="1"), server=path)
    assert first["forked"] and first["fsspec"] == {"file": {"auto_mkdir": 1}}
    env = _base_env(tmp_path)
    plain = job(env)
    assert plain["fsspec"] == {}
    later = job(env, server=path)
    assert later["fsspec"] == plain["fsspec"], (later["forked"], later["fsspec"])
    assert not later["forked"]  # (FSSPEC_* is a start setting: its stand-in ran it)


def test_harness_forks_a_job_that_asks_for_plain_ranks(tmp_path, monkeypatch):
    """``_launcher_server``'s docstring: None where launchers start ranks the usual way
    (``RESILIENT_FORK_RANKS=0``), so that such a job is started as plain torchrun starts it.  It
    reads the switch from the harness's environment, not the job's: a scenario whose
    ``job.env`` says RESILIENT_FORK_RANKS=0 still has its launcher forked."""
    from resilient.chaos import harness

    monkeypatch.delenv("RESILIENT_FORK_RANKS", raising=False)
    monkeypatch.setattr(harness, "_launchers", {})
    try:
        got = harness._launcher_server(_base_env(tmp_path, RESILIENT_FORK_RANKS="0"))
        assert got is None
    finally:
        for srv, sock in harness._launchers.values():
            _stop_ready(srv, sock)


def test_harness_keeps_a_server_per_job_settings(tmp_path, monkeypatch):
    """A scenario's ``job.env`` with ``{run_dir}`` in a start setting (NCCL_DEBUG_FILE,
    TORCH_HOME, PYTHONPYCACHEPREFIX ...) differs per job: each job starts a new server for
    launchers (with torch imported, hundreds of MB) and none is ever stopped or reused before
    the harness exits, so a suite's servers grew with its jobs.  Now the harness keeps the two
    used last and stops an older one (which exits once its launchers have)."""
    import time

    from resilient.chaos import harness

    monkeypatch.delenv("RESILIENT_FORK_RANKS", raising=False)
    monkeypatch.setattr(harness, "_launchers", {})
    started = []
    try:
        for i in range(3):
            harness._launcher_server(_base_env(tmp_path, NCCL_DEBUG_FILE=f"{tmp_path}/run{i}/x"))
            started += [s for s, _ in harness._launchers.values() if s not in started]
        assert len(started) == 3 and len(harness._launchers) == harness._LAUNCHER_SERVERS
        deadline = time.monotonic() + 60
        while sum(s.poll() is None for s in started) > harness._LAUNCHER_SERVERS:
            assert time.monotonic() < deadline, "the server stopped did not exit"
            time.sleep(0.05)
    finally:
        for srv, sock in harness._launchers.values():
            _stop_ready(srv, sock)
        from resilient.forkserver import sweep

        sweep()  # (the stopped one's directory, had it died as it started)


LOCALE_PROBE = """
import json, locale, os, sys
print(json.dumps({"pid": os.getpid(), "utf8": sys.flags.utf8_mode,
                  "ctype": locale.setlocale(locale.LC_CTYPE)}))
"""


def test_locale_is_a_start_setting(tmp_path, server):
    """The interpreter sets its locale (LC_CTYPE) and UTF-8 mode from LANG/LC_ALL/LC_CTYPE at its
    start (PEP 538/540: LC_ALL=C turns UTF-8 mode on); none of them is in ``start_settings``, so
    a job with LC_ALL=C is forked from a server started under C.UTF-8 and runs with the server's
    locale and flags."""
    script = tmp_path / "loc.py"
    script.write_text(LOCALE_PROBE)
    base = {k: v for k, v in _base_env(tmp_path).items() if not k.startswith(("LC_", "LANG"))}
    path = server({**base, "LANG": "C.UTF-8"}, preload=())
    job_env = {**base, "LC_ALL": "C"}
    cmd = [sys.executable, "-m", "resilient.forkserver", "run", str(script)]
    plain = json.loads(subprocess.run(cmd, env=job_env, cwd=tmp_path, capture_output=True,
                                      text=True, timeout=60, check=True).stdout)  # fmt: skip
    forked = subprocess.run(cmd, env={**job_env, ENV: path}, cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, check=True)  # fmt: skip
    got = json.loads(forked.stdout)
    assert (got["utf8"], got["ctype"]) == (plain["utf8"], plain["ctype"]), got


def test_a_server_stopped_early_leaves_no_directory(tmp_path):
    """``stop`` (SIGTERM) of a server for launchers before its interpreter reached ``serve``
    (its SIGTERM handler) kills it outright: its /tmp/resilient-forkserver-* directory stays
    (until some later start's sweep).  The harness's own servers exit with it, but every stop()
    of a just-started one (the tests' fixtures, a program that starts then gives up) leaks."""
    srv, path = start_launchers([], _base_env(tmp_path))
    stop(srv)
    root = os.path.dirname(path)
    leaked = os.path.isdir(root)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    assert not leaked, f"{root} left after stop()"


JIT_PROBE = """
import json, os
import torch.jit._state as s
print(json.dumps({"pid": os.getpid(), "jit": bool(s._enabled.enabled)}))
"""


def test_pytorch_variables_are_start_settings(tmp_path, server):
    """torch reads PYTORCH_JIT when torch.jit is imported (torch/jit/_state.py), which the
    harness's launcher preload does; ``_START_PREFIXES`` has TORCH but not PYTORCH_ (nor
    KINETO_, ...): a job with PYTORCH_JIT=0 after one without is forked with the JIT on (and so
    are the ranks ``host`` forks from that launcher)."""
    from resilient.chaos.harness import _LAUNCHER_PRELOAD

    script = tmp_path / "jit.py"
    script.write_text(JIT_PROBE)
    base = {k: v for k, v in _base_env(tmp_path).items() if not k.startswith("PYTORCH_")}
    path = server(base, preload=_LAUNCHER_PRELOAD)
    cmd = [sys.executable, "-m", "resilient.forkserver", "run", str(script)]

    def run(env):
        out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=150, check=True)  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    run({**base, ENV: path})  # the first job: the server imports torch
    job_env = {**base, "PYTORCH_JIT": "0"}
    plain = run(job_env)
    assert plain["jit"] is False
    got = run({**job_env, ENV: path})
    assert got["jit"] is plain["jit"], got


HUP_PROBE = """
import os, sys, time
open(os.path.join(os.environ["REVIEW_DIR"], "ready-%s" % sys.argv[1]), "w").close()
time.sleep(3)
print("survived")
"""


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_signal_the_job_ignores_is_ignored_by_its_launcher(tmp_path, server, sig):
    """``nohup`` (SIGHUP), a shell's ``&`` (SIGINT, SIGQUIT) start a job with the signal
    ignored, and an exec'd launcher keeps it ignored (an ignored disposition survives exec;
    Python leaves an ignored SIGINT alone).  The stand-in installs its forwarding handler over
    the ignore, and the forked launcher gets SIG_DFL (SIGINT: KeyboardInterrupt): the hangup
    that a nohup'd job must survive kills the forked launcher (and, through torchrun, its job)."""
    script = tmp_path / "hup.py"
    script.write_text(HUP_PROBE)
    env = _base_env(tmp_path)
    path = server(env, preload=())

    def run(name, env):
        cmd = [sys.executable, "-m", "resilient.forkserver", "run", str(script), name]
        p = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True,
                             preexec_fn=lambda: signal.signal(sig, signal.SIG_IGN))  # fmt: skip
        try:
            import time

            deadline = time.monotonic() + 60
            while not (tmp_path / f"ready-{name}").exists():
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.05)
            p.send_signal(sig)
            out, _err = p.communicate(timeout=60)
            return p.returncode, out.decode().strip()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

    assert run("plain", env) == (0, "survived")
    assert run("forked", {**env, ENV: path}) == (0, "survived")
