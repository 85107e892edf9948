"""The collective ring (resilient.health.ring) and hang attribution (resilient.health.attribution):
the ring itself, its wrappers on real gloo groups, the comparison of rings as pure logic, the
summary through a real TCPStore, and the leader's record on a HUNG verdict."""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient.errors import FlightRecorderError
from resilient.health import flight_recorder
from resilient.health.attribution import (
    Call,
    GroupState,
    RankRing,
    attribute_hang,
    decode_summary,
    format_rank_list,
)
from resilient.health.detector import DetectorConfig, Finding, Verdict
from resilient.health.events import EventLog
from resilient.health.heartbeat import MAX_STACK_CHARS, Monitor, main_thread_stack
from resilient.health.ring import (
    SUMMARY_GROUPS,
    CollectiveRing,
    format_ranks,
    pack_ranks,
    unpack_ranks,
)
from tests.dist import run_distributed

# --- the ring ------------------------------------------------------------------------------------


def test_the_ring_keeps_the_newest_calls_and_counts_per_group():
    ring = CollectiveRing(size=4)
    world, tp = ring.named("world [0-3]", range(4)), ring.named("tp [0, 1]", (0, 1))
    for i in range(10):
        slot = ring.enter("all_reduce", world if i % 2 == 0 else tp, 16)
        if i < 9:
            ring.leave(slot)
    calls = ring.calls()
    assert len(calls) == 4 and ring.count == 10  # wrapped around: the newest four, oldest first
    assert [(c[1].label, c[2]) for c in calls] == [
        ("world [0-3]", 4),
        ("tp [0, 1]", 4),
        ("world [0-3]", 5),
        ("tp [0, 1]", 5),
    ]
    assert calls[-1][5] is None and all(c[5] >= c[4] for c in calls[:-1])  # the last: inside
    assert (world.entered, world.left, tp.entered, tp.left) == (5, 5, 5, 4)
    d = json.loads(ring.summary(last=2))
    assert [c[:3] for c in d["calls"]] == [
        ["all_reduce", "world [0-3]", 5],
        ["all_reduce", "tp [0, 1]", 5],
    ]
    assert d["v"] == 2 and d["more"] == 0
    assert d["groups"]["world [0-3]"] == [{"start": 0, "stop": 4, "step": 1}, 5, 5, "world [0-3]"]
    assert not ring.changed()  # nothing new to publish
    ring.leave(slot)  # the last call returns
    assert ring.changed()


def test_a_summary_keeps_a_call_still_inside_that_is_older_than_the_last_few():
    ring = CollectiveRing(size=16)
    g, other = ring.named("world [0, 1]", (0, 1)), ring.named("p2p [0, 1]", (0, 1))
    ring.enter("barrier", g, None)  # never returns (another thread made the newer calls)
    for _ in range(5):
        ring.leave(ring.enter("send", other, 4))
    calls = json.loads(ring.summary(last=2))["calls"]
    assert [(c[0], c[5]) for c in calls][0] == ("barrier", None) and len(calls) == 3


