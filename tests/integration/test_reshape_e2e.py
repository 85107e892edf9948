"""End to end: train in (dp1, ep2, tp2) with ZeRO-1, convert to other layouts, resume there."""

import shutil

import pytest
import torch

from reshape.execute import convert
from resilient import Checkpointer
from tests.dist import run_distributed
from tests.integration.test_trainer import CURVE_RTOL
from tests.integration.trainer_runs import run_evaluate, run_train

pytestmark = pytest.mark.distributed

SOURCE = {"dp": 1, "ep": 2, "tp": 2, "zero": True}
TARGETS = {  # name: (world, flags)
    "dp2-zero (2 ranks)": (2, {"dp": 2, "ep": 1, "tp": 1, "zero": True}),
    "dp3-zero, uneven shards (3 ranks)": (3, {"dp": 3, "ep": 1, "tp": 1, "zero": True}),
    "ep4 (4 ranks, no ZeRO)": (4, {"dp": 1, "ep": 4, "tp": 1}),
}
COMMON = {"global_batch": 12, "save_every": 4}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshape-e2e")
    run_distributed(run_train, 4, {**COMMON, **SOURCE, "steps": 4, "ckpt": str(root / "src")})
    shutil.copytree(root / "src", root / "cont")
    cont = run_distributed(
        run_train, 4, {**COMMON, **SOURCE, "steps": 8, "ckpt": str(root / "cont")}
    )[0]
    logits = run_distributed(
        run_evaluate, 4, {**COMMON, **SOURCE, "ckpt": str(root / "src"), "step": 4}
    )[0]
    return root, cont, logits


@pytest.mark.parametrize("name", list(TARGETS))
def test_convert_then_resume(source, name):
    root, continued, ref_logits = source
    world, flags = TARGETS[name]
    dst = str(root / name.split()[0])
    report = convert(str(root / "src"), dst, {k: flags[k] for k in ("dp", "ep", "tp")})
    assert report.files == world
    with Checkpointer(dst) as ck:
        assert ck.verify(4).ok
        assert ck.manifest(4).extras["data.next_step"] == 5  # data position carried over
    # the converted model computes the same outputs on a fixed batch
    logits = run_distributed(run_evaluate, world, {**COMMON, **flags, "ckpt": dst, "step": 4})[0]
    assert logits.shape == ref_logits.shape
    rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel <= 1e-6, (name, float(rel))
    # and training continues where it stopped, as it would have in the original layout
    rest = run_distributed(run_train, world, {**COMMON, **flags, "steps": 8, "ckpt": dst})[0]
    assert len(rest) == 4
    assert torch.allclose(torch.tensor(rest), torch.tensor(continued), rtol=CURVE_RTOL, atol=0), (
        rest,
        continued,
    )
