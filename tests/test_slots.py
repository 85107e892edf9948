"""The memory tier's lean snapshot path (checkpoint/slots.py): snapshots are staged straight into
laid-out tmpfs rank files, and the file of the snapshot a commit retires is reused.  Reuse must
never change a byte that something still reads: a committed snapshot, or one pinned for the
persister; and the files are plain rank files of the checkpoint format."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from resilient import Checkpointer, ResilientError, StorageError
from resilient.checkpoint import slots as slots_mod
from tests.dist import run_distributed
from tests.test_memory_tier import _bump, _weights


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 7, generator=g),
        "b": torch.randn(33, generator=g).bfloat16(),
        "i": torch.arange(5, dtype=torch.int64),
    }


def _rank_files(ck: Checkpointer) -> list[Path]:
    return sorted(Path(ck.memory.dir).rglob("rank_*.safetensors"))


def test_snapshots_reuse_the_retired_files_and_restore_bit_exact(tmp_path):
    m = torch.nn.Linear(64, 32)
    seen = {}
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        slots = ck._memory._slots
        for step in range(1, 9):
            _bump(m, 0.25)
            ck.snapshot(step, {"model": m}).wait()  # a step longer than the commit
            seen[step] = _weights(m)
        ck.wait_snapshot()
        # the first two snapshots need files; every later one takes the file of the older
        # committed snapshot, which its commit retires: two files in all
        assert slots.reused == 6
        assert len(_rank_files(ck)) == 2
        # back to back (the previous one still committing): a third file, then reuse again
        for step in range(9, 15):
            _bump(m, 0.25)
            ck.snapshot(step, {"model": m})
            seen[step] = _weights(m)
        ck.wait_snapshot()
        assert 2 <= len(_rank_files(ck)) <= 3 and slots.reused >= 6 + 4
        for step in (14, 13):  # both committed snapshots hold their own step's bytes
            assert ck.load({"model": m}, step=step) == step
            assert ck.last_load.source == "memory"
            assert all(torch.equal(m.state_dict()[k], v) for k, v in seen[step].items())
        assert ck.snapshots.verify(14).ok and ck.snapshots.verify(13).ok


def test_a_snapshot_file_is_a_plain_safetensors_file_with_a_page_aligned_data_section(tmp_path):
    state = _state()
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        for step in (9, 10, 11, 12, 10**12):  # a longer step number fits the same header room
            ck.snapshot(step, state).wait()
        ck.wait_snapshot()
        path = next(Path(ck.memory.steps).glob("step_*1000000000000/rank_*.safetensors"))
        raw = path.read_bytes()
        header_len = int.from_bytes(raw[:8], "little")
        assert (8 + header_len) % 4096 == 0
        with safe_open(str(path), framework="pt") as f:  # the reference reader agrees
            assert f.metadata()["step"] == str(10**12)
            got = {k: f.get_tensor(k) for k in f.keys()}
        assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_file_pinned_for_the_persister_is_never_overwritten(tmp_path):
    m = torch.nn.Linear(64, 32)
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        for step in (1, 2, 3):
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m}).wait()
        ck.wait_snapshot()
        # what the persister does to a step it writes out: a hard link to each file
        pinned = next(Path(ck.memory.steps).glob("step_00000002/rank_*.safetensors"))
        link = tmp_path / "pinned.safetensors"
        os.link(pinned, link)
        before = link.read_bytes()
        for step in range(4, 9):
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m}).wait()
        ck.wait_snapshot()
        assert link.read_bytes() == before
        assert len(_rank_files(ck)) <= 3  # the pinned one is the persister's now, not ours


def test_a_new_layout_gets_a_file_of_its_own(tmp_path):
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        for step in (1, 2, 3):
            ck.snapshot(step, _state(step)).wait()
        bigger = {**_state(4), "extra": torch.ones(1000)}
        ck.snapshot(4, bigger).wait()
        ck.snapshot(5, bigger).wait()
        ck.wait_snapshot()
        target = {k: torch.empty_like(v) for k, v in bigger.items()}
        assert ck.load(target) == 5
        assert all(torch.equal(target[k], bigger[k]) for k in bigger)


def test_a_snapshot_that_fails_after_taking_a_retired_file_leaves_the_newest_restorable(tmp_path):
    url = str(tmp_path / "ckpt")
    m = torch.nn.Linear(16, 8)
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        for step in (1, 2, 3):
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m}).wait()
        ck.wait_snapshot()
        want = _weights(m)
        # the next snapshot takes the file of step 2 (retired by its commit) and fails before
        # it commits, as when the process dies in the middle
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(slots_mod.Slots, "persist", _killed)
            _bump(m, 1.0)
            ck.snapshot(4, {"model": m})
            with pytest.raises(ResilientError):
                ck.wait_snapshot()
    m2 = torch.nn.Linear(16, 8)
    with Checkpointer(url, memory_every=1, persister=False) as again:
        assert again.memory_steps() == [3, 2]  # step 4 never committed
        assert again.load({"model": m2}) == 3 and again.last_load.source == "memory"
        assert all(torch.equal(m2.state_dict()[k], v) for k, v in want.items())
        # the retired step whose file was taken is a named error, never read as step 2
        with pytest.raises(StorageError, match="rank_00000.safetensors.*does not exist"):
            again.snapshots.load({"model": m2}, step=2, fallback=False)


def _killed(*_a, **_k):
    raise OSError("killed")


def test_a_copy_that_fails_midway_never_touches_the_snapshot_still_committing(
    tmp_path, monkeypatch
):
    """A snapshot whose copy raises (an interrupt, a bad tensor) leaves its file as the spare;
    the snapshot committing meanwhile keeps its own file and bytes."""
    m = torch.nn.Linear(64, 32)
    seen = {}
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        for step in (1, 2, 3, 4):
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m})  # back to back: 4 is still committing below
            seen[step] = _weights(m)
        calls = {"n": 0}
        real = slots_mod._copy

        def broken(dests, srcs):
            calls["n"] += 1
            if calls["n"] == 1:
                real(dests[:1], srcs[:1])  # some bytes are in, then
                raise RuntimeError("interrupted mid-copy")
            return real(dests, srcs)

        monkeypatch.setattr(slots_mod, "_copy", broken)
        _bump(m, 1.0)
        failed = ck.snapshot(5, {"model": m})  # a failed save, reported through its handle
        with pytest.raises(ResilientError, match="mid-copy"):
            failed.wait()
        _bump(m, 1.0)
        ck.snapshot(6, {"model": m}).wait()
        seen[6] = _weights(m)
        ck.wait_snapshot()
        assert ck.memory_steps() == [6, 4]
        for step in (6, 4):
            assert ck.load({"model": m}, step=step) == step and ck.last_load.source == "memory"
            assert all(torch.equal(m.state_dict()[k], v) for k, v in seen[step].items())
        staging = sorted(
            p.name
            for p in (Path(ck.memory.dir) / slots_mod.STAGING_DIR).iterdir()
            if not p.name.endswith(".lock")  # (the rank's lock, held while the tier is used)
        )
        assert len(staging) <= 1  # at most the spare: nothing half-written left behind


def _stage_fails_on_rank_1(rank: int, world: int, url: str) -> tuple:
    m = torch.nn.Linear(16, 8)
    ck = Checkpointer(url, memory_every=1, persister=False)
    real = slots_mod.Slots._fresh
    calls = {"n": 0}

    def no_room(self, *a, **k):  # rank 1's tmpfs is full once, at its second snapshot
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise slots_mod.MemoryTierError("no room (test)")
        return real(self, *a, **k)

    slots_mod.Slots._fresh = no_room
    outcomes = []
    for step in (1, 2, 3, 4):
        _bump(m, 1.0)
        try:
            ck.snapshot(step, {"model": m}).wait()
            outcomes.append("ok")
        except ResilientError as e:
            outcomes.append(type(e).__name__)
    steps = ck.memory_steps()
    ck.close()
    # rank 0's process hosts the group's store here (torchrun's agent does in a job): it must
    # not exit while rank 1 still reads step 4's commit from it (rank 1 then reported that
    # commit failed, "Failed to recv": a flake under load)
    torch.distributed.barrier()
    return outcomes, steps


def test_a_snapshot_that_fails_on_one_rank_fails_on_every_rank_and_the_next_ones_commit(tmp_path):
    # the failing rank still takes part in the commit (it reports its error), so the ranks stay
    # in step: the next snapshots commit everywhere
    results = run_distributed(_stage_fails_on_rank_1, 2, str(tmp_path / "ckpt"))
    for rank, (outcomes, steps) in enumerate(results):
        # rank 1 sees its own error; rank 0 hears it through the commit
        failed = "MemoryTierError" if rank == 1 else "CommitError"
        assert outcomes == ["ok", failed, "ok", "ok"]
        assert steps == [4, 3]


def test_a_crashed_runs_staging_files_are_reclaimed(tmp_path):
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        staging = Path(ck.memory.dir) / slots_mod.STAGING_DIR
        ck.snapshot(1, _state()).wait()
        ck.wait_snapshot()
        leftover = staging / "rank_00000.2.safetensors"
        leftover.write_bytes(b"x" * 4096)  # as a killed run leaves it
        other = staging / "rank_00001.0.safetensors"  # another rank's: not this rank's to take
        other.write_bytes(b"y")
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False):
        assert not leftover.exists() and other.exists()


def test_no_room_for_a_snapshot_file_is_a_named_error_not_a_crash(tmp_path):
    """A tmpfs that fills up must fail the snapshot with MemoryTierError; writing into a mapping
    with no pages behind it would kill the process with SIGBUS.  The file size limit stands in
    for a full tmpfs (the same error path: the allocation of the file's pages fails)."""
    script = textwrap.dedent(
        f"""
        import os, resource, signal, torch
        from resilient import Checkpointer, MemoryTierError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        os.environ["RESILIENT_MEMORY_ROOT"] = {str(tmp_path / "shm")!r}
        ck = Checkpointer({str(tmp_path / "ckpt")!r}, memory_every=1, persister=False)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            ck.snapshot(1, {{"w": torch.zeros(1 << 20)}}).wait()
        except MemoryTierError as e:
            print("named:", e)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "named: cannot make room for a" in out.stdout


def test_a_tensor_subclass_is_copied_with_the_copy_it_implements(tmp_path):
    """A snapshot copies plain tensors in one batched call; a tensor subclass that implements
    copy_ (and not the batched copy) is copied one by one, as before."""
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    handled = {
        aten.detach.default,
        aten.alias.default,
        aten.copy_.default,
        aten._to_copy.default,
        aten.clone.default,
    }

    class Wrap(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(
                cls, inner.shape, dtype=inner.dtype, strides=inner.stride()
            )

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func not in handled:
                raise NotImplementedError(func)

            def un(x):
                return x.inner if isinstance(x, Wrap) else x

            out = func(*tree_map(un, args), **tree_map(un, kwargs or {}))
            return Wrap(out) if func in (aten.detach.default, aten.alias.default) else out

    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        ck.snapshot(1, {"w": Wrap(torch.arange(6.0)), "p": torch.ones(3)}).wait()
        out = {"w": torch.zeros(6), "p": torch.zeros(3)}
        assert ck.load(out) == 1 and ck.last_load.source == "memory"
    assert torch.equal(out["w"], torch.arange(6.0)) and torch.equal(out["p"], torch.ones(3))


def _large_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors past the fused copy's threshold, of sizes that end mid-piece and mid-block, one
    transposed (not contiguous: copied by torch, checksummed in the background), one small."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(700_001, generator=g),  # 2.8 MB: several blocks, a short last one
        "bf16": torch.randn(300_007, generator=g).bfloat16(),
        "param": torch.nn.Parameter(torch.randn(513, 257, generator=g)),
        "t": torch.randn(400, 300, generator=g).t(),
        "small": torch.randn(10, generator=g),
    }


@pytest.mark.parametrize(
    ("threads", "block"), [(1, 64 << 10), (2, 64 << 10), (2, (1 << 20) + 4096)]
)
def test_large_tensors_are_checksummed_as_they_are_copied(tmp_path, threads, block):
    """The large plain tensors of a snapshot are checksummed by the copy itself, on torch's
    number of threads; the checksums are those of the file's blocks (verify recomputes them), and
    the snapshot restores bit-exact, back to back or not."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Checkpointer(
            str(tmp_path / "ckpt"), memory_every=1, persister=False, block_bytes=block
        ) as ck:  # blocks smaller than a piece, and larger (a piece ends mid-block)
            slots = ck._memory._slots
            fused = []
            real = slots_mod._copy_summed

            def spy(slot, plan, raws, block_bytes):
                sums = real(slot, plan, raws, block_bytes)
                fused.append(sorted(sums))
                return sums

            checked = []  # what the background checksums: only what the copy did not
            real_sums = slots_mod.block_checksums

            def background(view, *a, **k):
                checked.append(len(view))
                return real_sums(view, *a, **k)

            slots_mod._copy_summed, slots_mod.block_checksums = spy, background
            try:
                for step in range(1, 6):
                    ck.snapshot(step, _large_state(step))  # back to back
                ck.wait_snapshot()
            finally:
                slots_mod._copy_summed, slots_mod.block_checksums = real, real_sums
            assert fused == [["bf16", "big", "param"]] * 5  # not "t", not "small"
            assert sorted(set(checked)) == [40, 400 * 300 * 4]
            assert slots.reused >= 2
            for step in (5, 4):
                assert ck.snapshots.verify(step).ok
                state = {k: torch.zeros_like(v) for k, v in _large_state(0).items()}
                assert ck.load(state, step=step) == step and ck.last_load.source == "memory"
                want = _large_state(step)
                assert all(torch.equal(state[k], want[k]) for k in want)
    finally:
        torch.set_num_threads(before)


def test_a_fused_copy_that_fails_in_a_thread_fails_the_snapshot_and_the_next_one_commits(
    tmp_path, monkeypatch
):
    """An error in one of the copy's threads is the snapshot's error, raised once every thread
    has stopped writing; the file goes back as the spare and the next snapshot commits."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with Checkpointer(
            str(tmp_path / "ckpt"), memory_every=1, persister=False, block_bytes=64 << 10
        ) as ck:
            ck.snapshot(1, _large_state(1)).wait()
            calls = {"n": 0}
            real = slots_mod.crc32

            def flaky(data, value=0):
                calls["n"] += 1
                if calls["n"] == 7:
                    raise OSError("crc unit on fire (test)")
                return real(data, value)

            monkeypatch.setattr(slots_mod, "crc32", flaky)
            with pytest.raises(ResilientError, match="on fire"):
                ck.snapshot(2, _large_state(2)).wait()
            monkeypatch.setattr(slots_mod, "crc32", real)
            ck.snapshot(3, _large_state(3)).wait()
            ck.wait_snapshot()
            assert ck.memory_steps() == [3, 1]
            assert ck.snapshots.verify(3).ok and ck.snapshots.verify(1).ok
            state = {k: torch.zeros_like(v) for k, v in _large_state(0).items()}
            assert ck.load(state, step=3) == 3
            assert all(torch.equal(state[k], v) for k, v in _large_state(3).items())
    finally:
        torch.set_num_threads(before)


def test_a_reused_file_never_keeps_the_checksums_of_the_snapshot_before(tmp_path):
    """A file is reused by the next snapshot of the same layout; a tensor that was copied with its
    checksums there and is now not contiguous (the same shape: the same layout) is checksummed
    from its new bytes, not given the old checksums."""

    def state(step: int, contiguous: bool) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        w = torch.randn(300, 1000, generator=g)
        return {"w": w.t().contiguous() if contiguous else w.t()}

    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        for step in range(1, 7):
            ck.snapshot(step, state(step, contiguous=step <= 3)).wait()
        ck.wait_snapshot()
        assert ck._memory._slots.reused >= 3
        for step in (6, 5):
            assert ck.snapshots.verify(step).ok
            got = {"w": torch.zeros(1000, 300)}
            assert ck.load(got, step=step) == step
            assert torch.equal(got["w"], state(step, contiguous=False)["w"])


def test_no_thread_copies_into_a_snapshot_file_after_its_copy_failed(tmp_path, monkeypatch):
    """When the caller's share of a fused copy fails, the snapshot fails only once the other
    threads have stopped writing into the file (it becomes the spare, which the next snapshot
    overwrites), and they take no block after the failure."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    inside = {"n": 0, "after": 0}
    failed = threading.Event()
    lock = threading.Lock()
    real = slots_mod.crc32

    def crc(data, value=0):
        with lock:
            inside["n"] += 1
            if failed.is_set():
                inside["after"] += 1
        try:
            if threading.current_thread() is threading.main_thread():
                failed.set()
                raise OSError("the caller's copy failed (test)")
            time.sleep(0.25)  # the other thread is mid-block when the caller fails (long: a
            # second block after the failure needs the caller descheduled that long)
            return real(data, value)
        finally:
            with lock:
                inside["n"] -= 1

    try:
        with Checkpointer(
            str(tmp_path / "ckpt"), memory_every=1, persister=False, block_bytes=64 << 10
        ) as ck:
            ck.snapshot(1, _large_state(1)).wait()
            monkeypatch.setattr(slots_mod, "crc32", crc)
            handle = ck.snapshot(2, _large_state(2))
            assert inside["n"] == 0  # nothing writes into the file any more
            assert inside["after"] <= 1  # at most the block a thread was in, finished
            with pytest.raises(ResilientError, match="caller's copy failed"):
                handle.wait()
            monkeypatch.setattr(slots_mod, "crc32", real)
            ck.snapshot(3, _large_state(3)).wait()
            ck.wait_snapshot()
            assert ck.snapshots.verify(3).ok and ck.snapshots.verify(1).ok
    finally:
        torch.set_num_threads(before)


def test_the_header_template_writes_the_same_bytes_as_the_header_itself(tmp_path):
    """Each snapshot's header is its plan's template with the step filled in: the bytes of the
    header encoded in full, for any step; a plan whose tensor names hold the template's mark is
    encoded in full at every snapshot."""
    for state in (_state(), {**_state(), f"x{slots_mod._HeaderTemplate._MARK}y": torch.ones(3)}):
        with Checkpointer(str(tmp_path / f"ckpt{len(state)}"), memory_every=1) as ck:
            ck.snapshot(1, state).wait()
            plan = ck._memory._plan_cache[1]
            template = slots_mod._HeaderTemplate(plan)
            assert (template._parts is None) == (len(state) == 4)

            class Step(int):  # an int that prints otherwise: the header says what str() says
                def __str__(self) -> str:
                    return '"quoted"\\'

            for step in (0, 1, 9, 10, 4711, 10**12, 2**63 - 1, Step(5)):
                full = slots_mod.Slots._header(plan, step)
                assert template.text(step) == full[8:].rstrip(b" ")
            ck.snapshot(2, state).wait()
            assert ck.snapshots.verify(2).ok
            ck.release_memory()


def _reports_of(rank: int, world: int, url: str) -> tuple:
    from resilient.checkpoint import writer

    sent = []
    real = writer.Committer.report

    def report(self, value):
        sent.append(sorted(value))
        return real(self, value)

    writer.Committer.report = report
    m = torch.nn.Linear(16, 8)
    extra = torch.arange(6.0)
    ok = []
    with Checkpointer(url, memory_every=1, persister=False) as ck:
        for step in (1, 2, 3):
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m}).wait()
            ok.append(ck.snapshots.verify(step).ok)
        # back to step 2, and step 3 again: its files are of the next generation (other names)
        assert ck.load({"model": m}, step=2) == 2
        _bump(m, 0.5)
        ck.snapshot(3, {"model": m}).wait()
        generations = {ck.snapshots.manifest(3).generation}
        ok.append(ck.snapshots.verify(3).ok)
        for step in (4, 5):  # another layout: a tensor more
            _bump(m, 1.0)
            ck.snapshot(step, {"model": m, "extra": extra + step}).wait()
            ok.append(ck.snapshots.verify(step).ok)
        got = {"model": m, "extra": torch.zeros(6)}
        assert ck.load(got, step=5) == 5
        assert torch.equal(got["extra"], extra + 5)
        ck.release_memory()
    return sent, ok, _weights(m), generations


