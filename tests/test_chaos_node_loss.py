"""The chaos harness's node faults (``kill_node``, ``replace_node``) wait for the node to be in
the job: repros of a review of that change (each failed before its fix).  Real processes:
agents standing for nodes, a real spare taking a rank over through ``wait_for_rank``, a TCPStore."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from resilient.chaos.faults import kill_tree
from resilient.health.events import EventLog
from resilient.launch import free_port

# An agent of `resilient launch` with in-job recovery on a node of one rank, after that rank was
# lost and the node's spare took it over: its only worker is the spare, exec'd without RANK or
# LOCAL_RANK (agent.py _start_spare), which resilient.launch.injob.wait_for_rank gives it in
# os.environ, after exec (not in /proc/PID/environ).  argv: store port, key file, taken file.
_SPARE = """
import json, os, sys, time
from pathlib import Path
from torch.distributed import TCPStore
from resilient.launch.injob import base_key, wait_for_rank
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
Path(sys.argv[2]).write_text(base_key())
assert wait_for_rank(store)
Path(sys.argv[3]).write_text(os.environ["RANK"] + " " + os.environ["LOCAL_RANK"])
time.sleep(120)
"""
_INJOB_AGENT = """
import os, subprocess, sys, time
env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "ROLE_RANK")}
env.update(RESILIENT_SPARE="0:0", TORCHELASTIC_RUN_ID="review35", TORCHELASTIC_RESTART_COUNT="0")
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env,
                 start_new_session=True)
time.sleep(120)
"""


def test_kill_node_fires_on_a_node_whose_rank_a_spare_took_over(tmp_path):
    """``kill_node`` waits for ``has_workers``, which looks for ``LOCAL_RANK`` in
    ``/proc/PID/environ``.  A spare that took a rank over (in-job recovery) got its RANK and
    LOCAL_RANK in ``os.environ`` after exec, so a node whose rank(s) a spare runs now has "no
    workers" and a node loss due then never fires (the run ends with the fault pending)."""
    from torch.distributed import TCPStore

    from resilient.chaos.harness import RunPaths, _supervise
    from resilient.chaos.scenario import Fault, Job

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    paths = RunPaths(tmp_path)
    paths.metrics.write_text(json.dumps({"step": 20}) + "\n")  # past the fault's step
    key_file, taken = tmp_path / "key", tmp_path / "taken"
    agent = subprocess.Popen(
        [sys.executable, "-c", _INJOB_AGENT, _SPARE, str(port), str(key_file), str(taken)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    memory = tmp_path / "mem0"
    memory.mkdir()
    result: list = []
    supervisor = None
    try:
        deadline = time.time() + 120
        while not key_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert key_file.exists(), "the spare never came up"
        # the agent hands rank 0 (local rank 0) to its spare: the spare is the node's rank now
        store.set(
            f"{key_file.read_text()}/assign/0/0",
            json.dumps({"rank": 0, "local_rank": 0, "gen": 1}),
        )
        while not taken.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert taken.read_text() == "0 0"
        fault = Fault(id="lose-node-0", kind="kill_node", node=0, step=12)
        supervisor = threading.Thread(
            target=lambda: result.append(
                _supervise(
                    Job(nproc=1, nodes=1, timeout_s=60),
                    paths,
                    [agent],
                    [fault],
                    EventLog(str(paths.events)),
                    time.time(),
                    lambda *_: None,
                    [memory],
                    None,
                )
            ),
            daemon=True,
        )
        supervisor.start()
        try:
            agent.wait(timeout=10)  # the node, which runs rank 0, is lost at once
        except subprocess.TimeoutExpired:
            pass
        assert agent.poll() is not None, "kill_node never fired: the node's rank is a spare"
        assert not memory.exists()
    finally:
        kill_tree(agent.pid)
        agent.wait()
        if supervisor is not None:
            supervisor.join(timeout=30)


# an agent with one worker (a child with a rank's environment, as torchrun starts it)
_AGENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                 env=dict(os.environ, RANK=sys.argv[1], LOCAL_RANK="0"))
time.sleep(120)
"""


def test_a_lost_node_can_be_replaced_later(tmp_path):
    """a node lost for good (``kill_node``) and replaced later (``replace_node`` on the
    same node: the scenario parser takes it) is never replaced: the second fault waits for the
    dead agent to have workers, which it never will (before, the new agent was started)."""
    from resilient.chaos.harness import RunPaths, _supervise
    from resilient.chaos.scenario import Fault, Job

    paths = RunPaths(tmp_path)
    paths.metrics.write_text(json.dumps({"step": 20}) + "\n")  # past both faults' steps
    memory = [tmp_path / "mem0", tmp_path / "mem1"]
    for m in memory:
        m.mkdir()
    agents = [subprocess.Popen([sys.executable, "-c", _AGENT, str(n)]) for n in range(2)]
    started: list = []

    def start(node: int, mode: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _AGENT, str(node)])
        started.append(p)
        return p

    faults = [
        Fault(id="lose-node-1", kind="kill_node", node=1, step=5),
        Fault(id="new-host-for-1", kind="replace_node", node=1, step=10),
    ]
    result: list = []
    supervisor = threading.Thread(
        target=lambda: result.append(
            _supervise(
                Job(nproc=1, nodes=2, elastic=True, timeout_s=60),
                paths,
                agents,
                faults,
                EventLog(str(paths.events)),
                time.time(),
                lambda *_: None,
                memory,
                start,
            )
        ),
        daemon=True,
    )
    try:
        from resilient.chaos.faults import has_workers

        deadline = time.time() + 60
        while not all(has_workers(a.pid) for a in agents) and time.time() < deadline:
            time.sleep(0.05)
        supervisor.start()
        deadline = time.time() + 15
        while not started and time.time() < deadline:
            time.sleep(0.05)
        events = paths.events.read_text() if paths.events.exists() else ""
        assert "lose-node-1" in events
        assert started and "node_replaced" in events, "replace_node never fired"
    finally:
        for a in [*agents, *started]:
            kill_tree(a.pid)
            a.wait()
        if supervisor.is_alive():
            supervisor.join(timeout=30)