def test_threads_calling_collectives_at_once_each_get_their_own_slot():
    # resilient's replication thread runs gloo collectives while the main thread trains: a call
    # read the count, and another thread took the same slot and count before it wrote it back
    import torch.distributed.distributed_c10d as c10d

    from resilient.health.ring import _wrap

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        ring = CollectiveRing(size=64)
        wrapped = _wrap(ring, "all_reduce", lambda *a, **k: None, c10d.all_reduce)
        inside, release = threading.Event(), threading.Event()

        def blocking(*args, **kwargs):
            inside.set()
            release.wait(60)

        stuck = _wrap(ring, "all_reduce", blocking, c10d.all_reduce)
        pgs = [object() for _ in range(4)]
        for k, pg in enumerate(pgs):
            ring._by_id[id(pg)] = (ring.named(f"g{k}", (0,)), None)
        main = object()
        ring._by_id[id(main)] = (ring.named("main", (0,)), None)
        num_calls, t = 20000, torch.zeros(1)

        def hammer(pg, n):
            for _ in range(n):
                wrapped(t, group=pg)

        def hammer_enter(k):
            g = ring.named(f"e{k}", (0,))
            for _ in range(num_calls):
                ring.leave(ring.enter("barrier", g, None))

        threads = [threading.Thread(target=hammer, args=(pg, num_calls)) for pg in pgs]
        threads += [threading.Thread(target=hammer_enter, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert ring.count == 6 * num_calls  # no call lost, the count never wound back

        # a thread blocked inside a call shows inside it while others keep calling
        blocked = threading.Thread(target=stuck, args=(t,), kwargs={"group": main})
        blocked.start()
        assert inside.wait(60)
        side = [threading.Thread(target=hammer, args=(pg, 10)) for pg in pgs]
        for th in side:
            th.start()
        for th in side:
            th.join()
        calls = json.loads(ring.summary())["calls"]
        release.set()
        blocked.join()
        assert any(c[1] == "main" and c[5] is None for c in calls), calls
        assert ring.count == 6 * num_calls + 41
    finally:
        release.set()
        sys.setswitchinterval(interval)


def test_rank_lists_pack_and_read_compactly():
    assert pack_ranks(range(0, 4096)) == {"start": 0, "stop": 4096, "step": 1}
    assert unpack_ranks(pack_ranks((1, 3, 5, 7))) == (1, 3, 5, 7)
    assert pack_ranks((0, 1)) == [0, 1] and unpack_ranks([4, 9, 2]) == (4, 9, 2)
    assert format_ranks((0, 1)) == "[0, 1]"
    assert format_ranks(range(8)) == "[0-7]"
    assert format_ranks((0, 1, 2, 5, 7, 8, 9)) == "[0-2, 5, 7-9]"
    assert format_rank_list([3]) == "rank 3" and format_rank_list([0, 1, 3]) == "ranks 0, 1, 3"


# --- the wrappers on real gloo groups -----------------------------------------------------------


def _record_collectives(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.health.ring import install, installed

    calls_seen = []

    def outer_before(fn):  # a wrapper installed before the ring (it ends up inside)
        def w(*a, **k):
            calls_seen.append(("before", fn.__name__))
            return fn(*a, **k)

        w.__name__ = fn.__name__
        return w

    dist.all_reduce = outer_before(dist.all_reduce)
    ring = install(force=True)
    assert installed() is ring and install(force=True) is ring  # once per process
    # a wrapper installed after it, like the chaos harness's slow fault: takes (*args, **kwargs)
    inner = dist.all_reduce

    def after(*a, **k):
        calls_seen.append(("after", "all_reduce"))
        return inner(*a, **k)

    dist.all_reduce = after

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    g = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    t = torch.ones(4)
    dist.all_reduce(t)  # world, positional nothing
    dist.all_reduce(t, dist.ReduceOp.SUM, tp)  # group positional
    dist.all_reduce(t, group=dist.group.WORLD)  # the default group by name: same counter as None
    dist.all_gather([torch.empty(4) for _ in range(2)], t, group=g)
    dist.all_to_all_single(torch.empty(8), torch.ones(8, dtype=torch.float32), group=tp)
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, dist.Work)  # the caller gets torch's own object back
    work.wait()
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(torch.ones(3), dst=peer)
        dist.recv(t[:3], src=peer)
    else:
        dist.recv(t[:3], src=peer)
        dist.send(torch.ones(3), dst=peer)
    # P2POp tells isend from irecv by identity: the ring leaves them unwrapped (and unseen)
    ops = [
        dist.P2POp(dist.isend, torch.ones(2), peer),
        dist.P2POp(dist.irecv, torch.empty(2), peer),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.barrier()
    try:
        dist.broadcast(t, src=99)  # a failing call still counts as left
    except Exception:
        pass
    summary = ring.summary(last=64)
    return summary, calls_seen


@pytest.mark.distributed
def test_the_wrappers_record_every_collective_with_its_group_sequence_and_size():
    results = run_distributed(_record_collectives, 4)
    rings = [decode_summary(s, r, lambda t: t) for r, (s, _) in enumerate(results)]
    for r, ring in enumerate(rings):
        names = [(c.op, c.label, c.seq, c.nbytes) for c in ring.calls]
        tp = "tp [0, 1]" if r < 2 else "tp [2, 3]"
        pair = "[0, 1]" if r < 2 else "[2, 3]"
        assert names[:3] == [
            ("all_reduce", "world [0-3]", 1, 16),
            ("all_reduce", tp, 1, 16),  # a device mesh's axis by its name
            ("all_reduce", "world [0-3]", 2, 16),  # group=WORLD counts with group=None
        ]
        # new_group's: named by its number, counted on its own
        assert names[3][0] == "all_gather" and names[3][1].startswith("group ")
        assert names[3][1].endswith(" [0, 2]" if r % 2 == 0 else " [1, 3]")
        assert names[3][2:] == (1, 16)
        assert names[4] == ("all_to_all_single", tp, 2, 32)
        assert names[5] == ("all_reduce", "world [0-3]", 3, 16)  # async: counted the same
        p2p = [n for n in names if n[0] in ("send", "recv", "isend", "irecv")]
        # a send and its matching receive get the same sequence number on the pair
        assert [n[1:3] for n in p2p] == [(f"p2p {pair}", i) for i in range(1, 3)]
        assert [n[0] for n in p2p] == (["send", "recv"] if r % 2 == 0 else ["recv", "send"])
        assert names[-2][:3] == ("barrier", "world [0-3]", 4)
        assert names[-1][0] == "broadcast"
        assert all(c.left_t is not None and c.left_t >= c.entered_t for c in ring.calls)
        assert not any(c.pending for c in ring.calls)
        (tp_key,) = {c.group for c in ring.calls if c.label == tp}
        assert ring.groups[tp_key] == GroupState((0, 1) if r < 2 else (2, 3), 2, 2, tp)
    # calls are matched by the group's key: the same on every member, different between groups
    keys = [{c.label: c.group for c in ring.calls} for ring in rings]
    assert len({k["world [0-3]"] for k in keys}) == 1
    assert keys[0]["tp [0, 1]"] == keys[1]["tp [0, 1]"] != keys[2]["tp [2, 3]"]
    assert keys[0]["p2p [0, 1]"] == keys[1]["p2p [0, 1]"]
    # both other wrappers ran on every all_reduce: theirs and the ring compose either way round
    for _, seen in results:
        assert seen.count(("after", "all_reduce")) == 4
        assert seen.count(("before", "all_reduce")) == 4


def _pending_async(rank, world):
    from resilient.health.ring import install

    side = dist.new_group([0, 1])  # its own gloo context: a signal apart from WORLD's calls
    ring = install(force=True)
    t = torch.ones(2)
    if rank == 0:
        work = dist.broadcast(t, src=1, async_op=True)  # rank 1 joins after rank 0 published
        first = ring.summary()
        dist.barrier(group=side)
        work.wait()
        return first, ring.summary()
    dist.barrier(group=side)
    dist.broadcast(t, src=1)
    return None, None


@pytest.mark.distributed
def test_an_asynchronous_call_is_pending_until_its_work_completes():
    (first, after), _ = run_distributed(_pending_async, 2)
    before = decode_summary(first, 0, lambda t: t)
    assert before.inside() is not None and before.inside().op == "broadcast"
    assert before.inside().pending and before.inside().left_t is not None
    assert decode_summary(after, 0, lambda t: t).inside() is None


def _dump_flight_recorder(rank, world, prefix):
    import os

    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"  # read when a group is made
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    g = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4), group=g)
    return flight_recorder.dump(rank)


@pytest.mark.distributed
def test_the_flight_recorder_is_dumped_where_torch_would_put_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    assert flight_recorder.dump(0) is None  # off: nothing written, nothing named
    prefix = str(tmp_path / "fr" / "trace_rank_")
    paths = run_distributed(_dump_flight_recorder, 2, prefix)
    assert paths == [f"{prefix}0", f"{prefix}1"]
    trace = pickle.loads(open(paths[1], "rb").read())
    assert any(e["profiling_name"].endswith("all_reduce") for e in trace["entries"])


def _no_named_dump_file(monkeypatch, tmp_path):
    """The recorder on, no dump file named by the job, and the temporary directory in tmp_path."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "16")
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_two_jobs_on_one_host_dump_to_files_of_their_own_in_a_private_directory(
    tmp_path, monkeypatch
):
    """torch's default, /tmp/nccl_trace_rank_<rank>, is one name for every job on the host (the
    second job's dump replaced the first's) in a directory every user can write."""
    _no_named_dump_file(monkeypatch, tmp_path)
    paths = {}
    for job in ("job-a", "job-b"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        paths[job] = flight_recorder.dump(0)
        assert paths[job] == flight_recorder.dump_path(0)
    a, b = paths["job-a"], paths["job-b"]
    assert a != b and os.path.isfile(a) and os.path.isfile(b)
    private = tmp_path / f"resilient-fr-{os.getuid()}"
    for p in (a, b):
        assert Path(p).parent.parent == private and Path(p).name == "nccl_trace_rank_0"
        assert Path(p).parent.stat().st_mode & 0o777 == 0o700
    assert private.stat().st_mode & 0o777 == 0o700
    assert not (tmp_path / "nccl_trace_rank_0").exists()
    assert sorted(os.listdir(Path(a).parent)) == ["nccl_trace_rank_0"]  # no temporary left


@pytest.mark.parametrize("made", ["link", "open"])
def test_a_default_dump_directory_someone_else_made_is_refused_not_written_through(
    tmp_path, monkeypatch, made
):
    _no_named_dump_file(monkeypatch, tmp_path)
    private = tmp_path / f"resilient-fr-{os.getuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if made == "link":  # made first by another user: a link to a directory of the victim's
        private.symlink_to(elsewhere)
        found = "found a link"
    else:
        private.mkdir()
        private.chmod(0o777)
        found = "found open to others (mode 777)"
    with pytest.raises(FlightRecorderError) as e:
        flight_recorder.dump(0)
    assert str(e.value) == (
        f"flight recorder dump directory {private}: expected a directory of uid {os.getuid()}'s "
        f"own with mode 700, {found}; remove it, or set TORCH_FR_DUMP_TEMP_FILE to a path in a "
        f"directory of your own"
    )
    assert list(elsewhere.iterdir()) == [] and isinstance(e.value, OSError)


def test_nccls_own_dump_is_pointed_at_the_jobs_private_directory(tmp_path, monkeypatch):
    """NCCL's watchdog dumps on a collective's timeout to TORCH_FR_DUMP_TEMP_FILE, else to torch's
    shared /tmp/nccl_trace_rank_<rank>: init_process_group names the job's private file first."""
    _no_named_dump_file(monkeypatch, tmp_path)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "")  # (put back as it was, unset, at the end)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    prefix = flight_recorder.name_for_torch()
    private = tmp_path / f"resilient-fr-{os.getuid()}"
    assert (
        prefix
        == os.environ["TORCH_FR_DUMP_TEMP_FILE"]
        == str(Path(flight_recorder.dump_dir()) / "nccl_trace_rank_")
    )
    assert Path(prefix).parent.parent == private
    assert Path(prefix).parent.stat().st_mode & 0o777 == 0o700
    assert flight_recorder.dump_path(3) == f"{prefix}3"  # this toolkit's dump goes there too
    assert flight_recorder.name_for_torch() is None  # named now: left as it is
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    assert flight_recorder.name_for_torch() is None  # the recorder off: nothing named
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ


