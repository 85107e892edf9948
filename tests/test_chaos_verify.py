"""The chaos verifier and the harness's reading of a run's files, on files written by hand: what
a kill leaves (a cut line), a NaN loss, a damaging fault that damaged nothing, a dtype changed
(the adversarial review of the chaos harness).  tests/test_chaos.py has the rest."""

import json
from pathlib import Path

import torch

from resilient.chaos import verify
from resilient.chaos.harness import Launch, RunPaths
from resilient.chaos.scenario import Expect, parse_scenario
from resilient.chaos.verify import Check, verify_run

TRAINER_JOB = """
[job]
nproc = 2
[job.trainer]
steps = 4
save_every = 2
"""


def _scenario(job: str = TRAINER_JOB, faults: str = "", expect: str = ""):
    return parse_scenario(f'name = "t"\n{job}\n{faults}\n[expect]\n{expect}\n', "t.toml")


def test_an_exact_final_state_differs_when_a_tensor_s_dtype_does(tmp_path):
    """torch.equal ignores the dtype: a float64 weight against the reference's float32, or a
    float step counter against an int64 one, was called bit-identical."""
    from resilient import Checkpointer

    ref = {"model": {"w": torch.tensor([1.0, 2.0])}, "optim": {"step": torch.tensor([3])}}
    Checkpointer(str(tmp_path / "ref" / "ckpt")).save(4, ref).wait()
    exact = Expect(final_state="exact")

    def compare(name, state):
        Checkpointer(str(tmp_path / name / "ckpt")).save(4, state).wait()
        return verify._compare_final(
            RunPaths(tmp_path / name), RunPaths(tmp_path / "ref"), 4, exact
        )

    same = compare("same", ref)
    assert same.ok, same.detail
    double = compare("double", {**ref, "model": {"w": ref["model"]["w"].double()}})
    assert double.ok is False
    assert "model.w is torch.float64 (2,), the reference's torch.float32 (2,)" in double.detail
    counter = compare("counter", {**ref, "optim": {"step": torch.tensor([3.0])}})
    assert counter.ok is False and "optim.step is torch.float32" in counter.detail
    shape = compare("shape", {**ref, "optim": {"step": torch.tensor([[3]])}})
    assert shape.ok is False and "(1, 1), the reference's torch.int64 (1,)" in shape.detail


def _write_run(root: Path, losses: list[float], first_step: int = 1) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, first_step):
            r = {"step": i, "loss": loss, "wall_time": 100.0 + i, "samples": [(i - 1) * 8, 8]}
            f.write(json.dumps(r) + "\n")


def _launch(root: Path) -> Launch:
    return Launch(run_dir=str(root), command=[], started=0.0, ended=1.0, exit_codes=[0])


def _loss_check(tmp_path, monkeypatch, run_losses, ref_losses, name):
    monkeypatch.setattr(
        verify,
        "_compare_final",
        lambda *a, **k: Check("final state matches the reference", True, ""),
    )
    ref, run = tmp_path / name / "ref", tmp_path / name / "run"
    _write_run(ref, ref_losses)
    _write_run(run, run_losses)
    out = verify_run(_scenario(), run, _launch(run), ref)
    return next(c for c in out.checks if c.name == "loss curve matches the reference")


def test_a_nan_loss_the_reference_does_not_have_fails_the_loss_curve(tmp_path, monkeypatch):
    """A NaN loss in the faulty run: its difference is NaN, 'nan > worst' is False, and the
    loss curve check said the run matched the reference."""
    nan, inf = float("nan"), float("inf")
    ref = [5.0, 4.0, 3.0, 2.0]
    bad = _loss_check(tmp_path, monkeypatch, [5.0, 4.0, nan, 2.0], ref, "nan")
    assert bad.ok is False and "step 3: loss nan, the reference's 3.0" in bad.detail
    bad = _loss_check(tmp_path, monkeypatch, [5.0, 4.0, 3.0, 2.0], [5.0, inf, 3.0, 2.0], "ref")
    assert bad.ok is False and "step 2: loss 4.0, the reference's inf" in bad.detail
    bad = _loss_check(tmp_path, monkeypatch, [5.0, -inf, 3.0, 2.0], [5.0, inf, 3.0, 2.0], "signs")
    assert bad.ok is False
    # the same non-finite loss on both sides (a reference that diverged too) matches
    same = _loss_check(tmp_path, monkeypatch, [5.0, nan, inf, 2.0], [5.0, nan, inf, 2.0], "same")
    assert same.ok is True, same.detail


def test_a_run_step_the_reference_never_ran_fails_the_loss_curve(tmp_path, monkeypatch):
    bad = _loss_check(tmp_path, monkeypatch, [5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0], "extra")
    assert bad.ok is False and "steps [4, 5] have no reference step (it ran 1..3)" in bad.detail
