"""The memory tier's count of a job's runs in durable storage (snapshots.number_this_run): each
run's commits in memory are numbered above every earlier run's.  The file is untrusted input like
any checkpoint's: whatever it holds, a run starts, with a warning that names it, and never reads
more than a few KiB of it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer
from resilient.checkpoint import checkpointer as ckmod
from resilient.checkpoint.catalog import summary_of
from resilient.checkpoint.format import (
    MAX_RUN,
    PARENT_KEY,
    RUN_KEY,
    RUN_UNCOUNTED_KEY,
    RUNS_SEEN_KEY,
    step_dir_name,
    user_extras,
)
from resilient.checkpoint.persister import _promoted
from resilient.checkpoint.seal import seal_staged
from resilient.checkpoint.snapshots import MEMORY_RUNS_NAME, RUN_SHIFT, number_this_run
from resilient.checkpoint.storage import Storage
from resilient.errors import StorageError


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
        b"[" * 4000,  # (json's RecursionError, not a ValueError)
        b'{"format": "resilient-memory-runs/1", "runs": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    ],
    ids=[
        "text",
        "list",
        "format",
        "string",
        "negative",
        "bool",
        "too-many",
        "huge",
        "1MiB",
        "nested",
        "nested-value",
    ],
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


def test_a_count_that_cannot_be_read_is_not_written_back_lower(tmp_path, monkeypatch):
    """A storage failure reading the count (after retries) is not a damaged count: writing it
    anew from this node's memory alone could put it below runs already made."""
    url = tmp_path / "ckpt"
    url.mkdir()
    (url / MEMORY_RUNS_NAME).write_text(
        json.dumps({"format": "resilient-memory-runs/1", "runs": 5})
    )
    real = Storage.read_small

    def failing(self, rel, max_bytes):
        if rel == MEMORY_RUNS_NAME:
            try:
                raise ConnectionError("503 SlowDown (injected)")
            except ConnectionError as e:
                raise StorageError(f"reading {rel} kept failing: {e}", url=str(url)) from e
        return real(self, rel, max_bytes)

    monkeypatch.setattr(Storage, "read_small", failing)
    with pytest.warns(UserWarning, match="cannot be read"):
        assert number_this_run(Storage(str(url)), 0) is None
    assert _count(url) == 5