def test_naming_nccls_dump_file_never_stops_the_job(tmp_path, monkeypatch, caplog):
    """A temporary directory where the private one cannot be made (full, read-only, a file in the
    way) raised out of init_process_group: a debugging aid stopped an NCCL job at its start."""
    from resilient.launch import _name_nccl_dump_file

    _no_named_dump_file(monkeypatch, tmp_path)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "")  # (put back as it was, unset, at the end)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file"))  # mkdir under it fails
    with caplog.at_level("WARNING"):
        _name_nccl_dump_file()
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert "NCCL's own flight recorder dump goes to torch's default file" in caplog.text


def test_a_named_dump_file_is_written_to_a_new_file_never_through_a_link(tmp_path, monkeypatch):
    """The temporary the dump is renamed from was a predictable name (``<path>.tmp<pid>``) opened
    through whatever was there: a link made in a shared directory wrote the dump into its
    target."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "16")
    prefix = str(tmp_path / "trace_rank_")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", prefix)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, f"{prefix}0.tmp{os.getpid()}")
    os.symlink(victim, f"{prefix}0")  # replaced, not followed
    assert flight_recorder.dump(0) == f"{prefix}0"
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(f"{prefix}0") and os.path.getsize(f"{prefix}0") > 0


_DUMP_IN_A_FRESH_PROCESS = """
import importlib, os, pickle, socket, sys
import torch, torch.distributed as dist
from resilient.health import flight_recorder
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
out = {"before": "torch._inductor" in sys.modules}
path = flight_recorder.dump(0)
out["after"] = "torch._inductor" in sys.modules
out["plain"] = pickle.loads(open(path, "rb").read())["entries"][-1].get("frames")
importlib.import_module("torch._inductor")  # as in a job that compiles
out["compiled"] = pickle.loads(open(flight_recorder.dump(0), "rb").read())["entries"][-1]["frames"]
dist.destroy_process_group()
print(repr([out["before"], out["after"], bool(out["plain"]), [f["name"] for f in out["compiled"]]]))
"""


@pytest.mark.distributed
def test_the_dump_on_a_verdict_imports_nothing_heavy(tmp_path):
    """The collectives' call stacks need torch._inductor (with torch._dynamo: over a second of
    CPU when a verdict needs a fast answer): they are in the dump only where it is loaded."""
    env = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": "64",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_rank_"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _DUMP_IN_A_FRESH_PROCESS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after, plain_frames, compiled = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert (before, after, plain_frames) == (False, False, False)
    assert "all_reduce" in compiled


# --- attribution: pure logic ---------------------------------------------------------------------

NOW = 100.0


def _ring(rank, calls, groups=None):
    """calls: (op, group, seq, entered, left or None)."""
    cs = tuple(Call(op, g, seq, 64, t0, t1) for op, g, seq, t0, t1 in calls)
    gs = {}
    for c in cs:
        ranks = (groups or {}).get(c.group, GROUPS.get(c.group, ()))
        old = gs.get(c.group)
        gs[c.group] = GroupState(
            ranks,
            max(c.seq, old.entered if old else 0),
            max(c.seq if not c.inside else c.seq - 1, old.left if old else 0),
        )
    return RankRing(rank, cs, gs, len(cs))


GROUPS = {
    "world [0-3]": (0, 1, 2, 3),
    "tp [0, 1]": (0, 1),
    "tp [2, 3]": (2, 3),
    "ep [0, 2]": (0, 2),
    "ep [1, 3]": (1, 3),
}


def test_one_rank_behind_is_named_with_its_last_collective_and_stack():
    rings = {
        r: _ring(r, [("all_to_all", "world [0-3]", 56, 90, 95.9), ("all_reduce", "world [0-3]", 57, 96, None)])
        for r in (0, 1, 3)
    }  # fmt: skip
    rings[2] = _ring(2, [("all_to_all", "world [0-3]", 56, 90, 95.9)])
    a = attribute_hang(rings, 4, NOW, {2: "loop.py:10 in step\ntrain.py:5 in main"})
    assert a.kind == "missing_rank" and a.culprits == (2,)
    (s,) = a.stuck
    assert (s.op, s.group, s.seq, s.waiting, s.missing) == (
        "all_reduce",
        "world [0-3]",
        57,
        (0, 1, 3),
        (2,),
    )
    assert a.summary.startswith(
        "ranks 0, 1, 3 are in all_reduce #57 on world [0-3]; rank 2 never entered it: it last "
        "left all_to_all #56 on world [0-3] 4.1 s ago and is in no collective, at loop.py:10 in "
        "step <- train.py:5 in main"
    )
    assert a.ranks[2]["last_left"]["seq"] == 56 and a.ranks[2]["stack"].startswith("loop.py")
    json.dumps(a.to_json())  # goes to the event log as is


def test_two_groups_name_the_rank_both_wait_for_and_the_ranks_waiting_behind_them():
    # tp x ep on 4 ranks; rank 1 hangs between steps: rank 0 waits in tp [0, 1], rank 3 in
    # ep [1, 3]; rank 2 waits in ep [0, 2] for rank 0, which is itself waiting
    rings = {
        0: _ring(0, [("all_reduce", "world [0-3]", 12, 80, 81), ("all_reduce", "tp [0, 1]", 40, 82, None)]),
        1: _ring(1, [("all_reduce", "world [0-3]", 12, 80, 81)]),
        2: _ring(2, [("all_reduce", "tp [2, 3]", 40, 82, 82.5), ("all_to_all_single", "ep [0, 2]", 20, 83, None)]),
        3: _ring(3, [("all_reduce", "tp [2, 3]", 40, 82, 82.5), ("all_to_all_single", "ep [1, 3]", 20, 83, None)]),
    }  # fmt: skip
    rings[1].groups["tp [0, 1]"] = GroupState((0, 1), 39, 39)
    rings[1].groups["ep [1, 3]"] = GroupState((1, 3), 19, 19)
    rings[0].groups["ep [0, 2]"] = GroupState((0, 2), 19, 19)
    a = attribute_hang(rings, 4, NOW)
    assert a.kind == "missing_rank" and a.culprits == (1,)
    assert [(s.name(), s.missing) for s in a.stuck[:2]] == [
        ("all_reduce #40 on tp [0, 1]", (1,)),
        ("all_to_all_single #20 on ep [1, 3]", (1,)),
    ]
    assert a.stuck[2].name() == "all_to_all_single #20 on ep [0, 2]" and a.stuck[2].missing == (0,)
    assert (
        "rank 1 never entered either of them: it last left all_reduce #12 on world [0-3]"
        in a.summary
    )
    assert (
        "meanwhile rank 2 is in all_to_all_single #20 on ep [0, 2], waiting for rank 0 (in "
        "all_reduce #40 on tp [0, 1])" in a.summary
    )


def test_a_rank_inside_another_collective_at_the_same_call_is_a_mismatch():
    rings = {r: _ring(r, [("all_reduce", "world [0-3]", 57, 96, None)]) for r in (0, 1, 3)}
    rings[2] = _ring(2, [("all_gather", "world [0-3]", 57, 96, None)])
    a = attribute_hang(rings, 4, NOW)
    assert a.kind == "mismatch" and a.culprits == ()
    assert a.stuck[0].mismatched == {2: "all_gather"}
    assert a.summary == (
        "ranks 0, 1, 3 are in all_reduce #57 on world [0-3] but rank 2 is in all_gather #57 on "
        "the same group: the ranks called different collectives"
    )


def test_every_rank_inside_the_same_collective_puts_the_hang_inside_it():
    rings = {r: _ring(r, [("all_reduce", "world [0-3]", 57, 96 + r / 10, None)]) for r in range(4)}
    a = attribute_hang(rings, 4, NOW)
    assert a.kind == "inside_collective" and a.culprits == ()
    assert a.summary.startswith(
        "ranks 0-3 all entered all_reduce #57 on world [0-3] 4.0 s ago and every member is in "
        "it: the hang is inside the collective"
    )


def test_a_rank_with_an_empty_ring_never_entered_and_says_so():
    rings = {r: _ring(r, [("barrier", "world [0-3]", 1, 96, None)]) for r in (0, 1, 2)}
    rings[3] = RankRing(3, (), {}, 0)  # its ring is on, it made no collective yet
    a = attribute_hang(rings, 4, NOW)
    assert a.kind == "missing_rank" and a.culprits == (3,)
    assert "rank 3 never entered it: it has recorded no collective" in a.summary


def test_ranks_without_a_ring_are_reported_not_blamed():
    rings = {r: _ring(r, [("barrier", "world [0-3]", 1, 96, None)]) for r in (0, 1, 2)}
    rings[3] = None
    a = attribute_hang(rings, 4, NOW)
    assert a.culprits == () and a.stuck[0].unknown == (3,)
    assert "rank 3 published no ring" in a.summary
    off = attribute_hang({r: None for r in range(4)}, 4, NOW)
    assert off.kind == "no_ring" and "RESILIENT_COLLECTIVE_RING=0" in off.summary


def test_a_circular_wait_and_no_collective_at_all_are_told_apart():
    rings = {
        0: _ring(0, [("all_reduce", "tp [0, 1]", 5, 90, None)]),
        1: _ring(1, [("all_to_all", "ep [1, 3]", 5, 90, None)]),
        2: _ring(2, [("all_to_all", "ep [0, 2]", 5, 90, None)]),
        3: _ring(3, [("all_reduce", "tp [2, 3]", 5, 90, None)]),
    }
    for r, ring in rings.items():
        for g, ranks in GROUPS.items():
            if r in ranks and g not in ring.groups:
                ring.groups[g] = GroupState(ranks, 4, 4)
    a = attribute_hang(rings, 4, NOW)
    assert a.kind == "circular" and a.culprits == ()
    assert "different orders" in a.summary
    idle = {r: _ring(r, [("all_reduce", "world [0-3]", 9, 90, 91)]) for r in range(4)}
    b = attribute_hang(idle, 4, NOW)
    assert b.kind == "no_collective" and b.stuck == ()
    assert "ranks 0-3 all_reduce #9 on world [0-3]" in b.summary


# --- groups by key: labels may repeat; the summary's cap on groups -------------------------------


def _same_label_groups(rank, world):
    """Two groups labelled ``dp [0, 1]`` (the same group_desc over the same ranks).  Each rank
    leaves an asynchronous all_reduce pending on a different one of them, then publishes."""
    from resilient.health.ring import install

    side = dist.new_group([0, 1])  # the signal that both ranks published
    ring = install(force=True)
    first, second = dist.new_group([0, 1], group_desc="dp"), dist.new_group([0, 1], group_desc="dp")
    t = torch.ones(2)
    for _ in range(3):
        dist.all_reduce(t, group=first)
    dist.all_reduce(t, group=second)
    # rank 0 enters second's #2, rank 1 first's #4: each waits for the other (a circular wait);
    # counted by label, both would be "dp [0, 1]" #5 and look like one collective every rank is in
    mine, theirs = (second, first) if rank == 0 else (first, second)
    work = dist.all_reduce(t, group=mine, async_op=True)
    summary = ring.summary()
    dist.barrier(group=side)
    dist.all_reduce(t, group=theirs)  # the other's pending call completes
    work.wait()
    return summary


@pytest.mark.distributed
def test_two_groups_with_the_same_label_are_told_apart_by_their_key():
    summaries = run_distributed(_same_label_groups, 2)
    rings = {r: decode_summary(s, r, lambda t: t, 2) for r, s in enumerate(summaries)}
    inside = {r: ring.inside() for r, ring in rings.items()}
    assert {c.label for c in inside.values()} == {"dp [0, 1]"}
    assert inside[0].group != inside[1].group  # one label, two keys
    assert set(rings[0].groups) == set(rings[1].groups)  # each key the same on both ranks
    assert (inside[0].seq, inside[1].seq) == (2, 4)
    a = attribute_hang(rings, 2, NOW)
    assert a.kind == "circular" and a.culprits == ()
    assert sorted((s.group, s.name(), s.waiting, s.missing) for s in a.stuck) == sorted(
        [
            (inside[0].group, "all_reduce #2 on dp [0, 1]", (0,), (1,)),
            (inside[1].group, "all_reduce #4 on dp [0, 1]", (1,), (0,)),
        ]
    )
    assert "rank 0 in all_reduce #2 on dp [0, 1] waiting for rank 1 (in all_reduce #4" in a.summary
    record = a.to_json()
    assert {(s["group"], s["label"]) for s in record["stuck"]} == {
        (inside[0].group, "dp [0, 1]"),
        (inside[1].group, "dp [0, 1]"),
    }


def test_a_rank_is_named_for_the_group_it_missed_not_another_with_the_same_label():
    """Two meshes with a dp axis over ranks 0, 1 (keys "3" and "7"): rank 0 waits in the second's
    call #5; rank 1 never entered it, but made one more call on the first (NCCL returned it).
    Counted by label, rank 1's 14 calls on "dp [0, 1]" would cover rank 0's #14."""
    ring0, ring1 = CollectiveRing(), CollectiveRing()
    for ring, calls in ((ring0, {"7": 4, "3": 9}), (ring1, {"7": 4, "3": 10})):
        for key, n in calls.items():
            g = ring.named("dp [0, 1]", (0, 1), key=key)
            for _ in range(n):
                ring.leave(ring.enter("all_reduce", g, 8))
    ring0.enter("all_gather", ring0.named("dp [0, 1]", (0, 1), key="7"), 8)
    rings = {
        r: decode_summary(ring.summary(), r, lambda t: 96.0, 2)
        for r, ring in enumerate((ring0, ring1))
    }
    assert rings[0].groups["7"] == GroupState((0, 1), 5, 4, "dp [0, 1]")
    a = attribute_hang(rings, 2, NOW)
    assert a.kind == "missing_rank" and a.culprits == (1,)
    (s,) = a.stuck
    assert (s.group, s.label, s.seq, s.missing) == ("7", "dp [0, 1]", 5, (1,))
    assert a.summary.startswith(
        "rank 0 is in all_gather #5 on dp [0, 1]; rank 1 never entered it: it last left "
        "all_reduce #10 on dp [0, 1] 4.0 s ago and is in no collective"
    )
    assert a.ranks[1]["last_left"]["group"] == "dp [0, 1]"  # for people; the key beside it
    assert a.ranks[1]["last_left"]["group_key"] == "3"


