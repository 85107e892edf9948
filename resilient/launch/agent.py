"""``resilient launch``: torchrun's launcher with hot spares and in-job recovery.

It is torch.distributed.elastic throughout: torchrun's own argument parser and launch config, its
rendezvous handlers, its ``SimpleElasticAgent`` (rendezvous, rank assignment, restarts, the exit
barrier) and the agent's store.  What differs is the worker policy (``InJobAgent``): torchrun's
process context stops every worker as soon as one fails; here the agent owns its worker processes,
and when one exits with a failure it

1. gives the failed rank to a spare of its node (``--spares K``, started ahead of time: torch and
   the script's imports are loaded, and ``resilient.launch.init_process_group`` holds it),
2. opens the next generation of the group (``resilient.launch.injob``); the healthy ranks leave
   the broken group and form the new one with the spare, which restores the failed rank's state
   from the node's memory tier, and
3. starts a new spare in the background.

When that cannot work (no spare is left, the store is not the agent's, a worker fails again before
the previous recovery formed its group, a worker fails before the group's newest generation formed
or after another finished (on any node: each agent marks in the store that one of its workers
exited 0), the group cannot form), it falls back to torchrun's policy: stop the
workers, rendezvous again and restart them (``--max-restarts``), or fail.

Several nodes: the spares need the agent's store (torchrun's rendezvous TCPStore, shared with the
workers).  torch's c10d rendezvous handler publishes that store's address in a round's store only
the first time an agent is rank 0 (it caches it), so an agent that joins a later round (a
replacement node, agents re-forming after a restart) would wait for the address until the join
timeout.  ``share_store_address`` makes every round publish it (see there).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

from resilient.health.attach import ENV_ROUND, attempt_name
from resilient.launch import MAX_PROCESSES_PER_NODE
from resilient.launch.injob import ENV_GEN, ENV_INJOB, ENV_SPARE, base_key

log = logging.getLogger("resilient.launch")

__all__ = [
    "launch_main",
    "ask_for_stacks",
    "InJobAgent",
    "describe_process",
    "parse_args",
    "name_records_by_frame",
    "share_store_address",
    "tree_usage",
]

SPARES_DEFAULT = 1
MAX_RECOVERIES_DEFAULT = 10
REPEAT_WINDOW_S = 30.0  # a rank that fails again this soon after its takeover: restart instead
FINISH_TIMEOUT_DEFAULT = 300.0  # torchrun's exit barrier waits as long for the other nodes
STORE_POLL_S = 1.0  # how often an agent with workers still running asks whether another finished
BUSY_SHARE = 0.05  # a worker using this share of a core in a second (or on a CPU) is working
MAX_SPARE_REFILLS = 10  # idle spares that died and were started again, per round of workers


def parse_args(argv: list[str]) -> Any:
    """torchrun's own parser, with ``--spares K`` added (before the script, like its flags)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "resilient launch"
    parser.add_argument(
        "--spares",
        type=_spares,
        default=SPARES_DEFAULT,
        help="spare processes per node, started ahead of time, each of which takes a failed rank "
        "over while the healthy ranks stay alive (in-job recovery); 0 restarts the workers as "
        f"torchrun does (default {SPARES_DEFAULT})",
    )
    parser.add_argument(
        "--max-recoveries",
        type=_count("in-job recoveries per node"),
        default=MAX_RECOVERIES_DEFAULT,
        help="in-job recoveries per node before failures restart the workers instead (a rank that "
        f"fails again within {REPEAT_WINDOW_S:.0f}s of its takeover restarts them at once; "
        f"default {MAX_RECOVERIES_DEFAULT})",
    )
    parser.add_argument(
        "--preload",
        default="",
        metavar="MOD[,MOD...]",
        help="start the workers from a fork server that has imported these modules once "
        "(libraries: torch, your model code; not the training script itself): about 1.5 s of "
        "CPU less per worker and restart (resilient/forkserver.py); default: every worker a "
        "new interpreter",
    )
    parser.add_argument(
        "--finish-timeout",
        type=_seconds,
        default=FINISH_TIMEOUT_DEFAULT,
        metavar="SECONDS",
        help="once a worker of the job has finished (exit code 0, on any node), a worker that "
        "has done nothing (its process and its children: under 5%% of a core) for this long is "
        "named, with its state, and killed: a failure, so torchrun's policy restarts the workers "
        "(they resume from the last checkpoint) or fails the job; torchrun would wait for it "
        "forever (a rank frozen or hung in its teardown after the last step); 0 waits forever "
        f"(default {FINISH_TIMEOUT_DEFAULT:.0f})",
    )
    args = parser.parse_args(argv)
    _check_torchrun_values(parser, args)
    for flag, value in (
        ("--log-dir", args.log_dir),
        ("--redirects", args.redirects),
        ("--tee", args.tee),
        ("--local-ranks-filter", args.local_ranks_filter),
    ):
        if value not in (None, "", "0", 0):
            parser.error(
                f"{flag} is not supported by resilient launch yet (the workers write to the "
                f"launcher's stdout and stderr); use torchrun for it, or redirect the output"
            )
    return args


