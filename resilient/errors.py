"""The exception hierarchy of the toolkit.

Every message names the thing (tensor key, rank, file, step, URL), says what was expected and what
was found, and what to do about it. Tests assert the message text, so treat it as an interface.
"""

from __future__ import annotations

__all__ = [
    "ResilientError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "LayoutError",
    "StorageError",
    "LeaseError",
    "StepRetiredError",
    "StateMismatchError",
    "RankFailureError",
    "ScenarioError",
    "MemoryTierError",
    "PreflightError",
    "FlightRecorderError",
]


class ResilientError(Exception):
    """Base class of every error this toolkit raises on purpose."""


class CheckpointNotFoundError(ResilientError, FileNotFoundError):
    """The requested step (or any committed step) does not exist."""


class CheckpointCorruptError(ResilientError):
    """A checkpoint's bytes or manifest are damaged or inconsistent."""


class LayoutError(ResilientError, ValueError):
    """A layout or placement does not fit the world size or a tensor's shape."""


class StateMismatchError(ResilientError, ValueError):
    """The state being loaded into does not match the checkpoint (keys, shapes, dtypes)."""


class StorageError(ResilientError, OSError):
    """A storage operation failed permanently (or kept failing after retries)."""

    def __init__(self, message: str, *, url: str = "", operation: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.operation = operation


class LeaseError(ResilientError):
    """Another job holds the writer lease of a checkpoint URL (or took it over from this one):
    two writers on one URL would damage each other's steps.  The message names the other owner."""


class StepRetiredError(CheckpointNotFoundError):
    """A step was retired (removed by retention) while it was being read: not corruption."""


class RankFailureError(ResilientError):
    """A peer rank was declared dead or hung; this rank must stop."""


class ScenarioError(ResilientError, ValueError):
    """A chaos scenario file is malformed; the message names the file, the line and the field."""


class MemoryTierError(ResilientError):
    """The host-memory tier cannot work on this node (no room, no writable directory, a directory
    that belongs to another job); raised at start, before training."""


class PreflightError(ResilientError):
    """A preflight check failed (``Run(preflight=True)``): a rank or link slower than the others by
    the factor, a device that computes wrong results or reports uncorrected errors, unreachable
    checkpoint storage.  The message names each rank (and host) or link with its figure and the
    median; ``report`` holds every figure."""

    def __init__(self, message: str, *, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class FlightRecorderError(ResilientError, OSError):
    """PyTorch's flight recorder cannot be dumped safely where it would go (the default dump
    directory is a link, another user's, or open to others); the message names the path."""
