"""Launch a scenario's job under torchrun, inject its faults, and record what happened.

A run directory holds everything the verification and the report need, so ``resilient report
RUN_DIR`` can rebuild them later:

    scenario.toml       the scenario as given
    run.json            launch facts: command, exit codes, start and end, nodes killed, reference
    metrics.jsonl       the trainer's per-step records (rank 0), appended across restarts
    events.jsonl        the event log: starts, restores, saves, faults, verdicts, stacks, exits
    chaos_plan_node0.json ...  the in-rank faults, one plan per agent (its ``--chaos`` flag)
    storage_faults.jsonl  every storage fault the faulty:// filesystem fired
    node0.log ...       each torchrun agent's output
    ckpt/               the checkpoints
    report.json, report.md, timeline.png

Fault-free references live next to the runs (``references/<job hash>/``) and are shared by every
scenario with the same job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient import forkserver
from resilient.chaos.faults import (
    IN_RANK_KINDS,
    has_workers,
    kill_tree,
    persisters_of,
    worker_pid,
)
from resilient.chaos.jsonl import read_jsonl, records_of_line
from resilient.chaos.scenario import COMMAND_PLACEHOLDERS, JOB_KILLS, NODE_KILLS, Fault, Job
from resilient.health.events import EventLog
from resilient.launch import free_port

__all__ = [
    "RunPaths",
    "Launch",
    "launch_job",
    "run_reference",
    "reference_dir",
    "job_hash",
    "forked_launcher",
]


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    def plan(self, node: int = 0) -> Path:
        return self.root / f"chaos_plan_node{node}.json"

    @property
    def markers(self) -> Path:
        return self.root / "faults"

    @property
    def storage_record(self) -> Path:
        return self.root / "storage_faults.jsonl"

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    def log(self, node: int) -> Path:
        return self.root / f"node{node}.log"


@dataclass
class Launch:
    """What happened to one launch of a job."""

    run_dir: str
    command: list[str]
    started: float
    ended: float
    exit_codes: list[int | None]
    timed_out: bool = False
    killed_nodes: list[int] = field(default_factory=list)
    reference: str | None = None
    memory_left: list[str] = field(default_factory=list)  # job dirs left in the memory roots

    @property
    def succeeded(self) -> bool:
        survivors = [c for n, c in enumerate(self.exit_codes) if n not in self.killed_nodes]
        return not self.timed_out and bool(survivors) and all(c == 0 for c in survivors)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Launch:
        return cls(**d)


def job_hash(job: Job) -> str:
    return hashlib.sha256(json.dumps(job.key(), sort_keys=True).encode()).hexdigest()[:12]


def reference_dir(out: Path, job: Job) -> Path:
    return out / "references" / job_hash(job)


def run_reference(job: Job, directory: Path, *, say: Any = print) -> Launch:
    """The fault-free run of ``job`` in ``directory`` (reused when one already completed there).
    Scenario runs that share a references directory (side by side, in other processes) run each
    reference once: the first takes ``<directory>.lock`` and the others wait for its run."""
    import fcntl

    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        paths = RunPaths(directory)
        if paths.run_json.exists():
            done = Launch.from_json(json.loads(paths.run_json.read_text()))
            if done.succeeded and reference_complete(job, paths):
                return done
        if directory.exists():
            shutil.rmtree(directory)
        say(f"  reference: the same job without faults -> {directory}")
        return launch_job(job, paths, [])


def reference_complete(job: Job, paths: RunPaths) -> bool:
    """Whether a finished reference still holds what a verification reads: its checkpoints, and
    (a trainer job) its per-step records up to the final step.  A run.json alone says it
    succeeded once, not that its files are still there (a metrics file or checkpoint removed
    since left the loss curve, the samples and the final state unchecked)."""
    if not paths.ckpt.is_dir():
        return False
    if job.steps is None:
        return True
    last = max((r["step"] for r in read_jsonl(paths.metrics, "step")), default=None)
    return last == job.steps


def launch_job(
    job: Job,
    paths: RunPaths,
    faults: list[Fault],
    *,
    say: Any = print,
) -> Launch:
    """Run ``job`` to completion (or its timeout) with ``faults`` injected; writes run.json.

    Each agent (a node) gets its own memory root for the memory tier (``RESILIENT_MEMORY_ROOT``,
    on /dev/shm), removed afterwards; a ``kill_job`` fault SIGKILLs every process of the job and
    then runs the same job again, once, as a user would; a ``crash_job`` fault SIGKILLs the job's
    agents and workers but not the memory tier's persister, waits for the persister to finish,
    and runs the job again on nodes whose memory is empty (new nodes)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    events = EventLog(str(paths.events))
    in_rank = [f.to_json() for f in faults if f.kind in IN_RANK_KINDS and f.at_s is None]
    external = [f for f in faults if f.kind in (*NODE_KILLS, *JOB_KILLS) or f.at_s is not None]
    storage = [f for f in faults if f.kind == "storage"]
    for node in range(job.nodes):  # the plan reaches the ranks only through the job's own flag
        paths.plan(node).write_text(
            json.dumps(
                {
                    "marker_dir": str(paths.markers),
                    "events": str(paths.events),
                    "node": node,
                    "faults": in_rank,
                },
                indent=1,
            )
        )
    memory = memory_roots(paths, job.nodes)
    started = time.time()
    killed: list[int] = []
    timed_out = False
    try:
        for attempt in range(2):
            port = free_port()
            rdzv_id = f"chaos-{uuid.uuid4().hex[:8]}"  # one rendezvous for every agent
            cmds = [
                _command(job, paths, port, rdzv_id, storage, node, bool(in_rank))
                for node in range(job.nodes)
            ]
            if attempt == 0:
                events.write("job_start", nodes=job.nodes, nproc=job.nproc, command=cmds[0])
            else:
                events.write("job_rerun", nodes=job.nodes, nproc=job.nproc, command=cmds[0])
                say("  the whole job was killed: running it again")
            codes, killed, timed_out, job_killed = _attempt(
                job, paths, cmds, port, memory, external, events, started, say, rerun=attempt > 0
            )
            if not job_killed or timed_out:
                break
            external = [f for f in external if f.kind not in JOB_KILLS]
            if job_killed == "crash_job":
                _drop_memory(memory, events, say)
        leftover = sorted(
            str(d) for root in memory for d in (root.iterdir() if root.exists() else [])
        )
    finally:
        for root in memory:
            shutil.rmtree(root, ignore_errors=True)
        try:
            memory[0].parent.rmdir()  # the run's own base (empty now)
        except OSError:
            pass
    result = Launch(
        run_dir=str(paths.root),
        command=cmds[0],
        started=started,
        ended=time.time(),
        exit_codes=codes,
        timed_out=timed_out,
        killed_nodes=killed,
        memory_left=leftover,
    )
    events.write("job_end", exit_codes=result.exit_codes, timed_out=timed_out)
    paths.run_json.write_text(json.dumps(result.to_json(), indent=1))
    return result


