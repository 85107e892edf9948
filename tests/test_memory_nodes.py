"""The memory tier across nodes: each node keeps its ranks' snapshots, every rank's file of the
newest one is replicated to its peer on the next node, and a restore brings the files a rank needs
from whichever node holds them.  Nodes are memory roots here: four ranks, two roots, as two
torchrun agents on one host stand for two nodes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer, Shard, sharded
from tests.dist import run_distributed


@pytest.fixture(params=["links", "gloo"])
def transport(request, monkeypatch) -> str:
    """Replicas over the tier's own connections (the default), or through gloo only
    (``RESILIENT_REPLICA_LINKS=0``: where connections cannot be made, or after one broke)."""
    if request.param == "gloo":
        monkeypatch.setenv("RESILIENT_REPLICA_LINKS", "0")
    return request.param


def _root(base: str, node: int) -> str:
    return str(Path(base) / f"node{node}")


def _state(rank: int, world: int, value: float) -> dict:
    # every rank holds its own slice of "w" (16 values in all, so every rank's file holds bytes no
    # other rank has), and a replicated "b"
    w = torch.full((16 // world,), value + rank, dtype=torch.float32)
    return {
        "w": sharded(w, {"dp": Shard(0)}, global_shape=(16,)),
        "b": torch.full((3,), value, dtype=torch.float32),
        "meta": {"value": value},
    }


def _snapshot_on_two_nodes(rank: int, world: int, url: str, base: str) -> dict:
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    assert ck.nodes.nodes == 2 and ck.nodes.peer(rank) == (rank + 2) % 4
    for step in (1, 2, 3):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    import torch.distributed as dist

    dist.barrier()  # every rank's replica is in (a rank's wait() covers its own receive only)
    own = sorted(p.name for p in (Path(ck.memory.steps) / "step_00000003").iterdir())
    older = sorted(p.name for p in (Path(ck.memory.steps) / "step_00000002").iterdir())
    staging = sorted(p.name for p in (Path(ck.memory.dir) / "staging").iterdir())
    reused = ck._memory._replicas.reused
    linked = _linked(ck)
    manifest = (Path(ck.memory.steps) / "step_00000003" / "MANIFEST.json").read_bytes()
    ck.close()
    return {
        "manifest": manifest,
        "linked": linked,
        "own": own,
        "older": older,
        "memory_steps": ck.memory_steps(),
        "staging": staging,
        "replicas_into_spare": reused,
    }


def _restore(rank: int, world: int, url: str, base: str, node: int | None) -> tuple:
    node = rank // 2 if node is None else node
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, node), persister=False)
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = (got, ck.last_load.source, state["w"].tolist(), state["b"].tolist(), state["meta"])
    ck.close()
    return out


def test_every_node_holds_its_snapshots_and_the_previous_nodes_newest_replica(tmp_path, transport):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_snapshot_on_two_nodes, 4, url, base)
    for node in (0, 1):
        r = results[2 * node]
        assert r["memory_steps"] == [3, 2]
        mine = {f"rank_{x:05d}.safetensors" for x in (2 * node, 2 * node + 1)}
        theirs = {f"rank_{x:05d}.safetensors" for x in (2 * (1 - node), 2 * (1 - node) + 1)}
        # the newest step: this node's files, the peer node's replicas and the manifest
        assert set(r["own"]) == mine | theirs | {"MANIFEST.json"}
        # older steps keep no replica: one replica per rank is held
        assert set(r["older"]) == mine | {"MANIFEST.json"}
    # node 1's leader published rank 0's very bytes (from the summary line's message)
    assert results[2]["manifest"] == results[0]["manifest"]
    assert results[0]["manifest"].startswith(b"{")
    for rank, r in enumerate(results):
        assert r["linked"] == ([3, 3] if transport == "links" else [None, None])
        # the third replica went into the file of the first (the second's is the spare now);
        # the next test restores a replaced node from it
        assert r["replicas_into_spare"] == 1
        assert f"replica_{rank:05d}.safetensors" in r["staging"]


def test_a_replaced_node_restores_from_its_peers_replica(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshot_on_two_nodes, 4, url, base)
    shutil.rmtree(_root(base, 1))  # node 1 is lost; its replacement's memory is empty
    results = run_distributed(_restore, 4, url, base, None)
    for rank, (step, source, w, b, meta) in enumerate(results):
        assert (step, source) == (3, "memory")
        assert w == [3.0 + rank] * 4 and b == [3.0] * 3 and meta == {"value": 3.0}


def test_after_an_elastic_shrink_the_survivors_restore_from_memory(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshot_on_two_nodes, 4, url, base)
    shutil.rmtree(_root(base, 1))
    # two ranks on node 0 now hold what four held: resharded from node 0's own files and the
    # replicas of node 1's
    results = run_distributed(_restore, 2, url, base, 0)
    (s0, src0, w0, b0, _), (s1, src1, w1, b1, _) = results
    assert (s0, src0, s1, src1) == (3, "memory", 3, "memory")
    assert w0 + w1 == [3.0] * 4 + [4.0] * 4 + [5.0] * 4 + [6.0] * 4  # what ranks 0-3 held
    assert b0 == b1 == [3.0] * 3


def test_with_both_copies_of_a_file_gone_every_rank_falls_back_together(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    # rank 2's file of step 3 is gone from its node and from the replica on node 0
    for node in (0, 1):
        for f in (Path(base) / f"node{node}").glob("job-*/steps/step_00000003/rank_00002*"):
            f.unlink()
    results = run_distributed(_restore, 4, url, base, None)
    # step 2 in memory (its files are on their nodes, without replicas) serves every rank
    assert [r[:2] for r in results] == [(2, "memory")] * 4
    assert [r[2] for r in results] == [[2.0 + rank] * 4 for rank in range(4)]


def _durable_then_snapshots(rank: int, world: int, url: str, base: str) -> None:
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for step in (2, 3):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    ck.close()


def _a_failed_snapshot_on_one_node(rank: int, world: int, url: str, base: str) -> tuple:
    import os

    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    ck.snapshot(1, _state(rank, world, 1.0)).wait()
    dist.barrier()
    if rank == 2:  # node 1's snapshot directory is swapped for a file: its ranks cannot write
        shutil.rmtree(ck.memory.steps)
        Path(ck.memory.steps).write_text("in the way")
    dist.barrier()
    try:
        ck.snapshot(2, _state(rank, world, 2.0)).wait()
        failed = False
    except Exception:
        failed = True
    dist.barrier()
    if rank == 2:
        os.unlink(ck.memory.steps)
        os.mkdir(ck.memory.steps, 0o700)
    dist.barrier()
    # no rank waits for a replica that will not come: the next snapshot commits, replicated
    ck.snapshot(3, _state(rank, world, 3.0)).wait()
    dist.barrier()
    held = sorted(p.name for p in (Path(ck.memory.steps) / "step_00000003").iterdir())
    ck.close()
    return failed, held


def test_a_snapshot_that_fails_on_one_node_is_not_replicated_and_the_next_one_is(
    tmp_path, transport
):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_a_failed_snapshot_on_one_node, 4, url, base, timeout_s=120)
    assert [failed for failed, _ in results] == [True] * 4  # every rank: one commit, one outcome
    every = {f"rank_{r:05d}.safetensors" for r in range(4)} | {"MANIFEST.json"}
    assert set(results[0][1]) == every and set(results[2][1]) == every


def _save_across_nodes(
    rank: int, world: int, url: str, base: str, damage: bool, lease_timeout_s: float = 60.0
) -> tuple:
    ck = Checkpointer(
        url, memory_every=1, memory_root=_root(base, rank // 2), lease_timeout_s=lease_timeout_s
    )
    for step in (1, 2):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    if damage and rank == 2:  # node 1's snapshot of step 2 rots before its persister reads it
        path = Path(ck.memory.steps) / "step_00000002" / "rank_00002.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    import torch.distributed as dist

    dist.barrier()
    try:
        stats = ck.save(2, _state(rank, world, 2.0)).wait()
        outcome = "committed" if stats.committed else "not committed"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    pid = ck.persister_pid
    # what the node's persister still holds pinned for this save (nothing, once it is over)
    outbox = sorted(os.listdir(ck._persister.outbox)) if ck._persister is not None else []
    ck.close()
    return outcome, pid, outbox


def test_every_nodes_persister_writes_its_nodes_files_and_rank_0s_commits(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_save_across_nodes, 4, url, base, False)
    assert [r[0] for r in results] == ["committed"] * 4
    pids = [r[1] for r in results]
    # one persister per node, its leader's (ranks 0 and 2); the others ask none
    assert pids[0] and pids[2] and pids[0] != pids[2] and pids[1] is None and pids[3] is None
    logs = [next(Path(_root(base, n)).glob("job-*/persister.log")).read_text() for n in (0, 1)]
    assert "wrote 2 file(s) of step 2" in logs[0] and "persisted step 2" in logs[0]
    assert "wrote 2 file(s) of step 2" in logs[1] and "persisted step" not in logs[1]
    # a durable checkpoint like any other: every rank's share, bit-exact, read without the tier
    ck = Checkpointer(url)
    assert ck.steps() == [2] and ck.verify(2).ok
    want = torch.cat([torch.full((4,), 2.0 + r) for r in range(4)])
    got = {"w": torch.zeros(16), "b": torch.zeros(3), "meta": {"value": 0.0}}
    ck.load(got)
    assert torch.equal(got["w"], want) and got["meta"] == {"value": 2.0}


def test_a_node_whose_snapshot_is_damaged_fails_the_save_on_every_rank(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    results = run_distributed(_save_across_nodes, 4, url, base, True)
    for rank, (outcome, _pid, _outbox) in enumerate(results):
        assert outcome.startswith("CommitError") and "does not match its checksums" in outcome
        assert rank == 2 or "rank 2 failed to write" in outcome
    # at close, rank 0's node's persister flushed the step durable storage lacked: node 0 holds
    # it whole (its ranks' files and the intact replicas of node 1's), so step 2 is durable after
    # all, from good bytes
    log = next(Path(_root(base, 0)).glob("job-*/persister.log")).read_text()
    assert "flushed step 2" in log
    ck = Checkpointer(url)
    assert ck.steps() == [2] and ck.verify(2).ok
    got = {"w": torch.zeros(16), "b": torch.zeros(3), "meta": {"value": 0.0}}
    ck.load(got)
    assert torch.equal(got["w"], torch.cat([torch.full((4,), 2.0 + r) for r in range(4)]))


def test_when_rank_0_cannot_begin_every_rank_fails_and_no_node_keeps_the_step_pinned(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    # another job holds the URL's lease, and its heartbeats say it is alive
    with Checkpointer(url, job_id="another-job", lease_timeout_s=10) as other:
        other.save(1, {"w": torch.zeros(1)}).wait()
        results = run_distributed(_save_across_nodes, 4, url, base, False, 10.0)
    for outcome, _pid, outbox in results:
        assert outcome.startswith("LeaseError") and "another-job" in outcome
        assert outbox == []  # node 1's leader let go of its pinned files too


def _a_replica_that_does_not_arrive(rank: int, world: int, url: str, base: str) -> list[str]:
    import torch.distributed as dist

    from resilient.checkpoint import replicas

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    for step in (1, 2):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    if rank == 0:  # rank 0 cannot keep rank 2's file of step 3 (as when its peer dies)
        done = replicas._Incoming.__exit__

        def fail(self, *exc):
            done(self, *exc)
            (Path(ck.memory.steps) / "step_00000003" / "rank_00002.safetensors").unlink()
            raise OSError("the replica could not be kept (the test)")

        replicas._Incoming.__exit__ = fail
    ck.snapshot(3, _state(rank, world, 3.0)).wait()  # committed; its replication fails on rank 0
    dist.barrier()
    held = sorted(p.name for p in (Path(ck.memory.steps) / "step_00000002").iterdir())
    ck.close()
    return held


def test_older_replicas_stay_until_every_rank_holds_the_new_ones(tmp_path, transport):
    """Node 0's rank 1 got rank 3's file of step 3, rank 0 did not keep rank 2's: step 2 keeps
    both replicas (dropping rank 3's would leave no step of node 1's files whole on node 0), and
    after node 1 is lost the survivors restore step 2 from memory."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    held = run_distributed(_a_replica_that_does_not_arrive, 4, url, base)
    assert {"rank_00002.safetensors", "rank_00003.safetensors"} <= set(held[0])
    shutil.rmtree(_root(base, 1))
    (s0, src0, w0, _, _), (s1, src1, w1, _, _) = run_distributed(_restore, 2, url, base, 0)
    assert (s0, src0, s1, src1) == (2, "memory", 2, "memory")
    assert w0 + w1 == [2.0] * 4 + [3.0] * 4 + [4.0] * 4 + [5.0] * 4