def test_a_rank_reports_its_chunks_as_the_text_of_its_layout_and_the_checksums(tmp_path):
    """(two ranks) The rank that is not the coordinator sends the same text for its chunks at
    every snapshot of a layout, and the checksums apart; the manifests the coordinator builds
    from them pass the readers' full check, through a rollback (a step saved again: its files are
    of another generation) and a new layout, and the snapshots restore."""
    results = run_distributed(_reports_of, 2, str(tmp_path / "ckpt"))
    sent, ok, weights, generations = results[1]
    assert len(sent) == 6
    assert all("static" in keys and "sums" in keys and "chunks" not in keys for keys in sent)
    assert results[0][0] == []  # the coordinator reports to itself
    assert all(r[1] == [True] * 6 for r in results)
    assert all(r[3] == {1} for r in results)
    assert all(torch.equal(results[0][2][k], v) for k, v in weights.items())


def test_a_directory_at_the_ranks_staging_name_is_named_not_taken_for_a_full_node(tmp_path):
    """(a review) Every snapshot failed with "cannot make room ...: give the node more shared
    memory" while a directory sat at the rank's first staging name."""
    m = torch.nn.Linear(16, 16)
    with Checkpointer(str(tmp_path / "ckpt"), memory_every=1, persister=False) as ck:
        planted = Path(ck.memory.staging, "rank_00000.0.safetensors")
        planted.mkdir()
        (planted / "someone's").write_text("kept")
        with pytest.raises(
            slots_mod.MemoryTierError,
            match=r"rank 0's staging name .*"
            r"rank_00000\.0\.safetensors is a directory; expected a rank file of "
            r"the memory tier or nothing: remove it",
        ):
            ck.snapshot(1, {"model": m}).wait()
        assert (planted / "someone's").read_text() == "kept"
        planted.joinpath("someone's").unlink()
        planted.rmdir()
        ck.snapshot(2, {"model": m}).wait()
        assert ck.memory_steps() == [2]
