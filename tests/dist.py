"""Run a function on N real processes joined in a gloo process group.

Processes fork from a forkserver that has torch imported already (and torch._dynamo, which every
optimizer imports on construction: 1.5 s of CPU per process otherwise; and pytest, the toolkit's
modules and the reference trainer: a child imports its test's module to unpickle its function), so
a world of 4 starts in well under a second and never inherits OpenMP thread pools from the pytest
process.  The preload is the process's: ``multiprocessing``'s other forkserver users
(tests/integration/test_kill.py) take it too.  A child's
exception comes back with its traceback and fails the test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

from resilient.launch import free_port

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "resilient",
        # what the ranks of most tests import, each otherwise for itself: the checkpointer, the
        # training loop, the heartbeat and the reference trainer (0.15-0.3 s of CPU a rank)
        "resilient.checkpoint.checkpointer",
        "resilient.loop",
        "resilient.health.heartbeat",
        "reference_trainer.train",
        # a child unpickles the test's function, which imports its test module, which imports
        # pytest: 0.3 s of CPU a rank
        "pytest",
    ]
)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    queue,
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        **env,
    )
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except Exception as e:
            if "EADDRINUSE" in str(e):  # the port was taken after free_port() chose it
                queue.put((rank, "port-taken", traceback.format_exc()))
                return
            raise
        # By value: a tensor put on the queue as it is travels as a descriptor of this process's
        # shared memory, which the parent fetches from this process's fd server, gone once this
        # process has exited (seen: FileNotFoundError for its socket in the parent's get)
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the results in rank order.  When
    another process takes the chosen port before rank 0 listens on it (nothing ran yet), the
    world starts again on another port, up to twice."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout_s)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _take(rank: int, status: str, payload: Any, results: dict, errors: list[str]) -> bool:
    """One rank's report into ``results`` or ``errors``; whether it found the port taken."""
    if status == "ok":
        results[rank] = pickle.loads(payload)
        return False
    errors.append(f"--- rank {rank} ---\n{payload}")
    return status == "port-taken"


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> list[Any]:
    port = free_port()
    queue = _CTX.Queue()
    # the forkserver's environment is that of the test that started it: pass on this test's
    # memory root (tests/conftest.py), so no rank writes into the machine's /dev/shm
    env = {
        k: os.environ[k]
        for k in ("RESILIENT_MEMORY_ROOT", "RESILIENT_REPLICA_LINKS")
        if k in os.environ
    }
    procs = [
        _CTX.Process(target=_child, args=(fn, r, world_size, port, args, queue, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    port_taken = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:  # a child died without reporting (killed, or failed to start)
                    errors.append(
                        f"rank process exited with code {dead[0].exitcode} before reporting"
                    )
                elif time.monotonic() > deadline:
                    errors.append(
                        f"timed out after {timeout_s}s with {len(results)} of {world_size} ranks done"
                    )
                continue
            port_taken |= _take(rank, status, payload, results, errors)
        # the other ranks' reports too, for a few seconds: a rank that failed to connect may
        # have met another job's store on the port rank 0 found taken (then rank 0 says so)
        settle = time.monotonic() + 3.0
        while errors and time.monotonic() < settle:
            try:
                port_taken |= _take(*queue.get(timeout=0.2), results, errors)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # (what they put before they exited has come by now)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if port_taken:
        raise _PortTaken()
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
