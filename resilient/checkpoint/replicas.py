"""The memory tier across nodes: which ranks share a node, peer replicas, and the restore exchange.

A job whose ranks are on several nodes (memory roots) keeps each snapshot where it was written:
every rank's file in its own node's memory, and the manifest on every node (rank 0 commits it,
each node's leader publishes the same bytes in its own directory).  So that losing a node loses
nothing, every rank then sends its file of the newest snapshot to its **peer**, the rank with the
same local index on the next node (a ring of nodes), which keeps it beside its own files: each
node holds its ranks' two newest snapshots and one replica of the previous node's newest.  A
replica is received straight into the pages of a file of its final size; the file of the replica
it replaces is kept, mapped, as the next one's (allocating a tmpfs file's pages costs more than
receiving the bytes), so a rank holds one replica and one spare.

A restore from memory may need files that are not on the restoring rank's node: the layout changed
(an elastic shrink), a node was replaced (its memory is empty), or a replicated chunk was written
by a rank on another node.  Before reading, every rank says which of the step's files it needs and
which its node holds; each missing file is sent by a rank whose node holds it to one rank of each
node that needs it, which writes it into its node's directory; then every rank reads locally, with
the usual checks.  When some needed file is on no node, the step cannot be restored from memory
and every rank falls back together (to an older snapshot, then to durable storage).

Transport: a gloo process group of its own (created with the checkpointer, on every rank), used by
the snapshot's background thread (replication) and by ``load`` (the exchange) — never both at
once: a load first joins the snapshot in flight.  Sizes and names travel as int64 and uint8
tensors; nothing is pickled.

A replication itself goes, where it can, over a TCP connection of its own from each rank to its
peer (resilient/checkpoint/links.py): the file's size and bytes on the connection, and one
reduction on the group, which says whether every rank now holds its source's file and every
connection is still up.  Each gloo operation costs the sending and the waiting rank CPU on its
transport's thread (about half a millisecond for eight bytes on a busy machine: its event loop
keeps waking while one waits), and before this a replication made five of them.  Where a
connection could not be made, or once one broke, every rank replicates through gloo instead (five
operations: agreement, sizes, readiness, the bytes on the lanes, the outcome).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import secrets
import socket
import stat
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from resilient.checkpoint.format import rank_file_name
from resilient.checkpoint.links import Links, Sender
from resilient.checkpoint.seal import _MAX_RECORD
from resilient.checkpoint.seal_nodes import (
    PEER_FORMAT,
    is_peer_name,
    peer_file_name,
    peer_record_name,
)
from resilient.checkpoint.storage import Storage
from resilient.errors import CheckpointNotFoundError, ResilientError

__all__ = ["NodeMap", "Replicas", "node_map"]

log = logging.getLogger(__name__)

# what happens once a replication saw a connection fail (on every rank alike)
_GLOO_AFTER = "from now on the replicas travel through gloo"
_SEALED_AFTER = "from now on every snapshot is committed and its replica travels through gloo"
# the most a sealed snapshot's staged record may take on its way to the peer (its peer pair's
# record wraps it, and is read back with seal.py's cap)
MAX_PEER_RECORD = _MAX_RECORD - 4096


@dataclass(frozen=True)
class NodeMap:
    """Which node (memory root) each rank is on; nodes numbered by their lowest rank."""

    node_of: tuple[int, ...]

    @property
    def nodes(self) -> int:
        return max(self.node_of) + 1 if self.node_of else 1

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        return self.ranks_of(node)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of[rank]) == rank

    @property
    def uniform(self) -> bool:
        return len({len(self.ranks_of(n)) for n in range(self.nodes)}) == 1

    def peer(self, rank: int) -> int | None:
        """Where ``rank`` sends its replica: the same local index on the next node."""
        if self.nodes < 2 or not self.uniform:
            return None
        node = self.node_of[rank]
        return self.ranks_of((node + 1) % self.nodes)[self.ranks_of(node).index(rank)]

    def source(self, rank: int) -> int | None:
        """Whose replica ``rank`` keeps: the same local index on the previous node."""
        if self.nodes < 2 or not self.uniform:
            return None
        node = self.node_of[rank]
        return self.ranks_of((node - 1) % self.nodes)[self.ranks_of(node).index(rank)]


def node_map(world_size: int, rank: int, root: str, boot_id: str) -> NodeMap:
    """Every rank's node, by host, boot and memory root (a collective: every rank calls it)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return NodeMap((0,) * world_size)
    where = f"{socket.gethostname()}/{boot_id}/{os.path.realpath(root)}"
    h = int.from_bytes(hashlib.sha256(where.encode()).digest()[:7], "little")
    mine = torch.tensor([h], dtype=torch.int64, device=_device())
    every = [torch.zeros(1, dtype=torch.int64, device=_device()) for _ in range(world_size)]
    dist.all_gather(every, mine)
    ids: dict[int, int] = {}
    out = []
    for t in every:
        out.append(ids.setdefault(int(t.item()), len(ids)))
    return NodeMap(tuple(out))


