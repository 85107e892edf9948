"""The memory tier: snapshots in the node's host memory, in the checkpoint format, read by the same
verified reader; a damaged or missing snapshot falls back to durable storage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer, CheckpointNotFoundError, MemoryTierError, ResilientError, Run
from resilient.checkpoint.snapshots import JOB_FILE, memory_place
from tests.dist import run_distributed


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4)


def _bump(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_snapshot_cadence_and_restore_from_memory(tmp_path, memory_root):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=2) as ck:
        assert ck.memory is not None and Path(ck.memory.dir).parent == memory_root
        ck.save(2, {"model": m}).wait()
        assert ck.snapshot(3, {"model": m}) is None  # not a multiple of memory_every
        _bump(m, 1.0)
        ck.snapshot(4, {"model": m}).wait()
        want = {k: v.clone() for k, v in m.state_dict().items()}
        _bump(m, 5.0)
        # a durable save is a snapshot of its step promoted by the persister: both tiers hold 2
        assert ck.memory_steps() == [4, 2] and ck.steps() == [2]
        assert ck.load({"model": m}) == 4
        assert ck.last_load.source == "memory"
        assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
        # a snapshot is a checkpoint in the same format: the same verifier reads it
        assert ck.snapshots.verify(4).ok
        # an explicit step in both tiers loads from memory; once memory lacks it, from durable
        assert ck.load({"model": m}, step=2) == 2 and ck.last_load.source == "memory"
        shutil.rmtree(Path(ck.memory.steps) / "step_00000002")
        assert ck.load({"model": m}, step=2) == 2 and ck.last_load.source == "durable"


def test_two_snapshots_are_kept(tmp_path):
    m = _model()
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1) as ck:
        for step in range(1, 6):
            ck.snapshot(step, {"model": m}).wait()
        ck.wait_snapshot()
        assert ck.memory_steps() == [5, 4]
        names = sorted(n for n in os.listdir(ck.memory.steps) if n.startswith("step_"))
        assert names == ["step_00000004", "step_00000005"]


def test_corrupt_snapshot_falls_back_through_the_tiers(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1) as ck:
        ck.save(1, {"model": m}).wait()
        _bump(m, 1.0)
        ck.snapshot(2, {"model": m}).wait()
        want2 = {k: v.clone() for k, v in m.state_dict().items()}
        _bump(m, 1.0)
        ck.snapshot(3, {"model": m}).wait()
        step3 = Path(ck.memory.steps) / "step_00000003"
        _flip(next(step3.glob("rank_*.safetensors")))
        _bump(m, 9.0)
        with pytest.warns(
            UserWarning, match=r"checksum mismatch.*falling back to step 2 \(memory\)"
        ):
            assert ck.load({"model": m}) == 2
        assert ck.last_load.source == "memory" and ck.last_load.skipped_steps == [3]
        assert all(torch.equal(m.state_dict()[k], want2[k]) for k in want2)
        # both snapshots damaged: durable storage, even without fallback=True
        _flip(next((Path(ck.memory.steps) / "step_00000002").glob("rank_*.safetensors")))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ck.load({"model": m}, fallback=False) == 1
        assert ck.last_load.source == "durable" and ck.last_load.skipped_steps == [3, 2]


def test_missing_memory_falls_back_to_durable(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1) as ck:
        ck.save(1, {"model": m}).wait()
        ck.snapshot(2, {"model": m}).wait()
        shutil.rmtree(ck.memory.dir)  # the node's memory was dropped (a reboot)
        assert ck.memory_steps() == []
        assert ck.load({"model": m}) == 1 and ck.last_load.source == "durable"


def test_jobs_never_touch_each_others_snapshots(tmp_path, memory_root):
    m = _model()
    a = Checkpointer(str(tmp_path / "a"), memory_every=1)
    b = Checkpointer(str(tmp_path / "b"), memory_every=1)
    a.snapshot(1, {"model": m}).wait()
    b.snapshot(7, {"model": m}).wait()
    assert a.memory.dir != b.memory.dir
    assert a.memory_steps() == [1] and b.memory_steps() == [7]
    a.release_memory()
    assert not os.path.exists(a.memory.dir) and b.memory_steps() == [7]
    b.close()
    # a directory that says it belongs to another URL is refused, not adopted or removed
    place = memory_place(str(tmp_path / "c"))
    os.makedirs(place.dir)
    Path(place.dir, JOB_FILE).write_text(json.dumps({"url": "s3://someone/else"}))
    with pytest.raises(MemoryTierError, match="belongs to checkpoint URL 's3://someone/else'"):
        Checkpointer(str(tmp_path / "c"), memory_every=1)
    assert json.loads(Path(place.dir, JOB_FILE).read_text())["url"] == "s3://someone/else"


def test_room_is_checked_before_training(tmp_path, monkeypatch):
    m = torch.nn.Linear(256, 256)  # 257 KiB of state
    ck = Checkpointer(str(tmp_path / "ckpt"), memory_every=1)
    assert ck.check_memory_room({"model": m}) == 4 * (256 * 256 + 256) * 4
    monkeypatch.setenv("RESILIENT_MEMORY_LIMIT", "100K")
    with pytest.raises(MemoryTierError, match=r"needs 1\.0 MiB .* RESILIENT_MEMORY_LIMIT=100K"):
        ck.check_memory_room({"model": m})
    monkeypatch.setenv("RESILIENT_MEMORY_LIMIT", "lots")
    with pytest.raises(MemoryTierError, match="'lots' is not a size"):
        ck.check_memory_room({"model": m})
    ck.close()


def test_a_start_refused_for_room_leaves_no_job_directory_but_keeps_snapshots(
    tmp_path, monkeypatch
):
    """(a review) The job's directory made at claim stayed after the refusal: one per refused
    start, reclaimed only by a run of that job that got going."""
    root, m = tmp_path / "mem", torch.nn.Linear(256, 256)
    monkeypatch.setenv("RESILIENT_MEMORY_LIMIT", "100K")
    ck = Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_root=str(root))
    with pytest.raises(MemoryTierError, match="needs 1.0 MiB"):
        ck.check_memory_room({"model": m})
    ck.close()
    assert list(root.iterdir()) == []
    monkeypatch.delenv("RESILIENT_MEMORY_LIMIT")
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_root=str(root)) as ck:
        ck.snapshot(1, {"model": m}).wait()  # a run that got going, then crashed
        ck.close_memory()
    monkeypatch.setenv("RESILIENT_MEMORY_LIMIT", "100K")
    ck = Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_root=str(root))
    with pytest.raises(MemoryTierError, match="needs 1.0 MiB"):
        ck.check_memory_room({"model": m})
    ck.close()
    monkeypatch.delenv("RESILIENT_MEMORY_LIMIT")
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, memory_root=str(root)) as ck:
        assert ck.memory_steps() == [1]  # the snapshot is still there to restore


def test_options_are_checked(tmp_path):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="memory_every must be None"):
            Checkpointer(str(tmp_path / "x"), memory_every=bad)
        with pytest.raises(ValueError, match="memory_every must be None"):
            Run(str(tmp_path / "x"), memory_every=bad, detect=False)
    with Checkpointer(str(tmp_path / "x")) as ck, pytest.raises(ResilientError, match="no memory"):
        ck.snapshot(1, {"model": _model()})


def _train(run: Run, model: torch.nn.Module, total: int, crash_at: int | None = None) -> None:
    for step in run.steps(total):
        if step == crash_at:
            raise RuntimeError("crash")
        _bump(model, float(step))


def test_run_restores_from_memory_and_releases_it_at_the_end(tmp_path):
    url = str(tmp_path / "ckpt")
    model = _model()
    with pytest.raises(RuntimeError, match="crash"):
        with Run(url, save_every=5, memory_every=1, detect=False) as run:
            run.track(model=model)
            _train(run, model, 20, crash_at=8)
    place = memory_place(url)
    assert os.path.isdir(place.dir)  # a crashed run leaves its snapshots for the next one
    want = _model()
    for step in range(1, 8):
        _bump(want, float(step))
    fresh = _model(seed=1)
    with Run(url, save_every=5, memory_every=1, detect=False) as run:
        assert run.track(model=fresh) == 7  # memory: step 7; durable storage holds step 5
        assert run.checkpointer.last_load.source == "memory"
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.state_dict().items())
        events = [json.loads(x) for x in Path(run.events.path).read_text().splitlines()]
        restore = [e for e in events if e["event"] == "restore"][-1]
        assert restore["step"] == 7 and restore["source"] == "memory"
        _train(run, fresh, 12)
        assert run.checkpointer.steps()[-1] == 12  # the final step is durable ...
    assert not os.path.exists(place.dir)  # ... and the memory is given back


def test_a_second_loop_of_the_same_run_keeps_the_tier(tmp_path):
    """(a review) The first steps() loop gave the node's memory back, so every snapshot of a
    second loop failed (its checkpointer closed), a warning each step: a second loop makes a new
    checkpointer, as a restart would, and its snapshots continue from the durable final step."""
    url, model = str(tmp_path / "ckpt"), _model()
    place = memory_place(url)
    held = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed snapshot warns
        with Run(url, save_every=100, memory_every=1, detect=False) as run:
            run.track(model=model)
            _train(run, model, 3)
            assert run.checkpointer.steps() == [3] and not os.path.exists(place.dir)
            for step in run.steps(6):
                _bump(model, float(step))
                if step == 6:
                    run._join_snapshot()
                    held = sorted(run.checkpointer.memory_steps())
            assert run.checkpointer.steps() == [3, 6]
    assert held == [4, 5]
    assert not os.path.exists(place.dir)  # given back at the end of the second loop too
    want, fresh = _model(), _model(seed=1)
    for step in range(1, 7):
        _bump(want, float(step))
    with Run(url, memory_every=1, detect=False) as run:
        assert run.track(model=fresh) == 6
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.state_dict().items())


def test_a_crash_in_a_second_loop_restores_its_snapshots(tmp_path):
    """(a review of the fix above) The second loop's checkpointer had a job id of its own (a
    process's is new with every checkpointer) and no anchor: its snapshots were "taken before
    any durable commit" while durable storage held "another job's" step 3, so a restart fell
    back to durable step 3, losing steps 4 and 5."""
    url, model = str(tmp_path / "ckpt"), _model()
    with pytest.raises(RuntimeError, match="crash"):
        with Run(url, save_every=100, memory_every=1, detect=False) as run:
            run.track(model=model)
            _train(run, model, 3)
            _train(run, model, 9, crash_at=6)
    want, fresh = _model(), _model(seed=1)
    for step in range(1, 6):
        _bump(want, float(step))
    with Run(url, memory_every=1, detect=False) as run:
        assert run.track(model=fresh) == 5 and run.checkpointer.last_load.source == "memory"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.state_dict().items())


def _two_loops_then_rank_1_fails(rank: int, world: int, url: str, root: str) -> tuple:
    model = torch.nn.Linear(4, 2)
    try:
        with Run(url, save_every=100, memory_every=1, memory_root=root, detect=False) as run:
            run.track(model=model)
            for _ in run.steps(2):
                pass
            for _ in run.steps(4):
                pass
            if rank == 1:
                raise RuntimeError("the evaluation after the loop failed")
    except RuntimeError as e:
        if rank == 1:
            time.sleep(2)  # the process lives on for a while (its own clean-up)
        return ("raised", str(e)[:200])
    return ("ok", run.checkpointer.steps())


def test_a_rank_failing_after_the_loops_does_not_fail_the_others(tmp_path):
    """(a review of the fix above) The memory given back when the run closed, after a barrier
    of the ranks that closed cleanly: one that failed after the loop never came to it, and the
    healthy ranks failed ("Connection closed by peer") once it exited."""
    root = tmp_path / "mem"
    out = run_distributed(_two_loops_then_rank_1_fails, 2, str(tmp_path / "ckpt"), str(root))
    assert out[0] == ("ok", [2, 4]), out
    assert out[1] == ("raised", "the evaluation after the loop failed"), out
    assert list(root.iterdir()) == []


def _uneven_nodes(rank: int, world: int, url: str, roots: list[str]) -> tuple:
    # Two "nodes" (memory roots) with two ranks and one: peer replicas pair the ranks of
    # neighbouring nodes, so the tier turns itself off, with a warning (even nodes: see
    # test_memory_nodes.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = Checkpointer(url, memory_every=1, memory_root=roots[0 if rank < 2 else 1])
    m = _model()
    ck.save(1, {"model": m}).wait()
    off = ck.memory is None and ck.snapshots is None
    ck.close()
    return off, [str(w.message) for w in caught]


def test_nodes_of_different_sizes_turn_the_tier_off(tmp_path):
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    results = run_distributed(_uneven_nodes, 3, str(tmp_path / "ckpt"), roots)
    for off, messages in results:
        assert off
        assert any("different numbers of ranks" in m and "the tier is off" in m for m in messages)
    assert not any(Path(r).exists() for r in roots)


def _agree_on_fallback(rank: int, world: int, url: str) -> tuple:
    m = _model()
    ck = Checkpointer(url, memory_every=1)
    ck.save(1, {"model": m}).wait()
    _bump(m, 1.0)
    ck.snapshot(2, {"model": m}).wait()
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:  # only rank 1's file is damaged: every rank must load step 1 together
        step2 = Path(ck.memory.steps) / "step_00000002"
        _flip(step2 / "rank_00001.safetensors")
    dist.barrier()
    _bump(m, 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ck.load({"model": m})
    source = ck.last_load.source
    ck.snapshot(2, {"model": m}).wait()  # the next snapshot of the step replaces the damaged one
    dist.barrier()
    again = ck.load({"model": m})
    ck.close()
    return got, source, again, ck.last_load.source


def test_ranks_agree_when_one_rank_finds_its_snapshot_damaged(tmp_path):
    # a 2-rank Linear has replicated parameters: rank 1 writes a part of the state too
    results = run_distributed(_agree_on_fallback, 2, str(tmp_path / "ckpt"))
    assert results[0] == results[1]
    # step 1 was saved durably through a snapshot of it: the memory copy of step 1 serves
    assert results[0] == (1, "memory", 2, "memory")


def _snapshot_and_save_at_once(rank: int, world: int, url: str) -> list[int]:
    m = _model()
    ck = Checkpointer(url, memory_every=1, commit_timeout_s=30)
    for step in range(1, 5):
        _bump(m, 1.0)
        snap = ck.snapshot(step, {"model": m})  # both commits in flight on both ranks
        save = ck.save(step, {"model": m})
        snap.wait()
        save.wait()
    steps = ck.memory_steps()
    ck.close()
    return steps


def test_a_snapshot_and_a_save_in_flight_together_both_commit(tmp_path):
    # the two commit handshakes run on two threads of every rank at once; on one store client
    # each waited inside the other until the commit timeout
    results = run_distributed(_snapshot_and_save_at_once, 2, str(tmp_path / "ckpt"), timeout_s=150)
    assert results == [[4, 3], [4, 3]]


def _weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_a_snapshot_from_an_abandoned_line_is_never_restored(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    # persister=False: a job whose persister died with it (nothing flushed the newest snapshot)
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        ck.save(30, {"model": m}).wait()
        at30 = _weights(m)
        _bump(m, 1.0)
        ck.save(40, {"model": m}).wait()
        _bump(m, 1.0)
        ck.snapshot(100, {"model": m}).wait()  # descends from step 40
    with Checkpointer(url, memory_every=1) as ck:  # a user rolls back to 30 and trains on
        assert ck.load({"model": m}, step=30) == 30 and ck.last_load.source == "durable"
        _bump(m, -5.0)
        ck.save(35, {"model": m}).wait()
        want = _weights(m)
    with Checkpointer(url, memory_every=1) as ck:
        _bump(m, 9.0)
        # the newest durable commit is 35 (on the line from 30); snapshot 100 descends from 40,
        # which is on the abandoned branch: not restored, although its step is higher
        assert ck.load({"model": m}) == 35  # (from memory: the save of 35 went through it)
        assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
        assert at30  # (the rollback point itself stays loadable)


def test_a_snapshot_is_not_restored_when_durable_storage_moved_on(tmp_path):
    import shutil

    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1, persister=False) as ck:  # nothing flushes snapshot 31
        ck.save(10, {"model": m}).wait()
        _bump(m, 1.0)
        ck.save(30, {"model": m}).wait()
        _bump(m, 1.0)
        ck.snapshot(31, {"model": m}).wait()
    # the user deletes the newer durable steps: the snapshot's durable commit (30) is gone
    shutil.rmtree(Path(url) / "step_00000030")
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.load({"model": m}) == 10 and ck.last_load.source == "durable"
    # the user starts afresh at the same URL: nothing is restored at all
    shutil.rmtree(url)
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.memory_steps() == [31]
        with pytest.raises(CheckpointNotFoundError):
            ck.load({"model": m})
    with Run(url, memory_every=1, detect=False) as run:
        assert run.track(model=m) == 0


def test_a_snapshot_taken_before_any_durable_commit_is_restored(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1) as ck:
        _bump(m, 2.0)
        ck.snapshot(3, {"model": m}).wait()  # the job died before its first durable save
        want = _weights(m)
    with Checkpointer(url, memory_every=1) as ck:
        _bump(m, 1.0)
        assert ck.load({"model": m}) == 3 and ck.last_load.source == "memory"
        assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
        # and the next snapshot descends from the same (no) durable commit
        ck.snapshot(4, {"model": m}).wait()
        ck.save(4, {"model": m}).wait()
        ck.snapshot(5, {"model": m}).wait()
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.load({"model": m}) == 5 and ck.last_load.source == "memory"


def test_a_relative_url_is_a_job_per_directory(tmp_path, monkeypatch):
    m = _model()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with Checkpointer("ckpt", memory_every=1) as ck:
        ck.snapshot(5, {"model": m}).wait()
    monkeypatch.chdir(tmp_path / "b")
    with Checkpointer("ckpt", memory_every=1) as ck:
        assert ck.memory_steps() == []
        with pytest.raises(CheckpointNotFoundError):
            ck.load({"model": m})


def test_directories_that_are_not_the_jobs_own_are_refused(tmp_path, memory_root):
    url = str(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    place = memory_place(url)
    os.makedirs(memory_root)
    os.symlink(elsewhere, place.dir)  # the job's directory is a link
    with pytest.raises(MemoryTierError, match="is a symbolic link"):
        Checkpointer(url, memory_every=1)
    place.release()  # never follows the link
    assert elsewhere.exists() and os.path.islink(place.dir)
    os.unlink(place.dir)
    # steps/ is a link (for example to the durable checkpoints, which retention would prune)
    os.mkdir(place.dir, 0o700)
    os.symlink(elsewhere, place.steps)
    with pytest.raises(MemoryTierError, match="snapshot directory .* is a symbolic link"):
        Checkpointer(url, memory_every=1)
    os.unlink(place.steps)
    # staging/ is a link: rank files are made, replaced and removed there by name
    victim = elsewhere / "rank_00000.0.safetensors"
    victim.write_bytes(b"someone else's")
    os.symlink(elsewhere, place.staging)
    with pytest.raises(MemoryTierError, match="staging directory .* is a symbolic link"):
        Checkpointer(url, memory_every=1)
    assert (
        sorted(os.listdir(elsewhere)) == [victim.name] and victim.read_bytes() == b"someone else's"
    )
    os.unlink(place.staging)
    os.rmdir(place.steps)  # (made before staging/ was refused)
    Path(place.steps).write_text("not a directory")
    with pytest.raises(MemoryTierError, match="is not a directory"):
        Checkpointer(url, memory_every=1)
    os.unlink(place.steps)
    os.chmod(place.dir, 0o777)
    with pytest.raises(MemoryTierError, match="writable by others"):
        Checkpointer(url, memory_every=1)
    os.chmod(place.dir, 0o700)
    for record in ("[1, 2]", "{not json", "[" * 100000, json.dumps({"url": 5})):
        Path(place.dir, JOB_FILE).write_text(record)
        with pytest.raises(MemoryTierError, match="belongs to checkpoint URL '\\(not a job record"):
            Checkpointer(url, memory_every=1)
        assert Path(place.dir, JOB_FILE).read_text() == record  # left as it was


@pytest.mark.parametrize("limit", ["inf", "1e400", "-5", "", "G"])
def test_a_bad_memory_limit_is_a_named_error(tmp_path, monkeypatch, limit):
    ck = Checkpointer(str(tmp_path / "ckpt"), memory_every=1)
    monkeypatch.setenv("RESILIENT_MEMORY_LIMIT", limit)
    if limit == "":
        assert ck.check_memory_room({"model": _model()}) > 0  # unset
    else:
        with pytest.raises(MemoryTierError, match="is not a size"):
            ck.check_memory_room({"model": _model()})
    ck.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_state_created_before_the_first_step_does_not_change_training(make):
    # the memory tier measures the state (and may snapshot it) before the first step; an
    # optimizer whose state that creates must train exactly as one left alone
    from resilient.checkpoint.state import init_optimizer_state

    def train(create: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = torch.nn.Linear(6, 3)
        opt = make(m.parameters())
        if create:
            assert init_optimizer_state(opt)
        for _ in range(4):
            opt.zero_grad()
            m(torch.randn(5, 6)).pow(2).sum().backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))


def test_a_snapshot_taken_while_the_first_durable_save_was_in_flight_is_restored(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1) as ck:
        ck.snapshot(5, {"model": m}).wait()  # taken before its job's first durable commit ...
        ck.save(5, {"model": m}).wait()  # ... which committed right after: its own commit
    # (a new Checkpointer is a new job in a single process, like a rerun)
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.load({"model": m}) == 5 and ck.last_load.source == "memory"


def test_a_snapshot_taken_before_another_jobs_durable_commits_is_not_restored(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, memory_every=1) as ck:  # job A: never saved durably, crashed
        ck.snapshot(9, {"model": m}).wait()
    with Checkpointer(url) as other:  # job B (another job id) starts afresh at the URL
        other.save(2, {"model": m}).wait()
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.load({"model": m}) == 2 and ck.last_load.source == "durable"


def test_reruns_in_a_chain_keep_restoring_from_memory(tmp_path):
    # each Run in a single process is a new job; A dies right after its first durable save, B
    # resumes from it and dies three steps later: C must resume from B's newest snapshot
    url = str(tmp_path / "ckpt")
    model = _model()
    for crash_at, resumes in ((6, 0), (9, 5)):
        with pytest.raises(RuntimeError, match="crash"):
            with Run(url, save_every=5, memory_every=1, detect=False) as run:
                assert run.track(model=model) == resumes
                _train(run, model, 20, crash_at=crash_at)
    with Run(url, save_every=5, memory_every=1, detect=False) as run:
        assert run.track(model=model) == 8
        assert run.checkpointer.last_load.source == "memory"


def test_a_snapshot_whose_durable_commit_retention_pruned_is_restored(tmp_path):
    url = str(tmp_path / "ckpt")
    m = _model()
    with Checkpointer(url, keep_last=1, memory_every=1) as ck:
        ck.save(10, {"model": m}).wait()
        ck.snapshot(11, {"model": m}).wait()
        ck.snapshot(12, {"model": m}).wait()  # descends from 10 (the save of 12 not yet done)
        ck.save(12, {"model": m}).wait()  # keep_last=1: step 10 is pruned
        assert ck.steps() == [12]
    with Checkpointer(url, memory_every=1) as ck:
        assert ck.load({"model": m}) == 12 and ck.last_load.source == "memory"


def test_unrestorable_snapshots_and_nothing_durable_start_afresh_with_a_warning(tmp_path):
    url = str(tmp_path / "ckpt")
    with Checkpointer(url, memory_every=1, persister=False) as ck:  # nothing flushes it
        ck.snapshot(4, {"model": _model()}).wait()
    # the model changed shape since: the snapshot cannot be restored, and there is nothing else
    with pytest.warns(UserWarning, match="cannot be restored.*Starting from step 0"):
        with Run(url, memory_every=1, detect=False) as run:
            assert run.track(model=torch.nn.Linear(3, 2)) == 0


def test_a_memory_root_others_could_swap_is_refused(tmp_path, monkeypatch):
    open_root = tmp_path / "open"
    open_root.mkdir()
    os.chmod(open_root, 0o777)  # writable by all, no sticky bit
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(open_root))
    with pytest.raises(MemoryTierError, match="writable by others without the sticky bit"):
        Checkpointer(str(tmp_path / "ckpt"), memory_every=1)
    os.chmod(open_root, 0o1777)  # as /dev/shm: fine
    Checkpointer(str(tmp_path / "ckpt"), memory_every=1).close()
    link = tmp_path / "link"
    os.symlink(open_root, link)
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(link))
    with pytest.raises(MemoryTierError, match="root .* is a symbolic link"):
        Checkpointer(str(tmp_path / "ckpt2"), memory_every=1)


def test_a_memory_root_of_another_user_is_refused(tmp_path, monkeypatch):
    """The owner of a directory may rename what is in it, sticky bit or not: another user who
    made /dev/shm/resilient-<uid> first (mode 1777) could swap this job's directory for a link
    once it was claimed, and have its snapshots' files made and removed where the link points.
    (Root's own directories, such as /dev/shm itself, are trusted; so is a sticky one whose
    owner a user namespace does not map, as a rootless container sees the host's /dev/shm.)"""
    from resilient.checkpoint.snapshots import _overflow_uid

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o1777)
    owner = {"uid": os.getuid() + 4242}
    real_lstat = os.lstat

    def lstat(path, *a, **kw):  # (chown needs root: the root's owner as lstat says it)
        st = real_lstat(path, *a, **kw)
        if os.path.abspath(path) == str(theirs):
            fields = list(st)
            fields[4] = owner["uid"]  # st_uid
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(theirs))
    with pytest.raises(MemoryTierError, match=f"root .* belongs to uid {owner['uid']}"):
        Checkpointer(str(tmp_path / "ckpt"), memory_every=1)
    assert os.listdir(theirs) == []
    owner["uid"] = _overflow_uid()  # (an owner the namespace does not map)
    Checkpointer(str(tmp_path / "ckpt"), memory_every=1).close()
    os.chmod(theirs, 0o777)  # ... but not without the sticky bit
    with pytest.raises(MemoryTierError, match="root .* belongs to uid"):
        Checkpointer(str(tmp_path / "ckpt"), memory_every=1)


