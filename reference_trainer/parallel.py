"""How the model is split: process groups, the placement table, and the collectives.

Axes (dp, ep, tp), world = dp x ep x tp, rank-major with tp fastest (resilient.Layout):

* tensor parallel (Megatron): column-parallel wq, fused wkv and fused gate/up; row-parallel wo and
  down projections; heads and FFN width split over tp.  ``copy_to_tp`` (identity forward, all-reduce
  backward) enters a tp region and ``reduce_from_tp`` (all-reduce forward, identity backward)
  leaves it.
* expert parallel: experts split over ep; tokens go to their experts with an all-to-all of uneven
  sizes (dropless) and come back the same way.
* data parallel: dense weights are replicated over dp x ep (every ep rank reads its own data), expert
  weights over dp; gradients are averaged over each parameter's replica group.
* ZeRO-1 (``--zero``): each parameter's optimizer state is split over its data-parallel replicas
  along one dim the model axes do not split; updated slices are all-gathered after the step.

``PLACEMENTS`` is the one table from parameter names to placements; the checkpointer reads it from
the parameters (resilient.sharded), so every checkpoint records how each tensor is split.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reference_trainer.optim import AdamW
from resilient import Layout, Shard, sharded
from resilient.layout import chunk_offsets_sizes, normalize_placement

__all__ = [
    "ParallelContext",
    "PLACEMENTS",
    "placement_of",
    "is_expert",
    "Timers",
    "copy_to_tp",
    "reduce_from_tp",
    "all_to_all",
    "sync_gradients",
    "clip_grad_norm",
    "ZeroAdamW",
]

PLACEMENTS: list[tuple[str, dict]] = [
    (r"embed\.weight", {}),
    (r"layers\.\d+\.(attn_norm|moe_norm)\.weight", {}),
    (r"layers\.\d+\.attn\.wq\.weight", {"tp": Shard(0)}),
    (r"layers\.\d+\.attn\.wkv\.weight", {"tp": Shard(0, parts=2)}),  # fused k, v
    (r"layers\.\d+\.attn\.wo\.weight", {"tp": Shard(1)}),
    (r"layers\.\d+\.moe\.router\.weight", {}),
    (r"layers\.\d+\.moe\.w_gate_up", {"ep": Shard(0), "tp": Shard(1, parts=2)}),  # [E, 2F, D]
    (r"layers\.\d+\.moe\.w_down", {"ep": Shard(0), "tp": Shard(2)}),  # [E, D, F]
    (r"layers\.\d+\.moe\.shared_gate_up\.weight", {"tp": Shard(0, parts=2)}),
    (r"layers\.\d+\.moe\.shared_down\.weight", {"tp": Shard(1)}),
    (r"norm\.weight", {}),
    (r"lm_head\.weight", {}),
]


def placement_of(name: str) -> dict:
    for pattern, placement in PLACEMENTS:
        if re.fullmatch(pattern, name):
            return placement
    raise KeyError(
        f"parameter {name!r} has no entry in the placement table (reference_trainer/parallel.py)"
    )


def is_expert(name: str) -> bool:
    return "ep" in placement_of(name)


class Timers:
    """Seconds spent per kind of work in the current step (compute is what is left)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, kind: str, t0: float) -> None:
        self.seconds[kind] += time.perf_counter() - t0

    def reset(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


@dataclass
class ParallelContext:
    """The process groups of one rank, built from the layout (the same on every rank)."""

    layout: Layout
    rank: int
    tp_group: object | None = None
    ep_group: object | None = None
    dp_group: object | None = None
    dense_dp_group: object | None = None  # dp x ep: the replicas of a dense weight
    mesh: object | None = None
    timers: Timers = field(default_factory=Timers)

    @property
    def tp(self) -> int:
        return self.layout.size("tp")

    @property
    def ep(self) -> int:
        return self.layout.size("ep")

    @property
    def dp(self) -> int:
        return self.layout.size("dp")

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def data_replica(self) -> int:
        """Which slice of the global batch this rank reads (tp ranks share one)."""
        c = self.coords
        return c["dp"] * self.ep + c["ep"]

    @classmethod
    def single(cls) -> ParallelContext:
        return cls(Layout(dp=1, ep=1, tp=1), 0)

    @classmethod
    def create(cls, dp: int, ep: int, tp: int, device_type: str) -> ParallelContext:
        """Build the DeviceMesh (dp, ep, tp) and the groups; every rank must call this."""
        layout = Layout(dp=dp, ep=ep, tp=tp)
        layout.check_world_size(dist.get_world_size())
        ctx = cls(layout, dist.get_rank())
        ctx.regroup(device_type)
        return ctx

    def regroup(self, device_type: str) -> None:
        """(Re)build this rank's mesh and groups in the current default process group, in place:
        what holds this context (the model's layers, ZeRO's optimizer) uses the new groups.
        In-job recovery calls it after forming the next generation of the group (the same rank,
        the same layout); every rank must call it, in the same order as ``create``."""
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.layout
        layout.check_world_size(dist.get_world_size())
        if dist.get_rank() != self.rank:
            raise RuntimeError(
                f"regroup: this context is rank {self.rank}'s, the group says {dist.get_rank()}"
            )
        mesh = init_device_mesh(
            device_type, (layout.size("dp"), layout.size("ep"), layout.size("tp")),
            mesh_dim_names=("dp", "ep", "tp"),
        )  # fmt: skip
        self.mesh = mesh
        self.tp_group, self.ep_group = mesh.get_group("tp"), mesh.get_group("ep")
        self.dp_group = mesh.get_group("dp")
        # dp x ep flattened: new_group must be called by every rank for every group, in order.
        tp, dp, ep = layout.size("tp"), layout.size("dp"), layout.size("ep")
        for t in range(tp):
            ranks = [layout.rank({"dp": d, "ep": e, "tp": t}) for d in range(dp) for e in range(ep)]
            g = dist.new_group(ranks)
            if self.coords["tp"] == t:
                self.dense_dp_group = g

    def drop_groups(self) -> None:
        """Let go of the mesh and the groups (broken ones: in-job recovery frees them before it
        forms the next generation; ``regroup`` makes new ones)."""
        self.mesh = self.tp_group = self.ep_group = self.dp_group = self.dense_dp_group = None

    def replica_group(self, name: str) -> tuple[object | None, int]:
        """The data-parallel replica group of a parameter, and its size."""
        if is_expert(name):
            return self.dp_group, self.dp
        return self.dense_dp_group, self.dp * self.ep

    def annotate(self, name: str, param: torch.Tensor, global_shape: tuple[int, ...]) -> None:
        sharded(param, placement_of(name), global_shape=global_shape)


# --- collectives with autograd ----------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timers):
        ctx.group, ctx.timers = group, timers
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        t0 = time.perf_counter()
        dist.all_reduce(g, group=ctx.group)
        ctx.timers.add("all_reduce", t0)
        return g, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timers):
        x = x.contiguous().clone()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        timers.add("all_reduce", t0)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def copy_to_tp(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    return x if pc.tp == 1 else _CopyToTP.apply(x, pc.tp_group, pc.timers)


def reduce_from_tp(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    return x if pc.tp == 1 else _ReduceFromTP.apply(x, pc.tp_group, pc.timers)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group, timers):
        ctx.group, ctx.send_sizes, ctx.recv_sizes, ctx.timers = (
            group,
            send_sizes,
            recv_sizes,
            timers,
        )
        out = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        timers.add("all_to_all", t0)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.send_sizes),) + tuple(g.shape[1:]))
        t0 = time.perf_counter()
        dist.all_to_all_single(out, g.contiguous(), ctx.send_sizes, ctx.recv_sizes, group=ctx.group)
        ctx.timers.add("all_to_all", t0)
        return out, None, None, None, None