@pytest.mark.parametrize("damage", ["deleted", "garbage", "nested"])
def test_a_lost_count_never_numbers_a_run_below_the_newest_durable_commits(tmp_path, damage):
    """Run 1 on node X: durable 10, snapshot 20.  The count is lost.  Run 2 on node Y (X sat it
    out) restores 10 and commits durable 15.  Run 3 on X restores run 2's 15, not run 1's
    snapshot 20: run 2 is numbered above run 1, which durable step 10 records."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    x, y = str(tmp_path / "x"), str(tmp_path / "y")

    def checkpointer(root: str) -> Checkpointer:
        return Checkpointer(str(url), memory_every=1, memory_root=root, persister=False, job_id="j")

    with checkpointer(x) as ck:
        ck.save(10, {"model": m}).wait()
        ck.snapshot(20, {"model": m}).wait()
    if damage == "deleted":
        (url / MEMORY_RUNS_NAME).unlink()
    else:
        (url / MEMORY_RUNS_NAME).write_bytes(b"\x00garbage" if damage == "garbage" else b"[" * 4000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the damaged count's warning)
        with checkpointer(y) as ck:
            assert ck._run == 2
            assert ck.load({"model": m}) == 10
            with torch.no_grad():
                m.weight.fill_(15.0)
            ck.save(15, {"model": m}).wait()
    with checkpointer(x) as ck:
        assert ck._run == 3
        fresh = torch.nn.Linear(4, 4)
        assert ck.load({"model": fresh}) == 15
        assert torch.equal(fresh.weight, m.weight)


def test_a_rollback_by_name_to_a_snapshot_a_later_run_descends_from(tmp_path):
    """Run 1: durable 10, snapshots 11 and 12.  Run 2 restores 12 and commits durable 14 (a
    later run's commit, of a later step).  Run 3 rolls back to 12 by name: run 2 descends from
    it, so it is no older line."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    with Checkpointer(str(url), memory_every=1, persister=False, job_id="j") as ck:
        ck.save(10, {"model": m}).wait()
        for step in (11, 12):
            with torch.no_grad():
                m.weight.fill_(float(step))
            ck.snapshot(step, {"model": m}).wait()
    with Checkpointer(str(url), memory_every=1, persister=False, job_id="j") as ck:
        assert ck.load({"model": m}) == 12
        ck.save(14, {"model": m}).wait()
    with Checkpointer(str(url), memory_every=1, persister=False, job_id="j") as ck:
        fresh = torch.nn.Linear(4, 4)
        assert ck.load({"model": fresh}, step=12) == 12
        assert ck.last_load.source == "memory" and fresh.weight.eq(12.0).all()


@pytest.mark.parametrize("where", ["root", "prefix"])
def test_the_count_on_an_object_store(s3, tmp_path, where):
    """At a bucket's root and under a prefix (nothing to make: an object store has no
    directories); a durable save there records the run."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}" if where == "root" else f"s3://{bucket}/job"
    for run in (1, 2):
        with Checkpointer(
            url, memory_every=1, memory_root=str(tmp_path / "m"), storage_options=s3.options
        ) as ck:
            assert ck._run == run
            ck.save(run, {"w": torch.full((4,), float(run))}).wait()
    st = Storage(url, s3.options)
    assert json.loads(st.read_small(MEMORY_RUNS_NAME, 4096))["runs"] == 2
    with Checkpointer(url, storage_options=s3.options) as ck:
        assert ck.manifest(2).extras["_resilient_memory_run"] == 2


def _put(ck: Checkpointer, m: torch.nn.Module, step: int, value: float, *, durable=False) -> None:
    """``m``'s weights all ``value``, snapshotted (``durable``: saved) as ``step``, waited for."""
    with torch.no_grad():
        m.weight.fill_(value)
    (ck.save if durable else ck.snapshot)(step, {"model": m}).wait()


def _restored(ck: Checkpointer) -> tuple[int, float]:
    """The step ``ck`` loads and the value of the weights it restores (all one value)."""
    fresh = torch.nn.Linear(4, 4)
    step = ck.load({"model": fresh})
    values = fresh.weight.detach().unique()
    assert len(values) == 1, values
    return step, float(values[0])


def older_then_later_run(tmp_path: Path, commit_every: int) -> Callable[[], Checkpointer]:
    """Run 1 on node X: durable 10, snapshot 20 of weights 20 (committed, or with
    ``commit_every`` 0 sealed only: its commit is whoever needs it).  Run 2 on node Y (X sat it
    out) restores 10 and commits durable 15 of weights 15.  Returns the maker of run 3's
    checkpointer, back on X."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)

    def checkpointer(node: str, every: int = commit_every) -> Checkpointer:
        root = str(tmp_path / node)
        kw = {"memory_root": root, "persister": False, "job_id": "j", "memory_commit_every": every}
        return Checkpointer(str(url), memory_every=1, **kw)

    with checkpointer("x") as ck:
        ck.save(10, {"model": m}).wait()
        with torch.no_grad():
            m.weight.fill_(20.0)
        ck.snapshot(20, {"model": m})
    with checkpointer("y", 1) as ck:
        assert ck.load({"model": m}) == 10  # (X's memory is not this node's)
        with torch.no_grad():
            m.weight.fill_(15.0)
        ck.save(15, {"model": m}).wait()
    return lambda: checkpointer("x")


@pytest.mark.parametrize("commit_every", [1, 0], ids=["committed", "sealed"])
def test_an_older_runs_snapshot_loses_to_a_later_runs_durable_commit(tmp_path, commit_every):
    """Run 3 back on X restores run 2's 15: its load seals run 1's step 20 (if only sealed) as
    run 1's, which a later run's durable commit outranks."""
    with older_then_later_run(tmp_path, commit_every)() as ck:
        fresh = torch.nn.Linear(4, 4)
        assert ck.load({"model": fresh}) == 15 and fresh.weight.eq(15.0).all()
        runs = {s: ck._memory.catalog().get(s).commit_seq >> RUN_SHIFT for s in ck.memory_steps()}
        assert runs[20] == 1, runs  # (sealed or committed, run 1's)


@pytest.mark.parametrize("same_job", [False, True], ids=["another-job", "same-job"])
def test_a_snapshot_loses_to_a_later_durable_commit_by_another_job_without_the_tier(
    tmp_path, same_job
):
    """(a review) A commit made with the tier off records no run, and was never counted against
    a snapshot: run 1 kept snapshot 20 in memory, another job without the tier resumed from
    durable 10 and committed 15, and the next run with the tier restored 20, dropping 15.
    (a second review) The same job id too: torchrun's --rdzv-id, or the store address of a job
    on one host, is the same in every run, so run 1 with the tier, run 2 of the same id without
    it, and run 3 with it again restored run 1's 20 over run 2's newer commit 15."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    kw = {"memory_root": str(tmp_path / "x"), "persister": False, "job_id": "j"}
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        ck.save(10, {"model": m}).wait()
        _put(ck, m, 20, 20.0)
    with Checkpointer(str(url), job_id="j" if same_job else "k") as ck:  # the tier off
        assert ck.load({"model": m}) == 10
        _put(ck, m, 15, 15.0, durable=True)
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        assert _restored(ck) == (15, 15.0)


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "uncounted"])
def test_a_step_staged_by_a_run_older_than_a_later_commit_here_is_not_sealed(
    tmp_path, monkeypatch, counted
):
    """Run 1 (its count written, or not: storage down at its start) stages step 20 (sealed only)
    and dies.  Run 2 on the same memory commits steps 11 and 12 without sealing it (as a job on
    several nodes does: only one node's load seals), and run 1's staged files are still there
    (a run's first snapshot clears its own rank's only).  Run 3's load does not seal run 1's
    step 20 above run 2's line: it restores 12."""
    url, m, root = tmp_path / "ckpt", torch.nn.Linear(4, 4), tmp_path / "m"
    if not counted:
        monkeypatch.setattr(ckmod, "number_this_run", lambda *a, **k: None)
    with Checkpointer(str(url), memory_commit_every=0, **_kw(root)) as ck:
        assert ck._memory._slots.job_run == (1 if counted else 0)
        ck.save(10, {"model": m}).wait()
        ck.snapshot(20, {"model": m})
        staging = Path(ck.memory.dir) / "staging"
    monkeypatch.undo()
    _keep(staging, tmp_path / "kept")
    with Checkpointer(str(url), **_kw(root)) as ck:  # (no load: nothing sealed)
        for step in (11, 12):
            with torch.no_grad():
                m.weight.fill_(float(step))
            ck.snapshot(step, {"model": m}).wait()
    _put_back(staging, tmp_path / "kept")
    assert sorted(p.name for p in staging.iterdir()) == [
        "rank_00000.0.safetensors",
        "rank_00000.step_20.json",
    ]
    with Checkpointer(str(url), **_kw(root)) as ck:
        fresh = torch.nn.Linear(4, 4)
        assert ck.load({"model": fresh}) == 12 and fresh.weight.eq(12.0).all()
        assert 20 not in ck.memory_steps()


