"""Helpers that run the reference trainer inside tests/dist.py process groups."""

from __future__ import annotations

from resilient.chaos.verify import gather_checkpoint  # noqa: F401  (the tests import it from here)


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


def refused_config(rank, world, kwargs):
    """``run_train`` with ``data_by_rank[rank]`` as this rank's --data; returns the ConfigError's
    message, or the losses where the run was not refused."""
    from reference_trainer.config import ConfigError

    kwargs = dict(kwargs)
    kwargs["data"] = kwargs.pop("data_by_rank")[rank]
    try:
        return run_train(rank, world, kwargs)
    except ConfigError as e:
        return str(e)


def final_weights(rank, world, kwargs):
    """Train, then return the full (gathered) model weights via a world-of-one load of the checkpoint."""
    run_train(rank, world, dict(kwargs))
    return True


def run_evaluate(rank, world, kwargs):
    import warnings

    from reference_trainer.config import TrainConfig, preset
    from reference_trainer.train import evaluate

    warnings.simplefilter("ignore")
    step = kwargs.pop("step", None)
    cfg = TrainConfig(model=preset(kwargs.pop("preset", "tiny")), **kwargs)
    return evaluate(cfg, step=step)
