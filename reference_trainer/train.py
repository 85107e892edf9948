"""The training loop: AdamW (or ZeRO-1), warmup + cosine LR, clipping, checkpoints, metrics.

Library code: ``train(cfg)`` runs on every rank of an initialised (or launcher-provided) process
group and returns a summary.  The command line lives in ``__main__.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference_trainer.config import ConfigError, TrainConfig, sizing_warnings
from reference_trainer.data import Loader, corpus_id, load_tokens
from reference_trainer.model import MoETransformer, init_parameters
from reference_trainer.optim import AdamW
from reference_trainer.parallel import ParallelContext, ZeroAdamW, clip_grad_norm, sync_gradients
from resilient import Checkpointer, InJobRecovery, Run
from resilient.checkpoint.catalog import scan
from resilient.checkpoint.format import _short
from resilient.checkpoint.storage import Storage
from resilient.errors import StateMismatchError
from resilient.health import DetectorConfig, default_event_log
from resilient.health.events import EventLog
from resilient.launch import init_process_group
from resilient.launch.injob import generation

__all__ = ["train", "evaluate", "lr_at", "resolve_device"]

log = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """``auto``: the GPU when torch sees one (on ROCm torch.cuda is HIP), else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA or ROCm device")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2 and p is not model.embed.weight]
    rest = [
        p for _, p in model.named_parameters() if not (p.dim() >= 2 and p is not model.embed.weight)
    ]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def train(cfg: TrainConfig, *, hooks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train on every rank; resumes from the newest committed checkpoint under ``cfg.ckpt``.
    ``hooks``: ``resilient.hooks`` objects for the process group and the run (the chaos harness's,
    through ``--chaos``)."""
    device = resolve_device(cfg.device)
    events = cfg.events if cfg.events is not None else default_event_log(cfg.ckpt)
    detector = DetectorConfig(
        interval_s=cfg.heartbeat_interval_s,
        hang_timeout_s=cfg.hang_timeout_s,
        join_timeout_s=cfg.join_timeout_s,
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The corpus before the group: the same on every rank, and a hot spare of `resilient launch`
    # (held in init_process_group until it takes a rank) has it ready, as has a healthy rank
    # building its loader again after an in-job recovery.
    tokens = load_tokens(cfg.data)
    # the heartbeat starts here, before the process group: a rank stuck joining it is caught
    init_process_group(
        backend, detector=detector, event_log=events, hooks=hooks, warm_up=_warm_up_spare
    )
    # under `resilient launch` with spares, a failed peer is replaced in this process: the
    # group forms again and training goes on from the node's memory (else: re-raised)
    recovery = InJobRecovery(backend, detector=detector, event_log=events, hooks=hooks)
    kept = _Kept()  # the model and optimizer, across generations
    while True:
        try:
            return _train(cfg, device, events, hooks, recovery, tokens, kept)
        except BaseException as e:
            kept.drop_groups()  # before recovery frees the broken groups
            recovery.recover(e)  # or re-raises e


class _Kept:
    """What a healthy rank keeps from one generation of the group to the next (in-job recovery):
    its parallel context, model and optimizer, so that it neither builds nor allocates them
    again.  They are taken again only for the same rank and layout (always so in-job: the spare
    takes the failed rank) and without --init-from; the restore then overwrites every weight and
    optimizer state in place, or, where there is nothing to restore, they are initialised again
    exactly as a new build would be."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.key: tuple | None = None
        self.pc: ParallelContext | None = None
        self.model: Any = None
        self.optim: Any = None

    def take(self, key: tuple) -> bool:
        return self.key == key and self.model is not None

    def keep(self, key: tuple, pc: ParallelContext, model: Any, optim: Any) -> None:
        self.key, self.pc, self.model, self.optim = key, pc, model, optim

    def drop_groups(self) -> None:
        if self.pc is not None:
            self.pc.drop_groups()
        if isinstance(self.optim, ZeroAdamW):
            self.optim.drop_groups()


def _warm_up_spare() -> None:
    """A hot spare's warm-up before it waits for a rank: this trainer's modules are imported
    already and its optimizer never imports torch._dynamo (optim.py), which the default warm-up
    (for torch's optimizers) would: seconds of CPU taken from the ranks training beside it."""
    import resilient.checkpoint.checkpointer  # noqa: F401


def _train(
    cfg: TrainConfig,
    device: Any,
    events: Any,
    hooks: Any,
    recovery: InJobRecovery,
    tokens: np.ndarray,
    kept: _Kept,
) -> dict[str, Any]:
    """One generation of the process group: build the model (or take the previous generation's
    again), restore, train to the end."""
    cfg = cfg.with_(world_size=dist.get_world_size())
    if not gc.isenabled():  # the command line turned collection off for start-up
        # What start-up made (the imports: most of the heap) lives as long as the process: never
        # scan it again.  The model, its groups and the rest of a generation stay collectable,
        # and the collection in-job recovery runs to free the broken groups stays short.
        gc.freeze()
        gc.enable()
    key = (cfg.dp, cfg.ep, cfg.tp, cfg.zero, dist.get_world_size(), dist.get_rank())
    again = not cfg.init_from and kept.take(key)
    t_build = time.perf_counter()
    if again:  # a healthy rank after an in-job recovery: the same objects, new groups
        pc, model, optim = kept.pc, kept.model, kept.optim
        pc.regroup(device.type)
        if isinstance(optim, ZeroAdamW):
            optim.regroup()
        optim.zero_grad(set_to_none=True)  # the failed step's gradients
    else:
        kept.clear()  # let go of an old model before building a new one (not twice the memory)
        pc = ParallelContext.create(cfg.dp, cfg.ep, cfg.tp, device.type)
    rank = pc.rank
    tokens_per_rank = cfg.global_batch // cfg.data_replicas * cfg.model.seq_len
    if rank == 0 and not again:
        for w in sizing_warnings(
            cfg.model, cfg.tp, on_gpu=device.type == "cuda", tokens_per_rank=tokens_per_rank
        ):
            warnings.warn(f"sizing: {w}", stacklevel=2)

    if not again:
        model = MoETransformer(cfg.model, pc).to(device)
        init_parameters(model, pc, cfg.seed)
        if cfg.init_from and not _has_committed_step(cfg, device):
            # before the optimizer: ZeRO-1 copies the weights into its fp32 masters when it is
            # built
            _init_from(cfg, pc, model)
        groups = _param_groups(model, cfg.weight_decay)
        adamw = {"lr": cfg.lr, "betas": (0.9, 0.95), "eps": 1e-8}
        names = {p: f"model.{n}" for n, p in model.named_parameters()}  # (run.track's "model")
        optim = (
            ZeroAdamW(model, pc, groups, **adamw)
            if cfg.zero
            else AdamW(groups, names=names, **adamw)
        )
        kept.keep(key, pc, model, optim)
    (events if isinstance(events, EventLog) else EventLog(events)).write(
        "model",
        rank=rank,
        kept=again,
        pid=os.getpid(),
        build_s=round(time.perf_counter() - t_build, 4),
        generation=generation(),
    )
    loader = _loader(cfg, pc, tokens)
    corpus = corpus_id(tokens)
    _check_same_corpus(corpus, cfg, device)
    counters = {"tokens": 0}
    config = {
        "preset": cfg.preset,
        "seed": cfg.seed,
        "global_batch": cfg.global_batch,
        "model": dataclasses.asdict(cfg.model),  # what `reshape export --format hf` needs
        # which corpus (--data) the windows were drawn from, by content: None until restored
        # (a step saved before it was recorded keeps None), then this run's
        "corpus": None,
    }
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _nullcontext()
    )

    # The loop on top of resilient: restore, step, save every --save-every, stop cleanly on SIGTERM.
    run = Run(
        cfg.ckpt,
        save_every=cfg.save_every,
        memory_every=cfg.memory_every or None,
        memory_commit_every=cfg.memory_commit_every,
        keep_last=cfg.keep_last,
        layout=pc.layout,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        hang_timeout_s=cfg.hang_timeout_s,
        join_timeout_s=cfg.join_timeout_s,
        max_failed_saves=cfg.max_failed_saves,
        storage_options=cfg.storage_options,
        fallback=cfg.fallback,
        event_log=events,
        hooks=hooks,
        preflight=cfg.preflight,
        optional_values=("config.corpus",),  # (steps saved before it was recorded lack it)
    )
    recovery.attach(run)
    metrics = open_metrics(cfg.metrics) if cfg.metrics and rank == 0 else None
    losses: list[float] = []
    with run:  # on an error, the detector first gets a moment to name a failed peer
        start = run.track(model=model, optim=optim, data=loader, train=counters, config=config)
        if again and start == 0:  # nothing to restore: start as a new build would
            init_parameters(model, pc, cfg.seed)
            if isinstance(optim, ZeroAdamW):
                optim.reset()
            else:
                optim.state.clear()
        _check_resumed_config(config, cfg, start)
        _check_resumed_corpus(config, cfg, start, corpus)
        _check_resumed_position(loader, cfg, start)
        skipped = 0  # consecutive steps whose gradients were not finite
        try:
            for step in run.steps(cfg.steps):
                record = _train_step(step, cfg, pc, model, optim, loader, autocast, device)
                skipped = skipped + 1 if "skipped" in record else 0
                if skipped >= MAX_NON_FINITE_STEPS:
                    raise DivergedError(
                        f"step {step}: the gradients were not finite (loss {record['loss']}) "
                        f"{skipped} steps in a row, and no optimizer step was taken since step "
                        f"{step - skipped}; the weights stay those of that step and nothing "
                        f"non-finite was saved — lower --lr, raise --warmup-steps, or resume "
                        f"from an earlier step"
                    )
                run.report_compute(record["compute_s"] + record["optimizer_s"])
                counters["tokens"] += cfg.global_batch * cfg.model.seq_len
                losses.append(record["loss"])
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
        finally:
            if metrics is not None:
                metrics.close()
    return {"losses": losses, "start_step": start, "final_step": cfg.steps, "rank": rank}