def all_to_all(
    x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], pc: ParallelContext
) -> torch.Tensor:
    """Rows of ``x`` go to the ep ranks in ``send_sizes`` order; returns the rows received."""
    return _AllToAll.apply(x, send_sizes, recv_sizes, pc.ep_group, pc.timers)


def exchange_counts(counts: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """``counts[j, e]``: rows this rank sends to ep rank j's local expert e -> rows it receives."""
    out = torch.empty_like(counts)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, counts.contiguous(), group=pc.ep_group)
    pc.timers.add("all_to_all", t0)
    return out


# --- gradients ----------------------------------------------------------------------------------


def sync_gradients(model: torch.nn.Module, pc: ParallelContext) -> None:
    """Average each gradient over its parameter's data-parallel replicas (one bucket per group)."""
    buckets: dict[int, list[torch.Tensor]] = defaultdict(list)
    groups = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        group, size = pc.replica_group(name)
        if size > 1:
            buckets[id(group)].append(p.grad)
            groups[id(group)] = group
    scale = 1.0 / (pc.dp * pc.ep)  # every loss is a mean over one replica's tokens
    t0 = time.perf_counter()
    for gid, grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=groups[gid])
        flat.mul_(scale)
        pos = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[pos : pos + n].view_as(g))
            pos += n
    pc.timers.add("all_reduce", t0)
    if pc.dp * pc.ep > 1:
        # expert weights of an ep-only job have no replica group, yet their loss scale is the same
        for name, p in model.named_parameters():
            if pc.replica_group(name)[1] == 1:
                p.grad.mul_(scale)


