"""Commits that cannot tear, generations that never collide, conversions that never eat their source,
readers that race retention, and loads that are all or nothing."""

import contextlib
import json
import os
import threading
import time

import fsspec
import pytest
import torch

from resilient import Checkpointer
from resilient.checkpoint.format import MANIFEST_NAME
from resilient.checkpoint.storage import PinnedFiles, Storage
from resilient.errors import (
    CheckpointCorruptError,
    LeaseError,
    ResilientError,
    StateMismatchError,
    StepRetiredError,
    StorageError,
)
from tests.dist import run_distributed


def state(v: float, n: int = 3000) -> dict:
    return {"w": torch.arange(float(n)) * v, "v": {"s": v}}


def blank(n: int = 3000) -> dict:
    return {"w": torch.zeros(n), "v": {"s": 0.0}}


# --- the commit method, per backend ------------------------------------------------------------


def test_commit_methods_per_backend(tmp_path, s3):
    assert Storage(str(tmp_path)).commit_method == "rename"
    assert Storage(f"file://{tmp_path}").commit_method == "rename"
    dirfs = Storage("dir::file://", {"path": str(tmp_path)})
    assert dirfs.is_local and dirfs.commit_method == "rename"  # dir:: over a local disk is one
    assert Storage("memory://x").commit_method == "put"
    assert Storage(f"s3://{s3.new_bucket()}/r", s3.options).commit_method == "put"
    assert Storage(f"faulty://{tmp_path}").commit_method == "rename"
    assert Storage("dir::memory://", {"path": "/x"}).commit_method == "put"  # a path prefix
    for url in [
        f"simplecache::file://{tmp_path}/c",  # a caching wrapper around a local disk
        "http://127.0.0.1:9/x",  # no atomic publish known
    ]:
        assert Storage(url).commit_method is None, url


def test_a_filesystem_without_an_atomic_publish_is_refused_with_the_reason(tmp_path):
    url = f"simplecache::file://{tmp_path}/c"
    with Checkpointer(url) as ck:
        ck.save(1, state(1))
        with pytest.raises(StorageError, match=r"cannot commit checkpoints to .*commit_method="):
            ck.wait()
    assert not (tmp_path / "c" / "step_00000001").exists()  # nothing was written
    # the user may vouch for it
    with Checkpointer(f"dir::file://{tmp_path}/d", commit_method="rename") as ck:
        ck.save(1, state(1)).wait()
        assert ck.steps() == [1]


