"""The reference trainer on real gloo groups: layouts agree, loss falls, resume is bit-exact."""

import json
import subprocess
import sys

import pytest
import torch

from tests.dist import run_distributed
from tests.integration.trainer_runs import gather_checkpoint, run_train

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (world, flags)
    "1x1x1": (1, {}),
    "dp2": (2, {"dp": 2}),
    "ep2": (2, {"ep": 2}),
    "tp2": (2, {"tp": 2}),
    "1x2x2": (4, {"ep": 2, "tp": 2}),
    "dp2-zero": (2, {"dp": 2, "zero": True}),
}
# Stated tolerance for ten-step curves: reductions and expert dispatch sum in a different order in
# each layout (fp32), which moves losses by ~1e-6 per step; 1e-4 relative leaves a wide margin
# while still catching any real mistake (a missing gradient average moves step 2 by > 1e-2).
CURVE_RTOL = 1e-4


@pytest.fixture(scope="module")
def curves():
    out = {}
    for name, (world, flags) in LAYOUTS.items():
        per_rank = run_distributed(run_train, world, {"steps": 10, "global_batch": 8, **flags})
        assert all(r == per_rank[0] for r in per_rank), f"{name}: ranks disagree on the loss"
        out[name] = per_rank[0]
    return out


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "1x1x1"])
def test_first_step_loss_agrees_across_layouts(curves, name):
    ref, got = curves["1x1x1"][0], curves[name][0]
    assert abs(got - ref) / ref <= 1e-5, (name, got, ref)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "1x1x1"])
def test_ten_step_curves_agree_across_layouts(curves, name):
    ref = torch.tensor(curves["1x1x1"])
    got = torch.tensor(curves[name])
    assert len(got) == 10
    assert torch.allclose(got, ref, rtol=CURVE_RTOL, atol=0), (name, (got - ref).abs().max())


def test_top1_routing_as_in_zaya1_agrees_across_layouts():
    top1 = {"top_k": 1, "shared_expert": False}
    ref = run_distributed(run_train, 1, {"steps": 3, "global_batch": 8, "model": top1})[0]
    got = run_distributed(
        run_train, 4, {"steps": 3, "global_batch": 8, "ep": 2, "tp": 2, "model": top1}
    )[0]
    assert abs(got[0] - ref[0]) / ref[0] <= 1e-5
    assert torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=CURVE_RTOL, atol=0)


def test_loss_decreases_on_the_real_corpus(curves):
    losses = run_distributed(run_train, 1, {"steps": 30, "global_batch": 8})[0]
    # byte-level: log(256) = 5.55 at the start; the tiny model learns the bytes of Python quickly
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


