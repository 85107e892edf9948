"""``resilient launch --finish-timeout`` at its edges (a second review's repros, each failing
before its fix): a job whose workers' store is not the agent's (every poll blocked 30 s on a
connect to rank 0's store, gone once rank 0 exited), and a rank whose work a shell left in the
background (reparented to init, so not its descendant: it was killed as idle, the work with
it).  Plain-Python workers, as in tests/test_finish_timeout.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from resilient.chaos.harness import forked_launcher
from tests.test_finish_timeout import _env

ROOT = Path(__file__).resolve().parents[1]

# argv: a JSON {rank: behaviour}, the output dir.  A behaviour happens the first time its rank
# number runs (a marker file); every rank writes done-<rank> when it leaves.
#   hang: sleep for an hour; busy<N>: compute N seconds;
#   detached-export<N>: start an export (N s of computing) through a shell that leaves it in the
#   background (the shell exits; the export is reparented), and wait for its result file
_WORKER = """
import json, os, subprocess, sys, time
from pathlib import Path
plan, out = json.loads(sys.argv[1]), Path(sys.argv[2])
rank = int(os.environ["RANK"])
(out / f"pid-{rank}-{os.getpid()}").touch()
what = plan.get(str(rank), "")
if what and not (out / f"did-{rank}").exists():
    (out / f"did-{rank}").touch()
    if what == "hang":
        time.sleep(3600)
    elif what.startswith("busy"):
        t = time.monotonic()
        while time.monotonic() - t < float(what[4:]):
            pass
    elif what.startswith("detached-export"):
        n = float(what[len("detached-export"):])
        res = out / f"export-{rank}"
        code = (f"import time\\nt = time.monotonic()\\nwhile time.monotonic() - t < {n}: pass\\n"
                f"open({str(res)!r}, 'w').write('1')\\n")
        subprocess.run(["sh", "-c", f"{sys.executable} -c \\"$0\\" >/dev/null 2>&1 &", code],
                       check=True)
        while not res.exists():
            time.sleep(0.05)
(out / f"done-{rank}").write_text("1")
"""


def _launch(tmp: Path, plan: dict, *flags: str, env: dict | None = None) -> subprocess.Popen:
    (tmp / "w.py").write_text(_WORKER)
    # the launcher forked from this process's server for launchers (its workers as they were)
    cmd, env = forked_launcher(
        [sys.executable, "-m", "resilient.cli", "launch", "--spares", "0", *flags,
         str(tmp / "w.py"), json.dumps(plan), str(tmp)],
        env or _env(),
    )  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _finish(p: subprocess.Popen, timeout: float, tmp: Path) -> str:
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        for f in tmp.glob("pid-*"):  # the workers (each in a session of its own)
            try:
                os.killpg(int(f.name.split("-")[2]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        raise AssertionError(
            f"the launcher did not end in {timeout} s:\n" + p.communicate()[0][-4000:]
        ) from None


def test_without_the_agents_store_a_finished_job_ends_at_once():
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: MASTER_PORT is the workers' store (rank 0 hosts it,
    gone once rank 0 exited; nothing here), yet _say_finished / _say_succeeded / _release_spares
    connect to it with a 30 s timeout, every poll: a job whose ranks all exit 0 at once had not
    ended after 150 s (even with --finish-timeout 0)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        p = _launch(Path(d), {}, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                    "--finish-timeout", "0",
                    env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))  # fmt: skip
        log = _finish(p, 60, Path(d))
        took = time.monotonic() - t0
    assert p.returncode == 0, log[-3000:]
    assert took < 25, f"a job of two ranks that exit at once took {took:.0f}s\n{log[-3000:]}"


def test_without_the_agents_store_a_hung_rank_is_killed_after_the_bound(tmp_path):
    """The same: the 1 s bound killed the hung rank only after ~109 s (each monitor poll blocks
    30 s in _say_finished's TCPStore connect), and the launcher then blocks again (the fallback's
    _succeeded_elsewhere, _release_spares)."""
    t0 = time.monotonic()
    p = _launch(tmp_path, {"1": "hang"}, "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "0", "--finish-timeout", "1",
                env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))  # fmt: skip
    log = _finish(p, 60, tmp_path)
    assert p.returncode == 1 and "Killing it" in log, log[-3000:]
    assert time.monotonic() - t0 < 30, log[-3000:]


def test_a_rank_waiting_for_its_detached_export_is_not_killed_as_idle(tmp_path):
    """Rank 1 exports through a shell that backgrounds the work (the shell exits, the export is
    reparented to init) and polls for its result: the export is not a descendant any more, so
    tree_usage does not count it, the rank is killed as idle, and the export with it (it is
    still in the worker's process group, which the kill signals)."""
    p = _launch(tmp_path, {"1": "detached-export5"}, "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "0", "--finish-timeout", "1.5")  # fmt: skip
    log = _finish(p, 120, tmp_path)
    assert "Killing it" not in log, log[-3000:]
    assert p.returncode == 0 and (tmp_path / "export-1").exists(), log[-3000:]
