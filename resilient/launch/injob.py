"""In-job recovery, the workers' side: hot spares and process-group generations.

Under ``resilient launch`` (``RESILIENT_INJOB=1``) the agent keeps ``--spares`` processes per node
started ahead of time.  A spare runs the user's script like any worker; ``init_process_group``
holds it (torch and the script's imports loaded) until the agent gives it a rank.  When a worker
dies, the agent of its node kills it if it still exists, gives its rank to a spare and opens the
next *generation* of the group; the healthy ranks leave the broken group (their collectives fail
at once when a peer's process is gone), wait for that generation and form it with the spare.

Everything goes through the agent's store (torchrun's, which outlives the workers), under

    resilient/injob/<run id>/<attempt>/gen                     the generation counter
    resilient/injob/<run id>/<attempt>/assign/<node>/<spare>   a spare's rank, or "exit"
    resilient/injob/<run id>/<attempt>/ready/<node>/<spare>    set once the spare waits for it
    resilient/injob/<run id>/<attempt>/formed/<gen>            ranks that formed that generation

and generation ``g`` forms its group under ``/resilient/attempt_<attempt>/gen_<g>`` (generation 0:
``/resilient/attempt_<attempt>``, as without in-job recovery).  The attempt is the rendezvous
round (``attempt_key``: the same on every node of a round, new in every round, a restart or a node
joining).  When a generation cannot form (a
second fault during recovery, no spare), every rank exits with ``EXIT_RANK_FAILURE`` and the agent
falls back to what torchrun does: restart the workers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from resilient.errors import RankFailureError
from resilient.health.attach import attempt_key

ENV_INJOB = "RESILIENT_INJOB"
ENV_SPARE = "RESILIENT_SPARE"  # "<node>:<index>" in a spare's environment
ENV_GEN = "RESILIENT_INJOB_GEN"

__all__ = [
    "ENV_INJOB",
    "ENV_SPARE",
    "ENV_GEN",
    "injob_enabled",
    "generation",
    "base_key",
    "wait_for_rank",
    "warm_up_spare",
    "wait_for_generation",
    "mark_formed",
]


def injob_enabled() -> bool:
    """Whether this worker runs under ``resilient launch`` with in-job recovery on."""
    return os.environ.get(ENV_INJOB) == "1" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == (
        "True"
    )


def generation() -> int:
    return int(os.environ.get(ENV_GEN, "0"))


def base_key(run_id: str | None = None, attempt: str | None = None) -> str:
    run_id = run_id if run_id is not None else os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"resilient/injob/{run_id}/{attempt_key() if attempt is None else attempt}"


def store_prefix(attempt: str, gen: int) -> str:
    """Where generation ``gen`` of the workers' attempt ``attempt`` (``attempt_key``) forms its
    process group."""
    base = f"/resilient/attempt_{attempt}"
    return base if gen == 0 else f"{base}/gen_{gen}"


def wait_for_rank(
    store: Any, poll_s: float = 0.01, warm_up: Callable[[], object] | None = None
) -> bool:
    """(a spare) Wait for the agent to hand this process a rank; set RANK, LOCAL_RANK, ROLE_RANK
    and the generation in the environment and return True, or return False when the agent says
    the job is over (or went away).  ``warm_up`` runs first (default :func:`warm_up_spare`)."""
    (warm_up or warm_up_spare)()
    node, index = os.environ[ENV_SPARE].split(":")
    key = f"{base_key()}/assign/{node}/{index}"
    from resilient.forkserver import launcher_pid

    parent = launcher_pid()  # (a forked spare's parent is its node's fork server)
    # from now on, the agent starts another spare if this one dies (not for one that dies on
    # its way here, at import, say: another would too)
    try:
        store.set(f"{base_key()}/ready/{node}/{index}", "1")
    except Exception:  # the agent's store is gone: the job is over
        return False
    while True:
        try:
            if store.check([key]):
                break
        except Exception:  # the agent's store is gone: the job is over
            return False
        if launcher_pid() != parent:  # the agent died
            return False
        time.sleep(poll_s)
    got = json.loads(store.get(key))
    if got.get("exit"):
        return False
    os.environ["RANK"] = str(got["rank"])
    os.environ["LOCAL_RANK"] = str(got["local_rank"])
    os.environ["ROLE_RANK"] = str(got.get("role_rank", got["rank"]))
    os.environ[ENV_GEN] = str(got["gen"])
    os.environ.pop(ENV_SPARE, None)
    return True


def warm_up_spare() -> None:
    """A spare's default warm-up: load now what a rank's first steps load lazily, so that taking
    a rank over costs none of it: torch's optimizers import torch._dynamo on first use (seconds),
    and the checkpointer its storage and format modules.  A program whose ranks never import
    torch._dynamo (the reference trainer's optimizer does not) passes its own to
    ``init_process_group``: a spare's seconds of CPU are taken from the ranks training beside it."""
    try:
        import torch

        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        import resilient.checkpoint.checkpointer  # noqa: F401
    except Exception:  # a warm-up only
        pass


def wait_for_generation(store: Any, after: int, timeout_s: float, poll_s: float = 0.005) -> int:
    """(a healthy rank whose group broke) Wait until the agent that lost a worker opens a
    generation newer than ``after``; returns it, or raises RankFailureError at the timeout (no
    agent could recover in-job: the agents restart the workers instead)."""
    key = f"{base_key()}/gen"
    deadline = time.monotonic() + timeout_s
    while True:
        gen = int(store.add(key, 0))
        if gen > after:
            return gen
        if time.monotonic() > deadline:
            raise RankFailureError(
                f"no in-job recovery within {timeout_s:.0f}s of the group's failure (generation "
                f"{after} is still the newest); leaving for the launcher to restart the workers"
            )
        time.sleep(poll_s)


def mark_formed(store: Any, gen: int) -> None:
    """Tell the agents that this rank is in generation ``gen``'s group (recovery is over for it)."""
    store.add(f"{base_key()}/formed/{gen}", 1)