class Replicas:
    """Peer replicas and the restore exchange of one memory-tier checkpointer (module docstring)."""

    def __init__(
        self, nodes: NodeMap, rank: int, timeout_s: float, spare_dir: str | None = None
    ) -> None:
        self.nodes, self.rank = nodes, rank
        # the replica held now, and the file the next one is received into (both mapped)
        self.spare_path = (
            os.path.join(spare_dir, f"replica_{rank:05d}.safetensors") if spare_dir else None
        )
        self.staging = spare_dir  # (where peer pairs of sealed snapshots are kept: seal_nodes.py)
        if self.spare_path is not None:  # what a crashed run of this rank left
            try:
                os.unlink(self.spare_path)
            except OSError:
                pass
        self._held: _Mapped | None = None
        self._spare: _Mapped | None = None
        self.reused = 0  # replicas received into the spare (for tests and benchmarks)
        self._timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self.lanes: list[dist.ProcessGroup] = []
        self.links: Links | None = None  # the replicas' own connections (links.py)
        self.epoch = 0  # one more at every regroup: a save begun before it uses none of them
        self.regroup()

    def regroup(self) -> None:
        """Form this checkpointer's groups in the current default group (a collective: every
        rank, in the same order as the other checkpointers' constructors or regroups).  In-job
        recovery calls it in the new generation: the replica held and the spare stay."""
        timeout = timedelta(seconds=self._timeout_s)
        self.epoch += 1
        # a group of its own: collectives of the training group are never issued from here
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        # Replicas travel on two more groups, by the parity of the sending node: a pair of ranks
        # then carries one direction per group (two nodes send to each other at once, and one
        # connection carrying both directions moved them one after the other: half the speed)
        self.lanes = [dist.new_group(backend="gloo", timeout=timeout) for _ in range(2)]
        self._close_links()
        peer, source = self.nodes.peer(self.rank), self.nodes.source(self.rank)
        if peer is not None and source is not None:
            self.links = Links(self.group, self.rank, peer, source, self._timeout_s)

    def drop_groups(self) -> None:
        """(in-job recovery) Let go of the broken generation's groups, so that they can be freed
        (gloo closes a group's connections only then); a replication or exchange still running
        fails, and none starts until ``regroup``."""
        self.group, self.lanes = None, []
        self._close_links()  # (a transfer in flight on them fails at once)

    def _close_links(self) -> None:
        links, self.links = self.links, None
        if links is not None:
            links.close()

    def _groups(
        self, epoch: int | None = None
    ) -> tuple[dist.ProcessGroup, list[dist.ProcessGroup]]:
        """The live groups; ``epoch``: the one a background save began in (a save the abort
        abandoned must not meet the next generation's saves on its groups)."""
        group, lanes = self.group, self.lanes
        if group is None or not lanes or (epoch is not None and epoch != self.epoch):
            raise ResilientError(
                f"rank {self.rank}: the peer replicas' process group is gone (in-job recovery "
                f"left the broken one); nothing is sent until the new generation forms"
            )
        return group, lanes

    # --- replication (the snapshot's background thread, every rank, after every commit) -----------
    def replicate(
        self,
        storage: Storage,
        step_rel: str,
        own: str | None,
        generation: int,
        epoch: int | None = None,
    ) -> None:
        """Send this rank's file of the just-committed step to its peer; keep its source's file
        (and drop the replicas of older steps: one replica per rank is held).  Every rank calls
        this after every snapshot, ``own`` None where the snapshot failed (or its file cannot be
        read), so that no rank waits for a peer that will not send.  Over the links, such a rank
        sends word that there is nothing and the other files still move (each is a committed
        step's: ``own`` is set only after the commit); through gloo, the ranks agree first and
        replicate only when every rank has its file.  Either way the older replicas go only once
        every rank holds its source's file of this step."""
        peer, source = self.nodes.peer(self.rank), self.nodes.source(self.rank)
        if peer is None or source is None:
            return
        links = self.links  # (before the group: drop_groups() lets go of the group first)
        group, lanes = self._groups(epoch)
        if links is not None and links.usable and not links.failed:
            self._replicate_linked(storage, step_rel, own, generation, group, links, source)
            return
        data = _own_file(storage, step_rel, own)
        agreed = torch.tensor([0 if data is None else 1], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if data is None or not int(agreed.item()):
            return
        size = torch.tensor([data.numel()], dtype=torch.int64)
        theirs = torch.zeros(1, dtype=torch.int64)
        reqs = [
            dist.isend(size, peer, group=group),
            dist.irecv(theirs, source, group=group),
        ]
        for r in reqs:
            r.wait()
        name = rank_file_name(source, generation)
        size = int(theirs.item())
        spare = self._take_spare(size)
        received = 0
        try:
            with _Incoming(storage, f"{step_rel}/{name}", size, spare=spare, keep=True) as incoming:
                # Each rank tells its source whether it can take the file (no room, no inode or
                # descriptor left): a sender sends only to a rank that will receive, so that no
                # rank waits for a transfer the other side will not make.
                ready = torch.tensor([int(incoming.failed is None)], dtype=torch.int64)
                peer_ready = torch.zeros(1, dtype=torch.int64)
                reqs = [
                    dist.isend(ready, source, group=group),
                    dist.irecv(peer_ready, peer, group=group),
                ]
                for r in reqs:
                    r.wait()
                out_lane = lanes[self.nodes.node_of[self.rank] % 2]
                in_lane = lanes[self.nodes.node_of[source] % 2]
                reqs = [
                    dist.isend(data, peer, group=out_lane)
                    if data.numel() and int(peer_ready.item())
                    else None,
                    dist.irecv(incoming.tensor, source, group=in_lane)
                    if incoming.size and incoming.failed is None
                    else None,
                ]
                for r in reqs:
                    if r is not None:
                        r.wait()
            received = int(incoming.failed is None)  # (not kept: the older replicas stay)
        finally:
            # The older replicas go only once every rank holds its source's file of this step:
            # a node lost in the middle of the exchange (some of this node's ranks got theirs,
            # some not) must leave the previous step whole, or no step of the lost node's files
            # would be complete anywhere.  A rank whose transfer failed still takes part, so
            # that no rank waits here for it; with a peer gone the reduction fails everywhere.
            everyone = torch.tensor([received], dtype=torch.int64)
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
        self.reused += incoming.from_spare
        older, self._held = self._held, incoming.kept
        if int(everyone.item()):
            self._drop_older(storage, step_rel, source, older)
        elif older is not None:  # the previous step's replica stays where it is, unmapped
            older.close()

    def _replicate_linked(
        self,
        storage: Storage,
        step_rel: str,
        own: str | None,
        generation: int,
        group: dist.ProcessGroup,
        links: Links,
        source: int,
    ) -> None:
        """``replicate`` over this rank's connections: the file (or word that there is none) to
        the peer, from a thread of the connection's own, while the source's is received here
        (and dropped when this node cannot keep it: the connection stays in step); then one
        reduction says whether every rank holds its source's file and every connection is up."""
        sender, into = links.sender, links.into
        data = _own_file(storage, step_rel, own)
        received, links_up = 0, 1
        incoming: _Incoming | None = None
        started = False
        try:
            if sender is None or into is None:
                raise ConnectionError("the replicas' connections are closed")
            sender.start(None if data is None else memoryview(data.numpy()))
            started = True
            size = into.receive_header()
            if size is not None:
                spare = self._take_spare(size)
                name = rank_file_name(source, generation)
                with _Incoming(storage, f"{step_rel}/{name}", size, spare=spare, keep=True) as inc:
                    incoming = inc
                    try:
                        if inc.failed is not None:
                            into.drain(size)  # (no room here: its bytes still go by)
                        elif size:
                            into.receive_into(memoryview(inc.tensor.numpy()))
                    except Exception as e:
                        inc.failed = e
                        raise
                received = int(inc.failed is None)
        except Exception as e:
            links_up = 0
            log.warning(
                "rank %d: the replicas' connections failed (%s); from now on the replicas travel "
                "through gloo",
                self.rank,
                e,
            )
        finally:
            every_rank = self._agree_linked(
                group, links, sender, int(started), received, links_up, "its replica", _GLOO_AFTER
            )
        if incoming is None:
            return  # nothing came from the source: the replica held stays as it is
        self.reused += incoming.from_spare
        older, self._held = self._held, incoming.kept
        if every_rank:
            self._drop_older(storage, step_rel, source, older)
        elif older is not None:  # the previous step's replica stays where it is, unmapped
            older.close()

    def _take_spare(self, size: int) -> _Mapped | None:
        """The spare, to receive a replica of ``size`` bytes into (none held: one of another
        size is removed)."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.size != size:
            spare.discard()
            spare = None
        return spare

    def sealed_ready(self) -> bool:
        """Whether sealed snapshots can be replicated now (``replicate_sealed``): over this
        rank's connections, up on every rank (the same on every rank once the replication
        before is joined: ``failed`` is set on every rank by the reduction that saw it)."""
        links = self.links
        return (
            self.staging is not None
            and links is not None
            and links.usable
            and not links.failed
            and self.nodes.peer(self.rank) is not None
        )

    def replicate_sealed(
        self,
        storage: Storage,
        step: int,
        data: memoryview | None,
        record: bytes | None,
        epoch: int | None = None,
    ) -> bool:
        """(the snapshot's background thread, every rank, after every sealed snapshot) Send this
        rank's sealed file of ``step`` and its staged record to the peer (``data``/``record``
        None: this rank's seal failed; the peer is told there is nothing), keep the source's as
        a peer pair in the staging directory (seal_nodes.py), and, once one reduction says every
        rank holds its source's pair of this step and every connection is up, drop the source's
        older pairs and replicas.  Where the connections are not usable (``sealed_ready``
        false on every rank alike) nothing is sent.  Returns whether every rank holds its
        source's pair."""
        source = self.nodes.source(self.rank)
        links = self.links  # (before the group: drop_groups() lets go of the group first)
        group, _ = self._groups(epoch)
        if source is None or links is None or not links.usable or links.failed:
            return False
        assert self.staging is not None
        staging = Storage(self.staging)
        sender, into = links.sender, links.into
        received, links_up, started = 0, 1, 0
        incoming: _Incoming | None = None
        nothing = data is None or record is None
        try:
            if sender is None or into is None:
                raise ConnectionError("the replicas' connections are closed")
            sender.start(None if nothing else memoryview(record))  # type: ignore[arg-type]
            started += 1
            sender.start(None if nothing else data)
            started += 1
            theirs = None
            size = into.receive_header()
            if size is not None and size > MAX_PEER_RECORD:
                into.drain(size)
            elif size is not None:
                buf = bytearray(size)
                into.receive_into(memoryview(buf))
                theirs = bytes(buf)
            size = into.receive_header()
            if size is not None:
                spare = self._take_spare(size)
                name = peer_file_name(source, step)
                with _Incoming(staging, name, size, spare=spare, keep=True) as inc:
                    incoming = inc
                    try:
                        if inc.failed is not None or theirs is None:
                            into.drain(size)  # (no room here, or no record: its bytes go by)
                            if inc.failed is None:
                                inc.failed = ValueError("its staged record did not come")
                        elif size:
                            into.receive_into(memoryview(inc.tensor.numpy()))
                    except Exception as e:
                        inc.failed = e
                        raise
                if inc.failed is None and inc.kept is not None and theirs is not None:
                    received = int(_write_peer_record(self.staging, source, step, inc.kept, theirs))
        except Exception as e:
            links_up = 0
            log.warning(
                "rank %d: the replicas' connections failed (%s); from now on every snapshot is "
                "committed and its replica travels through gloo",
                self.rank,
                e,
            )
        finally:
            every_rank = self._agree_linked(
                group,
                links,
                sender,
                started,
                received,
                links_up,
                "its sealed snapshot",
                _SEALED_AFTER,
            )
        if incoming is None:
            return every_rank
        self.reused += incoming.from_spare
        older, self._held = self._held, incoming.kept
        if every_rank:
            self._drop_older(storage, None, source, older, step)
        elif older is not None:  # the previous step's replica stays where it is, unmapped
            older.close()
        return every_rank

    def _agree_linked(
        self,
        group: dist.ProcessGroup,
        links: Links,
        sender: Sender | None,
        started: int,
        received: int,
        links_up: int,
        what: str,
        after: str,
    ) -> bool:
        """(every rank, whatever happened in its transfers: with a peer gone the reduction
        fails) The outcome of this rank's ``started`` sends, then one reduction: whether every
        rank holds its source's file (returned) and every connection is up (else the links
        fail on every rank, and ``after`` says what happens from now on)."""
        for _ in range(started):
            assert sender is not None
            failed = sender.wait()
            if failed is not None and links_up:
                links_up = 0
                log.warning("rank %d: sending %s failed (%s); %s", self.rank, what, failed, after)
        everyone = torch.tensor([received, links_up], dtype=torch.int64)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
        if not int(everyone[1].item()):
            links.failed = True  # on every rank alike
            links.close()
        return bool(int(everyone[0].item()))

    def _drop_older(
        self,
        storage: Storage,
        keep_rel: str | None,
        source: int,
        older: _Mapped | None,
        keep_pair: int | None = None,
    ) -> None:
        """Remove the replicas of ``source``'s file held for steps other than ``keep_rel`` (None:
        every committed step's), and its peer pairs of sealed snapshots but ``keep_pair``'s
        (record first); the one this rank received last (``older``) becomes the spare when it
        is still there and linked nowhere else."""
        pairs = []
        if self.staging is not None:
            try:
                names = os.listdir(self.staging)
            except OSError:
                names = []
            for name in names:
                found = is_peer_name(name)
                if found is not None and found[0] == source and found[1] != keep_pair:
                    pairs.append(name)
            # records first: no record is left naming a file that is moved or removed
            for name in sorted(pairs, key=lambda n: not n.endswith(".json")):
                if name.endswith(".json"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.staging, name))
        if older is not None:
            if self.spare_path is not None and older.move_to(self.spare_path):
                self._spare = older
            else:
                older.close()
        if self.staging is not None:
            for name in pairs:
                if not name.endswith(".json"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.staging, name))
        # only this rank's source's: the node's other ranks keep (and drop) their own sources'
        theirs = {f"rank_{source:05d}"}
        try:
            steps = storage.listdir("")
        except Exception:  # (no committed step yet)
            steps = []
        for name in steps:
            if name == keep_rel or not name.startswith("step_"):
                continue
            try:
                files = storage.listdir(name)
            except Exception:  # retired meanwhile
                continue
            for f in files:
                if f.split(".", 1)[0] in theirs:
                    try:
                        storage.remove(f"{name}/{f}")
                    except Exception as e:
                        log.warning("could not drop an old replica %s/%s: %s", name, f, e)

    def close(self) -> None:
        """Unmap the replica and the spare, remove the spare's file, close the connections."""
        self._close_links()
        for held in (self._held, self._spare):
            if held is not None:
                held.close()
        self._held = self._spare = None
        if self.spare_path is not None:
            try:
                os.unlink(self.spare_path)
            except OSError:
                pass

    # --- the restore exchange (load, every rank, main thread) ---------------------------------
    def share_manifest(self, data: bytes | None) -> bytes:
        """The manifest bytes of the step being restored, on every rank: rank 0's, or where rank
        0 has none (its node lacks the step: a node that replaced a lost one), those of the
        lowest rank that has them (``data``: this rank's, or None)."""
        group, _ = self._groups()
        world = dist.get_world_size(group)
        size = torch.tensor([len(data) if data is not None else -1], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        src = next((r for r in range(world) if int(sizes[r].item()) >= 0), None)
        if src is None:
            raise CheckpointNotFoundError("no node could read the snapshot's manifest")
        n = int(sizes[src].item())
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == src and n and data is not None
            else torch.empty(n, dtype=torch.uint8)
        )
        if n:
            dist.broadcast(buf, src, group=group)
        return data if self.rank == src and data is not None else bytes(buf.numpy())

    def fetch(
        self,
        storage: Storage,
        step_rel: str,
        files: dict[str, int],
        need: set[str] | None,
        *,
        stale: bool = False,
    ) -> tuple[int, bool]:
        """Make every file this rank ``need``\\ s present in its node's ``step_rel`` (files: name ->
        size, the manifest's, sorted the same on every rank); ``need`` None: this rank failed
        before it knew (it still takes part, so nobody waits for it).  ``stale``: this node's
        files of the step are another version's (its manifest is not the one restored), so it
        holds none of them.  Returns how many files moved between nodes (the same on every
        rank), and whether this node holds no file of another version of the step any more (a
        stale node's files that were not fetched are removed: ``_drop_other_version``).
        Raises CheckpointNotFoundError on every rank when a needed file is on no node, or when a
        rank failed."""
        group, _ = self._groups()
        names = sorted(files)
        have = torch.zeros(len(names) + 1, dtype=torch.uint8)
        want = torch.zeros(len(names) + 1, dtype=torch.uint8)
        for i, name in enumerate(names):
            have[i] = int(not stale and _present(storage, f"{step_rel}/{name}", files[name]))
            want[i] = int(need is not None and name in need)
        want[-1] = int(need is None)
        world = dist.get_world_size(group)
        haves = [torch.zeros_like(have) for _ in range(world)]
        wants = [torch.zeros_like(want) for _ in range(world)]
        dist.all_gather(haves, have, group=group)
        dist.all_gather(wants, want, group=group)
        failed = [r for r in range(world) if int(wants[r][-1])]
        if failed:
            raise CheckpointNotFoundError(
                f"rank {failed[0]} could not plan its part of {step_rel} in memory"
            )
        node_of = self.nodes.node_of
        transfers: list[tuple[int, int, int]] = []  # (file index, sender, receiver)
        for i, name in enumerate(names):
            holders = [r for r in range(world) if int(haves[r][i])]
            nodes_with = {node_of[r] for r in holders}
            receivers: dict[int, int] = {}  # node -> the first rank there that needs the file
            for r in range(world):
                if int(wants[r][i]) and node_of[r] not in nodes_with:
                    receivers.setdefault(node_of[r], r)
            if receivers and not holders:
                raise CheckpointNotFoundError(
                    f"{step_rel}/{name} is needed by rank {min(receivers.values())} but no node "
                    f"holds it (its node and its peer's replica are gone)"
                )
            for receiver in receivers.values():
                transfers.append((i, holders[0], receiver))
        for i, sender, receiver in transfers:  # one global order: no two ranks wait on each other
            rel, size = f"{step_rel}/{names[i]}", files[names[i]]
            # The receiver says whether it can take the file, the sender whether it can read it
            # (each side's failure is its own: no rank is left waiting for bytes that will not
            # come, and nothing but the real file is ever put in place)
            if self.rank == sender:
                ready = torch.zeros(1, dtype=torch.int64)
                dist.recv(ready, receiver, group=group)
                data = _readable(storage, rel, size)
                dist.send(torch.tensor([int(data is not None)]), receiver, group=group)
                if data is not None and int(ready.item()) and size:
                    dist.send(data, receiver, group=group)
            elif self.rank == receiver:
                made: Exception | None = None
                try:
                    storage.makedirs(step_rel)
                except Exception as e:
                    made = e
                with _Incoming(storage, rel, size, failed=made) as incoming:
                    ok = incoming.failed is None
                    dist.send(torch.tensor([int(ok)]), sender, group=group)
                    has = torch.zeros(1, dtype=torch.int64)
                    dist.recv(has, sender, group=group)
                    if not int(has.item()):
                        incoming.failed = OSError(f"rank {sender} could not read {rel}")
                    elif ok and size:
                        dist.recv(incoming.tensor, sender, group=group)
        if transfers:
            dist.barrier(group=group)  # every received file is in place before anyone reads
            log.info(
                "restore of %s from memory: %d file(s) fetched from other nodes",
                step_rel,
                len(transfers),
            )
        cleared = not stale or self._drop_other_version(
            storage,
            step_rel,
            names,
            {names[i] for i, _, r in transfers if node_of[r] == node_of[self.rank]},
        )
        return len(transfers), cleared

    @staticmethod
    def _drop_other_version(
        storage: Storage, step_rel: str, names: list[str], received: set[str]
    ) -> bool:
        """(a node that held another version of the step) Remove its files of the step that were
        not just received: of the other version, and no rank of this node needs them now, but
        once the node publishes the restored manifest they would count as held (by their size)
        at the next restore of the step.  Whether none is left (every rank of the node does
        this; a removal another made first is fine)."""
        clean = True
        for name in names:
            if name in received:
                continue
            rel = f"{step_rel}/{name}"
            try:
                storage.remove(rel)
            except FileNotFoundError:
                pass
            except Exception as e:
                log.warning("cannot remove %s, another version's file: %s", rel, e)
                clean = False
        return clean