def test_a_torn_manifest_never_counts_and_retention_keeps_the_good_steps(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=2) as ck:
        for s in (1, 2, 3):
            ck.save(s, state(s)).wait()
    assert Checkpointer(str(tmp_path)).steps() == [2, 3]
    # a store without atomic writes left half a manifest for step 4
    step4 = tmp_path / "step_00000004"
    step4.mkdir()
    good = (tmp_path / "step_00000003" / MANIFEST_NAME).read_text()
    (step4 / MANIFEST_NAME).write_text(good.replace('"step": 3', '"step": 4')[: len(good) // 2])
    with Checkpointer(str(tmp_path), keep_last=2) as ck:
        assert ck.steps() == [2, 3] and ck.latest_step() == 3
        ck.save(5, state(5)).wait()
        # 4 counted for nothing: the newest two real commits are kept, and 4 is left alone
        assert ck.steps() == [3, 5]
        out = blank()
        assert ck.load(out, step=3) == 3 and out["v"]["s"] == 3
    assert (step4 / MANIFEST_NAME).exists()


# --- generations: agreed by the coordinator, never the name of an existing file ----------------


def test_a_resave_never_writes_under_an_existing_name(tmp_path, monkeypatch):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(5, state(5)).wait()
    step = tmp_path / "step_00000005"
    # leftovers of interrupted re-saves, hard-linked to a file outside (truncating them through
    # the link would destroy it), including the name the old clock-derived rule would pick
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"not yours")
    import time

    monkeypatch.setattr(time, "time", lambda: 1_700_000_123.0)
    for g in (1, 2, 1 + 1_700_000_123 % 1000):
        os.link(outside, step / f"rank_00000.g{g}.safetensors")
    # and a damaged committed manifest (the old rule fell back to the clock then)
    m = (step / MANIFEST_NAME).read_text()
    (step / MANIFEST_NAME).write_text(m[:-10])
    monkeypatch.undo()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(5, state(55)).wait()
        man = ck.manifest(5)
        assert man.generation == 1 + 1_700_000_123 % 1000 + 1
        assert list(man.files) == [f"rank_00000.g{man.generation}.safetensors"]
        out = blank()
        assert ck.load(out) == 5 and out["v"]["s"] == 55
    assert outside.read_bytes() == b"not yours"
    assert sorted(p.name for p in step.iterdir()) == [
        MANIFEST_NAME,
        f"rank_00000.g{man.generation}.safetensors",
    ]


def _two_rank_resave(rank, world, url):
    import time as time_mod

    import torch.distributed

    from resilient import Layout, Shard, sharded

    lay = Layout(tp=2)
    if rank == 1:  # this rank's clock is off by a second: a per-rank rule would disagree
        real = time_mod.time
        time_mod.time = lambda: real() + 1.0
    with Checkpointer(url, layout=lay) as ck:
        ck.save(3, {"w": sharded(torch.full((8,), 1.0 + rank), {"tp": Shard(0)})}).wait()
        if rank == 0:  # the committed manifest is damaged: no generation to read from it
            p = os.path.join(url, "step_00000003", MANIFEST_NAME)
            with open(p, "r+") as f:
                f.truncate(20)
        torch.distributed.barrier()
        ck.save(3, {"w": sharded(torch.full((8,), 10.0 + rank), {"tp": Shard(0)})}).wait()
        return {k: v.rank for k, v in ck.manifest(3).files.items()}


@pytest.mark.distributed
def test_every_rank_writes_the_generation_the_coordinator_picked(tmp_path):
    files = run_distributed(_two_rank_resave, 2, str(tmp_path))[0]
    assert files == {"rank_00000.g1.safetensors": 0, "rank_00001.g1.safetensors": 1}


# --- convert onto its own source ----------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["dot", "slash", "dotdot", "symlink", "file"])
def test_convert_refuses_its_own_source_under_any_spelling(tmp_path, spelling):
    from reshape.execute import DestinationExistsError, convert

    src = tmp_path / "ckpt"
    with Checkpointer(str(src)) as ck:
        ck.save(7, state(7)).wait()
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(src)
    dst = {
        "dot": f"{src}/.",
        "slash": f"{src}/",
        "dotdot": f"{tmp_path}/sub/../ckpt",
        "symlink": str(tmp_path / "link"),
        "file": f"file://{src}",
    }[spelling]
    with pytest.raises(DestinationExistsError, match="is the source"):
        convert(str(src), dst, {"dp": 1}, overwrite=True)
    with Checkpointer(str(src)) as ck:
        out = blank()
        assert ck.load(out) == 7 and ck.verify(7).ok


def test_convert_overwrite_keeps_the_old_target_step_until_the_new_one_commits(tmp_path):
    from reshape.execute import convert

    with Checkpointer(str(tmp_path / "a")) as ck:
        ck.save(1, state(1)).wait()
    convert(str(tmp_path / "a"), str(tmp_path / "b"), {"dp": 1})
    opts = {"faults": [{"op": "write", "error": "permanent", "path": "step_00000001/rank_"}]}
    with pytest.raises(StorageError):
        convert(
            str(tmp_path / "a"),
            f"faulty://{tmp_path / 'b'}",
            {"dp": 1},
            overwrite=True,
            dst_options=opts,
        )
    with Checkpointer(str(tmp_path / "b")) as ck:  # the old target step is still committed
        out = blank()
        assert ck.load(out) == 1 and ck.verify(1).ok


# --- readers while retention retires the step they read ------------------------------------------


@pytest.mark.parametrize("pause_at", ["size", "read_into"])
def test_a_step_retired_while_it_is_read_says_so(tmp_path, monkeypatch, pause_at):
    """Retired before this rank's files are open: StepRetiredError.  Retired after (a local load
    holds its files open from the size check on): the load reads the retired step's intact bytes."""
    writer = Checkpointer(str(tmp_path), keep_last=1)
    writer.save(1, state(1)).wait()
    reader = Checkpointer(str(tmp_path))
    reading, retired = threading.Event(), threading.Event()

    def pausing(real):
        def wrapper(self, rel, *a):
            if "rank_" in rel and not reading.is_set():
                reading.set()
                assert retired.wait(60)  # retention runs while this read is under way
            return real(self, rel, *a)

        return wrapper

    # a local load reads through files it holds open; other stores through Storage
    for cls in (Storage, PinnedFiles):
        monkeypatch.setattr(cls, pause_at, pausing(getattr(cls, pause_at)))
    box = {}
    out = blank()
    t = threading.Thread(target=lambda: box.update(r=_try(lambda: reader.load(out))))
    t.start()
    assert reading.wait(60)
    writer.save(2, state(2)).wait()  # keep_last=1: step 1 is retired...
    writer.wait()  # ...and, once the save's thread is done, its files are deleted
    assert not (tmp_path / "step_00000001").exists()
    retired.set()
    t.join(60)
    err = box["r"]
    if pause_at == "read_into":
        assert err == 1 and torch.equal(out["w"], state(1)["w"]), err
    else:
        assert isinstance(err, StepRetiredError), err
        assert "step 1 of" in str(err) and "retired (its manifest was removed)" in str(err)
        assert "not corruption" in str(err)
    monkeypatch.undo()
    out = blank()
    assert reader.load(out) == 2  # reading again finds the newest step
    writer.close()
    reader.close()


def test_verify_of_a_step_retired_meanwhile_is_not_a_corruption_report(tmp_path, monkeypatch):
    from resilient.checkpoint.reader import verify_step

    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state(1)).wait()
    storage = Storage(str(tmp_path))
    real = Storage.read_into

    def read_into(self, rel, start, out):
        Storage(str(tmp_path)).remove(f"step_00000001/{MANIFEST_NAME}")  # retired now
        Storage(str(tmp_path)).remove_tree("step_00000001")
        return real(self, rel, start, out)

    monkeypatch.setattr(Storage, "read_into", read_into)
    with pytest.raises(StepRetiredError, match="step 1 of .* was retired"):
        verify_step(storage, 1)


