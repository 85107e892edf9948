"""The ``@fault_tolerant`` decorator and ``Run``: auto-resume, periodic async saves, preemption.

``Run`` owns the training loop's contract with the toolkit (DESIGN.md section 5): ``track`` names
the state and restores the newest committed step (falling back, with a warning, to the step before
when the newest fails verification); ``steps`` yields the remaining steps, saves asynchronously every
``save_every`` steps, turns SIGTERM into a synchronous save and a clean exit, and waits for pending
saves at the end.  RNG states (python, numpy, torch CPU and CUDA) and the step are tracked without
the user asking.  Failure detection (heartbeats, verdicts) plugs in through ``monitor``.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from resilient.checkpoint import Checkpointer
from resilient.errors import RankFailureError
from resilient.health import EXIT_RANK_FAILURE, DetectorConfig, EventLog, Monitor
from resilient.launch import init_process_group
from resilient.layout import Layout

__all__ = ["Run", "fault_tolerant", "RNGState", "PREEMPTED_EXIT_CODE"]

log = logging.getLogger(__name__)

# A preempted run that saved and stopped cleanly exits 0: torchrun must not restart it.
PREEMPTED_EXIT_CODE = 0


class RNGState:
    """Stateful RNG states of this rank: python, numpy, torch CPU and every CUDA device (JSON)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_state = np.random.get_state()
        sd = {
            "python": [version, list(internal), gauss],
            "numpy": [
                np_state[0],
                np_state[1].tolist(),
                int(np_state[2]),
                int(np_state[3]),
                float(np_state[4]),
            ],
            "torch": _b64(torch.get_rng_state()),
            "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()]
            if torch.cuda.is_available()
            else [],
        }
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        version, internal, gauss = sd["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = sd["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_unb64(sd["torch"]))
        if sd["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [_unb64(s) for s in sd["cuda"]][: torch.cuda.device_count()]
            )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