def model_parallel_replicas(name: str, pc: ParallelContext) -> int:
    """How many ranks of one dp coordinate (the tp x ep ranks) hold the same slice of ``name``."""
    placement = placement_of(name)
    n = 1
    for axis in ("ep", "tp"):
        if axis not in placement:
            n *= pc.layout.size(axis)
    return n


def clip_grad_norm(model: torch.nn.Module, max_norm: float, pc: ParallelContext) -> float:
    """Clip by the global gradient norm of the whole model, counting every element once."""
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for name, p in model.named_parameters():
        total += p.grad.detach().double().pow(2).sum() / model_parallel_replicas(name, pc)
    if pc.tp * pc.ep > 1:
        t0 = time.perf_counter()
        # every dp coordinate holds the same averaged gradients, so the tp x ep ranks suffice;
        # summing over the whole world and dividing by dp is the same and needs no extra group
        dist.all_reduce(total)
        total /= pc.dp
        pc.timers.add("all_reduce", t0)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in model.parameters():
            p.grad.mul_(coef)
    return norm


# --- ZeRO-1 ---------------------------------------------------------------------------------------


def zero_dim(name: str, shape: torch.Size) -> int:
    """The dim ZeRO splits: the first one the model axes (tp, ep) leave whole."""
    taken = {p.dim for p in placement_of(name).values()}
    for d in range(len(shape)):
        if d not in taken:
            return d
    raise ValueError(f"parameter {name!r}: every dim is split by tp/ep; ZeRO needs one left whole")


@dataclass
class _ZeroEntry:
    name: str
    param: torch.Tensor
    master: torch.Tensor  # fp32 copy of this rank's slice: what the inner AdamW steps
    dim: int  # the dim ZeRO splits
    slices: list[tuple[int, int]]  # (offset, size) of every replica's slice, in group-rank order
    index: int  # this rank's place in ``slices``
    group: object | None

    @property
    def mine(self) -> tuple[int, int]:
        return self.slices[self.index]