def _try(fn):
    try:
        return fn()
    except BaseException as e:
        return e


# --- all or nothing -------------------------------------------------------------------------------


# local: checked with the files held open, then read in place; zstd and memory://: into scratch
@pytest.mark.parametrize("how", ["local", "local-zstd", "memory"])
def test_a_failed_load_leaves_the_state_as_it_was(tmp_path, how):
    def full(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 64)
        return {"model": model, "optim": torch.optim.AdamW(model.parameters()), "v": {"s": seed}}

    src = full(1)
    src["model"](torch.randn(2, 64)).sum().backward()
    src["optim"].step()
    url = f"memory://{tmp_path.name}" if how == "memory" else str(tmp_path)
    zstd = "zstd" if how == "local-zstd" else None
    with Checkpointer(url, block_bytes=4096, compression=zstd) as ck:
        ck.save(1, src).wait()
    # the last block of the rank file is corrupt: most tensors read fine before it fails
    fs, path = fsspec.core.url_to_fs(url)
    f = f"{path}/step_00000001/rank_00000.safetensors"
    data = bytearray(fs.cat_file(f))
    data[-3] ^= 0xFF
    fs.pipe_file(f, bytes(data))
    dst = full(2)
    before = {k: v.clone() for k, v in dst["model"].state_dict().items()}
    with Checkpointer(url) as ck:
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            ck.load(dst)
        assert ck.storage.is_local == (how != "memory")
    for k, v in dst["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    assert dst["v"] == {"s": 2}
    assert not dst["optim"].state  # the lazily created optimizer state is gone again


def test_a_mismatched_state_raises_before_changing_anything(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"w": torch.ones(8), "u": torch.ones(4), "v": {"s": 1}}).wait()
        dst = {"w": torch.zeros(8), "u": torch.zeros(5), "v": {"s": 0}}
        with pytest.raises(StateMismatchError, match="tensor 'u'"):
            ck.load(dst)
        assert not dst["w"].any() and dst["v"] == {"s": 0}


def test_the_lease_file_is_not_a_step(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state(1))
        ck.wait()
        assert (tmp_path / "LEASE.json").exists()
        assert json.loads((tmp_path / "LEASE.json").read_text())["format"] == "resilient-lease-v1"
        assert ck.steps() == [1]
    assert fsspec  # (the module is used by the backend fixtures)


# --- reading in place: check every byte first, then read it again into the state ---------------


def _saved(tmp_path, n=1 << 20):
    src = {"w": torch.randn(n), "v": {"s": 1}}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, src).wait()
    return src


def test_a_local_load_holds_no_copy_of_the_state(tmp_path):
    from tests.peak import PeakGrowth

    n = 32 << 20  # 128 MiB of float32
    src = _saved(tmp_path, n)
    dst = {"w": torch.zeros(n), "v": {"s": 0}}
    dst["w"].fill_(0.5)  # fault the destination in before measuring
    with Checkpointer(str(tmp_path)) as ck, PeakGrowth() as p:
        ck.load(dst)
    assert torch.equal(dst["w"], src["w"])
    # a scratch copy of the state would raise the peak by 128 MiB; the check's ring is bounded
    # (at most 2 x 4 reads of 8 MiB in flight)
    assert p.mib < 96, f"the load raised the peak by {p.mib:.0f} MiB"


def test_what_loads_is_what_was_checked_even_if_the_file_is_replaced_meanwhile(
    tmp_path, monkeypatch
):
    src = _saved(tmp_path)
    f = tmp_path / "step_00000001" / "rank_00000.safetensors"
    agree = Checkpointer._agree

    def replace_then_agree(self, *a, **k):
        # as a re-save would: a new file renamed over the checked one, between check and apply
        other = bytearray(f.read_bytes())
        other[-4096:] = bytes(4096)
        tmp = f.with_suffix(".new")
        tmp.write_bytes(bytes(other))
        os.replace(tmp, f)
        return agree(self, *a, **k)

    monkeypatch.setattr(Checkpointer, "_agree", replace_then_agree)
    dst = {"w": torch.zeros(1 << 20), "v": {"s": 0}}
    with Checkpointer(str(tmp_path)) as ck:
        ck.load(dst)
    assert torch.equal(dst["w"], src["w"])  # the checked bytes, not the replacement's zeros


def test_a_failure_reading_in_place_after_the_check_says_the_state_changed(tmp_path, monkeypatch):
    import errno

    import resilient.checkpoint.storage as storage_mod

    _saved(tmp_path)
    checked = threading.Event()
    agree, pread_into = Checkpointer._agree, storage_mod._pread_into

    def agree_then_mark(self, *a, **k):
        checked.set()
        return agree(self, *a, **k)

    def failing_after_check(fd, start, out):
        if checked.is_set():
            raise OSError(errno.EIO, "Input/output error")
        return pread_into(fd, start, out)

    monkeypatch.setattr(Checkpointer, "_agree", agree_then_mark)
    monkeypatch.setattr(storage_mod, "_pread_into", failing_after_check)
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(StorageError, match="partly overwritten"):
            ck.load({"w": torch.zeros(1 << 20), "v": {"s": 0}})