# --- sealing a step as the run that staged it (a third review's probes) ---------------------
def _kw(root: Path) -> dict:
    return {"memory_every": 1, "memory_root": str(root), "persister": False, "job_id": "j"}


def _keep(staging: Path, kept: Path) -> None:
    kept.mkdir()
    for f in staging.iterdir():
        os.link(f, kept / f.name)


def _put_back(staging: Path, kept: Path) -> None:
    shutil.rmtree(staging)
    staging.mkdir()
    for f in kept.iterdir():
        os.link(f, staging / f.name)


def test_an_implausible_commit_in_memory_does_not_stop_later_seals(tmp_path):
    """A commit numbered beyond any run in this memory (a damaged manifest's, IMPLAUSIBLE_SEQ)
    says nothing of runs: a later run's own cut-short step is still sealed."""
    url, m, root = tmp_path / "ckpt", torch.nn.Linear(4, 4), tmp_path / "m"
    with Checkpointer(str(url), memory_commit_every=1, **_kw(root)) as ck:
        ck._memory._seq_floor = 1 << 62  # (a manifest of that commit order in this memory)
        ck.snapshot(1, {"model": m}).wait()
        assert ck._memory.catalog().get(1).commit_seq > (1 << 62)
    with Checkpointer(str(url), memory_commit_every=0, **_kw(root)) as ck:
        assert ck._run and ck._run < (1 << 29)
        with torch.no_grad():
            m.weight.fill_(2.0)
        ck.snapshot(2, {"model": m})
    with Checkpointer(str(url), **_kw(root)) as ck:
        fresh = torch.nn.Linear(4, 4)
        assert ck.load({"model": fresh}) == 2  # run 2's newest step, cut short: sealed


