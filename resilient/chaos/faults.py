"""Fault injectors: inside a rank (a hook the job installs) and from outside (the harness).

In-rank injectors act at the exact point a scenario names, through the hook protocol
(``resilient.hooks``): the harness writes a plan (JSON) and hands its path to the job (the reference
trainer's ``--chaos PLAN``; ``{chaos}`` in a command job), which installs ``ChaosHook.from_file``.
Nothing in ``resilient`` outside this package reads the plan or imports this module: a job
without the hook cannot fire a fault.  Triggers: ``step`` (before the step starts, before its
progress heartbeat), ``save`` (right after an asynchronous save was issued: the bytes are still
being written), and the start-up phases ``import`` (the entry script, before the heartbeat exists),
``init`` (inside ``resilient.launch.init_process_group``, heartbeat running, before the process
group) and ``restore`` (``Run.track``, before the load).  Each fault fires once per run, even across
restarts: firing claims a marker file with ``O_EXCL``, and writes a ``fault`` event to the run's
event log before it acts, so that the harness can prove it fired.  A fault with ``after`` (another
fault's id) is armed only once that fault's marker exists: a second fault during the first one's
recovery.

Kinds (in-rank): ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: frozen, heartbeat thread
included), ``raise`` (an exception out of the loop), ``hang`` (the loop blocks while the heartbeat
thread keeps beating), ``pause`` (the loop blocks for ``seconds``, then goes on), ``slow``
(every torch operation on the rank takes ``factor`` times as long while communication keeps full
speed, like a throttled GPU; ``mode = "throttle"`` instead stops and continues the whole process
with SIGSTOP/SIGCONT, like an oversubscribed node), ``corrupt`` / ``truncate`` (bit rot or a lost tail in
a file of the newest committed checkpoint; one triggered before anything is committed stays armed
and fires at the first step or save after a commit: it claims its marker and records its ``fault``
event only once it damaged a file, and its ``fault_detail`` event says which), ``skew`` (the rank's wall clock, ``time.time``, runs
``seconds`` off from the start of every attempt: a host without NTP), ``delay_link`` (every
point-to-point send from the rank to ``peer`` is held to ``bytes_per_s``, plus ``latency_s``: one
slow link, for ``resilient preflight --chaos PLAN``; a plan-only kind, not a scenario's, since
the trainer's traffic is collectives, not sends).  From the harness:
``kill_node`` (a torchrun agent and all its workers) and time-triggered signals to a rank
(``kill_rank_process``).

Storage faults (latency, transient and permanent errors, ENOSPC) go through the ``faulty://``
filesystem (``resilient.chaos.faultfs``), which the harness puts in front of the checkpoint URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from resilient.health.events import EventLog

__all__ = [
    "IN_RANK_KINDS",
    "DAMAGE_KINDS",
    "PHASE_TRIGGERS",
    "ChaosHook",
    "ChaosError",
    "damage_newest_checkpoint",
    "descendants",
    "worker_pid",
    "has_workers",
    "kill_tree",
    "skew_clock",
    "slow_compute",
    "slowed",
    "delay_link",
    "LINK_KINDS",
]

SPARES_DIR = ".spares"  # in a run's marker directory: the pid of each spare that took a rank
IN_RANK_KINDS = ("kill", "stop", "raise", "hang", "pause", "slow", "corrupt", "truncate", "skew")
# kinds a plan may hold that scenario files do not take (see the module docstring)
LINK_KINDS = ("delay_link",)
# kinds that damage a committed checkpoint: fired only once they did (ChaosHook._damage)
DAMAGE_KINDS = ("corrupt", "truncate")
# scenario ``when`` -> the hook phase it fires at
PHASE_TRIGGERS = {"import": "import", "init": "init_process_group", "restore": "restore"}


class ChaosError(RuntimeError):
    """The exception the ``raise`` injector throws inside a rank."""


class ChaosHook:
    """The in-rank side of a chaos plan: ``{"marker_dir": DIR, "events": PATH, "node": N,
    "faults": [{id, kind, rank, node, step, when, ...}]}``.  A hook (``resilient.hooks``)."""

    def __init__(
        self, plan: dict[str, Any], rank: int | None, events: Any, *, node: int | None = None
    ) -> None:
        self.marker_dir = Path(plan["marker_dir"])
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.events = rank, events
        self.node = plan.get("node") if node is None else node
        self._plan = plan
        self.faults = self._mine()

    def _mine(self) -> list[dict[str, Any]]:
        return [
            f
            for f in self._plan["faults"]
            if f["kind"] in (*IN_RANK_KINDS, *LINK_KINDS)
            and self._targets(f)
            and f.get("at_s") is None
        ]

    def _learn_rank(self) -> None:
        """A spare of ``resilient launch`` starts without a rank; once it is given one (in
        ``init_process_group``), the faults aimed at that rank are its own."""
        if self.rank is None and "RANK" in os.environ:
            self.rank = int(os.environ["RANK"])
            self.faults = self._mine()
            # where the harness finds the process that runs the rank now (``worker_pid``): a
            # spare's rank is in its os.environ only, which /proc does not show
            from resilient.health.heartbeat import process_start

            with contextlib.suppress(OSError):
                spares = self.marker_dir / SPARES_DIR
                spares.mkdir(exist_ok=True)
                me = os.getpid()
                (spares / f"rank{self.rank}").write_text(f"{me} {process_start(me)}")

    @classmethod
    def from_file(cls, path: str, rank: int | None = None) -> ChaosHook:
        """The hook for this process (its rank from the launcher's ``RANK``)."""
        with open(path) as f:
            plan = json.load(f)
        if rank is None and "RANK" in os.environ:
            rank = int(os.environ["RANK"])
        # (no RANK: a spare, whose rank comes later; until then only rank-less faults are its)
        return cls(plan, rank, EventLog(plan.get("events")))

    def _targets(self, f: dict[str, Any]) -> bool:
        if f.get("rank") is not None and (self.rank is None or f["rank"] != self.rank):
            return False
        return not (
            f.get("kind") == "skew" and f.get("node") is not None and f["node"] != self.node
        )

    # --- the hook protocol ---------------------------------------------------------------------
    def at_phase(self, phase: str, run: Any | None) -> None:
        self._learn_rank()
        if phase == "import":
            for f in self.faults:
                if f["kind"] == "skew":  # a property of the host: every attempt, from the start
                    skew_clock(float(f["seconds"]))
                    self._claim_and_record(f, None, "import")
        for when, name in PHASE_TRIGGERS.items():
            if name == phase:
                self._trigger(when, None, run)

    def at_step(self, step: int, run: Any) -> None:
        self._learn_rank()
        self._trigger("step", step, run)

    def during_save(self, step: int, run: Any) -> None:
        self._trigger("save", step, run)

    def _trigger(self, when: str, step: int | None, run: Any) -> None:
        for f in self.faults:
            if f["kind"] == "skew" or f.get("when", "step") != when:
                continue
            if when in ("step", "save") and (step is None or step < f["step"]):
                continue
            if f.get("after") and not self._marker(f["after"]).exists():
                continue  # armed once the fault it follows has fired
            if f["kind"] in DAMAGE_KINDS:
                self._damage(f, step, when, run)
            elif self._claim_and_record(f, step, when):
                self._fire(f, step, run)

    def _claim_and_record(self, f: dict[str, Any], step: int | None, when: str) -> bool:
        if not self._claim(f):
            return False
        self._record(f, step, when)
        return True

    def _record(self, f: dict[str, Any], step: int | None, when: str) -> None:
        self.events.write(
            "fault",
            id=f["id"],
            kind=f["kind"],
            rank=self.rank,
            step=step,
            when=when,
            pid=os.getpid(),
            **({"seconds": f["seconds"]} if f["kind"] == "skew" else {}),
        )

    def _marker(self, fault_id: str) -> Path:
        """The file whose creation claims the fault, in the run's faults/ directory."""
        if not fault_id or "/" in fault_id or "\\" in fault_id or fault_id in (".", ".."):
            raise ChaosError(
                f"fault id {fault_id!r} is not a plain file name (it names the fault's marker "
                f"in {self.marker_dir}); give the fault an id of letters, digits, '-', '_', '.'"
            )
        return self.marker_dir / f"{fault_id}.fired"

    def _claim(self, fault: dict[str, Any]) -> bool:
        try:
            fd = os.open(self._marker(fault["id"]), os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def _fire(self, f: dict[str, Any], step: int | None, run: Any) -> None:
        kind = f["kind"]
        where = f"step {step}" if step is not None else f"phase {f.get('when')}"
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "raise":
            raise ChaosError(f"injected exception on rank {self.rank} at {where} ({f['id']})")
        elif kind == "hang":
            while True:  # the heartbeat thread goes on; only the detector can end this
                time.sleep(3600)
        elif kind == "pause":
            time.sleep(float(f["seconds"]))
        elif kind == "slow":
            if f.get("mode", "compute") == "throttle":
                throttle(os.getpid(), float(f["factor"]), float(f.get("seconds") or 0))
            else:
                slow_compute(float(f["factor"]))
        elif kind == "delay_link":
            delay_link(int(f["peer"]), float(f["bytes_per_s"]), float(f.get("latency_s") or 0.0))

    def _damage(self, f: dict[str, Any], step: int | None, when: str, run: Any) -> None:
        """A corrupt or truncate fault fires, and is recorded as fired, only once it damaged a
        committed step: triggered before the first commit, it stays armed (no marker, no event)
        and tries again at the next step or save, of this process or the next attempt's, so the
        verifier's "faults fired" never counts a fault that damaged nothing."""
        if run is None or run.checkpointer is None:  # a job that cannot be damaged: say so
            raise ChaosError(
                f"{f['id']}: the run has no checkpointer to damage; a {f['kind']} fault needs a "
                f"job that saves (save_every)"
            )
        target = run.checkpointer
        if f.get("tier") == "memory":
            target = run.checkpointer.snapshots
            if target is None:
                raise ChaosError(
                    f"{f['id']}: the run has no memory tier to damage; give the job memory_every"
                )
        if self._marker(f["id"]).exists():
            return  # fired already: later steps leave the checkpointer alone
        # damage a committed step, not one being written: the save in flight is joined first
        # (left to commit after the fault looked, on a loaded machine, the fault stayed armed,
        # fired only after a restart had restored the step it was meant to damage, and a job
        # that must fail completed); its failure is the run's to report (its own handle says it)
        with contextlib.suppress(Exception):
            target.wait()
        try:
            committed = target.latest_step()
        except Exception:  # (a storage fault on the listing: armed still, tried again later)
            return
        if committed is None:
            return  # nothing committed yet: armed still
        if not self._claim(f):
            return
        try:
            detail = damage_newest_checkpoint(target, f["kind"])
        except BaseException:
            self._marker(f["id"]).unlink(missing_ok=True)  # damaged nothing: not fired
            raise
        self._record(f, step, when)
        detail["tier"] = f.get("tier") or "durable"
        self.events.write("fault_detail", id=f["id"], **detail)


_TRUE_TIME = time.time


def skew_clock(seconds: float) -> None:
    """From now on this process's ``time.time()`` runs ``seconds`` off (negative: behind), as on
    a host whose clock is wrong; monotonic clocks are untouched."""
    time.time = lambda: _TRUE_TIME() + seconds


def damage_newest_checkpoint(checkpointer: Any, kind: str) -> dict[str, Any]:
    """Flip bytes in (``corrupt``) or cut the second half off (``truncate``) the largest data file
    of the newest committed step; returns what was damaged."""
    step = checkpointer.latest_step()
    if step is None:
        raise ChaosError("no committed checkpoint to damage yet; trigger the fault later")
    manifest = checkpointer.manifest(step)
    name = max(manifest.files, key=lambda n: manifest.files[n].size_bytes)
    storage = checkpointer.storage
    from resilient.checkpoint.format import step_dir_name

    rel = f"{step_dir_name(step)}/{name}"
    data = bytearray(storage.read(rel))
    if kind == "truncate":
        data = data[: len(data) // 2]
    else:
        mid = len(data) // 2
        for i in range(mid, min(mid + 64, len(data))):
            data[i] ^= 0xFF
    with storage.fs.open(storage.path(rel), "wb") as out:  # in place, like bit rot
        out.write(bytes(data))
    return {"step": step, "file": rel, "damage": kind, "size_after": len(data)}


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "send",
    "recv",
)


def slow_compute(factor: float) -> None:
    """From now on, every torch operation this thread runs takes ``factor`` times as long, while
    communication runs at full speed: a slower device (a throttled GPU, a degraded node).  See
    ``slowed``; this one stays on the thread's mode stack for the rest of the process."""
    slowed(factor).__enter__()


# per thread: the seconds its torch.distributed collectives took (they are wrapped once, on first use)
_comm = threading.local()
# where the functions that communicate live: c10d's own, and the functional collectives (DTensor,
# FSDP2); both reach torch function modes like any torch op, and their wait is not compute
_COMM_MODULES = ("torch.distributed", "torch._ops._c10d_functional")


def _comm_s() -> float:
    return getattr(_comm, "s", 0.0)


def _timed_already(fn: Any) -> bool:
    """Whether ``fn`` or a function it wraps (``__wrapped__``: the collective ring's wrappers
    keep it) is one of ``slowed``'s timing wrappers."""
    seen = 0
    while fn is not None and seen < 16:
        if getattr(fn, "__resilient_timed__", False):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def slowed(factor: float) -> Any:
    """A torch function mode (``with slowed(5): ...``) under which every torch operation this
    thread runs takes ``factor`` times as long, while communication runs at full speed.  Each
    top-level torch call (the backward pass counts as one) is timed, the time spent inside
    collectives is taken out, and the rest is stretched by sleeping; sleeps are batched to a
    millisecond so that tiny ops are not swamped by timer overhead.

    Communication is not stretched where torch lets it be told apart: c10d's collectives and the
    functional collectives pass through, and the time spent in a collective that runs inside
    another top-level call (a hook in the backward pass) is taken out of that call's.  A wait
    that torch hides inside an ordinary op (an async functional collective's result first used
    by ``t + 1``; DDP's C++ reducer) is stretched with that op."""
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    if factor <= 1:
        raise ValueError(f"slow factor must be > 1, got {factor}")

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _comm.s = _comm_s() + time.perf_counter() - t0

        wrapper.__resilient_timed__ = True  # type: ignore[attr-defined]
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not _timed_already(fn):
            setattr(dist, name, timed(fn))

    class Slow(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.debt = 0.0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if (getattr(func, "__module__", None) or "").startswith(_COMM_MODULES):
                # communication: its wait for the peers is not this rank's compute (a c10d
                # collective's time is counted by the wrapper outside)
                return func(*args, **(kwargs or {}))
            t0, c0 = time.perf_counter(), _comm_s()
            try:
                return func(*args, **(kwargs or {}))
            finally:
                own = time.perf_counter() - t0 - (_comm_s() - c0)
                self.debt += max(own, 0.0) * (factor - 1)
                if self.debt >= 1e-3:
                    time.sleep(self.debt)
                    self.debt = 0.0

    return Slow()


def delay_link(peer: int, bytes_per_s: float, latency_s: float = 0.0) -> None:
    """From now on, every blocking point-to-point send from this rank to rank ``peer``
    (``dist.send``) takes at least ``latency_s + bytes / bytes_per_s``: one slow link (a bad
    cable or port, a degraded NIC) in one direction.  The send itself runs at full speed; the
    rest of the time is slept after it, so the link's bandwidth is capped at ``bytes_per_s``.
    Other peers, receives, collectives and ``isend`` are untouched (torch tells ``isend`` apart
    by identity in ``P2POp``: it is never wrapped)."""
    import torch.distributed as dist

    if bytes_per_s <= 0 or latency_s < 0:
        raise ValueError(
            f"delay_link needs bytes_per_s > 0 and latency_s >= 0, got {bytes_per_s}, {latency_s}"
        )

    def hold(tensor: Any, t0: float) -> None:
        due = latency_s + tensor.numel() * tensor.element_size() / bytes_per_s
        left = due - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)

    def wrap(fn: Any) -> Any:
        def delayed(tensor: Any, dst: int | None = None, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            # (a send addressed by group_dst=, not dst=, is passed on untouched)
            out = (
                fn(tensor, dst, *args, **kwargs) if dst is not None else fn(tensor, *args, **kwargs)
            )
            if dst == peer:
                hold(tensor, t0)
            return out

        delayed.__wrapped__ = fn  # type: ignore[attr-defined]
        return delayed

    dist.send = wrap(dist.send)


_THROTTLE = """
import os, signal, sys, time
pid, factor, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
period = 0.01
run, stop = period / factor, period - period / factor
end = time.time() + seconds if seconds > 0 else float("inf")
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
try:
    while time.time() < end:
        time.sleep(run)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop)
        os.kill(pid, signal.SIGCONT)
except ProcessLookupError:
    pass
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


def throttle(pid: int, factor: float, seconds: float = 0.0) -> subprocess.Popen:
    """Run ``pid`` at 1/``factor`` of its speed (SIGSTOP/SIGCONT every 10 ms) for ``seconds``
    (0: until it exits), from a small helper process."""
    if factor <= 1:
        raise ValueError(f"slow factor must be > 1, got {factor}")
    return subprocess.Popen(
        [sys.executable, "-c", _THROTTLE, str(pid), str(factor), str(seconds)],
        stdin=subprocess.DEVNULL,
    )


# --- from outside: processes of a torchrun job ---------------------------------------------------


def _parents() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p.name))
    return children


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its workers in their own sessions, so
    a process group kill would miss them); below a stand-in (resilient/forkserver.py), the
    process a fork server started for it too, with its own: a launcher the harness started
    from its server for launchers is not its stand-in's child."""
    from resilient.forkserver import is_stand_in, rank_pid

    children, out, todo, seen = _parents(), [], [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        todo += children.get(p, [])
        if is_stand_in(p) and (forked := rank_pid(p)) not in (None, p):
            todo.append(forked)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL, *, spare_persisters: bool = False) -> list[int]:
    """Signal an agent and all its workers (a node lost at once); returns the pids signalled.
    With ``spare_persisters``, the job's processes die and the node's persister lives on."""
    pids = [p for p in descendants(pid) if not (spare_persisters and is_persister(p))]
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return pids


def is_persister(pid: int) -> bool:
    """Whether ``pid`` is a memory tier's persister (resilient/checkpoint/persister.py): the one
    process of a job that outlives its workers."""
    try:
        return b"resilient.checkpoint.persister" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def persisters_of(roots: list[Path]) -> list[int]:
    """The running persisters whose memory root (``RESILIENT_MEMORY_ROOT``) is one of ``roots``."""
    wanted = {f"RESILIENT_MEMORY_ROOT={r}".encode() for r in roots}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not is_persister(int(entry)):
            continue
        try:
            env = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if env & wanted and state != "Z":
            found.append(int(entry))
    return found


def worker_pid(agent: int, rank: int, markers: Path | None = None) -> int | None:
    """The pid of global rank ``rank`` among ``agent``'s workers (read from their environment;
    a worker that stands in for a rank its node's fork server started gives that rank's pid).
    ``markers``: a chaos run's marker directory, where a spare of ``resilient launch`` that took
    the rank over wrote its pid (``ChaosHook``; its rank is not in its /proc environment)."""
    from resilient.forkserver import prefer_stand_ins, rank_pid

    found = [p for p, env in _workers(agent) if f"RANK={rank}".encode() in env]
    # a stand-in first (a forked rank's children share its environment, the rank does not)
    if found:
        return rank_pid(prefer_stand_ins(found)[0])
    if markers is not None:
        from resilient.health.heartbeat import process_state

        try:
            spare, start = (
                int(x) for x in (markers / SPARES_DIR / f"rank{rank}").read_text().split()
            )
        except (OSError, ValueError):
            return None
        # the same process (pid and start time: not a pid used again), running (not a dead
        # spare its agent has not reaped yet), and the agent's (not a spare of an earlier job)
        if (
            process_state(spare, start) not in (None, "gone", "Z", "X")
            and spare in descendants(agent)[1:]
        ):
            return spare
    return None


def has_workers(agent: int) -> bool:
    """Whether ``agent`` runs workers now, or ``resilient launch``'s spares: its node is in the
    job (an elastic node that came after the rendezvous round closed waits, with none, for the
    next one).  A spare counts: one that took a rank over has it in ``os.environ`` only, set
    after its start, which ``/proc`` does not show."""
    return next(_workers(agent, spares=True), None) is not None


def _workers(agent: int, spares: bool = False) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, environment) of each worker process under ``agent``: a process torchrun started
    for a rank (``LOCAL_RANK`` set), not a rank's persister; with ``spares``, the spares of
    ``resilient launch`` too (``RESILIENT_SPARE`` set: resilient.launch.injob.ENV_SPARE)."""
    for p in descendants(agent)[1:]:
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RESILIENT_PERSISTER_PROCESS=1" in env:  # a rank's child, not a rank
            continue
        if any(
            e.startswith(b"LOCAL_RANK=") or (spares and e.startswith(b"RESILIENT_SPARE="))
            for e in env
        ):
            yield p, env