def _capped_rings(rank0_inside: bool) -> dict[int, RankRing]:
    """Rank 1 made two calls on g1 (ranks 0, 1), then one on each of 69 groups of its own: its
    summary leaves g1 out.  Rank 0 made two calls on g1, the second still inside or not."""
    ring1 = CollectiveRing()
    g1 = ring1.named("g1 [0, 1]", (0, 1), key="k1")
    ring1.leave(ring1.enter("all_reduce", g1, 8))
    ring1.leave(ring1.enter("all_reduce", g1, 8))
    for i in [*range(2, 70), 0]:
        ring1.leave(ring1.enter("all_reduce", ring1.named(f"g{i} [1]", (1,), key=f"k{i}"), 8))
    ring0 = CollectiveRing()
    g1 = ring0.named("g1 [0, 1]", (0, 1), key="k1")
    ring0.leave(ring0.enter("all_reduce", g1, 8))
    slot = ring0.enter("all_reduce", g1, 8)
    if not rank0_inside:
        ring0.leave(slot)
    return {
        r: decode_summary(ring.summary(), r, lambda t: 96.0, 2)
        for r, ring in enumerate((ring0, ring1))
    }


def test_a_summary_carries_its_calls_groups_then_the_most_recent_and_counts_the_rest():
    ring = CollectiveRing()
    for i in [1, *range(1, 70), 0]:  # g1 twice, then g2 ... g69, then g0
        ring.leave(ring.enter("all_reduce", ring.named(f"g{i}", (0,), key=f"k{i}"), 8))
    d = json.loads(ring.summary())
    assert [c[1] for c in d["calls"]] == [f"k{i}" for i in [*range(63, 70), 0]]
    # the 8 groups of its calls, then the 56 most recently entered others: k1 ... k6 left out
    assert len(d["groups"]) == SUMMARY_GROUPS == 64
    assert set(d["groups"]) == {f"k{i}" for i in [0, *range(7, 70)]} and d["more"] == 6
    assert d["groups"]["k0"] == [[0], 1, 1, "g0"]
    # calling g3 again brings it back in; the least recent of the others (k7) drops out
    ring.leave(ring.enter("all_reduce", ring.named("g3", (0,), key="k3"), 8))
    d = json.loads(ring.summary())
    assert "k3" in d["groups"] and "k7" not in d["groups"] and d["more"] == 6