def _sealed_5_whose_record_says(tmp_path: Path, job_run: object) -> Path:
    """A run that staged step 5 (sealed only) and ended; its rank 0 record's ``job_run`` then
    rewritten.  Returns the job's memory directory."""
    with Checkpointer(str(tmp_path / "ckpt"), memory_commit_every=0, **_kw(tmp_path / "m")) as ck:
        ck.snapshot(5, {"model": torch.nn.Linear(4, 4)})
        job = Path(ck.memory.dir)
    rec = job / "staging" / "rank_00000.step_5.json"
    data = json.loads(rec.read_text())
    data["job_run"] = job_run
    rec.write_text(json.dumps(data))
    return job


@pytest.mark.parametrize(
    "value",
    [True, False, -1, 1 << 29, 1 << 70, 2.0, "3", None, [1], {"a": 1}, float("nan")],
    ids=repr,
)
def test_a_damaged_job_run_in_a_staged_record_counts_as_no_run(tmp_path, value):
    job = _sealed_5_whose_record_says(tmp_path, value)
    assert seal_staged(str(job)) == 5
    from resilient.checkpoint.catalog import scan
    from resilient.checkpoint.storage import Storage

    seq = scan(Storage(str(job / "steps"))).get(5).commit_seq
    assert seq >> RUN_SHIFT == 0, seq  # (treated as no run)


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "uncounted"])
def test_a_step_staged_after_an_earlier_runs_commits_is_sealed_as_its_own_runs(
    tmp_path, monkeypatch, counted
):
    """Run 1 commits 1 and 2; run 2 stages step 3 only (sealed); run 3's load seals it as run
    2's, not its own, and restores it.  Where run 2 could not be counted (storage down at its
    start), it numbers as the newest run its memory holds (run 1's), so the seal still takes
    it: nothing committed since."""
    url, m, root = tmp_path / "ckpt", torch.nn.Linear(4, 4), tmp_path / "m"
    with Checkpointer(str(url), memory_commit_every=1, **_kw(root)) as ck:
        run1 = ck._run
        for s in (1, 2):
            ck.snapshot(s, {"model": m}).wait()
    if not counted:
        monkeypatch.setattr(ckmod, "number_this_run", lambda *a, **k: None)
    with Checkpointer(str(url), memory_commit_every=0, **_kw(root)) as ck:
        run2 = ck._run if counted else run1
        ck.snapshot(3, {"model": m})
    monkeypatch.undo()
    with Checkpointer(str(url), **_kw(root)) as ck:
        assert ck.load({"model": torch.nn.Linear(4, 4)}) == 3
        assert ck._memory.catalog().get(3).commit_seq >> RUN_SHIFT == run2 >= run1


def test_a_staged_record_claiming_a_later_run_than_the_sealers_counts_as_no_run(tmp_path):
    """One damaged record claiming run 2**29 - 1 would number its sealed commit so that no later
    run of the job could be counted: the load's seal knows its own run and takes no later one."""
    url, root = tmp_path / "ckpt", tmp_path / "m"
    _sealed_5_whose_record_says(tmp_path, (1 << 29) - 1)
    with Checkpointer(str(url), **_kw(root)) as ck:
        assert ck.load({"model": torch.nn.Linear(4, 4)}) == 5
        assert ck._memory.catalog().get(5).commit_seq >> RUN_SHIFT == 0
    with Checkpointer(str(url), **_kw(root)) as ck:
        assert ck._run == 3


