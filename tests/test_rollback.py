"""Commit order, not step number: rollback, the current line, retention, and v1 checkpoints."""

import dataclasses
import json
import os

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


def _falls_back(root, damaged: int, to: int) -> None:
    """Corrupt step ``damaged``: a load with fallback restores ``to`` (the next on the line)."""
    f = root / f"step_{damaged:08d}" / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-8] ^= 0xFF
    f.write_bytes(bytes(data))
    with Checkpointer(str(root)) as ck:
        out = blank()
        with pytest.warns(UserWarning, match=f"falling back to step {to}"):
            assert ck.load(out, fallback=True) == to
        assert out["meta"]["v"] == float(to) and ck.last_load.skipped_steps == [damaged]


def test_fallback_walks_the_line_never_into_the_abandoned_branch(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=5) as ck:
        for s in (100, 200, 250):
            save(ck, s)
        ck.load(blank(), step=100)
        save(ck, 150)
    _falls_back(tmp_path, 150, 100)


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


# --- the line follows what each commit descends from ------------------------------------------


def _parent(ck: Checkpointer, step: int) -> dict | None:
    return ck.manifest(step).extras.get("_resilient_parent")


def _rolled_back_past_the_branch(tmp_path) -> None:
    """100, 200, 250 saved; resume from 100 and save 300: numbered above the abandoned steps."""
    with Checkpointer(str(tmp_path), keep_last=3) as ck:
        for s in (100, 200, 250):
            save(ck, s)
        ck.load(blank(), step=100)
        ck.save(300, state(100.0)).wait()  # 100's state, trained on


def test_a_save_numbered_above_the_abandoned_branch_still_continues_the_step_it_resumed_from(
    tmp_path,
):
    _rolled_back_past_the_branch(tmp_path)
    with Checkpointer(str(tmp_path), keep_last=3) as ck:
        # 100 is 300's parent: kept (the line has 1 newer commit, not keep_last); 250 and 200
        # are the abandoned branch, not the line
        assert ck.steps() == [100, 200, 250, 300]
        assert ck.catalog().line() == [300, 100]
        c = ck.catalog()
        assert _parent(ck, 300) == {
            "step": 100,
            "commit_seq": c.get(100).commit_seq,
            "child_commit_seq": c.get(300).commit_seq,
        }
        # two more commits on the line: 300, 310, 320 are the newest 3 commits and the line's
        # newest 3, so the branch point and the abandoned branch go together
        ck.load(blank())
        save(ck, 310)
        assert ck.steps() == [100, 250, 300, 310]
        save(ck, 320)
        assert ck.steps() == [300, 310, 320] and ck.catalog().line() == [320, 310, 300]


def test_fallback_from_a_save_numbered_above_the_abandoned_branch_goes_to_its_parent(tmp_path):
    _rolled_back_past_the_branch(tmp_path)
    _falls_back(tmp_path, 300, 100)  # never 250, the abandoned state


def test_a_restart_after_the_rollback_continues_the_new_line(tmp_path):
    _rolled_back_past_the_branch(tmp_path)
    with Checkpointer(str(tmp_path), keep_last=3) as ck:  # auto-resume: the newest commit
        out = blank()
        assert ck.load(out) == 300 and out["meta"]["v"] == 100.0
        save(ck, 400)
        c = ck.catalog()
        assert _parent(ck, 400)["step"] == 300
        assert _parent(ck, 400)["commit_seq"] == c.get(300).commit_seq
        assert ck.catalog().line() == [400, 300, 100]
        assert ck.steps() == [100, 250, 300, 400]  # 200 was the oldest of the branch


def test_a_fresh_job_records_no_parent_and_its_saves_chain(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=5) as ck:
        save(ck, 1)  # no load: it descends from nothing this job knows of
        save(ck, 2)  # its previous commit
        assert _parent(ck, 1) is None
        c = ck.catalog()
        assert _parent(ck, 2) == {
            "step": 1,
            "commit_seq": c.get(1).commit_seq,
            "child_commit_seq": c.get(2).commit_seq,
        }


