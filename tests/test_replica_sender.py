"""The replicas' send thread: every start gets exactly one outcome, also once the connection
was closed.  replicate_sealed starts two transfers and waits for two outcomes: when the links
are closed (in-job recovery's drop_groups on the main thread) after the replication took
``links.sender`` but before its first start, a second wait that never returned would hang the
snapshot's background thread, and every later ``_join_pending`` (rebind, load, close) with it."""

from __future__ import annotations

import threading
import types

from resilient.checkpoint.links import Sender
from resilient.checkpoint.replicas import Replicas


def _fake_link():
    return types.SimpleNamespace(send=lambda data: None, what="a fake connection")


def _release(sender: Sender, n: int = 4) -> None:
    for _ in range(n):  # (so that a hung thread of this test ends)
        sender._done.put(ConnectionError("released by the test"))


def test_every_start_after_stop_gets_an_outcome():
    """Two transfers started after stop: each gets its outcome (a ConnectionError) at once."""
    sender = Sender(_fake_link())
    sender.stop()
    sender._thread.join(5)
    sender.start(None)
    sender.start(None)
    outcomes: list = []
    t = threading.Thread(target=lambda: outcomes.extend([sender.wait(), sender.wait()]))
    t.daemon = True
    t.start()
    t.join(3)
    try:
        assert not t.is_alive(), f"the second wait hangs (outcomes so far: {outcomes})"
        assert [type(o) for o in outcomes] == [ConnectionError, ConnectionError]
    finally:
        _release(sender)
        t.join(3)


def test_replicate_sealed_returns_when_the_links_close_before_its_first_start(tmp_path):
    """The links closed (drop_groups) between replicate_sealed's taking links.sender and its
    first start (Links.close: sender.stop() then sender = None): the replication returns."""
    sender = Sender(_fake_link())
    sender.stop()  # (Links.close, between the capture and the starts)
    sender._thread.join(5)

    class _Into:
        def receive_header(self):
            raise ConnectionError("a fake connection is closed")

    links = types.SimpleNamespace(
        sender=sender, into=_Into(), usable=True, failed=False, close=lambda: None
    )
    r = object.__new__(Replicas)
    r.nodes = types.SimpleNamespace(source=lambda rank: 1, peer=lambda rank: 1)
    r.rank, r.links, r.staging = 0, links, str(tmp_path)
    r._spare = r._held = None
    r.reused = 0
    r._groups = lambda epoch=None: (None, [])

    import torch.distributed as dist

    real = dist.all_reduce
    dist.all_reduce = lambda t, op=None, group=None: None  # (one rank: the reduction is a no-op)
    done = threading.Event()

    def run():
        try:
            r.replicate_sealed(None, 3, None, None)
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert done.wait(3), "replicate_sealed never returned (its second sender.wait hangs)"
    finally:
        _release(sender)
        t.join(3)
        dist.all_reduce = real
