"""Joining the process group so that torchrun restarts work.

Under torchrun the workers' store is the agent's TCPStore, which outlives the workers and is the same
server (same port) in every restart attempt, while ``init_process_group("env://")`` assumes a fresh
store per attempt and adds no prefix.  A restarted group then reads the previous attempt's keys
(gloo's peer addresses among them) and the first attempt after a failure dies in
``connectFullMesh ... Connection refused``.  ``init_process_group`` here prefixes the store with the
restart count, so every attempt rendezvouses on its own keys.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["init_process_group", "restart_count", "free_port"]


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(backend: str, *, timeout_s: float = 600.0) -> None:
    """``dist.init_process_group`` from the launcher's environment, safe across torchrun restarts."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