def test_a_member_whose_summary_left_the_group_out_is_unknown_not_missing():
    rings = _capped_rings(rank0_inside=True)
    assert "k1" not in rings[1].groups and rings[1].more == 6
    a = attribute_hang(rings, 2, NOW)
    (s,) = a.stuck
    assert (s.waiting, s.missing, s.done, s.unknown) == ((0,), (), (), (1,))
    assert a.kind == "inside_collective" and a.culprits == ()  # not a false accusation of rank 1
    assert a.summary == (
        "rank 0 entered all_reduce #2 on g1 [0, 1] 4.0 s ago and no member is known to have "
        "missed it (rank 1 is unknown): the hang is inside the collective (the transport or a "
        "device) or with it; whether rank 1 entered all_reduce #2 on g1 [0, 1] is unknown: its "
        "ring summary left the group out (a summary carries the 64 groups used most recently)"
    )
    # nobody inside: rank 1 is not "behind" on a group its summary left out
    idle = attribute_hang(_capped_rings(rank0_inside=False), 2, NOW)
    assert idle.kind == "no_collective" and idle.culprits == ()
    # the same summary with nothing left out: rank 1 never entered g1, and is named
    rings[1] = RankRing(1, rings[1].calls, rings[1].groups, rings[1].count, more=0)
    b = attribute_hang(rings, 2, NOW)
    assert b.kind == "missing_rank" and b.culprits == (1,)