def test_commits_that_record_no_parent_keep_the_line_by_number(tmp_path):
    # manifests of an older release (or of a fresh job): the line as before, by step number
    _rolled_back_past_the_branch(tmp_path)
    for s in (100, 200, 250, 300):
        path = tmp_path / f"step_{s:08d}" / MANIFEST_NAME
        m = json.loads(path.read_text())
        m["extras"].pop("_resilient_parent", None)
        path.write_text(json.dumps(m))
    with Checkpointer(str(tmp_path), keep_last=3) as ck:
        assert ck.catalog().line() == [300, 250, 200, 100]


def _good(**changes):
    return {"step": 100, "commit_seq": 1, "child_commit_seq": 4, **changes}


@pytest.mark.parametrize(
    "value",
    [
        "100:1",  # the memory tier's anchor form, not a parent record
        {"step": 100, "commit_seq": 1},
        {**_good(), "extra": 0},
        _good(step="100"),
        _good(step=True),
        _good(step=-1),
        _good(step=1.0),
        _good(commit_seq=2**63),
        _good(child_commit_seq=3),  # made for another commit_seq: copied from elsewhere
        [100, 1, 4],
        None,
    ],
)
def test_a_parent_record_that_does_not_check_is_not_recorded(tmp_path, value):
    # untrusted: anything but the object of integers made for this very commit says nothing
    from resilient.checkpoint.format import recorded_parent

    assert recorded_parent({"_resilient_parent": value}, 4) is None
    assert recorded_parent({"_resilient_parent": _good()}, 4) == (100, 1)
    _rolled_back_past_the_branch(tmp_path)
    path = tmp_path / "step_00000300" / MANIFEST_NAME
    m = json.loads(path.read_text())
    assert m["commit_seq"] == 4 and m["extras"]["_resilient_parent"] == _good()
    m["extras"]["_resilient_parent"] = value
    path.write_text(json.dumps(m))
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.catalog().line() == [300, 250, 200, 100]  # no parent; still a commit
        assert ck.load(blank()) == 300


def test_line_of_follows_parents():
    from resilient.checkpoint.catalog import line_of
    from resilient.checkpoint.retention import steps_to_delete

    commits = [100, 200, 250, 300]  # commit_seq 1, 2, 3, 4
    assert line_of(commits, {300: (100, 1)}) == [300, 100]
    chain = {300: (250, 3), 250: (200, 2), 200: (100, 1)}
    assert line_of(commits, chain) == [300, 250, 200, 100]
    # not below and older: says nothing (by number); another version of 100: gone
    assert line_of(commits, {300: (400, 1)}) == [300, 250, 200, 100]
    assert line_of(commits, {300: (100, 9)}) == [300, 250, 200, 100]
    assert line_of(commits, {300: (100, 0)}) == [300]  # gone, and nothing before it
    assert steps_to_delete(commits, 3, None, {300: (100, 1)}) == []
    more = {320: (310, 6), 310: (300, 5), 300: (100, 1)}
    assert steps_to_delete([*commits, 310, 320], 3, None, more, [1, 2, 3, 5, 6, 7]) == [
        100,
        200,
        250,
    ]
    assert steps_to_delete(commits, 3, None) == [100]  # without parents: by number


def test_a_parent_that_is_gone_places_the_line_where_it_was():
    from resilient.checkpoint.catalog import Catalog, StepInfo

    def info(step, seq, parent=None):
        return StepInfo(
            step, f"step_{step:08d}", "committed", commit_seq=seq, chain=(parent,) if parent else ()
        )

    # 50 (1), 100 (2, retired), 200 (3), 250 (4); 300 (5) descends from 100
    c = Catalog(
        [info(50, 1), info(200, 3, (100, 2)), info(250, 4, (200, 3)), info(300, 5, (100, 2))]
    )
    assert c.line() == [300, 50]
    # a parent numbered at or above its child, or newer than it, says nothing
    c = Catalog([info(50, 1), info(200, 2), info(150, 3, (200, 2)), info(120, 4, (130, 9))])
    assert c.line() == [120, 50]


def test_the_line_of_many_dangling_parents_takes_linear_time():
    """A hostile root may hold many commits whose parents are gone: the line's walk only goes
    back in commit order, never scanning the commits again for each of them."""
    import time

    from resilient.checkpoint.catalog import Catalog, StepInfo

    n = 50_000
    c = Catalog(
        StepInfo(s, f"step_{s:08d}", "committed", commit_seq=s, chain=((1, 0),))
        for s in range(2, n + 2)
    )
    t0 = time.monotonic()
    assert c.line() == [n + 1]
    assert time.monotonic() - t0 < 5


