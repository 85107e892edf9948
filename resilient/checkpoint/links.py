"""Raw TCP connections that carry peer replicas' bytes between nodes.

Every snapshot on several nodes sends each rank's file to its peer (resilient.checkpoint.replicas).
Through gloo that transfer cost most of the replication (BENCHMARKS.md, "Eighteenth session": about
17 points of a tiny-preset step for 1.8 MB each way, where a plain socket moves the same bytes for
2 to 6), so the bytes travel on a connection of their own per peer pair: one from this rank to its
peer ("out") and one from its source ("in"), made when the replicas' groups form and kept for their
generation.  The gloo group stays the channel of agreement: the ranks agree there, before every
transfer, whether it goes by socket (both ends' connection up) or through gloo, so a broken or
refused connection costs speed, never a replica.

Setting up (a collective of the replicas' gloo group):

1. each rank with a source listens on the address it advertises (``RESILIENT_REPLICA_HOST``, or
   the address this host reaches the job's ``MASTER_ADDR`` from, or its host name's), on a port the
   system picks, and draws a random token;
2. the ranks all-gather "host port token" (text in a uint8 tensor; nothing is pickled);
3. each rank connects to its peer and says hello: a magic, its rank, its peer's token;
4. the ranks all-gather whether they connected; each rank whose source did accepts, and takes only
   the connection whose hello names its source and its own token (anything else that reaches the
   port in that window is closed), then stops listening.

A transfer is a 24-byte header (magic, a sequence number both ends count, the size) and the bytes,
received straight into the file's pages.  Any failure (the peer gone, a timeout, a header that is
not the one expected) closes that connection on that end; the other end learns it at the next
agreement, and both use gloo from then on in this generation.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["Link", "Links", "advertised_host"]

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<8sI16s")  # magic, the connecting rank, the listener's token
_HELLO_MAGIC = b"RSLNK\x00\x00\x01"
_HEADER = struct.Struct("<8sQQ")  # magic, sequence number, size
_HEADER_MAGIC = b"RSLNKDAT"
_RECORD = 192  # bytes of one rank's "host port token" record in the all-gather
_SETUP_S = 30.0  # the most a connect or an accept waits at setup (then gloo carries the bytes)


def advertised_host() -> str:
    """The address this rank's peers connect to: ``RESILIENT_REPLICA_HOST`` if set, else the
    address of the interface that reaches ``MASTER_ADDR`` (no packet is sent), else the host
    name's address."""
    host = os.environ.get("RESILIENT_REPLICA_HOST", "").strip()
    if host:
        return host
    master = os.environ.get("MASTER_ADDR", "").strip()
    if master:
        try:
            info = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
                probe.connect(info[4])
                return str(probe.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Link:
    """One end of a connection: sends or receives whole transfers, in order."""

    def __init__(self, sock: socket.socket, timeout_s: float, what: str) -> None:
        self.sock: socket.socket | None = sock
        self.what = what
        self.seq = 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking, with the kernel's timeouts: a whole transfer is one call that lets go of the
        # interpreter (Python's own timeouts poll and wake it at every chunk)
        sock.settimeout(None)
        tv = struct.pack("ll", max(1, int(timeout_s)), 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    @property
    def up(self) -> bool:
        return self.sock is not None

    def send(self, data: memoryview) -> None:
        """Send one transfer; on any failure the connection is closed (so the receiver sees its
        end at once, not at its timeout) and the error raised."""
        sock = self.sock
        if sock is None:
            raise ConnectionError(f"{self.what} is closed")
        try:
            sock.sendall(_HEADER.pack(_HEADER_MAGIC, self.seq, data.nbytes))
            sock.sendall(data)
        except BaseException:
            self.close()
            raise
        self.seq += 1

    def receive_into(self, into: memoryview) -> None:
        """Receive one transfer of exactly ``into.nbytes`` bytes into ``into``."""
        sock = self.sock
        if sock is None:
            raise ConnectionError(f"{self.what} is closed")
        try:
            header = bytearray(_HEADER.size)
            _receive_exactly(sock, memoryview(header))
            magic, seq, size = _HEADER.unpack(header)
            if magic != _HEADER_MAGIC or seq != self.seq or size != into.nbytes:
                raise ConnectionError(
                    f"{self.what}: expected transfer {self.seq} of {into.nbytes} bytes, found "
                    f"{'a header that is not a replica' if magic != _HEADER_MAGIC else ''}"
                    f"{f'transfer {seq} of {size} bytes' if magic == _HEADER_MAGIC else ''}"
                )
            _receive_exactly(sock, into)
        except BaseException:
            self.close()
            raise
        self.seq += 1

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread blocked in it)
            except OSError:
                pass
            sock.close()


def _receive_exactly(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            raise ConnectionError(f"the sender closed the connection after {got} of {n} bytes")
        got += k


class Links:
    """This rank's two connections: ``out`` to ``peer``, ``into`` from ``source`` (None where
    that connection could not be made).  Constructing it is a collective of ``group``."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        peer: int,
        source: int,
        timeout_s: float,
    ) -> None:
        self.rank, self.peer, self.source = rank, peer, source
        self.out: Link | None = None
        self.into: Link | None = None
        world = dist.get_world_size(group)
        setup_s = min(_SETUP_S, timeout_s)
        token = secrets.token_bytes(16)
        listener: socket.socket | None = None
        record = b""
        try:
            host = advertised_host()
            family = socket.AF_INET6 if _is_v6(host) else socket.AF_INET
            listener = socket.create_server((host, 0), family=family, backlog=8)
            port = listener.getsockname()[1]
            record = f"{host} {port} {token.hex()}".encode()
        except (OSError, ValueError) as e:
            log.warning(
                "rank %d: cannot listen for its peer replicas (%s): they travel through gloo "
                "(set RESILIENT_REPLICA_HOST to an address of this host that the other nodes reach)",
                rank,
                e,
            )
        try:
            records = _all_gather_bytes(group, world, record)
            self.out = self._connect(records[peer], setup_s, timeout_s)
            connected = torch.tensor([int(self.out is not None)], dtype=torch.int64)
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(every, connected, group=group)
            if listener is not None and int(every[source].item()):
                self.into = self._accept(listener, token, setup_s, timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _connect(self, record: bytes, setup_s: float, timeout_s: float) -> Link | None:
        """The connection to this rank's peer, hello said; None (and a warning) when it fails."""
        if not record:
            return None
        try:
            host, port, token = record.decode().split(" ")
            sock = socket.create_connection((host, int(port)), timeout=setup_s)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.warning(
                "rank %d: cannot connect to its peer rank %d for replicas (%s): they travel "
                "through gloo",
                self.rank,
                self.peer,
                e,
            )
            return None
        try:
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, self.rank, bytes.fromhex(token)))
        except (OSError, ValueError) as e:
            sock.close()
            log.warning("rank %d: hello to peer rank %d failed: %s", self.rank, self.peer, e)
            return None
        return Link(sock, timeout_s, f"rank {self.rank}'s replica connection to rank {self.peer}")

    def _accept(
        self, listener: socket.socket, token: bytes, setup_s: float, timeout_s: float
    ) -> Link | None:
        """The connection from this rank's source: the first whose hello names the source and
        this rank's token, within ``setup_s``; None (and a warning) when none came."""
        deadline = time.monotonic() + setup_s
        while (left := deadline - time.monotonic()) > 0:
            listener.settimeout(left)
            try:
                sock, _ = listener.accept()
            except OSError:
                break
            try:
                sock.settimeout(max(0.1, min(left, 5.0)))
                hello = bytearray(_HELLO.size)
                view, got = memoryview(hello), 0
                while got < len(hello):
                    k = sock.recv_into(view[got:])
                    if not k:
                        break
                    got += k
                if got == len(hello) and secrets.compare_digest(
                    bytes(hello), _HELLO.pack(_HELLO_MAGIC, self.source, token)
                ):
                    return Link(
                        sock,
                        timeout_s,
                        f"rank {self.rank}'s replica connection from rank {self.source}",
                    )
            except OSError:
                pass
            sock.close()  # not the source: whatever else reached the port
        log.warning(
            "rank %d: its source rank %d did not connect for replicas within %.0f s: they travel "
            "through gloo",
            self.rank,
            self.source,
            setup_s,
        )
        return None

    def close(self) -> None:
        for link in (self.out, self.into):
            if link is not None:
                link.close()


def send_in_background(link: Link, data: memoryview) -> tuple[threading.Thread, list]:
    """Start sending ``data`` on ``link`` from a thread of its own (both directions of a pair move
    at once); join the thread, then the list holds the exception, if any."""
    failed: list[BaseException] = []

    def send() -> None:
        try:
            link.send(data)
        except BaseException as e:  # (reported to the caller, which decides)
            failed.append(e)

    t = threading.Thread(target=send, name="resilient-replica-send", daemon=True)
    t.start()
    return t, failed


def _all_gather_bytes(group: dist.ProcessGroup, world: int, data: bytes) -> list[bytes]:
    if len(data) > _RECORD - 2:
        data = b""  # (an address that long is not one)
    buf = torch.zeros(_RECORD, dtype=torch.uint8)
    buf[0] = len(data) & 0xFF
    buf[1] = len(data) >> 8
    if data:
        buf[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.zeros(_RECORD, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(every, buf, group=group)
    out = []
    for t in every:
        raw = bytes(t.numpy())
        n = min(raw[0] | raw[1] << 8, _RECORD - 2)
        out.append(raw[2 : 2 + n])
    return out


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
