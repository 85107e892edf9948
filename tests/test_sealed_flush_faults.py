"""Faults in the persisters' seal through the URL (seal_nodes._try's word on the manifest,
UrlGroup's patient round, the seal lock's waiting marker) and in the flush around it; found by a
review.  Nodes are memory roots, as in test_sealed_flush.py; the memory state is a real 3-node
sealed run (test_sealed_nodes._sealed_run), the seal the persisters' real seal_together over real
UrlGroups; a node's fault (a slow or a gone root) is a UrlGroup subclass, as test_sealed_flush's
_LeavesAtTheManifest."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from resilient.checkpoint.joint_flush import seal_together
from resilient.checkpoint.seal import _LOCK, _lock
from resilient.checkpoint.storage import Storage
from resilient.checkpoint.url_group import GroupBroken, UrlGroup
from tests.dist import run_distributed
from tests.test_memory_nodes import _root

pytestmark = [pytest.mark.distributed]

SESSION = "0" * 16


class _Promoter:  # (what seal_together reads of the persister's Promoter)
    def __init__(self, url: str, job_dir: str, node: int, nodes: int) -> None:
        self.storage = Storage(url)
        self.job_dir = job_dir
        self.config = {"nodes": nodes, "node": node}


def _three_sealed_nodes(tmp_path: Path) -> tuple[str, str, list[Path]]:
    from tests.test_sealed_nodes import _sealed_run

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 3, url, base, 1, [1, 2, 3])
    jobs = [next(Path(_root(base, n)).glob("job-*")) for n in range(3)]
    return url, base, jobs


def _manifests(jobs: list[Path]) -> list[list[str]]:
    return [sorted(p.parent.name for p in (j / "steps").rglob("MANIFEST.json")) for j in jobs]


def _seal_all(url: str, jobs: list[Path], groups: list[UrlGroup], close_root: bool = True):
    out: list[Any] = [None] * len(groups)

    def seal(n: int) -> None:
        out[n] = seal_together(_Promoter(url, str(jobs[n]), n, len(groups)), groups[n], 1.0)
        if n != 0 or close_root:
            groups[n].close()

    threads = [threading.Thread(target=seal, args=(n,)) for n in range(len(groups))]
    for t in threads:
        t.start()
    return out, threads


# --- 1. A root slow with the word: the members wait for it -------------------------------------

MEMBER_WAIT_S = 2.0


class _SlowRootAtTheWord(UrlGroup):
    """Node 0's persister, slow to publish the outcome of the patient round (the word on whether
    to commit): its storage is slow, or its process was descheduled / stopped for a while.  It
    publishes it all the same, then goes on as the real root does."""

    _patient = False

    def all_gather_json(self, data: bytes, cap: int, *, patient: bool = False) -> list[Any]:
        self._patient = patient
        try:
            return super().all_gather_json(data, cap, patient=patient)
        finally:
            self._patient = False

    def _publish_all(self, data: bytes) -> None:
        if self._patient:
            time.sleep(3 * MEMBER_WAIT_S + 3.0)  # (past the members' patient wait)
        super()._publish_all(data)


def test_a_root_slow_with_the_word_is_still_heard_by_every_node(tmp_path):
    """The members wait for the word on whether to commit longer than the root waits for their
    words (half a minute more), hurried or not: a root slower than 3 * wait_s with it is still
    heard (the members gave up at 3 * wait_s, and the root committed step 3 alone: a partial
    commit across nodes)."""
    url, _base, jobs = _three_sealed_nodes(tmp_path)
    groups = [
        (_SlowRootAtTheWord if n == 0 else UrlGroup)(Storage(url), SESSION, n, 3, MEMBER_WAIT_S)
        for n in range(3)
    ]
    out, threads = _seal_all(url, jobs, groups)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    committed = _manifests(jobs)
    # every node commits step 3 (the word came, late)
    assert committed == [["step_00000003"]] * 3, (out, committed)
    assert out == [3, 3, 3]


# --- 2. A member's patient wait ends before a restarted load gives up on the seal lock ---------


class _RootGoneAtTheWord(UrlGroup):
    """Node 0's persister, gone (its node lost, OOM-killed) just before the patient round."""

    def all_gather_json(self, data: bytes, cap: int, *, patient: bool = False) -> list[Any]:
        if patient:
            raise GroupBroken("(the test) node 0's persister is gone")
        return super().all_gather_json(data, cap, patient=patient)