def test_a_save_through_the_persister_records_its_parent_too(tmp_path):
    # with the memory tier, the persister process commits durable saves from snapshots: the
    # snapshot's durable anchor becomes the commit's parent
    from tests.test_memory_tier import _model

    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1, keep_last=3) as ck:
        for s in (100, 200, 250):
            ck.save(s, {"model": m}).wait()
        assert ck.persister_pid is not None
        assert ck.load({"model": m}, step=100) == 100
        ck.save(300, {"model": m}).wait()
        assert ck.persister_pid is not None and ck.last_load.source == "durable"
    with Checkpointer(url) as ck:
        assert _parent(ck, 300)["step"] == 100
        assert _parent(ck, 300)["commit_seq"] == ck.catalog().get(100).commit_seq
        assert ck.catalog().line() == [300, 100] and ck.steps() == [100, 200, 250, 300]


def test_a_snapshots_anchor_is_not_taken_for_the_parent_of_its_durable_commit(tmp_path):
    """A snapshot's anchor is the newest durable commit known when it was taken: with a durable
    save in flight then (step 10), it names the one before (step 5).  Taken for the parent of
    the snapshot's flush (step 11), it made the line 11 -> 5: step 10 counted as abandoned,
    retention dropped it, and the next snapshot, anchored at 10, was called stale (chaos
    memory-corrupt, now and then).  A flush records no parent (the line goes by numbers); a
    save the trainer hands over records the one it knows exactly."""
    from resilient.checkpoint.persister import _promoted

    url = str(tmp_path / "ckpt")
    with Checkpointer(url, memory_every=1) as ck:
        ck.snapshot(11, state(11.0)).wait()
        snap = ck.snapshots.manifest(11)
    assert snap.extras["_resilient_durable_anchor"] == ""  # (none here: set one by hand)
    import dataclasses

    snap = dataclasses.replace(snap, extras={**snap.extras, "_resilient_durable_anchor": "5:1"})
    names = {f: f for f in snap.files}
    flushed = _promoted(snap, names, 1, 3, "job")
    assert "_resilient_parent" not in flushed.extras
    handed = _promoted(snap, names, 1, 3, "job", ((10, 2),))
    assert handed.extras["_resilient_parent"] == {
        "step": 10,
        "commit_seq": 2,
        "child_commit_seq": 3,
    }


def test_a_durable_save_after_a_rollback_commits_the_state_given_not_an_older_snapshot(tmp_path):
    """With the memory tier, save(S) commits the snapshot of S when one was just taken: one
    taken before a rollback was reused, and durable step 300 held the abandoned state (300),
    not the one given after the rollback (111), under a parent saying it descends from 100."""
    url = str(tmp_path / "ckpt")
    with Checkpointer(url, memory_every=1) as ck:
        for s in (100, 200):
            save(ck, s)
        ck.snapshot(300, state(300.0)).wait()
        assert ck.load(blank(), step=100) == 100
        ck.save(300, state(111.0)).wait()
    out = blank()
    with Checkpointer(url) as ck:
        assert ck.load(out, step=300) == 300 and ck.last_load.source == "durable"
        assert out["meta"]["v"] == 111.0 and torch.equal(out["w"], torch.full((64,), 111.0))
        assert _parent(ck, 300)["step"] == 100


def test_saving_the_loaded_step_again_keeps_what_it_descends_from(tmp_path):
    """A rerun that resumes from 40 and saves 40 again replaces that commit: the new one
    recorded 40 itself for its parent, which says nothing, and the line went by numbers into
    the abandoned 30 (retention then deleted 10, 40's real parent)."""
    url = str(tmp_path / "ckpt")
    with Checkpointer(url, keep_last=10) as ck:
        save(ck, 10)
        save(ck, 30)
        assert ck.load(blank(), step=10) == 10
        save(ck, 40)
        assert ck.catalog().line() == [40, 10]
    with Checkpointer(url, keep_last=2) as ck:
        out = blank()
        assert ck.load(out) == 40
        ck.save(40, out).wait()
        assert _parent(ck, 40)["step"] == 10
        assert ck.catalog().line() == [40, 10] and 10 in ck.steps()
        seq10 = ck.catalog().get(10).commit_seq
        save(ck, 41)  # and the next one descends from the new 40
        assert _parent(ck, 41) == {
            "step": 40,
            "commit_seq": ck.catalog().get(40).commit_seq,
            "child_commit_seq": ck.catalog().get(41).commit_seq,
            "older": [[10, seq10]],  # (what 40 descends from; retired by now)
        }
        assert ck.catalog().line() == [41, 40]