def test_after_the_first_snapshot_of_a_shape_only_what_changes_is_checked(tmp_path, monkeypatch):
    """A memory snapshot's manifest is checked in full the way readers check it once per shape
    (layout, tensors, files, chunks); later ones of that shape get the check of the parts that
    change, which still refuses what a reader would refuse there."""
    import resilient.checkpoint.writer as writer

    short = []
    real = writer.check_variable_parts
    monkeypatch.setattr(writer, "check_variable_parts", lambda *a: (short.append(1), real(*a)))
    deep: list = []
    for _ in range(80):  # deeper than the format allows (64)
        deep = [deep]
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        for step in (1, 2, 3):
            ck.snapshot(step, {"w": torch.full((4,), float(step)), "meta": [step]}).wait()
        assert len(short) == 2  # steps 2 and 3
        h = ck.snapshot(4, {"w": torch.ones(4), "meta": deep})
        with pytest.raises(ResilientError, match=r"readers would refuse it.*nests deeper than 64"):
            h.wait()
        assert len(short) == 3
        # another shape: the full check again
        ck.snapshot(5, {"w": torch.ones(8), "meta": [5]}).wait()
        assert len(short) == 3
        assert sorted(ck.memory_steps()) == [3, 5]
        m = {"w": torch.zeros(8), "meta": []}
        assert ck.load(m) == 5 and m["meta"] == [5]