def test_a_member_waiting_patiently_for_a_gone_root_leaves_the_lock_in_time(tmp_path, monkeypatch):
    """seal_across_nodes holds the node's seal lock across every collective, and the patient
    round does not hurry: it waited 3 * wait_s (180 s with join_wait_s 60), longer than a
    restarted rank's load waits for the seal lock (120 s), which then gave up and restored no
    sealed step.  Now at most _WORD_WAIT_S + _WORD_MARGIN_S (60 s); here both scaled down with
    the load's wait (2 * wait_s, as 120 s is to 60)."""
    from resilient.checkpoint import url_group

    assert url_group._WORD_WAIT_S + url_group._WORD_MARGIN_S < _load_lock_s()
    monkeypatch.setattr(url_group, "_WORD_WAIT_S", 2.0)
    monkeypatch.setattr(url_group, "_WORD_MARGIN_S", 2.0)
    url, _base, jobs = _three_sealed_nodes(tmp_path)
    wait_s = 4.0
    groups = [
        (_RootGoneAtTheWord if n == 0 else UrlGroup)(
            Storage(url), SESSION, n, 3, wait_s, hurry=None
        )
        for n in range(3)
    ]
    # (a patient round does not hurry: a successor's marker changes nothing here)
    out, threads = _seal_all(url, jobs, groups, close_root=False)
    # the restarted job's rank on node 1 loads: it waits for the seal lock (its marker written)
    seal_lock = os.path.join(str(jobs[1]), _LOCK)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("1.") for p in (tmp_path / "ckpt").rglob("*.json")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    got: list[Any] = []

    def load() -> None:
        fd = _lock(seal_lock, 2 * wait_s)  # (as Checkpointer.load's seal_across_nodes does)
        got.append(fd)
        if fd is not None:
            os.close(fd)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join(120)
    for t in threads:
        t.join(120)
    assert got and got[0] is not None, (
        "the restarted load could not take the seal lock within 2 * join_wait_s: the flush's "
        "member held it in the patient round waiting for a gone root, hurried or not"
    )


def _load_lock_s() -> float:
    """How long a load's seal waits for the seal lock (seal_across_nodes' lock_s)."""
    import inspect

    from resilient.checkpoint.seal_nodes import seal_across_nodes

    return inspect.signature(seal_across_nodes).parameters["lock_s"].default


# --- 3. A seal that finds nothing keeps node 0's staged records for the next run's load ---------


def _members_persisters_gone(rank: int, world: int, url: str, base: str) -> int | None:
    """Durable step 1, sealed snapshots 2 and 3 on three nodes of one rank each; the persisters
    of nodes 1 and 2 are gone (killed: an OOM, a teardown that reached them first), node 0's is
    told goodbye and flushes: its seal through the URL hears no one and seals nothing."""
    import signal

    import torch.distributed as dist

    from tests.test_sealed_flush import _open
    from tests.test_sealed_nodes import _state

    ck = _open(url, base, rank, 3.0)
    ck.save(1, _state(rank, world, 1.0)).wait()
    for s in (2, 3):
        assert ck.snapshot(s, _state(rank, world, float(s))).stats.sealed
    ck._memory._join_pending()
    dist.barrier()
    if rank != 0:
        os.kill(ck._persister.pid, signal.SIGKILL)
        ck._persister._proc.wait()
    dist.barrier()
    pid = ck._persister.pid
    staged = sorted(p.name for p in (Path(ck.memory.dir) / "staging").iterdir())
    ck.close()
    return pid, staged


def _restore3(rank: int, world: int, url: str, base: str) -> dict:
    from tests.test_sealed_flush import _restore

    return _restore(rank, world, url, base)