def test_a_later_runs_commit_whose_manifest_cannot_be_read_again_still_outranks(
    tmp_path, monkeypatch
):
    """The run that made each durable commit comes with the listing (the catalog's read of its
    manifest), not from a second read: a storage error on that read, after the listing, used to
    count as "no run", and run 1's snapshot 20 was restored over run 2's durable 15."""
    make = older_then_later_run(tmp_path, 1)
    with make() as ck:
        ck.catalog()  # (listed: the manifests' summaries are known)
        real = Storage.read_small

        def failing(self, rel, *a, **kw):
            if rel.endswith("MANIFEST.json") and "00000015" in rel:
                raise StorageError(f"injected: {rel} cannot be read")
            return real(self, rel, *a, **kw)

        monkeypatch.setattr(Storage, "read_small", failing)
        fresh = torch.nn.Linear(4, 4)
        with pytest.raises(StorageError, match="00000015"):  # (the durable step's own read)
            ck.load({"model": fresh})
        assert not fresh.weight.eq(20.0).all()
        monkeypatch.undo()
        assert ck.load({"model": fresh}) == 15 and fresh.weight.eq(15.0).all()


@pytest.mark.parametrize("anchor", ["²:1", "1:²", "١٢:3", "3:", ":3", "1:2:3", "1_0:2"])
def test_an_anchor_of_other_digits_records_no_durable_commit(anchor):
    """str.isdigit takes "²" and Arabic-Indic digits, which int() refuses (a bare ValueError
    out of a damaged snapshot's manifest): such an anchor names no commit."""
    from resilient.checkpoint.snapshots import _parse_anchor

    assert _parse_anchor(anchor) is None
    assert _parse_anchor("12:3") == (12, 3)


def test_an_uncounted_runs_snapshot_taken_during_its_own_save_is_restored(tmp_path, monkeypatch):
    """(a review) Run 1 counted; run 2's count cannot be written (a directory at its name) and
    its durable saves stay in the trainer (persister off): it takes snapshot 31 while its save of
    30 is in flight.  Its commit of 30 recorded no run, so run 3 refused 31 as "committed by a run
    without the memory tier" and restored 30; it records the run its memory numbering uses."""
    url, m, root = tmp_path / "ckpt", torch.nn.Linear(4, 4), tmp_path / "m"
    with Checkpointer(str(url), **_kw(root)) as ck:
        ck.snapshot(1, {"model": m}).wait()
    (url / MEMORY_RUNS_NAME).unlink()
    (url / MEMORY_RUNS_NAME).mkdir()
    gate, real = threading.Event(), ckmod.publish_commit

    def held(storage, lease, manifest, **kw):  # (save 30 commits only once 31 is taken)
        if manifest.step == 30:
            assert gate.wait(30)
        return real(storage, lease, manifest, **kw)

    monkeypatch.setattr(ckmod, "publish_commit", held)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the count's)
        with Checkpointer(str(url), **_kw(root)) as ck:
            assert ck._run is None
            ck.save(10, {"model": m}).wait()
            with torch.no_grad():
                m.weight.fill_(30.0)
            saving = ck.save(30, {"model": m})
            with torch.no_grad():
                m.weight.fill_(31.0)
            ck.snapshot(31, {"model": m}).wait()
            gate.set()
            saving.wait()
            run = ck._memory.catalog().get(31).commit_seq >> RUN_SHIFT
        with Checkpointer(str(url), **_kw(root)) as ck:
            assert ck.manifest(30).extras.get("_resilient_memory_run") == run == 1
            fresh = torch.nn.Linear(4, 4)
            assert ck.load({"model": fresh}) == 31 and fresh.weight.eq(31.0).all()


