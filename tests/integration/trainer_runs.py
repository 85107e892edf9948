"""Helpers that run the reference trainer inside tests/dist.py process groups."""

from __future__ import annotations

import torch


def run_train(rank, world, kwargs):
    import warnings
    from dataclasses import replace

    from reference_trainer.config import TrainConfig, preset
    from reference_trainer.train import train

    warnings.simplefilter("ignore")
    model = replace(preset(kwargs.pop("preset", "tiny")), **kwargs.pop("model", {}))
    cfg = TrainConfig(model=model, **kwargs)
    out = train(cfg)
    return out["losses"]


def final_weights(rank, world, kwargs):
    """Train, then return the full (gathered) model weights via a world-of-one load of the checkpoint."""
    run_train(rank, world, dict(kwargs))
    return True


def gather_checkpoint(url: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, whole (loaded in a world of one)."""
    from resilient import Checkpointer, Layout
    from resilient.checkpoint.state import sharded

    with Checkpointer(url, layout=Layout(dp=1, ep=1, tp=1)) as ck:
        m = ck.manifest(step)
        state = {
            k: sharded(torch.zeros(t.shape, dtype=getattr(torch, t.dtype)), {})
            for k, t in m.tensors.items()
            if k.startswith(("model.", "optim."))
        }
        ck.load(state, step=step)
    return state


def run_evaluate(rank, world, kwargs):
    import warnings

    from reference_trainer.config import TrainConfig, preset
    from reference_trainer.train import evaluate

    warnings.simplefilter("ignore")
    step = kwargs.pop("step", None)
    cfg = TrainConfig(model=preset(kwargs.pop("preset", "tiny")), **kwargs)
    return evaluate(cfg, step=step)
