"""The collectives a trainer uses, timed over message sizes, as nccl-tests reports them.

Message size is nccl-tests' ``size``: the all-reduce and broadcast buffer, the all-gather output,
the reduce-scatter input, and each rank's all-to-all send buffer.  Algorithm bandwidth is size /
time; bus bandwidth scales it by what each rank must move over its links, so that one number can be
compared with the link's peak whatever the collective: all-reduce ``2(n-1)/n``, all-gather,
reduce-scatter and all-to-all ``(n-1)/n``, broadcast ``1``.  Time is the slowest rank's mean per
iteration (the collective is done when its last rank is).

All-to-all uses uneven splits (rank r sends peer p a share weighted ``1 + (r + p) mod n``), as a
mixture-of-experts token dispatch does; every rank still sends and receives ``size`` in all.
Sizes go up by powers of two from 4 KiB to 256 MiB; a size is left out when two buffers of it do
not fit in a quarter of the memory free to each rank, or when the time it would take no longer
fits the check's budget.  Both cuts are listed in the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from resilient.preflight.group import Group
from resilient.preflight.outliers import human_bytes

__all__ = [
    "OPS",
    "bus_factor",
    "message_sizes",
    "uneven_splits",
    "CollectiveResult",
    "run_collectives",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_F32 = 4


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from ``min_bytes`` up to ``max_bytes`` (both included when powers of two)."""
    out, size = [], 1
    while size < min_bytes:
        size *= 2
    while size <= max_bytes:
        out.append(size)
        size *= 2
    return out


def uneven_splits(count: int, n: int, rank: int) -> tuple[list[int], list[int]]:
    """(input splits, output splits) in elements of rank ``rank``'s all-to-all over ``count``
    elements per rank: rank r sends peer p a share weighted ``1 + (r + p) mod n`` (a Latin square:
    each rank also receives every weight once); what it receives from p is p's split for r."""

    total = n * (n + 1) // 2  # every rank's weights are 1..n in some order
    rest = count - sum(count * w // total for w in range(1, n + 1))  # the same for every rank
    sends = [count * (1 + (rank + p) % n) // total for p in range(n)]
    sends[-1] += rest  # the last peer takes what rounding left
    recv = [
        count * (1 + (p + rank) % n) // total + (rest if rank == n - 1 else 0) for p in range(n)
    ]
    return sends, recv


@dataclass(frozen=True)
class CollectiveResult:
    op: str
    size_bytes: int  # the nominal size (a power of two)
    bytes: int  # what was moved: rounded down to a multiple of the world's float32s
    iters: int
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "size_bytes": self.size_bytes,
            "bytes": self.bytes,
            "iters": self.iters,
            "time_s": self.time_s,
            "algbw_bytes_per_s": self.algbw_bytes_per_s,
            "busbw_bytes_per_s": self.busbw_bytes_per_s,
        }


def _op(op: str, size: int, group: Group, a: torch.Tensor, b: torch.Tensor):
    """A closure running one ``op`` of ``size`` bytes on views of the buffers ``a`` and ``b``,
    and the bytes it really moves (sizes round down to a multiple of the world's float32s)."""
    n, rank = group.world, group.rank
    count = max(size // _F32 // n, 1) * n
    if op == "all_reduce":
        x = a[:count]
        return (lambda: dist.all_reduce(x)), count * _F32
    if op == "broadcast":
        x = a[:count]
        return (lambda: dist.broadcast(x, src=0)), count * _F32
    if op == "all_gather":
        out, inp = b[:count], a[: count // n]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(out, inp)), count * _F32
    if op == "reduce_scatter":
        out, inp = b[: count // n], a[:count]
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(out, inp)), count * _F32
    if op == "all_to_all":
        ins, outs = uneven_splits(count, n, rank)
        inp, out = a[:count], b[: sum(outs)]
        return (lambda: dist.all_to_all_single(out, inp, outs, ins)), count * _F32
    raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")


def run_collectives(
    group: Group,
    *,
    ops: tuple[str, ...],
    sizes: list[int],
    budget_s: float,
    max_iters: int = 20,
) -> tuple[list[CollectiveResult], list[str]]:
    """Time each of ``ops`` over ``sizes`` (ascending) within ``budget_s`` in all; returns the
    results and what was cut.  Each op gets an equal share; a size runs only when its estimate
    (the previous size's time, scaled by the size) fits what is left of the share.  Every
    decision is taken on the slowest rank's times, which every rank agrees on."""
    results: list[CollectiveResult] = []
    cut: list[str] = []
    if group.world < 2 or not ops or not sizes:
        return results, cut
    largest = max(sizes)
    # untouched until a size uses them (zeroed then): the sizes the budget cuts cost no memory
    a = torch.empty(largest // _F32 + group.world**2, device=group.device)
    b = torch.empty_like(a)
    share = budget_s / len(ops)
    for op in ops:
        spent, per_iter, prev_size = 0.0, None, None
        for size in sizes:
            estimate = per_iter * size / prev_size if per_iter else None
            if estimate is None:  # the first size of each op always runs: warm-up, first estimate
                iters, warmup = 5, 2
            else:
                warmup = 1 if estimate > 0.05 else 2
                target = share / len(sizes)
                iters = int(min(max_iters, max(1, target / max(estimate, 1e-6))))
                room = (share - spent) / max(estimate, 1e-9) - warmup
                iters = min(iters, int(room))
                if iters < 1:
                    left = [s for s in sizes if s >= size]
                    cut.append(
                        f"{op}: {_span(left)} not run (it would not fit its {share:.1f} s share "
                        f"of the budget)"
                    )
                    break
            fn, nbytes = _op(op, size, group, a, b)
            a[: nbytes // _F32].zero_()  # zeros stay zeros: no overflow, no denormals
            t_start = time.perf_counter()
            for _ in range(warmup):
                fn()
            group.sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            group.synchronize()
            mine = (time.perf_counter() - t0) / iters
            t_iter, spent_here = group.agree_max([mine, time.perf_counter() - t_start])
            spent += spent_here
            per_iter, prev_size = t_iter, size
            algbw = nbytes / t_iter
            results.append(
                CollectiveResult(
                    op=op,
                    size_bytes=size,
                    bytes=nbytes,
                    iters=iters,
                    time_s=t_iter,
                    algbw_bytes_per_s=algbw,
                    busbw_bytes_per_s=algbw * bus_factor(op, group.world),
                )
            )
    return results, cut


def _span(sizes: list[int]) -> str:
    lo, hi = human_bytes(min(sizes)), human_bytes(max(sizes))
    return lo if lo == hi else f"{lo}..{hi}"
