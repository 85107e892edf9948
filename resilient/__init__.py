"""resilient: fault tolerance and checkpoint management for large-scale PyTorch training."""

__version__ = "0.1.0"

from resilient.checkpoint import Checkpointer, RetryPolicy, sharded  # noqa: E402
from resilient.layout import Layout, Replicate, Shard  # noqa: E402
from resilient.loop import Run, fault_tolerant  # noqa: E402

__all__ = [
    "Layout",
    "Shard",
    "Replicate",
    "Checkpointer",
    "RetryPolicy",
    "sharded",
    "Run",
    "fault_tolerant",
    "__version__",
]