class _Mapped:
    """A file of this node's memory, mapped read-write (kept to receive the next replica into)."""

    def __init__(self, path: str, mm: mmap.mmap, ino: int) -> None:
        self.path, self.mm, self.ino, self.size = path, mm, ino, len(mm)

    def move_to(self, path: str) -> bool:
        """Rename it to ``path`` if it is still this file, at its place, and linked nowhere else."""
        try:
            st = os.lstat(self.path)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != self.ino or st.st_nlink != 1:
                return False
            os.replace(self.path, path)
        except OSError:
            return False
        self.path = path
        return True

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):  # a tensor still views it: freed with the tensor
            pass

    def discard(self) -> None:
        """Close it and remove its file (when that is still this file)."""
        self.close()
        try:
            if os.lstat(self.path).st_ino == self.ino:
                os.unlink(self.path)
        except OSError:
            pass


class _Incoming:
    """A file of this node's memory received straight into its pages: a temporary of the final
    size, mapped as the receive buffer (no second copy), renamed into place once complete.  With
    ``spare``, the spare's file and mapping are the temporary (no page is allocated); with
    ``keep``, the mapping is kept (``kept``) once the file is in place."""

    def __init__(
        self,
        storage: Storage,
        rel: str,
        size: int,
        *,
        spare: _Mapped | None = None,
        keep: bool = False,
        failed: Exception | None = None,
    ) -> None:
        self.path = storage.path(rel)
        self.tmp = f"{self.path}.tmp-{secrets.token_hex(4)}"
        self.size = size
        self.spare, self.keep = spare, keep
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.failed: Exception | None = failed
        self.mapped: _Mapped | None = None
        self.kept: _Mapped | None = None
        self.from_spare = False

    def __enter__(self) -> _Incoming:
        """Never raises: a receive that cannot be set up in this node's memory (no room, no
        inode or descriptor left, the directory gone) sets ``failed``, which the caller tells
        its sender before any byte moves (a rank that left here would leave its own transfers
        unmade and its peers waiting for them until the group's timeout)."""
        if self.failed is not None:
            log.warning("cannot receive %s: %s", self.path, self.failed)
        elif self.spare is not None and self.size and self.spare.move_to(self.tmp):
            self.mapped, self.spare, self.from_spare = self.spare, None, True
            self.tensor = torch.frombuffer(self.mapped.mm, dtype=torch.uint8)
            return self
        if self.spare is not None:
            self.spare.discard()
            self.spare = None
        if self.failed is not None:
            return self
        try:
            self._map()
        except Exception as e:
            self.failed = e
            log.warning("no room for %s in this node's memory: %s", self.path, e)
            self.tensor = torch.empty(0, dtype=torch.uint8)
            if self.mapped is not None:
                self.mapped.close()
                self.mapped = None
        return self

    def _map(self) -> None:
        fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if self.size:
                # the pages now: a full tmpfs says so here, not as a fault inside the receive
                os.posix_fallocate(fd, 0, self.size)
                mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
                self.mapped = _Mapped(self.tmp, mm, os.fstat(fd).st_ino)
                self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        finally:
            os.close(fd)

    def __exit__(self, exc_type: object, *_: object) -> None:
        """Never raises either: a file that cannot be put in place is removed and ``failed``
        says why (the restore then finds it missing, and every rank falls back together)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the tensor's view of the mapping goes
        if exc_type is None and self.failed is None:
            try:
                os.rename(self.tmp, self.path)
            except OSError as e:
                self.failed = e
                log.warning("cannot put %s in place: %s", self.path, e)
            else:
                if self.mapped is not None:
                    self.mapped.path = self.path
                    if self.keep:
                        self.kept, self.mapped = self.mapped, None
        if exc_type is not None or self.failed is not None:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
        if self.mapped is not None:
            self.mapped.close()


def _write_peer_record(staging: str, source: int, step: int, kept: _Mapped, record: bytes) -> bool:
    """The record of a peer pair just received (``kept``: its file, in place), written whole (a
    temporary renamed into place) after the file: the source's staged record as it came, and the
    inode of this node's copy.  Whether it is in place."""
    head = json.dumps({"format": PEER_FORMAT, "source": source, "step": step, "ino": kept.ino})
    data = head[:-1].encode() + b', "record": ' + record + b"}"
    # (a name of its own, made here: whatever else is in the directory is never opened)
    tmp = os.path.join(staging, f"peer_{source:05d}.record.tmp-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(staging, peer_record_name(source, step)))
    except OSError as e:
        log.warning("cannot keep the peer replica of rank %d's step %d: %s", source, step, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def _present(storage: Storage, rel: str, size: int) -> bool:
    try:
        return storage.size(rel) == size
    except Exception:
        return False


def _readable(storage: Storage, rel: str, size: int) -> torch.Tensor | None:
    """The file to send, mapped, or None when it cannot be read or is no longer ``size`` bytes."""
    try:
        data = _file_tensor(storage, rel)
    except Exception as e:  # (OSError; ValueError: truncated between the stat and the map)
        log.warning("cannot read %s to send it: %s", rel, e)
        return None
    if data.numel() != size:
        log.warning("%s is %d bytes, not %d: not sent", rel, data.numel(), size)
        return None
    return data


def _own_file(storage: Storage, step_rel: str, own: str | None) -> torch.Tensor | None:
    """This rank's file of the step to replicate, mapped; None when there is none or it cannot
    be read (the peer is told so, and keeps its replica of the previous step)."""
    if own is None:
        return None
    try:
        return _file_tensor(storage, f"{step_rel}/{own}")
    except Exception as e:  # (ValueError: truncated between the stat and the map)
        log.warning("cannot read %s/%s to replicate it: %s", step_rel, own, e)
        return None


def _file_tensor(storage: Storage, rel: str) -> torch.Tensor:
    """A file of this node's memory as a uint8 tensor, mapped (it is on a tmpfs), not copied:
    read-only, populated at once (faulting it in page by page during the send cost as much as
    the transfer).  Only ever sent."""
    path = storage.path(rel)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return torch.empty(0, dtype=torch.uint8)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # "not writable": it is not, and it is never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _device() -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
