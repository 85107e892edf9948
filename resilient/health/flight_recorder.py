"""PyTorch's flight recorder: dump it on a verdict when the job turned it on, and say where.

The flight recorder (``TORCH_FR_BUFFER_SIZE=N``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) keeps
the last N collectives each process group issued, with their state (scheduled, started,
completed) as the backend sees it: NCCL's, and in torch 2.13 gloo's too.  NCCL's watchdog dumps it
when a collective times out (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), which is after the verdict has
already restarted the job; so on a DEAD or HUNG verdict every live rank dumps it itself, in
torch's own format (a pickle that ``python -m torch.distributed.flight_recorder.fr_trace``
analyses), and the event log names the file.  Nothing happens when the recorder is off.

Where: the file the job named (``TORCH_FR_DUMP_TEMP_FILE``, formerly
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, followed by the rank).  Where it named none, not torch's
default ``/tmp/nccl_trace_rank_<rank>``: every job on a host shares that name (a second job's
dump replaced the first's), and it lies in a world-writable directory where another user can
make the name first (a file we cannot replace, or a link to one of ours).  The default is a
directory of this job's own in a directory private to this user, ``<tmp>/resilient-fr-<uid>/
<run id>-<digest>/nccl_trace_rank_<rank>`` (the digest: the run id, the store's address and the
attempt, the same on every rank of an attempt and different for another job), made with mode
0700 and refused (``FlightRecorderError``) when something else is there: not a directory, not
ours, or open to others.  Every dump is written to a new file of its own (``mkstemp``: ``O_EXCL``)
and renamed over the name, which replaces a link, never follows one.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
import tempfile

from resilient.errors import FlightRecorderError

__all__ = ["buffer_size", "dump_path", "dump_dir", "dump", "name_for_torch", "ANALYSE_HINT"]

ANALYSE_HINT = "python -m torch.distributed.flight_recorder.fr_trace -d DIR --prefix PREFIX"
FILE_PREFIX = "nccl_trace_rank_"  # torch's own file name before the rank


def buffer_size() -> int:
    """The flight recorder's entries per group as this process's torch reads them (0: off)."""
    raw = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def _named_prefix() -> str | None:
    """The dump file's prefix the job set, if any."""
    return (
        os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        or None
    )


def _private_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"resilient-fr-{os.getuid()}")


def dump_dir() -> str:
    """The directory of this job's dumps where the job named no file (``dump_path``): one per
    user, then one per job and attempt."""
    env = os.environ
    run = env.get("TORCHELASTIC_RUN_ID") or "local"
    job = "\0".join(
        [
            run,
            env.get("MASTER_ADDR", ""),
            env.get("MASTER_PORT", ""),
            env.get("TORCHELASTIC_RESTART_COUNT", "0"),
            env.get("RESILIENT_RDZV_ROUND", ""),  # (heartbeat.ENV_ROUND: resilient launch's)
            env.get("RESILIENT_INJOB_GEN", "0"),
        ]
    )
    digest = hashlib.sha1(job.encode("utf-8", "replace")).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:40].lstrip(".") or "run"
    return os.path.join(_private_root(), f"{name}-{digest}")


def dump_path(rank: int | str) -> str:
    """Where rank ``rank`` of this job dumps: the job's ``TORCH_FR_DUMP_TEMP_FILE`` followed by
    the rank, else ``dump_dir()/nccl_trace_rank_<rank>``."""
    prefix = _named_prefix()
    if prefix is None:
        prefix = os.path.join(dump_dir(), FILE_PREFIX)
    return f"{prefix}{rank}"


def _own_dir(path: str) -> None:
    """Make directory ``path`` (mode 0700) or check the one there: a directory, not a link, this
    user's and closed to others; else a ``FlightRecorderError`` naming it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    found = None
    if not stat.S_ISDIR(st.st_mode):
        found = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    elif st.st_uid != os.getuid():
        found = f"owned by uid {st.st_uid}"
    elif st.st_mode & 0o077:
        found = f"open to others (mode {stat.S_IMODE(st.st_mode):o})"
    if found is not None:
        raise FlightRecorderError(
            f"flight recorder dump directory {path}: expected a directory of uid {os.getuid()}'s "
            f"own with mode 700, found {found}; remove it, or set TORCH_FR_DUMP_TEMP_FILE to a "
            f"path in a directory of your own"
        )


def name_for_torch() -> str | None:
    """Where the job named no dump file and the recorder is on, name this job's private one
    (``dump_dir()``, made or checked here) in ``TORCH_FR_DUMP_TEMP_FILE``, before a process group
    is made: NCCL's watchdog dumps on a collective's timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to
    that variable's file, else to torch's shared ``/tmp/nccl_trace_rank_<rank>``.  Returns the
    prefix named, or None (one named already, the recorder off); raises ``FlightRecorderError``
    when the private directory is not this user's own."""
    if buffer_size() <= 0 or _named_prefix() is not None:
        return None
    _own_dir(_private_root())
    _own_dir(dump_dir())
    prefix = os.path.join(dump_dir(), FILE_PREFIX)
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    return prefix


def dump(rank: int) -> str | None:
    """Write this process's flight recorder to ``dump_path(rank)``; returns the path, or None when
    the recorder is off or torch cannot dump it.  Raises OSError when the file cannot be written
    (a ``FlightRecorderError`` when the default directory is not this user's own).

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
    path = dump_path(rank)
    if _named_prefix() is None:
        _own_dir(_private_root())
        _own_dir(os.path.dirname(path))
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = _dump_fr_trace(True, "torch._inductor" in sys.modules, False)
    # a new file of its own (mkstemp: O_EXCL, mode 600): never one made before by another user
    # in a shared directory, never through a link
    head, tail = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f"{tail}.tmp", dir=head)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