# A step whose gradients are not finite is skipped; this many in a row end the run.
MAX_NON_FINITE_STEPS = 5


class DivergedError(RuntimeError):
    """Training diverged: the gradients stayed non-finite for MAX_NON_FINITE_STEPS steps."""


def _check_resumed_config(restored: dict[str, Any], cfg: TrainConfig, start: int) -> None:
    """A resumed run reads the samples of each step from (seed, global batch): with either
    changed, the steps after the restored one read other samples than the run it continues
    (some twice, some never).  Refused by name."""
    if start == 0:
        return
    for key, flag in (("seed", "--seed"), ("global_batch", "--global-batch")):
        was, now = restored.get(key), getattr(cfg, key)
        if was is not None and was != now:
            raise ConfigError(
                f"{flag} {now}: the checkpoint this run resumes (step {start} of {cfg.ckpt}) "
                f"was trained with {flag} {was}; resuming with another would read other "
                f"samples than the run it continues (some twice, some never) — use {flag} {was}, "
                f"or start a new run (another --ckpt)"
            )


def _data_name(cfg: TrainConfig) -> str:
    """--data as the refusals name it."""
    return cfg.data or "(the embedded default: Python's standard library)"


def _check_same_corpus(now: str, cfg: TrainConfig, device: Any) -> None:
    """Every rank reads its own --data (each node its own copy): ranks that read different text
    train on windows no one asked for (a tensor-parallel group's ranks on different tokens), and
    only some of them would refuse a resume.  The ranks compare their corpus ids (one
    all-gather of a 64-bit digest of each) and refuse alike, each naming its own corpus and the
    ranks that differ from rank 0."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(now.encode()).digest()[:8], "big", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    ids = [int(t.item()) for t in every]
    others = [r for r, d in enumerate(ids) if d != ids[0]]
    if others:
        data = _data_name(cfg)
        raise ConfigError(
            f"--data {data}: the ranks do not read the same corpus: rank(s) {others} read "
            f"another than rank 0 (this rank, {dist.get_rank()}, reads {now} tokens:digest); "
            f"every rank draws its windows from the same text — give every node the same text at "
            f"--data (the same file, byte for byte)"
        )


def _check_resumed_corpus(config: dict[str, Any], cfg: TrainConfig, start: int, now: str) -> None:
    """The windows of every step are drawn from the corpus: a run resumed on another one (another
    --data, or the same path edited) reads other samples than the run it continues.  Refused by
    name; a step saved before the corpus was recorded resumes with a warning.  Then the config
    records this run's corpus for its saves."""
    was = config.get("corpus")
    data = _data_name(cfg)
    if start and was is None:
        log.warning(
            "step %d of %s does not record which corpus it was trained on (saved by an older "
            "trainer): resuming on --data %s, unchecked",
            start,
            cfg.ckpt,
            data,
        )
    elif start and was != now:
        raise ConfigError(
            f"--data {data}: the checkpoint this run resumes (step {start} of {cfg.ckpt}) was "
            f"trained on another corpus ({_short(was)} tokens:digest, this one {now}); resuming "
            f"would draw other samples than the run it continues — give the --data it was "
            f"trained on, or start a new run (another --ckpt)"
        )
    config["corpus"] = now


