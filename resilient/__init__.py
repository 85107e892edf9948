"""resilient: fault tolerance and checkpoint management for large-scale PyTorch training."""

__version__ = "0.1.0"

from resilient import errors as _errors  # noqa: E402
from resilient.checkpoint import Checkpointer, RetryPolicy, sharded  # noqa: E402
from resilient.data import ResumableSampler  # noqa: E402
from resilient.errors import *  # noqa: E402, F403  (every error class, importable from here)
from resilient.hooks import Hook  # noqa: E402
from resilient.layout import Layout, Replicate, Shard  # noqa: E402
from resilient.loop import InJobRecovery, Run, SaveFailedWarning, fault_tolerant  # noqa: E402

__all__ = [
    "Layout",
    "Shard",
    "Replicate",
    "Checkpointer",
    "RetryPolicy",
    "sharded",
    "Run",
    "fault_tolerant",
    "InJobRecovery",
    "Hook",
    "SaveFailedWarning",
    "ResumableSampler",
    *_errors.__all__,
    "__version__",
]
