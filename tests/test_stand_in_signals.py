"""A fork server's stand-in and the signals that reach it while it waits for its rank's pid (the
server's reply to its request).  It set its forwarding handlers only once the pid had come: a
signal in between (the rank already forked and running, say ready to its launcher) ended the
stand-in as the signal's default does and never reached the rank (seen once under load in
test_forkserver.py's SIGINT test: the KeyboardInterrupt was the stand-in's).  The server here is
the test's own socket, so that the signal lands exactly there; the "rank" is a ``sleep`` in a
session of its own, as a forked rank leads its group."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_HEADER = struct.Struct("!I")


def _pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` is still pending (not yet delivered) in process ``pid``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    bit = 1 << (sig - 1)
    return any(int(fields[k].strip(), 16) & bit for k in ("SigPnd", "ShdPnd") if k in fields)


class _Server:
    """A stand-in's server that answers only when told: accepts one request and reads it
    whole, as resilient.forkserver's server does before it forks."""

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "sock"
        (tmp / "server.pid").write_text(str(os.getpid()))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(1)
        self.listener.settimeout(60)

    def take_request(self) -> dict:
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(60)
        head, fds, _flags, _addr = socket.recv_fds(self.conn, _HEADER.size, 3)
        for fd in fds:
            os.close(fd)
        (size,) = _HEADER.unpack(head)
        body = b""
        while len(body) < size:
            body += self.conn.recv(size - len(body))
        return json.loads(body)

    def say(self, **reply) -> None:
        self.conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        for s in (getattr(self, "conn", None), self.listener):
            if s is not None:
                s.close()


def _stand_in(server: _Server) -> subprocess.Popen:
    env = {**os.environ, "RESILIENT_FORKSERVER": str(server.path), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "resilient.forkserver", "run", "-m", "never_run"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _delivered(proc: subprocess.Popen, sig: int) -> None:
    """Until ``sig`` sent to ``proc`` is delivered: handled, or (its default) ended it."""
    deadline = time.monotonic() + 30
    while _pending(proc.pid, sig) and proc.poll() is None:
        assert time.monotonic() < deadline, "the signal stayed pending for 30 s"
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_that_comes_before_the_ranks_pid_reaches_the_rank(tmp_path, sig):
    server = _Server(tmp_path)
    rank = subprocess.Popen(["sleep", "300"], start_new_session=True)
    stand_in = _stand_in(server)
    try:
        request = server.take_request()
        assert request["target"] == ["-m", "never_run"]
        stand_in.send_signal(sig)  # it waits for the reply: the rank exists, its pid not known
        _delivered(stand_in, sig)
        assert stand_in.poll() is None, (
            f"the stand-in ended by the signal: {stand_in.stderr.read()}"
        )
        server.say(pid=rank.pid)
        assert rank.wait(timeout=60) == -sig  # forwarded to the rank (its group) once known
        server.say(status=sig)  # the rank's wait status: killed by the signal
        stand_in.wait(timeout=60)
        assert stand_in.returncode == -sig  # as the rank ended, as ever
    finally:
        for p in (rank, stand_in):
            if p.poll() is None:
                p.kill()
                p.wait()
        server.close()


@pytest.mark.parametrize("how", ["silent", "closed", "garbage"])
def test_a_signalled_stand_in_whose_server_gives_no_pid_ends_by_the_signal(tmp_path, how):
    """No pid comes: a server still importing its preload (``silent``: nothing forked yet; the
    signal, having waited its bound, about 5 s), one gone before it forked (the connection
    closed, no reply), one answering garbage (a review's repro).  The stand-in was told to stop,
    so it ends by the signal, as it did at once before it took signals early; not with exit
    code 1 and the signal dropped."""
    server = _Server(tmp_path)
    stand_in = _stand_in(server)
    try:
        server.take_request()
        stand_in.send_signal(signal.SIGTERM)
        _delivered(stand_in, signal.SIGTERM)
        if how == "closed":
            server.conn.close()
        elif how == "garbage":
            server.conn.sendall(b"not json\n")
        stand_in.wait(timeout=120)
        assert stand_in.returncode == -signal.SIGTERM, stand_in.stderr.read()
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
        server.close()
