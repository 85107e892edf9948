"""Several ranks' saves and loads simulated in one process, through the real writer and reader.

Real multi-process runs (tests/integration) cover the commit handshake over the c10d store; this
helper lets the resharding property tests cover hundreds of layout pairs in seconds.  Each rank's
bytes go through the same plan -> stage -> persist -> manifest -> plan_reads -> execute_reads path.
"""

from __future__ import annotations

import math

import torch

from resilient.checkpoint.format import (
    MANIFEST_NAME,
    manifest_to_bytes,
    rank_file_name,
    step_dir_name,
)
from resilient.checkpoint.reader import execute_reads, plan_reads, read_manifest
from resilient.checkpoint.state import flatten_state, shard_of
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.writer import Stager, build_manifest, persist_rank_file, plan_writes
from resilient.layout import (
    Layout,
)


def local_chunk(g: torch.Tensor, placement: dict, layout: Layout, rank: int) -> torch.Tensor:
    """This rank's chunk of global tensor ``g`` (fused dims: its slice of every block)."""
    return shard_of(g, placement, layout, rank)


def distribute(globals_: dict, placements: dict, layout: Layout, rank: int) -> dict:
    return {k: shard_of(g, placements.get(k, {}), layout, rank) for k, g in globals_.items()}


def save_world(
    url: str,
    step: int,
    states: list[dict],
    layout: Layout,
    *,
    block_bytes: int = 4096,
    compression: str | None = None,
    storage_options: dict | None = None,
) -> dict:
    storage = Storage(url, storage_options)
    rel = step_dir_name(step)
    storage.makedirs(rel)
    plans, reports = [], []
    for r, state in enumerate(states):
        flat = flatten_state(state, layout, r)
        plan = plan_writes(flat.tensors, layout, r)
        data = Stager().stage(plan, flat.tensors)
        res = persist_rank_file(
            storage,
            rel,
            rank_file_name(r),
            plan,
            data,
            block_bytes=block_bytes,
            compression=compression,
            step=step,
        )
        plans.append(plan)
        reports.append(
            {
                "rank": r,
                "file": res.file,
                "size_bytes": res.size_bytes,
                "chunks": {k: c.to_json() for k, c in res.chunks.items()},
                "digest": plan.digest,
                "num_tensors": len(plan.tensors),
                "values": flat.values,
            }
        )
    m = build_manifest(
        step, layout, plans[0], reports, block_bytes=block_bytes, generation=0, version="test"
    )
    storage.write_atomic(f"{rel}/{MANIFEST_NAME}", manifest_to_bytes(m))
    return {
        "bytes_per_rank": [r["size_bytes"] for r in reports],
        "plan_load": plans[0].bytes_per_rank,
    }


def load_world(
    url: str, step: int, states: list[dict], layout: Layout, storage_options: dict | None = None
):
    storage = Storage(url, storage_options)
    m = read_manifest(storage, step)
    stats = []
    for r, state in enumerate(states):
        flat = flatten_state(state, layout, r, for_load=True)
        items = plan_reads(m, flat.tensors, layout, r)
        stats.append(
            execute_reads(storage, m, items, {k: v.local for k, v in flat.tensors.items()})
        )
    return stats


def numel(shape) -> int:
    return math.prod(shape)
