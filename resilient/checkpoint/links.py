"""TCP connections of the memory tier's own that carry peer replicas between nodes.

Every snapshot on several nodes sends each rank's file to its peer (resilient.checkpoint.replicas).
Through gloo, a replication was five operations (agreement, sizes, readiness, the bytes, the
outcome), and each costs both ranks CPU on gloo's transport thread, whose event loop keeps waking
while an operation waits (about half a millisecond for eight bytes on a busy 2-core machine;
BENCHMARKS.md, "Nineteenth session").  So each rank keeps one connection to its peer ("out") and one from
its source ("into"), made when the replicas' groups form, kept for their generation: a replication
is then the file on "out" (from a thread of its own), the source's file on "into", and one gloo
reduction that says whether every rank holds its source's file and every connection is still up.

Setting up (a collective of the replicas' gloo group):

1. each rank listens on the address it advertises (``RESILIENT_REPLICA_HOST``, or the address of
   the interface that reaches the job's ``MASTER_ADDR``, or its host name's), on a port the system
   picks, and draws a random token;
2. the ranks all-gather "host port token hostname" (text in a uint8 tensor; nothing pickled);
3. each rank connects to its peer and says hello: a magic, its rank, its peer's token;
4. the ranks all-gather whether they connected; each rank whose source did accepts, and takes only
   the connection whose hello names its source and its own token (anything else that reaches the
   port in that window is closed), then stops listening;
5. a reduction: the connections are used only if every rank has both of its own up.

``RESILIENT_REPLICA_LINKS=0`` (on any rank) makes no connection: every replica goes through gloo.

A transfer is a 24-byte header (magic, a sequence number both ends count, the size, or "nothing
this time") and the bytes, received straight into the file's pages.  A failure (the peer gone, a
timeout: a transfer's bytes not all in within the link's timeout, half the group's, however they
trickle in; a header out of step) closes the connection on that end and is reported in the
replication's reduction: every rank then closes its connections and replicates through gloo for
the rest of the generation.  A replica lost in that replication is the same loss as through gloo:
the node keeps the previous step's.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import secrets
import selectors
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from resilient.errors import ResilientError

__all__ = ["Link", "Links", "Sender", "advertised_host"]

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<8sI16s")  # magic, the connecting rank, the listener's token
_HELLO_MAGIC = b"RSLNK\x00\x00\x01"
_HEADER = struct.Struct("<8sQQ")  # magic, sequence number, size
_HEADER_MAGIC = b"RSLNKDAT"
_RECORD = 192  # bytes of one rank's "host port token hostname" record in the all-gather
_SETUP_S = 30.0  # the most a connect or an accept waits at setup (then gloo carries the bytes)
_PENDING = 64  # connections read at once at setup, waiting for their hello


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
    """One end of a connection: whole transfers, in order.  A transfer is a header (magic, a
    sequence number both ends count, the size, or ``NONE``: nothing this time) and the bytes."""

    NONE = (1 << 64) - 1

    def __init__(self, sock: socket.socket, timeout_s: float, what: str) -> None:
        self.sock: socket.socket | None = sock
        self.what = what
        self.seq = 0
        # the most one transfer's bytes may take to arrive, however they trickle in: a peer
        # that sends a byte now and then would pass every per-call timeout and hold this rank
        # (and every rank in the replication's reduction after it) past the group's timeout
        self.timeout_s = timeout_s
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

    def _sock(self) -> socket.socket:
        sock = self.sock
        if sock is None:
            raise ConnectionError(f"{self.what} is closed")
        return sock

    def send(self, data: memoryview | None) -> None:
        """Send one transfer (None: the header only, saying there is nothing); on any failure
        the connection is closed (so the receiver sees its end at once, not at its timeout) and
        the error raised."""
        sock = self._sock()
        try:
            size = self.NONE if data is None else data.nbytes
            sock.sendall(_HEADER.pack(_HEADER_MAGIC, self.seq, size))
            self.seq += 1
            if data is not None and data.nbytes:
                sock.sendall(data)
        except BaseException:
            self.close()
            raise

    def receive_header(self) -> int | None:
        """The size of the next transfer, None when it carries nothing; its bytes must be taken
        next (``receive_into`` or ``drain``)."""
        sock = self._sock()
        try:
            header = bytearray(_HEADER.size)
            _receive_exactly(
                sock,
                memoryview(header),
                time.monotonic() + self.timeout_s,
                self.what,
                self.timeout_s,
            )
            magic, seq, size = _HEADER.unpack(header)
            if magic != _HEADER_MAGIC or seq != self.seq:
                raise ConnectionError(
                    f"{self.what}: expected the header of transfer {self.seq}, found "
                    + (f"transfer {seq}" if magic == _HEADER_MAGIC else "bytes that are not one")
                )
        except BaseException:
            self.close()
            raise
        self.seq += 1
        return None if size == self.NONE else int(size)

    def receive_into(self, into: memoryview, deadline: float | None = None) -> None:
        """The bytes of the transfer whose header came last, exactly ``into.nbytes`` of them,
        by ``deadline`` (time.monotonic; default: ``timeout_s`` from now)."""
        sock = self._sock()
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            _receive_exactly(sock, into, deadline, self.what, self.timeout_s)
        except BaseException:
            self.close()
            raise

    def drain(self, size: int) -> None:
        """Read and drop the ``size`` bytes of the transfer whose header came last (a receiver
        that cannot keep them keeps the connection in step)."""
        scratch = memoryview(bytearray(min(size, 1 << 20)))
        deadline = time.monotonic() + self.timeout_s  # (the whole transfer's, as any receive)
        while size > 0:
            n = min(size, scratch.nbytes)
            self.receive_into(scratch[:n], deadline)
            size -= n

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread blocked in it)
            except OSError:
                pass
            sock.close()


class Sender:
    """A thread of the link's own that sends its transfers (both directions of a pair move at
    once, and a thread started per transfer costs more than handing one over).  Every
    ``start`` gets exactly one outcome for ``wait``: its transfer's, or, once ``stop`` was
    called, a ConnectionError at once (the connection was closed, possibly on another thread,
    between a caller's taking this sender and its start: its thread no longer sends)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="resilient-replica-send", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._work.get()
            if data is _STOP:
                return
            try:
                self.link.send(data)
            except BaseException as e:  # (handed to the caller of wait)
                self._done.put(e)
            else:
                self._done.put(None)

    def start(self, data: memoryview | None) -> None:
        with self._lock:
            if not self._stopped:
                self._work.put(data)
                return
        self._done.put(ConnectionError(f"{self.link.what} is closed"))

    def wait(self) -> BaseException | None:
        """The outcome of the oldest transfer started and not waited for yet: None, or what it
        raised."""
        return self._done.get()

    def stop(self) -> None:
        """End the thread (after the transfers started before this, each of which still gets
        its outcome); a transfer started after this fails at once."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._work.put(_STOP)


_STOP = object()


def _receive_exactly(
    sock: socket.socket,
    view: memoryview,
    deadline: float | None = None,
    what: str = "a replica connection",
    timeout_s: float = 0.0,
) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            raise ConnectionError(f"the sender closed the connection after {got} of {n} bytes")
        got += k
        if got < n and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: {got} of {n} bytes arrived within {timeout_s:g} s, the most a "
                f"transfer may take (half the replicas' group timeout); expected all of them: "
                f"the peer sends too slowly (an overloaded node?), so the replicas travel "
                f"through gloo"
            )


class Links:
    """This rank's two connections: ``out`` to ``peer``, ``into`` from ``source``.  Constructing it
    is a collective of ``group``; ``usable`` is the same on every rank: every rank's two
    connections were up (else none is used, and the replicas travel through gloo), and so is
    ``failed``, which the replications set on every rank at once."""

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
        self.sender: Sender | None = None
        self.usable = False  # (set here only: the same on every rank for the generation)
        self.failed = False  # a replication over them failed somewhere (set on every rank)
        world = dist.get_world_size(group)
        # A connect and an accept each wait at most this long: together well within the group's
        # timeout, so that the other ranks, already in the next collective, do not time out
        # there (the set-up then ends in gloo, not in a failed group)
        setup_s = min(_SETUP_S, timeout_s / 4)
        # a connection's send or receive that makes no progress for this long fails: the
        # replication's reduction after it still has the group's whole timeout
        link_timeout_s = timeout_s / 2
        token = secrets.token_bytes(16)
        listener: socket.socket | None = None
        record = b""
        disabled = os.environ.get("RESILIENT_REPLICA_LINKS", "").strip() == "0"
        try:
            if disabled:
                raise ValueError("RESILIENT_REPLICA_LINKS=0")
            host = advertised_host()
            family = socket.AF_INET6 if _is_v6(host) else socket.AF_INET
            listener = socket.create_server((host, 0), family=family, backlog=64)
            port = listener.getsockname()[1]
            record = f"{host} {port} {token.hex()} {socket.gethostname()}".encode()
            if len(record) > _RECORD - 2:
                raise ValueError(f"its address and host name take {len(record)} bytes")
        except (OSError, ValueError) as e:
            if not disabled:
                log.warning(
                    "rank %d: cannot listen for its peer replicas (%s): they travel through gloo "
                    "(set RESILIENT_REPLICA_HOST to an address of this host that the other nodes "
                    "reach, or RESILIENT_REPLICA_LINKS=0 to use gloo without trying)",
                    rank,
                    e,
                )
        try:
            records = _all_gather_bytes(group, world, record)
            if not disabled:
                self.out = self._connect(records[peer], setup_s, link_timeout_s)
            connected = torch.tensor([int(self.out is not None)], dtype=torch.int64)
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(every, connected, group=group)
            if listener is not None and int(every[source].item()):
                self.into = self._accept(listener, token, setup_s, link_timeout_s)
            if self.out is not None and self.into is not None:
                try:
                    self.sender = Sender(self.out)  # (before the reduction: its failure counts)
                except RuntimeError as e:  # (no thread can be started)
                    log.warning("rank %d: no thread to send replicas: %s", rank, e)
            up = torch.tensor([int(self.sender is not None and self.into is not None)])
            dist.all_reduce(up, op=dist.ReduceOp.MIN, group=group)
            if int(up.item()):
                self.usable = True
            else:
                self.close()
        except Exception as e:  # a collective failed (the group broke, or timed out)
            self.close()
            raise ResilientError(
                f"rank {rank}: setting up the peer replicas' connections failed in the replicas' "
                f"process group: {e}"
            ) from e
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
            host, port, token, hostname = record.decode().split(" ")
            if _is_unspecified(host) or (_is_loopback(host) and hostname != socket.gethostname()):
                raise ValueError(
                    f"it advertises {host} from host {hostname}, an address this host cannot "
                    f"reach it at; set RESILIENT_REPLICA_HOST there to one it can"
                )
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
            return Link(
                sock, timeout_s, f"rank {self.rank}'s replica connection to rank {self.peer}"
            )
        except (OSError, ValueError) as e:
            sock.close()
            log.warning("rank %d: hello to peer rank %d failed: %s", self.rank, self.peer, e)
            return None

    def _accept(
        self, listener: socket.socket, token: bytes, setup_s: float, timeout_s: float
    ) -> Link | None:
        """The connection from this rank's source: the first whose hello names the source and
        this rank's token, within ``setup_s``; None (and a warning) when none came.  Every
        connection that reaches the port is read at once (a stranger that sends slowly, or
        nothing, holds up no other), up to the hello's 28 bytes; at most ``_PENDING`` at a time."""
        try:
            found = self._hello_from_source(listener, token, setup_s)
        except OSError as e:  # (no descriptor for the selector, ...): gloo, on every rank
            log.warning("rank %d: cannot accept its source's connection: %s", self.rank, e)
            return None
        if found is not None:
            try:
                return Link(
                    found,
                    timeout_s,
                    f"rank {self.rank}'s replica connection from rank {self.source}",
                )
            except OSError as e:
                found.close()
                log.warning("rank %d: the connection from rank %d: %s", self.rank, self.source, e)
                return None
        log.warning(
            "rank %d: its source rank %d did not connect for replicas within %.0f s: they travel "
            "through gloo",
            self.rank,
            self.source,
            setup_s,
        )
        return None

    def _hello_from_source(
        self, listener: socket.socket, token: bytes, setup_s: float
    ) -> socket.socket | None:
        """(``_accept``) The socket whose hello is right, or None at the deadline."""
        deadline = time.monotonic() + setup_s
        pending: dict[socket.socket, bytearray] = {}  # (in the order they came)
        found: socket.socket | None = None
        listener.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ)
            try:
                while found is None and (left := deadline - time.monotonic()) > 0:
                    for key, _ in sel.select(timeout=left):
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        if sock is listener:
                            try:
                                conn, _ = listener.accept()
                            except OSError:
                                continue
                            if len(pending) >= _PENDING:  # the oldest goes, not the newest:
                                # strangers that came first do not lock the source out
                                oldest = next(iter(pending))
                                sel.unregister(oldest)
                                del pending[oldest]
                                oldest.close()
                            conn.setblocking(False)
                            pending[conn] = bytearray()
                            sel.register(conn, selectors.EVENT_READ)
                            continue
                        got = pending.get(sock)
                        if got is None:  # (the oldest, closed for a newer one just now)
                            continue
                        try:
                            chunk = sock.recv(_HELLO.size - len(got))
                        except BlockingIOError:
                            continue
                        except OSError:
                            chunk = b""
                        got += chunk
                        if chunk and len(got) < _HELLO.size:
                            continue
                        sel.unregister(sock)
                        del pending[sock]
                        if len(got) == _HELLO.size and secrets.compare_digest(
                            bytes(got), _HELLO.pack(_HELLO_MAGIC, self.source, token)
                        ):
                            found = sock
                            break
                        sock.close()  # not the source: whatever else reached the port
            finally:
                for sock in pending:
                    sock.close()
        return found

    def close(self) -> None:
        """Close both connections (a transfer in flight fails at once)."""
        for link in (self.out, self.into):
            if link is not None:
                link.close()
        if self.sender is not None:
            self.sender.stop()
            self.sender = None


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


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)  # (::ffff:127.0.0.1 is 127.0.0.1)
    return mapped if mapped is not None else ip


def _is_loopback(host: str) -> bool:
    ip = _ip(host)
    return ip.is_loopback if ip is not None else host == "localhost"


def _is_unspecified(host: str) -> bool:
    ip = _ip(host)
    return ip is not None and ip.is_unspecified


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