def _no_room_for_replicas_of(source: int) -> None:
    """(in a rank's process) This node has no room for a replica of ``source``'s file: creating
    its temporary fails, and so does moving the spare's pages to it (ENOSPC)."""
    import errno

    real_open, real_replace = os.open, os.replace

    def refused(path):
        if f"rank_{source:05d}" in str(path) and ".tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device (the test)", str(path))

    def full_open(path, flags, mode=0o777, *, dir_fd=None):
        refused(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def full_replace(src, dst, **kw):
        refused(dst)
        return real_replace(src, dst, **kw)

    os.open, os.replace = full_open, full_replace


def _a_receive_that_cannot_be_set_up(rank: int, world: int, url: str, base: str) -> dict:

    import torch.distributed as dist

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    for step in (1, 2):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    if rank == 0:  # rank 0's node has no room left for rank 2's file of step 3 (not even in
        # the spare, the previous replica's pages, which cannot be moved into place)
        _no_room_for_replicas_of(2)
    ck.snapshot(3, _state(rank, world, 3.0)).wait()
    dist.barrier()
    steps = Path(ck.memory.steps)
    out = {
        "step_2": sorted(p.name for p in (steps / "step_00000002").iterdir()),
        "step_3": sorted(p.name for p in (steps / "step_00000003").iterdir()),
        "linked": _linked(ck),
    }
    ck.close()
    return out


def _linked(ck: Checkpointer) -> list[int | None]:
    """Transfers made on each of this rank's connections (None: not made, or not used)."""
    links = ck._memory._replicas.links
    return [x.seq if x is not None and x.up else None for x in (links.out, links.into)]


def test_a_rank_that_cannot_receive_its_replica_still_sends_its_own(tmp_path, transport):
    """Rank 0 cannot set up the receive of rank 2's file (no room in its node's memory).  Through
    gloo it tells rank 2, which does not send it; over the links rank 2 sends it and rank 0
    drops the bytes, the connection staying in step.  Either way rank 0 still sends its own file
    to rank 2 (leaving instead would leave rank 2 waiting for it until the group's timeout), and
    step 2's replicas stay on node 0."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    held = run_distributed(_a_receive_that_cannot_be_set_up, 4, url, base, timeout_s=120)
    for r in held:  # over the links, a drained transfer leaves them up
        assert r["linked"] == ([3, 3] if transport == "links" else [None, None])
    assert "rank_00002.safetensors" not in held[0]["step_3"]
    assert {"rank_00002.safetensors", "rank_00003.safetensors"} <= set(held[0]["step_2"])
    assert "rank_00000.safetensors" in held[2]["step_3"]  # rank 0's own file reached node 1
    assert "rank_00001.safetensors" in held[3]["step_3"]


def _restore_with_an_unreadable_replica(rank: int, world: int, url: str, base: str) -> tuple:
    import errno

    if rank < 2:  # node 0 holds node 1's files of step 3 but cannot read them when sending
        real_open = os.open

        def unreadable(path, flags, mode=0o777, *, dir_fd=None):
            name = str(path)
            if flags == os.O_RDONLY | os.O_NOFOLLOW and "step_00000003/rank_0000" in name:
                if name.endswith(("rank_00002.safetensors", "rank_00003.safetensors")):
                    raise OSError(errno.EIO, "Input/output error (the test)", name)
            return real_open(path, flags, mode, dir_fd=dir_fd)

        os.open = unreadable
    return _restore(rank, world, url, base, None)


def test_a_sender_that_cannot_read_a_file_another_node_waits_for_says_so(tmp_path):
    """The replaced node 1 needs its files of step 3 from node 0, which cannot read them at the
    moment it sends: it says so instead of leaving node 1's ranks waiting until the group's
    timeout, every rank falls back together, and nothing is put in place on node 1, so that a
    restore with the files readable again restores step 3 from memory."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    shutil.rmtree(_root(base, 1))
    results = run_distributed(_restore_with_an_unreadable_replica, 4, url, base, timeout_s=120)
    assert len({r[:2] for r in results}) == 1  # one step, from one source, on every rank
    step, source = results[0][:2]
    assert (step, source) != (3, "memory")
    for rank, (_, _, w, _, _) in enumerate(results):
        assert w == [float(step) + rank] * 4
    assert not list(Path(_root(base, 1)).glob("job-*/steps/step_00000003/rank_0000[23]*"))
    results = run_distributed(_restore, 4, url, base, None)
    assert [r[:2] for r in results] == [(3, "memory")] * 4
    assert [r[2] for r in results] == [[3.0 + rank] * 4 for rank in range(4)]


def _restore_where_a_step_directory_cannot_be_made(rank, world, url, base) -> tuple:
    import errno

    from resilient.checkpoint.storage import Storage

    if rank == 2:  # the replaced node has no inode left for the step's directory
        real = Storage.makedirs

        def full(self, rel):
            if rel.startswith("step_00000003"):
                raise OSError(errno.ENOSPC, "No space left on device (the test)", rel)
            return real(self, rel)

        Storage.makedirs = full
    return _restore(rank, world, url, base, None)


def test_a_receiver_that_cannot_make_the_steps_directory_leaves_nobody_waiting(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_durable_then_snapshots, 4, url, base)
    shutil.rmtree(_root(base, 1))
    results = run_distributed(
        _restore_where_a_step_directory_cannot_be_made, 4, url, base, timeout_s=120
    )
    assert len({r[:2] for r in results}) == 1
    step = results[0][0]
    assert results[0][:2] != (3, "memory")
    assert [r[2] for r in results] == [[float(step) + rank] * 4 for rank in range(4)]


def _three_nodes_one_cannot_receive(rank: int, world: int, url: str, base: str) -> dict:

    import torch.distributed as dist

    def _state(rank: int, world: int, value: float) -> dict:  # 4 values per rank
        w = torch.full((4,), value + rank, dtype=torch.float32)
        return {"w": sharded(w, {"dp": Shard(0)}, global_shape=(4 * world,))}

    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank), persister=False)
    assert ck.nodes.nodes == 3 and ck.nodes.peer(rank) == (rank + 1) % 3
    ck.snapshot(1, _state(rank, world, 1.0)).wait()
    if rank == 0:  # rank 0 cannot take its source's (rank 2's) file of step 2
        _no_room_for_replicas_of(2)
    ck.snapshot(2, _state(rank, world, 2.0)).wait()
    dist.barrier()
    out = sorted(p.name for p in (Path(ck.memory.steps) / "step_00000002").iterdir())
    ck.close()
    return {"step_2": out}


