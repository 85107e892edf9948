"""The launcher and the command lines refuse nonsense by name, before any work (a review of the
launcher and the CLIs: each of these failed before its fix with a raw traceback, a leaked
process, or minutes of work on a typo).  Quick: subprocesses with short timeouts, a trivial
worker script, no training."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from resilient import Checkpointer, Layout
from resilient.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "200"
    return env


def _resilient(
    args: list[str], cwd: Path, timeout: float = 60.0, **kw
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resilient.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text and "─╮" not in text, (
        "a raw (rich) traceback instead of a one-line error:\n" + text[-2500:]
    )


# --- resilient launch: torchrun's flags with nonsense values -----------------------------------


NONSENSE = [
    ["--nproc-per-node", "0"],  # AssertionError from WorkerSpec (local_world_size > 0)
    ["--nproc-per-node", "abc"],  # ValueError: Unsupported nproc_per_node value
    ["--nproc-per-node", "100000"],  # started 100000 workers (forked until memory ran out)
    ["--spares", "100000"],  # started 100000 spares
    ["--master-port", "99999"],  # ValueError from the rendezvous endpoint parser
    ["--max-restarts", "-1"],  # AssertionError: max_restarts must be >= 0
    ["--monitor-interval", "-1"],  # AssertionError from WorkerSpec.__post_init__
    ["--nnodes", "0"],  # AssertionError: min_nodes must be > 0
    ["--nnodes", "2", "--standalone"],  # waited for a second node until the rendezvous timeout
    ["--rdzv-backend", "bogus"],  # ValueError: the backend is not registered
    ["--rdzv-endpoint", "localhost:notaport", "--rdzv-backend", "c10d"],  # ValueError: port
    ["--rdzv-conf", "join_timeout=abc"],  # ValueError: not a valid integer value
    ["--finish-timeout", "-1"],  # a bound in the past: every worker killed at the first exit
    ["--finish-timeout", "nan"],  # compared false with everything: never (or always) fired
]

# Every command line of NONSENSE through the launcher's entry point, in one process (one torch
# import for all ten): [exit code, what it printed] each.
# (no agent is ever made here: a case that got past the checks must not start its workers, the
# 100000 of --nproc-per-node 100000 included)
_LAUNCH_EACH = """
import contextlib, io, json, sys
import resilient.launch.agent as agent
from resilient.launch.agent import launch_main
def no_agent(*args, **kwargs):
    print("worker ran (an agent was made)")
    raise SystemExit(0)
