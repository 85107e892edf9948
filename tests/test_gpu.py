"""The device path: GPU tensors are staged through pinned CPU memory and loaded back onto the GPU.

Needs a CUDA or ROCm device (torch.cuda is HIP on ROCm); CI has none, so these run on GPU machines.
"""

import pytest
import torch

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