class Run:
    """One training run's link to checkpoints, preemption and (later) failure detection."""

    def __init__(
        self,
        checkpoint_url: str | None,
        *,
        save_every: int = 100,
        keep_last: int = 3,
        keep_every: int | None = None,
        heartbeat_interval_s: float = 1.0,
        hang_timeout_s: float | None = None,
        storage_options: dict | None = None,
        layout: Layout | None = None,
        monitor: Any | None = None,
        detect: bool | None = None,
        event_log: str | None = None,
        fallback: bool = True,
    ) -> None:
        if save_every < 0:
            raise ValueError(
                f"save_every must be >= 0 (0: only at preemption and the end), got {save_every}"
            )
        self.url, self.save_every = checkpoint_url, save_every
        self.keep_last, self.keep_every = keep_last, keep_every
        self.heartbeat_interval_s, self.hang_timeout_s = heartbeat_interval_s, hang_timeout_s
        self.storage_options = storage_options
        self.layout = layout
        self.fallback = fallback
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.events = EventLog(
            event_log if event_log is not None else _default_event_log(checkpoint_url)
        )
        self.events.write(
            "start",
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            process_start=process_start_time(),
        )
        if (
            monitor is None
            and (detect if detect is not None else _detect_by_default())
            and self.world_size > 1
        ):
            monitor = _start_monitor(
                self.rank, self.world_size, heartbeat_interval_s, hang_timeout_s, self.events
            )
        self.monitor = monitor
        self.step = 0  # the last completed step
        self.restored_step: int | None = None
        self.state: dict[str, Any] = {}
        self.checkpointer: Checkpointer | None = None
        self._saved_step: int | None = None
        self._preempt = threading.Event()
        self._old_handler: Any = None
        self._busy_s: float | None = None
        self._handle: Any = None  # the newest save, until it is in the event log
        self._failing = False
        self._install_sigterm()
        from resilient.chaos.faults import agent_from_env

        self._chaos = agent_from_env(self.rank, self.events)

    # --- state -----------------------------------------------------------------------------------
    def track(self, *, layout: Layout | None = None, **objects: Any) -> int:
        """Name the state to checkpoint and restore the newest committed step; returns that step
        (0 for a fresh run).  Objects: modules, optimizers, loaders, anything Stateful, tensors,
        JSON values.  ``layout`` describes how the state is split, when it is."""
        reserved = {"run", "rng"} & set(objects)
        if reserved:
            raise ValueError(f"state names {sorted(reserved)} are reserved by Run; rename them")
        self.state = {**objects, "run": {"step": 0}, "rng": RNGState()}
        if self.url is None:  # a run without checkpoints: nothing to restore or save
            return self.step
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(
                self.url,
                layout=layout or self.layout,
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                storage_options=self.storage_options,
            )
        self.state = {**objects, "run": {"step": 0}, "rng": RNGState()}
        if self.checkpointer.latest_step() is not None:
            t0 = time.time()
            loaded = self.checkpointer.load(self.state, fallback=self.fallback)
            self.step = int(self.state["run"]["step"])
            self.restored_step = loaded
            self._saved_step = self.step
            if self.rank == 0:
                log.info("restored step %d from %s", self.step, self.url)
                last = self.checkpointer.last_load
                self.events.write(
                    "restore",
                    rank=0,
                    step=loaded,
                    start=t0,
                    seconds=time.time() - t0,
                    skipped_steps=list(last.skipped_steps) if last else [],
                    resharded=bool(last and last.resharded),
                )
        return self.step

    # --- the loop ----------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps after the restored one up to ``total``; save, watch and handle SIGTERM
        between them."""
        if not self.state:
            raise RuntimeError(
                "call run.track(...) before run.steps(...), so there is state to save"
            )
        first = self.step + 1
        for step in range(first, total + 1):
            self._check_peers()
            if self._chaos is not None:
                self._chaos.at_step(step, self)
            if self.monitor is not None:  # the first step of an attempt has its own budget
                self.monitor.progress(
                    step, "first_step" if step == first else "train", self._busy_s
                )
            yield step
            if step == first and self.rank == 0:
                self.events.write("first_step", rank=0, step=step)
            self.step = step
            self.state["run"]["step"] = step
            if self._agree_preempted():
                self._stop_for_preemption()
            if self.save_every and step % self.save_every == 0:
                self.save()
            elif self._handle is not None:
                self._log_save()
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self._log_save()

    def save(self, *, wait: bool = False) -> None:
        """Save the tracked state at the current step (asynchronously unless ``wait``)."""
        if self.checkpointer is None:
            return
        if self.monitor is not None:
            self.monitor.progress(self.step, "checkpoint")
        self._log_save()
        handle = self.checkpointer.save(self.step, self.state)
        self._handle = handle
        self._saved_step = self.step
        if self.monitor is not None and not wait:  # the snapshot is taken: back to training
            self.monitor.progress(self.step, "train", self._busy_s)
        if self._chaos is not None:
            self._chaos.during_save(self.step, self)
        if wait:
            handle.wait()
            self._log_save()

    def _log_save(self) -> None:
        """Put the last save in the event log once it has finished (rank 0, which commits)."""
        h, self._handle = self._handle, None
        if h is None:
            return
        if not h.done():
            self._handle = h
            return
        if self.rank == 0:
            st = h.stats
            self.events.write(
                "save",
                rank=0,
                step=h.step,
                ok=h.error is None,
                error=None if h.error is None else str(h.error),
                started_at=h.started_at,
                committed_at=h.finished_at,
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

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        failed = exc is not None and not isinstance(exc, SystemExit | GeneratorExit)
        if failed:
            self._failing = True  # from here a SIGTERM (torchrun tearing the group down) ends it
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
        self.events.write("error", rank=self.rank, error=f"{type(exc).__name__}: {exc}"[:2000])
        config = self.monitor.config
        deadline = time.time() + config.dead_timeout_s + 2 * config.interval_s
        # a SIGTERM already here is torchrun tearing the group down: it knows, so go at once
        while (
            time.time() < deadline and self.monitor.verdict() is None and not self._preempt.is_set()
        ):
            time.sleep(config.interval_s / 10)

    def close(self, *, announce: bool = True) -> None:
        """Wait for pending saves and restore the SIGTERM handler; ``announce``: tell peers this
        rank finished (False when it is failing)."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
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
        flag = torch.tensor([1 if self._preempt.is_set() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _stop_for_preemption(self) -> None:
        if self._saved_step != self.step:
            self.save(wait=True)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self.rank == 0:
            log.warning("preempted: saved step %d to %s and stopping", self.step, self.url)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _check_peers(self) -> None:
        if self.monitor is not None:
            verdict = self.monitor.verdict()
            if verdict is not None:
                raise RankFailureError(str(verdict))


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


def _detect_by_default() -> bool:
    """On under torchrun (whose agent restarts the group after a verdict), unless RESILIENT_DETECT=0;
    RESILIENT_DETECT=1 turns it on elsewhere."""
    flag = os.environ.get("RESILIENT_DETECT")
    if flag is not None:
        return flag not in ("0", "false", "no", "")
    return "TORCHELASTIC_RUN_ID" in os.environ


def _default_event_log(url: str | None) -> str | None:
    if url is None:
        return None
    if "://" not in url or url.startswith("file://"):
        return os.path.join(url.removeprefix("file://"), "events.jsonl")
    return None


def _start_monitor(
    rank: int, world_size: int, interval_s: float, hang_timeout_s: float | None, events: EventLog
) -> Monitor:
    """Heartbeats go to torchrun's agent store when there is one (it outlives the workers), else to
    the default process group's store; keys live under a per-run, per-restart prefix."""
    from datetime import timedelta

    if "TORCHELASTIC_RUN_ID" in os.environ:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=60),
        )
        prefix = (
            f"resilient/health/{os.environ['TORCHELASTIC_RUN_ID']}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
    else:
        store = dist.distributed_c10d._get_default_store()
        n = store.add("resilient/health/runs", 1)
        prefix = f"resilient/health/local/{(n - 1) // world_size}"
    events.write(
        "monitor",
        rank=rank,
        prefix=prefix,
        pid=os.getpid(),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    config = DetectorConfig(interval_s=interval_s, hang_timeout_s=hang_timeout_s)
    return Monitor(store, prefix, rank, world_size, config, events=events)


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
    GPU) if the caller has not, hands the function a ``Run``, and closes it at the end.  Works in a
    single process without torchrun too."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def runner(*args: Any, **kwargs: Any) -> Any:
            created = False
            if (
                int(os.environ.get("WORLD_SIZE", "1")) > 1
                and dist.is_available()
                and not dist.is_initialized()
            ):
                init_process_group("nccl" if torch.cuda.is_available() else "gloo")
                created = True
            run = Run(
                checkpoint_url,
                save_every=save_every,
                keep_last=keep_last,
                heartbeat_interval_s=heartbeat_interval_s,
                hang_timeout_s=hang_timeout_s,
                **run_kwargs,
            )
            try:
                with run:
                    return fn(run, *args, **kwargs)
            finally:
                if created and dist.is_initialized():
                    dist.destroy_process_group()

        return runner

    return wrap
