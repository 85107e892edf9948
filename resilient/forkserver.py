"""Start a node's ranks from a process that has torch imported already: a fork server.

A rank's start costs about two seconds of CPU before its first line of training, most of it
``import torch``, and every torchrun restart pays it again on every rank.  A fork server pays it
once per node: it imports the heavy modules, then forks a child per rank, which runs the rank's
module as ``__main__`` the way ``python -m`` would.  It stays out of torchrun's way:

* ``python -m resilient.forkserver host --preload MOD[,MOD...] -- LAUNCHER [ARGS]`` starts the
  server (a child of this process) and then *becomes* the launcher (``exec``, so the pid is the
  same): ``torch.distributed.run``, ``resilient.cli launch``, any module.  The server's socket is
  in the environment (``RESILIENT_FORKSERVER``) that the launcher's workers inherit.  The server
  exits when its parent, the launcher, does.
* ``python -m resilient.forkserver run (-m MODULE | SCRIPT) [ARGS]`` is the worker's command (after torchrun's
  ``-m``).  This process stays torchrun's worker: it hands its arguments, environment, working
  directory and standard streams to the server, which forks the real rank; it forwards the
  signals it gets (torchrun's SIGTERM, SIGINT, ...) to the rank, and ends as the rank ended (its
  exit code, or killed by the same signal).  When it is killed itself (torchrun's SIGKILL), the
  server kills the rank.  With no server in the environment, or one that cannot be reached, it
  runs the module itself: the same rank, started the slow way.
* A program that starts many jobs (the chaos harness) can start their launchers the same way:
  :func:`start_launchers` starts a server that forks launchers, and a job's command is the
  stand-in, ``run -m LAUNCHER ...`` (``host`` included), so that a launcher costs no
  ``import torch`` either.

The rank is the server's child, so a tool that looks for a worker by its environment
(``/proc/PID/environ`` keeps what a process was exec'd with, the server's) finds the stand-in
instead: :func:`rank_pid` maps it to the rank, from the file the server writes for each one
(``pids/<stand-in pid>`` next to the socket).

What a forked rank shares with its siblings: the modules the server imported (and their
module-level state, set before any rank existed) and the string hash seed.  Its own: random seeds
(Python seeds ``random`` again in a forked child, this module numpy's global generator; torch's
default generator starts where a new process's would), torch's thread count (from
``OMP_NUM_THREADS``), what its stand-in was started with (CPU affinity, niceness, umask,
resource limits, the signals it ignores), and an interpreter's exit (its non-daemon threads
waited for, ``atexit`` handlers run, streams flushed).  The server imports and forks only: it
starts no threads and runs no torch operation, so no thread pool or CUDA context exists to be
copied half-made.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time

TYPE_CHECKING = False  # (not typing's: a stand-in starts often, and never needs it)

if TYPE_CHECKING:
    import subprocess
    from typing import Any

__all__ = [
    "ENV",
    "ENV_SWITCH",
    "enabled",
    "is_stand_in",
    "launcher_pid",
    "main",
    "prefer_stand_ins",
    "rank_pid",
    "start",
    "start_launchers",
    "start_settings",
    "stop",
    "sweep",
]

ENV = "RESILIENT_FORKSERVER"  # the server's socket, in the workers' environment
_PREFIX = "resilient-forkserver-"
ENV_SWITCH = "RESILIENT_FORK_RANKS"  # "0": launchers start every rank the usual way
# a worker that stands in for a rank: ``python [-u] *STAND_IN -m MODULE | SCRIPT ...``
STAND_IN = ("-m", "resilient.forkserver", "run")
ENV_STAND_IN = "RESILIENT_FORKSERVER_STAND_IN"  # in a forked rank: its stand-in's pid
# a rank that joined through resilient.launch.init_process_group writes its Python stacks to its
# stderr on this signal, then ends as the signal's default would have it (faulthandler, chained):
# ``resilient launch --finish-timeout`` asks a rank it is about to kill (a real-time signal: no
# library or scheduler sends it of its own accord; Linux's: None where there are none)
STACKS_SIGNAL: int | None = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2, *([STACKS_SIGNAL] if STACKS_SIGNAL else []))  # fmt: skip
_HEADER = struct.Struct("!I")
_START_WAIT_S = 60.0  # how long a worker waits for a server that is still starting
_SIGNALED_WAIT_S = 5.0  # how long a signalled stand-in waits for its rank's pid (_stand_in)


# --- the worker's stand-in ------------------------------------------------------------------------


def _connect(path: str) -> socket.socket | None:
    """A connection to the server at ``path``, waiting while the server (alive: its pid file
    names it) is still importing; None when there is none to reach."""
    deadline = time.monotonic() + _START_WAIT_S
    server_pid = _read_int(os.path.join(os.path.dirname(path), "server.pid"))
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
        if server_pid is None or not _alive(server_pid) or time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(64).strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_target(target: list[str], args: list[str]) -> None:
    """Run ``target`` (``["-m", MODULE]`` or ``[SCRIPT]``) as ``python -m MODULE`` or ``python
    SCRIPT`` would: in a ``__main__`` module of its own that stays in ``sys.modules`` (so that
    the interpreter's exit finalizes what it holds, an open file flushed), with ``sys.argv`` and
    ``sys.path[0]`` as python sets them."""
    import runpy
    import types

    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if target[0] == "-m":
        sys.path[0] = os.getcwd()
        sys.argv = [target[1], *args]
        run_as_main = getattr(runpy, "_run_module_as_main", None)  # what `python -m` calls
        if run_as_main is not None:
            run_as_main(target[1], alter_argv=True)
        else:
            sys.argv[0] = _module_file(target[1])
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        return
    import importlib.machinery
    import importlib.util

    class ScriptLoader(importlib.machinery.SourceFileLoader):
        def set_data(self, *args, **kwargs) -> None:  # python caches no script's bytecode
            pass

    path = os.path.abspath(target[0])  # a script's __file__ is absolute (python >= 3.9)
    try:
        with open(path, "rb"):
            pass
    except OSError as e:  # as python says it (exit 2), not an importlib traceback
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    sys.path[0] = os.path.dirname(path)
    sys.argv = [target[0], *args]
    loader = ScriptLoader("__main__", path)
    spec = importlib.util.spec_from_file_location("__main__", path, loader=loader)
    main = importlib.util.module_from_spec(spec)
    main.__spec__ = None  # as python gives a script (multiprocessing's spawn goes by it)
    main.__cached__ = None
    sys.modules["__main__"] = main
    loader.exec_module(main)


def _module_file(name: str) -> str:
    """The file ``python -m name`` runs (a package's ``__main__``), or ``name`` if not found."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError):
        return name
    return spec.origin if spec is not None and spec.origin else name


def _run_itself(path: str | None, target: list[str], args: list[str]) -> int:
    """The slow way, in this process (no server, or one that could not fork): this process is
    the rank (what rank_pid says of it).  A launcher's stand-in (a server for launchers, or
    none left to tell) lets go of the server's socket, as a forked launcher does."""
    if path:
        root = os.path.dirname(path)
        try:
            _write(os.path.join(root, "pids", str(os.getpid())), str(os.getpid()))
        except OSError:
            pass  # no server directory: rank_pid takes it for the rank anyway
        if not os.path.isdir(root) or os.path.exists(os.path.join(root, "launchers")):
            os.environ.pop(ENV, None)
            os.environ.pop(ENV_STAND_IN, None)
    _run_target(target, args)
    return 0


def _reply(conn: socket.socket, reader: Any, waiting: list[int]) -> bytes | None:
    """The server's reply line to a stand-in's request; None once a signal has waited for it
    ``_SIGNALED_WAIT_S``."""
    since = None
    while not select.select([conn], [], [], 0.2)[0]:
        if waiting:
            since = time.monotonic() if since is None else since
            if time.monotonic() - since > _SIGNALED_WAIT_S:
                return None
    return reader.readline()


def _stand_in(target: list[str], args: list[str]) -> int:
    path = os.environ.get(ENV)
    conn = _connect(path) if path else None
    if conn is None:
        return _run_itself(path, target, args)
    # signals it was started with ignored (nohup's SIGHUP, a shell's `&` SIGINT): ignored in the
    # forked process too, and not forwarded
    ignored = [s for s in _FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    # The others are forwarded to the rank, and taken from before the request on: one that came
    # between the server's fork and handlers set only then (the rank already running, say ready
    # to its launcher) ended this process as its default does, and never reached the rank (a
    # SIGTERM meant to let it save; seen as a SIGINT's KeyboardInterrupt here, under load).
    # Until the rank's pid is known they wait, then go to it; a server that has not answered
    # _SIGNALED_WAIT_S after one came (still importing its preload) has forked nothing for this
    # process yet, and one that gives no pid none: it then ends by them, as it would have.
    rank: dict[str, Any] = {"pid": None, "waiting": []}

    def forward(signum, _frame):
        if rank["pid"] is None or rank["waiting"]:  # (behind those still waiting: in order)
            rank["waiting"].append(signum)
        else:
            deliver(signum)

    def deliver(signum: int) -> None:
        child = rank["pid"]
        if signum == STACKS_SIGNAL:  # the rank's stacks: its children are not asked
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass
        else:
            _signal_group(child, signum)  # the rank leads its own group: its children too

    before = {sig: signal.signal(sig, forward) for sig in _FORWARDED if sig not in ignored}

    def as_before() -> None:
        """This process's handlers as they were, and the signals that came meanwhile delivered
        to it (which end it, as their defaults do), as they would have been without the wait:
        for a stand-in that has no rank to forward them to."""
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in rank["waiting"]:
            signal.raise_signal(sig)

    def run_itself() -> int:
        as_before()
        return _run_itself(path, target, args)

    request = {
        "target": target,
        "args": args,
        "path": sys.path[1:],  # PYTHONPATH and site as this worker has them
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "nice": os.nice(0),
        "umask": _umask(),
        "limits": _limits(),
        "ignored": ignored,
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
    }
    body = json.dumps(request).encode()
    try:
        socket.send_fds(conn, [_HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
    except OSError:
        conn.close()
        return run_itself()  # the server forks whole requests only
    try:
        reader = conn.makefile("rb")
        line = _reply(conn, reader, rank["waiting"])
        if line is None:  # signalled, and no rank in sight: as before the request, it ends here
            conn.close()
            return run_itself()
        reply = json.loads(line)
        if reply["pid"] is None:  # the server could not fork it: nothing started yet
            conn.close()
            return run_itself()
        child = int(reply["pid"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        as_before()  # told to stop meanwhile: it stops so, not as a failed start
        # the rank may have been forked: starting it here as well could make two of it
        print(
            f"resilient.forkserver: the server at {path} did not start the rank ({e!r})",
            file=sys.stderr,
        )
        return 1
    rank["pid"] = child
    while rank["waiting"]:  # (one that comes meanwhile joins the queue: see forward)
        deliver(rank["waiting"][0])
        rank["waiting"].pop(0)
    try:
        line = reader.readline()
    except OSError:
        line = b""
    if not line:  # the server died: its ranks die with it (PDEATHSIG); wait for ours, say killed
        _wait_gone(child)
        status = signal.SIGKILL  # a wait status: killed by SIGKILL
    else:
        status = int(json.loads(line)["status"])
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        # a failed rank's group goes with it (what it started: a data helper, a shell wrapper's
        # python), as when it is this process's own child: a launcher that replaces it (in-job
        # recovery) or stops the workers signals this process's group, which does not hold them
        try:
            os.killpg(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nothing left of it
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)  # (SIGPIPE, say, is ignored in python)
        except (OSError, ValueError):
            pass  # SIGKILL, SIGSTOP: their default already
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank dumped core, if any
        except (ImportError, OSError, ValueError):
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)
        return 128 + sig  # not reached for a deadly signal
    return os.waitstatus_to_exitcode(status)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _limits() -> dict[str, list[int]]:
    """This process's resource limits (``ulimit``), by name: a forked process has them."""
    try:
        import resource
    except ImportError:
        return {}
    out = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                out[name] = list(resource.getrlimit(getattr(resource, name)))
            except (OSError, ValueError):
                pass
    return out


def _take_limits(limits: object) -> None:
    """The stand-in's resource limits, where this process may take them (a hard limit raised
    above the server's needs the privilege a stand-in started with a higher one had)."""
    if not isinstance(limits, dict):
        return
    import resource

    for name, value in limits.items():
        which = getattr(resource, str(name), None)
        if not (str(name).startswith("RLIMIT_") and isinstance(which, int)):
            continue
        try:
            soft, hard = (int(v) for v in value)
            if (soft, hard) != resource.getrlimit(which):
                resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError, TypeError):
            pass


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group (a rank and its children, as torchrun's ``killpg``
    reaches a worker's), or to ``pid`` alone before it has made its group."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def _wait_gone(pid: int) -> None:
    """Until ``pid`` (not this process's child) has exited, zombie or reaped."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [])  # readable once the process has exited
        finally:
            os.close(fd)
        return
    while _alive(pid) and not _zombie(pid):
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


# --- the server ---------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(2.0)  # a stand-in sends its whole request at once: a slow one is refused
    fds: list[int] = []
    try:
        head, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
        if len(head) != _HEADER.size or len(fds) != 3:
            raise OSError("a short request")
        (size,) = _HEADER.unpack(head)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise OSError("a short request")
            body += chunk
        request = json.loads(body)
        if not isinstance(request, dict):
            raise ValueError("not a request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def _child(
    request: dict,
    fds: list[int],
    close: list[socket.socket],
    server: int,
    stand_in: int,
    launchers: bool = False,
) -> None:
    """In the forked rank: become the process ``python -m MODULE`` (or ``python SCRIPT``) would
    have started, and leave the way it would (an exception or ``SystemExit`` up to the
    interpreter, which then waits for threads, runs ``atexit`` and finalizes).  From a server
    for launchers (``launchers``) the child is a launcher, not a rank: nothing in its
    environment names a server or a stand-in, so that its workers find their launcher as their
    parent and it starts a server of its own for them."""
    _die_with(server)
    for s in close:
        s.close()
    os.setsid()  # its own group, which the stand-in signals (torchrun's killpg of the worker)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    ignored = request.get("ignored")
    ignored = [s for s in _FORWARDED if isinstance(ignored, list) and s in ignored]
    for sig in (*_FORWARDED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:  # as a new interpreter has it (an ignored one stays so)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # what came meanwhile lands now
    os.environ.clear()
    os.environ.update(request["env"])
    if launchers:
        os.environ.pop(ENV, None)
        os.environ.pop(ENV_STAND_IN, None)
    else:
        os.environ[ENV_STAND_IN] = str(stand_in)  # its launcher's child (see launcher_pid)
    os.chdir(request["cwd"])
    _take_placement(request)
    if isinstance(request.get("umask"), int):
        os.umask(request["umask"] & 0o777)
    _take_limits(request.get("limits"))
    if request.get("unbuffered"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if "numpy.random" in sys.modules:  # numpy's global generator: seeded per process
        sys.modules["numpy.random"].seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit():
        sys.modules["torch"].set_num_threads(max(1, int(threads)))
    sys.path[1:] = [p for p in request["path"] if isinstance(p, str)]
    sys.excepthook = _rank_excepthook
    _run_target(list(request["target"]), list(request["args"]))
    raise SystemExit(0)


def _rank_excepthook(etype, value, tb) -> None:
    """A forked rank's uncaught exception as ``python -m`` prints it: from the frame that runs
    the rank's module on, without the server's and its launcher's frames above it."""
    t = tb
    while t is not None and t.tb_frame.f_code is not _run_target.__code__:
        t = t.tb_next
    if t is not None and t.tb_next is not None:
        tb = t.tb_next
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(
            "<frozen importlib"
        ):  # (a script's: python shows its own frame first; none for a SyntaxError)
            tb = tb.tb_next
        if isinstance(value, BaseException):  # (printed from its own __traceback__)
            value = value.with_traceback(tb)
    sys.__excepthook__(etype, value, tb)


def _take_placement(request: dict) -> None:
    """The CPU affinity and niceness the worker was started with (``numactl``, ``taskset``,
    ``nice`` in front of it; torchrun's ``--numa-binding``): the rank's, not the server's."""
    cpus = request.get("cpus")
    if isinstance(cpus, list) and cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, [int(c) for c in cpus])
        except (OSError, ValueError):
            pass
    nice = request.get("nice")
    if isinstance(nice, int):
        try:
            delta = nice - os.nice(0)
            if delta:
                os.nice(delta)  # lowering it needs the privilege a worker started lower had
        except OSError:
            pass


def launcher_pid() -> int:
    """This worker's launcher (torchrun's agent): its parent, or, for a rank a fork server
    forked, its stand-in's parent (0 once that is gone)."""
    stand_in = os.environ.get(ENV_STAND_IN, "")
    if not stand_in.isdigit():
        return os.getppid()
    try:
        with open(f"/proc/{stand_in}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _die_with(server: int) -> None:
    """SIGKILL this process when the server dies (its parent: a server that crashed must not
    leave ranks whose stand-ins cannot learn how they ended)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != server:  # it died before the line above
        os._exit(1)


def serve(path: str, preload: list[str], parent: int, *, launchers: bool = False) -> int:
    """Fork a rank for every worker that asks (``preload`` imported first, in the first
    worker's environment), until ``parent`` exits; then wait for the ranks still running.
    ``launchers``: what it forks are launchers (see :func:`start_launchers`)."""
    me = os.getpid()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    pids_dir = os.path.join(os.path.dirname(path), "pids")
    os.makedirs(pids_dir, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(128)
    os.rename(path + ".tmp", path)  # workers connect once it listens, and wait for their pids
    ranks: dict[int, _Rank] = {}
    loaded = False
    settings = (start_settings(dict(os.environ)), os.getcwd())  # (launchers: see _same_start)
    try:
        while not stopping and os.getppid() == parent:
            open_ = {r.conn: pid for pid, r in ranks.items() if r.conn is not None}
            try:
                ready, _, _ = select.select([listener, *open_], [], [], 0.1)
            except InterruptedError:
                ready = []
            try:
                for s in ready:
                    if s is not listener:
                        _check(open_[s], ranks)
                        continue
                    got = _accept(listener)
                    if got is None:
                        continue
                    if launchers and not _same_start(got[1], settings):
                        _refuse(got[0], got[2])  # its stand-in runs the launcher itself
                        continue
                    if not loaded:  # at the first worker, not before: see _preload
                        _preload(preload, got[1])
                        loaded = True
                    _fork(*got, listener, ranks, pids_dir, me, launchers)
                _reap(ranks, pids_dir)
            except Exception as e:
                if os.getpid() != me:
                    raise  # a rank's own exception, leaving through the interpreter
                # the server's ranks die with it: one request's failure must not end it
                print(f"resilient.forkserver: {e!r}; serving on", file=sys.stderr)
                time.sleep(0.1)
    finally:
        if os.getpid() == me:
            listener.close()
            for name in (path, path + ".tmp"):
                try:
                    os.unlink(name)
                except OSError:
                    pass
    # the launcher is gone (or stopped us): no new ranks; those still running are waited for
    # (their stand-ins may outlive the launcher, as torchrun's workers do an agent's SIGKILL),
    # and a rank whose stand-in is gone is killed
    while ranks:
        for pid in list(ranks):
            _check(pid, ranks)
        _reap(ranks, pids_dir)
        time.sleep(0.1)
    return 0


def _same_start(request: dict, settings: tuple[dict[str, str], str]) -> bool:
    """Whether a launcher started as ``request`` asks would start as this server did: the same
    start settings in its environment, in the same working directory."""
    env = request.get("env")
    if not isinstance(env, dict):
        return False
    return (start_settings(env), request.get("cwd")) == settings


def _refuse(conn: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": None}).encode() + b"\n")
    except OSError:
        pass
    conn.close()


class _Rank:
    __slots__ = ("conn", "stand_in")

    def __init__(self, conn: socket.socket | None, stand_in: int) -> None:
        self.conn, self.stand_in = conn, stand_in


def _preload(preload: list[str], request: dict) -> None:
    """Import ``preload`` in the first worker's environment (its ``OMP_NUM_THREADS``, which
    torchrun sets for its workers, sizes the thread pools libraries make at import).  Done when
    the first worker asks, not when the server starts: the launcher starts the server before its
    rendezvous, and an import racing the launchers of a job's other nodes for the cores can make
    one of them join too late for the first round."""
    import gc
    import importlib

    env = request.get("env")
    if isinstance(env, dict):
        os.environ.update({k: v for k, v in env.items() if isinstance(v, str)})
    target = request.get("target")
    for name in preload:
        if target == ["-m", name]:  # it would run here, as itself, then again in every rank
            print(f"resilient.forkserver: not preloading {name}: it is what the ranks run",
                  file=sys.stderr)  # fmt: skip
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # a rank that needs it will say why; the others are still served
            print(f"resilient.forkserver: could not preload {name}: {e}", file=sys.stderr)
    gc.collect()
    gc.freeze()  # what every rank shares stays shared (and is never scanned again)


def _accept(listener: socket.socket) -> tuple[socket.socket, dict, list[int], int] | None:
    try:
        conn, _ = listener.accept()
    except OSError as e:  # out of descriptors, say: the worker waits in the backlog
        print(f"resilient.forkserver: accept: {e}", file=sys.stderr)
        time.sleep(0.1)
        return None
    try:
        request, fds = _recv_request(conn)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, ValueError):
        conn.close()
        return None
    return conn, request, fds, struct.unpack("3i", creds)[0]


def _fork(conn, request, fds, stand_in, listener, ranks, pids_dir, me, launchers) -> None:
    if not _peek(conn):  # its stand-in is gone already (killed while the preload ran)
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # a signal the stand-in forwards before the rank has its own dispositions waits for them
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        pid = os.fork()
    except OSError as e:  # no fork (a process limit, memory): the stand-in starts it itself
        print(f"resilient.forkserver: fork: {e}", file=sys.stderr)
        pid = None
    if pid == 0:  # the rank: leaves by its own exception, up to the interpreter
        others = [r.conn for r in ranks.values() if r.conn is not None]
        _child(request, fds, [listener, conn, *others], me, stand_in, launchers)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    for fd in fds:
        os.close(fd)
    if pid is None:
        _refuse(conn, [])
        return
    ranks[pid] = _Rank(conn, stand_in)
    try:
        _write(os.path.join(pids_dir, str(stand_in)), str(pid))
    except OSError as e:  # only rank_pid misses it
        print(f"resilient.forkserver: {e}", file=sys.stderr)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:
        pass  # its stand-in is gone: _check sees the closed connection


def _check(pid: int, ranks: dict[int, _Rank]) -> None:
    """Kill rank ``pid`` (and its group) when its stand-in has gone (torchrun's SIGKILL)."""
    rank = ranks.get(pid)
    if rank is None or rank.conn is None or _peek(rank.conn):
        return
    rank.conn.close()
    rank.conn = None
    _signal_group(pid, signal.SIGKILL)


def _peek(conn: socket.socket) -> bool:
    """Whether ``conn`` is still open (a stand-in sends nothing after its request)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _reap(ranks: dict[int, _Rank], pids_dir: str) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rank = ranks.pop(pid, None)
        if rank is None:
            continue
        if rank.conn is not None:
            try:
                rank.conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            except OSError:
                pass
            rank.conn.close()
        try:
            os.unlink(os.path.join(pids_dir, str(rank.stand_in)))
        except OSError:
            pass


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# --- the launcher's side ------------------------------------------------------------------------


def enabled() -> bool:
    """Whether launchers start ranks from a fork server (``RESILIENT_FORK_RANKS=0``: every rank
    its own interpreter, as plain torchrun starts them)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def start(preload: list[str] | tuple[str, ...], *, fork: bool = False):
    """Start a server for this process's workers (it exits when this process does, or on
    SIGTERM), and put its socket in this process's environment; returns its ``Popen``.
    ``fork``: the server is this process, forked (``fork_ready``), not a new interpreter; its
    ranks leave through the caller's stack up to the interpreter, so the caller is the program's
    entry and nothing on its stack may catch what a rank raises (``host``; ``resilient launch``
    and ``python -m reference_trainer --nproc`` as their own programs)."""
    import subprocess
    import tempfile

    sweep(tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix=_PREFIX)
    path = os.path.join(root, "sock")
    if fork:
        return _start_forked(root, path, list(preload))
    cmd = [sys.executable, "-m", "resilient.forkserver", "serve", path, str(os.getpid())]
    server = subprocess.Popen(
        [*cmd, ",".join(preload)], stdin=subprocess.DEVNULL, start_new_session=True
    )
    _write(os.path.join(root, "server.pid"), str(server.pid))
    os.environ[ENV] = path
    return server


def start_launchers(
    preload: list[str] | tuple[str, ...],
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start a server that forks *launchers* (``torch.distributed.run``, ``resilient launch``,
    ``host`` in front of either) for a program that starts many jobs, one after another or side
    by side (the chaos harness): ``import torch`` once for all of them, not once per launcher.
    Returns the server and its socket; this process's environment is left as it is: a job's
    command is ``python -m resilient.forkserver run -m LAUNCHER ...`` with ``RESILIENT_FORKSERVER``
    set to the socket in *its* environment.  A launcher forked so is in a session of its own,
    its workers' parent as usual; the process the program started is its stand-in (signals
    forwarded, its exit status taken, killed with it: see :func:`rank_pid` to find the launcher
    from it).  The server exits when this process does (or on SIGTERM: :func:`stop`), once the
    launchers it forked have ended.

    The server is a new interpreter started with ``env`` (the jobs' environment: the interpreter
    is set up from its ``PYTHON*`` variables) in ``cwd`` (the jobs' working directory; default
    this process's), and forks only for a job whose environment agrees with ``env`` on
    everything that a launcher's modules or the interpreter read once, at their start
    (:func:`start_settings`), and whose working directory is the same; any other job's
    stand-in runs its launcher itself (a program that starts jobs of several such settings
    starts a server for each).  Its output
    goes nowhere: a launcher has its stand-in's streams, and a server that outlives a killed
    program must not hold the program's output open."""
    import subprocess
    import tempfile

    sweep(tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix=_PREFIX)
    path = os.path.join(root, "sock")
    _write(os.path.join(root, "launchers"), "")  # (what a stand-in that runs itself looks at)
    cmd = [sys.executable, "-m", "resilient.forkserver", "serve", path, str(os.getpid())]
    server = subprocess.Popen(
        [*cmd, ",".join(preload), "--launchers"],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _write(os.path.join(root, "server.pid"), str(server.pid))
    return server, path


# what the interpreter and a launcher's modules read from the environment once, at their start:
# the interpreter's settings (PYTHON*, the locale, the time zone); torch's (TORCH_*, PYTORCH_*),
# torchrun's LOGLEVEL; fsspec's configuration (FSSPEC_*, the one under HOME or XDG_*); the
# temporary directory tempfile settles on; the sizes of the thread pools numpy's and torch's
# libraries make at import; the loader's
_START_PREFIXES = (
    "PYTHON", "LANG", "LC_", "TZ", "TORCH", "PYTORCH_", "LOGLEVEL", "FSSPEC_", "HOME", "XDG_",
    "TMPDIR", "TEMP", "TMP", "OMP_", "MKL_", "OPENBLAS_", "GOTO", "BLIS_", "KMP_", "GOMP_",
    "NCCL_", "GLOO_", "CUDA_", "HIP_", "ROCR_", "HSA_", "LD_", "MALLOC_",
)  # fmt: skip


def start_settings(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` a server for launchers must share with a job to fork its launcher
    (:func:`start_launchers`)."""
    return {k: v for k, v in env.items() if k.startswith(_START_PREFIXES)}


class _Forked:
    """A forked server, with the part of ``Popen``'s interface that ``stop`` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0
                return 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _start_forked(root: str, path: str, preload: list[str]) -> _Forked:
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        me, code = os.getpid(), 1
        try:
            os.setsid()  # (as start_new_session: a signal to the launcher's group is not its)
            _default_handlers()
            _close_inherited()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            code = serve(path, preload, parent)
        finally:
            if os.getpid() == me:  # (a rank leaves through here by its exception, up to
                import shutil  # the interpreter, as from ``main``'s serve)

                shutil.rmtree(root, ignore_errors=True)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
    # the start time first: a sweep that finds the pid without it judges by the command line,
    # which a forked server's does not name
    _write(os.path.join(root, "server.start"), _start_time(pid) or "")
    _write(os.path.join(root, "server.pid"), str(pid))
    os.environ[ENV] = path
    return _Forked(pid)


def _close_inherited() -> None:
    """Let go of the descriptors above 2 this process would pass on to a program it started
    (the inheritable ones: a supervisor's pipe, a lock file given to the launcher): a new
    interpreter as server (``Popen``'s close_fds) never had them, and a rank outliving its
    launcher would hold them open.  Each number stays taken, on /dev/null (a launcher object
    that owns one closes it later).  Python's own are not inheritable, and stay as they are."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)  # (not inheritable)
    try:
        for fd in fds:
            try:
                if fd > 2 and fd != null and os.get_inheritable(fd):
                    # released, but the number stays taken: a launcher object that owns it
                    # closes /dev/null later, not a descriptor the server or a rank reused it for
                    os.dup2(null, fd, inheritable=False)
            except OSError:
                pass  # (the listing's own descriptor, closed by now)
    finally:
        os.close(null)


def _default_handlers() -> None:
    """The signal handlers the caller installed, back to what a new interpreter starts with
    (an ignored signal stays ignored, as across an exec)."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT and handler is not signal.SIG_IGN:
                signal.signal(sig, signal.default_int_handler)
            elif callable(handler):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat): with the pid, which
    process it is (a pid is reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep(tmp: str | None = None) -> None:
    """Remove what servers killed outright (a node's whole process tree, SIGKILL) left in
    ``tmp`` (the temporary directory): a directory whose server is gone.  One still being set up (no pid file yet, for a
    minute) and one whose server lives are left alone."""
    import tempfile

    tmp = tempfile.gettempdir() if tmp is None else tmp
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(_PREFIX)]
    except OSError:
        return
    import shutil

    for name in names:
        root = os.path.join(tmp, name)
        pid = _read_int(os.path.join(root, "server.pid"))
        try:
            if pid is None and time.time() - os.stat(root).st_mtime < 60:
                continue
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read() if pid is not None else b""
        except FileNotFoundError:
            cmdline = b""
        except OSError:
            continue
        if pid is not None and not cmdline and _alive(pid) and not _zombie(pid):
            continue  # in its exec still (no command line yet): not known to be gone
        start = _read_text(os.path.join(root, "server.start"))
        if start and pid is not None and not _zombie(pid) and _start_time(pid) == start:
            continue  # a forked server (its command line is its launcher's), alive
        if root.encode() not in cmdline:
            shutil.rmtree(root, ignore_errors=True)


def stop(server) -> None:
    """Stop a server :func:`start` or :func:`start_launchers` started (the ranks it forked are
    left to their stand-ins); its directory goes with it, also where the stop came before the
    server could remove it (a server stopped as it started dies outright)."""
    os.environ.pop(ENV, None)
    server.terminate()
    try:
        server.wait(timeout=10)
    except Exception:
        server.kill()
        server.wait()
    sweep()


def host(preload: list[str], launcher: list[str]) -> int:
    """Start the server, then run ``python -m LAUNCHER...`` as this process.

    Where torch may be imported here as the workers will have it (a launcher that imports it
    anyway, and ``OMP_NUM_THREADS`` set: torchrun passes it on to the workers as it is, and the
    thread pools some libraries make at import are sized by it), it is, once: the server is
    forked from this process with them (it imports the rest of the preload at the first worker's
    request, as always), and the launcher, which imports torch too, runs here, in-process, with
    them already imported.  That is one interpreter's ``import torch`` less per job (about
    1.5 s of CPU).  Otherwise the server is a new interpreter and the launcher is exec'd."""
    if any(launcher[: len(t)] == t for t in _TORCH_LAUNCHERS) and fork_ready():
        import importlib
        import runpy

        start(preload, fork=True)
        # (the toolkit's launcher module: torch's rendezvous names its records from the frame,
        # not from inspect.stack(), in this process; resilient.launch.agent.name_records_by_frame)
        importlib.import_module("resilient.launch.agent")
        sys.argv = [launcher[0], *launcher[1:]]
        # (its SystemExit goes up to the interpreter as it is: a message is printed, as for the
        # exec'd launcher)
        runpy.run_module(launcher[0], run_name="__main__", alter_sys=True)
        return 0
    start(preload)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", *launcher])
    return 1


_TORCH_LAUNCHERS = (["torch.distributed.run"], ["resilient.cli", "launch"])


def fork_ready() -> bool:
    """Whether this process may be forked into a fork server whose ranks come out as a new
    interpreter's would (``host``, and ``resilient launch`` as its own program): torch imported
    here under the ``OMP_NUM_THREADS`` the workers get (torchrun passes it on as it is; set after
    torch's import it was not read: torch's pool is then sized by the cores); this process
    still one thread (a pool a library started at import would not be in a forked child),
    started with no interpreter option a worker's ``python -u`` lacks (``-O``, ``-W``, ``-X``:
    a forked rank would keep them), and no GPU runtime touched here (a CUDA driver initialised
    before a fork is unusable in the child: torch.cuda.is_available() does it; on ROCm, not
    verified, never)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not threads.isdigit() or not _plain_interpreter():
        return False
    try:
        import torch
    except Exception:
        return False
    try:
        if torch.get_num_threads() != max(1, int(threads)):
            return False
        if torch.version.hip is not None or torch.cuda.is_initialized():
            return False
        with open("/proc/self/maps") as f:
            if _gpu_driver_loaded(f.read()):
                return False
        return len(os.listdir("/proc/self/task")) == 1
    except (OSError, RuntimeError, AttributeError):
        return False


def _plain_interpreter() -> bool:
    """Whether this interpreter's command line has no option before its module or script
    other than ``-u`` (what torchrun gives its workers; an option from the environment, such as
    PYTHONOPTIMIZE, the workers get alike)."""
    for arg in getattr(sys, "orig_argv", [])[1:]:
        if arg in ("-m", "-c") or not arg.startswith("-"):
            return True
        if arg != "-u":
            return False
    return True


def _gpu_driver_loaded(maps: str) -> bool:
    """Whether a GPU driver library is mapped (``/proc/self/maps``): CUDA's libcuda is loaded
    at the runtime's first call (torch.cuda.is_available(), device_count()), not at import."""
    for line in maps.splitlines():
        fields = line.split(None, 5)  # the path is the sixth field, spaces and all
        if len(fields) == 6 and fields[5].startswith("/"):
            path = fields[5].removesuffix(" (deleted)")
            if os.path.basename(path).startswith("libcuda.so"):
                return True
    return False


def is_stand_in(pid: int) -> bool:
    """Whether ``pid`` is a worker standing in for a rank that a fork server forked."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
    except OSError:
        return False
    words = [w.encode() for w in STAND_IN]
    return cmdline[1:4] == words or cmdline[1:5] == [b"-u", *words]


def rank_pid(pid: int) -> int | None:
    """The rank that worker ``pid`` stands in for when a fork server started it (None when it
    has not been forked yet); ``pid`` itself for a worker that is the rank."""
    if not is_stand_in(pid):
        return pid
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(ENV.encode() + b"="):
            root = os.path.dirname(e.split(b"=", 1)[1].decode(errors="replace"))
            if not os.path.isdir(root):
                return pid  # no server to fork it: the stand-in runs the rank itself
            return _read_int(os.path.join(root, "pids", str(pid)))
    return pid


def prefer_stand_ins(pids: list[int]) -> list[int]:
    """``pids`` (workers found by their launcher environment) with stand-ins first, the order
    otherwise kept: a forked rank's own children inherit that environment while the rank's
    ``/proc`` entry shows the server's, so a match that is not a stand-in may be a rank's
    child."""
    return sorted(pids, key=lambda p: not is_stand_in(p))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m resilient.forkserver host --preload MOD[,MOD] -- LAUNCHER [ARGS]\n"
        "       python -m resilient.forkserver run (-m MODULE | SCRIPT) [ARGS]"
    )
    if argv[:1] == ["run"] and len(argv) >= 3 and argv[1] == "-m":
        return _stand_in(argv[1:3], argv[3:])
    if argv[:1] == ["run"] and len(argv) >= 2 and not argv[1].startswith("-"):
        return _stand_in(argv[1:2], argv[2:])
    if argv[:1] == ["serve"] and len(argv) in (4, 5) and argv[4:] in ([], ["--launchers"]):
        path, parent, preload = argv[1], int(argv[2]), [m for m in argv[3].split(",") if m]
        me = os.getpid()
        try:
            return serve(path, preload, parent, launchers=argv[4:] == ["--launchers"])
        finally:
            if os.getpid() == me:  # not in a rank leaving through here
                import shutil

                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if argv[:1] == ["host"] and "--" in argv:
        split = argv.index("--")
        opts, launcher = argv[1:split], argv[split + 1 :]
        preload = []
        if len(opts) == 2 and opts[0] == "--preload":
            preload = [m for m in opts[1].split(",") if m]
        elif opts:
            print(usage, file=sys.stderr)
            return 2
        if launcher:
            return host(preload, launcher)
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
