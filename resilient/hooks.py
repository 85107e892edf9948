"""The hook protocol: code that runs at fixed points of a run, installed explicitly by the caller.

``Run(hooks=[...])``, ``fault_tolerant(..., hooks=[...])`` and
``resilient.launch.init_process_group(..., hooks=[...])`` call every hook, on every rank, at:

1. ``at_phase("import", None)``: whenever the entry script calls :func:`call` with it, as early as
   it likes (the reference trainer does, before building anything);
2. ``at_phase("init_process_group", None)``: in ``init_process_group``, once the heartbeat runs and
   before ``dist.init_process_group``;
3. ``at_phase("restore", run)``: in ``Run.track``, before the newest committed step is loaded;
4. ``at_step(step, run)``: before each step, before its progress heartbeat;
5. ``during_save(step, run)``: right after an asynchronous save was issued (its bytes are still
   being written).

A hook implements the methods it needs; missing ones are skipped.  Nothing in ``resilient`` looks
for hooks on its own (no environment variable, no plugin discovery): a job runs exactly the hooks
its code installs.  The chaos harness is one such hook (``resilient.chaos.faults.ChaosHook``),
installed by the reference trainer's ``--chaos PLAN`` flag.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Hook", "RunHook", "call", "PHASES"]

PHASES = ("import", "init_process_group", "restore")


@runtime_checkable
class RunHook(Protocol):
    """What a hook may implement (every method optional)."""

    def at_phase(self, phase: str, run: Any | None) -> None: ...

    def at_step(self, step: int, run: Any) -> None: ...

    def during_save(self, step: int, run: Any) -> None: ...


class Hook:
    """A convenient base class: every method does nothing."""

    def at_phase(self, phase: str, run: Any | None) -> None:
        pass

    def at_step(self, step: int, run: Any) -> None:
        pass

    def during_save(self, step: int, run: Any) -> None:
        pass


def call(hooks: Iterable[Any], method: str, *args: Any) -> None:
    """Call ``method(*args)`` on every hook that has it, in order."""
    for hook in hooks:
        fn = getattr(hook, method, None)
        if fn is not None:
            fn(*args)