def test_a_gone_parent_leaves_the_line_on_what_it_descended_from(tmp_path):
    """Where a commit's parent is gone (retired, or its manifest damaged), the line went on by
    step numbers from there, into the abandoned branch the parent had skipped: each commit also
    records what its parent descends from, and the line goes on through the first of those
    still there."""
    url = str(tmp_path / "ckpt")
    with Checkpointer(url, keep_last=10) as ck:
        save(ck, 100)
        save(ck, 120)  # abandoned by the rollback below
        assert ck.load(blank(), step=100) == 100
        for s in (130, 131, 132):
            save(ck, s)
        assert ck.catalog().line() == [132, 131, 130, 100]
        assert _parent(ck, 131)["older"] == [[100, ck.catalog().get(100).commit_seq]]
    manifest = tmp_path / "ckpt" / "step_00000130" / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:40])  # 130 is no commit any more
    with Checkpointer(url) as ck:
        assert ck.catalog().line() == [132, 131, 100]  # (by numbers: 132, 131, 120, 100)
        # a chain longer than the record keeps: the line still ends where it is all gone
        from resilient.checkpoint.catalog import line_of

        chain = [(s, s) for s in range(50, 30, -1)]
        assert line_of([10, 20, 40, 60], {60: chain}, [10, 20, 40, 60]) == [60, 40, 20, 10]


def test_a_parent_chain_that_is_not_one_records_nothing():
    from resilient.checkpoint.format import recorded_chain

    good = {"step": 5, "commit_seq": 2, "child_commit_seq": 9, "older": [[3, 1]]}
    assert recorded_chain({"_resilient_parent": good}, 9) == ((5, 2), (3, 1))
    for older in ([[3]], [[3, -1]], [[3, True]], "3:1", [[3, 1]] * 16, [[3, 1.0]], [(3, 1)]):
        value = {**good, "older": older}
        assert recorded_chain({"_resilient_parent": value}, 9) == (), older
    assert recorded_chain({"_resilient_parent": {**good, "extra": 1}}, 9) == ()


def test_the_chain_a_commit_records_stays_bounded_through_the_persister_too(tmp_path):
    """Each save's chain was its anchor's chain and one more: after 16 saves through the
    persister it was longer than a request may carry, and the parent was dropped."""
    from resilient.checkpoint.format import MAX_OLDER

    url = str(tmp_path / "ckpt")
    with Checkpointer(url, memory_every=1, keep_last=3) as ck:
        for s in range(1, MAX_OLDER + 6):
            ck.save(s, state(float(s))).wait()
        assert ck.persister_pid is not None
        assert len(ck._anchor_chain) <= MAX_OLDER + 1
    with Checkpointer(url) as ck:
        last = MAX_OLDER + 5
        record = _parent(ck, last)
        assert record["step"] == last - 1 and len(record["older"]) == MAX_OLDER
        assert record["older"][0][0] == last - 2


def _rolled_back_then_snapshotted(url: str) -> None:
    """Saves 100, 200, 250, a rollback to 100, and a snapshot of 260 (100's state trained on):
    no durable commit since the rollback."""
    with Checkpointer(url, memory_every=1, keep_last=3) as ck:
        for s in (100, 200, 250):
            save(ck, s)
        assert ck.load(blank(), step=100) == 100
        ck.snapshot(260, state(100.5)).wait()
        snap = ck.snapshots.manifest(260)
        # (no durable save in flight: exact, as of the newest durable commit it knew, 250's)
        assert snap.extras["_resilient_anchor_exact"] == 3
        assert snap.extras["_resilient_durable_anchor"] == "100:1"


def test_a_flush_after_a_rollback_records_the_step_it_resumed_from(tmp_path):
    """The trainer closes (or dies) after a rollback with no durable commit since: the persister's
    flush of snapshot 260 recorded no parent, so the line went 260 -> 250 -> 200 by numbers,
    retention deleted 100 (the step the job resumed from) and a fallback from 260 went into the
    abandoned branch."""
    url = str(tmp_path / "ckpt")
    _rolled_back_then_snapshotted(url)
    with Checkpointer(url) as ck:
        assert ck.steps() == [100, 200, 250, 260]
        assert ck.catalog().line() == [260, 100]
        assert _parent(ck, 260)["step"] == 100
    _falls_back(tmp_path / "ckpt", 260, 100)


