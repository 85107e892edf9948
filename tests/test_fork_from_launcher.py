"""The fork server forked from its launcher (``resilient launch --preload`` and the trainer's
``--nproc`` as their own programs; ``resilient/forkserver.py`` ``fork_ready``): a rank of it is
what torchrun's fresh interpreter would be (``RESILIENT_FORK_RANKS=0``), and the ``launch``
dispatch in ``resilient.cli.main`` (before typer) answers as typer's path did.  Each test here
is a repro from an adversarial review of the first version (thirty-second session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a rank that writes down what a fresh interpreter would have differently from a forked one
PROBE = """
import json, os, sys, warnings
info = {"optimize": sys.flags.optimize, "debug": __debug__, "warnoptions": list(sys.warnoptions),
        "dev_mode": sys.flags.dev_mode, "xoptions": dict(sys._xoptions),
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")), "argv0": sys.argv[0]}
info["parent"] = open(f"/proc/{os.getppid()}/cmdline").read().replace("\\0", " ")
info["links"] = {}
for f in info["fds"]:
    try:
        info["links"][str(f)] = os.readlink(f"/proc/self/fd/{f}")
    except OSError:
        pass
try:
    warnings.warn("a warning in the rank", UserWarning)
    info["warned"] = "returned"
except UserWarning:
    info["warned"] = "raised"
with open(os.path.join(os.environ["PROBE_OUT"], f"rank-{os.getpid()}.json"), "w") as f:
    json.dump(info, f)
"""


@pytest.fixture
def where(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "out").mkdir()
    return tmp_path


def _env(where: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "OMP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(where), str(ROOT)])
    env["PROBE_OUT"] = str(where / "out")
    env["OMP_NUM_THREADS"] = "1"  # fork_ready: the launcher forks the server from itself
    env.update(extra)
    return env


def _launch(where: Path, *, python_flags=(), **popen) -> dict:
    """``python [FLAGS] -m resilient.cli launch --preload json`` of one probe rank; the rank's
    report."""
    cmd = [sys.executable, *python_flags, "-m", "resilient.cli", "launch", "--preload", "json"]
    cmd += ["--nproc-per-node", "1", "--max-restarts", "0", "--spares", "0"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "probe"]
    env = _env(where)
    p = subprocess.run(cmd, env=env, cwd=where, capture_output=True, text=True, timeout=120,
                       **popen)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    reports = sorted((where / "out").glob("rank-*.json"))
    assert len(reports) == 1, p.stderr[-3000:]
    info = json.loads(reports[0].read_text())
    reports[0].unlink()
    return info


@pytest.mark.distributed
def test_a_launcher_with_interpreter_options_does_not_pass_them_to_its_ranks(where):
    """``python -O -W error::UserWarning -m resilient.cli launch --preload ...`` (or
    ``python -O -m reference_trainer --nproc N``): torchrun starts every worker as ``python -u``,
    without the launcher's ``-O``/``-W``/``-X`` flags.  A rank of the forked server is the
    launcher's interpreter: its asserts were off (``__debug__`` False), its warnings raised.
    Such a launcher starts its server as a new interpreter."""
    got = _launch(where, python_flags=("-O", "-W", "error::UserWarning"))
    assert "resilient.forkserver serve" in got["parent"], got["parent"]
    keys = ("optimize", "debug", "warnoptions", "warned")
    assert {k: got[k] for k in keys} == {  # what `python -u -m probe` has
        "optimize": 0,
        "debug": True,
        "warnoptions": [],
        "warned": "returned",
    }


@pytest.mark.distributed
def test_forked_rank_does_not_inherit_the_launchers_file_descriptors(where):
    """A descriptor the launcher inherited (a supervisor's pipe, a lock file, ``3>file``):
    torchrun's workers (Popen, close_fds) and the server before 61f6e4c (a Popen) never had it;
    the forked server and every rank it forks hold it, for as long as they live (a rank outliving
    its launcher keeps a supervisor's pipe open, a lock held)."""
    r, w = os.pipe()
    pipe = os.readlink(f"/proc/self/fd/{w}")
    try:
        forked = _launch(where, pass_fds=(w,))
    finally:
        os.close(r)
        os.close(w)
    assert "resilient.forkserver serve" not in forked["parent"], forked["parent"]  # forked
    # (the number may stay taken, on /dev/null: a launcher object that owns it closes that)
    assert pipe not in forked["links"].values(), forked["links"]


SPY = """
import json, os
from resilient import forkserver
_start = forkserver.start
def start(preload, *, fork=False):
    with open(os.environ["SPY_OUT"], "a") as f:
        f.write(json.dumps({"fork": fork, "omp": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
    return _start(preload, fork=fork)
forkserver.start = start
"""


@pytest.mark.distributed
def test_trainer_nproc_forks_its_server_without_omp_num_threads_exported(tmp_path):
    """``python -m reference_trainer --nproc 2 ...`` with OMP_NUM_THREADS not exported (the
    usual case): the ranks get one thread each, and the launcher's torch must be imported under
    that already, or ``fork_ready()`` says no on any machine with more than one core (the review
    found the setting came after torch's import).  A sitecustomize records what the launcher
    asked of ``forkserver.start``; the run is real (2 steps)."""
    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(SPY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "OMP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "spy"), str(ROOT)])
    env["SPY_OUT"] = str(tmp_path / "spy.jsonl")
    cmd = [sys.executable, "-m", "reference_trainer", "--nproc", "2", "--dp", "2", "--steps", "2"]
    cmd += ["--ckpt", str(tmp_path / "ck")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "spy.jsonl").read_text().splitlines()]
    assert calls == [{"fork": True, "omp": "1"}], calls
    assert (tmp_path / "ck" / "step_00000002").is_dir()


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``resilient ARGS`` through ``resilient.cli.main`` in this process (what reaches the
    launcher here stops at its argument parser): (exit code, stdout and stderr)."""
    from resilient import cli

    monkeypatch.setattr(sys, "argv", ["resilient", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_launch_double_dash_help_is_the_same_help_as_before(monkeypatch, capsys):
    """``resilient launch -- -h``: through typer (before 61f6e4c) click took the ``--`` out and
    the command printed its usage (exit 0), as ``resilient launch -h`` still does; the first
    dispatch in cli.main handed ``-h`` to torchrun's argparse parser, a different help."""
    plain = _cli(monkeypatch, capsys, "launch", "-h")
    assert plain[0] == 0 and "usage: resilient launch" in plain[1]
    assert _cli(monkeypatch, capsys, "launch", "--", "-h") == plain


def test_launch_with_a_bare_double_dash_is_the_usage_error_it_was(monkeypatch, capsys):
    """``resilient launch --`` (nothing after it): typer's path gave the command's usage and
    exit 2, as ``resilient launch`` still does; the first dispatch gave torchrun's parser's
    error (exit 2)."""
    bare = _cli(monkeypatch, capsys, "launch")
    assert bare[0] == 2 and "usage: resilient launch" in bare[1]
    assert _cli(monkeypatch, capsys, "launch", "--") == bare


ATEXIT_PROBE = """
import atexit, json, os, sys
MARK = "the rank's own __main__"
def at_exit():
    main = sys.modules["__main__"]
    with open(os.path.join(os.environ["PROBE_OUT"], f"atexit-{os.getpid()}.json"), "w") as f:
        json.dump({"argv0": sys.argv[0], "mark": getattr(main, "MARK", None)}, f)
atexit.register(at_exit)
"""


@pytest.mark.distributed
def test_rank_of_launch_preload_under_host_keeps_its_argv0_and_main_at_exit(where):
    """``python -m resilient.forkserver host --preload M -- resilient.cli launch --preload M ...``
    (host's own launcher, given --preload too): host runs cli.main through
    ``runpy.run_module(alter_sys=True)``, and launch_main (program=True) forks a second server
    under it, so each rank unwinds through runpy's _TempModule/_ModifiedArgv0 ``__exit__``:
    its atexit handlers see ``sys.argv[0] == "resilient.cli"`` and the host's ``__main__``
    (resilient/forkserver.py) instead of its own."""
    (where / "probe.py").write_text(ATEXIT_PROBE)
    cmd = [sys.executable, "-m", "resilient.forkserver", "host", "--preload", "json", "--"]
    cmd += ["resilient.cli", "launch", "--preload", "json", "--nproc-per-node", "1"]
    cmd += ["--spares", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    cmd += ["-m", "probe"]
    p = subprocess.run(cmd, env=_env(where), cwd=where, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    (report,) = sorted((where / "out").glob("atexit-*.json"))
    info = json.loads(report.read_text())
    assert info == {"argv0": str(where / "probe.py"), "mark": "the rank's own __main__"}


@pytest.mark.distributed
def test_a_ranks_traceback_does_not_show_the_launchers_frames(where):
    """(nit) A rank's traceback runs through cli.main, launch_main's ``forkserver.start(...)``
    line and the server's loop before the rank's own code: read top-down it looks like the
    launcher crashed.  ``python -m probe`` (what torchrun starts) shows runpy and the probe."""
    (where / "probe.py").write_text("raise RuntimeError('boom in the probe')\n")
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--preload", "json"]
    cmd += ["--nproc-per-node", "1", "--max-restarts", "0", "--spares", "0"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "probe"]
    p = subprocess.run(cmd, env=_env(where), cwd=where, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert "boom in the probe" in p.stderr, p.stderr[-3000:]
    assert "launch_main" not in p.stderr and "resilient/cli.py" not in p.stderr, p.stderr[-3000:]


def test_the_interpreter_options_and_gpu_drivers_fork_ready_looks_at():
    from resilient import forkserver

    for argv, plain in [
        (["python", "-m", "resilient.cli", "launch"], True),
        (["python", "-u", "-m", "reference_trainer"], True),
        (["/venv/bin/python", "/venv/bin/resilient", "launch", "-O"], True),  # (a console script)
        (["python", "-O", "-m", "resilient.cli"], False),
        (["python", "-X", "dev", "-m", "resilient.cli"], False),
        (["python", "-W", "error", "train.py"], False),
    ]:
        sys_argv = sys.orig_argv
        try:
            sys.orig_argv = argv
            assert forkserver._plain_interpreter() is plain, argv
        finally:
            sys.orig_argv = sys_argv
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libcudart.so.12\n"
        "7f10-7f20 r-xp 00000000 08:01 13 /usr/lib/libnvidia-ml.so.1\n"
        "7f20-7f30 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert not forkserver._gpu_driver_loaded(maps)  # the runtime is linked; the driver is not up
    assert forkserver._gpu_driver_loaded(maps + "7f30-7f40 r-xp 0 08:01 14 /usr/lib/libcuda.so.1\n")