def test_a_seal_that_finds_nothing_keeps_the_records_for_the_next_runs_load(tmp_path):
    """Where the persisters cannot seal, the records and pairs stay for the next run's load (the
    one-node seal_staged ran after a seal across nodes that found nothing, and removed rank 0's
    own records; with node 1 lost the next load then fell back to durable step 1)."""
    import shutil

    from tests.test_sealed_flush import _alive, _logs

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    pid, before = run_distributed(_members_persisters_gone, 3, url, base)[0]
    deadline = time.monotonic() + 120
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)
    staged = sorted(
        p.name for p in Path(_root(base, 0)).rglob("staging/*") if "peer_" not in p.name
    )
    # rank 0's own records (of steps 2 and 3) were there as the flush began; the flush removed them
    assert [n for n in before if n.endswith(".json") and "peer_" not in n] == [
        n for n in staged if n.endswith(".json")
    ], (before, staged, _logs(base)[-3000:])
    shutil.rmtree(_root(base, 1))  # node 1 is lost (its memory with it)
    results = run_distributed(_restore3, 3, url, base)
    assert [(r["step"], r["source"]) for r in results] == [(3, "memory")] * 3, (
        staged,
        _logs(base)[-4000:],
    )


# --- 4. Two nodes: node 0 seals alone only its own newest step --------------------------------


def _two_nodes_pair_3_not_at_node_0(rank: int, world: int, url: str, base: str):
    """Durable step 1, sealed snapshots 2 and 3 on two nodes of one rank each; node 1's pair of
    step 3 never reached node 0 (the job was killed while it was on its way: node 0 still holds
    node 1's pair of step 2, kept until the newer one arrives).  Both persisters are alive, and
    every rank sealed step 3 (node 0: its own copy; node 1: its own copy)."""
    import torch.distributed as dist

    from tests.test_sealed_flush import _open
    from tests.test_sealed_nodes import _state

    ck = _open(url, base, rank, 10.0)
    ck.save(1, _state(rank, world, 1.0)).wait()
    staging = Path(ck.memory.dir) / "staging"
    aside = Path(base) / "aside"
    assert ck.snapshot(2, _state(rank, world, 2.0)).stats.sealed
    ck._memory._join_pending()
    dist.barrier()
    if rank == 0:  # (hard links: the same inodes, as the pair's record names its file)
        aside.mkdir()
        for p in staging.glob("peer_00001.step_2.*"):
            os.link(p, aside / p.name)
    dist.barrier()
    assert ck.snapshot(3, _state(rank, world, 3.0)).stats.sealed
    ck._memory._join_pending()
    dist.barrier()
    if rank == 0:
        for p in staging.glob("peer_00001.step_3.*"):
            p.unlink()
        for p in aside.iterdir():
            if not (staging / p.name).exists():
                os.link(p, staging / p.name)
    dist.barrier()
    pid = ck._persister.pid
    ck.close()
    return pid


def test_on_two_nodes_the_seal_alone_does_not_flush_an_older_step_than_every_rank_sealed(
    tmp_path,
):
    """On two nodes node 0 seals alone only the newest step its own ranks staged: here it holds
    step 2 whole (its own copy, node 1's pair) but not step 3 (the pair never arrived), so the
    seal through the URL, with node 1, commits step 3 (node 0 alone flushed step 2 and removed
    its own copy of step 3)."""
    from tests.test_sealed_flush import _alive, _logs

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    pids = run_distributed(_two_nodes_pair_3_not_at_node_0, 2, url, base)
    deadline = time.monotonic() + 120
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    from resilient import Checkpointer

    assert Checkpointer(url).steps()[-1] == 3, (Checkpointer(url).steps(), _logs(base)[-4000:])


# --- 5. What a node lost after the seal, or before it, leaves ------------------------------------


def _seal_three(url: str, base: str) -> list:
    """The persisters' seal through the URL on three nodes (as test_sealed_flush does it)."""
    from tests.test_sealed_flush import seal_nodes

    jobs = [next(Path(_root(base, n)).glob("job-*")) for n in range(3)]
    return seal_nodes(url, jobs, [UrlGroup(Storage(url), "1" * 16, n, 3, 5.0) for n in range(3)])


@pytest.mark.parametrize("seal_first", [False, True])
def test_a_node_lost_after_the_flush_seal_does_not_lose_the_step(tmp_path, seal_first):
    """Sealed step 3 on three nodes; node 2's memory is then lost (the whole job died with a
    node, and its persister never wrote rank 2's file).  The next run restores step 3 all the
    same, with or without the persisters' seal through the URL first: that seal commits each
    node's own ranks' files and keeps the pairs (it removed them, and rank 2's only other copy
    with them; found by a review)."""
    from tests.test_sealed_nodes import _expected, _restore, _sealed_run

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 3, url, base, 1, [1, 2, 3])
    if seal_first:
        assert _seal_three(url, base) == [3, 3, 3]
    shutil.rmtree(_root(base, 2))  # node 2 lost (its persister never served the flush)
    got = run_distributed(_restore, 3, url, base, [0, 1, 2])
    assert [(g["step"], g["w"][0]) for g in got] == [
        (e["step"], e["w"][0]) for e in _expected(3, 3)
    ], got


