"""Configuration of the reference trainer: model presets and the training run.

One configuration system: keyword-only dataclasses validated in ``__post_init__``; presets are
functions returning a ``ModelConfig``; the CLI (``__main__.py``) is a thin layer over ``TrainConfig``.
Every check that a flag fits the model and the world runs here, before any process group exists.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

__all__ = ["ModelConfig", "TrainConfig", "PRESETS", "preset", "sizing_warnings", "ConfigError"]


class ConfigError(ValueError):
    """A flag does not fit the model, the world or the machine; the message names the flag."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level; a multiple of 64 so it never depends on the layout
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 128
    shared_expert: bool = True
    seq_len: int = 64
    rope_theta: float = 10000.0
    aux_loss_coef: float = 0.01
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")

    @property
    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        moe = self.num_experts * self.dim + self.num_experts * 3 * self.dim * self.expert_ffn_dim
        if self.shared_expert:
            moe += 3 * self.dim * self.expert_ffn_dim
        per_layer = attn + moe + 2 * self.dim
        return self.num_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim

    @property
    def active_params(self) -> int:
        inactive = (
            (self.num_experts - self.top_k) * 3 * self.dim * self.expert_ffn_dim * self.num_layers
        )
        return self.num_params - inactive


PRESETS = {
    # well under a million parameters: tests on 2 CPU cores
    "tiny": ModelConfig(),
    # tens of millions: a real CPU or small-GPU run
    "small": ModelConfig(
        dim=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=8,
        top_k=2,
        expert_ffn_dim=512,
        seq_len=256,
    ),
    # ZAYA1's shape ratios scaled down (top-1 routing over 16 experts, grouped KV heads, head dim
    # 128, no shared expert); sized for one GPU
    "zaya1-mini": ModelConfig(
        dim=1024,
        num_layers=12,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        num_experts=16,
        top_k=1,
        expert_ffn_dim=2048,
        shared_expert=False,
        seq_len=1024,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"--preset {name!r} is not a preset; choose one of {sorted(PRESETS)}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    preset: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    dp: int = 1
    ep: int = 1
    tp: int = 1
    zero: bool = False
    steps: int = 100
    save_every: int = 0  # 0: never
    memory_every: int = 0  # 0: no memory tier
    memory_commit_every: int = 1  # 0: snapshots sealed, committed only when needed
    ckpt: str | None = None
    init_from: str | None = None  # model weights to start from (a checkpoint URL), step 0
    keep_last: int = 3
    data: str | None = None  # None: the Python standard library's source files
    seed: int = 0
    global_batch: int = 8  # sequences per step, split over the dp x ep data replicas
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "auto"
    metrics: str | None = None
    micro_batch: int = 0  # sequences per forward/backward on a replica; 0: its whole share
    heartbeat_interval_s: float = 1.0
    hang_timeout_s: float | None = None  # None: calibrated from observed step times
    join_timeout_s: float = 120.0  # a rank not registered this long after the leader: DEAD
    max_failed_saves: int = 3  # consecutive failed saves before the run stops
    storage_options: dict | None = None  # for the checkpoint URL's fsspec filesystem
    fallback: bool = True  # on resume, fall back to the previous step if the newest is corrupt
    events: str | None = None  # the run's event log (default: events.jsonl in a local --ckpt)
    world_size: int | None = None  # what the launcher provides; checked against dp x ep x tp
    # check every rank first (resilient's quick preflight) and refuse to train if one fails
    preflight: bool = False

    def __post_init__(self) -> None:
        m = self.model
        for name in ("dp", "ep", "tp"):
            v = getattr(self, name)
            if v < 1:
                raise ConfigError(f"--{name} {v}: must be >= 1")
        world = self.dp * self.ep * self.tp
        if self.world_size is not None and self.world_size != world:
            raise ConfigError(
                f"--dp {self.dp} x --ep {self.ep} x --tp {self.tp} = {world} ranks, but the job has "
                f"{self.world_size} ranks (--nproc / WORLD_SIZE); make the product equal the world size"
            )
        if m.num_experts % self.ep:
            raise ConfigError(
                f"--ep {self.ep} does not divide the {m.num_experts} experts of preset {self.preset!r}; "
                f"choose an --ep that divides {m.num_experts}"
            )
        if m.num_heads % self.tp or m.num_kv_heads % self.tp:
            raise ConfigError(
                f"--tp {self.tp} does not divide the {m.num_heads} attention heads and {m.num_kv_heads} "
                f"KV heads of preset {self.preset!r}; choose a --tp that divides {m.num_kv_heads}"
            )
        if m.expert_ffn_dim % self.tp:
            raise ConfigError(
                f"--tp {self.tp} does not divide the expert FFN width {m.expert_ffn_dim}"
            )
        if self.global_batch < 1:
            raise ConfigError(f"--global-batch {self.global_batch}: must be >= 1 sequence per step")
        if self.keep_last < 1:
            raise ConfigError(
                f"--keep-last {self.keep_last}: must be >= 1 (the newest committed steps kept)"
            )
        for flag, v, ok, what in (
            ("--lr", self.lr, self.lr >= 0, ">= 0 (0: the weights stay as loaded)"),
            ("min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("--warmup-steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0"),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0"),
            ("grad_clip", self.grad_clip, self.grad_clip >= 0, ">= 0 (0: no clipping)"),
        ):
            if not (ok and math.isfinite(v)):  # (NaN passes no comparison: refused here too)
                raise ConfigError(f"{flag} {v}: must be a finite number {what}")
        if self.global_batch % (self.dp * self.ep):
            raise ConfigError(
                f"--global-batch {self.global_batch} must be divisible by the {self.dp * self.ep} data "
                f"replicas (--dp {self.dp} x --ep {self.ep})"
            )
        per_replica = self.global_batch // (self.dp * self.ep)
        if self.micro_batch < 0 or (self.micro_batch and per_replica % self.micro_batch):
            raise ConfigError(
                f"--micro-batch {self.micro_batch} must divide the {per_replica} sequences each data "
                f"replica gets per step (--global-batch {self.global_batch} / {self.dp * self.ep} "
                f"replicas); 0 uses them all at once"
            )
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"--heartbeat-interval-s {self.heartbeat_interval_s}: must be > 0")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise ConfigError(f"--hang-timeout-s {self.hang_timeout_s}: must be > 0")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"--join-timeout-s {self.join_timeout_s}: must be > 0")
        if self.max_failed_saves < 1:
            raise ConfigError(
                f"--max-failed-saves {self.max_failed_saves}: must be >= 1 (1: the first failed "
                f"save ends the run)"
            )
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: must be >= 1")
        if self.save_every < 0:
            raise ConfigError(f"--save-every {self.save_every}: must be >= 0 (0 disables saving)")
        if self.save_every and not self.ckpt:
            raise ConfigError(f"--save-every {self.save_every} needs --ckpt URL to save to")
        if self.memory_every < 0:
            raise ConfigError(
                f"--memory-every {self.memory_every}: must be >= 0 (0 turns the memory tier off)"
            )
        if self.memory_commit_every < 0:
            raise ConfigError(
                f"--memory-commit-every {self.memory_commit_every}: must be >= 0 (1 commits "
                f"every snapshot, 0 only when a restore, a flush or a durable save needs it)"
            )
        if self.memory_every and not self.ckpt:
            raise ConfigError(
                f"--memory-every {self.memory_every} needs --ckpt URL (the memory tier belongs to "
                f"a checkpoint URL, and the final step is committed there)"
            )
        if self.data is not None and not os.path.exists(self.data):
            raise ConfigError(
                f"--data {self.data}: no such file or directory; give a text file or a directory of them"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: one of auto, cpu, cuda")

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.tp

    @property
    def data_replicas(self) -> int:
        return self.dp * self.ep

    @property
    def micro_batches(self) -> int:
        """Forward/backward passes per step on each replica (gradient accumulation)."""
        per_replica = self.global_batch // self.data_replicas
        return per_replica // self.micro_batch if self.micro_batch else 1

    def with_(self, **kw) -> TrainConfig:
        return replace(self, **kw)


def sizing_warnings(m: ModelConfig, tp: int, *, on_gpu: bool, tokens_per_rank: int) -> list[str]:
    """MI300X-aware sizing rules (they hold for recent NVIDIA parts too); never fatal."""
    out = []
    if m.head_dim not in (64, 128):
        out.append(
            f"head_dim {m.head_dim}: attention kernels are fastest at 64 or 128; set head_dim to 64 or 128"
        )
    for name, width in (("dim", m.dim), ("expert_ffn_dim", m.expert_ffn_dim)):
        if (width // tp) % 64:
            out.append(
                f"{name} {width} / tp {tp} = {width // tp} per rank is not a multiple of 64; "
                f"pick {name} so that {name} / tp is a multiple of 64 (GEMM tiles)"
            )
    if on_gpu:
        smallest = min(m.dim, m.expert_ffn_dim // tp, m.num_heads // tp * m.head_dim)
        if smallest < 1024 or tokens_per_rank < 4096:
            out.append(
                f"GEMM dims (smallest {smallest}, {tokens_per_rank} tokens per rank) are too small "
                f"to fill the GPU; raise dim / expert_ffn_dim or the tokens per rank (global batch x seq_len)"
            )
    return out