def _open_step_files(tmp_path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(tmp_path)) and "step_" in target:
                out.append(target)
    return out


@pytest.mark.parametrize("exc", [RuntimeError("the process group failed"), KeyboardInterrupt()])
def test_a_load_whose_agreement_fails_lets_its_files_go(tmp_path, monkeypatch, exc):
    """The files held open between the check and the apply are closed when the agreement between
    ranks raises (a peer died, Ctrl-C), and the state is as it was."""
    _saved(tmp_path)
    dst = {"w": torch.zeros(1 << 20), "v": {"s": 0}}

    def agree(self, *a):
        raise exc

    monkeypatch.setattr(Checkpointer, "_agree", agree)
    with Checkpointer(str(tmp_path)) as ck:
        for _ in range(3):
            with pytest.raises(type(exc)):
                ck.load(dst)
            assert _open_step_files(tmp_path) == []
    assert not dst["w"].any() and dst["v"] == {"s": 0}


def test_an_interrupted_apply_says_the_state_was_partly_overwritten(tmp_path, monkeypatch):
    """Ctrl-C while a checked step is read into the state: the interrupt goes through, with a note
    that the state is partly overwritten, and the files are closed."""
    from resilient.checkpoint import storage as storage_mod

    _saved(tmp_path, 4 << 20)
    dst = {"w": torch.zeros(4 << 20), "v": {"s": 0}}
    real = storage_mod.PinnedFiles.read_into
    calls = {"n": 0}
    checked = threading.Event()

    def read_into(self, rel, start, out):
        if checked.is_set():
            calls["n"] += 1
            if calls["n"] > 1:
                raise KeyboardInterrupt
        return real(self, rel, start, out)

    real_agree = Checkpointer._agree

    def agree(self, *a):
        got = real_agree(self, *a)
        checked.set()
        return got

    monkeypatch.setattr(storage_mod.PinnedFiles, "read_into", read_into)
    monkeypatch.setattr(Checkpointer, "_agree", agree)
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(KeyboardInterrupt) as info:
            ck.load(dst)
    assert any("partly overwritten" in n for n in getattr(info.value, "__notes__", []))
    assert _open_step_files(tmp_path) == []


def test_reading_into_the_state_counts_as_an_in_place_write_for_autograd(tmp_path):
    """The second pass writes the tensors' memory directly: their version moves, as after copy_,
    so a graph that saved one of them refuses to backward instead of using the new values."""
    _saved(tmp_path)
    w = torch.zeros(1 << 20, requires_grad=True)
    y = (w * w).sum()  # saves w for backward
    before = w._version
    with Checkpointer(str(tmp_path)) as ck:
        ck.load({"w": w, "v": {"s": 0}})
    assert w._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