@pytest.mark.parametrize("committed_by", ["trainer", "persister", "flush", "sealed-flush"])
def test_an_uncounted_runs_commit_outranks_a_later_numbered_runs_snapshot_it_did_not_see(
    tmp_path, committed_by
):
    """(a review) Run 1 on node Y: snapshot 5.  Run 2 on node X: durable 10, snapshot 20.  Run 3
    back on Y, its count unwritable: its numbering, and so its durable commits' run, is run 1's
    (the newest Y's memory holds); it restores 10 and commits durable 15.  Run 4 on X restored
    run 2's 20 over 15 (a commit recording run 1 did not outrank run 2's snapshot); an uncounted
    run says so in its commits, and one numbered as another run than a snapshot's outranks it.
    (a later review) Whoever writes durable 15: the trainer (persister off), the persister (the
    save handed over), or the persister's flush of snapshot 15 at close: the persister's commits
    recorded run 1 without the flag, and run 4 still restored 20."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)

    def node(name: str, persister: bool = False, commit_every: int = 1) -> Checkpointer:
        kw = {**_kw(tmp_path / name), "persister": persister, "memory_commit_every": commit_every}
        return Checkpointer(str(url), **kw)

    def fill(v: float) -> None:
        with torch.no_grad():
            m.weight.fill_(v)

    with node("y") as ck:
        fill(5.0)
        ck.snapshot(5, {"model": m}).wait()
    with node("x") as ck:
        assert ck._run == 2
        fill(10.0)
        ck.save(10, {"model": m}).wait()
        fill(20.0)
        ck.snapshot(20, {"model": m}).wait()
    (url / MEMORY_RUNS_NAME).rename(tmp_path / "count")
    (url / MEMORY_RUNS_NAME).mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the count's)
        sealed = committed_by == "sealed-flush"  # (snapshot 15 sealed only: the flush seals it)
        with node("y", committed_by != "trainer", 0 if sealed else 1) as ck:
            assert ck._run is None and ck._memory._slots.job_run == 1
            assert ck.load({"model": m}) == 10
            fill(15.0)
            if committed_by.endswith("flush"):  # (durable 15: the goodbye's flush of snapshot 15)
                ck.snapshot(15, {"model": m}).wait()
                assert sorted(ck.memory_steps()) == ([5] if sealed else [5, 15])
            else:
                ck.save(15, {"model": m}).wait()
                assert (ck.persister_pid is not None) == (committed_by == "persister")
    (url / MEMORY_RUNS_NAME).rmdir()
    (tmp_path / "count").rename(url / MEMORY_RUNS_NAME)
    with node("x") as ck:
        fresh = torch.nn.Linear(4, 4)
        assert ck.load({"model": fresh}) == 15 and fresh.weight.eq(15.0).all()
        extras = ck.manifest(15).extras
        assert extras[RUN_KEY] == 1 and extras[RUN_UNCOUNTED_KEY] is True


def test_a_counted_run_and_a_run_without_the_tier_record_no_uncounted_flag(tmp_path):
    """Only an uncounted run's snapshots carry the flag (for the persister's commits of them):
    a counted run's snapshots and durable commits, through the persister or not, have none,
    and a run without the tier records no run at all."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    extras = {}
    with Checkpointer(str(url), **{**_kw(tmp_path / "m"), "persister": True}) as ck:
        ck.save(1, {"model": m}).wait()
        assert ck.persister_pid is not None  # (saved by the persister)
        extras[1] = ck.manifest(1).extras
        ck.snapshot(2, {"model": m}).wait()
        assert RUN_UNCOUNTED_KEY not in ck._memory.manifest(2).extras
    with Checkpointer(str(url), **_kw(tmp_path / "m")) as ck:  # (the trainer's own save)
        extras[2] = ck.manifest(2).extras  # (the goodbye's flush of snapshot 2)
        ck.save(3, {"model": m}).wait()
        extras[3] = ck.manifest(3).extras
    with Checkpointer(str(url), job_id="j") as ck:
        ck.save(4, {"model": m}).wait()
        extras[4] = ck.manifest(4).extras
    assert [e.get(RUN_KEY) for e in extras.values()] == [1, 1, 2, None]
    assert not any(RUN_UNCOUNTED_KEY in e for e in extras.values())


