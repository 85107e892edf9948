"""Sharded, asynchronous, checksummed checkpoints (format v1; see docs/FORMAT.md)."""

from resilient.checkpoint.checkpointer import Checkpointer, LoadStats, SaveHandle, SaveStats
from resilient.checkpoint.format import FORMAT_VERSION, Manifest
from resilient.checkpoint.reader import VerifyReport, read_manifest, verify_step
from resilient.checkpoint.retention import committed_steps
from resilient.checkpoint.state import sharded
from resilient.checkpoint.storage import RetryPolicy, Storage

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
