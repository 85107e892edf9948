"""AdamW for the reference trainer: torch's AdamW arithmetic, held without ``torch.optim.Optimizer``.

``torch.optim.AdamW`` imports ``torch._dynamo`` in its constructor (``add_param_group`` is wrapped
to be skipped by the compiler) and at every ``step`` (graph breaks), for the sake of
``torch.compile``, which this trainer does not use.  That import costs about a second of CPU in
every process (more than the rest of a tiny preset's start-up, and a restarted rank pays it again
before its first step).  This class keeps the same state and steps it through torch's own
functional ``torch.optim.adamw.adamw`` (on torch >= 2.7, ``adam(..., decoupled_weight_decay=True)``,
the call ``AdamW.step`` makes) with the arguments ``AdamW.step`` passes, so a run is bit for bit
the same as with ``torch.optim.AdamW``.

``state_dict()`` has the keys the checkpointer gives a ``torch.optim.AdamW`` (``state.<parameter
name>.<step|exp_avg|exp_avg_sq>``, ``param_groups.<i>.<hyperparameter>``, the same
hyperparameters), and state tensors carry their parameter's ``sharded`` annotation, so checkpoints
move between this class, ``torch.optim.AdamW`` and ZeRO-1 (``ZeroAdamW``), in any layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw

from resilient.checkpoint.state import sharded
from resilient.errors import StateMismatchError

__all__ = ["AdamW", "ADAMW_DEFAULTS"]

# torch.optim.AdamW's hyperparameters and defaults: every group carries all of them (a checkpoint
# saves them, and one from torch's AdamW loads here)
ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
# torch >= 2.7 (AdamW became Adam with decoupled weight decay) keeps this in every group too
if "decoupled_weight_decay" in inspect.signature(adam).parameters:
    ADAMW_DEFAULTS["decoupled_weight_decay"] = True
_UNSUPPORTED = ("capturable", "fused", "differentiable")


class AdamW:
    """``torch.optim.AdamW(param_groups, **hyperparameters)`` for eager training: ``param_groups``
    (dicts with ``params`` and any hyperparameter), ``state`` (parameter -> its state, created at
    its first step, or by ``init_state``), ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict``.  ``names`` maps each parameter to its key in the checkpoint (``model.`` and
    its name in the module), which ``state_dict`` needs.  Not supported: ``capturable``, ``fused``
    and ``differentiable`` (CUDA graphs, fused kernels, differentiating through the step), closures
    and hooks."""

    def __init__(
        self,
        param_groups: Iterable[Mapping[str, Any]],
        *,
        names: Mapping[torch.Tensor, str] | None = None,
        **hyperparameters: Any,
    ) -> None:
        unknown = set(hyperparameters) - set(ADAMW_DEFAULTS)
        if unknown:
            raise TypeError(f"AdamW: unknown hyperparameter(s) {sorted(unknown)}")
        defaults = {**ADAMW_DEFAULTS, **hyperparameters}
        self.param_groups: list[dict[str, Any]] = []
        for g in param_groups:
            group = {**defaults, **{k: v for k, v in g.items() if k != "params"}}
            for flag in _UNSUPPORTED:
                if group[flag]:
                    raise ValueError(f"AdamW: {flag}=True is not supported; use torch.optim.AdamW")
            group["params"] = list(g["params"])
            self.param_groups.append(group)
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.names = dict(names) if names is not None else None

    def _state_of(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``p``'s state, created as ``torch.optim.AdamW`` creates it at the first step: ``step``
        a scalar on the CPU (capturable and fused off), the averages zeros like ``p``."""
        st = self.state.get(p)
        if st:
            return st
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        st = {"step": torch.tensor(0.0, dtype=scalar, device="cpu")}
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        spec = getattr(p, "_resilient_sharding", None)
        for k in keys:
            st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if spec is not None:  # the parameter's chunk of the global tensor: so is its state
                sharded(
                    st[k],
                    spec.placement,
                    global_shape=spec.global_shape,
                    layout=spec.layout,
                    rank=spec.rank,
                )
        self.state[p] = st
        return st

    def init_state(self) -> None:
        """Create the state (a first step's) of every parameter that trains, so that a load can
        fill it in place (a frozen one has none, as with torch's AdamW)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._state_of(p, group)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_of(p, group) for p in params]
            beta1, beta2 = group["betas"]
            adamw(  # (torch >= 2.7: adam(..., decoupled_weight_decay=True), as AdamW.step calls)
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
                [s["step"] for s in states],
                foreach=group["foreach"],
                capturable=False,
                differentiable=False,
                fused=group["fused"],
                grad_scale=None,
                found_inf=None,
                has_complex=any(torch.is_complex(p) for p in params),
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:  # (as torch's: a gradient that is a view cannot be detached in place)
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: {...}}, "param_groups": {"0": {...}, ...}}``: what the checkpointer
        makes of a ``torch.optim.AdamW`` (every parameter's state, created first if need be)."""
        if self.names is None:
            raise TypeError("AdamW.state_dict needs the parameters' names (AdamW(..., names=))")
        self.init_state()
        state = {self.names[p]: dict(st) for p, st in self.state.items()}
        groups = {
            str(i): {k: v for k, v in g.items() if k != "params"}
            for i, g in enumerate(self.param_groups)
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Take what ``state_dict()`` gave, filled in place by a load (state tensors loaded into
        new objects, and the hyperparameters, are taken as they are)."""
        if self.names is None:
            raise TypeError(
                "AdamW.load_state_dict needs the parameters' names (AdamW(..., names=))"
            )
        for p, st in self.state.items():
            for k, v in sd["state"][self.names[p]].items():
                if st.get(k) is not v:
                    st[k] = v
        groups = [
            {k: v for k, v in sd["param_groups"][str(i)].items() if k != "params"}
            for i in range(len(self.param_groups))
        ]
        for i, g in enumerate(groups):
            wrong = [flag for flag in _UNSUPPORTED if g.get(flag)]
            if wrong:
                raise StateMismatchError(
                    f"optimizer param group {i} was saved with {wrong[0]}=True, which the "
                    f"trainer's AdamW does not do; load it into torch.optim.AdamW instead"
                )
        for g, saved in zip(self.param_groups, groups):
            g.update(saved)
