"""Peer replicas on connections of their own (resilient/checkpoint/links.py): they travel by
socket, arrive bit-exact, and when a connection cannot be made or breaks, every rank replicates
through gloo from then on, without losing a replica.  Four ranks on two memory roots stand for two
nodes (rank r's peer and source: r + 2 mod 4)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.checkpoint.links import Link, Sender
from tests.dist import run_distributed
from tests.test_memory_nodes import _root, _state


def _links(ck: Checkpointer):
    return ck._memory._replicas.links


def _snapshots(rank, world, url, base, steps, before=None) -> dict:
    """Snapshots ``steps`` on two nodes; ``before(rank, ck, step)`` runs before each."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    for step in steps:
        if before is not None:
            before(rank, ck, step)
        ck.snapshot(step, _state(rank, world, float(step))).wait()
        dist.barrier()  # every replica of the step is in (or failed) before the next
    # (a snapshot's handle is done before its thread deletes the step its commit retired: every
    # rank's thread is over before any rank lists its node's steps)
    ck._memory._join_pending()
    dist.barrier()
    links = _links(ck)
    out = {
        # transfers made on each connection, None where it is not up
        "out": links.out.seq if links.out is not None and links.out.up else None,
        "into": links.into.seq if links.into is not None and links.into.up else None,
        "dir": str(ck.memory.steps),
        "steps": {
            p.name: sorted(f.name for f in p.iterdir())
            for p in sorted(Path(ck.memory.steps).glob("step_*"))
        },
    }
    ck.close()
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_replicas_are_the_files(res: list[dict], step: int) -> None:
    """Each node's replica of the other node's files of ``step`` is byte for byte the file."""
    d = f"step_{step:08d}"
    for node, other in ((0, 1), (1, 0)):
        for r in (2 * other, 2 * other + 1):
            name = f"rank_{r:05d}.safetensors"
            held = Path(res[2 * node]["dir"]) / d / name
            own = Path(res[2 * other]["dir"]) / d / name
            assert _digest(held) == _digest(own), (node, name)