def _check_torchrun_values(parser: Any, args: Any) -> None:
    """torchrun's flags take nonsense and fail later with a bare AssertionError or ValueError
    traceback (``--nproc-per-node 0``, ``--max-restarts -1``, ``--master-port 99999``): refused
    here, as a usage error naming the flag."""
    n = str(args.nproc_per_node)
    if n not in ("auto", "cpu", "gpu", "xpu") and not (
        n.isdigit() and 1 <= int(n) <= MAX_PROCESSES_PER_NODE
    ):
        parser.error(
            f"--nproc-per-node {n}: expected a number of processes from 1 to "
            f"{MAX_PROCESSES_PER_NODE} on this node, or auto, cpu or gpu; for more ranks, run on "
            f"several nodes (--nnodes)"
        )
    nodes = str(args.nnodes).split(":")
    if not (
        1 <= len(nodes) <= 2
        and all(x.isdigit() and int(x) >= 1 for x in nodes)
        and int(nodes[0]) <= int(nodes[-1])
    ):
        parser.error(f"--nnodes {args.nnodes}: N, or MIN:MAX, with 1 <= MIN <= MAX")
    if args.standalone and int(nodes[0]) > 1:  # its rendezvous is on a port no other node knows
        parser.error(
            f"--standalone with --nnodes {args.nnodes}: a standalone job is one node, and it would "
            f"wait for {nodes[0]} nodes until the rendezvous timed out; drop --standalone and give "
            "every node the same --rdzv-endpoint HOST:PORT and --rdzv-id"
        )
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be >= 0")
    if not args.monitor_interval > 0:
        parser.error(f"--monitor-interval {args.monitor_interval}: must be > 0 seconds")
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        parser.error(f"--master-port {args.master_port}: a TCP port, 0..65535")


def _count(what: str, most: int | None = None) -> Any:
    """An argparse type: a whole number >= 0 (and at most ``most``) of ``what``."""

    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of {what}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a whole number of {what}, at most {most}"
            )
        return value

    return parse


_spares = _count("spare processes per node (0 turns in-job recovery off)", MAX_PROCESSES_PER_NODE)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds >= 0")
    return value


def name_records_by_frame() -> None:
    """Make torch's rendezvous name the events it records from the calling frame, not from
    ``inspect.stack()``.

    ``DynamicRendezvousHandler`` and its op executor record every step of a round (joined,
    completed, kept alive, closed: a dozen per round and node) under the name of the method that
    recorded it, which ``dynamic_rendezvous.get_method_name`` finds with ``inspect.stack()``,
    twice: every frame's source lines read and its module looked up, 80 ms of CPU a record
    30 frames deep (a chaos test's CPU 16.0 s against 15.2 s with this, BENCHMARKS.md).  The
    frame at the same depth names the same method.  Applied when this module is imported (the launchers that
    use it: ``resilient launch``, the trainer's ``--nproc``, the fork server's ``host``, the
    server for launchers); once."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "get_method_name", None)
    if original is None or getattr(original, "__resilient__", False):
        return  # (a torch that names its records some other way: nothing to do)

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # what inspect.stack()[depth].function is
        except ValueError:  # a stack that shallow
            return "no_method_name"

    get_method_name.__resilient__ = True  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name


name_records_by_frame()


def share_store_address(handler: Any) -> None:
    """Make ``handler`` (torch's c10d rendezvous handler, with the store shared) agree on the
    workers' store in every round, not only the first.

    torch's ``DynamicRendezvousHandler.next_rendezvous`` writes MASTER_ADDR / MASTER_PORT into a
    round's store only while building its cached bootstrap info (an agent's first round, or its
    first round as rank 0); an agent that joins a later round for the first time waits for those
    keys in that round's store, and an agent with cached info keeps the address of whichever agent
    was rank 0 when it cached it.  Wrapped here (on this instance): after the round, rank 0 writes
    its address into the round's store, which releases an agent waiting for it inside its own
    ``next_rendezvous``, and every other rank reads the address from there instead of its cache.
    Rank 0 publishes before the agents exchange their worker counts (``_assign_worker_ranks``,
    where rank 0 waits for everyone), so this must happen inside ``next_rendezvous``."""
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    if not isinstance(handler, DynamicRendezvousHandler) or getattr(handler, "_resilient", False):
        return  # static rendezvous: the address comes from --master-addr / --master-port
    inner = handler.next_rendezvous
    addr_key, port_key = RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY

    def next_rendezvous() -> Any:
        info = inner()
        # the round this agent joined, the same on every agent of it: the workers' keys go under
        # it (their restart counts differ when a node joins: its agent's starts again at 0)
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        handler._resilient_round = getattr(state, "round", None)
        if not handler.use_agent_store:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: one per round
            return info
        store, boot = info.store, info.bootstrap_store_info
        if info.rank == 0:
            store.set(addr_key, boot.master_addr.encode())
            store.set(port_key, str(boot.master_port).encode())
            return info
        addr = store.get(addr_key).decode()
        port = int(store.get(port_key).decode())
        if (addr, port) != (boot.master_addr, boot.master_port):
            log.warning("the workers' store moved to %s:%d (rank 0 of this round)", addr, port)
        return RendezvousInfo(store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))

    handler.next_rendezvous = next_rendezvous
    handler._resilient = True


class InJobAgent:
    """Factory for the agent class (torch is imported only when a launch happens)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _agent_class()(*args, **kwargs)


_CLASS: Any = None


# who finished, where an agent only knows it from the store (_finished)
ANOTHER_NODE = "a rank on another node"


