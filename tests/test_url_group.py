"""The seal's collectives through the checkpoint URL (url_group.py): members in threads here, over
a local folder, as the nodes' persisters use them over any fsspec URL; and what someone else's
bucket can put in a session's folder."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from resilient.checkpoint.joint_flush import FLUSH_NAME, _parse, seal_together
from resilient.checkpoint.snapshots import STAGING_DIR
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.url_group import SEAL_DIR, GroupBroken, UrlGroup
from resilient.errors import ResilientError

SESSION = "a1b2c3d4e5f60718"

# each a JSON value a post (an offer) can be; _candidates iterates and calls .items() on them
HOSTILE_OFFERS = [
    {"rules": [1, 2]},  # .items() on a list: AttributeError
    {"copies": 5},  # iterating an int: TypeError
    {"rules": {"\u00b2/k": [0, 0]}},  # "²".isdigit() but int("²") fails: ValueError
]
IDS = ["rules-a-list", "copies-an-int", "unicode-digit-step"]


class _Promoter:  # (what seal_together reads of the persister's Promoter)
    def __init__(self, tmp: Path, node: int) -> None:
        self.storage = Storage(str(tmp / "ckpt"))
        self.job_id = "job"
        self.job_dir = str(tmp / f"job{node}")
        os.makedirs(os.path.join(self.job_dir, STAGING_DIR), exist_ok=True)  # (no copies)
        self.config = {"nodes": 2, "node": node, "max_run": 1}


@pytest.mark.parametrize("node", [0, 1], ids=["root", "member"])
@pytest.mark.parametrize("offer", HOSTILE_OFFERS, ids=IDS)
def test_a_hostile_offer_is_no_offer(tmp_path, offer, node, caplog):
    """The root (node 0's persister, in Promoter._flush) reads node 1's round-0 post from the
    URL, and a member (join_flush) the root's outcome: an offer of the wrong shape counts as
    nothing offered, and the seal goes on (it raised AttributeError, TypeError or ValueError out of the whole flush:
    nothing flushed, not even the steps committed in memory; and out of join_flush, whose node
    then served no invitation; found by a review)."""
    promoter = _Promoter(tmp_path, node)
    folder = tmp_path / "ckpt" / SEAL_DIR / SESSION
    folder.mkdir(parents=True)
    if node == 0:
        (folder / "0.1.json").write_text(json.dumps(offer))
    else:
        (folder / "0.all.json").write_text(json.dumps([offer, None]))
    group = UrlGroup(promoter.storage, SESSION, node, 2, wait_s=2.0)
    try:
        got = seal_together(promoter, group, writers_s=0.1)
    except Exception as e:  # noqa: BLE001 (the repro: what escapes)
        pytest.fail(f"seal_together raised {type(e).__name__}: {e}")
    assert got is None
    assert "broke off" not in caplog.text  # (counted as nothing offered, not as a fault)


def test_a_member_whose_memory_is_gone_still_takes_part(tmp_path):
    """A node whose memory is gone (its staging folder with it) has nothing to offer, and takes
    part all the same (it returned before its first post, and the root waited out its whole
    wait_s for it, holding node 0's seal lock)."""
    import threading

    root_p = _Promoter(tmp_path, 0)
    member_p = _Promoter(tmp_path, 1)
    shutil.rmtree(member_p.job_dir)  # node 1's memory is gone
    root = UrlGroup(root_p.storage, SESSION, 0, 2, wait_s=3.0)
    member = UrlGroup(member_p.storage, SESSION, 1, 2, wait_s=3.0)
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("root", seal_together(root_p, root, 0.1)))
    t.start()
    out["member"] = seal_together(member_p, member, 0.1)
    member.close()
    t.join(60)
    assert not t.is_alive()
    assert out == {"root": None, "member": None}
    # the member took part (posted round 0), so the root did not have to wait it out
    assert root._awaited == {1}, "the root waited out wait_s for a member that had returned"


def _members(url: str, n: int, wait_s: float = 20.0) -> list[UrlGroup]:
    return [UrlGroup(Storage(url), SESSION, m, n, wait_s) for m in range(n)]


def _each(groups: list[UrlGroup], fn) -> list[Any]:
    """``fn(group)`` on every member at once; each one's result (or the exception it raised)."""
    out: list[Any] = [None] * len(groups)

    def one(m: int) -> None:
        try:
            out[m] = fn(groups[m])
        except Exception as e:  # (the test looks at it)
            out[m] = e

    threads = [threading.Thread(target=one, args=(m,)) for m in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_collective_gives_each_member_the_same_outcome(tmp_path):
    url = str(tmp_path / "ckpt")
    groups = _members(url, 3)

    def seal_like(g: UrlGroup) -> list[Any]:
        offers = g.all_gather_json(json.dumps({"node": g.rank}).encode(), 1 << 20)
        rows = g.all_gather_ints([1, g.rank, 7])
        posts = g.gather_to_root(json.dumps([g.rank] * 2).encode(), 1 << 20, {1, 2})
        manifest = g.broadcast(b"the manifest" if g.rank == 0 else b"", 1 << 10)
        g.close()
        return [offers, rows, posts, manifest]

    got = _each(groups, seal_like)
    offers = [{"node": 0}, {"node": 1}, {"node": 2}]
    rows = [[1, 0, 7], [1, 1, 7], [1, 2, 7]]
    assert got[0] == [offers, rows, [[0, 0], [1, 1], [2, 2]], b"the manifest"]
    for m in (1, 2):
        assert got[m] == [offers, rows, None, b"the manifest"]
    # the root removed the session's folder once every member said it was done with it
    assert not (tmp_path / "ckpt" / SEAL_DIR / "a1b2c3d4e5f60718").exists()


def test_a_member_not_heard_from_holds_nothing_and_is_not_waited_for_again(tmp_path):
    url = str(tmp_path / "ckpt")
    groups = _members(url, 3, wait_s=0.5)
    live = [groups[0], groups[1]]  # node 2 never comes

    def two_rounds(g: UrlGroup) -> list[Any]:
        return [g.all_gather_ints([1, 1]), g.all_gather_json(b'"late"', 64)]

    got = _each(live, two_rounds)
    assert got[0] == got[1] == [[[1, 1], [1, 1], [0, 0]], ["late", "late", None]]
    assert groups[0]._awaited == {1}
    # ... and the root's close does not wait for it either
    assert _each([groups[0], groups[1]], lambda g: g.close()) == [None, None]


@pytest.mark.parametrize(
    "post",
    [b"x" * 200, b"not json", b"[" * 100, b'{"a": 1}', b"[1, 2, 3]", b"[1, -2]", b"[true, 1]"],
    ids=["over-the-cap", "not-json", "nested", "not-a-list", "too-long", "negative", "bool"],
)
def test_a_hostile_post_counts_as_nothing_posted(tmp_path, post):
    """Someone else's bucket: a member's post in the folder is anything at all."""
    url = str(tmp_path / "ckpt")
    root = _members(url, 2, wait_s=0.3)[0]
    (tmp_path / "ckpt" / SEAL_DIR / "a1b2c3d4e5f60718" / "0.1.json").write_bytes(post)
    assert root.all_gather_ints([5, 6]) == [[5, 6], [0, 0]]
    (tmp_path / "ckpt" / SEAL_DIR / "a1b2c3d4e5f60718" / "1.1.json").write_bytes(post)
    got = root.all_gather_json(b"{}", 64)
    assert got[0] == {} and (got[1] is None or len(post) <= 64 and got[1] == json.loads(post))


@pytest.mark.parametrize(
    "outcome", [b"{}", b"[1]", b"not json", b"[" * 100], ids=["dict", "short", "text", "nested"]
)
def test_a_damaged_outcome_breaks_the_group_with_a_named_error(tmp_path, outcome):
    url = str(tmp_path / "ckpt")
    member = _members(url, 2)[1]
    (tmp_path / "ckpt" / SEAL_DIR / "a1b2c3d4e5f60718" / "0.all.json").write_bytes(outcome)
    with pytest.raises(GroupBroken, match="damaged") as e:
        member.all_gather_ints([1])
    assert isinstance(e.value, ResilientError)


def test_a_member_whose_root_is_gone_gives_up(tmp_path):
    member = _members(str(tmp_path / "ckpt"), 2, wait_s=0.1)[1]
    with pytest.raises(GroupBroken, match="did not come within"):
        member.broadcast(b"", 64)
    hurried = UrlGroup(Storage(str(tmp_path / "ckpt")), "b" * 16, 1, 2, 60.0, lambda: True)
    with pytest.raises(GroupBroken):  # (a successor waits on its node: at once)
        hurried.all_gather_json(b"{}", 64)


def test_a_seal_record_names_its_session_and_anything_else_is_no_record(tmp_path):
    record = {"format": 1, "job_id": "j", "id": "0123456789abcdef", "done": False, "seal": True}
    assert _parse(json.dumps({**record, "seen": []}).encode())["seal"] is True
    for bad in ({**record, "id": "../../etc"}, {**record, "seen": 3}, {**record, "seal": 1}):
        assert _parse(json.dumps(bad).encode()) is None, bad
    assert FLUSH_NAME == "FLUSH.json"


def test_a_node_outside_the_session_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        UrlGroup(Storage("memory://x"), "c" * 16, 3, 3, 1.0)


def test_the_root_of_a_new_session_removes_the_old_ones(tmp_path):
    from resilient.checkpoint.joint_flush import open_seal

    class _Promoter:  # (what open_seal reads of the persister's Promoter)
        storage = Storage(str(tmp_path / "ckpt"))
        job_id = "job"
        job_dir = str(tmp_path / "job")
        config = {"nodes": 3}
        flush_ids: list[str] = []

    stale = tmp_path / "ckpt" / SEAL_DIR / "ffffffffffffffff"
    stale.mkdir(parents=True)
    (stale / "0.1.json").write_text("{}")
    group = open_seal(_Promoter(), 1.0)
    assert group is not None and group.size() == 3 and group.rank == 0
    assert not stale.exists()
    record = _parse((tmp_path / "ckpt" / FLUSH_NAME).read_bytes())
    assert record["seal"] is True and group.dir == f"{SEAL_DIR}/{record['id']}"
    assert Path(tmp_path / "ckpt" / group.dir).is_dir()


def test_a_manifest_is_committed_only_where_it_describes_the_copy_verified_here(tmp_path):
    """A manifest that came through the URL may be anyone's: a node commits it over the copies it
    verified only where it gives each the size, byte ranges and checksums the copy has."""
    import torch

    from resilient import Checkpointer
    from resilient.checkpoint.format import MANIFEST_NAME, manifest_of_step
    from resilient.checkpoint.seal_nodes import _describes

    url = str(tmp_path / "ckpt")
    Checkpointer(url).save(1, {"w": torch.arange(8.0), "b": torch.ones(3)}).wait()
    manifest = manifest_of_step(
        (tmp_path / "ckpt" / "step_00000001" / MANIFEST_NAME).read_bytes(), "step 1", 1
    )
    (name,) = manifest.files
    chunks = [c for t in manifest.tensors.values() for c in t.chunks if c.file == name]
    report = {
        "size_bytes": manifest.files[name].size_bytes,
        "chunks": {
            str(i): {"byte_range": list(c.byte_range), "checksums": list(c.checksums)}
            for i, c in enumerate(reversed(chunks))
        },
    }
    assert _describes(manifest, name, report)
    first = next(iter(report["chunks"].values()))
    for damaged in (
        {**report, "size_bytes": report["size_bytes"] + 1},
        {**report, "chunks": {**report["chunks"], "0": {**first, "checksums": [1]}}},
        {**report, "chunks": dict(list(report["chunks"].items())[1:])},
        {**report, "chunks": {"0": "not a chunk"}},
        {"size_bytes": report["size_bytes"]},
    ):
        assert not _describes(manifest, name, damaged), damaged


def test_a_member_heard_from_again_is_waited_for_again(tmp_path):
    """A member late for one round (taken as holding nothing) whose next post comes in time is
    waited for again: the seal may name it the holder of its ranks' copies."""
    import time

    root, member = _members(str(tmp_path / "ckpt"), 2, wait_s=2.0)
    assert root.all_gather_ints([1]) == [[1], [0]]  # (the member is late)
    assert root._awaited == set()
    seen: list[Any] = []

    def member_rounds() -> None:
        seen.append(member.all_gather_ints([1]))  # (it reads the outcome all the same)
        seen.append(member.all_gather_ints([2]))
        time.sleep(0.5)
        seen.append(member.gather_to_root(b'{"mine": 1}', 64, {1}))

    t = threading.Thread(target=member_rounds)
    t.start()
    try:
        deadline = time.monotonic() + 30  # (its round 1 post is there before the root looks)
        while not (tmp_path / "ckpt" / member.dir / "1.1.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert root.all_gather_ints([2]) == [[2], [2]]
        assert root.gather_to_root(b"{}", 64, {1}) == [{}, {"mine": 1}]
    finally:
        t.join(30)
    assert seen == [[[1], [0]], [[2], [2]], None]


def test_a_patient_member_waits_for_the_roots_word_even_once_hurried(tmp_path):
    """The word on whether to commit: a member whose post may already count waits for the
    outcome however long the root takes, a successor waiting or not (else the others commit a
    step it leaves uncommitted); for any other round a hurried member leaves after a few
    seconds."""
    import time

    url = str(tmp_path / "ckpt")
    root = UrlGroup(Storage(url), SESSION, 0, 2, 20.0)
    member = UrlGroup(Storage(url), SESSION, 1, 2, 20.0, hurry=lambda: True)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(member.all_gather_ints([1], patient=True)))
    t.start()
    time.sleep(7.0)  # (past a hurried member's few seconds)
    assert root.all_gather_ints([1]) == [[1], [1]]
    t.join(30)
    assert got == [[[1], [1]]]


class _Node:  # (what open_seal, publish_done and _await_seal read of a persister's Promoter)
    def __init__(self, url: str, job_dir: str, node: int, job_id: str) -> None:
        self.storage = Storage(url)
        self.job_dir = job_dir
        self.job_id = job_id
        self.config = {"nodes": 3, "node": node, "sealed_nodes": True}
        self.flush_ids: list[str] = []


def test_a_joiner_started_during_its_predecessors_flush_joins_the_next_seal(tmp_path):
    """torchrun restarts the job on the same nodes (one job id): node 1's new persister reads its
    baseline while the predecessor's root on node 0 still flushes (its seal record), and that
    root's done record comes after.  When the restarted job dies in turn, the joiner takes part
    in the new root's seal: the old done record names the seal it ends, the baseline (it took it
    for a later flush's end and gave up at once; found by a review)."""
    import time

    from resilient.checkpoint.joint_flush import _await_seal, open_seal, publish_done

    url, job = str(tmp_path / "ckpt"), "torchrun:restarted"
    dirs = [tmp_path / f"node{n}" / "job" for n in range(2)]
    for d in dirs:
        d.mkdir(parents=True)
    old_root, new_root = _Node(url, str(dirs[0]), 0, job), _Node(url, str(dirs[0]), 0, job)
    joiner = _Node(url, str(dirs[1]), 1, job)
    Storage(url).makedirs("")
    old = open_seal(old_root, 5.0)
    assert old is not None
    baseline = _parse((tmp_path / "ckpt" / FLUSH_NAME).read_bytes())["id"]  # (the new joiner's)
    publish_done(old_root, [])  # the predecessor's flush ends after the joiner started
    opened: list[Any] = []

    def open_later() -> None:  # the restarted job dies: its root opens a seal
        time.sleep(1.0)
        group = open_seal(new_root, 5.0)
        opened.append(None if group is None else group.dir.rsplit("/", 1)[1])

    t = threading.Thread(target=open_later)
    t.start()
    got = _await_seal(joiner, baseline, time.monotonic() + 30.0)
    t.join(30)
    assert opened and opened[0] is not None
    assert got == opened[0], "the joiner did not join its root's seal"
    # a done record that names no earlier record of its flush still ends a joiner's wait
    publish_done(_Node(url, str(dirs[0]), 0, job), [])
    assert _await_seal(joiner, got, time.monotonic() + 30.0) is None
