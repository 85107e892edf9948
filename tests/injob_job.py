"""A data-parallel loop on ``@fault_tolerant`` with a memory snapshot every step, for the in-job
recovery tests.  Rank 0 writes the final weights (their exact bytes, hex), the pids that ran each
rank and their ``ROLE_RANK`` to ``OUT.json``.

Faults, each fired once per job (a marker file next to ``OUT.json``):

* ``INJOB_KILL=SPEC[,SPEC...]``, ``SPEC = RANK:STEP[:SIGNAL[:ORDER]]``: that rank sends itself
  SIGKILL (or ``STOP``, ...) before that step's update.  ``STEP`` may be ``import`` (a worker, not
  a spare, at import: before the group forms) or ``end`` (after the final collective); at ``end``,
  ``ORDER`` ``last`` (default) waits until every other rank's process has exited first, ``first``
  has the other ranks wait, before they exit, until this one's process is gone.
* ``INJOB_HELPER=1``: every rank starts a ``sleep`` child (a helper in its process group) and
  writes the rank's pid and the helper's to ``helper.RANK_PID.HELPER_PID``.
* ``INJOB_SPARE_DIE=1``: the first spare kills itself once it waits for a rank (idle); its pid goes
  to ``spare_died``, and a rank's step kill waits until that process is gone.
* ``INJOB_SPARE_CRASH=1``: every spare exits with 1 at import (a script that fails in a spare).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("RESILIENT_SPARE") and os.environ.get("INJOB_SPARE_CRASH"):
    sys.exit(1)

import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from resilient import Run, fault_tolerant  # noqa: E402

URL, STEPS, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
DIR = os.path.dirname(OUT)
_HELPERS: list[subprocess.Popen] = []


def _claim(name: str) -> bool:
    """Whether this process is the first to claim the once-per-job marker ``name``."""
    try:
        os.close(os.open(os.path.join(DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _gone(pid: int, reaped: bool = False) -> bool:
    """Whether ``pid`` (not this process's child) has exited: a zombie its parent can reap, or
    (``reaped``) waited for by its parent, the launcher, which then has seen it exit.  (A process
    whose main thread is a zombie while its other threads still exit cannot be reaped yet: its
    parent's poll still finds it running, which on a busy machine lasted long enough for the
    launcher to see this rank's death first.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return not reaped and zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (OSError, IndexError):
        return True


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _wait(done, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"injob_job: {what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.01)


def _faults() -> list[tuple[int, int, list[str]]]:
    specs = [s for s in os.environ.get("INJOB_KILL", "").split(",") if s]
    return [(i, int(s.split(":")[0]), s.split(":")[1:]) for i, s in enumerate(specs)]


def fault(rank: int, where: str, pids: list[int] | None = None) -> None:
    """Fire the faults of ``rank`` at ``where`` (a step number, ``import`` or ``end``)."""
    for i, r, (at, *rest) in _faults():
        order = rest[1] if len(rest) > 1 else "last"
        if at == where == "end" and r != rank and order == "first":
            _wait(lambda: _gone(pids[r], reaped=True), f"the launcher's wait for rank {r}")
        if (r, at) != (rank, where) or not _claim("killed" if i == 0 else f"killed.{i}"):
            continue
        if where == "end" and order == "last":
            others = [p for j, p in enumerate(pids) if j != rank]
            _wait(lambda: all(_gone(p) for p in others), "the other ranks' exit")
        if where not in ("import", "end") and os.environ.get("INJOB_SPARE_DIE"):
            path = os.path.join(DIR, "spare_died")
            _wait(lambda: _read_pid(path) is not None, "a spare's death")
            _wait(lambda: _gone(_read_pid(path), reaped=True), "the launcher's wait for the spare")
        os.kill(os.getpid(), getattr(signal, "SIG" + (rest[0] if rest else "KILL")))


def _die_once_idle() -> None:
    """(the first spare) SIGKILL this process once it waits for a rank."""
    from resilient.health.attach import agent_store
    from resilient.launch.injob import base_key

    if not _claim("spare_died.claim"):
        return
    node, index = os.environ["RESILIENT_SPARE"].split(":")
    key = f"{base_key()}/ready/{node}/{index}"

    def die() -> None:
        store = agent_store()
        _wait(lambda: store.check([key]), "the spare's wait for a rank")
        path = os.path.join(DIR, "spare_died")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(path + ".tmp", path)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die, daemon=True).start()


if os.environ.get("RESILIENT_SPARE"):
    if os.environ.get("INJOB_SPARE_DIE"):
        _die_once_idle()
else:
    fault(int(os.environ.get("RANK", "0")), "import")


@fault_tolerant(URL, save_every=5, memory_every=1)
def train(run: Run) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(model=model, optim=optim)
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("INJOB_HELPER") and not _HELPERS:
        # (not on the launcher's streams: one left over would hold a test's pipe open)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        _HELPERS.append(subprocess.Popen(["sleep", "300"], **quiet))
        open(os.path.join(DIR, f"helper.{os.getpid()}.{_HELPERS[0].pid}"), "w").close()
    for step in run.steps(STEPS):
        # before the step's update, as the chaos harness's in-rank faults: the snapshot of the
        # step before may still be committing, the one before that is committed
        fault(rank, str(step))
        g = torch.Generator().manual_seed(step * 1000 + rank)
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
    got = [None] * world
    dist.all_gather_object(got, (os.getpid(), os.environ.get("ROLE_RANK")))
    pids = [pid for pid, _ in got]
    if rank == 0:
        weights = {k: v.detach().numpy().tobytes().hex() for k, v in model.state_dict().items()}
        role_ranks = [role for _, role in got]
        with open(OUT, "w") as f:
            json.dump({"weights": weights, "pids": pids, "role_ranks": role_ranks,
                       "step": run.step}, f)  # fmt: skip
    fault(rank, "end", pids)


if __name__ == "__main__":
    train()
