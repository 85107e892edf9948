"""Sharded, asynchronous, checksummed checkpoints (format v1; see docs/FORMAT.md).

Its names are imported when first used (PEP 562): the persister process imports the modules that
read and commit files, and never torch, which the checkpointer needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resilient import _lazy

if TYPE_CHECKING:
    from resilient.checkpoint.checkpointer import Checkpointer, LoadStats, SaveHandle, SaveStats
    from resilient.checkpoint.format import FORMAT_VERSION, Manifest
    from resilient.checkpoint.reader import VerifyReport, read_manifest, verify_step
    from resilient.checkpoint.retention import committed_steps
    from resilient.checkpoint.state import sharded
    from resilient.checkpoint.storage import RetryPolicy, Storage

_WHERE = {
    "Checkpointer": "checkpointer",
    "SaveHandle": "checkpointer",
    "SaveStats": "checkpointer",
    "LoadStats": "checkpointer",
    "FORMAT_VERSION": "format",
    "Manifest": "format",
    "VerifyReport": "reader",
    "read_manifest": "reader",
    "verify_step": "reader",
    "committed_steps": "retention",
    "sharded": "state",
    "RetryPolicy": "storage",
    "Storage": "storage",
}

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "SaveStats",
    "LoadStats",
    "FORMAT_VERSION",
    "Manifest",
    "VerifyReport",
    "read_manifest",
    "verify_step",
    "committed_steps",
    "sharded",
    "RetryPolicy",
    "Storage",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        found = _lazy.submodule(__name__, name)
        if found is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return found  # a module of this package, as when it imported them all
    value = _lazy.name_of(f"{__name__}.{module}", name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
