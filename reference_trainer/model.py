"""A decoder-only MoE transformer, written against its rank-local shapes.

What the model is; how it is split lives in parallel.py (the placement table and collectives).
Shapes in comments are local: H = heads / tp, KV = kv heads / tp, F = expert FFN width / tp,
El = experts / ep; B batch, T sequence, D model dim, N = B * T tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import threading
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from reference_trainer.config import ModelConfig
from reference_trainer.parallel import (
    ParallelContext,
    all_to_all,
    copy_to_tp,
    exchange_counts,
    placement_of,
    reduce_from_tp,
)
from resilient.checkpoint.state import shard_of

__all__ = ["MoETransformer", "global_shapes", "init_parameters"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, T, heads, hd): rotate each (first half, second half) pair by its position angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelContext) -> None:
        super().__init__()
        self.pc, self.hd = pc, cfg.head_dim
        self.h, self.kv = cfg.num_heads // pc.tp, cfg.num_kv_heads // pc.tp
        self.wq = nn.Linear(cfg.dim, self.h * self.hd, bias=False)  # column-parallel
        self.wkv = nn.Linear(
            cfg.dim, 2 * self.kv * self.hd, bias=False
        )  # fused [k; v], column-parallel
        self.wo = nn.Linear(self.h * self.hd, cfg.dim, bias=False)  # row-parallel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        xi = copy_to_tp(x, self.pc)  # (B, T, D)
        q = self.wq(xi).view(B, T, self.h, self.hd)  # (B, T, H, hd)
        k, v = self.wkv(xi).view(B, T, 2, self.kv, self.hd).unbind(2)  # (B, T, KV, hd) each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.h // self.kv  # grouped KV: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # (B, T, H, hd)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(B, T, self.h * self.hd)  # (B, T, H*hd)
        return reduce_from_tp(self.wo(out), self.pc)  # (B, T, D), summed over tp


class MoE(nn.Module):
    """Top-k router, dropless expert parallelism over ep, SwiGLU experts, optional shared expert."""

    def __init__(self, cfg: ModelConfig, pc: ParallelContext) -> None:
        super().__init__()
        self.pc, self.cfg = pc, cfg
        self.E, self.El, self.F = (
            cfg.num_experts,
            cfg.num_experts // pc.ep,
            cfg.expert_ffn_dim // pc.tp,
        )
        self.router = nn.Linear(cfg.dim, self.E, bias=False)  # replicated
        self.w_gate_up = nn.Parameter(
            torch.empty(self.El, 2 * self.F, cfg.dim)
        )  # (El, 2F, D) [gate; up]
        self.w_down = nn.Parameter(torch.empty(self.El, cfg.dim, self.F))  # (El, D, F)
        if cfg.shared_expert:
            self.shared_gate_up = nn.Linear(cfg.dim, 2 * self.F, bias=False)
            self.shared_down = nn.Linear(self.F, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, D = x.shape
        k, pc = self.cfg.top_k, self.pc
        probs = self.router(x).float().softmax(-1)  # (N, E); on x: a replicated computation
        weights, experts = probs.topk(k, dim=-1)  # (N, k)
        if k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(experts.reshape(-1), minlength=self.E)  # (E,)
        # load balancing (Switch): E * sum_e (fraction of assignments to e) * (mean prob of e)
        aux = self.E * (counts.float() / (N * k) * probs.mean(0)).sum()

        xi = copy_to_tp(x, pc)
        flat = experts.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token = order // k
        send = xi[token]  # (N*k, D), expert-major
        if pc.ep > 1:
            by_rank = counts.view(pc.ep, self.El)  # rows for ep rank j's local expert e
            recv_counts = exchange_counts(by_rank, pc)  # (ep, El): rows from rank j for my expert e
            send_sizes, recv_sizes = by_rank.sum(1).tolist(), recv_counts.sum(1).tolist()
            recv = all_to_all(send, send_sizes, recv_sizes, pc)  # (M, D), source-major
            expert_of = (
                torch.arange(self.El, device=x.device)
                .repeat(pc.ep)
                .repeat_interleave(recv_counts.reshape(-1))
            )
            perm = torch.argsort(expert_of, stable=True)  # source-major -> expert-major
            xe, per_expert = recv[perm], recv_counts.sum(0).tolist()
        else:
            xe, per_expert = send, counts.tolist()
        outs, pos = [], 0
        for e, n in enumerate(per_expert):  # SwiGLU per local expert
            gate, up = (xe[pos : pos + n] @ self.w_gate_up[e].t()).chunk(2, dim=-1)  # (n, F) each
            outs.append((F.silu(gate) * up) @ self.w_down[e].t())  # (n, D), partial over tp
            pos += n
        ye = torch.cat(outs) if outs else xe.new_zeros(0, D)
        if pc.ep > 1:
            back = torch.empty_like(perm)
            back[perm] = torch.arange(len(perm), device=perm.device)
            ye = all_to_all(ye[back], recv_sizes, send_sizes, pc)  # (N*k, D), expert-major again
        # reduce over tp before weighting, so that the router's gradient is whole on every tp rank
        ye = reduce_from_tp(ye, pc)
        w = weights.reshape(-1)[order].unsqueeze(-1).to(ye.dtype)
        # in the residual stream's dtype: under autocast the experts' matmuls give bf16, x is fp32
        out = torch.zeros_like(x).index_add(0, token, (ye * w).to(x.dtype))  # (N, D)
        if self.cfg.shared_expert:
            gate, up = self.shared_gate_up(xi).chunk(2, dim=-1)
            out = out + reduce_from_tp(self.shared_down(F.silu(gate) * up), pc)
        return out, aux


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelContext) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, pc)
        self.moe_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg, pc)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        B, T, D = x.shape
        h, aux = self.moe(self.moe_norm(x).reshape(B * T, D))
        return x + h.view(B, T, D), aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelContext) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, pc) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # (on the CPU even where the model is built on the meta device for its shapes: meta
        # arithmetic runs through torch's Python decompositions, see _shapes_only)
        steps = torch.arange(0, cfg.head_dim, 2, device="cpu").float()
        inv = 1.0 / cfg.rope_theta ** (steps / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.seq_len, device="cpu").float(), inv)  # (T, hd/2)
        self.register_buffer(
            "cos", angles.cos()[None, :, None, :], persistent=False
        )  # (1, T, 1, hd/2)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = tokens.shape
        x = self.embed(tokens)  # (B, T, D)
        cos, sin = self.cos[:, :T].to(x.dtype), self.sin[:, :T].to(x.dtype)
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, a = layer(x, cos, sin)
            aux = aux + a
        return self.lm_head(self.norm(x)), aux / len(self.layers)  # (B, T, V), ()


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the unsplit model (never depend on the layout)."""
    with torch.device("meta"), _shapes_only():
        m = MoETransformer(cfg, ParallelContext.single())
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


