"""Where a rank's monitor comes from: the store, the key prefix, and the hand-over to ``Run``.

Under torchrun the heartbeat starts as early as the rank can talk to the agent's store, inside
``resilient.launch.init_process_group`` and before ``dist.init_process_group``, so that every phase
from there to the first step is watched (a rank frozen in the rendezvous or before it is caught;
one frozen before it ever registers is caught by the join timeout).  ``Run`` then adopts that
monitor instead of starting a second one.  Without torchrun (a process group created by hand),
``Run`` starts one on the default process group's store.

The agent's store outlives the workers and is shared by every restart attempt, so keys live under
``resilient/health/<run id>/<attempt>`` (``attempt_key``: the restart count, or the rendezvous round
under ``resilient launch``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from resilient.health.detector import DetectorConfig
from resilient.health.events import EventLog
from resilient.health.heartbeat import ENV_ROUND, Monitor

__all__ = [
    "detect_by_default",
    "start_monitor",
    "agent_store",
    "shares_agent_store",
    "hand_over",
    "take_over",
    "restart_count",
]

_EARLY: Monitor | None = None


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_key() -> str:
    """The keys of this attempt of the workers in the launcher's store: the rendezvous round
    under ``resilient launch`` (the same on every node of a round and new in every round, a
    restart or a node joining, whose agent's restart count starts again at 0), else torchrun's
    restart count (which a membership change does not move: torchrun's own keys have that gap)."""
    rnd = os.environ.get(ENV_ROUND, "")
    return attempt_name(int(rnd) if rnd.isdigit() else None, restart_count())


def attempt_name(rnd: int | None, restart: int) -> str:
    """``attempt_key`` from its parts: the round where the launcher knows it (the agent calls this
    for its own keys, the workers through their environment)."""
    return f"round_{rnd}" if rnd is not None else str(restart)


def detect_by_default() -> bool:
    """On under torchrun (whose agent restarts the group after a verdict), unless RESILIENT_DETECT=0;
    RESILIENT_DETECT=1 turns it on elsewhere."""
    flag = os.environ.get("RESILIENT_DETECT")
    if flag is not None:
        return flag not in ("0", "false", "no", "")
    return "TORCHELASTIC_RUN_ID" in os.environ


def shares_agent_store() -> bool:
    """Whether torchrun's agent hosts the workers' store (MASTER_ADDR:MASTER_PORT), as it does
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; then rank 0 hosts it once the group forms."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agent_store(timeout_s: float = 60.0) -> Any:
    """A client of torchrun's agent store (MASTER_ADDR:MASTER_PORT); None where the agent does
    not host one (``shares_agent_store``)."""
    import torch.distributed as dist

    if not shares_agent_store():
        return None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def start_monitor(
    rank: int,
    world_size: int,
    config: DetectorConfig,
    events: EventLog,
    *,
    store: Any | None = None,
) -> Monitor:
    """Heartbeats go to torchrun's agent store when there is one (it outlives the workers), else to
    the default process group's store; keys live under a per-run, per-restart prefix."""
    if store is None and "TORCHELASTIC_RUN_ID" in os.environ:
        store = agent_store()
    if store is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        prefix = f"resilient/health/{os.environ['TORCHELASTIC_RUN_ID']}/{attempt_key()}"
        gen = os.environ.get("RESILIENT_INJOB_GEN", "0")  # in-job recovery's generation
        if gen != "0":
            prefix += f".{gen}"
    else:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        if hasattr(store, "clone"):
            # a connection of its own: one client serializes its requests, and a commit's long
            # wait on the group's store would hold the heartbeats back (a false DEAD verdict)
            store = store.clone()
        n = store.add("resilient/health/runs", 1)
        prefix = f"resilient/health/local/{(n - 1) // world_size}"
    events.write("monitor", rank=rank, prefix=prefix, pid=os.getpid(), restart=restart_count())
    return Monitor(store, prefix, rank, world_size, config, events=events)


def hand_over(monitor: Monitor) -> None:
    """Keep the monitor ``init_process_group`` started, for the ``Run`` that comes next."""
    global _EARLY
    _EARLY = monitor


def take_over(rank: int, world_size: int) -> Monitor | None:
    """The monitor started for this rank before the process group, if any (once)."""
    global _EARLY
    m, _EARLY = _EARLY, None
    if m is None or m.closed or m.rank != rank or m.world_size != world_size:
        return None
    return m
