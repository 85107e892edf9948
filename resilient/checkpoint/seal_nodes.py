"""Sealed snapshots across nodes: the collective seal at a load (the memory tier; README, "Sealed
snapshots", and docs/FORMAT.md section 9).

With ``memory_commit_every`` other than 1 on several nodes, a snapshot is sealed on every rank
as on one node (its copy, and the staged record that carries its checksums: seal.py), and the
snapshot's background thread sends the file and the record to the rank's peer on the next node
(``Replicas.replicate_sealed``), which keeps them in its staging directory as a *peer pair*; one
reduction says every rank now holds its source's pair of the step, and only then does an older
pair go (a node lost in the middle of an exchange leaves the step before it whole).  Nothing is
committed as it is taken.

Whoever restores commits the newest step that every rank sealed: :func:`seal_across_nodes`, a
collective of the replicas' group, run by every rank at a load once every rank of the job let go
of its sealed snapshots (so that every writer of the group is done with them):

1. Each node's leader lists the copies it holds: its own ranks' staged records whose writers are
   gone, and its peer pairs (each naming its file by inode and size).  The offers are gathered on
   every rank.
2. Every rank picks, alike, the newest steps for which every rank of the snapshot's job is offered
   with one shared description (``seal.SHARED_KEYS`` and the world size).  For the newest of
   them, every leader checks the rules of the one-node seal against its own memory (its commits
   since the line began, its newest run: ``seal.void_reason``), checksums each copy it holds
   against the sums its record carries, and claims a generation of the step; the leaders gather
   which ranks they hold a verified copy of.  A step vetoed, or with a rank no node holds whole,
   gives way to the next.
3. Rank 0 takes every rank's record and report from the lowest leader holding a verified copy,
   builds the manifest as the trainer's commit would (numbered above every node's commits and
   as the run that staged it), and sends its bytes to every rank; each leader links the verified
   files it holds into the step's directory under the manifest's names and commits it in its own
   memory.  The restore that follows then fetches the files a node lacks, as for any committed
   snapshot.

Whatever a node holds is only offered: a record that does not parse, a file replaced, a copy that
fails its checksums, or leaders that disagree leave the step uncommitted, and the load restores
the newest committed snapshot (or durable storage) instead.  Every rank runs the same collectives
in the same order whatever it found; only a broken group raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resilient.checkpoint.catalog import Catalog, scan
from resilient.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    manifest_of_step,
    manifest_to_bytes,
    rank_file_name,
    step_dir_name,
)
from resilient.checkpoint.retention import delete_dirs
from resilient.checkpoint.seal import (
    _LOCK,
    _MAX_RECORD,
    _MAX_WORLD,
    RECORD_FORMAT,
    SHARED_KEYS,
    NodeLocal,
    _lock,
    _move,
    _open_staged,
    _read_record,
    _records,
    _report,
    link_open_file,
    manifest_of_records,
    newest_plausible_seq,
    open_record_file,
    void_reason,
)
from resilient.checkpoint.snapshots import RUN_SHIFT, STAGING_DIR, STEPS_DIR
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.url_group import UrlGroup
from resilient.checkpoint.writer import next_generation, publish_commit

if TYPE_CHECKING:  # (torch only where a group is: the persister runs this without it)
    import torch.distributed as dist

__all__ = [
    "PEER_FORMAT",
    "has_peer_pairs",
    "is_peer_name",
    "peer_file_name",
    "peer_record_name",
    "seal_across_nodes",
]

log = logging.getLogger(__name__)

PEER_FORMAT = "resilient-peer-v1"
_PEER_RE = re.compile(r"^peer_(\d{5,9})\.step_(\d{1,19})\.(json|safetensors)$")
_MAX_OFFER = 8 << 20  # the bytes of one leader's offer
_CANDIDATES = 3  # the newest steps tried, one collective round each
_PAIRS_PER_SOURCE = 2
_STEP = re.compile(r"[0-9]{1,19}")


def peer_record_name(source: int, step: int) -> str:
    return f"peer_{source:05d}.step_{step}.json"


def peer_file_name(source: int, step: int) -> str:
    return f"peer_{source:05d}.step_{step}.safetensors"


def is_peer_name(name: str) -> tuple[int, int] | None:
    """(source rank, step) of a peer pair's record or file name; None for any other name."""
    m = _PEER_RE.match(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


@dataclass
class _Copy:
    """One rank's sealed snapshot of one step, as this node holds it."""

    step: int
    rank: int
    rec: dict[str, Any]
    key: str  # the digest of what every rank's record of the snapshot shares
    world: int
    peer: str | None  # a peer pair's file (None: this node's own rank's staged file)
    ino: int
    fd: int = -1  # open once verified (its inode cannot be reused while it is)
    path: str = ""  # where it was opened
    report: dict[str, Any] | None = None


def seal_across_nodes(
    job_dir: str,
    *,
    rank: int,
    leader: bool,
    group: dist.ProcessGroup | UrlGroup | None,
    floor: int,
    max_run: int | None = None,
    newer_than: int | None = None,
    clear: bool = True,
    lock_s: float = 120.0,
) -> int | None:
    """Commit, in every node's memory, the newest step every rank sealed (module docstring);
    returns it on every rank, or None when none is whole.  Every rank of ``group`` calls this,
    after every rank let go of its sealed snapshots; ``leader``: this rank's node is its to look
    at (one rank per node).  ``group`` None: this process alone, on the one node that holds
    every copy there is (a job on one node now, after an elastic shrink; the persister's flush).
    ``floor``: the newest commit order in any node's memory (the commit is numbered above it);
    ``max_run``: rank 0's run, where it knows it; ``newer_than``: only later steps are worth
    it (the flush: the newest durable step).  ``clear``: the staged records and peer pairs that
    no later seal can use are removed after (a load: the line goes on from what it restores);
    else (the flush, whose next run may still need them) only once a step is sealed."""
    from resilient import __version__ as version

    through_url = isinstance(group, UrlGroup)
    world = 1 if group is None else group.size() if through_url else _dist().get_world_size(group)
    staging = os.path.join(job_dir, STAGING_DIR)
    mem = Storage(os.path.join(job_dir, STEPS_DIR))
    copies: list[_Copy] = []
    catalog: Catalog | None = None
    lock: int | None = None
    if leader and os.path.isdir(staging) and not os.path.islink(staging):
        try:
            # (a persister of the job's previous run may be flushing on this node: seal.py)
            lock = _lock(os.path.join(job_dir, _LOCK), lock_s)
            if lock is None:
                raise TimeoutError(f"its seal lock stayed taken for {lock_s:g} s")
            catalog = scan(mem)
            copies = [
                c for c in _local_copies(staging) if newer_than is None or c.step > newer_than
            ]
            _complete_commits(mem, catalog, copies)
            offer = _offer(copies, catalog)
        except Exception as e:  # (offers nothing; takes part all the same)
            log.warning("rank %d: this node's sealed snapshots cannot be listed: %s", rank, e)
            catalog, copies, offer = None, [], b""
    else:
        offer = b""
    sealed = None
    try:
        offers = _gather_json(group, world, offer)
        for step, key, snap_world, rules in _candidates(offers):
            sealed = _try(
                step,
                key,
                snap_world,
                rules,
                copies=copies if catalog is not None else [],
                catalog=catalog,
                staging=staging,
                mem=mem,
                rank=rank,
                group=group,
                floor=floor,
                max_run=max_run,
                version=version,
            )
            if sealed is not None:
                break
        # (the persisters' seal through the URL commits a node's own ranks' files only: its
        # pairs stay, until the next load, for a node lost before the step is durable)
        if catalog is not None and (clear or (sealed is not None and not through_url)):
            _clear(staging)
    finally:
        for c in copies:
            if c.fd >= 0:
                os.close(c.fd)
        if lock is not None:
            os.close(lock)
    if sealed is not None:
        log.info("sealed memory snapshot of step %d from the nodes' copies", sealed)
    return sealed


def has_peer_pairs(job_dir: str) -> bool:
    """Whether the node's memory at ``job_dir`` holds a peer pair (its job ran on several nodes
    with sealed snapshots): the sealed steps are then committed by ``seal_across_nodes``."""
    try:
        names = os.listdir(os.path.join(job_dir, STAGING_DIR))
    except OSError:
        return False
    return any(is_peer_name(n) is not None for n in names)


def _local_copies(staging: str) -> list[_Copy]:
    """This node's own ranks' staged records (of writers that are gone) and its peer pairs."""
    if os.path.islink(staging) or not os.path.isdir(staging):
        return []
    out: list[_Copy] = []
    records, _dead, _live = _records(staging)
    for step, by_rank in records.items():
        for r, rec in by_rank.items():
            copy = _copy_of(step, r, rec, None)
            if copy is not None:
                out.append(copy)
    # (a source's pairs are at most two steps, the newest: older names are left unread, so a
    # directory of many stale records costs neither time nor memory here)
    newest: dict[int, list[int]] = {}
    for name in os.listdir(staging):
        found = is_peer_name(name)
        if found is not None and name.endswith(".json"):
            newest.setdefault(found[0], []).append(found[1])
    for source in sorted(newest):
        newest[source] = sorted(newest[source], reverse=True)[:_PAIRS_PER_SOURCE]
    for source, step in ((s, t) for s in sorted(newest) for t in newest[s]):
        name = peer_record_name(source, step)
        path = os.path.join(staging, name)
        try:
            wrap = _read_record(path)
        except (OSError, ValueError, RecursionError) as e:
            log.warning("peer replica record %s does not parse (%s); ignored", path, e)
            continue
        rec = wrap.get("record") if isinstance(wrap, dict) else None
        if (
            not isinstance(wrap, dict)
            or wrap.get("format") != PEER_FORMAT
            or not isinstance(rec, dict)
            or rec.get("rank") != source
            or rec.get("step") != step
        ):
            log.warning(
                "peer replica record %s is not one of rank %d's step %d", path, source, step
            )
            continue
        copy = _copy_of(step, source, rec, os.path.join(staging, peer_file_name(source, step)))
        if copy is not None and type(wrap.get("ino")) is int:
            copy.ino = wrap["ino"]
            out.append(copy)
    return out


def _copy_of(step: int, rank: int, rec: dict[str, Any], peer: str | None) -> _Copy | None:
    world, ino = rec.get("world"), rec.get("ino")
    if (
        rec.get("format") != RECORD_FORMAT
        or type(world) is not int
        or not 0 <= rank < world <= _MAX_WORLD
        or type(ino) is not int
        or not isinstance(rec.get("sums"), dict)  # (sealed: its checksums taken as copied)
    ):
        return None
    try:
        shared = json.dumps([world, *(rec.get(k) for k in SHARED_KEYS)], sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return None
    key = hashlib.sha256(shared.encode()).hexdigest()[:32]
    return _Copy(step, rank, rec, key, world, peer, ino)


def _complete_commits(mem: Storage, catalog: Catalog, copies: list[_Copy]) -> None:
    """(a leader) A committed step that lacks the file of a rank this node holds a peer pair of,
    of that very step, gets it from the pair: a sealed snapshot committed for a durable save is
    replicated as a committed one after its commit, and a node lost in between leaves only the
    pairs of its ranks (sent as it was sealed) on the next node.  Each pair is checked against
    its record's sums and against the size and checksums the step's manifest gives that file,
    then linked in under the manifest's name; one that differs in anything is left out."""
    for c in copies:
        info = catalog.get(c.step)
        if c.peer is None or info is None or info.state != "committed":
            continue
        step_rel = step_dir_name(c.step)
        fd = -1
        try:
            data = mem.read_small(f"{step_rel}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
            manifest = manifest_of_step(data, mem.display(step_rel), c.step)
            name = rank_file_name(c.rank, manifest.generation)
            entry = manifest.files.get(name)
            if entry is None or entry.rank != c.rank or mem.exists(f"{step_rel}/{name}"):
                continue
            if entry.size_bytes != c.rec.get("size"):
                raise ValueError(
                    f"it has {c.rec.get('size')} bytes, the manifest says {entry.size_bytes}"
                )
            want = {
                ch.name: (list(ch.byte_range), list(ch.checksums))
                for t in manifest.tensors.values()
                for ch in t.chunks
                if ch.file == name
            }
            fd = _open_peer(c)
            report = _report(c.rec, c.rank, fd)
            got = {
                k: (list(v.get("byte_range") or ()), list(v["checksums"]))
                for k, v in report["chunks"].items()
            }
            if got != want:
                raise ValueError("its chunks are not the ones the manifest gives that file")
            link_open_file(fd, c.peer, c.ino, os.path.join(mem.path(), step_rel, name))
            log.info("memory step %d: rank %d's file completed from its peer pair", c.step, c.rank)
        except Exception as e:
            log.warning(
                "memory step %d: rank %d's peer pair does not complete it: %s", c.step, c.rank, e
            )
        finally:
            if fd >= 0:
                os.close(fd)


def _offer(copies: list[_Copy], catalog: Catalog | None) -> bytes:
    """A leader's offer: (step, rank, key, world) of each copy it holds, and the line's rules of
    each step it holds rank 0's record of (``after``, ``job_run``); b"" for none."""
    if catalog is None or not copies:
        return b""
    rows = [[c.step, c.rank, c.key, c.world] for c in copies]
    rules = {
        f"{c.step}/{c.key}": [c.rec.get("after"), c.rec.get("job_run")]
        for c in copies
        if c.rank == 0
    }
    data = json.dumps({"copies": rows, "rules": rules}).encode()
    if len(data) > _MAX_OFFER:
        log.warning("this node's sealed snapshots are too many to offer (%d bytes)", len(data))
        return b""
    return data


def _candidates(offers: list[Any]) -> list[tuple[int, str, int, list[Any]]]:
    """(step, key, world, rules) of the newest steps every rank is offered for with one key and
    whose rank 0's rules are known, newest first; the same on every rank (from the same offers)."""
    ranks: dict[tuple[int, str, int], set[int]] = {}
    rules: dict[tuple[int, str], list[Any]] = {}
    for offer in offers:
        if not isinstance(offer, dict):
            continue
        copies, named = offer.get("copies"), offer.get("rules")
        # (an offer through the URL is anything someone else's bucket holds: url_group.py)
        for row in copies if isinstance(copies, list) else ():
            if (
                isinstance(row, list)
                and len(row) == 4
                and type(row[0]) is int
                and type(row[1]) is int
                and isinstance(row[2], str)
                and type(row[3]) is int
                and 0 <= row[1] < row[3] <= _MAX_WORLD
                and row[0] >= 0
            ):
                ranks.setdefault((row[0], row[2], row[3]), set()).add(row[1])
        for name, rule in (named if isinstance(named, dict) else {}).items():
            step, _, key = str(name).partition("/")
            if _STEP.fullmatch(step) and isinstance(rule, list) and len(rule) == 2:
                rules.setdefault((int(step), key), rule)
    whole = [
        (step, key, world, rules[(step, key)])
        for (step, key, world), have in ranks.items()
        if len(have) == world and (step, key) in rules
    ]
    whole.sort(key=lambda c: (-c[0], c[1]))
    out: list[tuple[int, str, int, list[Any]]] = []
    for c in whole:  # one key per step: the first
        if not out or out[-1][0] != c[0]:
            out.append(c)
    return out[:_CANDIDATES]


def _try(
    step: int,
    key: str,
    snap_world: int,
    rules: list[Any],
    *,
    copies: list[_Copy],
    catalog: Catalog | None,
    staging: str,
    mem: Storage,
    rank: int,
    group: dist.ProcessGroup | UrlGroup | None,
    floor: int,
    max_run: int | None,
    version: str,
) -> int | None:
    """One candidate (every rank): the leaders' vetoes, verified copies and generations
    gathered, then, where it is whole, built on rank 0 and committed on every leader."""
    step_rel = step_dir_name(step)
    # [1 where this rank's node looked, veto, generation, run, seq, its verified copies (ranks)]
    row = [0] * (5 + snap_world)
    mine: dict[int, _Copy] = {}
    held: list[_Copy] = []
    if catalog is not None:
        row[0] = 1
        committed_run = newest_plausible_seq(catalog) >> RUN_SHIFT
        first = {"after": rules[0], "job_run": rules[1]}
        why, run = void_reason(step, first, catalog, committed_run, max_run)
        if why is not None:
            row[1] = 1
            log.warning("memory snapshot of step %d is not sealed: %s", step, why)
        else:
            row[3] = run
            row[4] = newest_plausible_seq(catalog)
            held = [c for c in copies if c.step == step and c.key == key]
            if held:
                try:
                    mem.makedirs(step_rel)
                    row[2] = next_generation(mem, step_rel)
                    if not 0 <= row[2] < 1 << 62:
                        raise ValueError(f"generation {row[2]} is out of range")
                except Exception as e:
                    log.warning("cannot claim a generation of memory step %d: %s", step, e)
                    row[1] = 1
                    held = []
            # first its own ranks' copies only: each node checks its own, and a peer pair is
            # checked only where its rank's own node could not offer a whole copy
            mine = _verify(step, [c for c in held if c.peer is None], staging, mem)
            for r in mine:
                row[5 + r] = 1
    rows = [row] if group is None else _all_gather_ints(group, row)
    world = len(rows)
    looked = [r for r in range(world) if rows[r][0]]
    if any(rows[r][1] for r in looked):
        return None
    holder: list[int | None] = [
        next((r for r in looked if rows[r][5 + i]), None) for i in range(snap_world)
    ]
    missing = {i for i, h in enumerate(holder) if h is None}
    if missing:  # (a lost node's ranks, or a damaged own copy: the peer pairs of them)
        extra = _verify(
            step, [c for c in held if c.peer is not None and c.rank in missing], staging, mem
        )
        mine.update(extra)
        bits = [int(i in extra) for i in range(snap_world)]
        every = [bits] if group is None else _all_gather_ints(group, bits)
        for i in missing:
            holder[i] = next((r for r in range(world) if every[r][i]), None)
    if any(h is None for h in holder):
        log.warning(
            "memory snapshot of step %d is not sealed: no node holds a whole copy of rank %d's "
            "file",
            step,
            holder.index(None),
        )
        return None
    generation = max(rows[r][2] for r in looked)
    run = max(rows[r][3] for r in looked)
    seq = max([floor, *(rows[r][4] for r in looked)]) + 1
    seq = max(seq, (run << RUN_SHIFT) + 1)
    reports = _to_rank_0(holder, mine, rank, group)
    data = b""
    if rank == 0 and reports is not None:
        try:
            first = next(c for c in reports if c.get("record") is not None)["record"]
            manifest = manifest_of_records(
                step, first, [c["report"] for c in reports], generation, seq, version
            )
            data = manifest_to_bytes(manifest)
            manifest_of_step(data, f"sealed memory step {step}", step)  # (as readers check)
        except Exception as e:
            log.warning("memory snapshot of step %d is not sealed: %s", step, e)
            data = b""
    data = _broadcast_bytes(group, data, rank)
    if not data:
        return None
    if isinstance(group, UrlGroup):
        # Through the URL a node may leave the seal at any round (its wait is over): it commits
        # only once every node that holds copies said the manifest describes them, and that
        # word is one outcome every node reads alike (a node waits for it longer than the root
        # waits for the words: url_group.py), so that no node commits a step another left
        # uncommitted
        ready = 1
        if mine:
            try:
                _describe_all(manifest_of_step(data, f"sealed memory step {step}", step), mine)
            except Exception as e:
                log.warning("memory step %d is not sealed on this node: %s", step, e)
                ready = 0
        words = group.all_gather_ints([ready], patient=True)
        if not all(words[h][0] for h in set(holder) if h is not None):
            return None
    done = 1
    if mine:
        try:
            _commit(step, data, mine, mem)
        except Exception as e:
            log.warning("committing sealed memory step %d on this node failed: %s", step, e)
            done = 0
    # Sealed only where every node that holds copies committed it: else the caller must not
    # count it (the flush keeps the records and pairs then, for the next run's load)
    if group is not None:
        every = _all_gather_ints(group, [done])
        if isinstance(group, UrlGroup):  # (a node not heard from holds nothing: not counted)
            every = [every[h] for h in set(holder) if h is not None]
        done = min(row[0] for row in every)
    return step if done else None


def _verify(step: int, copies: list[_Copy], staging: str, mem: Storage) -> dict[int, _Copy]:
    """rank -> a copy of ``step`` among ``copies`` this node holds whole (its file open,
    checksummed against its record's sums)."""
    out: dict[int, _Copy] = {}
    step_dir = os.path.join(mem.path(), step_dir_name(step))
    for c in copies:
        if c.rank in out:
            continue
        try:
            if c.peer is None:
                c.fd, c.path = _open_staged(c.rec, c.rank, step, staging, step_dir)
            else:
                c.fd, c.path = _open_peer(c), c.peer
            c.report = _report(c.rec, c.rank, c.fd)
        except Exception as e:
            log.warning(
                "%s of rank %d's memory snapshot of step %d is not usable: %s",
                "the peer replica" if c.peer is not None else "this node's copy",
                c.rank,
                step,
                e,
            )
            continue
        out[c.rank] = c
    return out


def _open_peer(c: _Copy) -> int:
    assert c.peer is not None
    size = c.rec.get("size")
    if type(size) is not int or size < 8:
        raise ValueError("its record has no size")
    fd = open_record_file(c.peer, c.ino, size, c.step)
    if fd is None:
        raise ValueError(f"{c.peer} is not the file its record names")
    return fd


def _to_rank_0(
    holder: list[int | None],
    mine: dict[int, _Copy],
    rank: int,
    group: dist.ProcessGroup | UrlGroup | None,
) -> list[dict[str, Any]] | None:
    """(every rank) Each rank's report (and rank 0's record) sent to rank 0 by its holder, in
    rank order; rank 0's list of them, or None where one could not come (elsewhere: None)."""
    if isinstance(group, UrlGroup):
        return _to_root_through_url(holder, mine, rank, group)
    if group is not None:
        import torch

        dist = _dist()
    got: list[dict[str, Any]] = []
    whole = True
    for r, h in enumerate(holder):
        if h == rank:
            c = mine[r]
            item = {"report": c.report, "record": c.rec if r == 0 else None}
            if rank == 0:
                got.append(item)
                continue
            try:
                data = json.dumps(item).encode()
            except (TypeError, ValueError, RecursionError):  # (rank 0 must hear all the same)
                data = b""
            if len(data) > 2 * _MAX_RECORD:
                data = b""
            dist.send(torch.tensor([len(data) or -1], dtype=torch.int64), 0, group=group)
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=group)
        elif rank == 0 and h is not None:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, h, group=group)
            n = int(size.item())
            if n <= 0:
                whole = False
                continue
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, h, group=group)
            try:
                item = json.loads(bytes(buf.numpy()))
            except (ValueError, RecursionError):
                whole = False
                continue
            if not isinstance(item, dict) or not isinstance(item.get("report"), dict):
                whole = False
                continue
            got.append(item)
    if rank != 0 or not whole or len(got) != len(holder):
        return None
    return got