class _Counting:
    """A real TCPStore client that counts the requests made through it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            self.calls += 1
            return attr(*a, **k)

        return call


def _store():
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))


def test_the_coordinator_gathers_a_thousand_reports_in_two_requests():
    """Rank 0 waits for every report at once and reads them in one request, not two per rank:
    a thousand ranks would otherwise be two thousand round trips per commit."""
    from resilient.checkpoint.writer import Committer

    world = 1000
    server = _store()
    for r in range(1, world):
        server.set(f"p/report/{r}", json.dumps({"rank": r, "file": f"rank_{r:05d}"}))
    counting = _Counting(server)
    c = Committer(counting, "p", 0, world, timeout_s=30)
    reports = c.gather({"rank": 0})
    assert [r["rank"] for r in reports] == list(range(world))
    assert counting.calls <= 2


def test_a_commit_that_times_out_names_the_ranks_that_did_not_report():
    from resilient.checkpoint.writer import CommitError, Committer

    world = 12
    server = _store()
    for r in range(1, world):
        if r not in (5, 9):
            server.set(f"p/report/{r}", "{}")
    c = Committer(server, "p", 0, world, timeout_s=0.5)
    with pytest.raises(CommitError, match=r"ranks 5, 9 did not report its file"):
        c.gather({"rank": 0})


# steps whose file fails to be written on a rank: its own failure reported (rank 1), or the
# coordinator's, after every other rank reported (rank 0); twice in a row, then once more
FAILING = {5: 1, 6: 0, 9: 0}


def _store_keys_over_commits(
    rank: int, world: int, url: str, memory: str, fail: bool
) -> list[int | None]:
    import torch.distributed as dist

    import resilient.checkpoint.checkpointer as ckm
    from resilient.checkpoint.writer import CommitError

    store = dist.distributed_c10d._get_default_store()
    state = {"w": torch.arange(8.0) + rank}
    counts: list[int | None] = []
    kw = {"memory_every": 1, "persister": memory == "persister"} if memory != "durable" else {}
    with Checkpointer(url, **kw) as ck:

        def failing(write):
            def write_or_fail(*a, **k):
                if fail and FAILING.get(step) == rank:
                    raise OSError(f"no space left for step {step} (injected)")
                return write(*a, **k)

            return write_or_fail

        ck_write = ckm.persist_rank_file  # (with the persister: a durable save after a failed
        if memory != "memory tier":  # snapshot is written by this process, as without one)
            ckm.persist_rank_file = failing(ck_write)
        if memory != "durable":
            ck._memory._slots.persist = failing(ck._memory._slots.persist)
        try:
            for step in range(1, 16):
                state["w"] += 1
                # as Run does: a snapshot every step, and with the persister a durable save
                # of it, which the persister commits to the URL
                handle = ck.snapshot(step, state) if memory != "durable" else None
                if memory != "memory tier":
                    handle = ck.save(step, state)
                try:
                    handle.wait()
                    ok = True
                except CommitError:
                    ok = False
                if memory == "persister":  # the snapshot's own outcome, as Run joins it
                    with contextlib.suppress(CommitError):
                        ck.wait_snapshot()
                assert ok == (not fail or step not in FAILING), step
                dist.barrier()  # every rank's commit is over, its clean-up included
                counts.append(store.num_keys() if ok else None)
                dist.barrier()
        finally:
            ckm.persist_rank_file = ck_write
    return counts


@pytest.mark.parametrize("fail", [False, True], ids=["", "failures"])
@pytest.mark.parametrize("memory", ["durable", "memory tier", "persister"])
def test_the_store_holds_a_bounded_number_of_commit_keys(tmp_path, monkeypatch, memory, fail):
    """Each commit's keys go (begin, every report, and the outcome at the next commit): a run
    that saves every step does not grow the c10d store (it grew by one key per commit).  Nor
    does one whose commits fail now and then (a failed commit's keys stayed: its begin, the
    reports, its outcome), nor the durable saves a persister commits (their outcome stayed)."""
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(tmp_path / "shm"))
    args = (str(tmp_path / "ck"), memory, fail)
    counts = run_distributed(_store_keys_over_commits, 2, *args)[0]
    steady, settled = counts[3], [c for c in counts[3:] if c is not None]
    assert len(settled) == len(counts[3:]) - (len(FAILING) if fail else 0)
    assert settled[-5:] == [steady] * 5, counts  # where it was before the failures
    # With the persister, a durable save after a failed snapshot is written by this process,
    # through a commit with reports, whose outcome stays until the next save (as any such one's)
    extra = 1 if fail and memory == "persister" else 0
    assert all(steady <= c <= steady + extra for c in settled), counts


def test_a_peers_abandon_does_not_make_a_rank_take_back_its_report():
    """In-job recovery: rank 1 abandons the commit (its failure becomes the outcome rank 2 reads)
    after rank 0's abandon() left rank 2's report, already there, alone.  Rank 2 must not delete
    its report on that outcome: rank 0's gather would wait for it until commit_timeout_s (seen:
    the rejoined group hung in the restore, which joins that commit)."""
    from resilient.checkpoint.writer import Committer

    server = _store()
    ranks = [Committer(server.clone(), "p", r, 3, timeout_s=10) for r in range(3)]
    ranks[2].report({"rank": 2, "file": "rank_00002.safetensors"})
    ranks[0].abandon("rank 0 left the broken process group")  # report/2 is set: kept
    ranks[1].abandon("rank 1 left the broken process group")  # the outcome: a failure
    assert ranks[2].wait_outcome().startswith("CommitError")
    reports = ranks[0].gather({"rank": 0})  # at once: every key is there
    assert [r["rank"] for r in reports] == [0, 1, 2]
    assert "error" in reports[1] and reports[2]["file"] == "rank_00002.safetensors"


def test_the_previous_outcome_stays_when_a_report_is_a_failure(tmp_path):
    """A failure among the reports may be one the coordinator's abort() filled in for a rank
    still reading the previous commit's outcome: that outcome is deleted only when every report
    is a rank's own; and rebind() (a new group's store, its counters started again) forgets the
    old group's key names."""
    from resilient.checkpoint.writer import Committer

    server = _store()
    ck = Checkpointer(str(tmp_path / "ck"))
    ck._last_outcome_key = "p/1/done"
    server.set("p/1/done", "ok")
    now = ck._live_committer = Committer(server, "p/2", 0, 3, timeout_s=10)
    ck._forget_previous_outcome(now, [{"rank": 0}, {"rank": 1, "error": "abandoned"}, {"rank": 2}])
    assert server.check(["p/1/done"])  # a rank may still be reading it
    ck._forget_previous_outcome(now, [{"rank": 0}, {"rank": 1}, {"rank": 2}])
    assert server.check(["p/1/done"])  # deleted once this commit's outcome is out:
    ck._forget_doomed(now)
    assert not server.check(["p/1/done"]) and ck._last_outcome_key == "p/2/done"
    ck._shared_manifest = "p/2/manifest"
    ck.rebind()
    assert ck._last_outcome_key is None and ck._shared_manifest is None
    ck.close()