@pytest.mark.parametrize("flag", [True, "true", 1, 1.0, [True], {"v": True}, None, False], ids=repr)
def test_the_persister_records_the_uncounted_flag_only_where_a_snapshot_says_true(tmp_path, flag):
    """A snapshot's flag is copied into the persister's commit only where it is ``true`` and
    beside a run number (its commit_seq's); any other value, or one in another rank's values,
    records none, and the snapshot's own bookkeeping is never copied as a user value."""
    with Checkpointer(str(tmp_path / "ckpt"), **_kw(tmp_path / "m")) as ck:
        ck.snapshot(3, {"model": torch.nn.Linear(4, 4), "lr": 0.5}).wait()
        snap = ck._memory.manifest(3)
    hostile = {
        RUN_UNCOUNTED_KEY: flag,
        RUN_KEY: 7,
        PARENT_KEY: {"step": 1, "commit_seq": 1, "child_commit_seq": 9},
    }
    snap = dataclasses.replace(
        snap,
        extras={**snap.extras, **hostile},
        rank_extras={1: {RUN_UNCOUNTED_KEY: True, "lr": 0.25}},
    )
    names = {f: f"new-{f}" for f in snap.files}
    for run in (1, 0):
        made = _promoted(
            dataclasses.replace(snap, commit_seq=(run << RUN_SHIFT) + 1), names, 1, 9, "j"
        )
        want = {"lr": 0.5, **({RUN_KEY: run} if run else {})}
        if run and flag is True:
            want[RUN_UNCOUNTED_KEY] = True
        assert made.extras == want
        assert made.rank_extras == {1: {"lr": 0.25}}
        assert user_extras(made.extras) == {"lr": 0.5}
        assert summary_of(made).uncounted is (run == 1 and flag is True)


def test_a_snapshot_taken_before_any_durable_commit_loses_to_a_later_run_without_the_tier(
    tmp_path,
):
    """Run 1 with the tier never committed durably (its snapshots' anchor is "": no durable
    commit known) and kept snapshot 20; run 2 of the same job without the tier started afresh
    (it cannot see memory) and committed 15; run 3 with the tier restored run 1's 20 over run 2's
    newer line.  A commit made without the tier now records the runs counted when it was made
    (RUNS_SEEN_KEY): one that had seen run 1 begin is newer than run 1's snapshots."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    kw = {"memory_root": str(tmp_path / "x"), "persister": False, "job_id": "j"}
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        _put(ck, m, 20, 20.0)
    with Checkpointer(str(url), job_id="j") as ck:  # the tier off: nothing durable to load
        assert ck.latest_step() is None
        _put(ck, m, 15, 15.0, durable=True)
        assert ck.manifest(15).extras[RUNS_SEEN_KEY] == 1
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        assert _restored(ck) == (15, 15.0)


def test_a_commit_without_the_tier_made_before_a_runs_snapshots_does_not_outrank_them(tmp_path):
    """The other order: durable 15 by a run without the tier, then a run with the tier that never
    loads (a fresh start at the URL) snapshots 20: its snapshot is the newer state, and a commit
    that counted no run (none had begun) is no sign against it."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    kw = {"memory_root": str(tmp_path / "x"), "persister": False, "job_id": "j"}
    with Checkpointer(str(url), job_id="j") as ck:  # the tier off, before any run with it
        _put(ck, m, 15, 15.0, durable=True)
        assert RUNS_SEEN_KEY not in ck.manifest(15).extras
    with Checkpointer(str(url), memory_every=1, **kw) as ck:  # never loads
        _put(ck, m, 20, 20.0)
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        assert _restored(ck) == (20, 20.0)


