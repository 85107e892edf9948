"""examples/fsdp2.py on real processes: a ``fully_shard`` model and AdamW saved on 2 torchrun ranks,
resumed bit for bit on 2, and loaded (resharded) on 3 ranks and in one plain process.

One module-scoped fixture runs the example five times (2 ranks to step K; loads of step K on 3 ranks
and in one process; the same 2-rank job continued to step N; an uninterrupted 2-rank run to N); the
tests compare the full (unsharded) weights and optimizer state each launch wrote with ``--out``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resilient import Checkpointer
from resilient.chaos.harness import forked_launcher

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "fsdp2.py")
K, N = 3, 6  # stop at step K, resume to step N


def launch(tmp: Path, nproc: int | None, *args: str, torchrun: bool = False) -> str:
    """Run the example (``nproc`` ranks, or one plain process); returns its stdout.  The ranks are
    started by plain torchrun (``torchrun``), else by ``resilient launch``, which forks them from
    a process that imported torch once (the same torchrun agent otherwise; torch._dynamo is what
    AdamW imports when it is made)."""
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        preload = "torch.distributed.fsdp,torch.distributed.tensor,torch._dynamo,resilient"
        launcher = [sys.executable, "-m", "resilient.cli", "launch", "--standalone"]
        # no spare (its default is one): torchrun's policy, and --load-only joins the group with
        # torch's own init_process_group, which a spare (no RANK until given one) fails in
        launcher += ["--spares", "0", "--preload", preload]
    cmd = (
        [*launcher, "--nproc-per-node", str(nproc), EXAMPLE] if nproc else [sys.executable, EXAMPLE]
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RESILIENT_MEMORY_ROOT": str(tmp / "memory-root"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [*cmd, *args]
    if nproc and not torchrun:  # the launcher forked from this process's server for launchers
        cmd, env = forked_launcher(cmd, env)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    # (a process of the job that failed in a job that succeeded: a spare, say)
    assert "Traceback" not in proc.stderr, f"{cmd}:\n{proc.stderr[-5000:]}"
    return proc.stdout


def losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", stdout, re.M)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    ckpt, fresh = str(tmp / "ckpt"), str(tmp / "fresh")
    out = {}
    out["first"] = launch(
        tmp,
        2,
        *("--ckpt", ckpt, "--steps", str(K), "--save-every", "2", "--out", str(tmp / "k.st")),
        torchrun=True,  # as the example's docstring runs it
    )
    with Checkpointer(ckpt) as ck:
        out["manifest"] = ck.manifest(K)
    # before the continuation: its saves retire old steps (keep_last=3)
    for name, nproc in (("three", 3), ("one", None)):
        load = ["--ckpt", ckpt, "--load-only", "--step", str(K)]
        out[name] = launch(tmp, nproc, *load, "--out", str(tmp / f"{name}.st"))
    out["resumed"] = launch(
        tmp, 2, "--ckpt", ckpt, "--steps", str(N), "--save-every", "2", "--out", str(tmp / "n.st")
    )
    out["fresh"] = launch(
        tmp, 2, "--ckpt", fresh, "--steps", str(N), "--save-every", "2", "--out", str(tmp / "f.st")
    )
    for name in ("k", "three", "one", "n", "f"):
        out[f"{name}.st"] = load_file(str(tmp / f"{name}.st"))
    return out


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"not bit-identical: {different}"


def test_saved_sharded_weights_and_optimizer_state(runs):
    """The checkpoint holds each rank's FSDP shard, optimizer state included (not a gathered copy)."""
    m = runs["manifest"]
    assert [tuple(a) for a in m.layout.axes] == [("dp", 2)]
    for key in ("model.blocks.0.up.weight", "optim.state.model.blocks.0.up.weight.exp_avg"):
        entry = m.tensors[key]
        assert entry.shape == (40, 16) and len(entry.chunks) == 2, key
        assert dict(entry.placement)["dp"].dim == 0, key
    full = runs["k.st"]
    assert {"exp_avg", "exp_avg_sq", "step"} == {
        k.rsplit(".", 1)[1] for k in full if k.startswith("optim.")
    }
    assert all(float(v) == K for k, v in full.items() if k.endswith(".step"))


def test_resume_on_two_ranks_is_bit_exact(runs):
    assert f"resumed from step {K}" in runs["resumed"]
    resumed, fresh = losses(runs["resumed"]), losses(runs["fresh"])
    assert sorted(resumed) == list(range(K + 1, N + 1)) and sorted(fresh) == list(range(1, N + 1))
    assert losses(runs["first"]) == {s: fresh[s] for s in range(1, K + 1)}
    assert resumed == {s: fresh[s] for s in range(K + 1, N + 1)}
    assert_identical(runs["n.st"], runs["f.st"])  # weights and AdamW state


@pytest.mark.parametrize("world", ["three", "one"])
def test_load_on_another_world_size(runs, world):
    """3 FSDP ranks (uneven shards, an empty one for ``head.bias``) and one plain process without
    torchrun read the 2-rank step K into exactly the weights and state the 2 ranks had."""
    assert f"loaded step {K}" in runs[world]
    assert_identical(runs[f"{world}.st"], runs["k.st"])