def test_a_job_restored_from_memory_after_a_rollback_records_the_step_it_resumed_from(
    tmp_path, monkeypatch
):
    """No flush (no persister: in-job recovery's survivors, a trainer whose persister is off):
    the job restored from snapshot 260 recorded no parent at its first durable commit, and
    retention kept the abandoned 200 and 250 as the line, deleting 100."""
    monkeypatch.setenv("RESILIENT_PERSISTER", "0")
    url = str(tmp_path / "ckpt")
    _rolled_back_then_snapshotted(url)
    with Checkpointer(url, memory_every=1, keep_last=3) as ck:
        out = blank()
        assert ck.load(out) == 260 and ck.last_load.source == "memory"
        assert out["meta"]["v"] == 100.5
        save(ck, 300)
    with Checkpointer(url) as ck:
        assert ck.steps() == [100, 200, 250, 300]
        assert ck.catalog().line() == [300, 100]
        assert _parent(ck, 300) == {
            "step": 100,
            "commit_seq": ck.catalog().get(100).commit_seq,
            "child_commit_seq": ck.catalog().get(300).commit_seq,
        }


def test_a_snapshot_taken_while_a_durable_save_is_in_flight_has_no_exact_anchor(tmp_path):
    """Its anchor is the commit before that save, which, once committed, is the state's parent."""
    root = tmp_path / "ckpt"
    root.mkdir()  # (faulty:// makes no root: the tier's count of runs goes there first)
    slow = {"op": "write", "path": "step_00000020/MANIFEST.json", "latency_s": 3.0, "count": 1}
    opts = {"target_protocol": "file", "record": str(tmp_path / "fired"), "faults": [slow]}
    with Checkpointer(f"faulty://{root}", storage_options=opts, memory_every=1) as ck:
        save(ck, 10)
        handle = ck.save(20, state(20.0))  # its manifest's write waits 3 s
        ck.snapshot(21, state(21.0)).wait()
        in_flight = ck.snapshots.manifest(21).extras
        handle.wait()
        ck.snapshot(22, state(22.0)).wait()
        after = ck.snapshots.manifest(22).extras
    assert in_flight["_resilient_durable_anchor"] == "10:1"
    assert in_flight["_resilient_anchor_exact"] is False
    assert after["_resilient_durable_anchor"] == "20:2" and after["_resilient_anchor_exact"] == 2


@pytest.mark.parametrize(
    "exact, anchor, made_since, expected",
    [
        (3, "100:1", (), (100, 1)),
        (3, "100:1", ((260, 4),), None),  # a flush of the snapshot since: the state's commit
        (3, "100:1", ((270, 4),), (100, 1)),  # a later step's commit: not the state's
        (False, "100:1", (), None),
        (True, "100:1", (), None),  # (a bool is no commit_seq)
        ("3", "100:1", (), None),
        (-1, "100:1", (), None),
        (2**63, "100:1", (), None),
        (0, "100:1", (), None),  # the anchor's commit newer than what its job knew of: no
        (3, "", (), None),
    ],
)
def test_a_snapshots_exact_anchor_is_taken_only_as_recorded(exact, anchor, made_since, expected):
    from resilient.checkpoint.catalog import Catalog, StepInfo
    from resilient.checkpoint.format import Manifest
    from resilient.checkpoint.snapshots import exact_anchor
    from resilient.layout import Layout

    def info(s: int, q: int) -> StepInfo:
        return StepInfo(step=s, dir=f"step_{s:08d}", state="committed", commit_seq=q)

    infos = {s: info(s, q) for s, q in ((100, 1), (200, 2), (250, 3), *made_since)}
    durable = Catalog(infos.values())
    extras = {"_resilient_durable_anchor": anchor, "_resilient_anchor_exact": exact}
    snap = Manifest(step=260, layout=Layout(dp=1), tensors={}, files={}, extras=extras)
    assert exact_anchor(snap, durable, set(infos)) == expected
    assert exact_anchor(snap, None, set()) is None  # durable storage not listed: nothing known


