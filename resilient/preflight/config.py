"""What a preflight measures and how long it may take: one keyword-only, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, replace

from resilient.preflight.collectives import OPS

__all__ = ["PreflightConfig", "DEFAULT_BUDGET_S", "QUICK_BUDGET_S", "MAX_BUDGET_S"]

DEFAULT_BUDGET_S = 45.0
QUICK_BUDGET_S = 5.0
MAX_BUDGET_S = 86400.0


@dataclass(frozen=True, kw_only=True)
class PreflightConfig:
    """``budget_s``: seconds the measurements may take in all (start-up excluded); sizes and
    repeats shrink to fit, and the report lists what was cut.  ``factor``: a rank or link whose
    figure is below ``factor`` x the median (above median / factor for a latency) is named and
    fails the check.  ``checkpoint_url``: the storage to test (None: skipped).  ``quick``: the
    subset ``Run(preflight=True)`` runs at start: store latency, one small all-reduce, pairwise
    links, memory bandwidth and device health, in a few seconds."""

    budget_s: float = DEFAULT_BUDGET_S
    factor: float = 0.7
    checkpoint_url: str | None = None
    storage_options: dict | None = None
    quick: bool = False
    min_bytes: int = 4 << 10
    max_bytes: int = 256 << 20
    ops: tuple[str, ...] = OPS

    def __post_init__(self) -> None:
        if not 0 < self.budget_s <= MAX_BUDGET_S:
            # (the process group's timeout is the budget and a grace: past about 24 days it no
            # longer fits gloo's milliseconds, an OverflowError from deep in the group's start)
            raise ValueError(
                f"--budget-s {self.budget_s}: must be a finite number > 0 of seconds, at most "
                f"{MAX_BUDGET_S:g} (a day); the default is {DEFAULT_BUDGET_S:g}"
            )
        if not 0 < self.factor < 1:
            raise ValueError(
                f"--factor {self.factor}: must be between 0 and 1 (0.7: a figure below 0.7 x the "
                f"median is named)"
            )
        if self.min_bytes < 4 or self.max_bytes < self.min_bytes:
            raise ValueError(
                f"message sizes {self.min_bytes}..{self.max_bytes} bytes: need 4 <= min <= max"
            )
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise ValueError(f"unknown collectives {unknown}; choose from {', '.join(OPS)}")
        if self.checkpoint_url is not None and not self.checkpoint_url:
            raise ValueError("--checkpoint-url is empty; give an fsspec URL or leave it out")

    @classmethod
    def quick_check(cls, **overrides: object) -> PreflightConfig:
        """The start-of-training subset (``Run(preflight=True)``)."""
        # a gate that stops training: named only at half the median (a noisy moment on a busy
        # node moves one rank's figure by 2x), and Run measures again before it refuses
        return cls(**{"budget_s": QUICK_BUDGET_S, "quick": True, "factor": 0.5, **overrides})

    def with_(self, **kw: object) -> PreflightConfig:
        return replace(self, **kw)