def _check_resumed_position(loader: Loader, cfg: TrainConfig, start: int) -> None:
    """The loader serves its own position, which every save records as the step after the one
    saved: another (a stale or edited checkpoint) would serve the samples of other steps than
    the ones trained next, some twice, some never.  Refused by name."""
    if loader.next_step != start + 1:
        raise StateMismatchError(
            f"the checkpoint this run resumes (step {start} of {cfg.ckpt}) holds the loader "
            f"position data.next_step {loader.next_step}, expected {start + 1} (the step after "
            f"the one restored): resuming would serve the samples of step {loader.next_step} at "
            f"step {start + 1}. The checkpoint is damaged or was edited: resume from another "
            f"step, or start a new run (another --ckpt)"
        )


def open_metrics(path: str) -> Any:
    """The metrics file, to append one line per step on a fresh line: a kill can cut the
    previous attempt's last record mid-write, and a record appended to its line would be read
    as part of the cut one (a replayed step hidden from the chaos verifier's lineage)."""
    f = open(path, "a", buffering=1)
    with open(path, "rb") as r:
        size = r.seek(0, os.SEEK_END)
        if size and (r.seek(size - 1), r.read(1))[1] != b"\n":
            f.write("\n")
    return f


def _has_committed_step(cfg: TrainConfig, device: Any) -> bool:
    """Whether --ckpt holds a durable step to resume from (rank 0 looks; every rank hears the
    same answer): then --init-from is not read at all."""
    found = 0
    if cfg.ckpt and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            found = int(bool(scan(Storage(cfg.ckpt, cfg.storage_options)).steps()))
        except Exception as e:  # the restore names it, on every rank alike
            log.warning("could not list %s (%s); reading --init-from", cfg.ckpt, e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([found], dtype=torch.int64, device=device)
        dist.broadcast(flag, src=0)
        found = int(flag.item())
    return bool(found)


def _init_from(cfg: TrainConfig, pc: ParallelContext, model: torch.nn.Module) -> None:
    """Load the model weights of ``cfg.init_from`` (its newest step, any layout), after checking
    that it records the same model.  A resumed run then overwrites them with its own step."""
    from reshape.formats.hf import recorded_model_config  # only with --init-from (35 ms)

    with Checkpointer(cfg.init_from, layout=pc.layout, storage_options=cfg.storage_options) as src:
        recorded = recorded_model_config(src.manifest().extras)
        mine = dataclasses.asdict(cfg.model)
        differ = {
            k: (v, mine[k])
            for k, v in recorded.items()
            if k in mine and k not in _TRAINING_ONLY and v != mine[k]
        }
        if differ:
            raise ConfigError(
                f"--init-from {cfg.init_from} holds another model than --preset {cfg.preset}: "
                + ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in sorted(differ.items()))
                + "; choose the preset (or model) it was made for"
            )
        src.load({"model": model})