def _to_root_through_url(
    holder: list[int | None], mine: dict[int, _Copy], rank: int, group: UrlGroup
) -> list[dict[str, Any]] | None:
    """_to_rank_0 through the URL: each node posts the items it holds, by rank (every node posts,
    so the rounds stay numbered alike); the root waits only for the holders."""
    items: dict[str, Any] = {}
    for r, h in enumerate(holder):
        if h == rank:
            items[str(r)] = {"report": mine[r].report, "record": mine[r].rec if r == 0 else None}
    try:
        data = json.dumps(items).encode()
    except (TypeError, ValueError, RecursionError):  # (the root hears nothing of this node)
        data = b"{}"
    holders = {h for h in holder if h is not None}
    posts = group.gather_to_root(data, 2 * _MAX_RECORD, holders)
    if posts is None:
        return None
    got: list[dict[str, Any]] = []
    for r, h in enumerate(holder):
        post = posts[h] if h is not None else None
        item = post.get(str(r)) if isinstance(post, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("report"), dict):
            return None
        got.append(item)
    return got


def _broadcast_bytes(group: dist.ProcessGroup | UrlGroup | None, data: bytes, rank: int) -> bytes:
    if group is None:
        return data
    if isinstance(group, UrlGroup):
        return group.broadcast(data, MAX_MANIFEST_BYTES)
    import torch

    dist = _dist()
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    n = int(size.item())
    if n <= 0:
        return b""
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if rank == 0
        else torch.empty(n, dtype=torch.uint8)
    )
    dist.broadcast(buf, 0, group=group)
    return data if rank == 0 else bytes(buf.numpy())


