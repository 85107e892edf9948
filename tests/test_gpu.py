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
