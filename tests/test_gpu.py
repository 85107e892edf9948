"""The device path: GPU tensors are staged through pinned CPU memory and loaded back onto the GPU.

Needs a CUDA or ROCm device (torch.cuda is HIP on ROCm); CI has none, so these run on GPU machines.
"""

import os

import pytest
import torch

import resilient.checkpoint.slots as slots
from resilient import Checkpointer, Shard, sharded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]


def test_gpu_tensors_round_trip_through_pinned_buffers(tmp_path):
    dev = torch.device("cuda")
    model = torch.nn.Linear(64, 32).to(dev)
    w = sharded(torch.randn(12, 8, device=dev).bfloat16(), {"dp": Shard(0)})
    state = {"model": model, "w": w}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state).wait()
        assert ck._stager._buffer.is_pinned()
        out = {
            "model": torch.nn.Linear(64, 32).to(dev),
            "w": sharded(torch.zeros(12, 8, device=dev).bfloat16(), {"dp": Shard(0)}),
        }
        ck.load(out)
    assert out["w"].device.type == "cuda" and torch.equal(out["w"], w)
    assert torch.equal(out["model"].weight, model.weight)


def test_trainer_runs_on_the_gpu_with_bf16_autocast(tmp_path):
    import json
    import subprocess
    import sys

    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reference_trainer",
            "--device",
            "cuda",
            "--steps",
            "5",
            "--save-every",
            "5",
            "--ckpt",
            str(tmp_path / "ck"),
            "--metrics",
            str(metrics),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]


@pytest.mark.parametrize("root", ["tmpfs", "disk"])
@pytest.mark.parametrize("commit_every", [1, 0], ids=["committed", "sealed"])
def test_memory_snapshot_of_gpu_state_restores_bit_exact(tmp_path, monkeypatch, commit_every, root):
    """A memory-tier snapshot of device tensors (bf16, fp32, a non-contiguous view) is copied
    into the node's memory and loaded back onto the device bit-exact, from memory.  On a tmpfs
    the tier's files are page-locked for the copy; on a disk's filesystem (which the driver
    refuses to page-lock) they are not, and nothing else changes."""
    import shutil
    import tempfile

    if root == "disk" and slots._in_ram(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a RAM filesystem here: no disk root to try")
    if root == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm on this machine")
        where = tempfile.mkdtemp(prefix="gpu-test-", dir="/dev/shm")
        monkeypatch.setenv("RESILIENT_MEMORY_ROOT", where)
    try:
        _snapshot_round_trip(tmp_path, commit_every, pinned=root == "tmpfs")
    finally:
        if root == "tmpfs":
            shutil.rmtree(where, ignore_errors=True)


def test_a_refused_page_lock_leaves_no_cuda_error_behind(tmp_path, monkeypatch, caplog):
    """Where the driver refuses to page-lock the tier's file (here: one on a disk's filesystem,
    tried anyway), the runtime's last error is reset: torch would otherwise raise it at its next
    kernel launch, as that kernel's ("invalid argument"), and fail the snapshot and the step
    after it.  The snapshot copies through the driver's bounce buffer instead, and says so."""
    monkeypatch.setattr(slots, "_in_ram", lambda path: True)
    monkeypatch.setattr(slots, "_PIN_WARNED", False)
    _snapshot_round_trip(tmp_path, 1, pinned=False)
    torch.ones(8, device="cuda").add_(1).sum().item()  # a kernel launch after the refusal
    assert "could not page-lock" in caplog.text


def _snapshot_round_trip(tmp_path, commit_every: int, pinned: bool) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    state = {
        "a": torch.randn(257, 33, device=dev, generator=g).bfloat16(),
        "b": torch.randn(4096, device=dev, generator=g),
        "c": torch.randn(64, 48, device=dev, generator=g).t(),
        "step": 3,
    }
    with Checkpointer(str(tmp_path / "ck"), memory_every=1, memory_commit_every=commit_every) as ck:
        for step in (1, 2):
            state["b"].add_(1.0)
            expect = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            handle = ck.snapshot(step, state)
            for v in state.values():  # at once, on the current stream: the copy must be done
                if torch.is_tensor(v):
                    v.zero_()
            handle.wait()
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in expect.items()}
        # copied from the device straight into the node's memory, page-locked for the copy (the
        # files this rank holds: a load lets a sealed snapshot's go first)
        slots = ck._memory._slots
        held = [*slots._committed, *slots._staged]
        assert held and all(bool(s.pinned) == pinned for s in held), [s.pinned for s in held]
        out = {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in state.items()}
        assert ck.load(out) == 2
        assert ck.last_load.source == "memory"
        assert bool(ck.last_load.sealed) == (commit_every == 0)
        ck.release_memory()
    for k in ("a", "b", "c"):
        assert out[k].device.type == "cuda" and torch.equal(out[k], expect[k]), k
    assert out["step"] == 3