# ModelConfig fields that do not change the weights or the forward pass of the same tokens
_TRAINING_ONLY = {"seq_len", "aux_loss_coef"}


def _train_step(step, cfg, pc, model, optim, loader, autocast, device) -> dict[str, Any]:
    """One optimizer step on the global batch of ``step``; returns the metrics record."""
    t_step = time.perf_counter()
    pc.timers.reset()
    lr = lr_at(step, cfg)
    for g in optim.param_groups:
        g["lr"] = lr
    # The loader serves its own position (restored from the checkpoint); the samples it served
    # are recorded, so a chaos run can prove each was consumed exactly once.
    served = loader.next_step
    x, y = (t.to(device) for t in loader.batch(served))
    n = cfg.micro_batches
    ce_sum = aux_sum = None
    for xm, ym in zip(x.chunk(n), y.chunk(n)):  # gradient accumulation over micro-batches
        with autocast:
            logits, aux = model(xm)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ym.reshape(-1))
        loss = ce + cfg.model.aux_loss_coef * aux
        (loss / n if n > 1 else loss).backward()
        ce_d, aux_d = ce.detach() / n, aux.detach() / n
        ce_sum = ce_d if ce_sum is None else ce_sum + ce_d
        aux_sum = aux_d if aux_sum is None else aux_sum + aux_d
    ce, aux = ce_sum, aux_sum
    sync_gradients(model, pc)
    grad_norm = clip_grad_norm(model, cfg.grad_clip, pc)
    t_opt = time.perf_counter()
    # A non-finite gradient (the same global norm on every rank) is never applied: the weights
    # would be NaN from here on, and every later save would commit them as healthy steps
    finite = math.isfinite(grad_norm)
    if finite:
        optim.step()
    optim.zero_grad(set_to_none=True)
    opt_s = time.perf_counter() - t_opt
    loss, samples = _global_mean_and_samples(ce.detach(), loader.sample_ids(served), pc)
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t_step
    comm = pc.timers.reset()
    opt_s -= comm.get("all_gather", 0.0)  # ZeRO's gather happens inside step(): count it once
    return {
        "step": step,
        "loss": loss,
        "aux_loss": float(aux.detach()),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": cfg.global_batch * cfg.model.seq_len / step_s,
        "wall_time": time.time(),
        "step_s": step_s,
        "optimizer_s": opt_s,
        "compute_s": max(step_s - opt_s - sum(comm.values()), 0.0),
        **{f"{k}_s": v for k, v in comm.items()},
        "layout": {"dp": cfg.dp, "ep": cfg.ep, "tp": cfg.tp, "zero": cfg.zero},
        "data_step": served,
        "samples": samples,  # [[first id, count]] per data replica, as each one served them
        "micro_batches": n,
        **({} if finite else {"skipped": "non-finite gradients: the optimizer step was not taken"}),
    }


