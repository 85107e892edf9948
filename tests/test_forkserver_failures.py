"""A forked rank fails as the interpreter torchrun would have started fails (its own exception,
message and exit code), and the server's descriptor hygiene frees no number a launcher object
owns: repros from the second adversarial review of the fork server forked from its launcher
(thirty-second session).

Each test drives a tiny launcher script that starts a server (forked from itself, as
``resilient launch --preload`` does when ``fork_ready()``, or exec'd, as preflight does) and one
stand-in (``python -u -m resilient.forkserver run SCRIPT``), then compares with what a fresh
``python -u SCRIPT`` (torchrun's worker, RESILIENT_FORK_RANKS=0) does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAUNCHER = """
import os, subprocess, sys
from resilient import forkserver
KEEP = None
if os.environ.get("KEEP_INHERITABLE"):
    # a launcher-owned file object on an inheritable descriptor (a supervisor's pipe or a log
    # descriptor it was handed and wraps: socket.socket(fileno=3), os.fdopen(3, "w"), ...)
    r, w = os.pipe()
    os.set_inheritable(w, True)
    KEEP = os.fdopen(w, "w")
server = forkserver.start(["json"], fork=os.environ.get("FORK") == "1")
p = subprocess.run([sys.executable, "-u", "-m", "resilient.forkserver", "run", *sys.argv[1:]])
forkserver.stop(server)
sys.exit(p.returncode)
"""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "OMP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _fresh(tmp: Path, *target: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-u", *target], env=_env(tmp, **env), cwd=tmp,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _served(tmp: Path, fork: bool, *target: str, **env: str) -> subprocess.CompletedProcess:
    (tmp / "launcher.py").write_text(LAUNCHER)
    return subprocess.run([sys.executable, str(tmp / "launcher.py"), *target],
                          env=_env(tmp, FORK="1" if fork else "0", **env), cwd=tmp,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


# --- defect: a rank's uncaught OSError is taken for a failed fork -------------------------------


@pytest.mark.parametrize("fork", [True, False], ids=["forked-server", "execd-server"])
def test_a_ranks_uncaught_oserror_is_reported_as_the_rank_raised_it(tmp_path, fork):
    """A rank that dies of an OSError (a missing data file, a refused connection, a timeout:
    FileNotFoundError, ConnectionError, TimeoutError, PermissionError...) unwinds through
    ``_fork``'s ``except OSError`` (meant for ``os.fork()`` only) in the child: the server
    prints "resilient.forkserver: fork: [Errno 2] ..." as if the fork had failed, then closes
    the request's descriptors (closed already by ``_child``), and the rank dies of
    ``OSError: [Errno 9] Bad file descriptor`` with the launcher's and server's frames: the
    rank's own exception and traceback are gone.  ``python -u needs_data.py`` prints the
    FileNotFoundError and its line."""
    (tmp_path / "needs_data.py").write_text('open("/nonexistent/train.bin")\n')
    fresh = _fresh(tmp_path, "needs_data.py")
    served = _served(tmp_path, fork, "needs_data.py")
    assert "FileNotFoundError" in fresh.stderr and fresh.returncode == 1
    assert served.returncode == 1
    assert "Bad file descriptor" not in served.stderr, served.stderr[-2000:]
    assert "resilient.forkserver: fork:" not in served.stderr, served.stderr[-2000:]
    assert served.stderr == fresh.stderr, served.stderr[-2000:]


def test_a_rank_whose_script_is_missing_fails_as_python_does(tmp_path):
    """(same root cause) ``python missing.py`` says "can't open file ...: [Errno 2]" and exits
    2; a forked rank prints the fake fork failure and the EBADF traceback, and exits 1."""
    fresh = _fresh(tmp_path, "missing.py")
    served = _served(tmp_path, True, "missing.py")
    assert fresh.returncode == 2
    assert "Bad file descriptor" not in served.stderr, served.stderr[-2000:]
    assert served.returncode == 2, served.stderr[-2000:]


# --- nit: a script's SyntaxError --------------------------------------------------------------


def test_a_scripts_syntax_error_is_printed_as_python_prints_it(tmp_path):
    """``python -u syn.py`` prints the SyntaxError alone (no code ran: no traceback);
    _rank_excepthook skips the frozen importlib frames only while another frame follows, so the
    last one stays and a "Traceback ... <frozen importlib._bootstrap>" header is printed."""
    (tmp_path / "syn.py").write_text("x = (\n")
    fresh = _fresh(tmp_path, "syn.py")
    served = _served(tmp_path, True, "syn.py")
    assert fresh.returncode == served.returncode == 1
    assert served.stderr == fresh.stderr, served.stderr[-2000:]


# --- risk: _close_inherited frees a number a launcher object still owns -------------------------

RANK_WITH_LOG = """
import atexit, os
log = open(os.environ["RANK_LOG"], "w")  # the lowest free descriptor
log.write("started\\n")
@atexit.register
def bye():
    log.write("finished\\n")
    log.close()
"""


def test_a_launcher_objects_inheritable_descriptor_is_not_freed_for_reuse(tmp_path):
    """_close_inherited closes an inheritable descriptor that a Python object of the launcher
    owns; the number is reused (the server's listener, then in the rank the rank's own file),
    and when the rank unwinds through the launcher's frames the owner is deallocated and closes
    *that number*: the rank's log loses what its atexit handler writes (EBADF), or, had the
    number been reused again, the write lands in another file.  A fresh interpreter, or the
    server before 1c2f524, never closed a file it did not own."""
    (tmp_path / "ranklog.py").write_text(RANK_WITH_LOG)
    log = tmp_path / "rank.log"
    fresh = _fresh(tmp_path, "ranklog.py", RANK_LOG=str(log))
    assert fresh.returncode == 0 and log.read_text() == "started\nfinished\n"
    log.unlink()
    served = _served(tmp_path, True, "ranklog.py", RANK_LOG=str(log), KEEP_INHERITABLE="1")
    assert log.read_text() == "started\nfinished\n", served.stderr[-2000:]
    assert served.returncode == 0


# --- defect (low): a GPU driver mapped from a deleted file ------------------------------------


def test_a_gpu_driver_mapped_from_a_deleted_file_is_seen():
    """/proc/self/maps marks a mapping whose file was replaced since (a driver upgraded under a
    running job, a container's overlay) with a trailing " (deleted)": ``line.split()[-1]`` is
    then "(deleted)", the driver goes unseen, and fork_ready() forks a process whose CUDA driver
    is initialised (torch.cuda.is_available() does that without is_initialized())."""
    from resilient import forkserver

    line = (
        "7f30-7f40 r-xp 00000000 08:01 14      "
        "/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05 (deleted)\n"
    )
    assert forkserver._gpu_driver_loaded(line)
    spaced = "7f30-7f40 r-xp 00000000 08:01 14      /opt/nvidia drivers/libcuda.so.1 (deleted)\n"
    assert forkserver._gpu_driver_loaded(spaced)
