"""The seal's collectives through the checkpoint URL (url_group.py): members in threads here, over
a local folder, as the nodes' persisters use them over any fsspec URL; and what someone else's
bucket can put in a session's folder."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from resilient.checkpoint.joint_flush import FLUSH_NAME, _parse
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.url_group import SEAL_DIR, GroupBroken, UrlGroup
from resilient.errors import ResilientError


def _members(url: str, n: int, wait_s: float = 20.0) -> list[UrlGroup]:
    return [UrlGroup(Storage(url), "a1b2c3d4e5f60718", m, n, wait_s) for m in range(n)]


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

    stale = tmp_path / "ckpt" / SEAL_DIR / "ffffffffffffffff"
    stale.mkdir(parents=True)
    (stale / "0.1.json").write_text("{}")
    group = open_seal(_Promoter(), 1.0)
    assert group is not None and group.size() == 3 and group.rank == 0
    assert not stale.exists()
    record = _parse((tmp_path / "ckpt" / FLUSH_NAME).read_bytes())
    assert record["seal"] is True and group.dir == f"{SEAL_DIR}/{record['id']}"
    assert Path(tmp_path / "ckpt" / group.dir).is_dir()