def evaluate(
    cfg: TrainConfig, *, step: int | None = None, batch_step: int = 1_000_000
) -> torch.Tensor:
    """Logits of the whole global batch of ``batch_step`` from the model of checkpoint ``step``.

    Loads only the model (resharded to ``cfg``'s layout if needed), runs one forward pass, and
    gathers every data replica's logits; every rank returns the full (B, T, V) tensor on the CPU.
    """
    device = resolve_device(cfg.device)
    init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = cfg.with_(world_size=dist.get_world_size())
    pc = ParallelContext.create(cfg.dp, cfg.ep, cfg.tp, device.type)
    model = MoETransformer(cfg.model, pc).to(device)
    init_parameters(model, pc, cfg.seed)
    with Checkpointer(cfg.ckpt, layout=pc.layout) as ck:
        ck.load({"model": model}, step=step)
    x, _ = _loader(cfg, pc, load_tokens(cfg.data)).batch(batch_step)
    with torch.no_grad():
        logits, _ = model(x.to(device))
    logits = logits.float().contiguous()
    if cfg.data_replicas == 1:
        return logits.cpu()
    parts = [torch.empty_like(logits) for _ in range(cfg.data_replicas)]
    dist.all_gather(parts, logits, group=pc.dense_dp_group)
    return torch.cat(parts).cpu()


def _loader(cfg: TrainConfig, pc: ParallelContext, tokens: np.ndarray) -> Loader:
    """This rank's slice of the global batches (its data replica)."""
    return Loader(
        tokens,
        seq_len=cfg.model.seq_len,
        global_batch=cfg.global_batch,
        seed=cfg.seed,
        replica=pc.data_replica,
        num_replicas=cfg.data_replicas,
    )


def _global_mean_and_samples(
    x: torch.Tensor, ids: list[int], pc: ParallelContext
) -> tuple[float, list[list[int]]]:
    """The mean of ``x`` over the data replicas (tp ranks hold the same value), and the samples
    each replica read this step, ``[first id, count]`` in replica order.

    The samples ride in the loss's all-reduce (no collective of their own): each replica fills
    its own slots, so the record is what every replica's loader served, not what rank 0's
    implies; a replica restored to another position shows as a repeated or skipped range.
    """
    first, count = (ids[0], len(ids)) if ids else (0, 0)
    n = pc.dp * pc.ep
    if n == 1:
        return float(x), [[first, count]]
    v = torch.zeros(1 + 2 * n, dtype=torch.float64, device=x.device)  # ids exact to 2**53
    v[0] = x.float()
    v[1 + 2 * pc.data_replica] = first
    v[2 + 2 * pc.data_replica] = count
    dist.all_reduce(v, group=pc.dense_dp_group)
    loss = float(v[0].float()) / n
    return loss, [[int(v[1 + 2 * r]), int(v[2 + 2 * r])] for r in range(n)]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
