"""PyTorch's flight recorder: dump it on a verdict when the job turned it on, and say where.

The flight recorder (``TORCH_FR_BUFFER_SIZE=N``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) keeps
the last N collectives each process group issued, with their state (scheduled, started,
completed) as the backend sees it: NCCL's, and in torch 2.13 gloo's too.  NCCL's watchdog dumps it
when a collective times out (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), which is after the verdict has
already restarted the job; so on a DEAD or HUNG verdict every live rank dumps it itself, to the
file torch would use (``TORCH_FR_DUMP_TEMP_FILE``, formerly ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``,
default ``/tmp/nccl_trace_rank_``, followed by the rank), in torch's own format (a pickle that
``python -m torch.distributed.flight_recorder.fr_trace`` analyses), and the event log names it.
Nothing happens when the recorder is off.
"""

from __future__ import annotations

import os
import sys

__all__ = ["buffer_size", "dump_path", "dump", "ANALYSE_HINT"]

ANALYSE_HINT = "python -m torch.distributed.flight_recorder.fr_trace -d DIR --prefix PREFIX"


def buffer_size() -> int:
    """The flight recorder's entries per group as this process's torch reads them (0: off)."""
    raw = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def dump_path(rank: int | str) -> str:
    prefix = (
        os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        or "/tmp/nccl_trace_rank_"
    )
    return f"{prefix}{rank}"


def dump(rank: int) -> str | None:
    """Write this process's flight recorder to ``dump_path(rank)``; returns the path, or None when
    the recorder is off or torch cannot dump it.  Raises OSError when the file cannot be written.

    Each collective's call stack is in the dump only where ``torch._inductor`` is loaded already
    (a ``torch.compile`` job): torch symbolizes the stacks with it, and importing it (with
    ``torch._dynamo``) takes over a second of CPU, at the moment a verdict needs every rank to
    answer before the launcher tears the job down.  The ``stacks`` event that follows has every
    thread's Python stack."""
    if buffer_size() <= 0:
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    data = _dump_fr_trace(True, "torch._inductor" in sys.modules, False)
    path = dump_path(rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path
