"""A memory snapshot whose copy every rank finished but whose commit a fault cut short is committed
by the next load, or by the persister's flush (resilient/checkpoint/seal.py): a fault then loses at
most one step.  A staged record that does not add up is never sealed, and never raises."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer
from tests.dist import run_distributed
from tests.test_persister import _alive, _wait_for

# Snapshots of steps 1-3, each committed but the last: its commit never runs (the memory tier's
# commit thread sleeps), and the process dies with the copy complete, as when a job is SIGKILLed
# while the next training step computes.
_CUT_SHORT = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from resilient import Checkpointer
    url, ref, persister = sys.argv[1], sys.argv[2], sys.argv[3] == "persister"
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32)
    ck = Checkpointer(url, memory_every=1, persister=persister)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        if step == 3:
            ck._memory._persist = lambda *a, **k: time.sleep(3600)
        ck.snapshot(step, {"model": m, "meta": {"step": step}})
        if step < 3:
            ck.wait_snapshot()
    torch.save(m.state_dict(), ref)  # (the test's reference: not a checkpoint)
    print(ck.persister_pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _cut_short(tmp_path: Path, persister: bool = False) -> tuple[str, dict, int | None]:
    url, ref = tmp_path / "ckpt", tmp_path / "reference.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(url), str(ref), "persister" if persister else ""],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = proc.stdout.split()[-1]
    return str(url), torch.load(ref, weights_only=True), None if pid == "None" else int(pid)


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


def test_a_snapshot_whose_commit_was_cut_short_is_sealed_at_the_next_load(tmp_path, memory_root):
    url, want, _ = _cut_short(tmp_path)
    records = _records(memory_root)
    assert [p.name for p in records] == ["rank_00000.step_3.json"]
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


def test_the_persister_flushes_a_snapshot_whose_commit_was_cut_short(tmp_path, memory_root):
    url, want, pid = _cut_short(tmp_path, persister=True)
    assert pid is not None
    _wait_for("the persister's exit", lambda: not _alive(pid))
    durable = Checkpointer(url)
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
    if kind == "live writer":
        from resilient.checkpoint.lease import _process_start

        rec["pid"], rec["start"] = os.getpid(), _process_start(os.getpid())
    elif kind == "size":
        rec["size"] += 4096
    elif kind == "chunk outside the file":
        chunk = next(iter(rec["chunks"].values()))
        chunk["byte_range"] = [0, rec["size"] + 1]
    elif kind == "another job's layout":
        rec["world"] = 2
    elif kind == "values not a mapping":
        rec["values"] = [1, 2]
    elif kind == "file gone":
        (_staging(memory_root) / rec["path"]).unlink()
    record.write_text(json.dumps(rec))


@pytest.mark.parametrize(
    "kind",
    [
        "garbage",
        "replaced file",
        "live writer",
        "size",
        "chunk outside the file",
        "another job's layout",
        "values not a mapping",
        "file gone",
    ],
)
def test_a_staged_record_that_does_not_add_up_is_not_sealed(tmp_path, memory_root, kind):
    url, _, _ = _cut_short(tmp_path)
    (record,) = _records(memory_root)
    _damage(kind, record, memory_root)
    step, ck, _m, meta = _load(url)
    with ck:
        assert step == 2 and ck.last_load.source == "memory" and meta == {"step": 2}
        assert sorted(ck.memory_steps()) == [1, 2]
        # a live writer's record is its own commit's business; any other one served its purpose
        assert _records(memory_root) == ([record] if kind == "live writer" else [])


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
    return {k: v.clone() for k, v in m.state_dict().items()}  # the process exits, unclosed


def _two_ranks_load(rank: int, world: int, url: str) -> tuple:
    m = torch.nn.Linear(64, 32)
    meta = {"step": -1, "rank": -1}
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        step = ck.load({"model": m, "meta": meta})
        return step, ck.last_load.source, {k: v.clone() for k, v in m.state_dict().items()}, meta


@pytest.mark.parametrize("records", ["every rank's", "rank 1's missing"])
def test_two_ranks_seal_only_a_step_every_rank_staged(tmp_path, memory_root, records):
    url = str(tmp_path / "ckpt")
    want = run_distributed(_two_ranks_cut_short, 2, url)
    assert len(_records(memory_root)) == 2
    if records == "rank 1's missing":
        (_staging(memory_root) / "rank_00001.step_3.json").unlink()
    got = run_distributed(_two_ranks_load, 2, url)
    for rank, (step, source, weights, meta) in enumerate(got):
        assert source == "memory"
        if records == "every rank's":
            assert step == 3 and meta == {"step": 3, "rank": rank}
            assert all(torch.equal(weights[k], want[0][k]) for k in weights)
        else:
            assert step == 2 and meta == {"step": 2, "rank": rank}
    assert _records(memory_root) == []