def test_on_three_nodes_a_rank_that_cannot_receive_leaves_nobody_waiting(tmp_path, transport):
    """Peer and source differ on three nodes (rank 0 sends to rank 1 and receives from rank 2):
    rank 0's "cannot take it" reaches rank 2, the one that would send to it, and every other
    transfer is made."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    held = run_distributed(_three_nodes_one_cannot_receive, 3, url, base, timeout_s=120)
    assert "rank_00002.safetensors" not in held[0]["step_2"]
    assert "rank_00000.safetensors" in held[1]["step_2"]  # rank 0's own file reached rank 1
    assert "rank_00001.safetensors" in held[2]["step_2"]


def _restore_with_rank_0_on_the_new_node(
    rank: int, world: int, url: str, base: str, first: int, unlisted: bool = False
) -> dict:
    """Node 0 was lost; its replacement (an empty memory root) holds ranks 0 and 1 now (torchrun's
    rendezvous may hand rank 0 to the new agent), the survivor ranks 2 and 3 (root 1).
    ``unlisted``: the survivor's memory cannot be listed while the checkpointer is made (a
    transient error, on both of its ranks); it lists again by the load."""
    import torch.distributed as dist

    from resilient.checkpoint import checkpointer as mod

    real = mod.Checkpointer.catalog
    failing = {"on": unlisted and rank >= 2}

    def catalog(self):
        if failing["on"] and self._namespace == "mem":
            raise OSError("memory cannot be listed (test, transient)")
        return real(self)

    mod.Checkpointer.catalog = catalog
    root = _root(base, 2) if rank < 2 else _root(base, 1)
    ck = Checkpointer(url, memory_every=1, memory_root=root, persister=False)
    failing["on"] = False
    state = _state(rank, world, 0.0)
    got = ck.load(state)
    out = {
        "step": got,
        "source": ck.last_load.source,
        "peer_files": ck.last_load.peer_files,
        "newest_memory": ck.last_load.newest_memory,
        "w": state["w"].tolist(),
    }
    for step in (first, first + 1):  # the snapshots after it are kept on every node
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    dist.barrier()
    out["memory_steps"] = ck.memory_steps()
    ck.close()
    return out


def test_rank_0_on_a_replaced_node_restores_from_the_other_nodes_memory(tmp_path):
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshot_on_two_nodes, 4, url, base)
    shutil.rmtree(_root(base, 0))  # node 0 (rank 0's) is lost
    results = run_distributed(_restore_with_rank_0_on_the_new_node, 4, url, base, 4)
    for rank, r in enumerate(results):
        # step 3 from memory: node 1's own files, and the replicas of node 0's it held
        assert (r["step"], r["source"]) == (3, "memory"), r
        assert r["peer_files"] >= 2 and r["w"] == [3.0 + rank] * 4
        assert r["memory_steps"] == [5, 4], (rank, r)
    # what the restore event reports as the newest snapshot there was: node 1's
    assert results[0]["newest_memory"] == 3


def _snapshots_then_a_durable_save(rank: int, world: int, url: str, base: str) -> None:
    ck = Checkpointer(url, memory_every=1, memory_root=_root(base, rank // 2), persister=False)
    for step in (1, 2, 3):
        ck.snapshot(step, _state(rank, world, float(step))).wait()
    ck.save(4, _state(rank, world, 4.0)).wait()
    ck.close()


def test_rank_0_on_a_replaced_node_commits_above_the_other_nodes_older_snapshots(tmp_path):
    """Rank 0's node is new (its memory empty) and the job restores from durable storage, newer
    than what the survivor's memory holds: rank 0's next snapshots must rank above the
    survivor's older ones there (commit order), or its retention retires each new one at once."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_snapshots_then_a_durable_save, 4, url, base)
    shutil.rmtree(_root(base, 0))
    results = run_distributed(_restore_with_rank_0_on_the_new_node, 4, url, base, 5)
    for rank, r in enumerate(results):
        assert (r["step"], r["source"]) == (4, "durable"), r
        assert r["w"] == [4.0 + rank] * 4
        assert r["memory_steps"] == [6, 5], (rank, r)