def _drop_memory(memory: list[Path], events: EventLog, say: Any, timeout_s: float = 120.0) -> None:
    """Wait for the persisters that outlived a crashed job to finish (a persister of this run is
    one whose memory root is one of its nodes'), then empty every node's memory: the rerun comes
    up on nodes that hold nothing of the job."""
    deadline = time.monotonic() + timeout_s
    while left := persisters_of(memory):
        if time.monotonic() > deadline:
            say(f"  persisters {left} still run after {timeout_s:.0f}s; dropping the memory anyway")
            break
        time.sleep(0.05)
    for root in memory:
        shutil.rmtree(root, ignore_errors=True)
    events.write("memory_dropped", nodes=len(memory), source="harness")
    say("  the job's processes are gone and its persister is done: rerunning on empty memory")


def memory_roots(paths: RunPaths, nodes: int) -> list[Path]:
    """A fresh memory root per node, on /dev/shm where there is one (the run's directory else)."""
    shm = Path("/dev/shm")
    key = hashlib.sha256(str(paths.root.resolve()).encode()).hexdigest()[:12]
    base = shm / f"resilient-chaos-{key}" if shm.is_dir() else paths.root / "memory"
    shutil.rmtree(base, ignore_errors=True)
    return [base / f"node{n}" for n in range(nodes)]