def test_a_report_of_static_text_and_checksums_gives_the_chunks_of_a_full_report(tmp_path):
    """writer.report_chunks: a rank's chunks from ``static`` text and ``sums`` are the entries of
    the full report; the text is parsed once (the cache); anything that does not add up is a
    CommitError naming the rank; and the commit's shape tells the texts apart."""
    import dataclasses

    from resilient.checkpoint.checkpointer import _manifest_shape
    from resilient.checkpoint.writer import CommitError, chunks_static, report_chunks

    with Checkpointer(str(tmp_path / "ckpt"), block_bytes=4096) as ck:
        ck.save(1, {"a": torch.randn(3000), "b.c": torch.arange(7)}).wait()
        m = ck.manifest(1)
        plan, layout = ck._plan_cache[1], ck.layout
    chunks = {k: t.chunks[0] for k, t in m.tensors.items()}
    base = {"rank": 1, "file": "f", "size_bytes": 1, "digest": plan.digest, "values": {}}
    full = {**base, "chunks": {k: c.to_json() for k, c in chunks.items()}}
    static = chunks_static(chunks)
    compact = {**base, "static": static, "sums": [list(c.checksums) for c in chunks.values()]}
    cache: dict = {}
    assert report_chunks(compact, cache) == report_chunks(full) == list(chunks.items())
    assert list(cache) == [static]
    other = [[7] * len(c.checksums) for c in chunks.values()]
    again = report_chunks({**compact, "sums": other}, cache)  # parsed from the cache
    assert [c for _, c in again] == [
        dataclasses.replace(c, checksums=tuple(s)) for c, s in zip(chunks.values(), other)
    ]
    one = [list(c.checksums) for c in chunks.values()]
    for bad in (
        {**compact, "sums": other[:-1]},
        {**compact, "sums": [*other[:-1], 5]},
        *({**compact, "sums": [*one[:-1], [x]]} for x in (-1, 2**32, True, 1.0, "x", None)),
        {**compact, "static": static[:-1]},
        {**compact, "static": '[["a", 5]]'},
        {**compact, "static": "[[7, {}]]"},
        {**compact, "static": "[" * 50000},
        {**compact, "static": ["not", "text"]},
        {k: v for k, v in compact.items() if k != "sums"},
        {**full, "static": static},  # both: the shape would be the text's, the chunks others
        {**full, "chunks": ["a"]},
    ):
        with pytest.raises((CommitError, CheckpointCorruptError), match="rank 1"):
            report_chunks(bad, {})

    def shape(report):
        return _manifest_shape(layout, plan, [report], block_bytes=4096)

    assert shape(compact) == shape({**compact, "sums": other})
    assert shape(compact) != shape({**compact, "sums": [[*s, 1] for s in other]})
    moved = chunks_static({k: dataclasses.replace(c, file="g") for k, c in chunks.items()})
    assert shape(compact) != shape({**compact, "static": moved})


def _url_of(request, tmp_path, backend: str) -> tuple[str, dict | None]:
    if backend == "s3":
        s3 = request.getfixturevalue("s3")
        return f"s3://{s3.new_bucket()}/run", s3.options
    return str(tmp_path / "ck"), None


def _stall_rank_file(ck: Checkpointer, backend: str, prefix: str):
    """Hold ``ck``'s write of the rank file under ``prefix`` until the gate opens: on S3 with
    the upload in flight (its first part sent), on a local disk before its first byte."""
    gate, started = threading.Event(), threading.Event()
    real = ck.storage.write_file

    def slow_write(rel, parts, **kw):
        if rel.startswith(prefix):
            fixed = list(parts() if callable(parts) else parts)

            def held():
                yield fixed[0]
                started.set()
                assert gate.wait(120)  # the upload is in flight
                yield from fixed[1:]

            if backend == "local":  # stalled before its first byte
                started.set()
                assert gate.wait(120)
                return real(rel, fixed, **kw)
            return real(rel, held, **kw)
        return real(rel, parts, **kw)

    ck.storage.write_file = slow_write
    return started, gate