# --- through a real store: the summary and the leader's record ------------------------------------


def test_the_summary_goes_through_a_tcpstore_with_the_heartbeat_and_reads_back(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ring = CollectiveRing()
    g = ring.named("tp [0, 1]", (0, 1))
    ring.leave(ring.enter("all_reduce", g, 1024))
    ring.enter("all_to_all_single", ring.named("ep [0, 2]", (0, 2)), 2048)
    m = Monitor(
        server,
        "run/0",
        0,
        1,
        DetectorConfig(interval_s=0.1),
        events=EventLog(str(tmp_path / "e.jsonl")),
        on_failure=lambda f: None,
        kill_local=False,
        ring=ring,
    )
    try:
        client = dist.TCPStore("127.0.0.1", server.port, 1, False)
        back = decode_summary(client.get("run/0/ring/0"), 0, lambda t: t)
        assert [(c.op, c.group, c.seq, c.nbytes, c.inside) for c in back.calls] == [
            ("all_reduce", "tp [0, 1]", 1, 1024, False),
            ("all_to_all_single", "ep [0, 2]", 1, 2048, True),
        ]
        assert back.groups["ep [0, 2]"] == GroupState((0, 2), 1, 0, "ep [0, 2]")
        ring.enter("barrier", g, None)  # the next beat carries it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            back = decode_summary(client.get("run/0/ring/0"), 0, lambda t: t)
            if back.count == 3:
                break
            time.sleep(0.05)
        assert back.count == 3 and back.inside().op == "barrier"
    finally:
        m.close()


def test_on_hung_the_leader_logs_which_collective_and_which_rank_never_entered(tmp_path):
    """Four monitors on one TCPStore, each with its own ring: ranks 0, 2, 3 enter all_reduce #3
    on the world and stop there; rank 1 stops progressing before it."""
    server = dist.TCPStore("127.0.0.1", 0, 5, True, wait_for_workers=False)
    events = EventLog(str(tmp_path / "events.jsonl"))
    config = DetectorConfig(
        interval_s=0.2, dead_after_intervals=10, startup_dead_after_intervals=10, hang_timeout_s=2.0
    )
    failures: dict[int, list] = {r: [] for r in range(4)}
    rings, monitors = {}, {}
    for r in range(4):
        rings[r] = ring = CollectiveRing()
        world = ring.named("world [0-3]", range(4))
        for _ in range(2):
            ring.leave(ring.enter("all_reduce", world, 8))
        client = dist.TCPStore("127.0.0.1", server.port, 5, False)
        monitors[r] = Monitor(
            client,
            "run/0",
            r,
            4,
            config,
            events=events,
            on_failure=failures[r].append,
            kill_local=False,
            ring=ring,
        )
    stop = threading.Event()

    def drive(r):
        for step in range(1, 10_000):
            if stop.is_set() or (r == 1 and step > 3):
                return
            monitors[r].progress(step, "train")
            if r != 1 and step == 3:
                rings[r].enter("all_reduce", rings[r].named("world [0-3]", ()), 8)
                return  # inside it for good
            time.sleep(0.05)

    threads = [threading.Thread(target=drive, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not failures[0]:
            time.sleep(0.05)
        assert failures[0] and failures[0][0].verdict.value == "HUNG"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            att = [e for e in events.read() if e["event"] == "hang_attribution"]
            if att:
                break
            time.sleep(0.05)
        (a,) = att
        assert a["kind"] == "missing_rank" and a["culprits"] == [1]
        assert a["summary"].startswith(
            "ranks 0, 2, 3 are in all_reduce #3 on world [0-3]; rank 1 never entered it: it last "
            "left all_reduce #2 on world [0-3]"
        )
        assert a["flight_recorder"].startswith("off")
        # rank 1 published its main thread's stack (here: this test's), and it is in the record
        assert a["ranks"]["1"]["stack"].startswith("tests/test_ring.py:")
        assert a["verdict_rank"] is None  # every rank stalled: the detector alone names none
        assert list(monitors[0].attribution["culprits"]) == [1]
    finally:
        stop.set()
        for m in monitors.values():
            m.close()


@pytest.mark.parametrize(
    "published",
    [
        b"[1]",
        b'{"stack": 5, "flight_recorder": 7}',
        b'{"stack": ["a"], "flight_recorder": {"x": 1}}',
        b"[" * 100_000,
        b'{"stack": "' + b"x" * (4 << 20) + b'"}',
        b"\xff\xfe",
    ],
)
def test_a_garbled_stack_in_the_store_costs_that_stack_not_the_attribution(tmp_path, published):
    """The stack a rank published (a broken rank, another job's value under the key): anything
    but a stack is no stack, a long one is cut; the comparison of the rings still names rank 1."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ring0, ring1 = CollectiveRing(), CollectiveRing()
    world = ring0.named("world [0, 1]", (0, 1))
    ring0.leave(ring0.enter("all_reduce", world, 8))
    ring0.enter("all_reduce", world, 8)  # inside #2 for good
    w1 = ring1.named("world [0, 1]", (0, 1))
    ring1.leave(ring1.enter("all_reduce", w1, 8))  # left #1, never entered #2
    server.set("run/0/ring/1", ring1.summary())
    server.set("run/0/stack/1", published)
    events = EventLog(str(tmp_path / "events.jsonl"))
    m = Monitor(
        server,
        "run/0",
        0,
        2,
        DetectorConfig(interval_s=0.1, startup_dead_after_intervals=10_000, join_timeout_s=600),
        events=events,
        on_failure=lambda f: None,
        kill_local=False,
        ring=ring0,
    )
    try:
        finding = Finding(Verdict.HUNG, 1, "h", 0, 3, "train", 9.0, 0.1, "no progress")
        m._attribute(finding, "loop.py:1 in step", None)
    finally:
        m.close()
    (a,) = [e for e in events.read() if e["event"] == "hang_attribution"]
    assert "error" not in a, a.get("error")
    assert a["kind"] == "missing_rank" and a["culprits"] == [1]
    assert a["summary"].startswith(
        "rank 0 is in all_reduce #2 on world [0, 1]; rank 1 never entered it: it last left "
        "all_reduce #1 on world [0, 1]"
    )
    stack = a["ranks"]["1"].get("stack")
    assert stack is None or len(stack) <= MAX_STACK_CHARS + 40
    assert len(json.dumps(a)) < 64 << 10


def test_the_main_thread_stack_is_innermost_first():
    stack = main_thread_stack()
    assert stack.splitlines()[0].endswith("in test_the_main_thread_stack_is_innermost_first")


def test_on_nccl_a_rank_behind_its_groups_newest_call_is_named_though_nobody_is_inside():
    """NCCL returns from a collective once it is queued: the others have "left" all_reduce #71
    and block later; rank 2 never entered it."""
    rings = {
        r: _ring(
            r,
            [
                ("all_reduce", "world [0-3]", 70, 90, 91),
                ("all_reduce", "world [0-3]", 71, 92, 92.1),
            ],
        )
        for r in (0, 1, 3)
    }
    rings[2] = _ring(2, [("all_reduce", "world [0-3]", 70, 90, 91)])
    a = attribute_hang(rings, 4, NOW, {2: "train.py:10 in data\nloop.py:3 in steps"})
    assert a.kind == "behind" and a.culprits == (2,)
    assert "ranks 0, 1, 3 entered all_reduce #71 on world [0-3] and rank 2 never did" in a.summary
    assert "rank 2 last left all_reduce #70 on world [0-3], at train.py:10 in data" in a.summary


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b'{"v": 2, "calls": {}}',
        b'{"v": 2, "calls": [["all_reduce", ["g"], 1, 4, 0, 1, false]]}',
        b'{"v": 2, "calls": [[1, 2, 3]]}',
        b'{"v": 2, "calls": [["all_reduce", "g", null, 4, 0, 1, false]], "groups": '
        b'{"g": [[0, 1], 1, 1, "g"]}}',
        b'{"v": 2, "calls": [["all_reduce", "g", 1, 4, "0", 1, false]], "groups": '
        b'{"g": [[0, 1], 1, 1, "g"]}}',
        b'{"v": 2, "groups": {"g": [{"start": 0, "stop": 300000000, "step": 1}, 1, 1, "g"]}}',
        b'{"v": 2, "groups": {"g": [[0, -1, 99], 1, 1, "g"]}}',
        b'{"v": 2, "groups": {"g": [{"start": 0, "stop": 4, "step": 0}, 1, 1, "g"]}}',
        b'{"v": 2, "calls": [["all_reduce", "g", 1, 4, 1' + b"0" * 400 + b", 1, false]], "
        b'"groups": {"g": [[0, 1], 1, 1, "g"]}}',
        b'{"v": 2, "calls": [["all_reduce", "g", 1, 4, Infinity, 1, false]], "groups": '
        b'{"g": [[0, 1], 1, 1, "g"]}}',
        b'{"v": 2, "groups": {"g": [[0, 1], null, 1, "g"]}}',
        b'{"v": 2, "n": "many"}',
        b"[" * 5000 + b"]" * 5000,
        b"x" * (2 << 20),
    ],
)
def test_a_malformed_summary_is_a_valueerror_not_a_crash_or_a_huge_allocation(raw):
    with pytest.raises(ValueError):
        decode_summary(raw, 1, lambda t: t, 4)


def test_a_summary_cannot_unpack_to_more_ranks_than_a_summary_carries():
    """250 KB of JSON (4096 groups, each a range over a world of 4096) unpacked to 16 million
    ranks: 800 MB at the leader, per such rank, in the middle of answering a HUNG verdict."""
    world = 4096
    groups = {f"g{i}": [{"start": 0, "stop": world, "step": 1}, 1, 1, ""] for i in range(200)}
    with pytest.raises(ValueError) as e:
        decode_summary(json.dumps({"v": 2, "groups": groups}), 1, lambda t: t, world)
    assert str(e.value) == (
        "rank 1's ring summary, group 'g72': rank range {'start': 0, 'stop': 4096, 'step': 1} "
        "holds 4096 ranks, more than the 0 left to it (a summary lists at most 72 groups' worth "
        "of the world's ranks)"
    )
    many = {f"g{i}": [list(range(4)), 1, 1, ""] for i in range(73)}  # lists count too
    with pytest.raises(ValueError, match="group 'g72': 4 ranks, more than the 0 left to it"):
        decode_summary(json.dumps({"v": 2, "groups": many}), 1, lambda t: t, 4)
    # what a real summary carries still reads: its groups, each up to the world
    ok = {f"g{i}": [{"start": 0, "stop": world, "step": 1}, 1, 1, ""] for i in range(72)}
    ring = decode_summary(json.dumps({"v": 2, "groups": ok}), 1, lambda t: t, world)
    assert len(ring.groups) == 72 and ring.groups["g71"].ranks == tuple(range(world))


@pytest.mark.parametrize(
    "summary, message",
    [
        ({"v": 1, "calls": [], "groups": {}}, "rank 1's ring summary is version 1, this reader "
         "reads version 2: every rank must run the same resilient"),
        ({"calls": [], "groups": {}}, "is version None, this reader reads version 2"),
        ({"v": "2"}, "is version '2', this reader reads version 2"),
        ({"v": 2, "groups": {"7": [[0, 1], 1, 1]}}, "malformed group '7': expected [ranks, "
         "entered, left, label], got [[0, 1], 1, 1]"),
        ({"v": 2, "groups": {"7": [[0, 1], 1, 1, 5]}}, "malformed label for group '7': expected "
         "a string of at most 200 characters, got 5"),
        ({"v": 2, "groups": {"7": [[0, 1], 1, 1, "dp" * 101]}}, "malformed label for group '7'"),
        ({"v": 2, "groups": {"k" * 201: [[0, 1], 1, 1, "dp"]}}, "a group key of 201 characters "
         "(at most 200)"),
        ({"v": 2, "calls": [["barrier", "7", 1, None, 0.5, None, 0]], "groups": {}}, "a call on "
         "group '7' that its groups do not describe"),
        ({"v": 2, "n": 3, "more": -1}, "malformed count (n 3, more -1): expected integers >= 0"),
    ],
)  # fmt: skip
def test_a_summary_of_another_version_or_with_a_bad_group_says_what_is_wrong(summary, message):
    with pytest.raises(ValueError) as e:
        decode_summary(json.dumps(summary), 1, lambda t: t, 4)
    assert message in str(e.value)


def _compiled_all_reduce(rank, world):
    from resilient.health.ring import install

    ring = install(force=True)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        dist.all_reduce(x)
        return x * 2

    out = f(torch.ones(3))
    return out.tolist(), ring.count


@pytest.mark.distributed
def test_torch_compile_traces_through_the_wrappers_in_one_graph():
    (out, count), _ = run_distributed(_compiled_all_reduce, 2)
    assert out == [4.0, 4.0, 4.0]  # summed over 2 ranks, then doubled
    assert count == 0  # compiled calls go to torch's own function (not recorded)