def test_replicas_travel_by_socket_and_arrive_bit_exact(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(_snapshots, 4, url, base, (1, 2, 3))
    for r in res:  # every transfer went over the rank's two connections
        assert (r["out"], r["into"]) == (3, 3)
    _assert_replicas_are_the_files(res, 3)
    assert "rank_00002.safetensors" in res[0]["steps"]["step_00000003"]


def _break_rank_2s_connection_mid_transfer(rank, ck, step) -> None:
    """Before step 2, rank 2's connection to rank 0 sends half a file and closes."""
    if rank != 2 or step != 2:
        return
    link = _links(ck).out

    def half(data):
        sock = link.sock
        from resilient.checkpoint import links as links_mod

        sock.sendall(links_mod._HEADER.pack(links_mod._HEADER_MAGIC, link.seq, data.nbytes))
        sock.sendall(data[: data.nbytes // 2])
        link.seq += 1
        link.close()
        raise ConnectionResetError("the connection broke (the test)")

    link.send = half


def test_a_connection_that_breaks_mid_transfer_hands_replication_to_gloo(tmp_path):
    """Rank 0 gets half of rank 2's file of step 2: that replica fails, every rank closes its
    connections, and step 3's replicas reach every node through gloo, bit-exact."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(
        _snapshots, 4, url, base, (1, 2, 3), _break_rank_2s_connection_mid_transfer
    )
    assert all(r["out"] is None and r["into"] is None for r in res)
    # step 2's replica of rank 2 never arrived; step 3's did
    assert "rank_00002.safetensors" not in res[0]["steps"].get("step_00000002", [])
    assert "rank_00002.safetensors" in res[0]["steps"]["step_00000003"]
    _assert_replicas_are_the_files(res, 3)


def _no_address_on_rank_0(rank, world, url, base) -> dict:
    import os

    if rank == 0:  # an address this host does not have (TEST-NET-1): rank 0 cannot listen
        os.environ["RESILIENT_REPLICA_HOST"] = "192.0.2.1"
    return _snapshots(rank, world, url, base, (1, 2))


def test_when_a_rank_cannot_listen_every_rank_replicates_through_gloo(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(_no_address_on_rank_0, 4, url, base)
    assert all(r["out"] is None and r["into"] is None for r in res)
    _assert_replicas_are_the_files(res, 2)
    assert "rank_00002.safetensors" in res[0]["steps"]["step_00000002"]


def _strangers_first(rank, world) -> dict:
    """One rank, its own peer: before it connects to itself, two strangers reach its port, one
    with a wrong token, one naming another rank; only the real connection is taken."""
    import torch.distributed as dist

    from resilient.checkpoint import links as links_mod

    real_connect = links_mod.Links._connect
    strangers: list[socket.socket] = []

    def strangers_then_real(self, record, setup_s, timeout_s):
        host, port, token, _ = record.decode().split(" ")
        for hello in (
            links_mod._HELLO.pack(links_mod._HELLO_MAGIC, 0, b"\x00" * 16),
            links_mod._HELLO.pack(links_mod._HELLO_MAGIC, 7, bytes.fromhex(token)),
        ):
            s = socket.create_connection((host, int(port)))
            s.sendall(hello)
            strangers.append(s)
        return real_connect(self, record, setup_s, timeout_s)

    links_mod.Links._connect = strangers_then_real
    group = dist.new_group(backend="gloo")
    links = links_mod.Links(group, 0, 0, 0, timeout_s=30)
    turned_away = []
    for s in strangers:
        s.settimeout(10)
        turned_away.append(s.recv(1) == b"")  # closed by the listener's side
        s.close()
    payload = bytes(range(256)) * 64
    into = bytearray(len(payload))
    usable = links.usable
    links.sender.start(memoryview(payload))
    size = links.into.receive_header()
    links.into.receive_into(memoryview(into))
    sent = links.sender.wait()
    links.close()
    return {
        "turned_away": turned_away,
        "usable": usable,
        "arrived": size == len(payload) and bytes(into) == payload and sent is None,
    }


def test_strangers_at_the_replica_port_are_turned_away(tmp_path):
    (res,) = run_distributed(_strangers_first, 1)
    assert res == {"turned_away": [True, True], "usable": True, "arrived": True}


def _pair(timeout_s: float = 30) -> tuple[Link, Link]:
    with socket.create_server(("127.0.0.1", 0)) as server:  # (TCP, as between nodes)
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Link(a, timeout_s, "the sender"), Link(b, timeout_s, "the receiver")


def _send(link: Link, data: bytes | None) -> threading.Thread:
    t = threading.Thread(target=link.send, args=(None if data is None else memoryview(data),))
    t.start()
    return t


def test_a_transfer_out_of_step_is_refused_and_closes_the_link():
    out, into = _pair()
    out.seq = 1  # the sender is one transfer ahead of the receiver
    t = _send(out, b"x" * 100)
    with pytest.raises(
        ConnectionError, match="expected the header of transfer 0, found transfer 1"
    ):
        into.receive_header()
    t.join()
    assert not into.up
    out.close()


def test_bytes_that_are_not_a_header_are_refused():
    out, into = _pair()
    out.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ConnectionError, match="found bytes that are not one"):
        into.receive_header()
    assert not into.up
    out.close()


def test_a_sender_that_closes_mid_transfer_ends_the_receive_at_once():
    out, into = _pair(timeout_s=600)  # (a receive waiting for its timeout would hang the test)
    from resilient.checkpoint import links as links_mod

    out.sock.sendall(links_mod._HEADER.pack(links_mod._HEADER_MAGIC, 0, 1000))
    out.sock.sendall(b"y" * 10)
    out.close()
    assert into.receive_header() == 1000
    with pytest.raises(ConnectionError, match="after 10 of 1000 bytes"):
        into.receive_into(memoryview(bytearray(1000)))
    assert not into.up


def test_transfers_in_order_arrive_whole_nothing_and_drained_ones_included():
    out, into = _pair()
    sizes = []
    for n in (0, 1, 3 << 20, None, (1 << 20) + 5, 7):
        data = None if n is None else bytes(os.urandom(n))
        t = _send(out, data)
        size = into.receive_header()
        sizes.append(size)
        if n == (1 << 20) + 5:
            into.drain(size)  # a receiver with no room for it: the next one is still whole
        elif size is not None:
            got = bytearray(size)
            into.receive_into(memoryview(got))
            assert bytes(got) == data
        t.join()
    assert sizes == [0, 1, 3 << 20, None, (1 << 20) + 5, 7]
    assert out.seq == into.seq == 6
    out.close()
    into.close()


def test_a_stopped_sender_fails_what_it_is_given_instead_of_hanging():
    out, into = _pair()
    sender = Sender(out)
    sender.stop()
    sender.start(memoryview(b"late"))
    assert isinstance(sender.wait(), ConnectionError)
    out.close()
    into.close()


def _silent_strangers_first(rank, world, crowd: int, pending: int | None) -> dict:
    """``crowd`` strangers reach the port before the source and send nothing, holding their
    connections open (``pending``: how many the set-up reads at once, if not its own): the
    source's connection behind them is still taken (every connection is read at once, and when
    too many wait, the oldest make room)."""
    import torch.distributed as dist

    from resilient.checkpoint import links as links_mod

    real_connect = links_mod.Links._connect
    held: list[socket.socket] = []
    if pending is not None:
        links_mod._PENDING = pending

    def strangers_then_real(self, record, setup_s, timeout_s):
        host, port, _, _ = record.decode().split(" ")
        for _ in range(crowd):
            held.append(socket.create_connection((host, int(port))))
        return real_connect(self, record, setup_s, timeout_s)

    links_mod.Links._connect = strangers_then_real
    group = dist.new_group(backend="gloo")
    links = links_mod.Links(group, 0, 0, 0, timeout_s=20)  # (5 s to accept)
    usable = links.usable
    links.close()
    for s in held:
        s.close()
    return {"usable": usable}


def test_a_silent_stranger_at_the_port_holds_up_no_one(tmp_path):
    (res,) = run_distributed(_silent_strangers_first, 1, 1, None)
    assert res == {"usable": True}


def _a_peer_that_cannot_be_reached(rank, world) -> str:
    """Rank 1's connect hangs until its set-up time is over (a firewall dropping the packets),
    with a group timeout of 16 s: the set-up ends in gloo on both ranks, within the timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    from resilient.checkpoint import links as links_mod

    if rank == 1:

        def dropped(address, timeout=None):
            time.sleep(timeout)
            raise TimeoutError("timed out (the test: packets dropped)")

        links_mod.socket.create_connection = dropped
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=16))
    links = links_mod.Links(group, rank, 1 - rank, 1 - rank, timeout_s=16)
    usable = links.usable
    links.close()
    return f"usable={usable}"


