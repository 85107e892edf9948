"""Joining the process group so that torchrun restarts work, with the heartbeat already running.

Under torchrun the workers' store is the agent's TCPStore, which outlives the workers and is the same
server (same port) in every restart attempt, while ``init_process_group("env://")`` assumes a fresh
store per attempt and adds no prefix.  A restarted group then reads the previous attempt's keys
(gloo's peer addresses among them) and the first attempt after a failure dies in
``connectFullMesh ... Connection refused``.  ``init_process_group`` here prefixes the store with the
attempt (``attempt_key``: the rendezvous round under ``resilient launch``, else the restart count),
so every attempt rendezvouses on its own keys.

It also starts the rank's heartbeat (``resilient.health``) on the agent's store *before* the
process group exists, when detection is on (under torchrun by default): a rank that freezes in the
rendezvous, or is stuck before it, is declared like any other, and one that never gets here is
declared DEAD by the join timeout.  ``Run`` adopts that monitor.  Phases announced here: ``init``
(the monitor started), ``rendezvous`` (inside ``dist.init_process_group``) and ``setup`` (the group
is up; until ``Run.track``).

It installs the collective ring (``resilient.health.ring``: every collective this process enters
and leaves, for hang attribution) before the group exists, so that the first collective is
recorded and a hook that wraps the same functions later (the chaos harness's ``slow`` fault)
wraps the ring's wrappers; ``RESILIENT_COLLECTIVE_RING=0`` leaves torch's functions alone.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default argument,
# evaluated when the module is first imported (torch._dynamo imports it, lazily, at the first
# optimizer step): imported after init_process_group, they would hold the first world group for
# the life of the process, and a gloo group closes its connections only when it is freed.  In-job
# recovery frees the broken groups; imported here, before any group exists, the default is None.
import torch.distributed.nn  # noqa: F401

from resilient.errors import RankFailureError
from resilient.health import flight_recorder
from resilient.health.attach import (
    agent_store,
    attempt_key,
    detect_by_default,
    hand_over,
    restart_count,
    shares_agent_store,
    start_monitor,
)
from resilient.health.detector import DetectorConfig
from resilient.health.events import EventLog
from resilient.health.ring import install as install_ring
from resilient.hooks import call as call_hooks
from resilient.launch.injob import (
    ENV_GEN,
    ENV_INJOB,
    ENV_SPARE,
    base_key,
    generation,
    injob_enabled,
    mark_formed,
    store_prefix,
    wait_for_generation,
    wait_for_rank,
)

log = logging.getLogger(__name__)

__all__ = [
    "init_process_group",
    "dump_stacks_on_signal",
    "regroup",
    "restart_count",
    "free_port",
    "injob_enabled",
    "MAX_PROCESSES_PER_NODE",
]

# The most local processes a launcher starts on one node (ranks, and spares each): far past any
# machine's accelerators or cores; a typo such as --nproc 100000 would otherwise fork until the
# machine runs out of memory or pids.  More ranks run on more nodes (--nnodes).
MAX_PROCESSES_PER_NODE = 4096


def init_process_group(
    backend: str,
    *,
    timeout_s: float = 600.0,
    detector: DetectorConfig | None = None,
    event_log: str | None = None,
    detect: bool | None = None,
    hooks: Sequence[Any] = (),
    warm_up: Callable[[], object] | None = None,
) -> None:
    """``dist.init_process_group`` from the launcher's environment, safe across torchrun restarts.

    ``detector``: heartbeat and verdict settings for the monitor started here (under torchrun, or
    anywhere with ``detect=True``/``RESILIENT_DETECT=1`` when the launcher's store is reachable);
    ``event_log``: where verdicts and stacks go (a path; default: none);
    ``hooks``: called with ``at_phase("init_process_group", None)`` before joining the group;
    ``warm_up``: what a hot spare of ``resilient launch`` runs before it waits for a rank
    (default ``resilient.launch.injob.warm_up_spare``: what torch's optimizers and the
    checkpointer import on first use)."""
    if dist.is_initialized():
        return
    install_ring()  # once per process; a new group (regroup) starts it over
    dump_stacks_on_signal()
    timeout = timedelta(seconds=timeout_s)
    under_agent = shares_agent_store()
    if backend != "gloo" and injob_enabled():
        # In-job recovery needs a collective that fails when a peer's process is gone: gloo's
        # does; NCCL's may wait for its timeout.  Off for this job: failures restart the workers.
        os.environ[ENV_INJOB] = "0"
        if os.environ.get(ENV_SPARE):
            print(
                f"resilient launch: spare not used: in-job recovery works with the gloo backend "
                f"only (this job uses {backend}); failures restart the workers",
                file=sys.stderr,
            )
            raise SystemExit(0)
    if os.environ.get(ENV_SPARE) and injob_enabled():
        # a hot spare of ``resilient launch``: wait here, imports done, until given a rank
        if not wait_for_rank(agent_store(), warm_up=warm_up):
            raise SystemExit(0)  # the job finished without needing this spare
        EventLog(event_log).write(
            "spare_takeover", rank=int(os.environ["RANK"]), pid=os.getpid(), generation=generation()
        )
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if "nccl" in backend.lower():  # (its watchdog's dump on a timeout: not torch's shared file)
        _name_nccl_dump_file()
    monitor = None
    # under torchrun, the monitor watches the rendezvous too: it starts on the agent's store,
    # before the group; where the agent hosts none (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), on the
    # group's store, once the group has formed
    watch = (
        world > 1
        and "TORCHELASTIC_RUN_ID" in os.environ
        and (detect if detect is not None else detect_by_default())
    )
    if watch and under_agent:
        monitor = start_monitor(
            rank, world, detector or DetectorConfig(), EventLog(event_log), store=agent_store()
        )
        hand_over(monitor)
    call_hooks(hooks, "at_phase", "init_process_group", None)
    if monitor is not None:
        monitor.progress(None, "rendezvous")
    if under_agent:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timeout,
        )
        gen = generation() if injob_enabled() else 0
        if gen:
            _gather(store, gen, world, min(timeout_s, 120.0))
        prefixed = dist.PrefixStore(store_prefix(attempt_key(), gen), store)
        dist.init_process_group(
            backend, store=prefixed, rank=rank, world_size=world, timeout=timeout
        )
        if injob_enabled():
            mark_formed(store, gen)
    else:
        dist.init_process_group(backend, timeout=timeout)
    if watch and not under_agent:
        monitor = start_monitor(rank, world, detector or DetectorConfig(), EventLog(event_log))
        hand_over(monitor)
    if monitor is not None:
        monitor.progress(None, "setup")


def dump_stacks_on_signal() -> None:
    """From now on this process writes every thread's Python stacks to its stderr when it gets
    ``STACKS_SIGNAL`` (resilient.forkserver: a real-time signal), then ends as the signal's
    default would have it: ``resilient launch --finish-timeout`` asks a rank it is about to kill
    (a rank hung in its teardown after its peers finished) why it is stuck, and the dump is in
    the rank's output.  faulthandler writes from its signal handler in C, so a rank blocked in
    C code or holding the GIL dumps too (not one that is stopped).  Best effort: a stderr with
    no file descriptor (a test runner's capture) registers nothing."""
    # (not imported with this module: a launcher forked from a server for launchers, which
    # preloads this module, runs resilient.forkserver as __main__, and runpy warns when the
    # module it runs was imported before)
    from resilient.forkserver import STACKS_SIGNAL

    if STACKS_SIGNAL is None:
        return
    try:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=True)
    except (ValueError, RuntimeError, OSError, AttributeError):
        pass


def _name_nccl_dump_file() -> None:
    """Point NCCL's own flight recorder dump at the job's private file (flight_recorder): best
    effort, never in the job's way (a full or read-only temporary directory, one not ours)."""
    try:
        flight_recorder.name_for_torch()
    except OSError as e:  # (FlightRecorderError is one)
        log.warning("NCCL's own flight recorder dump goes to torch's default file: %s", e)


def _gather(store: Any, gen: int, world: int, timeout_s: float) -> None:
    """Before forming generation ``gen``: wait until every rank is there, so that a second fault
    now (the generation moves on, or a rank never comes) ends in the launcher's restart rather than
    in a group that waits for a rank forever."""
    base = base_key()
    key, gen_key = f"{base}/joining/{gen}", f"{base}/gen"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < world:
        newest = int(store.add(gen_key, 0))
        if newest != gen or time.monotonic() > deadline:
            raise RankFailureError(
                f"generation {gen} of the group did not form (newest generation {newest}, "
                f"{int(store.add(key, 0))} of {world} ranks there): leaving for the launcher to "
                f"restart the workers"
            )
        time.sleep(0.002)


def regroup(
    backend: str,
    *,
    wait_s: float = 60.0,
    timeout_s: float = 600.0,
    detector: DetectorConfig | None = None,
    event_log: str | None = None,
    detect: bool | None = None,
    hooks: Sequence[Any] = (),
) -> int:
    """(in-job recovery, a healthy rank) Leave the broken group, wait up to ``wait_s`` for the
    agent to open the next generation (a spare takes the failed rank), form it; returns the
    generation.  Raises RankFailureError when no generation opens or it cannot form: then exit,
    and the launcher restarts the workers."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gen = wait_for_generation(agent_store(), generation(), wait_s)
    os.environ[ENV_GEN] = str(gen)
    init_process_group(
        backend,
        timeout_s=timeout_s,
        detector=detector,
        event_log=event_log,
        detect=detect,
        hooks=hooks,
    )
    return gen


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a local rendezvous), below
    the kernel's ephemeral range where it can: a port the kernel picked (bind to 0) is also one it
    may give an outgoing connection as its source port before the rendezvous listens on it, and
    torchrun's agent then takes that connection for another agent's store ("Connection reset by
    peer", seen once on a busy machine)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        if port == 0:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