def test_the_manifest_template_writes_the_same_bytes_as_the_manifest_itself(tmp_path):
    """The memory tier writes each snapshot's manifest by filling one shape's template in; the
    bytes are those of manifest_to_bytes whatever changes (checksums, numbers, values), and
    what the template cannot take goes the usual way."""
    import dataclasses

    from resilient.checkpoint.format import ManifestEncoder, manifest_to_bytes

    with Checkpointer(str(tmp_path / "ckpt"), block_bytes=4096) as ck:
        state = {"a": torch.randn(3000), "b.c": torch.arange(7), "e": torch.zeros(0)}
        ck.save(1, {**state, "meta": {"lr": 0.5, "names": ["x", "é"]}}).wait()
        m = ck.manifest(1)
    a = m.tensors["a"]
    assert len(a.chunks[0].checksums) == 3
    split = (  # two chunks for one tensor, and a chunk with no checksums
        dataclasses.replace(a.chunks[0], sizes=(1500,), checksums=(1, 2)),
        dataclasses.replace(a.chunks[0], offsets=(1500,), sizes=(1500,), checksums=()),
    )
    m = dataclasses.replace(m, tensors={**m.tensors, "a": dataclasses.replace(a, chunks=split)})
    enc = ManifestEncoder()
    shape = ("one shape",)

    def same(man, shape=shape):
        assert enc.encode(man, shape) == manifest_to_bytes(man)

    same(m)
    for i in range(3):  # the template of this shape, filled in
        chunks = tuple(dataclasses.replace(c, checksums=(i, 2**32 - 1)) for c in split)
        same(
            dataclasses.replace(
                m,
                step=10 + i,
                commit_seq=i,
                created_unix_s=1.5 * i,
                extras={**m.extras, "meta.lr": i / 3},
                rank_extras={1: {"x": [i]}, 0: {"y": None}},
                tensors={**m.tensors, "a": dataclasses.replace(a, chunks=chunks)},
            )
        )
    assert enc._shape == shape
    # a checksum that is not a plain int: the usual way (readers would refuse it, and do)
    bad = dataclasses.replace(split[0], checksums=(True, 3))
    same(dataclasses.replace(m, tensors={**m.tensors, "a": dataclasses.replace(a, chunks=(bad,))}))
    # a tensor whose name reads like the mark: no template, the usual way
    marked = {**m.tensors, ManifestEncoder._MARK: m.tensors["b.c"]}
    same(dataclasses.replace(m, tensors=marked), ("another shape",))
    assert enc._shape is None
    same(m, None)