def _stale_save_fails_and_step_holds(a, b, stale, url, opts, step: int, want: float) -> None:
    with pytest.raises(ResilientError):
        stale.wait()  # (its commit is refused: the lease is b's; or its file is)
    with contextlib.suppress(ResilientError):
        a.close()
    b.close()
    with Checkpointer(url, storage_options=opts, job_id="reader") as r:
        out = state(0)
        assert r.load(out, step=step) == step and torch.equal(out["w"], state(want)["w"])
        assert r.verify(step).ok


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_writer_that_lost_its_lease_never_replaces_its_successors_committed_files(
    request, tmp_path, backend
):
    """Writer A's lease is taken over (the same job restarted) while A still writes step 2's
    rank file: on an object store an upload in flight is invisible to a listing, and on a local
    disk A may not have opened its temporary yet.  Its successor B saves step 2 and commits.
    Both used to pick the same generation (one past every file B could see), so A's upload,
    landing later, replaced B's committed rank file: step 2 failed its checksums.  Each save now
    claims its generation where nothing is (claim.g<N>), and B's is another one."""
    url, opts = _url_of(request, tmp_path, backend)
    a = Checkpointer(url, storage_options=opts, job_id="J", keep_last=3)
    a.save(1, state(1)).wait()
    started, gate = _stall_rank_file(a, backend, "step_00000002/rank_00000")
    stale = a.save(2, state(2.5))
    assert started.wait(120)
    b = Checkpointer(url, storage_options=opts, job_id="J", keep_last=3)  # takes the lease over
    b.save(2, state(2)).wait()
    gate.set()  # the stale upload lands
    _stale_save_fails_and_step_holds(a, b, stale, url, opts, 2, 2)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_stale_writers_file_never_replaces_a_committed_one_after_its_claim_was_swept(
    request, tmp_path, backend
):
    """Writer A (its lease taken over) is frozen in its save of step 4, generation 0 claimed;
    its successor B saves 2 and 3, and B's commit of 3 removes step 4's directory, left
    uncommitted over two commits, with A's claim; B's save of 4 then claims generation 0 again
    and commits.  A's write, landing after that, replaced B's committed rank file (step 4 failed
    its checksums).  A rank file is now written only where nothing is (a link() of the
    temporary; If-None-Match on S3): A's save fails, B's step stays whole."""
    url, opts = _url_of(request, tmp_path, backend)
    a = Checkpointer(url, storage_options=opts, job_id="J", keep_last=3)
    a.save(1, state(1)).wait()
    started, gate = _stall_rank_file(a, backend, "step_00000004/rank_00000")
    stale = a.save(4, state(4.5))
    assert started.wait(120)
    b = Checkpointer(url, storage_options=opts, job_id="J", keep_last=3)  # takes the lease over
    b.save(2, state(2)).wait()
    assert "claim.g0" in b.storage.listdir("step_00000004")  # (A's claim)
    b.save(3, state(3)).wait()
    deadline = time.monotonic() + 120  # (retired directories are deleted after the commit)
    while "step_00000004" in b.storage.listdir("") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "step_00000004" not in b.storage.listdir("")  # swept, A's claim with it
    b.save(4, state(4)).wait()
    assert b.catalog().get(4).generation == 0  # (the generation A claimed)
    gate.set()  # the stale write lands
    _stale_save_fails_and_step_holds(a, b, stale, url, opts, 4, 4)


# --- a stale writer (its lease taken over by the same job restarted) between its last lease
# check and a destructive act: each stall an event, each takeover a fresh Checkpointer


def _holds_step(url, opts, step: int, want: float) -> None:
    with Checkpointer(url, storage_options=opts, job_id="reader") as r:
        assert step in r.steps(), f"the successor's committed step {step} is gone: {r.steps()}"
        out = state(0)
        assert r.load(out, step=step, fallback=False) == step
        assert torch.equal(out["w"], state(want)["w"]), f"step {step} is not the successor's"
        assert r.verify(step).ok


def _hold_call(storage, name, pred):
    """Hold ``storage.<name>(rel, ...)`` the first time ``pred(rel)``, until the gate opens."""
    gate, started, armed = threading.Event(), threading.Event(), [True]
    real = getattr(storage, name)

    def held(rel, *a, **k):
        if armed[0] and pred(rel):
            armed[0] = False
            started.set()
            assert gate.wait(120)
        return real(rel, *a, **k)

    setattr(storage, name, held)
    return started, gate


def test_a_stale_writers_clean_up_never_deletes_a_later_generations_files(tmp_path, monkeypatch):
    """A committed step 2 and checked its lease, then (frozen) listed the step directory after B
    took over, saved step 2 under generation 1 and committed: every file not in A's manifest was
    garbage, B's rank file with them, and B's step named a missing file.  Only files of A's own
    generation or older are garbage now (and the lease is checked before each deletion)."""
    import resilient.checkpoint.checkpointer as ckmod

    url = str(tmp_path / "ck")
    a = Checkpointer(url, job_id="J", keep_last=3)
    judged: list[str] = []  # what A's commit took for garbage
    real_delete = ckmod.delete_dirs

    def recording(storage, names, **kw):
        names = list(names)
        if storage is a.storage:
            judged.extend(names)
        return real_delete(storage, names, **kw)

    monkeypatch.setattr(ckmod, "delete_dirs", recording)
    a.save(1, state(1)).wait()
    started, gate = _hold_call(
        a.storage,
        "listdir",
        lambda rel: rel == "step_00000002" and a.storage.exists(f"step_00000002/{MANIFEST_NAME}"),
    )
    stale = a.save(2, state(2.5))
    assert started.wait(120)  # A committed step 2 and checked its lease again
    b = Checkpointer(url, job_id="J", keep_last=3)  # takes the lease over
    b.save(2, state(2)).wait()  # generation 1
    b.wait()
    gate.set()
    stale.wait()  # (A's commit stands until B's: A's save succeeded)
    a.wait()  # (A's thread deletes its garbage)
    assert judged and not [n for n in judged if ".g1." in n]  # (A's garbage: never B's files)
    with contextlib.suppress(ResilientError):
        a.close()
    b.close()
    _holds_step(url, None, 2, 2)