def _run_on_two_nodes(rank: int, world: int, url: str, base: str, phase: int) -> tuple:
    """A Run, ranks 0-1 on one node and 2-3 on another; phase 1 crashes in step 4 (its
    memory stays for the next run: no persister flushes it), phase 2 runs on a replacement of
    node 0 (ranks 0 and 1 on an empty root) beside the survivor (root 1)."""
    from resilient import Run

    os.environ["RESILIENT_PERSISTER"] = "0"
    root = _root(base, rank // 2) if phase == 1 else _root(base, 2 if rank < 2 else 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with Run(url, memory_every=1, memory_root=root, detect=False) as run:
        got = run.track(model=model)
        if phase == 2:
            events = [json.loads(x) for x in Path(run.events.path).read_text().splitlines()]
            restore = [e for e in events if e["event"] == "restore"]
            newest = restore[-1]["newest_memory"] if rank == 0 else None
            return got, run.checkpointer.last_load.source, newest
        try:
            for step in run.steps(10):
                with torch.no_grad():
                    model.weight.add_(float(step))
                if step == 4:
                    run._join_snapshot()  # (step 3's replica in)
                    raise RuntimeError("crash")
        except RuntimeError:
            pass
    return None


def test_a_run_with_rank_0_on_an_empty_node_restores_the_other_nodes_snapshot(tmp_path):
    """No durable commit yet, and rank 0's node's memory empty: every rank still loads (the
    other node holds the snapshots), none skips the load alone and leaves the others waiting."""
    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_run_on_two_nodes, 4, url, base, 1)
    shutil.rmtree(_root(base, 0))
    results = run_distributed(_run_on_two_nodes, 4, url, base, 2, timeout_s=120)
    # rank 0's restore event names node 1's newest snapshot (the chaos harness's proof that no
    # newer committed step was passed over)
    assert results == [(3, "memory", 3)] + [(3, "memory", None)] * 3
