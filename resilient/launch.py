"""Joining the process group so that torchrun restarts work, with the heartbeat already running.

Under torchrun the workers' store is the agent's TCPStore, which outlives the workers and is the same
server (same port) in every restart attempt, while ``init_process_group("env://")`` assumes a fresh
store per attempt and adds no prefix.  A restarted group then reads the previous attempt's keys
(gloo's peer addresses among them) and the first attempt after a failure dies in
``connectFullMesh ... Connection refused``.  ``init_process_group`` here prefixes the store with the
restart count, so every attempt rendezvouses on its own keys.

It also starts the rank's heartbeat (``resilient.health``) on the agent's store *before* the
process group exists, when detection is on (under torchrun by default): a rank that freezes in the
rendezvous, or is stuck before it, is declared like any other, and one that never gets here is
declared DEAD by the join timeout.  ``Run`` adopts that monitor.  Phases announced here: ``init``
(the monitor started), ``rendezvous`` (inside ``dist.init_process_group``) and ``setup`` (the group
is up; until ``Run.track``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient.health.attach import (
    agent_store,
    detect_by_default,
    hand_over,
    restart_count,
    shares_agent_store,
    start_monitor,
)
from resilient.health.detector import DetectorConfig
from resilient.health.events import EventLog
from resilient.hooks import call as call_hooks

__all__ = ["init_process_group", "restart_count", "free_port"]


def init_process_group(
    backend: str,
    *,
    timeout_s: float = 600.0,
    detector: DetectorConfig | None = None,
    event_log: str | None = None,
    detect: bool | None = None,
    hooks: Sequence[Any] = (),
) -> None:
    """``dist.init_process_group`` from the launcher's environment, safe across torchrun restarts.

    ``detector``: heartbeat and verdict settings for the monitor started here (under torchrun, or
    anywhere with ``detect=True``/``RESILIENT_DETECT=1`` when the launcher's store is reachable);
    ``event_log``: where verdicts and stacks go (a path; default: none);
    ``hooks``: called with ``at_phase("init_process_group", None)`` before joining the group."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    under_agent = shares_agent_store()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
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
        prefixed = dist.PrefixStore(f"/resilient/attempt_{restart_count()}", store)
        dist.init_process_group(
            backend, store=prefixed, rank=rank, world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    if watch and not under_agent:
        monitor = start_monitor(rank, world, detector or DetectorConfig(), EventLog(event_log))
        hand_over(monitor)
    if monitor is not None:
        monitor.progress(None, "setup")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