def test_a_stale_writer_deletes_nothing_once_its_lease_is_gone(tmp_path, monkeypatch):
    """A's failed save of step 3 left its directory; A's commit of 4 collected it, and A froze
    before deleting it (deletion runs after the save's outcome); B took over, saved 3 and
    committed it into that directory; A's deletion removed B's committed step.  The lease is
    checked right before each deletion now."""
    import resilient.checkpoint.checkpointer as ckmod

    url = str(tmp_path / "ck")
    a = Checkpointer(url, job_id="J", keep_last=3)
    a.save(1, state(1)).wait()
    real_write = a.storage.write_file

    def failing(rel, parts, **kw):
        if rel.startswith("step_00000003/rank_"):
            raise StorageError("injected: the write of step 3 fails", url=url, operation="write")
        return real_write(rel, parts, **kw)

    a.storage.write_file = failing
    with pytest.raises(ResilientError):
        a.save(3, state(3.5)).wait()
    a.storage.write_file = real_write
    assert "step_00000003" in a.storage.listdir("")  # (uncommitted, A's own)
    gate, started = threading.Event(), threading.Event()
    real_delete = ckmod.delete_dirs

    def frozen_delete(storage, names, **kw):
        names = list(names)
        if storage is a.storage and "step_00000003" in names:
            started.set()
            assert gate.wait(120)
        return real_delete(storage, names, **kw)

    monkeypatch.setattr(ckmod, "delete_dirs", frozen_delete)
    a.save(4, state(4)).wait()  # committed; its thread now holds the garbage
    assert started.wait(120)
    b = Checkpointer(url, job_id="J", keep_last=3)  # takes the lease over
    b.save(3, state(3)).wait()  # (B resumed from step 1: its step 3)
    b.wait()
    gate.set()
    with contextlib.suppress(ResilientError):
        a.close()
    b.close()
    _holds_step(url, None, 3, 3)


def test_a_lease_renewal_never_writes_over_a_takeover(tmp_path):
    """A's renewal read its own token, then (frozen) wrote its record: B's takeover in between
    was overwritten, A held the lease again and its next save replaced the step B committed.  A
    renewal writes only the holder's own heartbeat file now (LEASE.beat.<token>)."""
    from resilient.checkpoint.lease import BEAT_PREFIX

    url = str(tmp_path / "ck")
    a = Checkpointer(url, job_id="J", keep_last=3)
    a.save(1, state(1)).wait()
    started, gate = _hold_call(
        a.storage, "publish", lambda rel: rel in ("LEASE.json", BEAT_PREFIX + a._lease.token)
    )
    renewal = threading.Thread(target=a._lease.renew)  # (the renewal thread's beat)
    renewal.start()
    assert started.wait(120)  # A read its own token; its write is on the way
    b = Checkpointer(url, job_id="J", keep_last=3)  # takes the lease over
    b.save(2, state(2)).wait()
    b.wait()
    gate.set()
    renewal.join(120)
    stale = a.save(2, state(2.5))  # A must never commit again
    with pytest.raises(LeaseError):
        stale.wait()
    assert not stale.stats.committed
    with contextlib.suppress(ResilientError):
        a.close()
    assert b._lease.held
    b.close()
    _holds_step(url, None, 2, 2)


def test_a_stale_coordinators_manifest_never_replaces_its_successors_commit_on_s3(s3):
    """A checked its lease and froze right before publishing step 2's manifest; B took over,
    saved step 2 and committed (A's generation deleted as garbage); A's publish then replaced
    B's manifest with one naming deleted files.  On S3 the manifest is published only if it is
    still what was there before the lease check (If-Match / If-None-Match): A's commit fails.
    (A local disk has no conditional replace: there the check and the publish are adjacent.)"""
    url, opts = f"s3://{s3.new_bucket()}/run", s3.options
    a = Checkpointer(url, storage_options=opts, job_id="J", keep_last=3)
    a.save(1, state(1)).wait()
    started, gate = _hold_call(
        a.storage, "publish_if", lambda rel: rel == f"step_00000002/{MANIFEST_NAME}"
    )
    stale = a.save(2, state(2.5))
    assert started.wait(120)  # A checked its lease and is about to publish
    b = Checkpointer(url, storage_options=opts, job_id="J", keep_last=3)  # takes the lease over
    b.save(2, state(2)).wait()
    b.wait()  # (B's clean-up of step 2 done)
    gate.set()
    with pytest.raises(ResilientError, match="changed since this commit began"):
        stale.wait()
    with contextlib.suppress(ResilientError):
        a.close()
    b.close()
    _holds_step(url, opts, 2, 2)


def test_the_next_commit_of_a_step_collects_its_temporaries(tmp_path):
    """Temporaries left in a step directory (a publish or a write cut short by a crash) are
    garbage of the step's next commit: the manifest's too, not only a rank file's."""
    with Checkpointer(str(tmp_path), job_id="job-A", keep_last=3) as ck:
        ck.save(1, state(1)).wait()
        d = tmp_path / "step_00000001"
        (d / "MANIFEST.json.tmp-0123456789ab").write_bytes(b"{half a manifest")
        (d / "rank_00000.safetensors.tmp-0123456789ab").write_bytes(b"half a rank file")
        ck.save(1, state(2)).wait()  # the step saved again (a rollback, then the same step)
    left = sorted(p.name for p in d.iterdir())  # (after close: the deletions joined)
    assert "rank_00000.safetensors.tmp-0123456789ab" not in left
    assert "MANIFEST.json.tmp-0123456789ab" not in left, left
