"""Peer replicas' bytes on connections of their own (resilient/checkpoint/links.py): they travel
by socket, arrive bit-exact, and any connection that breaks or cannot be made hands its transfers
to gloo on both of its ends, without losing a replica.  Four ranks on two memory roots stand for
two nodes (rank r's peer and source: r + 2 mod 4)."""

from __future__ import annotations

import hashlib
import socket
import threading
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.checkpoint.links import Link
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
    links = _links(ck)
    out = {
        # transfers made on each connection, None where it is not up
        "out": links.out.seq if links.out is not None and links.out.up else None,
        "into": links.into.seq if links.into is not None and links.into.up else None,
        "steps": {
            p.name: sorted(f.name for f in p.iterdir())
            for p in sorted(Path(ck.memory.steps).glob("step_*"))
        },
    }
    ck.close()
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_replicas_are_the_files(base: str, step: int) -> None:
    """Each node's replica of the other node's files of ``step`` is byte for byte the file."""
    d = f"step_{step:08d}"
    for node, other in ((0, 1), (1, 0)):
        for r in (2 * other, 2 * other + 1):
            name = f"rank_{r:05d}.safetensors"
            own, held = _step_dir(base, other, d) / name, _step_dir(base, node, d) / name
            assert _digest(held) == _digest(own), (node, name)


def _step_dir(base: str, node: int, d: str) -> Path:
    found = list(Path(_root(base, node)).rglob(d))
    assert len(found) == 1, found
    return found[0]


def test_replicas_travel_by_socket_and_arrive_bit_exact(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(_snapshots, 4, url, base, (1, 2, 3))
    for r in res:  # every transfer went over the rank's two connections
        assert (r["out"], r["into"]) == (3, 3)
    _assert_replicas_are_the_files(base, 3)
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
        link.close()
        raise ConnectionResetError("the connection broke (the test)")

    link.send = half


def test_a_connection_that_breaks_mid_transfer_hands_the_pair_to_gloo(tmp_path):
    """Rank 0 gets half of rank 2's file of step 2: that replica fails (step 1's stay on node 0),
    both ends of the connection close, and step 3 reaches rank 0 through gloo, bit-exact; the
    other connections carry on."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(
        _snapshots, 4, url, base, (1, 2, 3), _break_rank_2s_connection_mid_transfer
    )
    assert res[0]["into"] is None and res[2]["out"] is None
    assert (res[0]["out"], res[2]["into"]) == (3, 3)  # the other direction of the pair
    assert (res[1]["out"], res[1]["into"], res[3]["out"], res[3]["into"]) == (3, 3, 3, 3)
    # step 2's replica of rank 2 failed: the older ones stayed on node 0 until step 3's came
    assert "rank_00002.safetensors" not in res[0]["steps"].get("step_00000002", [])
    assert "rank_00002.safetensors" in res[0]["steps"]["step_00000003"]
    _assert_replicas_are_the_files(base, 3)


def _no_address_on_rank_0(rank, world, url, base) -> dict:
    import os

    if rank == 0:  # an address this host does not have (TEST-NET-1): rank 0 cannot listen
        os.environ["RESILIENT_REPLICA_HOST"] = "192.0.2.1"
    return _snapshots(rank, world, url, base, (1, 2))


def test_a_rank_that_cannot_listen_gets_its_replicas_through_gloo(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    res = run_distributed(_no_address_on_rank_0, 4, url, base)
    assert res[0]["into"] is None and res[2]["out"] is None  # rank 2 -> rank 0: gloo
    assert (res[0]["out"], res[2]["into"]) == (2, 2)  # rank 0 -> rank 2: by socket
    assert (res[1]["out"], res[1]["into"]) == (2, 2)
    _assert_replicas_are_the_files(base, 2)


def _strangers_first(rank, world) -> dict:
    """One rank, its own peer: before it connects to itself, two strangers reach its port, one
    with a wrong token, one naming another rank; only the real connection is taken."""
    import torch.distributed as dist

    from resilient.checkpoint import links as links_mod

    real_connect = links_mod.Links._connect
    strangers: list[socket.socket] = []

    def strangers_then_real(self, record, setup_s, timeout_s):
        host, port, token = record.decode().split(" ")
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
    t = threading.Thread(target=links.out.send, args=(memoryview(payload),))
    t.start()
    links.into.receive_into(memoryview(into))
    t.join()
    links.close()
    return {"turned_away": turned_away, "arrived": bytes(into) == payload}


def test_strangers_at_the_replica_port_are_turned_away(tmp_path):
    (res,) = run_distributed(_strangers_first, 1)
    assert res == {"turned_away": [True, True], "arrived": True}


def _pair(timeout_s: float = 30) -> tuple[Link, Link]:
    with socket.create_server(("127.0.0.1", 0)) as server:  # (TCP, as between nodes)
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Link(a, timeout_s, "the sender"), Link(b, timeout_s, "the receiver")


def test_a_transfer_out_of_step_is_refused_and_closes_the_link():
    out, into = _pair()
    out.seq = 1  # the sender is one transfer ahead of the receiver
    t = threading.Thread(target=out.send, args=(memoryview(b"x" * 100),))
    t.start()
    with pytest.raises(ConnectionError, match="expected transfer 0 of 100 bytes, found transfer 1"):
        into.receive_into(memoryview(bytearray(100)))
    t.join()
    assert not into.up
    out.close()


def test_a_transfer_of_another_size_is_refused():
    out, into = _pair()
    t = threading.Thread(target=out.send, args=(memoryview(b"x" * 100),))
    t.start()
    with pytest.raises(
        ConnectionError, match="expected transfer 0 of 64 bytes, found transfer 0 of 100"
    ):
        into.receive_into(memoryview(bytearray(64)))
    t.join()
    assert not into.up
    out.close()


def test_a_sender_that_closes_mid_transfer_ends_the_receive_at_once():
    out, into = _pair(timeout_s=600)  # (a receive waiting for its timeout would hang the test)
    from resilient.checkpoint import links as links_mod

    out.sock.sendall(links_mod._HEADER.pack(links_mod._HEADER_MAGIC, 0, 1000))
    out.sock.sendall(b"y" * 10)
    out.close()
    with pytest.raises(ConnectionError, match="after 10 of 1000 bytes"):
        into.receive_into(memoryview(bytearray(1000)))
    assert not into.up


def test_transfers_in_order_arrive_whole():
    out, into = _pair()
    for n in (0, 1, 3 << 20):
        data = bytes(hashlib.sha256(str(n).encode()).digest()) * (n // 32) + b"z" * (n % 32)
        got = bytearray(n)
        t = threading.Thread(target=out.send, args=(memoryview(data),))
        t.start()
        into.receive_into(memoryview(got))
        t.join()
        assert bytes(got) == data
    assert out.seq == into.seq == 3
    out.close()
    into.close()