agent.InJobAgent = no_agent
out = []
for flags in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = launch_main([*flags, "--spares", "0", "w.py"])
        except SystemExit as e:
            code = e.code
    out.append([code, buf.getvalue()])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def nonsense_launches(tmp_path_factory):
    import json

    d = tmp_path_factory.mktemp("nonsense")
    (d / "w.py").write_text("print('worker ran')\n")
    r = subprocess.run(
        [sys.executable, "-c", _LAUNCH_EACH, json.dumps(NONSENSE)],
        cwd=d, env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _no_traceback(r.stderr)  # (what a case logged rather than printed)
    return {" ".join(f): (code, text) for f, (code, text) in zip(NONSENSE, json.loads(
        r.stdout.splitlines()[-1]))}  # fmt: skip


@pytest.mark.parametrize("flags", NONSENSE, ids=lambda f: " ".join(f))
def test_launch_rejects_nonsense_flags_with_a_usage_error(nonsense_launches, flags):
    code, out = nonsense_launches[" ".join(flags)]
    _no_traceback(out)
    assert code == 2, f"exit {code}, expected 2 (bad usage):\n{out[-1500:]}"
    assert flags[0] in out, f"the message does not name {flags[0]}:\n{out[-1500:]}"
    assert "worker ran" not in out


# --- resilient launch: stopping the workers reaches their children -----------------------------

_WORKER_WITH_CHILD = """
import os, subprocess, sys, time
if os.environ.get("RESILIENT_SPARE"):
    time.sleep(60); sys.exit(0)
p = subprocess.Popen(["sleep", "97"])
open(os.path.join(sys.argv[1], f"child.{p.pid}"), "w").close()
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_to_launch_stops_the_workers_children_as_torchrun_does(tmp_path):
    """torchrun starts each worker in a session of its own and stops it with killpg, so a
    worker's children (a data-loading helper, a shell wrapper's python) go with it; resilient
    launch signals the worker's pid only, and its children outlive the job."""
    (tmp_path / "w.py").write_text(_WORKER_WITH_CHILD)
    out = tmp_path / "out"
    out.mkdir()
    log = open(tmp_path / "launch.log", "w")  # not a pipe: a leaked child would hold it open
    launcher = subprocess.Popen(
        [sys.executable, "-m", "resilient.cli", "launch", "--nproc-per-node", "1", "--spares",
         "0", "w.py", str(out)],
        cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not children and time.monotonic() < deadline and launcher.poll() is None:
            children = [int(p.name.split(".")[1]) for p in out.glob("child.*")]
            time.sleep(0.1)
        assert children, "the worker never started its child"
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        text = (tmp_path / "launch.log").read_text()
        assert launcher.returncode == 128 + signal.SIGTERM, text[-1500:]
        time.sleep(1.0)
        left = [pid for pid in children if _alive(pid)]
        assert not left, f"the worker's child {left} still runs after the launcher stopped"
    finally:
        log.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_launch_does_not_say_restarting_when_no_restart_is_left(tmp_path):
    """--max-restarts 1: one restart, so one 'restarting the workers'; the final failure says so
    too, though nothing restarts."""
    (tmp_path / "w.py").write_text("import sys; sys.exit(3)\n")
    r = _resilient(
        ["launch", "--nproc-per-node", "1", "--spares", "0", "--max-restarts", "1", "w.py"],
        tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-1500:]
    assert out.count("restarting the workers") == 1, out[-2000:]


# --- reshape: a target layout past the format's rank cap ---------------------------------------


def test_target_layout_past_the_format_cap_is_a_layout_error():
    from reshape.plan import target_layout
    from resilient.checkpoint.format import MAX_WORLD_SIZE
    from resilient.errors import LayoutError

    with pytest.raises(LayoutError):
        target_layout(Layout(dp=1), {"dp": 1_000_000_000})  # > MAX_WORLD_SIZE (2**24)
    assert MAX_WORLD_SIZE < 1_000_000_000


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_reshape_plan_with_a_billion_ranks_is_refused_fast(tmp_path):
    """`reshape plan SRC --dp 1000000000` (a typo) builds a table of every target rank: it grew
    past 18 GB of memory and ran for minutes here before it was killed.  Expected: exit 2 with
    the format's cap (16777216 ranks) named, at once."""
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(2, {"w": torch.arange(3000.0)}).wait()
    code = "import sys; sys.argv[0] = 'reshape'; from reshape.cli import main; main()"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, "plan", str(tmp_path / "ck"), "--dp", "1000000000"],
            env=_env(), capture_output=True, text=True, timeout=30, preexec_fn=_limit_memory,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("reshape plan --dp 1000000000 still ran after 30 s (3 GiB address space)")
    out = r.stdout + r.stderr
    _no_traceback(out)
    assert r.returncode == 2 and "16777216" in out, f"exit {r.returncode}:\n{out[-1500:]}"


# --- resilient preflight / demo: bad paths ------------------------------------------------------


def test_preflight_chaos_plan_that_does_not_exist_is_a_usage_error(tmp_path):
    r = _resilient(["preflight", "--quick", "--chaos", str(tmp_path / "nope.json")], tmp_path)
    out = r.stdout + r.stderr
    _no_traceback(out)  # FileNotFoundError from ChaosHook.from_file (cli.py:183)
    assert r.returncode == 2 and "nope.json" in out, out[-1500:]


def test_preflight_json_into_a_missing_directory_fails_before_measuring(tmp_path):
    """--json into a directory that does not exist: the measurements run, then rank 0 dies
    writing the report with a FileNotFoundError traceback and exit 1 ('a check failed')."""
    target = tmp_path / "no" / "such" / "report.json"
    r = _resilient(
        ["preflight", "--quick", "--nproc", "1", "--budget-s", "1", "--json", str(target)],
        tmp_path,
        timeout=120,
    )
    out = r.stdout + r.stderr
    _no_traceback(out)
    assert r.returncode == 2 and str(target.parent) in out, out[-1500:]


def test_demo_out_that_is_a_file_is_a_usage_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    res = runner.invoke(app, ["demo", "--out", str(f)])
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        f"raw {type(res.exception).__name__}: {res.exception}"  # NotADirectoryError (demo.py:379)
    )
    assert res.exit_code == 2 and "afile" in res.output, res.output