@pytest.mark.parametrize("name", ["1x2x2", "dp2-zero"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, name):
    world, flags = LAYOUTS[name]
    common = {"global_batch": 8, "save_every": 4, **flags}
    straight = run_distributed(
        run_train, world, {**common, "steps": 8, "ckpt": str(tmp_path / "a")}
    )[0]
    first = run_distributed(run_train, world, {**common, "steps": 4, "ckpt": str(tmp_path / "b")})[
        0
    ]
    second = run_distributed(run_train, world, {**common, "steps": 8, "ckpt": str(tmp_path / "b")})[
        0
    ]
    assert len(first) == 4 and len(second) == 4  # the second run resumed after step 4
    assert first + second == straight  # bit for bit
    a, b = gather_checkpoint(str(tmp_path / "a"), 8), gather_checkpoint(str(tmp_path / "b"), 8)
    assert a.keys() == b.keys() and any(k.startswith("optim.state.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", ["dp2-zero", "1x2x2"])
def test_the_memory_tier_does_not_change_training(curves, tmp_path, name):
    """Snapshots every step (and the size check before the first one, which makes a ZeRO
    optimizer create its state) leave the loss curve bit for bit as it is without them."""
    world, flags = LAYOUTS[name]
    run = {"steps": 10, "global_batch": 8, "memory_every": 1, "ckpt": str(tmp_path / "c")}
    with_tier = run_distributed(run_train, world, {**run, **flags})[0]
    assert with_tier == curves[name]


def test_each_data_replica_records_the_samples_it_read(tmp_path):
    """The chaos verifier's exactly-once check reads each replica's own range (gathered in the
    loss's all-reduce), not the one rank 0's loader position implies."""
    metrics = tmp_path / "m.jsonl"
    run = {"steps": 2, "global_batch": 8, "metrics": str(metrics), "ep": 2}
    run_distributed(run_train, 2, run)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["samples"] for r in records] == [[[0, 4], [4, 4]], [[8, 4], [12, 4]]]


def test_resume_in_another_layout_continues_the_curve(tmp_path):
    """The checkpointer reshards on load: (ep2, tp2) for 4 steps, then dp2 with ZeRO-1 to 8."""
    straight = run_distributed(run_train, 4, {"steps": 8, "global_batch": 8, "ep": 2, "tp": 2})[0]
    run_distributed(
        run_train,
        4,
        {"steps": 4, "global_batch": 8, "ep": 2, "tp": 2, "save_every": 4, "ckpt": str(tmp_path)},
    )
    rest = run_distributed(
        run_train,
        2,
        {
            "steps": 8,
            "global_batch": 8,
            "dp": 2,
            "zero": True,
            "save_every": 4,
            "ckpt": str(tmp_path),
        },
    )[0]
    assert len(rest) == 4
    assert torch.allclose(torch.tensor(rest), torch.tensor(straight[4:]), rtol=CURVE_RTOL, atol=0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--nproc", "4", "--tp", "2", "--ep", "1", "--dp", "1"],
            "--dp 1 x --ep 1 x --tp 2 = 2 ranks, but the job has 4 ranks",
        ),
        (["--nproc", "3", "--ep", "3"], "--ep 3 does not divide the 4 experts of preset 'tiny'"),
        (
            ["--nproc", "4", "--tp", "4"],
            "--tp 4 does not divide the 4 attention heads and 2 KV heads",
        ),
        (["--data", "/no/such/corpus"], "--data /no/such/corpus: no such file or directory"),
        (["--preset", "huge"], "--preset 'huge' is not a preset"),
        (["--save-every", "5"], "--save-every 5 needs --ckpt URL"),
        (
            ["--nproc", "2", "--dp", "2", "--global-batch", "3"],
            "--global-batch 3 must be divisible by the 2 data replicas",
        ),
        (["--join-timeout-s", "0"], "--join-timeout-s 0.0: must be > 0"),
        (["--max-failed-saves", "0"], "--max-failed-saves 0: must be >= 1"),
    ],
)
def test_bad_flags_fail_before_any_process_group(argv, message, capsys):
    import torch.distributed as dist

    from reference_trainer.__main__ import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.slow
def test_command_line_launches_ranks_through_the_elastic_launcher(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "reference_trainer",
        "--nproc",
        "2",
        "--tp",
        "2",
        "--steps",
        "3",
        "--save-every",
        "3",
        "--ckpt",
        str(tmp_path / "ck"),
        "--metrics",
        str(metrics),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert {"step", "loss", "tokens_per_s", "wall_time"} <= set(lines[0])
    # run again: it resumes at the end, trains nothing more, and appends nothing
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and len(metrics.read_text().splitlines()) == 3
    bad = subprocess.run(
        [sys.executable, "-m", "reference_trainer", "--nproc", "4", "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--tp 3" in bad.stderr


def test_zero_with_uneven_shards_over_three_replicas(tmp_path):
    ref = run_distributed(run_train, 1, {"steps": 5, "global_batch": 6})[0]
    got = run_distributed(
        run_train,
        3,
        {
            "steps": 5,
            "global_batch": 6,
            "dp": 3,
            "zero": True,
            "save_every": 5,
            "ckpt": str(tmp_path),
        },
    )[0]
    assert torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=CURVE_RTOL, atol=0)
    from resilient import Checkpointer

    with Checkpointer(str(tmp_path)) as ck:
        m = ck.manifest()
    # the checkpoint records how each tensor is split, ZeRO shards included
    wkv = m.tensors["model.layers.0.attn.wkv.weight"]
    assert dict(wkv.placement)["tp"].parts == 2  # the fused k/v dim, recorded even at tp=1
    emb_state = m.tensors["optim.state.model.embed.weight.exp_avg"]
    assert dict(emb_state.placement)["dp"].dim == 0
    assert sorted(c.sizes[0] for c in emb_state.chunks) == [84, 86, 86]  # 256 rows over 3: uneven
