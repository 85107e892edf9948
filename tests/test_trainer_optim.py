"""The trainer's AdamW (reference_trainer/optim.py) against torch.optim.AdamW: the same steps bit
for bit, checkpoints that move between the two, and a trainer process that never imports
torch._dynamo (what the class is for)."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reference_trainer.optim import AdamW
from resilient import Checkpointer
from resilient.errors import StateMismatchError

ROOT = Path(__file__).resolve().parents[1]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(11, 6), torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)
    )


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _names(model: torch.nn.Module) -> dict:
    return {p: f"model.{n}" for n, p in model.named_parameters()}


def _step(model: torch.nn.Module, optim, seed: int, lr: float, skip_bias: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (4, 7), generator=g)
    model(tokens).pow(2).mean().backward()
    if skip_bias:  # a parameter without a gradient this step (its state must not move)
        model[2].bias.grad = None
    for group in optim.param_groups:
        group["lr"] = lr
    optim.step()
    optim.zero_grad(set_to_none=True)


def _assert_same(m1, o1, m2, o2) -> None:
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
        s1, s2 = o1.state.get(a, {}), o2.state.get(b, {})
        assert s1.keys() == s2.keys(), n
        for k in s1:
            assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), (n, k)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_steps_are_bit_for_bit_torchs_adamw(amsgrad):
    hp = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": amsgrad}
    m1, m2 = _model(), _model()
    o1 = torch.optim.AdamW(_groups(m1), **hp)
    o2 = AdamW(_groups(m2), names=_names(m2), **hp)
    for step in range(6):
        lr = 1e-2 * (step + 1) / 6  # a schedule changes the groups' lr between steps
        _step(m1, o1, step, lr, skip_bias=step == 2)
        _step(m2, o2, step, lr, skip_bias=step == 2)
        _assert_same(m1, o1, m2, o2)
    for g1, g2 in zip(o1.param_groups, o2.param_groups):  # every hyperparameter torch keeps
        assert {k: v for k, v in g1.items() if k != "params"} == {
            k: v for k, v in g2.items() if k != "params"
        }


def test_checkpoints_move_between_torchs_adamw_and_this_one(tmp_path):
    hp = {"lr": 1e-2, "betas": (0.9, 0.95)}
    m_torch, m_ours = _model(), _model()
    o_torch = torch.optim.AdamW(_groups(m_torch), **hp)
    o_ours = AdamW(_groups(m_ours), names=_names(m_ours), **hp)
    for step in range(2):
        _step(m_torch, o_torch, step, 1e-2)
        _step(m_ours, o_ours, step, 1e-2)
    with Checkpointer(str(tmp_path / "torch")) as ck:
        ck.save(2, {"model": m_torch, "optim": o_torch}).wait()
        keys_torch = set(ck.manifest(2).tensors)
    with Checkpointer(str(tmp_path / "ours")) as ck:
        ck.save(2, {"model": m_ours, "optim": o_ours}).wait()
        keys_ours = set(ck.manifest(2).tensors)
    assert keys_torch == keys_ours and "optim.state.model.1.weight.exp_avg" in keys_ours

    # each checkpoint into a fresh optimizer of the other kind (before its first step): the two
    # continue the same, and the same as the optimizers that were saved
    m_a, m_b = _model(seed=5), _model(seed=6)
    o_a = AdamW(_groups(m_a), names=_names(m_a), lr=0.5)  # hyperparameters come from the load
    o_b = torch.optim.AdamW(_groups(m_b), lr=0.5)
    with Checkpointer(str(tmp_path / "torch")) as ck:
        assert ck.load({"model": m_a, "optim": o_a}) == 2
    with Checkpointer(str(tmp_path / "ours")) as ck:
        assert ck.load({"model": m_b, "optim": o_b}) == 2
    assert o_a.param_groups[0]["lr"] == 1e-2 and o_b.param_groups[0]["lr"] == 1e-2
    _assert_same(m_torch, o_torch, m_a, o_a)
    _assert_same(m_ours, o_ours, m_b, o_b)
    for step in range(2, 4):
        for m, o in ((m_torch, o_torch), (m_a, o_a), (m_b, o_b)):
            _step(m, o, step, 1e-2)
    _assert_same(m_torch, o_torch, m_a, o_a)
    _assert_same(m_torch, o_torch, m_b, o_b)


def test_frozen_parameters_and_view_gradients_as_torch_has_them(tmp_path):
    # a frozen parameter has no state (torch's has none): a torch checkpoint loads
    m_torch, m_ours = _model(), _model(seed=3)
    for m in (m_torch, m_ours):
        m[1].bias.requires_grad_(False)
    o_torch = torch.optim.AdamW(_groups(m_torch), lr=1e-2)
    o_ours = AdamW(_groups(m_ours), names=_names(m_ours), lr=1e-2)
    _step(m_torch, o_torch, 0, 1e-2)
    with Checkpointer(str(tmp_path / "frozen")) as ck:
        ck.save(1, {"model": m_torch, "optim": o_torch}).wait()
        assert ck.load({"model": m_ours, "optim": o_ours}) == 1
    assert m_ours[1].bias not in o_ours.state
    _assert_same(m_torch, o_torch, m_ours, o_ours)
    # zero_grad(set_to_none=False) with a gradient that is a view of another (ZeroAdamW's slices)
    p = torch.nn.Parameter(torch.zeros(4))
    full = torch.arange(8.0)
    p.grad = full.narrow(0, 2, 4)
    AdamW([{"params": [p]}]).zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(4)) and torch.equal(full[2:6], torch.zeros(4))


def test_a_checkpoint_it_cannot_step_is_a_named_error(tmp_path):
    m = _model()
    fused = torch.optim.AdamW(_groups(m), lr=1e-2, foreach=False)
    _step(m, fused, 0, 1e-2)
    fused.param_groups[0]["fused"] = True  # what a fused (GPU) run of torch's AdamW saves
    with Checkpointer(str(tmp_path / "fused")) as ck:
        ck.save(1, {"model": m, "optim": fused}).wait()
        ours = _model(seed=4)
        with pytest.raises(StateMismatchError, match="group 0 was saved with fused=True"):
            ck.load({"model": ours, "optim": AdamW(_groups(ours), names=_names(ours))})


def test_what_it_does_not_do_is_an_error():
    m = _model()
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        AdamW(_groups(m), momentum=0.9)
    with pytest.raises(ValueError, match="fused=True is not supported"):
        AdamW(_groups(m), fused=True)
    with pytest.raises(TypeError, match="needs the parameters' names"):
        AdamW(_groups(m)).state_dict()


@pytest.mark.slow
def test_a_trainer_process_never_imports_torch_dynamo(tmp_path):
    """torch.optim.AdamW and a model built on the meta device import torch._dynamo (about a
    second of CPU per process); the trainer does neither, saves and restores included."""
    script = textwrap.dedent(
        f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        from reference_trainer.config import TrainConfig, preset
        from reference_trainer.train import train
        for zero in (False, True):
            for steps in (2, 3):  # the second run restores the first's step 2
                train(TrainConfig(model=preset("tiny"), steps=steps, save_every=1,
                      memory_every=1, zero=zero, ckpt={str(tmp_path)!r} + f"/z{{zero}}"))
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
        """
    )
    with socket.socket() as s:  # a world of one rank, as torchrun would set it up
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "RESILIENT_MEMORY_ROOT": str(tmp_path / "memory"),
        "OMP_NUM_THREADS": "1",
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
    }
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "no dynamo", proc.stderr[-3000:]


# A hot spare of `resilient launch` warms up, then waits for a rank: here it is told at once that
# the job is over.  argv[1]: the trainer's warm-up, or the default (torch's optimizers').
_SPARE = """
import datetime, json, os, sys
from torch.distributed import TCPStore
from reference_trainer.train import _warm_up_spare
from resilient.launch.injob import base_key, wait_for_rank
os.environ.update(RESILIENT_SPARE="0:0", TORCHELASTIC_RUN_ID="spare-warm-up")
store = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
store.set(f"{base_key()}/assign/0/0", json.dumps({"exit": True}))
assert wait_for_rank(store, warm_up=_warm_up_spare if sys.argv[1] == "trainer" else None) is False
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""


@pytest.mark.parametrize("warm_up, expected", [("trainer", "no dynamo"), ("default", "dynamo")])
def test_a_spare_of_the_trainer_warms_up_without_torch_dynamo(warm_up, expected):
    """The default warm-up imports what torch's optimizers import on first use (torch._dynamo:
    seconds of CPU, taken from the ranks training beside the spare); the trainer's, which never
    needs it, does not."""
    proc = subprocess.run(
        [sys.executable, "-c", _SPARE, warm_up],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == expected, proc.stderr[-3000:]
