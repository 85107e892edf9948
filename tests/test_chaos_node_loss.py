"""The chaos harness's node faults (``kill_node``, ``replace_node``) fire once the node is in the
job: it has workers, or spares of ``resilient launch`` (one that took a rank over has the rank in
its ``os.environ`` only, so the harness finds it by the pid its ChaosHook writes).  Losing a node that never joined (late to an elastic rendezvous on a
loaded machine) would lose nothing and test no recovery.  Real processes throughout: agents
standing for nodes, a real spare taking a rank over through ``wait_for_rank`` on a TCPStore, and
the harness's own supervisor loop (``_supervise``)."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from resilient.chaos.faults import SPARES_DIR, has_workers, kill_tree, worker_pid
from resilient.chaos.harness import RunPaths, _supervise
from resilient.chaos.scenario import Fault, Job
from resilient.health.events import EventLog
from resilient.health.heartbeat import process_start, process_state
from resilient.launch import free_port

ROOT = Path(__file__).resolve().parents[1]

# an agent with one worker (a child with a rank's environment, as torchrun starts it) once the
# file argv[1] exists; argv[2]: the worker's rank
_AGENT = """
import os, subprocess, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                 env=dict(os.environ, RANK=sys.argv[2], LOCAL_RANK="0"))
time.sleep(120)
"""
# An agent of `resilient launch` on a node of one rank, whose only worker is its spare, started
# without RANK or LOCAL_RANK as the launcher starts one (agent.py _start_spare); given a rank,
# resilient.launch.injob.wait_for_rank sets them in os.environ (not in /proc/PID/environ).
# argv: the spare's program, then its arguments: store port, key file, taken file.
_INJOB_AGENT = """
import os, subprocess, sys, time
env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "ROLE_RANK")}
env.update(RESILIENT_SPARE="0:0", TORCHELASTIC_RUN_ID="node-loss", TORCHELASTIC_RESTART_COUNT="0")
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env,
                 start_new_session=True)
time.sleep(120)
"""
# the spare: given a rank, it calls the job's hooks as resilient.launch.init_process_group does
# next (a chaos job's ChaosHook, with the run's marker directory, argv[4], when given)
_SPARE = """
import datetime, os, sys, time
from pathlib import Path
from torch.distributed import TCPStore
from resilient.chaos.faults import ChaosHook
from resilient.launch.injob import base_key, wait_for_rank
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                 timeout=datetime.timedelta(seconds=60))
hooks = [ChaosHook({"marker_dir": sys.argv[4], "faults": []}, None, None)] if sys.argv[4:] else []
Path(sys.argv[2]).write_text(base_key())
assert wait_for_rank(store)
for hook in hooks:
    hook.at_phase("init_process_group", None)
Path(sys.argv[3]).write_text(os.environ["RANK"] + " " + os.environ["LOCAL_RANK"] + " " + str(os.getpid()))
time.sleep(120)
"""


def _agent(go: Path, rank: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _AGENT, str(go), str(rank)])


def _supervisor(
    tmp: Path, agents: list[subprocess.Popen], faults: list[Fault], start: Any = None
) -> tuple[threading.Thread, list, RunPaths, list[Path]]:
    """The harness's supervisor loop over ``agents`` in a thread, the job past every fault's
    step: (the thread, its result once it returned, the run's paths, each node's memory root)."""
    paths = RunPaths(tmp)
    paths.metrics.write_text(json.dumps({"step": 20}) + "\n")
    memory = [tmp / f"mem{n}" for n in range(len(agents))]
    for m in memory:
        m.mkdir()
    result: list = []
    job = Job(nproc=1, nodes=len(agents), elastic=len(agents) > 1, timeout_s=120)
    events = EventLog(str(paths.events))
    thread = threading.Thread(
        target=lambda: result.append(
            _supervise(job, paths, agents, faults, events, time.time(), print, memory, start)
        ),
        daemon=True,
    )
    thread.start()
    return thread, result, paths, memory


def _fired(paths: RunPaths) -> list[tuple[str, Any]]:
    if not paths.events.exists():
        return []
    records = [json.loads(line) for line in paths.events.read_text().splitlines()]
    return [(e["event"], e.get("id")) for e in records]


def _wait(what: Any, timeout_s: float = 60) -> bool:
    deadline = time.time() + timeout_s
    while not what() and time.time() < deadline:
        time.sleep(0.05)
    return bool(what())


def _end(agents: list[subprocess.Popen | None], supervisor: threading.Thread | None) -> None:
    """Every agent killed with all it started, then the supervisor, which returns once they
    are gone."""
    for a in agents:
        if a is not None:
            kill_tree(a.pid)
            a.wait()
    if supervisor is not None:
        supervisor.join(timeout=60)


def test_a_node_is_lost_only_once_it_is_in_the_job(tmp_path):
    """``kill_node`` at a step already reached waits for the node's workers, then fires."""
    go = [tmp_path / "go0", tmp_path / "go1"]
    go[0].touch()  # node 0 is in the job from the start; node 1 comes late
    agents = [_agent(go[n], 2 * n) for n in range(2)]
    supervisor = None
    try:
        assert _wait(lambda: has_workers(agents[0].pid))
        assert not has_workers(agents[1].pid)
        fault = Fault(id="lose-node-1", kind="kill_node", node=1, step=12)
        supervisor, result, paths, memory = _supervisor(tmp_path, agents, [fault])
        time.sleep(1.0)  # some twenty of the supervisor's rounds with the fault due
        assert agents[1].poll() is None and memory[1].exists()  # not in the job: not lost yet
        assert _fired(paths) == []
        go[1].touch()  # node 1 joins: now it is lost, with its memory
        agents[1].wait(timeout=60)
        # (the supervisor drops the memory and writes the event once the agent is gone)
        assert _wait(lambda: _fired(paths) == [("fault", "lose-node-1")]), _fired(paths)
        assert not memory[1].exists() and memory[0].exists()
    finally:
        _end(agents, supervisor)
    assert result == [([1], False, None)]