def test_a_save_given_up_on_that_commits_later_is_not_skipped_by_the_next_parent(tmp_path):
    """(a review) The trainer gave up waiting for the persister's commit of step 2 (it goes on in
    the background, and committed later), and step 4 recorded step 1 as its parent: the line
    skipped 2, which its state descends from (a fallback from 4 lost it).  A commit above the
    one a parent was known as of now leaves the parent unrecorded (the line goes by numbers)."""
    import signal
    import time

    url = str(tmp_path / "ckpt")
    with Checkpointer(url, memory_every=1, commit_timeout_s=3) as ck:
        save(ck, 1)
        pid = ck.persister_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(Exception, match="step 2"):
                ck.save(2, state(2.0)).wait()
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while 2 not in Checkpointer(url).steps() and time.monotonic() < deadline:
            time.sleep(0.1)
        for s in (3, 4):
            ck.snapshot(s, state(float(s))).wait()
        save(ck, 4)
    with Checkpointer(url) as ck:
        assert ck.catalog().line() == [4, 2, 1]
        assert _parent(ck, 4) is None or _parent(ck, 4)["step"] == 2


def _rolled_back_below_the_branch(url: str, persister: bool, then_load: int | None = None) -> None:
    """Saves 10 and 20, a rollback to 10, snapshots 11 and 12 (numbered below 20), maybe a load
    of ``then_load`` again, and the job ends with no durable save since (a fault: with the
    persister, its flush; without, nothing)."""
    with Checkpointer(url, memory_every=1, persister=persister) as ck:
        for s in (10, 20):
            save(ck, s)
        assert ck.load(blank(), step=10) == 10
        for s in (11, 12):
            ck.snapshot(s, state(10.0 + s / 100)).wait()
        assert ck.snapshots.manifest(12).extras["_resilient_durable_anchor"] == "10:1"
        if then_load is not None:
            assert ck.load(blank(), step=then_load) == then_load


@pytest.mark.parametrize("persister", [True, False])
def test_a_fault_after_a_rollback_resumes_the_new_line_not_the_abandoned_branch(
    tmp_path, persister
):
    """After a rollback to 10 (20 committed) and snapshots 11, 12, a fault before any durable
    save resumed 20, the branch the rollback left: its number is above 12.  Snapshot 12 descends
    exactly from 10 and nothing was committed since: the flush commits it as a durable save
    after the rollback would (parent 10, the line skips 20), and a restore from memory takes it."""
    url = str(tmp_path / "ckpt")
    _rolled_back_below_the_branch(url, persister)
    if not persister:  # a restart restores it from memory, and its first save continues it
        with Checkpointer(url, memory_every=1, persister=False) as ck:
            out = blank()
            assert ck.load(out) == 12 and ck.last_load.source == "memory"
            assert out["meta"]["v"] == 10.12
            save(ck, 13)
    with Checkpointer(url) as ck:  # (durable storage alone)
        top = 12 if persister else 13
        out = blank()
        assert ck.load(out) == top and out["meta"]["v"] == float(top if top == 13 else 10.12)
        assert ck.catalog().line() == [top, 10] and _parent(ck, top)["step"] == 10
        assert 20 in ck.steps()  # (abandoned, left to age out: never deleted as the line)


@pytest.mark.parametrize("persister", [True, False])
def test_a_load_after_the_snapshots_of_a_rollback_begins_another_line(tmp_path, persister):
    """A load of 20 again after those snapshots: a fault before the next snapshot resumes 20,
    not snapshot 12 of the line it left (LINE.json: 12 was taken before that load)."""
    url = str(tmp_path / "ckpt")
    _rolled_back_below_the_branch(url, persister, then_load=20)
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        assert ck.load(blank()) == 20
        assert ck.catalog().line() == [20, 10] and 12 not in ck.steps()


def test_the_fallback_from_a_snapshot_of_a_rollback_is_its_anchor_not_the_branch(tmp_path):
    """Snapshots 11 and 12 of the new line both damaged: the load falls back to 10, the step
    they descend from, not to 20 on the branch the rollback left."""
    url = str(tmp_path / "ckpt")
    _rolled_back_below_the_branch(url, persister=False)
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        for s in (11, 12):
            d = os.path.join(ck.memory.steps, f"step_{s:08d}")
            for name in os.listdir(d):
                if name.endswith(".safetensors"):
                    with open(os.path.join(d, name), "r+b") as f:
                        f.seek(-3, os.SEEK_END)
                        f.write(b"\xff\xfe\xfd")
        with pytest.warns(UserWarning, match="falling back"):
            assert ck.load(blank()) == 10
        assert ck.last_load.source == "durable"


