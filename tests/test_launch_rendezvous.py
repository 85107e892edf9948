"""``resilient launch`` on several nodes: every rendezvous round agrees on the workers' store.

Real torch c10d rendezvous handlers in one process (each its own node), with the store shared with
the workers (torch's default).  Nodes A and B form round 0; B is lost and a new node C takes its
place in round 1.  torch publishes the workers' store address only in an agent's first round as
rank 0, so C (or A, with its cached address) would wait for it until the read timeout;
``share_store_address`` has round 1's rank 0 publish it, and both agree on it."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from resilient.launch import free_port
from resilient.launch.agent import share_store_address

pytestmark = [pytest.mark.distributed]


def _handler(port: int, run_id: str) -> Any:
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        join_timeout=60,
        last_call_timeout=1,
        keep_alive_interval=1,
        keep_alive_max_attempt=2,
        read_timeout=15,
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    share_store_address(handler)
    return handler


def _round(handlers: dict[str, Any], timeout_s: float = 90.0) -> dict[str, Any]:
    """Every handler's ``next_rendezvous`` at once (as the agents of a job call it)."""
    got: dict[str, Any] = {}

    def join(name: str) -> None:
        try:
            got[name] = handlers[name].next_rendezvous()
        except Exception as e:  # the test names it
            got[name] = e

    threads = [threading.Thread(target=join, args=(n,), daemon=True) for n in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert set(got) == set(handlers), f"rendezvous did not return: {set(handlers) - set(got)}"
    failed = {n: r for n, r in got.items() if isinstance(r, Exception)}
    assert not failed, failed
    return got


def _address(info: Any) -> tuple[str, int]:
    return info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port


def test_a_node_that_joins_a_later_round_gets_the_workers_store_address():
    port, run_id = free_port(), str(uuid.uuid4())
    a, b = _handler(port, run_id), _handler(port, run_id)
    handlers = {"a": a, "b": b}
    try:
        first = _round(handlers)
        assert sorted(i.rank for i in first.values()) == [0, 1]
        assert _address(first["a"]) == _address(first["b"])
        b._stop_heartbeats()  # node B is lost (its keep-alives stop) ...
        del handlers["b"]
        handlers["c"] = _handler(port, run_id)  # ... and a new node takes its place
        second = _round(handlers)
        assert sorted(i.rank for i in second.values()) == [0, 1]
        assert _address(second["a"]) == _address(second["c"])
        rank0 = next(i for i in second.values() if i.rank == 0)
        # the address every rank got is what the round's store says
        store = rank0.store
        assert store.get("MASTER_ADDR").decode() == _address(rank0)[0]
        assert int(store.get("MASTER_PORT").decode()) == _address(rank0)[1]
    finally:
        for h in (a, b, *handlers.values()):
            try:
                h._stop_heartbeats()
            except Exception:
                pass


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    """A rendezvous port the kernel never hands out as an outgoing connection's source port."""
    import socket

    from resilient.launch import _ephemeral_low, free_port

    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        if low > 2048:
            assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_rendezvous_records_name_the_methods_that_made_them(monkeypatch):
    """``name_records_by_frame`` (applied when the launcher module is imported): every event a
    real round records is named, as torch's ``inspect.stack()`` named it, after the method that
    recorded it."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    assert getattr(dynamic_rendezvous.get_method_name, "__resilient__", False)
    names: list[tuple[str, str]] = []
    record = dynamic_rendezvous.construct_and_record_rdzv_event

    def collect(**event: Any) -> None:
        # called by _record: the method that called _record is two frames up, as torch looks
        names.append((event["name"].rsplit(".", 1)[1], inspect.stack()[2].function))
        record(**event)

    monkeypatch.setattr(dynamic_rendezvous, "construct_and_record_rdzv_event", collect)
    port, run_id = free_port(), str(uuid.uuid4())
    handlers = {"a": _handler(port, run_id), "b": _handler(port, run_id)}
    try:
        _round(handlers)
    finally:
        for h in handlers.values():
            h.shutdown()
    assert len(names) >= 4 and all(got == torchs for got, torchs in names), names
    assert {"next_rendezvous", "_add_to_participants"} <= {got for got, _ in names}, names