_SHAPES_ONLY_LOCK = threading.Lock()


@contextlib.contextmanager
def _shapes_only() -> Iterator[None]:
    """torch's modules skip their initialisers while a model is built only for its shapes: a
    random fill of a meta tensor runs through torch's Python decompositions, whose first call
    imports torch._dynamo (about a second of CPU, in every process).  One build at a time (the
    lock), and no other thread may build modules meanwhile: the trainer builds them on its main
    thread only."""
    with _SHAPES_ONLY_LOCK:
        saved = [(cls, cls.__dict__["reset_parameters"]) for cls in (nn.Linear, nn.Embedding)]
        for cls, _ in saved:
            cls.reset_parameters = _no_init  # type: ignore[method-assign]
        try:
            yield
        finally:
            for cls, fn in saved:
                cls.reset_parameters = fn  # type: ignore[method-assign]


def _no_init(self: nn.Module) -> None:
    pass


def init_parameters(model: MoETransformer, pc: ParallelContext, seed: int) -> None:
    """Initialise each parameter as a slice of one deterministic global tensor.

    Every layout therefore starts from the same global weights.  Each parameter is annotated with
    its placement and global shape for the checkpointer.
    """
    cfg = model.cfg
    shapes = global_shapes(cfg)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = shapes[name]
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                full = torch.ones(shape)
            else:
                std = 0.02 * (
                    out_scale if any(s in name for s in ("wo.", "w_down", "shared_down")) else 1.0
                )
                full = torch.randn(shape, generator=g) * std
            p.copy_(shard_of(full, placement_of(name), pc.layout, pc.rank))
            pc.annotate(name, p, shape)