@pytest.mark.parametrize(
    "exact, after, since, anchor_seq, expected",
    [
        (2, 0, (), 1, (10, 1)),
        (2, None, (), 1, None),  # no mark of where the line began
        (2, 5, (), 1, None),  # taken before rank 0's last load (numbered 5 and below)
        (False, 0, (), 1, None),  # a durable save in flight when it was taken
        (2, 0, ((30, 3),), 1, None),  # committed since: that commit is newer
        (2, 0, (), 9, None),  # the anchor's commit is another (re-saved)
        (1, 0, (), 1, None),  # it did not know of 20 (seen 1): not a rollback past it
    ],
)
def test_a_snapshot_is_of_a_newer_line_only_as_recorded(exact, after, since, anchor_seq, expected):
    from resilient.checkpoint.catalog import Catalog, StepInfo
    from resilient.checkpoint.format import Manifest
    from resilient.checkpoint.snapshots import newer_line
    from resilient.layout import Layout

    infos = [
        StepInfo(step=s, dir=f"step_{s:08d}", state="committed", commit_seq=q)
        for s, q in ((10, 1), (20, 2), *since)
    ]
    extras = {"_resilient_durable_anchor": f"10:{anchor_seq}", "_resilient_anchor_exact": exact}
    snap = Manifest(step=12, layout=Layout(dp=1), tensors={}, files={}, extras=extras)
    snap = dataclasses.replace(snap, commit_seq=5)
    assert newer_line(snap, Catalog(infos), after) == expected
    assert newer_line(snap, None, after) is None


@pytest.mark.parametrize("persister", [True, False])
def test_a_second_fault_before_a_snapshot_still_resumes_the_new_line(
    tmp_path, monkeypatch, persister
):
    """The restart after the fault restores snapshot 12 of the new line and faults again before
    its first snapshot (a restart loop): the next restart (or that restart's persister's flush)
    still takes 12, the state it restored, not 20 on the branch the rollback left.  Its load's
    mark of where the line begins counted 12 itself as taken before it."""
    url = str(tmp_path / "ckpt")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")  # (one job, restarted)
    _rolled_back_below_the_branch(url, persister=False)  # (its persister killed with it)
    with Checkpointer(url, memory_every=1, persister=persister) as ck:
        assert ck.load(blank()) == 12 and ck.last_load.source == "memory"
        if persister:  # (started, as by a first snapshot the fault cut short: it flushes)
            ck._start_persister()
    with Checkpointer(url, memory_every=None if persister else 1) as ck:
        out = blank()  # (with the persister: durable storage alone, its flush)
        assert ck.load(out) == 12 and out["meta"]["v"] == 10.12
        if persister:
            assert ck.catalog().line() == [12, 10] and _parent(ck, 12)["step"] == 10


@pytest.mark.parametrize("planted", ["directory", "fifo", "symlink"])
def test_a_line_mark_that_is_not_a_regular_file_counts_as_none(tmp_path, planted):
    """LINE.json planted as a directory (its read raised IsADirectoryError out of the load), a
    FIFO or a link (to a mark that would count snapshot 12 as of the new line): no mark, so the
    load resumes 20; nothing is written through the link, and no temporary file is left."""
    url = str(tmp_path / "ckpt")
    _rolled_back_below_the_branch(url, persister=False)
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        job = ck.memory.dir
    mark = os.path.join(job, "LINE.json")
    os.unlink(mark)
    victim = tmp_path / "victim"
    victim.write_text(json.dumps({"format": "resilient-line/1", "after": 0}))
    before = victim.read_text()
    if planted == "directory":
        os.mkdir(mark)
    elif planted == "fifo":
        os.mkfifo(mark)
    else:
        os.symlink(victim, mark)
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        assert ck.load(blank()) == 20 and ck.last_load.source == "durable"
    assert victim.read_text() == before
    assert not [n for n in os.listdir(job) if n.startswith("LINE.json.tmp")]
