"""A memory snapshot whose copy every rank finished but whose commit a fault cut short is committed
by the next load, or by the persister's flush (resilient/checkpoint/seal.py): a fault then loses at
most one step.  A staged record that does not add up is never sealed, and never raises."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer
from tests.dist import run_distributed
from tests.test_persister import _alive, _wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # real multi-process jobs, seconds each

# Snapshots of steps 1-3, each committed but the last: its commit never runs (the memory tier's
# commit thread sleeps), and the process dies with the copy complete, as when a job is SIGKILLed
# while the next training step computes.
_CUT_SHORT = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from resilient import Checkpointer
    url, ref, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32)
    ck = Checkpointer(url, memory_every=1, persister=mode == "persister")
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        if step == 3 and mode == "moved":  # cut after the file moved into the step directory
            ck._memory._coordinate = lambda *a, **k: time.sleep(3600)
        elif step == 3:  # cut before the checksums
            ck._memory._persist = lambda *a, **k: time.sleep(3600)
        ck.snapshot(step, {"model": m, "meta": {"step": step}})
        if step < 3:
            ck.wait_snapshot()
    torch.save(m.state_dict(), ref)  # (the test's reference: not a checkpoint)
    if mode == "moved":
        step_dir = os.path.join(ck.memory.steps, "step_00000003")
        # (the rank file itself: the directory also holds the generation's claim, made before)
        while not os.path.isdir(step_dir) or not any(
                n.startswith("rank_") for n in os.listdir(step_dir)):
            time.sleep(0.01)
    if mode == "persister":
        log = os.path.join(ck.memory.dir, "persister.log")
        while not os.path.exists(log) or "started" not in open(log).read():
            time.sleep(0.01)  # the persister is up: it sees this process die, not reaped yet
    print(os.getpid(), ck.persister_pid, flush=True)
    if mode == "persister":
        time.sleep(3600)  # the test kills it, and leaves it unreaped a while (a zombie)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _cut_short(tmp_path: Path, mode: str = "staged") -> tuple[str, dict]:
    url, ref = tmp_path / "ckpt", tmp_path / "reference.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(url), str(ref), mode],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return str(url), torch.load(ref, weights_only=True)


def _staging(memory_root: Path) -> Path:
    return next(memory_root.glob("job-*/staging"))


def _records(memory_root: Path) -> list[Path]:
    return sorted(_staging(memory_root).glob("rank_*.step_*.json"))


def _load(url: str) -> tuple[int, Checkpointer, torch.nn.Module, dict]:
    m = torch.nn.Linear(64, 32)
    meta = {"step": -1}
    ck = Checkpointer(url, memory_every=1, persister=False)
    step = ck.load({"model": m, "meta": meta})
    return step, ck, m, meta


@pytest.mark.parametrize("mode", ["staged", "moved"])
def test_a_snapshot_whose_commit_was_cut_short_is_sealed_at_the_next_load(
    tmp_path, memory_root, mode
):
    url, want = _cut_short(tmp_path, mode)
    records = _records(memory_root)
    assert [p.name for p in records] == ["rank_00000.step_3.json"]
    moved = list((next(memory_root.glob("job-*/steps")) / "step_00000003").glob("rank_*"))
    assert len(moved) == (1 if mode == "moved" else 0)
    step, ck, m, meta = _load(url)
    with ck:
        assert step == 3 and ck.last_load.source == "memory"
        assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
        assert meta == {"step": 3}  # the non-tensor values of the step, from its record
        assert sorted(ck.memory_steps()) == [2, 3]
        assert ck._memory.verify(3).ok  # checksummed like any snapshot
        assert _records(memory_root) == []
        # training goes on from it: the next snapshots commit as usual
        ck.snapshot(4, {"model": m, "meta": {"step": 4}}).wait()
        assert sorted(ck.memory_steps()) == [3, 4]


def _state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_persister_flushes_a_snapshot_whose_commit_was_cut_short(tmp_path, memory_root):
    url, ref = tmp_path / "ckpt", tmp_path / "reference.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CUT_SHORT, str(url), str(ref), "persister"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        trainer, pid = map(int, proc.stdout.readline().split())
        os.kill(trainer, signal.SIGKILL)
        # the trainer stays a zombie (not reaped) while its persister flushes: gone all the same
        _wait_for("the trainer's death", lambda: _state_of(trainer) == "Z")
        _wait_for("the persister's exit", lambda: not _alive(pid))
        assert _state_of(trainer) == "Z"
    finally:
        proc.kill()
        proc.wait()
    want = torch.load(ref, weights_only=True)
    durable = Checkpointer(str(url))
    assert durable.steps() == [3]
    assert durable.verify(3).ok
    m, meta = torch.nn.Linear(64, 32), {"step": -1}
    assert durable.load({"model": m, "meta": meta}) == 3
    assert all(torch.equal(m.state_dict()[k], want[k]) for k in want) and meta == {"step": 3}
    log = next(memory_root.glob("job-*/persister.log")).read_text()
    assert "sealed memory snapshot of step 3" in log and "flushed step 3" in log


def _damage(kind: str, record: Path, memory_root: Path) -> None:
    rec = json.loads(record.read_text())
    if kind == "garbage":
        record.write_text('{"format": "resilient-staged-v1", "pid": ')
        return
    if kind == "replaced file":  # same name, same bytes, another file
        path = _staging(memory_root) / rec["path"]
        shutil.copyfile(path, f"{path}.copy")
        os.replace(f"{path}.copy", path)
        return
    if kind == "another step in the header":  # (staged again for step 4 after a rollback)
        path = _staging(memory_root) / rec["path"]
        data = path.read_bytes()
        at = data.index(b'"step":"3"')
        path.write_bytes(data[:at] + b'"step":"4"' + data[at + 10 :])
        return
    if kind == "older than the newest commit":
        rec["step"] = 2
        record.unlink()
        record = record.with_name("rank_00000.step_2.json")
    elif kind == "a FIFO for a file":
        fifo = _staging(memory_root) / "fifo.safetensors"
        os.mkfifo(fifo)
        rec["path"], rec["ino"] = fifo.name, os.stat(fifo).st_ino
    elif kind == "live writer":
        from resilient.checkpoint.lease import _process_start

        rec["pid"], rec["start"] = os.getpid(), _process_start(os.getpid())
    elif kind == "size":
        rec["size"] += 4096
    elif kind == "chunk outside the file":
        chunk = next(iter(rec["chunks"].values()))
        chunk["byte_range"] = [0, rec["size"] + 1]
    elif kind == "overlapping chunks":  # (together they claim more bytes than the file has)
        for chunk in rec["chunks"].values():
            chunk["byte_range"] = [8, rec["size"]]
    elif kind == "another job's layout":
        rec["world"] = 2
    elif kind == "values not a mapping":
        rec["values"] = [1, 2]
    elif kind == "file gone":
        (_staging(memory_root) / rec["path"]).unlink()
    record.write_text(json.dumps(rec))


@pytest.fixture(scope="module")
def _cut_short_once(tmp_path_factory) -> tuple[Path, Path]:
    """One job cut short (a process killed with its copy of step 3 complete, its commit not
    run), made once for the cases below, and a copy of it kept aside: the job's directory
    and its memory root."""
    here = tmp_path_factory.mktemp("cut-short")
    env = os.environ.get("RESILIENT_MEMORY_ROOT")
    os.environ["RESILIENT_MEMORY_ROOT"] = str(here / "memory-root")
    try:
        _cut_short(here)
    finally:
        if env is None:
            del os.environ["RESILIENT_MEMORY_ROOT"]
        else:
            os.environ["RESILIENT_MEMORY_ROOT"] = env
    kept = tmp_path_factory.mktemp("cut-short-kept") / "job"
    shutil.copytree(here, kept, symlinks=True)
    return here, kept


@pytest.fixture
def cut_short_copy(_cut_short_once, monkeypatch) -> tuple[str, Path]:
    """The job cut short, as it was left, at its own paths (its memory directory is named from
    the URL): copied back over what the case before changed, each staged record naming its
    file's inode in the copy (a copy is another file: the record's own inode would not match)."""
    here, kept = _cut_short_once
    shutil.rmtree(here)
    shutil.copytree(kept, here, symlinks=True)
    memory_root = here / "memory-root"
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(memory_root))
    for record in _records(memory_root):
        rec = json.loads(record.read_text())
        rec["ino"] = os.stat(_staging(memory_root) / rec["path"]).st_ino
        record.write_text(json.dumps(rec))
    return str(here / "ckpt"), memory_root


def test_the_job_cut_short_as_the_cases_below_get_it_seals_step_3(cut_short_copy):
    """(the cases below would pass for any reason a seal fails: undamaged, it seals)"""
    url, _ = cut_short_copy
    step, ck, _m, meta = _load(url)
    with ck:
        assert (step, ck.last_load.source, ck.last_load.sealed) == (3, "memory", True)
        assert meta == {"step": 3}


# why a case's step is not sealed, where another check would refuse it too (the one named must)
_WHY = {
    "replaced file": "staged file (inode",  # (not "was replaced": that is the link's own check)
    "a FIFO for a file": "staged file (inode",  # (not "has 0 bytes": the size check)
}


@pytest.mark.parametrize(
    "kind",
    [
        "garbage",
        "replaced file",
        "live writer",
        "size",
        "chunk outside the file",
        "overlapping chunks",
        "another job's layout",
        "values not a mapping",
        "file gone",
        "another step in the header",
        "older than the newest commit",
        "a FIFO for a file",
    ],
)
def test_a_staged_record_that_does_not_add_up_is_not_sealed(cut_short_copy, kind, caplog):
    url, memory_root = cut_short_copy
    (record,) = _records(memory_root)
    _damage(kind, record, memory_root)
    with caplog.at_level(logging.WARNING, logger="resilient.checkpoint.seal"):
        step, ck, _m, meta = _load(url)
    if kind in _WHY:
        assert any(_WHY[kind] in r.getMessage() for r in caplog.records), caplog.text
    with ck:
        assert step == 2 and ck.last_load.source == "memory" and meta == {"step": 2}
        assert sorted(ck.memory_steps()) == [1, 2]
        # a live writer's record is its own commit's business; any other one served its purpose
        left = [p.name for p in _records(memory_root)]
        assert left == (["rank_00000.step_3.json"] if kind == "live writer" else [])


def _two_ranks_cut_short(rank: int, world: int, url: str) -> dict:
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32)
    ck = Checkpointer(url, memory_every=1, persister=False)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)  # the same on every rank: the model is replicated
        if step == 3:
            ck._memory._persist = lambda *a, **k: time.sleep(3600)
        ck.snapshot(step, {"model": m, "meta": {"step": step, "rank": rank}})
        if step < 3:
            ck.wait_snapshot()
    # Rank 0's process holds the store: were it to exit while rank 1's thread still waits for the
    # outcome of step 2 (a loaded machine), that wait would fail on a closed connection
    torch.distributed.barrier()
    # plain lists: a tensor would come back through a file descriptor this process (exiting
    # unclosed at once) may no longer be there to hand over
    return {k: v.tolist() for k, v in m.state_dict().items()}


def _two_ranks_load(rank: int, world: int, url: str) -> tuple:
    m = torch.nn.Linear(64, 32)
    meta = {"step": -1, "rank": -1}
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        step = ck.load({"model": m, "meta": meta})
        return step, ck.last_load.source, {k: v.tolist() for k, v in m.state_dict().items()}, meta


@pytest.mark.parametrize("records", ["every rank's", "rank 1's missing", "rank 1's of another run"])
def test_two_ranks_seal_only_a_step_every_rank_staged(tmp_path, memory_root, records):
    url = str(tmp_path / "ckpt")
    want = run_distributed(_two_ranks_cut_short, 2, url)
    assert len(_records(memory_root)) == 2
    one = _staging(memory_root) / "rank_00001.step_3.json"
    if records == "rank 1's missing":
        one.unlink()
    elif records == "rank 1's of another run":  # (a rank of an earlier run that died later)
        one.write_text(json.dumps({**json.loads(one.read_text()), "run": "another:0::"}))
    got = run_distributed(_two_ranks_load, 2, url)
    for rank, (step, source, weights, meta) in enumerate(got):
        assert source == "memory"
        if records == "every rank's":
            assert step == 3 and meta == {"step": 3, "rank": rank}
            assert all(weights[k] == want[0][k] for k in weights)
        else:
            assert step == 2 and meta == {"step": 2, "rank": rank}
    assert _records(memory_root) == []


def test_a_dead_ranks_record_waits_while_another_rank_of_its_step_lives(tmp_path, memory_root):
    """Rank 0 died first (the persister's flush runs now), rank 1 still runs: nothing is sealed,
    and rank 0's record stays for the seal once rank 1 is gone too."""
    from resilient.checkpoint.lease import _process_start
    from resilient.checkpoint.seal import seal_staged

    url = str(tmp_path / "ckpt")
    run_distributed(_two_ranks_cut_short, 2, url)
    one = _staging(memory_root) / "rank_00001.step_3.json"
    dead = one.read_text()
    one.write_text(
        json.dumps({**json.loads(dead), "pid": os.getpid(), "start": _process_start(os.getpid())})
    )
    job = _staging(memory_root).parent
    t0 = time.monotonic()
    assert seal_staged(str(job), wait_s=0.3) is None
    assert time.monotonic() - t0 >= 0.3  # it waited for rank 1, in vain
    assert [p.name for p in _records(memory_root)] == [
        "rank_00000.step_3.json",
        "rank_00001.step_3.json",
    ]
    one.write_text(dead)  # rank 1 is gone now
    got = run_distributed(_two_ranks_load, 2, url)
    assert [g[0] for g in got] == [3, 3]


def test_a_fifo_among_the_records_does_not_hang_the_seal(tmp_path, memory_root):
    from resilient.checkpoint.seal import seal_staged

    url, _ = _cut_short(tmp_path)
    os.mkfifo(_staging(memory_root) / "rank_00001.step_3.json")
    result: list = []
    t = threading.Thread(
        target=lambda: result.append(seal_staged(str(_staging(memory_root).parent)))
    )
    t.start()
    t.join(60)
    assert not t.is_alive(), "seal_staged blocked on a FIFO"
    # rank 1's "record" is not one (world 1 anyway): the step seals from rank 0's
    assert result == [3]
    assert not (_staging(memory_root) / "rank_00001.step_3.json").exists()
