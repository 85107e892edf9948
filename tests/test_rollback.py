"""Commit order, not step number: rollback, the current line, retention, and v1 checkpoints."""

import json

import pytest
import torch

from resilient import Checkpointer
from resilient.checkpoint.format import MANIFEST_NAME


def state(v: float) -> dict:
    return {"w": torch.full((64,), v), "meta": {"v": v}}


def blank() -> dict:
    return {"w": torch.zeros(64), "meta": {"v": 0.0}}


def save(ck: Checkpointer, step: int) -> None:
    ck.save(step, state(float(step))).wait()


def test_a_rollback_commit_is_the_latest_and_survives_retention(tmp_path):
    # 100, 200, 250 saved; a loss spike: resume from 100, train on, save 150.
    with Checkpointer(str(tmp_path), keep_last=3) as ck:
        for s in (100, 200, 250):
            save(ck, s)
        out = blank()
        assert ck.load(out, step=100) == 100
        save(ck, 150)
        assert ck.steps() == [100, 150, 200, 250]  # listed by number, the abandoned branch too
        assert ck.commits() == [100, 200, 250, 150]
        assert ck.latest_step() == 150
        assert ck.catalog().line() == [150, 100]  # the line 150 continues
        out = blank()
        assert ck.load(out) == 150 and out["meta"]["v"] == 150.0
    # a fresh process (auto-resume) picks 150, not the abandoned 250
    with Checkpointer(str(tmp_path)) as ck:
        out = blank()
        assert ck.load(out) == 150 and torch.equal(out["w"], torch.full((64,), 150.0))


def test_the_abandoned_branch_ages_out_and_the_line_is_kept(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=3) as ck:
        for s in (100, 200, 250):
            save(ck, s)
        ck.load(blank(), step=100)
        save(ck, 150)
        # the newest 3 commits (200, 250, 150) and the line's newest 3 (150, 100): all kept
        assert ck.steps() == [100, 150, 200, 250]
        save(ck, 160)  # commits ... 250, 150, 160; line 160, 150, 100
        assert ck.steps() == [100, 150, 160, 250]
        save(ck, 170)  # the line has 3 newer commits than the branch point: both go
        assert ck.steps() == [150, 160, 170]
        assert (tmp_path / "step_00000200").exists() is False


def test_fallback_walks_the_line_never_into_the_abandoned_branch(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=5) as ck:
        for s in (100, 200, 250):
            save(ck, s)
        ck.load(blank(), step=100)
        save(ck, 150)
    f = tmp_path / "step_00000150" / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-8] ^= 0xFF
    f.write_bytes(bytes(data))
    with Checkpointer(str(tmp_path)) as ck:
        out = blank()
        with pytest.warns(UserWarning, match="falling back to step 100"):
            assert ck.load(out, fallback=True) == 100
        assert out["meta"]["v"] == 100.0 and ck.last_load.skipped_steps == [150]


def test_resaving_an_old_step_makes_it_the_newest_commit(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=3) as ck:
        for s in (1, 2, 3):
            save(ck, s)
        ck.load(blank(), step=2)
        ck.save(2, state(22.0)).wait()
        assert ck.commits() == [1, 3, 2] and ck.latest_step() == 2
        out = blank()
        assert ck.load(out) == 2 and out["meta"]["v"] == 22.0


def _as_v1(path) -> None:
    """Rewrite a saved manifest as format v1 wrote it (no commit order, no job id)."""
    m = json.loads(path.read_text())
    m["format_version"] = 1
    del m["commit_seq"], m["job_id"]
    path.write_text(json.dumps(m))


def test_v1_checkpoints_still_load_and_order_before_v2_commits(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=5) as ck:
        for s in (10, 20):
            save(ck, s)
    for s in (10, 20):
        _as_v1(tmp_path / f"step_{s:08d}" / MANIFEST_NAME)
    with Checkpointer(str(tmp_path), keep_last=5) as ck:
        assert ck.commits() == [10, 20] and ck.latest_step() == 20  # v1: by step number
        out = blank()
        assert ck.load(out) == 20 and out["meta"]["v"] == 20.0
        assert ck.manifest(20).commit_seq == 0 and ck.manifest(20).format_version == 2
        assert ck.verify(10).ok
        # a rollback to 10 on the upgraded toolkit: the v2 commit is newer than any v1 step
        ck.load(blank(), step=10)
        save(ck, 15)
        assert ck.commits() == [10, 20, 15] and ck.latest_step() == 15


@pytest.mark.parametrize(
    "commits,keep_last,keep_every,dropped",
    [
        ([1, 2, 3, 4, 5], 2, None, [1, 2, 3]),  # no rollback: the newest by number
        ([1, 2, 3, 4, 5], 2, 2, [1, 3]),
        ([100, 200, 250, 150], 3, None, []),
        ([100, 200, 250, 150, 160], 3, None, [200]),
        ([100, 200, 250, 150, 160, 170], 3, None, [100, 200, 250]),
        ([100, 200, 250, 150, 160, 170], 1, 100, [150, 160, 250]),
        ([5], 1, None, []),
        ([], 1, None, []),
    ],
)
def test_retention_rule(commits, keep_last, keep_every, dropped):
    from resilient.checkpoint.retention import steps_to_delete

    assert steps_to_delete(commits, keep_last, keep_every) == dropped
    if commits:
        assert commits[-1] not in steps_to_delete(commits, keep_last, keep_every)


def test_line_of():
    from resilient.checkpoint.catalog import line_of

    assert line_of([100, 200, 250, 150]) == [150, 100]
    assert line_of([1, 2, 3]) == [3, 2, 1]
    assert line_of([3, 2, 1]) == [1]
    assert line_of([]) == []
