"""The ``@fault_tolerant`` decorator and ``Run``: auto-resume, periodic async saves, preemption.

``Run`` owns the training loop's contract with the toolkit (DESIGN.md section 5): ``track`` names
the state and restores the newest committed step (falling back, with a warning, to the step before
when the newest fails verification); ``steps`` yields the remaining steps, saves asynchronously every
``save_every`` steps, turns SIGTERM into a synchronous save and a clean exit, and commits the final
step synchronously before it returns.  A failed save is not a failed run: it is logged and counted,
training goes on, and only ``max_failed_saves`` consecutive failures (or a failed final save) end
the run.  RNG states (python, numpy, torch CPU and CUDA) and the step are tracked without the user
asking.  Failure detection plugs in through ``monitor`` (under torchrun, the one
``resilient.launch.init_process_group`` started); other code plugs in through ``hooks``
(``resilient.hooks``): nothing here imports the chaos harness or reads its environment.
"""

from __future__ import annotations

import base64
import functools
import gc
import inspect
import logging
import numbers
import os
import random
import signal
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from resilient.checkpoint import Checkpointer
from resilient.checkpoint.checkpointer import (
    _optional_names,
    check_memory_options,
    collective_device,
)
from resilient.checkpoint.format import _short
from resilient.checkpoint.worker import join_running
from resilient.errors import (
    CheckpointNotFoundError,
    LeaseError,
    PreflightError,
    RankFailureError,
    ResilientError,
    StateMismatchError,
)
from resilient.health import EXIT_RANK_FAILURE, DetectorConfig, EventLog, Monitor
from resilient.health.attach import attempt_key, detect_by_default, start_monitor, take_over
from resilient.health.detector import DEFAULT_PHASE_BUDGETS_S, check_seconds
from resilient.health.events import default_event_log
from resilient.hooks import call as call_hooks
from resilient.launch import init_process_group, injob_enabled, regroup
from resilient.launch.injob import generation
from resilient.layout import Layout
from resilient.preflight import PreflightConfig, run_preflight

__all__ = ["Run", "fault_tolerant", "RNGState", "PREEMPTED_EXIT_CODE", "SaveFailedWarning"]

log = logging.getLogger(__name__)

# A preempted run that saved and stopped cleanly exits 0: torchrun must not restart it.
PREEMPTED_EXIT_CODE = 0


class SaveFailedWarning(UserWarning):
    """A checkpoint save failed; training goes on from the newest committed step."""