def test_a_peer_that_cannot_be_reached_leaves_gloo_in_charge_not_a_failed_group(tmp_path):
    assert run_distributed(_a_peer_that_cannot_be_reached, 2) == ["usable=False"] * 2


def _unreadable_own_file_at_step_2(rank, ck, step) -> None:
    if rank != 2 or step != 2:
        return
    from resilient.checkpoint import replicas as replicas_mod

    real = replicas_mod._file_tensor

    def unreadable(storage, rel):
        if "step_00000002" in rel:
            raise OSError("Input/output error (the test)")
        return real(storage, rel)

    replicas_mod._file_tensor = unreadable


def test_a_rank_that_cannot_read_its_file_says_so_and_the_others_still_replicate(tmp_path):
    """Rank 2 cannot read its file of step 2: it sends word that there is nothing, rank 0 keeps
    rank 2's replica of step 1, rank 1 still gets rank 3's of step 2; the links stay up."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(_snapshots, 4, url, base, (1, 2, 3), _unreadable_own_file_at_step_2)
    for r in res:
        assert (r["out"], r["into"]) == (3, 3)
    assert "rank_00002.safetensors" in res[0]["steps"]["step_00000003"]
    _assert_replicas_are_the_files(res, 3)


def _regroup_then_snapshot(rank, world, url, base) -> dict:
    """In-job recovery's part: the replicas' groups dropped and formed again (twice), then a
    snapshot: it travels over the new generation's connections; one send thread is left."""
    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    ck.snapshot(1, _state(rank, world, 1.0)).wait()
    replicas = ck._memory._replicas
    first = replicas.links
    for _ in range(2):
        replicas.drop_groups()
        replicas.regroup()
    ck.snapshot(2, _state(rank, world, 2.0)).wait()
    dist.barrier()
    links = replicas.links
    out = {
        "old_closed": not first.out.up and not first.into.up,
        "seq": (links.out.seq, links.into.seq),
        "senders": sum(t.name == "resilient-replica-send" for t in threading.enumerate()),
        "dir": str(ck.memory.steps),
    }
    ck.close()
    out["senders_after_close"] = sum(
        t.name == "resilient-replica-send" and t.is_alive() for t in threading.enumerate()
    )
    return out