def _spare_takes_rank_0(tmp: Path, store: TCPStore, port: int, *markers: str) -> Any:
    """An agent whose spare is given rank 0 (local rank 0), as the launcher hands it over:
    (the agent, the spare's pid)."""
    key_file, taken = tmp / "key", tmp / "taken"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _INJOB_AGENT,
            _SPARE,
            str(port),
            str(key_file),
            str(taken),
            *markers,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert _wait(key_file.exists, 120), "the spare never came up"
    assignment = {"rank": 0, "local_rank": 0, "gen": 1}
    store.set(f"{key_file.read_text()}/assign/0/0", json.dumps(assignment))
    assert _wait(lambda: taken.exists() and taken.read_text().count(" ") == 2)
    rank, local_rank, pid = taken.read_text().split()
    assert (rank, local_rank) == ("0", "0")
    return agent, int(pid)


def test_a_node_whose_rank_a_spare_took_over_is_in_the_job(tmp_path):
    """The node's only rank runs in the spare that took it over: the node is lost when due."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    agent = None
    supervisor = None
    try:
        agent, _ = _spare_takes_rank_0(tmp_path, store, port)
        fault = Fault(id="lose-node-0", kind="kill_node", node=0, step=12)
        supervisor, _, paths, memory = _supervisor(tmp_path, [agent], [fault])
        agent.wait(timeout=60)  # the node, which runs rank 0, is lost
        assert _wait(lambda: _fired(paths) == [("fault", "lose-node-0")]), _fired(paths)
        assert not memory[0].exists()
    finally:
        _end([agent], supervisor)
        del store


def test_the_rank_a_spare_took_over_is_found_through_the_runs_markers(tmp_path):
    """``worker_pid``, which the harness's rank faults (``kill``/``stop`` by time) use, finds a
    rank that a spare runs: not in /proc (the spare's rank is in its os.environ only) but in the
    pid its ChaosHook wrote into the run's marker directory on taking the rank."""
    markers = tmp_path / "faults"
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    agent = supervisor = None
    try:
        agent, spare = _spare_takes_rank_0(tmp_path, store, port, str(markers))
        process_start_of = {spare: process_start(spare)}
        assert worker_pid(agent.pid, 0) is None  # what /proc says
        assert worker_pid(agent.pid, 0, markers) == spare
        assert worker_pid(agent.pid, 1, markers) is None
        # the harness's rank fault (by time) reaches it
        fault = Fault(id="kill-rank-0", kind="kill", rank=0, at_s=0.0)
        supervisor, _, paths, _ = _supervisor(tmp_path, [agent], [fault])
        assert _wait(lambda: ("fault", "kill-rank-0") in _fired(paths)), _fired(paths)
        assert _wait(lambda: process_state(spare, process_start_of[spare]) in ("gone", "Z"))
        # a process left in the markers that is not the agent's (an earlier job's): not taken
        me = os.getpid()
        (markers / SPARES_DIR / "rank0").write_text(f"{me} {process_start(me)}")
        assert worker_pid(agent.pid, 0, markers) is None
    finally:
        _end([agent], supervisor)
        del store


_AGENT_WITH_DEAD_SPARE = """
import subprocess, sys, time
spare = subprocess.Popen([sys.executable, "-c", "pass"])
print(spare.pid, flush=True)
time.sleep(120)  # not reaped: a zombie, still the agent's child
"""


def test_a_spare_that_ran_the_rank_and_died_is_not_taken_for_it(tmp_path):
    """Its pid in the markers, its process a zombie the agent has not reaped yet (or the pid
    used again by another process): nothing runs the rank now, and the fault waits."""
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT_WITH_DEAD_SPARE], stdout=subprocess.PIPE, text=True
    )
    try:
        spare = int(agent.stdout.readline())
        start = process_start(spare)
        assert _wait(lambda: process_state(spare, start) == "Z")
        markers = tmp_path / "faults"
        (markers / SPARES_DIR).mkdir(parents=True)
        (markers / SPARES_DIR / "rank0").write_text(f"{spare} {start}")  # as its hook wrote it
        assert worker_pid(agent.pid, 0, markers) is None
        (markers / SPARES_DIR / "rank0").write_text(f"{spare} {start + 1}")  # another process's
        assert worker_pid(agent.pid, 0, markers) is None
    finally:
        agent.kill()
        agent.wait()


def test_a_lost_node_can_be_replaced_later(tmp_path):
    """A node lost for good (``kill_node``) and replaced later (``replace_node`` on the same
    node: the scenario parser takes it): the second fault does not wait for the dead agent's
    workers; a new agent takes the node's place."""
    go = tmp_path / "go"
    go.touch()
    agents = [_agent(go, n) for n in range(2)]
    started: list = []

    def start(node: int, mode: str) -> subprocess.Popen:
        started.append(_agent(go, node))
        return started[-1]

    faults = [
        Fault(id="lose-node-1", kind="kill_node", node=1, step=5),
        Fault(id="new-host-for-1", kind="replace_node", node=1, step=10),
    ]
    supervisor = None
    try:
        assert _wait(lambda: all(has_workers(a.pid) for a in agents))
        supervisor, _, paths, _ = _supervisor(tmp_path, agents, faults, start)
        assert _wait(lambda: ("node_replaced", None) in _fired(paths)), "replace_node never fired"
        assert ("fault", "lose-node-1") in _fired(paths) and len(started) == 1
    finally:
        _end([*agents, *started], supervisor)