def test_a_node_gone_whole_does_not_make_the_committed_seal_count_as_not_sealed(tmp_path):
    """Node 1 is lost with its persister (nothing of it takes part); rank 1's copy is node 2's
    peer pair.  Nodes 0 and 2 commit step 3, and the seal counts as made: the last round counts
    the nodes that hold copies, not one never heard from (it counted it as a failure)."""
    import threading
    from pathlib import Path

    from resilient.checkpoint.joint_flush import seal_together
    from resilient.checkpoint.storage import Storage
    from resilient.checkpoint.url_group import UrlGroup
    from tests.test_sealed_flush import _Promoter
    from tests.test_sealed_nodes import _sealed_run

    url, base = str(tmp_path / "ckpt"), str(tmp_path / "memory")
    run_distributed(_sealed_run, 3, url, base, 1, [1, 2, 3])
    shutil.rmtree(_root(base, 1))
    jobs = {n: next(Path(_root(base, n)).glob("job-*")) for n in (0, 2)}
    groups = {n: UrlGroup(Storage(url), "2" * 16, n, 3, 3.0) for n in (0, 2)}
    out: dict = {}

    def seal(n: int) -> None:
        out[n] = seal_together(_Promoter(url, str(jobs[n]), n, 3), groups[n], 1.0)
        groups[n].close()

    threads = [threading.Thread(target=seal, args=(n,)) for n in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    committed = {
        n: sorted(p.parent.name for p in (jobs[n] / "steps").rglob("MANIFEST.json")) for n in (0, 2)
    }
    assert committed == {0: ["step_00000003"], 2: ["step_00000003"]}, committed
    assert out == {0: 3, 2: 3}, f"committed on every node that holds copies, yet {out}"


def test_mark_waiting_never_removes_a_live_processs_marker(tmp_path):
    """A waiting marker is whole once at its name: mark_waiting (a persister at its node's lock)
    never reads a live one empty and removes it as a dead process's (written with O_TRUNC, then
    its start time, it was; the marker is written once per wait).  Real processes."""
    import os
    import subprocess
    import sys

    from resilient.checkpoint.joint_flush import mark_waiting

    d = str(tmp_path)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "from resilient.checkpoint.seal import write_waiting_marker\n"
            "lost = 0\n"
            "for i in range(500):\n"
            f"    p = write_waiting_marker({d!r})\n"
            "    time.sleep(0.0005)\n"
            "    if not os.path.exists(p): lost += 1\n"
            "    else: os.unlink(p)\n"
            "print(lost)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        while child.poll() is None:
            os.unlink(mark_waiting(d))
        lost = int(child.communicate(timeout=60)[0].strip())
    finally:
        if child.poll() is None:
            child.kill()
    assert lost == 0, f"{lost} of 500 live markers were removed as a dead process's"


def test_a_marker_gone_when_read_is_not_removed_once_written_again(tmp_path, monkeypatch):
    """A waiting marker that is gone when mark_waiting reads it (its process's wait ended) is not
    removed afterwards: its live process may have written its next one at that name meanwhile
    (the race the test above found under load, once in 500, made certain here)."""
    import subprocess
    import sys

    from resilient.checkpoint import joint_flush
    from resilient.checkpoint.lease import _process_start
    from resilient.checkpoint.seal import WAITING_PREFIX

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        marker = tmp_path / f"{WAITING_PREFIX}{live.pid}"
        marker.write_text(_process_start(live.pid))
        read = joint_flush._marker_state

        def racing(path: str, pid: int) -> str:
            os.unlink(path)  # its wait ends...
            state = read(path, pid)
            Path(path).write_text(_process_start(live.pid))  # ...and the next one begins
            return state

        monkeypatch.setattr(joint_flush, "_marker_state", racing)
        os.unlink(joint_flush.mark_waiting(str(tmp_path)))  # (this process's own)
        assert marker.read_text() == _process_start(live.pid)
    finally:
        live.kill()
        live.wait()