@pytest.mark.parametrize("commit_every", ["1", "0"], ids=["committed", "sealed"])
def test_trainer_on_the_gpu_with_the_memory_tier_resumes_where_it_stopped(tmp_path, commit_every):
    """The trainer on the GPU with a snapshot every step and no durable save of its own: the
    snapshots are taken from the device, the last one is made durable when the run ends, and a
    second run of the same job restores it onto the device and goes on."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    env = dict(os.environ)
    if os.path.isdir("/dev/shm"):  # the node's memory on a tmpfs, as in production: page-locked
        env["RESILIENT_MEMORY_ROOT"] = tempfile.mkdtemp(prefix="gpu-test-", dir="/dev/shm")
    ckpt, events = tmp_path / "ck", tmp_path / "events.jsonl"
    common = [sys.executable, "-m", "reference_trainer", "--device", "cuda", "--ckpt", str(ckpt)]
    common += ["--memory-every", "1", "--memory-commit-every", commit_every]
    common += ["--save-every", "0", "--events", str(events)]
    try:
        for steps in (4, 6):
            proc = subprocess.run(
                [*common, "--steps", str(steps)],
                capture_output=True,
                text=True,
                timeout=600,
                env=env,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        if env.get("RESILIENT_MEMORY_ROOT", "").startswith("/dev/shm/"):
            shutil.rmtree(env["RESILIENT_MEMORY_ROOT"], ignore_errors=True)
    events_read = [json.loads(line) for line in events.read_text().splitlines()]
    failed = [e for e in events_read if e["event"] == "snapshot" and not e.get("ok", True)]
    assert not failed, failed  # (a failed snapshot is only warned about: training goes on)
    restores = [
        e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "restore"
    ]
    assert len(restores) == 1 and restores[0]["step"] == 4, restores


CUDA_PROBE = """
import json, os, sys, torch
try:
    got = float(torch.ones(1, device="cuda").sum().item())
except Exception as e:
    got = repr(e)
with open(os.path.join(sys.argv[1], f"rank-{os.getpid()}.json"), "w") as f:
    json.dump({"cuda": got}, f)
"""


def test_ranks_forked_from_a_launcher_that_counted_the_gpus_can_use_them(tmp_path):
    """``resilient launch --preload torch --nproc-per-node gpu``: torchrun counts the GPUs in the
    launcher (torch.cuda.is_available(), which initialises the driver and "poisons fork"), so
    the server is not forked from it (``fork_ready``): every rank can use CUDA."""
    import json
    import subprocess
    import sys

    (tmp_path / "probe.py").write_text(CUDA_PROBE)
    (tmp_path / "out").mkdir()
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--preload", "torch"]
    cmd += ["--nproc-per-node", "gpu", "--max-restarts", "0", "--spares", "0", "--standalone"]
    cmd += [str(tmp_path / "probe.py"), str(tmp_path / "out")]
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    reports = [json.loads(r.read_text()) for r in (tmp_path / "out").glob("rank-*.json")]
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(reports) == torch.cuda.device_count(), reports
    assert all(r["cuda"] == 1.0 for r in reports), reports