def _gather_json(group: dist.ProcessGroup | UrlGroup | None, world: int, data: bytes) -> list[Any]:
    """Every rank's ``data`` (JSON, or b""), parsed (None for b"" or bytes that do not parse)."""
    if group is None:
        try:
            return [json.loads(data) if data else None]
        except (ValueError, RecursionError):
            return [None]
    if isinstance(group, UrlGroup):
        return group.all_gather_json(data, _MAX_OFFER)
    import torch

    dist = _dist()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    n = max(int(s.item()) for s in sizes)
    if n <= 0:
        return [None] * world
    buf = torch.zeros(n, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.zeros(n, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(every, buf, group=group)
    out: list[Any] = []
    for s, t in zip(sizes, every, strict=True):
        k = int(s.item())
        try:
            out.append(json.loads(bytes(t[:k].numpy())) if k > 0 else None)
        except (ValueError, RecursionError):
            out.append(None)
    return out


def _dist():  # (imported where a group is: see TYPE_CHECKING above)
    import torch.distributed as dist

    return dist


def _all_gather_ints(group: dist.ProcessGroup | UrlGroup, row: list[int]) -> list[list[int]]:
    if isinstance(group, UrlGroup):
        return group.all_gather_ints(row)
    import torch

    dist = _dist()
    mine = torch.tensor(row, dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [[int(x) for x in t.tolist()] for t in every]


def _describe_all(manifest: Manifest, mine: dict[int, _Copy]) -> None:
    """That the manifest rank 0 sent describes every copy this node verified."""
    for r, c in mine.items():
        name = rank_file_name(r, manifest.generation)
        if name in manifest.files and (
            c.report is None or not _describes(manifest, name, c.report)
        ):
            raise ValueError(
                f"the manifest rank 0 sent does not describe rank {r}'s file as this node's "
                f"verified copy is"
            )


def _commit(step: int, data: bytes, mine: dict[int, _Copy], mem: Storage) -> None:
    """(a leader) Link the verified files this node holds into the step's directory under the
    manifest's names, and commit the manifest rank 0 built in this node's memory."""
    step_rel = step_dir_name(step)
    manifest = manifest_of_step(data, mem.display(f"{step_rel}"), step)
    step_dir = os.path.join(mem.path(), step_rel)
    _describe_all(manifest, mine)
    for r, c in mine.items():
        name = rank_file_name(r, manifest.generation)
        if name not in manifest.files:  # (a file the manifest does not name is not put there)
            continue
        dest = os.path.join(step_dir, name)
        if c.peer is None:
            _move(c.fd, c.path, c.ino, dest)
        else:
            link_open_file(c.fd, c.path, c.ino, dest)
    garbage = publish_commit(
        mem,
        NodeLocal(),
        manifest,
        keep_last=2,
        keep_every=None,
        collect=lambda _info: False,
        data=data,
    )
    with contextlib.suppress(Exception):
        delete_dirs(mem, garbage)


def _describes(manifest: Manifest, name: str, report: dict[str, Any]) -> bool:
    """Whether ``manifest`` gives file ``name`` the size and chunks (byte ranges and checksums)
    that this node's verified copy has (``report``): a manifest that came through the URL
    (url_group.py) may be anyone's."""
    theirs = sorted(
        (tuple(c.byte_range), tuple(c.checksums))
        for t in manifest.tensors.values()
        for c in t.chunks
        if c.file == name
    )
    try:
        mine = sorted(
            (tuple(c["byte_range"]), tuple(c["checksums"])) for c in report["chunks"].values()
        )
    except (KeyError, TypeError, AttributeError):
        return False
    return manifest.files[name].size_bytes == report.get("size_bytes") and theirs == mine


def _clear(staging: str) -> None:
    """(a leader, after the seal) What no later seal can use: the staged records of this node's
    ranks whose writers are gone (a step that was not sealed now never will be: the load
    restores an older one and the line goes on from there) and every peer pair, record first."""
    with contextlib.suppress(OSError):
        for _step, path in _records(staging)[1]:
            with contextlib.suppress(OSError):
                os.unlink(path)
        names = sorted(os.listdir(staging), key=lambda n: not n.endswith(".json"))
        for name in names:
            if is_peer_name(name) is not None:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(staging, name))
