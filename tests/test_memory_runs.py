"""The memory tier's count of a job's runs in durable storage (snapshots.number_this_run): each
run's commits in memory are numbered above every earlier run's.  The file is untrusted input like
any checkpoint's: whatever it holds, a run starts, with a warning that names it, and never reads
more than a few KiB of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.checkpoint.snapshots import MAX_RUN, MEMORY_RUNS_NAME, RUN_SHIFT, number_this_run
from resilient.checkpoint.storage import Storage


def _count(url: Path) -> int:
    return json.loads((url / MEMORY_RUNS_NAME).read_text())["runs"]


def test_each_checkpointer_with_the_tier_counts_one_run_and_numbers_its_commits_above(tmp_path):
    url = tmp_path / "ckpt"
    for run in (1, 2, 3):
        with Checkpointer(str(url), memory_every=1, persister=False) as ck:
            ck.snapshot(run, {"w": [float(run)]}).wait()
            seq = ck._memory.catalog().get(run).commit_seq
        assert _count(url) == run
        assert seq >> RUN_SHIFT == run, seq
    with Checkpointer(str(url)) as ck:  # no memory tier: nothing is counted
        ck.save(9, {"w": [9.0]}).wait()
    assert _count(url) == 3


def test_the_count_never_falls_behind_the_runs_this_nodes_memory_holds(tmp_path):
    """(the file lost, say, or written back by an older copy of the checkpoint)"""
    st = Storage(str(tmp_path / "ckpt"))
    assert number_this_run(st, 0) == 1
    assert number_this_run(st, 7) == 8
    assert number_this_run(st, 2) == 9


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        b'{"format": "something-else/1", "runs": 3}',
        b'{"format": "resilient-memory-runs/1", "runs": "3"}',
        b'{"format": "resilient-memory-runs/1", "runs": -1}',
        b'{"format": "resilient-memory-runs/1", "runs": true}',
        json.dumps({"format": "resilient-memory-runs/1", "runs": MAX_RUN}).encode(),
        json.dumps({"format": "resilient-memory-runs/1", "runs": 10**400}).encode(),
        b" " * (1 << 20),
    ],
    ids=["text", "list", "format", "string", "negative", "bool", "too-many", "huge", "1MiB"],
)
def test_a_damaged_count_is_named_and_written_anew(tmp_path, content):
    url = tmp_path / "ckpt"
    url.mkdir()
    (url / MEMORY_RUNS_NAME).write_bytes(content)
    st = Storage(str(url))
    with pytest.warns(UserWarning, match=MEMORY_RUNS_NAME):
        assert number_this_run(st, 4) == 5
    assert _count(url) == 5


def test_a_count_that_is_a_link_or_a_directory_is_not_followed(tmp_path):
    url = tmp_path / "ckpt"
    url.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": "resilient-memory-runs/1", "runs": 40}))
    os.symlink(target, url / MEMORY_RUNS_NAME)
    with pytest.warns(UserWarning, match="link"):
        assert number_this_run(Storage(str(url)), 0) == 1
    assert json.loads(target.read_text())["runs"] == 40  # the link was replaced, not written
    assert not (url / MEMORY_RUNS_NAME).is_symlink() and _count(url) == 1
    (url / MEMORY_RUNS_NAME).unlink()
    (url / MEMORY_RUNS_NAME).mkdir()
    with pytest.warns(UserWarning) as caught:
        # a directory cannot be written either: the run is numbered by its memory alone
        assert number_this_run(Storage(str(url)), 0) is None
    said = [str(w.message) for w in caught]
    assert any("cannot be read" in m for m in said), said
    assert any("cannot be written" in m for m in said), said
