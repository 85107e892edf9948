"""Long-lived background threads for a checkpointer's saves' commits.

A thread per save made the caller of ``save()``/``snapshot()`` wait for the new thread to be
scheduled (``Thread.start`` waits until it runs): on a machine whose cores are busy with training,
that wait is a scheduler's time slice, at every snapshot.  A worker's thread, once started, waits
for the next job; it ends after ``idle_s`` without work (a durable save every few minutes starts
one again, which costs what a thread per save did) and when its checkpointer closes.  A job never
waits behind another: when no thread is idle, the job gets a new one (see ``Worker``).

A job looks like a thread to the code that waits for it (``join(timeout)``, ``is_alive()``,
``name``), and while it runs the worker's thread carries the job's name, so that a stack dump names
the save it is in.  A finished job holds nothing of what it ran (its function and arguments are
dropped), so that the objects a save used (a process group) can be collected once it is over.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

IDLE_NAME = "resilient-ckpt-idle"

_live: set[Job] = set()  # jobs submitted and not done yet, by every worker of this process
_live_lock = threading.Lock()
os.register_at_fork(after_in_child=_live.clear)  # a forked child runs none of them


class Job:
    """A save's background work, submitted to a ``Worker``."""

    def __init__(self, name: str, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.name = name
        self._call: tuple[Callable[..., None], tuple[Any, ...]] | None = (fn, args)
        self._done = threading.Event()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def _run(self) -> None:
        call, self._call = self._call, None
        assert call is not None
        fn, args = call
        del call
        try:
            fn(*args)
        except BaseException:  # the job reports its own failures; this is a bug's last word
            # (as text: a handler that keeps records must not keep the job's frames alive)
            log.error("background job %s failed:\n%s", self.name, traceback.format_exc())
        finally:
            del fn, args
            with _live_lock:
                _live.discard(self)
            self._done.set()


class Worker:
    """Runs each submitted job on an idle thread of its own, started when none is idle; a thread
    waits ``idle_s`` for the next job, then ends.  A checkpointer submits its next save once the
    previous one is over, so one thread serves a run of saves; a job that outlives its turn (the
    old group's save after an in-job recovery, still waiting on a broken peer or the persister)
    keeps its thread, and the next job gets another instead of queueing behind it."""

    def __init__(self, idle_s: float = 5.0) -> None:
        self.idle_s = idle_s
        self._cv = threading.Condition()
        self._jobs: collections.deque[Job] = collections.deque()
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting for a job
        self._pid = os.getpid()  # a forked child has none of its parent's threads
        self._stop = False

    @property
    def threads(self) -> set[threading.Thread]:
        with self._cv:
            return set(self._threads)

    def submit(self, name: str, fn: Callable[..., None], *args: Any) -> Job:
        """Run ``fn(*args)`` on an idle thread, or a new one; raises (and runs nothing) when no
        thread can be started."""
        job = Job(name, fn, args)
        with self._cv:
            if self._pid != os.getpid():  # a forked child: the parent's threads and jobs are not
                self._threads, self._idle, self._pid = set(), 0, os.getpid()  # here
                self._jobs.clear()
            self._stop = False
            self._jobs.append(job)
            if self._idle >= len(self._jobs):
                self._cv.notify()
            else:
                thread = threading.Thread(target=self._loop, name=name, daemon=True)
                try:
                    thread.start()  # (it waits for the lock held here before it looks)
                except BaseException:
                    self._jobs.remove(job)
                    raise
                self._threads.add(thread)
            with _live_lock:
                _live.add(job)
        return job

    def stop(self) -> None:
        """Let the threads end once the jobs are done (they are not waited for)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                self._idle += 1
                try:
                    deadline = time.monotonic() + self.idle_s
                    while not self._jobs:
                        left = deadline - time.monotonic()
                        if self._stop or left <= 0:
                            self._threads.discard(me)  # (under the lock: a submit starts another)
                            return
                        self._cv.wait(left)
                    job = self._jobs.popleft()
                finally:
                    self._idle -= 1
            me.name = job.name
            try:
                job._run()
            finally:
                me.name = IDLE_NAME
                del job


def join_running(prefix: str, timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for the jobs of this process whose name starts with
    ``prefix`` that are submitted and not done yet."""
    deadline = time.monotonic() + timeout
    with _live_lock:
        jobs = [j for j in _live if j.name.startswith(prefix)]
    for job in jobs:
        job.join(max(0.0, deadline - time.monotonic()))