def test_a_lost_count_never_numbers_a_run_below_the_runs_a_commit_without_the_tier_saw(tmp_path):
    """Run 1 with the tier (node X) is counted; run 2 without it commits durable 15, which
    records having seen run 1 counted (RUNS_SEEN_KEY).  The count is lost.  Run 3 with the tier,
    on node Y (X sat it out), starts afresh at the URL (never loads) and snapshots 20: numbered
    from the newest durable commit's run alone (15 records none) it was run 1 again, and its
    snapshot 20, the newest state, was taken for run 1's and lost to 15."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    x, y = str(tmp_path / "x"), str(tmp_path / "y")

    def checkpointer(root: str) -> Checkpointer:
        return Checkpointer(str(url), memory_every=1, memory_root=root, persister=False, job_id="j")

    with checkpointer(x):
        pass
    with Checkpointer(str(url), job_id="j") as ck:  # the tier off
        ck.save(15, {"model": m}).wait()
        assert ck.manifest(15).extras[RUNS_SEEN_KEY] == 1
    (url / MEMORY_RUNS_NAME).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the lost count's warning)
        with checkpointer(y) as ck:  # never loads
            assert ck._run == 2
            _put(ck, m, 20, 20.0)
    with checkpointer(y) as ck:
        assert _restored(ck) == (20, 20.0)


@pytest.mark.parametrize("job", ["j", "k"])
def test_a_rollback_by_name_past_a_commit_without_the_tier_keeps_its_snapshots(tmp_path, job):
    """Durable 10 and 15 by a run without the tier (this job's, or another job's).  A run with
    the tier rolls back to 10 by name and snapshots 20, then stops.  Its snapshot is the newest
    state: 15, which it knew of when it rolled back (ANCHOR_EXACT_KEY), is on the branch it left,
    not a commit made since that did not see it."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    kw = {"memory_root": str(tmp_path / "x"), "persister": False, "job_id": "j"}
    with Checkpointer(str(url), job_id=job) as ck:  # the tier off
        for step in (10, 15):
            with torch.no_grad():
                m.weight.fill_(float(step))
            ck.save(step, {"model": m}).wait()
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        assert ck.load({"model": m}, step=10) == 10
        _put(ck, m, 20, 20.0)
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        assert _restored(ck) == (20, 20.0)


def _rollback_then_deleted_by_hand(
    tmp_path: Path, durable: tuple[int, int], snapshots: list[int], later: int, tier: bool
) -> Checkpointer:
    """Durable ``durable`` by a run without the tier; a run with it rolls back by name to the
    first and snapshots ``snapshots``; the second is deleted by hand; a later run (without the
    tier, or with it on a node that sat the other out) loads and commits ``later``.  Returns the
    checkpointer of the next run, back on the first node."""
    url, m = tmp_path / "ckpt", torch.nn.Linear(4, 4)
    kw = {"memory_root": str(tmp_path / "x"), "persister": False, "job_id": "j"}
    with Checkpointer(str(url), job_id="j") as ck:  # the tier off
        for step in durable:
            _put(ck, m, step, float(step), durable=True)
    with Checkpointer(str(url), memory_every=1, **kw) as ck:
        assert ck.load({"model": m}, step=durable[0]) == durable[0]
        for step in snapshots:
            _put(ck, m, step, float(step))
    shutil.rmtree(url / step_dir_name(durable[1]))  # (by hand)
    other = {**kw, "memory_root": str(tmp_path / "y"), "memory_every": 1} if tier else {}
    with Checkpointer(str(url), **{"job_id": "j", **other}) as ck:
        assert ck.load({"model": m}) == durable[0]
        _put(ck, m, later, float(later), durable=True)
    return Checkpointer(str(url), memory_every=1, **kw)


@pytest.mark.parametrize("tier", [False, True])
def test_a_snapshot_loses_to_a_later_commit_that_took_a_commit_order_it_knew_of(tmp_path, tier):
    """As above, and then 15, the branch the rollback left, is deleted by hand: the next commit
    takes the commit order past the newest one left (10's), at or below the newest the snapshot's
    job knew of (15's, ANCHOR_EXACT_KEY).  A later run (without the tier, or with it on a node
    that sat the other out) loads 10 and commits 12 without seeing snapshot 20: its line is the
    newer one, and 20 was restored over it (its commit_seq taken for one the job knew of)."""
    with _rollback_then_deleted_by_hand(tmp_path, (10, 15), [20], 12, tier) as ck:
        assert _restored(ck) == (12, 12.0)


def test_a_newer_line_loses_to_a_later_commit_that_took_a_commit_order_it_knew_of(tmp_path):
    """A rollback by name to 10 while 20 is committed, snapshots 11 and 12, a stop: 12 is the
    job's newest state (a newer line).  Then 20 is deleted by hand, and a later run without the
    tier loads 10 and commits 14, whose commit_seq is 20's again (the newest its job knew of,
    ANCHOR_EXACT_KEY): snapshot 12 was still taken for the newer line and restored over 14."""
    with _rollback_then_deleted_by_hand(tmp_path, (10, 20), [11, 12], 14, False) as ck:
        assert _restored(ck) == (14, 14.0)