def _attempt(
    job: Job,
    paths: RunPaths,
    cmds: list[list[str]],
    port: int,
    memory: list[Path],
    external: list[Fault],
    events: EventLog,
    started: float,
    say: Any,
    *,
    rerun: bool,
) -> tuple[list[int | None], list[int], bool, str | None]:
    """Start the agents and supervise them: (exit codes, nodes killed, timed out, the kind of
    fault that killed the whole job, if one did)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RESILIENT_DETECT": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if len(cmds) > 1 and job.spares is None:
        # With the rendezvous store shared with the workers (torch's default since 2.4), torchrun's
        # rank-0 agent publishes the workers' store address in the first round only, and agents
        # in a later round with two or more nodes wait for it until the join times out: a
        # replacement node, and also two agents re-forming the group after one missed its
        # keep-alives on a loaded machine (seen under make-test-under-load: both waited 60 s for
        # round 1's MASTER_ADDR and the job failed before its first step).  The README says the
        # same for users.  `resilient launch` (a job with spares) publishes it in every round
        # (resilient.launch.agent.share_store_address), so its jobs keep the shared store, which
        # the spares of in-job recovery need.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents: list[subprocess.Popen] = []
    logs = []

    def start(node: int, mode: str) -> subprocess.Popen:
        """An agent for ``node`` (a replacement too: the same command, the node's memory root)."""
        log = open(paths.log(node), mode)
        logs.append(log)
        node_env = {
            **env,
            "RESILIENT_MEMORY_ROOT": str(memory[node]),
            **{k: v.replace("{run_dir}", str(paths.root)) for k, v in job.env.items()},
        }
        # the agent forked from this process's server for launchers
        cmd, node_env = forked_launcher(cmds[node], node_env)
        return subprocess.Popen(
            cmd, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    try:
        for node in range(job.nodes):
            agents.append(start(node, "a" if rerun else "w"))
            if node == 0 and job.nodes > 1:
                _wait_for_port(port, agents[0], timeout=60)  # node 0 hosts the rendezvous store
        killed, timed_out, job_killed = _supervise(
            job, paths, agents, external, events, started, say, memory, start
        )
    finally:
        for a in agents:
            if a.poll() is None:
                kill_tree(a.pid)
                a.wait()
        for log in logs:
            log.close()
        forkserver.sweep()  # what the fork servers of agents killed outright left in /tmp
    return [a.returncode for a in agents], killed, timed_out, job_killed


def _supervise(
    job: Job,
    paths: RunPaths,
    agents: list[subprocess.Popen],
    external: list[Fault],
    events: EventLog,
    started: float,
    say: Any,
    memory: list[Path],
    start: Any,
) -> tuple[list[int], bool, str | None]:
    """Wait for the agents, firing the harness-side faults when their trigger comes:
    (nodes killed for good, timed out, the kind of fault that killed the whole job).  A replaced
    node's agent is started again by ``start(node, mode)`` and takes its place in ``agents``."""
    pending, killed = list(external), []
    progress = _MetricsTail(paths.metrics)
    deadline = started + job.timeout_s
    while any(a.poll() is None for a in agents):
        now = time.time()
        if now > deadline:
            say(f"  timeout: the job ran past {job.timeout_s:.0f}s; killing it")
            return killed, True, None
        step = progress.last_step()
        for f in list(pending):
            due = (f.step is not None and step >= f.step) or (
                f.at_s is not None and now - started >= f.at_s
            )
            if not due:
                continue
            node = agents[f.node] if f.kind in NODE_KILLS else None
            if node is not None and node.poll() is None and not has_workers(node.pid):
                # the node is not in the job (yet): an elastic node that reached the rendezvous
                # after its round closed (a loaded machine) waits for the next; losing it now
                # would lose nothing the job had (a node lost already is replaced at once)
                continue
            pending.remove(f)
            if f.kind in JOB_KILLS:
                spare = f.kind == "crash_job"
                pids = [p for a in agents for p in kill_tree(a.pid, spare_persisters=spare)]
                for a in agents:
                    a.wait()
                events.write("fault", id=f.id, kind=f.kind, step=step, pids=pids, source="harness")
                return killed, False, f.kind
            if f.kind in NODE_KILLS:
                pids = kill_tree(agents[f.node].pid)
                agents[f.node].wait()
                # the node is gone, and its memory with it (the memory tier's snapshots and the
                # replicas it kept of its peer's)
                shutil.rmtree(memory[f.node], ignore_errors=True)
                events.write(
                    "fault",
                    id=f.id,
                    kind=f.kind,
                    node=f.node,
                    step=step,
                    pids=pids,
                    source="harness",
                )
                if f.kind == "kill_node":
                    killed.append(f.node)
                else:  # a new host in its place: same command, empty memory
                    agents[f.node] = start(f.node, "a")
                    events.write("node_replaced", node=f.node, source="harness")
                    say(f"  node {f.node} replaced by a new agent with empty memory")
            else:
                pid = next(
                    (
                        p
                        for a in agents
                        if (p := worker_pid(a.pid, f.rank, paths.markers)) is not None
                    ),
                    None,
                )
                if pid is None:
                    pending.append(f)  # between restarts: try again in a moment
                    continue
                events.write(
                    "fault", id=f.id, kind=f.kind, rank=f.rank, step=step, pid=pid, source="harness"
                )
                os.kill(pid, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
        time.sleep(0.05)
    return killed, False, None


class _MetricsTail:
    """The last step in a growing metrics file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step, self.partial = path, 0, 0, b""

    def last_step(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.step
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            # a record cut by a kill, or merged with the next attempt's first: what parses
            for record in records_of_line(line.decode(errors="replace"), "step"):
                if isinstance(record.get("step"), int):
                    self.step = record["step"]
        return self.step


def _command(
    job: Job,
    paths: RunPaths,
    port: int,
    rdzv_id: str,
    storage: list[Fault],
    node: int,
    chaos: bool,
) -> list[str]:
    nnodes = f"1:{job.nodes}" if job.elastic else str(job.nodes)
    launcher = ["torch.distributed.run"]
    if job.spares is not None:  # torchrun's flags, with hot spares and in-job recovery
        launcher = ["resilient.cli", "launch", "--spares", str(job.spares)]
    # the reference trainer's ranks start from the node's fork server (resilient/forkserver.py):
    # torch imported once per agent, not once per rank and restart
    forked = job.command is None and forkserver.enabled()
    host = ["resilient.forkserver", "host", "--preload", _PRELOAD, "--"] if forked else []
    cmd = [
        sys.executable,
        "-m",
        *host,
        *launcher,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(job.nproc),
        "--max-restarts",
        str(job.max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        # A lost node's place is given up after ~3 s.  An elastic job waits 6 s after the first
        # node is ready for the others: long enough for both agents of a localhost job to join
        # the first round on a loaded machine (a node that joins a finished round makes every
        # agent restart to admit it), short enough to keep the recovery after a node loss fast.
        "--rdzv-conf",
        f"last_call_timeout={6 if job.elastic else 1},keep_alive_interval=1,"
        "keep_alive_max_attempt=3,join_timeout=60",
    ]
    url, options = str(paths.ckpt), None
    if storage:
        url = f"faulty://{paths.ckpt}"
        options = {
            "target_protocol": "file",
            "record": str(paths.storage_record),
            "faults": [_storage_rule(f) for f in storage],
        }
    if job.command is not None:
        # the parser let through only words these substitute (scenario.command_fields)
        subs = {
            "ckpt": url,
            "metrics": str(paths.metrics),
            "events": str(paths.events),
            "run_dir": str(paths.root),
            "chaos": str(paths.plan(node)),
        }
        assert set(subs) == set(COMMAND_PLACEHOLDERS), "keep scenario.COMMAND_PLACEHOLDERS in step"
        return cmd + [c.format(**subs) for c in job.command]
    flags = [*(forkserver.STAND_IN if forked else ()), "-m", "reference_trainer"]
    for k, v in job.trainer.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            flags += [flag] if v else []
        else:
            flags += [flag, str(v)]
    flags += ["--ckpt", url, "--metrics", str(paths.metrics), "--events", str(paths.events)]
    if options is not None:
        flags += ["--storage-options", json.dumps(options)]
    if chaos:
        flags += ["--chaos", str(paths.plan(node))]
    return cmd + flags


# what a reference-trainer rank imports (reference_trainer.PRELOAD), the chaos hook's modules too
_PRELOAD = ",".join(
    [
        "reference_trainer.train",
        "fsspec.implementations.local",
        "numpy.random",
        "resilient.chaos.faults",
        "resilient.chaos.faultfs",
    ]
)
# what a job's launcher imports (either launcher; `host` forks the ranks' server from it, which
# then has the ranks' modules imported already), less the modules it runs as __main__
# (torch.distributed.run, resilient.cli: runpy warns when one was imported before)
_LAUNCHER_PRELOAD = [
    "torch.distributed.launcher.api",
    "torch.distributed.argparse_util",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "resilient.launch.agent",
]
_launchers: dict[tuple, tuple[subprocess.Popen, str]] = {}  # the most recently used last
_LAUNCHER_SERVERS = 2  # kept at most: a job whose start settings name its run has one to itself


def forked_launcher(cmd: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``cmd`` (``[python, -m, LAUNCHER, ...]``: torchrun, ``resilient launch``, the reference
    trainer with ``--nproc``) and ``env`` made to start the launcher forked from this process's
    server for launchers (:func:`_launcher_server`), through its stand-in (signals forwarded,
    exit status taken); unchanged where ``env`` asks for processes started the usual way."""
    launchers = _launcher_server(env)
    if launchers is None:
        return cmd, env
    return [cmd[0], *forkserver.STAND_IN, *cmd[1:]], {**env, forkserver.ENV: launchers}


def _launcher_server(env: dict[str, str]) -> str | None:
    """The socket of this process's server for the launchers of jobs started with ``env``
    (``forkserver.start_launchers``: a chaos suite's agents fork from it, one ``import torch``
    for all of them), started at the first such job: one per start settings of the jobs'
    environments (a scenario's ``job.env`` with a ``PYTHON*`` or ``TORCH*`` variable, say) and
    working directory, the two used last kept (an older one is stopped: it exits once its
    launchers have).  None where ``env`` asks for ranks started the usual way
    (``RESILIENT_FORK_RANKS=0``), so that such a job is started as plain torchrun starts it.
    Each exits with this process."""
    if env.get(forkserver.ENV_SWITCH, "1") == "0":
        return None
    key = (tuple(sorted(forkserver.start_settings(env).items())), os.getcwd())
    got = _launchers.pop(key, None)
    if got is None or got[0].poll() is not None:
        preload = [*_LAUNCHER_PRELOAD, *_PRELOAD.split(",")]
        got = forkserver.start_launchers(preload, env)
    _launchers[key] = got
    while len(_launchers) > _LAUNCHER_SERVERS:
        old, _path = _launchers.pop(next(iter(_launchers)))
        old.terminate()  # (SIGTERM: no new launchers; those running go on)
    return got[1]


def _storage_rule(f: Fault) -> dict[str, Any]:
    rule: dict[str, Any] = {"id": f.id, "op": f.op, "path": f.path, "skip": f.skip}
    if f.error is not None:
        rule["error"] = f.error
    if f.latency_s is not None:
        rule["latency_s"] = f.latency_s
    if f.count is not None:
        rule["count"] = f.count
    if f.probability < 1:
        rule["probability"] = f.probability
    return rule


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)


def load_launch(run_dir: Path) -> Launch:
    return Launch.from_json(json.loads(RunPaths(run_dir).run_json.read_text()))