def test_a_regroup_makes_new_connections_and_closes_the_old(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(_regroup_then_snapshot, 4, url, base)
    for r in res:
        assert r["old_closed"] and r["seq"] == (1, 1) and r["senders"] == 1
    _assert_replicas_are_the_files(res, 2)


def test_a_crowd_at_the_port_does_not_lock_the_source_out(tmp_path):
    # 20 within the listen backlog (all wait to be accepted), 8 read at once
    (res,) = run_distributed(_silent_strangers_first, 1, 20, 8)
    assert res == {"usable": True}


def _no_descriptor_for_the_selector_on_rank_1(rank, world) -> str:
    """Rank 1 cannot make the selector it accepts with (EMFILE): every rank ends in gloo, none
    fails, and nobody waits for the group's timeout."""
    import errno

    import torch.distributed as dist

    from resilient.checkpoint import links as links_mod

    if rank == 1:

        def no_selector():
            raise OSError(errno.EMFILE, "Too many open files (the test)")

        links_mod.selectors.DefaultSelector = no_selector
    group = dist.new_group(backend="gloo")
    links = links_mod.Links(group, rank, 1 - rank, 1 - rank, timeout_s=60)
    usable = links.usable
    links.close()
    return f"usable={usable}"


def test_a_rank_that_cannot_accept_leaves_every_rank_in_gloo(tmp_path):
    assert run_distributed(_no_descriptor_for_the_selector_on_rank_1, 2) == ["usable=False"] * 2


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost", "0.0.0.0", "::"]
)
def test_an_address_the_peer_cannot_be_reached_at_is_not_connected_to(host, caplog):
    """A peer on another host that advertises a loopback address (or none at all) is not
    connected to: the connection would reach this host."""
    from resilient.checkpoint.links import Links

    links = Links.__new__(Links)
    links.rank, links.peer = 0, 1
    record = f"{host} 1 {'00' * 16} another-host-than-{socket.gethostname()}".encode()
    assert links._connect(record, 1.0, 1.0) is None
    assert "an address this host cannot reach it at" in caplog.text


def test_a_peer_that_trickles_its_bytes_fails_the_transfer_at_the_links_timeout():
    """(a review) Each receive call waited at most the link's timeout for *some* bytes, so a
    peer sending a byte now and then (an overloaded node) held the receive, and every rank in
    the replication's reduction after it, without end: past the group's timeout, which then
    broke the group instead of handing the replicas to gloo."""
    out, into = _pair(timeout_s=0.5)
    from resilient.checkpoint import links as links_mod

    stop = threading.Event()

    def trickle() -> None:
        out.sock.sendall(links_mod._HEADER.pack(links_mod._HEADER_MAGIC, 0, 40))
        for _ in range(40):
            if stop.wait(0.1):
                return
            try:
                out.sock.sendall(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert into.receive_header() == 40
        with pytest.raises(
            TimeoutError,
            match=r"the receiver: \d+ of 40 bytes arrived within "
            r"0.5 s, the most a transfer may take .* travel through gloo",
        ):
            into.receive_into(memoryview(bytearray(40)))
        assert not into.up
    finally:
        stop.set()
        t.join()
        out.close()