class RNGState:
    """Stateful RNG states of this rank: python, numpy, torch CPU and every CUDA device (JSON).

    The Mersenne Twister states (624 words and a position) are written as base64 of their
    little-endian 32-bit words: a third of the JSON of a list of integers, and a fraction of its
    cost to encode and parse at every save.  States saved as lists (before) load all the same.
    A state that has not moved since the previous call is not encoded again (a snapshot at every
    step reads all three, and a trainer seldom draws from python's or numpy's)."""

    def _encode(self, source: str, raw: Any, encode: Callable[[Any], str]) -> str:
        # source -> (raw state, its text); kept in the instance (a subclass's __init__ need not
        # call this one's)
        encoded: dict[str, tuple[Any, str]] = vars(self).setdefault("_encoded", {})
        last = encoded.get(source)
        if last is not None and last[0] == raw:
            return last[1]
        text = encode(raw)
        encoded[source] = (raw, text)
        return text

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_state = np.random.get_state()
        sd = {
            "python": [version, self._encode("python", internal, _words), gauss],
            "numpy": [
                np_state[0],
                self._encode("numpy", np_state[1].tobytes(), _words_of_bytes),
                int(np_state[2]),
                int(np_state[3]),
                float(np_state[4]),
            ],
            "torch": self._encode("torch", torch.get_rng_state().numpy().tobytes(), _bytes64),
            "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()]
            if torch.cuda.is_available()
            else [],
        }
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Set every generator from ``sd``; a state that is damaged or of another shape is
        refused by its key (``rng.numpy``) before any generator is set."""
        if not isinstance(sd, Mapping):
            raise StateMismatchError(
                f"the saved RNG states 'rng' are {_short(sd)}, expected the mapping that "
                f"RNGState.state_dict() returns; the checkpoint is damaged"
            )
        python = _rng_part(sd, "python", _python_state)
        numpy_state = _rng_part(sd, "numpy", _numpy_state)
        torch_state = _rng_part(sd, "torch", _torch_state)
        cuda = _rng_part(sd, "cuda", lambda v: [_unb64(s) for s in v])
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def _rng_part(sd: Mapping[str, Any], source: str, decode: Callable[[Any], Any]) -> Any:
    """``decode(sd[source])``, checked on a scratch generator; what fails is named."""
    if source not in sd:
        raise StateMismatchError(
            f"the saved RNG states have no 'rng.{source}' (found {sorted(map(str, sd))}); the "
            f"checkpoint is damaged or was not saved by Run"
        )
    value = sd[source]
    try:
        return decode(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:  # (binascii's too)
        raise StateMismatchError(
            f"the saved RNG state 'rng.{source}' is {_short(value)}, which does not set a "
            f"{source} generator ({type(e).__name__}: {e}); the checkpoint is damaged: resume "
            f"from another step or start a fresh run (another checkpoint URL)"
        ) from None


def _python_state(value: Any) -> tuple:
    version, internal, gauss = value
    if gauss is not None and (isinstance(gauss, bool) or not isinstance(gauss, float)):
        raise TypeError(f"the cached gauss value must be None or a float, not {_short(gauss)}")
    state = (version, tuple(_unwords(internal)), gauss)
    random.Random().setstate(state)  # raises on a state of the wrong version or size
    return state


def _numpy_state(value: Any) -> tuple:
    name, keys, pos, has_gauss, cached = value
    state = (name, np.array(_unwords(keys), dtype=np.uint32), pos, has_gauss, cached)
    np.random.RandomState().set_state(state)
    return state


def _torch_state(value: Any) -> torch.Tensor:
    state = _unb64(value)
    torch.Generator().set_state(state)
    return state


def _words(words: Any) -> str:
    return base64.b64encode(np.asarray(words, dtype="<u4").tobytes()).decode()


def _words_of_bytes(raw: bytes) -> str:
    """``_words`` of the native-endian uint32 words ``raw`` holds."""
    return _words(np.frombuffer(raw, dtype=np.uint32))


def _bytes64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unwords(words: Any) -> list[int]:
    """What ``_words`` wrote, or the list of integers of a state saved before it."""
    if isinstance(words, str):
        return np.frombuffer(base64.b64decode(words, validate=True), dtype="<u4").tolist()
    return list(words)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


class Run:
    """One training run's link to checkpoints, preemption, failure detection and hooks.

    ``Run(checkpoint_url, *, save_every=100, keep_last=3, keep_every=None, max_failed_saves=3,
    heartbeat_interval_s=1.0, hang_timeout_s=None, join_timeout_s=120.0, phase_budgets_s=None,
    storage_options=None, layout=None, monitor=None, detect=None, event_log=None, fallback=True,
    hooks=(), memory_every=None, memory_root=None, memory_commit_every=1, preflight=False,
    optional_values=())``; see the README for what each does.  ``preflight=True`` (or a ``resilient.preflight.PreflightConfig``) checks every rank
    before training (the quick subset of ``resilient preflight``: store latency, a small
    all-reduce, pairwise links, memory bandwidth, device health; a few seconds) and raises
    ``PreflightError`` naming the failing rank, host or link and its figure.
    """

    def __init__(
        self,
        checkpoint_url: str | None,
        *,
        save_every: int = 100,
        keep_last: int = 3,
        keep_every: int | None = None,
        max_failed_saves: int = 3,
        heartbeat_interval_s: float = 1.0,
        hang_timeout_s: float | None = None,
        join_timeout_s: float = 120.0,
        phase_budgets_s: dict[str, float] | None = None,
        storage_options: dict | None = None,
        layout: Layout | None = None,
        monitor: Any | None = None,
        detect: bool | None = None,
        event_log: str | None = None,
        fallback: bool = True,
        hooks: Sequence[Any] = (),
        memory_every: int | None = None,
        memory_root: str | None = None,
        memory_commit_every: int = 1,
        preflight: Any = False,
        optional_values: Iterable[str] = (),
    ) -> None:
        detector = check_run_options(
            save_every=save_every,
            keep_last=keep_last,
            keep_every=keep_every,
            max_failed_saves=max_failed_saves,
            heartbeat_interval_s=heartbeat_interval_s,
            hang_timeout_s=hang_timeout_s,
            join_timeout_s=join_timeout_s,
            phase_budgets_s=phase_budgets_s,
            hooks=hooks,
            memory_every=memory_every,
            memory_commit_every=memory_commit_every,
            preflight=preflight,
        )
        self.url, self.save_every = checkpoint_url, save_every
        self.memory_every, self.memory_root = memory_every, memory_root
        self.memory_commit_every = memory_commit_every
        self.keep_last, self.keep_every = keep_last, keep_every
        self.max_failed_saves = max_failed_saves
        self.heartbeat_interval_s, self.hang_timeout_s = heartbeat_interval_s, hang_timeout_s
        self.detector_config = detector
        self.storage_options = storage_options
        self.layout = layout
        self.fallback = fallback
        # (Checkpointer.load's ``optional``: values an older script's steps lack keep theirs)
        self.optional_values = _optional_names(optional_values)
        self.hooks = list(hooks)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.events = EventLog(
            event_log if event_log is not None else default_event_log(checkpoint_url)
        )
        self.events.write(
            "start",
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            attempt=attempt_key(),  # the workers' attempt: a restart, or a new rendezvous round
            generation=generation(),  # in-job recovery's generation of the group
            process_start=process_start_time(),
        )
        detecting = detect if detect is not None else detect_by_default()
        if monitor is None and detecting and self.world_size > 1:
            monitor = take_over(self.rank, self.world_size)  # started before the process group
            if monitor is not None:
                _adopt(monitor, detector, self.events)
            else:
                monitor = start_monitor(self.rank, self.world_size, detector, self.events)
        self.monitor = monitor
        self.step = 0  # the last completed step
        self.restored_step: int | None = None
        self.state: dict[str, Any] = {}
        self.checkpointer: Checkpointer | None = None
        self._saved_step: int | None = None  # the newest step a save was issued for
        self._committed_step: int | None = None  # the newest step this run saw committed
        self._failed_saves = 0  # consecutive
        self._preempt = threading.Event()
        self._old_handler: Any = None
        self._busy_s: float | None = None
        self._handle: Any = None  # the newest save, until it is settled (logged, counted)
        self._snap: Any = None  # the newest memory snapshot, until it is settled
        self._failed_snapshots = 0  # consecutive
        # a steps() loop completed and gave the node's memory back: another loop of this run
        # starts with a new checkpointer (its tier open again)
        self._released = False
        self._ckpt_layout: Layout | None = None
        self._failing = False
        self._carry = False  # (in-job recovery) the checkpointer goes on to the next generation
        # (in-job recovery) this rank takes a peer's failure over, with a checkpointer to carry or
        # none (the loop failed before track, or there is no checkpoint URL)
        self._in_job_next = False
        self._rebind = False  # (in-job recovery) the checkpointer came from the previous one
        self._install_sigterm()
        if monitor is not None and injob_enabled():
            monitor.on_peer_failure = self._peer_failed
        if preflight:
            self._preflight(preflight)

    def _preflight(self, setting: Any) -> None:
        """Every rank checks the job together (a collective) and gets the same verdict; on a
        failing one, every rank refuses to train with the same message."""
        config = setting if isinstance(setting, PreflightConfig) else PreflightConfig.quick_check()
        report = run_preflight(config)
        if not report.ok:  # a noisy moment must not stop a job: refused when it fails again
            log.warning("preflight failed (%s); measuring again", "; ".join(report.failures))
            report = run_preflight(config)
        if self.rank == 0:
            self.events.write(
                "preflight",
                rank=0,
                ok=report.ok,
                used_s=round(report.used_s, 3),
                failures=report.failures[:50],
            )
        if report.ok:
            log.info("preflight passed on %d rank(s) in %.1f s", self.world_size, report.used_s)
            return
        self.close()  # a deliberate, agreed stop: no peer is declared dead for it
        raise PreflightError(
            f"preflight refused to train: {'; '.join(report.failures)}. Drain or fix what is "
            f"named and start again (`resilient preflight --json FILE` on the same ranks shows "
            f"every figure; Run(preflight=False) trains without the check)",
            report=report,
        )

    def _peer_failed(self, finding: Any) -> None:
        """(in-job recovery; the monitor's thread) A verdict on another rank: a commit that waits
        for it gives up now, so the loop reaches its next collective, which fails, and regroups."""
        if self.checkpointer is not None:
            self.checkpointer.abort()

    # --- state -----------------------------------------------------------------------------------
    def track(self, *, layout: Layout | None = None, **objects: Any) -> int:
        """Register the state to checkpoint and **restore it in place from the newest committed
        checkpoint**, if there is one; returns the restored step (0 for a fresh run).

        Objects: modules, optimizers, loaders, anything Stateful, tensors, JSON values.
        ``layout`` describes how the state is split, when it is.  The newest step that fails
        verification falls back, with a warning, to the one before (``fallback=True``)."""
        reserved = {"run", "rng"} & set(objects)
        if reserved:
            raise ValueError(f"state names {sorted(reserved)} are reserved by Run; rename them")
        self.state = {**objects, "run": {"step": 0}, "rng": RNGState()}
        self._progress(None, "restore")
        call_hooks(self.hooks, "at_phase", "restore", self)
        if self.url is not None:
            self._restore(layout)
        self._progress(None, "setup")
        return self.step

    def _make_checkpointer(self, layout: Layout | None, *, job_id: str | None = None) -> None:
        self.checkpointer = Checkpointer(
            self.url,
            layout=layout,
            job_id=job_id,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            storage_options=self.storage_options,
            memory_every=self.memory_every,
            memory_root=self.memory_root,
            memory_commit_every=self.memory_commit_every,
        )

    def _restore(self, layout: Layout | None) -> None:
        if self._rebind:
            # (in-job recovery) the previous generation's checkpointer, joined to the new group
            # here, where a new one would be built: its collectives come in the same order as
            # the spare's new checkpointer's
            self._rebind = False
            self.checkpointer.rebind()
        self._ckpt_layout = layout or self.layout  # (a second loop's checkpointer's too)
        if self.checkpointer is None:
            self._make_checkpointer(self._ckpt_layout)
        # (a collective: every rank, the one a previous generation's checkpointer came from too)
        if self.checkpointer.memory is not None:
            self.checkpointer.check_memory_room(self.state)
        newest, durable, something = self._what_to_restore()
        if not something:
            return
        t0, t0_mono = time.time(), time.monotonic()  # (when, for the log; how long, measured)
        try:
            loaded = self.checkpointer.load(
                self.state, fallback=self.fallback, optional=self.optional_values
            )
        except ResilientError as e:
            if durable or isinstance(e, RankFailureError):
                raise
            # nothing durable, and no snapshot in memory that is restorable (stale, damaged, of
            # another state): a fresh run, said loudly, rather than the same error at every rerun
            if not isinstance(e, CheckpointNotFoundError):
                where = self.checkpointer.memory.steps if self.checkpointer.memory else "memory"
                message = (
                    f"rank {self.rank}: no durable checkpoint under {self.url}, and the memory "
                    f"tier's snapshots ({where}) cannot be restored: {e}. Starting from step 0."
                )
                log.warning(message)
                warnings.warn(message, stacklevel=3)
            return
        self.step = self._restored_loop_step(loaded)
        self.restored_step = loaded
        self._saved_step = self._committed_step = self.step
        if self.rank == 0:
            last = self.checkpointer.last_load
            source = last.source if last else "durable"
            try:
                offered = [last.newest_memory] if last and last.newest_memory is not None else []
                in_memory = max([*self.checkpointer.memory_steps(), *offered], default=None)
            except (ResilientError, OSError) as e:  # (only for the event: the restore is done)
                log.warning("could not list the memory tier's steps: %s", e)
                in_memory = None
            log.info("restored step %d from %s (%s)", self.step, self.url, source)
            self.events.write(
                "restore",
                rank=0,
                step=loaded,
                start=t0,
                seconds=time.monotonic() - t0_mono,
                skipped_steps=list(last.skipped_steps) if last else [],
                resharded=bool(last and last.resharded),
                source=source,
                peer_files=last.peer_files if last else 0,
                sealed=bool(last and last.sealed),  # committed from the ranks' staged records
                # what was committed when the restore began: a chaos run's proof that the restore
                # took the newest step there was (nothing committed was lost)
                newest_durable=newest,
                newest_memory=in_memory,
            )

    def _restored_loop_step(self, loaded: int) -> int:
        """The step the restored state's loop had done (``run.step``): the same as the step it
        was saved as for every save ``Run`` makes.  A value that is no step number, or one below
        the step it was loaded from (the loop would train the steps up to that one again and save
        them over the committed ones, its samples seen twice), is refused; one above it (a
        checkpoint imported or converted as another step number) resumes after it, said loudly."""
        value = self.state["run"]["step"]
        where = f"rank {self.rank}: the value 'run.step' of step {loaded} under {self.url}"
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise StateMismatchError(
                f"{where} is {_short(value)} ({type(value).__name__}), expected the int step number "
                f"(in [0, 2**63 - 1]) that Run saved there; the checkpoint is damaged or was not "
                f"written by Run: move step {loaded}'s directory aside (the step before it is "
                f"restored then) or start a fresh run (another checkpoint URL)"
            )
        if value < loaded:
            raise StateMismatchError(
                f"{where} is {value}, expected {loaded} (Run saves each step with its own "
                f"number): resuming after step {value} would train steps {value + 1}..{loaded} "
                f"again and save them over the committed ones. The checkpoint is damaged or was "
                f"edited: move step {loaded}'s directory aside (the step before it is restored "
                f"then) or start a fresh run (another checkpoint URL)"
            )
        if value > loaded:
            message = (
                f"{where} is {value}: the state was saved by a loop at step {value} and stored "
                f"as step {loaded} (imported or converted under another number); resuming after "
                f"step {value}"
            )
            log.warning(message)
            warnings.warn(message, stacklevel=4)
        return value

    def _what_to_restore(self) -> tuple[int | None, bool, bool]:
        """(the newest durable step this rank found, whether durable storage holds a commit,
        whether there is anything to load): the last two agreed by every rank, since the load is
        a collective, and a rank that skipped it (its listing failed, or saw another state of
        the storage than rank 0's) would leave the others waiting in it.  A listing that fails
        counts as a commit: the load then says what is wrong."""
        ck = self.checkpointer
        assert ck is not None
        newest = None
        try:
            newest = ck.latest_step()
            durable = newest is not None
        except ResilientError as e:
            log.warning("rank %d: cannot list the durable steps of %s: %s", self.rank, self.url, e)
            durable = True
        # (across nodes, this node's memory may be empty while another's holds the snapshots:
        # the load looks on every node, and says "nothing" on every rank alike; on one node,
        # sealed snapshots and commits cut short are staged records, not yet memory_steps(),
        # which the load seals first)
        across = ck.memory is not None and ck.nodes.nodes > 1
        try:
            memory = across or bool(ck.memory_steps()) or ck._has_staged()
        except ResilientError as e:
            log.warning("rank %d: cannot list this node's memory tier: %s", self.rank, e)
            memory = True
        if self.distributed and self.world_size > 1:
            flags = torch.tensor(
                [int(durable), int(memory)], dtype=torch.int32, device=collective_device()
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            durable, memory = bool(flags[0].item()), bool(flags[1].item())
        return newest, durable, durable or memory

    # --- the loop ----------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps after the restored one up to ``total``; save, watch and handle SIGTERM
        between them.  When the loop completes, the final step is committed synchronously before
        this returns (whatever ``save_every`` is); a SIGTERM that came meanwhile stops the run
        there (SystemExit), as one between steps does."""
        if not self.state:
            raise RuntimeError(
                "call run.track(...) before run.steps(...), so there is state to save"
            )
        if isinstance(total, bool) or not isinstance(total, numbers.Integral) or total < 0:
            raise ValueError(
                f"run.steps(total): total must be an int >= 0 (the number of the last step), got "
                f"{total!r} ({type(total).__name__}); pass the last step's number as an int"
            )
        if self._released and total > self.step:
            # (a second loop) the first one gave the node's memory back; its final step is
            # durable, and this checkpointer's snapshots continue from it, as after a restart
            self._released = False
            done, self.checkpointer = self.checkpointer, None
            done.close()
            # the same job (a process's own job id is new with every checkpointer), and its
            # snapshots descend from the final commit, as after a restore
            self._make_checkpointer(self._ckpt_layout, job_id=done.job_id)
            self.checkpointer.continue_line_of(done)
            if self.checkpointer.memory is not None:
                self.checkpointer.check_memory_room(self.state)
        first = self.step + 1
        if first <= total and self._agree_preempted():
            # SIGTERM came before the first step (in the restore, the model's build): stop now,
            # not after a step (a first step can take long, and the grace period is short)
            self._stop_for_preemption()
        for step in range(first, total + 1):
            self._check_peers()
            call_hooks(self.hooks, "at_step", step, self)
            # the first step of an attempt has its own budget
            self._progress(step, "first_step" if step == first else "train", self._busy_s)
            yield step
            if step == first and self.rank == 0:
                self.events.write("first_step", rank=0, step=step)
            self.step = step
            self.state["run"]["step"] = step
            if self._agree_preempted():
                self._stop_for_preemption()
            # the final step is saved below, synchronously
            if self.memory_every and step % self.memory_every == 0 and step != total:
                self.snapshot()
            else:
                self._poll_snapshot()
            if self.save_every and step % self.save_every == 0 and step != total:
                self.save()
            else:
                self._poll_save()
        self._commit_final()
        if self._agree_preempted():
            # SIGTERM came after the last step's check (in the final commit): the run is complete
            # and committed, and what follows the loop would run into the grace period's SIGKILL;
            # stop as a preemption does (the next run resumes at the final step, and goes on)
            if self.rank == 0:
                log.warning(
                    "preempted: the final step %d is committed to %s; stopping", self.step, self.url
                )
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def save(self, *, wait: bool = False) -> None:
        """Save the tracked state at the current step (asynchronously unless ``wait``).

        The previous save is joined first; if it failed, the failure is logged and counted (see
        ``max_failed_saves``) instead of raised.  With ``wait`` this save is final: its failure
        is raised."""
        if self.checkpointer is None:
            return
        self._progress(self.step, "checkpoint")
        self._join_save(final=False)
        handle = self.checkpointer.save(self.step, self.state)
        self._handle = handle
        self._saved_step = self.step
        if not wait:  # the snapshot is taken: back to training
            self._progress(self.step, "train", self._busy_s)
        call_hooks(self.hooks, "during_save", self.step, self)
        if wait:
            self._progress(self.step, "commit")
            self._join_save(final=True)
            self.checkpointer.wait()  # and its clean-up (retention), before returning

    def snapshot(self) -> None:
        """Snapshot the tracked state into the node's memory at the current step (the memory tier;
        ``memory_every`` does it for you).  The previous snapshot is joined first; a failed one
        is logged and warned about, never raised: durable saves still protect the run."""
        if self.checkpointer is None or self.checkpointer.memory is None:
            return
        self._progress(self.step, "checkpoint")
        self._join_snapshot()
        try:
            self._snap = self.checkpointer.snapshot(self.step, self.state)
        except ResilientError as e:  # it could not even start (the tier's directory is gone, ...)
            self._snapshot_failed(self.step, e)
        self._progress(self.step, "train", self._busy_s)

    def _poll_snapshot(self) -> None:
        h = self._snap
        if h is not None and h.done():
            self._join_snapshot()

    def _join_snapshot(self) -> None:
        h, self._snap = self._snap, None
        if h is None:
            return
        try:
            h.wait()
        except Exception:  # reported below (an interrupt is not swallowed)
            pass
        error = h.error
        if error is None:
            self._failed_snapshots = 0
            return
        self._snapshot_failed(h.step, error)

    def _snapshot_failed(self, step: int, error: BaseException) -> None:
        self._failed_snapshots += 1
        self.events.write(
            "snapshot",
            rank=self.rank,
            step=step,
            ok=False,
            error=f"{type(error).__name__}: {error}"[:2000],
            consecutive_failures=self._failed_snapshots,
        )
        message = (
            f"rank {self.rank}: memory snapshot of step {step} failed: {error}. Training goes "
            f"on; a restart restores the newest snapshot that verifies, or durable storage."
        )
        log.warning(message)
        warnings.warn(message, SaveFailedWarning, stacklevel=3)

    def _release_memory(self) -> None:
        """The run completed and its final step is durable: give the node's memory back."""
        ckpt = self.checkpointer
        if ckpt is None or ckpt.memory is None:
            return
        self._join_snapshot()
        ckpt.close_memory()
        if self.distributed and self.world_size > 1:
            dist.barrier()  # every rank of the node is done with the tier
        if ckpt.nodes.is_leader(self.rank):  # one rank per node (memory root)
            ckpt.memory.release()
        self._released = True

    def _commit_final(self) -> None:
        """The run completed: make sure its final step is committed before returning."""
        if self.checkpointer is None:
            return
        self._join_snapshot()
        self._commit_final_durable()
        self._release_memory()

    def _commit_final_durable(self) -> None:
        assert self.checkpointer is not None
        if self._handle is not None and self._handle.step == self.step:
            self._progress(self.step, "commit")
            self._join_save(final=True)
            self.checkpointer.wait()
        elif self._committed_step != self.step:
            self.save(wait=True)
        else:
            self._join_save(final=False)
            self.checkpointer.wait()

    # --- saves: settle each one once ------------------------------------------------------------
    def _poll_save(self) -> None:
        h = self._handle
        if h is not None and h.done():
            self._handle = None
            self._settle(h, final=False)

    def _join_save(self, *, final: bool) -> None:
        h = self._handle
        if h is None:
            return
        try:
            h.wait()
        except Exception:  # settled below, once
            pass
        # (an interrupt, Ctrl-C, goes on from the wait: the save still runs and stays pending,
        # for close() to settle once it is over)
        self._handle = None
        self._settle(h, final=final)

    def _settle(self, h: Any, *, final: bool) -> None:
        """Log a finished save; count a failed one, and raise it when it is final, not transient
        (another job owns the URL), or one too many in a row.  A save still running is not
        settled: it stays the pending one (its error is None only because it is not over)."""
        if not h.done():
            self._handle = h
            return
        error = h.error
        if error is None:
            self._failed_saves = 0
            self._committed_step = h.step
            if self.rank == 0:
                self._save_event(h, None)
            return
        try:
            h.wait()  # marks it reported: the checkpointer's next save/wait will not raise it again
        except Exception:
            pass
        self._failed_saves += 1
        self._save_event(h, error)
        if not isinstance(error, ResilientError) or isinstance(error, LeaseError):
            raise error
        newest = (
            f"step {self._committed_step}" if self._committed_step is not None else "no step yet"
        )
        if final or self._failed_saves >= self.max_failed_saves:
            why = (
                "the final save failed"
                if final
                else f"{self._failed_saves} consecutive saves failed (max_failed_saves="
                f"{self.max_failed_saves})"
            )
            error.add_note(
                f"rank {self.rank}: {why}; the newest committed step is {newest}. Fix the storage "
                f"({self.url}) and rerun: the run resumes from there."
            )
            raise error
        message = (
            f"rank {self.rank}: checkpoint save of step {h.step} failed: {error}. Training goes "
            f"on; the newest committed step is {newest}. {self._failed_saves} consecutive failed "
            f"save(s); the run stops after {self.max_failed_saves}."
        )
        log.warning(message)
        warnings.warn(message, SaveFailedWarning, stacklevel=3)

    def _save_event(self, h: Any, error: BaseException | None) -> None:
        st = h.stats
        self.events.write(
            "save",
            rank=self.rank,
            step=h.step,
            ok=error is None,
            error=None if error is None else f"{type(error).__name__}: {error}"[:2000],
            consecutive_failures=self._failed_saves if error is not None else 0,
            started_at=h.started_at,
            committed_at=h.finished_at if error is None else None,
            stage_s=st.stage_s,
            write_s=st.write_s,
            commit_s=st.commit_s,
            bytes=st.bytes_written,
        )

    def report_compute(self, seconds: float) -> None:
        """The time this rank spent computing in the step just done, without waiting in
        collectives.  Optional: it lets the detector tell a straggler apart in a synchronous job,
        where every rank's wall-clock step is as long as the slowest rank's."""
        self._busy_s = float(seconds)

    def _progress(self, step: int | None, phase: str, busy_s: float | None = None) -> None:
        if self.monitor is not None:
            self.monitor.progress(step, phase, busy_s)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        failed = exc is not None and not isinstance(exc, SystemExit | GeneratorExit)
        if failed:
            self._failing = True  # from here a SIGTERM (torchrun tearing the group down) ends it
            if recoverable_in_job(exc):
                # in-job recovery comes next: no wait for a verdict, and a commit that waits
                # for the dead peer gives up now
                self.events.write("error", rank=self.rank, error=_describe_exc(exc))
                self._in_job_next = True
                if self.monitor is not None:
                    self.monitor.leaving(self.step)  # not to be declared dead meanwhile
                if self.checkpointer is not None:
                    self.checkpointer.abort()
                    # kept for the next generation: its memory tier, persister and lease; the
                    # saves the abort abandoned are not waited for
                    self._carry = self.checkpointer.can_rebind
            else:
                self.explain_failure(exc)
        self.close(announce=not failed)  # a crashed rank is not "done": peers must see it die

    def explain_failure(self, exc: BaseException) -> None:
        """A collective that failed because a peer died says nothing about which peer, or why.
        Before this rank exits with ``exc``, give the detector a moment (its dead timeout plus two
        intervals) to name the failed rank: on a verdict the monitor writes the failure record and
        the stacks and exits with ``EXIT_RANK_FAILURE`` itself; without one, ``exc`` goes on.
        torchrun's own SIGTERM (it saw a worker exit) ends the wait: recovery comes first."""
        if self.monitor is None or not _is_peer_failure(exc):
            return
        self.events.write("error", rank=self.rank, error=_describe_exc(exc))
        config = self.monitor.config
        deadline = time.monotonic() + config.dead_timeout_s + 2 * config.interval_s
        # a SIGTERM already here is torchrun tearing the group down: it knows, so go at once
        while (
            time.monotonic() < deadline
            and self.monitor.verdict() is None
            and not self._preempt.is_set()
        ):
            time.sleep(config.interval_s / 10)

    def close(self, *, announce: bool = True) -> None:
        """Wait for pending saves and restore the SIGTERM handler; ``announce``: tell peers this
        rank finished (False when it is failing, and then a save's failure is logged, not raised
        over the error that ends the run)."""
        if self._in_job_next and self.monitor is not None:
            # a late verdict neither exits nor aborts the next generation, and one the monitor's
            # thread missed is answered at its close (a kill this rank is named for), whether or
            # not a checkpointer goes on
            self.monitor.hand_over()
        try:
            if self.checkpointer is not None and not self._carry:
                try:
                    self._join_snapshot()
                    pending = self._handle
                    if not announce and pending is not None and not pending.done():
                        log.warning(
                            "rank %d: waiting for the save of step %d to finish before exiting "
                            "(interrupt again to abandon it: the newest committed step then "
                            "stays %s)",
                            self.rank,
                            pending.step,
                            self._committed_step,
                        )
                    self._join_save(final=announce)
                    self.checkpointer.close()
                except ResilientError as e:
                    if announce:
                        raise
                    log.error("rank %d: a pending save failed while failing: %s", self.rank, e)
        finally:
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
                self._old_handler = None
            if self.monitor is not None:
                self.monitor.close(announce=announce)

    # --- preemption and peers -----------------------------------------------------------------------
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only

        def handler(signum, frame):
            if self._failing or (self.monitor is not None and self.monitor.verdict() is not None):
                # not a preemption: torchrun is tearing down a failed group, and this rank cannot
                # save anyway (a peer is gone); waiting would hold the restart for 30 s
                self.events.write("exit", rank=self.rank, code=EXIT_RANK_FAILURE, reason="SIGTERM")
                if self.monitor is not None:
                    self.monitor.leaving(self.step)
                os._exit(EXIT_RANK_FAILURE)
            self._preempt.set()

        self._old_handler = signal.signal(signal.SIGTERM, handler)

    def _agree_preempted(self) -> bool:
        """Whether any rank was told to stop: all ranks stop at the same step boundary."""
        if not self.distributed or self.world_size == 1:
            return self._preempt.is_set()
        flag = torch.tensor(
            [1 if self._preempt.is_set() else 0], dtype=torch.int32, device=collective_device()
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _stop_for_preemption(self) -> None:
        self._commit_final()
        if self.rank == 0:
            log.warning("preempted: saved step %d to %s and stopping", self.step, self.url)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _check_peers(self) -> None:
        if self.monitor is not None:
            verdict = self.monitor.verdict()
            if verdict is not None:
                raise RankFailureError(str(verdict))


def _adopt(monitor: Monitor, config: DetectorConfig, events: EventLog) -> None:
    """Run's settings win over the ones the early monitor started with; its events go to the run's
    log when the run has one."""
    monitor.reconfigure(config)
    if events.path:
        monitor.events = events


def check_run_options(
    *,
    save_every: int,
    keep_last: int,
    keep_every: int | None,
    max_failed_saves: int,
    heartbeat_interval_s: float,
    hang_timeout_s: float | None,
    join_timeout_s: float,
    phase_budgets_s: dict[str, float] | None,
    hooks: Sequence[Any] = (),
    memory_every: int | None = None,
    memory_commit_every: int = 1,
    preflight: Any = False,
) -> DetectorConfig:
    """Validate ``Run``'s values (before any process group exists, when ``fault_tolerant`` calls
    it); returns the detector settings they make."""
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 0:
        raise ValueError(
            f"save_every must be an int >= 0 (0: only at preemption and the end), got {save_every!r}"
        )
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if keep_every is not None and (
        isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1
    ):
        raise ValueError(f"keep_every must be None or an int >= 1, got {keep_every!r}")
    if (
        isinstance(max_failed_saves, bool)
        or not isinstance(max_failed_saves, int)
        or max_failed_saves < 1
    ):
        raise ValueError(
            f"max_failed_saves must be an int >= 1 (1: the first failed save ends the run), "
            f"got {max_failed_saves!r}"
        )
    check_memory_options(memory_every, memory_commit_every)
    if not isinstance(preflight, bool | PreflightConfig):
        raise ValueError(
            f"preflight must be True, False or a resilient.preflight.PreflightConfig, got "
            f"{preflight!r}"
        )
    if isinstance(hooks, str | bytes) or not isinstance(hooks, Sequence):
        raise ValueError(f"hooks must be a list of hook objects, got {hooks!r}")
    # (Run's names: the detector's own check would name its fields, interval_s for one)
    check_seconds("heartbeat_interval_s", heartbeat_interval_s)
    check_seconds("hang_timeout_s", hang_timeout_s, none_ok=True)
    check_seconds("join_timeout_s", join_timeout_s)
    if phase_budgets_s is not None:
        if not isinstance(phase_budgets_s, Mapping):
            raise ValueError(
                f"phase_budgets_s must map phase names to seconds, got {phase_budgets_s!r}"
            )
        # the phases the loop announces (a misspelt one would be a budget nothing ever uses)
        known = (*DEFAULT_PHASE_BUDGETS_S, "first_step", "train")
        unknown = sorted(str(k) for k in phase_budgets_s if k not in known)
        if unknown:
            raise ValueError(
                f"phase_budgets_s names phases the loop does not go through: {unknown}; its "
                f"phases are {list(known)}"
            )
    return DetectorConfig(
        interval_s=heartbeat_interval_s,
        hang_timeout_s=hang_timeout_s,
        join_timeout_s=join_timeout_s,
        phase_budgets_s=dict(phase_budgets_s or {}),
    )


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective's error (a peer closed its connection, a backend timeout), not this rank's."""
    if isinstance(exc, RankFailureError):
        return False
    dist_error = getattr(dist, "DistError", ())
    text = str(exc)
    return isinstance(exc, dist_error) or (
        isinstance(exc, RuntimeError)
        and any(
            s in text for s in ("gloo", "NCCL", "Connection closed by peer", "Connection reset")
        )
    )


def recoverable_in_job(exc: BaseException) -> bool:
    """Under ``resilient launch`` with spares: an error that means a peer failed (a collective's,
    or the detector's verdict on another rank), which in-job recovery answers."""
    return injob_enabled() and (_is_peer_failure(exc) or isinstance(exc, RankFailureError))


class InJobRecovery:
    """In-job recovery for a loop that builds its own ``Run`` (what ``@fault_tolerant`` does for
    its function): under ``resilient launch`` with spares, a peer's failure is answered in this
    process, without a restart::

        recovery = InJobRecovery("gloo", detector=..., event_log=...)
        while True:
            run = Run(url, ...)
            recovery.attach(run)      # the previous generation's checkpointer, if any
            try:
                with run:
                    ...build the model, run.track(...), train...
                    break
            except BaseException as e:
                recovery.recover(e)   # re-raises what in-job recovery does not answer

    ``recover`` leaves the broken process group, waits for the spare's generation, forms it
    (``resilient.launch.regroup``) and returns: build the model again and ``track`` it, which
    restores the newest snapshot every rank holds.  The checkpointer (its memory tier, its
    persister process, the writer lease) goes on to the new ``Run`` when it can."""

    def __init__(self, backend: str, **group: Any) -> None:
        self.backend, self.group = backend, group
        self._run: Run | None = None
        self._carried: Checkpointer | None = None

    def attach(self, run: Run) -> None:
        """The ``Run`` of this generation (before its ``track``): it gets the previous
        generation's checkpointer, if any, and is the one ``recover`` closes over."""
        self._run = run
        carried, self._carried = self._carried, None
        if carried is not None and run.checkpointer is None:
            run.checkpointer = carried
            run._rebind = True

    def recover(self, error: BaseException) -> None:
        """Answer ``error`` in this process (raised in or after the attached ``Run``'s ``with``
        block), or re-raise it: not under ``resilient launch`` with spares, not a peer's failure,
        or no ``Run`` attached yet."""
        run, self._run = self._run, None
        if run is None or not recoverable_in_job(error):
            raise error
        events = EventLog(self.group.get("event_log"))
        t0 = time.monotonic()
        events.write("injob_leave", rank=run.rank, error=_describe_exc(error))
        carried = run.checkpointer if run._carry else None
        # Let go of everything that holds the old groups (the model and its parallel context,
        # in the failed attempt's frames and in the run's state): a gloo group closes its
        # connections only when it is freed, not when it is destroyed (nor aborted), and a
        # healthy peer still blocked in a collective with this rank is released only by that.
        traceback.clear_frames(error.__traceback__)
        run.state = {}
        del run
        freed = _free_process_groups()
        t_freed = time.monotonic()
        if freed == "held":
            log.warning(
                "in-job recovery: a broken process group is still referenced after a full garbage "
                "collection (a module-level cache or global holds it?); a peer blocked in a "
                "collective with this rank waits for that collective's timeout"
            )
        gen = regroup(self.backend, **self.group)
        self._carried = carried  # rebound by the next Run's track(), where a new one is built
        events.write(
            "injob_rejoin",
            rank=dist.get_rank(),
            generation=gen,
            regroup_s=round(time.monotonic() - t0, 3),
            free_s=round(t_freed - t0, 3),
            freed=freed,
            kept_checkpointer=carried is not None,
        )


_SAVE_THREAD_GRACE_S = 1.0


def _free_process_groups() -> str:
    """Destroy the broken groups and free them, which closes their connections.  A collection
    always runs (a cycle may hold a group's backend, a DDP reducer or a pending work, which no
    weakref to the group shows); it is cheap when start-up's objects are frozen (``gc.freeze()``).
    If a group object is still alive after it, the memory tier's snapshot threads get a moment (one
    inside a failing collective holds its group until it returns); then everything is collected,
    frozen objects included (a frozen cycle holds it), and the survivors frozen again.  Returns
    "collected", "all", or
    "held" (something still references a group: a peer blocked in a collective with this rank
    waits for that collective's timeout)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {}) if dist.is_initialized() else []
    refs = [weakref.ref(g) for g in groups]
    del groups
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if not any(r() is not None for r in refs):
        return "collected"
    # an abandoned snapshot's thread may still be inside a collective of a broken group (its
    # replication; it fails once the dead peer's connection resets or a peer frees its group) and
    # holds the group until it returns: a moment for it first (a durable save's holds none)
    join_running("resilient-ckpt-snapshot", _SAVE_THREAD_GRACE_S)
    gc.collect()
    if not any(r() is not None for r in refs):
        return "collected"
    gc.unfreeze()  # objects a gc.freeze() made permanent are collectable again
    gc.collect()
    gc.freeze()  # and what survives is start-up's again: later collections skip it
    return "all" if not any(r() is not None for r in refs) else "held"


def _describe_exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def process_start_time() -> float:
    """When this process started (wall clock; Linux /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


def fault_tolerant(
    checkpoint_url: str,
    *,
    save_every: int = 100,
    keep_last: int = 3,
    heartbeat_interval_s: float = 1.0,
    hang_timeout_s: float | None = None,
    **run_kwargs: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap ``train(run, ...)``: creates the process group under torchrun (gloo on CPU, nccl on
    GPU) if the caller has not, with the heartbeat already running, hands the function a ``Run``,
    and closes it at the end.  Works in a single process without torchrun too.

    ``run_kwargs`` are ``Run``'s other options (``keep_every``, ``max_failed_saves``,
    ``join_timeout_s``, ``phase_budgets_s``, ``event_log``, ``hooks``, ...).  An unknown option or a
    bad value is rejected here, when the decorator is applied: before any process group exists."""
    unknown = sorted(set(run_kwargs) - _RUN_OPTIONS)
    if unknown:
        import difflib

        hints = [
            f"{u!r} (did you mean {m[0]!r}?)"
            if (m := difflib.get_close_matches(u, _RUN_OPTIONS, 1))
            else repr(u)
            for u in unknown
        ]
        raise TypeError(
            f"fault_tolerant() got unknown option(s) {', '.join(hints)}; it takes "
            f"{', '.join(sorted(_RUN_OPTIONS | _DECORATOR_OPTIONS))}"
        )
    options = {
        "save_every": save_every,
        "keep_last": keep_last,
        "heartbeat_interval_s": heartbeat_interval_s,
        "hang_timeout_s": hang_timeout_s,
        **run_kwargs,
    }
    checked = {k: options[k] for k in _CHECKED if k in options}
    detector = check_run_options(**{**_CHECK_DEFAULTS, **checked})
    _optional_names(options.get("optional_values", ()))  # (Run's check, before any group)
    event_log = options.get("event_log") or default_event_log(checkpoint_url)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def runner(*args: Any, **kwargs: Any) -> Any:
            created = False
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            group = {
                "detector": detector,
                "event_log": event_log,
                "detect": options.get("detect"),
                "hooks": options.get("hooks", ()),
            }
            if (
                int(os.environ.get("WORLD_SIZE", "1")) > 1
                and dist.is_available()
                and not dist.is_initialized()
            ):
                init_process_group(backend, **group)
                created = True
            recovery = InJobRecovery(backend, **group) if created else None
            try:
                while True:
                    run = Run(checkpoint_url, **options)
                    if recovery is not None:
                        recovery.attach(run)
                    try:
                        with run:
                            return fn(run, *args, **kwargs)
                    except BaseException as e:
                        if recovery is None:
                            raise
                        run = None  # noqa: F841 (nothing here may hold the old groups)
                        recovery.recover(e)  # or re-raises e
            finally:
                if created and dist.is_initialized():
                    dist.destroy_process_group()

        return runner

    return wrap


_RUN_OPTIONS = {
    name
    for name, p in inspect.signature(Run.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}
_DECORATOR_OPTIONS = {"save_every", "keep_last", "heartbeat_interval_s", "hang_timeout_s"}
_CHECKED = set(inspect.signature(check_run_options).parameters)
_CHECK_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(Run.__init__).parameters.items()
    if name in _CHECKED
}
