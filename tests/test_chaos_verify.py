"""The chaos verifier and the harness's reading of a run's files, on files written by hand: what
a kill leaves (a cut line), a NaN loss, a damaging fault that damaged nothing, a dtype changed
(the adversarial review of the chaos harness).  tests/test_chaos.py has the rest."""


import torch

from resilient.chaos import verify
from resilient.chaos.harness import RunPaths
from resilient.chaos.scenario import Expect, parse_scenario

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
        return verify._compare_final(RunPaths(tmp_path / name), RunPaths(tmp_path / "ref"), 4, exact)

    same = compare("same", ref)
    assert same.ok, same.detail
    double = compare("double", {**ref, "model": {"w": ref["model"]["w"].double()}})
    assert double.ok is False
    assert "model.w is torch.float64 (2,), the reference's torch.float32 (2,)" in double.detail
    counter = compare("counter", {**ref, "optim": {"step": torch.tensor([3.0])}})
    assert counter.ok is False and "optim.step is torch.float32" in counter.detail
    shape = compare("shape", {**ref, "optim": {"step": torch.tensor([[3]])}})
    assert shape.ok is False and "(1, 1), the reference's torch.int64 (1,)" in shape.detail
