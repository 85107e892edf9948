"""The job's ranks as preflight sees them: who is where, agreeing on numbers, exchanging results.

Every decision that changes which collectives run next (how many sizes, how many repeats, whether
a check still fits the budget) is taken on numbers every rank agrees on (``agree_max`` /
``agree_min``), so that no rank ever waits in a collective its peers skipped.  Results travel as
JSON through the job's c10d store, never pickled (``all_gather_object`` would unpickle what peers
send).  A world of one (no process group) is a ``Group`` too: its collectives are no-ops.

Per-node figures (memory bandwidth, matmul throughput, store latency, storage) are measured in
*turns*: one local rank of every node at a time, all nodes at once, so ranks of one node never
compete for the same memory bus or disk while the check still takes the same time on 2 nodes as on
200.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group"]

_CALLS_KEY = "resilient/preflight/calls"


class Group:
    """The default process group (or a world of one) with the few operations preflight needs."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.backend = dist.get_backend() if self.distributed else None
        on_gpu = self.backend == "nccl" and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        self.device = self.device or torch.device("cpu")
        self.host = socket.gethostname()
        # torchrun sets both; a job started otherwise (tests/dist.py) is one node
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.turns = int(self.agree_max([local_world])[0])
        self.store = dist.distributed_c10d._get_default_store() if self.distributed else None
        self.prefix = "resilient/preflight/0"
        if self.store is not None:
            # the n-th preflight of this job (Run(preflight=True) after an in-job recovery, say)
            # keeps its keys apart from the ones before
            # keeps its keys apart from the ones before; agreed, so that a count an interrupted
            # run left uneven cannot split the ranks between two prefixes
            call = (int(self.store.add(_CALLS_KEY, 1)) - 1) // self.world
            (call,) = self.agree_max([call])
            self.prefix = f"resilient/preflight/{int(call)}"

    # --- collectives on agreed numbers ----------------------------------------------------------
    def sync(self) -> None:
        """Every rank is here (a tiny all-reduce: a barrier on any backend)."""
        if self.world > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))
            self.synchronize()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def agree_max(self, values: list[float]) -> list[float]:
        """The element-wise maximum of ``values`` over every rank (the same list everywhere)."""
        if self.world == 1 or not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu().tolist()]

    def agree_min(self, values: list[float]) -> list[float]:
        return [-v for v in self.agree_max([-float(v) for v in values])]

    def collect(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order, on every rank (a sum of one-hot vectors)."""
        return [row[0] for row in self.collect_many([value])]

    def collect_many(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length on every rank), in rank order, on every rank:
        one all-reduce of a world x len(values) table."""
        if self.world == 1 or not self.distributed:
            return [[float(v) for v in values]]
        t = torch.zeros(self.world, len(values), dtype=torch.float64, device=self.device)
        t[self.rank] = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t)
        return [[float(v) for v in row] for row in t.cpu().tolist()]

    # --- JSON through the store -----------------------------------------------------------------
    def gather(self, name: str, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (JSON-able) at rank 0, in rank order; None elsewhere."""
        if self.store is None:
            return [value]
        self.store.set(f"{self.prefix}/{name}/{self.rank}", json.dumps(value))
        if self.rank != 0:
            return None
        return [json.loads(self.store.get(f"{self.prefix}/{name}/{r}")) for r in range(self.world)]

    def share(self, name: str, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.store is None:
            return value
        key = f"{self.prefix}/{name}"
        if self.rank == 0:
            self.store.set(key, json.dumps(value))
        return json.loads(self.store.get(key))

    def cleanup(self, names: list[str]) -> None:
        """(rank 0, after every rank has read what it needs) Drop this preflight's keys."""
        if self.store is None or self.rank != 0:
            return
        for name in names:
            keys = [f"{self.prefix}/{name}"] + [
                f"{self.prefix}/{name}/{r}" for r in range(self.world)
            ]
            for key in keys:
                try:
                    self.store.delete_key(key)
                except Exception:  # a store without delete (or a key never set): harmless
                    pass

    # --- after a collective timed out -----------------------------------------------------------
    def unanswered(self, wait_s: float) -> list[int]:
        """(every rank that is still running, after a collective or store read failed) Say so
        through the store; at rank 0, the ranks that have not said so within ``wait_s`` (a rank
        stopped, hung or gone never does).  Empty elsewhere."""
        if self.store is None:
            return []
        key = f"{self.prefix}/answer"
        try:
            self.store.set(f"{key}/{self.rank}", "1")
        except Exception:  # the store itself is gone: nothing to tell anyone
            return []
        if self.rank != 0:
            return []
        missing = list(range(self.world))
        deadline = time.monotonic() + wait_s
        while True:
            try:
                missing = [r for r in missing if not self.store.check([f"{key}/{r}"])]
            except Exception:
                break
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.cleanup(["answer"])
        return missing

    def timeout_s(self) -> float | None:
        """The store's timeout (the group's: ``init_process_group`` gives both the same), in
        seconds; None when the store does not say."""
        try:
            return self.store.timeout.total_seconds() if self.store is not None else None
        except Exception:
            return None

    # --- the store's own latency ----------------------------------------------------------------
    def store_round_trip(self, count: int) -> list[float]:
        """``count`` timed ``get`` round trips to the job's store, in seconds."""
        if self.store is None:
            return []
        key = f"{self.prefix}/ping"
        self.store.set(key, b"x")
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            self.store.get(key)
            out.append(time.perf_counter() - t0)
        return out