class ZeroAdamW:
    """AdamW whose state is split over each parameter's data-parallel replicas (ZeRO stage 1).

    Each rank keeps fp32 master slices of its part of every parameter (torch.chunk semantics along
    ``zero_dim``, so uneven dp sizes work), steps an AdamW (``reference_trainer.optim``, torch's
    arithmetic) on them with the matching slices of the averaged gradients, writes the slices back
    and all-gathers them.  ``state_dict()`` uses
    the same keys as a plain AdamW keyed by parameter name, with each state tensor annotated as its
    parameter's placement plus the replica axes on ``zero_dim``; a checkpoint therefore moves
    between ZeRO and plain AdamW, and between dp sizes, like any other sharded tensor.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pc: ParallelContext,
        param_groups: list[dict],
        *,
        key_prefix: str = "model.",
        **adamw,
    ) -> None:
        # state keys match what the checkpointer gives a plain optimizer: the parameter's path in
        # the saved state (the model is saved under "model")
        self.pc, self.key_prefix = pc, key_prefix
        self.entries: list[_ZeroEntry] = []
        names = {id(p): n for n, p in model.named_parameters()}
        layout, coords = pc.layout, pc.coords
        groups = []
        for g in param_groups:
            masters = []
            for p in g["params"]:
                name = names[id(p)]
                group, _ = pc.replica_group(name)
                d = zero_dim(name, p.shape)
                placement = dict(placement_of(name))
                replica_axes = ["dp"] if is_expert(name) else ["dp", "ep"]
                for axis in replica_axes:
                    placement[axis] = Shard(d)
                global_shape = tuple(p._resilient_sharding.global_shape)
                norm = normalize_placement(placement, layout)
                # the replicas in group-rank order (ascending global rank), and each one's slice
                members = [
                    r
                    for r in range(layout.world_size)
                    if all(
                        layout.coords(r)[a] == coords[a]
                        for a in layout.names
                        if a not in replica_axes
                    )
                ]
                slices = [
                    (o[d], s[d])
                    for o, s in (
                        chunk_offsets_sizes(global_shape, norm, layout, r) for r in members
                    )
                ]
                index = members.index(pc.rank)
                off, n = slices[index]
                master = torch.nn.Parameter(p.detach().narrow(d, off, n).clone().float())
                sharded(master, placement, global_shape=global_shape)
                self.entries.append(_ZeroEntry(name, p, master, d, slices, index, group))
                masters.append(master)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        self.inner = AdamW(groups, **adamw)
        self.param_groups = self.inner.param_groups

    def step(self) -> None:
        for e in self.entries:
            off, n = e.mine
            e.master.grad = e.param.grad.narrow(e.dim, off, n).float()
        self.inner.step()
        t0 = time.perf_counter()
        with torch.no_grad():
            for e in self.entries:
                p, d = e.param, e.dim
                if len(e.slices) == 1:
                    p.copy_(e.master.to(p.dtype))
                    continue
                # all_gather needs equal sizes: pad every slice to the largest one
                pad_shape = list(p.shape)
                pad_shape[d] = max(n for _, n in e.slices)
                mine = e.master.new_zeros(pad_shape)
                mine.narrow(d, 0, e.master.shape[d]).copy_(e.master)
                parts = [torch.empty_like(mine) for _ in e.slices]
                dist.all_gather(parts, mine, group=e.group)
                full = torch.cat([part.narrow(d, 0, n) for part, (_, n) in zip(parts, e.slices)], d)
                p.copy_(full.to(p.dtype))
        self.pc.timers.add("all_gather", t0)

    def regroup(self) -> None:
        """Take each slice's replica group again from the context (after its ``regroup``)."""
        for e in self.entries:
            e.group = self.pc.replica_group(e.name)[0]

    def drop_groups(self) -> None:
        for e in self.entries:
            e.group = None

    def reset(self) -> None:
        """Forget the AdamW state and take the master slices from the weights again: what a new
        ZeroAdamW of the same model would hold."""
        self.inner.state.clear()
        with torch.no_grad():
            for e in self.entries:
                off, n = e.mine
                e.master.copy_(e.param.detach().narrow(e.dim, off, n).float())
                e.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (what the loop accumulates into) and the slices'."""
        self.inner.zero_grad(set_to_none=set_to_none)
        for e in self.entries:
            e.param.grad = None

    def state_dict(self) -> dict:
        self._ensure_state()
        state = {}
        for e in self.entries:
            st = state[self.key_prefix + e.name] = dict(self.inner.state[e.master])
            spec = e.master._resilient_sharding
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.shape == e.master.shape:
                    sharded(v, spec.placement, global_shape=spec.global_shape)
        # keyed by index, so the keys are those of a plain optimizer: optim.param_groups.0.lr
        groups = {
            str(i): {k: v for k, v in g.items() if k != "params"}
            for i, g in enumerate(self.inner.param_groups)
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        """State tensors were filled in place; refresh the master slices from the loaded weights."""
        for e in self.entries:
            st = self.inner.state[e.master]
            for k, v in sd["state"][self.key_prefix + e.name].items():
                if st.get(k) is not v:
                    st[k] = v
            off, n = e.mine
            with torch.no_grad():
                e.master.copy_(e.param.detach().narrow(e.dim, off, n).float())
        for i, g in enumerate(self.inner.param_groups):
            g.update({k: v for k, v in sd["param_groups"][str(i)].items() if k != "params"})

    def _ensure_state(self) -> None:
        self.inner.init_state()
