"""The memory tier's route for GPU state, the parts of it a machine without a GPU can check:
checksums of a GPU state's chunks taken on the checksum threads (against the seal's own check),
the page-lock's bookkeeping through a stand-in for the CUDA runtime's two calls (each
registration undone once, on its device, whichever thread closes the file), and the parsing of
/proc that decides what is page-locked and where the runtime lives.  tests/test_gpu.py runs the
same route on a GPU."""

import contextlib

import pytest
import torch

import resilient.checkpoint.slots as slots
from resilient import Checkpointer
from resilient.checkpoint.storage import fs_type_in


@pytest.fixture
def as_gpu(monkeypatch):
    """Every snapshot staged as a GPU state's is (CPU tensors stand in for the device's)."""
    stage = slots.Slots.stage

    def staged_as_gpu(self, *args, **kwargs):
        return stage(self, *args, **{**kwargs, "gpu": True})

    monkeypatch.setattr(slots.Slots, "stage", staged_as_gpu)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(5 * 4096 + 7, 300, generator=g),  # ~24.6 MB: 6 blocks of 4 MiB
        "mid": torch.randn(3 << 18, generator=g),  # 3 MiB: one block
        "empty": torch.zeros(0, 5),
        "small": torch.arange(10, dtype=torch.int64),
    }


@pytest.mark.parametrize("commit_every", [0, 1], ids=["sealed", "committed"])
def test_a_gpu_states_checksums_from_the_checksum_threads_pass_the_seals_check(
    tmp_path, as_gpu, commit_every
):
    """A sealed snapshot's record carries every chunk's block checksums; for a GPU state they are
    taken after the copy on the checksum threads, one batch of every block.  The seal (at the
    restore) computes them again from the file and commits the step only if they match."""
    state = _state()
    with Checkpointer(str(tmp_path / "ck"), memory_every=1, memory_commit_every=commit_every) as ck:
        for step in (1, 2):
            state["big"].add_(1.0)
            ck.snapshot(step, state).wait()
        slot = ck._memory._slots._committed[-1]
        if commit_every == 0:  # what the record carries: one checksum per block
            assert [len(slot.sums[k]) for k in ("big", "mid", "small")] == [6, 1, 1]
            assert not slot.sums.get("empty")
        out = {k: torch.full_like(v, -1) for k, v in state.items()}
        assert ck.load(out) == 2
        assert ck.last_load.source == "memory"
        assert bool(ck.last_load.sealed) == (commit_every == 0)
        ck.release_memory()
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_sums_on_the_threads_equal_those_taken_in_order(tmp_path, as_gpu, monkeypatch):
    """The batch on the checksum threads gives each chunk's checksums in block order, as the
    serial path does."""
    taken = {}
    real = slots._sum_rest

    def both(slot, plan, block_bytes, small, parallel=False):
        real(slot, plan, block_bytes, small, parallel=False)
        serial, slot.sums = dict(slot.sums), {k: v for k, v in slot.sums.items() if k == "-"}
        real(slot, plan, block_bytes, small, parallel=True)
        taken["serial"], taken["parallel"] = serial, dict(slot.sums)

    monkeypatch.setattr(slots, "_sum_rest", both)
    with Checkpointer(str(tmp_path / "ck"), memory_every=1, memory_commit_every=0) as ck:
        ck.snapshot(1, _state()).wait()
        ck.release_memory()
    assert taken["parallel"] == taken["serial"] and len(taken["serial"]["big"]) == 6


class _Runtime:
    """Stands in for torch's binding of the CUDA runtime: cudaHostRegister and its undoing,
    recorded with the calling thread's current device (``refuse``: every registration fails).
    As CUDA's, the current device is the thread's own: 3 on the thread that stages (the rank's
    device), 0 on any other thread (a commit thread) unless it enters ``torch.cuda.device``."""

    def __init__(self) -> None:
        import threading

        self.live: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.refuse = False
        self._main = threading.main_thread()
        self._local = threading.local()

    def current(self) -> int:
        import threading

        default = 3 if threading.current_thread() is self._main else 0
        return getattr(self._local, "device", default)

    @contextlib.contextmanager
    def device(self, index: int):
        before = getattr(self._local, "device", None)
        self._local.device = index
        try:
            yield
        finally:
            if before is None:
                del self._local.device
            else:
                self._local.device = before

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the runtime's name)
        self.calls.append(("register", ptr, size, flags, self.current()))
        if self.refuse:
            return 1  # cudaErrorInvalidValue
        assert ptr not in self.live
        self.live[ptr] = self.current()
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr, self.current()))
        if self.live.get(ptr) != self.current():  # not registered in this device's context
            return 1  # cudaErrorInvalidValue (the page-lock stays)
        del self.live[ptr]
        return 0


@pytest.fixture
def runtime(monkeypatch):
    rt = _Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", rt.current)
    monkeypatch.setattr(torch.cuda, "device", rt.device)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(slots, "_in_ram", lambda path: True)
    monkeypatch.setattr(slots, "_PIN_WARNED", False)
    return rt