def _agent_class() -> Any:
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import (
        RunResult,
        SimpleElasticAgent,
        WorkerGroup,
        WorkerState,
    )
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    class _InJobAgent(SimpleElasticAgent):
        def __init__(
            self,
            spec: Any,
            spares: int,
            *,
            max_recoveries: int = MAX_RECOVERIES_DEFAULT,
            finish_timeout: float = FINISH_TIMEOUT_DEFAULT,
            exit_barrier_timeout: float = 300,
        ) -> None:
            # a node whose workers finished waits in torchrun's exit barrier for the others: at
            # least as long as their agents take to kill a worker left behind
            super().__init__(spec, max(exit_barrier_timeout, finish_timeout + 30))
            share_store_address(spec.rdzv_handler)
            self.spares_wanted = spares
            self.max_recoveries = max_recoveries
            self.finish_timeout = finish_timeout
            self._done: tuple[float, str] | None = None  # when a worker first finished, and which
            # the workers' last (time, {local rank: (CPU seconds, on a CPU)}), when last busy,
            # when last warned of as still working
            self._sample: tuple[float, dict[int, tuple[float, bool]]] = (0.0, {})
            self._busy_at: dict[int, float] = {}
            self._warned: dict[int, float] = {}
            self._store_asked = 0.0  # when the store was last asked whether another node's did
            self._taken_over: dict[int, float] = {}  # local rank -> when a spare took it
            self._procs: dict[int, subprocess.Popen] = {}
            self._spares: list[tuple[int, subprocess.Popen]] = []
            self._next_spare = 0
            self._spare_refills = 0
            self._client: Any = None
            self._pending_gen: int | None = None  # a recovery whose group has not formed yet
            self._said_finished = False  # this round's "a worker exited 0" is in the store
            self.recoveries: list[dict[str, Any]] = []

        # --- processes ------------------------------------------------------------------------
        def _env(self, wg: WorkerGroup, worker: Any | None) -> dict[str, str]:
            spec = wg.spec
            restart = spec.max_restarts - self._remaining_restarts
            env = {
                **os.environ,
                "GROUP_RANK": str(wg.group_rank),
                "ROLE_NAME": spec.role,
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "WORLD_SIZE": str(wg.workers[0].world_size),
                "GROUP_WORLD_SIZE": str(wg.group_world_size),
                "ROLE_WORLD_SIZE": str(wg.workers[0].role_world_size),
                "MASTER_ADDR": wg.master_addr,
                "MASTER_PORT": str(wg.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restart),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
                ENV_INJOB: "1" if self._injob_possible() else "0",
                ENV_GEN: "0",
            }
            rnd = getattr(spec.rdzv_handler, "_resilient_round", None)
            if isinstance(rnd, int):
                env[ENV_ROUND] = str(rnd)
            else:  # not one inherited from an outer launcher: the keys must be what _base says
                env.pop(ENV_ROUND, None)
            env.pop(ENV_SPARE, None)
            # torchrun's per-worker variables: a spare has no rank until it is given one, and
            # must not take the launcher's own (an outer launcher's RANK, say) for it
            for name in ("RANK", "LOCAL_RANK", "ROLE_RANK"):
                env.pop(name, None)
            if worker is not None:
                env.update(
                    RANK=str(worker.global_rank),
                    LOCAL_RANK=str(worker.local_rank),
                    ROLE_RANK=str(worker.role_rank),
                )
            return env

        def _injob_possible(self) -> bool:
            return self.spares_wanted > 0 and bool(
                self._worker_group.spec.rdzv_handler.use_agent_store
            )

        def _cmd(self, local_rank: int) -> list[str]:
            spec = self._worker_group.spec
            from torch.distributed.elastic.utils import macros

            return [spec.entrypoint, *macros.substitute(list(spec.args), str(local_rank))]

        def _start_spare(self) -> None:
            wg = self._worker_group
            index = self._next_spare
            self._next_spare += 1
            env = self._env(wg, None)
            # no RANK or LOCAL_RANK (_env) until it is given a rank: a script that picks its device
            # at import fails loudly rather than landing on device 0
            env[ENV_SPARE] = f"{wg.group_rank}:{index}"
            proc = subprocess.Popen(self._cmd(0), env=env, start_new_session=True)
            self._spares.append((index, proc))
            log.info("spare %d started (pid %d)", index, proc.pid)

        def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
            self._client = None
            self._pending_gen = None
            self._said_finished = False
            self._done = None
            # takeovers and refills of the previous round: its processes are all gone
            self._taken_over.clear()
            self._spare_refills = 0
            pids = {}
            for w in worker_group.workers:
                # each in a session (a process group) of its own, as torchrun does: stopping it
                # stops what it started too (a shell wrapper's python, data helpers), not it alone
                p = subprocess.Popen(
                    self._cmd(w.local_rank), env=self._env(worker_group, w), start_new_session=True
                )
                self._procs[w.local_rank] = p
                pids[w.local_rank] = p.pid
            if self._injob_possible():
                for _ in range(self.spares_wanted):
                    self._start_spare()
            elif self.spares_wanted > 0:
                log.warning(
                    "in-job recovery is off: the workers' store is not the agent's "
                    "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE is set?); failures restart the workers"
                )
            return pids

        def _kill_all(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
            self._release_spares()
            procs = list(self._procs.values()) + [p for _, p in self._spares]
            for p in procs:  # (its group: what it started too, even when it has exited)
                _signal_group(p, sig)
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    _signal_group(p, signal.SIGKILL)
                    p.wait()
            self._procs.clear()
            self._spares.clear()

        def _release_spares(self) -> None:
            """Tell the idle spares the job needs no more of them."""
            if not self._spares:
                return
            store = self._store_client(quiet=True)
            for index, p in self._spares:
                if store is not None and p.poll() is None:
                    try:
                        store.set(self._assign_key(index), json.dumps({"exit": 1}))
                    except Exception:
                        pass

        def _stop_workers(self, worker_group: WorkerGroup) -> None:
            self._kill_all()

        def _shutdown(
            self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30, **_: Any
        ) -> None:
            self._kill_all(death_sig, timeout)

        # --- the store ------------------------------------------------------------------------
        def _store_client(self, quiet: bool = False) -> Any:
            """A client of the workers' store (the spares' and generations' keys).  Only where
            in-job recovery is on: otherwise that store is rank 0's own, gone once rank 0 has
            exited, and each try to reach it would block the monitor for the connect timeout."""
            if not self._injob_possible():
                if quiet:
                    return None
                raise RuntimeError("in-job recovery is off: the workers' store is not the agent's")
            if self._client is None:
                wg = self._worker_group
                try:
                    self._client = dist.TCPStore(
                        wg.master_addr,
                        int(wg.master_port),
                        is_master=False,
                        timeout=timedelta(seconds=30),
                    )
                except Exception:
                    if not quiet:
                        raise
            return self._client

        def _assign_key(self, index: int) -> str:
            return f"{self._base()}/assign/{self._worker_group.group_rank}/{index}"

        def _ready_key(self, index: int) -> str:
            return f"{self._base()}/ready/{self._worker_group.group_rank}/{index}"

        def _base(self) -> str:
            """The in-job keys of this round (what ``base_key`` is in its workers)."""
            spec = self._worker_group.spec
            rnd = getattr(spec.rdzv_handler, "_resilient_round", None)
            restart = spec.max_restarts - self._remaining_restarts
            attempt = attempt_name(rnd if isinstance(rnd, int) else None, restart)
            return base_key(spec.rdzv_handler.get_run_id(), attempt)

        def _invoke_run(self, role: str = "default") -> Any:
            result = super()._invoke_run(role)
            if result.is_failed():
                self._arrive_at_exit_barrier()
            return result

        def _arrive_at_exit_barrier(self) -> None:
            """The agents whose workers succeeded wait in torchrun's exit barrier for every other
            agent, up to ``exit_barrier_timeout`` (300 s); an agent that fails for good (no
            restarts left) never went there, so they waited out the whole bound before they
            exited.  Its workers are stopped, so it arrives (without waiting) and they go."""
            try:
                from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
                from torch.distributed.elastic.utils.store import _barrier_nonblocking

                _barrier_nonblocking(
                    store=self._store,
                    world_size=self._worker_group.group_world_size,
                    key_prefix=_TERMINAL_STATE_SYNC_ID,
                )
            except Exception as e:  # (the store's host is gone; another torch's internals)
                log.info("the exit barrier was not reached: %s", e)

        # --- monitoring -----------------------------------------------------------------------
        def _monitor_workers(self, worker_group: WorkerGroup) -> Any:
            self._check_formed()
            codes = {lr: p.poll() for lr, p in self._procs.items()}
            if 0 in codes.values():
                self._say_finished()
            self._refill_spares()
            failed = {lr: c for lr, c in codes.items() if c not in (None, 0)}
            if not failed and self._pending_gen is not None:
                done = self._finished(codes)
                if done is not None:
                    self._check_formed()  # (a rank may have formed it and finished since)
                    if self._pending_gen is not None:
                        return self._unformable(worker_group, done)
            if not failed:
                if all(c == 0 for c in codes.values()):
                    self._release_spares()
                    self._say_succeeded()
                    return RunResult(
                        state=WorkerState.SUCCEEDED,
                        return_values={w.global_rank: None for w in worker_group.workers},
                    )
                return self._past_finish(worker_group, codes) or RunResult(
                    state=WorkerState.HEALTHY
                )
            reason = self._cannot_recover(failed)
            if reason is None:
                self._take_over(worker_group, failed)
                return RunResult(state=WorkerState.HEALTHY)
            self._log_fallback(reason)
            failures = {}
            for lr, code in failed.items():
                w = worker_group.workers[lr]
                failures[w.global_rank] = ProcessFailure(
                    local_rank=lr, pid=self._procs[lr].pid, exitcode=code, error_file=""
                )
            return RunResult(state=WorkerState.FAILED, failures=failures)

        def _unformable(self, worker_group: WorkerGroup, done: str) -> Any:
            """A worker finished (exit code 0: ``done`` says which) while the generation of a
            takeover was forming: that generation can never form (the spare would wait for it
            until its bound), so the failure that started the recovery goes to torchrun's
            policy now."""
            rec = self.recoveries[-1]
            self._log_fallback(
                f"{done} finished (exit code 0) before generation {rec['gen']} formed"
            )
            lr = next(w.local_rank for w in worker_group.workers if w.global_rank == rec["rank"])
            failure = ProcessFailure(
                local_rank=lr, pid=rec["old_pid"], exitcode=rec["exitcode"], error_file=""
            )
            return RunResult(state=WorkerState.FAILED, failures={rec["rank"]: failure})

        def _past_finish(self, worker_group: WorkerGroup, codes: dict[int, int | None]) -> Any:
            """Workers idle for ``finish_timeout`` since a worker of the job finished (exit code
            0, here or on another node) are named with their state and killed, a failure for
            torchrun's policy (restart: they resume from the last checkpoint; or fail).  torchrun
            waits for such a worker forever: a rank frozen after its last step, or hung in its
            teardown (a process group's destroy, a non-daemon thread), keeps the job from ending
            although its work is done.  Idle: every second, the worker's process and its
            descendants used under ``BUSY_SHARE`` of a core and none was running.  A worker
            still computing (rank 0's export after the others left, in its own process or a
            child) is left alone, with a warning once a bound."""
            if not self.finish_timeout or self._pending_gen is not None:
                return None
            now = time.monotonic()
            running = [lr for lr, c in sorted(codes.items()) if c is None]
            if self._done is None:
                if 0 not in codes.values():  # (the store asked once a second, not every poll)
                    if now - self._store_asked < STORE_POLL_S:
                        return None
                    self._store_asked = now
                what = self._finished(codes)
                if what is not None:
                    self._done = (now, what)
                    self._sample = (now, self._usage(running))
                    self._busy_at, self._warned = {}, {}
                return None
            last, before = self._sample
            if now - last < STORE_POLL_S:
                return None
            usage = self._usage(running)
            self._sample = (now, usage)
            since, what = self._done
            stuck = []
            for lr in running:
                cpu, on_cpu = usage[lr]
                used = cpu - before.get(lr, (cpu, False))[0]
                # (less than before: a process of it left, its time with it: no telling)
                if on_cpu or used < 0 or used >= BUSY_SHARE * (now - last):
                    self._busy_at[lr] = now
                idle_since = max(since, self._busy_at.get(lr, since))
                if now - idle_since >= self.finish_timeout:
                    stuck.append(lr)
                elif (
                    now - since >= self.finish_timeout
                    and now - self._warned.get(lr, -math.inf) >= self.finish_timeout
                ):
                    self._warned[lr] = now
                    log.warning(
                        "rank %d (local rank %d, pid %d) is still running %.0fs after %s "
                        "finished (exit code 0), and working: left alone while it works "
                        "(--finish-timeout %gs: killed once it has done nothing for that long)",
                        worker_group.workers[lr].global_rank, lr, self._procs[lr].pid,
                        now - since, what, self.finish_timeout,
                    )  # fmt: skip
            if not stuck:
                return None
            failures = {}
            for lr in stuck:
                w, p = worker_group.workers[lr], self._procs[lr]
                log.error(
                    "rank %d (local rank %d, pid %d) is still running %.0fs after %s finished "
                    "(exit code 0) and has done nothing for the last %.0fs (under %.0f%% of a "
                    "core, its child processes included; --finish-timeout %gs); %s. Killing it: "
                    "otherwise the job waits for it forever",
                    w.global_rank, lr, p.pid, now - since, what,
                    now - max(since, self._busy_at.get(lr, since)), 100 * BUSY_SHARE,
                    self.finish_timeout, describe_process(p.pid),
                )  # fmt: skip
            dumped = ask_for_stacks([self._procs[lr] for lr in stuck])  # (all at once)
            for lr in stuck:
                w, p = worker_group.workers[lr], self._procs[lr]
                if p.pid in dumped:
                    log.error(
                        "rank %d wrote its Python stacks to its stderr as it was killed (above, or "
                        "in its log file under --log-dir)", w.global_rank,
                    )  # fmt: skip
                _signal_group(p, signal.SIGKILL)
                try:
                    p.wait(10)  # (a process in an uninterruptible wait dies when it leaves it)
                except subprocess.TimeoutExpired:
                    pass
                code = p.returncode if p.returncode is not None else -signal.SIGKILL
                failures[w.global_rank] = ProcessFailure(
                    local_rank=lr, pid=p.pid, exitcode=code, error_file=""
                )
            # a restart needs every node in a new rendezvous: not one whose workers all finished
            # (its agent waits in the exit barrier); a node that restarts its own joins
            self._log_fallback(
                f"{what} finished (exit code 0) {now - since:.0f}s before",
                no_rendezvous=self._succeeded_elsewhere(),
            )
            return RunResult(state=WorkerState.FAILED, failures=failures)

        def _usage(self, running: list[int]) -> dict[int, tuple[float, bool]]:
            """Each running worker's (CPU seconds, whether a process of it is on a CPU now):
            its rank's process and the rank's descendants (``tree_usage``)."""
            return tree_usage({lr: self._procs[lr].pid for lr in running})

        def _succeeded_key(self) -> str:
            return f"{self._base()}/succeeded"

        def _say_succeeded(self) -> None:
            """Tell the other agents that every worker of this node finished: this agent goes to
            torchrun's exit barrier, never to another rendezvous."""
            try:
                self._store.add(self._succeeded_key(), 1)
            except Exception:
                pass

        def _succeeded_elsewhere(self) -> bool:
            try:
                return int(self._store.add(self._succeeded_key(), 0)) > 0
            except Exception:
                return False

        # The agents' "a worker finished" and "every worker finished" marks are in the round's
        # rendezvous store (``self._store``, as torchrun's exit barrier is), which every agent
        # holds a client of already, whether or not the workers share it.
        def _finished_key(self) -> str:
            return f"{self._base()}/finished"

        def _say_finished(self) -> None:
            """Tell the other nodes' agents that a worker of this node exited 0: a takeover there
            could never form its generation with it (they cannot see this node's processes)."""
            if self._said_finished:
                return
            try:
                self._store.add(self._finished_key(), 1)
                self._said_finished = True
            except Exception:
                pass  # tried again at the next poll; the spare's own bound is the last resort

        def _finished(self, codes: dict[int, int | None]) -> str | None:
            """Which worker of the job has exited 0, if one has: this node's lowest local rank,
            else "a rank on another node" (its agent says so in the store); None when none."""
            done = [lr for lr, c in codes.items() if c == 0]
            if done:
                return f"local rank {min(done)}"
            return ANOTHER_NODE if self._finished_elsewhere() else None

        def _finished_elsewhere(self) -> bool:
            """Whether another node's agent said in the store that a worker of its finished."""
            try:
                said = int(self._store.add(self._finished_key(), 0))
            except Exception:
                return False
            return said > (1 if self._said_finished else 0)

        def _log_fallback(self, reason: str, no_rendezvous: bool | None = None) -> None:
            """Log why the workers are restarted (or not, with none left); ``no_rendezvous``:
            another node joins no new rendezvous, so none is tried (default: the reason says a
            rank on another node finished)."""
            if no_rendezvous is None:
                no_rendezvous = ANOTHER_NODE in reason
            if no_rendezvous and getattr(self, "_remaining_restarts", 0) > 0:
                # that node's agent waits in the exit barrier, not in a rendezvous: a restart
                # would wait for it until the rendezvous times out, then fail anyway
                self._remaining_restarts = 0
                log.warning(
                    "in-job recovery not possible (%s): not restarting the workers either (that "
                    "node's workers are done, so no new rendezvous can form)",
                    reason,
                )
                return
            left = getattr(self, "_remaining_restarts", 1)
            log.warning(
                "in-job recovery not possible (%s): %s",
                reason,
                "restarting the workers"
                if left > 0
                else f"no restarts left (--max-restarts {self._worker_group.spec.max_restarts})",
            )

        def _refill_spares(self) -> None:
            """Drop the spares that exited; start another for each that had been waiting for a
            rank (killed while idle: the OOM killer, an operator), not for one that died on its
            way there (the script fails without RANK at import, say: it would die again), and at
            most MAX_SPARE_REFILLS per round."""
            died = [(i, p) for i, p in self._spares if p.poll() is not None]
            if not died:
                return
            self._spares = [spare for spare in self._spares if spare not in died]
            for i, p in died:
                if p.returncode == 0:  # it said it cannot serve (a backend without in-job recovery)
                    log.info("spare %d (pid %d) exited: not used", i, p.pid)
                    continue
                ready = self._spare_was_ready(i)
                if ready and self._spare_refills < MAX_SPARE_REFILLS:
                    self._spare_refills += 1
                    log.warning("spare %d (pid %d) exited with %s: starting another",
                                i, p.pid, p.returncode)  # fmt: skip
                    self._start_spare()
                else:
                    why = (
                        f"{MAX_SPARE_REFILLS} spares started again already this round"
                        if ready
                        else "before it was ready for a rank: the script fails in a spare, "
                        "which has no RANK or LOCAL_RANK until it is given one?"
                    )
                    log.warning("spare %d (pid %d) exited with %s, not replaced (%s)",
                                i, p.pid, p.returncode, why)  # fmt: skip

        def _spare_was_ready(self, index: int) -> bool:
            store = self._store_client(quiet=True)
            try:
                return store is not None and bool(store.check([self._ready_key(index)]))
            except Exception:
                return False

        def _generation_formed(self) -> str | None:
            """None when the group's newest generation has formed (every rank marked it), else
            why not: a rank that fails before then leaves its peers blocked in that
            generation's rendezvous, which no spare can join."""
            store = self._store_client(quiet=True)
            if store is None:
                return "the agent's store cannot be reached"
            try:
                gen = int(store.add(f"{self._base()}/gen", 0))
                formed = int(store.add(f"{self._base()}/formed/{gen}", 0))
            except Exception as e:
                return f"the agent's store cannot be read ({e})"
            world = self._worker_group.workers[0].world_size
            if formed < world:
                return f"generation {gen} of the group had not formed ({formed} of {world} ranks)"
            return None

        def _cannot_recover(self, failed: dict[int, int]) -> str | None:
            if not self._injob_possible():
                return "in-job recovery is off"
            if self._pending_gen is not None:
                return f"a worker failed while generation {self._pending_gen} was forming"
            done = self._finished({lr: p.poll() for lr, p in self._procs.items()})
            if done is not None:  # its peers can no longer form a group with it
                return f"{done} already finished (exit code 0)"
            not_formed = self._generation_formed()
            if not_formed is not None:
                return not_formed
            if len(self._spares) < len(failed):
                return f"{len(self._spares)} spare(s) left for {len(failed)} failed worker(s)"
            if len(self.recoveries) >= self.max_recoveries:
                return f"{len(self.recoveries)} in-job recoveries already (--max-recoveries)"
            now = time.monotonic()
            again = [lr for lr in failed if now - self._taken_over.get(lr, -1e9) < REPEAT_WINDOW_S]
            if again:
                return (
                    f"local rank {again[0]} failed again within {REPEAT_WINDOW_S:.0f}s of its "
                    f"takeover"
                )
            return None

        def _check_formed(self) -> None:
            if self._pending_gen is None:
                return
            store = self._store_client(quiet=True)
            try:
                formed = int(store.add(f"{self._base()}/formed/{self._pending_gen}", 0))
            except Exception:
                return
            if formed >= self._worker_group.workers[0].world_size:
                rec = self.recoveries[-1]
                rec["formed_s"] = round(time.monotonic() - rec["t0"], 3)
                log.warning(
                    "in-job recovery: generation %d formed %.2fs after the failure",
                    self._pending_gen,
                    rec["formed_s"],
                )
                self._pending_gen = None

        def _take_over(self, wg: WorkerGroup, failed: dict[int, int]) -> None:
            """Give every failed rank to a spare, in one new generation."""
            t0 = time.monotonic()
            store = self._store_client()
            gen = int(store.add(f"{self._base()}/gen", 1))
            for local_rank, code in sorted(failed.items()):
                worker = wg.workers[local_rank]
                index, spare = self._spares.pop(0)
                store.set(
                    self._assign_key(index),
                    json.dumps({"rank": worker.global_rank, "local_rank": local_rank,
                                "role_rank": worker.role_rank, "gen": gen}),
                )  # fmt: skip
                old = self._procs[local_rank]
                # what the failed rank started (a data helper, a shell wrapper's python) goes with
                # it, as torchrun's stop of a worker's group does; the checkpointer's persister has
                # a session of its own and stays
                _signal_group(old, signal.SIGKILL)
                self._procs[local_rank] = spare
                worker.id = spare.pid
                self._taken_over[local_rank] = t0
                self.recoveries.append(
                    {"t0": t0, "rank": worker.global_rank, "exitcode": code, "gen": gen,
                     "old_pid": old.pid, "spare_pid": spare.pid}
                )  # fmt: skip
                log.warning(
                    "rank %d (pid %d) exited with %s: spare pid %d takes its rank, generation %d",
                    worker.global_rank,
                    old.pid,
                    code,
                    spare.pid,
                    gen,
                )
            self._pending_gen = gen
            for _ in failed:
                self._start_spare()  # refill the pool (it imports in the background)

    _CLASS = _InJobAgent
    return _CLASS


_STATES = {
    "R": "running",
    "S": "sleeping (waiting on a lock, a socket, a timer)",
    "D": "in an uninterruptible wait (disk or driver I/O)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "exited, not yet reaped",
}


def _rank_of(pid: int) -> int:
    """The process that does worker ``pid``'s work: the rank a fork server's stand-in stands for."""
    from resilient import forkserver

    return forkserver.rank_pid(pid) or pid


def tree_usage(workers: dict[int, int]) -> dict[int, tuple[float, bool]]:
    """For each ``key: worker pid``, (the CPU seconds its rank, the rank's descendants and the
    rest of its session have used, whether one of them is on a CPU now), from one pass over
    ``/proc``.  A worker's work may run in a child (a script's export subprocess, a shell
    wrapper's python, a shell's background job); a descendant that has exited is counted in its
    parent's children's time once reaped (one reaped by init is not: the total drops)."""
    from resilient.health.heartbeat import proc_stat

    tick = os.sysconf("SC_CLK_TCK")
    stat: dict[int, tuple[int, float, bool]] = {}  # pid -> (ppid, CPU seconds, running)
    sessions: dict[int, list[int]] = {}  # session id -> its processes
    for name in os.listdir("/proc"):
        fields = proc_stat(f"/proc/{name}/stat") if name.isdigit() else None
        if fields is None:
            continue  # (not a process, or gone meanwhile)
        cpu = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        stat[int(name)] = (int(fields[1]), cpu, fields[0] == "R")
        sessions.setdefault(int(fields[3]), []).append(int(name))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stat.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for key, pid in workers.items():
        # the rank and what it started: its descendants, and what is left of its session (a
        # worker's, and a forked rank's, is its own), where a shell's background job goes when
        # the shell exits
        rank = _rank_of(pid)
        todo = [rank, *sessions.get(rank, ()), *(sessions.get(pid, ()) if pid != rank else ())]
        cpu, running, seen = 0.0, False, set()
        while todo:
            p = todo.pop()
            if p in seen or p not in stat:
                continue
            seen.add(p)
            cpu += stat[p][1]
            running |= stat[p][2]
            todo += children.get(p, [])
        out[key] = (cpu, running)
    return out


def describe_process(pid: int) -> str:
    """What ``/proc`` says worker ``pid`` is doing (the rank a fork server's stand-in stands
    for): its state, its threads' states, and the kernel wait of its main thread."""
    from resilient.health.heartbeat import proc_stat

    rank = _rank_of(pid)
    who = f"process {rank}" + (f" (forked for stand-in {pid})" if rank != pid else "")
    try:
        tids = sorted(os.listdir(f"/proc/{rank}/task"), key=int)
    except OSError as e:
        return f"{who}: its state cannot be read ({e})"
    stats = [proc_stat(f"/proc/{rank}/task/{tid}/stat") for tid in tids]
    threads = [fields[0] for fields in stats if fields is not None]
    main = threads[0] if threads else "?"
    text = f"{who} is {_STATES.get(main, f'in state {main}')}"
    if len(threads) > 1:
        counts = {s: threads.count(s) for s in sorted(set(threads))}
        text += (
            f", {len(threads)} threads ("
            + ", ".join(f"{n} {_STATES.get(s, s).split(' (')[0]}" for s, n in counts.items())
            + ")"
        )
    try:
        with open(f"/proc/{rank}/wchan") as f:
            wchan = f.read().strip()
        if wchan and wchan != "0":
            text += f", main thread's kernel wait: {wchan}"
    except OSError:
        pass
    return text


STACKS_WAIT_S = 5.0  # how long a rank asked for its stacks has to write them and end


def ask_for_stacks(procs: list[subprocess.Popen], wait_s: float = STACKS_WAIT_S) -> set[int]:
    """Have workers ``procs`` write their Python stacks to their stderr before they are killed,
    those that catch ``STACKS_SIGNAL`` (a rank that joined through
    ``resilient.launch.init_process_group``: ``dump_stacks_on_signal``; the rank a fork server's
    stand-in stands for is the one asked, through its stand-in, and not its children): all asked
    at once, then waited for together, ``wait_s`` at most.  The pids of those that wrote them
    and ended (the signal's default, after the dump).  A worker that does not catch the signal
    is not sent it (its default would end the process without a word), nor one that is stopped
    (SIGSTOP, a debugger: it could not answer); one that catches it is taken for a rank of the
    toolkit (a program with a handler of its own for this real-time signal gets it too)."""
    from resilient import forkserver
    from resilient.health.heartbeat import proc_stat

    sig = forkserver.STACKS_SIGNAL
    if sig is None:
        return set()
    asked = []
    for p in procs:
        rank = forkserver.rank_pid(p.pid)
        if rank is None or not _catches(rank, sig):
            continue
        stat = proc_stat(f"/proc/{rank}/stat")
        if stat is None or stat[0] in "TtZX":  # stopped, traced or gone: no answer will come
            continue
        try:
            os.kill(p.pid, sig)  # (a stand-in forwards it to its rank)
        except ProcessLookupError:
            continue
        asked.append(p)
    deadline = time.monotonic() + wait_s
    dumped = set()
    for p in asked:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # in an uninterruptible wait, or slow: no stacks
            continue
        dumped.add(p.pid)
    return dumped


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """Signal ``p``'s process group (``p`` leads it: started with ``start_new_session``)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):  # nothing left of it
        pass


def launch_main(argv: list[str], *, program: bool = False) -> int:
    """``resilient launch [torchrun's flags] [--spares K] [--preload MODS] SCRIPT ...``; returns
    the exit code.  ``program``: the caller is the program's entry (``resilient launch``, ``python
    -m reference_trainer --nproc``) and nothing on its stack catches an exception, so the fork
    server of ``--preload`` may be this process, forked (``forkserver.fork_ready``), and not a new
    interpreter importing torch again: its ranks leave through this stack."""
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    from resilient import forkserver

    args = parse_args(argv)
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
            "c10d",
            "localhost:0",
            str(uuid.uuid4()),
        )
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
                "c10d",
                "localhost:0",
                str(uuid.uuid4()),
            )
    if args.master_port is None:
        args.master_port = 29500
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError) as e:  # (torchrun's own checks: --rdzv-conf, ...)
        print(f"resilient launch: error: {e or type(e).__name__}", file=sys.stderr)
        return 2
    if not isinstance(cmd, str):
        raise SystemExit("resilient launch: the entrypoint must be a script or -m MODULE")
    server = None
    preload = [m for m in args.preload.split(",") if m]
    if preload and not args.no_python and cmd == sys.executable and forkserver.enabled():
        # torchrun's "-u [-m] SCRIPT ARGS": the same, through the fork server's stand-in
        unbuffered, rest = cmd_args[:1], cmd_args[1:]
        cmd_args = [*unbuffered, *forkserver.STAND_IN, *rest]
        # (under another server, the host's: its launcher runs in-process, under runpy's
        # restoring context managers, which a rank must not unwind through)
        fork = program and forkserver.ENV not in os.environ and forkserver.fork_ready()
        server = forkserver.start(preload, fork=fork)
    try:
        return _run_agent(args, config, cmd, cmd_args)
    finally:
        if server is not None:
            forkserver.stop(server)


def _rendezvous_flag(args: Any, message: str) -> str:
    """The rendezvous flag (and its value) that torch's ``message`` is about; every one given
    where the message names none of them."""
    flags = [
        ("rendezvous backend", f"--rdzv-backend {args.rdzv_backend} (torchrun's backends: c10d, "
         "static, etcd, etcd-v2)"),
        ("rendezvous endpoint", f"--rdzv-endpoint {args.rdzv_endpoint}"),
        ("rendezvous configuration", f"--rdzv-conf {args.rdzv_conf}"),
    ]  # fmt: skip
    named = [flag for words, flag in flags if words in message]
    return named[0] if named else ", ".join(flag for _, flag in flags)


def _run_agent(args: Any, config: Any, cmd: str, cmd_args: list[str]) -> int:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import (
        SignalException,
        _terminate_process_handler,
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port

    spares = args.spares
    try:  # torch's own checks of the rendezvous flags: a usage error, not a traceback
        rdzv = RendezvousParameters(
            backend=config.rdzv_backend,
            endpoint=config.rdzv_endpoint,
            run_id=config.run_id or str(uuid.uuid4().int),
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            local_addr=config.local_addr,
            **config.rdzv_configs,
        )
        master_addr, master_port = _get_addr_and_port(rdzv)
        rdzv_handler = rdzv_registry.get_rendezvous_handler(rdzv)
    except ValueError as e:
        print(f"resilient launch: error: {_rendezvous_flag(args, str(e))}: {e}", file=sys.stderr)
        return 2
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=rdzv_handler,
        max_restarts=config.max_restarts,
        monitor_interval=min(config.monitor_interval, 0.05),
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    agent = InJobAgent(
        spec, spares, max_recoveries=args.max_recoveries, finish_timeout=args.finish_timeout
    )
    # as torchrun's process context does: a signal to the launcher becomes a SignalException in
    # the agent's loop, which stops the workers with that signal (SIGTERM: a preemption save)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, _terminate_process_handler)
    shutdown_rdzv = True
    try:
        result = agent.run()
    except SignalException as e:
        shutdown_rdzv = False  # torchrun's rule: the other agents may still need it
        print(f"resilient launch: stopped by signal {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
    if result is None or result.is_failed():
        if result is not None:
            for rank, f in sorted(result.failures.items()):
                print(
                    f"resilient launch: rank {rank} (pid {f.pid}) failed with exit code "
                    f"{f.exitcode}",
                    file=sys.stderr,
                )
        return 1
    return 0