# A job of the tier that seals steps 1 and 2 (their files at the staging names, with their
# records), says so, and snapshots step 3 once told to: the first of two jobs on one URL.
_LIVE_JOB = """
import sys, torch
from resilient import Checkpointer
m = torch.nn.Linear(64, 64)
ck = Checkpointer(sys.argv[1], memory_every=1, memory_commit_every=0, persister=False)
for step in (1, 2):
    with torch.no_grad():
        m.weight.fill_(float(step))
    ck.snapshot(step, {"model": m})
print("sealed", flush=True)
sys.stdin.readline()
with torch.no_grad():
    m.weight.fill_(3.0)
ck.snapshot(3, {"model": m})
ck.close_memory()
print("done", flush=True)
"""


def _listing(d: Path) -> dict[str, tuple[int, int, int]]:
    return {
        str(p.relative_to(d)): (p.lstat().st_ino, p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
    }


def test_a_second_job_on_a_live_jobs_memory_is_refused_and_touches_none_of_its_files(tmp_path):
    """(a review) A second job of the same URL on the same memory root, started while the first
    runs, got going: its first snapshot removed the live job's staging files ("a crashed run's",
    it took them for) and its close the rest, and the live job's sealed step was gone."""
    url = str(tmp_path / "ckpt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    live = subprocess.Popen(
        [sys.executable, "-c", _LIVE_JOB, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert live.stdout.readline().strip() == "sealed"
        place = memory_place(url)
        before = _listing(Path(place.dir))
        assert "staging/rank_00000.step_2.json" in before
        m = torch.nn.Linear(64, 64)
        with pytest.raises(
            MemoryTierError,
            match=r"rank 0 of the memory tier's directory .* in "
            r"use by another live process \(pid \d+",
        ):
            second = Checkpointer(url, memory_every=1, memory_commit_every=0, persister=False)
            second.snapshot(1, {"model": m})  # what a second job that got going does first
            second.close()
        assert _listing(Path(place.dir)) == before  # nothing read in place, replaced or removed
        live.stdin.write("go\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "done"
        assert live.wait(timeout=60) == 0
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    # the first job's newest steps are whole: the next run restores its step 3
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        fresh = torch.nn.Linear(64, 64)
        assert ck.load({"model": fresh}) == 3 and fresh.weight.eq(3.0).all()


# A rank of the tier that forks a child (as a DataLoader's worker is forked) once its
# checkpointer holds the rank's lock, says the child's pid, and dies; the child lives on.
_FORKING_RANK = """
import os, signal, sys, time, torch
from resilient import Checkpointer
ck = Checkpointer(sys.argv[1], memory_every=1, persister=False)
ck.snapshot(1, {"model": torch.nn.Linear(4, 4)})
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_the_rank_forked_does_not_hold_its_lock_after_it(tmp_path):
    """A child forked after the checkpointer was made shared the rank lock's open file: alive
    after the rank died, it held the lock, and the rank's restart was refused as a second live
    process of that rank."""
    url = str(tmp_path / "ckpt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    rank = subprocess.Popen(
        [sys.executable, "-c", _FORKING_RANK, url], stdout=subprocess.PIPE, text=True, env=env
    )
    child = int(rank.stdout.readline())
    try:
        assert rank.wait(timeout=60) == -9
        os.kill(child, 0)  # (alive: a sleep of 120 s)
        with Checkpointer(url, memory_every=1, persister=False) as ck:  # the rank's restart
            assert ck.load({"model": torch.nn.Linear(4, 4)}) == 1
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("planted", ["symlink", "directory", "fifo"])
def test_a_rank_lock_that_is_not_a_file_of_the_jobs_is_refused(tmp_path, planted):
    url = str(tmp_path / "ckpt")
    place = memory_place(url)
    os.makedirs(place.staging, mode=0o700)
    lock = Path(place.staging, "rank_00000.lock")
    victim = tmp_path / "victim"
    victim.write_text("someone else's")
    if planted == "symlink":
        os.symlink(victim, lock)
    elif planted == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(
        MemoryTierError,
        match=r"rank 0's lock .*rank_00000\.lock of the memory "
        r"tier",
    ):
        Checkpointer(url, memory_every=1)
    assert victim.read_text() == "someone else's" and os.path.lexists(lock)


def test_a_checkpointer_of_the_url_left_open_in_this_process_is_named(tmp_path):
    url, m = str(tmp_path / "ckpt"), torch.nn.Linear(8, 8)
    first = Checkpointer(url, memory_every=1, persister=False)
    first.snapshot(1, {"model": m}).wait()
    with pytest.raises(
        MemoryTierError,
        match=r"another checkpointer of this process .*, still referenced .* not "
        r"closed; expected none: close it",
    ):
        Checkpointer(url, memory_every=1, persister=False)
    del first  # dropped unclosed: its rank lets go once it is collected
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        assert ck.memory_steps() == [1]


def test_a_new_checkpointer_waits_for_a_slow_letting_go_of_a_dropped_one(tmp_path, monkeypatch):
    """A checkpointer dropped unclosed is let go of by a thread of its own: a new one of the URL
    waits for that (its rank's lock), however long it takes (on a busy machine, past the 3 s a
    lock held by another live checkpointer is waited for; the new one was refused then)."""
    url, m = str(tmp_path / "ckpt"), torch.nn.Linear(8, 8)
    let_go = Checkpointer._let_go

    def slow(self):
        time.sleep(4)  # (past the lock's own 3 s wait)
        let_go(self)

    monkeypatch.setattr(Checkpointer, "_let_go", slow)
    _snapshot_drop_and_open_again(url, m)


def test_a_new_checkpointer_still_waits_for_the_lock_after_a_slow_reaper(tmp_path, monkeypatch):
    """The reaper's turn can come late (a busy machine) and a dropped checkpointer's rank lock go
    a moment after it (its last snapshot was still being committed: the tier lets go on a
    thread of its own once that is over): the lock's own wait begins once the reaper's turn came,
    not before it (its deadline had passed, and the new checkpointer was refused at once)."""
    import threading

    url, m = str(tmp_path / "ckpt"), torch.nn.Linear(8, 8)
    let_go = Checkpointer._let_go

    def slow(self):
        if self._memory is None:  # (the tier's own)
            let_go(self)
            return
        time.sleep(4)  # (the reaper's turn, past the lock's own 3 s wait)
        # (its last snapshot still being committed: the tier lets go a moment later)
        threading.Timer(1.0, let_go, (self,)).start()

    monkeypatch.setattr(Checkpointer, "_let_go", slow)
    _snapshot_drop_and_open_again(url, m)


def _snapshot_drop_and_open_again(url: str, m: torch.nn.Module) -> None:
    """A checkpointer of ``url`` takes snapshot 1 and is dropped unclosed; a new one of the URL
    restores nothing yet but finds the snapshot (its rank's lock was let go of)."""
    first = Checkpointer(url, memory_every=1, persister=False)
    first.snapshot(1, {"model": m}).wait()
    del first
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        assert ck.memory_steps() == [1]