@pytest.mark.parametrize("commit_every", [0, 1], ids=["sealed", "committed"])
def test_each_page_lock_is_undone_once_on_its_own_device(tmp_path, as_gpu, runtime, commit_every):
    """Every file the tier maps for a GPU state is registered once, portable, and unregistered
    once when it is closed, with the device it was registered on current, also when a commit
    thread closes it (snapshots back to back, a layout change in between, a load)."""
    import glob
    import os

    state = {"w": torch.randn(300, 700)}
    pins = tmp_path / "pins"
    pins.mkdir()
    with Checkpointer(str(tmp_path / "ck"), memory_every=1, memory_commit_every=commit_every) as ck:
        for step in range(1, 12):
            state["w"].add_(1.0)
            if step == 6:
                state["v"] = torch.randn(64)  # another layout: files of another size
            ck.snapshot(step, state)
            # linked elsewhere (as the persister pins a step it copies): not reusable, so the
            # commit thread closes a file it retires
            pattern = f"{ck.memory.dir}/steps/**/rank_*.safetensors"
            for i, f in enumerate(glob.glob(pattern, recursive=True)):
                with contextlib.suppress(OSError):
                    os.link(f, pins / f"{step}_{i}")
        ck.wait_snapshot()
        assert ck.load({k: torch.empty_like(v) for k, v in state.items()}) == 11
        ck.release_memory()
    registered = [c for c in runtime.calls if c[0] == "register"]
    assert registered and all(c[3] == slots._HOST_REGISTER_PORTABLE for c in registered)
    assert all(c[4] == 3 for c in registered)
    assert not runtime.live, "a page-lock was never undone"
    assert {c[2] for c in runtime.calls if c[0] == "unregister"} == {3}
    assert len([c for c in runtime.calls if c[0] == "unregister"]) == len(registered)


def test_a_refused_page_lock_resets_the_runtimes_error_and_the_snapshot_goes_on(
    tmp_path, as_gpu, runtime, monkeypatch, caplog
):
    runtime.refuse = True
    reset = []
    monkeypatch.setattr(slots, "_clear_device_error", lambda: reset.append(1))
    state = {"w": torch.randn(1000)}
    with Checkpointer(str(tmp_path / "ck"), memory_every=1) as ck:
        for step in (1, 2, 3):
            ck.snapshot(step, state).wait()
        assert ck.load({"w": torch.empty(1000)}) == 3
        ck.release_memory()
    tries = [c for c in runtime.calls if c[0] == "register"]
    assert tries and len(reset) == len(tries)  # after each refusal
    assert not [c for c in runtime.calls if c[0] == "unregister"]
    assert caplog.text.count("could not page-lock") == 1  # said once


def test_what_is_page_locked_follows_the_filesystem_and_its_mount_points(monkeypatch):
    mounts = (
        "proc /proc proc rw 0 0\n"
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "/dev/vdb /mnt/a\\040b/disk ext4 rw 0 0\n"
        "tmpfs /mnt/a\\040b tmpfs rw 0 0\n"
        "tmpfs /dev/shmfoo/x ext4 rw 0 0\n"
    )
    assert fs_type_in(mounts, "/dev/shm/resilient-0/job") == "tmpfs"
    assert fs_type_in(mounts, "/dev/shmfoo") == "ext4"  # "/", not /dev/shm
    assert fs_type_in(mounts, "/mnt/a b/x") == "tmpfs"  # an escaped space
    assert fs_type_in(mounts, "/mnt/a b/disk/x") == "ext4"  # the longest mount point
    assert fs_type_in(mounts, "/tmp") == "ext4"
    assert fs_type_in("", "/tmp") == ""


def test_the_runtime_libraries_are_found_in_the_maps_whatever_their_path():
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/my env/lib/libcudart.so.13\n"
        "7f04-7f05 r-xp 00000000 08:01 3 /old/libcudart.so.12 (deleted)\n"
        "7f06-7f07 r-xp 00000000 08:01 4 /opt/rocm/lib/libamdhip64.so.6\n"
        "7f08-7f09 rw-p 00000000 00:00 0\n"
    )
    assert slots._runtime_libraries(maps) == [
        "/old/libcudart.so.12",
        "/opt/my env/lib/libcudart.so.13",
        "/opt/rocm/lib/libamdhip64.so.6",
    ]


def test_a_view_of_a_closed_rank_file_stays_readable(tmp_path):
    """A tensor that still views a rank file when the file is closed (a traceback's frame holds
    the views a failed copy was given, say) keeps its mapping: reading it is not a segfault."""
    import mmap
    import os

    path = tmp_path / "rank.safetensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 1 << 16)
    mm = mmap.mmap(fd, 1 << 16, flags=mmap.MAP_SHARED)
    slot = slots._Slot(str(path), fd, mm, ("k",), 4096)
    view = slot.data()[:1024].view(torch.float32)
    view.fill_(2.5)
    slot.close()
    assert float(view.sum()) == 2.5 * 256
    del view  # the mapping goes with the last view
